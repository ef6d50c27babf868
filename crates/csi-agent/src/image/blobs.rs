//! A content-addressed blob store: `<dir>/blobs/sha256/<hex>`, the layout of an OCI image
//! layout's `blobs/` (so a store can later be read by the same code as an imported layout).
//!
//! A blob is written to a temp file in the same directory while it is hashed and counted,
//! checked against the digest and size the caller expects, fsynced, renamed into place with
//! `RENAME_NOREPLACE` and the directory fsynced. So a name under `sha256/` is always a whole,
//! verified blob, even after a crash at any point; what a crash leaves is a temp file (named
//! with a leading `.`, which no valid digest has), never used and removed by [`BlobStore::open`].
//!
//! Digest strings come from manifests, i.e. from outside: [`Digest::parse`] accepts only
//! `sha256:` followed by exactly 64 lowercase hex digits, so a digest can never name anything
//! but a plain file in `sha256/` (no `/`, `..`, NUL or temp name).
//!
//! It must not fetch anything, nor decide when a blob is no longer needed (garbage collection
//! belongs to the image index, `super::store`, which calls [`BlobStore::remove`]). It does keep
//! [`BlobHolds`]: a blob held by a writer that has not indexed it yet (an import, which stores
//! its blobs while it reads the archive, before it takes the image store's lock) is never
//! removed, whatever the index says.

use std::collections::BTreeMap;
use std::fmt;
use std::fs::File;
use std::io::{self, Read};
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::sync::{Arc, Mutex, MutexGuard};

use rustix::fs::{AtFlags, Mode, OFlags};
use rustix::io::Errno;
use sha2::{Digest as _, Sha256};

use crate::durable::{self, IoError, Persisted, Replace, io_err};

/// The only digest algorithm accepted (the one every registry and OCI layout uses).
pub const ALGORITHM: &str = "sha256";
/// Bytes read from the source at a time.
const CHUNK: usize = 64 * 1024;

/// A validated `sha256:<64 lowercase hex>` digest.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Digest {
    hex: String,
}

/// Why a digest string was refused.
#[derive(Debug, thiserror::Error)]
#[error("digest {given:?} {reason}")]
pub struct DigestError {
    /// The string given, cut to a printable length.
    pub given: String,
    pub reason: &'static str,
}

impl Digest {
    /// Parses `sha256:<hex>`; anything else (another algorithm, upper case, the wrong length,
    /// any other character) is refused.
    pub fn parse(given: &str) -> Result<Self, DigestError> {
        let refuse = |reason| DigestError {
            given: given.chars().take(80).collect(),
            reason,
        };
        let Some(hex) = given
            .strip_prefix(ALGORITHM)
            .and_then(|rest| rest.strip_prefix(':'))
        else {
            return Err(refuse(
                "does not start with \"sha256:\" (the only algorithm supported)",
            ));
        };
        if hex.len() != 64 || !hex.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')) {
            return Err(refuse(
                "must have exactly 64 lowercase hex digits after \"sha256:\"",
            ));
        }
        Ok(Self {
            hex: hex.to_owned(),
        })
    }

    /// The digest of `bytes`.
    pub fn of(bytes: &[u8]) -> Self {
        Self::from_hasher(Sha256::new_with_prefix(bytes))
    }

    fn from_hasher(hasher: Sha256) -> Self {
        let out = hasher.finalize();
        let mut hex = String::with_capacity(64);
        for byte in out.iter() {
            hex.push_str(&format!("{byte:02x}"));
        }
        Self { hex }
    }

    /// The 64 hex digits, which are the blob's file name.
    pub fn hex(&self) -> &str {
        &self.hex
    }
}

impl fmt::Display for Digest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{ALGORITHM}:{}", self.hex)
    }
}

impl FromStr for Digest {
    type Err = DigestError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::parse(s)
    }
}

/// Why a blob could not be stored or opened.
#[derive(Debug, thiserror::Error)]
pub enum BlobError {
    /// What was read does not hash to the digest expected; nothing was kept.
    #[error("blob {expected}: content hashes to {actual}; refused")]
    DigestMismatch { expected: Digest, actual: Digest },
    /// The source ended before the size expected; nothing was kept.
    #[error("blob {digest}: expected {expected} bytes, got {actual}; refused")]
    SizeMismatch {
        digest: Digest,
        expected: u64,
        actual: u64,
    },
    /// The source went on past the size expected (reading stopped there); nothing was kept.
    #[error("blob {digest}: more than the {expected} bytes expected; refused")]
    TooLarge { digest: Digest, expected: u64 },
    /// The source failed; nothing was kept.
    #[error("blob {digest}: reading the source: {source}")]
    Read {
        digest: Digest,
        #[source]
        source: io::Error,
    },
    /// The blob asked for is not in the store.
    #[error("blob {digest} is not in the store")]
    NotFound { digest: Digest },
    /// A syscall on the store failed.
    #[error(transparent)]
    Io(#[from] IoError),
}

/// What [`BlobStore::put`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Put {
    /// The blob was verified and stored.
    Stored,
    /// The blob was already there; it was not rewritten (and the source not read, unless a
    /// concurrent put won the rename).
    AlreadyPresent,
}

/// The blob store of one directory. One store per directory per process: [`BlobStore::open`]
/// removes temp files, which would break a put in progress elsewhere.
#[derive(Debug)]
pub struct BlobStore {
    /// `<dir>/blobs/sha256`, opened: blobs are written, renamed and listed relative to it.
    dir: durable::Dir,
    /// How many [`BlobHolds`] hold each blob. [`BlobStore::remove`] takes it for the whole
    /// removal, and a holder takes a blob before it looks for it or renames it into place, so
    /// a blob is never removed once held, nor found present and then removed.
    held: Mutex<BTreeMap<Digest, usize>>,
}

/// Blobs kept from [`BlobStore::remove`] until this is dropped: those a writer stored or found
/// present and will index later (see the module documentation).
#[derive(Debug)]
pub struct BlobHolds {
    store: Arc<BlobStore>,
    digests: Vec<Digest>,
}

impl BlobHolds {
    /// Holds `digest` (again, if already held) until `self` is dropped. Take it before
    /// looking for the blob or storing it.
    pub fn hold(&mut self, digest: &Digest) {
        *self.store.lock_held().entry(digest.clone()).or_insert(0) += 1;
        self.digests.push(digest.clone());
    }
}

impl Drop for BlobHolds {
    fn drop(&mut self) {
        let mut held = self.store.lock_held();
        for digest in self.digests.drain(..) {
            if let Some(count) = held.get_mut(&digest) {
                *count = count.saturating_sub(1);
                if *count == 0 {
                    held.remove(&digest);
                }
            }
        }
    }
}

impl BlobStore {
    /// Opens (creating if needed, mode 0700) `<dir>/blobs/sha256` and removes the temp files a
    /// crash left there. `dir` is the operator's, trusted as given.
    pub fn open(dir: &Path) -> Result<Self, BlobError> {
        let blobs = dir.join("blobs");
        let sha = blobs.join(ALGORITHM);
        {
            use std::os::unix::fs::DirBuilderExt;
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(&sha)
                .map_err(io_err("mkdir", &sha))?;
        }
        // The directories just made must survive a crash before the first blob is renamed in.
        for at in [dir, blobs.as_path()] {
            durable::sync_dir(at)?;
        }
        let store = Self {
            dir: durable::Dir::open(&sha)?,
            held: Mutex::new(BTreeMap::new()),
        };
        store.remove_temp_files()?;
        Ok(store)
    }

    /// A new, empty set of holds on this store's blobs.
    pub fn holds(self: &Arc<Self>) -> BlobHolds {
        BlobHolds {
            store: Arc::clone(self),
            digests: Vec::new(),
        }
    }

    /// Whether some [`BlobHolds`] holds the blob.
    pub fn is_held(&self, digest: &Digest) -> bool {
        self.lock_held().contains_key(digest)
    }

    fn lock_held(&self) -> MutexGuard<'_, BTreeMap<Digest, usize>> {
        // Counts are updated whole: a panic elsewhere cannot leave one half-changed.
        self.held
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Where the blob is (or would be) stored.
    pub fn path_of(&self, digest: &Digest) -> PathBuf {
        self.dir.path().join(digest.hex())
    }

    /// True when the blob is in the store (a regular file under its name).
    pub fn contains(&self, digest: &Digest) -> Result<bool, BlobError> {
        match rustix::fs::statat(self.dir.fd(), digest.hex(), AtFlags::SYMLINK_NOFOLLOW) {
            Ok(stat) => Ok(rustix::fs::FileType::from_raw_mode(stat.st_mode)
                == rustix::fs::FileType::RegularFile),
            Err(Errno::NOENT) => Ok(false),
            Err(errno) => Err(self.io("stat", digest.hex(), errno)),
        }
    }

    /// Opens a stored blob for reading.
    pub fn open_blob(&self, digest: &Digest) -> Result<File, BlobError> {
        match rustix::fs::openat(
            self.dir.fd(),
            digest.hex(),
            OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            Mode::empty(),
        ) {
            Ok(fd) => Ok(File::from(fd)),
            Err(Errno::NOENT) => Err(BlobError::NotFound {
                digest: digest.clone(),
            }),
            Err(errno) => Err(self.io("open", digest.hex(), errno)),
        }
    }

    /// Streams `source` into the store as the blob `expected` of `size` bytes. Reading stops
    /// as soon as more than `size` bytes come; a digest or size mismatch, or a failing
    /// source, leaves nothing behind. A blob already present is not rewritten.
    pub fn put<R: Read>(
        &self,
        mut source: R,
        expected: &Digest,
        size: u64,
    ) -> Result<Put, BlobError> {
        if self.contains(expected)? {
            return Ok(Put::AlreadyPresent);
        }
        let mut temp = self.dir.create_temp(expected.hex(), 0o600)?;
        let mut hasher = Sha256::new();
        let mut buf = vec![0u8; CHUNK];
        let mut total: u64 = 0;
        loop {
            let n = match source.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => n,
                Err(err) if err.kind() == io::ErrorKind::Interrupted => continue,
                Err(source) => {
                    return Err(BlobError::Read {
                        digest: expected.clone(),
                        source,
                    });
                }
            };
            total = total.saturating_add(n as u64);
            if total > size {
                return Err(BlobError::TooLarge {
                    digest: expected.clone(),
                    expected: size,
                });
            }
            let chunk = buf.get(..n).unwrap_or_default();
            hasher.update(chunk);
            temp.write_all(chunk)?;
        }
        if total != size {
            return Err(BlobError::SizeMismatch {
                digest: expected.clone(),
                expected: size,
                actual: total,
            });
        }
        let actual = Digest::from_hasher(hasher);
        if actual != *expected {
            return Err(BlobError::DigestMismatch {
                expected: expected.clone(),
                actual,
            });
        }
        // A concurrent put of the same blob may get there first: its copy is as good as ours.
        Ok(match temp.persist(expected.hex(), Replace::NoReplace)?.0 {
            Persisted::Renamed => Put::Stored,
            Persisted::AlreadyThere => Put::AlreadyPresent,
        })
    }

    /// Streams `source` into the store under the digest its content hashes to, for a blob
    /// whose digest is not known beforehand (a `docker save` layer named by an image id, not
    /// a digest). Reading stops with [`BlobError::TooLarge`] past `max` bytes; a failing
    /// source leaves nothing behind. Returns the digest, the size and whether it was stored
    /// or already there (then the copy just written is discarded). The blob is added to
    /// `holds` as soon as its digest is known, before it is looked for or renamed into place.
    pub fn put_computed<R: Read>(
        &self,
        mut source: R,
        max: u64,
        holds: &mut BlobHolds,
    ) -> Result<(Digest, u64, Put), BlobError> {
        // Until the digest is known, errors name the empty digest.
        let unknown = Digest::of(b"");
        // Named like a put's temp file, so that open removes it after a crash.
        let mut temp = self.dir.create_temp("computed", 0o600)?;
        let mut hasher = Sha256::new();
        let mut buf = vec![0u8; CHUNK];
        let mut total: u64 = 0;
        loop {
            let n = match source.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => n,
                Err(err) if err.kind() == io::ErrorKind::Interrupted => continue,
                Err(source) => {
                    return Err(BlobError::Read {
                        digest: unknown,
                        source,
                    });
                }
            };
            total = total.saturating_add(n as u64);
            if total > max {
                return Err(BlobError::TooLarge {
                    digest: unknown,
                    expected: max,
                });
            }
            let chunk = buf.get(..n).unwrap_or_default();
            hasher.update(chunk);
            temp.write_all(chunk)?;
        }
        let digest = Digest::from_hasher(hasher);
        holds.hold(&digest);
        if self.contains(&digest)? {
            // Dropping `temp` removes the copy.
            return Ok((digest, total, Put::AlreadyPresent));
        }
        let put = match temp.persist(digest.hex(), Replace::NoReplace)?.0 {
            Persisted::Renamed => Put::Stored,
            Persisted::AlreadyThere => Put::AlreadyPresent,
        };
        Ok((digest, total, put))
    }

    /// The size of a stored blob.
    pub fn size_of(&self, digest: &Digest) -> Result<u64, BlobError> {
        match rustix::fs::statat(self.dir.fd(), digest.hex(), AtFlags::SYMLINK_NOFOLLOW) {
            Ok(stat) => Ok(u64::try_from(stat.st_size).unwrap_or(0)),
            Err(Errno::NOENT) => Err(BlobError::NotFound {
                digest: digest.clone(),
            }),
            Err(errno) => Err(self.io("stat", digest.hex(), errno)),
        }
    }

    /// Every blob in the store (names that are not a valid digest are skipped: they are
    /// temp files or not ours).
    pub fn list(&self) -> Result<Vec<Digest>, BlobError> {
        let listing = rustix::fs::openat(
            self.dir.fd(),
            ".",
            OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
            Mode::empty(),
        )
        .map_err(|errno| self.io("open", ".", errno))?;
        let dir = rustix::fs::Dir::new(listing).map_err(|errno| self.io("list", ".", errno))?;
        let mut digests = Vec::new();
        for entry in dir {
            let entry = entry.map_err(|errno| self.io("list", ".", errno))?;
            if let Ok(name) = std::str::from_utf8(entry.file_name().to_bytes())
                && let Ok(digest) = Digest::parse(&format!("{ALGORITHM}:{name}"))
            {
                digests.push(digest);
            }
        }
        digests.sort();
        Ok(digests)
    }

    /// Removes a blob (garbage collection; the caller knows no indexed image uses it), unless
    /// a [`BlobHolds`] holds it: then it is kept and `Ok(false)` returned. Removing one that is
    /// not there is not an error (`Ok(true)`).
    pub fn remove(&self, digest: &Digest) -> Result<bool, BlobError> {
        // Held for the whole removal: a holder taking it meanwhile waits, then finds it gone.
        let held = self.lock_held();
        if held.contains_key(digest) {
            return Ok(false);
        }
        match rustix::fs::unlinkat(self.dir.fd(), digest.hex(), AtFlags::empty()) {
            Ok(()) | Err(Errno::NOENT) => Ok(self.dir.sync().map(|_| true)?),
            Err(errno) => Err(self.io("remove", digest.hex(), errno)),
        }
    }

    fn remove_temp_files(&self) -> Result<(), BlobError> {
        let listing = rustix::fs::openat(
            self.dir.fd(),
            ".",
            OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
            Mode::empty(),
        )
        .map_err(|errno| self.io("open", ".", errno))?;
        let dir = rustix::fs::Dir::new(listing).map_err(|errno| self.io("list", ".", errno))?;
        let mut temps = Vec::new();
        for entry in dir {
            let entry = entry.map_err(|errno| self.io("list", ".", errno))?;
            let name = entry.file_name().to_bytes();
            if durable::is_temp_name(name) {
                temps.push(name.to_vec());
            }
        }
        for name in &temps {
            match rustix::fs::unlinkat(self.dir.fd(), name.as_slice(), AtFlags::empty()) {
                Ok(()) | Err(Errno::NOENT) => {}
                Err(errno) => {
                    return Err(self.io("remove", &String::from_utf8_lossy(name), errno));
                }
            }
        }
        if !temps.is_empty() {
            tracing::info!(dir = %self.dir.path().display(), removed = temps.len(), "partial blobs left by a crash removed");
            self.dir.sync()?;
        }
        Ok(())
    }

    fn io(&self, op: &'static str, name: &str, errno: Errno) -> BlobError {
        IoError::new(op, self.dir.path().join(name), errno).into()
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    fn names(dir: &Path) -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        names
    }

    #[test]
    fn digests_are_validated_before_they_become_names() {
        let good = format!("sha256:{}", "a1".repeat(32));
        assert_eq!(Digest::parse(&good).unwrap().hex(), "a1".repeat(32));
        assert_eq!(Digest::parse(&good).unwrap().to_string(), good);
        for bad in [
            String::new(),
            "sha256:".to_owned(),
            format!("sha512:{}", "a".repeat(64)),
            format!("SHA256:{}", "a".repeat(64)),
            format!("sha256:{}", "A".repeat(64)),
            format!("sha256:{}", "a".repeat(63)),
            format!("sha256:{}", "a".repeat(65)),
            format!("sha256:../{}", "a".repeat(61)),
            format!("sha256:{}/", "a".repeat(63)),
            format!("sha256:{}\0", "a".repeat(63)),
            format!("sha256 {}", "a".repeat(64)),
        ] {
            assert!(Digest::parse(&bad).is_err(), "{bad:?} accepted");
        }
        // The well-known digest of nothing.
        assert_eq!(
            Digest::of(b"").hex(),
            "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
        );
    }

    #[test]
    fn put_verifies_and_stores_once() {
        let dir = tempfile::tempdir().unwrap();
        let store = BlobStore::open(dir.path()).unwrap();
        let data = b"layer bytes".to_vec();
        let digest = Digest::of(&data);
        assert!(!store.contains(&digest).unwrap());
        assert_eq!(
            store
                .put(data.as_slice(), &digest, data.len() as u64)
                .unwrap(),
            Put::Stored
        );
        assert!(store.contains(&digest).unwrap());
        let mut back = Vec::new();
        store
            .open_blob(&digest)
            .unwrap()
            .read_to_end(&mut back)
            .unwrap();
        assert_eq!(back, data);
        let sha = dir.path().join("blobs/sha256");
        assert_eq!(names(&sha), vec![digest.hex().to_owned()]);
    }

    #[test]
    fn a_too_long_source_is_cut_off_and_leaves_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let store = BlobStore::open(dir.path()).unwrap();
        let digest = Digest::of(b"abc");
        // An endless source: the put must stop at the size, not read forever.
        let err = store.put(io::repeat(b'x'), &digest, 3).unwrap_err();
        assert!(
            matches!(err, BlobError::TooLarge { expected: 3, .. }),
            "{err}"
        );
        let err = store.put(&b"ab"[..], &digest, 3).unwrap_err();
        assert!(
            matches!(
                err,
                BlobError::SizeMismatch {
                    expected: 3,
                    actual: 2,
                    ..
                }
            ),
            "{err}"
        );
        assert!(names(&dir.path().join("blobs/sha256")).is_empty());
        assert!(matches!(
            store.open_blob(&digest),
            Err(BlobError::NotFound { .. })
        ));
    }

    #[test]
    fn a_failing_source_leaves_nothing() {
        struct Failing(usize);
        impl Read for Failing {
            fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
                if self.0 == 0 {
                    return Err(io::Error::other("connection reset"));
                }
                self.0 -= 1;
                buf[0] = b'x';
                Ok(1)
            }
        }
        let dir = tempfile::tempdir().unwrap();
        let store = BlobStore::open(dir.path()).unwrap();
        let digest = Digest::of(b"xxxxx");
        let err = store.put(Failing(2), &digest, 5).unwrap_err();
        assert!(matches!(err, BlobError::Read { .. }), "{err}");
        assert!(std::error::Error::source(&err).is_some());
        assert!(names(&dir.path().join("blobs/sha256")).is_empty());
    }

    #[test]
    fn crash_leftovers_are_removed_on_open_and_never_used() {
        let dir = tempfile::tempdir().unwrap();
        let data = b"whole".to_vec();
        let digest = Digest::of(&data);
        let sha = dir.path().join("blobs/sha256");
        std::fs::create_dir_all(&sha).unwrap();
        // A crash mid-put of this very blob left a partial temp file.
        std::fs::write(sha.join(format!(".tmp-{}-1-0", digest.hex())), b"who").unwrap();
        let store = BlobStore::open(dir.path()).unwrap();
        assert!(names(&sha).is_empty(), "temp file not removed");
        assert!(!store.contains(&digest).unwrap());
        assert_eq!(store.put(data.as_slice(), &digest, 5).unwrap(), Put::Stored);
        assert_eq!(names(&sha), vec![digest.hex().to_owned()]);
    }

    #[test]
    fn a_held_blob_is_not_removed_until_every_hold_is_dropped() {
        let dir = tempfile::tempdir().unwrap();
        let store = Arc::new(BlobStore::open(dir.path()).unwrap());
        let data = b"held".to_vec();
        let digest = Digest::of(&data);
        assert_eq!(store.put(data.as_slice(), &digest, 4).unwrap(), Put::Stored);
        let mut first = store.holds();
        first.hold(&digest);
        // A computed put holds what it stores (here: finds present) as soon as it is hashed.
        let mut second = store.holds();
        let (computed, _, put) = store
            .put_computed(data.as_slice(), 100, &mut second)
            .unwrap();
        assert_eq!((computed == digest, put), (true, Put::AlreadyPresent));
        assert!(!store.remove(&digest).unwrap(), "removed while held");
        drop(first);
        assert!(!store.remove(&digest).unwrap(), "removed while still held");
        assert!(store.contains(&digest).unwrap());
        drop(second);
        assert!(!store.is_held(&digest));
        assert!(store.remove(&digest).unwrap());
        assert!(!store.contains(&digest).unwrap());
        // Removing what is not there is not an error.
        assert!(store.remove(&digest).unwrap());
    }
}
