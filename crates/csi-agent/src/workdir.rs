//! One daemon per work dir: an exclusive `flock` on `<work_dir>/lock`, held for the life of
//! the process.
//!
//! Two daemons on one work dir overwrite each other's records and unmount each other's
//! volumes (docs/design.md, "Trust"), so the lock is taken before anything in the work dir is
//! read or written, and a second daemon is refused with the pid of the first. The kernel
//! drops the lock when the holder dies, however it dies, so a crash never leaves a stale lock.
//!
//! It must not create or touch anything in the work dir but the lock file.

use std::fs::File;
use std::io::{Read, Seek, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use rustix::fs::FlockOperation;

/// The lock file's name inside the work dir.
pub const LOCK_FILE: &str = "lock";

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

/// Takes the exclusive lock of `work_dir` (which must exist), or says who holds it.
pub fn lock(work_dir: &Path) -> Result<WorkDirLock, LockError> {
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
    match rustix::fs::flock(&file, FlockOperation::NonBlockingLockExclusive) {
        Ok(()) => {}
        Err(rustix::io::Errno::WOULDBLOCK) => {
            let mut text = String::new();
            let _ = file.take(32).read_to_string(&mut text);
            return Err(LockError::Held {
                work_dir: work_dir.to_path_buf(),
                holder: text.trim().parse().ok(),
            });
        }
        Err(errno) => return Err(io(errno.into())),
    }
    // The pid is only for the message a second daemon prints; the lock is the flock.
    file.set_len(0).map_err(io)?;
    file.rewind().map_err(io)?;
    writeln!(file, "{}", std::process::id()).map_err(io)?;
    Ok(WorkDirLock { _file: file })
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
