//! The image store: pulled images, their prepared root file systems, and garbage collection,
//! all under one directory the caller gives (the daemon uses `<work_dir>/images`).
//!
//! Layout (docs/operations.md, "Image store"):
//! - `blobs/sha256/<hex>`: the [`BlobStore`], shared by every image;
//! - `index.json`: reference → manifest digest, config digest, layers, size, pulled at;
//!   rewritten whole, atomically (temp file, fsync, rename, directory fsync);
//! - `rootfs/<manifest hex>/`: the image's layers applied in order (a flattened copy, shared
//!   read-only by every container of the image), built in `rootfs/.tmp-<hex>-<random>/`, the
//!   file system synced, and renamed into place only when complete.
//!
//! So a SIGKILL at any point leaves at worst temp files and temp dirs (names starting with
//! `.`, never a digest) which [`ImageStore::open`] removes, an index that is the old or the
//! new one, and possibly a complete rootfs the index does not name yet (used by the next
//! [`ImageStore::ensure`] of that image, or removed by [`ImageStore::prune`]).
//!
//! It owns when to pull (Mesos `cached` semantics), the index, the rootfs dirs and which blobs
//! are garbage. It must not decide which images are in use (the caller says, from the plugin
//! configs), nor run containers. Everything read back from disk is checked: index digests are
//! parsed with [`Digest::parse`] before they name a file or directory, the index and the
//! image config are read with a size bound, and the config is parsed as hostile JSON.

use std::collections::{BTreeMap, BTreeSet};
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

use super::blobs::{BlobError, BlobStore, Digest};
use super::pull::{PullError, Puller};
use super::reference::ImageRef;
use super::unpack::{self, Compression, Limits, UnpackError};

/// The index's file name.
pub const INDEX_FILE: &str = "index.json";
/// The directory of prepared root file systems.
pub const ROOTFS_DIR: &str = "rootfs";
const TEMP_PREFIX: &str = ".tmp-";
const INDEX_VERSION: u32 = 1;
/// An index larger than this is refused (an entry is a few hundred bytes).
const MAX_INDEX_BYTES: u64 = 16 << 20;

/// When [`ImageStore::ensure`] asks the registry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PullPolicy {
    /// Mesos `cached: true` (its default): an image already in the store is used as it is.
    IfMissing,
    /// Mesos `cached: false`: the tag is looked up again (a pull that finds the same
    /// manifest downloads nothing).
    Always,
}

/// One image in the index.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct IndexEntry {
    pub manifest: String,
    pub config: String,
    /// Layer digests and media-type compression (`gzip` or `none`), in order.
    pub layers: Vec<IndexLayer>,
    /// Config plus layers, compressed, as the manifest declares.
    pub size: u64,
    /// Seconds since the epoch.
    pub pulled_at: u64,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct IndexLayer {
    pub digest: String,
    pub gzip: bool,
}

#[derive(Debug, Default, Serialize, Deserialize)]
struct IndexFile {
    version: u32,
    images: BTreeMap<String, IndexEntry>,
}

/// What the runtime needs from an image config (`config` section of the OCI image config).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ImageConfig {
    pub entrypoint: Vec<String>,
    pub cmd: Vec<String>,
    pub env: Vec<String>,
    pub working_dir: Option<String>,
    pub user: Option<String>,
}

/// A pulled and prepared image.
#[derive(Clone, Debug)]
pub struct Prepared {
    pub reference: String,
    pub manifest: Digest,
    /// The complete root file system (`rootfs/<manifest hex>`).
    pub rootfs: PathBuf,
    pub config: ImageConfig,
    /// Blobs this call downloaded (empty when everything was in the store).
    pub downloaded: Vec<Digest>,
}

/// What [`ImageStore::prune`] removed.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Pruned {
    pub references: Vec<String>,
    pub rootfs: usize,
    pub blobs: usize,
}

/// Why an image could not be made ready.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error(transparent)]
    Pull(#[from] PullError),
    #[error("image store: {0}")]
    Blob(#[from] BlobError),
    #[error("{reference}: layer {layer}: {source}")]
    Unpack {
        reference: String,
        layer: String,
        #[source]
        source: Box<UnpackError>,
    },
    #[error("{reference}: image config {digest}: {reason}")]
    Config {
        reference: String,
        digest: String,
        reason: String,
    },
    #[error("image index {}: {reason}", path.display())]
    IndexCorrupt { path: PathBuf, reason: String },
    #[error("image store: {op} {}: {source}", at.display())]
    Io {
        op: &'static str,
        at: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("image store: a preparing task failed: {0}")]
    Task(String),
}

impl StoreError {
    /// True when retrying later may succeed as it is (see [`PullError::is_transient`]; a
    /// store I/O failure such as a full disk is transient, a hostile layer or config is not).
    pub fn is_transient(&self) -> bool {
        match self {
            Self::Pull(err) => err.is_transient(),
            Self::Blob(_) | Self::Io { .. } | Self::Task(_) => true,
            Self::Unpack { source, .. } => matches!(**source, UnpackError::Io { .. }),
            Self::Config { .. } | Self::IndexCorrupt { .. } => false,
        }
    }
}

/// The store of one directory; one per directory per process (open removes temp files).
#[derive(Debug)]
pub struct ImageStore {
    dir: PathBuf,
    blobs: Arc<BlobStore>,
    puller: Puller,
    limits: Limits,
    index: Mutex<IndexFile>,
    /// One ensure or prune at a time: a prune must never remove what an ensure is about to
    /// use, and two ensures of one image must not build its rootfs twice.
    busy: tokio::sync::Mutex<()>,
}

fn io_err<'a>(op: &'static str, at: &'a Path) -> impl FnOnce(io::Error) -> StoreError + 'a {
    move |source| StoreError::Io {
        op,
        at: at.to_path_buf(),
        source,
    }
}

impl ImageStore {
    /// Opens (creating) the store in `dir`, removing what a crash left half-done.
    pub fn open(dir: &Path, puller: Puller) -> Result<Self, StoreError> {
        let blobs = Arc::new(BlobStore::open(dir)?);
        let rootfs = dir.join(ROOTFS_DIR);
        {
            use std::os::unix::fs::DirBuilderExt;
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(&rootfs)
                .map_err(io_err("mkdir", &rootfs))?;
        }
        for entry in std::fs::read_dir(&rootfs).map_err(io_err("list", &rootfs))? {
            let entry = entry.map_err(io_err("list", &rootfs))?;
            if entry.file_name().to_string_lossy().starts_with(TEMP_PREFIX) {
                let path = entry.path();
                remove_tree(&path)?;
                tracing::info!(path = %path.display(), "partial root file system left by a crash removed");
            }
        }
        for entry in std::fs::read_dir(dir).map_err(io_err("list", dir))? {
            let entry = entry.map_err(io_err("list", dir))?;
            if entry.file_name().to_string_lossy().starts_with(TEMP_PREFIX) {
                std::fs::remove_file(entry.path()).map_err(io_err("remove", &entry.path()))?;
            }
        }
        let index = read_index(&dir.join(INDEX_FILE))?;
        Ok(Self {
            dir: dir.to_path_buf(),
            blobs,
            puller,
            limits: Limits::default(),
            index: Mutex::new(index),
            busy: tokio::sync::Mutex::new(()),
        })
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Resolves an image name against the daemon's default registry.
    pub fn resolve(&self, name: &str) -> Result<ImageRef, super::reference::ReferenceError> {
        ImageRef::parse(name, &self.puller.settings().default_registry)
    }

    pub fn blobs(&self) -> &Arc<BlobStore> {
        &self.blobs
    }

    /// The pulls in flight and their bytes per blob (never waits for a pull).
    pub fn pulls(&self) -> Vec<super::progress::PullSnapshot> {
        self.puller.progress().snapshot()
    }

    /// The images in the index.
    pub fn list(&self) -> BTreeMap<String, IndexEntry> {
        self.lock_index().images.clone()
    }

    fn lock_index(&self) -> std::sync::MutexGuard<'_, IndexFile> {
        // A panic while holding it cannot leave it half-updated (entries are replaced whole).
        self.index
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Where a prepared rootfs of `manifest` is.
    pub fn rootfs_path(&self, manifest: &Digest) -> PathBuf {
        self.dir.join(ROOTFS_DIR).join(manifest.hex())
    }

    /// Makes `reference` ready: pulled (per `policy`), its rootfs prepared, its config read.
    pub async fn ensure(
        &self,
        reference: &ImageRef,
        policy: PullPolicy,
    ) -> Result<Prepared, StoreError> {
        let _busy = self.busy.lock().await;
        let key = reference.to_string();
        let known = self.lock_index().images.get(&key).cloned();
        // A digest-pinned reference never changes; a tag is re-checked only when asked.
        let use_local = policy == PullPolicy::IfMissing || reference.digest().is_some();
        let local = match known {
            Some(entry) if use_local => self.usable(&key, &entry)?,
            _ => None,
        };
        let (entry, downloaded) = match local {
            Some(entry) => (entry, Vec::new()),
            None => {
                let pulled = self.puller.pull(reference, &self.blobs).await?;
                let entry = IndexEntry {
                    manifest: pulled.manifest.to_string(),
                    config: pulled.config.digest.to_string(),
                    size: pulled.size(),
                    layers: pulled
                        .layers
                        .iter()
                        .map(|l| IndexLayer {
                            digest: l.blob.digest.to_string(),
                            gzip: l.compression == Compression::Gzip,
                        })
                        .collect(),
                    pulled_at: now_secs(),
                };
                (entry, pulled.downloaded)
            }
        };
        let mut prepared = self
            .prepare_and_record(vec![(key, entry, downloaded)])
            .await?;
        prepared
            .pop()
            .ok_or_else(|| StoreError::Task("nothing prepared".to_owned()))
    }

    /// Waits for the store's one-at-a-time lock (see `busy`); the import holds it while it
    /// checks, prepares, records and cleans up.
    pub(super) async fn lock_busy(&self) -> tokio::sync::MutexGuard<'_, ()> {
        self.busy.lock().await
    }

    /// The one path by which an image whose blobs are all in the store becomes usable, shared
    /// by pull ([`ImageStore::ensure`]) and import: each image's rootfs prepared (unless
    /// already complete) and its config read and checked, then every entry that changed
    /// written to the index in one durable rewrite, so either all of them are indexed or
    /// none. The caller holds the busy lock.
    pub(super) async fn prepare_and_record(
        &self,
        images: Vec<(String, IndexEntry, Vec<Digest>)>,
    ) -> Result<Vec<Prepared>, StoreError> {
        let mut prepared = Vec::with_capacity(images.len());
        let mut entries = Vec::with_capacity(images.len());
        for (key, entry, downloaded) in images {
            let manifest = parse_digest(&self.index_path(), &entry.manifest)?;
            let rootfs = self.rootfs_path(&manifest);
            if !rootfs.is_dir() {
                let store = BlobsAndDir {
                    blobs: Arc::clone(&self.blobs),
                    dir: self.dir.clone(),
                    limits: self.limits.clone(),
                };
                let (key2, entry2, manifest2) = (key.clone(), entry.clone(), manifest.clone());
                tokio::task::spawn_blocking(move || store.prepare(&key2, &entry2, &manifest2))
                    .await
                    .map_err(|err| StoreError::Task(err.to_string()))??;
            }
            let config = self.read_config(&key, &entry)?;
            prepared.push(Prepared {
                reference: key.clone(),
                manifest,
                rootfs,
                config,
                downloaded,
            });
            entries.push((key, entry));
        }
        let changed: Vec<(String, IndexEntry)> = {
            let index = self.lock_index();
            entries
                .into_iter()
                .filter(|(key, entry)| index.images.get(key) != Some(entry))
                .collect()
        };
        if !changed.is_empty() {
            self.write_index_with(|index| {
                for (key, entry) in changed {
                    index.images.insert(key, entry);
                }
            })?;
        }
        Ok(prepared)
    }

    /// The pull limits, which bound an import's manifests, configs and layer counts too.
    pub(super) fn pull_limits(&self) -> &super::pull::PullLimits {
        self.puller.limits()
    }

    /// Removes those of `candidates` that no index entry names (blobs an import stored and
    /// then did not use, or used by nothing because it failed). The caller holds the busy
    /// lock, so no pull or import is between storing a blob and indexing it.
    pub(super) fn remove_unreferenced(&self, candidates: &[Digest]) -> Result<usize, StoreError> {
        let path = self.index_path();
        let mut keep = BTreeSet::new();
        for entry in self.lock_index().images.values() {
            keep.insert(parse_digest(&path, &entry.config)?);
            for layer in &entry.layers {
                keep.insert(parse_digest(&path, &layer.digest)?);
            }
        }
        let mut removed = 0;
        for digest in candidates {
            if !keep.contains(digest) {
                self.blobs.remove(digest)?;
                removed += 1;
            }
        }
        Ok(removed)
    }

    /// The entry when everything it needs is still in the store (blobs for a rootfs not yet
    /// prepared); `None` means pull again.
    fn usable(&self, _key: &str, entry: &IndexEntry) -> Result<Option<IndexEntry>, StoreError> {
        let path = self.index_path();
        let config = parse_digest(&path, &entry.config)?;
        if !self.blobs.contains(&config)? {
            return Ok(None);
        }
        let manifest = parse_digest(&path, &entry.manifest)?;
        if self.rootfs_path(&manifest).is_dir() {
            return Ok(Some(entry.clone()));
        }
        for layer in &entry.layers {
            if !self.blobs.contains(&parse_digest(&path, &layer.digest)?)? {
                return Ok(None);
            }
        }
        Ok(Some(entry.clone()))
    }

    fn read_config(&self, key: &str, entry: &IndexEntry) -> Result<ImageConfig, StoreError> {
        let digest = parse_digest(&self.index_path(), &entry.config)?;
        let bad = |reason: String| StoreError::Config {
            reference: key.to_owned(),
            digest: digest.to_string(),
            reason,
        };
        let max = self.puller.limits().max_config_bytes;
        let mut text = Vec::new();
        self.blobs
            .open_blob(&digest)?
            .take(max + 1)
            .read_to_end(&mut text)
            .map_err(|err| bad(err.to_string()))?;
        if text.len() as u64 > max {
            return Err(bad(format!("larger than {max} bytes")));
        }
        let parsed: oci_spec::image::ImageConfiguration =
            serde_json::from_slice(&text).map_err(|err| bad(err.to_string()))?;
        let config = parsed.config().clone().unwrap_or_default();
        let image = ImageConfig {
            entrypoint: config.entrypoint().clone().unwrap_or_default(),
            cmd: config.cmd().clone().unwrap_or_default(),
            env: config.env().clone().unwrap_or_default(),
            working_dir: config.working_dir().clone().filter(|w| !w.is_empty()),
            user: config.user().clone().filter(|u| !u.is_empty()),
        };
        if let Some(dir) = &image.working_dir
            && !dir.starts_with('/')
        {
            return Err(bad(format!("WorkingDir {dir:?} is not absolute")));
        }
        if image
            .env
            .iter()
            .chain(&image.entrypoint)
            .chain(&image.cmd)
            .any(|s| s.contains('\0'))
        {
            return Err(bad("a NUL byte in Env, Entrypoint or Cmd".to_owned()));
        }
        Ok(image)
    }

    /// Removes every image whose reference is not in `used`, the rootfs dirs no remaining
    /// image has, and the blobs no remaining image names.
    pub async fn prune(&self, used: &BTreeSet<String>) -> Result<Pruned, StoreError> {
        let _busy = self.busy.lock().await;
        let path = self.index_path();
        let mut pruned = Pruned::default();
        let removed: Vec<String> = self
            .lock_index()
            .images
            .keys()
            .filter(|k| !used.contains(*k))
            .cloned()
            .collect();
        if !removed.is_empty() {
            self.write_index_with(|index| {
                for key in &removed {
                    index.images.remove(key);
                }
            })?;
        }
        pruned.references = removed;
        let (mut keep_rootfs, mut keep_blobs) = (BTreeSet::new(), BTreeSet::new());
        for entry in self.lock_index().images.values() {
            keep_rootfs.insert(parse_digest(&path, &entry.manifest)?.hex().to_owned());
            keep_blobs.insert(parse_digest(&path, &entry.config)?);
            for layer in &entry.layers {
                keep_blobs.insert(parse_digest(&path, &layer.digest)?);
            }
        }
        let rootfs_dir = self.dir.join(ROOTFS_DIR);
        for dir_entry in std::fs::read_dir(&rootfs_dir).map_err(io_err("list", &rootfs_dir))? {
            let dir_entry = dir_entry.map_err(io_err("list", &rootfs_dir))?;
            let name = dir_entry.file_name().to_string_lossy().into_owned();
            // Only names this store makes: a digest's hex (temp dirs are open's to remove).
            if Digest::parse(&format!("sha256:{name}")).is_ok() && !keep_rootfs.contains(&name) {
                remove_tree(&dir_entry.path())?;
                pruned.rootfs += 1;
            }
        }
        for digest in self.blobs.list()? {
            if !keep_blobs.contains(&digest) {
                self.blobs.remove(&digest)?;
                pruned.blobs += 1;
            }
        }
        Ok(pruned)
    }

    fn index_path(&self) -> PathBuf {
        self.dir.join(INDEX_FILE)
    }

    /// Applies `change` to a copy of the index, writes it durably, then makes it current.
    fn write_index_with(&self, change: impl FnOnce(&mut IndexFile)) -> Result<(), StoreError> {
        let mut copy = IndexFile {
            version: INDEX_VERSION,
            images: self.lock_index().images.clone(),
        };
        change(&mut copy);
        write_atomically(
            &self.dir,
            INDEX_FILE,
            &serde_json::to_vec_pretty(&copy).unwrap_or_default(),
        )?;
        *self.lock_index() = copy;
        Ok(())
    }
}

/// What the blocking rootfs preparation needs (owned, for `spawn_blocking`).
struct BlobsAndDir {
    blobs: Arc<BlobStore>,
    dir: PathBuf,
    limits: Limits,
}

impl BlobsAndDir {
    /// Applies the layers in order into a temp dir, syncs it, renames it into place.
    fn prepare(&self, key: &str, entry: &IndexEntry, manifest: &Digest) -> Result<(), StoreError> {
        use std::os::unix::fs::DirBuilderExt;
        let index_path = self.dir.join(INDEX_FILE);
        let parent = self.dir.join(ROOTFS_DIR);
        let temp = parent.join(format!(
            "{TEMP_PREFIX}{}-{:016x}",
            manifest.hex(),
            rand::random::<u64>()
        ));
        std::fs::DirBuilder::new()
            .mode(0o755)
            .create(&temp)
            .map_err(io_err("mkdir", &temp))?;
        let result = (|| {
            for layer in &entry.layers {
                let digest = parse_digest(&index_path, &layer.digest)?;
                let blob = self.blobs.open_blob(&digest)?;
                let compression = if layer.gzip {
                    Compression::Gzip
                } else {
                    Compression::None
                };
                unpack::apply_layer(&temp, io::BufReader::new(blob), compression, &self.limits)
                    .map_err(|source| StoreError::Unpack {
                        reference: key.to_owned(),
                        layer: digest.to_string(),
                        source: Box::new(source),
                    })?;
            }
            // Everything written reaches the disk before the name says it is complete.
            let fd = std::fs::File::open(&temp).map_err(io_err("open", &temp))?;
            rustix::fs::syncfs(&fd).map_err(|e| StoreError::Io {
                op: "syncfs",
                at: temp.clone(),
                source: e.into(),
            })?;
            let target = parent.join(manifest.hex());
            match rustix::fs::renameat_with(
                rustix::fs::CWD,
                &temp,
                rustix::fs::CWD,
                &target,
                rustix::fs::RenameFlags::NOREPLACE,
            ) {
                // Another process's complete copy: as good as ours.
                Ok(()) | Err(rustix::io::Errno::EXIST) => {}
                Err(e) => {
                    return Err(StoreError::Io {
                        op: "rename",
                        at: target,
                        source: e.into(),
                    });
                }
            }
            fsync_dir(&parent)
        })();
        if temp.exists() {
            // Failed or lost the race: never leave a partial tree (open would remove it too).
            if let Err(err) = remove_tree(&temp) {
                tracing::warn!(path = %temp.display(), %err, "partial root file system not removed");
            }
        }
        result
    }
}

/// Seconds since the epoch (0 if the clock is before it).
pub(super) fn now_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

fn parse_digest(index: &Path, text: &str) -> Result<Digest, StoreError> {
    Digest::parse(text).map_err(|err| StoreError::IndexCorrupt {
        path: index.to_path_buf(),
        reason: err.to_string(),
    })
}

fn read_index(path: &Path) -> Result<IndexFile, StoreError> {
    let file = match std::fs::File::open(path) {
        Ok(file) => file,
        Err(err) if err.kind() == io::ErrorKind::NotFound => {
            return Ok(IndexFile {
                version: INDEX_VERSION,
                images: BTreeMap::new(),
            });
        }
        Err(err) => return Err(io_err("open", path)(err)),
    };
    let corrupt = |reason: String| StoreError::IndexCorrupt {
        path: path.to_path_buf(),
        reason,
    };
    let mut text = Vec::new();
    file.take(MAX_INDEX_BYTES + 1)
        .read_to_end(&mut text)
        .map_err(io_err("read", path))?;
    if text.len() as u64 > MAX_INDEX_BYTES {
        return Err(corrupt(format!("larger than {MAX_INDEX_BYTES} bytes")));
    }
    let index: IndexFile = serde_json::from_slice(&text).map_err(|e| corrupt(e.to_string()))?;
    if index.version != INDEX_VERSION {
        return Err(corrupt(format!("unknown version {}", index.version)));
    }
    for entry in index.images.values() {
        parse_digest(path, &entry.manifest)?;
        parse_digest(path, &entry.config)?;
        for layer in &entry.layers {
            parse_digest(path, &layer.digest)?;
        }
    }
    Ok(index)
}

/// Temp file in `dir`, fsync, rename over `name`, fsync `dir`.
fn write_atomically(dir: &Path, name: &str, bytes: &[u8]) -> Result<(), StoreError> {
    let temp = dir.join(format!(
        "{TEMP_PREFIX}{name}-{:016x}",
        rand::random::<u64>()
    ));
    let result = (|| {
        let mut file = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&temp)
            .map_err(io_err("create", &temp))?;
        file.write_all(bytes).map_err(io_err("write", &temp))?;
        file.sync_all().map_err(io_err("fsync", &temp))?;
        let target = dir.join(name);
        std::fs::rename(&temp, &target).map_err(io_err("rename", &target))?;
        fsync_dir(dir)
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&temp);
    }
    result
}

fn fsync_dir(dir: &Path) -> Result<(), StoreError> {
    std::fs::File::open(dir)
        .and_then(|f| f.sync_all())
        .map_err(io_err("fsync", dir))
}

/// Removes a tree the store made, without following symlinks in it (`remove_dir_all` does not
/// follow them).
fn remove_tree(path: &Path) -> Result<(), StoreError> {
    match std::fs::remove_dir_all(path) {
        Ok(()) => Ok(()),
        Err(err) if err.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(err) => Err(io_err("remove", path)(err)),
    }
}
