//! Fault injection, driven by a JSON control file (`--faults`).
//!
//! Owns: parsing the control file, re-reading it whenever its identity
//! (device, inode, size, mtime) changes — checked at the start of every RPC,
//! which costs one `stat` — deciding which rules fire for a call, and the
//! per-rule firing counts, persisted in `<faults>.state` so that "fail the
//! next N calls" survives re-reads and plugin restarts. Also the Probe and
//! capability quirks (file settings OR'ed with the command-line flags).
//!
//! Must not: act on a decision (the RPC wrapper sleeps, fails or exits), or
//! drop the previous configuration because of a half-written file: a file that
//! does not parse is reported and the last good configuration stays in force.
//!
//! The format is documented in the crate README.

use std::collections::BTreeMap;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tonic::Status;

use crate::model::{ApiVersion, parse_code};

/// Every RPC name a rule may name (plus `*`).
pub const METHODS: &[&str] = &[
    "GetPluginInfo",
    "GetPluginCapabilities",
    "Probe",
    "CreateVolume",
    "DeleteVolume",
    "ControllerPublishVolume",
    "ControllerUnpublishVolume",
    "ValidateVolumeCapabilities",
    "ListVolumes",
    "GetCapacity",
    "ControllerGetCapabilities",
    "CreateSnapshot",
    "DeleteSnapshot",
    "ListSnapshots",
    "GetSnapshot",
    "ControllerExpandVolume",
    "ControllerGetVolume",
    "ControllerModifyVolume",
    "NodeStageVolume",
    "NodeUnstageVolume",
    "NodePublishVolume",
    "NodeUnpublishVolume",
    "NodeGetVolumeStats",
    "NodeExpandVolume",
    "NodeGetCapabilities",
    "NodeGetInfo",
    "NodeGetId",
];

/// Quirks of real, not entirely conformant plugins.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Quirks {
    /// Answer `ready=false` to the first N Probe calls since process start.
    pub probe_not_ready: u64,
    /// Answer Probe with an empty message (no `ready`).
    pub empty_probe: bool,
    /// Repeat every capability and add an `UNKNOWN` one, in the plugin,
    /// controller and node capability responses.
    pub duplicate_capabilities: bool,
    /// Report an empty `vendor_version`.
    pub empty_vendor_version: bool,
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct FaultFile {
    #[serde(default)]
    rules: Vec<Rule>,
    #[serde(default)]
    probe_not_ready: u64,
    #[serde(default)]
    empty_probe: bool,
    #[serde(default)]
    duplicate_capabilities: bool,
    #[serde(default)]
    empty_vendor_version: bool,
    #[serde(default)]
    plugin_name: Option<String>,
    #[serde(default)]
    vendor_version_bytes: Option<usize>,
    #[serde(default)]
    created_volume_id: Option<String>,
    #[serde(default)]
    list_duplicates: bool,
    /// Volumes whose condition is abnormal, with the message to report.
    #[serde(default)]
    abnormal: BTreeMap<String, String>,
}

/// Hostile answers (fault file only): what a broken or malicious plugin says.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Answers {
    /// GetPluginInfo answers this name instead of its own (`""`: an empty one).
    pub plugin_name: Option<String>,
    /// GetPluginInfo's `vendor_version` is this many bytes long (a huge message).
    pub vendor_version_bytes: Option<usize>,
    /// CreateVolume answers this volume id instead of the one it made.
    pub created_volume_id: Option<String>,
    /// ListVolumes lists every entry twice.
    pub list_duplicates: bool,
}

#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
struct Rule {
    /// An RPC name from [`METHODS`] or `*`.
    method: String,
    /// Restricts the rule to `v1`, `v0` (either 0.x flavour), `v0.3` or `v0.2`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    version: Option<String>,
    /// Names the rule's firing count in the state file; changing it re-arms
    /// the rule.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    fail: Option<Fail>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    delay_ms: Option<u64>,
    #[serde(default)]
    exit: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    exit_code: Option<i32>,
    /// Fire at most this many times (counted across re-reads and restarts);
    /// absent means every time.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    times: Option<u64>,
}

#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
struct Fail {
    code: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    message: Option<String>,
}

/// Why a rule of the fault file is refused (the whole file is then ignored).
#[derive(Debug, thiserror::Error)]
enum RuleError {
    #[error("unknown method {0:?}")]
    UnknownMethod(String),
    #[error("unknown version {0:?} (v1, v0, v0.3, v0.2)")]
    UnknownVersion(String),
    #[error("fail.code {0:?} is not a gRPC error code")]
    NotAnErrorCode(String),
    #[error("rule for {0:?} has none of fail, delay_ms, exit")]
    NoAction(String),
}

impl Rule {
    fn validate(&self) -> Result<(), RuleError> {
        if self.method != "*" && !METHODS.contains(&self.method.as_str()) {
            return Err(RuleError::UnknownMethod(self.method.clone()));
        }
        if let Some(v) = &self.version
            && !matches!(v.as_str(), "v1" | "v0" | "v0.3" | "v0.2")
        {
            return Err(RuleError::UnknownVersion(v.clone()));
        }
        if let Some(f) = &self.fail {
            match parse_code(&f.code) {
                Some(tonic::Code::Ok) | None => {
                    return Err(RuleError::NotAnErrorCode(f.code.clone()));
                }
                Some(_) => {}
            }
        }
        if !self.exit && self.fail.is_none() && self.delay_ms.is_none() {
            return Err(RuleError::NoAction(self.method.clone()));
        }
        Ok(())
    }

    fn matches(&self, method: &str, version: ApiVersion) -> bool {
        let method_ok = self.method == "*" || self.method == method;
        let version_ok = match self.version.as_deref() {
            None => true,
            Some("v0") => version.is_v0(),
            Some(v) => v == version.as_str(),
        };
        method_ok && version_ok
    }

    /// The key of this rule's firing count.
    fn key(&self, index: usize) -> String {
        match &self.id {
            Some(id) => format!("id:{id}"),
            None => format!(
                "{index}:{}",
                serde_json::to_string(self).unwrap_or_default()
            ),
        }
    }
}

/// File identity used to notice a changed control file cheaply.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Stamp {
    dev: u64,
    ino: u64,
    size: u64,
    mtime_ns: i128,
}

#[derive(Debug, Default, Serialize, Deserialize)]
struct Counts {
    #[serde(default)]
    fired: BTreeMap<String, u64>,
}

#[derive(Debug)]
struct Inner {
    /// `None` until first checked; `Some(None)` when the file is absent.
    stamp: Option<Option<Stamp>>,
    file: FaultFile,
    counts: Counts,
}

/// What the RPC wrapper must do for one call (besides possibly exiting).
#[derive(Debug, Default)]
pub struct Actions {
    pub delay: Duration,
    pub fail: Option<Status>,
}

/// The fault injector.
#[derive(Debug)]
pub struct Faults {
    path: PathBuf,
    counts_path: PathBuf,
    flags: Quirks,
    inner: Mutex<Inner>,
    probes: AtomicU64,
}

impl Faults {
    /// `flags` are the command-line quirks; the file's settings are OR'ed
    /// with them (for `probe_not_ready`, the larger count wins).
    pub fn new(path: &Path, flags: Quirks) -> Self {
        let mut counts_path = path.as_os_str().to_owned();
        counts_path.push(".state");
        let counts_path = PathBuf::from(counts_path);
        let counts = match std::fs::read(&counts_path) {
            Ok(b) => serde_json::from_slice(&b).unwrap_or_else(|e| {
                tracing::warn!(path = %counts_path.display(), "ignoring unreadable fault counts: {e}");
                Counts::default()
            }),
            Err(_) => Counts::default(),
        };
        let faults = Self {
            path: path.to_owned(),
            counts_path,
            flags,
            inner: Mutex::new(Inner {
                stamp: None,
                file: FaultFile::default(),
                counts,
            }),
            probes: AtomicU64::new(0),
        };
        faults.refresh(&mut faults.lock());
        faults
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Re-reads the control file if it changed since the last look.
    fn refresh(&self, inner: &mut Inner) {
        let stamp = std::fs::metadata(&self.path).ok().map(|m| Stamp {
            dev: m.dev(),
            ino: m.ino(),
            size: m.size(),
            mtime_ns: i128::from(m.mtime()) * 1_000_000_000 + i128::from(m.mtime_nsec()),
        });
        if inner.stamp == Some(stamp) {
            return;
        }
        inner.stamp = Some(stamp);
        if stamp.is_none() {
            if !inner.file.rules.is_empty() {
                tracing::info!(path = %self.path.display(), "fault file removed; no faults");
            }
            inner.file = FaultFile::default();
            return;
        }
        let parsed = std::fs::read(&self.path)
            .map_err(|e| e.to_string())
            .and_then(|b| serde_json::from_slice::<FaultFile>(&b).map_err(|e| e.to_string()))
            .and_then(|f| {
                f.rules
                    .iter()
                    .try_for_each(Rule::validate)
                    .map_err(|e| e.to_string())?;
                Ok(f)
            });
        match parsed {
            Ok(f) => {
                tracing::info!(path = %self.path.display(), rules = f.rules.len(), "fault file loaded");
                inner.file = f;
            }
            Err(e) => tracing::error!(
                path = %self.path.display(),
                "fault file rejected, keeping the previous faults: {e}"
            ),
        }
    }

    /// Whether rule `index` fires now; consumes one of its `times`.
    fn fire(&self, inner: &mut Inner, index: usize) -> bool {
        let rule = &inner.file.rules[index];
        let Some(times) = rule.times else {
            return true;
        };
        let key = rule.key(index);
        let used = inner.counts.fired.get(&key).copied().unwrap_or(0);
        if used >= times {
            return false;
        }
        inner.counts.fired.insert(key, used + 1);
        // Persist before acting, so that an injected exit is not repeated
        // after the restart it causes.
        match serde_json::to_vec_pretty(&inner.counts) {
            Ok(bytes) => {
                let mut tmp = self.counts_path.as_os_str().to_owned();
                tmp.push(".tmp");
                if let Err(e) =
                    crate::state::write_atomic(&self.counts_path, Path::new(&tmp), &bytes)
                {
                    tracing::warn!("cannot persist fault counts: {e:#}");
                }
            }
            Err(e) => tracing::warn!("cannot encode fault counts: {e}"),
        }
        true
    }

    /// Called first for every RPC: re-reads the file if needed and returns
    /// the exit code if an `exit` rule fires for this call.
    pub fn take_exit(&self, method: &str, version: ApiVersion) -> Option<i32> {
        let mut inner = self.lock();
        self.refresh(&mut inner);
        for i in 0..inner.file.rules.len() {
            let rule = &inner.file.rules[i];
            if rule.exit && rule.matches(method, version) {
                let code = rule.exit_code.unwrap_or(1);
                if self.fire(&mut inner, i) {
                    return Some(code);
                }
            }
        }
        None
    }

    /// The delays and failure for this call. Rules fire in file order: their
    /// delays add up, and the first firing `fail` ends the evaluation (later
    /// rules are not consumed). `exit` rules are handled by
    /// [`Faults::take_exit`] only.
    pub fn take_actions(&self, method: &str, version: ApiVersion) -> Actions {
        let mut inner = self.lock();
        let mut actions = Actions::default();
        for i in 0..inner.file.rules.len() {
            let rule = &inner.file.rules[i];
            if rule.exit || !rule.matches(method, version) {
                continue;
            }
            let (delay, fail) = (rule.delay_ms, rule.fail.clone());
            if !self.fire(&mut inner, i) {
                continue;
            }
            if let Some(ms) = delay {
                actions.delay += Duration::from_millis(ms);
            }
            if let Some(f) = fail {
                let code = parse_code(&f.code).unwrap_or(tonic::Code::Internal);
                let msg = f
                    .message
                    .unwrap_or_else(|| format!("injected fault for {method}"));
                actions.fail = Some(Status::new(code, msg));
                break;
            }
        }
        actions
    }

    /// The quirks in force (file OR flags).
    pub fn quirks(&self) -> Quirks {
        let inner = self.lock();
        let f = &inner.file;
        Quirks {
            probe_not_ready: self.flags.probe_not_ready.max(f.probe_not_ready),
            empty_probe: self.flags.empty_probe || f.empty_probe,
            duplicate_capabilities: self.flags.duplicate_capabilities || f.duplicate_capabilities,
            empty_vendor_version: self.flags.empty_vendor_version || f.empty_vendor_version,
        }
    }

    /// The hostile answers of the fault file (re-read at the start of every RPC).
    pub fn answers(&self) -> Answers {
        let inner = self.lock();
        let f = &inner.file;
        Answers {
            plugin_name: f.plugin_name.clone(),
            vendor_version_bytes: f.vendor_version_bytes,
            created_volume_id: f.created_volume_id.clone(),
            list_duplicates: f.list_duplicates,
        }
    }

    /// The injected abnormal condition of `volume_id` (the fault file's
    /// `abnormal` map), for any RPC that reports a volume condition.
    pub fn abnormal(&self, volume_id: &str) -> Option<String> {
        self.lock().file.abnormal.get(volume_id).cloned()
    }

    /// Counts a Probe and tells whether it is among the first
    /// `probe_not_ready` since process start.
    pub fn probe_not_ready_now(&self) -> bool {
        let n = self.probes.fetch_add(1, Ordering::SeqCst);
        n < self.quirks().probe_not_ready
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(path: &Path, json: &str) -> anyhow::Result<()> {
        // A different size or mtime is what triggers a re-read; tests write
        // different content each time so that the size changes too.
        std::fs::write(path, json)?;
        Ok(())
    }

    #[test]
    fn fail_times_survives_reload_and_restart() -> anyhow::Result<()> {
        let dir = tempfile::tempdir()?;
        let path = dir.path().join("faults.json");
        write(
            &path,
            r#"{"rules":[{"method":"NodeStageVolume","fail":{"code":"UNAVAILABLE"},"times":2}]}"#,
        )?;
        let f = Faults::new(&path, Quirks::default());
        let a = f.take_actions("NodeStageVolume", ApiVersion::V1);
        assert_eq!(a.fail.map(|s| s.code()), Some(tonic::Code::Unavailable));
        assert!(
            f.take_actions("NodePublishVolume", ApiVersion::V1)
                .fail
                .is_none()
        );
        // A restart (a new injector on the same files) keeps the count.
        let f = Faults::new(&path, Quirks::default());
        assert!(
            f.take_actions("NodeStageVolume", ApiVersion::V1)
                .fail
                .is_some()
        );
        assert!(
            f.take_actions("NodeStageVolume", ApiVersion::V1)
                .fail
                .is_none()
        );
        Ok(())
    }

    #[test]
    fn bad_file_keeps_previous() -> anyhow::Result<()> {
        let dir = tempfile::tempdir()?;
        let path = dir.path().join("faults.json");
        write(&path, r#"{"rules":[{"method":"*","delay_ms":5}]}"#)?;
        let f = Faults::new(&path, Quirks::default());
        assert_eq!(
            f.take_actions("Probe", ApiVersion::V1).delay,
            Duration::from_millis(5)
        );
        write(&path, r#"{"rules":[{"method":"NoSuchRpc","delay_ms":5}]} "#)?;
        let _ = f.take_exit("Probe", ApiVersion::V1);
        assert_eq!(
            f.take_actions("Probe", ApiVersion::V1).delay,
            Duration::from_millis(5)
        );
        std::fs::remove_file(&path)?;
        let _ = f.take_exit("Probe", ApiVersion::V1);
        assert_eq!(
            f.take_actions("Probe", ApiVersion::V1).delay,
            Duration::ZERO
        );
        Ok(())
    }

    #[test]
    fn version_filter() -> anyhow::Result<()> {
        let dir = tempfile::tempdir()?;
        let path = dir.path().join("faults.json");
        write(
            &path,
            r#"{"rules":[{"method":"Probe","version":"v0","fail":{"code":"INTERNAL"}}]}"#,
        )?;
        let f = Faults::new(&path, Quirks::default());
        assert!(f.take_actions("Probe", ApiVersion::V1).fail.is_none());
        assert!(f.take_actions("Probe", ApiVersion::V0_2).fail.is_some());
        Ok(())
    }
}
