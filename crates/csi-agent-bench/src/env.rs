//! The benchmark environment: where the binaries are, where temp dirs and JSON figures go,
//! and a description of the machine for the report.

use std::path::{Path, PathBuf};
use std::time::SystemTime;

use anyhow::{Context, bail};
use serde::Serialize;

use crate::CommonArgs;
use crate::procs::Scratch;

/// The plugin type every benchmark plugin config uses (with a suffix per variant).
pub const PLUGIN_TYPE: &str = "org.example.bench";
/// The node id given to the daemon and the plugins.
pub const NODE_ID: &str = "bench-node";

const BUILD_HINT: &str =
    "build them with `cargo build --release -p csi-agent-bench -p csi-testplugin -p csi-agentd`";

#[derive(Debug)]
pub struct Env {
    pub plugin_bin: PathBuf,
    pub daemon_bin: PathBuf,
    pub tmp_base: PathBuf,
    pub out_dir: PathBuf,
    /// `--daemon-arg`s, appended to every `csi-agentd serve`.
    pub daemon_args: Vec<String>,
}

impl Env {
    pub fn new(args: &CommonArgs) -> anyhow::Result<Self> {
        let exe = std::env::current_exe().context("cannot find this binary's path")?;
        let exe_dir = exe
            .parent()
            .map(Path::to_path_buf)
            .unwrap_or_else(|| PathBuf::from("."));
        let bin_dir = args.bin_dir.clone().unwrap_or_else(|| exe_dir.clone());
        let plugin_bin = bin_dir.join("csi-testplugin");
        let daemon_bin = bin_dir.join("csi-agentd");
        for bin in [&plugin_bin, &daemon_bin] {
            if !bin.is_file() {
                bail!("{} is missing: {BUILD_HINT}", bin.display());
            }
        }
        if !bin_dir.ends_with("release") {
            eprintln!(
                "warning: {} is not a release directory; figures of debug builds are meaningless ({BUILD_HINT})",
                bin_dir.display()
            );
        }
        let tmp_base = args.tmp_dir.clone().unwrap_or_else(std::env::temp_dir);
        let out_dir = args.out_dir.clone().unwrap_or_else(|| {
            exe_dir
                .parent()
                .map(|target| target.join("csi-agent-bench"))
                .unwrap_or_else(|| PathBuf::from("csi-agent-bench-results"))
        });
        Ok(Self {
            plugin_bin: std::path::absolute(plugin_bin)?,
            daemon_bin: std::path::absolute(daemon_bin)?,
            tmp_base,
            out_dir,
            daemon_args: args.daemon_args.clone(),
        })
    }

    /// A fresh temp dir; processes started under it are killed when it is dropped.
    pub fn scratch(&self, what: &str) -> anyhow::Result<Scratch> {
        Scratch::new(
            &self.tmp_base,
            what,
            vec![self.plugin_bin.clone(), self.daemon_bin.clone()],
        )
    }

    /// Writes `<out_dir>/<name>.json`.
    pub fn write_json<T: Serialize>(&self, name: &str, value: &T) -> anyhow::Result<PathBuf> {
        std::fs::create_dir_all(&self.out_dir)
            .with_context(|| format!("cannot create {}", self.out_dir.display()))?;
        let path = self.out_dir.join(format!("{name}.json"));
        let text = serde_json::to_string_pretty(value)?;
        std::fs::write(&path, text + "\n")
            .with_context(|| format!("cannot write {}", path.display()))?;
        eprintln!("figures written to {}", path.display());
        Ok(path)
    }
}

/// The machine a run happened on.
#[derive(Clone, Debug, Serialize)]
pub struct Machine {
    pub date_utc: String,
    pub kernel: String,
    pub cpus: usize,
    pub cpu_model: String,
    pub memory_gib: f64,
    /// File system type of the temp dir (where records and fsyncs go).
    pub tmp_fs: String,
    pub tmp_dir: String,
    pub private_mount_namespace: bool,
}

impl Machine {
    pub fn describe(tmp: &Path) -> Self {
        let uname = rustix::system::uname();
        let kernel = format!(
            "{} {}",
            uname.sysname().to_string_lossy(),
            uname.release().to_string_lossy()
        );
        let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
        let cpu_model = cpuinfo
            .lines()
            .find(|l| l.starts_with("model name"))
            .and_then(|l| l.split_once(':'))
            .map(|(_, v)| v.trim().to_owned())
            .unwrap_or_else(|| "unknown".to_owned());
        let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
        let memory_kib: f64 = meminfo
            .lines()
            .find(|l| l.starts_with("MemTotal:"))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse().ok())
            .unwrap_or(0.0);
        Self {
            date_utc: utc_now(),
            kernel,
            cpus: std::thread::available_parallelism().map_or(0, usize::from),
            cpu_model,
            memory_gib: (memory_kib / 1024.0 / 1024.0 * 10.0).round() / 10.0,
            tmp_fs: fs_type_of(tmp),
            // The base the run's temp dirs are created in (not the per-run dir itself).
            tmp_dir: tmp.parent().unwrap_or(tmp).display().to_string(),
            private_mount_namespace: in_private_mount_namespace(),
        }
    }
}

/// The type of the file system holding `path` (longest mount point prefix).
fn fs_type_of(path: &Path) -> String {
    let path = std::fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf());
    let Ok(table) = csi_agent::mounts::MountTable::read() else {
        return "unknown".to_owned();
    };
    table
        .mounts_under(Path::new("/"))
        .into_iter()
        .filter(|m| path.starts_with(&m.mount_point))
        .max_by_key(|m| m.mount_point.as_os_str().len())
        .map(|m| m.fs_type.clone())
        .unwrap_or_else(|| "unknown".to_owned())
}

/// True when this process has a mount namespace of its own: other than pid 1's, or, where
/// pid 1's cannot be read (a sandbox), other than its parent's (as under `unshare -m`).
/// Real bind mounts made by the bind-mode variant then stay private to the run.
pub fn in_private_mount_namespace() -> bool {
    let Ok(own) = std::fs::read_link("/proc/self/ns/mnt") else {
        return false;
    };
    let other = std::fs::read_link("/proc/1/ns/mnt").or_else(|_| {
        let parent = rustix::process::getppid().map_or(0, |p| p.as_raw_nonzero().get());
        std::fs::read_link(format!("/proc/{parent}/ns/mnt"))
    });
    other.is_ok_and(|other| other != own)
}

/// `YYYY-MM-DD HH:MM UTC`.
pub fn utc_now() -> String {
    let at = csi_agent_api::time::rfc3339_millis(SystemTime::now());
    format!("{} {} UTC", &at[..10], &at[11..16])
}
