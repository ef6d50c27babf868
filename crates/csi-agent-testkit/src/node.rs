//! A node for the crash matrix and the other observed-node tests: a [`Daemon`] with the
//! test plugin in a temp dir of its own (work dir, plugin configs, socket root, plugin state),
//! and everything that can be observed of it from outside: `/proc/self/mountinfo`, the API, the
//! plugin's state dir and call log, the work dir's files and the process table.
//!
//! Nothing here knows a failpoint: the tests decide what to break and what to expect.

use std::collections::{BTreeMap, BTreeSet};
use std::ops::{Deref, DerefMut};
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use csi_agent::layout::{Layout, encode_id};
use csi_agent::mounts::{HostMounter, Mounter};
use csi_agent_api::{ApiError, PublishResponse};
use serde_json::Value;

use crate::{
    Daemon, NODE_ID, PLUGIN, eventually, kill9_pid, mounts_under, pid_alive, publish_with_secrets,
    unpublish_request,
};

/// Volume id → the workloads that must hold a claim on it. A volume absent from the map must
/// be absent everywhere (no claim, no record, no mount, nothing in the plugin).
pub type Want = BTreeMap<String, BTreeSet<String>>;

pub fn want(entries: &[(&str, &[&str])]) -> Want {
    entries
        .iter()
        .map(|(volume, workloads)| {
            (
                (*volume).to_owned(),
                workloads.iter().map(|w| (*w).to_owned()).collect(),
            )
        })
        .collect()
}

/// What a volume's record on disk says, read while the daemon is dead.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DiskRecord {
    pub state: String,
    pub claims: BTreeSet<String>,
}

/// What the plugin's own bookkeeping says of one volume: the three things it can hold.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PluginHolds {
    pub controller_published: bool,
    pub staged: bool,
    pub published: bool,
}

impl PluginHolds {
    /// In lifecycle order, with the level of the transient state of each step
    /// (CONTROLLER_PUBLISH 1, NODE_STAGE 3, NODE_PUBLISH 5; docs/on-disk-format.md).
    pub fn steps(self) -> [(&'static str, u8, bool); 3] {
        [
            ("controller publish", 1, self.controller_published),
            ("stage", 3, self.staged),
            ("publish", 5, self.published),
        ]
    }
}

/// The ladder of docs/recovery.md: steady states even, each transient between its two.
pub fn level(state: &str) -> u8 {
    match state {
        "CREATED" => 0,
        "CONTROLLER_PUBLISH" | "CONTROLLER_UNPUBLISH" => 1,
        "NODE_READY" => 2,
        "NODE_STAGE" | "NODE_UNSTAGE" => 3,
        "VOL_READY" => 4,
        "NODE_PUBLISH" | "NODE_UNPUBLISH" => 5,
        "PUBLISHED" => 6,
        other => panic!("unknown volume state {other:?} on disk"),
    }
}

/// A [`Daemon`] (reached through `Deref`: `node.api()`, `node.work`, `node.kill9()`, ...)
/// with the test plugin's state dir, in a temp dir of its own removed on drop.
#[derive(Debug)]
pub struct Node {
    /// Dropped first: kills what runs and detaches the mounts before `root` goes.
    pub daemon: Daemon,
    pub root: tempfile::TempDir,
    pub plugin_dir: PathBuf,
}

impl Deref for Node {
    type Target = Daemon;
    fn deref(&self) -> &Daemon {
        &self.daemon
    }
}

impl DerefMut for Node {
    fn deref_mut(&mut self) -> &mut Daemon {
        &mut self.daemon
    }
}

impl Node {
    /// A node whose managed test plugin pre-provisions `volumes` (`name:size,...`); the daemon
    /// logs JSON ([`Daemon::log_events`] reads only that).
    pub fn new(volumes: &str) -> Self {
        let root = tempfile::Builder::new()
            .prefix("csi-crash-")
            .tempdir_in("/tmp")
            .unwrap();
        let daemon = Daemon::builder(root.path())
            .test_plugin(volumes)
            .log_format("json")
            .build();
        Self {
            daemon,
            plugin_dir: root.path().join("plugin"),
            root,
        }
    }

    /// Starts the daemon, with `failpoints` as `CSI_AGENT_FAILPOINTS` (none when `None`), and
    /// waits until its API answers.
    pub async fn start(&mut self, failpoints: Option<&str>) {
        assert!(self.child.is_none(), "the daemon is already running");
        self.daemon
            .set_env(csi_agent::failpoint::ENV_VAR, failpoints);
        // Not `Daemon::start`, whose wait for the socket blocks the thread: the soak's and the
        // crash matrix's clients run on this runtime and must keep running while the daemon
        // restarts (a blocked runtime froze all 16 soak clients at every restart).
        // A socket left by a daemon killed before would look like the new one's.
        let _ = std::fs::remove_file(&self.daemon.socket);
        self.daemon.spawn();
        self.daemon.wait_healthy().await;
    }

    /// What the plugin wrote on stderr (the daemon appends it to its component dir).
    pub fn plugin_stderr(&self) -> String {
        let dir = self.layout().containers_dir(PLUGIN, "default");
        std::fs::read_dir(dir)
            .map(|entries| {
                entries
                    .flatten()
                    .map(|e| std::fs::read_to_string(e.path().join("stderr")).unwrap_or_default())
                    .collect()
            })
            .unwrap_or_default()
    }

    /// After a request failed: the daemon must have died by SIGKILL, sent by the failpoint
    /// `point` (its last words are on stderr).
    pub async fn expect_failpoint_kill(&mut self, point: &str, request_error: &ApiError) {
        let status = self.exit_status(Duration::from_secs(15)).await;
        let log = self.log_text();
        let Some(status) = status else {
            panic!(
                "the request failed ({request_error}) but the daemon did not die at {point}: {log}"
            );
        };
        assert_eq!(
            status.signal(),
            Some(9),
            "the daemon ended with {status:?}, not by SIGKILL at {point}: {log}"
        );
        let line = format!("failpoint {point}: exit (SIGKILL to self)");
        assert_eq!(
            log.matches(&line).count(),
            1,
            "the daemon was killed, but not once by {point}: {log}"
        );
        assert!(
            request_error.is_connection(),
            "the daemon died but the request got an answer: {request_error}"
        );
    }

    /// Whether the daemon died at `point` by itself within `timeout` (a failpoint hit after
    /// the answer, such as a commit of progress notes). Checks it died of SIGKILL there.
    pub async fn died_at_failpoint(&mut self, point: &str, timeout: Duration) -> bool {
        let Some(status) = self.exit_status(timeout).await else {
            return false;
        };
        let log = self.log_text();
        assert_eq!(
            status.signal(),
            Some(9),
            "the daemon ended with {status:?}: {log}"
        );
        let line = format!("failpoint {point}: exit (SIGKILL to self)");
        assert_eq!(
            log.matches(&line).count(),
            1,
            "not killed once by {point}: {log}"
        );
        true
    }

    // ---- plugin processes ----

    /// Every live process whose command line has this node's plugin dir as an argument: the
    /// test plugin instances working on its state (the launch passes `--work-dir <dir>`).
    pub fn plugin_pids(&self) -> BTreeSet<i32> {
        crate::plugin_pids(&self.plugin_dir)
    }

    /// The pid the daemon recorded for its component (`containers/<id>/component.json`).
    pub fn component_record_pid(&self) -> Option<i32> {
        let dir = Layout::new(&self.work).containers_dir(PLUGIN, "default");
        let mut pids = Vec::new();
        for entry in std::fs::read_dir(dir).ok()?.flatten() {
            let Ok(bytes) = std::fs::read(entry.path().join("component.json")) else {
                continue;
            };
            let record: Value = serde_json::from_slice(&bytes).unwrap();
            let pid = find_key(&record["runtime"], "pid")
                .and_then(Value::as_i64)
                .expect("component.json has a runtime pid");
            pids.push(i32::try_from(pid).unwrap());
        }
        assert!(pids.len() <= 1, "several component records: {pids:?}");
        pids.pop()
    }

    /// The pids of the components the API reports ready, and the restarts it counted.
    pub async fn api_plugin_pids(&self) -> Result<(BTreeSet<i32>, u64), String> {
        let info = self
            .api()
            .plugin(PLUGIN)
            .await
            .map_err(|e| format!("GET /v1/plugins/{PLUGIN}: {e}"))?;
        let pids = info
            .components
            .iter()
            .filter_map(|c| c.pid)
            .map(|p| i32::try_from(p).unwrap())
            .collect();
        Ok((pids, info.components.iter().map(|c| c.restarts).sum()))
    }

    /// SIGKILLs every plugin process of this node and waits until they are gone.
    pub async fn kill_plugins(&self) {
        let pids = self.plugin_pids();
        for pid in &pids {
            kill9_pid(*pid);
        }
        let deadline = Instant::now() + Duration::from_secs(10);
        while pids.iter().any(|pid| pid_alive(*pid)) {
            assert!(
                Instant::now() < deadline,
                "plugin processes {pids:?} survive"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    // ---- paths and files ----

    pub fn layout(&self) -> Layout {
        Layout::new(&self.work)
    }

    pub fn staging(&self, volume: &str) -> PathBuf {
        self.layout().staging_path(PLUGIN, "default", volume)
    }

    pub fn target(&self, volume: &str) -> PathBuf {
        self.layout().target_path(PLUGIN, "default", volume)
    }

    /// Every mount point under this node's temp dir (work dir, plugin dir, socket root), in
    /// mount table order, repeated if stacked.
    pub fn mounts(&self) -> Vec<PathBuf> {
        mounts_under(self.root.path())
    }

    /// Unmounts everything under the temp dir, innermost first (what a reboot does).
    pub fn unmount_all(&self) {
        let mut mounts = self.mounts();
        mounts.sort_by_key(|p| std::cmp::Reverse(p.components().count()));
        mounts.dedup();
        for mount in mounts {
            HostMounter.unmount(&mount).unwrap();
        }
        assert!(self.mounts().is_empty(), "{:?}", self.mounts());
    }

    /// The record committed to the state database, if any.
    pub fn disk_record(&self, volume: &str) -> Option<DiskRecord> {
        let key = encode_id(volume);
        let row = csi_agent::store::db::dump(&self.work)
            .unwrap_or_default()
            .into_iter()
            .find(|row| row.plugin_type == PLUGIN && row.volume_key == key)?;
        let record: Value = serde_json::from_str(&row.record)
            .unwrap_or_else(|e| panic!("the record of {volume} does not parse: {e}"));
        Some(DiskRecord {
            state: record["state"].as_str().unwrap().to_owned(),
            claims: record["claims"]
                .as_array()
                .unwrap()
                .iter()
                .map(|c| c.as_str().unwrap().to_owned())
                .collect(),
        })
    }

    pub fn plugin_state(&self) -> Value {
        let path = self.plugin_dir.join("state.json");
        serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap()
    }

    /// What the plugin holds of `volume`, and whether that is what the paths csi-agent gave
    /// it: anything staged or published elsewhere is an error.
    pub fn plugin_holds(&self, volume: &str) -> Result<PluginHolds, String> {
        if !self.plugin_dir.join("state.json").exists() {
            // Never launched: it holds nothing.
            return Ok(PluginHolds::default());
        }
        let state = self.plugin_state();
        let v = &state["volumes"][volume];
        if v.is_null() {
            return Err(format!("the plugin does not know volume {volume}: {state}"));
        }
        let nodes: Vec<&String> = v["controller_published"]
            .as_object()
            .map(|m| m.keys().collect())
            .unwrap_or_default();
        let staged = match v["staged"]["path"].as_str() {
            None => false,
            Some(path) if Path::new(path) == self.staging(volume) => true,
            Some(path) => return Err(format!("{volume} is staged at a foreign path {path}")),
        };
        let targets: Vec<&String> = v["published"]
            .as_object()
            .map(|m| m.keys().collect())
            .unwrap_or_default();
        let target = self.target(volume);
        if targets.iter().any(|t| Path::new(t.as_str()) != target) || targets.len() > 1 {
            return Err(format!(
                "{volume} is published at {targets:?}, not only {target:?}"
            ));
        }
        if nodes.iter().any(|n| n.as_str() != NODE_ID) {
            return Err(format!("{volume} is controller-published to {nodes:?}"));
        }
        Ok(PluginHolds {
            controller_published: !nodes.is_empty(),
            staged,
            published: !targets.is_empty(),
        })
    }

    /// The plugin's call log, one JSON object per completed call.
    pub fn calls(&self) -> Vec<Value> {
        std::fs::read_to_string(self.plugin_dir.join("calls.jsonl"))
            .unwrap_or_default()
            .lines()
            .map(|line| serde_json::from_str(line).unwrap())
            .collect()
    }

    /// Replaces the plugin's fault file atomically (the plugin re-reads it on change).
    pub fn set_faults(&self, faults: &Value) {
        std::fs::create_dir_all(&self.plugin_dir).unwrap();
        let tmp = self.plugin_dir.join("faults.json.tmp-test");
        std::fs::write(&tmp, serde_json::to_vec_pretty(faults).unwrap()).unwrap();
        std::fs::rename(&tmp, self.plugin_dir.join("faults.json")).unwrap();
    }

    pub fn clear_faults(&self) {
        for file in ["faults.json", "faults.json.state"] {
            match std::fs::remove_file(self.plugin_dir.join(file)) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => panic!("{file}: {e}"),
            }
        }
    }

    /// How often the fault rule with this `id` has fired (persisted before it acts).
    pub fn fault_fired(&self, id: &str) -> u64 {
        std::fs::read(self.plugin_dir.join("faults.json.state"))
            .ok()
            .and_then(|b| serde_json::from_slice::<Value>(&b).ok())
            .and_then(|v| v["fired"][format!("id:{id}")].as_u64())
            .unwrap_or(0)
    }

    // ---- the convergence check ----

    /// Everything observable agrees with `want`: the API, the mount table, the plugin's
    /// bookkeeping and processes, and the files in the work dir. `known` lists every volume
    /// the test touched (those not in `want` must have left no trace).
    pub async fn consistency(&self, want: &Want, known: &[&str]) -> Result<(), String> {
        // The API answers, and lists exactly the claimed volumes, published.
        let listed = self
            .api()
            .volumes()
            .await
            .map_err(|e| format!("GET /v1/volumes: {e}"))?;
        let mut seen = Want::new();
        for volume in &listed.volumes {
            if volume.plugin != PLUGIN || volume.state != "PUBLISHED" {
                return Err(format!("GET /v1/volumes lists {volume:?}"));
            }
            if Path::new(&volume.target_path) != self.target(&volume.volume_id) {
                return Err(format!("target path of {volume:?}"));
            }
            seen.insert(
                volume.volume_id.clone(),
                volume.claims.iter().cloned().collect(),
            );
        }
        if &seen != want {
            return Err(format!("GET /v1/volumes has {seen:?}, want {want:?}"));
        }
        let info = self
            .api()
            .plugin(PLUGIN)
            .await
            .map_err(|e| format!("GET /v1/plugins/{PLUGIN}: {e}"))?;
        if info.volumes != want.len() {
            return Err(format!("the plugin reports {} volumes", info.volumes));
        }

        // Mounted: each claimed volume's staging and target, once; nothing else under the
        // work dir, the plugin dir or the socket root.
        let mut mounts = self.mounts();
        mounts.sort();
        let mut expected: Vec<PathBuf> = want
            .keys()
            .flat_map(|v| [self.staging(v), self.target(v)])
            .collect();
        expected.sort();
        if mounts != expected {
            return Err(format!("mounted {mounts:?}, want {expected:?}"));
        }

        // The plugin agrees: everything done for a claimed volume, nothing for the others.
        for volume in known {
            let holds = self.plugin_holds(volume)?;
            let claimed = want.contains_key(*volume);
            let all = PluginHolds {
                controller_published: claimed,
                staged: claimed,
                published: claimed,
            };
            if holds != all {
                return Err(format!(
                    "the plugin holds {holds:?} of {volume} (claimed: {claimed})"
                ));
            }
        }

        // One plugin process, the one the daemon supervises.
        let processes = self.plugin_pids();
        let (reported, _) = self.api_plugin_pids().await?;
        if processes.len() > 1 || processes != reported {
            return Err(format!(
                "plugin processes {processes:?}, the daemon reports {reported:?} (leaked or lost plugin)"
            ));
        }

        // Files: one record per claimed volume and its mount dirs; no stray dir, no temp
        // file, nothing quarantined.
        let layout = self.layout();
        let names = |dir: PathBuf| -> BTreeSet<String> {
            std::fs::read_dir(dir)
                .map(|entries| {
                    entries
                        .flatten()
                        .map(|e| e.file_name().to_string_lossy().into_owned())
                        .collect()
                })
                .unwrap_or_default()
        };
        let encoded: BTreeSet<String> = want.keys().map(|v| encode_id(v)).collect();
        let records: BTreeSet<String> = csi_agent::store::db::dump(&self.work)
            .unwrap_or_default()
            .into_iter()
            .filter(|row| row.plugin_type == PLUGIN)
            .map(|row| row.volume_key)
            .collect();
        if records != encoded {
            return Err(format!("volume records {records:?}, want {encoded:?}"));
        }
        // Only secrets files live beside the database, and only for recorded volumes.
        let secrets_dirs = names(layout.volumes_dir(PLUGIN, "default"));
        if !secrets_dirs.is_subset(&encoded) {
            return Err(format!(
                "secrets dirs {secrets_dirs:?}, want within {encoded:?}"
            ));
        }
        for volume in want.keys() {
            let files = names(layout.volume_dir(PLUGIN, "default", volume));
            let allowed: BTreeSet<String> = ["secrets.json".to_owned()].into_iter().collect();
            if !files.is_subset(&allowed) {
                return Err(format!("files of the record of {volume}: {files:?}"));
            }
            let dirs = names(layout.volume_mount_dir(PLUGIN, "default", volume));
            if dirs != ["staging".to_owned(), "target".to_owned()].into() {
                return Err(format!("mount dir of {volume} holds {dirs:?}"));
            }
        }
        let mount_dirs = names(layout.mounts_dir(PLUGIN, "default"));
        if mount_dirs != encoded {
            return Err(format!("mount dirs {mount_dirs:?}, want {encoded:?}"));
        }
        let quarantined = names(layout.plugin_dir(PLUGIN, "default").join("quarantine"));
        if !quarantined.is_empty() {
            return Err(format!("quarantined: {quarantined:?}"));
        }
        let quarantined_rows: i64 = rusqlite::Connection::open_with_flags(
            self.work.join("state.db"),
            rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY,
        )
        .and_then(|db| db.query_row("SELECT count(*) FROM quarantine", [], |row| row.get(0)))
        .unwrap_or(0);
        if quarantined_rows != 0 {
            return Err(format!("{quarantined_rows} quarantined rows"));
        }

        // A published target is the volume itself, not an empty directory.
        for volume in want.keys() {
            let probe = self.target(volume).join(".crash-matrix-probe");
            std::fs::write(&probe, volume.as_bytes())
                .map_err(|e| format!("write through {}: {e}", probe.display()))?;
            let seen = std::fs::read(
                self.plugin_dir
                    .join("volumes")
                    .join(volume)
                    .join(".crash-matrix-probe"),
            );
            std::fs::remove_file(&probe).map_err(|e| e.to_string())?;
            if seen.ok().as_deref() != Some(volume.as_bytes()) {
                return Err(format!(
                    "{} is not volume {volume}",
                    self.target(volume).display()
                ));
            }
        }
        Ok(())
    }

    /// Waits until [`Node::consistency`] holds.
    pub async fn converged(&self, want: &Want, known: &[&str], what: &str) {
        eventually(what, Duration::from_secs(30), || {
            self.consistency(want, known)
        })
        .await;
    }

    /// [`Node::consistency`] must hold now — but for the progress notes of the operation just
    /// answered, which the daemon commits within its note flush interval (500 ms): they get
    /// two seconds.
    pub async fn assert_consistent(&self, want: &Want, known: &[&str], what: &str) {
        let deadline = Instant::now() + Duration::from_secs(2);
        loop {
            match self.consistency(want, known).await {
                Ok(()) => return,
                Err(_) if Instant::now() < deadline => {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                Err(err) => panic!("{what}: {err}\n{}", self.log_text()),
            }
        }
    }

    /// Waits until the plugin is initialized (its volumes recovered) in a daemon just started.
    pub async fn wait_recovered(&self) {
        eventually(
            "the plugin to be initialized",
            Duration::from_secs(20),
            || async {
                let info = self.api().plugin(PLUGIN).await.map_err(|e| e.to_string())?;
                match info.state.as_str() {
                    "not_started" => Err("not started".to_owned()),
                    "failed" => panic!("the plugin failed to initialize: {info:?}"),
                    _ => Ok(()),
                }
            },
        )
        .await;
    }

    pub async fn publish(&self, volume: &str, workload: &str) -> Result<PublishResponse, ApiError> {
        self.api()
            .publish(&publish_with_secrets(volume, workload))
            .await
    }

    pub async fn unpublish(&self, volume: &str, workload: &str) -> Result<(), ApiError> {
        self.api()
            .unpublish(&unpublish_request(volume, workload))
            .await
            .map(|_| ())
    }
}

fn find_key<'a>(value: &'a Value, key: &str) -> Option<&'a Value> {
    match value {
        Value::Object(map) => map
            .get(key)
            .or_else(|| map.values().find_map(|v| find_key(v, key))),
        _ => None,
    }
}
