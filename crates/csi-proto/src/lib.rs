//! CSI wire definitions for csi-agent: the Container Storage Interface
//! protobuf messages and the tonic gRPC clients and servers, for CSI v1
//! ([`v1`], package `csi.v1`) and CSI 0.3/0.2 ([`v0`], package `csi.v0`).
//!
//! This crate owns the `.proto` files (written in this repository from the
//! facts of the CSI specification) and the code generated from them at build
//! time with `protox` and `tonic-prost-build`; it contains no logic.
//!
//! Both packages provide, for each of the Identity, Controller and Node
//! services, a client (`v1::node_client::NodeClient`, ...) and a server
//! (`v1::node_server::{Node, NodeServer}`, ...).
//!
//! # Secrets
//!
//! Every message that carries secrets (any field whose name contains
//! `secrets`, e.g. `secrets` in v1, `node_stage_secrets` in v0) has a
//! `Debug` implementation that prints those fields as
//! `<redacted N entries>` instead of their content. The list of such
//! messages is `v1::REDACTED_DEBUG_MESSAGES` / `v0::REDACTED_DEBUG_MESSAGES`.
//! The wire encoding is not affected.

/// CSI v1 (package `csi.v1`): Identity, Controller and Node services.
// Generated code: keep future clippy/rustc lint additions from failing CI.
#[allow(
    missing_docs,
    clippy::all,
    clippy::pedantic,
    clippy::nursery,
    clippy::unwrap_used,
    clippy::expect_used
)]
pub mod v1 {
    tonic::include_proto!("csi.v1");
    include!(concat!(env!("OUT_DIR"), "/csi.v1.redacted_debug.rs"));
}

/// CSI 0.3 (package `csi.v0`), which also serves 0.2 plugins: it includes
/// the 0.2 `NodeGetId` RPC next to the 0.3 `NodeGetInfo`.
// Generated code: keep future clippy/rustc lint additions from failing CI.
#[allow(
    missing_docs,
    clippy::all,
    clippy::pedantic,
    clippy::nursery,
    clippy::unwrap_used,
    clippy::expect_used
)]
pub mod v0 {
    tonic::include_proto!("csi.v0");
    include!(concat!(env!("OUT_DIR"), "/csi.v0.redacted_debug.rs"));
}

/// The encoded `google.protobuf.FileDescriptorSet` of both CSI packages and
/// their imports (e.g. for gRPC server reflection).
pub const FILE_DESCRIPTOR_SET: &[u8] =
    include_bytes!(concat!(env!("OUT_DIR"), "/csi_file_descriptor_set.bin"));

/// Helpers used by the generated `Debug` implementations.
mod redact {
    use core::fmt;

    /// Stands in for a secret value in `Debug` output.
    pub(crate) enum Redacted {
        Entries(usize),
        Value,
    }

    impl Redacted {
        pub(crate) fn entries(n: usize) -> Self {
            Self::Entries(n)
        }

        #[allow(dead_code)]
        pub(crate) fn value() -> Self {
            Self::Value
        }
    }

    impl fmt::Debug for Redacted {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            match self {
                Self::Entries(1) => f.write_str("<redacted 1 entry>"),
                Self::Entries(n) => write!(f, "<redacted {n} entries>"),
                Self::Value => f.write_str("<redacted>"),
            }
        }
    }
}
