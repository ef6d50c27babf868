//! `--backend-dir`: two instances of the plugin, as on two nodes (their own `--node-id`, work
//! dir and socket), sharing one backend over real gRPC: the volumes and who has them attached
//! are the backend's, and it refuses — and records — a second node's attach of a single-node
//! volume. In `--mount-mode none` (no mount syscalls); the data itself, through real bind
//! mounts, is tested in `bind_mounts.rs`.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::path::Path;

use common::*;
use csi_proto::v1;
use tonic::Code;
use v1::volume_capability::access_mode::Mode;

const A: &str = "node-a";
const B: &str = "node-b";

/// Two instances in `--mount-mode none`, on nodes A and B, sharing `backend`, with a v1
/// client of each.
struct Nodes {
    backend: tempfile::TempDir,
    a: Plugin,
    b: Plugin,
    ca: V1,
    cb: V1,
}

impl Nodes {
    async fn start() -> anyhow::Result<Self> {
        let backend = tempfile::tempdir()?;
        let dir = backend.path().display().to_string();
        let flags = ["--backend-dir", dir.as_str(), "--mount-mode", "none"];
        let (a, b) = (
            Plugin::start_on(A, &flags).await?,
            Plugin::start_on(B, &flags).await?,
        );
        let (ca, cb) = (a.v1().await?, b.v1().await?);
        Ok(Self {
            backend,
            a,
            b,
            ca,
            cb,
        })
    }
}

fn delete(id: &str) -> v1::DeleteVolumeRequest {
    v1::DeleteVolumeRequest {
        volume_id: id.to_owned(),
        ..Default::default()
    }
}

fn lines(path: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .map(|l| serde_json::from_str(l).expect("a JSON line"))
        .collect()
}

fn attachments(backend: &Path) -> serde_json::Value {
    let text = std::fs::read_to_string(backend.join("attachments.json")).unwrap_or_default();
    if text.is_empty() {
        return serde_json::json!({});
    }
    serde_json::from_str(&text).expect("attachments.json")
}

fn cpub(id: &str, node: &str, mode: Mode, readonly: bool) -> v1::ControllerPublishVolumeRequest {
    v1::ControllerPublishVolumeRequest {
        volume_id: id.to_owned(),
        node_id: node.to_owned(),
        volume_capability: Some(cap(mode)),
        readonly,
        ..Default::default()
    }
}

fn cunpub(id: &str, node: &str) -> v1::ControllerUnpublishVolumeRequest {
    v1::ControllerUnpublishVolumeRequest {
        volume_id: id.to_owned(),
        node_id: node.to_owned(),
        ..Default::default()
    }
}

fn create(id: &str, mode: Mode) -> v1::CreateVolumeRequest {
    let mut req = create_req(id, 1 << 20);
    req.volume_capabilities = vec![cap(mode)];
    req
}

fn stage(id: &str, staging: &Path, mode: Mode) -> v1::NodeStageVolumeRequest {
    let mut req = stage_req(id, staging);
    req.volume_capability = Some(cap(mode));
    req
}

#[tokio::test]
async fn a_single_node_volume_moves_between_nodes_only_through_the_backend() -> anyhow::Result<()> {
    let Nodes {
        backend,
        a,
        b,
        mut ca,
        mut cb,
    } = Nodes::start().await?;
    let snw = Mode::SingleNodeWriter;

    // Created through A, seen through B: one catalogue.
    ca.ctl.create_volume(create("vol", snw)).await?;
    let listed = cb
        .ctl
        .list_volumes(v1::ListVolumesRequest::default())
        .await?;
    let ids: Vec<String> = listed
        .into_inner()
        .entries
        .into_iter()
        .filter_map(|e| e.volume.map(|v| v.volume_id))
        .collect();
    assert_eq!(ids, ["vol"]);
    assert!(backend.path().join("volumes/vol").is_dir());

    // Published to A; the repeat is the same answer.
    let first = ca
        .ctl
        .controller_publish_volume(cpub("vol", A, snw, false))
        .await?;
    let again = ca
        .ctl
        .controller_publish_volume(cpub("vol", A, snw, false))
        .await?;
    assert_eq!(
        first.into_inner().publish_context,
        again.into_inner().publish_context
    );
    assert_eq!(
        attachments(backend.path())["vol"]["nodes"],
        serde_json::json!([A])
    );

    // A second node, through its own instance: refused, naming the holder.
    let msg = expect_code(
        cb.ctl
            .controller_publish_volume(cpub("vol", B, snw, false))
            .await,
        Code::FailedPrecondition,
    )?;
    assert!(msg.contains(A), "{msg}");
    // Nor through A's instance (the backend decides, not the instance asked).
    expect_code(
        ca.ctl
            .controller_publish_volume(cpub("vol", B, snw, false))
            .await,
        Code::FailedPrecondition,
    )?;
    assert_eq!(
        attachments(backend.path())["vol"]["nodes"],
        serde_json::json!([A])
    );
    // Nor deleted through B while A has it.
    let msg = expect_code(
        cb.ctl.delete_volume(delete("vol")).await,
        Code::FailedPrecondition,
    )?;
    assert!(msg.contains(A), "{msg}");

    // Every Controller/Node RPC is in the backend's call log, by node.
    let calls = lines(&backend.path().join("calls.jsonl"));
    let outcomes = |node: &str, rpc: &str| -> Vec<String> {
        calls
            .iter()
            .filter(|c| c["node"] == node && c["rpc"] == rpc && c["volume"] == "vol")
            .map(|c| c["outcome"].as_str().unwrap_or_default().to_owned())
            .collect()
    };
    assert_eq!(
        outcomes(A, "ControllerPublishVolume"),
        ["OK", "OK", "FAILED_PRECONDITION"]
    );
    assert_eq!(
        outcomes(B, "ControllerPublishVolume"),
        ["FAILED_PRECONDITION"]
    );
    assert_eq!(outcomes(A, "CreateVolume"), ["OK"]);
    assert!(
        calls
            .iter()
            .all(|c| c["time_ms"].as_u64().is_some_and(|t| t > 0))
    );

    // Staged on A and let go, unpublished from A: published to B.
    let staging_a = a.mkdir("staging")?;
    ca.node
        .node_stage_volume(stage("vol", &staging_a, snw))
        .await?;
    assert_eq!(
        attachments(backend.path())["vol"]["staged"],
        serde_json::json!([A])
    );
    // Unpublishing a node that is not there is OK and changes nothing.
    ca.ctl.controller_unpublish_volume(cunpub("vol", B)).await?;
    assert_eq!(
        attachments(backend.path())["vol"]["nodes"],
        serde_json::json!([A])
    );
    ca.node
        .node_unstage_volume(unstage_req("vol", &staging_a))
        .await?;
    ca.ctl.controller_unpublish_volume(cunpub("vol", A)).await?;
    ca.ctl.controller_unpublish_volume(cunpub("vol", A)).await?;
    assert_eq!(attachments(backend.path()).get("vol"), None);
    cb.ctl
        .controller_publish_volume(cpub("vol", B, snw, false))
        .await?;
    assert_eq!(
        attachments(backend.path())["vol"]["nodes"],
        serde_json::json!([B])
    );
    assert!(lines(&backend.path().join("violations.jsonl")).is_empty());

    // A, whose CO missed the move, stages anyway: refused and recorded as a violation.
    let msg = expect_code(
        ca.node
            .node_stage_volume(stage("vol", &staging_a, snw))
            .await,
        Code::FailedPrecondition,
    )?;
    assert!(msg.contains(B), "{msg}");
    let violations = lines(&backend.path().join("violations.jsonl"));
    assert_eq!(violations.len(), 1, "{violations:?}");
    assert_eq!(violations[0]["node"], A);
    assert_eq!(violations[0]["volume"], "vol");
    assert_eq!(violations[0]["rpc"], "NodeStageVolume");
    assert_eq!(violations[0]["attached_to"], serde_json::json!([B]));
    assert!(violations[0]["time"].as_u64().is_some());
    assert_eq!(
        attachments(backend.path())["vol"].get("staged"),
        Some(&serde_json::json!([]))
    );

    // B, where it is attached, stages it.
    let staging_b = b.mkdir("staging")?;
    cb.node
        .node_stage_volume(stage("vol", &staging_b, snw))
        .await?;
    assert_eq!(
        attachments(backend.path())["vol"]["staged"],
        serde_json::json!([B])
    );

    // Let go on B, deleted through A: gone for B too.
    cb.node
        .node_unstage_volume(unstage_req("vol", &staging_b))
        .await?;
    cb.ctl.controller_unpublish_volume(cunpub("vol", B)).await?;
    ca.ctl.delete_volume(delete("vol")).await?;
    assert!(!backend.path().join("volumes/vol").exists());
    let listed = cb
        .ctl
        .list_volumes(v1::ListVolumesRequest::default())
        .await?;
    assert!(listed.into_inner().entries.is_empty());
    expect_code(
        cb.ctl
            .controller_publish_volume(cpub("vol", B, snw, false))
            .await,
        Code::NotFound,
    )?;
    Ok(())
}

#[tokio::test]
async fn multi_node_modes_share_readers_and_one_writer() -> anyhow::Result<()> {
    let Nodes {
        backend,
        a,
        b,
        mut ca,
        mut cb,
    } = Nodes::start().await?;

    // MULTI_NODE_READER_ONLY: published to both, staged on both.
    let ro = Mode::MultiNodeReaderOnly;
    ca.ctl.create_volume(create("shared", ro)).await?;
    ca.ctl
        .controller_publish_volume(cpub("shared", A, ro, true))
        .await?;
    cb.ctl
        .controller_publish_volume(cpub("shared", B, ro, true))
        .await?;
    assert_eq!(
        attachments(backend.path())["shared"]["nodes"],
        serde_json::json!([A, B])
    );
    // Each instance reports both nodes (ListVolumes' published_node_ids).
    let listed = ca
        .ctl
        .list_volumes(v1::ListVolumesRequest::default())
        .await?;
    let nodes = listed.into_inner().entries[0]
        .status
        .clone()
        .unwrap_or_default()
        .published_node_ids;
    assert_eq!(nodes, [A, B]);
    let (sa, sb) = (a.mkdir("staging")?, b.mkdir("staging")?);
    ca.node.node_stage_volume(stage("shared", &sa, ro)).await?;
    cb.node.node_stage_volume(stage("shared", &sb, ro)).await?;
    assert_eq!(
        attachments(backend.path())["shared"]["staged"],
        serde_json::json!([A, B])
    );
    ca.node
        .node_unstage_volume(unstage_req("shared", &sa))
        .await?;
    cb.node
        .node_unstage_volume(unstage_req("shared", &sb))
        .await?;
    // An empty node_id unpublishes every node (spec).
    ca.ctl
        .controller_unpublish_volume(cunpub("shared", ""))
        .await?;
    assert_eq!(attachments(backend.path()).get("shared"), None);

    // MULTI_NODE_SINGLE_WRITER: a reader beside the writer, never a second writer.
    let sw = Mode::MultiNodeSingleWriter;
    ca.ctl.create_volume(create("one-writer", sw)).await?;
    ca.ctl
        .controller_publish_volume(cpub("one-writer", A, sw, false))
        .await?;
    let msg = expect_code(
        cb.ctl
            .controller_publish_volume(cpub("one-writer", B, sw, false))
            .await,
        Code::FailedPrecondition,
    )?;
    assert!(msg.contains(A), "{msg}");
    cb.ctl
        .controller_publish_volume(cpub("one-writer", B, sw, true))
        .await?;
    assert_eq!(
        attachments(backend.path())["one-writer"]["nodes"],
        serde_json::json!([A, B])
    );

    // A single-node volume is refused beside a multi-node publication.
    let msg = expect_code(
        cb.ctl
            .controller_publish_volume(cpub("one-writer", "node-c", Mode::SingleNodeWriter, false))
            .await,
        Code::FailedPrecondition,
    )?;
    assert!(msg.contains(A), "{msg}");
    assert!(lines(&backend.path().join("violations.jsonl")).is_empty());
    Ok(())
}

#[tokio::test]
async fn a_node_stage_where_another_node_has_a_single_node_volume_is_a_violation()
-> anyhow::Result<()> {
    let Nodes {
        backend,
        a,
        b,
        mut ca,
        mut cb,
    } = Nodes::start().await?;
    let snw = Mode::SingleNodeWriter;
    ca.ctl.create_volume(create("vol", snw)).await?;
    ca.ctl
        .controller_publish_volume(cpub("vol", A, snw, false))
        .await?;
    let sa = a.mkdir("staging")?;
    ca.node.node_stage_volume(stage("vol", &sa, snw)).await?;
    // A backend that lost track (a CO forcing a detach while A still has it staged): B
    // attached by hand, A's staging still there. B's NodeStage must not make it two.
    let path = backend.path().join("attachments.json");
    let mut att = attachments(backend.path());
    att["vol"]["nodes"] = serde_json::json!([A, B]);
    let publication = att["vol"]["publications"][A].clone();
    att["vol"]["publications"][B] = publication;
    std::fs::write(&path, serde_json::to_vec(&att)?)?;
    let sb = b.mkdir("staging")?;
    let msg = expect_code(
        cb.node.node_stage_volume(stage("vol", &sb, snw)).await,
        Code::FailedPrecondition,
    )?;
    assert!(msg.contains(A), "{msg}");
    let violations = lines(&backend.path().join("violations.jsonl"));
    assert_eq!(violations.len(), 1, "{violations:?}");
    assert_eq!(violations[0]["node"], B);
    assert_eq!(violations[0]["attached_to"], serde_json::json!([A]));
    assert_eq!(
        attachments(backend.path())["vol"]["staged"],
        serde_json::json!([A])
    );
    Ok(())
}

#[tokio::test]
async fn without_staging_a_node_publish_where_the_volume_is_not_attached_is_a_violation()
-> anyhow::Result<()> {
    let backend = tempfile::tempdir()?;
    let dir = backend.path().display().to_string();
    let flags = [
        "--backend-dir",
        dir.as_str(),
        "--mount-mode",
        "none",
        "--no-stage-unstage",
    ];
    let (a, b) = (
        Plugin::start_on(A, &flags).await?,
        Plugin::start_on(B, &flags).await?,
    );
    let (mut ca, mut cb) = (a.v1().await?, b.v1().await?);
    let snw = Mode::SingleNodeWriter;
    ca.ctl.create_volume(create("vol", snw)).await?;
    ca.ctl
        .controller_publish_volume(cpub("vol", A, snw, false))
        .await?;
    let publish = |p: &Plugin| {
        let mut req = publish_req("vol", Path::new(""), &p.path("target"));
        req.staging_target_path = String::new();
        req
    };
    let msg = expect_code(
        cb.node.node_publish_volume(publish(&b)).await,
        Code::FailedPrecondition,
    )?;
    assert!(msg.contains(A), "{msg}");
    let violations = lines(&backend.path().join("violations.jsonl"));
    assert_eq!(violations.len(), 1, "{violations:?}");
    assert_eq!(violations[0]["node"], B);
    assert_eq!(violations[0]["rpc"], "NodePublishVolume");
    assert_eq!(violations[0]["attached_to"], serde_json::json!([A]));
    // Where it is attached, the same publish is served.
    ca.node.node_publish_volume(publish(&a)).await?;
    assert_eq!(
        lines(&backend.path().join("violations.jsonl")).len(),
        1,
        "no violation for the attached node"
    );
    Ok(())
}

#[tokio::test]
async fn flags_that_keep_data_on_one_node_are_refused_with_a_backend() -> anyhow::Result<()> {
    let backend = tempfile::tempdir()?;
    let dir = backend.path().display().to_string();
    for flag in [
        &["--block"][..],
        &["--snapshots"],
        &["--volume-fs", "tmpfs"],
        &["--no-controller-publish"],
    ] {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_csi-testplugin"))
            .args(["--endpoint", "unix:///nonexistent/x.sock", "--work-dir"])
            .arg(backend.path().join("work"))
            .args(["--backend-dir", &dir])
            .args(flag)
            .output()?;
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{flag:?}: {stderr}");
        assert!(
            stderr.contains("--backend-dir cannot be combined with") && stderr.contains(flag[0]),
            "{flag:?}: {stderr}"
        );
    }
    Ok(())
}
