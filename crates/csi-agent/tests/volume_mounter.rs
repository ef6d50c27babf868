//! The volume state machine's mount error paths, without root: the volume manager and its
//! binder take every mount, unmount and mount-table read through a `FakeMounter`, and the
//! test plugin mounts nothing (`--mount-mode none`). These tests must pass as an
//! unprivileged user (`setpriv --reuid=65534 ...` on the built binary).
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod volume_support;

use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use csi_agent::mounts::{FakeMounter, Mounter};
use csi_agent::volume::bind::BindError;
use csi_agent::volume::{PublishRequest, VolumeError, VolumeManager, VolumeState};
use serde_json::json;
use volume_support::*;

/// Mount ids the fake hands out start here (far above any real one).
const FAKE_IDS: u64 = 1 << 40;

struct Node {
    _dir: tempfile::TempDir,
    plugin: TestPlugin,
    work: PathBuf,
    sandboxes: PathBuf,
    mounter: Arc<FakeMounter>,
}

impl Node {
    fn start() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let plugin = TestPlugin::start(dir.path(), &["--volumes", "v:1M", "--mount-mode", "none"]);
        let sandboxes = dir.path().join("sandboxes");
        std::fs::create_dir(&sandboxes).unwrap();
        Self {
            work: dir.path().join("agent"),
            plugin,
            sandboxes: sandboxes.canonicalize().unwrap(),
            mounter: Arc::new(FakeMounter::new()),
            _dir: dir,
        }
    }

    fn manager(&self) -> VolumeManager {
        self.manager_with(self.mounter.clone())
    }

    fn manager_with(&self, mounter: Arc<FakeMounter>) -> VolumeManager {
        manager_mounting(
            &self.work,
            &self.plugin.socket,
            "boot-a",
            vec![self.sandboxes.clone()],
            mounter,
        )
    }

    fn bind_to(&self, workload: &str) -> PathBuf {
        self.sandboxes.join(workload).join("data")
    }

    fn request(&self, workload: &str) -> PublishRequest {
        PublishRequest {
            bind_to: Some(self.bind_to(workload)),
            ..publish_request("v", workload)
        }
    }

    fn mounted_at(&self, path: &Path) -> usize {
        self.mounter
            .mounts()
            .iter()
            .filter(|m| m.dst == path)
            .count()
    }
}

fn bind_mount_id(work: &Path, workload: &str) -> Option<u64> {
    record_json(work, "v")["bind_mounts"][workload]["mount_id"].as_u64()
}

#[tokio::test]
async fn a_bind_mount_goes_through_the_mounter_and_its_unpublish_undoes_it() {
    let node = Node::start();
    let manager = node.manager();
    let published = manager.publish(node.request("w1")).await.unwrap();
    assert_eq!(published.state, VolumeState::Published);
    let mounts = node.mounter.mounts();
    assert_eq!(mounts.len(), 1, "{mounts:?}");
    assert_eq!(mounts[0].dst, node.bind_to("w1"));
    assert_eq!(mounts[0].src, published.target_path.canonicalize().unwrap());
    let noted = manager.get("v").await.unwrap().bind_mounts["w1"].mount_id;
    assert!(noted.is_some_and(|id| id >= FAKE_IDS), "{noted:?}");
    manager.unpublish("v", "w1").await.unwrap();
    assert!(node.mounter.mounts().is_empty());
    assert!(manager.get("v").await.is_none());
    // The dirs csi-agent created for the bind go with it, the root stays.
    assert!(!node.sandboxes.join("w1").exists());
    assert!(node.sandboxes.exists());
}

#[tokio::test]
async fn a_failing_bind_mount_withdraws_the_claim_and_frees_the_path() {
    let node = Node::start();
    let manager = node.manager();
    node.mounter
        .fail_next_attach(io::ErrorKind::PermissionDenied);
    let err = manager.publish(node.request("w1")).await.unwrap_err();
    assert!(
        matches!(&err, VolumeError::Bind(BindError::Mount { op: "mount", source, .. })
            if source.kind() == io::ErrorKind::PermissionDenied),
        "{err:?}"
    );
    assert!(node.mounter.mounts().is_empty());
    let record = manager.get("v").await;
    assert!(
        record
            .as_ref()
            .is_none_or(|r| !r.claims.contains("w1") && r.bind_mounts.is_empty()),
        "{record:?}"
    );
    // The reservation was released: another claim may take the very same path.
    let again = PublishRequest {
        bind_to: Some(node.bind_to("w1")),
        ..publish_request("v", "w2")
    };
    manager.publish(again).await.unwrap();
    assert_eq!(node.mounted_at(&node.bind_to("w1")), 1);
    let record = manager.get("v").await.unwrap();
    assert_eq!(record.claims.iter().collect::<Vec<_>>(), vec!["w2"]);
}

#[tokio::test]
async fn an_unmount_answering_ebusy_keeps_the_claim_and_the_bind_until_it_succeeds() {
    let node = Node::start();
    let manager = node.manager();
    manager.publish(node.request("w1")).await.unwrap();
    node.mounter
        .fail_unmounts(rustix::io::Errno::BUSY.raw_os_error());
    let err = manager.unpublish("v", "w1").await.unwrap_err();
    assert!(
        matches!(&err, VolumeError::Bind(BindError::Mount { op: "unmount", source, .. })
            if source.raw_os_error() == Some(rustix::io::Errno::BUSY.raw_os_error())),
        "{err:?}"
    );
    // Nothing was forgotten: the claim, its bind entry and the mount are all still there.
    let record = manager.get("v").await.unwrap();
    assert!(record.claims.contains("w1"), "{record:?}");
    assert!(record.bind_mounts.contains_key("w1"), "{record:?}");
    assert_eq!(record.state, VolumeState::Published);
    assert_eq!(node.mounted_at(&node.bind_to("w1")), 1);
    assert_eq!(node.plugin.count("NodeUnpublishVolume"), 0);
    // The path is still held: no other claim may take it meanwhile.
    let thief = PublishRequest {
        bind_to: Some(node.bind_to("w1")),
        ..publish_request("v", "w2")
    };
    let err = manager.publish(thief).await.unwrap_err();
    assert!(
        matches!(&err, VolumeError::Bind(BindError::InUse { .. })),
        "{err:?}"
    );
    node.mounter.allow_unmounts();
    manager.unpublish("v", "w1").await.unwrap();
    assert!(node.mounter.mounts().is_empty());
    assert!(manager.get("v").await.is_none());
    assert_eq!(node.plugin.count("NodeUnpublishVolume"), 1);
}

#[tokio::test]
async fn a_foreign_mount_on_a_bind_to_is_refused_and_left_alone() {
    let node = Node::start();
    let manager = node.manager();
    let bind_to = node.bind_to("w1");
    let elsewhere = node.sandboxes.join("elsewhere");
    std::fs::create_dir_all(&bind_to).unwrap();
    std::fs::create_dir_all(&elsewhere).unwrap();
    node.mounter
        .bind_mount(&elsewhere, &bind_to, false)
        .unwrap();
    let err = manager.publish(node.request("w1")).await.unwrap_err();
    assert!(
        matches!(&err, VolumeError::Bind(BindError::AlreadyMounted { .. })),
        "{err:?}"
    );
    // The foreign mount is untouched, nothing was stacked on it, and the unpublish that
    // winds the failed publish back did not unmount it either.
    let mounts = node.mounter.mounts();
    assert_eq!(mounts.len(), 1, "{mounts:?}");
    assert_eq!(mounts[0].src, elsewhere);
    assert!(bind_to.exists());
}

#[tokio::test]
async fn a_bind_missing_at_recovery_is_mounted_again() {
    let node = Node::start();
    {
        let manager = node.manager();
        manager.publish(node.request("w1")).await.unwrap();
        manager.flush().await.unwrap();
    }
    let before = bind_mount_id(&node.work, "w1").unwrap();
    // Same boot, but the mount is gone (a workload's sandbox teardown unmounted it): the
    // new mounter has no mounts at all.
    let after_crash = Arc::new(FakeMounter::new());
    let manager = node.manager_with(after_crash.clone());
    let report = manager.recover().await.unwrap();
    assert_eq!(report.reconciling, vec!["v".to_owned()], "{report:?}");
    eventually("the missing bind is mounted again", || {
        after_crash
            .mounts()
            .iter()
            .any(|m| m.dst == node.bind_to("w1"))
    })
    .await;
    eventually("the new mount id is noted", || {
        manager
            .snapshot_of("v")
            .and_then(|r| r.bind_mounts["w1"].mount_id)
            .is_some_and(|id| id >= FAKE_IDS)
    })
    .await;
    assert_eq!(after_crash.mounts().len(), 1);
    let record = manager.get("v").await.unwrap();
    assert_eq!(record.state, VolumeState::Published);
    assert!(record.claims.contains("w1"));
    // One mount id per mounter: the recorded one named the old mount.
    assert_eq!(before, FAKE_IDS);
}

/// A record that lags behind reality (a lost write, MESOS-9281): it says NODE_READY and
/// unclaimed while the volume was published.
async fn stale_record(node: &Node) {
    {
        let manager = node.manager();
        manager.publish(publish_request("v", "w1")).await.unwrap();
        manager.flush().await.unwrap();
    }
    let mut record = record_json(&node.work, "v");
    record["state"] = json!("NODE_READY");
    record["claims"] = json!([]);
    set_record_raw(&node.work, "v", &record.to_string());
}

#[tokio::test]
async fn a_target_the_mount_table_shows_mounted_is_unpublished_at_recovery() {
    let node = Node::start();
    stale_record(&node).await;
    let manager = node.manager();
    node.mounter.add_foreign(&manager.target_path("v"));
    let report = manager.recover().await.unwrap();
    assert_eq!(report.corrected_by_mount_table, 1, "{report:?}");
    eventually("the unaccounted mount is undone", || {
        records(&node.work).is_empty()
    })
    .await;
    assert_eq!(node.plugin.count("NodeUnpublishVolume"), 1);
}

#[tokio::test]
async fn a_target_the_mount_table_does_not_show_is_not_unpublished_at_recovery() {
    let node = Node::start();
    stale_record(&node).await;
    let manager = node.manager();
    let report = manager.recover().await.unwrap();
    assert_eq!(report.corrected_by_mount_table, 0, "{report:?}");
    let state = manager.get("v").await.unwrap().state;
    assert!(
        state.level() <= VolumeState::NodeReady.level(),
        "raised to {state:?} without a mount"
    );
    // Down from NODE_READY (controller-published): ControllerUnpublish is tried (the test
    // plugin refuses it while it still has the volume staged, which is its business); no
    // node step is undone without a mount that says it was done.
    eventually("the reconciler tries to controller-unpublish", || {
        node.plugin.count("ControllerUnpublishVolume") >= 1
    })
    .await;
    assert_eq!(node.plugin.count("NodeUnstageVolume"), 0);
    assert_eq!(node.plugin.count("NodeUnpublishVolume"), 0);
}
