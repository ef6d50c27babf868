//! Cluster mode: csi-agentd daemons on several nodes coordinate the volumes of shared
//! storage through etcd, so that a volume moves between nodes safely (docs/cluster.md).
//!
//! Owns the node's session with etcd (a lease, the node's presence key, the ownership of its
//! node name, the check that etcd is the one it joined), the claims a node takes and releases
//! on a volume's key, fences, and the read snapshot `GET /v1/cluster` answers from. It must
//! not call CSI itself: controller and node RPCs stay with the volume manager, which asks
//! this module before and after its steps ([`ClusterPlugin`] is how the session reaches it).
//!
//! The rules that make a move safe (docs/cluster.md, "Why a volume cannot be in two places"):
//! a claim is taken in etcd before the node's own durable claim and released only after the
//! node's NodeUnpublish, NodeUnstage and ControllerUnpublish; no claim is leased, so a node
//! that stops answering keeps its volumes until it returns or an operator fences it; every
//! change of a volume's key is a compare-and-swap on its revision.

pub mod claims;
mod deleting;
pub mod etcd;

pub mod keys;
pub mod leader;
pub mod store;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex as StdMutex, Weak};
use std::time::{Duration, Instant, SystemTime};

use futures::future::BoxFuture;
use serde::Serialize;

use self::claims::{Admitted, ClaimRequest, Refusal};
use self::keys::{
    EntryState, Fence, Keys, Member, NodeEntry, NodeInfo, PluginKey, SCHEMA, ValueError,
    VolumeClaims, encode, key_name,
};
pub use self::leader::{Also, LeaderView, Leadership};
use self::store::{ClusterStore, Guarded, StoreError, Versioned, WriteOp};
use crate::volume::access_mode_name;

/// How many times a compare-and-swap is retried when another node changed the key between
/// the read and the write.
const CAS_TRIES: u32 = 16;

/// Cluster settings from the daemon's flags.
#[derive(Clone, Debug)]
pub struct ClusterOptions {
    /// The key prefix: daemons with the same name form one cluster.
    pub name: String,
    /// This node's name, unique in the cluster.
    pub node: String,
    /// The node's lease: its presence vanishes this long after its last keepalive.
    pub lease_ttl: Duration,
}

/// What went wrong with a cluster operation. Each says what to do.
#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    #[error("cluster volumes cannot be published now: {reason}; mounted volumes are unaffected")]
    Unavailable { reason: String },
    #[error(
        "volume {volume_id} ({access_mode}) is held by {holders}; it moves when {movers} \
         unpublishes it{fence_hint}"
    )]
    Held {
        volume_id: String,
        access_mode: String,
        holders: String,
        movers: String,
        fence_hint: String,
    },
    #[error(
        "volume {volume_id} is held with another capability ({held}) by {holders}; publish it \
         with that capability or wait until they unpublish it"
    )]
    OtherCapability {
        volume_id: String,
        held: String,
        holders: String,
    },
    #[error(
        "volume {volume_id} is held by this node with readonly={held_readonly}; a publish \
         must agree with it"
    )]
    OtherReadonly {
        volume_id: String,
        held_readonly: bool,
    },
    #[error(
        "this node's hold on volume {volume_id} was taken away ({found}): an operator fenced \
         this node, or etcd was replaced; the volume is released on this node and is not \
         used here again until it is claimed anew"
    )]
    Lost { volume_id: String, found: String },
    #[error(
        "{source}; the volume is taken as held by an unknown holder: fix or delete the key \
         (docs/cluster.md, \"A damaged key\")"
    )]
    Unreadable {
        #[source]
        source: ValueError,
    },
    #[error("volume {volume_id} has entries for {max} nodes, the most one key may hold")]
    TooManyNodes { volume_id: String, max: usize },
    #[error("{key} kept changing under {tries} compare-and-swap attempts; try again")]
    Contention { key: String, tries: u32 },
    #[error(
        "node {node} is alive (its lease is held): fencing a live node lets two nodes write \
         one volume; stop its csi-agentd (or power it off) and fence it once `csictl cluster \
         nodes` no longer lists it"
    )]
    Alive { node: String },
    #[error("node name {node} may not be fenced: {why}")]
    BadFence { node: String, why: String },
    /// This node stopped leading the plugin's controller during a step (its lease ran out,
    /// or another daemon leads now): nothing was written; the new leader does the step.
    #[error(
        "this node no longer leads the controller of plugin {plugin}; the step is handed to \
         the new leader"
    )]
    Deposed { plugin: String },
    /// The plugin's controller leader sent the step and the plugin refused it.
    #[error(
        "{step} of volume {volume_id} by the controller leader (node {leader}) failed: {message}"
    )]
    LeaderRefused {
        volume_id: String,
        step: &'static str,
        leader: String,
        message: String,
    },
    /// A DeleteVolume refused: nodes hold the volume.
    #[error("volume {volume_id} is held by {holders}: unpublish it there before deleting it")]
    DeleteInUse { volume_id: String, holders: String },
    /// A claim (or another DeleteVolume) refused: a node is deleting the volume.
    #[error(
        "volume {volume_id} is being deleted by node {node}: it cannot be published (or deleted \
         elsewhere) until that DeleteVolume ends; if it was interrupted, delete the volume again \
         on {node}, or, if {node} is gone for good, delete the key {key} with etcdctl"
    )]
    BeingDeleted {
        volume_id: String,
        node: String,
        key: String,
    },
    #[error(transparent)]
    Store(#[from] StoreError),
}

impl ClusterError {
    /// True when etcd (or this node's session) cannot answer now: a 503, not a 409.
    pub fn is_unavailable(&self) -> bool {
        match self {
            ClusterError::Unavailable { .. } | ClusterError::Deposed { .. } => true,
            ClusterError::Store(err) => err.is_unavailable(),
            _ => false,
        }
    }
}

/// Where this node's session with etcd is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum SessionState {
    /// Not joined yet (etcd not reached since the start or since the lease was lost).
    Joining,
    /// Lease held and kept alive: cluster publishes are allowed.
    Healthy,
    /// A keepalive or request failed; the lease may still be valid.
    Degraded,
    /// The node found itself fenced and is releasing its cluster volumes.
    Fenced,
    /// The node may not join (its name belongs to another daemon, or etcd is another one);
    /// the reason says what to do.
    Refused,
}

/// The session as `GET /v1/cluster` shows it: kept current by the session task, read without
/// waiting on etcd.
#[derive(Clone, Debug, Serialize)]
pub struct ClusterStatus {
    pub name: String,
    pub node: String,
    pub instance_id: String,
    pub state: SessionState,
    pub lease_id: i64,
    pub lease_ttl_secs: u64,
    /// How much longer this node may count on its lease (0 when none).
    pub lease_valid_for_ms: u64,
    pub since_unix: u64,
    pub reason: Option<String>,
    pub etcd_cluster_id: Option<u64>,
    /// Nodes with a live lease at the session's last look.
    pub members: Vec<NodeInfo>,
    /// Fenced nodes at the session's last look.
    pub fenced: Vec<String>,
    /// Cluster volumes this node released without using after it found itself fenced.
    pub released_after_fence: Vec<String>,
    pub lease_losses: u64,
    /// Each cluster plugin's controller leader, as this node last saw it.
    pub leaders: Vec<LeaderView>,
}

/// A node's entry on one volume, for `GET /v1/cluster/claims`.
#[derive(Clone, Debug, Serialize)]
pub struct ClaimView {
    pub plugin_type: String,
    pub plugin_name: String,
    pub volume_id: String,
    pub access_mode: String,
    pub node: String,
    pub state: EntryState,
    /// The node has no live lease: it may be down or cut off.
    pub suspect: bool,
    pub readonly: bool,
    pub csi_node_id: String,
    pub workloads: Vec<String>,
    pub since_unix: u64,
}

/// A key that could not be read while listing claims.
#[derive(Clone, Debug, Serialize)]
pub struct DamagedKey {
    pub key: String,
    pub problem: String,
}

/// What a fence did on this daemon.
#[derive(Clone, Debug, Default, Serialize)]
pub struct FenceReport {
    pub node: String,
    /// Volumes ControllerUnpublished from the fenced node and freed.
    pub freed: Vec<String>,
    /// Volumes still held (with why): a plugin this daemon does not run, or an answer that
    /// does not prove the detach.
    pub left: Vec<String>,
}

/// A cluster plugin's volume manager, as the session reaches it.
pub trait ClusterPlugin: Send + Sync + std::fmt::Debug {
    fn plugin_key(&self) -> PluginKey;
    /// Detaches every volume of `node` (fenced) through this daemon's controller and frees
    /// its entries.
    fn free_fenced<'a>(&'a self, node: &'a str) -> BoxFuture<'a, FenceReport>;
    /// This node was fenced: releases, node side only, every volume whose hold it lost.
    /// Returns the volumes released; an error leaves the fence in place for the next try.
    fn release_lost(&self) -> BoxFuture<'_, Result<Vec<String>, String>>;
    /// Removes this node's entries that no local record explains (a crash between the claim
    /// and the node's own record).
    fn sweep_orphans(&self) -> BoxFuture<'_, Result<(), String>>;
    /// The plugin's NodeGetInfo on this node if it was asked already (never asks: plugins
    /// start on first use).
    fn csi_node(&self) -> Option<keys::CsiNode>;
    /// Whether the plugin has the ControllerPublish step, if its capabilities are known
    /// (never asks: the session's own loop must not wait on a plugin).
    fn controller_step_known(&self) -> Option<bool>;
    /// Whether this daemon stands for the plugin's controller leader (asks the plugin's
    /// capabilities, starting it if need be: a leader serves other nodes' steps): its plugin has the
    /// ControllerPublish step (docs/cluster.md, "One controller per plugin").
    fn wants_leadership(&self) -> BoxFuture<'_, bool>;
    /// As the plugin's leader: does the controller work other nodes asked for (ControllerPublish
    /// of `PUBLISHING` entries, ControllerUnpublish of `NODE_DETACHED` ones), each result
    /// written under `leadership`.
    fn serve(&self, leadership: Leadership) -> BoxFuture<'_, Result<(), ClusterError>>;
}

/// A volume's value as this node last wrote (or read) it, with its revision: the next
/// compare-and-swap of the node's own steps starts from it instead of a read.
#[derive(Clone, Debug)]
pub struct Known {
    pub claims: VolumeClaims,
    pub revision: i64,
}

/// The state a node keeps about its own holds: whether an entry is still its own.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Own {
    /// The entry is this node's claim, in this state.
    Held(NodeEntry),
    /// The entry was fenced: the node may finish its release (it is back), never use it.
    Fenced(NodeEntry),
    /// No entry of this claim exists (freed after a fence, or never written).
    Gone,
}

/// The node's cluster handle: cheap to clone.
#[derive(Clone)]
pub struct Cluster {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Cluster {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Cluster")
            .field("name", &self.inner.options.name)
            .field("node", &self.inner.options.node)
            .finish_non_exhaustive()
    }
}

struct Inner {
    options: ClusterOptions,
    keys: Keys,
    store: Arc<dyn ClusterStore>,
    /// The same store, measured apart: the election, the leader's polling, the presence's
    /// refresh (calls no request waits for).
    background_store: Arc<dyn ClusterStore>,
    instance_id: String,
    /// The etcd cluster id this node joined first (from its own durable state).
    joined_cluster_id: StdMutex<Option<u64>>,
    /// Where the first join's etcd cluster id is made durable.
    remember_cluster_id: Box<dyn Fn(u64) -> Result<(), String> + Send + Sync>,
    session: StdMutex<Session>,
    plugins: StdMutex<Vec<Weak<dyn ClusterPlugin>>>,
    /// Each cluster plugin's controller leader as this node last saw it.
    leaders: StdMutex<BTreeMap<PluginKey, leader::Seen>>,
    /// The plugins known to have the ControllerPublish step in the cluster (`controllers/`
    /// key read or written): never asked again.
    with_controller: StdMutex<BTreeSet<PluginKey>>,
    /// Keys found unreadable and warned about: the leader looks at least once a second, and
    /// a forged or newer-schema key must not flood the log (bounded: forgotten when full).
    warned: StdMutex<BTreeSet<Vec<u8>>>,
    running: std::sync::atomic::AtomicBool,
    metrics: Option<Arc<crate::metrics::Metrics>>,
    /// Unix seconds this daemon's cluster handle was made (the presence's `started_at`).
    started_at: u64,
}

#[derive(Clone, Debug)]
struct Session {
    state: SessionState,
    lease: Option<i64>,
    valid_until: Option<Instant>,
    since: u64,
    reason: Option<String>,
    cluster_id: Option<u64>,
    members: Vec<NodeInfo>,
    fenced: Vec<String>,
    released_after_fence: Vec<String>,
    lease_losses: u64,
    /// The node key's value as last written with the current lease.
    presence: Option<NodeInfo>,
}

fn now_unix() -> u64 {
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

fn lock<T>(mutex: &StdMutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// This node's durable identity in the cluster, kept in the node's own store.
#[derive(Clone, Debug)]
pub struct Identity {
    pub instance_id: String,
    pub etcd_cluster_id: Option<u64>,
}

impl Cluster {
    /// The node's cluster handle; [`Cluster::run`] starts its session. `remember_cluster_id`
    /// makes the first join's etcd cluster id durable.
    pub fn new(
        options: ClusterOptions,
        store: Arc<dyn ClusterStore>,
        identity: Identity,
        remember_cluster_id: Box<dyn Fn(u64) -> Result<(), String> + Send + Sync>,
        metrics: Option<Arc<crate::metrics::Metrics>>,
    ) -> Cluster {
        let measured = |prefix: &'static str| -> Arc<dyn ClusterStore> {
            match &metrics {
                Some(metrics) => Arc::new(store::Measured {
                    store: store.clone(),
                    metrics: metrics.clone(),
                    prefix,
                }),
                None => store.clone(),
            }
        };
        let background_store = measured("background_");
        let store = measured("");
        Cluster {
            inner: Arc::new(Inner {
                keys: Keys::new(&options.name),
                options,
                store,
                background_store,
                instance_id: identity.instance_id,
                joined_cluster_id: StdMutex::new(identity.etcd_cluster_id),
                remember_cluster_id,
                session: StdMutex::new(Session {
                    state: SessionState::Joining,
                    lease: None,
                    valid_until: None,
                    since: now_unix(),
                    reason: Some("not joined yet".to_owned()),
                    cluster_id: None,
                    members: Vec::new(),
                    fenced: Vec::new(),
                    released_after_fence: Vec::new(),
                    lease_losses: 0,
                    presence: None,
                }),
                plugins: StdMutex::new(Vec::new()),
                leaders: StdMutex::new(BTreeMap::new()),
                warned: StdMutex::new(BTreeSet::new()),
                with_controller: StdMutex::new(BTreeSet::new()),
                running: std::sync::atomic::AtomicBool::new(false),
                metrics,
                started_at: now_unix(),
            }),
        }
    }

    /// Starts the session task (once): the node joins as soon as etcd answers. Called after
    /// the plugins present at start registered, so that the first join can release what a
    /// fence took and sweep orphans for each of them.
    pub fn run(&self) {
        if self
            .inner
            .running
            .swap(true, std::sync::atomic::Ordering::AcqRel)
        {
            return;
        }
        let task = self.clone();
        tokio::spawn(async move { task.run_session().await });
        let task = self.clone();
        tokio::spawn(async move { task.run_leadership().await });
    }

    pub fn node(&self) -> &str {
        &self.inner.options.node
    }

    pub fn keys(&self) -> &Keys {
        &self.inner.keys
    }

    /// Registers a cluster plugin's volume manager (held weakly: a removed plugin drops out).
    pub fn register(&self, plugin: &Arc<dyn ClusterPlugin>) {
        lock(&self.inner.plugins).push(Arc::downgrade(plugin));
    }

    fn plugins(&self) -> Vec<Arc<dyn ClusterPlugin>> {
        let mut plugins = lock(&self.inner.plugins);
        plugins.retain(|p| p.strong_count() > 0);
        plugins.iter().filter_map(Weak::upgrade).collect()
    }

    /// The session as last seen; never waits on etcd.
    pub fn status(&self) -> ClusterStatus {
        let session = lock(&self.inner.session).clone();
        let valid_for = session
            .valid_until
            .map(|until| until.saturating_duration_since(Instant::now()))
            .unwrap_or_default();
        ClusterStatus {
            name: self.inner.options.name.clone(),
            node: self.inner.options.node.clone(),
            instance_id: self.inner.instance_id.clone(),
            state: session.state,
            lease_id: session.lease.unwrap_or(0),
            lease_ttl_secs: self.inner.options.lease_ttl.as_secs(),
            lease_valid_for_ms: valid_for.as_millis() as u64,
            since_unix: session.since,
            reason: session.reason,
            etcd_cluster_id: session.cluster_id,
            members: session.members,
            fenced: session.fenced,
            released_after_fence: session.released_after_fence,
            lease_losses: session.lease_losses,
            leaders: self.leader_views(),
        }
    }

    /// Refuses unless the session is healthy with a lease valid for a while yet: a node that
    /// may have been fenced must not take or use a hold.
    pub fn require_healthy(&self) -> Result<(), ClusterError> {
        let session = lock(&self.inner.session);
        let margin = self.inner.options.lease_ttl / 4;
        let valid = session
            .valid_until
            .is_some_and(|until| until > Instant::now() + margin);
        // A keepalive that failed once (DEGRADED) leaves the lease valid by this node's own
        // clock: a claim may still be tried (it must reach etcd anyway), so that a member lost
        // among three, or an etcd leader election, goes unnoticed.
        if matches!(
            session.state,
            SessionState::Healthy | SessionState::Degraded
        ) && valid
        {
            return Ok(());
        }
        let reason = match (&session.state, &session.reason) {
            (SessionState::Healthy, _) => "this node's etcd lease is about to run out".to_owned(),
            (state, Some(reason)) => format!("cluster session {state:?}: {reason}"),
            (state, None) => format!("cluster session {state:?}"),
        };
        Err(ClusterError::Unavailable { reason })
    }

    fn set_session(&self, edit: impl FnOnce(&mut Session)) {
        let mut session = lock(&self.inner.session);
        let before = session.state;
        edit(&mut session);
        if session.state != before {
            session.since = now_unix();
            tracing::info!(node = %self.inner.options.node, from = ?before, to = ?session.state, reason = ?session.reason, "cluster session changed");
        }
    }

    async fn run_session(self) {
        let ttl = self.inner.options.lease_ttl;
        let tick = (ttl / 3).max(Duration::from_millis(200));
        loop {
            let joined = lock(&self.inner.session).lease.is_some();
            if !joined {
                match self.join().await {
                    Ok(()) => {}
                    Err(JoinFailure::Refused(reason)) => {
                        tracing::error!(node = %self.inner.options.node, %reason, "this node may not join the cluster");
                        self.set_session(|s| {
                            s.state = SessionState::Refused;
                            s.reason = Some(reason);
                        });
                        tokio::time::sleep(tick.max(Duration::from_secs(2))).await;
                        continue;
                    }
                    Err(JoinFailure::Retry(reason)) => {
                        self.set_session(|s| {
                            if s.state != SessionState::Fenced {
                                s.state = SessionState::Joining;
                            }
                            s.reason = Some(reason);
                        });
                        tokio::time::sleep(tick).await;
                        continue;
                    }
                }
            }
            tokio::time::sleep(tick).await;
            self.keep_alive().await;
            self.look_around().await;
        }
    }

    async fn keep_alive(&self) {
        let Some(lease) = lock(&self.inner.session).lease else {
            return;
        };
        let sent = Instant::now();
        match self.inner.store.keep_alive(lease).await {
            Ok(ttl) if ttl > 0 => self.set_session(|s| {
                s.state = SessionState::Healthy;
                s.reason = None;
                s.valid_until = Some(sent + Duration::from_secs(ttl as u64));
            }),
            Ok(_) => self.lose_lease("etcd says the lease is gone".to_owned()),
            Err(err) => {
                let expired = lock(&self.inner.session)
                    .valid_until
                    .is_none_or(|until| until <= Instant::now());
                if expired {
                    self.lose_lease(format!("lease ran out while etcd was unreachable: {err}"));
                } else {
                    self.set_session(|s| {
                        s.state = SessionState::Degraded;
                        s.reason = Some(format!("keepalive failed: {err}"));
                    });
                }
            }
        }
    }

    fn lose_lease(&self, reason: String) {
        if let Some(metrics) = &self.inner.metrics {
            metrics.cluster_lease_losses.inc();
        }
        tracing::warn!(node = %self.inner.options.node, %reason, "cluster lease lost; joining again");
        self.set_session(|s| {
            s.state = SessionState::Joining;
            s.lease = None;
            s.valid_until = None;
            s.reason = Some(reason);
            s.lease_losses += 1;
        });
        // The leader keys went (or go) with the lease.
        self.forget_leadership(None);
    }

    /// This node's presence value: its plugins and what each answered to NodeGetInfo so far.
    fn presence(&self) -> NodeInfo {
        let plugins = self.plugins();
        let name = |p: &Arc<dyn ClusterPlugin>| {
            let key = p.plugin_key();
            format!("{}/{}", key.plugin_type, key.plugin_name)
        };
        NodeInfo {
            schema: SCHEMA,
            node: self.inner.options.node.clone(),
            instance_id: self.inner.instance_id.clone(),
            version: env!("CARGO_PKG_VERSION").to_owned(),
            started_at: self.inner.started_at,
            plugins: plugins.iter().map(name).collect(),
            csi: plugins
                .iter()
                .filter_map(|p| Some((name(p), p.csi_node()?)))
                .collect(),
        }
    }

    /// Writes the node's presence again when it changed since the join (a plugin answered
    /// NodeGetInfo for the first time): under the lease, unless the node was fenced meanwhile.
    async fn refresh_presence(&self) {
        let (lease, written) = {
            let session = lock(&self.inner.session);
            (session.lease, session.presence.clone())
        };
        let Some(lease) = lease else {
            return;
        };
        let presence = self.presence();
        if written.as_ref() == Some(&presence) {
            return;
        }
        let node = &self.inner.options.node;
        let put = self.inner.background_store.write(Guarded {
            when: vec![(self.inner.keys.fence(node), 0)],
            then: vec![WriteOp::Put {
                key: self.inner.keys.node(node),
                value: encode(&presence),
                lease: Some(lease),
            }],
        });
        if let Ok(Some(_)) = put.await {
            self.set_session(|s| s.presence = Some(presence));
        }
    }

    /// Refreshes the members and fences in the snapshot, and frees fenced nodes' volumes
    /// through this daemon's plugins.
    async fn look_around(&self) {
        self.refresh_presence().await;
        if let Ok(read) = self.inner.store.list(self.inner.keys.nodes()).await {
            let members = read
                .kvs
                .iter()
                .filter_map(|kv| NodeInfo::decode(&kv.key, &kv.value).ok())
                .collect();
            self.set_session(|s| s.members = members);
        }
        let Ok(read) = self.inner.store.list(self.inner.keys.fences()).await else {
            return;
        };
        let fenced: Vec<String> = read
            .kvs
            .iter()
            .filter_map(|kv| {
                let prefix = self.inner.keys.fences();
                let encoded = kv.key.get(prefix.len()..)?;
                crate::layout::decode_id(std::str::from_utf8(encoded).ok()?)
            })
            .collect();
        self.set_session(|s| s.fenced = fenced.clone());
        for node in fenced {
            if node == self.inner.options.node {
                continue;
            }
            for plugin in self.plugins() {
                // Only the leader frees a plugin with a controller step: the others would
                // list the plugin's volumes for nothing. Never waits on a plugin here: the
                // keepalives come from this loop.
                let key = plugin.plugin_key();
                if self.leadership(&key).is_none() && plugin.controller_step_known() != Some(false)
                {
                    continue;
                }
                let report = plugin.free_fenced(&node).await;
                if !report.freed.is_empty() {
                    tracing::info!(fenced = %node, freed = ?report.freed, left = ?report.left, "volumes of a fenced node freed");
                }
            }
        }
    }

    async fn join(&self) -> Result<(), JoinFailure> {
        let store = &self.inner.store;
        let keys = &self.inner.keys;
        let node = self.inner.options.node.clone();
        let ttl = self.inner.options.lease_ttl.as_secs().max(1) as i64;
        let retry = |err: StoreError| JoinFailure::Retry(err.to_string());
        // The member key says which daemon owns the node name (never leased).
        let member_key = keys.member(&node);
        let member = store.get(member_key.clone()).await.map_err(retry)?;
        self.check_cluster_id(member.cluster_id)?;
        match member.kvs.first() {
            Some(kv) => {
                let owner = Member::decode(&kv.key, &kv.value)
                    .map_err(|err| JoinFailure::Refused(format!("{err}: fix or delete the key")))?;
                if owner.instance_id != self.inner.instance_id {
                    return Err(JoinFailure::Refused(format!(
                        "node name {node} belongs to another csi-agentd (instance {}, joined at \
                         {}): give this one another --node-name, or, if that daemon is gone for \
                         good, delete the key {} with etcdctl",
                        owner.instance_id,
                        owner.joined_at,
                        key_name(&member_key)
                    )));
                }
            }
            None => {
                let value = encode(&Member {
                    schema: SCHEMA,
                    instance_id: self.inner.instance_id.clone(),
                    joined_at: now_unix(),
                });
                let created = store
                    .write(Guarded {
                        when: vec![(member_key.clone(), 0)],
                        then: vec![WriteOp::Put {
                            key: member_key,
                            value,
                            lease: None,
                        }],
                    })
                    .await
                    .map_err(retry)?;
                if created.is_none() {
                    return Err(JoinFailure::Retry(
                        "another daemon took the node name meanwhile".to_owned(),
                    ));
                }
            }
        }
        let lease = store.grant(ttl).await.map_err(retry)?;
        let granted = Instant::now();
        // A fenced node releases what it lost before it is present again.
        let fence_key = keys.fence(&node);
        let fence = store.get(fence_key.clone()).await.map_err(retry)?;
        if let Some(kv) = fence.kvs.first() {
            let why = Fence::decode(&kv.key, &kv.value)
                .map(|f| format!("fenced by {} at {}: {}", f.by, f.at, f.reason))
                .unwrap_or_else(|err| format!("fenced ({err})"));
            tracing::warn!(node = %node, %why, "this node was fenced: releasing its cluster volumes without using them");
            self.set_session(|s| {
                s.state = SessionState::Fenced;
                s.reason = Some(format!("{why}; releasing this node's cluster volumes"));
                s.lease = None;
            });
            let mut released = Vec::new();
            for plugin in self.plugins() {
                match plugin.release_lost().await {
                    Ok(mut volumes) => released.append(&mut volumes),
                    Err(err) => {
                        let _ = store.revoke(lease).await;
                        return Err(JoinFailure::Retry(format!(
                            "releasing the volumes of a fenced node failed: {err}"
                        )));
                    }
                }
            }
            tracing::warn!(node = %node, released = ?released, "fenced node released its cluster volumes");
            self.set_session(|s| s.released_after_fence.extend(released));
            let cleared = store
                .write(Guarded {
                    when: vec![(fence_key.clone(), kv.mod_revision)],
                    then: vec![WriteOp::Delete { key: fence_key }],
                })
                .await
                .map_err(retry)?;
            if cleared.is_none() {
                return Err(JoinFailure::Retry("the fence changed meanwhile".to_owned()));
            }
        }
        let presence = self.presence();
        let info = encode(&presence);
        let node_key = keys.node(&node);
        let fence_key = keys.fence(&node);
        let present = store
            .write(Guarded {
                when: vec![(fence_key, 0)],
                then: vec![WriteOp::Put {
                    key: node_key,
                    value: info,
                    lease: Some(lease),
                }],
            })
            .await
            .map_err(retry)?;
        if present.is_none() {
            let _ = store.revoke(lease).await;
            return Err(JoinFailure::Retry(
                "this node was fenced while joining".to_owned(),
            ));
        }
        self.set_session(|s| {
            s.state = SessionState::Healthy;
            s.reason = None;
            s.lease = Some(lease);
            s.valid_until = Some(granted + Duration::from_secs(ttl as u64));
            s.presence = Some(presence);
        });
        // In its own task: the sweep waits on volumes' locks, and an operation holding one
        // may wait on etcd through this very session (a step handed to the leader), whose
        // keepalives must go on meanwhile.
        let plugins = self.plugins();
        let node = self.inner.options.node.clone();
        tokio::spawn(async move {
            for plugin in plugins {
                if let Err(err) = plugin.sweep_orphans().await {
                    tracing::warn!(node = %node, error = %err, "orphan claims not swept; the next join tries again");
                }
            }
        });
        Ok(())
    }

    fn check_cluster_id(&self, found: u64) -> Result<(), JoinFailure> {
        let mut joined = lock(&self.inner.joined_cluster_id);
        match *joined {
            Some(expected) if expected != found => Err(JoinFailure::Refused(format!(
                "etcd is another cluster than the one this node joined (cluster id {found:x}, \
                 joined {expected:x}): an empty or restored etcd is not a free cluster; this \
                 node keeps its mounts and takes no new cluster volume (docs/cluster.md, \
                 \"etcd replaced\")"
            ))),
            Some(_) => {
                self.set_session(|s| s.cluster_id = Some(found));
                Ok(())
            }
            None => {
                (self.inner.remember_cluster_id)(found).map_err(|err| {
                    JoinFailure::Retry(format!("the etcd cluster id could not be recorded: {err}"))
                })?;
                *joined = Some(found);
                self.set_session(|s| s.cluster_id = Some(found));
                Ok(())
            }
        }
    }

    /// Runs `call` again while etcd is unavailable, for half the lease TTL (at least 2 s,
    /// a few of etcd's default election timeouts): a member killed among three, or a leader
    /// election, is ridden out rather than reported. Safe
    /// for guarded writes too: a write that was applied although its answer was lost fails
    /// its compare when repeated, and the caller reads again.
    async fn patiently<T, F, Fut>(&self, mut call: F) -> Result<T, StoreError>
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = Result<T, StoreError>>,
    {
        let patience = (self.inner.options.lease_ttl / 2).max(Duration::from_secs(2));
        let deadline = Instant::now() + patience;
        loop {
            match call().await {
                Err(err) if err.is_unavailable() && Instant::now() < deadline => {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                other => return other,
            }
        }
    }

    /// Reads a volume's claims; an unreadable value is an error, never "free".
    async fn read_volume(
        &self,
        plugin: &PluginKey,
        volume_id: &str,
    ) -> Result<(Option<VolumeClaims>, i64), ClusterError> {
        let key = self.inner.keys.volume(plugin, volume_id);
        let read = self.patiently(|| self.inner.store.get(key.clone())).await?;
        match read.kvs.into_iter().next() {
            None => Ok((None, 0)),
            Some(kv) => {
                let claims = VolumeClaims::decode(&kv.key, &kv.value)
                    .map_err(|source| ClusterError::Unreadable { source })?;
                Ok((Some(claims), kv.mod_revision))
            }
        }
    }

    /// Replaces a volume's value (or deletes it when `None`) if it is still at `revision`,
    /// with `also`'s compares and writes in the same transaction. A leader write whose
    /// leadership no longer holds is [`ClusterError::Deposed`], never a retry.
    async fn swap(
        &self,
        plugin: &PluginKey,
        volume_id: &str,
        revision: i64,
        next: Option<&VolumeClaims>,
        also: &Also,
    ) -> Result<Option<i64>, ClusterError> {
        let key = self.inner.keys.volume(plugin, volume_id);
        let op = match next {
            Some(value) => WriteOp::Put {
                key: key.clone(),
                value: encode(value),
                lease: None,
            },
            None => WriteOp::Delete { key: key.clone() },
        };
        let mut guarded = Guarded {
            when: vec![(key, revision)],
            then: vec![op],
        };
        if let Some(leadership) = &also.leadership {
            guarded
                .when
                .push((leadership.key.clone(), leadership.revision));
        }
        guarded
            .when
            .extend(also.absent.iter().map(|key| (key.clone(), 0)));
        guarded.then.extend(also.ops.iter().cloned());
        let written = self
            .patiently(|| self.inner.store.write(guarded.clone()))
            .await?;
        if written.is_none()
            && let Some(leadership) = &also.leadership
        {
            self.check_leadership(plugin, leadership).await?;
        }
        Ok(written)
    }

    /// One compare-and-swap loop on a volume's key: `decide` sees the value (from `known`
    /// first, else read) and edits it in place, answering whether to write it (`None`
    /// deletes the key). Answers `decide`'s result and the value and revision now known.
    async fn change_volume<R>(
        &self,
        plugin: &PluginKey,
        volume_id: &str,
        known: Option<Known>,
        also: &Also,
        mut decide: impl FnMut(&mut Option<VolumeClaims>) -> Change<R>,
    ) -> Result<(R, Option<Known>), ClusterError> {
        let mut known = known;
        for _ in 0..CAS_TRIES {
            let (mut current, revision) = match known.take() {
                Some(Known { claims, revision }) => (Some(claims), revision),
                None => self.read_volume(plugin, volume_id).await?,
            };
            let (result, write) = match decide(&mut current) {
                Change::Keep(result) => (result, false),
                Change::Write(result) => (result, true),
            };
            if !write {
                let known = current.map(|claims| Known { claims, revision });
                return Ok((result, known));
            }
            if let Some(revision) = self
                .swap(plugin, volume_id, revision, current.as_ref(), also)
                .await?
            {
                let known = current.map(|claims| Known { claims, revision });
                return Ok((result, known));
            }
        }
        Err(ClusterError::Contention {
            key: key_name(&self.inner.keys.volume(plugin, volume_id)),
            tries: CAS_TRIES,
        })
    }

    /// Changes to a volume's key from `from_revision` on, for a node waiting for the leader's
    /// result in its entry.
    pub async fn watch_volume(
        &self,
        plugin: &PluginKey,
        volume_id: &str,
        from_revision: i64,
    ) -> Result<Box<dyn store::Changes>, ClusterError> {
        let key = self.inner.keys.volume(plugin, volume_id);
        Ok(self.inner.store.watch(key, false, from_revision).await?)
    }

    /// Takes (or extends) this node's hold on a volume for a workload. One read and, when
    /// anything changes, one compare-and-swap. Nothing is written on a refusal.
    pub async fn claim(
        &self,
        plugin: &PluginKey,
        request: ClaimRequest,
    ) -> Result<(String, Known), ClusterError> {
        self.try_claim(plugin, request).await.map_err(unavailable)
    }

    async fn try_claim(
        &self,
        plugin: &PluginKey,
        mut request: ClaimRequest,
    ) -> Result<(String, Known), ClusterError> {
        self.require_healthy()?;
        request.node = self.inner.options.node.clone();
        request.now = now_unix();
        let volume_id = request.volume_id.clone();
        for _ in 0..CAS_TRIES {
            let (current, revision) = self.read_volume(plugin, &volume_id).await?;
            let Admitted {
                claims,
                claim_id,
                changed,
            } = match claims::admit(current.as_ref(), &request) {
                Ok(admitted) => admitted,
                Err(refusal) => {
                    if let (Some(metrics), Refusal::Held { .. } | Refusal::OtherCapability { .. }) =
                        (&self.inner.metrics, &refusal)
                    {
                        metrics
                            .cluster_conflicts
                            .get_or_create(&crate::metrics::PluginLabels {
                                plugin: plugin.plugin_type.clone(),
                            })
                            .inc();
                    }
                    let alive = self.alive_nodes().await;
                    return Err(self.refusal(&volume_id, &alive, refusal));
                }
            };
            if !changed {
                return Ok((claim_id, Known { claims, revision }));
            }
            // Never while a DeleteVolume of the volume runs (cluster::deleting).
            let also = Also {
                absent: vec![self.inner.keys.deleting(plugin, &volume_id)],
                ..Also::default()
            };
            if let Some(revision) = self
                .swap(plugin, &volume_id, revision, Some(&claims), &also)
                .await?
            {
                return Ok((claim_id, Known { claims, revision }));
            }
            // The volume's key changed, or a deletion began: only the latter is a refusal.
            self.refuse_while_deleting(plugin, &volume_id).await?;
        }
        Err(ClusterError::Contention {
            key: key_name(&self.inner.keys.volume(plugin, &volume_id)),
            tries: CAS_TRIES,
        })
    }

    /// The nodes with a live lease: read from etcd (a refusal or a listing names suspects
    /// from what etcd says now), or from the session's last look when etcd does not answer.
    async fn alive_nodes(&self) -> Vec<String> {
        match self.inner.store.list(self.inner.keys.nodes()).await {
            Ok(read) => read
                .kvs
                .iter()
                .filter_map(|kv| NodeInfo::decode(&kv.key, &kv.value).ok())
                .map(|info| info.node)
                .collect(),
            Err(_) => lock(&self.inner.session)
                .members
                .iter()
                .map(|m| m.node.clone())
                .collect(),
        }
    }

    fn refusal(&self, volume_id: &str, alive: &[String], refusal: Refusal) -> ClusterError {
        let describe = |holders: &[claims::Holder]| {
            holders
                .iter()
                .map(|h| {
                    let suspect = if alive.contains(&h.node) {
                        ""
                    } else {
                        ", SUSPECT: no live lease"
                    };
                    format!("node {} ({}{suspect})", h.node, h.state.as_str())
                })
                .collect::<Vec<_>>()
                .join(", ")
        };
        match refusal {
            Refusal::Held {
                access_mode,
                holders,
            } => {
                let suspects: Vec<&str> = holders
                    .iter()
                    .filter(|h| !alive.contains(&h.node))
                    .map(|h| h.node.as_str())
                    .collect();
                let fence_hint = if suspects.is_empty() {
                    String::new()
                } else {
                    format!(
                        "; {} has no live lease: if it is powered off, an operator may fence it \
                         (`csictl cluster fence {}`, docs/cluster.md)",
                        suspects.join(", "),
                        suspects[0]
                    )
                };
                ClusterError::Held {
                    volume_id: volume_id.to_owned(),
                    access_mode: access_mode_name(access_mode),
                    movers: holders
                        .iter()
                        .map(|h| h.node.clone())
                        .collect::<Vec<_>>()
                        .join(", "),
                    holders: describe(&holders),
                    fence_hint,
                }
            }
            Refusal::OtherCapability { held, holders } => ClusterError::OtherCapability {
                volume_id: volume_id.to_owned(),
                held: format!(
                    "{} {} {}",
                    access_mode_name(held.access_mode),
                    held.access_type,
                    held.fs_type
                )
                .trim_end()
                .to_owned(),
                holders: describe(&holders),
            },
            Refusal::OtherReadonly { held_readonly } => ClusterError::OtherReadonly {
                volume_id: volume_id.to_owned(),
                held_readonly,
            },
            Refusal::Lost { found } => ClusterError::Lost {
                volume_id: volume_id.to_owned(),
                found: match found {
                    None => "no entry of this node".to_owned(),
                    Some((claim, state)) => format!("entry {claim} in state {}", state.as_str()),
                },
            },
            Refusal::TooManyNodes { max } => ClusterError::TooManyNodes {
                volume_id: volume_id.to_owned(),
                max,
            },
        }
    }

    /// This node's entry of claim `claim_id` on a volume, as etcd has it now.
    pub async fn own(
        &self,
        plugin: &PluginKey,
        volume_id: &str,
        claim_id: &str,
    ) -> Result<Own, ClusterError> {
        let (current, _) = self
            .read_volume(plugin, volume_id)
            .await
            .map_err(unavailable)?;
        Ok(own_of(current.as_ref(), &self.inner.options.node, claim_id))
    }

    /// Changes this node's own entry (claim `claim_id`) with `edit`; answers what the entry
    /// was before the change, and the value and revision written (or read). A fenced or
    /// vanished entry is not written. `known`, the node's own last write to the key, saves
    /// the read when nobody changed the key since (a failed compare reads it then). With
    /// writes in `also`, the entry is written even when `edit` changes nothing.
    pub async fn update_own(
        &self,
        plugin: &PluginKey,
        volume_id: &str,
        claim_id: &str,
        known: Option<Known>,
        also: &Also,
        edit: impl Fn(&mut NodeEntry),
    ) -> Result<(Own, Option<Known>), ClusterError> {
        let node = self.inner.options.node.clone();
        self.change_volume(plugin, volume_id, known, also, |current| {
            let own = own_of(current.as_ref(), &node, claim_id);
            let Some(entry) = current
                .as_mut()
                .and_then(|claims| claims::own_entry(claims, &node, claim_id))
            else {
                return Change::Keep(own);
            };
            let before = entry.clone();
            edit(entry);
            if *entry == before && also.ops.is_empty() {
                return Change::Keep(own);
            }
            entry.since = now_unix();
            Change::Write(own)
        })
        .await
    }

    /// Deletes node `node`'s entry of claim `claim_id` (fenced or not); the volume's key goes
    /// with its last entry. Deleting an entry that is gone succeeds.
    pub async fn remove_entry(
        &self,
        plugin: &PluginKey,
        volume_id: &str,
        node: &str,
        claim_id: &str,
        known: Option<Known>,
        also: &Also,
    ) -> Result<(), ClusterError> {
        self.change_volume(plugin, volume_id, known, also, |current| {
            let Some(claims) = current else {
                return Change::Keep(());
            };
            if claims
                .nodes
                .get(node)
                .is_none_or(|e| e.claim_id != claim_id)
            {
                return Change::Keep(());
            }
            claims.nodes.remove(node);
            if claims.nodes.is_empty() {
                *current = None;
            }
            Change::Write(())
        })
        .await
        .map(|_| ())
    }

    /// Marks `node`'s entry on a volume fenced (so that the node, if it returns, never uses
    /// it); answers the entry as it is now, or `None` when it is gone.
    pub async fn mark_fenced(
        &self,
        plugin: &PluginKey,
        volume_id: &str,
        node: &str,
        also: &Also,
    ) -> Result<Option<NodeEntry>, ClusterError> {
        self.change_volume(plugin, volume_id, None, also, |current| {
            let Some(entry) = current.as_mut().and_then(|c| c.nodes.get_mut(node)) else {
                return Change::Keep(None);
            };
            if entry.state == EntryState::Fenced {
                return Change::Keep(Some(entry.clone()));
            }
            entry.state = EntryState::Fenced;
            entry.since = now_unix();
            Change::Write(Some(entry.clone()))
        })
        .await
        .map(|(entry, _)| entry)
    }

    /// Every volume of `plugin` with an entry of `node`: (volume id, entry).
    pub async fn entries_of(
        &self,
        plugin: &PluginKey,
        node: &str,
    ) -> Result<Vec<(String, NodeEntry)>, ClusterError> {
        let read = self
            .inner
            .store
            .list(self.inner.keys.volumes_of(plugin))
            .await?;
        let mut entries = Vec::new();
        for kv in read.kvs {
            match VolumeClaims::decode(&kv.key, &kv.value) {
                Ok(claims) => {
                    if let Some(entry) = claims.nodes.get(node) {
                        entries.push((claims.volume_id.clone(), entry.clone()));
                    }
                }
                Err(err) => {
                    tracing::warn!(key = %key_name(&kv.key), error = %err, "unreadable claims skipped (taken as held)");
                }
            }
        }
        Ok(entries)
    }

    /// Every entry of every cluster volume, with the keys that could not be read.
    pub async fn claims(&self) -> Result<(Vec<ClaimView>, Vec<DamagedKey>), ClusterError> {
        let read = self.inner.store.list(self.inner.keys.all_volumes()).await?;
        let alive = self.alive_nodes().await;
        let mut views = Vec::new();
        let mut damaged = Vec::new();
        for Versioned { key, value, .. } in read.kvs {
            let claims = match VolumeClaims::decode(&key, &value) {
                Ok(claims) => claims,
                Err(err) => {
                    damaged.push(DamagedKey {
                        key: key_name(&key),
                        problem: err.to_string(),
                    });
                    continue;
                }
            };
            let Some(plugin) = plugin_of_key(&self.inner.keys, &key) else {
                continue;
            };
            for (node, entry) in &claims.nodes {
                views.push(ClaimView {
                    plugin_type: plugin.plugin_type.clone(),
                    plugin_name: plugin.plugin_name.clone(),
                    volume_id: claims.volume_id.clone(),
                    access_mode: access_mode_name(claims.capability.access_mode),
                    node: node.clone(),
                    state: entry.state,
                    suspect: !alive.contains(node),
                    readonly: entry.readonly,
                    csi_node_id: entry.csi_node_id.clone(),
                    workloads: entry.workloads.iter().cloned().collect(),
                    since_unix: entry.since,
                });
            }
        }
        Ok((views, damaged))
    }

    /// An operator's fence of `node`: refused while the node's lease is held. Then every
    /// plugin of this daemon detaches the node's volumes and frees them; the other daemons'
    /// sessions do the same for their plugins.
    pub async fn fence(&self, node: &str, reason: &str) -> Result<FenceReport, ClusterError> {
        if node == self.inner.options.node {
            return Err(ClusterError::BadFence {
                node: node.to_owned(),
                why: "it is this node; fence it from another node's csi-agentd".to_owned(),
            });
        }
        crate::volume::validate_id("node", node).map_err(|err| ClusterError::BadFence {
            node: node.to_owned(),
            why: err.to_string(),
        })?;
        let node_key = self.inner.keys.node(node);
        let fence_key = self.inner.keys.fence(node);
        let value = encode(&Fence {
            schema: SCHEMA,
            reason: reason.to_owned(),
            by: self.inner.options.node.clone(),
            at: now_unix(),
        });
        let written = self
            .inner
            .store
            .write(Guarded {
                when: vec![(node_key.clone(), 0), (fence_key.clone(), 0)],
                then: vec![WriteOp::Put {
                    key: fence_key,
                    value,
                    lease: None,
                }],
            })
            .await?;
        if written.is_none() {
            let present = self.inner.store.get(node_key).await?;
            if !present.kvs.is_empty() {
                return Err(ClusterError::Alive {
                    node: node.to_owned(),
                });
            }
            // Fenced already: free what is left.
        }
        tracing::warn!(fenced = %node, by = %self.inner.options.node, %reason, "node fenced by an operator");
        let mut report = FenceReport {
            node: node.to_owned(),
            ..FenceReport::default()
        };
        for plugin in self.plugins() {
            // The fenced node's leader keys went with its lease: this daemon may lead now,
            // and then frees the volumes at once rather than at the leader's next sweep.
            let key = plugin.plugin_key();
            if self.leadership(&key).is_none() {
                let stands = plugin.wants_leadership().await;
                if let Err(err) = self.campaign(&key, stands).await {
                    tracing::debug!(plugin = %key.plugin_type, error = %err, "leader key not read");
                }
            }
            let mut one = plugin.free_fenced(node).await;
            report.freed.append(&mut one.freed);
            report.left.append(&mut one.left);
        }
        Ok(report)
    }
}

/// What a compare-and-swap's `decide` answers.
enum Change<R> {
    /// Nothing to write.
    Keep(R),
    /// Write the value as edited.
    Write(R),
}

/// Why a join did not complete.
enum JoinFailure {
    /// Try again after a while (etcd unreachable, a race).
    Retry(String),
    /// Joining would be unsafe until an operator acts.
    Refused(String),
}

/// etcd not answering, as a publish refusal says it.
fn unavailable(err: ClusterError) -> ClusterError {
    match err {
        ClusterError::Store(store) if store.is_unavailable() => ClusterError::Unavailable {
            reason: store.to_string(),
        },
        other => other,
    }
}

fn own_of(current: Option<&VolumeClaims>, node: &str, claim_id: &str) -> Own {
    match current.and_then(|c| c.nodes.get(node)) {
        Some(entry) if entry.claim_id == claim_id => {
            if entry.state == EntryState::Fenced {
                Own::Fenced(entry.clone())
            } else {
                Own::Held(entry.clone())
            }
        }
        _ => Own::Gone,
    }
}

/// The plugin a volume key belongs to.
fn plugin_of_key(keys: &Keys, key: &[u8]) -> Option<PluginKey> {
    let prefix = keys.all_volumes();
    let rest = std::str::from_utf8(key.get(prefix.len()..)?).ok()?;
    let mut parts = rest.split('/');
    let plugin_type = crate::layout::decode_id(parts.next()?)?;
    let plugin_name = crate::layout::decode_id(parts.next()?)?;
    Some(PluginKey {
        plugin_type,
        plugin_name,
    })
}

/// Fresh random claim and instance ids.
pub fn random_id() -> String {
    format!(
        "{:016x}{:016x}",
        rand::random::<u64>(),
        rand::random::<u64>()
    )
}
