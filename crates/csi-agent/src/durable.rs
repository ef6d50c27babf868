//! Durable file writes, the one way the engine makes a file appear whole or not at all: a temp
//! file in the target's directory, written, fsynced, renamed over (or, with
//! [`Replace::NoReplace`], next to) the target, and the directory fsynced. It also owns the
//! temp-name scheme every writer uses ([`TEMP_PREFIX`], [`temp_name`]) and [`IoError`], the
//! one way an `io::Error` gets the operation and the path it failed on.
//!
//! Used by the store's file layer (`store/files.rs`), the image store's index
//! (`image/store.rs`), the blob store (`image/blobs.rs`) and the fetcher (`fetch/`). It must
//! not decide where files go, what they hold, or when leftovers are removed: each caller
//! cleans its own directories (at open or load), recognising temp names with
//! [`is_temp_name`] (plus any older scheme it still has to clean, see `store/files.rs`).
//!
//! Temp names are `.tmp-<stem>-<pid>-<16 hex random>`: hidden (a leading `.`, which no
//! digest, encoded volume id or accepted fetch name has), tagged with the writer's pid so a
//! loader can leave alone the temp files its own process may still be writing
//! ([`is_own_temp`]), and created with `O_EXCL | O_NOFOLLOW`, so an existing file or a
//! planted symlink is never written through.

use std::fs::File;
use std::io::{self, Write};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rustix::fs::{AtFlags, Mode, OFlags, RenameFlags};
use rustix::io::Errno;

/// What every temp name (file or directory) of a durable writer starts with.
pub const TEMP_PREFIX: &str = ".tmp-";

/// An I/O error with what was being done and on which path; its `Display` is
/// `<op> <path>: <error>` and its `source` the `io::Error`.
#[derive(Debug, thiserror::Error)]
#[error("{op} {}: {source}", path.display())]
pub struct IoError {
    pub op: &'static str,
    pub path: PathBuf,
    #[source]
    pub source: io::Error,
}

impl IoError {
    pub fn new(op: &'static str, path: impl Into<PathBuf>, source: impl Into<io::Error>) -> Self {
        Self {
            op,
            path: path.into(),
            source: source.into(),
        }
    }

    /// The kind of the underlying `io::Error`.
    pub fn kind(&self) -> io::ErrorKind {
        self.source.kind()
    }
}

/// `map_err(io_err("op", path))`: attaches `op` and `path` to an `io::Error` (or an errno).
pub fn io_err<'a, E: Into<io::Error>>(
    op: &'static str,
    path: &'a Path,
) -> impl FnOnce(E) -> IoError + 'a {
    move |source| IoError::new(op, path, source)
}

/// The longest stem kept in a temp name, so that the name fits in NAME_MAX (255) whatever
/// the target's name (a fetched file's may be 255 bytes).
const MAX_STEM: usize = 128;

/// A fresh temp name for `stem` (cut to [`MAX_STEM`] bytes; see the module doc).
pub fn temp_name(stem: &str) -> String {
    let mut end = stem.len().min(MAX_STEM);
    while !stem.is_char_boundary(end) {
        end -= 1;
    }
    let stem = &stem[..end];
    format!(
        "{TEMP_PREFIX}{stem}-{}-{:016x}",
        std::process::id(),
        rand::random::<u64>()
    )
}

/// True for a name made by [`temp_name`] (or any name starting with [`TEMP_PREFIX`]).
pub fn is_temp_name(name: &[u8]) -> bool {
    name.starts_with(TEMP_PREFIX.as_bytes())
}

/// True for a temp name carrying this process's pid: a write of ours may still be in flight.
pub fn is_own_temp(name: &[u8]) -> bool {
    let Some(rest) = name
        .strip_prefix(TEMP_PREFIX.as_bytes())
        .and_then(|rest| std::str::from_utf8(rest).ok())
    else {
        return false;
    };
    let mut parts = rest.rsplit('-');
    let _random = parts.next();
    parts.next() == Some(std::process::id().to_string().as_str())
}

/// How [`TempFile::persist`] treats an existing target.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Replace {
    /// `rename(2)`: the target (a file, or a symlink itself, never its target) is replaced.
    Overwrite,
    /// `RENAME_NOREPLACE`: an existing target is kept and the temp file discarded.
    NoReplace,
}

/// What [`TempFile::persist`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Persisted {
    /// The temp file is now the target, durably.
    Renamed,
    /// [`Replace::NoReplace`] found the target there; the temp file was removed.
    AlreadyThere,
}

/// A directory opened for durable writes (a real fd, not `O_PATH`: it is fsynced and
/// listed). Temp files are created and renamed relative to this fd, so the writes stay in
/// the directory that was opened even if its path is replaced meanwhile. Cheap to clone.
#[derive(Clone, Debug)]
pub struct Dir {
    path: PathBuf,
    fd: Arc<OwnedFd>,
}

impl Dir {
    /// Opens `path`, which must be a directory.
    pub fn open(path: &Path) -> Result<Self, IoError> {
        let fd = rustix::fs::open(
            path,
            OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
            Mode::empty(),
        )
        .map_err(io_err("open directory", path))?;
        Ok(Self {
            path: path.to_path_buf(),
            fd: Arc::new(fd),
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    /// fsyncs the directory (its entries: creations, renames, removals); returns the time
    /// the fsync took.
    pub fn sync(&self) -> Result<Duration, IoError> {
        let start = Instant::now();
        rustix::fs::fsync(self.fd()).map_err(io_err("fsync directory", &self.path))?;
        Ok(start.elapsed())
    }

    /// Creates a temp file for `stem` (mode `mode`, before the umask) in this directory.
    pub fn create_temp(&self, stem: &str, mode: u32) -> Result<TempFile, IoError> {
        // A random part makes a collision (with a dead writer that had our pid) unlikely;
        // O_EXCL makes one harmless, and a few tries make it vanish.
        let mut attempts = 0;
        loop {
            let name = temp_name(stem);
            match rustix::fs::openat(
                self.fd(),
                name.as_str(),
                OFlags::WRONLY | OFlags::CREATE | OFlags::EXCL | OFlags::NOFOLLOW | OFlags::CLOEXEC,
                Mode::from_raw_mode(mode),
            ) {
                Ok(fd) => {
                    return Ok(TempFile {
                        dir: self.clone(),
                        name: Some(name),
                        file: File::from(fd),
                        synced: None,
                    });
                }
                Err(Errno::EXIST) if attempts < 8 => attempts += 1,
                Err(errno) => {
                    return Err(IoError::new(
                        "create temp file",
                        self.path.join(name),
                        errno,
                    ));
                }
            }
        }
    }
}

/// fsyncs the directory at `path`; returns the time the fsync took.
pub fn sync_dir(path: &Path) -> Result<Duration, IoError> {
    Dir::open(path)?.sync()
}

/// Creates `dir` and its missing ancestors (mode `mode`, before the umask), fsyncing the
/// parent of each directory it creates so that the new entries survive a power cut. Returns
/// the time the fsyncs took.
pub fn create_dir_durable(dir: &Path, mode: u32) -> Result<Duration, IoError> {
    use std::os::unix::fs::DirBuilderExt;
    let mut missing = Vec::new();
    let mut current = dir;
    loop {
        match std::fs::metadata(current) {
            Ok(meta) if meta.is_dir() => break,
            Ok(_) => {
                return Err(IoError::new(
                    "create directory",
                    current,
                    io::Error::from(io::ErrorKind::NotADirectory),
                ));
            }
            Err(err) if err.kind() == io::ErrorKind::NotFound => {
                missing.push(current);
                match current.parent() {
                    Some(parent) if !parent.as_os_str().is_empty() => current = parent,
                    _ => break,
                }
            }
            Err(err) => return Err(IoError::new("stat", current, err)),
        }
    }
    let mut fsync_time = Duration::ZERO;
    for created in missing.into_iter().rev() {
        match std::fs::DirBuilder::new().mode(mode).create(created) {
            Ok(()) => fsync_time += sync_dir(parent_of(created))?,
            // Another writer created it first; it made it durable too.
            Err(err) if err.kind() == io::ErrorKind::AlreadyExists => {}
            Err(err) => return Err(IoError::new("create directory", created, err)),
        }
    }
    Ok(fsync_time)
}

/// The directory holding `path`; an empty parent means the current directory.
pub fn parent_of(path: &Path) -> &Path {
    match path.parent() {
        Some(parent) if !parent.as_os_str().is_empty() => parent,
        _ => Path::new("."),
    }
}

/// A temp file of a [`Dir`], removed when dropped unless [`TempFile::persist`] renamed it.
#[derive(Debug)]
pub struct TempFile {
    dir: Dir,
    name: Option<String>,
    file: File,
    /// Time of the file's fsync, once done.
    synced: Option<Duration>,
}

impl TempFile {
    /// The open file, to write to.
    pub fn file(&mut self) -> &mut File {
        &mut self.file
    }

    /// Where the temp file is (for messages, and for reading it back before it is persisted).
    pub fn path(&self) -> PathBuf {
        self.dir.path.join(self.name.as_deref().unwrap_or_default())
    }

    /// The error of `op` on the temp file.
    pub fn io_error(&self, op: &'static str, source: io::Error) -> IoError {
        IoError::new(op, self.path(), source)
    }

    /// Writes all of `bytes`.
    pub fn write_all(&mut self, bytes: &[u8]) -> Result<(), IoError> {
        self.file
            .write_all(bytes)
            .map_err(|source| self.io_error("write", source))
    }

    /// fsyncs the file's content (once); returns the time the fsync took.
    pub fn sync(&mut self) -> Result<Duration, IoError> {
        if let Some(took) = self.synced {
            return Ok(took);
        }
        let start = Instant::now();
        self.file
            .sync_all()
            .map_err(|source| self.io_error("fsync", source))?;
        let took = start.elapsed();
        self.synced = Some(took);
        Ok(took)
    }

    /// Makes the temp file `name` (one name in the same directory), durably: fsyncs the file
    /// if [`TempFile::sync`] was not called, renames it, fsyncs the directory. Returns what
    /// happened and the time both fsyncs took. On error the temp file is removed.
    pub fn persist(
        mut self,
        name: &str,
        replace: Replace,
    ) -> Result<(Persisted, Duration), IoError> {
        let mut fsync_time = self.sync()?;
        let temp = self.name.as_deref().unwrap_or_default();
        let flags = match replace {
            Replace::Overwrite => RenameFlags::empty(),
            Replace::NoReplace => RenameFlags::NOREPLACE,
        };
        match rustix::fs::renameat_with(self.dir.fd(), temp, self.dir.fd(), name, flags) {
            Ok(()) => self.name = None,
            // Dropping `self` removes the temp file.
            Err(Errno::EXIST) if replace == Replace::NoReplace => {
                return Ok((Persisted::AlreadyThere, fsync_time));
            }
            Err(errno) => return Err(IoError::new("rename over", self.dir.path.join(name), errno)),
        }
        fsync_time += self.dir.sync()?;
        Ok((Persisted::Renamed, fsync_time))
    }
}

impl Drop for TempFile {
    fn drop(&mut self) {
        if let Some(name) = self.name.take()
            && let Err(errno) = rustix::fs::unlinkat(self.dir.fd(), name.as_str(), AtFlags::empty())
            && errno != Errno::NOENT
        {
            // Harmless: never read as data, and removed by its directory's owner at the
            // next open or load.
            tracing::warn!(temp = %self.dir.path.join(&name).display(), %errno, "temp file not removed");
        }
    }
}

/// Replaces `name` in `dir` with `bytes` atomically and durably: a reader sees the old content
/// or the new one, never a mix, and once this returns `Ok` the new content survives a crash or
/// a power cut. The file is created with `mode` (before the umask). `before_rename` runs after
/// the temp file is written and fsynced, before it replaces the target (a failpoint); its
/// error, like any other, leaves the target as it was and removes the temp file. Returns the
/// time the two fsyncs took.
pub fn write_atomic<E: From<IoError>>(
    dir: &Dir,
    name: &str,
    bytes: &[u8],
    mode: u32,
    before_rename: impl FnOnce() -> Result<(), E>,
) -> Result<Duration, E> {
    let mut temp = dir.create_temp(name, mode)?;
    temp.write_all(bytes)?;
    temp.sync()?;
    before_rename()?;
    let (_, fsync_time) = temp.persist(name, Replace::Overwrite)?;
    Ok(fsync_time)
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    fn temps(dir: &Path) -> Vec<String> {
        std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| is_temp_name(n.as_bytes()))
            .collect()
    }

    #[test]
    fn write_atomic_replaces_the_content() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = Dir::open(tmp.path()).unwrap();
        write_atomic::<IoError>(&dir, "f.json", b"old", 0o600, || Ok(())).unwrap();
        write_atomic::<IoError>(&dir, "f.json", b"new", 0o600, || Ok(())).unwrap();
        assert_eq!(std::fs::read(tmp.path().join("f.json")).unwrap(), b"new");
        assert!(temps(tmp.path()).is_empty());
    }

    #[test]
    fn a_failure_between_write_and_rename_keeps_the_old_content() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = Dir::open(tmp.path()).unwrap();
        write_atomic::<IoError>(&dir, "f.json", b"old", 0o600, || Ok(())).unwrap();
        let mut seen = None;
        let err = write_atomic(&dir, "f.json", b"new content", 0o600, || {
            // The temp file is written and fsynced, not yet renamed.
            seen = Some(
                temps(tmp.path())
                    .iter()
                    .map(|n| std::fs::read(tmp.path().join(n)).unwrap())
                    .collect::<Vec<_>>(),
            );
            Err(IoError::new(
                "injected",
                tmp.path(),
                io::Error::other("crash"),
            ))
        })
        .unwrap_err();
        assert_eq!(err.op, "injected");
        assert_eq!(seen.unwrap(), vec![b"new content".to_vec()]);
        assert_eq!(std::fs::read(tmp.path().join("f.json")).unwrap(), b"old");
        assert!(temps(tmp.path()).is_empty(), "the temp file is removed");
    }

    /// A crash (not an error) between write and rename: the steps run up to the rename and
    /// the temp file is leaked as a killed process would (no destructor).
    #[test]
    fn a_crash_between_write_and_rename_keeps_the_old_content() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = Dir::open(tmp.path()).unwrap();
        write_atomic::<IoError>(&dir, "f.json", b"old", 0o600, || Ok(())).unwrap();
        let mut temp = dir.create_temp("f.json", 0o600).unwrap();
        temp.write_all(b"new").unwrap();
        temp.sync().unwrap();
        std::mem::forget(temp);
        assert_eq!(std::fs::read(tmp.path().join("f.json")).unwrap(), b"old");
        let left = temps(tmp.path());
        assert_eq!(left.len(), 1);
        assert!(is_own_temp(left[0].as_bytes()));
        assert!(left[0].starts_with(".tmp-f.json-"));
    }

    #[test]
    fn no_replace_keeps_the_target_and_drops_the_temp() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = Dir::open(tmp.path()).unwrap();
        std::fs::write(tmp.path().join("blob"), b"first").unwrap();
        let mut temp = dir.create_temp("blob", 0o600).unwrap();
        temp.write_all(b"second").unwrap();
        let (persisted, _) = temp.persist("blob", Replace::NoReplace).unwrap();
        assert_eq!(persisted, Persisted::AlreadyThere);
        assert_eq!(std::fs::read(tmp.path().join("blob")).unwrap(), b"first");
        assert!(temps(tmp.path()).is_empty());
    }

    #[test]
    fn the_mode_is_set_at_creation_and_symlinks_are_replaced_not_followed() {
        use std::os::unix::fs::PermissionsExt;
        let tmp = tempfile::tempdir().unwrap();
        let outside = tmp.path().join("outside");
        std::fs::write(&outside, b"untouched").unwrap();
        let inside = tmp.path().join("in");
        std::fs::create_dir(&inside).unwrap();
        std::os::unix::fs::symlink(&outside, inside.join("f")).unwrap();
        let dir = Dir::open(&inside).unwrap();
        write_atomic::<IoError>(&dir, "f", b"mine", 0o600, || Ok(())).unwrap();
        assert_eq!(std::fs::read(&outside).unwrap(), b"untouched");
        let meta = std::fs::symlink_metadata(inside.join("f")).unwrap();
        assert!(meta.is_file());
        assert_eq!(meta.permissions().mode() & 0o777, 0o600);
    }

    #[test]
    fn temp_names_are_recognised() {
        let name = temp_name("volume.json");
        assert!(is_temp_name(name.as_bytes()));
        assert!(is_own_temp(name.as_bytes()));
        assert!(!is_own_temp(b".tmp-volume.json-1-0000000000000000") || std::process::id() == 1);
        assert!(!is_temp_name(b"volume.json"));
        assert!(!is_own_temp(b"volume.json"));
    }

    #[test]
    fn a_long_target_name_still_gets_a_temp_file() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = Dir::open(tmp.path()).unwrap();
        let name = "é".repeat(127); // 254 bytes, a cut inside a character would split one
        write_atomic::<IoError>(&dir, &name, b"x", 0o600, || Ok(())).unwrap();
        assert_eq!(std::fs::read(tmp.path().join(&name)).unwrap(), b"x");
        assert!(temp_name(&name).len() <= 255);
    }

    #[test]
    fn io_errors_name_the_operation_and_the_path() {
        let err = io_err("fsync", Path::new("/x/y"))(io::Error::from(io::ErrorKind::NotFound));
        assert!(err.to_string().starts_with("fsync /x/y: "), "{err}");
        assert_eq!(err.kind(), io::ErrorKind::NotFound);
    }
}
