//! The paths the oci runtime uses inside a container's own root file system (an image's, or
//! a configured `runtime.rootfs`).
//!
//! A root file system is input: runc resolves a mount destination and the working dir inside
//! it *following its symlinks*, so an image symlink where the runtime binds something (`srv ->
//! /state/pwn` with a BIDIRECTIONAL volume at `/state`) sends the bind into the host dir
//! behind the volume, where it outlives the container untracked; and a `WorkingDir` of
//! `/proc/self/fd/7` is a descriptor of runc's own (CVE-2024-21626). So before `runc
//! create`, every mount destination of the container's `config.json` and the working dir are
//! walked here beneath the root with [`crate::beneath`] (`openat2` with `RESOLVE_BENEATH |
//! RESOLVE_NO_SYMLINKS`, one component at a time): missing directories are created through
//! the walk (as runc would create them, but without following anything), and a symlink
//! anywhere on the way is refused with an error naming the field and the path. runc then
//! finds real directories only. The last component of a mount destination is not created
//! (a file bind needs a file there, which runc makes), only refused if it is a symlink.
//!
//! It must not mount, run or remove anything, and must not read or create anything outside
//! the root.

use std::os::fd::{AsFd, OwnedFd};
use std::path::{Component, Path, PathBuf};

use rustix::fs::Mode;

use crate::beneath::{self, BeneathError};

/// Mode of the directories made for mount points and the working dir.
const DIR_MODE: u32 = 0o755;

/// Why a path inside the container's root cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum RootPathError {
    /// Refused by its form; nothing was touched.
    #[error("{field} {path:?} {reason}")]
    Invalid {
        field: String,
        path: String,
        reason: String,
    },
    /// The walk beneath the root refused it (a symlink on the way, a component that is no
    /// directory) or failed.
    #[error(
        "{field} {path:?} cannot be resolved beneath the container's root: {source}; the root must have plain directories there (no symlink), so fix the image or choose another path"
    )]
    Beneath {
        field: String,
        path: String,
        #[source]
        source: BeneathError,
    },
}

/// The container's root, opened once for the walks.
#[derive(Debug)]
pub struct Root {
    fd: OwnedFd,
    path: PathBuf,
}

impl Root {
    /// Opens the root dir itself (the operator's or the store's path: trusted as given).
    pub fn open(path: &Path) -> Result<Self, RootPathError> {
        let fd = beneath::open_root(path).map_err(|source| RootPathError::Beneath {
            field: "the root".to_owned(),
            path: path.display().to_string(),
            source,
        })?;
        Ok(Self {
            fd,
            path: path.to_path_buf(),
        })
    }

    /// The checked relative form of an absolute `path` (`None` for `/` itself).
    fn relative(&self, field: &str, path: &str) -> Result<Option<PathBuf>, RootPathError> {
        beneath::check_form(Path::new(path)).map_err(|err| RootPathError::Invalid {
            field: field.to_owned(),
            path: path.to_owned(),
            reason: match err {
                BeneathError::Invalid { reason, .. } => reason,
                other => other.to_string(),
            },
        })?;
        let relative: PathBuf = Path::new(path)
            .components()
            .filter(|c| matches!(c, Component::Normal(_)))
            .collect();
        Ok((!relative.as_os_str().is_empty()).then_some(relative))
    }

    /// Opens (creating) the directory `relative` beneath the root, or the root itself.
    fn dir(
        &self,
        field: &str,
        path: &str,
        relative: &Path,
    ) -> Result<Option<OwnedFd>, RootPathError> {
        if relative.as_os_str().is_empty() {
            return Ok(None);
        }
        beneath::open_dir(
            self.fd.as_fd(),
            &self.path,
            relative,
            Some(Mode::from_raw_mode(DIR_MODE)),
        )
        .map(|opened| Some(opened.fd))
        .map_err(|source| RootPathError::Beneath {
            field: field.to_owned(),
            path: path.to_owned(),
            source,
        })
    }

    /// The process's working dir from the image's `WorkingDir` (unset or empty: `/`): an
    /// absolute, normalised path (no `.` or `..`), not under `/proc`, whose every component
    /// is a directory of the root, not a symlink (missing ones are created).
    pub fn working_dir(&self, working_dir: Option<&str>) -> Result<String, RootPathError> {
        const FIELD: &str = "its config's WorkingDir";
        let Some(path) = working_dir.filter(|p| !p.is_empty()) else {
            return Ok("/".to_owned());
        };
        let Some(relative) = self.relative(FIELD, path)? else {
            return Ok("/".to_owned());
        };
        if relative.starts_with("proc") {
            return Err(RootPathError::Invalid {
                field: FIELD.to_owned(),
                path: path.to_owned(),
                reason: "is under /proc, which is the container's own proc file system (a working dir there can be a file descriptor of the runtime's, CVE-2024-21626): give a directory of the image".to_owned(),
            });
        }
        self.dir(FIELD, path, &relative)?;
        Ok(path.to_owned())
    }

    /// Checks one mount destination (`field` names it in errors): its parent directories
    /// are walked beneath the root (missing ones created), and neither they nor the last
    /// component may be a symlink.
    pub fn mount_point(&self, field: &str, destination: &Path) -> Result<(), RootPathError> {
        let shown = destination.display().to_string();
        let Some(relative) = self.relative(field, &shown)? else {
            return Ok(());
        };
        let (parent, name) = match (relative.parent(), relative.file_name()) {
            (Some(parent), Some(name)) => (parent.to_path_buf(), name.to_os_string()),
            _ => return Ok(()),
        };
        let parent_fd = self.dir(field, &shown, &parent)?;
        let parent_fd = parent_fd.as_ref().map_or(self.fd.as_fd(), |fd| fd.as_fd());
        if beneath::is_symlink(parent_fd, &name) {
            return Err(RootPathError::Beneath {
                field: field.to_owned(),
                path: shown,
                source: BeneathError::Symlink {
                    at: self.path.join(&relative),
                    root: self.path.clone(),
                },
            });
        }
        Ok(())
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    struct Scene {
        _dir: tempfile::TempDir,
        root: PathBuf,
        outside: PathBuf,
    }

    fn scene() -> Scene {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("root");
        let outside = dir.path().join("outside");
        std::fs::create_dir_all(root.join("bin")).unwrap();
        std::fs::create_dir_all(root.join("etc")).unwrap();
        std::fs::create_dir_all(&outside).unwrap();
        std::os::unix::fs::symlink(&outside, root.join("srv")).unwrap();
        std::os::unix::fs::symlink("../outside", root.join("rel")).unwrap();
        std::os::unix::fs::symlink("/bin", root.join("work")).unwrap();
        Scene {
            _dir: dir,
            root,
            outside,
        }
    }

    #[test]
    fn a_working_dir_is_absolute_beneath_the_root_without_symlinks_or_proc() {
        let scene = scene();
        let root = Root::open(&scene.root).unwrap();
        assert_eq!(root.working_dir(None).unwrap(), "/");
        assert_eq!(root.working_dir(Some("")).unwrap(), "/");
        assert_eq!(root.working_dir(Some("/bin")).unwrap(), "/bin");
        // A missing one is made beneath the root.
        assert_eq!(root.working_dir(Some("/var/lib/p")).unwrap(), "/var/lib/p");
        assert!(scene.root.join("var/lib/p").is_dir());
        for (bad, wanted) in [
            ("/proc/self/fd/7", "/proc"),
            ("/proc", "/proc"),
            ("../..", "absolute"),
            ("/bin/../..", "'..'"),
            ("bin", "absolute"),
            ("/srv/x", "symlink"),
            ("/rel", "symlink"),
            ("/work", "symlink"),
        ] {
            let err = root.working_dir(Some(bad)).unwrap_err().to_string();
            assert!(err.contains("WorkingDir"), "{bad}: {err}");
            assert!(err.contains(bad), "{bad}: {err}");
            assert!(err.contains(wanted), "{bad}: {err}");
        }
        assert_eq!(
            std::fs::read_dir(&scene.outside).unwrap().count(),
            0,
            "something was made through a symlink"
        );
    }

    #[test]
    fn mount_points_are_made_beneath_the_root_and_symlinks_refused() {
        let scene = scene();
        let root = Root::open(&scene.root).unwrap();
        root.mount_point("the plugin's mount root", Path::new("/var/lib/x/mounts"))
            .unwrap();
        assert!(scene.root.join("var/lib/x").is_dir());
        // The last component is left for the runtime (a file bind needs a file).
        assert!(!scene.root.join("var/lib/x/mounts").exists());
        root.mount_point("the root", Path::new("/")).unwrap();
        for (path, at) in [
            ("/srv/pwn/mounts", "srv"),
            ("/srv", "srv"),
            ("/rel/a", "rel"),
        ] {
            let err = root
                .mount_point("container.volumes[0].container_path", Path::new(path))
                .unwrap_err()
                .to_string();
            assert!(err.contains("container.volumes[0]"), "{err}");
            assert!(err.contains(path), "{err}");
            assert!(
                err.contains(&format!("{}/{at} is a symlink", scene.root.display())),
                "{err}"
            );
        }
        let err = root
            .mount_point("x", Path::new("/a/../b"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("'..'"), "{err}");
        assert_eq!(std::fs::read_dir(&scene.outside).unwrap().count(), 0);
    }
}
