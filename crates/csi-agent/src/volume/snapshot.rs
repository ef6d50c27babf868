//! Snapshots (CreateSnapshot, DeleteSnapshot, ListSnapshots) and the records that make them
//! durable.
//!
//! Owns: the snapshot record kind of the store — one row per `(plugin, snapshot name)` in the
//! namespace `<plugin name>/snapshots` (a plugin name never holds `/`, so it cannot meet a
//! plugin's volume rows) — and the steps of a create and a delete:
//! - create: the intent (name, source, parameters) is durable before CreateSnapshot, so that a
//!   crash anywhere leaves a record that recovery re-issues with the same name (CSI makes it
//!   idempotent: one snapshot in the plugin, never two); the answer is a progress note after
//!   it (lost in a crash, the intent stays and the re-issue gets the answer again); a
//!   snapshot not yet `ready_to_use` is re-issued with backoff until it is, or until the
//!   operation timeout (then the record stays and recovery or the next request goes on);
//! - delete: `deleting` is durable before DeleteSnapshot, the record is forgotten after.
//!
//! Must not: hold a volume's lock (a snapshot is a controller operation on the source, which
//! may be published and in use meanwhile), copy or read data (the plugin does), or ask the
//! plugin's capabilities its own way (`require_controller_cap`).

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex as StdMutex, OnceLock};
use std::time::{Duration, Instant};

use csi_proto::v1;
use serde::{Deserialize, Serialize};

use super::refusal::{Conflict, ProtocolViolation};
use super::{Admission, VolumeError, VolumeManager, check_id, to_hash_map, validate_id};
use crate::backoff::Backoff;
use crate::failpoint;
use crate::store::Record;
use crate::sys::blocking;
use v1::controller_service_capability::rpc::Type as ControllerCap;

/// Intent written, CreateSnapshot not sent.
pub const FP_CREATE_AFTER_INTENT: &str = "snapshot.create.after_intent";
/// CreateSnapshot answered, its answer not written.
pub const FP_CREATE_AFTER_RPC: &str = "snapshot.create.after_rpc";
/// `deleting` written, DeleteSnapshot not sent.
pub const FP_DELETE_AFTER_INTENT: &str = "snapshot.delete.after_intent";
/// DeleteSnapshot answered, the record not forgotten.
pub const FP_DELETE_AFTER_RPC: &str = "snapshot.delete.after_rpc";

/// The longest wait between two CreateSnapshot re-issues of a snapshot not yet ready.
const MAX_READY_BACKOFF: Duration = Duration::from_secs(10);

/// One snapshot made through csi-agent, keyed by its name.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SnapshotRecord {
    pub name: String,
    pub source_volume_id: String,
    #[serde(default)]
    pub parameters: BTreeMap<String, String>,
    /// Empty until CreateSnapshot answered.
    #[serde(default)]
    pub snapshot_id: String,
    #[serde(default)]
    pub size_bytes: i64,
    /// Unix seconds and nanoseconds of the plugin's `creation_time`.
    #[serde(default)]
    pub creation_time: Option<(i64, i32)>,
    #[serde(default)]
    pub ready_to_use: bool,
    /// A delete is in progress: recovery finishes it.
    #[serde(default)]
    pub deleting: bool,
}

impl Record for SnapshotRecord {
    const SCHEMA_VERSION: u32 = 1;
}

/// One page of the plugin's snapshots.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SnapshotPage {
    pub snapshots: Vec<SnapshotRecord>,
    pub next_token: String,
}

/// A record's key in [`lock_written`]'s map: the database, the plugin's type and name, the snapshot name.
type WrittenKey = (std::path::PathBuf, String, String, String);

/// Every snapshot record this process wrote, as written: a note is answered before it is
/// committed, so reads of a record this process wrote come from here, never from a database
/// that may not hold the note yet. Bounded by the snapshots that exist (a forgotten record
/// leaves). Process-wide: an engine restarted inside one process (no test does that for
/// snapshots) would read its predecessor's writes, which the database also holds.
fn lock_written() -> std::sync::MutexGuard<'static, HashMap<WrittenKey, SnapshotRecord>> {
    static WRITTEN: OnceLock<StdMutex<HashMap<WrittenKey, SnapshotRecord>>> = OnceLock::new();
    WRITTEN
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|p| p.into_inner())
}

/// The store namespace of a plugin's snapshot records.
fn namespace(plugin_name: &str) -> String {
    format!("{plugin_name}/snapshots")
}

/// One lock per snapshot name of a plugin: two requests for one name never interleave (the
/// second sees the first's record). Entries go when their last user does.
type NameLocks = StdMutex<HashMap<(String, String), Arc<tokio::sync::Mutex<()>>>>;

fn name_lock(plugin: &str, name: &str) -> Arc<tokio::sync::Mutex<()>> {
    static LOCKS: OnceLock<NameLocks> = OnceLock::new();
    let locks = LOCKS.get_or_init(Default::default);
    let mut map = locks.lock().unwrap_or_else(|p| p.into_inner());
    map.retain(|_, lock| Arc::strong_count(lock) > 1);
    map.entry((plugin.to_owned(), name.to_owned()))
        .or_default()
        .clone()
}

/// The record of a plugin's answer, checked: a snapshot, with an id csi-agent can keep, of
/// the volume asked for.
fn from_answer(
    rpc: &'static str,
    asked_source: Option<&str>,
    snapshot: Option<v1::Snapshot>,
) -> Result<SnapshotRecord, ProtocolViolation> {
    let s = snapshot.ok_or(ProtocolViolation::NoSnapshot { rpc })?;
    check_id("snapshot_id", &s.snapshot_id)
        .map_err(|source| ProtocolViolation::BadSnapshotId { rpc, source })?;
    if let Some(asked) = asked_source
        && s.source_volume_id != asked
    {
        return Err(ProtocolViolation::SnapshotOfOtherVolume {
            asked: asked.to_owned(),
            got: s.source_volume_id,
        });
    }
    Ok(SnapshotRecord {
        name: String::new(),
        source_volume_id: s.source_volume_id,
        parameters: BTreeMap::new(),
        snapshot_id: s.snapshot_id,
        size_bytes: s.size_bytes,
        creation_time: s.creation_time.map(|t| (t.seconds, t.nanos)),
        ready_to_use: s.ready_to_use,
        deleting: false,
    })
}

impl VolumeManager {
    /// The key of this plugin's record `name` in [`lock_written`]'s map.
    fn written_key(&self, name: &str) -> WrittenKey {
        let c = &self.inner.config;
        (
            self.inner.store.db_path().to_path_buf(),
            c.plugin_type.clone(),
            c.plugin_name.clone(),
            name.to_owned(),
        )
    }

    /// Writes the record durably (an intent: returns once it is on disk).
    async fn save_snapshot(&self, record: &SnapshotRecord) -> Result<(), VolumeError> {
        let c = &self.inner.config;
        self.inner
            .store
            .save_volume(
                &c.plugin_type,
                &namespace(&c.plugin_name),
                &record.name,
                record,
            )
            .await?;
        lock_written().insert(self.written_key(&record.name), record.clone());
        Ok(())
    }

    /// Writes the record as a progress note (an answer of the plugin): committed with a later
    /// batch. Lost in a crash, the intent before it stays, and recovery re-issues the
    /// CreateSnapshot by name, which CSI makes idempotent (docs/recovery.md).
    fn note_snapshot(&self, record: &SnapshotRecord) -> Result<(), VolumeError> {
        let c = &self.inner.config;
        self.inner.store.note_volume(
            &c.plugin_type,
            &namespace(&c.plugin_name),
            &record.name,
            record,
        )?;
        lock_written().insert(self.written_key(&record.name), record.clone());
        Ok(())
    }

    /// Forgets the record durably.
    async fn forget_snapshot(&self, name: &str) -> Result<(), VolumeError> {
        let c = &self.inner.config;
        self.inner
            .store
            .delete_volume(&c.plugin_type, &namespace(&c.plugin_name), name)
            .await?;
        lock_written().remove(&self.written_key(name));
        Ok(())
    }

    /// The record as last written: from this process's writes (notes may not be committed
    /// yet), else from the database.
    async fn load_snapshot(&self, name: &str) -> Result<Option<SnapshotRecord>, VolumeError> {
        if let Some(record) = lock_written().get(&self.written_key(name)) {
            return Ok(Some(record.clone()));
        }
        let store = self.inner.store.clone();
        let c = self.inner.config.clone();
        let name = name.to_owned();
        blocking("load snapshot record", move || {
            store.load_volume(&c.plugin_type, &namespace(&c.plugin_name), &name)
        })
        .map_err(VolumeError::StoreRead)
    }

    /// Every snapshot record of this plugin (unreadable rows are quarantined by the store
    /// and logged here).
    pub async fn snapshot_records(&self) -> Result<Vec<SnapshotRecord>, VolumeError> {
        let store = self.inner.store.clone();
        let c = self.inner.config.clone();
        let loaded = blocking("load snapshot records", move || {
            store.load_all::<SnapshotRecord>(&c.plugin_type, &namespace(&c.plugin_name))
        })
        .map_err(VolumeError::StoreRead)?;
        for problem in &loaded.problems {
            tracing::error!(plugin = %self.inner.config.plugin_type, %problem, "snapshot record unreadable");
        }
        let mut records: BTreeMap<String, SnapshotRecord> = loaded
            .records
            .into_iter()
            .map(|l| {
                let record = SnapshotRecord {
                    name: l.volume_id.clone(),
                    ..l.record
                };
                (l.volume_id, record)
            })
            .collect();
        let written = lock_written();
        for name in records.keys().cloned().collect::<Vec<_>>() {
            if let Some(newer) = written.get(&self.written_key(&name)) {
                records.insert(name, newer.clone());
            }
        }
        // Written by this process and not yet committed (a note in the queue).
        let c = &self.inner.config;
        let db = self.inner.store.db_path();
        for ((path, plugin_type, plugin_name, name), record) in written.iter() {
            if path == db && *plugin_type == c.plugin_type && *plugin_name == c.plugin_name {
                records
                    .entry(name.clone())
                    .or_insert_with(|| record.clone());
            }
        }
        Ok(records.into_values().collect())
    }

    /// CreateSnapshot of `source_volume_id`, idempotent by `name`: the intent is durable
    /// before the first RPC, and the snapshot is re-issued until `ready_to_use` or the
    /// operation timeout. Answers the record as last written.
    pub async fn create_snapshot(
        &self,
        name: &str,
        source_volume_id: &str,
        parameters: BTreeMap<String, String>,
    ) -> Result<SnapshotRecord, VolumeError> {
        validate_id("name", name)?;
        validate_id("source_volume_id", source_volume_id)?;
        self.require_controller_cap(ControllerCap::CreateDeleteSnapshot, "snapshots")
            .await?;
        let _ticket = self.enter(source_volume_id, "snapshot", Admission::Request)?;
        let lock = name_lock(&self.inner.config.plugin_type, name);
        let _held = lock.lock().await;
        let record = match self.load_snapshot(name).await? {
            Some(r) if r.source_volume_id != source_volume_id || r.parameters != parameters => {
                return Err(Conflict::SnapshotNameTaken {
                    name: name.to_owned(),
                    source_volume_id: r.source_volume_id,
                    parameters: r.parameters,
                }
                .into());
            }
            Some(r) if r.deleting => {
                return Err(Conflict::SnapshotBeingDeleted {
                    name: name.to_owned(),
                }
                .into());
            }
            Some(r) if r.ready_to_use => return Ok(r),
            Some(r) => r,
            None => {
                let intent = SnapshotRecord {
                    name: name.to_owned(),
                    source_volume_id: source_volume_id.to_owned(),
                    parameters,
                    snapshot_id: String::new(),
                    size_bytes: 0,
                    creation_time: None,
                    ready_to_use: false,
                    deleting: false,
                };
                self.save_snapshot(&intent).await?;
                intent
            }
        };
        failpoint::hit(FP_CREATE_AFTER_INTENT)?;
        let never_answered = record.snapshot_id.is_empty();
        let snapshot_name = record.name.clone();
        match self.issue_until_ready(record).await {
            // Refused for good before the plugin ever named a snapshot: none exists under this
            // name, so the intent goes (no orphan record a hostile name could leave behind).
            Err(VolumeError::Plugin(rpc)) if never_answered && !rpc.is_transient() => {
                self.forget_snapshot(&snapshot_name).await?;
                Err(VolumeError::Plugin(rpc))
            }
            other => other,
        }
    }

    /// Re-issues CreateSnapshot (same name: idempotent) until the plugin says
    /// `ready_to_use`, with backoff, until the operation timeout.
    async fn issue_until_ready(
        &self,
        mut record: SnapshotRecord,
    ) -> Result<SnapshotRecord, VolumeError> {
        let deadline = Instant::now() + self.inner.config.operation_timeout;
        let mut backoff = Backoff::new(crate::backoff::RetryPolicy {
            max: self.inner.config.retry.max.min(MAX_READY_BACKOFF),
            ..self.inner.config.retry
        });
        let request = v1::CreateSnapshotRequest {
            source_volume_id: record.source_volume_id.clone(),
            name: record.name.clone(),
            parameters: to_hash_map(&record.parameters),
            ..Default::default()
        };
        loop {
            let response = self
                .controller_rpc(&[], request.clone(), |client, request| async move {
                    client.create_snapshot(request).await
                })
                .await?;
            failpoint::hit(FP_CREATE_AFTER_RPC)?;
            let answer = from_answer(
                "CreateSnapshot",
                Some(&record.source_volume_id),
                response.snapshot,
            )?;
            let changed = answer.snapshot_id != record.snapshot_id
                || answer.ready_to_use != record.ready_to_use
                || answer.size_bytes != record.size_bytes
                || answer.creation_time != record.creation_time;
            record = SnapshotRecord {
                name: record.name,
                parameters: record.parameters,
                ..answer
            };
            if changed {
                self.note_snapshot(&record)?;
            }
            if record.ready_to_use {
                return Ok(record);
            }
            let delay = backoff.next_delay();
            if Instant::now() + delay > deadline {
                tracing::warn!(plugin = %self.inner.config.plugin_type, snapshot = %record.name, "snapshot not ready to use within the operation timeout; recovery or the next request re-issues it");
                return Ok(record);
            }
            tokio::time::sleep(delay).await;
        }
    }

    /// DeleteSnapshot. A snapshot csi-agent recorded is marked `deleting` durably first; one
    /// it does not know (made elsewhere) is deleted all the same.
    pub async fn delete_snapshot(&self, snapshot_id: &str) -> Result<(), VolumeError> {
        validate_id("snapshot_id", snapshot_id)?;
        self.require_controller_cap(ControllerCap::CreateDeleteSnapshot, "snapshot deletion")
            .await?;
        let _ticket = self.enter(snapshot_id, "snapshot delete", Admission::Request)?;
        let known = self
            .snapshot_records()
            .await?
            .into_iter()
            .find(|r| r.snapshot_id == snapshot_id);
        let lock = known
            .as_ref()
            .map(|r| name_lock(&self.inner.config.plugin_type, &r.name));
        let _held = match &lock {
            Some(lock) => Some(lock.lock().await),
            None => None,
        };
        if let Some(record) = &known
            && !record.deleting
        {
            let marked = SnapshotRecord {
                deleting: true,
                ..record.clone()
            };
            self.save_snapshot(&marked).await?;
        }
        failpoint::hit(FP_DELETE_AFTER_INTENT)?;
        self.finish_delete(snapshot_id, known.map(|r| r.name)).await
    }

    async fn finish_delete(
        &self,
        snapshot_id: &str,
        name: Option<String>,
    ) -> Result<(), VolumeError> {
        let request = v1::DeleteSnapshotRequest {
            snapshot_id: snapshot_id.to_owned(),
            ..Default::default()
        };
        self.controller_rpc(&[], request, |client, request| async move {
            client.delete_snapshot(request).await
        })
        .await?;
        failpoint::hit(FP_DELETE_AFTER_RPC)?;
        if let Some(name) = name {
            self.forget_snapshot(&name).await?;
        }
        Ok(())
    }

    /// ListSnapshots, one page, optionally of one source volume or one snapshot id. Entries
    /// are checked and deduplicated: a plugin that lists one snapshot twice is no reason to
    /// show it twice (MESOS-9956).
    pub async fn list_snapshots(
        &self,
        max_entries: i32,
        starting_token: &str,
        source_volume_id: &str,
        snapshot_id: &str,
    ) -> Result<SnapshotPage, VolumeError> {
        if max_entries < 0 {
            return Err(super::refusal::InvalidRequest::NegativeMaxEntries(max_entries).into());
        }
        self.require_controller_cap(ControllerCap::ListSnapshots, "snapshot listing")
            .await?;
        let request = v1::ListSnapshotsRequest {
            max_entries,
            starting_token: starting_token.to_owned(),
            source_volume_id: source_volume_id.to_owned(),
            snapshot_id: snapshot_id.to_owned(),
            ..Default::default()
        };
        let response = self
            .controller_rpc(&[], request, |client, request| async move {
                client.list_snapshots(request).await
            })
            .await?;
        let mut seen = std::collections::HashSet::new();
        let mut snapshots = Vec::new();
        for entry in response.entries {
            let record = from_answer("ListSnapshots", None, entry.snapshot)?;
            if seen.insert(record.snapshot_id.clone()) {
                snapshots.push(record);
            }
        }
        Ok(SnapshotPage {
            snapshots,
            next_token: response.next_token,
        })
    }

    /// At start: finishes the deletes and the creates a crash interrupted, in the background
    /// (recovery never waits for a plugin). Returns how many it took up.
    pub(super) async fn recover_snapshots(&self) -> usize {
        let records = match self.snapshot_records().await {
            Ok(records) => records,
            Err(err) => {
                tracing::error!(plugin = %self.inner.config.plugin_type, error = %err, "snapshot records unreadable");
                return 0;
            }
        };
        let pending: Vec<SnapshotRecord> = records
            .into_iter()
            .filter(|r| r.deleting || !r.ready_to_use)
            .collect();
        let count = pending.len();
        for record in pending {
            let manager = self.clone();
            tokio::spawn(async move { manager.resume_snapshot(record).await });
        }
        count
    }

    /// Drives one interrupted snapshot operation to its end, retrying until the plugin
    /// answers (a missing plugin is transient; the record is never forgotten for it).
    async fn resume_snapshot(&self, record: SnapshotRecord) {
        let plugin = self.inner.config.plugin_type.clone();
        let mut backoff = Backoff::new(self.inner.config.retry);
        loop {
            let lock = name_lock(&plugin, &record.name);
            let held = lock.lock().await;
            // A request may have finished it meanwhile.
            let current = match self.load_snapshot(&record.name).await {
                Ok(Some(current)) => current,
                Ok(None) => return,
                Err(err) => {
                    tracing::error!(%plugin, snapshot = %record.name, error = %err, "snapshot record unreadable");
                    return;
                }
            };
            let result = if current.deleting {
                if current.snapshot_id.is_empty() {
                    // Never created: nothing to delete in the plugin.
                    self.forget_snapshot(&current.name).await
                } else {
                    let (id, name) = (current.snapshot_id.clone(), current.name.clone());
                    self.finish_delete(&id, Some(name)).await
                }
            } else if current.ready_to_use {
                return;
            } else {
                self.issue_until_ready(current).await.map(|_| ())
            };
            drop(held);
            match result {
                Ok(()) => {
                    tracing::info!(%plugin, snapshot = %record.name, "interrupted snapshot operation finished");
                    if let Ok(Some(r)) = self.load_snapshot(&record.name).await
                        && !r.deleting
                        && !r.ready_to_use
                    {
                        tokio::time::sleep(backoff.next_delay()).await;
                        continue;
                    }
                    return;
                }
                Err(VolumeError::Plugin(rpc)) if !record.deleting && !rpc.is_transient() => {
                    // The plugin refuses the snapshot for good (its source is gone, say): no
                    // snapshot exists under this name, so there is nothing left to track.
                    tracing::error!(%plugin, snapshot = %record.name, error = %rpc, "the plugin refuses an interrupted snapshot; forgetting its record");
                    if let Err(err) = self.forget_snapshot(&record.name).await {
                        tracing::error!(%plugin, snapshot = %record.name, error = %err, "forgetting a snapshot record");
                    }
                    return;
                }
                Err(err) => {
                    tracing::warn!(%plugin, snapshot = %record.name, error = %err, "resuming an interrupted snapshot operation; retrying");
                    tokio::time::sleep(backoff.next_delay()).await;
                }
            }
        }
    }
}

/// Where a new volume's data comes from (`POST /v1/volumes`' `content_source`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ContentSource {
    Snapshot(String),
    Volume(String),
}

impl VolumeManager {
    /// The `volume_content_source` of a CreateVolume from a snapshot (restore; needs
    /// CREATE_DELETE_SNAPSHOT) or from a volume (clone; needs CLONE_VOLUME), refused before any
    /// RPC when the plugin lacks it. The source is the plugin's own id: a volume of another
    /// plugin is unknown to it.
    pub(super) async fn content_source(
        &self,
        source: ContentSource,
    ) -> Result<v1::VolumeContentSource, VolumeError> {
        use v1::volume_content_source::{SnapshotSource, Type, VolumeSource};
        let source = match source {
            ContentSource::Snapshot(snapshot_id) => {
                validate_id("content_source.snapshot_id", &snapshot_id)?;
                self.require_controller_cap(
                    ControllerCap::CreateDeleteSnapshot,
                    "restoring a snapshot",
                )
                .await?;
                Type::Snapshot(SnapshotSource { snapshot_id })
            }
            ContentSource::Volume(volume_id) => {
                validate_id("content_source.volume_id", &volume_id)?;
                self.require_controller_cap(ControllerCap::CloneVolume, "cloning a volume")
                    .await?;
                Type::Volume(VolumeSource { volume_id })
            }
        };
        Ok(v1::VolumeContentSource {
            r#type: Some(source),
        })
    }
}
