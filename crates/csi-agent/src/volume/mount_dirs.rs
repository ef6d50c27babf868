//! The staging and target directories a plugin mounts on: created, probed and removed
//! without ever entering a file system mounted on them, so these calls run inline on the
//! async worker.
//!
//! A `stat` of a mount point crosses into the mounted file system and asks it for the
//! attributes of its root: over a hung NFS server that never returns, and the worker that
//! made the call stalls with every task queued on it. That is why such calls went through
//! `crate::sys::blocking`, a thread hand-off each (docs/benchmarks.md, "Throughput"). The
//! calls here look only at the last component's entry in its parent, which is csi-agent's
//! own directory (`<mounts root>/<enc id>`):
//! - `mkdirat` on the parent's fd answers EEXIST for an existing name without looking inside;
//! - `openat2(O_PATH | O_NOFOLLOW, RESOLVE_NO_XDEV)` from the parent's fd refuses with EXDEV
//!   to cross into a mount on the name, before the mounted file system is asked anything;
//! - `rmdir` looks its last component up without crossing a mount on it and answers EBUSY
//!   for a mount point.
//!
//! A block volume's target is a file, not a directory (the device node is bind-mounted on
//! it): [`ensure_file`] makes one where the CO creates the target, and [`remove`] removes an
//! empty regular file as it removes an empty directory. Neither ever deletes a device node,
//! a file with data, or anything something is mounted on.
//!
//! It must only be used for paths whose parent is csi-agent's own directory (a workload's
//! `bind_to` goes through `crate::beneath`), and must not mount or unmount anything.

use std::io;
use std::os::fd::OwnedFd;
use std::path::Path;

use rustix::fs::{AtFlags, FileType, Mode, OFlags, ResolveFlags, StatxFlags};
use rustix::io::Errno;

use super::VolumeError;

/// What is at a staging or target path, seen from its parent.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Entry {
    Missing,
    /// Something is mounted on the name (what is not looked at).
    MountPoint,
    Directory,
    /// A file, symlink, socket...: not what CSI's paths may be.
    Other,
}

/// What [`remove`] found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Removed {
    /// An empty directory, now gone.
    Removed,
    Missing,
    /// Something is mounted on it: left in place.
    MountPoint,
}

fn io_error(path: &Path, source: impl Into<io::Error>) -> VolumeError {
    VolumeError::Io {
        path: path.to_path_buf(),
        source: source.into(),
    }
}

/// The parent's directory fd and the last component.
fn split(path: &Path) -> Result<(OwnedFd, &std::ffi::OsStr), VolumeError> {
    let (Some(parent), Some(name)) = (path.parent(), path.file_name()) else {
        return Err(io_error(
            path,
            io::Error::new(io::ErrorKind::InvalidInput, "no parent or no name"),
        ));
    };
    let parent_fd = rustix::fs::open(
        parent,
        OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .map_err(|errno| io_error(parent, errno))?;
    Ok((parent_fd, name))
}

/// Looks at `path` without entering a mount on it.
pub fn probe(path: &Path) -> Result<Entry, VolumeError> {
    let (parent, name) = match split(path) {
        Ok(split) => split,
        Err(VolumeError::Io { source, .. }) if source.kind() == io::ErrorKind::NotFound => {
            return Ok(Entry::Missing);
        }
        Err(err) => return Err(err),
    };
    probe_at(&parent, name, path)
}

fn probe_at(parent: &OwnedFd, name: &std::ffi::OsStr, path: &Path) -> Result<Entry, VolumeError> {
    let opened = rustix::fs::openat2(
        parent,
        name,
        OFlags::PATH | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::empty(),
        ResolveFlags::NO_XDEV,
    );
    let fd = match opened {
        Ok(fd) => fd,
        Err(Errno::NOENT) => return Ok(Entry::Missing),
        Err(Errno::XDEV) => return Ok(Entry::MountPoint),
        Err(errno) => return Err(io_error(path, errno)),
    };
    // The fd is the name's own inode on the parent's file system (no mount was crossed).
    let stat = rustix::fs::statx(
        &fd,
        "",
        AtFlags::EMPTY_PATH | AtFlags::SYMLINK_NOFOLLOW,
        StatxFlags::TYPE,
    )
    .map_err(|errno| io_error(path, errno))?;
    Ok(match FileType::from_raw_mode(u32::from(stat.stx_mode)) {
        FileType::Directory => Entry::Directory,
        _ => Entry::Other,
    })
}

/// `create_dir_all` for csi-agent's own directories only (the mounts root,
/// `<mounts root>/<enc id>`), which no plugin mounts on: a lookup there stays on csi-agent's
/// file system. Looked at first: a mkdir that finds the dir there (EEXIST) still takes its
/// parent's lock and a journal handle; a lookup does neither.
pub fn ensure_own_dir(path: &Path) -> Result<(), VolumeError> {
    if path.is_dir() {
        return Ok(());
    }
    std::fs::create_dir_all(path).map_err(|source| io_error(path, source))
}

/// Makes sure `path` is a directory (or something mounted on one), creating it — and its
/// parents, which must be csi-agent's own — if needed.
pub fn ensure_dir(path: &Path) -> Result<(), VolumeError> {
    if let Some(parent) = path.parent() {
        ensure_own_dir(parent)?;
    }
    let (parent, name) = split(path)?;
    match rustix::fs::mkdirat(&parent, name, Mode::from_raw_mode(0o777)) {
        Ok(()) => Ok(()),
        Err(Errno::EXIST) => match probe_at(&parent, name, path)? {
            Entry::Directory | Entry::MountPoint => Ok(()),
            Entry::Missing => Err(io_error(
                path,
                io::Error::other("removed while it was being created; retry"),
            )),
            Entry::Other => Err(io_error(
                path,
                io::Error::new(
                    io::ErrorKind::AlreadyExists,
                    "exists and is not a directory",
                ),
            )),
        },
        Err(errno) => Err(io_error(path, errno)),
    }
}

/// Makes sure `path` is a regular file (or something mounted on one): a block volume's
/// target where the CO creates it (CSI 0.x, `target_path_exists`). Its parent must be
/// csi-agent's own (created if needed). `O_CREAT|O_EXCL` follows no symlink and replaces
/// nothing; an existing directory, symlink or device node is refused.
pub fn ensure_file(path: &Path) -> Result<(), VolumeError> {
    if let Some(parent) = path.parent() {
        ensure_own_dir(parent)?;
    }
    let (parent, name) = split(path)?;
    let created = rustix::fs::openat(
        &parent,
        name,
        OFlags::CREATE | OFlags::EXCL | OFlags::WRONLY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::from_raw_mode(0o600),
    );
    match created {
        Ok(_) => Ok(()),
        Err(Errno::EXIST) => match probe_at(&parent, name, path)? {
            Entry::MountPoint => Ok(()),
            _ if is_regular_file_at(&parent, name) => Ok(()),
            _ => Err(io_error(
                path,
                io::Error::new(
                    io::ErrorKind::AlreadyExists,
                    "exists and is not a regular file (a block volume's target is a file)",
                ),
            )),
        },
        Err(errno) => Err(io_error(path, errno)),
    }
}

/// Whether `name` in `parent` is a regular file (not followed; only called once
/// [`probe_at`] said nothing is mounted on it, so the `stat` stays on the parent's file
/// system). Returns its size too.
fn regular_file_size_at(parent: &OwnedFd, name: &std::ffi::OsStr) -> Option<u64> {
    rustix::fs::statat(parent, name, AtFlags::SYMLINK_NOFOLLOW)
        .ok()
        .filter(|st| FileType::from_raw_mode(st.st_mode) == FileType::RegularFile)
        .and_then(|st| u64::try_from(st.st_size).ok())
}

fn is_regular_file_at(parent: &OwnedFd, name: &std::ffi::OsStr) -> bool {
    regular_file_size_at(parent, name).is_some()
}

/// Removes `path` if it is an empty directory that nothing is mounted on — or, for a block
/// volume's target, an empty regular file that nothing is mounted on. A non-empty directory,
/// a file with data, a device node or a symlink is an error; nothing here can delete data.
pub fn remove(path: &Path) -> Result<Removed, VolumeError> {
    match std::fs::remove_dir(path) {
        Ok(()) => Ok(Removed::Removed),
        Err(err) if err.kind() == io::ErrorKind::NotFound => Ok(Removed::Missing),
        Err(err) if err.raw_os_error() == Some(Errno::BUSY.raw_os_error()) => {
            Ok(Removed::MountPoint)
        }
        // rmdir refuses a non-directory before it looks for a mount on it.
        Err(err) if err.raw_os_error() == Some(Errno::NOTDIR.raw_os_error()) => remove_file(path),
        Err(source) => Err(io_error(path, source)),
    }
}

/// The file half of [`remove`]: only an empty regular file goes, and `unlink` itself
/// refuses a mount point (EBUSY), closing the race with a mount made after the look.
fn remove_file(path: &Path) -> Result<Removed, VolumeError> {
    let (parent, name) = split(path)?;
    match probe_at(&parent, name, path)? {
        Entry::Missing => return Ok(Removed::Missing),
        Entry::MountPoint => return Ok(Removed::MountPoint),
        Entry::Directory | Entry::Other => {}
    }
    if regular_file_size_at(&parent, name) != Some(0) {
        return Err(io_error(
            path,
            io::Error::other(
                "is not an empty regular file (a device node, a symlink or a file with data is never deleted); left in place",
            ),
        ));
    }
    match rustix::fs::unlinkat(&parent, name, AtFlags::empty()) {
        Ok(()) => Ok(Removed::Removed),
        Err(Errno::NOENT) => Ok(Removed::Missing),
        Err(Errno::BUSY) => Ok(Removed::MountPoint),
        Err(errno) => Err(io_error(path, errno)),
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn file_targets_are_created_and_only_empty_regular_files_removed() {
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("vol/target");
        ensure_file(&target).unwrap();
        assert!(target.is_file());
        ensure_file(&target).unwrap();
        std::fs::write(&target, b"data").unwrap();
        assert!(
            remove(&target).is_err(),
            "a file with data is never deleted"
        );
        assert!(target.exists());
        std::fs::write(&target, b"").unwrap();
        assert_eq!(remove(&target).unwrap(), Removed::Removed);
        assert_eq!(remove(&target).unwrap(), Removed::Missing);
        // A symlink (to a file or a device) is neither created through nor deleted.
        std::os::unix::fs::symlink("/dev/null", &target).unwrap();
        assert!(ensure_file(&target).is_err());
        assert!(remove(&target).is_err());
        assert!(std::fs::symlink_metadata(&target).is_ok());
        std::fs::remove_file(&target).unwrap();
        // An existing directory is not a file target.
        std::fs::create_dir(&target).unwrap();
        assert!(ensure_file(&target).is_err());
    }

    #[test]
    fn probes_and_creates_without_a_mount() {
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("vol/target");
        assert_eq!(probe(&target).unwrap(), Entry::Missing);
        ensure_dir(&target).unwrap();
        assert_eq!(probe(&target).unwrap(), Entry::Directory);
        ensure_dir(&target).unwrap();
        assert_eq!(remove(&target).unwrap(), Removed::Removed);
        assert_eq!(remove(&target).unwrap(), Removed::Missing);

        let file = dir.path().join("vol/file");
        std::fs::write(&file, b"x").unwrap();
        assert_eq!(probe(&file).unwrap(), Entry::Other);
        let err = ensure_dir(&file).unwrap_err();
        assert!(err.to_string().contains("not a directory"), "{err}");
        assert!(remove(&file).is_err());

        let link = dir.path().join("vol/link");
        std::os::unix::fs::symlink(dir.path(), &link).unwrap();
        assert_eq!(probe(&link).unwrap(), Entry::Other);
        assert!(ensure_dir(&link).is_err());

        let full = dir.path().join("vol/full");
        std::fs::create_dir_all(full.join("data")).unwrap();
        assert!(remove(&full).is_err());
        assert!(full.join("data").is_dir());
    }

    /// A tmpfs mounted on the target is reported as a mount point — the probe did not enter
    /// it (entering would have shown the tmpfs root, a directory) — and survives a remove.
    #[test]
    fn a_mount_on_the_path_is_seen_from_the_parent_and_left_alone() {
        crate::mounts::require_private_mount_namespace();
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("vol/target");
        ensure_dir(&target).unwrap();
        crate::mounts::mount_test_tmpfs(&target);
        std::fs::write(target.join("data"), b"kept").unwrap();
        assert_eq!(probe(&target).unwrap(), Entry::MountPoint);
        ensure_dir(&target).unwrap();
        assert_eq!(remove(&target).unwrap(), Removed::MountPoint);
        assert_eq!(std::fs::read(target.join("data")).unwrap(), b"kept");
        rustix::mount::unmount(&target, rustix::mount::UnmountFlags::empty()).unwrap();
        assert_eq!(probe(&target).unwrap(), Entry::Directory);
        assert_eq!(remove(&target).unwrap(), Removed::Removed);
    }
}
