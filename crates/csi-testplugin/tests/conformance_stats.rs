//! Spec conformance of NodeGetVolumeStats (`--volume-stats`) and the volume
//! condition (`--volume-condition`), in `--mount-mode none` (no mount
//! syscalls, so these run anywhere): the cases csi-sanity's
//! "NodeGetVolumeStats" specs check — missing required fields, unknown
//! volumes, a path the volume is not at, repeated calls — plus what a CO
//! relies on: the capability is advertised only when enabled, and the
//! injected condition is reported and cleared.

mod common;

use common::*;
use csi_proto::v1;
use tonic::Code;
use v1::node_service_capability::rpc::Type as NodeCap;
use v1::volume_usage::Unit;

const STATS: &[&str] = &["--mount-mode", "none", "--volume-stats"];
const HEALTH: &[&str] = &[
    "--mount-mode",
    "none",
    "--volume-stats",
    "--volume-condition",
];

fn stats_req(id: &str, path: &std::path::Path) -> v1::NodeGetVolumeStatsRequest {
    v1::NodeGetVolumeStatsRequest {
        volume_id: id.to_owned(),
        volume_path: path.display().to_string(),
        staging_target_path: String::new(),
    }
}

async fn node_caps(c: &mut V1) -> anyhow::Result<Vec<i32>> {
    Ok(c.node
        .node_get_capabilities(v1::NodeGetCapabilitiesRequest {})
        .await?
        .into_inner()
        .capabilities
        .into_iter()
        .filter_map(|c| match c.r#type {
            Some(v1::node_service_capability::Type::Rpc(r)) => Some(r.r#type),
            _ => None,
        })
        .collect())
}

/// Creates, stages and publishes `id`; returns (staging, target).
async fn published(
    p: &Plugin,
    c: &mut V1,
    id: &str,
) -> anyhow::Result<(std::path::PathBuf, std::path::PathBuf)> {
    let staging = create_and_stage(p, c, id).await?;
    let target = p.dir.path().join(format!("target-{id}"));
    c.node
        .node_publish_volume(publish_req(id, &staging, &target))
        .await?;
    Ok((staging, target))
}

async fn condition_of(
    c: &mut V1,
    id: &str,
    path: &std::path::Path,
) -> anyhow::Result<Option<v1::VolumeCondition>> {
    Ok(c.node
        .node_get_volume_stats(stats_req(id, path))
        .await?
        .into_inner()
        .volume_condition)
}

fn usage(r: &v1::NodeGetVolumeStatsResponse, unit: Unit) -> Option<v1::VolumeUsage> {
    r.usage.iter().find(|u| u.unit == unit as i32).cloned()
}

#[tokio::test]
async fn capabilities_are_off_by_default_and_switchable() -> anyhow::Result<()> {
    let p = Plugin::start(&["--mount-mode", "none"]).await?;
    let mut c = p.v1().await?;
    let caps = node_caps(&mut c).await?;
    assert!(
        !caps.contains(&(NodeCap::GetVolumeStats as i32)),
        "{caps:?}"
    );
    assert!(
        !caps.contains(&(NodeCap::VolumeCondition as i32)),
        "{caps:?}"
    );
    // Without the capability the RPC is not served.
    let (_, target) = published(&p, &mut c, "v").await?;
    expect_code(
        c.node.node_get_volume_stats(stats_req("v", &target)).await,
        Code::Unimplemented,
    )?;

    let p = Plugin::start(HEALTH).await?;
    let mut c = p.v1().await?;
    let caps = node_caps(&mut c).await?;
    assert!(caps.contains(&(NodeCap::GetVolumeStats as i32)), "{caps:?}");
    assert!(
        caps.contains(&(NodeCap::VolumeCondition as i32)),
        "{caps:?}"
    );
    Ok(())
}

#[tokio::test]
async fn stats_at_target_and_staging_path_are_repeatable() -> anyhow::Result<()> {
    let p = Plugin::start(STATS).await?;
    let mut c = p.v1().await?;
    let (staging, target) = published(&p, &mut c, "v").await?;
    let a = c
        .node
        .node_get_volume_stats(stats_req("v", &target))
        .await?
        .into_inner();
    let bytes = usage(&a, Unit::Bytes).ok_or_else(|| anyhow::anyhow!("no BYTES: {a:?}"))?;
    let inodes = usage(&a, Unit::Inodes).ok_or_else(|| anyhow::anyhow!("no INODES: {a:?}"))?;
    for u in [&bytes, &inodes] {
        assert!(u.total > 0 && u.used >= 0 && u.available >= 0, "{u:?}");
        assert!(u.used <= u.total && u.available <= u.total, "{u:?}");
    }
    assert!(
        a.volume_condition.is_none(),
        "no condition without --volume-condition: {a:?}"
    );
    // The staging path is a path the volume is at too ("any valid path where
    // volume was previously staged or published").
    let b = c
        .node
        .node_get_volume_stats(stats_req("v", &staging))
        .await?
        .into_inner();
    assert_eq!(usage(&b, Unit::Bytes).map(|u| u.total), Some(bytes.total));
    // Unpublished, the target is no longer a path the volume is at.
    c.node
        .node_unpublish_volume(unpublish_req("v", &target))
        .await?;
    expect_code(
        c.node.node_get_volume_stats(stats_req("v", &target)).await,
        Code::NotFound,
    )?;
    Ok(())
}

#[tokio::test]
async fn missing_fields_are_invalid_argument() -> anyhow::Result<()> {
    let p = Plugin::start(STATS).await?;
    let mut c = p.v1().await?;
    let (_, target) = published(&p, &mut c, "v").await?;
    let mut r = stats_req("v", &target);
    r.volume_id.clear();
    let msg = expect_code(c.node.node_get_volume_stats(r).await, Code::InvalidArgument)?;
    assert!(msg.contains("volume_id"), "{msg}");
    let mut r = stats_req("v", &target);
    r.volume_path.clear();
    let msg = expect_code(c.node.node_get_volume_stats(r).await, Code::InvalidArgument)?;
    assert!(msg.contains("volume_path"), "{msg}");
    let mut r = stats_req("v", &target);
    r.volume_path = "relative/path".into();
    expect_code(c.node.node_get_volume_stats(r).await, Code::InvalidArgument)?;
    // Each refusal is answered before anything is measured: all in the log as errors.
    let logged = p.calls_of("NodeGetVolumeStats")?;
    assert_eq!(logged.len(), 3, "{logged:?}");
    Ok(())
}

#[tokio::test]
async fn unknown_volume_or_path_is_not_found() -> anyhow::Result<()> {
    let p = Plugin::start(STATS).await?;
    let mut c = p.v1().await?;
    let (_, target) = published(&p, &mut c, "v").await?;
    // csi-sanity: "should fail when volume is not found".
    let msg = expect_code(
        c.node
            .node_get_volume_stats(stats_req("no-such-volume", &target))
            .await,
        Code::NotFound,
    )?;
    assert!(msg.contains("no-such-volume"), "{msg}");
    // csi-sanity: "should fail when volume does not exist on the specified path".
    let elsewhere = p.mkdir("elsewhere")?;
    expect_code(
        c.node
            .node_get_volume_stats(stats_req("v", &elsewhere))
            .await,
        Code::NotFound,
    )?;
    // A volume that exists but was never staged or published anywhere.
    c.ctl.create_volume(create_req("idle", 1 << 20)).await?;
    expect_code(
        c.node
            .node_get_volume_stats(stats_req("idle", &target))
            .await,
        Code::NotFound,
    )?;
    Ok(())
}

#[tokio::test]
async fn injected_abnormal_condition_is_reported_and_cleared() -> anyhow::Result<()> {
    let p = Plugin::start(HEALTH).await?;
    let mut c = p.v1().await?;
    let (_, target) = published(&p, &mut c, "v").await?;
    let (_, other) = published(&p, &mut c, "w").await?;
    let normal = Some(v1::VolumeCondition {
        abnormal: false,
        message: String::new(),
    });
    assert_eq!(condition_of(&mut c, "v", &target).await?, normal);
    p.write_faults(r#"{"abnormal": {"v": "disk on fire"}}"#)?;
    assert_eq!(
        condition_of(&mut c, "v", &target).await?,
        Some(v1::VolumeCondition {
            abnormal: true,
            message: "disk on fire".into()
        })
    );
    // Only the named volume is abnormal.
    assert_eq!(condition_of(&mut c, "w", &other).await?, normal);
    p.write_faults(r#"{"abnormal": {}}"#)?;
    assert_eq!(condition_of(&mut c, "v", &target).await?, normal);
    Ok(())
}
