//! Raw block volumes through the real daemon and the real test plugin (`--block`, loop
//! devices): a block volume created and published with `bind_to` a file beneath the bind
//! root carries bytes written with `dd` (and they are in the plugin's backing file);
//! read-only is enforced; unpublish leaves no mount, no loop device and no file it created;
//! `bind_to` that is a symlink, a directory or a device node is refused; a plugin without
//! `--block` refuses with a clear error; a daemon killed at the publish failpoints converges.
//! Run under `unshare -m --propagation private`.

use std::os::unix::fs::FileTypeExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use csi_agent_api::{CapabilitySpec, CreateVolumeRequest, PublishRequest};
use csi_agent_testkit::*;

const MIB: usize = 1 << 20;

/// A daemon whose test plugin serves block (unless `block` is false), with `<dir>/sandboxes`
/// as its bind root.
struct Scene {
    daemon: Daemon,
    root: PathBuf,
    plugin_dir: PathBuf,
    dir: tempfile::TempDir,
}

impl Scene {
    fn new(block: bool) -> Self {
        Self::with_env(block, &[])
    }

    fn with_env(block: bool, env: &[(&str, &str)]) -> Self {
        Self::with(block, env, &[])
    }

    /// `plugin_args` are added to the test plugin's command line.
    fn with(block: bool, env: &[(&str, &str)], plugin_args: &[&str]) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("sandboxes");
        std::fs::create_dir_all(root.join("w1")).unwrap();
        let plugin_dir = dir.path().join("plugin");
        let mut config = managed_config(PLUGIN, &plugin_dir, "vol1:1M");
        if block {
            config["containers"][0]["command"]["arguments"]
                .as_array_mut()
                .unwrap()
                .push("--block".into());
        }
        for arg in plugin_args {
            config["containers"][0]["command"]["arguments"]
                .as_array_mut()
                .unwrap()
                .push((*arg).into());
        }
        setup_namespace_check();
        let mut builder = Daemon::builder(dir.path())
            .bind_root(&root)
            .plugin_config("test.json", config);
        for (k, v) in env {
            builder = builder.env(k, v);
        }
        let daemon = builder.start();
        Self {
            daemon,
            root,
            plugin_dir,
            dir,
        }
    }

    fn backing(&self, volume: &str) -> PathBuf {
        self.plugin_dir.join(format!("blocks/{volume}.img"))
    }

    async fn create(&self, name: &str) {
        self.daemon
            .api()
            .create_volume(&CreateVolumeRequest {
                accessibility_requirements: None,
                content_source: None,
                plugin: PLUGIN.to_owned(),
                name: name.to_owned(),
                capacity_bytes: 4 * MIB as i64,
                capability: CapabilitySpec::block("SINGLE_NODE_WRITER"),
                parameters: Default::default(),
            })
            .await
            .unwrap();
    }
}

/// A failed test must not leak loop devices on the machine: whatever the plugin attached to
/// its backing files is detached (lazily, if still bound) before the dirs go.
impl Drop for Scene {
    fn drop(&mut self) {
        for entry in std::fs::read_dir("/sys/block")
            .into_iter()
            .flatten()
            .flatten()
        {
            let name = entry.file_name().into_string().unwrap_or_default();
            if let Ok(b) = std::fs::read_to_string(format!("/sys/block/{name}/loop/backing_file"))
                && Path::new(b.trim_end()).starts_with(&self.plugin_dir)
            {
                let _ = Command::new(losetup_path())
                    .arg("-d")
                    .arg(format!("/dev/{name}"))
                    .status();
            }
        }
    }
}

fn setup_namespace_check() {
    csi_agent::mounts::require_private_mount_namespace();
}

fn block_publish(volume: &str, workload: &str, bind: &Path) -> PublishRequest {
    let mut request = publish_bound(volume, workload, bind);
    request.capability = CapabilitySpec::block("SINGLE_NODE_WRITER");
    request
}

/// The loop devices whose backing file is `file` (the kernel's answer).
fn loops_backed_by(file: &Path) -> Vec<String> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/sys/block").unwrap().flatten() {
        let name = entry.file_name().into_string().unwrap();
        if let Ok(b) = std::fs::read_to_string(format!("/sys/block/{name}/loop/backing_file"))
            && Path::new(b.trim_end()) == file
        {
            found.push(name);
        }
    }
    found
}

fn dd(args: &[&str]) -> std::process::Output {
    Command::new("dd").args(args).output().unwrap()
}

fn random_bytes(len: usize) -> Vec<u8> {
    let mut seed: u64 = 0x9E37_79B9_7F4A_7C15 ^ u64::from(std::process::id());
    (0..len)
        .map(|_| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            (seed >> 24) as u8
        })
        .collect()
}

/// Waits until no loop device backs `file` and nothing is mounted under the work dir.
async fn assert_released(scene: &Scene, volume: &str) {
    let backing = scene.backing(volume);
    eventually("loop device detached", Duration::from_secs(20), || {
        let loops = loops_backed_by(&backing);
        async move {
            if loops.is_empty() {
                Ok(())
            } else {
                Err(format!("still attached: {loops:?}"))
            }
        }
    })
    .await;
    assert!(mounts_under(&scene.daemon.work).is_empty());
    assert!(mounts_under(&scene.root).is_empty());
}

#[tokio::test]
async fn a_block_volume_bound_to_a_file_carries_dd_bytes_and_leaves_nothing_behind() {
    let scene = Scene::new(true);
    scene.create("blk").await;
    let bind = scene.root.join("w1/disk");
    let published = scene
        .daemon
        .api()
        .publish(&block_publish("blk", "w1", &bind))
        .await
        .unwrap();
    // The target and the bind are files with the device node mounted on them.
    let target = PathBuf::from(&published.target_path);
    assert!(
        std::fs::metadata(&target)
            .unwrap()
            .file_type()
            .is_block_device()
    );
    assert!(is_mounted(&bind), "bind_to is a mount point");
    assert!(
        std::fs::metadata(&bind)
            .unwrap()
            .file_type()
            .is_block_device()
    );
    assert_eq!(loops_backed_by(&scene.backing("blk")).len(), 1);

    // dd in, dd out: the same bytes, and they are in the plugin's backing file.
    let data = random_bytes(MIB);
    let input = scene.dir.path().join("in.bin");
    let output = scene.dir.path().join("out.bin");
    std::fs::write(&input, &data).unwrap();
    let bind_s = bind.to_str().unwrap();
    let written = dd(&[
        &format!("if={}", input.display()),
        &format!("of={bind_s}"),
        "bs=1M",
        "count=1",
        "oflag=direct",
        "conv=fsync,notrunc",
    ]);
    assert!(written.status.success(), "{written:?}");
    let read = dd(&[
        &format!("if={bind_s}"),
        &format!("of={}", output.display()),
        "bs=1M",
        "count=1",
        "iflag=direct",
    ]);
    assert!(read.status.success(), "{read:?}");
    assert!(std::fs::read(&output).unwrap() == data, "dd out != dd in");
    let backing = std::fs::read(scene.backing("blk")).unwrap();
    assert!(backing[..MIB] == data[..], "backing file holds the bytes");

    // A second publish of the same claim is idempotent.
    scene
        .daemon
        .api()
        .publish(&block_publish("blk", "w1", &bind))
        .await
        .unwrap();

    scene
        .daemon
        .api()
        .unpublish(&unpublish_request("blk", "w1"))
        .await
        .unwrap();
    assert!(!is_mounted(&bind));
    assert!(
        !bind.exists(),
        "the file csi-agent created for bind_to is gone"
    );
    assert!(
        scene.root.join("w1").is_dir(),
        "the workload's own dir stays"
    );
    assert!(
        std::fs::symlink_metadata(&target).is_err(),
        "target file gone"
    );
    assert_released(&scene, "blk").await;
    // The data survives unpublish (it is the volume's).
    let backing = std::fs::read(scene.backing("blk")).unwrap();
    assert!(backing[..MIB] == data[..]);
}

#[tokio::test]
async fn a_read_only_block_publish_refuses_writes() {
    let scene = Scene::new(true);
    scene.create("ro").await;
    let bind = scene.root.join("w1/ro");
    let mut request = block_publish("ro", "w1", &bind);
    request.readonly = true;
    scene.daemon.api().publish(&request).await.unwrap();
    let write = dd(&[
        "if=/dev/zero",
        &format!("of={}", bind.display()),
        "bs=4096",
        "count=1",
        "oflag=direct",
        "conv=notrunc",
    ]);
    assert!(
        !write.status.success(),
        "a write to a read-only block volume succeeded"
    );
    let read = dd(&[
        &format!("if={}", bind.display()),
        "of=/dev/null",
        "bs=4096",
        "count=1",
    ]);
    assert!(read.status.success(), "{read:?}");
    scene
        .daemon
        .api()
        .unpublish(&unpublish_request("ro", "w1"))
        .await
        .unwrap();
    assert_released(&scene, "ro").await;
}

#[tokio::test]
async fn bind_to_a_symlink_a_directory_or_a_device_node_is_refused() {
    let scene = Scene::new(true);
    scene.create("blk").await;
    let victim = scene.dir.path().join("victim.img");
    std::fs::write(&victim, b"precious").unwrap();
    let w1 = scene.root.join("w1");
    std::os::unix::fs::symlink(&victim, w1.join("link")).unwrap();
    std::fs::create_dir(w1.join("dir")).unwrap();
    let status = Command::new("mknod")
        .arg(w1.join("node"))
        .args(["b", "7", "250"])
        .status()
        .unwrap();
    assert!(status.success());
    for (name, wanted) in [
        ("link", "symlink"),
        ("dir", "existing directory"),
        ("node", "device node"),
    ] {
        let (code, body) = api_error(
            scene
                .daemon
                .api()
                .publish(&block_publish("blk", "w1", &w1.join(name)))
                .await,
        );
        assert_eq!(code, 409, "{name}: {}", body.message);
        assert!(body.message.contains(wanted), "{name}: {}", body.message);
    }
    // Nothing was mounted, followed or deleted.
    assert!(mounts_under(&scene.root).is_empty());
    assert_eq!(std::fs::read(&victim).unwrap(), b"precious");
    assert!(
        std::fs::symlink_metadata(w1.join("link"))
            .unwrap()
            .is_symlink()
    );
    assert!(w1.join("dir").is_dir());
    assert!(
        std::fs::symlink_metadata(w1.join("node"))
            .unwrap()
            .file_type()
            .is_block_device()
    );
    assert_released(&scene, "blk").await;
}

#[tokio::test]
async fn a_plugin_without_block_refuses_it_clearly() {
    let scene = Scene::new(false);
    let (code, body) = api_error(
        scene
            .daemon
            .api()
            .create_volume(&CreateVolumeRequest {
                accessibility_requirements: None,
                content_source: None,
                plugin: PLUGIN.to_owned(),
                name: "blk".to_owned(),
                capacity_bytes: MIB as i64,
                capability: CapabilitySpec::block("SINGLE_NODE_WRITER"),
                parameters: Default::default(),
            })
            .await,
    );
    assert!((400..500).contains(&code), "{code}: {}", body.message);
    assert!(
        body.message.contains("block access type is not supported"),
        "{}",
        body.message
    );
    // A pre-provisioned (mount) volume published as block: the plugin refuses at stage.
    let bind = scene.root.join("w1/disk");
    let (code, body) = api_error(
        scene
            .daemon
            .api()
            .publish(&block_publish("vol1", "w1", &bind))
            .await,
    );
    assert!(code >= 400, "{code}");
    assert!(body.message.contains("block"), "{}", body.message);
    assert!(!bind.exists());
    assert!(mounts_under(&scene.root).is_empty());
}

/// The publish failpoints the crash matrix uses for a mount volume, for a block volume: the
/// daemon dies there, restarts without failpoints, and the claim (durable before any RPC)
/// is published with its bind; an unpublish then leaves nothing behind.
#[tokio::test]
async fn a_daemon_killed_at_the_publish_failpoints_converges_for_a_block_volume() {
    for point in [
        "volume.node_stage.after_rpc",
        "volume.node_publish.after_rpc",
        "volume.bind.after_mount",
    ] {
        let mut scene =
            Scene::with_env(true, &[("CSI_AGENT_FAILPOINTS", &format!("{point}=exit"))]);
        scene.create("blk").await;
        let bind = scene.root.join("w1/disk");
        let result = scene
            .daemon
            .api()
            .publish(&block_publish("blk", "w1", &bind))
            .await;
        assert!(
            result.is_err(),
            "{point}: the daemon should have died: {result:?}"
        );
        scene.daemon.wait_exit();
        scene.daemon.set_env("CSI_AGENT_FAILPOINTS", None);
        scene.daemon.start();
        // The claim was durable before any RPC: the reconciler publishes it again (the
        // bind left by the killed daemon is adopted or redone, never stacked).
        let api = scene.daemon.api();
        eventually(
            &format!("{point}: published again"),
            Duration::from_secs(30),
            || {
                let api = api.clone();
                let bind = bind.clone();
                async move {
                    let info = api.volume(PLUGIN, "blk").await.map_err(|e| e.to_string())?;
                    let meta = std::fs::metadata(&bind).map_err(|e| e.to_string())?;
                    if info.state == "PUBLISHED"
                        && info.operation.is_none()
                        && meta.file_type().is_block_device()
                        && is_mounted(&bind)
                    {
                        Ok(())
                    } else {
                        Err(format!("{info:?}"))
                    }
                }
            },
        )
        .await;
        assert_eq!(
            mounts_under(&scene.root),
            vec![bind.clone()],
            "{point}: one bind, no stacked mounts"
        );
        assert_eq!(loops_backed_by(&scene.backing("blk")).len(), 1, "{point}");
        scene
            .daemon
            .api()
            .unpublish(&unpublish_request("blk", "w1"))
            .await
            .unwrap();
        assert!(!bind.exists(), "{point}");
        assert_released(&scene, "blk").await;
    }
}

/// A CSI 0.3 plugin: the CO creates the target (a file, for block) and removes it after
/// NodeUnpublish; the plugin neither creates nor removes it.
#[tokio::test]
async fn for_a_v0_plugin_csi_agent_creates_and_removes_the_target_file() {
    let scene = Scene::with(true, &[], &["--api-versions", "v0.3"]);
    scene.create("blk").await;
    let bind = scene.root.join("w1/disk");
    let published = scene
        .daemon
        .api()
        .publish(&block_publish("blk", "w1", &bind))
        .await
        .unwrap();
    let target = PathBuf::from(&published.target_path);
    assert!(is_mounted(&target));
    assert!(
        std::fs::metadata(&bind)
            .unwrap()
            .file_type()
            .is_block_device()
    );
    let data = random_bytes(4096);
    let input = scene.dir.path().join("in.bin");
    std::fs::write(&input, &data).unwrap();
    let written = dd(&[
        &format!("if={}", input.display()),
        &format!("of={}", bind.display()),
        "bs=4096",
        "count=1",
        "oflag=direct",
        "conv=fsync,notrunc",
    ]);
    assert!(written.status.success(), "{written:?}");
    assert!(std::fs::read(scene.backing("blk")).unwrap()[..4096] == data[..]);
    scene
        .daemon
        .api()
        .unpublish(&unpublish_request("blk", "w1"))
        .await
        .unwrap();
    assert!(
        std::fs::symlink_metadata(&target).is_err(),
        "the target file csi-agent created is gone"
    );
    assert!(!bind.exists());
    assert_released(&scene, "blk").await;
}

/// An existing regular file at `bind_to` (the workload's own) is bound onto and, after
/// unpublish, left where it was with its bytes: csi-agent removes only a file it created.
#[tokio::test]
async fn an_existing_file_at_bind_to_is_used_and_kept() {
    let scene = Scene::new(true);
    scene.create("blk").await;
    let bind = scene.root.join("w1/mine");
    std::fs::write(&bind, b"the workload's").unwrap();
    scene
        .daemon
        .api()
        .publish(&block_publish("blk", "w1", &bind))
        .await
        .unwrap();
    assert!(is_mounted(&bind));
    assert!(
        std::fs::metadata(&bind)
            .unwrap()
            .file_type()
            .is_block_device()
    );
    scene
        .daemon
        .api()
        .unpublish(&unpublish_request("blk", "w1"))
        .await
        .unwrap();
    assert!(!is_mounted(&bind));
    assert_eq!(std::fs::read(&bind).unwrap(), b"the workload's");
    assert_released(&scene, "blk").await;
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
