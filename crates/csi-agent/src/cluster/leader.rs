//! One controller per cluster plugin: the election of a leader among the daemons whose
//! plugin has the ControllerPublish step, and the etcd side of the work handed to it
//! (docs/cluster.md, "One controller per plugin").
//!
//! Owns the leader key (`leaders/<plugin>`, put with the leader's lease: it goes when the
//! lease does), the leadership every leader write is conditioned on (the key's revision, so a
//! deposed leader writes nothing), the pending hints (`pending/<plugin>/<volume>`: a volume
//! with an entry waiting for ControllerPublish or ControllerUnpublish), and the leader's
//! writes of a step's result into a node's entry. It must not call CSI: the volume manager
//! sends the RPCs ([`super::ClusterPlugin::serve`]) and reads the results.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex as StdMutex};
use std::time::{Duration, Instant};

use serde::Serialize;

use super::keys::{
    EntryState, HasController, Leader, NodeEntry, Pending, PluginKey, SCHEMA, SharedCapability,
    VolumeClaims, encode, key_name,
};
use super::store::{Guarded, WriteOp};
use super::{Change, Cluster, ClusterError, Known, lock, now_unix};

/// How often the leader looks for pending work while etcd would not watch it for it (and
/// how often the leadership loop runs).
const SERVE_EVERY: Duration = Duration::from_millis(100);
/// How often it looks anyway while its watch wakes it on every new hint: a watch whose stream
/// silently stalled costs this much, never the work.
const WATCHED_SERVE_EVERY: Duration = Duration::from_secs(1);
/// How often a daemon reads (and, when free, takes) a plugin's leader key.
const CAMPAIGN_EVERY: Duration = Duration::from_secs(1);
/// Most unreadable keys remembered as already warned about.
const MAX_WARNED_KEYS: usize = 4096;

/// The leadership loop's per-plugin bookkeeping, under one lock so that a task's "nothing
/// more to serve" and a watcher's "a hint arrived" cannot pass each other.
#[derive(Debug, Default)]
struct Lanes {
    /// A task runs for the plugin (its campaign, its work).
    serving: BTreeSet<PluginKey>,
    /// A hint was written since its last look.
    dirty: BTreeSet<PluginKey>,
    /// Its pending hints are watched (while this node leads it).
    watching: BTreeSet<PluginKey>,
    /// Its last look failed (warned once per run of failures).
    failing: BTreeSet<PluginKey>,
}

/// This node's leadership of one plugin's controller: the leader key and the revision it
/// was created at. A write conditioned on it fails once the key is gone or re-created.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Leadership {
    pub plugin: PluginKey,
    pub key: Vec<u8>,
    pub revision: i64,
}

/// Compares and writes that go into a volume key's compare-and-swap: the leadership a leader
/// write is conditioned on, a pending hint written with a node's request.
#[derive(Clone, Debug, Default)]
pub struct Also {
    pub leadership: Option<Leadership>,
    pub ops: Vec<WriteOp>,
    /// Keys that must be absent (a claim is taken only while no DeleteVolume runs).
    pub absent: Vec<Vec<u8>>,
}

impl Also {
    /// A write conditioned on `leadership`, when there is one.
    pub fn led(leadership: Option<&Leadership>) -> Self {
        Self {
            leadership: leadership.cloned(),
            ..Self::default()
        }
    }
}

/// A plugin's leader as a node last saw it.
#[derive(Clone, Debug)]
pub(super) struct Seen {
    node: String,
    revision: i64,
    mine: bool,
}

impl Seen {
    /// Revision 0 (no key has it) marks a leader key that cannot be trusted: nobody leads.
    fn trusted(&self) -> bool {
        self.revision != 0
    }
}

/// A plugin's controller leader, for `GET /v1/cluster`.
#[derive(Clone, Debug, Serialize)]
pub struct LeaderView {
    pub plugin_type: String,
    pub plugin_name: String,
    pub node: String,
    /// The leader key's revision: a new value means a new term.
    pub revision: i64,
    pub this_node: bool,
}

/// A node's entry waiting for the leader.
#[derive(Clone, Debug)]
pub struct Work {
    pub node: String,
    pub entry: NodeEntry,
    pub capability: SharedCapability,
    /// The volume's key as read for this work: the result's compare-and-swap starts from it
    /// instead of reading it again.
    read: Known,
}

/// A step's result, as the leader writes it into the entry.
#[derive(Clone, Debug)]
pub enum Settle {
    /// ControllerPublish succeeded: `ATTACHED`, with the publish context.
    Attached(BTreeMap<String, String>),
    /// ControllerUnpublish succeeded: the entry goes.
    Detached,
    /// The plugin refused the step: the node reports it and asks again with a new request.
    Refused(String),
}

impl Cluster {
    /// This node's leadership of `plugin`, while its session is healthy.
    pub fn leadership(&self, plugin: &PluginKey) -> Option<Leadership> {
        if self.require_healthy().is_err() {
            return None;
        }
        let leaders = lock(&self.inner.leaders);
        let seen = leaders.get(plugin).filter(|seen| seen.mine)?;
        Some(Leadership {
            plugin: plugin.clone(),
            key: self.inner.keys.leader(plugin),
            revision: seen.revision,
        })
    }

    /// The node leading `plugin`'s controller, as last seen.
    pub fn leader_node(&self, plugin: &PluginKey) -> Option<String> {
        lock(&self.inner.leaders)
            .get(plugin)
            .filter(|seen| seen.trusted())
            .map(|seen| seen.node.clone())
    }

    pub(super) fn leader_views(&self) -> Vec<LeaderView> {
        lock(&self.inner.leaders)
            .iter()
            .filter(|(_, seen)| seen.trusted())
            .map(|(plugin, seen)| LeaderView {
                plugin_type: plugin.plugin_type.clone(),
                plugin_name: plugin.plugin_name.clone(),
                node: seen.node.clone(),
                revision: seen.revision,
                this_node: seen.mine,
            })
            .collect()
    }

    /// Forgets this node's leadership of `plugin` (of every plugin when `None`).
    pub(super) fn forget_leadership(&self, plugin: Option<&PluginKey>) {
        let mut leaders = lock(&self.inner.leaders);
        for (key, seen) in leaders.iter_mut() {
            if plugin.is_none_or(|p| p == key) {
                seen.mine = false;
            }
        }
    }

    /// After a leader write's compare failed: was it the leadership? Then this node is
    /// deposed (and forgets it); otherwise the volume's key changed and the caller reads again.
    pub(super) async fn check_leadership(
        &self,
        plugin: &PluginKey,
        leadership: &Leadership,
    ) -> Result<(), ClusterError> {
        let read = self
            .patiently(|| self.inner.background_store.get(leadership.key.clone()))
            .await?;
        let holds = read
            .kvs
            .first()
            .is_some_and(|kv| kv.mod_revision == leadership.revision);
        if holds {
            return Ok(());
        }
        self.forget_leadership(Some(plugin));
        Err(ClusterError::Deposed {
            plugin: plugin.plugin_type.clone(),
        })
    }

    /// Reads `plugin`'s leader key and, when it is free and this daemon `stands`, takes it
    /// with this node's lease (one create-only transaction: two daemons cannot both win).
    pub(super) async fn campaign(
        &self,
        plugin: &PluginKey,
        stands: bool,
    ) -> Result<(), ClusterError> {
        let Some(lease) = lock(&self.inner.session).lease else {
            self.forget_leadership(Some(plugin));
            return Ok(());
        };
        if stands {
            self.record_controller(plugin).await?;
        }
        let key = self.inner.keys.leader(plugin);
        let read = self.inner.background_store.get(key.clone()).await?;
        let seen = match read.kvs.first() {
            // A leader's key goes with its lease: one without a lease (put by hand, or a
            // forgery) would never go, and one naming this node counts only on this node's
            // lease, whatever its value says.
            Some(kv) => match Leader::decode(&kv.key, &kv.value) {
                Ok(leader) if kv.lease != 0 && kv.lease == leader.lease => Seen {
                    mine: leader.instance_id == self.inner.instance_id && kv.lease == lease,
                    node: leader.node,
                    revision: kv.mod_revision,
                },
                unreadable => {
                    // Nobody leads until an operator deletes it; it never reads as free.
                    let error = match unreadable {
                        Err(err) => err.to_string(),
                        Ok(_) => "its value names a lease the key is not attached to".to_owned(),
                    };
                    if self.unreadable_leader_key(plugin) {
                        tracing::warn!(key = %key_name(&key), error = %error, "unreadable leader key: delete it with etcdctl so that a leader can be elected");
                    }
                    return Ok(());
                }
            },
            None if stands => {
                let value = encode(&Leader {
                    schema: SCHEMA,
                    node: self.inner.options.node.clone(),
                    instance_id: self.inner.instance_id.clone(),
                    lease,
                    since: now_unix(),
                });
                let written = self
                    .inner
                    .background_store
                    .write(Guarded {
                        when: vec![(key.clone(), 0)],
                        then: vec![WriteOp::Put {
                            key,
                            value,
                            lease: Some(lease),
                        }],
                    })
                    .await?;
                match written {
                    Some(revision) => Seen {
                        node: self.inner.options.node.clone(),
                        revision,
                        mine: true,
                    },
                    // Another daemon won: read it at the next look.
                    None => return Ok(()),
                }
            }
            None => {
                lock(&self.inner.leaders).remove(plugin);
                return Ok(());
            }
        };
        self.observe(plugin, seen);
        Ok(())
    }

    /// Records, once, that `plugin` has the ControllerPublish step (this node's instance has
    /// it): a create-only write of the `controllers/` key.
    async fn record_controller(&self, plugin: &PluginKey) -> Result<(), ClusterError> {
        if lock(&self.inner.with_controller).contains(plugin) {
            return Ok(());
        }
        let key = self.inner.keys.controller(plugin);
        let value = encode(&HasController {
            schema: SCHEMA,
            node: self.inner.options.node.clone(),
            since: now_unix(),
        });
        // Written or already there: either way the cluster knows.
        self.inner
            .background_store
            .write(Guarded {
                when: vec![(key.clone(), 0)],
                then: vec![WriteOp::Put {
                    key,
                    value,
                    lease: None,
                }],
            })
            .await?;
        lock(&self.inner.with_controller).insert(plugin.clone());
        Ok(())
    }

    /// Whether `plugin` has the ControllerPublish step somewhere in the cluster, for a node
    /// whose own instance has no controller: then its steps are asked of the leader. Read
    /// until it is found (then remembered); a key present but unreadable counts as found (a
    /// step asked for nothing is refused by the leader's plugin, a step skipped attaches
    /// nothing).
    pub async fn has_controller(&self, plugin: &PluginKey) -> Result<bool, ClusterError> {
        if lock(&self.inner.with_controller).contains(plugin) {
            return Ok(true);
        }
        let key = self.inner.keys.controller(plugin);
        let read = self.patiently(|| self.inner.store.get(key.clone())).await?;
        let found = !read.kvs.is_empty();
        if found {
            lock(&self.inner.with_controller).insert(plugin.clone());
        }
        Ok(found)
    }

    /// Nobody leads `plugin` while its leader key cannot be trusted (not this node either).
    /// True the first time (warn once, not every second).
    fn unreadable_leader_key(&self, plugin: &PluginKey) -> bool {
        let mut leaders = lock(&self.inner.leaders);
        let was_unreadable = leaders.get(plugin).is_some_and(|seen| seen.revision == 0);
        leaders.insert(
            plugin.clone(),
            Seen {
                node: String::new(),
                revision: 0,
                mine: false,
            },
        );
        !was_unreadable
    }

    fn observe(&self, plugin: &PluginKey, seen: Seen) {
        let mut leaders = lock(&self.inner.leaders);
        let changed = leaders
            .get(plugin)
            .is_none_or(|before| before.revision != seen.revision);
        if changed {
            tracing::info!(plugin = %plugin.plugin_type, leader = %seen.node, this_node = seen.mine, "controller leader of a cluster plugin");
            if let (Some(metrics), Some(_)) = (&self.inner.metrics, leaders.get(plugin)) {
                metrics
                    .cluster_leader_changes
                    .get_or_create(&crate::metrics::PluginLabels {
                        plugin: plugin.plugin_type.clone(),
                    })
                    .inc();
            }
        }
        leaders.insert(plugin.clone(), seen);
    }

    /// The session's second task: every daemon reads each cluster plugin's leader key, a
    /// daemon whose plugin has the controller step stands for it, and a leader serves its
    /// plugin's pending work (one task per plugin at a time: one plugin never waits on
    /// another's RPCs). A leader watches its plugin's pending hints and serves as soon as one
    /// is written; it also looks every SERVE_EVERY while it has no watch, and every
    /// WATCHED_SERVE_EVERY while it has one.
    pub(super) async fn run_leadership(self) {
        let lanes: Arc<StdMutex<Lanes>> = Arc::default();
        let wake = Arc::new(tokio::sync::Notify::new());
        let mut campaigned: BTreeMap<PluginKey, Instant> = BTreeMap::new();
        let mut served: BTreeMap<PluginKey, Instant> = BTreeMap::new();
        loop {
            tokio::select! {
                () = tokio::time::sleep(SERVE_EVERY) => {}
                () = wake.notified() => {}
            }
            if lock(&self.inner.session).lease.is_none() {
                continue;
            }
            let now = Instant::now();
            for plugin in self.plugins() {
                let key = plugin.plugin_key();
                // The leader key is read at the first look and then every CAMPAIGN_EVERY (a
                // plugin nobody stands for, one without a controller step, would otherwise be
                // read every SERVE_EVERY).
                let campaign = campaigned
                    .get(&key)
                    .is_none_or(|at| now.duration_since(*at) >= CAMPAIGN_EVERY);
                {
                    let mut lanes = lock(&lanes);
                    // One task per plugin at a time, so that a plugin slow to start or to
                    // answer delays only its own election and work. A hint written meanwhile
                    // stays marked for that task to serve.
                    if lanes.serving.contains(&key) {
                        continue;
                    }
                    let poll_every = if lanes.watching.contains(&key) {
                        WATCHED_SERVE_EVERY
                    } else {
                        SERVE_EVERY
                    };
                    let poll = served
                        .get(&key)
                        .is_none_or(|at| now.duration_since(*at) >= poll_every);
                    let woken = lanes.dirty.remove(&key);
                    if !(campaign || woken || poll) {
                        continue;
                    }
                    if woken || poll {
                        served.insert(key.clone(), now);
                    }
                    lanes.serving.insert(key.clone());
                }
                if campaign {
                    campaigned.insert(key.clone(), now);
                }
                let cluster = self.clone();
                let lanes = lanes.clone();
                let wake = wake.clone();
                tokio::spawn(async move {
                    if campaign {
                        let stands = plugin.wants_leadership().await;
                        if let Err(err) = cluster.campaign(&key, stands).await {
                            tracing::debug!(plugin = %key.plugin_type, error = %err, "leader key not read");
                        }
                    }
                    loop {
                        let Some(leadership) = cluster.leadership(&key) else {
                            lock(&lanes).serving.remove(&key);
                            return;
                        };
                        if lock(&lanes).watching.insert(key.clone()) {
                            tokio::spawn(cluster.clone().watch_pending(
                                key.clone(),
                                lanes.clone(),
                                wake.clone(),
                            ));
                        }
                        match plugin.serve(leadership).await {
                            Ok(()) => {
                                lock(&lanes).failing.remove(&key);
                            }
                            // Warned once per run of failures: it is tried again soon.
                            Err(err) if lock(&lanes).failing.insert(key.clone()) => {
                                tracing::warn!(plugin = %key.plugin_type, error = %err, "controller leader: pending work not done; trying again");
                            }
                            Err(err) => {
                                tracing::debug!(plugin = %key.plugin_type, error = %err, "controller leader: pending work not done; trying again");
                            }
                        }
                        // A hint written while it served: serve again at once (checked and
                        // released under one lock, so a hint is never left unserved).
                        let mut lanes = lock(&lanes);
                        if !lanes.dirty.remove(&key) {
                            lanes.serving.remove(&key);
                            return;
                        }
                    }
                });
            }
        }
    }

    /// While this node leads `plugin`: a watch of its pending hints, marking the plugin dirty
    /// and waking the leadership loop on every change. A watch that ends is opened again
    /// after a pause; without one, the loop polls.
    async fn watch_pending(
        self,
        plugin: PluginKey,
        lanes: Arc<StdMutex<Lanes>>,
        wake: Arc<tokio::sync::Notify>,
    ) {
        let prefix = self.inner.keys.pending_of(&plugin);
        let mark = || {
            lock(&lanes).dirty.insert(plugin.clone());
            wake.notify_one();
        };
        while self.leadership(&plugin).is_some() {
            let mut changes = match self
                .inner
                .background_store
                .watch(prefix.clone(), true, 0)
                .await
            {
                Ok(changes) => changes,
                Err(err) => {
                    tracing::debug!(plugin = %plugin.plugin_type, error = %err, "pending hints not watched; polling");
                    tokio::time::sleep(WATCHED_SERVE_EVERY).await;
                    continue;
                }
            };
            // Hints written before the watch was in place: one look now.
            mark();
            loop {
                tokio::select! {
                    changed = changes.changed() => match changed {
                        Ok(()) => mark(),
                        Err(err) => {
                            tracing::debug!(plugin = %plugin.plugin_type, error = %err, "watch of pending hints ended");
                            break;
                        }
                    },
                    () = tokio::time::sleep(WATCHED_SERVE_EVERY) => {
                        if self.leadership(&plugin).is_none() {
                            break;
                        }
                    }
                }
            }
        }
        lock(&lanes).watching.remove(&plugin);
    }

    /// True the first time `key` is reported unreadable (see `Inner::warned`).
    pub fn first_warning(&self, key: &[u8]) -> bool {
        let mut warned = lock(&self.inner.warned);
        if warned.len() >= MAX_WARNED_KEYS {
            warned.clear();
        }
        warned.insert(key.to_vec())
    }

    /// The pending hint a node's request writes with its entry.
    pub fn pending_put(&self, plugin: &PluginKey, volume_id: &str) -> WriteOp {
        WriteOp::Put {
            key: self.inner.keys.pending(plugin, volume_id),
            value: encode(&Pending {
                schema: SCHEMA,
                volume_id: volume_id.to_owned(),
            }),
            lease: None,
        }
    }

    /// The volumes of `plugin` with pending work: (volume id, the hint's revision).
    pub async fn pending_volumes(
        &self,
        plugin: &PluginKey,
    ) -> Result<Vec<(String, i64)>, ClusterError> {
        let read = self
            .inner
            .background_store
            .list(self.inner.keys.pending_of(plugin))
            .await?;
        let mut volumes = Vec::new();
        for kv in read.kvs {
            match Pending::decode(&kv.key, &kv.value) {
                // The hint must name the volume its key does: a forged hint is not work.
                Ok(p) if kv.key == self.inner.keys.pending(plugin, &p.volume_id) => {
                    volumes.push((p.volume_id, kv.mod_revision));
                }
                _ if self.first_warning(&kv.key) => {
                    tracing::warn!(key = %key_name(&kv.key), "unreadable pending hint skipped; delete it with etcdctl");
                }
                _ => {}
            }
        }
        Ok(volumes)
    }

    /// Deletes a volume's pending hint if nobody asked again since it was read, under the
    /// leadership.
    pub async fn clear_pending(
        &self,
        plugin: &PluginKey,
        volume_id: &str,
        revision: i64,
        leadership: &Leadership,
    ) -> Result<(), ClusterError> {
        let key = self.inner.keys.pending(plugin, volume_id);
        let guarded = Guarded {
            when: vec![
                (key.clone(), revision),
                (leadership.key.clone(), leadership.revision),
            ],
            then: vec![WriteOp::Delete { key }],
        };
        let written = self
            .patiently(|| self.inner.background_store.write(guarded.clone()))
            .await?;
        if written.is_none() {
            self.check_leadership(plugin, leadership).await?;
        }
        Ok(())
    }

    /// The first entry of a volume that waits for the leader: `PUBLISHING` (ControllerPublish)
    /// or `NODE_DETACHED` (ControllerUnpublish), without a refusal recorded.
    pub async fn next_work(
        &self,
        plugin: &PluginKey,
        volume_id: &str,
    ) -> Result<Option<Work>, ClusterError> {
        let (current, revision) = self.read_volume(plugin, volume_id).await?;
        Ok(current.and_then(|claims: VolumeClaims| {
            let (node, entry) = claims.nodes.iter().find(|(_, entry)| {
                entry.error.is_none()
                    && matches!(
                        entry.state,
                        EntryState::Publishing | EntryState::NodeDetached
                    )
            })?;
            Some(Work {
                node: node.clone(),
                entry: entry.clone(),
                capability: claims.capability.clone(),
                read: Known {
                    claims: claims.clone(),
                    revision,
                },
            })
        }))
    }

    /// Writes a step's result into `work`'s entry, under the leadership; an entry that moved
    /// on meanwhile (another claim, another state) is left as it is.
    pub async fn settle(
        &self,
        plugin: &PluginKey,
        volume_id: &str,
        work: &Work,
        leadership: &Leadership,
        result: Settle,
    ) -> Result<(), ClusterError> {
        let also = Also::led(Some(leadership));
        let known = Some(work.read.clone());
        self.change_volume(plugin, volume_id, known, &also, |current| {
            let Some(claims) = current.as_mut() else {
                return Change::Keep(());
            };
            let Some(entry) = claims.nodes.get_mut(&work.node) else {
                return Change::Keep(());
            };
            if entry.claim_id != work.entry.claim_id
                || entry.state != work.entry.state
                || entry.error.is_some()
            {
                return Change::Keep(());
            }
            match &result {
                Settle::Attached(context) => {
                    entry.state = EntryState::Attached;
                    entry.publish_context = context.clone();
                    entry.since = now_unix();
                }
                Settle::Refused(message) => entry.error = Some(message.clone()),
                Settle::Detached => {
                    claims.nodes.remove(&work.node);
                    if claims.nodes.is_empty() {
                        *current = None;
                    }
                }
            }
            Change::Write(())
        })
        .await
        .map(|_| ())
    }
}
