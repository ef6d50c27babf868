//! The last component of a walk beneath a root that is a *file*, not a directory: a block
//! volume's `bind_to`, on which csi-agent bind-mounts the volume's device node.
//!
//! Owns: opening that node without following a symlink (the parent dirs walked by
//! [`super::open_dir`]), creating it as an empty regular file already marked as csi-agent's
//! (made under a temporary name, marked, renamed into place without replacing anything, as
//! [`super::mkdir_marked`] does for dirs), and removing it again only when it is that:
//! marked, empty, regular, and not a mount point.
//!
//! Must not: mount or unmount anything, delete a device node, a symlink, a directory, a
//! file with data or one csi-agent did not create, or follow a link of any kind.

use std::ffi::OsStr;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::Path;

use rustix::fs::{AtFlags, FileType, Mode, OFlags, RenameFlags, StatxFlags, XattrFlags};
use rustix::io::Errno;

use super::{BeneathError, CREATED_MARK, io_error, open_at, open_dir, resolve_flags};

/// What a file node walk found at the last component.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NodeKind {
    RegularFile,
    Directory,
    Symlink,
    /// A device node, FIFO or socket (or a device mounted on a file: see the identity's
    /// `mount_root`).
    Other,
}

/// An opened last component with its parent and what this walk created.
#[derive(Debug)]
pub struct OpenedNode {
    /// The parent directory (`None`: the root itself).
    pub parent: Option<OwnedFd>,
    /// `O_PATH` fd of the node itself (not followed).
    pub fd: OwnedFd,
    pub kind: NodeKind,
    /// Trailing parent dirs this walk created (as [`super::OpenedDir::created`]).
    pub created_dirs: usize,
    /// Whether this walk created the file.
    pub created_file: bool,
}

/// The parent of `relative` and its last name.
fn split(relative: &Path) -> Result<(&Path, &OsStr), BeneathError> {
    match (relative.parent(), relative.file_name()) {
        (Some(parent), Some(name)) => Ok((parent, name)),
        _ => Err(BeneathError::Invalid {
            path: relative.to_path_buf(),
            reason: "has no last component".to_owned(),
        }),
    }
}

/// The kind of what `fd` refers to (the fd itself, not followed).
pub fn node_kind(fd: BorrowedFd<'_>, at: &Path) -> Result<NodeKind, BeneathError> {
    let stat = rustix::fs::statx(
        fd,
        "",
        AtFlags::EMPTY_PATH | AtFlags::SYMLINK_NOFOLLOW,
        StatxFlags::TYPE,
    )
    .map_err(|errno| io_error("statx", at, errno))?;
    Ok(match FileType::from_raw_mode(u32::from(stat.stx_mode)) {
        FileType::RegularFile => NodeKind::RegularFile,
        FileType::Directory => NodeKind::Directory,
        FileType::Symlink => NodeKind::Symlink,
        _ => NodeKind::Other,
    })
}

/// Walks to `relative`'s parent beneath `root_fd` (creating missing dirs with `create`) and
/// opens its last component without following it. With `create`, a missing last component
/// is created as an empty regular file marked as csi-agent's.
pub fn open_node(
    root_fd: BorrowedFd<'_>,
    root_path: &Path,
    relative: &Path,
    create: Option<Mode>,
) -> Result<OpenedNode, BeneathError> {
    let (parent_rel, name) = split(relative)?;
    let (parent, created_dirs) = if parent_rel.as_os_str().is_empty() {
        (None, 0)
    } else {
        let opened = open_dir(root_fd, root_path, parent_rel, create)?;
        (Some(opened.fd), opened.created)
    };
    let dir = parent.as_ref().map_or(root_fd, |fd| fd.as_fd());
    let at = root_path.join(relative);
    let mut created_file = false;
    let fd = match open_at(dir, name, OFlags::PATH, &at, root_path) {
        Ok(fd) => fd,
        Err(BeneathError::NotFound { .. }) if create.is_some() => {
            match create_file_marked(dir, name) {
                Ok(()) => created_file = true,
                // Made by someone else meanwhile: used, never removed as ours.
                Err(Errno::EXIST) => {}
                Err(errno) => return Err(io_error("create", &at, errno)),
            }
            open_at(dir, name, OFlags::PATH, &at, root_path)?
        }
        Err(err) => return Err(err),
    };
    let kind = node_kind(fd.as_fd(), &at)?;
    Ok(OpenedNode {
        parent,
        fd,
        kind,
        created_dirs,
        created_file,
    })
}

/// Creates the empty file `name` in `parent`, marked as created by csi-agent, without ever
/// having it unmarked under its real name. `EEXIST`: someone else made `name` first.
fn create_file_marked(parent: BorrowedFd<'_>, name: &OsStr) -> Result<(), Errno> {
    use std::sync::atomic::{AtomicU64, Ordering};
    static SEQUENCE: AtomicU64 = AtomicU64::new(0);
    // `.f<n>`: never the name of a dir `mkdir_marked` is making at the same moment.
    let temp = format!(
        "{}{}.f{}",
        super::NEW_DIR_PREFIX,
        super::new_dir_token(),
        SEQUENCE.fetch_add(1, Ordering::Relaxed)
    );
    let fd = rustix::fs::openat(
        parent,
        temp.as_str(),
        OFlags::CREATE | OFlags::EXCL | OFlags::RDWR | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::from_raw_mode(0o600),
    )?;
    if let Err(errno) = rustix::fs::fsetxattr(&fd, CREATED_MARK, b"1", XattrFlags::empty()) {
        tracing::debug!(file = ?name, %errno, "file created for bind_to not marked");
    }
    drop(fd);
    let renamed =
        rustix::fs::renameat_with(parent, temp.as_str(), parent, name, RenameFlags::NOREPLACE);
    if renamed.is_err() {
        let _ = rustix::fs::unlinkat(parent, temp.as_str(), AtFlags::empty());
    }
    renamed
}

/// Removes the file at `relative` beneath `root_fd` if csi-agent created it (`created`, or
/// marked so) and it is still an empty regular file that nothing is mounted on; then the
/// last `created_dirs` parent dirs as [`super::remove_trailing_dirs`] does. Anything else
/// at the path is left alone, quietly: it is not ours.
pub fn remove_created_file(
    root_fd: BorrowedFd<'_>,
    root_path: &Path,
    relative: &Path,
    created: bool,
    created_dirs: usize,
) -> Result<(), BeneathError> {
    let (parent_rel, name) = split(relative)?;
    let parent = if parent_rel.as_os_str().is_empty() {
        None
    } else {
        match open_dir(root_fd, root_path, parent_rel, None) {
            Ok(opened) => Some(opened.fd),
            Err(BeneathError::NotFound { .. }) => return Ok(()),
            Err(err) => return Err(err),
        }
    };
    let dir = parent.as_ref().map_or(root_fd, |fd| fd.as_fd());
    let at = root_path.join(relative);
    // NO_XDEV: a mount on the name is refused before its file system is asked anything.
    let opened = rustix::fs::openat2(
        dir,
        name,
        OFlags::RDONLY | OFlags::NONBLOCK | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::empty(),
        resolve_flags() | rustix::fs::ResolveFlags::NO_XDEV,
    );
    let removable = match opened {
        Ok(fd) => {
            let stat = rustix::fs::fstat(&fd).map_err(|errno| io_error("stat", &at, errno))?;
            let mut value = [0u8; 1];
            let marked = matches!(
                rustix::fs::fgetxattr(&fd, CREATED_MARK, &mut value),
                Ok(1) if value == *b"1"
            );
            FileType::from_raw_mode(stat.st_mode) == FileType::RegularFile
                && stat.st_size == 0
                && (created || marked)
        }
        Err(_) => false,
    };
    if removable {
        match rustix::fs::unlinkat(dir, name, AtFlags::empty()) {
            // EBUSY: mounted on meanwhile; not ours to take away.
            Ok(()) | Err(Errno::NOENT | Errno::BUSY) => {}
            Err(errno) => return Err(io_error("unlink", &at, errno)),
        }
    }
    if !parent_rel.as_os_str().is_empty() {
        super::remove_trailing_dirs(root_fd, root_path, parent_rel, created_dirs)?;
    }
    Ok(())
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn creates_a_marked_file_refuses_links_and_removes_only_what_it_made() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        let root_fd = super::super::open_root(root).unwrap();
        let rel = Path::new("w1/dev");
        let opened = open_node(root_fd.as_fd(), root, rel, Some(Mode::RWXU)).unwrap();
        assert_eq!(opened.kind, NodeKind::RegularFile);
        assert!(opened.created_file);
        assert_eq!(opened.created_dirs, 1);
        drop(opened);
        assert!(root.join("w1/dev").is_file());
        // Opened again: there already, not created by this walk.
        let again = open_node(root_fd.as_fd(), root, rel, Some(Mode::RWXU)).unwrap();
        assert!(!again.created_file);
        drop(again);
        remove_created_file(root_fd.as_fd(), root, rel, false, 1).unwrap();
        assert!(
            !root.join("w1").exists(),
            "marked file and created dir removed"
        );

        // A symlink at the last component is opened as itself, never followed.
        std::fs::create_dir(root.join("w2")).unwrap();
        std::os::unix::fs::symlink("/dev/null", root.join("w2/dev")).unwrap();
        let link = open_node(root_fd.as_fd(), root, Path::new("w2/dev"), Some(Mode::RWXU));
        assert!(matches!(link, Ok(ref o) if o.kind == NodeKind::Symlink) || link.is_err());
        // A file the workload made (unmarked, with data) is never removed.
        std::fs::write(root.join("w2/data"), b"x").unwrap();
        remove_created_file(root_fd.as_fd(), root, Path::new("w2/data"), true, 0).unwrap();
        assert!(root.join("w2/data").exists());
        std::fs::write(root.join("w2/empty"), b"").unwrap();
        remove_created_file(root_fd.as_fd(), root, Path::new("w2/empty"), false, 0).unwrap();
        assert!(
            root.join("w2/empty").exists(),
            "unmarked and not created: kept"
        );
        remove_created_file(root_fd.as_fd(), root, Path::new("w2/dev"), true, 0).unwrap();
        assert!(
            std::fs::symlink_metadata(root.join("w2/dev")).is_ok(),
            "symlink kept"
        );
    }
}
