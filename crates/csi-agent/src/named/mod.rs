//! Volume names: what container engines call a volume (`docker volume create -d csi NAME`,
//! docs/docker-podman.md), mapped durably to a CSI volume of one plugin, and the four things
//! done with a name — create (or adopt), mount for a mount id, unmount, remove.
//!
//! A name's record (`named_volumes` in `state.db`, docs/on-disk-format.md) holds the plugin,
//! the volume id (none while its CreateVolume is in flight), whether csi-agent created the
//! volume or adopted it, and the capability and options it was created with; its secrets sit in
//! a 0600 file beside the database, never in it. A mount is a publish of that volume for a
//! claim (workload) the front door derives from the engine's mount id, so every mount is
//! reference counted by the volume manager's durable claims, and recovery covers it like any
//! publish.
//!
//! Crash safety of a create: the name's intent is committed before CreateVolume
//! (`named.create.after_intent`), the volume id after it (`named.create.after_rpc` lies
//! between). CreateVolume is idempotent by name ("if a volume corresponding to the specified
//! volume name already exists ... the Plugin MUST reply 0 OK", CSI spec, CreateVolume), so a
//! name left without an id is completed by re-issuing it with the same name — by the next
//! create, mount or remove of that name — and never yields two volumes. A remove deletes the
//! CSI volume first and forgets the name after (`named.remove.after_rpc`): a crash between
//! the two leaves the name, whose next remove re-issues the (idempotent) DeleteVolume.
//!
//! This module owns the names and their records. It must not parse an engine's protocol (the
//! daemon's `volume_plugin` does), publish or unpublish by itself (the volume manager does, for
//! the claim given), or wait for an operation in flight when asked to read: [`CsiServer::named`]
//! and [`CsiServer::named_list`] answer from the records and the plugins' read snapshots.

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::{Arc, Mutex, PoisonError};

use serde::{Deserialize, Serialize};

use crate::config::Service;
use crate::failpoint;
use crate::server::{CsiServer, ServerError};
use crate::store::{Record, Store, StoreError, Unreadable};
use crate::volume::{
    Capability, NewVolume, PluginEndpoints, PublishRequest, VolumeError, VolumeSecrets, VolumeState,
};

/// Failpoint: a create's intent (the name without a volume id) is committed; no
/// CreateVolume was sent yet.
pub const FP_NAME_CREATE_AFTER_INTENT: &str = "named.create.after_intent";
/// Failpoint: CreateVolume answered; the volume id is not recorded yet.
pub const FP_NAME_CREATE_AFTER_RPC: &str = "named.create.after_rpc";
/// Failpoint: DeleteVolume answered; the name is not forgotten yet.
pub const FP_NAME_REMOVE_AFTER_RPC: &str = "named.remove.after_rpc";

/// The most names one node keeps: each is a row and, with secrets, a file.
pub const MAX_NAMES: usize = 65_536;
/// The longest name, in bytes (a CSI name: it is the CreateVolume name).
pub const MAX_NAME_BYTES: usize = 128;

/// How a name came to its volume.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum NamedOrigin {
    /// csi-agent sent CreateVolume for it; removing the name deletes the volume.
    Created,
    /// An existing volume was named (`volume_id` given); removing the name only forgets it.
    Adopted,
}

/// What a name is created with (the front door parsed it from the engine's options).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NamedSpec {
    /// The plugin's type.
    pub plugin: String,
    /// `Some`: adopt this existing volume instead of creating one.
    pub volume_id: Option<String>,
    /// CreateVolume's `required_bytes` (0: the plugin's default).
    pub capacity_bytes: i64,
    pub capability: Capability,
    /// CreateVolume's `parameters`.
    pub parameters: BTreeMap<String, String>,
    /// The `volume_context` of an adopted volume (a created one gets CreateVolume's).
    pub volume_context: BTreeMap<String, String>,
    /// Given to CreateVolume, DeleteVolume, NodeStage and NodePublish; kept in a 0600 file.
    pub secrets: BTreeMap<String, String>,
    /// The engine's options as given, secrets' values left out: what a second create of the
    /// same name must repeat, and what `Status` shows.
    pub options: BTreeMap<String, String>,
}

/// The durable record of a name.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct NamedRecord {
    pub plugin: String,
    /// `None` while the CreateVolume of a created name is in flight (or its answer was lost).
    pub volume_id: Option<String>,
    pub origin: NamedOrigin,
    pub capacity_bytes: i64,
    pub capability: Capability,
    #[serde(default)]
    pub parameters: BTreeMap<String, String>,
    #[serde(default)]
    pub volume_context: BTreeMap<String, String>,
    #[serde(default)]
    pub has_secrets: bool,
    #[serde(default)]
    pub options: BTreeMap<String, String>,
    /// When the name was created (Unix seconds).
    pub created_at_unix: u64,
}

impl Record for NamedRecord {
    const SCHEMA_VERSION: u32 = 1;
}

/// A name as read: its record and where its volume stands on this node.
#[derive(Clone, Debug)]
pub struct NamedView {
    pub name: String,
    pub record: Arc<NamedRecord>,
    /// The volume's state on this node (`CREATED` … `PUBLISHED`); `None` while its create is
    /// unfinished or its plugin is not loaded.
    pub state: Option<VolumeState>,
    /// The workloads (mounts) holding the volume.
    pub claims: Vec<String>,
    /// The target path, while the volume is published there; `None` otherwise (an empty
    /// directory is never handed out: an engine binding it would write to the host's disk).
    pub mountpoint: Option<PathBuf>,
}

/// Errors of the names' operations, each saying what to do.
#[derive(Debug, thiserror::Error)]
pub enum NamedError {
    #[error(
        "volume name {name:?} is not valid: {reason}; use 1 to {MAX_NAME_BYTES} letters, digits, '_', '.' or '-', starting with a letter or digit"
    )]
    InvalidName { name: String, reason: &'static str },
    #[error("no volume is named {name:?} on this node")]
    UnknownName { name: String },
    #[error(
        "volume name {name:?} exists with other options (plugin {plugin}, options {options:?}): remove it first, or create it again with the same options"
    )]
    Exists {
        name: String,
        plugin: String,
        options: BTreeMap<String, String>,
    },
    #[error(
        "volume {name:?} is in use by {} mount(s) ({}): stop the containers using it first",
        claims.len(),
        claims.join(", ")
    )]
    InUse { name: String, claims: Vec<String> },
    #[error(
        "volume {name:?} (volume id {volume_id:?}) is still {state} on this node with no mount: wait for the unmount to finish, then remove it again"
    )]
    Busy {
        name: String,
        volume_id: String,
        state: &'static str,
    },
    #[error(
        "plugin {plugin} has no controller service, so it cannot create volume {name:?}: name an existing volume with the option volume_id=ID"
    )]
    NoController { name: String, plugin: String },
    #[error("this node already has {MAX_NAMES} volume names: remove some first")]
    TooMany,
    #[error("volume {name:?}: {source}")]
    Volume {
        name: String,
        #[source]
        source: Box<VolumeError>,
    },
    #[error(transparent)]
    Server(#[from] ServerError),
    #[error("volume {name:?}: the work dir: {source}")]
    Store {
        name: String,
        #[source]
        source: StoreError,
    },
    #[error("volume {name:?}: {source}")]
    Failpoint {
        name: String,
        #[source]
        source: failpoint::FailpointError,
    },
}

impl NamedError {
    fn volume(name: &str) -> impl FnOnce(VolumeError) -> Self + '_ {
        move |source| Self::Volume {
            name: name.to_owned(),
            source: Box::new(source),
        }
    }

    fn failpoint(name: &str) -> impl FnOnce(failpoint::FailpointError) -> Self + '_ {
        move |source| Self::Failpoint {
            name: name.to_owned(),
            source,
        }
    }

    fn store(name: &str) -> impl FnOnce(StoreError) -> Self + '_ {
        move |source| Self::Store {
            name: name.to_owned(),
            source,
        }
    }
}

/// The names of one node: their records, read without waiting, and one lock per name that
/// orders the operations on it.
#[derive(Debug, Default)]
pub struct NamedState {
    records: Mutex<BTreeMap<String, Arc<NamedRecord>>>,
    locks: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
    /// Rows this build could not read at start (left in the database).
    unreadable: Vec<(String, Unreadable)>,
}

impl NamedState {
    /// Loads every name's record (see [`Store::load_named`]).
    pub fn load(store: &Store) -> Result<Self, StoreError> {
        let loaded = store.load_named::<NamedRecord>()?;
        for (key, reason) in &loaded.unreadable {
            tracing::warn!(
                row = %key,
                %reason,
                "a volume name's record cannot be read; it is left in the database's named_volumes table and not served"
            );
        }
        Ok(Self {
            records: Mutex::new(
                loaded
                    .records
                    .into_iter()
                    .map(|(name, record)| (name, Arc::new(record)))
                    .collect(),
            ),
            locks: Mutex::default(),
            unreadable: loaded.unreadable,
        })
    }

    fn get(&self, name: &str) -> Option<Arc<NamedRecord>> {
        self.records
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(name)
            .cloned()
    }

    fn set(&self, name: &str, record: Option<NamedRecord>) {
        let mut records = self.records.lock().unwrap_or_else(PoisonError::into_inner);
        match record {
            Some(record) => records.insert(name.to_owned(), Arc::new(record)),
            None => records.remove(name),
        };
    }

    fn lock_of(&self, name: &str) -> Arc<tokio::sync::Mutex<()>> {
        let mut locks = self.locks.lock().unwrap_or_else(PoisonError::into_inner);
        // Requests for names that do not exist make locks too: those nobody holds go once
        // there are more locks than names can need.
        if locks.len() > MAX_NAMES {
            locks.retain(|_, lock| Arc::strong_count(lock) > 1);
        }
        locks.entry(name.to_owned()).or_default().clone()
    }

    /// The rows that could not be read at start: `(row key, why)`.
    pub fn unreadable(&self) -> &[(String, Unreadable)] {
        &self.unreadable
    }
}

/// Checks a name as Docker and Podman do (`[a-zA-Z0-9][a-zA-Z0-9_.-]*`), bounded as a CSI
/// name.
pub fn check_name(name: &str) -> Result<(), NamedError> {
    let invalid = |reason| NamedError::InvalidName {
        name: name.to_owned(),
        reason,
    };
    if name.is_empty() {
        return Err(invalid("it is empty"));
    }
    if name.len() > MAX_NAME_BYTES {
        return Err(invalid("it is too long"));
    }
    if !name.as_bytes()[0].is_ascii_alphanumeric() {
        return Err(invalid("it does not start with a letter or digit"));
    }
    if !name
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-'))
    {
        return Err(invalid("it holds a character other than those allowed"));
    }
    Ok(())
}

fn now_unix() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

impl CsiServer {
    /// Creates the volume `name` (CreateVolume through the plugin's controller, idempotent by
    /// name) or adopts `spec.volume_id`. Creating an existing name again with the same options
    /// succeeds (and finishes a create a crash interrupted); with other options it is refused.
    pub async fn named_create(&self, name: &str, spec: NamedSpec) -> Result<NamedView, NamedError> {
        check_name(name)?;
        self.refuse_if_drained()?;
        let named = self.named_state();
        let lock = named.lock_of(name);
        let _held = lock.lock().await;
        if let Some(existing) = named.get(name) {
            // The options as given include `volume_id` (adoption) and everything else asked.
            if existing.plugin != spec.plugin || existing.options != spec.options {
                return Err(NamedError::Exists {
                    name: name.to_owned(),
                    plugin: existing.plugin.clone(),
                    options: existing.options.clone(),
                });
            }
            if existing.volume_id.is_none() {
                self.finish_create(name, &existing).await?;
            }
            return Ok(self
                .named_view(name)
                .await
                .unwrap_or_else(|| fresh_view(name, existing)));
        }
        if named
            .records
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .len()
            >= MAX_NAMES
        {
            return Err(NamedError::TooMany);
        }
        // The plugin must exist (and be started) before anything is written for the name.
        let plugin = self.plugin(&spec.plugin).await?;
        let origin = if spec.volume_id.is_some() {
            NamedOrigin::Adopted
        } else if !plugin.endpoints.serves(Service::Controller) {
            return Err(NamedError::NoController {
                name: name.to_owned(),
                plugin: spec.plugin,
            });
        } else {
            NamedOrigin::Created
        };
        if let Some(volume_id) = &spec.volume_id {
            crate::volume::validate_id("volume_id", volume_id).map_err(NamedError::volume(name))?;
        }
        let store = self.store();
        // Secrets first: a record never names secrets that are not there. Secrets without a
        // record (a crash right here) are swept at the next start.
        let has_secrets = !spec.secrets.is_empty();
        if has_secrets {
            store
                .save_named_secrets(name, &spec.secrets)
                .map_err(NamedError::store(name))?;
        }
        let record = NamedRecord {
            plugin: spec.plugin,
            volume_id: spec.volume_id,
            origin,
            capacity_bytes: spec.capacity_bytes,
            capability: spec.capability,
            parameters: spec.parameters,
            volume_context: spec.volume_context,
            has_secrets,
            options: spec.options,
            created_at_unix: now_unix(),
        };
        store
            .save_named(name, &record)
            .await
            .map_err(NamedError::store(name))?;
        named.set(name, Some(record.clone()));
        if record.volume_id.is_none() {
            failpoint::hit(FP_NAME_CREATE_AFTER_INTENT).map_err(NamedError::failpoint(name))?;
            if let Err(err) = self.finish_create(name, &record).await {
                // Nothing was created (or the plugin refused): the name goes, so that the
                // engine's create can simply be tried again. A plugin that created the volume
                // but whose answer was lost gives it back to the next create of this name.
                if let Err(forget) = store.delete_named(name).await {
                    tracing::warn!(name, error = %forget, "a failed create's name was not forgotten; it is completed or removed by its next create or remove");
                } else {
                    named.set(name, None);
                }
                return Err(err);
            }
        }
        let record = named.get(name).unwrap_or_else(|| Arc::new(record));
        Ok(self
            .named_view(name)
            .await
            .unwrap_or_else(|| fresh_view(name, record)))
    }

    /// Sends the (idempotent) CreateVolume of a name whose volume id is not recorded, and
    /// records the id. Called with the name's lock held.
    async fn finish_create(&self, name: &str, record: &NamedRecord) -> Result<String, NamedError> {
        let plugin = self.plugin(&record.plugin).await?;
        let secrets = self.named_secrets(name, record)?;
        let created = plugin
            .volumes
            .create_volume(NewVolume {
                parameters: record.parameters.clone(),
                secrets,
                ..NewVolume::new(name, record.capacity_bytes, &record.capability)
            })
            .await
            .map_err(NamedError::volume(name))?;
        failpoint::hit(FP_NAME_CREATE_AFTER_RPC).map_err(NamedError::failpoint(name))?;
        let mut done = record.clone();
        done.volume_id = Some(created.volume_id.clone());
        self.store()
            .save_named(name, &done)
            .await
            .map_err(NamedError::store(name))?;
        self.named_state().set(name, Some(done));
        Ok(created.volume_id)
    }

    fn named_secrets(
        &self,
        name: &str,
        record: &NamedRecord,
    ) -> Result<BTreeMap<String, String>, NamedError> {
        if !record.has_secrets {
            return Ok(BTreeMap::new());
        }
        Ok(self
            .store()
            .load_named_secrets(name)
            .map_err(NamedError::store(name))?
            .unwrap_or_default())
    }

    /// The name's record with its volume id, finishing an interrupted create first.
    async fn named_volume(&self, name: &str) -> Result<(Arc<NamedRecord>, String), NamedError> {
        let record = self
            .named_state()
            .get(name)
            .ok_or_else(|| NamedError::UnknownName {
                name: name.to_owned(),
            })?;
        let volume_id = match &record.volume_id {
            Some(id) => id.clone(),
            None => self.finish_create(name, &record).await?,
        };
        let record = self.named_state().get(name).unwrap_or(record);
        Ok((record, volume_id))
    }

    /// Publishes the named volume for `workload` (the front door's claim for one mount id) and
    /// returns its target path. Idempotent per workload.
    pub async fn named_mount(&self, name: &str, workload: &str) -> Result<PathBuf, NamedError> {
        check_name(name)?;
        self.refuse_if_drained()?;
        let lock = self.named_state().lock_of(name);
        let _held = lock.lock().await;
        let (record, volume_id) = self.named_volume(name).await?;
        let plugin = self.plugin(&record.plugin).await?;
        let secrets = self.named_secrets(name, &record)?;
        let published = plugin
            .volumes
            .publish(PublishRequest {
                volume_id,
                workload: workload.to_owned(),
                capability: record.capability.clone(),
                readonly: false,
                // A created volume's context is the one its record keeps from CreateVolume.
                volume_context: (record.origin == NamedOrigin::Adopted)
                    .then(|| record.volume_context.clone()),
                secrets: VolumeSecrets {
                    node_stage: secrets.clone(),
                    node_publish: secrets,
                },
                bind_to: None,
            })
            .await
            .map_err(NamedError::volume(name))?;
        Ok(published.target_path)
    }

    /// Drops `workload`'s claim on the named volume; the volume manager unpublishes (and
    /// unstages) when it was the last. Idempotent: a claim that is not there is no error.
    pub async fn named_unmount(&self, name: &str, workload: &str) -> Result<(), NamedError> {
        check_name(name)?;
        let lock = self.named_state().lock_of(name);
        let _held = lock.lock().await;
        let record = self
            .named_state()
            .get(name)
            .ok_or_else(|| NamedError::UnknownName {
                name: name.to_owned(),
            })?;
        // A name whose create never finished was never mounted.
        let Some(volume_id) = &record.volume_id else {
            return Ok(());
        };
        let plugin = self.plugin(&record.plugin).await?;
        plugin
            .volumes
            .unpublish(volume_id, workload)
            .await
            .map_err(NamedError::volume(name))
    }

    /// Removes the name: refused while a mount holds its volume; deletes the CSI volume if
    /// csi-agent created it (an adopted one is only forgotten). Removing a name that does
    /// not exist succeeds (a retried remove).
    pub async fn named_remove(&self, name: &str) -> Result<(), NamedError> {
        check_name(name)?;
        let named = self.named_state();
        let lock = named.lock_of(name);
        let _held = lock.lock().await;
        if named.get(name).is_none() {
            return Ok(());
        }
        let (record, volume_id) = self.named_volume(name).await?;
        let plugin = self.plugin(&record.plugin).await?;
        if let Some(volume) = plugin.volumes.get(&volume_id).await {
            if !volume.claims.is_empty() {
                return Err(NamedError::InUse {
                    name: name.to_owned(),
                    claims: volume.claims.iter().cloned().collect(),
                });
            }
            if volume.state != VolumeState::Created {
                return Err(NamedError::Busy {
                    name: name.to_owned(),
                    volume_id,
                    state: volume.state.as_str(),
                });
            }
        }
        if record.origin == NamedOrigin::Created {
            let secrets = self.named_secrets(name, &record)?;
            plugin
                .volumes
                .delete_volume(&volume_id, secrets)
                .await
                .map_err(NamedError::volume(name))?;
            failpoint::hit(FP_NAME_REMOVE_AFTER_RPC).map_err(NamedError::failpoint(name))?;
        }
        self.store()
            .delete_named(name)
            .await
            .map_err(NamedError::store(name))?;
        named.set(name, None);
        Ok(())
    }

    /// One name as read now, without waiting for an operation on it.
    pub async fn named(&self, name: &str) -> Option<NamedView> {
        self.named_view(name).await
    }

    /// Every name, sorted, without waiting for an operation on any.
    pub async fn named_list(&self) -> Vec<NamedView> {
        let records: Vec<(String, Arc<NamedRecord>)> = self
            .named_state()
            .records
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .iter()
            .map(|(name, record)| (name.clone(), record.clone()))
            .collect();
        let mut views = Vec::with_capacity(records.len());
        for (name, record) in records {
            views.push(self.view_of(name, record).await);
        }
        views
    }

    async fn named_view(&self, name: &str) -> Option<NamedView> {
        let record = self.named_state().get(name)?;
        Some(self.view_of(name.to_owned(), record).await)
    }

    async fn view_of(&self, name: String, record: Arc<NamedRecord>) -> NamedView {
        let mut view = NamedView {
            name,
            record,
            state: None,
            claims: Vec::new(),
            mountpoint: None,
        };
        let Some(volume_id) = view.record.volume_id.as_deref() else {
            return view;
        };
        let Some(plugin) = self.plugin_if_loaded(&view.record.plugin).await else {
            return view;
        };
        match plugin.volumes.snapshot_of(volume_id) {
            Some(volume) => {
                view.state = Some(volume.state);
                view.claims = volume.claims.iter().cloned().collect();
                if volume.state == VolumeState::Published {
                    view.mountpoint = Some(plugin.volumes.target_path(volume_id));
                }
            }
            // Known to the plugin but not tracked here (adopted, never mounted).
            None => view.state = Some(VolumeState::Created),
        }
        view
    }
}

/// The view of a name whose record was just written, should it have gone meanwhile.
fn fresh_view(name: &str, record: Arc<NamedRecord>) -> NamedView {
    NamedView {
        name: name.to_owned(),
        record,
        state: None,
        claims: Vec::new(),
        mountpoint: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_checked_as_the_engines_check_them() {
        for good in ["v1", "data", "a.b-c_d", "0", &"x".repeat(MAX_NAME_BYTES)] {
            assert!(check_name(good).is_ok(), "{good:?}");
        }
        for bad in [
            "",
            ".hidden",
            "-x",
            "_x",
            "a/b",
            "../etc",
            "a b",
            "a\0b",
            "vol\u{fc}",
            &"x".repeat(MAX_NAME_BYTES + 1),
        ] {
            let err = check_name(bad).err().map(|e| e.to_string());
            assert!(
                err.as_deref().is_some_and(|e| e.contains("is not valid")),
                "{bad:?}: {err:?}"
            );
        }
    }
}
