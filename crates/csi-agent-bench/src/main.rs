//! `csi-agent-bench`: measures csi-agent against the raw CSI RPC sequence on the same test
//! plugin, in one run, and checks the targets listed in docs/benchmarks.md.
//!
//! Subcommands: `cycle` (one publish+unpublish, sequential: raw vs engine vs daemon, durable
//! writes and their fsync cost), `throughput` (1,000 volumes by 64 concurrent clients),
//! `restart` (10,000 volume records: time to serve and to list them all, resident memory),
//! `supervision` (socket → ready, kill -9 → ready again), `stats` (the volume stats
//! collector's CPU at 1,000 published volumes; not part of `all`), `images` (pulling and preparing a
//! plugin image against skopeo + umoci; not part of `all`: it needs a registry and those
//! tools), `cluster` (cluster mode on a real etcd against single-node mode and the raw RPCs,
//! and three daemons publishing 1,000 volumes together; not part of `all`), `snapshot` (a snapshot create: daemon vs the raw RPC vs one durable write) and
//! `all` (everything else, plus a markdown report for `docs/benchmarks.md`).
//!
//! Every subcommand is bounded, works only in a fresh temp dir (removed at the end), talks
//! only over unix sockets, and kills every process it started, also on error or Ctrl-C.
//! It needs the release binaries of `csi-testplugin` and `csi-agentd` next to its own (see
//! `docs/benchmarks.md`).

mod cluster;
mod cpu;
mod cycle;
mod daemon;
mod docker;
mod env;
mod expand;
mod images;
mod procs;
mod raw;
mod report;
mod restart;
mod snapshot;
mod stats;
mod supervision;
mod throughput;
mod volume_stats;

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use clap::{Parser, Subcommand};

use crate::env::Env;

#[derive(Debug, Parser)]
#[command(
    name = "csi-agent-bench",
    version,
    about = "Benchmarks csi-agent against the raw CSI RPC sequence"
)]
struct Cli {
    #[command(flatten)]
    common: CommonArgs,
    #[command(subcommand)]
    command: Command,
}

/// Settings shared by every subcommand.
#[derive(Debug, clap::Args)]
pub struct CommonArgs {
    /// Directory holding the release `csi-testplugin` and `csi-agentd` binaries (default: the
    /// directory of this binary, i.e. `target/release`).
    #[arg(long, global = true)]
    pub bin_dir: Option<PathBuf>,
    /// Where the temp dir of a run is created; it decides the file system measured (default:
    /// `$TMPDIR` or `/tmp`).
    #[arg(long, global = true)]
    pub tmp_dir: Option<PathBuf>,
    /// Where the JSON figures are written, one `<subcommand>.json` each (default:
    /// `target/csi-agent-bench` beside the binaries).
    #[arg(long, global = true)]
    pub out_dir: Option<PathBuf>,
    /// An extra argument for every `csi-agentd serve` the benchmark starts (repeatable), to
    /// compare settings: `--daemon-arg=--worker-threads=2`.
    #[arg(long = "daemon-arg", global = true, allow_hyphen_values = true)]
    pub daemon_args: Vec<String>,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// One publish+unpublish cycle, sequentially: raw RPCs vs the engine in-process vs the
    /// daemon over HTTP; durable writes per operation and their fsync cost.
    Cycle(cycle::CycleArgs),
    /// Volumes published (then unpublished) by concurrent clients: raw vs engine vs daemon.
    Throughput(throughput::ThroughputArgs),
    /// Restart of the daemon with many volume records: time to serve, time until all are
    /// listed, resident memory idle and loaded.
    Restart(restart::RestartArgs),
    /// Plugin supervision: socket appears → ready, kill -9 → ready again, against the
    /// plugin's own start time.
    Supervision(supervision::SupervisionArgs),
    /// Plugin images: csi-agent's pull + unpack against skopeo + umoci from a loopback
    /// registry, and the warm start of a cached image (needs docker-registry, skopeo, umoci).
    Images(images::ImagesArgs),
    /// `docker run` of a short container on a csi-agent volume (the volume plugin protocol)
    /// against a local volume, on a real dockerd the run starts; the raw CSI publish +
    /// unpublish beside them. Not part of `all` (needs docker.io).
    Docker(docker::DockerArgs),
    /// Volume expansion: the raw ControllerExpandVolume + NodeExpandVolume against the
    /// daemon's `POST …/expand`, and the cost of one durable write.
    Expand(expand::ExpandArgs),
    /// The volume stats collector's CPU at 1,000 published volumes, as % of one core at a
    /// 60 s interval. Not part of `all`.
    Stats(volume_stats::StatsArgs),
    /// Snapshot create latency: the daemon against the raw CreateSnapshot RPC and one
    /// durable write (target: raw + one durable write + 1 ms).
    Snapshot(snapshot::SnapshotArgs),
    /// Cluster mode (issue 28) on one real etcd member: publish+unpublish against a
    /// single-node daemon and the raw RPCs, etcd writes per operation, and three daemons
    /// publishing 1,000 volumes together. Not part of `all` (needs /usr/bin/etcd).
    Cluster(cluster::ClusterArgs),
    /// Everything, with the default sizes; prints markdown for docs/benchmarks.md.
    All(report::AllArgs),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(err) => {
            eprintln!("csi-agent-bench: cannot start the async runtime: {err}");
            return ExitCode::FAILURE;
        }
    };
    let result = runtime.block_on(async {
        tokio::select! {
            result = run(cli) => result,
            // Dropping `run` drops every guard: children are killed, temp dirs removed.
            _ = tokio::signal::ctrl_c() => Err(anyhow::anyhow!("interrupted")),
        }
    });
    // Background tasks (plugin connections, supervisors) must not outlive the guards' work.
    runtime.shutdown_timeout(std::time::Duration::from_secs(2));
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("csi-agent-bench: {err:#}");
            ExitCode::FAILURE
        }
    }
}

async fn run(cli: Cli) -> anyhow::Result<()> {
    let env = Env::new(&cli.common).context("cannot prepare the benchmark environment")?;
    match cli.command {
        Command::Cycle(args) => {
            let report = cycle::run(&env, &args).await?;
            print!("{}", report::cycle_table(&report));
            env.write_json("cycle", &report)?;
        }
        Command::Throughput(args) => {
            let report = throughput::run(&env, &args).await?;
            print!("{}", report::throughput_table(&report));
            env.write_json("throughput", &report)?;
        }
        Command::Restart(args) => {
            let report = restart::run(&env, &args).await?;
            print!("{}", report::restart_table(&report));
            env.write_json("restart", &report)?;
        }
        Command::Supervision(args) => {
            let report = supervision::run(&env, &args).await?;
            print!("{}", report::supervision_table(&report));
            env.write_json("supervision", &report)?;
        }
        Command::Images(args) => {
            let report = images::run(&env, &args).await?;
            print!("{}", images::table(&report));
            env.write_json("images", &report)?;
        }
        Command::Docker(args) => {
            let report = docker::run(&env, &args).await?;
            print!("{}", docker::table(&report));
            env.write_json("docker", &report)?;
        }
        Command::Expand(args) => {
            let report = expand::run(&env, &args).await?;
            print!("{}", expand::table(&report));
            env.write_json("expand", &report)?;
        }
        Command::Stats(args) => {
            let report = volume_stats::run(&env, &args).await?;
            print!("{}", volume_stats::table(&report));
            env.write_json("stats", &report)?;
        }
        Command::Snapshot(args) => {
            let report = snapshot::run(&env, &args).await?;
            print!("{}", snapshot::table(&report));
            env.write_json("snapshot", &report)?;
        }
        Command::Cluster(args) => {
            let report = cluster::run(&env, &args).await?;
            print!("{}", cluster::table(&report));
            env.write_json("cluster", &report)?;
        }
        Command::All(args) => report::run_all(&env, &args).await?,
    }
    Ok(())
}
