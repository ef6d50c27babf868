//! CreateSnapshot, DeleteSnapshot and ListSnapshots.
//!
//! Owns: the three calls and their translation to and from CSI 0.3, which has
//! the same RPCs with other field names (`created_at` in Unix nanoseconds
//! instead of a Timestamp, a `status` instead of `ready_to_use`). CSI 0.2 has
//! no snapshots: its plugins cannot advertise them, so the engine refuses
//! before any call (`require_controller_cap`); should one be made anyway,
//! the plugin's UNIMPLEMENTED comes back as it is.
//!
//! Must not: decide when to call (the engine checks the capability and
//! re-issues until `ready_to_use`), or retry.

use csi_proto::v0 as pb0;
use csi_proto::v1;

use super::{CsiClient, RpcError, request};

/// A CSI 0.3 snapshot in v1's shape. `ERROR_UPLOADING` is a failure of the
/// call: v1 reports it as an error status, and so does the engine.
fn snapshot_from_v0(
    method: &'static str,
    s: Option<pb0::Snapshot>,
) -> Result<Option<v1::Snapshot>, RpcError> {
    use pb0::snapshot_status::Type;
    let Some(s) = s else { return Ok(None) };
    let status = s.status.unwrap_or_default();
    let ready = match Type::try_from(status.r#type) {
        Ok(Type::Ready) => true,
        Ok(Type::ErrorUploading) => {
            return Err(RpcError::protocol(
                method,
                format!("snapshot {:?} failed to upload: {}", s.id, status.details),
            ));
        }
        _ => false,
    };
    Ok(Some(v1::Snapshot {
        size_bytes: s.size_bytes,
        snapshot_id: s.id,
        source_volume_id: s.source_volume_id,
        creation_time: Some(prost_types::Timestamp {
            seconds: s.created_at.div_euclid(1_000_000_000),
            nanos: i32::try_from(s.created_at.rem_euclid(1_000_000_000)).unwrap_or(0),
        }),
        ready_to_use: ready,
        group_snapshot_id: String::new(),
    }))
}

impl CsiClient {
    pub async fn create_snapshot(
        &self,
        req: v1::CreateSnapshotRequest,
    ) -> Result<v1::CreateSnapshotResponse, RpcError> {
        const METHOD: &str = "CreateSnapshot";
        if self.version.is_v0() {
            let req = pb0::CreateSnapshotRequest {
                source_volume_id: req.source_volume_id,
                name: req.name,
                create_snapshot_secrets: req.secrets,
                parameters: req.parameters,
            };
            let response = self
                .call(METHOD, |ch, d| async move {
                    pb0::controller_client::ControllerClient::new(ch)
                        .create_snapshot(request(req, d))
                        .await
                })
                .await?;
            Ok(v1::CreateSnapshotResponse {
                snapshot: snapshot_from_v0(METHOD, response.snapshot)?,
            })
        } else {
            self.call(METHOD, |ch, d| async move {
                v1::controller_client::ControllerClient::new(ch)
                    .create_snapshot(request(req, d))
                    .await
            })
            .await
        }
    }

    pub async fn delete_snapshot(&self, req: v1::DeleteSnapshotRequest) -> Result<(), RpcError> {
        const METHOD: &str = "DeleteSnapshot";
        if self.version.is_v0() {
            let req = pb0::DeleteSnapshotRequest {
                snapshot_id: req.snapshot_id,
                delete_snapshot_secrets: req.secrets,
            };
            self.call(METHOD, |ch, d| async move {
                pb0::controller_client::ControllerClient::new(ch)
                    .delete_snapshot(request(req, d))
                    .await
            })
            .await?;
        } else {
            self.call(METHOD, |ch, d| async move {
                v1::controller_client::ControllerClient::new(ch)
                    .delete_snapshot(request(req, d))
                    .await
            })
            .await?;
        }
        Ok(())
    }

    pub async fn list_snapshots(
        &self,
        req: v1::ListSnapshotsRequest,
    ) -> Result<v1::ListSnapshotsResponse, RpcError> {
        const METHOD: &str = "ListSnapshots";
        if self.version.is_v0() {
            let req = pb0::ListSnapshotsRequest {
                max_entries: req.max_entries,
                starting_token: req.starting_token,
                source_volume_id: req.source_volume_id,
                snapshot_id: req.snapshot_id,
            };
            let response = self
                .call(METHOD, |ch, d| async move {
                    pb0::controller_client::ControllerClient::new(ch)
                        .list_snapshots(request(req, d))
                        .await
                })
                .await?;
            let entries = response
                .entries
                .into_iter()
                .map(|e| {
                    Ok(v1::list_snapshots_response::Entry {
                        snapshot: snapshot_from_v0(METHOD, e.snapshot)?,
                    })
                })
                .collect::<Result<_, RpcError>>()?;
            Ok(v1::ListSnapshotsResponse {
                entries,
                next_token: response.next_token,
            })
        } else {
            self.call(METHOD, |ch, d| async move {
                v1::controller_client::ControllerClient::new(ch)
                    .list_snapshots(request(req, d))
                    .await
            })
            .await
        }
    }
}
