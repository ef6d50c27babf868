//! Plugin configuration: loading, validating and diffing the per-plugin JSON files of
//! `--plugin-config-dir` (docs/configuration.md).
//!
//! This module owns the file format and its validation. It only reads files: it must not
//! launch, stop or talk to plugins (that is the service manager's job), and a bad file must
//! never be fatal — it becomes one [`ConfigError`] naming the file, the field and what to fix,
//! and the other files still load.
//!
//! # Format
//!
//! A file is Mesos's `CSIPluginInfo` as JSON, unchanged, so an existing Mesos
//! `--csi_plugin_config_dir` works as is:
//!
//! | field | meaning |
//! |---|---|
//! | `type` | required; the plugin type, which requests use to name the plugin |
//! | `name` | optional, default `"default"` |
//! | `containers` | managed plugin: `[{services, command, resources, container}]` |
//! | `endpoints` | unmanaged plugin: `[{csi_service, endpoint}]`, `endpoint` is `unix:///abs` or `/abs` |
//! | `target_path_root` | optional absolute path, kept for the volume manager |
//! | `target_path_exists` | optional bool, default `false` |
//!
//! `type` and `name` become path components, so they are limited to letters, digits, `.`,
//! `-` and `_`, must not start with a dot and are at most [`MAX_NAME_LEN`] bytes.
//!
//! `command` is Mesos's `CommandInfo`: `value`, `arguments`, `shell` (default **true**, as in
//! Mesos's protobuf), `environment.variables[{name, value}]` (or `{name, type: SECRET,
//! secret: {type: VALUE, value: {data: <base64>}}}` or `secret: {type: REFERENCE,
//! reference: {name, key}}}` read at launch from `--secret-dir` by [`crate::secrets`],
//! whose value is redacted wherever it is shown: [`EnvVar`]). With `shell: true`, `value` runs
//! through `/bin/sh -c` and `arguments` are ignored. With `shell: false`, `value` is the
//! executable and `arguments` the whole argv, `argv[0]` included (an empty `arguments` means
//! `argv[0] = value`); since no shell expands them, the references `$NAME` and `${NAME}` to
//! the variables csi-agent sets over the config's (`CSI_ENDPOINT`, `CSI_NODE_ID`,
//! `MESOS_AGENT_ID`: `crate::runtime::agent_vars`) inside `arguments` are replaced by
//! csi-agent. `uris` are fetched into the component's sandbox before each launch
//! ([`UriConfig`], `crate::fetch`); `user` is the user the command runs as
//! ([`crate::runtime::users`]).
//!
//! csi-agent's own optional top-level fields:
//!
//! | field | default | meaning |
//! |---|---|---|
//! | `runtime` | `{"kind": "process"}`; `{"kind": "oci"}` when a component names an image or asks for isolation (`crate::runtime::isolation::requested`) | how managed components run; other kinds put their settings in the same object (`oci`: see [`OciConfig`]); an unknown kind is an error |
//! | `startup_timeout_ms` | 30000 | socket appears, connects and answers `Probe` ready within this time, or the launch failed |
//! | `rpc_deadline_ms` | 10000 | deadline of each CSI call |
//! | `stop_grace_ms` | 10000 | SIGTERM → SIGKILL grace period when a component is stopped |
//! | `restart_backoff` | `{"initial_ms": 1000, "max_ms": 60000, "reset_after_ms": 60000}` | restart delays of a crashing component |
//! | `node_id` | the daemon's | node id given to the plugin (`CSI_NODE_ID`) |
//! | `cluster` | `false` | the plugin's storage is shared between nodes: with `--cluster-etcd`, its volumes are claimed across nodes in etcd before use (docs/cluster.md); without it, the field changes nothing |
//!
//! Unknown fields are errors (they are usually typos of the fields above).
//!
//! # Rules
//!
//! - `containers` xor `endpoints`: neither or both is an error.
//! - A service listed by several components (or endpoints) is served by the first one; a
//!   component left serving nothing is dropped with a warning. A service served by no
//!   component is fine (a node-only plugin).
//! - Every file is read as JSON, whatever its name (as Mesos; DC/OS ships `nfs.conf`), in
//!   file-name order, skipping hidden files and directories. Two files with the same `type`:
//!   the second one is an error naming both.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::metrics::{ConfigFileLabels, Metrics};

mod env_secret;

/// Longest accepted `type` or `name`, in bytes. They become path components and parts of
/// component ids and socket paths, so they are kept well below `NAME_MAX` (255).
pub const MAX_NAME_LEN: usize = 128;
/// The plugin name when the file gives none (Mesos's default).
pub const DEFAULT_NAME: &str = "default";
/// Longest accepted `node_id`, in bytes.
pub const MAX_NODE_ID_LEN: usize = 256;
/// Unix socket paths are limited to 108 bytes including the terminating NUL (`sun_path`).
pub const MAX_SOCKET_PATH_LEN: usize = 107;

pub const DEFAULT_STARTUP_TIMEOUT: Duration = Duration::from_secs(30);
pub const DEFAULT_RPC_DEADLINE: Duration = Duration::from_secs(10);
/// Real plugins may take seconds to exit after SIGTERM (LESSONS.md).
pub const DEFAULT_STOP_GRACE: Duration = Duration::from_secs(10);
pub const DEFAULT_BACKOFF: RestartBackoff = RestartBackoff {
    initial: Duration::from_secs(1),
    max: Duration::from_secs(60),
    reset_after: Duration::from_secs(60),
};

/// A CSI service a component can serve (Identity is served by every component).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum Service {
    #[serde(rename = "CONTROLLER_SERVICE")]
    Controller,
    #[serde(rename = "NODE_SERVICE")]
    Node,
}

impl Service {
    pub const ALL: [Service; 2] = [Service::Controller, Service::Node];

    /// The Mesos enum name, used in configs and component ids.
    pub const fn as_str(self) -> &'static str {
        match self {
            Service::Controller => "CONTROLLER_SERVICE",
            Service::Node => "NODE_SERVICE",
        }
    }

    pub fn parse(text: &str) -> Option<Self> {
        Service::ALL.into_iter().find(|s| s.as_str() == text)
    }
}

impl fmt::Display for Service {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What a secret variable's value is replaced with wherever it is shown or recorded.
pub const REDACTED: &str = "<redacted>";

/// One environment variable of a command.
///
/// A `secret` one (Mesos `type: SECRET` with an inline `VALUE`) reaches the plugin's
/// environment like any other, but its value is never shown: `Debug` and `Serialize` (hence
/// `component.json`, whose spec is this serialization, and the launch spec's hash) write
/// [`REDACTED`] instead. So a change of the secret's value alone does not make the running
/// component outdated; the new value applies at its next launch (docs/configuration.md).
/// A non-secret variable serializes exactly as before secrets existed, so the hash of an
/// existing component's spec does not change.
#[derive(Clone, PartialEq, Eq, Hash, Deserialize)]
pub struct EnvVar {
    pub name: String,
    pub value: String,
    #[serde(default)]
    pub secret: bool,
    /// A REFERENCE secret (`secret` is true): `value` is empty in the config and read from
    /// `<secret-dir>/<name>/<key>` at each launch ([`crate::secrets::resolve`]).
    #[serde(default)]
    pub reference: Option<crate::secrets::SecretRef>,
}

impl EnvVar {
    /// A plain (not secret) variable.
    pub fn plain(name: impl Into<String>, value: impl Into<String>) -> Self {
        Self {
            name: name.into(),
            value: value.into(),
            secret: false,
            reference: None,
        }
    }

    /// The value to show: the value itself, or [`REDACTED`] for a secret.
    pub fn shown_value(&self) -> &str {
        if self.secret { REDACTED } else { &self.value }
    }
}

impl fmt::Debug for EnvVar {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EnvVar")
            .field("name", &self.name)
            .field("value", &self.shown_value())
            .field("secret", &self.secret)
            .field("reference", &self.reference)
            .finish()
    }
}

impl Serialize for EnvVar {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeStruct;
        let fields = 2 + usize::from(self.secret) + usize::from(self.reference.is_some());
        let mut out = serializer.serialize_struct("EnvVar", fields)?;
        out.serialize_field("name", &self.name)?;
        out.serialize_field("value", self.shown_value())?;
        if self.secret {
            out.serialize_field("secret", &true)?;
        }
        // The reference (not its content) is shown and hashed: pointing the variable at
        // another file makes the component outdated.
        if let Some(reference) = &self.reference {
            out.serialize_field("reference", reference)?;
        }
        out.end()
    }
}

/// Mesos `CommandInfo`, reduced to what a runtime needs.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct CommandConfig {
    pub value: String,
    pub arguments: Vec<String>,
    pub shell: bool,
    pub environment: Vec<EnvVar>,
    /// Mesos `CommandInfo.uris`: fetched into the sandbox before each launch. Not serialized
    /// when empty, so that the spec hash of a component without any is what it was before.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub uris: Vec<UriConfig>,
    /// Mesos `CommandInfo.user`: the user the command runs as (a name or a uid), resolved at
    /// launch in the host's (or the image's) `/etc/passwd` ([`crate::runtime::users`]).
    /// Absent from the serialized form when unset, so existing launch spec hashes hold.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user: Option<String>,
}

/// One Mesos `CommandInfo.URI`, validated (`crate::fetch` fetches it).
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct UriConfig {
    /// `http://…`, `https://…`, `file:///abs` or `/abs`.
    pub value: String,
    /// chmod 0755, never extracted. Default false.
    pub executable: bool,
    /// Extract a `.tar`, `.tar.gz` or `.tgz` into the sandbox. Default **true**, as Mesos.
    pub extract: bool,
    /// Reuse an earlier download of the same `value` (http/https). Default false.
    pub cache: bool,
    /// The name in the sandbox instead of the last component of `value`; one file name.
    pub output_file: Option<String>,
}

impl CommandConfig {
    /// The program to execute and the full argv (`argv[0]` included), following Mesos:
    /// `shell` → `/bin/sh -c value`; otherwise `value` with `arguments` as argv, or
    /// `argv = [value]` when `arguments` is empty. `vars` are substituted in the arguments of
    /// a non-shell command (a shell expands them itself from the environment).
    pub fn argv(&self, vars: &[(&str, &str)]) -> (String, Vec<String>) {
        if self.shell {
            return (
                "/bin/sh".to_owned(),
                vec!["sh".to_owned(), "-c".to_owned(), self.value.clone()],
            );
        }
        if self.arguments.is_empty() {
            return (self.value.clone(), vec![self.value.clone()]);
        }
        let argv = self
            .arguments
            .iter()
            .map(|arg| substitute_vars(arg, vars))
            .collect();
        (self.value.clone(), argv)
    }
}

/// Replaces `$NAME` and `${NAME}` for each `(NAME, value)`; `$NAME` only matches when the
/// next character cannot continue a variable name, as in a shell.
pub fn substitute_vars(text: &str, vars: &[(&str, &str)]) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    'outer: while let Some(pos) = rest.find('$') {
        out.push_str(&rest[..pos]);
        let after = &rest[pos + 1..];
        for (name, value) in vars {
            if let Some(tail) = after
                .strip_prefix('{')
                .and_then(|t| t.strip_prefix(name))
                .and_then(|t| t.strip_prefix('}'))
            {
                out.push_str(value);
                rest = tail;
                continue 'outer;
            }
            if let Some(tail) = after.strip_prefix(name) {
                let continues = tail
                    .chars()
                    .next()
                    .is_some_and(|c| c.is_ascii_alphanumeric() || c == '_');
                if !continues {
                    out.push_str(value);
                    rest = tail;
                    continue 'outer;
                }
            }
        }
        out.push('$');
        rest = after;
    }
    out.push_str(rest);
    out
}

/// One managed component (`containers[i]`).
#[derive(Clone, Debug, PartialEq)]
pub struct ComponentConfig {
    /// The services listed in the file, deduplicated, in file order. The component id is
    /// built from these (Mesos compatibility), even if an earlier component took one of them.
    pub services: Vec<Service>,
    /// The services this component actually serves: `services` minus those an earlier
    /// component already serves. Never empty.
    pub serves: Vec<Service>,
    pub command: CommandConfig,
    /// Mesos `resources`, kept verbatim once validated (`crate::runtime::isolation`; the
    /// process runtime does not enforce them).
    pub resources: Vec<Value>,
    /// Mesos `ContainerInfo`, kept verbatim.
    pub container: Option<Value>,
}

/// Whether any `containers[i].container` names an image (a malformed one counts: the
/// component's own parse reports it with its field).
fn names_an_image(containers: &[Value]) -> bool {
    containers.iter().any(|c| {
        c.get("container").is_some_and(|container| {
            container.is_object()
                && !matches!(
                    crate::image::reference::ContainerImage::from_container(container),
                    Ok(None)
                )
        })
    })
}

/// Whether any `containers[i]` asks for isolation the process runtime cannot give
/// (`crate::runtime::isolation::requested`).
fn asks_for_isolation(containers: &[Value]) -> bool {
    containers.iter().any(|c| {
        let resources = c
            .get("resources")
            .and_then(Value::as_array)
            .map_or(&[][..], Vec::as_slice);
        !crate::runtime::isolation::requested(resources, c.get("container")).is_empty()
    })
}

/// One unmanaged endpoint (`endpoints[i]`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EndpointConfig {
    pub service: Service,
    /// The socket path (the `unix://` scheme removed).
    pub socket: PathBuf,
}

/// Managed (launched by csi-agent) or unmanaged (running elsewhere).
#[derive(Clone, Debug, PartialEq)]
pub enum Deployment {
    Managed(Vec<ComponentConfig>),
    /// Only the first endpoint of each service is kept.
    Unmanaged(Vec<EndpointConfig>),
}

/// How managed components are run. Serialized as `{"kind": "process", ...settings}`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
pub enum RuntimeConfig {
    /// A supervised host process (see `crate::runtime`).
    #[default]
    Process,
    /// A container run by an OCI runtime such as runc (see `crate::runtime::oci`).
    Oci(OciConfig),
}

impl RuntimeConfig {
    pub const fn kind(&self) -> &'static str {
        match self {
            RuntimeConfig::Process => "process",
            RuntimeConfig::Oci(_) => "oci",
        }
    }
}

/// The settings of `"runtime": {"kind": "oci", ...}`. Every field is optional; `None` means
/// the default documented on the field. Part of the launch spec's hash: changing one
/// replaces the container.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct OciConfig {
    /// The container's root file system (an unpacked image). Default: the host's root,
    /// bind-mounted, with its own `/proc`, `/dev` and `/tmp`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rootfs: Option<PathBuf>,
    /// All capabilities, the host's devices, no masked paths. Default: true for a component
    /// serving NODE_SERVICE (node plugins mount), false otherwise.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub privileged: Option<bool>,
    /// The capabilities the plugin gets (`CAP_SYS_ADMIN` or `SYS_ADMIN`), narrowing
    /// `privileged`. Default: all when privileged, runc's default set otherwise.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub capabilities: Option<Vec<String>>,
    /// Mount the root file system read-only. Default: true.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub readonly_rootfs: Option<bool>,
    /// Share the host's network namespace. Default: true (a fresh one has only loopback).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_network: Option<bool>,
    /// Share the host's PID namespace. Default: false.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_pid: Option<bool>,
}

/// Restart delays of a crashing component: the first restart after a healthy run is
/// immediate, then `initial`, doubling up to `max`; the count resets once the component has
/// been ready for `reset_after`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct RestartBackoff {
    pub initial: Duration,
    pub max: Duration,
    pub reset_after: Duration,
}

impl RestartBackoff {
    /// The delay before relaunching after the `failures`-th consecutive failure (1-based).
    pub fn delay(&self, failures: u32) -> Duration {
        if failures <= 1 {
            return Duration::ZERO;
        }
        let exponent = (failures - 2).min(31);
        self.initial
            .checked_mul(1u32 << exponent)
            .unwrap_or(self.max)
            .min(self.max)
    }
}

/// One plugin's effective configuration.
#[derive(Clone, Debug, PartialEq)]
pub struct PluginConfig {
    pub plugin_type: String,
    pub name: String,
    pub deployment: Deployment,
    pub target_path_root: Option<PathBuf>,
    pub target_path_exists: bool,
    pub runtime: RuntimeConfig,
    pub startup_timeout: Duration,
    pub rpc_deadline: Duration,
    pub stop_grace: Duration,
    pub restart_backoff: RestartBackoff,
    pub node_id: Option<String>,
    /// Shared storage: claimed across nodes in cluster mode (docs/cluster.md).
    pub cluster: bool,
}

impl PluginConfig {
    pub fn is_managed(&self) -> bool {
        matches!(self.deployment, Deployment::Managed(_))
    }
}

/// Why a file (or the directory) could not be loaded. `Display` says which file, which field
/// and what to fix.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot list the plugin config dir {}: {source}", dir.display())]
    ReadDir {
        dir: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{}: cannot read the file: {source}", file.display())]
    Read {
        file: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "{}: not a regular file; a plugin config must be a regular file (or a symlink to one): remove it from the config dir",
        file.display()
    )]
    NotAFile { file: PathBuf },
    #[error(
        "{}: malformed JSON at line {line}, column {column}: {message}; fix the syntax (every non-hidden file of the config dir is read as a plugin config: move other files out)",
        file.display()
    )]
    Malformed {
        file: PathBuf,
        line: usize,
        column: usize,
        message: String,
    },
    #[error("{}: field `{field}`: {message}", file.display())]
    Invalid {
        file: PathBuf,
        field: String,
        message: String,
    },
    #[error(
        "{}: plugin type \"{plugin_type}\" is already configured by {}; each plugin needs its own type: remove or rename one of the two files",
        file.display(),
        first_file.display()
    )]
    DuplicateType {
        file: PathBuf,
        first_file: PathBuf,
        plugin_type: String,
    },
}

impl ConfigError {
    /// The file (or directory) the error is about.
    pub fn file(&self) -> &Path {
        match self {
            ConfigError::ReadDir { dir, .. } => dir,
            ConfigError::Read { file, .. }
            | ConfigError::NotAFile { file }
            | ConfigError::Malformed { file, .. }
            | ConfigError::Invalid { file, .. }
            | ConfigError::DuplicateType { file, .. } => file,
        }
    }
}

/// A successfully loaded plugin and the file it came from.
#[derive(Clone, Debug, PartialEq)]
pub struct LoadedConfig {
    pub file: PathBuf,
    pub config: PluginConfig,
}

/// The plugins of one load, keyed by type.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ConfigSet {
    pub plugins: BTreeMap<String, LoadedConfig>,
}

impl ConfigSet {
    pub fn get(&self, plugin_type: &str) -> Option<&PluginConfig> {
        self.plugins.get(plugin_type).map(|loaded| &loaded.config)
    }
}

/// The result of loading a directory: the good plugins and one error per bad file.
#[derive(Debug, Default)]
pub struct LoadReport {
    pub set: ConfigSet,
    pub errors: Vec<ConfigError>,
}

/// What a reload changes, by plugin type (each list sorted).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ConfigDiff {
    pub added: Vec<String>,
    /// Same type, different effective configuration.
    pub changed: Vec<String>,
    pub removed: Vec<String>,
    /// Plugins whose file failed to load this time: the caller should keep running the old
    /// configuration rather than stop a plugin because of a typo.
    pub kept_on_error: Vec<String>,
}

impl ConfigDiff {
    /// Compares the running set with a fresh load.
    pub fn between(old: &ConfigSet, new: &LoadReport) -> ConfigDiff {
        let failed: BTreeSet<&Path> = new.errors.iter().map(ConfigError::file).collect();
        let mut diff = ConfigDiff::default();
        for (plugin_type, loaded) in &new.set.plugins {
            match old.plugins.get(plugin_type) {
                None => diff.added.push(plugin_type.clone()),
                Some(previous) if previous.config != loaded.config => {
                    diff.changed.push(plugin_type.clone());
                }
                Some(_) => {}
            }
        }
        for (plugin_type, loaded) in &old.plugins {
            if new.set.plugins.contains_key(plugin_type) {
                continue;
            }
            if failed.contains(loaded.file.as_path()) {
                diff.kept_on_error.push(plugin_type.clone());
            } else {
                diff.removed.push(plugin_type.clone());
            }
        }
        diff
    }

    pub fn is_empty(&self) -> bool {
        self.added.is_empty() && self.changed.is_empty() && self.removed.is_empty()
    }
}

/// Loads every file of `dir` as JSON, whatever its name (sorted by file name, hidden files
/// and directories skipped; see [`list_config_files`]). Never
/// fails as a whole: unreadable or invalid files become errors in the report. When `metrics`
/// is given, `config_errors` is reset to exactly the failing files of this load.
pub fn load_dir(dir: &Path, metrics: Option<&Metrics>) -> LoadReport {
    let mut report = LoadReport::default();
    match list_config_files(dir) {
        Err(source) => report.errors.push(ConfigError::ReadDir {
            dir: dir.to_path_buf(),
            source,
        }),
        Ok((files, unreadable)) => {
            report.errors.extend(unreadable);
            for file in files {
                match load_file(&file) {
                    Err(err) => report.errors.push(err),
                    Ok(config) => {
                        if let Some(first) = report.set.plugins.get(&config.plugin_type) {
                            report.errors.push(ConfigError::DuplicateType {
                                file: file.clone(),
                                first_file: first.file.clone(),
                                plugin_type: config.plugin_type.clone(),
                            });
                            continue;
                        }
                        report
                            .set
                            .plugins
                            .insert(config.plugin_type.clone(), LoadedConfig { file, config });
                    }
                }
            }
        }
    }
    for err in &report.errors {
        tracing::error!(file = %err.file().display(), "skipping plugin config: {err}");
    }
    if let Some(metrics) = metrics {
        metrics.config_errors.clear();
        for err in &report.errors {
            let file = err
                .file()
                .file_name()
                .map(|name| name.to_string_lossy().into_owned())
                .unwrap_or_else(|| err.file().display().to_string());
            metrics
                .config_errors
                .get_or_create(&ConfigFileLabels { file })
                .set(1);
        }
    }
    report
}

/// The files of `dir` to load, and one error per entry that cannot be one.
///
/// Every non-hidden entry is a config, whatever its name, as Mesos reads every file of
/// `--csi_plugin_config_dir` (`src/slave/csi_server.cpp`: `os::ls`, directories skipped):
/// DC/OS ships its NFS plugin as `nfs.conf`. Hidden entries are skipped (Mesos reads them
/// too): editors and config management leave `.x.json.swp`, `.#x.json` and temp files
/// there, which are never meant as configs. Symlinks are followed, as before and as Mesos
/// does (the dir is operator-owned, and config management links files in); directories are
/// skipped, as Mesos does. Anything else (a FIFO, a socket, a device, a dangling link) is an
/// error on that entry: reading a FIFO would block the load forever.
fn list_config_files(dir: &Path) -> std::io::Result<(Vec<PathBuf>, Vec<ConfigError>)> {
    let mut files = Vec::new();
    let mut errors = Vec::new();
    for entry in std::fs::read_dir(dir)? {
        let entry = entry?;
        if entry.file_name().as_encoded_bytes().starts_with(b".") {
            continue;
        }
        let path = entry.path();
        match std::fs::metadata(&path) {
            Ok(meta) if meta.is_file() => files.push(path),
            Ok(meta) if meta.is_dir() => {}
            Ok(_) => errors.push(ConfigError::NotAFile { file: path }),
            Err(source) => errors.push(ConfigError::Read { file: path, source }),
        }
    }
    files.sort();
    errors.sort_by(|a, b| a.file().cmp(b.file()));
    Ok((files, errors))
}

/// Reads and validates one file.
pub fn load_file(file: &Path) -> Result<PluginConfig, ConfigError> {
    let text = std::fs::read_to_string(file).map_err(|source| ConfigError::Read {
        file: file.to_path_buf(),
        source,
    })?;
    parse_config(file, &text)
}

/// Validates one file's text; `file` is only used in error messages.
pub fn parse_config(file: &Path, text: &str) -> Result<PluginConfig, ConfigError> {
    let value: Value = serde_json::from_str(text).map_err(|err| {
        // serde_json appends the position to its message; it is reported separately.
        let full = err.to_string();
        let suffix = format!(" at line {} column {}", err.line(), err.column());
        let message = if text.trim().is_empty() {
            "the file is empty".to_owned()
        } else {
            full.strip_suffix(&suffix).unwrap_or(&full).to_owned()
        };
        ConfigError::Malformed {
            file: file.to_path_buf(),
            line: err.line(),
            column: err.column(),
            message,
        }
    })?;
    Parser { file }.plugin(&value)
}

/// Why a `type` or `name` is refused ([`validate_name`]); the message says what to fix.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum NameError {
    #[error("must not be empty")]
    Empty,
    #[error("is {len} bytes long; at most {MAX_NAME_LEN} are allowed")]
    TooLong { len: usize },
    #[error("\"{text}\" must not start with a dot")]
    LeadingDot { text: String },
    #[error("\"{text}\" contains {bad:?}; only letters, digits, '.', '-' and '_' are allowed")]
    BadCharacter { text: String, bad: char },
}

/// Validates a `type` or `name`: letters, digits, `.`, `-`, `_`; no leading dot; at most
/// [`MAX_NAME_LEN`] bytes.
pub fn validate_name(text: &str) -> Result<(), NameError> {
    if text.is_empty() {
        return Err(NameError::Empty);
    }
    if text.len() > MAX_NAME_LEN {
        return Err(NameError::TooLong { len: text.len() });
    }
    if text.starts_with('.') {
        return Err(NameError::LeadingDot {
            text: text.to_owned(),
        });
    }
    if let Some(bad) = text
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | '_')))
    {
        return Err(NameError::BadCharacter {
            text: text.to_owned(),
            bad,
        });
    }
    Ok(())
}

/// Why an endpoint of a config is refused ([`parse_endpoint`]).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum EndpointConfigError {
    #[error(transparent)]
    Form(#[from] crate::client::EndpointError),
    #[error("socket path is {len} bytes long; unix sockets allow at most {MAX_SOCKET_PATH_LEN}")]
    TooLong { len: usize },
}

/// Parses an endpoint (`unix:///abs/path` or a bare absolute path, as the client accepts)
/// and checks that it fits in a unix socket address.
pub fn parse_endpoint(text: &str) -> Result<PathBuf, EndpointConfigError> {
    let path = crate::client::parse_endpoint(text)?;
    let len = path.as_os_str().len();
    if len > MAX_SOCKET_PATH_LEN {
        return Err(EndpointConfigError::TooLong { len });
    }
    Ok(path)
}

/// Walks the JSON value, building errors that name the field path.
struct Parser<'a> {
    file: &'a Path,
}

type Obj = Map<String, Value>;

impl Parser<'_> {
    fn invalid(&self, field: impl Into<String>, message: impl Into<String>) -> ConfigError {
        ConfigError::Invalid {
            file: self.file.to_path_buf(),
            field: field.into(),
            message: message.into(),
        }
    }

    fn object<'v>(&self, value: &'v Value, field: &str) -> Result<&'v Obj, ConfigError> {
        value
            .as_object()
            .ok_or_else(|| self.invalid(field, format!("must be an object, not {}", kind(value))))
    }

    fn check_keys(&self, obj: &Obj, prefix: &str, known: &[&str]) -> Result<(), ConfigError> {
        for key in obj.keys() {
            if !known.contains(&key.as_str()) {
                return Err(self.invalid(
                    join(prefix, key),
                    format!("unknown field; known fields here: {}", known.join(", ")),
                ));
            }
        }
        Ok(())
    }

    fn string<'v>(
        &self,
        obj: &'v Obj,
        prefix: &str,
        key: &str,
    ) -> Result<Option<&'v str>, ConfigError> {
        match obj.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::String(s)) => Ok(Some(s)),
            Some(other) => Err(self.invalid(
                join(prefix, key),
                format!("must be a string, not {}", kind(other)),
            )),
        }
    }

    fn boolean(&self, obj: &Obj, prefix: &str, key: &str) -> Result<Option<bool>, ConfigError> {
        match obj.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(other) => Err(self.invalid(
                join(prefix, key),
                format!("must be true or false, not {}", kind(other)),
            )),
        }
    }

    fn array<'v>(
        &self,
        obj: &'v Obj,
        prefix: &str,
        key: &str,
    ) -> Result<Option<&'v [Value]>, ConfigError> {
        match obj.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::Array(items)) => Ok(Some(items)),
            Some(other) => Err(self.invalid(
                join(prefix, key),
                format!("must be a list, not {}", kind(other)),
            )),
        }
    }

    /// A positive number of milliseconds.
    fn millis(&self, obj: &Obj, prefix: &str, key: &str) -> Result<Option<Duration>, ConfigError> {
        match obj.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(value) => match value.as_u64() {
                Some(ms) if ms > 0 => Ok(Some(Duration::from_millis(ms))),
                _ => Err(self.invalid(
                    join(prefix, key),
                    format!("must be a positive whole number of milliseconds, not {value}"),
                )),
            },
        }
    }

    fn plugin(&self, value: &Value) -> Result<PluginConfig, ConfigError> {
        let obj = self.object(value, "(top level)")?;
        self.check_keys(
            obj,
            "",
            &[
                "type",
                "name",
                "containers",
                "endpoints",
                "target_path_root",
                "target_path_exists",
                "runtime",
                "startup_timeout_ms",
                "rpc_deadline_ms",
                "stop_grace_ms",
                "restart_backoff",
                "node_id",
                "cluster",
            ],
        )?;
        let plugin_type = self
            .string(obj, "", "type")?
            .ok_or_else(|| self.invalid("type", "is required (e.g. \"org.example.lvm\")"))?;
        validate_name(plugin_type).map_err(|err| self.invalid("type", err.to_string()))?;
        let name = self.string(obj, "", "name")?.unwrap_or(DEFAULT_NAME);
        validate_name(name).map_err(|err| self.invalid("name", err.to_string()))?;

        let containers = self.array(obj, "", "containers")?.filter(|c| !c.is_empty());
        let runtime = match obj.get("runtime") {
            // A plugin config naming an image runs it (issue #13): the oci runtime is the
            // one that can. An explicit "process" with an image is refused below.
            None | Some(Value::Null) if names_an_image(containers.unwrap_or_default()) => {
                RuntimeConfig::Oci(OciConfig::default())
            }
            // Without an image, a component asking for isolation (cgroup limits, volumes,
            // capabilities, rlimits, a hostname) runs in a container on the host's root, as
            // Mesos's containerizer confines it on the host's file system (issue #29).
            None | Some(Value::Null) if asks_for_isolation(containers.unwrap_or_default()) => {
                RuntimeConfig::Oci(OciConfig::default())
            }
            None | Some(Value::Null) => RuntimeConfig::Process,
            Some(value) => self.runtime(value)?,
        };

        let endpoints = self.array(obj, "", "endpoints")?.filter(|e| !e.is_empty());
        let deployment = match (containers, endpoints) {
            (None, None) => {
                return Err(self.invalid(
                    "containers/endpoints",
                    "neither is given; add `containers` (a plugin csi-agent launches) or `endpoints` (a plugin running elsewhere)",
                ));
            }
            (Some(_), Some(_)) => {
                return Err(self.invalid(
                    "containers/endpoints",
                    "both are given; keep `containers` (csi-agent launches the plugin) or `endpoints` (the plugin runs elsewhere), not both",
                ));
            }
            (Some(containers), None) => Deployment::Managed(self.components(containers, &runtime)?),
            (None, Some(endpoints)) => Deployment::Unmanaged(self.endpoints(endpoints)?),
        };

        let target_path_root = match self.string(obj, "", "target_path_root")? {
            None => None,
            Some(root) if root.starts_with('/') => Some(PathBuf::from(root)),
            Some(root) => {
                return Err(self.invalid(
                    "target_path_root",
                    format!("\"{root}\" must be an absolute path"),
                ));
            }
        };
        let target_path_exists = self
            .boolean(obj, "", "target_path_exists")?
            .unwrap_or(false);
        let cluster = self.boolean(obj, "", "cluster")?.unwrap_or(false);

        let node_id = match self.string(obj, "", "node_id")? {
            None => None,
            Some("") => {
                return Err(self.invalid(
                    "node_id",
                    "must not be empty; remove the field to use the daemon's node id",
                ));
            }
            Some(id) if id.len() > MAX_NODE_ID_LEN => {
                return Err(self.invalid(
                    "node_id",
                    format!(
                        "is {} bytes long; at most {MAX_NODE_ID_LEN} are allowed",
                        id.len()
                    ),
                ));
            }
            Some(id) => Some(id.to_owned()),
        };

        let restart_backoff = match obj.get("restart_backoff") {
            None | Some(Value::Null) => DEFAULT_BACKOFF,
            Some(value) => self.backoff(value)?,
        };

        Ok(PluginConfig {
            plugin_type: plugin_type.to_owned(),
            name: name.to_owned(),
            deployment,
            target_path_root,
            target_path_exists,
            runtime,
            startup_timeout: self
                .millis(obj, "", "startup_timeout_ms")?
                .unwrap_or(DEFAULT_STARTUP_TIMEOUT),
            rpc_deadline: self
                .millis(obj, "", "rpc_deadline_ms")?
                .unwrap_or(DEFAULT_RPC_DEADLINE),
            stop_grace: self
                .millis(obj, "", "stop_grace_ms")?
                .unwrap_or(DEFAULT_STOP_GRACE),
            restart_backoff,
            node_id,
            cluster,
        })
    }

    fn runtime(&self, value: &Value) -> Result<RuntimeConfig, ConfigError> {
        let obj = self.object(value, "runtime")?;
        // A root file system is only something a container has.
        if obj.get("kind").is_none() && obj.contains_key("rootfs") {
            return self.oci(obj).map(RuntimeConfig::Oci);
        }
        let kind = self.string(obj, "runtime", "kind")?.ok_or_else(|| {
            self.invalid(
                "runtime.kind",
                "is required (supported: \"process\", \"oci\")",
            )
        })?;
        match kind {
            "process" => {
                self.check_keys(obj, "runtime", &["kind"])?;
                Ok(RuntimeConfig::Process)
            }
            "oci" => self.oci(obj).map(RuntimeConfig::Oci),
            other => Err(self.invalid(
                "runtime.kind",
                format!(
                    "\"{other}\" is not a runtime this build supports; use \"process\" or \"oci\""
                ),
            )),
        }
    }

    fn oci(&self, obj: &Obj) -> Result<OciConfig, ConfigError> {
        let prefix = "runtime";
        self.check_keys(
            obj,
            prefix,
            &[
                "kind",
                "rootfs",
                "privileged",
                "capabilities",
                "readonly_rootfs",
                "host_network",
                "host_pid",
            ],
        )?;
        let rootfs = match self.string(obj, prefix, "rootfs")? {
            None => None,
            Some(root) if root.starts_with('/') => Some(PathBuf::from(root)),
            Some(root) => {
                return Err(self.invalid(
                    "runtime.rootfs",
                    format!("\"{root}\" must be an absolute path"),
                ));
            }
        };
        let capabilities = match self.array(obj, prefix, "capabilities")? {
            None => None,
            Some(items) => {
                let mut names = Vec::new();
                for (index, item) in items.iter().enumerate() {
                    let field = format!("runtime.capabilities[{index}]");
                    let Some(name) = item.as_str() else {
                        return Err(
                            self.invalid(field, format!("must be a string, not {}", kind(item)))
                        );
                    };
                    let canonical = crate::runtime::oci::canonical_capability(name)
                        .ok_or_else(|| {
                            self.invalid(
                                field,
                                format!(
                                    "\"{name}\" is not a Linux capability; use a name like \"CAP_SYS_ADMIN\" (see capabilities(7))"
                                ),
                            )
                        })?;
                    names.push(canonical);
                }
                Some(names)
            }
        };
        Ok(OciConfig {
            rootfs,
            privileged: self.boolean(obj, prefix, "privileged")?,
            capabilities,
            readonly_rootfs: self.boolean(obj, prefix, "readonly_rootfs")?,
            host_network: self.boolean(obj, prefix, "host_network")?,
            host_pid: self.boolean(obj, prefix, "host_pid")?,
        })
    }

    fn backoff(&self, value: &Value) -> Result<RestartBackoff, ConfigError> {
        let prefix = "restart_backoff";
        let obj = self.object(value, prefix)?;
        self.check_keys(obj, prefix, &["initial_ms", "max_ms", "reset_after_ms"])?;
        let initial = self
            .millis(obj, prefix, "initial_ms")?
            .unwrap_or(DEFAULT_BACKOFF.initial);
        let max = self
            .millis(obj, prefix, "max_ms")?
            .unwrap_or(DEFAULT_BACKOFF.max.max(initial));
        let reset_after = self
            .millis(obj, prefix, "reset_after_ms")?
            .unwrap_or(DEFAULT_BACKOFF.reset_after);
        if max < initial {
            return Err(self.invalid(
                "restart_backoff.max_ms",
                format!(
                    "{} is less than initial_ms ({}); make max_ms at least initial_ms",
                    max.as_millis(),
                    initial.as_millis()
                ),
            ));
        }
        Ok(RestartBackoff {
            initial,
            max,
            reset_after,
        })
    }

    fn components(
        &self,
        containers: &[Value],
        runtime: &RuntimeConfig,
    ) -> Result<Vec<ComponentConfig>, ConfigError> {
        let mut served: BTreeSet<Service> = BTreeSet::new();
        let mut components = Vec::new();
        for (index, value) in containers.iter().enumerate() {
            let prefix = format!("containers[{index}]");
            let obj = self.object(value, &prefix)?;
            self.check_keys(
                obj,
                &prefix,
                &["services", "command", "resources", "container"],
            )?;
            let services = self.services(obj, &prefix)?;
            let image = match obj.get("container") {
                Some(container) if container.is_object() => {
                    crate::image::reference::ContainerImage::from_container(container).map_err(
                        |(field, message)| {
                            self.invalid(join(&join(&prefix, "container"), &field), message)
                        },
                    )?
                }
                _ => None,
            };
            let command = match obj.get("command") {
                // The image's Entrypoint and Cmd (see `crate::runtime::oci::image_argv`).
                None | Some(Value::Null) if image.is_some() => CommandConfig::default(),
                None | Some(Value::Null) => {
                    return Err(self.invalid(
                        join(&prefix, "command"),
                        "is required: give the command that starts the plugin ({\"value\": \"/path/to/plugin\", ...})",
                    ));
                }
                Some(value) => self.command(value, &join(&prefix, "command"), image.is_some())?,
            };
            let resources = self
                .array(obj, &prefix, "resources")?
                .map(<[Value]>::to_vec)
                .unwrap_or_default();
            let container = match obj.get("container") {
                None | Some(Value::Null) => None,
                Some(value) => {
                    self.object(value, &join(&prefix, "container"))?;
                    let has_image = image.is_some();
                    if has_image
                        && let RuntimeConfig::Oci(OciConfig {
                            rootfs: Some(_), ..
                        }) = runtime
                    {
                        return Err(self.invalid(
                            join(&prefix, "container"),
                            "names an image, and runtime.rootfs gives another root file system; remove one",
                        ));
                    }
                    if has_image && *runtime == RuntimeConfig::Process {
                        return Err(self.invalid(
                            join(&prefix, "container"),
                            "names an image, but runtime \"process\" runs host processes; remove the image or choose a runtime that runs images",
                        ));
                    }
                    Some(value.clone())
                }
            };
            // Validated whichever runtime runs the component (issue #29): the process
            // runtime does not apply these, but a typo must not wait for a runtime change
            // to surface.
            crate::runtime::isolation::parse(&resources, container.as_ref())
                .map_err(|(field, message)| self.invalid(join(&prefix, &field), message))?;
            if let Some(container) = &container {
                for (field, instead) in crate::runtime::isolation::unhonoured(container) {
                    tracing::warn!(
                        file = %self.file.display(),
                        "{prefix}.{field} is not applied by any runtime of csi-agent: {instead}"
                    );
                }
            }
            let serves: Vec<Service> = services
                .iter()
                .copied()
                .filter(|s| !served.contains(s))
                .collect();
            if serves.is_empty() {
                // docs/configuration.md: the first component listing a service serves it.
                tracing::warn!(
                    file = %self.file.display(),
                    "{prefix} serves nothing: each of its services is served by an earlier component; it will not be launched"
                );
                continue;
            }
            served.extend(serves.iter().copied());
            components.push(ComponentConfig {
                services,
                serves,
                command,
                resources,
                container,
            });
        }
        Ok(components)
    }

    fn services(&self, obj: &Obj, prefix: &str) -> Result<Vec<Service>, ConfigError> {
        let field = join(prefix, "services");
        let items = self.array(obj, prefix, "services")?.unwrap_or_default();
        if items.is_empty() {
            return Err(self.invalid(
                field,
                "must list at least one of CONTROLLER_SERVICE, NODE_SERVICE",
            ));
        }
        let mut services = Vec::new();
        for (index, item) in items.iter().enumerate() {
            let service = self.service(item, &format!("{field}[{index}]"))?;
            if !services.contains(&service) {
                services.push(service);
            }
        }
        Ok(services)
    }

    fn service(&self, value: &Value, field: &str) -> Result<Service, ConfigError> {
        let unknown = || {
            self.invalid(
                field,
                format!("unknown service {value}; use \"CONTROLLER_SERVICE\" or \"NODE_SERVICE\""),
            )
        };
        match value {
            Value::String(text) => Service::parse(text).ok_or_else(unknown),
            _ => Err(unknown()),
        }
    }

    /// `from_image`: the component runs an image, whose Entrypoint/Cmd apply when `value`
    /// is not given.
    fn command(
        &self,
        value: &Value,
        prefix: &str,
        from_image: bool,
    ) -> Result<CommandConfig, ConfigError> {
        let obj = self.object(value, prefix)?;
        self.check_keys(
            obj,
            prefix,
            &["value", "arguments", "shell", "environment", "uris", "user"],
        )?;
        let command = self.string(obj, prefix, "value")?.unwrap_or_default();
        if command.trim().is_empty() && !(from_image && command.is_empty()) {
            return Err(self.invalid(
                join(prefix, "value"),
                "is empty; give the plugin's executable (or a shell command with \"shell\": true)",
            ));
        }
        let mut arguments = Vec::new();
        for (index, item) in self
            .array(obj, prefix, "arguments")?
            .unwrap_or_default()
            .iter()
            .enumerate()
        {
            match item {
                Value::String(arg) => arguments.push(arg.clone()),
                other => {
                    return Err(self.invalid(
                        format!("{prefix}.arguments[{index}]"),
                        format!("must be a string, not {}", kind(other)),
                    ));
                }
            }
        }
        // Mesos's CommandInfo.shell defaults to true.
        let shell = self.boolean(obj, prefix, "shell")?.unwrap_or(true);
        let mut uris = Vec::new();
        for (index, item) in self
            .array(obj, prefix, "uris")?
            .unwrap_or_default()
            .iter()
            .enumerate()
        {
            uris.push(self.uri(item, &format!("{prefix}.uris[{index}]"))?);
        }
        let user = self.string(obj, prefix, "user")?.map(str::to_owned);
        if let Some(user) = &user
            && (user.is_empty() || user.contains([':', '\n', '\0']) || user.len() > 256)
        {
            return Err(self.invalid(
                join(prefix, "user"),
                format!(
                    "{user:?} is not a user name: give a name or a uid of /etc/passwd (no ':', newline or NUL, at most 256 bytes), or remove `user` to run as csi-agent's user"
                ),
            ));
        }
        if user.is_some() && !uris.is_empty() {
            // The fetched files land in the sandbox, inside the work dir (root's, 0700: it
            // holds secrets), which a component run as a user cannot reach (docs/configuration.md,
            // "Running as a user"): refused here rather than failing every launch.
            return Err(self.invalid(
                join(prefix, "user"),
                "cannot be combined with `uris` yet: the fetched files are in csi-agent's sandbox, which only root can reach; drop `user`, or install the plugin on the host and drop `uris`",
            ));
        }
        let environment = match obj.get("environment") {
            None | Some(Value::Null) => Vec::new(),
            Some(value) => self.environment(value, &join(prefix, "environment"))?,
        };
        Ok(CommandConfig {
            value: command.to_owned(),
            arguments,
            shell,
            environment,
            uris,
            user,
        })
    }

    /// One `CommandInfo.URI` (Mesos's fields and defaults; the schemes `crate::fetch` can
    /// fetch).
    fn uri(&self, value: &Value, field: &str) -> Result<UriConfig, ConfigError> {
        let obj = self.object(value, field)?;
        self.check_keys(
            obj,
            field,
            &["value", "executable", "extract", "cache", "output_file"],
        )?;
        let text = self.string(obj, field, "value")?.unwrap_or_default();
        crate::fetch::check_uri(text)
            .map_err(|err| self.invalid(join(field, "value"), err.to_string()))?;
        let output_file = self.string(obj, field, "output_file")?;
        if let Some(name) = output_file {
            crate::fetch::check_output_file(name)
                .map_err(|err| self.invalid(join(field, "output_file"), err.to_string()))?;
        }
        Ok(UriConfig {
            value: text.to_owned(),
            executable: self.boolean(obj, field, "executable")?.unwrap_or(false),
            extract: self.boolean(obj, field, "extract")?.unwrap_or(true),
            cache: self.boolean(obj, field, "cache")?.unwrap_or(false),
            output_file: output_file.map(str::to_owned),
        })
    }

    fn environment(&self, value: &Value, prefix: &str) -> Result<Vec<EnvVar>, ConfigError> {
        let obj = self.object(value, prefix)?;
        self.check_keys(obj, prefix, &["variables"])?;
        let mut vars = Vec::new();
        for (index, item) in self
            .array(obj, prefix, "variables")?
            .unwrap_or_default()
            .iter()
            .enumerate()
        {
            let field = format!("{prefix}.variables[{index}]");
            let var = self.object(item, &field)?;
            self.check_keys(var, &field, &["name", "value", "type", "secret"])?;
            let secret = match self.string(var, &field, "type")? {
                None | Some("VALUE") => {
                    if var.get("secret").is_some_and(|s| !s.is_null()) {
                        return Err(self.invalid(
                            join(&field, "secret"),
                            "is only for \"type\": \"SECRET\"; set the type, or give `value` instead",
                        ));
                    }
                    false
                }
                Some("SECRET") => true,
                Some(other) => {
                    return Err(self.invalid(
                        join(&field, "type"),
                        format!("\"{other}\" is not a variable type; use \"VALUE\" or \"SECRET\""),
                    ));
                }
            };
            let name = self.string(var, &field, "name")?.unwrap_or_default();
            if name.is_empty() || name.contains('=') || name.contains('\0') {
                return Err(self.invalid(
                    join(&field, "name"),
                    "must be a non-empty variable name without '=' or NUL",
                ));
            }
            let (value, reference) = if secret {
                if var.get("value").is_some_and(|v| !v.is_null()) {
                    return Err(self.invalid(
                        join(&field, "value"),
                        "a SECRET variable takes its value from `secret`, not `value`; remove one",
                    ));
                }
                match env_secret::secret(var.get("secret"))
                    .map_err(|(key, message)| self.invalid(join(&field, &key), message))?
                {
                    env_secret::Secret::Value(value) => (value, None),
                    env_secret::Secret::Reference(reference) => (String::new(), Some(reference)),
                }
            } else {
                let value = self.string(var, &field, "value")?.unwrap_or_default();
                (value.to_owned(), None)
            };
            if value.contains('\0') {
                // Never the value itself in the message: it may be a secret.
                return Err(self.invalid(join(&field, "value"), "must not contain NUL"));
            }
            vars.push(EnvVar {
                name: name.to_owned(),
                value,
                secret,
                reference,
            });
        }
        Ok(vars)
    }

    fn endpoints(&self, items: &[Value]) -> Result<Vec<EndpointConfig>, ConfigError> {
        let mut endpoints: Vec<EndpointConfig> = Vec::new();
        for (index, item) in items.iter().enumerate() {
            let prefix = format!("endpoints[{index}]");
            let obj = self.object(item, &prefix)?;
            self.check_keys(obj, &prefix, &["csi_service", "endpoint"])?;
            let service = match obj.get("csi_service") {
                None | Some(Value::Null) => {
                    return Err(self.invalid(
                        join(&prefix, "csi_service"),
                        "is required: \"CONTROLLER_SERVICE\" or \"NODE_SERVICE\"",
                    ));
                }
                Some(value) => self.service(value, &join(&prefix, "csi_service"))?,
            };
            let text = self.string(obj, &prefix, "endpoint")?.ok_or_else(|| {
                self.invalid(
                    join(&prefix, "endpoint"),
                    "is required: unix:///absolute/path or /absolute/path of the plugin's socket",
                )
            })?;
            let socket = parse_endpoint(text)
                .map_err(|err| self.invalid(join(&prefix, "endpoint"), err.to_string()))?;
            if endpoints.iter().any(|e| e.service == service) {
                // docs/configuration.md: the first one listing a service serves it.
                tracing::warn!(
                    file = %self.file.display(),
                    "{prefix}: {service} already has an endpoint; this one is ignored"
                );
                continue;
            }
            endpoints.push(EndpointConfig { service, socket });
        }
        Ok(endpoints)
    }
}

fn join(prefix: &str, key: &str) -> String {
    if prefix.is_empty() {
        key.to_owned()
    } else {
        format!("{prefix}.{key}")
    }
}

fn kind(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "a list",
        Value::Object(_) => "an object",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<PluginConfig, ConfigError> {
        parse_config(Path::new("x.json"), text)
    }

    #[test]
    #[allow(clippy::unwrap_used)]
    fn uris_take_mesos_defaults_and_bad_ones_name_their_field() {
        let config = parse(
            r#"{"type": "t", "containers": [{"services": ["NODE_SERVICE"],
                "command": {"value": "./p", "uris": [
                    {"value": "http://127.0.0.1:1/p", "executable": true},
                    {"value": "/opt/p.tar.gz", "cache": true, "output_file": "q.tgz"}]}}]}"#,
        )
        .unwrap();
        let Deployment::Managed(components) = &config.deployment else {
            panic!("not managed");
        };
        let uris = &components[0].command.uris;
        assert_eq!(uris.len(), 2);
        assert!(uris[0].executable && uris[0].extract && !uris[0].cache);
        assert!(!uris[1].executable && uris[1].extract && uris[1].cache);
        assert_eq!(uris[1].output_file.as_deref(), Some("q.tgz"));
        for (uri, field) in [
            (
                r#"{"value": "ftp://h/p"}"#,
                "containers[0].command.uris[1].value",
            ),
            (r#"{"value": "p"}"#, "containers[0].command.uris[1].value"),
            (
                r#"{"value": "/p", "output_file": "../x"}"#,
                "containers[0].command.uris[1].output_file",
            ),
            (
                r#"{"value": "/p", "exec": true}"#,
                "containers[0].command.uris[1].exec",
            ),
        ] {
            let text = format!(
                r#"{{"type": "t", "containers": [{{"services": ["NODE_SERVICE"],
                    "command": {{"value": "./p", "uris": [{{"value": "/ok"}}, {uri}]}}}}]}}"#
            );
            match parse(&text) {
                Err(ConfigError::Invalid { field: got, .. }) => assert_eq!(got, field, "{uri}"),
                other => panic!("{uri}: {other:?}"),
            }
        }
        // A user cannot reach the sandbox the uris are fetched into: refused, naming `user`.
        match parse(
            r#"{"type": "t", "containers": [{"services": ["NODE_SERVICE"],
                "command": {"value": "./p", "user": "nobody", "uris": [{"value": "/ok"}]}}]}"#,
        ) {
            Err(ConfigError::Invalid { field, message, .. }) => {
                assert_eq!(field, "containers[0].command.user");
                assert!(message.contains("uris"), "{message}");
            }
            other => panic!("user with uris: {other:?}"),
        }
    }

    #[test]
    #[allow(clippy::unwrap_used)]
    fn isolation_without_an_image_runs_in_a_container_and_is_validated_anyway() {
        let component = |extra: &str| {
            format!(r#"{{"services": ["NODE_SERVICE"], "command": {{"value": "./p"}}{extra}}}"#)
        };
        let with = |extra: &str, runtime: &str| {
            parse(&format!(
                r#"{{"type": "t", {runtime} "containers": [{}]}}"#,
                component(extra)
            ))
        };
        // Asking for nothing (a bare container type, a disk resource): the process runtime.
        for nothing in [
            "",
            r#", "container": {"type": "MESOS", "volumes": []}"#,
            r#", "resources": [{"name": "disk", "type": "SCALAR", "scalar": {"value": 10}}]"#,
        ] {
            assert_eq!(
                with(nothing, "").unwrap().runtime,
                RuntimeConfig::Process,
                "{nothing}"
            );
        }
        // Asking for any isolation: a container on the host's root.
        for asking in [
            r#", "resources": [{"name": "mem", "type": "SCALAR", "scalar": {"value": 64}}]"#,
            r#", "container": {"volumes": [{"container_path": "/d", "host_path": "/srv"}]}"#,
            r#", "container": {"linux_info": {"effective_capabilities": {"capabilities": ["CHOWN"]}}}"#,
            r#", "container": {"rlimit_info": {"rlimits": [{"type": "RLMT_NOFILE"}]}}"#,
            r#", "container": {"hostname": "plugin"}"#,
        ] {
            assert_eq!(
                with(asking, "").unwrap().runtime,
                RuntimeConfig::Oci(OciConfig::default()),
                "{asking}"
            );
            // An explicit process runtime keeps it.
            assert_eq!(
                with(asking, r#""runtime": {"kind": "process"},"#)
                    .unwrap()
                    .runtime,
                RuntimeConfig::Process
            );
        }
        // Validated whichever runtime: a bad capability, a NaN-free negative cpus, an
        // unknown rlimit each name their field, under the process runtime too.
        for (bad, field) in [
            (
                r#", "container": {"linux_info": {"effective_capabilities": {"capabilities": ["CHOWN", "CAP_FLY"]}}}"#,
                "containers[0].container.linux_info.effective_capabilities.capabilities[1]",
            ),
            (
                r#", "resources": [{"name": "cpus", "type": "SCALAR", "scalar": {"value": -0.5}}]"#,
                "containers[0].resources[0].scalar.value",
            ),
            (
                r#", "container": {"rlimit_info": {"rlimits": [{"type": "RLMT_FLY"}]}}"#,
                "containers[0].container.rlimit_info.rlimits[0].type",
            ),
        ] {
            for runtime in ["", r#""runtime": {"kind": "process"},"#] {
                match with(bad, runtime) {
                    Err(ConfigError::Invalid { field: got, .. }) => assert_eq!(got, field),
                    other => panic!("{bad} {runtime}: {other:?}"),
                }
            }
        }
    }

    #[test]
    #[allow(clippy::unwrap_used)]
    fn a_config_naming_an_image_runs_it_with_the_oci_runtime() {
        let image = r#"{"type": "MESOS", "mesos": {"image": {"type": "DOCKER",
            "docker": {"name": "org/plugin:1"}}}}"#;
        // No runtime and no command: the oci runtime and the image's Entrypoint/Cmd.
        let config = parse(&format!(
            r#"{{"type": "t", "containers": [{{"services": ["NODE_SERVICE"], "container": {image}}}]}}"#
        ))
        .unwrap();
        assert_eq!(config.runtime, RuntimeConfig::Oci(OciConfig::default()));
        let Deployment::Managed(components) = &config.deployment else {
            panic!("not managed");
        };
        assert_eq!(components[0].command, CommandConfig::default());
        // Docker-containerizer style too, with only an environment in the command.
        let config = parse(
            r#"{"type": "t", "containers": [{"services": ["NODE_SERVICE"],
                "command": {"environment": {"variables": [{"name": "A", "value": "1"}]}},
                "container": {"type": "DOCKER", "docker": {"image": "busybox"}}}]}"#,
        )
        .unwrap();
        assert_eq!(config.runtime.kind(), "oci");
        // A rootfs without a kind is a container too.
        let config = parse(
            r#"{"type": "t", "runtime": {"rootfs": "/img"},
                "containers": [{"services": ["NODE_SERVICE"], "command": {"value": "/p"}}]}"#,
        )
        .unwrap();
        assert_eq!(config.runtime.kind(), "oci");

        let field = |text: String| match parse(&text) {
            Err(ConfigError::Invalid { field, .. }) => field,
            other => panic!("expected an invalid field, got {other:?}"),
        };
        let component = |container: &str| {
            format!(r#""containers": [{{"services": ["NODE_SERVICE"], "container": {container}}}]"#)
        };
        // An explicit "process" runtime cannot run an image.
        assert_eq!(
            field(format!(
                r#"{{"type": "t", "runtime": {{"kind": "process"}}, {}}}"#,
                component(image)
            )),
            "containers[0].container"
        );
        // Two roots.
        assert_eq!(
            field(format!(
                r#"{{"type": "t", "runtime": {{"kind": "oci", "rootfs": "/img"}}, {}}}"#,
                component(image)
            )),
            "containers[0].container"
        );
        // Bad references, named by field.
        assert_eq!(
            field(format!(
                r#"{{"type": "t", {}}}"#,
                component(
                    r#"{"mesos": {"image": {"type": "DOCKER", "docker": {"name": "Bad:"}}}}"#
                )
            )),
            "containers[0].container.mesos.image.docker.name"
        );
        assert_eq!(
            field(format!(
                r#"{{"type": "t", {}}}"#,
                component(r#"{"type": "DOCKER", "docker": {"image": "a@sha256:12"}}"#)
            )),
            "containers[0].container.docker.image"
        );
        // Without an image, a command is still required.
        assert_eq!(
            field(r#"{"type": "t", "containers": [{"services": ["NODE_SERVICE"]}]}"#.to_owned()),
            "containers[0].command"
        );
    }

    #[test]
    fn minimal_managed_plugin_gets_defaults() -> anyhow::Result<()> {
        let config = parse(
            r#"{"type": "org.example.test",
                "containers": [{"services": ["NODE_SERVICE"], "command": {"value": "/bin/plugin"}}]}"#,
        )?;
        assert_eq!(config.name, "default");
        assert_eq!(config.runtime, RuntimeConfig::Process);
        assert_eq!(config.startup_timeout, DEFAULT_STARTUP_TIMEOUT);
        assert_eq!(config.restart_backoff, DEFAULT_BACKOFF);
        let Deployment::Managed(components) = &config.deployment else {
            anyhow::bail!("not managed");
        };
        assert!(components[0].command.shell, "Mesos default is shell=true");
        Ok(())
    }

    #[test]
    fn first_component_listing_a_service_serves_it() -> anyhow::Result<()> {
        let config = parse(
            r#"{"type": "t", "containers": [
                {"services": ["NODE_SERVICE", "NODE_SERVICE"], "command": {"value": "a"}},
                {"services": ["CONTROLLER_SERVICE", "NODE_SERVICE"], "command": {"value": "b"}},
                {"services": ["CONTROLLER_SERVICE"], "command": {"value": "c"}}]}"#,
        )?;
        let Deployment::Managed(components) = &config.deployment else {
            anyhow::bail!("not managed");
        };
        assert_eq!(components.len(), 2);
        assert_eq!(components[0].services, vec![Service::Node]);
        assert_eq!(
            components[1].services,
            vec![Service::Controller, Service::Node]
        );
        assert_eq!(components[1].serves, vec![Service::Controller]);
        Ok(())
    }

    #[test]
    fn argv_follows_mesos_semantics() {
        let mut cmd = CommandConfig {
            value: "/bin/plugin".into(),
            arguments: vec![],
            shell: false,
            environment: vec![],
            uris: vec![],
            user: None,
        };
        assert_eq!(cmd.argv(&[]).1, vec!["/bin/plugin"]);
        cmd.arguments = vec![
            "plugin".into(),
            "--endpoint=$CSI_ENDPOINT".into(),
            "${CSI_NODE_ID}x".into(),
            "$CSI_ENDPOINTS".into(),
        ];
        let vars = [("CSI_ENDPOINT", "unix:///s"), ("CSI_NODE_ID", "n1")];
        let (program, argv) = cmd.argv(&vars);
        assert_eq!(program, "/bin/plugin");
        assert_eq!(
            argv,
            vec!["plugin", "--endpoint=unix:///s", "n1x", "$CSI_ENDPOINTS"]
        );
        cmd.shell = true;
        cmd.value = "exec plugin --endpoint=$CSI_ENDPOINT".into();
        assert_eq!(
            cmd.argv(&vars),
            (
                "/bin/sh".to_owned(),
                vec![
                    "sh".to_owned(),
                    "-c".to_owned(),
                    "exec plugin --endpoint=$CSI_ENDPOINT".to_owned()
                ]
            )
        );
    }

    #[test]
    fn backoff_is_immediate_then_doubles_to_the_cap() {
        let backoff = RestartBackoff {
            initial: Duration::from_millis(100),
            max: Duration::from_millis(350),
            reset_after: Duration::from_secs(1),
        };
        let delays: Vec<u128> = (1..=6).map(|n| backoff.delay(n).as_millis()).collect();
        assert_eq!(delays, vec![0, 100, 200, 350, 350, 350]);
        assert_eq!(backoff.delay(200), Duration::from_millis(350));
    }

    #[test]
    fn endpoints_accept_unix_urls_and_bare_paths_only() {
        assert_eq!(
            parse_endpoint("unix:///run/x.sock"),
            Ok(PathBuf::from("/run/x.sock"))
        );
        assert_eq!(
            parse_endpoint("/run/x.sock"),
            Ok(PathBuf::from("/run/x.sock"))
        );
        for bad in ["unix://run/x.sock", "tcp://1.2.3.4:5", "x.sock", ""] {
            assert!(parse_endpoint(bad).is_err(), "{bad}");
        }
        let long = format!("/{}", "a".repeat(120));
        assert!(
            parse_endpoint(&long).is_err_and(|e| matches!(e, EndpointConfigError::TooLong { .. })
                && e.to_string().contains("at most 107"))
        );
    }

    #[test]
    fn oci_runtime_settings_parse_and_bad_ones_name_their_field() -> anyhow::Result<()> {
        let config = parse(
            r#"{"type": "t", "runtime": {"kind": "oci", "rootfs": "/img", "privileged": false,
                "capabilities": ["sys_admin", "CAP_MKNOD"], "readonly_rootfs": false,
                "host_network": false, "host_pid": true},
                "containers": [{"services": ["NODE_SERVICE"], "command": {"value": "/p"},
                  "container": {"volumes": [{"container_path": "/s", "host_path": "/h"}]}}]}"#,
        )?;
        assert_eq!(
            config.runtime,
            RuntimeConfig::Oci(OciConfig {
                rootfs: Some(PathBuf::from("/img")),
                privileged: Some(false),
                capabilities: Some(vec!["CAP_SYS_ADMIN".into(), "CAP_MKNOD".into()]),
                readonly_rootfs: Some(false),
                host_network: Some(false),
                host_pid: Some(true),
            })
        );
        let field = |text: &str| match parse(text) {
            Err(ConfigError::Invalid { field, .. }) => field,
            other => panic!("expected an invalid field, got {other:?}"),
        };
        let component =
            r#""containers": [{"services": ["NODE_SERVICE"], "command": {"value": "/p"}}]"#;
        assert_eq!(
            field(&format!(
                r#"{{"type": "t", "runtime": {{"kind": "oci", "rootfs": "img"}}, {component}}}"#
            )),
            "runtime.rootfs"
        );
        assert_eq!(
            field(&format!(
                r#"{{"type": "t", "runtime": {{"kind": "oci", "capabilities": ["CAP_NOPE"]}}, {component}}}"#
            )),
            "runtime.capabilities[0]"
        );
        assert_eq!(
            field(&format!(
                r#"{{"type": "t", "runtime": {{"kind": "oci", "rootfss": "/x"}}, {component}}}"#
            )),
            "runtime.rootfss"
        );
        assert_eq!(
            field(
                r#"{"type": "t", "runtime": {"kind": "oci"}, "containers": [{"services": ["NODE_SERVICE"],
                    "command": {"value": "/p"}, "container": {"volumes": [{"container_path": "/s"}]}}]}"#
            ),
            "containers[0].container.volumes[0].host_path"
        );
        Ok(())
    }

    #[test]
    #[allow(clippy::unwrap_used)]
    fn a_command_user_is_kept_and_a_malformed_one_names_its_field() {
        let with = |user: &str| {
            parse(&format!(
                r#"{{"type": "t", "containers": [{{"services": ["NODE_SERVICE"],
                    "command": {{"value": "/p", "user": {user}}}}}]}}"#
            ))
        };
        let config = with(r#""nobody""#).unwrap();
        let Deployment::Managed(components) = &config.deployment else {
            panic!("not managed");
        };
        assert_eq!(components[0].command.user.as_deref(), Some("nobody"));
        // Serialized (and hashed) only when set: existing launch specs keep their hash.
        let mut command = components[0].command.clone();
        assert!(
            serde_json::to_string(&command)
                .unwrap()
                .contains(r#""user":"nobody""#)
        );
        command.user = None;
        assert!(!serde_json::to_string(&command).unwrap().contains("user"));
        for bad in [r#""""#, r#""a:b""#, r#""a\nb""#, "1"] {
            match with(bad) {
                Err(ConfigError::Invalid { field, .. }) => {
                    assert_eq!(field, "containers[0].command.user", "{bad}");
                }
                other => panic!("{bad}: expected an invalid field, got {other:?}"),
            }
        }
    }

    #[test]
    #[allow(clippy::unwrap_used)]
    fn a_secret_variable_is_decoded_and_redacted_wherever_shown() {
        let with = |var: &str| {
            parse(&format!(
                r#"{{"type": "t", "containers": [{{"services": ["NODE_SERVICE"],
                    "command": {{"value": "/p", "environment": {{"variables": [{var}]}}}}}}]}}"#
            ))
        };
        let config = with(
            r#"{"name": "TOKEN", "type": "SECRET",
                "secret": {"type": "VALUE", "value": {"data": "aHVudGVyMg=="}}}"#,
        )
        .unwrap();
        let Deployment::Managed(components) = &config.deployment else {
            panic!("not managed");
        };
        let var = &components[0].command.environment[0];
        assert_eq!((var.value.as_str(), var.secret), ("hunter2", true));
        for shown in [
            format!("{config:?}"),
            serde_json::to_string(&components[0].command).unwrap(),
        ] {
            assert!(!shown.contains("hunter2"), "{shown}");
            assert!(shown.contains(REDACTED), "{shown}");
        }
        // A plain variable serializes as before secrets existed (launch spec hashes hold).
        assert_eq!(
            serde_json::to_string(&EnvVar::plain("A", "1")).unwrap(),
            r#"{"name":"A","value":"1"}"#
        );
        let field = |var: &str| match with(var) {
            Err(ConfigError::Invalid { field, message, .. }) => {
                assert!(!message.contains("aHVudGVyMg"), "{message}");
                field
            }
            other => panic!("expected an invalid field, got {other:?}"),
        };
        let prefix = "containers[0].command.environment.variables[0]";
        assert_eq!(
            field(
                r#"{"name": "T", "type": "SECRET", "value": "x", "secret": {"type": "VALUE", "value": {"data": "aHVudGVyMg=="}}}"#
            ),
            format!("{prefix}.value")
        );
        assert_eq!(
            field(
                r#"{"name": "T", "value": "x", "secret": {"type": "VALUE", "value": {"data": "aHVudGVyMg=="}}}"#
            ),
            format!("{prefix}.secret")
        );
        assert_eq!(
            field(
                r#"{"name": "T", "type": "SECRET", "secret": {"type": "REFERENCE", "reference": {"name": "a", "key": "../b"}}}"#
            ),
            format!("{prefix}.secret.reference.key")
        );
        // A reference is kept as such, its value read at launch; it is shown and hashed.
        let config = with(
            r#"{"name": "T", "type": "SECRET", "secret": {"type": "REFERENCE", "reference": {"name": "a", "key": "b"}}}"#,
        )
        .unwrap();
        let Deployment::Managed(components) = &config.deployment else {
            panic!("not managed");
        };
        let var = &components[0].command.environment[0];
        assert_eq!(var.value, "");
        assert!(var.secret);
        assert_eq!(
            serde_json::to_string(var).unwrap(),
            r#"{"name":"T","value":"<redacted>","secret":true,"reference":{"name":"a","key":"b"}}"#
        );
        assert_eq!(
            field(r#"{"name": "T", "type": "UNKNOWN", "value": "x"}"#),
            format!("{prefix}.type")
        );
    }

    #[test]
    fn names_are_bounded_and_safe() {
        for good in ["org.example.lvm", "a", "A-b_c.9"] {
            assert!(validate_name(good).is_ok(), "{good}");
        }
        for bad in [
            "",
            ".hidden",
            "..",
            "a/b",
            "a b",
            "é",
            &"x".repeat(MAX_NAME_LEN + 1),
        ] {
            assert!(validate_name(bad).is_err(), "{bad}");
        }
    }
}
