//! Migration of a work dir written by the first release's per-file store
//! (`csi/<type>/<name>/volumes/<enc id>/volume.json`) into the database.
//!
//! Crash-safe and idempotent: every readable record file is inserted in one transaction that
//! also sets `meta.files_migrated`; only after that commit are the record files removed. A
//! crash before the commit leaves the files as they were (the next start migrates again, and
//! `INSERT OR REPLACE` makes a repeated insert harmless); a crash after it leaves files that
//! the next start only removes, never imports again (the database has moved on since). Secrets
//! files stay where they are: the database era keeps them there too. A volume dir with secrets
//! and no record file (what every volume dir of the database era is) is left alone, never taken
//! for an interrupted first-release write, since the migration also runs on every new database
//! (a reinitialized one included). Unreadable record files are moved to `quarantine/` by the
//! file store's own rules and reported.
//!
//! It must not touch anything but record files and the database.

use std::path::Path;

use rusqlite::{Connection, OptionalExtension};

use super::db::{self, Key, Op};
use super::files::{FileStore, ProblemKind, Record, StoreError};
use crate::failpoint;
use crate::layout::encode_id;

/// Failpoint: the records are read, their rows not yet committed.
pub const FP_MIGRATE_BEFORE_COMMIT: &str = "store.migrate.before_commit";
/// Failpoint: the migrated rows are committed, the record files not yet removed.
pub const FP_MIGRATE_AFTER_COMMIT: &str = "store.migrate.after_commit";
/// Failpoint: hit after each record file removed by the migration.
pub const FP_MIGRATE_AFTER_REMOVE: &str = "store.migrate.after_remove";

/// A record of the first release, copied as it is: that release wrote volume records with
/// schema_version 1 only, so any other version is unreadable and quarantined by the file
/// store's rules, exactly as that release would have done.
#[derive(serde::Serialize, serde::Deserialize)]
#[serde(transparent)]
struct FirstRelease(serde_json::Value);

impl super::files::Record for FirstRelease {
    const SCHEMA_VERSION: u32 = 1;
}

/// Imports every per-file record under the work dir, then removes the files.
pub fn from_files(
    files: &FileStore,
    conn: &mut Connection,
    db_path: &Path,
) -> Result<(), StoreError> {
    let sqlite = |source| StoreError::Read {
        path: db_path.to_path_buf(),
        source,
    };
    let migrated: Option<String> = conn
        .query_row(
            "SELECT value FROM meta WHERE key = 'files_migrated'",
            [],
            |row| row.get(0),
        )
        .optional()
        .map_err(sqlite)?;
    let plugins = plugin_dirs(files);
    if migrated.is_none() {
        let mut ops = Vec::new();
        // Record files that could not be read for a reason that may pass (EIO, ...), left in
        // place by the file store: not imported, so moved aside after the commit instead of
        // being removed with the migrated ones.
        let mut left = Vec::new();
        for (plugin_type, plugin_name) in &plugins {
            // Moves unreadable files to quarantine/ and reports them, as the file store did.
            let loaded =
                files.load_all_keeping_secrets::<FirstRelease>(plugin_type, plugin_name)?;
            for problem in &loaded.problems {
                if problem.moved_to.is_none() && matches!(problem.kind, ProblemKind::Io(_)) {
                    left.push((
                        plugin_type.clone(),
                        plugin_name.clone(),
                        problem.path.clone(),
                    ));
                }
            }
            for loaded in loaded.records {
                ops.push(Op::Put {
                    key: Key {
                        plugin_type: plugin_type.clone(),
                        plugin_name: plugin_name.clone(),
                        volume_key: encode_id(&loaded.volume_id),
                    },
                    schema_version: FirstRelease::SCHEMA_VERSION,
                    record: loaded.record.0.to_string(),
                });
            }
        }
        let count = ops.len();
        failpoint::hit(FP_MIGRATE_BEFORE_COMMIT)?;
        db::apply_with_meta(conn, &ops, ("files_migrated", "1")).map_err(sqlite)?;
        if count > 0 {
            tracing::info!(records = count, db = %db_path.display(), "migrated the per-file volume records into the state database");
        }
        failpoint::hit(FP_MIGRATE_AFTER_COMMIT)?;
        for (plugin_type, plugin_name, dir) in left {
            match files.quarantine_volume_dir(&plugin_type, &plugin_name, &dir) {
                Ok(to) => {
                    tracing::warn!(dir = %dir.display(), moved_to = %to.display(), "record file not migrated (unreadable); moved aside for the operator")
                }
                Err(err) => {
                    tracing::error!(dir = %dir.display(), error = %err, "record file not migrated (unreadable) and not moved aside")
                }
            }
        }
    }
    // The database holds them (now, or since an earlier start): the files go.
    for (plugin_type, plugin_name) in &plugins {
        files.remove_record_files(plugin_type, plugin_name, || {
            failpoint::hit(FP_MIGRATE_AFTER_REMOVE).map_err(StoreError::from)
        })?;
    }
    Ok(())
}

/// `csi/<type>/<name>` dirs that have a `volumes/` dir, with names the config rules allow.
fn plugin_dirs(files: &FileStore) -> Vec<(String, String)> {
    let root = files.layout().csi_root();
    let mut out = Vec::new();
    let Ok(types) = std::fs::read_dir(&root) else {
        return out;
    };
    for plugin_type in types.flatten() {
        let Some(type_name) = plugin_type.file_name().to_str().map(str::to_owned) else {
            continue;
        };
        let Ok(names) = std::fs::read_dir(plugin_type.path()) else {
            continue;
        };
        for name in names.flatten() {
            let Some(plugin_name) = name.file_name().to_str().map(str::to_owned) else {
                continue;
            };
            if crate::config::validate_name(&type_name).is_err()
                || crate::config::validate_name(&plugin_name).is_err()
            {
                continue;
            }
            if name.path().join("volumes").is_dir() {
                out.push((type_name.clone(), plugin_name));
            }
        }
    }
    out.sort();
    out
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    #[test]
    fn the_marker_and_the_rows_commit_together() {
        let dir = tempfile::tempdir().unwrap();
        let (mut conn, _) = db::Database::open(dir.path()).unwrap();
        db::apply_with_meta(&mut conn, &[], ("files_migrated", "1")).unwrap();
        let value: String = conn
            .query_row(
                "SELECT value FROM meta WHERE key = 'files_migrated'",
                [],
                |r| r.get(0),
            )
            .unwrap();
        assert_eq!(value, "1");
    }
}
