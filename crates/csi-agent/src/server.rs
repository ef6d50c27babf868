//! [`CsiServer`]: the engine's front door (Mesos's `CSIServer`).
//!
//! It owns the start gate, the plugin table keyed by plugin type, configuration loading and
//! reloading, and routes each volume operation to the plugin's volume manager. A request for
//! a type that is not loaded yet loads its config then; a plugin whose initialization failed
//! is retried on the next request instead of staying dead. Until the gate opens, requests
//! wait (they are not refused) and no plugin is launched and no CSI call is made.
//!
//! It must not parse requests or format responses: the daemon does that.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use futures::future::BoxFuture;
use tokio::sync::{Mutex, watch};

use crate::client::{CsiClient, RpcError};
use crate::config::{
    self, ConfigDiff, ConfigError, ConfigSet, LoadedConfig, PluginConfig, Service,
};
use crate::layout::Layout;
use crate::metrics::Metrics;
use crate::mounts::MountTable;
use crate::service_manager::{ComponentStatus, ManagerOptions, ServiceManager};
use crate::store::{Store, StoreError};
use crate::volume::bind::Binder;
use crate::volume::gate::InFlight;
use crate::volume::recovery::RecoveryReport;
use crate::volume::{
    NodeContext, PluginEndpoints, VolumeConfig, VolumeError, VolumeManager, VolumeState,
};

/// Settings of the engine.
#[derive(Clone, Debug)]
pub struct ServerOptions {
    pub work_dir: PathBuf,
    /// Where plugin configs (`*.json`) are read; `None`: no plugins.
    pub plugin_config_dir: Option<PathBuf>,
    /// Root of the short socket dirs of managed components.
    pub socket_root: PathBuf,
    /// The node id given to plugins unless their config overrides it.
    pub node_id: String,
    /// The current boot id (`/proc/sys/kernel/random/boot_id`).
    pub boot_id: String,
    /// Dirs beneath which a publish's `bind_to` may go (`--bind-root`), absolute and
    /// canonical; empty: `bind_to` is refused.
    pub bind_roots: Vec<PathBuf>,
    /// Claims per volume and `bind_to` length (`--max-claims-per-volume`,
    /// `--max-bind-to-bytes`).
    pub claim_limits: crate::volume::ClaimLimits,
    /// The OCI runtime binary of the `oci` runtime (`runc`, or a path).
    pub oci_runtime: PathBuf,
    /// Launch every managed plugin's components when the gate opens, instead of on first use.
    pub start_plugins: bool,
    /// Registries of plugin images (`--docker-registry`, `--docker-config`,
    /// `--insecure-registry`).
    pub registry: crate::image::reference::RegistrySettings,
    /// Bounds on image pulls (`--image-pull-min-bytes-per-sec` and its window).
    pub pull_limits: crate::image::pull::PullLimits,
    /// The records' writer: its note flush and commit delay (`--commit-delay-us`).
    pub store: crate::store::StoreOptions,
    /// Caps on each image's unpacked bytes and inodes, and the image store's quota
    /// (`--image-max-unpacked-bytes`, `--image-max-inodes`, `--image-store-max-bytes`).
    pub image_limits: crate::image::budget::ImageLimits,
    /// Where and how plugins' `command.uris` are fetched (`--fetch-max-bytes`, ...).
    pub fetch: crate::fetch::FetchOptions,
    /// `--secret-dir`: where REFERENCE secrets of plugin configs are read at each launch.
    pub secret_dir: Option<PathBuf>,
    /// Cluster mode (`--cluster-etcd`): the cluster's settings and its etcd.
    pub cluster: Option<ClusterSetup>,
}

/// What cluster mode needs from the daemon (docs/cluster.md).
#[derive(Clone, Debug)]
pub struct ClusterSetup {
    pub options: crate::cluster::ClusterOptions,
    pub store: Arc<dyn crate::cluster::store::ClusterStore>,
}

/// `meta` keys of the node's cluster identity (docs/on-disk-format.md).
const META_CLUSTER_NAME: &str = "cluster_name";
const META_CLUSTER_NODE: &str = "cluster_node_name";
const META_CLUSTER_INSTANCE: &str = "cluster_instance_id";
const META_ETCD_CLUSTER_ID: &str = "etcd_cluster_id";

/// The image store's dir in the work dir (docs/operations.md, "Image store").
pub const IMAGES_DIR: &str = "images";

/// Errors of engine operations.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error("unknown plugin type {plugin_type:?}: {hint}")]
    UnknownPlugin { plugin_type: String, hint: String },
    #[error("plugin {plugin_type}: configuration error: {message}")]
    PluginConfig {
        plugin_type: String,
        message: String,
    },
    #[error("plugin {plugin_type} could not be initialized: {message}")]
    PluginInit {
        plugin_type: String,
        message: String,
    },
    #[error(transparent)]
    Volume(#[from] VolumeError),
    #[error("work dir: {0}")]
    Store(#[from] StoreError),
    /// The image store could not be opened at start (the daemon's log says why).
    #[error("the image store could not be opened; the daemon's log says why")]
    ImagesUnavailable,
    /// A prune would remove images a leftover plugin's containers may still run on.
    #[error(
        "not pruning: components of plugins that are no longer configured are still on the node ({}), and they may run on an image no config names; unpublish their volumes (restore their configs) first",
        plugins.join(", ")
    )]
    PruneUnsafe { plugins: Vec<String> },
    #[error(transparent)]
    ImageStore(#[from] crate::image::store::ImageStoreError),
    #[error("cannot list the plugins' components under {}: {source}", path.display())]
    ListComponents {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// The node was drained (`POST /v1/drain`): it publishes nothing and starts no plugin
    /// until csi-agentd is restarted.
    #[error(
        "the node is drained: it publishes nothing and starts no plugin; restart csi-agentd to serve again"
    )]
    Drained,
    /// The work dir belongs to another cluster or node name than the flags say.
    #[error(
        "the work dir joined cluster {recorded_cluster:?} as node {recorded_node:?}, but the flags say cluster {cluster:?}, node {node:?}: its volumes' claims in etcd are under the recorded names; start with --cluster-name {recorded_cluster} --node-name {recorded_node}, or use another --work-dir"
    )]
    ClusterIdentity {
        recorded_cluster: String,
        recorded_node: String,
        cluster: String,
        node: String,
    },
    /// Cluster mode is off (no `--cluster-etcd`).
    #[error("cluster mode is off: start csi-agentd with --cluster-etcd (docs/cluster.md)")]
    NoCluster,
    #[error(transparent)]
    Cluster(Box<crate::cluster::ClusterError>),
}

impl From<crate::cluster::ClusterError> for ServerError {
    fn from(err: crate::cluster::ClusterError) -> Self {
        ServerError::Cluster(Box::new(err))
    }
}

/// How long a drain waits, by default, for the operations in flight, and then again for the
/// unpublishes it runs itself (`POST /v1/drain` `timeout_secs`).
pub const DEFAULT_DRAIN_TIMEOUT: Duration = Duration::from_secs(60);

/// How often a waiting drain says in the log what it waits for.
const DRAIN_PROGRESS_EVERY: Duration = Duration::from_secs(5);

/// What [`CsiServer::drain`] did.
#[derive(Debug, Default)]
pub struct DrainReport {
    /// Every claim released.
    pub released: Vec<DrainedClaim>,
    /// Claims that could not be released, with why (they stay recorded and their plugin
    /// keeps running, so a later drain can finish them), and plugins not stopped.
    pub failed: Vec<DrainFailure>,
    /// Plugin types whose components were stopped.
    pub stopped: Vec<String>,
    /// What of csi-agent's is still on the node after the drain, with why: mounts (from the
    /// mount table), records not at rest, operations still in flight. Empty, with `failed`
    /// empty, is the only "drained".
    pub left: Vec<DrainLeft>,
}

impl DrainReport {
    /// True when nothing is left: the mount table shows nothing of csi-agent's, every record
    /// is at rest and no operation runs.
    pub fn is_complete(&self) -> bool {
        self.left.is_empty() && self.failed.is_empty()
    }
}

/// One workload's claim on one volume, as a drain names it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DrainedClaim {
    /// The plugin type.
    pub plugin: String,
    pub volume_id: String,
    pub workload: String,
}

/// A claim the drain could not release or, with empty `volume_id` and `workload`, a plugin
/// it could not stop.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DrainFailure {
    /// The plugin type.
    pub plugin: String,
    pub volume_id: String,
    pub workload: String,
    /// Why, as the error said it.
    pub error: String,
}

/// One thing a drain could not take away.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DrainLeft {
    pub plugin: String,
    /// Empty when it is not about one volume.
    pub volume_id: String,
    /// The mount point still mounted; `None` for a record or an operation.
    pub path: Option<PathBuf>,
    pub reason: String,
}

/// The endpoints of a managed or unmanaged plugin, through its service manager, which can be
/// replaced when the plugin's configuration changes while its volumes stay put.
#[derive(Debug)]
pub struct ManagedEndpoints {
    manager: RwLock<Arc<ServiceManager>>,
}

impl ManagedEndpoints {
    pub fn new(manager: Arc<ServiceManager>) -> Self {
        Self {
            manager: RwLock::new(manager),
        }
    }

    pub fn manager(&self) -> Arc<ServiceManager> {
        match self.manager.read() {
            Ok(m) => m.clone(),
            Err(poisoned) => poisoned.into_inner().clone(),
        }
    }

    fn replace(&self, manager: Arc<ServiceManager>) -> Arc<ServiceManager> {
        let mut slot = match self.manager.write() {
            Ok(m) => m,
            Err(poisoned) => poisoned.into_inner(),
        };
        std::mem::replace(&mut *slot, manager)
    }
}

impl PluginEndpoints for ManagedEndpoints {
    fn client(&self, service: Service) -> BoxFuture<'_, Result<CsiClient, RpcError>> {
        let manager = self.manager();
        Box::pin(async move {
            match manager.endpoint(service).await {
                Ok(ready) => Ok(ready.client),
                // Not ready (starting, restarting, backing off): transient, so the caller
                // retries with backoff and waits through the restart.
                Err(err @ crate::service_manager::ManagerError::NotReady { .. }) => {
                    Err(RpcError::not_ready("connect", err))
                }
                Err(err) if err.is_transient() => Err(RpcError::transport("connect", err)),
                Err(err) => Err(RpcError::protocol("connect", err.to_string())),
            }
        })
    }

    fn serves(&self, service: Service) -> bool {
        config_serves(self.manager().config(), service)
    }
}

/// True when some component (or endpoint) of the plugin serves `service`.
pub fn config_serves(config: &PluginConfig, service: Service) -> bool {
    match &config.deployment {
        config::Deployment::Managed(components) => {
            components.iter().any(|c| c.serves.contains(&service))
        }
        config::Deployment::Unmanaged(endpoints) => endpoints.iter().any(|e| e.service == service),
    }
}

/// One initialized plugin.
#[derive(Debug)]
pub struct Plugin {
    pub loaded: LoadedConfig,
    pub endpoints: Arc<ManagedEndpoints>,
    pub volumes: VolumeManager,
    pub recovery: RecoveryReport,
    /// The session's way to this plugin's volumes (cluster plugins in cluster mode): held
    /// here, registered weakly, so that a removed plugin drops out of the cluster's list.
    pub cluster_volumes: Option<Arc<dyn crate::cluster::ClusterPlugin>>,
}

impl Plugin {
    pub fn config(&self) -> &PluginConfig {
        &self.loaded.config
    }

    pub fn components(&self) -> Vec<ComponentStatus> {
        self.endpoints.manager().status()
    }
}

/// A plugin as reported by [`CsiServer::plugins`].
#[derive(Debug)]
pub struct PluginReport {
    pub loaded: LoadedConfig,
    /// `None` until the plugin is first used (or the gate opens).
    pub plugin: Option<Arc<Plugin>>,
    /// The last initialization error, if the plugin could not be set up.
    pub error: Option<String>,
}

#[derive(Debug, Default)]
struct Table {
    /// The configs of the last successful load of each type.
    configs: ConfigSet,
    config_errors: Vec<String>,
    config_error_files: Vec<(PathBuf, String)>,
    plugins: BTreeMap<String, Arc<Plugin>>,
    init_errors: BTreeMap<String, String>,
    /// One lock per plugin type, held while that plugin starts and recovers: the table
    /// itself is never held across a plugin's start, so one slow plugin blocks neither
    /// another nor `GET /v1/plugins` (nothing waits on what it does not need).
    init_locks: BTreeMap<String, Arc<Mutex<()>>>,
}

/// The engine.
#[derive(Clone, Debug)]
pub struct CsiServer {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    options: ServerOptions,
    layout: Layout,
    store: Store,
    metrics: Arc<Metrics>,
    binder: Arc<Binder>,
    started: watch::Sender<bool>,
    /// Set once the start gate opened and every configured plugin was initialized (its
    /// volumes recovered) or failed to.
    recovered: std::sync::atomic::AtomicBool,
    /// Set by [`CsiServer::drain`]; never cleared (a restart serves again).
    drained: std::sync::atomic::AtomicBool,
    /// Every volume operation in flight, and the door the drain closes.
    gate: Arc<crate::volume::gate::OperationGate>,
    /// One drain at a time.
    drain_lock: Mutex<()>,
    /// Plugins a drain stopped: they stay in the table (their records stay listed) but are
    /// not stopped again, replaced or started.
    drain_stopped: std::sync::Mutex<std::collections::BTreeSet<String>>,
    table: Mutex<Table>,
    /// Held by [`CsiServer::reload`] for its whole run: reloads happen one at a time, while
    /// `table` is held only for short sections.
    reload_lock: Mutex<()>,
    /// `<work_dir>/images`, shared by every plugin; `None` when it could not be opened (a
    /// plugin naming an image then fails to launch, saying so; the others are unaffected).
    images: Option<Arc<crate::image::store::ImageStore>>,
    /// The front doors' volume names (`crate::named`).
    named: crate::named::NamedState,
    /// Cluster mode's handle (`--cluster-etcd`).
    cluster: Option<crate::cluster::Cluster>,
}

impl CsiServer {
    /// Creates the engine over a work dir. Makes no CSI call and launches nothing.
    pub fn new(options: ServerOptions, metrics: Arc<Metrics>) -> Result<Self, ServerError> {
        let layout = Layout::new(&options.work_dir);
        let store = Store::open_with(layout.clone(), Some(metrics.clone()), options.store)?;
        let (started, _) = watch::channel(false);
        let binder = Arc::new(Binder::new(options.bind_roots.clone(), layout.work_dir()));
        let images_dir = layout.work_dir().join(IMAGES_DIR);
        let puller =
            crate::image::pull::Puller::new(options.registry.clone(), options.pull_limits.clone());
        let images = match crate::image::store::ImageStore::open(&images_dir, puller, None) {
            Ok(images) => Some(Arc::new(
                images.with_image_limits(options.image_limits.clone()),
            )),
            Err(err) => {
                tracing::error!(dir = %images_dir.display(), "the image store cannot be opened; plugins naming an image will not start: {err}");
                None
            }
        };
        let named = crate::named::NamedState::load(&store)?;
        let cluster = match &options.cluster {
            Some(setup) => Some(open_cluster(setup, &store, &metrics)?),
            None => None,
        };
        let server = Self {
            inner: Arc::new(Inner {
                options,
                layout,
                store,
                metrics,
                binder,
                started,
                recovered: std::sync::atomic::AtomicBool::new(false),
                drained: std::sync::atomic::AtomicBool::new(false),
                gate: Arc::default(),
                drain_lock: Mutex::new(()),
                drain_stopped: std::sync::Mutex::default(),
                table: Mutex::new(Table::default()),
                reload_lock: Mutex::new(()),
                images,
                named,
                cluster,
            }),
        };
        Ok(server)
    }

    /// Cluster mode's handle, when the daemon runs in cluster mode.
    pub fn cluster(&self) -> Result<&crate::cluster::Cluster, ServerError> {
        self.inner.cluster.as_ref().ok_or(ServerError::NoCluster)
    }

    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.inner.metrics
    }

    pub(crate) fn named_state(&self) -> &crate::named::NamedState {
        &self.inner.named
    }

    pub(crate) fn store(&self) -> &Store {
        &self.inner.store
    }

    pub fn work_dir(&self) -> &Path {
        &self.inner.options.work_dir
    }

    /// Commits every progress note queued so far (at a clean shutdown: the next start then
    /// repeats no RPC). A crash may lose them, which recovery is built for.
    pub async fn flush_store(&self) -> Result<(), StoreError> {
        self.inner.store.flush().await
    }

    pub fn is_started(&self) -> bool {
        *self.inner.started.borrow()
    }

    /// True once [`CsiServer::start`] has initialized every configured plugin: before, lists
    /// hold what is known so far.
    pub fn is_recovered(&self) -> bool {
        self.inner
            .recovered
            .load(std::sync::atomic::Ordering::Acquire)
    }

    /// Opens the start gate: loads every config and initializes every plugin, which recovers
    /// its volumes and starts reconciling them. Idempotent; returns true when it opened the
    /// gate now.
    pub async fn start(&self) -> bool {
        let opened = self.inner.started.send_if_modified(|started| {
            let was = *started;
            *started = true;
            !was
        });
        if opened {
            self.reload().await;
            self.clean_unconfigured_plugins().await;
            let types: Vec<String> = {
                let table = self.inner.table.lock().await;
                table.configs.plugins.keys().cloned().collect()
            };
            for plugin_type in types {
                if let Err(err) = self.plugin(&plugin_type).await {
                    tracing::error!(plugin = %plugin_type, error = %err, "plugin not initialized at start; retried on next use");
                }
            }
            self.inner
                .recovered
                .store(true, std::sync::atomic::Ordering::Release);
            if let Some(cluster) = &self.inner.cluster {
                // After the plugins registered: the first join releases what a fence took
                // and sweeps orphans for each of them.
                cluster.run();
            }
            if self.inner.options.start_plugins {
                self.launch_all_components().await;
            }
        }
        opened
    }

    /// `--start-plugins`: asks every initialized plugin for each service it serves, which
    /// launches its components now. Each waits in its own task: a plugin slow to start (or
    /// failing) delays no other, and its error shows on the plugin as for a lazy start.
    async fn launch_all_components(&self) {
        let plugins: Vec<Arc<Plugin>> = {
            let table = self.inner.table.lock().await;
            table.plugins.values().cloned().collect()
        };
        for plugin in plugins {
            for service in [Service::Controller, Service::Node] {
                if !config_serves(plugin.config(), service) {
                    continue;
                }
                let manager = plugin.endpoints.manager();
                let plugin_type = plugin.config().plugin_type.clone();
                tokio::spawn(async move {
                    match manager.endpoint(service).await {
                        Ok(_) => {
                            tracing::info!(plugin = %plugin_type, %service, "started at start-up (--start-plugins)")
                        }
                        Err(err) => {
                            tracing::warn!(plugin = %plugin_type, %service, error = %err, "not started at start-up (--start-plugins); retried on first use")
                        }
                    }
                });
            }
        }
    }

    /// `(type, name)` of every configured plugin.
    async fn configured_plugins(&self) -> Vec<(String, String)> {
        let table = self.inner.table.lock().await;
        table
            .configs
            .plugins
            .values()
            .map(|l| (l.config.plugin_type.clone(), l.config.name.clone()))
            .collect()
    }

    /// Components left running by an earlier csi-agent for plugins that are no longer
    /// configured: stopped and cleaned when none of their volumes is known, else kept (a node
    /// plugin must outlive its volumes) and reported.
    async fn clean_unconfigured_plugins(&self) {
        let Ok(found) = crate::service_manager::plugins_with_components(&self.inner.layout) else {
            return;
        };
        let configured = self.configured_plugins().await;
        for (plugin_type, plugin_name) in found {
            if configured.contains(&(plugin_type.clone(), plugin_name.clone())) {
                continue;
            }
            let volumes = self.inner.layout.volumes_dir(&plugin_type, &plugin_name);
            let has_volumes = std::fs::read_dir(&volumes)
                .map(|mut entries| entries.next().is_some())
                .unwrap_or(false);
            if has_volumes {
                tracing::warn!(plugin = %plugin_type, name = %plugin_name, "plugin no longer configured but has volumes; its components are left running — restore its config to unpublish them");
                continue;
            }
            match crate::service_manager::remove_components(
                &self.inner.layout,
                &plugin_type,
                &plugin_name,
                std::time::Duration::from_secs(10),
                &self.manager_options().runtime_options(),
            )
            .await
            {
                Ok(stopped) => {
                    tracing::info!(plugin = %plugin_type, stopped, "components of a removed plugin stopped and cleaned")
                }
                Err(err) => {
                    tracing::error!(plugin = %plugin_type, error = %err, "components of a removed plugin not cleaned")
                }
            }
        }
    }

    /// Waits until the gate is open.
    pub async fn wait_started(&self) {
        let mut rx = self.inner.started.subscribe();
        // The sender lives in `self`, so this cannot fail while we wait.
        let _ = rx.wait_for(|started| *started).await;
    }

    /// True once the node was drained ([`CsiServer::drain`]).
    pub fn is_drained(&self) -> bool {
        self.inner
            .drained
            .load(std::sync::atomic::Ordering::Acquire)
    }

    /// Refuses an operation that would claim a volume or start a plugin on a drained node.
    pub fn refuse_if_drained(&self) -> Result<(), ServerError> {
        if self.is_drained() {
            return Err(ServerError::Drained);
        }
        Ok(())
    }

    /// Stops the node (`csictl drain`, docs/operations.md "Draining a node"), as a barrier:
    ///
    /// 1. closes the door: from now on no volume operation starts (503 "draining") and no
    ///    plugin is started;
    /// 2. waits (up to `timeout`) for every operation in flight to end;
    /// 3. unpublishes every claim and drives every volume left in a transient state down,
    ///    through the usual durable steps (again up to `timeout`; what is still running then
    ///    goes on, counted, and a later drain waits for it);
    /// 4. reads the mount table and the records: what of csi-agent's is still there is
    ///    reported in `left`, with why;
    /// 5. stops each plugin that nothing is left of (no mount, no record in use, no operation).
    ///
    /// Never reports success with anything left: a drain that timed out or failed leaves the
    /// node in a state that a later drain goes on from.
    pub async fn drain(&self, timeout: Duration) -> DrainReport {
        let _one_drain = self.inner.drain_lock.lock().await;
        self.inner
            .drained
            .store(true, std::sync::atomic::Ordering::Release);
        self.inner.gate.close();
        self.wait_started().await;
        let mut report = DrainReport::default();

        let busy = self.wait_in_flight(timeout).await;
        let plugins = self.plugins_to_drain().await;
        // Every workload bind of every record, before the claims (and their entries) go: the
        // mount table is checked at these paths afterwards.
        let (binds, tasks) = start_volume_drains(&plugins, &busy);
        collect_volume_drains(tasks, timeout, &mut report).await;

        report.left = match self.left_after_drain(&plugins, &binds).await {
            Ok(left) => left,
            Err(err) => vec![DrainLeft {
                plugin: String::new(),
                volume_id: String::new(),
                path: None,
                reason: format!(
                    "the mount table could not be read, so nothing is confirmed unmounted: {err}"
                ),
            }],
        };

        self.stop_drained_plugins(&plugins, &mut report).await;
        log_drain_report(&report);
        report
    }

    /// Drain step 2: waits up to `timeout` for the operations in flight to end. Returns
    /// those still running then (their volumes are left for a later drain).
    async fn wait_in_flight(&self, timeout: Duration) -> Vec<InFlight> {
        let waiting = Instant::now();
        let busy = self
            .inner
            .gate
            .wait_idle(waiting + timeout, DRAIN_PROGRESS_EVERY, |running| {
                let first = running.first().map(ToString::to_string).unwrap_or_default();
                tracing::info!(in_flight = running.len(), oldest = %first, "drain: waiting for operations in flight");
            })
            .await;
        if busy.is_empty() {
            tracing::info!(
                waited_ms = waiting.elapsed().as_millis() as u64,
                "drain: no operation in flight; unpublishing every claim"
            );
        } else {
            tracing::warn!(
                in_flight = busy.len(),
                timeout_s = timeout.as_secs_f64(),
                "drain: operations still in flight at the timeout; the volumes they hold are left for a later drain"
            );
        }
        busy
    }

    /// The plugins the drain reaches: every configured one that is initialized.
    async fn plugins_to_drain(&self) -> Vec<(String, Arc<Plugin>)> {
        let types: Vec<String> = {
            let table = self.inner.table.lock().await;
            table.configs.plugins.keys().cloned().collect()
        };
        let mut plugins: Vec<(String, Arc<Plugin>)> = Vec::new();
        for plugin_type in types {
            // Not `plugin()`: the drain itself must reach the plugins that hold claims.
            match self.plugin_unchecked(&plugin_type).await {
                Ok(plugin) => plugins.push((plugin_type, plugin)),
                Err(err) => {
                    tracing::warn!(plugin = %plugin_type, error = %err, "drain: plugin not initialized; nothing of it to release");
                }
            }
        }
        plugins
    }

    /// Drain step 5: stops each plugin that nothing is left of, once per daemon; a plugin
    /// that does not stop cleanly is a failure in `report`.
    async fn stop_drained_plugins(
        &self,
        plugins: &[(String, Arc<Plugin>)],
        report: &mut DrainReport,
    ) {
        for (plugin_type, plugin) in plugins {
            if report.left.iter().any(|l| &l.plugin == plugin_type)
                || report
                    .failed
                    .iter()
                    .any(|failure| &failure.plugin == plugin_type)
            {
                tracing::warn!(plugin = %plugin_type, "drain: plugin kept running: something it serves is left");
                continue;
            }
            if !lock_std(&self.inner.drain_stopped).insert(plugin_type.clone()) {
                continue;
            }
            match plugin.endpoints.manager().stop().await {
                Ok(()) => report.stopped.push(plugin_type.clone()),
                Err(err) => {
                    tracing::error!(plugin = %plugin_type, error = %err, "drain: plugin not stopped cleanly");
                    report.failed.push(DrainFailure {
                        plugin: plugin_type.clone(),
                        volume_id: String::new(),
                        workload: String::new(),
                        error: format!("components not stopped: {err}"),
                    });
                }
            }
        }
    }

    /// What of csi-agent's is still on the node: operations in flight, records not at rest,
    /// and mounts beneath each plugin's mounts root or at a workload's bind path (from the
    /// mount table, not from the records).
    async fn left_after_drain(
        &self,
        plugins: &[(String, Arc<Plugin>)],
        binds: &[(String, String, PathBuf)],
    ) -> Result<Vec<DrainLeft>, crate::mounts::MountError> {
        let mut left = Vec::new();
        for op in self.inner.gate.running() {
            let detail = plugins
                .iter()
                .find(|(t, _)| *t == op.plugin)
                .and_then(|(_, p)| p.volumes.progress(&op.volume_id))
                .map(|p| format!(": {}", describe_progress(&p)))
                .unwrap_or_default();
            left.push(DrainLeft {
                plugin: op.plugin.clone(),
                volume_id: op.volume_id.clone(),
                path: None,
                reason: format!("{op} (still in flight){detail}"),
            });
        }
        let table = crate::sys::blocking("read mountinfo", MountTable::read)?;
        for (plugin_type, plugin) in plugins {
            let root = plugin.volumes.mounts_root();
            let record_of = |volume_id: &str| {
                plugin
                    .volumes
                    .snapshot_of(volume_id)
                    .map(|r| describe_record(&r))
                    .unwrap_or_else(|| "it has no volume record".to_owned())
            };
            for mount in table.mounts_under(&root) {
                // The mounts root itself is the runtime's shared mount for its containers.
                let Ok(rest) = mount.mount_point.strip_prefix(&root) else {
                    continue;
                };
                let Some(first) = rest.components().next() else {
                    continue;
                };
                let volume_id = crate::layout::decode_id(&first.as_os_str().to_string_lossy())
                    .unwrap_or_default();
                left.push(DrainLeft {
                    plugin: plugin_type.clone(),
                    reason: format!("still mounted; {}", record_of(&volume_id)),
                    volume_id,
                    path: Some(mount.mount_point.clone()),
                });
            }
            for (bind_type, volume_id, path) in binds {
                if bind_type != plugin_type {
                    continue;
                }
                for mount in table.mounts_under(path) {
                    left.push(DrainLeft {
                        plugin: plugin_type.clone(),
                        volume_id: volume_id.clone(),
                        path: Some(mount.mount_point.clone()),
                        reason: format!(
                            "a workload's bind_to still mounted; {}",
                            record_of(volume_id)
                        ),
                    });
                }
            }
            for record in plugin.volumes.list_snapshot() {
                if at_rest(&record) {
                    continue;
                }
                if left
                    .iter()
                    .any(|l| &l.plugin == plugin_type && l.volume_id == record.volume_id)
                {
                    continue;
                }
                left.push(DrainLeft {
                    plugin: plugin_type.clone(),
                    volume_id: record.volume_id.clone(),
                    path: None,
                    reason: describe_record(&record),
                });
            }
        }
        left.sort_by(|a, b| {
            (&a.plugin, &a.volume_id, &a.path).cmp(&(&b.plugin, &b.volume_id, &b.path))
        });
        left.dedup();
        Ok(left)
    }

    /// The plugin of `plugin_type`, initialized on first use. Waits for the gate. On a drained
    /// node only a plugin still loaded (one whose claims could not all be released) is given.
    pub async fn plugin(&self, plugin_type: &str) -> Result<Arc<Plugin>, ServerError> {
        if self.is_drained() {
            let table = self.inner.table.lock().await;
            return table
                .plugins
                .get(plugin_type)
                .cloned()
                .ok_or(ServerError::Drained);
        }
        self.plugin_unchecked(plugin_type).await
    }

    async fn plugin_unchecked(&self, plugin_type: &str) -> Result<Arc<Plugin>, ServerError> {
        self.wait_started().await;
        let (loaded, init_lock) = {
            let mut table = self.inner.table.lock().await;
            if let Some(plugin) = table.plugins.get(plugin_type) {
                return Ok(plugin.clone());
            }
            if !table.configs.plugins.contains_key(plugin_type) {
                // Configs added at run time work without a reload.
                drop(table);
                self.reload().await;
                table = self.inner.table.lock().await;
                if let Some(plugin) = table.plugins.get(plugin_type) {
                    return Ok(plugin.clone());
                }
            }
            let Some(loaded) = table.configs.plugins.get(plugin_type).cloned() else {
                return Err(self.unknown_plugin(&table, plugin_type));
            };
            let init_lock = table
                .init_locks
                .entry(plugin_type.to_owned())
                .or_default()
                .clone();
            (loaded, init_lock)
        };
        let _initializing = init_lock.lock().await;
        // Another caller may have finished while this one waited for the lock.
        if let Some(plugin) = self.plugin_if_loaded(plugin_type).await {
            return Ok(plugin);
        }
        let initialized = self.init_plugin(loaded.clone()).await;
        let mut table = self.inner.table.lock().await;
        match initialized {
            Ok(plugin) => {
                table.init_errors.remove(plugin_type);
                if table.configs.plugins.get(plugin_type) == Some(&loaded) {
                    table.plugins.insert(plugin_type.to_owned(), plugin.clone());
                }
                // Else a reload changed or removed the config meanwhile: this caller gets
                // the plugin it asked for, the next one starts from the current config.
                Ok(plugin)
            }
            Err(err) => {
                table
                    .init_errors
                    .insert(plugin_type.to_owned(), err.to_string());
                Err(err)
            }
        }
    }

    fn unknown_plugin(&self, table: &Table, plugin_type: &str) -> ServerError {
        let hint = match table
            .config_error_files
            .iter()
            .find(|(_, message)| message.contains(&format!("\"{plugin_type}\"")))
        {
            Some((file, message)) => format!("{} failed to load: {message}", file.display()),
            None => match &self.inner.options.plugin_config_dir {
                Some(dir) => format!(
                    "no config in {} declares it; add a <file>.json with \"type\": \"{plugin_type}\"",
                    dir.display()
                ),
                None => "the daemon runs without --plugin-config-dir".to_owned(),
            },
        };
        ServerError::UnknownPlugin {
            plugin_type: plugin_type.to_owned(),
            hint,
        }
    }

    async fn init_plugin(&self, loaded: LoadedConfig) -> Result<Arc<Plugin>, ServerError> {
        let config = &loaded.config;
        let init_err = |message: String| ServerError::PluginInit {
            plugin_type: config.plugin_type.clone(),
            message,
        };
        let manager = ServiceManager::new(config.clone(), self.manager_options())
            .await
            .map_err(|e| init_err(e.to_string()))?;
        let endpoints = Arc::new(ManagedEndpoints::new(Arc::new(manager)));
        let volumes = VolumeManager::new(
            self.volume_config(config),
            endpoints.clone(),
            NodeContext {
                layout: self.inner.layout.clone(),
                store: self.inner.store.clone(),
                boot_id: self.inner.options.boot_id.clone(),
                metrics: Some(self.inner.metrics.clone()),
                binder: self.inner.binder.clone(),
                gate: self.inner.gate.clone(),
                claim_limits: self.inner.options.claim_limits,
            },
        );
        let recovery = volumes
            .recover()
            .await
            .map_err(|e| init_err(format!("recovering its volumes failed: {e}")))?;
        let cluster_volumes = match (&self.inner.cluster, config.cluster) {
            (Some(cluster), true) => {
                let handle = crate::volume::cluster::ClusterVolumes::handle(volumes.clone());
                cluster.register(&handle);
                Some(handle)
            }
            _ => None,
        };
        Ok(Arc::new(Plugin {
            loaded,
            endpoints,
            volumes,
            recovery,
            cluster_volumes,
        }))
    }

    fn manager_options(&self) -> ManagerOptions {
        ManagerOptions {
            layout: self.inner.layout.clone(),
            node_id: self.inner.options.node_id.clone(),
            socket_root: self.inner.options.socket_root.clone(),
            metrics: self.inner.metrics.clone(),
            oci_runtime: self.inner.options.oci_runtime.clone(),
            images: self.inner.images.clone(),
            fetch: self.inner.options.fetch.clone(),
            secret_dir: self.inner.options.secret_dir.clone(),
        }
    }

    fn volume_config(&self, config: &PluginConfig) -> VolumeConfig {
        let mut volume_config = VolumeConfig::new(&config.plugin_type, &config.name);
        volume_config.target_path_exists = config.target_path_exists;
        volume_config.target_path_root = config.target_path_root.clone();
        volume_config.node_id = config.node_id.clone();
        if config.cluster {
            volume_config.cluster = self.inner.cluster.clone();
        }
        volume_config
    }

    /// Re-reads the config dir: added plugins become usable, changed ones get new components
    /// (their volumes stay), removed ones stop once none of their volumes is in use.
    pub async fn reload(&self) -> (ConfigDiff, Vec<(PathBuf, String)>) {
        // One reload at a time; the table itself is locked only for the bookkeeping, never
        // across a component's stop grace (issue #11: a reload must not stall status reads or
        // other plugins' operations).
        let _reloading = self.inner.reload_lock.lock().await;
        let report = match &self.inner.options.plugin_config_dir {
            Some(dir) => config::load_dir(dir, Some(&self.inner.metrics)),
            None => config::LoadReport::default(),
        };
        let errors: Vec<(PathBuf, String)> = report
            .errors
            .iter()
            .map(|e: &ConfigError| (e.file().to_path_buf(), e.to_string()))
            .collect();
        for (_, message) in &errors {
            tracing::error!(%message, "plugin config skipped");
        }
        // Under the lock, no slow await: the new configs, the plugins to replace or stop.
        let mut to_replace: Vec<(String, Arc<Plugin>, LoadedConfig)> = Vec::new();
        let mut to_stop: Vec<(String, Arc<Plugin>)> = Vec::new();
        let diff = {
            let mut table = self.inner.table.lock().await;
            let diff = ConfigDiff::between(&table.configs, &report);
            let mut next = report.set.clone();
            // A file that failed this time keeps its plugin on the old configuration.
            for plugin_type in &diff.kept_on_error {
                if let Some(old) = table.configs.plugins.get(plugin_type) {
                    next.plugins.insert(plugin_type.clone(), old.clone());
                }
            }
            for plugin_type in &diff.changed {
                let Some(plugin) = table.plugins.get(plugin_type).cloned() else {
                    continue;
                };
                let Some(loaded) = next.plugins.get(plugin_type).cloned() else {
                    continue;
                };
                if plugin.config().name != loaded.config.name {
                    // A renamed plugin lives in another directory: set it up afresh.
                    table.plugins.remove(plugin_type);
                    continue;
                }
                to_replace.push((plugin_type.clone(), plugin, loaded));
            }
            for plugin_type in &diff.removed {
                let Some(plugin) = table.plugins.get(plugin_type).cloned() else {
                    continue;
                };
                // From the read snapshot: never waits for an operation in progress.
                let in_use = plugin.volumes.list().await.iter().any(|v| {
                    !v.claims.is_empty() || v.state != crate::volume::VolumeState::Created
                });
                if in_use {
                    // A node plugin must outlive its volumes (nomad#11614): keep it configured
                    // until they are unpublished.
                    tracing::warn!(plugin = %plugin_type, "plugin config removed but volumes are in use; it keeps running until they are unpublished");
                    if let Some(old) = table.configs.plugins.get(plugin_type) {
                        next.plugins.insert(plugin_type.clone(), old.clone());
                    }
                    continue;
                }
                table.plugins.remove(plugin_type);
                to_stop.push((plugin_type.clone(), plugin));
            }
            table.configs = next;
            table.config_errors = errors.iter().map(|(_, m)| m.clone()).collect();
            table.config_error_files = errors.clone();
            diff
        };
        if self.is_drained() && !(to_replace.is_empty() && to_stop.is_empty()) {
            // A drained node starts no component (and a drain stops them itself).
            tracing::warn!(
                "the node is drained: changed or removed plugins keep their components until csi-agentd is restarted"
            );
            to_replace.clear();
            to_stop.clear();
        }
        // Unlocked: the slow part. A changed plugin stays in the table on its old manager
        // (same volumes) until its replacement is ready.
        for (plugin_type, plugin, loaded) in to_replace {
            // Ordered after the RPC attempts in flight to this plugin, and before the next
            // ones: no attempt straddles the swap, and every step after it asks the new
            // components for their capabilities (issue #24, M5; docs/reliability.md).
            let paused = plugin.volumes.pause_steps().await;
            // The old manager's supervision must stop before the new one looks at the
            // components: otherwise the old one relaunches what the new one kills.
            let replaced = plugin
                .endpoints
                .manager()
                .replace_with(loaded.config.clone())
                .await;
            match replaced {
                Ok(manager) => {
                    let old = plugin.endpoints.replace(Arc::new(manager));
                    drop(old);
                    plugin.volumes.forget_capabilities();
                    drop(paused);
                    let updated = Arc::new(Plugin {
                        loaded,
                        endpoints: plugin.endpoints.clone(),
                        volumes: plugin.volumes.clone(),
                        recovery: plugin.recovery.clone(),
                        // The volume manager (and its `cluster` setting) stays: changing
                        // `cluster` takes a restart (docs/cluster.md).
                        cluster_volumes: plugin.cluster_volumes.clone(),
                    });
                    let mut table = self.inner.table.lock().await;
                    // Only over the entry this reload replaced (the reload lock keeps other
                    // reloads out; a drain may have removed it meanwhile).
                    if table
                        .plugins
                        .get(&plugin_type)
                        .is_some_and(|current| Arc::ptr_eq(current, &plugin))
                    {
                        table.plugins.insert(plugin_type.clone(), updated);
                    }
                    tracing::info!(plugin = %plugin_type, "plugin configuration changed; components replaced");
                }
                Err(err) => {
                    drop(paused);
                    tracing::error!(plugin = %plugin_type, error = %err, "changed plugin not restarted");
                }
            }
        }
        for (plugin_type, plugin) in to_stop {
            if let Err(err) = plugin.endpoints.manager().stop().await {
                tracing::error!(plugin = %plugin_type, error = %err, "removed plugin not stopped cleanly");
            }
        }
        (diff, errors)
    }

    /// Every configured plugin, with its state.
    pub async fn plugins(&self) -> (Vec<PluginReport>, Vec<(PathBuf, String)>) {
        let table = self.inner.table.lock().await;
        let reports = table
            .configs
            .plugins
            .iter()
            .map(|(plugin_type, loaded)| PluginReport {
                loaded: loaded.clone(),
                plugin: table.plugins.get(plugin_type).cloned(),
                error: table.init_errors.get(plugin_type).cloned(),
            })
            .collect();
        (reports, table.config_error_files.clone())
    }

    /// The image store (`None` when it could not be opened; the daemon's log says why).
    pub fn images(&self) -> Option<&Arc<crate::image::store::ImageStore>> {
        self.inner.images.as_ref()
    }

    /// Removes the images no configured plugin names (`POST /v1/images/prune`, docs/operations.md
    /// "Image store"): their index entries, root file systems and the blobs no kept image
    /// names. Holds the reload lock, so no reload adds a user or stops one meanwhile; refuses
    /// while components of unconfigured plugins remain (an earlier csi-agent's, kept for their
    /// volumes), whose containers may run on an image no config names.
    pub async fn prune_images(&self) -> Result<crate::image::store::Pruned, ServerError> {
        let Some(store) = self.inner.images.clone() else {
            return Err(ServerError::ImagesUnavailable);
        };
        let _reloading = self.inner.reload_lock.lock().await;
        let configured = self.configured_plugins().await;
        let found = crate::service_manager::plugins_with_components(&self.inner.layout).map_err(
            |source| ServerError::ListComponents {
                path: self.inner.layout.csi_root(),
                source,
            },
        )?;
        let leftovers: Vec<String> = found
            .into_iter()
            .filter(|found| !configured.contains(found))
            .map(|(plugin_type, name)| format!("{plugin_type} ({name})"))
            .collect();
        if !leftovers.is_empty() {
            return Err(ServerError::PruneUnsafe { plugins: leftovers });
        }
        let used: std::collections::BTreeSet<String> =
            self.image_users().await.into_keys().collect();
        let pruned = store.prune(&used).await?;
        tracing::info!(removed = ?pruned.references, rootfs = pruned.rootfs, layers = pruned.layers, blobs = pruned.blobs, "images pruned");
        Ok(pruned)
    }

    /// Resolved image reference → the types of the configured plugins whose components name
    /// it (what `GET /v1/images` shows as `used_by`).
    pub async fn image_users(&self) -> BTreeMap<String, Vec<String>> {
        let mut users: BTreeMap<String, Vec<String>> = BTreeMap::new();
        let Some(store) = &self.inner.images else {
            return users;
        };
        let table = self.inner.table.lock().await;
        for (plugin_type, loaded) in &table.configs.plugins {
            let config::Deployment::Managed(components) = &loaded.config.deployment else {
                continue;
            };
            for component in components {
                let image = component.container.as_ref().and_then(|c| {
                    crate::image::reference::ContainerImage::from_container(c)
                        .ok()
                        .flatten()
                });
                if let Some(reference) = image.and_then(|i| store.resolve(&i.name).ok()) {
                    let types = users.entry(reference.to_string()).or_default();
                    if !types.contains(plugin_type) {
                        types.push(plugin_type.clone());
                    }
                }
            }
        }
        users
    }

    /// The plugin if it is initialized, without initializing it or waiting for the gate.
    pub async fn plugin_if_loaded(&self, plugin_type: &str) -> Option<Arc<Plugin>> {
        self.inner
            .table
            .lock()
            .await
            .plugins
            .get(plugin_type)
            .cloned()
    }

    /// Reads the configs once at startup without opening the gate (for `GET /v1/plugins`).
    pub async fn load_configs(&self) {
        let mut table = self.inner.table.lock().await;
        if !table.configs.plugins.is_empty() {
            return;
        }
        let report = match &self.inner.options.plugin_config_dir {
            Some(dir) => config::load_dir(dir, Some(&self.inner.metrics)),
            None => config::LoadReport::default(),
        };
        let errors: Vec<(PathBuf, String)> = report
            .errors
            .iter()
            .map(|e| (e.file().to_path_buf(), e.to_string()))
            .collect();
        table.configs = report.set;
        table.config_errors = errors.iter().map(|(_, m)| m.clone()).collect();
        table.config_error_files = errors;
    }
}

/// The drain's unpublish tasks, one per volume: what each released and what failed.
type VolumeDrains = futures::stream::FuturesUnordered<
    tokio::task::JoinHandle<(Vec<DrainedClaim>, Vec<DrainFailure>)>,
>;

/// Drain step 3, begun: one task per volume not at rest and not held by an operation still
/// in flight, unpublishing its claims. Returns every workload bind of every record (the
/// mount table is checked at these paths afterwards) and the tasks.
fn start_volume_drains(
    plugins: &[(String, Arc<Plugin>)],
    busy: &[InFlight],
) -> (Vec<(String, String, PathBuf)>, VolumeDrains) {
    let mut binds: Vec<(String, String, PathBuf)> = Vec::new();
    let tasks = futures::stream::FuturesUnordered::new();
    for (plugin_type, plugin) in plugins {
        for record in plugin.volumes.list_snapshot() {
            for bind in record.bind_mounts.values() {
                binds.push((
                    plugin_type.clone(),
                    record.volume_id.clone(),
                    bind.path.clone(),
                ));
            }
            if at_rest(&record) {
                continue;
            }
            if busy
                .iter()
                .any(|op| &op.plugin == plugin_type && op.volume_id == record.volume_id)
            {
                // Its operation holds the volume's lock: reported below, not waited for.
                continue;
            }
            let volumes = plugin.volumes.clone();
            let plugin_type = plugin_type.clone();
            let claims: Vec<String> = record.claims.iter().cloned().collect();
            let volume_id = record.volume_id.clone();
            // Its own task: one that outlives the timeout keeps running (and counted on
            // the gate) instead of being cut off between an RPC and its record.
            tasks.push(tokio::spawn(async move {
                drain_volume(&volumes, &plugin_type, &volume_id, claims).await
            }));
        }
    }
    (binds, tasks)
}

/// Drain step 3, ended: gathers what the volumes' tasks released and failed into `report`,
/// waiting up to `timeout`. Dropping the handles detaches the tasks still running then: they
/// finish on their own (and stay counted on the gate).
async fn collect_volume_drains(
    mut tasks: VolumeDrains,
    timeout: Duration,
    report: &mut DrainReport,
) {
    let unpublishing = Instant::now() + timeout;
    loop {
        match tokio::time::timeout_at(unpublishing.into(), futures::StreamExt::next(&mut tasks))
            .await
        {
            Ok(Some(Ok((released, failed)))) => {
                report.released.extend(released);
                report.failed.extend(failed);
            }
            Ok(Some(Err(join))) => {
                tracing::error!(error = %join, "drain: a volume's unpublish task failed");
            }
            Ok(None) => break,
            Err(_) => {
                tracing::warn!(
                    running = tasks.len(),
                    "drain: unpublishes still running at the timeout; a later drain waits for them"
                );
                break;
            }
        }
    }
    drop(tasks);
}

/// The drain's last word in the log: drained, or what is left and why.
fn log_drain_report(report: &DrainReport) {
    if report.is_complete() {
        tracing::info!(
            released = report.released.len(),
            stopped = report.stopped.len(),
            "node drained: nothing of csi-agent's is mounted"
        );
    } else {
        for left in &report.left {
            tracing::warn!(plugin = %left.plugin, volume_id = ?left.volume_id, path = ?left.path, reason = %left.reason, "drain: left on the node");
        }
        tracing::warn!(
            released = report.released.len(),
            failed = report.failed.len(),
            left = report.left.len(),
            "drain incomplete: drain again once the causes are fixed"
        );
    }
}

/// Unpublishes every claim of one volume for the drain, then drives it down if no claim wants
/// it but it is not at rest (a step that failed earlier). Returns the claims released and
/// those not, with why.
async fn drain_volume(
    volumes: &VolumeManager,
    plugin_type: &str,
    volume_id: &str,
    claims: Vec<String>,
) -> (Vec<DrainedClaim>, Vec<DrainFailure>) {
    let mut released = Vec::new();
    let mut failed = Vec::new();
    for workload in claims {
        match volumes.drain_unpublish(volume_id, &workload).await {
            Ok(()) => released.push(DrainedClaim {
                plugin: plugin_type.to_owned(),
                volume_id: volume_id.to_owned(),
                workload,
            }),
            Err(err) => {
                tracing::error!(plugin = %plugin_type, volume_id = ?volume_id, workload = ?workload, error = %err, "drain: claim not released");
                failed.push(DrainFailure {
                    plugin: plugin_type.to_owned(),
                    volume_id: volume_id.to_owned(),
                    workload,
                    error: err.to_string(),
                });
            }
        }
    }
    let unwanted_but_busy = volumes
        .snapshot_of(volume_id)
        .is_some_and(|r| r.claims.is_empty() && !at_rest(&r));
    if unwanted_but_busy && let Err(err) = volumes.drain_reconcile(volume_id).await {
        // Reported with the record's state in the drain's `left`.
        tracing::error!(plugin = %plugin_type, volume_id = ?volume_id, error = %err, "drain: volume not driven down");
    }
    (released, failed)
}

/// True when a volume needs nothing more from a drain: no claim, and nothing done on the node
/// (a created volume's record stays, at rest).
fn at_rest(record: &crate::volume::VolumeRecord) -> bool {
    record.claims.is_empty() && record.state == VolumeState::Created
}

/// A record that is not at rest, for the drain's `left`.
fn describe_record(record: &crate::volume::VolumeRecord) -> String {
    let mut text = format!(
        "its record is in state {} with {} claim(s)",
        record.state.as_str(),
        record.claims.len()
    );
    if let Some(error) = &record.last_error {
        text.push_str(&format!("; last error: {error}"));
    }
    text
}

fn describe_progress(progress: &crate::volume::progress::Progress) -> String {
    let mut text = progress.operation.to_string();
    if let Some(step) = &progress.step {
        text.push_str(&format!(", step {step} attempt {}", progress.attempt));
    }
    if let Some(error) = &progress.last_error {
        text.push_str(&format!(", last error: {error}"));
    }
    text
}

fn lock_std<T>(mutex: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // A poisoned lock only means a panicking holder; the data is a plain value.
    mutex
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Builds the cluster handle from the flags and the node's recorded identity: the first
/// start in cluster mode records the names and a fresh instance id; a later start with other
/// names is refused (the claims in etcd are under the recorded ones).
fn open_cluster(
    setup: &ClusterSetup,
    store: &Store,
    metrics: &Arc<Metrics>,
) -> Result<crate::cluster::Cluster, ServerError> {
    let options = &setup.options;
    let recorded_cluster = store.meta(META_CLUSTER_NAME)?;
    let recorded_node = store.meta(META_CLUSTER_NODE)?;
    if let (Some(cluster), Some(node)) = (&recorded_cluster, &recorded_node)
        && (*cluster != options.name || *node != options.node)
    {
        return Err(ServerError::ClusterIdentity {
            recorded_cluster: cluster.clone(),
            recorded_node: node.clone(),
            cluster: options.name.clone(),
            node: options.node.clone(),
        });
    }
    let instance_id = match store.meta(META_CLUSTER_INSTANCE)? {
        Some(id) => id,
        None => {
            let id = crate::cluster::random_id();
            store.set_meta(META_CLUSTER_INSTANCE, &id)?;
            id
        }
    };
    store.set_meta(META_CLUSTER_NAME, &options.name)?;
    store.set_meta(META_CLUSTER_NODE, &options.node)?;
    let etcd_cluster_id = store
        .meta(META_ETCD_CLUSTER_ID)?
        .and_then(|id| u64::from_str_radix(&id, 16).ok());
    let remember = store.clone();
    Ok(crate::cluster::Cluster::new(
        options.clone(),
        setup.store.clone(),
        crate::cluster::Identity {
            instance_id,
            etcd_cluster_id,
        },
        Box::new(move |id| {
            remember
                .set_meta(META_ETCD_CLUSTER_ID, &format!("{id:x}"))
                .map_err(|e| e.to_string())
        }),
        Some(metrics.clone()),
    ))
}
