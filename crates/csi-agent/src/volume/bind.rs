//! Workload bind mounts (`bind_to`): where they may go, mounting them through fds, and
//! unmounting exactly what was mounted.
//!
//! A `bind_to` path comes from the workload launcher and names a place inside a workload's
//! sandbox, a tree the workload itself may be able to write: it is hostile input. The rules
//! (docs/design.md, "Trust"):
//! - a `bind_to` must lie beneath one of the operator's `--bind-root` dirs (none configured:
//!   every `bind_to` is refused), must be normalised, and must not be, contain or lie inside
//!   the work dir, a plugin's mount root or another claim's `bind_to`;
//! - the walked dir must not lie in a mount csi-agent made for another claim (a workload may
//!   have moved its bind elsewhere beneath the root): a mount inside it would make that
//!   workload's unpublish fail with EBUSY, and its dirs would be created inside the volume;
//! - the path is walked beneath its root without following any symlink
//!   ([`crate::beneath`]); missing dirs are created on the way and counted, so that unbinding
//!   removes exactly those;
//! - the volume's target is cloned with `open_tree(OPEN_TREE_CLONE)` and attached with
//!   `move_mount` onto the walked fd: no path string is resolved again between the check and
//!   the mount;
//! - a `bind_to` that is already a mount point is refused unless that mount is this volume's
//!   own bind (its root is the target's inode), which is then adopted;
//! - the mount id is recorded, and unbinding unmounts only the mount with that id (or, when
//!   the id was never noted, a mount whose root is the target's inode) through
//!   `/proc/self/fd/N` of a freshly walked fd. A bind whose path changed since (a component
//!   swapped for a symlink, a dir renamed) is found in the mount table by its id; if it now
//!   lies outside the bind roots it is left alone and the unpublish fails loudly rather than
//!   unmounting something else.
//!
//! A block volume's target is a file with the device node mounted on it: its `bind_to` is
//! a file too, created beneath the root the same way (`file.rs`); the rules above hold for
//! it unchanged.
//!
//! It must not decide *when* to bind or unbind (the volume manager does) and must not touch
//! anything outside the bind roots.

use std::collections::{BTreeMap, HashMap};
use std::ops::Bound;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use rustix::fs::Mode;
use serde::{Deserialize, Serialize};

use crate::beneath::{self, BeneathError, Identity};
use crate::mounts::{HostMounter, Mounter};

mod file;

/// How many of our own stacked binds one unbind peels off a path before giving up.
const MAX_STACKED_BINDS: usize = 8;

/// One workload's bind mount of a volume, as recorded with its claim.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct BindMount {
    /// The `bind_to` path, as the request gave it (normalised; checked again at every use).
    pub path: PathBuf,
    /// The id of the mount csi-agent made there (`/proc/self/mountinfo`'s first field);
    /// `None` until the mount was made and noted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mount_id: Option<u64>,
    /// The boot `mount_id` belongs to: ids are reused after a reboot.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub boot_id: Option<String>,
    /// How many trailing components of `path` csi-agent created (removed with the bind).
    #[serde(default)]
    pub created_dirs: usize,
}

impl BindMount {
    pub fn new(path: PathBuf) -> Self {
        Self {
            path,
            mount_id: None,
            boot_id: None,
            created_dirs: 0,
        }
    }
}

/// Records of the first release held the bare path; both forms are read.
impl<'de> Deserialize<'de> for BindMount {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        struct Full {
            path: PathBuf,
            #[serde(default)]
            mount_id: Option<u64>,
            #[serde(default)]
            boot_id: Option<String>,
            #[serde(default)]
            created_dirs: usize,
        }
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Either {
            Path(PathBuf),
            Full(Full),
        }
        Ok(match Either::deserialize(deserializer)? {
            Either::Path(path) => BindMount::new(path),
            Either::Full(f) => BindMount {
                path: f.path,
                mount_id: f.mount_id,
                boot_id: f.boot_id,
                created_dirs: f.created_dirs,
            },
        })
    }
}

/// Who holds a `bind_to` path.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BindOwner {
    pub plugin: String,
    pub volume_id: String,
    pub workload: String,
}

impl std::fmt::Display for BindOwner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "workload {:?} of volume {:?} (plugin {})",
            self.workload, self.volume_id, self.plugin
        )
    }
}

/// Why a bind was refused or failed.
#[derive(Debug, thiserror::Error)]
pub enum BindError {
    #[error(
        "bind_to is disabled on this node: start csi-agentd with --bind-root DIR (the dir under which workload sandboxes live) to allow it"
    )]
    Disabled,
    #[error("bind_to {} is not beneath a --bind-root of this daemon ({roots}): bind beneath one of them", path.display())]
    OutsideRoots { path: PathBuf, roots: String },
    #[error("bind_to {0}")]
    Invalid(#[source] BeneathError),
    #[error("bind_to {} {what} {}: choose another path", path.display(), other.display())]
    Forbidden {
        path: PathBuf,
        what: &'static str,
        other: PathBuf,
    },
    #[error("bind_to {} is already used by {owner}: every claim needs a path of its own", path.display())]
    InUse { path: PathBuf, owner: BindOwner },
    #[error(
        "bind_to {} lies in the bind mount csi-agent made for {owner} (mount {mount_id}, which that workload may have moved there): a mount in it would block that workload's unpublish; choose a path outside every other workload's bind",
        path.display()
    )]
    InsideOtherBind {
        path: PathBuf,
        owner: BindOwner,
        mount_id: u64,
    },
    #[error("bind_to {} is already a mount point of something else (mount {mount_id}); csi-agent mounts only onto a plain directory", path.display())]
    AlreadyMounted { path: PathBuf, mount_id: u64 },
    #[error("bind_to {} is {found}: a block volume is bound onto a file (csi-agent creates it, or uses an existing regular file); choose another path", path.display())]
    NotAFile { path: PathBuf, found: &'static str },
    #[error("bind_to {}: {source}", path.display())]
    Walk {
        path: PathBuf,
        #[source]
        source: BeneathError,
    },
    #[error("the volume's target {} cannot be bound: {source}", target.display())]
    Source {
        target: PathBuf,
        #[source]
        source: BeneathError,
    },
    #[error("{op} of bind_to {}: {source}", path.display())]
    Mount {
        op: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "the bind mount made at {} (mount {mount_id}) is now at {}, {why}; csi-agent leaves it alone: move it back or unmount it by hand, then retry",
        path.display(), now_at.display()
    )]
    Moved {
        path: PathBuf,
        mount_id: u64,
        now_at: PathBuf,
        why: String,
    },
    #[error("{} is still a bind of this volume after {MAX_STACKED_BINDS} unmounts", path.display())]
    StillMounted { path: PathBuf },
    #[error("reading the mount table: {0}")]
    MountTable(#[source] crate::mounts::MountError),
}

impl BindError {
    /// True when the request itself is wrong (a 400): nothing was touched.
    pub fn is_invalid_request(&self) -> bool {
        matches!(
            self,
            BindError::Disabled | BindError::OutsideRoots { .. } | BindError::Invalid(_)
        )
    }

    /// True when the path collides with something else in use (a 409).
    pub fn is_conflict(&self) -> bool {
        matches!(
            self,
            BindError::Forbidden { .. }
                | BindError::InUse { .. }
                | BindError::InsideOtherBind { .. }
                | BindError::AlreadyMounted { .. }
                | BindError::NotAFile { .. }
                | BindError::Walk {
                    source: BeneathError::Symlink { .. }
                        | BeneathError::NotADirectory { .. }
                        | BeneathError::Escapes { .. },
                    ..
                }
        )
    }
}

/// The bind roots, the paths no bind may touch, and every `bind_to` in use: one per daemon,
/// shared by every plugin's volume manager.
#[derive(Debug)]
pub struct Binder {
    roots: Vec<PathBuf>,
    /// Every mount syscall, mount-table read and mount identity of the node's volume code
    /// goes through it: [`HostMounter`] in the daemon, a `FakeMounter` in tests without root.
    mounter: Arc<dyn Mounter>,
    forbidden: Mutex<Vec<(PathBuf, &'static str)>>,
    owners: Mutex<Owners>,
}

/// Every `bind_to` in use, and the mounts csi-agent made for them. Both lookups cost the
/// depth of a path times a logarithm, never a pass over every claim of the node: a publish's
/// cost must not grow with the claims of other volumes (issue #24, L2).
#[derive(Debug, Default)]
struct Owners {
    /// Path → its holder and the id of the mount made there (this boot), once known.
    by_path: BTreeMap<PathBuf, (BindOwner, Option<u64>)>,
    /// Mount id → its holder, for the mounts in `by_path`.
    by_mount: HashMap<u64, BindOwner>,
}

impl Owners {
    /// The holder, other than `owner`, of `path`, of a path around it or of one inside it.
    fn overlapping(&self, path: &Path, owner: &BindOwner) -> Option<&BindOwner> {
        // `path` itself and every path around it: one lookup per component.
        for around in path.ancestors() {
            if let Some((holder, _)) = self.by_path.get(around)
                && holder != owner
            {
                return Some(holder);
            }
        }
        // Paths inside `path` sort right after it (paths compare component by component).
        self.by_path
            .range::<Path, _>((Bound::Excluded(path), Bound::Unbounded))
            .take_while(|(inside, _)| inside.starts_with(path))
            .map(|(_, (holder, _))| holder)
            .find(|holder| *holder != owner)
    }
}

impl Binder {
    /// `roots` must be absolute and canonical (the daemon canonicalizes the flags);
    /// `work_dir` may never be bound over or into.
    pub fn new(roots: Vec<PathBuf>, work_dir: &Path) -> Self {
        Self::with_mounter(roots, work_dir, Arc::new(HostMounter))
    }

    /// [`Binder::new`] with the mounter every mount goes through.
    pub fn with_mounter(roots: Vec<PathBuf>, work_dir: &Path, mounter: Arc<dyn Mounter>) -> Self {
        let binder = Self {
            roots,
            mounter,
            forbidden: Mutex::default(),
            owners: Mutex::default(),
        };
        binder.forbid(work_dir, "is or overlaps the csi-agent work dir");
        binder
    }

    /// The mounter of the node's volume code (the volume managers read the mount table
    /// through it too).
    pub fn mounter(&self) -> &dyn Mounter {
        self.mounter.as_ref()
    }

    /// No roots: every `bind_to` is refused.
    pub fn disabled(work_dir: &Path) -> Self {
        Self::new(Vec::new(), work_dir)
    }

    pub fn roots(&self) -> &[PathBuf] {
        &self.roots
    }

    /// Adds a path no bind may be, contain or lie in (a plugin's mount root).
    pub fn forbid(&self, path: &Path, what: &'static str) {
        let mut forbidden = lock(&self.forbidden);
        if !forbidden.iter().any(|(p, _)| p == path) {
            forbidden.push((path.to_path_buf(), what));
        }
        if let Ok(canonical) = std::fs::canonicalize(path)
            && canonical != path
            && !forbidden.iter().any(|(p, _)| *p == canonical)
        {
            forbidden.push((canonical, what));
        }
    }

    /// The lexical checks of a `bind_to`, before anything else happens: returns its root and
    /// the path relative to it.
    pub fn check(&self, path: &Path) -> Result<(PathBuf, PathBuf), BindError> {
        if self.roots.is_empty() {
            return Err(BindError::Disabled);
        }
        // Validate the form on its own first, so that `..` or NUL get their own message.
        beneath::check_form(path).map_err(BindError::Invalid)?;
        if path.as_os_str().as_bytes().iter().any(u8::is_ascii_control) {
            // No sandbox path needs one; refused, they cannot reach logs, and a record's
            // worst-case size counts each byte of a bind_to as at most 2 in JSON.
            return Err(BindError::Invalid(BeneathError::Invalid {
                path: path.to_path_buf(),
                reason: "contains a control character".to_owned(),
            }));
        }
        let root = self
            .roots
            .iter()
            .filter(|root| path.starts_with(root) && path != root.as_path())
            .max_by_key(|root| root.as_os_str().len())
            .ok_or_else(|| BindError::OutsideRoots {
                path: path.to_path_buf(),
                roots: self
                    .roots
                    .iter()
                    .map(|r| r.display().to_string())
                    .collect::<Vec<_>>()
                    .join(", "),
            })?;
        let relative = beneath::normalized_relative(root, path).map_err(BindError::Invalid)?;
        for (other, what) in lock(&self.forbidden).iter() {
            if path.starts_with(other) || other.starts_with(path) {
                return Err(BindError::Forbidden {
                    path: path.to_path_buf(),
                    what,
                    other: other.clone(),
                });
            }
        }
        Ok((root.clone(), relative))
    }

    /// Reserves `path` for `owner`: refused when [`Binder::check`] refuses it (so a path read
    /// back from a hand-edited record is held to the rules of a new request wherever it is
    /// reserved), or when another claim holds it, or a path inside or around it. Reserving
    /// again for the same owner is fine.
    pub fn reserve(&self, path: &Path, owner: &BindOwner) -> Result<(), BindError> {
        self.reserve_new(path, owner).map(drop)
    }

    /// [`Binder::reserve`] for one request: the reservation is given back when the returned
    /// guard drops, unless [`Reservation::keep`] was called, so that every early return of
    /// the request undoes it. A reservation `owner` held before the call is never given back
    /// by the guard (an earlier request made it, and a record names it).
    pub fn reservation(
        &self,
        path: &Path,
        owner: &BindOwner,
    ) -> Result<Reservation<'_>, BindError> {
        let new = self.reserve_new(path, owner)?;
        Ok(Reservation {
            binder: self,
            held: new.then(|| (path.to_path_buf(), owner.clone())),
        })
    }

    /// Reserves `path` for `owner`; true when this call made the reservation.
    fn reserve_new(&self, path: &Path, owner: &BindOwner) -> Result<bool, BindError> {
        self.check(path)?;
        let mut owners = lock(&self.owners);
        if let Some(holder) = owners.overlapping(path, owner) {
            return Err(BindError::InUse {
                path: path.to_path_buf(),
                owner: holder.clone(),
            });
        }
        let mut new = false;
        owners.by_path.entry(path.to_path_buf()).or_insert_with(|| {
            new = true;
            (owner.clone(), None)
        });
        Ok(new)
    }

    /// Gives `path` back (only if `owner` holds it), with the mount noted for it.
    pub fn release(&self, path: &Path, owner: &BindOwner) {
        let mut owners = lock(&self.owners);
        if owners
            .by_path
            .get(path)
            .is_some_and(|(holder, _)| holder == owner)
            && let Some((_, Some(mount_id))) = owners.by_path.remove(path)
            && owners.by_mount.get(&mount_id) == Some(owner)
        {
            owners.by_mount.remove(&mount_id);
        }
    }

    /// Notes that the mount `mount_id` (of this boot) is `owner`'s bind at `path`, which
    /// `owner` has reserved: no other claim's `bind_to` may lie in it, wherever it is moved.
    pub fn note_mount(&self, path: &Path, owner: &BindOwner, mount_id: u64) {
        let mut owners = lock(&self.owners);
        let Some((holder, noted)) = owners.by_path.get_mut(path) else {
            return;
        };
        if holder != owner {
            return;
        }
        let before = noted.replace(mount_id);
        if let Some(before) = before
            && before != mount_id
            && owners.by_mount.get(&before) == Some(owner)
        {
            owners.by_mount.remove(&before);
        }
        owners.by_mount.insert(mount_id, owner.clone());
    }

    /// Who, other than `owner`, holds the bind mount `mount_id`, if csi-agent made it.
    fn mount_holder(&self, mount_id: u64, owner: &BindOwner) -> Option<BindOwner> {
        lock(&self.owners)
            .by_mount
            .get(&mount_id)
            .filter(|holder| *holder != owner)
            .cloned()
    }

    /// Makes sure `bind` (held by `owner`) is a bind of the volume's target (`target`
    /// beneath `target_root`), mounting it if it is not there. Returns the bind as it should
    /// now be recorded (mount id noted, created dirs counted).
    pub fn ensure(
        &self,
        target_root: &Path,
        target: &Path,
        bind: &BindMount,
        readonly: bool,
        boot_id: &str,
        owner: &BindOwner,
    ) -> Result<BindMount, BindError> {
        let (root, relative) = self.check(&bind.path)?;
        let source = open_target(target_root, target)?;
        let source_id = self.identity(&source, target)?;
        if is_file_target(&source, target)? {
            return self.ensure_file(bind, &source, &source_id, readonly, boot_id, owner);
        }
        let root_fd = beneath::open_root(&root).map_err(|source| BindError::Walk {
            path: bind.path.clone(),
            source,
        })?;
        let opened = beneath::open_dir(
            root_fd.as_fd(),
            &root,
            &relative,
            Some(Mode::from_raw_mode(0o755)),
        )
        .map_err(|source| BindError::Walk {
            path: bind.path.clone(),
            source,
        })?;
        let mut recorded = bind.clone();
        let opened_created = opened.created;
        recorded.created_dirs = recorded.created_dirs.max(opened.created);
        let here = self.identity(&opened.fd, &bind.path)?;
        self.refuse_forbidden_inode(&bind.path, &here)?;
        // The walked dir is, or lies in, another claim's bind (moved there, or this path
        // reached through it): neither mount there nor adopt it (L3).
        if let Some(holder) = self.mount_holder(here.mount_id, owner) {
            drop(opened);
            if opened_created > 0
                && let Err(err) =
                    beneath::remove_trailing_dirs(root_fd.as_fd(), &root, &relative, opened_created)
            {
                tracing::warn!(bind_to = ?bind.path, error = %err, "dir created for a refused bind_to left in place");
            }
            return Err(BindError::InsideOtherBind {
                path: bind.path.clone(),
                owner: holder,
                mount_id: here.mount_id,
            });
        }
        if here.mount_root {
            if here.same_inode(&source_id) {
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
        self.refuse_moved(bind, boot_id, &source_id)?;
        let walked = Walked {
            root_fd: root_fd.as_fd(),
            root: &root,
            relative: &relative,
            file: false,
        };
        let mount_id = self.attach(bind, &source, opened.fd, &walked, readonly)?;
        recorded.mount_id = Some(mount_id);
        recorded.boot_id = Some(boot_id.to_owned());
        self.note_mount(&bind.path, owner, mount_id);
        Ok(recorded)
    }

    /// Mounts the clone of the target (`source`) onto the walked `onto`, checks that it is
    /// reachable at the bind's path (undone at once if not), and makes it read-only if asked
    /// (undone if that fails). Returns the new mount's id.
    fn attach(
        &self,
        bind: &BindMount,
        source: &OwnedFd,
        onto: OwnedFd,
        walked: &Walked<'_>,
        readonly: bool,
    ) -> Result<u64, BindError> {
        let tree = self
            .mounter
            .attach_clone(source.as_fd(), onto.as_fd())
            .map_err(|err| BindError::Mount {
                op: err.op,
                path: bind.path.clone(),
                source: err.source,
            })?;
        drop(onto);
        // After move_mount the tree fd is the root of the attached mount: its id is the one
        // to record, and unmounting through it reaches this mount wherever it ends up.
        let attached = self.identity(&tree, &bind.path)?;
        // Walk again: the bind must be reachable at its path, or it is undone at once.
        let reachable = file::walk(walked.root_fd, walked.root, walked.relative, walked.file)
            .ok()
            .and_then(|fd| self.identity(&fd, &bind.path).ok())
            .is_some_and(|now| now.mount_root && now.mount_id == attached.mount_id);
        if !reachable {
            let _ = self.detach_fd(&tree);
            return Err(BindError::Walk {
                path: bind.path.clone(),
                source: BeneathError::Invalid {
                    path: bind.path.clone(),
                    reason: "changed while it was being mounted".to_owned(),
                },
            });
        }
        if readonly
            && let Err(err) = self
                .mounter
                .remount_read_only(&beneath::fd_path(tree.as_fd()))
        {
            // Never leave a writable bind where a read-only one was asked for.
            let _ = self.detach_fd(&tree);
            return Err(BindError::Mount {
                op: "read-only remount",
                path: bind.path.clone(),
                source: std::io::Error::other(err.to_string()),
            });
        }
        Ok(attached.mount_id)
    }

    /// The mount made for this claim this boot, moved away by the workload: a second one
    /// here would leave the first one unknown to every unpublish (looked up in the mount
    /// table only in this rare case: nothing mounted where the record says).
    fn refuse_moved(
        &self,
        bind: &BindMount,
        boot_id: &str,
        source_id: &Identity,
    ) -> Result<(), BindError> {
        if let Some(id) = bind
            .mount_id
            .filter(|_| bind.boot_id.as_deref() == Some(boot_id))
        {
            let table = self.mounter.mount_table().map_err(BindError::MountTable)?;
            if let Some(entry) = table.entries().iter().find(|m| m.mount_id == id)
                && self.is_our_bind(&entry.mount_point, id, Some(source_id))
            {
                return Err(BindError::Moved {
                    path: bind.path.clone(),
                    mount_id: id,
                    now_at: entry.mount_point.clone(),
                    why: "not where the claim says".to_owned(),
                });
            }
        }
        Ok(())
    }

    /// Unmounts the bind csi-agent made for `bind` (held by `owner`) and removes the dirs it
    /// created (and, for a block volume, the file it created). Succeeds when nothing of ours is mounted there any more; never unmounts a
    /// mount that is not this volume's bind, nor one made for another claim (of the same
    /// volume: same inode, moved to this path); fails (changing nothing) when our mount moved
    /// out of reach.
    pub fn remove(
        &self,
        target_root: &Path,
        target: &Path,
        bind: &BindMount,
        boot_id: &str,
        owner: &BindOwner,
    ) -> Result<(), BindError> {
        let (root, relative) = match self.check(&bind.path) {
            Ok(found) => found,
            Err(err) => {
                // A path csi-agent would never have mounted (a hand-edited record, or roots
                // changed since): nothing of ours can be there, and nothing is touched.
                tracing::warn!(bind_to = ?bind.path, error = %err, "recorded bind_to is not allowed; forgetting it without touching it");
                return Ok(());
            }
        };
        let mut our_id = bind
            .mount_id
            .filter(|_| bind.boot_id.as_deref() == Some(boot_id));
        // The target's inode tells our bind from anything else mounted at the path.
        let source_id = open_target(target_root, target)
            .ok()
            .and_then(|fd| self.identity(&fd, target).ok());
        let root_fd = beneath::open_root(&root).map_err(|source| BindError::Walk {
            path: bind.path.clone(),
            source,
        })?;
        // A block volume's bind: a file at the path, or a device mounted on one.
        let file = file::is_file_bind(root_fd.as_fd(), &root, &relative);
        for _ in 0..MAX_STACKED_BINDS {
            // The fd only identifies what is there; it is closed before the unmount, which
            // an open fd would make fail with EBUSY.
            let here = match file::walk(root_fd.as_fd(), &root, &relative, file) {
                Ok(fd) => Some(self.identity(&fd, &bind.path)?),
                Err(_) => None,
            };
            let ours_here = here.is_some_and(|id| {
                id.mount_root
                    && (Some(id.mount_id) == our_id
                        || source_id.as_ref().is_some_and(|s| id.same_inode(s))
                            && self.mount_holder(id.mount_id, owner).is_none())
            });
            if ours_here {
                self.unmount_beneath(root_fd.as_fd(), &root, &relative)
                    .map_err(|source| BindError::Mount {
                        op: "unmount",
                        path: bind.path.clone(),
                        source,
                    })?;
                // Gone: from now on its id may name someone else's new mount.
                our_id = None;
                continue;
            }
            // Nothing of ours at the path (any foreign mount there is left alone). If the
            // mount we made still exists elsewhere, the path was changed under us.
            if let Some(id) = our_id {
                let table = self.mounter.mount_table().map_err(BindError::MountTable)?;
                if let Some(entry) = table.entries().iter().find(|m| m.mount_id == id)
                    && self.is_our_bind(&entry.mount_point, id, source_id.as_ref())
                {
                    return self.remove_moved(bind, id, &entry.mount_point, &root);
                }
            }
            // Even with no count recorded (a crash between the mkdir and the record), the
            // dirs (and the file) csi-agent marked as created go.
            let removed = if file {
                beneath::remove_created_file(
                    root_fd.as_fd(),
                    &root,
                    &relative,
                    false,
                    bind.created_dirs,
                )
            } else {
                beneath::remove_trailing_dirs(root_fd.as_fd(), &root, &relative, bind.created_dirs)
            };
            if let Err(err) = removed {
                tracing::warn!(bind_to = ?bind.path, error = %err, "dir created for bind_to left in place");
            }
            return Ok(());
        }
        Err(BindError::StillMounted {
            path: bind.path.clone(),
        })
    }

    /// Our mount is in the table at `now_at`, not at its recorded path: unmount it there only
    /// if that place is itself beneath a bind root and walks without symlinks to the mount.
    fn remove_moved(
        &self,
        bind: &BindMount,
        mount_id: u64,
        now_at: &Path,
        root: &Path,
    ) -> Result<(), BindError> {
        let moved = |why: &str| BindError::Moved {
            path: bind.path.clone(),
            mount_id,
            now_at: now_at.to_path_buf(),
            why: why.to_owned(),
        };
        let Some(now_root) = self
            .roots
            .iter()
            .find(|r| now_at.starts_with(r) && now_at != r.as_path())
        else {
            return Err(moved("outside every --bind-root"));
        };
        let relative = beneath::normalized_relative(now_root, now_at)
            .map_err(|_| moved("not a normalised path"))?;
        let root_fd = beneath::open_root(now_root).map_err(|source| BindError::Walk {
            path: bind.path.clone(),
            source,
        })?;
        let opened = beneath::open_dir(root_fd.as_fd(), now_root, &relative, None)
            .map_err(|_| moved("reachable only through a symlink"))?;
        let id = self.identity(&opened.fd, now_at)?;
        drop(opened);
        if !(id.mount_root && id.mount_id == mount_id) {
            return Err(moved("covered by another mount"));
        }
        tracing::warn!(bind_to = ?bind.path, now_at = ?now_at, root = ?root, mount_id, "bind mount was moved beneath the bind root; unmounting it where it is");
        self.unmount_beneath(root_fd.as_fd(), now_root, &relative)
            .map_err(|source| BindError::Mount {
                op: "unmount",
                path: now_at.to_path_buf(),
                source,
            })
    }

    /// Refuses a walked dir that is the work dir or a plugin's mount root by inode (a bind
    /// mount can alias them beneath a bind root, which the lexical check cannot see).
    fn refuse_forbidden_inode(&self, path: &Path, here: &Identity) -> Result<(), BindError> {
        for (other, what) in lock(&self.forbidden).iter() {
            let Ok(fd) = beneath::open_root(other) else {
                continue;
            };
            if let Ok(id) = self.mounter.identity(fd.as_fd(), other)
                && id.same_inode(here)
            {
                return Err(BindError::Forbidden {
                    path: path.to_path_buf(),
                    what,
                    other: other.clone(),
                });
            }
        }
        Ok(())
    }
}

/// A `bind_to` one request reserved ([`Binder::reservation`]): given back on drop unless
/// kept. Replaces the hand-written releases on each of a publish's error paths.
#[must_use = "dropping the reservation gives the path back at once"]
#[derive(Debug)]
pub struct Reservation<'a> {
    binder: &'a Binder,
    /// What to give back on drop (`None`: nothing, or kept).
    held: Option<(PathBuf, BindOwner)>,
}

impl Reservation<'_> {
    /// A reservation of nothing (a request without `bind_to`).
    pub fn none(binder: &Binder) -> Reservation<'_> {
        Reservation { binder, held: None }
    }

    /// Keeps the path reserved: a durable record now names it, and an unpublish gives it
    /// back.
    pub fn keep(mut self) {
        self.held = None;
    }
}

impl Drop for Reservation<'_> {
    fn drop(&mut self) {
        if let Some((path, owner)) = self.held.take() {
            self.binder.release(&path, &owner);
        }
    }
}

/// The mount calls of the binder, each through its [`Mounter`].
impl Binder {
    /// Whether the mount the table shows at `mount_point` with `mount_id` is a bind of the
    /// volume's target (`source`): ids are reused as soon as a mount goes, so an id alone
    /// proves nothing. Looked at without following symlinks; when the target cannot be seen,
    /// any mount with that id counts as ours, so that nothing is unmounted without an operator.
    fn is_our_bind(&self, mount_point: &Path, mount_id: u64, source: Option<&Identity>) -> bool {
        let Ok(relative) = beneath::normalized_relative(Path::new("/"), mount_point) else {
            return source.is_none();
        };
        let Ok(root) = beneath::open_root(Path::new("/")) else {
            return source.is_none();
        };
        match beneath::open_dir(root.as_fd(), Path::new("/"), &relative, None)
            .and_then(|opened| self.mounter.identity(opened.fd.as_fd(), mount_point))
        {
            Ok(id) => {
                id.mount_root
                    && id.mount_id == mount_id
                    && source.is_none_or(|source| id.same_inode(source))
            }
            Err(_) => source.is_none(),
        }
    }

    fn identity(&self, fd: &OwnedFd, at: &Path) -> Result<Identity, BindError> {
        self.mounter
            .identity(fd.as_fd(), at)
            .map_err(|source| BindError::Walk {
                path: at.to_path_buf(),
                source,
            })
    }

    /// Unmounts what is mounted at `relative` beneath `root_fd`: the parent is walked without
    /// symlinks and named by its fd (`/proc/self/fd/N/<name>`), and the last component is
    /// not followed (`UMOUNT_NOFOLLOW`), so no path string that may have changed is resolved.
    fn unmount_beneath(
        &self,
        root_fd: std::os::fd::BorrowedFd<'_>,
        root: &Path,
        relative: &Path,
    ) -> Result<(), std::io::Error> {
        let name = relative
            .file_name()
            .ok_or_else(|| std::io::Error::from(std::io::ErrorKind::InvalidInput))?;
        let parent_rel = relative.parent().unwrap_or(Path::new(""));
        let parent = if parent_rel.as_os_str().is_empty() {
            None
        } else {
            Some(
                beneath::open_dir(root_fd, root, parent_rel, None)
                    .map_err(std::io::Error::other)?
                    .fd,
            )
        };
        let parent_fd = parent.as_ref().map_or(root_fd, |fd| fd.as_fd());
        let path = beneath::fd_path(parent_fd).join(name);
        self.mounter.unmount_nofollow(&path)
    }

    /// Takes back a mount csi-agent just made and nobody uses yet, through the fd that made
    /// it (that fd pins the mount, so only a lazy detach works; it completes when the fd
    /// closes).
    fn detach_fd(&self, fd: &OwnedFd) -> Result<(), std::io::Error> {
        self.mounter.detach(&beneath::fd_path(fd.as_fd()))
    }
}

/// Where a bind is walked to: the root's fd and path, the path beneath it, and whether its
/// last component is a file (a block volume's) or a dir.
struct Walked<'a> {
    root_fd: std::os::fd::BorrowedFd<'a>,
    root: &'a Path,
    relative: &'a Path,
    file: bool,
}

/// Opens the volume's target (derived by csi-agent, beneath the plugin's mount root) without
/// following a symlink a plugin may have planted there.
fn open_target(target_root: &Path, target: &Path) -> Result<OwnedFd, BindError> {
    let source_err = |source| BindError::Source {
        target: target.to_path_buf(),
        source,
    };
    let relative = target
        .strip_prefix(target_root)
        .map_err(|_| {
            source_err(BeneathError::Invalid {
                path: target.to_path_buf(),
                reason: format!("is not beneath {}", target_root.display()),
            })
        })?
        .to_path_buf();
    let root_fd = beneath::open_root(target_root).map_err(source_err)?;
    match beneath::open_dir(root_fd.as_fd(), target_root, &relative, None) {
        Ok(opened) => Ok(opened.fd),
        // A block volume's target: a file, with the device node mounted on it.
        Err(BeneathError::NotADirectory { .. }) => {
            beneath::open_node(root_fd.as_fd(), target_root, &relative, None)
                .map(|opened| opened.fd)
                .map_err(source_err)
        }
        Err(err) => Err(source_err(err)),
    }
}

/// Whether the opened target is a block volume's (a file or a device node), not a dir.
fn is_file_target(source: &OwnedFd, target: &Path) -> Result<bool, BindError> {
    let kind = beneath::node_kind(source.as_fd(), target).map_err(|source| BindError::Source {
        target: target.to_path_buf(),
        source,
    })?;
    match kind {
        beneath::NodeKind::Directory => Ok(false),
        beneath::NodeKind::RegularFile | beneath::NodeKind::Other => Ok(true),
        beneath::NodeKind::Symlink => Err(BindError::Source {
            target: target.to_path_buf(),
            source: BeneathError::Symlink {
                at: target.to_path_buf(),
                root: target.parent().unwrap_or(target).to_path_buf(),
            },
        }),
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    fn owner(workload: &str) -> BindOwner {
        BindOwner {
            plugin: "p".into(),
            volume_id: "v".into(),
            workload: workload.into(),
        }
    }

    #[test]
    fn records_of_the_first_release_still_read() {
        let old: BindMount =
            serde_json::from_str("\"/sandboxes/w1/data\"").unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(old, BindMount::new(PathBuf::from("/sandboxes/w1/data")));
        let new: BindMount =
            serde_json::from_str(r#"{"path":"/s/x","mount_id":42,"boot_id":"b","created_dirs":2}"#)
                .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(new.mount_id, Some(42));
        assert_eq!(new.created_dirs, 2);
    }

    #[test]
    fn check_refuses_without_roots_outside_roots_and_over_the_work_dir() {
        let work = Path::new("/var/lib/csi-agent");
        let none = Binder::disabled(work);
        assert!(matches!(
            none.check(Path::new("/sandboxes/w/data")),
            Err(BindError::Disabled)
        ));
        assert!(BindError::Disabled.to_string().contains("--bind-root"));

        let binder = Binder::new(
            vec![PathBuf::from("/sandboxes"), PathBuf::from("/var")],
            work,
        );
        assert!(binder.check(Path::new("/sandboxes/w/data")).is_ok());
        for (path, wanted) in [
            ("/etc/passwd", "not beneath a --bind-root"),
            ("/sandboxes", "not beneath a --bind-root"),
            ("/sandboxes/../etc", "'..'"),
            ("/sandboxes//w", "normalised"),
            ("/sandboxes/w\0x", "NUL"),
            ("/var/lib/csi-agent/csi", "work dir"),
            ("/var/lib", "work dir"),
        ] {
            let err = binder.check(Path::new(path)).map(|_| ()).unwrap_err();
            assert!(err.to_string().contains(wanted), "{path}: {err}");
        }
    }

    #[test]
    fn reserve_refuses_shared_nested_and_enclosing_paths() {
        let binder = Binder::new(vec![PathBuf::from("/s")], Path::new("/w"));
        binder
            .reserve(Path::new("/s/a/data"), &owner("w1"))
            .unwrap_or_else(|e| panic!("{e}"));
        binder
            .reserve(Path::new("/s/a/data"), &owner("w1"))
            .unwrap_or_else(|e| panic!("same owner again: {e}"));
        for path in ["/s/a/data", "/s/a/data/x", "/s/a"] {
            let err = binder.reserve(Path::new(path), &owner("w2")).unwrap_err();
            assert!(matches!(err, BindError::InUse { .. }), "{path}: {err}");
        }
        binder.release(Path::new("/s/a/data"), &owner("w2"));
        assert!(
            binder.reserve(Path::new("/s/a"), &owner("w2")).is_err(),
            "only the owner releases"
        );
        binder.release(Path::new("/s/a/data"), &owner("w1"));
        assert!(binder.reserve(Path::new("/s/a"), &owner("w2")).is_ok());
    }

    #[test]
    fn a_reservation_is_given_back_on_drop_unless_kept() {
        let binder = Binder::new(vec![PathBuf::from("/s")], Path::new("/w"));
        let path = Path::new("/s/a/data");
        let taken = |who: &str| binder.reserve(path, &owner(who)).is_err();
        drop(binder.reservation(path, &owner("w1")).unwrap());
        assert!(!taken("w2"), "a dropped reservation holds nothing");
        binder.release(path, &owner("w2"));
        binder.reservation(path, &owner("w1")).unwrap().keep();
        assert!(taken("w2"), "a kept reservation holds the path");
        // A guard of a path its owner held before gives nothing back: an earlier request's
        // record names it.
        drop(binder.reservation(path, &owner("w1")).unwrap());
        assert!(
            taken("w2"),
            "an earlier reservation was given back by a later guard"
        );
        assert!(matches!(
            binder.reservation(path, &owner("w2")),
            Err(BindError::InUse { .. })
        ));
        drop(Reservation::none(&binder));
        assert!(taken("w2"));
    }

    #[test]
    fn reserve_refuses_what_check_refuses() {
        let binder = Binder::new(vec![PathBuf::from("/s")], Path::new("/w"));
        for path in [
            "/etc/x",
            "/s/../etc",
            "/s/a/../../etc",
            "relative",
            "/s",
            "/w/x",
        ] {
            let checked = binder.check(Path::new(path)).map(|_| ()).unwrap_err();
            let reserved = binder.reserve(Path::new(path), &owner("w1")).unwrap_err();
            assert_eq!(reserved.to_string(), checked.to_string(), "{path}");
        }
        assert!(
            binder.reserve(Path::new("/s/ok"), &owner("w1")).is_ok(),
            "nothing refused was reserved"
        );
    }
}
