//! Durable state (docs/design.md, docs/on-disk-format.md): volume records in one SQLite
//! database with group commit ([`db`]), secrets in 0600 files ([`files`]), and the migration
//! of a work dir written by the first release's per-file store ([`migrate`]).
//!
//! Two kinds of record write:
//! - [`Store::save_volume`] / [`Store::delete_volume`]: durable. The call returns once the
//!   commit holding the write is on disk. An operation's desired state (a claim added or
//!   removed) is written this way, once, before its first RPC.
//! - [`Store::note_volume`] / [`Store::note_delete`]: a progress note. Queued and committed
//!   with a later batch, never waited for. Losing one in a crash only makes recovery repeat
//!   RPCs that CSI makes idempotent (docs/recovery.md).
//!
//! Secrets stay out of the database: SQLite reuses freed pages and keeps old page images in
//! its write-ahead log, so a deleted secret could survive in the file; a 0600 file that is
//! unlinked is simply gone.
//!
//! This module must not interpret records (the volume manager's types) and must never log or
//! echo secret contents.

pub mod db;
pub mod files;
pub mod migrate;
pub mod vanished;
mod writer;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde::Serialize;
use serde::de::DeserializeOwned;

pub use db::{DB_FILE, DB_SCHEMA_VERSION, FP_COMMIT_AFTER, FP_COMMIT_BEFORE, StoreOptions};
pub use files::{
    FileStore, LoadAll, Loaded, Problem, ProblemKind, Record, StoreError, Unreadable, UpgradeError,
    decode_record, encode_record, write_atomic,
};

use crate::layout::{Layout, decode_id, encode_id};
use crate::metrics::Metrics;
use db::{Database, Key, Op};
use rusqlite::types::ValueRef;

/// The records of the volume names ([`Store::load_named`]).
#[derive(Debug)]
pub struct LoadedNames<T> {
    /// `(name, record)`, sorted by name.
    pub records: Vec<(String, T)>,
    /// Rows this build cannot read, left in the database: `(the row's key, why)`.
    pub unreadable: Vec<(String, Unreadable)>,
}

/// Durable volume records and secrets of every plugin under one work dir.
#[derive(Clone, Debug)]
pub struct Store {
    files: FileStore,
    db: Arc<Database>,
}

impl Store {
    /// Opens the store with the default writer settings.
    pub fn open(layout: Layout, metrics: Option<Arc<Metrics>>) -> Result<Self, StoreError> {
        Self::open_with(layout, metrics, StoreOptions::default())
    }

    /// Opens `<work_dir>/state.db` (creating it), migrates records left by the per-file
    /// store of the first release, and starts the writer.
    pub fn open_with(
        layout: Layout,
        metrics: Option<Arc<Metrics>>,
        options: StoreOptions,
    ) -> Result<Self, StoreError> {
        let files = FileStore::open(layout.clone(), metrics.clone())?;
        let (mut writer, path) = Database::open(layout.work_dir())?;
        migrate::from_files(&files, &mut writer, &path)?;
        let db = Database::start(path, writer, metrics, options)?;
        Ok(Self {
            files,
            db: Arc::new(db),
        })
    }

    pub fn layout(&self) -> &Layout {
        self.files.layout()
    }

    /// The database file.
    pub fn db_path(&self) -> &Path {
        self.db.path()
    }

    /// The file layer (secrets, migration).
    pub fn files(&self) -> &FileStore {
        &self.files
    }

    fn key(plugin_type: &str, plugin_name: &str, volume_id: &str) -> Key {
        Key {
            plugin_type: plugin_type.to_owned(),
            plugin_name: plugin_name.to_owned(),
            volume_key: encode_id(volume_id),
        }
    }

    fn put<T: Record>(
        &self,
        plugin_type: &str,
        plugin_name: &str,
        volume_id: &str,
        record: &T,
    ) -> Result<Op, StoreError> {
        let json = serde_json::to_string(record).map_err(|source| StoreError::Encode {
            path: self.db_path().to_path_buf(),
            source,
        })?;
        Ok(Op::Put {
            key: Self::key(plugin_type, plugin_name, volume_id),
            schema_version: T::SCHEMA_VERSION,
            record: json,
        })
    }

    /// Writes the volume record durably: returns once the commit holding it is on disk.
    pub async fn save_volume<T: Record>(
        &self,
        plugin_type: &str,
        plugin_name: &str,
        volume_id: &str,
        record: &T,
    ) -> Result<(), StoreError> {
        let op = self.put(plugin_type, plugin_name, volume_id, record)?;
        Ok(self.db.commit(vec![op]).await?)
    }

    /// Queues the volume record as a progress note (committed with a later batch).
    pub fn note_volume<T: Record>(
        &self,
        plugin_type: &str,
        plugin_name: &str,
        volume_id: &str,
        record: &T,
    ) -> Result<(), StoreError> {
        let op = self.put(plugin_type, plugin_name, volume_id, record)?;
        self.db.note(op);
        Ok(())
    }

    /// Forgets a volume durably: its record, then its secrets file.
    pub async fn delete_volume(
        &self,
        plugin_type: &str,
        plugin_name: &str,
        volume_id: &str,
    ) -> Result<(), StoreError> {
        self.db
            .commit(vec![Op::Delete {
                key: Self::key(plugin_type, plugin_name, volume_id),
            }])
            .await?;
        self.files
            .delete_volume(plugin_type, plugin_name, volume_id)
    }

    /// Forgets a volume as a progress note. Its secrets file (if any) is removed durably at
    /// once: a record that outlives its secrets only ever goes down, and teardown RPCs take
    /// no node secrets.
    pub fn note_delete(
        &self,
        plugin_type: &str,
        plugin_name: &str,
        volume_id: &str,
        had_secrets: bool,
    ) -> Result<(), StoreError> {
        self.db.note(Op::Delete {
            key: Self::key(plugin_type, plugin_name, volume_id),
        });
        if had_secrets {
            self.files
                .delete_volume(plugin_type, plugin_name, volume_id)?;
        }
        Ok(())
    }

    /// Waits until everything queued so far (notes included) is committed.
    pub async fn flush(&self) -> Result<(), StoreError> {
        Ok(self.db.commit(Vec::new()).await?)
    }

    /// Reads one volume record from the database (`Ok(None)`: none).
    pub fn load_volume<T: Record>(
        &self,
        plugin_type: &str,
        plugin_name: &str,
        volume_id: &str,
    ) -> Result<Option<T>, StoreError> {
        let key = Self::key(plugin_type, plugin_name, volume_id);
        let row: Option<(u32, String)> = self
            .db
            .read(|conn| {
                use rusqlite::OptionalExtension;
                conn.query_row(
                    "SELECT schema_version, record FROM volumes
                     WHERE plugin_type = ?1 AND plugin_name = ?2 AND volume_key = ?3",
                    rusqlite::params![key.plugin_type, key.plugin_name, key.volume_key],
                    |row| Ok((row.get(0)?, row.get(1)?)),
                )
                .optional()
            })
            .map_err(|source| self.read_error(source))?;
        let Some((version, json)) = row else {
            return Ok(None);
        };
        decode_row::<T>(version, &json)
            .map(Some)
            .map_err(|reason| StoreError::Unreadable {
                path: self.row_path(&key),
                reason,
            })
    }

    /// Loads every volume record of a plugin, for recovery, sorted by volume id. A row that
    /// cannot be read (an id that does not decode, a corrupt record, an unknown version) is
    /// moved to the `quarantine` table and reported; it never fails the load.
    pub fn load_all<T: Record>(
        &self,
        plugin_type: &str,
        plugin_name: &str,
    ) -> Result<LoadAll<T>, StoreError> {
        // Each row is decoded as it is read, so that recovery never holds every record's
        // JSON and its decoded form at once (at 100,000 records, tens of MiB of peak).
        let mut records = Vec::new();
        let mut bad = Vec::new();
        let key_of = |volume_key: String| Key {
            plugin_type: plugin_type.to_owned(),
            plugin_name: plugin_name.to_owned(),
            volume_key,
        };
        self.db
            .read(|conn| {
                let mut stmt = conn.prepare_cached(
                    "SELECT volume_key, schema_version, record FROM volumes
                     WHERE plugin_type = ?1 AND plugin_name = ?2",
                )?;
                let mut rows = stmt.query(rusqlite::params![plugin_type, plugin_name])?;
                while let Some(row) = rows.next()? {
                    let volume_key: String = row.get(0)?;
                    let version: u32 = row.get(1)?;
                    // A hand-edited row may hold a blob or text that is not UTF-8: quarantined
                    // like any other unreadable record, never a failed recovery.
                    let bytes = match row.get_ref(2)? {
                        ValueRef::Text(bytes) | ValueRef::Blob(bytes) => bytes,
                        _ => &[],
                    };
                    match read_row::<T>(&volume_key, version, bytes) {
                        Ok(loaded) => records.push(loaded),
                        Err((kind, volume_id)) => {
                            bad.push((key_of(volume_key), bytes.to_vec(), kind, volume_id))
                        }
                    }
                }
                Ok(())
            })
            .map_err(|source| self.read_error(source))?;
        let mut out = LoadAll {
            records,
            problems: Vec::new(),
        };
        for (key, record, kind, volume_id) in bad {
            let path = self.row_path(&key);
            let moved = self.quarantine_row(&key, &record, &kind);
            out.problems.push(Problem {
                path,
                volume_id,
                kind,
                moved_to: moved
                    .as_ref()
                    .ok()
                    .map(|()| self.db_path().join("quarantine")),
                move_error: moved.err().map(|e| e.to_string()),
            });
        }
        out.records
            .sort_unstable_by(|a, b| a.volume_id.cmp(&b.volume_id));
        self.sweep_volume_dirs(plugin_type, plugin_name, &out.records)?;
        for problem in &out.problems {
            tracing::warn!(%problem, "volume record problem");
        }
        Ok(out)
    }

    /// Sweeps the plugin's volume dirs at recovery, when no operation of the plugin runs:
    /// temp files of dead writers go (a daemon SIGKILLed mid-write leaves
    /// `.secrets.json.<pid>.<n>.tmp`), and so do the secrets of a volume without a record
    /// when nothing says the record may merely be missing from this database:
    ///
    /// - written first, secrets outlive a publish killed before its claim was committed (its
    ///   volume has no mount dir yet: the mount dir is made after the commit), and nothing was
    ///   promised about such a volume: removed;
    /// - a volume that has a mount dir got further than that, so its record existed; a
    ///   database restored from an older copy lacks it: the secrets are kept, and reported;
    /// - secrets older than a `--reinitialize-state` start belong to the database that
    ///   vanished: kept, and reported (docs/operations.md, "The state database vanished").
    ///
    /// So secrets are deleted with the record that owns them, or as the leftover of a publish
    /// that never had one; never because their owner's record is lost.
    fn sweep_volume_dirs<T>(
        &self,
        plugin_type: &str,
        plugin_name: &str,
        records: &[Loaded<T>],
    ) -> Result<(), StoreError> {
        // Fails only if `volumes/` exists and cannot be listed: the secrets of the plugin's
        // volumes would be unreachable.
        let volumes = self.layout().volumes_dir(plugin_type, plugin_name);
        let entries = match std::fs::read_dir(&volumes) {
            Ok(entries) => entries,
            Err(err) if err.kind() == std::io::ErrorKind::NotFound => return Ok(()),
            Err(source) => {
                return Err(crate::durable::IoError::new("list", volumes, source).into());
            }
        };
        let known: std::collections::HashSet<String> =
            records.iter().map(|l| encode_id(&l.volume_id)).collect();
        let reinitialized_at = self.reinitialized_at();
        for entry in entries.flatten() {
            let name = entry.file_name();
            let Some(volume_id) = name.to_str().and_then(decode_id) else {
                continue;
            };
            if let Err(err) = files::remove_stale_temps(&entry.path()) {
                tracing::warn!(dir = %entry.path().display(), error = %err, "stale temp files not removed; retried at the next start");
            }
            if known.contains(&encode_id(&volume_id)) {
                continue;
            }
            let secrets = self
                .files
                .secrets_path(plugin_type, plugin_name, &volume_id);
            let kept = match std::fs::symlink_metadata(&secrets) {
                Err(_) => None,
                Ok(meta) => {
                    let written = meta
                        .modified()
                        .ok()
                        .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
                        .map(|d| d.as_millis() as u64);
                    if reinitialized_at.is_some_and(|at| written.is_none_or(|w| w <= at)) {
                        Some(
                            "it predates the --reinitialize-state start: its volume's record was in the database that vanished",
                        )
                    } else if std::fs::symlink_metadata(self.layout().volume_mount_dir(
                        plugin_type,
                        plugin_name,
                        &volume_id,
                    ))
                    .is_ok()
                    {
                        Some(
                            "its volume has a mount dir, so it had a record, which this database (restored from an older copy?) lacks",
                        )
                    } else {
                        None
                    }
                }
            };
            if let Some(why) = kept {
                tracing::warn!(
                    plugin = %plugin_type,
                    volume_id = ?volume_id,
                    file = %secrets.display(),
                    "secrets of a volume without a record kept: {why}. Restore the database that has the record, or publish the volume again; remove the file by hand once it is not needed (docs/operations.md)"
                );
                continue;
            }
            if let Err(err) = self
                .files
                .delete_volume(plugin_type, plugin_name, &volume_id)
            {
                tracing::warn!(volume_id = ?volume_id, error = %err, "secrets of a volume without a record not removed");
            }
        }
        Ok(())
    }

    /// A value of the database's `meta` table (the node's cluster identity lives there:
    /// docs/on-disk-format.md).
    pub fn meta(&self, key: &str) -> Result<Option<String>, StoreError> {
        use rusqlite::OptionalExtension;
        self.db
            .read(|conn| {
                conn.query_row("SELECT value FROM meta WHERE key = ?1", [key], |row| {
                    row.get::<_, String>(0)
                })
                .optional()
            })
            .map_err(|source| StoreError::Read {
                path: self.db_path().to_path_buf(),
                source,
            })
    }

    /// Sets a `meta` value, committed (FULL synchronous) before this returns.
    pub fn set_meta(&self, key: &str, value: &str) -> Result<(), StoreError> {
        self.db
            .read(|conn| {
                conn.execute(
                    "INSERT INTO meta (key, value) VALUES (?1, ?2)
                     ON CONFLICT(key) DO UPDATE SET value = excluded.value",
                    [key, value],
                )
            })
            .map(|_| ())
            .map_err(|source| StoreError::Read {
                path: self.db_path().to_path_buf(),
                source,
            })
    }

    /// When `--reinitialize-state` created this database (Unix milliseconds), if it did.
    fn reinitialized_at(&self) -> Option<u64> {
        self.db
            .read(|conn| {
                use rusqlite::OptionalExtension;
                conn.query_row(
                    "SELECT value FROM meta WHERE key = ?1",
                    [vanished::REINITIALIZED_AT],
                    |row| row.get::<_, String>(0),
                )
                .optional()
            })
            .ok()
            .flatten()
            .and_then(|v| v.parse().ok())
    }

    /// Moves an unreadable row into the `quarantine` table (kept for an operator, never read
    /// again by the daemon).
    fn quarantine_row(&self, key: &Key, record: &[u8], kind: &ProblemKind) -> rusqlite::Result<()> {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs() as i64)
            .unwrap_or(0);
        self.db.read(|conn| {
            conn.execute_batch("BEGIN IMMEDIATE")?;
            let moved = conn
                .execute(
                    "INSERT INTO quarantine (plugin_type, plugin_name, volume_key, record, reason, quarantined_at)
                     VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
                    rusqlite::params![key.plugin_type, key.plugin_name, key.volume_key, record, kind.to_string(), now],
                )
                .and_then(|_| {
                    conn.execute(
                        "DELETE FROM volumes WHERE plugin_type = ?1 AND plugin_name = ?2 AND volume_key = ?3",
                        rusqlite::params![key.plugin_type, key.plugin_name, key.volume_key],
                    )
                });
            match moved {
                Ok(_) => conn.execute_batch("COMMIT"),
                Err(err) => {
                    let _ = conn.execute_batch("ROLLBACK");
                    Err(err)
                }
            }
        })
    }

    /// Writes the record of the front doors' volume `name` (`crate::named`) durably.
    pub async fn save_named<T: Record>(&self, name: &str, record: &T) -> Result<(), StoreError> {
        let json = serde_json::to_string(record).map_err(|source| StoreError::Encode {
            path: self.db_path().to_path_buf(),
            source,
        })?;
        let op = Op::PutNamed {
            name_key: encode_id(name),
            schema_version: T::SCHEMA_VERSION,
            record: json,
        };
        Ok(self.db.commit(vec![op]).await?)
    }

    /// Forgets the volume name durably: its record, then its secrets file.
    pub async fn delete_named(&self, name: &str) -> Result<(), StoreError> {
        self.db
            .commit(vec![Op::DeleteNamed {
                name_key: encode_id(name),
            }])
            .await?;
        self.files.delete_named_secrets(name)
    }

    /// Every volume name's record, sorted by name. A row that cannot be read (a key that
    /// does not decode, a corrupt record, an unknown version) is reported beside the others
    /// and left in place for an operator: a name is never forgotten because this build cannot
    /// read its record. Secrets files of names without a row (a crash between the two
    /// deletes of [`Self::delete_named`], or secrets written before a create's first commit)
    /// are removed.
    pub fn load_named<T: Record>(&self) -> Result<LoadedNames<T>, StoreError> {
        let rows: Vec<(String, u32, String)> = self
            .db
            .read(|conn| {
                let mut stmt = conn.prepare(
                    "SELECT name, schema_version, record FROM named_volumes ORDER BY name",
                )?;
                stmt.query_map([], |row| Ok((row.get(0)?, row.get(1)?, row.get(2)?)))?
                    .collect()
            })
            .map_err(|source| self.read_error(source))?;
        let mut loaded = LoadedNames {
            records: Vec::new(),
            unreadable: Vec::new(),
        };
        for (name_key, version, json) in rows {
            let Some(name) = decode_id(&name_key) else {
                loaded.unreadable.push((
                    name_key,
                    Unreadable::Corrupt("the row's name is not an encoded id".to_owned()),
                ));
                continue;
            };
            match decode_row::<T>(version, &json) {
                Ok(record) => loaded.records.push((name, record)),
                Err(reason) => loaded.unreadable.push((name_key, reason)),
            }
        }
        let known: std::collections::HashSet<String> = loaded
            .records
            .iter()
            .map(|(name, _)| name.clone())
            .chain(
                loaded
                    .unreadable
                    .iter()
                    .filter_map(|(key, _)| decode_id(key)),
            )
            .collect();
        self.files.sweep_named_secrets(&known);
        Ok(loaded)
    }

    /// Writes the secrets of volume name `name` to a 0600 file (see
    /// [`FileStore::save_named_secrets`]).
    pub fn save_named_secrets<S: Serialize>(
        &self,
        name: &str,
        secrets: &S,
    ) -> Result<(), StoreError> {
        self.files.save_named_secrets(name, secrets)
    }

    /// Reads the secrets of volume name `name` (`Ok(None)`: none).
    pub fn load_named_secrets<S: DeserializeOwned>(
        &self,
        name: &str,
    ) -> Result<Option<S>, StoreError> {
        self.files.load_named_secrets(name)
    }

    fn row_path(&self, key: &Key) -> PathBuf {
        self.db_path()
            .join(&key.plugin_type)
            .join(&key.plugin_name)
            .join(&key.volume_key)
    }

    fn read_error(&self, source: rusqlite::Error) -> StoreError {
        StoreError::Read {
            path: self.db_path().to_path_buf(),
            source,
        }
    }

    /// Writes the volume's secrets to a 0600 file (see [`FileStore::save_secrets`]).
    pub fn save_secrets<S: Serialize>(
        &self,
        plugin_type: &str,
        plugin_name: &str,
        volume_id: &str,
        secrets: &S,
    ) -> Result<(), StoreError> {
        self.files
            .save_secrets(plugin_type, plugin_name, volume_id, secrets)
    }

    /// Reads the volume's secrets (see [`FileStore::load_secrets`]).
    pub fn load_secrets<S: DeserializeOwned>(
        &self,
        plugin_type: &str,
        plugin_name: &str,
        volume_id: &str,
    ) -> Result<Option<S>, StoreError> {
        self.files.load_secrets(plugin_type, plugin_name, volume_id)
    }
}

/// Reads one stored row: its key decoded to the volume id, its record checked to be UTF-8 text
/// of at most `files::MAX_FILE_BYTES` and decoded. The error is what to report and quarantine,
/// with the volume id when the key decoded.
fn read_row<T: Record>(
    volume_key: &str,
    version: u32,
    bytes: &[u8],
) -> Result<Loaded<T>, (ProblemKind, Option<String>)> {
    let volume_id = decode_id(volume_key).ok_or((ProblemKind::UndecodableName, None))?;
    let unreadable = |reason| (ProblemKind::Unreadable(reason), Some(volume_id.clone()));
    let json = std::str::from_utf8(bytes).map_err(|err| {
        unreadable(Unreadable::Corrupt(format!(
            "the record is not UTF-8 text: {err}"
        )))
    })?;
    if json.len() as u64 > files::MAX_FILE_BYTES {
        return Err(unreadable(Unreadable::Corrupt(format!(
            "the record is {} bytes, more than the {} a record may have",
            json.len(),
            files::MAX_FILE_BYTES
        ))));
    }
    let record = decode_row::<T>(version, json).map_err(unreadable)?;
    Ok(Loaded { volume_id, record })
}

/// Decodes a row's record with the same rules as the envelope of the file store (a version
/// this build cannot read, or cannot upgrade from, is unreadable).
fn decode_row<T: Record>(version: u32, json: &str) -> Result<T, Unreadable> {
    if version == T::SCHEMA_VERSION {
        return serde_json::from_str(json).map_err(|err| Unreadable::Corrupt(err.to_string()));
    }
    let value: serde_json::Value =
        serde_json::from_str(json).map_err(|err| Unreadable::Corrupt(err.to_string()))?;
    match T::upgrade(version, value) {
        Some(Ok(record)) => Ok(record),
        Some(Err(reason)) => Err(Unreadable::UpgradeFailed {
            from: version,
            reason,
        }),
        None => Err(Unreadable::UnknownVersion {
            found: version,
            supported: T::SCHEMA_VERSION,
        }),
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    #[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
    struct Vol {
        state: String,
    }

    impl Record for Vol {
        const SCHEMA_VERSION: u32 = 1;
    }

    const T: &str = "org.example";
    const N: &str = "default";

    fn secrets() -> BTreeMap<&'static str, &'static str> {
        BTreeMap::from([("k", "s")])
    }

    #[tokio::test(flavor = "multi_thread")]
    async fn secrets_without_a_record_go_only_when_their_record_cannot_merely_be_missing() {
        let dir = tempfile::tempdir().unwrap();
        let layout = Layout::new(dir.path().join("work"));
        std::fs::create_dir_all(layout.work_dir()).unwrap();
        let store = Store::open(layout.clone(), None).unwrap();
        store
            .save_volume(T, N, "recorded", &Vol { state: "x".into() })
            .await
            .unwrap();
        for volume in ["recorded", "never-committed", "mounted-once"] {
            store.save_secrets(T, N, volume, &secrets()).unwrap();
        }
        // A publish that got as far as its mount dir had a record: this database lacks it.
        std::fs::create_dir_all(layout.volume_mount_dir(T, N, "mounted-once")).unwrap();
        // A writer killed mid-write left its temp file beside the recorded volume's secrets.
        let stale = layout
            .volume_dir(T, N, "recorded")
            .join(".secrets.json.999999.0.tmp");
        std::fs::write(&stale, b"{").unwrap();

        let loaded = store.load_all::<Vol>(T, N).unwrap();
        assert_eq!(loaded.records.len(), 1);
        let path = |v: &str| store.files().secrets_path(T, N, v);
        assert!(path("recorded").exists());
        assert!(!stale.exists(), "the stale temp file was not swept");
        assert!(
            !path("never-committed").exists(),
            "the secrets of a publish killed before its claim was committed stay"
        );
        assert!(
            path("mounted-once").exists(),
            "secrets deleted without their record"
        );
        // Deleting the record deletes its secrets.
        store.delete_volume(T, N, "recorded").await.unwrap();
        assert!(!path("recorded").exists());
    }

    #[tokio::test(flavor = "multi_thread")]
    async fn secrets_older_than_a_reinitialization_are_kept() {
        let dir = tempfile::tempdir().unwrap();
        let layout = Layout::new(dir.path().join("work"));
        let volume_dir = layout.volume_dir(T, N, "from-the-lost-db");
        std::fs::create_dir_all(&volume_dir).unwrap();
        std::fs::write(volume_dir.join("secrets.json"), b"{}").unwrap();
        // Written a while ago, before the reinitialization.
        let old = std::time::SystemTime::now() - std::time::Duration::from_secs(3600);
        std::fs::File::options()
            .write(true)
            .open(volume_dir.join("secrets.json"))
            .unwrap()
            .set_modified(old)
            .unwrap();
        assert!(matches!(
            vanished::check(&layout, true).unwrap(),
            vanished::Outcome::Reinitialized(_)
        ));
        let store = Store::open(layout.clone(), None).unwrap();
        std::thread::sleep(std::time::Duration::from_millis(5));
        store.save_secrets(T, N, "after", &secrets()).unwrap();
        for _ in 0..2 {
            store.load_all::<Vol>(T, N).unwrap();
            assert!(volume_dir.join("secrets.json").exists());
        }
        // One written after it, of a publish that never committed its claim, still goes.
        assert!(!store.files().secrets_path(T, N, "after").exists());
    }
}
