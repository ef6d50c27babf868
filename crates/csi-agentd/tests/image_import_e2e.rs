//! Image import end to end (issue #13, nodes without a registry): an image of `csi-testplugin`
//! built here, exported by `skopeo` to an `oci-archive:` and a `docker-archive:`, imported
//! through the real `csi-agentd` with `csictl image import` and `ApiClient::import_image`, then
//! Mesos plugin configs naming those images start the plugin in runc and publish a volume, with
//! no registry anywhere. Hostile archives and one over `--image-import-max-bytes` are refused,
//! leaving the store as it was. Real mounts: run under `unshare -m --propagation private`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};

use serde_json::json;

use csi_agent_testkit::image::*;
use csi_agent_testkit::registry::*;
use csi_agent_testkit::*;

const DOCKER_PLUGIN: &str = "org.example.docker";

/// Every blob name and temp name in the store's `blobs/sha256`.
fn blob_names(work: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(work.join("images/blobs/sha256"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

fn mesos_config(plugin_type: &str, image: &str, plugin_dir: &Path) -> serde_json::Value {
    json!({
        "type": plugin_type,
        "containers": [component(
            &["CONTROLLER_SERVICE", "NODE_SERVICE"],
            json!({"type": "MESOS",
                   "mesos": {"image": {"type": "DOCKER", "docker": {"name": image}}},
                   "volumes": [volume(plugin_dir)]}),
        )],
        "startup_timeout_ms": 20000,
        "restart_backoff": {"initial_ms": 100, "max_ms": 500},
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn archives_imported_through_the_daemon_run_the_plugin_without_a_registry() {
    csi_agent::mounts::require_private_mount_namespace();
    let dir = tempfile::Builder::new()
        .prefix("csi-import-")
        .tempdir_in("/tmp")
        .unwrap();
    let plugin_dir = dir.path().join("plugin");
    let docker_dir = dir.path().join("docker");
    std::fs::create_dir_all(&plugin_dir).unwrap();
    std::fs::create_dir_all(&docker_dir).unwrap();
    // One image; its Env names no state dir: each config's arguments and environment do.
    let layout = dir.path().join("layout");
    oci_layout(
        &layout,
        &[plugin_layer()],
        json!({"Entrypoint": ["/bin/csi-testplugin"], "WorkingDir": "/bin"}),
    )
    .unwrap();
    let oci_file = dir.path().join("oci.tar");
    let docker_file = dir.path().join("docker.tar");
    export(&layout, "oci-archive", &oci_file, "csi/testplugin:oci").unwrap();
    export(
        &layout,
        "docker-archive",
        &docker_file,
        "csi/testplugin:docker",
    )
    .unwrap();
    let biggest = std::fs::metadata(&oci_file)
        .unwrap()
        .len()
        .max(std::fs::metadata(&docker_file).unwrap().len());
    let max = biggest + 64 * 1024;

    // The default registry is Docker Hub, as skopeo's docker-archive names say; no registry
    // is reachable for these names, so a pull could only fail.
    let containers = Containers(dir.path().join("sockets/runc"));
    let mut daemon = Daemon::new(dir.path(), &["--image-import-max-bytes", &max.to_string()]);
    daemon.start();
    let api = daemon.api();

    // The oci-archive through csictl, as an operator does.
    let out = daemon.csictl(&["-o", "json", "image", "import", oci_file.to_str().unwrap()]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let answer: csi_agent_api::ImageImportResponse = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(answer.images.len(), 1, "{answer:?}");
    assert_eq!(
        answer.images[0].reference,
        "registry-1.docker.io/csi/testplugin:oci"
    );
    assert_eq!(answer.images[0].layers.len(), 1);
    // The docker-archive through the client.
    let length = std::fs::metadata(&docker_file).unwrap().len();
    let answer = api
        .import_image(
            std::fs::File::open(&docker_file).unwrap(),
            Some(length),
            None,
        )
        .await
        .unwrap();
    assert_eq!(
        answer.images[0].reference,
        "registry-1.docker.io/csi/testplugin:docker"
    );
    // The layout directory itself, packed by csictl on the fly, under a name given.
    let out = daemon.csictl(&[
        "image",
        "import",
        layout.to_str().unwrap(),
        "--name",
        "csi/testplugin:dir",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("registry-1.docker.io/csi/testplugin:dir"),
        "{text}"
    );
    let listed = api.images().await.unwrap();
    assert_eq!(listed.images.len(), 3, "{listed:?}");
    let blobs_before = blob_names(&daemon.work);

    // Mesos configs naming the imported images (cached: true by default).
    let mut oci = mesos_config(PLUGIN, "csi/testplugin:oci", &plugin_dir);
    oci["containers"][0]["command"] = json!({
        "shell": false,
        "arguments": ["--volumes", "vol1:1M", "--node-id", "node-1"],
        "environment": {"variables": [{"name": "CSI_TESTPLUGIN_WORK_DIR", "value": plugin_dir}]},
    });
    daemon.add_config("oci.json", &oci);
    let mut docker = mesos_config(DOCKER_PLUGIN, "csi/testplugin:docker", &docker_dir);
    docker["containers"][0]["command"] = json!({
        "shell": false,
        "arguments": ["--volumes", "d1:1M", "--node-id", "node-1", "--plugin-name", DOCKER_PLUGIN],
        "environment": {"variables": [{"name": "CSI_TESTPLUGIN_WORK_DIR", "value": docker_dir}]},
    });
    daemon.add_config("docker.json", &docker);
    api.reload().await.unwrap();

    let published = api.publish(&publish_request("vol1", "w1")).await.unwrap();
    let target = PathBuf::from(&published.target_path);
    assert!(is_mounted(&target), "{}", target.display());
    std::fs::write(target.join("file"), b"imported").unwrap();
    assert_eq!(
        std::fs::read(plugin_dir.join("volumes/vol1/file")).unwrap(),
        b"imported"
    );
    let mut request = publish_request("d1", "w2");
    request.plugin = DOCKER_PLUGIN.to_owned();
    let second = api.publish(&request).await.unwrap();
    assert!(is_mounted(Path::new(&second.target_path)));
    // Both run in runc on the image's root, not the host's.
    for plugin in [PLUGIN, DOCKER_PLUGIN] {
        let info = wait_plugin(&daemon, plugin, "the plugin ready", |i| {
            ready_pid(i).is_some()
        })
        .await;
        let root = PathBuf::from(format!("/proc/{}/root", ready_pid(&info).unwrap()));
        assert!(root.join("bin/csi-testplugin").is_file(), "{plugin}");
        assert!(!root.join("etc/passwd").exists(), "{plugin} sees the host");
    }
    assert_eq!(containers.list().len(), 2, "{:?}", containers.list());
    // Nothing was pulled: no download, no new blob.
    let log = std::fs::read_to_string(dir.path().join("daemon.log")).unwrap();
    assert!(!log.contains("blob downloaded"), "{log}");
    assert!(log.matches("image imported").count() >= 3, "{log}");
    assert_eq!(blob_names(&daemon.work), blobs_before);

    // Hostile archives and an oversized one, through the daemon: refused, naming the file or
    // the limit, the store as it was, nothing beside it.
    let mut files = layout_files(&layout);
    files.push(("../escaped".to_owned(), b"x".to_vec()));
    let hostile = dir.path().join("hostile.tar");
    std::fs::write(&hostile, archive_of(&files)).unwrap();
    let out = daemon.csictl(&["image", "import", hostile.to_str().unwrap()]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("../escaped"), "{err}");
    assert!(!dir.path().join("escaped").exists());
    assert!(!daemon.work.join("escaped").exists());

    // Over the limit by 1 MiB, less than the daemon drains after refusing (MAX_DRAIN_BYTES):
    // far beyond it, the daemon closes the connection and the client, still sending, sees a
    // broken pipe instead of the answer (a debug build's image is near 64 MiB compressed, so
    // "the layout plus the limit" crossed that line on some machines and not on others).
    let big = archive_of(&[("padding".to_owned(), vec![0u8; max as usize + (1 << 20)])]);
    let length = big.len() as u64;
    // Declared too large: refused before a byte is read.
    let err = api
        .import_image(std::io::Cursor::new(big), Some(length), None)
        .await
        .unwrap_err();
    match &err {
        csi_agent_api::ApiError::Api { status, body } => {
            assert_eq!(*status, 413, "{err}");
            assert!(body.message.contains("--image-import-max-bytes"), "{err}");
        }
        other => panic!("not a 413: {other:?}"),
    }
    // Chunked (no length): refused once the limit is read, over it by as much.
    let over = archive_of(&[("padding".to_owned(), vec![0u8; max as usize + (1 << 20)])]);
    let err = api
        .import_image(std::io::Cursor::new(over), None, None)
        .await
        .unwrap_err();
    match &err {
        csi_agent_api::ApiError::Api { status, body } => {
            assert_eq!(*status, 413, "{err}");
            assert!(body.message.contains("--image-import-max-bytes"), "{err}");
        }
        other => panic!("not a 413: {other:?}"),
    }
    // Not a tar body type: 415.
    let out = std::process::Command::new("curl")
        .args([
            "-s",
            "-o",
            "/dev/null",
            "-w",
            "%{http_code}",
            "--unix-socket",
        ])
        .arg(&daemon.socket)
        .args([
            "-H",
            "Content-Type: application/json",
            "--data-binary",
            "{}",
            "http://localhost/v1/images/import",
        ])
        .output();
    if let Ok(out) = out {
        assert_eq!(String::from_utf8_lossy(&out.stdout), "415");
    }
    assert_eq!(api.images().await.unwrap().images.len(), 3);
    assert_eq!(blob_names(&daemon.work), blobs_before, "a blob was left");
    assert!(temp_names(&daemon.work.join("images")).is_empty());
    // Another route keeps its small limit.
    let err = api.pull_image(&"x".repeat(2 << 20)).await.unwrap_err();
    assert!(
        matches!(&err, csi_agent_api::ApiError::Api { status: 413, .. }),
        "{err}"
    );

    // Clean up: the plugins and their containers.
    api.unpublish(&unpublish_request("vol1", "w1"))
        .await
        .unwrap();
    let mut request = unpublish_request("d1", "w2");
    request.plugin = DOCKER_PLUGIN.to_owned();
    api.unpublish(&request).await.unwrap();
    for file in ["oci.json", "docker.json"] {
        std::fs::remove_file(daemon.configs.join(file)).unwrap();
    }
    api.reload().await.unwrap();
    containers.wait_gone().await;
}
