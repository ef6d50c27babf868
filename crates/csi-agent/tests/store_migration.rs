//! Migration of a work dir written by the first release's per-file store into the state
//! database: complete, idempotent, crash-safe (SIGKILL at each migration failpoint, then a
//! restart finishes it), unreadable files quarantined as before, secrets left in place; and a
//! database from a newer csi-agent refused with both versions named.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::os::unix::process::ExitStatusExt;
use std::path::Path;
use std::process::Command;

use csi_agent::layout::Layout;
use csi_agent::store::{FileStore, Store};
use csi_agent::volume::{Origin, VolumeRecord, VolumeSecrets, VolumeState};

const T: &str = "org.example.test";
const N: &str = "default";

fn record(id: &str, claims: &[&str]) -> VolumeRecord {
    let mut record = VolumeRecord::new(id, Origin::PreProvisioned);
    record.state = VolumeState::Published;
    record.claims = claims.iter().map(|c| (*c).to_owned()).collect();
    record
}

/// A work dir as the first release left it: 20 records (ids that need encoding among them),
/// one with a secrets file, one corrupt record file.
fn legacy_work_dir(work: &Path) -> Vec<VolumeRecord> {
    let files = FileStore::open(Layout::new(work), None).unwrap();
    let mut records = Vec::new();
    for i in 0..20 {
        let id = if i % 5 == 0 {
            format!("vol/{i} ünïcode")
        } else {
            format!("vol-{i}")
        };
        let mut r = record(&id, &["w1"]);
        if i == 3 {
            r.has_secrets = true;
            files
                .save_secrets(
                    T,
                    N,
                    &id,
                    &VolumeSecrets {
                        node_stage: [("k".to_owned(), "v".to_owned())].into(),
                        node_publish: Default::default(),
                    },
                )
                .unwrap();
        }
        files.save_volume(T, N, &id, &r).unwrap();
        records.push(r);
    }
    let corrupt = Layout::new(work).volume_dir(T, N, "corrupt");
    std::fs::create_dir_all(&corrupt).unwrap();
    std::fs::write(
        corrupt.join("volume.json"),
        b"{\"schema_version\": 1, \"rec",
    )
    .unwrap();
    records.sort_by(|a, b| a.volume_id.cmp(&b.volume_id));
    records
}

fn record_files(work: &Path) -> usize {
    let volumes = Layout::new(work).volumes_dir(T, N);
    std::fs::read_dir(volumes)
        .map(|entries| {
            entries
                .flatten()
                .filter(|e| e.path().join("volume.json").exists())
                .count()
        })
        .unwrap_or(0)
}

fn loaded(store: &Store) -> Vec<VolumeRecord> {
    let all = store.load_all::<VolumeRecord>(T, N).unwrap();
    assert!(all.problems.is_empty(), "{:?}", all.problems);
    all.records.into_iter().map(|l| l.record).collect()
}

#[test]
fn migration_imports_every_record_removes_the_files_and_keeps_secrets() {
    let dir = tempfile::tempdir().unwrap();
    let work = dir.path().join("work");
    let expected = legacy_work_dir(&work);
    assert_eq!(record_files(&work), 21);
    let store = Store::open(Layout::new(&work), None).unwrap();
    assert_eq!(loaded(&store), expected);
    assert_eq!(record_files(&work), 0, "the record files are removed");
    let quarantine = Layout::new(&work).plugin_dir(T, N).join("quarantine");
    assert_eq!(
        std::fs::read_dir(quarantine).unwrap().count(),
        1,
        "the corrupt file is moved aside"
    );
    let secrets: Option<VolumeSecrets> = store.load_secrets(T, N, "vol-3").unwrap();
    assert_eq!(secrets.unwrap().node_stage["k"], "v");
    drop(store);
    // A second start finds nothing more to do and changes nothing.
    let store = Store::open(Layout::new(&work), None).unwrap();
    assert_eq!(loaded(&store), expected);
}

#[test]
fn a_database_from_a_newer_csi_agent_is_refused_naming_both_versions() {
    let dir = tempfile::tempdir().unwrap();
    drop(Store::open(Layout::new(dir.path()), None).unwrap());
    let conn = rusqlite::Connection::open(dir.path().join("state.db")).unwrap();
    conn.execute(
        "UPDATE meta SET value = '99' WHERE key = 'schema_version'",
        [],
    )
    .unwrap();
    drop(conn);
    let err = Store::open(Layout::new(dir.path()), None)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("schema_version 99") && err.contains("(1)"),
        "{err}"
    );
}

const CHILD_WORK: &str = "CSI_AGENT_MIGRATION_CHILD_WORK";

/// Runs only as the child of `a_migration_killed_at_*`: opens the store under the armed
/// failpoint, which must kill it.
#[test]
fn migration_child() {
    let Some(work) = std::env::var_os(CHILD_WORK) else {
        return;
    };
    csi_agent::failpoint::init_from_env().unwrap();
    let _ = Store::open(Layout::new(Path::new(&work)), None);
    println!("child: completed");
}

fn killed_migration(spec: &str) {
    let dir = tempfile::tempdir().unwrap();
    let work = dir.path().join("work");
    let expected = legacy_work_dir(&work);
    let output = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "migration_child",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD_WORK, &work)
        .env(csi_agent::failpoint::ENV_VAR, spec)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert_eq!(output.status.signal(), Some(9), "{spec}: {stdout}");
    assert!(!stdout.contains("child: completed"));
    // The restart finishes the migration: every record, no file left.
    let store = Store::open(Layout::new(&work), None).unwrap();
    assert_eq!(loaded(&store), expected, "{spec}");
    assert_eq!(record_files(&work), 0, "{spec}");
}

#[test]
fn a_migration_killed_after_its_commit_is_finished_by_the_restart() {
    killed_migration("store.migrate.after_commit=exit");
}

#[test]
fn a_migration_killed_while_removing_files_is_finished_by_the_restart() {
    killed_migration("store.migrate.after_remove=1*exit");
    killed_migration("store.migrate.after_remove=7*exit");
}

#[test]
fn a_migration_killed_before_its_commit_starts_over() {
    // The first file write of the store itself: the database exists, nothing is imported.
    killed_migration("store.migrate.before_commit=exit");
}

#[test]
fn a_record_file_that_cannot_be_read_is_moved_aside_not_removed() {
    let dir = tempfile::tempdir().unwrap();
    let work = dir.path();
    legacy_work_dir(work);
    // Opening a socket fails (ENXIO): an I/O error, not a verdict on the record.
    let odd = Layout::new(work).volume_dir(T, N, "odd");
    std::fs::create_dir_all(&odd).unwrap();
    let _socket = std::os::unix::net::UnixListener::bind(odd.join("volume.json")).unwrap();
    let store = Store::open(Layout::new(work), None).unwrap();
    assert!(!loaded(&store).iter().any(|r| r.volume_id == "odd"));
    assert!(
        !odd.exists(),
        "left in volumes/ to be removed by the next start"
    );
    let quarantine = Layout::new(work).plugin_dir(T, N).join("quarantine");
    let moved: Vec<String> = std::fs::read_dir(&quarantine)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    let entry = moved
        .iter()
        .find(|n| n.starts_with("odd."))
        .unwrap_or_else(|| panic!("not moved aside: {moved:?}"));
    let kept = quarantine.join(entry).join("volume.json");
    assert!(
        std::fs::symlink_metadata(&kept).is_ok(),
        "{} is gone",
        kept.display()
    );
    drop(store);
    // A second start changes nothing more.
    let _store = Store::open(Layout::new(work), None).unwrap();
    assert!(std::fs::symlink_metadata(&kept).is_ok());
}
