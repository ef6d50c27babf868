//! Test harness: starts the real `csi-testplugin` binary on a socket in a
//! temporary directory and hands out tonic clients for it.
//!
//! Owns: process start/stop, the unix-socket connector, reading the call log,
//! writing the fault file, and small request builders. Must not: reach into
//! the plugin's internals (only its socket and its documented files).

#![allow(dead_code)] // Each test binary uses a different subset.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use csi_proto::{v0, v1};
use tonic::transport::{Channel, Endpoint};

pub const NODE: &str = "node-1";

/// A running plugin process with its own work dir and socket.
pub struct Plugin {
    pub child: Option<Child>,
    /// Kept alive for the plugin's lifetime; removed on drop.
    pub dir: tempfile::TempDir,
    pub socket: PathBuf,
    pub work: PathBuf,
    pub args: Vec<String>,
    pub uid: Option<u32>,
    /// Its `--node-id` ([`NODE`] unless started by [`Plugin::start_on`]).
    pub node: String,
}

impl Plugin {
    /// Starts a plugin with `--node-id node-1` and the given extra flags.
    pub async fn start(args: &[&str]) -> anyhow::Result<Self> {
        Self::start_as(args, None).await
    }

    /// Like [`Plugin::start`], running the plugin under `uid` (and the same
    /// gid) when given.
    pub async fn start_as(args: &[&str], uid: Option<u32>) -> anyhow::Result<Self> {
        Self::start_node(NODE, args, uid).await
    }

    /// Like [`Plugin::start`] with `--node-id node`: one of several nodes' instances.
    pub async fn start_on(node: &str, args: &[&str]) -> anyhow::Result<Self> {
        Self::start_node(node, args, None).await
    }

    async fn start_node(node: &str, args: &[&str], uid: Option<u32>) -> anyhow::Result<Self> {
        let dir = tempfile::tempdir()?;
        if uid.is_some() {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o777))?;
        }
        let socket = dir.path().join("csi.sock");
        let work = dir.path().join("work");
        let mut p = Self {
            child: None,
            dir,
            socket,
            work,
            args: args.iter().map(|s| (*s).to_owned()).collect(),
            uid,
            node: node.to_owned(),
        };
        p.spawn().await?;
        Ok(p)
    }

    /// (Re)starts the process on the same work dir and socket.
    pub async fn spawn(&mut self) -> anyhow::Result<()> {
        let stderr = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.path().join("plugin.stderr"))?;
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_csi-testplugin"));
        cmd.arg("--endpoint")
            .arg(format!("unix://{}", self.socket.display()))
            .arg("--work-dir")
            .arg(&self.work)
            .arg("--node-id")
            .arg(&self.node)
            .args(&self.args)
            .env("RUST_LOG", "debug")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(stderr);
        if let Some(uid) = self.uid {
            use std::os::unix::process::CommandExt;
            cmd.uid(uid).gid(uid);
        }
        self.child = Some(cmd.spawn().context("spawning csi-testplugin")?);
        self.wait_ready().await
    }

    async fn wait_ready(&mut self) -> anyhow::Result<()> {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Some(child) = self.child.as_mut()
                && let Some(status) = child.try_wait()?
            {
                bail!("plugin exited early ({status}): {}", self.stderr());
            }
            if tokio::net::UnixStream::connect(&self.socket).await.is_ok() {
                return Ok(());
            }
            if Instant::now() > deadline {
                bail!("plugin did not listen in time: {}", self.stderr());
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    pub fn stderr(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("plugin.stderr")).unwrap_or_default()
    }

    pub fn pid(&self) -> anyhow::Result<i32> {
        let child = self.child.as_ref().context("plugin not running")?;
        Ok(i32::try_from(child.id())?)
    }

    /// Sends a signal to the plugin.
    pub fn signal(&self, sig: rustix::process::Signal) -> anyhow::Result<()> {
        let pid = rustix::process::Pid::from_raw(self.pid()?).context("pid 0")?;
        rustix::process::kill_process(pid, sig)?;
        Ok(())
    }

    /// Waits for the process to end.
    pub async fn wait_exit(&mut self, timeout: Duration) -> anyhow::Result<ExitStatus> {
        let deadline = Instant::now() + timeout;
        loop {
            let child = self.child.as_mut().context("plugin not running")?;
            if let Some(status) = child.try_wait()? {
                self.child = None;
                return Ok(status);
            }
            if Instant::now() > deadline {
                bail!("plugin still running after {timeout:?}");
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// SIGKILL and reap.
    pub async fn kill(&mut self) -> anyhow::Result<()> {
        if let Some(child) = self.child.as_mut() {
            child.kill()?;
        }
        self.wait_exit(Duration::from_secs(10)).await.map(|_| ())
    }

    pub async fn channel(&self) -> anyhow::Result<Channel> {
        connect(&self.socket).await
    }

    pub async fn v1(&self) -> anyhow::Result<V1> {
        let ch = self.channel().await?;
        Ok(V1 {
            id: v1::identity_client::IdentityClient::new(ch.clone()),
            ctl: v1::controller_client::ControllerClient::new(ch.clone()),
            node: v1::node_client::NodeClient::new(ch),
        })
    }

    pub async fn v0(&self) -> anyhow::Result<V0> {
        let ch = self.channel().await?;
        Ok(V0 {
            id: v0::identity_client::IdentityClient::new(ch.clone()),
            ctl: v0::controller_client::ControllerClient::new(ch.clone()),
            node: v0::node_client::NodeClient::new(ch),
        })
    }

    pub fn faults_path(&self) -> PathBuf {
        self.work.join("faults.json")
    }

    /// Writes the fault file atomically (the plugin may read it any time).
    pub fn write_faults(&self, json: &str) -> anyhow::Result<()> {
        let tmp = self.work.join("faults.json.tmp");
        std::fs::write(&tmp, json)?;
        std::fs::rename(&tmp, self.faults_path())?;
        Ok(())
    }

    /// The call log, parsed.
    pub fn calls(&self) -> anyhow::Result<Vec<serde_json::Value>> {
        let text = std::fs::read_to_string(self.work.join("calls.jsonl")).unwrap_or_default();
        text.lines()
            .map(|l| serde_json::from_str(l).with_context(|| format!("call log line {l:?}")))
            .collect()
    }

    /// Call-log entries of one method.
    pub fn calls_of(&self, method: &str) -> anyhow::Result<Vec<serde_json::Value>> {
        Ok(self
            .calls()?
            .into_iter()
            .filter(|c| c["method"] == method)
            .collect())
    }

    /// A directory inside the test's temp dir (created; world-writable so
    /// that a plugin running unprivileged can create targets in it).
    pub fn mkdir(&self, name: &str) -> anyhow::Result<PathBuf> {
        use std::os::unix::fs::PermissionsExt;
        let p = self.dir.path().join(name);
        std::fs::create_dir_all(&p)?;
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o777))?;
        Ok(p)
    }

    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }
}

impl Drop for Plugin {
    fn drop(&mut self) {
        if let Some(child) = self.child.as_mut() {
            let _ = child.kill();
            let _ = child.wait();
        }
        // What a test left mounted beneath the temp dir (a failed step, a fault): its removal
        // cannot go through a mount point and would leave the dir in /tmp (issue #30).
        // Innermost first; the dir's paths hold no character mountinfo escapes.
        let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
        let mut mounts: Vec<&str> = mountinfo
            .lines()
            .filter_map(|line| line.split(' ').nth(4))
            .filter(|point| Path::new(point).starts_with(self.dir.path()))
            .collect();
        mounts.sort_by_key(|p| std::cmp::Reverse(p.len()));
        for mount in mounts {
            let _ = std::process::Command::new("umount")
                .arg("-l")
                .arg(mount)
                .status();
        }
    }
}

/// Connects a tonic channel over a unix socket.
pub async fn connect(path: &Path) -> anyhow::Result<Channel> {
    let path = path.to_owned();
    let channel = Endpoint::from_static("http://x")
        .connect_with_connector(tower::service_fn(move |_| {
            let path = path.clone();
            async move {
                Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(
                    tokio::net::UnixStream::connect(path).await?,
                ))
            }
        }))
        .await?;
    Ok(channel)
}

pub struct V1 {
    pub id: v1::identity_client::IdentityClient<Channel>,
    pub ctl: v1::controller_client::ControllerClient<Channel>,
    pub node: v1::node_client::NodeClient<Channel>,
}

pub struct V0 {
    pub id: v0::identity_client::IdentityClient<Channel>,
    pub ctl: v0::controller_client::ControllerClient<Channel>,
    pub node: v0::node_client::NodeClient<Channel>,
}

/// A v1 mount capability with the given access mode.
pub fn cap(mode: v1::volume_capability::access_mode::Mode) -> v1::VolumeCapability {
    use v1::volume_capability::{AccessMode, AccessType, MountVolume};
    v1::VolumeCapability {
        access_mode: Some(AccessMode { mode: mode as i32 }),
        access_type: Some(AccessType::Mount(MountVolume::default())),
    }
}

/// SINGLE_NODE_WRITER mount capability.
pub fn snw() -> v1::VolumeCapability {
    cap(v1::volume_capability::access_mode::Mode::SingleNodeWriter)
}

/// A v0 SINGLE_NODE_WRITER mount capability.
pub fn snw0() -> v0::VolumeCapability {
    use v0::volume_capability::{AccessMode, AccessType, MountVolume, access_mode::Mode};
    v0::VolumeCapability {
        access_mode: Some(AccessMode {
            mode: Mode::SingleNodeWriter as i32,
        }),
        access_type: Some(AccessType::Mount(MountVolume::default())),
    }
}

pub fn create_req(name: &str, required: i64) -> v1::CreateVolumeRequest {
    v1::CreateVolumeRequest {
        name: name.to_owned(),
        capacity_range: Some(v1::CapacityRange {
            required_bytes: required,
            limit_bytes: 0,
        }),
        volume_capabilities: vec![snw()],
        ..Default::default()
    }
}

pub fn cpub_req(id: &str) -> v1::ControllerPublishVolumeRequest {
    v1::ControllerPublishVolumeRequest {
        volume_id: id.to_owned(),
        node_id: NODE.to_owned(),
        volume_capability: Some(snw()),
        ..Default::default()
    }
}

pub fn stage_req(id: &str, staging: &Path) -> v1::NodeStageVolumeRequest {
    v1::NodeStageVolumeRequest {
        volume_id: id.to_owned(),
        staging_target_path: staging.display().to_string(),
        volume_capability: Some(snw()),
        ..Default::default()
    }
}

pub fn publish_req(id: &str, staging: &Path, target: &Path) -> v1::NodePublishVolumeRequest {
    v1::NodePublishVolumeRequest {
        volume_id: id.to_owned(),
        staging_target_path: staging.display().to_string(),
        target_path: target.display().to_string(),
        volume_capability: Some(snw()),
        ..Default::default()
    }
}

pub fn unpublish_req(id: &str, target: &Path) -> v1::NodeUnpublishVolumeRequest {
    v1::NodeUnpublishVolumeRequest {
        volume_id: id.to_owned(),
        target_path: target.display().to_string(),
    }
}

pub fn unstage_req(id: &str, staging: &Path) -> v1::NodeUnstageVolumeRequest {
    v1::NodeUnstageVolumeRequest {
        volume_id: id.to_owned(),
        staging_target_path: staging.display().to_string(),
    }
}

/// Asserts that a call failed with `code`; returns the status message.
pub fn expect_code<T: std::fmt::Debug>(
    r: Result<tonic::Response<T>, tonic::Status>,
    code: tonic::Code,
) -> anyhow::Result<String> {
    match r {
        Ok(resp) => bail!("expected {code:?}, got OK: {:?}", resp.get_ref()),
        Err(s) if s.code() == code => Ok(s.message().to_owned()),
        Err(s) => bail!("expected {code:?}, got {:?}: {}", s.code(), s.message()),
    }
}

/// Creates, controller-publishes and stages volume `id` through v1; returns
/// the staging path.
pub async fn create_and_stage(p: &Plugin, c: &mut V1, id: &str) -> anyhow::Result<PathBuf> {
    c.ctl.create_volume(create_req(id, 1 << 20)).await?;
    c.ctl.controller_publish_volume(cpub_req(id)).await?;
    let staging = p.mkdir(&format!("staging-{id}"))?;
    c.node.node_stage_volume(stage_req(id, &staging)).await?;
    Ok(staging)
}

/// A ControllerExpandVolume of `id` to `required` bytes (at most `limit`, 0: no limit).
pub fn expand_req(id: &str, required: i64, limit: i64) -> v1::ControllerExpandVolumeRequest {
    v1::ControllerExpandVolumeRequest {
        volume_id: id.to_owned(),
        capacity_range: Some(v1::CapacityRange {
            required_bytes: required,
            limit_bytes: limit,
        }),
        ..Default::default()
    }
}
