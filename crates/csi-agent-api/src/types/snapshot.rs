//! Bodies of the snapshot routes (`POST /v1/snapshots`, `DELETE /v1/snapshots/{plugin}/{id}`,
//! `GET /v1/plugins/{type}/snapshots`) and of a create's `content_source`.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// `POST /v1/snapshots` (CreateSnapshot), idempotent by `name`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CreateSnapshotRequest {
    pub plugin: String,
    pub source_volume_id: String,
    pub name: String,
    #[serde(default)]
    pub parameters: BTreeMap<String, String>,
}

/// A snapshot, as the plugin last reported it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SnapshotInfo {
    pub snapshot_id: String,
    pub source_volume_id: String,
    pub size_bytes: i64,
    /// RFC 3339 (UTC) when the plugin cut it; absent when the plugin did not say.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub creation_time: Option<String>,
    pub ready_to_use: bool,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeleteSnapshotResponse {
    pub deleted: bool,
}

/// `GET /v1/plugins/{type}/snapshots` (ListSnapshots): one page.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SnapshotPage {
    pub snapshots: Vec<SnapshotInfo>,
    /// Empty when this is the last page.
    pub next_token: String,
}

/// `POST /v1/volumes`' `content_source`: exactly one of a snapshot to restore or a volume to
/// clone, both ids of the plugin the create names.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ContentSource {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub snapshot_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub volume_id: Option<String>,
}
