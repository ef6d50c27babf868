//! The `oci` runtime: a component is a real container run by an OCI runtime (`runc`, or
//! `crun`, which takes the same command line).
//!
//! This module owns the component's OCI bundle (`containers/<id>/bundle/`), the runc
//! command lines, the container's state root and the shared propagation of the plugin's
//! mount root. Like every runtime it must not decide when to launch, restart or stop
//! (the service manager does), must not write component records, and must not use `unsafe`.
//!
//! - **Launch**: any leftover container of the same id is deleted; the bundle is written
//!   (`config.json` from [`bundle::spec`]); `runc create` with the component's `stdout`
//!   and `stderr` files as the container's stdio, then `runc start`. The container id is
//!   the component id (already made of `[A-Za-z0-9._-]` only; see [`container_id`]).
//! - **State root**: `runc --root <socket root>/runc` (so `/run/csi-agent/runc` for root):
//!   on tmpfs, so it vanishes at a reboot with the containers, and private to csi-agent,
//!   so `runc --root /run/csi-agent/runc list` shows exactly csi-agent's containers.
//! - **What the plugin sees**: see [`bundle::spec`]. The plugin's `mounts/` dir (every
//!   staging and target path csi-agent hands it) is made a shared mount on the host (a bind
//!   onto itself, `make-rshared`) and bound at the same path in the container with
//!   `rshared`, so a mount the plugin makes inside appears on the host, and its unmount
//!   disappears there. [`release_mount_root`] undoes the self-bind once the plugin stops.
//! - **Images**: a component whose `container` names an image (`mesos.image` or
//!   `docker.image`) is pulled and prepared through the daemon's
//!   [`crate::image::store::ImageStore`] before `runc create` (a failure is a failed launch:
//!   reported on the plugin and retried with the restart backoff). With overlayfs, the
//!   container's root is an overlay of the image's shared layer dirs under an upper dir of
//!   its own (`bundle/overlay/`), mounted at `bundle/rootfs` before `runc create` and
//!   unmounted (its upper removed) whenever the bundle is; `readonly_rootfs` applies.
//!   Without, the image's flattened rootfs is the root, always read-only (every container of
//!   the image shares it). The
//!   image's Entrypoint/Cmd apply unless the config's `command` overrides them
//!   ([`image_argv`]); its Env replaces the daemon's environment, over a default `PATH` and
//!   `HOME` ([`rootpaths::image_environment`]); its numeric User applies, and its
//!   WorkingDir once resolved beneath the root. Every mount destination in a root of the
//!   container's own (an image's, a configured rootfs) is walked beneath it without
//!   following its symlinks before `runc create` ([`rootpaths`]).
//! - **Identity**: container id, plus the init's pid and start time and the boot id (so a
//!   reused pid is never taken for the container).
//! - **Watching**: a pidfd on the container's init, readable once it exits; it is not our
//!   child (runc's), so its exit status is unknown.
//! - **Stopping**: `runc kill <id> SIGTERM`, `SIGKILL` after the grace period, then
//!   `runc delete --force` and the bundle removed: nothing is left in `runc list`, in the
//!   mount table or in the cgroup hierarchy.
//! - **Adoption**: `runc state <id>`: a running container whose init is the recorded
//!   process is adopted; anything else is deleted (and relaunched by the service manager).

use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::FutureExt;
use futures::future::BoxFuture;
use rustix::io::Errno;
use rustix::process::{Pid, PidfdFlags, pidfd_open};
use serde_json::Value;
use tokio::io::unix::AsyncFd;

use super::isolation::{self, Isolation};
use super::process::{current_boot_id, read_stat};
use super::{Component, ExitInfo, LaunchContext, LaunchSpec, Runtime, RuntimeError, RuntimeHandle};
use crate::config::{CommandConfig, OciConfig, RuntimeConfig, Service};
use crate::image::reference::ContainerImage;
use crate::image::store::{ImageConfig, ImageStore, ImageStoreError, Prepared, PreparedRoot};
use crate::mounts::MountTable;

pub mod bundle;
pub mod rootpaths;
pub mod runc;

pub use runc::{ContainerState, Runc, RuncError};

/// The default OCI runtime binary (looked up in `PATH`).
pub const DEFAULT_OCI_RUNTIME: &str = "runc";
/// The bundle dir inside a component's container dir.
pub const BUNDLE_DIR: &str = "bundle";
/// The state root's name inside the socket root.
pub const STATE_ROOT_DIR: &str = "runc";
/// The dir of a container's overlay upper and work dirs, inside its bundle.
pub const OVERLAY_DIR: &str = "overlay";
/// Failpoints of a launch: after the image's overlay is mounted (before the bundle), after
/// `runc create` (a created, never started container) and after `runc start` (running, but
/// no component record yet).
pub const FP_AFTER_OVERLAY: &str = "oci.launch.after_overlay";
pub const FP_AFTER_CREATE: &str = "oci.launch.after_create";
pub const FP_AFTER_START: &str = "oci.launch.after_start";

/// Every capability oci-spec and runc know, by number (capabilities(7)): what a privileged
/// component gets, less what csi-agent itself does not hold.
pub const ALL_CAPABILITIES: &[&str] = &[
    "CAP_CHOWN",
    "CAP_DAC_OVERRIDE",
    "CAP_DAC_READ_SEARCH",
    "CAP_FOWNER",
    "CAP_FSETID",
    "CAP_KILL",
    "CAP_SETGID",
    "CAP_SETUID",
    "CAP_SETPCAP",
    "CAP_LINUX_IMMUTABLE",
    "CAP_NET_BIND_SERVICE",
    "CAP_NET_BROADCAST",
    "CAP_NET_ADMIN",
    "CAP_NET_RAW",
    "CAP_IPC_LOCK",
    "CAP_IPC_OWNER",
    "CAP_SYS_MODULE",
    "CAP_SYS_RAWIO",
    "CAP_SYS_CHROOT",
    "CAP_SYS_PTRACE",
    "CAP_SYS_PACCT",
    "CAP_SYS_ADMIN",
    "CAP_SYS_BOOT",
    "CAP_SYS_NICE",
    "CAP_SYS_RESOURCE",
    "CAP_SYS_TIME",
    "CAP_SYS_TTY_CONFIG",
    "CAP_MKNOD",
    "CAP_LEASE",
    "CAP_AUDIT_WRITE",
    "CAP_AUDIT_CONTROL",
    "CAP_SETFCAP",
    "CAP_MAC_OVERRIDE",
    "CAP_MAC_ADMIN",
    "CAP_SYSLOG",
    "CAP_WAKE_ALARM",
    "CAP_BLOCK_SUSPEND",
    "CAP_AUDIT_READ",
    "CAP_PERFMON",
    "CAP_BPF",
    "CAP_CHECKPOINT_RESTORE",
];

/// The capabilities csi-agent itself may hand on: its bounding set (`CapBnd` of
/// `/proc/self/status`). A container cannot get more (runc fails with EPERM), and hosts
/// differ (a sandbox may drop `CAP_SYS_RESOURCE`, an old kernel lacks `CAP_BPF`). `None`
/// when it cannot be read.
pub fn own_capabilities() -> Option<Vec<&'static str>> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let hex = status
        .lines()
        .find_map(|line| line.strip_prefix("CapBnd:"))?
        .trim();
    let mask = u64::from_str_radix(hex, 16).ok()?;
    Some(
        ALL_CAPABILITIES
            .iter()
            .enumerate()
            .filter(|(bit, _)| mask & (1u64 << bit) != 0)
            .map(|(_, name)| *name)
            .collect(),
    )
}

/// The capabilities of an unprivileged component without a `capabilities` list: the set
/// container engines usually grant.
pub const DEFAULT_CAPABILITIES: &[&str] = &[
    "CAP_AUDIT_WRITE",
    "CAP_CHOWN",
    "CAP_DAC_OVERRIDE",
    "CAP_FOWNER",
    "CAP_FSETID",
    "CAP_KILL",
    "CAP_MKNOD",
    "CAP_NET_BIND_SERVICE",
    "CAP_NET_RAW",
    "CAP_SETFCAP",
    "CAP_SETGID",
    "CAP_SETPCAP",
    "CAP_SETUID",
    "CAP_SYS_CHROOT",
];

/// `CAP_SYS_ADMIN` for `CAP_SYS_ADMIN`, `SYS_ADMIN` or `sys_admin`; `None` for a name that
/// is no capability.
pub fn canonical_capability(name: &str) -> Option<String> {
    let capability: oci_spec::runtime::Capability =
        serde_json::from_value(Value::String(name.to_owned())).ok()?;
    match serde_json::to_value(capability).ok()? {
        Value::String(canonical) => Some(canonical),
        _ => None,
    }
}

/// The container id of a component id: runc accepts `[A-Za-z0-9_+.-]`; component ids are
/// built from validated names and so already are, but anything else becomes `_`.
pub fn container_id(component_id: &str) -> String {
    component_id
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '_' | '+' | '-' | '.') {
                c
            } else {
                '_'
            }
        })
        .collect()
}

/// One entry of Mesos `ContainerInfo.volumes`, as a bind mount into the container.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VolumeBind {
    pub container_path: PathBuf,
    pub host_path: PathBuf,
    pub readonly: bool,
    /// `mount_propagation.mode: BIDIRECTIONAL`: mounts made inside appear on the host.
    pub bidirectional: bool,
}

/// Parses `container.volumes` (Mesos `Volume`: `container_path`, `host_path` or
/// `source: {type: HOST_PATH, host_path: {path, mount_propagation: {mode}}}`, `mode`
/// `RW`/`RO`). An error is `(field relative to the container object, message)`.
pub fn volumes(container: &Value) -> Result<Vec<VolumeBind>, (String, String)> {
    let Some(items) = container.get("volumes") else {
        return Ok(Vec::new());
    };
    let Some(items) = items.as_array() else {
        return Err(("volumes".to_owned(), "must be a list".to_owned()));
    };
    let mut binds = Vec::new();
    for (index, item) in items.iter().enumerate() {
        let field = |key: &str| format!("volumes[{index}].{key}");
        let absolute = |key: &str, value: Option<&Value>| -> Result<PathBuf, (String, String)> {
            match value.and_then(Value::as_str) {
                Some(path) if path.starts_with('/') => Ok(PathBuf::from(path)),
                Some(path) => Err((field(key), format!("\"{path}\" must be an absolute path"))),
                None => Err((field(key), "is required (an absolute path)".to_owned())),
            }
        };
        let container_path = absolute("container_path", item.get("container_path"))?;
        let source_host = item
            .get("source")
            .and_then(|s| s.get("host_path"))
            .filter(|h| h.is_object());
        let (host_path, bidirectional) = match (item.get("host_path"), source_host) {
            (Some(path), _) => (absolute("host_path", Some(path))?, false),
            (None, Some(host)) => {
                let path = absolute("source.host_path.path", host.get("path"))?;
                let mode = host
                    .get("mount_propagation")
                    .and_then(|p| p.get("mode"))
                    .and_then(Value::as_str)
                    .unwrap_or("HOST_TO_CONTAINER");
                let bidirectional = match mode {
                    "BIDIRECTIONAL" => true,
                    "HOST_TO_CONTAINER" => false,
                    other => {
                        return Err((
                            field("source.host_path.mount_propagation.mode"),
                            format!(
                                "\"{other}\" is not a propagation mode; use HOST_TO_CONTAINER or BIDIRECTIONAL"
                            ),
                        ));
                    }
                };
                (path, bidirectional)
            }
            (None, None) => {
                return Err((
                    field("host_path"),
                    "is required: the host dir to bind (or source.host_path.path)".to_owned(),
                ));
            }
        };
        let readonly = match item.get("mode").and_then(Value::as_str) {
            None | Some("RW") => false,
            Some("RO") => true,
            Some(other) => {
                return Err((
                    field("mode"),
                    format!("\"{other}\" is not a mode; use RW or RO"),
                ));
            }
        };
        binds.push(VolumeBind {
            container_path,
            host_path,
            readonly,
            bidirectional,
        });
    }
    Ok(binds)
}

/// The cgroup limits of a component, from Mesos `resources` (`cpus`, `mem` in MB).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Limits {
    pub cpus: Option<f64>,
    pub mem_mb: Option<f64>,
}

/// The smallest memory limit a container starts with (runc, its init and a small plugin).
pub const MIN_MEM_MB: f64 = 8.0;
/// The smallest CPU share: a CFS quota of 1 ms per 100 ms period.
pub const MIN_CPUS: f64 = 0.01;
/// The CFS period the CPU quota is a share of.
pub const CPU_PERIOD_US: u64 = 100_000;

/// Parses the `cpus` and `mem` of Mesos `resources` (`[{name, type: SCALAR, scalar:
/// {value}}]`); other resources (`disk`, `ports`, ...) have no cgroup limit and are ignored.
/// An error is `(field relative to the component, message)`.
pub fn limits(resources: &[Value]) -> Result<Limits, (String, String)> {
    let mut limits = Limits::default();
    for (index, resource) in resources.iter().enumerate() {
        let field = format!("resources[{index}]");
        let Some(name) = resource.get("name").and_then(Value::as_str) else {
            return Err((
                format!("{field}.name"),
                "is required (\"cpus\" or \"mem\")".to_owned(),
            ));
        };
        if !matches!(name, "cpus" | "mem") {
            continue;
        }
        let value = resource
            .get("scalar")
            .and_then(|s| s.get("value"))
            .and_then(Value::as_f64)
            .filter(|v| v.is_finite() && *v > 0.0)
            .ok_or_else(|| {
                (
                    format!("{field}.scalar.value"),
                    format!("{name} needs a positive number"),
                )
            })?;
        match name {
            "cpus" if value < MIN_CPUS => {
                return Err((
                    format!("{field}.scalar.value"),
                    format!("cpus {value} is below the smallest CPU limit, {MIN_CPUS}"),
                ));
            }
            "cpus" => limits.cpus = Some(value),
            _ if value < MIN_MEM_MB => {
                return Err((
                    format!("{field}.scalar.value"),
                    format!(
                        "mem {value} MB is below the {MIN_MEM_MB} MB a container needs to start"
                    ),
                ));
            }
            _ => limits.mem_mb = Some(value),
        }
    }
    Ok(limits)
}

/// The controllers of the cgroup v2 part of a hybrid cgroup hierarchy (v1 hierarchies under
/// `/sys/fs/cgroup`, cgroup v2 at `/sys/fs/cgroup/unified`), as its `cgroup.controllers`
/// lists them; `None` on a pure v1 or v2 host, or when the v2 part has none.
pub fn hybrid_cgroup_v2_controllers() -> Option<Vec<String>> {
    let root = Path::new("/sys/fs/cgroup");
    if root.join("cgroup.controllers").exists() {
        return None;
    }
    let listed = std::fs::read_to_string(root.join("unified/cgroup.controllers")).ok()?;
    let controllers: Vec<String> = listed.split_whitespace().map(str::to_owned).collect();
    (!controllers.is_empty()).then_some(controllers)
}

/// What crun answers, at `create`, for every container on a hybrid cgroup hierarchy whose
/// cgroup v2 part has controllers (its libcrun checks `unified/cgroup.controllers`).
const CRUN_HYBRID_REFUSAL: &str = "cgroups in hybrid mode not supported";

/// A failed `create`, said plainly when the runtime refused this host's cgroup layout rather
/// than the container (crun on a hybrid hierarchy with v2 controllers; see
/// [`OciError::HybridCgroups`]).
fn explain_create_failure(runc: &Runc, err: RuncError) -> OciError {
    if let RuncError::Failed { message, .. } = &err
        && message.contains(CRUN_HYBRID_REFUSAL)
        && let Some(controllers) = hybrid_cgroup_v2_controllers()
    {
        return OciError::HybridCgroups {
            binary: runc.binary().to_path_buf(),
            controllers: controllers.join(" "),
            message: message.clone(),
        };
    }
    err.into()
}

/// Whether this host's cgroups can enforce a controller (`cpu`, `memory`): a v1 hierarchy
/// of that name, or the controller listed in the v2 root's `cgroup.controllers`.
pub fn cgroup_controller_available(controller: &str) -> bool {
    let root = Path::new("/sys/fs/cgroup");
    if root.join(controller).is_dir() {
        return true;
    }
    std::fs::read_to_string(root.join("cgroup.controllers"))
        .is_ok_and(|list| list.split_whitespace().any(|c| c == controller))
}

/// Errors of the oci runtime, each naming what to fix.
#[derive(Debug, thiserror::Error)]
pub enum OciError {
    #[error(transparent)]
    Runc(#[from] RuncError),
    /// `command.user` is not in the container root's `/etc/passwd` (the image's, or the
    /// host's for a container on the host's root), or its socket dir could not be given.
    #[error(transparent)]
    User(Box<super::users::UserError>),
    /// The runtime refuses every container on this host's cgroups, whatever the config: crun
    /// on a hybrid hierarchy whose cgroup v2 part (`/sys/fs/cgroup/unified`) has controllers.
    #[error(
        "the OCI runtime `{}` refuses every container on this host's cgroups: a hybrid hierarchy (cgroup v1 under /sys/fs/cgroup, cgroup v2 at /sys/fs/cgroup/unified) whose cgroup v2 part has controllers ({controllers}), which crun does not support whatever the container's resources; use runc (the daemon's --oci-runtime), mount those controllers as cgroup v1 hierarchies, or boot with the unified cgroup v2 hierarchy (systemd.unified_cgroup_hierarchy=1) (the runtime said: {message})",
        binary.display()
    )]
    HybridCgroups {
        binary: PathBuf,
        controllers: String,
        message: String,
    },
    #[error(
        "runtime.rootfs: {} does not exist or is not a directory: unpack the image there or fix the path",
        path.display()
    )]
    RootfsMissing { path: PathBuf },
    #[error(
        "container.volumes: host_path {} does not exist: create it or fix the path",
        path.display()
    )]
    HostPathMissing { path: PathBuf },
    #[error("container: {0}")]
    Volumes(String),
    /// A launch spec of another runtime kind reached the oci runtime (a bug of the caller).
    #[error("container: the oci runtime was given a component of another runtime kind")]
    OtherRuntimeKind,
    /// `--oci-runtime` cannot be found: the component is not run at all, never without the
    /// isolation it asks for.
    #[error(
        "the OCI runtime `{}` (the daemon's --oci-runtime) is not installed or not in PATH, and this component needs it for {needs}: install runc (or crun) or point --oci-runtime at it; to run the plugin as a host process without that isolation, set \"runtime\": {{\"kind\": \"process\"}} in its config",
        binary.display()
    )]
    RuntimeMissing { binary: PathBuf, needs: String },
    #[error(
        "container.volumes[{index}].source.host_path.mount_propagation.mode: BIDIRECTIONAL needs host_path {} on a shared mount, and the mount at {} is not shared: mounts made in the container would never reach the host. Make it shared (mount --make-rshared {}, or give the path a shared mount of its own: mount --bind {} {} && mount --make-shared {}) or use HOST_TO_CONTAINER",
        path.display(), mount.display(), mount.display(), path.display(), path.display(), path.display()
    )]
    NotShared {
        index: usize,
        path: PathBuf,
        mount: PathBuf,
    },
    #[error(
        "runtime.capabilities: {name} is not in csi-agent's own capability bounding set, so no container of it can have it: remove it"
    )]
    Capability { name: String },
    #[error("the container's bundle: {0}")]
    Bundle(#[from] bundle::BundleError),
    #[error(transparent)]
    Failpoint(#[from] crate::failpoint::FailpointError),
    #[error("{0}")]
    Resources(String),
    #[error("{what} {}: {source}", path.display())]
    Io {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// The image could not be pulled or prepared (transient ones are retried by the
    /// service manager's backoff like any failed launch).
    #[error("container image {name}: {source}")]
    Image {
        name: String,
        #[source]
        source: Box<ImageStoreError>,
    },
    /// A path the runtime uses inside the container's own root (an image's WorkingDir, a
    /// mount destination) is not a plain directory beneath it (see [`rootpaths`]).
    #[error("{root}: {source}")]
    RootPath {
        root: String,
        #[source]
        source: Box<rootpaths::RootPathError>,
    },
    /// The image cannot be run as the config asks.
    #[error("container image {name}: {source}")]
    ImageUse {
        name: String,
        #[source]
        source: ImageUseError,
    },
    #[error("runc started container {id} but its init process {pid} cannot be watched: {source}")]
    Watch {
        id: String,
        pid: i32,
        #[source]
        source: std::io::Error,
    },
}

/// Why an image cannot be run as the config asks ([`OciError::ImageUse`]).
#[derive(Debug, thiserror::Error)]
pub enum ImageUseError {
    #[error("the daemon has no usable image store (see its log)")]
    NoImageStore,
    #[error(transparent)]
    Reference(crate::image::reference::ReferenceError),
    #[error("the image has no Entrypoint or Cmd: give command.value in the plugin config")]
    NoCommand,
    #[error(
        "its config's User {user:?} is not numeric (uid or uid:gid); user names are not resolved"
    )]
    UserNotNumeric { user: String },
}

impl From<OciError> for RuntimeError {
    fn from(err: OciError) -> Self {
        RuntimeError::Oci(Box::new(err))
    }
}

fn io<'a>(what: &'static str, path: &'a Path) -> impl FnOnce(std::io::Error) -> OciError + 'a {
    move |source| OciError::Io {
        what,
        path: path.to_path_buf(),
        source,
    }
}

/// Settings of the oci runtime that come from the daemon, not from plugin configs.
#[derive(Clone, Debug)]
pub struct OciOptions {
    /// `--oci-runtime`: the runc (or crun) binary, a path or a name looked up in `PATH`.
    pub binary: PathBuf,
    /// runc's state root (`--root`).
    pub state_root: PathBuf,
    /// Where images named by `container.mesos.image` / `container.docker.image` are pulled
    /// and prepared (`<work_dir>/images`).
    pub images: Option<Arc<ImageStore>>,
}

/// Runs components as containers. See the module documentation.
#[derive(Debug)]
pub struct OciRuntime {
    runc: Runc,
    images: Option<Arc<ImageStore>>,
}

impl OciRuntime {
    pub fn new(options: &OciOptions) -> Self {
        Self {
            runc: Runc::new(&options.binary, &options.state_root),
            images: options.images.clone(),
        }
    }

    pub fn runc(&self) -> &Runc {
        &self.runc
    }
}

impl Runtime for OciRuntime {
    fn kind(&self) -> &'static str {
        "oci"
    }

    fn launch<'a>(
        &'a self,
        spec: &'a LaunchSpec,
        context: &'a LaunchContext,
    ) -> BoxFuture<'a, Result<Box<dyn Component>, RuntimeError>> {
        async move {
            self.launch_container(spec, context)
                .await
                .map(|c| Box::new(c) as Box<dyn Component>)
                .map_err(RuntimeError::from)
        }
        .boxed()
    }

    fn adopt<'a>(
        &'a self,
        handle: &'a RuntimeHandle,
    ) -> BoxFuture<'a, Result<Option<Box<dyn Component>>, RuntimeError>> {
        async move {
            self.adopt_container(handle)
                .await
                .map(|c| c.map(|c| Box::new(c) as Box<dyn Component>))
                .map_err(RuntimeError::from)
        }
        .boxed()
    }
}

/// A BIDIRECTIONAL volume's bind is a peer of the host mount its `host_path` is on only when
/// that mount is shared: on a private one, the mounts the plugin makes inside never reach the
/// host, silently. Such a volume is refused (as containerd refuses Kubernetes'
/// `Bidirectional` there), naming it and the mount; csi-agent does not change the mount
/// propagation of the operator's paths itself.
fn check_bidirectional_volumes(volumes: &[VolumeBind]) -> Result<(), OciError> {
    if !volumes.iter().any(|v| v.bidirectional) {
        return Ok(());
    }
    let table = MountTable::read().map_err(|err| OciError::Io {
        what: "cannot read the mount table for",
        path: PathBuf::from("container.volumes"),
        source: std::io::Error::other(err.to_string()),
    })?;
    for (index, volume) in volumes.iter().enumerate() {
        if !volume.bidirectional {
            continue;
        }
        let path = std::fs::canonicalize(&volume.host_path).map_err(io(
            "cannot resolve the volume's host_path",
            &volume.host_path,
        ))?;
        let mount = path.ancestors().find_map(|dir| table.mount_at(dir));
        if !mount.is_some_and(|m| m.is_shared()) {
            return Err(OciError::NotShared {
                index,
                path,
                mount: mount
                    .map(|m| m.mount_point.clone())
                    .unwrap_or_else(|| PathBuf::from("/")),
            });
        }
    }
    Ok(())
}

/// Walks every mount destination of the container's `config.json` beneath its own root
/// `root` ([`rootpaths::Root::mount_point`]), each named for the error by what is bound
/// there.
fn check_mount_points(
    root: &Path,
    oci_spec: &oci_spec::runtime::Spec,
    input: &bundle::BundleInput<'_>,
    volumes: &[VolumeBind],
) -> Result<(), rootpaths::RootPathError> {
    let tree = rootpaths::Root::open(root)?;
    for mount in oci_spec.mounts().iter().flatten() {
        let destination = mount.destination();
        let field = if let Some(index) = volumes
            .iter()
            .position(|v| v.container_path == *destination)
        {
            format!("container.volumes[{index}].container_path")
        } else if input.mount_roots.iter().any(|r| r == destination) {
            "the plugin's mount root".to_owned()
        } else if destination == input.socket_dir {
            "the endpoint dir".to_owned()
        } else {
            "the runtime's mount point".to_owned()
        };
        tree.mount_point(&field, destination)?;
    }
    Ok(())
}

/// Makes `dir` a shared mount (a bind onto itself when it is not a mount point yet), so that
/// an `rshared` bind of it in a container is a peer of the host's.
pub fn share_mount_root(dir: &Path) -> Result<(), OciError> {
    std::fs::create_dir_all(dir).map_err(io("cannot create the mount root", dir))?;
    let table = MountTable::read().map_err(|err| OciError::Io {
        what: "cannot read the mount table for",
        path: dir.to_path_buf(),
        source: std::io::Error::other(err.to_string()),
    })?;
    let mount = table.mount_at(dir).filter(|m| m.mount_point == dir);
    if mount.is_some_and(|m| m.is_shared()) {
        return Ok(());
    }
    if mount.is_none() {
        rustix::mount::mount_bind(dir, dir)
            .map_err(|errno| io("cannot bind the mount root onto itself", dir)(errno.into()))?;
    }
    rustix::mount::mount_change(
        dir,
        rustix::mount::MountPropagationFlags::SHARED | rustix::mount::MountPropagationFlags::REC,
    )
    .map_err(|errno| io("cannot make the mount root shared", dir)(errno.into()))
}

/// Undoes [`share_mount_root`] once no container needs it: unmounts the self-bind of `dir`
/// if it is one and nothing is mounted beneath it (a volume still mounted keeps it; the
/// volume's own unmount comes first).
pub fn release_mount_root(dir: &Path) {
    let Ok(table) = MountTable::read() else {
        return;
    };
    let Some(mount) = table.mount_at(dir).filter(|m| m.mount_point == dir) else {
        return;
    };
    // Only our self-bind: its root is the dir itself on the same file system. A mount root
    // that is an operator's own mount is left alone.
    if mount.root != dir {
        return;
    }
    let beneath = table.mounts_under(dir).iter().any(|m| m.mount_point != dir);
    if beneath {
        tracing::info!(dir = %dir.display(), "mount root still has mounts beneath it; kept shared");
        return;
    }
    if let Err(errno) = rustix::mount::unmount(dir, rustix::mount::UnmountFlags::empty()) {
        tracing::warn!(dir = %dir.display(), "cannot unmount the shared mount root: {errno}");
    }
}

impl OciRuntime {
    async fn launch_container(
        &self,
        spec: &LaunchSpec,
        context: &LaunchContext,
    ) -> Result<OciComponent, OciError> {
        let RuntimeConfig::Oci(settings) = &spec.runtime else {
            return Err(OciError::OtherRuntimeKind);
        };
        // Before anything is made: without the runtime binary the plugin must fail saying
        // what it needs, never run without its isolation (issue #29).
        self.check_installed(spec)?;
        let isolation = isolation::parse(&spec.resources, spec.container.as_ref())
            .map_err(|(field, message)| OciError::Volumes(format!("{field}: {message}")))?;
        let id = container_id(&spec.container_id);
        let bundle_dir = context.container_dir.join(BUNDLE_DIR);
        let (image, prepared) = self.image_of(spec).await?;
        let settings = settings_with_image(settings, prepared.as_ref(), &bundle_dir);
        self.prepare_bundle_dir(&id, &bundle_dir, prepared.as_ref())
            .await?;
        let (root, host_root) = match &settings.rootfs {
            Some(rootfs) => {
                if !rootfs.is_dir() {
                    return Err(OciError::RootfsMissing {
                        path: rootfs.clone(),
                    });
                }
                (rootfs.clone(), Vec::new())
            }
            None => (
                bundle_dir.join(bundle::ROOTFS_DIR),
                host_root_entries(Path::new("/"))?,
            ),
        };
        check_host_side(&isolation, context)?;
        let socket_dir = context.socket.parent().unwrap_or(Path::new("/"));

        let endpoint = format!("unix://{}", context.socket.display());
        let vars = super::agent_vars(&endpoint, &spec.node_id);
        // On the host's root (no image, no configured rootfs) the component's sandbox is
        // bound at its own path and is its working directory, as with the process runtime:
        // what the fetcher put there (`./test-csi-plugin`) runs as under Mesos.
        let sandbox = settings
            .rootfs
            .is_none()
            .then_some(context.container_dir.as_path());
        let started = match (&prepared, &image) {
            (Some(prepared), Some(image)) => {
                image_process(spec, prepared, image, &root, &vars).inspect_err(|_| {
                    // Nothing was created: the image's overlay, if any, goes now.
                    remove_bundle(&bundle_dir);
                })?
            }
            _ => host_process(spec, &settings, sandbox, &vars)?,
        };
        let env = final_environment(started.env, &vars);
        let (settings, bounding) = resolve_capabilities(&settings, &isolation)?;
        let privileged = settings
            .privileged
            .unwrap_or_else(|| spec.container_id.contains(Service::Node.as_str()));
        let own = own_capabilities();
        let input = bundle::BundleInput {
            settings: &settings,
            privileged,
            args: started.args,
            env,
            root: &root,
            host_root: &host_root,
            socket_dir,
            mount_roots: &context.mount_roots,
            volumes: &isolation.volumes,
            cgroups_path: cgroups_path(self.runc.root(), &id),
            available_capabilities: own.as_deref(),
            limits: isolation.limits,
            cwd: started.cwd,
            user: (started.user.uid, started.user.gid),
            additional_gids: started.user.groups.clone(),
            bounding: bounding.as_deref(),
            rlimits: &isolation.rlimits,
            hostname: isolation.hostname.as_deref(),
            sandbox,
        };
        // The socket dir is the process's user's (an image's numeric `User` too), or taken
        // back for root.
        let owner = (started.user.uid != 0 || started.user.gid != 0).then_some(&started.user);
        super::users::give_socket_dir(socket_dir, owner)
            .map_err(|err| OciError::User(Box::new(err)))?;
        let oci_spec = bundle::spec(&input)?;
        let root_name = settings.rootfs.as_ref().map(|rootfs| match &image {
            Some(image) => format!("container image {}", image.name),
            None => format!("runtime.rootfs {}", rootfs.display()),
        });
        write_bundle(&bundle_dir, &oci_spec, &input, root_name)?;
        self.create_and_start(&id, &bundle_dir, context).await
    }

    /// The runtime binary (`--oci-runtime`) can be run: a path that is a file, or a name
    /// found in `PATH`. Else the error names the fields of the component that need it.
    fn check_installed(&self, spec: &LaunchSpec) -> Result<(), OciError> {
        let binary = self.runc.binary();
        if binary_exists(binary) {
            return Ok(());
        }
        let mut needs: Vec<&str> = isolation::requested(&spec.resources, spec.container.as_ref());
        if spec
            .container
            .as_ref()
            .is_some_and(|c| !matches!(ContainerImage::from_container(c), Ok(None)))
        {
            needs.insert(0, "container image");
        }
        if let RuntimeConfig::Oci(OciConfig {
            rootfs: Some(_), ..
        }) = &spec.runtime
        {
            needs.insert(0, "runtime.rootfs");
        }
        Err(OciError::RuntimeMissing {
            binary: binary.to_path_buf(),
            needs: if needs.is_empty() {
                "\"runtime\": {\"kind\": \"oci\"}".to_owned()
            } else {
                needs.join(", ")
            },
        })
    }

    /// The image the component's `container` names, pulled (per its policy) and prepared.
    async fn image_of(
        &self,
        spec: &LaunchSpec,
    ) -> Result<(Option<ContainerImage>, Option<Prepared>), OciError> {
        // The store is shared by every plugin; an image already there is used without a
        // download.
        let image = match &spec.container {
            Some(container) => ContainerImage::from_container(container)
                .map_err(|(field, message)| OciError::Volumes(format!("{field}: {message}")))?,
            None => None,
        };
        let prepared = match &image {
            Some(image) => Some(self.prepare_image(image).await?),
            None => None,
        };
        Ok((image, prepared))
    }

    /// Clears what an earlier container of this id left, and mounts the image's overlay.
    async fn prepare_bundle_dir(
        &self,
        id: &str,
        bundle_dir: &Path,
        prepared: Option<&Prepared>,
    ) -> Result<(), OciError> {
        // A container left by a crash or an earlier run of this component (stopped, or
        // never started) would make `create` fail: it is ours, and outdated.
        self.runc.delete(id).await?;
        remove_bundle(bundle_dir);
        if let Some(PreparedRoot::Layers(layers)) = prepared.map(|p| &p.root) {
            if let Err(err) =
                crate::sys::blocking("overlay mount", || mount_image_root(layers, bundle_dir))
            {
                remove_bundle(bundle_dir);
                return Err(err);
            }
            if let Err(err) = crate::failpoint::hit(FP_AFTER_OVERLAY) {
                self.discard(id, bundle_dir).await;
                return Err(err.into());
            }
        }
        Ok(())
    }

    /// `runc create` with the component's log files as stdio, then `runc start`; any
    /// failure deletes the container and its bundle.
    async fn create_and_start(
        &self,
        id: &str,
        bundle_dir: &Path,
        context: &LaunchContext,
    ) -> Result<OciComponent, OciError> {
        let stdout = open_log(&context.container_dir.join("stdout"))?;
        let stderr = open_log(&context.container_dir.join("stderr"))?;
        let pid_file = bundle_dir.join("init.pid");
        let log = bundle_dir.join("runc.log");
        if let Err(err) = self
            .runc
            .create(id, bundle_dir, &pid_file, &log, stdout, stderr)
            .await
        {
            self.discard(id, bundle_dir).await;
            return Err(explain_create_failure(&self.runc, err));
        }
        if let Err(err) = crate::failpoint::hit(FP_AFTER_CREATE) {
            self.discard(id, bundle_dir).await;
            return Err(err.into());
        }
        let component = match self.watch_init(id, &pid_file) {
            Ok(component) => component,
            Err(err) => {
                self.discard(id, bundle_dir).await;
                return Err(err);
            }
        };
        if let Err(err) = self.runc.start(id).await {
            self.discard(id, bundle_dir).await;
            return Err(err.into());
        }
        if let Err(err) = crate::failpoint::hit(FP_AFTER_START) {
            self.discard(id, bundle_dir).await;
            return Err(err.into());
        }
        tracing::debug!(container = %id, pid = component.pid.as_raw_pid(), "started container");
        Ok(component)
    }

    /// Pulls (per the image's policy) and prepares the image, resolved against the daemon's
    /// default registry.
    async fn prepare_image(&self, image: &ContainerImage) -> Result<Prepared, OciError> {
        let Some(store) = &self.images else {
            return Err(OciError::ImageUse {
                name: image.name.clone(),
                source: ImageUseError::NoImageStore,
            });
        };
        let reference = store
            .resolve(&image.name)
            .map_err(|err| OciError::ImageUse {
                name: image.name.clone(),
                source: ImageUseError::Reference(err),
            })?;
        let started = std::time::Instant::now();
        let prepared = store
            .ensure(&reference, image.policy)
            .await
            .map_err(|source| OciError::Image {
                name: image.name.clone(),
                source: Box::new(source),
            })?;
        tracing::info!(image = %reference, manifest = %prepared.manifest,
            downloaded = prepared.downloaded.len(), elapsed_ms = started.elapsed().as_millis() as u64,
            "image ready");
        Ok(prepared)
    }

    fn watch_init(&self, id: &str, pid_file: &Path) -> Result<OciComponent, OciError> {
        let text = std::fs::read_to_string(pid_file)
            .map_err(io("cannot read runc's pid file", pid_file))?;
        let raw: i32 = text.trim().parse().map_err(|_| OciError::Io {
            what: "runc's pid file holds no pid:",
            path: pid_file.to_path_buf(),
            source: std::io::Error::other(format!("{text:?}")),
        })?;
        let watch_err = |source: std::io::Error| OciError::Watch {
            id: id.to_owned(),
            pid: raw,
            source,
        };
        let pid = Pid::from_raw(raw).ok_or_else(|| watch_err(std::io::Error::other("pid 0")))?;
        let fd = pidfd_open(pid, PidfdFlags::NONBLOCK).map_err(|e| watch_err(e.into()))?;
        // Read after the pidfd is open: the start time then belongs to the same process.
        let start_time = read_stat(pid)
            .map(|s| s.start_time)
            .ok_or_else(|| watch_err(std::io::Error::other("no /proc/<pid>/stat")))?;
        OciComponent::new(
            self.runc.clone(),
            id.to_owned(),
            pid,
            start_time,
            current_boot_id(),
            pid_file.parent().unwrap_or(Path::new("/")).to_path_buf(),
            fd,
        )
        .map_err(watch_err)
    }

    /// A failed launch leaves nothing: the container deleted, the bundle removed.
    async fn discard(&self, id: &str, bundle_dir: &Path) {
        if let Err(err) = self.runc.delete(id).await {
            tracing::warn!(container = %id, "cannot delete a container whose launch failed: {err}");
        }
        remove_bundle(bundle_dir);
    }

    async fn adopt_container(
        &self,
        handle: &RuntimeHandle,
    ) -> Result<Option<OciComponent>, OciError> {
        let RuntimeHandle::Oci {
            container_id: id,
            pid,
            start_time,
            boot_id,
            bundle: bundle_dir,
            ..
        } = handle
        else {
            return Ok(None);
        };
        let state = self.runc.state(id).await?;
        let same_boot = match (boot_id, current_boot_id()) {
            (Some(recorded), Some(now)) => *recorded == now,
            _ => true,
        };
        let running = state
            .as_ref()
            .is_some_and(|s| s.status == "running" && s.pid == *pid && same_boot);
        let adopted = if running {
            Pid::from_raw(*pid).and_then(|raw| match pidfd_open(raw, PidfdFlags::NONBLOCK) {
                Ok(fd) => Some((raw, fd)),
                Err(Errno::SRCH) => None,
                Err(err) => {
                    tracing::warn!(container = %id, "cannot open a pidfd on {pid}: {err}");
                    None
                }
            })
        } else {
            None
        };
        if let Some((raw, fd)) = adopted
            && read_stat(raw).is_some_and(|s| s.start_time == *start_time && s.state != 'Z')
        {
            let component = OciComponent::new(
                self.runc.clone(),
                id.clone(),
                raw,
                *start_time,
                boot_id.clone(),
                bundle_dir.clone(),
                fd,
            )
            .map_err(|source| OciError::Watch {
                id: id.clone(),
                pid: *pid,
                source,
            })?;
            return Ok(Some(component));
        }
        // Stopped, never started, or not the recorded one: it cannot be adopted, and a
        // stale container would block the relaunch.
        if state.is_some() {
            tracing::info!(container = %id, status = ?state.as_ref().map(|s| s.status.clone()), "container not running; deleting it");
            self.runc.delete(id).await?;
        }
        remove_bundle(bundle_dir);
        Ok(None)
    }
}

/// Deletes the container of a component that has no component record (a crash between
/// `runc create` and the record's write, docs/design.md, "Supervision"), so that it neither runs unsupervised
/// nor blocks the next launch. Costs nothing when runc knows no such container (its state
/// dir is looked for first), so it is safe to call for components of any runtime.
pub async fn forget_stray(options: &OciOptions, component_id: &str, container_dir: &Path) {
    let id = container_id(component_id);
    let bundle_dir = container_dir.join(BUNDLE_DIR);
    if !options.state_root.join(&id).exists() {
        remove_bundle(&bundle_dir);
        return;
    }
    let runtime = OciRuntime::new(options);
    tracing::info!(container = %id, "deleting a container that no component record accounts for");
    runtime.discard(&id, &bundle_dir).await;
}

/// The container's argv for a component run from an image, as the Mesos docker runtime
/// isolator builds it: a config `command.value` overrides the image (`shell: true` →
/// `/bin/sh -c value`; `shell: false` → `value` with `arguments`); without one, the image's
/// `Entrypoint` followed by the config's `arguments` when given, else the image's `Cmd`.
pub fn image_argv(
    command: &CommandConfig,
    image: &ImageConfig,
    vars: &[(&str, &str)],
) -> Result<Vec<String>, ImageUseError> {
    if !command.value.is_empty() {
        let (program, argv) = command.argv(vars);
        return Ok(std::iter::once(program)
            .chain(argv.into_iter().skip(1))
            .collect());
    }
    let arguments: Vec<String> = command
        .arguments
        .iter()
        .map(|arg| crate::config::substitute_vars(arg, vars))
        .collect();
    let tail = if arguments.is_empty() {
        image.cmd.clone()
    } else {
        arguments
    };
    let args: Vec<String> = image.entrypoint.iter().cloned().chain(tail).collect();
    if args.first().is_none_or(String::is_empty) {
        return Err(ImageUseError::NoCommand);
    }
    Ok(args)
}

/// An image's `User` as uid and gid: empty → root; `uid` or `uid:gid` numbers. Names would
/// need the image's `/etc/passwd`, which is not read (refused, saying so).
fn numeric_user(user: Option<&str>) -> Result<(u32, u32), ImageUseError> {
    let Some(user) = user else {
        return Ok((0, 0));
    };
    let (uid, gid) = user.split_once(':').unwrap_or((user, "0"));
    match (uid.parse(), gid.parse()) {
        (Ok(uid), Ok(gid)) => Ok((uid, gid)),
        _ => Err(ImageUseError::UserNotNumeric {
            user: user.to_owned(),
        }),
    }
}

/// A cgroup path of its own per state root: two csi-agents (or test daemons) with the same
/// plugin type must not share a cgroup. One level only, so that `runc delete` (which removes
/// Whether an OCI runtime binary can be run: a path naming a file, or a bare name found in
/// one of `PATH`'s dirs.
fn binary_exists(binary: &Path) -> bool {
    if binary.components().count() > 1 {
        return binary.is_file();
    }
    std::env::var_os("PATH")
        .is_some_and(|path| std::env::split_paths(&path).any(|dir| dir.join(binary).is_file()))
}

/// The settings once an image is prepared: its root is the container's.
fn settings_with_image(
    settings: &OciConfig,
    prepared: Option<&Prepared>,
    bundle_dir: &Path,
) -> OciConfig {
    match prepared.map(|p| &p.root) {
        // Shared by every container of the image: never writable.
        Some(PreparedRoot::Flattened(rootfs)) => OciConfig {
            rootfs: Some(rootfs.clone()),
            readonly_rootfs: Some(true),
            ..settings.clone()
        },
        // The container's own overlay: writable if the config says so.
        Some(PreparedRoot::Layers(_)) => OciConfig {
            rootfs: Some(bundle_dir.join(bundle::ROOTFS_DIR)),
            ..settings.clone()
        },
        None => settings.clone(),
    }
}

/// What the host must have for the component's isolation: the cgroup controllers of its
/// limits, its volumes' host paths (shared where BIDIRECTIONAL); then the mount roots are
/// made shared.
fn check_host_side(isolation: &Isolation, context: &LaunchContext) -> Result<(), OciError> {
    for (wanted, controller) in [
        (isolation.limits.cpus.is_some(), "cpu"),
        (isolation.limits.mem_mb.is_some(), "memory"),
    ] {
        if wanted && !cgroup_controller_available(controller) {
            // A limit the host cannot enforce is an error, not silently dropped.
            return Err(OciError::Resources(format!(
                "resources: this host has no {controller} cgroup controller to enforce the limit; remove it or enable the controller"
            )));
        }
    }
    for volume in &isolation.volumes {
        if !volume.host_path.exists() {
            return Err(OciError::HostPathMissing {
                path: volume.host_path.clone(),
            });
        }
    }
    check_bidirectional_volumes(&isolation.volumes)?;
    for dir in &context.mount_roots {
        share_mount_root(dir)?;
    }
    Ok(())
}

/// The container's process before the agent's variables: argv, environment, working dir
/// and user.
struct Started {
    args: Vec<String>,
    env: Vec<(String, String)>,
    cwd: String,
    user: super::users::User,
}

/// The process of an image: its Entrypoint/Cmd unless the config's command overrides them,
/// its environment, WorkingDir and User (`command.user` wins, from the image's passwd).
fn image_process(
    spec: &LaunchSpec,
    prepared: &Prepared,
    image: &ContainerImage,
    root: &Path,
    vars: &[(&str, &str)],
) -> Result<Started, OciError> {
    let args =
        image_argv(&spec.command, &prepared.config, vars).map_err(|source| OciError::ImageUse {
            name: image.name.clone(),
            source,
        })?;
    // `command.user` wins over the image's `User`, and is a name or uid of the image's own
    // /etc/passwd (read beneath its root), as Mesos resolves it in the container.
    let user = match &spec.command.user {
        Some(name) => {
            super::users::resolve(root, name).map_err(|err| OciError::User(Box::new(err)))?
        }
        None => numeric_user(prepared.config.user.as_deref())
            .map(|(uid, gid)| super::users::User {
                name: format!("{uid}"),
                uid,
                gid,
                groups: Vec::new(),
            })
            .map_err(|source| OciError::ImageUse {
                name: image.name.clone(),
                source,
            })?,
    };
    // The image's config is input: its WorkingDir is resolved beneath the root here, never
    // handed to runc as it is (rootpaths).
    let (tree, cwd) = rootpaths::Root::open(root)
        .and_then(|tree| {
            let cwd = tree.working_dir(prepared.config.working_dir.as_deref())?;
            Ok((tree, cwd))
        })
        .map_err(|source| OciError::RootPath {
            root: format!("container image {}", image.name),
            source: Box::new(source),
        })?;
    // The image's environment, not the daemon's (the host's PATH and the like mean nothing
    // inside another root file system), over the defaults a real image expects; the
    // config's comes after it.
    let config_env: Vec<(String, String)> = spec
        .command
        .environment
        .iter()
        .map(|var| (var.name.clone(), var.value.clone()))
        .collect();
    let env = rootpaths::image_environment(&prepared.config.env, &config_env, || {
        tree.home_of(user.uid)
            .unwrap_or_else(|| rootpaths::DEFAULT_HOME.to_owned())
    });
    Ok(Started {
        args,
        env,
        cwd,
        user,
    })
}

/// The process of a container on the host's root (or a configured rootfs): the config's
/// command and the daemon's environment, as with the process runtime.
fn host_process(
    spec: &LaunchSpec,
    settings: &OciConfig,
    sandbox: Option<&Path>,
    vars: &[(&str, &str)],
) -> Result<Started, OciError> {
    let (program, argv) = spec.command.argv(vars);
    // OCI has no separate argv[0]: args[0] is what runc executes.
    let args: Vec<String> = std::iter::once(program)
        .chain(argv.into_iter().skip(1))
        .collect();
    // The same environment as the process runtime: the daemon's, Mesos's sandbox variable
    // (where the sandbox is given), then the config's.
    let mut env: Vec<(String, String)> = std::env::vars().collect();
    if let Some(sandbox) = sandbox {
        env.push((
            super::MESOS_SANDBOX_VAR.to_owned(),
            sandbox.display().to_string(),
        ));
    }
    for var in &spec.command.environment {
        env.push((var.name.clone(), var.value.clone()));
    }
    // The host's user database: the container runs on the host's root (or on a configured
    // rootfs, whose own database then applies).
    let user = match &spec.command.user {
        Some(name) => {
            super::users::resolve(settings.rootfs.as_deref().unwrap_or(Path::new("/")), name)
                .map_err(|err| OciError::User(Box::new(err)))?
        }
        None => super::users::User {
            name: "root".to_owned(),
            uid: 0,
            gid: 0,
            groups: Vec::new(),
        },
    };
    // The sandbox is the working dir, as with the process runtime; not for another user,
    // who cannot reach it (the work dir is root's, 0700), as with the process runtime too.
    let cwd = match sandbox {
        Some(sandbox) if user.uid == 0 => sandbox.display().to_string(),
        _ => "/".to_owned(),
    };
    Ok(Started {
        args,
        env,
        cwd,
        user,
    })
}

/// The environment with the agent's variables over it (they win), one entry per name (the
/// last), as `NAME=value`.
fn final_environment(mut env: Vec<(String, String)>, vars: &[(&str, &str)]) -> Vec<String> {
    env.extend(
        vars.iter()
            .map(|(name, value)| ((*name).to_owned(), (*value).to_owned())),
    );
    let mut seen = std::collections::BTreeSet::new();
    let mut env: Vec<String> = env
        .into_iter()
        .rev()
        .filter(|(name, _)| seen.insert(name.clone()))
        .map(|(name, value)| format!("{name}={value}"))
        .collect();
    env.reverse();
    env
}

/// The capabilities: `runtime.capabilities` wins (effective and bounding); else what Mesos
/// `linux_info` asks for, its bounding set apart. Each must be one csi-agent holds.
fn resolve_capabilities(
    settings: &OciConfig,
    isolation: &Isolation,
) -> Result<(OciConfig, Option<Vec<String>>), OciError> {
    let mut effective = settings.clone();
    let mut bounding = None;
    if effective.capabilities.is_none()
        && let Some(sets) = &isolation.capabilities
    {
        effective.capabilities = Some(sets.effective.clone());
        bounding = Some(sets.bounding.clone());
    }
    if let Some(own) = own_capabilities() {
        let wanted = effective
            .capabilities
            .iter()
            .chain(bounding.iter())
            .flatten();
        if let Some(missing) = wanted.into_iter().find(|c| !own.contains(&c.as_str())) {
            return Err(OciError::Capability {
                name: missing.clone(),
            });
        }
    }
    Ok((effective, bounding))
}

/// Writes the bundle: a root of the container's own checked (`root_name` names it), the
/// host root's symlinks recreated in `rootfs/`, `config.json` (0600: it holds secrets).
fn write_bundle(
    bundle_dir: &Path,
    oci_spec: &oci_spec::runtime::Spec,
    input: &bundle::BundleInput<'_>,
    root_name: Option<String>,
) -> Result<(), OciError> {
    // A root of the container's own (an image's, a configured rootfs) is input: runc would
    // follow its symlinks to every mount destination.
    if let Some(name) = root_name
        && let Err(source) = check_mount_points(input.root, oci_spec, input, input.volumes)
    {
        remove_bundle(bundle_dir);
        return Err(OciError::RootPath {
            root: name,
            source: Box::new(source),
        });
    }
    std::fs::create_dir_all(bundle_dir.join(bundle::ROOTFS_DIR))
        .map_err(io("cannot create the bundle", bundle_dir))?;
    for entry in input.host_root {
        if let bundle::HostRootEntry::Symlink { path, target } = entry {
            let link = bundle_dir
                .join(bundle::ROOTFS_DIR)
                .join(path.strip_prefix("/").unwrap_or(path));
            std::os::unix::fs::symlink(target, &link)
                .map_err(io("cannot recreate the host's symlink at", &link))?;
        }
    }
    let config_path = bundle_dir.join(bundle::CONFIG_FILE);
    // It holds the process's environment, SECRET variables included (runc reads them from
    // here): made 0600 before anything is written to it, like every secret csi-agent keeps
    // (the save truncates it, keeping the mode).
    {
        use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
        let file = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&config_path)
            .map_err(io("cannot create", &config_path))?;
        file.set_permissions(std::fs::Permissions::from_mode(0o600))
            .map_err(io("cannot restrict the mode of", &config_path))?;
    }
    oci_spec.save(&config_path).map_err(|err| OciError::Io {
        what: "cannot write",
        path: config_path.clone(),
        source: std::io::Error::other(err.to_string()),
    })
}

/// the leaf) leaves no dir behind.
fn cgroups_path(state_root: &Path, id: &str) -> String {
    let mut hash: u32 = 0x811c_9dc5;
    for byte in state_root.as_os_str().as_encoded_bytes() {
        hash ^= u32::from(*byte);
        hash = hash.wrapping_mul(0x0100_0193);
    }
    format!("/csi-agent-{hash:08x}-{id}")
}

fn open_log(path: &Path) -> Result<std::fs::File, OciError> {
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .mode(0o640)
        .open(path)
        .map_err(io("cannot open log file", path))
}

/// The container's root from an image's layers: `bundle/overlay/{upper,work}` made afresh
/// (a relaunched container starts from the image, as a new Mesos container does) and the
/// overlay of the layers under them mounted at `bundle/rootfs`.
fn mount_image_root(layers: &[PathBuf], bundle_dir: &Path) -> Result<(), OciError> {
    let rootfs = bundle_dir.join(bundle::ROOTFS_DIR);
    let upper = bundle_dir.join(OVERLAY_DIR).join("upper");
    let work = bundle_dir.join(OVERLAY_DIR).join("work");
    for dir in [&rootfs, &upper, &work] {
        std::fs::create_dir_all(dir).map_err(io("cannot create", dir))?;
    }
    crate::image::overlay::mount(layers, Some((&upper, &work)), &rootfs).map_err(|err| {
        OciError::Io {
            what: "cannot mount the image's layers at",
            path: rootfs.clone(),
            source: std::io::Error::other(err.to_string()),
        }
    })
}

/// The top-level entries of the host's root `/` (`root`) a container on the host's root is
/// given ([`bundle::HostRootEntry`]), by name: directories and files bound, symlinks
/// recreated; [`bundle::OWN_ROOT_ENTRIES`], other kinds (sockets, devices) and names that are
/// not UTF-8 (which `config.json` cannot hold) left out, the last two logged.
pub fn host_root_entries(root: &Path) -> Result<Vec<bundle::HostRootEntry>, OciError> {
    use std::os::unix::fs::MetadataExt;
    let root_dev = std::fs::metadata(root)
        .map_err(io("cannot read the host's root", root))?
        .dev();
    let mut entries = Vec::new();
    for entry in std::fs::read_dir(root).map_err(io("cannot list the host's root", root))? {
        let entry = entry.map_err(io("cannot list the host's root", root))?;
        let name = entry.file_name();
        let Some(text) = name.to_str() else {
            tracing::warn!(name = ?name, "an entry of / whose name is not UTF-8 is not given to containers on the host's root");
            continue;
        };
        if bundle::OWN_ROOT_ENTRIES.contains(&text) {
            continue;
        }
        let path = root.join(&name);
        // Gone since the listing: nothing to give.
        let Ok(meta) = std::fs::symlink_metadata(&path) else {
            continue;
        };
        let file_type = meta.file_type();
        let entry = if file_type.is_symlink() {
            let Ok(target) = std::fs::read_link(&path) else {
                continue;
            };
            bundle::HostRootEntry::Symlink {
                path: Path::new("/").join(&name),
                target,
            }
        } else if file_type.is_dir() || file_type.is_file() {
            bundle::HostRootEntry::Bind {
                path: Path::new("/").join(&name),
                own_mount: meta.dev() != root_dev,
            }
        } else {
            tracing::debug!(path = %path.display(), "not a directory, file or symlink: not given to containers on the host's root");
            continue;
        };
        entries.push(entry);
    }
    entries.sort_by(|a, b| entry_path(a).cmp(entry_path(b)));
    Ok(entries)
}

fn entry_path(entry: &bundle::HostRootEntry) -> &Path {
    match entry {
        bundle::HostRootEntry::Bind { path, .. } | bundle::HostRootEntry::Symlink { path, .. } => {
            path
        }
    }
}

/// The most levels of mount points beneath `rootfs/` that [`clear_root_dir`] removes.
const ROOT_DIR_DEPTH: usize = 32;

/// Empties the bundle's `rootfs/` of what a launch on the host's root leaves on the host:
/// the symlinks csi-agent recreated and the mount points the runtime made (empty dirs and
/// empty files). Nothing else is removed, nothing is followed, and nothing on another file
/// system is entered: a `rootfs/` that is still a mount (an overlay that would not unmount)
/// is left whole. What is left is logged.
fn clear_root_dir(rootfs: &Path) {
    use std::os::unix::fs::MetadataExt;
    let Ok(meta) = std::fs::symlink_metadata(rootfs) else {
        return;
    };
    let parent_dev = rootfs
        .parent()
        .and_then(|p| std::fs::metadata(p).ok())
        .map(|m| m.dev());
    if !meta.is_dir() || parent_dev != Some(meta.dev()) {
        return;
    }
    clear_dir(rootfs, meta.dev(), 0);
}

fn clear_dir(dir: &Path, dev: u64, depth: usize) {
    use std::os::unix::fs::MetadataExt;
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        let Ok(meta) = std::fs::symlink_metadata(&path) else {
            continue;
        };
        let removed = if meta.file_type().is_symlink() || (meta.is_file() && meta.len() == 0) {
            std::fs::remove_file(&path)
        } else if meta.is_dir() && meta.dev() == dev && depth < ROOT_DIR_DEPTH {
            clear_dir(&path, dev, depth + 1);
            std::fs::remove_dir(&path)
        } else {
            Err(std::io::Error::other(
                "not a symlink, an empty file or a dir on the same file system",
            ))
        };
        if let Err(err) = removed
            && err.kind() != std::io::ErrorKind::NotFound
        {
            tracing::warn!(path = %path.display(), "cannot remove from the container's root dir: {err}");
        }
    }
}

/// Removes the files csi-agent writes into a bundle, then the bundle dir; never
/// recursively but for [`clear_root_dir`] (the `rootfs/` dir holds only mount points and
/// symlinks on the host once its overlay, if any, is unmounted: the container's mounts live
/// in its own mount namespace). The overlay's upper and work dirs go only after the overlay
/// is unmounted.
fn remove_bundle(bundle_dir: &Path) {
    let rootfs = bundle_dir.join(bundle::ROOTFS_DIR);
    let overlay = bundle_dir.join(OVERLAY_DIR);
    match crate::image::overlay::unmount_if_mounted(&rootfs) {
        Ok(_) => {
            if let Err(err) = std::fs::remove_dir_all(&overlay)
                && err.kind() != std::io::ErrorKind::NotFound
            {
                tracing::warn!(path = %overlay.display(), "cannot remove: {err}");
            }
        }
        Err(err) => tracing::warn!(path = %rootfs.display(), "{err}; its upper dir is kept"),
    }
    clear_root_dir(&rootfs);
    for name in [bundle::CONFIG_FILE, "init.pid", "runc.log"] {
        let path = bundle_dir.join(name);
        if let Err(err) = std::fs::remove_file(&path)
            && err.kind() != std::io::ErrorKind::NotFound
        {
            tracing::warn!(path = %path.display(), "cannot remove: {err}");
        }
    }
    for dir in [
        bundle_dir.join(bundle::ROOTFS_DIR),
        bundle_dir.to_path_buf(),
    ] {
        if let Err(err) = std::fs::remove_dir(&dir)
            && err.kind() != std::io::ErrorKind::NotFound
        {
            tracing::warn!(path = %dir.display(), "cannot remove: {err}");
        }
    }
}

/// A watched container.
#[derive(Debug)]
struct OciComponent {
    runc: Runc,
    id: String,
    pid: Pid,
    start_time: u64,
    boot_id: Option<String>,
    bundle: PathBuf,
    pidfd: AsyncFd<OwnedFd>,
    exited: Mutex<bool>,
    /// Serializes `stop` so that concurrent stops send one kill sequence.
    stopping: tokio::sync::Mutex<()>,
}

impl OciComponent {
    fn new(
        runc: Runc,
        id: String,
        pid: Pid,
        start_time: u64,
        boot_id: Option<String>,
        bundle: PathBuf,
        fd: OwnedFd,
    ) -> std::io::Result<Self> {
        // See ProcessComponent::new: `with_interest` on an owned fd is sound; its
        // replacement is `unsafe`, which the workspace denies.
        #[allow(deprecated)]
        let pidfd = AsyncFd::with_interest(fd, tokio::io::Interest::READABLE)?;
        Ok(Self {
            runc,
            id,
            pid,
            start_time,
            boot_id,
            bundle,
            pidfd,
            exited: Mutex::new(false),
            stopping: tokio::sync::Mutex::new(()),
        })
    }

    fn has_exited(&self) -> bool {
        *self
            .exited
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    async fn wait_exit(&self) -> ExitInfo {
        if self.has_exited() {
            return ExitInfo::Unknown;
        }
        loop {
            match self.pidfd.readable().await {
                // Readiness is not cleared: an ended process stays readable.
                Ok(_guard) => break,
                Err(err) => {
                    tracing::warn!(container = %self.id, "cannot poll pidfd: {err}");
                    tokio::time::sleep(Duration::from_millis(500)).await;
                    let alive = read_stat(self.pid)
                        .is_some_and(|s| s.start_time == self.start_time && s.state != 'Z');
                    if !alive {
                        break;
                    }
                }
            }
        }
        *self
            .exited
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = true;
        // The init is runc's child, not ours: its status is not ours to collect.
        ExitInfo::Unknown
    }

    async fn kill(&self, signal: &str) {
        if let Err(err) = self.runc.kill(&self.id, signal, false).await {
            // Already stopped is the usual reason; the pidfd tells.
            tracing::debug!(container = %self.id, "runc kill {signal}: {err}");
        }
    }

    async fn stop_container(&self, grace: Duration) -> ExitInfo {
        let _serial = self.stopping.lock().await;
        let exit = if self.has_exited() {
            ExitInfo::Unknown
        } else {
            self.kill("SIGTERM").await;
            match tokio::time::timeout(grace, self.wait_exit()).await {
                Ok(exit) => exit,
                Err(_) => {
                    tracing::warn!(container = %self.id,
                        "container did not exit {} ms after SIGTERM; sending SIGKILL", grace.as_millis());
                    self.kill("SIGKILL").await;
                    match tokio::time::timeout(runc::QUICK_TIMEOUT, self.wait_exit()).await {
                        Ok(exit) => exit,
                        Err(_) => ExitInfo::Unknown,
                    }
                }
            }
        };
        // `delete --force` also kills whatever is left (an init that ignored SIGKILL cannot
        // exist, but a stuck runc state can) and removes the cgroup.
        if let Err(err) = self.runc.delete(&self.id).await {
            tracing::warn!(container = %self.id, "cannot delete the container: {err}");
        }
        remove_bundle(&self.bundle);
        exit
    }
}

impl Component for OciComponent {
    fn handle(&self) -> RuntimeHandle {
        RuntimeHandle::Oci {
            container_id: self.id.clone(),
            pid: self.pid.as_raw_pid(),
            start_time: self.start_time,
            boot_id: self.boot_id.clone(),
            state_root: self.runc.root().to_path_buf(),
            bundle: self.bundle.clone(),
        }
    }

    fn wait(&self) -> BoxFuture<'_, ExitInfo> {
        self.wait_exit().boxed()
    }

    fn stop(&self, grace: Duration) -> BoxFuture<'_, ExitInfo> {
        self.stop_container(grace).boxed()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    #[allow(clippy::unwrap_used)]
    fn image_argv_follows_the_mesos_rules() {
        let image = ImageConfig {
            entrypoint: vec!["/bin/plugin".into(), "--csi".into()],
            cmd: vec!["serve".into()],
            ..ImageConfig::default()
        };
        let vars = [("CSI_ENDPOINT", "unix:///s")];
        let command = |value: &str, shell: bool, arguments: &[&str]| CommandConfig {
            value: value.into(),
            shell,
            arguments: arguments.iter().map(|a| (*a).to_owned()).collect(),
            environment: Vec::new(),
            uris: vec![],
            user: None,
        };
        // Nothing given: Entrypoint + Cmd.
        assert_eq!(
            image_argv(&command("", false, &[]), &image, &vars).unwrap(),
            ["/bin/plugin", "--csi", "serve"]
        );
        // Only arguments: they replace Cmd (variables substituted).
        assert_eq!(
            image_argv(
                &command("", false, &["--endpoint", "$CSI_ENDPOINT"]),
                &image,
                &vars
            )
            .unwrap(),
            ["/bin/plugin", "--csi", "--endpoint", "unix:///s"]
        );
        // shell: true → /bin/sh -c value, the image's Entrypoint and Cmd ignored.
        assert_eq!(
            image_argv(&command("exec /x", true, &[]), &image, &vars).unwrap(),
            ["/bin/sh", "-c", "exec /x"]
        );
        // shell: false → value + arguments (argv[0] included, as Mesos has it).
        assert_eq!(
            image_argv(&command("/y", false, &["y", "-v"]), &image, &vars).unwrap(),
            ["/y", "-v"]
        );
        // An image with neither, and no command: refused, saying what to give.
        assert!(
            image_argv(&command("", false, &[]), &ImageConfig::default(), &vars)
                .unwrap_err()
                .to_string()
                .contains("command.value")
        );
        assert_eq!(numeric_user(None).unwrap(), (0, 0));
        assert_eq!(numeric_user(Some("1000")).unwrap(), (1000, 0));
        assert_eq!(numeric_user(Some("1000:50")).unwrap(), (1000, 50));
        assert!(matches!(
            numeric_user(Some("nobody")),
            Err(ImageUseError::UserNotNumeric { user }) if user == "nobody"
        ));
    }

    #[test]
    fn capability_names_are_canonicalized_or_refused() {
        assert_eq!(
            canonical_capability("CAP_SYS_ADMIN").as_deref(),
            Some("CAP_SYS_ADMIN")
        );
        assert_eq!(
            canonical_capability("sys_admin").as_deref(),
            Some("CAP_SYS_ADMIN")
        );
        assert_eq!(canonical_capability("CAP_MAKE_COFFEE"), None);
        for name in ALL_CAPABILITIES.iter().chain(DEFAULT_CAPABILITIES) {
            assert_eq!(canonical_capability(name).as_deref(), Some(*name));
        }
    }

    #[test]
    fn mesos_linux_info_capabilities_are_read_and_checked() {
        use crate::runtime::isolation::{CapabilitySets, capability_sets};
        let container = serde_json::json!({"linux_info": {"effective_capabilities":
            {"capabilities": ["SYS_ADMIN", "MKNOD"]}}});
        let both = vec!["CAP_SYS_ADMIN".to_owned(), "CAP_MKNOD".to_owned()];
        // The effective set alone bounds itself, as under Mesos.
        assert_eq!(
            capability_sets(&container),
            Ok(Some(CapabilitySets {
                effective: both.clone(),
                bounding: both
            }))
        );
        let older =
            serde_json::json!({"linux_info": {"capability_info": {"capabilities": ["CHOWN"]}}});
        assert_eq!(
            capability_sets(&older).map(|s| s.map(|s| s.effective)),
            Ok(Some(vec!["CAP_CHOWN".to_owned()]))
        );
        assert_eq!(capability_sets(&serde_json::json!({})), Ok(None));
        let bad = serde_json::json!({"linux_info": {"effective_capabilities":
            {"capabilities": ["SYS_ADMIN", "TEA"]}}});
        assert_eq!(
            capability_sets(&bad).map_err(|(field, _)| field),
            Err("linux_info.effective_capabilities.capabilities[1]".to_owned())
        );
    }

    #[test]
    fn the_host_root_is_listed_entry_by_entry_and_its_dir_cleared_after() -> anyhow::Result<()> {
        let host = tempfile::tempdir()?;
        std::fs::create_dir(host.path().join("etc"))?;
        std::fs::write(host.path().join(".marker"), b"")?;
        std::os::unix::fs::symlink("usr/bin", host.path().join("bin"))?;
        std::fs::create_dir(host.path().join("proc"))?;
        std::fs::create_dir(host.path().join("tmp"))?;
        rustix::fs::mknodat(
            rustix::fs::CWD,
            host.path().join("fifo"),
            rustix::fs::FileType::Fifo,
            rustix::fs::Mode::from_raw_mode(0o600),
            0,
        )?;
        let entries = host_root_entries(host.path())?;
        assert_eq!(
            entries,
            vec![
                bundle::HostRootEntry::Bind {
                    path: "/.marker".into(),
                    own_mount: false
                },
                bundle::HostRootEntry::Symlink {
                    path: "/bin".into(),
                    target: "usr/bin".into()
                },
                bundle::HostRootEntry::Bind {
                    path: "/etc".into(),
                    own_mount: false
                },
            ]
        );

        // What a launch leaves in rootfs/: symlinks, empty mount point files and dirs, nested
        // ones too. A file with content is no mount point: it is left.
        let rootfs = host.path().join("bundle/rootfs");
        std::fs::create_dir_all(rootfs.join("state/sub"))?;
        std::fs::create_dir_all(rootfs.join("etc"))?;
        std::fs::write(rootfs.join(".marker"), b"")?;
        std::os::unix::fs::symlink("/", rootfs.join("bin"))?;
        std::fs::create_dir_all(rootfs.join("kept"))?;
        std::fs::write(rootfs.join("kept/data"), b"not a mount point")?;
        clear_root_dir(&rootfs);
        let mut left: Vec<String> = std::fs::read_dir(&rootfs)?
            .map(|e| e.map(|e| e.file_name().to_string_lossy().into_owned()))
            .collect::<Result<_, _>>()?;
        left.sort();
        assert_eq!(left, ["kept"]);
        assert!(rootfs.join("kept/data").exists());
        // The symlink was removed, not followed.
        assert!(host.path().join("etc").exists());
        Ok(())
    }

    #[test]
    fn container_ids_keep_component_ids() {
        let id = "csi-agent-org-example-test-default--CONTROLLER_SERVICE-NODE_SERVICE";
        assert_eq!(container_id(id), id);
        assert_eq!(container_id("a/b c"), "a_b_c");
    }

    #[test]
    fn mesos_volumes_become_binds() {
        let container = serde_json::json!({"volumes": [
            {"container_path": "/state", "host_path": "/var/lib/p", "mode": "RW"},
            {"container_path": "/ro", "mode": "RO",
             "source": {"type": "HOST_PATH", "host_path": {"path": "/etc/p",
                        "mount_propagation": {"mode": "BIDIRECTIONAL"}}}}
        ]});
        assert_eq!(
            volumes(&container),
            Ok(vec![
                VolumeBind {
                    container_path: "/state".into(),
                    host_path: "/var/lib/p".into(),
                    readonly: false,
                    bidirectional: false
                },
                VolumeBind {
                    container_path: "/ro".into(),
                    host_path: "/etc/p".into(),
                    readonly: true,
                    bidirectional: true
                },
            ])
        );
        let bad = serde_json::json!({"volumes": [{"container_path": "rel", "host_path": "/x"}]});
        assert_eq!(
            volumes(&bad).map_err(|(field, _)| field),
            Err("volumes[0].container_path".to_owned())
        );
        let bad = serde_json::json!({"volumes": [{"container_path": "/a", "host_path": "/x", "mode": "RX"}]});
        assert_eq!(
            volumes(&bad).map_err(|(field, _)| field),
            Err("volumes[0].mode".to_owned())
        );
    }
}
