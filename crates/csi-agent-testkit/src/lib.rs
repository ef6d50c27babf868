//! The one harness of the daemon-level tests: the real `csi-agentd` started by a builder
//! ([`Daemon`], flags, plugin configs, bind roots, a registry), real etcd
//! members and a fault-injecting proxy in front of them ([`etcd`]), the real
//! `csi-testplugin` as its managed plugin, the API client, publish and unpublish requests,
//! mount-table and process checks, the crash matrix's observed node ([`node::Node`]), the
//! image tests' plugin images ([`image`]) and the loopback registries and
//! image builders ([`registry`]), the judge of double attach that reads the test plugin's
//! shared backend ([`backend::BackendJudge`]), and real container engines — Debian's `dockerd` and
//! `podman` on the test's dir, with a busybox image — for the volume plugin front door
//! ([`engines`]).
//!
//! Owns: starting, observing and cleaning up what a test runs (processes by pid, mounts under
//! the test's dir), never anything outside the test's dir. Must not: be a dependency of a
//! shipped crate (only dev-dependencies and `csi-agent-bench`), turn on csi-agent's
//! `failpoints` itself, or know a failpoint or a test's expectations. Tests mount for real: they
//! run as root under `unshare -m --propagation private` ([`require_private_mount_namespace`]).
//!
//! A test crate, so it panics on the unexpected: `unwrap`/`expect` are allowed here.
#![allow(clippy::unwrap_used, clippy::expect_used)]

pub mod backend;
pub mod daemon;
pub mod engines;
pub mod etcd;
pub mod image;
pub mod node;
pub mod registry;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

pub use backend::{BackendJudge, Call};
use csi_agent::mounts::MountTable;
pub use csi_agent::mounts::require_private_mount_namespace;
use csi_agent_api::{
    ApiError, CapabilitySpec, MountSpec, PublishRequest, SecretsSpec, UnpublishRequest,
};
pub use daemon::{Daemon, DaemonBuilder, setup};
use serde_json::json;

/// The plugin type of the test plugin in [`managed_config`] and the requests below.
pub const PLUGIN: &str = "org.example.test";
/// The node id the test plugin answers and accepts in ControllerPublish.
pub const NODE_ID: &str = "node-1";

/// A binary of the workspace (`csi-agentd`, `csi-testplugin`, `csictl`) beside the running
/// test binary, whatever `CARGO_TARGET_DIR` and profile; panics saying what to build.
pub fn binary(name: &str) -> PathBuf {
    csi_agent::binaries::required(name, None)
}

/// A managed plugin config of `plugin_type` launching the test plugin with its state in
/// `plugin_dir` and the pre-provisioned `volumes` (`name:size,...`), node id [`NODE_ID`].
pub fn managed_config(plugin_type: &str, plugin_dir: &Path, volumes: &str) -> serde_json::Value {
    json!({
        "type": plugin_type,
        "containers": [{
            "services": ["CONTROLLER_SERVICE", "NODE_SERVICE"],
            "command": {
                "shell": false,
                "value": binary("csi-testplugin"),
                "arguments": ["csi-testplugin", "--endpoint", "$CSI_ENDPOINT",
                              "--work-dir", plugin_dir, "--volumes", volumes,
                              "--node-id", NODE_ID]
            }
        }],
        "startup_timeout_ms": 20000
    })
}

/// A single-node-writer mount capability.
pub fn capability() -> CapabilitySpec {
    CapabilitySpec {
        mount: Some(MountSpec::default()),
        block: None,
        access_mode: "SINGLE_NODE_WRITER".to_owned(),
    }
}

/// A publish of `volume` of [`PLUGIN`] for `workload`, read-write, no secrets, no `bind_to`.
pub fn publish_request(volume: &str, workload: &str) -> PublishRequest {
    PublishRequest {
        plugin: PLUGIN.to_owned(),
        volume_id: volume.to_owned(),
        workload: workload.to_owned(),
        capability: capability(),
        readonly: false,
        volume_context: None,
        secrets: None,
        bind_to: None,
    }
}

/// [`publish_request`] with a `bind_to`.
pub fn publish_bound(volume: &str, workload: &str, bind: &Path) -> PublishRequest {
    let mut request = publish_request(volume, workload);
    request.bind_to = Some(bind.to_string_lossy().into_owned());
    request
}

/// [`publish_request`] with node-stage secrets: the publish then writes the secrets file
/// first (one more durable write for the crash matrix to break).
pub fn publish_with_secrets(volume: &str, workload: &str) -> PublishRequest {
    let mut request = publish_request(volume, workload);
    request.secrets = Some(SecretsSpec {
        node_stage: [("user".to_owned(), "crash-matrix".to_owned())].into(),
        node_publish: Default::default(),
    });
    request
}

pub fn unpublish_request(volume: &str, workload: &str) -> UnpublishRequest {
    UnpublishRequest {
        plugin: PLUGIN.to_owned(),
        volume_id: volume.to_owned(),
        workload: workload.to_owned(),
    }
}

/// The status and body of an API error; panics on success or a transport error.
pub fn api_error(
    result: Result<impl std::fmt::Debug, ApiError>,
) -> (u16, csi_agent_api::ErrorBody) {
    match result {
        Err(ApiError::Api { status, body }) => (status, body),
        other => panic!("expected an API error, got {other:?}"),
    }
}

/// Polls `check` until it returns `Ok`, or panics with its last error.
pub async fn eventually<F, Fut>(what: &str, timeout: Duration, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<(), String>>,
{
    let deadline = Instant::now() + timeout;
    loop {
        match check().await {
            Ok(()) => return,
            Err(_) if Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(25)).await;
            }
            Err(err) => panic!("timed out after {timeout:?} waiting for {what}: {err}"),
        }
    }
}

// ---- files and mounts ----

/// The names in `dir`, sorted.
pub fn dir_names(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

/// Names in `dir` starting with `.tmp-` (what a pull or a preparation in progress has).
pub fn temp_names(dir: &Path) -> Vec<String> {
    std::fs::read_dir(dir)
        .map(|entries| {
            entries
                .flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| n.starts_with(".tmp-"))
                .collect()
        })
        .unwrap_or_default()
}

/// Every mount point under `dir`, in mount table order, repeated if stacked.
pub fn mounts_under(dir: &Path) -> Vec<PathBuf> {
    MountTable::read()
        .unwrap()
        .mounts_under(dir)
        .into_iter()
        .map(|m| m.mount_point.clone())
        .collect()
}

pub fn is_mounted(path: &Path) -> bool {
    MountTable::read().unwrap().is_mount_point(path)
}

/// Detaches every mount under `dir`, innermost first (a process killed a moment ago may still
/// hold one): a temp dir's removal cannot go through a mount point (issue #30).
pub fn detach_mounts_under(dir: &Path) {
    let mut mounts = mounts_under(dir);
    mounts.sort_by_key(|p| std::cmp::Reverse(p.components().count()));
    for mount in mounts {
        let _ = std::process::Command::new("umount")
            .arg("-l")
            .arg(&mount)
            .status();
    }
}

// ---- the state database ----

/// Edits the committed record of `volume` (of [`PLUGIN`]) by hand, as an operator or an
/// attacker with the work dir could, while no daemon runs.
pub fn edit_record(work: &Path, volume: &str, edit: impl FnOnce(&mut serde_json::Value)) {
    let key = csi_agent::layout::encode_id(volume);
    let mut row = csi_agent::store::db::dump(work)
        .unwrap()
        .into_iter()
        .find(|row| row.plugin_type == PLUGIN && row.volume_key == key)
        .unwrap_or_else(|| panic!("no record of {volume}"));
    let mut record: serde_json::Value = serde_json::from_str(&row.record).unwrap();
    edit(&mut record);
    row.record = record.to_string();
    csi_agent::store::db::put_raw(work, &row).unwrap();
}

// ---- processes ----

/// `Uid:`, `Gid:` and `Groups:` of `/proc/<pid>/status`, each as written there (fields
/// separated by one space).
pub fn proc_ids(pid: u32) -> (String, String, String) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let field = |name: &str| {
        status
            .lines()
            .find_map(|line| line.strip_prefix(&format!("{name}:")))
            .unwrap()
            .split_whitespace()
            .collect::<Vec<_>>()
            .join(" ")
    };
    (field("Uid"), field("Gid"), field("Groups"))
}

/// Live (not zombie) processes one of whose arguments satisfies `matches`.
pub fn pids_with_arg(matches: impl Fn(&[u8]) -> bool) -> std::collections::BTreeSet<i32> {
    let mut pids = std::collections::BTreeSet::new();
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return pids;
    };
    for entry in entries.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|s| s.parse::<i32>().ok())
        else {
            continue;
        };
        let Ok(cmdline) = std::fs::read(entry.path().join("cmdline")) else {
            continue;
        };
        if cmdline.split(|b| *b == 0).any(&matches) && !is_zombie(pid) {
            pids.insert(pid);
        }
    }
    pids
}

/// Live processes with an argument that contains `dir` (its path or a path under it): what a
/// test started there, the daemon's plugins included. Never the test process itself.
pub fn pids_using_dir(dir: &Path) -> std::collections::BTreeSet<i32> {
    let wanted = dir.as_os_str().as_encoded_bytes().to_vec();
    let me = i32::try_from(std::process::id()).unwrap_or(-1);
    let mut pids = pids_with_arg(|arg| arg.windows(wanted.len()).any(|w| w == wanted));
    pids.remove(&me);
    pids
}

/// Live test plugin processes working on `plugin_dir` (launched with `--work-dir
/// <plugin_dir>`, as [`managed_config`] does).
pub fn plugin_pids(plugin_dir: &Path) -> std::collections::BTreeSet<i32> {
    let wanted = plugin_dir.as_os_str().as_encoded_bytes().to_vec();
    pids_with_arg(|arg| arg == wanted.as_slice())
}

pub fn kill9_pid(pid: i32) {
    if let Some(pid) = rustix::process::Pid::from_raw(pid) {
        let _ = rustix::process::kill_process(pid, rustix::process::Signal::KILL);
    }
}

fn is_zombie(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map(|stat| {
            stat.rsplit_once(')')
                .is_some_and(|(_, rest)| rest.trim_start().starts_with('Z'))
        })
        .unwrap_or(true)
}

pub fn pid_alive(pid: i32) -> bool {
    Path::new(&format!("/proc/{pid}")).exists() && !is_zombie(pid)
}
