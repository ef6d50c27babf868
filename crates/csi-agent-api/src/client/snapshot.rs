//! The snapshot routes' calls: create, delete and list (one page). Owns only their URLs and
//! bodies; what the routes do is the daemon's.

use hyper::Method;

use super::ApiClient;
use crate::error::ApiError;
use crate::routes;
use crate::types::{CreateSnapshotRequest, DeleteSnapshotResponse, SnapshotInfo, SnapshotPage};

impl ApiClient {
    /// `POST /v1/snapshots` (CreateSnapshot), idempotent by name.
    pub async fn create_snapshot(
        &self,
        request: &CreateSnapshotRequest,
    ) -> Result<SnapshotInfo, ApiError> {
        self.post_json(routes::SNAPSHOTS, request).await
    }

    /// `DELETE /v1/snapshots/{plugin}/{snapshot_id}` (DeleteSnapshot)
    pub async fn delete_snapshot(
        &self,
        plugin: &str,
        snapshot_id: &str,
    ) -> Result<DeleteSnapshotResponse, ApiError> {
        self.call_json(Method::DELETE, &routes::snapshot(plugin, snapshot_id), None)
            .await
    }

    /// `GET /v1/plugins/{type}/snapshots` (ListSnapshots): one page, optionally of one source
    /// volume or one snapshot id. Pass the previous page's `next_token` as `starting_token`.
    pub async fn snapshots(
        &self,
        plugin_type: &str,
        max_entries: Option<u32>,
        starting_token: Option<&str>,
        source_volume_id: Option<&str>,
        snapshot_id: Option<&str>,
    ) -> Result<SnapshotPage, ApiError> {
        let max_entries = max_entries.map(|n| n.to_string());
        let path = format!(
            "{}{}",
            routes::plugin_snapshots(plugin_type),
            routes::query(&[
                ("max_entries", max_entries.as_deref()),
                ("starting_token", starting_token),
                ("source_volume_id", source_volume_id),
                ("snapshot_id", snapshot_id),
            ])
        );
        self.get_json(&path).await
    }
}
