//! The durable volume record: what csi-agent knows about one volume, as written to
//! `volumes/<enc id>/volume.json`.
//!
//! The record holds the *actual* state (the steady or transient state of the lifecycle) and
//! the *desired* state (the claims). It carries no secrets: those live in the 0600 secrets
//! file beside it. This module defines data and its conversions only; the volume manager
//! decides when records change.

use std::collections::BTreeMap;

use csi_proto::v1;
use serde::{Deserialize, Serialize};

/// Mesos's `csi.state.VolumeState`: four steady states and one transient state per RPC.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum VolumeState {
    /// Known (created or pre-provisioned); nothing done on this node.
    Created,
    /// ControllerPublish in flight (or its outcome unknown).
    ControllerPublish,
    /// ControllerUnpublish in flight (or its outcome unknown).
    ControllerUnpublish,
    /// Attached to this node (or no controller publish needed).
    NodeReady,
    NodeStage,
    NodeUnstage,
    /// Staged (or no staging needed).
    VolReady,
    NodePublish,
    NodeUnpublish,
    /// Published at the target path.
    Published,
}

impl VolumeState {
    /// Position on the ladder `CREATED(0) … PUBLISHED(6)`: steady states are even, a transient
    /// state sits between the two steady states its RPC moves between.
    pub fn level(self) -> u8 {
        match self {
            VolumeState::Created => 0,
            VolumeState::ControllerPublish | VolumeState::ControllerUnpublish => 1,
            VolumeState::NodeReady => 2,
            VolumeState::NodeStage | VolumeState::NodeUnstage => 3,
            VolumeState::VolReady => 4,
            VolumeState::NodePublish | VolumeState::NodeUnpublish => 5,
            VolumeState::Published => 6,
        }
    }

    pub fn is_transient(self) -> bool {
        self.level() % 2 == 1
    }

    /// True when something may exist on this node (a stage or a publish, done or uncertain):
    /// exactly the states a reboot invalidates.
    pub fn is_node_side(self) -> bool {
        self.level() >= 3
    }

    pub fn as_str(self) -> &'static str {
        match self {
            VolumeState::Created => "CREATED",
            VolumeState::ControllerPublish => "CONTROLLER_PUBLISH",
            VolumeState::ControllerUnpublish => "CONTROLLER_UNPUBLISH",
            VolumeState::NodeReady => "NODE_READY",
            VolumeState::NodeStage => "NODE_STAGE",
            VolumeState::NodeUnstage => "NODE_UNSTAGE",
            VolumeState::VolReady => "VOL_READY",
            VolumeState::NodePublish => "NODE_PUBLISH",
            VolumeState::NodeUnpublish => "NODE_UNPUBLISH",
            VolumeState::Published => "PUBLISHED",
        }
    }

    pub const ALL: [VolumeState; 10] = [
        VolumeState::Created,
        VolumeState::ControllerPublish,
        VolumeState::ControllerUnpublish,
        VolumeState::NodeReady,
        VolumeState::NodeStage,
        VolumeState::NodeUnstage,
        VolumeState::VolReady,
        VolumeState::NodePublish,
        VolumeState::NodeUnpublish,
        VolumeState::Published,
    ];
}

/// CSI access modes, spelled as in the spec.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum AccessMode {
    SingleNodeWriter,
    SingleNodeReaderOnly,
    MultiNodeReaderOnly,
    MultiNodeSingleWriter,
    MultiNodeMultiWriter,
    SingleNodeSingleWriter,
    SingleNodeMultiWriter,
}

impl AccessMode {
    /// Modes under which a workload can never write: publishing read-write contradicts them.
    pub fn is_read_only(self) -> bool {
        matches!(
            self,
            AccessMode::SingleNodeReaderOnly | AccessMode::MultiNodeReaderOnly
        )
    }

    fn to_v1(self) -> v1::volume_capability::access_mode::Mode {
        use v1::volume_capability::access_mode::Mode;
        match self {
            AccessMode::SingleNodeWriter => Mode::SingleNodeWriter,
            AccessMode::SingleNodeReaderOnly => Mode::SingleNodeReaderOnly,
            AccessMode::MultiNodeReaderOnly => Mode::MultiNodeReaderOnly,
            AccessMode::MultiNodeSingleWriter => Mode::MultiNodeSingleWriter,
            AccessMode::MultiNodeMultiWriter => Mode::MultiNodeMultiWriter,
            AccessMode::SingleNodeSingleWriter => Mode::SingleNodeSingleWriter,
            AccessMode::SingleNodeMultiWriter => Mode::SingleNodeMultiWriter,
        }
    }
}

/// How the volume is accessed: a mounted file system or a raw block device. `Debug` never
/// shows mount flags (they can carry credentials, e.g. a CIFS password).
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AccessType {
    Mount {
        #[serde(default)]
        fs_type: String,
        /// Mount flags may be sensitive (they can carry credentials): never logged.
        #[serde(default)]
        mount_flags: Vec<String>,
    },
    Block {},
}

impl std::fmt::Debug for AccessType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            AccessType::Mount {
                fs_type,
                mount_flags,
            } => f
                .debug_struct("Mount")
                .field("fs_type", fs_type)
                .field(
                    "mount_flags",
                    &format_args!("<redacted {} flags>", mount_flags.len()),
                )
                .finish(),
            AccessType::Block {} => f.write_str("Block"),
        }
    }
}

/// A CSI `VolumeCapability` in csi-agent's own, stable JSON shape.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Capability {
    #[serde(flatten)]
    pub access_type: AccessType,
    pub access_mode: AccessMode,
}

impl Capability {
    pub fn to_v1(&self) -> v1::VolumeCapability {
        let access_type = match &self.access_type {
            AccessType::Mount {
                fs_type,
                mount_flags,
            } => v1::volume_capability::AccessType::Mount(v1::volume_capability::MountVolume {
                fs_type: fs_type.clone(),
                mount_flags: mount_flags.clone(),
                ..Default::default()
            }),
            AccessType::Block {} => {
                v1::volume_capability::AccessType::Block(v1::volume_capability::BlockVolume {})
            }
        };
        v1::VolumeCapability {
            access_type: Some(access_type),
            access_mode: Some(v1::volume_capability::AccessMode {
                mode: self.access_mode.to_v1().into(),
            }),
        }
    }
}

/// Where a volume came from: created through csi-agent (kept until deleted) or given by the
/// caller (pre-provisioned: forgotten once nothing claims it).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Origin {
    PreProvisioned,
    Created,
}

/// The workloads claiming a volume: a set, kept as a sorted vector. A volume has one claim or
/// a few, and a `BTreeSet` would spend a 288-byte node on each record (about 27 MiB at
/// 100,000 volumes, issue #10's memory bound). Its JSON is the same: a sorted array of
/// distinct strings. A hand-edited array with duplicates or out of order reads back as the
/// set it means.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Claims(Vec<String>);

impl Claims {
    /// Adds `workload`; false if it was already there.
    pub fn insert(&mut self, workload: String) -> bool {
        match self.0.binary_search(&workload) {
            Ok(_) => false,
            Err(at) => {
                // Exactly the room needed: most volumes have one claim all their life.
                self.0.reserve_exact(1);
                self.0.insert(at, workload);
                true
            }
        }
    }

    /// Removes `workload`; false if it was not there.
    pub fn remove(&mut self, workload: &str) -> bool {
        match self.0.binary_search_by(|w| w.as_str().cmp(workload)) {
            Ok(at) => {
                self.0.remove(at);
                true
            }
            Err(_) => false,
        }
    }

    pub fn contains(&self, workload: &str) -> bool {
        self.0
            .binary_search_by(|w| w.as_str().cmp(workload))
            .is_ok()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// The workloads, sorted.
    pub fn iter(&self) -> std::slice::Iter<'_, String> {
        self.0.iter()
    }
}

impl FromIterator<String> for Claims {
    fn from_iter<I: IntoIterator<Item = String>>(workloads: I) -> Self {
        let mut all: Vec<String> = workloads.into_iter().collect();
        all.sort_unstable();
        all.dedup();
        all.shrink_to_fit();
        Claims(all)
    }
}

impl<'a> IntoIterator for &'a Claims {
    type Item = &'a String;
    type IntoIter = std::slice::Iter<'a, String>;

    fn into_iter(self) -> Self::IntoIter {
        self.0.iter()
    }
}

impl<'de> Deserialize<'de> for Claims {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        Vec::<String>::deserialize(deserializer).map(Claims::from_iter)
    }
}

/// One volume's durable record.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct VolumeRecord {
    pub volume_id: String,
    pub state: VolumeState,
    pub origin: Origin,
    /// Workloads that want the volume published: the desired state.
    #[serde(default)]
    pub claims: Claims,
    /// The capability the volume is (being) staged and published with; `None` until the first
    /// publish of a created volume.
    #[serde(default)]
    pub capability: Option<Capability>,
    #[serde(default)]
    pub readonly: bool,
    #[serde(default)]
    pub volume_context: BTreeMap<String, String>,
    /// From ControllerPublish, passed to NodeStage and NodePublish.
    #[serde(default)]
    pub publish_context: BTreeMap<String, String>,
    /// The node id ControllerPublish was called with (needed for the matching unpublish).
    #[serde(default)]
    pub node_id: Option<String>,
    /// The boot the node-side state belongs to; a different boot id at recovery means every
    /// mount vanished with a reboot.
    #[serde(default)]
    pub boot_id: Option<String>,
    /// Capacity reported at creation (0 when unknown).
    #[serde(default)]
    pub capacity_bytes: i64,
    /// True when a secrets file exists beside the record.
    #[serde(default)]
    pub has_secrets: bool,
    /// Set when a reboot wiped the node-side state this record describes: the plugin's own
    /// bookkeeping may still say "staged"/"published", so going down still unpublishes and
    /// unstages (to clear it), and going up stages again before publishing.
    #[serde(default)]
    pub node_state_lost: bool,
    /// Paths where csi-agent bind-mounts the target for a workload (`bind_to`), by workload.
    /// Recorded with the claim, before the mount, so that a crash never leaks one.
    #[serde(default)]
    pub bind_mounts: BTreeMap<String, super::bind::BindMount>,
    /// The last final error met while driving the volume, for operators.
    #[serde(default)]
    pub last_error: Option<String>,
}

impl VolumeRecord {
    pub fn new(volume_id: &str, origin: Origin) -> Self {
        Self {
            volume_id: volume_id.to_owned(),
            state: VolumeState::Created,
            origin,
            claims: Claims::default(),
            capability: None,
            readonly: false,
            volume_context: BTreeMap::new(),
            publish_context: BTreeMap::new(),
            node_id: None,
            boot_id: None,
            capacity_bytes: 0,
            has_secrets: false,
            node_state_lost: false,
            bind_mounts: BTreeMap::new(),
            last_error: None,
        }
    }

    /// The state the claims ask for.
    pub fn wants_published(&self) -> bool {
        !self.claims.is_empty()
    }

    /// True when nothing remains to undo and nothing claims the volume: a pre-provisioned
    /// volume in this condition is forgotten.
    pub fn is_idle(&self) -> bool {
        self.claims.is_empty() && self.state == VolumeState::Created
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn levels_put_each_transient_between_its_steady_states() {
        for state in VolumeState::ALL {
            let steady = matches!(
                state,
                VolumeState::Created
                    | VolumeState::NodeReady
                    | VolumeState::VolReady
                    | VolumeState::Published
            );
            assert_eq!(state.is_transient(), !steady, "{state:?}");
        }
    }

    #[test]
    fn debug_hides_mount_flags() {
        let access = AccessType::Mount {
            fs_type: "cifs".into(),
            mount_flags: vec!["password=hunter2".into()],
        };
        let shown = format!("{access:?}");
        assert!(
            !shown.contains("hunter2") && shown.contains("cifs"),
            "{shown}"
        );
    }

    #[test]
    fn claims_are_a_sorted_set_in_memory_and_in_json() {
        let mut claims = Claims::default();
        assert!(claims.insert("w2".into()));
        assert!(claims.insert("w1".into()));
        assert!(!claims.insert("w2".into()), "a claim is there once");
        assert!(claims.contains("w1") && claims.contains("w2") && !claims.contains("w3"));
        assert_eq!(claims.len(), 2);
        assert_eq!(
            serde_json::to_string(&claims).unwrap_or_default(),
            r#"["w1","w2"]"#
        );
        assert!(claims.remove("w1"));
        assert!(!claims.remove("w1"));
        assert_eq!(claims.iter().collect::<Vec<_>>(), ["w2"]);
        // A hand-edited array: duplicates and order do not matter, as for the BTreeSet the
        // records were written with.
        let read: Claims = serde_json::from_str(r#"["b","a","b"]"#).unwrap_or_default();
        assert_eq!(read.iter().collect::<Vec<_>>(), ["a", "b"]);
        let old: std::collections::BTreeSet<String> = ["b".to_owned(), "a".to_owned()].into();
        assert_eq!(
            serde_json::to_string(&old).unwrap_or_default(),
            serde_json::to_string(&read).unwrap_or_default()
        );
        assert!(serde_json::from_str::<Claims>(r#"{"a": 1}"#).is_err());
    }

    #[test]
    fn record_json_is_stable() {
        let mut record = VolumeRecord::new("vol/1", Origin::PreProvisioned);
        record.claims.insert("w1".into());
        record.capability = Some(Capability {
            access_type: AccessType::Mount {
                fs_type: "ext4".into(),
                mount_flags: vec![],
            },
            access_mode: AccessMode::SingleNodeWriter,
        });
        let json = serde_json::to_value(&record).unwrap_or_default();
        assert_eq!(json["state"], "CREATED");
        assert_eq!(json["capability"]["mount"]["fs_type"], "ext4");
        assert_eq!(json["capability"]["access_mode"], "SINGLE_NODE_WRITER");
        let back: VolumeRecord = serde_json::from_value(json).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(back, record);
    }
}
