//! The real `csi-agentd` in a test's dir: built by [`DaemonBuilder`] (flags, plugin configs,
//! bind roots, a registry, a wrapper command, environment), started, killed with SIGKILL,
//! restarted, with its API client, `csictl` and its log.
//!
//! Owns the daemon process and, when dropped, everything started under the test's dir (by
//! pid) and every mount there. Must not: decide what a test expects (no assertion here but
//! "the daemon started"), or touch anything outside the test's dir.

use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use csi_agent_api::ApiClient;

use crate::{PLUGIN, binary, detach_mounts_under, kill9_pid, managed_config, pids_using_dir};

/// What a [`Daemon`] is started with. Later: etcd endpoints and container engines, as more
/// methods that add their flags.
#[derive(Debug)]
pub struct DaemonBuilder {
    dir: PathBuf,
    extra: Vec<String>,
    env: Vec<(String, String)>,
    wrapper: Vec<String>,
    configs: Vec<(String, serde_json::Value)>,
    log_format: Option<&'static str>,
}

impl DaemonBuilder {
    /// One more argument of `csi-agentd serve`.
    pub fn flag(mut self, arg: impl AsRef<std::ffi::OsStr>) -> Self {
        self.extra.push(arg.as_ref().to_string_lossy().into_owned());
        self
    }

    /// More arguments of `csi-agentd serve`.
    pub fn flags(mut self, args: &[&str]) -> Self {
        self.extra.extend(args.iter().map(|s| (*s).to_owned()));
        self
    }

    /// `--bind-root DIR`.
    pub fn bind_root(self, dir: &Path) -> Self {
        self.flag("--bind-root").flag(dir)
    }

    /// Pulls from the registry at `host` over plain HTTP.
    pub fn registry(self, host: &str) -> Self {
        self.flags(&["--docker-registry", host, "--insecure-registry", host])
    }

    /// A plugin config file `file` in the config dir.
    pub fn plugin_config(mut self, file: &str, config: serde_json::Value) -> Self {
        self.configs.push((file.to_owned(), config));
        self
    }

    /// The test plugin as [`PLUGIN`] (`test.json`), its state in `<dir>/plugin`, with these
    /// pre-provisioned `volumes` (`name:size,...`).
    pub fn test_plugin(self, volumes: &str) -> Self {
        let config = managed_config(PLUGIN, &self.dir.join("plugin"), volumes);
        self.plugin_config("test.json", config)
    }

    /// `key=value` in the daemon's environment.
    pub fn env(mut self, key: &str, value: &str) -> Self {
        self.env.push((key.to_owned(), value.to_owned()));
        self
    }

    /// Starts the daemon through this command (`prlimit ...`, `unshare -m sh -c '...; exec
    /// "$0" "$@"'`), given the daemon's path and arguments.
    pub fn wrapper(mut self, command: &[&str]) -> Self {
        self.wrapper = command.iter().map(|s| (*s).to_owned()).collect();
        self
    }

    /// `--log-format` (`json` for [`Daemon::log_events`]).
    pub fn log_format(mut self, format: &'static str) -> Self {
        self.log_format = Some(format);
        self
    }

    /// The daemon, its dirs and config files written, not started.
    pub fn build(self) -> Daemon {
        let configs = self.dir.join("configs");
        std::fs::create_dir_all(&configs).unwrap();
        let work = self.dir.join("work");
        let daemon = Daemon {
            socket: work.join("api.sock"),
            socket_root: self.dir.join("sockets"),
            log: self.dir.join("daemon.log"),
            log_start: 0,
            work,
            configs,
            child: None,
            extra: self.extra,
            env: self.env,
            wrapper: self.wrapper,
            log_format: self.log_format,
            boot_id_file: None,
            starts: 0,
        };
        for (file, config) in &self.configs {
            daemon.add_config(file, config);
        }
        daemon
    }

    /// [`DaemonBuilder::build`], then [`Daemon::start`].
    pub fn start(self) -> Daemon {
        let mut daemon = self.build();
        daemon.start();
        daemon
    }
}

/// A `csi-agentd serve` with its work dir, plugin config dir and socket root in one test dir,
/// its stderr appended to `<dir>/daemon.log`.
#[derive(Debug)]
pub struct Daemon {
    pub work: PathBuf,
    pub configs: PathBuf,
    pub socket: PathBuf,
    pub socket_root: PathBuf,
    pub child: Option<Child>,
    /// More arguments of the next `start`.
    pub extra: Vec<String>,
    /// Extra environment of the next `start`.
    pub env: Vec<(String, String)>,
    /// A command the daemon is started through, given its path and arguments. Empty: the
    /// daemon is started directly.
    pub wrapper: Vec<String>,
    /// `--log-format` of the next `start`, if any.
    pub log_format: Option<&'static str>,
    /// Passed as `--boot-id-file` when set.
    pub boot_id_file: Option<PathBuf>,
    /// Daemon processes started so far.
    pub starts: u32,
    log: PathBuf,
    /// Where the current daemon's lines start in the log.
    log_start: u64,
}

impl Daemon {
    pub fn builder(dir: &Path) -> DaemonBuilder {
        DaemonBuilder {
            dir: dir.to_owned(),
            extra: Vec::new(),
            env: Vec::new(),
            wrapper: Vec::new(),
            configs: Vec::new(),
            log_format: None,
        }
    }

    /// A daemon in `dir` with these extra flags and no plugin config, not started.
    pub fn new(dir: &Path, extra: &[&str]) -> Self {
        Self::builder(dir).flags(extra).build()
    }

    /// The test's dir (the work dir's parent).
    pub fn dir(&self) -> &Path {
        self.log.parent().unwrap()
    }

    pub fn add_config(&self, file: &str, config: &serde_json::Value) {
        std::fs::write(
            self.configs.join(file),
            serde_json::to_vec_pretty(config).unwrap(),
        )
        .unwrap();
    }

    /// The whole command of the next start: wrapper, binary, `serve` and the dirs, log
    /// format, boot id file, extra flags and environment (the test's own
    /// `CSI_AGENT_FAILPOINTS` is not inherited), stderr to the log. For tests that run it
    /// themselves (a refused start).
    pub fn command(&self) -> Command {
        let daemon = binary("csi-agentd");
        let mut command = match self.wrapper.split_first() {
            Some((program, args)) => {
                let mut command = Command::new(program);
                command.args(args).arg(daemon);
                command
            }
            None => Command::new(daemon),
        };
        self.serve_args(&mut command);
        if let Some(format) = self.log_format {
            command.args(["--log-format", format]);
        }
        if let Some(file) = &self.boot_id_file {
            command.arg("--boot-id-file").arg(file);
        }
        command
            .args(&self.extra)
            .env("CSI_AGENT_LOG", "info")
            .env_remove(csi_agent::failpoint::ENV_VAR)
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(
                std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(&self.log)
                    .unwrap(),
            );
        command
    }

    /// Starts the daemon and waits (20 s at most) until its socket exists; panics with its
    /// log if it exits first.
    pub fn start(&mut self) {
        // A socket left by a daemon killed before would look like the new one's.
        let _ = std::fs::remove_file(&self.socket);
        self.spawn();
        let deadline = Instant::now() + Duration::from_secs(20);
        while !self.socket.exists() {
            if let Some(status) = self.child.as_mut().unwrap().try_wait().unwrap() {
                panic!("the daemon exited at start ({status}): {}", self.log_text());
            }
            assert!(
                Instant::now() < deadline,
                "the daemon never opened its socket: {}",
                self.log_text()
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Starts the daemon and returns at once, leaving whatever is at its socket path (for a
    /// test of what the daemon does with it); [`Daemon::start`] is the usual way.
    pub fn spawn(&mut self) {
        self.log_start = std::fs::metadata(&self.log).map(|m| m.len()).unwrap_or(0);
        self.starts += 1;
        self.child = Some(self.command().spawn().unwrap());
    }

    /// Waits (20 s at most) until the API answers `GET /v1/health`.
    pub async fn wait_healthy(&mut self) {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if self.socket.exists() && self.api().health().await.is_ok() {
                return;
            }
            if let Some(status) = self.child.as_mut().and_then(|c| c.try_wait().unwrap()) {
                panic!(
                    "the daemon exited at start ({status:?}): {}",
                    self.log_text()
                );
            }
            assert!(
                Instant::now() < deadline,
                "the daemon never answered: {}",
                self.log_text()
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// Adds `serve` and this daemon's work dir, config dir and socket root to `command` (the
    /// `csi-agentd` binary or its wrapper): for a second daemon a test runs beside or
    /// instead of this one.
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
        self.set_env(key, Some(value));
    }

    /// Sets (or with `None` removes) `key` in the environment of the next `start`.
    pub fn set_env(&mut self, key: &str, value: Option<&str>) {
        self.env.retain(|(k, _)| k != key);
        if let Some(value) = value {
            self.env.push((key.to_owned(), value.to_owned()));
        }
    }

    /// The running daemon's pid.
    pub fn daemon_pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    pub fn daemon_alive(&mut self) -> bool {
        match self.child.as_mut() {
            None => false,
            Some(child) => child.try_wait().unwrap().is_none(),
        }
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

    /// Waits (`timeout` at most) for the daemon to end and returns how; `None` if it still
    /// runs (or never ran).
    pub async fn exit_status(&mut self, timeout: Duration) -> Option<ExitStatus> {
        let deadline = Instant::now() + timeout;
        loop {
            let child = self.child.as_mut()?;
            if let Some(status) = child.try_wait().unwrap() {
                self.child = None;
                return Some(status);
            }
            if Instant::now() >= deadline {
                return None;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    /// SIGKILL from outside.
    pub fn kill9(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            child.wait().unwrap();
        }
    }

    pub fn api(&self) -> ApiClient {
        ApiClient::unix(&self.socket).with_timeout(Some(Duration::from_secs(60)))
    }

    /// The ids of the test plugin's own volumes (one page of ListVolumes through the API),
    /// sorted: what a create or a delete changed in the plugin.
    pub async fn backend_volume_ids(&self) -> Vec<String> {
        let mut ids: Vec<String> = self
            .api()
            .backend_volumes(PLUGIN, None, None)
            .await
            .unwrap()
            .volumes
            .into_iter()
            .map(|v| v.volume_id)
            .collect();
        ids.sort();
        ids
    }

    pub fn csictl(&self, args: &[&str]) -> std::process::Output {
        Command::new(binary("csictl"))
            .arg("--socket")
            .arg(&self.socket)
            .args(args)
            .output()
            .unwrap()
    }

    /// What the current (or last) daemon process wrote to its log.
    pub fn log_text(&self) -> String {
        let mut text = String::new();
        if let Ok(mut file) = std::fs::File::open(&self.log) {
            let _ = file.seek(SeekFrom::Start(self.log_start));
            let _ = file.read_to_string(&mut text);
        }
        text
    }

    /// Polls `GET /v1/plugins/{plugin}` until `check` accepts the answer, failing the test
    /// with the last answer and the daemon's log after `timeout`.
    pub async fn wait_plugin(
        &self,
        plugin: &str,
        what: &str,
        timeout: Duration,
        mut check: impl FnMut(&csi_agent_api::PluginInfo) -> bool,
    ) -> csi_agent_api::PluginInfo {
        let deadline = Instant::now() + timeout;
        loop {
            let info = self.api().plugin(plugin).await;
            if let Ok(info) = &info
                && check(info)
            {
                return info.clone();
            }
            assert!(
                Instant::now() < deadline,
                "timed out waiting for {what}: {info:?}\n{}",
                self.full_log()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// What every daemon process started here wrote to the log.
    pub fn full_log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// The fields of the current daemon's JSON log lines with this message (`--log-format
    /// json`).
    pub fn log_events(&self, message: &str) -> Vec<serde_json::Value> {
        self.log_text()
            .lines()
            .filter_map(|line| serde_json::from_str::<serde_json::Value>(line).ok())
            .filter(|event| event["fields"]["message"] == message)
            .map(|event| event["fields"].clone())
            .collect()
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        if std::thread::panicking() {
            // The temp dir goes with the test: show what the daemon said while it can be read.
            let text = self.full_log();
            let tail: Vec<&str> = text.lines().rev().take(40).collect();
            eprintln!("--- the daemon's log ({}), last lines:", self.log.display());
            for line in tail.iter().rev() {
                eprintln!("{line}");
            }
        }
        self.kill9();
        // The daemon leaves its plugins running on purpose; the test does not. By pid: only
        // the processes with an argument in this test's dir.
        let dir = self.dir().to_owned();
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            let pids = pids_using_dir(&dir);
            if pids.is_empty() || Instant::now() >= deadline {
                break;
            }
            for pid in pids {
                kill9_pid(pid);
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        // Nor its mounts (the plugin's, a test's own tmpfs).
        detach_mounts_under(&dir);
    }
}

/// The test plugin's daemon in `dir` with `vol1` and `vol2` (1 MiB each) and these flags,
/// started, in a private mount namespace (panics otherwise).
pub fn setup(dir: &Path, extra: &[&str]) -> Daemon {
    crate::require_private_mount_namespace();
    Daemon::builder(dir)
        .flags(extra)
        .test_plugin("vol1:1M,vol2:1M")
        .start()
}
