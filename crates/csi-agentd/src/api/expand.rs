//! The handler of `POST /v1/volumes/{plugin}/{volume_id}/expand`: parses the body, refuses a
//! volume csi-agent does not know (404) and hands the rest to the volume manager's expansion
//! (`csi_agent::volume::expand`), answering the volume with its new capacity.
//!
//! It must not decide anything about the expansion itself (capabilities, OFFLINE, sizes):
//! the volume manager refuses, and `convert.rs` maps its errors to the API's codes.

use axum::Json;
use axum::body::Bytes;
use axum::extract::State;
use csi_agent_api as api;

use super::{ApiResult, AppState, Params, parse_body, volume_answer};
use crate::convert::ApiFailure;

pub(super) async fn expand_volume(
    State(state): State<AppState>,
    Params((plugin_type, volume_id)): Params<(String, String)>,
    body: Bytes,
) -> ApiResult<api::VolumeInfo> {
    let request: api::ExpandRequest =
        parse_body("POST /v1/volumes/{plugin}/{volume_id}/expand", &body)?;
    csi_agent::volume::validate_id("volume_id", &volume_id)?;
    state.server.refuse_if_drained()?;
    let plugin = state.server.plugin(&plugin_type).await?;
    if plugin.volumes.get(&volume_id).await.is_none() {
        return Err(ApiFailure::new(
            api::ErrorCode::NotFound,
            format!(
                "plugin {plugin_type} has no volume {volume_id:?} on this node: create it (POST /v1/volumes) or publish it before expanding it"
            ),
        ));
    }
    let record = plugin
        .volumes
        .expand(&volume_id, request.capacity_bytes)
        .await?;
    Ok(Json(volume_answer(
        &state,
        &plugin_type,
        &plugin.volumes,
        &record,
    )))
}
