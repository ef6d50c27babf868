//! Snapshots (`--snapshots`: CREATE_DELETE_SNAPSHOT, LIST_SNAPSHOTS) and
//! volumes created from a snapshot or cloned from a volume (`--clones` for
//! CLONE_VOLUME; a snapshot source needs `--snapshots`).
//!
//! Owns: the copy of a volume's data into `<work-dir>/snapshots/<id>` and of
//! a snapshot's or volume's data into a new volume, the snapshot records in
//! `state.json`, their CSI error codes and paging, and the start-up cleanup
//! of copies a crash interrupted.
//!
//! Must not: follow a symbolic link or cross a mount point while copying (a
//! volume's content is the workload's, hence hostile: a symlink to `/etc`
//! is copied as that symlink, never as `/etc`), or mount anything. Every copy
//! is recorded as an intent before it starts, so that a plugin killed in the
//! middle finds the record at start and removes the partial copy instead of
//! serving it as data.

use std::fs::{self, OpenOptions};
use std::io;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use tonic::Status;

use super::{Plugin, encode_token, internal, invalid, page_bounds};
use crate::backing;
use crate::cli::Config;
use crate::model::validate_volume_name;
use crate::state::{ContentSource, SnapshotRecord, StateFile};

/// Controller capability numbers (v1).
pub const CAP_CREATE_DELETE_SNAPSHOT: i32 = 5;
pub const CAP_LIST_SNAPSHOTS: i32 = 6;
pub const CAP_CLONE_VOLUME: i32 = 7;

/// A snapshot as the RPCs report it.
#[derive(Clone, Debug)]
pub struct SnapshotInfo {
    pub id: String,
    pub source_volume_id: String,
    pub size_bytes: i64,
    pub creation_time_ns: u64,
    pub ready_to_use: bool,
}

/// CreateSnapshot, version-neutral.
#[derive(Debug)]
pub struct SnapshotArgs {
    pub name: String,
    pub source_volume_id: String,
    pub parameters: std::collections::BTreeMap<String, String>,
}

fn info(id: &str, r: &SnapshotRecord) -> SnapshotInfo {
    SnapshotInfo {
        id: id.to_owned(),
        source_volume_id: r.source_volume_id.clone(),
        size_bytes: r.size_bytes,
        creation_time_ns: r.creation_time_ns,
        ready_to_use: r.not_ready_answers == 0,
    }
}

/// Copies the tree at `src` into `dst` (created): directories, regular files
/// (opened with `O_NOFOLLOW`) and symbolic links as links. Anything on
/// another device (a mount inside the volume) and special files are skipped.
/// Returns the bytes of regular files copied.
pub fn copy_tree(src: &Path, dst: &Path) -> io::Result<i64> {
    let root = fs::symlink_metadata(src)?;
    if !root.is_dir() {
        return Err(io::Error::other(format!(
            "{} is not a directory",
            src.display()
        )));
    }
    fs::create_dir_all(dst)?;
    copy_dir(src, dst, root.dev())
}

fn copy_dir(src: &Path, dst: &Path, dev: u64) -> io::Result<i64> {
    let mut bytes = 0i64;
    for entry in fs::read_dir(src)? {
        let entry = entry?;
        let (from, to) = (entry.path(), dst.join(entry.file_name()));
        let meta = fs::symlink_metadata(&from)?;
        if meta.dev() != dev {
            tracing::warn!(path = %from.display(), "not copying across a mount point");
            continue;
        }
        let kind = meta.file_type();
        if kind.is_symlink() {
            std::os::unix::fs::symlink(fs::read_link(&from)?, &to)?;
        } else if kind.is_dir() {
            fs::create_dir(&to)?;
            fs::set_permissions(&to, meta.permissions())?;
            bytes = bytes.saturating_add(copy_dir(&from, &to, dev)?);
        } else if kind.is_file() {
            let nofollow = rustix::fs::OFlags::NOFOLLOW.bits() as i32;
            let mut input = OpenOptions::new()
                .read(true)
                .custom_flags(nofollow)
                .open(&from)?;
            let mut output = OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(meta.mode() & 0o7777)
                .open(&to)?;
            let n = io::copy(&mut input, &mut output)?;
            output.sync_all()?;
            bytes = bytes.saturating_add(i64::try_from(n).unwrap_or(i64::MAX));
        } else {
            tracing::warn!(path = %from.display(), "not copying a special file");
        }
    }
    Ok(bytes)
}

/// Removes `path` and what is beneath it, never across a mount point (the
/// copies made here hold none, but a test may bind something there).
fn remove_copy(path: &Path) {
    match crate::mounts::mount_points_under(path) {
        Ok(under) if under.is_empty() => {}
        Ok(under) => {
            tracing::warn!(path = %path.display(), mounts = ?under, "not removing a copy with mounts inside");
            return;
        }
        Err(e) => {
            tracing::warn!(path = %path.display(), "reading the mount table: {e}");
            return;
        }
    }
    if let Err(e) = fs::remove_dir_all(path)
        && e.kind() != io::ErrorKind::NotFound
    {
        tracing::warn!(path = %path.display(), "removing an interrupted copy: {e}");
    }
}

fn snapshots_dir(cfg: &Config) -> PathBuf {
    cfg.work_dir.join("snapshots")
}

fn partial_dir(cfg: &Config) -> PathBuf {
    cfg.work_dir.join("snapshots.partial")
}

/// At start: drops snapshot records a crash left incomplete (and their
/// partial copies), snapshot directories without a record, and volumes
/// whose content copy was interrupted. Returns whether `s` changed.
pub(super) fn reconcile_copies(
    cfg: &Config,
    s: &mut StateFile,
    volumes_dir: &Path,
) -> anyhow::Result<bool> {
    let mut changed = false;
    let partial = partial_dir(cfg);
    if partial.exists() {
        remove_copy(&partial);
    }
    let snapshots = snapshots_dir(cfg);
    fs::create_dir_all(&snapshots)?;
    s.snapshots.retain(|id, r| {
        if !r.complete {
            tracing::warn!(snapshot = %id, "dropping a snapshot whose copy was interrupted");
            remove_copy(&snapshots.join(id));
            changed = true;
        }
        r.complete
    });
    for entry in fs::read_dir(&snapshots)? {
        let entry = entry?;
        let name = entry.file_name();
        let known = name.to_str().is_some_and(|n| s.snapshots.contains_key(n));
        if !known {
            tracing::warn!(entry = ?name, "removing a snapshot directory without a record");
            remove_copy(&entry.path());
        }
    }
    let interrupted: Vec<String> = s
        .volumes
        .iter()
        .filter(|(_, v)| v.populating)
        .map(|(id, _)| id.clone())
        .collect();
    for id in interrupted {
        tracing::warn!(volume = %id, "removing a volume whose content copy was interrupted");
        let dir = volumes_dir.join(&id);
        backing::release(&dir, cfg.volume_fs)?;
        remove_copy(&dir);
        s.volumes.remove(&id);
        changed = true;
    }
    Ok(changed)
}

impl Plugin {
    pub(super) fn snapshots_dir(&self) -> PathBuf {
        snapshots_dir(&self.cfg)
    }

    fn partial_dir(&self) -> PathBuf {
        partial_dir(&self.cfg)
    }

    pub async fn create_snapshot(&self, a: SnapshotArgs) -> Result<SnapshotInfo, Status> {
        // CreateSnapshotRequest: "source_volume_id ... This field is
        // REQUIRED." and "name ... This field is REQUIRED."
        if a.source_volume_id.is_empty() {
            return Err(invalid("source_volume_id is required"));
        }
        if a.name.is_empty() {
            return Err(invalid("name is required"));
        }
        validate_volume_name(&a.name).map_err(|e| invalid(format!("snapshot name: {e}")))?;
        let ready_after = self.cfg.snapshot_ready_after;
        let now = crate::calllog::now_ns();
        let (name, source, parameters) = (a.name, a.source_volume_id, a.parameters);
        // Intent first: the record, then the copy.
        let existing = self
            .store
            .update(|s| {
                if let Some(r) = s.snapshots.get_mut(&name) {
                    // "Snapshot already exists but is incompatible | 6 ALREADY_EXISTS".
                    if r.source_volume_id != source || r.parameters != parameters {
                        return Err(Status::already_exists(format!(
                            "snapshot {name:?} exists for volume {:?} with parameters {:?}",
                            r.source_volume_id, r.parameters
                        )));
                    }
                    // "Operation pending for snapshot | 10 ABORTED".
                    if !r.complete {
                        return Err(Status::aborted(format!(
                            "snapshot {name:?} is being created"
                        )));
                    }
                    let answer = info(&name, r);
                    if r.not_ready_answers > 0 {
                        r.not_ready_answers -= 1;
                        return Ok((Some(answer), true));
                    }
                    return Ok((Some(answer), false));
                }
                // CreateSnapshot errors: "Source volume does not exist"
                // is NOT_FOUND in the csi-sanity suite and the hostpath driver.
                if !s.volumes.contains_key(&source) {
                    return Err(Status::not_found(format!(
                        "source volume {source:?} does not exist"
                    )));
                }
                s.snapshots.insert(
                    name.clone(),
                    SnapshotRecord {
                        source_volume_id: source.clone(),
                        parameters: parameters.clone(),
                        creation_time_ns: now,
                        not_ready_answers: ready_after,
                        ..SnapshotRecord::default()
                    },
                );
                Ok((None, true))
            })
            .await?;
        if let Some(answer) = existing {
            return Ok(answer);
        }
        let from = self.volume_dir(&source);
        let partial = self.partial_dir().join(&name);
        let done = self.snapshots_dir().join(&name);
        let copied = tokio::task::spawn_blocking(move || -> io::Result<i64> {
            if partial.exists() {
                fs::remove_dir_all(&partial)?;
            }
            let bytes = copy_tree(&from, &partial)?;
            fs::rename(&partial, &done)?;
            Ok(bytes)
        })
        .await
        .map_err(io::Error::other)
        .and_then(|r| r);
        let name2 = name.clone();
        let snapshots = self.snapshots_dir();
        self.store
            .update(move |s| {
                let bytes = match copied {
                    Ok(b) => b,
                    Err(e) => {
                        s.snapshots.remove(&name2);
                        remove_copy(&snapshots.join(&name2));
                        return Ok((
                            Err(internal(&format!("copying volume {source:?}"), e)),
                            true,
                        ));
                    }
                };
                let Some(r) = s.snapshots.get_mut(&name2) else {
                    // Deleted while it was being copied.
                    remove_copy(&snapshots.join(&name2));
                    return Ok((
                        Err(Status::aborted(format!(
                            "snapshot {name2:?} was deleted while it was being created"
                        ))),
                        false,
                    ));
                };
                r.size_bytes = bytes;
                r.complete = true;
                let answer = info(&name2, r);
                if r.not_ready_answers > 0 {
                    r.not_ready_answers -= 1;
                }
                Ok((Ok(answer), true))
            })
            .await?
    }

    pub async fn delete_snapshot(&self, id: &str) -> Result<(), Status> {
        // DeleteSnapshotRequest.snapshot_id: "This field is REQUIRED."
        if id.is_empty() {
            return Err(invalid("snapshot_id is required"));
        }
        // "If a snapshot corresponding to the specified snapshot_id does not
        // exist ... the Plugin MUST reply 0 OK."
        if validate_volume_name(id).is_err() {
            return Ok(());
        }
        let dir = self.snapshots_dir().join(id);
        let trash = self
            .trash_dir
            .join(format!("snapshot.{id}.{}", crate::calllog::now_ns()));
        let moved = self
            .store
            .update(|s| {
                if s.snapshots.remove(id).is_none() {
                    return Ok((false, false));
                }
                let moved = match fs::rename(&dir, &trash) {
                    Ok(()) => true,
                    Err(e) if e.kind() == io::ErrorKind::NotFound => false,
                    Err(e) => return Err(internal(&format!("removing {}", dir.display()), e)),
                };
                Ok((moved, true))
            })
            .await?;
        if moved {
            let _ = tokio::task::spawn_blocking(move || remove_copy(&trash)).await;
        }
        Ok(())
    }

    pub fn list_snapshots(
        &self,
        max_entries: i32,
        starting_token: &str,
        snapshot_id: &str,
        source_volume_id: &str,
    ) -> Result<(Vec<SnapshotInfo>, String), Status> {
        let (after, limit) = page_bounds(max_entries, starting_token)?;
        self.store.read(|s| {
            // An unknown snapshot_id or source_volume_id filters everything
            // out: an empty list, not an error (the spec's "if no snapshots
            // are found ... the Plugin MUST return an empty list").
            let mut matching = s
                .snapshots
                .iter()
                .filter(|(id, r)| {
                    r.complete
                        && (snapshot_id.is_empty() || *id == snapshot_id)
                        && (source_volume_id.is_empty() || r.source_volume_id == source_volume_id)
                        && after.as_ref().is_none_or(|a| id.as_str() > a.as_str())
                })
                .map(|(id, r)| info(id, r));
            let page: Vec<SnapshotInfo> = matching.by_ref().take(limit).collect();
            let next = match (matching.next(), page.last()) {
                (Some(_), Some(last)) => encode_token(&last.id),
                _ => String::new(),
            };
            Ok((page, next))
        })
    }

    /// Checks a `volume_content_source` before anything is created:
    /// INVALID_ARGUMENT when the kind of source is not supported, NOT_FOUND
    /// for an unknown one. Returns the source's data directory and size.
    pub(super) fn content_source_dir(&self, src: &ContentSource) -> Result<(PathBuf, i64), Status> {
        match src {
            ContentSource::Snapshot(id) => {
                if !self.cfg.snapshots {
                    return Err(invalid(
                        "volume_content_source.snapshot is not supported (no CREATE_DELETE_SNAPSHOT)",
                    ));
                }
                let size = self.store.read(|s| {
                    s.snapshots
                        .get(id)
                        .filter(|r| r.complete)
                        .map(|r| r.size_bytes)
                });
                match size {
                    Some(size) if validate_volume_name(id).is_ok() => {
                        Ok((self.snapshots_dir().join(id), size))
                    }
                    _ => Err(Status::not_found(format!(
                        "source snapshot {id:?} does not exist"
                    ))),
                }
            }
            ContentSource::Volume(id) => {
                if !self.cfg.clones {
                    return Err(invalid(
                        "volume_content_source.volume is not supported (no CLONE_VOLUME)",
                    ));
                }
                match self.record(id) {
                    Some(v) if validate_volume_name(id).is_ok() && !v.populating => {
                        Ok((self.volume_dir(id), v.capacity_bytes))
                    }
                    _ => Err(Status::not_found(format!(
                        "source volume {id:?} does not exist"
                    ))),
                }
            }
        }
    }

    /// Copies the source's data into the new volume `id`, recorded as
    /// `populating`, then clears the mark. A failed copy removes the volume,
    /// so that the CO's retry starts afresh.
    pub(super) async fn populate(&self, id: &str, from: PathBuf) -> Result<(), Status> {
        let to = self.volume_dir(id);
        let copied = tokio::task::spawn_blocking(move || copy_tree(&from, &to))
            .await
            .map_err(io::Error::other)
            .and_then(|r| r);
        let dir = self.volume_dir(id);
        let volume_fs = self.cfg.volume_fs;
        self.store
            .update(|s| {
                if let Err(e) = copied {
                    s.volumes.remove(id);
                    if let Err(release) = backing::release(&dir, volume_fs) {
                        tracing::warn!(volume = id, "releasing a failed clone: {release}");
                    } else {
                        remove_copy(&dir);
                    }
                    return Ok((
                        Err(internal(
                            &format!("copying the content source into volume {id:?}"),
                            e,
                        )),
                        true,
                    ));
                }
                match s.volumes.get_mut(id) {
                    Some(v) => {
                        v.populating = false;
                        Ok((Ok(()), true))
                    }
                    None => Ok((
                        Err(Status::aborted(format!(
                            "volume {id:?} was deleted while its content was copied"
                        ))),
                        false,
                    )),
                }
            })
            .await?
    }
}
