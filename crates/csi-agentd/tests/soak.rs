//! The soak: 16 clients publish and unpublish 8 volumes for 4 workloads (half of them with
//! `bind_to`) through the real API for `SOAK_SECONDS` (default 20), while the plugin is
//! SIGKILLed and the daemon is SIGKILLed and restarted at random moments. Then the node must
//! converge: every claim a client saw acknowledged (and did not try to remove since) is
//! there, published and bound; every claim a client saw removed is gone; the mount table,
//! the plugin's bookkeeping, its processes and the work dir agree with the API; and after
//! every claim is removed, nothing is left mounted or created under the bind root.
//!
//! `SOAK_SEED` replays a run (the seed is printed). Real bind mounts: run as root under
//! `unshare -m --propagation private`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use csi_agent::mounts::require_private_mount_namespace;
use csi_agent_api::ApiClient;
use csi_agent_testkit::node::*;
use csi_agent_testkit::*;

const CLIENTS: usize = 16;
const VOLUMES: usize = 8;
const WORKLOADS: usize = 4;
/// Every request must be answered within this, chaos or not.
const REQUEST_BOUND: Duration = Duration::from_secs(60);
/// The value of the node-stage secret `publish_request` sends.
const SECRET: &str = "crash-matrix";

/// A small xorshift: the run is reproducible from its seed without another dependency.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// What a client knows of its claim after its last request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Belief {
    Claimed,
    Unclaimed,
    /// The last request failed or the daemon died under it: either may be true.
    Unknown,
}

#[derive(Default, Debug)]
struct Stats {
    publish_ok: u64,
    unpublish_ok: u64,
    errors: BTreeMap<String, u64>,
    slowest: Duration,
}

fn volume(i: usize) -> String {
    format!("v{i}")
}

fn workload(i: usize) -> String {
    format!("w{i}")
}

/// Workloads w0 and w1 bind their volumes beneath the bind root.
fn bind_path(bind_root: &Path, volume: &str, workload: &str) -> Option<PathBuf> {
    matches!(workload, "w0" | "w1").then(|| bind_root.join(workload).join(volume).join("data"))
}

fn error_kind(err: &csi_agent_api::ApiError) -> String {
    match err {
        csi_agent_api::ApiError::Api { status, body } if *status >= 422 => {
            format!("{status} {:?}: {}", body.code, body.message)
        }
        csi_agent_api::ApiError::Api { status, body } => format!("{status} {:?}", body.code),
        other if other.is_connection() => "connection".to_owned(),
        other => {
            let text = other.to_string();
            text.chars().take(60).collect()
        }
    }
}

async fn client(
    api: ApiClient,
    pairs: Vec<(String, String)>,
    bind_root: PathBuf,
    seed: u64,
    until: Instant,
    beliefs: Arc<Mutex<BTreeMap<(String, String), Belief>>>,
    stats: Arc<Mutex<Stats>>,
) {
    let mut rng = Rng(seed | 1);
    while Instant::now() < until {
        let (volume, workload) = &pairs[rng.below(pairs.len() as u64) as usize];
        let publish = rng.below(2) == 0;
        let started = Instant::now();
        let outcome = if publish {
            let mut request = publish_with_secrets(volume, workload);
            request.bind_to =
                bind_path(&bind_root, volume, workload).map(|p| p.to_string_lossy().into_owned());
            api.publish(&request).await.map(|_| Belief::Claimed)
        } else {
            api.unpublish(&unpublish_request(volume, workload))
                .await
                .map(|_| Belief::Unclaimed)
        };
        let took = started.elapsed();
        let belief = {
            let mut stats = stats.lock().unwrap();
            stats.slowest = stats.slowest.max(took);
            match &outcome {
                Ok(Belief::Claimed) => stats.publish_ok += 1,
                Ok(_) => stats.unpublish_ok += 1,
                Err(err) => *stats.errors.entry(error_kind(err)).or_default() += 1,
            }
            outcome.as_ref().copied().unwrap_or(Belief::Unknown)
        };
        assert!(
            took < REQUEST_BOUND,
            "{} of {volume} for {workload} took {took:?}",
            if publish { "publish" } else { "unpublish" }
        );
        beliefs
            .lock()
            .unwrap()
            .insert((volume.clone(), workload.clone()), belief);
        if outcome.is_err() {
            // The daemon may be restarting: do not spin on the refused socket.
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

/// Every directory and file under `dir`, relative.
fn tree(dir: &Path) -> BTreeSet<PathBuf> {
    let mut out = BTreeSet::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(next) = stack.pop() {
        for entry in std::fs::read_dir(&next).into_iter().flatten().flatten() {
            let path = entry.path();
            out.insert(path.strip_prefix(dir).unwrap().to_path_buf());
            if entry.file_type().is_ok_and(|t| t.is_dir()) {
                stack.push(path);
            }
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sixteen_clients_under_plugin_and_daemon_kills_converge() {
    require_private_mount_namespace();
    let seconds: u64 = std::env::var("SOAK_SECONDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(20);
    let seed: u64 = std::env::var("SOAK_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos() as u64
        });
    println!("soak: {seconds} s, SOAK_SEED={seed}");

    let volumes: Vec<String> = (0..VOLUMES).map(volume).collect();
    let spec = volumes
        .iter()
        .map(|v| format!("{v}:1Mi"))
        .collect::<Vec<_>>()
        .join(",");
    let mut node = Node::new(&spec);
    let bind_dir = tempfile::Builder::new()
        .prefix("csi-soak-bind-")
        .tempdir_in("/tmp")
        .unwrap();
    let bind_root = bind_dir.path().to_path_buf();
    node.extra = vec!["--bind-root".into(), bind_root.to_string_lossy().into()];
    node.start(None).await;
    node.wait_recovered().await;

    let api = node.api().with_timeout(Some(REQUEST_BOUND));
    let beliefs: Arc<Mutex<BTreeMap<(String, String), Belief>>> = Arc::default();
    let stats: Arc<Mutex<Stats>> = Arc::default();
    let until = Instant::now() + Duration::from_secs(seconds);
    let mut pairs: Vec<Vec<(String, String)>> = vec![Vec::new(); CLIENTS];
    for (i, pair) in (0..VOLUMES)
        .flat_map(|v| (0..WORKLOADS).map(move |w| (volume(v), workload(w))))
        .enumerate()
    {
        pairs[i % CLIENTS].push(pair);
    }
    let mut rng = Rng(seed | 1);
    let clients: Vec<_> = pairs
        .into_iter()
        .map(|pairs| {
            tokio::spawn(client(
                api.clone(),
                pairs,
                bind_root.clone(),
                rng.next(),
                until,
                beliefs.clone(),
                stats.clone(),
            ))
        })
        .collect();

    // Health is asked every 50 ms throughout: while a daemon is up it must answer promptly,
    // however busy the storm keeps it.
    let health = tokio::spawn({
        let api = api.clone();
        async move {
            let mut slowest = Duration::ZERO;
            let mut answered = 0u64;
            while Instant::now() < until {
                let asked = Instant::now();
                if api.health().await.is_ok() {
                    slowest = slowest.max(asked.elapsed());
                    answered += 1;
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            (answered, slowest)
        }
    });

    // The chaos: every 1–3 s, SIGKILL the plugin or SIGKILL and restart the daemon.
    let (mut plugin_kills, mut daemon_kills) = (0u32, 0u32);
    while Instant::now() + Duration::from_secs(1) < until {
        tokio::time::sleep(Duration::from_millis(1000 + rng.below(2000))).await;
        if rng.below(2) == 0 {
            node.kill_plugins().await;
            plugin_kills += 1;
        } else {
            node.kill9();
            tokio::time::sleep(Duration::from_millis(rng.below(300))).await;
            node.start(None).await;
            daemon_kills += 1;
        }
    }
    for client in clients {
        client.await.unwrap();
    }
    let (health_answers, health_slowest) = health.await.unwrap();
    println!("soak: health answered {health_answers} times, slowest {health_slowest:?}");
    assert!(health_answers > 0, "health never answered");
    assert!(
        health_slowest < Duration::from_secs(1),
        "health took {health_slowest:?} during the storm"
    );
    let stats = std::mem::take(&mut *stats.lock().unwrap());
    println!(
        "soak: {plugin_kills} plugin kills, {daemon_kills} daemon kills; {} publishes and {} unpublishes acknowledged, errors {:?}, slowest answer {:?}",
        stats.publish_ok, stats.unpublish_ok, stats.errors, stats.slowest
    );
    assert!(
        stats.publish_ok > 0 && stats.unpublish_ok > 0,
        "the soak did no work: {stats:?}"
    );
    assert!(
        plugin_kills + daemon_kills > 0 || seconds < 3,
        "no chaos happened"
    );
    // A killed daemon refuses connections; a killed plugin is waited for and the call
    // retried. Nothing else may reach a client: no 500 from a race, no plugin error made of
    // a dropped connection.
    let unexpected: Vec<_> = stats
        .errors
        .keys()
        .filter(|kind| *kind != "connection" && !kind.starts_with("503"))
        .collect();
    assert!(unexpected.is_empty(), "unexpected errors: {unexpected:?}");

    // One last restart without chaos, then the node settles.
    node.kill9();
    node.start(None).await;
    node.wait_recovered().await;
    let beliefs = beliefs.lock().unwrap().clone();
    let settled = Mutex::new(Want::new());
    eventually(
        "every claim to be published and every definite belief to hold",
        Duration::from_secs(60),
        || {
            let api = node.api();
            let beliefs = &beliefs;
            let settled = &settled;
            async move {
                let listed = api.volumes().await.map_err(|e| e.to_string())?;
                if let Some(v) = listed.volumes.iter().find(|v| v.state != "PUBLISHED") {
                    return Err(format!("not settled: {v:?}"));
                }
                let claims: BTreeSet<(String, String)> = listed
                    .volumes
                    .iter()
                    .flat_map(|v| v.claims.iter().map(|w| (v.volume_id.clone(), w.clone())))
                    .collect();
                for (pair, belief) in beliefs {
                    let held = claims.contains(pair);
                    match belief {
                        Belief::Claimed if !held => {
                            return Err(format!("acknowledged claim {pair:?} is lost"));
                        }
                        Belief::Unclaimed if held => {
                            return Err(format!("removed claim {pair:?} is back"));
                        }
                        _ => {}
                    }
                }
                let mut want = Want::new();
                for (v, w) in claims {
                    want.entry(v).or_default().insert(w);
                }
                *settled.lock().unwrap() = want;
                Ok(())
            }
        },
    )
    .await;
    let want = settled.into_inner().unwrap();
    let known: Vec<&str> = volumes.iter().map(String::as_str).collect();
    node.converged(&want, &known, "the node after the soak")
        .await;

    // Binds: exactly one mount per claim with bind_to, nothing else under the bind root.
    let mut expected_binds: Vec<PathBuf> = want
        .iter()
        .flat_map(|(v, ws)| ws.iter().filter_map(|w| bind_path(&bind_root, v, w)))
        .collect();
    expected_binds.sort();
    let mut binds = mounts_under(&bind_root);
    binds.sort();
    assert_eq!(binds, expected_binds, "bind mounts after the soak");
    for bind in &expected_binds {
        let volume = bind
            .parent()
            .unwrap()
            .file_name()
            .unwrap()
            .to_str()
            .unwrap();
        let probe = bind.join(".soak-probe");
        std::fs::write(&probe, b"soak").unwrap();
        assert_eq!(
            std::fs::read(node.target(volume).join(".soak-probe")).unwrap(),
            b"soak",
            "{} is not volume {volume}",
            bind.display()
        );
        std::fs::remove_file(&probe).unwrap();
    }

    // Everything removed: nothing mounted, nothing csi-agent created left behind.
    for (v, ws) in &want {
        for w in ws {
            node.unpublish(v, w).await.unwrap();
        }
    }
    node.converged(&Want::new(), &known, "the node after removing every claim")
        .await;
    assert_eq!(mounts_under(&bind_root), Vec::<PathBuf>::new());
    assert_eq!(
        tree(&bind_root),
        BTreeSet::new(),
        "directories created for bind_to are removed with their last claim"
    );

    // Every daemon start appended to the one log: read them all at once.
    let starts = node.starts;
    let log = node.full_log();
    assert!(
        !log.contains("panicked"),
        "a daemon start (of {starts}) panicked: {log}"
    );
    // The node-stage secret every publish carries (`publish_with_secrets`) never reaches a log.
    assert!(
        !log.contains(SECRET),
        "a daemon start (of {starts}) logged the secret"
    );
}
