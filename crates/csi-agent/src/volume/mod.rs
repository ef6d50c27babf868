//! The volume manager: Mesos's `VolumeManager`, with durable claims.
//!
//! It owns every volume of one plugin: the per-volume lock, the in-memory copy of each
//! record, and the driving of a volume through its lifecycle ([`machine`]) with the intent
//! of each RPC durable before the RPC and the result durable before the caller is answered
//! (a step's result and the next step's intent share one write). Claims are the desired
//! state; the record's state is the actual state; [`VolumeManager::reconcile`] drives each
//! volume from one toward the other, also after a crash or a reboot ([`recovery`]).
//!
//! It must not launch or supervise plugins (it asks [`PluginEndpoints`] for a client) and
//! must not parse or format the API.

pub mod bind;
pub mod cluster;
pub mod cluster_leader;
pub mod controller;
pub mod expand;
pub mod gate;
pub mod machine;
pub mod mount_dirs;
pub mod progress;
pub mod record;
pub mod recovery;
pub mod refusal;
pub mod snapshot;
pub mod stats;
pub mod topology;

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex as StdMutex};
use std::time::{Duration, Instant};

use csi_proto::v1;
use futures::future::BoxFuture;
use serde::{Deserialize, Serialize};
use tokio::sync::{Mutex, OnceCell};

use crate::backoff::{Backoff, RetryPolicy};
use crate::client::{
    ControllerCapabilities, CsiClient, CsiVersion, NodeCapabilities, RpcError, RpcErrorKind,
    code_name,
};
use crate::config::Service;
use crate::failpoint;
use crate::layout::{Layout, encode_id};
use crate::metrics::{Metrics, OperationLabels, VolumeStateLabels};
use crate::mounts::MountTable;
use crate::store::{Record, Store, StoreError};
use crate::sys;
use bind::{BindError, BindMount, BindOwner, Binder};
pub use controller::NewVolume;
use machine::{LifecycleCaps, LifecycleRpc, Step, next_step};
pub use record::{
    AccessMode, AccessType, Capability, ClaimLimits, ClaimLimitsError, Origin, VolumeRecord,
    VolumeState,
};

/// What a plugin told about itself, asked once per configuration of its components and
/// forgotten together when a reload replaces them. `generation` counts the replacements: an
/// answer of the old components that arrives after a reload is not kept as the new ones'.
#[derive(Debug, Default)]
struct Learned {
    generation: u64,
    /// NodeGetCapabilities and ControllerGetCapabilities.
    caps: Option<Arc<Advertised>>,
    /// NodeGetInfo and GetPluginCapabilities' services (topology.rs).
    node_info: Option<Arc<topology::NodeInfo>>,
}

/// The capabilities a plugin advertises, as asked of its current components.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Advertised {
    /// NodeGetCapabilities.
    pub node: NodeCapabilities,
    /// ControllerGetCapabilities; `None` when no component serves the Controller service.
    pub controller: Option<ControllerCapabilities>,
    /// GetPluginCapabilities' `VolumeExpansion` type, asked only when an expansion needs it
    /// ([`expand`]) and forgotten with the rest.
    pub expansion: OnceCell<Option<v1::plugin_capability::volume_expansion::Type>>,
}

impl Advertised {
    /// What the lifecycle needs of them.
    pub fn lifecycle(&self) -> LifecycleCaps {
        use v1::controller_service_capability::rpc::Type as Controller;
        LifecycleCaps {
            controller_publish: self
                .controller
                .as_ref()
                .is_some_and(|c| c.contains(&Controller::PublishUnpublishVolume)),
            stage: self
                .node
                .contains(&v1::node_service_capability::rpc::Type::StageUnstageVolume),
        }
    }
}

impl Record for VolumeRecord {
    const SCHEMA_VERSION: u32 = 1;
}

/// Gives the volume manager a client for a plugin service, waiting (bounded) for the plugin
/// to be ready. Implemented by the service manager; tests use fixed sockets.
pub trait PluginEndpoints: Send + Sync + fmt::Debug {
    /// A ready client for `service`. Errors are reported as [`RpcError`]s: a plugin that is
    /// not there (yet) is a transient transport error, so callers retry it like any other.
    fn client(&self, service: Service) -> BoxFuture<'_, Result<CsiClient, RpcError>>;

    /// True when some component of the plugin serves `service`.
    fn serves(&self, service: Service) -> bool;
}

/// Secrets for the node RPCs of one volume. Redacted in `Debug`; stored only in the 0600
/// secrets file beside the record.
#[derive(Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct VolumeSecrets {
    #[serde(default)]
    pub node_stage: BTreeMap<String, String>,
    #[serde(default)]
    pub node_publish: BTreeMap<String, String>,
}

impl VolumeSecrets {
    pub fn is_empty(&self) -> bool {
        self.node_stage.is_empty() && self.node_publish.is_empty()
    }
}

impl fmt::Debug for VolumeSecrets {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("VolumeSecrets")
            .field(
                "node_stage",
                &format_args!("<redacted {} entries>", self.node_stage.len()),
            )
            .field(
                "node_publish",
                &format_args!("<redacted {} entries>", self.node_publish.len()),
            )
            .finish()
    }
}

/// Settings of one plugin's volume manager.
#[derive(Clone, Debug)]
pub struct VolumeConfig {
    pub plugin_type: String,
    pub plugin_name: String,
    /// Backoff between retries of transient errors.
    pub retry: RetryPolicy,
    /// How long a publish or unpublish request keeps retrying transient errors before it
    /// answers with the last one (the reconciler goes on after that).
    pub operation_timeout: Duration,
    /// Mesos's `target_path_exists`: the CO creates the target even for v1 plugins.
    pub target_path_exists: bool,
    /// Mesos's `target_path_root`: the directory under which staging and target paths are
    /// made, instead of the work dir's `mounts/`.
    pub target_path_root: Option<PathBuf>,
    /// The node id for ControllerPublish, instead of asking NodeGetInfo.
    pub node_id: Option<String>,
    /// Set for a plugin of shared storage (`"cluster": true`) on a daemon in cluster mode:
    /// its volumes are claimed in etcd before they are used (docs/cluster.md).
    pub cluster: Option<crate::cluster::Cluster>,
}

impl VolumeConfig {
    pub fn new(plugin_type: &str, plugin_name: &str) -> Self {
        Self {
            plugin_type: plugin_type.to_owned(),
            plugin_name: plugin_name.to_owned(),
            retry: RetryPolicy::default(),
            operation_timeout: Duration::from_secs(120),
            target_path_exists: false,
            target_path_root: None,
            node_id: None,
            cluster: None,
        }
    }
}

/// A request to publish a volume for a workload.
#[derive(Clone, Debug)]
pub struct PublishRequest {
    pub volume_id: String,
    pub workload: String,
    pub capability: Capability,
    pub readonly: bool,
    /// `None`: use the context recorded when the volume was created (or none).
    pub volume_context: Option<BTreeMap<String, String>>,
    pub secrets: VolumeSecrets,
    /// An absolute path where csi-agent bind-mounts the target for this workload (read-only
    /// when the volume is published read-only); undone when the workload unpublishes.
    pub bind_to: Option<PathBuf>,
}

/// Where a published volume is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Published {
    pub target_path: PathBuf,
    pub state: VolumeState,
    pub bind_to: Option<PathBuf>,
}

/// Errors of volume operations, each with what the caller should do.
#[derive(Debug, thiserror::Error)]
pub enum VolumeError {
    /// The request itself is wrong; nothing was changed.
    #[error("{0}")]
    InvalidRequest(#[from] refusal::InvalidRequest),
    /// The request contradicts the volume's current use; nothing was changed.
    #[error("{0}")]
    Conflict(#[from] refusal::Conflict),
    /// The plugin answered with a final error (or transient ones until the operation
    /// timeout); the volume is left in its transient state for the reconciler.
    #[error("{0}")]
    Plugin(#[from] RpcError),
    /// The plugin's config has no component serving the service the operation needs (a
    /// config mistake); nothing was changed.
    #[error(
        "plugin {plugin} serves no {service}: no container or endpoint of its config lists \
         \"{service}\" in `services`; add it there (see docs/configuration.md) and reload"
    )]
    NotServed { plugin: String, service: Service },
    /// The plugin does not advertise the CSI capability the operation needs; nothing was
    /// sent to it. `capability` is spelled as the spec does (`GET_VOLUME_STATS`).
    #[error(
        "plugin {plugin} does not support {operation}: it does not advertise the CSI \
         capability {capability} (see `csictl plugins {plugin}`)"
    )]
    Unsupported {
        plugin: String,
        operation: &'static str,
        capability: &'static str,
    },
    /// The plugin answered success but broke a rule of the CSI spec.
    #[error("the plugin broke the CSI spec: {0}")]
    Protocol(#[from] refusal::ProtocolViolation),
    #[error("durable state could not be written: {0}")]
    Store(#[from] StoreError),
    /// A stored file the operation needs (a volume's `secrets.json`) could not be read; the
    /// inner error names the file and why.
    #[error("durable state could not be read: {0}")]
    StoreRead(#[source] StoreError),
    #[error("file system error on {}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A `bind_to` was refused, or binding or unbinding it failed.
    #[error(transparent)]
    Bind(#[from] BindError),
    /// Reading the mount table or asking the kernel about a mount point failed.
    #[error(transparent)]
    Mounts(#[from] crate::mounts::MountError),
    #[error("interrupted by failpoint {0}")]
    Failpoint(String),
    /// The node is draining: no new operation starts (docs/operations.md, "Draining a node").
    #[error(transparent)]
    Draining(#[from] gate::Closed),
    /// A cluster plugin's claim was refused or etcd could not answer (docs/cluster.md).
    /// (Boxed: the refusals carry the holders' names, and every `Result` of the volume
    /// manager would otherwise carry their size.)
    #[error(transparent)]
    Cluster(Box<crate::cluster::ClusterError>),
    /// The volume went down on this node, but etcd could not be told: the release completes
    /// when etcd answers again (the reconciler retries it).
    #[error("released on this node; the cluster release is pending: {0}")]
    ClusterReleasePending(#[source] Box<crate::cluster::ClusterError>),
}

impl From<crate::cluster::ClusterError> for VolumeError {
    fn from(err: crate::cluster::ClusterError) -> Self {
        VolumeError::Cluster(Box::new(err))
    }
}

impl From<failpoint::FailpointError> for VolumeError {
    fn from(err: failpoint::FailpointError) -> Self {
        VolumeError::Failpoint(err.to_string())
    }
}

/// One volume's lock and cached record (`None`: no record on disk).
#[derive(Debug, Default)]
struct Slot {
    /// The record as last written, shared with the read snapshot (one copy per volume: at
    /// 100,000 volumes a second copy costs about 70 MiB).
    record: Option<Arc<VolumeRecord>>,
    /// Secrets cached after a publish or first read, so that steps need not re-read the file.
    secrets: Option<VolumeSecrets>,
    /// The record was loaded at recovery below the state its claims want, and no operation
    /// has driven it since: its lost progress notes may hide steps done (mounts made). A
    /// claim removed before the reconciler caught up must not take it down from there.
    unconfirmed: bool,
    /// Cluster plugins: the volume's value in etcd as this node last wrote it, so that its
    /// next compare-and-swap needs no read first (a changed key fails the compare, then is
    /// read).
    cluster_known: Option<crate::cluster::Known>,
    /// Set by a publish that has just claimed the volume in etcd, for the drive it starts:
    /// the claim proved the hold, so that drive does not read it again before NodeStage.
    fresh_claim: bool,
}

/// One request's hold on a volume's [`Slot`] (see [`VolumeManager::slot`]).
struct SlotHandle<'a> {
    slots: &'a StdMutex<HashMap<String, Arc<Mutex<Slot>>>>,
    volume_id: String,
    slot: Arc<Mutex<Slot>>,
}

impl std::ops::Deref for SlotHandle<'_> {
    type Target = Mutex<Slot>;

    fn deref(&self) -> &Mutex<Slot> {
        &self.slot
    }
}

impl Drop for SlotHandle<'_> {
    fn drop(&mut self) {
        let mut slots = lock(self.slots);
        // Clones are made only under the map's lock: with the map and this handle the only
        // holders, nobody can be waiting for the slot or about to.
        if Arc::strong_count(&self.slot) != 2 {
            return;
        }
        let empty = self.slot.try_lock().is_ok_and(|slot| slot.record.is_none());
        if empty
            && slots
                .get(&self.volume_id)
                .is_some_and(|held| Arc::ptr_eq(held, &self.slot))
        {
            slots.remove(&self.volume_id);
        }
    }
}

/// The volumes of one plugin.
#[derive(Clone, Debug)]
pub struct VolumeManager {
    inner: Arc<Inner>,
}

/// What every plugin's volume manager on one node shares.
#[derive(Clone, Debug)]
pub struct NodeContext {
    pub layout: Layout,
    pub store: Store,
    /// The current boot id (`/proc/sys/kernel/random/boot_id`).
    pub boot_id: String,
    pub metrics: Option<Arc<Metrics>>,
    /// Where workloads' `bind_to` may go, and which are in use.
    pub binder: Arc<Binder>,
    /// Every operation in flight on the node, and the drain's door ([`gate`]).
    pub gate: Arc<gate::OperationGate>,
    /// Claims per volume and `bind_to` length (`--max-claims-per-volume`,
    /// `--max-bind-to-bytes`).
    pub claim_limits: ClaimLimits,
}

impl NodeContext {
    /// A context with `bind_to` disabled and no metrics (tests, benchmarks).
    pub fn new(layout: Layout, store: Store, boot_id: String) -> Self {
        let binder = Arc::new(Binder::disabled(layout.work_dir()));
        Self {
            layout,
            store,
            boot_id,
            metrics: None,
            binder,
            gate: Arc::default(),
            claim_limits: ClaimLimits::default(),
        }
    }
}

#[derive(Debug)]
struct Inner {
    config: VolumeConfig,
    /// [`VolumeManager::mounts_root`], worked out once: every step joins paths beneath it.
    mounts_root: PathBuf,
    store: Store,
    endpoints: Arc<dyn PluginEndpoints>,
    boot_id: String,
    metrics: Option<Arc<Metrics>>,
    binder: Arc<Binder>,
    gate: Arc<gate::OperationGate>,
    claim_limits: ClaimLimits,
    slots: StdMutex<HashMap<String, Arc<Mutex<Slot>>>>,
    /// Every record as last written (durably or as a note), for reads that must never wait
    /// for an operation in progress (docs/design.md: reads come from a snapshot).
    snapshot: std::sync::RwLock<BTreeMap<String, Arc<VolumeRecord>>>,
    /// What the plugin told about itself (capabilities, NodeGetInfo), asked once per
    /// configuration and forgotten together when it changes.
    learned: StdMutex<Learned>,
    /// Held (read) by every attempt of an RPC to the plugin, and (write) by a reload while it
    /// replaces the plugin's components: a reload is ordered after the attempts in flight,
    /// and the attempts after it see the new components (docs/reliability.md, "Reload").
    steps: Arc<tokio::sync::RwLock<()>>,
    /// Cluster plugins: held by every controller step this node sends as the plugin's leader,
    /// so that the leader sends one at a time (the concurrency Nomad defaults to) and never
    /// two for one volume at once.
    controller_lane: tokio::sync::Mutex<()>,

    /// Publishes of volumes not attached yet, in flight (topology.rs, the volume limit).
    attaching: StdMutex<std::collections::BTreeSet<String>>,
    /// What each operation in progress is doing, for status reads (never waits).
    progress: progress::Tracker,
    /// The latest volume stats of published volumes ([`stats`]).
    stats: stats::StatsState,
}

/// The longest volume id accepted, in bytes (the CSI spec's size limit for ids).
pub const MAX_ID_BYTES: usize = 128;

/// Checks an id from a request (volume id or workload); `what` names the field.
pub fn validate_id(what: &'static str, id: &str) -> Result<(), VolumeError> {
    Ok(check_id(what, id)?)
}

/// [`validate_id`], with the reason typed.
pub fn check_id(field: &'static str, id: &str) -> Result<(), refusal::InvalidRequest> {
    use refusal::InvalidRequest;
    if id.is_empty() {
        return Err(InvalidRequest::EmptyId { field });
    }
    if id.len() > MAX_ID_BYTES {
        return Err(InvalidRequest::IdTooLong {
            field,
            len: id.len(),
            max: MAX_ID_BYTES,
        });
    }
    // Each id becomes one path component; encoding may triple its length.
    if encode_id(id).len() > 255 {
        return Err(InvalidRequest::IdTooLongEncoded { field });
    }
    Ok(())
}

impl VolumeManager {
    pub fn new(
        config: VolumeConfig,
        endpoints: Arc<dyn PluginEndpoints>,
        context: NodeContext,
    ) -> Self {
        if let Some(root) = &config.target_path_root {
            context
                .binder
                .forbid(root, "is or overlaps a plugin's target_path_root");
        }
        let mounts_root = match &config.target_path_root {
            Some(root) => root.clone(),
            None => context
                .layout
                .mounts_dir(&config.plugin_type, &config.plugin_name),
        };
        Self {
            inner: Arc::new(Inner {
                config,
                mounts_root,
                store: context.store,
                endpoints,
                boot_id: context.boot_id,
                metrics: context.metrics,
                binder: context.binder,
                gate: context.gate,
                claim_limits: context.claim_limits,
                slots: StdMutex::new(HashMap::new()),
                snapshot: std::sync::RwLock::new(BTreeMap::new()),
                learned: StdMutex::default(),
                steps: Arc::default(),
                controller_lane: tokio::sync::Mutex::new(()),
                attaching: StdMutex::default(),
                progress: progress::Tracker::default(),
                stats: stats::StatsState::default(),
            }),
        }
    }

    pub fn config(&self) -> &VolumeConfig {
        &self.inner.config
    }

    /// The NodePublish target path: `<mounts root>/<enc id>/target`.
    pub fn target_path(&self, volume_id: &str) -> PathBuf {
        self.volume_mount_dir(volume_id).join("target")
    }

    /// The NodeStage staging path: `<mounts root>/<enc id>/staging`.
    pub fn staging_path(&self, volume_id: &str) -> PathBuf {
        self.volume_mount_dir(volume_id).join("staging")
    }

    /// Where this plugin's staging and target paths live: the plugin's `target_path_root`
    /// when configured (Mesos), else `<work dir>/csi/<type>/<name>/mounts`.
    pub fn mounts_root(&self) -> PathBuf {
        self.inner.mounts_root.clone()
    }

    /// The lock and cached record of one volume. The entry lives while some request holds
    /// it or a record exists: a handle dropped while the slot holds no record removes it, so
    /// requests naming ids that do not exist leave nothing behind (bounded engine state).
    fn slot(&self, volume_id: &str) -> SlotHandle<'_> {
        let mut slots = lock(&self.inner.slots);
        SlotHandle {
            slots: &self.inner.slots,
            volume_id: volume_id.to_owned(),
            slot: slots.entry(volume_id.to_owned()).or_default().clone(),
        }
    }

    /// The record of a volume, as last written. Never waits for an operation on the volume,
    /// and an unknown id creates nothing.
    pub async fn get(&self, volume_id: &str) -> Option<VolumeRecord> {
        self.snapshot_of(volume_id).map(|r| (*r).clone())
    }

    /// How many volumes are known, from the read snapshot: never waits for an operation in
    /// progress (status reads must not hang behind a publish waiting for its plugin).
    pub fn count(&self) -> usize {
        self.inner
            .snapshot
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .len()
    }

    /// The record of a volume from the read snapshot.
    pub fn snapshot_of(&self, volume_id: &str) -> Option<Arc<VolumeRecord>> {
        self.inner
            .snapshot
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .get(volume_id)
            .cloned()
    }

    /// Every known volume's record, sorted by volume id, from the read snapshot: never waits
    /// for an operation in progress.
    pub async fn list(&self) -> Vec<VolumeRecord> {
        self.list_snapshot().iter().map(|r| (**r).clone()).collect()
    }

    /// The read snapshot itself, sorted by volume id (cheap: shared records).
    pub fn list_snapshot(&self) -> Vec<Arc<VolumeRecord>> {
        self.inner
            .snapshot
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .values()
            .cloned()
            .collect()
    }

    /// Makes `record` the slot's copy and the snapshot's (`None`: forgotten), keeping the
    /// state gauge in step.
    fn set_record(&self, slot: &mut Slot, record: Option<VolumeRecord>) {
        let record = record.map(Arc::new);
        self.count_state(
            slot.record.as_ref().map(|r| r.state),
            record.as_ref().map(|r| r.state),
        );
        {
            let mut snapshot = self
                .inner
                .snapshot
                .write()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            match &record {
                Some(r) => {
                    snapshot.insert(r.volume_id.clone(), Arc::clone(r));
                }
                None => {
                    if let Some(old) = &slot.record {
                        snapshot.remove(&old.volume_id);
                    }
                }
            }
        }
        let unpublished = record
            .as_ref()
            .is_none_or(|r| r.state != VolumeState::Published);
        if let (true, Some(old)) = (unpublished, &slot.record) {
            self.forget_stats(&old.volume_id);
        }
        slot.record = record;
    }

    /// Publishes a volume for a workload and returns its target path.
    ///
    /// The claim is durable before any RPC. Publishing a volume that is already published for
    /// another workload only adds the claim: it never resets the volume's state. On failure the
    /// claim this request added is withdrawn and the volume is left for the reconciler to wind
    /// back.
    pub async fn publish(&self, request: PublishRequest) -> Result<Published, VolumeError> {
        let started = Instant::now();
        let result = self.publish_inner(request).await;
        self.observe_operation("publish", &result, started);
        result
    }

    async fn publish_inner(&self, request: PublishRequest) -> Result<Published, VolumeError> {
        validate_id("volume_id", &request.volume_id)?;
        validate_id("workload", &request.workload)?;
        let _ticket = self.enter(&request.volume_id, "publish", Admission::Request)?;
        self.check_publish(&request)?;
        let slot = self.slot(&request.volume_id);
        let mut guard = slot.lock().await;
        let _running = self.inner.progress.begin(&request.volume_id, "publish");
        let mut record = match guard.record.as_deref().cloned() {
            Some(record) => record,
            None => VolumeRecord::new(&request.volume_id, Origin::PreProvisioned),
        };
        let attached = !record.claims.is_empty() || record.state != VolumeState::Created;
        if let Some(published) = self.admit_publish(&mut guard, &mut record, &request)? {
            return Ok(published);
        }
        // The hold across nodes first: etcd may claim more than this node uses, never less.
        let deadline = Instant::now() + self.inner.config.operation_timeout;
        let claimed = self
            .cluster_claim(&mut guard, &mut record, &request.workload, deadline)
            .await?;
        // A second workload on an attached volume is no volume more (topology.rs).
        let _attaching = if attached {
            None
        } else {
            Some(self.reserve_attachment(&request.volume_id).await?)
        };
        let owner = self.bind_owner(&request.volume_id, &request.workload);
        // Given back by every early return below, kept once a record names it.
        let reservation = match &request.bind_to {
            Some(bind_to) => self.inner.binder.reservation(bind_to, &owner)?,
            None => bind::Reservation::none(&self.inner.binder),
        };
        // Secrets first: the steps below may need them after a crash.
        self.save_publish_secrets(&mut guard, &mut record, &request)
            .await?;
        let added_claim = record.claims.insert(request.workload.clone());
        if let Some(bind_to) = &request.bind_to {
            // The binding is durable with the claim, before anything is mounted.
            record
                .bind_mounts
                .entry(request.workload.clone())
                .or_insert_with(|| BindMount::new(bind_to.clone()));
        }
        guard.fresh_claim = claimed;
        match self
            .drive(&mut guard, record, true, Binds::Of(&request.workload))
            .await
        {
            Ok(state) => {
                reservation.keep();
                failpoint::hit("volume.publish.before_answer")?;
                Ok(Published {
                    target_path: self.target_path(&request.volume_id),
                    state,
                    bind_to: request.bind_to.clone(),
                })
            }
            Err(err) => {
                if !added_claim {
                    // The claim existed before this request; its reservation stays.
                    reservation.keep();
                } else if self.withdraw_failed_claim(&mut guard, &request, &err).await {
                    reservation.keep();
                }
                Err(err)
            }
        }
    }

    /// The checks of a publish request that need neither the volume's lock nor its record:
    /// a bad request changes nothing.
    fn check_publish(&self, request: &PublishRequest) -> Result<(), VolumeError> {
        if !self.inner.endpoints.serves(Service::Node) {
            // A config mistake, not the plugin's: nothing may be recorded for a publish no
            // component can ever carry out.
            return Err(VolumeError::NotServed {
                plugin: self.inner.config.plugin_type.clone(),
                service: Service::Node,
            });
        }
        if !request.readonly && request.capability.access_mode.is_read_only() {
            return Err(refusal::InvalidRequest::ReadOnlyAccessMode {
                access_mode: access_mode_name(request.capability.access_mode),
            }
            .into());
        }
        if let Some(bind_to) = &request.bind_to {
            // Refused up front, before any lock, write or RPC (a bad path changes nothing).
            let len = bind_to.as_os_str().len();
            let max = self.inner.claim_limits.max_bind_to_bytes;
            if len > max {
                return Err(refusal::InvalidRequest::BindToTooLong { len, max }.into());
            }
            self.inner.binder.check(bind_to)?;
        }
        Ok(())
    }

    /// Holds a publish to the volume's current use: refused when it contradicts it or when
    /// the volume has all the claims it may have. A volume already published for this very
    /// claim is answered at once (`Some`), its bind checked; a volume not in use takes the
    /// request's capability, readonly and context.
    fn admit_publish(
        &self,
        slot: &mut Slot,
        record: &mut VolumeRecord,
        request: &PublishRequest,
    ) -> Result<Option<Published>, VolumeError> {
        let in_use = !record.claims.is_empty() || record.state != VolumeState::Created;
        if in_use {
            // The first publish fixed how the volume is staged and published; a later one
            // must agree, or it would silently get something else than it asked for.
            if record.capability.as_ref() != Some(&request.capability)
                || record.readonly != request.readonly
            {
                return Err(refusal::Conflict::InUseOtherwise {
                    volume_id: request.volume_id.clone(),
                    in_use: describe_use(record),
                }
                .into());
            }
            let recorded_bind = record.bind_mounts.get(&request.workload).map(|b| &b.path);
            if let Some(existing) = recorded_bind
                && request.bind_to.as_ref() != Some(existing)
            {
                return Err(refusal::Conflict::BoundElsewhere {
                    workload: request.workload.clone(),
                    volume_id: request.volume_id.clone(),
                    bound_at: existing.clone(),
                }
                .into());
            }
            if record.claims.contains(&request.workload)
                && record.state == VolumeState::Published
                && recorded_bind == request.bind_to.as_ref()
            {
                // Already published for this workload. The bind is checked, not assumed: a
                // crash may have come between recording it and mounting it.
                if self.ensure_binds(record, Binds::Of(&request.workload))? {
                    self.note(slot, record.clone())?;
                }
                return Ok(Some(Published {
                    target_path: self.target_path(&request.volume_id),
                    state: record.state,
                    bind_to: request.bind_to.clone(),
                }));
            }
        } else {
            record.capability = Some(request.capability.clone());
            record.readonly = request.readonly;
            if let Some(context) = &request.volume_context {
                record.volume_context = context.clone();
            }
        }
        let max_claims = self.inner.claim_limits.max_claims;
        if !record.claims.contains(&request.workload) && record.claims.len() >= max_claims {
            // Bounds the record, so that it can always be read back (ClaimLimits).
            return Err(refusal::Conflict::TooManyClaims {
                volume_id: request.volume_id.clone(),
                claims: record.claims.len(),
                max: max_claims,
            }
            .into());
        }
        Ok(None)
    }

    /// Writes a publish request's secrets (if any) before anything needs them.
    async fn save_publish_secrets(
        &self,
        slot: &mut Slot,
        record: &mut VolumeRecord,
        request: &PublishRequest,
    ) -> Result<(), VolumeError> {
        if request.secrets.is_empty() {
            return Ok(());
        }
        let store = self.inner.store.clone();
        let c = self.inner.config.clone();
        let secrets = request.secrets.clone();
        let volume_id = request.volume_id.clone();
        blocking(move || store.save_secrets(&c.plugin_type, &c.plugin_name, &volume_id, &secrets))
            .await?;
        record.has_secrets = true;
        slot.secrets = Some(request.secrets.clone());
        failpoint::hit("volume.secrets.after_write")?;
        Ok(())
    }

    /// Withdraws the claim a failed publish added (and its bind, if it can be undone), and
    /// leaves the volume to a reconciler. True when the claim's `bind_to` must stay reserved:
    /// its bind could not be undone, or the withdrawal could not be written (the claim stays,
    /// and a later unpublish cleans it).
    async fn withdraw_failed_claim(
        &self,
        slot: &mut Slot,
        request: &PublishRequest,
        err: &VolumeError,
    ) -> bool {
        let Some(mut record) = slot.record.as_deref().cloned() else {
            return false;
        };
        record.claims.remove(&request.workload);
        let mut bind_kept = false;
        if let Some(bind) = record.bind_mounts.get(&request.workload).cloned() {
            match self.unbind(&request.volume_id, &request.workload, &bind) {
                Ok(()) => {
                    record.bind_mounts.remove(&request.workload);
                }
                Err(unbind_err) => {
                    // Keep the entry (and the claim) so that a later unpublish still knows
                    // what to undo.
                    tracing::warn!(plugin = %self.inner.config.plugin_type, volume_id = ?request.volume_id, error = %unbind_err, "bind mount of a failed publish could not be undone");
                    record.claims.insert(request.workload.clone());
                    bind_kept = true;
                }
            }
        }
        record.last_error = Some(err.to_string());
        // Best effort: if this write fails, the claim stays and the reconciler publishes the
        // volume; a later unpublish for the workload cleans it.
        if self.persist(slot, record).await.is_err() {
            return true;
        }
        self.spawn_reconcile(&request.volume_id);
        bind_kept
    }

    /// Withdraws a workload's claim; when it was the last one, unpublishes (and unstages, and
    /// controller-unpublishes) the volume. An unknown volume or claim succeeds.
    pub async fn unpublish(&self, volume_id: &str, workload: &str) -> Result<(), VolumeError> {
        let started = Instant::now();
        let result = self
            .unpublish_inner(volume_id, workload, Admission::Request)
            .await;
        self.observe_operation("unpublish", &result, started);
        result
    }

    /// [`VolumeManager::unpublish`] for the drain: it passes the closed door (and is counted).
    pub async fn drain_unpublish(
        &self,
        volume_id: &str,
        workload: &str,
    ) -> Result<(), VolumeError> {
        let started = Instant::now();
        let result = self
            .unpublish_inner(volume_id, workload, Admission::Drain)
            .await;
        self.observe_operation("unpublish", &result, started);
        result
    }

    async fn unpublish_inner(
        &self,
        volume_id: &str,
        workload: &str,
        admission: Admission,
    ) -> Result<(), VolumeError> {
        validate_id("volume_id", volume_id)?;
        validate_id("workload", workload)?;
        let _ticket = self.enter(volume_id, "unpublish", admission)?;
        let slot = self.slot(volume_id);
        let mut guard = slot.lock().await;
        let Some(mut record) = guard.record.as_deref().cloned() else {
            return Ok(());
        };
        let _running = self.inner.progress.begin(volume_id, "unpublish");
        if let Some(bind) = record.bind_mounts.get(workload).cloned() {
            // The workload's own bind mount goes first; its record entry only once it is gone.
            self.unbind(volume_id, workload, &bind)?;
            record.bind_mounts.remove(workload);
            self.inner
                .binder
                .release(&bind.path, &self.bind_owner(volume_id, workload));
        }
        record.claims.remove(workload);
        let up = record.wants_published();
        // The other workloads' binds are theirs to check: one of them broken must not
        // block this unpublish (issue #24, M2).
        match self.drive(&mut guard, record, up, Binds::None).await {
            Ok(_) => Ok(()),
            Err(VolumeError::ClusterReleasePending(err)) => {
                // Unpublished on this node; etcd still shows the hold (an over-claim: the
                // volume cannot move yet, which is safe) until the reconciler tells it.
                tracing::warn!(plugin = %self.inner.config.plugin_type, volume_id = ?volume_id, error = %err, "unpublished on this node; the cluster release is pending");
                drop(guard);
                self.spawn_reconcile(volume_id);
                Ok(())
            }
            Err(err) => Err(err),
        }
    }

    /// Registers an operation on the node's door ([`gate`]) before it touches a volume or the
    /// plugin; refused with [`VolumeError::Draining`] once the node drains.
    fn enter(
        &self,
        volume_id: &str,
        operation: &'static str,
        admission: Admission,
    ) -> Result<gate::Ticket, VolumeError> {
        let plugin = &self.inner.config.plugin_type;
        Ok(match admission {
            Admission::Request => self.inner.gate.enter(plugin, volume_id, operation)?,
            Admission::Drain => self.inner.gate.enter_draining(plugin, volume_id, operation),
        })
    }

    fn bind_owner(&self, volume_id: &str, workload: &str) -> BindOwner {
        BindOwner {
            plugin: self.inner.config.plugin_type.clone(),
            volume_id: volume_id.to_owned(),
            workload: workload.to_owned(),
        }
    }

    /// Unmounts a workload's bind mount of `volume_id` (and the dirs csi-agent created for
    /// it): only the mount csi-agent made, found by its mount id ([`Binder::remove`]).
    fn unbind(&self, volume_id: &str, workload: &str, bind: &BindMount) -> Result<(), VolumeError> {
        sys::blocking("unbind", || {
            self.inner.binder.remove(
                &self.mounts_root(),
                &self.target_path(volume_id),
                bind,
                &self.inner.boot_id,
                &self.bind_owner(volume_id, workload),
            )?;
            failpoint::hit("volume.unbind.after_unmount")?;
            Ok(())
        })
    }

    /// Makes sure the recorded bind mounts `which` of a published volume are this volume's
    /// binds, mounting the missing ones (after a crash between recording and mounting, or
    /// after a reboot). Returns true when a bind's entry changed (mount id noted, dirs
    /// counted). With [`Binds::All`], a failing bind does not stop the others from being
    /// made; the first failure is returned.
    fn ensure_binds(
        &self,
        record: &mut VolumeRecord,
        which: Binds<'_>,
    ) -> Result<bool, VolumeError> {
        let any = match which {
            Binds::None => false,
            Binds::Of(workload) => record.bind_mounts.contains_key(workload),
            Binds::All => !record.bind_mounts.is_empty(),
        };
        if !any {
            return Ok(false);
        }
        sys::blocking("bind", || self.ensure_binds_now(record, which))
    }

    fn ensure_binds_now(
        &self,
        record: &mut VolumeRecord,
        which: Binds<'_>,
    ) -> Result<bool, VolumeError> {
        let target = self.target_path(&record.volume_id);
        let mounts_root = self.mounts_root();
        let mut changed = false;
        let mut first_error = None;
        let volume_id = record.volume_id.clone();
        let readonly = record.readonly;
        // One claim's bind is looked up, not found by a pass over all: a publish costs the
        // same whatever the number of claims (issue #24, L2).
        let binds: Vec<(&String, &mut BindMount)> = match which {
            Binds::None => Vec::new(),
            Binds::Of(workload) => record
                .bind_mounts
                .range_mut::<str, _>((
                    std::ops::Bound::Included(workload),
                    std::ops::Bound::Included(workload),
                ))
                .collect(),
            Binds::All => record.bind_mounts.iter_mut().collect(),
        };
        for (workload, bind) in binds {
            let owner = self.bind_owner(&volume_id, workload);
            // A bind read back from disk is held to the same rules as a new request.
            let ensured = self
                .inner
                .binder
                .reserve(&bind.path, &owner)
                .and_then(|()| {
                    self.inner.binder.ensure(
                        &mounts_root,
                        &target,
                        bind,
                        readonly,
                        &self.inner.boot_id,
                        &owner,
                    )
                });
            match ensured {
                Ok(now) => {
                    if now != *bind {
                        failpoint::hit("volume.bind.after_mount")?;
                        *bind = now;
                        changed = true;
                    }
                }
                Err(err) => {
                    tracing::warn!(plugin = %self.inner.config.plugin_type, volume_id = ?volume_id, workload = ?workload, error = %err, "bind_to of this workload could not be made");
                    first_error.get_or_insert(err);
                }
            }
        }
        match first_error {
            Some(err) => Err(err.into()),
            None => Ok(changed),
        }
    }

    /// Drives one volume toward what its claims want (used by recovery and after failures).
    pub async fn reconcile(&self, volume_id: &str) -> Result<(), VolumeError> {
        self.reconcile_as(volume_id, Admission::Request).await
    }

    /// [`VolumeManager::reconcile`] for the drain: drives a volume no claim wants (one left in
    /// a transient state) down past the closed door.
    pub async fn drain_reconcile(&self, volume_id: &str) -> Result<(), VolumeError> {
        self.reconcile_as(volume_id, Admission::Drain).await
    }

    async fn reconcile_as(&self, volume_id: &str, admission: Admission) -> Result<(), VolumeError> {
        let _ticket = self.enter(volume_id, "reconcile", admission)?;
        let slot = self.slot(volume_id);
        let mut guard = slot.lock().await;
        let Some(record) = guard.record.as_deref().cloned() else {
            return Ok(());
        };
        let _running = self.inner.progress.begin(volume_id, "reconcile");
        let up = record.wants_published();
        self.drive(&mut guard, record, up, Binds::All).await?;
        Ok(())
    }

    /// What the operation in progress on `volume_id` is doing, if one runs or a background
    /// reconciler waits to retry. Never waits.
    pub fn progress(&self, volume_id: &str) -> Option<progress::Progress> {
        self.inner.progress.get(volume_id)
    }

    /// Reconciles a volume in the background, retrying with backoff until it converges.
    /// A missing plugin never makes it give up (k8s#72500, k8s#120268). At most one
    /// reconciler runs per volume: asked again while one runs, that one drives once more.
    pub fn spawn_reconcile(&self, volume_id: &str) {
        if !self.inner.progress.want_reconciler(volume_id) {
            return;
        }
        let manager = self.clone();
        let volume_id = volume_id.to_owned();
        tokio::spawn(async move {
            let mut backoff = Backoff::new(manager.inner.config.retry);
            loop {
                match manager.reconcile(&volume_id).await {
                    Ok(()) => {
                        if !manager.inner.progress.reconciler_done(&volume_id) {
                            return;
                        }
                    }
                    Err(VolumeError::Draining(_)) => {
                        // The drain drives every volume itself from here on.
                        manager.inner.progress.reconciler_stopped(&volume_id);
                        return;
                    }
                    Err(err) => {
                        let delay = backoff.next_delay();
                        let message = err.to_string();
                        let attempt = manager
                            .inner
                            .progress
                            .reconciler_failed(&volume_id, &message, delay);
                        tracing::warn!(
                            plugin = %manager.inner.config.plugin_type,
                            volume_id = ?volume_id,
                            attempt,
                            error = %message,
                            retry_in_ms = delay.as_millis() as u64,
                            "volume did not converge yet; retrying"
                        );
                        tokio::time::sleep(delay).await;
                    }
                }
            }
        });
    }

    /// Drives `record` step by step toward published (`up`) or unpublished. `record` may hold
    /// changes not yet durable (a new claim, a claim removed): they are written with the first
    /// intent, or alone if no step is needed.
    /// `binds` names the bind mounts this drive makes sure of once published: a request's
    /// own only, so that another workload's broken bind never fails it (M2); when a request
    /// had to publish the volume again, the other claims' binds are left to a reconciler.
    async fn drive(
        &self,
        slot: &mut Slot,
        mut record: VolumeRecord,
        up: bool,
        binds: Binds<'_>,
    ) -> Result<VolumeState, VolumeError> {
        let deadline = Instant::now() + self.inner.config.operation_timeout;
        if slot.unconfirmed && !up {
            let (mounts_root, mounted) = self.mounted_under_mounts_root(&self.mount_table()?);
            let volume_dir = mounts_root.join(crate::layout::encode_id(&record.volume_id));
            if self.raise_to_mounts(&mut record, &volume_dir, &mounted) {
                tracing::info!(plugin = %self.inner.config.plugin_type, volume_id = ?record.volume_id, state = ?record.state, "record raised to what the mount table shows before going down");
            }
            slot.unconfirmed = false;
        }
        if slot
            .record
            .as_ref()
            .is_none_or(|old| !same_desire(old, &record))
        {
            // The operation's one durable write: its desired state (a claim added or removed,
            // with its capability and bind), before the first RPC. Every step after it is a
            // progress note.
            failpoint::hit("volume.desire.before_write")?;
            self.persist(slot, record.clone()).await?;
            failpoint::hit("volume.desire.after_write")?;
        }
        let mut dirty = slot.record.as_deref() != Some(&record);
        let mut ran_rpc = false;
        // Consumed here whatever happens: only the drive a publish starts right after its
        // claim may skip the check.
        let mut confirmed = std::mem::take(&mut slot.fresh_claim);
        let mut ran_controller_unpublish = false;
        loop {
            let caps = if next_step(record.state, up, ALL_CAPS) == Step::Done {
                // No step needed whatever the plugin can do: don't ask it.
                ALL_CAPS
            } else {
                self.lifecycle_caps(deadline).await?
            };
            if up
                && record.node_state_lost
                && caps.stage
                && record.state.level() > VolumeState::NodeStage.level()
            {
                // The staging mount vanished with a reboot: publishing now would bind an
                // empty staging dir (nomad#20424). Stage again first.
                record.state = VolumeState::NodeStage;
                dirty = true;
            }
            match next_step(record.state, up, caps) {
                Step::Done => {
                    // Every step up has been done (again) and recorded: the record is true.
                    slot.unconfirmed = false;
                    break;
                }
                Step::Skip(to) => {
                    self.after_skip(&record, to)?;
                    record.state = to;
                    dirty = true;
                }
                Step::Rpc(rpc) => {
                    if up && !confirmed {
                        // Every step up needs the hold to be this node's still.
                        self.cluster_confirm(&record).await?;
                        confirmed = true;
                    }
                    if rpc == LifecycleRpc::ControllerUnpublish
                        && let cluster::BeforeDetach::Skip =
                            self.cluster_before_detach(slot, &record).await?
                    {
                        // Freed after a fence: the volume may be another node's now.
                        record.state = VolumeState::Created;
                        record.publish_context.clear();
                        record.node_id = None;
                        dirty = true;
                        continue;
                    }
                    ran_rpc = true;
                    let points = rpc.failpoints();
                    failpoint::hit(points.before_intent)?;
                    record.state = rpc.intent();
                    if record.state.is_node_side() {
                        record.boot_id = Some(self.inner.boot_id.clone());
                    }
                    if matches!(
                        rpc,
                        LifecycleRpc::ControllerPublish | LifecycleRpc::ControllerUnpublish
                    ) && record.node_id.is_none()
                    {
                        // For an unpublish too: the id noted with the publish may have been
                        // lost, and an empty node_id would ask the plugin to unpublish the
                        // volume from every node.
                        record.node_id = Some(self.node_id(deadline).await?);
                    }
                    self.note(slot, record.clone())?;
                    failpoint::hit(points.before_rpc)?;
                    let outcome = self
                        .controller_step_or_rpc(slot, &mut record, rpc, caps, deadline)
                        .await;
                    failpoint::hit(points.after_rpc)?;
                    if let Err(err) = outcome {
                        tracing::warn!(
                            plugin = %self.inner.config.plugin_type,
                            volume_id = ?record.volume_id,
                            step = rpc.name(),
                            error = %err,
                            "volume step failed; the volume stays in its transient state"
                        );
                        return Err(err);
                    }
                    record.state = rpc.result();
                    record.last_error = None;
                    if matches!(rpc, LifecycleRpc::NodeStage | LifecycleRpc::NodeUnstage)
                        || !record.state.is_node_side() && record.state != VolumeState::VolReady
                    {
                        record.node_state_lost = false;
                    }
                    if rpc == LifecycleRpc::ControllerUnpublish {
                        record.publish_context.clear();
                        record.node_id = None;
                        ran_controller_unpublish = true;
                    }
                    if !record.state.is_node_side() && record.state != VolumeState::VolReady {
                        record.boot_id = None;
                    }
                    dirty = true;
                }
            }
        }
        if record.claims.is_empty() && record.state == VolumeState::Created {
            if self
                .cluster_release(slot, &mut record, ran_controller_unpublish, deadline)
                .await?
            {
                dirty = true;
            }
            self.cleanup_mount_dir(&record.volume_id);
            if record.origin == Origin::PreProvisioned {
                failpoint::hit("volume.record.before_delete")?;
                self.note_forget(slot, &record.volume_id).await?;
                failpoint::hit("volume.record.after_delete")?;
                return Ok(VolumeState::Created);
            }
        }
        self.finish_drive(slot, record, binds, ran_rpc, dirty)
    }

    /// The end of a [`VolumeManager::drive`] that reached the state it wanted: the binds
    /// `binds` of a published volume made sure of, then the last progress note (when
    /// anything changed), then the binds' first error, if any.
    fn finish_drive(
        &self,
        slot: &mut Slot,
        mut record: VolumeRecord,
        binds: Binds<'_>,
        ran_rpc: bool,
        mut dirty: bool,
    ) -> Result<VolumeState, VolumeError> {
        // Binds before the last write, so that their mount ids are durable with it; a bind
        // that fails still lets the progress above be written.
        let published = record.state == VolumeState::Published;
        if published && ran_rpc && !matches!(binds, Binds::All) {
            let others = match binds {
                Binds::Of(workload) => record.bind_mounts.keys().any(|w| w != workload),
                _ => !record.bind_mounts.is_empty(),
            };
            if others {
                // Published again (a step was redone): the other claims' binds may be gone;
                // a reconciler makes them, outside this request.
                self.spawn_reconcile(&record.volume_id);
            }
        }
        let binds = if published {
            self.ensure_binds(&mut record, binds)
        } else {
            Ok(false)
        };
        if let Err(err) = &binds {
            // Shown on the volume for operators; written only when it changes, so that a
            // reconciler retrying a bad bind does not write on every attempt.
            let message = err.to_string();
            if slot.record.as_ref().and_then(|r| r.last_error.as_ref()) != Some(&message) {
                record.last_error = Some(message);
                dirty = true;
            }
        }
        if dirty || matches!(binds, Ok(true)) {
            failpoint::hit("volume.final.before_write")?;
            self.note(slot, record.clone())?;
            failpoint::hit("volume.final.after_write")?;
        }
        binds?;
        Ok(record.state)
    }

    /// Runs one lifecycle RPC with retries of transient errors, including the preparation and
    /// checks the CSI spec puts on the CO around it.
    async fn run_rpc(
        &self,
        slot: &mut Slot,
        record: &mut VolumeRecord,
        rpc: LifecycleRpc,
        caps: LifecycleCaps,
        deadline: Instant,
    ) -> Result<(), VolumeError> {
        let volume_id = record.volume_id.clone();
        let staging = self.staging_path(&volume_id);
        let target = self.target_path(&volume_id);
        let service = match rpc {
            LifecycleRpc::ControllerPublish | LifecycleRpc::ControllerUnpublish => {
                Service::Controller
            }
            _ => Service::Node,
        };
        let secrets = if matches!(rpc, LifecycleRpc::NodeStage | LifecycleRpc::NodePublish) {
            self.secrets(slot, record).await?
        } else {
            VolumeSecrets::default()
        };
        let capability = record.capability.as_ref().map(Capability::to_v1);
        let mut backoff = Backoff::new(self.inner.config.retry);
        let mut tries: u32 = 0;
        loop {
            tries = tries.saturating_add(1);
            self.inner.progress.trying(&volume_id, rpc.name(), tries);
            let step = self.inner.steps.read().await;
            let client = self.inner.endpoints.client(service).await;
            let attempt = match client {
                Err(err) => Err(VolumeError::Plugin(err)),
                Ok(client) => {
                    self.attempt(
                        &client,
                        record,
                        rpc,
                        caps,
                        &staging,
                        &target,
                        &secrets,
                        capability.clone(),
                    )
                    .await
                }
            };
            // Not across the backoff below: a reload waits for attempts, not for retries.
            drop(step);
            match attempt {
                Ok(()) => return Ok(()),
                // An undo RPC answered NOT_FOUND: the plugin has no such volume (any more), so
                // nothing of it is left on this node to undo. Treating that as done keeps a
                // volume deleted behind our back from blocking its own cleanup forever.
                Err(VolumeError::Plugin(err))
                    if err.code() == tonic::Code::NotFound
                        && matches!(
                            rpc,
                            LifecycleRpc::NodeUnpublish
                                | LifecycleRpc::NodeUnstage
                                | LifecycleRpc::ControllerUnpublish
                        ) =>
                {
                    tracing::warn!(
                        plugin = %self.inner.config.plugin_type,
                        volume_id = ?record.volume_id,
                        step = rpc.name(),
                        "plugin does not know the volume; taking the undo as done"
                    );
                    return Ok(());
                }
                Err(VolumeError::Plugin(err)) if err.is_transient() && !err.is_not_ready() => {
                    let delay = backoff.next_delay();
                    if Instant::now() + delay >= deadline {
                        return Err(VolumeError::Plugin(err));
                    }
                    // Info, once per attempt: an operator must see a publish that keeps
                    // retrying without turning on debug logs (issue #11).
                    tracing::info!(
                        plugin = %self.inner.config.plugin_type,
                        volume_id = ?volume_id,
                        step = rpc.name(),
                        attempt = tries,
                        code = code_name(err.code()),
                        error = %err,
                        retry_in_ms = delay.as_millis() as u64,
                        "transient error; retrying"
                    );
                    self.inner.progress.retrying(
                        &volume_id,
                        Some(rpc.name()),
                        tries,
                        &err.to_string(),
                        delay,
                    );
                    tokio::time::sleep(delay).await;
                }
                Err(err) => return Err(err),
            }
        }
    }

    /// One attempt of one RPC, with the CO's side of the target path rules (docs/design.md, "The volume lifecycle").
    #[allow(clippy::too_many_arguments)]
    async fn attempt(
        &self,
        client: &CsiClient,
        record: &mut VolumeRecord,
        rpc: LifecycleRpc,
        caps: LifecycleCaps,
        staging: &Path,
        target: &Path,
        secrets: &VolumeSecrets,
        capability: Option<v1::VolumeCapability>,
    ) -> Result<(), VolumeError> {
        let volume_id = record.volume_id.clone();
        let v0 = client.version() != CsiVersion::V1;
        let co_creates_target = v0 || self.inner.config.target_path_exists;
        match rpc {
            LifecycleRpc::ControllerPublish => {
                let response = client
                    .controller_publish_volume(v1::ControllerPublishVolumeRequest {
                        volume_id,
                        node_id: record.node_id.clone().unwrap_or_default(),
                        volume_capability: capability,
                        readonly: record.readonly,
                        volume_context: to_hash_map(&record.volume_context),
                        ..Default::default()
                    })
                    .await?;
                record.publish_context = response.publish_context.into_iter().collect();
            }
            LifecycleRpc::ControllerUnpublish => {
                client
                    .controller_unpublish_volume(v1::ControllerUnpublishVolumeRequest {
                        volume_id,
                        node_id: record.node_id.clone().unwrap_or_default(),
                        ..Default::default()
                    })
                    .await?;
            }
            LifecycleRpc::NodeStage => {
                // "The CO SHALL ensure that the path is directory and that the process serving
                // the request has read and write permission to it."
                mount_dirs::ensure_dir(staging)?;
                client
                    .node_stage_volume(v1::NodeStageVolumeRequest {
                        volume_id,
                        publish_context: to_hash_map(&record.publish_context),
                        staging_target_path: path_string(staging),
                        volume_capability: capability,
                        secrets: to_hash_map(&secrets.node_stage),
                        volume_context: to_hash_map(&record.volume_context),
                    })
                    .await?;
            }
            LifecycleRpc::NodeUnstage => {
                client
                    .node_unstage_volume(v1::NodeUnstageVolumeRequest {
                        volume_id,
                        staging_target_path: path_string(staging),
                    })
                    .await?;
                if mount_dirs::remove(staging)? == mount_dirs::Removed::MountPoint {
                    return Err(refusal::ProtocolViolation::StillMounted {
                        rpc: "NodeUnstageVolume",
                        path: staging.to_path_buf(),
                    }
                    .into());
                }
            }
            LifecycleRpc::NodePublish => {
                // v1: "The CO SHALL ensure that the parent directory of this path exists";
                // the SP creates the target. v0 (and target_path_exists): the CO creates it,
                // a file for a block volume (the device node is bind-mounted on it).
                let block = record
                    .capability
                    .as_ref()
                    .is_some_and(|c| matches!(c.access_type, AccessType::Block {}));
                if co_creates_target && block {
                    mount_dirs::ensure_file(target)?;
                } else if co_creates_target {
                    mount_dirs::ensure_dir(target)?;
                } else {
                    mount_dirs::ensure_own_dir(&self.volume_mount_dir(&record.volume_id))?;
                }
                // The capabilities this step was chosen with, not the cache's: a reload may have
                // forgotten those meanwhile, and a NodePublish without staging_target_path to a
                // plugin with STAGE_UNSTAGE_VOLUME breaks the spec (issue #24, M5).
                let stage_used = caps.stage;
                client
                    .node_publish_volume(v1::NodePublishVolumeRequest {
                        volume_id,
                        publish_context: to_hash_map(&record.publish_context),
                        staging_target_path: if stage_used {
                            path_string(staging)
                        } else {
                            String::new()
                        },
                        target_path: path_string(target),
                        volume_capability: capability,
                        readonly: record.readonly,
                        secrets: to_hash_map(&secrets.node_publish),
                        volume_context: to_hash_map(&record.volume_context),
                    })
                    .await?;
                if mount_dirs::probe(target)? == mount_dirs::Entry::Missing {
                    return Err(refusal::ProtocolViolation::TargetNotCreated {
                        path: target.to_path_buf(),
                    }
                    .into());
                }
            }
            LifecycleRpc::NodeUnpublish => {
                client
                    .node_unpublish_volume(v1::NodeUnpublishVolumeRequest {
                        volume_id,
                        target_path: path_string(target),
                    })
                    .await?;
                match mount_dirs::remove(target)? {
                    mount_dirs::Removed::MountPoint => {
                        return Err(refusal::ProtocolViolation::StillMounted {
                            rpc: "NodeUnpublishVolume",
                            path: target.to_path_buf(),
                        }
                        .into());
                    }
                    // v1: "the SP MUST delete the file or directory it created at this path".
                    // A plugin that leaves an empty directory is tolerated (real ones do); the
                    // CO removes what it created itself (v0).
                    mount_dirs::Removed::Removed if !co_creates_target => {
                        tracing::warn!(
                            plugin = %self.inner.config.plugin_type,
                            target = %target.display(),
                            "plugin left the target path after NodeUnpublishVolume (CSI v1 says it must remove it); removed it"
                        );
                    }
                    mount_dirs::Removed::Removed | mount_dirs::Removed::Missing => {}
                }
            }
        }
        Ok(())
    }

    /// Tidies up after a step skipped for lack of a capability.
    fn after_skip(&self, record: &VolumeRecord, to: VolumeState) -> Result<(), VolumeError> {
        if to == VolumeState::NodeReady && record.state == VolumeState::VolReady {
            // Unstage skipped (no STAGE_UNSTAGE_VOLUME): the CO-created staging dir, if any, goes.
            mount_dirs::remove(&self.staging_path(&record.volume_id))?;
        }
        Ok(())
    }

    async fn secrets(
        &self,
        slot: &mut Slot,
        record: &VolumeRecord,
    ) -> Result<VolumeSecrets, VolumeError> {
        if !record.has_secrets {
            return Ok(VolumeSecrets::default());
        }
        if let Some(secrets) = &slot.secrets {
            return Ok(secrets.clone());
        }
        let store = self.inner.store.clone();
        let c = self.inner.config.clone();
        let volume_id = record.volume_id.clone();
        let loaded: Option<VolumeSecrets> = blocking(move || {
            store
                .load_secrets(&c.plugin_type, &c.plugin_name, &volume_id)
                .map_err(VolumeError::StoreRead)
        })
        .await?;
        let secrets = loaded.unwrap_or_default();
        slot.secrets = Some(secrets.clone());
        Ok(secrets)
    }

    /// Makes `record` durable (waits for the commit holding it) and the slot's copy.
    async fn persist(&self, slot: &mut Slot, record: VolumeRecord) -> Result<(), VolumeError> {
        let c = &self.inner.config;
        self.inner
            .store
            .save_volume(&c.plugin_type, &c.plugin_name, &record.volume_id, &record)
            .await?;
        self.set_record(slot, Some(record));
        Ok(())
    }

    /// Notes `record` as progress (committed with a later batch, never waited for) and makes
    /// it the slot's copy. Safe to lose: a record on disk that is behind only makes recovery
    /// repeat RPCs, which CSI makes idempotent (docs/recovery.md).
    fn note(&self, slot: &mut Slot, record: VolumeRecord) -> Result<(), VolumeError> {
        let c = &self.inner.config;
        self.inner
            .store
            .note_volume(&c.plugin_type, &c.plugin_name, &record.volume_id, &record)?;
        self.set_record(slot, Some(record));
        Ok(())
    }

    /// Keeps the `volumes{plugin,state}` gauge in step with the records.
    fn count_state(&self, old: Option<VolumeState>, new: Option<VolumeState>) {
        let Some(metrics) = &self.inner.metrics else {
            return;
        };
        if old == new {
            return;
        }
        let labels = |state: VolumeState| VolumeStateLabels {
            plugin: self.inner.config.plugin_type.clone(),
            state: state.as_str().to_owned(),
        };
        if let Some(old) = old {
            metrics.volumes.get_or_create(&labels(old)).dec();
        }
        if let Some(new) = new {
            metrics.volumes.get_or_create(&labels(new)).inc();
        }
    }

    /// Deletes the record (and secrets) of an idle volume durably (controller DeleteVolume).
    async fn forget(&self, slot: &mut Slot, volume_id: &str) -> Result<(), VolumeError> {
        let c = &self.inner.config;
        self.inner
            .store
            .delete_volume(&c.plugin_type, &c.plugin_name, volume_id)
            .await?;
        self.set_record(slot, None);
        slot.secrets = None;
        Ok(())
    }

    /// Forgets an idle pre-provisioned volume as a progress note: if the note is lost, the
    /// record left on disk has no claim and recovery winds it down again (every teardown RPC
    /// answers OK for what is not there) before forgetting it.
    async fn note_forget(&self, slot: &mut Slot, volume_id: &str) -> Result<(), VolumeError> {
        let had_secrets = slot.record.as_ref().is_some_and(|r| r.has_secrets);
        let c = &self.inner.config;
        if had_secrets {
            // Deleting the secrets file is file-system work: off the async worker.
            let store = self.inner.store.clone();
            let c = c.clone();
            let id = volume_id.to_owned();
            blocking(move || store.note_delete(&c.plugin_type, &c.plugin_name, &id, true)).await?;
        } else {
            // Only a note queued to the writer: no thread hand-off for it.
            self.inner
                .store
                .note_delete(&c.plugin_type, &c.plugin_name, volume_id, false)?;
        }
        self.set_record(slot, None);
        slot.secrets = None;
        Ok(())
    }

    /// Removes `mounts/<enc id>/{staging,target}` and the dir itself, when empty and not
    /// mounted. Never recursive, never across a mount point.
    ///
    /// Inline, without a hand-off: [`mount_dirs::remove`] never enters a mount on the path.
    fn cleanup_mount_dir(&self, volume_id: &str) {
        // The usual case first: the steps already removed staging and target, and one rmdir
        // of the empty volume dir is all there is to do.
        if let Ok(mount_dirs::Removed::Removed | mount_dirs::Removed::Missing) =
            mount_dirs::remove(&self.volume_mount_dir(volume_id))
        {
            return;
        }
        for path in [
            self.staging_path(volume_id),
            self.target_path(volume_id),
            self.volume_mount_dir(volume_id),
        ] {
            match mount_dirs::remove(&path) {
                Ok(mount_dirs::Removed::Removed | mount_dirs::Removed::Missing) => {}
                Ok(mount_dirs::Removed::MountPoint) => {
                    tracing::warn!(path = %path.display(), "mount dir left in place: something is mounted on it");
                }
                Err(err) => {
                    tracing::warn!(path = %path.display(), error = %err, "mount dir left in place");
                }
            }
        }
    }

    /// The mount table, through the node's mounter ([`Binder::mounter`]).
    fn mount_table(&self) -> Result<MountTable, VolumeError> {
        Ok(sys::blocking("read mountinfo", || {
            self.inner.binder.mounter().mount_table()
        })?)
    }

    fn volume_mount_dir(&self, volume_id: &str) -> PathBuf {
        self.inner.mounts_root.join(encode_id(volume_id))
    }

    /// Waits until every progress note queued so far is committed (a clean shutdown, tests).
    pub async fn flush(&self) -> Result<(), VolumeError> {
        Ok(self.inner.store.flush().await?)
    }

    /// Forgets the plugin's capabilities (after its configuration changed): they are asked
    /// again before the next step.
    pub fn forget_capabilities(&self) {
        let mut learned = lock(&self.inner.learned);
        *learned = Learned {
            generation: learned.generation.wrapping_add(1),
            ..Learned::default()
        };
    }

    /// Waits for every RPC attempt to this plugin in flight to end, and keeps new ones from
    /// starting until the guard is dropped: a reload holds it while it swaps the plugin's
    /// components, so that no attempt straddles the swap (docs/reliability.md, "Reload").
    pub async fn pause_steps(&self) -> tokio::sync::OwnedRwLockWriteGuard<()> {
        Arc::clone(&self.inner.steps).write_owned().await
    }

    /// What the plugin advertises, asked once (and retried while it is unavailable).
    /// The capabilities as learned so far (never asks the plugin).
    fn learned_caps(&self) -> Option<Arc<Advertised>> {
        lock(&self.inner.learned).caps.clone()
    }

    async fn caps(&self, deadline: Instant) -> Result<Arc<Advertised>, VolumeError> {
        let generation = {
            let learned = lock(&self.inner.learned);
            if let Some(caps) = &learned.caps {
                return Ok(Arc::clone(caps));
            }
            learned.generation
        };
        let endpoints = &self.inner.endpoints;
        let steps = &self.inner.steps;
        let retry = self.inner.config.retry;
        let node = retry_transient(retry, deadline, || async {
            let _step = steps.read().await;
            let client = endpoints.client(Service::Node).await?;
            client.node_get_capabilities().await
        })
        .await?;
        let controller = if endpoints.serves(Service::Controller) {
            Some(
                retry_transient(retry, deadline, || async {
                    let _step = steps.read().await;
                    let client = endpoints.client(Service::Controller).await?;
                    client.controller_get_capabilities().await
                })
                .await?,
            )
        } else {
            None
        };
        let caps = Arc::new(Advertised {
            node,
            controller,
            expansion: OnceCell::new(),
        });
        let mut learned = lock(&self.inner.learned);
        if learned.generation == generation {
            learned.caps = Some(Arc::clone(&caps));
        }
        // Else the components were replaced while this was asked: this step still acts on
        // what it asked (consistently), the next one asks the new components.
        Ok(caps)
    }

    /// Refuses, before any RPC, an operation whose controller capability the plugin does not
    /// advertise: the spec lets a CO call an optional controller RPC only when its capability
    /// is advertised (e.g. "If the plugin has LIST_VOLUMES capability, the CO MAY call
    /// ListVolumes").
    pub async fn require_controller_cap(
        &self,
        capability: v1::controller_service_capability::rpc::Type,
        operation: &'static str,
    ) -> Result<(), VolumeError> {
        let deadline = Instant::now() + self.inner.config.operation_timeout;
        let caps = self.caps(deadline).await?;
        if caps
            .controller
            .as_ref()
            .is_some_and(|c| c.contains(&capability))
        {
            return Ok(());
        }
        Err(VolumeError::Unsupported {
            plugin: self.inner.config.plugin_type.clone(),
            operation,
            capability: capability.as_str_name(),
        })
    }

    /// Like [`Self::require_controller_cap`], for a node capability.
    pub async fn require_node_cap(
        &self,
        capability: v1::node_service_capability::rpc::Type,
        operation: &'static str,
    ) -> Result<(), VolumeError> {
        let deadline = Instant::now() + self.inner.config.operation_timeout;
        if self.caps(deadline).await?.node.contains(&capability) {
            return Ok(());
        }
        Err(VolumeError::Unsupported {
            plugin: self.inner.config.plugin_type.clone(),
            operation,
            capability: capability.as_str_name(),
        })
    }

    /// The node id for ControllerPublish: the configured one, or NodeGetInfo's (NodeGetId's on
    /// CSI 0.2).
    async fn node_id(&self, deadline: Instant) -> Result<String, VolumeError> {
        if let Some(id) = &self.inner.config.node_id {
            return Ok(id.clone());
        }
        // One NodeGetInfo serves the node id, the topology and the volume limit.
        let info = self.node_info(deadline).await?;
        if info.node_id.is_empty() {
            return Err(refusal::ProtocolViolation::EmptyNodeId.into());
        }
        Ok(info.node_id.clone())
    }

    fn observe_operation<T>(
        &self,
        operation: &str,
        result: &Result<T, VolumeError>,
        started: Instant,
    ) {
        if let Some(metrics) = &self.inner.metrics {
            metrics
                .operation_duration
                .get_or_create(&OperationLabels {
                    operation: operation.to_owned(),
                    outcome: if result.is_ok() { "ok" } else { "error" }.to_owned(),
                })
                .observe(started.elapsed().as_secs_f64());
        }
    }
}

/// Who lets an operation in ([`VolumeManager::enter`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Admission {
    /// A request or a reconciler: refused once the node drains.
    Request,
    /// The drain's own unpublish or reconcile.
    Drain,
}

/// Which recorded bind mounts a drive makes sure of (see [`VolumeManager::drive`]).
#[derive(Clone, Copy, Debug)]
enum Binds<'a> {
    /// None: an unpublish leaves the other workloads' binds alone.
    None,
    /// This workload's only: a publish.
    Of(&'a str),
    /// Every one: the reconciler and recovery.
    All,
}

/// True when two records want the same thing: the same claims, binds and way of use. A
/// change here is what an operation must make durable before its first RPC.
fn same_desire(a: &VolumeRecord, b: &VolumeRecord) -> bool {
    a.claims == b.claims
        && a.capability == b.capability
        && a.readonly == b.readonly
        && a.volume_context == b.volume_context
        && a.has_secrets == b.has_secrets
        && a.origin == b.origin
        && a.cluster_claim == b.cluster_claim
        && a.bind_mounts.len() == b.bind_mounts.len()
        && a.bind_mounts
            .iter()
            .zip(&b.bind_mounts)
            .all(|((wa, ba), (wb, bb))| wa == wb && ba.path == bb.path)
}

/// Every capability on: used to ask "is anything left to do at all?" without the plugin.
const ALL_CAPS: LifecycleCaps = LifecycleCaps {
    controller_publish: true,
    stage: true,
};

/// Retries `call` on transient errors until `deadline`.
async fn retry_transient<T, F, Fut>(
    policy: RetryPolicy,
    deadline: Instant,
    call: F,
) -> Result<T, VolumeError>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, RpcError>>,
{
    retry_transient_except(policy, deadline, &[], call).await
}

/// Like [`retry_transient`], but codes in `final_codes` are final for this RPC (the spec gives
/// some transient-looking codes a precise meaning, e.g. ListVolumes' ABORTED: a bad token).
async fn retry_transient_except<T, F, Fut>(
    policy: RetryPolicy,
    deadline: Instant,
    final_codes: &[tonic::Code],
    mut call: F,
) -> Result<T, VolumeError>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, RpcError>>,
{
    let mut backoff = Backoff::new(policy);
    loop {
        match call().await {
            Ok(value) => return Ok(value),
            // NotReady: the wait for the plugin's start is the whole budget for it.
            Err(err)
                if err.is_transient()
                    && !err.is_not_ready()
                    && !final_codes.contains(&err.code()) =>
            {
                let delay = backoff.next_delay();
                if Instant::now() + delay >= deadline {
                    return Err(err.into());
                }
                tokio::time::sleep(delay).await;
            }
            Err(err) => return Err(err.into()),
        }
    }
}

/// Runs blocking file-system work (fsync) off the async workers.
async fn blocking<T, E>(
    work: impl FnOnce() -> Result<T, E> + Send + 'static,
) -> Result<T, VolumeError>
where
    T: Send + 'static,
    E: Into<VolumeError> + Send + 'static,
{
    match tokio::task::spawn_blocking(work).await {
        Ok(result) => result.map_err(Into::into),
        Err(join) => Err(VolumeError::Io {
            path: PathBuf::new(),
            source: std::io::Error::other(format!("blocking task failed: {join}")),
        }),
    }
}

fn lock<T>(mutex: &StdMutex<T>) -> std::sync::MutexGuard<'_, T> {
    // A poisoned lock only means a panicking holder; the data is a plain value.
    mutex
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

// The helpers below are the volume code's blocking system calls, each through the one
// boundary (`crate::sys`).

fn path_string(path: &Path) -> String {
    path.to_string_lossy().into_owned()
}

fn to_hash_map(map: &BTreeMap<String, String>) -> HashMap<String, String> {
    map.iter().map(|(k, v)| (k.clone(), v.clone())).collect()
}

/// An access mode as the CSI spec spells it.
pub(crate) fn access_mode_name(mode: AccessMode) -> String {
    serde_json::to_value(mode)
        .ok()
        .and_then(|v| v.as_str().map(str::to_owned))
        .unwrap_or_default()
}

fn describe_use(record: &VolumeRecord) -> String {
    let mode = record
        .capability
        .as_ref()
        .map(|c| access_mode_name(c.access_mode))
        .unwrap_or_else(|| "no capability".to_owned());
    format!(
        "access_mode {mode}, readonly {}, {} claim(s)",
        record.readonly,
        record.claims.len()
    )
}

/// True for errors a caller may retry later (plugin unavailable, timeouts).
pub fn is_transient(err: &VolumeError) -> bool {
    matches!(err, VolumeError::Plugin(e) if e.is_transient())
        || matches!(
            err,
            VolumeError::Plugin(RpcError {
                kind: RpcErrorKind::DeadlineExceeded,
                ..
            })
        )
}
