//! Pulling an image from a registry into the [`BlobStore`]: the manifest (an image index
//! resolved to this host's platform first), the config and every layer, each verified.
//!
//! It owns a pull's steps and their bounds (the HTTP conversation itself is
//! [`super::registry`]'s). It must not unpack anything, decide
//! which images are kept (the image store does), nor trust anything the registry says:
//! manifests, indexes, configs, blobs, headers and tokens are hostile input. So:
//! - every blob goes through [`BlobStore::put`], which hashes and counts while streaming and
//!   keeps nothing that does not match the digest and size the manifest gave; the manifest
//!   itself is hashed here and must match a pinned digest (and the digest the platform entry
//!   of an index gave);
//! - a blob already in the store is never requested again;
//! - sizes are bounded before anything is fetched where the manifest declares them (config,
//!   layer count, the sum of the layer sizes) and the declared size is enforced while
//!   streaming; every answer read into memory is read under a cap (below);
//! - every wait is bounded: a connect timeout, a deadline per manifest request, per blob and
//!   for the whole pull, and an idle bound on every blob download: a registry that sends
//!   nothing for [`PullLimits::read_timeout`], before a blob's headers or mid-body, fails the
//!   pull as [`PullError::Stalled`] (the HTTP client's own read timeout, twice as long, is
//!   only a backstop);
//! - only `sha256` digests (validated by [`Digest::parse`]) ever become names or requests, and
//!   layers' foreign `urls` are never fetched.
//!
//! ## Every byte from the registry bounded before it is buffered (issue #23)
//! The HTTP conversation is `super::registry`'s, on reqwest directly rather than through the
//! `oci-client` crate used before: that crate read manifests, `/v2/` and token answers and
//! every error body whole before anyone could check their size (an endless manifest took
//! 3 GB in 1.6 s), and its HTTP client cannot be wrapped. Now a manifest or index is read
//! under [`PullLimits::max_manifest_bytes`], a token answer under
//! [`PullLimits::max_token_bytes`], a `/v2/` answer and every error body under
//! [`PullLimits::max_error_bytes`]; configs and layers stream into the store, which stops at
//! the size the manifest declared (a config's declared size is capped by
//! [`PullLimits::max_config_bytes`] first). An answer over its cap fails the pull at once as
//! [`PullError::AnswerTooLarge`]: final (the same registry would send the same), naming the
//! registry, the reference and the cap. Index resolution is done here, so the platform
//! manifest's digest is checked against the index entry.

use std::collections::BTreeSet;
use std::io::{self, Read};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::{StreamExt, TryStreamExt};
use serde::Deserialize;

use super::blobs::{BlobError, BlobHolds, BlobStore, Digest, Put};
use super::progress::{BlobProgress, PullGuard, PullProgress};
use super::reference::{ImageRef, RegistrySettings};
use super::registry::{AnswerCaps, RegistryError, Session};
use super::unpack::Compression;

pub const OCI_MANIFEST: &str = "application/vnd.oci.image.manifest.v1+json";
pub const OCI_INDEX: &str = "application/vnd.oci.image.index.v1+json";
pub const DOCKER_MANIFEST: &str = "application/vnd.docker.distribution.manifest.v2+json";
pub const DOCKER_MANIFEST_LIST: &str = "application/vnd.docker.distribution.manifest.list.v2+json";
pub const OCI_CONFIG: &str = "application/vnd.oci.image.config.v1+json";
pub const DOCKER_CONFIG: &str = "application/vnd.docker.container.image.v1+json";
pub const OCI_LAYER: &str = "application/vnd.oci.image.layer.v1.tar";
pub const OCI_LAYER_GZIP: &str = "application/vnd.oci.image.layer.v1.tar+gzip";
pub const DOCKER_LAYER_GZIP: &str = "application/vnd.docker.image.rootfs.diff.tar.gzip";

/// How often a blob's download progress (bytes done / total) is logged.
const PROGRESS_EVERY: Duration = Duration::from_secs(5);

/// The media types asked for in `Accept` (schema 1 is not among them: it is unsigned-unsafe
/// and deprecated; a registry that has only that answers with something refused below).
const ACCEPTED: &[&str] = &[
    OCI_MANIFEST,
    DOCKER_MANIFEST,
    OCI_INDEX,
    DOCKER_MANIFEST_LIST,
];

/// Bounds on one pull. The defaults fit real CSI plugin images (tens to hundreds of MiB,
/// under 50 layers) with a wide margin.
#[derive(Clone, Debug)]
pub struct PullLimits {
    /// A manifest or index, read under this cap.
    pub max_manifest_bytes: u64,
    /// A token service's answer, read under this cap (real tokens are a few KiB).
    pub max_token_bytes: u64,
    /// The `/v2/` answer and every error answer's body (a 404's, a 401's), read under this
    /// cap (only its start is shown in messages).
    pub max_error_bytes: u64,
    pub max_config_bytes: u64,
    pub max_layers: usize,
    /// The sum of the layer sizes the manifest declares (each enforced while streaming).
    pub max_total_bytes: u64,
    /// Layers downloaded at once.
    pub parallel: usize,
    pub connect_timeout: Duration,
    /// Longest a blob's download may wait for the registry: for the answer's headers, then
    /// for each next piece of the body ([`PullError::Stalled`]). The HTTP client's read
    /// timeout is twice this, a backstop for the other requests (each is under
    /// `manifest_timeout` too).
    pub read_timeout: Duration,
    /// The throughput floor of a blob's body, beside the idle bound of `read_timeout`: a
    /// blob that, once its answer's headers arrived, receives fewer than `min_bytes_per_sec` ×
    /// `throughput_window` bytes in any whole `throughput_window` fails the pull as
    /// [`PullError::TooSlow`] (a registry trickling a byte every 20 s never goes idle for
    /// 30 s). 0 turns it off.
    pub min_bytes_per_sec: u64,
    /// The window over which `min_bytes_per_sec` is averaged (consecutive windows from the
    /// answer's headers; a blob that completes within one is never judged).
    pub throughput_window: Duration,
    /// Deadline of one manifest request (auth included).
    pub manifest_timeout: Duration,
    /// Deadline of one blob's download.
    pub blob_timeout: Duration,
    /// Deadline of the whole pull.
    pub total_timeout: Duration,
}

impl Default for PullLimits {
    fn default() -> Self {
        Self {
            max_manifest_bytes: 4 << 20,
            max_token_bytes: 256 << 10,
            max_error_bytes: 64 << 10,
            max_config_bytes: 4 << 20,
            max_layers: 128,
            max_total_bytes: 8 << 30,
            parallel: 4,
            connect_timeout: Duration::from_secs(10),
            read_timeout: Duration::from_secs(30),
            min_bytes_per_sec: 10 << 10,
            throughput_window: Duration::from_secs(60),
            manifest_timeout: Duration::from_secs(60),
            blob_timeout: Duration::from_secs(30 * 60),
            total_timeout: Duration::from_secs(60 * 60),
        }
    }
}

/// A blob the manifest names, validated.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BlobRef {
    pub digest: Digest,
    pub size: u64,
    pub media_type: String,
}

/// A layer: its blob and how it is compressed (from its media type).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LayerRef {
    pub blob: BlobRef,
    pub compression: Compression,
}

/// What a pull produced: everything is in the blob store.
#[derive(Clone, Debug)]
pub struct Pulled {
    /// The platform manifest's digest (the image's identity).
    pub manifest: Digest,
    /// The index's digest, when the reference named an index.
    pub index: Option<Digest>,
    pub config: BlobRef,
    pub layers: Vec<LayerRef>,
    /// Blobs fetched by this pull (those already stored are not).
    pub downloaded: Vec<Digest>,
}

impl Pulled {
    /// The manifest's declared size of the image: config plus layers (compressed).
    pub fn size(&self) -> u64 {
        self.layers
            .iter()
            .fold(self.config.size, |sum, l| sum.saturating_add(l.blob.size))
    }
}

/// The blobs one pull holds (from before it looks for each until [`Fetched::release`]) and
/// those it stored. Kept by the caller, so that it outlives a pull that failed: the image
/// store removes what a failed pull stored unless an indexed image names it, and while held
/// no prune or cleanup of another pull removes it. A blob whose writer finishes after the
/// release (a download the failure of another one abandoned: its blocking writer cannot be
/// stopped mid-rename) is removed by that writer.
#[derive(Debug)]
pub struct Fetched {
    store: Arc<BlobStore>,
    holds: Mutex<BlobHolds>,
    state: Mutex<FetchedState>,
    /// Blob writers running (each on a blocking thread): a pull returns only once it is 0.
    writers: tokio::sync::watch::Sender<usize>,
}

/// Counts one blob writer while it lives.
struct WriterRunning(Arc<Fetched>);

impl Drop for WriterRunning {
    fn drop(&mut self) {
        self.0.writers.send_modify(|n| *n = n.saturating_sub(1));
    }
}

#[derive(Debug, Default)]
struct FetchedState {
    stored: Vec<Digest>,
    released: bool,
}

impl Fetched {
    pub fn new(store: &Arc<BlobStore>) -> Arc<Self> {
        Arc::new(Self {
            store: Arc::clone(store),
            holds: Mutex::new(store.holds()),
            state: Mutex::default(),
            writers: tokio::sync::watch::Sender::new(0),
        })
    }

    fn writer_running(self: &Arc<Self>) -> WriterRunning {
        self.writers.send_modify(|n| *n += 1);
        WriterRunning(Arc::clone(self))
    }

    /// Waits until no blob writer of this pull runs (one whose download was dropped ends at
    /// once: its source reports the end).
    async fn writers_finished(&self) {
        let _ = self.writers.subscribe().wait_for(|n| *n == 0).await;
    }

    fn hold(&self, digest: &Digest) {
        self.holds
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .hold(digest);
    }

    fn lock_state(&self) -> std::sync::MutexGuard<'_, FetchedState> {
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Notes a blob this pull stored; false when the pull was released already (the
    /// writer then removes it: nobody else will).
    fn note_stored(&self, digest: &Digest) -> bool {
        let mut state = self.lock_state();
        if state.released {
            return false;
        }
        state.stored.push(digest.clone());
        true
    }

    /// Drops every hold and returns the blobs this pull stored (the caller decides whether
    /// they are garbage); a writer finishing later removes its blob itself.
    pub fn release(&self) -> Vec<Digest> {
        // Holds first: a late writer that finds the pull released can then remove its blob.
        let holds = std::mem::replace(
            &mut *self
                .holds
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner),
            self.store.holds(),
        );
        drop(holds);
        let mut state = self.lock_state();
        state.released = true;
        std::mem::take(&mut state.stored)
    }
}

/// Why a pull failed. [`PullError::is_transient`] says whether retrying may help.
#[derive(Debug, thiserror::Error)]
pub enum PullError {
    /// The registry says the repository, tag or blob does not exist.
    #[error("{reference}: not found in the registry: {source}")]
    NotFound {
        reference: String,
        #[source]
        source: Box<RegistryError>,
    },
    /// Connecting or talking to the registry failed (refused, reset, DNS, TLS, a read timed
    /// out). Transient.
    #[error("{reference}: registry {registry} unreachable: {source}")]
    Unreachable {
        reference: String,
        registry: String,
        #[source]
        source: Box<RegistryError>,
    },
    /// The registry or its token service refused the credentials (or their absence).
    #[error("{reference}: registry {registry} refused access: {source}")]
    AuthRefused {
        reference: String,
        registry: String,
        #[source]
        source: Box<RegistryError>,
    },
    /// Content does not hash to the digest it was asked for; nothing was kept.
    #[error("{reference}: {what} {expected}: the registry sent content hashing to {actual}")]
    DigestMismatch {
        reference: String,
        what: &'static str,
        expected: String,
        actual: String,
    },
    /// A blob's size or digest did not match while it was streamed into the store.
    #[error("{reference}: blob refused: {source}")]
    BlobRefused {
        reference: String,
        #[source]
        source: BlobError,
    },
    #[error("{reference}: unsupported media type {media_type:?} for the {what}")]
    UnsupportedMediaType {
        reference: String,
        what: &'static str,
        media_type: String,
    },
    #[error(
        "{reference}: the image index has no manifest for {os}/{architecture} (it has: {available})"
    )]
    UnsupportedPlatform {
        reference: String,
        os: &'static str,
        architecture: &'static str,
        available: String,
    },
    /// The index's entry for this platform is itself an index. Nested indexes are not
    /// followed: one level is what Docker and containerd publish, and following more would
    /// let a registry chain fetches without bound.
    #[error(
        "{reference}: the image index's entry for {os}/{architecture} ({digest}) is itself an image index ({media_type}); nested indexes are not followed: pull that entry by its digest, or an image whose index lists a manifest for {os}/{architecture}"
    )]
    NestedIndex {
        reference: String,
        os: &'static str,
        architecture: &'static str,
        digest: String,
        media_type: String,
    },
    /// The registry (or its token service) sent an answer larger than its cap: reading
    /// stopped there, nothing of it was kept. Final: the same registry would send the same.
    #[error(
        "{reference}: registry {registry} sent {what} of more than {max} bytes (at least {received} received); refused without reading further (that answer is capped at {max} bytes: fix the registry or the image)"
    )]
    AnswerTooLarge {
        reference: String,
        registry: String,
        what: String,
        received: u64,
        max: u64,
    },
    #[error("{reference}: {what} is {actual}, over the limit of {max}")]
    Limit {
        reference: String,
        what: &'static str,
        actual: u64,
        max: u64,
    },
    #[error("{reference}: malformed {what}: {reason}")]
    Malformed {
        reference: String,
        what: &'static str,
        reason: String,
    },
    /// A deadline of [`PullLimits`] passed. Transient.
    #[error("{reference}: {what} took longer than {after:?}")]
    Timeout {
        reference: String,
        what: &'static str,
        after: Duration,
    },
    /// The registry sent nothing for [`PullLimits::read_timeout`] while a blob was being
    /// downloaded (before the answer's headers, or mid-body); what it had sent was discarded.
    /// Transient: a registry that stalls once may answer the next time.
    #[error(
        "{reference}: registry {registry} stalled: nothing for {after:?} while sending {what} of blob {blob} ({received} of {size} bytes received); the partial blob was discarded"
    )]
    Stalled {
        reference: String,
        registry: String,
        blob: String,
        /// `the answer` (no headers yet) or `the body`.
        what: &'static str,
        received: u64,
        size: u64,
        after: Duration,
    },
    /// A blob's body arrived slower than [`PullLimits::min_bytes_per_sec`] over a whole
    /// [`PullLimits::throughput_window`]; what it had sent was discarded. Transient: a slow
    /// registry or link may be faster later, and the retry holds no lock meanwhile (the
    /// image store locks only local work), so retrying it costs other plugins nothing.
    #[error(
        "{reference}: registry {registry} too slow: {received_in_window} bytes of blob {blob} in {window:?}, under the floor of {floor} bytes/s ({received} bytes received in all); the partial blob was discarded"
    )]
    TooSlow {
        reference: String,
        registry: String,
        blob: String,
        received_in_window: u64,
        window: Duration,
        floor: u64,
        received: u64,
    },
    /// Any other registry answer (5xx, 429 are transient; see [`PullError::is_transient`]).
    #[error("{reference}: registry {registry}: {source}")]
    Registry {
        reference: String,
        registry: String,
        transient: bool,
        #[source]
        source: Box<RegistryError>,
    },
    /// The store failed (disk full, I/O): transient, as the operator may free space.
    #[error("{reference}: storing: {source}")]
    Store {
        reference: String,
        #[source]
        source: BlobError,
    },
    /// The HTTP client could not be built.
    #[error("cannot set up the registry client: {source}")]
    Client {
        #[source]
        source: reqwest::Error,
    },
    /// A download task failed or panicked.
    #[error("{reference}: download task failed: {reason}")]
    Task { reference: String, reason: String },
}

impl PullError {
    /// True when the same pull may succeed later without anything changing in the image or
    /// the config: the registry unreachable or overloaded, a timeout, the disk full.
    pub fn is_transient(&self) -> bool {
        match self {
            Self::Unreachable { .. }
            | Self::Timeout { .. }
            | Self::Stalled { .. }
            | Self::TooSlow { .. }
            | Self::Task { .. } => true,
            Self::Registry { transient, .. } => *transient,
            Self::Store { .. } => true,
            Self::NotFound { .. }
            | Self::AuthRefused { .. }
            | Self::DigestMismatch { .. }
            | Self::BlobRefused { .. }
            | Self::UnsupportedMediaType { .. }
            | Self::UnsupportedPlatform { .. }
            | Self::NestedIndex { .. }
            | Self::Limit { .. }
            | Self::AnswerTooLarge { .. }
            | Self::Malformed { .. }
            | Self::Client { .. } => false,
        }
    }
}

/// The registry client of one daemon: settings, limits and the HTTP client (shared by
/// clones).
#[derive(Clone)]
pub struct Puller {
    /// Built on the first pull: the HTTP client and its TLS roots cost the daemon a few MiB of
    /// memory, which a node whose plugins use no image should not pay.
    client: Arc<Mutex<Option<reqwest::Client>>>,
    settings: RegistrySettings,
    limits: PullLimits,
    /// Shared by the clones: every pull of the daemon reports here.
    progress: Arc<PullProgress>,
}

impl std::fmt::Debug for Puller {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Puller")
            .field("settings", &self.settings)
            .field("limits", &self.limits)
            .finish_non_exhaustive()
    }
}

impl Puller {
    /// Nothing is connected, and the HTTP client is built only by the first pull (see
    /// [`Puller::client`]).
    pub fn new(settings: RegistrySettings, limits: PullLimits) -> Self {
        Self {
            client: Arc::default(),
            settings,
            limits,
            progress: Arc::default(),
        }
    }

    /// The HTTP client, built once; one that cannot be built (its TLS setup) fails the pull,
    /// and the next pull tries again.
    fn client(&self) -> Result<reqwest::Client, PullError> {
        let mut slot = self
            .client
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(client) = slot.as_ref() {
            return Ok(client.clone());
        }
        // The read timeout is a backstop: a blob download's own idle bound (`read_timeout`)
        // fires first and says which blob stalled (`fetch_blob`).
        let client = super::registry::http_client(
            self.limits.connect_timeout,
            self.limits.read_timeout.saturating_mul(2),
        )
        .map_err(|source| PullError::Client { source })?;
        *slot = Some(client.clone());
        Ok(client)
    }

    fn caps(&self) -> AnswerCaps {
        AnswerCaps {
            manifest: self.limits.max_manifest_bytes,
            token: self.limits.max_token_bytes,
            error: self.limits.max_error_bytes,
        }
    }

    /// The pulls in flight, with their bytes per blob.
    pub fn progress(&self) -> &Arc<PullProgress> {
        &self.progress
    }

    pub fn settings(&self) -> &RegistrySettings {
        &self.settings
    }

    pub fn limits(&self) -> &PullLimits {
        &self.limits
    }

    /// Pulls `reference` into `blobs`: the whole pull under [`PullLimits::total_timeout`].
    /// What it stored stays, even when it fails (see [`Puller::pull_into`]).
    pub async fn pull(
        &self,
        reference: &ImageRef,
        blobs: &Arc<BlobStore>,
    ) -> Result<Pulled, PullError> {
        self.pull_into(reference, blobs, &Fetched::new(blobs)).await
    }

    /// [`Puller::pull`], holding each blob in `fetched` before it looks for it and noting
    /// there each blob it stores, so that the caller can remove them when the pull (or what
    /// it does next with the image) fails.
    pub async fn pull_into(
        &self,
        reference: &ImageRef,
        blobs: &Arc<BlobStore>,
        fetched: &Arc<Fetched>,
    ) -> Result<Pulled, PullError> {
        let name = reference.to_string();
        // Registered for as long as this call runs, whatever ends it.
        let progress = self.progress.begin(&name);
        // On a task of its own: a panic in the HTTP stack on a hostile answer (oci-client
        // unwraps a header value built from the registry's token) becomes this pull's error
        // instead of taking down the caller's task (a plugin's supervisor).
        let this = self.clone();
        let (owned, blobs, held) = (reference.clone(), Arc::clone(blobs), Arc::clone(fetched));
        let mut task = AbortOnDrop(tokio::spawn(async move {
            tokio::time::timeout(
                this.limits.total_timeout,
                this.pull_inner(&owned, &blobs, &progress, &held),
            )
            .await
        }));
        // A caller that gives up (its future dropped) stops the pull too.
        let ended = (&mut task.0).await;
        // A failed pull drops the downloads still running; their writers end at once, and
        // what the caller sees next (the store's files) must not change after it returns.
        fetched.writers_finished().await;
        match ended {
            Ok(Ok(result)) => result,
            Ok(Err(_)) => Err(PullError::Timeout {
                reference: name,
                what: "the pull",
                after: self.limits.total_timeout,
            }),
            Err(err) => Err(PullError::Task {
                reference: name,
                reason: err.to_string(),
            }),
        }
    }

    async fn pull_inner(
        &self,
        reference: &ImageRef,
        blobs: &Arc<BlobStore>,
        progress: &PullGuard,
        fetched: &Arc<Fetched>,
    ) -> Result<Pulled, PullError> {
        let name = reference.to_string();
        // The `/v2/` ping and the token first, so that a refused token is reported as such.
        let http = self.client()?;
        let session = self
            .bounded(&name, "authenticating", async {
                Session::start(http, &self.settings, self.caps(), reference)
                    .await
                    .map_err(|err| self.classify(reference, err))
            })
            .await?;

        let (body, manifest_digest) = self.fetch_manifest(reference, &session, reference).await?;
        let top = parse_manifest(&name, &body)?;
        let (manifest, manifest_digest, index) = match top {
            Manifest::Image(image) => (image, manifest_digest, None),
            Manifest::Index(entries) => {
                let chosen = choose_platform(&name, &entries)?;
                let platform_ref = reference.with_digest(chosen.clone());
                let (body, digest) = self
                    .fetch_manifest(reference, &session, &platform_ref)
                    .await?;
                match parse_manifest(&name, &body)? {
                    Manifest::Image(image) => (image, digest, Some(manifest_digest)),
                    Manifest::Index(_) => {
                        return Err(PullError::Malformed {
                            reference: name,
                            what: "image index",
                            reason: "its platform entry is another index".to_owned(),
                        });
                    }
                }
            }
        };

        if manifest.config.size > self.limits.max_config_bytes {
            return Err(PullError::Limit {
                reference: name,
                what: "the image config",
                actual: manifest.config.size,
                max: self.limits.max_config_bytes,
            });
        }
        if manifest.layers.len() > self.limits.max_layers {
            return Err(PullError::Limit {
                reference: name,
                what: "the number of layers",
                actual: manifest.layers.len() as u64,
                max: self.limits.max_layers as u64,
            });
        }
        let total = manifest
            .layers
            .iter()
            .fold(0u64, |sum, l| sum.saturating_add(l.blob.size));
        if total > self.limits.max_total_bytes {
            return Err(PullError::Limit {
                reference: name,
                what: "the sum of the layer sizes",
                actual: total,
                max: self.limits.max_total_bytes,
            });
        }

        // Config and layers, each distinct blob once, in parallel.
        let mut wanted: Vec<BlobRef> = vec![manifest.config.clone()];
        let mut seen = BTreeSet::from([manifest.config.digest.clone()]);
        for layer in &manifest.layers {
            if seen.insert(layer.blob.digest.clone()) {
                wanted.push(layer.blob.clone());
            }
        }
        let downloaded: Vec<Option<Digest>> = futures::stream::iter(wanted)
            .map(|blob| {
                let counted = progress.blob(&blob.digest.to_string(), blob.size);
                self.fetch_blob(reference, &session, blob, blobs, counted, fetched)
            })
            .buffer_unordered(self.limits.parallel.max(1))
            .try_collect()
            .await?;
        Ok(Pulled {
            manifest: manifest_digest,
            index,
            config: manifest.config,
            layers: manifest.layers,
            downloaded: downloaded.into_iter().flatten().collect(),
        })
    }

    /// Fetches the manifest `target` names; checks its size and, when `target` pins a digest,
    /// that the body hashes to it. Returns the body and its digest.
    async fn fetch_manifest(
        &self,
        reference: &ImageRef,
        session: &Session,
        target: &ImageRef,
    ) -> Result<(Vec<u8>, Digest), PullError> {
        let name = reference.to_string();
        let tag_or_digest = target.manifest_target();
        let body = self
            .bounded(&name, "fetching the manifest", async {
                session
                    .manifest(&tag_or_digest, &ACCEPTED.join(", "))
                    .await
                    .map_err(|err| self.classify(reference, err))
            })
            .await?;
        if body.len() as u64 > self.limits.max_manifest_bytes {
            return Err(PullError::Limit {
                reference: name,
                what: "the manifest",
                actual: body.len() as u64,
                max: self.limits.max_manifest_bytes,
            });
        }
        let digest = Digest::of(&body);
        if let Some(expected) = target.digest()
            && *expected != digest
        {
            return Err(PullError::DigestMismatch {
                reference: name,
                what: "manifest",
                expected: expected.to_string(),
                actual: digest.to_string(),
            });
        }
        Ok((body, digest))
    }

    /// Streams one blob into the store unless it is there already. Returns its digest when
    /// it was downloaded.
    async fn fetch_blob(
        &self,
        reference: &ImageRef,
        session: &Session,
        blob: BlobRef,
        blobs: &Arc<BlobStore>,
        progress: Arc<BlobProgress>,
        fetched: &Arc<Fetched>,
    ) -> Result<Option<Digest>, PullError> {
        let name = reference.to_string();
        // Before looking: a blob found present is not removed before it is indexed.
        fetched.hold(&blob.digest);
        let store_err = |source| PullError::Store {
            reference: name.clone(),
            source,
        };
        if blobs.contains(&blob.digest).map_err(store_err)? {
            progress.complete();
            return Ok(None);
        }
        let digest_text = blob.digest.to_string();
        let idle = self.limits.read_timeout;
        let stalled = |what: &'static str, received: u64| PullError::Stalled {
            reference: name.clone(),
            registry: reference.registry().to_owned(),
            blob: blob.digest.to_string(),
            what,
            received,
            size: blob.size,
            after: idle,
        };
        let work = async {
            let mut response = tokio::time::timeout(idle, session.blob(digest_text.as_str()))
                .await
                .map_err(|_| stalled("the answer", 0))?
                .map_err(|err| self.classify(reference, err))?;
            check_blob_length(&name, &blob, response.content_length())?;
            // The store is synchronous (it fsyncs): it runs on a blocking thread reading the
            // chunks this task receives, at most 16 chunks ahead.
            let (tx, rx) = tokio::sync::mpsc::channel::<io::Result<bytes::Bytes>>(16);
            let writer = spawn_blob_writer(blobs, fetched, &blob, rx);
            let mut sent: u64 = 0;
            let started = std::time::Instant::now();
            let mut next_report = started + PROGRESS_EVERY;
            let mut stall = None;
            let mut floor = Floor::new(&self.limits, started);
            let mut last_chunk = started;
            loop {
                // Wakes at the idle bound or the window's end, whichever is first (reqwest's
                // `chunk` is cancel-safe: a wake-up for the window loses no bytes).
                let idle_at = last_chunk + idle;
                let wake = floor.window_end().map_or(idle_at, |end| end.min(idle_at));
                let polled = tokio::time::timeout_at(wake.into(), response.chunk()).await;
                let now = std::time::Instant::now();
                let arrived = match &polled {
                    Ok(Ok(Some(chunk))) => chunk.len() as u64,
                    _ => 0,
                };
                if let Some(received_in_window) = floor.too_slow(now, sent.saturating_add(arrived))
                {
                    stall = Some(PullError::TooSlow {
                        reference: name.clone(),
                        registry: reference.registry().to_owned(),
                        blob: blob.digest.to_string(),
                        received_in_window,
                        window: self.limits.throughput_window,
                        floor: self.limits.min_bytes_per_sec,
                        received: sent,
                    });
                }
                let item = match polled {
                    _ if stall.is_some() => Err(io::Error::new(
                        io::ErrorKind::TimedOut,
                        "the registry sent under the throughput floor",
                    )),
                    Ok(Ok(Some(chunk))) => Ok(chunk),
                    Ok(Ok(None)) => break,
                    Ok(Err(err)) => Err(io::Error::other(err)),
                    Err(_) if now < idle_at => continue,
                    Err(_) => {
                        stall = Some(stalled("the body", sent));
                        Err(io::Error::new(
                            io::ErrorKind::TimedOut,
                            format!("the registry sent nothing for {idle:?}"),
                        ))
                    }
                };
                if item.is_ok() {
                    last_chunk = now;
                }
                match item {
                    Ok(chunk) => {
                        sent = sent.saturating_add(chunk.len() as u64);
                        progress.add(chunk.len() as u64);
                        if std::time::Instant::now() >= next_report {
                            next_report += PROGRESS_EVERY;
                            tracing::info!(image = %name, blob = %blob.digest, bytes = sent,
                                total = blob.size, "downloading");
                        }
                        // The writer stops receiving once it has refused the blob (too large).
                        if tx.send(Ok(chunk)).await.is_err() {
                            break;
                        }
                    }
                    Err(err) => {
                        let _ = tx.send(Err(err)).await;
                        break;
                    }
                }
            }
            drop(tx);
            let written = writer.await;
            if let Some(stall) = stall {
                // Only now: the writer has removed its temp file.
                return Err(stall);
            }
            self.blob_written(reference, &name, &blob, &progress, started, written)
        };
        match tokio::time::timeout(self.limits.blob_timeout, work).await {
            Ok(result) => result,
            Err(_) => Err(PullError::Timeout {
                reference: name.clone(),
                what: "downloading a blob",
                after: self.limits.blob_timeout,
            }),
        }
    }

    /// What the writer's end says of the blob: its digest when it stored it, `None` when it
    /// found the blob there already, else the store's refusal or the writer's crash.
    fn blob_written(
        &self,
        reference: &ImageRef,
        name: &str,
        blob: &BlobRef,
        progress: &BlobProgress,
        started: std::time::Instant,
        written: Result<Result<Put, BlobError>, tokio::task::JoinError>,
    ) -> Result<Option<Digest>, PullError> {
        match written {
            Ok(Ok(Put::Stored)) => {
                progress.complete();
                tracing::info!(image = %name, blob = %blob.digest, bytes = blob.size,
                    elapsed_ms = started.elapsed().as_millis() as u64, "blob downloaded and verified");
                Ok(Some(blob.digest.clone()))
            }
            Ok(Ok(Put::AlreadyPresent)) => {
                progress.complete();
                Ok(None)
            }
            Ok(Err(err)) => Err(self.classify_blob(reference, err)),
            Err(err) => Err(PullError::Task {
                reference: name.to_owned(),
                reason: err.to_string(),
            }),
        }
    }

    async fn bounded<T>(
        &self,
        name: &str,
        what: &'static str,
        work: impl Future<Output = Result<T, PullError>>,
    ) -> Result<T, PullError> {
        match tokio::time::timeout(self.limits.manifest_timeout, work).await {
            Ok(result) => result,
            Err(_) => Err(PullError::Timeout {
                reference: name.to_owned(),
                what,
                after: self.limits.manifest_timeout,
            }),
        }
    }

    fn classify_blob(&self, reference: &ImageRef, err: BlobError) -> PullError {
        let reference_registry = reference.registry();
        let reference = reference.to_string();
        match err {
            BlobError::DigestMismatch { expected, actual } => PullError::DigestMismatch {
                reference,
                what: "blob",
                expected: expected.to_string(),
                actual: actual.to_string(),
            },
            BlobError::SizeMismatch { .. } | BlobError::TooLarge { .. } => PullError::BlobRefused {
                reference,
                source: err,
            },
            // The stream failed mid-blob: the connection, i.e. the registry went away.
            BlobError::Read { .. } => PullError::Registry {
                registry: reference_registry.to_owned(),
                reference,
                transient: true,
                source: Box::new(RegistryError::BrokenOff {
                    url: format!("{reference_registry} (a blob)"),
                    reason: err.to_string(),
                }),
            },
            other => PullError::Store {
                reference,
                source: other,
            },
        }
    }

    fn classify(&self, reference: &ImageRef, err: RegistryError) -> PullError {
        let name = reference.to_string();
        let registry = reference.registry().to_owned();
        match &err {
            // A sink only buffers in memory here: it cannot fail, but it is not the
            // registry's answer either.
            RegistryError::Request { .. }
            | RegistryError::BrokenOff { .. }
            | RegistryError::Sink { .. } => PullError::Unreachable {
                reference: name,
                registry,
                source: Box::new(err),
            },
            RegistryError::TooLarge {
                what,
                received,
                max,
                ..
            } => PullError::AnswerTooLarge {
                reference: name,
                registry,
                what: what.clone(),
                received: *received,
                max: *max,
            },
            RegistryError::Auth { .. } => PullError::AuthRefused {
                reference: name,
                registry,
                source: Box::new(err),
            },
            RegistryError::Status { status, codes, .. } => {
                let has = |wanted: &[&str]| codes.iter().any(|c| wanted.contains(&c.as_str()));
                if *status == 404
                    || has(&[
                        "MANIFEST_UNKNOWN",
                        "NAME_UNKNOWN",
                        "BLOB_UNKNOWN",
                        "NOT_FOUND",
                    ])
                {
                    PullError::NotFound {
                        reference: name,
                        source: Box::new(err),
                    }
                } else if *status == 401 || *status == 403 || has(&["UNAUTHORIZED", "DENIED"]) {
                    PullError::AuthRefused {
                        reference: name,
                        registry,
                        source: Box::new(err),
                    }
                } else {
                    let transient =
                        *status == 429 || (500..600).contains(status) || has(&["TOOMANYREQUESTS"]);
                    PullError::Registry {
                        reference: name,
                        registry,
                        transient,
                        source: Box::new(err),
                    }
                }
            }
        }
    }
}

/// Aborts the task when dropped.
struct AbortOnDrop<T>(tokio::task::JoinHandle<T>);

impl<T> Drop for AbortOnDrop<T> {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Refuses a blob whose `Content-Length` is not the size its manifest gives, before a byte
/// of it is read: more would overrun the store's bound, less cannot hash to the digest.
fn check_blob_length(name: &str, blob: &BlobRef, length: Option<u64>) -> Result<(), PullError> {
    if let Some(length) = length
        && length != blob.size
    {
        return Err(PullError::BlobRefused {
            reference: name.to_owned(),
            source: if length > blob.size {
                BlobError::TooLarge {
                    digest: blob.digest.clone(),
                    expected: blob.size,
                }
            } else {
                BlobError::SizeMismatch {
                    digest: blob.digest.clone(),
                    expected: blob.size,
                    actual: length,
                }
            },
        });
    }
    Ok(())
}

/// Starts the blocking thread that stores `blob` from the chunks `rx` receives. A blob it
/// stored after the pull failed is removed at once (the pull's cleanup has run already).
fn spawn_blob_writer(
    blobs: &Arc<BlobStore>,
    fetched: &Arc<Fetched>,
    blob: &BlobRef,
    rx: tokio::sync::mpsc::Receiver<io::Result<bytes::Bytes>>,
) -> tokio::task::JoinHandle<Result<Put, BlobError>> {
    let store = Arc::clone(blobs);
    let (digest, size) = (blob.digest.clone(), blob.size);
    let noted = Arc::clone(fetched);
    let running = fetched.writer_running();
    tokio::task::spawn_blocking(move || {
        let _running = running;
        let put = store.put(ChannelReader::new(rx), &digest, size);
        if matches!(put, Ok(Put::Stored)) && !noted.note_stored(&digest) {
            // The pull failed (or was dropped) while this blob was being renamed in.
            if let Err(err) = store.remove(&digest) {
                tracing::warn!(blob = %digest, error = %err, "cannot remove a blob stored after its pull failed; the next start removes it");
            }
        }
        put
    })
}

/// One blob body's throughput floor ([`PullLimits::min_bytes_per_sec`] over consecutive
/// [`PullLimits::throughput_window`]s): a registry that keeps sending, but too little to ever
/// go idle, is cut at the end of the first window under the floor.
struct Floor {
    /// Bytes a whole window must bring.
    per_window: u64,
    window: Duration,
    /// The current window's end (`None`: no floor).
    end: Option<std::time::Instant>,
    /// Bytes received when the current window began.
    at_start: u64,
}

impl Floor {
    fn new(limits: &PullLimits, started: std::time::Instant) -> Self {
        let window = limits.throughput_window;
        let millis = u64::try_from(window.as_millis()).unwrap_or(u64::MAX);
        let per_window = limits.min_bytes_per_sec.saturating_mul(millis) / 1000;
        Self {
            per_window,
            window,
            end: (per_window > 0).then(|| started + window),
            at_start: 0,
        }
    }

    fn window_end(&self) -> Option<std::time::Instant> {
        self.end
    }

    /// At or after the current window's end, with `received` bytes so far: the window's
    /// bytes when under the floor; otherwise (or before the end) `None`, the next window
    /// begun if this one ended.
    fn too_slow(&mut self, now: std::time::Instant, received: u64) -> Option<u64> {
        let end = self.end?;
        if now < end {
            return None;
        }
        let in_window = received.saturating_sub(self.at_start);
        if in_window < self.per_window {
            return Some(in_window);
        }
        self.end = Some(now + self.window);
        self.at_start = received;
        None
    }
}

/// A blocking [`Read`] over the chunks an async task sends (a download, an uploaded body).
/// Read it on a blocking thread only.
#[derive(Debug)]
pub struct ChannelReader {
    rx: tokio::sync::mpsc::Receiver<io::Result<bytes::Bytes>>,
    current: Option<bytes::Bytes>,
    offset: usize,
}

impl ChannelReader {
    pub fn new(rx: tokio::sync::mpsc::Receiver<io::Result<bytes::Bytes>>) -> Self {
        Self {
            rx,
            current: None,
            offset: 0,
        }
    }
}

impl Read for ChannelReader {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        loop {
            if let Some(chunk) = &self.current {
                let bytes: &[u8] = chunk;
                let left = bytes.get(self.offset..).unwrap_or_default();
                if !left.is_empty() {
                    let n = left.len().min(buf.len());
                    buf.get_mut(..n)
                        .unwrap_or_default()
                        .copy_from_slice(left.get(..n).unwrap_or_default());
                    self.offset += n;
                    return Ok(n);
                }
            }
            match self.rx.blocking_recv() {
                Some(Ok(chunk)) => {
                    self.current = Some(chunk);
                    self.offset = 0;
                }
                Some(Err(err)) => return Err(err),
                None => return Ok(0),
            }
        }
    }
}

/// A manifest, validated: either an image manifest or an index's entries.
#[derive(Debug)]
pub enum Manifest {
    Image(ImageManifest),
    Index(Vec<IndexEntry>),
}

#[derive(Debug)]
pub struct ImageManifest {
    pub config: BlobRef,
    pub layers: Vec<LayerRef>,
}

#[derive(Debug)]
pub struct IndexEntry {
    pub digest: Digest,
    pub media_type: String,
    pub os: Option<String>,
    pub architecture: Option<String>,
    pub variant: Option<String>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct RawManifest {
    schema_version: Option<i64>,
    media_type: Option<String>,
    config: Option<RawDescriptor>,
    layers: Option<Vec<RawDescriptor>>,
    manifests: Option<Vec<RawDescriptor>>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct RawDescriptor {
    media_type: Option<String>,
    digest: String,
    size: i64,
    platform: Option<RawPlatform>,
}

#[derive(Deserialize)]
struct RawPlatform {
    os: Option<String>,
    architecture: Option<String>,
    variant: Option<String>,
}

/// Parses and validates a manifest or index (hostile JSON: every digest validated, every
/// size non-negative, every media type known).
pub fn parse_manifest(reference: &str, body: &[u8]) -> Result<Manifest, PullError> {
    let malformed = |what, reason: String| PullError::Malformed {
        reference: reference.to_owned(),
        what,
        reason,
    };
    let raw: RawManifest =
        serde_json::from_slice(body).map_err(|err| malformed("manifest", err.to_string()))?;
    if raw.schema_version != Some(2) {
        return Err(PullError::UnsupportedMediaType {
            reference: reference.to_owned(),
            what: "manifest",
            media_type: format!(
                "schema version {:?} (only 2 is supported)",
                raw.schema_version
            ),
        });
    }
    let media_type = match raw.media_type.as_deref() {
        Some(t) => t.to_owned(),
        // OCI allows leaving it out: the shape says which one it is.
        None if raw.manifests.is_some() => OCI_INDEX.to_owned(),
        None => OCI_MANIFEST.to_owned(),
    };
    let descriptor = |what, d: &RawDescriptor| -> Result<BlobRef, PullError> {
        let digest = Digest::parse(&d.digest).map_err(|err| malformed(what, err.to_string()))?;
        let size = u64::try_from(d.size)
            .map_err(|_| malformed(what, format!("negative size {}", d.size)))?;
        Ok(BlobRef {
            digest,
            size,
            media_type: d.media_type.clone().unwrap_or_default(),
        })
    };
    match media_type.as_str() {
        OCI_MANIFEST | DOCKER_MANIFEST => {
            let config = raw
                .config
                .as_ref()
                .ok_or_else(|| malformed("manifest", "no config".to_owned()))?;
            let config = descriptor("config descriptor", config)?;
            if config.media_type != OCI_CONFIG && config.media_type != DOCKER_CONFIG {
                return Err(PullError::UnsupportedMediaType {
                    reference: reference.to_owned(),
                    what: "config",
                    media_type: config.media_type,
                });
            }
            let mut layers = Vec::new();
            for raw_layer in raw.layers.as_deref().unwrap_or_default() {
                let blob = descriptor("layer descriptor", raw_layer)?;
                let compression = match blob.media_type.as_str() {
                    OCI_LAYER => Compression::None,
                    OCI_LAYER_GZIP | DOCKER_LAYER_GZIP => Compression::Gzip,
                    _ => {
                        return Err(PullError::UnsupportedMediaType {
                            reference: reference.to_owned(),
                            what: "layer",
                            media_type: blob.media_type,
                        });
                    }
                };
                layers.push(LayerRef { blob, compression });
            }
            Ok(Manifest::Image(ImageManifest { config, layers }))
        }
        OCI_INDEX | DOCKER_MANIFEST_LIST => {
            let mut entries = Vec::new();
            for raw_entry in raw.manifests.as_deref().unwrap_or_default() {
                let blob = descriptor("index entry", raw_entry)?;
                let platform = raw_entry.platform.as_ref();
                entries.push(IndexEntry {
                    digest: blob.digest,
                    media_type: blob.media_type,
                    os: platform.and_then(|p| p.os.clone()),
                    architecture: platform.and_then(|p| p.architecture.clone()),
                    variant: platform.and_then(|p| p.variant.clone()),
                });
            }
            Ok(Manifest::Index(entries))
        }
        other => Err(PullError::UnsupportedMediaType {
            reference: reference.to_owned(),
            what: "manifest",
            media_type: other.to_owned(),
        }),
    }
}

/// This host's platform in OCI terms.
pub fn host_platform() -> (&'static str, &'static str) {
    let architecture = match std::env::consts::ARCH {
        "x86_64" => "amd64",
        "aarch64" => "arm64",
        "x86" => "386",
        "powerpc64" => "ppc64le",
        other => other,
    };
    ("linux", architecture)
}

/// The index entry for this host's platform: an image manifest for linux and this
/// architecture (the first such, as Docker and containerd pick).
pub fn choose_platform(reference: &str, entries: &[IndexEntry]) -> Result<Digest, PullError> {
    let (os, architecture) = host_platform();
    entries
        .iter()
        .find(|e| {
            e.os.as_deref() == Some(os)
                && e.architecture.as_deref() == Some(architecture)
                && (e.media_type == OCI_MANIFEST || e.media_type == DOCKER_MANIFEST)
        })
        .map(|e| e.digest.clone())
        .ok_or_else(|| {
            let is_index =
                |e: &IndexEntry| e.media_type == OCI_INDEX || e.media_type == DOCKER_MANIFEST_LIST;
            // Saying "no manifest for linux/amd64 (it has: linux/amd64)" would be a riddle:
            // name the nested index instead.
            if let Some(nested) = entries.iter().find(|e| {
                e.os.as_deref() == Some(os)
                    && e.architecture.as_deref() == Some(architecture)
                    && is_index(e)
            }) {
                return PullError::NestedIndex {
                    reference: reference.to_owned(),
                    os,
                    architecture,
                    digest: nested.digest.to_string(),
                    media_type: nested.media_type.clone(),
                };
            }
            PullError::UnsupportedPlatform {
                reference: reference.to_owned(),
                os,
                architecture,
                available: entries
                    .iter()
                    .map(|e| {
                        let kind =
                            if e.media_type == OCI_MANIFEST || e.media_type == DOCKER_MANIFEST {
                                String::new()
                            } else {
                                format!(" ({}, not an image manifest)", e.media_type)
                            };
                        format!(
                            "{}/{}{}{kind}",
                            e.os.as_deref().unwrap_or("?"),
                            e.architecture.as_deref().unwrap_or("?"),
                            e.variant
                                .as_deref()
                                .map(|v| format!("/{v}"))
                                .unwrap_or_default()
                        )
                    })
                    .collect::<Vec<_>>()
                    .join(", "),
            }
        })
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    fn hex(c: char) -> String {
        std::iter::repeat_n(c, 64).collect()
    }

    #[test]
    fn manifests_are_validated() {
        let good = format!(
            r#"{{"schemaVersion": 2, "mediaType": "{DOCKER_MANIFEST}",
              "config": {{"mediaType": "{DOCKER_CONFIG}", "digest": "sha256:{}", "size": 10}},
              "layers": [{{"mediaType": "{DOCKER_LAYER_GZIP}", "digest": "sha256:{}", "size": 20}},
                         {{"mediaType": "{OCI_LAYER}", "digest": "sha256:{}", "size": 0}}]}}"#,
            hex('a'),
            hex('b'),
            hex('c')
        );
        let Manifest::Image(image) = parse_manifest("r", good.as_bytes()).unwrap() else {
            panic!("not an image manifest");
        };
        assert_eq!(image.config.size, 10);
        assert_eq!(image.layers.len(), 2);
        assert_eq!(image.layers[0].compression, Compression::Gzip);
        assert_eq!(image.layers[1].compression, Compression::None);

        let bad_digest = good.replace(&format!("sha256:{}", hex('b')), "sha256:../../etc");
        assert!(matches!(
            parse_manifest("r", bad_digest.as_bytes()),
            Err(PullError::Malformed { .. })
        ));
        let negative = good.replace("\"size\": 20", "\"size\": -1");
        assert!(matches!(
            parse_manifest("r", negative.as_bytes()),
            Err(PullError::Malformed { .. })
        ));
        let zstd = good.replace(
            DOCKER_LAYER_GZIP,
            "application/vnd.oci.image.layer.v1.tar+zstd",
        );
        assert!(matches!(
            parse_manifest("r", zstd.as_bytes()),
            Err(PullError::UnsupportedMediaType { what: "layer", .. })
        ));
        let schema1 = r#"{"schemaVersion": 1, "name": "x", "fsLayers": []}"#;
        assert!(matches!(
            parse_manifest("r", schema1.as_bytes()),
            Err(PullError::UnsupportedMediaType { .. })
        ));
        assert!(matches!(
            parse_manifest("r", b"\xff\xfe"),
            Err(PullError::Malformed { .. })
        ));
    }

    #[test]
    fn an_index_resolves_to_this_platform_or_says_what_it_has() {
        let (_, arch) = host_platform();
        let index = format!(
            r#"{{"schemaVersion": 2, "manifests": [
              {{"mediaType": "{OCI_MANIFEST}", "digest": "sha256:{}", "size": 1,
                "platform": {{"os": "linux", "architecture": "s390x"}}}},
              {{"mediaType": "{OCI_MANIFEST}", "digest": "sha256:{}", "size": 1,
                "platform": {{"os": "linux", "architecture": "{arch}"}}}}]}}"#,
            hex('1'),
            hex('2')
        );
        let Manifest::Index(entries) = parse_manifest("r", index.as_bytes()).unwrap() else {
            panic!("not an index");
        };
        assert_eq!(choose_platform("r", &entries).unwrap().hex(), hex('2'));
        let err = choose_platform("r", &entries[..1]).unwrap_err();
        assert!(err.to_string().contains("linux/s390x"), "{err}");
        assert!(!err.is_transient());
    }

    #[test]
    fn a_nested_index_for_this_platform_is_named_not_taken_for_a_missing_one() {
        let (_, arch) = host_platform();
        for nested_type in [OCI_INDEX, DOCKER_MANIFEST_LIST] {
            let index = format!(
                r#"{{"schemaVersion": 2, "manifests": [
                  {{"mediaType": "{nested_type}", "digest": "sha256:{}", "size": 1,
                    "platform": {{"os": "linux", "architecture": "{arch}"}}}},
                  {{"mediaType": "{OCI_MANIFEST}", "digest": "sha256:{}", "size": 1,
                    "platform": {{"os": "linux", "architecture": "s390x"}}}}]}}"#,
                hex('3'),
                hex('4')
            );
            let Manifest::Index(entries) = parse_manifest("r", index.as_bytes()).unwrap() else {
                panic!("not an index");
            };
            let err = choose_platform("r", &entries).unwrap_err();
            let message = err.to_string();
            assert!(matches!(err, PullError::NestedIndex { .. }), "{message}");
            assert!(
                message.contains("is itself an image index")
                    && message.contains("nested indexes are not followed")
                    && message.contains(&format!("sha256:{}", hex('3')))
                    && message.contains(nested_type),
                "{message}"
            );
            assert!(!message.contains("has no manifest"), "{message}");
            assert!(!err.is_transient());
            // Without the nested entry the list says what each entry is.
            let other = choose_platform("r", &entries[1..]).unwrap_err().to_string();
            assert!(other.contains("(it has: linux/s390x)"), "{other}");
        }
    }
}
