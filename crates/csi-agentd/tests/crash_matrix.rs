//! The crash matrix on the real daemon: the real `csi-agentd` process killed (SIGKILL, by an
//! armed failpoint) at every hit of every failpoint of docs/recovery.md during a publish and
//! an unpublish made through the real API; the real `csi-testplugin` killed during each RPC;
//! and reboots simulated in each steady (or stuck) state. After each, the daemon restarts
//! without failpoints and the node must converge, as seen from outside: the mount table, the
//! API, the plugin's own state dir and processes, and the files of the work dir.
//!
//! Real bind mounts: run as root under `unshare -m --propagation private` (see
//! docs/recovery.md, "Crash matrix on the real daemon").
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use csi_agent::mounts::require_private_mount_namespace;
use csi_agent_testkit::node::*;
use csi_agent_testkit::*;
use serde_json::json;

const VOLUME: &str = "vol";
const WORKLOAD: &str = "w1";

/// Points that cannot be reached without `bind_to`, which stays out of the matrix while
/// bind handling is being rewritten (it is added after that merge). They are still probed:
/// a point listed here that a plain publish/unpublish reaches is simply covered.
const BIND_ONLY: &[&str] = &[
    "beneath.mkdir.before_mark",
    "beneath.mkdir.before_rename",
    "volume.bind.after_mount",
    "volume.unbind.after_unmount",
];

/// Points of the oci runtime's launch, hit only by a plugin in a container (this matrix runs
/// the process runtime): killed and restarted by `oci_runtime.rs`, left out of this matrix.
const OCI_ONLY: &[&str] = &[
    "oci.launch.after_overlay",
    "oci.launch.after_create",
    "oci.launch.after_start",
];

/// Points of a volume expansion, hit only by `POST /v1/volumes/{plugin}/{volume_id}/expand`
/// (not by a publish/unpublish cycle): killed and restarted by
/// `the_daemon_killed_at_each_expansion_failpoint_resumes_the_expansion` below.
const EXPAND_ONLY: &[&str] = &[
    "volume.expand.before_intent",
    "volume.expand.controller.before_rpc",
    "volume.expand.controller.after_rpc",
    "volume.expand.node.before_rpc",
    "volume.expand.node.after_rpc",
];

/// Points of the volume names' create and remove (the Docker volume plugin protocol), not hit
/// by a publish/unpublish cycle: killed and restarted by
/// `tests/daemon/volume_plugin.rs`'s
/// `the_daemon_killed_inside_a_create_or_a_remove_leaves_one_volume_or_none`.
const NAMED_ONLY: &[&str] = &[
    "named.create.after_intent",
    "named.create.after_rpc",
    "named.remove.after_rpc",
];

/// Points of cluster mode, hit only by a cluster plugin on a daemon with `--cluster-etcd`:
/// killed and restarted by `tests/cluster.rs` (`a_daemon_killed_at_each_cluster_failpoint_converges`,
/// and `the_leader_killed_after_a_controller_publish_for_another_node_is_replaced` for
/// `cluster.leader.after_rpc`).
const CLUSTER_ONLY: &[&str] = &[
    "cluster.claim.before_txn",
    "cluster.claim.after_txn",
    "cluster.release.before_txn",
    "cluster.release.after_txn",
    "cluster.fence.after_mark",
    "cluster.fence.after_rpc",
    "cluster.leader.after_rpc",
];

/// Points of the store's migration, hit while a daemon opens a work dir of the first release,
/// not by a publish/unpublish cycle: killed and restarted by
/// `crates/csi-agent/tests/store_migration.rs`, left out of this matrix.
const MIGRATION_ONLY: &[&str] = &[
    "store.migrate.before_commit",
    "store.migrate.after_commit",
    "store.migrate.after_remove",
];

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The failpoints of the table in docs/recovery.md ("## Failpoints"), in table order.
fn documented_points() -> Vec<String> {
    let doc = std::fs::read_to_string(repo_root().join("docs/recovery.md")).unwrap();
    let section = doc
        .split("\n## ")
        .find(|s| s.starts_with("Failpoints"))
        .expect("docs/recovery.md has a `## Failpoints` section");
    let mut points = Vec::new();
    for line in section.lines() {
        let Some(rest) = line.strip_prefix("| `") else {
            continue;
        };
        let name = rest.split('`').next().unwrap();
        assert!(
            !points.iter().any(|p| p == name),
            "{name} is listed twice in docs/recovery.md"
        );
        points.push(name.to_owned());
    }
    assert!(
        points.len() > 10,
        "the failpoint table of docs/recovery.md did not parse: {points:?}"
    );
    points
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap().flatten() {
        let path = entry.path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The string literals of a `"a", $x, "b"`-style argument list, split around its one
/// metavariable.
fn concat_template(args: &str) -> Option<(String, String)> {
    let mut before = String::new();
    let mut after = String::new();
    let mut seen_var = false;
    for part in args.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        if part.starts_with('$') {
            if seen_var {
                return None;
            }
            seen_var = true;
        } else {
            let literal = part.strip_prefix('"')?.strip_suffix('"')?;
            if seen_var {
                after.push_str(literal);
            } else {
                before.push_str(literal);
            }
        }
    }
    seen_var.then_some((before, after))
}

/// Every failpoint name the engine's sources pass to `failpoint::hit`, resolved from what
/// the call names: a string literal, a `const NAME: &str = "…"`, or a field of a struct
/// built by a `macro_rules!` from `concat!("…", $step, "…")` (the per-step points).
/// Anything else fails, so that a new way of naming points cannot slip past this check.
fn points_in_sources() -> BTreeSet<String> {
    let mut files = Vec::new();
    rust_files(&repo_root().join("crates/csi-agent/src"), &mut files);
    let sources: Vec<(PathBuf, String)> = files
        .into_iter()
        .map(|path| {
            let text = std::fs::read_to_string(&path).unwrap();
            // Comments may quote calls; only code counts.
            let code: String = text
                .lines()
                .filter(|l| !l.trim_start().starts_with("//"))
                .map(|l| format!("{l}\n"))
                .collect();
            (path, code)
        })
        .collect();
    let all_code: String = sources.iter().map(|(_, c)| c.as_str()).collect();
    let mut names = BTreeSet::new();
    for (path, code) in &sources {
        for (at, _) in code.match_indices("failpoint::hit(") {
            let rest = &code[at + "failpoint::hit(".len()..];
            let arg = rest[..rest.find(')').unwrap()].trim();
            let where_ = format!("{}: failpoint::hit({arg})", path.display());
            if let Some(literal) = arg.strip_prefix('"') {
                names.insert(literal.strip_suffix('"').expect(&where_).to_owned());
            } else if let Some((_, field)) = arg.rsplit_once('.') {
                // `points.before_intent`: `before_intent: concat!("volume.", $step, ".…")`
                // in a macro, expanded for each `name!("…")` invocation of that macro.
                let pattern = format!("{field}: concat!(");
                let defining: Vec<&String> = sources
                    .iter()
                    .map(|(_, c)| c)
                    .filter(|c| c.contains(&pattern))
                    .collect();
                assert_eq!(defining.len(), 1, "{where_}: where is `{pattern}`?");
                let code = defining[0];
                let at = code.find(&pattern).unwrap() + pattern.len();
                let args = &code[at..at + code[at..].find(')').unwrap()];
                let (before, after) =
                    concat_template(args).unwrap_or_else(|| panic!("{where_}: {args}"));
                let macro_at = code[..at].rfind("macro_rules! ").expect(&where_);
                let macro_name: String = code[macro_at + "macro_rules! ".len()..]
                    .chars()
                    .take_while(|c| c.is_alphanumeric() || *c == '_')
                    .collect();
                let invocation = format!("{macro_name}!(\"");
                let mut steps = 0;
                for (i, _) in code.match_indices(&invocation) {
                    let step_rest = &code[i + invocation.len()..];
                    let step = &step_rest[..step_rest.find('"').unwrap()];
                    names.insert(format!("{before}{step}{after}"));
                    steps += 1;
                }
                assert!(steps > 0, "{where_}: no `{invocation}…)` found");
            } else {
                let ident = arg.rsplit("::").next().unwrap();
                let pattern = format!("const {ident}: &str = \"");
                let at = all_code
                    .find(&pattern)
                    .unwrap_or_else(|| panic!("{where_}: cannot resolve `{arg}`"))
                    + pattern.len();
                names.insert(all_code[at..at + all_code[at..].find('"').unwrap()].to_owned());
            }
        }
    }
    assert!(names.len() > 10, "no failpoint found in the sources");
    names
}

/// The table and the code name the same points, and the bind-only exceptions are real rows.
#[test]
fn the_failpoint_table_matches_the_sources() {
    let documented: BTreeSet<String> = documented_points().into_iter().collect();
    let in_code = points_in_sources();
    let undocumented: Vec<&String> = in_code.difference(&documented).collect();
    let stale: Vec<&String> = documented.difference(&in_code).collect();
    assert!(
        undocumented.is_empty() && stale.is_empty(),
        "hit in crates/csi-agent/src but not in the table of docs/recovery.md: {undocumented:?}; \
         in the table but hit nowhere: {stale:?}"
    );
    for point in BIND_ONLY {
        assert!(documented.contains(*point), "{point} is not in the table");
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Phase {
    Publish,
    Unpublish,
}

/// The kill that leaves a plugin process no record names: the daemon killed at the publish's
/// first durable write, the component record of the plugin it has just launched (renamed into
/// place after the launch; the publish asks the plugin's NodeGetInfo, for its volume limit,
/// before it writes anything of its own). The process carries its component's marker, and the
/// next daemon's recovery kills it (issue #12, item 6): the convergence check after the
/// restart, which allows no plugin process the daemon does not report, proves it. This is the one case
/// where an untracked process is expected; the check fails if one appears anywhere else, or no
/// longer appears here (then the window moved and this entry must follow it).
const UNTRACKED_LAUNCH: (&str, Phase, u64) = ("store.write.before_rename", Phase::Publish, 1);

/// One kill, as observed.
#[derive(Debug)]
struct Kill {
    phase: Phase,
    /// Which hit of the point within its phase (1-based).
    nth: u64,
    /// Whether the workload's claim was on disk when the daemon died.
    claim_durable: bool,
}

/// The record on disk, what the plugin holds and what is mounted, at the moment of a kill,
/// must obey the rules of docs/recovery.md: the operation's desired state (the claim, or its
/// removal) is durable before its first RPC, and progress notes never claim more than
/// happened, so the record on disk is at worst behind the node, never ahead of it. Returns
/// whether the workload's claim is durable.
fn check_at_kill(node: &mut Node, point: &str, phase: Phase, nth: u64) -> bool {
    let what = &format!("{point} #{nth} ({phase:?})");
    // Every running plugin process is one the daemon recorded: otherwise the next daemon
    // can neither adopt nor stop it.
    let recorded = node.component_record_pid();
    let orphans: BTreeSet<i32> = node
        .plugin_pids()
        .into_iter()
        .filter(|pid| recorded != Some(*pid))
        .collect();
    if (point, phase, nth) == UNTRACKED_LAUNCH {
        assert!(
            !orphans.is_empty(),
            "{what}: no untracked plugin process at the launch window; move UNTRACKED_LAUNCH"
        );
        for pid in &orphans {
            let environ = std::fs::read(format!("/proc/{pid}/environ")).unwrap_or_default();
            assert!(
                environ
                    .split(|b| *b == 0)
                    .any(|var| var.starts_with(b"CSI_AGENT_COMPONENT=/")),
                "{what}: untracked plugin process {pid} carries no component marker, so the \
                 next daemon cannot find it"
            );
        }
        println!("{what}: plugin process {orphans:?} untracked (marked; the next daemon stops it)");
    } else {
        assert!(
            orphans.is_empty(),
            "{what}: plugin processes {orphans:?} run without a component record"
        );
    }
    let record = node.disk_record(VOLUME);
    let holds = node
        .plugin_holds(VOLUME)
        .unwrap_or_else(|e| panic!("{what}: {e}"));
    let mounts = node.mounts();
    // No RPC is in flight at a failpoint: the plugin's bookkeeping matches the mounts.
    let staging_mounted = mounts.contains(&node.staging(VOLUME));
    let target_mounted = mounts.contains(&node.target(VOLUME));
    assert_eq!(
        (holds.staged, holds.published),
        (staging_mounted, target_mounted),
        "{what}: the plugin's state {holds:?} does not match the mounts {mounts:?}"
    );
    assert!(
        mounts
            .iter()
            .all(|m| *m == node.staging(VOLUME) || *m == node.target(VOLUME)),
        "{what}: foreign mounts {mounts:?}"
    );
    let Some(record) = record else {
        // Nothing may exist on the node that no record accounts for.
        assert_eq!(
            holds,
            PluginHolds::default(),
            "{what}: the plugin holds {holds:?} of a volume without a record (intent not durable before the RPC)"
        );
        return false;
    };
    let level = level(&record.state);
    let claimed = record.claims.contains(WORKLOAD);
    for (step, step_level, done) in holds.steps() {
        // Never ahead of the node in the direction the claims drive it. Going up (claimed):
        // a step the record says is done is done in the plugin; the plugin may hold more (a
        // note lost with the crash). Going down (no claim): the plugin holds nothing above
        // the recorded state; it may hold less.
        if claimed && step_level < level {
            assert!(
                done,
                "{what}: the record says {} but the {step} is not done in the plugin ({holds:?})",
                record.state
            );
        }
        if !claimed && step_level > level {
            assert!(
                !done,
                "{what}: the {step} is done in the plugin ({holds:?}) but the record says only {}",
                record.state
            );
        }
    }
    if phase == Phase::Publish {
        // The claim is the publish's first write, before any RPC: a record means the claim.
        assert!(claimed, "{what}: a record without the claim: {record:?}");
    }
    claimed
}

/// After a kill: restart without failpoints, converge to what the durable claim wants, then
/// the workload's retried request, then the end of the cycle leaves nothing.
async fn recover_and_finish(node: &mut Node, phase: Phase, claim_durable: bool, what: &str) {
    let claimed = want(&[(VOLUME, &[WORKLOAD])]);
    let nothing = Want::new();
    node.start(None).await;
    node.wait_recovered().await;
    let expected = if claim_durable { &claimed } else { &nothing };
    node.converged(
        expected,
        &[VOLUME],
        &format!("{what}: convergence after restart"),
    )
    .await;
    match phase {
        Phase::Publish => {
            // The workload got no answer: it repeats the publish (idempotent, one claim).
            let published = node
                .publish(VOLUME, WORKLOAD)
                .await
                .unwrap_or_else(|e| panic!("{what}: retried publish: {e}"));
            assert_eq!(published.state, "PUBLISHED", "{what}");
            assert_eq!(Path::new(&published.target_path), node.target(VOLUME));
            node.assert_consistent(
                &claimed,
                &[VOLUME],
                &format!("{what}: after the retried publish"),
            )
            .await;
            node.unpublish(VOLUME, WORKLOAD)
                .await
                .unwrap_or_else(|e| panic!("{what}: unpublish: {e}"));
        }
        Phase::Unpublish => {
            node.unpublish(VOLUME, WORKLOAD)
                .await
                .unwrap_or_else(|e| panic!("{what}: retried unpublish: {e}"));
        }
    }
    node.assert_consistent(
        &nothing,
        &[VOLUME],
        &format!("{what}: after the final unpublish"),
    )
    .await;
}

/// One publish + unpublish cycle with `point` armed to kill the daemon at its `n`-th hit.
/// Returns the kill, or `None` when the point was hit fewer than `n` times (the cycle then
/// completed normally, with the point armed). `publish_hits` is how often the point is hit
/// by a publish (known once a run got past the publish).
async fn run_cycle(point: &str, n: u64, publish_hits: &mut Option<u64>) -> Option<Kill> {
    let mut node = Node::new(&format!("{VOLUME}:1M"));
    let spec = format!("{point}={n}*exit");
    node.start(Some(&spec)).await;
    node.wait_recovered().await;
    let claimed = want(&[(VOLUME, &[WORKLOAD])]);
    match node.publish(VOLUME, WORKLOAD).await {
        Ok(published) => {
            assert_eq!(published.state, "PUBLISHED");
            node.assert_consistent(&claimed, &[VOLUME], &format!("{spec}: published"))
                .await;
            // The first publish that gets through tells how often a publish hits the point.
            publish_hits.get_or_insert(n - 1);
        }
        Err(err) => {
            assert!(
                publish_hits.is_none(),
                "{spec}: the publish hit counts vary"
            );
            let what = format!("{point} #{n} (publish)");
            node.expect_failpoint_kill(point, &err).await;
            let durable = check_at_kill(&mut node, point, Phase::Publish, n);
            recover_and_finish(&mut node, Phase::Publish, durable, &what).await;
            return Some(Kill {
                phase: Phase::Publish,
                nth: n,
                claim_durable: durable,
            });
        }
    }
    match node.unpublish(VOLUME, WORKLOAD).await {
        Ok(()) => {
            // The unpublish's progress notes are committed after its answer (within the note
            // flush interval): a kill at that commit comes after the answer.
            if point.starts_with("store.commit.")
                && node.died_at_failpoint(point, Duration::from_secs(2)).await
            {
                let nth = n - publish_hits.unwrap();
                let what = format!("{point} #{nth} (unpublish, after the answer)");
                let durable = check_at_kill(&mut node, point, Phase::Unpublish, nth);
                assert!(
                    !durable,
                    "{what}: the claim removal was answered, so committed"
                );
                recover_and_finish(&mut node, Phase::Unpublish, durable, &what).await;
                return Some(Kill {
                    phase: Phase::Unpublish,
                    nth,
                    claim_durable: durable,
                });
            }
            assert!(
                node.daemon_alive(),
                "{spec}: the daemon died after the unpublish"
            );
            node.assert_consistent(&Want::new(), &[VOLUME], &format!("{spec}: unpublished"))
                .await;
            None
        }
        Err(err) => {
            let nth = n - publish_hits.unwrap();
            let what = format!("{point} #{nth} (unpublish)");
            node.expect_failpoint_kill(point, &err).await;
            let durable = check_at_kill(&mut node, point, Phase::Unpublish, nth);
            recover_and_finish(&mut node, Phase::Unpublish, durable, &what).await;
            Some(Kill {
                phase: Phase::Unpublish,
                nth,
                claim_durable: durable,
            })
        }
    }
}

/// Every hit of every documented failpoint, in a publish and in an unpublish.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_daemon_killed_at_every_failpoint_converges() {
    require_private_mount_namespace();
    let started = Instant::now();
    let points = documented_points();
    let mut runs = 0u64;
    let mut kills: BTreeMap<String, Vec<Kill>> = BTreeMap::new();
    let mut unreached = Vec::new();
    for point in points.iter().filter(|p| {
        !MIGRATION_ONLY.contains(&p.as_str())
            && !OCI_ONLY.contains(&p.as_str())
            && !EXPAND_ONLY.contains(&p.as_str())
            && !SNAPSHOT_ONLY.contains(&p.as_str())
            && !NAMED_ONLY.contains(&p.as_str())
            && !CLUSTER_ONLY.contains(&p.as_str())
    }) {
        let mut publish_hits = None;
        let mut found = Vec::new();
        for n in 1.. {
            runs += 1;
            match run_cycle(point, n, &mut publish_hits).await {
                Some(kill) => found.push(kill),
                None => break,
            }
            assert!(n < 20, "{point}: more than 20 hits in one cycle?");
        }
        println!(
            "{point}: {}",
            if found.is_empty() {
                "not hit".to_owned()
            } else {
                found
                    .iter()
                    .map(|k| {
                        format!(
                            "{:?}#{}{}",
                            k.phase,
                            k.nth,
                            if k.claim_durable { "(claim)" } else { "" }
                        )
                    })
                    .collect::<Vec<_>>()
                    .join(" ")
            }
        );
        if found.is_empty() {
            unreached.push(point.clone());
        }
        kills.insert(point.clone(), found);
    }
    let not_excused: Vec<&String> = unreached
        .iter()
        .filter(|p| !BIND_ONLY.contains(&p.as_str()))
        .collect();
    assert!(
        not_excused.is_empty(),
        "documented failpoints never hit by a publish/unpublish cycle: {not_excused:?}"
    );
    let pairs: BTreeSet<(&String, Phase)> = kills
        .iter()
        .flat_map(|(p, ks)| ks.iter().map(move |k| (p, k.phase)))
        .collect();
    let total: usize = kills.values().map(Vec::len).sum();
    let untracked = kills
        .iter()
        .filter(|(p, ks)| {
            ks.iter()
                .any(|k| (p.as_str(), k.phase, k.nth) == UNTRACKED_LAUNCH)
        })
        .count();
    assert_eq!(untracked, 1, "UNTRACKED_LAUNCH names no case of the matrix");
    let publish = pairs.iter().filter(|(_, ph)| *ph == Phase::Publish).count();
    println!(
        "crash matrix: {} points in docs/recovery.md, {} hit ({} not reached without bind_to, \
         {} migration points left to store_migration.rs), \
         {} point×phase pairs ({publish} publish, {} unpublish), {total} daemon kills, \
         {total} volume convergences, all full ({untracked} stopped an untracked plugin process), \
         {runs} cycles, {:.0} s",
        points.len(),
        points.len()
            - unreached.len()
            - MIGRATION_ONLY.len()
            - OCI_ONLY.len()
            - EXPAND_ONLY.len()
            - SNAPSHOT_ONLY.len()
            - NAMED_ONLY.len()
            - CLUSTER_ONLY.len(),
        unreached.len(),
        MIGRATION_ONLY.len(),
        pairs.len(),
        pairs.len() - publish,
        started.elapsed().as_secs_f64()
    );
}

/// The RPCs a publish/unpublish cycle makes, each with the request it happens in.
const PLUGIN_RPCS: &[(&str, Phase)] = &[
    ("Probe", Phase::Publish),
    ("NodeGetCapabilities", Phase::Publish),
    ("ControllerGetCapabilities", Phase::Publish),
    ("NodeGetInfo", Phase::Publish),
    ("ControllerPublishVolume", Phase::Publish),
    ("NodeStageVolume", Phase::Publish),
    ("NodePublishVolume", Phase::Publish),
    ("NodeUnpublishVolume", Phase::Unpublish),
    ("NodeUnstageVolume", Phase::Unpublish),
    ("ControllerUnpublishVolume", Phase::Unpublish),
];

/// The plugin SIGKILLed while an RPC is in flight (held by a `delay` fault): the request
/// still completes once the supervisor has restarted the plugin, and the node is consistent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_plugin_killed_during_each_rpc_is_restarted_and_the_request_completes() {
    require_private_mount_namespace();
    let started = Instant::now();
    let claimed = want(&[(VOLUME, &[WORKLOAD])]);
    let nothing = Want::new();
    for (method, phase) in PLUGIN_RPCS {
        let what = format!("plugin killed during {method}");
        let mut node = Node::new(&format!("{VOLUME}:1M"));
        node.start(None).await;
        node.wait_recovered().await;
        let id = format!("kill-{method}");
        node.set_faults(&json!({"rules": [
            {"method": method, "delay_ms": 20000, "times": 1, "id": id}
        ]}));
        if *phase == Phase::Unpublish {
            node.publish(VOLUME, WORKLOAD).await.unwrap();
            node.assert_consistent(&claimed, &[VOLUME], &what).await;
        }
        let request = {
            let api = node.api();
            let phase = *phase;
            tokio::spawn(async move {
                match phase {
                    Phase::Publish => api
                        .publish(&publish_with_secrets(VOLUME, WORKLOAD))
                        .await
                        .map(|_| ()),
                    Phase::Unpublish => api
                        .unpublish(&unpublish_request(VOLUME, WORKLOAD))
                        .await
                        .map(|_| ()),
                }
            })
        };
        eventually(
            &format!("{method} in flight"),
            Duration::from_secs(20),
            || async {
                if node.fault_fired(&id) == 1 {
                    Ok(())
                } else {
                    Err("the delayed call has not arrived".to_owned())
                }
            },
        )
        .await;
        let pid = node.component_record_pid().expect("a component record");
        assert_eq!(node.plugin_pids(), [pid].into(), "{what}");
        let calls_before = node
            .calls()
            .iter()
            .filter(|c| c["method"] == *method)
            .count();
        let killed_at_ns = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos();
        kill9_pid(pid);
        tokio::time::timeout(Duration::from_secs(60), request)
            .await
            .unwrap_or_else(|_| panic!("{what}: the request never completed"))
            .unwrap()
            .unwrap_or_else(|e| panic!("{what}: {e}\n{}", node.log_text()));
        let expected = if *phase == Phase::Publish {
            &claimed
        } else {
            &nothing
        };
        node.assert_consistent(expected, &[VOLUME], &what).await;
        // The call in flight died with its plugin; a new one, to the restarted plugin,
        // answered the request.
        let (pids, restarts) = node.api_plugin_pids().await.unwrap();
        assert!(
            !pids.contains(&pid) && restarts >= 1,
            "{what}: {pids:?}, {restarts} restarts"
        );
        let calls = node.calls();
        let retried: Vec<_> = calls.iter().filter(|c| c["method"] == *method).collect();
        // Exactly one more call, except for Probe, which the supervisor also sends on its own.
        if *method == "Probe" {
            assert!(retried.len() > calls_before, "{what}: {retried:?}");
        } else {
            assert_eq!(retried.len(), calls_before + 1, "{what}: {retried:?}");
        }
        let last = retried.last().unwrap();
        assert_eq!(last["code"], "OK", "{what}: {last}");
        assert!(
            u128::from(last["start_ns"].as_u64().unwrap()) > killed_at_ns,
            "{what}: the answered call started before the kill: {last}"
        );
        assert!(
            calls.iter().all(|c| c["overlap"] == false),
            "{what}: overlapping calls for one volume"
        );
        if *phase == Phase::Publish {
            node.unpublish(VOLUME, WORKLOAD).await.unwrap();
            node.assert_consistent(&nothing, &[VOLUME], &what).await;
        }
    }
    println!(
        "plugin kills: {} RPC types, {} kills, all completed, {:.0} s",
        PLUGIN_RPCS.len(),
        PLUGIN_RPCS.len(),
        started.elapsed().as_secs_f64()
    );
}

/// The states a node can be in when it reboots.
#[derive(Clone, Copy, Debug)]
enum Before {
    /// Published for one workload.
    Published,
    /// One volume shared by two workloads, another published for a third.
    Shared,
    /// Published, with this RPC failing UNAVAILABLE for good: the volume is stuck in its
    /// transient state (the request keeps retrying) when the node goes down.
    StuckPublishing(&'static str, &'static str),
    /// Same, during the unpublish (the claim is already withdrawn).
    StuckUnpublishing(&'static str, &'static str),
}

const REBOOTS: &[Before] = &[
    Before::Published,
    Before::Shared,
    Before::StuckPublishing("ControllerPublishVolume", "CONTROLLER_PUBLISH"),
    // Staged only: the staging is mounted, the target not yet.
    Before::StuckPublishing("NodePublishVolume", "NODE_PUBLISH"),
    Before::StuckPublishing("NodeStageVolume", "NODE_STAGE"),
    Before::StuckUnpublishing("NodeUnpublishVolume", "NODE_UNPUBLISH"),
    Before::StuckUnpublishing("NodeUnstageVolume", "NODE_UNSTAGE"),
    Before::StuckUnpublishing("ControllerUnpublishVolume", "CONTROLLER_UNPUBLISH"),
];

/// Brings a node into `before`; returns what its claims want and the volumes it touched.
async fn reach(node: &Node, before: Before) -> (Want, Vec<&'static str>) {
    match before {
        Before::Published => {
            node.publish(VOLUME, WORKLOAD).await.unwrap();
            (want(&[(VOLUME, &[WORKLOAD])]), vec![VOLUME])
        }
        Before::Shared => {
            for (volume, workload) in [(VOLUME, "w1"), (VOLUME, "w2"), ("vol2", "w3")] {
                node.publish(volume, workload).await.unwrap();
            }
            (
                want(&[(VOLUME, &["w1", "w2"]), ("vol2", &["w3"])]),
                vec![VOLUME, "vol2"],
            )
        }
        Before::StuckPublishing(method, state) | Before::StuckUnpublishing(method, state) => {
            let publishing = matches!(before, Before::StuckPublishing(..));
            if !publishing {
                node.publish(VOLUME, WORKLOAD).await.unwrap();
            }
            node.set_faults(&json!({"rules": [
                {"method": method, "fail": {"code": "UNAVAILABLE", "message": "stuck"}}
            ]}));
            let api = node.api();
            // Retried until the operation timeout; the reboot cuts it short.
            tokio::spawn(async move {
                if publishing {
                    let _ = api.publish(&publish_with_secrets(VOLUME, WORKLOAD)).await;
                } else {
                    let _ = api.unpublish(&unpublish_request(VOLUME, WORKLOAD)).await;
                }
            });
            eventually(
                &format!("stuck in {state}"),
                Duration::from_secs(20),
                || async {
                    let failed = node
                        .calls()
                        .iter()
                        .any(|c| c["method"] == method && c["code"] == "UNAVAILABLE");
                    match node.disk_record(VOLUME) {
                        Some(record) if record.state == state && failed => Ok(()),
                        other => Err(format!("{other:?}, {method} failed: {failed}")),
                    }
                },
            )
            .await;
            if publishing {
                (want(&[(VOLUME, &[WORKLOAD])]), vec![VOLUME])
            } else {
                (Want::new(), vec![VOLUME])
            }
        }
    }
}

/// A reboot: the daemon and the plugin die, every mount vanishes, /run is emptied, the boot
/// id changes. With `plugin_forgets`, the plugin sees the new boot too (its node-side
/// bookkeeping is dropped at start); otherwise it comes back with stale node-side records.
async fn reboot(node: &mut Node, plugin_forgets: bool) {
    node.kill9();
    node.unmount_all();
    node.kill_plugins().await;
    node.clear_faults();
    for entry in std::fs::read_dir(&node.socket_root).unwrap().flatten() {
        std::fs::remove_dir_all(entry.path()).unwrap();
    }
    if plugin_forgets {
        let path = node.plugin_dir.join("state.json");
        let mut state = node.plugin_state();
        state["boot_id"] = json!("the-boot-before");
        std::fs::write(&path, serde_json::to_vec_pretty(&state).unwrap()).unwrap();
    }
    std::fs::write(node.boot_id_file.as_ref().unwrap(), "boot-2\n").unwrap();
    node.start(None).await;
}

/// After a reboot in each state, volumes with claims are published again (staged first, not
/// a bind of an empty staging dir) and the others are cleaned; then unpublishing leaves
/// nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_reboot_in_each_state_claimed_volumes_are_published_again() {
    require_private_mount_namespace();
    let started = Instant::now();
    let mut cases = 0;
    for before in REBOOTS {
        for plugin_forgets in [true, false] {
            cases += 1;
            let what = format!("reboot in {before:?} (plugin forgets: {plugin_forgets})");
            let mut node = Node::new(&format!("{VOLUME}:1M,vol2:1M"));
            let boot_id_file = node.root.path().join("boot_id");
            std::fs::write(&boot_id_file, "boot-1\n").unwrap();
            node.boot_id_file = Some(boot_id_file);
            node.start(None).await;
            node.wait_recovered().await;
            let (wanted, known) = reach(&node, *before).await;
            // Data written through a published target before the reboot is there after it.
            let written: Vec<&String> = wanted
                .keys()
                .filter(|v| node.mounts().contains(&node.target(v)))
                .collect();
            for volume in &written {
                std::fs::write(node.target(volume).join("before-reboot"), b"kept").unwrap();
            }
            let node_side = known
                .iter()
                .filter(|v| node.disk_record(v).is_some_and(|r| level(&r.state) >= 3))
                .count();
            reboot(&mut node, plugin_forgets).await;
            node.wait_recovered().await;
            // The reboot was seen as one, by the daemon and (if asked) by the plugin.
            let recovered = node.log_events("volumes recovered");
            assert_eq!(recovered.len(), 1, "{what}: {recovered:?}");
            assert_eq!(
                recovered[0]["reset_by_reboot"],
                json!(node_side),
                "{what}: {recovered:?}"
            );
            node.converged(&wanted, &known, &what).await;
            assert_eq!(
                node.plugin_stderr()
                    .contains("boot id changed since the last run"),
                plugin_forgets,
                "{what}"
            );
            for volume in &written {
                assert_eq!(
                    std::fs::read(node.target(volume).join("before-reboot")).unwrap(),
                    b"kept",
                    "{what}"
                );
            }
            for (volume, workloads) in &wanted {
                for workload in workloads {
                    node.unpublish(volume, workload).await.unwrap();
                }
            }
            node.assert_consistent(&Want::new(), &known, &what).await;
        }
    }
    println!(
        "reboots: {} states x 2 plugin behaviours = {cases} reboots, all converged, {:.0} s",
        REBOOTS.len(),
        started.elapsed().as_secs_f64()
    );
}

/// The progress notes of a publish lost with the daemon (killed before their flush) leave a
/// record below what is mounted. A claim removed before the reconciler has done the steps
/// again (here it cannot: the plugin refuses every step up with a final error, so the
/// reconciler backs off between tries and lets the unpublish in) must still take down what the
/// mount table shows, not leave the target and staging mounted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_removed_before_recovery_caught_up_undoes_what_lost_notes_hid() {
    require_private_mount_namespace();
    let mut node = Node::new(&format!("{VOLUME}:1Mi"));
    node.start(None).await;
    node.wait_recovered().await;
    node.publish(VOLUME, WORKLOAD).await.unwrap();
    node.kill9();
    let on_disk = node.disk_record(VOLUME).expect("the claim is durable");
    assert!(
        level(&on_disk.state) < level("PUBLISHED"),
        "the notes were flushed before the kill ({on_disk:?}): the test proves nothing"
    );
    assert!(node.mounts().contains(&node.target(VOLUME)));
    node.set_faults(&json!({"rules": [
        {"method": "ControllerPublishVolume", "fail": {"code": "INTERNAL", "message": "refused"}},
        {"method": "NodeStageVolume", "fail": {"code": "INTERNAL", "message": "refused"}},
        {"method": "NodePublishVolume", "fail": {"code": "INTERNAL", "message": "refused"}}
    ]}));
    node.start(None).await;
    node.wait_recovered().await;
    node.unpublish(VOLUME, WORKLOAD).await.unwrap();
    node.converged(
        &Want::new(),
        &[VOLUME],
        "the volume after its claim was removed",
    )
    .await;
}

/// The daemon killed at each expansion failpoint while a published `--volume-fs tmpfs` volume
/// grows from 1 MiB to 16 MiB (ONLINE, controller and node expansion). Restarted without
/// failpoints it converges on its own where the intent was durable (every point but
/// `before_intent`): the API shows the capacity reached and no expansion in progress, the
/// file system seen through the target has grown, and the plugin's own state agrees. Killed
/// before the intent, nothing changed and nothing resumes: the workload repeats its request,
/// which succeeds. An unpublish then leaves nothing mounted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_daemon_killed_at_each_expansion_failpoint_resumes_the_expansion() {
    require_private_mount_namespace();
    const MI: i64 = 1 << 20;
    let fs_size = |path: &Path| -> i64 {
        let fs = rustix::fs::statvfs(path).unwrap();
        (fs.f_blocks * fs.f_frsize) as i64
    };
    for point in EXPAND_ONLY {
        let mut node = Node::new(&format!("{VOLUME}:1Mi"));
        let mut config = managed_config(PLUGIN, &node.plugin_dir, &format!("{VOLUME}:1Mi"));
        let args = config["containers"][0]["command"]["arguments"]
            .as_array_mut()
            .unwrap();
        for flag in [
            "--volume-fs",
            "tmpfs",
            "--expansion",
            "online",
            "--controller-expand",
            "--node-expand",
        ] {
            args.push(flag.into());
        }
        node.add_config("test.json", &config);
        let spec = format!("{point}=exit");
        node.start(Some(&spec)).await;
        node.wait_recovered().await;
        let published = node.publish(VOLUME, WORKLOAD).await.unwrap();
        let target = PathBuf::from(&published.target_path);
        std::fs::write(target.join("data"), b"kept").unwrap();
        let err = node
            .api()
            .expand_volume(PLUGIN, VOLUME, 16 * MI)
            .await
            .unwrap_err();
        node.expect_failpoint_kill(point, &err).await;
        let intent_durable = *point != "volume.expand.before_intent";
        // The claim is durable (the publish was answered); its progress notes may not be.
        let on_disk = node
            .disk_record(VOLUME)
            .expect("the published volume's record");
        assert!(on_disk.claims.contains(WORKLOAD), "{point}: {on_disk:?}");

        node.start(None).await;
        node.wait_recovered().await;
        if intent_durable {
            eventually(
                &format!("{point}: the expansion to resume"),
                Duration::from_secs(30),
                || async {
                    let v = node
                        .api()
                        .volume(PLUGIN, VOLUME)
                        .await
                        .map_err(|e| e.to_string())?;
                    if v.capacity_bytes == Some(16 * MI) && v.expansion.is_none() {
                        Ok(())
                    } else {
                        Err(format!("{v:?}"))
                    }
                },
            )
            .await;
        } else {
            let v = node.api().volume(PLUGIN, VOLUME).await.unwrap();
            assert_eq!(v.expansion, None, "{point}: no intent was durable");
            assert_eq!(fs_size(&target), MI, "{point}: nothing grew");
            // The workload repeats its request.
            let v = node
                .api()
                .expand_volume(PLUGIN, VOLUME, 16 * MI)
                .await
                .unwrap();
            assert_eq!(v.capacity_bytes, Some(16 * MI));
        }
        assert_eq!(fs_size(&target), 16 * MI, "{point}: the file system grew");
        assert_eq!(std::fs::read(target.join("data")).unwrap(), b"kept");
        let state = node.plugin_state();
        assert_eq!(
            state["volumes"][VOLUME]["capacity_bytes"].as_i64(),
            Some(16 * MI),
            "{point}: the plugin's state agrees: {state}"
        );
        // A repeat is idempotent, and the unpublish leaves nothing.
        let v = node
            .api()
            .expand_volume(PLUGIN, VOLUME, 16 * MI)
            .await
            .unwrap();
        assert_eq!(v.capacity_bytes, Some(16 * MI));
        node.unpublish(VOLUME, WORKLOAD).await.unwrap();
        // Nothing is left mounted but the volume's own tmpfs in the plugin's dir (the
        // backing of `--volume-fs tmpfs`, which the publish/unpublish cycle's check does not
        // expect), and the API tracks nothing.
        assert_eq!(
            node.mounts(),
            vec![node.plugin_dir.join("volumes").join(VOLUME)],
            "{point}: unpublished"
        );
        assert!(
            node.api().volumes().await.unwrap().volumes.is_empty(),
            "{point}"
        );
        println!("{point}: killed, resumed, converged");
    }
}

/// The snapshot steps' failpoints, hit by a snapshot create or delete, not by a
/// publish/unpublish cycle: [`the_daemon_killed_at_each_snapshot_failpoint_converges`].
const SNAPSHOT_ONLY: &[&str] = &[
    "snapshot.create.after_intent",
    "snapshot.create.after_rpc",
    "snapshot.delete.after_intent",
    "snapshot.delete.after_rpc",
];

/// The snapshot rows of the daemon's database (read while it is dead or alive):
/// `(snapshot name key, record)`.
fn snapshot_rows(node: &Node) -> Vec<(String, serde_json::Value)> {
    csi_agent::store::db::dump(&node.work)
        .unwrap()
        .into_iter()
        .filter(|r| r.plugin_name.ends_with("/snapshots"))
        .map(|r| (r.volume_key, serde_json::from_str(&r.record).unwrap()))
        .collect()
}

/// The snapshots the plugin holds: its records (with `complete`) and its data directories.
fn plugin_snapshots(node: &Node) -> (Vec<(String, bool)>, Vec<String>) {
    let state = node.plugin_state();
    let records = state["snapshots"]
        .as_object()
        .map(|m| {
            m.iter()
                .map(|(k, v)| (k.clone(), v["complete"] == json!(true)))
                .collect()
        })
        .unwrap_or_default();
    (records, dir_names(&node.plugin_dir.join("snapshots")))
}

/// The daemon SIGKILLed at each snapshot failpoint, then restarted without failpoints: the
/// intent (or the delete mark) is on disk at the kill, recovery resumes it on its own, and
/// the plugin ends with exactly one snapshot (create) or none (delete), the database with the
/// matching record or none; the caller's repeated request then agrees, without another copy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_daemon_killed_at_each_snapshot_failpoint_converges() {
    require_private_mount_namespace();
    let documented = documented_points();
    for point in SNAPSHOT_ONLY {
        assert!(
            documented.iter().any(|p| p == point),
            "{point} is not in docs/recovery.md"
        );
        let mut node = Node::new(&format!("{VOLUME}:1M"));
        let mut config = managed_config(PLUGIN, &node.plugin_dir, &format!("{VOLUME}:1M"));
        config["containers"][0]["command"]["arguments"]
            .as_array_mut()
            .unwrap()
            .push("--snapshots".into());
        node.add_config("test.json", &config);
        node.start(Some(&format!("{point}=1*exit"))).await;
        node.wait_recovered().await;
        let request = csi_agent_api::CreateSnapshotRequest {
            plugin: PLUGIN.to_owned(),
            source_volume_id: VOLUME.to_owned(),
            name: "snap".to_owned(),
            parameters: Default::default(),
        };
        let creating = point.starts_with("snapshot.create.");
        if creating {
            let err = node.api().create_snapshot(&request).await.unwrap_err();
            node.expect_failpoint_kill(point, &err).await;
        } else {
            let taken = node.api().create_snapshot(&request).await.unwrap();
            let err = node
                .api()
                .delete_snapshot(PLUGIN, &taken.snapshot_id)
                .await
                .unwrap_err();
            node.expect_failpoint_kill(point, &err).await;
        }
        // At the kill: the intent (or the delete mark) is durable.
        let rows = snapshot_rows(&node);
        assert_eq!(rows.len(), 1, "{point}: {rows:?}");
        if creating {
            assert_eq!(rows[0].1["source_volume_id"], json!(VOLUME), "{point}");
        } else {
            assert_eq!(rows[0].1["deleting"], json!(true), "{point}: {rows:?}");
        }

        node.start(None).await;
        node.wait_recovered().await;
        eventually(
            &format!("{point}: recovery to finish the snapshot operation"),
            Duration::from_secs(30),
            || async {
                let rows = snapshot_rows(&node);
                let plugin = plugin_snapshots(&node);
                let done = if creating {
                    rows.len() == 1
                        && rows[0].1["ready_to_use"] == json!(true)
                        && plugin == (vec![("snap".to_owned(), true)], vec!["snap".to_owned()])
                } else {
                    rows.is_empty() && plugin == (Vec::new(), Vec::new())
                };
                if done {
                    Ok(())
                } else {
                    Err(format!("rows {rows:?}, plugin {plugin:?}"))
                }
            },
        )
        .await;
        if creating {
            // The caller's retried request: the same snapshot, no second copy.
            let calls_before = node
                .calls()
                .iter()
                .filter(|c| c["method"] == "CreateSnapshot")
                .count();
            let taken = node.api().create_snapshot(&request).await.unwrap();
            assert!(taken.ready_to_use, "{point}: {taken:?}");
            assert_eq!(taken.snapshot_id, "snap");
            let calls_after = node
                .calls()
                .iter()
                .filter(|c| c["method"] == "CreateSnapshot")
                .count();
            assert_eq!(
                calls_before, calls_after,
                "{point}: answered from the record"
            );
            assert_eq!(plugin_snapshots(&node).1, ["snap"], "{point}");
            node.api().delete_snapshot(PLUGIN, "snap").await.unwrap();
        }
        assert!(snapshot_rows(&node).is_empty(), "{point}");
        assert_eq!(plugin_snapshots(&node), (Vec::new(), Vec::new()), "{point}");
        println!("{point}: killed, recovered, converged");
    }
}
