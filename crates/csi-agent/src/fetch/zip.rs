//! Zip archives for `uris` `extract`: a fetched `.zip` is rewritten as a tar, entry by entry,
//! with each entry's name, type, mode and (for a symlink) target kept as they are, and that tar
//! is extracted by the same code as a fetched `.tar.gz` (`crate::image::unpack`), so a zip
//! entry meets exactly the tar rules: no absolute name, no `..`, nothing through a symlink, no
//! device node, entries and bytes bounded.
//!
//! It owns the rewrite and the zip bomb bounds that must hold before a byte is written out: at
//! most `max_entries` entries, at most `max_bytes` decompressed in all (each entry's reader is
//! cut one byte past what is left, whatever its header claims). It must not write anywhere but
//! the tar and scratch files it is given (hidden temp names in the sandbox), and it never
//! interprets a name: refusing hostile ones is the unpacker's job.

use std::fs::File;
use std::io::{self, Read, Seek, Write};
use std::path::Path;

/// File type bits of a zip entry's Unix mode (`st_mode`).
const S_IFMT: u32 = 0o170_000;
const S_IFLNK: u32 = 0o120_000;
const S_IFDIR: u32 = 0o040_000;
const S_IFCHR: u32 = 0o020_000;
const S_IFBLK: u32 = 0o060_000;
const S_IFIFO: u32 = 0o010_000;
/// Longest symlink target read from an entry (`PATH_MAX`).
const MAX_LINK_TARGET: u64 = 4096;

/// Why a zip could not be rewritten; the caller names the URI.
#[derive(Debug, thiserror::Error)]
pub enum ZipError {
    #[error("not a readable zip archive: {0}")]
    Zip(#[from] ::zip::result::ZipError),
    #[error("it has {count} entries, more than the {max} allowed")]
    TooManyEntries { count: usize, max: u64 },
    #[error(
        "it expands to more than {max} bytes (entry {entry:?}): a zip bomb, or raise --fetch-max-bytes"
    )]
    TooLarge { entry: String, max: u64 },
    #[error("entry {entry:?}: its symlink target is longer than {MAX_LINK_TARGET} bytes")]
    LinkTarget { entry: String },
    #[error("writing the rewritten archive: {0}")]
    Io(#[from] io::Error),
}

/// Rewrites the zip at `zip` as the tar `tar`, using `scratch` for one entry at a time.
pub fn to_tar(
    zip: &Path,
    tar: &Path,
    scratch: &Path,
    max_entries: u64,
    max_bytes: u64,
) -> Result<(), ZipError> {
    let mut archive = ::zip::ZipArchive::new(File::open(zip)?)?;
    if u64::try_from(archive.len()).unwrap_or(u64::MAX) > max_entries {
        return Err(ZipError::TooManyEntries {
            count: archive.len(),
            max: max_entries,
        });
    }
    let mut builder = ::tar::Builder::new(File::create(tar)?);
    let mut left = max_bytes;
    for index in 0..archive.len() {
        let mut entry = archive.by_index(index)?;
        let name = entry.name_raw().to_vec();
        let shown = String::from_utf8_lossy(&name).into_owned();
        let mode = entry.unix_mode();
        let kind = match mode.map(|m| m & S_IFMT) {
            Some(S_IFLNK) => ::tar::EntryType::Symlink,
            Some(S_IFDIR) => ::tar::EntryType::Directory,
            Some(S_IFCHR) => ::tar::EntryType::Char,
            Some(S_IFBLK) => ::tar::EntryType::Block,
            Some(S_IFIFO) => ::tar::EntryType::Fifo,
            _ if entry.is_dir() => ::tar::EntryType::Directory,
            _ => ::tar::EntryType::Regular,
        };
        let mut header = ::tar::Header::new_gnu();
        header.set_entry_type(kind);
        header.set_mode(mode.map_or(if kind.is_dir() { 0o755 } else { 0o644 }, |m| m & 0o7777));
        header.set_mtime(0);
        long_field(&mut builder, ::tar::EntryType::GNULongName, &name)?;
        raw_field(&mut header.as_old_mut().name, &name);
        match kind {
            ::tar::EntryType::Regular => {
                // Decompressed into scratch first (a tar header needs the size), cut one
                // byte past what the whole archive may still expand to.
                let mut file = std::fs::OpenOptions::new()
                    .read(true)
                    .write(true)
                    .create(true)
                    .truncate(true)
                    .open(scratch)?;
                let copied = io::copy(&mut (&mut entry).take(left.saturating_add(1)), &mut file)?;
                if copied > left {
                    return Err(ZipError::TooLarge {
                        entry: shown,
                        max: max_bytes,
                    });
                }
                left -= copied;
                header.set_size(copied);
                header.set_cksum();
                file.rewind()?;
                builder.append(&header, file)?;
            }
            ::tar::EntryType::Symlink => {
                let mut target = Vec::new();
                (&mut entry)
                    .take(MAX_LINK_TARGET + 1)
                    .read_to_end(&mut target)?;
                if u64::try_from(target.len()).unwrap_or(u64::MAX) > MAX_LINK_TARGET {
                    return Err(ZipError::LinkTarget { entry: shown });
                }
                long_field(&mut builder, ::tar::EntryType::GNULongLink, &target)?;
                raw_field(&mut header.as_old_mut().linkname, &target);
                header.set_size(0);
                header.set_cksum();
                builder.append(&header, io::empty())?;
            }
            _ => {
                header.set_size(0);
                header.set_cksum();
                builder.append(&header, io::empty())?;
            }
        }
    }
    builder.into_inner()?.flush()?;
    Ok(())
}

/// `bytes` into a header field as they are (truncated where a GNU long entry before the
/// header carries the whole).
fn raw_field(field: &mut [u8], bytes: &[u8]) {
    let n = bytes.len().min(field.len());
    field[..n].copy_from_slice(&bytes[..n]);
}

/// A GNU long name (or link) entry before the real one when `bytes` does not fit the
/// header's 100 bytes: the tar reader then takes the name from it, as tar-rs writes them.
fn long_field(
    builder: &mut ::tar::Builder<File>,
    kind: ::tar::EntryType,
    bytes: &[u8],
) -> io::Result<()> {
    if bytes.len() <= 100 {
        return Ok(());
    }
    let mut header = ::tar::Header::new_gnu();
    raw_field(&mut header.as_old_mut().name, b"././@LongLink");
    header.set_entry_type(kind);
    header.set_mode(0o644);
    header.set_mtime(0);
    let mut data = bytes.to_vec();
    data.push(0);
    header.set_size(u64::try_from(data.len()).unwrap_or(u64::MAX));
    header.set_cksum();
    builder.append(&header, data.as_slice())
}
