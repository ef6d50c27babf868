//! Compiles etcd's `etcdserverpb/rpc.proto` (and the files it imports, all under `proto/`) with
//! `protox` (pure Rust: a fresh machine needs no `protoc`) and generates prost messages plus tonic
//! **clients only** from the resulting `FileDescriptorSet`, the same way `csi-proto` does.

use std::error::Error;
use std::path::PathBuf;

use prost::Message as _;

/// The one root file; `protox` follows its imports inside `proto/`.
const ROOT_PROTO: &str = "etcd/api/etcdserverpb/rpc.proto";

fn main() -> Result<(), Box<dyn Error>> {
    let manifest_dir = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR")?);
    let proto_root = manifest_dir.join("proto");

    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed={}", proto_root.display());

    let fds = protox::compile([ROOT_PROTO], [&proto_root])?;
    for file in &fds.file {
        // Only files on disk: protox supplies google/protobuf/*.proto itself, and a path
        // that does not exist makes cargo rebuild this crate (and all above it) every time.
        if let Some(name) = &file.name
            && proto_root.join(name).exists()
        {
            println!("cargo:rerun-if-changed={}", proto_root.join(name).display());
        }
    }

    // Kept for the test that compares every field the client uses with etcd 3.4's own protos.
    let out_dir = PathBuf::from(std::env::var("OUT_DIR")?);
    std::fs::write(
        out_dir.join("etcd_file_descriptor_set.bin"),
        fds.encode_to_vec(),
    )?;

    tonic_prost_build::configure()
        .build_client(true)
        .build_server(false)
        .compile_fds(fds)?;
    Ok(())
}
