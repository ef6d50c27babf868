//! REFERENCE secrets: the value of a Mesos `Secret` of `type: REFERENCE`
//! (`{"reference": {"name": N, "key": K}}`), read from the file `<secret-dir>/N/K` of the
//! directory the operator names with `--secret-dir` (docs/configuration.md).
//!
//! This module owns the rules of that directory: names and keys are single path components
//! (not empty, no `/`, no NUL, not `.` or `..`); the file is opened beneath the dir without
//! following any symlink ([`crate::beneath`]), must be a regular file owned by root with no
//! permission for group or others (0600 or stricter), and at most [`MAX_SECRET_BYTES`] long,
//! checked while reading, not after. It is read at each launch, so a rotated secret applies at
//! the component's next launch.
//!
//! It must never put a secret's value into an error, a log line or anything else that is
//! shown: errors name the reference (`N/K`) and the file, never the content. It does not
//! decide where secrets go (the runtimes put them in the plugin's environment).

use std::ffi::OsStr;
use std::io::Read;
use std::os::fd::AsFd;
use std::path::{Path, PathBuf};

use crate::beneath::{self, BeneathError};
use crate::config::EnvVar;

/// The largest secret file accepted, in bytes: it becomes an environment variable.
pub const MAX_SECRET_BYTES: u64 = 64 * 1024;

/// A reference to a secret: `<secret-dir>/<name>/<key>`.
#[derive(Clone, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct SecretRef {
    pub name: String,
    pub key: String,
}

impl std::fmt::Display for SecretRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.name, self.key)
    }
}

/// Why a reference could not be resolved. Never carries the secret's content.
#[derive(Debug, thiserror::Error)]
pub enum SecretError {
    #[error(
        "environment variable {var} is the REFERENCE secret {reference}, but the daemon has no --secret-dir (or `secret_dir` in its config file); set it to the directory holding <name>/<key> files"
    )]
    NoSecretDir { var: String, reference: SecretRef },
    #[error("environment variable {var}: secret reference {reference}: {source}")]
    Open {
        var: String,
        reference: SecretRef,
        #[source]
        source: Box<BeneathError>,
    },
    #[error(
        "environment variable {var}: secret reference {reference}: {} {problem}", path.display()
    )]
    Unfit {
        var: String,
        reference: Box<SecretRef>,
        path: PathBuf,
        problem: String,
    },
    #[error("environment variable {var}: secret reference {reference}: cannot read {}: {source}", path.display())]
    Read {
        var: String,
        reference: SecretRef,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// Checks one part (`name` or `key`) of a reference; the message says what is wrong.
pub fn check_part(part: &str) -> Result<(), &'static str> {
    if part.is_empty() {
        return Err("must not be empty");
    }
    if part == "." || part == ".." {
        return Err("must not be `.` or `..`");
    }
    if part.contains('/') || part.contains('\0') {
        return Err("must be a single file name: no `/` and no NUL");
    }
    if part.len() > beneath::MAX_COMPONENT_BYTES {
        return Err("is longer than 255 bytes");
    }
    Ok(())
}

/// `environment` with every REFERENCE secret's value read from `secret_dir`; the others as
/// they are.
pub fn resolve(
    environment: &[EnvVar],
    secret_dir: Option<&Path>,
) -> Result<Vec<EnvVar>, SecretError> {
    let mut out = environment.to_vec();
    for var in &mut out {
        let Some(reference) = &var.reference else {
            continue;
        };
        let Some(dir) = secret_dir else {
            return Err(SecretError::NoSecretDir {
                var: var.name.clone(),
                reference: reference.clone(),
            });
        };
        var.value = read(dir, reference, &var.name)?;
    }
    Ok(out)
}

/// The content of `<dir>/<name>/<key>`, under the rules of the module doc.
pub fn read(dir: &Path, reference: &SecretRef, var: &str) -> Result<String, SecretError> {
    let open = |source| SecretError::Open {
        var: var.to_owned(),
        reference: reference.clone(),
        source: Box::new(source),
    };
    let path = dir.join(&reference.name).join(&reference.key);
    let unfit = |problem: String| SecretError::Unfit {
        var: var.to_owned(),
        reference: Box::new(reference.clone()),
        path: path.clone(),
        problem,
    };
    for part in [&reference.name, &reference.key] {
        check_part(part)
            .map_err(|why| unfit(format!("is not a valid reference: {part:?} {why}")))?;
    }
    let root = beneath::open_root(dir).map_err(open)?;
    let parent =
        beneath::open_dir(root.as_fd(), dir, Path::new(&reference.name), None).map_err(open)?;
    let fd = beneath::open_file_in(parent.fd.as_fd(), OsStr::new(&reference.key), &path, dir)
        .map_err(open)?;
    let stat = rustix::fs::fstat(&fd).map_err(|errno| SecretError::Read {
        var: var.to_owned(),
        reference: reference.clone(),
        path: path.clone(),
        source: errno.into(),
    })?;
    if rustix::fs::FileType::from_raw_mode(stat.st_mode) != rustix::fs::FileType::RegularFile {
        return Err(unfit("is not a regular file".to_owned()));
    }
    if stat.st_uid != 0 {
        return Err(unfit(format!(
            "is owned by uid {}; a secret file must be owned by root (chown root)",
            stat.st_uid
        )));
    }
    if stat.st_mode & 0o077 != 0 {
        return Err(unfit(format!(
            "has mode {:04o}; a secret file must be 0600 or stricter (chmod 0600)",
            stat.st_mode & 0o7777
        )));
    }
    let mut bytes = Vec::new();
    std::fs::File::from(fd)
        .take(MAX_SECRET_BYTES + 1)
        .read_to_end(&mut bytes)
        .map_err(|source| SecretError::Read {
            var: var.to_owned(),
            reference: reference.clone(),
            path: path.clone(),
            source,
        })?;
    if bytes.len() as u64 > MAX_SECRET_BYTES {
        return Err(unfit(format!(
            "is larger than {MAX_SECRET_BYTES} bytes; a secret becomes an environment variable"
        )));
    }
    match String::from_utf8(bytes) {
        Ok(text) if !text.contains('\0') => Ok(text),
        _ => Err(unfit(
            "is not UTF-8 text without NUL; an environment variable's value must be".to_owned(),
        )),
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    const CONTENT: &str = "pa55-wo3d-never-shown";

    fn secret_var(name: &str, key: &str) -> EnvVar {
        EnvVar {
            name: "TOKEN".to_owned(),
            value: String::new(),
            secret: true,
            reference: Some(SecretRef {
                name: name.to_owned(),
                key: key.to_owned(),
            }),
        }
    }

    fn write(path: &Path, mode: u32) {
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, CONTENT).unwrap();
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).unwrap();
    }

    #[test]
    fn a_reference_reads_its_file_and_every_refusal_names_it_never_its_content() {
        if !rustix::process::geteuid().is_root() {
            eprintln!("skipped: needs root (secret files must be owned by root)");
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let secrets = dir.path().join("secrets");
        write(&secrets.join("nfs/password"), 0o600);
        write(&secrets.join("nfs/open"), 0o644);
        write(&dir.path().join("outside"), 0o600);
        std::os::unix::fs::symlink(dir.path().join("outside"), secrets.join("nfs/link")).unwrap();
        std::os::unix::fs::symlink(dir.path(), secrets.join("up")).unwrap();
        std::fs::create_dir_all(secrets.join("nfs/dir")).unwrap();
        write(&secrets.join("nfs/other-owner"), 0o600);
        std::os::unix::fs::chown(secrets.join("nfs/other-owner"), Some(65534), None).unwrap();
        let big = secrets.join("nfs/big");
        std::fs::write(&big, vec![b'a'; MAX_SECRET_BYTES as usize + 1]).unwrap();
        std::fs::set_permissions(&big, std::fs::Permissions::from_mode(0o600)).unwrap();

        let got = resolve(&[secret_var("nfs", "password")], Some(&secrets)).unwrap();
        assert_eq!(got[0].value, CONTENT);
        // A plain variable passes through untouched.
        let plain = EnvVar::plain("A", "b");
        assert_eq!(
            resolve(std::slice::from_ref(&plain), None).unwrap(),
            vec![plain]
        );

        for (name, key, expect) in [
            ("nfs", "open", "0644"),
            ("nfs", "link", "symlink"),
            ("up", "outside", "symlink"),
            ("nfs", "missing", "does not exist"),
            ("nfs", "dir", "not a regular file"),
            ("nfs", "other-owner", "owned by uid 65534"),
            ("nfs", "big", "larger than"),
            ("..", "outside", "`.` or `..`"),
            ("nfs/..", "outside", "no `/`"),
            ("nfs", "", "empty"),
        ] {
            let err = resolve(&[secret_var(name, key)], Some(&secrets))
                .unwrap_err()
                .to_string();
            assert!(err.contains(expect), "{name}/{key}: {err}");
            assert!(
                err.contains("TOKEN") && err.contains(&format!("{name}/{key}")),
                "{err}"
            );
            assert!(!err.contains(CONTENT), "{err}");
        }
        let err = resolve(&[secret_var("nfs", "password")], None)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("--secret-dir") && err.contains("nfs/password"),
            "{err}"
        );
    }
}
