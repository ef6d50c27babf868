//! Spec conformance of topology (`--topology`), the per-node volume limit
//! (`--max-volumes-per-node`) and ControllerGetVolume (`--get-volume`), in
//! `--mount-mode none`: the cases csi-sanity checks for these RPCs, and that
//! a plugin without the flags advertises and answers none of it.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::collections::HashMap;

use common::*;
use csi_proto::v1;
use tonic::Code;

const TOPO: &[&str] = &[
    "--mount-mode",
    "none",
    "--topology",
    "zone=a,rack=1",
    "--max-volumes-per-node",
    "2",
    "--get-volume",
];

fn topo(pairs: &[(&str, &str)]) -> v1::Topology {
    v1::Topology {
        segments: pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect(),
    }
}

fn ours() -> v1::Topology {
    topo(&[("zone", "a"), ("rack", "1")])
}

async fn plugin_caps(c: &mut V1) -> anyhow::Result<Vec<i32>> {
    use v1::plugin_capability::Type;
    Ok(c.id
        .get_plugin_capabilities(v1::GetPluginCapabilitiesRequest {})
        .await?
        .into_inner()
        .capabilities
        .into_iter()
        .filter_map(|cap| match cap.r#type {
            Some(Type::Service(s)) => Some(s.r#type),
            _ => None,
        })
        .collect())
}

async fn controller_caps(c: &mut V1) -> anyhow::Result<Vec<i32>> {
    use v1::controller_service_capability::Type;
    Ok(c.ctl
        .controller_get_capabilities(v1::ControllerGetCapabilitiesRequest {})
        .await?
        .into_inner()
        .capabilities
        .into_iter()
        .filter_map(|cap| match cap.r#type {
            Some(Type::Rpc(r)) => Some(r.r#type),
            _ => None,
        })
        .collect())
}

#[tokio::test]
async fn node_info_and_capabilities_carry_topology_and_limit() -> anyhow::Result<()> {
    use v1::controller_service_capability::rpc::Type as Rpc;
    use v1::plugin_capability::service::Type as Svc;
    let p = Plugin::start(TOPO).await?;
    let mut c = p.v1().await?;
    assert!(
        plugin_caps(&mut c)
            .await?
            .contains(&(Svc::VolumeAccessibilityConstraints as i32))
    );
    assert!(
        controller_caps(&mut c)
            .await?
            .contains(&(Rpc::GetVolume as i32))
    );
    let info = c
        .node
        .node_get_info(v1::NodeGetInfoRequest {})
        .await?
        .into_inner();
    assert_eq!(info.node_id, NODE);
    assert_eq!(info.max_volumes_per_node, 2);
    assert_eq!(info.accessible_topology, Some(ours()));

    // The same plugin without the flags: nothing advertised, nothing answered.
    let bare = Plugin::start(&["--mount-mode", "none"]).await?;
    let mut b = bare.v1().await?;
    assert!(
        !plugin_caps(&mut b)
            .await?
            .contains(&(Svc::VolumeAccessibilityConstraints as i32))
    );
    assert!(
        !controller_caps(&mut b)
            .await?
            .contains(&(Rpc::GetVolume as i32))
    );
    let info = b
        .node
        .node_get_info(v1::NodeGetInfoRequest {})
        .await?
        .into_inner();
    assert_eq!(
        (info.max_volumes_per_node, info.accessible_topology),
        (0, None)
    );
    expect_code(
        b.ctl
            .controller_get_volume(v1::ControllerGetVolumeRequest {
                volume_id: "x".into(),
            })
            .await,
        Code::Unimplemented,
    )?;
    Ok(())
}

#[tokio::test]
async fn create_honours_accessibility_requirements() -> anyhow::Result<()> {
    let p = Plugin::start(TOPO).await?;
    let mut c = p.v1().await?;

    // Requisite containing our topology (among others), preferred elsewhere.
    let mut req = create_req("vol-a", 1 << 20);
    req.accessibility_requirements = Some(v1::TopologyRequirement {
        requisite: vec![topo(&[("zone", "b")]), ours()],
        preferred: vec![topo(&[("zone", "b")])],
    });
    let v = c
        .ctl
        .create_volume(req.clone())
        .await?
        .into_inner()
        .volume
        .unwrap();
    // "accessible_topology ... Specifies where ... the provisioned volume is accessible from."
    assert_eq!(v.accessible_topology, vec![ours()]);
    // Idempotent repeat.
    let again = c.ctl.create_volume(req).await?.into_inner().volume.unwrap();
    assert_eq!(again.volume_id, v.volume_id);

    // A partial segment map of ours is served too (zone only).
    let mut req = create_req("vol-zone", 1 << 20);
    req.accessibility_requirements = Some(v1::TopologyRequirement {
        requisite: vec![topo(&[("zone", "a")])],
        preferred: Vec::new(),
    });
    c.ctl.create_volume(req).await?;

    // A requisite excluding us: RESOURCE_EXHAUSTED, and no volume made.
    let mut req = create_req("vol-b", 1 << 20);
    req.accessibility_requirements = Some(v1::TopologyRequirement {
        requisite: vec![topo(&[("zone", "b"), ("rack", "1")])],
        preferred: vec![topo(&[("zone", "b"), ("rack", "1")])],
    });
    let msg = expect_code(c.ctl.create_volume(req).await, Code::ResourceExhausted)?;
    assert!(msg.contains("zone") && msg.contains("\"a\""), "{msg}");
    assert!(!p.work.join("volumes/vol-b").exists());

    // The call log records what was asked, for the CO-side tests.
    let logged = p.calls_of("CreateVolume")?;
    let last = logged.last().unwrap();
    assert_eq!(last["code"], "RESOURCE_EXHAUSTED");
    assert_eq!(last["topology"]["requisite"][0]["zone"], "b");
    let first = &logged[0];
    assert_eq!(first["topology"]["requisite"][1]["rack"], "1");
    // A create without requirements logs none.
    c.ctl.create_volume(create_req("vol-c", 1 << 20)).await?;
    let last = p.calls_of("CreateVolume")?.pop().unwrap();
    assert!(last.get("topology").is_none(), "{last}");
    Ok(())
}

#[tokio::test]
async fn capacity_of_a_foreign_topology_is_zero() -> anyhow::Result<()> {
    let p = Plugin::start(TOPO).await?;
    let mut c = p.v1().await?;
    let cap = |t: Option<v1::Topology>| v1::GetCapacityRequest {
        accessible_topology: t,
        ..Default::default()
    };
    let all = c
        .ctl
        .get_capacity(cap(None))
        .await?
        .into_inner()
        .available_capacity;
    assert!(all > 0);
    let here = c.ctl.get_capacity(cap(Some(ours()))).await?.into_inner();
    assert_eq!(here.available_capacity, all);
    for foreign in [
        topo(&[("zone", "b")]),
        topo(&[("zone", "a"), ("rack", "2")]),
        topo(&[("region", "x")]),
    ] {
        let r = c
            .ctl
            .get_capacity(cap(Some(foreign.clone())))
            .await?
            .into_inner();
        assert_eq!(r.available_capacity, 0, "{foreign:?}");
    }
    Ok(())
}

#[tokio::test]
async fn controller_get_volume_reports_published_nodes() -> anyhow::Result<()> {
    let p = Plugin::start(TOPO).await?;
    let mut c = p.v1().await?;
    let get = |id: &str| v1::ControllerGetVolumeRequest {
        volume_id: id.to_owned(),
    };
    // "Volume does not exist | 5 NOT_FOUND"; a missing volume_id is INVALID_ARGUMENT.
    expect_code(
        c.ctl.controller_get_volume(get("nope")).await,
        Code::NotFound,
    )?;
    expect_code(
        c.ctl.controller_get_volume(get("")).await,
        Code::InvalidArgument,
    )?;

    c.ctl.create_volume(create_req("vol-a", 4 << 20)).await?;
    let r = c
        .ctl
        .controller_get_volume(get("vol-a"))
        .await?
        .into_inner();
    let (vol, status) = (r.volume.unwrap(), r.status.unwrap());
    assert_eq!(
        (vol.volume_id.as_str(), vol.capacity_bytes),
        ("vol-a", 4 << 20)
    );
    assert_eq!(vol.accessible_topology, vec![ours()]);
    assert!(status.published_node_ids.is_empty());

    c.ctl.controller_publish_volume(cpub_req("vol-a")).await?;
    for _ in 0..2 {
        let s = c
            .ctl
            .controller_get_volume(get("vol-a"))
            .await?
            .into_inner()
            .status
            .unwrap();
        assert_eq!(s.published_node_ids, vec![NODE.to_owned()]);
    }
    c.ctl
        .controller_unpublish_volume(v1::ControllerUnpublishVolumeRequest {
            volume_id: "vol-a".into(),
            node_id: NODE.into(),
            ..Default::default()
        })
        .await?;
    let s = c
        .ctl
        .controller_get_volume(get("vol-a"))
        .await?
        .into_inner()
        .status
        .unwrap();
    assert!(s.published_node_ids.is_empty());
    Ok(())
}

#[tokio::test]
async fn controller_publish_beyond_max_volumes_is_resource_exhausted() -> anyhow::Result<()> {
    let p = Plugin::start(TOPO).await?;
    let mut c = p.v1().await?;
    for id in ["v1", "v2", "v3"] {
        c.ctl.create_volume(create_req(id, 1 << 20)).await?;
    }
    c.ctl.controller_publish_volume(cpub_req("v1")).await?;
    c.ctl.controller_publish_volume(cpub_req("v2")).await?;
    // Republishing an attached volume is idempotent, not one more.
    c.ctl.controller_publish_volume(cpub_req("v2")).await?;
    // "Max volumes attached | 8 RESOURCE_EXHAUSTED".
    let msg = expect_code(
        c.ctl.controller_publish_volume(cpub_req("v3")).await,
        Code::ResourceExhausted,
    )?;
    assert!(
        msg.contains("max_volumes_per_node 2") && msg.contains("v1"),
        "{msg}"
    );
    let listed: HashMap<String, Vec<String>> = c
        .ctl
        .list_volumes(v1::ListVolumesRequest::default())
        .await?
        .into_inner()
        .entries
        .into_iter()
        .map(|e| {
            (
                e.volume.unwrap().volume_id,
                e.status.unwrap().published_node_ids,
            )
        })
        .collect();
    assert!(listed["v3"].is_empty());
    Ok(())
}

#[tokio::test]
async fn bad_topology_flags_are_refused() -> anyhow::Result<()> {
    for bad in [
        &["--topology", "zone"][..],
        &["--topology", "zone=a,zone=b"],
        &["--max-volumes-per-node", "-1"],
    ] {
        let mut args = vec!["--mount-mode", "none"];
        args.extend_from_slice(bad);
        assert!(Plugin::start(&args).await.is_err(), "{bad:?} was accepted");
    }
    Ok(())
}
