//! Topology, the node's volume limit and ControllerGetVolume in the JSON contract
//! (issue 26, item 5): what `GET /v1/plugins/{type}` shows of NodeGetInfo, the
//! `accessibility_requirements` of `POST /v1/volumes`, and the `controller` object of
//! `GET /v1/volumes/{plugin}/{volume_id}`.
//!
//! Must not: hold behaviour; the engine decides defaults and limits.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// One topology segment map, as CSI's `Topology.segments` (`{"zone": "a", "rack": "1"}`).
pub type TopologySegments = BTreeMap<String, String>;

/// What the plugin's NodeGetInfo answered (`GET /v1/plugins/{type}`, `"node"`).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PluginNodeInfo {
    pub node_id: String,
    /// Where this node is accessible from; absent when the plugin reports none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub accessible_topology: Option<TopologySegments>,
    /// The most volumes the plugin takes on this node; absent when it sets no limit.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_volumes_per_node: Option<i64>,
}

/// CSI's `TopologyRequirement` (`POST /v1/volumes`, `"accessibility_requirements"`).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AccessibilityRequirements {
    /// The volume must be accessible from at least one of these.
    #[serde(default)]
    pub requisite: Vec<TopologySegments>,
    /// The order in which the plugin should try the topologies.
    #[serde(default)]
    pub preferred: Vec<TopologySegments>,
}

/// What ControllerGetVolume answered (`GET /v1/volumes/{plugin}/{volume_id}`, `"controller"`),
/// for plugins that advertise GET_VOLUME.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ControllerVolumeStatus {
    /// The nodes the volume is controller-published to.
    #[serde(default)]
    pub published_node_ids: Vec<String>,
    /// The volume's condition, from plugins that advertise VOLUME_CONDITION (the controller
    /// capability); absent otherwise.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub condition: Option<super::VolumeCondition>,
    /// Why the call failed (the volume's other fields are still shown); absent on success.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}
