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
    /// An expansion asked and not finished (durable before its first RPC); absent in the
    /// JSON when none is.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expansion: Option<super::expand::Expansion>,
    /// Where the volume is accessible from, as CreateVolume reported (empty: not said).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub accessible_topology: Vec<BTreeMap<String, String>>,
    /// This node's claim id on the volume in etcd (cluster plugins only): written with the
    /// node's own claim, after the claim in etcd; cleared after the entry's removal.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cluster_claim: Option<String>,
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
            expansion: None,
            accessible_topology: Vec::new(),
            cluster_claim: None,
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

/// How many claims one volume may have, and how long each claim's `bind_to` may be
/// (`--max-claims-per-volume`, `--max-bind-to-bytes`). They bound what a record can grow to,
/// so that every record that can be written can be read back: the store refuses (and
/// quarantines) a record over [`MAX_FILE_BYTES`](crate::store::files::MAX_FILE_BYTES) when
/// it reads one (issue #24, L2). Enforced when a claim is added; a record read back with more
/// claims than the limit (the limit was lowered) keeps them, but takes no new one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ClaimLimits {
    pub max_claims: usize,
    pub max_bind_to_bytes: usize,
}

/// The default `--max-claims-per-volume`.
pub const DEFAULT_MAX_CLAIMS: usize = 256;
/// The default (and largest) `--max-bind-to-bytes`: a path the kernel accepts (`PATH_MAX`
/// less its NUL).
pub const MAX_BIND_TO_BYTES: usize = crate::beneath::MAX_PATH_BYTES;
/// The part of a record's read cap its claims may take; the rest (a quarter, 2 MiB) is for
/// the other fields (contexts, error text).
pub const CLAIMS_BUDGET_BYTES: u64 = crate::store::files::MAX_FILE_BYTES / 4 * 3;
/// The most a boot id (ours: 36 bytes) and the fixed text of one `bind_mounts` entry take.
const BIND_ENTRY_FIXED_BYTES: u64 = 256;

/// The most one claim can add to a record's JSON, whatever its characters: the workload id
/// twice (in `claims` and as its `bind_mounts` key), each at most
/// [`MAX_ID_BYTES`](super::MAX_ID_BYTES) bytes escaped to at most 6 each (`\u001f`), quoted,
/// with a separator; and its `bind_to` of at most `max_bind_to_bytes`, escaped to at most 2
/// each (`\"`, `\\`: a `bind_to` with a control character is refused), with the entry's
/// other fields.
pub const fn worst_claim_bytes(max_bind_to_bytes: usize) -> u64 {
    let id = 6 * super::MAX_ID_BYTES as u64 + 3;
    2 * id + 2 * max_bind_to_bytes as u64 + BIND_ENTRY_FIXED_BYTES
}

// The defaults fit in the budget, with room to spare (issue #24: every record that can be
// written can be read back).
const _: () = assert!(
    DEFAULT_MAX_CLAIMS as u64 * worst_claim_bytes(MAX_BIND_TO_BYTES) <= CLAIMS_BUDGET_BYTES
);

/// Limits that would let a record outgrow what can be read back.
#[derive(Debug, thiserror::Error)]
pub enum ClaimLimitsError {
    #[error(
        "--max-bind-to-bytes {0} is out of range: give 1 to {MAX_BIND_TO_BYTES} (the longest path the kernel takes)"
    )]
    BindToBytes(usize),
    #[error(
        "--max-claims-per-volume {max_claims} with --max-bind-to-bytes {max_bind_to_bytes} lets a volume record reach {worst} bytes, more than the {CLAIMS_BUDGET_BYTES} its claims may take (records over {} bytes cannot be read back): lower one of them, e.g. --max-claims-per-volume {fits}",
        crate::store::files::MAX_FILE_BYTES
    )]
    TooLarge {
        max_claims: usize,
        max_bind_to_bytes: usize,
        worst: u64,
        fits: u64,
    },
}

impl Default for ClaimLimits {
    fn default() -> Self {
        Self {
            max_claims: DEFAULT_MAX_CLAIMS,
            max_bind_to_bytes: MAX_BIND_TO_BYTES,
        }
    }
}

impl ClaimLimits {
    /// The defaults, with what the flags or the config file set; refused when a record at
    /// these limits could not be read back.
    pub fn new(
        max_claims: Option<usize>,
        max_bind_to_bytes: Option<usize>,
    ) -> Result<Self, ClaimLimitsError> {
        let limits = Self {
            max_claims: max_claims.unwrap_or(DEFAULT_MAX_CLAIMS),
            max_bind_to_bytes: max_bind_to_bytes.unwrap_or(MAX_BIND_TO_BYTES),
        };
        if limits.max_bind_to_bytes == 0 || limits.max_bind_to_bytes > MAX_BIND_TO_BYTES {
            return Err(ClaimLimitsError::BindToBytes(limits.max_bind_to_bytes));
        }
        let per_claim = worst_claim_bytes(limits.max_bind_to_bytes);
        let worst = (limits.max_claims as u64).saturating_mul(per_claim);
        if worst > CLAIMS_BUDGET_BYTES {
            return Err(ClaimLimitsError::TooLarge {
                max_claims: limits.max_claims,
                max_bind_to_bytes: limits.max_bind_to_bytes,
                worst,
                fits: CLAIMS_BUDGET_BYTES / per_claim,
            });
        }
        Ok(limits)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    /// A record at the limits, made of the characters JSON escapes most, stays within what
    /// the store reads back: the bound above is not just arithmetic.
    #[test]
    fn a_record_at_the_claim_limits_fits_what_the_store_reads() {
        for limits in [
            ClaimLimits::default(),
            ClaimLimits::new(Some(768), Some(2700)).unwrap_or_else(|e| panic!("{e}")),
        ] {
            let mut record =
                VolumeRecord::new(&"v".repeat(super::super::MAX_ID_BYTES), Origin::Created);
            record.state = VolumeState::Published;
            record.boot_id = Some("b".repeat(36));
            for i in 0..limits.max_claims {
                // Control characters: 6 bytes each in JSON; the index keeps them distinct.
                let tag = format!("{i:05}");
                let workload = format!(
                    "{tag}{}",
                    "\u{1}".repeat(super::super::MAX_ID_BYTES - tag.len())
                );
                let path = format!(
                    "/{tag}/{}",
                    "\"".repeat(limits.max_bind_to_bytes - tag.len() - 2)
                );
                assert_eq!(path.len(), limits.max_bind_to_bytes);
                record.claims.insert(workload.clone());
                let mut bind = super::super::bind::BindMount::new(path.into());
                bind.mount_id = Some(u64::MAX);
                bind.boot_id = Some("b".repeat(36));
                bind.created_dirs = usize::MAX;
                record.bind_mounts.insert(workload, bind);
            }
            let base = serde_json::to_vec(&VolumeRecord {
                claims: Claims::default(),
                bind_mounts: BTreeMap::new(),
                ..record.clone()
            })
            .unwrap_or_else(|e| panic!("{e}"))
            .len() as u64;
            let json = serde_json::to_vec(&record).unwrap_or_else(|e| panic!("{e}"));
            let claims_bytes = json.len() as u64 - base;
            assert!(
                claims_bytes
                    <= limits.max_claims as u64 * worst_claim_bytes(limits.max_bind_to_bytes),
                "{claims_bytes} bytes of claims exceed the computed bound"
            );
            assert!(claims_bytes <= CLAIMS_BUDGET_BYTES, "{claims_bytes}");
            assert!((json.len() as u64) < crate::store::files::MAX_FILE_BYTES);
            let back: VolumeRecord =
                serde_json::from_slice(&json).unwrap_or_else(|e| panic!("{e}"));
            assert_eq!(back, record);
        }
    }

    #[test]
    fn limits_that_would_outgrow_the_read_cap_are_refused_naming_the_flags() {
        let err = ClaimLimits::new(Some(100_000), None)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("--max-claims-per-volume 100000")
                && err.contains("--max-bind-to-bytes 4095"),
            "{err}"
        );
        assert!(
            err.contains("lower one of them, e.g. --max-claims-per-volume 629"),
            "{err}"
        );
        assert!(ClaimLimits::new(Some(629), None).is_ok());
        assert!(ClaimLimits::new(Some(630), None).is_err());
        assert!(ClaimLimits::new(None, Some(0)).is_err());
        assert!(
            ClaimLimits::new(None, Some(4096))
                .unwrap_err()
                .to_string()
                .contains("1 to 4095")
        );
    }

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
