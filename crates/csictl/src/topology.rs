//! Topology at the command line: `csictl create --requisite/--preferred`, `csictl capacity
//! --topology`, and how `csictl plugins TYPE` / `csictl volume` show NodeGetInfo's topology
//! and limit and ControllerGetVolume's published nodes.
//!
//! Must not: decide defaults (the daemon defaults a create to this node's topology).

use std::collections::BTreeMap;

use csi_agent_api::{AccessibilityRequirements, ControllerVolumeStatus, PluginNodeInfo};

use crate::args::{UsageError, parse_pairs};

/// `zone=a,rack=1` as a segment map.
pub fn segments(flag: &str, value: &str) -> Result<BTreeMap<String, String>, UsageError> {
    let items: Vec<String> = value
        .split(',')
        .filter(|s| !s.is_empty())
        .map(str::to_owned)
        .collect();
    if items.is_empty() {
        return Err(UsageError(format!(
            "{flag} expects KEY=VALUE[,KEY=VALUE...], e.g. zone=a,rack=1"
        )));
    }
    parse_pairs(flag, &items)
}

/// `--requisite` and `--preferred` (each repeatable) as a request's requirements; `None`
/// when neither is given (the daemon then uses this node's topology).
pub fn requirements(
    requisite: &[String],
    preferred: &[String],
) -> Result<Option<AccessibilityRequirements>, UsageError> {
    if requisite.is_empty() && preferred.is_empty() {
        return Ok(None);
    }
    Ok(Some(AccessibilityRequirements {
        requisite: requisite
            .iter()
            .map(|t| segments("--requisite", t))
            .collect::<Result<_, _>>()?,
        preferred: preferred
            .iter()
            .map(|t| segments("--preferred", t))
            .collect::<Result<_, _>>()?,
    }))
}

/// `zone=a,rack=1`.
pub fn shown(segments: &BTreeMap<String, String>) -> String {
    segments
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(",")
}

/// The `node …` lines of `csictl plugins TYPE`.
pub fn node_fields(node: &PluginNodeInfo) -> Vec<(&'static str, String)> {
    vec![
        ("node id", node.node_id.clone()),
        (
            "node topology",
            node.accessible_topology
                .as_ref()
                .map(shown)
                .unwrap_or_else(|| "-".to_owned()),
        ),
        (
            "max volumes on node",
            node.max_volumes_per_node
                .map(|n| n.to_string())
                .unwrap_or_else(|| "no limit".to_owned()),
        ),
    ]
}

/// The `accessible from` and `controller` lines of `csictl volume`.
pub fn volume_fields(
    accessible: &[BTreeMap<String, String>],
    controller: Option<&ControllerVolumeStatus>,
) -> Vec<(&'static str, String)> {
    let mut out = Vec::new();
    if !accessible.is_empty() {
        let all: Vec<String> = accessible.iter().map(shown).collect();
        out.push(("accessible from", all.join(" | ")));
    }
    if let Some(c) = controller {
        out.push((
            "controller published to",
            match &c.error {
                Some(error) => format!("unknown ({error})"),
                None if c.published_node_ids.is_empty() => "-".to_owned(),
                None => c.published_node_ids.join(", "),
            },
        ));
        if let Some(condition) = &c.condition {
            out.push(("controller condition", crate::stats::condition(condition)));
        }
    }
    out
}
