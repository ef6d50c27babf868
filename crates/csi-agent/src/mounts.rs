//! The mount table and the mounter: parsing `/proc/self/mountinfo`, bind mounts and
//! unmounts through a [`Mounter`] trait, and the one safe way to clean up directories under
//! the mount root.
//!
//! This module owns every mount syscall of the engine and the rule "never delete recursively
//! across a mount point" (LESSONS.md): [`remove_empty_tree`] and [`remove_dir_if_unmounted`]
//! remove only empty directories that are not mount points, bottom-up, and never unlink a
//! file. It must not decide *when* to mount or clean up (the volume manager and garbage
//! collection do), must not shell out to `mount`/`umount`, and must not follow a symlink a
//! plugin may have planted when unmounting or cleaning.
//!
//! Mount points are compared after canonicalization: both the table's mount points (as the
//! kernel prints them, already canonical) and the queried path (resolved with
//! `realpath`, falling back to resolving its parent when the path itself cannot be reached,
//! as with a dead FUSE or NFS mount).

use std::collections::HashSet;
use std::ffi::OsString;
use std::fs;
use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::ffi::OsStringExt;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, PoisonError};

use rustix::mount::{MountFlags, MoveMountFlags, OpenTreeFlags, UnmountFlags};

use crate::beneath::{self, BeneathError, Identity};

/// Where the kernel publishes this process's mount table.
pub const MOUNTINFO_PATH: &str = "/proc/self/mountinfo";

/// How many stacked mounts [`Mounter::unmount`] peels off one path before giving up.
const MAX_STACKED_MOUNTS: usize = 32;
/// The deepest directory tree [`remove_empty_tree`] walks (ours are three levels deep).
const MAX_CLEANUP_DEPTH: usize = 32;

#[derive(Debug, thiserror::Error)]
pub enum MountError {
    #[error("read {}: {source}", path.display())]
    Read {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("mountinfo line {line}: {reason}")]
    Parse {
        line: usize,
        #[source]
        reason: LineError,
    },
    #[error("bind mount {} on {}: {source}", src.display(), dst.display())]
    Bind {
        src: PathBuf,
        dst: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("remount {} read-only: {source}", path.display())]
    Remount {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("unmount {}: {source}", path.display())]
    Unmount {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("{} is still a mount point after {attempts} unmounts", path.display())]
    StillMounted { path: PathBuf, attempts: usize },
}

/// One line of `/proc/self/mountinfo` (see proc(5)), with escapes decoded.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MountInfo {
    pub mount_id: u64,
    pub parent_id: u64,
    pub major: u32,
    pub minor: u32,
    /// The root of the mount within its file system (e.g. the source dir of a bind mount).
    pub root: PathBuf,
    pub mount_point: PathBuf,
    /// Per-mount options (`rw`, `ro`, `nosuid`, ...).
    pub mount_options: String,
    /// Optional fields such as `shared:1`, `master:2`, `propagate_from:3`, `unbindable`.
    pub optional_fields: Vec<String>,
    pub fs_type: String,
    pub source: String,
    pub super_options: String,
}

impl MountInfo {
    /// True if the mount itself is read-only (per-mount `ro`, as a read-only bind shows).
    pub fn is_read_only(&self) -> bool {
        self.mount_options.split(',').any(|option| option == "ro")
    }

    /// True if mounts and unmounts under this one propagate to peers (`shared:N`).
    pub fn is_shared(&self) -> bool {
        self.optional_fields
            .iter()
            .any(|field| field.starts_with("shared:"))
    }
}

/// A snapshot of the mount table.
#[derive(Clone, Debug, Default)]
pub struct MountTable {
    entries: Vec<MountInfo>,
    /// Every mount point, for O(1) lookups when recovery checks thousands of paths.
    points: HashSet<PathBuf>,
}

impl MountTable {
    /// Reads `/proc/self/mountinfo`. The kernel produces it in chunks and a mount or unmount
    /// between two chunks can skew a single read, so read until two reads agree (at most
    /// three times, then use the last).
    pub fn read() -> Result<Self, MountError> {
        Self::read_from(Path::new(MOUNTINFO_PATH))
    }

    /// Reads a mountinfo file at `path` (as [`MountTable::read`]).
    pub fn read_from(path: &Path) -> Result<Self, MountError> {
        let read = || {
            fs::read(path).map_err(|source| MountError::Read {
                path: path.to_path_buf(),
                source,
            })
        };
        let mut previous = read()?;
        for _ in 0..2 {
            let current = read()?;
            if current == previous {
                break;
            }
            previous = current;
        }
        Self::parse_bytes(&previous)
    }

    /// Parses mountinfo text.
    pub fn parse(text: &str) -> Result<Self, MountError> {
        Self::parse_bytes(text.as_bytes())
    }

    /// Parses mountinfo bytes (paths need not be UTF-8: the kernel escapes only space, tab,
    /// newline and backslash).
    pub fn parse_bytes(bytes: &[u8]) -> Result<Self, MountError> {
        let mut entries = Vec::new();
        for (index, line) in bytes.split(|&b| b == b'\n').enumerate() {
            if line.iter().all(u8::is_ascii_whitespace) {
                continue;
            }
            entries.push(parse_line(line).map_err(|reason| MountError::Parse {
                line: index + 1,
                reason,
            })?);
        }
        Ok(Self::from_entries(entries))
    }

    /// Builds a table from entries (fakes and tests).
    pub fn from_entries(entries: Vec<MountInfo>) -> Self {
        let points = entries
            .iter()
            .map(|entry| entry.mount_point.clone())
            .collect();
        Self { entries, points }
    }

    pub fn entries(&self) -> &[MountInfo] {
        &self.entries
    }

    /// True if `path` (canonicalized) is exactly a mount point in the table.
    pub fn is_mount_point(&self, path: &Path) -> bool {
        self.points.contains(&canonical(path))
    }

    /// Like [`MountTable::is_mount_point`] but does not follow a final symlink: a symlink to
    /// a mount point is not one itself. This is how `umount2(UMOUNT_NOFOLLOW)` sees `path`.
    pub fn is_mount_point_nofollow(&self, path: &Path) -> bool {
        self.points.contains(&canonical_nofollow(path))
    }

    /// The mounts at `prefix` (canonicalized) or below it, in table order (parents first).
    pub fn mounts_under(&self, prefix: &Path) -> Vec<&MountInfo> {
        let prefix = canonical(prefix);
        self.entries
            .iter()
            .filter(|entry| entry.mount_point.starts_with(&prefix))
            .collect()
    }

    /// The topmost mount at exactly `path` (canonicalized), if any.
    pub fn mount_at(&self, path: &Path) -> Option<&MountInfo> {
        let path = canonical(path);
        // Later lines are mounted later: the last match is the one a lookup sees.
        self.entries
            .iter()
            .rev()
            .find(|entry| entry.mount_point == path)
    }
}

/// Why one line of mountinfo does not parse (proc(5)'s format; [`MountError::Parse`]).
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum LineError {
    #[error("expected at least 10 fields, found {found}")]
    TooFewFields { found: usize },
    #[error("no ` - ` separator")]
    NoSeparator,
    #[error("expected file system type, source and super options after ` - `")]
    NothingAfterSeparator,
    #[error("bad {what}")]
    BadNumber { what: &'static str },
    #[error("bad major:minor")]
    BadDevice,
}

fn parse_line(line: &[u8]) -> Result<MountInfo, LineError> {
    let fields: Vec<&[u8]> = line.split(|&b| b == b' ').collect();
    // The separator comes after the six fixed fields and the optional ones; searching from
    // there means no earlier field can be mistaken for it.
    if fields.len() < 6 {
        return Err(LineError::TooFewFields {
            found: fields.len(),
        });
    }
    let separator = fields[6..]
        .iter()
        .position(|field| *field == b"-")
        .map(|offset| offset + 6)
        .ok_or(LineError::NoSeparator)?;
    if fields.len() < separator + 4 {
        return Err(LineError::NothingAfterSeparator);
    }
    let number = |index: usize, what: &'static str| -> Result<u64, LineError> {
        std::str::from_utf8(fields[index])
            .ok()
            .and_then(|text| text.parse().ok())
            .ok_or(LineError::BadNumber { what })
    };
    let (major, minor) = std::str::from_utf8(fields[2])
        .ok()
        .and_then(|text| text.split_once(':'))
        .and_then(|(major, minor)| Some((major.parse().ok()?, minor.parse().ok()?)))
        .ok_or(LineError::BadDevice)?;
    Ok(MountInfo {
        mount_id: number(0, "mount id")?,
        parent_id: number(1, "parent id")?,
        major,
        minor,
        root: unescape_path(fields[3]),
        mount_point: unescape_path(fields[4]),
        mount_options: unescape_string(fields[5]),
        optional_fields: fields[6..separator]
            .iter()
            .filter(|field| !field.is_empty())
            .map(|field| unescape_string(field))
            .collect(),
        fs_type: unescape_string(fields[separator + 1]),
        source: unescape_string(fields[separator + 2]),
        // Anything after the super options is a future extension: ignored.
        super_options: unescape_string(fields[separator + 3]),
    })
}

/// Decodes the kernel's `\ooo` octal escapes (`\040` space, `\011` tab, `\012` newline,
/// `\134` backslash). A backslash not followed by three octal digits is kept as is.
fn unescape(field: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(field.len());
    let mut i = 0;
    while i < field.len() {
        if field[i] == b'\\'
            && let Some(digits) = field.get(i + 1..i + 4)
            && digits.iter().all(|d| (b'0'..=b'7').contains(d))
        {
            let value = digits
                .iter()
                .fold(0u32, |acc, d| acc * 8 + u32::from(d - b'0'));
            if let Ok(byte) = u8::try_from(value) {
                out.push(byte);
                i += 4;
                continue;
            }
        }
        out.push(field[i]);
        i += 1;
    }
    out
}

fn unescape_path(field: &[u8]) -> PathBuf {
    PathBuf::from(OsString::from_vec(unescape(field)))
}

fn unescape_string(field: &[u8]) -> String {
    String::from_utf8_lossy(&unescape(field)).into_owned()
}

/// Resolves `path` the way the kernel prints mount points: absolute, symlinks resolved.
fn canonical(path: &Path) -> PathBuf {
    if let Ok(resolved) = fs::canonicalize(path) {
        return resolved;
    }
    // The path itself may be unreachable (a dead FUSE/NFS mount answers ENOTCONN/ESTALE) or
    // gone: resolve its parent and keep the last component.
    if let (Some(parent), Some(name)) = (path.parent(), path.file_name()) {
        let parent = if parent.as_os_str().is_empty() {
            Path::new(".")
        } else {
            parent
        };
        if let Ok(resolved) = fs::canonicalize(parent) {
            return resolved.join(name);
        }
    }
    if path.is_absolute() {
        path.to_path_buf()
    } else {
        std::env::current_dir()
            .map(|cwd| cwd.join(path))
            .unwrap_or_else(|_| path.to_path_buf())
    }
}

/// [`canonical`] without following a final symlink.
fn canonical_nofollow(path: &Path) -> PathBuf {
    let is_symlink = fs::symlink_metadata(path)
        .map(|meta| meta.file_type().is_symlink())
        .unwrap_or(false);
    match (is_symlink, path.parent(), path.file_name()) {
        (true, Some(parent), Some(name)) => {
            let parent = if parent.as_os_str().is_empty() {
                Path::new(".")
            } else {
                parent
            };
            canonical(parent).join(name)
        }
        _ => canonical(path),
    }
}

/// Whether `path` is a mount point right now: asks the kernel (statx, one syscall) and falls
/// back to reading the mount table on kernels that cannot say. A missing path is not one.
pub fn is_mount_point(path: &Path) -> Result<bool, MountError> {
    match statx_mount_root(path) {
        Some(answer) => Ok(answer),
        None if !path.exists() => Ok(false),
        None => Ok(MountTable::read()?.is_mount_point(path)),
    }
}

/// Asks the kernel whether `path` itself (not following a final symlink) is the root of a
/// mount. `None` when it cannot say (kernel before 5.8, or the path cannot be stat'ed).
fn statx_mount_root(path: &Path) -> Option<bool> {
    use rustix::fs::{AtFlags, StatxAttributes, StatxFlags};
    let stat = rustix::fs::statx(
        rustix::fs::CWD,
        path,
        AtFlags::SYMLINK_NOFOLLOW | AtFlags::NO_AUTOMOUNT,
        StatxFlags::TYPE,
    )
    .ok()?;
    stat.stx_attributes_mask
        .contains(StatxAttributes::MOUNT_ROOT)
        .then(|| stat.stx_attributes.contains(StatxAttributes::MOUNT_ROOT))
}

/// A mount point by the table snapshot or, for mounts newer than the snapshot, by the kernel.
fn is_mount_point_now(path: &Path, table: &MountTable) -> bool {
    table.is_mount_point(path) || statx_mount_root(path) == Some(true)
}

/// The mount operations of the engine, behind a trait so that most tests need no root.
pub trait Mounter: Send + Sync + std::fmt::Debug {
    /// Bind-mounts `src` on `dst` (both must exist). With `readonly`, the new mount is
    /// read-only (the source stays writable) or the call fails and leaves nothing mounted.
    fn bind_mount(&self, src: &Path, dst: &Path, readonly: bool) -> Result<(), MountError>;

    /// Makes `path` not a mount point: unmounts every mount stacked on it. Succeeds if it was
    /// not mounted or does not exist. Never follows a final symlink.
    fn unmount(&self, path: &Path) -> Result<(), MountError>;

    /// The current mount table as this mounter sees it.
    fn mount_table(&self) -> Result<MountTable, MountError>;

    /// Clones the mount tree at the dir `source` (`open_tree(OPEN_TREE_CLONE)`) and
    /// attaches the clone onto the dir `onto` (`move_mount`): no path is resolved between
    /// the walk that opened `onto` and the mount. Returns an fd of the attached mount's root
    /// (which pins it: see [`Mounter::detach`]).
    fn attach_clone(
        &self,
        source: BorrowedFd<'_>,
        onto: BorrowedFd<'_>,
    ) -> Result<OwnedFd, AttachError>;

    /// One `umount2(path, UMOUNT_NOFOLLOW)`: unmounts the topmost mount at exactly `path`
    /// (callers name it through `/proc/self/fd/N/<name>` of a walked parent).
    fn unmount_nofollow(&self, path: &Path) -> io::Result<()>;

    /// One `umount2(path, MNT_DETACH)`: lazily detaches the mount reached through `path`.
    fn detach(&self, path: &Path) -> io::Result<()>;

    /// Makes the bind mount reached through `path` read-only, keeping its other per-mount
    /// flags.
    fn remount_read_only(&self, path: &Path) -> Result<(), MountError>;

    /// The identity (inode, mount id, mount root) of what `fd` refers to, as this mounter's
    /// mounts make it look (`statx` for the real one).
    fn identity(&self, fd: BorrowedFd<'_>, at: &Path) -> Result<Identity, BeneathError>;
}

/// A step of [`Mounter::attach_clone`] failed: `op` names it ("clone of the target" or
/// "mount").
#[derive(Debug, thiserror::Error)]
#[error("{op}: {source}")]
pub struct AttachError {
    pub op: &'static str,
    #[source]
    pub source: io::Error,
}

/// The real mounter: mount(2)/umount2(2) through `rustix`, in this process's mount namespace.
#[derive(Clone, Copy, Debug, Default)]
pub struct HostMounter;

impl HostMounter {
    fn remount_bind_read_only(dst: &Path) -> Result<(), MountError> {
        let remount_error = |source: io::Error| MountError::Remount {
            path: dst.to_path_buf(),
            source,
        };
        // Linux ignores MS_RDONLY on the initial MS_BIND: a second mount(2) with
        // MS_REMOUNT|MS_BIND|MS_RDONLY changes the per-mount flags. That call *sets* all of
        // them, so carry over nosuid/nodev/noexec and the atime mode of the new mount, which
        // would otherwise be silently dropped (and which, locked in a user namespace, make
        // the remount fail with EPERM if dropped).
        let vfs = rustix::fs::statvfs(dst).map_err(|errno| remount_error(errno.into()))?;
        use rustix::fs::StatVfsMountFlags as St;
        let mut flags = MountFlags::BIND | MountFlags::RDONLY;
        for (st, ms) in [
            (St::NOSUID, MountFlags::NOSUID),
            (St::NODEV, MountFlags::NODEV),
            (St::NOEXEC, MountFlags::NOEXEC),
            (St::NOATIME, MountFlags::NOATIME),
            (St::NODIRATIME, MountFlags::NODIRATIME),
            (St::RELATIME, MountFlags::RELATIME),
        ] {
            if vfs.f_flag.contains(st) {
                flags |= ms;
            }
        }
        if !vfs.f_flag.intersects(St::NOATIME | St::RELATIME) {
            // Without an atime flag the kernel defaults to relatime.
            flags |= MountFlags::STRICTATIME;
        }
        rustix::mount::mount_remount(dst, flags, "").map_err(|errno| remount_error(errno.into()))
    }

    /// After EINVAL or ENOENT from umount2: success only if the path is verifiably not a
    /// mount point (EINVAL also means "locked mount" or bad flags).
    fn verify_unmounted(path: &Path, errno: rustix::io::Errno) -> Result<(), MountError> {
        if MountTable::read()?.is_mount_point_nofollow(path) {
            Err(MountError::Unmount {
                path: path.to_path_buf(),
                source: errno.into(),
            })
        } else {
            Ok(())
        }
    }
}

impl Mounter for HostMounter {
    fn bind_mount(&self, src: &Path, dst: &Path, readonly: bool) -> Result<(), MountError> {
        rustix::mount::mount_bind(src, dst).map_err(|errno| MountError::Bind {
            src: src.to_path_buf(),
            dst: dst.to_path_buf(),
            source: errno.into(),
        })?;
        if readonly && let Err(err) = Self::remount_bind_read_only(dst) {
            // Never leave a writable mount where a read-only one was asked for.
            if rustix::mount::unmount(dst, UnmountFlags::NOFOLLOW).is_err() {
                let _ = rustix::mount::unmount(dst, UnmountFlags::NOFOLLOW | UnmountFlags::DETACH);
            }
            return Err(err);
        }
        Ok(())
    }

    fn unmount(&self, path: &Path) -> Result<(), MountError> {
        for _ in 0..MAX_STACKED_MOUNTS {
            // UMOUNT_NOFOLLOW: a plugin could have replaced the target by a symlink to
            // somewhere else; we unmount only what is at this very path.
            match rustix::mount::unmount(path, UnmountFlags::NOFOLLOW) {
                Ok(()) => match statx_mount_root(path) {
                    Some(false) => return Ok(()),
                    // Another mount was stacked below: peel it too.
                    Some(true) => {}
                    None => {
                        if !MountTable::read()?.is_mount_point_nofollow(path) {
                            return Ok(());
                        }
                    }
                },
                Err(errno @ (rustix::io::Errno::INVAL | rustix::io::Errno::NOENT)) => {
                    return Self::verify_unmounted(path, errno);
                }
                Err(errno) => {
                    return Err(MountError::Unmount {
                        path: path.to_path_buf(),
                        source: errno.into(),
                    });
                }
            }
        }
        Err(MountError::StillMounted {
            path: path.to_path_buf(),
            attempts: MAX_STACKED_MOUNTS,
        })
    }

    fn mount_table(&self) -> Result<MountTable, MountError> {
        MountTable::read()
    }

    fn attach_clone(
        &self,
        source: BorrowedFd<'_>,
        onto: BorrowedFd<'_>,
    ) -> Result<OwnedFd, AttachError> {
        let failed = |op: &'static str| {
            move |errno: rustix::io::Errno| AttachError {
                op,
                source: errno.into(),
            }
        };
        let tree = rustix::mount::open_tree(
            source,
            "",
            OpenTreeFlags::OPEN_TREE_CLONE
                | OpenTreeFlags::OPEN_TREE_CLOEXEC
                | OpenTreeFlags::AT_EMPTY_PATH,
        )
        .map_err(failed("clone of the target"))?;
        rustix::mount::move_mount(
            tree.as_fd(),
            "",
            onto,
            "",
            MoveMountFlags::MOVE_MOUNT_F_EMPTY_PATH | MoveMountFlags::MOVE_MOUNT_T_EMPTY_PATH,
        )
        .map_err(failed("mount"))?;
        Ok(tree)
    }

    fn unmount_nofollow(&self, path: &Path) -> io::Result<()> {
        rustix::mount::unmount(path, UnmountFlags::NOFOLLOW).map_err(Into::into)
    }

    fn detach(&self, path: &Path) -> io::Result<()> {
        rustix::mount::unmount(path, UnmountFlags::DETACH).map_err(Into::into)
    }

    fn remount_read_only(&self, path: &Path) -> Result<(), MountError> {
        Self::remount_bind_read_only(path)
    }

    fn identity(&self, fd: BorrowedFd<'_>, at: &Path) -> Result<Identity, BeneathError> {
        beneath::identity(fd, at)
    }
}

/// One mount made by [`FakeMounter`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FakeMount {
    pub src: PathBuf,
    pub dst: PathBuf,
    pub readonly: bool,
}

/// A file's device and inode: what the fake's mounts are keyed by, so that a dir reached by
/// any path (or fd) is the same mount point, as it is for the kernel.
type InodeKey = (u32, u32, u64);

/// A [`FakeMounter`] mount with what its identity overlay needs.
#[derive(Clone, Debug)]
struct FakeEntry {
    mount: FakeMount,
    mount_id: u64,
    /// The mount point dir's own inode.
    point: InodeKey,
    /// The inode the mount shows at its root (the bound dir's).
    root: InodeKey,
}

#[derive(Debug, Default)]
struct FakeState {
    entries: Vec<FakeEntry>,
    /// Mounts only the table shows (made by "someone else": a plugin, an operator).
    foreign: Vec<MountInfo>,
    next_id: u64,
    fail_attach: Option<io::ErrorKind>,
    fail_unmount: Option<i32>,
}

/// Fake mount ids start far above any real one, so that a fake id never names a real mount.
const FAKE_MOUNT_IDS: u64 = 1 << 40;

/// An in-memory mounter for tests without root: records mounts, reports them in its table
/// and overlays them on [`Mounter::identity`] (a dir it "mounted" on shows the bound dir's
/// inode as a mount root with the fake mount's id), so that code walking real directories
/// through fds sees the fake mounts the way it would see real ones. It checks that both paths
/// exist, as the kernel would, and can be told to fail the next attach or every unmount.
#[derive(Debug, Default)]
pub struct FakeMounter {
    state: Mutex<FakeState>,
}

impl FakeMounter {
    pub fn new() -> Self {
        Self::default()
    }

    fn state(&self) -> std::sync::MutexGuard<'_, FakeState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The current mounts, oldest first.
    pub fn mounts(&self) -> Vec<FakeMount> {
        self.state()
            .entries
            .iter()
            .map(|entry| entry.mount.clone())
            .collect()
    }

    /// Shows a mount at `mount_point` in the table only, as one made outside this mounter
    /// (by a plugin or an operator) would be.
    pub fn add_foreign(&self, mount_point: &Path) {
        let mut state = self.state();
        let mount_id = FAKE_MOUNT_IDS + state.next_id;
        state.next_id += 1;
        state.foreign.push(MountInfo {
            mount_id,
            parent_id: 1,
            major: 0,
            minor: 0,
            root: PathBuf::from("/"),
            mount_point: canonical(mount_point),
            mount_options: "rw".to_owned(),
            optional_fields: Vec::new(),
            fs_type: "foreign".to_owned(),
            source: "foreign".to_owned(),
            super_options: "rw".to_owned(),
        });
    }

    /// The next [`Mounter::attach_clone`] fails with `kind` (once).
    pub fn fail_next_attach(&self, kind: io::ErrorKind) {
        self.state().fail_attach = Some(kind);
    }

    /// Every [`Mounter::unmount_nofollow`] fails with `errno` (say `EBUSY`) until
    /// [`FakeMounter::allow_unmounts`].
    pub fn fail_unmounts(&self, errno: i32) {
        self.state().fail_unmount = Some(errno);
    }

    pub fn allow_unmounts(&self) {
        self.state().fail_unmount = None;
    }

    /// Records a mount of `root` (a dir) on `point` (a dir) and returns its id.
    fn push(&self, src: PathBuf, dst: PathBuf, point: InodeKey, root: InodeKey) -> u64 {
        let mut state = self.state();
        let mount_id = FAKE_MOUNT_IDS + state.next_id;
        state.next_id += 1;
        state.entries.push(FakeEntry {
            mount: FakeMount {
                src,
                dst,
                readonly: false,
            },
            mount_id,
            point,
            root,
        });
        mount_id
    }

    /// Removes the topmost mount on the dir `point`; false if there is none.
    fn pop_at(&self, point: InodeKey) -> bool {
        let mut state = self.state();
        match state.entries.iter().rposition(|entry| entry.point == point) {
            Some(index) => {
                state.entries.remove(index);
                true
            }
            None => false,
        }
    }
}

/// The device and inode of what `path` names; `follow`: through a final symlink.
fn inode_of_path(path: &Path, follow: bool) -> io::Result<InodeKey> {
    use rustix::fs::{AtFlags, StatxFlags};
    let flags = if follow {
        AtFlags::empty()
    } else {
        AtFlags::SYMLINK_NOFOLLOW
    };
    let stat = rustix::fs::statx(rustix::fs::CWD, path, flags, StatxFlags::BASIC_STATS)?;
    Ok((stat.stx_dev_major, stat.stx_dev_minor, stat.stx_ino))
}

fn inode_of(id: &Identity) -> InodeKey {
    (id.dev_major, id.dev_minor, id.ino)
}

impl Mounter for FakeMounter {
    fn bind_mount(&self, src: &Path, dst: &Path, readonly: bool) -> Result<(), MountError> {
        let bind_err = |source: io::Error| MountError::Bind {
            src: src.to_path_buf(),
            dst: dst.to_path_buf(),
            source,
        };
        let root = inode_of_path(src, true).map_err(bind_err)?;
        let point = inode_of_path(dst, true).map_err(bind_err)?;
        self.push(canonical(src), canonical(dst), point, root);
        if readonly && let Some(last) = self.state().entries.last_mut() {
            last.mount.readonly = true;
        }
        Ok(())
    }

    fn unmount(&self, path: &Path) -> Result<(), MountError> {
        let path = canonical(path);
        self.state().entries.retain(|entry| entry.mount.dst != path);
        Ok(())
    }

    fn mount_table(&self) -> Result<MountTable, MountError> {
        let state = self.state();
        let mut entries: Vec<MountInfo> = state.foreign.clone();
        entries.extend(state.entries.iter().map(|entry| MountInfo {
            mount_id: entry.mount_id,
            parent_id: 1,
            major: 0,
            minor: 0,
            root: entry.mount.src.clone(),
            mount_point: entry.mount.dst.clone(),
            mount_options: if entry.mount.readonly { "ro" } else { "rw" }.to_owned(),
            optional_fields: Vec::new(),
            fs_type: "fake".to_owned(),
            source: "fake".to_owned(),
            super_options: "rw".to_owned(),
        }));
        Ok(MountTable::from_entries(entries))
    }

    fn attach_clone(
        &self,
        source: BorrowedFd<'_>,
        onto: BorrowedFd<'_>,
    ) -> Result<OwnedFd, AttachError> {
        let failed = |op: &'static str| move |source: io::Error| AttachError { op, source };
        if let Some(kind) = self.state().fail_attach.take() {
            return Err(failed("mount")(io::Error::from(kind)));
        }
        let src = fs::read_link(beneath::fd_path(source)).map_err(failed("clone of the target"))?;
        let root = self
            .identity(source, &src)
            .map(|id| inode_of(&id))
            .map_err(|err| failed("clone of the target")(io::Error::other(err.to_string())))?;
        let dst = fs::read_link(beneath::fd_path(onto)).map_err(failed("mount"))?;
        let point = beneath::identity(onto, &dst)
            .map(|id| inode_of(&id))
            .map_err(|err| failed("mount")(io::Error::other(err.to_string())))?;
        // The returned fd names the mount point dir, which the overlay shows as the mount.
        let tree = rustix::io::fcntl_dupfd_cloexec(onto, 0)
            .map_err(|errno| failed("mount")(errno.into()))?;
        self.push(src, dst, point, root);
        Ok(tree)
    }

    fn unmount_nofollow(&self, path: &Path) -> io::Result<()> {
        if let Some(errno) = self.state().fail_unmount {
            return Err(io::Error::from_raw_os_error(errno));
        }
        // umount2 on a path that is not a mount point answers EINVAL.
        if self.pop_at(inode_of_path(path, false)?) {
            Ok(())
        } else {
            Err(io::Error::from_raw_os_error(
                rustix::io::Errno::INVAL.raw_os_error(),
            ))
        }
    }

    fn detach(&self, path: &Path) -> io::Result<()> {
        if self.pop_at(inode_of_path(path, true)?) {
            Ok(())
        } else {
            Err(io::Error::from_raw_os_error(
                rustix::io::Errno::INVAL.raw_os_error(),
            ))
        }
    }

    fn remount_read_only(&self, path: &Path) -> Result<(), MountError> {
        let remount_err = |source: io::Error| MountError::Remount {
            path: path.to_path_buf(),
            source,
        };
        let point = inode_of_path(path, true).map_err(remount_err)?;
        let mut state = self.state();
        match state.entries.iter_mut().rev().find(|e| e.point == point) {
            Some(entry) => {
                entry.mount.readonly = true;
                Ok(())
            }
            None => Err(remount_err(io::Error::from_raw_os_error(
                rustix::io::Errno::INVAL.raw_os_error(),
            ))),
        }
    }

    fn identity(&self, fd: BorrowedFd<'_>, at: &Path) -> Result<Identity, BeneathError> {
        let real = beneath::identity(fd, at)?;
        let state = self.state();
        Ok(
            match state
                .entries
                .iter()
                .rev()
                .find(|e| e.point == inode_of(&real))
            {
                Some(entry) => Identity {
                    dev_major: entry.root.0,
                    dev_minor: entry.root.1,
                    ino: entry.root.2,
                    mount_id: entry.mount_id,
                    mount_root: true,
                },
                None => real,
            },
        )
    }
}

/// Why a directory was left in place by the safe cleanup.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum KeptReason {
    #[error("is a mount point")]
    MountPoint,
    /// Holds a file, a symlink, a mount point or a directory that was kept.
    #[error("is not empty")]
    NotEmpty,
    #[error("is not a directory")]
    NotADirectory,
    #[error("tree deeper than {MAX_CLEANUP_DEPTH} levels")]
    TooDeep,
    #[error("{0}")]
    Error(String),
}

/// What a safe cleanup removed and what it left, and why.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CleanupReport {
    pub removed: Vec<PathBuf>,
    pub kept: Vec<(PathBuf, KeptReason)>,
}

impl CleanupReport {
    /// True if nothing was left behind.
    pub fn is_clean(&self) -> bool {
        self.kept.is_empty()
    }
}

/// The outcome of [`remove_dir_if_unmounted`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Removal {
    Removed,
    /// There was nothing at the path.
    Absent,
    Kept(KeptReason),
}

/// Removes `path` if it is an empty directory that is not a mount point (by `table` or by
/// the kernel's own answer, for mounts newer than the snapshot). Never unlinks a file and
/// never recurses.
pub fn remove_dir_if_unmounted(path: &Path, table: &MountTable) -> Removal {
    match fs::symlink_metadata(path) {
        Ok(meta) if meta.is_dir() => {}
        Ok(_) => return Removal::Kept(KeptReason::NotADirectory),
        Err(err) if err.kind() == io::ErrorKind::NotFound => return Removal::Absent,
        Err(err) => return Removal::Kept(KeptReason::Error(err.to_string())),
    }
    if is_mount_point_now(path, table) {
        return Removal::Kept(KeptReason::MountPoint);
    }
    // rmdir(2) itself refuses a non-empty directory (ENOTEMPTY) and a mount point of this
    // namespace (EBUSY), which closes the race with a mount made after the check.
    match fs::remove_dir(path) {
        Ok(()) => Removal::Removed,
        Err(err) if err.kind() == io::ErrorKind::NotFound => Removal::Absent,
        Err(err) if err.kind() == io::ErrorKind::DirectoryNotEmpty => {
            Removal::Kept(KeptReason::NotEmpty)
        }
        Err(err) if err.kind() == io::ErrorKind::ResourceBusy => {
            Removal::Kept(KeptReason::MountPoint)
        }
        Err(err) => Removal::Kept(KeptReason::Error(err.to_string())),
    }
}

/// Removes every empty, unmounted directory in the tree at `root`, bottom-up, then `root`
/// itself if it became empty. Never descends into a mount point, never follows a symlink,
/// never unlinks a file: a directory holding anything but removable directories is kept and
/// reported. A missing `root` is a clean no-op. This is what garbage collection of
/// `mounts/<enc id>/` uses.
pub fn remove_empty_tree(root: &Path, table: &MountTable) -> CleanupReport {
    let mut report = CleanupReport::default();
    walk(root, table, 0, &mut report);
    report
}

/// Returns true if `dir` is gone afterwards.
fn walk(dir: &Path, table: &MountTable, depth: usize, report: &mut CleanupReport) -> bool {
    let keep = |report: &mut CleanupReport, reason| {
        report.kept.push((dir.to_path_buf(), reason));
        false
    };
    match fs::symlink_metadata(dir) {
        Ok(meta) if meta.is_dir() => {}
        Ok(_) => return keep(report, KeptReason::NotADirectory),
        Err(err) if err.kind() == io::ErrorKind::NotFound => return true,
        Err(err) => return keep(report, KeptReason::Error(err.to_string())),
    }
    // Checked before listing: what is below a mount point belongs to the volume.
    if is_mount_point_now(dir, table) {
        return keep(report, KeptReason::MountPoint);
    }
    if depth >= MAX_CLEANUP_DEPTH {
        return keep(report, KeptReason::TooDeep);
    }
    let entries = match fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(err) => return keep(report, KeptReason::Error(err.to_string())),
    };
    let mut occupied = false;
    for entry in entries {
        let entry = match entry {
            Ok(entry) => entry,
            Err(err) => return keep(report, KeptReason::Error(err.to_string())),
        };
        // file_type() does not follow symlinks: a symlink to a directory is "occupied".
        let is_dir = entry.file_type().map(|t| t.is_dir()).unwrap_or(false);
        if !(is_dir && walk(&entry.path(), table, depth + 1, report)) {
            occupied = true;
        }
    }
    if occupied {
        return keep(report, KeptReason::NotEmpty);
    }
    match remove_dir_if_unmounted(dir, table) {
        Removal::Removed => {
            report.removed.push(dir.to_path_buf());
            true
        }
        Removal::Absent => true,
        Removal::Kept(reason) => keep(report, reason),
    }
}

/// True when this process runs in a mount namespace other than the host's: PID 1's, or, where
/// a sandbox hides PID 1's namespace even from root, some ancestor's.
pub fn in_own_mount_namespace() -> bool {
    let Ok(own) = fs::read_link("/proc/self/ns/mnt") else {
        return false;
    };
    match fs::read_link("/proc/1/ns/mnt") {
        Ok(init) => init != own,
        Err(_) => ancestor_in_other_mount_ns(&own),
    }
}

fn ancestor_in_other_mount_ns(own: &Path) -> bool {
    let mut pid = std::process::id();
    for _ in 0..64 {
        let Ok(status) = fs::read_to_string(format!("/proc/{pid}/status")) else {
            return false;
        };
        let Some(parent) = status
            .lines()
            .find_map(|line| line.strip_prefix("PPid:"))
            .and_then(|ppid| ppid.trim().parse::<u32>().ok())
        else {
            return false;
        };
        if parent <= 1 {
            return false;
        }
        if let Ok(ns) = fs::read_link(format!("/proc/{parent}/ns/mnt"))
            && ns != own
        {
            return true;
        }
        pid = parent;
    }
    false
}

/// For tests that mount: they must never touch the host's mount table, so they run only as
/// root in a mount namespace of their own (the suite runs under `unshare -m --propagation
/// private`) and panic otherwise rather than silently skip. Makes `/` recursively private
/// in that namespace so nothing mounted propagates anywhere.
///
/// # Panics
/// When not root or not in a private mount namespace: that is the point.
pub fn require_private_mount_namespace() {
    assert!(
        rustix::process::geteuid().is_root(),
        "this test mounts: run as root under unshare -m --propagation private"
    );
    assert!(
        in_own_mount_namespace(),
        "this test mounts and this process is in the host's mount namespace \
         (or that cannot be ruled out): run under unshare -m --propagation private"
    );
    static PRIVATE: std::sync::Once = std::sync::Once::new();
    PRIVATE.call_once(|| {
        if let Err(err) = rustix::mount::mount_change(
            "/",
            rustix::mount::MountPropagationFlags::PRIVATE
                | rustix::mount::MountPropagationFlags::REC,
        ) {
            panic!("cannot make / rprivate in the test namespace: {err}");
        }
    });
}

/// For tests: mounts an empty tmpfs on `at` (an existing directory), in the test's private
/// mount namespace ([`require_private_mount_namespace`] is checked first).
///
/// # Panics
/// When the namespace check fails or the mount does.
pub fn mount_test_tmpfs(at: &Path) {
    require_private_mount_namespace();
    if let Err(err) = rustix::mount::mount(
        "tmpfs",
        at,
        "tmpfs",
        rustix::mount::MountFlags::empty(),
        None,
    ) {
        panic!("cannot mount a tmpfs on {}: {err}", at.display());
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
pub(crate) mod tests {
    use super::*;

    /// Mounting tests call this first. They must never touch the host's mount table: they
    /// run only in a mount namespace of their own (the CI runs the suite under
    /// `unshare -m --propagation private`) and panic otherwise, rather than silently skip.
    pub(crate) fn require_private_mount_ns() {
        super::require_private_mount_namespace();
    }

    const SAMPLE: &str = "\
22 28 0:21 / /sys rw,nosuid,nodev,noexec,relatime shared:7 - sysfs sysfs rw
28 1 8:1 / / rw,relatime shared:1 master:2 - ext4 /dev/sda1 rw,errors=remount-ro
36 35 98:0 /mnt1 /mnt/with\\040space\\011tab rw,noatime master:1 propagate_from:3 - ext3 /dev/root rw,errors=continue
40 28 0:50 /src/back\\134slash /data/new\\012line ro,relatime - tmpfs my\\040src rw,size=10k
41 28 0:51 / /private rw - tmpfs none rw
";

    #[test]
    fn parses_fields_escapes_and_optional_fields() {
        let table = MountTable::parse(SAMPLE).unwrap();
        let entries = table.entries();
        assert_eq!(entries.len(), 5);
        assert_eq!(entries[0].mount_point, PathBuf::from("/sys"));
        assert_eq!(entries[0].optional_fields, vec!["shared:7"]);
        assert!(entries[0].is_shared());
        assert_eq!(entries[1].optional_fields, vec!["shared:1", "master:2"]);
        assert_eq!(entries[1].source, "/dev/sda1");
        let spaced = &entries[2];
        assert_eq!(spaced.mount_id, 36);
        assert_eq!(spaced.parent_id, 35);
        assert_eq!((spaced.major, spaced.minor), (98, 0));
        assert_eq!(spaced.root, PathBuf::from("/mnt1"));
        assert_eq!(spaced.mount_point, PathBuf::from("/mnt/with space\ttab"));
        assert_eq!(spaced.optional_fields, vec!["master:1", "propagate_from:3"]);
        assert_eq!(spaced.fs_type, "ext3");
        assert_eq!(spaced.super_options, "rw,errors=continue");
        assert!(!spaced.is_shared());
        assert_eq!(entries[3].root, PathBuf::from("/src/back\\slash"));
        assert_eq!(entries[3].mount_point, PathBuf::from("/data/new\nline"));
        assert_eq!(entries[3].source, "my src");
        assert!(entries[3].is_read_only());
        assert!(!entries[2].is_read_only());
        assert!(entries[4].optional_fields.is_empty());
        assert!(table.is_mount_point(Path::new("/mnt/with space\ttab")));
        assert!(table.is_mount_point(Path::new("/data/new\nline")));
        assert!(!table.is_mount_point(Path::new("/mnt")));
        assert_eq!(
            table.mount_at(Path::new("/private")).map(|m| m.mount_id),
            Some(41)
        );
    }

    #[test]
    fn parses_non_utf8_paths() {
        let table = MountTable::parse_bytes(b"1 0 0:1 / /a\xffb rw - tmpfs t rw\n").unwrap();
        use std::os::unix::ffi::OsStrExt;
        assert_eq!(
            table.entries()[0].mount_point.as_os_str().as_bytes(),
            b"/a\xffb"
        );
    }

    #[test]
    fn rejects_malformed_lines_with_their_number() {
        for (text, line) in [
            ("1 0 0:1 / / rw - tmpfs\n", 1),
            (
                "22 28 0:21 / /sys rw - sysfs sysfs rw\nnot a mountinfo line\n",
                2,
            ),
            ("x 0 0:1 / / rw - tmpfs t rw\n", 1),
            ("1 0 01 / / rw - tmpfs t rw\n", 1),
            ("1 0 0:1 / / rw tmpfs t rw\n", 1),
        ] {
            match MountTable::parse(text) {
                Err(MountError::Parse { line: got, .. }) => assert_eq!(got, line, "{text}"),
                other => panic!("{text:?}: {other:?}"),
            }
        }
    }

    #[test]
    fn reads_the_live_table() {
        let table = MountTable::read().unwrap();
        assert!(table.is_mount_point(Path::new("/")));
        assert!(!table.mounts_under(Path::new("/")).is_empty());
    }

    #[test]
    fn lookups_canonicalize() {
        let dir = tempfile::tempdir().unwrap();
        let real = dir.path().canonicalize().unwrap();
        fs::create_dir(real.join("m")).unwrap();
        std::os::unix::fs::symlink(real.join("m"), real.join("link")).unwrap();
        let table = MountTable::parse(&format!(
            "1 0 0:1 / {}/m rw - tmpfs t rw\n2 1 0:2 / {}/m/sub rw - tmpfs t rw\n",
            real.display(),
            real.display()
        ))
        .unwrap();
        assert!(table.is_mount_point(&real.join("link")));
        assert!(!table.is_mount_point_nofollow(&real.join("link")));
        assert!(table.is_mount_point_nofollow(&real.join("m")));
        assert!(table.is_mount_point(&real.join("m/../m")));
        assert!(!table.is_mount_point(&real));
        assert_eq!(table.mounts_under(&real.join("link")).len(), 2);
        assert_eq!(table.mounts_under(&real.join("m/sub")).len(), 1);
        // A path that does not exist resolves through its parent.
        assert!(table.is_mount_point(&real.join("m/sub")));
        assert!(!table.is_mount_point(&real.join("m/gone")));
    }

    #[test]
    fn cleanup_keeps_what_the_table_says_is_mounted() {
        // Needs no root: the table is fake, and the cleanup must trust it.
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().canonicalize().unwrap().join("vol");
        fs::create_dir_all(root.join("staging")).unwrap();
        fs::create_dir_all(root.join("target/deep")).unwrap();
        let table = MountTable::parse(&format!(
            "1 0 0:1 / {} rw - tmpfs t rw\n",
            root.join("staging").display()
        ))
        .unwrap();
        let report = remove_empty_tree(&root, &table);
        assert_eq!(
            report.removed,
            vec![root.join("target/deep"), root.join("target")]
        );
        assert_eq!(
            report.kept,
            vec![
                (root.join("staging"), KeptReason::MountPoint),
                (root.clone(), KeptReason::NotEmpty)
            ]
        );
        assert!(root.join("staging").exists());
        assert_eq!(
            remove_dir_if_unmounted(&root.join("staging"), &table),
            Removal::Kept(KeptReason::MountPoint)
        );
        // Once the table says it is unmounted, the rest goes.
        let report = remove_empty_tree(&root, &MountTable::default());
        assert!(report.is_clean(), "{report:?}");
        assert!(!root.exists());
        assert!(remove_empty_tree(&root, &MountTable::default()).is_clean());
        assert_eq!(
            remove_dir_if_unmounted(&root, &MountTable::default()),
            Removal::Absent
        );
    }

    #[test]
    fn cleanup_never_removes_files_or_follows_symlinks() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("vol");
        let outside = dir.path().join("outside");
        fs::create_dir_all(outside.join("empty")).unwrap();
        fs::create_dir_all(root.join("a")).unwrap();
        fs::write(root.join("a/data"), b"precious").unwrap();
        fs::create_dir_all(root.join("b/empty")).unwrap();
        std::os::unix::fs::symlink(&outside, root.join("link")).unwrap();
        let report = remove_empty_tree(&root, &MountTable::default());
        assert_eq!(report.removed, vec![root.join("b/empty"), root.join("b")]);
        assert!(
            report
                .kept
                .contains(&(root.join("a"), KeptReason::NotEmpty))
        );
        assert!(report.kept.contains(&(root.clone(), KeptReason::NotEmpty)));
        assert_eq!(fs::read(root.join("a/data")).unwrap(), b"precious");
        assert!(outside.join("empty").exists());
        assert_eq!(
            remove_dir_if_unmounted(&root.join("a/data"), &MountTable::default()),
            Removal::Kept(KeptReason::NotADirectory)
        );
    }

    #[test]
    fn fake_mounter_reports_its_mounts() {
        let dir = tempfile::tempdir().unwrap();
        let (src, dst) = (dir.path().join("src"), dir.path().join("dst"));
        fs::create_dir(&src).unwrap();
        fs::create_dir(&dst).unwrap();
        let mounter = FakeMounter::new();
        assert!(
            mounter
                .bind_mount(&src, &dir.path().join("missing"), false)
                .is_err()
        );
        mounter.bind_mount(&src, &dst, true).unwrap();
        let table = mounter.mount_table().unwrap();
        assert!(table.is_mount_point(&dst));
        assert!(table.mount_at(&dst).unwrap().is_read_only());
        mounter.unmount(&dst).unwrap();
        mounter.unmount(&dst).unwrap();
        assert!(!mounter.mount_table().unwrap().is_mount_point(&dst));
    }

    // --- Real mounts: root, private mount namespace. ---

    fn live_mount_at(path: &Path) -> Option<MountInfo> {
        MountTable::read().unwrap().mount_at(path).cloned()
    }

    #[test]
    fn bind_mount_appears_and_unmount_removes_it() {
        require_private_mount_ns();
        let dir = tempfile::tempdir().unwrap();
        let (src, dst) = (dir.path().join("src"), dir.path().join("dst with space"));
        fs::create_dir(&src).unwrap();
        fs::create_dir(&dst).unwrap();
        fs::write(src.join("file"), b"hello").unwrap();
        let mounter = HostMounter;
        mounter.bind_mount(&src, &dst, false).unwrap();
        let mount = live_mount_at(&dst).expect("bind mount in mountinfo");
        assert!(!mount.is_read_only());
        assert_eq!(fs::read(dst.join("file")).unwrap(), b"hello");
        fs::write(dst.join("new"), b"x").unwrap();
        assert!(statx_mount_root(&dst).unwrap_or(true));

        mounter.unmount(&dst).unwrap();
        assert!(live_mount_at(&dst).is_none());
        assert!(!dst.join("file").exists());
        assert_eq!(fs::read(src.join("new")).unwrap(), b"x");
        // Unmounting what is not mounted, or not there, succeeds.
        mounter.unmount(&dst).unwrap();
        mounter.unmount(&dir.path().join("missing")).unwrap();
    }

    #[test]
    fn unmount_peels_stacked_mounts_and_ignores_symlinks() {
        require_private_mount_ns();
        let dir = tempfile::tempdir().unwrap();
        let (src, dst) = (dir.path().join("src"), dir.path().join("dst"));
        fs::create_dir(&src).unwrap();
        fs::create_dir(&dst).unwrap();
        let mounter = HostMounter;
        mounter.bind_mount(&src, &dst, false).unwrap();
        mounter.bind_mount(&src, &dst, false).unwrap();
        // A symlink to a mount point is not that mount point: unmounting the link must not
        // unmount its target (a plugin could plant one).
        let link = dir.path().join("link");
        std::os::unix::fs::symlink(&dst, &link).unwrap();
        mounter.unmount(&link).unwrap();
        assert!(live_mount_at(&dst).is_some());
        mounter.unmount(&dst).unwrap();
        assert!(live_mount_at(&dst).is_none());
    }

    #[test]
    fn read_only_bind_refuses_writes_and_keeps_flags() {
        require_private_mount_ns();
        let dir = tempfile::tempdir().unwrap();
        let (src, dst) = (dir.path().join("src"), dir.path().join("dst"));
        fs::create_dir(&src).unwrap();
        fs::create_dir(&dst).unwrap();
        // A nosuid,nodev source: the read-only bind must keep both.
        rustix::mount::mount(
            "tmpfs",
            &src,
            "tmpfs",
            MountFlags::NOSUID | MountFlags::NODEV,
            None,
        )
        .unwrap();
        fs::write(src.join("file"), b"data").unwrap();
        let mounter = HostMounter;
        mounter.bind_mount(&src, &dst, true).unwrap();
        let mount = live_mount_at(&dst).unwrap();
        assert!(mount.is_read_only(), "{mount:?}");
        let options: Vec<&str> = mount.mount_options.split(',').collect();
        assert!(
            options.contains(&"nosuid") && options.contains(&"nodev"),
            "{mount:?}"
        );
        let err = fs::write(dst.join("other"), b"x").unwrap_err();
        assert_eq!(
            err.raw_os_error(),
            Some(rustix::io::Errno::ROFS.raw_os_error())
        );
        assert_eq!(fs::read(dst.join("file")).unwrap(), b"data");
        // The source stays writable.
        fs::write(src.join("other"), b"x").unwrap();
        mounter.unmount(&dst).unwrap();
        mounter.unmount(&src).unwrap();
        assert!(live_mount_at(&dst).is_none() && live_mount_at(&src).is_none());
    }

    #[test]
    fn cleanup_refuses_real_mount_points_and_non_empty_dirs() {
        require_private_mount_ns();
        let dir = tempfile::tempdir().unwrap();
        let src = dir.path().join("backing");
        fs::create_dir(&src).unwrap();
        fs::write(src.join("precious"), b"data").unwrap();
        let root = dir.path().join("mounts/vol");
        for sub in ["staging", "target", "empty/deeper"] {
            fs::create_dir_all(root.join(sub)).unwrap();
        }
        fs::write(root.join("staging/file"), b"x").unwrap();
        let mounter = HostMounter;
        mounter
            .bind_mount(&src, &root.join("target"), false)
            .unwrap();

        // With a stale (empty) table, the kernel's own answer still protects the mount.
        for table in [MountTable::read().unwrap(), MountTable::default()] {
            let report = remove_empty_tree(&root, &table);
            assert!(
                report
                    .kept
                    .contains(&(root.join("target"), KeptReason::MountPoint)),
                "{report:?}"
            );
            assert!(
                report
                    .kept
                    .contains(&(root.join("staging"), KeptReason::NotEmpty)),
                "{report:?}"
            );
            assert!(report.kept.contains(&(root.clone(), KeptReason::NotEmpty)));
            assert_eq!(fs::read(root.join("target/precious")).unwrap(), b"data");
        }
        assert!(!root.join("empty").exists());
        assert_eq!(
            remove_dir_if_unmounted(&root.join("target"), &MountTable::default()),
            Removal::Kept(KeptReason::MountPoint)
        );

        mounter.unmount(&root.join("target")).unwrap();
        fs::remove_file(root.join("staging/file")).unwrap();
        let report = remove_empty_tree(&root, &MountTable::read().unwrap());
        assert!(report.is_clean(), "{report:?}");
        assert!(!root.exists());
        assert_eq!(fs::read(src.join("precious")).unwrap(), b"data");
    }
}
