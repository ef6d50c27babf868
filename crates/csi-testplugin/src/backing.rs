//! Where a volume's data lives: a plain directory (the default), or with
//! `--volume-fs tmpfs` a tmpfs of the volume's own capacity mounted on that
//! directory, so that the volume has a file system of its own: `statvfs`
//! of it reports the volume's bytes and inodes (not the host's), and growing
//! the volume really grows its file system (`remount,size=`).
//!
//! Owns: making, resizing and releasing a volume's backing at
//! `<work-dir>/volumes/<id>`. Must not: decide when (that is `plugin.rs`,
//! which records the volume before making its backing and forgets it only
//! after releasing it), or delete any data (deletion renames the released
//! directory into the trash, as for a plain directory).
//!
//! A tmpfs lives in memory: after a reboot (or in a new mount namespace) a
//! recorded volume's tmpfs is mounted again, empty, and this is logged.

use std::ffi::CString;
use std::io;
use std::path::Path;

use rustix::mount::{MountFlags, UnmountFlags};

use crate::mounts;

/// What backs each volume's directory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum VolumeFs {
    /// A directory on the work dir's file system (the default; no root needed).
    Dir,
    /// A tmpfs of the volume's capacity on that directory (needs `CAP_SYS_ADMIN`).
    Tmpfs,
}

/// tmpfs wants a size of at least one page; a zero-byte volume gets one.
fn tmpfs_size(capacity_bytes: i64) -> u64 {
    u64::try_from(capacity_bytes).unwrap_or(0).max(4096)
}

/// Makes `dir` (an existing one is fine: a crash may have left it) and, for
/// a tmpfs backing, mounts the tmpfs unless one is already there. Idempotent,
/// so that a CreateVolume re-issued after a crash between the two steps
/// finishes the volume.
pub fn make(dir: &Path, fs: VolumeFs, capacity_bytes: i64) -> io::Result<()> {
    match std::fs::create_dir(dir) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(e),
    }
    if fs == VolumeFs::Dir || mounts::is_mount_point(dir)? {
        return Ok(());
    }
    let data = CString::new(format!("size={},mode=0755", tmpfs_size(capacity_bytes)))
        .map_err(io::Error::other)?;
    let flags = MountFlags::NOSUID | MountFlags::NODEV;
    rustix::mount::mount("csi-testplugin", dir, "tmpfs", flags, Some(data.as_c_str()))?;
    Ok(())
}

/// Sets the file system of a tmpfs-backed volume to `capacity_bytes`; the
/// data stays. A plain directory has no size of its own: nothing to do.
pub fn resize(dir: &Path, fs: VolumeFs, capacity_bytes: i64) -> io::Result<()> {
    if fs == VolumeFs::Dir {
        return Ok(());
    }
    if !mounts::is_mount_point(dir)? {
        return Err(io::Error::other(format!(
            "{} should be the volume's tmpfs but nothing is mounted there",
            dir.display()
        )));
    }
    let data = format!("size={}", tmpfs_size(capacity_bytes));
    rustix::mount::mount_remount(dir, MountFlags::NOSUID | MountFlags::NODEV, data.as_str())?;
    Ok(())
}

/// Unmounts a tmpfs backing so that the directory can be renamed into the
/// trash. Not mounted is success. Never detaches lazily: a tmpfs still
/// bind-mounted elsewhere keeps its data, and the caller has already refused
/// a volume in use.
pub fn release(dir: &Path, fs: VolumeFs) -> io::Result<()> {
    if fs == VolumeFs::Dir {
        return Ok(());
    }
    match rustix::mount::unmount(dir, UnmountFlags::empty()) {
        Ok(()) => Ok(()),
        Err(rustix::io::Errno::INVAL) | Err(rustix::io::Errno::NOENT) => Ok(()),
        Err(e) => Err(e.into()),
    }
}
