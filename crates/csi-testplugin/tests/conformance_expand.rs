//! Spec conformance of volume expansion (`--expansion`, `--controller-expand`,
//! `--node-expand`), in `--mount-mode none` so that these run anywhere: the cases
//! csi-sanity's ControllerExpandVolume and NodeExpandVolume specs check (missing fields,
//! unknown volumes, growth, idempotent repeats), plus the error table's OUT_OF_RANGE and
//! the OFFLINE "Volume in use" FAILED_PRECONDITION. The real growth of a tmpfs is in
//! `bind_mounts.rs` (it needs root and a private mount namespace).

mod common;

use common::*;
use csi_proto::{v0, v1};
use tonic::Code;

const ONLINE_BOTH: &[&str] = &[
    "--mount-mode",
    "none",
    "--expansion",
    "online",
    "--controller-expand",
    "--node-expand",
];

fn node_expand_req(id: &str, path: &std::path::Path, required: i64) -> v1::NodeExpandVolumeRequest {
    v1::NodeExpandVolumeRequest {
        volume_id: id.to_owned(),
        volume_path: path.display().to_string(),
        capacity_range: Some(v1::CapacityRange {
            required_bytes: required,
            limit_bytes: 0,
        }),
        ..Default::default()
    }
}

async fn plugin_expansion(c: &mut V1) -> anyhow::Result<Vec<i32>> {
    use v1::plugin_capability::Type;
    let caps =
        c.id.get_plugin_capabilities(v1::GetPluginCapabilitiesRequest {})
            .await?
            .into_inner()
            .capabilities;
    Ok(caps
        .into_iter()
        .filter_map(|cap| match cap.r#type {
            Some(Type::VolumeExpansion(e)) => Some(e.r#type),
            _ => None,
        })
        .collect())
}

/// The RPC types of a capability list, whichever service's: `rpc` picks a capability's
/// RPC type, if it names one.
fn rpc_types<C>(caps: Vec<C>, rpc: impl Fn(C) -> Option<i32>) -> Vec<i32> {
    caps.into_iter().filter_map(rpc).collect()
}

async fn controller_caps(c: &mut V1) -> anyhow::Result<Vec<i32>> {
    use v1::controller_service_capability::Type;
    let caps = c
        .ctl
        .controller_get_capabilities(v1::ControllerGetCapabilitiesRequest {})
        .await?
        .into_inner()
        .capabilities;
    Ok(rpc_types(caps, |cap| match cap.r#type {
        Some(Type::Rpc(r)) => Some(r.r#type),
        _ => None,
    }))
}

async fn node_caps(c: &mut V1) -> anyhow::Result<Vec<i32>> {
    use v1::node_service_capability::Type;
    let caps = c
        .node
        .node_get_capabilities(v1::NodeGetCapabilitiesRequest {})
        .await?
        .into_inner()
        .capabilities;
    Ok(rpc_types(caps, |cap| match cap.r#type {
        Some(Type::Rpc(r)) => Some(r.r#type),
        _ => None,
    }))
}

/// Each flag advertises exactly its capability, and none is on by default: a plugin
/// without them answers UNIMPLEMENTED (and CSI 0.3, which has no expansion, never sees it).
#[tokio::test]
async fn capabilities_follow_the_flags() -> anyhow::Result<()> {
    use v1::controller_service_capability::rpc::Type as Ctl;
    use v1::node_service_capability::rpc::Type as Node;
    use v1::plugin_capability::volume_expansion::Type as Exp;

    let p = Plugin::start(ONLINE_BOTH).await?;
    let mut c = p.v1().await?;
    assert_eq!(plugin_expansion(&mut c).await?, vec![Exp::Online as i32]);
    assert!(
        controller_caps(&mut c)
            .await?
            .contains(&(Ctl::ExpandVolume as i32))
    );
    assert!(
        node_caps(&mut c)
            .await?
            .contains(&(Node::ExpandVolume as i32))
    );
    let mut c0 = p.v0().await?;
    let v0_node: Vec<_> = c0
        .node
        .node_get_capabilities(v0::NodeGetCapabilitiesRequest {})
        .await?
        .into_inner()
        .capabilities;
    assert_eq!(
        v0_node.len(),
        1,
        "v0.3 sees STAGE_UNSTAGE only: {v0_node:?}"
    );

    let p = Plugin::start(&["--mount-mode", "none", "--expansion", "offline"]).await?;
    let mut c = p.v1().await?;
    assert_eq!(plugin_expansion(&mut c).await?, vec![Exp::Offline as i32]);
    assert!(
        !controller_caps(&mut c)
            .await?
            .contains(&(Ctl::ExpandVolume as i32))
    );
    assert!(
        !node_caps(&mut c)
            .await?
            .contains(&(Node::ExpandVolume as i32))
    );

    let p = Plugin::start(&["--mount-mode", "none"]).await?;
    let mut c = p.v1().await?;
    assert!(plugin_expansion(&mut c).await?.is_empty());
    c.ctl.create_volume(create_req("v", 1 << 20)).await?;
    expect_code(
        c.ctl
            .controller_expand_volume(expand_req("v", 2 << 20, 0))
            .await,
        Code::Unimplemented,
    )?;
    expect_code(
        c.node
            .node_expand_volume(node_expand_req("v", &p.path("x"), 0))
            .await,
        Code::Unimplemented,
    )?;
    Ok(())
}

/// csi-sanity "ControllerExpandVolume": missing fields, an unknown volume, growth; and the
/// spec's idempotency ("already larger than or equal to the target capacity ... SHOULD reply
/// 0 OK"), OUT_OF_RANGE for what the pool cannot hold or a limit below the current size.
#[tokio::test]
async fn controller_expand_follows_the_spec() -> anyhow::Result<()> {
    let p = Plugin::start(&[
        "--mount-mode",
        "none",
        "--expansion",
        "online",
        "--controller-expand",
        "--capacity",
        "64Mi",
    ])
    .await?;
    let mut c = p.v1().await?;
    c.ctl.create_volume(create_req("v", 8 << 20)).await?;

    expect_code(
        c.ctl
            .controller_expand_volume(expand_req("", 16 << 20, 0))
            .await,
        Code::InvalidArgument,
    )?;
    let msg = expect_code(
        c.ctl
            .controller_expand_volume(v1::ControllerExpandVolumeRequest {
                volume_id: "v".into(),
                ..Default::default()
            })
            .await,
        Code::InvalidArgument,
    )?;
    assert!(msg.contains("capacity_range"), "{msg}");
    expect_code(
        c.ctl
            .controller_expand_volume(expand_req("nope", 16 << 20, 0))
            .await,
        Code::NotFound,
    )?;
    expect_code(
        c.ctl.controller_expand_volume(expand_req("v", -1, 0)).await,
        Code::InvalidArgument,
    )?;

    let r = c
        .ctl
        .controller_expand_volume(expand_req("v", 16 << 20, 0))
        .await?
        .into_inner();
    assert_eq!(r.capacity_bytes, 16 << 20);
    assert!(!r.node_expansion_required, "no --node-expand: no node step");
    // Repeated: the same answer.
    let again = c
        .ctl
        .controller_expand_volume(expand_req("v", 16 << 20, 0))
        .await?
        .into_inner();
    assert_eq!(again.capacity_bytes, 16 << 20);
    // Smaller: never shrinks, answers the current capacity.
    let smaller = c
        .ctl
        .controller_expand_volume(expand_req("v", 4 << 20, 0))
        .await?
        .into_inner();
    assert_eq!(smaller.capacity_bytes, 16 << 20);
    // The listing agrees.
    let listed = c
        .ctl
        .list_volumes(v1::ListVolumesRequest::default())
        .await?
        .into_inner();
    let cap = listed
        .entries
        .iter()
        .filter_map(|e| e.volume.as_ref())
        .find(|v| v.volume_id == "v")
        .map(|v| v.capacity_bytes);
    assert_eq!(cap, Some(16 << 20));

    // A limit below the current size, a size beyond the pool, more than is free.
    expect_code(
        c.ctl
            .controller_expand_volume(expand_req("v", 4 << 20, 8 << 20))
            .await,
        Code::OutOfRange,
    )?;
    expect_code(
        c.ctl
            .controller_expand_volume(expand_req("v", 1 << 30, 0))
            .await,
        Code::OutOfRange,
    )?;
    c.ctl.create_volume(create_req("w", 40 << 20)).await?;
    let msg = expect_code(
        c.ctl
            .controller_expand_volume(expand_req("v", 32 << 20, 0))
            .await,
        Code::OutOfRange,
    )?;
    assert!(msg.contains("free"), "{msg}");
    // Nothing changed by the refusals.
    let r = c
        .ctl
        .controller_expand_volume(expand_req("v", 0, 0))
        .await?
        .into_inner();
    assert_eq!(r.capacity_bytes, 16 << 20);
    Ok(())
}

/// OFFLINE: "Volume in use | 9 FAILED_PRECONDITION"; once unpublished, it grows.
#[tokio::test]
async fn offline_expansion_refuses_a_volume_in_use() -> anyhow::Result<()> {
    let p = Plugin::start(&[
        "--mount-mode",
        "none",
        "--expansion",
        "offline",
        "--controller-expand",
    ])
    .await?;
    let mut c = p.v1().await?;
    let staging = create_and_stage(&p, &mut c, "v").await?;
    let msg = expect_code(
        c.ctl
            .controller_expand_volume(expand_req("v", 4 << 20, 0))
            .await,
        Code::FailedPrecondition,
    )?;
    assert!(msg.contains("OFFLINE"), "{msg}");
    c.node
        .node_unstage_volume(unstage_req("v", &staging))
        .await?;
    c.ctl
        .controller_unpublish_volume(v1::ControllerUnpublishVolumeRequest {
            volume_id: "v".into(),
            node_id: NODE.into(),
            ..Default::default()
        })
        .await?;
    let r = c
        .ctl
        .controller_expand_volume(expand_req("v", 4 << 20, 0))
        .await?
        .into_inner();
    assert_eq!(r.capacity_bytes, 4 << 20);
    Ok(())
}

/// csi-sanity "NodeExpandVolume": missing volume id and path, an unknown volume, and an
/// expansion after publish; plus a path the volume is not at (NOT_FOUND), the node asked
/// for more than the controller grew (OUT_OF_RANGE), and `node_expansion_required`.
#[tokio::test]
async fn node_expand_follows_the_spec() -> anyhow::Result<()> {
    let p = Plugin::start(ONLINE_BOTH).await?;
    let mut c = p.v1().await?;
    let staging = create_and_stage(&p, &mut c, "v").await?;
    let target = p.path("target");
    c.node
        .node_publish_volume(publish_req("v", &staging, &target))
        .await?;

    expect_code(
        c.node
            .node_expand_volume(node_expand_req("", &target, 0))
            .await,
        Code::InvalidArgument,
    )?;
    let msg = expect_code(
        c.node
            .node_expand_volume(v1::NodeExpandVolumeRequest {
                volume_id: "v".into(),
                ..Default::default()
            })
            .await,
        Code::InvalidArgument,
    )?;
    assert!(msg.contains("volume_path"), "{msg}");
    expect_code(
        c.node
            .node_expand_volume(node_expand_req("nope", &target, 0))
            .await,
        Code::NotFound,
    )?;
    expect_code(
        c.node
            .node_expand_volume(node_expand_req("v", &p.path("elsewhere"), 0))
            .await,
        Code::NotFound,
    )?;

    let r = c
        .ctl
        .controller_expand_volume(expand_req("v", 4 << 20, 0))
        .await?
        .into_inner();
    assert!(r.node_expansion_required);
    expect_code(
        c.node
            .node_expand_volume(node_expand_req("v", &target, 8 << 20))
            .await,
        Code::OutOfRange,
    )?;
    for path in [&target, &staging, &target] {
        let n = c
            .node
            .node_expand_volume(node_expand_req("v", path, 4 << 20))
            .await?
            .into_inner();
        assert_eq!(n.capacity_bytes, 4 << 20);
    }
    let calls = p.calls_of("NodeExpandVolume")?;
    assert!(calls.len() >= 3, "the call log records NodeExpandVolume");
    Ok(())
}

/// A node-only plugin (no controller EXPAND_VOLUME) grows the volume itself in
/// NodeExpandVolume, and still never shrinks it.
#[tokio::test]
async fn a_node_only_plugin_grows_in_node_expand() -> anyhow::Result<()> {
    let p = Plugin::start(&[
        "--mount-mode",
        "none",
        "--expansion",
        "online",
        "--node-expand",
    ])
    .await?;
    let mut c = p.v1().await?;
    let staging = create_and_stage(&p, &mut c, "v").await?;
    let n = c
        .node
        .node_expand_volume(node_expand_req("v", &staging, 8 << 20))
        .await?
        .into_inner();
    assert_eq!(n.capacity_bytes, 8 << 20);
    let n = c
        .node
        .node_expand_volume(node_expand_req("v", &staging, 2 << 20))
        .await?
        .into_inner();
    assert_eq!(n.capacity_bytes, 8 << 20, "never shrinks");
    Ok(())
}
