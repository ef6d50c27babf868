//! Importing images from an archive, for nodes without a registry (`csictl image import`,
//! `POST /v1/images/import`): a tar of an OCI image layout (`oci-layout`, `index.json`,
//! `blobs/sha256/<hex>`, as `skopeo copy … oci-archive:FILE:TAG` writes) or a `docker save`
//! archive (`manifest.json` with `Config`, `RepoTags` and `Layers`, as `skopeo copy …
//! docker-archive:FILE:REF` writes).
//!
//! It owns reading the archive and turning it into index entries: every blob streamed into the
//! [`BlobStore`] and verified there, the manifests (or `manifest.json`) resolved to images and
//! the references they are imported under. Then the image goes through the store's one
//! "prepare and record" path, exactly as after a pull, so a plugin config naming it with Mesos
//! `cached: true` starts without asking any registry.
//!
//! The archive is hostile input, and so it must not:
//! - use an entry name as a path on the host. The tar is read as a stream, entry by entry;
//!   a name is only a key to look files up by. A blob's content is written only into the blob
//!   store's own temp files and renamed to the digest its content hashes to (checked against
//!   the digest in its name, for `blobs/sha256/<hex>`). Nothing is ever extracted by name;
//! - be trusted for a digest or a size: every digest is computed from the content, every size
//!   a manifest declares is compared with what the archive held;
//! - hold anything odd: `..` or absolute names, hard links, symlinks (but for `docker save`'s
//!   legacy `<id>/layer.tar -> ../<hex>.tar`, which is skipped, never followed nor created,
//!   as `manifest.json` names the files themselves), devices, a name twice,
//!   a JSON file over [`ImportLimits::max_json_bytes`], more than
//!   [`ImportLimits::max_archive_bytes`] in all, a media type the pull refuses too, a file
//!   referenced but missing: each is a typed [`ImportError`] naming the file or field;
//! - leave anything behind when refused: nothing is indexed unless every image of the archive
//!   is prepared, and the blobs the import stored that no index entry names are removed
//!   (under the store's busy lock, so no pull is between storing and indexing one).
//!
//! It must not talk to a registry, nor decide which images are in use.

use std::collections::{BTreeMap, BTreeSet};
use std::io::{self, Read};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use serde::Deserialize;

use super::blobs::{ALGORITHM, BlobError, BlobHolds, BlobStore, Digest, Put};
use super::pull::{self, Manifest, PullError};
use super::reference::{ImageRef, ReferenceError};
use super::store::{ImageStore, ImageStoreError, IndexEntry, IndexLayer, now_secs};

/// The OCI layout's marker file.
const OCI_LAYOUT: &str = "oci-layout";
/// The OCI layout's top-level index.
const OCI_INDEX_FILE: &str = "index.json";
/// `docker save`'s list of images.
const DOCKER_MANIFEST_FILE: &str = "manifest.json";
/// Small JSON files read into memory (with [`ImportLimits::max_json_bytes`]) instead of the
/// blob store. `repositories` is `docker save`'s legacy tag list, read only to be bounded.
const JSON_FILES: &[&str] = &[
    OCI_LAYOUT,
    OCI_INDEX_FILE,
    DOCKER_MANIFEST_FILE,
    "repositories",
];
/// The annotation naming an image in an OCI layout's index.
pub const REF_NAME: &str = "org.opencontainers.image.ref.name";
/// containerd's annotation with the full name (its `ref.name` is the tag alone).
pub const CONTAINERD_NAME: &str = "io.containerd.image.name";
/// The longest entry name accepted (Linux's `PATH_MAX`).
const MAX_NAME_BYTES: usize = 4096;

/// Bounds on one import. The defaults take any real plugin image.
#[derive(Clone, Debug)]
pub struct ImportLimits {
    /// The whole archive, as read (the daemon's `--image-import-max-bytes`).
    pub max_archive_bytes: u64,
    /// `index.json`, `manifest.json`, `oci-layout`, and each manifest and index blob read.
    pub max_json_bytes: u64,
    /// Entries in the archive.
    pub max_entries: usize,
    /// Images in one archive.
    pub max_images: usize,
}

impl Default for ImportLimits {
    fn default() -> Self {
        Self {
            max_archive_bytes: 8 << 30,
            max_json_bytes: 4 << 20,
            max_entries: 100_000,
            max_images: 64,
        }
    }
}

/// One image the import indexed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Imported {
    /// The resolved reference, the index key.
    pub reference: String,
    pub entry: IndexEntry,
}

/// Why an archive was refused. Nothing was indexed, and no blob it brought is left.
#[derive(Debug, thiserror::Error)]
pub enum ImportError {
    /// The archive could not be read (not a tar, truncated, the upload broke off).
    #[error("image archive: cannot read it: {source}")]
    Read {
        #[source]
        source: io::Error,
    },
    /// The archive went on past the limit (reading stopped there).
    #[error("image archive: larger than the limit of {max} bytes")]
    TooLarge { max: u64 },
    #[error("image archive: entry {name:?}: {reason}; refused (names are never used as paths)")]
    UnsafeName { name: String, reason: &'static str },
    #[error(
        "image archive: entry {name:?} is a {kind}; an image archive holds only files and directories"
    )]
    UnsupportedEntry { name: String, kind: String },
    #[error("image archive: entry {name:?} appears twice")]
    Duplicate { name: String },
    #[error("image archive: more than {max} {what}")]
    TooMany { what: &'static str, max: usize },
    #[error("image archive: {file} is larger than {max} bytes")]
    JsonTooLarge { file: String, max: u64 },
    #[error("image archive: {file}: {reason}")]
    Malformed { file: String, reason: String },
    #[error(
        "image archive: neither an OCI image layout (oci-layout, index.json) nor a docker save archive (manifest.json)"
    )]
    UnknownFormat,
    #[error("image archive: {file}, named by {referenced_by}, is not in the archive")]
    Missing { file: String, referenced_by: String },
    #[error("image archive: {file}: content hashes to {actual}, not the digest of its name")]
    BlobMismatch { file: String, actual: Digest },
    #[error(
        "image archive: {file}: {referenced_by} declares {declared} bytes, the archive holds {actual}"
    )]
    SizeMismatch {
        file: String,
        referenced_by: String,
        declared: u64,
        actual: u64,
    },
    #[error("image archive: {file}: unsupported media type {media_type:?} for the {what}")]
    UnsupportedMediaType {
        file: String,
        what: &'static str,
        media_type: String,
    },
    /// A manifest or index refused by the same checks as a pulled one.
    #[error("image archive: {file}: {source}")]
    Manifest {
        file: String,
        #[source]
        source: Box<PullError>,
    },
    #[error("image archive: the image {manifest} has no name ({what}); give one (--name REF)")]
    Unnamed {
        manifest: Digest,
        what: &'static str,
    },
    #[error("image archive: {reason}")]
    Ambiguous { reason: String },
    #[error("image archive: {file}: {source}")]
    Reference {
        file: String,
        #[source]
        source: ReferenceError,
    },
    #[error("image archive: {reference} pins {pinned}, but the archive's image is {manifest}")]
    PinnedDigest {
        reference: String,
        pinned: Digest,
        manifest: Digest,
    },
    #[error("image archive: {file}: storing it: {source}")]
    Blob {
        file: String,
        #[source]
        source: BlobError,
    },
    /// Preparing the image (a layer refused, its config refused) or the store failed.
    #[error(transparent)]
    Store(#[from] ImageStoreError),
    #[error("image archive: the reading task failed: {0}")]
    Task(String),
}

impl ImportError {
    /// True when the same archive may import later as it is (a full disk, an I/O error of the
    /// store); a hostile or malformed archive is not.
    pub fn is_transient(&self) -> bool {
        match self {
            Self::Store(err) => err.is_transient(),
            Self::Blob { source, .. } => matches!(source, BlobError::Io(_)),
            Self::Task(_) => true,
            _ => false,
        }
    }
}

/// A file of the archive, by its normalised name.
#[derive(Clone, Debug)]
enum File {
    Json(Vec<u8>),
    Blob { digest: Digest, size: u64 },
}

/// What reading the archive produced.
#[derive(Debug)]
struct Archive {
    files: BTreeMap<String, File>,
    /// Blobs this import put into the store (those already there are not its to remove).
    stored: Vec<Digest>,
    /// Every blob of the archive, stored or found present, held from a prune until the
    /// import has indexed its images (or given up) under the store's busy lock.
    holds: Option<BlobHolds>,
}

impl Archive {
    fn json(&self, name: &str) -> Option<&[u8]> {
        match self.files.get(name) {
            Some(File::Json(bytes)) => Some(bytes),
            _ => None,
        }
    }

    fn blob(&self, name: &str, referenced_by: &str) -> Result<(Digest, u64), ImportError> {
        match self.files.get(name) {
            Some(File::Blob { digest, size }) => Ok((digest.clone(), *size)),
            _ => Err(ImportError::Missing {
                file: name.to_owned(),
                referenced_by: referenced_by.to_owned(),
            }),
        }
    }
}

/// An image found in the archive, before it is named.
struct Found {
    entry: IndexEntry,
    manifest: Digest,
    /// The names the archive gives it (already parsed).
    names: Vec<(String, ImageRef)>,
}

impl ImageStore {
    /// Imports every image of `archive` (read on a blocking thread, as a stream), or the one
    /// image under `name`. Returns what was indexed, sorted by reference.
    pub async fn import<R: Read + Send + 'static>(
        &self,
        archive: R,
        name: Option<&str>,
        limits: &ImportLimits,
    ) -> Result<Vec<Imported>, ImportError> {
        // A bad --name is refused before a byte is read.
        let name = name
            .map(|n| {
                self.resolve(n).map_err(|source| ImportError::Reference {
                    file: "the name given".to_owned(),
                    source,
                })
            })
            .transpose()?;
        let blobs = Arc::clone(self.blobs());
        let read_limits = limits.clone();
        let (archive, read_error) =
            tokio::task::spawn_blocking(move || read_archive(archive, &blobs, &read_limits))
                .await
                .map_err(|err| ImportError::Task(err.to_string()))?;
        let _busy = self.lock_busy().await;
        let mut archive = archive;
        let result = match read_error {
            Some(err) => Err(err),
            None => self.index_archive(&archive, name.as_ref(), limits).await,
        };
        // Indexed or given up, under the busy lock: no prune can come between, and the blobs
        // no longer need holding.
        drop(archive.holds.take());
        // Whatever happened: the blobs brought and not indexed go (a failed import leaves
        // none, a successful one only what its images use).
        if let Err(err) = self.remove_unreferenced(&archive.stored) {
            tracing::warn!(%err, "blobs of an import not removed (a prune removes them)");
        }
        result
    }

    async fn index_archive(
        &self,
        archive: &Archive,
        name: Option<&ImageRef>,
        limits: &ImportLimits,
    ) -> Result<Vec<Imported>, ImportError> {
        let found = if archive.files.contains_key(OCI_INDEX_FILE)
            || archive.files.contains_key(OCI_LAYOUT)
        {
            self.oci_images(archive, limits)?
        } else if archive.files.contains_key(DOCKER_MANIFEST_FILE) {
            self.docker_images(archive, limits)?
        } else {
            return Err(ImportError::UnknownFormat);
        };
        let mut keys: BTreeMap<String, (IndexEntry, Digest)> = BTreeMap::new();
        match name {
            Some(name) => {
                let distinct: BTreeSet<&Digest> = found.iter().map(|f| &f.manifest).collect();
                let [image] = found.as_slice() else {
                    return Err(ImportError::Ambiguous {
                        reason: format!(
                            "--name names one image, but the archive holds {} ({})",
                            distinct.len(),
                            found
                                .iter()
                                .map(|f| f.manifest.to_string())
                                .collect::<Vec<_>>()
                                .join(", ")
                        ),
                    });
                };
                keys.insert(
                    name.to_string(),
                    (image.entry.clone(), image.manifest.clone()),
                );
            }
            None => {
                for image in &found {
                    if image.names.is_empty() {
                        return Err(ImportError::Unnamed {
                            manifest: image.manifest.clone(),
                            what: "no RepoTags, no org.opencontainers.image.ref.name annotation",
                        });
                    }
                    for (_, reference) in &image.names {
                        let key = reference.to_string();
                        if let Some((_, other)) = keys.get(&key)
                            && *other != image.manifest
                        {
                            return Err(ImportError::Ambiguous {
                                reason: format!(
                                    "{key} names two images ({other} and {})",
                                    image.manifest
                                ),
                            });
                        }
                        keys.insert(key, (image.entry.clone(), image.manifest.clone()));
                    }
                }
            }
        }
        let images: Vec<(String, IndexEntry, Vec<Digest>)> = keys
            .iter()
            .map(|(key, (entry, manifest))| {
                if let Ok(reference) = self.resolve(key)
                    && let Some(pinned) = reference.digest()
                    && pinned != manifest
                {
                    return Err(ImportError::PinnedDigest {
                        reference: key.clone(),
                        pinned: pinned.clone(),
                        manifest: manifest.clone(),
                    });
                }
                let downloaded = archive
                    .stored
                    .iter()
                    .filter(|d| {
                        entry.config == d.to_string()
                            || entry.layers.iter().any(|l| l.digest == d.to_string())
                    })
                    .cloned()
                    .collect();
                Ok((key.clone(), entry.clone(), downloaded))
            })
            .collect::<Result<_, _>>()?;
        let prepared = self.prepare_and_record(images).await?;
        for image in &prepared {
            tracing::info!(image = %image.reference, manifest = %image.manifest,
                root = ?image.root, "image imported");
        }
        Ok(keys
            .into_iter()
            .map(|(reference, (entry, _))| Imported { reference, entry })
            .collect())
    }

    /// The images of an OCI layout: `index.json`'s image manifests, and its nested indexes
    /// resolved to this host's platform.
    fn oci_images(
        &self,
        archive: &Archive,
        limits: &ImportLimits,
    ) -> Result<Vec<Found>, ImportError> {
        let layout = archive
            .json(OCI_LAYOUT)
            .ok_or_else(|| ImportError::Missing {
                file: OCI_LAYOUT.to_owned(),
                referenced_by: "the OCI image layout specification".to_owned(),
            })?;
        let layout: RawLayout = parse_json(OCI_LAYOUT, layout)?;
        if !layout.image_layout_version.starts_with("1.") {
            return Err(ImportError::Malformed {
                file: OCI_LAYOUT.to_owned(),
                reason: format!(
                    "imageLayoutVersion {:?} (only 1.x is supported)",
                    layout.image_layout_version
                ),
            });
        }
        let index = archive
            .json(OCI_INDEX_FILE)
            .ok_or_else(|| ImportError::Missing {
                file: OCI_INDEX_FILE.to_owned(),
                referenced_by: "the OCI image layout specification".to_owned(),
            })?;
        let index: RawIndex = parse_json(OCI_INDEX_FILE, index)?;
        if index.manifests.len() > limits.max_images {
            return Err(ImportError::TooMany {
                what: "images in index.json",
                max: limits.max_images,
            });
        }
        let (os, architecture) = pull::host_platform();
        let mut found = Vec::new();
        for (at, raw) in index.manifests.iter().enumerate() {
            let field = format!("index.json manifests[{at}]");
            let digest = Digest::parse(&raw.digest).map_err(|err| ImportError::Malformed {
                file: OCI_INDEX_FILE.to_owned(),
                reason: format!("{field}: {err}"),
            })?;
            // An image for another platform in a multi-platform layout is not this node's.
            if let Some(platform) = &raw.platform
                && (platform.os.as_deref().is_some_and(|o| o != os)
                    || platform
                        .architecture
                        .as_deref()
                        .is_some_and(|a| a != architecture))
            {
                continue;
            }
            let media_type = raw.media_type.as_deref().unwrap_or_default();
            let manifest = match media_type {
                pull::OCI_MANIFEST | pull::DOCKER_MANIFEST => digest,
                pull::OCI_INDEX | pull::DOCKER_MANIFEST_LIST => {
                    let file = blob_name(&digest);
                    let body = self.read_json_blob(archive, &file, &field, raw.size, limits)?;
                    match pull::parse_manifest(&file, &body)
                        .map_err(|source| manifest_err(&file, source))?
                    {
                        Manifest::Index(entries) => pull::choose_platform(&file, &entries)
                            .map_err(|source| manifest_err(&file, source))?,
                        Manifest::Image(_) => {
                            return Err(ImportError::Malformed {
                                file,
                                reason: format!("{field} says an index, it is an image manifest"),
                            });
                        }
                    }
                }
                other => {
                    return Err(ImportError::UnsupportedMediaType {
                        file: OCI_INDEX_FILE.to_owned(),
                        what: "manifest",
                        media_type: other.to_owned(),
                    });
                }
            };
            // The name: containerd's full name first (its ref.name is the tag alone).
            let annotations = raw.annotations.clone().unwrap_or_default();
            let names = match annotations
                .get(CONTAINERD_NAME)
                .or_else(|| annotations.get(REF_NAME))
            {
                Some(given) => vec![(given.clone(), self.parse_name(OCI_INDEX_FILE, given)?)],
                None => Vec::new(),
            };
            let declared = if manifest.to_string() == raw.digest {
                Some(raw.size)
            } else {
                None
            };
            found.push(self.oci_image(archive, &manifest, &field, declared, names, limits)?);
        }
        if found.is_empty() && !index.manifests.is_empty() {
            return Err(manifest_err(
                OCI_INDEX_FILE,
                PullError::UnsupportedPlatform {
                    reference: OCI_INDEX_FILE.to_owned(),
                    os,
                    architecture,
                    available: "only other platforms".to_owned(),
                },
            ));
        }
        if found.is_empty() {
            return Err(ImportError::Malformed {
                file: OCI_INDEX_FILE.to_owned(),
                reason: "it lists no manifest".to_owned(),
            });
        }
        Ok(found)
    }

    /// One image manifest of an OCI layout, its config and layers checked against the archive.
    fn oci_image(
        &self,
        archive: &Archive,
        manifest: &Digest,
        field: &str,
        declared: Option<i64>,
        names: Vec<(String, ImageRef)>,
        limits: &ImportLimits,
    ) -> Result<Found, ImportError> {
        let file = blob_name(manifest);
        let body = match declared {
            Some(size) => self.read_json_blob(archive, &file, field, size, limits)?,
            // Chosen from a nested index, whose size parse_manifest does not keep: bounded
            // by the limit alone.
            None => self.read_json_blob(archive, &file, field, -1, limits)?,
        };
        let image = match pull::parse_manifest(&file, &body)
            .map_err(|source| manifest_err(&file, source))?
        {
            Manifest::Image(image) => image,
            Manifest::Index(_) => {
                return Err(ImportError::Malformed {
                    file,
                    reason: "an image manifest was expected, it is an index".to_owned(),
                });
            }
        };
        let pull_limits = self.pull_limits();
        if image.layers.len() > pull_limits.max_layers {
            return Err(ImportError::TooMany {
                what: "layers in a manifest",
                max: pull_limits.max_layers,
            });
        }
        if image.config.size > pull_limits.max_config_bytes {
            return Err(ImportError::JsonTooLarge {
                file: blob_name(&image.config.digest),
                max: pull_limits.max_config_bytes,
            });
        }
        let check = |blob: &pull::BlobRef| -> Result<(), ImportError> {
            let name = blob_name(&blob.digest);
            let (_, actual) = archive.blob(&name, &file)?;
            if actual != blob.size {
                return Err(ImportError::SizeMismatch {
                    file: name,
                    referenced_by: file.clone(),
                    declared: blob.size,
                    actual,
                });
            }
            Ok(())
        };
        check(&image.config)?;
        for layer in &image.layers {
            check(&layer.blob)?;
        }
        let size = image
            .layers
            .iter()
            .fold(image.config.size, |sum, l| sum.saturating_add(l.blob.size));
        Ok(Found {
            entry: IndexEntry {
                manifest: manifest.to_string(),
                config: image.config.digest.to_string(),
                layers: image
                    .layers
                    .iter()
                    .map(|l| IndexLayer {
                        digest: l.blob.digest.to_string(),
                        gzip: l.compression == super::unpack::Compression::Gzip,
                    })
                    .collect(),
                size,
                pulled_at: now_secs(),
            },
            manifest: manifest.clone(),
            names,
        })
    }

    /// The images of a `docker save` archive. Its layers are named by image ids, not digests,
    /// and it has no manifest: the digests are those of the content, and the image's identity
    /// is the digest of the OCI manifest that describes exactly these blobs.
    fn docker_images(
        &self,
        archive: &Archive,
        limits: &ImportLimits,
    ) -> Result<Vec<Found>, ImportError> {
        let text = archive.json(DOCKER_MANIFEST_FILE).unwrap_or_default();
        let images: Vec<RawDockerImage> = parse_json(DOCKER_MANIFEST_FILE, text)?;
        if images.len() > limits.max_images {
            return Err(ImportError::TooMany {
                what: "images in manifest.json",
                max: limits.max_images,
            });
        }
        if images.is_empty() {
            return Err(ImportError::Malformed {
                file: DOCKER_MANIFEST_FILE.to_owned(),
                reason: "it lists no image".to_owned(),
            });
        }
        let pull_limits = self.pull_limits();
        let mut found = Vec::new();
        for (at, raw) in images.iter().enumerate() {
            let field = format!("manifest.json [{at}]");
            let config_name = normalise(&raw.config).map_err(|reason| ImportError::Malformed {
                file: DOCKER_MANIFEST_FILE.to_owned(),
                reason: format!("{field}.Config {:?}: {reason}", raw.config),
            })?;
            let (config, config_size) = archive.blob(&config_name, &format!("{field}.Config"))?;
            if config_size > pull_limits.max_config_bytes {
                return Err(ImportError::JsonTooLarge {
                    file: config_name,
                    max: pull_limits.max_config_bytes,
                });
            }
            if raw.layers.len() > pull_limits.max_layers {
                return Err(ImportError::TooMany {
                    what: "layers in manifest.json",
                    max: pull_limits.max_layers,
                });
            }
            let mut layers = Vec::new();
            let mut descriptors = Vec::new();
            let mut size = config_size;
            for (n, layer) in raw.layers.iter().enumerate() {
                let layer_field = format!("{field}.Layers[{n}]");
                let layer_name = normalise(layer).map_err(|reason| ImportError::Malformed {
                    file: DOCKER_MANIFEST_FILE.to_owned(),
                    reason: format!("{layer_field} {layer:?}: {reason}"),
                })?;
                let (digest, layer_size) = archive.blob(&layer_name, &layer_field)?;
                // What the file is, from its first bytes: docker save writes plain tars,
                // other tools may have kept them compressed.
                let gzip = match self.magic(&digest, &layer_name)? {
                    Magic::Gzip => true,
                    Magic::Zstd => {
                        return Err(ImportError::UnsupportedMediaType {
                            file: layer_name,
                            what: "layer",
                            media_type: "zstd-compressed tar".to_owned(),
                        });
                    }
                    Magic::Other => false,
                };
                size = size.saturating_add(layer_size);
                descriptors.push(serde_json::json!({
                    "mediaType": if gzip { pull::OCI_LAYER_GZIP } else { pull::OCI_LAYER },
                    "digest": digest.to_string(),
                    "size": layer_size,
                }));
                layers.push(IndexLayer {
                    digest: digest.to_string(),
                    gzip,
                });
            }
            let manifest = serde_json::json!({
                "schemaVersion": 2,
                "mediaType": pull::OCI_MANIFEST,
                "config": {
                    "mediaType": pull::OCI_CONFIG,
                    "digest": config.to_string(),
                    "size": config_size,
                },
                "layers": descriptors,
            });
            let manifest = Digest::of(manifest.to_string().as_bytes());
            let mut names = Vec::new();
            for tag in raw.repo_tags.iter().flatten() {
                names.push((tag.clone(), self.parse_name(DOCKER_MANIFEST_FILE, tag)?));
            }
            found.push(Found {
                entry: IndexEntry {
                    manifest: manifest.to_string(),
                    config: config.to_string(),
                    layers,
                    size,
                    pulled_at: now_secs(),
                },
                manifest,
                names,
            });
        }
        Ok(found)
    }

    fn parse_name(&self, file: &str, given: &str) -> Result<ImageRef, ImportError> {
        self.resolve(given)
            .map_err(|source| ImportError::Reference {
                file: file.to_owned(),
                source,
            })
    }

    /// A manifest or index blob of the archive, read with a bound; `declared` (negative:
    /// unknown) must be its size.
    fn read_json_blob(
        &self,
        archive: &Archive,
        file: &str,
        referenced_by: &str,
        declared: i64,
        limits: &ImportLimits,
    ) -> Result<Vec<u8>, ImportError> {
        let (digest, size) = archive.blob(file, referenced_by)?;
        if declared >= 0 && u64::try_from(declared).ok() != Some(size) {
            return Err(ImportError::SizeMismatch {
                file: file.to_owned(),
                referenced_by: referenced_by.to_owned(),
                declared: u64::try_from(declared).unwrap_or(0),
                actual: size,
            });
        }
        let max = limits.max_json_bytes;
        if size > max {
            return Err(ImportError::JsonTooLarge {
                file: file.to_owned(),
                max,
            });
        }
        let mut body = Vec::new();
        self.blobs()
            .open_blob(&digest)
            .map_err(|source| ImportError::Blob {
                file: file.to_owned(),
                source,
            })?
            .take(max + 1)
            .read_to_end(&mut body)
            .map_err(|source| ImportError::Read { source })?;
        if body.len() as u64 > max {
            return Err(ImportError::JsonTooLarge {
                file: file.to_owned(),
                max,
            });
        }
        Ok(body)
    }

    fn magic(&self, digest: &Digest, file: &str) -> Result<Magic, ImportError> {
        let mut head = [0u8; 4];
        let mut blob = self
            .blobs()
            .open_blob(digest)
            .map_err(|source| ImportError::Blob {
                file: file.to_owned(),
                source,
            })?;
        let mut got = 0;
        while got < head.len() {
            match blob.read(head.get_mut(got..).unwrap_or_default()) {
                Ok(0) => break,
                Ok(n) => got += n,
                Err(err) if err.kind() == io::ErrorKind::Interrupted => {}
                Err(source) => return Err(ImportError::Read { source }),
            }
        }
        Ok(match head {
            [0x1f, 0x8b, ..] => Magic::Gzip,
            [0x28, 0xb5, 0x2f, 0xfd] => Magic::Zstd,
            _ => Magic::Other,
        })
    }
}

enum Magic {
    Gzip,
    Zstd,
    Other,
}

fn manifest_err(file: &str, source: PullError) -> ImportError {
    ImportError::Manifest {
        file: file.to_owned(),
        source: Box::new(source),
    }
}

fn blob_name(digest: &Digest) -> String {
    format!("blobs/{ALGORITHM}/{}", digest.hex())
}

fn parse_json<'a, T: Deserialize<'a>>(file: &str, bytes: &'a [u8]) -> Result<T, ImportError> {
    serde_json::from_slice(bytes).map_err(|err| ImportError::Malformed {
        file: file.to_owned(),
        reason: err.to_string(),
    })
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct RawLayout {
    image_layout_version: String,
}

#[derive(Deserialize)]
struct RawIndex {
    #[serde(default)]
    manifests: Vec<RawIndexEntry>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct RawIndexEntry {
    media_type: Option<String>,
    digest: String,
    size: i64,
    platform: Option<RawPlatform>,
    annotations: Option<BTreeMap<String, String>>,
}

#[derive(Deserialize)]
struct RawPlatform {
    os: Option<String>,
    architecture: Option<String>,
}

#[derive(Deserialize)]
#[serde(rename_all = "PascalCase")]
struct RawDockerImage {
    config: String,
    repo_tags: Option<Vec<String>>,
    layers: Vec<String>,
}

/// An entry name as a lookup key: `./` and empty components dropped (`./a//b` is `a/b`), so
/// that two spellings of one name are caught as a duplicate. Refused: `..`, an absolute name,
/// NUL, non-UTF-8, over [`MAX_NAME_BYTES`].
fn normalise(name: &str) -> Result<String, &'static str> {
    if name.len() > MAX_NAME_BYTES {
        return Err("the name is longer than 4096 bytes");
    }
    if name.starts_with('/') {
        return Err("an absolute name");
    }
    if name.contains('\0') {
        return Err("a NUL byte in the name");
    }
    let mut parts = Vec::new();
    for part in name.split('/') {
        match part {
            "" | "." => {}
            ".." => return Err("a \"..\" component"),
            part => parts.push(part),
        }
    }
    Ok(parts.join("/"))
}

/// True when the symlink `name -> target` is relative and, resolved lexically from `name`'s
/// directory, stays inside the archive (and is not itself a blob or JSON file's name, which
/// only content may claim).
fn stays_inside(name: &str, target: &str) -> bool {
    if target.is_empty() || target.starts_with('/') || target.contains('\0') {
        return false;
    }
    if name.starts_with("blobs/") || JSON_FILES.contains(&name) {
        return false;
    }
    let mut parts: Vec<&str> = name.split('/').collect();
    parts.pop();
    for part in target.split('/') {
        match part {
            "" | "." => {}
            ".." => {
                if parts.pop().is_none() {
                    return false;
                }
            }
            part => parts.push(part),
        }
    }
    !parts.is_empty()
}

/// Counts what is read and fails once past the limit, remembering that it did.
struct Bounded<R> {
    inner: R,
    read: u64,
    max: u64,
    over: Arc<AtomicBool>,
}

impl<R: Read> Read for Bounded<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.read = self.read.saturating_add(n as u64);
        if self.read > self.max {
            self.over.store(true, Ordering::SeqCst);
            return Err(io::Error::other(format!(
                "more than {} bytes of archive",
                self.max
            )));
        }
        Ok(n)
    }
}

/// Reads the archive as a stream: small JSON files into memory, every other file into the
/// blob store. Returns what it read (also on failure, for the cleanup) and the error, if any.
fn read_archive<R: Read>(
    source: R,
    blobs: &Arc<BlobStore>,
    limits: &ImportLimits,
) -> (Archive, Option<ImportError>) {
    let mut archive = Archive {
        files: BTreeMap::new(),
        stored: Vec::new(),
        holds: None,
    };
    let mut holds = blobs.holds();
    let over = Arc::new(AtomicBool::new(false));
    let bounded = Bounded {
        inner: source,
        read: 0,
        max: limits.max_archive_bytes,
        over: Arc::clone(&over),
    };
    let result = read_entries(bounded, blobs, limits, &mut archive, &mut holds);
    archive.holds = Some(holds);
    let error = match result {
        Ok(()) => None,
        // Whatever the error looked like on the way up, it was the limit.
        Err(_) if over.load(Ordering::SeqCst) => Some(ImportError::TooLarge {
            max: limits.max_archive_bytes,
        }),
        Err(err) => Some(err),
    };
    (archive, error)
}

fn read_entries<R: Read>(
    source: R,
    blobs: &BlobStore,
    limits: &ImportLimits,
    archive: &mut Archive,
    holds: &mut BlobHolds,
) -> Result<(), ImportError> {
    let mut tar = tar::Archive::new(source);
    let entries = tar
        .entries()
        .map_err(|source| ImportError::Read { source })?;
    let mut count = 0usize;
    let mut seen = BTreeSet::new();
    for entry in entries {
        let mut entry = entry.map_err(|source| ImportError::Read { source })?;
        count += 1;
        if count > limits.max_entries {
            return Err(ImportError::TooMany {
                what: "entries",
                max: limits.max_entries,
            });
        }
        let raw = String::from_utf8_lossy(&entry.path_bytes()).into_owned();
        let name = normalise(&raw).map_err(|reason| ImportError::UnsafeName {
            name: raw.chars().take(200).collect(),
            reason,
        })?;
        let kind = entry.header().entry_type();
        match kind {
            tar::EntryType::Directory => continue,
            // PAX global headers carry no file.
            tar::EntryType::XGlobalHeader => continue,
            tar::EntryType::Regular | tar::EntryType::Continuous => {}
            // `docker save` (and skopeo's docker-archive) add `<id>/layer.tar ->
            // ../<hex>.tar` for the legacy format; manifest.json names the files themselves.
            // Such a link is skipped: never created, never followed, never looked up. Any
            // other link (absolute, or leading out of the archive) is refused.
            tar::EntryType::Symlink => {
                let target = entry
                    .link_name_bytes()
                    .map(|t| String::from_utf8_lossy(&t).into_owned())
                    .unwrap_or_default();
                if !stays_inside(&name, &target) {
                    return Err(ImportError::UnsupportedEntry {
                        name,
                        kind: format!("symlink to {target:?}"),
                    });
                }
                if !seen.insert(name.clone()) {
                    return Err(ImportError::Duplicate { name });
                }
                continue;
            }
            tar::EntryType::Link => {
                return Err(ImportError::UnsupportedEntry {
                    name,
                    kind: "hard link".to_owned(),
                });
            }
            other => {
                return Err(ImportError::UnsupportedEntry {
                    name,
                    kind: format!("{other:?}"),
                });
            }
        }
        if !seen.insert(name.clone()) {
            return Err(ImportError::Duplicate { name });
        }
        if JSON_FILES.contains(&name.as_str()) {
            let max = limits.max_json_bytes;
            let mut bytes = Vec::new();
            (&mut entry)
                .take(max + 1)
                .read_to_end(&mut bytes)
                .map_err(|source| ImportError::Read { source })?;
            if bytes.len() as u64 > max {
                return Err(ImportError::JsonTooLarge { file: name, max });
            }
            archive.files.insert(name, File::Json(bytes));
            continue;
        }
        let blob_err = |name: &str| {
            let name = name.to_owned();
            move |source| ImportError::Blob { file: name, source }
        };
        let (digest, size, put) = if let Some(hex) = name.strip_prefix("blobs/") {
            let expected = Digest::parse(&hex.replacen('/', ":", 1)).map_err(|err| {
                ImportError::Malformed {
                    file: name.clone(),
                    reason: format!("not a blob name: {err}"),
                }
            })?;
            // The content decides: it must hash to its name's digest, or nothing is kept.
            let size = entry.size();
            // Held before it is looked for: a prune cannot remove it, present or stored,
            // before this import indexes it.
            holds.hold(&expected);
            let put = blobs
                .put(&mut entry, &expected, size)
                .map_err(|source| match source {
                    BlobError::DigestMismatch { actual, .. } => ImportError::BlobMismatch {
                        file: name.clone(),
                        actual,
                    },
                    source => blob_err(&name)(source),
                })?;
            // A blob already in the store was not read from the archive: its size is the
            // stored (verified) one, not what the header claims.
            let size = match put {
                Put::Stored => size,
                Put::AlreadyPresent => blobs.size_of(&expected).map_err(blob_err(&name))?,
            };
            (expected, size, put)
        } else {
            blobs
                .put_computed(&mut entry, limits.max_archive_bytes, holds)
                .map_err(blob_err(&name))?
        };
        if put == Put::Stored {
            archive.stored.push(digest.clone());
        }
        archive.files.insert(name, File::Blob { digest, size });
    }
    Ok(())
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    #[test]
    fn names_are_normalised_and_hostile_ones_refused() {
        assert_eq!(normalise("./blobs//sha256/ab").unwrap(), "blobs/sha256/ab");
        assert_eq!(normalise("index.json").unwrap(), "index.json");
        for bad in ["../x", "a/../../x", "/etc/passwd", "a\0b"] {
            assert!(normalise(bad).is_err(), "{bad:?} accepted");
        }
        assert!(normalise(&"a".repeat(5000)).is_err());
    }

    #[test]
    fn only_docker_legacy_links_inside_the_archive_pass() {
        assert!(stays_inside("abc/layer.tar", "../def.tar"));
        for (name, target) in [
            ("abc/layer.tar", "/etc/passwd"),
            ("abc/layer.tar", "../../x"),
            ("layer.tar", "../x"),
            ("blobs/sha256/ab", "../cd"),
            ("index.json", "other.json"),
            ("a", ""),
        ] {
            assert!(!stays_inside(name, target), "{name} -> {target} passed");
        }
    }
}
