//! The backend shared by the plugin instances of several nodes (`--backend-dir DIR`), as
//! networked storage is shared: what one node's instance creates, another lists and
//! publishes, and the backend — not any one CO — is the judge of who has a volume attached.
//!
//! Owns the files under DIR other than the volumes' data (`DIR/volumes/<id>`):
//! - `catalogue.json`: volume id → size, parameters, content source: which volumes exist;
//! - `attachments.json`: volume id → `{nodes, access_mode, staged, publications}`: the nodes
//!   it is controller-published to (with each publication's capability and readonly flag)
//!   and the nodes that have it staged;
//! - both read and written only under an exclusive `flock` of `attachments.lock`, by every
//!   instance, and replaced atomically (temp, fsync, rename) so a reader never sees half;
//! - `violations.jsonl`: one line per refused node-side attach (`{time, node, volume, rpc,
//!   attached_to}`): a CO that stages where the volume is not attached;
//! - `calls.jsonl`: one line per Controller/Node RPC (`{time_ms, node, rpc, volume,
//!   target_node, outcome}`; `target_node` is a Controller(Un)Publish's node id), each a single bounded `write(2)` on an `O_APPEND` file, so the lines of
//!   several processes never interleave.
//!
//! Must not: decide CSI semantics beyond who holds an attachment (`plugin.rs` does), touch
//! a volume's data, or keep anything of the shared state in memory between calls: each
//! instance reads it afresh under the lock, since others change it.

use std::collections::BTreeMap;
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::Context;
use serde::{Deserialize, Serialize};
use tonic::Status;

use crate::model::AccessMode;
use crate::state::{ContentSource, ControllerPublication};

/// The most a line of `calls.jsonl` or `violations.jsonl` may take; a longer one (ids are
/// bounded, so only a hand-made call could) is cut, keeping it one write.
const MAX_LINE: usize = 2048;

/// One volume in `catalogue.json`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CatalogueEntry {
    pub capacity_bytes: i64,
    #[serde(default)]
    pub parameters: BTreeMap<String, String>,
    #[serde(default)]
    pub content_source: Option<ContentSource>,
}

/// One volume in `attachments.json`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Attachment {
    /// The nodes it is controller-published to (the keys of `publications`, in order).
    #[serde(default)]
    pub nodes: Vec<String>,
    /// The access mode of its first publication; `None` when it is published nowhere.
    #[serde(default)]
    pub access_mode: Option<AccessMode>,
    /// The nodes that have it staged (NodeStage adds, NodeUnstage removes).
    #[serde(default)]
    pub staged: Vec<String>,
    /// Each node's publication, so that a repeat is answered as the first time.
    #[serde(default)]
    pub publications: BTreeMap<String, ControllerPublication>,
}

impl Attachment {
    /// Takes the publications as the plugin decided them; `nodes` and `access_mode` follow.
    pub fn set_publications(&mut self, publications: &BTreeMap<String, ControllerPublication>) {
        // A node the volume was detached from has it staged no more: its device is gone
        // (what a fence's ControllerUnpublish from another node's instance relies on).
        self.staged.retain(|node| publications.contains_key(node));
        self.publications = publications.clone();
        self.nodes = publications.keys().cloned().collect();
        self.access_mode = publications.values().next().map(|p| p.capability.mode);
    }

    fn is_empty(&self) -> bool {
        self.nodes.is_empty() && self.staged.is_empty() && self.publications.is_empty()
    }

    /// Whether at most one node may have the volume at a time.
    pub fn single_node(&self) -> bool {
        self.access_mode.is_some_and(|m| !m.is_multi_node())
    }
}

/// The shared state as read under the lock.
#[derive(Debug, Default)]
pub struct Shared {
    pub catalogue: BTreeMap<String, CatalogueEntry>,
    pub attachments: BTreeMap<String, Attachment>,
}

/// An instance's handle on the shared backend.
#[derive(Debug)]
pub struct Backend {
    dir: PathBuf,
    node: String,
    calls: File,
    violations: File,
}

fn open_append(path: &Path) -> anyhow::Result<File> {
    OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .with_context(|| format!("opening {} for appending", path.display()))
}

fn now_ms() -> u64 {
    crate::calllog::now_ns() / 1_000_000
}

fn io_status(what: &str, path: &Path, e: impl std::fmt::Display) -> Status {
    Status::internal(format!("shared backend: {what} {}: {e}", path.display()))
}

/// Reads one of the JSON maps; absent is empty, unreadable is an error naming the file.
fn read_map<T: serde::de::DeserializeOwned + Default>(path: &Path) -> Result<T, Status> {
    match std::fs::read(path) {
        Ok(bytes) => serde_json::from_slice(&bytes)
            .map_err(|e| io_status("cannot parse (fix or remove it)", path, e)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(T::default()),
        Err(e) => Err(io_status("reading", path, e)),
    }
}

/// Replaces `path` with `value`: temp file, fsync, rename.
fn write_map<T: Serialize>(path: &Path, value: &T) -> Result<(), Status> {
    let bytes = serde_json::to_vec_pretty(value).map_err(|e| io_status("encoding", path, e))?;
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp");
    let tmp = PathBuf::from(tmp);
    let written = File::create(&tmp)
        .and_then(|mut f| f.write_all(&bytes).and_then(|()| f.sync_all()))
        .and_then(|()| std::fs::rename(&tmp, path));
    written.map_err(|e| io_status("writing", path, e))
}

impl Backend {
    /// Opens (creating) the backend directory for node `node`.
    pub fn open(dir: &Path, node: &str) -> anyhow::Result<Self> {
        std::fs::create_dir_all(dir.join("volumes"))
            .with_context(|| format!("creating the backend directory {}", dir.display()))?;
        Ok(Self {
            dir: dir.to_owned(),
            node: node.to_owned(),
            calls: open_append(&dir.join("calls.jsonl"))?,
            violations: open_append(&dir.join("violations.jsonl"))?,
        })
    }

    /// Where the volumes' data lives: `DIR/volumes`.
    pub fn volumes_dir(&self) -> PathBuf {
        self.dir.join("volumes")
    }

    /// Where this backend's deleted volumes go before they are removed: `DIR/trash`.
    pub fn trash_dir(&self) -> PathBuf {
        self.dir.join("trash")
    }

    /// Runs `f` on the shared state under the exclusive lock; `f` returns its result and
    /// whether it changed anything, which is then written before the lock is released.
    /// Nothing is written when `f` fails. Blocks the thread while another instance holds
    /// the lock (each holds it for one read-decide-write).
    pub fn with_lock<R>(
        &self,
        f: impl FnOnce(&mut Shared) -> Result<(R, bool), Status>,
    ) -> Result<R, Status> {
        let lock_path = self.dir.join("attachments.lock");
        let lock = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&lock_path)
            .map_err(|e| io_status("opening", &lock_path, e))?;
        // Released when `lock` is closed, on every return below.
        rustix::fs::flock(&lock, rustix::fs::FlockOperation::LockExclusive)
            .map_err(|e| io_status("locking", &lock_path, e))?;
        let catalogue_path = self.dir.join("catalogue.json");
        let attachments_path = self.dir.join("attachments.json");
        let mut shared = Shared {
            catalogue: read_map(&catalogue_path)?,
            attachments: read_map(&attachments_path)?,
        };
        let (value, changed) = f(&mut shared)?;
        if changed {
            shared.attachments.retain(|_, a| !a.is_empty());
            write_map(&catalogue_path, &shared.catalogue)?;
            write_map(&attachments_path, &shared.attachments)?;
        }
        Ok(value)
    }

    /// Appends one line; failures are logged, never returned (an observation aid must not
    /// change an RPC's answer).
    fn append(file: &File, what: &str, value: &serde_json::Value) {
        let mut line = value.to_string();
        if line.len() >= MAX_LINE {
            line = serde_json::json!({"truncated": line.chars().take(MAX_LINE / 2).collect::<String>()})
                .to_string();
        }
        line.push('\n');
        // One write(2) on an O_APPEND file: whole lines, whichever process writes.
        if let Err(e) = (&*file).write_all(line.as_bytes()) {
            tracing::warn!("cannot append to the backend's {what}: {e}");
        }
    }

    /// Records a Controller/Node RPC answered by this node's instance.
    pub fn record_call(
        &self,
        rpc: &str,
        volume: Option<&str>,
        target_node: Option<&str>,
        outcome: &str,
    ) {
        let entry = serde_json::json!({
            "time_ms": now_ms(),
            "node": self.node,
            "rpc": rpc,
            "volume": volume,
            "target_node": target_node,
            "outcome": outcome,
        });
        Self::append(&self.calls, "calls.jsonl", &entry);
    }

    /// Records a refused node-side attach and returns the FAILED_PRECONDITION to answer.
    pub fn violation(&self, volume: &str, rpc: &str, attached_to: &[String], why: &str) -> Status {
        let entry = serde_json::json!({
            "time": now_ms(),
            "node": self.node,
            "volume": volume,
            "rpc": rpc,
            "attached_to": attached_to,
            "why": why,
        });
        Self::append(&self.violations, "violations.jsonl", &entry);
        tracing::error!(
            volume,
            rpc,
            ?attached_to,
            "attach violation by the CO: {why}"
        );
        Status::failed_precondition(format!("volume {volume:?}: {why}"))
    }

    /// The node-side check of NodeStage (`stage`: and the record of this node's staging)
    /// or of NodePublish without staging: the volume must be controller-published to this
    /// node, and a single-node volume staged on no other node. A refusal is a violation.
    pub fn check_attached(&self, volume: &str, rpc: &str, stage: bool) -> Result<(), Status> {
        let me = self.node.clone();
        self.with_lock(|shared| {
            let att = shared.attachments.entry(volume.to_owned()).or_default();
            if !att.nodes.contains(&me) {
                let why = match att.nodes.as_slice() {
                    [] => format!("it is controller-published to no node, not to {me:?}"),
                    nodes => format!(
                        "it is controller-published to node {nodes:?}, not to {me:?}; ControllerPublishVolume to {me:?} must succeed first"
                    ),
                };
                return Err(self.violation(volume, rpc, &att.nodes, &why));
            }
            if !stage {
                return Ok(((), false));
            }
            if att.single_node()
                && let Some(other) = att.staged.iter().find(|n| **n != me)
            {
                let why = format!(
                    "it is a single-node volume already staged on node {other:?}; NodeUnstageVolume there first"
                );
                let staged = att.staged.clone();
                return Err(self.violation(volume, rpc, &staged, &why));
            }
            if att.staged.contains(&me) {
                return Ok(((), false));
            }
            att.staged.push(me);
            Ok(((), true))
        })
    }

    /// Forgets this node's staging of `volume` (NodeUnstage, or a NodeStage that failed).
    pub fn unstaged(&self, volume: &str) -> Result<(), Status> {
        let me = &self.node;
        self.with_lock(|shared| {
            let Some(att) = shared.attachments.get_mut(volume) else {
                return Ok(((), false));
            };
            let before = att.staged.len();
            att.staged.retain(|n| n != me);
            Ok(((), att.staged.len() != before))
        })
    }
}
