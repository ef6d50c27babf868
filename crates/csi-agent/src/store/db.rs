//! The records' database: one SQLite file (`<work_dir>/state.db`, WAL, `synchronous=FULL`)
//! written by a single writer thread with group commit.
//!
//! Why SQLite: it is the most widely crash-tested embedded store, its WAL commit is one fsync
//! of the log, and a single transaction can hold the writes of many operations — which
//! per-volume files cannot (docs/benchmarks.md measured 7 fsyncs per publish with them).
//!
//! # Group commit
//! Every write joins one ordered queue that a single writer thread drains ([`super::writer`]).
//! A *durable* write carries a waiter; a *note* does not. The writer commits everything queued
//! in one transaction (one fsync) as soon as any waiter is among it — after a short commit
//! delay when durable writes arrive close together — and only then answers the waiters of
//! that batch. Notes alone are committed after [`StoreOptions::note_flush`] at the latest, so
//! in steady operation they ride along with the next durable write for free. Writes are
//! applied in the order they were sent, so a later write of the same record always wins.
//!
//! A failed commit (disk full, read-only file system, I/O error) fails every waiter of its
//! batch with the error and rolls the batch back; earlier commits are untouched.
//!
//! It must not interpret records (the caller's types), and reads go through a separate
//! connection (WAL readers never block the writer).

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use rusqlite::{Connection, OpenFlags, OptionalExtension, params};

use super::writer::{self, Queue};
use crate::failpoint;
use crate::metrics::Metrics;

/// The database file inside the work dir.
pub const DB_FILE: &str = "state.db";
/// The schema this build writes and reads.
pub const DB_SCHEMA_VERSION: u32 = 1;
/// Failpoint hit in the writer just before a batch commits.
pub const FP_COMMIT_BEFORE: &str = "store.commit.before";
/// Failpoint hit after a batch committed, before its waiters are answered.
pub const FP_COMMIT_AFTER: &str = "store.commit.after";

const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS meta (
    key TEXT PRIMARY KEY NOT NULL,
    value TEXT NOT NULL
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS volumes (
    plugin_type TEXT NOT NULL,
    plugin_name TEXT NOT NULL,
    volume_key TEXT NOT NULL,
    schema_version INTEGER NOT NULL,
    record TEXT NOT NULL,
    PRIMARY KEY (plugin_type, plugin_name, volume_key)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS named_volumes (
    name TEXT PRIMARY KEY NOT NULL,
    schema_version INTEGER NOT NULL,
    record TEXT NOT NULL
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS quarantine (
    id INTEGER PRIMARY KEY,
    plugin_type TEXT NOT NULL,
    plugin_name TEXT NOT NULL,
    volume_key TEXT NOT NULL,
    record BLOB NOT NULL,
    reason TEXT NOT NULL,
    quarantined_at INTEGER NOT NULL
);
";

/// Tuning of the writer.
#[derive(Clone, Copy, Debug)]
pub struct StoreOptions {
    /// The longest a note waits for a durable write to ride along with before it is
    /// committed alone.
    pub note_flush: Duration,
    /// How long a durable write waits for company before its commit, when durable writes
    /// have been arriving closer together than this (docs/benchmarks.md measured the effect).
    pub commit_delay: Duration,
}

impl Default for StoreOptions {
    fn default() -> Self {
        Self {
            note_flush: Duration::from_millis(500),
            commit_delay: Duration::from_millis(1),
        }
    }
}

/// A row key: the plugin and the volume's encoded id (`layout::encode_id`: one safe ASCII
/// token, so no NUL or odd text ever reaches SQLite).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Key {
    pub plugin_type: String,
    pub plugin_name: String,
    pub volume_key: String,
}

/// One change to the database.
#[derive(Clone, Debug)]
pub enum Op {
    Put {
        key: Key,
        schema_version: u32,
        record: String,
    },
    Delete {
        key: Key,
    },
    /// A row of `named_volumes` (the volume names of the front doors, `crate::named`), keyed
    /// by the name's encoding (`layout::encode_id`).
    PutNamed {
        name_key: String,
        schema_version: u32,
        record: String,
    },
    DeleteNamed {
        name_key: String,
    },
}

/// The row an [`Op`] writes, for keeping the last write of each row.
#[derive(PartialEq, Eq, Hash)]
enum Row<'a> {
    Volume(&'a Key),
    Named(&'a str),
}

/// Why a batch did not commit; cloned to every waiter of the batch.
#[derive(Clone, Debug, thiserror::Error)]
pub enum CommitError {
    #[error("commit to {}: {source}", path.display())]
    Sqlite {
        path: PathBuf,
        #[source]
        source: Arc<rusqlite::Error>,
    },
    #[error("commit interrupted by failpoint {0}")]
    Failpoint(String),
    #[error("the store's writer has stopped")]
    Closed,
}

/// The open database: the writer's queue and the reader connection.
#[derive(Debug)]
pub struct Database {
    path: PathBuf,
    queue: Arc<Queue>,
    reader: Mutex<Connection>,
    writer: Mutex<Option<std::thread::JoinHandle<()>>>,
}

impl Drop for Database {
    /// Lets the writer commit what is queued and waits for it: a store dropped in order
    /// (a clean shutdown, a test) loses no note; a crash may, which is allowed.
    fn drop(&mut self) {
        self.queue.close();
        if let Some(writer) = self
            .writer
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take()
        {
            let _ = writer.join();
        }
    }
}

impl Op {
    fn row(&self) -> Row<'_> {
        match self {
            Op::Put { key, .. } | Op::Delete { key } => Row::Volume(key),
            Op::PutNamed { name_key, .. } | Op::DeleteNamed { name_key } => Row::Named(name_key),
        }
    }
}

/// Keeps only the last operation on each row, in their order: within one transaction an
/// earlier write of a row is overwritten by the later one anyway, so applying it is wasted
/// work (an operation's progress notes pile up on one row between two commits).
pub fn last_per_row(ops: &mut Vec<Op>) {
    // Decided on borrowed keys (no copy of their three strings per operation), then applied.
    let mut keep = vec![false; ops.len()];
    let mut seen = std::collections::HashSet::with_capacity(ops.len());
    for (index, op) in ops.iter().enumerate().rev() {
        keep[index] = seen.insert(op.row());
    }
    let mut keep = keep.into_iter();
    ops.retain(|_| keep.next().unwrap_or(true));
}

/// Errors of opening the database.
#[derive(Debug, thiserror::Error)]
pub enum OpenError {
    #[error("cannot open the state database {}: {source}", path.display())]
    Sqlite {
        path: PathBuf,
        #[source]
        source: rusqlite::Error,
    },
    #[error("cannot create the state database {}: {source}", path.display())]
    Create {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "the state database {} has schema_version {found}, newer than this csi-agentd reads ({supported}): run a csi-agentd at least as new as the one that wrote it",
        path.display()
    )]
    NewerSchema {
        path: PathBuf,
        found: u32,
        supported: u32,
    },
    #[error("the state database {} is not csi-agent's: {reason}", path.display())]
    Foreign { path: PathBuf, reason: String },
}

impl Database {
    /// Opens (creating if needed, mode 0600) `<work_dir>/state.db`, checks its schema, and
    /// returns the writer connection (for migration before the writer starts) and the
    /// database handle (whose writer has not started yet: call [`Database::start`]).
    pub fn open(work_dir: &Path) -> Result<(Connection, PathBuf), OpenError> {
        let path = work_dir.join(DB_FILE);
        // Created 0600 before SQLite sees it; SQLite gives the -wal and -shm files the
        // database file's mode.
        {
            use std::os::unix::fs::OpenOptionsExt;
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .mode(0o600)
                .custom_flags(rustix::fs::OFlags::NOFOLLOW.bits() as i32)
                .open(&path)
                .map_err(|source| OpenError::Create {
                    path: path.clone(),
                    source,
                })?;
        }
        let sqlite = |source| OpenError::Sqlite {
            path: path.clone(),
            source,
        };
        let conn = Connection::open_with_flags(
            &path,
            OpenFlags::SQLITE_OPEN_READ_WRITE | OpenFlags::SQLITE_OPEN_NO_MUTEX,
        )
        .map_err(sqlite)?;
        configure(&conn).map_err(sqlite)?;
        let has_meta: Option<String> = conn
            .query_row(
                "SELECT name FROM sqlite_master WHERE type = 'table' AND name = 'meta'",
                [],
                |row| row.get(0),
            )
            .optional()
            .map_err(sqlite)?;
        if has_meta.is_some() {
            let found: Option<String> = conn
                .query_row(
                    "SELECT value FROM meta WHERE key = 'schema_version'",
                    [],
                    |row| row.get(0),
                )
                .optional()
                .map_err(sqlite)?;
            match found.as_deref().map(str::parse::<u32>) {
                Some(Ok(found)) if found > DB_SCHEMA_VERSION => {
                    return Err(OpenError::NewerSchema {
                        path,
                        found,
                        supported: DB_SCHEMA_VERSION,
                    });
                }
                Some(Ok(_)) | None => {}
                Some(Err(_)) => {
                    return Err(OpenError::Foreign {
                        path,
                        reason: "its meta.schema_version is not a number".to_owned(),
                    });
                }
            }
        }
        conn.execute_batch(SCHEMA).map_err(sqlite)?;
        conn.execute(
            "INSERT OR IGNORE INTO meta (key, value) VALUES ('schema_version', ?1)",
            params![DB_SCHEMA_VERSION.to_string()],
        )
        .map_err(sqlite)?;
        Ok((conn, path))
    }

    /// Starts the writer thread on `writer` and opens the reader connection.
    pub fn start(
        path: PathBuf,
        writer: Connection,
        metrics: Option<Arc<Metrics>>,
        options: StoreOptions,
    ) -> Result<Self, OpenError> {
        let reader = Connection::open_with_flags(
            &path,
            OpenFlags::SQLITE_OPEN_READ_WRITE | OpenFlags::SQLITE_OPEN_NO_MUTEX,
        )
        .and_then(|conn| configure(&conn).map(|()| conn))
        .map_err(|source| OpenError::Sqlite {
            path: path.clone(),
            source,
        })?;
        let queue = Arc::new(Queue::default());
        let writer_queue = queue.clone();
        let writer_path = path.clone();
        let handle = std::thread::Builder::new()
            .name("csi-agent-store".to_owned())
            .spawn(move || write_loop(writer, &writer_path, &writer_queue, metrics, options))
            .map_err(|source| OpenError::Create {
                path: path.clone(),
                source,
            })?;
        Ok(Self {
            path,
            queue,
            reader: Mutex::new(reader),
            writer: Mutex::new(Some(handle)),
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Queues `ops` and waits until the batch holding them is committed.
    pub async fn commit(&self, ops: Vec<Op>) -> Result<(), CommitError> {
        let (done, answer) = tokio::sync::oneshot::channel();
        self.queue.durable(ops, done)?;
        answer.await.unwrap_or(Err(CommitError::Closed))
    }

    /// Queues `op` without waiting: it is committed with a later batch.
    pub fn note(&self, op: Op) {
        if self.queue.note(op).is_err() {
            tracing::warn!("store writer stopped; a progress note was dropped");
        }
    }

    /// Runs `read` on the reader connection.
    pub fn read<T>(
        &self,
        read: impl FnOnce(&Connection) -> rusqlite::Result<T>,
    ) -> rusqlite::Result<T> {
        let conn = self.reader.lock().unwrap_or_else(PoisonError::into_inner);
        read(&conn)
    }
}

fn configure(conn: &Connection) -> rusqlite::Result<()> {
    // WAL: one fsync per commit, readers never block the writer. FULL: that fsync happens at
    // every commit (NORMAL would let a power cut lose the last commits).
    let mode: String = conn.query_row("PRAGMA journal_mode = WAL", [], |row| row.get(0))?;
    if !mode.eq_ignore_ascii_case("wal") {
        return Err(rusqlite::Error::InvalidParameterName(format!(
            "journal_mode is {mode}, WAL was asked"
        )));
    }
    conn.pragma_update(None, "synchronous", "FULL")?;
    conn.busy_timeout(Duration::from_secs(10))?;
    Ok(())
}

/// Applies `ops` in order in one transaction.
pub fn apply(conn: &mut Connection, ops: &[Op]) -> rusqlite::Result<()> {
    apply_inner(conn, ops, None)
}

/// Applies `ops` and sets `meta.<key> = <value>` in the same transaction.
pub fn apply_with_meta(
    conn: &mut Connection,
    ops: &[Op],
    meta: (&str, &str),
) -> rusqlite::Result<()> {
    apply_inner(conn, ops, Some(meta))
}

fn apply_inner(
    conn: &mut Connection,
    ops: &[Op],
    meta: Option<(&str, &str)>,
) -> rusqlite::Result<()> {
    let tx = conn.transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)?;
    if let Some((key, value)) = meta {
        tx.execute(
            "INSERT INTO meta (key, value) VALUES (?1, ?2)
             ON CONFLICT (key) DO UPDATE SET value = excluded.value",
            params![key, value],
        )?;
    }
    {
        let mut put = tx.prepare_cached(
            "INSERT INTO volumes (plugin_type, plugin_name, volume_key, schema_version, record)
             VALUES (?1, ?2, ?3, ?4, ?5)
             ON CONFLICT (plugin_type, plugin_name, volume_key)
             DO UPDATE SET schema_version = excluded.schema_version, record = excluded.record",
        )?;
        let mut delete = tx.prepare_cached(
            "DELETE FROM volumes WHERE plugin_type = ?1 AND plugin_name = ?2 AND volume_key = ?3",
        )?;
        let mut put_named = tx.prepare_cached(
            "INSERT INTO named_volumes (name, schema_version, record) VALUES (?1, ?2, ?3)
             ON CONFLICT (name)
             DO UPDATE SET schema_version = excluded.schema_version, record = excluded.record",
        )?;
        let mut delete_named = tx.prepare_cached("DELETE FROM named_volumes WHERE name = ?1")?;
        for op in ops {
            match op {
                Op::Put {
                    key,
                    schema_version,
                    record,
                } => {
                    put.execute(params![
                        key.plugin_type,
                        key.plugin_name,
                        key.volume_key,
                        schema_version,
                        record
                    ])?;
                }
                Op::Delete { key } => {
                    delete.execute(params![key.plugin_type, key.plugin_name, key.volume_key])?;
                }
                Op::PutNamed {
                    name_key,
                    schema_version,
                    record,
                } => {
                    put_named.execute(params![name_key, schema_version, record])?;
                }
                Op::DeleteNamed { name_key } => {
                    delete_named.execute(params![name_key])?;
                }
            }
        }
    }
    tx.commit()
}

fn write_loop(
    mut conn: Connection,
    path: &Path,
    queue: &Queue,
    metrics: Option<Arc<Metrics>>,
    options: StoreOptions,
) {
    writer::run(
        queue,
        options,
        |ops| {
            last_per_row(ops);
            commit_batch(&mut conn, path, ops)
        },
        |committed| {
            if let Some(metrics) = &metrics {
                metrics.checkpoint_writes.inc();
                if committed.waiters == 0 {
                    metrics.checkpoint_lazy_commits.inc();
                }
                metrics.checkpoint_records.inc_by(committed.ops as u64);
                metrics
                    .checkpoint_fsync_seconds
                    .observe(committed.took.as_secs_f64());
            }
        },
    );
}

fn commit_batch(conn: &mut Connection, path: &Path, ops: &[Op]) -> Result<(), CommitError> {
    failpoint::hit(FP_COMMIT_BEFORE).map_err(|e| CommitError::Failpoint(e.to_string()))?;
    apply(conn, ops).map_err(|source| CommitError::Sqlite {
        path: path.to_path_buf(),
        source: Arc::new(source),
    })?;
    failpoint::hit(FP_COMMIT_AFTER).map_err(|e| CommitError::Failpoint(e.to_string()))?;
    Ok(())
}

/// One row of the `volumes` table, as stored.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RawRow {
    pub plugin_type: String,
    pub plugin_name: String,
    /// The encoded volume id (`layout::encode_id`).
    pub volume_key: String,
    pub schema_version: u32,
    pub record: String,
}

/// Offline access for tests and tooling, while no daemon uses the work dir: every row of
/// `volumes`, sorted. (Operators can do the same with `sqlite3 -readonly`.)
pub fn dump(work_dir: &Path) -> rusqlite::Result<Vec<RawRow>> {
    let conn = Connection::open_with_flags(
        work_dir.join(DB_FILE),
        OpenFlags::SQLITE_OPEN_READ_ONLY | OpenFlags::SQLITE_OPEN_NO_MUTEX,
    )?;
    let mut stmt = conn.prepare(
        "SELECT plugin_type, plugin_name, volume_key, schema_version, record FROM volumes
         ORDER BY plugin_type, plugin_name, volume_key",
    )?;
    stmt.query_map([], |row| {
        Ok(RawRow {
            plugin_type: row.get(0)?,
            plugin_name: row.get(1)?,
            volume_key: row.get(2)?,
            schema_version: row.get(3)?,
            record: row.get(4)?,
        })
    })?
    .collect()
}

/// Offline access for tests and tooling: writes one row as given (a hand edit).
pub fn put_raw(work_dir: &Path, row: &RawRow) -> rusqlite::Result<()> {
    let mut conn = Connection::open(work_dir.join(DB_FILE))?;
    conn.busy_timeout(Duration::from_secs(10))?;
    apply(
        &mut conn,
        &[Op::Put {
            key: Key {
                plugin_type: row.plugin_type.clone(),
                plugin_name: row.plugin_name.clone(),
                volume_key: row.volume_key.clone(),
            },
            schema_version: row.schema_version,
            record: row.record.clone(),
        }],
    )
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn key(volume: &str) -> Key {
        Key {
            plugin_type: "t".into(),
            plugin_name: "default".into(),
            volume_key: volume.into(),
        }
    }

    fn put(volume: &str, record: &str) -> Op {
        Op::Put {
            key: key(volume),
            schema_version: 1,
            record: record.into(),
        }
    }

    fn delete(volume: &str) -> Op {
        Op::Delete { key: key(volume) }
    }

    fn describe(ops: &[Op]) -> Vec<String> {
        ops.iter()
            .map(|op| match op {
                Op::Put { key, record, .. } => format!("put {} {record}", key.volume_key),
                Op::Delete { key } => format!("delete {}", key.volume_key),
                Op::PutNamed {
                    name_key, record, ..
                } => format!("put name {name_key} {record}"),
                Op::DeleteNamed { name_key } => format!("delete name {name_key}"),
            })
            .collect()
    }

    #[test]
    fn a_batch_keeps_the_last_write_of_each_row() {
        let mut ops = vec![
            put("a", "1"),
            put("b", "1"),
            put("a", "2"),
            delete("b"),
            put("c", "1"),
            delete("a"),
            put("a", "3"),
        ];
        last_per_row(&mut ops);
        assert_eq!(describe(&ops), ["delete b", "put c 1", "put a 3"]);
    }

    #[test]
    fn a_deduplicated_batch_leaves_the_same_rows_as_the_whole_one() {
        let ops = vec![
            put("a", "1"),
            put("b", "1"),
            put("a", "2"),
            delete("b"),
            put("b", "2"),
            delete("a"),
            put("c", "1"),
        ];
        let rows = |ops: &[Op]| {
            let dir = tempfile::tempdir().unwrap();
            let (mut conn, _) = Database::open(dir.path()).unwrap();
            apply(&mut conn, ops).unwrap();
            let mut stmt = conn
                .prepare("SELECT volume_key, record FROM volumes ORDER BY volume_key")
                .unwrap();
            stmt.query_map([], |row| {
                Ok((row.get::<_, String>(0)?, row.get::<_, String>(1)?))
            })
            .unwrap()
            .collect::<Result<Vec<_>, _>>()
            .unwrap()
        };
        let mut deduplicated = ops.clone();
        last_per_row(&mut deduplicated);
        assert_eq!(rows(&ops), rows(&deduplicated));
        assert_eq!(
            rows(&ops),
            [
                ("b".to_owned(), "2".to_owned()),
                ("c".to_owned(), "1".to_owned())
            ]
        );
    }
}
