//! Why a volume request was refused (an invalid field, a conflict with the volume's use) and
//! how a plugin broke the CSI spec: the typed reasons inside [`super::VolumeError`]'s
//! `InvalidRequest`, `Conflict` and `Protocol`, so that callers (the daemon's status
//! mapping, tests) branch on what happened rather than on text.
//!
//! It owns the wording of these messages (the daemon's error snapshots check it) and must not
//! decide anything: the volume manager refuses, this only says why.

use std::path::PathBuf;

/// Which field of a request is invalid, and how; nothing was changed.
#[derive(Debug, thiserror::Error)]
pub enum InvalidRequest {
    #[error("{field} is empty: give a non-empty id")]
    EmptyId { field: &'static str },
    #[error("{field} is {len} bytes long: at most {max} bytes are allowed")]
    IdTooLong {
        field: &'static str,
        len: usize,
        max: usize,
    },
    #[error(
        "{field} has too many characters outside [A-Za-z0-9_-]: its on-disk name would exceed 255 bytes"
    )]
    IdTooLongEncoded { field: &'static str },
    #[error(
        "access_mode {access_mode} is read-only but readonly is false: set \"readonly\": true or use a writer access mode"
    )]
    ReadOnlyAccessMode { access_mode: String },
    #[error(
        "bind_to is {len} bytes long: this node allows at most {max} (--max-bind-to-bytes); use a shorter path"
    )]
    BindToTooLong { len: usize, max: usize },
    #[error(
        "plugin {plugin} has no CONTROLLER_SERVICE component: controller operations need one in its configuration"
    )]
    NoController { plugin: String },
    #[error("capacity_bytes is {0}: give 0 (plugin default) or a positive size")]
    NegativeCapacity(i64),
    #[error("capabilities is empty: give at least one capability to validate")]
    NoCapabilities,
    #[error("max_entries is {0}: give 0 (no limit) or a positive number")]
    NegativeMaxEntries(i32),
    #[error("capacity_bytes is {0}: give the size to expand the volume to, in bytes (positive)")]
    ExpandCapacity(i64),
    #[error(
        "volume {volume_id:?} is not known to csi-agent: create it (POST /v1/volumes) or publish it before expanding it"
    )]
    ExpandUnknown { volume_id: String },
    #[error(
        "volume {volume_id:?} has {current} bytes and volumes never shrink: give a capacity_bytes of at least {current} (asked {requested})"
    )]
    ExpandSmaller {
        volume_id: String,
        requested: i64,
        current: i64,
    },
}

/// What a request contradicts in the volume's current use; nothing was changed.
#[derive(Debug, thiserror::Error)]
pub enum Conflict {
    /// An expansion of a published volume by a plugin whose expansion is OFFLINE.
    #[error(
        "volume {volume_id:?} is in use (claims: {claims:?}) and the plugin's volume expansion is OFFLINE: unpublish it for every claim, then expand it"
    )]
    ExpandOffline {
        volume_id: String,
        claims: Vec<String>,
    },
    /// An expansion to resume while the volume is between two lifecycle steps.
    #[error(
        "volume {volume_id:?} is in transient state {state}: its expansion waits until the reconciler brings it to a steady state"
    )]
    ExpandBusy {
        volume_id: String,
        state: &'static str,
    },
    /// The volume is in use with another capability or readonly.
    #[error(
        "volume {volume_id:?} is already in use with {in_use}; publish it with the same capability and readonly, or unpublish it first"
    )]
    InUseOtherwise { volume_id: String, in_use: String },
    /// The workload's claim already binds the volume at another `bind_to`.
    #[error(
        "workload {workload:?} already has volume {volume_id:?} bound at {}; unpublish it first to bind elsewhere",
        bound_at.display()
    )]
    BoundElsewhere {
        workload: String,
        volume_id: String,
        bound_at: PathBuf,
    },
    #[error(
        "volume {volume_id:?} already has {claims} claims, the most this node allows per volume (--max-claims-per-volume {max}): unpublish it for a workload that no longer needs it, or raise the limit (docs/configuration.md)"
    )]
    TooManyClaims {
        volume_id: String,
        claims: usize,
        max: usize,
    },
    /// A publish of one volume more than the plugin takes on this node (NodeGetInfo's
    /// `max_volumes_per_node`); refused before any RPC.
    #[error(
        "plugin {plugin} takes at most {max} volumes on this node (its NodeGetInfo max_volumes_per_node) and {} already hold them: {}; unpublish one of them before publishing volume {volume_id:?}",
        attached.len(), attached.join(", ")
    )]
    TooManyVolumesOnNode {
        plugin: String,
        volume_id: String,
        max: i64,
        attached: Vec<String>,
    },
    /// A delete of a volume still staged, published or claimed.
    #[error(
        "volume {volume_id:?} is {state} with {claims} claim(s): unpublish it before deleting it"
    )]
    DeleteInUse {
        volume_id: String,
        state: &'static str,
        claims: usize,
    },
    /// A snapshot name already used with another source volume or other parameters.
    #[error(
        "snapshot name {name:?} is already used for volume {source_volume_id:?} with parameters {parameters:?}; choose another name, or repeat the request exactly"
    )]
    SnapshotNameTaken {
        name: String,
        source_volume_id: String,
        parameters: std::collections::BTreeMap<String, String>,
    },
    /// A create of a snapshot whose delete is in progress.
    #[error("snapshot {name:?} is being deleted; wait for the delete, then create it again")]
    SnapshotBeingDeleted { name: String },
}

/// How a plugin that answered success broke a rule of the CSI spec.
#[derive(Debug, thiserror::Error)]
pub enum ProtocolViolation {
    /// An unstage or unpublish left its path mounted.
    #[error("{rpc} succeeded but {} is still mounted", path.display())]
    StillMounted { rpc: &'static str, path: PathBuf },
    #[error(
        "NodePublishVolume succeeded but did not create the target path {} (CSI v1: the plugin creates it)",
        path.display()
    )]
    TargetNotCreated { path: PathBuf },
    #[error("CreateVolume returned no volume")]
    NoVolume,
    #[error("CreateVolume returned an empty volume_id")]
    EmptyVolumeId,
    /// CreateVolume returned a volume id csi-agent cannot keep.
    #[error("{0}")]
    BadVolumeId(#[source] InvalidRequest),
    #[error("NodeGetInfo returned an empty node_id")]
    EmptyNodeId,
    #[error("{rpc} returned no snapshot")]
    NoSnapshot { rpc: &'static str },
    /// A snapshot id csi-agent cannot keep (empty, too long).
    #[error("{rpc} returned an unusable snapshot_id: {source}")]
    BadSnapshotId {
        rpc: &'static str,
        #[source]
        source: InvalidRequest,
    },
    #[error("CreateSnapshot for source volume {asked:?} returned a snapshot of volume {got:?}")]
    SnapshotOfOtherVolume { asked: String, got: String },
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;
    use crate::volume::{MAX_ID_BYTES, VolumeError, check_id, validate_id};

    #[test]
    fn a_bad_id_names_its_field_and_keeps_its_message() {
        let err = validate_id("workload", "").unwrap_err();
        assert!(matches!(
            err,
            VolumeError::InvalidRequest(InvalidRequest::EmptyId { field: "workload" })
        ));
        assert_eq!(err.to_string(), "workload is empty: give a non-empty id");
        let long = "a".repeat(MAX_ID_BYTES + 1);
        let err = validate_id("volume_id", &long).unwrap_err();
        assert!(matches!(
            err,
            VolumeError::InvalidRequest(InvalidRequest::IdTooLong { field: "volume_id", len, max })
                if len == MAX_ID_BYTES + 1 && max == MAX_ID_BYTES
        ));
        assert_eq!(
            err.to_string(),
            format!("volume_id is 129 bytes long: at most {MAX_ID_BYTES} bytes are allowed")
        );
        // Short in bytes, long once encoded (each byte outside [A-Za-z0-9_-] takes three).
        let odd = "%".repeat(MAX_ID_BYTES);
        assert!(matches!(
            check_id("name", &odd),
            Err(InvalidRequest::IdTooLongEncoded { field: "name" })
        ));
        assert!(validate_id("volume_id", "ok-id_1").is_ok());
    }

    #[test]
    fn a_plugin_id_csi_agent_cannot_keep_is_a_protocol_error_with_its_source() {
        let err: VolumeError = ProtocolViolation::BadVolumeId(
            check_id("volume_id returned by CreateVolume", "").unwrap_err(),
        )
        .into();
        assert_eq!(
            err.to_string(),
            "the plugin broke the CSI spec: volume_id returned by CreateVolume is empty: give a non-empty id"
        );
        let VolumeError::Protocol(violation) = &err else {
            panic!("{err:?}");
        };
        let source = std::error::Error::source(violation).expect("the id's own error");
        assert!(source.is::<InvalidRequest>(), "{source:?}");
    }

    #[test]
    fn conflicts_say_what_conflicted() {
        let err: VolumeError = Conflict::BoundElsewhere {
            workload: "w1".to_owned(),
            volume_id: "v".to_owned(),
            bound_at: PathBuf::from("/s/w1/data"),
        }
        .into();
        assert_eq!(
            err.to_string(),
            "workload \"w1\" already has volume \"v\" bound at /s/w1/data; unpublish it first to bind elsewhere"
        );
        let err: VolumeError = ProtocolViolation::StillMounted {
            rpc: "NodeUnpublishVolume",
            path: PathBuf::from("/m/v/target"),
        }
        .into();
        assert_eq!(
            err.to_string(),
            "the plugin broke the CSI spec: NodeUnpublishVolume succeeded but /m/v/target is still mounted"
        );
    }
}
