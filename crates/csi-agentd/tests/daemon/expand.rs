//! Volume expansion through the real daemon and the real test plugin with
//! `--volume-fs tmpfs` (each volume a file system of its own capacity): the size seen inside
//! the published volume before and after, which RPCs the plugin received (its call log), and
//! the refusals made before any RPC (a plugin that cannot expand: 501; an OFFLINE plugin and
//! a published volume: 409 naming the claims; a smaller size: 400).
//!
//! Run as root under `unshare -m --propagation private` like the other daemon tests.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::Path;

use csi_agent_api::ErrorCode;
use csi_agent_testkit::*;

const MI: i64 = 1 << 20;

/// The daemon with the test plugin (tmpfs volumes `vol1`, `vol2` of 1 MiB) and these extra
/// plugin flags.
fn daemon_with(dir: &Path, plugin_flags: &[&str]) -> Daemon {
    require_private_mount_namespace();
    let mut config = managed_config(PLUGIN, &dir.join("plugin"), "vol1:1Mi,vol2:1Mi");
    let args = config["containers"][0]["command"]["arguments"]
        .as_array_mut()
        .unwrap();
    for flag in ["--volume-fs", "tmpfs"].iter().chain(plugin_flags) {
        args.push((*flag).into());
    }
    Daemon::builder(dir)
        .plugin_config("test.json", config)
        .start()
}

/// The size of the file system at `path` (`df`'s total).
fn fs_size(path: &Path) -> i64 {
    let fs = rustix::fs::statvfs(path).unwrap();
    (fs.f_blocks * fs.f_frsize) as i64
}

/// How many times the plugin received `method`.
fn calls_of(dir: &Path, method: &str) -> usize {
    let calls = std::fs::read_to_string(dir.join("plugin/calls.jsonl")).unwrap_or_default();
    calls
        .lines()
        .filter(|l| l.contains(&format!("\"{method}\"")))
        .count()
}

/// ONLINE, controller and node: a published volume grows inside (statvfs of the target and
/// of the workload's `bind_to` view), keeps its data, and shows its capacity; `csictl expand`
/// takes `32Mi`; a smaller size is a 400 that sends no RPC.
#[tokio::test]
async fn a_published_volume_grows_inside() {
    let dir = tempfile::tempdir().unwrap();
    let daemon = daemon_with(
        dir.path(),
        &[
            "--expansion",
            "online",
            "--controller-expand",
            "--node-expand",
        ],
    );
    let api = daemon.api();
    let published = api.publish(&publish_request("vol1", "w1")).await.unwrap();
    let target = Path::new(&published.target_path);
    assert_eq!(fs_size(target), MI);
    std::fs::write(target.join("data"), b"before").unwrap();

    let volume = api.expand_volume(PLUGIN, "vol1", 16 * MI).await.unwrap();
    assert_eq!(volume.capacity_bytes, Some(16 * MI), "{volume:?}");
    assert_eq!(volume.expansion, None, "{volume:?}");
    assert_eq!(fs_size(target), 16 * MI, "the file system grew inside");
    assert_eq!(std::fs::read(target.join("data")).unwrap(), b"before");
    // Room that was not there: 8 MiB into a volume that had 1.
    std::fs::write(target.join("big"), vec![7u8; 8 << 20]).unwrap();
    assert_eq!(calls_of(dir.path(), "ControllerExpandVolume"), 1);
    assert_eq!(calls_of(dir.path(), "NodeExpandVolume"), 1);

    let out = daemon.csictl(&["expand", PLUGIN, "vol1", "32Mi"]);
    assert!(out.status.success(), "{out:?}");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("capacity"), "{text}");
    assert_eq!(fs_size(target), 32 * MI);
    let shown = api.volume(PLUGIN, "vol1").await.unwrap();
    assert_eq!(shown.capacity_bytes, Some(32 * MI));

    let (status, body) = api_error(api.expand_volume(PLUGIN, "vol1", 8 * MI).await);
    assert_eq!(status, 400, "{body:?}");
    assert_eq!(body.code, ErrorCode::InvalidRequest);
    assert!(body.message.contains("never shrink"), "{}", body.message);
    let (status, _) = api_error(api.expand_volume(PLUGIN, "vol1", 0).await);
    assert_eq!(status, 400);
    let (status, body) = api_error(api.expand_volume(PLUGIN, "unknown", 8 * MI).await);
    assert_eq!(status, 404, "{body:?}");
    assert_eq!(
        calls_of(dir.path(), "ControllerExpandVolume"),
        2,
        "no RPC for a refusal"
    );

    api.unpublish(&unpublish_request("vol1", "w1"))
        .await
        .unwrap();
    assert!(mounts_under(&daemon.dir().join("csi")).is_empty());
}

/// A controller-only plugin grows the volume in ControllerExpandVolume alone; a node-only
/// one in NodeExpandVolume alone. Each receives only its own RPC.
#[tokio::test]
async fn controller_only_and_node_only_plugins() {
    for (flag, sent, not_sent) in [
        (
            "--controller-expand",
            "ControllerExpandVolume",
            "NodeExpandVolume",
        ),
        (
            "--node-expand",
            "NodeExpandVolume",
            "ControllerExpandVolume",
        ),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let daemon = daemon_with(dir.path(), &["--expansion", "online", flag]);
        let api = daemon.api();
        let published = api.publish(&publish_request("vol1", "w1")).await.unwrap();
        let target = Path::new(&published.target_path);
        let volume = api.expand_volume(PLUGIN, "vol1", 8 * MI).await.unwrap();
        assert_eq!(volume.capacity_bytes, Some(8 * MI), "{flag}");
        assert_eq!(fs_size(target), 8 * MI, "{flag}");
        assert_eq!(calls_of(dir.path(), sent), 1, "{flag}");
        assert_eq!(calls_of(dir.path(), not_sent), 0, "{flag}");
        api.unpublish(&unpublish_request("vol1", "w1"))
            .await
            .unwrap();
    }
}

/// A plugin that advertises neither EXPAND_VOLUME: 501 `unsupported` naming the capability,
/// and the plugin receives no expansion RPC.
#[tokio::test]
async fn a_plugin_that_cannot_expand_is_a_501_before_any_rpc() {
    let dir = tempfile::tempdir().unwrap();
    let daemon = daemon_with(dir.path(), &[]);
    let api = daemon.api();
    api.publish(&publish_request("vol1", "w1")).await.unwrap();
    // The publish asked GetPluginCapabilities (with NodeGetInfo, for topology and the volume
    // limit); the expansion must not ask it again.
    let asked_before = calls_of(dir.path(), "GetPluginCapabilities");
    let (status, body) = api_error(api.expand_volume(PLUGIN, "vol1", 8 * MI).await);
    assert_eq!(status, 501, "{body:?}");
    assert_eq!(body.code, ErrorCode::Unsupported);
    assert!(body.message.contains("EXPAND_VOLUME"), "{}", body.message);
    assert_eq!(calls_of(dir.path(), "ControllerExpandVolume"), 0);
    assert_eq!(calls_of(dir.path(), "NodeExpandVolume"), 0);
    assert_eq!(
        calls_of(dir.path(), "GetPluginCapabilities"),
        asked_before,
        "refused on the node and controller capabilities, without asking the expansion type"
    );
}

/// OFFLINE: refused while published (409 naming the claim), before any RPC; once
/// unpublished, the volume grows, and shows it when published again.
#[tokio::test]
async fn offline_expansion_is_refused_while_published() {
    let dir = tempfile::tempdir().unwrap();
    let daemon = daemon_with(
        dir.path(),
        &["--expansion", "offline", "--controller-expand"],
    );
    let api = daemon.api();
    // A created volume: its record outlives its claims (a pre-provisioned one is forgotten).
    api.create_volume(&csi_agent_api::CreateVolumeRequest {
        accessibility_requirements: None,
        content_source: None,
        plugin: PLUGIN.to_owned(),
        name: "made".to_owned(),
        capacity_bytes: MI,
        capability: capability(),
        parameters: Default::default(),
    })
    .await
    .unwrap();
    api.publish(&publish_request("made", "workload-a"))
        .await
        .unwrap();
    let (status, body) = api_error(api.expand_volume(PLUGIN, "made", 8 * MI).await);
    assert_eq!(status, 409, "{body:?}");
    assert_eq!(body.code, ErrorCode::Conflict);
    assert!(body.message.contains("workload-a"), "{}", body.message);
    assert!(body.message.contains("OFFLINE"), "{}", body.message);
    assert_eq!(calls_of(dir.path(), "ControllerExpandVolume"), 0);

    api.unpublish(&unpublish_request("made", "workload-a"))
        .await
        .unwrap();
    let volume = api.expand_volume(PLUGIN, "made", 8 * MI).await.unwrap();
    assert_eq!(volume.capacity_bytes, Some(8 * MI));
    let published = api
        .publish(&publish_request("made", "workload-a"))
        .await
        .unwrap();
    assert_eq!(fs_size(Path::new(&published.target_path)), 8 * MI);
    api.unpublish(&unpublish_request("made", "workload-a"))
        .await
        .unwrap();
}
