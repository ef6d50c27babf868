//! The volume lifecycle against the real `csi-testplugin`, with real bind mounts (run under
//! `unshare -m --propagation private`, as `scripts/test` does): publish and unpublish in v1
//! and v0, shared volumes, retries of transient codes, final codes, secrets, plugin crashes
//! during node RPCs, a simulated reboot, and many volumes at once.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod volume_support;

use csi_agent::client::RpcErrorKind;
use csi_agent::mounts::require_private_mount_namespace;
use csi_agent::volume::refusal::Conflict;
use csi_agent::volume::{VolumeError, VolumeSecrets, VolumeState};
use serde_json::json;
use volume_support::*;

async fn publish_write_unpublish(versions: &str) {
    require_private_mount_namespace();
    let dir = tempfile::tempdir().unwrap();
    let plugin = TestPlugin::start(
        dir.path(),
        &["--api-versions", versions, "--volumes", "vol1:1M"],
    );
    let work = dir.path().join("agent");
    let manager = manager(&work, &plugin.socket, "boot-a");

    let published = manager
        .publish(publish_request("vol1", "w1"))
        .await
        .unwrap();
    assert_eq!(published.state, VolumeState::Published);
    assert_eq!(published.target_path, manager.target_path("vol1"));
    let mounted = mounts_under(&work);
    assert!(mounted.contains(&published.target_path), "{mounted:?}");
    // Writing through the target lands in the plugin's volume.
    std::fs::write(published.target_path.join("hello"), b"world").unwrap();
    assert_eq!(
        std::fs::read(plugin.volume_dir("vol1").join("hello")).unwrap(),
        b"world"
    );
    let record = manager.get("vol1").await.unwrap();
    assert_eq!(record.claims.iter().collect::<Vec<_>>(), vec!["w1"]);

    manager.unpublish("vol1", "w1").await.unwrap();
    assert_eq!(mounts_under(&work), Vec::<std::path::PathBuf>::new());
    manager.flush().await.unwrap(); // the last steps are progress notes: commit them
    assert!(records(&work).is_empty(), "{:?}", records(&work));
    assert!(!published.target_path.exists());
    assert!(manager.get("vol1").await.is_none());
    // The plugin saw the whole sequence, in order.
    let methods: Vec<String> = plugin
        .calls()
        .iter()
        .map(|c| c["method"].as_str().unwrap_or("").to_owned())
        .filter(|m| {
            m.starts_with("Node") && m.ends_with("Volume")
                || m.starts_with("Controller") && m.ends_with("Volume")
        })
        .collect();
    assert_eq!(
        methods,
        [
            "ControllerPublishVolume",
            "NodeStageVolume",
            "NodePublishVolume",
            "NodeUnpublishVolume",
            "NodeUnstageVolume",
            "ControllerUnpublishVolume"
        ]
    );
}

#[tokio::test]
async fn v1_publish_write_unpublish_leaves_nothing() {
    publish_write_unpublish("v1").await;
}

#[tokio::test]
async fn v0_3_publish_write_unpublish_leaves_nothing() {
    publish_write_unpublish("v0.3").await;
}

#[tokio::test]
async fn v0_2_publish_write_unpublish_leaves_nothing() {
    publish_write_unpublish("v0.2").await;
}

#[tokio::test]
async fn readonly_publish_refuses_writes() {
    require_private_mount_namespace();
    let dir = tempfile::tempdir().unwrap();
    let plugin = TestPlugin::start(dir.path(), &["--volumes", "ro:1M"]);
    let work = dir.path().join("agent");
    let manager = manager(&work, &plugin.socket, "boot-a");
    let mut request = publish_request("ro", "w1");
    request.readonly = true;
    let published = manager.publish(request).await.unwrap();
    let err = std::fs::write(published.target_path.join("x"), b"x").unwrap_err();
    assert_eq!(err.raw_os_error(), Some(30), "expected EROFS, got {err}");
    manager.unpublish("ro", "w1").await.unwrap();
    assert!(mounts_under(&work).is_empty());
}

#[tokio::test]
async fn shared_volume_stays_until_the_last_claim_goes() {
    require_private_mount_namespace();
    let dir = tempfile::tempdir().unwrap();
    let plugin = TestPlugin::start(dir.path(), &["--volumes", "shared:1M"]);
    let work = dir.path().join("agent");
    let manager = manager(&work, &plugin.socket, "boot-a");
    let first = manager
        .publish(publish_request("shared", "w1"))
        .await
        .unwrap();
    let second = manager
        .publish(publish_request("shared", "w2"))
        .await
        .unwrap();
    assert_eq!(first.target_path, second.target_path);
    // The second publish only added a claim: no node RPC was repeated.
    assert_eq!(plugin.count("NodePublishVolume"), 1);
    assert_eq!(plugin.count("NodeStageVolume"), 1);

    manager.unpublish("shared", "w1").await.unwrap();
    assert!(mounts_under(&work).contains(&first.target_path));
    assert_eq!(plugin.count("NodeUnpublishVolume"), 0);
    // Unpublishing an unknown claim or an unknown volume succeeds and changes nothing.
    manager.unpublish("shared", "nobody").await.unwrap();
    manager.unpublish("never-seen", "w1").await.unwrap();
    assert!(mounts_under(&work).contains(&first.target_path));

    manager.unpublish("shared", "w2").await.unwrap();
    assert!(mounts_under(&work).is_empty());
    manager.flush().await.unwrap(); // the last steps are progress notes: commit them
    assert!(records(&work).is_empty());
}

#[tokio::test]
async fn a_conflicting_second_publish_is_refused_and_changes_nothing() {
    require_private_mount_namespace();
    let dir = tempfile::tempdir().unwrap();
    let plugin = TestPlugin::start(dir.path(), &["--volumes", "v:1M"]);
    let work = dir.path().join("agent");
    let manager = manager(&work, &plugin.socket, "boot-a");
    manager.publish(publish_request("v", "w1")).await.unwrap();
    let before = manager.get("v").await.unwrap();
    let mut readonly = publish_request("v", "w2");
    readonly.readonly = true;
    let err = manager.publish(readonly).await.unwrap_err();
    assert!(
        matches!(&err, VolumeError::Conflict(Conflict::InUseOtherwise { volume_id, .. }) if volume_id == "v"),
        "{err}"
    );
    assert_eq!(manager.get("v").await.unwrap(), before);
    manager.unpublish("v", "w1").await.unwrap();
}

#[tokio::test]
async fn transient_codes_are_retried_until_success() {
    require_private_mount_namespace();
    let dir = tempfile::tempdir().unwrap();
    let plugin = TestPlugin::start(dir.path(), &["--volumes", "v:1M"]);
    plugin.set_faults(json!({"rules": [
        {"method": "NodeStageVolume", "fail": {"code": "UNAVAILABLE", "message": "busy"}, "times": 2},
        {"method": "NodePublishVolume", "fail": {"code": "ABORTED", "message": "pending"}, "times": 1},
        {"method": "NodeUnpublishVolume", "fail": {"code": "RESOURCE_EXHAUSTED", "message": "later"}, "times": 1},
        {"method": "NodeUnstageVolume", "fail": {"code": "DEADLINE_EXCEEDED", "message": "slow"}, "times": 1}
    ]}));
    let work = dir.path().join("agent");
    let manager = manager(&work, &plugin.socket, "boot-a");
    manager.publish(publish_request("v", "w1")).await.unwrap();
    assert_eq!(plugin.count("NodeStageVolume"), 3);
    assert_eq!(plugin.count("NodePublishVolume"), 2);
    manager.unpublish("v", "w1").await.unwrap();
    assert_eq!(plugin.count("NodeUnpublishVolume"), 2);
    assert_eq!(plugin.count("NodeUnstageVolume"), 2);
    assert!(mounts_under(&work).is_empty());
}

#[tokio::test]
async fn final_codes_surface_unchanged_and_the_volume_is_wound_back() {
    require_private_mount_namespace();
    let dir = tempfile::tempdir().unwrap();
    let plugin = TestPlugin::start(dir.path(), &["--volumes", "v:1M"]);
    plugin.set_faults(json!({"rules": [
        {"method": "NodePublishVolume", "fail": {"code": "FAILED_PRECONDITION", "message": "disk on fire"}, "times": 1}
    ]}));
    let work = dir.path().join("agent");
    let manager = manager(&work, &plugin.socket, "boot-a");
    let err = manager
        .publish(publish_request("v", "w1"))
        .await
        .unwrap_err();
    match &err {
        VolumeError::Plugin(rpc) => match &rpc.kind {
            RpcErrorKind::Status { code, message } => {
                assert_eq!(*code, tonic::Code::FailedPrecondition);
                assert_eq!(message, "disk on fire");
            }
            other => panic!("unexpected {other:?}"),
        },
        other => panic!("unexpected {other}"),
    }
    assert_eq!(
        plugin.count("NodePublishVolume"),
        1,
        "final codes are not retried"
    );
    // The failed publish withdrew its claim; the reconciler unstages and forgets the volume.
    eventually("the staged volume is cleaned", || {
        mounts_under(&work).is_empty() && records(&work).is_empty()
    })
    .await;
    assert_eq!(plugin.count("NodeUnstageVolume"), 1);
}

#[tokio::test]
async fn stage_and_publish_secrets_reach_the_plugin_and_nowhere_else() {
    require_private_mount_namespace();
    let dir = tempfile::tempdir().unwrap();
    let plugin = TestPlugin::start(dir.path(), &["--volumes", "v:1M", "--record-secrets"]);
    let work = dir.path().join("agent");
    let manager = manager(&work, &plugin.socket, "boot-a");
    let mut request = publish_request("v", "w1");
    request.secrets = VolumeSecrets {
        node_stage: secrets(&[("stage-key", "stage-s3cret")]),
        node_publish: secrets(&[("publish-key", "publish-s3cret")]),
    };
    assert!(!format!("{request:?}").contains("s3cret"));
    manager.publish(request).await.unwrap();
    let calls = plugin.calls();
    let stage = calls
        .iter()
        .find(|c| c["method"] == "NodeStageVolume")
        .unwrap();
    assert_eq!(stage["secrets"]["stage-key"], "stage-s3cret");
    let publish = calls
        .iter()
        .find(|c| c["method"] == "NodePublishVolume")
        .unwrap();
    assert_eq!(publish["secrets"]["publish-key"], "publish-s3cret");
    // Only the 0600 secrets file holds them: not the database, nor its write-ahead log.
    manager.flush().await.unwrap();
    for file in ["state.db", "state.db-wal"] {
        let bytes = std::fs::read(work.join(file)).unwrap_or_default();
        assert!(
            !bytes.windows(6).any(|w| w == b"s3cret"),
            "{file} holds a secret"
        );
    }
    assert!(!records(&work).is_empty());
    let record_dir = csi_agent::layout::Layout::new(&work).volume_dir(
        PLUGIN_TYPE,
        "default",
        &records(&work)[0],
    );
    let secrets_file = record_dir.join("secrets.json");
    assert!(
        std::fs::read_to_string(&secrets_file)
            .unwrap()
            .contains("stage-s3cret")
    );
    use std::os::unix::fs::PermissionsExt;
    assert_eq!(
        std::fs::metadata(&secrets_file)
            .unwrap()
            .permissions()
            .mode()
            & 0o777,
        0o600
    );
    let record_debug = format!("{:?}", manager.get("v").await.unwrap());
    assert!(!record_debug.contains("s3cret"));
    manager.unpublish("v", "w1").await.unwrap();
    assert!(!secrets_file.exists());
}

/// The plugin exits when the RPC arrives (as a crash would); the test's supervisor restarts
/// it, and the operation completes after the restart.
async fn plugin_dies_during(method: &str) {
    require_private_mount_namespace();
    let dir = tempfile::tempdir().unwrap();
    let plugin = TestPlugin::start(dir.path(), &["--volumes", "v:1M"]);
    plugin.keep_restarting();
    plugin.set_faults(json!({"rules": [{"method": method, "exit": true, "times": 1}]}));
    let work = dir.path().join("agent");
    let manager = manager(&work, &plugin.socket, "boot-a");
    let first_pid = plugin.pid();
    manager.publish(publish_request("v", "w1")).await.unwrap();
    manager.unpublish("v", "w1").await.unwrap();
    assert_ne!(plugin.pid(), first_pid, "the plugin was not restarted");
    assert!(mounts_under(&work).is_empty());
    manager.flush().await.unwrap(); // the last steps are progress notes: commit them
    assert!(records(&work).is_empty());
    // The dying call and its successful repeat.
    assert_eq!(plugin.count(method), 2, "{method}");
}

#[tokio::test]
async fn plugin_killed_during_node_stage() {
    plugin_dies_during("NodeStageVolume").await;
}

#[tokio::test]
async fn plugin_killed_during_node_publish() {
    plugin_dies_during("NodePublishVolume").await;
}

#[tokio::test]
async fn plugin_killed_during_node_unpublish() {
    plugin_dies_during("NodeUnpublishVolume").await;
}

#[tokio::test]
async fn plugin_killed_during_node_unstage() {
    plugin_dies_during("NodeUnstageVolume").await;
}

#[tokio::test]
async fn plugin_killed_during_controller_publish() {
    plugin_dies_during("ControllerPublishVolume").await;
}

#[tokio::test]
async fn reboot_restages_claimed_volumes_and_cleans_unclaimed_ones() {
    require_private_mount_namespace();
    let dir = tempfile::tempdir().unwrap();
    let plugin = TestPlugin::start(dir.path(), &["--volumes", "kept:1M,dropped:1M"]);
    let work = dir.path().join("agent");
    {
        let manager = manager(&work, &plugin.socket, "boot-a");
        manager
            .publish(publish_request("kept", "w1"))
            .await
            .unwrap();
        manager
            .publish(publish_request("dropped", "w2"))
            .await
            .unwrap();
    }
    // The "reboot": every mount vanishes, the plugin restarts; w2's claim is withdrawn by
    // editing nothing — instead, unpublish it after the reboot below.
    for mount in mounts_under(&work).into_iter().rev() {
        rustix::mount::unmount(&mount, rustix::mount::UnmountFlags::DETACH).unwrap();
    }
    for mount in mounts_under(&plugin.work).into_iter().rev() {
        rustix::mount::unmount(&mount, rustix::mount::UnmountFlags::DETACH).unwrap();
    }
    assert!(mounts_under(&work).is_empty());
    plugin.restart();
    let manager = manager(&work, &plugin.socket, "boot-b");
    let report = manager.recover().await.unwrap();
    assert_eq!(report.records, 2);
    assert_eq!(report.reset_by_reboot, 2);
    let kept_target = manager.target_path("kept");
    eventually("claimed volumes are published again", || {
        let mounted = mounts_under(&work);
        mounted.contains(&kept_target) && mounted.contains(&manager.target_path("dropped"))
    })
    .await;
    // Now the workload of "dropped" ends: unpublish cleans it completely.
    manager.unpublish("dropped", "w2").await.unwrap();
    assert!(!mounts_under(&work).contains(&manager.target_path("dropped")));
    assert_eq!(
        manager.get("kept").await.unwrap().state,
        VolumeState::Published
    );
    manager.unpublish("kept", "w1").await.unwrap();
    assert!(mounts_under(&work).is_empty());
    manager.flush().await.unwrap(); // the last steps are progress notes: commit them
    assert!(records(&work).is_empty());
}

#[tokio::test]
async fn reboot_forgets_volumes_without_claims() {
    require_private_mount_namespace();
    let dir = tempfile::tempdir().unwrap();
    let plugin = TestPlugin::start(dir.path(), &["--volumes", "v:1M"]);
    let work = dir.path().join("agent");
    {
        let manager = manager(&work, &plugin.socket, "boot-a");
        manager.publish(publish_request("v", "w1")).await.unwrap();
    }
    // A crash after the claim was withdrawn but before the unpublish ran: simulate by
    // editing the durable record directly (the manager is gone, its notes committed).
    let mut record = record_json(&work, "v");
    record["claims"] = json!([]);
    set_record_raw(&work, "v", &record.to_string());
    for mount in mounts_under(&work).into_iter().rev() {
        rustix::mount::unmount(&mount, rustix::mount::UnmountFlags::DETACH).unwrap();
    }
    plugin.restart();
    let manager = manager(&work, &plugin.socket, "boot-b");
    let report = manager.recover().await.unwrap();
    assert_eq!(report.reconciling, vec!["v".to_owned()], "{report:?}");
    eventually("the unclaimed volume is forgotten", || {
        records(&work).is_empty()
    })
    .await;
    assert!(mounts_under(&work).is_empty());
    // Controller side undone too.
    assert!(plugin.count("ControllerUnpublishVolume") >= 1);
}

#[tokio::test]
async fn concurrent_operations_on_one_volume_never_interleave() {
    require_private_mount_namespace();
    let dir = tempfile::tempdir().unwrap();
    let plugin = TestPlugin::start(dir.path(), &["--volumes", "v:1M"]);
    // Slow node calls make any interleaving visible to the plugin.
    plugin.set_faults(json!({"rules": [
        {"method": "NodeStageVolume", "delay_ms": 20},
        {"method": "NodePublishVolume", "delay_ms": 20},
        {"method": "NodeUnpublishVolume", "delay_ms": 20}
    ]}));
    let work = dir.path().join("agent");
    let manager = manager(&work, &plugin.socket, "boot-a");
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..8 {
        let manager = manager.clone();
        tasks.spawn(async move {
            let workload = format!("w{i}");
            for _ in 0..3 {
                manager
                    .publish(publish_request("v", &workload))
                    .await
                    .unwrap();
                manager.unpublish("v", &workload).await.unwrap();
            }
        });
    }
    while let Some(done) = tasks.join_next().await {
        done.unwrap();
    }
    let overlaps: Vec<_> = plugin
        .calls()
        .into_iter()
        .filter(|c| c["overlap"] == true)
        .collect();
    assert!(overlaps.is_empty(), "{overlaps:?}");
    assert!(plugin.count("NodePublishVolume") >= 1);
    assert!(mounts_under(&work).is_empty());
    manager.flush().await.unwrap(); // the last steps are progress notes: commit them
    assert!(records(&work).is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thousand_volumes_published_and_unpublished_concurrently_leave_nothing() {
    require_private_mount_namespace();
    let dir = tempfile::tempdir().unwrap();
    let names: Vec<String> = (0..1000).map(|i| format!("vol{i}")).collect();
    let spec: Vec<String> = names.iter().map(|n| format!("{n}:1K")).collect();
    let plugin = TestPlugin::start(dir.path(), &["--volumes", &spec.join(",")]);
    let work = dir.path().join("agent");
    let manager = manager(&work, &plugin.socket, "boot-a");
    let semaphore = std::sync::Arc::new(tokio::sync::Semaphore::new(64));
    let started = std::time::Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for name in names.clone() {
        let manager = manager.clone();
        let semaphore = semaphore.clone();
        tasks.spawn(async move {
            let _permit = semaphore.acquire().await.unwrap();
            manager.publish(publish_request(&name, "w")).await.unwrap();
        });
    }
    while let Some(done) = tasks.join_next().await {
        done.unwrap();
    }
    eprintln!("published 1000 volumes in {:?}", started.elapsed());
    assert_eq!(
        mounts_under(&work).len(),
        2000,
        "1000 staged + 1000 published"
    );
    let started = std::time::Instant::now();
    for name in names {
        let manager = manager.clone();
        let semaphore = semaphore.clone();
        tasks.spawn(async move {
            let _permit = semaphore.acquire().await.unwrap();
            manager.unpublish(&name, "w").await.unwrap();
        });
    }
    while let Some(done) = tasks.join_next().await {
        done.unwrap();
    }
    eprintln!("unpublished 1000 volumes in {:?}", started.elapsed());
    assert!(mounts_under(&work).is_empty());
    manager.flush().await.unwrap(); // the last steps are progress notes: commit them
    assert!(records(&work).is_empty());
}

#[tokio::test]
async fn a_timed_out_stage_stays_uncertain_and_is_undone() {
    require_private_mount_namespace();
    let dir = tempfile::tempdir().unwrap();
    let plugin = TestPlugin::start(dir.path(), &["--volumes", "v:1M"]);
    // The plugin finishes the stage (and mounts) long after csi-agent stopped waiting.
    plugin.set_faults(
        json!({"rules": [{"method": "NodeStageVolume", "delay_ms": 1500, "times": 1}]}),
    );
    let work = dir.path().join("agent");
    let manager = manager_with(
        &work,
        &plugin.socket,
        "boot-a",
        std::time::Duration::from_millis(300),
        std::time::Duration::from_millis(500),
    );
    let err = manager
        .publish(publish_request("v", "w1"))
        .await
        .unwrap_err();
    // The first attempt timed out; the repeats found the plugin still busy with it (ABORTED):
    // transient either way, and answered once the operation timeout ran out.
    assert!(
        matches!(&err, VolumeError::Plugin(rpc) if rpc.is_transient()),
        "{err}"
    );
    // Never forgotten: the reconciler undoes the stage that may have happened (k8s#82190).
    eventually("the uncertain stage is undone", || {
        plugin.count("NodeUnstageVolume") >= 1 && records(&work).is_empty()
    })
    .await;
    eventually("the late mount is gone", || mounts_under(&work).is_empty()).await;
}

#[tokio::test]
async fn an_unreadable_record_is_moved_aside_and_the_others_recover() {
    require_private_mount_namespace();
    let dir = tempfile::tempdir().unwrap();
    let plugin = TestPlugin::start(dir.path(), &["--volumes", "good:1M,bad:1M"]);
    let work = dir.path().join("agent");
    {
        let manager = manager(&work, &plugin.socket, "boot-a");
        manager
            .publish(publish_request("good", "w1"))
            .await
            .unwrap();
        manager.publish(publish_request("bad", "w1")).await.unwrap();
    }
    set_record_raw(&work, "bad", "{\"volu");
    let manager = manager(&work, &plugin.socket, "boot-a");
    let report = manager.recover().await.unwrap();
    assert_eq!(report.records, 1);
    assert_eq!(report.problems.len(), 1, "{report:?}");
    assert!(report.problems[0].contains("bad"), "{report:?}");
    assert!(
        !records(&work).contains(&"bad".to_owned()),
        "the unreadable record was not moved aside"
    );
    let quarantined: i64 = rusqlite::Connection::open(work.join("state.db"))
        .unwrap()
        .query_row("SELECT count(*) FROM quarantine", [], |row| row.get(0))
        .unwrap();
    assert_eq!(quarantined, 1);
    assert_eq!(
        manager.get("good").await.unwrap().state,
        VolumeState::Published
    );
    manager.unpublish("good", "w1").await.unwrap();
    // The stray mounts of the quarantined volume are reported, never removed blindly.
    let table = mounts_under(&work);
    assert!(
        table
            .iter()
            .all(|m| m.to_string_lossy().contains("/mounts/bad/")),
        "{table:?}"
    );
    detach_mounts_under(dir.path());
}

#[tokio::test]
async fn target_path_root_and_target_path_exists_are_honoured() {
    require_private_mount_namespace();
    let dir = tempfile::tempdir().unwrap();
    let plugin = TestPlugin::start(dir.path(), &["--volumes", "v:1M", "--api-versions", "v1"]);
    let work = dir.path().join("agent");
    let root = dir.path().join("elsewhere");
    let manager = manager_configured(
        &work,
        &plugin.socket,
        "boot-a",
        std::time::Duration::from_secs(5),
        |config| {
            config.target_path_root = Some(root.clone());
            config.target_path_exists = true;
        },
    );
    let published = manager.publish(publish_request("v", "w1")).await.unwrap();
    assert_eq!(published.target_path, root.join("v/target"));
    assert!(mounts_under(&root).contains(&published.target_path));
    assert!(mounts_under(&work).is_empty());
    manager.unpublish("v", "w1").await.unwrap();
    assert!(mounts_under(&root).is_empty());
    // The CO created the target (target_path_exists) and removed it, and its parent.
    assert!(!root.join("v").exists());
}

#[tokio::test]
async fn recovery_trusts_the_mount_table_over_a_stale_record() {
    require_private_mount_namespace();
    let dir = tempfile::tempdir().unwrap();
    let plugin = TestPlugin::start(dir.path(), &["--volumes", "v:1M"]);
    let work = dir.path().join("agent");
    {
        let manager = manager(&work, &plugin.socket, "boot-a");
        manager.publish(publish_request("v", "w1")).await.unwrap();
    }
    // A record that lags behind reality (as after a lost write, MESOS-9281): it says
    // NODE_READY and unclaimed while the volume is staged and published.
    let mut record = record_json(&work, "v");
    record["state"] = json!("NODE_READY");
    record["claims"] = json!([]);
    set_record_raw(&work, "v", &record.to_string());
    let manager = manager(&work, &plugin.socket, "boot-a");
    let report = manager.recover().await.unwrap();
    assert_eq!(report.corrected_by_mount_table, 1, "{report:?}");
    eventually("the unaccounted mounts are undone", || {
        mounts_under(&work).is_empty() && records(&work).is_empty()
    })
    .await;
    assert!(plugin.count("NodeUnpublishVolume") >= 1);
}

#[tokio::test]
async fn a_target_still_mounted_after_node_unpublish_is_reported_and_left_in_place() {
    // A plugin that answers NodeUnpublishVolume OK but leaves a mount on the target (here: a
    // CSI 0.3 plugin that mounts nothing, and a tmpfs the test mounts on its target) must not
    // have the target removed or the volume reported unpublished.
    require_private_mount_namespace();
    let dir = tempfile::tempdir().unwrap();
    let plugin = TestPlugin::start(
        dir.path(),
        &[
            "--api-versions",
            "v0.3",
            "--mount-mode",
            "none",
            "--volumes",
            "vol1:1M",
        ],
    );
    let work = dir.path().join("agent");
    let manager = manager(&work, &plugin.socket, "boot-a");
    let published = manager
        .publish(publish_request("vol1", "w1"))
        .await
        .unwrap();
    let target = published.target_path.clone();
    csi_agent::mounts::mount_test_tmpfs(&target);
    std::fs::write(target.join("data"), b"kept").unwrap();

    let err = manager.unpublish("vol1", "w1").await.unwrap_err();
    assert!(err.to_string().contains("still mounted"), "{err}");
    assert!(mounts_under(&work).contains(&target));
    assert_eq!(std::fs::read(target.join("data")).unwrap(), b"kept");
    assert!(manager.get("vol1").await.is_some());

    // Once the leftover mount is gone, the unpublish completes and leaves nothing.
    rustix::mount::unmount(&target, rustix::mount::UnmountFlags::empty()).unwrap();
    manager.unpublish("vol1", "w1").await.unwrap();
    assert!(mounts_under(&work).is_empty(), "{:?}", mounts_under(&work));
    assert!(!target.exists());
}

#[tokio::test]
async fn recovery_removes_an_empty_stray_mount_dir_and_keeps_one_holding_data() {
    // Mount dirs no record owns (an interrupted older daemon, a hand-made mess): an empty one
    // goes with its empty staging and target dirs; one holding a file stays, as rmdir cannot
    // delete data.
    let dir = tempfile::tempdir().unwrap();
    let plugin = TestPlugin::start(
        dir.path(),
        &["--mount-mode", "none", "--volumes", "vol1:1M"],
    );
    let work = dir.path().join("agent");
    let manager = manager(&work, &plugin.socket, "boot-a");
    let empty_target = manager.target_path("stray-empty");
    let empty_dir = empty_target.parent().unwrap().to_path_buf();
    std::fs::create_dir_all(&empty_target).unwrap();
    std::fs::create_dir_all(empty_dir.join("staging")).unwrap();
    let full_target = manager.target_path("stray-full");
    std::fs::create_dir_all(&full_target).unwrap();
    std::fs::write(full_target.join("data"), b"kept").unwrap();

    manager.recover().await.unwrap();
    assert!(
        !empty_dir.exists(),
        "{} is still there",
        empty_dir.display()
    );
    assert_eq!(std::fs::read(full_target.join("data")).unwrap(), b"kept");
}

#[tokio::test]
async fn an_unreadable_secrets_file_is_reported_as_a_read_naming_the_file() {
    require_private_mount_namespace();
    let dir = tempfile::tempdir().unwrap();
    let plugin = TestPlugin::start(dir.path(), &["--volumes", "v:1M"]);
    let work = dir.path().join("agent");
    let secrets_file = csi_agent::layout::Layout::new(&work)
        .volume_dir(PLUGIN_TYPE, "default", "v")
        .join("secrets.json");
    {
        let manager = manager(&work, &plugin.socket, "boot-a");
        let mut request = publish_request("v", "w1");
        request.secrets.node_stage = secrets(&[("stage-key", "stage-s3cret")]);
        manager.publish(request).await.unwrap();
    }
    // A reboot: the staging must be redone, with the stored secrets, which are now garbage.
    for mount in mounts_under(&work).into_iter().rev() {
        rustix::mount::unmount(&mount, rustix::mount::UnmountFlags::DETACH).unwrap();
    }
    for mount in mounts_under(&plugin.work).into_iter().rev() {
        rustix::mount::unmount(&mount, rustix::mount::UnmountFlags::DETACH).unwrap();
    }
    std::fs::write(&secrets_file, b"{not json").unwrap();
    plugin.restart();
    let manager = manager(&work, &plugin.socket, "boot-b");
    manager.recover().await.unwrap();
    let err = manager
        .publish(publish_request("v", "w2"))
        .await
        .unwrap_err();
    let message = err.to_string();
    assert!(matches!(err, VolumeError::StoreRead(_)), "{message}");
    assert!(
        message.contains("could not be read")
            && message.contains(&secrets_file.display().to_string()),
        "{message}"
    );
    assert!(!message.contains("written"), "{message}");
    // The file is kept for an operator to repair; it was not taken for missing.
    assert_eq!(std::fs::read(&secrets_file).unwrap(), b"{not json");
}
