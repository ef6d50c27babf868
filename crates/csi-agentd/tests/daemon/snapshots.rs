//! Snapshots and clones through the real daemon and the real test plugin (`--snapshots`,
//! `--clones`): data written into a published volume, snapshotted, restored into a new volume
//! and published again; a clone; the re-issue of a snapshot not yet ready; and the abuse
//! cases: hostile names and ids, a content source naming another plugin's volume, a plugin
//! without the capability (501, and no RPC in the plugin's call log).

use std::path::{Path, PathBuf};

use csi_agent_api::{ContentSource, CreateSnapshotRequest, CreateVolumeRequest, ErrorCode};
use csi_agent_testkit::*;

fn snapshot_config(
    plugin_type: &str,
    plugin_dir: &Path,
    volumes: &str,
    extra: &[&str],
) -> serde_json::Value {
    let mut config = managed_config(plugin_type, plugin_dir, volumes);
    let args = config["containers"][0]["command"]["arguments"]
        .as_array_mut()
        .unwrap();
    for arg in extra {
        args.push((*arg).into());
    }
    config
}

fn snap(source: &str, name: &str) -> CreateSnapshotRequest {
    CreateSnapshotRequest {
        plugin: PLUGIN.to_owned(),
        source_volume_id: source.to_owned(),
        name: name.to_owned(),
        parameters: Default::default(),
    }
}

fn create_from(plugin: &str, name: &str, source: ContentSource) -> CreateVolumeRequest {
    CreateVolumeRequest {
        accessibility_requirements: None,
        plugin: plugin.to_owned(),
        name: name.to_owned(),
        capacity_bytes: 16 << 20,
        capability: capability(),
        parameters: Default::default(),
        content_source: Some(source),
    }
}

fn from_snapshot(id: &str) -> ContentSource {
    ContentSource {
        snapshot_id: Some(id.to_owned()),
        volume_id: None,
    }
}

fn from_volume(id: &str) -> ContentSource {
    ContentSource {
        snapshot_id: None,
        volume_id: Some(id.to_owned()),
    }
}

/// The names of the RPCs the plugin in `plugin_dir` received.
fn calls(plugin_dir: &Path) -> Vec<String> {
    std::fs::read_to_string(plugin_dir.join("calls.jsonl"))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter_map(|v| v["method"].as_str().map(str::to_owned))
        .collect()
}

fn count(calls: &[String], method: &str) -> usize {
    calls.iter().filter(|c| *c == method).count()
}

/// The snapshot directories the plugin holds.
fn plugin_snapshots(plugin_dir: &Path) -> Vec<String> {
    dir_names(&plugin_dir.join("snapshots"))
}

/// A daemon in `dir` managing the test plugin as [`PLUGIN`] with `volumes` and `flags`; its
/// state in `<dir>/plugin` (returned).
fn start(dir: &Path, volumes: &str, flags: &[&str]) -> (Daemon, PathBuf) {
    require_private_mount_namespace();
    let plugin_dir = dir.join("plugin");
    let config = snapshot_config(PLUGIN, &plugin_dir, volumes, flags);
    let daemon = Daemon::builder(dir)
        .plugin_config("test.json", config)
        .start();
    (daemon, plugin_dir)
}

async fn publish(daemon: &Daemon, volume: &str, workload: &str) -> PathBuf {
    let published = daemon
        .api()
        .publish(&publish_request(volume, workload))
        .await
        .unwrap();
    PathBuf::from(published.target_path)
}

#[tokio::test]
async fn a_restored_snapshot_and_a_clone_hold_the_data_written_before() {
    let dir = tempfile::tempdir().unwrap();
    let (daemon, plugin_dir) = start(
        dir.path(),
        "src:16M",
        &["--snapshots", "--clones", "--volume-fs", "tmpfs"],
    );
    let api = daemon.api();

    let target = publish(&daemon, "src", "w1").await;
    std::fs::create_dir(target.join("dir")).unwrap();
    std::fs::write(target.join("dir/a"), "before").unwrap();

    let taken = api.create_snapshot(&snap("src", "snap-1")).await.unwrap();
    assert_eq!(taken.snapshot_id, "snap-1");
    assert_eq!(taken.source_volume_id, "src");
    assert!(taken.ready_to_use);
    assert_eq!(taken.size_bytes, 6);
    assert!(
        taken
            .creation_time
            .as_deref()
            .is_some_and(|t| t.ends_with('Z')),
        "{taken:?}"
    );
    // Idempotent by name: the same snapshot, and no second one in the plugin.
    let again = api.create_snapshot(&snap("src", "snap-1")).await.unwrap();
    assert_eq!(again, taken);
    assert_eq!(plugin_snapshots(&plugin_dir), ["snap-1"]);
    // The same name for another volume is a conflict, not a second snapshot.
    let (status, body) = api_error(api.create_snapshot(&snap("other", "snap-1")).await);
    assert_eq!((status, body.code), (409, ErrorCode::Conflict), "{body:?}");

    std::fs::write(target.join("dir/a"), "after").unwrap();
    std::fs::write(target.join("b"), "later").unwrap();

    let restored = api
        .create_volume(&create_from(PLUGIN, "restored", from_snapshot("snap-1")))
        .await
        .unwrap();
    assert_eq!(restored.volume_id, "restored");
    let restored_target = publish(&daemon, "restored", "w2").await;
    assert_eq!(
        std::fs::read_to_string(restored_target.join("dir/a")).unwrap(),
        "before"
    );
    assert!(
        !restored_target.join("b").exists(),
        "written after the snapshot"
    );

    api.create_volume(&create_from(PLUGIN, "clone", from_volume("src")))
        .await
        .unwrap();
    let clone_target = publish(&daemon, "clone", "w3").await;
    assert_eq!(
        std::fs::read_to_string(clone_target.join("dir/a")).unwrap(),
        "after"
    );
    assert_eq!(
        std::fs::read_to_string(clone_target.join("b")).unwrap(),
        "later"
    );
    // Copies, not views: writing the clone leaves the source alone.
    std::fs::write(clone_target.join("b"), "changed").unwrap();
    assert_eq!(std::fs::read_to_string(target.join("b")).unwrap(), "later");

    let page = api
        .snapshots(PLUGIN, None, None, Some("src"), None)
        .await
        .unwrap();
    assert_eq!(page.snapshots, std::slice::from_ref(&taken));
    let none = api
        .snapshots(PLUGIN, None, None, Some("no-such-volume"), None)
        .await
        .unwrap();
    assert!(none.snapshots.is_empty());
    let listed = daemon.csictl(&["snapshot", "list", PLUGIN]);
    assert!(listed.status.success(), "{listed:?}");
    assert!(String::from_utf8_lossy(&listed.stdout).contains("snap-1"));

    let out = daemon.csictl(&["snapshot", "delete", PLUGIN, "snap-1"]);
    assert!(out.status.success(), "{out:?}");
    assert!(plugin_snapshots(&plugin_dir).is_empty());
    assert!(
        api.snapshots(PLUGIN, None, None, None, None)
            .await
            .unwrap()
            .snapshots
            .is_empty()
    );
    // Deleting it again, or an id never seen, succeeds (CSI).
    api.delete_snapshot(PLUGIN, "snap-1").await.unwrap();

    for (volume, workload) in [("src", "w1"), ("restored", "w2"), ("clone", "w3")] {
        api.unpublish(&unpublish_request(volume, workload))
            .await
            .unwrap();
    }
    assert!(mounts_under(&daemon.work).is_empty());
}

#[tokio::test]
async fn a_snapshot_not_ready_is_reissued_by_name_until_it_is() {
    let dir = tempfile::tempdir().unwrap();
    let (daemon, plugin_dir) = start(
        dir.path(),
        "src:1M",
        &["--snapshots", "--snapshot-ready-after", "2"],
    );
    let taken = daemon
        .api()
        .create_snapshot(&snap("src", "s"))
        .await
        .unwrap();
    assert!(taken.ready_to_use, "{taken:?}");
    // Two answers said "not ready", the third "ready": three calls, one snapshot.
    assert_eq!(count(&calls(&plugin_dir), "CreateSnapshot"), 3);
    assert_eq!(plugin_snapshots(&plugin_dir), ["s"]);
    // Ready now: a repeat answers from the record, without an RPC.
    daemon
        .api()
        .create_snapshot(&snap("src", "s"))
        .await
        .unwrap();
    assert_eq!(count(&calls(&plugin_dir), "CreateSnapshot"), 3);
}

#[tokio::test]
async fn hostile_names_ids_and_sources_are_refused_and_leave_nothing() {
    let dir = tempfile::tempdir().unwrap();
    require_private_mount_namespace();
    let plugin_dir = dir.path().join("plugin");
    let other_dir = dir.path().join("other");
    let daemon = Daemon::builder(dir.path())
        .plugin_config(
            "test.json",
            snapshot_config(PLUGIN, &plugin_dir, "src:1M", &["--snapshots", "--clones"]),
        )
        .plugin_config(
            "other.json",
            snapshot_config(
                "org.example.other",
                &other_dir,
                "theirs:1M",
                &["--snapshots", "--clones"],
            ),
        )
        .start();
    let api = daemon.api();
    // A request makes sure the other plugin runs (and has made its volume).
    api.snapshots("org.example.other", None, None, None, None)
        .await
        .unwrap();
    std::fs::write(other_dir.join("volumes/theirs/secret"), "theirs").unwrap();

    let long = "x".repeat(10 << 10);
    for name in ["..", ".", "a/b", "a\0b", long.as_str()] {
        let (status, body) = api_error(api.create_snapshot(&snap("src", name)).await);
        assert!(
            status == 400
                || (status == 422 && body.grpc_code.as_deref() == Some("INVALID_ARGUMENT")),
            "name {:?}: {status} {body:?}",
            &name[..name.len().min(20)]
        );
    }
    for source in ["..", "a\0b", long.as_str()] {
        let (status, body) = api_error(api.create_snapshot(&snap(source, "s")).await);
        assert!(status == 400 || status == 422, "{status} {body:?}");
    }
    // Nothing was made, and no intent was left behind to be re-issued at the next start.
    assert!(plugin_snapshots(&plugin_dir).is_empty());
    let page = api.snapshots(PLUGIN, None, None, None, None).await.unwrap();
    assert!(page.snapshots.is_empty(), "{page:?}");
    let rows = csi_agent::store::db::dump(&daemon.work);
    if let Ok(rows) = rows {
        assert!(
            rows.iter().all(|r| !r.plugin_name.ends_with("/snapshots")),
            "{rows:?}"
        );
    }
    // Unknown or unrepresentable snapshot ids are "already deleted".
    for id in ["..", "a/b", "never-existed"] {
        api.delete_snapshot(PLUGIN, id).await.unwrap();
    }

    // Another plugin's volume is unknown to this plugin: nothing is copied.
    let (status, body) = api_error(
        api.create_volume(&create_from(PLUGIN, "stolen", from_volume("theirs")))
            .await,
    );
    assert_eq!(status, 422, "{body:?}");
    assert_eq!(body.grpc_code.as_deref(), Some("NOT_FOUND"));
    assert!(!plugin_dir.join("volumes/stolen").exists());
    let (status, _) = api_error(
        api.create_volume(&create_from(PLUGIN, "stolen", from_snapshot("..")))
            .await,
    );
    assert_eq!(status, 422);
    assert!(!plugin_dir.join("volumes/stolen").exists());
    // Both sources, or neither, is a malformed request.
    let both = ContentSource {
        snapshot_id: Some("s".into()),
        volume_id: Some("v".into()),
    };
    for source in [both, ContentSource::default()] {
        let (status, body) = api_error(api.create_volume(&create_from(PLUGIN, "x", source)).await);
        assert_eq!(
            (status, body.code),
            (400, ErrorCode::InvalidRequest),
            "{body:?}"
        );
    }
    assert_eq!(
        std::fs::read_to_string(other_dir.join("volumes/theirs/secret")).unwrap(),
        "theirs"
    );
}

/// A plugin that advertises neither snapshots nor clones: every route answers 501 naming the
/// capability, and the plugin receives none of those RPCs.
#[tokio::test]
async fn a_plugin_without_snapshots_or_clones_is_a_501_before_any_rpc() {
    let dir = tempfile::tempdir().unwrap();
    let daemon = setup(dir.path(), &[]);
    let plugin_dir = dir.path().join("plugin");
    let api = daemon.api();
    let (status, body) = api_error(api.create_snapshot(&snap("vol1", "s")).await);
    assert_eq!(
        (status, body.code),
        (501, ErrorCode::Unsupported),
        "{body:?}"
    );
    assert!(
        body.message.contains("CREATE_DELETE_SNAPSHOT"),
        "{}",
        body.message
    );
    let (status, body) = api_error(api.delete_snapshot(PLUGIN, "s").await);
    assert_eq!(status, 501, "{body:?}");
    let (status, body) = api_error(api.snapshots(PLUGIN, None, None, None, None).await);
    assert_eq!(status, 501, "{body:?}");
    assert!(body.message.contains("LIST_SNAPSHOTS"), "{}", body.message);
    let (status, body) = api_error(
        api.create_volume(&create_from(PLUGIN, "r", from_snapshot("s")))
            .await,
    );
    assert_eq!(status, 501, "{body:?}");
    let (status, body) = api_error(
        api.create_volume(&create_from(PLUGIN, "c", from_volume("vol1")))
            .await,
    );
    assert_eq!(status, 501, "{body:?}");
    assert!(body.message.contains("CLONE_VOLUME"), "{}", body.message);
    let calls = calls(&plugin_dir);
    for method in [
        "CreateSnapshot",
        "DeleteSnapshot",
        "ListSnapshots",
        "CreateVolume",
    ] {
        assert_eq!(
            count(&calls, method),
            0,
            "{method} reached the plugin: {calls:?}"
        );
    }
}
