//! Topology, the node's volume limit and ControllerGetVolume at the API (issue 26, item 5):
//! conversions between the JSON contract and the engine's v1-shaped values.
//!
//! Must not: decide anything (the engine's `volume/topology.rs` does) or call the plugin
//! itself.

use csi_agent::client::{RpcErrorKind, code_name};
use csi_agent::volume::topology::{ControllerView, Requirements};
use csi_agent::volume::{VolumeError, VolumeManager};
use csi_agent_api as api;

use crate::convert::ApiFailure;

/// What the plugin's NodeGetInfo said, as last asked; asks it in the background when it
/// was never asked (a status read never waits for it).
pub(super) fn node_info(volumes: &VolumeManager, ready: bool) -> Option<api::PluginNodeInfo> {
    let info = volumes.cached_node_info();
    if info.is_none() && ready {
        volumes.refresh_node_info();
    }
    info.map(|info| api::PluginNodeInfo {
        node_id: info.node_id.clone(),
        accessible_topology: info.accessible_topology.clone(),
        max_volumes_per_node: info.max_volumes_per_node,
    })
}

/// A request's `accessibility_requirements` for the engine.
pub(super) fn requirements(r: &api::AccessibilityRequirements) -> Requirements {
    Requirements {
        requisite: r.requisite.clone(),
        preferred: r.preferred.clone(),
    }
}

/// ControllerGetVolume's answer for a volume's status (`None`: not advertised).
pub(super) async fn controller_status(
    volumes: &VolumeManager,
    volume_id: &str,
) -> Option<api::ControllerVolumeStatus> {
    Some(match volumes.controller_view(volume_id).await? {
        ControllerView::Answered {
            published_node_ids,
            condition,
        } => api::ControllerVolumeStatus {
            published_node_ids,
            condition: condition
                .map(|(abnormal, message)| api::VolumeCondition { abnormal, message }),
            error: None,
        },
        ControllerView::Failed(error) => api::ControllerVolumeStatus {
            published_node_ids: Vec::new(),
            condition: None,
            error: Some(error),
        },
    })
}

/// A failed CreateVolume as an API failure. With topology requirements (a request's own, or
/// this node's by default) the engine takes RESOURCE_EXHAUSTED as final: the spec's "Unable
/// to provision in `accessible_topology`", the plugin's final answer (422 `plugin_error`),
/// not a busy plugin (503) to be asked again.
pub(super) fn create_failure(
    volumes: &VolumeManager,
    requested: bool,
    err: VolumeError,
) -> ApiFailure {
    let with_topology = requested
        || volumes
            .cached_node_info()
            .is_some_and(|n| n.accessible_topology.is_some());
    match &err {
        VolumeError::Plugin(rpc)
            if with_topology
                && code_name(rpc.code()) == "RESOURCE_EXHAUSTED"
                && matches!(rpc.kind, RpcErrorKind::Status { .. }) =>
        {
            ApiFailure(api::ErrorBody {
                code: api::ErrorCode::PluginError,
                message: format!(
                    "{err}; the plugin cannot provision in the requested topology (see this \
                     node's topology with `csictl plugins TYPE`)"
                ),
                grpc_code: Some(code_name(rpc.code()).to_owned()),
            })
        }
        _ => err.into(),
    }
}
