//! The test plugin as a container: its root file system (the `csi-testplugin` binary with the
//! shared libraries and loader `ldd` lists) as a layer tar or an unpacked dir, and OCI image
//! layouts (`oci-layout`, `index.json`, `blobs/sha256/…`) of such layers.
//!
//! One source, included by `#[path]` wherever it is needed, so that the demo and the tests
//! build the same image: the `csi-testplugin-image` binary (`./scripts/demo --oci` and
//! `--image`), the test kit's registry support (`csi-agent-testkit/src/registry`, which
//! the image tests and the bench use in turn). It therefore uses only crates all of them
//! have (`anyhow`, `tar`, `sha2`, `serde_json`) and the standard library.
//!
//! Must not: start or talk to anything (registries, skopeo, the daemon), compress (a plain tar
//! is a valid OCI layer; callers gzip their own layers if they want), or panic on the files it
//! reads: every error names the file.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, bail};
use sha2::{Digest as _, Sha256};

/// Where the binary sits in the image's root, and the image's `Entrypoint`.
pub const PLUGIN_PATH: &str = "/bin/csi-testplugin";

/// The files a dynamically linked binary needs, as `ldd` lists them (the loader included);
/// none for a static one.
pub fn shared_libraries(binary: &Path) -> anyhow::Result<Vec<PathBuf>> {
    let out = Command::new("ldd")
        .arg(binary)
        .output()
        .with_context(|| format!("running ldd on {} (is ldd installed?)", binary.display()))?;
    let text = String::from_utf8_lossy(&out.stdout);
    // glibc's ldd says so on stdout (exit 0) or on stderr (exit 1), depending on the binary.
    let said =
        |what: &str| text.contains(what) || String::from_utf8_lossy(&out.stderr).contains(what);
    if said("statically linked") || said("not a dynamic executable") {
        return Ok(Vec::new());
    }
    if !out.status.success() {
        bail!(
            "ldd {}: {}",
            binary.display(),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(text
        .lines()
        .filter_map(|line| {
            let path = match line.split_once("=>") {
                Some((_, rest)) => rest.split_whitespace().next()?,
                None => line.split_whitespace().next()?,
            };
            path.starts_with('/').then(|| PathBuf::from(path))
        })
        .collect())
}

/// A plain tar: `binary` at `bin/csi-testplugin` plus its libraries and loader at their
/// paths, all root-owned, mode 0755.
pub fn plugin_layer(binary: &Path) -> anyhow::Result<Vec<u8>> {
    let mut builder = tar::Builder::new(Vec::new());
    let mut add = |path: &str, source: &Path| -> anyhow::Result<()> {
        // The file itself (ldd's path may be a symlink on the host), at the path the loader
        // and the binary ask for.
        let file = std::fs::File::open(source)
            .with_context(|| format!("opening {} for the plugin layer", source.display()))?;
        let len = file
            .metadata()
            .with_context(|| format!("reading {}'s size", source.display()))?
            .len();
        let mut header = tar::Header::new_gnu();
        header.set_entry_type(tar::EntryType::Regular);
        header.set_mode(0o755);
        header.set_uid(0);
        header.set_gid(0);
        header.set_size(len);
        builder
            .append_data(&mut header, path, file)
            .with_context(|| format!("adding {} to the plugin layer", source.display()))
    };
    add(PLUGIN_PATH.trim_start_matches('/'), binary)?;
    for library in shared_libraries(binary)? {
        add(library.to_string_lossy().trim_start_matches('/'), &library)?;
    }
    builder
        .into_inner()
        .context("finishing the plugin layer's tar")
}

/// [`plugin_layer`] unpacked into `dir` (created): a root file system for
/// `"runtime": {"kind": "oci", "rootfs": DIR}`. The runtime makes the mount points it needs.
pub fn write_rootfs(binary: &Path, dir: &Path) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let layer = plugin_layer(binary)?;
    tar::Archive::new(layer.as_slice())
        .unpack(dir)
        .with_context(|| format!("unpacking the plugin layer into {}", dir.display()))
}

/// The test plugin's image as an OCI layout at `layout`: [`plugin_layer`] of `binary`, run by
/// its `Entrypoint` ([`PLUGIN_PATH`]) with `cmd` as `Cmd` and `env` (`NAME=value`) as `Env`.
pub fn plugin_image(
    layout: &Path,
    binary: &Path,
    cmd: &[String],
    env: &[String],
) -> anyhow::Result<Image> {
    oci_layout(
        layout,
        &[plugin_layer(binary)?],
        serde_json::json!({"Entrypoint": [PLUGIN_PATH], "Cmd": cmd, "Env": env}),
    )
}

/// The hex sha256 of `bytes`.
pub fn sha256_hex(bytes: &[u8]) -> String {
    let out = Sha256::digest(bytes);
    out.iter().map(|b| format!("{b:02x}")).collect()
}

/// What [`oci_layout`] wrote.
#[derive(Clone, Debug)]
pub struct Image {
    pub manifest_hex: String,
    pub config_hex: String,
    pub layer_hexes: Vec<String>,
}

/// Writes an OCI image layout at `dir` with `layers` (gzipped or plain tars) and an image
/// config with the given `config` section (Entrypoint, Cmd, Env, WorkingDir...).
pub fn oci_layout(
    dir: &Path,
    layers: &[Vec<u8>],
    config: serde_json::Value,
) -> anyhow::Result<Image> {
    let mut with_ids = Vec::with_capacity(layers.len());
    for layer in layers {
        // Gzipped, or a plain tar (big layers: no time spent compressing in a test).
        let diff_id = if layer.starts_with(&[0x1f, 0x8b]) {
            let mut plain = Vec::new();
            std::io::Read::read_to_end(
                &mut flate2::read::GzDecoder::new(layer.as_slice()),
                &mut plain,
            )
            .context("a layer starting with gzip's magic is not valid gzip")?;
            sha256_hex(&plain)
        } else {
            sha256_hex(layer)
        };
        with_ids.push((layer.as_slice(), diff_id));
    }
    oci_layout_with_diff_ids(dir, &with_ids, config)
}

/// [`oci_layout`] with each layer's diff id (the hex sha256 of its uncompressed tar) given,
/// for layers too large to decompress in memory (a gzip bomb). Layers may repeat.
pub fn oci_layout_with_diff_ids(
    dir: &Path,
    layers: &[(&[u8], String)],
    config: serde_json::Value,
) -> anyhow::Result<Image> {
    let blobs = dir.join("blobs/sha256");
    std::fs::create_dir_all(&blobs).with_context(|| format!("creating {}", blobs.display()))?;
    let put = |bytes: &[u8]| -> anyhow::Result<String> {
        let hex = sha256_hex(bytes);
        let path = blobs.join(&hex);
        std::fs::write(&path, bytes).with_context(|| format!("writing {}", path.display()))?;
        Ok(hex)
    };
    let mut diff_ids = Vec::new();
    let mut layer_descs = Vec::new();
    let mut layer_hexes = Vec::new();
    for (layer, diff_id) in layers {
        let gzip = layer.starts_with(&[0x1f, 0x8b]);
        diff_ids.push(format!("sha256:{diff_id}"));
        let hex = put(layer)?;
        layer_descs.push(serde_json::json!({
            "mediaType": if gzip {
                "application/vnd.oci.image.layer.v1.tar+gzip"
            } else {
                "application/vnd.oci.image.layer.v1.tar"
            },
            "digest": format!("sha256:{hex}"),
            "size": layer.len(),
        }));
        layer_hexes.push(hex);
    }
    let config_json = serde_json::to_vec(&serde_json::json!({
        "architecture": host_architecture(),
        "os": "linux",
        "config": config,
        "rootfs": {"type": "layers", "diff_ids": diff_ids},
    }))?;
    let config_hex = put(&config_json)?;
    let manifest = serde_json::to_vec(&serde_json::json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {
            "mediaType": "application/vnd.oci.image.config.v1+json",
            "digest": format!("sha256:{config_hex}"),
            "size": config_json.len(),
        },
        "layers": layer_descs,
    }))?;
    let manifest_hex = put(&manifest)?;
    let write = |name: &str, bytes: &[u8]| -> anyhow::Result<()> {
        let path = dir.join(name);
        std::fs::write(&path, bytes).with_context(|| format!("writing {}", path.display()))
    };
    write("oci-layout", br#"{"imageLayoutVersion": "1.0.0"}"#)?;
    write(
        "index.json",
        &serde_json::to_vec(&serde_json::json!({
            "schemaVersion": 2,
            "manifests": [{
                "mediaType": "application/vnd.oci.image.manifest.v1+json",
                "digest": format!("sha256:{manifest_hex}"),
                "size": manifest.len(),
            }],
        }))?,
    )?;
    Ok(Image {
        manifest_hex,
        config_hex,
        layer_hexes,
    })
}

/// The OCI name of this build's architecture (the daemon runs only images of its own).
fn host_architecture() -> &'static str {
    match std::env::consts::ARCH {
        "x86_64" => "amd64",
        "aarch64" => "arm64",
        other => other,
    }
}
