//! The real `csi-agentd` as a child process, with plugin configs pointing at the release
//! `csi-testplugin`, and the API client used to drive it.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use csi_agent_api::client::ApiClient;
use csi_agent_api::types::{CapabilitySpec, PublishRequest, UnpublishRequest};

use crate::env::{Env, NODE_ID};
use crate::procs::{ChildGuard, Memory, Scratch, memory};
use crate::stats::metric;

/// One managed test plugin in the daemon's config dir.
#[derive(Clone, Debug)]
pub struct PluginSpec {
    pub plugin_type: String,
    /// The plugin's own work dir (state.json, call log, volume dirs).
    pub work_dir: PathBuf,
    /// Flags after `--endpoint` and `--work-dir`.
    pub flags: Vec<String>,
    /// Extra top-level fields of the config (csi-agent's own settings).
    pub extra: serde_json::Map<String, serde_json::Value>,
}

impl PluginSpec {
    pub fn new(plugin_type: &str, work_dir: PathBuf, flags: &[&str]) -> Self {
        Self {
            plugin_type: plugin_type.to_owned(),
            work_dir,
            flags: flags.iter().map(|s| (*s).to_owned()).collect(),
            extra: serde_json::Map::new(),
        }
    }

    /// The Mesos `CSIPluginInfo` JSON of this plugin (managed; the process runtime).
    pub fn config_json(&self, plugin_bin: &Path) -> serde_json::Value {
        let mut arguments = vec![
            "csi-testplugin".to_owned(),
            "--endpoint".to_owned(),
            "$CSI_ENDPOINT".to_owned(),
            "--work-dir".to_owned(),
            self.work_dir.display().to_string(),
        ];
        arguments.extend(self.flags.iter().cloned());
        let mut config = serde_json::json!({
            "type": self.plugin_type,
            "containers": [{
                "services": ["CONTROLLER_SERVICE", "NODE_SERVICE"],
                "command": {
                    "value": plugin_bin.display().to_string(),
                    "arguments": arguments,
                    "shell": false,
                    "environment": { "variables": [ { "name": "RUST_LOG", "value": "warn" } ] }
                }
            }]
        });
        if let Some(object) = config.as_object_mut() {
            object.extend(self.extra.clone());
        }
        config
    }
}

/// A running `csi-agentd serve`.
#[derive(Debug)]
pub struct Daemon {
    guard: ChildGuard,
    pub api: ApiClient,
    command: Vec<String>,
    log: PathBuf,
}

/// Paths of a daemon instance under a scratch dir (stable across restarts).
#[derive(Clone, Debug)]
pub struct DaemonDirs {
    pub work_dir: PathBuf,
    pub config_dir: PathBuf,
    pub socket_root: PathBuf,
    pub log_dir: PathBuf,
}

impl DaemonDirs {
    pub fn new(scratch: &Scratch, name: &str) -> anyhow::Result<Self> {
        let dirs = Self {
            work_dir: scratch.join(&format!("{name}-work")),
            config_dir: scratch.join(&format!("{name}-plugins")),
            socket_root: scratch.join(&format!("{name}-s")),
            log_dir: scratch.join(&format!("{name}-logs")),
        };
        for dir in [&dirs.config_dir, &dirs.log_dir] {
            std::fs::create_dir_all(dir)?;
        }
        Ok(dirs)
    }

    pub fn add_plugin(&self, env: &Env, spec: &PluginSpec) -> anyhow::Result<()> {
        std::fs::create_dir_all(&spec.work_dir)?;
        let file = self.config_dir.join(format!("{}.json", spec.plugin_type));
        let text = serde_json::to_string_pretty(&spec.config_json(&env.plugin_bin))?;
        std::fs::write(&file, text).with_context(|| format!("cannot write {}", file.display()))
    }
}

impl Daemon {
    /// Starts the daemon (`--start immediate`) and waits until `GET /v1/health` answers.
    pub async fn start(env: &Env, dirs: &DaemonDirs) -> anyhow::Result<(Self, Duration)> {
        let daemon = Self::spawn(env, dirs)?;
        daemon.ready().await
    }

    /// Starts the daemon without waiting.
    pub fn spawn(env: &Env, dirs: &DaemonDirs) -> anyhow::Result<Self> {
        Self::spawn_with(env, dirs, &[])
    }

    /// Starts the daemon without waiting, with `extra` flags after the usual ones.
    pub fn spawn_with(env: &Env, dirs: &DaemonDirs, extra: &[String]) -> anyhow::Result<Self> {
        Self::spawn_wrapped(env, dirs, &[], extra)
    }

    /// [`Daemon::spawn_with`], the command run through `wrapper` (a program and its
    /// arguments that exec the daemon, e.g. `unshare -m --propagation private` for a mount
    /// namespace of its own, as each node of a cluster has). The wrapper must exec, not
    /// fork: the guard kills the pid it started.
    pub fn spawn_wrapped(
        env: &Env,
        dirs: &DaemonDirs,
        wrapper: &[String],
        extra: &[String],
    ) -> anyhow::Result<Self> {
        let index = std::fs::read_dir(&dirs.log_dir).map_or(0, Iterator::count);
        let log = dirs.log_dir.join(format!("daemon-{index}.stderr"));
        let stderr = std::fs::File::create(&log)?;
        let args: Vec<String> = vec![
            "serve".into(),
            "--work-dir".into(),
            dirs.work_dir.display().to_string(),
            "--plugin-config-dir".into(),
            dirs.config_dir.display().to_string(),
            "--socket-root".into(),
            dirs.socket_root.display().to_string(),
            "--start".into(),
            "immediate".into(),
            "--node-id".into(),
            NODE_ID.into(),
        ];
        let args: Vec<String> = args
            .into_iter()
            .chain(extra.iter().cloned())
            .chain(env.daemon_args.clone())
            .collect();
        let mut command = match wrapper.split_first() {
            Some((program, wrapper_args)) => {
                let mut command = Command::new(program);
                command.args(wrapper_args).arg(&env.daemon_bin);
                command
            }
            None => Command::new(&env.daemon_bin),
        };
        command
            .args(&args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(stderr);
        if std::env::var_os("CSI_AGENT_LOG").is_none() {
            command.env("CSI_AGENT_LOG", "info");
        }
        let guard = ChildGuard::spawn("csi-agentd", &mut command)?;
        Ok(Self {
            guard,
            api: ApiClient::unix(dirs.work_dir.join("api.sock"))
                .with_timeout(Some(Duration::from_secs(120))),
            command: args,
            log,
        })
    }

    /// Waits until `GET /v1/health` answers; returns the time since this call.
    pub async fn ready(mut self) -> anyhow::Result<(Self, Duration)> {
        let waited = self.wait_healthy(Duration::from_secs(30)).await?;
        Ok((self, waited))
    }

    /// Polls `GET /v1/health` every millisecond (fresh connection each time).
    pub async fn wait_healthy(&mut self, timeout: Duration) -> anyhow::Result<Duration> {
        let started = Instant::now();
        let api = self.api.clone().with_timeout(Some(Duration::from_secs(5)));
        loop {
            match api.health().await {
                Ok(_) => return Ok(started.elapsed()),
                Err(err) if err.is_connection() => {
                    self.guard
                        .check_running()
                        .with_context(|| self.describe())?;
                    if started.elapsed() > timeout {
                        bail!("{} not healthy after {timeout:?}: {err}", self.describe());
                    }
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
                Err(err) => bail!("GET /v1/health failed: {err}; {}", self.describe()),
            }
        }
    }

    pub fn pid(&self) -> u32 {
        self.guard.pid()
    }

    pub fn memory(&self) -> anyhow::Result<Memory> {
        memory(self.pid())
    }

    /// SIGTERM and wait for the exit (plugins stay running, by design).
    pub async fn stop(mut self) -> anyhow::Result<Duration> {
        let (took, status) = self.guard.terminate(Duration::from_secs(30)).await?;
        if !status.success() {
            bail!(
                "csi-agentd exited with {status} on SIGTERM; see {}",
                self.log.display()
            );
        }
        Ok(took)
    }

    fn describe(&self) -> String {
        format!(
            "csi-agentd {} (log: {}; set {}=1 to keep it)",
            self.command.join(" "),
            self.log.display(),
            crate::procs::KEEP_VAR
        )
    }

    /// The socket of the plugin's (single) component, once it is ready.
    pub async fn plugin_socket(&self, plugin_type: &str) -> anyhow::Result<(PathBuf, u32)> {
        let info = self.api.plugin(plugin_type).await?;
        let component =
            info.components.iter().find(|c| c.ready).with_context(|| {
                format!("plugin {plugin_type} has no ready component: {info:?}")
            })?;
        let endpoint = component
            .endpoint
            .clone()
            .with_context(|| format!("plugin {plugin_type}: no endpoint reported"))?;
        Ok((PathBuf::from(endpoint), component.pid.unwrap_or(0)))
    }

    pub async fn metrics_text(&self) -> anyhow::Result<String> {
        Ok(self.api.metrics().await?)
    }

    /// The daemon's checkpoint counters: (writes, fsync seconds sum, fsync count).
    pub async fn checkpoint_counters(&self) -> anyhow::Result<Checkpoints> {
        let text = self.metrics_text().await?;
        Ok(Checkpoints::parse(&text))
    }

    pub async fn publish(
        &self,
        plugin: &str,
        volume_id: &str,
        workload: &str,
    ) -> anyhow::Result<()> {
        self.api
            .publish(&publish_request(plugin, volume_id, workload))
            .await
            .with_context(|| format!("daemon publish of {volume_id}"))?;
        Ok(())
    }

    pub async fn unpublish(
        &self,
        plugin: &str,
        volume_id: &str,
        workload: &str,
    ) -> anyhow::Result<()> {
        self.api
            .unpublish(&unpublish_request(plugin, volume_id, workload))
            .await
            .with_context(|| format!("daemon unpublish of {volume_id}"))?;
        Ok(())
    }
}

pub fn publish_request(plugin: &str, volume_id: &str, workload: &str) -> PublishRequest {
    PublishRequest {
        plugin: plugin.to_owned(),
        volume_id: volume_id.to_owned(),
        workload: workload.to_owned(),
        capability: CapabilitySpec::mount("SINGLE_NODE_WRITER", "", Vec::new()),
        readonly: false,
        volume_context: None,
        secrets: None,
        bind_to: None,
    }
}

pub fn unpublish_request(plugin: &str, volume_id: &str, workload: &str) -> UnpublishRequest {
    UnpublishRequest {
        plugin: plugin.to_owned(),
        volume_id: volume_id.to_owned(),
        workload: workload.to_owned(),
    }
}

/// Checkpoint metrics of the daemon at one moment.
#[derive(Clone, Copy, Debug, Default)]
pub struct Checkpoints {
    pub writes: f64,
    pub fsync_sum_s: f64,
    pub fsync_count: f64,
    pub publish_sum_s: f64,
    pub publish_count: f64,
    pub unpublish_sum_s: f64,
    pub unpublish_count: f64,
    /// Every CSI RPC's latency, summed (seconds), and their number.
    pub rpc_sum_s: f64,
    pub rpc_count: f64,
}

impl Checkpoints {
    pub fn parse(text: &str) -> Self {
        let get = |name: &str, labels: &[(&str, &str)]| metric(text, name, labels).unwrap_or(0.0);
        let op = "csi_agent_operation_duration_seconds";
        Self {
            writes: get("csi_agent_checkpoint_writes_total", &[]),
            fsync_sum_s: get("csi_agent_checkpoint_fsync_seconds_sum", &[]),
            fsync_count: get("csi_agent_checkpoint_fsync_seconds_count", &[]),
            publish_sum_s: get(&format!("{op}_sum"), &[("operation", "publish")]),
            publish_count: get(&format!("{op}_count"), &[("operation", "publish")]),
            unpublish_sum_s: get(&format!("{op}_sum"), &[("operation", "unpublish")]),
            unpublish_count: get(&format!("{op}_count"), &[("operation", "unpublish")]),
            rpc_sum_s: get("csi_agent_rpc_duration_seconds_sum", &[]),
            rpc_count: get("csi_agent_rpc_duration_seconds_count", &[]),
        }
    }

    /// The change from `earlier` to `self`.
    pub fn since(&self, earlier: &Checkpoints) -> Checkpoints {
        Checkpoints {
            writes: self.writes - earlier.writes,
            fsync_sum_s: self.fsync_sum_s - earlier.fsync_sum_s,
            fsync_count: self.fsync_count - earlier.fsync_count,
            publish_sum_s: self.publish_sum_s - earlier.publish_sum_s,
            publish_count: self.publish_count - earlier.publish_count,
            unpublish_sum_s: self.unpublish_sum_s - earlier.unpublish_sum_s,
            unpublish_count: self.unpublish_count - earlier.unpublish_count,
            rpc_sum_s: self.rpc_sum_s - earlier.rpc_sum_s,
            rpc_count: self.rpc_count - earlier.rpc_count,
        }
    }
}
