//! The command line: clap definitions, and the parsers for values clap cannot check alone
//! (`KEY=VALUE` lists, sizes with suffixes, access modes).
//!
//! This module owns what the user may type and how it turns into API request values. It must
//! not talk to the daemon or print anything, and it must never echo a secret value, not even in
//! an error message or `{:?}`.

use std::collections::BTreeMap;
use std::fmt;
use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Parser, Subcommand, ValueEnum};
use csi_agent_api::{CapabilitySpec, VolumeQuery};

/// Where `--socket` points when neither the flag nor `CSI_AGENT_SOCKET` is given: the socket of
/// a daemon started with `--work-dir ./csi-agent-state`, as in the README's demo.
pub const DEFAULT_SOCKET: &str = "./csi-agent-state/api.sock";

const DEFAULT_ACCESS_MODE: &str = "SINGLE_NODE_WRITER";

#[derive(Debug, Parser)]
#[command(
    name = "csictl",
    version,
    about = "Talk to csi-agentd: publish and unpublish volumes, inspect plugins and volumes, \
             create and delete volumes",
    after_help = "Exit status: 0 success, 1 the daemon refused or failed the request, 2 usage \
                  error, 3 cannot reach the daemon."
)]
pub struct Cli {
    #[command(flatten)]
    pub global: Global,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Args)]
#[command(next_help_heading = "Global options")]
pub struct Global {
    /// csi-agentd's API socket (`<work dir>/api.sock`).
    #[arg(
        long,
        global = true,
        env = "CSI_AGENT_SOCKET",
        default_value = DEFAULT_SOCKET,
        value_name = "PATH"
    )]
    pub socket: PathBuf,

    /// Use csi-agentd's TCP listener at this URL (http://HOST:PORT) instead of the socket.
    #[arg(long, global = true, env = "CSI_AGENT_URL", value_name = "URL")]
    pub url: Option<String>,

    /// A file holding the bearer token for --url (the socket needs none).
    #[arg(long, global = true, env = "CSI_AGENT_TOKEN_FILE", value_name = "PATH")]
    pub token_file: Option<PathBuf>,

    /// How to print answers: aligned tables for people, or the API's JSON for programs.
    #[arg(long, short = 'o', global = true, value_enum, default_value_t = OutputFormat::Table)]
    pub output: OutputFormat,

    /// Give up after this many seconds (default: wait as long as the daemon takes; a publish may
    /// wait through a plugin restart).
    #[arg(long, global = true, value_name = "SECONDS", value_parser = parse_seconds)]
    pub timeout: Option<Duration>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum OutputFormat {
    Table,
    Json,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Is the daemon up, and is its start gate open?
    Health,
    /// Open the start gate: let the daemon launch plugins and serve volumes (idempotent).
    Start,
    /// Print the Prometheus metrics (always as text).
    Metrics,
    /// List the plugins and the configuration files that failed to load, or show one plugin.
    Plugins {
        /// Show this plugin type only (also accepted as the positional TYPE).
        #[arg(long = "plugin", value_name = "TYPE", conflicts_with = "plugin_type")]
        plugin_flag: Option<String>,
        #[arg(value_name = "TYPE")]
        plugin_type: Option<String>,
    },
    /// Re-read the plugin configuration directory (as SIGHUP does).
    Reload,
    /// Stop the node: refuse new operations, wait for those in flight, unpublish every claim,
    /// then stop every plugin, leaving nothing mounted. Exits 1 and lists what is left when
    /// anything is. The daemon then publishes nothing until it is restarted
    /// (docs/operations.md).
    Drain {
        /// Seconds the daemon waits for the operations in flight, and then again for the
        /// unpublishes (default 60). The global --timeout is the client's own limit.
        #[arg(long, value_name = "SECONDS", value_parser = clap::value_parser!(u64).range(1..=86_400))]
        wait: Option<u64>,
    },
    /// List the daemon's plugin images and the plugins that use them.
    Images,
    /// Pull a plugin image into the daemon's store (`image pull REF`).
    #[command(subcommand)]
    Image(crate::image::ImageCommand),
    /// Publish a volume for a workload and print the host path to bind-mount.
    Publish(PublishArgs),
    /// Remove a workload's claim on a volume; the last claim's removal unpublishes it.
    Unpublish(UnpublishArgs),
    /// List the volumes csi-agent tracks (filtered and paged), or show one (--plugin and
    /// --volume, or PLUGIN VOLUME_ID).
    Volumes(VolumesArgs),
    /// Create a volume through the plugin's controller (CreateVolume).
    Create(CreateArgs),
    /// Delete a volume through the plugin's controller (DeleteVolume).
    Delete(VolumeRef),
    /// Ask the plugin whether a volume supports access modes (ValidateVolumeCapabilities).
    Validate(ValidateArgs),
    /// List one page of the plugin's own volumes (ListVolumes).
    BackendVolumes(BackendVolumesArgs),
    /// Ask the plugin how much capacity is available (GetCapacity).
    Capacity(CapacityArgs),
    /// Grow a volume to SIZE (ControllerExpandVolume, then NodeExpandVolume where the
    /// plugin needs it): `csictl expand PLUGIN VOLUME_ID 1Gi`. Prints the volume with its
    /// new capacity.
    Expand(crate::expand::ExpandArgs),
    /// Show a published volume's usage (bytes, inodes) and condition, as its plugin reports
    /// them (NodeGetVolumeStats; the latest background sample, or one taken now).
    Stats(VolumeRef),
    /// Create, delete or list a plugin's snapshots (CreateSnapshot, DeleteSnapshot,
    /// ListSnapshots).
    #[command(subcommand)]
    Snapshot(crate::snapshot::SnapshotCommand),
    /// Cluster mode (csi-agentd --cluster-etcd): this node's session, the nodes, the claims
    /// held in etcd, and the fence of a lost node.
    #[command(subcommand)]
    Cluster(crate::cluster::ClusterCommand),
}

/// A volume named the same way by every command: `--plugin TYPE --volume VOLUME_ID`, or the
/// positionals `PLUGIN VOLUME_ID` (either one of a pair may be a flag, the other positional).
#[derive(Debug, Args)]
pub struct VolumeRef {
    /// The plugin's type, e.g. org.example.lvm.
    #[arg(long = "plugin", value_name = "TYPE")]
    plugin_flag: Option<String>,
    /// The CSI volume id.
    #[arg(long = "volume", value_name = "VOLUME_ID")]
    volume_flag: Option<String>,
    /// PLUGIN VOLUME_ID, as an alternative to the flags.
    #[arg(value_name = "PLUGIN VOLUME_ID", num_args = 0..=2)]
    positional: Vec<String>,
}

impl VolumeRef {
    /// The plugin type and the volume id, from the flags or the positionals.
    pub fn resolve(&self) -> Result<(String, String), UsageError> {
        match plugin_and_volume(&self.plugin_flag, &self.volume_flag, &self.positional)? {
            (Some(plugin), Some(volume)) => Ok((plugin, volume)),
            (None, _) => Err(UsageError(
                "no plugin given: add --plugin TYPE (or PLUGIN VOLUME_ID)".to_owned(),
            )),
            (Some(_), None) => Err(UsageError(
                "no volume given: add --volume VOLUME_ID (or PLUGIN VOLUME_ID)".to_owned(),
            )),
        }
    }
}

/// `csictl volumes`: one volume, or the list with the API's filters.
#[derive(Debug, Args)]
pub struct VolumesArgs {
    /// Only this plugin's volumes (with --volume or VOLUME_ID: show that one volume).
    #[arg(long = "plugin", value_name = "TYPE")]
    plugin_flag: Option<String>,
    /// Show this volume only (needs the plugin).
    #[arg(long = "volume", value_name = "VOLUME_ID")]
    volume_flag: Option<String>,
    /// PLUGIN [VOLUME_ID], as an alternative to the flags.
    #[arg(value_name = "PLUGIN VOLUME_ID", num_args = 0..=2)]
    positional: Vec<String>,
    /// Only volumes in this state (PUBLISHED, NODE_STAGE, ...).
    #[arg(long, value_name = "STATE")]
    pub state: Option<String>,
    /// Only volumes this workload claims.
    #[arg(long, value_name = "ID")]
    pub workload: Option<String>,
    /// At most this many volumes (1 to 10000); the next page's token is printed.
    #[arg(long, value_name = "N")]
    pub limit: Option<usize>,
    /// The token printed with the previous page.
    #[arg(long, value_name = "TOKEN")]
    pub page_token: Option<String>,
}

impl VolumesArgs {
    /// `Some((plugin, volume))` to show one volume, `None` to list.
    pub fn one(&self) -> Result<Option<(String, String)>, UsageError> {
        let (plugin, volume) = self.plugin_and_volume()?;
        match (plugin, volume) {
            (Some(plugin), Some(volume)) => {
                if self.state.is_some()
                    || self.workload.is_some()
                    || self.limit.is_some()
                    || self.page_token.is_some()
                {
                    return Err(UsageError(
                        "--state, --workload, --limit and --page-token filter the list; \
                         drop them to show one volume"
                            .to_owned(),
                    ));
                }
                Ok(Some((plugin, volume)))
            }
            (None, Some(_)) => Err(UsageError(
                "a volume id needs its plugin: add --plugin TYPE".to_owned(),
            )),
            _ => Ok(None),
        }
    }

    /// The list's query (the plugin filter from --plugin or PLUGIN).
    pub fn query(&self) -> Result<VolumeQuery, UsageError> {
        let (plugin, _) = self.plugin_and_volume()?;
        Ok(VolumeQuery {
            plugin,
            state: self.state.clone(),
            workload: self.workload.clone(),
            limit: self.limit,
            page_token: self.page_token.clone(),
        })
    }

    fn plugin_and_volume(&self) -> Result<(Option<String>, Option<String>), UsageError> {
        plugin_and_volume(&self.plugin_flag, &self.volume_flag, &self.positional)
    }
}

/// The plugin and the volume from their flags, else from the positionals in that order (the
/// flags' place taken by the first free positionals); more positionals than that is an error.
pub(crate) fn plugin_and_volume(
    plugin_flag: &Option<String>,
    volume_flag: &Option<String>,
    positional: &[String],
) -> Result<(Option<String>, Option<String>), UsageError> {
    let mut positional = positional.iter().cloned();
    let plugin = plugin_flag.clone().or_else(|| positional.next());
    let volume = volume_flag.clone().or_else(|| positional.next());
    if positional.next().is_some() {
        return Err(UsageError(
            "too many arguments: give the plugin and the volume once, as --plugin TYPE \
             --volume VOLUME_ID or as PLUGIN VOLUME_ID"
                .to_owned(),
        ));
    }
    Ok((plugin, volume))
}

/// How a volume is accessed: a filesystem (`--fs-type`, `--mount-flag`) or a raw device.
#[derive(Debug, Args)]
pub struct AccessType {
    /// Access the volume as a raw block device instead of a filesystem.
    #[arg(long, conflicts_with_all = ["fs_type", "mount_flags"])]
    pub block: bool,
    /// Filesystem type (default: the plugin's choice).
    #[arg(long, value_name = "TYPE")]
    pub fs_type: Option<String>,
    /// A mount flag; repeat for several.
    #[arg(long = "mount-flag", value_name = "FLAG")]
    pub mount_flags: Vec<String>,
}

impl AccessType {
    pub fn capability(&self, access_mode: &str) -> CapabilitySpec {
        if self.block {
            CapabilitySpec::block(access_mode)
        } else {
            CapabilitySpec::mount(
                access_mode,
                self.fs_type.as_deref().unwrap_or_default(),
                self.mount_flags.clone(),
            )
        }
    }
}

#[derive(Debug, Args)]
pub struct PublishArgs {
    #[command(flatten)]
    pub volume: VolumeRef,
    /// The consumer, usually a container id.
    #[arg(long, default_value = "default", value_name = "ID")]
    pub workload: String,
    /// CSI access mode, e.g. SINGLE_NODE_WRITER, SINGLE_NODE_READER_ONLY,
    /// MULTI_NODE_MULTI_WRITER (case-insensitive, `-` for `_`).
    #[arg(long, value_parser = parse_access_mode, default_value = DEFAULT_ACCESS_MODE, value_name = "MODE")]
    pub access_mode: String,
    #[command(flatten)]
    pub access_type: AccessType,
    /// Publish read-only.
    #[arg(long)]
    pub readonly: bool,
    /// Volume context entry (default: the context returned when csi-agent created the volume).
    #[arg(long = "context", value_name = "KEY=VALUE")]
    pub context: Vec<String>,
    /// Secret for NodeStageVolume; prefer --secrets-file, as the command line is visible to
    /// other users of the host.
    #[arg(long = "stage-secret", value_name = "KEY=VALUE", value_parser = secret_arg)]
    pub stage_secrets: Vec<SecretArg>,
    /// Secret for NodePublishVolume; prefer --secrets-file.
    #[arg(long = "publish-secret", value_name = "KEY=VALUE", value_parser = secret_arg)]
    pub publish_secrets: Vec<SecretArg>,
    /// A JSON file `{"node_stage": {..}, "node_publish": {..}}` with the secrets; entries given
    /// with --stage-secret/--publish-secret are added to it.
    #[arg(long, value_name = "PATH")]
    pub secrets_file: Option<PathBuf>,
    /// An absolute path where csi-agent bind-mounts the published volume for the workload.
    #[arg(long, value_name = "PATH")]
    pub bind_to: Option<String>,
}

#[derive(Debug, Args)]
pub struct UnpublishArgs {
    #[command(flatten)]
    pub volume: VolumeRef,
    /// The consumer whose claim is removed.
    #[arg(long, default_value = "default", value_name = "ID")]
    pub workload: String,
}

#[derive(Debug, Args)]
pub struct CreateArgs {
    #[arg(long, value_name = "TYPE")]
    pub plugin: String,
    /// The volume's name: the idempotency key of the creation.
    #[arg(long)]
    pub name: String,
    /// Requested size in bytes; suffixes k M G T P (powers of 1000) or Ki Mi Gi Ti Pi (powers
    /// of 1024), e.g. 10Gi. Default: the plugin's choice.
    #[arg(long, value_parser = csi_agent_api::size::parse_size, value_name = "BYTES")]
    pub capacity: Option<i64>,
    /// CSI access mode, e.g. SINGLE_NODE_WRITER, SINGLE_NODE_READER_ONLY,
    /// MULTI_NODE_MULTI_WRITER (case-insensitive, `-` for `_`).
    #[arg(long, value_parser = parse_access_mode, default_value = DEFAULT_ACCESS_MODE, value_name = "MODE")]
    pub access_mode: String,
    #[command(flatten)]
    pub access_type: AccessType,
    /// A CreateVolume parameter; repeat for several.
    #[arg(long = "param", value_name = "KEY=VALUE")]
    pub params: Vec<String>,
    /// A topology the volume must be accessible from (one of those given), e.g.
    /// zone=a,rack=1; repeat for several. Default: this node's topology, for a plugin that has
    /// one.
    #[arg(long = "requisite", value_name = "KEY=VALUE,...")]
    pub requisite: Vec<String>,
    /// A topology to try first, in order; repeat for several.
    #[arg(long = "preferred", value_name = "KEY=VALUE,...")]
    pub preferred: Vec<String>,
    /// Restore this snapshot into the new volume (the plugin needs CREATE_DELETE_SNAPSHOT).
    #[arg(long, value_name = "SNAPSHOT_ID", conflicts_with = "from_volume")]
    pub from_snapshot: Option<String>,
    /// Clone this volume of the same plugin (the plugin needs CLONE_VOLUME).
    #[arg(long, value_name = "VOLUME_ID")]
    pub from_volume: Option<String>,
}

#[derive(Debug, Args)]
pub struct ValidateArgs {
    #[command(flatten)]
    pub volume: VolumeRef,
    /// An access mode to validate; repeat for several (default SINGLE_NODE_WRITER).
    #[arg(long = "access-mode", value_parser = parse_access_mode, value_name = "MODE")]
    pub access_modes: Vec<String>,
    #[command(flatten)]
    pub access_type: AccessType,
    #[arg(long = "context", value_name = "KEY=VALUE")]
    pub context: Vec<String>,
    #[arg(long = "param", value_name = "KEY=VALUE")]
    pub params: Vec<String>,
}

impl ValidateArgs {
    pub fn capabilities(&self) -> Vec<CapabilitySpec> {
        if self.access_modes.is_empty() {
            return vec![self.access_type.capability(DEFAULT_ACCESS_MODE)];
        }
        self.access_modes
            .iter()
            .map(|mode| self.access_type.capability(mode))
            .collect()
    }
}

#[derive(Debug, Args)]
pub struct BackendVolumesArgs {
    #[arg(long, value_name = "TYPE")]
    pub plugin: String,
    /// At most this many volumes in the page (default: the plugin's choice).
    #[arg(long, value_name = "N")]
    pub max_entries: Option<u32>,
    /// The token printed with the previous page.
    #[arg(long, value_name = "TOKEN")]
    pub starting_token: Option<String>,
}

#[derive(Debug, Args)]
pub struct CapacityArgs {
    #[arg(long, value_name = "TYPE")]
    pub plugin: String,
    /// Count only capacity usable with this access mode; repeat for several (default: any).
    #[arg(long = "access-mode", value_parser = parse_access_mode, value_name = "MODE")]
    pub access_modes: Vec<String>,
    #[command(flatten)]
    pub access_type: AccessType,
    /// A GetCapacity parameter; repeat for several.
    #[arg(long = "param", value_name = "KEY=VALUE")]
    pub params: Vec<String>,
    /// Only the capacity usable in this topology, e.g. zone=a,rack=1.
    #[arg(long = "topology", value_name = "KEY=VALUE,...")]
    pub topology: Option<String>,
}

impl CapacityArgs {
    pub fn capabilities(&self) -> Vec<CapabilitySpec> {
        self.access_modes
            .iter()
            .map(|mode| self.access_type.capability(mode))
            .collect()
    }
}

/// A `KEY=VALUE` secret as typed; its `Debug` never shows the value.
#[derive(Clone)]
pub struct SecretArg(pub String);

impl fmt::Debug for SecretArg {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("SecretArg(<redacted>)")
    }
}

// Infallible: the split into key and value happens later, where the error message can name the
// flag without quoting the secret.
fn secret_arg(raw: &str) -> Result<SecretArg, std::convert::Infallible> {
    Ok(SecretArg(raw.to_owned()))
}

/// A usage error found after clap: it exits 2 like clap's own.
#[derive(Debug, PartialEq, Eq)]
pub struct UsageError(pub String);

impl fmt::Display for UsageError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// Parses the `KEY=VALUE` items of one flag into a map. The flag's name is in every message so
/// the user knows which one to fix. Duplicate keys are refused rather than letting the last one
/// win silently.
pub fn parse_pairs(flag: &str, items: &[String]) -> Result<BTreeMap<String, String>, UsageError> {
    parse_pairs_inner(flag, items.iter().map(String::as_str), false)
}

/// As [`parse_pairs`], for secrets: messages never contain the value, nor the item as typed
/// (which may be the bare secret).
pub fn parse_secret_pairs(
    flag: &str,
    items: &[SecretArg],
) -> Result<BTreeMap<String, String>, UsageError> {
    parse_pairs_inner(flag, items.iter().map(|s| s.0.as_str()), true)
}

fn parse_pairs_inner<'a>(
    flag: &str,
    items: impl Iterator<Item = &'a str>,
    secret: bool,
) -> Result<BTreeMap<String, String>, UsageError> {
    let mut map = BTreeMap::new();
    for item in items {
        let Some((key, value)) = item.split_once('=') else {
            return Err(UsageError(if secret {
                format!("{flag} expects KEY=VALUE, got a value without '=' (not shown: secret)")
            } else {
                format!("{flag} expects KEY=VALUE, got '{item}'")
            }));
        };
        if key.is_empty() {
            return Err(UsageError(if secret {
                format!("{flag} expects KEY=VALUE, got an empty KEY")
            } else {
                format!("{flag} expects KEY=VALUE, got an empty KEY in '{item}'")
            }));
        }
        if map.insert(key.to_owned(), value.to_owned()).is_some() {
            return Err(UsageError(format!("{flag} gives the key '{key}' twice")));
        }
    }
    Ok(map)
}

/// An access mode that is none of the API's ([`parse_access_mode`]); clap prints it after
/// the flag and the value.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct UnknownAccessMode;

impl fmt::Display for UnknownAccessMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "unknown access mode; expected one of {}",
            CapabilitySpec::ACCESS_MODES.join(", ")
        )
    }
}

impl std::error::Error for UnknownAccessMode {}

/// A `--timeout` that is not a positive number of seconds ([`parse_seconds`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BadSeconds;

impl fmt::Display for BadSeconds {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("expected a positive number of seconds, e.g. 30 or 0.5")
    }
}

impl std::error::Error for BadSeconds {}

/// An access mode, case-insensitive, with `-` accepted for `_` (`single-node-writer`).
pub fn parse_access_mode(raw: &str) -> Result<String, UnknownAccessMode> {
    let normal = raw.trim().to_ascii_uppercase().replace('-', "_");
    if CapabilitySpec::ACCESS_MODES.contains(&normal.as_str()) {
        Ok(normal)
    } else {
        Err(UnknownAccessMode)
    }
}

fn parse_seconds(raw: &str) -> Result<Duration, BadSeconds> {
    match raw.trim().parse::<f64>() {
        Ok(secs) if secs.is_finite() && secs > 0.0 && secs < 1e9 => {
            Ok(Duration::from_secs_f64(secs))
        }
        _ => Err(BadSeconds),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    fn parse(args: &[&str]) -> Result<Cli, clap::Error> {
        Cli::try_parse_from(std::iter::once("csictl").chain(args.iter().copied()))
    }

    fn strings(items: &[&str]) -> Vec<String> {
        items.iter().map(|s| (*s).to_owned()).collect()
    }

    #[test]
    fn clap_definition_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn publish_defaults() -> Result<(), clap::Error> {
        let cli = parse(&["publish", "--plugin", "p", "--volume", "v"])?;
        let Command::Publish(args) = cli.command else {
            panic!("not publish");
        };
        assert_eq!(args.volume.resolve(), Ok(("p".to_owned(), "v".to_owned())));
        assert_eq!(args.workload, "default");
        assert_eq!(args.access_mode, "SINGLE_NODE_WRITER");
        assert!(!args.readonly && !args.access_type.block);
        assert_eq!(
            args.access_type.capability(&args.access_mode),
            CapabilitySpec::mount("SINGLE_NODE_WRITER", "", vec![])
        );
        assert_eq!(cli.global.output, OutputFormat::Table);
        Ok(())
    }

    #[test]
    fn publish_all_options() -> Result<(), clap::Error> {
        let cli = parse(&[
            "publish",
            "--plugin",
            "p",
            "--volume",
            "v",
            "--workload",
            "c1",
            "--access-mode",
            "multi-node-reader-only",
            "--fs-type",
            "xfs",
            "--mount-flag",
            "noatime",
            "--mount-flag",
            "nodev",
            "--readonly",
            "--context",
            "a=b",
            "--stage-secret",
            "user=admin",
            "--publish-secret",
            "token=x",
            "--bind-to",
            "/run/c1/data",
            "--output",
            "json",
        ])?;
        let Command::Publish(args) = cli.command else {
            panic!("not publish");
        };
        assert_eq!(args.workload, "c1");
        assert_eq!(
            args.access_type.capability(&args.access_mode),
            CapabilitySpec::mount(
                "MULTI_NODE_READER_ONLY",
                "xfs",
                strings(&["noatime", "nodev"])
            )
        );
        assert!(args.readonly);
        assert_eq!(args.context, strings(&["a=b"]));
        assert_eq!(args.stage_secrets.len(), 1);
        assert_eq!(args.publish_secrets.len(), 1);
        assert_eq!(args.bind_to.as_deref(), Some("/run/c1/data"));
        assert_eq!(cli.global.output, OutputFormat::Json);
        Ok(())
    }

    #[test]
    fn block_conflicts_with_fs_type() {
        let err = parse(&[
            "publish",
            "--plugin",
            "p",
            "--volume",
            "v",
            "--block",
            "--fs-type",
            "ext4",
        ]);
        assert!(err.is_err());
    }

    #[test]
    fn block_capability() -> Result<(), clap::Error> {
        let cli = parse(&["create", "--plugin", "p", "--name", "n", "--block"])?;
        let Command::Create(args) = cli.command else {
            panic!("not create");
        };
        assert_eq!(
            args.access_type.capability(&args.access_mode),
            CapabilitySpec::block("SINGLE_NODE_WRITER")
        );
        assert_eq!(args.capacity, None);
        Ok(())
    }

    #[test]
    fn create_capacity_and_params() -> Result<(), clap::Error> {
        let cli = parse(&[
            "create",
            "--plugin",
            "p",
            "--name",
            "n",
            "--capacity",
            "1Gi",
            "--param",
            "pool=fast",
        ])?;
        let Command::Create(args) = cli.command else {
            panic!("not create");
        };
        assert_eq!(args.capacity, Some(1 << 30));
        assert_eq!(args.params, strings(&["pool=fast"]));
        Ok(())
    }

    #[test]
    fn a_volume_is_named_by_flags_or_positionals_alike() -> Result<(), clap::Error> {
        let pair = Ok(("p".to_owned(), "a/b".to_owned()));
        for args in [
            &["unpublish", "--plugin", "p", "--volume", "a/b"][..],
            &["unpublish", "p", "a/b"],
            &["unpublish", "--plugin", "p", "a/b"],
            &["unpublish", "--volume", "a/b", "p"],
        ] {
            let Command::Unpublish(unpublish) = parse(args)?.command else {
                panic!("not unpublish");
            };
            assert_eq!(unpublish.volume.resolve(), pair, "{args:?}");
        }
        let Command::Delete(volume) = parse(&["delete", "p"])?.command else {
            panic!("not delete");
        };
        assert!(volume.resolve().is_err_and(|e| e.0.contains("--volume")));
        let Command::Delete(volume) = parse(&["delete", "--plugin", "p", "x", "y"])?.command else {
            panic!("not delete");
        };
        assert!(volume.resolve().is_err_and(|e| e.0.contains("too many")));
        Ok(())
    }

    #[test]
    fn volumes_lists_with_filters_or_shows_one() -> Result<(), clap::Error> {
        let Command::Volumes(all) = parse(&["volumes"])?.command else {
            panic!("not volumes");
        };
        assert_eq!(all.one(), Ok(None));
        assert_eq!(all.query(), Ok(VolumeQuery::default()));
        for args in [
            &["volumes", "p", "a/b"][..],
            &["volumes", "--plugin", "p", "--volume", "a/b"],
        ] {
            let Command::Volumes(one) = parse(args)?.command else {
                panic!("not volumes");
            };
            assert_eq!(one.one(), Ok(Some(("p".to_owned(), "a/b".to_owned()))));
        }
        let Command::Volumes(filtered) = parse(&[
            "volumes",
            "p",
            "--state",
            "PUBLISHED",
            "--workload",
            "w",
            "--limit",
            "5",
        ])?
        .command
        else {
            panic!("not volumes");
        };
        assert_eq!(filtered.one(), Ok(None));
        assert_eq!(
            filtered.query(),
            Ok(VolumeQuery {
                plugin: Some("p".to_owned()),
                state: Some("PUBLISHED".to_owned()),
                workload: Some("w".to_owned()),
                limit: Some(5),
                page_token: None,
            })
        );
        let Command::Volumes(volume_only) = parse(&["volumes", "--volume", "v"])?.command else {
            panic!("not volumes");
        };
        assert!(volume_only.one().is_err_and(|e| e.0.contains("--plugin")));
        Ok(())
    }

    #[test]
    fn global_flags_go_anywhere() -> Result<(), clap::Error> {
        let cli = parse(&["health", "--socket", "/x/api.sock", "-o", "json"])?;
        assert_eq!(cli.global.socket, PathBuf::from("/x/api.sock"));
        assert_eq!(cli.global.output, OutputFormat::Json);
        let cli = parse(&["--url", "http://h:1", "--token-file", "/t", "health"])?;
        assert_eq!(cli.global.url.as_deref(), Some("http://h:1"));
        assert_eq!(cli.global.token_file, Some(PathBuf::from("/t")));
        let cli = parse(&["--timeout", "1.5", "health"])?;
        assert_eq!(cli.global.timeout, Some(Duration::from_millis(1500)));
        assert!(parse(&["--timeout", "0", "health"]).is_err());
        Ok(())
    }

    #[test]
    fn validate_and_capacity_capabilities() -> Result<(), clap::Error> {
        let cli = parse(&["validate", "--plugin", "p", "--volume", "v"])?;
        let Command::Validate(args) = cli.command else {
            panic!("not validate");
        };
        assert_eq!(
            args.capabilities(),
            vec![CapabilitySpec::mount("SINGLE_NODE_WRITER", "", vec![])]
        );
        let cli = parse(&[
            "validate",
            "--plugin",
            "p",
            "--volume",
            "v",
            "--access-mode",
            "SINGLE_NODE_WRITER",
            "--access-mode",
            "MULTI_NODE_MULTI_WRITER",
            "--block",
        ])?;
        let Command::Validate(args) = cli.command else {
            panic!("not validate");
        };
        assert_eq!(
            args.capabilities(),
            vec![
                CapabilitySpec::block("SINGLE_NODE_WRITER"),
                CapabilitySpec::block("MULTI_NODE_MULTI_WRITER")
            ]
        );

        let cli = parse(&["capacity", "--plugin", "p"])?;
        let Command::Capacity(args) = cli.command else {
            panic!("not capacity");
        };
        assert!(args.capabilities().is_empty());
        Ok(())
    }

    #[test]
    fn pairs_parse() {
        assert_eq!(
            parse_pairs("--context", &strings(&["a=b", "c=d=e", "f="])),
            Ok(BTreeMap::from([
                ("a".to_owned(), "b".to_owned()),
                ("c".to_owned(), "d=e".to_owned()),
                ("f".to_owned(), String::new()),
            ]))
        );
        assert_eq!(parse_pairs("--param", &[]), Ok(BTreeMap::new()));
    }

    #[test]
    fn pair_errors_name_the_flag() {
        assert_eq!(
            parse_pairs("--context", &strings(&["x"])),
            Err(UsageError(
                "--context expects KEY=VALUE, got 'x'".to_owned()
            ))
        );
        assert_eq!(
            parse_pairs("--param", &strings(&["=v"])),
            Err(UsageError(
                "--param expects KEY=VALUE, got an empty KEY in '=v'".to_owned()
            ))
        );
        assert_eq!(
            parse_pairs("--param", &strings(&["a=1", "a=2"])),
            Err(UsageError("--param gives the key 'a' twice".to_owned()))
        );
    }

    #[test]
    fn secret_errors_never_show_the_secret() {
        for items in [&["hunter2"][..], &["=hunter2"], &["k=hunter2", "k=hunter2"]] {
            let items: Vec<SecretArg> = items.iter().map(|s| SecretArg((*s).to_owned())).collect();
            let Err(err) = parse_secret_pairs("--stage-secret", &items) else {
                panic!("accepted {items:?}");
            };
            assert!(err.0.starts_with("--stage-secret"), "{err}");
            assert!(!err.0.contains("hunter2"), "{err}");
        }
        assert!(!format!("{:?}", SecretArg("k=hunter2".to_owned())).contains("hunter2"));
    }

    #[test]
    fn access_modes_parse() {
        assert_eq!(
            parse_access_mode("single-node-reader-only"),
            Ok("SINGLE_NODE_READER_ONLY".to_owned())
        );
        assert_eq!(
            parse_access_mode("MULTI_NODE_MULTI_WRITER"),
            Ok("MULTI_NODE_MULTI_WRITER".to_owned())
        );
        assert_eq!(parse_access_mode("rw"), Err(UnknownAccessMode));
        let err = UnknownAccessMode.to_string();
        assert!(err.contains("SINGLE_NODE_WRITER"), "{err}");
    }
}
