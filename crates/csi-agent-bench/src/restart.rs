//! `restart`: the daemon's restart with many volume records (default 10,000), and its
//! resident memory.
//!
//! 1. Start the daemon with one managed test plugin (`--mount-mode none`) holding N
//!    pre-provisioned volumes; measure VmRSS idle (no volume, plugin not launched) and after
//!    one publish+unpublish (plugin launched and connected, no volume).
//! 2. Publish all N volumes for real through the API (concurrently), measure VmRSS.
//! 3. SIGTERM the daemon (the plugin keeps running, by design), start it again, and measure
//!    from the spawn: `GET /v1/health` answering, a first publish answering (an idempotent
//!    re-publish of a published volume), and `GET /v1/volumes` listing all N volumes as
//!    PUBLISHED. Check the plugin was adopted (same pid), and measure VmRSS again.
//!
//! The plugin runs with `--volatile-state`: it rewrites its whole `state.json` per commit, so
//! at 100,000 volumes its own bookkeeping, not csi-agent, would make the set-up quadratic (a
//! run was still publishing after 32 minutes). It is never restarted here, so what it would
//! have kept on disk is never needed; csi-agent's store is the real, durable one. The
//! plugin indexes its staging and target paths, so a 100,000 set-up is linear (about 30 s).

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use serde::Serialize;

use crate::daemon::{Daemon, DaemonDirs, PluginSpec};
use crate::env::{Env, Machine, PLUGIN_TYPE};

/// the targets of docs/benchmarks.md.
pub const MAX_SERVE_MS: f64 = 1000.0;
pub const MAX_IDLE_MIB: f64 = 16.0;
pub const MAX_LOADED_MIB: f64 = 64.0;
/// Issue #10's bound for 100,000 records, applied above 10,000.
pub const MAX_LOADED_MIB_LARGE: f64 = 128.0;

/// The resident-memory bound for `volumes` published volumes.
pub fn max_loaded_mib(volumes: usize) -> f64 {
    if volumes <= 10_000 {
        MAX_LOADED_MIB
    } else {
        MAX_LOADED_MIB_LARGE
    }
}

#[derive(Clone, Debug, clap::Args)]
pub struct RestartArgs {
    /// Volume records to create (by publishing them for real).
    #[arg(long, default_value_t = 10_000)]
    pub volumes: usize,
    /// Concurrent clients publishing them.
    #[arg(long, default_value_t = 64)]
    pub concurrency: usize,
    /// Settle time before each memory reading, in milliseconds.
    #[arg(long, default_value_t = 1000)]
    pub settle_ms: u64,
}

impl Default for RestartArgs {
    fn default() -> Self {
        Self {
            volumes: 10_000,
            concurrency: 64,
            settle_ms: 1000,
        }
    }
}

#[derive(Clone, Debug, Serialize)]
pub struct RestartReport {
    pub machine: Machine,
    pub volumes: usize,
    pub rss_idle_mib: f64,
    pub rss_idle_after_use_mib: f64,
    pub rss_loaded_mib: f64,
    pub hwm_loaded_mib: f64,
    pub rss_after_restart_mib: f64,
    pub hwm_after_restart_mib: f64,
    pub publish_all_s: f64,
    pub publish_all_per_s: f64,
    pub shutdown_ms: f64,
    /// From spawn to `GET /v1/health` answering.
    pub health_ms: f64,
    /// From spawn to an idempotent publish answering.
    pub first_publish_ms: f64,
    /// From spawn to `GET /v1/volumes` listing every volume as PUBLISHED.
    pub all_listed_ms: f64,
    /// The daemon's own `csi_agent_recovery_seconds` (loading the records).
    pub recovery_metric_ms: f64,
    pub listed: usize,
    pub published_listed: usize,
    pub plugin_adopted: bool,
    pub serve_pass: bool,
    pub recovered_pass: bool,
    pub idle_pass: bool,
    /// The bound `loaded_pass` was judged against ([`max_loaded_mib`]).
    pub loaded_bound_mib: f64,
    pub loaded_pass: bool,
}

const VOLUME_PREFIX: &str = "v";

/// The test plugin without mounts, controller publish or durable state, with `volumes`
/// pre-provisioned volumes of 1 MiB ([`volume_name`]) and `extra` flags.
pub(crate) fn series_plugin(
    plugin_type: &str,
    work_dir: std::path::PathBuf,
    volumes: usize,
    extra: &[&str],
) -> PluginSpec {
    let mut spec = PluginSpec::new(
        plugin_type,
        work_dir,
        &[
            "--mount-mode",
            "none",
            "--no-controller-publish",
            "--volatile-state",
        ],
    );
    spec.flags.extend(extra.iter().map(|f| (*f).to_owned()));
    // One series flag, not the names: the daemon keeps the plugin's config, and 100,000
    // names in it would weigh on its idle memory.
    spec.flags.extend([
        "--volume-series".to_owned(),
        format!("{VOLUME_PREFIX}:{volumes}:1M"),
    ]);
    spec
}

/// The name of the i-th volume of the plugin's `--volume-series`.
pub fn volume_name(i: usize) -> String {
    format!("{VOLUME_PREFIX}{i:05}")
}

pub(crate) const WORKLOAD: &str = "bench-workload";

pub async fn run(env: &Env, args: &RestartArgs) -> anyhow::Result<RestartReport> {
    if args.volumes == 0 || args.concurrency == 0 {
        bail!("--volumes and --concurrency must be positive");
    }
    let settle = Duration::from_millis(args.settle_ms);
    let scratch = env.scratch("restart")?;
    let machine = Machine::describe(scratch.path());
    let plugin_type = format!("{PLUGIN_TYPE}-restart");
    let dirs = DaemonDirs::new(&scratch, "daemon")?;
    let spec = series_plugin(&plugin_type, scratch.join("plugin"), args.volumes, &[]);
    dirs.add_plugin(env, &spec)?;

    let (daemon, _) = Daemon::start(env, &dirs).await?;
    tokio::time::sleep(settle).await;
    let idle = daemon.memory()?;
    eprintln!("restart: idle daemon VmRSS {:.1} MiB", idle.rss_mib());
    daemon
        .publish(&plugin_type, &volume_name(0), WORKLOAD)
        .await?;
    daemon
        .unpublish(&plugin_type, &volume_name(0), WORKLOAD)
        .await?;
    tokio::time::sleep(settle).await;
    let idle_used = daemon.memory()?;
    let (_, plugin_pid) = daemon.plugin_socket(&plugin_type).await?;

    eprintln!(
        "restart: publishing {} volumes through the daemon ({} clients)...",
        args.volumes, args.concurrency
    );
    let daemon = Arc::new(daemon);
    let started = Instant::now();
    publish_all(&daemon, &plugin_type, args.volumes, args.concurrency).await?;
    let publish_all = started.elapsed();
    tokio::time::sleep(settle).await;
    let loaded = daemon.memory()?;
    eprintln!(
        "restart: {} volumes published in {:.1} s; VmRSS {:.1} MiB",
        args.volumes,
        publish_all.as_secs_f64(),
        loaded.rss_mib()
    );

    let daemon = Arc::try_unwrap(daemon)
        .map_err(|_| anyhow::anyhow!("the daemon handle is still shared"))?;
    let shutdown = daemon.stop().await?;

    eprintln!("restart: daemon stopped; starting it again...");
    let spawned = Instant::now();
    let mut daemon = Daemon::spawn(env, &dirs)?;
    eprintln!("restart: new daemon pid {}", daemon.pid());
    daemon.wait_healthy(Duration::from_secs(60)).await?;
    let health = spawned.elapsed();
    daemon
        .publish(&plugin_type, &volume_name(0), WORKLOAD)
        .await
        .context("idempotent publish after the restart")?;
    let first_publish = spawned.elapsed();
    let deadline = spawned + Duration::from_secs(120);
    let (listed, published_listed, all_listed) = loop {
        let list = daemon.api.volumes().await?;
        let published = list
            .volumes
            .iter()
            .filter(|v| v.plugin == plugin_type && v.state == "PUBLISHED")
            .count();
        if published >= args.volumes {
            break (list.volumes.len(), published, spawned.elapsed());
        }
        if Instant::now() > deadline {
            bail!(
                "after the restart only {published} of {} volumes are listed as PUBLISHED",
                args.volumes
            );
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    };
    let metrics = daemon.metrics_text().await?;
    let recovery_s =
        crate::stats::metric(&metrics, "csi_agent_recovery_seconds", &[]).unwrap_or(0.0);
    let (_, plugin_pid_after) = daemon.plugin_socket(&plugin_type).await?;
    let states = states_of(&daemon, &plugin_type).await?;
    if states.len() > 1 {
        eprintln!("restart: volume states after the restart: {states:?}");
    }
    tokio::time::sleep(settle).await;
    let after = daemon.memory()?;
    daemon.stop().await?;

    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    let loaded_bound = max_loaded_mib(args.volumes);
    Ok(RestartReport {
        machine,
        volumes: args.volumes,
        rss_idle_mib: idle.rss_mib(),
        rss_idle_after_use_mib: idle_used.rss_mib(),
        rss_loaded_mib: loaded.rss_mib(),
        hwm_loaded_mib: loaded.hwm_mib(),
        rss_after_restart_mib: after.rss_mib(),
        hwm_after_restart_mib: after.hwm_mib(),
        publish_all_s: publish_all.as_secs_f64(),
        publish_all_per_s: args.volumes as f64 / publish_all.as_secs_f64(),
        shutdown_ms: ms(shutdown),
        health_ms: ms(health),
        first_publish_ms: ms(first_publish),
        all_listed_ms: ms(all_listed),
        recovery_metric_ms: recovery_s * 1e3,
        listed,
        published_listed,
        plugin_adopted: plugin_pid != 0 && plugin_pid == plugin_pid_after,
        serve_pass: ms(health).max(ms(first_publish)) <= MAX_SERVE_MS,
        recovered_pass: published_listed >= args.volumes && ms(all_listed) <= MAX_SERVE_MS,
        idle_pass: idle.rss_mib().max(idle_used.rss_mib()) <= MAX_IDLE_MIB,
        loaded_bound_mib: loaded_bound,
        loaded_pass: loaded.rss_mib().max(after.rss_mib()) <= loaded_bound,
    })
}

async fn states_of(daemon: &Daemon, plugin_type: &str) -> anyhow::Result<HashMap<String, usize>> {
    let mut states = HashMap::new();
    for v in daemon.api.volumes().await?.volumes {
        if v.plugin == plugin_type {
            *states.entry(v.state).or_insert(0) += 1;
        }
    }
    Ok(states)
}

pub(crate) async fn publish_all(
    daemon: &Arc<Daemon>,
    plugin_type: &str,
    n: usize,
    concurrency: usize,
) -> anyhow::Result<()> {
    let next = Arc::new(AtomicUsize::new(0));
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..concurrency.min(n) {
        let daemon = daemon.clone();
        let next = next.clone();
        let plugin_type = plugin_type.to_owned();
        tasks.spawn(async move {
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= n {
                    return Ok::<(), anyhow::Error>(());
                }
                daemon
                    .publish(&plugin_type, &volume_name(i), WORKLOAD)
                    .await?;
            }
        });
    }
    while let Some(joined) = tasks.join_next().await {
        joined.context("a client task panicked")??;
    }
    Ok(())
}
