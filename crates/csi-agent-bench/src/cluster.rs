//! `csi-agent-bench cluster`: cluster mode (docs/cluster.md, issue 28) against single-node
//! mode and the raw RPCs, in one run, on one real etcd member on loopback:
//!
//! 1. latency of publish+unpublish of one volume, interleaved round by round (rotating the
//!    order so drift hits all alike): a daemon in single-node mode, a daemon in cluster mode
//!    (its plugin `"cluster": true`), the raw RPC sequence on the single-node daemon's plugin,
//!    and one etcd round trip (a guarded write: a Txn comparing the key's mod revision, as a
//!    claim's compare-and-swap does) with etcd's own client. Target: cluster − single ≤ 2 etcd
//!    round trips.
//!    A second cluster daemon (n2) on the same backend, which does not lead the plugin's
//!    controller, is measured in the same rounds: its ControllerPublish and
//!    ControllerUnpublish are handed to n1, the leader (docs/cluster.md, "One controller per
//!    plugin").
//! 2. etcd writes per operation: the store's revision read before and after each publish and
//!    each unpublish of the cluster daemon (no other writer meanwhile), and over an idle window
//!    longer than a keepalive interval (keepalives must not write). Target: ≤ 2 per publish.
//! 3. three cluster daemons (n1..n3, each in its own mount namespace, one shared backend with
//!    the volumes pre-provisioned) publishing the volumes together, concurrently, each its
//!    third (`split`), then all racing for every volume (`race`: exactly one may win each, the
//!    others must get 409); then unpublishing. The backend's judge must find no double attach.
//!
//! Every plugin, single-node ones included, runs on a shared backend dir (`--backend-dir`), so
//! the only difference between the single-node and the cluster daemon is cluster mode.
//!
//! It owns this benchmark's setup and figures; it must not change what it measures: the
//! daemons through their API, the plugins through their sockets, etcd through its client.
//! It must not leave anything behind: the daemons and plugins are killed by their guards and
//! the scratch dir, the etcd member by [`EtcdCluster`]'s drop.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use csi_agent::cluster::keys::Keys;
use csi_agent_api::ApiError;
use csi_agent_testkit::BackendJudge;
use csi_agent_testkit::etcd::EtcdCluster;
use csi_etcd::{Compare, CompareOp, ConnectOptions, Txn, TxnOp};
use futures::StreamExt;
use serde::Serialize;

use crate::daemon::{Daemon, DaemonDirs, PluginSpec, publish_request, unpublish_request};
use crate::env::{Env, Machine, NODE_ID, PLUGIN_TYPE, in_private_mount_namespace};
use crate::procs::Scratch;
use crate::raw::Raw;
use crate::stats::Summary;

/// The nodes of the three-daemon run.
const NODES: [&str; 3] = ["n1", "n2", "n3"];
/// Bound of every phase of the three-daemon run (publish all, unpublish all).
const PHASE_TIMEOUT: Duration = Duration::from_secs(600);
/// Bound of the latency rounds altogether.
const LATENCY_TIMEOUT: Duration = Duration::from_secs(900);
/// How long a cluster daemon may take to be present in etcd (its session joined).
const JOIN_TIMEOUT: Duration = Duration::from_secs(30);
/// The size of the value the etcd round trip writes: about a claim's (one entry).
const RTT_VALUE_BYTES: usize = 600;

#[derive(Debug, clap::Args)]
pub struct ClusterArgs {
    /// Measured publish+unpublish cycles per contender (warm-up excluded).
    #[arg(long, default_value_t = 200)]
    pub rounds: usize,
    /// Warm-up cycles per contender, not measured.
    #[arg(long, default_value_t = 10)]
    pub warmup: usize,
    /// Pre-provisioned volumes of the three-daemon run.
    #[arg(long, default_value_t = 1000)]
    pub volumes: usize,
    /// Concurrent API clients per daemon in the three-daemon run.
    #[arg(long, default_value_t = 16)]
    pub concurrency: usize,
    /// The idle window (seconds) over which etcd's revision must not move; longer than the
    /// keepalive interval (a third of the default 10 s lease), so at least one falls in it.
    #[arg(long, default_value_t = 4)]
    pub idle_secs: u64,
    /// Skip the race of the three daemons for the same volumes.
    #[arg(long)]
    pub skip_race: bool,
}

/// One contender's publish, unpublish and their sum, per round.
#[derive(Debug, Serialize)]
pub struct Contender {
    pub publish: Summary,
    pub unpublish: Summary,
    pub cycle: Summary,
}

impl Contender {
    fn of(samples: &[(Duration, Duration)]) -> Self {
        let publish: Vec<Duration> = samples.iter().map(|s| s.0).collect();
        let unpublish: Vec<Duration> = samples.iter().map(|s| s.1).collect();
        let cycle: Vec<Duration> = samples.iter().map(|s| s.0 + s.1).collect();
        Self {
            publish: Summary::of(&publish),
            unpublish: Summary::of(&unpublish),
            cycle: Summary::of(&cycle),
        }
    }
}

#[derive(Debug, Serialize)]
pub struct LatencyReport {
    pub rounds: usize,
    /// A daemon without `--cluster-etcd`.
    pub single: Contender,
    /// A daemon with `--cluster-etcd`, its plugin `"cluster": true`, leading its controller.
    pub cluster: Contender,
    /// A second cluster daemon, not the leader: its controller steps are handed to `cluster`.
    pub handed: Contender,
    /// ControllerPublish, NodeStage, NodePublish and the reverse on the plugin's socket.
    pub raw: Contender,
    /// One guarded write: a Txn comparing the key's mod revision, then a put.
    pub etcd_txn: Summary,
    /// One read of a key (a claim reads its volume's key before its compare-and-swap).
    pub etcd_get: Summary,
    /// cluster − single, cycle p50 and mean, in ms.
    pub overhead_p50_ms: f64,
    pub overhead_mean_ms: f64,
    /// 2 × the etcd round trip's p50 (the target's budget).
    pub budget_p50_ms: f64,
    /// cluster / single, cycle p50.
    pub ratio_p50: f64,
    pub met: bool,
}

#[derive(Debug, Serialize)]
pub struct WritesReport {
    /// etcd revisions per publish: delta → how many publishes had it.
    pub per_publish: BTreeMap<i64, usize>,
    pub per_unpublish: BTreeMap<i64, usize>,
    pub per_publish_mean: f64,
    pub per_unpublish_mean: f64,
    pub per_publish_max: i64,
    pub per_unpublish_max: i64,
    pub idle_secs: u64,
    /// Revisions over the idle window (the daemon running, no request): keepalives only.
    pub idle_writes: i64,
    /// max per publish ≤ 2 and no write while idle.
    pub met: bool,
    /// Where the time goes, from unmeasured cycles after the rounds: etcd's gRPC calls per
    /// publish and per unpublish of the cluster daemon, by method (etcd's own counters).
    pub etcd_calls_per_publish: BTreeMap<String, f64>,
    pub etcd_calls_per_unpublish: BTreeMap<String, f64>,
    /// The daemons' own durable writes per publish / unpublish (its checkpoint counter).
    pub single_durable_writes: (f64, f64),
    pub cluster_durable_writes: (f64, f64),
}

/// The methods of etcd's KV and Lease services a daemon may call.
const ETCD_METHODS: [&str; 6] = [
    "Range",
    "Txn",
    "Put",
    "DeleteRange",
    "LeaseGrant",
    "LeaseKeepAlive",
];
/// Unmeasured cycles that count etcd's calls and the daemons' durable writes.
const COUNT_CYCLES: usize = 20;

/// etcd's handled gRPC calls per method, from its `/metrics` (plain HTTP on the client URL;
/// not a gRPC call, so reading it does not count itself).
fn etcd_calls(client_url: &str) -> anyhow::Result<BTreeMap<String, f64>> {
    use std::io::{Read, Write};
    let address = client_url
        .strip_prefix("http://")
        .with_context(|| format!("etcd URL {client_url} is not http://HOST:PORT"))?;
    let mut stream = std::net::TcpStream::connect(address)
        .with_context(|| format!("cannot connect to etcd's metrics at {address}"))?;
    stream.set_read_timeout(Some(Duration::from_secs(5)))?;
    write!(
        stream,
        "GET /metrics HTTP/1.0\r\nHost: {address}\r\nConnection: close\r\n\r\n"
    )?;
    let mut text = String::new();
    stream
        .read_to_string(&mut text)
        .context("reading etcd's /metrics")?;
    Ok(ETCD_METHODS
        .iter()
        .map(|m| {
            let n = crate::stats::metric(&text, "grpc_server_handled_total", &[("grpc_method", m)])
                .unwrap_or(0.0);
            ((*m).to_owned(), n)
        })
        .collect())
}

/// Per-method differences `after − before`, zeros left out.
fn per_op(before: &BTreeMap<String, f64>, after: &BTreeMap<String, f64>) -> BTreeMap<String, f64> {
    after
        .iter()
        .map(|(m, a)| (m.clone(), a - before.get(m).copied().unwrap_or(0.0)))
        .filter(|(_, d)| *d != 0.0)
        .collect()
}

/// The three-daemon run, one mode.
#[derive(Debug, Serialize)]
pub struct ManyReport {
    /// `split`: each daemon its third; `race`: every daemon every volume.
    pub mode: String,
    pub volumes: usize,
    pub daemons: usize,
    pub concurrency_per_daemon: usize,
    /// Publish requests sent, all daemons.
    pub publish_requests: usize,
    pub published: usize,
    /// Publishes answered 409 (held by another node).
    pub conflicts_409: usize,
    pub publish_wall_s: f64,
    /// Volumes published per second of wall time.
    pub publish_volumes_per_s: f64,
    /// Every publish request's latency (409s included in `race`).
    pub publish: Summary,
    pub unpublish_wall_s: f64,
    pub unpublish_volumes_per_s: f64,
    pub unpublish: Summary,
    /// ControllerPublishVolume calls the shared backend recorded in this mode, and those it
    /// refused (another node holding the volume: only a CO without claims sends those).
    pub controller_publishes: usize,
    pub controller_publishes_refused: usize,
    /// Volumes the backend had attached once every publish answered, and at the end.
    pub attached_after_publish: usize,
    pub attached_after_unpublish: usize,
    /// The backend judge's verdict (the run fails when it is false).
    pub no_double_attach: bool,
    /// Where the publish phase's time goes: the plugins' CSI RPCs as the daemons timed them
    /// (their `csi_agent_rpc_duration_seconds`), per published volume, and their mean.
    pub plugin_rpcs_per_publish: f64,
    pub plugin_rpc_ms_per_publish: f64,
    pub plugin_rpc_mean_ms: f64,
}

/// The daemons' RPC counters summed: (seconds, calls).
async fn rpc_totals(daemons: &[Arc<Daemon>]) -> anyhow::Result<(f64, f64)> {
    let mut total = (0.0, 0.0);
    for daemon in daemons {
        let c = daemon.checkpoint_counters().await?;
        total.0 += c.rpc_sum_s;
        total.1 += c.rpc_count;
    }
    Ok(total)
}

#[derive(Debug, Serialize)]
pub struct ClusterReport {
    pub machine: Machine,
    pub etcd_version: String,
    pub latency: LatencyReport,
    pub writes: WritesReport,
    pub many: Vec<ManyReport>,
}

/// A plugin on a backend dir, with its own node id; `cluster` sets `"cluster": true`.
fn plugin_spec(
    work_dir: &Path,
    backend: &Path,
    node_id: &str,
    volumes: &[&str],
    cluster: bool,
) -> PluginSpec {
    let mut flags = vec!["--backend-dir", path_str(backend), "--node-id", node_id];
    flags.extend_from_slice(volumes);
    let mut spec = PluginSpec::new(PLUGIN_TYPE, work_dir.to_path_buf(), &flags);
    if cluster {
        spec.extra
            .insert("cluster".to_owned(), serde_json::Value::Bool(true));
    }
    spec
}

fn path_str(path: &Path) -> &str {
    path.to_str().unwrap_or_default()
}

fn cluster_flags(endpoints: &str, cluster: &str, node: &str) -> Vec<String> {
    [
        "--cluster-etcd",
        endpoints,
        "--cluster-name",
        cluster,
        "--node-name",
        node,
    ]
    .map(str::to_owned)
    .to_vec()
}

/// The keys written after revision `from` up to `to` (a watch replays them), for a count
/// over the target: what wrote.
async fn written_between(etcd: &csi_etcd::Client, from: i64, to: i64) -> String {
    let replay = async {
        let mut watch = etcd.watch(b"/", true, from + 1).await?;
        let mut seen = Vec::new();
        loop {
            for event in watch.changes().await? {
                let (kind, kv) = match event {
                    csi_etcd::WatchEvent::Put(kv) => ("put", kv),
                    csi_etcd::WatchEvent::Delete(kv) => ("delete", kv),
                };
                if kv.mod_revision > to {
                    return Ok::<_, csi_etcd::EtcdError>(seen.join(", "));
                }
                seen.push(format!(
                    "{kind} {} @{}",
                    String::from_utf8_lossy(&kv.key),
                    kv.mod_revision
                ));
                if kv.mod_revision == to {
                    return Ok(seen.join(", "));
                }
            }
        }
    };
    match tokio::time::timeout(Duration::from_secs(2), replay).await {
        Ok(Ok(keys)) => keys,
        Ok(Err(err)) => format!("not replayed: {err}"),
        Err(_) => "not replayed in 2 s".to_owned(),
    }
}

/// Waits (at most 5 s) until no key is under `prefix`.
async fn settled(etcd: &csi_etcd::Client, prefix: &[u8]) -> anyhow::Result<()> {
    let until = Instant::now() + Duration::from_secs(5);
    while !etcd.get_prefix(prefix, 1).await?.kvs.is_empty() {
        if Instant::now() >= until {
            bail!("the leader left a pending hint for 5 s");
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    Ok(())
}

/// etcd's store revision now (a read's header).
async fn revision(etcd: &csi_etcd::Client) -> anyhow::Result<i64> {
    Ok(etcd
        .get(b"/csi-agent-bench/revision")
        .await
        .context("reading etcd's revision")?
        .revision)
}

/// Waits until `node`'s presence is in etcd: its session joined, cluster publishes allowed.
async fn wait_joined(etcd: &csi_etcd::Client, cluster: &str, node: &str) -> anyhow::Result<()> {
    let key = Keys::new(cluster).node(node);
    let started = Instant::now();
    loop {
        if !etcd.get(&key).await?.kvs.is_empty() {
            return Ok(());
        }
        if started.elapsed() > JOIN_TIMEOUT {
            bail!(
                "node {node} of cluster {cluster} not present in etcd after {JOIN_TIMEOUT:?} (see its daemon's log)"
            );
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Waits until `daemon` sees `node` lead the bench plugin's controller (`GET /v1/cluster`).
async fn wait_leader(daemon: &Daemon, node: &str) -> anyhow::Result<()> {
    let started = Instant::now();
    loop {
        let status = daemon.api.cluster().await?;
        if status
            .leaders
            .iter()
            .any(|l| l.plugin == PLUGIN_TYPE && l.node == node)
        {
            return Ok(());
        }
        if started.elapsed() > JOIN_TIMEOUT {
            bail!(
                "{node} does not lead the plugin's controller after {JOIN_TIMEOUT:?}: {status:?}"
            );
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// One publish+unpublish of `volume`: the first request launches the daemon's plugin (plugins
/// start lazily), whose socket is then known.
async fn launch_plugin(daemon: &Daemon, volume: &str) -> anyhow::Result<std::path::PathBuf> {
    daemon.publish(PLUGIN_TYPE, volume, "launch").await?;
    daemon.unpublish(PLUGIN_TYPE, volume, "launch").await?;
    Ok(daemon.plugin_socket(PLUGIN_TYPE).await?.0)
}

/// One real etcd member on loopback (the test kit's; it panics on failure, turned into an
/// error here).
async fn start_etcd() -> anyhow::Result<EtcdCluster> {
    tokio::task::spawn_blocking(|| EtcdCluster::start(1))
        .await
        .context("cannot start etcd (/usr/bin/etcd, or $CSI_AGENT_ETCD_BIN)")
}

pub async fn run(env: &Env, args: &ClusterArgs) -> anyhow::Result<ClusterReport> {
    if !in_private_mount_namespace() {
        bail!("run under `unshare -m --propagation private` (the publishes bind-mount)");
    }
    if args.rounds == 0 || args.volumes == 0 || args.concurrency == 0 {
        bail!("--rounds, --volumes and --concurrency must be at least 1");
    }
    let scratch = env.scratch("cluster")?;
    let machine = Machine::describe(scratch.path());
    let etcd_server = start_etcd().await?;
    let endpoints = etcd_server.endpoints_flag();
    let etcd = csi_etcd::Client::connect(ConnectOptions {
        endpoints: etcd_server.client_urls(),
        request_timeout: Duration::from_secs(5),
        connect_timeout: Duration::from_secs(2),
        user: None,
        tls: None,
    })
    .await?;
    let etcd_version = etcd
        .status(&etcd_server.client_urls()[0])
        .await
        .map(|s| s.version)
        .unwrap_or_else(|e| format!("unknown ({e})"));

    let (latency, writes) = tokio::time::timeout(
        LATENCY_TIMEOUT,
        latency_and_writes(env, &scratch, &endpoints, &etcd, args),
    )
    .await
    .context("the latency rounds took too long")??;

    let mut many = Vec::new();
    many_daemons(env, &scratch, &endpoints, &etcd, args, &mut many).await?;
    drop(etcd_server);
    Ok(ClusterReport {
        machine,
        etcd_version,
        latency,
        writes,
        many,
    })
}

/// One timed publish + unpublish of the daemon's `vol`.
async fn daemon_cycle(daemon: &Daemon) -> anyhow::Result<(Duration, Duration)> {
    let started = Instant::now();
    daemon.publish(PLUGIN_TYPE, "vol", "w").await?;
    let publish = started.elapsed();
    let started = Instant::now();
    daemon.unpublish(PLUGIN_TYPE, "vol", "w").await?;
    Ok((publish, started.elapsed()))
}

async fn raw_cycle(raw: &Raw) -> anyhow::Result<(Duration, Duration)> {
    let started = Instant::now();
    raw.publish("raw").await?;
    let publish = started.elapsed();
    let started = Instant::now();
    raw.unpublish("raw").await?;
    Ok((publish, started.elapsed()))
}

/// The guarded write of the etcd round trip: put `key` only if its mod revision is still
/// `*last` (0: absent), as a claim's compare-and-swap does; `*last` becomes the new one.
async fn etcd_guarded_write(etcd: &csi_etcd::Client, last: &mut i64) -> anyhow::Result<Duration> {
    let key = b"/csi-agent-bench/rtt".to_vec();
    let txn = Txn::new()
        .when([Compare::ModRevision(key.clone(), CompareOp::Equal, *last)])
        .and_then([TxnOp::Put {
            key,
            value: vec![b'x'; RTT_VALUE_BYTES],
            lease: None,
        }]);
    let started = Instant::now();
    let result = etcd.txn(txn).await.context("the guarded etcd write")?;
    let took = started.elapsed();
    if !result.succeeded {
        bail!("the guarded etcd write lost its compare: another writer on the benchmark's etcd?");
    }
    *last = result.revision;
    Ok(took)
}

async fn latency_and_writes(
    env: &Env,
    scratch: &Scratch,
    endpoints: &str,
    etcd: &csi_etcd::Client,
    args: &ClusterArgs,
) -> anyhow::Result<(LatencyReport, WritesReport)> {
    let single_dirs = DaemonDirs::new(scratch, "single")?;
    single_dirs.add_plugin(
        env,
        &plugin_spec(
            &scratch.join("single-plugin"),
            &scratch.join("single-backend"),
            NODE_ID,
            &["--volumes", "vol:1Mi,raw:1Mi"],
            false,
        ),
    )?;
    let cluster_dirs = DaemonDirs::new(scratch, "cluster")?;
    cluster_dirs.add_plugin(
        env,
        &plugin_spec(
            &scratch.join("cluster-plugin"),
            &scratch.join("cluster-backend"),
            "n1",
            &["--volumes", "vol:1Mi"],
            true,
        ),
    )?;
    let handed_dirs = DaemonDirs::new(scratch, "cluster-n2")?;
    handed_dirs.add_plugin(
        env,
        &plugin_spec(
            &scratch.join("cluster-plugin-n2"),
            &scratch.join("cluster-backend"),
            "n2",
            &["--volumes", "vol:1Mi"],
            true,
        ),
    )?;
    let (single, _) = Daemon::start(env, &single_dirs).await?;
    let (cluster, _) = Daemon::spawn_with(
        env,
        &cluster_dirs,
        &cluster_flags(endpoints, "bench-latency", "n1"),
    )?
    .ready()
    .await?;
    wait_joined(etcd, "bench-latency", "n1").await?;
    let socket = launch_plugin(&single, "vol").await?;
    launch_plugin(&cluster, "vol").await?;
    // n1 leads before n2 starts, so that n2's controller steps are handed to it.
    wait_leader(&cluster, "n1").await?;
    let (handed, _) = Daemon::spawn_with(
        env,
        &handed_dirs,
        &cluster_flags(endpoints, "bench-latency", "n2"),
    )?
    .ready()
    .await?;
    wait_joined(etcd, "bench-latency", "n2").await?;
    launch_plugin(&handed, "vol").await?;
    wait_leader(&handed, "n1").await?;
    let raw = Raw::connect(&socket, scratch.join("raw"), PLUGIN_TYPE).await?;

    let mut last_mod = 0;
    for _ in 0..args.warmup {
        daemon_cycle(&single).await?;
        daemon_cycle(&cluster).await?;
        daemon_cycle(&handed).await?;
        raw_cycle(&raw).await?;
        etcd_guarded_write(etcd, &mut last_mod).await?;
    }
    let (mut s, mut c, mut r, mut h) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let (mut txns, mut gets) = (Vec::new(), Vec::new());
    let (mut per_publish, mut per_unpublish) = (Vec::new(), Vec::new());
    for round in 0..args.rounds {
        for slot in 0..5 {
            match (round + slot) % 5 {
                0 => s.push(daemon_cycle(&single).await?),
                3 => {
                    h.push(daemon_cycle(&handed).await?);
                    // The leader deletes a served hint after it wrote the result, so after n2
                    // has its answer: wait for that write here, or it lands in the next
                    // publish's count of revisions.
                    settled(etcd, &Keys::new("bench-latency").all_pending()).await?;
                }
                1 => {
                    // Revisions read around each step, outside the timings.
                    let r0 = revision(etcd).await?;
                    let started = Instant::now();
                    cluster.publish(PLUGIN_TYPE, "vol", "w").await?;
                    let publish = started.elapsed();
                    let r1 = revision(etcd).await?;
                    let started = Instant::now();
                    cluster.unpublish(PLUGIN_TYPE, "vol", "w").await?;
                    let unpublish = started.elapsed();
                    let r2 = revision(etcd).await?;
                    c.push((publish, unpublish));
                    if r1 - r0 > 2 {
                        eprintln!(
                            "a publish spanned {} etcd revisions: {}",
                            r1 - r0,
                            written_between(etcd, r0, r1).await
                        );
                    }
                    per_publish.push(r1 - r0);
                    per_unpublish.push(r2 - r1);
                }
                2 => r.push(raw_cycle(&raw).await?),
                _ => {
                    txns.push(etcd_guarded_write(etcd, &mut last_mod).await?);
                    let started = Instant::now();
                    revision(etcd).await?;
                    gets.push(started.elapsed());
                }
            }
        }
    }
    // Where the time goes: unmeasured cycles counting etcd's calls (nothing else calls etcd
    // meanwhile: the keepalives are on the lease stream, counted apart) and durable writes.
    let metrics_url = endpoints.split(',').next().unwrap_or_default();
    let (mut calls_publish, mut calls_unpublish) = (BTreeMap::new(), BTreeMap::new());
    let (c0, s0) = (
        cluster.checkpoint_counters().await?,
        single.checkpoint_counters().await?,
    );
    let (mut c_publish, mut s_publish) = (0.0, 0.0);
    for _ in 0..COUNT_CYCLES {
        let m0 = etcd_calls(metrics_url)?;
        let before = cluster.checkpoint_counters().await?;
        cluster.publish(PLUGIN_TYPE, "vol", "w").await?;
        let m1 = etcd_calls(metrics_url)?;
        c_publish += cluster.checkpoint_counters().await?.since(&before).writes;
        cluster.unpublish(PLUGIN_TYPE, "vol", "w").await?;
        let m2 = etcd_calls(metrics_url)?;
        for (sum, (a, b)) in [
            (&mut calls_publish, (&m0, &m1)),
            (&mut calls_unpublish, (&m1, &m2)),
        ] {
            for (m, d) in per_op(a, b) {
                *sum.entry(m).or_insert(0.0) += d;
            }
        }
        let before = single.checkpoint_counters().await?;
        single.publish(PLUGIN_TYPE, "vol", "w").await?;
        s_publish += single.checkpoint_counters().await?.since(&before).writes;
        single.unpublish(PLUGIN_TYPE, "vol", "w").await?;
    }
    let n = COUNT_CYCLES as f64;
    for sum in [&mut calls_publish, &mut calls_unpublish] {
        sum.values_mut().for_each(|v| *v /= n);
    }
    let c_all = cluster.checkpoint_counters().await?.since(&c0).writes;
    let s_all = single.checkpoint_counters().await?.since(&s0).writes;
    let cluster_durable_writes = (c_publish / n, (c_all - c_publish) / n);
    let single_durable_writes = (s_publish / n, (s_all - s_publish) / n);

    let idle_start = revision(etcd).await?;
    tokio::time::sleep(Duration::from_secs(args.idle_secs)).await;
    let idle_writes = revision(etcd).await? - idle_start;
    single.stop().await?;
    handed.stop().await?;
    cluster.stop().await?;

    let (single, cluster, raw) = (Contender::of(&s), Contender::of(&c), Contender::of(&r));
    let handed = Contender::of(&h);
    let (etcd_txn, etcd_get) = (Summary::of(&txns), Summary::of(&gets));
    let overhead_p50_ms = cluster.cycle.p50_ms - single.cycle.p50_ms;
    let budget_p50_ms = 2.0 * etcd_txn.p50_ms;
    let latency = LatencyReport {
        rounds: args.rounds,
        overhead_p50_ms,
        overhead_mean_ms: cluster.cycle.mean_ms - single.cycle.mean_ms,
        budget_p50_ms,
        ratio_p50: cluster.cycle.p50_ms / single.cycle.p50_ms,
        met: overhead_p50_ms <= budget_p50_ms,
        single,
        cluster,
        handed,
        raw,
        etcd_txn,
        etcd_get,
    };
    let histogram = |deltas: &[i64]| {
        let mut map = BTreeMap::new();
        for &d in deltas {
            *map.entry(d).or_insert(0) += 1;
        }
        map
    };
    let mean = |deltas: &[i64]| deltas.iter().sum::<i64>() as f64 / deltas.len().max(1) as f64;
    let per_publish_max = per_publish.iter().copied().max().unwrap_or(0);
    let writes = WritesReport {
        per_publish: histogram(&per_publish),
        per_unpublish: histogram(&per_unpublish),
        per_publish_mean: mean(&per_publish),
        per_unpublish_mean: mean(&per_unpublish),
        per_publish_max,
        per_unpublish_max: per_unpublish.iter().copied().max().unwrap_or(0),
        idle_secs: args.idle_secs,
        idle_writes,
        met: per_publish_max <= 2 && idle_writes == 0,
        etcd_calls_per_publish: calls_publish,
        etcd_calls_per_unpublish: calls_unpublish,
        single_durable_writes,
        cluster_durable_writes,
    };
    Ok((latency, writes))
}

/// The three daemons n1..n3 on one shared backend, one mount namespace each; the split and
/// (unless skipped) the race, each judged by the backend.
async fn many_daemons(
    env: &Env,
    scratch: &Scratch,
    endpoints: &str,
    etcd: &csi_etcd::Client,
    args: &ClusterArgs,
    reports: &mut Vec<ManyReport>,
) -> anyhow::Result<()> {
    let backend = scratch.join("many-backend");
    let series = format!("v:{}:1Mi", args.volumes);
    let wrapper: Vec<String> = ["unshare", "-m", "--propagation", "private"]
        .map(str::to_owned)
        .to_vec();
    let mut daemons = Vec::new();
    for node in NODES {
        let dirs = DaemonDirs::new(scratch, &format!("many-{node}"))?;
        dirs.add_plugin(
            env,
            &plugin_spec(
                &scratch.join(&format!("many-{node}-plugin")),
                &backend,
                node,
                &[
                    "--volume-series",
                    series.as_str(),
                    "--volumes",
                    "launch:1Mi",
                    // The plugin's own `state.json` in memory: with `--backend-dir`, its
                    // per-call sync with the backend rewrites that file outside its writer
                    // slot, and concurrent calls then race on its temp file (INTERNAL
                    // "renaming onto state.json"). The shared backend stays durable.
                    "--volatile-state",
                ],
                true,
            ),
        )?;
        let (daemon, _) = Daemon::spawn_wrapped(
            env,
            &dirs,
            &wrapper,
            &cluster_flags(endpoints, "bench-many", node),
        )?
        .ready()
        .await?;
        wait_joined(etcd, "bench-many", node).await?;
        // The plugin's start pre-provisions the series in the shared backend.
        // One after the other: each plugin's start pre-provisions the series in the shared
        // backend (idempotent, but three at once would only measure the file system).
        launch_plugin(&daemon, "launch").await?;
        daemons.push(Arc::new(daemon));
    }
    let volumes: Vec<String> = (0..args.volumes).map(|i| format!("v{i:05}")).collect();
    let judge = BackendJudge::new(&backend);

    // Split: daemon i publishes volumes i, i+3, i+6, …
    let split: Vec<Vec<String>> = (0..NODES.len())
        .map(|d| {
            volumes
                .iter()
                .skip(d)
                .step_by(NODES.len())
                .cloned()
                .collect()
        })
        .collect();
    reports.push(many_round("split", &daemons, &split, &judge, args).await?);
    if !args.skip_race {
        let race: Vec<Vec<String>> = NODES.iter().map(|_| volumes.clone()).collect();
        reports.push(many_round("race", &daemons, &race, &judge, args).await?);
    }
    for daemon in daemons {
        if let Ok(daemon) = Arc::try_unwrap(daemon) {
            daemon.stop().await?;
        }
    }
    Ok(())
}

/// How one publish of the three-daemon run ended.
enum Outcome {
    Published,
    Conflict,
}

/// Sends `requests` to `daemon` with at most `concurrency` in flight; each request's
/// latency and outcome.
async fn fan_out<F, Fut>(
    requests: &[String],
    concurrency: usize,
    call: F,
) -> anyhow::Result<Vec<(String, Duration, Outcome)>>
where
    F: Fn(String) -> Fut,
    Fut: std::future::Future<Output = Result<(), ApiError>>,
{
    let results: Vec<anyhow::Result<(String, Duration, Outcome)>> =
        futures::stream::iter(requests.iter().cloned())
            .map(|volume| {
                let call = &call;
                async move {
                    let started = Instant::now();
                    let result = call(volume.clone()).await;
                    let took = started.elapsed();
                    match result {
                        Ok(()) => Ok((volume, took, Outcome::Published)),
                        Err(ApiError::Api { status: 409, .. }) => {
                            Ok((volume, took, Outcome::Conflict))
                        }
                        Err(err) => {
                            Err(anyhow::Error::new(err).context(format!("volume {volume}")))
                        }
                    }
                }
            })
            .buffer_unordered(concurrency)
            .collect()
            .await;
    results.into_iter().collect()
}

async fn many_round(
    mode: &str,
    daemons: &[Arc<Daemon>],
    per_daemon: &[Vec<String>],
    judge: &BackendJudge,
    args: &ClusterArgs,
) -> anyhow::Result<ManyReport> {
    let calls_before = judge.calls().len();
    let concurrency = args.concurrency;

    let rpc_before = rpc_totals(daemons).await?;
    let started = Instant::now();
    let publishes = futures::future::join_all(daemons.iter().zip(per_daemon).map(
        |(daemon, volumes)| async move {
            fan_out(volumes, concurrency, |volume| async move {
                daemon
                    .api
                    .publish(&publish_request(PLUGIN_TYPE, &volume, "w"))
                    .await
                    .map(|_| ())
            })
            .await
        },
    ));
    let publishes = tokio::time::timeout(PHASE_TIMEOUT, publishes)
        .await
        .with_context(|| format!("{mode}: the publishes took over {PHASE_TIMEOUT:?}"))?;
    let publish_wall = started.elapsed();
    let rpc_after = rpc_totals(daemons).await?;
    let (rpc_s, rpc_n) = (rpc_after.0 - rpc_before.0, rpc_after.1 - rpc_before.1);
    let mut won: Vec<Vec<String>> = Vec::new();
    let mut latencies = Vec::new();
    let mut winners: BTreeMap<String, usize> = BTreeMap::new();
    let mut conflicts = 0;
    for (node, outcomes) in NODES.iter().zip(publishes) {
        let outcomes = outcomes.with_context(|| format!("{mode}: a publish on {node}"))?;
        let mut mine = Vec::new();
        for (volume, took, outcome) in outcomes {
            latencies.push(took);
            match outcome {
                Outcome::Published => {
                    *winners.entry(volume.clone()).or_insert(0) += 1;
                    mine.push(volume);
                }
                Outcome::Conflict => conflicts += 1,
            }
        }
        won.push(mine);
    }
    let expected: usize = per_daemon
        .iter()
        .flatten()
        .collect::<std::collections::BTreeSet<_>>()
        .len();
    if winners.len() != expected || winners.values().any(|&n| n != 1) {
        let doubles: Vec<_> = winners.iter().filter(|(_, n)| **n != 1).take(5).collect();
        bail!(
            "{mode}: {} of {expected} volumes published, exactly one node each expected; won by several: {doubles:?}",
            winners.len()
        );
    }
    let verdict_after_publish = verdict(judge);
    let attached_after_publish = judge.attachments().len();

    let started = Instant::now();
    let unpublishes = futures::future::join_all(daemons.iter().zip(&won).map(
        |(daemon, volumes)| async move {
            fan_out(volumes, concurrency, |volume| async move {
                daemon
                    .api
                    .unpublish(&unpublish_request(PLUGIN_TYPE, &volume, "w"))
                    .await
                    .map(|_| ())
            })
            .await
        },
    ));
    let unpublishes = tokio::time::timeout(PHASE_TIMEOUT, unpublishes)
        .await
        .with_context(|| format!("{mode}: the unpublishes took over {PHASE_TIMEOUT:?}"))?;
    let unpublish_wall = started.elapsed();
    let mut unpublish_latencies = Vec::new();
    for (node, outcomes) in NODES.iter().zip(unpublishes) {
        for (volume, took, outcome) in
            outcomes.with_context(|| format!("{mode}: an unpublish on {node}"))?
        {
            if matches!(outcome, Outcome::Conflict) {
                bail!("{mode}: the unpublish of {volume} on {node} answered 409");
            }
            unpublish_latencies.push(took);
        }
    }
    let verdict_at_end = verdict(judge);
    let calls = judge.calls();
    let controller: Vec<_> = calls[calls_before.min(calls.len())..]
        .iter()
        .filter(|c| c.rpc == "ControllerPublishVolume")
        .collect();
    let report = ManyReport {
        mode: mode.to_owned(),
        volumes: expected,
        daemons: daemons.len(),
        concurrency_per_daemon: concurrency,
        publish_requests: latencies.len(),
        published: winners.len(),
        conflicts_409: conflicts,
        publish_wall_s: publish_wall.as_secs_f64(),
        publish_volumes_per_s: winners.len() as f64 / publish_wall.as_secs_f64(),
        publish: Summary::of(&latencies),
        unpublish_wall_s: unpublish_wall.as_secs_f64(),
        unpublish_volumes_per_s: unpublish_latencies.len() as f64 / unpublish_wall.as_secs_f64(),
        unpublish: Summary::of(&unpublish_latencies),
        controller_publishes: controller.len(),
        controller_publishes_refused: controller.iter().filter(|c| c.outcome != "OK").count(),
        attached_after_publish,
        attached_after_unpublish: judge.attachments().len(),
        no_double_attach: verdict_after_publish.is_ok() && verdict_at_end.is_ok(),
        plugin_rpcs_per_publish: rpc_n / winners.len() as f64,
        plugin_rpc_ms_per_publish: rpc_s * 1e3 / winners.len() as f64,
        plugin_rpc_mean_ms: rpc_s * 1e3 / rpc_n.max(1.0),
    };
    if let Err(why) = verdict_after_publish.and(verdict_at_end) {
        bail!("{mode}: the shared backend saw a double attach: {why}");
    }
    Ok(report)
}

/// The backend judge's verdict; its panic (a double attach) as an error.
fn verdict(judge: &BackendJudge) -> Result<(), String> {
    let judge = judge.clone();
    std::panic::catch_unwind(move || judge.assert_no_double_attach()).map_err(|panic| {
        panic
            .downcast_ref::<String>()
            .cloned()
            .unwrap_or_else(|| "the judge panicked without a message".to_owned())
    })
}

/// The markdown tables of docs/benchmarks.md.
pub fn table(r: &ClusterReport) -> String {
    let l = &r.latency;
    let row = |name: &str, s: &Summary| {
        format!(
            "| {name} | {:.2} | {:.2} | {:.2} |\n",
            s.p50_ms, s.p90_ms, s.mean_ms
        )
    };
    let mut out =
        String::from("| publish+unpublish | p50 ms | p90 ms | mean ms |\n|---|---|---|---|\n");
    out.push_str(&row("single-node daemon", &l.single.cycle));
    out.push_str(&row(
        "cluster daemon, the leader (1 etcd member)",
        &l.cluster.cycle,
    ));
    out.push_str(&row(
        "cluster daemon, steps handed to the leader",
        &l.handed.cycle,
    ));
    out.push_str(&row("raw CSI RPCs", &l.raw.cycle));
    out.push_str(&row("one guarded etcd write (Txn)", &l.etcd_txn));
    out.push_str(&row("one etcd read", &l.etcd_get));
    out.push_str(&row("— single-node publish", &l.single.publish));
    out.push_str(&row("— cluster publish", &l.cluster.publish));
    out.push_str(&row("— single-node unpublish", &l.single.unpublish));
    out.push_str(&row("— cluster unpublish", &l.cluster.unpublish));
    out.push_str(&row("— handed-over publish", &l.handed.publish));
    out.push_str(&row("— handed-over unpublish", &l.handed.unpublish));
    out.push_str(&format!(
        "\n{} rounds, interleaved; cluster − single at p50: {:.2} ms (mean {:.2} ms), cluster/single {:.2}×; target ≤ 2 etcd round trips = {:.2} ms: {}\n",
        l.rounds,
        l.overhead_p50_ms,
        l.overhead_mean_ms,
        l.ratio_p50,
        l.budget_p50_ms,
        met(l.met)
    ));
    let w = &r.writes;
    out.push_str(&format!(
        "\netcd writes (revisions) per publish: mean {:.2}, max {} ({:?}); per unpublish: mean {:.2}, max {} ({:?}); over {} s idle: {}. Target ≤ 2 per publish, none idle: {}\n",
        w.per_publish_mean,
        w.per_publish_max,
        w.per_publish,
        w.per_unpublish_mean,
        w.per_unpublish_max,
        w.per_unpublish,
        w.idle_secs,
        w.idle_writes,
        met(w.met)
    ));
    out.push_str(&format!(
        "\nWhere the time goes ({COUNT_CYCLES} unmeasured cycles): etcd calls per cluster publish {}, per unpublish {}; durable writes per publish / unpublish: single-node {:.1} / {:.1}, cluster {:.1} / {:.1}\n",
        calls(&w.etcd_calls_per_publish),
        calls(&w.etcd_calls_per_unpublish),
        w.single_durable_writes.0,
        w.single_durable_writes.1,
        w.cluster_durable_writes.0,
        w.cluster_durable_writes.1,
    ));
    out.push_str(
        "\n| three daemons | volumes | requests | published | 409s | publish wall s | volumes/s | publish p50 ms | p99 ms | unpublish wall s | unpublish p50 ms | p99 ms | ControllerPublish (refused) | double attach |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n",
    );
    for m in &r.many {
        out.push_str(&format!(
            "| {} ({}×{} clients) | {} | {} | {} | {} | {:.2} | {:.0} | {:.1} | {:.1} | {:.2} | {:.1} | {:.1} | {} ({}) | {} |\n",
            m.mode,
            m.daemons,
            m.concurrency_per_daemon,
            m.volumes,
            m.publish_requests,
            m.published,
            m.conflicts_409,
            m.publish_wall_s,
            m.publish_volumes_per_s,
            m.publish.p50_ms,
            m.publish.p99_ms,
            m.unpublish_wall_s,
            m.unpublish.p50_ms,
            m.unpublish.p99_ms,
            m.controller_publishes,
            m.controller_publishes_refused,
            if m.no_double_attach { "none" } else { "FOUND" }
        ));
    }
    for m in &r.many {
        out.push_str(&format!(
            "\n{}: publish mean {:.1} ms, of which the plugin's CSI RPCs {:.1} ms ({:.1} RPCs per published volume, {:.1} ms each on average, as the daemons timed them)\n",
            m.mode,
            m.publish.mean_ms,
            m.plugin_rpc_ms_per_publish,
            m.plugin_rpcs_per_publish,
            m.plugin_rpc_mean_ms
        ));
    }
    out
}

/// `Range 3, Txn 2`.
fn calls(per_method: &BTreeMap<String, f64>) -> String {
    per_method
        .iter()
        .map(|(m, n)| format!("{m} {n:.2}"))
        .collect::<Vec<_>>()
        .join(", ")
}

fn met(ok: bool) -> &'static str {
    if ok { "met" } else { "NOT met" }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    #[test]
    fn a_planted_double_attach_fails_the_verdict() {
        let dir = tempfile::tempdir().unwrap();
        let judge = BackendJudge::new(dir.path());
        let one = r#"{"v00001": {"nodes": ["n1"], "access_mode": "SINGLE_NODE_WRITER", "staged": ["n1"]}}"#;
        std::fs::write(dir.path().join("attachments.json"), one).unwrap();
        verdict(&judge).unwrap();
        let two = r#"{"v00001": {"nodes": ["n1", "n2"], "access_mode": "SINGLE_NODE_WRITER", "staged": ["n1"]}}"#;
        std::fs::write(dir.path().join("attachments.json"), two).unwrap();
        let why = verdict(&judge).unwrap_err();
        assert!(why.contains("v00001") && why.contains("n2"), "{why}");
    }

    #[test]
    fn calls_per_operation_are_differences_without_zeros() {
        let counts = |pairs: &[(&str, f64)]| -> BTreeMap<String, f64> {
            pairs.iter().map(|(m, n)| ((*m).to_owned(), *n)).collect()
        };
        let before = counts(&[("Range", 10.0), ("Txn", 4.0), ("Put", 1.0)]);
        let after = counts(&[
            ("Range", 13.0),
            ("Txn", 6.0),
            ("Put", 1.0),
            ("LeaseGrant", 1.0),
        ]);
        let delta = per_op(&before, &after);
        assert_eq!(
            delta,
            counts(&[("Range", 3.0), ("Txn", 2.0), ("LeaseGrant", 1.0)])
        );
        assert_eq!(calls(&delta), "LeaseGrant 1.00, Range 3.00, Txn 2.00");
    }

    #[test]
    fn contenders_sum_publish_and_unpublish_per_round() {
        let ms = Duration::from_millis;
        let c = Contender::of(&[(ms(2), ms(3)), (ms(4), ms(1))]);
        assert_eq!(c.publish.n, 2);
        assert!((c.publish.mean_ms - 3.0).abs() < 1e-9);
        assert!((c.unpublish.mean_ms - 2.0).abs() < 1e-9);
        assert!((c.cycle.min_ms - 5.0).abs() < 1e-9);
        assert!((c.cycle.max_ms - 5.0).abs() < 1e-9);
    }
}
