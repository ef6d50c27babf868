//! Hostile on-disk state, on the real daemon with the real test plugin and real mounts: the
//! per-volume record files of the first release (what `store/migrate.rs` imports) and rows of
//! `state.db`, forged while the daemon is stopped. Each record may be truncated, huge, a
//! symlink (to `/etc/shadow`, or to a well-formed record elsewhere), a FIFO, named by an id
//! that does not decode, or carry `bind_mounts` outside every `--bind-root` (with `..`, or
//! onto a foreign mount point with that mount's id). For each: the daemon starts, serves the
//! other volumes, reports the bad record naming it, moves it aside or refuses what it asks,
//! and never reads, mounts, unmounts or creates anything outside its roots.
//! Run under `unshare -m --propagation private`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use csi_agent::layout::encode_id;
use csi_agent::mounts::{MountTable, require_private_mount_namespace};
use csi_agent_testkit::node::*;
use csi_agent_testkit::*;
use serde_json::{Value, json};

const VOLUMES: &str = "vol1:1M,vol2:1M,vol3:1M,vol4:1M";

/// A node with `<scene>/sandboxes` as its bind root and a victim outside it: a tmpfs holding
/// a marker file, standing in for anything a record must never reach.
struct Scene {
    node: Node,
    dir: tempfile::TempDir,
    sandboxes: PathBuf,
    victim: PathBuf,
}

impl Scene {
    fn new() -> Self {
        require_private_mount_namespace();
        let dir = tempfile::Builder::new()
            .prefix("csi-hostile-")
            .tempdir_in("/tmp")
            .unwrap();
        let sandboxes = dir.path().join("sandboxes");
        let victim = dir.path().join("victim");
        std::fs::create_dir_all(sandboxes.join("w9")).unwrap();
        std::fs::create_dir_all(&victim).unwrap();
        let status = Command::new("mount")
            .args(["-t", "tmpfs", "tmpfs"])
            .arg(&victim)
            .status()
            .unwrap();
        assert!(status.success());
        std::fs::write(victim.join("passwd"), "root:x:0:0").unwrap();
        let mut node = Node::new(VOLUMES);
        node.extra = vec![
            "--bind-root".to_owned(),
            sandboxes.to_str().unwrap().to_owned(),
        ];
        Self {
            node,
            dir,
            sandboxes,
            victim,
        }
    }

    fn victim_mount_id(&self) -> u64 {
        MountTable::read()
            .unwrap()
            .entries()
            .iter()
            .find(|m| m.mount_point == self.victim)
            .map(|m| m.mount_id)
            .expect("the victim is mounted")
    }

    /// The victim is still exactly one tmpfs with only its marker, and nothing is mounted
    /// beneath the bind root.
    fn assert_untouched(&self) {
        let table = MountTable::read().unwrap();
        let on_victim: Vec<_> = table
            .mounts_under(&self.victim)
            .into_iter()
            .map(|m| m.mount_point.clone())
            .collect();
        assert_eq!(on_victim, vec![self.victim.clone()], "mounts on the victim");
        assert_eq!(
            std::fs::read_to_string(self.victim.join("passwd")).unwrap(),
            "root:x:0:0"
        );
        assert_eq!(std::fs::read_dir(&self.victim).unwrap().count(), 1);
        let binds: Vec<_> = table.mounts_under(&self.sandboxes);
        assert!(binds.is_empty(), "mounted beneath the bind root: {binds:?}");
    }

    /// Publishes vol1 for w1, stops the daemon, and returns vol1's committed record.
    async fn published_record(&mut self) -> Value {
        self.node.start(None).await;
        self.node.wait_recovered().await;
        self.node.publish("vol1", "w1").await.unwrap();
        // Progress notes are committed within 500 ms of an answer.
        tokio::time::sleep(Duration::from_millis(800)).await;
        self.node.kill9();
        let key = encode_id("vol1");
        let row = csi_agent::store::db::dump(&self.node.work)
            .unwrap()
            .into_iter()
            .find(|row| row.volume_key == key)
            .expect("vol1 is recorded");
        serde_json::from_str(&row.record).unwrap()
    }

    /// Waits until the API reports `volume`'s last error containing `wanted`.
    async fn last_error_contains(&self, volume: &str, wanted: &str) {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let info = self.node.api().volume(PLUGIN, volume).await.unwrap();
            if info
                .last_error
                .as_deref()
                .is_some_and(|e| e.contains(wanted))
            {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "{volume}: {wanted:?} not reported: {info:?}\n{}",
                self.node.log_text()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// The problems the daemon logged about volume records (one string each).
    fn problems(&self) -> Vec<String> {
        self.node
            .log_events("volume record problem")
            .iter()
            .map(|e| e["problem"].as_str().unwrap_or_default().to_owned())
            .collect()
    }

    fn assert_problem(&self, name: &str, reason: &str) {
        let problems = self.problems();
        assert!(
            problems
                .iter()
                .any(|p| p.contains(&format!("/{name}")) && p.contains(reason)),
            "no problem naming {name} with {reason:?}: {problems:#?}"
        );
    }

    /// A record of `volume` claimed by w9 with a bind at `bind`, made from a real one.
    fn forged(&self, real: &Value, volume: &str, bind: &str, mount_id: Option<u64>) -> Value {
        let mut record = real.clone();
        record["volume_id"] = json!(volume);
        record["state"] = json!("CREATED");
        record["claims"] = json!(["w9"]);
        record["publish_context"] = json!({});
        record["has_secrets"] = json!(false);
        let mut entry = json!({ "path": bind });
        if let Some(id) = mount_id {
            entry["mount_id"] = json!(id);
            entry["boot_id"] = real["boot_id"].clone();
        }
        record["bind_mounts"] = json!({ "w9": entry });
        record
    }
}

/// Stat of a file that must not change (never opened for writing, never replaced).
fn fingerprint(path: &Path) -> (u64, i64, i64, u64) {
    let meta = std::fs::metadata(path).unwrap();
    (meta.ino(), meta.mtime(), meta.mtime_nsec(), meta.len())
}

fn db_keys(work: &Path) -> Vec<String> {
    csi_agent::store::db::dump(work)
        .unwrap()
        .into_iter()
        .map(|row| row.volume_key)
        .collect()
}

#[tokio::test]
async fn hostile_record_files_of_the_first_release_are_moved_aside_and_the_rest_migrated() {
    let mut scene = Scene::new();
    let real = scene.published_record().await;
    let work = scene.node.work.clone();
    // Back to the first release's layout: no database, one volume.json per volume.
    for file in ["state.db", "state.db-wal", "state.db-shm"] {
        let _ = std::fs::remove_file(work.join(file));
    }
    let volumes = scene.node.layout().volumes_dir(PLUGIN, "default");
    let envelope = |record: &Value| {
        serde_json::to_vec(&json!({ "schema_version": 1, "record": record })).unwrap()
    };
    let write = |name: &str, bytes: &[u8]| {
        std::fs::create_dir_all(volumes.join(name)).unwrap();
        std::fs::write(volumes.join(name).join("volume.json"), bytes).unwrap();
    };
    write("vol1", &envelope(&real));
    // Truncated JSON.
    let whole = envelope(&real);
    write("trunc", &whole[..whole.len() / 2]);
    // Larger than any store file may be (sparse: nothing of it is ever read).
    std::fs::create_dir_all(volumes.join("huge")).unwrap();
    std::fs::File::create(volumes.join("huge/volume.json"))
        .unwrap()
        .set_len(9 << 20)
        .unwrap();
    // A symlink to /etc/shadow, and one to a well-formed record outside the work dir: a
    // followed link would import "elsewhere".
    let shadow_before = fingerprint(Path::new("/etc/shadow"));
    std::fs::create_dir_all(volumes.join("shadow")).unwrap();
    std::os::unix::fs::symlink("/etc/shadow", volumes.join("shadow/volume.json")).unwrap();
    let outside = scene.dir.path().join("elsewhere.json");
    let mut elsewhere = real.clone();
    elsewhere["volume_id"] = json!("elsewhere");
    std::fs::write(&outside, envelope(&elsewhere)).unwrap();
    let outside_before = fingerprint(&outside);
    std::fs::create_dir_all(volumes.join("elsewhere")).unwrap();
    std::os::unix::fs::symlink(&outside, volumes.join("elsewhere/volume.json")).unwrap();
    // A FIFO nobody writes: a blocking open would hang the daemon's start for good.
    std::fs::create_dir_all(volumes.join("fifo")).unwrap();
    let status = Command::new("mkfifo")
        .arg(volumes.join("fifo/volume.json"))
        .status()
        .unwrap();
    assert!(status.success());
    // A dir name encode_id never makes (`%zz`, and `%41` for a plain `A`), holding a good record.
    write("bad%zz", &envelope(&real));
    write("%41", &envelope(&real));
    // Well-formed records whose binds lie outside the bind root: onto the victim with its
    // own mount id, and through `..`.
    let victim = scene.victim.to_str().unwrap().to_owned();
    let dotdot = format!("{}/../victim", scene.sandboxes.display());
    write(
        "vol2",
        &envelope(&scene.forged(&real, "vol2", &victim, Some(scene.victim_mount_id()))),
    );
    write(
        "vol3",
        &envelope(&scene.forged(&real, "vol3", &dotdot, None)),
    );

    let started = Instant::now();
    scene.node.start(None).await;
    scene.node.wait_recovered().await;
    assert!(
        started.elapsed() < Duration::from_secs(20),
        "the start took {:?}",
        started.elapsed()
    );

    // Each bad file is reported naming it and why.
    scene.assert_problem("trunc", "corrupt");
    scene.assert_problem("huge", "more than the 8388608 a store file may have");
    scene.assert_problem("shadow", "symlink (never followed)");
    scene.assert_problem("elsewhere", "symlink (never followed)");
    scene.assert_problem("fifo", "not a regular file (a FIFO)");
    scene.assert_problem("bad%zz", "does not decode");
    scene.assert_problem("%41", "does not decode");
    // ... and moved aside, not imported; the good ones are.
    assert_eq!(db_keys(&work), vec!["vol1", "vol2", "vol3"]);
    let quarantine = scene
        .node
        .layout()
        .plugin_dir(PLUGIN, "default")
        .join("quarantine");
    let mut moved: Vec<String> = std::fs::read_dir(&quarantine)
        .unwrap()
        .map(|e| {
            let name = e.unwrap().file_name().into_string().unwrap();
            name[..name.rfind('.').unwrap()].to_owned()
        })
        .collect();
    moved.sort();
    assert_eq!(
        moved,
        vec![
            "%41",
            "bad%zz",
            "elsewhere",
            "fifo",
            "huge",
            "shadow",
            "trunc"
        ]
    );
    let left: Vec<_> = std::fs::read_dir(&volumes)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    assert!(
        left.iter().all(|n| n.starts_with("vol")),
        "left in volumes/: {left:?}"
    );
    // Nothing a link pointed at was touched.
    assert_eq!(fingerprint(Path::new("/etc/shadow")), shadow_before);
    assert_eq!(fingerprint(&outside), outside_before);

    // The good volume is served as it was, and new work goes on.
    let vol1 = scene.node.api().volume(PLUGIN, "vol1").await.unwrap();
    assert_eq!(vol1.state, "PUBLISHED");
    assert_eq!(vol1.claims, vec!["w1".to_owned()]);
    scene.node.publish("vol4", "w4").await.unwrap();

    // The forged binds are refused with the rule they break, and never acted on.
    scene
        .last_error_contains("vol2", "is not beneath a --bind-root")
        .await;
    scene
        .last_error_contains("vol3", "contains a '..' component")
        .await;
    scene.assert_untouched();
    for volume in ["vol2", "vol3"] {
        scene.node.unpublish(volume, "w9").await.unwrap();
    }
    scene.assert_untouched();
    assert!(scene.node.mounts().contains(&scene.node.target("vol1")));
    assert!(scene.node.mounts().contains(&scene.node.target("vol4")));
}

#[tokio::test]
async fn hostile_rows_in_the_state_database_are_quarantined_or_refused() {
    let mut scene = Scene::new();
    let real = scene.published_record().await;
    let work = scene.node.work.clone();
    let put = |key: &str, record: String| {
        csi_agent::store::db::put_raw(
            &work,
            &csi_agent::store::db::RawRow {
                plugin_type: PLUGIN.to_owned(),
                plugin_name: "default".to_owned(),
                volume_key: key.to_owned(),
                schema_version: 1,
                record,
            },
        )
        .unwrap();
    };
    // An id that does not decode; invalid JSON; a state that does not exist; a record larger
    // than any the daemon writes.
    put("bad%zz", real.to_string());
    put("garbage", "{\"state\": \"PUBL".to_owned());
    let mut ghost = real.clone();
    ghost["state"] = json!("EXPLODED");
    put("ghost", ghost.to_string());
    let mut big = real.clone();
    big["volume_context"] = json!({ "k": "x".repeat(9 << 20) });
    put("big", big.to_string());
    // A record that is not UTF-8 text (stored as text, and as a blob), as a hand edit with
    // `sqlite3` can leave it.
    {
        let db = rusqlite::Connection::open(work.join("state.db")).unwrap();
        for (key, value) in [
            ("binary", "CAST(X'7BFF22' AS TEXT)"),
            ("blob", "X'7B22737461746522FF7D'"),
        ] {
            db.execute(
                &format!(
                    "INSERT INTO volumes (plugin_type, plugin_name, volume_key, schema_version, record)
                     VALUES (?1, 'default', ?2, 1, {value})"
                ),
                rusqlite::params![PLUGIN, key],
            )
            .unwrap();
        }
    }
    // Binds outside the root: onto the victim with its mount id, through `..`, at the root
    // itself, and into the work dir.
    let victim = scene.victim.to_str().unwrap().to_owned();
    put(
        "vol2",
        scene
            .forged(&real, "vol2", &victim, Some(scene.victim_mount_id()))
            .to_string(),
    );
    let dotdot = format!("{}/w9/../../victim", scene.sandboxes.display());
    put(
        "vol3",
        scene.forged(&real, "vol3", &dotdot, None).to_string(),
    );

    scene.node.start(None).await;
    scene.node.wait_recovered().await;

    scene.assert_problem("bad%zz", "does not decode");
    scene.assert_problem("garbage", "corrupt");
    scene.assert_problem("ghost", "unknown variant `EXPLODED`");
    scene.assert_problem("big", "more than the 8388608 a record may have");
    scene.assert_problem("binary", "not UTF-8");
    scene.assert_problem("blob", "not UTF-8");
    assert_eq!(db_keys(&work), vec!["vol1", "vol2", "vol3"]);
    let db = rusqlite::Connection::open_with_flags(
        work.join("state.db"),
        rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY,
    )
    .unwrap();
    let mut quarantined: Vec<(String, String)> = db
        .prepare("SELECT volume_key, reason FROM quarantine ORDER BY volume_key")
        .unwrap()
        .query_map([], |row| Ok((row.get(0)?, row.get(1)?)))
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap();
    quarantined.sort();
    let keys: Vec<&str> = quarantined.iter().map(|(k, _)| k.as_str()).collect();
    assert_eq!(
        keys,
        vec!["bad%zz", "big", "binary", "blob", "garbage", "ghost"]
    );
    drop(db);

    let vol1 = scene.node.api().volume(PLUGIN, "vol1").await.unwrap();
    assert_eq!(vol1.state, "PUBLISHED");
    scene.node.publish("vol4", "w4").await.unwrap();
    scene
        .last_error_contains("vol2", "is not beneath a --bind-root")
        .await;
    scene
        .last_error_contains("vol3", "contains a '..' component")
        .await;
    scene.assert_untouched();
    for volume in ["vol2", "vol3"] {
        scene.node.unpublish(volume, "w9").await.unwrap();
    }
    scene.assert_untouched();
    // A restart finds nothing left to report: the bad rows were moved for good. (Progress
    // notes, such as the forgotten records, are committed within 500 ms.)
    tokio::time::sleep(Duration::from_millis(800)).await;
    scene.node.kill9();
    scene.node.start(None).await;
    scene.node.wait_recovered().await;
    assert!(scene.problems().is_empty(), "{:?}", scene.problems());
    assert_eq!(db_keys(&work), vec!["vol1", "vol4"]);
    assert!(scene.node.mounts().contains(&scene.node.target("vol1")));
}
