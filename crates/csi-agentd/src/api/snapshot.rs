//! The snapshot routes: `POST /v1/snapshots`, `DELETE /v1/snapshots/{plugin}/{snapshot_id}`,
//! `GET /v1/plugins/{type}/snapshots`, and the `content_source` of `POST /v1/volumes`.
//!
//! Owns: parsing and formatting only (the engine's `volume::snapshot` does the work and the
//! capability checks); must not keep state of its own.

use axum::Json;
use axum::body::Bytes;
use axum::extract::{Query, State};
use axum::http::StatusCode;
use csi_agent::volume::snapshot::{ContentSource, SnapshotRecord};
use csi_agent_api as api;

use super::{ApiResult, AppState, Params, list_failure, parse_body};
use crate::convert::ApiFailure;

fn info(r: SnapshotRecord) -> api::SnapshotInfo {
    api::SnapshotInfo {
        creation_time: r.creation_time.and_then(|(s, n)| api::time::rfc3339(s, n)),
        snapshot_id: r.snapshot_id,
        source_volume_id: r.source_volume_id,
        size_bytes: r.size_bytes,
        ready_to_use: r.ready_to_use,
    }
}

/// The engine's content source of a create: exactly one of the two ids.
pub(super) fn content_source(
    source: Option<api::ContentSource>,
) -> Result<Option<ContentSource>, ApiFailure> {
    match source {
        None => Ok(None),
        Some(api::ContentSource {
            snapshot_id: Some(id),
            volume_id: None,
        }) => Ok(Some(ContentSource::Snapshot(id))),
        Some(api::ContentSource {
            snapshot_id: None,
            volume_id: Some(id),
        }) => Ok(Some(ContentSource::Volume(id))),
        Some(_) => Err(ApiFailure::invalid(
            "content_source must hold exactly one of snapshot_id (restore a snapshot) and \
             volume_id (clone a volume); see docs/api.md",
        )),
    }
}

/// `POST /v1/snapshots`: 201 with the snapshot; `ready_to_use: false` when the plugin still
/// processes it after the operation timeout (repeat the request to follow it).
pub(super) async fn create_snapshot(
    State(state): State<AppState>,
    body: Bytes,
) -> Result<(StatusCode, Json<api::SnapshotInfo>), ApiFailure> {
    let request: api::CreateSnapshotRequest = parse_body("POST /v1/snapshots", &body)?;
    state.server.refuse_if_drained()?;
    let plugin = state.server.plugin(&request.plugin).await?;
    let record = plugin
        .volumes
        .create_snapshot(&request.name, &request.source_volume_id, request.parameters)
        .await?;
    Ok((StatusCode::CREATED, Json(info(record))))
}

pub(super) async fn delete_snapshot(
    State(state): State<AppState>,
    Params((plugin_type, snapshot_id)): Params<(String, String)>,
) -> ApiResult<api::DeleteSnapshotResponse> {
    let plugin = state.server.plugin(&plugin_type).await?;
    plugin.volumes.delete_snapshot(&snapshot_id).await?;
    Ok(Json(api::DeleteSnapshotResponse { deleted: true }))
}

#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct SnapshotQuery {
    #[serde(default)]
    max_entries: i32,
    #[serde(default)]
    starting_token: String,
    #[serde(default)]
    source_volume_id: String,
    #[serde(default)]
    snapshot_id: String,
}

pub(super) async fn list_snapshots(
    State(state): State<AppState>,
    Params(plugin_type): Params<String>,
    query: Result<Query<SnapshotQuery>, axum::extract::rejection::QueryRejection>,
) -> ApiResult<api::SnapshotPage> {
    let Query(query) = query.map_err(|e| {
        ApiFailure::invalid(format!(
            "query of GET /v1/plugins/{{type}}/snapshots is not valid: {e}; use max_entries=<number>&starting_token=<token>&source_volume_id=<id>&snapshot_id=<id>"
        ))
    })?;
    let plugin = state.server.plugin(&plugin_type).await?;
    let page = plugin
        .volumes
        .list_snapshots(
            query.max_entries,
            &query.starting_token,
            &query.source_volume_id,
            &query.snapshot_id,
        )
        .await
        .map_err(|err| list_failure(err, &query.starting_token))?;
    Ok(Json(api::SnapshotPage {
        snapshots: page.snapshots.into_iter().map(info).collect(),
        next_token: page.next_token,
    }))
}
