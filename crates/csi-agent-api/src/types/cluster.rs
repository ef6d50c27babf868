//! Cluster mode in the JSON contract (issue 28, items 6 and 8): the node's session and the
//! members it sees (`GET /v1/cluster`), the claims held in etcd (`GET /v1/cluster/claims`),
//! and an operator's fence of a lost node (`POST /v1/cluster/nodes/{node}/fence`).
//!
//! Must not: hold behaviour; the engine's `cluster` module decides, the daemon converts its
//! values into these.

use serde::{Deserialize, Serialize};

/// This node's session with etcd and the cluster as it last saw it (`GET /v1/cluster`): a
/// snapshot that never waits on etcd.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClusterStatus {
    /// The cluster's name (`--cluster-name`, the etcd key prefix).
    pub name: String,
    /// This node's name (`--node-name`).
    pub node: String,
    /// This daemon's identity in the cluster (kept across restarts in its work dir).
    pub instance_id: String,
    /// `JOINING`, `HEALTHY`, `DEGRADED`, `FENCED` or `REFUSED`.
    pub state: String,
    /// The node's etcd lease (0 when it holds none).
    pub lease_id: i64,
    pub lease_ttl_secs: u64,
    /// How much longer this node may count on its lease (0 when none).
    pub lease_valid_for_ms: u64,
    /// Unix seconds of the last change of `state`.
    pub since_unix: u64,
    /// Why the session is not healthy (or what it did last); absent when there is nothing to say.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// The etcd cluster's id in hex, as `etcdctl` shows it; absent before the first join.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub etcd_cluster_id: Option<String>,
    /// Nodes with a live lease at the session's last look.
    pub members: Vec<ClusterMember>,
    /// Nodes an operator fenced, at the session's last look.
    pub fenced: Vec<String>,
    /// Cluster volumes this node released without using them after it found itself fenced.
    pub released_after_fence: Vec<String>,
    /// How many times this node lost its lease since the daemon started.
    pub lease_losses: u64,
    /// Each cluster plugin's controller leader, as this node last saw it.
    #[serde(default)]
    pub leaders: Vec<ClusterLeader>,
}

/// The daemon that sends a cluster plugin's controller RPCs (docs/cluster.md, "One controller
/// per plugin").
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClusterLeader {
    /// The plugin's type.
    pub plugin: String,
    pub plugin_name: String,
    /// The leading node.
    pub node: String,
    /// The leader key's etcd revision: a new value is a new leader term.
    pub revision: i64,
    /// True when this node leads.
    pub this_node: bool,
}

/// A node with a live lease.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClusterMember {
    pub node: String,
    pub instance_id: String,
    /// Its csi-agentd's version.
    pub version: String,
    pub started_at_unix: u64,
    /// The plugins it runs with `"cluster": true`, as `type/name`.
    pub plugins: Vec<String>,
    /// What each of those plugins answered to NodeGetInfo on that node, once asked (a plugin
    /// starts on its first use).
    #[serde(default)]
    pub csi_nodes: Vec<ClusterCsiNode>,
}

/// A cluster plugin's NodeGetInfo on one node.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClusterCsiNode {
    /// The plugin, as `type/name`.
    pub plugin: String,
    /// The node id ControllerPublish is sent with.
    pub node_id: String,
    /// The node's topology segments (empty when the plugin reports none).
    #[serde(default)]
    pub topology: std::collections::BTreeMap<String, String>,
}

/// One node's hold on one volume (`GET /v1/cluster/claims`).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClusterClaim {
    /// The plugin's type.
    pub plugin: String,
    /// The plugin's instance name (`default` unless configured).
    pub plugin_name: String,
    pub volume_id: String,
    /// The access mode every holder of the volume agreed on.
    pub access_mode: String,
    /// The node holding it.
    pub node: String,
    /// `PUBLISHING`, `ATTACHED`, `NODE_DETACHED` or `FENCED`.
    pub state: String,
    /// The node has no live lease: it may be down or cut off. Its claim stays until it returns
    /// or an operator fences it.
    pub suspect: bool,
    pub readonly: bool,
    /// The node id ControllerPublish was (or will be) called with.
    pub csi_node_id: String,
    /// The node's workloads at its last write.
    pub workloads: Vec<String>,
    /// Unix seconds of the entry's last state change.
    pub since_unix: u64,
}

/// A key under the cluster's prefix that could not be read; its volume is taken as held.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DamagedKey {
    pub key: String,
    pub problem: String,
}

/// `GET /v1/cluster/claims`: the claims matching the query, and every damaged key.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClusterClaims {
    pub claims: Vec<ClusterClaim>,
    /// Keys that could not be read (never filtered: which plugin or node they are of is unknown).
    pub damaged: Vec<DamagedKey>,
}

/// The filters of `GET /v1/cluster/claims`; each one given must be non-empty.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClusterClaimsQuery {
    /// Only this plugin type's claims.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub plugin: Option<String>,
    /// Only this node's claims.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node: Option<String>,
    /// Only the claims on this volume id.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub volume: Option<String>,
}

/// `POST /v1/cluster/nodes/{node}/fence`'s body.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FenceRequest {
    /// Why the node is declared out of service: recorded with the fence in etcd.
    pub reason: String,
}

impl FenceRequest {
    /// The longest `reason`, in bytes: it is stored in etcd with the fence.
    pub const MAX_REASON_BYTES: usize = 1024;
}

/// What a fence did on the daemon that took it.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct FenceReport {
    pub node: String,
    /// Volumes ControllerUnpublished from the fenced node and freed.
    pub freed: Vec<String>,
    /// Volumes still held, each with why (a plugin this daemon does not run, or an answer
    /// that does not prove the detach).
    pub left: Vec<String>,
}
