//! The `process` runtime: a component is a supervised host process.
//!
//! This module owns spawning, adopting, watching and signalling plugin processes. It must not
//! restart anything nor write records (the service manager does both), and it must not use
//! `unsafe` (the workspace denies it).
//!
//! - **Launch**: `command` (see [`crate::config::CommandConfig::argv`]) runs with the daemon's
//!   environment, then the config's `environment`, then `CSI_ENDPOINT=unix://<socket>` and
//!   `CSI_NODE_ID` (ours win: the socket location is csi-agent's to choose). stdin is
//!   `/dev/null`; stdout and stderr are appended to `stdout` and `stderr` in the container
//!   dir, which is also the working directory. With `command.user`, the process runs as that
//!   user of the host's `/etc/passwd` (uid and primary gid, no supplementary groups: setting
//!   them needs `pre_exec`), starts in `/` (the container dir is in root's private work dir)
//!   and gets its socket dir ([`super::users`]; docs/configuration.md, "Running as a user").
//! - **Outliving the daemon**: the process is put in its own process group
//!   (`CommandExt::process_group(0)`), so Ctrl-C or a SIGTERM sent to the daemon's group does
//!   not reach it. A full `setsid` would also detach it from the daemon's session, but needs
//!   `pre_exec`, which is `unsafe`; a new process group is enough because csi-agent has no
//!   controlling terminal worth detaching from when run as a service, and a terminal hang-up
//!   of an interactive session is not a case we need to survive.
//! - **Untracked processes**: every component process carries `CSI_AGENT_COMPONENT=<its
//!   container dir>` in its environment. A daemon killed after spawning a component but before
//!   its `component.json` was durable leaves a process no record names; before each launch the
//!   runtime finds such processes by that marker (same owner, own process group) and kills
//!   them, so that a component never runs twice (issue #12, item 6; docs/recovery.md).
//! - **Identity**: pid plus process start time (field 22 of `/proc/<pid>/stat`) plus boot id,
//!   so adoption never takes a reused pid for the component.
//! - **Watching**: a pidfd (`pidfd_open`) registered with tokio: readable = exited. This works
//!   for adopted processes too, which are not our children. When the process *is* our child
//!   it is also reaped (`waitid(P_PIDFD)`), so no zombies are left.
//! - **Stopping**: SIGTERM to the component's process group, SIGKILL after the grace period.
//!   When our child ends, what is left of its process group (e.g. the real plugin under a
//!   `sh -c` wrapper) is killed before it is reaped, so nothing of an old component lingers.

use std::fs::{File, OpenOptions};
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::fs::OpenOptionsExt;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::Mutex;
use std::time::Duration;

use futures::FutureExt;
use futures::future::BoxFuture;
use rustix::io::Errno;
use rustix::process::{
    Pid, PidfdFlags, Signal, WaitId, WaitIdOptions, WaitIdStatus, kill_process_group, pidfd_open,
    pidfd_send_signal, waitid,
};
use tokio::io::unix::AsyncFd;

use super::{
    Component, ExitInfo, LaunchContext, LaunchSpec, MESOS_SANDBOX_VAR, Runtime, RuntimeError,
    RuntimeHandle, agent_vars, users,
};

/// Runs components as host processes.
#[derive(Debug, Default)]
pub struct ProcessRuntime {}

impl ProcessRuntime {
    pub fn new() -> Self {
        Self {}
    }
}

impl Runtime for ProcessRuntime {
    fn kind(&self) -> &'static str {
        "process"
    }

    fn launch<'a>(
        &'a self,
        spec: &'a LaunchSpec,
        context: &'a LaunchContext,
    ) -> BoxFuture<'a, Result<Box<dyn Component>, RuntimeError>> {
        async move {
            // The host's user database, read at each launch (a user added since applies).
            let user = match &spec.command.user {
                Some(user) => Some(
                    users::resolve(Path::new("/"), user)
                        .map_err(|err| RuntimeError::User(Box::new(err)))?,
                ),
                None => None,
            };
            stop_untracked(&component_marker(context), user.as_ref().map(|u| u.uid)).await;
            launch(spec, context, user.as_ref()).map(|c| Box::new(c) as Box<dyn Component>)
        }
        .boxed()
    }

    fn adopt<'a>(
        &'a self,
        handle: &'a RuntimeHandle,
    ) -> BoxFuture<'a, Result<Option<Box<dyn Component>>, RuntimeError>> {
        async move { adopt(handle).map(|c| c.map(|c| Box::new(c) as Box<dyn Component>)) }.boxed()
    }
}

fn open_log(path: &Path) -> Result<File, RuntimeError> {
    OpenOptions::new()
        .create(true)
        .append(true)
        .mode(0o640)
        .open(path)
        .map_err(|source| RuntimeError::Log {
            path: path.to_path_buf(),
            source,
        })
}

/// The environment variable that marks a component's processes (see the module doc).
pub const COMPONENT_MARKER_VAR: &str = "CSI_AGENT_COMPONENT";

/// An environment larger than this is not searched for the marker (a process's environment is
/// a few KiB; the marker of a component csi-agent launched is never beyond the variables its
/// config sets).
const MAX_ENVIRON_BYTES: u64 = 1 << 20;

/// How long an untracked process is given to die after SIGKILL before the launch goes on.
const UNTRACKED_KILL_WAIT: Duration = Duration::from_secs(2);

/// The marker value of a component: its container dir, unique per work dir and component.
fn component_marker(context: &LaunchContext) -> String {
    context.container_dir.display().to_string()
}

/// Processes marked as the component's (environment entry `CSI_AGENT_COMPONENT=<marker>`),
/// owned by our effective user and leading their own process group, as every component
/// process this runtime starts does. Anything else is left alone, whatever its environment
/// says: another user's process cannot make csi-agent signal it.
pub fn find_marked(marker: &str) -> Vec<Pid> {
    find_marked_owned_by(marker, None)
}

/// [`find_marked`], also taking processes owned by `user`: the uid a component with
/// `command.user` runs as. A process of that user can carry the marker, and so have itself
/// killed, but it could signal the component itself anyway (same uid): no new power.
pub fn find_marked_owned_by(marker: &str, user: Option<u32>) -> Vec<Pid> {
    use std::io::Read;
    use std::os::unix::fs::MetadataExt;
    let wanted = format!("{COMPONENT_MARKER_VAR}={marker}");
    let me = rustix::process::getpid();
    let uid = rustix::process::geteuid().as_raw();
    let owned = |owner: u32| owner == uid || Some(owner) == user;
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    let mut found = Vec::new();
    for entry in entries.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|name| name.parse::<i32>().ok())
            .and_then(Pid::from_raw)
        else {
            continue;
        };
        if pid == me
            || !entry.metadata().is_ok_and(|m| owned(m.uid()))
            || read_stat(pid).is_none_or(|stat| {
                stat.process_group != pid.as_raw_pid() || matches!(stat.state, 'Z' | 'X')
            })
        {
            continue;
        }
        let mut environ = Vec::new();
        let read = File::open(entry.path().join("environ"))
            .and_then(|file| file.take(MAX_ENVIRON_BYTES).read_to_end(&mut environ));
        if read.is_ok()
            && environ
                .split(|byte| *byte == 0)
                .any(|var| var == wanted.as_bytes())
        {
            found.push(pid);
        }
    }
    found
}

/// At recovery, for a component dir without a record: kills the processes a launch
/// interrupted before its record was durable left running (marked with this dir, owned by
/// the daemon's user), so that they do not outlive the crash until the component's next
/// launch, which may never come (nothing claims a volume of the plugin). A component with
/// `command.user` runs as another uid: its stray is stopped at its next launch instead.
pub async fn forget_stray(container_dir: &Path) {
    stop_untracked(&container_dir.display().to_string(), None).await;
}

/// Kills the component's untracked processes (see the module doc) and waits, bounded, until
/// they are gone.
async fn stop_untracked(marker: &str, user: Option<u32>) {
    let marker_owned = marker.to_owned();
    let pids = crate::sys::blocking("scan /proc", || find_marked_owned_by(&marker_owned, user));
    for pid in pids {
        // The pidfd pins the process: the signal below cannot hit a later one with its pid.
        let Ok(fd) = pidfd_open(pid, PidfdFlags::empty()) else {
            continue;
        };
        tracing::warn!(
            pid = pid.as_raw_pid(),
            component = marker,
            "killing a component process no record accounts for (left by a daemon that died while launching it)"
        );
        // Its group too (a plugin under a shell wrapper): the leader is alive (we hold its
        // pidfd and it was no zombie), so the group id is still its own.
        let _ = kill_process_group(pid, Signal::KILL);
        let _ = pidfd_send_signal(&fd, Signal::KILL);
        let deadline = tokio::time::Instant::now() + UNTRACKED_KILL_WAIT;
        while read_stat(pid).is_some_and(|stat| !matches!(stat.state, 'Z' | 'X'))
            && tokio::time::Instant::now() < deadline
        {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
}

/// A component the config explicitly runs as a host process (`"runtime": {"kind":
/// "process"}`) may still ask for isolation only a container gives: said once per launch,
/// naming the fields, never silently dropped (issue #29).
fn warn_unapplied(spec: &LaunchSpec) {
    let fields = super::isolation::requested(&spec.resources, spec.container.as_ref());
    if !fields.is_empty() {
        tracing::warn!(
            component = %spec.container_id,
            fields = %fields.join(", "),
            "runtime \"process\" does not apply {}: the plugin runs without them; remove \"runtime\" (or use {{\"kind\": \"oci\"}}) to run it in a container that applies them",
            fields.join(", ")
        );
    }
}

fn launch(
    spec: &LaunchSpec,
    context: &LaunchContext,
    user: Option<&users::User>,
) -> Result<ProcessComponent, RuntimeError> {
    warn_unapplied(spec);
    let stdout = open_log(&context.container_dir.join("stdout"))?;
    let stderr = open_log(&context.container_dir.join("stderr"))?;
    let endpoint = format!("unix://{}", context.socket.display());
    let vars = agent_vars(&endpoint, &spec.node_id);
    let (program, argv) = spec.command.argv(&vars);
    let mut command = Command::new(&program);
    if let Some((argv0, args)) = argv.split_first() {
        command.arg0(argv0).args(args);
    }
    // The daemon's environment, then Mesos's sandbox variable (the config's may replace it,
    // as under Mesos's containerizer), then the config's, then ours (which win).
    command.env(MESOS_SANDBOX_VAR, &context.container_dir);
    for var in &spec.command.environment {
        command.env(&var.name, &var.value);
    }
    for (name, value) in vars {
        command.env(name, value);
    }
    // std changes the user after forking and before `chdir` and `exec`: the working dir and
    // the program must be reachable by that user. The container dir is not (the work dir is
    // root's, 0700: it holds secrets), so such a component starts in `/`.
    let mut cwd = context.container_dir.as_path();
    if let Some(socket_dir) = context.socket.parent() {
        users::give_socket_dir(socket_dir, user)
            .map_err(|err| RuntimeError::User(Box::new(err)))?;
    }
    if let Some(user) = user {
        if !user.groups.is_empty() {
            // std's `CommandExt::groups` is unstable and `pre_exec` is `unsafe`: setting the
            // uid clears the supplementary groups (setgroups(0)), which is never more power.
            tracing::warn!(
                user = %user.name,
                groups = ?user.groups,
                "the process runtime runs command.user without its supplementary groups; use the oci runtime (additionalGids) if the plugin needs them"
            );
        }
        command.uid(user.uid).gid(user.gid);
        cwd = Path::new("/");
    }
    command
        .env(COMPONENT_MARKER_VAR, component_marker(context))
        .current_dir(cwd)
        .stdin(Stdio::null())
        .stdout(stdout)
        .stderr(stderr)
        .process_group(0);
    let child = command.spawn().map_err(|source| RuntimeError::Spawn {
        program: program.clone(),
        source,
    })?;
    let pid = Pid::from_child(&child);
    // Dropping a std Child neither waits for nor kills it; from here on the pidfd is the
    // handle, and `collect` reaps.
    drop(child);
    let watched = pidfd_open(pid, PidfdFlags::NONBLOCK)
        .map_err(std::io::Error::from)
        .and_then(|fd| {
            // Our unreaped child cannot vanish from /proc, so the start time is there.
            let start_time = read_stat(pid)
                .map(|stat| stat.start_time)
                .ok_or_else(|| std::io::Error::other("cannot read /proc/<pid>/stat"))?;
            ProcessComponent::new(pid, start_time, current_boot_id(), fd)
        });
    match watched {
        Ok(component) => {
            tracing::debug!(pid = pid.as_raw_pid(), %program, "launched component");
            Ok(component)
        }
        Err(source) => {
            // An unwatched component would run unsupervised: kill and reap it (it is our
            // unreaped child, so the pid is still its own).
            let _ = rustix::process::kill_process(pid, Signal::KILL);
            let _ = rustix::process::waitpid(Some(pid), rustix::process::WaitOptions::empty());
            Err(RuntimeError::Watch {
                pid: pid.as_raw_pid(),
                source,
            })
        }
    }
}

fn adopt(handle: &RuntimeHandle) -> Result<Option<ProcessComponent>, RuntimeError> {
    let RuntimeHandle::Process {
        pid,
        start_time,
        boot_id,
    } = handle
    else {
        return Err(RuntimeError::WrongKind {
            runtime: "process",
            handle: handle.kind(),
        });
    };
    if let (Some(recorded), Some(now)) = (boot_id, current_boot_id())
        && *recorded != now
    {
        return Ok(None);
    }
    let Some(pid) = Pid::from_raw(*pid) else {
        return Ok(None);
    };
    let fd = match pidfd_open(pid, PidfdFlags::NONBLOCK) {
        Ok(fd) => fd,
        Err(Errno::SRCH) => return Ok(None),
        Err(err) => {
            return Err(RuntimeError::Watch {
                pid: pid.as_raw_pid(),
                source: err.into(),
            });
        }
    };
    // Checked after opening the pidfd: if the start time matches now, the pidfd refers to
    // the component and not to a later process that reused its pid.
    let Some(stat) = read_stat(pid) else {
        return Ok(None);
    };
    if stat.start_time != *start_time {
        return Ok(None);
    }
    let component =
        ProcessComponent::new(pid, *start_time, boot_id.clone(), fd).map_err(|source| {
            RuntimeError::Watch {
                pid: pid.as_raw_pid(),
                source,
            }
        })?;
    if matches!(stat.state, 'Z' | 'X') {
        // Dead already; if it is our own zombie (a manager re-created in the same process),
        // reap it.
        component.collect();
        return Ok(None);
    }
    Ok(Some(component))
}

/// A watched component process.
#[derive(Debug)]
struct ProcessComponent {
    pid: Pid,
    start_time: u64,
    boot_id: Option<String>,
    pidfd: AsyncFd<OwnedFd>,
    exit: Mutex<Option<ExitInfo>>,
}

impl ProcessComponent {
    fn new(
        pid: Pid,
        start_time: u64,
        boot_id: Option<String>,
        fd: OwnedFd,
    ) -> std::io::Result<Self> {
        // `with_interest` is deprecated because a generic `T: AsRawFd` may hand out a
        // different or closed fd later; an `OwnedFd` owned by the `AsyncFd` cannot, so this
        // use is sound. The replacement (`register_with_interest`) is `unsafe`, which the
        // workspace denies.
        #[allow(deprecated)]
        let pidfd = AsyncFd::with_interest(fd, tokio::io::Interest::READABLE)?;
        Ok(Self {
            pid,
            start_time,
            boot_id,
            pidfd,
            exit: Mutex::new(None),
        })
    }

    fn exit_slot(&self) -> std::sync::MutexGuard<'_, Option<ExitInfo>> {
        // A poisoned lock only means another waiter panicked; the Option is still valid.
        self.exit
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Records the exit (called once the pidfd is readable, i.e. the process ended).
    fn collect(&self) -> ExitInfo {
        let mut slot = self.exit_slot();
        if let Some(exit) = *slot {
            return exit;
        }
        let fd = self.pidfd.get_ref().as_fd();
        let peek = waitid(
            WaitId::PidFd(fd),
            WaitIdOptions::EXITED | WaitIdOptions::NOHANG | WaitIdOptions::NOWAIT,
        );
        let exit = match peek {
            Ok(Some(_)) => {
                // Our child and still a zombie: its pid, which is also its process group id,
                // cannot be reused until we reap it, so killing the group hits only what is
                // left of this component.
                let _ = kill_process_group(self.pid, Signal::KILL);
                match waitid(
                    WaitId::PidFd(fd),
                    WaitIdOptions::EXITED | WaitIdOptions::NOHANG,
                ) {
                    Ok(Some(status)) => exit_info(&status),
                    _ => ExitInfo::Unknown,
                }
            }
            // ECHILD: adopted, not our child; its parent (init or a subreaper) reaps it.
            _ => ExitInfo::Unknown,
        };
        *slot = Some(exit);
        exit
    }

    async fn wait_exit(&self) -> ExitInfo {
        loop {
            if let Some(exit) = *self.exit_slot() {
                return exit;
            }
            match self.pidfd.readable().await {
                // Readiness is deliberately not cleared: an ended process stays readable.
                Ok(_guard) => return self.collect(),
                Err(err) => {
                    // Only when the reactor is gone (runtime shutting down). Fall back to
                    // looking at /proc now and then rather than claiming an exit.
                    tracing::warn!(pid = self.pid.as_raw_pid(), "cannot poll pidfd: {err}");
                    tokio::time::sleep(Duration::from_millis(500)).await;
                    if !self.leader_present() {
                        return self.collect();
                    }
                }
            }
        }
    }

    /// The process still exists (running or zombie) with our start time.
    fn leader_present(&self) -> bool {
        read_stat(self.pid).is_some_and(|stat| stat.start_time == self.start_time)
    }

    fn signal(&self, signal: Signal) {
        // The whole process group first, so a plugin under a shell wrapper gets it too. Only
        // while the leader exists: then its pid, the group id, cannot belong to anyone else.
        if self.leader_present() && kill_process_group(self.pid, signal).is_ok() {
            return;
        }
        // The pidfd cannot hit a reused pid.
        let _ = pidfd_send_signal(self.pidfd.get_ref(), signal);
    }
}

impl Component for ProcessComponent {
    fn handle(&self) -> RuntimeHandle {
        RuntimeHandle::Process {
            pid: self.pid.as_raw_pid(),
            start_time: self.start_time,
            boot_id: self.boot_id.clone(),
        }
    }

    fn wait(&self) -> BoxFuture<'_, ExitInfo> {
        self.wait_exit().boxed()
    }

    fn stop(&self, grace: Duration) -> BoxFuture<'_, ExitInfo> {
        async move {
            if let Some(exit) = *self.exit_slot() {
                return exit;
            }
            self.signal(Signal::TERM);
            match tokio::time::timeout(grace, self.wait_exit()).await {
                Ok(exit) => exit,
                Err(_) => {
                    tracing::warn!(
                        pid = self.pid.as_raw_pid(),
                        "component did not exit {} ms after SIGTERM; sending SIGKILL",
                        grace.as_millis()
                    );
                    self.signal(Signal::KILL);
                    self.wait_exit().await
                }
            }
        }
        .boxed()
    }
}

fn exit_info(status: &WaitIdStatus) -> ExitInfo {
    if let Some(code) = status.exit_status() {
        ExitInfo::Code(code)
    } else if let Some(signal) = status.terminating_signal() {
        ExitInfo::Signal(signal)
    } else {
        ExitInfo::Unknown
    }
}

/// The fields of `/proc/<pid>/stat` we need.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ProcStat {
    /// Field 3: `R`, `S`, `Z` (zombie), ...
    pub state: char,
    /// Field 5: the process group id.
    pub process_group: i32,
    /// Field 22: start time in clock ticks after boot.
    pub start_time: u64,
}

/// Reads `/proc/<pid>/stat`; `None` if the process does not exist (or the file is odd).
pub fn read_stat(pid: Pid) -> Option<ProcStat> {
    let text = std::fs::read_to_string(format!("/proc/{}/stat", pid.as_raw_pid())).ok()?;
    parse_stat(&text)
}

fn parse_stat(text: &str) -> Option<ProcStat> {
    // Field 2 (comm) is in parentheses and may itself contain spaces and parentheses: the
    // fixed fields start after the *last* ')'.
    let rest = &text[text.rfind(')')? + 1..];
    let fields: Vec<&str> = rest.split_ascii_whitespace().collect();
    // `fields[0]` is field 3.
    let state = fields.first()?.chars().next()?;
    let process_group = fields.get(5 - 3)?.parse().ok()?;
    let start_time = fields.get(22 - 3)?.parse().ok()?;
    Some(ProcStat {
        state,
        process_group,
        start_time,
    })
}

/// The current boot id, or `None` where the kernel does not expose it.
pub fn current_boot_id() -> Option<String> {
    std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .ok()
        .map(|id| id.trim().to_owned())
        .filter(|id| !id.is_empty())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_stat_with_awkward_comm() {
        let text =
            "1234 (a) b (c)) S 1 1234 1234 0 -1 4194560 100 0 0 0 1 2 0 0 20 0 1 0 987654 1000 10";
        assert_eq!(
            parse_stat(text),
            Some(ProcStat {
                state: 'S',
                process_group: 1234,
                start_time: 987654
            })
        );
        assert_eq!(parse_stat("garbage"), None);
    }

    #[test]
    fn reads_own_stat() {
        let me = rustix::process::getpid();
        let stat = read_stat(me);
        // The main thread may sleep while a test thread reads: any live state will do.
        assert!(
            stat.is_some_and(|s| s.start_time > 0 && s.state != 'Z' && s.state != 'X'),
            "{stat:?}"
        );
    }
}
