//! Cluster mode under chaos (issue 28: "1,000 random publishes and unpublishes"): one etcd
//! member, three real csi-agentd daemons in mount namespaces of their own on one shared
//! backend, 1,000 random publishes and unpublishes of a dozen volumes, and a daemon SIGKILLed
//! every 40 operations or so (sometimes while a publish of its is in flight), then restarted
//! on its work dir and namespace.
//!
//! Judged only by what does not depend on which daemon sends the controller RPCs: the API's
//! answers, the backend's records ([`BackendJudge`]: never a single-node volume attached or
//! staged on two nodes, never a refused node-side attach, every answered publish attached to
//! its node until it is unpublished), and at the end etcd's keys and the nodes' mounts: once
//! every workload is unpublished, no claim, no attachment and no mount is left.
//!
//! The seed is printed first; `CHAOS_SEED=N` replays the same choices (the timing of the
//! kills, and the answers that depend on it, may still differ). `CHAOS_LOG=FILE` writes every
//! operation and its answer there; a failure shows the last 60.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod cluster_support;

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use csi_agent_api::{ApiClient, ApiError, PublishRequest};
use csi_agent_testkit::backend::BackendJudge;
use csi_agent_testkit::etcd::EtcdCluster;
use csi_agent_testkit::unpublish_request;

use cluster_support::*;

const NODES: [&str; 3] = ["n1", "n2", "n3"];
const OPS: usize = 1000;
/// Volumes `sw00`.. (SINGLE_NODE_WRITER), then `mr00`.. (MULTI_NODE_READER_ONLY).
const WRITERS: usize = 9;
const READERS: usize = 3;
/// Workloads `w0`.. a node may publish a volume for.
const WORKLOADS: usize = 3;
/// A daemon is SIGKILLed every this many operations, on average.
const KILL_EVERY: usize = 40;
/// An operation in flight is killed up to this many milliseconds after it was sent (a publish
/// that gets as far as the mounts takes 12 to 35 ms on 2 busy cores).
const KILL_WITHIN_MS: usize = 15;
/// A request without an answer for this long fails the test (unless its daemon was killed).
const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);
/// How long the final unpublishes retry, and how long the cluster then has to converge.
const SETTLE: Duration = Duration::from_secs(30);

fn volume_name(volume: usize) -> String {
    if volume < WRITERS {
        format!("sw{volume:02}")
    } else {
        format!("mr{:02}", volume - WRITERS)
    }
}

fn single_node(volume: usize) -> bool {
    volume < WRITERS
}

fn publish_of(volume: usize, workload: &str) -> PublishRequest {
    let name = volume_name(volume);
    if single_node(volume) {
        with_mode(&name, workload, "SINGLE_NODE_WRITER", false)
    } else {
        with_mode(&name, workload, "MULTI_NODE_READER_ONLY", true)
    }
}

/// xorshift64, its state from splitmix64 of the seed (any seed, 0 included, gives a non-zero
/// state).
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Rng {
        let mut z = seed.wrapping_add(0x9E37_79B9_7F4A_7C15);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        Rng((z ^ (z >> 31)) | 1)
    }

    fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        x
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    fn percent(&mut self, p: u64) -> bool {
        self.next() % 100 < p
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Kind {
    Publish,
    Unpublish,
}

#[derive(Clone, Debug)]
struct Op {
    kind: Kind,
    node: usize,
    volume: usize,
    workload: String,
}

impl Op {
    fn key(&self) -> Held {
        (self.node, self.volume, self.workload.clone())
    }
}

impl fmt::Display for Op {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let kind = match self.kind {
            Kind::Publish => "publish",
            Kind::Unpublish => "unpublish",
        };
        write!(
            f,
            "{kind} {}/{} on {}",
            volume_name(self.volume),
            self.workload,
            NODES[self.node]
        )
    }
}

/// The accepted answers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Outcome {
    Ok,
    /// 409: held elsewhere.
    Conflict,
    /// 503: the cluster is unavailable to the node.
    Unavailable,
    /// No answer: the daemon was killed while the request ran.
    Lost,
}

/// (node, volume, workload) of a publish.
type Held = (usize, usize, String);

/// Sends `op` to `api`; the answer in short.
async fn send(api: ApiClient, op: Op) -> Result<String, ApiError> {
    match op.kind {
        Kind::Publish => api
            .publish(&publish_of(op.volume, &op.workload))
            .await
            .map(|r| r.state),
        Kind::Unpublish => api
            .unpublish(&unpublish_request(&volume_name(op.volume), &op.workload))
            .await
            .map(|r| format!("{} was_claimed={}", r.state, r.was_claimed)),
    }
}

fn classify(answer: &Result<String, ApiError>, killed: bool) -> Option<Outcome> {
    match answer {
        Ok(_) => Some(Outcome::Ok),
        Err(ApiError::Api { status: 409, .. }) => Some(Outcome::Conflict),
        Err(ApiError::Api { status: 503, .. }) => Some(Outcome::Unavailable),
        Err(e) if killed && e.is_connection() => Some(Outcome::Lost),
        Err(_) => None,
    }
}

fn short(answer: &Result<String, ApiError>) -> String {
    match answer {
        Ok(state) => format!("ok {state}"),
        Err(ApiError::Api { status, body }) => format!("{status} {}", body.message),
        Err(e) => format!("error: {e}"),
    }
}

/// The run: the seed, what every operation answered, and what the answers say is published.
struct Chaos {
    seed: u64,
    started: Instant,
    log: Vec<String>,
    outcomes: BTreeMap<(Kind, Outcome), usize>,
    /// Publishes answered OK and not unpublished since.
    confirmed: BTreeSet<Held>,
    /// Publishes (or unpublishes) whose effect is unknown: lost, or answered 503.
    maybe: BTreeSet<Held>,
    /// 409s to publishes while no other node held the volume by the model.
    unexplained_conflicts: Vec<String>,
    kills: usize,
    kills_in_flight: usize,
    /// Of those, the operations the kill left without an answer.
    kills_lost: usize,
    /// Total time and count of the operations answered OK (no kill), by kind.
    took_ok: BTreeMap<Kind, (Duration, u32)>,
    rejoin_max: Duration,
    rejoin_total: Duration,
    slowest_op: (Duration, String),
    judge: BackendJudge,
}

impl Chaos {
    /// Fails the test with the seed, `what`, and the last operations.
    fn fail(&self, what: &str) -> ! {
        self.save_log();
        let tail = &self.log[self.log.len().saturating_sub(60)..];
        panic!(
            "CHAOS_SEED={} after {:?}: {what}\nthe last {} operations:\n  {}",
            self.seed,
            self.started.elapsed(),
            tail.len(),
            tail.join("\n  ")
        );
    }

    /// With `CHAOS_LOG=FILE`, writes every operation and its answer there.
    fn save_log(&self) {
        if let Some(file) = std::env::var_os("CHAOS_LOG") {
            let text = format!("CHAOS_SEED={}\n{}\n", self.seed, self.log.join("\n"));
            if let Err(e) = std::fs::write(&file, text) {
                eprintln!("CHAOS_LOG={}: {e}", file.to_string_lossy());
            }
        }
    }

    /// Every workload the model has on `node` (published, or perhaps).
    fn held_on(&self, node: usize) -> Vec<Held> {
        self.confirmed
            .iter()
            .chain(&self.maybe)
            .filter(|(n, _, _)| *n == node)
            .cloned()
            .collect::<BTreeSet<_>>()
            .into_iter()
            .collect()
    }

    /// The model's publishes of `volume` on nodes other than `node` (with `sure_only`, the
    /// answered ones only).
    fn holders_besides(&self, node: usize, volume: usize, sure_only: bool) -> Vec<Held> {
        let sets: &[&BTreeSet<Held>] = if sure_only {
            &[&self.confirmed]
        } else {
            &[&self.confirmed, &self.maybe]
        };
        sets.iter()
            .flat_map(|set| set.iter())
            .filter(|(n, v, _)| *n != node && *v == volume)
            .cloned()
            .collect()
    }

    /// The mean time of an answered operation of this kind so far.
    fn mean_ok(&self, kind: Kind) -> Duration {
        match self.took_ok.get(&kind) {
            Some((total, count)) if *count > 0 => *total / *count,
            _ => Duration::from_millis(50),
        }
    }

    /// A publish on `node` of a volume no other node holds by the model, if there is one:
    /// one that gets as far as the controller and the mounts, for a kill to land in.
    fn free_publish(&self, rng: &mut Rng, node: usize) -> Op {
        let free: Vec<usize> = (0..WRITERS + READERS)
            .filter(|v| !single_node(*v) || self.holders_besides(node, *v, false).is_empty())
            .collect();
        let volume = if free.is_empty() {
            rng.below(WRITERS + READERS)
        } else {
            free[rng.below(free.len())]
        };
        Op {
            kind: Kind::Publish,
            node,
            volume,
            workload: format!("w{}", rng.below(WORKLOADS)),
        }
    }

    fn choose(&self, rng: &mut Rng, node: usize) -> Op {
        let held = self.held_on(node);
        if !held.is_empty() && rng.percent(45) {
            let (node, volume, workload) = held[rng.below(held.len())].clone();
            return Op {
                kind: Kind::Unpublish,
                node,
                volume,
                workload,
            };
        }
        let kind = if rng.percent(5) {
            Kind::Unpublish
        } else {
            Kind::Publish
        };
        Op {
            kind,
            node,
            volume: rng.below(WRITERS + READERS),
            workload: format!("w{}", rng.below(WORKLOADS)),
        }
    }

    /// Records operation `n`'s answer, fails the test on one not accepted, and checks the
    /// backend against the model.
    fn record(
        &mut self,
        n: usize,
        op: &Op,
        answer: &Result<String, ApiError>,
        killed: bool,
        took: Duration,
    ) {
        let line = format!(
            "#{n} {op}{}: {} ({} ms)",
            if killed { " (its daemon killed)" } else { "" },
            short(answer),
            took.as_millis()
        );
        self.log.push(line.clone());
        if took > self.slowest_op.0 {
            self.slowest_op = (took, line.clone());
        }
        let Some(outcome) = classify(answer, killed) else {
            self.fail(&format!("unexpected answer to #{n} {op}: {answer:?}"));
        };
        *self.outcomes.entry((op.kind, outcome)).or_default() += 1;
        if outcome == Outcome::Ok && !killed {
            let (total, count) = self.took_ok.entry(op.kind).or_default();
            *total += took;
            *count += 1;
        }
        if outcome == Outcome::Lost {
            self.kills_lost += 1;
        }
        let key = op.key();
        match (op.kind, outcome) {
            (Kind::Publish, Outcome::Ok) => {
                let others = self.holders_besides(op.node, op.volume, true);
                if single_node(op.volume) && !others.is_empty() {
                    self.fail(&format!(
                        "#{n} {op} succeeded while the volume is published on {others:?} \
                         (answered, never unpublished)"
                    ));
                }
                self.maybe.remove(&key);
                self.confirmed.insert(key);
            }
            (Kind::Publish, Outcome::Conflict) => {
                if self.holders_besides(op.node, op.volume, false).is_empty() {
                    self.unexplained_conflicts.push(line);
                }
            }
            (Kind::Publish, _) => {
                if !self.confirmed.contains(&key) {
                    self.maybe.insert(key);
                }
            }
            (Kind::Unpublish, Outcome::Ok) => {
                self.confirmed.remove(&key);
                self.maybe.remove(&key);
            }
            (Kind::Unpublish, _) => {
                if self.confirmed.remove(&key) {
                    self.maybe.insert(key);
                }
            }
        }
        self.check_backend(&format!("after #{n} {op}"));
    }

    /// The backend's records: no single-node volume on two nodes, no refused node-side
    /// attach, every answered publish still attached to its node.
    fn check_backend(&self, when: &str) {
        let attachments = self.judge.attachments();
        let staged = self.judge.staged();
        let mut found = Vec::new();
        for volume in 0..WRITERS {
            let name = volume_name(volume);
            for (what, map) in [("attached to", &attachments), ("staged on", &staged)] {
                if let Some(nodes) = map.get(&name)
                    && nodes.len() > 1
                {
                    found.push(format!("SINGLE_NODE_WRITER {name} {what} {nodes:?}"));
                }
            }
        }
        for v in self.judge.violations() {
            found.push(format!("violation: {v}"));
        }
        for (node, volume, workload) in &self.confirmed {
            let name = volume_name(*volume);
            let attached = attachments
                .get(&name)
                .is_some_and(|nodes| nodes.iter().any(|n| n == NODES[*node]));
            if !attached {
                found.push(format!(
                    "{name} published for {workload} on {} (answered, never unpublished) \
                     is not attached to it: {:?}",
                    NODES[*node],
                    attachments.get(&name)
                ));
            }
        }
        if !found.is_empty() {
            self.fail(&format!("the backend {when}:\n  {}", found.join("\n  ")));
        }
    }
}

/// SIGKILLs the node's daemon, starts it again on its work dir and namespace, and waits
/// until it rejoined; how long it took.
async fn kill_and_restart(node: &mut Node) -> Duration {
    node.kill9();
    let start = Instant::now();
    node.start();
    joined(node).await;
    start.elapsed()
}

/// The mount points under the node's work dir, from its namespace's mount table.
fn mounts_in(node: &Node) -> Vec<String> {
    let work = node.work.to_string_lossy().into_owned();
    in_node(node, "cat /proc/self/mountinfo")
        .lines()
        .filter_map(|line| line.split_whitespace().nth(4))
        .filter(|point| point.starts_with(&work))
        .map(str::to_owned)
        .collect()
}

/// A line of the daemon's log without its colours (`ESC [ ... m`).
fn plain(line: &str) -> String {
    let mut out = String::with_capacity(line.len());
    let mut chars = line.chars();
    while let Some(c) = chars.next() {
        if c == '\x1b' {
            for c in chars.by_ref() {
                if c == 'm' {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

fn seed() -> u64 {
    match std::env::var("CHAOS_SEED") {
        Ok(s) => s
            .trim()
            .parse()
            .unwrap_or_else(|e| panic!("CHAOS_SEED={s:?}: {e}")),
        Err(_) => SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap()
            .as_nanos() as u64,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_publishes_and_unpublishes_with_daemons_killed_never_double_attach() {
    csi_agent_testkit::require_private_mount_namespace();
    let seed = seed();
    println!("CHAOS_SEED={seed}");
    eprintln!("CHAOS_SEED={seed}");
    let mut rng = Rng::new(seed);

    let (tmp, backend) = scratch();
    let etcd = EtcdCluster::start(1);
    let volumes = (0..WRITERS + READERS)
        .map(|v| format!("{}:16Mi", volume_name(v)))
        .collect::<Vec<_>>()
        .join(",");
    let mut nodes: Vec<Node> = NODES
        .iter()
        .map(|n| {
            node_with_volumes(
                tmp.path(),
                n,
                &etcd.endpoints_flag(),
                &backend,
                &[],
                &volumes,
            )
        })
        .collect();
    for node in &nodes {
        joined(node).await;
    }
    let apis = |nodes: &[Node], i: usize| nodes[i].api().with_timeout(Some(REQUEST_TIMEOUT));
    let mut chaos = Chaos {
        seed,
        started: Instant::now(),
        log: Vec::new(),
        outcomes: BTreeMap::new(),
        confirmed: BTreeSet::new(),
        maybe: BTreeSet::new(),
        unexplained_conflicts: Vec::new(),
        kills: 0,
        kills_in_flight: 0,
        kills_lost: 0,
        took_ok: BTreeMap::new(),
        rejoin_max: Duration::ZERO,
        rejoin_total: Duration::ZERO,
        slowest_op: (Duration::ZERO, String::new()),
        judge: BackendJudge::new(&backend),
    };

    let mut next_kill = KILL_EVERY / 2 + rng.below(KILL_EVERY);
    let mut n = 0;
    let mut hundreds = 0;
    while n < OPS {
        if n / 100 > hundreds {
            hundreds = n / 100;
            eprintln!(
                "chaos: {n} operations, {} kills, {:?}",
                chaos.kills,
                chaos.started.elapsed()
            );
        }
        if n == next_kill {
            next_kill = n + KILL_EVERY / 2 + rng.below(KILL_EVERY) + 1;
            let victim = rng.below(NODES.len());
            chaos.kills += 1;
            if rng.percent(50) {
                // Killed while a publish (sometimes an unpublish) of its runs.
                let op = if rng.percent(75) {
                    chaos.free_publish(&mut rng, victim)
                } else {
                    chaos.choose(&mut rng, victim)
                };
                // From the seed alone, not from the timing, so that a replay makes the same
                // choices as long as the answers are the same.
                let delay = Duration::from_millis(rng.below(KILL_WITHIN_MS + 1) as u64);
                chaos.log.push(format!(
                    "kill {} {} ms into #{n} {op}",
                    NODES[victim],
                    delay.as_millis()
                ));
                chaos.kills_in_flight += 1;
                let sent = Instant::now();
                let task = tokio::spawn(send(apis(&nodes, victim), op.clone()));
                tokio::time::sleep(delay).await;
                let rejoin = kill_and_restart(&mut nodes[victim]).await;
                let answer = task.await.unwrap();
                chaos.record(n, &op, &answer, true, sent.elapsed());
                chaos.rejoin_max = chaos.rejoin_max.max(rejoin);
                chaos.rejoin_total += rejoin;
                n += 1;
            } else {
                chaos
                    .log
                    .push(format!("kill {} between operations", NODES[victim]));
                let rejoin = kill_and_restart(&mut nodes[victim]).await;
                chaos.rejoin_max = chaos.rejoin_max.max(rejoin);
                chaos.rejoin_total += rejoin;
            }
            chaos.check_backend(&format!("after {} restarted", NODES[victim]));
            continue;
        }
        let node = rng.below(NODES.len());
        let op = chaos.choose(&mut rng, node);
        let sent = Instant::now();
        let answer = send(apis(&nodes, node), op.clone()).await;
        chaos.record(n, &op, &answer, false, sent.elapsed());
        n += 1;
    }
    let ops_took = chaos.started.elapsed();

    // Every publish answered and not unpublished is mounted on its node (its target, at
    // `.../mounts/<volume>/target`), daemons restarted or not.
    for (i, node) in nodes.iter().enumerate() {
        let mounts = mounts_in(node);
        for (_, volume, workload) in chaos.confirmed.iter().filter(|(n, _, _)| *n == i) {
            let target = format!("/mounts/{}/target", volume_name(*volume));
            if !mounts.iter().any(|m| m.ends_with(&target)) {
                chaos.fail(&format!(
                    "{} published for {workload} on {} is not mounted there: {mounts:?}",
                    volume_name(*volume),
                    NODES[i]
                ));
            }
        }
    }

    // Every workload the model believes (or may believe) published, unpublished.
    let settle = Instant::now();
    let left: Vec<Held> = chaos.confirmed.union(&chaos.maybe).cloned().collect();
    for (node, volume, workload) in &left {
        let op = Op {
            kind: Kind::Unpublish,
            node: *node,
            volume: *volume,
            workload: workload.clone(),
        };
        let deadline = Instant::now() + SETTLE;
        loop {
            let answer = send(apis(&nodes, *node), op.clone()).await;
            let retry = match &answer {
                Ok(_) => break,
                Err(ApiError::Api { status: 503, .. }) => true,
                Err(e) => e.is_connection(),
            };
            if !retry || Instant::now() >= deadline {
                chaos.fail(&format!("the final {op}: {}", short(&answer)));
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        chaos.log.push(format!("final {op}: ok"));
    }
    chaos.confirmed.clear();
    chaos.maybe.clear();

    // Then nothing is left: no claim in etcd, no attachment, nothing staged, no mount.
    let client = etcd_client(etcd.client_urls()).await;
    let deadline = Instant::now() + SETTLE;
    let (entries, attachments, staged, mounts) = loop {
        let entries = etcd_entries(&client).await;
        let attachments = chaos.judge.attachments();
        let staged = chaos.judge.staged();
        let mounts: Vec<(usize, Vec<String>)> = (0..NODES.len())
            .map(|i| (i, mounts_in(&nodes[i])))
            .filter(|(_, m)| !m.is_empty())
            .collect();
        let clean =
            entries.is_empty() && attachments.is_empty() && staged.is_empty() && mounts.is_empty();
        if clean || Instant::now() >= deadline {
            break (entries, attachments, staged, mounts);
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let settled = settle.elapsed();
    if !(entries.is_empty() && attachments.is_empty() && staged.is_empty() && mounts.is_empty()) {
        let mut claims = String::new();
        for (i, node) in nodes.iter().enumerate() {
            let volumes = node.api().volumes().await;
            claims.push_str(&format!("\n  {}: {volumes:?}", NODES[i]));
        }
        chaos.fail(&format!(
            "{SETTLE:?} after every workload was unpublished, left:\n  \
             etcd claims (volume, node, state): {entries:?}\n  \
             backend attachments: {attachments:?}\n  backend staged: {staged:?}\n  \
             mounts under the nodes' work dirs: {mounts:?}\n\
             the daemons' volumes:{claims}"
        ));
    }
    assert!(entries.is_empty(), "etcd still claims {entries:?}");
    assert!(attachments.is_empty(), "still attached: {attachments:?}");
    assert!(staged.is_empty(), "still staged: {staged:?}");
    assert!(mounts.is_empty(), "still mounted: {mounts:?}");
    chaos.judge.assert_no_double_attach();

    // The storage never refused a controller publish as attached elsewhere.
    let refused: Vec<_> = chaos
        .judge
        .calls()
        .into_iter()
        .filter(|c| c.rpc == "ControllerPublishVolume" && c.outcome == "FAILED_PRECONDITION")
        .collect();
    if !refused.is_empty() {
        chaos.fail(&format!(
            "the backend refused ControllerPublish as attached to another node: {refused:?}"
        ));
    }
    // No daemon panicked (a panic in a task of its does not end the process), and what
    // they logged as errors, for the summary.
    let mut errors = Vec::new();
    let mut warnings = Vec::new();
    for (i, node) in nodes.iter().enumerate() {
        let log = node.full_log();
        if let Some(line) = log.lines().find(|l| l.contains("panicked")) {
            chaos.fail(&format!("{} panicked: {line}", NODES[i]));
        }
        for line in log.lines().map(plain) {
            match line.split_whitespace().nth(1) {
                Some("ERROR") => errors.push(format!("{}: {line}", NODES[i])),
                Some("WARN") => warnings.push(format!("{}: {line}", NODES[i])),
                _ => {}
            }
        }
    }
    let mut failed_rpcs: BTreeMap<(String, String), usize> = BTreeMap::new();
    for call in chaos.judge.calls() {
        if call.outcome != "OK" {
            *failed_rpcs.entry((call.rpc, call.outcome)).or_default() += 1;
        }
    }

    let outcomes: Vec<String> = chaos
        .outcomes
        .iter()
        .map(|((kind, outcome), count)| format!("{kind:?} {outcome:?} {count}"))
        .collect();
    println!(
        "chaos summary: seed {seed}; {OPS} operations in {ops_took:?} ({}); answered publish \
         {:?}, unpublish {:?} on average; {} kills ({} with an operation in flight, {} of \
         those left without an answer), rejoin max {:?} mean {:?}; {} unexplained 409s{}; \
         slowest: {}; RPCs not OK: {failed_rpcs:?}; {} errors logged{}, {} warnings{}; cleanup and convergence {settled:?}; total \
         {:?}",
        outcomes.join(", "),
        chaos.mean_ok(Kind::Publish),
        chaos.mean_ok(Kind::Unpublish),
        chaos.kills,
        chaos.kills_in_flight,
        chaos.kills_lost,
        chaos.rejoin_max,
        chaos.rejoin_total / u32::try_from(chaos.kills.max(1)).unwrap(),
        chaos.unexplained_conflicts.len(),
        chaos
            .unexplained_conflicts
            .iter()
            .take(5)
            .map(|l| format!("\n    {l}"))
            .collect::<String>(),
        chaos.slowest_op.1,
        errors.len(),
        errors
            .iter()
            .take(5)
            .map(|l| format!("\n    {l}"))
            .collect::<String>(),
        warnings.len(),
        warnings
            .iter()
            .take(3)
            .map(|l| format!("\n    {l}"))
            .collect::<String>(),
        chaos.started.elapsed(),
    );
    chaos.save_log();
    drop(nodes);
    drop(tmp);
}
