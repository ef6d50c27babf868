//! Isolation without an image (issue #29 item 3), end to end through the real `csi-agentd`,
//! the real `csi-testplugin` and the real runc (`--oci-runtime`, default `runc` from `PATH`):
//!
//! - a config without an image that sets `resources` (cpus 0.5, mem 64 MiB),
//!   `container.volumes`, `linux_info` effective and bounding capabilities, `rlimit_info` and
//!   `hostname` runs in a container on the host's root with each of them: read from the
//!   plugin's cgroup (`/proc/PID/cgroup`, v1 or v2), its root (`/proc/PID/root`), its
//!   `/proc/PID/status` (`CapEff`, `CapBnd`), `/proc/PID/limits` and its UTS namespace; its
//!   working directory is its sandbox, and it serves a publish;
//! - with `--oci-runtime` naming a missing binary, the launch fails naming the fields that
//!   need it and the flag, and no plugin process ever runs;
//! - an explicit `"runtime": {"kind": "process"}` runs it as a host process (in the daemon's
//!   cgroup) and logs the fields it does not apply once per launch (two launches, two lines);
//! - an invalid capability name, a negative cpus and an unknown rlimit type are refused when
//!   the file loads, naming the field, under either runtime.
//!
//! Real mounts and containers: run under `unshare -m --propagation private`.

use std::path::{Path, PathBuf};
use std::time::Duration;

use csi_agent::mounts::require_private_mount_namespace;
use csi_agent_api::PluginInfo;
use serde_json::{Value, json};

use csi_agent_testkit::*;

/// A temp dir under /tmp (the container gets a /tmp of its own: anything of the test's it
/// sees there is bound in).
fn test_dir(prefix: &str) -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix(prefix)
        .tempdir_in("/tmp")
        .unwrap()
}

/// The test plugin with its state in `workdir`, relative: beneath its working directory.
fn plugin_config() -> Value {
    let mut config = managed_config(PLUGIN, Path::new("workdir"), "vol1:1M");
    config["restart_backoff"] = json!({"initial_ms": 100, "max_ms": 500});
    config
}

fn resources() -> Value {
    json!([
        {"name": "cpus", "type": "SCALAR", "scalar": {"value": 0.5}},
        {"name": "mem", "type": "SCALAR", "scalar": {"value": 64}},
        {"name": "disk", "type": "SCALAR", "scalar": {"value": 100}}
    ])
}

fn ready_pid(info: &PluginInfo) -> Option<u32> {
    info.components
        .first()
        .filter(|c| c.ready)
        .and_then(|c| c.pid)
}

/// A `Name:` line of `/proc/PID/status` as a capability mask.
fn cap_mask(pid: u32, name: &str) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let hex = status
        .lines()
        .find_map(|l| l.strip_prefix(name))
        .unwrap_or_else(|| panic!("no {name} in {status}"));
    u64::from_str_radix(hex.trim(), 16).unwrap()
}

/// The process's memory limit (bytes) and CPU quota (quota, period in µs), read from its own
/// cgroup (`/proc/PID/cgroup`) on cgroup v1 or v2, whichever holds the controller. `None`
/// where no limit is set.
fn cgroup_limits(pid: u32) -> (Option<u64>, Option<(u64, u64)>) {
    let listed = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).unwrap();
    let mut memory = None;
    let mut cpu = None;
    for line in listed.lines() {
        let mut parts = line.splitn(3, ':');
        let (_, controllers, path) = (
            parts.next().unwrap(),
            parts.next().unwrap(),
            parts.next().unwrap().trim_start_matches('/'),
        );
        let read = |dir: &str, file: &str| {
            std::fs::read_to_string(Path::new("/sys/fs/cgroup").join(dir).join(path).join(file))
                .ok()
                .map(|s| s.trim().to_owned())
        };
        let names: Vec<&str> = controllers.split(',').collect();
        if names.contains(&"memory") {
            memory = read(controllers, "memory.limit_in_bytes").map(|v| v.parse().unwrap());
        }
        if names.contains(&"cpu") {
            let quota = read(controllers, "cpu.cfs_quota_us").unwrap();
            let period = read(controllers, "cpu.cfs_period_us").unwrap();
            cpu = quota
                .parse::<i64>()
                .ok()
                .and_then(|q| u64::try_from(q).ok())
                .map(|q| (q, period.parse().unwrap()));
        }
        if controllers.is_empty() && memory.is_none() && cpu.is_none() {
            // cgroup v2: the unified hierarchy at /sys/fs/cgroup.
            if let Some(max) = read("", "memory.max") {
                memory = max.parse().ok();
            }
            if let Some(max) = read("", "cpu.max") {
                let (quota, period) = max.split_once(' ').unwrap();
                cpu = quota.parse().ok().map(|q| (q, period.parse().unwrap()));
            }
        }
    }
    (memory, cpu)
}

/// Live processes whose command line mentions `needle`, zombies excluded.
fn processes_mentioning(needle: &str) -> Vec<u32> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        let zombie = stat
            .rsplit_once(')')
            .is_some_and(|(_, rest)| rest.trim_start().starts_with('Z'));
        if !zombie && String::from_utf8_lossy(&cmdline).contains(needle) {
            found.push(pid);
        }
    }
    found
}

#[tokio::test]
async fn an_image_less_config_asking_for_isolation_runs_confined_as_asked() {
    require_private_mount_namespace();
    let dir = test_dir("csi-iso-run-");
    // A host dir with a marker, bound at a path that exists nowhere on the host.
    let volume = dir.path().join("volume");
    std::fs::create_dir_all(&volume).unwrap();
    std::fs::write(volume.join("marker"), "from the host").unwrap();
    let inside = dir.path().join("only-inside");
    let mut config = plugin_config();
    config["containers"][0]["resources"] = resources();
    config["containers"][0]["container"] = json!({
        "type": "MESOS",
        "volumes": [{"container_path": inside, "host_path": volume, "mode": "RO"}],
        "linux_info": {
            "effective_capabilities": {"capabilities": ["SYS_ADMIN", "DAC_OVERRIDE"]},
            "bounding_capabilities": {"capabilities": ["SYS_ADMIN", "DAC_OVERRIDE", "CHOWN"]}
        },
        "rlimit_info": {"rlimits": [{"type": "RLMT_NOFILE", "soft": 1000, "hard": 4096}]},
        "hostname": "iso-plugin"
    });
    let mut daemon = Daemon::new(dir.path(), &["--start-plugins"]);
    daemon.add_config("iso.json", &config);
    daemon.start();
    let info = daemon
        .wait_plugin(PLUGIN, "the plugin ready", Duration::from_secs(30), |i| {
            ready_pid(i).is_some()
        })
        .await;
    let pid = ready_pid(&info).unwrap();

    // cpus 0.5 → a CFS quota of half the period; mem 64 → 64 MiB.
    let (memory, cpu) = cgroup_limits(pid);
    assert_eq!(memory, Some(64 << 20), "{}", daemon.full_log());
    assert_eq!(cpu, Some((50_000, 100_000)));
    // The volume: its content at the container path, which the host does not have.
    assert!(!inside.exists());
    assert_eq!(
        std::fs::read_to_string(
            Path::new(&format!("/proc/{pid}/root"))
                .join(inside.strip_prefix("/").unwrap())
                .join("marker")
        )
        .unwrap(),
        "from the host"
    );
    // CAP_CHOWN is bit 0, CAP_DAC_OVERRIDE bit 1, CAP_SYS_ADMIN bit 21. The bounding set is
    // the one asked, not the effective one nor the daemon's. The effective set, inheritable
    // and ambient, is as asked; a root process gets its whole bounding set as effective at
    // `exec` whatever the runtime sets (capabilities(7)), so that is what a root plugin
    // holds.
    let bounding = 1 | (1 << 1) | (1 << 21);
    assert_eq!(cap_mask(pid, "CapBnd:"), bounding);
    assert_eq!(cap_mask(pid, "CapInh:"), (1 << 1) | (1 << 21));
    assert_eq!(cap_mask(pid, "CapAmb:"), (1 << 1) | (1 << 21));
    assert_eq!(cap_mask(pid, "CapEff:"), bounding);
    let limits = std::fs::read_to_string(format!("/proc/{pid}/limits")).unwrap();
    let open_files = limits
        .lines()
        .find(|l| l.starts_with("Max open files"))
        .unwrap()
        .split_whitespace()
        .collect::<Vec<_>>();
    assert_eq!(open_files[3..5], ["1000", "4096"], "{limits}");
    // A UTS namespace of its own, named as asked.
    assert_ne!(
        std::fs::read_link(format!("/proc/{pid}/ns/uts")).unwrap(),
        std::fs::read_link("/proc/self/ns/uts").unwrap()
    );
    let hostname = std::process::Command::new("nsenter")
        .args(["-t", &pid.to_string(), "--uts", "hostname"])
        .output()
        .unwrap();
    assert_eq!(
        String::from_utf8_lossy(&hostname.stdout).trim(),
        "iso-plugin"
    );
    // Its working directory is its sandbox (bound at the same path), where its relative
    // work dir was made, seen on the host too.
    let cwd = std::fs::read_link(format!("/proc/{pid}/cwd")).unwrap();
    assert!(cwd.starts_with(&daemon.work), "{cwd:?}");
    assert!(cwd.join("workdir").is_dir(), "{cwd:?}");
    let environ = std::fs::read(format!("/proc/{pid}/environ")).unwrap();
    let sandbox_var = format!("MESOS_SANDBOX={}", cwd.display());
    assert!(
        environ
            .split(|b| *b == 0)
            .any(|v| v == sandbox_var.as_bytes()),
        "{:?}",
        String::from_utf8_lossy(&environ)
    );
    // And it works: a publish through the daemon.
    let api = daemon.api();
    let published = api.publish(&publish_request("vol1", "w1")).await.unwrap();
    assert!(Path::new(&published.target_path).is_dir());
    api.unpublish(&unpublish_request("vol1", "w1"))
        .await
        .unwrap();
    std::fs::remove_file(daemon.configs.join("iso.json")).unwrap();
    api.reload().await.unwrap();
    daemon.kill9();
    assert_eq!(mounts_under(dir.path()), Vec::<PathBuf>::new());
}

#[tokio::test]
async fn without_the_oci_runtime_the_launch_fails_naming_the_fields_and_nothing_runs() {
    require_private_mount_namespace();
    let dir = test_dir("csi-iso-norunc-");
    let mut config = plugin_config();
    config["containers"][0]["resources"] = resources();
    config["containers"][0]["container"] =
        json!({"linux_info": {"effective_capabilities": {"capabilities": ["SYS_ADMIN"]}}});
    let mut daemon = Daemon::new(
        dir.path(),
        &["--start-plugins", "--oci-runtime", "/nonexistent/bin/runc"],
    );
    daemon.add_config("iso.json", &config);
    daemon.start();
    let info = daemon
        .wait_plugin(PLUGIN, "the launch error", Duration::from_secs(30), |i| {
            i.components.first().is_some_and(|c| c.error.is_some())
        })
        .await;
    let error = info.components[0].error.clone().unwrap();
    for needle in [
        "/nonexistent/bin/runc",
        "--oci-runtime",
        "resources.cpus",
        "resources.mem",
        "container.linux_info.effective_capabilities",
        "\"kind\": \"process\"",
    ] {
        assert!(error.contains(needle), "{needle:?} not in {error}");
    }
    // It is retried, and never runs unconfined meanwhile.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let info = daemon.api().plugin(PLUGIN).await.unwrap();
    assert!(info.components[0].restarts >= 1 || info.components[0].error.is_some());
    assert_eq!(info.components[0].pid, None, "{info:?}");
    let binary = binary("csi-testplugin");
    let running: Vec<u32> = processes_mentioning(&binary.display().to_string())
        .into_iter()
        .filter(|pid| {
            std::fs::read_link(format!("/proc/{pid}/cwd"))
                .is_ok_and(|cwd| cwd.starts_with(dir.path()))
        })
        .collect();
    assert_eq!(running, Vec::<u32>::new());
    let sandbox_workdirs: Vec<PathBuf> = walk_dirs(&daemon.work)
        .into_iter()
        .filter(|p| p.ends_with("workdir"))
        .collect();
    assert_eq!(sandbox_workdirs, Vec::<PathBuf>::new(), "the plugin ran");
    daemon.kill9();
}

/// Every dir beneath `root`.
fn walk_dirs(root: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
            if entry.file_type().is_ok_and(|t| t.is_dir()) {
                out.push(entry.path());
                stack.push(entry.path());
            }
        }
    }
    out
}

#[tokio::test]
async fn an_explicit_process_runtime_runs_unconfined_and_says_so_at_each_launch() {
    require_private_mount_namespace();
    let dir = test_dir("csi-iso-proc-");
    let mut config = plugin_config();
    config["runtime"] = json!({"kind": "process"});
    config["containers"][0]["resources"] = resources();
    config["containers"][0]["container"] = json!({"hostname": "not-applied"});
    let mut daemon = Daemon::new(dir.path(), &["--start-plugins"]);
    daemon.add_config("iso.json", &config);
    daemon.start();
    let warning =
        "runtime \"process\" does not apply resources.cpus, resources.mem, container.hostname";
    let first = ready_pid(
        &daemon
            .wait_plugin(PLUGIN, "the plugin ready", Duration::from_secs(30), |i| {
                ready_pid(i).is_some()
            })
            .await,
    )
    .unwrap();
    // A host process: the daemon's cgroup and UTS namespace, no limit of its own.
    let daemon_pid = daemon.child.as_ref().unwrap().id();
    assert_eq!(
        std::fs::read_to_string(format!("/proc/{first}/cgroup")).unwrap(),
        std::fs::read_to_string(format!("/proc/{daemon_pid}/cgroup")).unwrap()
    );
    assert_eq!(
        std::fs::read_link(format!("/proc/{first}/ns/uts")).unwrap(),
        std::fs::read_link("/proc/self/ns/uts").unwrap()
    );
    assert_eq!(
        daemon.full_log().matches(warning).count(),
        1,
        "{}",
        daemon.full_log()
    );
    // A second launch: a second line.
    rustix::process::kill_process(
        rustix::process::Pid::from_raw(i32::try_from(first).unwrap()).unwrap(),
        rustix::process::Signal::KILL,
    )
    .unwrap();
    daemon
        .wait_plugin(
            PLUGIN,
            "the relaunched plugin",
            Duration::from_secs(30),
            |i| ready_pid(i).is_some_and(|p| p != first),
        )
        .await;
    assert_eq!(
        daemon.full_log().matches(warning).count(),
        2,
        "{}",
        daemon.full_log()
    );
    std::fs::remove_file(daemon.configs.join("iso.json")).unwrap();
    daemon.api().reload().await.unwrap();
    daemon.kill9();
}

#[tokio::test]
async fn invalid_isolation_fields_are_refused_at_load_under_either_runtime() {
    require_private_mount_namespace();
    let dir = test_dir("csi-iso-bad-");
    let mut daemon = Daemon::new(dir.path(), &[]);
    let cases = [
        (
            json!({"linux_info": {"effective_capabilities": {"capabilities": ["CHOWN", "CAP_FLY"]}}}),
            Value::Null,
            "containers[0].container.linux_info.effective_capabilities.capabilities[1]",
            "CAP_FLY",
        ),
        (
            Value::Null,
            json!([{"name": "cpus", "type": "SCALAR", "scalar": {"value": -1}}]),
            "containers[0].resources[0].scalar.value",
            "positive",
        ),
        (
            json!({"rlimit_info": {"rlimits": [{"type": "RLMT_FLY", "soft": 1, "hard": 1}]}}),
            Value::Null,
            "containers[0].container.rlimit_info.rlimits[0].type",
            "RLMT_FLY",
        ),
    ];
    let mut expected = Vec::new();
    for (index, (container, resources, field, word)) in cases.iter().enumerate() {
        for (runtime, suffix) in [
            (Value::Null, "implicit"),
            (json!({"kind": "process"}), "process"),
        ] {
            let mut config = plugin_config();
            config["type"] = json!(format!("org.example.bad{index}{suffix}"));
            config["containers"][0]["container"] = container.clone();
            config["containers"][0]["resources"] = resources.clone();
            if !runtime.is_null() {
                config["runtime"] = runtime;
            }
            let file = format!("bad{index}-{suffix}.json");
            daemon.add_config(&file, &config);
            expected.push((file, *field, *word));
        }
    }
    daemon.start();
    let plugins = daemon.api().plugins().await.unwrap();
    assert!(plugins.plugins.is_empty(), "{plugins:?}");
    for (file, field, word) in expected {
        let error = plugins
            .config_errors
            .iter()
            .find(|e| e.file.ends_with(&file))
            .unwrap_or_else(|| panic!("no error for {file}: {plugins:?}"));
        assert!(
            error.message.contains(field) && error.message.contains(word),
            "{file}: {}",
            error.message
        );
    }
    daemon.kill9();
}
