//! `csi-agent-bench snapshot`: the latency of a snapshot create through the daemon against the
//! raw CreateSnapshot RPC to the same plugin, and against the budget of issue 26: raw + one
//! durable write + 1 ms.
//!
//! Contenders, interleaved in blocks on one daemon and its managed `csi-testplugin
//! --snapshots` (so that both meet the same plugin, cache and disk): `raw`, CreateSnapshot
//! over [`CsiClient`] straight to the plugin's socket (what a CO without durability does);
//! `daemon`, `POST /v1/snapshots`; `write`, one durable record write of the engine's store on
//! the same file system (the "one durable write" of the budget). Each snapshot is deleted
//! after its sample, unmeasured, so that the plugin's state stays the same size.
//!
//! Owns its arguments, the run and the report; it must not change what it measures (no
//! capability cache warmed differently: one warm-up block of each contender first).

use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use csi_agent::client::{ClientOptions, CsiClient};
use csi_agent::layout::Layout;
use csi_agent::store::Store;
use csi_agent::volume::snapshot::SnapshotRecord;
use csi_agent_api::types::CreateSnapshotRequest;
use csi_proto::v1;
use serde::Serialize;

use crate::daemon::{Daemon, DaemonDirs, PluginSpec};
use crate::env::{Env, Machine};
use crate::stats::Summary;

const PLUGIN_TYPE: &str = "org.example.snapshot-bench";
const SOURCE: &str = "src";

#[derive(Debug, clap::Args)]
pub struct SnapshotArgs {
    /// Measured snapshots per contender (warm-up excluded).
    #[arg(long, default_value_t = 300)]
    pub iterations: usize,
    /// Warm-up snapshots per contender, not measured.
    #[arg(long, default_value_t = 20)]
    pub warmup: usize,
    /// Snapshots per contender per interleaved block.
    #[arg(long, default_value_t = 20)]
    pub block: usize,
    /// Bytes of data in the source volume (one file), copied by each snapshot.
    #[arg(long, default_value_t = 4096)]
    pub data_bytes: usize,
}

#[derive(Clone, Debug, Serialize)]
pub struct SnapshotReport {
    pub machine: Machine,
    pub iterations: usize,
    pub data_bytes: usize,
    pub raw: Summary,
    pub daemon: Summary,
    pub durable_write: Summary,
    /// Mean daemon − mean raw, ms.
    pub overhead_ms: f64,
    /// Mean durable write + 1 ms: the target of the overhead.
    pub budget_ms: f64,
    pub within_target: bool,
}

pub async fn run(env: &Env, args: &SnapshotArgs) -> anyhow::Result<SnapshotReport> {
    if args.iterations == 0 || args.block == 0 {
        bail!("--iterations and --block must be positive");
    }
    let scratch = env.scratch("snapshot")?;
    let machine = Machine::describe(scratch.path());
    let dirs = DaemonDirs::new(&scratch, "daemon")?;
    let plugin_dir = scratch.join("plugin");
    let spec = PluginSpec::new(
        PLUGIN_TYPE,
        plugin_dir.clone(),
        &[
            "--snapshots",
            "--mount-mode",
            "none",
            "--volumes",
            &format!("{SOURCE}:1Mi"),
        ],
    );
    dirs.add_plugin(env, &spec)?;
    let (daemon, _) = Daemon::start(env, &dirs).await?;
    let (socket, _) = wait_socket(&daemon).await?;
    std::fs::write(
        plugin_dir.join("volumes").join(SOURCE).join("data"),
        vec![0x5a; args.data_bytes],
    )
    .context("cannot write the source volume's data")?;
    let client = CsiClient::connect(
        &socket,
        ClientOptions {
            rpc_deadline: Duration::from_secs(30),
            plugin: PLUGIN_TYPE.to_owned(),
            metrics: None,
        },
    )
    .await
    .with_context(|| format!("cannot connect to {}", socket.display()))?;
    let store = Store::open(Layout::new(scratch.join("store-probe")), None)?;
    let record = SnapshotRecord {
        name: "probe".to_owned(),
        source_volume_id: SOURCE.to_owned(),
        parameters: Default::default(),
        snapshot_id: String::new(),
        size_bytes: 0,
        creation_time: None,
        ready_to_use: false,
        deleting: false,
    };

    let (mut raw, mut via_daemon, mut write) = (Vec::new(), Vec::new(), Vec::new());
    let total = args.warmup + args.iterations;
    let mut done = 0;
    let mut n = 0usize;
    eprintln!(
        "snapshot: {} warm-up + {} measured creates per contender, {} data bytes...",
        args.warmup, args.iterations, args.data_bytes
    );
    while done < total {
        let block = args.block.min(total - done);
        for _ in 0..block {
            n += 1;
            let name = format!("raw-{n}");
            let t = Instant::now();
            let answer = client
                .create_snapshot(v1::CreateSnapshotRequest {
                    source_volume_id: SOURCE.to_owned(),
                    name: name.clone(),
                    ..Default::default()
                })
                .await?;
            let took = t.elapsed();
            let id = answer.snapshot.map(|s| s.snapshot_id).unwrap_or(name);
            client
                .delete_snapshot(v1::DeleteSnapshotRequest {
                    snapshot_id: id,
                    ..Default::default()
                })
                .await?;
            if done >= args.warmup {
                raw.push(took);
            }
        }
        for _ in 0..block {
            n += 1;
            let t = Instant::now();
            let answer = daemon
                .api
                .create_snapshot(&CreateSnapshotRequest {
                    plugin: PLUGIN_TYPE.to_owned(),
                    source_volume_id: SOURCE.to_owned(),
                    name: format!("daemon-{n}"),
                    parameters: Default::default(),
                })
                .await?;
            let took = t.elapsed();
            if !answer.ready_to_use {
                bail!("the daemon answered a snapshot not ready: {answer:?}");
            }
            daemon
                .api
                .delete_snapshot(PLUGIN_TYPE, &answer.snapshot_id)
                .await?;
            if done >= args.warmup {
                via_daemon.push(took);
            }
        }
        for _ in 0..block {
            let t = Instant::now();
            store
                .save_volume(PLUGIN_TYPE, "default/snapshots", "probe", &record)
                .await?;
            if done >= args.warmup {
                write.push(t.elapsed());
            }
        }
        done += block;
    }
    daemon.stop().await?;
    let (raw, daemon, durable_write) = (
        Summary::of(&raw),
        Summary::of(&via_daemon),
        Summary::of(&write),
    );
    let overhead_ms = daemon.mean_ms - raw.mean_ms;
    let budget_ms = durable_write.mean_ms + 1.0;
    Ok(SnapshotReport {
        machine,
        iterations: args.iterations,
        data_bytes: args.data_bytes,
        raw,
        daemon,
        durable_write,
        overhead_ms,
        budget_ms,
        within_target: overhead_ms <= budget_ms,
    })
}

/// The plugin's socket once the daemon reports its component ready (a first request makes
/// the daemon launch the plugin, which it does on first use).
async fn wait_socket(daemon: &Daemon) -> anyhow::Result<(std::path::PathBuf, u32)> {
    daemon
        .api
        .snapshots(PLUGIN_TYPE, Some(1), None, None, None)
        .await
        .context("listing the plugin's snapshots, to start it")?;
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        match daemon.plugin_socket(PLUGIN_TYPE).await {
            Ok(found) => return Ok(found),
            Err(err) if Instant::now() > deadline => return Err(err),
            Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
        }
    }
}

/// The markdown rows of docs/benchmarks.md.
pub fn table(r: &SnapshotReport) -> String {
    let row = |what: &str, s: &Summary| {
        format!(
            "| {what} | {:.2} | {:.2} | {:.2} |\n",
            s.mean_ms, s.p50_ms, s.p99_ms
        )
    };
    let mut out =
        String::from("| snapshot create | mean ms | p50 ms | p99 ms |\n|---|---|---|---|\n");
    out += &row("raw CreateSnapshot", &r.raw);
    out += &row("daemon `POST /v1/snapshots`", &r.daemon);
    out += &row("one durable write (the store)", &r.durable_write);
    out += &format!(
        "\noverhead {:.2} ms (daemon − raw, means), budget {:.2} ms (durable write + 1 ms): {}\n",
        r.overhead_ms,
        r.budget_ms,
        if r.within_target {
            "within target"
        } else {
            "OVER TARGET"
        }
    );
    out
}
