//! Fault injection, the call log, quirks, restarts and signals: every
//! injected behaviour must be observable from the outside.

mod common;

use std::time::{Duration, Instant};

use common::*;
use csi_proto::v1;
use rustix::process::Signal;
use tonic::Code;

const NONE: &[&str] = &["--mount-mode", "none"];

#[tokio::test]
async fn fail_n_times_then_succeed_across_restart() -> anyhow::Result<()> {
    let mut p = Plugin::start(NONE).await?;
    p.write_faults(
        r#"{"rules": [{"method": "NodeStageVolume", "fail": {"code": "UNAVAILABLE", "message": "x"}, "times": 3}]}"#,
    )?;
    let mut c = p.v1().await?;
    c.ctl.create_volume(create_req("v", 1)).await?;
    c.ctl.controller_publish_volume(cpub_req("v")).await?;
    let staging = p.mkdir("staging")?;
    for _ in 0..2 {
        let msg = expect_code(
            c.node.node_stage_volume(stage_req("v", &staging)).await,
            Code::Unavailable,
        )?;
        assert_eq!(msg, "x");
    }
    // Killed and restarted: the count ("next N") and the volume survive.
    p.kill().await?;
    p.spawn().await?;
    let mut c = p.v1().await?;
    expect_code(
        c.node.node_stage_volume(stage_req("v", &staging)).await,
        Code::Unavailable,
    )?;
    c.node.node_stage_volume(stage_req("v", &staging)).await?;
    c.node.node_stage_volume(stage_req("v", &staging)).await?;
    // The stage record survived too: publish needs it.
    let target = p.mkdir("pods")?.join("t");
    c.node
        .node_publish_volume(publish_req("v", &staging, &target))
        .await?;

    let codes: Vec<String> = p
        .calls_of("NodeStageVolume")?
        .iter()
        .map(|c| c["code"].as_str().unwrap_or_default().to_owned())
        .collect();
    assert_eq!(
        codes,
        ["UNAVAILABLE", "UNAVAILABLE", "UNAVAILABLE", "OK", "OK"]
    );
    Ok(())
}

#[tokio::test]
async fn fault_file_is_reread_and_wildcard_applies() -> anyhow::Result<()> {
    let p = Plugin::start(NONE).await?;
    let mut c = p.v1().await?;
    c.ctl.create_volume(create_req("v", 1)).await?;
    p.write_faults(r#"{"rules": [{"method": "*", "fail": {"code": "RESOURCE_EXHAUSTED"}}]}"#)?;
    expect_code(
        c.ctl.get_capacity(v1::GetCapacityRequest::default()).await,
        Code::ResourceExhausted,
    )?;
    expect_code(
        c.id.probe(v1::ProbeRequest {}).await,
        Code::ResourceExhausted,
    )?;
    std::fs::remove_file(p.faults_path())?;
    c.id.probe(v1::ProbeRequest {}).await?;
    Ok(())
}

#[tokio::test]
async fn delay_is_measurable_and_overlap_is_aborted() -> anyhow::Result<()> {
    let p = Plugin::start(NONE).await?;
    let mut c = p.v1().await?;
    let staging = create_and_stage(&p, &mut c, "v").await?;
    p.write_faults(r#"{"rules": [{"method": "NodePublishVolume", "delay_ms": 500}]}"#)?;
    let target = p.mkdir("pods")?.join("t");

    let mut slow = c.node.clone();
    let req = publish_req("v", &staging, &target);
    let started = Instant::now();
    let first = tokio::spawn(async move { slow.node_publish_volume(req).await });
    tokio::time::sleep(Duration::from_millis(150)).await;
    // A second call on the same volume while the first is in flight.
    let msg = expect_code(
        c.node
            .node_unpublish_volume(unpublish_req("v", &target))
            .await,
        Code::Aborted,
    )?;
    assert!(msg.contains("pending"), "{msg}");
    // Another volume is not blocked.
    c.ctl.create_volume(create_req("other", 1)).await?;
    first.await??;
    assert!(started.elapsed() >= Duration::from_millis(500));

    let publish = p.calls_of("NodePublishVolume")?;
    let (s, e) = (
        publish[0]["start_ns"].as_u64().unwrap_or_default(),
        publish[0]["end_ns"].as_u64().unwrap_or_default(),
    );
    assert!(e - s >= 500_000_000, "{publish:?}");
    assert_eq!(publish[0]["overlap"], false);
    let unpublish = p.calls_of("NodeUnpublishVolume")?;
    assert_eq!(unpublish[0]["overlap"], true);
    assert_eq!(unpublish[0]["code"], "ABORTED");
    assert_eq!(unpublish[0]["volume_id"], "v");
    assert!(
        p.calls()?
            .iter()
            .all(|c| c["method"] != "CreateVolume" || c["overlap"] == false)
    );
    Ok(())
}

#[tokio::test]
async fn operation_completes_after_the_client_gives_up() -> anyhow::Result<()> {
    let p = Plugin::start(NONE).await?;
    let mut c = p.v1().await?;
    c.ctl.create_volume(create_req("v", 1)).await?;
    p.write_faults(r#"{"rules": [{"method": "ControllerPublishVolume", "delay_ms": 400}]}"#)?;
    let mut req = tonic::Request::new(cpub_req("v"));
    req.set_timeout(Duration::from_millis(100));
    let r = c.ctl.controller_publish_volume(req).await;
    assert!(r.is_err(), "the client gave up after 100 ms: {r:?}");
    tokio::time::sleep(Duration::from_millis(600)).await;
    // It happened in the plugin although the caller timed out.
    let listed = c
        .ctl
        .list_volumes(v1::ListVolumesRequest::default())
        .await?
        .into_inner();
    let nodes = listed.entries[0]
        .status
        .clone()
        .unwrap_or_default()
        .published_node_ids;
    assert_eq!(nodes, vec![NODE.to_owned()]);
    assert_eq!(p.calls_of("ControllerPublishVolume")?[0]["code"], "OK");
    Ok(())
}

#[tokio::test]
async fn exit_fault_ends_the_process_without_answering() -> anyhow::Result<()> {
    let mut p = Plugin::start(NONE).await?;
    let mut c = p.v1().await?;
    let staging = create_and_stage(&p, &mut c, "v").await?;
    p.write_faults(
        r#"{"rules": [{"method": "NodeUnstageVolume", "exit": true, "exit_code": 7, "times": 1}]}"#,
    )?;
    let r = c.node.node_unstage_volume(unstage_req("v", &staging)).await;
    assert!(r.is_err(), "no answer expected: {r:?}");
    let status = p.wait_exit(Duration::from_secs(10)).await?;
    assert_eq!(status.code(), Some(7));
    assert_eq!(p.calls_of("NodeUnstageVolume")?[0]["code"], "EXIT");
    // The socket stays behind, like a crashed plugin's; a restart copes,
    // and the exit rule (times: 1) does not fire again.
    assert!(p.socket.exists());
    p.spawn().await?;
    let mut c = p.v1().await?;
    c.node
        .node_unstage_volume(unstage_req("v", &staging))
        .await?;
    Ok(())
}

#[tokio::test]
async fn probe_not_ready_then_ready() -> anyhow::Result<()> {
    let p = Plugin::start(NONE).await?;
    p.write_faults(r#"{"probe_not_ready": 3}"#)?;
    let mut c = p.v1().await?;
    let mut answers = Vec::new();
    for _ in 0..5 {
        answers.push(c.id.probe(v1::ProbeRequest {}).await?.into_inner().ready);
    }
    assert_eq!(
        answers,
        [
            Some(false),
            Some(false),
            Some(false),
            Some(true),
            Some(true)
        ]
    );
    // The same as a flag.
    let p = Plugin::start(&["--mount-mode", "none", "--probe-not-ready", "1"]).await?;
    let mut c = p.v1().await?;
    assert_eq!(
        c.id.probe(v1::ProbeRequest {}).await?.into_inner().ready,
        Some(false)
    );
    assert_eq!(
        c.id.probe(v1::ProbeRequest {}).await?.into_inner().ready,
        Some(true)
    );
    Ok(())
}

#[tokio::test]
async fn empty_probe_and_duplicate_capabilities() -> anyhow::Result<()> {
    let p = Plugin::start(NONE).await?;
    p.write_faults(
        r#"{"empty_probe": true, "duplicate_capabilities": true, "empty_vendor_version": true}"#,
    )?;
    let mut c = p.v1().await?;
    assert_eq!(
        c.id.probe(v1::ProbeRequest {}).await?.into_inner().ready,
        None
    );
    let info =
        c.id.get_plugin_info(v1::GetPluginInfoRequest {})
            .await?
            .into_inner();
    assert!(info.vendor_version.is_empty());

    let plugin: Vec<i32> =
        c.id.get_plugin_capabilities(v1::GetPluginCapabilitiesRequest {})
            .await?
            .into_inner()
            .capabilities
            .into_iter()
            .filter_map(|c| match c.r#type {
                Some(v1::plugin_capability::Type::Service(s)) => Some(s.r#type),
                _ => None,
            })
            .collect();
    assert_eq!(plugin, [1, 1, 0]);
    let ctl: Vec<i32> = c
        .ctl
        .controller_get_capabilities(v1::ControllerGetCapabilitiesRequest {})
        .await?
        .into_inner()
        .capabilities
        .into_iter()
        .filter_map(|c| {
            c.r#type
                .map(|v1::controller_service_capability::Type::Rpc(r)| r.r#type)
        })
        .collect();
    assert_eq!(ctl.iter().filter(|t| **t == 1).count(), 2, "{ctl:?}");
    assert!(ctl.contains(&0));
    let node: Vec<i32> = c
        .node
        .node_get_capabilities(v1::NodeGetCapabilitiesRequest {})
        .await?
        .into_inner()
        .capabilities
        .into_iter()
        .filter_map(|c| {
            c.r#type
                .map(|v1::node_service_capability::Type::Rpc(r)| r.r#type)
        })
        .collect();
    assert_eq!(node, [1, 1, 0]);
    Ok(())
}

#[tokio::test]
async fn call_log_records_secrets_only_when_asked() -> anyhow::Result<()> {
    for record in [false, true] {
        let mut args = NONE.to_vec();
        if record {
            args.push("--record-secrets");
        }
        let p = Plugin::start(&args).await?;
        let mut c = p.v1().await?;
        c.ctl.create_volume(create_req("v", 1)).await?;
        c.ctl.controller_publish_volume(cpub_req("v")).await?;
        let staging = p.mkdir("staging")?;
        let mut stage = stage_req("v", &staging);
        stage.secrets = [("user".to_owned(), "stage-secret".to_owned())].into();
        c.node.node_stage_volume(stage).await?;
        let mut publish = publish_req("v", &staging, &p.mkdir("pods")?.join("t"));
        publish.secrets = [("token".to_owned(), "publish-secret".to_owned())].into();
        c.node.node_publish_volume(publish).await?;

        let stage = &p.calls_of("NodeStageVolume")?[0];
        let publish = &p.calls_of("NodePublishVolume")?[0];
        assert_eq!(stage["version"], "v1");
        assert_eq!(stage["volume_id"], "v");
        assert_eq!(stage["code"], "OK");
        assert!(stage["start_ns"].as_u64() <= stage["end_ns"].as_u64());
        if record {
            assert_eq!(stage["secrets"]["user"], "stage-secret");
            assert_eq!(publish["secrets"]["token"], "publish-secret");
        } else {
            assert!(stage.get("secrets").is_none());
            let raw = std::fs::read_to_string(p.work.join("calls.jsonl"))?;
            assert!(!raw.contains("stage-secret") && !raw.contains("publish-secret"));
            assert!(!p.stderr().contains("stage-secret"));
        }
    }
    Ok(())
}

#[tokio::test]
async fn sigterm_removes_socket_and_exits_zero_after_delay() -> anyhow::Result<()> {
    // A stale socket file from an earlier run does not prevent the start.
    let dir = tempfile::tempdir()?;
    let stale = dir.path().join("csi.sock");
    drop(std::os::unix::net::UnixListener::bind(&stale)?);
    assert!(stale.exists());

    let mut p = Plugin::start(&["--mount-mode", "none", "--exit-delay-ms", "300"]).await?;
    // (The harness socket lives in its own temp dir; check the stale case
    // with a second plugin on `stale`.)
    let mut q = std::process::Command::new(env!("CARGO_BIN_EXE_csi-testplugin"))
        .arg("--endpoint")
        .arg(&stale)
        .arg("--work-dir")
        .arg(dir.path().join("w"))
        .args(NONE)
        .stderr(std::process::Stdio::null())
        .spawn()?;
    let deadline = Instant::now() + Duration::from_secs(20);
    while tokio::net::UnixStream::connect(&stale).await.is_err() {
        anyhow::ensure!(Instant::now() < deadline, "stale socket blocked the start");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    q.kill()?;
    q.wait()?;

    // An idle client connection must not hold up the exit.
    let mut idle = p.v1().await?;
    idle.id.probe(v1::ProbeRequest {}).await?;
    let t = Instant::now();
    p.signal(Signal::TERM)?;
    let status = p.wait_exit(Duration::from_secs(10)).await?;
    assert!(status.success(), "{status}");
    assert!(t.elapsed() >= Duration::from_millis(300));
    assert!(t.elapsed() < Duration::from_secs(3), "{:?}", t.elapsed());
    drop(idle);
    assert!(!p.socket.exists(), "socket removed on SIGTERM");
    Ok(())
}

#[tokio::test]
async fn bad_fault_file_is_reported_not_fatal() -> anyhow::Result<()> {
    let p = Plugin::start(NONE).await?;
    p.write_faults(r#"{"rules": [{"method": "NodeStageVolumeTypo", "delay_ms": 1}]}"#)?;
    let mut c = p.v1().await?;
    c.id.probe(v1::ProbeRequest {}).await?;
    assert!(p.stderr().contains("fault file rejected"), "{}", p.stderr());
    Ok(())
}

#[tokio::test]
async fn leave_socket_quirk_and_slow_start() -> anyhow::Result<()> {
    let t = Instant::now();
    let mut p = Plugin::start(&[
        "--mount-mode",
        "none",
        "--leave-socket",
        "--startup-delay-ms",
        "300",
    ])
    .await?;
    assert!(t.elapsed() >= Duration::from_millis(300), "slow start");
    p.signal(Signal::INT)?;
    let status = p.wait_exit(Duration::from_secs(10)).await?;
    assert!(status.success(), "{status}");
    assert!(p.socket.exists(), "--leave-socket keeps the socket file");
    // ...and the next start replaces it.
    p.spawn().await?;
    let mut c = p.v1().await?;
    c.id.probe(v1::ProbeRequest {}).await?;
    Ok(())
}

#[tokio::test]
async fn corrupt_state_is_moved_aside_and_volumes_adopted() -> anyhow::Result<()> {
    let mut p = Plugin::start(NONE).await?;
    let mut c = p.v1().await?;
    c.ctl.create_volume(create_req("keep", 1 << 20)).await?;
    p.kill().await?;
    std::fs::write(p.work.join("state.json"), b"{truncated")?;
    p.spawn().await?;
    assert!(p.stderr().contains("unreadable plugin state"));
    let mut c = p.v1().await?;
    let listed = c
        .ctl
        .list_volumes(v1::ListVolumesRequest::default())
        .await?
        .into_inner();
    let ids: Vec<String> = listed
        .entries
        .into_iter()
        .filter_map(|e| e.volume.map(|v| v.volume_id))
        .collect();
    assert_eq!(ids, ["keep"]);
    Ok(())
}
