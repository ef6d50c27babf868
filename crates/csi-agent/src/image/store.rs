//! The image store: pulled images, their prepared root file systems, and garbage collection,
//! all under one directory the caller gives (the daemon uses `<work_dir>/images`).
//!
//! Layout (docs/operations.md, "Image store"):
//! - `blobs/sha256/<hex>`: the [`BlobStore`], shared by every image;
//! - `index.json`: reference → manifest digest, config digest, layers, size, pulled at;
//!   rewritten whole, atomically (temp file, fsync, rename, directory fsync);
//! - [`Composition::Overlay`] (where the host can, [`Composition::detect`]):
//!   `layers/<chain hex>/`, each layer unpacked once, on its own, in the overlay form
//!   ([`unpack::apply_overlay_layer`]), shared by every image that has the same layers
//!   below it and stacked by [`super::overlay`] under each container's own upper dir. The
//!   name is the layer's chain id, as Docker's overlay2 keys its layers: the first layer's
//!   digest, then `sha256(<chain id below> + " " + <layer digest>)` (of the compressed blob
//!   digests), because a layer's directory depends on the layers below it (inherited
//!   directory modes, hard links copied up);
//! - [`Composition::Flattened`] (the fallback): `rootfs/<manifest hex>/`, the image's layers
//!   applied in order into one tree, shared read-only by every container of the image.
//!
//! Either is built in a `.tmp-<hex>-<random>/` dir beside its final name, the file system
//! synced, and renamed into place only when complete. So a SIGKILL at any point leaves at
//! worst temp files and temp dirs (names starting with `.`, never a digest), an index that is
//! the old or the new one, and possibly blobs, complete layers or rootfs the index does not
//! name: [`ImageStore::open`] removes all of these (the start-up sweep).
//!
//! Nothing unindexed outlives its pull (issue #23): an [`ImageStore::ensure`] that fails (its
//! pull, its unpacking, its config) or is abandoned removes the blobs its pull stored and the
//! layer or rootfs dirs prepared for it, unless an indexed image names them. A pull holds
//! each blob ([`super::blobs::BlobHolds`]) from before it looks for it until the ensure ends,
//! so neither this cleanup nor a prune removes a blob another pull or import is fetching or
//! about to index.
//!
//! ## Locking: a pull blocks nobody (issue #23)
//! No lock is held across the network. The store-wide `busy` lock is taken only for local
//! work: checking the index for a cached image, preparing (unpacking) and indexing, a prune,
//! an import's check-prepare-record, and the removal of the `layers/`/`rootfs/` dirs a failed
//! ensure prepared. So the prepared dirs are only ever created, indexed or removed under it,
//! and a blob a pull is fetching is protected by its hold instead. A cached image
//! ([`PullPolicy::IfMissing`] or a digest) is checked and made ready under `busy` alone, so
//! another plugin's slow or stuck pull never delays it (a registry trickling bytes is cut by
//! [`super::pull::PullLimits::min_bytes_per_sec`]). Two ensures that must pull the same
//! reference are serialized by a per-reference lock (the second then usually finds it cached
//! instead of downloading it again); it is never taken on the cached path.
//!
//! It owns when to pull (Mesos `cached` semantics), the index, the rootfs dirs and which blobs
//! are garbage. It must not decide which images are in use (the caller says, from the plugin
//! configs), nor run containers. Everything read back from disk is checked: index digests are
//! parsed with [`Digest::parse`] before they name a file or directory, the index and the
//! image config are read with a size bound, and the config is parsed as hostile JSON.

use std::collections::{BTreeMap, BTreeSet};
use std::io::{self, Read};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

use crate::durable::{self, IoError, io_err};

use super::blobs::{BlobError, BlobStore, Digest};
use super::budget::{Budget, ImageLimits};
use super::pull::{PullError, Puller};
use super::reference::ImageRef;
use super::unpack::{self, Compression, Limits, UnpackError};

/// The index's file name.
pub const INDEX_FILE: &str = "index.json";
/// The directory of prepared (flattened) root file systems.
pub const ROOTFS_DIR: &str = "rootfs";
/// The directory of unpacked layers (overlay form).
pub const LAYERS_DIR: &str = "layers";

/// How the store makes an image's root file system.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Composition {
    /// Each layer unpacked once into `layers/`; a container's root is an overlay of them.
    Overlay,
    /// The layers applied into one `rootfs/<manifest>/` tree per image.
    Flattened,
}

impl Composition {
    /// Overlay when [`super::overlay::probe`] succeeds in `dir` (created if missing), else
    /// flattened, with the probe's reason.
    pub fn detect(dir: &Path) -> (Self, Option<String>) {
        if let Err(err) = std::fs::create_dir_all(dir) {
            return (
                Self::Flattened,
                Some(format!("mkdir {}: {err}", dir.display())),
            );
        }
        match super::overlay::probe(dir) {
            Ok(()) => (Self::Overlay, None),
            Err(reason) => (Self::Flattened, Some(reason.to_string())),
        }
    }
}
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

impl IndexLayer {
    fn compression(&self) -> Compression {
        if self.gzip {
            Compression::Gzip
        } else {
            Compression::None
        }
    }
}

/// A layer's refusal, naming the image and the layer.
fn unpack_err<'a>(
    reference: &'a str,
    layer: &'a Digest,
) -> impl FnOnce(UnpackError) -> ImageStoreError + 'a {
    move |source| ImageStoreError::Unpack {
        reference: reference.to_owned(),
        layer: layer.to_string(),
        source: Box::new(source),
    }
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

/// Where a prepared image's root file system is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PreparedRoot {
    /// The complete tree (`rootfs/<manifest hex>`), to be used read-only.
    Flattened(PathBuf),
    /// The layer directories (`layers/<chain hex>`), bottom first, to be stacked with
    /// [`super::overlay::mount`].
    Layers(Vec<PathBuf>),
}

/// A pulled and prepared image.
#[derive(Clone, Debug)]
pub struct Prepared {
    pub reference: String,
    pub manifest: Digest,
    pub root: PreparedRoot,
    pub config: ImageConfig,
    /// Blobs this call downloaded (empty when everything was in the store).
    pub downloaded: Vec<Digest>,
}

impl Prepared {
    /// The flattened tree, when the store made one.
    pub fn flattened(&self) -> Option<&Path> {
        match &self.root {
            PreparedRoot::Flattened(path) => Some(path),
            PreparedRoot::Layers(_) => None,
        }
    }
}

/// What [`ImageStore::prune`] removed.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Pruned {
    pub references: Vec<String>,
    pub rootfs: usize,
    pub layers: usize,
    pub blobs: usize,
}

/// Why an image could not be made ready.
#[derive(Debug, thiserror::Error)]
pub enum ImageStoreError {
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
    #[error("image store: {0}")]
    Io(#[from] IoError),
    #[error("image store: a preparing task failed: {0}")]
    Task(String),
}

impl ImageStoreError {
    /// True when retrying later may succeed as it is (see [`PullError::is_transient`]; a
    /// store I/O failure such as a full disk is transient, a hostile layer or config is not).
    pub fn is_transient(&self) -> bool {
        match self {
            Self::Pull(err) => err.is_transient(),
            Self::Blob(_) | Self::Io(_) | Self::Task(_) => true,
            Self::Unpack { source, .. } => source.is_transient(),
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
    /// Caps on each image's unpacked bytes and inodes, and the store's quota.
    image_limits: ImageLimits,
    /// Given to [`ImageStore::open`], or detected by the first image prepared (the probe
    /// mounts, which a daemon that never runs an image need not do).
    composition: std::sync::OnceLock<Composition>,
    index: Mutex<IndexFile>,
    /// Local work only, never the network (module doc, "Locking"): checking the index for a
    /// cached image, preparing and indexing, a prune, an import, a failed ensure's cleanup of
    /// its prepared dirs. A prune must never remove what an ensure is about to use, and two
    /// ensures of one image must not build its rootfs twice.
    busy: tokio::sync::Mutex<()>,
    /// One pull per reference at a time (module doc); entries go when no ensure uses them.
    pulling: Mutex<BTreeMap<String, Arc<tokio::sync::Mutex<()>>>>,
}

/// What the index names (see [`ImageStore::kept`]).
#[derive(Default)]
struct Kept {
    rootfs: BTreeSet<String>,
    layers: BTreeSet<String>,
    blobs: BTreeSet<Digest>,
}

/// Removes, when dropped unless the ensure succeeded, what its pull stored and prepared
/// ([`ImageStore::remove_failed`]); a dropped (abandoned) ensure included.
///
/// `entry` (the prepared dirs to remove) is set only while `busy` holds the store's lock, so
/// those dirs are removed under it (dropped after `drop` runs); the blobs need no lock (their
/// holds protect another pull's).
struct FailedPullCleanup<'a> {
    store: &'a ImageStore,
    fetched: Arc<super::pull::Fetched>,
    entry: Option<IndexEntry>,
    busy: Option<tokio::sync::MutexGuard<'a, ()>>,
    succeeded: bool,
}

impl Drop for FailedPullCleanup<'_> {
    fn drop(&mut self) {
        let stored = self.fetched.release();
        if !self.succeeded {
            let entry = self.busy.as_ref().and(self.entry.as_ref());
            self.store.remove_failed(&stored, entry);
        }
    }
}

/// The per-reference pull lock of one ensure; forgets the reference when the last user goes.
struct PullingRef<'a> {
    store: &'a ImageStore,
    key: String,
    lock: Arc<tokio::sync::Mutex<()>>,
}

impl Drop for PullingRef<'_> {
    fn drop(&mut self) {
        let mut pulling = self
            .store
            .pulling
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        // The map's and ours: nobody else waits for it.
        if Arc::strong_count(&self.lock) <= 2 {
            pulling.remove(&self.key);
        }
    }
}

/// [`ImageStore::disk_bytes`] of the store at `dir`: one measure for the listing and the quota.
fn store_disk_bytes(dir: &Path) -> Result<u64, ImageStoreError> {
    Ok(super::budget::disk_usage(dir).map_err(io_err("measure", dir))?)
}

impl ImageStore {
    /// Opens (creating) the store in `dir`, removing what a crash left half-done. Images are
    /// prepared per `composition` from now on (`None`: [`Composition::detect`] when the
    /// first is); what the other form prepared earlier stays until [`ImageStore::prune`]
    /// finds no image needing it.
    pub fn open(
        dir: &Path,
        puller: Puller,
        composition: Option<Composition>,
    ) -> Result<Self, ImageStoreError> {
        let blobs = Arc::new(BlobStore::open(dir)?);
        for sub in [ROOTFS_DIR, LAYERS_DIR] {
            let prepared = dir.join(sub);
            {
                use std::os::unix::fs::DirBuilderExt;
                std::fs::DirBuilder::new()
                    .recursive(true)
                    .mode(0o700)
                    .create(&prepared)
                    .map_err(io_err("mkdir", &prepared))?;
            }
            for entry in std::fs::read_dir(&prepared).map_err(io_err("list", &prepared))? {
                let entry = entry.map_err(io_err("list", &prepared))?;
                if entry
                    .file_name()
                    .to_string_lossy()
                    .starts_with(durable::TEMP_PREFIX)
                {
                    let path = entry.path();
                    remove_tree(&path)?;
                    tracing::info!(path = %path.display(), "partial root file system or layer left by a crash removed");
                }
            }
        }
        for entry in std::fs::read_dir(dir).map_err(io_err("list", dir))? {
            let entry = entry.map_err(io_err("list", dir))?;
            if entry
                .file_name()
                .to_string_lossy()
                .starts_with(durable::TEMP_PREFIX)
            {
                // Temp index files; and an overlay probe's dir a crash left.
                let path = entry.path();
                if entry.file_type().is_ok_and(|t| t.is_dir()) {
                    remove_tree(&path)?;
                } else {
                    std::fs::remove_file(&path).map_err(io_err("remove", &path))?;
                }
            }
        }
        let index = read_index(&dir.join(INDEX_FILE))?;
        let store = Self {
            dir: dir.to_path_buf(),
            blobs,
            puller,
            limits: Limits::default(),
            image_limits: ImageLimits::default(),
            composition: composition.map_or_else(std::sync::OnceLock::new, |c| {
                let cell = std::sync::OnceLock::new();
                let _ = cell.set(c);
                cell
            }),
            index: Mutex::new(index),
            busy: tokio::sync::Mutex::new(()),
            pulling: Mutex::new(BTreeMap::new()),
        };
        // Nothing runs yet: whatever the index does not name is what a crash mid-pull (or
        // mid-prepare) left, and nothing will ever use it.
        let swept = store.remove_unindexed()?;
        if swept != Pruned::default() {
            tracing::info!(
                blobs = swept.blobs,
                layers = swept.layers,
                rootfs = swept.rootfs,
                "image store: unindexed leftovers of an interrupted pull removed at start"
            );
        }
        Ok(store)
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Sets the per-image caps and the store's quota (`--image-max-unpacked-bytes`,
    /// `--image-max-inodes`, `--image-store-max-bytes`).
    pub fn with_image_limits(mut self, limits: ImageLimits) -> Self {
        self.image_limits = limits;
        self
    }

    pub fn image_limits(&self) -> &ImageLimits {
        &self.image_limits
    }

    /// How images are prepared (detected now if it was not given and is not known yet).
    pub fn composition(&self) -> Composition {
        *self.composition.get_or_init(|| {
            let (composition, reason) = Composition::detect(&self.dir);
            match reason {
                None => tracing::info!(dir = %self.dir.display(), "image layers are unpacked once each and stacked with overlayfs"),
                Some(reason) => tracing::warn!(dir = %self.dir.display(), %reason, "overlayfs is not usable here; each image is unpacked into a flattened root file system"),
            }
            composition
        })
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

    /// Where the unpacked layers of `entry` are, bottom first (see [`chain_ids`]).
    fn layer_paths(&self, entry: &IndexEntry) -> Result<Vec<PathBuf>, ImageStoreError> {
        let digests = layer_digests(&self.index_path(), entry)?;
        Ok(chain_ids(&digests)
            .iter()
            .map(|chain| self.dir.join(LAYERS_DIR).join(chain.hex()))
            .collect())
    }

    /// The prepared root of `entry` in this store's composition, when complete.
    fn prepared_root(&self, entry: &IndexEntry) -> Result<Option<PreparedRoot>, ImageStoreError> {
        Ok(match self.composition() {
            Composition::Flattened => {
                let manifest = parse_digest(&self.index_path(), &entry.manifest)?;
                let rootfs = self.rootfs_path(&manifest);
                rootfs.is_dir().then_some(PreparedRoot::Flattened(rootfs))
            }
            Composition::Overlay => {
                let layers = self.layer_paths(entry)?;
                layers
                    .iter()
                    .all(|layer| layer.is_dir())
                    .then_some(PreparedRoot::Layers(layers))
            }
        })
    }

    /// Makes `reference` ready: pulled (per `policy`), its rootfs prepared, its config read.
    ///
    /// Holds the store's lock only for local work (module doc, "Locking"): a cached image is
    /// ready without waiting for any pull, and a pull waits only for another pull of the same
    /// reference, never holding the store's lock while it talks to the registry.
    pub async fn ensure(
        &self,
        reference: &ImageRef,
        policy: PullPolicy,
    ) -> Result<Prepared, ImageStoreError> {
        // Dropped last: what a failed (or abandoned) ensure stored is removed (its prepared
        // dirs only while it holds the store's lock).
        let mut cleanup = FailedPullCleanup {
            store: self,
            fetched: super::pull::Fetched::new(&self.blobs),
            entry: None,
            busy: None,
            succeeded: false,
        };
        let key = reference.to_string();
        // A digest-pinned reference never changes; a tag is re-checked only when asked.
        let use_local = policy == PullPolicy::IfMissing || reference.digest().is_some();
        if use_local && self.cached(&key, &mut cleanup).await? {
            return self.record_one(key, Vec::new(), cleanup).await;
        }
        let pulling = self.pulling_ref(&key);
        let _pulling = pulling.lock.lock().await;
        // Another ensure of this reference may have pulled it while this one waited.
        if use_local && self.cached(&key, &mut cleanup).await? {
            return self.record_one(key, Vec::new(), cleanup).await;
        }
        // No store lock here: a slow registry delays this reference only.
        let pulled = self
            .puller
            .pull_into(reference, &self.blobs, &cleanup.fetched)
            .await?;
        cleanup.entry = Some(IndexEntry {
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
        });
        cleanup.busy = Some(self.busy.lock().await);
        self.record_one(key, pulled.downloaded, cleanup).await
    }

    /// Takes the store's lock and checks whether `key` can be made ready from what the store
    /// has: if so, true, with the lock and the entry kept in `cleanup` until the ensure ends;
    /// if not, false, the lock released.
    async fn cached<'a>(
        &'a self,
        key: &str,
        cleanup: &mut FailedPullCleanup<'a>,
    ) -> Result<bool, ImageStoreError> {
        let busy = self.busy.lock().await;
        let known = self.lock_index().images.get(key).cloned();
        let Some(entry) = known
            .map(|entry| self.usable(key, &entry))
            .transpose()?
            .flatten()
        else {
            return Ok(false);
        };
        cleanup.entry = Some(entry);
        cleanup.busy = Some(busy);
        Ok(true)
    }

    /// Prepares and indexes the image of `cleanup.entry` (`cleanup` holds the store's lock),
    /// marking the ensure succeeded.
    async fn record_one<'a>(
        &'a self,
        key: String,
        downloaded: Vec<Digest>,
        mut cleanup: FailedPullCleanup<'a>,
    ) -> Result<Prepared, ImageStoreError> {
        let entry = cleanup
            .entry
            .clone()
            .ok_or_else(|| ImageStoreError::Task(format!("{key}: nothing to prepare")))?;
        let mut prepared = self
            .prepare_and_record(vec![(key, entry, downloaded)])
            .await?;
        let prepared = prepared
            .pop()
            .ok_or_else(|| ImageStoreError::Task("nothing prepared".to_owned()))?;
        cleanup.succeeded = true;
        Ok(prepared)
    }

    /// The pull lock of `key` (shared with every ensure pulling it now).
    fn pulling_ref(&self, key: &str) -> PullingRef<'_> {
        let lock = Arc::clone(
            self.pulling
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .entry(key.to_owned())
                .or_default(),
        );
        PullingRef {
            store: self,
            key: key.to_owned(),
            lock,
        }
    }

    /// After a failed ensure: removes the blobs the pull stored and (when given: the caller
    /// then holds the busy lock) the layer and rootfs dirs prepared for `entry`, each unless an
    /// indexed image names it (or, for a blob, another pull or import holds it).
    fn remove_failed(&self, stored: &[Digest], entry: Option<&IndexEntry>) {
        let kept = match self.kept() {
            Ok(kept) => kept,
            Err(err) => {
                tracing::warn!(error = %err, "after a failed pull: cannot read the index; what it stored stays until the next start or prune");
                return;
            }
        };
        let mut removed = 0usize;
        for digest in stored {
            if kept.blobs.contains(digest) {
                continue;
            }
            match self.blobs.remove(digest) {
                Ok(true) => removed += 1,
                Ok(false) => {}
                Err(err) => {
                    tracing::warn!(blob = %digest, error = %err, "after a failed pull: cannot remove a blob it stored")
                }
            }
        }
        if let Some(entry) = entry {
            let path = self.index_path();
            let mut dirs = Vec::new();
            if let Ok(manifest) = parse_digest(&path, &entry.manifest)
                && !kept.rootfs.contains(manifest.hex())
            {
                dirs.push(self.rootfs_path(&manifest));
            }
            if let Ok(layers) = layer_digests(&path, entry) {
                for chain in chain_ids(&layers) {
                    if !kept.layers.contains(chain.hex()) {
                        dirs.push(self.dir.join(LAYERS_DIR).join(chain.hex()));
                    }
                }
            }
            for dir in dirs.iter().filter(|d| d.exists()) {
                match remove_tree(dir) {
                    Ok(()) => removed += 1,
                    Err(err) => {
                        tracing::warn!(error = %err, "after a failed pull: cannot remove what it prepared")
                    }
                }
            }
        }
        if removed > 0 {
            tracing::info!(
                removed,
                "a failed pull's blobs and prepared dirs removed (no indexed image names them)"
            );
        }
    }

    /// What the index names: rootfs and layer dir names, blobs.
    fn kept(&self) -> Result<Kept, ImageStoreError> {
        let path = self.index_path();
        let mut kept = Kept::default();
        for entry in self.lock_index().images.values() {
            kept.rootfs
                .insert(parse_digest(&path, &entry.manifest)?.hex().to_owned());
            kept.blobs.insert(parse_digest(&path, &entry.config)?);
            let layers = layer_digests(&path, entry)?;
            for chain in chain_ids(&layers) {
                kept.layers.insert(chain.hex().to_owned());
            }
            kept.blobs.extend(layers);
        }
        Ok(kept)
    }

    /// Removes the rootfs dirs, layer dirs and blobs the index does not name (blobs a pull
    /// or import holds excepted): the sweep at open and the second half of a prune.
    fn remove_unindexed(&self) -> Result<Pruned, ImageStoreError> {
        let kept = self.kept()?;
        let mut pruned = Pruned {
            rootfs: self.remove_unkept(ROOTFS_DIR, &kept.rootfs)?,
            layers: self.remove_unkept(LAYERS_DIR, &kept.layers)?,
            ..Pruned::default()
        };
        for digest in self.blobs.list()? {
            // A blob a pull or import holds is about to be indexed (or removed by it).
            if !kept.blobs.contains(&digest) && self.blobs.remove(&digest)? {
                pruned.blobs += 1;
            }
        }
        Ok(pruned)
    }

    /// The bytes of every blob in the store (the compressed images as pulled).
    pub fn blob_bytes(&self) -> Result<u64, ImageStoreError> {
        let mut total = 0u64;
        for digest in self.blobs.list()? {
            match self.blobs.size_of(&digest) {
                Ok(size) => total = total.saturating_add(size),
                // Removed between the listing and the stat.
                Err(BlobError::NotFound { .. }) => {}
                Err(err) => return Err(err.into()),
            }
        }
        Ok(total)
    }

    /// The store's size on disk: blobs, unpacked layers, root file systems and whatever a
    /// preparation in progress has written, in allocated blocks as `du` counts. The measure
    /// the quota (`--image-store-max-bytes`, [`ImageLimits::store_max_bytes`]) is checked
    /// against before an image is prepared. Takes no lock: a walk of the store's dir.
    pub fn disk_bytes(&self) -> Result<u64, ImageStoreError> {
        store_disk_bytes(&self.dir)
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
    ) -> Result<Vec<Prepared>, ImageStoreError> {
        let mut prepared = Vec::with_capacity(images.len());
        let mut entries = Vec::with_capacity(images.len());
        for (key, entry, downloaded) in images {
            let manifest = parse_digest(&self.index_path(), &entry.manifest)?;
            let root = match self.prepared_root(&entry)? {
                Some(root) => root,
                None => {
                    let store = BlobsAndDir {
                        blobs: Arc::clone(&self.blobs),
                        dir: self.dir.clone(),
                        limits: self.limits.clone(),
                        image_limits: self.image_limits.clone(),
                    };
                    let (key2, entry2, manifest2) = (key.clone(), entry.clone(), manifest.clone());
                    let composition = self.composition();
                    tokio::task::spawn_blocking(move || match composition {
                        Composition::Flattened => store.prepare(&key2, &entry2, &manifest2),
                        Composition::Overlay => store.prepare_layers(&key2, &entry2),
                    })
                    .await
                    .map_err(|err| ImageStoreError::Task(err.to_string()))??;
                    self.prepared_root(&entry)?.ok_or_else(|| {
                        ImageStoreError::Task(format!("{key}: prepared, then not found complete"))
                    })?
                }
            };
            let config = self.read_config(&key, &entry)?;
            prepared.push(Prepared {
                reference: key.clone(),
                manifest,
                root,
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

    /// Removes those of `candidates` that no index entry names and no other import holds
    /// (blobs an import stored and then did not use, or used by nothing because it failed).
    /// The caller holds the busy lock and has dropped its own [`super::blobs::BlobHolds`]; a
    /// pull between storing a blob and indexing it holds it, so it is not removed.
    pub(super) fn remove_unreferenced(
        &self,
        candidates: &[Digest],
    ) -> Result<usize, ImageStoreError> {
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
            // One another import holds (it found it present) is its to index or leave.
            if !keep.contains(digest) && self.blobs.remove(digest)? {
                removed += 1;
            }
        }
        Ok(removed)
    }

    /// The entry when everything it needs is still in the store (blobs for a rootfs not yet
    /// prepared); `None` means pull again.
    fn usable(
        &self,
        _key: &str,
        entry: &IndexEntry,
    ) -> Result<Option<IndexEntry>, ImageStoreError> {
        let path = self.index_path();
        let config = parse_digest(&path, &entry.config)?;
        if !self.blobs.contains(&config)? {
            return Ok(None);
        }
        if self.prepared_root(entry)?.is_some() {
            return Ok(Some(entry.clone()));
        }
        for layer in &entry.layers {
            if !self.blobs.contains(&parse_digest(&path, &layer.digest)?)? {
                return Ok(None);
            }
        }
        Ok(Some(entry.clone()))
    }

    fn read_config(&self, key: &str, entry: &IndexEntry) -> Result<ImageConfig, ImageStoreError> {
        let digest = parse_digest(&self.index_path(), &entry.config)?;
        let bad = |reason: String| ImageStoreError::Config {
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
    /// image has, and the blobs no remaining image names and no pull or import in progress
    /// holds (both store their blobs before they take the busy lock to index them).
    pub async fn prune(&self, used: &BTreeSet<String>) -> Result<Pruned, ImageStoreError> {
        let _busy = self.busy.lock().await;
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
        Ok(Pruned {
            references: removed,
            ..self.remove_unindexed()?
        })
    }

    /// Removes the dirs of `sub` whose names are digests' hex not in `keep` (temp dirs are
    /// open's to remove); how many.
    fn remove_unkept(&self, sub: &str, keep: &BTreeSet<String>) -> Result<usize, ImageStoreError> {
        let dir = self.dir.join(sub);
        let mut removed = 0;
        for dir_entry in std::fs::read_dir(&dir).map_err(io_err("list", &dir))? {
            let dir_entry = dir_entry.map_err(io_err("list", &dir))?;
            let name = dir_entry.file_name().to_string_lossy().into_owned();
            if Digest::parse(&format!("sha256:{name}")).is_ok() && !keep.contains(&name) {
                remove_tree(&dir_entry.path())?;
                removed += 1;
            }
        }
        Ok(removed)
    }

    fn index_path(&self) -> PathBuf {
        self.dir.join(INDEX_FILE)
    }

    /// Applies `change` to a copy of the index, writes it durably, then makes it current.
    fn write_index_with(&self, change: impl FnOnce(&mut IndexFile)) -> Result<(), ImageStoreError> {
        let mut copy = IndexFile {
            version: INDEX_VERSION,
            images: self.lock_index().images.clone(),
        };
        change(&mut copy);
        // 0o666 before the umask: the mode `File::create` gave the index before.
        durable::write_atomic(
            &durable::Dir::open(&self.dir)?,
            INDEX_FILE,
            &serde_json::to_vec_pretty(&copy).unwrap_or_default(),
            0o666,
            || Ok::<(), ImageStoreError>(()),
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
    image_limits: ImageLimits,
}

impl BlobsAndDir {
    /// The budget of one image's preparation: its caps, within what the store's quota
    /// leaves now (refused at once when nothing is left; `first` names the layer).
    fn budget(&self, key: &str, first: Option<&IndexLayer>) -> Result<Budget, ImageStoreError> {
        let used = store_disk_bytes(&self.dir)?;
        Budget::new(&self.image_limits, used).map_err(|exceeded| ImageStoreError::Unpack {
            reference: key.to_owned(),
            layer: first.map_or_else(String::new, |l| l.digest.clone()),
            source: Box::new(UnpackError::Limit {
                entry: "<image>".to_owned(),
                limit: exceeded.limit,
                max: exceeded.max,
            }),
        })
    }

    /// Applies the layers in order into a temp dir, syncs it, renames it into place.
    fn prepare(
        &self,
        key: &str,
        entry: &IndexEntry,
        manifest: &Digest,
    ) -> Result<(), ImageStoreError> {
        use std::os::unix::fs::DirBuilderExt;
        let index_path = self.dir.join(INDEX_FILE);
        let parent = self.dir.join(ROOTFS_DIR);
        let temp = parent.join(durable::temp_name(manifest.hex()));
        std::fs::DirBuilder::new()
            .mode(0o755)
            .create(&temp)
            .map_err(io_err("mkdir", &temp))?;
        let layers = distinct_layers(entry);
        let result = (|| {
            let budget = self.budget(key, layers.first())?;
            for layer in &layers {
                let digest = parse_digest(&index_path, &layer.digest)?;
                let blob = self.blobs.open_blob(&digest)?;
                unpack::apply_layer_within(
                    &temp,
                    io::BufReader::new(blob),
                    layer.compression(),
                    &self.limits,
                    &budget,
                )
                .map_err(unpack_err(key, &digest))?;
            }
            sync_and_rename(&temp, &parent.join(manifest.hex()))?;
            Ok(durable::sync_dir(&parent).map(drop)?)
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

impl BlobsAndDir {
    /// Unpacks each layer of `entry` not yet in `layers/` (overlay form), bottom first, each
    /// into a temp dir that is synced and renamed to its chain id only when complete.
    fn prepare_layers(&self, key: &str, entry: &IndexEntry) -> Result<(), ImageStoreError> {
        use std::os::unix::fs::DirBuilderExt;
        let index_path = self.dir.join(INDEX_FILE);
        let parent = self.dir.join(LAYERS_DIR);
        let digests = layer_digests(&index_path, entry)?;
        let chains = chain_ids(&digests);
        let layers = distinct_layers(entry);
        let budget = self.budget(key, layers.first())?;
        let mut below: Vec<PathBuf> = Vec::with_capacity(chains.len());
        // Layers this call completed: removed again if a later one is refused, since no
        // indexed image names them (the busy lock keeps other preparations out).
        let mut made: Vec<PathBuf> = Vec::new();
        for ((digest, chain), layer) in digests.iter().zip(&chains).zip(&layers) {
            let target = parent.join(chain.hex());
            if !target.is_dir() {
                let temp = parent.join(durable::temp_name(chain.hex()));
                std::fs::DirBuilder::new()
                    .mode(0o755)
                    .create(&temp)
                    .map_err(io_err("mkdir", &temp))?;
                let result = (|| {
                    let blob = self.blobs.open_blob(digest)?;
                    let lowers: Vec<PathBuf> = below.iter().rev().cloned().collect();
                    unpack::apply_overlay_layer_within(
                        &temp,
                        &lowers,
                        io::BufReader::new(blob),
                        layer.compression(),
                        &self.limits,
                        &budget,
                    )
                    .map_err(unpack_err(key, digest))?;
                    sync_and_rename(&temp, &target)?;
                    Ok(durable::sync_dir(&parent).map(drop)?)
                })();
                if temp.exists()
                    && let Err(err) = remove_tree(&temp)
                {
                    tracing::warn!(path = %temp.display(), %err, "partial layer not removed");
                }
                if let Err(err) = result {
                    for done in &made {
                        if let Err(err) = remove_tree(done) {
                            tracing::warn!(path = %done.display(), %err, "layer of a refused image not removed");
                        }
                    }
                    return Err(err);
                }
                made.push(target.clone());
            }
            below.push(target);
        }
        Ok(())
    }
}

/// Syncs the file system of `temp` (everything written reaches the disk before the name
/// says it is complete), then renames it to `target` unless a complete one is there.
fn sync_and_rename(temp: &Path, target: &Path) -> Result<(), ImageStoreError> {
    let fd = std::fs::File::open(temp).map_err(io_err("open", temp))?;
    rustix::fs::syncfs(&fd).map_err(io_err("syncfs", temp))?;
    match rustix::fs::renameat_with(
        rustix::fs::CWD,
        temp,
        rustix::fs::CWD,
        target,
        rustix::fs::RenameFlags::NOREPLACE,
    ) {
        // Another process's complete copy: as good as ours.
        Ok(()) | Err(rustix::io::Errno::EXIST) => Ok(()),
        Err(e) => Err(IoError::new("rename", target, e).into()),
    }
}

/// The layer digests of an index entry ([`distinct_layers`]), parsed.
fn layer_digests(index: &Path, entry: &IndexEntry) -> Result<Vec<Digest>, ImageStoreError> {
    distinct_layers(entry)
        .iter()
        .map(|layer| parse_digest(index, &layer.digest))
        .collect()
}

/// An entry's layers with each run of one layer repeated (the same blob listed twice in a
/// row) kept once: applying a layer again on top of itself changes nothing, so it is never
/// written twice (a gzip bomb listed eight times is unpacked, and refused, once). A layer
/// repeated with others between is applied again (what lies between may have changed what
/// it overrides), within the image's caps.
fn distinct_layers(entry: &IndexEntry) -> Vec<IndexLayer> {
    let mut layers = entry.layers.clone();
    layers.dedup_by(|a, b| a.digest == b.digest);
    layers
}

/// Each layer's chain id (module doc): the first layer's digest, then
/// `sha256(<chain id below> + " " + <digest>)`.
pub fn chain_ids(layers: &[Digest]) -> Vec<Digest> {
    use sha2::Digest as _;
    let mut chains: Vec<Digest> = Vec::with_capacity(layers.len());
    for layer in layers {
        let chain = match chains.last() {
            None => layer.clone(),
            Some(below) => {
                let hash = sha2::Sha256::digest(format!("{below} {layer}").as_bytes());
                let hex: String = hash.iter().map(|b| format!("{b:02x}")).collect();
                Digest::parse(&format!("sha256:{hex}")).unwrap_or_else(|_| layer.clone())
            }
        };
        chains.push(chain);
    }
    chains
}

/// Seconds since the epoch (0 if the clock is before it).
pub(super) fn now_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

fn parse_digest(index: &Path, text: &str) -> Result<Digest, ImageStoreError> {
    Digest::parse(text).map_err(|err| ImageStoreError::IndexCorrupt {
        path: index.to_path_buf(),
        reason: err.to_string(),
    })
}

fn read_index(path: &Path) -> Result<IndexFile, ImageStoreError> {
    let file = match std::fs::File::open(path) {
        Ok(file) => file,
        Err(err) if err.kind() == io::ErrorKind::NotFound => {
            return Ok(IndexFile {
                version: INDEX_VERSION,
                images: BTreeMap::new(),
            });
        }
        Err(err) => return Err(IoError::new("open", path, err).into()),
    };
    let corrupt = |reason: String| ImageStoreError::IndexCorrupt {
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

/// Removes a tree the store made, without following symlinks in it (`remove_dir_all` does not
/// follow them).
fn remove_tree(path: &Path) -> Result<(), ImageStoreError> {
    match std::fs::remove_dir_all(path) {
        Ok(()) => Ok(()),
        Err(err) if err.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(err) => Err(IoError::new("remove", path, err).into()),
    }
}
