//! Serving several CSI versions on one socket: v1 with v0.3, v0.2 alone,
//! v1 alone; the 0.x differences (NodeGetId/NodeGetInfo, Probe without
//! `ready`, the CO-owned target) and the per-version plugin name.

mod common;

use common::*;
use csi_proto::{v0, v1};
use tonic::Code;

const NONE: &[&str] = &["--mount-mode", "none"];

#[tokio::test]
async fn v1_and_v0_3_share_one_socket_and_one_truth() -> anyhow::Result<()> {
    let p = Plugin::start(&[
        "--mount-mode",
        "none",
        "--v0-plugin-name",
        "org.example.legacy",
    ])
    .await?;
    let mut a = p.v1().await?;
    let mut b = p.v0().await?;

    let n1 =
        a.id.get_plugin_info(v1::GetPluginInfoRequest {})
            .await?
            .into_inner();
    let n0 =
        b.id.get_plugin_info(v0::GetPluginInfoRequest {})
            .await?
            .into_inner();
    assert_eq!(n1.name, "org.example.test");
    assert_eq!(n0.name, "org.example.legacy");
    assert!(!n1.vendor_version.is_empty());

    let probe = b.id.probe(v0::ProbeRequest {}).await?.into_inner();
    assert_eq!(probe.ready, Some(true));
    let info = b
        .node
        .node_get_info(v0::NodeGetInfoRequest {})
        .await?
        .into_inner();
    assert_eq!(info.node_id, NODE);
    let id = b
        .node
        .node_get_id(v0::NodeGetIdRequest {})
        .await?
        .into_inner();
    assert_eq!(id.node_id, NODE);

    // Created through v1, visible through v0.
    a.ctl.create_volume(create_req("v", 1)).await?;
    let listed = b
        .ctl
        .list_volumes(v0::ListVolumesRequest::default())
        .await?
        .into_inner();
    assert_eq!(listed.entries.len(), 1);
    assert_eq!(listed.entries[0].volume.clone().unwrap_or_default().id, "v");
    let valid = b
        .ctl
        .validate_volume_capabilities(v0::ValidateVolumeCapabilitiesRequest {
            volume_id: "v".into(),
            volume_capabilities: vec![snw0()],
            ..Default::default()
        })
        .await?
        .into_inner();
    assert!(valid.supported);
    let caps = b
        .ctl
        .controller_get_capabilities(v0::ControllerGetCapabilitiesRequest {})
        .await?
        .into_inner();
    assert_eq!(
        caps.capabilities.len(),
        4,
        "v0 has no PUBLISH_READONLY etc."
    );
    Ok(())
}

#[tokio::test]
async fn v0_target_is_created_and_kept_by_the_co() -> anyhow::Result<()> {
    let p = Plugin::start(&["--mount-mode", "none", "--record-secrets"]).await?;
    let mut c = p.v0().await?;
    c.ctl
        .create_volume(v0::CreateVolumeRequest {
            name: "v".into(),
            volume_capabilities: vec![snw0()],
            ..Default::default()
        })
        .await?;
    let info = c
        .ctl
        .controller_publish_volume(v0::ControllerPublishVolumeRequest {
            volume_id: "v".into(),
            node_id: NODE.into(),
            volume_capability: Some(snw0()),
            ..Default::default()
        })
        .await?
        .into_inner();
    assert!(info.publish_info.contains_key("device"));
    let staging = p.mkdir("staging")?;
    c.node
        .node_stage_volume(v0::NodeStageVolumeRequest {
            volume_id: "v".into(),
            staging_target_path: staging.display().to_string(),
            volume_capability: Some(snw0()),
            node_stage_secrets: [("stage-key".to_owned(), "s3cret".to_owned())].into(),
            ..Default::default()
        })
        .await?;
    let target = p.path("target");
    let publish = |target: &std::path::Path| v0::NodePublishVolumeRequest {
        volume_id: "v".into(),
        staging_target_path: staging.display().to_string(),
        target_path: target.display().to_string(),
        volume_capability: Some(snw0()),
        node_publish_secrets: [("publish-key".to_owned(), "p4ss".to_owned())].into(),
        ..Default::default()
    };
    // The plugin must not create the target in 0.x.
    expect_code(
        c.node.node_publish_volume(publish(&target)).await,
        Code::FailedPrecondition,
    )?;
    assert!(!target.exists());
    std::fs::create_dir(&target)?;
    c.node.node_publish_volume(publish(&target)).await?;
    c.node.node_publish_volume(publish(&target)).await?;
    for _ in 0..2 {
        c.node
            .node_unpublish_volume(v0::NodeUnpublishVolumeRequest {
                volume_id: "v".into(),
                target_path: target.display().to_string(),
            })
            .await?;
    }
    assert!(target.is_dir(), "0.x: the target stays, the CO owns it");

    // The v0 secrets fields arrive.
    let stage = p.calls_of("NodeStageVolume")?;
    assert_eq!(stage[0]["version"], "v0.3");
    assert_eq!(stage[0]["secrets"]["stage-key"], "s3cret");
    let publish = p.calls_of("NodePublishVolume")?;
    assert_eq!(
        publish.last().map(|c| c["secrets"]["publish-key"].clone()),
        Some("p4ss".into())
    );
    Ok(())
}

#[tokio::test]
async fn v0_2_mode() -> anyhow::Result<()> {
    let p = Plugin::start(&[
        "--mount-mode",
        "none",
        "--api-versions",
        "v0.2",
        "--probe-not-ready",
        "1",
    ])
    .await?;
    let mut c = p.v0().await?;
    // 0.2 has no `ready`: "not ready" can only be an error.
    expect_code(
        c.id.probe(v0::ProbeRequest {}).await,
        Code::FailedPrecondition,
    )?;
    let probe = c.id.probe(v0::ProbeRequest {}).await?.into_inner();
    assert_eq!(probe.ready, None, "a 0.2 ProbeResponse has no ready field");
    expect_code(
        c.node.node_get_info(v0::NodeGetInfoRequest {}).await,
        Code::Unimplemented,
    )?;
    let id = c
        .node
        .node_get_id(v0::NodeGetIdRequest {})
        .await?
        .into_inner();
    assert_eq!(id.node_id, NODE);
    // No v1 on this socket.
    let mut v1c = p.v1().await?;
    expect_code(v1c.id.probe(v1::ProbeRequest {}).await, Code::Unimplemented)?;
    let log = p.calls_of("NodeGetInfo")?;
    assert_eq!(log[0]["version"], "v0.2");
    assert_eq!(log[0]["code"], "UNIMPLEMENTED");
    Ok(())
}

#[tokio::test]
async fn v1_only_has_no_v0_services() -> anyhow::Result<()> {
    let p = Plugin::start(&["--mount-mode", "none", "--api-versions", "v1"]).await?;
    let mut c = p.v0().await?;
    expect_code(c.id.probe(v0::ProbeRequest {}).await, Code::Unimplemented)?;
    expect_code(
        c.node.node_get_id(v0::NodeGetIdRequest {}).await,
        Code::Unimplemented,
    )?;
    let mut c1 = p.v1().await?;
    c1.id.probe(v1::ProbeRequest {}).await?;
    Ok(())
}

#[tokio::test]
async fn two_v0_flavours_are_refused() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_csi-testplugin"))
        .arg("--endpoint")
        .arg(dir.path().join("s.sock"))
        .arg("--work-dir")
        .arg(dir.path())
        .args(["--api-versions", "v0.2,v0.3"])
        .output()?;
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("at most one v0 flavour"), "{err}");
    Ok(())
}

#[tokio::test]
async fn preprovisioned_volumes_and_plain_socket_path() -> anyhow::Result<()> {
    // The endpoint given as a bare path (a real-world quirk of CSI_ENDPOINT).
    let dir = tempfile::tempdir()?;
    let socket = dir.path().join("plain.sock");
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_csi-testplugin"))
        .env("CSI_ENDPOINT", &socket)
        .env("CSI_TESTPLUGIN_WORK_DIR", dir.path().join("w"))
        .env("CSI_NODE_ID", "env-node")
        .args(NONE)
        .args(["--volumes", "data:1Gi,logs:5Mi"])
        .stderr(std::process::Stdio::null())
        .spawn()?;
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while tokio::net::UnixStream::connect(&socket).await.is_err() {
        anyhow::ensure!(std::time::Instant::now() < deadline, "no socket");
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    let ch = connect(&socket).await?;
    let mut ctl = v1::controller_client::ControllerClient::new(ch.clone());
    let mut node = v1::node_client::NodeClient::new(ch);
    let listed = ctl
        .list_volumes(v1::ListVolumesRequest::default())
        .await?
        .into_inner();
    let sizes: Vec<(String, i64)> = listed
        .entries
        .into_iter()
        .filter_map(|e| e.volume.map(|v| (v.volume_id, v.capacity_bytes)))
        .collect();
    assert_eq!(
        sizes,
        vec![("data".into(), 1 << 30), ("logs".into(), 5 << 20)]
    );
    let info = node
        .node_get_info(v1::NodeGetInfoRequest {})
        .await?
        .into_inner();
    assert_eq!(info.node_id, "env-node");
    child.kill()?;
    child.wait()?;
    Ok(())
}
