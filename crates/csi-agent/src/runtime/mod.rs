//! Runtimes: how one managed plugin component is run (docs/design.md).
//!
//! This module owns the [`Runtime`] trait and the runtime kinds: `process`
//! ([`ProcessRuntime`]) and `oci` ([`OciRuntime`], containers through runc); `mesos` later. A runtime launches a component, adopts one
//! launched by an earlier csi-agent from its persisted [`RuntimeHandle`], watches it and stops
//! it. It must not decide *when* to do any of this (restarts, backoff, readiness and the
//! on-disk records are the service manager's), and it never speaks CSI.

use std::fmt;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;
use serde::{Deserialize, Serialize};

use crate::config::{CommandConfig, RuntimeConfig};

pub mod isolation;
pub mod oci;
pub mod process;
pub mod users;

pub use oci::OciRuntime;
pub use process::ProcessRuntime;

/// Environment variable carrying the component's endpoint (`unix://<socket>`), as Mesos sets
/// it and as CSI plugins conventionally read it.
pub const CSI_ENDPOINT_VAR: &str = "CSI_ENDPOINT";
/// Environment variable carrying the node id.
pub const CSI_NODE_ID_VAR: &str = "CSI_NODE_ID";
/// Environment variable carrying the node id under Mesos's name: Mesos's service manager
/// (`src/csi/service_manager.cpp`) gives a plugin's node component the agent id there, and
/// real plugin configs pass it on (`nfsplugin --nodeid=$MESOS_AGENT_ID`).
pub const MESOS_AGENT_ID_VAR: &str = "MESOS_AGENT_ID";
/// Environment variable carrying the component's sandbox (its working directory), as Mesos's
/// containerizer sets it for every standalone container.
pub const MESOS_SANDBOX_VAR: &str = "MESOS_SANDBOX";

/// The variables csi-agent sets *over* the config's `environment` (they win over a variable
/// of the same name there, as under Mesos: its service manager appends `CSI_ENDPOINT` and
/// `MESOS_AGENT_ID` after the config's variables, and its launcher keeps the last of a
/// name). Also the references a non-shell command's arguments may use
/// ([`CommandConfig::argv`]). `MESOS_AGENT_ID` goes to every component, not only those
/// listing `NODE_SERVICE` as in Mesos: a controller sharing the node's command line then
/// gets the node id instead of an empty string (docs/configuration.md).
pub fn agent_vars<'a>(endpoint: &'a str, node_id: &'a str) -> [(&'static str, &'a str); 3] {
    [
        (CSI_ENDPOINT_VAR, endpoint),
        (CSI_NODE_ID_VAR, node_id),
        (MESOS_AGENT_ID_VAR, node_id),
    ]
}

/// Everything that defines *what* a component runs. Its hash is stored in `component.json`;
/// a component whose stored spec differs from the configured one is outdated and relaunched.
/// Paths that csi-agent picks (work dir, socket dir) are deliberately not part of it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LaunchSpec {
    pub container_id: String,
    pub command: CommandConfig,
    pub node_id: String,
    pub resources: Vec<serde_json::Value>,
    pub container: Option<serde_json::Value>,
    pub runtime: RuntimeConfig,
}

impl LaunchSpec {
    /// A stable hash of the spec (FNV-1a 64 over its JSON form, hex). Stable across builds
    /// and Rust versions, unlike `DefaultHasher`, because it is persisted. It detects
    /// changes; it is not a security boundary.
    pub fn hash(&self) -> String {
        let bytes = serde_json::to_vec(self).unwrap_or_default();
        let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
        for byte in bytes {
            hash ^= u64::from(byte);
            hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
        }
        format!("{hash:016x}")
    }
}

/// Where a launch happens: picked by the service manager.
#[derive(Clone, Debug)]
pub struct LaunchContext {
    /// `containers/<id>/`: the component's working directory and where `stdout` and
    /// `stderr` are written.
    pub container_dir: PathBuf,
    /// The socket the component must listen on (inside a short socket dir).
    pub socket: PathBuf,
    /// The dirs beneath which csi-agent hands the plugin staging and target paths. A
    /// runtime that isolates mounts shares them with the host (docs/design.md, "Supervision").
    pub mount_roots: Vec<PathBuf>,
}

/// Settings of the runtimes that come from the daemon (flags), not from plugin configs.
#[derive(Clone, Debug)]
pub struct RuntimeOptions {
    pub oci: oci::OciOptions,
}

impl RuntimeOptions {
    /// `runc` from `PATH`, its state under `<socket_root>/runc`.
    pub fn new(oci_runtime: impl Into<PathBuf>, socket_root: &std::path::Path) -> Self {
        Self {
            oci: oci::OciOptions {
                binary: oci_runtime.into(),
                state_root: socket_root.join(oci::STATE_ROOT_DIR),
                images: None,
            },
        }
    }
}

/// The persisted identity of a running component, enough to find it again after csi-agent
/// restarts. Stored in `component.json` as `{"kind": "process", ...}`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
pub enum RuntimeHandle {
    Process {
        pid: i32,
        /// Field 22 of `/proc/<pid>/stat` (clock ticks after boot): rules out pid reuse.
        start_time: u64,
        /// `/proc/sys/kernel/random/boot_id` at launch: a pid and start time only mean
        /// something within one boot.
        boot_id: Option<String>,
    },
    /// A container of the `oci` runtime.
    Oci {
        container_id: String,
        /// The container's init process, with its start time and boot id as above.
        pid: i32,
        start_time: u64,
        boot_id: Option<String>,
        /// runc's `--root` when it was launched.
        state_root: PathBuf,
        bundle: PathBuf,
    },
}

impl fmt::Display for RuntimeHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RuntimeHandle::Process { pid, .. } => write!(f, "process {pid}"),
            RuntimeHandle::Oci {
                container_id, pid, ..
            } => write!(f, "container {container_id} (init {pid})"),
        }
    }
}

/// How a component ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExitInfo {
    Code(i32),
    Signal(i32),
    /// It ended, but it was not csi-agent's child (adopted), so its status is unknown.
    Unknown,
}

impl fmt::Display for ExitInfo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ExitInfo::Code(code) => write!(f, "exited with code {code}"),
            ExitInfo::Signal(signal) => write!(f, "killed by signal {signal}"),
            ExitInfo::Unknown => f.write_str("exited (status unknown)"),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    #[error("cannot open log file {}: {source}", path.display())]
    Log {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot start `{program}`: {source}")]
    Spawn {
        program: String,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot watch process {pid}: {source}")]
    Watch {
        pid: i32,
        #[source]
        source: std::io::Error,
    },
    #[error(transparent)]
    Oci(Box<oci::OciError>),
    /// `command.user` is unknown, or its socket dir could not be given to it.
    #[error(transparent)]
    User(Box<users::UserError>),
    #[error("runtime \"{runtime}\" cannot adopt a component run by runtime \"{handle}\"")]
    WrongKind {
        runtime: &'static str,
        handle: &'static str,
    },
}

/// A way to run components. Object safe so that the service manager can hold any kind.
pub trait Runtime: Send + Sync + fmt::Debug {
    fn kind(&self) -> &'static str;

    /// Starts a component. It must outlive csi-agent (a daemon restart must not stop it).
    fn launch<'a>(
        &'a self,
        spec: &'a LaunchSpec,
        context: &'a LaunchContext,
    ) -> BoxFuture<'a, Result<Box<dyn Component>, RuntimeError>>;

    /// Finds a component launched earlier. `Ok(None)`: it is not running any more (or the
    /// handle names something else now, e.g. a reused pid).
    fn adopt<'a>(
        &'a self,
        handle: &'a RuntimeHandle,
    ) -> BoxFuture<'a, Result<Option<Box<dyn Component>>, RuntimeError>>;
}

/// One running component.
pub trait Component: Send + Sync + fmt::Debug {
    fn handle(&self) -> RuntimeHandle;

    /// Resolves once the component has ended. May be awaited many times and concurrently.
    fn wait(&self) -> BoxFuture<'_, ExitInfo>;

    /// Asks it to stop (SIGTERM or the runtime's equivalent), forces it after `grace`, and
    /// returns once it has ended.
    fn stop(&self, grace: Duration) -> BoxFuture<'_, ExitInfo>;
}

/// The runtime that can adopt a persisted handle (whatever the plugin's configured kind is
/// now: a component launched under an older configuration must still be found and stopped).
pub fn for_handle(handle: &RuntimeHandle, options: &RuntimeOptions) -> Arc<dyn Runtime> {
    match handle {
        RuntimeHandle::Process { .. } => Arc::new(ProcessRuntime::new()),
        RuntimeHandle::Oci { state_root, .. } => {
            // The state root it was launched under, even if the daemon's changed since.
            let oci = oci::OciOptions {
                binary: options.oci.binary.clone(),
                state_root: state_root.clone(),
                images: options.oci.images.clone(),
            };
            Arc::new(OciRuntime::new(&oci))
        }
    }
}

impl RuntimeHandle {
    pub const fn kind(&self) -> &'static str {
        match self {
            RuntimeHandle::Process { .. } => "process",
            RuntimeHandle::Oci { .. } => "oci",
        }
    }

    /// The component's (init) process.
    pub const fn pid(&self) -> i32 {
        match self {
            RuntimeHandle::Process { pid, .. } | RuntimeHandle::Oci { pid, .. } => *pid,
        }
    }
}

/// The runtime for a configured kind.
pub fn for_config(config: &RuntimeConfig, options: &RuntimeOptions) -> Arc<dyn Runtime> {
    match config {
        RuntimeConfig::Process => Arc::new(ProcessRuntime::new()),
        RuntimeConfig::Oci(_) => Arc::new(OciRuntime::new(&options.oci)),
    }
}
