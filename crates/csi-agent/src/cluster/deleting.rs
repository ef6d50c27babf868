//! DeleteVolume of a cluster plugin's volume across nodes (docs/cluster.md, "Deleting a
//! volume").
//!
//! A node's own records say nothing of the other nodes, so a DeleteVolume sent on one node
//! could delete a volume mounted on another. Before the RPC, the deleting node puts a
//! `deleting/<plugin>/<volume>` mark in one transaction that also requires the volume's
//! claims key to be absent (nobody holds it); every claim's compare-and-swap requires the mark
//! to be absent, so no node claims the volume while it is being deleted. The mark is removed
//! after the RPC, whatever it answered.
//!
//! The mark is not on the node's lease, for the reason claims are not (issue 28: a node that
//! went silent is not known to have stopped): a node that died during the RPC leaves it, and
//! claims are refused naming that node until it deletes the volume again (its own mark is
//! taken over) or an operator deletes the key. Owns the mark; must not call CSI.

use super::keys::{Deleting, PluginKey, SCHEMA, encode, key_name};
use super::store::{Guarded, WriteOp};
use super::{CAS_TRIES, Cluster, ClusterError, now_unix};

/// How an unreadable mark's node is named.
const UNREADABLE: &str = "(unknown: the mark is unreadable)";

/// This node's mark on a volume it deletes, until [`Cluster::end_delete`].
#[derive(Debug)]
pub struct DeleteMark {
    key: Vec<u8>,
    revision: i64,
}

impl Cluster {
    /// Puts this node's deletion mark on `volume_id`, if no node holds the volume and no
    /// other node deletes it. A mark of this node's own (an interrupted delete) is taken over.
    pub async fn begin_delete(
        &self,
        plugin: &PluginKey,
        volume_id: &str,
    ) -> Result<DeleteMark, ClusterError> {
        self.require_healthy()?;
        let node = &self.inner.options.node;
        let volume_key = self.inner.keys.volume(plugin, volume_id);
        let key = self.inner.keys.deleting(plugin, volume_id);
        let value = encode(&Deleting {
            schema: SCHEMA,
            node: node.clone(),
            since: now_unix(),
        });
        let mut mark_revision = 0;
        for _ in 0..CAS_TRIES {
            let guarded = Guarded {
                when: vec![(volume_key.clone(), 0), (key.clone(), mark_revision)],
                then: vec![WriteOp::Put {
                    key: key.clone(),
                    value: value.clone(),
                    lease: None,
                }],
            };
            if let Some(revision) = self
                .patiently(|| self.inner.store.write(guarded.clone()))
                .await?
            {
                return Ok(DeleteMark { key, revision });
            }
            // Why not: a holder (an unreadable claims key counts as one), or another mark.
            let (claims, _) = self.read_volume(plugin, volume_id).await?;
            if let Some(claims) = claims.filter(|claims| !claims.nodes.is_empty()) {
                let holders = claims
                    .nodes
                    .iter()
                    .map(|(node, entry)| format!("node {node} ({})", entry.state.as_str()))
                    .collect::<Vec<_>>()
                    .join(", ");
                return Err(ClusterError::DeleteInUse {
                    volume_id: volume_id.to_owned(),
                    holders,
                });
            }
            mark_revision = match self.deletion_mark(plugin, volume_id).await? {
                Some((Some(holder), revision)) if holder == *node => revision,
                Some((holder, _)) => {
                    return Err(ClusterError::BeingDeleted {
                        volume_id: volume_id.to_owned(),
                        node: holder.unwrap_or_else(|| UNREADABLE.to_owned()),
                        key: key_name(&key),
                    });
                }
                None => 0,
            };
        }
        Err(ClusterError::Contention {
            key: key_name(&key),
            tries: CAS_TRIES,
        })
    }

    /// Removes this node's mark after the DeleteVolume answered. A mark left (etcd did not
    /// answer) is this node's: its next delete of the volume takes it over.
    pub async fn end_delete(&self, mark: DeleteMark) {
        let guarded = Guarded {
            when: vec![(mark.key.clone(), mark.revision)],
            then: vec![WriteOp::Delete {
                key: mark.key.clone(),
            }],
        };
        if let Err(err) = self
            .patiently(|| self.inner.store.write(guarded.clone()))
            .await
        {
            tracing::warn!(key = %key_name(&mark.key), error = %err, "deletion mark not removed: claims of the volume are refused until this node deletes it again or the key is deleted");
        }
    }

    /// Refuses a claim while a node deletes the volume.
    pub(super) async fn refuse_while_deleting(
        &self,
        plugin: &PluginKey,
        volume_id: &str,
    ) -> Result<(), ClusterError> {
        match self.deletion_mark(plugin, volume_id).await? {
            Some((node, _)) => Err(ClusterError::BeingDeleted {
                volume_id: volume_id.to_owned(),
                node: node.unwrap_or_else(|| UNREADABLE.to_owned()),
                key: key_name(&self.inner.keys.deleting(plugin, volume_id)),
            }),
            None => Ok(()),
        }
    }

    /// The node deleting `volume_id` (`None`: the mark is unreadable, which is never read as
    /// absent nor as this node's) and its mark's revision.
    async fn deletion_mark(
        &self,
        plugin: &PluginKey,
        volume_id: &str,
    ) -> Result<Option<(Option<String>, i64)>, ClusterError> {
        let key = self.inner.keys.deleting(plugin, volume_id);
        let read = self.patiently(|| self.inner.store.get(key.clone())).await?;
        Ok(read.kvs.first().map(|kv| {
            let node = Deleting::decode(&kv.key, &kv.value)
                .ok()
                .map(|mark| mark.node);
            (node, kv.mod_revision)
        }))
    }
}
