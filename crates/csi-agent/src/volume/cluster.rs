//! A cluster plugin's volumes: the volume manager's side of cluster mode (docs/cluster.md).
//!
//! Owns when the volume manager asks etcd, around its own steps: the claim before the
//! node's durable claim, the check that the hold is still this node's before any step up,
//! `ATTACHED` with the publish context after ControllerPublish, `NODE_DETACHED` before
//! ControllerUnpublish, the entry's removal after it; and the session's requests
//! ([`ClusterPlugin`]): freeing a fenced node's volumes, releasing what this node lost, and
//! sweeping orphans. It must not decide admission (cluster::claims) or hold etcd state.

use std::sync::Arc;
use std::time::Instant;

use csi_proto::v1;
use futures::future::BoxFuture;

use super::machine::{LifecycleCaps, LifecycleRpc};
use super::{Admission, Service, Slot, VolumeError, VolumeManager, VolumeRecord, VolumeState};
use crate::cluster::claims::ClaimRequest;
use crate::cluster::keys::{EntryState, PluginKey, SharedCapability};
use crate::cluster::{
    Also, Cluster, ClusterError, ClusterPlugin, FenceReport, Leadership, Own, random_id,
};
use crate::failpoint;

/// Where a drive going down stands with the cluster before ControllerUnpublish.
pub(super) enum BeforeDetach {
    /// The hold is this node's (or fenced and this node is back): detach it.
    Detach,
    /// The hold is gone (freed after a fence): another node may have the volume now, so
    /// this node sends no ControllerUnpublish for it.
    Skip,
}

impl VolumeManager {
    /// The cluster and this plugin's key there, when the plugin is a cluster plugin.
    pub(super) fn cluster(&self) -> Option<(&Cluster, PluginKey)> {
        let config = &self.inner.config;
        config.cluster.as_ref().map(|cluster| {
            (
                cluster,
                PluginKey {
                    plugin_type: config.plugin_type.clone(),
                    plugin_name: config.plugin_name.clone(),
                },
            )
        })
    }

    /// The lifecycle's steps for this node. A cluster plugin whose instance here serves no
    /// controller (deployed with its controller on other nodes) still has the ControllerPublish
    /// step when the cluster's plugin has it: the step is then asked of the leader
    /// (docs/cluster.md, "One controller per plugin").
    pub(super) async fn lifecycle_caps(
        &self,
        deadline: Instant,
    ) -> Result<LifecycleCaps, VolumeError> {
        let mut caps = self.caps(deadline).await?.lifecycle();
        if !caps.controller_publish
            && !self.inner.endpoints.serves(Service::Controller)
            && let Some((cluster, plugin)) = self.cluster()
        {
            caps.controller_publish = cluster.has_controller(&plugin).await?;
        }
        Ok(caps)
    }

    /// Takes this node's hold in etcd for a publish, before the node's own durable claim;
    /// the claim id goes into `record` with that write. True when it claimed.
    pub(super) async fn cluster_claim(
        &self,
        slot: &mut Slot,
        record: &mut VolumeRecord,
        workload: &str,
        deadline: Instant,
    ) -> Result<bool, VolumeError> {
        let Some((cluster, plugin)) = self.cluster() else {
            return Ok(false);
        };
        let Some(capability) = record.capability.as_ref() else {
            return Ok(false);
        };
        let caps = self.lifecycle_caps(deadline).await?;
        let csi_node_id = self.node_id(deadline).await?;
        // A record that already holds the volume (claims, or a state past CREATED) expects
        // its own entry; one that does not may take over an orphan of its own.
        let holds = !record.claims.is_empty() || record.state != VolumeState::Created;
        let expected_claim = if holds {
            record.cluster_claim.clone()
        } else {
            None
        };
        failpoint::hit("cluster.claim.before_txn")?;
        let claim_id = cluster
            .claim(
                &plugin,
                ClaimRequest {
                    volume_id: record.volume_id.clone(),
                    node: cluster.node().to_owned(),
                    workload: workload.to_owned(),
                    capability: SharedCapability::of(capability),
                    readonly: record.readonly,
                    csi_node_id,
                    expected_claim,
                    fresh_claim_id: random_id(),
                    start_state: if caps.controller_publish {
                        EntryState::Publishing
                    } else {
                        EntryState::Attached
                    },
                    volume_context: record.volume_context.clone(),
                    now: 0,
                },
            )
            .await;
        let claim_id = match claim_id {
            Ok((id, known)) => {
                slot.cluster_known = Some(known);
                id
            }
            Err(err @ ClusterError::Lost { .. }) => {
                // The hold was taken away: release the volume here, never use it.
                self.spawn_release_lost(&record.volume_id);
                return Err(err.into());
            }
            Err(err) => return Err(err.into()),
        };
        failpoint::hit("cluster.claim.after_txn")?;
        record.cluster_claim = Some(claim_id);
        Ok(true)
    }

    /// Before a step up: the hold must still be this node's, and the session healthy (a node
    /// that may have been fenced must not stage).
    pub(super) async fn cluster_confirm(&self, record: &VolumeRecord) -> Result<(), VolumeError> {
        let (Some((cluster, plugin)), Some(claim_id)) = (self.cluster(), &record.cluster_claim)
        else {
            return Ok(());
        };
        cluster.require_healthy()?;
        match cluster.own(&plugin, &record.volume_id, claim_id).await? {
            Own::Held(_) => Ok(()),
            Own::Fenced(_) | Own::Gone => {
                self.spawn_release_lost(&record.volume_id);
                Err(ClusterError::Lost {
                    volume_id: record.volume_id.clone(),
                    found: "the entry is fenced or gone".to_owned(),
                }
                .into())
            }
        }
    }

    /// After this node, as the plugin's leader, sent ControllerPublish: `ATTACHED`, with the
    /// publish context, in the entry, under the leadership.
    pub(super) async fn cluster_attached(
        &self,
        slot: &mut Slot,
        record: &VolumeRecord,
        leadership: &Leadership,
    ) -> Result<(), VolumeError> {
        let (Some((cluster, plugin)), Some(claim_id)) = (self.cluster(), &record.cluster_claim)
        else {
            return Ok(());
        };
        let context = record.publish_context.clone();
        let (own, known) = cluster
            .update_own(
                &plugin,
                &record.volume_id,
                claim_id,
                slot.cluster_known.take(),
                &Also::led(Some(leadership)),
                |entry| {
                    entry.state = EntryState::Attached;
                    entry.publish_context = context.clone();
                },
            )
            .await?;
        slot.cluster_known = known;
        match own {
            Own::Held(_) => Ok(()),
            Own::Fenced(_) | Own::Gone => {
                self.spawn_release_lost(&record.volume_id);
                Err(ClusterError::Lost {
                    volume_id: record.volume_id.clone(),
                    found: "the entry was fenced or removed during ControllerPublish".to_owned(),
                }
                .into())
            }
        }
    }

    /// Before ControllerUnpublish: `NODE_DETACHED` (this node's NodeUnpublish and NodeUnstage
    /// are done), or the news that the hold is gone.
    pub(super) async fn cluster_before_detach(
        &self,
        slot: &mut Slot,
        record: &VolumeRecord,
    ) -> Result<BeforeDetach, VolumeError> {
        let (Some((cluster, plugin)), Some(claim_id)) = (self.cluster(), &record.cluster_claim)
        else {
            return Ok(BeforeDetach::Detach);
        };
        failpoint::hit("cluster.release.before_txn")?;
        let (own, known) = cluster
            .update_own(
                &plugin,
                &record.volume_id,
                claim_id,
                slot.cluster_known.take(),
                &Also::default(),
                |entry| {
                    entry.state = EntryState::NodeDetached;
                    entry.workloads.clear();
                },
            )
            .await
            .map_err(release_pending)?;
        slot.cluster_known = known;
        Ok(match own {
            Own::Held(_) | Own::Fenced(_) => BeforeDetach::Detach,
            Own::Gone => BeforeDetach::Skip,
        })
    }

    /// After the volume went down to CREATED with no claim: the entry is removed (its
    /// ControllerUnpublish is done, or was not needed). `detached` says whether this drive
    /// did the ControllerUnpublish step; when it did not, the record may be behind (its
    /// progress notes lost in a crash after ControllerPublish) while etcd still holds this
    /// node's entry, so the idempotent ControllerUnpublish is done first, with the CSI node
    /// id the entry recorded: never a removal that could leave the volume attached here. A
    /// controller step goes through the plugin's leader, and so does the removal after it.
    pub(super) async fn cluster_release(
        &self,
        slot: &mut Slot,
        record: &mut VolumeRecord,
        detached: bool,
        deadline: Instant,
    ) -> Result<bool, VolumeError> {
        let (Some((cluster, plugin)), Some(claim_id)) =
            (self.cluster(), record.cluster_claim.clone())
        else {
            return Ok(false);
        };
        // The plugin's capabilities are cached: asked first, they spare a plugin without a
        // controller step the read of its entry.
        let controller = self.lifecycle_caps(deadline).await?.controller_publish;
        let leadership = cluster.leadership(&plugin);
        if controller && (!detached || leadership.is_none()) {
            let own = cluster
                .own(&plugin, &record.volume_id, &claim_id)
                .await
                .map_err(release_pending)?;
            if let Own::Held(entry) | Own::Fenced(entry) = own {
                match &leadership {
                    Some(_) => {
                        let _lane = self.inner.controller_lane.lock().await;
                        self.detach_from(&record.volume_id, &entry.csi_node_id)
                            .await
                            .map_err(VolumeError::Plugin)?;
                    }
                    // The leader detaches it and removes the entry.
                    None => {
                        self.hand_to_leader(
                            slot,
                            record,
                            &plugin,
                            &claim_id,
                            LifecycleRpc::ControllerUnpublish,
                            deadline,
                        )
                        .await?
                    }
                }
            }
        }
        // A plugin with a controller step: only its leader removes an entry (a handed-over
        // step's is gone already). Without one, the node removes its own.
        let also = Also::led(leadership.as_ref());
        if !controller || leadership.is_some() {
            cluster
                .remove_entry(
                    &plugin,
                    &record.volume_id,
                    cluster.node(),
                    &claim_id,
                    slot.cluster_known.take(),
                    &also,
                )
                .await
                .map_err(release_pending)?;
        }
        failpoint::hit("cluster.release.after_txn")?;
        record.cluster_claim = None;
        slot.cluster_known = None;
        Ok(true)
    }

    pub(super) fn spawn_release_lost(&self, volume_id: &str) {
        let manager = self.clone();
        let volume_id = volume_id.to_owned();
        tokio::spawn(async move {
            if let Err(err) = manager.release_lost_volume(&volume_id).await {
                tracing::warn!(plugin = %manager.inner.config.plugin_type, volume_id = ?volume_id, error = %err, "a volume whose hold was lost is not released yet");
            }
        });
    }

    /// Releases a volume whose hold this node lost: every claim withdrawn (binds undone),
    /// node side torn down; ControllerUnpublish only while the entry is still this node's
    /// (fenced), never after it was freed.
    async fn release_lost_volume(&self, volume_id: &str) -> Result<bool, VolumeError> {
        let Some(record) = self.snapshot_of(volume_id) else {
            return Ok(false);
        };
        let (Some((cluster, plugin)), Some(claim_id)) = (self.cluster(), &record.cluster_claim)
        else {
            return Ok(false);
        };
        if let Own::Held(_) = cluster.own(&plugin, volume_id, claim_id).await? {
            return Ok(false);
        }
        let workloads: Vec<String> = record.claims.iter().cloned().collect();
        tracing::warn!(plugin = %self.inner.config.plugin_type, volume_id = ?volume_id, workloads = ?workloads, "this node's hold on the volume was taken away: releasing it here without using it");
        for workload in &workloads {
            self.unpublish_inner(volume_id, workload, Admission::Drain)
                .await?;
        }
        if workloads.is_empty() {
            self.reconcile_as(volume_id, Admission::Drain).await?;
        }
        Ok(true)
    }

    /// ControllerUnpublish of a volume from `csi_node_id` (never empty: an empty node id
    /// asks to unpublish from every node).
    pub(super) async fn detach_from(
        &self,
        volume_id: &str,
        csi_node_id: &str,
    ) -> Result<(), crate::client::RpcError> {
        let client = self.inner.endpoints.client(Service::Controller).await?;
        let _step = self.inner.steps.read().await;
        client
            .controller_unpublish_volume(v1::ControllerUnpublishVolumeRequest {
                volume_id: volume_id.to_owned(),
                node_id: csi_node_id.to_owned(),
                ..Default::default()
            })
            .await
            .map(|_| ())
    }
}

/// An etcd that cannot answer while a volume goes down leaves the release pending: the
/// node side is done and the reconciler writes the rest when etcd is back.
pub(super) fn release_pending(err: ClusterError) -> VolumeError {
    if err.is_unavailable() {
        VolumeError::ClusterReleasePending(Box::new(err))
    } else {
        err.into()
    }
}

/// A cluster plugin's volume manager, as the session reaches it.
#[derive(Debug)]
pub struct ClusterVolumes(pub VolumeManager);

impl ClusterVolumes {
    pub fn handle(manager: VolumeManager) -> Arc<dyn ClusterPlugin> {
        Arc::new(Self(manager))
    }
}

impl ClusterPlugin for ClusterVolumes {
    fn plugin_key(&self) -> PluginKey {
        let config = &self.0.inner.config;
        PluginKey {
            plugin_type: config.plugin_type.clone(),
            plugin_name: config.plugin_name.clone(),
        }
    }

    fn free_fenced<'a>(&'a self, node: &'a str) -> BoxFuture<'a, FenceReport> {
        Box::pin(async move {
            let manager = &self.0;
            let mut report = FenceReport {
                node: node.to_owned(),
                ..FenceReport::default()
            };
            let Some((cluster, plugin)) = manager.cluster() else {
                return report;
            };
            let entries = match cluster.entries_of(&plugin, node).await {
                Ok(entries) => entries,
                Err(err) => {
                    report.left.push(format!("{}: {err}", plugin.plugin_type));
                    return report;
                }
            };
            if entries.is_empty() {
                return report;
            }
            let deadline = Instant::now() + manager.inner.config.operation_timeout;
            let controller_publish = match manager.lifecycle_caps(deadline).await {
                Ok(caps) => caps.controller_publish,
                Err(err) => {
                    for (volume_id, _) in &entries {
                        report
                            .left
                            .push(format!("{volume_id}: plugin not ready: {err}"));
                    }
                    return report;
                }
            };
            // A plugin with a controller step is freed by its leader alone, each write under
            // the leadership; without one, any daemon running it may free the entries.
            let leadership = cluster.leadership(&plugin);
            if controller_publish && leadership.is_none() {
                let leader = cluster
                    .leader_node(&plugin)
                    .unwrap_or_else(|| "none elected yet".to_owned());
                for (volume_id, _) in &entries {
                    report.left.push(format!(
                        "{volume_id}: freed by the controller leader of plugin {} (node {leader})",
                        plugin.plugin_type
                    ));
                }
                return report;
            }
            let also = Also::led(leadership.as_ref());
            for (volume_id, _) in entries {
                let outcome: Result<(), String> = async {
                    let Some(entry) = cluster
                        .mark_fenced(&plugin, &volume_id, node, &also)
                        .await
                        .map_err(|e| e.to_string())?
                    else {
                        return Ok(());
                    };
                    failpoint::hit("cluster.fence.after_mark").map_err(|e| e.to_string())?;
                    if controller_publish {
                        // Only an OK proves the detach: NOT_FOUND means "volume not assumed
                        // ControllerUnpublished" in the spec's words, so the entry stays
                        // (fenced), is reported and retried.
                        let _lane = manager.inner.controller_lane.lock().await;
                        manager
                            .detach_from(&volume_id, &entry.csi_node_id)
                            .await
                            .map_err(|e| e.to_string())?;
                    }
                    failpoint::hit("cluster.fence.after_rpc").map_err(|e| e.to_string())?;
                    cluster
                        .remove_entry(&plugin, &volume_id, node, &entry.claim_id, None, &also)
                        .await
                        .map_err(|e| e.to_string())
                }
                .await;
                match outcome {
                    Ok(()) => report.freed.push(volume_id),
                    Err(err) => report.left.push(format!("{volume_id}: {err}")),
                }
            }
            report
        })
    }

    fn release_lost(&self) -> BoxFuture<'_, Result<Vec<String>, String>> {
        Box::pin(async move {
            let manager = &self.0;
            let mut released = Vec::new();
            let ids: Vec<String> = manager
                .list_snapshot()
                .iter()
                .filter(|r| r.cluster_claim.is_some())
                .map(|r| r.volume_id.clone())
                .collect();
            for volume_id in ids {
                if manager
                    .release_lost_volume(&volume_id)
                    .await
                    .map_err(|e| format!("volume {volume_id}: {e}"))?
                {
                    released.push(volume_id);
                }
            }
            Ok(released)
        })
    }

    fn sweep_orphans(&self) -> BoxFuture<'_, Result<(), String>> {
        Box::pin(async move {
            let manager = &self.0;
            let Some((cluster, plugin)) = manager.cluster() else {
                return Ok(());
            };
            let entries = cluster
                .entries_of(&plugin, cluster.node())
                .await
                .map_err(|e| e.to_string())?;
            for (volume_id, entry) in entries {
                // Under the volume's lock: a publish between its claim and its record holds it.
                let slot = manager.slot(&volume_id);
                let guard = slot.lock().await;
                let explained = guard
                    .record
                    .as_ref()
                    .is_some_and(|r| r.cluster_claim.as_deref() == Some(entry.claim_id.as_str()));
                if explained {
                    continue;
                }
                // No record names this claim: the crash came between the claim and the
                // node's own record, before any RPC (the record is written first).
                tracing::info!(plugin = %plugin.plugin_type, volume_id = ?volume_id, "orphan claim of this node removed");
                cluster
                    .remove_entry(
                        &plugin,
                        &volume_id,
                        cluster.node(),
                        &entry.claim_id,
                        None,
                        &Also::default(),
                    )
                    .await
                    .map_err(|e| e.to_string())?;
                drop(guard);
            }
            Ok(())
        })
    }

    fn csi_node(&self) -> Option<crate::cluster::keys::CsiNode> {
        let manager = &self.0;
        let info = manager.learned_node_info();
        let node_id = manager
            .inner
            .config
            .node_id
            .clone()
            .or_else(|| info.as_ref().map(|i| i.node_id.clone()))
            .filter(|id| !id.is_empty())?;
        Some(crate::cluster::keys::CsiNode {
            node_id,
            topology: info
                .and_then(|i| i.accessible_topology.clone())
                .unwrap_or_default(),
        })
    }

    fn controller_step_known(&self) -> Option<bool> {
        self.0
            .learned_caps()
            .map(|caps| caps.lifecycle().controller_publish)
    }

    fn wants_leadership(&self) -> BoxFuture<'_, bool> {
        Box::pin(async move {
            let manager = &self.0;
            let deadline = Instant::now() + manager.inner.config.operation_timeout;
            manager
                .caps(deadline)
                .await
                .is_ok_and(|caps| caps.lifecycle().controller_publish)
        })
    }

    fn serve(&self, leadership: Leadership) -> BoxFuture<'_, Result<(), ClusterError>> {
        Box::pin(self.0.serve_pending(leadership))
    }
}
