//! A cluster plugin's controller steps run on its one elected leader (docs/cluster.md, "One
//! controller per plugin").
//!
//! Owns both sides of a handed-over step: the requester's (its entry asks, with a pending
//! hint, in one transaction; then it waits for the leader's result in the entry) and the
//! leader's (it sends ControllerPublish or ControllerUnpublish for the entries that ask, one
//! at a time, and writes each result under its leadership). A node that leads sends its own
//! steps itself, under the same one-at-a-time lane. It must not decide who leads
//! (cluster::leader) or admit claims (cluster::claims).

use std::time::{Duration, Instant};

use csi_proto::v1;

use super::machine::LifecycleRpc;
use super::{Service, Slot, VolumeError, VolumeManager, VolumeRecord};
use crate::cluster::keys::{EntryState, PluginKey};
use crate::cluster::leader::{Settle, Work};
use crate::cluster::{Also, ClusterError, Leadership, Own};
use crate::volume::machine::LifecycleCaps;
use crate::volume::to_hash_map;

/// How often a node waiting for the leader reads its entry when etcd would not watch it.
const WAIT_EVERY: Duration = Duration::from_millis(10);
/// How often it reads its entry anyway while a watch wakes it on every change of the key (a
/// watch whose stream silently stalled costs this much, never the result).
const WATCHED_WAIT: Duration = Duration::from_secs(1);

impl VolumeManager {
    /// One lifecycle RPC of a drive. A cluster plugin's controller step goes through the
    /// plugin's leader: sent here when this node leads, handed over otherwise.
    pub(super) async fn controller_step_or_rpc(
        &self,
        slot: &mut Slot,
        record: &mut VolumeRecord,
        rpc: LifecycleRpc,
        caps: LifecycleCaps,
        deadline: Instant,
    ) -> Result<(), VolumeError> {
        let controller = matches!(
            rpc,
            LifecycleRpc::ControllerPublish | LifecycleRpc::ControllerUnpublish
        );
        let (Some((cluster, plugin)), true, Some(claim_id)) =
            (self.cluster(), controller, record.cluster_claim.clone())
        else {
            return self.run_rpc(slot, record, rpc, caps, deadline).await;
        };
        if let Some(leadership) = cluster.leadership(&plugin) {
            let lane = self.inner.controller_lane.lock().await;
            self.run_rpc(slot, record, rpc, caps, deadline).await?;
            if rpc == LifecycleRpc::ControllerUnpublish {
                // The entry goes in the release, under the leadership.
                return Ok(());
            }
            match self.cluster_attached(slot, record, &leadership).await {
                Err(VolumeError::Cluster(err)) if matches!(*err, ClusterError::Deposed { .. }) => {
                    drop(lane);
                    tracing::info!(plugin = %plugin.plugin_type, volume_id = ?record.volume_id, "leadership ended during ControllerPublish; the new leader does it again");
                }
                other => return other,
            }
        }
        self.hand_to_leader(slot, record, &plugin, &claim_id, rpc, deadline)
            .await
    }

    /// Asks the plugin's leader for a controller step and waits for its result in the entry.
    /// An unpublish that cannot complete now is a pending release (the node side is done).
    pub(super) async fn hand_to_leader(
        &self,
        slot: &mut Slot,
        record: &mut VolumeRecord,
        plugin: &PluginKey,
        claim_id: &str,
        rpc: LifecycleRpc,
        deadline: Instant,
    ) -> Result<(), VolumeError> {
        let publish = rpc == LifecycleRpc::ControllerPublish;
        let fail = |err: ClusterError| -> VolumeError {
            if publish {
                err.into()
            } else {
                super::cluster::release_pending(err)
            }
        };
        let Some((cluster, _)) = self.cluster() else {
            return Ok(());
        };
        let volume_id = record.volume_id.clone();
        // The request: the entry (its last refusal cleared; NODE_DETACHED for an unpublish)
        // and the pending hint, in one transaction.
        let also = Also {
            ops: vec![cluster.pending_put(plugin, &volume_id)],
            ..Also::default()
        };
        let (mut own, known) = cluster
            .update_own(
                plugin,
                &volume_id,
                claim_id,
                slot.cluster_known.take(),
                &also,
                |entry| {
                    entry.error = None;
                    if !publish {
                        entry.state = EntryState::NodeDetached;
                        entry.workloads.clear();
                    }
                },
            )
            .await
            .map_err(fail)?;
        // Woken by the next change of the volume's key (the leader's result is one) instead of
        // reading it every WAIT_EVERY; without a watch, it reads at that pace.
        let mut changes = match &known {
            Some(known) => cluster
                .watch_volume(plugin, &volume_id, known.revision + 1)
                .await
                .ok(),
            None => None,
        };
        let step = rpc.name();
        loop {
            match (&own, publish) {
                (Own::Held(entry), true) if entry.state == EntryState::Attached => {
                    record.publish_context = entry.publish_context.clone();
                    return Ok(());
                }
                (Own::Gone, false) => return Ok(()),
                (Own::Fenced(_) | Own::Gone, true) => {
                    self.spawn_release_lost(&volume_id);
                    return Err(ClusterError::Lost {
                        volume_id,
                        found: "the entry is fenced or gone".to_owned(),
                    }
                    .into());
                }
                (Own::Held(entry) | Own::Fenced(entry), _) => {
                    if let Some(message) = &entry.error {
                        return Err(ClusterError::LeaderRefused {
                            volume_id,
                            step,
                            leader: cluster.leader_node(plugin).unwrap_or_default(),
                            message: message.clone(),
                        }
                        .into());
                    }
                }
            }
            if Instant::now() >= deadline {
                let leader = cluster
                    .leader_node(plugin)
                    .unwrap_or_else(|| "none elected yet".to_owned());
                return Err(fail(ClusterError::Unavailable {
                    reason: format!(
                        "the controller leader of plugin {} (node {leader}) has not done {step} \
                         of volume {volume_id} in time; it is asked again by the next retry",
                        plugin.plugin_type
                    ),
                }));
            }
            match changes.as_mut() {
                Some(watch) => {
                    let until = deadline.min(Instant::now() + WATCHED_WAIT);
                    tokio::select! {
                        changed = watch.changed() => if changed.is_err() {
                            changes = None;
                        },
                        () = tokio::time::sleep_until(until.into()) => {}
                    }
                }
                None => tokio::time::sleep(WAIT_EVERY).await,
            }
            own = cluster
                .own(plugin, &volume_id, claim_id)
                .await
                .map_err(fail)?;
        }
    }

    /// As the plugin's leader: every volume with a pending hint, each entry that asks, one
    /// step at a time. A transient failure leaves the entry asking (tried again next time); a
    /// refusal is written into the entry for its node to report. One volume's trouble (an
    /// unreadable claims key, forged or of a newer schema) is that volume's: the others are
    /// served; only etcd's unavailability or the end of the leadership stops the round.
    pub(super) async fn serve_pending(&self, leadership: Leadership) -> Result<(), ClusterError> {
        let Some((cluster, plugin)) = self.cluster() else {
            return Ok(());
        };
        for (volume_id, hint_revision) in cluster.pending_volumes(&plugin).await? {
            match self
                .serve_volume(&plugin, &volume_id, hint_revision, &leadership)
                .await
            {
                Ok(()) => {}
                Err(err) if err.is_unavailable() => return Err(err),
                Err(err) => {
                    let key = format!("{}/{volume_id}", plugin.plugin_type);
                    if cluster.first_warning(key.as_bytes()) {
                        tracing::warn!(plugin = %plugin.plugin_type, volume_id = ?volume_id, error = %err, "pending controller work of a volume skipped; the other volumes are served");
                    }
                }
            }
        }
        Ok(())
    }

    /// The leader's work on one volume with a pending hint.
    async fn serve_volume(
        &self,
        plugin: &PluginKey,
        volume_id: &str,
        hint_revision: i64,
        leadership: &Leadership,
    ) -> Result<(), ClusterError> {
        let Some((cluster, _)) = self.cluster() else {
            return Ok(());
        };
        let _lane = self.inner.controller_lane.lock().await;
        // Bounded: each round settles one entry (or stops), and a value holds at most
        // MAX_NODES_PER_VOLUME entries.
        for _ in 0..=crate::cluster::keys::MAX_NODES_PER_VOLUME {
            let Some(work) = cluster.next_work(plugin, volume_id).await? else {
                cluster
                    .clear_pending(plugin, volume_id, hint_revision, leadership)
                    .await?;
                break;
            };
            let result = self.leader_rpc(volume_id, &work).await;
            // Killed here, the step was sent and its result is not in etcd: the next
            // leader sends it again (the RPCs are idempotent).
            crate::failpoint::hit("cluster.leader.after_rpc").map_err(|err| {
                ClusterError::Unavailable {
                    reason: err.to_string(),
                }
            })?;
            let settle = match result {
                Ok(settle) => settle,
                Err(err) if super::is_transient(&err) => {
                    tracing::info!(plugin = %plugin.plugin_type, volume_id = ?volume_id, node = %work.node, error = %err, "controller step for another node failed for now; trying again");
                    break;
                }
                Err(err) => Settle::Refused(err.to_string()),
            };
            cluster
                .settle(plugin, volume_id, &work, leadership, settle)
                .await?;
        }
        Ok(())
    }

    /// The leader's RPC for one entry: ControllerPublish of a `PUBLISHING` entry to its
    /// node, ControllerUnpublish of a `NODE_DETACHED` one from it.
    async fn leader_rpc(&self, volume_id: &str, work: &Work) -> Result<Settle, VolumeError> {
        // Never empty: an empty node id asks the plugin to unpublish from every node.
        if work.entry.csi_node_id.is_empty() {
            return Ok(Settle::Refused(format!(
                "node {}'s entry has no CSI node id",
                work.node
            )));
        }
        if work.entry.state == EntryState::NodeDetached {
            self.detach_from(volume_id, &work.entry.csi_node_id)
                .await
                .map_err(VolumeError::Plugin)?;
            return Ok(Settle::Detached);
        }
        let client = self
            .inner
            .endpoints
            .client(Service::Controller)
            .await
            .map_err(VolumeError::Plugin)?;
        let _step = self.inner.steps.read().await;
        let response = client
            .controller_publish_volume(v1::ControllerPublishVolumeRequest {
                volume_id: volume_id.to_owned(),
                node_id: work.entry.csi_node_id.clone(),
                volume_capability: Some(work.capability.to_capability().to_v1()),
                readonly: work.entry.readonly,
                volume_context: to_hash_map(&work.entry.volume_context),
                ..Default::default()
            })
            .await
            .map_err(VolumeError::Plugin)?;
        Ok(Settle::Attached(
            response.publish_context.into_iter().collect(),
        ))
    }
}
