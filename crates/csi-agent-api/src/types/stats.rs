//! `GET /v1/volumes/{plugin}/{volume_id}/stats`: a published volume's usage and condition
//! (CSI NodeGetVolumeStats), and the condition shown on the volume itself.
//!
//! Owns the JSON shape only. A figure or unit the plugin did not report is absent, never 0.

use serde::{Deserialize, Serialize};

/// Used, available and total of one unit (bytes or inodes).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct UsageFigures {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub total: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub used: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub available: Option<u64>,
}

/// A volume's condition as its plugin reports it (VOLUME_CONDITION).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct VolumeCondition {
    pub abnormal: bool,
    #[serde(default)]
    pub message: String,
}

/// `GET /v1/volumes/{plugin}/{volume_id}/stats`
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct VolumeStats {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bytes: Option<UsageFigures>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub inodes: Option<UsageFigures>,
    /// Only from a plugin that advertises VOLUME_CONDITION.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub condition: Option<VolumeCondition>,
    /// When the plugin answered, RFC 3339 (UTC).
    pub collected_at: String,
}
