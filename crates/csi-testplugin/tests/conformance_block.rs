//! Raw block volumes (`--block`): the csi-sanity cases for the block access type
//! (idempotent repeats, NOT_FOUND, ALREADY_EXISTS, INVALID_ARGUMENT per missing field), and
//! the real effects: a sparse backing file, a loop device attached at NodeStage, the device
//! bind-mounted on a target *file* at NodePublish, bytes written through it landing in the
//! backing file, read-only enforced, and nothing left attached or mounted afterwards.
//!
//! Needs root and loop devices; MUST run in a private mount namespace:
//! `unshare -m --propagation private cargo test -p csi-testplugin --test conformance_block`.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::io::{Read, Seek, SeekFrom, Write};
use std::os::unix::fs::FileTypeExt;
use std::path::{Path, PathBuf};

use common::*;
use csi_proto::v1;
use tonic::Code;

fn require_private_mount_namespace() {
    let mine = std::fs::read_link("/proc/self/ns/mnt").ok();
    let init = std::fs::read_link("/proc/1/ns/mnt").ok();
    assert!(
        mine.is_some() && mine != init,
        "block tests mount: run under `unshare -m --propagation private`"
    );
}

/// SINGLE_NODE_WRITER block capability (or `mode`).
fn block_cap(mode: v1::volume_capability::access_mode::Mode) -> v1::VolumeCapability {
    use v1::volume_capability::{AccessMode, AccessType, BlockVolume};
    v1::VolumeCapability {
        access_mode: Some(AccessMode { mode: mode as i32 }),
        access_type: Some(AccessType::Block(BlockVolume {})),
    }
}

fn blk() -> v1::VolumeCapability {
    block_cap(v1::volume_capability::access_mode::Mode::SingleNodeWriter)
}

fn create_block(name: &str, size: i64) -> v1::CreateVolumeRequest {
    v1::CreateVolumeRequest {
        volume_capabilities: vec![blk()],
        ..create_req(name, size)
    }
}

/// The loop devices whose backing file is `file`, by the kernel's answer.
fn loops_backed_by(file: &Path) -> Vec<String> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/sys/block").unwrap() {
        let name = entry.unwrap().file_name().into_string().unwrap();
        if let Ok(b) = std::fs::read_to_string(format!("/sys/block/{name}/loop/backing_file"))
            && Path::new(b.trim_end()) == file
        {
            found.push(format!("/dev/{name}"));
        }
    }
    found
}

fn mounted(path: &Path) -> bool {
    std::fs::read_to_string("/proc/self/mountinfo")
        .unwrap()
        .lines()
        .filter_map(|l| l.split(' ').nth(4))
        .any(|m| Path::new(m) == path)
}

/// Detaches, on drop, every loop device backed by a file under `dir` (a failed test must
/// not leak loop devices on the machine).
struct LoopGuard(PathBuf);

impl Drop for LoopGuard {
    fn drop(&mut self) {
        for entry in std::fs::read_dir("/sys/block")
            .into_iter()
            .flatten()
            .flatten()
        {
            let name = entry.file_name().into_string().unwrap_or_default();
            if let Ok(b) = std::fs::read_to_string(format!("/sys/block/{name}/loop/backing_file"))
                && Path::new(b.trim_end()).starts_with(&self.0)
            {
                let _ = std::process::Command::new(losetup_path())
                    .arg("-d")
                    .arg(format!("/dev/{name}"))
                    .status();
            }
        }
    }
}

/// Whether writing one block to the device at `path` (and syncing it) fails.
fn write_fails(path: &Path) -> bool {
    let Ok(mut dev) = std::fs::OpenOptions::new().write(true).open(path) else {
        return true;
    };
    dev.write_all(&[0xAB; 4096])
        .and_then(|()| dev.sync_all())
        .is_err()
}

fn stage_block(id: &str, staging: &Path) -> v1::NodeStageVolumeRequest {
    v1::NodeStageVolumeRequest {
        volume_capability: Some(blk()),
        ..stage_req(id, staging)
    }
}

fn publish_block(id: &str, staging: &Path, target: &Path) -> v1::NodePublishVolumeRequest {
    v1::NodePublishVolumeRequest {
        volume_capability: Some(blk()),
        ..publish_req(id, staging, target)
    }
}

fn cpub_block(id: &str) -> v1::ControllerPublishVolumeRequest {
    v1::ControllerPublishVolumeRequest {
        volume_capability: Some(blk()),
        ..cpub_req(id)
    }
}

#[tokio::test]
async fn block_create_is_idempotent_and_keeps_its_access_type() -> anyhow::Result<()> {
    let p = Plugin::start(&["--block", "--mount-mode", "none"]).await?;
    let _guard = LoopGuard(p.work.clone());
    let mut c = p.v1().await?;
    let first = c.ctl.create_volume(create_block("b", 4 << 20)).await?;
    // "If a volume corresponding to the specified volume name already exists, ... and is
    // compatible ..., the Plugin MUST reply 0 OK with the corresponding CreateVolumeResponse."
    let again = c.ctl.create_volume(create_block("b", 4 << 20)).await?;
    assert_eq!(
        first.get_ref().volume.as_ref().unwrap().volume_id,
        again.get_ref().volume.as_ref().unwrap().volume_id
    );
    let backing = p.work.join("blocks/b.img");
    let meta = std::fs::metadata(&backing)?;
    assert_eq!(
        meta.len(),
        4 << 20,
        "backing file has the volume's capacity"
    );
    use std::os::unix::fs::MetadataExt;
    assert!(meta.blocks() * 512 < 1 << 20, "backing file is sparse");
    // Same name as a mount volume: "Volume already exists but is incompatible | 6 ALREADY_EXISTS".
    expect_code(
        c.ctl.create_volume(create_req("b", 4 << 20)).await,
        Code::AlreadyExists,
    )?;
    // Mixed block and mount capabilities: INVALID_ARGUMENT.
    let mut mixed = create_block("m", 1 << 20);
    mixed.volume_capabilities.push(snw());
    expect_code(c.ctl.create_volume(mixed).await, Code::InvalidArgument)?;
    // Validate: block confirmed on the block volume, mount not.
    let validate = |caps: Vec<v1::VolumeCapability>| v1::ValidateVolumeCapabilitiesRequest {
        volume_id: "b".into(),
        volume_capabilities: caps,
        ..Default::default()
    };
    let ok = c
        .ctl
        .validate_volume_capabilities(validate(vec![blk()]))
        .await?;
    assert!(ok.get_ref().confirmed.is_some());
    let no = c
        .ctl
        .validate_volume_capabilities(validate(vec![snw()]))
        .await?;
    assert!(no.get_ref().confirmed.is_none());
    assert!(
        no.get_ref().message.contains("block"),
        "{}",
        no.get_ref().message
    );
    // Delete removes the backing file; a repeat answers OK.
    c.ctl
        .delete_volume(v1::DeleteVolumeRequest {
            volume_id: "b".into(),
            ..Default::default()
        })
        .await?;
    assert!(!backing.exists(), "backing file removed by DeleteVolume");
    c.ctl
        .delete_volume(v1::DeleteVolumeRequest {
            volume_id: "b".into(),
            ..Default::default()
        })
        .await?;
    Ok(())
}

#[tokio::test]
async fn without_block_flag_block_is_refused() -> anyhow::Result<()> {
    let p = Plugin::start(&["--mount-mode", "none"]).await?;
    let mut c = p.v1().await?;
    let msg = expect_code(
        c.ctl.create_volume(create_block("b", 1 << 20)).await,
        Code::InvalidArgument,
    )?;
    assert!(msg.contains("--block"), "{msg}");
    assert!(!p.work.join("blocks").exists());
    // A mount volume staged with a block capability: "Exceeds capabilities | 9".
    let staging = create_and_stage(&p, &mut c, "m").await?;
    let other = p.mkdir("staging-other")?;
    let _ = staging;
    c.ctl.create_volume(create_req("m2", 1 << 20)).await?;
    c.ctl.controller_publish_volume(cpub_req("m2")).await?;
    expect_code(
        c.node.node_stage_volume(stage_block("m2", &other)).await,
        Code::FailedPrecondition,
    )?;
    Ok(())
}

#[tokio::test]
async fn block_stage_publish_write_read_unpublish_unstage() -> anyhow::Result<()> {
    require_private_mount_namespace();
    let p = Plugin::start(&["--block"]).await?;
    let _guard = LoopGuard(p.work.clone());
    let mut c = p.v1().await?;
    c.ctl.create_volume(create_block("b", 8 << 20)).await?;
    c.ctl.controller_publish_volume(cpub_block("b")).await?;
    let backing = p.work.join("blocks/b.img");
    let staging = p.mkdir("staging")?;

    // INVALID_ARGUMENT for each missing field, NOT_FOUND for an unknown volume.
    let mut r = stage_block("b", &staging);
    r.volume_id.clear();
    expect_code(c.node.node_stage_volume(r).await, Code::InvalidArgument)?;
    let mut r = stage_block("b", &staging);
    r.staging_target_path.clear();
    expect_code(c.node.node_stage_volume(r).await, Code::InvalidArgument)?;
    let mut r = stage_block("b", &staging);
    r.volume_capability = None;
    expect_code(c.node.node_stage_volume(r).await, Code::InvalidArgument)?;
    expect_code(
        c.node
            .node_stage_volume(stage_block("nope", &staging))
            .await,
        Code::NotFound,
    )?;
    // The mount access type on a block volume exceeds what it was created for.
    expect_code(
        c.node.node_stage_volume(stage_req("b", &staging)).await,
        Code::FailedPrecondition,
    )?;

    c.node.node_stage_volume(stage_block("b", &staging)).await?;
    let devices = loops_backed_by(&backing);
    assert_eq!(devices.len(), 1, "one loop device on the backing file");
    c.node.node_stage_volume(stage_block("b", &staging)).await?;
    assert_eq!(
        loops_backed_by(&backing),
        devices,
        "repeat attaches no second device"
    );
    let state = std::fs::read_to_string(p.work.join("state.json"))?;
    assert!(
        state.contains(&devices[0]),
        "state.json records the device: {state}"
    );

    // CSI v1: "Creation of target_path is the responsibility of the SP"; the CO creates the
    // parent only. For block "the SP SHALL place the block device at target_path".
    let parent = p.mkdir("pods")?;
    let target = parent.join("dev");
    let mut r = publish_block("b", &staging, &target);
    r.target_path.clear();
    expect_code(c.node.node_publish_volume(r).await, Code::InvalidArgument)?;
    let mut r = publish_block("b", &staging, &target);
    r.volume_capability = None;
    expect_code(c.node.node_publish_volume(r).await, Code::InvalidArgument)?;
    expect_code(
        c.node
            .node_publish_volume(publish_block("b", &staging, &p.path("missing/dev")))
            .await,
        Code::FailedPrecondition,
    )?;
    // An existing directory at the target is not a file.
    let dir_target = p.mkdir("pods/dir")?;
    expect_code(
        c.node
            .node_publish_volume(publish_block("b", &staging, &dir_target))
            .await,
        Code::FailedPrecondition,
    )?;

    c.node
        .node_publish_volume(publish_block("b", &staging, &target))
        .await?;
    c.node
        .node_publish_volume(publish_block("b", &staging, &target))
        .await?;
    assert!(
        mounted(&target),
        "the device is bind-mounted on the target file"
    );
    assert!(
        std::fs::metadata(&target)?.file_type().is_block_device(),
        "target is a block device"
    );
    // Bytes written through the device land in the backing file.
    let data: Vec<u8> = (0..(1 << 20))
        .map(|i: u32| (i.wrapping_mul(2654435761) >> 13) as u8)
        .collect();
    {
        let mut dev = std::fs::OpenOptions::new().write(true).open(&target)?;
        dev.seek(SeekFrom::Start(4096))?;
        dev.write_all(&data)?;
        dev.sync_all()?;
    }
    let mut back = vec![0; data.len()];
    let mut f = std::fs::File::open(&backing)?;
    f.seek(SeekFrom::Start(4096))?;
    f.read_exact(&mut back)?;
    assert!(
        back == data,
        "backing file holds the bytes written through the device"
    );

    // Unpublish: unmounted, the target file the SP created is gone; a repeat answers OK.
    c.node
        .node_unpublish_volume(unpublish_req("b", &target))
        .await?;
    assert!(!mounted(&target));
    assert!(!target.exists(), "SP removed the target file it created");
    c.node
        .node_unpublish_volume(unpublish_req("b", &target))
        .await?;
    // Still published → unstage refused; after unpublish it detaches the device.
    c.node
        .node_unstage_volume(unstage_req("b", &staging))
        .await?;
    assert!(loops_backed_by(&backing).is_empty(), "loop device detached");
    c.node
        .node_unstage_volume(unstage_req("b", &staging))
        .await?;
    assert!(staging.is_dir(), "the staging dir is the CO's");
    Ok(())
}

#[tokio::test]
async fn block_read_only_publish_refuses_writes() -> anyhow::Result<()> {
    require_private_mount_namespace();
    let p = Plugin::start(&["--block"]).await?;
    let _guard = LoopGuard(p.work.clone());
    let mut c = p.v1().await?;
    c.ctl.create_volume(create_block("ro", 1 << 20)).await?;
    c.ctl.controller_publish_volume(cpub_block("ro")).await?;
    let staging = p.mkdir("staging")?;
    c.node
        .node_stage_volume(stage_block("ro", &staging))
        .await?;
    let target = p.mkdir("pods")?.join("ro");
    let mut r = publish_block("ro", &staging, &target);
    r.readonly = true;
    c.node.node_publish_volume(r).await?;
    // The kernel may let the device open for writing; the write itself fails (EPERM on a
    // read-only loop device; EROFS/EACCES where the open is refused).
    assert!(
        write_fails(&target),
        "a read-only published block device took a write"
    );
    let ro = loops_backed_by(&p.work.join("blocks/ro.img"));
    assert!(
        ro.iter().any(
            |d| std::fs::read_to_string(format!("/sys/block/{}/ro", &d[5..]))
                .unwrap()
                .trim()
                == "1"
        ),
        "a read-only loop device backs the publication: {ro:?}"
    );
    std::fs::File::open(&target)?.read_exact(&mut [0; 512])?;
    // Another capability at the same target: ALREADY_EXISTS.
    expect_code(
        c.node
            .node_publish_volume(publish_block("ro", &staging, &target))
            .await,
        Code::AlreadyExists,
    )?;
    c.node
        .node_unpublish_volume(unpublish_req("ro", &target))
        .await?;
    c.node
        .node_unstage_volume(unstage_req("ro", &staging))
        .await?;
    assert!(loops_backed_by(&p.work.join("blocks/ro.img")).is_empty());
    Ok(())
}

#[tokio::test]
async fn restart_keeps_the_loop_device_and_never_detaches_a_foreign_one() -> anyhow::Result<()> {
    require_private_mount_namespace();
    let mut p = Plugin::start(&["--block"]).await?;
    let _guard = LoopGuard(p.dir.path().to_path_buf());
    let mut c = p.v1().await?;
    c.ctl.create_volume(create_block("b", 1 << 20)).await?;
    c.ctl.controller_publish_volume(cpub_block("b")).await?;
    let staging = p.mkdir("staging")?;
    c.node.node_stage_volume(stage_block("b", &staging)).await?;
    let backing = p.work.join("blocks/b.img");
    let ours = loops_backed_by(&backing);
    assert_eq!(ours.len(), 1);

    // A foreign loop device, and a hand-edited record naming it as ours.
    let foreign_file = p.path("foreign.img");
    std::fs::File::create(&foreign_file)?.set_len(1 << 20)?;
    let out = std::process::Command::new(losetup_path())
        .args(["--find", "--show"])
        .arg(&foreign_file)
        .output()?;
    let foreign = String::from_utf8(out.stdout)?.trim().to_owned();
    assert!(foreign.starts_with("/dev/loop"), "{foreign}");
    p.kill().await?;
    let state = std::fs::read_to_string(p.work.join("state.json"))?;
    std::fs::write(p.work.join("state.json"), state.replace(&ours[0], &foreign))?;
    p.spawn().await?;
    let mut c = p.v1().await?;

    // Staged before the restart: a repeat stage finds the device, attaches no other.
    c.node.node_stage_volume(stage_block("b", &staging)).await?;
    assert_eq!(loops_backed_by(&backing), ours);
    let target = p.mkdir("pods")?.join("t");
    c.node
        .node_publish_volume(publish_block("b", &staging, &target))
        .await?;
    c.node
        .node_unpublish_volume(unpublish_req("b", &target))
        .await?;
    c.node
        .node_unstage_volume(unstage_req("b", &staging))
        .await?;
    assert!(loops_backed_by(&backing).is_empty(), "ours detached");
    assert_eq!(
        loops_backed_by(&foreign_file),
        vec![foreign.clone()],
        "the foreign device named by the record is still attached"
    );
    Ok(())
}

/// util-linux's `losetup` from a system directory: the tests may run with a user's `PATH`
/// (through `sudo env PATH=...`), which lacks `/usr/sbin`.
fn losetup_path() -> &'static str {
    [
        "/usr/sbin/losetup",
        "/sbin/losetup",
        "/usr/bin/losetup",
        "/bin/losetup",
    ]
    .into_iter()
    .find(|path| std::path::Path::new(path).is_file())
    .unwrap_or("losetup")
}
