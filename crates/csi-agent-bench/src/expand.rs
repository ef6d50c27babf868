//! `csi-agent-bench expand`: the latency of a volume expansion through the daemon
//! (`POST /v1/volumes/{plugin}/{volume_id}/expand`) against the raw RPCs a minimal CO sends
//! (ControllerExpandVolume then NodeExpandVolume on the same plugin socket), side by side on
//! one published volume, each round growing it by 1 MiB for real (the plugin records the new
//! capacity durably). Also the cost of one durable write (a 1 KiB file written, fsynced,
//! renamed, its directory fsynced) on the same file system: the target is daemon ≤
//! raw + one durable write + 1 ms.
//!
//! It owns this benchmark's setup and figures; it must not change what it measures (no
//! engine internals: the daemon through its API, the plugin through its socket).

use std::io::Write;
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use csi_agent::client::{ClientOptions, CsiClient};
use csi_proto::v1;
use serde::Serialize;

use crate::daemon::{Daemon, DaemonDirs, PluginSpec};
use crate::env::{Env, PLUGIN_TYPE, in_private_mount_namespace};
use crate::stats::Summary;

const MI: i64 = 1 << 20;

#[derive(Debug, clap::Args)]
pub struct ExpandArgs {
    /// Expansions per contender.
    #[arg(long, default_value_t = 50)]
    pub rounds: usize,
}

#[derive(Debug, Serialize)]
pub struct ExpandReport {
    pub rounds: usize,
    /// ControllerExpandVolume + NodeExpandVolume, sequentially, on the plugin's socket.
    pub raw: Summary,
    /// `POST /v1/volumes/{plugin}/{volume_id}/expand` on the daemon's unix socket.
    pub daemon: Summary,
    /// One durable write of 1 KiB on the daemon's work dir file system.
    pub durable_write: Summary,
    /// daemon p50 − raw p50, in ms.
    pub overhead_p50_ms: f64,
    /// Target: raw p50 + durable write p50 + 1 ms.
    pub target_p50_ms: f64,
}

fn range(bytes: i64) -> Option<v1::CapacityRange> {
    Some(v1::CapacityRange {
        required_bytes: bytes,
        limit_bytes: 0,
    })
}

/// One durable write: the shape of csi-agent's file writes (temp file, fsync, rename,
/// directory fsync).
fn durable_write(dir: &Path, i: usize) -> anyhow::Result<Duration> {
    let started = Instant::now();
    let tmp = dir.join(format!(".w{i}.tmp"));
    let mut file = std::fs::File::create(&tmp)?;
    file.write_all(&[b'x'; 1024])?;
    file.sync_all()?;
    std::fs::rename(&tmp, dir.join("w"))?;
    std::fs::File::open(dir)?.sync_all()?;
    Ok(started.elapsed())
}

pub async fn run(env: &Env, args: &ExpandArgs) -> anyhow::Result<ExpandReport> {
    if !in_private_mount_namespace() {
        bail!("run under `unshare -m --propagation private` (the publish bind-mounts)");
    }
    let scratch = env.scratch("expand")?;
    let dirs = DaemonDirs::new(&scratch, "daemon")?;
    let spec = PluginSpec::new(
        PLUGIN_TYPE,
        scratch.join("plugin"),
        &[
            "--volumes",
            "vol:1Mi",
            "--expansion",
            "online",
            "--controller-expand",
            "--node-expand",
        ],
    );
    dirs.add_plugin(env, &spec)?;
    let (daemon, _) = Daemon::start(env, &dirs).await?;
    let published = daemon
        .api
        .publish(&crate::daemon::publish_request(PLUGIN_TYPE, "vol", "w"))
        .await
        .context("publishing the volume to expand")?;
    let (socket, _) = daemon.plugin_socket(PLUGIN_TYPE).await?;
    let client = CsiClient::connect(&socket, ClientOptions::default()).await?;
    let (mut raw, mut via_daemon, mut writes) = (Vec::new(), Vec::new(), Vec::new());
    let mut size = MI;
    for i in 0..args.rounds {
        size += MI;
        let started = Instant::now();
        let answer = client
            .controller_expand_volume(v1::ControllerExpandVolumeRequest {
                volume_id: "vol".to_owned(),
                capacity_range: range(size),
                ..Default::default()
            })
            .await?;
        if answer.node_expansion_required {
            client
                .node_expand_volume(v1::NodeExpandVolumeRequest {
                    volume_id: "vol".to_owned(),
                    volume_path: published.target_path.clone(),
                    capacity_range: range(size),
                    ..Default::default()
                })
                .await?;
        }
        raw.push(started.elapsed());

        size += MI;
        let started = Instant::now();
        let volume = daemon.api.expand_volume(PLUGIN_TYPE, "vol", size).await?;
        via_daemon.push(started.elapsed());
        if volume.capacity_bytes != Some(size) {
            bail!("the daemon's expansion answered {volume:?}, not {size} bytes");
        }
        writes.push(durable_write(&dirs.work_dir, i)?);
    }
    daemon.unpublish(PLUGIN_TYPE, "vol", "w").await?;
    daemon.stop().await?;
    let (raw, daemon, durable_write) = (
        Summary::of(&raw),
        Summary::of(&via_daemon),
        Summary::of(&writes),
    );
    Ok(ExpandReport {
        rounds: args.rounds,
        overhead_p50_ms: daemon.p50_ms - raw.p50_ms,
        target_p50_ms: raw.p50_ms + durable_write.p50_ms + 1.0,
        raw,
        daemon,
        durable_write,
    })
}

/// The markdown table of docs/benchmarks.md.
pub fn table(r: &ExpandReport) -> String {
    let row = |name: &str, s: &Summary| {
        format!(
            "| {name} | {:.2} | {:.2} | {:.2} |\n",
            s.p50_ms, s.p99_ms, s.mean_ms
        )
    };
    let mut out = String::from("| expansion | p50 ms | p99 ms | mean ms |\n|---|---|---|---|\n");
    out.push_str(&row("raw ControllerExpand + NodeExpand", &r.raw));
    out.push_str(&row("daemon POST …/expand", &r.daemon));
    out.push_str(&row("one durable write (1 KiB)", &r.durable_write));
    out.push_str(&format!(
        "\n{} rounds; daemon − raw at p50: {:.2} ms; target (raw + one durable write + 1 ms) at p50: {:.2} ms: {}\n",
        r.rounds,
        r.overhead_p50_ms,
        r.target_p50_ms,
        if r.daemon.p50_ms <= r.target_p50_ms { "met" } else { "NOT met" }
    ));
    out
}
