//! Raw block volumes (`--block`): the sparse backing file of each block volume, the loop
//! device attached to it, and the target *file* a block volume is published on.
//!
//! Owns: `<work-dir>/blocks/<id>.img` (created at CreateVolume, removed at DeleteVolume),
//! attaching a loop device to it and finding or detaching the loop devices that back onto
//! it, and creating/removing the regular file a block volume's device is bind-mounted on.
//!
//! Must not: detach a loop device whose backing file is not this volume's (the device
//! recorded in `state.json` is only a hint: `/sys/block/loopN/loop/backing_file` decides),
//! delete a device node, or delete anything that is a mount point or not an empty regular
//! file. It does not decide when (that is `plugin.rs`, which records intent first).

use std::fs;
use std::io;
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::process::Command;

/// The backing file of block volume `id` in `blocks_dir`.
pub fn backing_file(blocks_dir: &Path, id: &str) -> PathBuf {
    blocks_dir.join(format!("{id}.img"))
}

/// Creates (or takes over, after a crash before the record) the sparse backing file of
/// `size` bytes. Sparse: a 1 GiB volume costs no disk until written.
pub fn create(path: &Path, size: i64) -> io::Result<()> {
    if let Some(parent) = path.parent() {
        fs::create_dir_all(parent)?;
    }
    let file = fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .mode(0o600)
        .open(path)?;
    let size = u64::try_from(size).map_err(|_| io::Error::other("negative size"))?;
    if file.metadata()?.len() != size {
        file.set_len(size)?;
    }
    file.sync_all()
}

/// Removes the backing file (absent is fine).
pub fn remove(path: &Path) -> io::Result<()> {
    match fs::remove_file(path) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => Err(e),
        _ => Ok(()),
    }
}

/// The loop devices (`/dev/loopN`) whose backing file is `backing`, from
/// `/sys/block/loop*/loop/backing_file` (the kernel's own answer, not our records), with
/// whether each is read-only.
pub fn devices_backed_by(backing: &Path) -> io::Result<Vec<(String, bool)>> {
    let mut found = Vec::new();
    let entries = match fs::read_dir("/sys/block") {
        Ok(entries) => entries,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(found),
        Err(e) => return Err(e),
    };
    for entry in entries {
        let name = entry?.file_name();
        let Some(name) = name.to_str().filter(|n| n.starts_with("loop")) else {
            continue;
        };
        if backs_onto(name, backing) {
            let ro =
                fs::read_to_string(format!("/sys/block/{name}/ro")).is_ok_and(|t| t.trim() == "1");
            found.push((format!("/dev/{name}"), ro));
        }
    }
    found.sort();
    Ok(found)
}

/// Whether loop device `name` (`loopN`) is attached to `backing`.
fn backs_onto(name: &str, backing: &Path) -> bool {
    match fs::read_to_string(format!("/sys/block/{name}/loop/backing_file")) {
        Ok(text) => Path::new(text.trim_end_matches('\n')) == backing,
        Err(_) => false,
    }
}

/// The loop device attached to `backing` with this `readonly`: an existing one (a repeated
/// call, or one attached just before a crash, before it was recorded), else a new one.
///
/// util-linux's `losetup`: from a system directory when it is there, because the plugin may run
/// with a user's `PATH` (a test run through `sudo env PATH=...`), which lacks `/usr/sbin`.
fn losetup() -> &'static str {
    [
        "/usr/sbin/losetup",
        "/sbin/losetup",
        "/usr/bin/losetup",
        "/bin/losetup",
    ]
    .into_iter()
    .find(|path| Path::new(path).is_file())
    .unwrap_or("losetup")
}

/// Read-only is the device's own flag (`losetup --read-only`), not the mount's: a read-only
/// mount does not stop writes to a device node on it (the kernel's `sb_permission` refuses
/// writes on a read-only mount only for regular files, directories and symlinks), so a
/// read-only publication gets a read-only loop device of its own.
///
/// `losetup --find --show` (util-linux) rather than our own `LOOP_CTL_GET_FREE` +
/// `LOOP_CONFIGURE` ioctls: two processes asking for a free device race, and losetup
/// already retries that race; a test plugin can afford the subprocess.
pub fn attach(backing: &Path, readonly: bool) -> io::Result<String> {
    if let Some((dev, _)) = devices_backed_by(backing)?
        .into_iter()
        .find(|(_, ro)| *ro == readonly)
    {
        return Ok(dev);
    }
    let mut cmd = Command::new(losetup());
    cmd.arg("--find").arg("--show");
    if readonly {
        cmd.arg("--read-only");
    }
    let out = cmd.arg(backing).output()?;
    if !out.status.success() {
        return Err(io::Error::other(format!(
            "losetup --find --show {}: {}",
            backing.display(),
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    let dev = String::from_utf8_lossy(&out.stdout).trim().to_owned();
    if !dev.starts_with("/dev/loop") {
        return Err(io::Error::other(format!(
            "losetup answered {dev:?}, not a loop device"
        )));
    }
    Ok(dev)
}

/// Detaches every loop device backed by `backing`, and nothing else.
pub fn detach_all(backing: &Path) -> io::Result<()> {
    for (dev, _) in devices_backed_by(backing)? {
        let out = Command::new(losetup()).arg("--detach").arg(&dev).output()?;
        // Checked again: detached meanwhile (or reused) is not ours to complain about.
        let name = dev.trim_start_matches("/dev/");
        if !out.status.success() && backs_onto(name, backing) {
            return Err(io::Error::other(format!(
                "losetup --detach {dev}: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            )));
        }
    }
    Ok(())
}

/// What is at a block target path (not following a symlink).
#[derive(Debug, PartialEq, Eq)]
pub enum TargetKind {
    Missing,
    /// A regular file (or a device mounted on one: `stat` sees the mounted node).
    File,
    Other,
}

/// Looks at a block volume's target without following a final symlink.
pub fn target_kind(path: &Path) -> io::Result<TargetKind> {
    match fs::symlink_metadata(path) {
        Ok(m) if m.is_file() || m.file_type().is_block_device() => Ok(TargetKind::File),
        Ok(_) => Ok(TargetKind::Other),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(TargetKind::Missing),
        Err(e) => Err(e),
    }
}

/// Creates the target file (CSI v1: "Creation of target_path is the responsibility of the
/// SP"): one `open(O_CREAT|O_EXCL)`, so the parent must exist (the CO's duty) and nothing
/// already there is replaced or followed (`O_EXCL` fails on a symlink too, dangling or not).
/// Returns whether this call created it; the caller checks what is there otherwise.
pub fn create_target_file(path: &Path) -> io::Result<bool> {
    match fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
    {
        Ok(_) => Ok(true),
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => Ok(false),
        Err(e) => Err(e),
    }
}

/// Removes a target file the plugin created: only an empty regular file. A device node,
/// a directory, a file with data or a mount point (EBUSY) stays.
pub fn remove_target_file(path: &Path) -> io::Result<()> {
    match fs::symlink_metadata(path) {
        Ok(m) if m.is_file() && m.len() == 0 => match fs::remove_file(path) {
            Err(e) if e.kind() != io::ErrorKind::NotFound => Err(e),
            _ => Ok(()),
        },
        Ok(_) => Err(io::Error::other(format!(
            "{} is not an empty regular file; left in place",
            path.display()
        ))),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e),
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn backing_file_is_sparse_and_sized() {
        let dir = tempfile::tempdir().unwrap();
        let p = backing_file(dir.path(), "v1");
        create(&p, 8 << 20).unwrap();
        let m = fs::metadata(&p).unwrap();
        assert_eq!(m.len(), 8 << 20);
        use std::os::unix::fs::MetadataExt;
        assert!(
            m.blocks() * 512 < 1 << 20,
            "not sparse: {} blocks",
            m.blocks()
        );
        create(&p, 8 << 20).unwrap();
        remove(&p).unwrap();
        remove(&p).unwrap();
        assert!(!p.exists());
    }

    #[test]
    fn target_file_is_created_once_and_only_empty_files_are_removed() {
        let dir = tempfile::tempdir().unwrap();
        let t = dir.path().join("t");
        assert!(create_target_file(&t).unwrap());
        assert!(!create_target_file(&t).unwrap());
        assert_eq!(target_kind(&t).unwrap(), TargetKind::File);
        fs::write(&t, b"data").unwrap();
        assert!(remove_target_file(&t).is_err());
        assert!(t.exists());
        fs::write(&t, b"").unwrap();
        remove_target_file(&t).unwrap();
        assert_eq!(target_kind(&t).unwrap(), TargetKind::Missing);
        let link = dir.path().join("l");
        std::os::unix::fs::symlink(dir.path().join("elsewhere"), &link).unwrap();
        assert!(!create_target_file(&link).unwrap());
        assert_eq!(target_kind(&link).unwrap(), TargetKind::Other);
        assert!(!dir.path().join("elsewhere").exists());
        assert_eq!(
            target_kind(&dir.path().join("missing/x")).unwrap(),
            TargetKind::Missing
        );
        assert!(create_target_file(&dir.path().join("missing/x")).is_err());
    }
}
