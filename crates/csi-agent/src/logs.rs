//! Size-capped rotation of the components' `stdout` and `stderr` files (both runtimes).
//!
//! This module owns the rotation scheme only; it must not open the files for the
//! components nor decide which dirs to look at (the service manager does both).
//!
//! The files are the component's own stdio, opened with `O_APPEND` by the runtime (a
//! process, or a container's init through runc): csi-agent cannot reopen them in the
//! component. So rotation is copy-then-truncate: `stdout.{n-1}` → `stdout.{n}` (the oldest
//! dropped), `stdout` copied to `stdout.1`, then `stdout` truncated to zero; the component's
//! next append lands at the new end. A line written between the copy and the truncation is
//! lost, the known price of copy-truncate.

use std::io;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// Files rotated in each container dir.
pub const LOG_FILES: [&str; 2] = ["stdout", "stderr"];
/// Rotate a log once it is larger than this.
pub const DEFAULT_MAX_BYTES: u64 = 10 * 1024 * 1024;
/// Rotated generations kept (`stdout.1` … `stdout.N`).
pub const DEFAULT_GENERATIONS: u32 = 3;
/// How often the service manager looks at the sizes.
pub const CHECK_INTERVAL: Duration = Duration::from_secs(10);

fn generation(path: &Path, n: u32) -> PathBuf {
    let mut name = path.as_os_str().to_owned();
    name.push(format!(".{n}"));
    PathBuf::from(name)
}

/// Rotates `path` if it is larger than `max_bytes`, keeping `generations` old copies.
/// Returns whether it rotated.
pub fn rotate_if_larger(path: &Path, max_bytes: u64, generations: u32) -> io::Result<bool> {
    let size = match std::fs::metadata(path) {
        Ok(meta) => meta.len(),
        Err(err) if err.kind() == io::ErrorKind::NotFound => return Ok(false),
        Err(err) => return Err(err),
    };
    if size <= max_bytes || generations == 0 {
        return Ok(false);
    }
    for n in (1..generations).rev() {
        let from = generation(path, n);
        match std::fs::rename(&from, generation(path, n + 1)) {
            Ok(()) => {}
            Err(err) if err.kind() == io::ErrorKind::NotFound => {}
            Err(err) => return Err(err),
        }
    }
    std::fs::copy(path, generation(path, 1))?;
    std::fs::OpenOptions::new()
        .write(true)
        .open(path)?
        .set_len(0)?;
    Ok(true)
}

/// Rotates the logs of one container dir; errors are logged, not returned (a log that
/// cannot be rotated must not disturb the component).
pub fn rotate_dir(container_dir: &Path, max_bytes: u64, generations: u32) {
    for name in LOG_FILES {
        let path = container_dir.join(name);
        if let Err(err) = rotate_if_larger(&path, max_bytes, generations) {
            tracing::warn!(path = %path.display(), "cannot rotate the log: {err}");
        }
    }
}

#[cfg(test)]
mod tests {
    use std::io::Write;

    use super::*;

    #[test]
    fn logs_rotate_past_the_cap_keeping_n_generations_and_appends_go_on() -> anyhow::Result<()> {
        let dir = tempfile::tempdir()?;
        let path = dir.path().join("stdout");
        // The component's own handle, opened for appending as the runtimes do.
        let mut log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)?;
        log.write_all(b"small")?;
        assert!(!rotate_if_larger(&path, 10, 2)?);
        for round in 1..=3u8 {
            log.write_all(&[b'0' + round; 20])?;
            assert!(rotate_if_larger(&path, 10, 2)?, "round {round}");
            assert_eq!(std::fs::metadata(&path)?.len(), 0);
        }
        // Newest first; the oldest (round 1, with "small") dropped.
        assert_eq!(std::fs::read(generation(&path, 1))?, vec![b'3'; 20]);
        assert_eq!(std::fs::read(generation(&path, 2))?, vec![b'2'; 20]);
        assert!(!generation(&path, 3).exists());
        // The component's next write lands at the start of the truncated file.
        log.write_all(b"after")?;
        assert_eq!(std::fs::read(&path)?, b"after");
        Ok(())
    }
}
