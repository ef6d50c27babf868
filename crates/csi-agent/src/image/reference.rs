//! Image references as Docker and Mesos resolve them, and the registry settings a pull needs
//! from the operator (default registry, credentials, insecure registries).
//!
//! It owns the syntax: `busybox` is the default registry's `library/busybox:latest`,
//! `org/app:1.2` its `org/app:1.2`, `host:5000/app` the registry `host:5000`, and
//! `app@sha256:<hex>` pins a manifest digest (which wins over any tag, as with Docker). A
//! first component is a registry host when it has a `.` or a `:`, or is `localhost`
//! (Docker's rule, which Mesos's docker store follows). `library/` is prefixed only when the
//! registry was defaulted, i.e. only for the Docker Hub style of name.
//!
//! It also reads a docker `config.json` (`auths.<registry>.auth` = base64 `user:password`, or
//! `username`/`password`): credential helpers (`credsStore`, `credHelpers`) are not run.
//!
//! It must not talk to a registry, nor decide where images are stored. Reference strings come
//! from plugin configs (the operator's, but typed by hand): every part is validated so a
//! reference can only ever name a registry host, a repository and a tag or digest.

use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};

use base64::Engine as _;

use super::blobs::Digest;

/// Docker Hub's registry API host: what `--docker-registry` defaults to, and where
/// `docker.io/...` names go (as the Docker client does).
pub const DOCKER_HUB: &str = "registry-1.docker.io";
/// The tag of a reference that names none.
pub const DEFAULT_TAG: &str = "latest";
/// Docker's own bound on a whole reference.
const MAX_NAME_BYTES: usize = 255;
/// Docker's bound on a tag.
const MAX_TAG_BYTES: usize = 128;
/// A docker `config.json` larger than this is refused (real ones are a few KiB).
const MAX_DOCKER_CONFIG_BYTES: u64 = 1 << 20;

/// A resolved image reference: always a registry, a repository and a tag or a digest.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ImageRef {
    registry: String,
    repository: String,
    tag: Option<String>,
    digest: Option<Digest>,
}

/// Why a reference was refused.
#[derive(Debug, thiserror::Error)]
#[error("image reference {given:?}: {reason}")]
pub struct ReferenceError {
    pub given: String,
    pub reason: String,
}

impl ImageRef {
    /// Resolves `name` against `default_registry` (a host or `host:port`; a `https://` or
    /// `http://` prefix and a trailing `/` are dropped, as Mesos's `--docker_registry`
    /// allows a URL).
    pub fn parse(name: &str, default_registry: &str) -> Result<Self, ReferenceError> {
        let refuse = |reason: &str| ReferenceError {
            given: name.chars().take(MAX_NAME_BYTES + 10).collect(),
            reason: reason.to_owned(),
        };
        if name.is_empty() {
            return Err(refuse("is empty"));
        }
        if name.len() > MAX_NAME_BYTES {
            return Err(refuse("is longer than 255 bytes"));
        }
        let (rest, digest) = match name.split_once('@') {
            Some((rest, digest)) => (
                rest,
                Some(Digest::parse(digest).map_err(|err| refuse(&err.to_string()))?),
            ),
            None => (name, None),
        };
        // A tag is after a ':' in the last component only (a ':' before a '/' is a port).
        let last_slash = rest.rfind('/').map_or(0, |at| at + 1);
        let (path, tag) = match rest.get(last_slash..).and_then(|last| last.rfind(':')) {
            Some(colon) => {
                let at = last_slash + colon;
                (
                    rest.get(..at).unwrap_or_default(),
                    Some(rest.get(at + 1..).unwrap_or_default()),
                )
            }
            None => (rest, None),
        };
        if let Some(tag) = tag {
            validate_tag(tag).map_err(refuse)?;
        }
        let (registry, repository, defaulted) = match path.split_once('/') {
            Some((first, rest))
                if first.contains('.') || first.contains(':') || first == "localhost" =>
            {
                (first.to_owned(), rest.to_owned(), false)
            }
            _ => (normalize_registry(default_registry), path.to_owned(), true),
        };
        validate_registry(&registry).map_err(refuse)?;
        let registry = if registry == "docker.io" || registry == "index.docker.io" {
            DOCKER_HUB.to_owned()
        } else {
            registry
        };
        let repository = if (defaulted || registry == DOCKER_HUB) && !repository.contains('/') {
            format!("library/{repository}")
        } else {
            repository
        };
        validate_repository(&repository).map_err(refuse)?;
        let tag = match (&digest, tag) {
            (_, Some(tag)) => Some(tag.to_owned()),
            (None, None) => Some(DEFAULT_TAG.to_owned()),
            (Some(_), None) => None,
        };
        Ok(Self {
            registry,
            repository,
            tag,
            digest,
        })
    }

    /// The registry host (`host` or `host:port`).
    pub fn registry(&self) -> &str {
        &self.registry
    }

    /// The repository (`library/busybox`).
    pub fn repository(&self) -> &str {
        &self.repository
    }

    /// The tag, if the reference names one.
    pub fn tag(&self) -> Option<&str> {
        self.tag.as_deref()
    }

    /// The manifest digest the reference pins, if any.
    pub fn digest(&self) -> Option<&Digest> {
        self.digest.as_ref()
    }

    /// What the manifest is asked for by: the digest when pinned (it wins over a tag), else
    /// the tag.
    pub fn manifest_target(&self) -> String {
        match (&self.digest, &self.tag) {
            (Some(digest), _) => digest.to_string(),
            (None, tag) => tag.clone().unwrap_or_else(|| DEFAULT_TAG.to_owned()),
        }
    }

    /// The same image pinned to `digest` (for the platform manifest an index points to).
    pub fn with_digest(&self, digest: Digest) -> Self {
        Self {
            registry: self.registry.clone(),
            repository: self.repository.clone(),
            tag: None,
            digest: Some(digest),
        }
    }
}

impl fmt::Display for ImageRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.registry, self.repository)?;
        if let Some(tag) = &self.tag {
            write!(f, ":{tag}")?;
        }
        if let Some(digest) = &self.digest {
            write!(f, "@{digest}")?;
        }
        Ok(())
    }
}

/// `https://host:port/` → `host:port`.
pub fn normalize_registry(given: &str) -> String {
    let given = given
        .strip_prefix("https://")
        .or_else(|| given.strip_prefix("http://"))
        .unwrap_or(given);
    given.trim_end_matches('/').to_owned()
}

fn validate_registry(registry: &str) -> Result<(), &'static str> {
    let (host, port) = match registry.rsplit_once(':') {
        Some((host, port)) => (host, Some(port)),
        None => (registry, None),
    };
    if host.is_empty()
        || host.starts_with('-')
        || host.starts_with('.')
        || !host
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'.' || b == b'-')
    {
        return Err("the registry host may have only letters, digits, '.' and '-'");
    }
    if let Some(port) = port
        && (port.is_empty() || port.len() > 5 || !port.bytes().all(|b| b.is_ascii_digit()))
    {
        return Err("the registry port must be 1 to 5 digits");
    }
    Ok(())
}

fn validate_repository(repository: &str) -> Result<(), &'static str> {
    for component in repository.split('/') {
        let bytes = component.as_bytes();
        let alnum = |b: &u8| b.is_ascii_lowercase() || b.is_ascii_digit();
        if bytes.is_empty() || !bytes.first().is_some_and(alnum) || !bytes.last().is_some_and(alnum)
        {
            return Err(
                "every repository component must start and end with a lowercase letter or digit",
            );
        }
        if !bytes
            .iter()
            .all(|b| alnum(b) || matches!(b, b'.' | b'_' | b'-'))
        {
            return Err(
                "a repository may have only lowercase letters, digits, '.', '_', '-' and '/'",
            );
        }
        if component.contains("..") {
            return Err("a repository component may not contain \"..\"");
        }
    }
    Ok(())
}

fn validate_tag(tag: &str) -> Result<(), &'static str> {
    let bytes = tag.as_bytes();
    if bytes.is_empty() || bytes.len() > MAX_TAG_BYTES {
        return Err("a tag must have 1 to 128 characters");
    }
    if !bytes
        .first()
        .is_some_and(|b| b.is_ascii_alphanumeric() || *b == b'_')
        || !bytes
            .iter()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-'))
    {
        return Err(
            "a tag may have only letters, digits, '_', '.' and '-', and may not start with '.' or '-'",
        );
    }
    Ok(())
}

/// What the daemon's flags say about registries.
#[derive(Clone, Debug, Default)]
pub struct RegistrySettings {
    /// `--docker-registry`: where names without a registry host go.
    pub default_registry: String,
    /// `--insecure-registry`: `host:port`s reached over plain HTTP; every other registry is
    /// reached over HTTPS only.
    pub insecure: Vec<String>,
    /// From `--docker-config`.
    pub credentials: Credentials,
}

impl RegistrySettings {
    /// Docker Hub, no insecure registries, no credentials.
    pub fn docker_hub() -> Self {
        Self {
            default_registry: DOCKER_HUB.to_owned(),
            ..Self::default()
        }
    }
}

/// Credentials per registry host, from a docker `config.json`.
#[derive(Clone, Default)]
pub struct Credentials {
    by_registry: BTreeMap<String, (String, String)>,
}

impl fmt::Debug for Credentials {
    // Never the passwords, not even in a debug log.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Credentials")
            .field("registries", &self.by_registry.keys().collect::<Vec<_>>())
            .finish()
    }
}

/// Why a docker `config.json` could not be used.
#[derive(Debug, thiserror::Error)]
pub enum CredentialsError {
    #[error("reading the docker config {}: {source}", path.display())]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("the docker config {} is larger than 1 MiB", path.display())]
    TooLarge { path: PathBuf },
    #[error("the docker config {}: {source}", path.display())]
    Invalid {
        path: PathBuf,
        #[source]
        source: DockerConfigError,
    },
}

/// What is wrong in the text of a docker `config.json` (never quotes a credential).
#[derive(Debug, thiserror::Error)]
pub enum DockerConfigError {
    #[error("not JSON: {0}")]
    NotJson(#[source] serde_json::Error),
    #[error("\"auths\" is not an object")]
    AuthsNotObject,
    #[error("auths.{key:?}.auth is not base64")]
    NotBase64 { key: String },
    #[error("auths.{key:?}.auth is not UTF-8")]
    NotUtf8 { key: String },
    #[error("auths.{key:?}.auth is not \"user:password\"")]
    NotUserPassword { key: String },
}

impl Credentials {
    /// Reads a docker `config.json`.
    pub fn from_docker_config(path: &Path) -> Result<Self, CredentialsError> {
        use std::io::Read as _;
        let read = |source| CredentialsError::Read {
            path: path.to_path_buf(),
            source,
        };
        let file = std::fs::File::open(path).map_err(read)?;
        let mut text = Vec::new();
        file.take(MAX_DOCKER_CONFIG_BYTES + 1)
            .read_to_end(&mut text)
            .map_err(read)?;
        if text.len() as u64 > MAX_DOCKER_CONFIG_BYTES {
            return Err(CredentialsError::TooLarge {
                path: path.to_path_buf(),
            });
        }
        Self::from_docker_config_json(&text).map_err(|source| CredentialsError::Invalid {
            path: path.to_path_buf(),
            source,
        })
    }

    /// Parses the text of a docker `config.json`.
    pub fn from_docker_config_json(text: &[u8]) -> Result<Self, DockerConfigError> {
        let value: serde_json::Value =
            serde_json::from_slice(text).map_err(DockerConfigError::NotJson)?;
        let mut by_registry = BTreeMap::new();
        let Some(auths) = value.get("auths") else {
            return Ok(Self { by_registry });
        };
        let auths = auths.as_object().ok_or(DockerConfigError::AuthsNotObject)?;
        for (key, entry) in auths {
            let pair = if let Some(auth) = entry.get("auth").and_then(|a| a.as_str()) {
                let decoded = base64::engine::general_purpose::STANDARD
                    .decode(auth.trim())
                    .map_err(|_| DockerConfigError::NotBase64 { key: key.clone() })?;
                let decoded = String::from_utf8(decoded)
                    .map_err(|_| DockerConfigError::NotUtf8 { key: key.clone() })?;
                let (user, password) = decoded
                    .split_once(':')
                    .ok_or_else(|| DockerConfigError::NotUserPassword { key: key.clone() })?;
                (user.to_owned(), password.to_owned())
            } else if let (Some(user), Some(password)) = (
                entry.get("username").and_then(|u| u.as_str()),
                entry.get("password").and_then(|p| p.as_str()),
            ) {
                (user.to_owned(), password.to_owned())
            } else {
                continue;
            };
            by_registry.insert(registry_of_key(key), pair);
        }
        Ok(Self { by_registry })
    }

    /// One registry's credentials, set by hand (tests, `csictl`).
    pub fn insert(&mut self, registry: &str, user: &str, password: &str) {
        self.by_registry.insert(
            registry_of_key(registry),
            (user.to_owned(), password.to_owned()),
        );
    }

    /// The user and password for `registry`, if the config has them.
    pub fn for_registry(&self, registry: &str) -> Option<(&str, &str)> {
        self.by_registry
            .get(registry)
            .map(|(user, password)| (user.as_str(), password.as_str()))
    }
}

/// A `config.json` key (`https://index.docker.io/v1/`, `host:5000`, `https://host/v2/`) →
/// the registry host it is for.
fn registry_of_key(key: &str) -> String {
    let host = normalize_registry(key);
    let host = host.split('/').next().unwrap_or_default();
    match host {
        "index.docker.io" | "docker.io" => DOCKER_HUB.to_owned(),
        other => other.to_owned(),
    }
}

/// The image a Mesos `ContainerInfo` names, as written (resolved against the daemon's
/// default registry only when pulled), with its pull policy.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ContainerImage {
    pub name: String,
    pub policy: super::store::PullPolicy,
}

impl ContainerImage {
    /// The image of a `ContainerInfo`: `mesos.image` (`type: DOCKER`, `docker.name`,
    /// `cached`, default true) or, for configs written for the Docker containerizer,
    /// `docker.image` (`force_pull_image` re-checks the tag). `None` when it names none. An
    /// error is `(field relative to the container, message)`.
    pub fn from_container(container: &serde_json::Value) -> Result<Option<Self>, (String, String)> {
        use super::store::PullPolicy;
        use serde_json::Value;
        let err = |field: &str, message: String| Err((field.to_owned(), message));
        let check = |field: &str, name: &str| -> Result<(), (String, String)> {
            ImageRef::parse(name, DOCKER_HUB)
                .map(|_| ())
                .map_err(|e| (field.to_owned(), e.reason))
        };
        let mesos = container.get("mesos").and_then(|m| m.get("image"));
        let docker = container.get("docker").filter(|d| !d.is_null());
        match (mesos, docker) {
            (Some(_), Some(_)) => err(
                "docker",
                "an image is named in both mesos.image and docker.image; keep one".to_owned(),
            ),
            (Some(image), None) => {
                let Some(image) = image.as_object() else {
                    return err("mesos.image", "must be an object".to_owned());
                };
                match image.get("type").and_then(Value::as_str) {
                    None | Some("DOCKER") => {}
                    Some("APPC") => {
                        return err(
                            "mesos.image.type",
                            "APPC images are not supported; use a Docker/OCI image (type DOCKER)"
                                .to_owned(),
                        );
                    }
                    Some(other) => {
                        return err(
                            "mesos.image.type",
                            format!("\"{other}\" is not an image type; use DOCKER"),
                        );
                    }
                }
                let Some(name) = image
                    .get("docker")
                    .and_then(|d| d.get("name"))
                    .and_then(Value::as_str)
                else {
                    return err(
                        "mesos.image.docker.name",
                        "is required: the image to run, e.g. \"org/plugin:1.0\"".to_owned(),
                    );
                };
                check("mesos.image.docker.name", name)?;
                let cached = match image.get("cached") {
                    None | Some(Value::Null) => true,
                    Some(Value::Bool(cached)) => *cached,
                    Some(_) => {
                        return err("mesos.image.cached", "must be true or false".to_owned());
                    }
                };
                Ok(Some(Self {
                    name: name.to_owned(),
                    policy: if cached {
                        PullPolicy::IfMissing
                    } else {
                        PullPolicy::Always
                    },
                }))
            }
            (None, Some(docker)) => {
                let Some(name) = docker.get("image").and_then(Value::as_str) else {
                    return err(
                        "docker.image",
                        "is required: the image to run, e.g. \"org/plugin:1.0\"".to_owned(),
                    );
                };
                check("docker.image", name)?;
                let force = match docker.get("force_pull_image") {
                    None | Some(Value::Null) => false,
                    Some(Value::Bool(force)) => *force,
                    Some(_) => {
                        return err(
                            "docker.force_pull_image",
                            "must be true or false".to_owned(),
                        );
                    }
                };
                Ok(Some(Self {
                    name: name.to_owned(),
                    policy: if force {
                        PullPolicy::Always
                    } else {
                        PullPolicy::IfMissing
                    },
                }))
            }
            (None, None) => Ok(None),
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    fn parse(name: &str) -> ImageRef {
        ImageRef::parse(name, DOCKER_HUB).unwrap()
    }

    #[test]
    fn names_resolve_as_docker_does() {
        let r = parse("busybox");
        assert_eq!(
            (r.registry(), r.repository(), r.tag()),
            (DOCKER_HUB, "library/busybox", Some("latest"))
        );
        assert_eq!(r.to_string(), "registry-1.docker.io/library/busybox:latest");
        let r = parse("org/app:1.2");
        assert_eq!((r.repository(), r.tag()), ("org/app", Some("1.2")));
        let r = parse("docker.io/busybox:1");
        assert_eq!(
            (r.registry(), r.repository()),
            (DOCKER_HUB, "library/busybox")
        );
        let r = parse("localhost/app");
        assert_eq!((r.registry(), r.repository()), ("localhost", "app"));
        let r = parse("127.0.0.1:5000/csi/plugin:v1");
        assert_eq!(
            (r.registry(), r.repository(), r.tag()),
            ("127.0.0.1:5000", "csi/plugin", Some("v1"))
        );
        let hex = "ab".repeat(32);
        let r = parse(&format!("host:5000/app@sha256:{hex}"));
        assert_eq!(r.tag(), None);
        assert_eq!(r.digest().unwrap().hex(), hex);
        let r = parse(&format!("app:v2@sha256:{hex}"));
        assert_eq!(r.tag(), Some("v2"));
        assert_eq!(
            r.manifest_target(),
            format!("sha256:{hex}"),
            "the digest wins"
        );
        assert_eq!(parse("app:v2").manifest_target(), "v2");
        // A private default registry: names without a host go there.
        let r = ImageRef::parse("busybox", "https://mirror.example:5000/").unwrap();
        assert_eq!(
            (r.registry(), r.repository()),
            ("mirror.example:5000", "library/busybox")
        );
    }

    #[test]
    fn bad_references_are_refused() {
        for bad in [
            "",
            "UPPER/case",
            "app:",
            "app:-tag",
            "a//b",
            "app/",
            "/app",
            "app@sha256:short",
            "app@md5:0123",
            "host:port/app",
            "ho st:5000/app",
            "a/../b",
            "app:t/ag",
            "app:tag with space",
            &"a".repeat(256),
        ] {
            assert!(
                ImageRef::parse(bad, DOCKER_HUB).is_err(),
                "{bad:?} accepted"
            );
        }
    }

    #[test]
    fn docker_config_credentials() {
        let auth = base64::engine::general_purpose::STANDARD.encode("alice:s3cret");
        let text = format!(
            r#"{{"auths": {{"https://index.docker.io/v1/": {{"auth": "{auth}"}},
                "127.0.0.1:5000": {{"username": "bob", "password": "pw"}},
                "helper.example": {{}}}}, "credsStore": "desktop"}}"#
        );
        let creds = Credentials::from_docker_config_json(text.as_bytes()).unwrap();
        assert_eq!(creds.for_registry(DOCKER_HUB), Some(("alice", "s3cret")));
        assert_eq!(creds.for_registry("127.0.0.1:5000"), Some(("bob", "pw")));
        assert_eq!(creds.for_registry("helper.example"), None);
        assert!(!format!("{creds:?}").contains("s3cret"));
        assert!(matches!(
            Credentials::from_docker_config_json(br#"{"auths": {"h": {"auth": "!!"}}}"#),
            Err(DockerConfigError::NotBase64 { key }) if key == "h"
        ));
        assert!(matches!(
            Credentials::from_docker_config_json(b"["),
            Err(DockerConfigError::NotJson(_))
        ));
    }

    #[test]
    fn container_infos_name_images() {
        use super::super::store::PullPolicy;
        use serde_json::json;
        let of = |v| ContainerImage::from_container(&v);
        assert_eq!(of(json!({"type": "MESOS"})).unwrap(), None);
        let image = of(
            json!({"type": "MESOS", "mesos": {"image": {"type": "DOCKER",
            "docker": {"name": "busybox"}}}}),
        )
        .unwrap()
        .unwrap();
        assert_eq!(
            (image.name.as_str(), image.policy),
            ("busybox", PullPolicy::IfMissing)
        );
        let image = of(
            json!({"mesos": {"image": {"type": "DOCKER", "cached": false,
            "docker": {"name": "h:5000/p:1"}}}}),
        )
        .unwrap()
        .unwrap();
        assert_eq!(image.policy, PullPolicy::Always);
        let image =
            of(json!({"type": "DOCKER", "docker": {"image": "org/p", "force_pull_image": true}}))
                .unwrap()
                .unwrap();
        assert_eq!(
            (image.name.as_str(), image.policy),
            ("org/p", PullPolicy::Always)
        );
        for (bad, field) in [
            (
                json!({"mesos": {"image": {"type": "APPC"}}}),
                "mesos.image.type",
            ),
            (
                json!({"mesos": {"image": {"type": "DOCKER"}}}),
                "mesos.image.docker.name",
            ),
            (
                json!({"mesos": {"image": {"docker": {"name": "Bad Name"}}}}),
                "mesos.image.docker.name",
            ),
            (
                json!({"mesos": {"image": {"docker": {"name": "a"}, "cached": "no"}}}),
                "mesos.image.cached",
            ),
            (json!({"docker": {"network": "HOST"}}), "docker.image"),
            (json!({"docker": {"image": "a:"}}), "docker.image"),
        ] {
            let (got, message) = of(bad.clone()).unwrap_err();
            assert_eq!(got, field, "{bad}: {message}");
        }
    }
}
