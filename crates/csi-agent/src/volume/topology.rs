//! Topology and the node's volume limit (CSI `NodeGetInfo`'s `accessible_topology` and
//! `max_volumes_per_node`), and ControllerGetVolume: an `impl VolumeManager` block.
//!
//! Owns: asking NodeGetInfo and GetPluginCapabilities once per plugin configuration (cached
//! beside the advertised capabilities and forgotten with them on reload), the default
//! `accessibility_requirements` of a create on this node, the topology of a capacity request,
//! the refusal of a publish that would exceed `max_volumes_per_node` (before any RPC), and the
//! one bounded ControllerGetVolume a volume status read makes.
//!
//! Must not: change a volume's lifecycle or records (publish keeps the claim and the steps);
//! make status reads wait on a volume's lock or on a plugin that does not answer; send a
//! topology to a plugin that does not advertise VOLUME_ACCESSIBILITY_CONSTRAINTS.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use csi_proto::v1;

use super::{VolumeError, VolumeManager, VolumeState, lock, refusal, retry_transient};
use crate::client::PluginServices;
use crate::config::Service;
use v1::controller_service_capability::rpc::Type as ControllerCap;
use v1::plugin_capability::service::Type as PluginService;

/// One topology segment map.
pub type Segments = BTreeMap<String, String>;

/// CreateVolume's `accessibility_requirements`, as a request gives them.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Requirements {
    pub requisite: Vec<Segments>,
    pub preferred: Vec<Segments>,
}

/// What the plugin's node side says about this node, asked once.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NodeInfo {
    pub node_id: String,
    /// `None` when the plugin reports no topology (or does not advertise
    /// VOLUME_ACCESSIBILITY_CONSTRAINTS, in which case its topology means nothing).
    pub accessible_topology: Option<Segments>,
    /// `None`: no limit (the spec's 0).
    pub max_volumes_per_node: Option<i64>,
    /// GetPluginCapabilities' services.
    pub services: PluginServices,
}

impl NodeInfo {
    fn has_topology_support(&self) -> bool {
        self.services
            .contains(&PluginService::VolumeAccessibilityConstraints)
    }
}

/// What ControllerGetVolume said of a volume.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ControllerView {
    Answered {
        published_node_ids: Vec<String>,
        /// `(abnormal, message)`, from plugins with the VOLUME_CONDITION controller
        /// capability.
        condition: Option<(bool, String)>,
    },
    /// The call failed or timed out: said on the volume, which is shown all the same.
    Failed(String),
}

/// How long a volume status read waits for ControllerGetVolume: a status read must stay
/// fast even when the plugin does not answer.
const GET_VOLUME_TIMEOUT: Duration = Duration::from_secs(2);

/// Keeps a publish of a volume not yet attached counted against the limit until it ends
/// (by then the volume's record holds its claim, or the claim was withdrawn).
#[derive(Debug)]
pub(super) struct AttachReservation<'a> {
    manager: Option<&'a VolumeManager>,
    volume_id: String,
}

impl Drop for AttachReservation<'_> {
    fn drop(&mut self) {
        if let Some(manager) = self.manager {
            lock(&manager.inner.attaching).remove(&self.volume_id);
        }
    }
}

fn segments(t: &v1::Topology) -> Segments {
    t.segments
        .iter()
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect()
}

fn topology(s: &Segments) -> v1::Topology {
    v1::Topology {
        segments: s.iter().map(|(k, v)| (k.clone(), v.clone())).collect(),
    }
}

impl VolumeManager {
    /// NodeGetInfo and GetPluginCapabilities, as last asked (no RPC): for status reads.
    pub fn cached_node_info(&self) -> Option<Arc<NodeInfo>> {
        lock(&self.inner.learned).node_info.clone()
    }

    /// What NodeGetInfo answered, if it was asked already (never asks).
    pub fn learned_node_info(&self) -> Option<Arc<NodeInfo>> {
        lock(&self.inner.learned).node_info.clone()
    }

    /// NodeGetInfo and GetPluginCapabilities, asked once per plugin configuration (retried
    /// while the plugin is unavailable, until `deadline`).
    pub async fn node_info(&self, deadline: Instant) -> Result<Arc<NodeInfo>, VolumeError> {
        let generation = {
            let learned = lock(&self.inner.learned);
            if let Some(info) = &learned.node_info {
                return Ok(Arc::clone(info));
            }
            learned.generation
        };
        let endpoints = &self.inner.endpoints;
        let steps = &self.inner.steps;
        let retry = self.inner.config.retry;
        let (info, services) = retry_transient(retry, deadline, || async {
            let _step = steps.read().await;
            let client = endpoints.client(Service::Node).await?;
            let info = client.node_get_info().await?;
            let services = client.get_plugin_capabilities().await?.services;
            Ok((info, services))
        })
        .await?;
        let mut node = NodeInfo {
            node_id: info.node_id,
            accessible_topology: info
                .accessible_topology
                .as_ref()
                .map(segments)
                .filter(|s| !s.is_empty()),
            // "The plugin MUST NOT set negative values here": a negative one is taken as
            // no limit rather than as a node that takes nothing.
            max_volumes_per_node: Some(info.max_volumes_per_node).filter(|n| *n > 0),
            services,
        };
        if !node.has_topology_support() {
            node.accessible_topology = None;
        }
        let node = Arc::new(node);
        let mut learned = lock(&self.inner.learned);
        if learned.generation == generation {
            learned.node_info = Some(Arc::clone(&node));
        }
        Ok(node)
    }

    /// Asks NodeGetInfo in the background when it was not asked yet, so that the plugin's
    /// status shows it soon without making the status read wait.
    pub fn refresh_node_info(&self) {
        if !self.inner.endpoints.serves(Service::Node) || self.cached_node_info().is_some() {
            return;
        }
        let manager = self.clone();
        tokio::spawn(async move {
            let deadline = Instant::now() + manager.inner.config.operation_timeout;
            if let Err(err) = manager.node_info(deadline).await {
                tracing::debug!(plugin = %manager.inner.config.plugin_type, error = %err, "NodeGetInfo for the plugin's status failed");
            }
        });
    }

    /// The `accessibility_requirements` of a CreateVolume: the request's own, or, for a
    /// plugin that advertises VOLUME_ACCESSIBILITY_CONSTRAINTS and reports a topology for
    /// this node, that topology as the only requisite and preferred one (a volume created
    /// here is meant to be used here). A request's own requirements to a plugin without
    /// topology support are refused before any RPC.
    pub(super) async fn accessibility_for(
        &self,
        requested: Option<&Requirements>,
    ) -> Result<Option<v1::TopologyRequirement>, VolumeError> {
        if requested.is_none() && !self.inner.endpoints.serves(Service::Node) {
            // A controller-only plugin configuration: no node to default to.
            return Ok(None);
        }
        let deadline = Instant::now() + self.inner.config.operation_timeout;
        let node = self.node_info(deadline).await?;
        if let Some(requested) = requested {
            self.require_topology(&node, "topology requirements")?;
            return Ok(Some(v1::TopologyRequirement {
                requisite: requested.requisite.iter().map(topology).collect(),
                preferred: requested.preferred.iter().map(topology).collect(),
            }));
        }
        Ok(node
            .accessible_topology
            .as_ref()
            .map(|t| v1::TopologyRequirement {
                requisite: vec![topology(t)],
                preferred: vec![topology(t)],
            }))
    }

    /// GetCapacity's `accessible_topology`, refused before any RPC for a plugin without
    /// topology support.
    pub(super) async fn capacity_topology(
        &self,
        requested: Option<&Segments>,
    ) -> Result<Option<v1::Topology>, VolumeError> {
        let Some(requested) = requested else {
            return Ok(None);
        };
        let deadline = Instant::now() + self.inner.config.operation_timeout;
        let node = self.node_info(deadline).await?;
        self.require_topology(&node, "capacity in a topology")?;
        Ok(Some(topology(requested)))
    }

    fn require_topology(
        &self,
        node: &NodeInfo,
        operation: &'static str,
    ) -> Result<(), VolumeError> {
        if node.has_topology_support() {
            return Ok(());
        }
        Err(VolumeError::Unsupported {
            plugin: self.inner.config.plugin_type.clone(),
            operation,
            capability: PluginService::VolumeAccessibilityConstraints.as_str_name(),
        })
    }

    /// Admits a publish of a volume not attached on this node yet against the plugin's
    /// `max_volumes_per_node`: attached are the volumes with a claim or node-side state, and
    /// the publishes of new volumes in flight (so that two at once cannot both take the last
    /// place). Refused before any lifecycle RPC, naming the volumes that hold the places.
    pub(super) async fn reserve_attachment(
        &self,
        volume_id: &str,
    ) -> Result<AttachReservation<'_>, VolumeError> {
        let deadline = Instant::now() + self.inner.config.operation_timeout;
        let node = match self.node_info(deadline).await {
            Ok(node) => Some(node),
            // A plugin that answers NodeGetInfo with a final error states no limit; the
            // publish goes on as before this check existed (a transient error until the
            // deadline means the plugin is not there: the publish could not go on anyway).
            Err(VolumeError::Plugin(err)) if !err.is_transient() => {
                tracing::warn!(plugin = %self.inner.config.plugin_type, error = %err, "NodeGetInfo failed; max_volumes_per_node not enforced for this publish");
                None
            }
            Err(err) => return Err(err),
        };
        let Some(max) = node.and_then(|n| n.max_volumes_per_node) else {
            return Ok(AttachReservation {
                manager: None,
                volume_id: volume_id.to_owned(),
            });
        };
        let mut attaching = lock(&self.inner.attaching);
        let mut attached: BTreeSet<String> = {
            let snapshot = self
                .inner
                .snapshot
                .read()
                .unwrap_or_else(|p| p.into_inner());
            snapshot
                .values()
                .filter(|r| !r.claims.is_empty() || r.state != VolumeState::Created)
                .map(|r| r.volume_id.clone())
                .collect()
        };
        attached.extend(attaching.iter().cloned());
        attached.remove(volume_id);
        if i64::try_from(attached.len()).unwrap_or(i64::MAX) >= max {
            return Err(refusal::Conflict::TooManyVolumesOnNode {
                plugin: self.inner.config.plugin_type.clone(),
                volume_id: volume_id.to_owned(),
                max,
                attached: attached.into_iter().collect(),
            }
            .into());
        }
        attaching.insert(volume_id.to_owned());
        Ok(AttachReservation {
            manager: Some(self),
            volume_id: volume_id.to_owned(),
        })
    }

    /// ControllerGetVolume for a status read, where the plugin advertises GET_VOLUME: one
    /// attempt, bounded by a short timeout, never under the volume's lock. `None` when the
    /// plugin does not advertise it, or its capabilities were not asked yet (no operation
    /// since it started or was reloaded): a status read does not wait for them, it has them
    /// asked in the background for the next read.
    pub async fn controller_view(&self, volume_id: &str) -> Option<ControllerView> {
        if !self.inner.endpoints.serves(Service::Controller) {
            return None;
        }
        let deadline = Instant::now() + GET_VOLUME_TIMEOUT;
        // Only capabilities already known: a status read must not wait for a plugin that is
        // still starting to tell what it advertises.
        let Some(caps) = lock(&self.inner.learned).caps.clone() else {
            // Asked in the background, so that the next read can show it.
            let manager = self.clone();
            tokio::spawn(async move {
                let deadline = Instant::now() + manager.inner.config.operation_timeout;
                let _ = manager.caps(deadline).await;
            });
            return None;
        };
        if !caps
            .controller
            .as_ref()
            .is_some_and(|c| c.contains(&ControllerCap::GetVolume))
        {
            return None;
        }
        let call = async {
            let client = self.inner.endpoints.client(Service::Controller).await?;
            client
                .controller_get_volume(v1::ControllerGetVolumeRequest {
                    volume_id: volume_id.to_owned(),
                })
                .await
        };
        let remaining = deadline.saturating_duration_since(Instant::now());
        Some(match tokio::time::timeout(remaining, call).await {
            Ok(Ok(response)) => {
                let status = response.status.unwrap_or_default();
                ControllerView::Answered {
                    published_node_ids: status.published_node_ids,
                    condition: status.volume_condition.map(|c| (c.abnormal, c.message)),
                }
            }
            Ok(Err(err)) => ControllerView::Failed(err.to_string()),
            Err(_) => ControllerView::Failed(format!(
                "ControllerGetVolume did not answer within {GET_VOLUME_TIMEOUT:?}"
            )),
        })
    }
}
