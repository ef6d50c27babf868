//! The judge of double attach: reads the shared backend of `csi-testplugin --backend-dir DIR`
//! — the storage's own record of which node has which volume — so that a multi-node test
//! judges by what the storage saw, never by csi-agent's own word.
//!
//! Owns: reading `DIR/attachments.json` (volume → `{nodes, access_mode, staged, ...}`),
//! `DIR/violations.jsonl` (the node-side attaches the plugin refused) and `DIR/calls.jsonl`
//! (every Controller/Node RPC with the node that served it), in the format the plugin's README
//! documents, and the one verdict [`BackendJudge::assert_no_double_attach`]. Must not: write
//! to the backend (tests that plant a state write the files themselves), or know the daemon.
//!
//! A test helper: a file it cannot read or parse is a panic naming the file.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde_json::Value;

/// One line of `DIR/calls.jsonl`: an RPC the plugin instance on `node` answered.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Call {
    /// Milliseconds since the Unix epoch when it was answered.
    pub time_ms: u64,
    pub node: String,
    /// The RPC name as in the proto (`ControllerPublishVolume`).
    pub rpc: String,
    /// The volume it was about, if any.
    pub volume: Option<String>,
    /// The node a Controller(Un)Publish was about (its node id), whichever instance sent it.
    pub target_node: Option<String>,
    /// The gRPC code name of the answer (`OK`, `FAILED_PRECONDITION`, ...).
    pub outcome: String,
}

/// Reads the backend under `dir`.
#[derive(Clone, Debug)]
pub struct BackendJudge {
    dir: PathBuf,
}

fn strings(value: &Value) -> Vec<String> {
    value
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|v| v.as_str().map(str::to_owned))
                .collect()
        })
        .unwrap_or_default()
}

impl BackendJudge {
    pub fn new(dir: &Path) -> Self {
        Self {
            dir: dir.to_owned(),
        }
    }

    /// `attachments.json` as written by the plugin; absent is empty.
    fn attachment_map(&self) -> BTreeMap<String, Value> {
        let path = self.dir.join("attachments.json");
        match std::fs::read(&path) {
            Ok(bytes) => serde_json::from_slice(&bytes).unwrap_or_else(|e| {
                panic!("{} is not the plugin's attachments: {e}", path.display())
            }),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => BTreeMap::new(),
            Err(e) => panic!("reading {}: {e}", path.display()),
        }
    }

    /// The lines of one of the backend's JSON-lines files; absent is none.
    fn lines(&self, name: &str) -> Vec<Value> {
        let path = self.dir.join(name);
        let text = match std::fs::read_to_string(&path) {
            Ok(text) => text,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Vec::new(),
            Err(e) => panic!("reading {}: {e}", path.display()),
        };
        text.lines()
            .filter(|l| !l.trim().is_empty())
            .map(|l| {
                serde_json::from_str(l)
                    .unwrap_or_else(|e| panic!("{}: line {l:?}: {e}", path.display()))
            })
            .collect()
    }

    /// One field (`nodes` or `staged`) of every volume that has any.
    fn per_volume(&self, field: &str) -> BTreeMap<String, Vec<String>> {
        self.attachment_map()
            .into_iter()
            .map(|(volume, a)| (volume, strings(&a[field])))
            .filter(|(_, nodes)| !nodes.is_empty())
            .collect()
    }

    /// Volume → the nodes it is controller-published to.
    pub fn attachments(&self) -> BTreeMap<String, Vec<String>> {
        self.per_volume("nodes")
    }

    /// Volume → the nodes that have it staged.
    pub fn staged(&self) -> BTreeMap<String, Vec<String>> {
        self.per_volume("staged")
    }

    /// The node-side attaches the plugin refused (`{time, node, volume, rpc, attached_to}`).
    pub fn violations(&self) -> Vec<Value> {
        self.lines("violations.jsonl")
    }

    /// Every Controller/Node RPC any instance answered, in the order they were answered.
    pub fn calls(&self) -> Vec<Call> {
        self.lines("calls.jsonl")
            .iter()
            .map(|c| Call {
                time_ms: c["time_ms"].as_u64().unwrap_or_default(),
                node: c["node"].as_str().unwrap_or_default().to_owned(),
                rpc: c["rpc"].as_str().unwrap_or_default().to_owned(),
                volume: c["volume"].as_str().map(str::to_owned),
                target_node: c["target_node"].as_str().map(str::to_owned),
                outcome: c["outcome"].as_str().unwrap_or_default().to_owned(),
            })
            .collect()
    }

    /// The RPCs about `node`: a Controller(Un)Publish to or from it (whichever node's
    /// instance answered it: in cluster mode the plugin's controller leader sends them), and
    /// every other RPC its own instance answered.
    pub fn calls_for_node(&self, node: &str) -> Vec<Call> {
        self.calls()
            .into_iter()
            .filter(|c| match &c.target_node {
                Some(target) => target == node,
                None => c.node == node,
            })
            .collect()
    }

    /// Panics, naming the volume and the nodes, if any single-node volume is published to
    /// or staged on two nodes, or if the plugin refused any node-side attach (a CO that
    /// staged where the volume was not attached).
    pub fn assert_no_double_attach(&self) {
        let mut found = Vec::new();
        for (volume, a) in self.attachment_map() {
            let mode = a["access_mode"].as_str().unwrap_or_default();
            if !mode.starts_with("SINGLE_NODE") {
                continue;
            }
            for field in ["nodes", "staged"] {
                let nodes = strings(&a[field]);
                if nodes.len() > 1 {
                    let what = if field == "nodes" {
                        "published to"
                    } else {
                        "staged on"
                    };
                    found.push(format!("{mode} volume {volume:?} {what} nodes {nodes:?}"));
                }
            }
        }
        for v in self.violations() {
            found.push(format!(
                "{} of volume {} on node {} while attached to {}",
                v["rpc"], v["volume"], v["node"], v["attached_to"]
            ));
        }
        assert!(
            found.is_empty(),
            "double attach in the backend {}:\n  {}",
            self.dir.display(),
            found.join("\n  ")
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn verdict(judge: &BackendJudge) -> Result<(), String> {
        let judge = judge.clone();
        std::panic::catch_unwind(move || judge.assert_no_double_attach()).map_err(|p| {
            p.downcast_ref::<String>()
                .cloned()
                .unwrap_or_else(|| "a panic without a message".to_owned())
        })
    }

    #[test]
    fn a_planted_double_attach_is_reported_by_volume_and_nodes() {
        let dir = tempfile::tempdir().unwrap();
        let judge = BackendJudge::new(dir.path());
        // Nothing yet: no verdict against an empty backend.
        assert!(judge.attachments().is_empty());
        assert!(judge.calls().is_empty());
        verdict(&judge).unwrap();

        // Legitimate sharing: a multi-node reader volume on two nodes, a single-node one on one.
        let ok = r#"{
          "shared": {"nodes": ["n1", "n2"], "access_mode": "MULTI_NODE_READER_ONLY", "staged": ["n1", "n2"]},
          "solo": {"nodes": ["n1"], "access_mode": "SINGLE_NODE_WRITER", "staged": ["n1"]}
        }"#;
        std::fs::write(dir.path().join("attachments.json"), ok).unwrap();
        verdict(&judge).unwrap();
        assert_eq!(judge.attachments()["shared"], ["n1", "n2"]);
        assert_eq!(judge.staged()["solo"], ["n1"]);

        // Planted: the single-node volume attached to a second node.
        let planted = r#"{
          "shared": {"nodes": ["n1", "n2"], "access_mode": "MULTI_NODE_READER_ONLY", "staged": []},
          "solo": {"nodes": ["n1", "n3"], "access_mode": "SINGLE_NODE_WRITER", "staged": ["n1"]}
        }"#;
        std::fs::write(dir.path().join("attachments.json"), planted).unwrap();
        let msg = verdict(&judge).unwrap_err();
        assert!(
            msg.contains("\"solo\"") && msg.contains("n3") && msg.contains("n1"),
            "{msg}"
        );
        assert!(!msg.contains("shared"), "{msg}");

        // Staged on two nodes is a double attach too.
        let staged_twice = r#"{"solo": {"nodes": ["n1"], "access_mode": "SINGLE_NODE_READER_ONLY", "staged": ["n1", "n2"]}}"#;
        std::fs::write(dir.path().join("attachments.json"), staged_twice).unwrap();
        let msg = verdict(&judge).unwrap_err();
        assert!(msg.contains("staged on") && msg.contains("n2"), "{msg}");
    }

    #[test]
    fn a_refused_attach_is_a_violation_and_calls_are_by_node() {
        let dir = tempfile::tempdir().unwrap();
        let judge = BackendJudge::new(dir.path());
        let calls = concat!(
            r#"{"time_ms":1,"node":"n1","rpc":"ControllerPublishVolume","volume":"v","outcome":"OK"}"#,
            "\n",
            r#"{"time_ms":2,"node":"n2","rpc":"NodeGetInfo","volume":null,"outcome":"OK"}"#,
            "\n",
            r#"{"time_ms":3,"node":"n2","rpc":"NodeStageVolume","volume":"v","outcome":"FAILED_PRECONDITION"}"#,
            "\n"
        );
        std::fs::write(dir.path().join("calls.jsonl"), calls).unwrap();
        let n2 = judge.calls_for_node("n2");
        assert_eq!(n2.len(), 2);
        assert_eq!(n2[0].volume, None);
        assert_eq!(n2[1].rpc, "NodeStageVolume");
        assert_eq!(n2[1].outcome, "FAILED_PRECONDITION");
        assert_eq!(judge.calls_for_node("n1")[0].time_ms, 1);
        assert!(judge.calls_for_node("n3").is_empty());
        verdict(&judge).unwrap();

        let violation = r#"{"time":3,"node":"n2","volume":"v","rpc":"NodeStageVolume","attached_to":["n1"],"why":"..."}"#;
        std::fs::write(
            dir.path().join("violations.jsonl"),
            format!("{violation}\n"),
        )
        .unwrap();
        assert_eq!(judge.violations().len(), 1);
        let msg = verdict(&judge).unwrap_err();
        assert!(
            msg.contains("NodeStageVolume") && msg.contains("\"n2\"") && msg.contains("n1"),
            "{msg}"
        );
    }
}
