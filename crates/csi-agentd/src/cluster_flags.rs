//! Cluster mode's flags (`--cluster-etcd`, `--cluster-name`, `--node-name`, …) and their TOML
//! twins: parsed and checked here, handed to the engine as a `ClusterSetup`
//! (docs/cluster.md, docs/configuration.md).
//!
//! Must not: decide anything about claims (the engine's `cluster` module does) or log the
//! etcd password.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, bail};
use csi_agent::cluster::ClusterOptions;
use csi_agent::server::ClusterSetup;

/// The flags; each may also come from the TOML file (flags win).
#[derive(Debug, Default, clap::Args)]
pub struct ClusterArgs {
    /// Cluster mode: the etcd (v3 API, 3.4 or later) client URLs, comma-separated, e.g.
    /// `http://10.0.0.1:2379,http://10.0.0.2:2379`. Plugins whose config says
    /// `"cluster": true` are then claimed across nodes before use (docs/cluster.md). Off by
    /// default.
    #[arg(long, value_name = "URL[,URL…]")]
    cluster_etcd: Option<String>,
    /// The cluster's name: the key prefix in etcd, the same on every node (default `default`).
    #[arg(long)]
    cluster_name: Option<String>,
    /// This node's name in the cluster, unique among its nodes (default: the host name).
    #[arg(long)]
    node_name: Option<String>,
    /// The node's lease in etcd, in seconds: its presence vanishes this long after its last
    /// keepalive (default 10; at least 2). A node that vanishes keeps its volumes.
    #[arg(long)]
    cluster_lease_ttl_secs: Option<u64>,
    /// Deadline of each etcd request, in milliseconds (default 2000).
    #[arg(long)]
    cluster_etcd_timeout_ms: Option<u64>,
    /// An etcd user (with `--cluster-etcd-password-file`).
    #[arg(long)]
    cluster_etcd_user: Option<String>,
    /// A file holding the etcd user's password (never on the command line).
    #[arg(long)]
    cluster_etcd_password_file: Option<PathBuf>,
}

/// The TOML twins of [`ClusterArgs`] (fields of the file's top level: serde cannot deny
/// unknown fields through a flattened struct, so `serve` copies them here).
#[derive(Debug, Default)]
pub struct ClusterFile {
    pub cluster_etcd: Option<String>,
    pub cluster_name: Option<String>,
    pub node_name: Option<String>,
    pub cluster_lease_ttl_secs: Option<u64>,
    pub cluster_etcd_timeout_ms: Option<u64>,
    pub cluster_etcd_user: Option<String>,
    pub cluster_etcd_password_file: Option<PathBuf>,
}

/// Cluster mode's effective settings (the etcd client is made at start).
#[derive(Clone, Debug)]
pub struct ClusterSettings {
    pub endpoints: Vec<String>,
    pub options: ClusterOptions,
    pub request_timeout: Duration,
    pub user: Option<(String, PathBuf)>,
}

const DEFAULT_CLUSTER_NAME: &str = "default";
const DEFAULT_LEASE_TTL_SECS: u64 = 10;
const MIN_LEASE_TTL_SECS: u64 = 2;
const DEFAULT_ETCD_TIMEOUT_MS: u64 = 2000;

/// Checks the flags (and file); `None` when cluster mode is off.
pub fn settings(
    args: ClusterArgs,
    file: ClusterFile,
    host_name: &str,
) -> anyhow::Result<Option<ClusterSettings>> {
    let Some(etcd) = args.cluster_etcd.or(file.cluster_etcd) else {
        let stray = [
            (
                "--cluster-name",
                args.cluster_name.is_some() || file.cluster_name.is_some(),
            ),
            (
                "--node-name",
                args.node_name.is_some() || file.node_name.is_some(),
            ),
        ];
        if let Some((flag, _)) = stray.iter().find(|(_, set)| *set) {
            bail!("{flag} is given without --cluster-etcd: cluster mode needs etcd's URLs");
        }
        return Ok(None);
    };
    let endpoints: Vec<String> = etcd
        .split(',')
        .map(str::trim)
        .filter(|e| !e.is_empty())
        .map(str::to_owned)
        .collect();
    if endpoints.is_empty() {
        bail!("--cluster-etcd {etcd:?} names no URL; give http://HOST:PORT[,http://HOST:PORT…]");
    }
    for endpoint in &endpoints {
        if !(endpoint.starts_with("http://") || endpoint.starts_with("https://")) {
            bail!(
                "--cluster-etcd: {endpoint:?} is not an http:// or https:// URL (e.g. http://127.0.0.1:2379)"
            );
        }
    }
    let name = args
        .cluster_name
        .or(file.cluster_name)
        .unwrap_or_else(|| DEFAULT_CLUSTER_NAME.to_owned());
    csi_agent::config::validate_name(&name)
        .with_context(|| format!("--cluster-name {name:?} is not valid"))?;
    let node = args
        .node_name
        .or(file.node_name)
        .unwrap_or_else(|| host_name.to_owned());
    csi_agent::config::validate_name(&node).with_context(|| {
        format!("--node-name {node:?} is not valid (the host name is the default)")
    })?;
    let ttl = args
        .cluster_lease_ttl_secs
        .or(file.cluster_lease_ttl_secs)
        .unwrap_or(DEFAULT_LEASE_TTL_SECS);
    if ttl < MIN_LEASE_TTL_SECS {
        bail!(
            "--cluster-lease-ttl-secs {ttl} is below {MIN_LEASE_TTL_SECS}: etcd's leases cannot be kept reliably that short"
        );
    }
    let timeout = args
        .cluster_etcd_timeout_ms
        .or(file.cluster_etcd_timeout_ms)
        .unwrap_or(DEFAULT_ETCD_TIMEOUT_MS);
    if timeout == 0 {
        bail!("--cluster-etcd-timeout-ms must be more than 0");
    }
    let user = match (
        args.cluster_etcd_user.or(file.cluster_etcd_user),
        args.cluster_etcd_password_file
            .or(file.cluster_etcd_password_file),
    ) {
        (None, None) => None,
        (Some(user), Some(file)) => Some((user, file)),
        (Some(_), None) => bail!("--cluster-etcd-user needs --cluster-etcd-password-file"),
        (None, Some(_)) => bail!("--cluster-etcd-password-file needs --cluster-etcd-user"),
    };
    Ok(Some(ClusterSettings {
        endpoints,
        options: ClusterOptions {
            name,
            node,
            lease_ttl: Duration::from_secs(ttl),
        },
        request_timeout: Duration::from_millis(timeout),
        user,
    }))
}

/// The engine's cluster setup: the etcd client over the endpoints (connections are made on
/// first use, so a daemon starts while etcd is down and joins when it answers).
pub async fn setup(settings: &ClusterSettings) -> anyhow::Result<ClusterSetup> {
    let user = match &settings.user {
        None => None,
        Some((user, file)) => {
            let password = std::fs::read_to_string(file).with_context(|| {
                format!(
                    "cannot read --cluster-etcd-password-file {}",
                    file.display()
                )
            })?;
            Some((
                user.clone(),
                password.trim_end_matches(['\n', '\r']).to_owned(),
            ))
        }
    };
    let store = csi_agent::cluster::etcd::EtcdStore::connect(
        settings.endpoints.clone(),
        settings.request_timeout,
        user,
    )
    .await
    .context("--cluster-etcd")?;
    Ok(ClusterSetup {
        options: settings.options.clone(),
        store: Arc::new(store),
    })
}
