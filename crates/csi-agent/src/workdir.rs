//! One daemon per work dir: an exclusive `flock` on `<work_dir>/lock`, held for the life of
//! the process.
//!
//! Two daemons on one work dir overwrite each other's records and unmount each other's
//! volumes (docs/design.md, "Trust"), so the lock is taken before anything in the work dir is
//! read or written, and a second daemon is refused with the pid of the first. The kernel
//! drops the lock when the holder dies, however it dies, so a crash never leaves a stale lock.
//!
//! "When the holder dies" is not "when `kill -9` returns": a SIGKILLed daemon keeps its files
//! (and so the lock) until its last thread has finished exiting, which takes from microseconds
//! to seconds (threads in a blocking system call, a dying mount). A daemon started at once
//! after the crash must not be refused for that, so the holder's pid and start time are
//! written into the lock file, and a lock whose recorded holder is exiting (zombie, dead,
//! SIGKILL pending, `PF_EXITING`) or gone (no such pid, or the pid now belongs to another
//! process, told by its start time) is waited for, bounded by [`EXITING_HOLDER_WAIT`]. A lock
//! held by a live process is refused at once, as before.
//!
//! It must not create or touch anything in the work dir but the lock file.

use std::fs::File;
use std::io::{Read, Seek, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use std::time::{Duration, Instant};

use rustix::fs::FlockOperation;

/// The lock file's name inside the work dir.
pub const LOCK_FILE: &str = "lock";

/// How long a lock held by an exiting or vanished holder is waited for before giving up.
pub const EXITING_HOLDER_WAIT: Duration = Duration::from_secs(10);

/// How long a lock whose file names no holder yet is retried: the holder writes its pid
/// right after it takes the lock, so only that moment is bridged.
const UNNAMED_HOLDER_WAIT: Duration = Duration::from_secs(1);

/// The pause between two tries while waiting.
const RETRY_EVERY: Duration = Duration::from_millis(20);

#[derive(Debug, thiserror::Error)]
pub enum LockError {
    #[error(
        "work dir {} is in use by another csi-agentd{}: stop that daemon first, or give this one another --work-dir",
        work_dir.display(),
        holder.map(|pid| format!(" (pid {pid})")).unwrap_or_default()
    )]
    Held {
        work_dir: PathBuf,
        holder: Option<u32>,
    },
    #[error(
        "work dir {} is still locked by csi-agentd pid {pid}, which is {why}, after waiting {}s for it to release the lock: \
         a process stuck exiting is usually blocked in the kernel (see /proc/{pid}/stack, state D); start csi-agentd again once it is gone",
        work_dir.display(),
        waited.as_secs()
    )]
    HolderStuckExiting {
        work_dir: PathBuf,
        pid: u32,
        why: String,
        waited: Duration,
    },
    #[error("cannot lock the work dir through {}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// The held lock; dropping it (or the process ending) releases it.
#[derive(Debug)]
pub struct WorkDirLock {
    _file: File,
}

/// Takes the exclusive lock of `work_dir` (which must exist), or says who holds it. A holder
/// that is exiting or gone is waited for, up to [`EXITING_HOLDER_WAIT`].
pub fn lock(work_dir: &Path) -> Result<WorkDirLock, LockError> {
    lock_waiting(work_dir, EXITING_HOLDER_WAIT)
}

/// [`lock`] with the wait for an exiting holder bounded by `wait`.
pub fn lock_waiting(work_dir: &Path, wait: Duration) -> Result<WorkDirLock, LockError> {
    let path = work_dir.join(LOCK_FILE);
    let io = |source: std::io::Error| LockError::Io {
        path: path.clone(),
        source,
    };
    // O_NOFOLLOW: a symlink planted at the lock's path must not make root open another file.
    let mut file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o600)
        .custom_flags(o_nofollow())
        .open(&path)
        .map_err(io)?;
    let started = Instant::now();
    let mut told: Option<u32> = None;
    loop {
        match rustix::fs::flock(&file, FlockOperation::NonBlockingLockExclusive) {
            Ok(()) => break,
            Err(rustix::io::Errno::WOULDBLOCK) => {}
            Err(errno) => return Err(io(errno.into())),
        }
        let (pid, recorded_start) = read_holder(&mut file).map_err(io)?;
        let held = || LockError::Held {
            work_dir: work_dir.to_path_buf(),
            holder: pid,
        };
        let Some(pid) = pid else {
            if started.elapsed() >= UNNAMED_HOLDER_WAIT {
                return Err(held());
            }
            std::thread::sleep(RETRY_EVERY);
            continue;
        };
        let Some(why) = holder_leaving(pid, recorded_start) else {
            // A live daemon: refused at once, whatever was waited for before.
            return Err(held());
        };
        if started.elapsed() >= wait {
            return Err(LockError::HolderStuckExiting {
                work_dir: work_dir.to_path_buf(),
                pid,
                why,
                waited: wait,
            });
        }
        if told != Some(pid) {
            tracing::warn!(
                work_dir = %work_dir.display(),
                pid,
                holder = %why,
                wait_s = wait.as_secs(),
                "the work dir's lock is still held by a csi-agentd that is {why}; waiting for the kernel to release it"
            );
            told = Some(pid);
        }
        std::thread::sleep(RETRY_EVERY);
    }
    if let Some(pid) = told {
        tracing::info!(
            pid,
            waited_ms = started.elapsed().as_millis() as u64,
            "the previous csi-agentd released the work dir's lock"
        );
    }
    // The pid and start time are for a second daemon's message and its "is the holder
    // exiting?" check; the lock is the flock.
    file.set_len(0).map_err(io)?;
    file.rewind().map_err(io)?;
    let pid = std::process::id();
    match proc_start_time(pid) {
        Some(start) => writeln!(file, "{pid} {start}"),
        None => writeln!(file, "{pid}"),
    }
    .map_err(io)?;
    Ok(WorkDirLock { _file: file })
}

/// The holder's pid and start time as the lock file records them (`<pid> [<start time>]`; a
/// file written by an older csi-agentd has only the pid).
fn read_holder(file: &mut File) -> std::io::Result<(Option<u32>, Option<u64>)> {
    let mut text = String::new();
    file.rewind()?;
    // Bounded: the file is ours, but a work dir is still outside input.
    let _ = (&*file).take(64).read_to_string(&mut text);
    let mut fields = text.split_whitespace();
    let pid = fields.next().and_then(|p| p.parse().ok());
    let start = fields.next().and_then(|s| s.parse().ok());
    Ok((pid, start))
}

/// Why the recorded holder `pid` is leaving (exiting or gone), or `None` when it is a live
/// process that is not being killed.
fn holder_leaving(pid: u32, recorded_start: Option<u64>) -> Option<String> {
    let stat = match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => stat,
        Err(err) if err.kind() == std::io::ErrorKind::NotFound => {
            return Some("gone (no such process)".to_owned());
        }
        // Unknown: treat it as alive, which refuses at once, as before this wait existed.
        Err(_) => return None,
    };
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    leaving_from_proc(&stat, &status, recorded_start)
}

/// [`holder_leaving`] on the text of `/proc/PID/stat` and `/proc/PID/status`.
fn leaving_from_proc(stat: &str, status: &str, recorded_start: Option<u64>) -> Option<String> {
    // The command name (field 2) may hold spaces and parentheses: fields start after the
    // last ')'. After it: state (field 3), ..., flags (field 9), ..., starttime (field 22).
    let fields = stat_fields(stat);
    let state = fields.first().copied().unwrap_or("");
    if state == "Z" || state == "X" || state == "x" {
        return Some(format!("exiting (state {state})"));
    }
    if let (Some(recorded), Some(now)) = (
        recorded_start,
        fields.get(19).and_then(|s| s.parse::<u64>().ok()),
    ) && recorded != now
    {
        return Some("gone (its pid now belongs to another process)".to_owned());
    }
    // PF_EXITING: the task is in do_exit().
    const PF_EXITING: u64 = 0x4;
    if fields
        .get(6)
        .and_then(|f| f.parse::<u64>().ok())
        .is_some_and(|flags| flags & PF_EXITING != 0)
    {
        return Some("exiting".to_owned());
    }
    // A SIGKILL sent but not yet acted on: `kill -9` returns before the target runs again.
    const SIGKILL_BIT: u64 = 1 << (9 - 1);
    let killed = status.lines().any(|line| {
        let Some((key, value)) = line.split_once(':') else {
            return false;
        };
        matches!(key, "SigPnd" | "ShdPnd")
            && u64::from_str_radix(value.trim(), 16).is_ok_and(|mask| mask & SIGKILL_BIT != 0)
    });
    killed.then(|| "exiting (SIGKILL pending)".to_owned())
}

/// The fields of `/proc/PID/stat` from field 3 (the state) on. The command name (field 2)
/// may hold spaces and parentheses, so they start after the last ')'.
fn stat_fields(stat: &str) -> Vec<&str> {
    stat.rsplit_once(')')
        .map(|(_, rest)| rest.split_whitespace().collect())
        .unwrap_or_default()
}

/// The start time of `pid` (clock ticks after boot, field 22 of `/proc/PID/stat`).
fn proc_start_time(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat_fields(&stat).get(19)?.parse().ok()
}

fn o_nofollow() -> i32 {
    rustix::fs::OFlags::NOFOLLOW.bits() as i32
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    #[test]
    fn a_second_lock_is_refused_with_the_holders_pid_and_freed_on_drop() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let first = lock(dir.path()).unwrap_or_else(|e| panic!("{e}"));
        let err = lock(dir.path()).map(|_| ()).unwrap_err();
        let message = err.to_string();
        assert!(
            message.contains(&format!("pid {}", std::process::id())) && message.contains("in use"),
            "{message}"
        );
        drop(first);
        assert!(lock(dir.path()).is_ok(), "the lock is free once dropped");
    }

    /// The pid of a process that has exited and been reaped.
    fn dead_pid() -> u32 {
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = child.id();
        child.wait().unwrap();
        pid
    }

    /// Holds the work dir's lock through a second open file (as another process would) and
    /// writes `holder` into the lock file as that process's record.
    fn hold(work: &Path, holder: &str) -> File {
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(work.join(LOCK_FILE))
            .unwrap();
        rustix::fs::flock(&file, FlockOperation::NonBlockingLockExclusive).unwrap();
        std::fs::write(work.join(LOCK_FILE), holder).unwrap();
        file
    }

    #[test]
    fn a_live_holder_is_refused_at_once() {
        let dir = tempfile::tempdir().unwrap();
        let me = std::process::id();
        let _held = hold(
            dir.path(),
            &format!("{me} {}\n", proc_start_time(me).unwrap()),
        );
        let started = Instant::now();
        let err = lock(dir.path()).map(|_| ()).unwrap_err();
        assert!(
            started.elapsed() < Duration::from_millis(500),
            "{:?}",
            started.elapsed()
        );
        assert!(
            matches!(err, LockError::Held { holder: Some(pid), .. } if pid == me),
            "{err}"
        );
    }

    #[test]
    fn a_holder_that_is_gone_is_waited_for_until_the_lock_is_free() {
        let dir = tempfile::tempdir().unwrap();
        let held = hold(dir.path(), &format!("{}\n", dead_pid()));
        let releaser = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(300));
            drop(held);
        });
        let started = Instant::now();
        let lock = lock(dir.path()).unwrap();
        let waited = started.elapsed();
        releaser.join().unwrap();
        assert!(waited >= Duration::from_millis(250), "{waited:?}");
        // The new holder records itself with its start time.
        let text = std::fs::read_to_string(dir.path().join(LOCK_FILE)).unwrap();
        let me = std::process::id();
        assert_eq!(text, format!("{me} {}\n", proc_start_time(me).unwrap()));
        drop(lock);
    }

    #[test]
    fn a_reused_pid_is_not_taken_for_the_holder_and_the_wait_is_bounded() {
        let dir = tempfile::tempdir().unwrap();
        // Our own pid, but with a start time that is not ours: the recorded holder is gone.
        let me = std::process::id();
        let _held = hold(
            dir.path(),
            &format!("{me} {}\n", proc_start_time(me).unwrap() + 1),
        );
        let started = Instant::now();
        let err = lock_waiting(dir.path(), Duration::from_millis(300))
            .map(|_| ())
            .unwrap_err();
        let waited = started.elapsed();
        assert!(
            waited >= Duration::from_millis(300) && waited < Duration::from_secs(2),
            "{waited:?}"
        );
        let message = err.to_string();
        assert!(
            matches!(err, LockError::HolderStuckExiting { pid, .. } if pid == me)
                && message.contains("another process")
                && message.contains(&format!("/proc/{me}/stack")),
            "{message}"
        );
    }

    #[test]
    fn proc_states_are_read_past_a_hostile_command_name() {
        let stat = |state: &str, flags: u64, start: u64| {
            format!("42 (a) Z (b)) {state} 1 1 1 0 -1 {flags} 0 0 0 0 0 0 0 0 20 0 4 0 {start} 0 0")
        };
        assert_eq!(leaving_from_proc(&stat("S", 0, 7), "", Some(7)), None);
        assert_eq!(leaving_from_proc(&stat("R", 0x40, 7), "", None), None);
        assert!(
            leaving_from_proc(&stat("Z", 0, 7), "", Some(7))
                .unwrap()
                .contains("state Z")
        );
        assert!(
            leaving_from_proc(&stat("S", 0, 8), "", Some(7))
                .unwrap()
                .contains("another process")
        );
        assert_eq!(
            leaving_from_proc(&stat("D", 0x4, 7), "", Some(7)).as_deref(),
            Some("exiting")
        );
        let killed = "Name:\tx\nSigPnd:\t0000000000000000\nShdPnd:\t0000000000000100\n";
        assert!(
            leaving_from_proc(&stat("S", 0, 7), killed, Some(7))
                .unwrap()
                .contains("SIGKILL")
        );
        let termed = "SigPnd:\t0000000000004000\nShdPnd:\t0000000000000000\n";
        assert_eq!(leaving_from_proc(&stat("S", 0, 7), termed, Some(7)), None);
    }

    #[test]
    fn a_symlink_at_the_lock_path_is_not_followed() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let victim = dir.path().join("victim");
        std::fs::write(&victim, "keep").unwrap_or_else(|e| panic!("{e}"));
        let work = dir.path().join("work");
        std::fs::create_dir(&work).unwrap_or_else(|e| panic!("{e}"));
        std::os::unix::fs::symlink(&victim, work.join(LOCK_FILE)).unwrap_or_else(|e| panic!("{e}"));
        assert!(lock(&work).is_err());
        assert_eq!(std::fs::read_to_string(&victim).unwrap_or_default(), "keep");
    }
}
