//! Test support: real container engines — Debian's `dockerd` 20.10 ([`Dockerd`]) and `podman`
//! 4.3 ([`Podman`]) — run on a test's own dir, for the tests of the volume plugin front door
//! (issue 27), and the one image both run ([`busybox_image_tar`], imported as [`IMAGE`]).
//!
//! Owns: the engines' processes it starts and everything they start (containerd, shims,
//! conmon, containers), found by pid through their arguments naming the test's dir and their
//! descendants, never by name; the mounts under the test's dir; and, once per test process,
//! private tmpfs copies of the engines' fixed host paths ([`private_engine_paths`]: Docker
//! finds plugin specs only in `/etc/docker/plugins`, and dockerd, containerd's shims, podman
//! and its runc write under `/run`, podman under `/var/lib/containers/cache`, whatever their
//! flags say). Must not: touch the host (tests run as root under `unshare -m --propagation
//! private`, checked before anything starts; a missing mount point of those paths is the one
//! trace, an empty dir), use a system engine or containerd, or rely on `PATH` (CI runs tests
//! with a user's `PATH` lacking `/usr/sbin`; `/usr/local/bin/docker` may be a newer client than
//! Debian's daemon): every binary by its absolute path.

pub mod docker;
pub mod podman;

pub use docker::Dockerd;
pub use podman::Podman;

use std::collections::BTreeSet;
use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use csi_agent::mounts::MountTable;

use crate::{detach_mounts_under, kill9_pid, pid_alive, pids_using_dir};

/// The image [`busybox_image_tar`] makes, as both engines import it.
pub const IMAGE: &str = "csi-test/busybox:1";
/// busybox-static's binary (Debian's path; scripts/test installs the package).
pub const BUSYBOX: &str = "/bin/busybox";
/// The applets the image links to busybox.
const APPLETS: &[&str] = &[
    "sh",
    "cat",
    "echo",
    "sleep",
    "ls",
    "test",
    "mountpoint",
    "mkdir",
    "rm",
    "touch",
    "stat",
    "df",
    "grep",
    "mount",
    "true",
    "false",
];

/// Host paths the engines write to or read from whatever their flags say, each given a private
/// tmpfs in the test's namespace: `/etc/docker` (dockerd's `key.json`; the plugin specs Docker
/// discovers), `/run/docker` (Docker's plugin socket dir, created by every dockerd),
/// `/run/containerd` (the shims' sockets, `/run/containerd/s`), `/run/containers` and
/// `/run/runc` (podman's network run dir and its runc's state), `/var/lib/containers/cache`
/// (podman's image blob-info cache, written by `podman import` whatever `--root` says).
const ENGINE_HOST_PATHS: &[&str] = &[
    "/etc/docker",
    "/run/docker",
    "/run/containerd",
    "/run/containers",
    "/run/runc",
    "/var/lib/containers/cache",
];

/// Gives each of the engines' fixed host paths a private, empty tmpfs in this test process's
/// mount namespace, once per process: nothing an engine writes there reaches the host, a
/// system dockerd's or containerd's files are not seen, and a spec file written to
/// `/etc/docker/plugins` is visible only to this process's engines. A missing mount point is
/// created first (an empty dir: the only trace on the host).
///
/// # Panics
/// When not root in a private mount namespace, or a mount fails.
pub fn private_engine_paths() {
    crate::require_private_mount_namespace();
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        for path in ENGINE_HOST_PATHS {
            std::fs::create_dir_all(path).unwrap_or_else(|err| panic!("mkdir {path}: {err}"));
            csi_agent::mounts::mount_test_tmpfs(Path::new(path));
        }
        std::fs::create_dir_all(docker::PLUGIN_SPEC_DIR).unwrap();
    });
}

/// Writes a rootfs tar under `dir` (`busybox.tar`): `/bin/busybox` from busybox-static and
/// links for [`APPLETS`], plus the empty dirs a container needs. Both engines import it
/// (`docker import`, `podman import`) as [`IMAGE`].
pub fn busybox_image_tar(dir: &Path) -> PathBuf {
    std::fs::create_dir_all(dir).unwrap();
    let path = dir.join("busybox.tar");
    let busybox = std::fs::read(BUSYBOX)
        .unwrap_or_else(|err| panic!("{BUSYBOX}: {err} (install busybox-static)"));
    let mut builder = tar::Builder::new(std::fs::File::create(&path).unwrap());
    for name in ["bin", "data", "dev", "etc", "proc", "sys", "tmp"] {
        let mut header = tar::Header::new_gnu();
        header.set_entry_type(tar::EntryType::Directory);
        header.set_mode(0o755);
        header.set_size(0);
        builder
            .append_data(&mut header, name, std::io::empty())
            .unwrap();
    }
    let mut header = tar::Header::new_gnu();
    header.set_mode(0o755);
    header.set_size(busybox.len() as u64);
    builder
        .append_data(&mut header, "bin/busybox", busybox.as_slice())
        .unwrap();
    for applet in APPLETS {
        let mut header = tar::Header::new_gnu();
        header.set_entry_type(tar::EntryType::Symlink);
        header.set_mode(0o777);
        header.set_size(0);
        builder
            .append_link(&mut header, format!("bin/{applet}"), "busybox")
            .unwrap();
    }
    builder.into_inner().unwrap();
    path
}

/// What the two engines' CLIs share: a base command (absolute binary, the dir's flags and
/// environment) to which a test adds its arguments.
pub trait Engine {
    /// The engine's CLI with its flags and environment for the test's dir, no arguments yet.
    fn command(&self) -> Command;
    /// The dir the engine lives in (the image tar is made under it).
    fn dir(&self) -> &Path;

    /// Runs the engine's CLI with `args`, panicking only when it cannot be started.
    fn run<I, S>(&self, args: I) -> Output
    where
        I: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
    {
        let mut command = self.command();
        command.args(args).stdin(Stdio::null());
        command
            .output()
            .unwrap_or_else(|err| panic!("cannot run {command:?}: {err}"))
    }

    /// [`Engine::run`], panicking with the command and its stderr unless it succeeded; its
    /// stdout, trimmed.
    fn run_ok<I, S>(&self, args: I) -> String
    where
        I: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
    {
        let args: Vec<S> = args.into_iter().collect();
        let out = self.run(&args);
        assert!(
            out.status.success(),
            "{:?} {:?} failed ({}): {}",
            self.command().get_program(),
            args.iter().map(AsRef::as_ref).collect::<Vec<_>>(),
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).trim().to_owned()
    }

    /// Imports [`busybox_image_tar`] (made under the dir) as [`IMAGE`].
    fn import_busybox(&self) {
        let tar = busybox_image_tar(&self.dir().join("image"));
        self.run_ok([OsStr::new("import"), tar.as_os_str(), OsStr::new(IMAGE)]);
    }
}

/// The pids of processes started for `dir` (an argument names it: engines, containerd,
/// shims, conmon) and of all their descendants (the containers' processes, whose arguments
/// name nothing of the test).
pub fn engine_pids(dir: &Path) -> BTreeSet<i32> {
    let mut pids = pids_using_dir(dir);
    let parents = parent_map();
    loop {
        let more: Vec<i32> = parents
            .iter()
            .filter(|(pid, ppid)| pids.contains(ppid) && !pids.contains(pid))
            .map(|(pid, _)| *pid)
            .filter(|pid| pid_alive(*pid))
            .collect();
        if more.is_empty() {
            return pids;
        }
        pids.extend(more);
    }
}

/// (pid, parent pid) of every process.
fn parent_map() -> Vec<(i32, i32)> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|entry| {
            let pid = entry.file_name().to_str()?.parse::<i32>().ok()?;
            let stat = std::fs::read_to_string(entry.path().join("stat")).ok()?;
            let ppid = stat.rsplit_once(')')?.1.split_whitespace().nth(1)?;
            Some((pid, ppid.parse().ok()?))
        })
        .collect()
}

/// SIGKILLs whatever [`engine_pids`] finds for `dir`, until nothing is left (bounded), removes
/// the containers' cgroups the kill left behind (a shim or conmon killed before it could), then
/// detaches the mounts under `dir`: what Drop does after the engine's own clean-up, so that a
/// crashed engine or a failed test leaves nothing behind either.
pub fn kill_everything_under(dir: &Path) {
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut cgroups = BTreeSet::new();
    loop {
        let pids = engine_pids(dir);
        if pids.is_empty() || Instant::now() > deadline {
            break;
        }
        cgroups.extend(container_cgroups(&pids));
        for pid in &pids {
            kill9_pid(*pid);
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    remove_cgroups(&cgroups);
    detach_mounts_under(dir);
}

/// The cgroups (as in `/proc/PID/cgroup`, e.g. `/docker/<id>`) of `pids` that are a
/// container's own: named by a 64-hex container id, and not this process's. Never a parent
/// such as `/docker` or `/libpod_parent/conmon`, which engines share.
fn container_cgroups(pids: &BTreeSet<i32>) -> BTreeSet<String> {
    let own = cgroup_paths("self");
    pids.iter()
        .flat_map(|pid| cgroup_paths(&pid.to_string()))
        .filter(|path| !own.contains(path) && has_container_id(path))
        .collect()
}

fn cgroup_paths(pid: &str) -> BTreeSet<String> {
    std::fs::read_to_string(format!("/proc/{pid}/cgroup"))
        .unwrap_or_default()
        .lines()
        .filter_map(|line| line.splitn(3, ':').nth(2).map(str::to_owned))
        .collect()
}

fn has_container_id(path: &str) -> bool {
    path.rsplit('/').next().is_some_and(|name| {
        name.split(|c: char| !c.is_ascii_hexdigit())
            .any(|run| run.len() == 64)
    })
}

/// Removes each of `paths` (empty by now: its processes are dead) in every cgroup hierarchy
/// mounted; one that is busy or absent in a hierarchy is left alone.
fn remove_cgroups(paths: &BTreeSet<String>) {
    if paths.is_empty() {
        return;
    }
    let table = MountTable::read().unwrap();
    for mount in table
        .entries()
        .iter()
        .filter(|m| m.fs_type == "cgroup" || m.fs_type == "cgroup2")
    {
        for path in paths {
            let _ = std::fs::remove_dir(mount.mount_point.join(path.trim_start_matches('/')));
        }
    }
}

/// Waits (bounded) until `pid` is gone; true if it went.
pub fn wait_gone(pid: i32, within: Duration) -> bool {
    let deadline = Instant::now() + within;
    while pid_alive(pid) {
        if Instant::now() > deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    true
}
