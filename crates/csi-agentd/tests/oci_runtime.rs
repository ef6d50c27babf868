//! The `oci` runtime end to end: the real `csi-agentd` runs the real `csi-testplugin` inside a
//! runc container (runc must be installed: `scripts/test` and `.ci/run` install it), and the
//! mounts the plugin makes inside the container reach the host; of `container.volumes`, only
//! a BIDIRECTIONAL one carries mounts made inside out to the host. Real mounts: run under
//! `unshare -m --propagation private`.
//!
//! `CSI_TEST_OCI_RUNTIME=crun` runs the same tests with crun as the daemon's `--oci-runtime`
//! (`.ci/run` does both): the runtime speaks only the CLI the two share. crun refuses every
//! container on a hybrid cgroup hierarchy whose cgroup v2 part has controllers: on such a
//! host `crun_on_a_hybrid_cgroup_host_is_refused_saying_why` checks that the daemon says so,
//! and the other tests hide the v2 hierarchy in this binary's private mount namespace, so
//! that crun sees (and is tested on) the host's cgroup v1 hierarchies.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use csi_agent::mounts::MountTable;
use csi_agent_api::PluginInfo;
use serde_json::{Value, json};

use csi_agent_testkit::*;

const ID: &str = "csi-agent-org-example-test-default--CONTROLLER_SERVICE-NODE_SERVICE";

/// The test plugin in a container on the host's root, its state dir given as a volume.
fn oci_config(plugin_dir: &Path, runtime: Value) -> Value {
    let mut config = managed_config(PLUGIN, plugin_dir, "vol1:1M,vol2:1M");
    config["runtime"] = runtime;
    config["containers"][0]["container"] = json!({
        "type": "MESOS",
        "volumes": [{"container_path": plugin_dir, "host_path": plugin_dir, "mode": "RW"}]
    });
    config["restart_backoff"] = json!({"initial_ms": 100, "max_ms": 500});
    config["stop_grace_ms"] = json!(5000);
    config
}

/// The OCI runtime under test: `runc` unless `CSI_TEST_OCI_RUNTIME` names another.
fn oci_runtime() -> String {
    std::env::var("CSI_TEST_OCI_RUNTIME").unwrap_or_else(|_| "runc".to_owned())
}

fn testing_crun() -> bool {
    Path::new(&oci_runtime())
        .file_name()
        .is_some_and(|name| name.to_string_lossy().contains("crun"))
}

/// The cgroup v2 hierarchy of a hybrid host, which crun refuses to run anything beside
/// when it has controllers.
const UNIFIED: &str = "/sys/fs/cgroup/unified";

/// A shell function: `cgroup_view v1` puts a tmpfs of this mount namespace's own over
/// /sys/fs/cgroup holding the host's v1 hierarchies (moved there) and no `unified` (crun
/// enters every hierarchy dir it finds, and would make plain dirs in an empty one);
/// `cgroup_view hybrid` does the same and mounts cgroup v2 at `unified` again. Nothing is
/// written to the host's /sys/fs/cgroup.
const CGROUP_VIEW: &str = r#"
cgroup_view() {
    old=$(mktemp -d /tmp/csi-oci-cgroup-XXXXXX)
    mount --rbind /sys/fs/cgroup "$old"
    mount -t tmpfs -o mode=755 cgroup /sys/fs/cgroup
    for dir in "$old"/*; do
        name=${dir##*/}
        if [ "$name" != unified ] && mountpoint -q "$dir"; then
            mkdir "/sys/fs/cgroup/$name"
            mount --move "$dir" "/sys/fs/cgroup/$name"
        fi
    done
    if [ "$1" = hybrid ]; then
        mkdir /sys/fs/cgroup/unified
        mount -t cgroup2 cgroup2 /sys/fs/cgroup/unified
    fi
    umount -R "$old"
    rmdir "$old"
}
"#;

/// A temp dir for one test under /tmp (`prefix` names it) and the test plugin's dir in it.
fn test_dir(prefix: &str) -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::Builder::new()
        .prefix(prefix)
        .tempdir_in("/tmp")
        .unwrap();
    let plugin_dir = dir.path().join("plugin");
    std::fs::create_dir_all(&plugin_dir).unwrap();
    (dir, plugin_dir)
}

/// Every test's first step (after checking the private mount namespace): with crun on a
/// hybrid cgroup host whose v2 part has controllers, the v2 hierarchy is hidden in this
/// test binary's own mount namespace (the host keeps it), so that crun sees the host's
/// cgroup v1 hierarchies only and runs containers; what crun says on the hybrid host itself is
/// `crun_on_a_hybrid_cgroup_host_is_refused_saying_why`'s. Returns the controllers it
/// hid the hierarchy for.
fn prepare_runtime() -> Option<&'static [String]> {
    csi_agent::mounts::require_private_mount_namespace();
    static HIDDEN: OnceLock<Option<Vec<String>>> = OnceLock::new();
    HIDDEN
        .get_or_init(|| {
            let controllers = csi_agent::runtime::oci::hybrid_cgroup_v2_controllers()
                .filter(|_| testing_crun())?;
            let status = Command::new("sh")
                .args(["-euc", &format!("{CGROUP_VIEW}\ncgroup_view v1")])
                .status()
                .unwrap();
            assert!(status.success(), "hiding {UNIFIED}: {status}");
            eprintln!(
                "crun on a hybrid cgroup host (v2 controllers: {controllers:?}): {UNIFIED} \
                 hidden in this test's mount namespace; crun runs on cgroup v1"
            );
            Some(controllers)
        })
        .as_deref()
}

/// The daemon flags that select it.
fn oci_flags() -> Vec<&'static str> {
    let runtime: &'static str = Box::leak(oci_runtime().into_boxed_str());
    vec!["--oci-runtime", runtime]
}

fn runc_list(socket_root: &Path) -> Vec<Value> {
    let out = Command::new(oci_runtime())
        .arg("--root")
        .arg(socket_root.join("runc"))
        .args(["list", "--format", "json"])
        .output()
        .expect("runc is installed (scripts/test installs it)");
    assert!(
        out.status.success(),
        "runc list: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice::<Option<Vec<Value>>>(&out.stdout)
        .unwrap()
        .unwrap_or_default()
}

/// A publish of vol1 for w1 started in the background (it waits for the plugin) and the
/// plugin's state once its launch has failed with an error `failed` accepts. The publish is
/// handed back to be aborted, or awaited once the cause is fixed.
async fn publish_until_launch_fails(
    daemon: &Daemon,
    what: &str,
    mut failed: impl FnMut(&str) -> bool,
) -> (
    PluginInfo,
    tokio::task::JoinHandle<Result<csi_agent_api::PublishResponse, csi_agent_api::ApiError>>,
) {
    let publishing = {
        let api = daemon.api();
        tokio::spawn(async move { api.publish(&publish_request("vol1", "w1")).await })
    };
    let info = daemon
        .wait_plugin(PLUGIN, what, Duration::from_secs(20), |i| {
            i.error.as_deref().is_some_and(&mut failed)
        })
        .await;
    (info, publishing)
}

fn ready_pid(info: &PluginInfo) -> Option<u32> {
    info.components
        .first()
        .filter(|c| c.ready)
        .and_then(|c| c.pid)
}

fn mount_ns(pid: u32) -> PathBuf {
    std::fs::read_link(format!("/proc/{pid}/ns/mnt")).unwrap()
}

fn is_mounted(path: &Path) -> bool {
    MountTable::read().unwrap().is_mount_point(path)
}

#[tokio::test]
async fn the_plugin_runs_in_a_container_and_its_mounts_reach_the_host() {
    prepare_runtime();
    let (dir, plugin_dir) = test_dir("csi-oci-");
    let mut daemon = Daemon::new(dir.path(), &oci_flags());
    let mut config = oci_config(&plugin_dir, json!({"kind": "oci"}));
    config["containers"][0]["resources"] = json!([
        {"name": "cpus", "type": "SCALAR", "scalar": {"value": 0.5}},
        {"name": "mem", "type": "SCALAR", "scalar": {"value": 256}}
    ]);
    daemon.add_config("test.json", &config);
    daemon.start();
    let api = daemon.api();

    // A volume published through csi-agent is mounted by the plugin inside its container
    // and is the volume on the host.
    let published = api.publish(&publish_request("vol1", "w1")).await.unwrap();
    let target = PathBuf::from(&published.target_path);
    assert!(
        is_mounted(&target),
        "{} is not a mount point on the host",
        target.display()
    );
    std::fs::write(target.join("file"), b"from the host").unwrap();
    assert_eq!(
        std::fs::read(plugin_dir.join("volumes/vol1/file")).unwrap(),
        b"from the host"
    );

    // It runs in a container of its own: its own mount namespace, known to runc.
    let info = daemon
        .wait_plugin(PLUGIN, "the plugin ready", Duration::from_secs(20), |i| {
            ready_pid(i).is_some()
        })
        .await;
    let pid = ready_pid(&info).unwrap();
    let daemon_pid = daemon.child.as_ref().unwrap().id();
    assert_ne!(
        mount_ns(pid),
        mount_ns(daemon_pid),
        "the plugin shares the daemon's mount namespace"
    );
    let listed = runc_list(&daemon.socket_root);
    assert_eq!(listed.len(), 1, "{listed:?}");
    assert_eq!(listed[0]["id"], ID);
    assert_eq!(listed[0]["status"], "running");
    assert_eq!(listed[0]["pid"], pid);
    assert!(
        !cgroups_of(&daemon.socket_root).is_empty(),
        "the container has no cgroup of its own"
    );
    // `resources` are its cgroup limits: 0.5 CPU (a 50 ms quota per 100 ms), 256 MB.
    let (memory, cpu) = cgroup_limits(&daemon.socket_root);
    assert_eq!(memory, 256 * 1024 * 1024);
    assert_eq!(cpu, (50_000, 100_000));
    // The host's root, entry by entry: its top-level names, symlinks as symlinks, files
    // as they are; read-only, the root and its entries alike.
    let root = PathBuf::from(format!("/proc/{pid}/root"));
    assert_eq!(dir_names(&root), dir_names(Path::new("/")));
    for entry in std::fs::read_dir("/").unwrap() {
        let path = entry.unwrap().path();
        if let Ok(target) = std::fs::read_link(&path) {
            let inside = root.join(path.strip_prefix("/").unwrap());
            assert_eq!(std::fs::read_link(&inside).unwrap(), target, "{inside:?}");
        }
    }
    assert_eq!(
        std::fs::read(root.join("etc/os-release")).unwrap(),
        std::fs::read("/etc/os-release").unwrap()
    );
    let err = std::fs::write(format!("/proc/{pid}/root/csi-oci-probe"), b"x").unwrap_err();
    assert_eq!(err.raw_os_error(), Some(30), "{err}");
    let err = std::fs::write(format!("/proc/{pid}/root/etc/csi-oci-probe"), b"x").unwrap_err();
    assert_eq!(err.raw_os_error(), Some(30), "{err}");
    // The state dir given as a volume is writable.
    let inside = format!("/proc/{pid}/root{}/probe", plugin_dir.display());
    std::fs::write(&inside, b"x").unwrap();
    assert!(plugin_dir.join("probe").exists());

    // Unpublish: the plugin's unmount inside the container removes the mount on the host.
    api.unpublish(&unpublish_request("vol1", "w1"))
        .await
        .unwrap();
    assert!(!is_mounted(&target), "still mounted after unpublish");
    assert!(!target.exists(), "the target is left behind");

    // The container killed → restarted (a new init), and it serves again.
    api.publish(&publish_request("vol2", "w2")).await.unwrap();
    common_kill9(pid);
    let info = daemon
        .wait_plugin(
            PLUGIN,
            "a restarted container",
            Duration::from_secs(20),
            |i| ready_pid(i).is_some_and(|p| p != pid),
        )
        .await;
    let restarted = ready_pid(&info).unwrap();
    assert!(info.components[0].restarts >= 1, "{info:?}");
    assert_eq!(runc_list(&daemon.socket_root).len(), 1);
    let again = api.publish(&publish_request("vol1", "w1")).await.unwrap();
    assert!(is_mounted(Path::new(&again.target_path)));

    // The daemon SIGKILLed → the container adopted (same init), and volumes keep working.
    daemon.kill9();
    assert!(Path::new(&format!("/proc/{restarted}")).exists());
    daemon.start();
    let api = daemon.api();
    api.unpublish(&unpublish_request("vol2", "w2"))
        .await
        .unwrap();
    let info = daemon
        .wait_plugin(PLUGIN, "the adopted plugin", Duration::from_secs(20), |i| {
            ready_pid(i).is_some()
        })
        .await;
    assert_eq!(ready_pid(&info), Some(restarted), "relaunched, not adopted");
    assert_eq!(info.components[0].restarts, 0, "{info:?}");
    api.unpublish(&unpublish_request("vol1", "w1"))
        .await
        .unwrap();
    assert!(
        mounts_under(&daemon.work)
            .iter()
            .all(|m| m.ends_with("mounts"))
    );

    // The config removed → the container stopped and deleted, nothing left behind.
    std::fs::remove_file(daemon.configs.join("test.json")).unwrap();
    let report = api.reload().await.unwrap();
    assert_eq!(report.removed, vec![PLUGIN.to_owned()]);
    let deadline = Instant::now() + Duration::from_secs(20);
    while Path::new(&format!("/proc/{restarted}")).exists() && !is_zombie(restarted) {
        assert!(Instant::now() < deadline, "the container still runs");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(runc_list(&daemon.socket_root), Vec::<Value>::new());
    assert_eq!(mounts_under(dir.path()), Vec::<PathBuf>::new());
    let containers = csi_agent::layout::Layout::new(&daemon.work).containers_dir(PLUGIN, "default");
    assert!(!containers.exists(), "{} is left", containers.display());
    assert_eq!(cgroups_of(&daemon.socket_root), Vec::<PathBuf>::new());
}

/// The container's memory limit (bytes) and CPU quota (quota, period in µs), from cgroup v1
/// or v2, whichever the host has.
fn cgroup_limits(socket_root: &Path) -> (u64, (i64, u64)) {
    let dirs = cgroups_of(socket_root);
    let read = |name: &str| -> Option<String> {
        dirs.iter()
            .find_map(|d| std::fs::read_to_string(d.join(name)).ok())
            .map(|s| s.trim().to_owned())
    };
    if let Some(limit) = read("memory.limit_in_bytes") {
        let quota = read("cpu.cfs_quota_us").unwrap().parse().unwrap();
        let period = read("cpu.cfs_period_us").unwrap().parse().unwrap();
        return (limit.parse().unwrap(), (quota, period));
    }
    let memory = read("memory.max").unwrap().parse().unwrap();
    let cpu = read("cpu.max").unwrap();
    let (quota, period) = cpu.split_once(' ').unwrap();
    (memory, (quota.parse().unwrap(), period.parse().unwrap()))
}

fn common_kill9(pid: u32) {
    let pid = rustix::process::Pid::from_raw(i32::try_from(pid).unwrap()).unwrap();
    rustix::process::kill_process(pid, rustix::process::Signal::KILL).unwrap();
}

fn is_zombie(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| {
        stat.rsplit_once(')')
            .is_some_and(|(_, rest)| rest.trim_start().starts_with('Z'))
    })
}

/// Cgroup dirs of the daemon in `socket_root` (`csi-agent-<hash of its runc root>-<id>`),
/// in any hierarchy (v1 or v2).
fn cgroups_of(socket_root: &Path) -> Vec<PathBuf> {
    let mut hash: u32 = 0x811c_9dc5;
    for byte in socket_root.join("runc").as_os_str().as_encoded_bytes() {
        hash ^= u32::from(*byte);
        hash = hash.wrapping_mul(0x0100_0193);
    }
    let name = format!("csi-agent-{hash:08x}-{ID}");
    let mut roots: Vec<PathBuf> = std::fs::read_dir("/sys/fs/cgroup")
        .map(|entries| entries.flatten().map(|e| e.path()).collect())
        .unwrap_or_default();
    roots.push(PathBuf::from("/sys/fs/cgroup"));
    roots
        .into_iter()
        .map(|root| root.join(&name))
        .filter(|dir| dir.exists())
        .collect()
}

#[tokio::test]
async fn launch_errors_are_reported_on_the_plugin_naming_the_field() {
    prepare_runtime();
    let (dir, plugin_dir) = test_dir("csi-oci-err-");

    // A bad capability name: the file is refused at load, naming the field.
    let mut daemon = Daemon::new(dir.path(), &["--oci-runtime", "/nonexistent/bin/runc"]);
    let mut bad_cap = oci_config(
        &plugin_dir,
        json!({"kind": "oci", "capabilities": ["CAP_SYS_ADMIN", "CAP_MAKE_COFFEE"]}),
    );
    bad_cap["type"] = json!("org.example.badcap");
    daemon.add_config("badcap.json", &bad_cap);
    // A memory limit below what a container can start with.
    let mut bad_mem = oci_config(&plugin_dir, json!({"kind": "oci"}));
    bad_mem["type"] = json!("org.example.badmem");
    bad_mem["containers"][0]["resources"] =
        json!([{"name": "mem", "type": "SCALAR", "scalar": {"value": 1}}]);
    daemon.add_config("badmem.json", &bad_mem);
    // runc missing (the daemon's --oci-runtime names a file that does not exist).
    daemon.add_config(
        "test.json",
        &oci_config(&plugin_dir, json!({"kind": "oci"})),
    );
    daemon.start();
    let api = daemon.api();
    let plugins = api.plugins().await.unwrap();
    let error = plugins
        .config_errors
        .iter()
        .find(|e| e.file.ends_with("badcap.json"))
        .unwrap_or_else(|| panic!("no error for badcap.json: {plugins:?}"));
    assert!(
        error.message.contains("runtime.capabilities[1]")
            && error.message.contains("CAP_MAKE_COFFEE"),
        "{}",
        error.message
    );
    let error = plugins
        .config_errors
        .iter()
        .find(|e| e.file.ends_with("badmem.json"))
        .unwrap_or_else(|| panic!("no error for badmem.json: {plugins:?}"));
    assert!(
        error
            .message
            .contains("containers[0].resources[0].scalar.value")
            && error.message.contains("below"),
        "{}",
        error.message
    );
    let (info, publishing) = publish_until_launch_fails(&daemon, "the launch error", |e| {
        e.contains("/nonexistent/bin/runc")
    })
    .await;
    assert_eq!(info.state, "restarting", "{info:?}");
    assert!(
        info.error.as_deref().unwrap().contains("--oci-runtime"),
        "{info:?}"
    );
    assert!(
        info.components[0]
            .error
            .as_deref()
            .is_some_and(|e| e.contains("/nonexistent/bin/runc")),
        "{info:?}"
    );
    publishing.abort();
    daemon.kill9();

    // A rootfs that does not exist, with the real runc.
    let mut daemon = Daemon::new(dir.path(), &oci_flags());
    std::fs::remove_file(daemon.configs.join("badcap.json")).unwrap();
    std::fs::remove_file(daemon.configs.join("badmem.json")).unwrap();
    daemon.add_config(
        "test.json",
        &oci_config(
            &plugin_dir,
            json!({"kind": "oci", "rootfs": "/nonexistent/rootfs"}),
        ),
    );
    daemon.start();
    let (info, publishing) = publish_until_launch_fails(&daemon, "the rootfs error", |e| {
        e.contains("runtime.rootfs")
    })
    .await;
    assert!(
        info.error
            .as_deref()
            .unwrap()
            .contains("/nonexistent/rootfs"),
        "{info:?}"
    );
    publishing.abort();
    assert_eq!(runc_list(&daemon.socket_root), Vec::<Value>::new());
}

#[tokio::test]
async fn a_container_stopped_while_the_daemon_was_down_is_replaced_and_a_changed_config_too() {
    prepare_runtime();
    let (dir, plugin_dir) = test_dir("csi-oci-re-");
    let mut daemon = Daemon::new(dir.path(), &oci_flags());
    daemon.add_config(
        "test.json",
        &oci_config(&plugin_dir, json!({"kind": "oci"})),
    );
    daemon.start();
    daemon
        .api()
        .publish(&publish_request("vol1", "w1"))
        .await
        .unwrap();
    let first = ready_pid(
        &daemon
            .wait_plugin(PLUGIN, "the plugin ready", Duration::from_secs(20), |i| {
                ready_pid(i).is_some()
            })
            .await,
    )
    .unwrap();

    // The daemon dies, then the container: runc still lists it, stopped.
    daemon.kill9();
    common_kill9(first);
    let deadline = Instant::now() + Duration::from_secs(10);
    while runc_list(&daemon.socket_root)
        .first()
        .is_none_or(|c| c["status"] != "stopped")
    {
        assert!(
            Instant::now() < deadline,
            "{:?}",
            runc_list(&daemon.socket_root)
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Back: the stopped container is deleted and a new one serves.
    daemon.start();
    let api = daemon.api();
    let published = api.publish(&publish_request("vol2", "w2")).await.unwrap();
    assert!(is_mounted(Path::new(&published.target_path)));
    let info = daemon
        .wait_plugin(PLUGIN, "a new container", Duration::from_secs(20), |i| {
            ready_pid(i).is_some()
        })
        .await;
    let second = ready_pid(&info).unwrap();
    assert_ne!(second, first);
    let listed = runc_list(&daemon.socket_root);
    assert_eq!(listed.len(), 1, "{listed:?}");
    assert_eq!(listed[0]["status"], "running");
    assert_eq!(listed[0]["pid"], second);

    // A changed config (here: the environment, and Mesos `linux_info` capabilities)
    // replaces the container.
    let mut changed = oci_config(&plugin_dir, json!({"kind": "oci"}));
    // Its MESOS_AGENT_ID is csi-agent's node id (here the plugin's own), over the config's
    // variable of that name (as Mesos's service manager's wins); MESOS_SANDBOX is the
    // component's dir, bound at its path in a container on the host's root (issue #29).
    changed["node_id"] = json!("node-oci");
    changed["containers"][0]["command"]["environment"] = json!({"variables": [
        {"name": "CHANGED", "value": "1"},
        {"name": "MESOS_AGENT_ID", "value": "from-the-config"}
    ]});
    changed["containers"][0]["container"]["linux_info"] =
        json!({"effective_capabilities": {"capabilities": ["SYS_ADMIN", "DAC_OVERRIDE"]}});
    daemon.add_config("test.json", &changed);
    let report = api.reload().await.unwrap();
    assert_eq!(report.changed, vec![PLUGIN.to_owned()], "{report:?}");
    let info = daemon
        .wait_plugin(
            PLUGIN,
            "the replaced container",
            Duration::from_secs(20),
            |i| ready_pid(i).is_some_and(|p| p != second),
        )
        .await;
    let third = ready_pid(&info).unwrap();
    let environ = std::fs::read(format!("/proc/{third}/environ")).unwrap();
    assert!(
        environ.split(|b| *b == 0).any(|v| v == b"CHANGED=1"),
        "the new container lacks the new environment"
    );
    let vars: Vec<&[u8]> = environ.split(|b| *b == 0).collect();
    assert!(
        vars.contains(&&b"MESOS_AGENT_ID=node-oci"[..]),
        "the container lacks MESOS_AGENT_ID=node-oci: {:?}",
        String::from_utf8_lossy(&environ)
    );
    assert!(
        !vars.iter().any(|v| v.starts_with(b"MESOS_AGENT_ID=from")),
        "{:?}",
        String::from_utf8_lossy(&environ)
    );
    let sandbox = std::fs::read_link(format!("/proc/{third}/cwd")).unwrap();
    assert!(sandbox.starts_with(&daemon.work), "{sandbox:?}");
    assert!(
        vars.contains(&format!("MESOS_SANDBOX={}", sandbox.display()).as_bytes()),
        "{:?}",
        String::from_utf8_lossy(&environ)
    );
    // CAP_DAC_OVERRIDE is bit 1, CAP_SYS_ADMIN bit 21: exactly those.
    let status = std::fs::read_to_string(format!("/proc/{third}/status")).unwrap();
    let effective = status
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))
        .map(|hex| u64::from_str_radix(hex.trim(), 16).unwrap());
    assert_eq!(effective, Some((1 << 1) | (1 << 21)), "{status}");
    assert!(
        !Path::new(&format!("/proc/{second}")).exists() || is_zombie(second),
        "the outdated container still runs"
    );
    let listed = runc_list(&daemon.socket_root);
    assert_eq!(listed.len(), 1, "{listed:?}");
    assert_eq!(listed[0]["pid"], third);

    // The volumes published through the older containers are unpublished by the new one.
    api.unpublish(&unpublish_request("vol1", "w1"))
        .await
        .unwrap();
    api.unpublish(&unpublish_request("vol2", "w2"))
        .await
        .unwrap();
    std::fs::remove_file(daemon.configs.join("test.json")).unwrap();
    api.reload().await.unwrap();
    assert_eq!(runc_list(&daemon.socket_root), Vec::<Value>::new());
    assert_eq!(mounts_under(dir.path()), Vec::<PathBuf>::new());
}

/// Live processes whose command line has `dir` as an argument (the test plugin's
/// `--work-dir`), zombies excluded.
fn plugin_processes(dir: &Path) -> Vec<u32> {
    let wanted = dir.as_os_str().as_encoded_bytes().to_vec();
    let mut pids = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|s| s.parse::<u32>().ok())
        else {
            continue;
        };
        let Ok(cmdline) = std::fs::read(entry.path().join("cmdline")) else {
            continue;
        };
        if cmdline
            .split(|b| *b == 0)
            .any(|arg| arg == wanted.as_slice())
            && !is_zombie(pid)
        {
            pids.push(pid);
        }
    }
    pids
}

#[tokio::test]
async fn a_daemon_killed_while_starting_a_container_leaves_exactly_one_after_restart() {
    prepare_runtime();
    for point in [
        csi_agent::runtime::oci::FP_AFTER_CREATE,
        csi_agent::runtime::oci::FP_AFTER_START,
    ] {
        let (dir, plugin_dir) = test_dir("csi-oci-fp-");
        let mut daemon = Daemon::new(dir.path(), &oci_flags());
        daemon.add_config(
            "test.json",
            &oci_config(&plugin_dir, json!({"kind": "oci"})),
        );
        daemon.env.push((
            csi_agent::failpoint::ENV_VAR.to_owned(),
            format!("{point}=exit"),
        ));
        daemon.start();
        let failed = daemon.api().publish(&publish_request("vol1", "w1")).await;
        assert!(failed.is_err(), "{point}: the publish succeeded");
        daemon.wait_exit_within(Duration::from_secs(60));
        // The container is left behind, created or running, with no record of it.
        let left = runc_list(&daemon.socket_root);
        assert_eq!(left.len(), 1, "{point}: {left:?}");

        daemon.env.clear();
        daemon.start();
        let api = daemon.api();
        let published = api.publish(&publish_request("vol1", "w1")).await.unwrap();
        assert!(is_mounted(Path::new(&published.target_path)), "{point}");
        let info = daemon
            .wait_plugin(PLUGIN, "the plugin ready", Duration::from_secs(20), |i| {
                ready_pid(i).is_some()
            })
            .await;
        let pid = ready_pid(&info).unwrap();
        let listed = runc_list(&daemon.socket_root);
        assert_eq!(listed.len(), 1, "{point}: {listed:?}");
        assert_eq!(listed[0]["status"], "running", "{point}");
        assert_eq!(listed[0]["pid"], pid, "{point}");
        assert_eq!(plugin_processes(&plugin_dir), vec![pid], "{point}");

        api.unpublish(&unpublish_request("vol1", "w1"))
            .await
            .unwrap();
        std::fs::remove_file(daemon.configs.join("test.json")).unwrap();
        api.reload().await.unwrap();
        assert_eq!(
            runc_list(&daemon.socket_root),
            Vec::<Value>::new(),
            "{point}"
        );
        assert_eq!(mounts_under(dir.path()), Vec::<PathBuf>::new(), "{point}");
        assert_eq!(
            cgroups_of(&daemon.socket_root),
            Vec::<PathBuf>::new(),
            "{point}"
        );
    }
}

#[tokio::test]
async fn crun_on_a_hybrid_cgroup_host_is_refused_saying_why() {
    let Some(controllers) = prepare_runtime() else {
        eprintln!(
            "skipped: {} on this host's cgroups is not refused (only crun on a hybrid \
             hierarchy whose cgroup v2 part has controllers is)",
            oci_runtime()
        );
        return;
    };
    let (dir, plugin_dir) = test_dir("csi-oci-hybrid-");
    let mut daemon = Daemon::new(dir.path(), &oci_flags());
    // The daemon sees the host's cgroups as they are: the v1 hierarchies and the v2 one
    // mounted again, in a mount namespace of its own (nothing it mounts needs to reach this
    // test, whose /sys/fs/cgroup stays as it is).
    daemon.wrapper = [
        "unshare",
        "-m",
        "--propagation",
        "unchanged",
        "sh",
        "-euc",
        &format!("{CGROUP_VIEW}\ncgroup_view hybrid\nexec \"$0\" \"$@\""),
    ]
    .map(str::to_owned)
    .to_vec();
    daemon.add_config(
        "test.json",
        &oci_config(&plugin_dir, json!({"kind": "oci"})),
    );
    daemon.start();
    let (info, publishing) = publish_until_launch_fails(&daemon, "the refusal", |_| true).await;
    publishing.abort();
    let error = info.error.clone().unwrap();
    assert_eq!(info.state, "restarting", "{info:?}");
    // It names the cause (the hybrid hierarchy and its v2 controllers) and the ways out.
    for wanted in [
        "hybrid hierarchy",
        "/sys/fs/cgroup/unified",
        &controllers.join(" "),
        "use runc (the daemon's --oci-runtime)",
        "cgroups in hybrid mode not supported",
    ] {
        assert!(error.contains(wanted), "{wanted:?} not in {error}");
    }
    assert_eq!(runc_list(&daemon.socket_root), Vec::<Value>::new());
}

/// Runs `argv` inside the test plugin's container (`runc exec`, or crun's).
fn exec_in_container(socket_root: &Path, argv: &[&str]) -> std::process::Output {
    Command::new(oci_runtime())
        .arg("--root")
        .arg(socket_root.join("runc"))
        .args(["exec", ID])
        .args(argv)
        .output()
        .unwrap()
}

fn exec_ok(socket_root: &Path, argv: &[&str]) {
    let out = exec_in_container(socket_root, argv);
    assert!(
        out.status.success(),
        "{argv:?} in the container: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The source (`tmpfs` device name) of what is mounted at `path` in `table`, if anything.
fn mounted_source(table: &MountTable, path: &Path) -> Option<String> {
    table.mount_at(path).map(|m| m.source.clone())
}

/// Makes `dir` a shared mount of its own in the test's namespace (a bind onto itself), as
/// systemd makes every mount of a host shared.
fn share(dir: &Path) {
    rustix::mount::mount_bind(dir, dir).unwrap();
    rustix::mount::mount_change(dir, rustix::mount::MountPropagationFlags::SHARED).unwrap();
}

#[tokio::test]
async fn only_bidirectional_volumes_carry_mounts_made_inside_out_to_the_host() {
    prepare_runtime();
    let (dir, plugin_dir) = test_dir("csi-oci-prop-");
    // Four volumes, each a shared mount on the host so that only its propagation mode
    // decides: BIDIRECTIONAL, HOST_TO_CONTAINER, a `source.host_path` without a mode and the
    // plain `host_path` field. Each is bound at another path in the container (under its
    // own /tmp), so what appears on the host can only have come through the volume.
    let modes = ["bidirectional", "host-to-container", "no-mode", "plain"];
    let host = |mode: &str| dir.path().join(format!("host-{mode}"));
    let inside = |mode: &str| PathBuf::from(format!("/tmp/csi-prop-{mode}"));
    for mode in modes {
        std::fs::create_dir_all(host(mode).join("m")).unwrap();
        std::fs::create_dir_all(host(mode).join("n")).unwrap();
        share(&host(mode));
    }
    let mut config = oci_config(&plugin_dir, json!({"kind": "oci"}));
    let volumes = config["containers"][0]["container"]["volumes"]
        .as_array_mut()
        .unwrap();
    volumes.push(json!({"container_path": inside(modes[0]), "mode": "RW",
        "source": {"type": "HOST_PATH", "host_path": {"path": host(modes[0]),
                   "mount_propagation": {"mode": "BIDIRECTIONAL"}}}}));
    volumes.push(json!({"container_path": inside(modes[1]), "mode": "RW",
        "source": {"type": "HOST_PATH", "host_path": {"path": host(modes[1]),
                   "mount_propagation": {"mode": "HOST_TO_CONTAINER"}}}}));
    volumes.push(json!({"container_path": inside(modes[2]), "mode": "RW",
        "source": {"type": "HOST_PATH", "host_path": {"path": host(modes[2])}}}));
    volumes.push(
        json!({"container_path": inside(modes[3]), "host_path": host(modes[3]),
        "mode": "RW"}),
    );
    let mut daemon = Daemon::new(dir.path(), &oci_flags());
    daemon.add_config("test.json", &config);
    daemon.start();
    let api = daemon.api();
    api.publish(&publish_request("vol1", "w1")).await.unwrap();
    let info = daemon
        .wait_plugin(PLUGIN, "the plugin ready", Duration::from_secs(20), |i| {
            ready_pid(i).is_some()
        })
        .await;
    let pid = ready_pid(&info).unwrap();
    let container_table = || MountTable::read_from(Path::new(&format!("/proc/{pid}/mountinfo")));

    // A tmpfs mounted inside beneath each container_path, named after its volume.
    for mode in modes {
        let target = inside(mode).join("m");
        let target = target.to_str().unwrap();
        let source = format!("csi-prop-{mode}");
        exec_ok(
            &daemon.socket_root,
            &["mount", "-t", "tmpfs", "-o", "size=1m", &source, target],
        );
        let table = container_table().unwrap();
        assert_eq!(
            mounted_source(&table, Path::new(target)).as_deref(),
            Some(source.as_str()),
            "not mounted inside the container"
        );
    }
    // BIDIRECTIONAL: it is on the host at host_path, the same file system.
    let table = MountTable::read().unwrap();
    assert_eq!(
        mounted_source(&table, &host(modes[0]).join("m")).as_deref(),
        Some("csi-prop-bidirectional"),
        "a mount made inside a BIDIRECTIONAL volume did not reach the host"
    );
    exec_ok(
        &daemon.socket_root,
        &[
            "sh",
            "-c",
            "echo inside > /tmp/csi-prop-bidirectional/m/file",
        ],
    );
    assert_eq!(
        std::fs::read_to_string(host(modes[0]).join("m/file")).unwrap(),
        "inside\n"
    );
    // The others: the host never sees it.
    for mode in &modes[1..] {
        assert_eq!(
            mounted_source(&table, &host(mode).join("m")),
            None,
            "a mount made inside a {mode} volume reached the host"
        );
    }
    // Host to container, every mode: a mount made on the host afterwards is seen inside.
    for mode in modes {
        let source = format!("csi-prop-host-{mode}");
        rustix::mount::mount(
            source.as_str(),
            host(mode).join("n"),
            "tmpfs",
            rustix::mount::MountFlags::empty(),
            None,
        )
        .unwrap();
        assert_eq!(
            mounted_source(&container_table().unwrap(), &inside(mode).join("n")).as_deref(),
            Some(source.as_str()),
            "a mount made on the host under a {mode} volume is not seen inside"
        );
    }

    // Its unmount inside disappears on the host.
    exec_ok(
        &daemon.socket_root,
        &["umount", "/tmp/csi-prop-bidirectional/m"],
    );
    assert_eq!(
        mounted_source(&MountTable::read().unwrap(), &host(modes[0]).join("m")),
        None,
        "unmounted inside, still mounted on the host"
    );

    api.unpublish(&unpublish_request("vol1", "w1"))
        .await
        .unwrap();
    std::fs::remove_file(daemon.configs.join("test.json")).unwrap();
    api.reload().await.unwrap();
    assert_eq!(runc_list(&daemon.socket_root), Vec::<Value>::new());
    for mode in modes {
        for path in [host(mode).join("n"), host(mode)] {
            rustix::mount::unmount(&path, rustix::mount::UnmountFlags::empty()).unwrap();
        }
    }
    assert_eq!(mounts_under(dir.path()), Vec::<PathBuf>::new());
}

#[tokio::test]
async fn a_bidirectional_volume_on_a_mount_that_is_not_shared_is_refused_naming_it() {
    prepare_runtime();
    let (dir, plugin_dir) = test_dir("csi-oci-noshare-");
    // /tmp is a private mount in the test's namespace (`unshare --propagation private`).
    let bidirectional = dir.path().join("host-bidirectional");
    std::fs::create_dir_all(&bidirectional).unwrap();
    let mut config = oci_config(&plugin_dir, json!({"kind": "oci"}));
    config["containers"][0]["container"]["volumes"]
        .as_array_mut()
        .unwrap()
        .push(json!({"container_path": "/tmp/csi-prop-bidirectional",
            "source": {"type": "HOST_PATH", "host_path": {"path": bidirectional,
                       "mount_propagation": {"mode": "BIDIRECTIONAL"}}}}));
    let mut daemon = Daemon::new(dir.path(), &oci_flags());
    daemon.add_config("test.json", &config);
    daemon.start();
    let api = daemon.api();
    let (info, publishing) = publish_until_launch_fails(&daemon, "the refusal", |_| true).await;
    let error = info.error.clone().unwrap();
    assert_eq!(info.state, "restarting", "{info:?}");
    for wanted in [
        "container.volumes[1].source.host_path.mount_propagation.mode",
        &format!("host_path {}", bidirectional.display()),
        "is not shared",
        "HOST_TO_CONTAINER",
    ] {
        assert!(error.contains(wanted), "{wanted:?} not in {error}");
    }
    assert_eq!(runc_list(&daemon.socket_root), Vec::<Value>::new());

    // Made shared as the message says, the next launch (restart backoff) succeeds.
    share(&bidirectional);
    publishing.await.unwrap().unwrap();
    daemon
        .wait_plugin(PLUGIN, "the plugin ready", Duration::from_secs(20), |i| {
            ready_pid(i).is_some()
        })
        .await;
    api.unpublish(&unpublish_request("vol1", "w1"))
        .await
        .unwrap();
    std::fs::remove_file(daemon.configs.join("test.json")).unwrap();
    api.reload().await.unwrap();
    assert_eq!(runc_list(&daemon.socket_root), Vec::<Value>::new());
    rustix::mount::unmount(&bidirectional, rustix::mount::UnmountFlags::empty()).unwrap();
    assert_eq!(mounts_under(dir.path()), Vec::<PathBuf>::new());
}
