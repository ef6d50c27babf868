//! `GET /v1/volumes/{plugin}/{volume_id}/stats` and the condition shown on a volume: formats
//! what the engine's stats ([`csi_agent::volume::stats`]) hold. Must not call a plugin itself
//! or cache anything: the engine decides between the latest sample and one collected now.

use axum::Json;
use axum::extract::State;
use csi_agent::client::stats as csi;
use csi_agent::volume::VolumeManager;
use csi_agent::volume::stats::{Sample, StatsError};
use csi_agent_api as api;

use super::{ApiResult, AppState, Params};
use crate::convert::ApiFailure;

impl From<StatsError> for ApiFailure {
    fn from(err: StatsError) -> Self {
        let message = err.to_string();
        match err {
            StatsError::UnknownVolume { .. } => Self::new(api::ErrorCode::NotFound, message),
            StatsError::NotPublished { .. } => Self::new(api::ErrorCode::Conflict, message),
            StatsError::Volume(err) => err.into(),
        }
    }
}

pub(super) async fn volume_stats(
    State(state): State<AppState>,
    Params((plugin_type, volume_id)): Params<(String, String)>,
) -> ApiResult<api::VolumeStats> {
    csi_agent::volume::validate_id("volume_id", &volume_id)?;
    let plugin = state.server.plugin(&plugin_type).await?;
    let sample = plugin
        .volumes
        .volume_stats(&volume_id, &state.stats)
        .await?;
    Ok(Json(stats_of(&sample)))
}

fn figures(u: csi::Usage) -> api::UsageFigures {
    api::UsageFigures {
        total: u.total,
        used: u.used,
        available: u.available,
    }
}

fn condition(c: &csi::Condition) -> api::VolumeCondition {
    api::VolumeCondition {
        abnormal: c.abnormal,
        message: c.message.clone(),
    }
}

fn stats_of(sample: &Sample) -> api::VolumeStats {
    api::VolumeStats {
        bytes: sample.stats.bytes.map(figures),
        inodes: sample.stats.inodes.map(figures),
        condition: sample.stats.condition.as_ref().map(condition),
        collected_at: api::time::rfc3339_millis(sample.collected_at),
    }
}

/// The condition of the volume's latest sample (for `GET /v1/volumes...`); never waits.
pub(crate) fn volume_condition(
    volumes: &VolumeManager,
    volume_id: &str,
) -> Option<api::VolumeCondition> {
    volumes
        .stats_sample(volume_id)
        .and_then(|s| s.stats.condition.as_ref().map(condition))
}
