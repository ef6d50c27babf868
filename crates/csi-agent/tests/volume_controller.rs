//! Controller-side operations through the volume manager against the real test plugin:
//! create (idempotent, retried), delete, validate, list with pagination, capacity, and
//! ControllerPublish with the node id from NodeGetInfo (NodeGetId on CSI 0.2).
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod volume_support;

use std::collections::BTreeMap;

use csi_agent::volume::refusal::Conflict;
use csi_agent::volume::{NewVolume, Origin, VolumeError, VolumeState};
use serde_json::json;
use volume_support::*;

#[tokio::test]
async fn create_publish_delete_with_the_creation_context() {
    let dir = tempfile::tempdir().unwrap();
    let plugin = TestPlugin::start(dir.path(), &["--mount-mode", "none"]);
    plugin.set_faults(json!({"rules": [
        {"method": "CreateVolume", "fail": {"code": "UNAVAILABLE", "message": "warming up"}, "times": 2}
    ]}));
    let work = dir.path().join("agent");
    let manager = manager(&work, &plugin.socket, "boot-a");
    let created = manager
        .create_volume(NewVolume::new("new-vol", 1 << 20, &mount_capability()))
        .await
        .unwrap();
    assert_eq!(
        plugin.count("CreateVolume"),
        3,
        "transient codes are retried"
    );
    assert_eq!(created.volume_id, "new-vol");
    assert!(created.capacity_bytes >= 1 << 20);
    // Idempotent by name.
    let again = manager
        .create_volume(NewVolume::new("new-vol", 1 << 20, &mount_capability()))
        .await
        .unwrap();
    assert_eq!(again.volume_id, created.volume_id);
    let record = manager.get("new-vol").await.unwrap();
    assert_eq!(record.origin, Origin::Created);
    assert_eq!(record.volume_context, created.volume_context);

    manager
        .publish(publish_request("new-vol", "w1"))
        .await
        .unwrap();
    let err = manager
        .delete_volume("new-vol", BTreeMap::new())
        .await
        .unwrap_err();
    assert!(
        matches!(
            &err,
            VolumeError::Conflict(Conflict::DeleteInUse { volume_id, claims: 1, .. })
                if volume_id == "new-vol"
        ),
        "{err}"
    );
    manager.unpublish("new-vol", "w1").await.unwrap();
    // A created volume stays known (CREATED) after unpublish, until deleted.
    assert_eq!(
        manager.get("new-vol").await.unwrap().state,
        VolumeState::Created
    );
    manager
        .delete_volume("new-vol", BTreeMap::new())
        .await
        .unwrap();
    assert!(manager.get("new-vol").await.is_none());
    assert!(records(&work).is_empty());
    assert!(!plugin.volume_dir("new-vol").exists());
}

#[tokio::test]
async fn list_pages_validate_and_capacity() {
    let dir = tempfile::tempdir().unwrap();
    let plugin = TestPlugin::start(
        dir.path(),
        &[
            "--mount-mode",
            "none",
            "--volumes",
            "a:1Mi,b:1Mi,c:1Mi,d:1Mi,e:1Mi",
            "--capacity",
            "1Gi",
        ],
    );
    let manager = manager(&dir.path().join("agent"), &plugin.socket, "boot-a");
    let mut seen = Vec::new();
    let mut token = String::new();
    for _ in 0..10 {
        let page = manager.list_backend_volumes(2, &token).await.unwrap();
        assert!(page.volumes.len() <= 2);
        seen.extend(page.volumes.into_iter().map(|v| v.volume_id));
        if page.next_token.is_empty() {
            break;
        }
        token = page.next_token;
    }
    seen.sort();
    assert_eq!(seen, ["a", "b", "c", "d", "e"]);
    let err = manager
        .list_backend_volumes(2, "garbage-token")
        .await
        .unwrap_err();
    assert!(matches!(&err, VolumeError::Plugin(rpc) if rpc.code() == tonic::Code::Aborted));

    let validation = manager
        .validate_volume_capabilities("a", &[mount_capability()], BTreeMap::new(), BTreeMap::new())
        .await
        .unwrap();
    assert!(validation.confirmed);
    let err = manager
        .validate_volume_capabilities(
            "zzz",
            &[mount_capability()],
            BTreeMap::new(),
            BTreeMap::new(),
        )
        .await
        .unwrap_err();
    assert!(matches!(&err, VolumeError::Plugin(rpc) if rpc.code() == tonic::Code::NotFound));

    let capacity = manager
        .get_capacity(&[mount_capability()], BTreeMap::new(), None)
        .await
        .unwrap();
    assert_eq!(capacity, (1 << 30) - 5 * (1 << 20));
}

#[tokio::test]
async fn controller_publish_uses_the_node_id_of_a_v0_2_plugin() {
    let dir = tempfile::tempdir().unwrap();
    let plugin = TestPlugin::start(
        dir.path(),
        &[
            "--mount-mode",
            "none",
            "--api-versions",
            "v0.2",
            "--volumes",
            "v:1M",
        ],
    );
    let work = dir.path().join("agent");
    let manager = manager(&work, &plugin.socket, "boot-a");
    manager.publish(publish_request("v", "w1")).await.unwrap();
    // The plugin checks the node id: success proves NodeGetId's answer was used.
    assert!(plugin.count("NodeGetId") >= 1);
    assert!(
        plugin
            .calls()
            .iter()
            .any(|c| c["method"] == "ControllerPublishVolume" && c["code"] == "OK")
    );
    let record = manager.get("v").await.unwrap();
    assert_eq!(record.node_id.as_deref(), Some("node-1"));
    assert!(!record.publish_context.is_empty());
    manager.unpublish("v", "w1").await.unwrap();
    manager.flush().await.unwrap(); // the last steps are progress notes: commit them
    assert!(records(&work).is_empty());
}
