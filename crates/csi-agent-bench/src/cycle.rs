//! `cycle`: the latency of one publish+unpublish cycle, sequential, three ways against the
//! same plugin process: the raw RPC sequence, the engine in-process, and the daemon over its
//! HTTP API (with `ApiClient`). Diagnostic contenders run beside them: the raw sequence with
//! the engine's record writes inline, the daemon over one kept-alive connection, one
//! durable write (`write_atomic`, the §9 formula's unit), the engine's `Store` work of one
//! cycle alone, and a bare `GET /v1/health`. All run interleaved in blocks, rotating the
//! order, so that drift (page cache, disk, plugin state) hits them alike.
//!
//! The daemon launches the plugin from its config (managed, as in production); the raw
//! client and the in-process engine then connect to that same plugin socket.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use csi_agent::layout::Layout;
use csi_agent::store::{Store, encode_record, write_atomic};
use csi_agent::volume::{Origin, VolumeRecord, VolumeState};
use serde::Serialize;

use crate::daemon::{
    Checkpoints, Daemon, DaemonDirs, PluginSpec, publish_request, unpublish_request,
};
use crate::env::{Env, Machine, PLUGIN_TYPE, in_private_mount_namespace};
use crate::procs::Scratch;
use crate::raw::{Engine, Raw, capability};
use crate::stats::Summary;
use csi_agent_api::ApiClient;

/// The fixed per-cycle allowance of the targets (docs/benchmarks.md) (on top of the raw sequence and the writes).
pub const ALLOWANCE_MS: f64 = 0.3;
/// docs/benchmarks.md, "Targets": durable writes per publish and per unpublish.
pub const MAX_WRITES: f64 = 3.0;

#[derive(Clone, Debug, clap::Args)]
pub struct CycleArgs {
    /// Measured cycles per contender (warm-up excluded).
    #[arg(long, default_value_t = 2000)]
    pub iterations: usize,
    /// Warm-up cycles per contender, not measured.
    #[arg(long, default_value_t = 100)]
    pub warmup: usize,
    /// Cycles per contender per interleaved block.
    #[arg(long, default_value_t = 100)]
    pub block: usize,
    /// The test plugin's mount mode. `bind` makes real bind mounts and requires a private
    /// mount namespace (`unshare -m --propagation private`).
    #[arg(long, value_enum, default_value_t = MountMode::None)]
    pub mount_mode: MountMode,
    /// Only the default variant (stage/unstage; no controller publish).
    #[arg(long)]
    pub skip_controller_publish: bool,
    /// Extra (unmeasured) daemon cycles that scrape /metrics between publish and unpublish
    /// to split its durable writes.
    #[arg(long, default_value_t = 20)]
    pub count_cycles: usize,
    /// Diagnostics: run only these contenders (raw, raw-durable, engine, daemon,
    /// daemon-fresh, write, store, health); the checks are then meaningless.
    #[arg(long, value_delimiter = ',', hide = true)]
    pub only: Vec<String>,
}

impl Default for CycleArgs {
    fn default() -> Self {
        Self {
            iterations: 2000,
            warmup: 100,
            block: 100,
            mount_mode: MountMode::None,
            skip_controller_publish: false,
            count_cycles: 20,
            only: Vec::new(),
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum MountMode {
    None,
    Bind,
}

impl MountMode {
    pub fn flag(self) -> &'static str {
        match self {
            MountMode::None => "none",
            MountMode::Bind => "bind",
        }
    }

    /// Refuses `bind` outside a private mount namespace: its mounts would reach the host.
    /// `subcommand` names the benchmark in the command the error suggests.
    pub fn check_namespace(self, subcommand: &str) -> anyhow::Result<()> {
        if self == MountMode::Bind && !in_private_mount_namespace() {
            bail!(
                "--mount-mode bind makes real mounts: run it in a private mount namespace, e.g. \
                 `unshare -m --propagation private target/release/csi-agent-bench {subcommand} --mount-mode bind`"
            );
        }
        Ok(())
    }
}

#[derive(Clone, Debug, Serialize)]
pub struct CycleReport {
    pub machine: Machine,
    pub mount_mode: MountMode,
    pub iterations: usize,
    pub warmup: usize,
    pub variants: Vec<VariantReport>,
}

/// Latencies of one contender.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Phase {
    pub cycle: Summary,
    pub publish: Summary,
    pub unpublish: Summary,
    /// Where a cycle's time goes (means over the measured cycles).
    pub breakdown: Breakdown,
}

/// A cycle's mean time split into CSI RPCs (client-side latency, as the client's metrics
/// see it), fsync of durable writes, and the rest (file operations of the writes, locks,
/// task switches, HTTP/JSON for the daemon).
#[derive(Clone, Debug, Default, Serialize)]
pub struct Breakdown {
    pub rpcs_per_cycle: f64,
    pub rpc_ms: f64,
    pub fsync_ms: f64,
    pub other_ms: f64,
}

impl Breakdown {
    fn new(cycle_mean_ms: f64, delta: &Checkpoints, cycles: usize) -> Self {
        let n = cycles.max(1) as f64;
        let rpc_ms = delta.rpc_sum_s * 1e3 / n;
        let fsync_ms = delta.fsync_sum_s * 1e3 / n;
        Self {
            rpcs_per_cycle: delta.rpc_count / n,
            rpc_ms,
            fsync_ms,
            other_ms: cycle_mean_ms - rpc_ms - fsync_ms,
        }
    }
}

#[derive(Clone, Debug, Serialize)]
pub struct VariantReport {
    /// `stage` or `stage+controller-publish`.
    pub name: String,
    pub plugin_flags: Vec<String>,
    pub rpcs_per_cycle: usize,
    pub raw: Phase,
    /// Diagnostic: the raw sequence plus the engine's record writes inline (no engine).
    pub raw_durable: Phase,
    pub engine: Phase,
    pub daemon: Phase,
    /// Diagnostic: the daemon driven with a fresh connection per request (a new `ApiClient`
    /// for each, as a one-shot `csictl` makes it; `daemon` reuses its pooled connection).
    pub daemon_fresh: Phase,
    /// Diagnostic: one `GET /v1/health` round trip, fresh connection and kept-alive (pooled)
    /// connection: the HTTP cost of a request without any engine work.
    pub health_fresh: Summary,
    pub health_keepalive: Summary,
    /// One `write_atomic` (temp file, write, fsync, rename, fsync dir) of a volume record
    /// into the same file system, timed in the same run.
    pub durable_write: Summary,
    /// The same write through `tokio::task::spawn_blocking`, as the engine makes it.
    pub durable_write_blocking: Summary,
    /// The engine's durable work of one cycle alone, through its `Store` (same record
    /// writes, the volume directory created by the first and removed by the final delete),
    /// without any RPC: a diagnostic of what the §9 formula's `writes × write` leaves out.
    pub store_cycle: Summary,
    /// The daemon's own fsync time per checkpoint write (its histogram), for comparison.
    pub daemon_fsync_per_write_ms: f64,
    /// Mean publish and unpublish time inside the daemon (its operation histogram): the
    /// rest of the daemon's cycle is HTTP, JSON and the client.
    pub daemon_inside_publish_ms: f64,
    pub daemon_inside_unpublish_ms: f64,
    pub writes: Writes,
    pub ratios: Ratios,
    pub cycle_check: CycleCheck,
    pub writes_check: WritesCheck,
}

#[derive(Clone, Debug, Default, Serialize)]
pub struct Writes {
    pub engine_per_publish: f64,
    pub engine_per_unpublish: f64,
    pub daemon_per_publish: f64,
    pub daemon_per_unpublish: f64,
    /// Daemon writes over the measured cycles divided by their number (cross-check).
    pub daemon_per_cycle_measured: f64,
}

#[derive(Clone, Debug, Default, Serialize)]
pub struct Ratios {
    pub engine_to_raw_mean: f64,
    pub daemon_to_raw_mean: f64,
    pub engine_to_raw_p50: f64,
    pub daemon_to_raw_p50: f64,
}

/// docs/benchmarks.md, "Targets": daemon_cycle ≤ raw_cycle + writes × durable_write + 0.3 ms (means).
#[derive(Clone, Debug, Default, Serialize)]
pub struct CycleCheck {
    pub raw_mean_ms: f64,
    pub writes_per_cycle: f64,
    pub durable_write_ms: f64,
    pub allowance_ms: f64,
    pub budget_ms: f64,
    pub daemon_mean_ms: f64,
    /// budget − daemon (positive: under budget).
    pub margin_ms: f64,
    pub pass: bool,
    /// The same check on medians.
    pub budget_p50_ms: f64,
    pub daemon_p50_ms: f64,
    pub pass_p50: bool,
}

/// docs/benchmarks.md, "Targets": at most 3 durable writes per publish and per unpublish.
#[derive(Clone, Debug, Default, Serialize)]
pub struct WritesCheck {
    pub max_per_operation: f64,
    pub publish: f64,
    pub unpublish: f64,
    /// RPCs per publish (and per unpublish) + 1: the floor when every RPC's intent is durable
    /// before it and the final result before the answer.
    pub floor_per_operation: f64,
    pub pass: bool,
}

#[derive(Clone, Copy, Debug)]
struct Variant {
    tag: &'static str,
    name: &'static str,
    controller_publish: bool,
}

const VARIANTS: [Variant; 2] = [
    Variant {
        tag: "stage",
        name: "stage",
        controller_publish: false,
    },
    Variant {
        tag: "cp",
        name: "stage+controller-publish",
        controller_publish: true,
    },
];

impl Variant {
    fn plugin_type(self) -> String {
        format!("{PLUGIN_TYPE}-{}", self.tag)
    }

    fn flags(self, mount_mode: MountMode) -> Vec<&'static str> {
        let mut flags = vec![
            "--mount-mode",
            mount_mode.flag(),
            "--volumes",
            "raw-vol:1M,engine-vol:1M,daemon-vol:1M,fresh-vol:1M",
        ];
        if !self.controller_publish {
            flags.push("--no-controller-publish");
        }
        flags
    }

    fn rpcs(self) -> usize {
        if self.controller_publish { 6 } else { 4 }
    }
}

pub async fn run(env: &Env, args: &CycleArgs) -> anyhow::Result<CycleReport> {
    if args.iterations == 0 || args.block == 0 {
        bail!("--iterations and --block must be positive");
    }
    args.mount_mode.check_namespace("cycle")?;
    let scratch = env.scratch("cycle")?;
    let machine = Machine::describe(scratch.path());
    let variants: Vec<Variant> = VARIANTS
        .into_iter()
        .filter(|v| !(args.skip_controller_publish && v.controller_publish))
        .collect();
    let dirs = DaemonDirs::new(&scratch, "daemon")?;
    for variant in &variants {
        let spec = PluginSpec::new(
            &variant.plugin_type(),
            scratch.join(&format!("plugin-{}", variant.tag)),
            &variant.flags(args.mount_mode),
        );
        dirs.add_plugin(env, &spec)?;
    }
    let (daemon, _) = Daemon::start(env, &dirs).await?;
    let mut reports = Vec::new();
    for variant in variants {
        eprintln!(
            "cycle [{}; mount-mode {}]: {} warm-up + {} measured cycles per contender...",
            variant.name,
            args.mount_mode.flag(),
            args.warmup,
            args.iterations
        );
        let report = run_variant(&scratch, &daemon, variant, args)
            .await
            .with_context(|| format!("variant {}", variant.name))?;
        reports.push(report);
    }
    daemon.stop().await?;
    Ok(CycleReport {
        machine,
        mount_mode: args.mount_mode,
        iterations: args.iterations,
        warmup: args.warmup,
        variants: reports,
    })
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Contender {
    Raw,
    RawDurable,
    Engine,
    Daemon,
    DaemonFresh,
    Write,
    Store,
    Health,
}

const ORDER: [Contender; 8] = [
    Contender::Raw,
    Contender::RawDurable,
    Contender::Engine,
    Contender::Daemon,
    Contender::DaemonFresh,
    Contender::Write,
    Contender::Store,
    Contender::Health,
];

impl Contender {
    fn name(self) -> &'static str {
        match self {
            Contender::Raw => "raw",
            Contender::RawDurable => "raw-durable",
            Contender::Engine => "engine",
            Contender::Daemon => "daemon",
            Contender::DaemonFresh => "daemon-fresh",
            Contender::Write => "write",
            Contender::Store => "store",
            Contender::Health => "health",
        }
    }
}

#[derive(Default)]
struct Samples {
    publish: Vec<Duration>,
    unpublish: Vec<Duration>,
}

impl Samples {
    /// `delta`: the contender's metrics over the measured cycles, `cycles` of them (the
    /// daemon's metrics cover both daemon contenders).
    fn phase(&self, delta: &Checkpoints, cycles: usize) -> Phase {
        let cycle: Vec<Duration> = self
            .publish
            .iter()
            .zip(&self.unpublish)
            .map(|(p, u)| *p + *u)
            .collect();
        let cycle = Summary::of(&cycle);
        Phase {
            breakdown: Breakdown::new(cycle.mean_ms, delta, cycles),
            cycle,
            publish: Summary::of(&self.publish),
            unpublish: Summary::of(&self.unpublish),
        }
    }
}

struct Contenders<'a> {
    raw: Raw,
    raw_durable: Raw,
    engine: Engine,
    daemon: &'a Daemon,
    daemon_socket: PathBuf,
    plugin_type: String,
    write_path: PathBuf,
    write_payload: Vec<u8>,
    store: Store,
    store_record: VolumeRecord,
    /// Record saves per cycle (the last write of a cycle is the delete).
    store_saves: usize,
}

const RAW_VOLUME: &str = "raw-vol";
const ENGINE_VOLUME: &str = "engine-vol";
const DAEMON_VOLUME: &str = "daemon-vol";
const FRESH_VOLUME: &str = "fresh-vol";
const WORKLOAD: &str = "bench-workload";
const STORE_TYPE: &str = "org.example.store-probe";
const STORE_VOLUME: &str = "store-vol";

impl Contenders<'_> {
    /// One cycle of `who`; returns (publish, unpublish) times and engine writes of each.
    async fn cycle(&self, who: Contender) -> anyhow::Result<(Duration, Duration, u64, u64)> {
        let (mut w0, mut w1, mut w2) = (0, 0, 0);
        let t0 = Instant::now();
        let t1;
        match who {
            Contender::Raw => {
                self.raw.publish(RAW_VOLUME).await?;
                t1 = Instant::now();
                self.raw.unpublish(RAW_VOLUME).await?;
            }
            Contender::RawDurable => {
                self.raw_durable.publish(RAW_VOLUME).await?;
                t1 = Instant::now();
                self.raw_durable.unpublish(RAW_VOLUME).await?;
            }
            Contender::Engine => {
                w0 = self.engine.writes();
                self.engine.publish(ENGINE_VOLUME, WORKLOAD).await?;
                t1 = Instant::now();
                w1 = self.engine.writes();
                self.engine.unpublish(ENGINE_VOLUME, WORKLOAD).await?;
                w2 = self.engine.writes();
            }
            Contender::Daemon => {
                self.daemon
                    .publish(&self.plugin_type, DAEMON_VOLUME, WORKLOAD)
                    .await?;
                t1 = Instant::now();
                self.daemon
                    .unpublish(&self.plugin_type, DAEMON_VOLUME, WORKLOAD)
                    .await?;
            }
            Contender::DaemonFresh => {
                ApiClient::unix(&self.daemon_socket)
                    .publish(&publish_request(&self.plugin_type, FRESH_VOLUME, WORKLOAD))
                    .await?;
                t1 = Instant::now();
                ApiClient::unix(&self.daemon_socket)
                    .unpublish(&unpublish_request(
                        &self.plugin_type,
                        FRESH_VOLUME,
                        WORKLOAD,
                    ))
                    .await?;
            }
            Contender::Health => {
                ApiClient::unix(&self.daemon_socket).health().await?;
                t1 = Instant::now();
                self.daemon.api.health().await?;
            }
            Contender::Write => {
                write_atomic(&self.write_path, &self.write_payload, None)?;
                t1 = Instant::now();
                // The same write handed to the blocking pool, as the engine does.
                let (path, payload) = (self.write_path.clone(), self.write_payload.clone());
                tokio::task::spawn_blocking(move || write_atomic(&path, &payload, None)).await??;
            }
            Contender::Store => {
                let (t, n, id) = (STORE_TYPE, "default", STORE_VOLUME);
                // The engine's store work of one cycle: per operation one durable write and
                // its notes (the RPCs and their results), the last one a noted delete.
                for _ in 0..2 {
                    self.store.save_volume(t, n, id, &self.store_record).await?;
                    for _ in 1..self.store_saves {
                        self.store.note_volume(t, n, id, &self.store_record)?;
                    }
                }
                self.store.note_delete(t, n, id, false)?;
                t1 = Instant::now();
            }
        }
        let t2 = Instant::now();
        Ok((t1 - t0, t2 - t1, w1 - w0, w2 - w1))
    }
}

impl<'a> Contenders<'a> {
    /// Launches the variant's plugin through the daemon, then opens every contender on its
    /// socket, each with its own work dir in `scratch`.
    async fn start(
        scratch: &Scratch,
        daemon: &'a Daemon,
        variant: Variant,
        plugin_type: &str,
    ) -> anyhow::Result<Self> {
        // The first request launches the plugin (lazily); then its socket is known.
        daemon.publish(plugin_type, DAEMON_VOLUME, WORKLOAD).await?;
        daemon
            .unpublish(plugin_type, DAEMON_VOLUME, WORKLOAD)
            .await?;
        let (socket, _) = daemon.plugin_socket(plugin_type).await?;
        let raw = Raw::connect(
            &socket,
            scratch.join(&format!("raw-co-{}", variant.tag)),
            plugin_type,
        )
        .await?;
        let engine = Engine::new(
            &scratch.join(&format!("engine-work-{}", variant.tag)),
            &socket,
            plugin_type,
        )?;
        let write_path = scratch.join(&format!("write-probe-{}/volume.json", variant.tag));
        std::fs::create_dir_all(write_path.parent().unwrap_or(scratch.path()))?;
        let raw_durable = Raw::connect(
            &socket,
            scratch.join(&format!("raw-co-{}", variant.tag)),
            plugin_type,
        )
        .await?
        .with_durable_writes(&scratch.join(&format!("raw-durable-{}", variant.tag)))?;
        let daemon_socket = daemon
            .api
            .socket()
            .context("the daemon client has no unix socket")?
            .to_path_buf();
        Ok(Contenders {
            raw,
            raw_durable,
            engine,
            daemon,
            daemon_socket,
            plugin_type: plugin_type.to_owned(),
            write_path,
            write_payload: sample_record()?,
            store: Store::open(
                Layout::new(scratch.join(&format!("store-probe-{}", variant.tag))),
                None,
            )?,
            store_record: published_record(STORE_VOLUME),
            store_saves: variant.rpcs() + 1,
        })
    }
}

/// The daemon's durable writes per publish and per unpublish, summed over `cycles`
/// unmeasured cycles (the metrics count writes, not which operation made them).
async fn daemon_write_split(
    daemon: &Daemon,
    plugin_type: &str,
    cycles: usize,
) -> anyhow::Result<(f64, f64)> {
    let (mut daemon_pub_writes, mut daemon_unpub_writes) = (0.0, 0.0);
    for _ in 0..cycles {
        let c0 = daemon.checkpoint_counters().await?;
        daemon.publish(plugin_type, DAEMON_VOLUME, WORKLOAD).await?;
        let c1 = daemon.checkpoint_counters().await?;
        daemon
            .unpublish(plugin_type, DAEMON_VOLUME, WORKLOAD)
            .await?;
        let c2 = daemon.checkpoint_counters().await?;
        daemon_pub_writes += c1.since(&c0).writes;
        daemon_unpub_writes += c2.since(&c1).writes;
    }
    Ok((daemon_pub_writes, daemon_unpub_writes))
}

async fn run_variant(
    scratch: &Scratch,
    daemon: &Daemon,
    variant: Variant,
    args: &CycleArgs,
) -> anyhow::Result<VariantReport> {
    let plugin_type = variant.plugin_type();
    let contenders = Contenders::start(scratch, daemon, variant, &plugin_type).await?;

    let selected =
        |who: Contender| args.only.is_empty() || args.only.iter().any(|o| o == who.name());
    for _ in 0..args.warmup {
        for who in ORDER {
            if selected(who) {
                contenders.cycle(who).await?;
            }
        }
    }

    let before = daemon.checkpoint_counters().await?;
    let raw_before = Checkpoints::parse(&contenders.raw.metrics.encode());
    let raw_durable_before = Checkpoints::parse(&contenders.raw_durable.metrics.encode());
    let engine_before = Checkpoints::parse(&contenders.engine.metrics.encode());
    let mut raw = Samples::default();
    let mut raw_durable = Samples::default();
    let mut engine = Samples::default();
    let mut daemon_samples = Samples::default();
    let mut fresh_samples = Samples::default();
    let mut health_fresh = Vec::new();
    let mut health_keepalive = Vec::new();
    let mut writes = Vec::new();
    let mut writes_blocking = Vec::new();
    let mut store_cycles = Vec::new();
    let (mut engine_pub_writes, mut engine_unpub_writes) = (0u64, 0u64);
    let blocks = args.iterations.div_ceil(args.block);
    for b in 0..blocks {
        let n = args.block.min(args.iterations - b * args.block);
        for k in 0..ORDER.len() {
            let who = ORDER[(b + k) % ORDER.len()];
            if !selected(who) {
                continue;
            }
            for _ in 0..n {
                let (p, u, wp, wu) = contenders.cycle(who).await?;
                match who {
                    Contender::Raw => {
                        raw.publish.push(p);
                        raw.unpublish.push(u);
                    }
                    Contender::RawDurable => {
                        raw_durable.publish.push(p);
                        raw_durable.unpublish.push(u);
                    }
                    Contender::Engine => {
                        engine.publish.push(p);
                        engine.unpublish.push(u);
                        engine_pub_writes += wp;
                        engine_unpub_writes += wu;
                    }
                    Contender::Daemon => {
                        daemon_samples.publish.push(p);
                        daemon_samples.unpublish.push(u);
                    }
                    Contender::DaemonFresh => {
                        fresh_samples.publish.push(p);
                        fresh_samples.unpublish.push(u);
                    }
                    Contender::Health => {
                        health_fresh.push(p);
                        health_keepalive.push(u);
                    }
                    Contender::Write => {
                        writes.push(p);
                        writes_blocking.push(u);
                    }
                    Contender::Store => store_cycles.push(p),
                }
            }
        }
    }
    let measured = daemon.checkpoint_counters().await?.since(&before);
    let raw_delta = Checkpoints::parse(&contenders.raw.metrics.encode()).since(&raw_before);
    let raw_durable_delta =
        Checkpoints::parse(&contenders.raw_durable.metrics.encode()).since(&raw_durable_before);
    let engine_delta =
        Checkpoints::parse(&contenders.engine.metrics.encode()).since(&engine_before);

    // Split the daemon's writes between publish and unpublish (unmeasured cycles).
    let (daemon_pub_writes, daemon_unpub_writes) =
        daemon_write_split(daemon, &plugin_type, args.count_cycles).await?;
    let count = args.count_cycles.max(1) as f64;
    let n = args.iterations as f64;
    let writes_summary = Summary::of(&writes);
    let daemon_cycles = daemon_samples.publish.len() + fresh_samples.publish.len();
    let raw = raw.phase(&raw_delta, args.iterations);
    let raw_durable = raw_durable.phase(&raw_durable_delta, args.iterations);
    let engine = engine.phase(&engine_delta, args.iterations);
    let daemon_phase = daemon_samples.phase(&measured, daemon_cycles);
    let fresh_phase = fresh_samples.phase(&measured, daemon_cycles);
    let write_counts = Writes {
        engine_per_publish: engine_pub_writes as f64 / n,
        engine_per_unpublish: engine_unpub_writes as f64 / n,
        daemon_per_publish: daemon_pub_writes / count,
        daemon_per_unpublish: daemon_unpub_writes / count,
        daemon_per_cycle_measured: measured.writes / daemon_cycles.max(1) as f64,
    };
    Ok(VariantReport {
        name: variant.name.to_owned(),
        plugin_flags: variant
            .flags(args.mount_mode)
            .into_iter()
            .map(str::to_owned)
            .collect(),
        rpcs_per_cycle: variant.rpcs(),
        ratios: Ratios {
            engine_to_raw_mean: engine.cycle.mean_ms / raw.cycle.mean_ms,
            daemon_to_raw_mean: daemon_phase.cycle.mean_ms / raw.cycle.mean_ms,
            engine_to_raw_p50: engine.cycle.p50_ms / raw.cycle.p50_ms,
            daemon_to_raw_p50: daemon_phase.cycle.p50_ms / raw.cycle.p50_ms,
        },
        cycle_check: cycle_check(&raw, &daemon_phase, &write_counts, &writes_summary),
        writes_check: writes_check(&write_counts, variant.rpcs()),
        daemon_fsync_per_write_ms: per(measured.fsync_sum_s * 1e3, measured.fsync_count),
        daemon_inside_publish_ms: per(measured.publish_sum_s * 1e3, measured.publish_count),
        daemon_inside_unpublish_ms: per(measured.unpublish_sum_s * 1e3, measured.unpublish_count),
        raw,
        raw_durable,
        engine,
        daemon: daemon_phase,
        daemon_fresh: fresh_phase,
        health_fresh: Summary::of(&health_fresh),
        health_keepalive: Summary::of(&health_keepalive),
        durable_write: writes_summary,
        durable_write_blocking: Summary::of(&writes_blocking),
        store_cycle: Summary::of(&store_cycles),
        writes: write_counts,
    })
}

fn per(sum: f64, count: f64) -> f64 {
    if count > 0.0 { sum / count } else { 0.0 }
}

fn cycle_check(raw: &Phase, daemon: &Phase, writes: &Writes, write: &Summary) -> CycleCheck {
    let writes_per_cycle = writes.daemon_per_publish + writes.daemon_per_unpublish;
    let budget = raw.cycle.mean_ms + writes_per_cycle * write.mean_ms + ALLOWANCE_MS;
    let budget_p50 = raw.cycle.p50_ms + writes_per_cycle * write.p50_ms + ALLOWANCE_MS;
    CycleCheck {
        raw_mean_ms: raw.cycle.mean_ms,
        writes_per_cycle,
        durable_write_ms: write.mean_ms,
        allowance_ms: ALLOWANCE_MS,
        budget_ms: budget,
        daemon_mean_ms: daemon.cycle.mean_ms,
        margin_ms: budget - daemon.cycle.mean_ms,
        pass: daemon.cycle.mean_ms <= budget,
        budget_p50_ms: budget_p50,
        daemon_p50_ms: daemon.cycle.p50_ms,
        pass_p50: daemon.cycle.p50_ms <= budget_p50,
    }
}

fn writes_check(writes: &Writes, rpcs_per_cycle: usize) -> WritesCheck {
    let publish = writes.daemon_per_publish.max(writes.engine_per_publish);
    let unpublish = writes.daemon_per_unpublish.max(writes.engine_per_unpublish);
    WritesCheck {
        max_per_operation: MAX_WRITES,
        publish,
        unpublish,
        floor_per_operation: (rpcs_per_cycle / 2 + 1) as f64,
        pass: publish <= MAX_WRITES && unpublish <= MAX_WRITES,
    }
}

/// A published volume record as the engine writes it (realistic size for the write probe).
pub fn sample_record() -> anyhow::Result<Vec<u8>> {
    Ok(encode_record(&published_record("write-probe-volume"))?)
}

fn published_record(volume_id: &str) -> VolumeRecord {
    let mut record = VolumeRecord::new(volume_id, Origin::PreProvisioned);
    record.state = VolumeState::Published;
    record.claims.insert(WORKLOAD.to_owned());
    record.capability = Some(capability());
    record.boot_id = Some("00000000-0000-0000-0000-000000000000".to_owned());
    record
}
