//! The file layer of the store: atomic, fsynced file writes (secrets files, component
//! records), the record envelope, and the per-volume record files of csi-agent's first
//! release, which are read only to migrate them into the database (`store/migrate.rs`).
//!
//! This module owns the bytes on disk under `csi/<type>/<name>/volumes/` and
//! `csi/<type>/<name>/quarantine/`, and the envelope format every record is written in. It
//! must not interpret records (their types belong to the volume manager), must not decide
//! what to do about a lost record (it reports; recovery decides), must never log or echo
//! secret contents, and must never crash the daemon because of what it finds on disk.
//!
//! # Record format
//! Every record is a JSON envelope `{"schema_version": N, "record": <T>}`. `T` implements
//! [`Record`], which names the version this build writes (`SCHEMA_VERSION`) and may upgrade
//! older versions ([`Record::upgrade`]). A record with a version this build cannot read (newer,
//! or older without an upgrade) is unreadable, like a truncated or corrupt one. The secrets
//! file uses the same shape with a fixed envelope version: `{"schema_version": 1, "secrets": S}`.
//!
//! # Durability
//! [`write_atomic`] is [`durable::write_atomic`]: temp file in the same directory (created
//! 0600, named `.tmp-<file name>-<pid>-<random>`), write, fsync the file, rename over the
//! target, fsync the directory: one fsync of the file and one of the directory per write,
//! plus one per directory it had to create. A temp file left by a writer that died is ignored
//! by loads and removed by [`FileStore::load_all`] and [`FileStore::delete_volume`], in the
//! current form and in the older one (`.<file name>.<pid>.<n>.tmp`), which a daemon of an
//! earlier version may have left.
//!
//! # Permissions
//! `csi/` is 0700 (created so, tightened by [`FileStore::open`] if it was looser), every directory
//! this module creates is 0700 and every file it writes is 0600, from its creation on.
//!
//! # Quarantine
//! An unreadable entry of `volumes/` (corrupt, truncated, unknown version, a name that does
//! not decode to a volume id, not a directory) is moved whole, secrets included, to
//! `csi/<type>/<name>/quarantine/<entry name>.<unix seconds>[-<n>]` and reported. Nothing
//! there is ever read again or deleted by the daemon; it is kept for an operator.

use std::ffi::{OsStr, OsString};
use std::fs::{self, OpenOptions};
use std::io;
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use crate::durable::{self, IoError, io_err};
use crate::failpoint::{self, FailpointError};
use crate::layout::{Layout, decode_id, encode_id};
use crate::metrics::Metrics;

/// Failpoint hit after the temp file is written and fsynced, before it replaces the target.
/// Dying here must leave the old record intact.
pub const FP_WRITE_BEFORE_RENAME: &str = "store.write.before_rename";
/// Failpoint hit after the rename and the directory fsync: the new record is durable.
pub const FP_WRITE_AFTER_RENAME: &str = "store.write.after_rename";

/// The volume record inside `volumes/<enc id>/`.
pub const VOLUME_RECORD_FILE: &str = "volume.json";
/// The volume's secrets inside `volumes/<enc id>/` (0600).
pub const SECRETS_FILE: &str = "secrets.json";
/// Where unreadable entries of `volumes/` are moved, inside the plugin dir.
pub const QUARANTINE_DIR: &str = "quarantine";

const DIR_MODE: u32 = 0o700;
const FILE_MODE: u32 = 0o600;
/// Version of the secrets envelope (the shape of the map inside is the caller's).
const SECRETS_SCHEMA_VERSION: u32 = 1;
/// Quarantine names keep at most this many bytes of the original name, so that the suffix
/// still fits in NAME_MAX (255).
const QUARANTINE_NAME_MAX: usize = 200;

/// A type stored as a durable record.
pub trait Record: Serialize + DeserializeOwned {
    /// The schema version this build writes and reads. Bump it on any change an older build
    /// could misread; never reuse a number.
    const SCHEMA_VERSION: u32;

    /// Converts a record written with an older `from_version`. `None` (the default) means the
    /// version is unknown: the record is reported unreadable and moved aside.
    fn upgrade(from_version: u32, record: serde_json::Value) -> Option<Result<Self, UpgradeError>> {
        let _ = (from_version, record);
        None
    }
}

/// Errors of store operations. A record that cannot be read is [`StoreError::Unreadable`]
/// from the single-record functions; [`FileStore::load_all`] reports it as a [`Problem`] instead.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error(transparent)]
    Io(#[from] IoError),
    #[error("cannot encode the record for {}: {source}", path.display())]
    Encode {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
    #[error("{} is unreadable: {reason}", path.display())]
    Unreadable { path: PathBuf, reason: Unreadable },
    #[error(transparent)]
    Failpoint(#[from] FailpointError),
    #[error(transparent)]
    Commit(#[from] super::db::CommitError),
    #[error(transparent)]
    Open(#[from] super::db::OpenError),
    #[error("reading the state database {}: {source}", path.display())]
    Read {
        path: PathBuf,
        #[source]
        source: rusqlite::Error,
    },
}

/// Why [`Record::upgrade`] could not convert an older record: what the record type found
/// wrong with it, in its own words (each record type has its own fields; the reason is kept
/// as text so that [`Unreadable`] stays comparable and clonable for the problem reports).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{reason}")]
pub struct UpgradeError {
    pub reason: String,
}

impl From<&str> for UpgradeError {
    fn from(reason: &str) -> Self {
        Self {
            reason: reason.to_owned(),
        }
    }
}

/// Why a record could not be read.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Unreadable {
    /// Not JSON, truncated, missing fields, or a record that does not fit its type.
    #[error("corrupt: {0}")]
    Corrupt(String),
    #[error("schema_version {found} is not supported (this build reads {supported})")]
    UnknownVersion { found: u32, supported: u32 },
    #[error("upgrade from schema_version {from} failed: {reason}")]
    UpgradeFailed { from: u32, reason: UpgradeError },
}

#[derive(Serialize)]
struct EnvelopeOut<'a, T> {
    schema_version: u32,
    record: &'a T,
}

#[derive(Deserialize)]
struct EnvelopeIn<T> {
    schema_version: u32,
    record: T,
}

#[derive(Serialize)]
struct SecretsOut<'a, S> {
    schema_version: u32,
    secrets: &'a S,
}

#[derive(Deserialize)]
struct SecretsIn<S> {
    schema_version: u32,
    secrets: S,
}

/// Serializes a record in its envelope.
pub fn encode_record<T: Record>(record: &T) -> Result<Vec<u8>, serde_json::Error> {
    serde_json::to_vec(&EnvelopeOut {
        schema_version: T::SCHEMA_VERSION,
        record,
    })
}

/// Parses a record from its envelope, upgrading an older version if `T` knows how.
pub fn decode_record<T: Record>(bytes: &[u8]) -> Result<T, Unreadable> {
    // The common case parses once; only a failure or another version parses again, to say
    // precisely what is wrong.
    let typed_error = match serde_json::from_slice::<EnvelopeIn<T>>(bytes) {
        Ok(envelope) if envelope.schema_version == T::SCHEMA_VERSION => {
            return Ok(envelope.record);
        }
        Ok(_) => None,
        Err(err) => Some(err),
    };
    let envelope: EnvelopeIn<serde_json::Value> =
        serde_json::from_slice(bytes).map_err(|err| Unreadable::Corrupt(err.to_string()))?;
    let found = envelope.schema_version;
    match found.cmp(&T::SCHEMA_VERSION) {
        std::cmp::Ordering::Equal => Err(Unreadable::Corrupt(
            typed_error.map_or_else(|| "record does not fit".to_owned(), |e| e.to_string()),
        )),
        std::cmp::Ordering::Less => match T::upgrade(found, envelope.record) {
            Some(Ok(record)) => Ok(record),
            Some(Err(reason)) => Err(Unreadable::UpgradeFailed {
                from: found,
                reason,
            }),
            None => Err(Unreadable::UnknownVersion {
                found,
                supported: T::SCHEMA_VERSION,
            }),
        },
        std::cmp::Ordering::Greater => Err(Unreadable::UnknownVersion {
            found,
            supported: T::SCHEMA_VERSION,
        }),
    }
}

/// The temp-name suffix of csi-agent 0.x before the one durable-write helper: those files
/// (`.<file name>.<pid>.<n>.tmp`) may be left by a writer of an older version killed
/// mid-write, and are cleaned like the current ones (never our own: this build does not make
/// them).
const LEGACY_TMP_SUFFIX: &str = ".tmp";

/// A temp file of a writer: [`durable::temp_name`]'s form, or the legacy one.
fn is_temp_name(name: &OsStr) -> bool {
    durable::is_temp_name(name.as_bytes())
        || name.as_bytes().ends_with(LEGACY_TMP_SUFFIX.as_bytes())
}

/// True for a temp file this process may still be writing (its name carries our pid). Loads
/// leave those alone; any other temp file belongs to a writer that is gone.
fn is_own_temp(name: &OsStr) -> bool {
    durable::is_own_temp(name.as_bytes())
}

/// Replaces `path` with `bytes` atomically and durably ([`durable::write_atomic`]): a reader
/// sees the old content or the new one, never a mix, and once this returns `Ok` the new
/// content survives a crash or power cut. Missing parent directories are created (0700) and
/// made durable; the file is created 0600. Counts one checkpoint write and its fsync time.
pub fn write_atomic(
    path: &Path,
    bytes: &[u8],
    metrics: Option<&Metrics>,
) -> Result<(), StoreError> {
    let dir = durable::parent_of(path);
    let Some(file_name) = path.file_name().and_then(OsStr::to_str) else {
        return Err(IoError::new(
            "write",
            path,
            io::Error::new(io::ErrorKind::InvalidInput, "path has no UTF-8 file name"),
        )
        .into());
    };
    let mut fsync_time = Duration::ZERO;
    // Try first and create directories only on ENOENT: the common case (the directory
    // exists) then costs no extra syscall.
    let handle = match durable::Dir::open(dir) {
        Ok(handle) => handle,
        Err(err) if err.kind() == io::ErrorKind::NotFound => {
            fsync_time += durable::create_dir_durable(dir, DIR_MODE)?;
            durable::Dir::open(dir)?
        }
        Err(err) => return Err(err.into()),
    };
    fsync_time += durable::write_atomic(&handle, file_name, bytes, FILE_MODE, || {
        failpoint::hit(FP_WRITE_BEFORE_RENAME).map_err(StoreError::from)
    })?;
    if let Some(metrics) = metrics {
        metrics.checkpoint_writes.inc();
        metrics
            .checkpoint_fsync_seconds
            .observe(fsync_time.as_secs_f64());
    }
    failpoint::hit(FP_WRITE_AFTER_RENAME)?;
    Ok(())
}

/// The largest store file read (a record or a secrets file). csi-agent never writes one
/// near this size: a bigger file is not its own, and reading it would only burn memory.
pub const MAX_FILE_BYTES: u64 = 8 << 20;

/// Reads a store file, `None` when it does not exist. The file is hostile until proven
/// otherwise: opened with `O_NOFOLLOW` (a symlink to `/etc/shadow` is never read) and
/// `O_NONBLOCK` (a FIFO never blocks the open), then required to be a regular file of at most
/// [`MAX_FILE_BYTES`] (read bounded, in case it grows meanwhile). A file refused for what it is
/// is [`StoreError::Unreadable`] (corrupt), which recovery moves aside; a passing I/O error is
/// [`StoreError::Io`].
fn read_optional(path: &Path) -> Result<Option<Vec<u8>>, StoreError> {
    use std::io::Read;
    let refused = |reason: String| StoreError::Unreadable {
        path: path.to_path_buf(),
        reason: Unreadable::Corrupt(reason),
    };
    let file = match OpenOptions::new()
        .read(true)
        .custom_flags(
            (rustix::fs::OFlags::NOFOLLOW
                | rustix::fs::OFlags::NONBLOCK
                | rustix::fs::OFlags::NOCTTY)
                .bits() as i32,
        )
        .open(path)
    {
        Ok(file) => file,
        Err(err) if err.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(err) if err.raw_os_error() == Some(rustix::io::Errno::LOOP.raw_os_error()) => {
            return Err(refused("it is a symlink (never followed)".to_owned()));
        }
        Err(err) => return Err(StoreError::from(io_err("read", path)(err))),
    };
    let meta = file.metadata().map_err(io_err("stat", path))?;
    if meta.is_dir() {
        return Err(StoreError::from(io_err("read", path)(io::Error::from(
            io::ErrorKind::IsADirectory,
        ))));
    }
    if !meta.file_type().is_file() {
        return Err(refused(format!(
            "it is not a regular file ({})",
            file_kind(&meta.file_type())
        )));
    }
    if meta.len() > MAX_FILE_BYTES {
        return Err(refused(format!(
            "it is {} bytes, more than the {MAX_FILE_BYTES} a store file may have",
            meta.len()
        )));
    }
    let mut bytes = Vec::with_capacity(meta.len() as usize);
    file.take(MAX_FILE_BYTES + 1)
        .read_to_end(&mut bytes)
        .map_err(io_err("read", path))?;
    if bytes.len() as u64 > MAX_FILE_BYTES {
        return Err(refused(format!(
            "it grew past the {MAX_FILE_BYTES} bytes a store file may have"
        )));
    }
    Ok(Some(bytes))
}

fn file_kind(kind: &fs::FileType) -> &'static str {
    use std::os::unix::fs::FileTypeExt;
    if kind.is_fifo() {
        "a FIFO"
    } else if kind.is_socket() {
        "a socket"
    } else if kind.is_char_device() {
        "a character device"
    } else if kind.is_block_device() {
        "a block device"
    } else if kind.is_symlink() {
        "a symlink"
    } else {
        "not a file"
    }
}

/// Removes a file; `Ok(false)` when it did not exist.
fn remove_optional(path: &Path) -> Result<bool, StoreError> {
    match fs::remove_file(path) {
        Ok(()) => Ok(true),
        Err(err) if err.kind() == io::ErrorKind::NotFound => Ok(false),
        Err(err) => Err(StoreError::from(io_err("remove", path)(err))),
    }
}

/// Removes temp files of dead writers from `dir`. Returns how many were removed.
pub(crate) fn remove_stale_temps(dir: &Path) -> Result<usize, StoreError> {
    let entries = match fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(err) if err.kind() == io::ErrorKind::NotFound => return Ok(0),
        Err(err) => return Err(StoreError::from(io_err("list", dir)(err))),
    };
    let mut removed = 0;
    for entry in entries {
        let entry = entry.map_err(io_err("list", dir))?;
        let name = entry.file_name();
        if is_temp_name(&name) && !is_own_temp(&name) && remove_optional(&entry.path())? {
            removed += 1;
        }
    }
    Ok(removed)
}

/// A record loaded by [`FileStore::load_all`].
#[derive(Clone, Debug, PartialEq)]
pub struct Loaded<T> {
    pub volume_id: String,
    pub record: T,
}

/// What [`FileStore::load_all`] found: the good records (sorted by volume id) and the problems.
#[derive(Clone, Debug)]
pub struct LoadAll<T> {
    pub records: Vec<Loaded<T>>,
    pub problems: Vec<Problem>,
}

/// One entry of `volumes/` that did not yield a record. Its `Display` is fit for a log line
/// (it never contains secrets).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Problem {
    /// The entry in `volumes/` (where it was found).
    pub path: PathBuf,
    /// The volume id, when the entry's name decodes to one.
    pub volume_id: Option<String>,
    pub kind: ProblemKind,
    /// Where the entry was moved, if it was.
    pub moved_to: Option<PathBuf>,
    /// Why moving it aside failed, if it did (it is then reported again at the next load).
    pub move_error: Option<String>,
}

impl std::fmt::Display for Problem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.path.display(), self.kind)?;
        if let Some(moved_to) = &self.moved_to {
            write!(f, "; moved to {}", moved_to.display())?;
        }
        if let Some(err) = &self.move_error {
            write!(f, "; could not move it aside: {err}")?;
        }
        Ok(())
    }
}

#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ProblemKind {
    #[error("the name does not decode to a volume id")]
    UndecodableName,
    #[error("not a directory")]
    NotADirectory,
    #[error("record {0}")]
    Unreadable(Unreadable),
    /// The record could not be read for a reason that may pass (EIO, EACCES): left in place.
    #[error("cannot read the record: {0}")]
    Io(String),
    /// A volume dir without a record that holds unexpected files: left in place.
    #[error("no {VOLUME_RECORD_FILE} but unexpected files remain; left in place")]
    Leftover,
}

/// Durable volume records and secrets of every plugin under one work dir.
#[derive(Clone, Debug)]
pub struct FileStore {
    layout: Layout,
    metrics: Option<Arc<Metrics>>,
}

impl FileStore {
    /// Opens the store: creates `<work_dir>/csi` (0700) if needed and tightens it to 0700 if
    /// it is looser, so that the whole tree, secrets included, is private to the daemon.
    pub fn open(layout: Layout, metrics: Option<Arc<Metrics>>) -> Result<Self, StoreError> {
        let root = layout.csi_root();
        durable::create_dir_durable(&root, DIR_MODE)?;
        let meta = fs::metadata(&root).map_err(io_err("stat", &root))?;
        if meta.permissions().mode() & 0o077 != 0 {
            tracing::warn!(path = %root.display(), mode = format!("{:o}", meta.permissions().mode() & 0o7777), "tightening the state directory to 0700");
            fs::set_permissions(&root, fs::Permissions::from_mode(DIR_MODE))
                .map_err(io_err("chmod", &root))?;
        }
        Ok(Self { layout, metrics })
    }

    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    fn metrics(&self) -> Option<&Metrics> {
        self.metrics.as_deref()
    }

    /// `volumes/<enc id>/volume.json`.
    pub fn volume_record_path(
        &self,
        plugin_type: &str,
        plugin_name: &str,
        volume_id: &str,
    ) -> PathBuf {
        self.layout
            .volume_dir(plugin_type, plugin_name, volume_id)
            .join(VOLUME_RECORD_FILE)
    }

    /// `volumes/<enc id>/secrets.json`.
    pub fn secrets_path(&self, plugin_type: &str, plugin_name: &str, volume_id: &str) -> PathBuf {
        self.layout
            .volume_dir(plugin_type, plugin_name, volume_id)
            .join(SECRETS_FILE)
    }

    /// `csi/<type>/<name>/quarantine`.
    pub fn quarantine_dir(&self, plugin_type: &str, plugin_name: &str) -> PathBuf {
        self.layout
            .plugin_dir(plugin_type, plugin_name)
            .join(QUARANTINE_DIR)
    }

    /// Writes the volume record atomically and durably (one checkpoint write).
    pub fn save_volume<T: Record>(
        &self,
        plugin_type: &str,
        plugin_name: &str,
        volume_id: &str,
        record: &T,
    ) -> Result<(), StoreError> {
        let path = self.volume_record_path(plugin_type, plugin_name, volume_id);
        let bytes = encode_record(record).map_err(|source| StoreError::Encode {
            path: path.clone(),
            source,
        })?;
        write_atomic(&path, &bytes, self.metrics())
    }

    /// Reads the volume record; `Ok(None)` if there is none. An unreadable record is an
    /// error here and is left in place (only [`FileStore::load_all`] moves records aside).
    pub fn load_volume<T: Record>(
        &self,
        plugin_type: &str,
        plugin_name: &str,
        volume_id: &str,
    ) -> Result<Option<T>, StoreError> {
        let path = self.volume_record_path(plugin_type, plugin_name, volume_id);
        let Some(bytes) = read_optional(&path)? else {
            return Ok(None);
        };
        decode_record(&bytes)
            .map(Some)
            .map_err(|reason| StoreError::Unreadable { path, reason })
    }

    /// Forgets a volume: removes its record, then its secrets and any temp file of a dead
    /// writer, then its directory, and makes that durable. Removing the record first means a
    /// crash part-way leaves at worst a directory without a record, which [`FileStore::load_all`]
    /// finishes removing. Deleting an unknown volume succeeds. Counts one checkpoint write.
    pub fn delete_volume(
        &self,
        plugin_type: &str,
        plugin_name: &str,
        volume_id: &str,
    ) -> Result<(), StoreError> {
        let dir = self.layout.volume_dir(plugin_type, plugin_name, volume_id);
        let mut fsync_time = Duration::ZERO;
        let record_removed = remove_optional(&dir.join(VOLUME_RECORD_FILE))?;
        let secrets_removed = remove_optional(&dir.join(SECRETS_FILE))?;
        // Per-volume serialization (the volume manager's) means no write of this volume is
        // in flight, so every temp file here is stale, even one carrying our pid.
        remove_all_temps(&dir)?;
        match fs::remove_dir(&dir) {
            Ok(()) => fsync_time += durable::sync_dir(durable::parent_of(&dir))?,
            Err(err) if err.kind() == io::ErrorKind::NotFound => {
                if !record_removed && !secrets_removed {
                    return Ok(());
                }
            }
            Err(err) => {
                // Something unexpected is in the directory. The record is gone, which is
                // what matters: make the unlinks durable and leave the rest to an operator.
                tracing::warn!(dir = %dir.display(), %err, "volume directory not removed");
                fsync_time += durable::sync_dir(&dir)?;
            }
        }
        if let Some(metrics) = self.metrics() {
            metrics.checkpoint_writes.inc();
            metrics
                .checkpoint_fsync_seconds
                .observe(fsync_time.as_secs_f64());
        }
        Ok(())
    }

    /// Writes the volume's secrets to a 0600 file (0600 from its creation: there is no moment
    /// at which another user could read it). `S` is usually a map of maps of strings.
    pub fn save_secrets<S: Serialize>(
        &self,
        plugin_type: &str,
        plugin_name: &str,
        volume_id: &str,
        secrets: &S,
    ) -> Result<(), StoreError> {
        self.save_secrets_at(
            &self.secrets_path(plugin_type, plugin_name, volume_id),
            secrets,
        )
    }

    fn save_secrets_at<S: Serialize>(&self, path: &Path, secrets: &S) -> Result<(), StoreError> {
        let bytes = serde_json::to_vec(&SecretsOut {
            schema_version: SECRETS_SCHEMA_VERSION,
            secrets,
        })
        .map_err(|source| StoreError::Encode {
            path: path.to_path_buf(),
            source,
        })?;
        write_atomic(path, &bytes, self.metrics())
    }

    /// Reads the volume's secrets; `Ok(None)` if there are none. A parse error never quotes
    /// the file (it might quote a secret): it names only the position and kind of error.
    pub fn load_secrets<S: DeserializeOwned>(
        &self,
        plugin_type: &str,
        plugin_name: &str,
        volume_id: &str,
    ) -> Result<Option<S>, StoreError> {
        self.load_secrets_at(self.secrets_path(plugin_type, plugin_name, volume_id))
    }

    fn load_secrets_at<S: DeserializeOwned>(&self, path: PathBuf) -> Result<Option<S>, StoreError> {
        let Some(bytes) = read_optional(&path)? else {
            return Ok(None);
        };
        match serde_json::from_slice::<SecretsIn<S>>(&bytes) {
            Ok(file) if file.schema_version == SECRETS_SCHEMA_VERSION => Ok(Some(file.secrets)),
            Ok(file) => Err(StoreError::Unreadable {
                path,
                reason: Unreadable::UnknownVersion {
                    found: file.schema_version,
                    supported: SECRETS_SCHEMA_VERSION,
                },
            }),
            Err(err) => Err(StoreError::Unreadable {
                path,
                reason: Unreadable::Corrupt(format!(
                    "{:?} error at line {} column {}",
                    err.classify(),
                    err.line(),
                    err.column()
                )),
            }),
        }
    }

    /// Removes the volume's secrets durably; succeeds if there were none.
    pub fn delete_secrets(
        &self,
        plugin_type: &str,
        plugin_name: &str,
        volume_id: &str,
    ) -> Result<(), StoreError> {
        self.delete_secrets_at(&self.secrets_path(plugin_type, plugin_name, volume_id))
    }

    fn delete_secrets_at(&self, path: &Path) -> Result<(), StoreError> {
        if remove_optional(path)? {
            let mut fsync_time = Duration::ZERO;
            fsync_time += durable::sync_dir(durable::parent_of(path))?;
            if let Some(metrics) = self.metrics() {
                metrics.checkpoint_writes.inc();
                metrics
                    .checkpoint_fsync_seconds
                    .observe(fsync_time.as_secs_f64());
            }
        }
        Ok(())
    }

    /// `<work_dir>/named/<enc name>.secrets.json`: the secrets of a front door's volume name
    /// (`crate::named`), given to CreateVolume, DeleteVolume, NodeStage and NodePublish.
    pub fn named_secrets_path(&self, name: &str) -> PathBuf {
        self.layout
            .named_dir()
            .join(format!("{}.{SECRETS_FILE}", encode_id(name)))
    }

    /// Writes the secrets of volume name `name` to a 0600 file, as [`Self::save_secrets`].
    pub fn save_named_secrets<S: Serialize>(
        &self,
        name: &str,
        secrets: &S,
    ) -> Result<(), StoreError> {
        self.save_secrets_at(&self.named_secrets_path(name), secrets)
    }

    /// Reads the secrets of volume name `name`; `Ok(None)` if there are none.
    pub fn load_named_secrets<S: DeserializeOwned>(
        &self,
        name: &str,
    ) -> Result<Option<S>, StoreError> {
        self.load_secrets_at(self.named_secrets_path(name))
    }

    /// Removes the secrets of volume name `name` durably; succeeds if there were none.
    pub fn delete_named_secrets(&self, name: &str) -> Result<(), StoreError> {
        self.delete_secrets_at(&self.named_secrets_path(name))
    }

    /// Removes the secrets files (and dead writers' temp files) of `named/` whose name is not
    /// in `known`. Best effort: what cannot be removed is logged and retried at the next start.
    pub fn sweep_named_secrets(&self, known: &std::collections::HashSet<String>) {
        let dir = self.layout.named_dir();
        if let Err(err) = remove_stale_temps(&dir) {
            tracing::warn!(dir = %dir.display(), error = %err, "stale temp files not removed; retried at the next start");
        }
        let Ok(entries) = std::fs::read_dir(&dir) else {
            return;
        };
        let suffix = format!(".{SECRETS_FILE}");
        for entry in entries.flatten() {
            let file_name = entry.file_name();
            let Some(name) = file_name
                .to_str()
                .and_then(|f| f.strip_suffix(&suffix))
                .and_then(decode_id)
            else {
                continue;
            };
            if !known.contains(&name)
                && let Err(err) = self.delete_named_secrets(&name)
            {
                tracing::warn!(file = %entry.path().display(), error = %err, "secrets of a forgotten volume name not removed; retried at the next start");
            }
        }
    }

    /// Loads every volume record of a plugin, for recovery. Never fails because of one
    /// record: unreadable entries are moved to the quarantine and reported; temp files of dead
    /// writers are removed; a volume dir without a record (a crash during a first write or a
    /// delete) is removed. Fails only if `volumes/` itself cannot be listed.
    ///
    /// Call it while no record of this plugin is being written (at recovery): it would
    /// otherwise see a half-created volume dir as an interrupted one.
    pub fn load_all<T: Record>(
        &self,
        plugin_type: &str,
        plugin_name: &str,
    ) -> Result<LoadAll<T>, StoreError> {
        self.load_all_with(plugin_type, plugin_name, Orphans::Remove)
    }

    /// [`FileStore::load_all`] for the migration into the database: a volume dir without a
    /// record file that holds secrets is left as it is. In a work dir of the database era
    /// every volume dir is such a dir (the record is in the database), and the migration runs
    /// on every new database, a reinitialized one included: removing them would delete the
    /// secrets of every volume (issue #24). Whether such secrets are leftovers is decided
    /// against the database's records, by the store's recovery sweep.
    pub fn load_all_keeping_secrets<T: Record>(
        &self,
        plugin_type: &str,
        plugin_name: &str,
    ) -> Result<LoadAll<T>, StoreError> {
        self.load_all_with(plugin_type, plugin_name, Orphans::KeepSecrets)
    }

    fn load_all_with<T: Record>(
        &self,
        plugin_type: &str,
        plugin_name: &str,
        orphans: Orphans,
    ) -> Result<LoadAll<T>, StoreError> {
        let volumes = self.layout.volumes_dir(plugin_type, plugin_name);
        let mut out = LoadAll {
            records: Vec::new(),
            problems: Vec::new(),
        };
        let entries = match fs::read_dir(&volumes) {
            Ok(entries) => entries,
            Err(err) if err.kind() == io::ErrorKind::NotFound => return Ok(out),
            Err(err) => return Err(StoreError::from(io_err("list", &volumes)(err))),
        };
        let quarantine = self.quarantine_dir(plugin_type, plugin_name);
        let mut changed = false;
        for entry in entries {
            let entry = entry.map_err(io_err("list", &volumes))?;
            let name = entry.file_name();
            let path = entry.path();
            if is_temp_name(&name) {
                // Nothing writes temp files directly in volumes/, but clean them the same way.
                if !is_own_temp(&name) {
                    changed |= remove_optional(&path).unwrap_or(false);
                }
                continue;
            }
            let volume_id = name.to_str().and_then(decode_id);
            let is_dir = entry.file_type().map(|t| t.is_dir()).unwrap_or(false);
            let kind = if !is_dir {
                Some(ProblemKind::NotADirectory)
            } else if volume_id.is_none() {
                Some(ProblemKind::UndecodableName)
            } else {
                None
            };
            if let Some(kind) = kind {
                changed = true;
                out.problems
                    .push(quarantine_entry(&quarantine, &path, &name, volume_id, kind));
                continue;
            }
            let Some(volume_id) = volume_id else {
                continue;
            };
            match load_volume_dir::<T>(&path, orphans) {
                DirOutcome::Record(record) => out.records.push(Loaded { volume_id, record }),
                DirOutcome::Removed => changed = true,
                DirOutcome::Kept => {}
                DirOutcome::Problem(kind @ ProblemKind::Unreadable(_)) => {
                    changed = true;
                    out.problems.push(quarantine_entry(
                        &quarantine,
                        &path,
                        &name,
                        Some(volume_id),
                        kind,
                    ));
                }
                DirOutcome::Problem(kind) => out.problems.push(Problem {
                    path,
                    volume_id: Some(volume_id),
                    kind,
                    moved_to: None,
                    move_error: None,
                }),
            }
        }
        if changed {
            // One fsync makes every removal and move-out of volumes/ durable. If it fails the
            // changes are redone at the next load, so report it without failing the load.
            if let Err(err) = durable::sync_dir(&volumes) {
                tracing::warn!(%err, "load_all: cleanup not made durable");
            }
        }
        out.records
            .sort_unstable_by(|a, b| a.volume_id.cmp(&b.volume_id));
        for problem in &out.problems {
            tracing::warn!(%problem, "volume record problem");
        }
        Ok(out)
    }
}

impl FileStore {
    /// Moves a volume dir of a plugin's `volumes/` (one [`FileStore::load_all`] left in place)
    /// into its quarantine, never replacing anything there. Returns where it went.
    pub fn quarantine_volume_dir(
        &self,
        plugin_type: &str,
        plugin_name: &str,
        dir: &Path,
    ) -> Result<PathBuf, StoreError> {
        let name = dir.file_name().ok_or_else(|| {
            IoError::new(
                "quarantine",
                dir,
                io::Error::from(io::ErrorKind::InvalidInput),
            )
        })?;
        move_aside(&self.quarantine_dir(plugin_type, plugin_name), dir, name)
    }

    /// Removes the record file (`volume.json`) of every volume dir of a plugin, and the dir
    /// when nothing else is left in it (secrets files stay: the database era keeps them
    /// there). `after_each` runs after each removal (a failpoint for the migration tests).
    pub fn remove_record_files(
        &self,
        plugin_type: &str,
        plugin_name: &str,
        mut after_each: impl FnMut() -> Result<(), StoreError>,
    ) -> Result<(), StoreError> {
        let volumes = self.layout.volumes_dir(plugin_type, plugin_name);
        let entries = match fs::read_dir(&volumes) {
            Ok(entries) => entries,
            Err(err) if err.kind() == io::ErrorKind::NotFound => return Ok(()),
            Err(err) => return Err(StoreError::from(io_err("list", &volumes)(err))),
        };
        let mut fsync_time = Duration::ZERO;
        for entry in entries {
            let entry = entry.map_err(io_err("list", &volumes))?;
            if !entry.file_type().map(|t| t.is_dir()).unwrap_or(false) {
                continue;
            }
            let dir = entry.path();
            if remove_optional(&dir.join(VOLUME_RECORD_FILE))? {
                fsync_time += durable::sync_dir(&dir)?;
                after_each()?;
            }
            if fs::remove_dir(&dir).is_ok() {
                fsync_time += durable::sync_dir(&volumes)?;
            }
        }
        Ok(())
    }
}

/// Removes every temp file in `dir`, including ones carrying our pid.
fn remove_all_temps(dir: &Path) -> Result<(), StoreError> {
    let entries = match fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(err) if err.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(err) => return Err(StoreError::from(io_err("list", dir)(err))),
    };
    for entry in entries {
        let entry = entry.map_err(io_err("list", dir))?;
        if is_temp_name(&entry.file_name()) {
            remove_optional(&entry.path())?;
        }
    }
    Ok(())
}

/// What [`FileStore::load_all_with`] does with a volume dir that has no record file.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Orphans {
    /// Removed with its secrets (the per-file store's own rule).
    Remove,
    /// Left in place when it holds secrets (the migration's rule).
    KeepSecrets,
}

enum DirOutcome<T> {
    Record(T),
    /// A dir without a record, removed (it held at most secrets and temp files).
    Removed,
    /// A dir without a record holding secrets, left in place ([`Orphans::KeepSecrets`]).
    Kept,
    Problem(ProblemKind),
}

fn load_volume_dir<T: Record>(dir: &Path, orphans: Orphans) -> DirOutcome<T> {
    if let Err(err) = remove_stale_temps(dir) {
        // Harmless: a temp file is never read as a record. Retried at the next load.
        tracing::warn!(%err, "stale temp file not removed");
    }
    let record_path = dir.join(VOLUME_RECORD_FILE);
    match read_optional(&record_path) {
        Ok(Some(bytes)) => match decode_record::<T>(&bytes) {
            Ok(record) => DirOutcome::Record(record),
            Err(reason) => DirOutcome::Problem(ProblemKind::Unreadable(reason)),
        },
        Err(StoreError::Unreadable { reason, .. }) => {
            DirOutcome::Problem(ProblemKind::Unreadable(reason))
        }
        Ok(None) => {
            if orphans == Orphans::KeepSecrets
                && fs::symlink_metadata(dir.join(SECRETS_FILE)).is_ok()
            {
                return DirOutcome::Kept;
            }
            // No record: a first write or a delete was interrupted. Without a record nothing
            // was promised about this volume, so its secrets are garbage.
            if let Err(err) = remove_optional(&dir.join(SECRETS_FILE)) {
                return DirOutcome::Problem(ProblemKind::Io(err.to_string()));
            }
            match fs::remove_dir(dir) {
                Ok(()) => DirOutcome::Removed,
                Err(err) if err.kind() == io::ErrorKind::NotFound => DirOutcome::Removed,
                Err(err) if err.kind() == io::ErrorKind::DirectoryNotEmpty => {
                    DirOutcome::Problem(ProblemKind::Leftover)
                }
                Err(err) => DirOutcome::Problem(ProblemKind::Io(err.to_string())),
            }
        }
        Err(StoreError::Io(err)) if err.kind() == io::ErrorKind::IsADirectory => {
            DirOutcome::Problem(ProblemKind::Unreadable(Unreadable::Corrupt(format!(
                "{VOLUME_RECORD_FILE} is a directory"
            ))))
        }
        Err(err) => DirOutcome::Problem(ProblemKind::Io(err.to_string())),
    }
}

/// Moves `path` (an entry of `volumes/` named `name`) into `quarantine`, never replacing
/// anything there, and builds the problem report.
fn quarantine_entry(
    quarantine: &Path,
    path: &Path,
    name: &OsStr,
    volume_id: Option<String>,
    kind: ProblemKind,
) -> Problem {
    let (moved_to, move_error) = match move_aside(quarantine, path, name) {
        Ok(moved_to) => (Some(moved_to), None),
        Err(err) => (None, Some(err.to_string())),
    };
    Problem {
        path: path.to_path_buf(),
        volume_id,
        kind,
        moved_to,
        move_error,
    }
}

fn move_aside(quarantine: &Path, path: &Path, name: &OsStr) -> Result<PathBuf, StoreError> {
    durable::create_dir_durable(quarantine, DIR_MODE)?;
    let seconds = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    // Names from disk may be anything, even non-UTF-8: keep their bytes, bounded.
    let bytes = name.as_bytes();
    let mut base = bytes[..bytes.len().min(QUARANTINE_NAME_MAX)].to_vec();
    base.extend_from_slice(format!(".{seconds}").as_bytes());
    for attempt in 0u32..100 {
        let mut candidate = base.clone();
        if attempt > 0 {
            candidate.extend_from_slice(format!("-{attempt}").as_bytes());
        }
        let target = quarantine.join(OsString::from_vec(candidate));
        // RENAME_NOREPLACE: a plain rename would silently replace an empty directory of the
        // same name, and a non-atomic exists-then-rename could race.
        match rustix::fs::renameat_with(
            rustix::fs::CWD,
            path,
            rustix::fs::CWD,
            &target,
            rustix::fs::RenameFlags::NOREPLACE,
        ) {
            Ok(()) => {
                durable::sync_dir(quarantine)?;
                return Ok(target);
            }
            Err(rustix::io::Errno::EXIST) => {}
            Err(errno) => return Err(StoreError::from(io_err("move aside", path)(errno))),
        }
    }
    Err(IoError::new(
        "move aside",
        path,
        io::Error::from(io::ErrorKind::AlreadyExists),
    )
    .into())
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;
    use std::process::Command;

    const T: &str = "org.example.test";
    const N: &str = "default";

    #[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
    struct Vol {
        state: String,
        claims: Vec<String>,
    }

    impl Record for Vol {
        const SCHEMA_VERSION: u32 = 2;

        fn upgrade(
            from_version: u32,
            record: serde_json::Value,
        ) -> Option<Result<Self, UpgradeError>> {
            // Version 1 had a single `claim`.
            (from_version == 1).then(|| {
                let state = record["state"].as_str().ok_or("no state")?.to_owned();
                let claim = record["claim"].as_str().ok_or("no claim")?.to_owned();
                Ok(Vol {
                    state,
                    claims: vec![claim],
                })
            })
        }
    }

    fn vol(state: &str) -> Vol {
        Vol {
            state: state.to_owned(),
            claims: vec!["w1".to_owned()],
        }
    }

    fn store() -> (tempfile::TempDir, FileStore) {
        let dir = tempfile::tempdir().unwrap();
        let store =
            FileStore::open(Layout::new(dir.path()), Some(Arc::new(Metrics::new()))).unwrap();
        (dir, store)
    }

    fn mode(path: &Path) -> u32 {
        fs::metadata(path).unwrap().permissions().mode() & 0o7777
    }

    #[test]
    fn round_trip_and_delete() {
        let (_dir, store) = store();
        assert_eq!(store.load_volume::<Vol>(T, N, "v1").unwrap(), None);
        store.save_volume(T, N, "v1", &vol("CREATED")).unwrap();
        assert_eq!(
            store.load_volume::<Vol>(T, N, "v1").unwrap(),
            Some(vol("CREATED"))
        );
        store.save_volume(T, N, "v1", &vol("NODE_READY")).unwrap();
        assert_eq!(
            store.load_volume::<Vol>(T, N, "v1").unwrap(),
            Some(vol("NODE_READY"))
        );
        let text = fs::read_to_string(store.volume_record_path(T, N, "v1")).unwrap();
        assert!(
            text.starts_with("{\"schema_version\":2,\"record\":"),
            "{text}"
        );

        store.delete_volume(T, N, "v1").unwrap();
        assert_eq!(store.load_volume::<Vol>(T, N, "v1").unwrap(), None);
        assert!(!store.layout().volume_dir(T, N, "v1").exists());
        // Deleting what is not there succeeds.
        store.delete_volume(T, N, "v1").unwrap();
        store.delete_volume(T, N, "never").unwrap();
    }

    #[test]
    fn writes_are_counted_with_their_fsync_time() {
        let (_dir, store) = store();
        store.save_volume(T, N, "v", &vol("CREATED")).unwrap();
        store.save_volume(T, N, "v", &vol("NODE_READY")).unwrap();
        let metrics = store.metrics().unwrap();
        assert_eq!(metrics.checkpoint_writes.get(), 2);
        let text = metrics.encode();
        assert!(
            text.contains("csi_agent_checkpoint_fsync_seconds_count 2"),
            "{text}"
        );
    }

    #[test]
    fn dangerous_ids_round_trip() {
        let (_dir, store) = store();
        let ids = ["../x", "a/b", "", ".", "..", "vol ü", "%41"];
        for id in ids {
            store.save_volume(T, N, id, &vol(id)).unwrap();
            assert_eq!(store.load_volume::<Vol>(T, N, id).unwrap(), Some(vol(id)));
            // Everything stays inside volumes/.
            let dir = store.layout().volume_dir(T, N, id);
            assert_eq!(dir.parent().unwrap(), store.layout().volumes_dir(T, N));
        }
        let all = store.load_all::<Vol>(T, N).unwrap();
        assert!(all.problems.is_empty(), "{:?}", all.problems);
        let mut expected: Vec<&str> = ids.to_vec();
        expected.sort_unstable();
        let got: Vec<&str> = all.records.iter().map(|l| l.volume_id.as_str()).collect();
        assert_eq!(got, expected);
        for loaded in &all.records {
            assert_eq!(loaded.record, vol(&loaded.volume_id));
        }
    }

    #[test]
    fn stale_temp_files_are_ignored_and_cleaned() {
        let (_dir, store) = store();
        store.save_volume(T, N, "good", &vol("CREATED")).unwrap();
        let good_dir = store.layout().volume_dir(T, N, "good");
        // A writer killed before its rename: a full and a truncated temp file next to the
        // record, and a volume dir that only ever got a temp file (killed during the first
        // write of a volume).
        fs::write(good_dir.join(".volume.json.999999.0.tmp"), b"{\"schema_ver").unwrap();
        fs::write(good_dir.join("volume.json.tmp"), b"garbage").unwrap();
        let fresh_dir = store.layout().volume_dir(T, N, "fresh");
        fs::create_dir(&fresh_dir).unwrap();
        fs::write(fresh_dir.join(".volume.json.999999.1.tmp"), b"{}").unwrap();
        // A delete interrupted after the record was removed: secrets remain.
        let half_deleted = store.layout().volume_dir(T, N, "half");
        fs::create_dir(&half_deleted).unwrap();
        fs::write(half_deleted.join(SECRETS_FILE), b"{}").unwrap();

        let all = store.load_all::<Vol>(T, N).unwrap();
        assert!(all.problems.is_empty(), "{:?}", all.problems);
        assert_eq!(
            all.records,
            vec![Loaded {
                volume_id: "good".to_owned(),
                record: vol("CREATED")
            }]
        );
        let left: Vec<_> = fs::read_dir(&good_dir)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(left, vec![OsString::from(VOLUME_RECORD_FILE)]);
        assert!(!fresh_dir.exists());
        assert!(!half_deleted.exists());
    }

    #[test]
    fn delete_removes_secrets_and_stale_temps() {
        let (_dir, store) = store();
        store.save_volume(T, N, "v", &vol("CREATED")).unwrap();
        store
            .save_secrets(T, N, "v", &BTreeMap::from([("k", "s")]))
            .unwrap();
        let dir = store.layout().volume_dir(T, N, "v");
        fs::write(dir.join(".volume.json.1.1.tmp"), b"x").unwrap();
        store.delete_volume(T, N, "v").unwrap();
        assert!(!dir.exists());
    }

    #[test]
    fn unreadable_records_are_moved_aside_and_reported() {
        let (_dir, store) = store();
        store.save_volume(T, N, "good", &vol("PUBLISHED")).unwrap();
        store
            .save_volume(T, N, "truncated", &vol("CREATED"))
            .unwrap();
        store
            .save_secrets(T, N, "truncated", &BTreeMap::from([("k", "s")]))
            .unwrap();
        let truncated = store.volume_record_path(T, N, "truncated");
        let bytes = fs::read(&truncated).unwrap();
        fs::write(&truncated, &bytes[..bytes.len() / 2]).unwrap();
        let path = |id: &str| store.volume_record_path(T, N, id);
        fs::create_dir(store.layout().volume_dir(T, N, "corrupt")).unwrap();
        fs::write(path("corrupt"), b"\0\x01not json").unwrap();
        fs::create_dir(store.layout().volume_dir(T, N, "future")).unwrap();
        fs::write(
            path("future"),
            br#"{"schema_version":99,"record":{"state":"X","claims":[]}}"#,
        )
        .unwrap();
        fs::create_dir(store.layout().volume_dir(T, N, "old")).unwrap();
        fs::write(
            path("old"),
            br#"{"schema_version":0,"record":{"state":"X","claims":[]}}"#,
        )
        .unwrap();
        fs::create_dir(store.layout().volume_dir(T, N, "badshape")).unwrap();
        fs::write(
            path("badshape"),
            br#"{"schema_version":2,"record":{"state":7}}"#,
        )
        .unwrap();
        let volumes = store.layout().volumes_dir(T, N);
        fs::create_dir(volumes.join("not.an.encoding")).unwrap();
        fs::write(
            volumes.join("not.an.encoding").join(VOLUME_RECORD_FILE),
            b"{}",
        )
        .unwrap();
        fs::write(volumes.join("stray-file"), b"x").unwrap();
        fs::create_dir_all(path("dir-record")).unwrap();

        let all = store.load_all::<Vol>(T, N).unwrap();
        assert_eq!(
            all.records,
            vec![Loaded {
                volume_id: "good".to_owned(),
                record: vol("PUBLISHED")
            }]
        );
        let mut kinds: Vec<(Option<String>, String)> = all
            .problems
            .iter()
            .map(|p| (p.volume_id.clone(), p.kind.to_string()))
            .collect();
        kinds.sort();
        let by_id = |id: &str| {
            all.problems
                .iter()
                .find(|p| p.volume_id.as_deref() == Some(id))
                .unwrap()
        };
        assert_eq!(all.problems.len(), 8, "{kinds:?}");
        assert!(matches!(
            by_id("dir-record").kind,
            ProblemKind::Unreadable(Unreadable::Corrupt(_))
        ));
        assert!(matches!(
            by_id("truncated").kind,
            ProblemKind::Unreadable(Unreadable::Corrupt(_))
        ));
        assert!(matches!(
            by_id("corrupt").kind,
            ProblemKind::Unreadable(Unreadable::Corrupt(_))
        ));
        assert_eq!(
            by_id("future").kind,
            ProblemKind::Unreadable(Unreadable::UnknownVersion {
                found: 99,
                supported: 2
            })
        );
        assert_eq!(
            by_id("old").kind,
            ProblemKind::Unreadable(Unreadable::UnknownVersion {
                found: 0,
                supported: 2
            })
        );
        assert!(matches!(
            by_id("badshape").kind,
            ProblemKind::Unreadable(Unreadable::Corrupt(_))
        ));
        assert!(
            all.problems
                .iter()
                .any(|p| p.kind == ProblemKind::UndecodableName
                    && p.path.ends_with("not.an.encoding"))
        );
        assert!(
            all.problems
                .iter()
                .any(|p| p.kind == ProblemKind::NotADirectory && p.path.ends_with("stray-file"))
        );

        // Every problem was moved into the quarantine, secrets included, and nothing bad is
        // left in volumes/.
        let quarantine = store.quarantine_dir(T, N);
        for problem in &all.problems {
            let moved = problem.moved_to.as_ref().expect("moved");
            assert!(moved.starts_with(&quarantine), "{problem}");
            assert!(moved.exists(), "{problem}");
            assert!(!problem.path.exists(), "{problem}");
            assert!(problem.to_string().contains("moved to"));
        }
        let moved_truncated = by_id("truncated").moved_to.clone().unwrap();
        assert!(moved_truncated.join(SECRETS_FILE).exists());
        assert_eq!(mode(&quarantine), 0o700);

        // A second load finds only the good record and no problems.
        let again = store.load_all::<Vol>(T, N).unwrap();
        assert_eq!(again.records.len(), 1);
        assert!(again.problems.is_empty(), "{:?}", again.problems);
    }

    #[test]
    fn quarantine_never_replaces_an_earlier_entry() {
        let (_dir, store) = store();
        for _ in 0..3 {
            fs::create_dir_all(store.layout().volume_dir(T, N, "bad")).unwrap();
            fs::write(store.volume_record_path(T, N, "bad"), b"{").unwrap();
            let all = store.load_all::<Vol>(T, N).unwrap();
            assert_eq!(all.problems.len(), 1);
        }
        assert_eq!(fs::read_dir(store.quarantine_dir(T, N)).unwrap().count(), 3);
    }

    #[test]
    fn older_versions_are_upgraded() {
        let (_dir, store) = store();
        fs::create_dir_all(store.layout().volume_dir(T, N, "v")).unwrap();
        fs::write(
            store.volume_record_path(T, N, "v"),
            br#"{"schema_version":1,"record":{"state":"CREATED","claim":"w1"}}"#,
        )
        .unwrap();
        assert_eq!(
            store.load_volume::<Vol>(T, N, "v").unwrap(),
            Some(vol("CREATED"))
        );
        fs::write(
            store.volume_record_path(T, N, "v"),
            br#"{"schema_version":1,"record":{"state":"CREATED"}}"#,
        )
        .unwrap();
        let err = store.load_volume::<Vol>(T, N, "v").unwrap_err();
        assert!(
            matches!(
                err,
                StoreError::Unreadable {
                    reason: Unreadable::UpgradeFailed { from: 1, .. },
                    ..
                }
            ),
            "{err}"
        );
        // A single load leaves the bad record where it is.
        assert!(store.volume_record_path(T, N, "v").exists());
    }

    #[test]
    fn secrets_are_private_from_creation() {
        let (dir, store) = store();
        let secrets = BTreeMap::from([(
            "node_stage".to_owned(),
            BTreeMap::from([("password".to_owned(), "hunter2".to_owned())]),
        )]);
        store.save_secrets(T, N, "v", &secrets).unwrap();
        let path = store.secrets_path(T, N, "v");
        assert_eq!(mode(&path), 0o600);
        // Every directory from csi/ down to the volume dir is 0700.
        let mut current = path.parent().unwrap();
        while current != dir.path() {
            assert_eq!(mode(current), 0o700, "{}", current.display());
            current = current.parent().unwrap();
        }
        let loaded: Option<BTreeMap<String, BTreeMap<String, String>>> =
            store.load_secrets(T, N, "v").unwrap();
        assert_eq!(loaded, Some(secrets));

        // A parse error does not quote the file.
        fs::write(&path, br#"{"schema_version":1,"secrets":{"a":"hunter2"#).unwrap();
        let err = store
            .load_secrets::<BTreeMap<String, String>>(T, N, "v")
            .unwrap_err();
        assert!(!err.to_string().contains("hunter2"), "{err}");
        fs::write(
            &path,
            br#"{"schema_version":1,"secrets":{"a":["hunter2"]}}"#,
        )
        .unwrap();
        let err = store
            .load_secrets::<BTreeMap<String, String>>(T, N, "v")
            .unwrap_err();
        assert!(!err.to_string().contains("hunter2"), "{err}");

        store.delete_secrets(T, N, "v").unwrap();
        assert!(!path.exists());
        store.delete_secrets(T, N, "v").unwrap();
        assert_eq!(
            store
                .load_secrets::<BTreeMap<String, String>>(T, N, "v")
                .unwrap(),
            None
        );
    }

    #[test]
    fn open_tightens_a_loose_state_dir() {
        let dir = tempfile::tempdir().unwrap();
        let csi = dir.path().join("csi");
        fs::create_dir(&csi).unwrap();
        fs::set_permissions(&csi, fs::Permissions::from_mode(0o755)).unwrap();
        FileStore::open(Layout::new(dir.path()), None).unwrap();
        assert_eq!(mode(&csi), 0o700);
    }

    #[test]
    fn write_atomic_creates_parents_and_replaces() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("a/b/c.json");
        write_atomic(&path, b"one", None).unwrap();
        write_atomic(&path, b"two", None).unwrap();
        assert_eq!(fs::read(&path).unwrap(), b"two");
        assert_eq!(mode(&path), 0o600);
        assert_eq!(mode(&dir.path().join("a")), 0o700);
        let names: Vec<_> = fs::read_dir(dir.path().join("a/b"))
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, vec![OsString::from("c.json")]);
    }

    #[test]
    fn failed_write_before_rename_keeps_the_old_record() {
        let (_dir, store) = store();
        store.save_volume(T, N, "v", &vol("CREATED")).unwrap();
        {
            let _fp = failpoint::arm_local(FP_WRITE_BEFORE_RENAME, failpoint::Action::Error);
            let err = store
                .save_volume(T, N, "v", &vol("NODE_READY"))
                .unwrap_err();
            assert!(matches!(err, StoreError::Failpoint(_)), "{err}");
        }
        assert_eq!(
            store.load_volume::<Vol>(T, N, "v").unwrap(),
            Some(vol("CREATED"))
        );
        // The temp file was removed on the error path.
        let names: Vec<_> = fs::read_dir(store.layout().volume_dir(T, N, "v"))
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, vec![OsString::from(VOLUME_RECORD_FILE)]);
    }

    const CHILD_ENV: &str = "CSI_AGENT_STORE_TEST_CHILD_DIR";

    /// Runs only as the child of `killed_writer_*`: overwrites the record, under whatever
    /// failpoint the parent armed through the environment.
    #[test]
    fn killed_writer_child() {
        let Some(work_dir) = std::env::var_os(CHILD_ENV) else {
            return;
        };
        failpoint::init_from_env().unwrap();
        let store = FileStore::open(Layout::new(PathBuf::from(work_dir)), None).unwrap();
        store.save_volume(T, N, "v", &vol("NODE_READY")).unwrap();
        println!("child: completed");
    }

    fn run_killed_writer(failpoint_spec: &str) -> (tempfile::TempDir, FileStore) {
        use std::os::unix::process::ExitStatusExt;
        let (dir, store) = store();
        store.save_volume(T, N, "v", &vol("CREATED")).unwrap();
        let output = Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "store::files::tests::killed_writer_child",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(CHILD_ENV, dir.path())
            .env(failpoint::ENV_VAR, failpoint_spec)
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&output.stdout);
        assert_eq!(output.status.signal(), Some(9), "{stdout}");
        assert!(!stdout.contains("child: completed"), "{stdout}");
        (dir, store)
    }

    #[test]
    fn killed_writer_before_rename_leaves_the_old_record() {
        let (_dir, store) = run_killed_writer("store.write.before_rename=exit");
        let volume_dir = store.layout().volume_dir(T, N, "v");
        // The dead writer's fsynced temp file is there...
        assert!(
            fs::read_dir(&volume_dir)
                .unwrap()
                .any(|e| is_temp_name(&e.unwrap().file_name()))
        );
        // ...and does not confuse the load, which removes it.
        let all = store.load_all::<Vol>(T, N).unwrap();
        assert!(all.problems.is_empty(), "{:?}", all.problems);
        assert_eq!(all.records.len(), 1);
        assert_eq!(all.records[0].record, vol("CREATED"));
        let names: Vec<_> = fs::read_dir(&volume_dir)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, vec![OsString::from(VOLUME_RECORD_FILE)]);
    }

    #[test]
    fn killed_writer_after_rename_leaves_the_new_record() {
        let (_dir, store) = run_killed_writer("store.write.after_rename=exit");
        assert_eq!(
            store.load_volume::<Vol>(T, N, "v").unwrap(),
            Some(vol("NODE_READY"))
        );
    }

    #[test]
    fn temp_names_are_recognised() {
        let name = OsString::from(durable::temp_name("volume.json"));
        assert!(is_temp_name(&name));
        assert!(is_own_temp(&name));
        // The older form is still cleaned, and never taken for one of ours.
        assert!(is_temp_name(OsStr::new(&format!(
            ".volume.json.{}.0.tmp",
            std::process::id()
        ))));
        assert!(!is_own_temp(OsStr::new(&format!(
            ".volume.json.{}.0.tmp",
            std::process::id()
        ))));
        assert!(!is_own_temp(OsStr::new(".volume.json.1.0.tmp")) || std::process::id() == 1);
        assert!(!is_temp_name(OsStr::new("volume.json")));
    }
}
