//! The version-neutral client against the real `csi-testplugin` in each version mode: version
//! detection, every RPC round trip in v1 and v0, quirks folded, errors classified. Real bind
//! mounts (run under `unshare -m --propagation private`).
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod volume_support;

use std::time::Duration;

use csi_agent::client::{ClientOptions, CsiClient, CsiVersion, ErrorClass, RpcErrorKind};
use csi_agent::mounts::require_private_mount_namespace;
use csi_proto::v1;
use serde_json::json;
use volume_support::*;

fn options() -> ClientOptions {
    ClientOptions {
        rpc_deadline: Duration::from_secs(5),
        plugin: PLUGIN_TYPE.to_owned(),
        metrics: None,
    }
}

async fn connect(plugin: &TestPlugin) -> CsiClient {
    CsiClient::connect(&plugin.socket, options()).await.unwrap()
}

#[tokio::test]
async fn detects_v1_v0_3_and_v0_2() {
    for (versions, expected) in [
        ("v1", CsiVersion::V1),
        ("v1,v0.3", CsiVersion::V1),
        ("v0.3", CsiVersion::V0_3),
        ("v0.2", CsiVersion::V0_2),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let plugin = TestPlugin::start(
            dir.path(),
            &["--api-versions", versions, "--mount-mode", "none"],
        );
        let client = connect(&plugin).await;
        assert_eq!(client.version(), expected, "--api-versions {versions}");
        assert_eq!(client.detect_version().await.unwrap(), expected);
    }
}

fn capability() -> v1::VolumeCapability {
    mount_capability().to_v1()
}

/// Every lifecycle and controller RPC through the client, with real mounts.
async fn round_trip(versions: &str) {
    require_private_mount_namespace();
    let dir = tempfile::tempdir().unwrap();
    let plugin = TestPlugin::start(
        dir.path(),
        &["--api-versions", versions, "--capacity", "1Gi"],
    );
    let client = connect(&plugin).await;

    let info = client.get_plugin_info().await.unwrap();
    assert_eq!(info.name, "org.example.test");
    assert!(client.probe().await.unwrap());
    let services = client.get_plugin_capabilities().await.unwrap().services;
    assert!(services.contains(&v1::plugin_capability::service::Type::ControllerService));
    let controller = client.controller_get_capabilities().await.unwrap();
    assert!(controller.contains(&v1::controller_service_capability::rpc::Type::CreateDeleteVolume));
    let node = client.node_get_capabilities().await.unwrap();
    assert!(node.contains(&v1::node_service_capability::rpc::Type::StageUnstageVolume));
    let node_info = client.node_get_info().await.unwrap();
    assert_eq!(node_info.node_id, "node-1");

    let capacity = client
        .get_capacity(v1::GetCapacityRequest {
            volume_capabilities: vec![capability()],
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(capacity.available_capacity, 1 << 30);
    let created = client
        .create_volume(v1::CreateVolumeRequest {
            name: "rt".into(),
            capacity_range: Some(v1::CapacityRange {
                required_bytes: 1 << 20,
                limit_bytes: 0,
            }),
            volume_capabilities: vec![capability()],
            ..Default::default()
        })
        .await
        .unwrap();
    let volume = created.volume.unwrap();
    assert_eq!(volume.volume_id, "rt");
    assert!(volume.capacity_bytes >= 1 << 20);
    let listed = client
        .list_volumes(v1::ListVolumesRequest {
            max_entries: 10,
            starting_token: String::new(),
        })
        .await
        .unwrap();
    assert!(
        listed
            .entries
            .iter()
            .any(|e| e.volume.as_ref().unwrap().volume_id == "rt")
    );
    let validated = client
        .validate_volume_capabilities(v1::ValidateVolumeCapabilitiesRequest {
            volume_id: "rt".into(),
            volume_capabilities: vec![capability()],
            ..Default::default()
        })
        .await
        .unwrap();
    assert!(validated.confirmed.is_some(), "{validated:?}");
    let published = client
        .controller_publish_volume(v1::ControllerPublishVolumeRequest {
            volume_id: "rt".into(),
            node_id: "node-1".into(),
            volume_capability: Some(capability()),
            ..Default::default()
        })
        .await
        .unwrap();

    // Node side, with the CO's duties: staging dir and target parent (v1) or target (v0).
    let staging = dir.path().join("co/staging");
    let target = dir.path().join("co/target");
    std::fs::create_dir_all(&staging).unwrap();
    if versions.starts_with("v0") {
        std::fs::create_dir_all(&target).unwrap();
    }
    client
        .node_stage_volume(v1::NodeStageVolumeRequest {
            volume_id: "rt".into(),
            publish_context: published.publish_context.clone(),
            staging_target_path: staging.display().to_string(),
            volume_capability: Some(capability()),
            ..Default::default()
        })
        .await
        .unwrap();
    client
        .node_publish_volume(v1::NodePublishVolumeRequest {
            volume_id: "rt".into(),
            publish_context: published.publish_context,
            staging_target_path: staging.display().to_string(),
            target_path: target.display().to_string(),
            volume_capability: Some(capability()),
            readonly: true,
            ..Default::default()
        })
        .await
        .unwrap();
    let mounted = mounts_under(dir.path());
    assert!(
        mounted.contains(&staging) && mounted.contains(&target),
        "{mounted:?}"
    );
    let err = std::fs::write(target.join("x"), b"x").unwrap_err();
    assert_eq!(
        err.raw_os_error(),
        Some(30),
        "read-only publish must refuse writes"
    );

    client
        .node_unpublish_volume(v1::NodeUnpublishVolumeRequest {
            volume_id: "rt".into(),
            target_path: target.display().to_string(),
        })
        .await
        .unwrap();
    client
        .node_unstage_volume(v1::NodeUnstageVolumeRequest {
            volume_id: "rt".into(),
            staging_target_path: staging.display().to_string(),
        })
        .await
        .unwrap();
    assert!(mounts_under(dir.path()).is_empty());
    if versions.starts_with("v0") {
        assert!(
            target.exists(),
            "v0: the CO removes the target, not the plugin"
        );
    } else {
        assert!(
            !target.exists(),
            "v1: the plugin removes the target it created"
        );
    }
    client
        .controller_unpublish_volume(v1::ControllerUnpublishVolumeRequest {
            volume_id: "rt".into(),
            node_id: "node-1".into(),
            ..Default::default()
        })
        .await
        .unwrap();
    client
        .delete_volume(v1::DeleteVolumeRequest {
            volume_id: "rt".into(),
            ..Default::default()
        })
        .await
        .unwrap();
    // The plugin saw the calls in the right version.
    let expected_version = if versions == "v1" { "v1" } else { versions };
    let stage = plugin
        .calls()
        .into_iter()
        .find(|c| c["method"] == "NodeStageVolume")
        .unwrap();
    assert_eq!(stage["version"], expected_version);
}

#[tokio::test]
async fn every_rpc_round_trips_in_v1() {
    round_trip("v1").await;
}

#[tokio::test]
async fn every_rpc_round_trips_in_v0_3() {
    round_trip("v0.3").await;
}

#[tokio::test]
async fn every_rpc_round_trips_in_v0_2() {
    round_trip("v0.2").await;
}

#[tokio::test]
async fn quirks_are_tolerated() {
    let dir = tempfile::tempdir().unwrap();
    let plugin = TestPlugin::start(
        dir.path(),
        &[
            "--mount-mode",
            "none",
            "--duplicate-capabilities",
            "--empty-probe",
            "--probe-not-ready",
            "0",
        ],
    );
    let client = connect(&plugin).await;
    // Empty Probe: a missing `ready` means ready.
    assert!(client.probe().await.unwrap());
    let node = client.node_get_capabilities().await.unwrap();
    assert_eq!(node.len(), 1, "duplicates and UNKNOWN folded: {node:?}");
    let controller = client.controller_get_capabilities().await.unwrap();
    assert!(!controller.is_empty());
    let described = client.describe().await.unwrap();
    assert_eq!(
        described.node_capabilities,
        Some(vec!["STAGE_UNSTAGE_VOLUME".to_owned()])
    );

    let dir = tempfile::tempdir().unwrap();
    let plugin = TestPlugin::start(
        dir.path(),
        &["--mount-mode", "none", "--probe-not-ready", "2"],
    );
    let client = connect(&plugin).await; // detection probes once (not ready yet)
    assert!(
        !client.probe().await.unwrap(),
        "ready=false means not ready yet"
    );
    assert!(client.probe().await.unwrap());
}

#[tokio::test]
async fn injected_codes_land_in_their_class() {
    let dir = tempfile::tempdir().unwrap();
    let plugin = TestPlugin::start(dir.path(), &["--mount-mode", "none", "--volumes", "v:1M"]);
    let client = connect(&plugin).await;
    let codes = [
        ("UNAVAILABLE", ErrorClass::Transient),
        ("DEADLINE_EXCEEDED", ErrorClass::Transient),
        ("RESOURCE_EXHAUSTED", ErrorClass::Transient),
        ("ABORTED", ErrorClass::Transient),
        ("NOT_FOUND", ErrorClass::Final),
        ("INVALID_ARGUMENT", ErrorClass::Final),
        ("FAILED_PRECONDITION", ErrorClass::Final),
        ("INTERNAL", ErrorClass::Final),
        ("ALREADY_EXISTS", ErrorClass::Final),
        ("OUT_OF_RANGE", ErrorClass::Final),
    ];
    for (i, (code, class)) in codes.iter().enumerate() {
        plugin.set_faults(json!({"rules": [
            {"id": format!("r{i}"), "method": "NodeGetInfo", "fail": {"code": code, "message": "injected"}, "times": 1}
        ]}));
        let err = client.node_get_info().await.unwrap_err();
        assert_eq!(err.class(), *class, "{code}: {err}");
        assert!(
            matches!(&err.kind, RpcErrorKind::Status { message, .. } if message == "injected"),
            "{err:?}"
        );
    }
    // A delay past the deadline: a local timeout, transient and uncertain.
    plugin
        .set_faults(json!({"rules": [{"id": "slow", "method": "NodeGetInfo", "delay_ms": 1500}]}));
    let impatient = CsiClient::with_version(
        &plugin.socket,
        CsiVersion::V1,
        ClientOptions {
            rpc_deadline: Duration::from_millis(300),
            ..options()
        },
    );
    let started = std::time::Instant::now();
    let err = impatient.node_get_info().await.unwrap_err();
    assert!(started.elapsed() < Duration::from_millis(1200));
    assert_eq!(err.kind, RpcErrorKind::DeadlineExceeded);
    assert!(err.is_transient());
    // The plugin exits when the call arrives: a transport failure, transient.
    plugin.set_faults(json!({"rules": [{"id": "die", "method": "NodeGetInfo", "exit": true}]}));
    let err = client.node_get_info().await.unwrap_err();
    assert!(err.is_transient(), "{err:?}");
}
