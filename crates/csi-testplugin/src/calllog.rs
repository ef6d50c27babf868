//! The call log: one JSON line per RPC, appended to `--call-log`.
//!
//! Owns: the line format and writing each line with a single `write(2)` on an
//! `O_APPEND` file, so that a test reading the file while the plugin runs
//! sees whole lines, in completion order, without waiting for a flush.
//!
//! Must not: decide anything about the call (the RPC wrapper in `rpc.rs`
//! fills the entry), or write secrets unless `--record-secrets` was given.

use std::collections::BTreeMap;
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::Path;
use std::sync::Mutex;
use std::time::{SystemTime, UNIX_EPOCH};

use anyhow::Context;
use serde::Serialize;

/// Nanoseconds since the Unix epoch (wall clock, so that tests can compare
/// entries of several plugin processes).
pub fn now_ns() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
        .unwrap_or(0)
}

/// One line of the call log.
#[derive(Debug, Serialize)]
pub struct Entry {
    /// The RPC name as in the proto (`NodePublishVolume`).
    pub method: &'static str,
    /// `v1`, `v0.3` or `v0.2`.
    pub version: &'static str,
    /// The volume the call is about (`name` for CreateVolume), if any.
    pub volume_id: Option<String>,
    pub start_ns: u64,
    pub end_ns: u64,
    /// gRPC code name (`OK`, `ABORTED`, ...) or `EXIT` for an injected exit.
    pub code: &'static str,
    /// Another RPC for the same volume was in flight when this one started.
    pub overlap: bool,
    /// The status message of a failed call.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    /// The request's secrets; present only with `--record-secrets`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub secrets: Option<BTreeMap<String, String>>,
    /// The request's topology: CreateVolume's `accessibility_requirements`
    /// (`{"requisite": [...], "preferred": [...]}`) or GetCapacity's
    /// `accessible_topology` (`{"accessible_topology": {...}}`), when given.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub topology: Option<serde_json::Value>,
}

/// The open call log.
#[derive(Debug)]
pub struct CallLog {
    file: Mutex<File>,
}

impl CallLog {
    pub fn open(path: &Path) -> anyhow::Result<Self> {
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent)
                .with_context(|| format!("creating {}", parent.display()))?;
        }
        let file = OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .with_context(|| format!("opening call log {}", path.display()))?;
        Ok(Self {
            file: Mutex::new(file),
        })
    }

    /// Appends one line. Failures are logged, never returned: the call log
    /// is an observation aid and must not change the answer of an RPC.
    pub fn write(&self, entry: &Entry) {
        let mut line = match serde_json::to_vec(entry) {
            Ok(l) => l,
            Err(e) => {
                tracing::warn!("cannot encode call log entry: {e}");
                return;
            }
        };
        line.push(b'\n');
        let mut f = self.file.lock().unwrap_or_else(|p| p.into_inner());
        if let Err(e) = f.write_all(&line) {
            tracing::warn!("cannot write call log: {e}");
        }
    }
}
