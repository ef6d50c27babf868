//! What preparing one image may write, across all its layers: unpacked bytes and inodes
//! (`--image-max-unpacked-bytes`, `--image-max-inodes`), and the room left under the image
//! store's quota (`--image-store-max-bytes`).
//!
//! It owns the counting: [`super::unpack`] charges every byte and every inode to a
//! [`Budget`] before it writes or creates it, so a hostile image is refused at the cap while
//! it is being written, not after the disk is full. It also measures a store's disk usage
//! ([`disk_usage`]) for the quota check before preparing. It must not remove anything nor
//! decide what a refusal means for the image: the store removes the partial layer, the
//! error's class is the store's.

use std::cell::Cell;
use std::io;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use super::unpack::LimitKind;

/// The caps on preparing one image, and the store's quota.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ImageLimits {
    /// Bytes written for one image's layers in all: file data (sparse files counted as
    /// expanded), symlink targets and the directory metadata held until a layer's end.
    pub max_unpacked_bytes: u64,
    /// Files, directories, links and device nodes made for one image, in all its layers.
    pub max_inodes: u64,
    /// The image store's size on disk (blobs, unpacked layers and root file systems) that
    /// preparing an image may not go past.
    pub store_max_bytes: u64,
}

/// `--image-max-unpacked-bytes`'s default: 8 GiB (the largest CSI plugin images unpack to
/// a few hundred MiB; `--image-import-max-bytes` is 8 GiB too).
pub const DEFAULT_MAX_UNPACKED_BYTES: u64 = 8 << 30;
/// `--image-max-inodes`' default (a full Debian root file system has about 30,000).
pub const DEFAULT_MAX_INODES: u64 = 1_000_000;
/// `--image-store-max-bytes`' default: 32 GiB.
pub const DEFAULT_STORE_MAX_BYTES: u64 = 32 << 30;

impl Default for ImageLimits {
    fn default() -> Self {
        Self {
            max_unpacked_bytes: DEFAULT_MAX_UNPACKED_BYTES,
            max_inodes: DEFAULT_MAX_INODES,
            store_max_bytes: DEFAULT_STORE_MAX_BYTES,
        }
    }
}

/// A cap was reached: which one, and its value.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Exceeded {
    pub limit: LimitKind,
    pub max: u64,
}

/// What one image's preparation may still write. Single-threaded: one image is prepared on
/// one blocking thread, layer after layer.
#[derive(Debug)]
pub struct Budget {
    max_bytes: u64,
    /// Which cap `max_bytes` is: the image's own, or what the store's quota leaves.
    bytes_kind: LimitKind,
    max_inodes: u64,
    bytes: Cell<u64>,
    inodes: Cell<u64>,
}

impl Budget {
    /// No cap (the per-layer [`super::unpack::Limits`] still hold).
    pub fn unlimited() -> Self {
        Self {
            max_bytes: u64::MAX,
            bytes_kind: LimitKind::ImageBytes,
            max_inodes: u64::MAX,
            bytes: Cell::new(0),
            inodes: Cell::new(0),
        }
    }

    /// The budget of an image prepared in a store that uses `store_used` bytes now: the
    /// image's caps, or what is left under the quota when that is less. A store already at
    /// its quota refuses at once.
    pub fn new(limits: &ImageLimits, store_used: u64) -> Result<Self, Exceeded> {
        let room = limits.store_max_bytes.saturating_sub(store_used);
        if room == 0 {
            return Err(Exceeded {
                limit: LimitKind::StoreBytes,
                max: limits.store_max_bytes,
            });
        }
        let (max_bytes, bytes_kind) = if room < limits.max_unpacked_bytes {
            (room, LimitKind::StoreBytes)
        } else {
            (limits.max_unpacked_bytes, LimitKind::ImageBytes)
        };
        Ok(Self {
            max_bytes,
            bytes_kind,
            max_inodes: limits.max_inodes,
            bytes: Cell::new(0),
            inodes: Cell::new(0),
        })
    }

    /// Charges `n` bytes about to be written; refused (and not charged) past the cap.
    pub fn bytes(&self, n: u64) -> Result<(), Exceeded> {
        let after = self.bytes.get().saturating_add(n);
        if after > self.max_bytes {
            return Err(Exceeded {
                limit: self.bytes_kind,
                max: self.max_bytes,
            });
        }
        self.bytes.set(after);
        Ok(())
    }

    /// Charges one inode (or name) about to be made.
    pub fn inode(&self) -> Result<(), Exceeded> {
        let after = self.inodes.get().saturating_add(1);
        if after > self.max_inodes {
            return Err(Exceeded {
                limit: LimitKind::ImageInodes,
                max: self.max_inodes,
            });
        }
        self.inodes.set(after);
        Ok(())
    }

    /// Bytes and inodes charged so far.
    pub fn used(&self) -> (u64, u64) {
        (self.bytes.get(), self.inodes.get())
    }
}

/// The space allocated to everything under `dir` (512-byte blocks, as `du` counts; a
/// file with several names counted once per name), symlinks not followed. Memory is one
/// directory listing handle per level of depth.
pub fn disk_usage(dir: &Path) -> io::Result<u64> {
    let mut total = std::fs::symlink_metadata(dir)?.blocks() * 512;
    let mut stack: Vec<(PathBuf, std::fs::ReadDir)> =
        vec![(dir.to_path_buf(), std::fs::read_dir(dir)?)];
    while let Some((_, entries)) = stack.last_mut() {
        let Some(entry) = entries.next() else {
            stack.pop();
            continue;
        };
        let entry = match entry {
            Ok(entry) => entry,
            // Removed while listed (a temp dir of a preparation that just ended).
            Err(err) if err.kind() == io::ErrorKind::NotFound => continue,
            Err(err) => return Err(err),
        };
        let meta = match entry.path().symlink_metadata() {
            Ok(meta) => meta,
            Err(err) if err.kind() == io::ErrorKind::NotFound => continue,
            Err(err) => return Err(err),
        };
        total = total.saturating_add(meta.blocks() * 512);
        if meta.is_dir() {
            let path = entry.path();
            match std::fs::read_dir(&path) {
                Ok(listing) => stack.push((path, listing)),
                Err(err) if err.kind() == io::ErrorKind::NotFound => {}
                Err(err) => return Err(err),
            }
        }
    }
    Ok(total)
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    #[test]
    fn the_tighter_of_the_image_cap_and_the_quota_room_is_the_bound() {
        let limits = ImageLimits {
            max_unpacked_bytes: 100,
            max_inodes: 2,
            store_max_bytes: 1000,
        };
        let budget = Budget::new(&limits, 0).unwrap();
        budget.bytes(100).unwrap();
        let err = budget.bytes(1).unwrap_err();
        assert_eq!(err.limit, LimitKind::ImageBytes);
        assert_eq!(budget.used().0, 100, "a refused charge is not counted");
        budget.inode().unwrap();
        budget.inode().unwrap();
        assert_eq!(budget.inode().unwrap_err().limit, LimitKind::ImageInodes);

        let near_full = Budget::new(&limits, 950).unwrap();
        near_full.bytes(50).unwrap();
        assert_eq!(
            near_full.bytes(1).unwrap_err(),
            Exceeded {
                limit: LimitKind::StoreBytes,
                max: 50
            }
        );
        assert_eq!(
            Budget::new(&limits, 1000).unwrap_err().limit,
            LimitKind::StoreBytes
        );
    }
}
