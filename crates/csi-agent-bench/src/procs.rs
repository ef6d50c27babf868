//! Processes and temp dirs of a run, and their guaranteed cleanup.
//!
//! [`ChildGuard`] kills (SIGKILL) and reaps a child it owns when dropped. [`Scratch`] is the
//! temp dir of one benchmark; when dropped it also kills the processes started *indirectly*
//! under it (plugins launched by the daemon, which outlive the daemon by design): a process
//! is ours when its executable is one of our binaries and its command line names the
//! scratch dir, which is unique to this run. Leftover mounts under the dir (bind-mode runs)
//! are detached before the dir is removed; nothing is ever removed across a mount.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use rustix::process::{Pid, Signal, kill_process};

/// When set, temp dirs are kept (after their processes are killed) for inspection: the
/// daemon's and plugins' logs are in them.
pub const KEEP_VAR: &str = "CSI_BENCH_KEEP";

/// A child process, killed and reaped on drop.
#[derive(Debug)]
pub struct ChildGuard {
    name: String,
    child: Option<Child>,
}

impl ChildGuard {
    pub fn spawn(name: &str, command: &mut Command) -> anyhow::Result<Self> {
        let child = command
            .spawn()
            .with_context(|| format!("cannot start {name} ({command:?})"))?;
        Ok(Self {
            name: name.to_owned(),
            child: Some(child),
        })
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().map_or(0, Child::id)
    }

    /// An error if the process has exited.
    pub fn check_running(&mut self) -> anyhow::Result<()> {
        if let Some(child) = self.child.as_mut()
            && let Some(status) = child.try_wait()?
        {
            bail!("{} exited early: {status}", self.name);
        }
        Ok(())
    }

    /// SIGTERM, then SIGKILL after `grace`; returns how long the exit took.
    pub async fn terminate(&mut self, grace: Duration) -> anyhow::Result<(Duration, ExitStatus)> {
        let Some(mut child) = self.child.take() else {
            bail!("{} is not running", self.name);
        };
        let started = Instant::now();
        signal(child.id(), Signal::TERM);
        loop {
            if let Some(status) = child.try_wait()? {
                return Ok((started.elapsed(), status));
            }
            if started.elapsed() > grace {
                let _ = child.kill();
                let status = child.wait()?;
                bail!(
                    "{} did not exit within {} ms of SIGTERM; killed ({status})",
                    self.name,
                    grace.as_millis()
                );
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }
}

impl Drop for ChildGuard {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// Sends `sig` to one process (errors ignored: it may be gone already).
pub fn signal(pid: u32, sig: Signal) {
    if let Some(pid) = i32::try_from(pid).ok().and_then(Pid::from_raw) {
        let _ = kill_process(pid, sig);
    }
}

/// The temp dir of one benchmark, and everything started under it.
#[derive(Debug)]
pub struct Scratch {
    dir: Option<tempfile::TempDir>,
    path: PathBuf,
    binaries: Vec<PathBuf>,
}

impl Scratch {
    pub fn new(base: &Path, what: &str, binaries: Vec<PathBuf>) -> anyhow::Result<Self> {
        std::fs::create_dir_all(base)
            .with_context(|| format!("cannot create {}", base.display()))?;
        let dir = tempfile::Builder::new()
            .prefix(&format!("csi-bench-{what}."))
            .tempdir_in(base)
            .with_context(|| format!("cannot create a temp dir in {}", base.display()))?;
        let path = std::fs::canonicalize(dir.path())?;
        let binaries = binaries
            .iter()
            .map(|b| std::fs::canonicalize(b).unwrap_or_else(|_| b.clone()))
            .collect();
        Ok(Self {
            dir: Some(dir),
            path,
            binaries,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn join(&self, rel: &str) -> PathBuf {
        self.path.join(rel)
    }

    /// Kills every process of ours still running under this dir (see the module doc) and
    /// waits until they are gone.
    pub fn kill_strays(&self) {
        let strays = self.strays();
        for &pid in &strays {
            signal(pid, Signal::KILL);
        }
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline && strays.iter().any(|&pid| alive(pid)) {
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    fn strays(&self) -> Vec<u32> {
        let me = std::process::id();
        let needle = self.path.as_os_str().as_encoded_bytes();
        let Ok(entries) = std::fs::read_dir("/proc") else {
            return Vec::new();
        };
        let mut found = Vec::new();
        for entry in entries.flatten() {
            let Some(pid) = entry
                .file_name()
                .to_str()
                .and_then(|s| s.parse::<u32>().ok())
            else {
                continue;
            };
            if pid == me {
                continue;
            }
            let proc_dir = entry.path();
            let Ok(exe) = std::fs::read_link(proc_dir.join("exe")) else {
                continue;
            };
            if !self.binaries.contains(&exe) {
                continue;
            }
            let Ok(cmdline) = std::fs::read(proc_dir.join("cmdline")) else {
                continue;
            };
            if cmdline.windows(needle.len()).any(|w| w == needle) {
                found.push(pid);
            }
        }
        found
    }
}

/// True while `pid` exists and is not a zombie.
fn alive(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().next())
            .is_some_and(|state| state != "Z" && state != "X"),
        Err(_) => false,
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let Some(dir) = self.dir.take() else {
            return;
        };
        self.kill_strays();
        if std::env::var_os(KEEP_VAR).is_some() {
            eprintln!(
                "{KEEP_VAR} is set: keeping {} (logs, state)",
                self.path.display()
            );
            let _ = dir.keep();
            return;
        }
        // Detach leftover mounts (a bind-mode run that failed half-way), deepest first.
        let mut left = Vec::new();
        if let Ok(table) = csi_agent::mounts::MountTable::read() {
            let mut points: Vec<PathBuf> = table
                .mounts_under(&self.path)
                .into_iter()
                .map(|m| m.mount_point.clone())
                .collect();
            points.reverse();
            for point in points {
                if rustix::mount::unmount(&point, rustix::mount::UnmountFlags::DETACH).is_err() {
                    left.push(point);
                }
            }
        }
        if left.is_empty() {
            drop(dir);
        } else {
            eprintln!(
                "warning: {} still holds mounts ({left:?}); left in place",
                self.path.display()
            );
            let _ = dir.keep();
        }
    }
}

/// Resident memory of a process, from `/proc/<pid>/status`.
#[derive(Clone, Copy, Debug, serde::Serialize)]
pub struct Memory {
    pub rss_kib: u64,
    /// Peak resident memory so far (`VmHWM`).
    pub hwm_kib: u64,
}

impl Memory {
    pub fn rss_mib(&self) -> f64 {
        self.rss_kib as f64 / 1024.0
    }

    pub fn hwm_mib(&self) -> f64 {
        self.hwm_kib as f64 / 1024.0
    }
}

pub fn memory(pid: u32) -> anyhow::Result<Memory> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))
        .with_context(|| format!("cannot read /proc/{pid}/status"))?;
    let field = |name: &str| -> anyhow::Result<u64> {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.split_whitespace().next())
            .and_then(|v| v.parse().ok())
            .with_context(|| format!("no {name} in /proc/{pid}/status"))
    };
    Ok(Memory {
        rss_kib: field("VmRSS:")?,
        hwm_kib: field("VmHWM:")?,
    })
}
