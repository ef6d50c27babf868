//! The real `csi-agentd` for end-to-end tests: start, kill -9, restart, its API and
//! `csictl`, with the real `csi-testplugin` as a managed plugin. Real bind mounts: callers
//! run under `unshare -m --propagation private` (`setup` checks).
#![allow(clippy::unwrap_used, clippy::expect_used, dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use csi_agent::mounts::{MountTable, require_private_mount_namespace};
use csi_agent_api::{
    ApiClient, ApiError, CapabilitySpec, MountSpec, PublishRequest, UnpublishRequest,
};
use serde_json::json;

pub const PLUGIN: &str = "org.example.test";

pub fn binary(name: &str) -> PathBuf {
    csi_agent::binaries::required(name, None)
}

/// A managed plugin config launching the test plugin with its state in `plugin_dir`.
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
                              "--node-id", "node-1"]
            }
        }],
        "startup_timeout_ms": 20000
    })
}

pub struct Daemon {
    pub work: PathBuf,
    pub configs: PathBuf,
    pub socket: PathBuf,
    pub socket_root: PathBuf,
    pub child: Option<Child>,
    pub extra: Vec<String>,
    /// Extra environment of the next `start`.
    pub env: Vec<(String, String)>,
    /// A command the daemon is started through (`unshare -m sh -c '...; exec "$0" "$@"'`):
    /// it is given the daemon's path and arguments. Empty: the daemon is started directly.
    pub wrapper: Vec<String>,
}

impl Daemon {
    pub fn new(dir: &Path, extra: &[&str]) -> Self {
        let configs = dir.join("configs");
        std::fs::create_dir_all(&configs).unwrap();
        let work = dir.join("work");
        Self {
            socket: work.join("api.sock"),
            socket_root: dir.join("sockets"),
            work,
            configs,
            child: None,
            extra: extra.iter().map(|s| (*s).to_owned()).collect(),
            env: Vec::new(),
            wrapper: Vec::new(),
        }
    }

    pub fn add_config(&self, file: &str, config: &serde_json::Value) {
        std::fs::write(
            self.configs.join(file),
            serde_json::to_vec_pretty(config).unwrap(),
        )
        .unwrap();
    }

    pub fn start(&mut self) {
        let _ = std::fs::remove_file(&self.socket);
        let daemon = env!("CARGO_BIN_EXE_csi-agentd");
        let mut command = match self.wrapper.split_first() {
            Some((program, args)) => {
                let mut command = Command::new(program);
                command.args(args).arg(daemon);
                command
            }
            None => Command::new(daemon),
        };
        let child = self
            .serve_args(&mut command)
            .args(&self.extra)
            .env("CSI_AGENT_LOG", "info")
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .stdout(Stdio::null())
            .stderr(
                std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(self.work.parent().unwrap().join("daemon.log"))
                    .unwrap(),
            )
            .spawn()
            .unwrap();
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(20);
        while !self.socket.exists() {
            assert!(
                Instant::now() < deadline,
                "the daemon never opened its socket"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Adds `serve` and this daemon's work dir, config dir and socket root to `command` (the
    /// `csi-agentd` binary or its wrapper): for `start`, and for a second daemon a test runs
    /// beside or instead of this one.
    pub fn serve_args<'a>(&self, command: &'a mut Command) -> &'a mut Command {
        command
            .arg("serve")
            .arg("--work-dir")
            .arg(&self.work)
            .arg("--plugin-config-dir")
            .arg(&self.configs)
            .arg("--socket-root")
            .arg(&self.socket_root)
    }

    /// Kills the daemon if it runs, and sets `key=value` for the next `start`.
    pub fn stop_and_set_env(&mut self, key: &str, value: &str) {
        self.kill9();
        self.env.retain(|(k, _)| k != key);
        self.env.push((key.to_owned(), value.to_owned()));
    }

    /// Waits for a daemon that is dying by itself (a failpoint) to be gone.
    pub fn wait_exit(&mut self) {
        if let Some(mut child) = self.child.take() {
            child.wait().unwrap();
        }
    }

    /// Waits for the daemon to exit on its own (a failpoint's `exit`), failing the test
    /// (the daemon killed) if it still runs after `limit`.
    pub fn wait_exit_within(&mut self, limit: Duration) {
        let deadline = Instant::now() + limit;
        while let Some(child) = self.child.as_mut() {
            if child.try_wait().unwrap().is_some() {
                self.child = None;
                return;
            }
            if Instant::now() >= deadline {
                self.kill9();
                panic!("the daemon did not exit within {limit:?}");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn kill9(&mut self) {
        if let Some(mut child) = self.child.take() {
            child.kill().unwrap();
            child.wait().unwrap();
        }
    }

    pub fn api(&self) -> ApiClient {
        ApiClient::unix(&self.socket).with_timeout(Some(Duration::from_secs(60)))
    }

    pub fn csictl(&self, args: &[&str]) -> std::process::Output {
        Command::new(binary("csictl"))
            .arg("--socket")
            .arg(&self.socket)
            .args(args)
            .output()
            .unwrap()
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        if std::thread::panicking() {
            // The temp dir goes with the test: show what the daemon said while it can be read.
            let log = self.work.parent().unwrap().join("daemon.log");
            let text = std::fs::read_to_string(&log).unwrap_or_default();
            let tail: Vec<&str> = text.lines().rev().take(40).collect();
            eprintln!("--- the daemon's log ({}), last lines:", log.display());
            for line in tail.iter().rev() {
                eprintln!("{line}");
            }
        }
        self.kill9();
        // The daemon leaves its plugins running on purpose; the test does not.
        let test_dir = self.work.parent().unwrap();
        let _ = Command::new("pkill")
            .arg("-f")
            .arg(test_dir.to_string_lossy().as_ref())
            .status();
        // Nor its mounts (the plugin's, a test's own tmpfs): the temp dir's removal cannot go
        // through a mount point and would leave the dir in /tmp (issue #30). Innermost first,
        // detached, since a plugin killed a moment ago may still hold one.
        let mut mounts = mounts_under(test_dir);
        mounts.sort_by_key(|p| std::cmp::Reverse(p.components().count()));
        for mount in mounts {
            let _ = Command::new("umount").arg("-l").arg(&mount).status();
        }
    }
}

pub fn capability() -> CapabilitySpec {
    CapabilitySpec {
        mount: Some(MountSpec::default()),
        block: None,
        access_mode: "SINGLE_NODE_WRITER".to_owned(),
    }
}

pub fn publish(volume: &str, workload: &str) -> PublishRequest {
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

/// [`publish`] with a `bind_to`.
pub fn publish_bound(volume: &str, workload: &str, bind: &Path) -> PublishRequest {
    let mut request = publish(volume, workload);
    request.bind_to = Some(bind.to_string_lossy().into_owned());
    request
}

pub fn unpublish(volume: &str, workload: &str) -> UnpublishRequest {
    UnpublishRequest {
        plugin: PLUGIN.to_owned(),
        volume_id: volume.to_owned(),
        workload: workload.to_owned(),
    }
}

/// The names in `dir`, sorted.
pub fn dir_names(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

pub fn mounts_under(dir: &Path) -> Vec<PathBuf> {
    MountTable::read()
        .unwrap()
        .mounts_under(dir)
        .into_iter()
        .map(|m| m.mount_point.clone())
        .collect()
}

pub fn api_error(
    result: Result<impl std::fmt::Debug, ApiError>,
) -> (u16, csi_agent_api::ErrorBody) {
    match result {
        Err(ApiError::Api { status, body }) => (status, body),
        other => panic!("expected an API error, got {other:?}"),
    }
}

pub fn setup(dir: &Path, extra: &[&str]) -> Daemon {
    require_private_mount_namespace();
    let mut daemon = Daemon::new(dir, extra);
    daemon.add_config(
        "test.json",
        &managed_config(PLUGIN, &dir.join("plugin"), "vol1:1M,vol2:1M"),
    );
    daemon.start();
    daemon
}

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
