//! `bind_to` for a block volume: the volume's target is a file with the device node mounted
//! on it, so its bind goes onto a *file* beneath the bind root.
//!
//! Owns: walking to that file (parents as for a dir bind, the file itself opened without
//! following it, created empty and marked when missing), refusing what is not a plain file
//! there (a directory, a symlink, a device node, a FIFO), and mounting the target's clone
//! onto the walked fd, read-only when asked.
//!
//! Must not: change the rules of the dir case (`super`), delete or open for I/O anything at
//! the path, or decide when to bind (the volume manager does). Read-only here is the
//! mount's flag; what stops writes to a block device is the device's own read-only flag,
//! which is the plugin's to set (a read-only mount does not stop writes to a device node).

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::Path;

use rustix::fs::Mode;

use super::{BindError, BindMount, BindOwner, Binder, Walked};
use crate::beneath::{self, BeneathError, Identity, NodeKind};

/// Whether what is at `relative` beneath `root_fd` is a block volume's bind: a file, or a
/// device mounted on one. Missing or a directory: the dir case.
pub(super) fn is_file_bind(root_fd: BorrowedFd<'_>, root: &Path, relative: &Path) -> bool {
    beneath::open_node(root_fd, root, relative, None)
        .is_ok_and(|opened| matches!(opened.kind, NodeKind::RegularFile | NodeKind::Other))
}

/// The fd of what is at `relative` now (a dir, or with `file` the node itself), to identify it.
pub(super) fn walk(
    root_fd: BorrowedFd<'_>,
    root: &Path,
    relative: &Path,
    file: bool,
) -> Result<OwnedFd, BeneathError> {
    if file {
        beneath::open_node(root_fd, root, relative, None).map(|opened| opened.fd)
    } else {
        beneath::open_dir(root_fd, root, relative, None).map(|opened| opened.fd)
    }
}

impl Binder {
    /// [`Binder::ensure`] for a file target (`source`, identified as `source_id`).
    pub(super) fn ensure_file(
        &self,
        bind: &BindMount,
        source: &OwnedFd,
        source_id: &Identity,
        readonly: bool,
        boot_id: &str,
        owner: &BindOwner,
    ) -> Result<BindMount, BindError> {
        let (root, relative) = self.check(&bind.path)?;
        let walk_err = |source| BindError::Walk {
            path: bind.path.clone(),
            source,
        };
        let root_fd = beneath::open_root(&root).map_err(walk_err)?;
        let opened = beneath::open_node(
            root_fd.as_fd(),
            &root,
            &relative,
            Some(Mode::from_raw_mode(0o755)),
        )
        .map_err(walk_err)?;
        // Whatever is refused below leaves nothing this call created.
        let undo = |opened: beneath::OpenedNode| {
            let (created_file, created_dirs) = (opened.created_file, opened.created_dirs);
            drop(opened);
            if (created_file || created_dirs > 0)
                && let Err(err) = beneath::remove_created_file(
                    root_fd.as_fd(),
                    &root,
                    &relative,
                    created_file,
                    created_dirs,
                )
            {
                tracing::warn!(bind_to = ?bind.path, error = %err, "file created for a refused bind_to left in place");
            }
        };
        let mut recorded = bind.clone();
        recorded.created_dirs = recorded.created_dirs.max(opened.created_dirs);
        let parent_id = match &opened.parent {
            Some(fd) => self.identity(fd, &bind.path)?,
            None => self.identity(&root_fd, &root)?,
        };
        let here = self.identity(&opened.fd, &bind.path)?;
        if let Err(err) = self.refuse_forbidden_inode(&bind.path, &parent_id) {
            undo(opened);
            return Err(err);
        }
        // The parent dir is, or lies in, another claim's bind: neither mount there nor adopt.
        let holder = self
            .mount_holder(parent_id.mount_id, owner)
            .map(|h| (h, parent_id.mount_id))
            .or_else(|| {
                here.mount_root
                    .then(|| self.mount_holder(here.mount_id, owner))
                    .flatten()
                    .map(|h| (h, here.mount_id))
            });
        if let Some((holder, mount_id)) = holder {
            undo(opened);
            return Err(BindError::InsideOtherBind {
                path: bind.path.clone(),
                owner: holder,
                mount_id,
            });
        }
        if here.mount_root {
            if here.same_inode(source_id) {
                // Our own bind, made before a crash or noted under another id: adopt it.
                recorded.mount_id = Some(here.mount_id);
                recorded.boot_id = Some(boot_id.to_owned());
                self.note_mount(&bind.path, owner, here.mount_id);
                return Ok(recorded);
            }
            return Err(BindError::AlreadyMounted {
                path: bind.path.clone(),
                mount_id: here.mount_id,
            });
        }
        let found = match opened.kind {
            NodeKind::RegularFile => None,
            NodeKind::Directory => Some("an existing directory"),
            NodeKind::Other => Some("a device node, FIFO or socket"),
            NodeKind::Symlink => Some("a symlink"),
        };
        if let Some(found) = found {
            let err = if opened.kind == NodeKind::Symlink {
                walk_err(BeneathError::Symlink {
                    at: bind.path.clone(),
                    root: root.clone(),
                })
            } else {
                BindError::NotAFile {
                    path: bind.path.clone(),
                    found,
                }
            };
            undo(opened);
            return Err(err);
        }
        if let Err(err) = self.refuse_moved(bind, boot_id, source_id) {
            undo(opened);
            return Err(err);
        }
        let (created_file, created_dirs) = (opened.created_file, opened.created_dirs);
        let onto = opened.fd;
        drop(opened.parent);
        let walked = Walked {
            root_fd: root_fd.as_fd(),
            root: &root,
            relative: &relative,
            file: true,
        };
        let attached = match self.attach(bind, source, onto, &walked, readonly) {
            Ok(mount_id) => mount_id,
            Err(err) => {
                if let Err(undo_err) = beneath::remove_created_file(
                    root_fd.as_fd(),
                    &root,
                    &relative,
                    created_file,
                    created_dirs,
                ) {
                    tracing::warn!(bind_to = ?bind.path, error = %undo_err, "file created for a failed bind_to left in place");
                }
                return Err(err);
            }
        };
        recorded.mount_id = Some(attached);
        recorded.boot_id = Some(boot_id.to_owned());
        self.note_mount(&bind.path, owner, attached);
        Ok(recorded)
    }
}
