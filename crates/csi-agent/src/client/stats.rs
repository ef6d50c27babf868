//! `NodeGetVolumeStats` (CSI v1 only: CSI 0.x has no such RPC).
//!
//! Owns: the call, a per-call deadline of its own (stats are collected in the background
//! with a shorter deadline than lifecycle RPCs), and checking the answer against the spec
//! ("The value of this field MUST NOT be negative"): a usage figure that breaks it is dropped
//! (reported absent), never shown as a number. Must not: decide when to call, or cache.

use std::time::Duration;

use csi_proto::v1;

use super::{CsiClient, RpcError, request};

/// One `VolumeUsage` entry. Each figure is `None` when the plugin's number broke the spec
/// (negative); proto3 cannot tell an unreported figure from 0, so 0 is a 0.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Usage {
    pub total: Option<u64>,
    pub used: Option<u64>,
    pub available: Option<u64>,
}

/// The condition of a volume, as the plugin reported it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Condition {
    pub abnormal: bool,
    pub message: String,
}

/// A NodeGetVolumeStats answer. A unit the plugin did not report is `None`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct VolumeStats {
    pub bytes: Option<Usage>,
    pub inodes: Option<Usage>,
    pub condition: Option<Condition>,
}

fn figure(value: i64) -> Option<u64> {
    u64::try_from(value).ok()
}

impl From<&v1::VolumeUsage> for Usage {
    fn from(u: &v1::VolumeUsage) -> Self {
        Self {
            total: figure(u.total),
            used: figure(u.used),
            available: figure(u.available),
        }
    }
}

/// Folds an answer: the first entry of each known unit counts (a repeated unit is a plugin
/// bug we tolerate), entries of unknown units are ignored.
pub fn fold_stats(response: &v1::NodeGetVolumeStatsResponse) -> VolumeStats {
    use v1::volume_usage::Unit;
    let of = |unit: Unit| {
        response
            .usage
            .iter()
            .find(|u| u.unit == unit as i32)
            .map(Usage::from)
    };
    VolumeStats {
        bytes: of(Unit::Bytes),
        inodes: of(Unit::Inodes),
        condition: response.volume_condition.as_ref().map(|c| Condition {
            abnormal: c.abnormal,
            message: c.message.clone(),
        }),
    }
}

impl CsiClient {
    /// This client with another per-RPC deadline (the connection is shared).
    pub fn with_deadline(&self, deadline: Duration) -> Self {
        let mut options = (*self.options).clone();
        options.rpc_deadline = deadline;
        Self {
            channel: self.channel.clone(),
            version: self.version,
            socket: self.socket.clone(),
            options: std::sync::Arc::new(options),
        }
    }

    /// NodeGetVolumeStats of the volume at `volume_path` (the target path), with the staging
    /// path when the plugin stages (the spec: the CO SHALL set it then). Refused without a
    /// call on CSI 0.x, which has no such RPC.
    pub async fn node_get_volume_stats(
        &self,
        volume_id: &str,
        volume_path: &str,
        staging_target_path: Option<&str>,
    ) -> Result<VolumeStats, RpcError> {
        const METHOD: &str = "NodeGetVolumeStats";
        if self.version.is_v0() {
            return Err(RpcError::protocol(
                METHOD,
                format!(
                    "CSI {} has no NodeGetVolumeStats; the plugin must not advertise GET_VOLUME_STATS",
                    self.version
                ),
            ));
        }
        let req = v1::NodeGetVolumeStatsRequest {
            volume_id: volume_id.to_owned(),
            volume_path: volume_path.to_owned(),
            staging_target_path: staging_target_path.unwrap_or_default().to_owned(),
        };
        let response = self
            .call(METHOD, |ch, d| async move {
                v1::node_client::NodeClient::new(ch)
                    .node_get_volume_stats(request(req, d))
                    .await
            })
            .await?;
        Ok(fold_stats(&response))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use v1::volume_usage::Unit;

    #[test]
    fn negative_figures_and_missing_units_are_absent() {
        let response = v1::NodeGetVolumeStatsResponse {
            usage: vec![
                v1::VolumeUsage {
                    available: -1,
                    total: 100,
                    used: 0,
                    unit: Unit::Bytes as i32,
                },
                v1::VolumeUsage {
                    available: 5,
                    total: 5,
                    used: 5,
                    unit: 7,
                },
            ],
            volume_condition: None,
        };
        let stats = fold_stats(&response);
        assert_eq!(
            stats.bytes,
            Some(Usage {
                total: Some(100),
                used: Some(0),
                available: None
            })
        );
        assert_eq!(stats.inodes, None, "an unknown unit is not inodes");
        assert_eq!(stats.condition, None);
    }
}
