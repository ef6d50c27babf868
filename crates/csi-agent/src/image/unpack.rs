//! Applying a layer tar to a root directory, as hostile input, beneath the root.
//!
//! Every entry is created with an `*at` syscall on a single name, relative to an fd of its
//! parent directory; that fd is reached from the root with [`crate::beneath::open_dir`]
//! (`openat2` with `RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS`), so no parent component can be a
//! symlink and nothing is ever written through one, whatever earlier entries or layers made.
//! Path strings are never joined and handed to `std::fs`.
//!
//! The rules, as built:
//! - Names: leading `/`, empty and `.` components are dropped (as Docker does), so `/etc/x`
//!   and `./etc/x` both mean `etc/x` beneath the root; a `..` component, a NUL byte, or a
//!   name over the limits is refused with a typed error naming the entry. The root entry
//!   itself (`./`) is skipped: the root's own metadata stays the caller's.
//! - Missing parent directories are created (mode 0755 less the umask, owned by the caller),
//!   as Docker and containerd do.
//! - An entry replaces what is at its name (a directory with everything in it), except that a
//!   directory entry over an existing directory keeps it and merges. Regular files are
//!   created with `O_CREAT | O_EXCL | O_NOFOLLOW` after the old name is unlinked.
//! - Symlinks are created as they are, pointing anywhere: they are only ever followed inside
//!   the container. A later entry through one (`a -> /etc`, then `a/passwd`) is refused by
//!   the walk.
//! - Hard links: the target name follows the same rules (no `..`) and is looked up beneath
//!   the root without symlinks in its parents; `linkat` without `AT_SYMLINK_FOLLOW` links a
//!   target symlink itself, never what it points to. So a hard link cannot reach an inode
//!   outside the root.
//! - Whiteouts (OCI image spec): `.wh.<name>` removes `<name>` as left by lower layers;
//!   `.wh..wh..opq` removes everything lower layers left in its directory. What this same
//!   layer created is kept (a whiteout hides only lower content). Other `.wh..wh.` names
//!   (aufs bookkeeping) are ignored. Whiteout files themselves are never created.
//! - Kept: mode (all 12 bits), uid/gid (when running as root; otherwise the files are the
//!   caller's), mtime (also as atime; seconds), from the header or PAX `uid`/`gid`/`mtime`.
//!   Directory metadata is applied after the layer's last entry, so that creating children
//!   does not change the mtime and a read-only mode does not stop later entries.
//! - Device nodes are created only when running as root; otherwise they are skipped and
//!   counted in [`Report::devices_skipped`]. FIFOs are always created.
//! - Extended attributes from PAX `SCHILY.xattr.*` records, best effort, on regular files and
//!   directories: only `user.*`, `security.capability` (file capabilities) and the POSIX ACLs
//!   are set. Other namespaces are skipped: `trusted.*` is what overlayfs and csi-agent itself
//!   interpret (an image must not forge either), and `security.selinux` is the host's policy.
//!   A skipped or failing attribute is counted in [`Report::xattrs_not_kept`], not an error.
//! - Limits ([`Limits`]) bound the entry count, name length and depth, the bytes written to
//!   files (sparse files counted as expanded) and the decompressed stream, so a hostile layer
//!   cannot fill the disk or run unbounded. Across the layers of one image, a
//!   [`Budget`] (given to [`apply_layer_within`] / [`apply_overlay_layer_within`]) is charged
//!   every byte and every inode before it is written or made, so an image is refused at its
//!   cap (or the store's quota) while it is written.
//! - Memory per layer does not grow with what an entry carries, and grows with the number of
//!   entries only by a fixed 16-byte key (plus the hash table's slack) per path: the paths
//!   this layer made are kept as keyed 128-bit hashes, not as names; the metadata of each
//!   directory (its path, owner, mode, times, extended attributes) waits for the layer's end
//!   in an unnamed temp file inside the root (`O_TMPFILE`, or a name unlinked at once),
//!   which is read back one record at a time; the extended attributes kept for one entry
//!   are capped at [`MAX_XATTR_BYTES_PER_ENTRY`] (the rest are counted in
//!   [`Report::xattrs_not_kept`]), and the temp file's bytes are charged to the [`Budget`].
//!   So 200 directories with megabytes of PAX xattrs each, or 300,000 long paths, stay within
//!   tens of MiB (tests/image_bounds.rs). Known gap: the tar crate reads a GNU long name
//!   or long link record, and a PAX record, whole into memory before the entry it describes
//!   reaches this module, so the memory one such record takes is bounded only by
//!   `max_layer_bytes`. Closing it means iterating the tar raw and parsing those records
//!   here, with their own bound (GNU sparse files and PAX `size` would then need handling
//!   here too).
//!
//!
//! Two forms ([`apply_layer`] and [`apply_overlay_layer`]):
//! - **flattened**: every layer of an image applied in order to one root, whiteouts carried
//!   out (what they hide is removed);
//! - **overlay**: each layer into a directory of its own, to be stacked as an overlayfs
//!   lower layer (docs/operations.md, "Image store"). Whiteouts are then recorded the way
//!   overlayfs reads them (Documentation/filesystems/overlayfs.rst in the kernel tree): `.wh.<name>`
//!   becomes a character device 0/0 at `<name>`, `.wh..wh..opq` the xattr
//!   `trusted.overlay.opaque=y` on its directory. A parent directory the layer does not
//!   list is created with the owner and mode it has in the nearest lower layer (as
//!   containerd does), so stacking does not change it. A hard link to a file of a lower
//!   layer (allowed by the OCI image spec's changeset rules) cannot cross directories of
//!   different layers: the file is copied up into this layer instead (link identity with
//!   the lower file is lost, as with containerd's overlay applier). A literal 0/0 character
//!   device in a layer reads as a whiteout in this form, as under Docker's overlay2.
//!
//! On any error the root is left partly written: the caller must discard it (unpack into a
//! fresh directory and rename it into place only when every layer applied). Nothing is
//! fsynced here; the caller syncs before that rename.

use std::cell::Cell;
use std::collections::{HashMap, HashSet};
use std::ffi::OsStr;
use std::fs::File;
use std::hash::{BuildHasher, RandomState};
use std::io::{self, BufRead, BufReader, Read, Write};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::rc::Rc;

use flate2::read::MultiGzDecoder;
use rustix::fs::{
    AtFlags, FileType, Gid, Mode, OFlags, ResolveFlags, Timespec, Timestamps, Uid, XattrFlags,
};
use rustix::io::Errno;

use super::budget::{Budget, Exceeded};
use crate::beneath::{self, BeneathError};

/// The prefix of a whiteout's name.
const WHITEOUT_PREFIX: &[u8] = b".wh.";
/// The name that makes its directory opaque.
const OPAQUE: &[u8] = b".wh..wh..opq";
/// Whiteout-prefixed names that are aufs bookkeeping, not whiteouts.
const AUFS_META_PREFIX: &[u8] = b".wh..wh.";
/// What overlayfs reads as "this directory hides the lower layers' content".
pub const OVERLAY_OPAQUE_XATTR: &str = "trusted.overlay.opaque";
/// Bytes copied at a time.
const CHUNK: usize = 64 * 1024;
/// Linux's limits on one extended attribute.
const XATTR_NAME_MAX: usize = 255;
const XATTR_SIZE_MAX: usize = 64 * 1024;
/// Bytes of extended attributes (names and values) kept for one entry; the rest are skipped
/// and counted. Linux file systems hold a few KiB per inode; this bounds what a directory's
/// deferred metadata carries.
pub const MAX_XATTR_BYTES_PER_ENTRY: usize = 64 * 1024;

/// Bounds on what one layer may make; every one has a typed error ([`UnpackError::Limit`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Entries in the tar, whatever their kind.
    pub max_entries: u64,
    /// Bytes of an entry's name or link target (Linux's `PATH_MAX` less the NUL).
    pub max_path_bytes: usize,
    /// Components of an entry's name.
    pub max_depth: usize,
    /// Bytes written to regular files in all (sparse files count as expanded).
    pub max_file_bytes: u64,
    /// Bytes of the tar stream after decompression (headers, PAX records and data).
    pub max_layer_bytes: u64,
}

impl Default for Limits {
    /// Generous for real plugin images (the largest CSI driver images are a few hundred MiB),
    /// small enough that one hostile layer cannot exhaust a node.
    fn default() -> Self {
        Self {
            max_entries: 1_000_000,
            max_path_bytes: beneath::MAX_PATH_BYTES,
            max_depth: 256,
            max_file_bytes: 16 << 30,
            max_layer_bytes: 17 << 30,
        }
    }
}

/// Which limit was exceeded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LimitKind {
    Entries,
    PathBytes,
    ComponentBytes,
    Depth,
    FileBytes,
    LayerBytes,
    /// The image's unpacked bytes, all layers ([`Budget`]).
    ImageBytes,
    /// The image's inodes, all layers ([`Budget`]).
    ImageInodes,
    /// The room the image store's quota left for this image ([`Budget`]).
    StoreBytes,
}

impl std::fmt::Display for LimitKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Entries => "entries",
            Self::PathBytes => "name bytes",
            Self::ComponentBytes => "bytes of one name component",
            Self::Depth => "name components",
            Self::FileBytes => "bytes written to files",
            Self::LayerBytes => "bytes of the decompressed layer",
            Self::ImageBytes => "bytes unpacked for the image (--image-max-unpacked-bytes)",
            Self::ImageInodes => {
                "files, directories and links made for the image (--image-max-inodes)"
            }
            Self::StoreBytes => "bytes the image store's quota leaves (--image-store-max-bytes)",
        })
    }
}

/// How the layer stream is compressed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Compression {
    /// Gzip when the stream starts with its magic bytes, else plain; zstd and xz are
    /// recognised and refused.
    Detect,
    None,
    Gzip,
}

/// Why an entry name was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    #[error("its name has a '..' component")]
    ParentDir,
    #[error("its name or link target has a NUL byte")]
    Nul,
    #[error("its link target has a '..' component")]
    LinkParentDir,
    #[error("its hard link target is empty or the root")]
    LinkEmpty,
    #[error("it is a hard link to itself")]
    LinkToSelf,
    #[error("it whites out '.', '..' or nothing")]
    WhiteoutName,
    /// [`apply_archive_within`] only: an archive is not a layer rooted at `/`.
    #[error("its name is an absolute path")]
    Absolute,
    /// [`apply_archive_within`] only: a fetched archive has no business making devices.
    #[error("it is a device node")]
    Device,
}

/// Why a layer could not be applied. Every variant about an entry names it (cut to 200
/// bytes, lossily decoded).
#[derive(Debug, thiserror::Error)]
pub enum UnpackError {
    #[error("opening the root {}: {source}", root.display())]
    Root {
        root: PathBuf,
        #[source]
        source: BeneathError,
    },
    /// A hostile or broken name; nothing was created for it.
    #[error("layer entry {entry:?} refused: {reason}")]
    Refused { entry: String, reason: Refusal },
    /// The walk beneath the root refused the entry's parent (a symlink, a non-directory, an
    /// escape).
    #[error("layer entry {entry:?}: {source}")]
    Beneath {
        entry: String,
        #[source]
        source: BeneathError,
    },
    #[error("layer entry {entry:?}: exceeds the limit on {limit} ({max})")]
    Limit {
        entry: String,
        limit: LimitKind,
        max: u64,
    },
    #[error("layer entry {entry:?}: unsupported entry type {kind}")]
    Unsupported { entry: String, kind: String },
    #[error("the layer is compressed with {0}, which is not supported")]
    UnsupportedCompression(&'static str),
    #[error("layer entry {entry:?}: malformed {field}: {source}")]
    Malformed {
        entry: String,
        field: &'static str,
        #[source]
        source: io::Error,
    },
    /// The stream is not a readable tar (or gzip), or its source failed.
    #[error("reading the layer: {source}")]
    Read {
        #[source]
        source: io::Error,
    },
    /// A hard link whose target no earlier entry (nor, in the overlay form, a lower layer)
    /// made: the layer is broken or hostile, not the host.
    #[error(
        "layer entry {entry:?} refused: its hard link target {target:?} does not exist in the layer or below it"
    )]
    LinkTargetMissing { entry: String, target: String },
    #[error("layer entry {entry:?}: {op}: {source}")]
    Io {
        entry: String,
        op: &'static str,
        #[source]
        source: io::Error,
    },
}

impl UnpackError {
    /// True when applying the same layer again later may succeed: only a failure of the
    /// host (a full disk or quota, an I/O error, out of memory or descriptors, a busy or
    /// read-only file system). Everything the layer's content caused — a refused name, a
    /// link target missing, a limit, a malformed or unreadable tar, a syscall refusing what
    /// the entries ask for (`EEXIST`, `ENOTDIR`, `EMLINK`, `EINVAL`...) — fails the same
    /// way every time: final, so that a hostile image is not fetched and unpacked again and
    /// again.
    pub fn is_transient(&self) -> bool {
        let source = match self {
            Self::Io { source, .. } | Self::Read { source } => source,
            Self::Root {
                source: BeneathError::Io { source, .. },
                ..
            } => source,
            // The root is the store's own dir: gone or swapped is the host's problem.
            Self::Root { .. } => return true,
            _ => return false,
        };
        source.raw_os_error().is_some_and(|code| {
            [
                Errno::NOSPC,
                Errno::DQUOT,
                Errno::IO,
                Errno::NOMEM,
                Errno::MFILE,
                Errno::NFILE,
                Errno::AGAIN,
                Errno::INTR,
                Errno::BUSY,
                Errno::ROFS,
                Errno::TIMEDOUT,
            ]
            .contains(&Errno::from_raw_os_error(code))
        })
    }
}

/// What applying a layer did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Report {
    /// Tar entries read (all kinds, PAX and long-name records included).
    pub entries: u64,
    /// Bytes written to regular files.
    pub bytes_written: u64,
    /// Whiteout entries applied (each `.wh.` name, opaque ones included).
    pub whiteouts: u64,
    /// Device nodes not created because csi-agent is not running as root.
    pub devices_skipped: u64,
    /// Extended attributes skipped (namespace not kept, too large) or refused by the file
    /// system.
    pub xattrs_not_kept: u64,
}

/// Applies one layer tar to `root` (an existing directory the caller owns), on top of what
/// earlier layers left there. Applying an image's layers in order gives the merged tree.
pub fn apply_layer<R: Read>(
    root: &Path,
    layer: R,
    compression: Compression,
    limits: &Limits,
) -> Result<Report, UnpackError> {
    apply(
        root,
        None,
        layer,
        compression,
        limits,
        &Budget::unlimited(),
        false,
    )
}

/// [`apply_layer`], charging what it writes to `budget` (the image's, shared by its layers).
pub fn apply_layer_within<R: Read>(
    root: &Path,
    layer: R,
    compression: Compression,
    limits: &Limits,
    budget: &Budget,
) -> Result<Report, UnpackError> {
    apply(root, None, layer, compression, limits, budget, false)
}

/// Extracts a tar (plain or gzip, detected) that is not an image layer — an archive the
/// fetcher downloaded (crate::fetch) — into `root`, an empty directory the caller owns and
/// discards on error. The layer rules hold (no `..`, nothing through a symlink, limits,
/// `budget`), stricter where a layer's conventions have no place: an absolute name and a
/// device node are refused, and a `.wh.` name is an ordinary file, not a whiteout.
pub fn apply_archive_within<R: Read>(
    root: &Path,
    archive: R,
    limits: &Limits,
    budget: &Budget,
) -> Result<Report, UnpackError> {
    apply(
        root,
        None,
        archive,
        Compression::Detect,
        limits,
        budget,
        true,
    )
}

/// Unpacks one layer tar into `dir` (an empty directory the caller owns) in the overlay
/// form (module doc). `lowers` are the directories of the layers below it, nearest first,
/// each unpacked the same way: they are only read (parent directory metadata, hard link
/// targets), never written.
pub fn apply_overlay_layer<R: Read>(
    dir: &Path,
    lowers: &[PathBuf],
    layer: R,
    compression: Compression,
    limits: &Limits,
) -> Result<Report, UnpackError> {
    apply_overlay_layer_within(
        dir,
        lowers,
        layer,
        compression,
        limits,
        &Budget::unlimited(),
    )
}

/// [`apply_overlay_layer`], charging what it writes to `budget` (the image's).
pub fn apply_overlay_layer_within<R: Read>(
    dir: &Path,
    lowers: &[PathBuf],
    layer: R,
    compression: Compression,
    limits: &Limits,
    budget: &Budget,
) -> Result<Report, UnpackError> {
    let mut fds = Vec::with_capacity(lowers.len());
    for lower in lowers {
        fds.push(
            beneath::open_root(lower).map_err(|source| UnpackError::Root {
                root: lower.clone(),
                source,
            })?,
        );
    }
    apply(dir, Some(fds), layer, compression, limits, budget, false)
}

/// `archive`: the stricter rules of [`apply_archive_within`].
fn apply<R: Read>(
    root: &Path,
    lowers: Option<Vec<OwnedFd>>,
    layer: R,
    compression: Compression,
    limits: &Limits,
    budget: &Budget,
    archive: bool,
) -> Result<Report, UnpackError> {
    let root_fd = beneath::open_root(root).map_err(|source| UnpackError::Root {
        root: root.to_path_buf(),
        source,
    })?;
    let mut input = BufReader::with_capacity(CHUNK, layer);
    let compression = match compression {
        Compression::Detect => detect(&mut input)?,
        other => other,
    };
    let exceeded = Rc::new(Cell::new(false));
    let decoded = match compression {
        Compression::Gzip => Decoded::Gzip(MultiGzDecoder::new(input)),
        Compression::None | Compression::Detect => Decoded::Plain(input),
    };
    let bounded = Bounded {
        inner: decoded,
        left: limits.max_layer_bytes,
        exceeded: Rc::clone(&exceeded),
    };
    // A failure of the stream is the limit when the bound tripped, whatever the tar or gzip
    // decoder made of the error on its way up.
    let read_error = |source: io::Error| {
        if exceeded.get() {
            UnpackError::Limit {
                entry: "<layer>".to_owned(),
                limit: LimitKind::LayerBytes,
                max: limits.max_layer_bytes,
            }
        } else {
            UnpackError::Read { source }
        }
    };
    let mut tar = tar::Archive::new(bounded);
    let mut layer = Layer {
        root,
        root_fd,
        limits,
        as_root: rustix::process::geteuid().is_root(),
        report: Report::default(),
        budget,
        ours: HashSet::new(),
        keys: (RandomState::new(), RandomState::new()),
        dirs: DeferredDirs::default(),
        lowers,
        archive,
    };
    let entries = tar.entries().map_err(read_error)?;
    for entry in entries {
        let mut entry = entry.map_err(read_error)?;
        layer.apply(&mut entry, &read_error)?;
    }
    layer.finish()
}

/// Metadata kept for an entry.
#[derive(Clone, Debug)]
struct Meta {
    mode: u32,
    uid: u32,
    gid: u32,
    mtime: i64,
    xattrs: Vec<(Vec<u8>, Vec<u8>)>,
}

/// Directory metadata waiting for the layer's end, on disk (module doc): records appended
/// to an unnamed file, each followed by its length so that [`Layer::finish`] reads them
/// back last first, one at a time.
#[derive(Default)]
struct DeferredDirs {
    /// Made on the first directory entry.
    file: Option<File>,
    len: u64,
    /// A directory's path key → the offset of its last record (the last entry wins).
    last: HashMap<u128, u64>,
}

struct Layer<'a> {
    root: &'a Path,
    root_fd: OwnedFd,
    limits: &'a Limits,
    as_root: bool,
    report: Report,
    /// The image's caps, shared by its layers.
    budget: &'a Budget,
    /// The key ([`Layer::key`]) of every path this layer created, with all its ancestors
    /// (`a`, `a/b`, ...): whiteouts hide only what lower layers left.
    ours: HashSet<u128>,
    /// Two independently keyed hashers: a path's key is 128 bits no layer can aim at.
    keys: (RandomState, RandomState),
    /// Directory metadata, applied by [`Layer::finish`].
    dirs: DeferredDirs,
    /// The overlay form: the lower layers' directories, nearest first (`None`: flattened).
    lowers: Option<Vec<OwnedFd>>,
    /// Not a layer: the rules of [`apply_archive_within`].
    archive: bool,
}

type ReadError<'f> = &'f dyn Fn(io::Error) -> UnpackError;

/// Where one entry goes: its parent dir (walked beneath the root), its name, its whole path
/// as components, and its name as shown in errors.
struct Place<'p> {
    parent: BorrowedFd<'p>,
    name: &'p [u8],
    components: &'p [Vec<u8>],
    shown: &'p str,
}

impl Place<'_> {
    /// How many components deep the entry is (what [`Layer::remove_existing`] takes).
    fn depth(&self) -> usize {
        self.components.len()
    }
}

impl Layer<'_> {
    fn apply<R: Read>(
        &mut self,
        entry: &mut tar::Entry<'_, R>,
        read_error: ReadError<'_>,
    ) -> Result<(), UnpackError> {
        self.report.entries += 1;
        let raw = entry.path_bytes().into_owned();
        let shown = show(&raw);
        if self.report.entries > self.limits.max_entries {
            return Err(UnpackError::Limit {
                entry: shown,
                limit: LimitKind::Entries,
                max: self.limits.max_entries,
            });
        }
        let kind = entry.header().entry_type();
        // Records the tar crate has already folded into the entries they describe.
        if kind.is_pax_global_extensions()
            || kind.is_pax_local_extensions()
            || kind.is_gnu_longname()
            || kind.is_gnu_longlink()
        {
            return Ok(());
        }
        if self.archive && raw.starts_with(b"/") {
            return Err(refused(&shown, Refusal::Absolute));
        }
        let components = self.components(&raw, &shown, Refusal::ParentDir)?;
        let Some((name, parent)) = components.split_last() else {
            return Ok(());
        };
        if !self.archive && name.starts_with(WHITEOUT_PREFIX) {
            return self.whiteout(parent, name, &shown);
        }
        let meta = self.meta(entry, &shown, read_error)?;
        let parent_fd = self.create_parent(parent, &shown)?;
        let at = Place {
            parent: parent_fd.as_fd(),
            name,
            components: &components,
            shown: &shown,
        };
        // Old-style tars mark directories by a trailing '/' on a regular entry.
        let is_dir = kind.is_dir() || (kind == tar::EntryType::Regular && raw.ends_with(b"/"));
        let made = if is_dir {
            self.apply_dir(&at, &meta)?
        } else if kind.is_file() || kind.is_contiguous() || kind.is_gnu_sparse() {
            self.apply_file(entry, &at, &meta, read_error)?
        } else if kind.is_symlink() {
            self.apply_symlink(entry, &at, &meta)?
        } else if kind.is_hard_link() {
            self.apply_hard_link(entry, &at)?
        } else if kind.is_character_special() || kind.is_block_special() || kind.is_fifo() {
            self.apply_node(entry, &at, kind, &meta)?
        } else {
            return Err(UnpackError::Unsupported {
                entry: shown,
                kind: format!("{kind:?}"),
            });
        };
        if made {
            self.record(&components);
        }
        Ok(())
    }

    /// A directory entry: made (replacing what else is there) or kept, its metadata set at
    /// the layer's end.
    fn apply_dir(&mut self, at: &Place<'_>, meta: &Meta) -> Result<bool, UnpackError> {
        let (parent_fd, name, shown) = (at.parent, at.name, at.shown);
        match rustix::fs::statat(parent_fd, name, AtFlags::SYMLINK_NOFOLLOW) {
            Ok(stat) if FileType::from_raw_mode(stat.st_mode) == FileType::Directory => {}
            Ok(_) => {
                self.remove_existing(parent_fd, name, at.depth(), shown)?;
                self.mkdir(parent_fd, name, shown)?;
            }
            Err(Errno::NOENT) => self.mkdir(parent_fd, name, shown)?,
            Err(errno) => return Err(io_error(shown, "stat", errno)),
        }
        self.defer_dir(at.components, meta, shown)?;
        Ok(true)
    }

    /// A regular file entry: created new (never through what was there) and filled.
    fn apply_file<R: Read>(
        &mut self,
        entry: &mut tar::Entry<'_, R>,
        at: &Place<'_>,
        meta: &Meta,
        read_error: ReadError<'_>,
    ) -> Result<bool, UnpackError> {
        let (parent_fd, name, shown) = (at.parent, at.name, at.shown);
        self.remove_existing(parent_fd, name, at.depth(), shown)?;
        self.charge_inode(shown)?;
        let fd = rustix::fs::openat(
            parent_fd,
            name,
            OFlags::WRONLY | OFlags::CREATE | OFlags::EXCL | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            Mode::from_raw_mode(0o600),
        )
        .map_err(|errno| io_error(shown, "create", errno))?;
        let mut file = File::from(fd);
        self.copy(entry, &mut file, shown, read_error)?;
        self.set_meta_fd(file.as_fd(), meta, shown)?;
        Ok(true)
    }

    /// A symlink entry: made as it is (its target is never followed), owner and times set
    /// on the link itself.
    fn apply_symlink<R: Read>(
        &mut self,
        entry: &mut tar::Entry<'_, R>,
        at: &Place<'_>,
        meta: &Meta,
    ) -> Result<bool, UnpackError> {
        let (parent_fd, name, shown) = (at.parent, at.name, at.shown);
        let target = self.link_target(entry, shown)?;
        self.remove_existing(parent_fd, name, at.depth(), shown)?;
        self.charge_inode(shown)?;
        self.charge_bytes(target.len() as u64, shown)?;
        rustix::fs::symlinkat(target.as_slice(), parent_fd, name)
            .map_err(|errno| io_error(shown, "symlink", errno))?;
        if self.as_root {
            rustix::fs::chownat(
                parent_fd,
                name,
                Some(uid(meta.uid)),
                Some(gid(meta.gid)),
                AtFlags::SYMLINK_NOFOLLOW,
            )
            .map_err(|errno| io_error(shown, "chown", errno))?;
        }
        rustix::fs::utimensat(
            parent_fd,
            name,
            &times(meta.mtime),
            AtFlags::SYMLINK_NOFOLLOW,
        )
        .map_err(|errno| io_error(shown, "set times", errno))?;
        Ok(true)
    }

    /// A hard link entry: linked to its target in this layer, or (the overlay form) to a
    /// copy up of a lower layer's; refused when the target is missing or the entry itself.
    fn apply_hard_link<R: Read>(
        &mut self,
        entry: &mut tar::Entry<'_, R>,
        at: &Place<'_>,
    ) -> Result<bool, UnpackError> {
        let (parent_fd, name, shown) = (at.parent, at.name, at.shown);
        let raw_target = self.link_target(entry, shown)?;
        let target = self.components(&raw_target, shown, Refusal::LinkParentDir)?;
        let Some((target_name, target_parent)) = target.split_last() else {
            return Err(refused(shown, Refusal::LinkEmpty));
        };
        if target == at.components {
            return Err(refused(shown, Refusal::LinkToSelf));
        }
        let not_found = || UnpackError::LinkTargetMissing {
            entry: shown.to_owned(),
            target: show(&raw_target),
        };
        let in_this_layer = match self.open_existing_parent(target_parent, shown)? {
            Some(dir) => {
                match rustix::fs::statat(&dir, target_name.as_slice(), AtFlags::SYMLINK_NOFOLLOW) {
                    Ok(_) => Some(dir),
                    Err(Errno::NOENT) => None,
                    Err(errno) => return Err(io_error(shown, "stat", errno)),
                }
            }
            None => None,
        };
        let Some(target_dir) = in_this_layer else {
            if self.lowers.is_none() {
                return Err(not_found());
            }
            // The overlay form: the target is a lower layer's; copy it up.
            if !self.lower_shows(&target, shown)? {
                return Err(not_found());
            }
            self.remove_existing(parent_fd, name, at.depth(), shown)?;
            if !self.copy_up(target_parent, target_name, parent_fd, name, shown)? {
                return Err(not_found());
            }
            return Ok(true);
        };
        self.remove_existing(parent_fd, name, at.depth(), shown)?;
        self.charge_inode(shown)?;
        // No AT_SYMLINK_FOLLOW: a target that is a symlink is linked itself.
        rustix::fs::linkat(
            &target_dir,
            target_name.as_slice(),
            parent_fd,
            name,
            AtFlags::empty(),
        )
        .map_err(|errno| io_error(shown, "link", errno))?;
        Ok(true)
    }

    /// A device node or FIFO entry: a device is refused in an archive and skipped (counted)
    /// without root. False when nothing was made.
    fn apply_node<R: Read>(
        &mut self,
        entry: &mut tar::Entry<'_, R>,
        at: &Place<'_>,
        kind: tar::EntryType,
        meta: &Meta,
    ) -> Result<bool, UnpackError> {
        let (parent_fd, name, shown) = (at.parent, at.name, at.shown);
        let file_type = if kind.is_character_special() {
            FileType::CharacterDevice
        } else if kind.is_block_special() {
            FileType::BlockDevice
        } else {
            FileType::Fifo
        };
        if file_type != FileType::Fifo && self.archive {
            return Err(refused(shown, Refusal::Device));
        }
        if file_type != FileType::Fifo && !self.as_root {
            self.report.devices_skipped += 1;
            return Ok(false);
        }
        let header = entry.header();
        let major = lenient(header, 329..337, header.device_major())
            .map_err(|source| malformed(shown, "device major", source))?
            .unwrap_or(0);
        let minor = lenient(header, 337..345, header.device_minor())
            .map_err(|source| malformed(shown, "device minor", source))?
            .unwrap_or(0);
        self.remove_existing(parent_fd, name, at.depth(), shown)?;
        self.charge_inode(shown)?;
        rustix::fs::mknodat(
            parent_fd,
            name,
            file_type,
            Mode::from_raw_mode(0o600),
            rustix::fs::makedev(major, minor),
        )
        .map_err(|errno| io_error(shown, "mknod", errno))?;
        self.set_meta_node(parent_fd, name, file_type, meta, shown)?;
        Ok(true)
    }

    /// The entry's name as components, by the rules in the module doc.
    fn components(
        &self,
        raw: &[u8],
        shown: &str,
        dotdot: Refusal,
    ) -> Result<Vec<Vec<u8>>, UnpackError> {
        if raw.len() > self.limits.max_path_bytes {
            return Err(limit(
                shown,
                LimitKind::PathBytes,
                self.limits.max_path_bytes,
            ));
        }
        if raw.contains(&0) {
            return Err(refused(shown, Refusal::Nul));
        }
        let mut out = Vec::new();
        for component in raw.split(|b| *b == b'/') {
            match component {
                b"" | b"." => {}
                b".." => return Err(refused(shown, dotdot)),
                _ if component.len() > beneath::MAX_COMPONENT_BYTES => {
                    return Err(limit(
                        shown,
                        LimitKind::ComponentBytes,
                        beneath::MAX_COMPONENT_BYTES,
                    ));
                }
                _ => out.push(component.to_vec()),
            }
        }
        if out.len() > self.limits.max_depth {
            return Err(limit(shown, LimitKind::Depth, self.limits.max_depth));
        }
        Ok(out)
    }

    fn link_target<R: Read>(
        &self,
        entry: &tar::Entry<'_, R>,
        shown: &str,
    ) -> Result<Vec<u8>, UnpackError> {
        let target = entry
            .link_name_bytes()
            .map(|t| t.into_owned())
            .unwrap_or_default();
        if target.len() > self.limits.max_path_bytes {
            return Err(limit(
                shown,
                LimitKind::PathBytes,
                self.limits.max_path_bytes,
            ));
        }
        if target.contains(&0) {
            return Err(refused(shown, Refusal::Nul));
        }
        if target.is_empty() {
            return Err(refused(shown, Refusal::LinkEmpty));
        }
        Ok(target)
    }

    fn meta<R: Read>(
        &mut self,
        entry: &mut tar::Entry<'_, R>,
        shown: &str,
        read_error: ReadError<'_>,
    ) -> Result<Meta, UnpackError> {
        let header = entry.header();
        let mode = lenient(header, 100..108, header.mode())
            .map_err(|source| malformed(shown, "mode", source))?
            & 0o7777;
        let mut uid = lenient(header, 108..116, header.uid())
            .map_err(|source| malformed(shown, "uid", source))?;
        let mut gid = lenient(header, 116..124, header.gid())
            .map_err(|source| malformed(shown, "gid", source))?;
        let mut mtime = i64::try_from(
            lenient(header, 136..148, header.mtime())
                .map_err(|source| malformed(shown, "mtime", source))?,
        )
        .unwrap_or(i64::MAX);
        let mut xattrs = Vec::new();
        let mut xattr_bytes = 0usize;
        let extensions = entry.pax_extensions().map_err(read_error)?;
        for extension in extensions.into_iter().flatten() {
            let extension = extension.map_err(|source| malformed(shown, "PAX record", source))?;
            let key = extension.key_bytes();
            let value = extension.value_bytes();
            match key {
                b"uid" => uid = parse_decimal(value, shown, "PAX uid")?,
                b"gid" => gid = parse_decimal(value, shown, "PAX gid")?,
                b"mtime" => {
                    // Seconds, with an optional fraction that is not kept.
                    let seconds = value.split(|b| *b == b'.').next().unwrap_or_default();
                    let negative = seconds.first() == Some(&b'-');
                    let digits = if negative { &seconds[1..] } else { seconds };
                    let magnitude: u64 = parse_decimal(digits, shown, "PAX mtime")?;
                    let magnitude = i64::try_from(magnitude).unwrap_or(i64::MAX);
                    mtime = if negative { -magnitude } else { magnitude };
                }
                _ => {
                    if let Some(name) = key.strip_prefix(b"SCHILY.xattr.") {
                        let size = name.len() + value.len();
                        if kept_xattr(name)
                            && name.len() <= XATTR_NAME_MAX
                            && value.len() <= XATTR_SIZE_MAX
                            && xattr_bytes + size <= MAX_XATTR_BYTES_PER_ENTRY
                        {
                            xattr_bytes += size;
                            xattrs.push((name.to_vec(), value.to_vec()));
                        } else {
                            self.report.xattrs_not_kept += 1;
                        }
                    }
                }
            }
        }
        let id = |value: u64, field| {
            // u32::MAX is -1, "leave unchanged", to chown(2): not an owner.
            u32::try_from(value)
                .ok()
                .filter(|v| *v != u32::MAX)
                .ok_or_else(|| malformed(shown, field, io::Error::other("out of range")))
        };
        Ok(Meta {
            mode,
            uid: id(uid, "uid")?,
            gid: id(gid, "gid")?,
            mtime,
            xattrs,
        })
    }

    /// Copies the entry's data, counting it against [`Limits::max_file_bytes`].
    fn copy<R: Read>(
        &mut self,
        entry: &mut tar::Entry<'_, R>,
        file: &mut File,
        shown: &str,
        read_error: ReadError<'_>,
    ) -> Result<(), UnpackError> {
        let mut buf = vec![0u8; CHUNK];
        loop {
            let n = match entry.read(&mut buf) {
                Ok(0) => return Ok(()),
                Ok(n) => n,
                Err(err) if err.kind() == io::ErrorKind::Interrupted => continue,
                Err(err) => return Err(read_error(err)),
            };
            self.charge_bytes(n as u64, shown)?;
            self.report.bytes_written = self.report.bytes_written.saturating_add(n as u64);
            if self.report.bytes_written > self.limits.max_file_bytes {
                return Err(limit(
                    shown,
                    LimitKind::FileBytes,
                    self.limits.max_file_bytes,
                ));
            }
            file.write_all(buf.get(..n).unwrap_or_default())
                .map_err(|source| UnpackError::Io {
                    entry: shown.to_owned(),
                    op: "write",
                    source,
                })?;
        }
    }

    fn mkdir(&self, parent: BorrowedFd<'_>, name: &[u8], shown: &str) -> Result<(), UnpackError> {
        self.charge_inode(shown)?;
        // Owner-only until `finish` sets the entry's mode.
        rustix::fs::mkdirat(parent, name, Mode::from_raw_mode(0o700))
            .map_err(|errno| io_error(shown, "mkdir", errno))
    }

    /// Opens the entry's parent beneath the root, creating missing directories.
    fn create_parent(&mut self, parent: &[Vec<u8>], shown: &str) -> Result<OwnedFd, UnpackError> {
        if let Some(fd) = self.open_existing_parent(parent, shown)? {
            return Ok(fd);
        }
        // Some component is missing: walk one component at a time from the root, each step
        // beneath the directory before it, making what is missing.
        let mut fd = self.dup_root(shown)?;
        let mut at = self.root.to_path_buf();
        for (index, component) in parent.iter().enumerate() {
            let name = Path::new(OsStr::from_bytes(component));
            let next = match beneath::open_dir(fd.as_fd(), &at, name, None) {
                Ok(opened) => opened.fd,
                Err(BeneathError::NotFound { .. }) => {
                    self.charge_inode(shown)?;
                    let made = match rustix::fs::mkdirat(&fd, name, Mode::from_raw_mode(0o755)) {
                        Ok(()) => true,
                        Err(Errno::EXIST) => false,
                        Err(errno) => return Err(io_error(shown, "mkdir", errno)),
                    };
                    let path = parent.get(..=index).unwrap_or_default();
                    self.record(path);
                    let opened = beneath::open_dir(fd.as_fd(), &at, name, None)
                        .map_err(|source| beneath_error(shown, source))?
                        .fd;
                    if made {
                        self.inherit_lower_dir(opened.as_fd(), path, shown)?;
                    }
                    opened
                }
                Err(source) => return Err(beneath_error(shown, source)),
            };
            at.push(name);
            fd = next;
        }
        Ok(fd)
    }

    /// Opens `parent` beneath the root; `None` when some component does not exist.
    fn open_existing_parent(
        &self,
        parent: &[Vec<u8>],
        shown: &str,
    ) -> Result<Option<OwnedFd>, UnpackError> {
        if parent.is_empty() {
            return self.dup_root(shown).map(Some);
        }
        match beneath::open_dir(self.root_fd.as_fd(), self.root, &relative(parent), None) {
            Ok(opened) => Ok(Some(opened.fd)),
            Err(BeneathError::NotFound { .. }) => Ok(None),
            Err(source) => Err(beneath_error(shown, source)),
        }
    }

    fn dup_root(&self, shown: &str) -> Result<OwnedFd, UnpackError> {
        self.root_fd.try_clone().map_err(|source| UnpackError::Io {
            entry: shown.to_owned(),
            op: "dup the root fd",
            source,
        })
    }

    fn whiteout(
        &mut self,
        parent: &[Vec<u8>],
        name: &[u8],
        shown: &str,
    ) -> Result<(), UnpackError> {
        self.report.whiteouts += 1;
        let overlay = self.lowers.is_some();
        if name == OPAQUE {
            if overlay {
                return self.mark_opaque(parent, shown);
            }
            // A directory that does not exist has no lower content to hide.
            let Some(dir) = self.open_existing_parent(parent, shown)? else {
                return Ok(());
            };
            return self.opaque(dir.as_fd(), parent.to_vec(), shown);
        }
        if name.starts_with(AUFS_META_PREFIX) {
            return Ok(());
        }
        let target = name.get(WHITEOUT_PREFIX.len()..).unwrap_or_default();
        if target.is_empty() || target == b"." || target == b".." {
            return Err(refused(shown, Refusal::WhiteoutName));
        }
        let mut path = parent.to_vec();
        path.push(target.to_vec());
        if self.is_ours(&path) {
            return Ok(());
        }
        if overlay {
            // overlayfs's whiteout: a character device 0/0 at the name it hides; nothing
            // when no lower layer shows that name (as in the flattened form).
            if !self.lower_shows(&path, shown)? {
                return Ok(());
            }
            let dir = self.create_parent(parent, shown)?;
            self.charge_inode(shown)?;
            rustix::fs::mknodat(
                &dir,
                target,
                FileType::CharacterDevice,
                Mode::empty(),
                rustix::fs::makedev(0, 0),
            )
            .map_err(|errno| io_error(shown, "mknod (whiteout)", errno))?;
            return Ok(());
        }
        let Some(dir) = self.open_existing_parent(parent, shown)? else {
            return Ok(());
        };
        self.remove_existing(dir.as_fd(), target, path.len(), shown)
    }

    /// The overlay form of `.wh..wh..opq`: the directory (made if this layer has not yet)
    /// gets overlayfs's opaque xattr, hiding the lower layers' content of it, not this
    /// layer's.
    fn mark_opaque(&mut self, dir: &[Vec<u8>], shown: &str) -> Result<(), UnpackError> {
        // A directory neither this layer nor a lower one has hides nothing.
        if !self.is_ours(dir) && !dir.is_empty() && !self.lower_shows(dir, shown)? {
            return Ok(());
        }
        let opened = if let Some((name, parent)) = dir.split_last() {
            let parent_fd = self.create_parent(parent, shown)?;
            match rustix::fs::statat(&parent_fd, name.as_slice(), AtFlags::SYMLINK_NOFOLLOW) {
                Ok(stat) if FileType::from_raw_mode(stat.st_mode) == FileType::Directory => {}
                Ok(_) => {
                    self.remove_existing(parent_fd.as_fd(), name, dir.len(), shown)?;
                    self.mkdir(parent_fd.as_fd(), name, shown)?;
                    self.inherit_lower_dir_at(parent_fd.as_fd(), name, dir, shown)?;
                }
                Err(Errno::NOENT) => {
                    self.mkdir(parent_fd.as_fd(), name, shown)?;
                    self.inherit_lower_dir_at(parent_fd.as_fd(), name, dir, shown)?;
                }
                Err(errno) => return Err(io_error(shown, "stat", errno)),
            }
            self.record(dir);
            open_child_dir(parent_fd.as_fd(), name, OFlags::PATH)
                .map_err(|errno| io_error(shown, "open", errno))?
        } else {
            self.dup_root(shown)?
        };
        let fd = rustix::fs::openat(
            &opened,
            ".",
            OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
            Mode::empty(),
        )
        .map_err(|errno| io_error(shown, "open", errno))?;
        rustix::fs::fsetxattr(&fd, OVERLAY_OPAQUE_XATTR, b"y", XattrFlags::empty())
            .map_err(|errno| io_error(shown, "set the opaque xattr", errno))
    }

    /// Whether the stack of lower layers shows something at `path`, walked as overlayfs
    /// looks it up: component by component from the nearest layer down, a missing name
    /// going on to the next layer unless its directory is opaque there, a whiteout or a
    /// non-directory (a symlink included) on the way hiding everything below.
    fn lower_shows(&self, path: &[Vec<u8>], shown: &str) -> Result<bool, UnpackError> {
        let Some(lowers) = &self.lowers else {
            return Ok(false);
        };
        'layers: for lower in lowers {
            let mut dir = lower.try_clone().map_err(|source| UnpackError::Io {
                entry: shown.to_owned(),
                op: "dup a lower layer's fd",
                source,
            })?;
            // An opaque directory anywhere on the way hides the layers below it.
            let mut hides_below = false;
            for (index, component) in path.iter().enumerate() {
                let last = index + 1 == path.len();
                match rustix::fs::statat(&dir, component.as_slice(), AtFlags::SYMLINK_NOFOLLOW) {
                    Ok(stat) => {
                        let file_type = FileType::from_raw_mode(stat.st_mode);
                        if file_type == FileType::CharacterDevice && stat.st_rdev == 0 {
                            return Ok(false);
                        }
                        if last {
                            return Ok(true);
                        }
                        if file_type != FileType::Directory {
                            return Ok(false);
                        }
                        dir = open_child_dir(dir.as_fd(), component, OFlags::PATH)
                            .map_err(|errno| io_error(shown, "open", errno))?;
                        hides_below |= is_opaque(dir.as_fd());
                    }
                    Err(Errno::NOENT) => {
                        if hides_below || is_opaque(dir.as_fd()) {
                            return Ok(false);
                        }
                        continue 'layers;
                    }
                    Err(errno) => return Err(io_error(shown, "stat", errno)),
                }
            }
        }
        Ok(false)
    }

    /// `inherit_lower_dir` for `name` in `parent`, a directory just made.
    fn inherit_lower_dir_at(
        &mut self,
        parent: BorrowedFd<'_>,
        name: &[u8],
        path: &[Vec<u8>],
        shown: &str,
    ) -> Result<(), UnpackError> {
        if self.lowers.is_none() {
            return Ok(());
        }
        let fd = open_child_dir(parent, name, OFlags::PATH)
            .map_err(|errno| io_error(shown, "open", errno))?;
        self.inherit_lower_dir(fd.as_fd(), path, shown)
    }

    /// In the overlay form, a directory this layer made without an entry of its own takes
    /// the owner, mode and times of the same directory in the nearest lower layer that has
    /// one (the topmost layer's attributes are what the stack shows).
    fn inherit_lower_dir(
        &mut self,
        dir: BorrowedFd<'_>,
        path: &[Vec<u8>],
        shown: &str,
    ) -> Result<(), UnpackError> {
        let Some(lowers) = &self.lowers else {
            return Ok(());
        };
        let relative = relative(path);
        let mut found = None;
        for lower in lowers {
            match beneath::open_dir(lower.as_fd(), self.root, &relative, None) {
                Ok(opened) => {
                    found = Some(opened.fd);
                    break;
                }
                Err(BeneathError::NotFound { .. }) => {}
                // A symlink or a file there: nothing below it shows through, keep defaults.
                Err(_) => return Ok(()),
            }
        }
        let Some(lower) = found else {
            return Ok(());
        };
        let stat = rustix::fs::fstat(&lower).map_err(|errno| io_error(shown, "stat", errno))?;
        let meta = Meta {
            mode: stat.st_mode & 0o7777,
            uid: stat.st_uid,
            gid: stat.st_gid,
            mtime: stat.st_mtime,
            xattrs: Vec::new(),
        };
        let fd = rustix::fs::openat(
            dir,
            ".",
            OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
            Mode::empty(),
        )
        .map_err(|errno| io_error(shown, "open", errno))?;
        self.set_meta_fd(fd.as_fd(), &meta, shown)
    }

    /// The overlay form's hard link to a lower layer's file: the nearest lower layer that
    /// has `target_parent/target_name` (and does not white it out or hide it behind an
    /// opaque directory) gives a copy of it (a regular file's data, owner, mode and times;
    /// a symlink as it is) at `name` in `parent`. False when no lower layer has it.
    fn copy_up(
        &mut self,
        target_parent: &[Vec<u8>],
        target_name: &[u8],
        parent: BorrowedFd<'_>,
        name: &[u8],
        shown: &str,
    ) -> Result<bool, UnpackError> {
        let Some(lowers) = self.lowers.take() else {
            return Ok(false);
        };
        let result = (|| {
            for lower in &lowers {
                let dir = if target_parent.is_empty() {
                    lower.try_clone().map_err(|source| UnpackError::Io {
                        entry: shown.to_owned(),
                        op: "dup a lower layer's fd",
                        source,
                    })?
                } else {
                    match beneath::open_dir(
                        lower.as_fd(),
                        self.root,
                        &relative(target_parent),
                        None,
                    ) {
                        Ok(opened) => opened.fd,
                        Err(BeneathError::NotFound { .. }) => continue,
                        Err(_) => return Ok(false),
                    }
                };
                let stat = match rustix::fs::statat(&dir, target_name, AtFlags::SYMLINK_NOFOLLOW) {
                    Ok(stat) => stat,
                    Err(Errno::NOENT) => {
                        if is_opaque(dir.as_fd()) {
                            return Ok(false);
                        }
                        continue;
                    }
                    Err(errno) => return Err(io_error(shown, "stat", errno)),
                };
                let meta = Meta {
                    mode: stat.st_mode & 0o7777,
                    uid: stat.st_uid,
                    gid: stat.st_gid,
                    mtime: stat.st_mtime,
                    xattrs: Vec::new(),
                };
                return match FileType::from_raw_mode(stat.st_mode) {
                    FileType::RegularFile => {
                        // Charged before the copy is written, at the size it has.
                        self.charge_inode(shown)?;
                        self.charge_bytes(stat.st_size.max(0) as u64, shown)?;
                        let source = rustix::fs::openat(
                            &dir,
                            target_name,
                            OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
                            Mode::empty(),
                        )
                        .map_err(|errno| io_error(shown, "open the link target", errno))?;
                        let fd = rustix::fs::openat(
                            parent,
                            name,
                            OFlags::WRONLY
                                | OFlags::CREATE
                                | OFlags::EXCL
                                | OFlags::NOFOLLOW
                                | OFlags::CLOEXEC,
                            Mode::from_raw_mode(0o600),
                        )
                        .map_err(|errno| io_error(shown, "create", errno))?;
                        let mut file = File::from(fd);
                        let copied =
                            io::copy(&mut File::from(source), &mut file).map_err(|source| {
                                UnpackError::Io {
                                    entry: shown.to_owned(),
                                    op: "copy up the link target",
                                    source,
                                }
                            })?;
                        self.report.bytes_written =
                            self.report.bytes_written.saturating_add(copied);
                        if self.report.bytes_written > self.limits.max_file_bytes {
                            return Err(limit(
                                shown,
                                LimitKind::FileBytes,
                                self.limits.max_file_bytes,
                            ));
                        }
                        self.set_meta_fd(file.as_fd(), &meta, shown)?;
                        Ok(true)
                    }
                    FileType::Symlink => {
                        let target = rustix::fs::readlinkat(&dir, target_name, Vec::new())
                            .map_err(|errno| io_error(shown, "read the link target", errno))?;
                        self.charge_inode(shown)?;
                        self.charge_bytes(target.as_bytes().len() as u64, shown)?;
                        rustix::fs::symlinkat(target.as_bytes(), parent, name)
                            .map_err(|errno| io_error(shown, "symlink", errno))?;
                        Ok(true)
                    }
                    // A whiteout (0/0) or anything else: no file to link to.
                    _ => Ok(false),
                };
            }
            Ok(false)
        })();
        self.lowers = Some(lowers);
        result
    }

    /// Removes what lower layers left in `dir`: everything not created by this layer, and
    /// below what this layer created, the same again.
    fn opaque(
        &mut self,
        dir: BorrowedFd<'_>,
        dir_components: Vec<Vec<u8>>,
        shown: &str,
    ) -> Result<(), UnpackError> {
        let children = list(dir).map_err(|errno| io_error(shown, "list", errno))?;
        for child in children {
            let mut path = dir_components.clone();
            path.push(child.clone());
            if !self.is_ours(&path) {
                self.remove_existing(dir, &child, path.len(), shown)?;
                continue;
            }
            let is_dir = rustix::fs::statat(dir, child.as_slice(), AtFlags::SYMLINK_NOFOLLOW)
                .is_ok_and(|st| FileType::from_raw_mode(st.st_mode) == FileType::Directory);
            if is_dir {
                let sub = open_child_dir(dir, &child, OFlags::PATH)
                    .map_err(|errno| io_error(shown, "open", errno))?;
                self.opaque(sub.as_fd(), path, shown)?;
            }
        }
        Ok(())
    }

    /// Removes `name` in `parent` if it exists, a directory with everything beneath it;
    /// symlinks are removed, never followed. `depth` is the name's depth below the root.
    fn remove_existing(
        &self,
        parent: BorrowedFd<'_>,
        name: &[u8],
        depth: usize,
        shown: &str,
    ) -> Result<(), UnpackError> {
        let stat = match rustix::fs::statat(parent, name, AtFlags::SYMLINK_NOFOLLOW) {
            Ok(stat) => stat,
            Err(Errno::NOENT) => return Ok(()),
            Err(errno) => return Err(io_error(shown, "stat", errno)),
        };
        let removed = if FileType::from_raw_mode(stat.st_mode) == FileType::Directory {
            // Nothing this module makes is deeper than the limit; stop rather than recurse
            // without bound into something else.
            if depth > self.limits.max_depth {
                return Err(limit(shown, LimitKind::Depth, self.limits.max_depth));
            }
            let dir = open_child_dir(parent, name, OFlags::RDONLY)
                .map_err(|errno| io_error(shown, "open", errno))?;
            for child in list(dir.as_fd()).map_err(|errno| io_error(shown, "list", errno))? {
                self.remove_existing(dir.as_fd(), &child, depth + 1, shown)?;
            }
            drop(dir);
            rustix::fs::unlinkat(parent, name, AtFlags::REMOVEDIR)
        } else {
            rustix::fs::unlinkat(parent, name, AtFlags::empty())
        };
        match removed {
            Ok(()) | Err(Errno::NOENT) => Ok(()),
            Err(errno) => Err(io_error(shown, "remove", errno)),
        }
    }

    /// Marks `components` and all its ancestors as this layer's.
    fn record(&mut self, components: &[Vec<u8>]) {
        // An ancestor of a recorded path is recorded: stop at the first one already there.
        for len in (1..=components.len()).rev() {
            let key = self.key(components.get(..len).unwrap_or_default());
            if !self.ours.insert(key) {
                break;
            }
        }
    }

    /// Whether this layer made `components` (or something beneath it).
    fn is_ours(&self, components: &[Vec<u8>]) -> bool {
        self.ours.contains(&self.key(components))
    }

    /// A path's 128-bit key (two independently, randomly keyed SipHashes of its joined
    /// components): what `ours` and the deferred directories keep instead of the path.
    fn key(&self, components: &[Vec<u8>]) -> u128 {
        let joined = join(components);
        (u128::from(self.keys.0.hash_one(&joined)) << 64)
            | u128::from(self.keys.1.hash_one(&joined))
    }

    fn charge_inode(&self, shown: &str) -> Result<(), UnpackError> {
        self.budget.inode().map_err(|e| exceeded(shown, e))
    }

    fn charge_bytes(&self, n: u64, shown: &str) -> Result<(), UnpackError> {
        self.budget.bytes(n).map_err(|e| exceeded(shown, e))
    }

    /// Appends a directory's metadata to the deferred file (made in the root on first use).
    fn defer_dir(
        &mut self,
        components: &[Vec<u8>],
        meta: &Meta,
        shown: &str,
    ) -> Result<(), UnpackError> {
        let record = encode_dir(components, meta);
        let with_len = record.len() as u64 + 8;
        self.charge_bytes(with_len, shown)?;
        if self.dirs.file.is_none() {
            self.dirs.file = Some(self.deferred_file(shown)?);
        }
        let key = self.key(components);
        let Some(file) = &self.dirs.file else {
            return Ok(());
        };
        let at = self.dirs.len;
        let write_err = |source| UnpackError::Io {
            entry: shown.to_owned(),
            op: "write deferred directory metadata",
            source,
        };
        file.write_all_at(&record, at).map_err(write_err)?;
        file.write_all_at(
            &(record.len() as u64).to_le_bytes(),
            at + record.len() as u64,
        )
        .map_err(write_err)?;
        self.dirs.len = at + with_len;
        self.dirs.last.insert(key, at);
        Ok(())
    }

    /// An unnamed file in the root: `O_TMPFILE`, or (where the file system has none) a
    /// random name made exclusively and unlinked at once. Either way nothing of it stays in
    /// the tree, and its blocks are freed when the layer ends, whatever way it ends.
    fn deferred_file(&self, shown: &str) -> Result<File, UnpackError> {
        let err = |source: Errno| io_error(shown, "create the deferred metadata file", source);
        match rustix::fs::openat(
            &self.root_fd,
            ".",
            OFlags::TMPFILE | OFlags::RDWR | OFlags::CLOEXEC,
            Mode::from_raw_mode(0o600),
        ) {
            Ok(fd) => return Ok(File::from(fd)),
            Err(Errno::OPNOTSUPP | Errno::ISDIR | Errno::INVAL | Errno::NOENT) => {}
            Err(errno) => return Err(err(errno)),
        }
        let name = format!(".csi-agent-dirs-{:016x}", rand::random::<u64>());
        let fd = rustix::fs::openat(
            &self.root_fd,
            name.as_str(),
            OFlags::CREATE | OFlags::EXCL | OFlags::NOFOLLOW | OFlags::RDWR | OFlags::CLOEXEC,
            Mode::from_raw_mode(0o600),
        )
        .map_err(err)?;
        rustix::fs::unlinkat(&self.root_fd, name.as_str(), AtFlags::empty()).map_err(err)?;
        Ok(File::from(fd))
    }

    /// Owner, mode, extended attributes and times of a file or directory open for reading
    /// or writing, in that order: chown clears set-id bits and file capabilities.
    fn set_meta_fd(
        &mut self,
        fd: BorrowedFd<'_>,
        meta: &Meta,
        shown: &str,
    ) -> Result<(), UnpackError> {
        if self.as_root {
            rustix::fs::fchown(fd, Some(uid(meta.uid)), Some(gid(meta.gid)))
                .map_err(|errno| io_error(shown, "chown", errno))?;
        }
        rustix::fs::fchmod(fd, Mode::from_raw_mode(meta.mode))
            .map_err(|errno| io_error(shown, "chmod", errno))?;
        for (name, value) in &meta.xattrs {
            if let Err(errno) =
                rustix::fs::fsetxattr(fd, name.as_slice(), value, XattrFlags::empty())
            {
                // Best effort: a file system without xattrs (or the attribute's namespace)
                // still gets the layer.
                tracing::debug!(entry = %shown, xattr = %String::from_utf8_lossy(name), %errno, "extended attribute not kept");
                self.report.xattrs_not_kept += 1;
            }
        }
        rustix::fs::futimens(fd, &times(meta.mtime))
            .map_err(|errno| io_error(shown, "set times", errno))
    }

    /// Owner, mode and times of a device node or FIFO just made by `mknodat`, without
    /// opening it for I/O (opening a device can act on it).
    fn set_meta_node(
        &mut self,
        parent: BorrowedFd<'_>,
        name: &[u8],
        file_type: FileType,
        meta: &Meta,
        shown: &str,
    ) -> Result<(), UnpackError> {
        let fd = rustix::fs::openat(
            parent,
            name,
            OFlags::PATH | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            Mode::empty(),
        )
        .map_err(|errno| io_error(shown, "open", errno))?;
        let stat = rustix::fs::fstat(&fd).map_err(|errno| io_error(shown, "stat", errno))?;
        if FileType::from_raw_mode(stat.st_mode) != file_type {
            return Err(io_error(shown, "mknod", Errno::EXIST));
        }
        if self.as_root {
            rustix::fs::chownat(
                &fd,
                "",
                Some(uid(meta.uid)),
                Some(gid(meta.gid)),
                AtFlags::EMPTY_PATH,
            )
            .map_err(|errno| io_error(shown, "chown", errno))?;
        }
        // fchmod refuses O_PATH fds; the fd's magic link reaches exactly this inode.
        rustix::fs::chmod(beneath::fd_path(fd.as_fd()), Mode::from_raw_mode(meta.mode))
            .map_err(|errno| io_error(shown, "chmod", errno))?;
        self.report.xattrs_not_kept += meta.xattrs.len() as u64;
        rustix::fs::utimensat(parent, name, &times(meta.mtime), AtFlags::SYMLINK_NOFOLLOW)
            .map_err(|errno| io_error(shown, "set times", errno))
    }

    /// Applies directory metadata, the last entry for a directory winning, deepest (latest)
    /// first; a directory a later entry replaced (by a file or symlink) is skipped. Records
    /// are read back from the deferred file one at a time, last first.
    fn finish(mut self) -> Result<Report, UnpackError> {
        let dirs = std::mem::take(&mut self.dirs);
        let Some(file) = dirs.file else {
            return Ok(self.report);
        };
        let read_err = |source| UnpackError::Io {
            entry: "<deferred directory metadata>".to_owned(),
            op: "read",
            source,
        };
        let mut end = dirs.len;
        let mut record = Vec::new();
        while end >= 8 {
            let mut len = [0u8; 8];
            file.read_exact_at(&mut len, end - 8).map_err(read_err)?;
            let len = u64::from_le_bytes(len);
            let start = (end - 8)
                .checked_sub(len)
                .ok_or_else(|| read_err(io::Error::other("a record runs past the start")))?;
            record.resize(usize::try_from(len).unwrap_or(usize::MAX), 0);
            file.read_exact_at(&mut record, start).map_err(read_err)?;
            end = start;
            let (components, meta) = decode_dir(&record)
                .ok_or_else(|| read_err(io::Error::other("a record does not decode")))?;
            if dirs.last.get(&self.key(&components)) != Some(&start) {
                continue;
            }
            let shown = show(&join(&components));
            let opened = match beneath::open_dir(
                self.root_fd.as_fd(),
                self.root,
                &relative(&components),
                None,
            ) {
                Ok(opened) => opened.fd,
                Err(
                    BeneathError::NotFound { .. }
                    | BeneathError::Symlink { .. }
                    | BeneathError::NotADirectory { .. },
                ) => continue,
                Err(source) => return Err(beneath_error(&shown, source)),
            };
            let fd = rustix::fs::openat(
                &opened,
                ".",
                OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
                Mode::empty(),
            )
            .map_err(|errno| io_error(&shown, "open", errno))?;
            self.set_meta_fd(fd.as_fd(), &meta, &shown)?;
        }
        Ok(self.report)
    }
}

/// One deferred directory: its components, then mode, uid, gid, mtime and its extended
/// attributes, every length a little-endian u32 (names are at most `PATH_MAX`, attributes
/// at most [`MAX_XATTR_BYTES_PER_ENTRY`]).
fn encode_dir(components: &[Vec<u8>], meta: &Meta) -> Vec<u8> {
    fn put(out: &mut Vec<u8>, bytes: &[u8]) {
        out.extend_from_slice(&(bytes.len() as u32).to_le_bytes());
        out.extend_from_slice(bytes);
    }
    let mut out = Vec::new();
    out.extend_from_slice(&(components.len() as u32).to_le_bytes());
    for component in components {
        put(&mut out, component);
    }
    out.extend_from_slice(&meta.mode.to_le_bytes());
    out.extend_from_slice(&meta.uid.to_le_bytes());
    out.extend_from_slice(&meta.gid.to_le_bytes());
    out.extend_from_slice(&meta.mtime.to_le_bytes());
    out.extend_from_slice(&(meta.xattrs.len() as u32).to_le_bytes());
    for (name, value) in &meta.xattrs {
        put(&mut out, name);
        put(&mut out, value);
    }
    out
}

/// The inverse of [`encode_dir`]; `None` for a record it did not write.
fn decode_dir(mut record: &[u8]) -> Option<(Vec<Vec<u8>>, Meta)> {
    fn take<'r>(record: &mut &'r [u8], n: usize) -> Option<&'r [u8]> {
        let (head, rest) = record.split_at_checked(n)?;
        *record = rest;
        Some(head)
    }
    fn u32_of(record: &mut &[u8]) -> Option<u32> {
        Some(u32::from_le_bytes(take(record, 4)?.try_into().ok()?))
    }
    fn bytes(record: &mut &[u8]) -> Option<Vec<u8>> {
        let len = u32_of(record)? as usize;
        Some(take(record, len)?.to_vec())
    }
    let count = u32_of(&mut record)?;
    let mut components = Vec::new();
    for _ in 0..count {
        components.push(bytes(&mut record)?);
    }
    let mode = u32_of(&mut record)?;
    let uid = u32_of(&mut record)?;
    let gid = u32_of(&mut record)?;
    let mtime = i64::from_le_bytes(take(&mut record, 8)?.try_into().ok()?);
    let mut xattrs = Vec::new();
    for _ in 0..u32_of(&mut record)? {
        let name = bytes(&mut record)?;
        let value = bytes(&mut record)?;
        xattrs.push((name, value));
    }
    record.is_empty().then_some((
        components,
        Meta {
            mode,
            uid,
            gid,
            mtime,
            xattrs,
        },
    ))
}

/// Opens `name` in `dir` as a directory, beneath `dir` and following no link.
fn open_child_dir(dir: BorrowedFd<'_>, name: &[u8], mode: OFlags) -> Result<OwnedFd, Errno> {
    rustix::fs::openat2(
        dir,
        name,
        mode | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::empty(),
        ResolveFlags::BENEATH | ResolveFlags::NO_SYMLINKS | ResolveFlags::NO_MAGICLINKS,
    )
}

/// The names in a directory (`dir` may be an `O_PATH` fd), `.` and `..` left out.
fn list(dir: BorrowedFd<'_>) -> Result<Vec<Vec<u8>>, Errno> {
    let fd = rustix::fs::openat(
        dir,
        ".",
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
        Mode::empty(),
    )?;
    let mut names = Vec::new();
    for entry in rustix::fs::Dir::new(fd)? {
        let name = entry?.file_name().to_bytes().to_vec();
        if name != b"." && name != b".." {
            names.push(name);
        }
    }
    Ok(names)
}

/// True when `dir` carries overlayfs's opaque xattr.
fn is_opaque(dir: BorrowedFd<'_>) -> bool {
    let Ok(fd) = rustix::fs::openat(
        dir,
        ".",
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
        Mode::empty(),
    ) else {
        return false;
    };
    let mut value = [0u8; 8];
    matches!(rustix::fs::fgetxattr(&fd, OVERLAY_OPAQUE_XATTR, &mut value), Ok(1) if value[0] == b'y')
}

fn detect<R: Read>(input: &mut BufReader<R>) -> Result<Compression, UnpackError> {
    let head = input
        .fill_buf()
        .map_err(|source| UnpackError::Read { source })?;
    if head.starts_with(&[0x1f, 0x8b]) {
        Ok(Compression::Gzip)
    } else if head.starts_with(&[0x28, 0xb5, 0x2f, 0xfd]) {
        Err(UnpackError::UnsupportedCompression("zstd"))
    } else if head.starts_with(&[0xfd, b'7', b'z', b'X', b'Z', 0x00]) {
        Err(UnpackError::UnsupportedCompression("xz"))
    } else {
        Ok(Compression::None)
    }
}

enum Decoded<R: Read> {
    Plain(R),
    Gzip(MultiGzDecoder<R>),
}

impl<R: Read> Read for Decoded<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Self::Plain(r) => r.read(buf),
            Self::Gzip(r) => r.read(buf),
        }
    }
}

/// A reader that fails once more than `left` bytes come, and says so in `exceeded`.
struct Bounded<R> {
    inner: R,
    left: u64,
    exceeded: Rc<Cell<bool>>,
}

impl<R: Read> Read for Bounded<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        // One byte more than is left tells a stream that ends exactly at the limit from one
        // that goes past it.
        let want = usize::try_from(self.left.saturating_add(1))
            .unwrap_or(usize::MAX)
            .min(buf.len());
        let n = self.inner.read(buf.get_mut(..want).unwrap_or_default())?;
        if n as u64 > self.left {
            self.exceeded.set(true);
            self.left = 0;
            return Err(io::Error::other("the layer is larger than the limit"));
        }
        self.left -= n as u64;
        Ok(n)
    }
}

/// A numeric header field that is empty (all NUL or spaces) reads as 0, as Go's
/// `archive/tar` (and so Docker and containerd) reads it; the tar crate refuses it. Anything
/// else unreadable stays an error.
fn lenient<T: Default>(
    header: &tar::Header,
    field: std::ops::Range<usize>,
    value: io::Result<T>,
) -> io::Result<T> {
    match value {
        Err(_)
            if header
                .as_bytes()
                .get(field)
                .is_some_and(|raw| raw.iter().all(|b| *b == 0 || *b == b' ')) =>
        {
            Ok(T::default())
        }
        other => other,
    }
}

/// Only namespaces an image may legitimately carry (see the module doc).
fn kept_xattr(name: &[u8]) -> bool {
    name.starts_with(b"user.")
        || name == b"security.capability"
        || name == b"system.posix_acl_access"
        || name == b"system.posix_acl_default"
}

fn parse_decimal<T: std::str::FromStr>(
    value: &[u8],
    shown: &str,
    field: &'static str,
) -> Result<T, UnpackError> {
    std::str::from_utf8(value)
        .ok()
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| malformed(shown, field, io::Error::other("not a decimal number")))
}

fn relative(components: &[Vec<u8>]) -> PathBuf {
    components.iter().map(|c| OsStr::from_bytes(c)).collect()
}

fn join(components: &[Vec<u8>]) -> Vec<u8> {
    components.join(&b'/')
}

fn times(mtime: i64) -> Timestamps {
    let at = Timespec {
        tv_sec: mtime,
        tv_nsec: 0,
    };
    Timestamps {
        last_access: at,
        last_modification: at,
    }
}

fn uid(raw: u32) -> Uid {
    Uid::from_raw(raw)
}

fn gid(raw: u32) -> Gid {
    Gid::from_raw(raw)
}

/// An entry name fit for an error message.
fn show(raw: &[u8]) -> String {
    const SHOWN: usize = 200;
    let mut shown = String::from_utf8_lossy(raw.get(..SHOWN).unwrap_or(raw)).into_owned();
    if raw.len() > SHOWN {
        shown.push('…');
    }
    shown
}

fn refused(shown: &str, reason: Refusal) -> UnpackError {
    UnpackError::Refused {
        entry: shown.to_owned(),
        reason,
    }
}

fn limit(shown: &str, limit: LimitKind, max: impl TryInto<u64>) -> UnpackError {
    UnpackError::Limit {
        entry: shown.to_owned(),
        limit,
        max: max.try_into().unwrap_or(u64::MAX),
    }
}

fn exceeded(shown: &str, exceeded: Exceeded) -> UnpackError {
    UnpackError::Limit {
        entry: shown.to_owned(),
        limit: exceeded.limit,
        max: exceeded.max,
    }
}

fn malformed(shown: &str, field: &'static str, source: io::Error) -> UnpackError {
    UnpackError::Malformed {
        entry: shown.to_owned(),
        field,
        source,
    }
}

fn beneath_error(shown: &str, source: BeneathError) -> UnpackError {
    UnpackError::Beneath {
        entry: shown.to_owned(),
        source,
    }
}

fn io_error(shown: &str, op: &'static str, errno: Errno) -> UnpackError {
    UnpackError::Io {
        entry: shown.to_owned(),
        op,
        source: errno.into(),
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    fn layer(limits: &Limits) -> Layer<'_> {
        Layer {
            root: Path::new("/nonexistent"),
            root_fd: beneath::open_root(Path::new("/")).unwrap(),
            limits,
            as_root: false,
            report: Report::default(),
            budget: Box::leak(Box::new(Budget::unlimited())),
            ours: HashSet::new(),
            keys: (RandomState::new(), RandomState::new()),
            dirs: DeferredDirs::default(),
            lowers: None,
            archive: false,
        }
    }

    #[test]
    fn names_are_normalised_like_docker_and_dotdot_refused() {
        let limits = Limits::default();
        let layer = layer(&limits);
        let parts = |raw: &str| {
            layer
                .components(raw.as_bytes(), raw, Refusal::ParentDir)
                .map(|c| {
                    c.iter()
                        .map(|p| String::from_utf8_lossy(p).into_owned())
                        .collect::<Vec<_>>()
                        .join("/")
                })
        };
        for (raw, want) in [
            ("a/b", "a/b"),
            ("/a/b", "a/b"),
            ("./a/b/", "a/b"),
            ("//a/./b", "a/b"),
            ("./", ""),
            ("...", "..."),
            ("..a/b..", "..a/b.."),
        ] {
            assert_eq!(parts(raw).unwrap(), want, "{raw:?}");
        }
        for raw in ["..", "../a", "a/../b", "a/..", "/../a"] {
            assert!(
                matches!(
                    parts(raw),
                    Err(UnpackError::Refused {
                        reason: Refusal::ParentDir,
                        ..
                    })
                ),
                "{raw:?}"
            );
        }
        assert!(matches!(
            layer.components(b"a\0b", "a", Refusal::ParentDir),
            Err(UnpackError::Refused {
                reason: Refusal::Nul,
                ..
            })
        ));
        let long = "x".repeat(256);
        assert!(matches!(
            parts(&long),
            Err(UnpackError::Limit {
                limit: LimitKind::ComponentBytes,
                ..
            })
        ));
    }

    #[test]
    fn a_path_this_layer_made_is_recorded_with_its_ancestors() {
        let limits = Limits::default();
        let mut layer = layer(&limits);
        layer.record(&[b"a".to_vec(), b"b".to_vec(), b"c".to_vec()]);
        let parts = |path: &str| -> Vec<Vec<u8>> {
            path.split('/').map(|c| c.as_bytes().to_vec()).collect()
        };
        for path in ["a", "a/b", "a/b/c"] {
            assert!(layer.is_ours(&parts(path)), "{path}");
        }
        assert!(!layer.is_ours(&parts("a/b/d")));
        assert_eq!(layer.ours.len(), 3);
    }

    #[test]
    fn deferred_directory_records_decode_to_what_was_encoded() {
        let components = vec![b"a".to_vec(), vec![0xff; 255]];
        let meta = Meta {
            mode: 0o1755,
            uid: 7,
            gid: 8,
            mtime: -5,
            xattrs: vec![(b"user.x".to_vec(), vec![1; 1000])],
        };
        let record = encode_dir(&components, &meta);
        let (back, got) = decode_dir(&record).unwrap();
        assert_eq!(back, components);
        assert_eq!(
            (got.mode, got.uid, got.gid, got.mtime, got.xattrs),
            (meta.mode, meta.uid, meta.gid, meta.mtime, meta.xattrs)
        );
        assert!(decode_dir(&record[..record.len() - 1]).is_none());
        let mut longer = record.clone();
        longer.push(0);
        assert!(decode_dir(&longer).is_none());
    }

    #[test]
    fn the_bound_trips_past_the_limit_not_at_it() {
        let exceeded = Rc::new(Cell::new(false));
        let mut exact = Bounded {
            inner: &[1u8; 10][..],
            left: 10,
            exceeded: Rc::clone(&exceeded),
        };
        let mut out = Vec::new();
        exact.read_to_end(&mut out).unwrap();
        assert_eq!(out.len(), 10);
        assert!(!exceeded.get());
        let mut over = Bounded {
            inner: &[1u8; 11][..],
            left: 10,
            exceeded: Rc::clone(&exceeded),
        };
        assert!(over.read_to_end(&mut Vec::new()).is_err());
        assert!(exceeded.get());
    }

    #[test]
    fn empty_numeric_fields_read_as_zero_and_garbage_does_not() {
        let mut header = tar::Header::new_ustar();
        header.as_mut_bytes()[108..116].fill(0);
        assert_eq!(lenient(&header, 108..116, header.uid()).unwrap(), 0);
        header.as_mut_bytes()[108..116].copy_from_slice(b"zzzzzzz\0");
        assert!(lenient(&header, 108..116, header.uid()).is_err());
    }
}
