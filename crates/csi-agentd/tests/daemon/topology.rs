//! Topology, the node's volume limit and ControllerGetVolume through the real daemon and the
//! real test plugin (issue 26, item 5): what the plugin's NodeGetInfo says is shown on the
//! plugin; a create defaults its accessibility requirements to this node's topology (the
//! plugin's call log shows what it received); `max_volumes_per_node` refuses a volume more
//! before any RPC; ControllerGetVolume's published node ids are shown on the volume; a plugin
//! without these capabilities behaves as before.
//!
//! Run as root under `unshare -m --propagation private`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use csi_agent_api::{
    AccessibilityRequirements, CapacityRequest, CreateVolumeRequest, ErrorCode, PluginInfo,
};
use csi_agent_testkit::*;

fn seg(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect()
}

fn ours() -> BTreeMap<String, String> {
    seg(&[("zone", "a"), ("rack", "1")])
}

/// A daemon with the test plugin started with `flags`, its state in `<dir>/plugin`.
fn daemon_with(dir: &Path, volumes: &str, flags: &[&str]) -> Daemon {
    require_private_mount_namespace();
    let mut config = managed_config(PLUGIN, &dir.join("plugin"), volumes);
    let args = config["containers"][0]["command"]["arguments"]
        .as_array_mut()
        .unwrap();
    args.extend(flags.iter().map(|f| serde_json::Value::from(*f)));
    Daemon::builder(dir)
        .plugin_config("test.json", config)
        .start()
}

const TOPOLOGY: &[&str] = &["--topology", "zone=a,rack=1", "--max-volumes-per-node", "2"];

/// The plugin's call log entries of `method`.
fn calls_of(dir: &Path, method: &str) -> Vec<serde_json::Value> {
    std::fs::read_to_string(dir.join("plugin/calls.jsonl"))
        .unwrap_or_default()
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .filter(|e| e["method"] == method)
        .collect()
}

fn create(name: &str, requirements: Option<AccessibilityRequirements>) -> CreateVolumeRequest {
    CreateVolumeRequest {
        content_source: None,
        plugin: PLUGIN.to_owned(),
        name: name.to_owned(),
        capacity_bytes: 1 << 20,
        capability: capability(),
        parameters: Default::default(),
        accessibility_requirements: requirements,
    }
}

fn capacity_in(topology: Option<BTreeMap<String, String>>) -> CapacityRequest {
    CapacityRequest {
        plugin: PLUGIN.to_owned(),
        capabilities: Vec::new(),
        parameters: Default::default(),
        accessible_topology: topology,
    }
}

async fn node_shown(daemon: &Daemon) -> PluginInfo {
    daemon
        .wait_plugin(
            PLUGIN,
            "NodeGetInfo on the plugin",
            Duration::from_secs(20),
            |p| p.node.is_some(),
        )
        .await
}

#[tokio::test]
async fn the_node_topology_is_shown_and_a_create_defaults_to_it() {
    let dir = tempfile::tempdir().unwrap();
    let daemon = daemon_with(dir.path(), "vol1:1M", TOPOLOGY);
    let api = daemon.api();

    // No requirements: this node's topology, as the only requisite and preferred one.
    let created = api.create_volume(&create("tv1", None)).await.unwrap();
    let node = node_shown(&daemon).await.node.unwrap();
    assert_eq!(node.node_id, NODE_ID);
    assert_eq!(node.accessible_topology, Some(ours()));
    assert_eq!(node.max_volumes_per_node, Some(2));
    let shown = daemon.csictl(&["plugins", PLUGIN]);
    let text = String::from_utf8_lossy(&shown.stdout);
    assert!(shown.status.success(), "{shown:?}");
    assert!(text.contains("rack=1,zone=a"), "{text}");
    assert!(text.contains("max volumes on node:"), "{text}");

    assert_eq!(created.accessible_topology, vec![ours()]);
    let sent = calls_of(dir.path(), "CreateVolume").pop().unwrap();
    assert_eq!(sent["code"], "OK");
    assert_eq!(
        sent["topology"],
        serde_json::json!({"requisite": [ours()], "preferred": [ours()]})
    );
    let volume = api.volume(PLUGIN, "tv1").await.unwrap();
    assert_eq!(volume.accessible_topology, vec![ours()]);

    // The request's own requirements replace the default.
    let own = AccessibilityRequirements {
        requisite: vec![seg(&[("zone", "b")]), seg(&[("zone", "a")])],
        preferred: vec![seg(&[("zone", "a")])],
    };
    api.create_volume(&create("tv2", Some(own))).await.unwrap();
    let sent = calls_of(dir.path(), "CreateVolume").pop().unwrap();
    assert_eq!(
        sent["topology"]["requisite"][0],
        serde_json::json!({"zone": "b"})
    );
    assert_eq!(
        sent["topology"]["preferred"],
        serde_json::json!([{"zone": "a"}])
    );

    // A requisite of another zone: the plugin's RESOURCE_EXHAUSTED, said clearly.
    let elsewhere = AccessibilityRequirements {
        requisite: vec![seg(&[("zone", "b")])],
        preferred: Vec::new(),
    };
    let (status, body) = api_error(api.create_volume(&create("tv3", Some(elsewhere))).await);
    assert_eq!(status, 422, "{body:?}");
    assert_eq!(body.code, ErrorCode::PluginError);
    assert_eq!(body.grpc_code.as_deref(), Some("RESOURCE_EXHAUSTED"));
    assert!(body.message.contains("requisite"), "{}", body.message);
    assert!(api.volume(PLUGIN, "tv3").await.is_err());

    // Capacity: all of it here, none in a topology the plugin does not serve.
    let all = api
        .capacity(&capacity_in(None))
        .await
        .unwrap()
        .available_capacity;
    assert!(all > 0);
    let here = api.capacity(&capacity_in(Some(ours()))).await.unwrap();
    assert_eq!(here.available_capacity, all);
    let foreign = api
        .capacity(&capacity_in(Some(seg(&[("zone", "b")]))))
        .await
        .unwrap();
    assert_eq!(foreign.available_capacity, 0);
    let sent = calls_of(dir.path(), "GetCapacity").pop().unwrap();
    assert_eq!(
        sent["topology"]["accessible_topology"],
        serde_json::json!({"zone": "b"})
    );
}

#[tokio::test]
async fn a_volume_beyond_max_volumes_per_node_is_refused_before_any_rpc() {
    let dir = tempfile::tempdir().unwrap();
    let daemon = daemon_with(dir.path(), "vol1:1M,vol2:1M,vol3:1M", TOPOLOGY);
    let api = daemon.api();
    api.publish(&publish_request("vol1", "w1")).await.unwrap();
    api.publish(&publish_request("vol2", "w1")).await.unwrap();
    // A second workload on a published volume is no volume more.
    api.publish(&publish_request("vol2", "w2")).await.unwrap();

    let (status, body) = api_error(api.publish(&publish_request("vol3", "w1")).await);
    assert_eq!(status, 409, "{body:?}");
    assert_eq!(body.code, ErrorCode::Conflict);
    for part in [
        "at most 2 volumes",
        "vol1",
        "vol2",
        "vol3",
        "max_volumes_per_node",
    ] {
        assert!(body.message.contains(part), "{part}: {}", body.message);
    }
    for method in [
        "ControllerPublishVolume",
        "NodeStageVolume",
        "NodePublishVolume",
    ] {
        let sent: Vec<_> = calls_of(dir.path(), method)
            .into_iter()
            .filter(|e| e["volume_id"] == "vol3")
            .collect();
        assert!(sent.is_empty(), "{method} was sent for vol3: {sent:?}");
    }
    let listed = api.volumes().await.unwrap();
    assert!(
        listed
            .volumes
            .iter()
            .all(|v| v.volume_id != "vol3" || v.claims.is_empty()),
        "{listed:?}"
    );

    // A place freed is a place taken.
    api.unpublish(&unpublish_request("vol1", "w1"))
        .await
        .unwrap();
    api.publish(&publish_request("vol3", "w1")).await.unwrap();
    for (volume, workload) in [("vol2", "w1"), ("vol2", "w2"), ("vol3", "w1")] {
        api.unpublish(&unpublish_request(volume, workload))
            .await
            .unwrap();
    }
}

#[tokio::test]
async fn controller_get_volume_shows_the_node_while_published() {
    let dir = tempfile::tempdir().unwrap();
    let daemon = daemon_with(
        dir.path(),
        "vol1:1M",
        &["--get-volume", "--volume-condition"],
    );
    let api = daemon.api();
    api.create_volume(&create("cg1", None)).await.unwrap();
    // Shown once the plugin's capabilities are known (a status read does not wait for them).
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    let before = loop {
        if let Some(c) = api.volume(PLUGIN, "cg1").await.unwrap().controller {
            break c;
        }
        assert!(std::time::Instant::now() < deadline, "never shown");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(before.published_node_ids, Vec::<String>::new());
    // The controller's condition (VOLUME_CONDITION), normal until one is injected.
    assert_eq!(before.condition.map(|c| c.abnormal), Some(false));
    std::fs::write(
        dir.path().join("plugin/faults.json"),
        r#"{"abnormal": {"cg1": "backend degraded"}}"#,
    )
    .unwrap();
    let condition = api
        .volume(PLUGIN, "cg1")
        .await
        .unwrap()
        .controller
        .unwrap()
        .condition;
    assert_eq!(
        condition.map(|c| (c.abnormal, c.message)),
        Some((true, "backend degraded".to_owned()))
    );
    let shown = daemon.csictl(&["volumes", PLUGIN, "cg1"]);
    let shown = String::from_utf8_lossy(&shown.stdout);
    assert!(
        shown.contains("controller condition") && shown.contains("backend degraded"),
        "{shown}"
    );
    std::fs::write(dir.path().join("plugin/faults.json"), r#"{"abnormal": {}}"#).unwrap();

    api.publish(&publish_request("cg1", "w1")).await.unwrap();
    let during = api.volume(PLUGIN, "cg1").await.unwrap().controller.unwrap();
    assert_eq!(during.published_node_ids, vec![NODE_ID.to_owned()]);
    assert_eq!(during.error, None);
    let shown = daemon.csictl(&["volumes", PLUGIN, "cg1"]);
    assert!(
        String::from_utf8_lossy(&shown.stdout).contains(NODE_ID),
        "{shown:?}"
    );

    api.unpublish(&unpublish_request("cg1", "w1"))
        .await
        .unwrap();
    let after = api.volume(PLUGIN, "cg1").await.unwrap().controller.unwrap();
    assert!(after.published_node_ids.is_empty(), "{after:?}");
    assert!(!calls_of(dir.path(), "ControllerGetVolume").is_empty());
}

#[tokio::test]
async fn a_plugin_without_topology_limit_or_get_volume_behaves_as_before() {
    let dir = tempfile::tempdir().unwrap();
    let daemon = daemon_with(dir.path(), "vol1:1M,vol2:1M,vol3:1M", &[]);
    let api = daemon.api();

    // No topology sent, none reported.
    let created = api.create_volume(&create("plain", None)).await.unwrap();
    let node = node_shown(&daemon).await.node.unwrap();
    assert_eq!(node.node_id, NODE_ID);
    assert_eq!(
        (node.accessible_topology, node.max_volumes_per_node),
        (None, None)
    );
    assert!(created.accessible_topology.is_empty());
    let sent = calls_of(dir.path(), "CreateVolume").pop().unwrap();
    assert!(sent.get("topology").is_none(), "{sent}");

    // Topology asked of a plugin without VOLUME_ACCESSIBILITY_CONSTRAINTS: 501, no RPC.
    let creates = calls_of(dir.path(), "CreateVolume").len();
    let own = AccessibilityRequirements {
        requisite: vec![ours()],
        preferred: Vec::new(),
    };
    let (status, body) = api_error(api.create_volume(&create("topo", Some(own))).await);
    assert_eq!(status, 501, "{body:?}");
    assert_eq!(body.code, ErrorCode::Unsupported);
    assert!(
        body.message.contains("VOLUME_ACCESSIBILITY_CONSTRAINTS"),
        "{}",
        body.message
    );
    assert_eq!(calls_of(dir.path(), "CreateVolume").len(), creates);
    let (status, _) = api_error(api.capacity(&capacity_in(Some(ours()))).await);
    assert_eq!(status, 501);
    assert!(calls_of(dir.path(), "GetCapacity").is_empty());

    // No limit: three volumes publish; no ControllerGetVolume is asked.
    for volume in ["vol1", "vol2", "vol3"] {
        api.publish(&publish_request(volume, "w1")).await.unwrap();
    }
    assert_eq!(api.volume(PLUGIN, "vol1").await.unwrap().controller, None);
    assert!(calls_of(dir.path(), "ControllerGetVolume").is_empty());
    for volume in ["vol1", "vol2", "vol3"] {
        api.unpublish(&unpublish_request(volume, "w1"))
            .await
            .unwrap();
    }
}
