//! Real bind mounts (`--mount-mode bind`, the default). These need root and
//! MUST run in a private mount namespace so that the host's mount table is
//! never touched:
//!
//! ```text
//! cd /work/main && unshare -m --propagation private cargo test -p csi-testplugin
//! ```
//!
//! Each test checks the namespace first and panics otherwise.

mod common;

use std::path::Path;

use common::*;
use csi_proto::{v0, v1};
use tonic::Code;

fn mnt_ns(pid: &str) -> Option<std::path::PathBuf> {
    std::fs::read_link(format!("/proc/{pid}/ns/mnt")).ok()
}

fn parent_of(pid: &str) -> Option<String> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("PPid:"))
        .map(|p| p.trim().to_owned())
}

/// Panics unless this process runs in a mount namespace of its own.
///
/// The primary check is `/proc/self/ns/mnt != /proc/1/ns/mnt`. Where pid 1's
/// namespace cannot be read (containers often deny it), the evidence is an
/// ancestor process (e.g. the shell that ran `unshare`) whose namespace is
/// readable and differs. No evidence means no mounting.
fn require_private_mount_namespace() {
    let mine = mnt_ns("self");
    let private = match (&mine, mnt_ns("1")) {
        (Some(m), Some(init)) => *m != init,
        (Some(m), None) => {
            let mut pid = parent_of("self");
            let mut found = false;
            while let Some(p) = pid.filter(|p| p != "0" && p != "1") {
                if mnt_ns(&p).is_some_and(|ns| ns != *m) {
                    found = true;
                    break;
                }
                pid = parent_of(&p);
            }
            found
        }
        (None, _) => false,
    };
    if !private {
        panic!(
            "bind-mount tests must not touch the host mount table: \
             run under `unshare -m --propagation private` (e.g. \
             `unshare -m --propagation private cargo test -p csi-testplugin`)"
        );
    }
}

fn mounted(path: &Path) -> anyhow::Result<bool> {
    let path = std::fs::canonicalize(path).unwrap_or_else(|_| path.to_owned());
    let text = std::fs::read_to_string("/proc/self/mountinfo")?;
    Ok(text
        .lines()
        .filter_map(|l| l.split(' ').nth(4))
        .any(|m| Path::new(m) == path))
}

#[tokio::test]
async fn stage_and_publish_are_bind_mounts() -> anyhow::Result<()> {
    require_private_mount_namespace();
    let p = Plugin::start(&[]).await?;
    let mut c = p.v1().await?;
    let staging = create_and_stage(&p, &mut c, "v").await?;
    assert!(mounted(&staging)?, "staging path is a mount point");
    // Idempotent: no second mount stacked on the first.
    c.node.node_stage_volume(stage_req("v", &staging)).await?;
    let count = |path: &Path| -> anyhow::Result<usize> {
        let path = std::fs::canonicalize(path)?;
        let text = std::fs::read_to_string("/proc/self/mountinfo")?;
        Ok(text
            .lines()
            .filter_map(|l| l.split(' ').nth(4))
            .filter(|m| Path::new(m) == path)
            .count())
    };
    assert_eq!(count(&staging)?, 1);

    let target = p.mkdir("pods")?.join("t");
    c.node
        .node_publish_volume(publish_req("v", &staging, &target))
        .await?;
    c.node
        .node_publish_volume(publish_req("v", &staging, &target))
        .await?;
    assert!(mounted(&target)?);
    assert_eq!(count(&target)?, 1);

    // Data written through the target lands in the volume directory.
    std::fs::write(target.join("hello"), b"world")?;
    assert_eq!(std::fs::read(p.work.join("volumes/v/hello"))?, b"world");

    // A volume in use cannot be deleted.
    expect_code(
        c.ctl
            .delete_volume(v1::DeleteVolumeRequest {
                volume_id: "v".into(),
                ..Default::default()
            })
            .await,
        Code::FailedPrecondition,
    )?;

    c.node
        .node_unpublish_volume(unpublish_req("v", &target))
        .await?;
    assert!(!mounted(&target)?);
    assert!(!target.exists(), "v1 target removed");
    c.node
        .node_unpublish_volume(unpublish_req("v", &target))
        .await?;
    c.node
        .node_unstage_volume(unstage_req("v", &staging))
        .await?;
    assert!(!mounted(&staging)?);
    assert!(staging.is_dir());
    assert!(
        !staging.join("hello").exists(),
        "nothing left in the staging dir"
    );
    c.node
        .node_unstage_volume(unstage_req("v", &staging))
        .await?;
    Ok(())
}

#[tokio::test]
async fn readonly_publish_refuses_writes() -> anyhow::Result<()> {
    require_private_mount_namespace();
    let p = Plugin::start(&[]).await?;
    let mut c = p.v1().await?;
    let staging = create_and_stage(&p, &mut c, "v").await?;
    std::fs::write(staging.join("existing"), b"data")?;
    let target = p.mkdir("pods")?.join("ro");
    let mut req = publish_req("v", &staging, &target);
    req.readonly = true;
    c.node.node_publish_volume(req).await?;
    assert_eq!(std::fs::read(target.join("existing"))?, b"data");
    let err = std::fs::write(target.join("new"), b"x").err();
    assert_eq!(
        err.and_then(|e| e.raw_os_error()),
        Some(rustix::io::Errno::ROFS.raw_os_error()),
        "writes must fail with EROFS"
    );
    // The staging mount itself stays writable.
    std::fs::write(staging.join("still-writable"), b"y")?;
    c.node
        .node_unpublish_volume(unpublish_req("v", &target))
        .await?;
    assert!(!mounted(&target)?);
    Ok(())
}

#[tokio::test]
async fn restart_keeps_mounts_and_truth() -> anyhow::Result<()> {
    require_private_mount_namespace();
    let mut p = Plugin::start(&[]).await?;
    let mut c = p.v1().await?;
    let staging = create_and_stage(&p, &mut c, "v").await?;
    let target = p.mkdir("pods")?.join("t");
    c.node
        .node_publish_volume(publish_req("v", &staging, &target))
        .await?;
    p.kill().await?;
    assert!(mounted(&target)?, "mounts outlive the plugin");
    p.spawn().await?;
    let mut c = p.v1().await?;
    c.node
        .node_publish_volume(publish_req("v", &staging, &target))
        .await?;
    let mut ro = publish_req("v", &staging, &target);
    ro.readonly = true;
    expect_code(c.node.node_publish_volume(ro).await, Code::AlreadyExists)?;
    c.node
        .node_unpublish_volume(unpublish_req("v", &target))
        .await?;
    c.node
        .node_unstage_volume(unstage_req("v", &staging))
        .await?;
    assert!(!mounted(&target)? && !mounted(&staging)?);
    Ok(())
}

#[tokio::test]
async fn stale_stage_record_is_repaired() -> anyhow::Result<()> {
    require_private_mount_namespace();
    let p = Plugin::start(&[]).await?;
    let mut c = p.v1().await?;
    let staging = create_and_stage(&p, &mut c, "v").await?;
    // Someone unmounted the staging path behind the plugin's back: publish
    // refuses (mountinfo is the truth), and staging again repairs it.
    rustix::mount::unmount(&staging, rustix::mount::UnmountFlags::empty())?;
    let target = p.mkdir("pods")?.join("t");
    expect_code(
        c.node
            .node_publish_volume(publish_req("v", &staging, &target))
            .await,
        Code::FailedPrecondition,
    )?;
    c.node.node_stage_volume(stage_req("v", &staging)).await?;
    assert!(mounted(&staging)?);
    c.node
        .node_publish_volume(publish_req("v", &staging, &target))
        .await?;
    assert!(mounted(&target)?);
    c.node
        .node_unpublish_volume(unpublish_req("v", &target))
        .await?;
    c.node
        .node_unstage_volume(unstage_req("v", &staging))
        .await?;
    Ok(())
}

#[tokio::test]
async fn v0_bind_mount_keeps_the_co_target() -> anyhow::Result<()> {
    require_private_mount_namespace();
    let p = Plugin::start(&["--no-stage-unstage", "--no-controller-publish"]).await?;
    let mut c = p.v0().await?;
    c.ctl
        .create_volume(v0::CreateVolumeRequest {
            name: "v".into(),
            volume_capabilities: vec![snw0()],
            ..Default::default()
        })
        .await?;
    let target = p.mkdir("co-target")?;
    let req = v0::NodePublishVolumeRequest {
        volume_id: "v".into(),
        target_path: target.display().to_string(),
        volume_capability: Some(snw0()),
        ..Default::default()
    };
    c.node.node_publish_volume(req).await?;
    assert!(mounted(&target)?);
    c.node
        .node_unpublish_volume(v0::NodeUnpublishVolumeRequest {
            volume_id: "v".into(),
            target_path: target.display().to_string(),
        })
        .await?;
    assert!(!mounted(&target)?);
    assert!(target.is_dir());
    Ok(())
}

/// `--volume-fs tmpfs`: each volume is a file system of its own capacity,
/// released on delete and mounted again (empty) by a plugin restarted in a
/// namespace where it is gone.
#[tokio::test]
async fn tmpfs_backing_gives_each_volume_its_own_file_system() -> anyhow::Result<()> {
    require_private_mount_namespace();
    let mut p = Plugin::start(&["--volume-fs", "tmpfs"]).await?;
    let mut c = p.v1().await?;
    c.ctl.create_volume(create_req("small", 16 << 20)).await?;
    let dir = p.work.join("volumes/small");
    assert!(mounted(&dir)?, "the volume's directory is a mount point");
    let fs = rustix::fs::statvfs(&dir)?;
    assert_eq!(
        fs.f_blocks * fs.f_frsize,
        16 << 20,
        "the tmpfs has the volume's capacity"
    );
    std::fs::write(dir.join("data"), vec![7u8; 1 << 20])?;
    let after = rustix::fs::statvfs(&dir)?;
    assert!(
        after.f_bfree < fs.f_bfree,
        "a write is counted in the volume's own file system"
    );

    // Restarted after its tmpfs went away (as after a reboot): mounted again.
    p.kill().await?;
    rustix::mount::unmount(&dir, rustix::mount::UnmountFlags::empty())?;
    assert!(!mounted(&dir)?);
    p.spawn().await?;
    let mut c = p.v1().await?;
    assert!(
        mounted(&dir)?,
        "a restarted plugin mounts the recorded volume's tmpfs"
    );
    assert!(
        p.stderr().contains("its data did not survive"),
        "{}",
        p.stderr()
    );

    c.ctl
        .delete_volume(v1::DeleteVolumeRequest {
            volume_id: "small".into(),
            ..Default::default()
        })
        .await?;
    assert!(!mounted(&dir)?, "delete unmounts the tmpfs");
    assert!(!dir.exists(), "and removes the directory");
    Ok(())
}

/// Expansion really grows a `--volume-fs tmpfs` volume's file system, seen through the
/// publication (a bind of the same tmpfs), with the data kept: by ControllerExpandVolume
/// alone when there is no node step, by NodeExpandVolume when there is (and not before).
#[tokio::test]
async fn expansion_grows_the_tmpfs_seen_through_the_target() -> anyhow::Result<()> {
    require_private_mount_namespace();
    let size = |path: &Path| -> anyhow::Result<u64> {
        let fs = rustix::fs::statvfs(path)?;
        Ok(fs.f_blocks * fs.f_frsize)
    };
    for node_step in [false, true] {
        let mut args = vec![
            "--volume-fs",
            "tmpfs",
            "--expansion",
            "online",
            "--controller-expand",
        ];
        if node_step {
            args.push("--node-expand");
        }
        let p = Plugin::start(&args).await?;
        let mut c = p.v1().await?;
        let staging = create_and_stage(&p, &mut c, "v").await?;
        let target = p.path("target");
        c.node
            .node_publish_volume(publish_req("v", &staging, &target))
            .await?;
        std::fs::write(target.join("data"), b"kept")?;
        assert_eq!(size(&target)?, 1 << 20);
        let r = c
            .ctl
            .controller_expand_volume(expand_req("v", 16 << 20, 0))
            .await?
            .into_inner();
        assert_eq!(r.node_expansion_required, node_step);
        if node_step {
            assert_eq!(size(&target)?, 1 << 20, "the node step grows the fs");
            let n = c
                .node
                .node_expand_volume(v1::NodeExpandVolumeRequest {
                    volume_id: "v".into(),
                    volume_path: target.display().to_string(),
                    ..Default::default()
                })
                .await?
                .into_inner();
            assert_eq!(n.capacity_bytes, 16 << 20);
        }
        assert_eq!(size(&target)?, 16 << 20, "node_step={node_step}");
        assert_eq!(std::fs::read(target.join("data"))?, b"kept");
        // Room that was not there before: 8 MiB written into a volume created with 1 MiB.
        std::fs::write(target.join("big"), vec![1u8; 8 << 20])?;
        c.node
            .node_unpublish_volume(unpublish_req("v", &target))
            .await?;
        c.node
            .node_unstage_volume(unstage_req("v", &staging))
            .await?;
    }
    Ok(())
}

/// The data: written at A's target, read at B's, through real bind mounts of the one
/// backend directory (`--backend-dir`): a volume's data is the backend's, not a node's.
#[tokio::test]
async fn data_written_through_one_node_is_read_through_the_other() -> anyhow::Result<()> {
    require_private_mount_namespace();
    let backend = tempfile::tempdir()?;
    let dir = backend.path().display().to_string();
    let flags = ["--backend-dir", dir.as_str()];
    let (a, b) = (
        Plugin::start_on("node-a", &flags).await?,
        Plugin::start_on("node-b", &flags).await?,
    );
    let (mut ca, mut cb) = (a.v1().await?, b.v1().await?);
    let cpub = |node: &str| v1::ControllerPublishVolumeRequest {
        node_id: node.to_owned(),
        ..cpub_req("data")
    };
    ca.ctl.create_volume(create_req("data", 1 << 20)).await?;
    ca.ctl.controller_publish_volume(cpub("node-a")).await?;
    let sa = a.mkdir("staging")?;
    ca.node.node_stage_volume(stage_req("data", &sa)).await?;
    std::fs::write(sa.join("hello"), "from A")?;
    ca.node
        .node_unstage_volume(unstage_req("data", &sa))
        .await?;
    ca.ctl
        .controller_unpublish_volume(v1::ControllerUnpublishVolumeRequest {
            volume_id: "data".into(),
            node_id: "node-a".into(),
            ..Default::default()
        })
        .await?;

    cb.ctl.controller_publish_volume(cpub("node-b")).await?;
    let sb = b.mkdir("staging")?;
    cb.node.node_stage_volume(stage_req("data", &sb)).await?;
    assert_eq!(std::fs::read_to_string(sb.join("hello"))?, "from A");
    cb.node
        .node_unstage_volume(unstage_req("data", &sb))
        .await?;
    Ok(())
}
