//! The OCI bundle of one component: `config.json` built with the `oci-spec` crate, and the
//! `rootfs/` dir that is the container's root when it runs on the host's root.
//!
//! The host's root is given entry by entry — each top-level directory and file of the host's
//! `/` bound at its own path, each top-level symlink recreated in `rootfs/` — never as one
//! bind of `/` onto the container's root: crun before 1.22 refuses any mount whose
//! destination is `/` (```mount `/` to ``: Invalid argument```, containers/crun#1752), and
//! both runtimes take the entries.
//!
//! It owns what the container sees (namespaces, mounts, capabilities, devices); it must not
//! run anything.

use std::collections::HashSet;
use std::path::{Path, PathBuf};

use oci_spec::runtime::{
    Capability, LinuxBuilder, LinuxCapabilitiesBuilder, LinuxCpuBuilder, LinuxDeviceCgroupBuilder,
    LinuxMemoryBuilder, LinuxNamespaceBuilder, LinuxNamespaceType, LinuxResourcesBuilder, Mount,
    MountBuilder, PosixRlimitBuilder, PosixRlimitType, ProcessBuilder, RootBuilder, Spec,
    SpecBuilder, UserBuilder,
};

use super::{ALL_CAPABILITIES, CPU_PERIOD_US, DEFAULT_CAPABILITIES, Limits, VolumeBind};
use crate::config::OciConfig;
use crate::runtime::isolation::Rlimit;

/// The bundle's files, inside `containers/<id>/bundle/`.
pub const CONFIG_FILE: &str = "config.json";
pub const ROOTFS_DIR: &str = "rootfs";

#[derive(Debug, thiserror::Error)]
pub enum BundleError {
    #[error("cannot build the container's config.json: {source}")]
    Spec {
        #[source]
        source: oci_spec::OciSpecError,
    },
    #[error("capability {name:?} is not known to oci-spec")]
    Capability { name: String },
    #[error("rlimit {name:?} is not known to oci-spec")]
    Rlimit { name: String },
}

impl From<oci_spec::OciSpecError> for BundleError {
    fn from(source: oci_spec::OciSpecError) -> Self {
        BundleError::Spec { source }
    }
}

/// Everything the spec is made of, resolved by the runtime.
#[derive(Debug)]
pub struct BundleInput<'a> {
    pub settings: &'a OciConfig,
    /// `settings.privileged`, with its default (node components) applied.
    pub privileged: bool,
    /// `args[0]` is the executable.
    pub args: Vec<String>,
    /// `NAME=value`.
    pub env: Vec<String>,
    /// The container's root: the configured rootfs, or the bundle's `rootfs/` beneath which
    /// the host's root is bound entry by entry (`host_root`).
    pub root: &'a Path,
    /// Without a configured rootfs: the entries of the host's `/` (see [`HostRootEntry`]).
    pub host_root: &'a [HostRootEntry],
    /// The dir holding the component's socket, shared with the host at the same path.
    pub socket_dir: &'a Path,
    /// The dirs csi-agent hands the plugin mount paths in, shared at the same path with
    /// `rshared` propagation so that the plugin's mounts appear on the host.
    pub mount_roots: &'a [PathBuf],
    pub volumes: &'a [VolumeBind],
    pub cgroups_path: String,
    /// The capabilities csi-agent holds (see [`super::own_capabilities`]); the defaults are
    /// cut down to them. `None`: unknown, the defaults are used whole.
    pub available_capabilities: Option<&'a [&'static str]>,
    /// `cpus` and `mem` from the component's `resources`.
    pub limits: Limits,
    /// The process's working directory (an image's `WorkingDir`; else `/`).
    pub cwd: String,
    /// The process's uid and gid (an image's numeric `User`; else root).
    pub user: (u32, u32),
    /// The process's supplementary groups (`command.user`'s in `/etc/group`).
    pub additional_gids: Vec<u32>,
    /// The bounding capability set, when it differs from the effective one (Mesos
    /// `linux_info.bounding_capabilities`). `None`: the effective set.
    pub bounding: Option<&'a [String]>,
    /// Mesos `rlimit_info`; empty: the daemon's rlimits are inherited.
    pub rlimits: &'a [Rlimit],
    /// Mesos `container.hostname`: a UTS namespace of its own with that name. `None`: the
    /// host's UTS namespace.
    pub hostname: Option<&'a str>,
    /// The component's sandbox (its container dir), bound at its own path: a container on
    /// the host's root only.
    pub sandbox: Option<&'a Path>,
}

/// One top-level entry of the host's `/`, as a container on the host's root gets it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum HostRootEntry {
    /// A directory or file, bound at the same path (`rbind`, `rslave`: the host's mounts
    /// beneath it come in, nothing made inside goes out). `own_mount`: it is a mount of its
    /// own on the host (another file system), which a read-only root leaves as it is — as a
    /// bind of the whole `/` would.
    Bind { path: PathBuf, own_mount: bool },
    /// A symlink (`/bin -> usr/bin`), recreated as it is in the bundle's `rootfs/` by the
    /// runtime before `create`.
    Symlink { path: PathBuf, target: PathBuf },
}

/// The top-level entries of the host's `/` that a container on the host's root does not get
/// from the host: it has its own `/proc`, `/dev`, `/sys` and `/tmp` (the host's `/dev` and
/// `/sys` are bound on their own when it is privileged or shares the host's network).
pub const OWN_ROOT_ENTRIES: &[&str] = &["proc", "dev", "sys", "tmp"];

fn mount(
    destination: &Path,
    typ: &str,
    source: &Path,
    options: &[&str],
) -> Result<Mount, BundleError> {
    Ok(MountBuilder::default()
        .destination(destination)
        .typ(typ)
        .source(source)
        .options(options.iter().map(|o| (*o).to_owned()).collect::<Vec<_>>())
        .build()?)
}

fn capabilities(names: &[String]) -> Result<HashSet<Capability>, BundleError> {
    names
        .iter()
        .map(|name| {
            serde_json::from_value::<Capability>(serde_json::Value::String(name.clone()))
                .map_err(|_| BundleError::Capability { name: name.clone() })
        })
        .collect()
}

/// Builds `config.json`. The mounts, in order:
/// 1. without a configured rootfs, the host's `/` entry by entry ([`HostRootEntry`]: `rbind`,
///    `rslave`, and `ro` with a read-only root unless the entry is a mount of its own);
/// 2. the container's own `/proc`, `/dev` (the host's `/dev` when privileged: a node plugin
///    needs the devices it formats and mounts), `/sys`, `/tmp`;
/// 3. the socket dir, the mount roots (`rshared`), the sandbox and `container.volumes`,
///    parents first.
pub fn spec(input: &BundleInput<'_>) -> Result<Spec, BundleError> {
    let mut mounts = host_root_mounts(input)?;
    mounts.extend(own_mounts(input)?);
    mounts.extend(bind_mounts(input)?);
    let process = process(input)?;
    let linux = linux(input)?;
    let mut spec = SpecBuilder::default()
        .version("1.0.2")
        .root(
            RootBuilder::default()
                .path(input.root)
                .readonly(input.settings.readonly_rootfs.unwrap_or(true))
                .build()?,
        )
        .process(process)
        .mounts(mounts)
        .linux(linux)
        .build()?;
    // Without `container.hostname` the host's UTS namespace is shared: runc refuses to set
    // a hostname then.
    spec.set_hostname(input.hostname.map(str::to_owned));
    spec.set_annotations(None);
    Ok(spec)
}

/// Step 1 of [`spec`]: the host's root, entry by entry.
fn host_root_mounts(input: &BundleInput<'_>) -> Result<Vec<Mount>, BundleError> {
    let mut mounts = Vec::new();
    if input.settings.rootfs.is_some() {
        return Ok(mounts);
    }
    let readonly = input.settings.readonly_rootfs.unwrap_or(true);
    for entry in input.host_root {
        if let HostRootEntry::Bind { path, own_mount } = entry {
            let mut options = vec!["rbind", "rslave"];
            if readonly && !own_mount {
                options.push("ro");
            }
            mounts.push(mount(path, "bind", path, &options)?);
        }
    }
    Ok(mounts)
}

/// Step 2 of [`spec`]: the container's own `/proc`, `/dev`, `/sys` and `/tmp`.
fn own_mounts(input: &BundleInput<'_>) -> Result<Vec<Mount>, BundleError> {
    let privileged = input.privileged;
    let mut mounts = vec![mount(
        Path::new("/proc"),
        "proc",
        Path::new("proc"),
        &["nosuid", "noexec", "nodev"],
    )?];
    if privileged {
        mounts.push(mount(
            Path::new("/dev"),
            "bind",
            Path::new("/dev"),
            &["rbind", "rslave"],
        )?);
    } else {
        mounts.push(mount(
            Path::new("/dev"),
            "tmpfs",
            Path::new("tmpfs"),
            &["nosuid", "strictatime", "mode=755", "size=65536k"],
        )?);
        mounts.push(mount(
            Path::new("/dev/pts"),
            "devpts",
            Path::new("devpts"),
            &[
                "nosuid",
                "noexec",
                "newinstance",
                "ptmxmode=0666",
                "mode=0620",
            ],
        )?);
        mounts.push(mount(
            Path::new("/dev/shm"),
            "tmpfs",
            Path::new("shm"),
            &["nosuid", "noexec", "nodev", "mode=1777", "size=65536k"],
        )?);
        mounts.push(mount(
            Path::new("/dev/mqueue"),
            "mqueue",
            Path::new("mqueue"),
            &["nosuid", "noexec", "nodev"],
        )?);
    }
    // A new sysfs can only be mounted in a network namespace of one's own (EBUSY
    // otherwise): with the host's network, the host's /sys is bound.
    let host_network = input.settings.host_network.unwrap_or(true);
    let sys_options: &[&str] = match (host_network, privileged) {
        (true, true) => &["rbind", "rslave"],
        (true, false) => &["rbind", "rslave", "ro"],
        (false, true) => &["nosuid", "noexec", "nodev"],
        (false, false) => &["nosuid", "noexec", "nodev", "ro"],
    };
    let (sys_type, sys_source) = if host_network {
        ("bind", Path::new("/sys"))
    } else {
        ("sysfs", Path::new("sysfs"))
    };
    mounts.push(mount(Path::new("/sys"), sys_type, sys_source, sys_options)?);
    mounts.push(mount(
        Path::new("/tmp"),
        "tmpfs",
        Path::new("tmpfs"),
        &["nosuid", "nodev", "mode=1777"],
    )?);
    Ok(mounts)
}

/// Step 3 of [`spec`]: binds at the same path (the volumes at theirs), parents before
/// children (a later mount may land inside an earlier one, e.g. a mount root under a
/// volume).
fn bind_mounts(input: &BundleInput<'_>) -> Result<Vec<Mount>, BundleError> {
    let mut binds: Vec<(PathBuf, PathBuf, Vec<&str>)> = Vec::new();
    binds.push((
        input.socket_dir.to_path_buf(),
        input.socket_dir.to_path_buf(),
        vec!["rbind"],
    ));
    for root in input.mount_roots {
        binds.push((root.clone(), root.clone(), vec!["rbind", "rshared"]));
    }
    // The sandbox, writable as under Mesos; `rslave` like the host's root, so that nothing
    // mounted inside goes out.
    if let Some(sandbox) = input.sandbox {
        binds.push((
            sandbox.to_path_buf(),
            sandbox.to_path_buf(),
            vec!["rbind", "rslave"],
        ));
    }
    // On the host's root the container still has its own /tmp (and /dev unless privileged):
    // an executable that lives there (a build tree under /tmp) would be hidden and the launch
    // fail with ENOENT, so the file itself is bound in, read-only, at its path.
    if input.settings.rootfs.is_none()
        && let Some(executable) = input.args.first().map(Path::new)
        && executable.is_absolute()
        && (executable.starts_with("/tmp") || !input.privileged && executable.starts_with("/dev"))
        && !input.sandbox.is_some_and(|s| executable.starts_with(s))
    {
        binds.push((
            executable.to_path_buf(),
            executable.to_path_buf(),
            vec!["bind", "ro"],
        ));
    }
    for volume in input.volumes {
        let mut options = vec!["rbind"];
        options.push(if volume.bidirectional {
            "rshared"
        } else {
            "rslave"
        });
        if volume.readonly {
            options.push("ro");
        }
        binds.push((
            volume.host_path.clone(),
            volume.container_path.clone(),
            options,
        ));
    }
    binds.sort_by_key(|(_, destination, _)| destination.components().count());
    binds
        .iter()
        .map(|(source, destination, options)| mount(destination, "bind", source, options))
        .collect()
}

/// The process: argv, environment, user, capabilities (effective and permitted; bounding
/// as given, else the same) and rlimits (without any, the daemon's are inherited, as with
/// the process runtime).
fn process(input: &BundleInput<'_>) -> Result<oci_spec::runtime::Process, BundleError> {
    let available = |name: &&&str| {
        input
            .available_capabilities
            .is_none_or(|a| a.contains(*name))
    };
    let capability_names: Vec<String> = match (&input.settings.capabilities, input.privileged) {
        (Some(names), _) => names.clone(),
        (None, true) => ALL_CAPABILITIES
            .iter()
            .filter(available)
            .map(|c| (*c).to_owned())
            .collect(),
        (None, false) => DEFAULT_CAPABILITIES
            .iter()
            .filter(available)
            .map(|c| (*c).to_owned())
            .collect(),
    };
    let caps = capabilities(&capability_names)?;
    // Mesos `linux_info` (a bounding set is given): the effective set is also inheritable
    // and ambient, as Mesos's launcher makes it, so that a non-root `command.user` keeps it
    // across `exec`. A root process gets its whole bounding set back at `exec` whatever
    // these say (capabilities(7), "Capabilities and execution of programs by root").
    let (bounding, ambient) = match input.bounding {
        Some(names) => (capabilities(names)?, caps.clone()),
        None => (caps.clone(), HashSet::new()),
    };
    let mut process = ProcessBuilder::default()
        .terminal(false)
        .user(
            UserBuilder::default()
                .uid(input.user.0)
                .gid(input.user.1)
                .additional_gids(input.additional_gids.clone())
                .build()?,
        )
        .args(input.args.clone())
        .env(input.env.clone())
        .cwd(input.cwd.as_str())
        .capabilities(
            LinuxCapabilitiesBuilder::default()
                .bounding(bounding)
                .effective(caps.clone())
                .permitted(caps)
                .inheritable(ambient.clone())
                .ambient(ambient)
                .build()?,
        )
        .no_new_privileges(!input.privileged)
        .build()?;
    // The builders start from oci-spec's defaults (a demo shell container): drop the parts
    // that are not ours.
    let rlimits = input
        .rlimits
        .iter()
        .map(|limit| {
            let typ: PosixRlimitType = serde_json::from_value(serde_json::Value::String(
                limit.typ.clone(),
            ))
            .map_err(|_| BundleError::Rlimit {
                name: limit.typ.clone(),
            })?;
            Ok(PosixRlimitBuilder::default()
                .typ(typ)
                .hard(limit.hard)
                .soft(limit.soft)
                .build()?)
        })
        .collect::<Result<Vec<_>, BundleError>>()?;
    process.set_rlimits((!rlimits.is_empty()).then_some(rlimits));
    Ok(process)
}

/// Namespaces, cgroup and its limits, masked paths.
fn linux(input: &BundleInput<'_>) -> Result<oci_spec::runtime::Linux, BundleError> {
    let settings = input.settings;
    let privileged = input.privileged;
    // Always an own mount namespace (that is the point); an own PID and IPC namespace
    // unless the config shares the host's PID namespace; the host's network by default (a
    // new one would have only loopback) and the host's UTS namespace (node ids are often
    // host names) unless `container.hostname` asks for one of its own.
    let mut types = vec![LinuxNamespaceType::Mount, LinuxNamespaceType::Ipc];
    if !settings.host_pid.unwrap_or(false) {
        types.push(LinuxNamespaceType::Pid);
    }
    if !settings.host_network.unwrap_or(true) {
        types.push(LinuxNamespaceType::Network);
    }
    if input.hostname.is_some() {
        types.push(LinuxNamespaceType::Uts);
    }
    let namespaces = types
        .into_iter()
        .map(|typ| LinuxNamespaceBuilder::default().typ(typ).build())
        .collect::<Result<Vec<_>, _>>()?;
    let mut linux = LinuxBuilder::default()
        .namespaces(namespaces)
        .cgroups_path(PathBuf::from(&input.cgroups_path))
        // The host's mounts stay peers of ours, so that an `rshared` bind of a mount root
        // is in the host's peer group; the `/` bind above is `rslave` so nothing else
        // propagates out.
        .rootfs_propagation("shared")
        .resources(resources(input)?);
    if !privileged {
        linux = linux
            .masked_paths(oci_spec::runtime::get_default_maskedpaths())
            .readonly_paths(oci_spec::runtime::get_default_readonly_paths());
    }
    let mut linux = linux.build()?;
    if privileged {
        // Privileged means the host's view: nothing masked, nothing read-only.
        linux.set_masked_paths(None);
        linux.set_readonly_paths(None);
    }
    Ok(linux)
}

/// The cgroup's devices and limits.
fn resources(input: &BundleInput<'_>) -> Result<oci_spec::runtime::LinuxResources, BundleError> {
    let mut resources = LinuxResourcesBuilder::default();
    if input.privileged {
        resources = resources.devices(vec![
            LinuxDeviceCgroupBuilder::default()
                .allow(true)
                .access("rwm")
                .build()?,
        ]);
    }
    // Mesos semantics: `cpus` is both a share (1024 per CPU, as Mesos's cpu.shares) and a
    // hard quota of that many CPUs; `mem` (MB) a hard limit.
    if let Some(cpus) = input.limits.cpus {
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
        let shares = ((cpus * 1024.0).round() as u64).max(2);
        #[allow(clippy::cast_possible_truncation)]
        let quota = (cpus * CPU_PERIOD_US as f64).round() as i64;
        resources = resources.cpu(
            LinuxCpuBuilder::default()
                .shares(shares)
                .quota(quota)
                .period(CPU_PERIOD_US)
                .build()?,
        );
    }
    if let Some(mem_mb) = input.limits.mem_mb {
        #[allow(clippy::cast_possible_truncation)]
        let bytes = (mem_mb * 1024.0 * 1024.0).round() as i64;
        resources = resources.memory(LinuxMemoryBuilder::default().limit(bytes).build()?);
    }
    Ok(resources.build()?)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn input<'a>(settings: &'a OciConfig, roots: &'a [PathBuf]) -> BundleInput<'a> {
        BundleInput {
            settings,
            privileged: true,
            args: vec!["/bin/plugin".to_owned()],
            env: vec!["CSI_ENDPOINT=unix:///run/s/endpoint.sock".to_owned()],
            root: Path::new("/b/rootfs"),
            host_root: &[],
            socket_dir: Path::new("/run/s"),
            mount_roots: roots,
            volumes: &[],
            cgroups_path: "/csi-agent/x".to_owned(),
            available_capabilities: Some(&["CAP_SYS_ADMIN", "CAP_CHOWN"]),
            limits: Limits {
                cpus: Some(0.5),
                mem_mb: Some(64.0),
            },
            cwd: "/".to_owned(),
            user: (0, 0),
            additional_gids: Vec::new(),
            bounding: None,
            rlimits: &[],
            hostname: None,
            sandbox: None,
        }
    }

    #[test]
    fn an_executable_under_the_containers_own_tmp_is_bound_in() -> anyhow::Result<()> {
        let settings = OciConfig::default();
        let roots = [PathBuf::from("/w/csi/t/default/mounts")];
        let mut input = input(&settings, &roots);
        input.args = vec!["/tmp/build/target/debug/plugin".to_owned()];
        let built = spec(&input)?;
        let mounts = built.mounts().clone().unwrap_or_default();
        let tmp = mounts
            .iter()
            .position(|m| m.destination() == Path::new("/tmp"))
            .ok_or_else(|| anyhow::anyhow!("no /tmp"))?;
        let exe = mounts
            .iter()
            .position(|m| m.destination() == Path::new("/tmp/build/target/debug/plugin"))
            .ok_or_else(|| anyhow::anyhow!("the executable is not bound in"))?;
        assert!(
            exe > tmp,
            "bound after the container's /tmp, not hidden by it"
        );
        assert!(
            mounts[exe]
                .options()
                .as_ref()
                .is_some_and(|o| o.contains(&"ro".to_owned()))
        );
        // Elsewhere on the host's root it is visible as it is: nothing to bind.
        input.args = vec!["/usr/bin/plugin".to_owned()];
        let built = spec(&input)?;
        assert!(
            !built
                .mounts()
                .clone()
                .unwrap_or_default()
                .iter()
                .any(|m| m.destination() == Path::new("/usr/bin/plugin"))
        );
        Ok(())
    }

    #[test]
    fn host_root_node_plugin_shares_its_mount_root() -> anyhow::Result<()> {
        let settings = OciConfig::default();
        let roots = [PathBuf::from("/w/csi/t/default/mounts")];
        let host_root = [
            HostRootEntry::Bind {
                path: PathBuf::from("/etc"),
                own_mount: false,
            },
            HostRootEntry::Bind {
                path: PathBuf::from("/home"),
                own_mount: true,
            },
            HostRootEntry::Symlink {
                path: PathBuf::from("/bin"),
                target: PathBuf::from("usr/bin"),
            },
        ];
        let mut input = input(&settings, &roots);
        input.host_root = &host_root;
        let spec = spec(&input)?;
        let json = serde_json::to_value(&spec)?;
        let mounts = json["mounts"].as_array().cloned().unwrap_or_default();
        // The host's root entry by entry, never one mount on `/` (crun refuses those).
        assert!(mounts.iter().all(|m| m["destination"] != "/"), "{mounts:?}");
        assert_eq!(mounts[0]["destination"], "/etc");
        assert_eq!(mounts[0]["source"], "/etc");
        assert_eq!(
            mounts[0]["options"],
            serde_json::json!(["rbind", "rslave", "ro"])
        );
        // A mount of its own keeps its flags, as under a bind of the whole root.
        assert_eq!(mounts[1]["destination"], "/home");
        assert_eq!(mounts[1]["options"], serde_json::json!(["rbind", "rslave"]));
        // Symlinks are made in rootfs/ by the runtime, not mounted.
        assert!(
            mounts.iter().all(|m| m["destination"] != "/bin"),
            "{mounts:?}"
        );
        let root = mounts
            .iter()
            .find(|m| m["destination"] == "/w/csi/t/default/mounts")
            .ok_or_else(|| anyhow::anyhow!("no mount root in {mounts:?}"))?;
        assert!(
            root["options"]
                .as_array()
                .is_some_and(|o| o.iter().any(|x| x == "rshared")),
            "{root}"
        );
        assert!(mounts.iter().any(|m| m["destination"] == "/run/s"));
        assert_eq!(json["root"]["readonly"], true);
        assert_eq!(json["linux"]["rootfsPropagation"], "shared");
        let caps = json["process"]["capabilities"]["bounding"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        // All capabilities, as far as csi-agent holds them.
        assert_eq!(caps.len(), 2, "{caps:?}");
        assert!(caps.iter().any(|c| c == "CAP_SYS_ADMIN"), "{caps:?}");
        let namespaces: Vec<String> = json["linux"]["namespaces"]
            .as_array()
            .cloned()
            .unwrap_or_default()
            .iter()
            .filter_map(|n| n["type"].as_str().map(str::to_owned))
            .collect();
        assert!(namespaces.contains(&"mount".to_owned()), "{namespaces:?}");
        assert!(
            !namespaces.contains(&"network".to_owned()),
            "{namespaces:?}"
        );
        Ok(())
    }

    #[test]
    fn mesos_isolation_fields_reach_the_spec() -> anyhow::Result<()> {
        let settings = OciConfig {
            capabilities: Some(vec!["CAP_SYS_ADMIN".to_owned()]),
            ..OciConfig::default()
        };
        let bounding = ["CAP_SYS_ADMIN".to_owned(), "CAP_CHOWN".to_owned()];
        let rlimits = [Rlimit {
            typ: "RLIMIT_NOFILE".to_owned(),
            hard: 4096,
            soft: 1024,
        }];
        let mut input = input(&settings, &[]);
        input.bounding = Some(&bounding);
        input.rlimits = &rlimits;
        input.hostname = Some("plugin-1");
        input.sandbox = Some(Path::new("/w/csi/t/default/containers/c"));
        input.args = vec!["/w/csi/t/default/containers/c/plugin".to_owned()];
        let json = serde_json::to_value(spec(&input)?)?;
        let caps = &json["process"]["capabilities"];
        let mut bounding_got: Vec<String> =
            serde_json::from_value(caps["bounding"].clone()).unwrap_or_default();
        bounding_got.sort();
        assert_eq!(bounding_got, vec!["CAP_CHOWN", "CAP_SYS_ADMIN"]);
        assert_eq!(caps["effective"], serde_json::json!(["CAP_SYS_ADMIN"]));
        assert_eq!(caps["ambient"], serde_json::json!(["CAP_SYS_ADMIN"]));
        assert_eq!(
            json["process"]["rlimits"],
            serde_json::json!([{"type": "RLIMIT_NOFILE", "hard": 4096, "soft": 1024}])
        );
        assert_eq!(json["hostname"], "plugin-1");
        let namespaces = json["linux"]["namespaces"].to_string();
        assert!(namespaces.contains("uts"), "{namespaces}");
        let mounts = json["mounts"].as_array().cloned().unwrap_or_default();
        let sandbox: Vec<_> = mounts
            .iter()
            .filter(|m| m["destination"] == "/w/csi/t/default/containers/c")
            .collect();
        assert_eq!(sandbox.len(), 1, "{mounts:?}");
        assert_eq!(sandbox[0]["source"], "/w/csi/t/default/containers/c");
        assert!(!sandbox[0]["options"].to_string().contains("\"ro\""));
        // Without them: no rlimits (the daemon's are inherited), the host's UTS namespace.
        let json = serde_json::to_value(spec(&self::input(&settings, &[]))?)?;
        assert!(json["process"]["rlimits"].is_null(), "{}", json["process"]);
        assert!(json["hostname"].is_null());
        assert!(!json["linux"]["namespaces"].to_string().contains("uts"));
        Ok(())
    }

    #[test]
    fn capabilities_narrow_and_a_rootfs_replaces_the_host_root() -> anyhow::Result<()> {
        let settings = OciConfig {
            rootfs: Some(PathBuf::from("/images/plugin")),
            capabilities: Some(vec!["CAP_SYS_ADMIN".to_owned()]),
            ..OciConfig::default()
        };
        let mut input = input(&settings, &[]);
        input.root = Path::new("/images/plugin");
        let host_root = [HostRootEntry::Bind {
            path: PathBuf::from("/etc"),
            own_mount: false,
        }];
        input.host_root = &host_root;
        let json = serde_json::to_value(spec(&input)?)?;
        assert_eq!(json["root"]["path"], "/images/plugin");
        // An image's root is not mixed with the host's.
        assert_ne!(json["mounts"][0]["destination"], "/etc");
        assert_eq!(
            json["process"]["capabilities"]["bounding"],
            serde_json::json!(["CAP_SYS_ADMIN"])
        );
        Ok(())
    }
}
