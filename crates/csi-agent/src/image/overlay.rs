//! overlayfs mounts of image layers: a container's root file system made of the image's
//! layer directories (read-only lowers, each unpacked once in the store and shared by every
//! image and container that has the layer) and an upper and work directory of its own.
//!
//! It owns the mount and unmount syscalls and the probe that tells whether the host can
//! do it. It must not decide where the directories are (the store and the runtime say),
//! nor when to mount or unmount.
//!
//! Every directory is handed to the kernel as `/proc/self/fd/<n>` of an `O_PATH` fd opened
//! here: the mount data stays short however long the work dir's path is (a page holds
//! about 200 such lowers; overlayfs itself stacks at most 500), and no path needs the
//! escaping overlayfs would want for `:` or `,`.

use std::os::fd::{AsFd, OwnedFd};
use std::path::{Path, PathBuf};

use rustix::fs::{Mode, OFlags};
use rustix::io::Errno;
use rustix::mount::{MountFlags, UnmountFlags};

use crate::beneath;

/// The most lower layers one mount takes (overlayfs's own limit, `OVL_MAX_STACK`).
pub const MAX_LOWERS: usize = 500;
/// The file system type in the mount table.
pub const FS_TYPE: &str = "overlay";

/// Why an overlay mount could not be made or removed.
#[derive(Debug, thiserror::Error)]
pub enum OverlayError {
    #[error("overlay: cannot open {}: {source}", path.display())]
    Open {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("overlay: {count} layers, more than overlayfs stacks ({MAX_LOWERS})")]
    TooManyLayers { count: usize },
    #[error("overlay: an image with no layers has no root file system")]
    NoLayers,
    #[error("overlay: mount at {}: {source}", target.display())]
    Mount {
        target: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("overlay: unmount {}: {source}", target.display())]
    Unmount {
        target: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

fn open_path(path: &Path) -> Result<OwnedFd, OverlayError> {
    rustix::fs::open(
        path,
        OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .map_err(|errno| OverlayError::Open {
        path: path.to_path_buf(),
        source: errno.into(),
    })
}

/// Mounts at `target` the overlay of `lowers` (bottom layer first, as an image lists them)
/// under `upper` (with its `work` dir on the same file system); `upper: None` makes a
/// read-only stack of the lowers alone.
pub fn mount(
    lowers: &[PathBuf],
    upper: Option<(&Path, &Path)>,
    target: &Path,
) -> Result<(), OverlayError> {
    if lowers.is_empty() {
        return Err(OverlayError::NoLayers);
    }
    if lowers.len() > MAX_LOWERS {
        return Err(OverlayError::TooManyLayers {
            count: lowers.len(),
        });
    }
    // overlayfs lists the top layer first.
    let lower_fds = lowers
        .iter()
        .rev()
        .map(|path| open_path(path))
        .collect::<Result<Vec<_>, _>>()?;
    let mut data = String::from("lowerdir=");
    for (index, fd) in lower_fds.iter().enumerate() {
        if index > 0 {
            data.push(':');
        }
        data.push_str(&beneath::fd_path(fd.as_fd()).to_string_lossy());
    }
    let upper_fds = match upper {
        Some((upper, work)) => Some((open_path(upper)?, open_path(work)?)),
        None => None,
    };
    if let Some((upper, work)) = &upper_fds {
        data.push_str(",upperdir=");
        data.push_str(&beneath::fd_path(upper.as_fd()).to_string_lossy());
        data.push_str(",workdir=");
        data.push_str(&beneath::fd_path(work.as_fd()).to_string_lossy());
    }
    let flags = if upper_fds.is_none() {
        MountFlags::RDONLY
    } else {
        MountFlags::empty()
    };
    // Paths from `fd_path` and the fixed option names hold no NUL.
    let data = std::ffi::CString::new(data).map_err(|err| OverlayError::Mount {
        target: target.to_path_buf(),
        source: std::io::Error::other(err.to_string()),
    })?;
    rustix::mount::mount(FS_TYPE, target, FS_TYPE, flags, data.as_c_str()).map_err(|errno| {
        OverlayError::Mount {
            target: target.to_path_buf(),
            source: errno.into(),
        }
    })
}

/// Unmounts the overlay at `target` if the mount table has one there (an operator's mount of
/// another type there is left alone). True when one was unmounted.
pub fn unmount_if_mounted(target: &Path) -> Result<bool, OverlayError> {
    let table = crate::mounts::MountTable::read().map_err(|err| OverlayError::Unmount {
        target: target.to_path_buf(),
        source: std::io::Error::other(err.to_string()),
    })?;
    let ours = table
        .entries()
        .iter()
        .any(|m| m.mount_point == target && m.fs_type == FS_TYPE);
    if !ours {
        return Ok(false);
    }
    // Detached: the container that used it is gone, but a process that still holds a
    // file open in it must not keep the next launch from mounting afresh.
    match rustix::mount::unmount(target, UnmountFlags::DETACH | UnmountFlags::NOFOLLOW) {
        Ok(()) => Ok(true),
        // Gone meanwhile: what was asked for.
        Err(Errno::INVAL) if !still_mounted(target) => Ok(true),
        Err(errno) => Err(OverlayError::Unmount {
            target: target.to_path_buf(),
            source: errno.into(),
        }),
    }
}

fn still_mounted(target: &Path) -> bool {
    crate::mounts::MountTable::read().is_ok_and(|t| t.is_mount_point_nofollow(target))
}

/// Whether overlay mounts of layers unpacked under `scratch` work on this host: overlayfs
/// present, the caller allowed to mount, `trusted.*` xattrs on `scratch`'s file system (for
/// opaque directories) and that file system usable as a layer (not itself an overlay).
/// Tried for real in a temp dir under `scratch`, which is removed. The reason when not.
pub fn probe(scratch: &Path) -> Result<(), ProbeError> {
    let dir = scratch.join(format!(".tmp-overlay-probe-{:016x}", rand::random::<u64>()));
    let result = probe_in(&dir);
    if let Err(err) = std::fs::remove_dir_all(&dir)
        && err.kind() != std::io::ErrorKind::NotFound
    {
        tracing::warn!(path = %dir.display(), %err, "cannot remove the overlay probe's dir");
    }
    result
}

/// Why overlay mounts do not work here ([`probe`]); the messages are the daemon's log reason
/// for unpacking flattened.
#[derive(Debug, thiserror::Error)]
pub enum ProbeError {
    #[error("mkdir {}: {source}", path.display())]
    Mkdir {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("the file system has no trusted.* xattrs: {0}")]
    NoTrustedXattrs(#[source] Errno),
    #[error(transparent)]
    Mount(#[from] OverlayError),
    #[error("unmount {}: {source}", path.display())]
    Unmount {
        path: PathBuf,
        #[source]
        source: Errno,
    },
    #[error("writing through the overlay: {0}")]
    Write(#[source] std::io::Error),
}

fn probe_in(dir: &Path) -> Result<(), ProbeError> {
    let [lower, upper, work, merged] = ["lower", "upper", "work", "merged"].map(|n| dir.join(n));
    let opaque = lower.join("opaque");
    for path in [&lower, &upper, &work, &merged] {
        std::fs::create_dir_all(path).map_err(|source| ProbeError::Mkdir {
            path: path.clone(),
            source,
        })?;
    }
    std::fs::create_dir(&opaque).map_err(|source| ProbeError::Mkdir {
        path: opaque.clone(),
        source,
    })?;
    rustix::fs::setxattr(
        &opaque,
        super::unpack::OVERLAY_OPAQUE_XATTR,
        b"y",
        rustix::fs::XattrFlags::empty(),
    )
    .map_err(ProbeError::NoTrustedXattrs)?;
    mount(std::slice::from_ref(&lower), Some((&upper, &work)), &merged)?;
    let written = std::fs::write(merged.join("probe"), b"ok");
    rustix::mount::unmount(&merged, UnmountFlags::DETACH).map_err(|source| {
        ProbeError::Unmount {
            path: merged.clone(),
            source,
        }
    })?;
    written.map_err(ProbeError::Write)
}
