//! Cluster mode's flags (`--cluster-etcd`, `--cluster-name`, `--node-name`, …) and their TOML
//! twins: parsed and checked here, handed to the engine as a `ClusterSetup`
//! (docs/cluster.md, docs/configuration.md).
//!
//! TLS to etcd (`--cluster-etcd-ca`, `--cluster-etcd-cert`, `--cluster-etcd-key`): the
//! combination is checked here with the flags and the files are read (bounded) with them, so a
//! refusal stops the daemon before it binds or serves anything.
//!
//! Must not: decide anything about claims (the engine's `cluster` module does) or log the
//! etcd password or the TLS key.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, bail};
use csi_agent::cluster::ClusterOptions;
use csi_agent::cluster::etcd::TlsOptions;
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
    /// TLS to etcd (`https://` URLs): a PEM file of the CA that signed etcd's server
    /// certificates; the only CA trusted. Required with `https://`.
    #[arg(long, value_name = "FILE")]
    cluster_etcd_ca: Option<PathBuf>,
    /// TLS to etcd: a PEM file of this node's client certificate, when etcd runs with
    /// `--client-cert-auth` (with `--cluster-etcd-key`).
    #[arg(long, value_name = "FILE")]
    cluster_etcd_cert: Option<PathBuf>,
    /// TLS to etcd: a PEM file of the client certificate's private key (with
    /// `--cluster-etcd-cert`).
    #[arg(long, value_name = "FILE")]
    cluster_etcd_key: Option<PathBuf>,
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
    pub cluster_etcd_ca: Option<PathBuf>,
    pub cluster_etcd_cert: Option<PathBuf>,
    pub cluster_etcd_key: Option<PathBuf>,
}

/// The TLS files to etcd: their paths (for messages) and their content (its `Debug` shows
/// only whether a CA and an identity are set).
#[derive(Clone, Debug)]
pub struct TlsFiles {
    /// `--cluster-etcd-ca`.
    pub ca: PathBuf,
    /// `--cluster-etcd-cert` and `--cluster-etcd-key`.
    pub identity: Option<(PathBuf, PathBuf)>,
    /// What the files hold, read by [`settings`].
    pub pem: Option<TlsOptions>,
}

impl TlsFiles {
    /// The flags and files, for a message.
    fn describe(&self) -> String {
        let mut text = format!("--cluster-etcd-ca {}", self.ca.display());
        if let Some((cert, key)) = &self.identity {
            text.push_str(&format!(
                ", --cluster-etcd-cert {}, --cluster-etcd-key {}",
                cert.display(),
                key.display()
            ));
        }
        text
    }
}

/// Cluster mode's effective settings (the etcd client is made at start).
#[derive(Clone, Debug)]
pub struct ClusterSettings {
    pub endpoints: Vec<String>,
    pub options: ClusterOptions,
    pub request_timeout: Duration,
    pub user: Option<(String, PathBuf)>,
    pub tls: Option<TlsFiles>,
}

const DEFAULT_CLUSTER_NAME: &str = "default";
const DEFAULT_LEASE_TTL_SECS: u64 = 10;
const MIN_LEASE_TTL_SECS: u64 = 2;
const DEFAULT_ETCD_TIMEOUT_MS: u64 = 2000;
/// The most bytes read from each TLS file (a CA bundle, a certificate chain, a key).
const MAX_TLS_FILE_BYTES: u64 = 1024 * 1024;

/// Checks the flags (and file); `None` when cluster mode is off.
pub fn settings(
    args: ClusterArgs,
    file: ClusterFile,
    host_name: &str,
) -> anyhow::Result<Option<ClusterSettings>> {
    let ca = args.cluster_etcd_ca.or(file.cluster_etcd_ca);
    let cert = args.cluster_etcd_cert.or(file.cluster_etcd_cert);
    let key = args.cluster_etcd_key.or(file.cluster_etcd_key);
    let Some(etcd) = args.cluster_etcd.or(file.cluster_etcd) else {
        let stray = [
            ("--cluster-etcd-ca", ca.is_some()),
            ("--cluster-etcd-cert", cert.is_some()),
            ("--cluster-etcd-key", key.is_some()),
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
    let tls = match tls_files(&endpoints, ca, cert, key)? {
        None => None,
        Some(mut files) => {
            let pem = TlsOptions {
                ca_pem: read_tls_file("--cluster-etcd-ca", &files.ca)?,
                identity: match &files.identity {
                    None => None,
                    Some((cert, key)) => Some((
                        read_tls_file("--cluster-etcd-cert", cert)?,
                        read_tls_file("--cluster-etcd-key", key)?,
                    )),
                },
            };
            if let Err(why) = pem.check() {
                bail!("{why} (files: {})", files.describe());
            }
            files.pem = Some(pem);
            Some(files)
        }
    };
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
        tls,
    }))
}

/// Checks the TLS flags against the endpoints' schemes: `https://` needs the CA, the TLS
/// flags need `https://` everywhere, and the client certificate and key come together.
fn tls_files(
    endpoints: &[String],
    ca: Option<PathBuf>,
    cert: Option<PathBuf>,
    key: Option<PathBuf>,
) -> anyhow::Result<Option<TlsFiles>> {
    let identity = match (cert, key) {
        (None, None) => None,
        (Some(cert), Some(key)) => Some((cert, key)),
        (Some(cert), None) => bail!(
            "--cluster-etcd-cert {} is given without --cluster-etcd-key: give the client certificate's private key too (both or neither)",
            cert.display()
        ),
        (None, Some(key)) => bail!(
            "--cluster-etcd-key {} is given without --cluster-etcd-cert: give the client certificate too (both or neither)",
            key.display()
        ),
    };
    let https = endpoints.iter().find(|e| e.starts_with("https://"));
    let http = endpoints.iter().find(|e| e.starts_with("http://"));
    match (ca, https, http) {
        (None, None, _) => {
            if let Some((cert, _)) = identity {
                bail!(
                    "--cluster-etcd-cert {} is given but --cluster-etcd names no https:// URL: give https://HOST:PORT URLs and --cluster-etcd-ca, or drop the TLS flags",
                    cert.display()
                );
            }
            Ok(None)
        }
        (None, Some(https), _) => bail!(
            "--cluster-etcd {https:?} is https:// but no --cluster-etcd-ca FILE is given: give the PEM file of the CA that signed etcd's server certificates"
        ),
        (Some(ca), _, Some(http)) => bail!(
            "--cluster-etcd-ca {} is given but --cluster-etcd {http:?} is plain http://: give https:// for every URL, or drop the TLS flags",
            ca.display()
        ),
        (Some(ca), _, None) => Ok(Some(TlsFiles {
            ca,
            identity,
            pem: None,
        })),
    }
}

/// Reads a TLS file given with `flag`, at most [`MAX_TLS_FILE_BYTES`]; refusals name the flag
/// and the file.
fn read_tls_file(flag: &str, path: &Path) -> anyhow::Result<Vec<u8>> {
    let file = std::fs::File::open(path).with_context(|| {
        format!(
            "cannot read {flag} {}: give a readable PEM file",
            path.display()
        )
    })?;
    let mut bytes = Vec::new();
    file.take(MAX_TLS_FILE_BYTES + 1)
        .read_to_end(&mut bytes)
        .with_context(|| {
            format!(
                "cannot read {flag} {}: give a readable PEM file",
                path.display()
            )
        })?;
    if bytes.len() as u64 > MAX_TLS_FILE_BYTES {
        bail!(
            "{flag} {} is larger than {} KiB: give the PEM file itself",
            path.display(),
            MAX_TLS_FILE_BYTES / 1024
        );
    }
    if bytes.is_empty() {
        bail!("{flag} {} is empty: give a PEM file", path.display());
    }
    Ok(bytes)
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
    let tls = settings.tls.as_ref().and_then(|files| files.pem.clone());
    let store = csi_agent::cluster::etcd::EtcdStore::connect(
        settings.endpoints.clone(),
        settings.request_timeout,
        user,
        tls,
    )
    .await
    .with_context(|| match &settings.tls {
        None => "--cluster-etcd".to_owned(),
        Some(files) => format!("--cluster-etcd with {}", files.describe()),
    })?;
    Ok(ClusterSetup {
        options: settings.options.clone(),
        store: Arc::new(store),
    })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn urls(list: &[&str]) -> Vec<String> {
        list.iter().map(|s| (*s).to_owned()).collect()
    }

    #[test]
    fn tls_flags_must_match_the_schemes_and_come_in_pairs() {
        let p = |s: &str| Some(PathBuf::from(s));
        assert!(
            tls_files(&urls(&["http://a:1"]), None, None, None)
                .unwrap()
                .is_none()
        );
        let files = tls_files(&urls(&["https://a:1"]), p("/ca"), p("/c"), p("/k"))
            .unwrap()
            .unwrap();
        assert_eq!(files.ca, PathBuf::from("/ca"));
        assert!(files.identity.is_some());
        for (endpoints, ca, cert, key, words) in [
            (
                &["https://a:1"][..],
                None,
                None,
                None,
                &["https://a:1", "--cluster-etcd-ca FILE"][..],
            ),
            (
                &["https://a:1"],
                p("/ca"),
                p("/c"),
                None,
                &["--cluster-etcd-cert /c", "--cluster-etcd-key"],
            ),
            (
                &["https://a:1"],
                p("/ca"),
                None,
                p("/k"),
                &["--cluster-etcd-key /k", "--cluster-etcd-cert"],
            ),
            (
                &["https://a:1", "http://b:1"],
                p("/ca"),
                None,
                None,
                &["--cluster-etcd-ca /ca", "http://b:1"],
            ),
            (
                &["http://a:1"],
                None,
                p("/c"),
                p("/k"),
                &["--cluster-etcd-cert /c", "https://"],
            ),
        ] {
            let err = tls_files(&urls(endpoints), ca, cert, key)
                .unwrap_err()
                .to_string();
            for word in words {
                assert!(err.contains(word), "{word:?} not in {err}");
            }
        }
    }

    #[test]
    fn tls_files_are_read_bounded_and_refusals_name_flag_and_file() {
        let dir = tempfile::tempdir().unwrap();
        let ok = dir.path().join("ok.pem");
        std::fs::write(&ok, "pem").unwrap();
        assert_eq!(read_tls_file("--cluster-etcd-ca", &ok).unwrap(), b"pem");
        let empty = dir.path().join("empty.pem");
        std::fs::write(&empty, "").unwrap();
        let big = dir.path().join("big.pem");
        std::fs::write(&big, vec![b'x'; 1024 * 1024 + 1]).unwrap();
        let missing = dir.path().join("missing.pem");
        for (file, word) in [
            (&empty, "empty"),
            (&big, "larger than"),
            (&missing, "cannot read"),
        ] {
            let err = format!(
                "{:#}",
                read_tls_file("--cluster-etcd-key", file).unwrap_err()
            );
            assert!(err.contains("--cluster-etcd-key"), "{err}");
            assert!(err.contains(&file.display().to_string()), "{err}");
            assert!(err.contains(word), "{err}");
        }
    }
}
