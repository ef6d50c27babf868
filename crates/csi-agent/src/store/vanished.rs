//! Vanished state is not a new node: the start-up check that tells a work dir that never had a
//! database from one whose `state.db` was lost (removed, or truncated to 0 bytes).
//!
//! Starting on an empty database in a work dir that held volumes would forget every claim
//! (an unpublish then finds "no such claim", the volumes' mounts leak) and make their secrets
//! look like leftovers. So [`check`] runs after the work dir is locked and before the store
//! opens: a missing or empty `state.db` while the work dir shows earlier state (volume secrets,
//! volume mount dirs, component dirs, mounts beneath `<work_dir>/csi`) is refused, naming what
//! was found and how to recover, unless the operator asked for `--reinitialize-state`. Then an
//! empty database is created with `meta.reinitialized_at` set, which the store reads to keep
//! every secrets file older than that moment (see `Store::load_all`).
//!
//! A work dir of the first release (per-file records, `volumes/<id>/volume.json`) has no
//! database by design: the store's migration imports it, so such a work dir is not vanished
//! state.
//!
//! It must not delete, move or rewrite anything: it only reads, and creates the database when
//! reinitializing.

use std::fmt;
use std::path::{Path, PathBuf};

use super::db::{DB_FILE, Database};
use crate::layout::Layout;

/// The `meta` key holding when `--reinitialize-state` created the database (Unix
/// milliseconds: secrets written in the same second after it must not pass for older).
pub const REINITIALIZED_AT: &str = "reinitialized_at_ms";

/// How many example paths a refusal names per kind.
const EXAMPLES: usize = 3;

/// What the work dir holds that only an earlier daemon can have made.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Found {
    /// `csi/<type>/<name>/volumes/<id>/secrets.json`.
    pub secrets: Vec<PathBuf>,
    /// `csi/<type>/<name>/mounts/<id>`.
    pub mount_dirs: Vec<PathBuf>,
    /// `csi/<type>/<name>/containers/<id>`.
    pub component_dirs: Vec<PathBuf>,
    /// Mount points beneath `<work_dir>/csi` in this process's mount table.
    pub mounts: Vec<PathBuf>,
}

impl Found {
    pub fn is_empty(&self) -> bool {
        self.secrets.is_empty()
            && self.mount_dirs.is_empty()
            && self.component_dirs.is_empty()
            && self.mounts.is_empty()
    }
}

impl fmt::Display for Found {
    /// `2 secrets files (e.g. …), 3 volume mount dirs (e.g. …), …`, kinds with none left out.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let kinds = [
            ("secrets file(s)", &self.secrets),
            ("volume mount dir(s)", &self.mount_dirs),
            ("plugin component dir(s)", &self.component_dirs),
            ("mount(s) beneath the work dir", &self.mounts),
        ];
        let mut first = true;
        for (what, paths) in kinds {
            if paths.is_empty() {
                continue;
            }
            if !first {
                f.write_str("; ")?;
            }
            first = false;
            let examples: Vec<String> = paths
                .iter()
                .take(EXAMPLES)
                .map(|p| p.display().to_string())
                .collect();
            write!(f, "{} {what} (e.g. {})", paths.len(), examples.join(", "))?;
        }
        Ok(())
    }
}

/// The state of `state.db` before the store opens it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DbFile {
    Present,
    Missing,
    /// 0 bytes: truncated, or created by a start that died before SQLite wrote to it.
    Empty,
}

impl fmt::Display for DbFile {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Present => "present",
            Self::Missing => "missing",
            Self::Empty => "empty (0 bytes)",
        })
    }
}

#[derive(Debug, thiserror::Error)]
pub enum VanishedError {
    #[error(
        "the state database {} is {db_file}, but the work dir {} shows earlier state: {found}. \
         Starting on an empty database would forget every claim (their mounts would leak and \
         their unpublishes find no claim), so csi-agentd refuses. To recover: restore {} (with \
         its -wal file, if the copy has one) from a backup and start again; or, if no copy \
         exists, start once with --reinitialize-state, which starts from an empty database and \
         deletes none of the above (docs/operations.md, \"The state database vanished\")",
        db.display(),
        work_dir.display(),
        db.display()
    )]
    Refused {
        work_dir: PathBuf,
        db: PathBuf,
        db_file: DbFile,
        found: Box<Found>,
    },
    #[error("cannot inspect the work dir for earlier state: {op} {}: {source}", path.display())]
    Io {
        op: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot read the mount table to look for earlier state beneath the work dir: {0}")]
    Mounts(#[from] crate::mounts::MountError),
    #[error("--reinitialize-state: cannot create the state database: {0}")]
    Create(#[source] super::StoreError),
}

/// What [`check`] decided.
#[derive(Debug, PartialEq, Eq)]
pub enum Outcome {
    /// The database is there (or this is a new node, or a first-release work dir to migrate).
    Proceed,
    /// `--reinitialize-state` on vanished state: an empty database was created, marked.
    Reinitialized(Found),
}

/// Whether `state.db` is present, missing or empty. A symlink or other non-file is
/// "present": the store's own open refuses it with its own message.
pub fn db_file(work_dir: &Path) -> Result<DbFile, VanishedError> {
    let path = work_dir.join(DB_FILE);
    match std::fs::symlink_metadata(&path) {
        Ok(meta) if meta.is_file() && meta.len() == 0 => Ok(DbFile::Empty),
        Ok(_) => Ok(DbFile::Present),
        Err(err) if err.kind() == std::io::ErrorKind::NotFound => Ok(DbFile::Missing),
        Err(source) => Err(VanishedError::Io {
            op: "stat",
            path,
            source,
        }),
    }
}

/// The start-up check (see the module doc). `reinitialize`: `--reinitialize-state`.
pub fn check(layout: &Layout, reinitialize: bool) -> Result<Outcome, VanishedError> {
    let work_dir = layout.work_dir();
    let db = db_file(work_dir)?;
    if db == DbFile::Present {
        if reinitialize {
            tracing::warn!(db = %work_dir.join(DB_FILE).display(), "--reinitialize-state ignored: the state database is there; remove the flag (it is for a start whose state.db is missing or empty)");
        }
        return Ok(Outcome::Proceed);
    }
    if has_first_release_records(layout)? {
        // The migration imports them; the rest of the work dir is theirs.
        return Ok(Outcome::Proceed);
    }
    let table = crate::mounts::MountTable::read()?;
    let found = scan(layout, &table)?;
    if found.is_empty() {
        return Ok(Outcome::Proceed);
    }
    if !reinitialize {
        return Err(VanishedError::Refused {
            work_dir: work_dir.to_path_buf(),
            db: work_dir.join(DB_FILE),
            db_file: db,
            found: Box::new(found),
        });
    }
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0);
    let (conn, path) = Database::open(work_dir).map_err(|e| VanishedError::Create(e.into()))?;
    conn.execute(
        "INSERT OR REPLACE INTO meta (key, value) VALUES (?1, ?2)",
        rusqlite::params![REINITIALIZED_AT, now.to_string()],
    )
    .map_err(|source| VanishedError::Create(super::StoreError::Read { path, source }))?;
    tracing::warn!(
        work_dir = %work_dir.display(),
        %found,
        "--reinitialize-state: the state database was {db}; started from an empty one. Nothing was deleted: these secrets files are kept, and the mounts are reported as mounts without a volume record and left in place",
    );
    Ok(Outcome::Reinitialized(found))
}

/// The plugin dirs `csi/<type>/<name>` (sorted), skipping names that are not directories.
fn plugin_dirs(layout: &Layout) -> Result<Vec<PathBuf>, VanishedError> {
    let mut out = Vec::new();
    for type_dir in list_dirs(&layout.csi_root())? {
        out.extend(list_dirs(&type_dir)?);
    }
    Ok(out)
}

/// The subdirectories of `dir` (not following symlinks), sorted; none when `dir` is missing
/// or not a directory (a broken plugin dir is the plugin's initialization to report, not a
/// reason to refuse the whole daemon). Any other error refuses: what it hides is unknown.
fn list_dirs(dir: &Path) -> Result<Vec<PathBuf>, VanishedError> {
    let entries = match std::fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(err)
            if matches!(
                err.kind(),
                std::io::ErrorKind::NotFound | std::io::ErrorKind::NotADirectory
            ) =>
        {
            return Ok(Vec::new());
        }
        Err(source) => {
            return Err(VanishedError::Io {
                op: "list",
                path: dir.to_path_buf(),
                source,
            });
        }
    };
    let mut out: Vec<PathBuf> = entries
        .flatten()
        .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
        .map(|e| e.path())
        .collect();
    out.sort();
    Ok(out)
}

fn has_first_release_records(layout: &Layout) -> Result<bool, VanishedError> {
    for plugin in plugin_dirs(layout)? {
        for volume in list_dirs(&plugin.join("volumes"))? {
            if volume.join(super::files::VOLUME_RECORD_FILE).exists() {
                return Ok(true);
            }
        }
    }
    Ok(false)
}

/// Everything under `<work_dir>/csi` that an earlier daemon made.
pub fn scan(layout: &Layout, table: &crate::mounts::MountTable) -> Result<Found, VanishedError> {
    let mut found = Found::default();
    for plugin in plugin_dirs(layout)? {
        for volume in list_dirs(&plugin.join("volumes"))? {
            let secrets = volume.join(super::files::SECRETS_FILE);
            if std::fs::symlink_metadata(&secrets).is_ok() {
                found.secrets.push(secrets);
            }
        }
        found.mount_dirs.extend(list_dirs(&plugin.join("mounts"))?);
        found
            .component_dirs
            .extend(list_dirs(&plugin.join("containers"))?);
    }
    found.mounts = table
        .mounts_under(&layout.csi_root())
        .into_iter()
        .map(|m| m.mount_point.clone())
        .collect();
    Ok(found)
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;
    use crate::mounts::MountTable;

    fn layout() -> (tempfile::TempDir, Layout) {
        let dir = tempfile::tempdir().unwrap();
        let layout = Layout::new(dir.path().join("work"));
        std::fs::create_dir_all(layout.work_dir()).unwrap();
        (dir, layout)
    }

    /// The dir of volume `v1` of `org.example/default`, holding a secrets file.
    fn volume_with_secrets(layout: &Layout) -> PathBuf {
        let vol = layout.volume_dir("org.example", "default", "v1");
        std::fs::create_dir_all(&vol).unwrap();
        std::fs::write(vol.join(super::super::files::SECRETS_FILE), b"{}").unwrap();
        vol
    }

    #[test]
    fn a_new_node_and_a_healthy_one_proceed() {
        let (_dir, layout) = layout();
        assert_eq!(check(&layout, false).unwrap(), Outcome::Proceed);
        // An empty state.db with nothing else: a first start that died early.
        std::fs::write(layout.work_dir().join(DB_FILE), b"").unwrap();
        assert_eq!(db_file(layout.work_dir()).unwrap(), DbFile::Empty);
        assert_eq!(check(&layout, false).unwrap(), Outcome::Proceed);
    }

    #[test]
    fn vanished_state_is_refused_naming_what_was_found() {
        let (_dir, layout) = layout();
        let vol = volume_with_secrets(&layout);
        std::fs::create_dir_all(layout.staging_path("org.example", "default", "v2")).unwrap();
        std::fs::create_dir_all(layout.container_dir("org.example", "default", "c1")).unwrap();
        for db in [DbFile::Missing, DbFile::Empty] {
            if db == DbFile::Empty {
                std::fs::write(layout.work_dir().join(DB_FILE), b"").unwrap();
            }
            let err = check(&layout, false).unwrap_err();
            let message = err.to_string();
            assert!(matches!(err, VanishedError::Refused { db_file, .. } if db_file == db));
            for part in [
                format!("is {db}"),
                "1 secrets file(s) (e.g. ".to_owned(),
                vol.join("secrets.json").display().to_string(),
                "1 volume mount dir(s)".to_owned(),
                "1 plugin component dir(s)".to_owned(),
                "--reinitialize-state".to_owned(),
                "restore".to_owned(),
            ] {
                assert!(message.contains(&part), "{part:?} not in {message}");
            }
        }
        // Nothing was created or removed by the refusals.
        assert!(vol.join("secrets.json").exists());
        assert_eq!(
            std::fs::metadata(layout.work_dir().join(DB_FILE))
                .unwrap()
                .len(),
            0
        );
    }

    #[test]
    fn mounts_beneath_the_work_dir_are_found_and_others_are_not() {
        let (_dir, layout) = layout();
        let inside = layout.target_path("org.example", "default", "v");
        let line = |id: u32, p: &Path| {
            format!(
                "{id} 1 0:50 / {} rw,relatime - tmpfs tmpfs rw\n",
                p.display()
            )
        };
        let table = MountTable::parse(&format!(
            "{}{}{}",
            line(2, &inside),
            line(3, Path::new("/somewhere/else")),
            line(4, &layout.work_dir().join("images/x"))
        ))
        .unwrap();
        let found = scan(&layout, &table).unwrap();
        assert_eq!(found.mounts, vec![inside]);
        assert!(
            found
                .to_string()
                .starts_with("1 mount(s) beneath the work dir")
        );
    }

    #[test]
    fn reinitializing_creates_a_marked_database_and_deletes_nothing() {
        let (_dir, layout) = layout();
        let vol = volume_with_secrets(&layout);
        let Outcome::Reinitialized(found) = check(&layout, true).unwrap() else {
            panic!("not reinitialized");
        };
        assert_eq!(found.secrets, vec![vol.join("secrets.json")]);
        assert!(vol.join("secrets.json").exists());
        assert_eq!(db_file(layout.work_dir()).unwrap(), DbFile::Present);
        let conn = rusqlite::Connection::open(layout.work_dir().join(DB_FILE)).unwrap();
        let at: String = conn
            .query_row(
                "SELECT value FROM meta WHERE key = ?1",
                [REINITIALIZED_AT],
                |row| row.get(0),
            )
            .unwrap();
        assert!(at.parse::<u64>().unwrap() > 0);
        // Once the database is there, the flag changes nothing.
        assert_eq!(check(&layout, true).unwrap(), Outcome::Proceed);
    }

    #[test]
    fn a_plugin_dir_that_is_not_a_directory_is_no_evidence_and_no_error() {
        let (_dir, layout) = layout();
        let volumes = layout.volumes_dir("org.example", "default");
        std::fs::create_dir_all(volumes.parent().unwrap()).unwrap();
        std::fs::write(&volumes, b"not a directory").unwrap();
        std::fs::write(layout.csi_root().join("stray-file"), b"").unwrap();
        assert_eq!(check(&layout, false).unwrap(), Outcome::Proceed);
    }

    #[test]
    fn a_first_release_work_dir_is_migrated_not_refused() {
        let (_dir, layout) = layout();
        let vol = volume_with_secrets(&layout);
        std::fs::write(vol.join(super::super::files::VOLUME_RECORD_FILE), b"{}").unwrap();
        assert_eq!(check(&layout, false).unwrap(), Outcome::Proceed);
    }
}
