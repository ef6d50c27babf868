//! The service manager of one plugin: its components' launch, readiness, restart, adoption
//! and cleanup (Mesos's `csi::ServiceManager` + `ContainerDaemon`; docs/design.md, docs/on-disk-format.md).
//!
//! This module owns the `containers/` directory of a plugin (component records, endpoint
//! symlinks, the short socket dirs they point to) and the supervision tasks. It hands out
//! ready endpoints with a connected [`CsiClient`]; it must not make any CSI call other than
//! `Probe` (volumes are the volume manager's), must not touch `volumes/` or `mounts/`, and
//! must not decide when a removed plugin may stop (the engine calls [`ServiceManager::stop`]
//! or [`remove_components`] once none of its volumes is published).
//!
//! # Behaviour
//!
//! - **Component ids** follow Mesos: `csi-agent-<type with '.'→'-'>-<name>--<SERVICES joined
//!   by '-'>`, e.g. `csi-agent-org-example-test-default--CONTROLLER_SERVICE-NODE_SERVICE`.
//!   They are persisted, so the format is a compatibility contract (tested).
//! - **Sockets**: unix socket paths are limited to 108 bytes, and the work dir can be deep. So
//!   each component gets a short 0700 directory under the socket root (`/run/csi-agent` for
//!   root, else `$TMPDIR/csi-agent-<uid>`) holding `endpoint.sock`, and
//!   `containers/<id>/endpoint` is a symlink to it. The component gets
//!   `CSI_ENDPOINT=unix://<socket>`. A stale socket is removed before every launch and after
//!   every stop (MESOS-8429).
//! - **Launch is lazy**: nothing is launched until [`ServiceManager::endpoint`] first needs a
//!   service, or until [`ServiceManager::start`] launches every component eagerly. What was
//!   running when the manager is created keeps running: adopted components are supervised at
//!   once (watched, probed, restarted), and components replaced because their configuration
//!   changed are relaunched at once. Create managers only after the start gate opened.
//! - **Readiness**: wait for the socket with inotify (no polling interval), connect (which
//!   detects the CSI version), then `Probe` until ready, all within the plugin's
//!   `startup_timeout`. The version is detected once per plugin; a plugin that later answers
//!   with another version is an error (and is retried like any failed start).
//! - **Restart**: a component that ends, or does not become ready in time, is relaunched: at
//!   once the first time, then after the plugin's capped exponential backoff while it keeps
//!   failing; the count resets once it has been ready for `reset_after`. It never gives up for
//!   good (MESOS-9130). Callers of [`ServiceManager::endpoint`] wait through a restart and get
//!   the new endpoint.
//! - **Recovery** (in [`ServiceManager::new`]): running components whose recorded launch
//!   spec hash matches the configuration are adopted (same process, not relaunched);
//!   outdated ones are stopped and relaunched later; components no longer configured are
//!   stopped and their directories removed; dead ones are cleaned.
//! - **Unmanaged** plugins: nothing is launched; the configured socket is awaited (inotify)
//!   and probed with retry; a socket that is removed or replaced is probed again.
//! - Dropping a manager leaves its components running (they outlive csi-agent, docs/design.md, "Supervision").

use std::collections::BTreeMap;
use std::io;
use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use futures::StreamExt;
use inotify::{Inotify, WatchMask};
use serde::{Deserialize, Serialize};
use tokio::sync::{Notify, watch};
use tokio::task::JoinHandle;

use crate::client::{ClientOptions, CsiClient, CsiVersion, RpcError};
use crate::config::{Deployment, PluginConfig, Service};
use crate::layout::Layout;
use crate::metrics::{ComponentLabels, Metrics, PluginLabels, RpcLabels};
use crate::runtime::{
    self, Component, LaunchContext, LaunchSpec, Runtime, RuntimeHandle, RuntimeOptions,
};

/// Prefix of every component id (Mesos uses `org-apache-mesos-csi-`).
pub const CONTAINER_ID_PREFIX: &str = "csi-agent-";
/// The socket file inside a component's socket dir.
pub const SOCKET_FILE: &str = "endpoint.sock";
/// The symlink in the container dir pointing at the socket dir.
pub const ENDPOINT_LINK: &str = "endpoint";
/// The component record in the container dir.
pub const COMPONENT_RECORD: &str = "component.json";
pub const COMPONENT_SCHEMA_VERSION: u32 = 1;

/// Builds a component id in Mesos's format:
/// `<prefix><type with '.'→'-'>-<name>--<SERVICES joined by '-'>`. The services are given in
/// config order, by name (a Mesos bug once rendered them as numbers).
pub fn container_id(plugin_type: &str, plugin_name: &str, services: &[Service]) -> String {
    let services: Vec<&str> = services.iter().map(|s| s.as_str()).collect();
    format!(
        "{CONTAINER_ID_PREFIX}{}-{plugin_name}--{}",
        plugin_type.replace('.', "-"),
        services.join("-")
    )
}

/// The default root of the short socket dirs: `/run/csi-agent` when running as root, else
/// `$TMPDIR/csi-agent-<uid>`.
pub fn default_socket_root() -> PathBuf {
    let uid = rustix::process::geteuid();
    if uid.is_root() {
        PathBuf::from("/run/csi-agent")
    } else {
        std::env::temp_dir().join(format!("csi-agent-{}", uid.as_raw()))
    }
}

/// What a manager needs from the engine.
#[derive(Clone, Debug)]
pub struct ManagerOptions {
    pub layout: Layout,
    /// The node id given to components (`CSI_NODE_ID`) unless the plugin config overrides it.
    pub node_id: String,
    /// Where short socket dirs are created (see [`default_socket_root`]).
    pub socket_root: PathBuf,
    pub metrics: Arc<Metrics>,
    /// The OCI runtime binary of the `oci` runtime (`--oci-runtime`; default `runc`).
    pub oci_runtime: PathBuf,
    /// The image store components naming an image are run from (`None`: such a component
    /// fails to launch, saying why).
    pub images: Option<Arc<crate::image::store::ImageStore>>,
    /// Where and how components' `command.uris` are fetched (`crate::fetch`).
    pub fetch: crate::fetch::FetchOptions,
    /// `--secret-dir`: where REFERENCE secrets are read at each launch (`None`: a component
    /// using one fails to launch, naming the flag).
    pub secret_dir: Option<PathBuf>,
}

impl ManagerOptions {
    /// The runtimes' daemon-wide settings: the OCI runtime, its state under
    /// `<socket_root>/runc`.
    pub fn runtime_options(&self) -> RuntimeOptions {
        let mut options = RuntimeOptions::new(&self.oci_runtime, &self.socket_root);
        options.oci.images = self.images.clone();
        options
    }
}

/// A ready endpoint: a connected client whose `Probe` said ready.
#[derive(Clone, Debug)]
pub struct ReadyEndpoint {
    /// The component id, or the socket path for an unmanaged plugin.
    pub component: String,
    pub socket: PathBuf,
    pub client: CsiClient,
    pub version: CsiVersion,
    /// Increases with every (re)launch or re-probe of this component: a caller can tell a
    /// restarted component from the one it used before.
    pub generation: u64,
    /// The runtime handle (pid) of a managed component.
    pub handle: Option<RuntimeHandle>,
    /// Time from seeing the socket to `Probe` answering ready (target in docs/benchmarks.md: ≤ 5 ms).
    pub socket_to_ready: Duration,
}

/// The state of one component, as published to waiters.
#[derive(Clone, Debug)]
// One per component and cloned rarely: boxing the ready endpoint would buy nothing.
#[allow(clippy::large_enum_variant)]
pub enum ComponentState {
    /// Not launched yet (launch is lazy), or not watched yet (unmanaged).
    Idle,
    /// Launched, adopted or re-probed; waiting for readiness.
    Starting {
        generation: u64,
    },
    Ready(ReadyEndpoint),
    /// Ended or failed to become ready; the next attempt comes after `delay`.
    BackingOff {
        failures: u32,
        delay: Duration,
        last_error: String,
    },
    /// Stopped by [`ServiceManager::stop`].
    Stopped,
}

impl ComponentState {
    fn describe(&self) -> String {
        match self {
            ComponentState::Idle => "not started".to_owned(),
            ComponentState::Starting { .. } => "starting".to_owned(),
            ComponentState::Ready(_) => "ready".to_owned(),
            ComponentState::BackingOff {
                failures,
                delay,
                last_error,
            } => format!(
                "{last_error}; {failures} failure(s) in a row, next attempt after {} ms",
                delay.as_millis()
            ),
            ComponentState::Stopped => "stopped".to_owned(),
        }
    }
}

/// A snapshot of one component for status reports.
#[derive(Clone, Debug)]
pub struct ComponentStatus {
    pub component: String,
    pub serves: Vec<Service>,
    pub state: ComponentState,
}

#[derive(Debug, thiserror::Error)]
pub enum ManagerError {
    #[error("plugin {plugin}: no component serves {service}")]
    NotServed { plugin: String, service: Service },
    #[error("plugin {plugin}: {service} not ready after {} ms: {status}", waited.as_millis())]
    NotReady {
        plugin: String,
        service: Service,
        waited: Duration,
        status: String,
    },
    #[error("plugin {plugin} is stopped")]
    Stopped { plugin: String },
    /// The manager was detached because a new one (new configuration) took over: ask the
    /// new manager.
    #[error("plugin {plugin}: its service manager was replaced; ask again")]
    Replaced { plugin: String },
    #[error("plugin {plugin}: {}: {source}", path.display())]
    Io {
        plugin: String,
        path: PathBuf,
        #[source]
        source: io::Error,
    },
}

impl ManagerError {
    /// Whether waiting and asking again may succeed (the plugin is starting or restarting).
    pub fn is_transient(&self) -> bool {
        matches!(
            self,
            ManagerError::NotReady { .. } | ManagerError::Replaced { .. }
        )
    }
}

/// Why one readiness attempt failed.
#[derive(Debug, thiserror::Error)]
enum ReadyError {
    #[error("no ready answer within the startup timeout ({} ms) while {stage}", timeout.as_millis())]
    Timeout {
        stage: &'static str,
        timeout: Duration,
    },
    #[error("{0}")]
    Rpc(RpcError),
    #[error("plugin changed its CSI version from {was} to {now}")]
    VersionChanged { was: CsiVersion, now: CsiVersion },
    #[error("cannot watch for the socket: {0}")]
    Watch(io::Error),
    #[error("GetPluginInfo: {0}")]
    Identity(#[source] PluginNameError),
}

/// Why the name a plugin answered in GetPluginInfo is refused.
#[derive(Debug, thiserror::Error)]
enum PluginNameError {
    #[error("the plugin answered an empty name; CSI requires one (GetPluginInfoResponse.name)")]
    Empty,
    #[error("the plugin's name is {len} bytes long: at most {MAX_PLUGIN_NAME_BYTES} are accepted")]
    TooLong { len: usize },
    #[error(
        "the plugin's name {name:?} holds whitespace or control characters; CSI asks for domain name notation"
    )]
    NotDomainName { name: String },
}

/// Why one launch of a managed component failed (its message is the component's last error).
#[derive(Debug, thiserror::Error)]
enum LaunchError {
    #[error("cannot create {}: {source}", path.display())]
    CreateDir {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("cannot prepare the socket dir: {0}")]
    SocketDir(#[source] io::Error),
    #[error(
        "command.uris are fetched into the sandbox, which a container with a root file system of its own (an image, runtime.rootfs) does not get; install the plugin in its image and remove `uris`"
    )]
    UrisNeedTheHostRoot,
    #[error(transparent)]
    Fetch(#[from] crate::fetch::FetchError),
    #[error(transparent)]
    Secret(#[from] crate::secrets::SecretError),
    #[error(transparent)]
    Runtime(#[from] crate::runtime::RuntimeError),
    #[error("cannot write {COMPONENT_RECORD}: {0}")]
    Record(#[source] io::Error),
}

/// The longest plugin name accepted (the spec asks for at most 63 characters; some plugins
/// are longer, none this long).
const MAX_PLUGIN_NAME_BYTES: usize = 255;

/// CSI, GetPluginInfoResponse.name: "This field is REQUIRED", in domain name notation.
fn check_plugin_name(name: &str) -> Result<(), PluginNameError> {
    if name.is_empty() {
        return Err(PluginNameError::Empty);
    }
    if name.len() > MAX_PLUGIN_NAME_BYTES {
        return Err(PluginNameError::TooLong { len: name.len() });
    }
    if name.chars().any(|c| c.is_control() || c.is_whitespace()) {
        return Err(PluginNameError::NotDomainName {
            name: name.to_owned(),
        });
    }
    Ok(())
}

/// `component.json`. Only `runtime` and `spec_hash` are needed to adopt; `spec` is kept for
/// operators. Unknown fields are ignored so that an older csi-agent can still adopt.
#[derive(Clone, Debug, Serialize, Deserialize)]
struct ComponentRecord {
    schema_version: u32,
    container_id: String,
    spec_hash: String,
    #[serde(default)]
    spec: serde_json::Value,
    runtime: RuntimeHandle,
    socket: PathBuf,
    #[serde(default)]
    launched_at_unix_ms: u64,
}

#[derive(Debug)]
// One per component, never moved after the manager is built.
#[allow(clippy::large_enum_variant)]
enum ComponentSlotKind {
    Managed { spec: LaunchSpec, spec_hash: String },
    Unmanaged { socket: PathBuf },
}

/// One component (managed) or one distinct endpoint (unmanaged).
#[derive(Debug)]
struct ComponentSlot {
    id: String,
    serves: Vec<Service>,
    kind: ComponentSlotKind,
    state: watch::Sender<ComponentState>,
    /// A component found running at recovery, handed to the supervisor when it starts.
    adopted: Mutex<Option<Box<dyn Component>>>,
    supervised: AtomicBool,
    /// Wakes an unmanaged supervisor to re-probe (a caller saw its endpoint fail).
    recheck: Notify,
    /// Why the last attempt failed, for "not ready" answers while the next one starts.
    last_error: Mutex<Option<String>>,
}

#[derive(Debug)]
struct Inner {
    config: PluginConfig,
    options: ManagerOptions,
    runtime: Arc<dyn Runtime>,
    node_id: String,
    slots: Vec<ComponentSlot>,
    routes: BTreeMap<Service, usize>,
    /// The plugin's CSI version, detected once.
    version: Mutex<Option<CsiVersion>>,
    stopping: watch::Sender<bool>,
    /// Set by [`ServiceManager::detach`]: no supervision starts any more.
    detached: AtomicBool,
}

/// Supervises the components of one plugin. See the module documentation.
#[derive(Debug)]
pub struct ServiceManager {
    inner: Arc<Inner>,
    tasks: Mutex<Vec<JoinHandle<()>>>,
}

impl Drop for ServiceManager {
    fn drop(&mut self) {
        // Supervision ends with the manager; the components themselves keep running and are
        // adopted by the next manager (docs/design.md, "Supervision": components outlive csi-agent).
        for task in lock(&self.tasks).drain(..) {
            task.abort();
        }
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // A poisoned lock only means a panicking holder; the data is still consistent here.
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

impl ServiceManager {
    /// Creates the manager of one plugin, with the runtime its config names, and recovers
    /// what an earlier csi-agent left in its `containers/` dir (see the module doc). At most
    /// one manager may supervise a plugin at a time: to reconfigure a plugin whose manager is
    /// still referenced, use [`ServiceManager::replace_with`].
    pub async fn new(config: PluginConfig, options: ManagerOptions) -> Result<Self, ManagerError> {
        let runtime = runtime::for_config(&config.runtime, &options.runtime_options());
        Self::with_runtime(config, options, runtime).await
    }

    /// Like [`ServiceManager::new`] with a given runtime (tests, embedders).
    pub async fn with_runtime(
        config: PluginConfig,
        options: ManagerOptions,
        runtime: Arc<dyn Runtime>,
    ) -> Result<Self, ManagerError> {
        let node_id = config
            .node_id
            .clone()
            .unwrap_or_else(|| options.node_id.clone());
        let mut slots = Vec::new();
        let mut routes = BTreeMap::new();
        match &config.deployment {
            Deployment::Managed(components) => {
                for component in components {
                    let id = container_id(&config.plugin_type, &config.name, &component.services);
                    let spec = LaunchSpec {
                        container_id: id.clone(),
                        command: component.command.clone(),
                        node_id: node_id.clone(),
                        resources: component.resources.clone(),
                        container: component.container.clone(),
                        runtime: config.runtime.clone(),
                    };
                    let spec_hash = spec.hash();
                    for service in &component.serves {
                        routes.entry(*service).or_insert(slots.len());
                    }
                    slots.push(ComponentSlot::new(
                        id,
                        component.serves.clone(),
                        ComponentSlotKind::Managed { spec, spec_hash },
                    ));
                }
            }
            Deployment::Unmanaged(endpoints) => {
                for endpoint in endpoints {
                    // Several services on one socket share one slot: one process to probe.
                    let index = match slots.iter().position(|slot: &ComponentSlot| {
                        matches!(&slot.kind, ComponentSlotKind::Unmanaged { socket } if *socket == endpoint.socket)
                    }) {
                        Some(index) => index,
                        None => {
                            slots.push(ComponentSlot::new(
                                endpoint.socket.display().to_string(),
                                Vec::new(),
                                ComponentSlotKind::Unmanaged {
                                    socket: endpoint.socket.clone(),
                                },
                            ));
                            slots.len() - 1
                        }
                    };
                    if let Some(slot) = slots.get_mut(index) {
                        slot.serves.push(endpoint.service);
                    }
                    routes.entry(endpoint.service).or_insert(index);
                }
            }
        }
        let inner = Arc::new(Inner {
            config,
            options,
            runtime,
            node_id,
            slots,
            routes,
            version: Mutex::new(None),
            stopping: watch::Sender::new(false),
            detached: AtomicBool::new(false),
        });
        inner.update_ready_gauge();
        let resume = inner.recover().await?;
        let manager = Self {
            inner,
            tasks: Mutex::new(Vec::new()),
        };
        // What was running keeps running under supervision: adopted components are watched
        // (and restarted if they end) and replaced ones relaunched at once, not on next need.
        for index in resume {
            manager.supervise(index);
        }
        if manager.inner.config.is_managed() {
            let inner = Arc::clone(&manager.inner);
            let task = tokio::spawn(async move { inner.rotate_logs_until_stopped().await });
            lock(&manager.tasks).push(task);
        }
        Ok(manager)
    }

    pub fn config(&self) -> &PluginConfig {
        &self.inner.config
    }

    /// The node id given to this plugin's components.
    pub fn node_id(&self) -> &str {
        &self.inner.node_id
    }

    /// The plugin's CSI version, once a component has been probed.
    pub fn version(&self) -> Option<CsiVersion> {
        *lock(&self.inner.version)
    }

    /// Eager start: launches (or starts watching) every component now instead of on first
    /// need. Returns at once; use [`ServiceManager::endpoint`] to wait for readiness.
    pub fn start(&self) {
        for index in 0..self.inner.slots.len() {
            self.supervise(index);
        }
    }

    /// A ready endpoint serving `service`, launching its component if needed and waiting
    /// up to the plugin's startup timeout (through restarts).
    pub async fn endpoint(&self, service: Service) -> Result<ReadyEndpoint, ManagerError> {
        self.endpoint_within(service, self.inner.config.startup_timeout)
            .await
    }

    /// Like [`ServiceManager::endpoint`] with an explicit wait.
    pub async fn endpoint_within(
        &self,
        service: Service,
        wait: Duration,
    ) -> Result<ReadyEndpoint, ManagerError> {
        let plugin = || self.inner.config.plugin_type.clone();
        let stopped = || {
            if self.inner.detached.load(Ordering::SeqCst) {
                ManagerError::Replaced { plugin: plugin() }
            } else {
                ManagerError::Stopped { plugin: plugin() }
            }
        };
        if *self.inner.stopping.borrow() || self.inner.detached.load(Ordering::SeqCst) {
            return Err(stopped());
        }
        let Some(&index) = self.inner.routes.get(&service) else {
            return Err(ManagerError::NotServed {
                plugin: plugin(),
                service,
            });
        };
        self.supervise(index);
        let slot = &self.inner.slots[index];
        let mut states = slot.state.subscribe();
        let waited = tokio::time::timeout(
            wait,
            states.wait_for(|s| matches!(s, ComponentState::Ready(_) | ComponentState::Stopped)),
        )
        .await;
        match waited {
            Ok(Ok(state)) => match &*state {
                ComponentState::Ready(endpoint) => Ok(endpoint.clone()),
                _ => Err(stopped()),
            },
            Ok(Err(_)) => Err(stopped()),
            Err(_) => Err(ManagerError::NotReady {
                plugin: plugin(),
                service,
                waited: wait,
                status: slot.describe(),
            }),
        }
    }

    /// Tells the manager that calls to `endpoint` fail at the transport level. A managed
    /// component is watched through its process, so nothing is needed; an unmanaged one is
    /// probed again (it may have restarted without replacing its socket).
    pub fn endpoint_failed(&self, endpoint: &ReadyEndpoint) {
        for slot in &self.inner.slots {
            if slot.id == endpoint.component {
                let current = matches!(&*slot.state.borrow(),
                    ComponentState::Ready(ready) if ready.generation == endpoint.generation);
                if current {
                    slot.recheck.notify_one();
                }
            }
        }
    }

    /// A snapshot of every component.
    pub fn status(&self) -> Vec<ComponentStatus> {
        self.inner
            .slots
            .iter()
            .map(|slot| ComponentStatus {
                component: slot.id.clone(),
                serves: slot.serves.clone(),
                state: slot.state.borrow().clone(),
            })
            .collect()
    }

    /// Stops every component (SIGTERM, SIGKILL after the plugin's `stop_grace_ms`) and
    /// removes their directories: for a plugin that is no longer configured and has no
    /// published volume left. The manager serves nothing afterwards.
    pub async fn stop(&self) -> Result<(), ManagerError> {
        self.inner.stopping.send_replace(true);
        let tasks: Vec<JoinHandle<()>> = lock(&self.tasks).drain(..).collect();
        for task in tasks {
            // A supervisor that panicked has nothing left to stop.
            let _ = task.await;
        }
        for slot in &self.inner.slots {
            let adopted = lock(&slot.adopted).take();
            if let Some(component) = adopted {
                component.stop(self.inner.config.stop_grace).await;
            }
            slot.state.send_replace(ComponentState::Stopped);
        }
        self.inner.update_ready_gauge();
        if self.inner.runtime.kind() == "oci" {
            // No container needs the shared mount root any more.
            runtime::oci::release_mount_root(
                &self
                    .inner
                    .options
                    .layout
                    .mounts_dir(&self.inner.config.plugin_type, &self.inner.config.name),
            );
        }
        remove_containers_dir(&self.inner.containers_dir())
            .map_err(|(path, source)| self.inner.io_error(path, source))
    }

    /// Ends supervision and waits until every supervision task is gone, leaving the
    /// components running, so that a new manager (a changed configuration) can recover them
    /// without racing this one: it adopts what is up to date and replaces the rest. Callers
    /// still holding this manager get [`ManagerError::Replaced`] (transient). Use this (or
    /// [`ServiceManager::replace_with`]) before creating a manager over the same plugin
    /// while this one is still referenced.
    pub async fn detach(&self) {
        self.inner.detached.store(true, Ordering::SeqCst);
        let tasks: Vec<JoinHandle<()>> = lock(&self.tasks).drain(..).collect();
        for task in tasks {
            task.abort();
            // Cancelled at its next await point; waiting for it means no launch of this
            // manager can land after the new manager's recovery has looked.
            let _ = task.await;
        }
        for slot in &self.inner.slots {
            slot.state.send_replace(ComponentState::Stopped);
        }
    }

    /// Detaches this manager and creates one for `config` over the same work dir (a
    /// reload): up-to-date components are adopted, changed ones relaunched, dropped ones
    /// stopped and cleaned.
    pub async fn replace_with(&self, config: PluginConfig) -> Result<ServiceManager, ManagerError> {
        self.detach().await;
        ServiceManager::new(config, self.inner.options.clone()).await
    }

    fn supervise(&self, index: usize) {
        let Some(slot) = self.inner.slots.get(index) else {
            return;
        };
        if *self.inner.stopping.borrow()
            || self.inner.detached.load(Ordering::SeqCst)
            || slot.supervised.swap(true, Ordering::SeqCst)
        {
            return;
        }
        let inner = Arc::clone(&self.inner);
        let task = tokio::spawn(async move {
            match inner.slots[index].kind {
                ComponentSlotKind::Managed { .. } => inner.supervise_managed(index).await,
                ComponentSlotKind::Unmanaged { .. } => inner.supervise_unmanaged(index).await,
            }
        });
        lock(&self.tasks).push(task);
    }
}

impl ComponentSlot {
    fn describe(&self) -> String {
        let state = self.state.borrow();
        match (&*state, &*lock(&self.last_error)) {
            (ComponentState::Starting { .. }, Some(err)) => {
                format!("starting again after: {err}")
            }
            (state, _) => state.describe(),
        }
    }

    fn note_error(&self, err: &str) {
        *lock(&self.last_error) = Some(err.to_owned());
    }

    fn new(id: String, serves: Vec<Service>, kind: ComponentSlotKind) -> Self {
        Self {
            id,
            serves,
            kind,
            state: watch::Sender::new(ComponentState::Idle),
            adopted: Mutex::new(None),
            supervised: AtomicBool::new(false),
            recheck: Notify::new(),
            last_error: Mutex::new(None),
        }
    }
}

impl Inner {
    fn plugin(&self) -> &str {
        &self.config.plugin_type
    }

    fn containers_dir(&self) -> PathBuf {
        self.options
            .layout
            .containers_dir(&self.config.plugin_type, &self.config.name)
    }

    /// Where the plugin is handed staging and target paths: its `mounts/` dir and the
    /// configured `target_path_root`.
    fn mount_roots(&self) -> Vec<PathBuf> {
        let mut roots = vec![
            self.options
                .layout
                .mounts_dir(&self.config.plugin_type, &self.config.name),
        ];
        roots.extend(self.config.target_path_root.clone());
        roots
    }

    fn io_error(&self, path: PathBuf, source: io::Error) -> ManagerError {
        ManagerError::Io {
            plugin: self.plugin().to_owned(),
            path,
            source,
        }
    }

    fn component_labels(&self, slot: &ComponentSlot) -> ComponentLabels {
        ComponentLabels {
            plugin: self.plugin().to_owned(),
            component: slot.id.clone(),
        }
    }

    fn set_state(&self, slot: &ComponentSlot, state: ComponentState) {
        slot.state.send_replace(state);
        self.update_ready_gauge();
    }

    /// `plugin_ready` is 1 when every component is ready.
    fn update_ready_gauge(&self) {
        let ready = !self.slots.is_empty()
            && self
                .slots
                .iter()
                .all(|slot| matches!(&*slot.state.borrow(), ComponentState::Ready(_)));
        self.options
            .metrics
            .plugin_ready
            .get_or_create(&PluginLabels {
                plugin: self.plugin().to_owned(),
            })
            .set(i64::from(ready));
    }

    async fn stopped(&self) {
        let mut rx = self.stopping.subscribe();
        // Err only if the sender is gone, which cannot happen while `self` lives.
        let _ = rx.wait_for(|stopping| *stopping).await;
    }

    /// Adopts, stops or cleans what an earlier csi-agent left (see the module doc). Returns
    /// the slots that were running: adopted, or stopped because their config changed.
    async fn recover(&self) -> Result<Vec<usize>, ManagerError> {
        let mut resume = Vec::new();
        let dir = self.containers_dir();
        let entries = match std::fs::read_dir(&dir) {
            Ok(entries) => entries,
            Err(err) if err.kind() == io::ErrorKind::NotFound => return Ok(resume),
            Err(err) => return Err(self.io_error(dir, err)),
        };
        for entry in entries {
            let entry = entry.map_err(|err| self.io_error(dir.clone(), err))?;
            let container_dir = entry.path();
            if !entry.file_type().is_ok_and(|t| t.is_dir()) {
                continue;
            }
            let id = entry.file_name().to_string_lossy().into_owned();
            let record = read_record(&container_dir);
            let running = match &record {
                Some(record) => {
                    let runtime = if record.runtime.kind() == self.runtime.kind() {
                        Arc::clone(&self.runtime)
                    } else {
                        runtime::for_handle(&record.runtime, &self.options.runtime_options())
                    };
                    match runtime.adopt(&record.runtime).await {
                        Ok(running) => running,
                        Err(err) => {
                            tracing::warn!(plugin = self.plugin(), component = %id, "cannot adopt: {err}");
                            None
                        }
                    }
                }
                None => None,
            };
            let index = self.slots.iter().position(|slot| slot.id == id);
            let configured = index.and_then(|i| self.slots.get(i));
            let current_hash = configured.and_then(|slot| match &slot.kind {
                ComponentSlotKind::Managed { spec_hash, .. } => Some(spec_hash.as_str()),
                ComponentSlotKind::Unmanaged { .. } => None,
            });
            match (configured, running) {
                (Some(slot), Some(component))
                    if record.as_ref().map(|r| r.spec_hash.as_str()) == current_hash =>
                {
                    tracing::info!(plugin = self.plugin(), component = %id, handle = %component.handle(), "adopted running component");
                    *lock(&slot.adopted) = Some(component);
                    resume.extend(index);
                }
                (Some(_), Some(component)) => {
                    tracing::info!(plugin = self.plugin(), component = %id, "configuration changed: stopping the outdated component");
                    component.stop(self.config.stop_grace).await;
                    clean_runtime_files(&container_dir);
                    resume.extend(index);
                }
                (Some(_), None) => {
                    if record.is_none() {
                        // A launch interrupted before its record was written may have left
                        // a container running that nothing accounts for.
                        runtime::oci::forget_stray(
                            &self.options.runtime_options().oci,
                            &id,
                            &container_dir,
                        )
                        .await;
                        runtime::process::forget_stray(&container_dir).await;
                    }
                    clean_runtime_files(&container_dir);
                }
                (None, running) => {
                    if let Some(component) = running {
                        tracing::info!(plugin = self.plugin(), component = %id, "no longer configured: stopping it");
                        component.stop(self.config.stop_grace).await;
                    } else if record.is_none() {
                        runtime::oci::forget_stray(
                            &self.options.runtime_options().oci,
                            &id,
                            &container_dir,
                        )
                        .await;
                        runtime::process::forget_stray(&container_dir).await;
                    }
                    if let Err((path, err)) = remove_container_dir(&container_dir) {
                        tracing::warn!(plugin = self.plugin(), path = %path.display(), "cannot remove: {err}");
                    }
                }
            }
        }
        Ok(resume)
    }

    /// Supervision loop of a managed component; runs until the manager stops.
    async fn supervise_managed(&self, index: usize) {
        let slot = &self.slots[index];
        let ComponentSlotKind::Managed { spec, spec_hash } = &slot.kind else {
            return;
        };
        let backoff = self.config.restart_backoff;
        let labels = self.component_labels(slot);
        let container_dir = self.containers_dir().join(&slot.id);
        let mut failures: u32 = 0;
        let mut generation: u64 = 0;
        let mut last_error = String::new();
        let mut adopted = lock(&slot.adopted).take();
        loop {
            let (component, socket) = match adopted.take() {
                Some(component) => match resolve_socket(&container_dir) {
                    Some(socket) => (component, socket),
                    None => {
                        // Its socket dir is gone: it cannot be reached; start it over.
                        component.stop(self.config.stop_grace).await;
                        continue;
                    }
                },
                None => {
                    let delay = backoff.delay(failures);
                    if !delay.is_zero() {
                        self.set_state(
                            slot,
                            ComponentState::BackingOff {
                                failures,
                                delay,
                                last_error: last_error.clone(),
                            },
                        );
                        tokio::select! {
                            () = tokio::time::sleep(delay) => {}
                            () = self.stopped() => return self.finish(slot, None, &container_dir).await,
                        }
                    }
                    if generation > 0 || failures > 0 {
                        self.options
                            .metrics
                            .component_restarts
                            .get_or_create(&labels)
                            .inc();
                    }
                    match self.launch(spec, spec_hash, &container_dir).await {
                        Ok(launched) => launched,
                        Err(err) => {
                            failures = failures.saturating_add(1);
                            last_error = err.to_string();
                            slot.note_error(&last_error);
                            tracing::warn!(plugin = self.plugin(), component = %slot.id, "launch failed: {err}");
                            continue;
                        }
                    }
                }
            };
            generation += 1;
            self.set_state(slot, ComponentState::Starting { generation });
            let deadline = tokio::time::Instant::now() + self.config.startup_timeout;
            let ready = tokio::select! {
                exit = component.wait() => Err(format!("{exit} before becoming ready")),
                ready = self.wait_ready(slot, &socket, generation, Some(deadline), Some(component.handle())) => {
                    ready.map_err(|err| err.to_string())
                }
                () = self.stopped() => return self.finish(slot, Some(component), &container_dir).await,
            };
            let ready_at = Instant::now();
            match ready {
                Ok(endpoint) => {
                    tracing::info!(plugin = self.plugin(), component = %slot.id, version = %endpoint.version,
                        socket_to_ready_us = endpoint.socket_to_ready.as_micros() as u64, "component ready");
                    self.set_state(slot, ComponentState::Ready(endpoint));
                    tokio::select! {
                        exit = component.wait() => {
                            last_error = exit.to_string();
                            slot.note_error(&last_error);
                        }
                        () = self.stopped() => return self.finish(slot, Some(component), &container_dir).await,
                    }
                    if ready_at.elapsed() >= backoff.reset_after {
                        failures = 0;
                    }
                    tracing::warn!(plugin = self.plugin(), component = %slot.id, "component {last_error}; restarting");
                }
                Err(err) => {
                    tracing::warn!(plugin = self.plugin(), component = %slot.id, "component failed to start: {err}");
                    slot.note_error(&err);
                    // Stop it if it still runs (timeout, version change); a no-op otherwise.
                    component.stop(self.config.stop_grace).await;
                    last_error = err;
                }
            }
            self.options
                .metrics
                .component_terminations
                .get_or_create(&labels)
                .inc();
            failures = failures.saturating_add(1);
            remove_file_if_exists(&socket);
        }
    }

    /// Stops the component (if any), cleans its runtime files and publishes `Stopped`.
    async fn finish(
        &self,
        slot: &ComponentSlot,
        component: Option<Box<dyn Component>>,
        container_dir: &Path,
    ) {
        if let Some(component) = component {
            component.stop(self.config.stop_grace).await;
        }
        clean_runtime_files(container_dir);
        self.set_state(slot, ComponentState::Stopped);
    }

    /// Keeps the components' stdout and stderr size-capped (see [`crate::logs`]) until the
    /// manager stops.
    async fn rotate_logs_until_stopped(&self) {
        let mut ticks = tokio::time::interval(crate::logs::CHECK_INTERVAL);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = ticks.tick() => {}
                () = self.stopped() => return,
            }
            let dirs: Vec<PathBuf> = self
                .slots
                .iter()
                .filter(|slot| matches!(slot.kind, ComponentSlotKind::Managed { .. }))
                .map(|slot| self.containers_dir().join(&slot.id))
                .collect();
            // Blocking file copies: off the async workers.
            let _ = tokio::task::spawn_blocking(move || {
                for dir in dirs {
                    crate::logs::rotate_dir(
                        &dir,
                        crate::logs::DEFAULT_MAX_BYTES,
                        crate::logs::DEFAULT_GENERATIONS,
                    );
                }
            })
            .await;
        }
    }

    /// Fetches the command's `uris` into the sandbox (the container dir, the process
    /// runtime's working directory, bound at the same path in a container on the host's
    /// root), before every launch: a failure is this launch's error, retried with the restart
    /// backoff like any other. A container with a root of its own (an image, a configured
    /// rootfs) does not get the sandbox, so a component with `uris` there is refused, saying
    /// so.
    async fn fetch_uris(&self, spec: &LaunchSpec, container_dir: &Path) -> Result<(), LaunchError> {
        let uris = &spec.command.uris;
        if uris.is_empty() {
            return Ok(());
        }
        let own_root = match &spec.runtime {
            crate::config::RuntimeConfig::Process => false,
            crate::config::RuntimeConfig::Oci(oci) => {
                oci.rootfs.is_some()
                    || spec.container.as_ref().is_some_and(|c| {
                        !matches!(
                            crate::image::reference::ContainerImage::from_container(c),
                            Ok(None)
                        )
                    })
            }
        };
        if own_root {
            return Err(LaunchError::UrisNeedTheHostRoot);
        }
        crate::fetch::fetch_all(uris, container_dir, &self.options.fetch).await?;
        tracing::info!(plugin = self.plugin(), component = %spec.container_id, uris = uris.len(), "fetched the command's uris into the sandbox");
        Ok(())
    }

    /// Prepares the dirs, removes a stale socket, launches and records the component.
    async fn launch(
        &self,
        spec: &LaunchSpec,
        spec_hash: &str,
        container_dir: &Path,
    ) -> Result<(Box<dyn Component>, PathBuf), LaunchError> {
        std::fs::create_dir_all(container_dir).map_err(|source| LaunchError::CreateDir {
            path: container_dir.to_path_buf(),
            source,
        })?;
        // A component crashing in a loop writes a lot: the cap holds across relaunches too.
        crate::logs::rotate_dir(
            container_dir,
            crate::logs::DEFAULT_MAX_BYTES,
            crate::logs::DEFAULT_GENERATIONS,
        );
        let socket_dir = ensure_socket_dir(container_dir, &self.options.socket_root)
            .map_err(LaunchError::SocketDir)?;
        let socket = socket_dir.join(SOCKET_FILE);
        // MESOS-8429: a stale socket would make the new component fail to bind, or make us
        // believe it is up.
        remove_file_if_exists(&socket);
        self.fetch_uris(spec, container_dir).await?;
        let context = LaunchContext {
            container_dir: container_dir.to_path_buf(),
            socket: socket.clone(),
            mount_roots: self.mount_roots(),
        };
        // Read at each launch, so a rotated secret applies now. Only the runtime sees the
        // resolved copy: the record below keeps `spec`, whose secrets serialize redacted.
        let mut resolved = spec.clone();
        resolved.command.environment = crate::secrets::resolve(
            &spec.command.environment,
            self.options.secret_dir.as_deref(),
        )?;
        let component = self.runtime.launch(&resolved, &context).await?;
        let record = ComponentRecord {
            schema_version: COMPONENT_SCHEMA_VERSION,
            container_id: spec.container_id.clone(),
            spec_hash: spec_hash.to_owned(),
            spec: serde_json::to_value(spec).unwrap_or_default(),
            runtime: component.handle(),
            socket: socket.clone(),
            launched_at_unix_ms: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX)),
        };
        if let Err(err) = write_record(container_dir, &record) {
            // Without a record the component could not be adopted after a restart; better
            // to fail this launch than to leave an untracked process.
            component.stop(self.config.stop_grace).await;
            return Err(LaunchError::Record(err));
        }
        tracing::info!(plugin = self.plugin(), component = %spec.container_id, handle = %record.runtime, "launched component");
        Ok((component, socket))
    }

    /// Supervision loop of an unmanaged endpoint.
    async fn supervise_unmanaged(&self, index: usize) {
        let slot = &self.slots[index];
        let ComponentSlotKind::Unmanaged { socket } = &slot.kind else {
            return;
        };
        let backoff = self.config.restart_backoff;
        let mut failures: u32 = 0;
        let mut generation: u64 = 0;
        loop {
            generation += 1;
            self.set_state(slot, ComponentState::Starting { generation });
            // The socket may take any time to appear (the plugin runs elsewhere): only the
            // connect and probe after it appeared are bounded by the startup timeout.
            let ready = tokio::select! {
                ready = self.wait_ready(slot, socket, generation, None, None) => ready,
                () = self.stopped() => {
                    self.set_state(slot, ComponentState::Stopped);
                    return;
                }
            };
            match ready {
                Ok(endpoint) => {
                    failures = 0;
                    self.set_state(slot, ComponentState::Ready(endpoint));
                    tokio::select! {
                        changed = wait_path_changed(socket) => {
                            if let Err(err) = changed {
                                tracing::warn!(plugin = self.plugin(), "cannot watch {}: {err}", socket.display());
                            }
                            tracing::info!(plugin = self.plugin(), socket = %socket.display(), "socket replaced or removed; probing again");
                        }
                        () = slot.recheck.notified() => {}
                        () = self.stopped() => {
                            self.set_state(slot, ComponentState::Stopped);
                            return;
                        }
                    }
                }
                Err(err) => {
                    failures = failures.saturating_add(1);
                    let delay = backoff.delay(failures).max(backoff.initial);
                    tracing::warn!(plugin = self.plugin(), socket = %socket.display(), "unmanaged plugin not ready: {err}");
                    slot.note_error(&err.to_string());
                    self.set_state(
                        slot,
                        ComponentState::BackingOff {
                            failures,
                            delay,
                            last_error: err.to_string(),
                        },
                    );
                    tokio::select! {
                        () = tokio::time::sleep(delay) => {}
                        () = slot.recheck.notified() => {}
                        () = self.stopped() => {
                            self.set_state(slot, ComponentState::Stopped);
                            return;
                        }
                    }
                }
            }
        }
    }

    /// Waits for the socket, connects and probes until ready. `deadline` bounds the whole
    /// attempt; without one only connect+probe is bounded (by the startup timeout).
    async fn wait_ready(
        &self,
        slot: &ComponentSlot,
        socket: &Path,
        generation: u64,
        deadline: Option<tokio::time::Instant>,
        handle: Option<RuntimeHandle>,
    ) -> Result<ReadyEndpoint, ReadyError> {
        let timeout = self.config.startup_timeout;
        match deadline {
            Some(deadline) => tokio::time::timeout_at(deadline, wait_for_path(socket))
                .await
                .map_err(|_| ReadyError::Timeout {
                    stage: "waiting for the socket",
                    timeout,
                })?
                .map_err(ReadyError::Watch)?,
            None => wait_for_path(socket).await.map_err(ReadyError::Watch)?,
        }
        let seen = Instant::now();
        let deadline = deadline.unwrap_or_else(|| tokio::time::Instant::now() + timeout);
        let options = ClientOptions {
            rpc_deadline: self.config.rpc_deadline,
            plugin: self.plugin().to_owned(),
            metrics: Some(Arc::clone(&self.options.metrics)),
        };
        // Connecting detects the version (a Probe). Between the plugin's bind() and listen()
        // a connect is refused: such transient failures are retried quickly.
        let mut delay = Duration::from_millis(1);
        let (client, ready_at_connect) = loop {
            let attempt = tokio::time::timeout_at(
                deadline,
                CsiClient::connect_and_probe(socket, options.clone()),
            )
            .await
            .map_err(|_| ReadyError::Timeout {
                stage: "connecting",
                timeout,
            })?;
            match attempt {
                Ok(client) => break client,
                Err(err) if err.is_transient() => {
                    self.count_probe(err.metric_code());
                    sleep_until_or(deadline, delay)
                        .await
                        .map_err(|()| ReadyError::Timeout {
                            stage: "connecting",
                            timeout,
                        })?;
                    delay = (delay * 2).min(Duration::from_millis(100));
                }
                Err(err) => {
                    self.count_probe(err.metric_code());
                    return Err(ReadyError::Rpc(err));
                }
            }
        };
        let version = client.version();
        {
            let mut known = lock(&self.version);
            match *known {
                None => *known = Some(version),
                Some(was) if was != version => {
                    return Err(ReadyError::VersionChanged { was, now: version });
                }
                Some(_) => {}
            }
        }
        // CSI spec, ProbeResponse.ready: "If not present, the caller SHALL assume that the
        // plugin is in a ready state"; `false` means not yet: probe again.
        let mut delay = Duration::from_millis(5);
        let mut ready = ready_at_connect;
        if ready {
            // The detection's Probe already said ready: no second round trip.
            self.count_probe("READY");
        }
        while !ready {
            let probe = tokio::time::timeout_at(deadline, client.probe())
                .await
                .map_err(|_| ReadyError::Timeout {
                    stage: "probing",
                    timeout,
                })?;
            match probe {
                Ok(true) => {
                    self.count_probe("READY");
                    ready = true;
                    continue;
                }
                Ok(false) => self.count_probe("NOT_READY"),
                Err(err) if err.is_transient() => self.count_probe(err.metric_code()),
                Err(err) => {
                    self.count_probe(err.metric_code());
                    return Err(ReadyError::Rpc(err));
                }
            }
            sleep_until_or(deadline, delay)
                .await
                .map_err(|()| ReadyError::Timeout {
                    stage: "waiting for Probe to answer ready",
                    timeout,
                })?;
            delay = (delay * 2).min(Duration::from_secs(1));
        }
        // The plugin's identity, once per launch. A name that breaks the spec's rules is not
        // a plugin csi-agent can tell apart from another: refused, naming the value. A plugin
        // that cannot answer now is not refused for it (Probe said it is ready; the calls
        // that matter have their own errors).
        match tokio::time::timeout_at(deadline, client.get_plugin_info()).await {
            Ok(Ok(info)) => check_plugin_name(&info.name).map_err(ReadyError::Identity)?,
            Ok(Err(err)) => {
                tracing::warn!(plugin = %self.plugin(), component = %slot.id, error = %err, "GetPluginInfo failed; the plugin's name is not checked");
            }
            Err(_) => {
                return Err(ReadyError::Timeout {
                    stage: "asking GetPluginInfo",
                    timeout,
                });
            }
        }
        Ok(ReadyEndpoint {
            component: slot.id.clone(),
            socket: socket.to_path_buf(),
            client,
            version,
            generation,
            handle,
            socket_to_ready: seen.elapsed(),
        })
    }

    fn count_probe(&self, code: &str) {
        self.options
            .metrics
            .probes
            .get_or_create(&RpcLabels {
                plugin: self.plugin().to_owned(),
                method: "Probe".to_owned(),
                code: code.to_owned(),
            })
            .inc();
    }
}

/// Sleeps `delay`, or fails if that would pass `deadline`.
async fn sleep_until_or(deadline: tokio::time::Instant, delay: Duration) -> Result<(), ()> {
    let wake = tokio::time::Instant::now() + delay;
    if wake >= deadline {
        tokio::time::sleep_until(deadline).await;
        return Err(());
    }
    tokio::time::sleep_until(wake).await;
    Ok(())
}

/// Waits until `path` exists, with inotify: the deepest existing ancestor is watched and the
/// path re-checked on every event there, so missing parent dirs may appear too. No polling.
pub async fn wait_for_path(path: &Path) -> io::Result<()> {
    if path.symlink_metadata().is_ok() {
        return Ok(());
    }
    let inotify = Inotify::init()?;
    let mut events = inotify.into_event_stream([0u8; 4096])?;
    let mut watched: Vec<PathBuf> = Vec::new();
    loop {
        let mut dir = path.parent().unwrap_or(Path::new("/"));
        while dir.symlink_metadata().is_err() {
            dir = dir.parent().unwrap_or(Path::new("/"));
        }
        if !watched.iter().any(|w| w == dir) {
            events.watches().add(
                dir,
                WatchMask::CREATE | WatchMask::MOVED_TO | WatchMask::ONLYDIR,
            )?;
            watched.push(dir.to_path_buf());
        }
        // Checked after adding the watch, so an appearance in between is not missed.
        if path.symlink_metadata().is_ok() {
            return Ok(());
        }
        match events.next().await {
            Some(Ok(_)) => {}
            Some(Err(err)) => return Err(err),
            None => return Err(io::Error::other("inotify stream ended")),
        }
    }
}

/// Waits until `path` is removed, replaced or renamed (inotify on its parent dir).
async fn wait_path_changed(path: &Path) -> io::Result<()> {
    let (Some(dir), Some(name)) = (path.parent(), path.file_name()) else {
        return Err(io::Error::other("path has no parent"));
    };
    let inotify = Inotify::init()?;
    let mut events = inotify.into_event_stream([0u8; 4096])?;
    events.watches().add(
        dir,
        WatchMask::CREATE
            | WatchMask::DELETE
            | WatchMask::MOVED_FROM
            | WatchMask::MOVED_TO
            | WatchMask::DELETE_SELF
            | WatchMask::MOVE_SELF,
    )?;
    if path.symlink_metadata().is_err() {
        return Ok(());
    }
    while let Some(event) = events.next().await {
        let event = event?;
        if event.name.is_none() || event.name.as_deref() == Some(name) {
            return Ok(());
        }
    }
    Err(io::Error::other("inotify stream ended"))
}

/// The socket of a container dir, from its `endpoint` symlink.
fn resolve_socket(container_dir: &Path) -> Option<PathBuf> {
    let target = std::fs::read_link(container_dir.join(ENDPOINT_LINK)).ok()?;
    target.is_dir().then(|| target.join(SOCKET_FILE))
}

/// Returns the component's socket dir, creating a fresh short one (0700) under
/// `socket_root` and pointing `containers/<id>/endpoint` at it when needed.
fn ensure_socket_dir(container_dir: &Path, socket_root: &Path) -> io::Result<PathBuf> {
    let link = container_dir.join(ENDPOINT_LINK);
    if let Ok(target) = std::fs::read_link(&link)
        && target.is_dir()
    {
        return Ok(target);
    }
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(socket_root)?;
    let dir = loop {
        let candidate = socket_root.join(format!("{:08x}", rand::random::<u32>()));
        match std::fs::DirBuilder::new().mode(0o700).create(&candidate) {
            Ok(()) => break candidate,
            Err(err) if err.kind() == io::ErrorKind::AlreadyExists => continue,
            Err(err) => return Err(err),
        }
    };
    let socket_len = dir.join(SOCKET_FILE).as_os_str().len();
    if socket_len > crate::config::MAX_SOCKET_PATH_LEN {
        let _ = std::fs::remove_dir(&dir);
        return Err(io::Error::other(format!(
            "socket path under {} would be {socket_len} bytes; unix sockets allow {}: choose a shorter socket root",
            socket_root.display(),
            crate::config::MAX_SOCKET_PATH_LEN
        )));
    }
    // Replace the link atomically: a crash leaves the old link or the new one.
    let tmp = container_dir.join(format!("{ENDPOINT_LINK}.tmp"));
    remove_file_if_exists(&tmp);
    std::os::unix::fs::symlink(&dir, &tmp)?;
    std::fs::rename(&tmp, &link)?;
    Ok(dir)
}

fn remove_file_if_exists(path: &Path) {
    if let Err(err) = std::fs::remove_file(path)
        && err.kind() != io::ErrorKind::NotFound
    {
        tracing::warn!(path = %path.display(), "cannot remove: {err}");
    }
}

/// Removes what a component leaves besides its logs: socket, socket dir, endpoint link and
/// record.
fn clean_runtime_files(container_dir: &Path) {
    let link = container_dir.join(ENDPOINT_LINK);
    if let Ok(target) = std::fs::read_link(&link) {
        remove_file_if_exists(&target.join(SOCKET_FILE));
        if let Err(err) = std::fs::remove_dir(&target)
            && err.kind() != io::ErrorKind::NotFound
        {
            tracing::warn!(path = %target.display(), "cannot remove socket dir: {err}");
        }
    }
    remove_file_if_exists(&link);
    remove_file_if_exists(&container_dir.join(COMPONENT_RECORD));
}

/// Removes a container dir: only the files csi-agent put there, then the dir if empty
/// (never recursively: a plugin might have mounted something in its working dir).
fn remove_container_dir(container_dir: &Path) -> Result<(), (PathBuf, io::Error)> {
    clean_runtime_files(container_dir);
    // Only names csi-agent creates: logs, and leftovers of an interrupted record or link
    // write (`component.json.*`, `endpoint.*`).
    if let Ok(entries) = std::fs::read_dir(container_dir) {
        for entry in entries.flatten() {
            let name = entry.file_name();
            let name = name.to_string_lossy();
            let ours = name == "stdout"
                || name == "stderr"
                || name.starts_with("stdout.")
                || name.starts_with("stderr.")
                || name.starts_with(&format!("{COMPONENT_RECORD}."))
                || name.starts_with(&format!("{ENDPOINT_LINK}."));
            if ours && entry.file_type().is_ok_and(|t| !t.is_dir()) {
                remove_file_if_exists(&entry.path());
            }
        }
    }
    match std::fs::remove_dir(container_dir) {
        Ok(()) => Ok(()),
        Err(err) if err.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(err) => Err((container_dir.to_path_buf(), err)),
    }
}

/// Removes every container dir under `containers_dir`, then the dir itself.
fn remove_containers_dir(containers_dir: &Path) -> Result<(), (PathBuf, io::Error)> {
    let entries = match std::fs::read_dir(containers_dir) {
        Ok(entries) => entries,
        Err(err) if err.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(err) => return Err((containers_dir.to_path_buf(), err)),
    };
    for entry in entries.flatten() {
        if entry.file_type().is_ok_and(|t| t.is_dir()) {
            remove_container_dir(&entry.path())?;
        }
    }
    match std::fs::remove_dir(containers_dir) {
        Ok(()) => Ok(()),
        Err(err) if err.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(err) => Err((containers_dir.to_path_buf(), err)),
    }
}

fn read_record(container_dir: &Path) -> Option<ComponentRecord> {
    let path = container_dir.join(COMPONENT_RECORD);
    let bytes = match std::fs::read(&path) {
        Ok(bytes) => bytes,
        Err(err) if err.kind() == io::ErrorKind::NotFound => return None,
        Err(err) => {
            tracing::warn!(path = %path.display(), "cannot read component record: {err}");
            return None;
        }
    };
    match serde_json::from_slice::<ComponentRecord>(&bytes) {
        Ok(record) => {
            if record.schema_version > COMPONENT_SCHEMA_VERSION {
                tracing::warn!(path = %path.display(), version = record.schema_version,
                    "component record from a newer csi-agent; using the fields this one knows");
            }
            Some(record)
        }
        Err(err) => {
            // Moved aside, not deleted: an operator may want to see it.
            let aside = container_dir.join(format!("{COMPONENT_RECORD}.corrupt"));
            tracing::error!(path = %path.display(), "unreadable component record ({err}); moved to {}", aside.display());
            let _ = std::fs::rename(&path, &aside);
            None
        }
    }
}

fn write_record(container_dir: &Path, record: &ComponentRecord) -> io::Result<()> {
    let bytes = serde_json::to_vec_pretty(record).map_err(io::Error::other)?;
    // Durable like every record (temp + fsync + rename + fsync dir). Not counted in
    // `checkpoint_writes`, which measures the volume records' writes per publish (docs/benchmarks.md, "Targets").
    crate::store::write_atomic(&container_dir.join(COMPONENT_RECORD), &bytes, None)
        .map_err(io::Error::other)
}

/// The `(type, name)` of every plugin that has a `containers/` dir in the work dir: the
/// engine compares it with the configured plugins to find removed ones.
pub fn plugins_with_components(layout: &Layout) -> io::Result<Vec<(String, String)>> {
    let mut found = Vec::new();
    let root = layout.csi_root();
    let types = match std::fs::read_dir(&root) {
        Ok(types) => types,
        Err(err) if err.kind() == io::ErrorKind::NotFound => return Ok(found),
        Err(err) => return Err(err),
    };
    for plugin_type in types.flatten() {
        let Ok(names) = std::fs::read_dir(plugin_type.path()) else {
            continue;
        };
        for name in names.flatten() {
            if name.path().join("containers").is_dir() {
                found.push((
                    plugin_type.file_name().to_string_lossy().into_owned(),
                    name.file_name().to_string_lossy().into_owned(),
                ));
            }
        }
    }
    found.sort();
    Ok(found)
}

/// Stops every component of a plugin that is no longer configured and removes its
/// `containers/` dir. The caller must only do this once none of the plugin's volumes is
/// published (docs/configuration.md: a node plugin outlives its volumes). Returns how many components
/// were found running.
pub async fn remove_components(
    layout: &Layout,
    plugin_type: &str,
    plugin_name: &str,
    grace: Duration,
    runtimes: &RuntimeOptions,
) -> Result<usize, ManagerError> {
    let dir = layout.containers_dir(plugin_type, plugin_name);
    let io_error = |path: PathBuf, source| ManagerError::Io {
        plugin: plugin_type.to_owned(),
        path,
        source,
    };
    let entries = match std::fs::read_dir(&dir) {
        Ok(entries) => entries,
        Err(err) if err.kind() == io::ErrorKind::NotFound => return Ok(0),
        Err(err) => return Err(io_error(dir, err)),
    };
    let mut stopped = 0;
    for entry in entries.flatten() {
        let container_dir = entry.path();
        let record = read_record(&container_dir);
        if record.is_none() {
            runtime::oci::forget_stray(
                &runtimes.oci,
                &entry.file_name().to_string_lossy(),
                &container_dir,
            )
            .await;
        }
        if let Some(record) = record {
            match runtime::for_handle(&record.runtime, runtimes)
                .adopt(&record.runtime)
                .await
            {
                Ok(Some(component)) => {
                    tracing::info!(plugin = plugin_type, component = %record.container_id, "plugin removed: stopping component");
                    component.stop(grace).await;
                    stopped += 1;
                }
                Ok(None) => {}
                Err(err) => tracing::warn!(
                    plugin = plugin_type,
                    "cannot adopt {}: {err}",
                    record.container_id
                ),
            }
        }
    }
    // A shared mount root left by the oci runtime (a no-op for other runtimes).
    runtime::oci::release_mount_root(&layout.mounts_dir(plugin_type, plugin_name));
    remove_containers_dir(&dir).map_err(|(path, err)| io_error(path, err))?;
    Ok(stopped)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn container_ids_follow_the_mesos_format() {
        assert_eq!(
            container_id(
                "org.example.test",
                "default",
                &[Service::Controller, Service::Node]
            ),
            "csi-agent-org-example-test-default--CONTROLLER_SERVICE-NODE_SERVICE"
        );
        assert_eq!(
            container_id("lvm", "fast", &[Service::Node]),
            "csi-agent-lvm-fast--NODE_SERVICE"
        );
        // Config order is kept, as Mesos does.
        assert_eq!(
            container_id("t", "n", &[Service::Node, Service::Controller]),
            "csi-agent-t-n--NODE_SERVICE-CONTROLLER_SERVICE"
        );
    }

    #[tokio::test]
    async fn wait_for_path_sees_files_created_in_missing_dirs() -> anyhow::Result<()> {
        let tmp = tempfile::tempdir()?;
        let target = tmp.path().join("a/b/sock");
        let waiter = tokio::spawn({
            let target = target.clone();
            async move { wait_for_path(&target).await }
        });
        tokio::time::sleep(Duration::from_millis(20)).await;
        std::fs::create_dir_all(tmp.path().join("a/b"))?;
        std::fs::write(&target, b"")?;
        tokio::time::timeout(Duration::from_secs(5), waiter).await???;
        Ok(())
    }
}
