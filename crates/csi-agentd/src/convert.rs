//! Conversions between the API's JSON types (`csi_agent_api`) and the engine's types, and the
//! mapping of engine errors onto the one API error shape. Pure functions; no I/O.

use std::path::Path;

use csi_agent::client::{RpcErrorKind, code_name};
use csi_agent::cluster::ClusterError;
use csi_agent::image::blobs::BlobError;
use csi_agent::image::import::ImportError;
use csi_agent::image::pull::PullError;
use csi_agent::image::store::ImageStoreError;
use csi_agent::server::ServerError;
use csi_agent::volume::progress::Progress;
use csi_agent::volume::{AccessMode, AccessType, Capability, Origin, VolumeError, VolumeRecord};
use csi_agent_api as api;

/// An API error: status from its code, the one JSON shape.
#[derive(Debug)]
pub struct ApiFailure(pub api::ErrorBody);

impl ApiFailure {
    pub fn new(code: api::ErrorCode, message: impl Into<String>) -> Self {
        Self(api::ErrorBody {
            code,
            message: message.into(),
            grpc_code: None,
        })
    }

    pub fn invalid(message: impl Into<String>) -> Self {
        Self::new(api::ErrorCode::InvalidRequest, message)
    }
}

impl From<VolumeError> for ApiFailure {
    fn from(err: VolumeError) -> Self {
        let message = err.to_string();
        match &err {
            VolumeError::InvalidRequest(_) | VolumeError::NotServed { .. } => {
                Self::new(api::ErrorCode::InvalidRequest, message)
            }
            VolumeError::Conflict(_) => Self::new(api::ErrorCode::Conflict, message),
            VolumeError::Unsupported { .. } => Self::new(api::ErrorCode::Unsupported, message),
            VolumeError::Plugin(rpc) => {
                let code = if rpc.is_transient() {
                    api::ErrorCode::Unavailable
                } else {
                    api::ErrorCode::PluginError
                };
                Self(api::ErrorBody {
                    code,
                    message,
                    // Only what the plugin itself answered: an exit, a refused socket or a
                    // deadline is not a code the plugin said.
                    grpc_code: matches!(rpc.kind, RpcErrorKind::Status { .. })
                        .then(|| code_name(rpc.code()).to_owned()),
                })
            }
            VolumeError::Protocol(_) => Self::new(api::ErrorCode::PluginProtocol, message),
            VolumeError::Bind(bind) if bind.is_invalid_request() => {
                Self::new(api::ErrorCode::InvalidRequest, message)
            }
            VolumeError::Bind(bind) if bind.is_conflict() => {
                Self::new(api::ErrorCode::Conflict, message)
            }
            VolumeError::Bind(_) => Self::new(api::ErrorCode::Internal, message),
            VolumeError::Store(_)
            | VolumeError::StoreRead(_)
            | VolumeError::Io { .. }
            | VolumeError::Mounts(_)
            | VolumeError::Failpoint(_) => Self::new(api::ErrorCode::Internal, message),
            VolumeError::Draining(_) => Self::new(api::ErrorCode::Unavailable, message),
            VolumeError::Cluster(cluster) => Self::new(cluster_code(cluster), message),
            // Only a drive going down meets it; an unpublish answers success (released here).
            VolumeError::ClusterReleasePending(_) => {
                Self::new(api::ErrorCode::Unavailable, message)
            }
        }
    }
}

/// A cluster refusal's code: 503 when etcd (or the node's session) cannot answer now, 400
/// for a bad fence request, 409 for every hold that stands in the way (it names the holder).
/// Exhaustive: a new variant must be given its code here.
pub fn cluster_code(err: &ClusterError) -> api::ErrorCode {
    match err {
        _ if err.is_unavailable() => api::ErrorCode::Unavailable,
        ClusterError::BadFence { .. } => api::ErrorCode::InvalidRequest,
        // The plugin refused the leader's step, as a refusal to this node's own RPC is.
        ClusterError::LeaderRefused { .. } => api::ErrorCode::PluginError,
        ClusterError::Held { .. }
        | ClusterError::OtherCapability { .. }
        | ClusterError::OtherReadonly { .. }
        | ClusterError::Lost { .. }
        | ClusterError::Unreadable { .. }
        | ClusterError::TooManyNodes { .. }
        | ClusterError::Contention { .. }
        | ClusterError::Alive { .. }
        | ClusterError::DeleteInUse { .. }
        | ClusterError::BeingDeleted { .. } => api::ErrorCode::Conflict,
        ClusterError::Unavailable { .. }
        | ClusterError::Deposed { .. }
        | ClusterError::Store(_) => api::ErrorCode::Internal,
    }
}

impl From<ClusterError> for ApiFailure {
    fn from(err: ClusterError) -> Self {
        Self::new(cluster_code(&err), err.to_string())
    }
}

impl From<ServerError> for ApiFailure {
    fn from(err: ServerError) -> Self {
        match err {
            ServerError::Volume(v) => v.into(),
            ServerError::UnknownPlugin { .. } => {
                Self::new(api::ErrorCode::NotFound, err.to_string())
            }
            ServerError::PluginConfig { .. } => {
                Self::new(api::ErrorCode::InvalidRequest, err.to_string())
            }
            ServerError::PluginInit { .. } => {
                Self::new(api::ErrorCode::Unavailable, err.to_string())
            }
            ServerError::Store(_) => Self::new(api::ErrorCode::Internal, err.to_string()),
            ServerError::Drained => Self::new(api::ErrorCode::Unavailable, err.to_string()),
            ServerError::PruneUnsafe { .. } => Self::new(api::ErrorCode::Conflict, err.to_string()),
            ServerError::ClusterIdentity { .. } => {
                Self::new(api::ErrorCode::Internal, err.to_string())
            }
            ServerError::NoCluster => Self::new(api::ErrorCode::NotFound, err.to_string()),
            ServerError::Cluster(cluster) => (*cluster).into(),
            ServerError::ImagesUnavailable
            | ServerError::ImageStore(_)
            | ServerError::ListComponents { .. } => {
                Self::new(api::ErrorCode::Internal, err.to_string())
            }
        }
    }
}

/// A failed pull or preparation: not found → 404, transient (unreachable, timeouts, disk) →
/// 503, an image that cannot be used (refused credentials, digest mismatch, unsupported,
/// hostile) → 400. Exhaustive: a new variant must be given its code here.
impl From<ImageStoreError> for ApiFailure {
    fn from(err: ImageStoreError) -> Self {
        let code = match &err {
            ImageStoreError::Pull(PullError::NotFound { .. }) => api::ErrorCode::NotFound,
            ImageStoreError::Pull(pull) => transient_or_invalid(pull.is_transient()),
            ImageStoreError::Unpack { source, .. } => transient_or_invalid(source.is_transient()),
            ImageStoreError::Blob(_) | ImageStoreError::Io(_) | ImageStoreError::Task(_) => {
                api::ErrorCode::Unavailable
            }
            ImageStoreError::Config { .. } | ImageStoreError::IndexCorrupt { .. } => {
                api::ErrorCode::InvalidRequest
            }
        };
        // Every variant's message already includes its cause.
        Self::new(code, err.to_string())
    }
}

/// The code of a refused image import: the same archive may import later (a full disk, an
/// I/O error of the store) → 503; a hostile or malformed archive → 400. The route adds its
/// HTTP-level statuses (413 too large, 408 stalled). Exhaustive, like the others.
pub fn import_code(err: &ImportError) -> api::ErrorCode {
    match err {
        ImportError::Store(store) => transient_or_invalid(store.is_transient()),
        ImportError::Blob { source, .. } => {
            transient_or_invalid(matches!(source, BlobError::Io(_)))
        }
        ImportError::Task(_) => api::ErrorCode::Unavailable,
        ImportError::Read { .. }
        | ImportError::TooLarge { .. }
        | ImportError::UnsafeName { .. }
        | ImportError::UnsupportedEntry { .. }
        | ImportError::Duplicate { .. }
        | ImportError::TooMany { .. }
        | ImportError::JsonTooLarge { .. }
        | ImportError::Malformed { .. }
        | ImportError::UnknownFormat
        | ImportError::Missing { .. }
        | ImportError::BlobMismatch { .. }
        | ImportError::SizeMismatch { .. }
        | ImportError::UnsupportedMediaType { .. }
        | ImportError::Manifest { .. }
        | ImportError::Unnamed { .. }
        | ImportError::Ambiguous { .. }
        | ImportError::Reference { .. }
        | ImportError::PinnedDigest { .. } => api::ErrorCode::InvalidRequest,
    }
}

fn transient_or_invalid(transient: bool) -> api::ErrorCode {
    if transient {
        api::ErrorCode::Unavailable
    } else {
        api::ErrorCode::InvalidRequest
    }
}

const ACCESS_MODES: [(&str, AccessMode); 7] = [
    ("SINGLE_NODE_WRITER", AccessMode::SingleNodeWriter),
    ("SINGLE_NODE_READER_ONLY", AccessMode::SingleNodeReaderOnly),
    ("MULTI_NODE_READER_ONLY", AccessMode::MultiNodeReaderOnly),
    (
        "MULTI_NODE_SINGLE_WRITER",
        AccessMode::MultiNodeSingleWriter,
    ),
    ("MULTI_NODE_MULTI_WRITER", AccessMode::MultiNodeMultiWriter),
    (
        "SINGLE_NODE_SINGLE_WRITER",
        AccessMode::SingleNodeSingleWriter,
    ),
    (
        "SINGLE_NODE_MULTI_WRITER",
        AccessMode::SingleNodeMultiWriter,
    ),
];

pub fn access_mode(name: &str) -> Result<AccessMode, ApiFailure> {
    ACCESS_MODES
        .iter()
        .find(|(n, _)| *n == name)
        .map(|(_, m)| *m)
        .ok_or_else(|| {
            let valid: Vec<&str> = ACCESS_MODES.iter().map(|(n, _)| *n).collect();
            ApiFailure::invalid(format!(
                "capability.access_mode {name:?} is not a CSI access mode; use one of {}",
                valid.join(", ")
            ))
        })
}

pub fn access_mode_name(mode: AccessMode) -> &'static str {
    ACCESS_MODES
        .iter()
        .find(|(_, m)| *m == mode)
        .map(|(n, _)| *n)
        .unwrap_or("UNKNOWN")
}

pub fn capability(spec: &api::CapabilitySpec) -> Result<Capability, ApiFailure> {
    let access_type = match (&spec.mount, &spec.block) {
        (Some(mount), None) => AccessType::Mount {
            fs_type: mount.fs_type.clone(),
            mount_flags: mount.mount_flags.clone(),
        },
        (None, Some(_)) => AccessType::Block {},
        _ => {
            return Err(ApiFailure::invalid(
                "capability needs exactly one of \"mount\": {...} or \"block\": {}",
            ));
        }
    };
    Ok(Capability {
        access_type,
        access_mode: access_mode(&spec.access_mode)?,
    })
}

pub fn capability_spec(capability: &Capability) -> api::CapabilitySpec {
    let (mount, block) = match &capability.access_type {
        AccessType::Mount {
            fs_type,
            mount_flags,
        } => (
            Some(api::MountSpec {
                fs_type: fs_type.clone(),
                mount_flags: mount_flags.clone(),
            }),
            None,
        ),
        AccessType::Block {} => (None, Some(api::BlockSpec {})),
    };
    api::CapabilitySpec {
        mount,
        block,
        access_mode: access_mode_name(capability.access_mode).to_owned(),
    }
}

/// `path` relative to the work dir (what an agent with another work dir can resolve).
pub fn relative(work_dir: &Path, path: &Path) -> String {
    path.strip_prefix(work_dir)
        .unwrap_or(path)
        .to_string_lossy()
        .into_owned()
}

pub fn volume_info(
    plugin: &str,
    record: &VolumeRecord,
    progress: Option<Progress>,
    target_path: &Path,
    work_dir: &Path,
) -> api::VolumeInfo {
    api::VolumeInfo {
        plugin: plugin.to_owned(),
        volume_id: record.volume_id.clone(),
        state: record.state.as_str().to_owned(),
        claims: record.claims.iter().cloned().collect(),
        capability: record.capability.as_ref().map(capability_spec),
        readonly: record.readonly,
        volume_context: record.volume_context.clone(),
        target_path: target_path.to_string_lossy().into_owned(),
        target_path_relative: relative(work_dir, target_path),
        origin: match record.origin {
            Origin::Created => "created",
            Origin::PreProvisioned => "pre_provisioned",
        }
        .to_owned(),
        has_secrets: record.has_secrets,
        last_error: record.last_error.clone(),
        operation: progress.map(operation_info),
        capacity_bytes: (record.capacity_bytes > 0).then_some(record.capacity_bytes),
        expansion: record.expansion.as_ref().map(|e| api::ExpansionInfo {
            capacity_bytes: e.capacity_bytes,
            next_step: e.next.as_str().to_owned(),
        }),
        condition: None,
        accessible_topology: record.accessible_topology.clone(),
        controller: None,
    }
}

fn operation_info(progress: Progress) -> api::OperationInfo {
    api::OperationInfo {
        operation: progress.operation.to_owned(),
        step: progress.step.map(str::to_owned),
        attempt: progress.attempt,
        last_error: progress.last_error,
        next_retry_at_unix_ms: progress.next_retry_at.and_then(|at| {
            at.duration_since(std::time::UNIX_EPOCH)
                .ok()
                .map(|since| since.as_millis() as u64)
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn image_errors_map_to_their_codes() {
        let code = |err: ImageStoreError| ApiFailure::from(err).0.code;
        assert_eq!(
            code(ImageStoreError::Task("panicked".to_owned())),
            api::ErrorCode::Unavailable
        );
        assert_eq!(
            code(ImageStoreError::IndexCorrupt {
                path: "/x/index.json".into(),
                reason: "bad".to_owned(),
            }),
            api::ErrorCode::InvalidRequest
        );
        assert_eq!(
            import_code(&ImportError::UnknownFormat),
            api::ErrorCode::InvalidRequest
        );
        assert_eq!(
            import_code(&ImportError::Task("gone".to_owned())),
            api::ErrorCode::Unavailable
        );
        assert_eq!(
            import_code(&ImportError::Store(ImageStoreError::Task("x".to_owned()))),
            api::ErrorCode::Unavailable
        );
    }

    #[test]
    fn capability_needs_exactly_one_access_type() {
        let both = api::CapabilitySpec {
            mount: Some(api::MountSpec::default()),
            block: Some(api::BlockSpec {}),
            access_mode: "SINGLE_NODE_WRITER".into(),
        };
        assert!(capability(&both).is_err());
        let mount = api::CapabilitySpec {
            block: None,
            ..both.clone()
        };
        let parsed = capability(&mount)
            .map_err(|e| e.0.message)
            .unwrap_or_else(|m| panic!("{m}"));
        assert_eq!(capability_spec(&parsed), mount);
    }

    #[test]
    fn unknown_access_mode_lists_the_valid_ones() {
        let err = access_mode("WRITER")
            .err()
            .map(|e| e.0.message)
            .unwrap_or_default();
        assert!(
            err.contains("\"WRITER\"") && err.contains("SINGLE_NODE_WRITER"),
            "{err}"
        );
    }
}
