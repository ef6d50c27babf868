//! `throughput`: N volumes (default 1,000) published, then unpublished, by C concurrent
//! clients (default 64): the raw RPC sequence, the engine in-process and the daemon over
//! HTTP, against the same plugin process. Each round runs the three contenders one after
//! the other (rotating the order); the median round is reported.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use serde::Serialize;

use crate::cpu::{CpuPerOp, Sample, Watched};
use crate::cycle::MountMode;
use crate::daemon::{Checkpoints, Daemon, DaemonDirs, PluginSpec};
use crate::env::{Env, Machine, PLUGIN_TYPE};
use crate::raw::{Engine, Raw};
use crate::stats::median_by;

/// docs/benchmarks.md, "Targets" (issue #10's): daemon throughput ≥ 0.9 × raw at the same
/// concurrency, for publish and for unpublish.
pub const MIN_RATIO: f64 = 0.9;

#[derive(Clone, Debug, clap::Args)]
pub struct ThroughputArgs {
    /// Volumes published (then unpublished) per round and contender.
    #[arg(long, default_value_t = 1000)]
    pub volumes: usize,
    /// Concurrent clients.
    #[arg(long, default_value_t = 64)]
    pub concurrency: usize,
    /// Rounds per contender (the median is reported).
    #[arg(long, default_value_t = 3)]
    pub rounds: usize,
    /// Pause before every measured phase, in seconds. On ext4 without a journal, inode
    /// allocation skips inodes freed in the last ~30 s one by one, so a phase that follows
    /// heavy file churn (the engine's) is slowed whoever runs it; 31 s isolates the phases.
    #[arg(long, default_value_t = 0)]
    pub settle_s: u64,
    /// The test plugin's mount mode. `bind` makes real bind mounts (two per volume) and
    /// requires a private mount namespace (`unshare -m --propagation private`).
    #[arg(long, value_enum, default_value_t = MountMode::None)]
    pub mount_mode: MountMode,
    /// Diagnostic: run the test plugin with `--volatile-state`. By default it keeps its state
    /// durable, rewriting its whole state file (every volume) once per group commit, a cost
    /// per operation that depends on how bunched its requests arrive.
    #[arg(long)]
    pub plugin_volatile_state: bool,
}

impl Default for ThroughputArgs {
    fn default() -> Self {
        Self {
            volumes: 1000,
            concurrency: 64,
            rounds: 3,
            settle_s: 0,
            mount_mode: MountMode::None,
            plugin_volatile_state: false,
        }
    }
}

#[derive(Clone, Debug, Serialize)]
pub struct ThroughputReport {
    pub machine: Machine,
    pub volumes: usize,
    pub concurrency: usize,
    pub rounds: usize,
    pub settle_s: u64,
    pub mount_mode: MountMode,
    pub plugin_volatile_state: bool,
    pub raw: Rates,
    pub engine: Rates,
    pub daemon: Rates,
    pub engine_to_raw_publish: f64,
    pub daemon_to_raw_publish: f64,
    pub engine_to_raw_unpublish: f64,
    pub daemon_to_raw_unpublish: f64,
    pub daemon_to_raw_cycle: f64,
    pub min_ratio: f64,
    /// The daemon's durable writes (store commits, one fsync each) per publish and per
    /// unpublish under this concurrency: what group commit shares.
    pub daemon_writes_per_publish: f64,
    pub daemon_writes_per_unpublish: f64,
    /// Publish throughput of the daemon ≥ [`MIN_RATIO`] × raw.
    pub pass: bool,
    pub pass_unpublish: bool,
}

/// Volumes per second (median round) and every round's figure.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Rates {
    pub publish_per_s: f64,
    pub unpublish_per_s: f64,
    /// Volumes / (publish time + unpublish time) of the median round.
    pub cycle_per_s: f64,
    pub publish_rounds: Vec<f64>,
    pub unpublish_rounds: Vec<f64>,
    /// CPU per operation by process (median of rounds): where the time goes.
    pub publish_cpu: CpuPerOp,
    pub unpublish_cpu: CpuPerOp,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Contender {
    Raw,
    Engine,
    Daemon,
}

const ORDER: [Contender; 3] = [Contender::Raw, Contender::Engine, Contender::Daemon];

#[derive(Clone)]
struct Shared {
    raw: Raw,
    engine: Engine,
    daemon: Arc<Daemon>,
    plugin_type: String,
}

const WORKLOAD: &str = "bench-workload";

pub fn volume_name(i: usize) -> String {
    format!("tp-{i:05}")
}

/// `--volumes` values for `n` volumes named by `name`, 1,000 per flag (argv strings stay
/// far below the kernel's 128 KiB per-argument limit).
pub fn volume_flags(n: usize, name: fn(usize) -> String) -> Vec<String> {
    let mut flags = Vec::new();
    let all: Vec<String> = (0..n).map(|i| format!("{}:1M", name(i))).collect();
    for chunk in all.chunks(1000) {
        flags.push("--volumes".to_owned());
        flags.push(chunk.join(","));
    }
    flags
}

pub async fn run(env: &Env, args: &ThroughputArgs) -> anyhow::Result<ThroughputReport> {
    if args.volumes == 0 || args.concurrency == 0 || args.rounds == 0 {
        bail!("--volumes, --concurrency and --rounds must be positive");
    }
    args.mount_mode.check_namespace("throughput")?;
    let scratch = env.scratch("throughput")?;
    let machine = Machine::describe(scratch.path());
    let plugin_type = format!("{PLUGIN_TYPE}-tp");
    let dirs = DaemonDirs::new(&scratch, "daemon")?;
    let mut spec = PluginSpec::new(
        &plugin_type,
        scratch.join("plugin"),
        &[
            "--mount-mode",
            args.mount_mode.flag(),
            "--no-controller-publish",
        ],
    );
    if args.plugin_volatile_state {
        spec.flags.push("--volatile-state".to_owned());
    }
    spec.flags.extend(volume_flags(args.volumes, volume_name));
    dirs.add_plugin(env, &spec)?;
    let (daemon, _) = Daemon::start(env, &dirs).await?;
    let daemon = Arc::new(daemon);
    // Launch the plugin through the daemon, then share its socket.
    daemon
        .publish(&plugin_type, &volume_name(0), WORKLOAD)
        .await?;
    daemon
        .unpublish(&plugin_type, &volume_name(0), WORKLOAD)
        .await?;
    let (socket, plugin_pid) = daemon.plugin_socket(&plugin_type).await?;
    let watched = Watched {
        daemon: daemon.pid(),
        plugin: plugin_pid,
    };
    let shared = Shared {
        raw: Raw::connect(&socket, scratch.join("raw-co"), &plugin_type).await?,
        engine: Engine::new(&scratch.join("engine-work"), &socket, &plugin_type)?,
        daemon: daemon.clone(),
        plugin_type,
    };

    // Warm-up: a concurrency-wide batch per contender.
    let warm = args.concurrency.min(args.volumes);
    for who in ORDER {
        phase(&shared, who, true, warm, args.concurrency).await?;
        phase(&shared, who, false, warm, args.concurrency).await?;
    }

    let mut publish: [Vec<Duration>; 3] = Default::default();
    let mut unpublish: [Vec<Duration>; 3] = Default::default();
    let mut publish_cpu: [Vec<CpuPerOp>; 3] = Default::default();
    let mut unpublish_cpu: [Vec<CpuPerOp>; 3] = Default::default();
    // The daemon's durable writes (store commits) during its measured phases.
    let (mut publish_writes, mut unpublish_writes) = (0.0, 0.0);
    let writes = || async {
        Ok::<f64, anyhow::Error>(Checkpoints::parse(&daemon.metrics_text().await?).writes)
    };
    for round in 0..args.rounds {
        for k in 0..ORDER.len() {
            let index = (round + k) % ORDER.len();
            let who = ORDER[index];
            eprintln!(
                "throughput round {}/{}: {who:?}, {} volumes by {} clients...",
                round + 1,
                args.rounds,
                args.volumes,
                args.concurrency
            );
            let settle = Duration::from_secs(args.settle_s);
            tokio::time::sleep(settle).await;
            let before = writes().await?;
            let cpu = Sample::take(watched);
            publish[index].push(phase(&shared, who, true, args.volumes, args.concurrency).await?);
            publish_cpu[index].push(Sample::take(watched).per_op_since(&cpu, args.volumes));
            let between = writes().await?;
            tokio::time::sleep(settle).await;
            let after_settle = writes().await?;
            let cpu = Sample::take(watched);
            unpublish[index]
                .push(phase(&shared, who, false, args.volumes, args.concurrency).await?);
            unpublish_cpu[index].push(Sample::take(watched).per_op_since(&cpu, args.volumes));
            if who == Contender::Daemon {
                publish_writes += between - before;
                unpublish_writes += writes().await? - after_settle;
            }
        }
    }
    drop(shared);
    let rates: Vec<Rates> = (0..ORDER.len())
        .map(|i| Rates {
            publish_cpu: CpuPerOp::median(&publish_cpu[i]),
            unpublish_cpu: CpuPerOp::median(&unpublish_cpu[i]),
            ..rates(args.volumes, &publish[i], &unpublish[i])
        })
        .collect();
    let [raw, engine, daemon_rates]: [Rates; 3] = rates
        .try_into()
        .map_err(|_| anyhow::anyhow!("three contenders expected"))?;
    if let Ok(daemon) = Arc::try_unwrap(daemon) {
        daemon.stop().await?;
    }
    let ratio = |a: f64, b: f64| if b > 0.0 { a / b } else { 0.0 };
    Ok(ThroughputReport {
        machine,
        volumes: args.volumes,
        concurrency: args.concurrency,
        rounds: args.rounds,
        settle_s: args.settle_s,
        mount_mode: args.mount_mode,
        plugin_volatile_state: args.plugin_volatile_state,
        engine_to_raw_publish: ratio(engine.publish_per_s, raw.publish_per_s),
        daemon_to_raw_publish: ratio(daemon_rates.publish_per_s, raw.publish_per_s),
        engine_to_raw_unpublish: ratio(engine.unpublish_per_s, raw.unpublish_per_s),
        daemon_to_raw_unpublish: ratio(daemon_rates.unpublish_per_s, raw.unpublish_per_s),
        daemon_to_raw_cycle: ratio(daemon_rates.cycle_per_s, raw.cycle_per_s),
        min_ratio: MIN_RATIO,
        daemon_writes_per_publish: publish_writes / (args.rounds * args.volumes) as f64,
        daemon_writes_per_unpublish: unpublish_writes / (args.rounds * args.volumes) as f64,
        pass: daemon_rates.publish_per_s >= MIN_RATIO * raw.publish_per_s,
        pass_unpublish: daemon_rates.unpublish_per_s >= MIN_RATIO * raw.unpublish_per_s,
        raw,
        engine,
        daemon: daemon_rates,
    })
}

fn rates(volumes: usize, publish: &[Duration], unpublish: &[Duration]) -> Rates {
    let per_s = |d: &Duration| volumes as f64 / d.as_secs_f64();
    let pm = median_by(publish.iter().copied(), Ord::cmp);
    let um = median_by(unpublish.iter().copied(), Ord::cmp);
    Rates {
        publish_per_s: per_s(&pm),
        unpublish_per_s: per_s(&um),
        cycle_per_s: per_s(&(pm + um)),
        publish_rounds: publish.iter().map(per_s).collect(),
        unpublish_rounds: unpublish.iter().map(per_s).collect(),
        ..Rates::default()
    }
}

/// Publishes (or unpublishes) volumes 0..n with `concurrency` clients; the wall time.
async fn phase(
    shared: &Shared,
    who: Contender,
    publish: bool,
    n: usize,
    concurrency: usize,
) -> anyhow::Result<Duration> {
    let next = Arc::new(AtomicUsize::new(0));
    let started = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..concurrency.min(n) {
        let shared = shared.clone();
        let next = next.clone();
        tasks.spawn(async move {
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= n {
                    return Ok::<(), anyhow::Error>(());
                }
                let volume = volume_name(i);
                match (who, publish) {
                    (Contender::Raw, true) => shared.raw.publish(&volume).await?,
                    (Contender::Raw, false) => shared.raw.unpublish(&volume).await?,
                    (Contender::Engine, true) => shared.engine.publish(&volume, WORKLOAD).await?,
                    (Contender::Engine, false) => {
                        shared.engine.unpublish(&volume, WORKLOAD).await?;
                    }
                    (Contender::Daemon, true) => {
                        shared
                            .daemon
                            .publish(&shared.plugin_type, &volume, WORKLOAD)
                            .await?;
                    }
                    (Contender::Daemon, false) => {
                        shared
                            .daemon
                            .unpublish(&shared.plugin_type, &volume, WORKLOAD)
                            .await?;
                    }
                }
            }
        });
    }
    while let Some(joined) = tasks.join_next().await {
        joined.context("a client task panicked")?.with_context(|| {
            format!("{who:?} {}", if publish { "publish" } else { "unpublish" })
        })?;
    }
    Ok(started.elapsed())
}
