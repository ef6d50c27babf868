//! `GET /v1/volumes/{plugin}/{volume_id}/stats` and the condition shown on a volume: formats
//! what the engine's stats ([`csi_agent::volume::stats`]) hold. Must not call a plugin itself
//! or cache anything: the engine decides between the latest sample and one collected now.

use std::time::{SystemTime, UNIX_EPOCH};

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
        collected_at: rfc3339(sample.collected_at),
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

/// `2026-12-06T08:17:31.123Z`: UTC, milliseconds.
pub(crate) fn rfc3339(at: SystemTime) -> String {
    let since = at.duration_since(UNIX_EPOCH).unwrap_or_default();
    let secs = since.as_secs();
    let (days, rest) = (secs / 86_400, secs % 86_400);
    // Howard Hinnant's civil_from_days, for days since 1970-01-01 (never negative here).
    let z = days + 719_468;
    let era = z / 146_097;
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + u64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{:03}Z",
        rest / 3600,
        rest % 3600 / 60,
        rest % 60,
        since.subsec_millis()
    )
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn rfc3339_dates() {
        let at =
            |secs: u64, ms: u64| UNIX_EPOCH + Duration::from_secs(secs) + Duration::from_millis(ms);
        assert_eq!(rfc3339(at(0, 0)), "1970-01-01T00:00:00.000Z");
        // 2000-02-29 (a leap day of a century leap year) 12:34:56.789.
        assert_eq!(rfc3339(at(951_827_696, 789)), "2000-02-29T12:34:56.789Z");
        assert_eq!(rfc3339(at(1_798_761_599, 0)), "2026-12-31T23:59:59.000Z");
        assert_eq!(rfc3339(at(4_107_542_400, 0)), "2100-03-01T00:00:00.000Z");
    }
}
