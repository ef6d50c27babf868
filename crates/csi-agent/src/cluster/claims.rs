//! Access-mode admission across nodes: the rules that decide, from one volume's
//! [`VolumeClaims`] in etcd, whether a node may hold it (docs/cluster.md, "Claims").
//!
//! Pure functions: no I/O, no time (the caller passes `now`). The caller writes the result
//! with one compare-and-swap on the volume key, so two nodes deciding at once cannot both
//! win. Every entry counts whatever its state, and whether or not its node is alive: an
//! entry stops counting only when it is deleted, after ControllerUnpublish (or a fence).

use std::collections::BTreeSet;

use super::keys::{
    EntryState, MAX_NODES_PER_VOLUME, NodeEntry, SCHEMA, SharedCapability, VolumeClaims,
};
use crate::volume::AccessMode;

/// A node asking to hold a volume for one workload.
#[derive(Clone, Debug)]
pub struct ClaimRequest {
    pub volume_id: String,
    pub node: String,
    pub workload: String,
    pub capability: SharedCapability,
    pub readonly: bool,
    pub csi_node_id: String,
    /// The claim id the node's own record holds for this volume, if it holds one: an entry
    /// with another id (or none) means the node's hold was taken away (a fence).
    pub expected_claim: Option<String>,
    /// The id a new entry gets.
    pub fresh_claim_id: String,
    /// The state a new (or re-opened) entry starts in: `Publishing` when ControllerPublish
    /// is to come, `Attached` when the plugin has no controller step.
    pub start_state: EntryState,
    /// Passed by the leader to ControllerPublish on the node's behalf.
    pub volume_context: std::collections::BTreeMap<String, String>,
    pub now: u64,
}

/// The new value to write (when `changed`) and the node's claim id in it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Admitted {
    pub claims: VolumeClaims,
    pub claim_id: String,
    pub changed: bool,
}

/// A node that holds a volume, as a refusal names it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Holder {
    pub node: String,
    pub state: EntryState,
    pub readonly: bool,
}

/// Why a node may not hold a volume now. Nothing was written.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// The access mode allows no more holders of this kind.
    Held {
        access_mode: AccessMode,
        holders: Vec<Holder>,
    },
    /// The volume is held with another capability (mode, type or file system).
    OtherCapability {
        held: SharedCapability,
        holders: Vec<Holder>,
    },
    /// This node's own entry is read-only and the request is not, or the reverse.
    OtherReadonly { held_readonly: bool },
    /// This node's hold was taken away (fenced, or its entry replaced): it must clean up
    /// before it may claim again.
    Lost { found: Option<(String, EntryState)> },
    /// The volume has as many node entries as a value may hold.
    TooManyNodes { max: usize },
}

fn holders(claims: &VolumeClaims, except: &str) -> Vec<Holder> {
    claims
        .nodes
        .iter()
        .filter(|(node, _)| node.as_str() != except)
        .map(|(node, entry)| Holder {
            node: node.clone(),
            state: entry.state,
            readonly: entry.readonly,
        })
        .collect()
}

/// Decides a claim. `current` is the volume's value as read (None: no one holds it).
pub fn admit(current: Option<&VolumeClaims>, request: &ClaimRequest) -> Result<Admitted, Refusal> {
    let Some(current) = current else {
        if request.expected_claim.is_some() {
            return Err(Refusal::Lost { found: None });
        }
        return Ok(Admitted {
            claims: VolumeClaims {
                schema: SCHEMA,
                volume_id: request.volume_id.clone(),
                capability: request.capability.clone(),
                nodes: [(
                    request.node.clone(),
                    new_entry(request, &request.fresh_claim_id),
                )]
                .into(),
            },
            claim_id: request.fresh_claim_id.clone(),
            changed: true,
        });
    };
    if current.capability != request.capability {
        return Err(Refusal::OtherCapability {
            held: current.capability.clone(),
            holders: holders(current, ""),
        });
    }
    let mut claims = current.clone();
    if let Some(own) = claims.nodes.get_mut(&request.node) {
        if let Some(expected) = &request.expected_claim
            && *expected != own.claim_id
        {
            return Err(Refusal::Lost {
                found: Some((own.claim_id.clone(), own.state)),
            });
        }
        if own.state == EntryState::Fenced {
            return Err(Refusal::Lost {
                found: Some((own.claim_id.clone(), own.state)),
            });
        }
        if own.readonly != request.readonly {
            return Err(Refusal::OtherReadonly {
                held_readonly: own.readonly,
            });
        }
        // An entry with no expected id is this node's own, left by a crash between the claim
        // and the node's durable record (nothing was sent to the plugin before that record):
        // taking it over is the retry finishing.
        let mut changed = own.workloads.insert(request.workload.clone());
        if own.state == EntryState::NodeDetached {
            // Released, not yet controller-unpublished: claimed again before the detach.
            own.state = request.start_state;
            own.since = request.now;
            changed = true;
        }
        let claim_id = own.claim_id.clone();
        return Ok(Admitted {
            claims,
            claim_id,
            changed,
        });
    }
    if request.expected_claim.is_some() {
        return Err(Refusal::Lost { found: None });
    }
    if claims.nodes.len() >= MAX_NODES_PER_VOLUME {
        return Err(Refusal::TooManyNodes {
            max: MAX_NODES_PER_VOLUME,
        });
    }
    let others = holders(&claims, &request.node);
    let mode = claims.capability.access_mode;
    let allowed = match mode {
        AccessMode::SingleNodeWriter
        | AccessMode::SingleNodeReaderOnly
        | AccessMode::SingleNodeSingleWriter
        | AccessMode::SingleNodeMultiWriter => others.is_empty(),
        // Readers only: the request is read-only (a read-write publish of a read-only mode
        // is refused before any claim).
        AccessMode::MultiNodeReaderOnly => request.readonly,
        AccessMode::MultiNodeSingleWriter => request.readonly || others.iter().all(|h| h.readonly),
        AccessMode::MultiNodeMultiWriter => true,
    };
    if !allowed {
        return Err(Refusal::Held {
            access_mode: mode,
            holders: others,
        });
    }
    claims.nodes.insert(
        request.node.clone(),
        new_entry(request, &request.fresh_claim_id),
    );
    Ok(Admitted {
        claims,
        claim_id: request.fresh_claim_id.clone(),
        changed: true,
    })
}

fn new_entry(request: &ClaimRequest, claim_id: &str) -> NodeEntry {
    NodeEntry {
        claim_id: claim_id.to_owned(),
        csi_node_id: request.csi_node_id.clone(),
        readonly: request.readonly,
        state: request.start_state,
        workloads: BTreeSet::from([request.workload.clone()]),
        publish_context: Default::default(),
        volume_context: request.volume_context.clone(),
        error: None,
        since: request.now,
    }
}

/// The node's entry as it must be after a step of its own: `None` when the entry is not the
/// node's claim `claim_id` any more (fenced or replaced: the caller must not write).
pub fn own_entry<'a>(
    claims: &'a mut VolumeClaims,
    node: &str,
    claim_id: &str,
) -> Option<&'a mut NodeEntry> {
    claims
        .nodes
        .get_mut(node)
        .filter(|entry| entry.claim_id == claim_id && entry.state != EntryState::Fenced)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    fn cap(mode: AccessMode) -> SharedCapability {
        SharedCapability {
            access_mode: mode,
            access_type: "mount".into(),
            fs_type: String::new(),
        }
    }

    fn request(node: &str, mode: AccessMode, readonly: bool) -> ClaimRequest {
        ClaimRequest {
            volume_id: "v1".into(),
            node: node.into(),
            workload: format!("w-{node}"),
            capability: cap(mode),
            readonly,
            csi_node_id: format!("csi-{node}"),
            expected_claim: None,
            fresh_claim_id: format!("id-{node}"),
            start_state: EntryState::Publishing,
            volume_context: Default::default(),
            now: 1,
        }
    }

    fn held_by(nodes: &[(&str, bool, EntryState)], mode: AccessMode) -> VolumeClaims {
        let mut claims = None;
        for (node, readonly, state) in nodes {
            let mut r = request(node, mode, *readonly);
            r.start_state = *state;
            let next = match claims.as_ref() {
                None => admit(None, &r).unwrap().claims,
                Some(c) => {
                    let mut c: VolumeClaims = Clone::clone(c);
                    c.nodes
                        .insert(node.to_string(), new_entry(&r, &r.fresh_claim_id));
                    c
                }
            };
            claims = Some(next);
        }
        claims.unwrap()
    }

    const ALL_STATES: [EntryState; 4] = [
        EntryState::Publishing,
        EntryState::Attached,
        EntryState::NodeDetached,
        EntryState::Fenced,
    ];

    #[test]
    fn a_single_node_volume_is_refused_to_a_second_node_whatever_the_first_entrys_state() {
        for mode in [
            AccessMode::SingleNodeWriter,
            AccessMode::SingleNodeReaderOnly,
            AccessMode::SingleNodeSingleWriter,
            AccessMode::SingleNodeMultiWriter,
        ] {
            for state in ALL_STATES {
                let claims = held_by(&[("n1", mode.is_read_only(), state)], mode);
                let err =
                    admit(Some(&claims), &request("n2", mode, mode.is_read_only())).unwrap_err();
                match err {
                    Refusal::Held { holders, .. } => {
                        assert_eq!(holders.len(), 1);
                        assert_eq!(holders[0].node, "n1");
                        assert_eq!(holders[0].state, state);
                    }
                    other => panic!("{mode:?} {state:?}: {other:?}"),
                }
            }
        }
    }

    #[test]
    fn multi_node_modes_admit_what_they_allow() {
        let ro = AccessMode::MultiNodeReaderOnly;
        let claims = held_by(
            &[
                ("n1", true, EntryState::Attached),
                ("n2", true, EntryState::Attached),
            ],
            ro,
        );
        let admitted = admit(Some(&claims), &request("n3", ro, true)).unwrap();
        assert_eq!(admitted.claims.nodes.len(), 3);

        let sw = AccessMode::MultiNodeSingleWriter;
        let claims = held_by(&[("n1", false, EntryState::Attached)], sw);
        assert!(
            admit(Some(&claims), &request("n2", sw, true)).is_ok(),
            "a reader beside the writer"
        );
        assert!(
            matches!(
                admit(Some(&claims), &request("n2", sw, false)),
                Err(Refusal::Held { .. })
            ),
            "a second writer"
        );
        let readers = held_by(&[("n1", true, EntryState::Attached)], sw);
        assert!(
            admit(Some(&readers), &request("n2", sw, false)).is_ok(),
            "the one writer"
        );

        let mw = AccessMode::MultiNodeMultiWriter;
        let claims = held_by(
            &[
                ("n1", false, EntryState::Attached),
                ("n2", false, EntryState::Publishing),
            ],
            mw,
        );
        assert!(admit(Some(&claims), &request("n3", mw, false)).is_ok());
    }

    #[test]
    fn another_capability_is_refused_naming_the_held_one() {
        let claims = held_by(
            &[("n1", false, EntryState::Attached)],
            AccessMode::MultiNodeMultiWriter,
        );
        let err = admit(
            Some(&claims),
            &request("n2", AccessMode::MultiNodeSingleWriter, false),
        )
        .unwrap_err();
        assert!(
            matches!(err, Refusal::OtherCapability { ref held, .. } if held.access_mode == AccessMode::MultiNodeMultiWriter),
            "{err:?}"
        );
    }

    #[test]
    fn the_same_node_adds_a_workload_and_reopens_a_released_entry() {
        let mode = AccessMode::SingleNodeWriter;
        let claims = held_by(&[("n1", false, EntryState::Attached)], mode);
        let mut again = request("n1", mode, false);
        again.expected_claim = Some("id-n1".into());
        let same = admit(Some(&claims), &again).unwrap();
        assert!(!same.changed, "the same workload again writes nothing");
        again.workload = "w2".into();
        let more = admit(Some(&claims), &again).unwrap();
        assert!(more.changed);
        assert_eq!(more.claim_id, "id-n1");
        assert_eq!(more.claims.nodes["n1"].workloads.len(), 2);

        let detached = held_by(&[("n1", false, EntryState::NodeDetached)], mode);
        let reopened = admit(Some(&detached), &again).unwrap();
        assert_eq!(reopened.claims.nodes["n1"].state, EntryState::Publishing);
    }

    #[test]
    fn a_hold_taken_away_is_lost_not_silently_reclaimed() {
        let mode = AccessMode::SingleNodeWriter;
        let mut r = request("n1", mode, false);
        r.expected_claim = Some("id-old".into());
        assert_eq!(admit(None, &r).unwrap_err(), Refusal::Lost { found: None });
        let replaced = held_by(&[("n1", false, EntryState::Attached)], mode);
        assert!(matches!(
            admit(Some(&replaced), &r),
            Err(Refusal::Lost { found: Some(_) })
        ));
        let fenced = held_by(&[("n1", false, EntryState::Fenced)], mode);
        r.expected_claim = Some("id-n1".into());
        assert!(matches!(
            admit(Some(&fenced), &r),
            Err(Refusal::Lost {
                found: Some((_, EntryState::Fenced))
            })
        ));
        // An orphan of this node's own (no expected id: the crash came before its record)
        // is taken over, with its id.
        r.expected_claim = None;
        let orphan = held_by(&[("n1", false, EntryState::Publishing)], mode);
        assert_eq!(admit(Some(&orphan), &r).unwrap().claim_id, "id-n1");
    }

    #[test]
    fn a_readonly_mismatch_on_the_own_entry_is_refused() {
        let mode = AccessMode::MultiNodeSingleWriter;
        let claims = held_by(&[("n1", true, EntryState::Attached)], mode);
        let err = admit(Some(&claims), &request("n1", mode, false)).unwrap_err();
        assert_eq!(
            err,
            Refusal::OtherReadonly {
                held_readonly: true
            }
        );
    }

    proptest::proptest! {
        /// Whatever sequence of claims and deletions three nodes make, a single-node volume
        /// never has two entries, and a single-writer volume never two writers.
        #[test]
        fn no_sequence_gives_two_holders_where_the_mode_allows_one(
            ops in proptest::collection::vec((0usize..3, proptest::bool::ANY, proptest::bool::ANY, 0usize..3), 1..60)
        ) {
            for mode in [AccessMode::SingleNodeWriter, AccessMode::MultiNodeSingleWriter] {
                let mut value: Option<VolumeClaims> = None;
                for (node, readonly, release, _) in &ops {
                    let node = format!("n{node}");
                    if *release {
                        if let Some(v) = value.as_mut() {
                            v.nodes.remove(&node);
                            if v.nodes.is_empty() { value = None; }
                        }
                        continue;
                    }
                    let mut r = request(&node, mode, *readonly);
                    r.expected_claim = value.as_ref().and_then(|v| v.nodes.get(&node)).map(|e| e.claim_id.clone());
                    if let Ok(admitted) = admit(value.as_ref(), &r) {
                        value = Some(admitted.claims);
                    }
                    if let Some(v) = &value {
                        match mode {
                            AccessMode::SingleNodeWriter => proptest::prop_assert!(v.nodes.len() <= 1),
                            _ => proptest::prop_assert!(v.nodes.values().filter(|e| !e.readonly).count() <= 1),
                        }
                    }
                }
            }
        }
    }
}
