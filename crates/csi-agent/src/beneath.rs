//! Paths resolved beneath a root without following symlinks: the one way csi-agent opens,
//! creates and removes a directory whose path comes from outside the process (a workload's
//! `bind_to`, a record read back from disk).
//!
//! A path string can change meaning between the check and the use: a component swapped for a
//! symlink sends the next syscall somewhere else (the kubelet's subPath escape,
//! CVE-2017-1002101; runc's CVE-2019-19921 and CVE-2024-21626 — see docs/design.md). So this
//! module never checks a path and then uses it: it walks the path one component at a time
//! with `openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS)` from an
//! `O_PATH` fd of the root, creates missing components with `mkdirat` on the parent fd, and
//! hands back the final fd. Callers then act on the fd (mount onto it, `statx` it, unmount
//! `/proc/self/fd/N`), never on the path again.
//!
//! It owns the lexical rules too ([`normalized_relative`]): absolute input, no `.`, `..`,
//! empty components or NUL, bounded lengths. Those rules make error messages precise; the
//! kernel flags are what make the walk safe.
//!
//! It must not decide which roots are allowed (the caller does) and must not mount anything.

use std::ffi::OsStr;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Component, Path, PathBuf};

use rustix::fs::{AtFlags, Mode, OFlags, ResolveFlags, StatxFlags};
use rustix::io::Errno;

mod file_node;
pub use file_node::{NodeKind, OpenedNode, node_kind, open_node, remove_created_file};

/// The longest path accepted (Linux's `PATH_MAX`, terminating NUL included).
pub const MAX_PATH_BYTES: usize = 4095;
/// The longest single component accepted (Linux's `NAME_MAX`).
pub const MAX_COMPONENT_BYTES: usize = 255;
/// The deepest path accepted; deeper ones are refused before any syscall.
pub const MAX_DEPTH: usize = 64;

/// Why a path could not be used.
#[derive(Debug, thiserror::Error)]
pub enum BeneathError {
    /// The path breaks a lexical rule; nothing was touched.
    #[error("{path:?} {reason}")]
    Invalid { path: PathBuf, reason: String },
    /// A component is a symlink (or a magic link): refused, never followed.
    #[error("{} is a symlink; csi-agent never follows symlinks beneath {}", at.display(), root.display())]
    Symlink { at: PathBuf, root: PathBuf },
    /// A component exists but is not a directory.
    #[error("{} is not a directory", at.display())]
    NotADirectory { at: PathBuf },
    /// A component does not exist (and creating was not asked for).
    #[error("{} does not exist", at.display())]
    NotFound { at: PathBuf },
    /// The kernel refused the walk because it would leave the root.
    #[error("{} resolves outside {}", at.display(), root.display())]
    Escapes { at: PathBuf, root: PathBuf },
    /// Any other error of a syscall on `at`.
    #[error("{op} {}: {source}", at.display())]
    Io {
        op: &'static str,
        at: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// Checks `path` lexically and returns it relative to `root` (both absolute). `root` is the
/// operator's, trusted as given; `path` is refused unless it is normalised (no `.`, `..`,
/// `//`, trailing `/`), free of NUL, within the length limits and strictly beneath `root`.
pub fn normalized_relative(root: &Path, path: &Path) -> Result<PathBuf, BeneathError> {
    check_form(path)?;
    match path.strip_prefix(root) {
        Ok(relative) if !relative.as_os_str().is_empty() => Ok(relative.to_path_buf()),
        _ => Err(BeneathError::Invalid {
            path: path.to_path_buf(),
            reason: format!("is not beneath {}", root.display()),
        }),
    }
}

/// The lexical rules of [`normalized_relative`] without a root: absolute, normalised, no
/// NUL, within the length limits.
pub fn check_form(path: &Path) -> Result<(), BeneathError> {
    let invalid = |reason: &str| BeneathError::Invalid {
        path: path.to_path_buf(),
        reason: reason.to_owned(),
    };
    let bytes = path.as_os_str().as_bytes();
    if bytes.contains(&0) {
        return Err(invalid("contains a NUL byte"));
    }
    if bytes.len() > MAX_PATH_BYTES {
        return Err(invalid(&format!(
            "is {} bytes long: at most {MAX_PATH_BYTES} are allowed",
            bytes.len()
        )));
    }
    if !path.is_absolute() {
        return Err(invalid("is not an absolute path"));
    }
    // `Path::components` silently folds `//`, `/./` and a trailing `/`; the raw bytes must
    // already be in the normal form so that what the caller sees is what is used.
    if bytes.windows(2).any(|w| w == b"//") || (bytes.len() > 1 && bytes.ends_with(b"/")) {
        return Err(invalid(
            "is not normalised (no empty components or trailing '/' allowed)",
        ));
    }
    let mut depth = 0;
    for component in path.components() {
        match component {
            Component::RootDir => {}
            Component::Normal(name) => {
                depth += 1;
                if name.len() > MAX_COMPONENT_BYTES {
                    return Err(invalid(&format!(
                        "has a component longer than {MAX_COMPONENT_BYTES} bytes"
                    )));
                }
                if name == OsStr::new(".") {
                    return Err(invalid("contains a '.' component"));
                }
            }
            Component::CurDir => return Err(invalid("contains a '.' component")),
            Component::ParentDir => return Err(invalid("contains a '..' component")),
            Component::Prefix(_) => return Err(invalid("is not a Unix path")),
        }
    }
    // `components()` drops interior `.`; look for it in the raw bytes too.
    if bytes.split(|b| *b == b'/').any(|c| c == b".") {
        return Err(invalid("contains a '.' component"));
    }
    if depth > MAX_DEPTH {
        return Err(invalid(&format!(
            "is {depth} components deep: at most {MAX_DEPTH} are allowed"
        )));
    }
    Ok(())
}

/// Opens `root` itself as an `O_PATH` directory fd. The root is the operator's and may
/// itself be reached through symlinks.
pub fn open_root(root: &Path) -> Result<OwnedFd, BeneathError> {
    rustix::fs::open(
        root,
        OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .map_err(|errno| io_error("open", root, errno))
}

/// The resolve flags of every step: stay beneath the dir fd, follow no link of any kind.
fn resolve_flags() -> ResolveFlags {
    ResolveFlags::BENEATH | ResolveFlags::NO_SYMLINKS | ResolveFlags::NO_MAGICLINKS
}

/// An opened directory beneath a root, with how many of its trailing components this call
/// created (so that whoever undoes the work removes exactly those).
#[derive(Debug)]
pub struct OpenedDir {
    pub fd: OwnedFd,
    pub created: usize,
}

/// Walks `relative` (from [`normalized_relative`]) beneath `root_fd`, one component at a
/// time, refusing symlinks. With `create`, missing directories are made with `mode`
/// (owned by the caller). `root_path` only names things in errors.
pub fn open_dir(
    root_fd: BorrowedFd<'_>,
    root_path: &Path,
    relative: &Path,
    create: Option<Mode>,
) -> Result<OpenedDir, BeneathError> {
    let mut attempt = 0;
    loop {
        match open_dir_once(root_fd, root_path, relative, create) {
            // Creating, a parent we had just opened was removed under us (the last claim
            // of another bind below it left): walk again from the root, a few times.
            Err(BeneathError::NotFound { .. }) if create.is_some() && attempt < 3 => {
                attempt += 1;
            }
            other => return other,
        }
    }
}

fn open_dir_once(
    root_fd: BorrowedFd<'_>,
    root_path: &Path,
    relative: &Path,
    create: Option<Mode>,
) -> Result<OpenedDir, BeneathError> {
    let mut current: Option<OwnedFd> = None;
    let mut at = root_path.to_path_buf();
    let mut created = 0;
    for component in relative.components() {
        let Component::Normal(name) = component else {
            return Err(BeneathError::Invalid {
                path: relative.to_path_buf(),
                reason: "is not a normalised relative path".to_owned(),
            });
        };
        at.push(name);
        let parent = current.as_ref().map_or(root_fd, |fd| fd.as_fd());
        let fd = match open_step(parent, name, &at, root_path) {
            Ok(fd) => {
                // A component that already existed after one we created: someone raced us.
                // Counting only a trailing run keeps the undo to what is certainly ours.
                created = 0;
                fd
            }
            Err(BeneathError::NotFound { .. }) if create.is_some() => {
                let mode = create.unwrap_or(Mode::RWXU);
                purge_stale_new_dirs_in(parent, false);
                match mkdir_marked(parent, name, mode) {
                    Ok(()) => created += 1,
                    // Made by someone else meanwhile: use it, it is not ours to remove.
                    Err(Errno::EXIST) => created = 0,
                    Err(Errno::NOENT) => {
                        return Err(BeneathError::NotFound { at: at.clone() });
                    }
                    Err(errno) => return Err(io_error("mkdir", &at, errno)),
                }
                open_step(parent, name, &at, root_path)?
            }
            Err(err) => return Err(err),
        };
        current = Some(fd);
    }
    match current {
        Some(fd) => Ok(OpenedDir { fd, created }),
        None => Err(BeneathError::Invalid {
            path: relative.to_path_buf(),
            reason: "is empty".to_owned(),
        }),
    }
}

/// Opens the file `name` in the directory `parent` (an fd from [`open_root`] or
/// [`open_dir`]) for reading, refusing a symlink or magic link (the last component is not
/// followed either). `at` only names it in errors. What it is (a regular file, a FIFO that
/// would block a read) is for the caller to check on the fd.
pub fn open_file_in(
    parent: BorrowedFd<'_>,
    name: &OsStr,
    at: &Path,
    root: &Path,
) -> Result<OwnedFd, BeneathError> {
    open_at(parent, name, OFlags::RDONLY | OFlags::NONBLOCK, at, root)
}

fn open_step(
    parent: BorrowedFd<'_>,
    name: &OsStr,
    at: &Path,
    root: &Path,
) -> Result<OwnedFd, BeneathError> {
    open_at(parent, name, OFlags::PATH | OFlags::DIRECTORY, at, root)
}

/// `openat2` of one name in `parent` with `flags`, following no link of any kind (the name
/// itself included), each refusal typed.
fn open_at(
    parent: BorrowedFd<'_>,
    name: &OsStr,
    flags: OFlags,
    at: &Path,
    root: &Path,
) -> Result<OwnedFd, BeneathError> {
    rustix::fs::openat2(
        parent,
        name,
        flags | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::empty(),
        resolve_flags(),
    )
    .map_err(|errno| match errno {
        Errno::LOOP => BeneathError::Symlink {
            at: at.to_path_buf(),
            root: root.to_path_buf(),
        },
        // O_PATH|O_NOFOLLOW opens a final symlink itself, which O_DIRECTORY then refuses.
        Errno::NOTDIR if is_symlink(parent, name) => BeneathError::Symlink {
            at: at.to_path_buf(),
            root: root.to_path_buf(),
        },
        Errno::NOTDIR => BeneathError::NotADirectory {
            at: at.to_path_buf(),
        },
        Errno::NOENT => BeneathError::NotFound {
            at: at.to_path_buf(),
        },
        Errno::XDEV => BeneathError::Escapes {
            at: at.to_path_buf(),
            root: root.to_path_buf(),
        },
        errno => io_error("open", at, errno),
    })
}

/// Whether `name` in `parent` is a symlink itself (not followed); false when it does not
/// exist.
pub fn is_symlink(parent: BorrowedFd<'_>, name: &OsStr) -> bool {
    rustix::fs::statat(parent, name, AtFlags::SYMLINK_NOFOLLOW).is_ok_and(|st| {
        rustix::fs::FileType::from_raw_mode(st.st_mode) == rustix::fs::FileType::Symlink
    })
}

/// The extended attribute that marks a directory csi-agent created for a `bind_to`. The
/// count a bind records covers only what that one call created; a parent made by one claim
/// and shared with another's path below it must go with whichever claim leaves last, and the
/// mark says it is ours to remove then. `trusted.*` can be set only with CAP_SYS_ADMIN, so a
/// user cannot mark a directory of their own for removal.
const CREATED_MARK: &str = "trusted.csi-agent.created";

/// The name prefix of a directory being created: it is made and marked under this name, then
/// renamed to its own, so that a directory never exists under its real name unmarked (a kill
/// between a plain `mkdir` and the mark left a directory nobody would remove).
const NEW_DIR_PREFIX: &str = ".csi-agent-mkdir.";

/// This process's part of [`NEW_DIR_PREFIX`] names: a directory being made by another
/// (killed) process is stale and may be purged; one of ours may be in flight on another thread.
fn new_dir_token() -> &'static str {
    static TOKEN: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    TOKEN.get_or_init(|| format!("{:016x}", rand::random::<u64>()))
}

/// Creates `name` beneath `parent`, already marked as created by csi-agent: made under a
/// temporary name, marked, then renamed into place without replacing anything. `EEXIST`
/// means someone else made `name` first. A file system without extended attributes still
/// gets the directory (the count a bind records then is the only trace).
fn mkdir_marked(parent: BorrowedFd<'_>, name: &OsStr, mode: Mode) -> Result<(), Errno> {
    use std::sync::atomic::{AtomicU64, Ordering};
    static SEQUENCE: AtomicU64 = AtomicU64::new(0);
    let temp = format!(
        "{NEW_DIR_PREFIX}{}.{}",
        new_dir_token(),
        SEQUENCE.fetch_add(1, Ordering::Relaxed)
    );
    rustix::fs::mkdirat(parent, temp.as_str(), mode)?;
    if crate::failpoint::hit("beneath.mkdir.before_mark").is_err() {
        let _ = rustix::fs::unlinkat(parent, temp.as_str(), AtFlags::REMOVEDIR);
        return Err(Errno::IO);
    }
    let marked = rustix::fs::openat(
        parent,
        temp.as_str(),
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .and_then(|fd| rustix::fs::fsetxattr(&fd, CREATED_MARK, b"1", rustix::fs::XattrFlags::empty()));
    if let Err(errno) = marked {
        tracing::debug!(dir = ?name, %errno, "dir created for bind_to not marked");
    }
    if crate::failpoint::hit("beneath.mkdir.before_rename").is_err() {
        let _ = rustix::fs::unlinkat(parent, temp.as_str(), AtFlags::REMOVEDIR);
        return Err(Errno::IO);
    }
    let renamed = rustix::fs::renameat_with(
        parent,
        temp.as_str(),
        parent,
        name,
        rustix::fs::RenameFlags::NOREPLACE,
    );
    if renamed.is_err() {
        let _ = rustix::fs::unlinkat(parent, temp.as_str(), AtFlags::REMOVEDIR);
    }
    renamed
}

/// Removes, inside the directory `name` beneath `parent` (one csi-agent made and is about to
/// remove), the empty directories a killed process left while creating them (see
/// [`NEW_DIR_PREFIX`]), so that they do not keep it from being removed. Inside a directory of
/// ours even an unmarked one goes: a kill between its `mkdir` and its mark leaves it so.
/// Best effort: anything unexpected is left alone.
fn purge_stale_new_dirs(parent: BorrowedFd<'_>, name: &OsStr) {
    if let Ok(dir) = rustix::fs::openat(
        parent,
        name,
        OFlags::PATH | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::empty(),
    ) {
        purge_stale_new_dirs_in(dir.as_fd(), true);
    }
}

/// [`purge_stale_new_dirs`] of the directory `dir` itself (an `O_PATH` fd will do). Unless
/// `dir_is_ours`, only marked leftovers go: the directory may be the workload's, and an
/// unmarked directory there is not known to be ours.
fn purge_stale_new_dirs_in(dir: BorrowedFd<'_>, dir_is_ours: bool) {
    let Ok(dir_fd) = rustix::fs::openat(
        dir,
        ".",
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
        Mode::empty(),
    ) else {
        return;
    };
    let Ok(entries) = rustix::fs::Dir::read_from(&dir_fd) else {
        return;
    };
    let ours = format!("{NEW_DIR_PREFIX}{}.", new_dir_token());
    // Bounded: a directory a workload filled with entries is not scanned to the end.
    for entry in entries.take(4096).flatten() {
        let entry_name = OsStr::from_bytes(entry.file_name().to_bytes());
        let bytes = entry_name.as_bytes();
        if !is_new_dir_name(bytes) || bytes.starts_with(ours.as_bytes()) {
            continue;
        }
        if dir_is_ours || is_marked_created(dir_fd.as_fd(), entry_name) {
            let _ = rustix::fs::unlinkat(&dir_fd, entry_name, AtFlags::REMOVEDIR);
        }
    }
}

/// `.csi-agent-mkdir.<16 hex>.<decimal>`, exactly as [`mkdir_marked`] names them.
fn is_new_dir_name(name: &[u8]) -> bool {
    let Some(rest) = name.strip_prefix(NEW_DIR_PREFIX.as_bytes()) else {
        return false;
    };
    let Some((token, sequence)) = rest.split_at_checked(16) else {
        return false;
    };
    token.iter().all(u8::is_ascii_hexdigit)
        && sequence.first() == Some(&b'.')
        && sequence.len() > 1
        && sequence[1..].iter().all(u8::is_ascii_digit)
}

fn is_marked_created(parent: BorrowedFd<'_>, name: &OsStr) -> bool {
    let Ok(fd) = rustix::fs::openat(
        parent,
        name,
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::empty(),
    ) else {
        return false;
    };
    let mut value = [0u8; 1];
    matches!(rustix::fs::fgetxattr(&fd, CREATED_MARK, &mut value), Ok(1) if value == *b"1")
}

/// Removes the last `count` components of `relative` beneath `root_fd`, deepest first, each
/// only if it is an empty directory that is not a mount point (`unlinkat(AT_REMOVEDIR)`
/// refuses anything else); then the ancestors above them that csi-agent marked as created,
/// while they are empty. A directory still holding something (another claim's path) stops
/// the walk quietly: the claim that empties it removes it. Any other failure stops it and
/// says why.
pub fn remove_trailing_dirs(
    root_fd: BorrowedFd<'_>,
    root_path: &Path,
    relative: &Path,
    count: usize,
) -> Result<(), BeneathError> {
    let names: Vec<&OsStr> = relative.components().map(|c| c.as_os_str()).collect();
    let count = count.min(names.len());
    for keep in (0..names.len()).rev() {
        let ours_by_count = keep >= names.len() - count;
        let name = names[keep];
        let parent_rel: PathBuf = names[..keep].iter().collect();
        let at = root_path.join(&parent_rel).join(name);
        let parent = if parent_rel.as_os_str().is_empty() {
            None
        } else {
            match open_dir(root_fd, root_path, &parent_rel, None) {
                Ok(opened) => Some(opened.fd),
                // The parent is gone or swapped: nothing of ours to remove beneath it.
                Err(BeneathError::NotFound { .. }) => return Ok(()),
                Err(err) => return Err(err),
            }
        };
        let dir = parent.as_ref().map_or(root_fd, |fd| fd.as_fd());
        if !ours_by_count && !is_marked_created(dir, name) {
            return Ok(());
        }
        purge_stale_new_dirs(dir, name);
        match rustix::fs::unlinkat(dir, name, AtFlags::REMOVEDIR) {
            Ok(()) | Err(Errno::NOENT) => {}
            Err(Errno::NOTEMPTY | Errno::EXIST) => return Ok(()),
            Err(errno) => return Err(io_error("rmdir", &at, errno)),
        }
    }
    Ok(())
}

/// What [`identity`] tells about an fd.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Identity {
    pub dev_major: u32,
    pub dev_minor: u32,
    pub ino: u64,
    /// The id of the mount the fd is on (`/proc/self/mountinfo`'s first field).
    pub mount_id: u64,
    /// True when the fd is the root of its mount (something is mounted exactly here).
    pub mount_root: bool,
}

impl Identity {
    /// True when both name the same inode.
    pub fn same_inode(&self, other: &Identity) -> bool {
        self.dev_major == other.dev_major
            && self.dev_minor == other.dev_minor
            && self.ino == other.ino
    }
}

/// `statx` of the fd itself: its inode, its mount id and whether it is a mount root.
pub fn identity(fd: BorrowedFd<'_>, at: &Path) -> Result<Identity, BeneathError> {
    use rustix::fs::StatxAttributes;
    let stat = rustix::fs::statx(
        fd,
        "",
        AtFlags::EMPTY_PATH | AtFlags::SYMLINK_NOFOLLOW,
        StatxFlags::BASIC_STATS | StatxFlags::MNT_ID,
    )
    .map_err(|errno| io_error("statx", at, errno))?;
    Ok(Identity {
        dev_major: stat.stx_dev_major,
        dev_minor: stat.stx_dev_minor,
        ino: stat.stx_ino,
        mount_id: stat.stx_mnt_id,
        mount_root: stat.stx_attributes.contains(StatxAttributes::MOUNT_ROOT),
    })
}

/// The path through which the kernel reaches exactly what `fd` refers to, for syscalls that
/// take no fd (`umount2`, the remount of `mount(2)`). Resolving it follows the magic link to
/// the fd's own file, not to whatever a path string names now.
pub fn fd_path(fd: BorrowedFd<'_>) -> PathBuf {
    use std::os::fd::AsRawFd;
    PathBuf::from(format!("/proc/self/fd/{}", fd.as_raw_fd()))
}

fn io_error(op: &'static str, at: &Path, errno: Errno) -> BeneathError {
    BeneathError::Io {
        op,
        at: at.to_path_buf(),
        source: errno.into(),
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    #[test]
    fn only_names_made_by_mkdir_marked_count_as_leftovers() {
        assert!(is_new_dir_name(b".csi-agent-mkdir.f309abc882d511b8.383"));
        for other in [
            &b".csi-agent-mkdir."[..],
            b".csi-agent-mkdir.f309abc882d511b8",
            b".csi-agent-mkdir.f309abc882d511b8.",
            b".csi-agent-mkdir.f309abc882d511bz.1",
            b".csi-agent-mkdir.f309abc882d511b8.1x",
            b"data",
        ] {
            assert!(
                !is_new_dir_name(other),
                "{}",
                String::from_utf8_lossy(other)
            );
        }
    }

    fn rel(root: &str, path: &str) -> Result<PathBuf, BeneathError> {
        normalized_relative(Path::new(root), Path::new(path))
    }

    #[test]
    fn lexical_rules_refuse_what_is_not_plainly_beneath() {
        assert_eq!(rel("/r", "/r/a/b").ok(), Some(PathBuf::from("a/b")));
        for bad in [
            "/r",
            "/r/",
            "r/a",
            "/r/../etc",
            "/r/a/..",
            "/r//a",
            "/r/./a",
            "/r/a/.",
            "/r/a/",
            "/rx/a",
            "/etc",
            "/r/a\0b",
        ] {
            assert!(rel("/r", bad).is_err(), "{bad:?} accepted");
        }
        let long = format!("/r/{}", "a".repeat(256));
        assert!(
            rel("/r", &long)
                .unwrap_err()
                .to_string()
                .contains("longer than 255")
        );
        let deep = format!("/r{}", "/a".repeat(MAX_DEPTH + 1));
        assert!(rel("/r", &deep).unwrap_err().to_string().contains("deep"));
        let huge = format!("/r{}", "/aaaaaaa".repeat(600));
        assert!(
            rel("/r", &huge)
                .unwrap_err()
                .to_string()
                .contains("bytes long")
        );
    }

    #[test]
    fn walk_creates_refuses_symlinks_and_removes_what_it_made() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let root = dir.path().join("root");
        let outside = dir.path().join("outside");
        std::fs::create_dir_all(root.join("have")).unwrap_or_else(|e| panic!("{e}"));
        std::fs::create_dir_all(&outside).unwrap_or_else(|e| panic!("{e}"));
        std::os::unix::fs::symlink(&outside, root.join("link")).unwrap_or_else(|e| panic!("{e}"));
        std::os::unix::fs::symlink("../outside", root.join("have/rel"))
            .unwrap_or_else(|e| panic!("{e}"));
        let root_fd = open_root(&root).unwrap_or_else(|e| panic!("{e}"));

        let opened = open_dir(
            root_fd.as_fd(),
            &root,
            Path::new("have/x/y"),
            Some(Mode::from_raw_mode(0o755)),
        )
        .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(opened.created, 2);
        assert!(root.join("have/x/y").is_dir());

        for (path, wanted) in [("link/x", "symlink"), ("have/rel/x", "symlink")] {
            let err = open_dir(
                root_fd.as_fd(),
                &root,
                Path::new(path),
                Some(Mode::from_raw_mode(0o755)),
            )
            .map(|_| ())
            .unwrap_err()
            .to_string();
            assert!(err.contains(wanted), "{path}: {err}");
        }
        assert_eq!(
            std::fs::read_dir(&outside).map(|d| d.count()).unwrap_or(99),
            0,
            "nothing may be created outside the root"
        );

        remove_trailing_dirs(root_fd.as_fd(), &root, Path::new("have/x/y"), 2)
            .unwrap_or_else(|e| panic!("{e}"));
        assert!(!root.join("have/x").exists());
        assert!(
            root.join("have").is_dir(),
            "only what the walk created goes"
        );
    }
}
