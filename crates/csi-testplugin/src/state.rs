//! The plugin's durable bookkeeping: `<work-dir>/state.json`.
//!
//! Owns: the record of every volume (size, parameters, controller
//! publications, staging and node publications with their capability and
//! readonly flag), loading it at start, and writing it atomically (temp file,
//! fsync, rename, fsync of the directory) with group commit so that concurrent
//! RPCs share one write. A caller is answered only after its change is
//! durable, so a plugin killed at any moment and restarted keeps its truth.
//! [`Durability::Volatile`] (`--volatile-state`) keeps it in memory only, for
//! benchmarks of csi-agent at a scale where rewriting the whole file per
//! commit would measure this plugin instead (the file is O(volumes)).
//! An in-memory index of staging and target paths answers "which other
//! volume uses this path" without a scan of every volume (a scan per
//! NodeStage/NodePublish made publishing 100,000 volumes quadratic).
//!
//! Must not: mount, create volume directories or decide CSI semantics; the
//! closures passed to [`Store::update`] (in `plugin.rs`) do that.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fs::{self, File, OpenOptions};
use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard};

use anyhow::Context;
use serde::{Deserialize, Serialize};
use tonic::Status;

use crate::model::Capability;

/// Bumped when the layout of `state.json` changes incompatibly.
pub const SCHEMA_VERSION: u32 = 1;

/// The whole content of `state.json`.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct StateFile {
    pub schema_version: u32,
    /// Boot id when the node-side records were last written; a different boot
    /// id at start means every mount vanished with a reboot.
    #[serde(default)]
    pub boot_id: String,
    #[serde(default)]
    pub volumes: BTreeMap<String, VolumeRecord>,
    /// Snapshots by id (= name), their data in `<work-dir>/snapshots/<id>`.
    #[serde(default)]
    pub snapshots: BTreeMap<String, SnapshotRecord>,
}

/// One snapshot (`--snapshots`). Written with `complete: false` before its
/// data is copied (intent first); a record still incomplete at start is
/// dropped with its partial copy, so the CO's re-issue copies again.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct SnapshotRecord {
    pub source_volume_id: String,
    #[serde(default)]
    pub parameters: BTreeMap<String, String>,
    /// Bytes of data copied (regular files).
    #[serde(default)]
    pub size_bytes: i64,
    /// Nanoseconds since the epoch.
    #[serde(default)]
    pub creation_time_ns: u64,
    #[serde(default)]
    pub complete: bool,
    /// CreateSnapshot answers still to say `ready_to_use: false`
    /// (`--snapshot-ready-after`).
    #[serde(default)]
    pub not_ready_answers: u32,
}

/// Where a volume's initial data came from (`volume_content_source`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ContentSource {
    Snapshot(String),
    Volume(String),
}

/// One volume. Its id is the key in [`StateFile::volumes`] and the name of
/// its directory under `<work-dir>/volumes`.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct VolumeRecord {
    /// 0 means unknown (e.g. a directory adopted without a record).
    pub capacity_bytes: i64,
    #[serde(default)]
    pub parameters: BTreeMap<String, String>,
    /// Controller publications by node id.
    #[serde(default)]
    pub controller_published: BTreeMap<String, ControllerPublication>,
    /// The staging of this volume; the CO ensures one staging path per volume.
    #[serde(default)]
    pub staged: Option<Staging>,
    /// Node publications by target path.
    #[serde(default)]
    pub published: BTreeMap<String, Publication>,
    /// Created for the block access type (`--block`): its data is `blocks/<id>.img`, and it
    /// stays a block volume.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub block: bool,
    /// The loop device last attached to the block volume's backing file (`/dev/loopN`).
    /// Only a hint: before detaching, the device's backing file is checked to be this
    /// volume's (`crate::block`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub loop_device: Option<String>,
    /// The snapshot or volume this volume was created from.
    #[serde(default)]
    pub content_source: Option<ContentSource>,
    /// Recorded before the source's data is copied in; still set at start
    /// means the copy was interrupted, and the volume is removed.
    #[serde(default)]
    pub populating: bool,
}

impl VolumeRecord {
    /// Whether anything still uses the volume (controller- or node-side).
    pub fn in_use(&self) -> Option<String> {
        if let Some(node) = self.controller_published.keys().next() {
            return Some(format!("it is controller-published to node {node:?}"));
        }
        if let Some(s) = &self.staged {
            return Some(format!("it is staged at {:?}", s.path));
        }
        if let Some(t) = self.published.keys().next() {
            return Some(format!("it is published at {t:?}"));
        }
        None
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ControllerPublication {
    pub capability: Capability,
    pub readonly: bool,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Staging {
    pub path: String,
    pub capability: Capability,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Publication {
    pub capability: Capability,
    pub readonly: bool,
    /// The staging path the target was bound from, if staged.
    #[serde(default)]
    pub staging_path: Option<String>,
    /// CSI v1: the plugin created the target and removes it on unpublish.
    /// CSI v0: the CO owns the target, the plugin leaves it.
    pub remove_target: bool,
}

struct Inner {
    data: StateFile,
    /// The staging and target paths of `data`, kept in step with it.
    paths: PathIndex,
    /// Incremented by every change to `data`.
    generation: u64,
}

/// Which volumes use each staging and target path. A set per path, since a
/// hand-edited `state.json` may name a path twice; the plugin itself never
/// lets two volumes share one.
#[derive(Debug, Default, PartialEq, Eq)]
struct PathIndex {
    staging: HashMap<String, BTreeSet<String>>,
    targets: HashMap<String, BTreeSet<String>>,
}

impl PathIndex {
    fn of(data: &StateFile) -> Self {
        let mut index = Self::default();
        for (id, v) in &data.volumes {
            index.add(id, v);
        }
        index
    }

    fn add(&mut self, id: &str, v: &VolumeRecord) {
        if let Some(st) = &v.staged {
            self.staging
                .entry(st.path.clone())
                .or_default()
                .insert(id.to_owned());
        }
        for target in v.published.keys() {
            self.targets
                .entry(target.clone())
                .or_default()
                .insert(id.to_owned());
        }
    }

    fn remove(&mut self, id: &str, v: &VolumeRecord) {
        fn drop_from(map: &mut HashMap<String, BTreeSet<String>>, path: &str, id: &str) {
            if let Some(ids) = map.get_mut(path) {
                ids.remove(id);
                if ids.is_empty() {
                    map.remove(path);
                }
            }
        }
        if let Some(st) = &v.staged {
            drop_from(&mut self.staging, &st.path, id);
        }
        for target in v.published.keys() {
            drop_from(&mut self.targets, target, id);
        }
    }

    fn other_user(
        map: &HashMap<String, BTreeSet<String>>,
        path: &str,
        except: Option<&str>,
    ) -> Option<String> {
        map.get(path)?
            .iter()
            .find(|id| Some(id.as_str()) != except)
            .cloned()
    }
}

/// Whether the store writes `state.json` at all.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Durability {
    /// Every change durable before its caller is answered (the default).
    Durable,
    /// Memory only: `state.json` is neither read nor written, so a restart of
    /// the plugin forgets every record (its volume directories are re-adopted
    /// with unknown size). Only for benchmarks that never restart the plugin.
    Volatile,
}

/// The durable store. Cheap to share behind the plugin's `Arc`.
pub struct Store {
    durability: Durability,
    path: PathBuf,
    tmp_path: PathBuf,
    inner: Mutex<Inner>,
    /// Serialises writers; the one holding it writes everything changed so far.
    writer: tokio::sync::Mutex<()>,
    /// The highest generation known to be on disk.
    durable: AtomicU64,
}

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Store").field("path", &self.path).finish()
    }
}

impl Store {
    /// Loads `path`, or starts empty if it does not exist. A file that cannot
    /// be parsed is moved aside (`state.json.corrupt-<ns>`) and reported, so
    /// that the plugin still starts; its volume directories are re-adopted by
    /// the caller.
    pub fn open(path: &Path, durability: Durability) -> anyhow::Result<Self> {
        let existing = match durability {
            Durability::Durable => fs::read(path),
            Durability::Volatile => Err(std::io::ErrorKind::NotFound.into()),
        };
        let data = match existing {
            Ok(bytes) => match serde_json::from_slice::<StateFile>(&bytes) {
                Ok(d) if d.schema_version == SCHEMA_VERSION => d,
                Ok(d) => move_aside(
                    path,
                    &format!("unknown schema_version {}", d.schema_version),
                )?,
                Err(e) => move_aside(path, &e.to_string())?,
            },
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => StateFile {
                schema_version: SCHEMA_VERSION,
                ..StateFile::default()
            },
            Err(e) => return Err(e).with_context(|| format!("reading {}", path.display())),
        };
        let mut tmp = path.as_os_str().to_owned();
        tmp.push(".tmp");
        Ok(Self {
            durability,
            path: path.to_owned(),
            tmp_path: PathBuf::from(tmp),
            inner: Mutex::new(Inner {
                paths: PathIndex::of(&data),
                data,
                generation: 0,
            }),
            writer: tokio::sync::Mutex::new(()),
            durable: AtomicU64::new(0),
        })
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        // A panic while holding the lock leaves a consistent-enough map for a
        // test plugin; keep serving rather than poisoning every later call.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Reads the current state.
    pub fn read<R>(&self, f: impl FnOnce(&StateFile) -> R) -> R {
        f(&self.lock().data)
    }

    /// A volume other than `except` staged at `path`, if any.
    pub fn staging_user(&self, path: &str, except: Option<&str>) -> Option<String> {
        PathIndex::other_user(&self.lock().paths.staging, path, except)
    }

    /// A volume other than `except` published at `path`, if any.
    pub fn target_user(&self, path: &str, except: Option<&str>) -> Option<String> {
        PathIndex::other_user(&self.lock().paths.targets, path, except)
    }

    /// Runs `f` on the state under the lock; `f` returns its result and
    /// whether it changed anything. A change is made durable before this
    /// returns. `f` must leave the state untouched when it returns an error.
    /// The path index is rebuilt after a change (O(volumes)): a change to one
    /// volume goes through [`Store::update_volume`] instead.
    pub async fn update<R>(
        &self,
        f: impl FnOnce(&mut StateFile) -> Result<(R, bool), Status>,
    ) -> Result<R, Status> {
        let (value, generation) = {
            let mut inner = self.lock();
            let (value, changed) = f(&mut inner.data)?;
            if !changed {
                return Ok(value);
            }
            inner.paths = PathIndex::of(&inner.data);
            inner.generation += 1;
            (value, inner.generation)
        };
        self.persist(generation).await?;
        Ok(value)
    }

    /// [`Store::update`] of one volume (`None` if it is unknown), keeping
    /// the path index in step with it at the cost of that volume's paths.
    pub async fn update_volume<R>(
        &self,
        id: &str,
        f: impl FnOnce(Option<&mut VolumeRecord>) -> Result<(R, bool), Status>,
    ) -> Result<R, Status> {
        let (value, generation) = {
            let mut guard = self.lock();
            let inner = &mut *guard;
            let volume = inner.data.volumes.get_mut(id);
            if let Some(v) = &volume {
                inner.paths.remove(id, v);
            }
            let result = f(volume);
            if let Some(v) = inner.data.volumes.get(id) {
                inner.paths.add(id, v);
            }
            let (value, changed) = result?;
            if !changed {
                return Ok(value);
            }
            inner.generation += 1;
            (value, inner.generation)
        };
        self.persist(generation).await?;
        Ok(value)
    }

    async fn persist(&self, generation: u64) -> Result<(), Status> {
        self.commit(generation)
            .await
            .map_err(|e| Status::internal(format!("persisting plugin state: {e:#}")))
    }

    /// Synchronous variant of [`Store::update`] for start-up, before the
    /// runtime serves anything.
    pub fn update_now(&self, f: impl FnOnce(&mut StateFile) -> bool) -> anyhow::Result<()> {
        let bytes = {
            let mut inner = self.lock();
            if !f(&mut inner.data) {
                return Ok(());
            }
            inner.paths = PathIndex::of(&inner.data);
            inner.generation += 1;
            self.durable.store(inner.generation, Ordering::SeqCst);
            if self.durability == Durability::Volatile {
                return Ok(());
            }
            serde_json::to_vec_pretty(&inner.data)?
        };
        write_atomic(&self.path, &self.tmp_path, &bytes)
    }

    /// Group commit: waits for the writer slot; if another writer already
    /// made `generation` durable meanwhile, there is nothing left to do,
    /// otherwise writes a snapshot of everything changed so far.
    async fn commit(&self, generation: u64) -> anyhow::Result<()> {
        if self.durability == Durability::Volatile {
            return Ok(());
        }
        let _slot = self.writer.lock().await;
        if self.durable.load(Ordering::SeqCst) >= generation {
            return Ok(());
        }
        let (bytes, snapshot_gen) = {
            let inner = self.lock();
            (serde_json::to_vec_pretty(&inner.data)?, inner.generation)
        };
        let (path, tmp) = (self.path.clone(), self.tmp_path.clone());
        tokio::task::spawn_blocking(move || write_atomic(&path, &tmp, &bytes))
            .await
            .context("state writer task")??;
        self.durable.store(snapshot_gen, Ordering::SeqCst);
        Ok(())
    }
}

/// Writes `bytes` to `path` atomically and durably: a temp file in the same
/// directory (mode 0600: the state holds mount flags), fsync, rename over the
/// old file, fsync the directory.
pub fn write_atomic(path: &Path, tmp: &Path, bytes: &[u8]) -> anyhow::Result<()> {
    let mut f = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(tmp)
        .with_context(|| format!("creating {}", tmp.display()))?;
    f.write_all(bytes)
        .and_then(|()| f.sync_all())
        .with_context(|| format!("writing {}", tmp.display()))?;
    drop(f);
    fs::rename(tmp, path).with_context(|| format!("renaming onto {}", path.display()))?;
    let dir = path.parent().unwrap_or_else(|| Path::new("."));
    File::open(dir)
        .and_then(|d| d.sync_all())
        .with_context(|| format!("fsync of {}", dir.display()))?;
    Ok(())
}

fn move_aside(path: &Path, why: &str) -> anyhow::Result<StateFile> {
    let ns = crate::calllog::now_ns();
    let mut aside = path.as_os_str().to_owned();
    aside.push(format!(".corrupt-{ns}"));
    tracing::error!(
        path = %path.display(),
        moved_to = ?aside,
        "unreadable plugin state ({why}); starting from the volume directories"
    );
    fs::rename(path, &aside).with_context(|| format!("moving {} aside", path.display()))?;
    Ok(StateFile {
        schema_version: SCHEMA_VERSION,
        ..StateFile::default()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn update_persists_and_reloads() -> anyhow::Result<()> {
        let dir = tempfile::tempdir()?;
        let path = dir.path().join("state.json");
        let store = Store::open(&path, Durability::Durable)?;
        store
            .update(|s| {
                s.volumes.insert(
                    "a".into(),
                    VolumeRecord {
                        capacity_bytes: 5,
                        ..VolumeRecord::default()
                    },
                );
                Ok(((), true))
            })
            .await
            .map_err(|s| anyhow::anyhow!("{s}"))?;
        let again = Store::open(&path, Durability::Durable)?;
        assert_eq!(again.read(|s| s.volumes["a"].capacity_bytes), 5);
        Ok(())
    }

    #[tokio::test]
    async fn a_volatile_store_neither_reads_nor_writes_the_file() -> anyhow::Result<()> {
        let dir = tempfile::tempdir()?;
        let path = dir.path().join("state.json");
        fs::write(&path, b"{not json")?;
        let store = Store::open(&path, Durability::Volatile)?;
        assert!(store.read(|s| s.volumes.is_empty()));
        store
            .update(|s| {
                s.volumes.insert("a".into(), VolumeRecord::default());
                Ok(((), true))
            })
            .await
            .map_err(|s| anyhow::anyhow!("{s}"))?;
        assert!(store.read(|s| s.volumes.contains_key("a")));
        assert_eq!(fs::read(&path)?, b"{not json", "the file is left as it was");
        Ok(())
    }

    fn capability() -> Capability {
        Capability {
            access: crate::model::AccessType::Block,
            mode: crate::model::AccessMode::SingleNodeWriter,
        }
    }

    fn staged_at(path: &str) -> Option<Staging> {
        Some(Staging {
            path: path.into(),
            capability: capability(),
        })
    }

    #[tokio::test]
    async fn the_path_index_follows_every_kind_of_change() -> anyhow::Result<()> {
        let dir = tempfile::tempdir()?;
        let path = dir.path().join("state.json");
        let store = Store::open(&path, Durability::Durable)?;
        let fail = |s: Status| anyhow::anyhow!("{s}");
        store
            .update(|s| {
                s.volumes.insert("a".into(), VolumeRecord::default());
                s.volumes.insert("b".into(), VolumeRecord::default());
                Ok(((), true))
            })
            .await
            .map_err(fail)?;
        store
            .update_volume("a", |v| {
                let v = v.ok_or_else(|| Status::not_found("a"))?;
                v.staged = staged_at("/s");
                v.published.insert("/t".into(), publication());
                Ok(((), true))
            })
            .await
            .map_err(fail)?;
        assert_eq!(store.staging_user("/s", Some("b")).as_deref(), Some("a"));
        assert_eq!(
            store.staging_user("/s", Some("a")),
            None,
            "a volume is not its own rival"
        );
        assert_eq!(store.target_user("/t", None).as_deref(), Some("a"));
        assert_eq!(store.target_user("/other", None), None);
        // An error leaves the state and the index as they were.
        let refused: Result<(), Status> = store
            .update_volume("a", |_| Err(Status::failed_precondition("no")))
            .await;
        assert!(refused.is_err());
        assert_eq!(store.target_user("/t", None).as_deref(), Some("a"));
        // Moving the paths moves the index.
        store
            .update_volume("a", |v| {
                let v = v.ok_or_else(|| Status::not_found("a"))?;
                v.published.remove("/t");
                v.staged = None;
                Ok(((), true))
            })
            .await
            .map_err(fail)?;
        assert_eq!(store.target_user("/t", None), None);
        assert_eq!(store.staging_user("/s", None), None);
        // A whole-state change (here a reboot's) is indexed too, and so is
        // a file read back at start.
        store
            .update(|s| {
                if let Some(v) = s.volumes.get_mut("b") {
                    v.staged = staged_at("/s2");
                }
                Ok(((), true))
            })
            .await
            .map_err(fail)?;
        assert_eq!(store.staging_user("/s2", None).as_deref(), Some("b"));
        let again = Store::open(&path, Durability::Durable)?;
        assert_eq!(again.staging_user("/s2", None).as_deref(), Some("b"));
        let inner = again.lock();
        assert_eq!(inner.paths, PathIndex::of(&inner.data));
        Ok(())
    }

    fn publication() -> Publication {
        Publication {
            capability: capability(),
            readonly: false,
            staging_path: None,
            remove_target: true,
        }
    }

    #[test]
    fn corrupt_file_is_moved_aside() -> anyhow::Result<()> {
        let dir = tempfile::tempdir()?;
        let path = dir.path().join("state.json");
        fs::write(&path, b"{not json")?;
        let store = Store::open(&path, Durability::Durable)?;
        assert!(store.read(|s| s.volumes.is_empty()));
        assert!(!path.exists());
        let moved = fs::read_dir(dir.path())?
            .filter_map(Result::ok)
            .any(|e| e.file_name().to_string_lossy().contains(".corrupt-"));
        assert!(moved);
        Ok(())
    }
}
