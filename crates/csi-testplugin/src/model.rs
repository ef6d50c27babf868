//! Version-neutral vocabulary shared by the core [`crate::plugin::Plugin`] and
//! the v1/v0 adapters: API versions, volume capabilities, access modes, and
//! gRPC code names.
//!
//! Owns: the plugin's own model of a `VolumeCapability` (parsed once from
//! either protobuf flavour) and the rules for which capabilities this plugin
//! supports. Must not: know about protobuf types (the adapters convert), or
//! touch the file system.

use std::fmt;

use serde::{Deserialize, Serialize};
use tonic::{Code, Status};

/// The CSI API flavour a call arrived on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ApiVersion {
    /// CSI 1.x, package `csi.v1`.
    V1,
    /// CSI 0.3, package `csi.v0`, with `NodeGetInfo` (and `NodeGetId`).
    V0_3,
    /// CSI 0.2, package `csi.v0`, with `NodeGetId` only and no Probe `ready`.
    V0_2,
}

impl ApiVersion {
    /// The spelling used on the command line and in the call log.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::V1 => "v1",
            Self::V0_3 => "v0.3",
            Self::V0_2 => "v0.2",
        }
    }

    /// Parses `v1`, `v0.3` or `v0.2`.
    pub fn parse(s: &str) -> Option<Self> {
        match s.trim() {
            "v1" => Some(Self::V1),
            "v0.3" => Some(Self::V0_3),
            "v0.2" => Some(Self::V0_2),
            _ => None,
        }
    }

    /// Whether this is one of the CSI 0.x flavours.
    pub fn is_v0(self) -> bool {
        !matches!(self, Self::V1)
    }
}

/// How a volume is accessed. `Block` is served only with `--block`; without it, it is
/// parsed so that it can be refused with the right error code.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AccessType {
    Mount {
        fs_type: String,
        mount_flags: Vec<String>,
    },
    Block,
}

// Mount flags MAY carry sensitive information (spec: "the CO and the Plugin
// MUST NOT leak this information to untrusted entities"), so Debug never
// prints them.
impl fmt::Debug for AccessType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Mount {
                fs_type,
                mount_flags,
            } => f
                .debug_struct("Mount")
                .field("fs_type", fs_type)
                .field(
                    "mount_flags",
                    &format_args!("<{} flags>", mount_flags.len()),
                )
                .finish(),
            Self::Block => f.write_str("Block"),
        }
    }
}

/// A CSI access mode (the union of the v1 and v0 enums).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum AccessMode {
    SingleNodeWriter,
    SingleNodeReaderOnly,
    MultiNodeReaderOnly,
    MultiNodeSingleWriter,
    MultiNodeMultiWriter,
    SingleNodeSingleWriter,
    SingleNodeMultiWriter,
}

impl AccessMode {
    /// Maps the protobuf enum value (identical numbering in v1 and v0 for
    /// 1..=5; 6 and 7 exist only in v1). `UNKNOWN` (0) and unknown values are
    /// `None`.
    pub fn from_i32(v: i32, version: ApiVersion) -> Option<Self> {
        match v {
            1 => Some(Self::SingleNodeWriter),
            2 => Some(Self::SingleNodeReaderOnly),
            3 => Some(Self::MultiNodeReaderOnly),
            4 => Some(Self::MultiNodeSingleWriter),
            5 => Some(Self::MultiNodeMultiWriter),
            6 if version == ApiVersion::V1 => Some(Self::SingleNodeSingleWriter),
            7 if version == ApiVersion::V1 => Some(Self::SingleNodeMultiWriter),
            _ => None,
        }
    }

    /// `MULTI_NODE_...` modes may be node-published at several targets.
    pub fn is_multi_node(self) -> bool {
        matches!(
            self,
            Self::MultiNodeReaderOnly | Self::MultiNodeSingleWriter | Self::MultiNodeMultiWriter
        )
    }

    /// Modes that only allow reading: such a volume is always mounted
    /// read-only, whatever `readonly` says.
    pub fn is_read_only(self) -> bool {
        matches!(self, Self::SingleNodeReaderOnly | Self::MultiNodeReaderOnly)
    }
}

/// A parsed, well-formed volume capability (it may still be unsupported; see
/// [`Capability::unsupported_reason_for`]).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Capability {
    pub access: AccessType,
    pub mode: AccessMode,
}

impl Capability {
    /// Whether this is the block access type.
    pub fn is_block(&self) -> bool {
        matches!(self.access, AccessType::Block)
    }

    /// Why this plugin cannot serve this capability, if it cannot.
    ///
    /// The plugin bind-mounts directories, so it serves the mount access type
    /// (any `fs_type` and `mount_flags` are accepted and ignored) in every
    /// single-node and multi-node mode of CSI 0.x/1.0. The two
    /// `SINGLE_NODE_*_WRITER` modes are refused because they belong to the
    /// `SINGLE_NODE_MULTI_WRITER` capability, which this plugin does not
    /// advertise. The block access type is served only when `block` is true (`--block`,
    /// loop devices).
    pub fn unsupported_reason_for(&self, block: bool) -> Option<Unsupported> {
        if !block && matches!(self.access, AccessType::Block) {
            return Some(Unsupported::Block);
        }
        if matches!(
            self.mode,
            AccessMode::SingleNodeSingleWriter | AccessMode::SingleNodeMultiWriter
        ) {
            return Some(Unsupported::MultiWriterMode(self.mode));
        }
        None
    }
}

/// A capability argument as received: the adapters report a missing or
/// malformed capability as an `INVALID_ARGUMENT` status, which the core
/// returns at the point where the spec's field order puts it.
pub type CapArg = Result<Capability, Status>;

/// The canonical upper-case gRPC code name (`INVALID_ARGUMENT`, ...), as used
/// in the call log and in fault files.
pub fn code_name(code: Code) -> &'static str {
    match code {
        Code::Ok => "OK",
        Code::Cancelled => "CANCELLED",
        Code::Unknown => "UNKNOWN",
        Code::InvalidArgument => "INVALID_ARGUMENT",
        Code::DeadlineExceeded => "DEADLINE_EXCEEDED",
        Code::NotFound => "NOT_FOUND",
        Code::AlreadyExists => "ALREADY_EXISTS",
        Code::PermissionDenied => "PERMISSION_DENIED",
        Code::ResourceExhausted => "RESOURCE_EXHAUSTED",
        Code::FailedPrecondition => "FAILED_PRECONDITION",
        Code::Aborted => "ABORTED",
        Code::OutOfRange => "OUT_OF_RANGE",
        Code::Unimplemented => "UNIMPLEMENTED",
        Code::Internal => "INTERNAL",
        Code::Unavailable => "UNAVAILABLE",
        Code::DataLoss => "DATA_LOSS",
        Code::Unauthenticated => "UNAUTHENTICATED",
    }
}

/// Parses a gRPC code given by name (any case, as [`code_name`] spells it) or
/// by number.
pub fn parse_code(s: &str) -> Option<Code> {
    if let Ok(n) = s.trim().parse::<i32>() {
        return (0..=16).contains(&n).then(|| Code::from(n));
    }
    let upper = s.trim().to_ascii_uppercase();
    (0..=16).map(Code::from).find(|c| code_name(*c) == upper)
}

/// Validates a volume name (which is also its id and its directory name).
///
/// The id becomes a single path component under `<work-dir>/volumes`, so it
/// must not be empty, `.`, `..`, contain `/` or NUL, and it is bounded by the
/// spec's general string size limit ("128 bytes | string").
pub fn validate_volume_name(name: &str) -> Result<(), VolumeNameError> {
    if name.is_empty() {
        return Err(VolumeNameError::Empty);
    }
    if name.len() > 128 {
        return Err(VolumeNameError::TooLong { len: name.len() });
    }
    if name == "." || name == ".." {
        return Err(VolumeNameError::DotName {
            name: name.to_owned(),
        });
    }
    if name.contains('/') || name.contains('\0') {
        return Err(VolumeNameError::BadCharacter);
    }
    Ok(())
}

/// Why a volume name is refused ([`validate_volume_name`]).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum VolumeNameError {
    #[error("volume name must not be empty")]
    Empty,
    #[error("volume name is {len} bytes; the CSI size limit for strings is 128 bytes")]
    TooLong { len: usize },
    #[error("volume name {name:?} is not allowed")]
    DotName { name: String },
    #[error("volume name must not contain '/' or NUL")]
    BadCharacter,
}

/// Why this plugin cannot serve a capability ([`Capability::unsupported_reason_for`]); the
/// message is what the plugin answers.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Unsupported {
    #[error("block access type is not supported (mount only; start the plugin with --block)")]
    Block,
    #[error(
        "access mode {0:?} needs the SINGLE_NODE_MULTI_WRITER capability, which this plugin does not advertise"
    )]
    MultiWriterMode(AccessMode),
    /// A volume stays the access type it was created for (`--block`).
    #[error("the volume was created for {volume} access; it cannot be used with {asked} access")]
    OtherAccessType {
        volume: &'static str,
        asked: &'static str,
    },
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn code_names_round_trip() {
        for n in 0..=16 {
            let c = Code::from(n);
            assert_eq!(parse_code(code_name(c)), Some(c));
            assert_eq!(parse_code(&n.to_string()), Some(c));
        }
        assert_eq!(parse_code("unavailable"), Some(Code::Unavailable));
        assert_eq!(parse_code("NOPE"), None);
        assert_eq!(parse_code("17"), None);
    }

    #[test]
    fn volume_names() {
        assert!(validate_volume_name("vol-1").is_ok());
        assert!(validate_volume_name(&"a".repeat(128)).is_ok());
        assert!(validate_volume_name(&"a".repeat(129)).is_err());
        for bad in ["", ".", "..", "a/b", "a\0b"] {
            assert!(validate_volume_name(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn debug_hides_mount_flags() {
        let a = AccessType::Mount {
            fs_type: "ext4".into(),
            mount_flags: vec!["password=hunter2".into()],
        };
        let s = format!("{a:?}");
        assert!(!s.contains("hunter2"), "{s}");
    }
}
