//! Mount-table access and the bind-mount syscalls of `--mount-mode bind`.
//!
//! Owns: reading `/proc/self/mountinfo` (the truth about what is mounted,
//! consulted when checking "already mounted"), bind mounts (read-only by a
//! second `MS_REMOUNT|MS_BIND|MS_RDONLY` call, as the kernel ignores
//! `MS_RDONLY` on the first bind), and unmounting. All through `rustix`, never
//! by running `mount(8)`.
//!
//! Must not: decide when to mount (that is `plugin.rs`), create or remove
//! directories, or ever delete anything.

use std::collections::HashSet;
use std::ffi::OsString;
use std::io;
use std::os::unix::ffi::OsStringExt;
use std::path::{Path, PathBuf};

use rustix::mount::{MountFlags, UnmountFlags};

/// How NodeStage/NodePublish make a volume available.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MountMode {
    /// Real bind mounts (needs `CAP_SYS_ADMIN`).
    Bind,
    /// Bookkeeping only: no mount syscalls (benchmarks, unprivileged runs).
    None,
}

/// Decodes the octal escapes (`\040` for space, ...) the kernel uses in
/// mountinfo paths.
fn unescape(field: &str) -> PathBuf {
    let b = field.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\'
            && b.get(i + 1..i + 4).is_some_and(|d| {
                // At most \377: one byte.
                d[0] <= b'3' && d.iter().all(|c| (b'0'..=b'7').contains(c))
            })
        {
            let v = (b[i + 1] - b'0') * 64 + (b[i + 2] - b'0') * 8 + (b[i + 3] - b'0');
            out.push(v);
            i += 4;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    PathBuf::from(OsString::from_vec(out))
}

/// Parses mountinfo text into the set of mount points (field 5).
pub fn parse_mount_points(text: &str) -> HashSet<PathBuf> {
    text.lines()
        .filter_map(|l| l.split(' ').nth(4))
        .map(unescape)
        .collect()
}

/// The current mount points of this process's mount namespace.
pub fn mount_points() -> io::Result<HashSet<PathBuf>> {
    Ok(parse_mount_points(&std::fs::read_to_string(
        "/proc/self/mountinfo",
    )?))
}

/// The path as the kernel would print it: symlinks resolved when the path
/// exists (mountinfo shows resolved paths).
fn canonical(path: &Path) -> PathBuf {
    std::fs::canonicalize(path).unwrap_or_else(|_| path.to_owned())
}

/// Whether `path` is a mount point.
pub fn is_mount_point(path: &Path) -> io::Result<bool> {
    Ok(mount_points()?.contains(&canonical(path)))
}

/// Mount points strictly below `dir`.
pub fn mount_points_under(dir: &Path) -> io::Result<Vec<PathBuf>> {
    let dir = canonical(dir);
    Ok(mount_points()?
        .into_iter()
        .filter(|m| m != &dir && m.starts_with(&dir))
        .collect())
}

/// Bind-mounts `source` on `target`, read-only if asked. On a failed
/// read-only remount the bind is undone, so that a writable mount never
/// stays where a read-only one was asked for.
pub fn bind(source: &Path, target: &Path, readonly: bool) -> io::Result<()> {
    rustix::mount::mount_bind(source, target)?;
    if readonly {
        let ro = MountFlags::BIND | MountFlags::RDONLY;
        if let Err(e) = rustix::mount::mount_remount(target, ro, "") {
            let _ = rustix::mount::unmount(target, UnmountFlags::empty());
            return Err(e.into());
        }
    }
    Ok(())
}

/// Unmounts everything stacked on `path` (a failed earlier attempt may have
/// left two mounts). Not being a mount point is success.
pub fn unmount_all(path: &Path) -> io::Result<()> {
    // Bounded: a mount that keeps reappearing is reported, not looped on.
    for _ in 0..16 {
        if !is_mount_point(path)? {
            return Ok(());
        }
        match rustix::mount::unmount(path, UnmountFlags::empty()) {
            Ok(()) => {}
            // Raced with another unmount or not a mount point after all.
            Err(rustix::io::Errno::INVAL) | Err(rustix::io::Errno::NOENT) => return Ok(()),
            Err(e) => return Err(e.into()),
        }
    }
    Err(io::Error::other(format!(
        "{} is still a mount point after 16 unmounts",
        path.display()
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_mountinfo_with_escapes() {
        let text = "36 35 98:0 /mnt1 /mnt/a\\040b rw,noatime master:1 - ext3 /dev/root rw\n\
                    37 35 98:0 / / rw - ext4 /dev/sda1 rw\n";
        let m = parse_mount_points(text);
        assert!(m.contains(Path::new("/mnt/a b")));
        assert!(m.contains(Path::new("/")));
        assert_eq!(m.len(), 2);
    }

    #[test]
    fn unescape_keeps_plain_backslash() {
        assert_eq!(unescape("a\\b"), PathBuf::from("a\\b"));
        assert_eq!(unescape("x\\134y"), PathBuf::from("x\\y"));
    }
}
