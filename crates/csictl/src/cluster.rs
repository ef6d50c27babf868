//! `csictl cluster status|nodes|claims|fence`: cluster mode through the API (`GET
//! /v1/cluster`, `GET /v1/cluster/claims`, `POST /v1/cluster/nodes/{node}/fence`).
//!
//! This module owns those subcommands' arguments, calls and text. Like the rest of csictl it
//! talks to the daemon only through `csi_agent_api::ApiClient` and returns the text to print;
//! every value that came from etcd (another node wrote it) goes through `cell` before it is
//! printed.

use std::fmt::Write as _;

use clap::Subcommand;
use csi_agent_api::{
    ApiClient, ApiError, ClusterClaims, ClusterClaimsQuery, ClusterStatus, ErrorCode, FenceReport,
};

use crate::args::OutputFormat;
use crate::commands::render;
use crate::failure::Failure;
use crate::output::{Table, cell, fields};

#[derive(Debug, Subcommand)]
pub enum ClusterCommand {
    /// This node's session with etcd (state, reason, lease), its members and fenced nodes.
    Status,
    /// The nodes of the cluster: the members (live lease) and the fenced ones.
    Nodes,
    /// The claims on cluster volumes held in etcd, across every node; SUSPECT marks a claim
    /// of a node without a live lease.
    Claims {
        /// Only this plugin type's claims.
        #[arg(long, value_name = "TYPE")]
        plugin: Option<String>,
        /// Only this node's claims.
        #[arg(long, value_name = "NODE")]
        node: Option<String>,
        /// Only the claims on this volume id.
        #[arg(long, value_name = "VOLUME_ID")]
        volume: Option<String>,
    },
    /// Declare a lost node out of service so that its volumes may move (docs/cluster.md,
    /// "Fencing"). Only for a node that is down for good: refused while its lease is alive.
    Fence {
        #[arg(value_name = "NODE")]
        node: String,
        /// Why the node is out of service (recorded with the fence; at most 1024 bytes).
        #[arg(long, value_name = "TEXT")]
        reason: String,
    },
}

/// `csictl cluster …`
pub async fn run(
    client: &ApiClient,
    format: OutputFormat,
    command: ClusterCommand,
) -> Result<String, Failure> {
    call(client, format, command).await.map_err(with_hint)
}

/// The hints of the error codes speak of plugins and volumes; a cluster command's refusals are
/// about cluster mode, etcd and the nodes.
fn with_hint(failure: Failure) -> Failure {
    let hint = match &failure {
        Failure::Api(ApiError::Api { body, .. }) => match body.code {
            ErrorCode::NotFound => Some(
                "this daemon runs without cluster mode; csi-agentd joins a cluster with \
                 --cluster-etcd URL (docs/cluster.md)",
            ),
            ErrorCode::Conflict => Some(
                "`csictl cluster nodes` shows which nodes hold a live lease: fence a node only \
                 once it is down for good (docs/cluster.md)",
            ),
            ErrorCode::Unavailable => Some(
                "etcd did not answer: `csictl cluster status` shows this node's session (it \
                 answers without etcd); retry once it is HEALTHY",
            ),
            _ => None,
        },
        _ => None,
    };
    match (failure, hint) {
        (Failure::Api(err), Some(hint)) => Failure::Refused { err, hint },
        (failure, _) => failure,
    }
}

async fn call(
    client: &ApiClient,
    format: OutputFormat,
    command: ClusterCommand,
) -> Result<String, Failure> {
    match command {
        ClusterCommand::Status => render(format, &client.cluster().await?, status),
        ClusterCommand::Nodes => render(format, &client.cluster().await?, nodes),
        ClusterCommand::Claims {
            plugin,
            node,
            volume,
        } => {
            let query = ClusterClaimsQuery {
                plugin,
                node,
                volume,
            };
            render(format, &client.cluster_claims(&query).await?, claims)
        }
        ClusterCommand::Fence { node, reason } => {
            render(format, &client.fence(&node, &reason).await?, fenced)
        }
    }
}

/// Milliseconds as seconds with one decimal (`7.2s`).
fn seconds(ms: u64) -> String {
    format!("{}.{}s", ms / 1000, (ms % 1000) / 100)
}

fn list(items: &[String]) -> String {
    items.iter().map(|i| cell(i)).collect::<Vec<_>>().join(",")
}

pub fn status(s: &ClusterStatus) -> String {
    let lease = if s.lease_id == 0 {
        "none".to_owned()
    } else {
        format!(
            "{:x}, valid for {} (ttl {}s)",
            s.lease_id,
            seconds(s.lease_valid_for_ms),
            s.lease_ttl_secs
        )
    };
    let mut out = fields(&[
        ("cluster", s.name.clone()),
        ("node", s.node.clone()),
        ("state", s.state.clone()),
        ("reason", s.reason.clone().unwrap_or_default()),
        ("lease", lease),
        ("lease losses", s.lease_losses.to_string()),
        (
            "etcd cluster",
            s.etcd_cluster_id.clone().unwrap_or_default(),
        ),
        ("fenced nodes", list(&s.fenced)),
        ("released after fence", list(&s.released_after_fence)),
    ]);
    let _ = write!(out, "\nmembers (live lease):\n{}", members(s));
    let _ = write!(out, "\ncontroller leaders:\n{}", leaders(s));
    out
}

fn leaders(s: &ClusterStatus) -> String {
    if s.leaders.is_empty() {
        return "none seen\n".to_owned();
    }
    let mut table = Table::new(&["PLUGIN", "NAME", "LEADER", "TERM", "THIS NODE"]);
    for l in &s.leaders {
        table.row(vec![
            l.plugin.clone(),
            l.plugin_name.clone(),
            l.node.clone(),
            l.revision.to_string(),
            if l.this_node { "yes" } else { "no" }.to_owned(),
        ]);
    }
    table.render()
}

fn members(s: &ClusterStatus) -> String {
    if s.members.is_empty() {
        return "none seen\n".to_owned();
    }
    let mut table = Table::new(&["NODE", "VERSION", "INSTANCE", "PLUGINS"]);
    for m in &s.members {
        table.row(vec![
            m.node.clone(),
            m.version.clone(),
            m.instance_id.clone(),
            m.plugins.join(","),
        ]);
    }
    table.render()
}

pub fn nodes(s: &ClusterStatus) -> String {
    if s.members.is_empty() && s.fenced.is_empty() {
        return "no nodes seen\n".to_owned();
    }
    let mut table = Table::new(&["NODE", "STATE", "VERSION", "INSTANCE", "PLUGINS"]);
    for m in &s.members {
        // A plugin with its CSI node id once the node asked NodeGetInfo: `type/name=id`.
        let plugins: Vec<String> = m
            .plugins
            .iter()
            .map(|p| match m.csi_nodes.iter().find(|c| &c.plugin == p) {
                Some(csi) => format!("{p}={}", csi.node_id),
                None => p.clone(),
            })
            .collect();
        table.row(vec![
            m.node.clone(),
            "alive".to_owned(),
            m.version.clone(),
            m.instance_id.clone(),
            plugins.join(","),
        ]);
    }
    for node in &s.fenced {
        table.row(vec![
            node.clone(),
            "FENCED".to_owned(),
            String::new(),
            String::new(),
            String::new(),
        ]);
    }
    table.render()
}

pub fn claims(c: &ClusterClaims) -> String {
    let mut out = if c.claims.is_empty() {
        "no cluster claims\n".to_owned()
    } else {
        let mut table = Table::new(&[
            "PLUGIN",
            "VOLUME",
            "NODE",
            "STATE",
            "LEASE",
            "ACCESS MODE",
            "WORKLOADS",
        ]);
        for claim in &c.claims {
            let plugin = if claim.plugin_name == "default" {
                claim.plugin.clone()
            } else {
                format!("{}/{}", claim.plugin, claim.plugin_name)
            };
            table.row(vec![
                plugin,
                claim.volume_id.clone(),
                claim.node.clone(),
                claim.state.clone(),
                if claim.suspect { "SUSPECT" } else { "alive" }.to_owned(),
                claim.access_mode.clone(),
                claim.workloads.join(","),
            ]);
        }
        table.render()
    };
    for damaged in &c.damaged {
        let _ = writeln!(
            out,
            "damaged key {}: {}",
            cell(&damaged.key),
            cell(&damaged.problem)
        );
    }
    out
}

pub fn fenced(r: &FenceReport) -> String {
    let mut out = format!("fenced {}\n", cell(&r.node));
    for volume in &r.freed {
        let _ = writeln!(out, "freed: {}", cell(volume));
    }
    for volume in &r.left {
        let _ = writeln!(out, "left: {}", cell(volume));
    }
    if !r.left.is_empty() {
        out.push_str(
            "the volumes left stay held by the fenced node until a daemon that runs their \
             plugin frees them; repeat the fence to try again (see `csictl cluster claims`)\n",
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use csi_agent_api::{ClusterClaim, ClusterMember, DamagedKey};

    use crate::failure::tests::api;

    use super::*;

    fn member(node: &str) -> ClusterMember {
        ClusterMember {
            node: node.to_owned(),
            instance_id: format!("i-{node}"),
            version: "0.1.0".to_owned(),
            started_at_unix: 1,
            plugins: vec!["org.example.nfs/default".to_owned()],
            // n1's plugin answered NodeGetInfo already; n2's was not asked yet.
            csi_nodes: if node == "n1" {
                vec![csi_agent_api::ClusterCsiNode {
                    plugin: "org.example.nfs/default".to_owned(),
                    node_id: "node-1".to_owned(),
                    topology: Default::default(),
                }]
            } else {
                vec![]
            },
        }
    }

    fn cluster_status() -> ClusterStatus {
        ClusterStatus {
            name: "prod".to_owned(),
            node: "n1".to_owned(),
            instance_id: "i-n1".to_owned(),
            state: "DEGRADED".to_owned(),
            lease_id: 0x7587_8a9f_1c2b_0d01,
            lease_ttl_secs: 10,
            lease_valid_for_ms: 7_250,
            since_unix: 1,
            reason: Some("keepalive failed: etcd unreachable".to_owned()),
            etcd_cluster_id: Some("cdf818194e3a8c32".to_owned()),
            members: vec![member("n1"), member("n2")],
            fenced: vec!["n3".to_owned()],
            released_after_fence: vec![],
            lease_losses: 2,
            leaders: vec![csi_agent_api::ClusterLeader {
                plugin: "org.example.nfs".to_owned(),
                plugin_name: "default".to_owned(),
                node: "n2".to_owned(),
                revision: 42,
                this_node: false,
            }],
        }
    }

    #[test]
    fn status_shows_state_reason_lease_members_and_fenced() {
        assert_eq!(
            status(&cluster_status()),
            "cluster:               prod\n\
             node:                  n1\n\
             state:                 DEGRADED\n\
             reason:                keepalive failed: etcd unreachable\n\
             lease:                 75878a9f1c2b0d01, valid for 7.2s (ttl 10s)\n\
             lease losses:          2\n\
             etcd cluster:          cdf818194e3a8c32\n\
             fenced nodes:          n3\n\
             released after fence:  -\n\
             \n\
             members (live lease):\n\
             NODE  VERSION  INSTANCE  PLUGINS\n\
             n1    0.1.0    i-n1      org.example.nfs/default\n\
             n2    0.1.0    i-n2      org.example.nfs/default\n\
             \n\
             controller leaders:\n\
             PLUGIN           NAME     LEADER  TERM  THIS NODE\n\
             org.example.nfs  default  n2      42    no\n"
        );
        let joining = ClusterStatus {
            state: "JOINING".to_owned(),
            lease_id: 0,
            members: vec![],
            fenced: vec![],
            leaders: vec![],
            ..cluster_status()
        };
        let text = status(&joining);
        assert!(text.contains("lease:                 none\n"), "{text}");
        assert!(
            text.ends_with("members (live lease):\nnone seen\n\ncontroller leaders:\nnone seen\n"),
            "{text}"
        );
    }

    #[test]
    fn nodes_lists_members_alive_and_fenced_nodes() {
        assert_eq!(
            nodes(&cluster_status()),
            "NODE  STATE   VERSION  INSTANCE  PLUGINS\n\
             n1    alive   0.1.0    i-n1      org.example.nfs/default=node-1\n\
             n2    alive   0.1.0    i-n2      org.example.nfs/default\n\
             n3    FENCED  -        -         -\n"
        );
        let empty = ClusterStatus {
            members: vec![],
            fenced: vec![],
            ..cluster_status()
        };
        assert_eq!(nodes(&empty), "no nodes seen\n");
    }

    fn claim(node: &str, suspect: bool) -> ClusterClaim {
        ClusterClaim {
            plugin: "org.example.nfs".to_owned(),
            plugin_name: "default".to_owned(),
            volume_id: "data-1".to_owned(),
            access_mode: "MULTI_NODE_READER_ONLY".to_owned(),
            node: node.to_owned(),
            state: "ATTACHED".to_owned(),
            suspect,
            readonly: true,
            csi_node_id: format!("csi-{node}"),
            workloads: vec!["w1".to_owned(), "w2".to_owned()],
            since_unix: 1,
        }
    }

    #[test]
    fn claims_mark_suspect_nodes_and_list_damaged_keys() {
        let list = ClusterClaims {
            claims: vec![
                claim("n1", false),
                ClusterClaim {
                    plugin_name: "fast".to_owned(),
                    workloads: vec![],
                    ..claim("n3", true)
                },
            ],
            damaged: vec![DamagedKey {
                key: "/prod/volumes/x\n".to_owned(),
                problem: "not JSON".to_owned(),
            }],
        };
        assert_eq!(
            claims(&list),
            "PLUGIN                VOLUME  NODE  STATE     LEASE    ACCESS MODE             WORKLOADS\n\
             org.example.nfs       data-1  n1    ATTACHED  alive    MULTI_NODE_READER_ONLY  w1,w2\n\
             org.example.nfs/fast  data-1  n3    ATTACHED  SUSPECT  MULTI_NODE_READER_ONLY  -\n\
             damaged key /prod/volumes/x\\n: not JSON\n"
        );
        assert_eq!(claims(&ClusterClaims::default()), "no cluster claims\n");
    }

    #[test]
    fn fence_prints_what_was_freed_and_what_is_left() {
        let report = FenceReport {
            node: "n3".to_owned(),
            freed: vec!["data-1".to_owned()],
            left: vec!["data-2: plugin not ready: starting".to_owned()],
        };
        assert_eq!(
            fenced(&report),
            "fenced n3\n\
             freed: data-1\n\
             left: data-2: plugin not ready: starting\n\
             the volumes left stay held by the fenced node until a daemon that runs their \
             plugin frees them; repeat the fence to try again (see `csictl cluster claims`)\n"
        );
        let clean = FenceReport {
            node: "n3".to_owned(),
            ..FenceReport::default()
        };
        assert_eq!(fenced(&clean), "fenced n3\n");
    }

    #[test]
    fn refusals_get_cluster_hints_and_other_failures_keep_theirs() {
        let hint = |f: Failure| with_hint(f).hint().unwrap_or_default();
        assert!(hint(api(ErrorCode::NotFound)).contains("--cluster-etcd"));
        assert!(hint(api(ErrorCode::Conflict)).contains("csictl cluster nodes"));
        assert!(hint(api(ErrorCode::Unavailable)).contains("csictl cluster status"));
        let invalid = api(ErrorCode::InvalidRequest);
        assert_eq!(
            hint(api(ErrorCode::InvalidRequest)),
            invalid.hint().unwrap_or_default()
        );
        let usage = with_hint(Failure::Usage("u".to_owned()));
        assert!(matches!(usage, Failure::Usage(_)), "{usage:?}");
    }
}
