//! Spec conformance of the v1 services, in `--mount-mode none` (no mount
//! syscalls, so these run anywhere): idempotency of every call and the error
//! codes of the spec's tables.

mod common;

use std::collections::{BTreeSet, HashMap};

use common::*;
use csi_proto::v1;
use tonic::Code;
use v1::volume_capability::access_mode::Mode;

const NONE: &[&str] = &["--mount-mode", "none"];

#[tokio::test]
async fn create_delete_are_idempotent() -> anyhow::Result<()> {
    let p = Plugin::start(NONE).await?;
    let mut c = p.v1().await?;
    let a = c
        .ctl
        .create_volume(create_req("vol-a", 10 << 20))
        .await?
        .into_inner();
    let b = c
        .ctl
        .create_volume(create_req("vol-a", 10 << 20))
        .await?
        .into_inner();
    let (a, b) = (a.volume.unwrap_or_default(), b.volume.unwrap_or_default());
    assert_eq!(a.volume_id, "vol-a");
    assert_eq!(a.volume_id, b.volume_id);
    assert!(a.capacity_bytes >= 10 << 20);
    assert!(p.work.join("volumes/vol-a").is_dir());

    // A compatible range (the existing size fits) is the same volume.
    let mut req = create_req("vol-a", 1 << 20);
    req.capacity_range = Some(v1::CapacityRange {
        required_bytes: 1 << 20,
        limit_bytes: 100 << 20,
    });
    c.ctl.create_volume(req).await?;

    for _ in 0..2 {
        c.ctl
            .delete_volume(v1::DeleteVolumeRequest {
                volume_id: "vol-a".into(),
                ..Default::default()
            })
            .await?;
    }
    assert!(!p.work.join("volumes/vol-a").exists());
    // Unknown and unrepresentable ids are "already deleted".
    for id in ["never-existed", "a/b", ".."] {
        c.ctl
            .delete_volume(v1::DeleteVolumeRequest {
                volume_id: id.into(),
                ..Default::default()
            })
            .await?;
    }
    Ok(())
}

#[tokio::test]
async fn create_volume_error_codes() -> anyhow::Result<()> {
    let p = Plugin::start(&["--mount-mode", "none", "--capacity", "1Gi"]).await?;
    let mut c = p.v1().await?;

    expect_code(
        c.ctl.create_volume(create_req("", 1)).await,
        Code::InvalidArgument,
    )?;
    let mut no_caps = create_req("x", 1);
    no_caps.volume_capabilities.clear();
    expect_code(c.ctl.create_volume(no_caps).await, Code::InvalidArgument)?;
    let mut no_mode = create_req("x", 1);
    no_mode.volume_capabilities[0].access_mode = None;
    expect_code(c.ctl.create_volume(no_mode).await, Code::InvalidArgument)?;
    let mut block = create_req("x", 1);
    block.volume_capabilities[0].access_type =
        Some(v1::volume_capability::AccessType::Block(Default::default()));
    expect_code(c.ctl.create_volume(block).await, Code::InvalidArgument)?;
    for bad in ["a/b", ".", "..", &"n".repeat(129)] {
        expect_code(
            c.ctl.create_volume(create_req(bad, 1)).await,
            Code::InvalidArgument,
        )?;
    }
    // The maximum-length name of csi-sanity works.
    c.ctl.create_volume(create_req(&"n".repeat(128), 1)).await?;

    let mut neg = create_req("x", 1);
    neg.capacity_range = Some(v1::CapacityRange {
        required_bytes: -1,
        limit_bytes: 0,
    });
    expect_code(c.ctl.create_volume(neg).await, Code::InvalidArgument)?;
    let mut inverted = create_req("x", 1);
    inverted.capacity_range = Some(v1::CapacityRange {
        required_bytes: 10,
        limit_bytes: 5,
    });
    expect_code(c.ctl.create_volume(inverted).await, Code::OutOfRange)?;
    let mut source = create_req("x", 1);
    source.volume_content_source = Some(v1::VolumeContentSource {
        r#type: Some(v1::volume_content_source::Type::Volume(
            v1::volume_content_source::VolumeSource {
                volume_id: "y".into(),
            },
        )),
    });
    expect_code(c.ctl.create_volume(source).await, Code::InvalidArgument)?;

    // Larger than the whole pool: the range is not allowed; larger than
    // what is free: exhausted for now.
    expect_code(
        c.ctl.create_volume(create_req("huge", 2 << 30)).await,
        Code::OutOfRange,
    )?;
    c.ctl.create_volume(create_req("big", 800 << 20)).await?;
    expect_code(
        c.ctl.create_volume(create_req("big2", 800 << 20)).await,
        Code::ResourceExhausted,
    )?;

    // Same name, incompatible capacity or parameters.
    let mut twice = create_req("big", 900 << 20);
    twice.capacity_range = Some(v1::CapacityRange {
        required_bytes: 900 << 20,
        limit_bytes: 900 << 20,
    });
    expect_code(c.ctl.create_volume(twice).await, Code::AlreadyExists)?;
    let mut params = create_req("big", 800 << 20);
    params.parameters = HashMap::from([("k".into(), "v".into())]);
    expect_code(c.ctl.create_volume(params).await, Code::AlreadyExists)?;
    Ok(())
}

#[tokio::test]
async fn capacity_list_and_pagination() -> anyhow::Result<()> {
    let p = Plugin::start(&[
        "--mount-mode",
        "none",
        "--capacity",
        "10Gi",
        "--volumes",
        "pre-1:1Gi,pre-2:2Gi",
    ])
    .await?;
    let mut c = p.v1().await?;
    let free = |r: v1::GetCapacityResponse| r.available_capacity;
    let cap0 = free(
        c.ctl
            .get_capacity(v1::GetCapacityRequest::default())
            .await?
            .into_inner(),
    );
    assert_eq!(cap0, 7 << 30);
    for i in 0..5 {
        c.ctl
            .create_volume(create_req(&format!("v{i}"), 1 << 20))
            .await?;
    }
    let cap1 = free(
        c.ctl
            .get_capacity(v1::GetCapacityRequest::default())
            .await?
            .into_inner(),
    );
    assert_eq!(cap1, cap0 - 5 * (1 << 20));

    let all = c
        .ctl
        .list_volumes(v1::ListVolumesRequest::default())
        .await?
        .into_inner();
    assert_eq!(all.entries.len(), 7);
    assert!(all.next_token.is_empty());

    // Paging with max_entries=3 visits every volume exactly once.
    let mut seen = BTreeSet::new();
    let mut token = String::new();
    loop {
        let page = c
            .ctl
            .list_volumes(v1::ListVolumesRequest {
                max_entries: 3,
                starting_token: token.clone(),
            })
            .await?
            .into_inner();
        assert!(page.entries.len() <= 3);
        for e in page.entries {
            assert!(seen.insert(e.volume.unwrap_or_default().volume_id));
        }
        if page.next_token.is_empty() {
            break;
        }
        token = page.next_token;
    }
    assert_eq!(seen.len(), 7);

    // A token stays valid when the last volume of its page is deleted.
    let first = c
        .ctl
        .list_volumes(v1::ListVolumesRequest {
            max_entries: 2,
            starting_token: String::new(),
        })
        .await?
        .into_inner();
    let last = first.entries[1]
        .volume
        .clone()
        .unwrap_or_default()
        .volume_id;
    c.ctl
        .delete_volume(v1::DeleteVolumeRequest {
            volume_id: last,
            ..Default::default()
        })
        .await?;
    let rest = c
        .ctl
        .list_volumes(v1::ListVolumesRequest {
            max_entries: 0,
            starting_token: first.next_token,
        })
        .await?
        .into_inner();
    assert_eq!(rest.entries.len(), 5, "7 volumes, 2 on the first page");

    expect_code(
        c.ctl
            .list_volumes(v1::ListVolumesRequest {
                max_entries: 0,
                starting_token: "invalid-token".into(),
            })
            .await,
        Code::Aborted,
    )?;
    expect_code(
        c.ctl
            .list_volumes(v1::ListVolumesRequest {
                max_entries: -1,
                starting_token: String::new(),
            })
            .await,
        Code::InvalidArgument,
    )?;
    Ok(())
}

#[tokio::test]
async fn validate_volume_capabilities() -> anyhow::Result<()> {
    let p = Plugin::start(NONE).await?;
    let mut c = p.v1().await?;
    c.ctl.create_volume(create_req("v", 1)).await?;
    let req = |id: &str, caps: Vec<v1::VolumeCapability>| v1::ValidateVolumeCapabilitiesRequest {
        volume_id: id.into(),
        volume_capabilities: caps,
        ..Default::default()
    };
    let ok = c
        .ctl
        .validate_volume_capabilities(req("v", vec![snw(), cap(Mode::MultiNodeReaderOnly)]))
        .await?
        .into_inner();
    assert_eq!(
        ok.confirmed.map(|c| c.volume_capabilities.len()),
        Some(2),
        "{}",
        ok.message
    );
    let mut block = snw();
    block.access_type = Some(v1::volume_capability::AccessType::Block(Default::default()));
    let no = c
        .ctl
        .validate_volume_capabilities(req("v", vec![snw(), block]))
        .await?
        .into_inner();
    assert!(no.confirmed.is_none());
    assert!(!no.message.is_empty());
    expect_code(
        c.ctl
            .validate_volume_capabilities(req("", vec![snw()]))
            .await,
        Code::InvalidArgument,
    )?;
    expect_code(
        c.ctl.validate_volume_capabilities(req("v", vec![])).await,
        Code::InvalidArgument,
    )?;
    expect_code(
        c.ctl
            .validate_volume_capabilities(req("nope", vec![snw()]))
            .await,
        Code::NotFound,
    )?;
    Ok(())
}

#[tokio::test]
async fn controller_publish_rules() -> anyhow::Result<()> {
    let p = Plugin::start(NONE).await?;
    let mut c = p.v1().await?;
    c.ctl.create_volume(create_req("v", 1)).await?;

    expect_code(
        c.ctl
            .controller_publish_volume(v1::ControllerPublishVolumeRequest::default())
            .await,
        Code::InvalidArgument,
    )?;
    let mut no_node = cpub_req("v");
    no_node.node_id.clear();
    expect_code(
        c.ctl.controller_publish_volume(no_node).await,
        Code::InvalidArgument,
    )?;
    let mut no_cap = cpub_req("does-not-exist");
    no_cap.volume_capability = None;
    expect_code(
        c.ctl.controller_publish_volume(no_cap).await,
        Code::InvalidArgument,
    )?;
    expect_code(
        c.ctl
            .controller_publish_volume(cpub_req("does-not-exist"))
            .await,
        Code::NotFound,
    )?;
    let mut other_node = cpub_req("v");
    other_node.node_id = "some-other-node".into();
    expect_code(
        c.ctl.controller_publish_volume(other_node).await,
        Code::NotFound,
    )?;

    let a = c
        .ctl
        .controller_publish_volume(cpub_req("v"))
        .await?
        .into_inner();
    let b = c
        .ctl
        .controller_publish_volume(cpub_req("v"))
        .await?
        .into_inner();
    assert_eq!(a.publish_context, b.publish_context);
    assert!(a.publish_context.contains_key("device"));
    let mut ro = cpub_req("v");
    ro.readonly = true;
    expect_code(
        c.ctl.controller_publish_volume(ro).await,
        Code::AlreadyExists,
    )?;

    // Published volumes cannot be deleted ("Volume in use").
    expect_code(
        c.ctl
            .delete_volume(v1::DeleteVolumeRequest {
                volume_id: "v".into(),
                ..Default::default()
            })
            .await,
        Code::FailedPrecondition,
    )?;
    let listed = c
        .ctl
        .list_volumes(v1::ListVolumesRequest::default())
        .await?
        .into_inner();
    let status = listed.entries[0].status.clone().unwrap_or_default();
    assert_eq!(status.published_node_ids, vec![NODE.to_owned()]);

    let unpub = |id: &str, node: &str| v1::ControllerUnpublishVolumeRequest {
        volume_id: id.into(),
        node_id: node.into(),
        ..Default::default()
    };
    for _ in 0..2 {
        c.ctl.controller_unpublish_volume(unpub("v", NODE)).await?;
    }
    c.ctl
        .controller_unpublish_volume(unpub("gone", NODE))
        .await?;
    c.ctl.controller_unpublish_volume(unpub("v", "")).await?;
    expect_code(
        c.ctl.controller_unpublish_volume(unpub("", NODE)).await,
        Code::InvalidArgument,
    )?;
    Ok(())
}

#[tokio::test]
async fn node_lifecycle_is_idempotent_v1_target_rules() -> anyhow::Result<()> {
    let p = Plugin::start(NONE).await?;
    let mut c = p.v1().await?;
    let staging = create_and_stage(&p, &mut c, "v").await?;
    // Stage again with the same arguments: OK.
    c.node.node_stage_volume(stage_req("v", &staging)).await?;

    // CSI v1: the CO creates the parent, the plugin creates the target.
    let parent = p.mkdir("pods")?;
    let target = parent.join("target");
    for _ in 0..2 {
        c.node
            .node_publish_volume(publish_req("v", &staging, &target))
            .await?;
        assert!(target.is_dir());
    }
    // Publishing with another readonly flag at the same target.
    let mut ro = publish_req("v", &staging, &target);
    ro.readonly = true;
    expect_code(c.node.node_publish_volume(ro).await, Code::AlreadyExists)?;
    // A second target for a SINGLE_NODE_WRITER volume.
    expect_code(
        c.node
            .node_publish_volume(publish_req("v", &staging, &parent.join("t2")))
            .await,
        Code::FailedPrecondition,
    )?;
    // The parent must exist (single mkdir).
    expect_code(
        c.node
            .node_publish_volume(publish_req("v", &staging, &p.path("no/such/parent/t")))
            .await,
        Code::FailedPrecondition,
    )?;
    // Unstage while published is refused, and so is controller unpublish.
    expect_code(
        c.node.node_unstage_volume(unstage_req("v", &staging)).await,
        Code::FailedPrecondition,
    )?;
    expect_code(
        c.ctl
            .controller_unpublish_volume(v1::ControllerUnpublishVolumeRequest {
                volume_id: "v".into(),
                node_id: NODE.into(),
                ..Default::default()
            })
            .await,
        Code::FailedPrecondition,
    )?;

    for _ in 0..2 {
        c.node
            .node_unpublish_volume(unpublish_req("v", &target))
            .await?;
        assert!(
            !target.exists(),
            "v1: the plugin removes the target it created"
        );
    }
    assert!(parent.is_dir());
    for _ in 0..2 {
        c.node
            .node_unstage_volume(unstage_req("v", &staging))
            .await?;
    }
    assert!(staging.is_dir(), "the staging dir belongs to the CO");
    c.ctl
        .controller_unpublish_volume(v1::ControllerUnpublishVolumeRequest {
            volume_id: "v".into(),
            node_id: NODE.into(),
            ..Default::default()
        })
        .await?;
    c.ctl
        .delete_volume(v1::DeleteVolumeRequest {
            volume_id: "v".into(),
            ..Default::default()
        })
        .await?;
    Ok(())
}

#[tokio::test]
async fn node_error_codes() -> anyhow::Result<()> {
    let p = Plugin::start(NONE).await?;
    let mut c = p.v1().await?;
    let staging = p.mkdir("staging")?;
    let target = p.path("target");

    // Missing required fields.
    expect_code(
        c.node.node_stage_volume(stage_req("", &staging)).await,
        Code::InvalidArgument,
    )?;
    let mut no_path = stage_req("x", &staging);
    no_path.staging_target_path.clear();
    expect_code(
        c.node.node_stage_volume(no_path).await,
        Code::InvalidArgument,
    )?;
    let mut no_cap = stage_req("x", &staging);
    no_cap.volume_capability = None;
    expect_code(
        c.node.node_stage_volume(no_cap).await,
        Code::InvalidArgument,
    )?;
    let mut relative = stage_req("x", &staging);
    relative.staging_target_path = "relative/path".into();
    expect_code(
        c.node.node_stage_volume(relative).await,
        Code::InvalidArgument,
    )?;
    expect_code(
        c.node
            .node_publish_volume(publish_req("", &staging, &target))
            .await,
        Code::InvalidArgument,
    )?;
    let mut no_target = publish_req("x", &staging, &target);
    no_target.target_path.clear();
    expect_code(
        c.node.node_publish_volume(no_target).await,
        Code::InvalidArgument,
    )?;
    let mut no_cap = publish_req("x", &staging, &target);
    no_cap.volume_capability = None;
    expect_code(
        c.node.node_publish_volume(no_cap).await,
        Code::InvalidArgument,
    )?;
    expect_code(
        c.node
            .node_unpublish_volume(unpublish_req("", &target))
            .await,
        Code::InvalidArgument,
    )?;
    expect_code(
        c.node
            .node_unpublish_volume(v1::NodeUnpublishVolumeRequest {
                volume_id: "x".into(),
                target_path: String::new(),
            })
            .await,
        Code::InvalidArgument,
    )?;
    expect_code(
        c.node.node_unstage_volume(unstage_req("", &staging)).await,
        Code::InvalidArgument,
    )?;
    expect_code(
        c.node
            .node_unstage_volume(v1::NodeUnstageVolumeRequest {
                volume_id: "x".into(),
                staging_target_path: String::new(),
            })
            .await,
        Code::InvalidArgument,
    )?;

    // Unknown volume.
    expect_code(
        c.node.node_stage_volume(stage_req("nope", &staging)).await,
        Code::NotFound,
    )?;
    expect_code(
        c.node
            .node_publish_volume(publish_req("nope", &staging, &target))
            .await,
        Code::NotFound,
    )?;
    expect_code(
        c.node
            .node_unpublish_volume(unpublish_req("nope", &target))
            .await,
        Code::NotFound,
    )?;
    expect_code(
        c.node
            .node_unstage_volume(unstage_req("nope", &staging))
            .await,
        Code::NotFound,
    )?;

    c.ctl.create_volume(create_req("v", 1)).await?;
    // Stage before ControllerPublish.
    expect_code(
        c.node.node_stage_volume(stage_req("v", &staging)).await,
        Code::FailedPrecondition,
    )?;
    c.ctl.controller_publish_volume(cpub_req("v")).await?;
    // Publish before stage, and without a staging path.
    expect_code(
        c.node
            .node_publish_volume(publish_req("v", &staging, &target))
            .await,
        Code::FailedPrecondition,
    )?;
    let mut unstaged = publish_req("v", &staging, &target);
    unstaged.staging_target_path.clear();
    expect_code(
        c.node.node_publish_volume(unstaged).await,
        Code::FailedPrecondition,
    )?;
    // A staging dir the CO did not create.
    expect_code(
        c.node
            .node_stage_volume(stage_req("v", &p.path("missing-staging")))
            .await,
        Code::FailedPrecondition,
    )?;
    // Block is not supported by the volume ("Exceeds capabilities").
    let mut block = stage_req("v", &staging);
    block.volume_capability = Some(v1::VolumeCapability {
        access_type: Some(v1::volume_capability::AccessType::Block(Default::default())),
        ..snw()
    });
    expect_code(
        c.node.node_stage_volume(block).await,
        Code::FailedPrecondition,
    )?;

    c.node.node_stage_volume(stage_req("v", &staging)).await?;
    let mut other_cap = stage_req("v", &staging);
    other_cap.volume_capability = Some(cap(Mode::MultiNodeMultiWriter));
    expect_code(
        c.node.node_stage_volume(other_cap).await,
        Code::AlreadyExists,
    )?;
    expect_code(
        c.node
            .node_stage_volume(stage_req("v", &p.mkdir("staging-2")?))
            .await,
        Code::FailedPrecondition,
    )?;

    // Not published / not staged there: OK (idempotent negation).
    c.node
        .node_unpublish_volume(unpublish_req("v", &target))
        .await?;
    c.node
        .node_unstage_volume(unstage_req("v", &p.path("elsewhere")))
        .await?;
    Ok(())
}

#[tokio::test]
async fn multi_node_volume_publishes_at_two_targets() -> anyhow::Result<()> {
    let p = Plugin::start(&["--mount-mode", "none", "--no-stage-unstage"]).await?;
    let mut c = p.v1().await?;
    let mut req = create_req("shared", 1);
    req.volume_capabilities = vec![cap(Mode::MultiNodeMultiWriter)];
    c.ctl.create_volume(req).await?;
    let mut cp = cpub_req("shared");
    cp.volume_capability = Some(cap(Mode::MultiNodeMultiWriter));
    c.ctl.controller_publish_volume(cp).await?;
    let parent = p.mkdir("pods")?;
    for t in ["t1", "t2"] {
        let mut r = publish_req("shared", &p.path("unused"), &parent.join(t));
        r.staging_target_path.clear();
        r.volume_capability = Some(cap(Mode::MultiNodeMultiWriter));
        c.node.node_publish_volume(r).await?;
    }
    assert!(parent.join("t1").is_dir() && parent.join("t2").is_dir());
    Ok(())
}

#[tokio::test]
async fn capabilities_follow_switches() -> anyhow::Result<()> {
    let p = Plugin::start(NONE).await?;
    let mut c = p.v1().await?;
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
    assert!(ctl.contains(&2), "PUBLISH_UNPUBLISH_VOLUME in {ctl:?}");
    let node = c
        .node
        .node_get_capabilities(v1::NodeGetCapabilitiesRequest {})
        .await?
        .into_inner();
    assert_eq!(node.capabilities.len(), 1);
    let info = c
        .node
        .node_get_info(v1::NodeGetInfoRequest {})
        .await?
        .into_inner();
    assert_eq!(info.node_id, NODE);

    let p = Plugin::start(&[
        "--mount-mode",
        "none",
        "--no-stage-unstage",
        "--no-controller-publish",
    ])
    .await?;
    let mut c = p.v1().await?;
    let ctl = c
        .ctl
        .controller_get_capabilities(v1::ControllerGetCapabilitiesRequest {})
        .await?
        .into_inner();
    assert_eq!(ctl.capabilities.len(), 3);
    let node = c
        .node
        .node_get_capabilities(v1::NodeGetCapabilitiesRequest {})
        .await?
        .into_inner();
    assert!(node.capabilities.is_empty());
    c.ctl.create_volume(create_req("v", 1)).await?;
    expect_code(
        c.ctl.controller_publish_volume(cpub_req("v")).await,
        Code::Unimplemented,
    )?;
    expect_code(
        c.node
            .node_stage_volume(stage_req("v", &p.mkdir("s")?))
            .await,
        Code::Unimplemented,
    )?;
    // Without staging and controller publish, publish goes straight.
    let target = p.mkdir("pods")?.join("t");
    let mut r = publish_req("v", &p.path("s"), &target);
    r.staging_target_path.clear();
    c.node.node_publish_volume(r).await?;
    c.node
        .node_unpublish_volume(unpublish_req("v", &target))
        .await?;
    assert!(!target.exists());
    Ok(())
}

/// `--mount-mode none` needs no privilege: run the whole lifecycle as
/// `nobody` when the tests run as root.
#[tokio::test]
async fn none_mode_runs_unprivileged() -> anyhow::Result<()> {
    let uid = rustix::process::geteuid().is_root().then_some(65534);
    let p = Plugin::start_as(NONE, uid).await?;
    let mut c = p.v1().await?;
    let staging = create_and_stage(&p, &mut c, "v").await?;
    let target = p.mkdir("pods")?.join("t");
    c.node
        .node_publish_volume(publish_req("v", &staging, &target))
        .await?;
    assert!(target.is_dir());
    c.node
        .node_unpublish_volume(unpublish_req("v", &target))
        .await?;
    c.node
        .node_unstage_volume(unstage_req("v", &staging))
        .await?;
    if let Some(uid) = uid {
        use std::os::unix::fs::MetadataExt;
        assert_eq!(std::fs::metadata(p.work.join("state.json"))?.uid(), uid);
    }
    Ok(())
}
