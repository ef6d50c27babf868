//! The paths the oci runtime uses inside a container's own root file system (an image's, or
//! a configured `runtime.rootfs`), and the environment an image's process starts with.
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
//! The environment of an image's process ([`image_environment`]): a default `PATH` and a
//! `HOME` first (the user's entry in the image's `/etc/passwd`, else `/`; as the Mesos
//! launcher and Docker do), then the image's `Env`, then the config's `environment`; a later
//! one wins.
//!
//! It must not mount, run or remove anything, and must not read or create anything outside
//! the root.

use std::ffi::OsStr;
use std::io::Read;
use std::os::fd::{AsFd, OwnedFd};
use std::path::{Component, Path, PathBuf};

use rustix::fs::Mode;

use crate::beneath::{self, BeneathError};

/// The `PATH` of a process whose image and config set none: Docker's and containerd's
/// default, and what Mesos's launcher gives (`os::host_default_path()`).
pub const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";
/// The `HOME` of a user the image's `/etc/passwd` does not list (Docker's).
pub const DEFAULT_HOME: &str = "/";
/// The most of an image's `/etc/passwd` read: a bigger one is hostile or broken, and the
/// user's `HOME` falls back to [`DEFAULT_HOME`].
pub const MAX_PASSWD_BYTES: u64 = 1 << 20;
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

/// Why the root's `/etc/<name>` was not read ([`Root::read_etc`]); each names the file.
#[derive(Debug, thiserror::Error)]
pub enum EtcError {
    #[error("cannot open {}: {source}", path.display())]
    Open {
        path: PathBuf,
        #[source]
        source: BeneathError,
    },
    #[error("cannot stat {}: {source}", path.display())]
    Stat {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{} is not a regular file", path.display())]
    NotAFile { path: PathBuf },
    #[error("cannot read {}: {source}", path.display())]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{} is larger than {max} bytes", path.display())]
    TooLarge { path: PathBuf, max: u64 },
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

    /// The home dir of `uid` in the root's `/etc/passwd` (read by [`Root::read_etc`]); `None`
    /// when there is no such file or entry, or its home is not an absolute path.
    pub fn home_of(&self, uid: u32) -> Option<String> {
        let passwd = self
            .read_etc("passwd")
            .map_err(|err| tracing::debug!("no /etc/passwd for HOME: {err}"))
            .ok()?;
        home_in_passwd(&passwd, uid)
    }

    /// The root's `/etc/<name>` (`passwd`, `group`), read beneath the root without following
    /// a symlink, a regular file of at most [`MAX_PASSWD_BYTES`], as text. The error says
    /// why it was not read (it names the file).
    pub fn read_etc(&self, name: &str) -> Result<String, EtcError> {
        let at = self.path.join("etc").join(name);
        let etc = self
            .dir_existing(Path::new("etc"))
            .map_err(|source| EtcError::Open {
                path: at.clone(),
                source,
            })?;
        let file = beneath::open_file_in(etc.as_fd(), OsStr::new(name), &at, &self.path).map_err(
            |source| EtcError::Open {
                path: at.clone(),
                source,
            },
        )?;
        let stat = rustix::fs::fstat(&file).map_err(|errno| EtcError::Stat {
            path: at.clone(),
            source: errno.into(),
        })?;
        if rustix::fs::FileType::from_raw_mode(stat.st_mode) != rustix::fs::FileType::RegularFile {
            return Err(EtcError::NotAFile { path: at });
        }
        let mut text = Vec::new();
        std::fs::File::from(file)
            .take(MAX_PASSWD_BYTES + 1)
            .read_to_end(&mut text)
            .map_err(|source| EtcError::Read {
                path: at.clone(),
                source,
            })?;
        if text.len() as u64 > MAX_PASSWD_BYTES {
            tracing::warn!(path = %at.display(), "larger than {MAX_PASSWD_BYTES} bytes: not read");
            return Err(EtcError::TooLarge {
                path: at,
                max: MAX_PASSWD_BYTES,
            });
        }
        Ok(String::from_utf8_lossy(&text).into_owned())
    }

    /// Opens an existing directory beneath the root, creating nothing.
    fn dir_existing(&self, relative: &Path) -> Result<OwnedFd, BeneathError> {
        beneath::open_dir(self.fd.as_fd(), &self.path, relative, None).map(|o| o.fd)
    }
}

/// The home field of `uid`'s line in a passwd file (`name:pw:uid:gid:gecos:home:shell`); the
/// first line for the uid wins, as getpwuid(3) has it.
pub fn home_in_passwd(passwd: &str, uid: u32) -> Option<String> {
    let wanted = uid.to_string();
    passwd
        .lines()
        .map(|line| line.split(':').collect::<Vec<_>>())
        .find(|fields| fields.len() >= 7 && fields[2] == wanted)
        .map(|fields| fields[5].to_owned())
        .filter(|home| home.starts_with('/') && !home.contains('\0'))
}

/// The environment of a process run from an image, lowest precedence first: the defaults
/// (`PATH`, and `HOME` from `home` when neither the image nor the config sets it), the
/// image's `Env` (`NAME=value`; an entry without `=` is skipped), the config's environment.
/// The caller appends its own variables after these and keeps the last of each name.
pub fn image_environment(
    image_env: &[String],
    config: &[(String, String)],
    home: impl FnOnce() -> String,
) -> Vec<(String, String)> {
    let from_image = image_env
        .iter()
        .filter_map(|var| var.split_once('='))
        .map(|(name, value)| (name.to_owned(), value.to_owned()));
    let given: Vec<(String, String)> = from_image.chain(config.iter().cloned()).collect();
    let mut env = vec![("PATH".to_owned(), DEFAULT_PATH.to_owned())];
    if !given.iter().any(|(name, _)| name == "HOME") {
        env.push(("HOME".to_owned(), home()));
    }
    env.extend(given);
    env
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    fn last<'a>(env: &'a [(String, String)], name: &str) -> Option<&'a str> {
        env.iter()
            .rev()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }

    #[test]
    fn environment_defaults_are_overridden_by_the_image_then_the_config() {
        let none = image_environment(&[], &[], || "/root".to_owned());
        assert_eq!(last(&none, "PATH"), Some(DEFAULT_PATH));
        assert_eq!(last(&none, "HOME"), Some("/root"));

        let image = vec!["PATH=/opt/bin".to_owned(), "HOME=/img".to_owned()];
        let env = image_environment(&image, &[], || panic!("HOME is given: no lookup"));
        assert_eq!(last(&env, "PATH"), Some("/opt/bin"));
        assert_eq!(last(&env, "HOME"), Some("/img"));

        let config = vec![
            ("PATH".to_owned(), "/cfg".to_owned()),
            ("HOME".to_owned(), "/c".to_owned()),
        ];
        let env = image_environment(&image, &config, || panic!("no lookup"));
        assert_eq!(last(&env, "PATH"), Some("/cfg"));
        assert_eq!(last(&env, "HOME"), Some("/c"));
        // A malformed image entry is skipped, not an empty variable.
        let env = image_environment(&["NOEQUALS".to_owned()], &[], || "/".to_owned());
        assert!(env.iter().all(|(n, _)| n != "NOEQUALS"), "{env:?}");
    }

    #[test]
    fn home_comes_from_the_users_passwd_line() {
        let passwd = "root:x:0:0:root:/root:/bin/sh\nbroken\nplug:x:1000:1000::/home/plug:/bin/sh\nodd:x:7:7::relative:/bin/sh\n";
        assert_eq!(home_in_passwd(passwd, 0).as_deref(), Some("/root"));
        assert_eq!(home_in_passwd(passwd, 1000).as_deref(), Some("/home/plug"));
        assert_eq!(
            home_in_passwd(passwd, 7),
            None,
            "a relative home is no home"
        );
        assert_eq!(home_in_passwd(passwd, 42), None);
    }

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

    #[test]
    fn home_is_read_beneath_the_root_only() {
        let scene = scene();
        let root = Root::open(&scene.root).unwrap();
        assert_eq!(root.home_of(0), None, "no passwd");
        std::fs::write(scene.root.join("etc/passwd"), "root:x:0:0::/root:/bin/sh\n").unwrap();
        assert_eq!(root.home_of(0).as_deref(), Some("/root"));
        // A passwd that is a symlink out of the root is not followed.
        std::fs::write(scene.outside.join("passwd"), "root:x:0:0::/pwned:/bin/sh\n").unwrap();
        std::fs::remove_file(scene.root.join("etc/passwd")).unwrap();
        std::os::unix::fs::symlink(scene.outside.join("passwd"), scene.root.join("etc/passwd"))
            .unwrap();
        assert_eq!(root.home_of(0), None);
        // Nor an /etc that is one.
        std::fs::remove_file(scene.root.join("etc/passwd")).unwrap();
        std::fs::remove_dir(scene.root.join("etc")).unwrap();
        std::os::unix::fs::symlink(&scene.outside, scene.root.join("etc")).unwrap();
        assert_eq!(root.home_of(0), None);
    }
}
