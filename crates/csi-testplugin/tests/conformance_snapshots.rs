//! Spec conformance of snapshots and clones (`--snapshots`, `--clones`), in
//! `--mount-mode none` (volumes are plain directories, so these run
//! anywhere): the cases csi-sanity checks for CreateSnapshot, DeleteSnapshot,
//! ListSnapshots and CreateVolume from a source, and that the data really
//! is copied, symbolic links as links.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::collections::BTreeSet;
use std::path::Path;

use common::*;
use csi_proto::v1;
use tonic::Code;

const ON: &[&str] = &["--mount-mode", "none", "--snapshots", "--clones"];

fn snap_req(name: &str, source: &str) -> v1::CreateSnapshotRequest {
    v1::CreateSnapshotRequest {
        name: name.into(),
        source_volume_id: source.into(),
        ..Default::default()
    }
}

/// A CreateVolume of `name` from `source`.
fn with_source(name: &str, source: v1::volume_content_source::Type) -> v1::CreateVolumeRequest {
    let mut req = create_req(name, 1 << 20);
    req.volume_content_source = Some(v1::VolumeContentSource {
        r#type: Some(source),
    });
    req
}

fn from_snapshot(name: &str, snapshot_id: &str) -> v1::CreateVolumeRequest {
    use v1::volume_content_source::{SnapshotSource, Type};
    let snapshot_id = snapshot_id.into();
    with_source(name, Type::Snapshot(SnapshotSource { snapshot_id }))
}

fn from_volume(name: &str, volume_id: &str) -> v1::CreateVolumeRequest {
    use v1::volume_content_source::{Type, VolumeSource};
    let volume_id = volume_id.into();
    with_source(name, Type::Volume(VolumeSource { volume_id }))
}

fn list_req(max: i32, token: &str, snap: &str, source: &str) -> v1::ListSnapshotsRequest {
    v1::ListSnapshotsRequest {
        max_entries: max,
        starting_token: token.into(),
        snapshot_id: snap.into(),
        source_volume_id: source.into(),
        ..Default::default()
    }
}

async fn controller_caps(c: &mut V1) -> BTreeSet<i32> {
    use v1::controller_service_capability::Type;
    c.ctl
        .controller_get_capabilities(v1::ControllerGetCapabilitiesRequest {})
        .await
        .unwrap()
        .into_inner()
        .capabilities
        .into_iter()
        .filter_map(|c| c.r#type.map(|Type::Rpc(r)| r.r#type))
        .collect()
}

/// A plugin started with `args`, its v1 client, and the volumes `volumes` created (1 MiB).
async fn with_volumes(args: &[&str], volumes: &[&str]) -> anyhow::Result<(Plugin, V1)> {
    let p = Plugin::start(args).await?;
    let mut c = p.v1().await?;
    for volume in volumes {
        c.ctl.create_volume(create_req(volume, 1 << 20)).await?;
    }
    Ok((p, c))
}

/// The snapshot ids of one ListSnapshots answer.
async fn listed(c: &mut V1, req: v1::ListSnapshotsRequest) -> anyhow::Result<Vec<String>> {
    Ok(c.ctl
        .list_snapshots(req)
        .await?
        .into_inner()
        .entries
        .into_iter()
        .map(|e| e.snapshot.unwrap_or_default().snapshot_id)
        .collect())
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap()
}

#[tokio::test]
async fn snapshot_restore_and_clone_copy_the_data() -> anyhow::Result<()> {
    let p = Plugin::start(ON).await?;
    let mut c = p.v1().await?;
    let caps = controller_caps(&mut c).await;
    for cap in [5, 6, 7] {
        assert!(caps.contains(&cap), "capability {cap} missing: {caps:?}");
    }
    c.ctl.create_volume(create_req("src", 1 << 20)).await?;
    let vol = p.work.join("volumes/src");
    std::fs::create_dir(vol.join("dir"))?;
    std::fs::write(vol.join("dir/a"), "before")?;
    std::os::unix::fs::symlink("/etc/hostname", vol.join("link"))?;

    let s = c
        .ctl
        .create_snapshot(snap_req("snap-1", "src"))
        .await?
        .into_inner()
        .snapshot
        .unwrap();
    assert_eq!(s.snapshot_id, "snap-1");
    assert_eq!(s.source_volume_id, "src");
    assert!(s.ready_to_use);
    assert_eq!(s.size_bytes, 6);
    assert!(s.creation_time.unwrap().seconds > 0);
    // Idempotent: the same snapshot again, not a second copy.
    let again = c
        .ctl
        .create_snapshot(snap_req("snap-1", "src"))
        .await?
        .into_inner()
        .snapshot
        .unwrap();
    assert_eq!(again.snapshot_id, s.snapshot_id);
    assert_eq!(again.creation_time, s.creation_time);
    let copy = p.work.join("snapshots/snap-1");
    // The link was copied as a link, never followed.
    assert_eq!(
        std::fs::read_link(copy.join("link"))?,
        Path::new("/etc/hostname")
    );

    std::fs::write(vol.join("dir/a"), "after")?;
    std::fs::write(vol.join("b"), "later")?;

    let restored = c
        .ctl
        .create_volume(from_snapshot("restored", "snap-1"))
        .await?
        .into_inner()
        .volume
        .unwrap();
    assert!(matches!(
        restored.content_source.and_then(|s| s.r#type),
        Some(v1::volume_content_source::Type::Snapshot(_))
    ));
    let r = p.work.join("volumes/restored");
    assert_eq!(read(&r.join("dir/a")), "before");
    assert!(!r.join("b").exists(), "data written after the snapshot");
    assert!(
        std::fs::symlink_metadata(r.join("link"))?
            .file_type()
            .is_symlink()
    );
    // Idempotent, and the same name from another source is another volume.
    c.ctl
        .create_volume(from_snapshot("restored", "snap-1"))
        .await?;
    expect_code(
        c.ctl.create_volume(from_volume("restored", "src")).await,
        Code::AlreadyExists,
    )?;

    c.ctl.create_volume(from_volume("clone", "src")).await?;
    let cl = p.work.join("volumes/clone");
    assert_eq!(read(&cl.join("dir/a")), "after");
    assert_eq!(read(&cl.join("b")), "later");

    // The snapshot survives its source, and deletion is idempotent.
    c.ctl
        .delete_volume(v1::DeleteVolumeRequest {
            volume_id: "src".into(),
            ..Default::default()
        })
        .await?;
    assert_eq!(read(&copy.join("dir/a")), "before");
    for _ in 0..2 {
        c.ctl
            .delete_snapshot(v1::DeleteSnapshotRequest {
                snapshot_id: "snap-1".into(),
                ..Default::default()
            })
            .await?;
    }
    assert!(!copy.exists());
    Ok(())
}

#[tokio::test]
async fn snapshot_error_codes() -> anyhow::Result<()> {
    let (p, mut c) = with_volumes(ON, &["v1", "v2"]).await?;

    let long = "x".repeat(10 << 10);
    let refused = [
        ("", "v1", Code::InvalidArgument),
        ("s", "", Code::InvalidArgument),
        ("s", "no-such-volume", Code::NotFound),
        ("..", "v1", Code::InvalidArgument),
        (".", "v1", Code::InvalidArgument),
        ("a/b", "v1", Code::InvalidArgument),
        ("a\0b", "v1", Code::InvalidArgument),
        (long.as_str(), "v1", Code::InvalidArgument),
    ];
    for (name, source, code) in refused {
        expect_code(c.ctl.create_snapshot(snap_req(name, source)).await, code)?;
    }
    c.ctl.create_snapshot(snap_req("s", "v1")).await?;
    expect_code(
        c.ctl.create_snapshot(snap_req("s", "v2")).await,
        Code::AlreadyExists,
    )?;
    let mut other_params = snap_req("s", "v1");
    other_params.parameters.insert("k".into(), "v".into());
    expect_code(
        c.ctl.create_snapshot(other_params).await,
        Code::AlreadyExists,
    )?;

    expect_code(
        c.ctl
            .delete_snapshot(v1::DeleteSnapshotRequest::default())
            .await,
        Code::InvalidArgument,
    )?;
    for unknown in ["never-existed", "..", "a/b"] {
        c.ctl
            .delete_snapshot(v1::DeleteSnapshotRequest {
                snapshot_id: unknown.into(),
                ..Default::default()
            })
            .await?;
    }
    assert!(
        p.work.join("snapshots/s").is_dir(),
        "an unknown id deleted nothing"
    );

    for source in [
        from_snapshot("x", "no-such"),
        from_volume("x", "no-such"),
        from_snapshot("x", ".."),
    ] {
        expect_code(c.ctl.create_volume(source).await, Code::NotFound)?;
    }
    assert!(!p.work.join("volumes/x").exists());
    expect_code(
        c.ctl.list_snapshots(list_req(-1, "", "", "")).await,
        Code::InvalidArgument,
    )?;
    expect_code(
        c.ctl
            .list_snapshots(list_req(0, "invalid-token", "", ""))
            .await,
        Code::Aborted,
    )?;
    Ok(())
}

#[tokio::test]
async fn list_snapshots_pages_and_filters() -> anyhow::Result<()> {
    let (_plugin, mut c) = with_volumes(ON, &["a", "b"]).await?;
    for (name, src) in [
        ("s1", "a"),
        ("s2", "a"),
        ("s3", "b"),
        ("s4", "a"),
        ("s5", "b"),
    ] {
        c.ctl.create_snapshot(snap_req(name, src)).await?;
    }
    let mut seen = Vec::new();
    let mut token = String::new();
    loop {
        let page = c
            .ctl
            .list_snapshots(list_req(2, &token, "", ""))
            .await?
            .into_inner();
        assert!(page.entries.len() <= 2);
        seen.extend(
            page.entries
                .into_iter()
                .map(|e| e.snapshot.unwrap().snapshot_id),
        );
        if page.next_token.is_empty() {
            break;
        }
        token = page.next_token;
    }
    assert_eq!(seen, ["s1", "s2", "s3", "s4", "s5"]);

    let of_a = listed(&mut c, list_req(0, "", "", "a")).await?;
    assert_eq!(of_a, ["s1", "s2", "s4"]);
    let one = c
        .ctl
        .list_snapshots(list_req(0, "", "s3", ""))
        .await?
        .into_inner();
    assert_eq!(one.entries.len(), 1);
    assert_eq!(
        one.entries[0].snapshot.as_ref().unwrap().source_volume_id,
        "b"
    );
    // Unknown ids filter everything out: an empty list, not an error.
    for (snap, src) in [("nope", ""), ("", "nope"), ("s3", "a")] {
        let r = c
            .ctl
            .list_snapshots(list_req(0, "", snap, src))
            .await?
            .into_inner();
        assert!(r.entries.is_empty(), "{snap:?}/{src:?}: {:?}", r.entries);
    }
    Ok(())
}

#[tokio::test]
async fn snapshot_is_not_ready_for_the_first_answers() -> anyhow::Result<()> {
    let mut args = ON.to_vec();
    args.extend(["--snapshot-ready-after", "2"]);
    let (_plugin, mut c) = with_volumes(&args, &["v"]).await?;
    let mut ready = Vec::new();
    for _ in 0..4 {
        let s = c
            .ctl
            .create_snapshot(snap_req("s", "v"))
            .await?
            .into_inner();
        ready.push(s.snapshot.unwrap().ready_to_use);
    }
    assert_eq!(ready, [false, false, true, true]);
    Ok(())
}

#[tokio::test]
async fn without_the_flags_nothing_is_advertised_or_served() -> anyhow::Result<()> {
    let p = Plugin::start(&["--mount-mode", "none"]).await?;
    let mut c = p.v1().await?;
    let caps = controller_caps(&mut c).await;
    for cap in [5, 6, 7] {
        assert!(
            !caps.contains(&cap),
            "capability {cap} advertised: {caps:?}"
        );
    }
    c.ctl.create_volume(create_req("v", 1 << 20)).await?;
    expect_code(
        c.ctl.create_snapshot(snap_req("s", "v")).await,
        Code::Unimplemented,
    )?;
    expect_code(
        c.ctl.list_snapshots(list_req(0, "", "", "")).await,
        Code::Unimplemented,
    )?;
    expect_code(
        c.ctl.create_volume(from_volume("x", "v")).await,
        Code::InvalidArgument,
    )?;
    // --snapshots alone restores but does not clone.
    let q = Plugin::start(&["--mount-mode", "none", "--snapshots"]).await?;
    let mut d = q.v1().await?;
    d.ctl.create_volume(create_req("v", 1 << 20)).await?;
    d.ctl.create_snapshot(snap_req("s", "v")).await?;
    d.ctl.create_volume(from_snapshot("r", "s")).await?;
    expect_code(
        d.ctl.create_volume(from_volume("x", "v")).await,
        Code::InvalidArgument,
    )?;
    Ok(())
}

#[tokio::test]
async fn interrupted_copies_are_removed_at_start() -> anyhow::Result<()> {
    let mut p = Plugin::start(ON).await?;
    {
        let mut c = p.v1().await?;
        c.ctl.create_volume(create_req("v", 1 << 20)).await?;
        c.ctl.create_snapshot(snap_req("kept", "v")).await?;
    }
    p.kill().await?;
    // What a kill in the middle of a copy leaves: an incomplete record with
    // a partial copy, a volume still marked populating, a stray directory.
    let state_path = p.work.join("state.json");
    let mut state: serde_json::Value = serde_json::from_slice(&std::fs::read(&state_path)?)?;
    state["snapshots"]["half"] = serde_json::json!({"source_volume_id": "v", "complete": false});
    state["volumes"]["filling"] =
        serde_json::json!({"capacity_bytes": 1048576, "populating": true});
    std::fs::write(&state_path, serde_json::to_vec(&state)?)?;
    std::fs::create_dir_all(p.work.join("snapshots/half"))?;
    std::fs::create_dir_all(p.work.join("snapshots/stray"))?;
    std::fs::create_dir_all(p.work.join("volumes/filling"))?;
    p.spawn().await?;
    let mut c = p.v1().await?;
    let ids = listed(&mut c, list_req(0, "", "", "")).await?;
    assert_eq!(ids, ["kept"]);
    assert!(!p.work.join("snapshots/half").exists());
    assert!(!p.work.join("snapshots/stray").exists());
    assert!(!p.work.join("volumes/filling").exists());
    assert!(p.work.join("snapshots/kept").is_dir());
    // The CO's re-issue of the interrupted snapshot copies afresh.
    let s = c
        .ctl
        .create_snapshot(snap_req("half", "v"))
        .await?
        .into_inner();
    assert!(s.snapshot.unwrap().ready_to_use);
    Ok(())
}
