//! Volume expansion: `ControllerExpandVolume` where the controller advertises
//! `EXPAND_VOLUME`, then `NodeExpandVolume` on this node where the answer says
//! `node_expansion_required` (or where only the node advertises `EXPAND_VOLUME`).
//!
//! Owns: the expansion intent on the volume's record ([`Expansion`]: the capacity asked and
//! the step that comes next), written durably before the first RPC (the one durable write of
//! an expansion; each step's result is a progress note) so that a daemon killed
//! at any point resumes the expansion on restart ([`VolumeManager::resume_expansion`],
//! started by recovery); the order of the two steps; the refusals made before any RPC (a
//! plugin that can expand neither side: `Unsupported`; an OFFLINE plugin and a published
//! volume: `Conflict` naming the claims; a size below the volume's: `InvalidRequest`).
//!
//! Must not: change the volume's lifecycle state, claims or binds (a node step waits for a
//! volume that is not staged or published on this node: the next expansion or restart runs
//! it), or wait for anything but the volume's own lock. Block volumes are expanded the same
//! way; the plugin decides what growing a device means.

use std::future::Future;
use std::time::Instant;

use csi_proto::v1;
use serde::{Deserialize, Serialize};
use v1::controller_service_capability::rpc::Type as ControllerCap;
use v1::node_service_capability::rpc::Type as NodeCap;
use v1::plugin_capability::volume_expansion::Type as ExpansionType;

use super::refusal::{Conflict, InvalidRequest};
use super::{
    Slot, VolumeError, VolumeManager, VolumeRecord, VolumeState, retry_transient, validate_id,
};
use crate::backoff::Backoff;
use crate::client::{CsiClient, RpcError};
use crate::config::Service;
use crate::failpoint;

/// An expansion asked and not finished, durable on the volume's record.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Expansion {
    /// The capacity asked, in bytes.
    pub capacity_bytes: i64,
    /// The step still to do.
    pub next: ExpansionStep,
}

/// The step of an [`Expansion`] still to do.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ExpansionStep {
    /// ControllerExpandVolume (then perhaps the node step).
    Controller,
    /// NodeExpandVolume on this node, where the volume is staged or published.
    Node,
}

impl ExpansionStep {
    pub fn as_str(self) -> &'static str {
        match self {
            ExpansionStep::Controller => "controller",
            ExpansionStep::Node => "node",
        }
    }
}

/// What the plugin can do for an expansion.
#[derive(Clone, Copy, Debug)]
struct ExpandCaps {
    controller: bool,
    node: bool,
    offline: bool,
}

impl VolumeManager {
    /// The plugin's expansion capabilities; `Unsupported` when neither side can expand.
    async fn expand_caps(&self, deadline: Instant) -> Result<ExpandCaps, VolumeError> {
        let caps = self.caps(deadline).await?;
        let controller = caps
            .controller
            .as_ref()
            .is_some_and(|c| c.contains(&ControllerCap::ExpandVolume));
        let node = caps.node.contains(&NodeCap::ExpandVolume);
        if !controller && !node {
            return Err(VolumeError::Unsupported {
                plugin: self.inner.config.plugin_type.clone(),
                operation: "expanding volumes",
                capability: ControllerCap::ExpandVolume.as_str_name(),
            });
        }
        let endpoints = &self.inner.endpoints;
        let steps = &self.inner.steps;
        let retry = self.inner.config.retry;
        let expansion = caps
            .expansion
            .get_or_try_init(|| async {
                retry_transient(retry, deadline, || async {
                    let _step = steps.read().await;
                    let service = if endpoints.serves(Service::Controller) {
                        Service::Controller
                    } else {
                        Service::Node
                    };
                    let client = endpoints.client(service).await?;
                    Ok(client.get_plugin_capabilities().await?.volume_expansion)
                })
                .await
            })
            .await?;
        Ok(ExpandCaps {
            controller,
            node,
            offline: *expansion == Some(ExpansionType::Offline),
        })
    }

    /// One expansion RPC to `service`, retried on transient errors until `deadline`, ordered
    /// with reloads like every step.
    async fn expand_rpc<Req, T, F, Fut>(
        &self,
        service: Service,
        deadline: Instant,
        request: Req,
        call: F,
    ) -> Result<T, VolumeError>
    where
        Req: Clone,
        F: Fn(CsiClient, Req) -> Fut,
        Fut: Future<Output = Result<T, RpcError>>,
    {
        let endpoints = &self.inner.endpoints;
        let steps = &self.inner.steps;
        retry_transient(self.inner.config.retry, deadline, || {
            let request = request.clone();
            let call = &call;
            async move {
                let _step = steps.read().await;
                let client = endpoints.client(service).await?;
                call(client, request).await
            }
        })
        .await
    }

    /// Expands volume `volume_id` to at least `capacity_bytes`, answering its record once the
    /// expansion is done (or waits only for a node step: see the module doc). The intent is
    /// durable before any RPC; a repeat of a finished expansion to the same size sends
    /// ControllerExpandVolume again (idempotent by the spec) and changes nothing.
    pub async fn expand(
        &self,
        volume_id: &str,
        capacity_bytes: i64,
    ) -> Result<VolumeRecord, VolumeError> {
        validate_id("volume_id", volume_id)?;
        if capacity_bytes <= 0 {
            return Err(InvalidRequest::ExpandCapacity(capacity_bytes).into());
        }
        let _ticket = self.enter(volume_id, "expand", super::Admission::Request)?;
        let deadline = Instant::now() + self.inner.config.operation_timeout;
        let caps = self.expand_caps(deadline).await?;
        let slot = self.slot(volume_id);
        let mut guard = slot.lock().await;
        let Some(mut record) = guard.record.as_deref().cloned() else {
            return Err(InvalidRequest::ExpandUnknown {
                volume_id: volume_id.to_owned(),
            }
            .into());
        };
        if capacity_bytes < record.capacity_bytes {
            return Err(InvalidRequest::ExpandSmaller {
                volume_id: volume_id.to_owned(),
                requested: capacity_bytes,
                current: record.capacity_bytes,
            }
            .into());
        }
        // "If the plugin has only VolumeExpansion.OFFLINE expansion capability and volume is
        // currently published or available on a node then ControllerExpandVolume MUST be
        // called ONLY after" it is unpublished: refused here, before any RPC.
        if caps.offline && (!record.claims.is_empty() || record.state.is_node_side()) {
            return Err(Conflict::ExpandOffline {
                volume_id: volume_id.to_owned(),
                claims: record.claims.iter().cloned().collect(),
            }
            .into());
        }
        let _running = self.inner.progress.begin(volume_id, "expand");
        record.expansion = Some(Expansion {
            capacity_bytes,
            next: if caps.controller {
                ExpansionStep::Controller
            } else {
                ExpansionStep::Node
            },
        });
        failpoint::hit("volume.expand.before_intent")?;
        self.persist(&mut guard, record.clone()).await?;
        self.drive_expansion(&mut guard, record, caps, deadline)
            .await
    }

    /// Runs the steps of the record's expansion from the one it names, making each result
    /// durable. Returns the record as last written.
    async fn drive_expansion(
        &self,
        slot: &mut Slot,
        mut record: VolumeRecord,
        caps: ExpandCaps,
        deadline: Instant,
    ) -> Result<VolumeRecord, VolumeError> {
        let volume_id = record.volume_id.clone();
        while let Some(expansion) = record.expansion.clone() {
            match expansion.next {
                ExpansionStep::Controller => {
                    self.inner
                        .progress
                        .trying(&volume_id, "controller_expand", 1);
                    let request = v1::ControllerExpandVolumeRequest {
                        volume_id: volume_id.clone(),
                        capacity_range: Some(v1::CapacityRange {
                            required_bytes: expansion.capacity_bytes,
                            limit_bytes: 0,
                        }),
                        volume_capability: record.capability.as_ref().map(|c| c.to_v1()),
                        ..Default::default()
                    };
                    failpoint::hit("volume.expand.controller.before_rpc")?;
                    let response = self
                        .expand_rpc(Service::Controller, deadline, request, |c, r| async move {
                            c.controller_expand_volume(r).await
                        })
                        .await?;
                    failpoint::hit("volume.expand.controller.after_rpc")?;
                    // "capacity_bytes: Capacity of volume after expansion. This field is
                    // REQUIRED." A plugin that answers 0 is taken at the size asked.
                    record.capacity_bytes = if response.capacity_bytes > 0 {
                        response.capacity_bytes
                    } else {
                        expansion.capacity_bytes
                    };
                    // "node_expansion_required: ... When true the CO MUST make
                    // NodeExpandVolume RPC call on the node."
                    record.expansion = if response.node_expansion_required {
                        if !caps.node {
                            tracing::warn!(plugin = %self.inner.config.plugin_type, volume_id = ?volume_id, "the controller asks for NodeExpandVolume but the node does not advertise EXPAND_VOLUME; calling it anyway");
                        }
                        Some(Expansion {
                            next: ExpansionStep::Node,
                            ..expansion
                        })
                    } else {
                        None
                    };
                }
                ExpansionStep::Node => {
                    let Some((volume_path, staging)) = self.expansion_paths(&record) else {
                        // Not on this node now: the intent stays, and the node step runs at
                        // the next expansion or restart while it is.
                        tracing::info!(plugin = %self.inner.config.plugin_type, volume_id = ?volume_id, "NodeExpandVolume waits until the volume is staged or published on this node");
                        break;
                    };
                    self.inner.progress.trying(&volume_id, "node_expand", 1);
                    let request = v1::NodeExpandVolumeRequest {
                        volume_id: volume_id.clone(),
                        volume_path: volume_path.to_string_lossy().into_owned(),
                        staging_target_path: staging
                            .map(|s| s.to_string_lossy().into_owned())
                            .unwrap_or_default(),
                        capacity_range: Some(v1::CapacityRange {
                            required_bytes: expansion.capacity_bytes,
                            limit_bytes: 0,
                        }),
                        volume_capability: record.capability.as_ref().map(|c| c.to_v1()),
                        ..Default::default()
                    };
                    failpoint::hit("volume.expand.node.before_rpc")?;
                    let response = self
                        .expand_rpc(Service::Node, deadline, request, |c, r| async move {
                            c.node_expand_volume(r).await
                        })
                        .await?;
                    failpoint::hit("volume.expand.node.after_rpc")?;
                    // "capacity_bytes: The capacity of the volume in bytes. This field is
                    // OPTIONAL."
                    record.capacity_bytes = record
                        .capacity_bytes
                        .max(response.capacity_bytes)
                        .max(expansion.capacity_bytes);
                    record.expansion = None;
                }
            }
            // A progress note, not a durable write: the intent is durable, and a note lost in a
            // crash only makes recovery repeat the steps, which the spec makes idempotent
            // (ControllerExpandVolume: "If a volume corresponding to the specified volume ID
            // is already larger than or equal to the target capacity of the expansion
            // request, the plugin SHOULD reply 0 OK"). One durable write per expansion.
            self.note(slot, record.clone())?;
        }
        if record.expansion.is_none() {
            tracing::info!(plugin = %self.inner.config.plugin_type, volume_id = ?volume_id, capacity_bytes = record.capacity_bytes, "volume expanded");
        }
        Ok(record)
    }

    /// Where NodeExpandVolume finds the volume on this node: `(volume_path, staging path)`;
    /// `None` while it is neither staged nor published (or between two steps).
    fn expansion_paths(
        &self,
        record: &VolumeRecord,
    ) -> Option<(std::path::PathBuf, Option<std::path::PathBuf>)> {
        let id = &record.volume_id;
        match record.state {
            VolumeState::Published => {
                // The staging path is passed only when the volume was staged: the record of
                // a published volume does not say, so look at whether it is there.
                let staging = self.staging_path(id);
                let staged = staging.exists();
                Some((self.target_path(id), staged.then_some(staging)))
            }
            VolumeState::VolReady if self.staging_path(id).exists() => {
                let staging = self.staging_path(id);
                Some((staging.clone(), Some(staging)))
            }
            _ => None,
        }
    }

    /// Finishes the expansion a record names (after a restart), retrying with backoff until
    /// it is done or waits for the volume to be on this node. Spawned by recovery.
    pub fn resume_expansion(&self, volume_id: &str) {
        let manager = self.clone();
        let volume_id = volume_id.to_owned();
        tokio::spawn(async move {
            let mut backoff = Backoff::new(manager.inner.config.retry);
            loop {
                match manager.resume_expansion_once(&volume_id).await {
                    Ok(()) | Err(VolumeError::Draining(_)) => return,
                    Err(err) => {
                        let delay = backoff.next_delay();
                        tracing::warn!(plugin = %manager.inner.config.plugin_type, volume_id = ?volume_id, error = %err, retry_in_ms = delay.as_millis() as u64, "volume expansion did not finish yet; retrying");
                        tokio::time::sleep(delay).await;
                    }
                }
            }
        });
    }

    async fn resume_expansion_once(&self, volume_id: &str) -> Result<(), VolumeError> {
        let _ticket = self.enter(volume_id, "expand", super::Admission::Request)?;
        let deadline = Instant::now() + self.inner.config.operation_timeout;
        let slot = self.slot(volume_id);
        let mut guard = slot.lock().await;
        let Some(record) = guard.record.as_deref().cloned() else {
            return Ok(());
        };
        if record.expansion.is_none() {
            return Ok(());
        }
        if record.state.is_transient()
            || (record.wants_published() && record.state != VolumeState::Published)
        {
            // The reconciler drives the volume where its claims want it first (recovery
            // starts both at once): a node step must find it published.
            return Err(Conflict::ExpandBusy {
                volume_id: volume_id.to_owned(),
                state: record.state.as_str(),
            }
            .into());
        }
        let caps = self.expand_caps(deadline).await?;
        let _running = self.inner.progress.begin(volume_id, "expand");
        self.drive_expansion(&mut guard, record, caps, deadline)
            .await?;
        Ok(())
    }
}
