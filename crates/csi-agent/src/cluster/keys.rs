//! The cluster's key layout in etcd and the values stored there (docs/cluster.md, "What
//! etcd holds").
//!
//! Owns key construction (every id through [`crate::layout::encode_id`], so that a hostile id
//! is one key segment and never a path of its own) and the value types with their bounds. A
//! value that cannot be read — bad JSON, an unknown schema, too large — decodes to an error,
//! never to "free": the callers treat it as held by an unknown holder. No I/O here.

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};

use crate::layout::encode_id;
use crate::volume::{AccessMode, AccessType, Capability};

/// The one value schema this build writes and reads.
pub const SCHEMA: u32 = 1;
/// Largest value read back from etcd (etcd's own request limit is 1.5 MiB).
pub const MAX_VALUE_BYTES: usize = 256 * 1024;
/// Most node entries one volume may have (a bound on the value, as `MAX_VALUE_BYTES` is).
pub const MAX_NODES_PER_VOLUME: usize = 256;

/// Builds every key of one cluster: `/csi-agent/<cluster>/v1/…`.
#[derive(Clone, Debug)]
pub struct Keys {
    prefix: String,
}

impl Keys {
    pub fn new(cluster_name: &str) -> Self {
        Self {
            prefix: format!("/csi-agent/{}/v1/", encode_id(cluster_name)),
        }
    }

    /// A node's presence, put with its lease: gone when the lease expires.
    pub fn node(&self, node: &str) -> Vec<u8> {
        format!("{}nodes/{}", self.prefix, encode_id(node)).into_bytes()
    }

    pub fn nodes(&self) -> Vec<u8> {
        format!("{}nodes/", self.prefix).into_bytes()
    }

    /// Which csi-agentd owns a node name (created once, never leased).
    pub fn member(&self, node: &str) -> Vec<u8> {
        format!("{}members/{}", self.prefix, encode_id(node)).into_bytes()
    }

    /// An operator's fence of a node.
    pub fn fence(&self, node: &str) -> Vec<u8> {
        format!("{}fence/{}", self.prefix, encode_id(node)).into_bytes()
    }

    pub fn fences(&self) -> Vec<u8> {
        format!("{}fence/", self.prefix).into_bytes()
    }

    /// The claims on one volume of one plugin: one key, so that the access-mode check across
    /// nodes is one compare-and-swap.
    pub fn volume(&self, plugin: &PluginKey, volume_id: &str) -> Vec<u8> {
        format!(
            "{}vol/{}/{}/{}",
            self.prefix,
            encode_id(&plugin.plugin_type),
            encode_id(&plugin.plugin_name),
            encode_id(volume_id)
        )
        .into_bytes()
    }

    /// Every volume key of one plugin.
    pub fn volumes_of(&self, plugin: &PluginKey) -> Vec<u8> {
        format!(
            "{}vol/{}/{}/",
            self.prefix,
            encode_id(&plugin.plugin_type),
            encode_id(&plugin.plugin_name)
        )
        .into_bytes()
    }

    /// Every volume key of every plugin.
    pub fn all_volumes(&self) -> Vec<u8> {
        format!("{}vol/", self.prefix).into_bytes()
    }

    /// The leader of one plugin's controller, put with the leader's lease: it vanishes with
    /// the lease, and its revision is the leadership every leader write is conditioned on.
    pub fn leader(&self, plugin: &PluginKey) -> Vec<u8> {
        format!(
            "{}leaders/{}/{}",
            self.prefix,
            encode_id(&plugin.plugin_type),
            encode_id(&plugin.plugin_name)
        )
        .into_bytes()
    }

    /// That `plugin` has the ControllerPublish step somewhere in the cluster: put once by the
    /// first daemon that stands for its leadership, never removed. A node whose own instance
    /// has no controller reads it to know whether to ask the leader for the step.
    pub fn controller(&self, plugin: &PluginKey) -> Vec<u8> {
        format!(
            "{}controllers/{}/{}",
            self.prefix,
            encode_id(&plugin.plugin_type),
            encode_id(&plugin.plugin_name)
        )
        .into_bytes()
    }

    /// A hint that a volume of `plugin` has controller work for the leader (an entry in
    /// `PUBLISHING` or `NODE_DETACHED`): the leader lists these, not every volume.
    pub fn pending(&self, plugin: &PluginKey, volume_id: &str) -> Vec<u8> {
        let mut key = self.pending_of(plugin);
        key.extend_from_slice(encode_id(volume_id).as_bytes());
        key
    }

    pub fn pending_of(&self, plugin: &PluginKey) -> Vec<u8> {
        let mut key = self.all_pending();
        key.extend_from_slice(
            format!(
                "{}/{}/",
                encode_id(&plugin.plugin_type),
                encode_id(&plugin.plugin_name)
            )
            .as_bytes(),
        );
        key
    }

    /// A DeleteVolume in progress on a volume of `plugin`: no claim is taken while it is
    /// there (`cluster::deleting`).
    pub fn deleting(&self, plugin: &PluginKey, volume_id: &str) -> Vec<u8> {
        format!(
            "{}deleting/{}/{}/{}",
            self.prefix,
            encode_id(&plugin.plugin_type),
            encode_id(&plugin.plugin_name),
            encode_id(volume_id)
        )
        .into_bytes()
    }

    /// Every plugin's pending hints.
    pub fn all_pending(&self) -> Vec<u8> {
        format!("{}pending/", self.prefix).into_bytes()
    }
}

/// A plugin as the cluster knows it: the same type and name on every node means the same
/// storage.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct PluginKey {
    pub plugin_type: String,
    pub plugin_name: String,
}

/// Where a node's entry is in its life (docs/cluster.md, "Release").
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum EntryState {
    /// Claimed; ControllerPublish to this node may be in flight.
    Publishing,
    /// ControllerPublish to this node succeeded (or the plugin has no controller step).
    Attached,
    /// The node's NodeUnpublish and NodeUnstage succeeded; ControllerUnpublish is next.
    NodeDetached,
    /// An operator fenced the node: its volumes are detached without its word.
    Fenced,
}

impl EntryState {
    pub fn as_str(self) -> &'static str {
        match self {
            EntryState::Publishing => "PUBLISHING",
            EntryState::Attached => "ATTACHED",
            EntryState::NodeDetached => "NODE_DETACHED",
            EntryState::Fenced => "FENCED",
        }
    }
}

/// One node's hold on a volume.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeEntry {
    /// Random, made by the node when it first claims: a re-created entry is another claim.
    pub claim_id: String,
    /// The node id ControllerPublish was (or will be) called with; ControllerUnpublish after
    /// a fence needs it without asking the node.
    pub csi_node_id: String,
    pub readonly: bool,
    pub state: EntryState,
    /// The node's workloads at the last write (the node's own store is authoritative).
    #[serde(default)]
    pub workloads: BTreeSet<String>,
    /// From ControllerPublish (Nomad #15415: a node that returns needs it to stage).
    #[serde(default)]
    pub publish_context: BTreeMap<String, String>,
    /// The volume context from CreateVolume (or the publish request), which the leader
    /// passes to ControllerPublish on the node's behalf. Not secret (secrets are not stored).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub volume_context: BTreeMap<String, String>,
    /// The leader's last refusal of this entry's controller step (a non-transient CSI
    /// error): the node reports it and asks again only with a new request.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// Unix seconds of the entry's last state change.
    pub since: u64,
}

/// What every node holding a volume must agree on. Mount flags are left out: they may carry
/// credentials, and etcd stores values in plain text for anyone with the cluster's
/// credentials to read.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SharedCapability {
    pub access_mode: AccessMode,
    /// `mount` or `block`.
    pub access_type: String,
    #[serde(default)]
    pub fs_type: String,
}

impl SharedCapability {
    pub fn of(capability: &Capability) -> Self {
        let (access_type, fs_type) = match &capability.access_type {
            AccessType::Mount { fs_type, .. } => ("mount", fs_type.clone()),
            AccessType::Block {} => ("block", String::new()),
        };
        Self {
            access_mode: capability.access_mode,
            access_type: access_type.to_owned(),
            fs_type,
        }
    }

    /// The capability the leader sends ControllerPublish with: the shared part, without the
    /// mount flags (never stored; ControllerPublish has no use for them).
    pub fn to_capability(&self) -> Capability {
        let access_type = if self.access_type == "block" {
            AccessType::Block {}
        } else {
            AccessType::Mount {
                fs_type: self.fs_type.clone(),
                mount_flags: Vec::new(),
            }
        };
        Capability {
            access_type,
            access_mode: self.access_mode,
        }
    }
}

/// Every node's hold on one volume, and the capability they share.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct VolumeClaims {
    pub schema: u32,
    /// The CSI volume id (the key holds it only encoded).
    pub volume_id: String,
    pub capability: SharedCapability,
    pub nodes: BTreeMap<String, NodeEntry>,
}

/// A node's presence (leased).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeInfo {
    pub schema: u32,
    pub node: String,
    pub instance_id: String,
    pub version: String,
    pub started_at: u64,
    /// Plugins this node runs with `"cluster": true`, as `type/name`.
    #[serde(default)]
    pub plugins: Vec<String>,
    /// Each cluster plugin's NodeGetInfo on this node (by `type/name`), once the node has
    /// asked it (plugins start on first use: never asked only for this).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub csi: BTreeMap<String, CsiNode>,
}

/// A cluster plugin's NodeGetInfo on one node: the node id ControllerPublish is sent with, and
/// the node's topology segments.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CsiNode {
    pub node_id: String,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub topology: BTreeMap<String, String>,
}

/// The csi-agentd that owns a node name.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Member {
    pub schema: u32,
    pub instance_id: String,
    pub joined_at: u64,
}

/// The leader of one plugin's controller.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Leader {
    pub schema: u32,
    pub node: String,
    pub instance_id: String,
    /// The lease the key is put with: a daemon that lost its lease and joined again with a
    /// new one is not the leader until this key goes with the old lease.
    pub lease: i64,
    pub since: u64,
}

/// A volume's pending controller work, as a hint for the leader.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Pending {
    pub schema: u32,
    pub volume_id: String,
}

/// That a plugin has the ControllerPublish step: the node that found it first, and when.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct HasController {
    pub schema: u32,
    pub node: String,
    pub since: u64,
}

/// A DeleteVolume in progress: which node sends it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Deleting {
    pub schema: u32,
    pub node: String,
    pub since: u64,
}

/// An operator's fence of a node.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Fence {
    pub schema: u32,
    pub reason: String,
    /// The node whose daemon took the request.
    pub by: String,
    pub at: u64,
}

/// Why a value read back from etcd cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum ValueError {
    #[error("value of {key} is {len} bytes, more than the {max} this build reads")]
    TooLarge { key: String, len: usize, max: usize },
    #[error("value of {key} is not valid: {source}")]
    Invalid {
        key: String,
        #[source]
        source: serde_json::Error,
    },
    #[error("value of {key} has schema {found}; this build reads schema {SCHEMA}")]
    Schema { key: String, found: u32 },
    #[error("value of {key} has {count} node entries, more than {MAX_NODES_PER_VOLUME}")]
    TooManyNodes { key: String, count: usize },
}

/// A key for messages: valid UTF-8 (our keys always are) or its lossy form.
pub fn key_name(key: &[u8]) -> String {
    String::from_utf8_lossy(key).into_owned()
}

fn decode_json<T: serde::de::DeserializeOwned>(key: &[u8], value: &[u8]) -> Result<T, ValueError> {
    if value.len() > MAX_VALUE_BYTES {
        return Err(ValueError::TooLarge {
            key: key_name(key),
            len: value.len(),
            max: MAX_VALUE_BYTES,
        });
    }
    serde_json::from_slice(value).map_err(|source| ValueError::Invalid {
        key: key_name(key),
        source,
    })
}

fn check_schema(key: &[u8], found: u32) -> Result<(), ValueError> {
    if found != SCHEMA {
        return Err(ValueError::Schema {
            key: key_name(key),
            found,
        });
    }
    Ok(())
}

impl VolumeClaims {
    pub fn decode(key: &[u8], value: &[u8]) -> Result<Self, ValueError> {
        let claims: VolumeClaims = decode_json(key, value)?;
        check_schema(key, claims.schema)?;
        if claims.nodes.len() > MAX_NODES_PER_VOLUME {
            return Err(ValueError::TooManyNodes {
                key: key_name(key),
                count: claims.nodes.len(),
            });
        }
        Ok(claims)
    }
}

impl NodeInfo {
    pub fn decode(key: &[u8], value: &[u8]) -> Result<Self, ValueError> {
        let info: NodeInfo = decode_json(key, value)?;
        check_schema(key, info.schema)?;
        Ok(info)
    }
}

impl Member {
    pub fn decode(key: &[u8], value: &[u8]) -> Result<Self, ValueError> {
        let member: Member = decode_json(key, value)?;
        check_schema(key, member.schema)?;
        Ok(member)
    }
}

impl Leader {
    pub fn decode(key: &[u8], value: &[u8]) -> Result<Self, ValueError> {
        let leader: Leader = decode_json(key, value)?;
        check_schema(key, leader.schema)?;
        Ok(leader)
    }
}

impl Pending {
    pub fn decode(key: &[u8], value: &[u8]) -> Result<Self, ValueError> {
        let pending: Pending = decode_json(key, value)?;
        check_schema(key, pending.schema)?;
        Ok(pending)
    }
}

impl Deleting {
    pub fn decode(key: &[u8], value: &[u8]) -> Result<Self, ValueError> {
        let deleting: Deleting = decode_json(key, value)?;
        check_schema(key, deleting.schema)?;
        Ok(deleting)
    }
}

impl Fence {
    pub fn decode(key: &[u8], value: &[u8]) -> Result<Self, ValueError> {
        let fence: Fence = decode_json(key, value)?;
        check_schema(key, fence.schema)?;
        Ok(fence)
    }
}

/// Encodes a value; our own types always serialize.
pub fn encode<T: Serialize>(value: &T) -> Vec<u8> {
    serde_json::to_vec(value).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    #[test]
    fn a_hostile_id_is_one_key_segment() {
        let keys = Keys::new("c1");
        let plugin = PluginKey {
            plugin_type: "t".into(),
            plugin_name: "n".into(),
        };
        let key = String::from_utf8(keys.volume(&plugin, "../../nodes/n1")).unwrap();
        assert!(key.starts_with("/csi-agent/c1/v1/vol/t/n/"), "{key}");
        let last = key.rsplit('/').next().unwrap();
        assert!(!last.is_empty() && !key["/csi-agent/c1/v1/vol/t/n/".len()..].contains('/'));
        assert!(key.starts_with(&String::from_utf8(keys.volumes_of(&plugin)).unwrap()));
        let node = String::from_utf8(keys.node("a/b")).unwrap();
        assert_eq!(node.matches('/').count(), 5, "{node}");
    }

    #[test]
    fn an_unreadable_value_is_an_error_naming_the_key() {
        let key = b"/csi-agent/c1/v1/vol/t/n/v1";
        let err = VolumeClaims::decode(key, b"{not json").unwrap_err();
        assert!(
            err.to_string().contains("/csi-agent/c1/v1/vol/t/n/v1"),
            "{err}"
        );
        let big = vec![b' '; MAX_VALUE_BYTES + 1];
        assert!(matches!(
            VolumeClaims::decode(key, &big),
            Err(ValueError::TooLarge { .. })
        ));
        let future = br#"{"schema":2,"volume_id":"v1","capability":{"access_type":"mount","access_mode":"SINGLE_NODE_WRITER"},"nodes":{}}"#;
        let err = VolumeClaims::decode(key, future).unwrap_err();
        assert!(matches!(err, ValueError::Schema { found: 2, .. }), "{err}");
    }
}
