//! Keeps the operators' documents in step with what the engine really makes, so that they
//! cannot drift:
//! - every metric the engine registers has its row in docs/operations.md's metrics table, and
//!   every row there is a registered metric;
//! - the work-dir tree of docs/on-disk-format.md is the real one: a real `csi-agentd` with the
//!   real `csi-testplugin` publishes a volume (with secrets), and every entry of the work dir
//!   it leaves has its line in the tree, and every line of the tree is either found there or
//!   named by the engine's code (the entries of images, the oci runtime, fetched URIs and
//!   migration, which this test does not make).
//!
//! The work-dir test runs the daemon as root in a private mount namespace
//! (`unshare -m --propagation private`), like every test that mounts; it needs `csi-agentd`
//! and `csi-testplugin` built (`cargo build -p csi-agentd -p csi-testplugin`). Each failure
//! says what to add or remove, and where.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use csi_agent::binaries;
use csi_agent::metrics::Metrics;
use csi_agent::mounts::{MountTable, require_private_mount_namespace};
use prometheus_client::metrics::MetricType;
use serde_json::json;

fn repo_file(name: &str) -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .join(name);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The first column's names (`| \`name\` | …`) of the table rows of one `## ` section.
fn table_names(doc: &str, file: &str, section_title: &str) -> BTreeSet<String> {
    let section = doc
        .split("\n## ")
        .find(|s| s.starts_with(section_title))
        .unwrap_or_else(|| panic!("{file} has no `## {section_title}` section"));
    section
        .lines()
        .filter_map(|line| line.strip_prefix("| `"))
        .filter_map(|rest| rest.split('`').next())
        .map(str::to_owned)
        .collect()
}

/// The metric names a scrape shows, of every registered family (with samples or not):
/// counters with the `_total` their samples carry.
fn registered_metrics() -> BTreeSet<String> {
    let names: BTreeSet<String> = Metrics::new()
        .families()
        .map(|(name, kind)| match kind {
            MetricType::Counter => format!("{name}_total"),
            _ => name.to_owned(),
        })
        .collect();
    assert!(names.len() > 5, "no metric families registered: {names:?}");
    names
}

#[test]
fn every_registered_metric_has_a_row_in_operations_md() {
    let registered = registered_metrics();
    let documented = table_names(
        &repo_file("docs/operations.md"),
        "docs/operations.md",
        "Metrics and logs",
    );
    let missing: Vec<_> = registered.difference(&documented).collect();
    let stale: Vec<_> = documented.difference(&registered).collect();
    assert!(
        missing.is_empty(),
        "metrics registered in crates/csi-agent/src/metrics.rs without a row in \
         docs/operations.md (`## Metrics and logs`): {missing:?}; add \
         `| name | type | labels | what |` for each (counters with their `_total`)"
    );
    assert!(
        stale.is_empty(),
        "rows of docs/operations.md's metrics table that the engine does not register: \
         {stale:?}; remove them or fix the name"
    );
}

/// One entry of the documented tree: its path below the work dir, as segments (`<…>` is a
/// placeholder).
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
struct DocEntry {
    segments: Vec<String>,
}

impl DocEntry {
    fn display(&self) -> String {
        self.segments.join("/")
    }
}

/// The tree of docs/on-disk-format.md (the code block under `# The work dir`), every line
/// resolved to its full path: a line's parent is the nearest less indented line ending in `/`.
/// `a, b` lists siblings (`-shm` after `state.db` is `state.db-shm`); `name -> …` is a link;
/// `a/b/c` documents the dirs `a` and `a/b` too.
fn documented_tree() -> Vec<DocEntry> {
    let doc = repo_file("docs/on-disk-format.md");
    let block = doc
        .split("```\n")
        .nth(1)
        .expect("docs/on-disk-format.md starts with the work dir's tree in a ``` block");
    let mut lines = block.lines();
    assert_eq!(
        lines.next(),
        Some("<work_dir>/"),
        "the tree starts at <work_dir>/"
    );
    let mut parents: Vec<(usize, Vec<String>)> = Vec::new();
    let mut entries = Vec::new();
    for line in lines {
        let indent = line.len() - line.trim_start().len();
        // The name column ends at the first run of two spaces (the description follows).
        let column = line.trim_start().split("  ").next().unwrap_or("").trim();
        let column = column.split(" -> ").next().unwrap_or(column);
        while parents.last().is_some_and(|(at, _)| *at >= indent) {
            parents.pop();
        }
        let parent = parents.last().map(|(_, p)| p.clone()).unwrap_or_default();
        let stem = column.split(", ").next().unwrap_or("");
        for name in column.split(", ") {
            let name = match name.strip_prefix('-') {
                Some(suffix) => format!("{stem}-{suffix}"),
                None => name.to_owned(),
            };
            let mut segments = parent.clone();
            for segment in name.trim_end_matches('/').split('/') {
                segments.push(segment.to_owned());
                entries.push(DocEntry {
                    segments: segments.clone(),
                });
            }
            if name.ends_with('/') {
                parents.push((indent, segments));
            }
        }
    }
    entries.sort();
    entries.dedup();
    assert!(entries.len() > 15, "the tree did not parse: {entries:?}");
    entries
}

/// Whether a documented segment names a real one. A placeholder names any, except
/// `<fetched files>`: this test fetches no URI, and it would otherwise hide any undocumented
/// file of a container dir.
fn segment_matches(documented: &str, real: &str) -> bool {
    if documented == "<fetched files>" {
        return false;
    }
    documented == real || documented.starts_with('<') && documented.ends_with('>')
}

fn documents(entry: &DocEntry, real: &[String]) -> bool {
    entry.segments.len() == real.len()
        && entry
            .segments
            .iter()
            .zip(real)
            .all(|(d, r)| segment_matches(d, r))
}

/// Every path below `root`, relative, as segments; mount points are listed, not entered
/// (what a plugin keeps in its volume is not the work dir's).
fn real_tree(root: &Path, mounts: &MountTable) -> Vec<(Vec<String>, bool)> {
    let mut out = Vec::new();
    let mut pending = vec![(root.to_path_buf(), Vec::<String>::new())];
    while let Some((dir, segments)) = pending.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let entry = entry.unwrap();
            let mut path = segments.clone();
            path.push(entry.file_name().to_string_lossy().into_owned());
            let is_dir = entry.file_type().unwrap().is_dir();
            if is_dir && !mounts.is_mount_point(&entry.path()) {
                pending.push((entry.path(), path.clone()));
            }
            out.push((path, is_dir));
        }
    }
    out
}

/// A real daemon over a work dir in a temp dir; killed (by its pid) when dropped.
struct Daemon {
    child: Child,
    socket: PathBuf,
}

impl Daemon {
    fn curl(&self, method: &str, route: &str, body: &serde_json::Value) -> serde_json::Value {
        let out = Command::new("curl")
            .args(["-sS", "-m", "60", "--unix-socket"])
            .arg(&self.socket)
            .args(["-X", method, &format!("http://localhost{route}")])
            .args(["-H", "content-type: application/json", "-d"])
            .arg(body.to_string())
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "curl {route}: {out:?}");
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("{route} answered {text}: {e}"))
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[test]
fn the_work_dir_tree_of_on_disk_format_md_is_the_real_one() {
    require_private_mount_namespace();
    let tmp = tempfile::tempdir().unwrap();
    let (work, configs, plugin_dir) = (
        tmp.path().join("work"),
        tmp.path().join("configs"),
        tmp.path().join("plugin"),
    );
    std::fs::create_dir_all(&configs).unwrap();
    let config = json!({
        "type": "org.example.test",
        "containers": [{
            "services": ["CONTROLLER_SERVICE", "NODE_SERVICE"],
            "command": {
                "shell": false,
                "value": binaries::required("csi-testplugin", Some("CSI_TESTPLUGIN")),
                "arguments": ["csi-testplugin", "--endpoint", "$CSI_ENDPOINT",
                              "--work-dir", plugin_dir, "--volumes", "vol1:1M",
                              "--node-id", "node-1"]
            }
        }],
        "startup_timeout_ms": 20000
    });
    std::fs::write(configs.join("test.json"), config.to_string()).unwrap();
    let child = Command::new(binaries::required("csi-agentd", Some("CSI_AGENTD")))
        .arg("serve")
        .arg("--work-dir")
        .arg(&work)
        .arg("--plugin-config-dir")
        .arg(&configs)
        .arg("--socket-root")
        .arg(tmp.path().join("sockets"))
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(tmp.path().join("daemon.log")).unwrap())
        .spawn()
        .unwrap();
    let daemon = Daemon {
        child,
        socket: work.join("api.sock"),
    };
    let deadline = Instant::now() + Duration::from_secs(20);
    while !daemon.socket.exists() {
        assert!(
            Instant::now() < deadline,
            "the daemon never opened its socket"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    // A publish with secrets makes every per-volume entry: the record, the secrets file, the
    // staging and target mounts; the managed plugin makes its container dir.
    let published = daemon.curl(
        "POST",
        "/v1/volumes/publish",
        &json!({
            "plugin": "org.example.test", "volume_id": "vol1", "workload": "w1",
            "capability": {"mount": {}, "access_mode": "SINGLE_NODE_WRITER"},
            "secrets": {"node_stage": {"key": "value"}}
        }),
    );
    assert_eq!(published["state"], "PUBLISHED", "{published}");

    let mounts = MountTable::read().unwrap();
    let real = real_tree(&work, &mounts);
    let documented = documented_tree();
    // Drain before asserting: it unpublishes and stops the plugin, whatever the outcome.
    let drained = daemon.curl("POST", "/v1/drain", &json!({}));
    drop(daemon);

    let undocumented: Vec<String> = real
        .iter()
        .filter(|(path, _)| !documented.iter().any(|d| documents(d, path)))
        .map(|(path, is_dir)| format!("{}{}", path.join("/"), if *is_dir { "/" } else { "" }))
        .collect();
    assert!(
        undocumented.is_empty(),
        "entries of a real work dir missing from the tree of docs/on-disk-format.md: \
         {undocumented:?}; add a line for each, under its parent, saying what it holds"
    );
    // A documented entry not in this work dir must be one the engine names (a constant or a
    // literal in crates/csi-agent/src): images, the oci runtime, fetched URIs, migration.
    let engine = engine_sources();
    let unexplained: Vec<String> = documented
        .iter()
        .filter(|d| !real.iter().any(|(path, _)| documents(d, path)))
        .filter(|d| {
            let last = d.segments.last().map(String::as_str).unwrap_or("");
            let fixed = !(last.starts_with('<') && last.ends_with('>'));
            fixed && !engine.contains(&format!("\"{last}\""))
        })
        .map(DocEntry::display)
        .collect();
    assert!(
        unexplained.is_empty(),
        "lines of docs/on-disk-format.md's tree that neither a real work dir has nor \
         crates/csi-agent/src names: {unexplained:?}; remove them or fix the name"
    );
    assert_eq!(
        drained["complete"], true,
        "the drain left something: {drained}"
    );
}

/// All of crates/csi-agent/src, as one text.
fn engine_sources() -> String {
    let mut text = String::new();
    let mut dirs = vec![Path::new(env!("CARGO_MANIFEST_DIR")).join("src")];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                dirs.push(path);
            } else {
                text.push_str(&std::fs::read_to_string(&path).unwrap());
            }
        }
    }
    text
}
