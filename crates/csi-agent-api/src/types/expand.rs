//! Bodies of volume expansion: `POST /v1/volumes/{plugin}/{volume_id}/expand` and the
//! expansion in progress shown on a volume.

use serde::{Deserialize, Serialize};

/// `POST /v1/volumes/{plugin}/{volume_id}/expand`. The answer is the volume
/// ([`crate::VolumeInfo`]) with its capacity after the expansion.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExpandRequest {
    /// The size to grow the volume to, in bytes; never less than its current capacity.
    pub capacity_bytes: i64,
}

/// An expansion asked of a volume and not finished yet (a step failed, or the node step waits
/// for the volume to be staged or published on this node).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExpansionInfo {
    /// The capacity asked, in bytes.
    pub capacity_bytes: i64,
    /// The step still to do: `controller` (ControllerExpandVolume) or `node`
    /// (NodeExpandVolume).
    pub next_step: String,
}
