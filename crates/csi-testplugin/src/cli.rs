//! Command-line flags and their validation into a [`Config`].
//!
//! Owns: the flag surface (names, defaults, environment fallbacks) and
//! turning it into a checked, typed configuration with clear errors.
//!
//! Must not: touch the file system beyond reading the host name, or start
//! anything.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, bail};
use clap::{Parser, ValueEnum};

use crate::backing::VolumeFs;
use crate::faults::Quirks;
use crate::model::{ApiVersion, validate_volume_name};
use crate::mounts::MountMode;
use crate::plugin::expand::Expansion;
use crate::state::Durability;

/// A real CSI plugin for tests, demos and benchmarks: volumes are
/// directories, node publication is a bind mount, and faults can be injected
/// through a JSON control file. See the crate README.
#[derive(Debug, Parser)]
#[command(name = "csi-testplugin", version)]
pub struct Args {
    /// The socket to serve on: `unix:///abs/path` or `/abs/path`. A stale
    /// socket file is removed before binding.
    #[arg(long, env = "CSI_ENDPOINT")]
    pub endpoint: String,

    /// Root of the plugin's state: `volumes/`, `state.json`, and by default
    /// the fault file and the call log. Also `--work_dir`, the flag of Mesos's
    /// `test-csi-plugin`, so Mesos's sample configs run this plugin unchanged.
    #[arg(long, env = "CSI_TESTPLUGIN_WORK_DIR", alias = "work_dir")]
    pub work_dir: PathBuf,

    /// The node id answered by NodeGetInfo/NodeGetId (default: host name).
    #[arg(long, env = "CSI_NODE_ID")]
    pub node_id: Option<String>,

    /// A backend shared with the plugin instances of other nodes, as networked storage is:
    /// the volumes, their catalogue and their attachments live under DIR, and every
    /// Controller/Node RPC and every refused attach is recorded there (see the README).
    #[arg(long, env = "CSI_TESTPLUGIN_BACKEND_DIR")]
    pub backend_dir: Option<PathBuf>,

    /// CSI versions to serve on the socket, comma-separated: `v1`, `v0.3`,
    /// `v0.2` (at most one v0 flavour).
    #[arg(long, default_value = "v1,v0.3")]
    pub api_versions: String,

    /// Pre-provisioned volumes created at start if absent: `name:size,...`
    /// (size in bytes, or with an SI suffix k/M/G/T/P or an IEC one Ki/Mi/Gi/Ti/Pi).
    #[arg(long, value_delimiter = ',')]
    pub volumes: Vec<String>,

    /// A numbered series of pre-provisioned volumes: `PREFIX:COUNT:SIZE`
    /// makes `PREFIX00000` … up to COUNT volumes, numbered from 0 with at
    /// least five digits (`v:3:1M` is `v00000`, `v00001`, `v00002`). For
    /// benchmarks with many volumes, whose names would otherwise fill the
    /// plugin's command line (and the config csi-agent keeps of it).
    #[arg(long)]
    pub volume_series: Option<String>,

    /// Total capacity of the pool in bytes (suffixes as for --volumes). Also
    /// `--available_capacity`, Mesos's `test-csi-plugin` flag, whose `2GB`
    /// (Mesos's `Bytes`: binary multiples) means 2 GiB here too.
    #[arg(long, default_value = "1T", alias = "available_capacity")]
    pub capacity: String,

    /// Advertise and serve STAGE_UNSTAGE_VOLUME (default).
    #[arg(long, overrides_with = "no_stage_unstage")]
    pub stage_unstage: bool,
    /// Do not advertise STAGE_UNSTAGE_VOLUME; NodeStage/NodeUnstage answer
    /// UNIMPLEMENTED.
    #[arg(long, overrides_with = "stage_unstage")]
    pub no_stage_unstage: bool,

    /// Advertise and serve PUBLISH_UNPUBLISH_VOLUME (default).
    #[arg(long, overrides_with = "no_controller_publish")]
    pub controller_publish: bool,
    /// Do not advertise PUBLISH_UNPUBLISH_VOLUME; ControllerPublish and
    /// ControllerUnpublish answer UNIMPLEMENTED.
    #[arg(long, overrides_with = "controller_publish")]
    pub no_controller_publish: bool,

    /// `bind`: real bind mounts; `none`: bookkeeping only (no mount
    /// syscalls; target directories are still created/removed per spec).
    #[arg(long, value_enum, default_value_t = MountModeArg::Bind)]
    pub mount_mode: MountModeArg,

    /// What backs each volume's directory: `dir`, a plain directory; `tmpfs`,
    /// a tmpfs of the volume's capacity mounted on it (needs root), so that
    /// the volume has a file system of its own to measure and to grow.
    #[arg(long, value_enum, default_value_t = VolumeFsArg::Dir)]
    pub volume_fs: VolumeFsArg,

    /// The plugin name answered by GetPluginInfo.
    #[arg(long, default_value = "org.example.test")]
    pub plugin_name: String,

    /// A different plugin name for the v0 services (a real-world quirk).
    #[arg(long)]
    pub v0_plugin_name: Option<String>,

    /// Fault-injection control file (default `<work-dir>/faults.json`).
    #[arg(long)]
    pub faults: Option<PathBuf>,

    /// Call log, one JSON line per RPC (default `<work-dir>/calls.jsonl`).
    #[arg(long)]
    pub call_log: Option<PathBuf>,

    /// Record each request's secrets in the call log (tests only!).
    #[arg(long)]
    pub record_secrets: bool,

    /// On SIGTERM/SIGINT, keep serving this long before exiting (a slow exit).
    #[arg(long, default_value_t = 0)]
    pub exit_delay_ms: u64,

    /// Wait this long before creating the socket (a slow start).
    #[arg(long, default_value_t = 0)]
    pub startup_delay_ms: u64,

    /// Quirk: leave the socket file behind on SIGTERM/SIGINT.
    #[arg(long)]
    pub leave_socket: bool,

    /// Keep the bookkeeping in memory only: `state.json` is neither read nor
    /// written (benchmarks at 100,000 volumes, where rewriting the whole file
    /// per commit would dominate). A restarted plugin forgets its records.
    #[arg(long)]
    pub volatile_state: bool,

    /// Quirk: answer `ready=false` to the first N probes.
    #[arg(long, default_value_t = 0)]
    pub probe_not_ready: u64,

    /// Quirk: answer Probe with an empty message (no `ready`).
    #[arg(long)]
    pub empty_probe: bool,

    /// Quirk: duplicate capability entries plus an UNKNOWN one.
    #[arg(long)]
    pub duplicate_capabilities: bool,

    /// Controller capabilities not to advertise, by their spec names
    /// (`LIST_VOLUMES,GET_CAPACITY`): a plugin that lacks them, as many do. The RPCs still
    /// answer if called (a CO must not call them).
    #[arg(long, value_delimiter = ',')]
    pub hide_controller_capabilities: Vec<String>,

    /// Serve the block access type: a volume created for block is a sparse file
    /// `<work-dir>/blocks/<id>.img`, attached to a loop device at NodeStage and bind-mounted
    /// onto the target file at NodePublish. Off: block capabilities are refused.
    #[arg(long)]
    pub block: bool,

    /// Advertise and serve CREATE_DELETE_SNAPSHOT and LIST_SNAPSHOTS (v1):
    /// snapshots are copies of the volume's data under `<work-dir>/snapshots`.
    #[arg(long)]
    pub snapshots: bool,

    /// Advertise CLONE_VOLUME (v1): CreateVolume from another volume copies its data.
    #[arg(long)]
    pub clones: bool,

    /// With --snapshots: the first N CreateSnapshot answers for a new snapshot
    /// say `ready_to_use: false` (a snapshot still being processed).
    #[arg(long, default_value_t = 0)]
    pub snapshot_ready_after: u32,

    /// Quirk: report an empty vendor_version.
    #[arg(long)]
    pub empty_vendor_version: bool,

    /// This node's topology, `KEY=VALUE[,KEY=VALUE...]` (`zone=a,rack=1`): advertises the
    /// plugin capability VOLUME_ACCESSIBILITY_CONSTRAINTS (v1), answers it in NodeGetInfo, and
    /// CreateVolume/GetCapacity honour topology requirements. Off (no topology) by default.
    #[arg(long)]
    pub topology: Option<String>,

    /// NodeGetInfo's `max_volumes_per_node` (0: no limit, the default). ControllerPublishVolume
    /// refuses a volume more with RESOURCE_EXHAUSTED.
    #[arg(long, default_value_t = 0)]
    pub max_volumes_per_node: i64,

    /// Advertise the controller capability GET_VOLUME and answer ControllerGetVolume (v1).
    #[arg(long)]
    pub get_volume: bool,

    /// Advertise and serve NodeGetVolumeStats (node GET_VOLUME_STATS): bytes and
    /// inodes from `statvfs` of the volume's backing directory.
    #[arg(long)]
    pub volume_stats: bool,

    /// Advertise VOLUME_CONDITION: NodeGetVolumeStats (and, with --get-volume,
    /// ControllerGetVolume) also reports the volume's condition, abnormal when the fault
    /// file's `abnormal` names the volume.
    #[arg(long)]
    pub volume_condition: bool,

    /// Advertise the plugin capability VolumeExpansion of this type: `online` (volumes
    /// grow while published) or `offline` (ControllerExpandVolume refuses a volume in use).
    #[arg(long, value_enum)]
    pub expansion: Option<ExpansionArg>,

    /// Advertise and serve the controller capability EXPAND_VOLUME (CSI v1).
    #[arg(long)]
    pub controller_expand: bool,

    /// Advertise and serve the node capability EXPAND_VOLUME (CSI v1): ControllerExpandVolume
    /// then answers `node_expansion_required`, and NodeExpandVolume grows the file system.
    #[arg(long)]
    pub node_expand: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum ExpansionArg {
    Online,
    Offline,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum VolumeFsArg {
    Dir,
    Tmpfs,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum MountModeArg {
    Bind,
    None,
}

/// The validated configuration.
#[derive(Clone, Debug)]
pub struct Config {
    pub socket: PathBuf,
    pub work_dir: PathBuf,
    pub node_id: String,
    /// `--backend-dir`: the backend shared with other nodes' instances (absolute).
    pub backend_dir: Option<PathBuf>,
    pub serve_v1: bool,
    pub v0: Option<ApiVersion>,
    pub volumes: Vec<(String, i64)>,
    pub capacity: i64,
    pub stage_unstage: bool,
    pub controller_publish: bool,
    pub mount_mode: MountMode,
    pub volume_fs: VolumeFs,
    pub plugin_name: String,
    pub v0_plugin_name: String,
    pub faults_path: PathBuf,
    pub call_log_path: PathBuf,
    pub record_secrets: bool,
    pub exit_delay: Duration,
    pub startup_delay: Duration,
    pub leave_socket: bool,
    pub state_durability: Durability,
    pub quirks: Quirks,
    /// Controller capability numbers not advertised (`--hide-controller-capabilities`).
    pub hidden_controller_caps: Vec<i32>,
    /// `--block`: the block access type is served.
    pub block: bool,
    /// `--expansion`: the VolumeExpansion plugin capability, if advertised.
    pub expansion: Option<Expansion>,
    /// `--controller-expand`.
    pub controller_expand: bool,
    /// `--node-expand`.
    pub node_expand: bool,
    /// `--volume-stats`.
    pub volume_stats: bool,
    /// `--volume-condition`.
    pub volume_condition: bool,
    /// `--topology`; empty: the plugin has no topology.
    pub topology: crate::topology::Segments,
    /// `--max-volumes-per-node`; 0: no limit.
    pub max_volumes_per_node: i64,
    /// `--get-volume`.
    pub get_volume: bool,
    /// `--snapshots`.
    pub snapshots: bool,
    /// `--clones`.
    pub clones: bool,
    /// `--snapshot-ready-after`.
    pub snapshot_ready_after: u32,
}

/// Sizes follow csi-agent's one convention ([`csi_agent_api::size`]): `1G` is 10^9 bytes,
/// `1Gi` 2^30.
pub fn parse_size(s: &str) -> anyhow::Result<i64> {
    csi_agent_api::size::parse_size(s).map_err(|err| anyhow::anyhow!("size {s:?}: {err}"))
}

/// Mesos's `Bytes` suffixes (`KB`, `MB`, `GB`, `TB`: binary multiples) in the IEC form
/// [`parse_size`] reads; anything else unchanged.
fn mesos_bytes(s: &str) -> String {
    for (mesos, iec) in [("KB", "Ki"), ("MB", "Mi"), ("GB", "Gi"), ("TB", "Ti")] {
        if let Some(number) = s.strip_suffix(mesos) {
            return format!("{number}{iec}");
        }
    }
    s.to_owned()
}

/// Accepts `unix:///abs` or a bare absolute path (some plugins get a plain
/// path in `CSI_ENDPOINT`).
pub fn parse_endpoint(s: &str) -> anyhow::Result<PathBuf> {
    let path = s.strip_prefix("unix://").unwrap_or(s);
    if !path.starts_with('/') {
        bail!("endpoint {s:?} must be unix:///absolute/path or an absolute path");
    }
    // sockaddr_un.sun_path is 108 bytes including the terminating NUL.
    if path.len() > 107 {
        bail!(
            "endpoint path is {} bytes; unix socket paths are limited to 107",
            path.len()
        );
    }
    Ok(PathBuf::from(path))
}

fn hostname() -> String {
    rustix::system::uname()
        .nodename()
        .to_string_lossy()
        .into_owned()
}

impl Args {
    /// `--backend-dir`, made absolute, refused with the flags whose data or devices would
    /// stay on one node (a tmpfs or loop device lives in one node's kernel, snapshots in its
    /// work dir) and without the controller publication that records attachments.
    fn check_backend(&self, dir: PathBuf) -> anyhow::Result<PathBuf> {
        let refused = [
            (
                self.no_controller_publish,
                "--no-controller-publish (attachments are recorded by ControllerPublishVolume)",
            ),
            (
                self.volume_fs == VolumeFsArg::Tmpfs,
                "--volume-fs tmpfs (a tmpfs is one node's memory)",
            ),
            (self.block, "--block (a loop device is one node's)"),
            (
                self.snapshots,
                "--snapshots (snapshots live in the work dir)",
            ),
        ];
        if let Some((_, flag)) = refused.iter().find(|(given, _)| *given) {
            bail!("--backend-dir cannot be combined with {flag}; drop one of the two");
        }
        if dir.as_os_str().is_empty() {
            bail!("--backend-dir must not be empty");
        }
        Ok(if dir.is_absolute() {
            dir
        } else {
            std::env::current_dir()?.join(dir)
        })
    }

    pub fn into_config(self) -> anyhow::Result<Config> {
        let backend_dir = match self.backend_dir.clone() {
            Some(dir) => Some(self.check_backend(dir)?),
            None => None,
        };
        let socket = parse_endpoint(&self.endpoint)?;
        let mut serve_v1 = false;
        let mut v0: Option<ApiVersion> = None;
        for part in self
            .api_versions
            .split(',')
            .filter(|p| !p.trim().is_empty())
        {
            match ApiVersion::parse(part) {
                Some(ApiVersion::V1) => serve_v1 = true,
                Some(v) => match v0 {
                    Some(prev) if prev != v => bail!(
                        "--api-versions: at most one v0 flavour (both {} and {} given); \
                         v0.2 and v0.3 share the csi.v0 package on one socket",
                        prev.as_str(),
                        v.as_str()
                    ),
                    _ => v0 = Some(v),
                },
                None => bail!("--api-versions: unknown version {part:?} (v1, v0.3, v0.2)"),
            }
        }
        if !serve_v1 && v0.is_none() {
            bail!("--api-versions: nothing to serve");
        }

        let node_id = self.node_id.unwrap_or_else(hostname);
        if node_id.is_empty() || node_id.len() > 256 {
            bail!("node id must be 1..=256 bytes (spec: NodeGetInfoResponse.node_id)");
        }

        let mut volumes = Vec::new();
        for v in self.volumes.iter().filter(|v| !v.trim().is_empty()) {
            let (name, size) = v
                .rsplit_once(':')
                .with_context(|| format!("--volumes entry {v:?} is not name:size"))?;
            validate_volume_name(name).map_err(|e| anyhow::anyhow!("--volumes {v:?}: {e}"))?;
            volumes.push((name.to_owned(), parse_size(size)?));
        }
        if let Some(series) = &self.volume_series {
            volumes.extend(volume_series(series)?);
        }
        let capacity = parse_size(&mesos_bytes(&self.capacity))?;

        let work_dir = if self.work_dir.is_absolute() {
            self.work_dir.clone()
        } else {
            std::env::current_dir()?.join(&self.work_dir)
        };
        let faults_path = self.faults.unwrap_or_else(|| work_dir.join("faults.json"));
        let call_log_path = self
            .call_log
            .unwrap_or_else(|| work_dir.join("calls.jsonl"));
        Ok(Config {
            socket,
            node_id,
            backend_dir,
            serve_v1,
            v0,
            volumes,
            capacity,
            // The positive flags exist so that a later flag can re-enable a
            // default turned off earlier (clap keeps the last of the pair).
            stage_unstage: !self.no_stage_unstage,
            controller_publish: !self.no_controller_publish,
            mount_mode: match self.mount_mode {
                MountModeArg::Bind => MountMode::Bind,
                MountModeArg::None => MountMode::None,
            },
            volume_fs: match self.volume_fs {
                VolumeFsArg::Dir => VolumeFs::Dir,
                VolumeFsArg::Tmpfs => VolumeFs::Tmpfs,
            },
            v0_plugin_name: self
                .v0_plugin_name
                .unwrap_or_else(|| self.plugin_name.clone()),
            plugin_name: self.plugin_name,
            faults_path,
            call_log_path,
            record_secrets: self.record_secrets,
            exit_delay: Duration::from_millis(self.exit_delay_ms),
            startup_delay: Duration::from_millis(self.startup_delay_ms),
            leave_socket: self.leave_socket,
            state_durability: if self.volatile_state {
                Durability::Volatile
            } else {
                Durability::Durable
            },
            block: self.block,
            volume_stats: self.volume_stats,
            volume_condition: self.volume_condition,
            snapshots: self.snapshots,
            clones: self.clones,
            snapshot_ready_after: self.snapshot_ready_after,
            hidden_controller_caps: self
                .hide_controller_capabilities
                .iter()
                .filter(|name| !name.trim().is_empty())
                .map(|name| {
                    csi_proto::v1::controller_service_capability::rpc::Type::from_str_name(
                        name.trim(),
                    )
                    .map(|t| t as i32)
                    .with_context(|| {
                        format!(
                            "--hide-controller-capabilities: unknown capability {name:?} \
                                 (spec names: LIST_VOLUMES, GET_CAPACITY, ...)"
                        )
                    })
                })
                .collect::<anyhow::Result<_>>()?,
            expansion: self.expansion.map(|e| match e {
                ExpansionArg::Online => Expansion::Online,
                ExpansionArg::Offline => Expansion::Offline,
            }),
            controller_expand: self.controller_expand,
            node_expand: self.node_expand,
            topology: crate::topology::parse(self.topology.as_deref().unwrap_or_default())?,
            max_volumes_per_node: if self.max_volumes_per_node < 0 {
                bail!(
                    "--max-volumes-per-node {} must not be negative (0: no limit)",
                    self.max_volumes_per_node
                )
            } else {
                self.max_volumes_per_node
            },
            get_volume: self.get_volume,
            quirks: Quirks {
                probe_not_ready: self.probe_not_ready,
                empty_probe: self.empty_probe,
                duplicate_capabilities: self.duplicate_capabilities,
                empty_vendor_version: self.empty_vendor_version,
            },
            work_dir,
        })
    }
}

/// The volumes of `--volume-series PREFIX:COUNT:SIZE`.
fn volume_series(series: &str) -> anyhow::Result<Vec<(String, i64)>> {
    let fields: Vec<&str> = series.split(':').collect();
    let [prefix, count, size] = fields[..] else {
        bail!("--volume-series {series:?} is not PREFIX:COUNT:SIZE");
    };
    let count: usize = count
        .parse()
        .with_context(|| format!("--volume-series {series:?}: COUNT {count:?} is not a number"))?;
    if count > 10_000_000 {
        bail!("--volume-series {series:?}: at most 10000000 volumes");
    }
    let size = parse_size(size)?;
    (0..count)
        .map(|i| {
            let name = format!("{prefix}{i:05}");
            validate_volume_name(&name)
                .map_err(|e| anyhow::anyhow!("--volume-series {series:?}: {e}"))?;
            Ok((name, size))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(args: &[&str]) -> anyhow::Result<Config> {
        let mut v = vec![
            "csi-testplugin",
            "--endpoint",
            "/tmp/x.sock",
            "--work-dir",
            "/tmp/w",
        ];
        v.extend_from_slice(args);
        Args::try_parse_from(v)?.into_config()
    }

    #[test]
    fn sizes() -> anyhow::Result<()> {
        assert_eq!(parse_size("10")?, 10);
        assert_eq!(parse_size("1K")?, 1000);
        assert_eq!(parse_size("1Ki")?, 1024);
        assert_eq!(parse_size("1Gi")?, 1 << 30);
        assert_eq!(parse_size("2TiB")?, 2 << 40);
        assert!(parse_size("1X").is_err());
        assert!(parse_size("x").is_err());
        assert!(parse_size("99999999P").is_err());
        Ok(())
    }

    #[test]
    fn endpoints() -> anyhow::Result<()> {
        assert_eq!(parse_endpoint("unix:///a/b")?, PathBuf::from("/a/b"));
        assert_eq!(parse_endpoint("/a/b")?, PathBuf::from("/a/b"));
        assert!(parse_endpoint("unix://rel").is_err());
        assert!(parse_endpoint(&format!("/{}", "x".repeat(200))).is_err());
        Ok(())
    }

    #[test]
    fn versions() -> anyhow::Result<()> {
        let c = cfg(&[])?;
        assert!(c.serve_v1);
        assert_eq!(c.v0, Some(ApiVersion::V0_3));
        let c = cfg(&["--api-versions", "v0.2"])?;
        assert!(!c.serve_v1);
        assert_eq!(c.v0, Some(ApiVersion::V0_2));
        let e = cfg(&["--api-versions", "v1,v0.2,v0.3"])
            .err()
            .map(|e| e.to_string());
        assert!(e.is_some_and(|e| e.contains("at most one v0 flavour")));
        assert!(cfg(&["--api-versions", "v2"]).is_err());
        Ok(())
    }

    #[test]
    fn switches_and_volumes() -> anyhow::Result<()> {
        let c = cfg(&["--no-stage-unstage", "--no-controller-publish"])?;
        assert!(!c.stage_unstage && !c.controller_publish);
        let c = cfg(&["--no-stage-unstage", "--stage-unstage"])?;
        assert!(c.stage_unstage);
        let c = cfg(&["--volumes", "a:1Gi,b:10"])?;
        assert_eq!(c.volumes, vec![("a".into(), 1 << 30), ("b".into(), 10)]);
        assert!(cfg(&["--volumes", "a/b:1"]).is_err());
        let c = cfg(&["--volumes", "a:1", "--volume-series", "v:3:1M"])?;
        let names: Vec<&str> = c.volumes.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names, ["a", "v00000", "v00001", "v00002"]);
        assert_eq!(c.volumes[3].1, 1_000_000);
        assert!(cfg(&["--volume-series", "v:3"]).is_err());
        assert!(cfg(&["--volume-series", "v/x:3:1M"]).is_err());
        assert!(cfg(&["--volume-series", "v:many:1M"]).is_err());
        assert_eq!(c.faults_path, PathBuf::from("/tmp/w/faults.json"));
        Ok(())
    }
}
