//! `csi-agentd serve`: flags and the optional TOML file, logging, listeners and signals.
//!
//! Shutdown (SIGTERM, SIGINT) stops serving and leaves plugins and mounts in place, so running
//! workloads keep their volumes; SIGHUP reloads the plugin configs.

use std::net::SocketAddr;
use std::num::{NonZeroU64, NonZeroUsize};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, bail};
use csi_agent::image::budget::ImageLimits;
use csi_agent::image::pull::PullLimits;
use csi_agent::image::reference::{Credentials, DOCKER_HUB, RegistrySettings, normalize_registry};
use csi_agent::metrics::Metrics;
use csi_agent::server::{CsiServer, ServerOptions};
use csi_agent::store::StoreOptions;
use csi_agent::volume::ClaimLimits;
use csi_agent::volume::stats::StatsOptions;
use serde::Deserialize;
use tokio::signal::unix::{SignalKind, signal};

use crate::api::{self, AppState};
use crate::cluster_flags::{self, ClusterArgs, ClusterFile, ClusterSettings};
use crate::listener::{self, Limits, Upload};

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum StartMode {
    /// Open the start gate at once.
    Immediate,
    /// Wait for `POST /v1/start` before launching plugins or making CSI calls.
    OnRequest,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    Human,
    Json,
}

/// Flags of `serve`; each may also come from the TOML file (flags win).
#[derive(Debug, clap::Args)]
pub struct ServeArgs {
    /// A TOML file with any of the settings below (same names, with underscores).
    #[arg(long)]
    config: Option<PathBuf>,
    /// Root of all durable state.
    #[arg(long)]
    work_dir: Option<PathBuf>,
    /// Directory of plugin configs: every non-hidden file, as JSON (Mesos `CSIPluginInfo`).
    #[arg(long)]
    plugin_config_dir: Option<PathBuf>,
    /// The API's unix socket (mode 0600). Default: `<work-dir>/api.sock`.
    #[arg(long)]
    api_socket: Option<PathBuf>,
    /// Also serve the Docker volume plugin protocol on this unix socket (mode 0600), for Docker
    /// and Podman (docs/docker-podman.md), e.g. `/run/docker/plugins/csi.sock`: the file's name
    /// without `.sock` is the driver's name for Docker. Off by default.
    #[arg(long)]
    volume_plugin_socket: Option<PathBuf>,
    /// Also listen on TCP at this address (requires --token-file; loopback only, unless
    /// --allow-insecure-listen).
    #[arg(long)]
    listen: Option<SocketAddr>,
    /// Allow --listen on a non-loopback address: plain HTTP, the token and secrets in the clear.
    #[arg(long)]
    allow_insecure_listen: bool,
    /// Open connections per listener; more are answered 503 and closed (default 1024).
    #[arg(long)]
    max_connections: Option<NonZeroUsize>,
    /// Close a connection whose request head is incomplete after this long (default 10000).
    #[arg(long)]
    header_timeout_ms: Option<NonZeroU64>,
    /// Close a connection idle (no request in flight, no traffic) this long (default 60000).
    #[arg(long)]
    idle_timeout_ms: Option<NonZeroU64>,
    /// Answer 408 to a request whose body is incomplete after this long (default 30000).
    #[arg(long)]
    body_timeout_ms: Option<NonZeroU64>,
    /// File holding the bearer token required on the TCP listener.
    #[arg(long)]
    token_file: Option<PathBuf>,
    /// When to open the start gate.
    #[arg(long, value_enum)]
    start: Option<StartMode>,
    /// Log format on stderr.
    #[arg(long, value_enum)]
    log_format: Option<LogFormat>,
    /// Node id given to plugins (default: the host name).
    #[arg(long)]
    node_id: Option<String>,
    /// Where the short socket dirs of managed plugins are created.
    #[arg(long)]
    socket_root: Option<PathBuf>,
    /// Read the boot id from this file instead of the kernel's (tests simulate a reboot).
    #[arg(long, hide = true)]
    boot_id_file: Option<PathBuf>,
    /// A dir beneath which a publish's `bind_to` may go (repeatable), e.g. the dir of the
    /// orchestrator's container sandboxes. None: `bind_to` is refused.
    #[arg(long = "bind-root", value_name = "DIR")]
    bind_roots: Vec<PathBuf>,
    /// Claims (workloads) one volume may have (default 256); bounded with
    /// --max-bind-to-bytes so that a volume's record can always be read back.
    #[arg(long)]
    max_claims_per_volume: Option<usize>,
    /// The longest `bind_to` accepted, in bytes (default and most 4095).
    #[arg(long)]
    max_bind_to_bytes: Option<usize>,
    /// The OCI runtime of plugins configured with `"runtime": {"kind": "oci"}`: runc (or
    /// crun), a path or a name looked up in PATH (default `runc`).
    #[arg(long)]
    oci_runtime: Option<PathBuf>,
    /// The directory of REFERENCE secrets of plugin configs: `<name>/<key>` files, owned by
    /// root, mode 0600 or stricter, read at each launch (default: none, such a plugin fails
    /// to launch).
    #[arg(long)]
    secret_dir: Option<PathBuf>,
    /// Launch every managed plugin when the daemon starts, instead of on first use.
    #[arg(long)]
    start_plugins: bool,
    /// Start once on a work dir whose `state.db` is missing or empty although the work dir
    /// shows earlier state (refused otherwise): start from an empty database, deleting
    /// nothing (docs/operations.md, "The state database vanished"). Command line only, so
    /// that it is never left in a config file; ignored, with a warning, when `state.db` is
    /// there.
    #[arg(long)]
    reinitialize_state: bool,
    /// The registry of plugin images named without a registry host (`busybox` is
    /// `<this>/library/busybox:latest`); `host[:port]` or an `https://` URL (default Docker
    /// Hub, `registry-1.docker.io`).
    #[arg(long)]
    docker_registry: Option<String>,
    /// A docker `config.json` with registry credentials (`auths`).
    #[arg(long)]
    docker_config: Option<PathBuf>,
    /// A registry (`HOST:PORT`) reached over plain HTTP instead of HTTPS (repeatable). Every
    /// other registry is HTTPS only.
    #[arg(long = "insecure-registry", value_name = "HOST:PORT")]
    insecure_registries: Vec<String>,
    /// The largest image archive `POST /v1/images/import` (`csictl image import`) takes, in
    /// bytes (default 8 GiB); larger is answered 413. Every other route keeps its 1 MiB limit.
    #[arg(long)]
    image_import_max_bytes: Option<NonZeroU64>,
    /// The most bytes preparing one plugin image may write, all its layers together (file
    /// data, symlink targets, directory metadata), checked while writing (default 8 GiB).
    #[arg(long)]
    image_max_unpacked_bytes: Option<NonZeroU64>,
    /// The most files, directories and links preparing one plugin image may make, all its
    /// layers together (default 1000000).
    #[arg(long)]
    image_max_inodes: Option<NonZeroU64>,
    /// The image store's quota (`<work_dir>/images`: blobs, unpacked layers, root file
    /// systems), in bytes: checked before an image is prepared and while it is written
    /// (default 32 GiB).
    #[arg(long)]
    image_store_max_bytes: Option<NonZeroU64>,
    /// The throughput floor of an image pull, per blob, in bytes per second averaged over
    /// `--image-pull-floor-window-secs` (default 10240); a blob under it fails the pull
    /// (retried like any slow registry). 0 turns it off, leaving only the 30 s stall bound.
    #[arg(long)]
    image_pull_min_bytes_per_sec: Option<u64>,
    /// The window of `--image-pull-min-bytes-per-sec`, in seconds (default 60).
    #[arg(long)]
    image_pull_floor_window_secs: Option<NonZeroU64>,
    /// The largest file a plugin's `command.uris` may fetch (a download, or a local file
    /// copied), in bytes (default 1 GiB); an archive may extract to 4 times this.
    #[arg(long)]
    fetch_max_bytes: Option<NonZeroU64>,
    /// The time one download of a plugin's `command.uris` may take in all, in seconds
    /// (default 600).
    #[arg(long)]
    fetch_timeout_secs: Option<NonZeroU64>,
    /// How long, in microseconds, a durable write waits for others to share its commit (one
    /// fsync) when they have been arriving closer together than this; 0 commits at once
    /// (default 1000, at most 100000). A lone operation never waits.
    #[arg(long)]
    commit_delay_us: Option<u64>,
    /// Threads running the daemon's async work: API requests, CSI calls, supervision
    /// (default 1, at most 64). Blocking system calls and the store's commits run on threads
    /// of their own whatever this is.
    #[arg(long)]
    worker_threads: Option<NonZeroUsize>,
    /// Time between rounds of NodeGetVolumeStats over a plugin's published volumes, before
    /// the kubelet's jitter (each wait is 1 to 2 times this): `60s` (default), `500ms`, `2m`,
    /// or seconds; `0` turns the collector off (the stats route still collects on demand).
    #[arg(long, value_name = "DURATION")]
    volume_stats_interval: Option<String>,
    /// NodeGetVolumeStats calls in flight at once, per plugin (default 4).
    #[arg(long)]
    volume_stats_concurrency: Option<NonZeroUsize>,
    /// Deadline of one NodeGetVolumeStats call (default `10s`; same forms as the interval).
    #[arg(long, value_name = "DURATION")]
    volume_stats_timeout: Option<String>,
    #[command(flatten)]
    cluster: ClusterArgs,
}

/// The TOML file: the same settings as the flags.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileSettings {
    work_dir: Option<PathBuf>,
    plugin_config_dir: Option<PathBuf>,
    api_socket: Option<PathBuf>,
    volume_plugin_socket: Option<PathBuf>,
    listen: Option<SocketAddr>,
    allow_insecure_listen: Option<bool>,
    max_connections: Option<NonZeroUsize>,
    header_timeout_ms: Option<NonZeroU64>,
    idle_timeout_ms: Option<NonZeroU64>,
    body_timeout_ms: Option<NonZeroU64>,
    token_file: Option<PathBuf>,
    start: Option<StartMode>,
    log_format: Option<LogFormat>,
    node_id: Option<String>,
    socket_root: Option<PathBuf>,
    #[serde(default)]
    bind_roots: Vec<PathBuf>,
    max_claims_per_volume: Option<usize>,
    max_bind_to_bytes: Option<usize>,
    oci_runtime: Option<PathBuf>,
    secret_dir: Option<PathBuf>,
    start_plugins: Option<bool>,
    docker_registry: Option<String>,
    docker_config: Option<PathBuf>,
    #[serde(default)]
    insecure_registries: Vec<String>,
    image_import_max_bytes: Option<NonZeroU64>,
    image_max_unpacked_bytes: Option<NonZeroU64>,
    image_max_inodes: Option<NonZeroU64>,
    image_store_max_bytes: Option<NonZeroU64>,
    image_pull_min_bytes_per_sec: Option<u64>,
    image_pull_floor_window_secs: Option<NonZeroU64>,
    fetch_max_bytes: Option<NonZeroU64>,
    fetch_timeout_secs: Option<NonZeroU64>,
    commit_delay_us: Option<u64>,
    worker_threads: Option<NonZeroUsize>,
    volume_stats_interval: Option<String>,
    volume_stats_concurrency: Option<NonZeroUsize>,
    volume_stats_timeout: Option<String>,
    cluster_etcd: Option<String>,
    cluster_name: Option<String>,
    node_name: Option<String>,
    cluster_lease_ttl_secs: Option<u64>,
    cluster_etcd_timeout_ms: Option<u64>,
    cluster_etcd_user: Option<String>,
    cluster_etcd_password_file: Option<PathBuf>,
    cluster_etcd_ca: Option<PathBuf>,
    cluster_etcd_cert: Option<PathBuf>,
    cluster_etcd_key: Option<PathBuf>,
}

/// The effective settings.
#[derive(Debug)]
pub struct Settings {
    pub work_dir: PathBuf,
    pub plugin_config_dir: Option<PathBuf>,
    pub api_socket: PathBuf,
    /// `--volume-plugin-socket`: where the Docker volume plugin protocol is served, if at all.
    pub volume_plugin_socket: Option<PathBuf>,
    pub listen: Option<SocketAddr>,
    pub limits: Limits,
    pub token_file: Option<PathBuf>,
    pub start: StartMode,
    pub log_format: LogFormat,
    pub node_id: String,
    pub socket_root: PathBuf,
    pub boot_id_file: PathBuf,
    pub bind_roots: Vec<PathBuf>,
    pub claim_limits: ClaimLimits,
    pub oci_runtime: PathBuf,
    pub secret_dir: Option<PathBuf>,
    pub start_plugins: bool,
    /// `--reinitialize-state`: start on vanished state from an empty database.
    pub reinitialize_state: bool,
    pub registry: RegistrySettings,
    /// Bounds on image pulls (the throughput floor from its flags, the rest defaults).
    pub pull_limits: PullLimits,
    pub store: StoreOptions,
    /// `--image-max-unpacked-bytes`, `--image-max-inodes`, `--image-store-max-bytes`.
    pub image_limits: ImageLimits,
    /// `--fetch-max-bytes`, `--fetch-timeout-secs`, the cache in the work dir.
    pub fetch: csi_agent::fetch::FetchOptions,
    /// The async runtime's worker threads (`--worker-threads`).
    pub worker_threads: NonZeroUsize,
    /// `--volume-stats-interval`, `--volume-stats-concurrency`, `--volume-stats-timeout`.
    pub volume_stats: StatsOptions,
    /// Cluster mode (`--cluster-etcd` and its companions), if on.
    pub cluster: Option<ClusterSettings>,
}

/// `--commit-delay-us`'s bound: a longer delay would only add latency (a commit takes about a
/// millisecond here; docs/benchmarks.md).
const MAX_COMMIT_DELAY_US: u64 = 100_000;

/// `--worker-threads`' bound. The daemon's async work is hand-offs between sockets, a few
/// tens of microseconds per request; more threads than this would only contend.
const MAX_WORKER_THREADS: usize = 64;

/// `--image-import-max-bytes`'s default: 8 GiB, the pull's bound on an image's layers.
pub const DEFAULT_IMAGE_IMPORT_MAX_BYTES: u64 = 8 << 30;

pub fn settings(args: ServeArgs) -> anyhow::Result<Settings> {
    let file = config_file(args.config.as_deref())?;
    let work_dir = args
        .work_dir
        .or(file.work_dir)
        .unwrap_or_else(|| PathBuf::from("/var/lib/csi-agent"));
    let work_dir = absolute(&work_dir)?;
    let api_socket = args
        .api_socket
        .or(file.api_socket)
        .unwrap_or_else(|| work_dir.join("api.sock"));
    let listen = args.listen.or(file.listen);
    let token_file = args.token_file.or(file.token_file);
    if listen.is_some() && token_file.is_none() {
        bail!(
            "--listen needs --token-file: the TCP listener only serves requests with the bearer token"
        );
    }
    if let Some(addr) = listen {
        let allow = args.allow_insecure_listen || file.allow_insecure_listen == Some(true);
        listener::check_listen_address(addr, allow)?;
    }
    let host_name = rustix::system::uname()
        .nodename()
        .to_string_lossy()
        .into_owned();
    let node_id = args.node_id.or(file.node_id).unwrap_or(host_name.clone());
    let cluster = cluster_flags::settings(
        args.cluster,
        ClusterFile {
            cluster_etcd: file.cluster_etcd,
            cluster_name: file.cluster_name,
            node_name: file.node_name,
            cluster_lease_ttl_secs: file.cluster_lease_ttl_secs,
            cluster_etcd_timeout_ms: file.cluster_etcd_timeout_ms,
            cluster_etcd_user: file.cluster_etcd_user,
            cluster_etcd_password_file: file.cluster_etcd_password_file,
            cluster_etcd_ca: file.cluster_etcd_ca,
            cluster_etcd_cert: file.cluster_etcd_cert,
            cluster_etcd_key: file.cluster_etcd_key,
        },
        &host_name,
    )?;
    let bind_roots = if args.bind_roots.is_empty() {
        file.bind_roots
    } else {
        args.bind_roots
    };
    let bind_roots = bind_roots
        .iter()
        .map(|root| bind_root(root, &work_dir))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let insecure = if args.insecure_registries.is_empty() {
        file.insecure_registries
    } else {
        args.insecure_registries
    };
    let registry = registry_settings(
        args.docker_registry.or(file.docker_registry),
        &insecure,
        args.docker_config.or(file.docker_config),
    )?;
    let pull_limits = pull_limits(
        args.image_pull_min_bytes_per_sec
            .or(file.image_pull_min_bytes_per_sec),
        args.image_pull_floor_window_secs
            .or(file.image_pull_floor_window_secs),
    );
    let store = store_options(args.commit_delay_us.or(file.commit_delay_us))?;
    let worker_threads = worker_threads(args.worker_threads.or(file.worker_threads))?;
    let image_limits = image_limits(
        args.image_max_unpacked_bytes
            .or(file.image_max_unpacked_bytes),
        args.image_max_inodes.or(file.image_max_inodes),
        args.image_store_max_bytes.or(file.image_store_max_bytes),
    );
    let fetch = fetch_options(
        &work_dir,
        args.fetch_max_bytes.or(file.fetch_max_bytes),
        args.fetch_timeout_secs.or(file.fetch_timeout_secs),
    );
    let claim_limits = ClaimLimits::new(
        args.max_claims_per_volume.or(file.max_claims_per_volume),
        args.max_bind_to_bytes.or(file.max_bind_to_bytes),
    )?;
    let volume_stats = stats_options(
        args.volume_stats_interval
            .as_deref()
            .or(file.volume_stats_interval.as_deref()),
        args.volume_stats_concurrency
            .or(file.volume_stats_concurrency),
        args.volume_stats_timeout
            .as_deref()
            .or(file.volume_stats_timeout.as_deref()),
    )?;
    Ok(Settings {
        cluster,
        volume_stats,
        fetch,
        claim_limits,
        store,
        image_limits,
        worker_threads,
        start_plugins: args.start_plugins || file.start_plugins == Some(true),
        reinitialize_state: args.reinitialize_state,
        registry,
        pull_limits,
        bind_roots,
        secret_dir: args
            .secret_dir
            .or(file.secret_dir)
            .map(|d| absolute(&d))
            .transpose()?,
        oci_runtime: args
            .oci_runtime
            .or(file.oci_runtime)
            .unwrap_or_else(|| PathBuf::from(csi_agent::runtime::oci::DEFAULT_OCI_RUNTIME)),
        work_dir,
        plugin_config_dir: args
            .plugin_config_dir
            .or(file.plugin_config_dir)
            .map(|d| absolute(&d))
            .transpose()?,
        api_socket,
        volume_plugin_socket: args
            .volume_plugin_socket
            .or(file.volume_plugin_socket)
            .map(|p| absolute(&p))
            .transpose()?,
        listen,
        limits: Limits {
            upload: Some(Upload {
                path: csi_agent_api::routes::IMAGES_IMPORT,
                content_type: csi_agent_api::routes::TAR_MEDIA_TYPE,
                max_bytes: args
                    .image_import_max_bytes
                    .or(file.image_import_max_bytes)
                    .map_or(DEFAULT_IMAGE_IMPORT_MAX_BYTES, NonZeroU64::get),
                flag: "--image-import-max-bytes",
            }),
            ..Limits::new(
                args.max_connections.or(file.max_connections),
                args.header_timeout_ms.or(file.header_timeout_ms),
                args.idle_timeout_ms.or(file.idle_timeout_ms),
                args.body_timeout_ms.or(file.body_timeout_ms),
            )
        },
        token_file,
        start: args.start.or(file.start).unwrap_or(StartMode::Immediate),
        log_format: args
            .log_format
            .or(file.log_format)
            .unwrap_or(LogFormat::Human),
        node_id,
        socket_root: args
            .socket_root
            .or(file.socket_root)
            .unwrap_or_else(csi_agent::service_manager::default_socket_root),
        boot_id_file: args
            .boot_id_file
            .unwrap_or_else(|| PathBuf::from(csi_agent::bootid::BOOT_ID_PATH)),
    })
}

/// The TOML file of `--config`, or every setting unset when there is none.
fn config_file(path: Option<&Path>) -> anyhow::Result<FileSettings> {
    Ok(match path {
        None => FileSettings::default(),
        Some(path) => {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("cannot read the config file {}", path.display()))?;
            toml::from_str(&text).with_context(|| {
                format!(
                    "config file {} is not valid TOML for csi-agentd",
                    path.display()
                )
            })?
        }
    })
}

/// The registries: the default one (Docker Hub unless given), the insecure ones and the
/// credentials of `--docker-config`, each registry name normalized as references use it.
fn registry_settings(
    docker_registry: Option<String>,
    insecure: &[String],
    docker_config: Option<PathBuf>,
) -> anyhow::Result<RegistrySettings> {
    Ok(RegistrySettings {
        default_registry: normalize_registry(docker_registry.as_deref().unwrap_or(DOCKER_HUB)),
        insecure: insecure.iter().map(|r| normalize_registry(r)).collect(),
        credentials: match docker_config {
            Some(path) => Credentials::from_docker_config(&path)?,
            None => Credentials::default(),
        },
    })
}

/// The pull's throughput floor from its flags; the other bounds keep their defaults.
fn pull_limits(
    min_bytes_per_sec: Option<u64>,
    floor_window_secs: Option<NonZeroU64>,
) -> PullLimits {
    let mut pull_limits = PullLimits::default();
    if let Some(floor) = min_bytes_per_sec {
        pull_limits.min_bytes_per_sec = floor;
    }
    if let Some(window) = floor_window_secs {
        pull_limits.throughput_window = std::time::Duration::from_secs(window.get());
    }
    pull_limits
}

/// The store's options: `--commit-delay-us`, refused over [`MAX_COMMIT_DELAY_US`].
fn store_options(commit_delay_us: Option<u64>) -> anyhow::Result<StoreOptions> {
    let mut store = StoreOptions::default();
    if let Some(delay) = commit_delay_us {
        if delay > MAX_COMMIT_DELAY_US {
            bail!(
                "--commit-delay-us {delay} is too long: give 0 to {MAX_COMMIT_DELAY_US} \
                 (microseconds; 0 commits at once)"
            );
        }
        store.commit_delay = std::time::Duration::from_micros(delay);
    }
    Ok(store)
}

/// `--worker-threads`, 1 unless given, refused over [`MAX_WORKER_THREADS`].
/// A duration flag: `250ms`, `10s`, `2m`, or a number of seconds.
fn duration(flag: &str, value: &str) -> anyhow::Result<Duration> {
    let value = value.trim();
    let (number, unit) = match value.find(|c: char| !c.is_ascii_digit()) {
        Some(at) => value.split_at(at),
        None => (value, "s"),
    };
    let n: u64 = number.parse().map_err(|_| {
        anyhow::anyhow!("{flag} {value:?} is not a duration: give e.g. 500ms, 10s or 2m")
    })?;
    match unit {
        "ms" => Ok(Duration::from_millis(n)),
        "s" => Ok(Duration::from_secs(n)),
        "m" => Ok(Duration::from_secs(n.saturating_mul(60))),
        _ => anyhow::bail!("{flag} {value:?}: unknown unit {unit:?}; use ms, s or m"),
    }
}

/// The volume stats collector's settings; a zero timeout is refused (every call would fail).
fn stats_options(
    interval: Option<&str>,
    concurrency: Option<NonZeroUsize>,
    timeout: Option<&str>,
) -> anyhow::Result<StatsOptions> {
    let defaults = StatsOptions::default();
    let timeout = match timeout {
        Some(t) => duration("--volume-stats-timeout", t)?,
        None => defaults.timeout,
    };
    if timeout.is_zero() {
        anyhow::bail!("--volume-stats-timeout must be more than 0 (e.g. 10s)");
    }
    Ok(StatsOptions {
        interval: match interval {
            Some(i) => duration("--volume-stats-interval", i)?,
            None => defaults.interval,
        },
        concurrency: concurrency.map_or(defaults.concurrency, NonZeroUsize::get),
        timeout,
    })
}

fn worker_threads(worker_threads: Option<NonZeroUsize>) -> anyhow::Result<NonZeroUsize> {
    let worker_threads = worker_threads.unwrap_or(NonZeroUsize::MIN);
    if worker_threads.get() > MAX_WORKER_THREADS {
        bail!(
            "--worker-threads {worker_threads} is too many: give 1 to {MAX_WORKER_THREADS} \
             (docs/configuration.md says when more than 1 helps)"
        );
    }
    Ok(worker_threads)
}

/// The image bounds given, each other one at its default.
fn image_limits(
    max_unpacked_bytes: Option<NonZeroU64>,
    max_inodes: Option<NonZeroU64>,
    store_max_bytes: Option<NonZeroU64>,
) -> ImageLimits {
    let defaults = ImageLimits::default();
    ImageLimits {
        max_unpacked_bytes: max_unpacked_bytes.map_or(defaults.max_unpacked_bytes, NonZeroU64::get),
        max_inodes: max_inodes.map_or(defaults.max_inodes, NonZeroU64::get),
        store_max_bytes: store_max_bytes.map_or(defaults.store_max_bytes, NonZeroU64::get),
    }
}

/// The fetcher's options: its cache in the work dir, the bounds given, the rest defaults.
fn fetch_options(
    work_dir: &Path,
    max_bytes: Option<NonZeroU64>,
    timeout_secs: Option<NonZeroU64>,
) -> csi_agent::fetch::FetchOptions {
    let mut fetch = csi_agent::fetch::FetchOptions::new(work_dir);
    if let Some(max) = max_bytes {
        fetch.max_bytes = max.get();
    }
    if let Some(secs) = timeout_secs {
        fetch.timeout = std::time::Duration::from_secs(secs.get());
    }
    fetch
}

/// A `--bind-root` must be an existing dir, is used canonical (the operator's symlinks are
/// trusted, a workload's never are), and must not overlap the work dir.
fn bind_root(root: &Path, work_dir: &Path) -> anyhow::Result<PathBuf> {
    let canonical = std::fs::canonicalize(root).with_context(|| {
        format!(
            "--bind-root {}: cannot resolve it (it must be an existing directory)",
            root.display()
        )
    })?;
    if !canonical.is_dir() {
        bail!("--bind-root {}: not a directory", root.display());
    }
    if canonical == Path::new("/") {
        bail!("--bind-root /: the whole host is not a bind root; name the sandboxes dir");
    }
    let work = std::fs::canonicalize(work_dir).unwrap_or_else(|_| work_dir.to_path_buf());
    if work.starts_with(&canonical) || canonical.starts_with(&work) {
        bail!(
            "--bind-root {} overlaps the work dir {}: workloads must not be able to bind over csi-agent's own state; use disjoint dirs",
            root.display(),
            work_dir.display()
        );
    }
    Ok(canonical)
}

fn absolute(path: &Path) -> anyhow::Result<PathBuf> {
    std::path::absolute(path).with_context(|| format!("cannot resolve {}", path.display()))
}

pub fn init_logging(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_env("CSI_AGENT_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt().with_env_filter(filter);
    match format {
        LogFormat::Human => builder.with_writer(OneLineStderr).init(),
        LogFormat::Json => builder.with_writer(std::io::stderr).json().init(),
    }
}

/// Stderr for the human log format, one event per line whatever its fields hold: a line break
/// inside an event (a hostile id quoted in a plugin's error message, say) is written as `\n`
/// or `\r`, so no field can forge a log line. The JSON format escapes them itself.
#[derive(Clone, Copy, Debug, Default)]
struct OneLineStderr;

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for OneLineStderr {
    type Writer = OneLine;

    fn make_writer(&'a self) -> Self::Writer {
        OneLine
    }
}

/// `event` with every line break but its final one escaped.
fn one_line(event: &[u8]) -> Vec<u8> {
    let (body, end): (&[u8], &[u8]) = match event.strip_suffix(b"\n") {
        Some(body) => (body, b"\n"),
        None => (event, b""),
    };
    let mut out = Vec::with_capacity(event.len() + 8);
    for &byte in body {
        match byte {
            b'\n' => out.extend_from_slice(b"\\n"),
            b'\r' => out.extend_from_slice(b"\\r"),
            _ => out.push(byte),
        }
    }
    out.extend_from_slice(end);
    out
}

/// One event: the formatter writes each event, ending in its one `\n`, with one `write_all`.
#[derive(Debug)]
struct OneLine;

impl std::io::Write for OneLine {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        std::io::stderr().lock().write_all(&one_line(buf))?;
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        std::io::stderr().flush()
    }
}

pub async fn run(settings: Settings) -> anyhow::Result<()> {
    if let Err(err) = csi_agent::failpoint::init_from_env() {
        bail!("{}: {err}", csi_agent::failpoint::ENV_VAR);
    }
    // Refusals come before anything is created or served.
    let token = match (settings.listen, &settings.token_file) {
        (Some(_), Some(file)) => Some(Arc::new(listener::read_token(file)?)),
        _ => None,
    };
    std::fs::create_dir_all(&settings.work_dir)
        .with_context(|| format!("cannot create the work dir {}", settings.work_dir.display()))?;
    // Before anything else in the work dir is read or written: one daemon per work dir.
    let _work_dir_lock = csi_agent::workdir::lock(&settings.work_dir)?;
    std::fs::set_permissions(&settings.work_dir, std::fs::Permissions::from_mode(0o700))
        .with_context(|| format!("cannot make {} private", settings.work_dir.display()))?;
    // Before the store opens (and would create an empty database): a lost state.db is not a
    // new node.
    csi_agent::store::vanished::check(
        &csi_agent::layout::Layout::new(&settings.work_dir),
        settings.reinitialize_state,
    )?;
    // Before the store is opened: a live socket means another daemon may be using this work dir.
    let socket = &settings.api_socket;
    let mut limits = settings.limits;
    limits.fit_fd_limit(
        1 + usize::from(token.is_some()) + usize::from(settings.volume_plugin_socket.is_some()),
    );
    let unix = listener::bind_unix(socket, "--api-socket").await?;
    let volume_plugin = match &settings.volume_plugin_socket {
        Some(path) => Some(listener::bind_unix(path, "--volume-plugin-socket").await?),
        None => None,
    };
    let boot_id = csi_agent::bootid::BootIdSource::boot_id(
        &csi_agent::bootid::ProcBootId::with_path(&settings.boot_id_file),
    )?;
    let cluster = match &settings.cluster {
        Some(cluster) => Some(cluster_flags::setup(cluster).await?),
        None => None,
    };
    let metrics = Arc::new(Metrics::new());
    let server = CsiServer::new(
        ServerOptions {
            work_dir: settings.work_dir.clone(),
            plugin_config_dir: settings.plugin_config_dir.clone(),
            socket_root: settings.socket_root.clone(),
            node_id: settings.node_id.clone(),
            boot_id,
            bind_roots: settings.bind_roots.clone(),
            claim_limits: settings.claim_limits,
            oci_runtime: settings.oci_runtime.clone(),
            start_plugins: settings.start_plugins,
            registry: settings.registry.clone(),
            pull_limits: settings.pull_limits.clone(),
            store: settings.store,
            image_limits: settings.image_limits.clone(),
            fetch: settings.fetch.clone(),
            secret_dir: settings.secret_dir.clone(),
            cluster,
        },
        metrics,
    )
    .context("cannot open the work dir")?;
    let state = AppState {
        server: server.clone(),
        import: api::ImportSettings {
            max_bytes: limits
                .upload
                .map_or(DEFAULT_IMAGE_IMPORT_MAX_BYTES, |u| u.max_bytes),
            idle_timeout: limits.body_timeout,
        },
        stats: settings.volume_stats,
    };
    csi_agent::stats::spawn_collector(server.clone(), settings.volume_stats);

    let (shutdown_tx, shutdown_rx) = tokio::sync::watch::channel(false);
    let mut servers = tokio::task::JoinSet::new();
    let app = listener::guard(api::router(state.clone()), &limits);
    if let (Some(addr), Some(token)) = (settings.listen, token) {
        let tcp = listener::bind_tcp(addr).with_context(|| format!("cannot listen on {addr}"))?;
        let addr = tcp.local_addr().unwrap_or(addr);
        let app = app.clone().layer(axum::middleware::from_fn_with_state(
            token,
            api::require_token,
        ));
        servers.spawn(listener::serve(
            tcp,
            "tcp",
            app,
            limits,
            shutdown_rx.clone(),
        ));
        if addr.ip().to_canonical().is_loopback() {
            tracing::info!(%addr, "listening on TCP (bearer token required)");
        } else {
            tracing::warn!(%addr, "listening on TCP on a non-loopback address (--allow-insecure-listen): plain HTTP, the bearer token and volume secrets cross the network in the clear");
        }
    }
    if let (Some(listener), Some(path)) = (volume_plugin, &settings.volume_plugin_socket) {
        let app = listener::guard(crate::volume_plugin::router(server.clone()), &limits);
        servers.spawn(listener::serve(
            listener,
            "volume-plugin",
            app,
            limits,
            shutdown_rx.clone(),
        ));
        tracing::info!(socket = %path.display(), "serving the Docker volume plugin protocol");
    }
    servers.spawn(listener::serve(unix, "unix", app, limits, shutdown_rx));
    tracing::info!(socket = %socket.display(), work_dir = %settings.work_dir.display(), "csi-agentd serving");

    match settings.start {
        StartMode::Immediate => {
            let server = server.clone();
            tokio::spawn(async move {
                server.start().await;
            });
        }
        StartMode::OnRequest => {
            server.load_configs().await;
            tracing::info!("waiting for POST /v1/start before launching plugins");
        }
    }

    let mut terminate = signal(SignalKind::terminate()).context("cannot watch SIGTERM")?;
    let mut interrupt = signal(SignalKind::interrupt()).context("cannot watch SIGINT")?;
    let mut hangup = signal(SignalKind::hangup()).context("cannot watch SIGHUP")?;
    loop {
        tokio::select! {
            _ = terminate.recv() => break,
            _ = interrupt.recv() => break,
            _ = hangup.recv() => {
                let (diff, errors) = server.reload().await;
                tracing::info!(added = ?diff.added, changed = ?diff.changed, removed = ?diff.removed, errors = errors.len(), "plugin configs reloaded (SIGHUP)");
            }
            Some(done) = servers.join_next() => {
                match done {
                    Ok(()) => bail!("an API listener stopped unexpectedly"),
                    Err(err) => bail!("an API listener task failed: {err}"),
                }
            }
        }
    }
    tracing::info!("shutting down; plugins and mounts stay in place");
    if let Err(err) = server.flush_store().await {
        tracing::warn!(error = %err, "progress notes not committed at shutdown; the next start repeats their RPCs");
    }
    let _ = shutdown_tx.send(true);
    while servers.join_next().await.is_some() {}
    let _ = std::fs::remove_file(socket);
    Ok(())
}

#[cfg(test)]
mod one_line_tests {
    use super::one_line;

    #[test]
    fn an_event_stays_one_line_whatever_its_fields_hold() {
        assert_eq!(one_line(b"plain\n"), b"plain\n");
        assert_eq!(
            one_line(b"id=evil\nFORGED level=ERROR\rX\n"),
            b"id=evil\\nFORGED level=ERROR\\rX\n"
        );
        assert_eq!(one_line(b"no end"), b"no end");
        assert_eq!(one_line(b"\n\n"), b"\\n\n");
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod image_limit_tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        serve: ServeArgs,
    }

    fn parse(args: &[&str]) -> anyhow::Result<Settings> {
        let argv = std::iter::once("csi-agentd").chain(args.iter().copied());
        settings(Cli::try_parse_from(argv)?.serve)
    }

    #[test]
    fn image_caps_come_from_the_flags_then_the_file_then_the_defaults() {
        let tmp = tempfile::tempdir().unwrap();
        let work = tmp.path().join("work");
        let work = work.to_str().unwrap();
        let defaults = parse(&["--work-dir", work]).unwrap().image_limits;
        assert_eq!(defaults, ImageLimits::default());
        assert_eq!(defaults.max_unpacked_bytes, 8 << 30);

        let config = tmp.path().join("csi-agentd.toml");
        std::fs::write(
            &config,
            "image_max_unpacked_bytes = 1000\nimage_max_inodes = 20\nimage_store_max_bytes = 3000\n",
        )
        .unwrap();
        let config = config.to_str().unwrap();
        let from_file = parse(&["--work-dir", work, "--config", config])
            .unwrap()
            .image_limits;
        assert_eq!(
            from_file,
            ImageLimits {
                max_unpacked_bytes: 1000,
                max_inodes: 20,
                store_max_bytes: 3000,
            }
        );
        let flags_win = parse(&[
            "--work-dir",
            work,
            "--config",
            config,
            "--image-max-unpacked-bytes",
            "5",
            "--image-max-inodes",
            "6",
            "--image-store-max-bytes",
            "7",
        ])
        .unwrap()
        .image_limits;
        assert_eq!(
            (
                flags_win.max_unpacked_bytes,
                flags_win.max_inodes,
                flags_win.store_max_bytes
            ),
            (5, 6, 7)
        );
        // Zero would refuse every image: a typed error naming the flag, not a silent cap.
        let zero = parse(&["--work-dir", work, "--image-max-inodes", "0"]).unwrap_err();
        assert!(zero.to_string().contains("--image-max-inodes"), "{zero}");
    }
}
