//! Plugin images end to end (issue #13): a real registry on loopback (`docker-registry`), an
//! image of `csi-testplugin` built here (the binary with the shared libraries and loader `ldd`
//! lists) and pushed with `skopeo`, a Mesos plugin config naming it in
//! `container.mesos.image`, the real `csi-agentd` pulling it and running it with runc, and a
//! volume published through csi-agent mounted on the host. Real mounts: run under
//! `unshare -m --propagation private`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde_json::json;

use csi_agent_testkit::image::*;
use csi_agent_testkit::registry::*;
use csi_agent_testkit::*;

const SECOND: &str = "org.example.second";
const BROKEN: &str = "org.example.broken";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mesos_config_naming_an_image_runs_the_plugin_from_the_registry() {
    csi_agent::mounts::require_private_mount_namespace();
    let dir = tempfile::Builder::new()
        .prefix("csi-image-")
        .tempdir_in("/tmp")
        .unwrap();
    let registry = Registry::start(&dir.path().join("registry")).unwrap();
    let plugin_dir = dir.path().join("plugin");
    let second_dir = dir.path().join("second");
    std::fs::create_dir_all(&plugin_dir).unwrap();
    std::fs::create_dir_all(&second_dir).unwrap();

    // The image: Entrypoint, Cmd and Env say how to run the plugin; the config says nothing.
    let layout = dir.path().join("layout");
    let image = oci_layout(
        &layout,
        &[plugin_layer()],
        json!({
            "Entrypoint": ["/bin/csi-testplugin"],
            "Cmd": ["--volumes", "vol1:1M,vol2:1M", "--node-id", "node-1"],
            "Env": [format!("CSI_TESTPLUGIN_WORK_DIR={}", plugin_dir.display())],
            "WorkingDir": "/bin",
        }),
    )
    .unwrap();
    push(&layout, &registry, "csi/testplugin:v1").unwrap();
    let pushed_gets = registry.blob_gets(None);

    let host = registry.host();
    let containers = Containers(dir.path().join("sockets/runc"));
    // A quota of its own, so that the listing is seen to report the flag, not the default.
    let quota = (1u64 << 30) + 4096;
    let mut daemon = Daemon::new(
        dir.path(),
        &[
            "--docker-registry",
            &host,
            "--insecure-registry",
            &host,
            "--image-store-max-bytes",
            &quota.to_string(),
        ],
    );
    // A Mesos CSIPluginInfo: no runtime, no command; the image is in container.mesos.image.
    daemon.add_config(
        "test.json",
        &json!({
            "type": PLUGIN,
            "containers": [component(
                &["CONTROLLER_SERVICE", "NODE_SERVICE"],
                json!({"type": "MESOS",
                       "mesos": {"image": {"type": "DOCKER", "docker": {"name": "csi/testplugin:v1"}}},
                       "volumes": [volume(&plugin_dir)]}),
            )],
            "startup_timeout_ms": 20000,
            "restart_backoff": {"initial_ms": 100, "max_ms": 500},
        }),
    );
    daemon.start();
    let api = daemon.api();

    let published = api.publish(&publish_request("vol1", "w1")).await.unwrap();
    let target = PathBuf::from(&published.target_path);
    assert!(
        is_mounted(&target),
        "{} is not mounted on the host",
        target.display()
    );
    std::fs::write(target.join("file"), b"from the host").unwrap();
    assert_eq!(
        std::fs::read(plugin_dir.join("volumes/vol1/file")).unwrap(),
        b"from the host"
    );

    // It runs on the image's root, read-only, in the image's WorkingDir, not on the host's.
    let info = wait_plugin(&daemon, PLUGIN, "the plugin ready", |i| {
        ready_pid(i).is_some()
    })
    .await;
    let pid = ready_pid(&info).unwrap();
    let root = PathBuf::from(format!("/proc/{pid}/root"));
    assert!(root.join("bin/csi-testplugin").is_file());
    assert!(
        !root.join("etc/passwd").exists(),
        "the plugin sees the host's root"
    );
    assert_eq!(
        std::fs::read_link(format!("/proc/{pid}/cwd")).unwrap(),
        PathBuf::from("/bin")
    );
    let err = std::fs::write(root.join("probe"), b"x").unwrap_err();
    assert_eq!(err.raw_os_error(), Some(30), "{err}");
    // The image's one layer is unpacked once in the store, under its chain id (for a first
    // layer, the digest of the blob skopeo pushed: it compresses the plain layer, so that is
    // not the layout's), and the container's root is an overlay of it under an upper dir of
    // its own; no flattened copy is made.
    let prepared = dir_names(&daemon.work.join("images/layers"));
    assert_eq!(prepared.len(), 1, "{prepared:?}");
    assert_eq!(prepared[0].len(), 64, "{prepared:?}");
    let layer = daemon.work.join("images/layers").join(&prepared[0]);
    assert!(layer.join("bin/csi-testplugin").is_file());
    assert!(dir_names(&daemon.work.join("images/rootfs")).is_empty());
    assert_eq!(
        overlays_under(&daemon.work).len(),
        1,
        "{:?}",
        overlays_under(&daemon.work)
    );
    let _ = image;
    let first_gets = registry.blob_gets(None) - pushed_gets;
    assert_eq!(first_gets, 2, "the layer and the config, once each");
    // The daemon's log says what was downloaded and when the image was ready.
    let log = std::fs::read_to_string(dir.path().join("daemon.log")).unwrap();
    assert_eq!(
        log.matches("blob downloaded and verified").count(),
        2,
        "{log}"
    );
    assert!(log.contains("image ready"), "{log}");

    // A second plugin of the same image (named the Docker-containerizer way, with its
    // registry host): its arguments replace Cmd, its environment wins over the image's.
    // Nothing is downloaded again.
    daemon.add_config(
        "second.json",
        &json!({
            "type": SECOND,
            "containers": [{
                "services": ["CONTROLLER_SERVICE", "NODE_SERVICE"],
                "command": {
                    "shell": false,
                    "arguments": ["--volumes", "v9:1M", "--node-id", "node-1",
                                  "--plugin-name", SECOND],
                    "environment": {"variables": [
                        {"name": "CSI_TESTPLUGIN_WORK_DIR", "value": second_dir}]}
                },
                "container": {"type": "DOCKER",
                              "docker": {"image": format!("{host}/csi/testplugin:v1")},
                              "volumes": [volume(&second_dir)]}
            }],
            // Its root writable: what it writes lands in its own upper dir.
            "runtime": {"kind": "oci", "readonly_rootfs": false},
            "startup_timeout_ms": 20000,
        }),
    );
    // And one whose image does not exist: it reports that, the others are unaffected.
    daemon.add_config(
        "broken.json",
        &json!({
            "type": BROKEN,
            "containers": [component(
                &["CONTROLLER_SERVICE", "NODE_SERVICE"],
                json!({"mesos": {"image": {"type": "DOCKER", "docker": {"name": "csi/testplugin:nope"}}}}),
            )],
            "restart_backoff": {"initial_ms": 100, "max_ms": 500},
        }),
    );
    api.reload().await.unwrap();
    let mut request = publish_request("v9", "w9");
    request.plugin = SECOND.to_owned();
    let second = api.publish(&request).await.unwrap();
    assert!(is_mounted(Path::new(&second.target_path)));
    assert!(second_dir.join("volumes/v9").is_dir());
    assert_eq!(
        registry.blob_gets(None) - pushed_gets,
        first_gets,
        "the second plugin downloaded a blob"
    );
    // The same layer dir under both containers, each with its own overlay; nothing unpacked
    // again.
    assert_eq!(dir_names(&daemon.work.join("images/layers")), prepared);
    assert_eq!(
        overlays_under(&daemon.work).len(),
        2,
        "{:?}",
        overlays_under(&daemon.work)
    );
    let second_info = wait_plugin(&daemon, SECOND, "the second plugin ready", |i| {
        ready_pid(i).is_some()
    })
    .await;
    let second_root = PathBuf::from(format!("/proc/{}/root", ready_pid(&second_info).unwrap()));
    std::fs::write(second_root.join("written-by-second"), b"upper").unwrap();
    assert!(second_root.join("bin/csi-testplugin").is_file());
    assert!(
        !root.join("written-by-second").exists(),
        "the first plugin sees the second's write"
    );
    assert!(
        !layer.join("written-by-second").exists(),
        "a write reached the shared layer"
    );

    let mut request = publish_request("vol1", "w1");
    request.plugin = BROKEN.to_owned();
    let api_broken = daemon.api();
    let attempt = tokio::spawn(async move { api_broken.publish(&request).await });
    let info = wait_plugin(&daemon, BROKEN, "the pull failure reported", |i| {
        i.components
            .first()
            .and_then(|c| c.error.as_deref())
            .is_some_and(|e| e.contains("not found"))
    })
    .await;
    assert!(ready_pid(&info).is_none());
    attempt.abort();
    // The first plugin still serves.
    api.unpublish(&unpublish_request("vol1", "w1"))
        .await
        .unwrap();
    assert!(!is_mounted(&target));
    let info = api.plugin(PLUGIN).await.unwrap();
    assert_eq!(ready_pid(&info), Some(pid), "{info:?}");

    // The API: the store's images and who uses them; a pull of a cached image downloads
    // nothing; an unknown tag is 404.
    let images = api.images().await.unwrap();
    assert_eq!(images.images.len(), 1, "{images:?}");
    let listed = &images.images[0];
    assert_eq!(listed.reference, format!("{host}/csi/testplugin:v1"));
    assert_eq!(listed.manifest.len(), "sha256:".len() + 64, "{listed:?}");
    // Sorted by plugin type.
    assert_eq!(listed.used_by, vec![SECOND.to_owned(), PLUGIN.to_owned()]);
    // The store's size: one image, so its blobs are exactly its declared config and layers.
    assert_eq!(images.blob_bytes, listed.size, "{images:?}");
    // On disk, against the quota: the blobs plus the unpacked layer (the binary alone is
    // larger than the compressed config), measured as the quota is (du of the store dir).
    assert_eq!(images.store_max_bytes, quota, "{images:?}");
    let binary_len = std::fs::metadata(binary("csi-testplugin")).unwrap().len();
    assert!(
        images.store_bytes >= images.blob_bytes + binary_len,
        "the store's size counts the blobs and the unpacked root: {images:?}"
    );
    let du = csi_agent::image::budget::disk_usage(&daemon.work.join("images")).unwrap();
    assert_eq!(images.store_bytes, du, "{images:?}");
    let text = String::from_utf8(daemon.csictl(&["images"]).stdout).unwrap();
    assert!(
        text.contains(&format!("blobs: {} bytes", listed.size))
            && text.contains(&format!("on disk of a {quota} (1.0Gi) quota")),
        "{text}"
    );
    let gets = registry.blob_gets(None);
    let pulled = api.pull_image("csi/testplugin:v1").await.unwrap();
    assert!(pulled.downloaded.is_empty(), "{pulled:?}");
    assert_eq!(registry.blob_gets(None), gets);
    let err = api.pull_image("csi/testplugin:nope").await.unwrap_err();
    assert!(
        matches!(&err, csi_agent_api::ApiError::Api { status: 404, .. }),
        "{err:?}"
    );
    // A prune keeps what configured plugins name.
    let pruned = api.prune_images().await.unwrap();
    assert!(pruned.removed.is_empty(), "{pruned:?}");
    assert_eq!(api.images().await.unwrap().images.len(), 1);

    // The configs removed: every container stopped and deleted.
    for file in ["test.json", "second.json", "broken.json"] {
        std::fs::remove_file(daemon.configs.join(file)).unwrap();
    }
    api.unpublish(&{
        let mut request = unpublish_request("v9", "w9");
        request.plugin = SECOND.to_owned();
        request
    })
    .await
    .unwrap();
    api.reload().await.unwrap();
    containers.wait_gone().await;

    // No config names the image any more: a prune removes it, its root and its blobs.
    let pruned = api.prune_images().await.unwrap();
    assert_eq!(
        pruned.removed,
        vec![format!("{host}/csi/testplugin:v1")],
        "{pruned:?}"
    );
    assert_eq!(
        (
            pruned.rootfs_removed,
            pruned.layers_removed,
            pruned.blobs_removed
        ),
        (0, 1, 2),
        "{pruned:?}"
    );
    assert!(
        overlays_under(&daemon.work).is_empty(),
        "{:?}",
        overlays_under(&daemon.work)
    );
    assert!(api.images().await.unwrap().images.is_empty());
    let images = daemon.work.join("images");
    for dir in ["rootfs", "layers", "blobs/sha256"] {
        let left: Vec<_> = std::fs::read_dir(images.join(dir)).unwrap().collect();
        assert!(left.is_empty(), "{dir} keeps {left:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_daemon_killed_mid_pull_finishes_on_restart_and_keeps_no_partial_blob() {
    csi_agent::mounts::require_private_mount_namespace();
    let dir = tempfile::Builder::new()
        .prefix("csi-image-")
        .tempdir_in("/tmp")
        .unwrap();
    let registry = Registry::start(&dir.path().join("registry")).unwrap();
    let plugin_dir = dir.path().join("plugin");
    std::fs::create_dir_all(&plugin_dir).unwrap();
    let layout = dir.path().join("layout");
    oci_layout(
        &layout,
        &[plugin_layer()],
        json!({
            "Entrypoint": ["/bin/csi-testplugin"],
            "Cmd": ["--volumes", "vol1:1M", "--node-id", "node-1"],
            "Env": [format!("CSI_TESTPLUGIN_WORK_DIR={}", plugin_dir.display())],
        }),
    )
    .unwrap();
    push(&layout, &registry, "csi/testplugin:v1").unwrap();
    let host = registry.host();
    let containers = Containers(dir.path().join("sockets/runc"));
    let mut daemon = Daemon::new(
        dir.path(),
        &["--docker-registry", &host, "--insecure-registry", &host],
    );
    daemon.add_config(
        "test.json",
        &json!({
            "type": PLUGIN,
            "containers": [component(
                &["CONTROLLER_SERVICE", "NODE_SERVICE"],
                json!({"mesos": {"image": {"type": "DOCKER", "docker": {"name": "csi/testplugin:v1"}}},
                       "volumes": [volume(&plugin_dir)]}),
            )],
            "startup_timeout_ms": 20000,
            "restart_backoff": {"initial_ms": 100, "max_ms": 500},
        }),
    );
    daemon.start();
    let blobs = daemon.work.join("images/blobs/sha256");
    // With overlayfs (this host has it) the image's layers are unpacked under `layers/`.
    let rootfs = daemon.work.join("images/layers");
    // A publish makes the plugin start, which pulls; the daemon is SIGKILLed as soon as a
    // blob is being written or a layer being unpacked.
    let api = daemon.api();
    let attempt = tokio::spawn(async move { api.publish(&publish_request("vol1", "w1")).await });
    let deadline = Instant::now() + Duration::from_secs(60);
    let caught = loop {
        let (b, r) = (temp_names(&blobs), temp_names(&rootfs));
        if !b.is_empty() || !r.is_empty() {
            break (b, r);
        }
        assert!(Instant::now() < deadline, "never saw a pull in progress");
        std::thread::sleep(Duration::from_micros(200));
    };
    daemon.kill9();
    attempt.abort();
    eprintln!("killed mid-pull with temp files {caught:?}");
    assert!(
        !temp_names(&blobs).is_empty() || !temp_names(&rootfs).is_empty(),
        "the kill left nothing half-done: it did not interrupt the pull"
    );

    // Restarted, and killed again while the root file system is being built (the blobs are
    // all there by then, or being finished).
    daemon.start();
    let api = daemon.api();
    let attempt = tokio::spawn(async move { api.publish(&publish_request("vol1", "w1")).await });
    let deadline = Instant::now() + Duration::from_secs(60);
    while temp_names(&rootfs).is_empty() {
        // Only a complete rootfs (a name not starting with `.tmp-`) means it was missed.
        let complete = std::fs::read_dir(&rootfs).is_ok_and(|entries| {
            entries
                .flatten()
                .any(|e| !e.file_name().to_string_lossy().starts_with(".tmp-"))
        });
        assert!(
            Instant::now() < deadline && !complete,
            "never saw the root file system being built"
        );
        std::thread::sleep(Duration::from_micros(200));
    }
    daemon.kill9();
    attempt.abort();
    assert!(
        !temp_names(&rootfs).is_empty(),
        "the kill did not interrupt the unpacking"
    );

    // Restarted: the leftovers are removed before anything uses the store, the pull
    // finishes, the plugin runs from the image.
    daemon.start();
    let published = daemon
        .api()
        .publish(&publish_request("vol1", "w1"))
        .await
        .unwrap();
    assert!(is_mounted(Path::new(&published.target_path)));
    assert_eq!(temp_names(&blobs), Vec::<String>::new());
    assert_eq!(temp_names(&rootfs), Vec::<String>::new());
    assert_eq!(
        temp_names(&daemon.work.join("images")),
        Vec::<String>::new()
    );
    // Every blob kept is whole: it hashes to its name.
    let names: Vec<String> = std::fs::read_dir(&blobs)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(names.len(), 2, "{names:?}");
    for name in &names {
        assert_eq!(&sha256_hex(&std::fs::read(blobs.join(name)).unwrap()), name);
    }
    let info = wait_plugin(&daemon, PLUGIN, "the plugin ready", |i| {
        ready_pid(i).is_some()
    })
    .await;
    let pid = ready_pid(&info).unwrap();
    assert!(Path::new(&format!("/proc/{pid}/root/bin/csi-testplugin")).is_file());

    let api = daemon.api();
    api.unpublish(&unpublish_request("vol1", "w1"))
        .await
        .unwrap();
    std::fs::remove_file(daemon.configs.join("test.json")).unwrap();
    api.reload().await.unwrap();
    containers.wait_gone().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_registry_down_is_reported_on_the_plugin_and_the_pull_retried_once_it_is_back() {
    csi_agent::mounts::require_private_mount_namespace();
    let dir = tempfile::Builder::new()
        .prefix("csi-image-")
        .tempdir_in("/tmp")
        .unwrap();
    let mut registry = Registry::start(&dir.path().join("registry")).unwrap();
    let plugin_dir = dir.path().join("plugin");
    std::fs::create_dir_all(&plugin_dir).unwrap();
    let layout = dir.path().join("layout");
    oci_layout(
        &layout,
        &[plugin_layer()],
        json!({
            "Entrypoint": ["/bin/csi-testplugin"],
            "Cmd": ["--volumes", "vol1:1M", "--node-id", "node-1"],
            "Env": [format!("CSI_TESTPLUGIN_WORK_DIR={}", plugin_dir.display())],
        }),
    )
    .unwrap();
    push(&layout, &registry, "csi/testplugin:v1").unwrap();
    registry.stop();

    let host = registry.host();
    let containers = Containers(dir.path().join("sockets/runc"));
    let mut daemon = Daemon::new(
        dir.path(),
        &["--docker-registry", &host, "--insecure-registry", &host],
    );
    daemon.add_config(
        "test.json",
        &json!({
            "type": PLUGIN,
            "containers": [component(
                &["CONTROLLER_SERVICE", "NODE_SERVICE"],
                json!({"mesos": {"image": {"type": "DOCKER", "docker": {"name": "csi/testplugin:v1"}}},
                       "volumes": [volume(&plugin_dir)]}),
            )],
            "startup_timeout_ms": 20000,
            "restart_backoff": {"initial_ms": 100, "max_ms": 1000},
        }),
    );
    daemon.start();
    let api = daemon.api();
    let attempt = tokio::spawn(async move { api.publish(&publish_request("vol1", "w1")).await });
    let info = wait_plugin(&daemon, PLUGIN, "the registry reported unreachable", |i| {
        i.components
            .first()
            .and_then(|c| c.error.as_deref())
            .is_some_and(|e| e.contains("unreachable"))
    })
    .await;
    assert!(ready_pid(&info).is_none());
    // Retried with the backoff, still failing while the registry is down.
    let failing = wait_plugin(&daemon, PLUGIN, "a retry", |i| {
        i.components.first().is_some_and(|c| c.restarts >= 2)
    })
    .await;
    assert!(ready_pid(&failing).is_none());

    registry.restart().unwrap();
    let info = wait_plugin(
        &daemon,
        PLUGIN,
        "the plugin ready once the registry is back",
        |i| ready_pid(i).is_some(),
    )
    .await;
    assert!(info.components[0].restarts >= 2, "{info:?}");
    attempt.abort();
    let published = daemon
        .api()
        .publish(&publish_request("vol1", "w1"))
        .await
        .unwrap();
    assert!(is_mounted(Path::new(&published.target_path)));

    let api = daemon.api();
    api.unpublish(&unpublish_request("vol1", "w1"))
        .await
        .unwrap();
    std::fs::remove_file(daemon.configs.join("test.json")).unwrap();
    api.reload().await.unwrap();
    containers.wait_gone().await;
}

/// The overlay mounts under `dir` in this mount namespace.
fn overlays_under(dir: &Path) -> Vec<PathBuf> {
    csi_agent::mounts::MountTable::read()
        .unwrap()
        .entries()
        .iter()
        .filter(|m| m.fs_type == "overlay" && m.mount_point.starts_with(dir))
        .map(|m| m.mount_point.clone())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_daemon_killed_while_starting_a_container_from_an_image_leaves_one_and_no_overlay() {
    csi_agent::mounts::require_private_mount_namespace();
    let dir = tempfile::Builder::new()
        .prefix("csi-image-fp-")
        .tempdir_in("/tmp")
        .unwrap();
    let registry = Registry::start(&dir.path().join("registry")).unwrap();
    let layout = dir.path().join("layout");
    oci_layout(
        &layout,
        &[plugin_layer()],
        json!({"Entrypoint": ["/bin/csi-testplugin"]}),
    )
    .unwrap();
    push(&layout, &registry, "csi/testplugin:v1").unwrap();
    let host = registry.host();
    for point in [
        csi_agent::runtime::oci::FP_AFTER_OVERLAY,
        csi_agent::runtime::oci::FP_AFTER_CREATE,
        csi_agent::runtime::oci::FP_AFTER_START,
    ] {
        let run = dir.path().join(point);
        let plugin_dir = run.join("plugin");
        std::fs::create_dir_all(&plugin_dir).unwrap();
        let containers = Containers(run.join("sockets/runc"));
        let mut daemon = Daemon::new(
            &run,
            &["--docker-registry", &host, "--insecure-registry", &host],
        );
        daemon.add_config(
            "test.json",
            &json!({
                "type": PLUGIN,
                "containers": [{
                    "services": ["CONTROLLER_SERVICE", "NODE_SERVICE"],
                    "command": {"shell": false, "arguments": [
                        "--volumes", "vol1:1M", "--node-id", "node-1"],
                        "environment": {"variables": [
                            {"name": "CSI_TESTPLUGIN_WORK_DIR", "value": plugin_dir}]}},
                    "container": {"type": "MESOS",
                        "mesos": {"image": {"type": "DOCKER", "docker": {"name": "csi/testplugin:v1"}}},
                        "volumes": [volume(&plugin_dir)]}
                }],
                "startup_timeout_ms": 20000,
                "restart_backoff": {"initial_ms": 100, "max_ms": 500},
            }),
        );
        daemon.env.push((
            csi_agent::failpoint::ENV_VAR.to_owned(),
            format!("{point}=exit"),
        ));
        daemon.start();
        let failed = daemon.api().publish(&publish_request("vol1", "w1")).await;
        assert!(failed.is_err(), "{point}: the publish succeeded");
        daemon.wait_exit();
        // What the kill left: the overlay mounted, and a container from the second point on.
        assert_eq!(overlays_under(&run).len(), 1, "{point}");

        daemon.env.clear();
        daemon.start();
        let api = daemon.api();
        let published = api.publish(&publish_request("vol1", "w1")).await.unwrap();
        assert!(is_mounted(Path::new(&published.target_path)), "{point}");
        let info = wait_plugin(&daemon, PLUGIN, "the plugin ready", |i| {
            ready_pid(i).is_some()
        })
        .await;
        let pid = ready_pid(&info).unwrap();
        assert!(Path::new(&format!("/proc/{pid}/root/bin/csi-testplugin")).is_file());
        assert_eq!(
            containers.list().len(),
            1,
            "{point}: {:?}",
            containers.list()
        );
        // One overlay: the leftover was unmounted before the relaunch mounted afresh.
        assert_eq!(
            overlays_under(&run).len(),
            1,
            "{point}: {:?}",
            overlays_under(&run)
        );

        api.unpublish(&unpublish_request("vol1", "w1"))
            .await
            .unwrap();
        std::fs::remove_file(daemon.configs.join("test.json")).unwrap();
        api.reload().await.unwrap();
        let deadline = Instant::now() + Duration::from_secs(20);
        while !containers.list().is_empty() || !overlays_under(&run).is_empty() {
            assert!(
                Instant::now() < deadline,
                "{point}: left {:?} {:?}",
                containers.list(),
                overlays_under(&run)
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        // No upper dir is left either.
        let uppers: Vec<PathBuf> = walk_dirs(&daemon.work)
            .into_iter()
            .filter(|p| p.ends_with(csi_agent::runtime::oci::OVERLAY_DIR))
            .collect();
        assert_eq!(uppers, Vec::<PathBuf>::new(), "{point}");
        drop(daemon);
    }
}

/// Every directory beneath `dir`, symlinks not followed.
fn walk_dirs(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let Ok(entries) = std::fs::read_dir(dir) else {
        return out;
    };
    for entry in entries.flatten() {
        if entry.file_type().is_ok_and(|t| t.is_dir()) {
            out.push(entry.path());
            out.extend(walk_dirs(&entry.path()));
        }
    }
    out
}
