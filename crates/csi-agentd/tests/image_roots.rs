//! Plugin images run as real images do, and an image's root and config are hostile input
//! (issue #23, items 1, 6 and 7): the real `csi-agentd` pulls images built here from a real
//! registry on loopback (`docker-registry`) and runs them with runc. Real mounts: run under
//! `unshare -m --propagation private`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};

use serde_json::{Value, json};

use csi_agent_testkit::image::*;
use csi_agent_testkit::registry::*;
use csi_agent_testkit::*;

const SECOND: &str = "org.example.second";

/// A plain layer tar: `(path, what)` in order.
#[derive(Clone, Copy)]
enum Item<'a> {
    Dir,
    File(&'a [u8], u32),
    /// The host file at this path, as it is.
    HostFile(&'a Path),
    Symlink(&'a str),
    HardLink(&'a str),
}

fn layer<S: AsRef<str>>(items: &[(S, Item<'_>)]) -> Vec<u8> {
    let mut builder = tar::Builder::new(Vec::new());
    for (path, item) in items {
        let path = path.as_ref();
        let mut header = tar::Header::new_gnu();
        header.set_uid(0);
        header.set_gid(0);
        header.set_mtime(1_700_000_000);
        match item {
            Item::Dir => {
                header.set_entry_type(tar::EntryType::Directory);
                header.set_mode(0o755);
                header.set_size(0);
                builder.append_data(&mut header, path, &[][..]).unwrap();
            }
            Item::File(data, mode) => {
                header.set_entry_type(tar::EntryType::Regular);
                header.set_mode(*mode);
                header.set_size(data.len() as u64);
                builder.append_data(&mut header, path, *data).unwrap();
            }
            Item::HostFile(source) => {
                let data = std::fs::read(source).unwrap();
                header.set_entry_type(tar::EntryType::Regular);
                header.set_mode(0o755);
                header.set_size(data.len() as u64);
                builder
                    .append_data(&mut header, path, data.as_slice())
                    .unwrap();
            }
            Item::Symlink(target) | Item::HardLink(target) => {
                header.set_entry_type(if matches!(item, Item::Symlink(_)) {
                    tar::EntryType::Symlink
                } else {
                    tar::EntryType::Link
                });
                header.set_mode(0o777);
                header.set_size(0);
                builder.append_link(&mut header, path, target).unwrap();
            }
        }
    }
    builder.into_inner().unwrap()
}

/// Waits for `plugin`'s launch error to say all of `wanted`, and returns it.
async fn wait_error(daemon: &Daemon, plugin: &str, wanted: &[&str]) -> String {
    let what = format!("{plugin}'s launch error with {wanted:?}");
    let info = wait_plugin(daemon, plugin, &what, |i| {
        i.components
            .first()
            .and_then(|c| c.error.as_deref())
            .is_some_and(|e| wanted.iter().all(|w| e.contains(w)))
    })
    .await;
    assert!(ready_pid(&info).is_none(), "{info:?}");
    info.components[0].error.clone().unwrap()
}

/// Unmounts what the test left under `dir` (a plugin that never started keeps its mount
/// root's shared self-bind; the test's own shared dir), deepest first, so that the temp dir
/// can be removed.
fn unmount_under(dir: &std::path::Path) {
    let mut left = mounts_under(dir);
    left.sort_by_key(|path| std::cmp::Reverse(path.components().count()));
    for path in left {
        let _ = rustix::mount::unmount(&path, rustix::mount::UnmountFlags::DETACH);
    }
}

/// A test's temp dir under `parent` (prefix `prefix`), a registry on loopback in it, and
/// the plugin's state dir.
fn scene(parent: &str, prefix: &str) -> (tempfile::TempDir, Registry, PathBuf) {
    let dir = tempfile::Builder::new()
        .prefix(prefix)
        .tempdir_in(parent)
        .unwrap();
    let registry = Registry::start(&dir.path().join("registry")).unwrap();
    let plugin_dir = dir.path().join("plugin");
    std::fs::create_dir_all(&plugin_dir).unwrap();
    (dir, registry, plugin_dir)
}

async fn remove_all_plugins(daemon: &Daemon, containers: &Containers) {
    for entry in std::fs::read_dir(&daemon.configs).unwrap() {
        std::fs::remove_file(entry.unwrap().path()).unwrap();
    }
    daemon.api().reload().await.unwrap();
    containers.wait_gone().await;
}

/// The hostpath-like case (issue #23): an image whose config has an `Entrypoint` and no
/// `Env`, whose plugin needs `mount` from `PATH`. The image carries busybox's `sh` at
/// `/bin/sh` and `mount` only at `/usr/local/bin/mount`: busybox's shell falls back to a
/// built-in `PATH` of its own when the environment has none, but that one lacks
/// `/usr/local/bin`, so only the default `PATH` csi-agent gives lets the entrypoint find
/// `mount` (and run it) before it execs the plugin. `HOME` comes from the image's
/// `/etc/passwd` entry of the user the plugin runs as.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_image_with_an_entrypoint_and_no_env_finds_mount_on_the_default_path() {
    csi_agent::mounts::require_private_mount_namespace();
    let busybox = Path::new("/bin/busybox");
    assert!(
        busybox.is_file() && shared_libraries(busybox).is_empty(),
        "this test needs a static busybox at /bin/busybox (apt-get install busybox-static)"
    );
    let (dir, registry, plugin_dir) = scene("/tmp", "csi-image-");

    let tools = layer(&[
        ("bin/busybox", Item::HostFile(busybox)),
        ("bin/sh", Item::Symlink("busybox")),
        ("usr/local/bin/mount", Item::Symlink("/bin/busybox")),
        (
            "etc/passwd",
            Item::File(
                b"root:x:0:0:root:/root:/bin/sh\nplugin:x:1000:1000::/home/plugin:/bin/sh\n",
                0o644,
            ),
        ),
        ("root", Item::Dir),
    ]);
    let script = "command -v mount >/dev/null || { echo \"mount is not on PATH=$PATH\" >&2; exit 97; }; \
                  mount >/dev/null || exit 98; exec /bin/csi-testplugin \"$@\"";
    let layout = dir.path().join("layout");
    oci_layout(
        &layout,
        &[plugin_layer(), tools],
        json!({
            "Entrypoint": ["/bin/sh", "-c", script, "sh"],
            "Cmd": ["--work-dir", plugin_dir, "--volumes", "vol1:1M", "--node-id", "node-1"],
        }),
    )
    .unwrap();
    push(&layout, &registry, "csi/hostpath-like:v1").unwrap();

    let containers = Containers(dir.path().join("sockets/runc"));
    let mut daemon = registry_daemon(dir.path(), &registry.host());
    // The pull of a 30 MiB layer counts: generous on a busy machine.
    daemon.add_config(
        "test.json",
        &image_plugin(
            PLUGIN,
            "csi/hostpath-like:v1",
            vec![volume(&plugin_dir)],
            55000,
        ),
    );
    daemon.start();
    let api = daemon.api();

    // A publish that really mounts: the plugin started, so its shell found `mount`.
    let published = api.publish(&publish_request("vol1", "w1")).await.unwrap();
    let target = PathBuf::from(&published.target_path);
    assert!(is_mounted(&target), "{} is not mounted", target.display());
    let info = wait_plugin(&daemon, PLUGIN, "the plugin ready", |i| {
        ready_pid(i).is_some()
    })
    .await;
    assert_eq!(info.components[0].restarts, 0, "{info:?}");
    let pid = ready_pid(&info).unwrap();
    // The container's init is the plugin the script exec'd after finding mount...
    assert_eq!(
        std::fs::read_link(format!("/proc/{pid}/exe")).unwrap(),
        PathBuf::from("/bin/csi-testplugin")
    );
    // ...and it got the default PATH, HOME from the image's passwd, and csi-agent's own
    // variables; nothing of the daemon's environment.
    let environ = std::fs::read(format!("/proc/{pid}/environ")).unwrap();
    let env: Vec<String> = environ
        .split(|b| *b == 0)
        .filter(|v| !v.is_empty())
        .map(|v| String::from_utf8_lossy(v).into_owned())
        .collect();
    let get = |name: &str| {
        env.iter()
            .find_map(|v| v.strip_prefix(&format!("{name}=")))
            .map(str::to_owned)
    };
    assert_eq!(
        get("PATH").as_deref(),
        Some(csi_agent::runtime::oci::rootpaths::DEFAULT_PATH),
        "{env:?}"
    );
    assert_eq!(get("HOME").as_deref(), Some("/root"), "{env:?}");
    assert!(get("CSI_ENDPOINT").is_some(), "{env:?}");
    assert!(get("CSI_NODE_ID").is_some(), "{env:?}");
    // The daemon's (cargo's, here) stays outside.
    assert!(!env.iter().any(|v| v.starts_with("CARGO")), "{env:?}");

    api.unpublish(&unpublish_request("vol1", "w1"))
        .await
        .unwrap();
    assert!(!is_mounted(&target));
    remove_all_plugins(&daemon, &containers).await;
    drop(daemon);
    unmount_under(dir.path());
}

/// The M3 attack of issue #23 and the image configs that are input too. An image symlink
/// where the runtime binds the plugin's mount root (`.../csi/<type>/default -> /state/pwn`)
/// plus a BIDIRECTIONAL volume at `/state`: runc, following the symlink, would bind the
/// mount root into the host dir behind the volume, an untracked host mount that outlives
/// the plugin. A `WorkingDir` of `/proc/self/fd/7` would be a descriptor of runc's
/// (CVE-2024-21626). Both are refused before `runc create`, with errors naming the image,
/// the field and the path, and no mount appears; a layer with a hard link to a missing
/// target is refused as final (400), not as the registry being unavailable (503).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_image_symlink_at_a_mount_point_and_a_proc_working_dir_are_refused() {
    csi_agent::mounts::require_private_mount_namespace();
    // Not under /tmp: the container gets a /tmp of its own, which would hide the image's
    // symlink from runc and so prove nothing.
    let (dir, registry, plugin_dir) = scene("/var/tmp", "csi-roots-");
    let advstate = dir.path().join("advstate");
    std::fs::create_dir_all(&advstate).unwrap();
    // A BIDIRECTIONAL volume needs its host dir on a shared mount.
    csi_agent::runtime::oci::share_mount_root(&advstate).unwrap();

    let containers = Containers(dir.path().join("sockets/runc"));
    let mut daemon = registry_daemon(dir.path(), &registry.host());
    // The image: real dirs down to the plugin's dir in the work dir, then the symlink.
    let plugin_parent = daemon.work.join("csi").join(PLUGIN);
    let relative = plugin_parent.strip_prefix("/").unwrap().to_str().unwrap();
    let mut items: Vec<(String, Item<'_>)> = Vec::new();
    let mut so_far = String::new();
    for component in relative.split('/') {
        so_far = if so_far.is_empty() {
            component.to_owned()
        } else {
            format!("{so_far}/{component}")
        };
        items.push((so_far.clone(), Item::Dir));
    }
    items.push((format!("{relative}/default"), Item::Symlink("/state/pwn")));
    items.push(("state".to_owned(), Item::Dir));
    let run = json!({
        "Entrypoint": ["/bin/csi-testplugin"],
        "Cmd": ["--work-dir", plugin_dir, "--volumes", "vol1:1M", "--node-id", "node-1"],
    });
    let layout = dir.path().join("evil");
    oci_layout(&layout, &[plugin_layer(), layer(&items)], run.clone()).unwrap();
    push(&layout, &registry, "csi/evil:v1").unwrap();
    let mut cwd_config = run.clone();
    cwd_config["WorkingDir"] = json!("/proc/self/fd/7");
    let layout = dir.path().join("evil-cwd");
    oci_layout(&layout, &[plugin_layer()], cwd_config).unwrap();
    push(&layout, &registry, "csi/evil-cwd:v1").unwrap();
    let layout = dir.path().join("hardlink");
    oci_layout(
        &layout,
        &[layer(&[
            ("present", Item::File(b"p", 0o644)),
            ("h", Item::HardLink("missing/target")),
        ])],
        run.clone(),
    )
    .unwrap();
    push(&layout, &registry, "csi/hardlink:v1").unwrap();

    let bidirectional: Value = json!({"container_path": "/state",
        "source": {"type": "HOST_PATH", "host_path": {"path": advstate,
                   "mount_propagation": {"mode": "BIDIRECTIONAL"}}}});
    daemon.add_config(
        "test.json",
        &image_plugin(
            PLUGIN,
            "csi/evil:v1",
            vec![volume(&plugin_dir), bidirectional],
            20000,
        ),
    );
    daemon.add_config(
        "second.json",
        &image_plugin(SECOND, "csi/evil-cwd:v1", vec![volume(&plugin_dir)], 20000),
    );
    daemon.start();
    let api = daemon.api();
    let attempt = tokio::spawn({
        let api = daemon.api();
        async move { api.publish(&publish_request("vol1", "w1")).await }
    });
    let mut request = publish_request("vol1", "w2");
    request.plugin = SECOND.to_owned();
    let second_attempt = tokio::spawn({
        let api = daemon.api();
        async move { api.publish(&request).await }
    });

    let mount_root = plugin_parent.join("default/mounts");
    let error = wait_error(
        &daemon,
        PLUGIN,
        &["container image csi/evil:v1", "the plugin's mount root"],
    )
    .await;
    assert!(error.contains(&mount_root.display().to_string()), "{error}");
    assert!(
        error.contains(&format!("{relative}/default is a symlink")),
        "{error}"
    );
    let error = wait_error(
        &daemon,
        SECOND,
        &["container image csi/evil-cwd:v1", "WorkingDir"],
    )
    .await;
    assert!(
        error.contains("\"/proc/self/fd/7\" is under /proc"),
        "{error}"
    );
    // Refused again at each retry, never started.
    wait_plugin(&daemon, PLUGIN, "a retry", |i| {
        i.components.first().is_some_and(|c| c.restarts >= 2)
    })
    .await;
    assert!(containers.list().is_empty(), "{:?}", containers.list());

    // No host mount appeared behind the volume, nothing was made through the symlink.
    let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    assert!(!mountinfo.contains("advstate/pwn"), "{mountinfo}");
    assert_eq!(mounts_under(&advstate), vec![advstate.clone()]);
    assert!(
        dir_names(&advstate).is_empty(),
        "{:?}",
        dir_names(&advstate)
    );

    // A hostile layer is the image's fault: 400, not 503 (which says "retry later").
    let err = api.pull_image("csi/hardlink:v1").await.unwrap_err();
    match &err {
        csi_agent_api::ApiError::Api { status, body } => {
            assert_eq!(*status, 400, "{err:?}");
            assert!(
                body.message.contains("hard link target \"missing/target\""),
                "{err:?}"
            );
        }
        other => panic!("expected a 400, got {other:?}"),
    }

    attempt.abort();
    second_attempt.abort();
    remove_all_plugins(&daemon, &containers).await;
    assert_eq!(mounts_under(&advstate), vec![advstate.clone()]);
    drop(daemon);
    unmount_under(dir.path());
}

/// `command.user` of an image plugin names a user of the *image's* `/etc/passwd` and
/// `/etc/group` (issue #29, item 5): the plugin runs as its uid and gid with its image
/// supplementary group (read from `/proc/<pid>/status`), and its socket dir is that user's.
/// A user only the host has (`nobody`) fails the launch naming `command.user` and the user.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_image_plugin_runs_as_its_command_user_from_the_images_passwd() {
    use std::os::unix::fs::MetadataExt;
    csi_agent::mounts::require_private_mount_namespace();
    let (dir, registry, plugin_dir) = scene("/tmp", "csi-image-");
    // Its state dir is the image user's (a uid the host does not name).
    std::os::unix::fs::chown(&plugin_dir, Some(4242), Some(4242)).unwrap();
    let users = layer(&[
        ("etc", Item::Dir),
        (
            "etc/passwd",
            Item::File(
                b"root:x:0:0:root:/root:/bin/sh\nimgplugin:x:4242:4242::/:/bin/sh\n",
                0o644,
            ),
        ),
        (
            "etc/group",
            Item::File(
                b"root:x:0:\nimgplugin:x:4242:\nstorage:x:4300:other,imgplugin\n",
                0o644,
            ),
        ),
    ]);
    let layout = dir.path().join("layout");
    oci_layout(
        &layout,
        &[plugin_layer(), users],
        json!({
            "Entrypoint": ["/bin/csi-testplugin"],
            "Cmd": ["--work-dir", plugin_dir, "--volumes", "vol1:1M", "--node-id", "node-1",
                    "--mount-mode", "none"],
        }),
    )
    .unwrap();
    push(&layout, &registry, "csi/users:v1").unwrap();

    let containers = Containers(dir.path().join("sockets/runc"));
    let mut daemon = registry_daemon(dir.path(), &registry.host());
    let mut config = image_plugin(PLUGIN, "csi/users:v1", vec![volume(&plugin_dir)], 55000);
    config["containers"][0]["command"] = json!({"user": "imgplugin"});
    daemon.add_config("test.json", &config);
    let mut host_only = image_plugin(SECOND, "csi/users:v1", vec![volume(&plugin_dir)], 55000);
    host_only["containers"][0]["command"] = json!({"user": "nobody"});
    daemon.add_config("second.json", &host_only);
    daemon.extra.push("--start-plugins".to_owned());
    daemon.start();

    let info = wait_plugin(&daemon, PLUGIN, "the plugin ready", |i| {
        ready_pid(i).is_some()
    })
    .await;
    let pid = ready_pid(&info).unwrap();
    assert_eq!(
        proc_ids(pid),
        (
            "4242 4242 4242 4242".to_owned(),
            "4242 4242 4242 4242".to_owned(),
            "4300".to_owned()
        )
    );
    let socket = PathBuf::from(info.components[0].endpoint.clone().unwrap());
    let meta = std::fs::metadata(socket.parent().unwrap()).unwrap();
    assert_eq!((meta.uid(), meta.gid()), (4242, 4242));

    let error = wait_error(&daemon, SECOND, &["command.user", "\"nobody\""]).await;
    assert!(error.contains("etc/passwd"), "{error}");

    remove_all_plugins(&daemon, &containers).await;
    drop(daemon);
    unmount_under(dir.path());
}
