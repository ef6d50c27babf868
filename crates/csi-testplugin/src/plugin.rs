//! The version-neutral core: one [`Plugin`] whose operations implement the
//! CSI semantics once, for the v1 and v0 adapters alike.
//!
//! Owns: volumes (directories under `<work-dir>/volumes/<id>`, the id being
//! the name), validation order and error codes of every RPC, idempotency,
//! the node-side rules (staging, target creation per version, read-only
//! publication), and start-up reconciliation of `state.json` with the volume
//! directories and the boot id.
//!
//! Must not: know protobuf types (the adapters convert), talk to the socket,
//! or inject faults (that is `rpc.rs`). Every change is recorded in the store
//! *before* the mount it describes (intent first), so that a plugin killed
//! between the two finds the record and can finish or undo the mount; an
//! unrecorded mount point is never adopted nor unmounted.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::io;
use std::ops::Bound;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::Context;
use tonic::Status;

use crate::backend::{Backend, CatalogueEntry};
use crate::backing::{self, VolumeFs};
use crate::block;
use crate::calllog::CallLog;
use crate::cli::Config;
use crate::faults::Faults;
use crate::model::{ApiVersion, CapArg, Capability, Unsupported, validate_volume_name};
use crate::mounts::{self, MountMode};
use crate::rpc::Inflight;
use crate::state::{
    ContentSource, ControllerPublication, Publication, Staging, StateFile, Store, VolumeRecord,
};

mod snapshots;
pub use snapshots::{SnapshotArgs, SnapshotInfo};

#[path = "expand.rs"]
pub mod expand;

/// Size of a volume created without a capacity range (capped by
/// `limit_bytes` when only that is given).
pub const DEFAULT_VOLUME_SIZE: i64 = 1 << 30;

/// Controller capability numbers (identical in v1 and v0 for 1..=4).
pub const CAP_CREATE_DELETE_VOLUME: i32 = 1;
pub const CAP_PUBLISH_UNPUBLISH_VOLUME: i32 = 2;
pub const CAP_LIST_VOLUMES: i32 = 3;
pub const CAP_GET_CAPACITY: i32 = 4;
/// v1 only.
pub const CAP_PUBLISH_READONLY: i32 = 8;
/// v1 only.
pub const CAP_LIST_VOLUMES_PUBLISHED_NODES: i32 = 10;
/// v1 only (`--get-volume`).
pub const CAP_GET_VOLUME: i32 = 12;
/// ControllerServiceCapability VOLUME_CONDITION: ControllerGetVolume reports the condition.
pub const CAP_VOLUME_CONDITION: i32 = 11;
/// Plugin capability `VOLUME_ACCESSIBILITY_CONSTRAINTS` (v1 only here: `--topology`).
pub const PLUGIN_CAP_VOLUME_ACCESSIBILITY_CONSTRAINTS: i32 = 2;
/// Node capability `STAGE_UNSTAGE_VOLUME` (v1 and v0).
pub const NODE_CAP_STAGE_UNSTAGE_VOLUME: i32 = 1;
pub const NODE_CAP_GET_VOLUME_STATS: i32 = 2;
pub const NODE_CAP_VOLUME_CONDITION: i32 = 4;
/// Plugin capability `CONTROLLER_SERVICE` (v1 and v0).
pub const PLUGIN_CAP_CONTROLLER_SERVICE: i32 = 1;

/// A volume as the controller RPCs report it.
#[derive(Clone, Debug)]
pub struct VolumeInfo {
    pub id: String,
    pub capacity_bytes: i64,
    pub context: HashMap<String, String>,
    pub content_source: Option<ContentSource>,
}

/// A ListVolumes entry.
#[derive(Clone, Debug)]
pub struct ListedVolume {
    pub info: VolumeInfo,
    pub published_nodes: Vec<String>,
}

/// CreateVolume, version-neutral.
#[derive(Debug)]
pub struct CreateArgs {
    pub name: String,
    pub required_bytes: i64,
    pub limit_bytes: i64,
    pub capabilities: Vec<CapArg>,
    pub parameters: BTreeMap<String, String>,
    pub has_content_source: bool,
    /// The source, where the adapter could read it (v1); `None` with
    /// `has_content_source` is a source of an unsupported kind.
    pub content_source: Option<ContentSource>,
    pub has_mutable_parameters: bool,
    /// `accessibility_requirements` (v1 only; `None` when not given).
    pub accessibility: Option<crate::topology::Requirements>,
}

/// NodePublishVolume, version-neutral.
#[derive(Debug)]
pub struct PublishArgs {
    pub volume_id: String,
    pub target_path: String,
    /// Empty when not given.
    pub staging_path: String,
    pub capability: CapArg,
    pub readonly: bool,
    /// Decides who owns the target directory (v1: the plugin; v0: the CO).
    pub version: ApiVersion,
}

fn invalid(msg: impl Into<String>) -> Status {
    Status::invalid_argument(msg)
}

fn precondition(msg: impl Into<String>) -> Status {
    Status::failed_precondition(msg)
}

fn internal(what: &str, e: impl std::fmt::Display) -> Status {
    Status::internal(format!("{what}: {e}"))
}

/// The spec requires every path argument to be "an absolute path in the root
/// filesystem of the process serving this request".
fn check_absolute(path: &str, field: &str) -> Result<(), Status> {
    if Path::new(path).is_absolute() {
        Ok(())
    } else {
        Err(invalid(format!(
            "{field} {path:?} must be an absolute path"
        )))
    }
}

/// Parses every capability argument; the first malformed one wins.
fn parse_caps(caps: Vec<CapArg>) -> Result<Vec<Capability>, Status> {
    caps.into_iter().collect()
}

fn is_mount_point(path: &Path) -> Result<bool, Status> {
    mounts::is_mount_point(path).map_err(|e| internal("reading /proc/self/mountinfo", e))
}

/// Encodes a ListVolumes page token: the last id returned, hex-encoded
/// behind a prefix, so that any other string (e.g. `invalid-token`) is
/// recognisably invalid, and a token stays valid when its volume is deleted.
fn encode_token(last_id: &str) -> String {
    let mut s = String::from("after:");
    for b in last_id.as_bytes() {
        s.push_str(&format!("{b:02x}"));
    }
    s
}

fn decode_token(token: &str) -> Option<String> {
    let hex = token.strip_prefix("after:")?;
    if hex.is_empty() || hex.len() % 2 != 0 {
        return None;
    }
    let bytes = (0..hex.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(hex.get(i..i + 2)?, 16).ok())
        .collect::<Option<Vec<u8>>>()?;
    String::from_utf8(bytes).ok()
}

/// The bounds of one page of ListVolumes or ListSnapshots: the id after which it starts and
/// how many entries it holds at most. Both requests say of `max_entries`: "The value of this
/// field MUST NOT be negative", and both tables: "Invalid starting_token | 10 ABORTED".
fn page_bounds(max_entries: i32, starting_token: &str) -> Result<(Option<String>, usize), Status> {
    if max_entries < 0 {
        return Err(invalid("max_entries must not be negative"));
    }
    let after =
        if starting_token.is_empty() {
            None
        } else {
            Some(decode_token(starting_token).ok_or_else(|| {
                Status::aborted(format!("invalid starting_token {starting_token:?}"))
            })?)
        };
    let limit = usize::try_from(max_entries)
        .ok()
        .filter(|n| *n > 0)
        .unwrap_or(usize::MAX);
    Ok((after, limit))
}

fn read_boot_id() -> String {
    std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .map(|s| s.trim().to_owned())
        .unwrap_or_default()
}

/// Removes a target directory the plugin owns: a single `rmdir`, never a
/// recursive delete (the directory may hide data if an unmount was missed).
fn remove_target_dir(target: &Path) -> Result<(), Status> {
    match std::fs::remove_dir(target) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(internal(
            &format!("removing target_path {}", target.display()),
            e,
        )),
    }
}

/// Mounts the tmpfs of every recorded volume that lacks one: after a reboot,
/// or when the plugin starts in a new mount namespace, the volume comes back
/// empty (a tmpfs is memory), which is logged.
fn mount_tmpfs_backings(store: &Store, volumes_dir: &Path) -> anyhow::Result<()> {
    let volumes: Vec<(String, i64)> = store.read(|s| {
        s.volumes
            .iter()
            .filter(|(_, v)| !v.block)
            .map(|(id, v)| (id.clone(), v.capacity_bytes))
            .collect()
    });
    for (id, capacity) in volumes {
        let dir = volumes_dir.join(&id);
        if !mounts::is_mount_point(&dir)? {
            tracing::warn!(volume = %id, "mounting the volume's tmpfs again: its data did not survive");
        }
        backing::make(&dir, VolumeFs::Tmpfs, capacity)
            .with_context(|| format!("mounting the tmpfs of volume {id:?} on {}", dir.display()))?;
    }
    Ok(())
}

/// The node holding a volume against a publication `wanted` to one more node, if any: every
/// node, when either side is single-node; the writer, when both are
/// MULTI_NODE_SINGLE_WRITER and both would write; none otherwise (readers, multi-writers).
fn holder_against(
    published: &BTreeMap<String, ControllerPublication>,
    wanted: &ControllerPublication,
) -> Option<String> {
    use crate::model::AccessMode::MultiNodeSingleWriter;
    let writes = |p: &ControllerPublication| !p.readonly && !p.capability.mode.is_read_only();
    published
        .iter()
        .find(|(_, p)| {
            !wanted.capability.mode.is_multi_node()
                || !p.capability.mode.is_multi_node()
                || ((wanted.capability.mode == MultiNodeSingleWriter
                    || p.capability.mode == MultiNodeSingleWriter)
                    && writes(wanted)
                    && writes(p))
        })
        .map(|(node, _)| node.clone())
}

/// The core plugin.
#[derive(Debug)]
pub struct Plugin {
    cfg: Config,
    volumes_dir: PathBuf,
    trash_dir: PathBuf,
    /// `--block`: the backing files of block volumes (`<work-dir>/blocks/<id>.img`).
    blocks_dir: PathBuf,
    store: Store,
    faults: Faults,
    calls: CallLog,
    inflight: Inflight,
    /// `--backend-dir`: the backend shared with other nodes' instances.
    backend: Option<Backend>,
}

impl Plugin {
    /// Opens the work dir: loads `state.json`, reconciles it with the volume
    /// directories and the boot id, and creates the pre-provisioned volumes.
    pub fn open(cfg: Config) -> anyhow::Result<Arc<Self>> {
        // The volumes may live in the backend: the work dir is made for the rest.
        std::fs::create_dir_all(&cfg.work_dir)
            .with_context(|| format!("creating {}", cfg.work_dir.display()))?;
        let backend = match &cfg.backend_dir {
            Some(dir) => Some(Backend::open(dir, &cfg.node_id)?),
            None => None,
        };
        let (volumes_dir, trash_dir) = match &backend {
            Some(b) => (b.volumes_dir(), b.trash_dir()),
            None => (cfg.work_dir.join("volumes"), cfg.work_dir.join("trash")),
        };
        std::fs::create_dir_all(&volumes_dir)
            .with_context(|| format!("creating {}", volumes_dir.display()))?;
        // Leftovers of deletions interrupted by a crash. A shared trash may hold another
        // instance's deletion in progress: its entries go one by one, and one that another
        // instance removes meanwhile is no error.
        if backend.is_some() {
            std::fs::create_dir_all(&trash_dir)?;
            for entry in std::fs::read_dir(&trash_dir)? {
                let path = entry?.path();
                if let Err(e) = std::fs::remove_dir_all(&path) {
                    tracing::warn!(path = %path.display(), "emptying the shared trash: {e}");
                }
            }
        } else if trash_dir.exists() {
            std::fs::remove_dir_all(&trash_dir)
                .with_context(|| format!("emptying {}", trash_dir.display()))?;
        }
        std::fs::create_dir_all(&trash_dir)?;

        for (name, _) in &cfg.volumes {
            let dir = volumes_dir.join(name);
            std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        }
        let mut dirs = HashSet::new();
        for entry in std::fs::read_dir(&volumes_dir)? {
            let entry = entry?;
            match entry.file_name().into_string() {
                Ok(name) if entry.file_type()?.is_dir() && validate_volume_name(&name).is_ok() => {
                    dirs.insert(name);
                }
                other => {
                    tracing::warn!(entry = ?other, "ignoring foreign entry in the volumes directory")
                }
            }
        }

        let store = Store::open(&cfg.work_dir.join("state.json"), cfg.state_durability)?;
        let boot_id = read_boot_id();
        let preprovisioned: HashMap<&str, i64> =
            cfg.volumes.iter().map(|(n, s)| (n.as_str(), *s)).collect();
        store.update_now(|s| {
            let mut changed = false;
            if s.boot_id != boot_id {
                if !s.boot_id.is_empty() {
                    // Every mount vanished with the reboot: node-side
                    // records describe nothing any more.
                    tracing::warn!("boot id changed since the last run; forgetting staged and published volumes");
                    for v in s.volumes.values_mut() {
                        v.staged = None;
                        v.published.clear();
                    }
                }
                s.boot_id.clone_from(&boot_id);
                changed = true;
            }
            for name in &dirs {
                if !s.volumes.contains_key(name) {
                    let size = preprovisioned.get(name.as_str()).copied();
                    if size.is_none() {
                        tracing::warn!(volume = %name, "adopting a volume directory without a record (size unknown)");
                    }
                    s.volumes.insert(
                        name.clone(),
                        VolumeRecord {
                            capacity_bytes: size.unwrap_or(0),
                            ..VolumeRecord::default()
                        },
                    );
                    changed = true;
                }
            }
            let gone: Vec<String> = s
                .volumes
                .keys()
                .filter(|k| !dirs.contains(*k))
                .cloned()
                .collect();
            for name in gone {
                tracing::warn!(volume = %name, "volume directory vanished; forgetting the volume");
                s.volumes.remove(&name);
                changed = true;
            }
            changed
        })?;
        let mut reconciled = Ok(());
        store.update_now(|s| {
            snapshots::reconcile_copies(&cfg, s, &volumes_dir).unwrap_or_else(|e| {
                reconciled = Err(e);
                false
            })
        })?;
        reconciled.context("removing copies a crash interrupted")?;
        if cfg.volume_fs == VolumeFs::Tmpfs {
            mount_tmpfs_backings(&store, &volumes_dir)?;
        }
        let used: i64 = store.read(|s| s.volumes.values().map(|v| v.capacity_bytes).sum());
        if used > cfg.capacity {
            tracing::warn!(used, capacity = cfg.capacity, "volumes exceed --capacity");
        }

        let faults = Faults::new(&cfg.faults_path, cfg.quirks);
        let calls = CallLog::open(&cfg.call_log_path)?;
        let plugin = Self {
            blocks_dir: cfg.work_dir.join("blocks"),
            cfg,
            volumes_dir,
            trash_dir,
            store,
            faults,
            calls,
            inflight: Inflight::default(),
            backend,
        };
        if let Some(b) = &plugin.backend {
            // The volumes found in the shared directory (pre-provisioned here, or left by
            // an instance that crashed before cataloguing them) join the catalogue.
            let found: Vec<(String, i64)> = plugin.store.read(|s| {
                s.volumes
                    .iter()
                    .map(|(id, v)| (id.clone(), v.capacity_bytes))
                    .collect()
            });
            b.with_lock(|shared| {
                let mut changed = false;
                for (id, capacity_bytes) in found {
                    shared.catalogue.entry(id).or_insert_with(|| {
                        changed = true;
                        CatalogueEntry {
                            capacity_bytes,
                            ..CatalogueEntry::default()
                        }
                    });
                }
                Ok(((), changed))
            })
            .map_err(|s| anyhow::anyhow!("{}", s.message()))?;
            plugin
                .sync_backend_now()
                .map_err(|s| anyhow::anyhow!("{}", s.message()))?;
        }
        Ok(Arc::new(plugin))
    }

    pub fn backend(&self) -> Option<&Backend> {
        self.backend.as_ref()
    }

    /// Takes the shared backend's truth into this instance's records, before every call:
    /// the volumes other nodes' instances created or deleted, and the nodes each volume is
    /// controller-published to. This node's staging and publications stay its own. Through
    /// the store's group commit, so that concurrent calls never write `state.json` at once.
    pub async fn sync_backend(&self) -> Result<(), Status> {
        let Some(b) = &self.backend else {
            return Ok(());
        };
        self.store
            .update(|s| take_backend(s, b).map(|changed| ((), changed)))
            .await
    }

    /// [`Plugin::sync_backend`] at start-up, before anything is served.
    fn sync_backend_now(&self) -> Result<(), Status> {
        let Some(b) = &self.backend else {
            return Ok(());
        };
        let mut outcome = Ok(());
        self.store
            .update_now(|s| match take_backend(s, b) {
                Ok(changed) => changed,
                Err(e) => {
                    outcome = Err(e);
                    false
                }
            })
            .map_err(|e| internal("persisting plugin state", format!("{e:#}")))?;
        outcome
    }

    /// Runs `decide` on volume `v`'s controller publications — with a backend, the shared
    /// ones, under its lock, written back if `decide` changed them — and returns its
    /// result and whether the local record changed.
    fn decide_publications<R>(
        &self,
        id: &str,
        v: &mut VolumeRecord,
        decide: impl FnOnce(&mut VolumeRecord) -> Result<(R, bool), Status>,
    ) -> Result<(R, bool), Status> {
        let Some(b) = &self.backend else {
            return decide(v);
        };
        let before = v.controller_published.clone();
        b.with_lock(|shared| {
            let att = shared.attachments.entry(id.to_owned()).or_default();
            v.controller_published = att.publications.clone();
            let (value, changed) = decide(v)?;
            if changed {
                att.set_publications(&v.controller_published);
            }
            Ok(((value, v.controller_published != before), changed))
        })
    }

    pub fn config(&self) -> &Config {
        &self.cfg
    }

    pub fn faults(&self) -> &Faults {
        &self.faults
    }

    pub fn calls(&self) -> &CallLog {
        &self.calls
    }

    pub fn inflight(&self) -> &Inflight {
        &self.inflight
    }

    pub(crate) fn volume_dir(&self, id: &str) -> PathBuf {
        self.volumes_dir.join(id)
    }

    pub(crate) fn record(&self, id: &str) -> Option<VolumeRecord> {
        self.store.read(|s| s.volumes.get(id).cloned())
    }

    fn not_found(id: &str) -> Status {
        Status::not_found(format!("volume {id:?} does not exist"))
    }

    /// Why this plugin cannot serve `cap` at all (block only with `--block`).
    fn unsupported(&self, cap: &Capability) -> Option<Unsupported> {
        cap.unsupported_reason_for(self.cfg.block)
    }

    /// Why `cap` cannot be used on the volume `rec`: unsupported, or the other access type
    /// than the volume was created for.
    fn unsupported_on(&self, cap: &Capability, rec: &VolumeRecord) -> Option<Unsupported> {
        let name = |block: bool| if block { "block" } else { "mount" };
        self.unsupported(cap).or_else(|| {
            (cap.is_block() != rec.block).then(|| Unsupported::OtherAccessType {
                volume: name(rec.block),
                asked: name(cap.is_block()),
            })
        })
    }

    fn backing_file(&self, id: &str) -> PathBuf {
        block::backing_file(&self.blocks_dir, id)
    }

    fn bind_mode(&self) -> bool {
        self.cfg.mount_mode == MountMode::Bind
    }

    // ----------------------------------------------------------------------
    // Identity
    // ----------------------------------------------------------------------

    pub fn plugin_name(&self, version: ApiVersion) -> String {
        if let Some(name) = self.faults.answers().plugin_name {
            return name;
        }
        if version.is_v0() {
            self.cfg.v0_plugin_name.clone()
        } else {
            self.cfg.plugin_name.clone()
        }
    }

    pub fn vendor_version(&self) -> String {
        if let Some(bytes) = self.faults.answers().vendor_version_bytes {
            return "9".repeat(bytes);
        }
        if self.faults.quirks().empty_vendor_version {
            String::new()
        } else {
            env!("CARGO_PKG_VERSION").to_owned()
        }
    }

    /// The `ready` field of a Probe answer: `None` for an empty answer (the
    /// empty-probe quirk, and always in CSI 0.2, whose ProbeResponse had no
    /// field). CSI 0.2 can only say "not ready" with an error, so the
    /// not-ready quirk answers FAILED_PRECONDITION there (the 0.x Probe
    /// error table: "Plugin not healthy | 9 FAILED_PRECONDITION").
    pub fn probe(&self, version: ApiVersion) -> Result<Option<bool>, Status> {
        let not_ready = self.faults.probe_not_ready_now();
        if version == ApiVersion::V0_2 {
            if not_ready {
                return Err(precondition("not ready yet (injected)"));
            }
            return Ok(None);
        }
        if self.faults.quirks().empty_probe {
            return Ok(None);
        }
        Ok(Some(!not_ready))
    }

    /// Applies the duplicate-capabilities quirk to a capability list.
    fn quirk_caps(&self, caps: Vec<i32>) -> Vec<i32> {
        if self.faults.quirks().duplicate_capabilities {
            caps.iter()
                .flat_map(|c| [*c, *c])
                .chain(std::iter::once(0))
                .collect()
        } else {
            caps
        }
    }

    pub fn plugin_caps(&self) -> Vec<i32> {
        self.quirk_caps(vec![PLUGIN_CAP_CONTROLLER_SERVICE])
    }

    pub fn controller_caps(&self, version: ApiVersion) -> Vec<i32> {
        let mut caps = vec![CAP_CREATE_DELETE_VOLUME, CAP_LIST_VOLUMES, CAP_GET_CAPACITY];
        if self.cfg.controller_publish {
            caps.push(CAP_PUBLISH_UNPUBLISH_VOLUME);
            if version == ApiVersion::V1 {
                caps.push(CAP_PUBLISH_READONLY);
                caps.push(CAP_LIST_VOLUMES_PUBLISHED_NODES);
            }
        }
        if self.cfg.controller_expand && version == ApiVersion::V1 {
            caps.push(expand::CAP_EXPAND_VOLUME);
        }
        if self.cfg.get_volume && version == ApiVersion::V1 {
            caps.push(CAP_GET_VOLUME);
            if self.cfg.volume_condition {
                caps.push(CAP_VOLUME_CONDITION);
            }
        }
        if self.cfg.snapshots && version == ApiVersion::V1 {
            caps.push(snapshots::CAP_CREATE_DELETE_SNAPSHOT);
            caps.push(snapshots::CAP_LIST_SNAPSHOTS);
        }
        if self.cfg.clones && version == ApiVersion::V1 {
            caps.push(snapshots::CAP_CLONE_VOLUME);
        }
        caps.retain(|c| !self.cfg.hidden_controller_caps.contains(c));
        self.quirk_caps(caps)
    }

    pub fn node_caps(&self) -> Vec<i32> {
        let mut caps = Vec::new();
        if self.cfg.stage_unstage {
            caps.push(NODE_CAP_STAGE_UNSTAGE_VOLUME);
        }
        // v1 only: the v0 adapter drops it (CSI 0.x has no NodeExpandVolume).
        if self.cfg.node_expand {
            caps.push(expand::NODE_CAP_EXPAND_VOLUME);
        }
        if self.cfg.volume_stats {
            caps.push(NODE_CAP_GET_VOLUME_STATS);
        }
        if self.cfg.volume_condition {
            caps.push(NODE_CAP_VOLUME_CONDITION);
        }
        self.quirk_caps(caps)
    }

    pub fn node_id(&self) -> &str {
        &self.cfg.node_id
    }

    /// ControllerGetVolume: the volume and the nodes it is controller-published to.
    pub fn get_volume(&self, id: &str) -> Result<ListedVolume, Status> {
        if id.is_empty() {
            return Err(invalid("volume_id is required"));
        }
        // "Volume does not exist | 5 NOT_FOUND".
        let rec = self.record(id).ok_or_else(|| Self::not_found(id))?;
        Ok(ListedVolume {
            info: VolumeInfo {
                id: id.to_owned(),
                capacity_bytes: rec.capacity_bytes,
                context: HashMap::new(),
                content_source: rec.content_source.clone(),
            },
            published_nodes: rec.controller_published.keys().cloned().collect(),
        })
    }

    // ----------------------------------------------------------------------
    // Controller
    // ----------------------------------------------------------------------

    pub async fn create_volume(&self, a: CreateArgs) -> Result<VolumeInfo, Status> {
        let mut info = self.create_volume_as_asked(a).await?;
        if let Some(id) = self.faults.answers().created_volume_id {
            info.id = id;
        }
        Ok(info)
    }

    async fn create_volume_as_asked(&self, a: CreateArgs) -> Result<VolumeInfo, Status> {
        // Spec, CreateVolumeRequest.name: "This field is REQUIRED."
        if a.name.is_empty() {
            return Err(invalid("name is required"));
        }
        validate_volume_name(&a.name).map_err(|err| invalid(err.to_string()))?;
        // "volume_capabilities ... This field is REQUIRED." and "A repeated
        // or map field listed as REQUIRED MUST contain at least 1 element."
        if a.capabilities.is_empty() {
            return Err(invalid("volume_capabilities is required"));
        }
        let caps = parse_caps(a.capabilities)?;
        // "If ANY of the specified volume capabilities are not supported by
        // the SP, the call MUST return the appropriate gRPC error code."
        if let Some(why) = caps.iter().find_map(|c| self.unsupported(c)) {
            return Err(invalid(why.to_string()));
        }
        // A volume is created for one access type and stays it (`--block`).
        let block = caps.iter().any(Capability::is_block);
        if block && caps.iter().any(|c| !c.is_block()) {
            return Err(invalid(
                "volume_capabilities mixes block and mount access: a volume is one or the other",
            ));
        }
        // CapacityRange: "The value of this field MUST NOT be negative."
        if a.required_bytes < 0 || a.limit_bytes < 0 {
            return Err(invalid("capacity_range values must not be negative"));
        }
        // "Unsupported capacity_range | 11 OUT_OF_RANGE".
        if a.limit_bytes > 0 && a.required_bytes > a.limit_bytes {
            return Err(Status::out_of_range(format!(
                "capacity_range: required_bytes {} exceeds limit_bytes {}",
                a.required_bytes, a.limit_bytes
            )));
        }
        // "Source incompatible or not supported | 3 INVALID_ARGUMENT" and
        // "Source does not exist | 5 NOT_FOUND".
        let source = match (&a.content_source, a.has_content_source) {
            (Some(src), _) => Some((src.clone(), self.content_source_dir(src)?)),
            (None, true) => {
                return Err(invalid(
                    "volume_content_source is not supported (no CREATE_DELETE_SNAPSHOT or CLONE_VOLUME)",
                ));
            }
            (None, false) => None,
        };
        // "Unsupported capacity_range | 11 OUT_OF_RANGE": smaller than the
        // data to restore.
        if let Some((ContentSource::Snapshot(id), (_, bytes))) = &source
            && a.required_bytes > 0
            && a.required_bytes < *bytes
        {
            return Err(Status::out_of_range(format!(
                "capacity_range.required_bytes {} is smaller than snapshot {id:?} ({bytes} bytes)",
                a.required_bytes
            )));
        }
        if a.has_mutable_parameters {
            return Err(invalid(
                "mutable_parameters given but MODIFY_VOLUME is not supported",
            ));
        }
        crate::topology::check_create(&self.cfg.topology, a.accessibility.as_ref())?;
        let size = if a.required_bytes > 0 {
            a.required_bytes
        } else if a.limit_bytes > 0 {
            a.limit_bytes.min(DEFAULT_VOLUME_SIZE)
        } else {
            DEFAULT_VOLUME_SIZE
        };
        let total = self.cfg.capacity;
        let volume_fs = self.cfg.volume_fs;
        let dir = self.volume_dir(&a.name);
        let backing_file = self.backing_file(&a.name);
        let (name, required, limit, parameters) =
            (a.name, a.required_bytes, a.limit_bytes, a.parameters);
        let (wanted_source, source_dir) = match source {
            Some((src, (dir, _))) => (Some(src), Some(dir)),
            None => (None, None),
        };
        let created = self
            .store
            .update(|s| {
                if let Some(v) = s.volumes.get(&name) {
                    // Spec: "If a volume corresponding to the specified volume
                    // name already exists, ... and is compatible with the
                    // specified capacity_range, volume_capabilities,
                    // parameters ..., the Plugin MUST reply 0 OK".
                    let fits = v.capacity_bytes >= required
                        && (limit == 0 || v.capacity_bytes <= limit);
                    if fits
                        && v.parameters == parameters
                        && v.block == block
                        && v.content_source == wanted_source
                    {
                        // "Operation pending for volume | 10 ABORTED".
                        if v.populating {
                            return Err(Status::aborted(format!(
                                "volume {name:?} is being filled from its content source"
                            )));
                        }
                        let info = VolumeInfo {
                            id: name.clone(),
                            capacity_bytes: v.capacity_bytes,
                            context: HashMap::new(),
                            content_source: v.content_source.clone(),
                        };
                        return Ok(((info, None), false));
                    }
                    return Err(Status::already_exists(format!(
                        "volume {name:?} exists with {} bytes, parameters {:?}, {} access and content source {:?}, incompatible with the request",
                        v.capacity_bytes,
                        v.parameters,
                        if v.block { "block" } else { "mount" },
                        v.content_source
                    )));
                }
                // A volume larger than the whole pool can never be made:
                // the capacity range is not allowed. One that only exceeds
                // what is free now may succeed after deletions.
                if size > total {
                    return Err(Status::out_of_range(format!(
                        "{size} bytes exceeds the plugin's total capacity of {total} bytes"
                    )));
                }
                let used: i64 = s.volumes.values().map(|v| v.capacity_bytes).sum();
                if used.saturating_add(size) > total {
                    return Err(Status::resource_exhausted(format!(
                        "not enough free capacity: {} of {total} bytes free, {size} requested",
                        total - used
                    )));
                }
                // A directory (or tmpfs) left by a crash before the record
                // was written is taken over.
                // A block volume's directory only marks it as existing (start-up
                // reconciliation goes by the directories); its data is the backing file.
                let fs = if block { VolumeFs::Dir } else { volume_fs };
                let make = || {
                    backing::make(&dir, fs, size)
                        .map_err(|e| internal(&format!("creating {}", dir.display()), e))?;
                    if block {
                        block::create(&backing_file, size).map_err(|e| {
                            internal(&format!("creating {}", backing_file.display()), e)
                        })?;
                    }
                    Ok::<(), Status>(())
                };
                match &self.backend {
                    // Catalogued and made under the backend's lock: another node's
                    // instance sees the volume whole or not at all.
                    Some(b) => b.with_lock(|shared| {
                        // "Operation pending for volume | 10 ABORTED": a create of the same
                        // name through another node since this call's view was taken.
                        if shared.catalogue.contains_key(&name) {
                            return Err(Status::aborted(format!(
                                "volume {name:?} was just created through another node; retry"
                            )));
                        }
                        make()?;
                        shared.catalogue.insert(
                            name.clone(),
                            CatalogueEntry {
                                capacity_bytes: size,
                                parameters: parameters.clone(),
                                content_source: wanted_source.clone(),
                            },
                        );
                        Ok(((), true))
                    })?,
                    None => make()?,
                }
                // Intent first: `populating` is durable before the copy.
                s.volumes.insert(
                    name.clone(),
                    VolumeRecord {
                        capacity_bytes: size,
                        parameters,
                        block,
                        populating: source_dir.is_some(),
                        content_source: wanted_source.clone(),
                        ..VolumeRecord::default()
                    },
                );
                let info = VolumeInfo {
                    id: name,
                    capacity_bytes: size,
                    context: HashMap::new(),
                    content_source: wanted_source,
                };
                Ok(((info, Some(source_dir)), true))
            })
            .await;
        let (info, fresh) = created?;
        if let Some(Some(from)) = fresh {
            self.populate(&info.id, from).await?;
        }
        Ok(info)
    }

    pub async fn delete_volume(&self, id: &str) -> Result<(), Status> {
        if id.is_empty() {
            return Err(invalid("volume_id is required"));
        }
        // An id that cannot name a volume directory names no volume, and the
        // spec says: "If a volume corresponding to the specified volume_id
        // does not exist ... the Plugin MUST reply 0 OK."
        if validate_volume_name(id).is_err() {
            return Ok(());
        }
        let dir = self.volume_dir(id);
        // Never delete across a mount point.
        let under = mounts::mount_points_under(&dir)
            .map_err(|e| internal("reading /proc/self/mountinfo", e))?;
        if let Some(m) = under.first() {
            return Err(precondition(format!(
                "volume {id:?} is in use: {} is mounted inside it",
                m.display()
            )));
        }
        let trash = self
            .trash_dir
            .join(format!("{id}.{}", crate::calllog::now_ns()));
        let trashed = self
            .store
            .update(|s| {
                let Some(v) = s.volumes.get(id) else {
                    return Ok((false, false));
                };
                // "Volume in use | 9 FAILED_PRECONDITION".
                if let Some(why) = v.in_use() {
                    return Err(precondition(format!("volume {id:?} is in use: {why}")));
                }
                if v.block {
                    // Detached at NodeUnstage; one left by a crash goes with the volume
                    // (only devices whose backing file is this volume's).
                    let file = self.backing_file(id);
                    block::detach_all(&file)
                        .and_then(|()| block::remove(&file))
                        .map_err(|e| internal(&format!("removing {}", file.display()), e))?;
                }
                backing::release(&dir, self.cfg.volume_fs)
                    .map_err(|e| internal(&format!("unmounting {}", dir.display()), e))?;
                // Renamed away under the lock, deleted after it: a large
                // volume does not hold up the other RPCs.
                let rename = || match std::fs::rename(&dir, &trash) {
                    Ok(()) => Ok(true),
                    Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(false),
                    Err(e) => Err(internal(&format!("removing {}", dir.display()), e)),
                };
                let moved = match &self.backend {
                    // Unless in use on another node (published or staged there since this
                    // call's view was taken): out of the catalogue and its directory away
                    // under the backend's lock, so no instance sees one without the other.
                    Some(b) => b.with_lock(|shared| {
                        if let Some(att) = shared.attachments.get(id) {
                            let nodes = if att.nodes.is_empty() { &att.staged } else { &att.nodes };
                            if !nodes.is_empty() {
                                return Err(precondition(format!(
                                    "volume {id:?} is in use: it is published to or staged on node {nodes:?}"
                                )));
                            }
                        }
                        shared.catalogue.remove(id);
                        Ok((rename()?, true))
                    })?,
                    None => rename()?,
                };
                s.volumes.remove(id);
                Ok((moved, true))
            })
            .await?;
        if trashed {
            let result = tokio::task::spawn_blocking(move || std::fs::remove_dir_all(&trash)).await;
            if let Err(e) | Ok(Err(e)) = result.map_err(io::Error::other) {
                tracing::warn!(volume = id, "deleting the volume's data: {e}");
            }
        }
        Ok(())
    }

    pub async fn controller_publish(
        &self,
        id: &str,
        node_id: &str,
        cap: CapArg,
        readonly: bool,
    ) -> Result<HashMap<String, String>, Status> {
        if !self.cfg.controller_publish {
            return Err(Status::unimplemented(
                "ControllerPublishVolume: PUBLISH_UNPUBLISH_VOLUME is disabled",
            ));
        }
        if id.is_empty() {
            return Err(invalid("volume_id is required"));
        }
        if node_id.is_empty() {
            return Err(invalid("node_id is required"));
        }
        let cap = cap?;
        let Some(rec) = self.record(id) else {
            return Err(Self::not_found(id));
        };
        // "Node does not exist | 5 NOT_FOUND": this plugin knows one node, or, with a
        // shared backend, every node that shares it.
        if node_id != self.cfg.node_id && self.backend.is_none() {
            return Err(Status::not_found(format!(
                "node {node_id:?} does not exist (this plugin's node is {:?})",
                self.cfg.node_id
            )));
        }
        if let Some(why) = self.unsupported_on(&cap, &rec) {
            return Err(invalid(why.to_string()));
        }
        let context = HashMap::from([(
            "device".to_owned(),
            self.volume_dir(id).display().to_string(),
        )]);
        // "Max volumes attached | 8 RESOURCE_EXHAUSTED | Indicates that the
        // maximum supported number of volumes that can be attached to the
        // specified node are already attached." (the limit NodeGetInfo reports).
        let max = self.cfg.max_volumes_per_node;
        if max > 0 {
            let attached: Vec<String> = self.store.read(|s| {
                s.volumes
                    .iter()
                    .filter(|(other, v)| {
                        *other != id && v.controller_published.contains_key(node_id)
                    })
                    .map(|(other, _)| other.clone())
                    .collect()
            });
            let already = self
                .record(id)
                .is_some_and(|v| v.controller_published.contains_key(node_id));
            if !already && i64::try_from(attached.len()).unwrap_or(i64::MAX) >= max {
                return Err(Status::resource_exhausted(format!(
                    "node {node_id:?} already has {} volumes attached, the most it takes (max_volumes_per_node {max}): {attached:?}",
                    attached.len()
                )));
            }
        }
        self.store
            .update_volume(id, |v| {
                let v = v.ok_or_else(|| Self::not_found(id))?;
                let wanted = ControllerPublication {
                    capability: cap,
                    readonly,
                };
                self.decide_publications(id, v, |v| match v.controller_published.get(node_id) {
                    // "If the volume ... has already been published at the
                    // node ..., and is compatible with the specified
                    // volume_capability and readonly flag, the Plugin MUST
                    // reply 0 OK."
                    Some(p) if *p == wanted => Ok((context, false)),
                    // "Volume published but is incompatible | 6 ALREADY_EXISTS"
                    Some(_) => Err(Status::already_exists(format!(
                        "volume {id:?} is already published to node {node_id:?} with another capability or readonly flag"
                    ))),
                    None => {
                        // "Volume published to another node | 9 FAILED_PRECONDITION |
                        // ... the caller SHOULD specify the node_id of the node currently
                        // holding the volume".
                        if let Some(holder) = holder_against(&v.controller_published, &wanted) {
                            return Err(precondition(format!(
                                "volume {id:?} is already published to node {holder:?}"
                            )));
                        }
                        v.controller_published.insert(node_id.to_owned(), wanted);
                        Ok((context, true))
                    }
                })
            })
            .await
    }

    pub async fn controller_unpublish(&self, id: &str, node_id: &str) -> Result<(), Status> {
        if !self.cfg.controller_publish {
            return Err(Status::unimplemented(
                "ControllerUnpublishVolume: PUBLISH_UNPUBLISH_VOLUME is disabled",
            ));
        }
        if id.is_empty() {
            return Err(invalid("volume_id is required"));
        }
        let me = self.cfg.node_id.clone();
        self.store
            .update_volume(id, |v| {
                // "If the volume corresponding to the volume_id or the node
                // corresponding to node_id cannot be found by the Plugin and
                // the volume can be safely regarded as ControllerUnpublished
                // from the node, the plugin SHOULD return 0 OK."
                let Some(v) = v else {
                    return Ok(((), false));
                };
                self.decide_publications(id, v, |v| {
                // "If the value is unset, the SP MUST unpublish the volume
                // from all nodes it is published to."
                let nodes: Vec<String> = if node_id.is_empty() {
                    v.controller_published.keys().cloned().collect()
                } else if v.controller_published.contains_key(node_id) {
                    vec![node_id.to_owned()]
                } else {
                    Vec::new()
                };
                if nodes.is_empty() {
                    return Ok(((), false));
                }
                // The spec makes the CO call this only after every
                // NodeUnpublish/NodeUnstage; detaching a volume still mounted
                // would fail on real storage, so it fails here too.
                if nodes.contains(&me) {
                    if let Some(st) = &v.staged {
                        return Err(precondition(format!(
                            "volume {id:?} is still staged at {:?} on node {me:?}; NodeUnstageVolume first",
                            st.path
                        )));
                    }
                    if let Some(t) = v.published.keys().next() {
                        return Err(precondition(format!(
                            "volume {id:?} is still published at {t:?} on node {me:?}; NodeUnpublishVolume first"
                        )));
                    }
                }
                for n in nodes {
                    v.controller_published.remove(&n);
                }
                Ok(((), true))
                })
            })
            .await
    }

    /// `Ok(Ok(caps))`: confirmed; `Ok(Err(reason))`: not supported.
    pub fn validate_capabilities(
        &self,
        id: &str,
        caps: Vec<CapArg>,
    ) -> Result<Result<Vec<Capability>, Unsupported>, Status> {
        if id.is_empty() {
            return Err(invalid("volume_id is required"));
        }
        if caps.is_empty() {
            return Err(invalid("volume_capabilities is required"));
        }
        let caps = parse_caps(caps)?;
        // "Volume does not exist | 5 NOT_FOUND".
        let Some(rec) = self.record(id) else {
            return Err(Self::not_found(id));
        };
        // "This RPC call SHALL return confirmed only if all the volume
        // capabilities specified in the request are supported."
        Ok(
            match caps.iter().find_map(|c| self.unsupported_on(c, &rec)) {
                Some(why) => Err(why),
                None => Ok(caps),
            },
        )
    }

    pub fn list_volumes(
        &self,
        max_entries: i32,
        starting_token: &str,
    ) -> Result<(Vec<ListedVolume>, String), Status> {
        let (page, next) = self.list_volumes_as_asked(max_entries, starting_token)?;
        if self.faults.answers().list_duplicates {
            let doubled = page.iter().flat_map(|v| [v.clone(), v.clone()]).collect();
            return Ok((doubled, next));
        }
        Ok((page, next))
    }

    fn list_volumes_as_asked(
        &self,
        max_entries: i32,
        starting_token: &str,
    ) -> Result<(Vec<ListedVolume>, String), Status> {
        let (after, limit) = page_bounds(max_entries, starting_token)?;
        self.store.read(|s| {
            let lower = match &after {
                Some(a) => Bound::Excluded(a.clone()),
                None => Bound::Unbounded,
            };
            let mut iter = s.volumes.range((lower, Bound::Unbounded));
            let page: Vec<ListedVolume> = iter
                .by_ref()
                .take(limit)
                .map(|(id, v)| ListedVolume {
                    info: VolumeInfo {
                        id: id.clone(),
                        capacity_bytes: v.capacity_bytes,
                        context: HashMap::new(),
                        content_source: v.content_source.clone(),
                    },
                    published_nodes: v.controller_published.keys().cloned().collect(),
                })
                .collect();
            // "If the actual number of entries is more than this number, the
            // Plugin MUST set next_token".
            let next = match (iter.next(), page.last()) {
                (Some(_), Some(last)) => encode_token(&last.info.id),
                _ => String::new(),
            };
            Ok((page, next))
        })
    }

    pub fn get_capacity(&self, caps: Vec<CapArg>) -> Result<i64, Status> {
        let caps = parse_caps(caps)?;
        // "If specified, the Plugin SHALL report the capacity of the storage
        // that can be used to provision volumes that satisfy ALL of the
        // specified volume_capabilities": none, for an unsupported one.
        if caps.iter().any(|c| self.unsupported(c).is_some()) {
            return Ok(0);
        }
        let used: i64 = self
            .store
            .read(|s| s.volumes.values().map(|v| v.capacity_bytes).sum());
        Ok((self.cfg.capacity - used).max(0))
    }

    // ----------------------------------------------------------------------
    // Node
    // ----------------------------------------------------------------------

    fn check_controller_published(&self, id: &str, rec: &VolumeRecord) -> Result<(), Status> {
        // The backend is the judge of where the volume is attached, not this instance's
        // view of it (NodePublish without staging comes here; NodeStage asks the backend).
        if let Some(b) = &self.backend {
            return b.check_attached(id, "NodePublishVolume", false);
        }
        if self.cfg.controller_publish && !rec.controller_published.contains_key(&self.cfg.node_id)
        {
            return Err(precondition(format!(
                "volume {id:?} is not controller-published to node {:?}; ControllerPublishVolume must succeed first",
                self.cfg.node_id
            )));
        }
        Ok(())
    }

    pub async fn node_stage(&self, id: &str, staging: &str, cap: CapArg) -> Result<(), Status> {
        if !self.cfg.stage_unstage {
            return Err(Status::unimplemented(
                "NodeStageVolume: STAGE_UNSTAGE_VOLUME is disabled",
            ));
        }
        if id.is_empty() {
            return Err(invalid("volume_id is required"));
        }
        if staging.is_empty() {
            return Err(invalid("staging_target_path is required"));
        }
        let cap = cap?;
        check_absolute(staging, "staging_target_path")?;
        let rec = self.record(id).ok_or_else(|| Self::not_found(id))?;
        // "Exceeds capabilities | 9 FAILED_PRECONDITION".
        if let Some(why) = self.unsupported_on(&cap, &rec) {
            return Err(precondition(why.to_string()));
        }
        if self.backend.is_none() {
            self.check_controller_published(id, &rec)?;
        }
        let staging_path = Path::new(staging);
        let dir = self.volume_dir(id);
        if let Some(st) = &rec.staged {
            if st.path != staging {
                // "The CO SHALL ensure that there is only one
                // staging_target_path per volume."
                return Err(precondition(format!(
                    "volume {id:?} is already staged at {:?}",
                    st.path
                )));
            }
            // "If the volume corresponding to the volume_id is already staged
            // to the staging_target_path, and is identical to the specified
            // volume_capability the Plugin MUST reply 0 OK."
            if st.capability != cap {
                return Err(Status::already_exists(format!(
                    "volume {id:?} is already staged at {staging:?} with another capability"
                )));
            }
            self.stage_shared(id)?;
            if rec.block {
                // Recorded but maybe not attached (killed between the two): finish.
                self.ensure_loop(id, false).await?;
                return Ok(());
            }
            // Recorded but not mounted (killed between the two): finish.
            if self.bind_mode() && !is_mount_point(staging_path)? {
                mounts::bind(&dir, staging_path, false)
                    .map_err(|e| internal(&format!("bind-mounting on {staging}"), e))?;
            }
            return Ok(());
        }
        let taken = self.store.staging_user(staging, Some(id));
        if let Some(other) = taken {
            return Err(precondition(format!(
                "staging_target_path {staging:?} is in use by volume {other:?}"
            )));
        }
        // "The CO SHALL be responsible for creating the directory if it does
        // not exist."
        match std::fs::metadata(staging_path) {
            Ok(m) if m.is_dir() => {}
            Ok(_) => {
                return Err(precondition(format!(
                    "staging_target_path {staging:?} is not a directory"
                )));
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                return Err(precondition(format!(
                    "staging_target_path {staging:?} does not exist; the CO must create it"
                )));
            }
            Err(e) => return Err(internal(&format!("checking {staging}"), e)),
        }
        if self.bind_mode() && is_mount_point(staging_path)? {
            return Err(precondition(format!(
                "staging_target_path {staging:?} is already a mount point"
            )));
        }
        let staged = Staging {
            path: staging.to_owned(),
            capability: cap,
        };
        self.stage_shared(id)?;
        let recorded = self
            .store
            .update_volume(id, |v| {
                let v = v.ok_or_else(|| Self::not_found(id))?;
                v.staged = Some(staged);
                Ok(((), true))
            })
            .await;
        if let Err(e) = recorded {
            self.unstaged_shared(id)?;
            return Err(e);
        }
        // A block volume is staged by attaching its loop device; the staging dir stays
        // empty (nothing is mounted on it).
        let staged_now = if rec.block {
            self.ensure_loop(id, false).await.map(|_| ())
        } else if self.bind_mode() {
            mounts::bind(&dir, staging_path, false)
                .map_err(|e| internal(&format!("bind-mounting on {staging}"), e))
        } else {
            Ok(())
        };
        if let Err(e) = staged_now {
            self.store
                .update_volume(id, |v| {
                    if let Some(v) = v {
                        v.staged = None;
                    }
                    Ok(((), true))
                })
                .await?;
            self.unstaged_shared(id)?;
            return Err(e);
        }
        Ok(())
    }

    /// Attaches a loop device (read-only if asked) to block volume `id`'s backing file, or
    /// finds the one attached (by the kernel's answer, not the record), and records it.
    /// Bookkeeping only in `--mount-mode none`.
    async fn ensure_loop(&self, id: &str, readonly: bool) -> Result<Option<PathBuf>, Status> {
        if !self.bind_mode() {
            return Ok(None);
        }
        let file = self.backing_file(id);
        let dev = block::attach(&file, readonly)
            .map_err(|e| internal(&format!("attaching a loop device to {}", file.display()), e))?;
        let noted = dev.clone();
        self.store
            .update_volume(id, |v| {
                let v = v.ok_or_else(|| Self::not_found(id))?;
                let changed = v.loop_device.as_deref() != Some(noted.as_str());
                v.loop_device = Some(noted);
                Ok(((), changed))
            })
            .await?;
        Ok(Some(PathBuf::from(dev)))
    }

    /// Detaches the loop devices of block volume `id` (only those whose backing file is its
    /// own) and forgets the recorded one.
    async fn release_loop(&self, id: &str) -> Result<(), Status> {
        if self.bind_mode() {
            let file = self.backing_file(id);
            block::detach_all(&file).map_err(|e| {
                internal(
                    &format!("detaching the loop device of {}", file.display()),
                    e,
                )
            })?;
        }
        self.store
            .update_volume(id, |v| {
                let changed = v.as_ref().is_some_and(|v| v.loop_device.is_some());
                if let Some(v) = v {
                    v.loop_device = None;
                }
                Ok(((), changed))
            })
            .await
    }

    /// With a backend: the backend's check that the volume is attached to this node and
    /// staged on no other (a violation otherwise), recording this node's staging (intent
    /// first: before the mount).
    fn stage_shared(&self, id: &str) -> Result<(), Status> {
        match &self.backend {
            Some(b) => b.check_attached(id, "NodeStageVolume", true),
            None => Ok(()),
        }
    }

    /// With a backend: forgets this node's staging of `id`.
    fn unstaged_shared(&self, id: &str) -> Result<(), Status> {
        match &self.backend {
            Some(b) => b.unstaged(id),
            None => Ok(()),
        }
    }

    pub async fn node_unstage(&self, id: &str, staging: &str) -> Result<(), Status> {
        if !self.cfg.stage_unstage {
            return Err(Status::unimplemented(
                "NodeUnstageVolume: STAGE_UNSTAGE_VOLUME is disabled",
            ));
        }
        if id.is_empty() {
            return Err(invalid("volume_id is required"));
        }
        if staging.is_empty() {
            return Err(invalid("staging_target_path is required"));
        }
        check_absolute(staging, "staging_target_path")?;
        // "Volume does not exist | 5 NOT_FOUND".
        let rec = self.record(id).ok_or_else(|| Self::not_found(id))?;
        // "If the volume corresponding to the volume_id is not staged to the
        // staging_target_path, the Plugin MUST reply 0 OK."
        if rec.staged.as_ref().is_none_or(|st| st.path != staging) {
            // Not staged on this node at all: so the backend says too (a staging
            // recorded there by a NodeStage killed before its local record).
            if rec.staged.is_none() {
                self.unstaged_shared(id)?;
            }
            return Ok(());
        }
        // "The CO MUST guarantee that this RPC is called after all
        // NodeUnpublishVolume have been called and returned success".
        if let Some(t) = rec.published.keys().next() {
            return Err(precondition(format!(
                "volume {id:?} is still published at {t:?}; NodeUnpublishVolume first"
            )));
        }
        if rec.block {
            self.release_loop(id).await?;
        } else if self.bind_mode() {
            mounts::unmount_all(Path::new(staging))
                .map_err(|e| internal(&format!("unmounting {staging}"), e))?;
        }
        self.store
            .update_volume(id, |v| {
                if let Some(v) = v {
                    v.staged = None;
                }
                Ok(((), true))
            })
            .await?;
        self.unstaged_shared(id)
    }

    /// Makes sure the target directory is there, per the version's rule.
    /// Returns whether this call created it.
    fn prepare_target(
        &self,
        target: &Path,
        version: ApiVersion,
        block: bool,
    ) -> Result<bool, Status> {
        if block {
            return Self::prepare_target_file(target, version);
        }
        let shown = target.display();
        let created = if version == ApiVersion::V1 {
            // CSI v1: "The CO SHALL ensure that the parent directory of this
            // path exists ... Creation of target_path is the responsibility
            // of the SP." One mkdir: the parent must exist.
            match std::fs::create_dir(target) {
                Ok(()) => true,
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => false,
                Err(e) if e.kind() == io::ErrorKind::NotFound => {
                    return Err(precondition(format!(
                        "the parent of target_path {shown} does not exist; the CO must create it"
                    )));
                }
                Err(e) => return Err(internal(&format!("creating target_path {shown}"), e)),
            }
        } else {
            // CSI 0.x: the CO creates the target; the plugin must not.
            false
        };
        match std::fs::metadata(target) {
            Ok(m) if m.is_dir() => Ok(created),
            Ok(_) => Err(precondition(format!(
                "target_path {shown} exists and is not a directory"
            ))),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Err(precondition(format!(
                "target_path {shown} does not exist; in CSI 0.x the CO must create it"
            ))),
            Err(e) => Err(internal(&format!("checking target_path {shown}"), e)),
        }
    }

    /// The block flavour of [`Plugin::prepare_target`]: the target is a file. CSI v1,
    /// NodePublishVolumeRequest.target_path: "Creation of target_path is the responsibility
    /// of the SP"; NodePublishVolume: "For volumes with an access type of block, the SP
    /// SHALL place the block device at target_path". CSI 0.x: the CO creates it.
    fn prepare_target_file(target: &Path, version: ApiVersion) -> Result<bool, Status> {
        let shown = target.display();
        let created = if version == ApiVersion::V1 {
            match block::create_target_file(target) {
                Ok(created) => created,
                Err(e) if e.kind() == io::ErrorKind::NotFound => {
                    return Err(precondition(format!(
                        "the parent of target_path {shown} does not exist; the CO must create it"
                    )));
                }
                Err(e) => return Err(internal(&format!("creating target_path {shown}"), e)),
            }
        } else {
            false
        };
        match block::target_kind(target) {
            Ok(block::TargetKind::File) => Ok(created),
            Ok(block::TargetKind::Other) => Err(precondition(format!(
                "target_path {shown} exists and is not a file: a block volume is published on a file"
            ))),
            Ok(block::TargetKind::Missing) => Err(precondition(format!(
                "target_path {shown} does not exist; in CSI 0.x the CO must create it"
            ))),
            Err(e) => Err(internal(&format!("checking target_path {shown}"), e)),
        }
    }

    pub async fn node_publish(&self, a: PublishArgs) -> Result<(), Status> {
        let id = a.volume_id.as_str();
        if id.is_empty() {
            return Err(invalid("volume_id is required"));
        }
        if a.target_path.is_empty() {
            return Err(invalid("target_path is required"));
        }
        let cap = a.capability?;
        check_absolute(&a.target_path, "target_path")?;
        if !a.staging_path.is_empty() {
            check_absolute(&a.staging_path, "staging_target_path")?;
        }
        let rec = self.record(id).ok_or_else(|| Self::not_found(id))?;
        // "Exceeds capabilities | 9 FAILED_PRECONDITION".
        if let Some(why) = self.unsupported_on(&cap, &rec) {
            return Err(precondition(why.to_string()));
        }
        let target = Path::new(&a.target_path);
        let (source, staging) = if self.cfg.stage_unstage {
            // "Staging target path not set | 9 FAILED_PRECONDITION".
            if a.staging_path.is_empty() {
                // A CO bug, not a plugin state: said on stderr as well as in the call log
                // (whose entry carries this message), so tests can fail on either.
                tracing::error!(
                    volume_id = %id,
                    "CSI violation by the CO: NodePublishVolume without staging_target_path to a plugin with STAGE_UNSTAGE_VOLUME; refused"
                );
                return Err(precondition(
                    "staging_target_path is not set but the plugin has STAGE_UNSTAGE_VOLUME",
                ));
            }
            if rec
                .staged
                .as_ref()
                .is_none_or(|st| st.path != a.staging_path)
            {
                return Err(precondition(format!(
                    "volume {id:?} is not staged at {:?}; NodeStageVolume must succeed first",
                    a.staging_path
                )));
            }
            if rec.block {
                // A block volume is staged by its loop device, found by the kernel's answer.
                let devices = self.attached_loops(id)?;
                if self.bind_mode() && devices.is_empty() {
                    return Err(precondition(format!(
                        "volume {id:?} is recorded as staged at {:?} but no loop device is attached; NodeStageVolume again",
                        a.staging_path
                    )));
                }
            } else if self.bind_mode() && !is_mount_point(Path::new(&a.staging_path))? {
                return Err(precondition(format!(
                    "volume {id:?} is recorded as staged at {:?} but nothing is mounted there; NodeStageVolume again",
                    a.staging_path
                )));
            }
            (PathBuf::from(&a.staging_path), Some(a.staging_path.clone()))
        } else {
            self.check_controller_published(id, &rec)?;
            (self.volume_dir(id), None)
        };
        let ro = a.readonly || cap.mode.is_read_only();

        if let Some(p) = rec.published.get(&a.target_path) {
            // "If the volume ... has already been published at the specified
            // target_path, and is compatible with the specified
            // volume_capability and readonly flag, the Plugin MUST reply 0 OK."
            if p.capability != cap || p.readonly != a.readonly {
                // "Volume published but is incompatible | 6 ALREADY_EXISTS".
                return Err(Status::already_exists(format!(
                    "volume {id:?} is already published at {:?} with another capability or readonly flag",
                    a.target_path
                )));
            }
            // Recorded but not (or no longer) mounted: finish the job.
            let version = if p.remove_target {
                ApiVersion::V1
            } else {
                a.version
            };
            self.prepare_target(target, version, rec.block)?;
            if self.bind_mode() && !is_mount_point(target)? {
                let source = self.publish_source(id, &rec, source, ro).await?;
                mounts::bind(&source, target, ro)
                    .map_err(|e| internal(&format!("bind-mounting on {}", a.target_path), e))?;
            }
            return Ok(());
        }
        // Second publication at another target: the spec's table says OK for
        // MULTI_NODE_... volumes and FAILED_PRECONDITION otherwise.
        if let Some((t, p)) = rec.published.iter().next()
            && !(cap.mode.is_multi_node() && p.capability.mode.is_multi_node())
        {
            return Err(precondition(format!(
                "volume {id:?} is already published at {t:?} and its access mode is not MULTI_NODE"
            )));
        }
        let taken = self.store.target_user(&a.target_path, Some(id));
        if let Some(other) = taken {
            return Err(precondition(format!(
                "target_path {:?} is in use by volume {other:?}",
                a.target_path
            )));
        }

        let created = self.prepare_target(target, a.version, rec.block)?;
        let undo_mkdir = |created: bool| {
            if created && rec.block {
                let _ = block::remove_target_file(target);
            } else if created {
                let _ = std::fs::remove_dir(target);
            }
        };
        if self.bind_mode() && is_mount_point(target)? {
            undo_mkdir(created);
            return Err(precondition(format!(
                "target_path {:?} is already a mount point",
                a.target_path
            )));
        }
        let publication = Publication {
            capability: cap,
            readonly: a.readonly,
            staging_path: staging,
            remove_target: a.version == ApiVersion::V1,
        };
        if let Err(e) = self
            .store
            .update_volume(id, |v| {
                let v = v.ok_or_else(|| Self::not_found(id))?;
                v.published.insert(a.target_path.clone(), publication);
                Ok(((), true))
            })
            .await
        {
            undo_mkdir(created);
            return Err(e);
        }
        let bound = match self.publish_source(id, &rec, source, ro).await {
            Ok(source) if self.bind_mode() => mounts::bind(&source, target, ro)
                .map_err(|e| internal(&format!("bind-mounting on {}", a.target_path), e)),
            other => other.map(|_| ()),
        };
        if let Err(e) = bound {
            undo_mkdir(created);
            self.store
                .update_volume(id, |v| {
                    if let Some(v) = v {
                        v.published.remove(&a.target_path);
                    }
                    Ok(((), true))
                })
                .await?;
            return Err(e);
        }
        Ok(())
    }

    /// The loop devices attached to block volume `id`'s backing file.
    fn attached_loops(&self, id: &str) -> Result<Vec<(String, bool)>, Status> {
        let file = self.backing_file(id);
        block::devices_backed_by(&file)
            .map_err(|e| internal(&format!("finding the loop device of {}", file.display()), e))
    }

    /// What NodePublish binds onto the target: for a mount volume `source` (the staging dir
    /// or the volume dir); for a block volume its loop device (attached here when the plugin
    /// does not stage).
    async fn publish_source(
        &self,
        id: &str,
        rec: &VolumeRecord,
        source: PathBuf,
        readonly: bool,
    ) -> Result<PathBuf, Status> {
        if !rec.block || !self.bind_mode() {
            return Ok(source);
        }
        if self.cfg.stage_unstage && self.attached_loops(id)?.is_empty() {
            return Err(precondition(format!(
                "volume {id:?} has no loop device attached; NodeStageVolume again"
            )));
        }
        // Staged: the device NodeStage attached (or, read-only, one of its own). Not
        // staged: attached here, for as long as a publication lasts.
        Ok(self.ensure_loop(id, readonly).await?.unwrap_or(source))
    }

    pub async fn node_unpublish(
        &self,
        id: &str,
        target: &str,
        version: ApiVersion,
    ) -> Result<(), Status> {
        if id.is_empty() {
            return Err(invalid("volume_id is required"));
        }
        if target.is_empty() {
            return Err(invalid("target_path is required"));
        }
        check_absolute(target, "target_path")?;
        // "Volume does not exist | 5 NOT_FOUND".
        let rec = self.record(id).ok_or_else(|| Self::not_found(id))?;
        let target_path = Path::new(target);
        let Some(p) = rec.published.get(target) else {
            // Not published there: nothing to undo, "0 OK" (idempotent). For
            // CSI v1 a leftover empty target no volume claims (e.g. a crash
            // between unmount and rmdir) is removed, as the SP owns it.
            let leftover = if rec.block {
                block::target_kind(target_path).is_ok_and(|k| k == block::TargetKind::File)
            } else {
                target_path.is_dir()
            };
            if version == ApiVersion::V1 && leftover {
                let claimed = self.store.target_user(target, None).is_some();
                let mounted = self.bind_mode() && is_mount_point(target_path)?;
                if !claimed && !mounted {
                    // Best effort: a non-empty directory (or file) is not ours to judge.
                    if rec.block {
                        let _ = block::remove_target_file(target_path);
                    } else {
                        let _ = std::fs::remove_dir(target_path);
                    }
                }
            }
            return Ok(());
        };
        if self.bind_mode() {
            mounts::unmount_all(target_path)
                .map_err(|e| internal(&format!("unmounting {target}"), e))?;
        }
        // CSI v1, NodeUnpublishVolumeRequest.target_path: "The SP MUST delete
        // the file or directory it created at this path." CSI 0.x: the CO
        // owns the target and it stays.
        if p.remove_target && rec.block {
            block::remove_target_file(target_path).map_err(|e| {
                internal(
                    &format!("removing target_path {}", target_path.display()),
                    e,
                )
            })?;
        } else if p.remove_target {
            remove_target_dir(target_path)?;
        }
        self.store
            .update_volume(id, |v| {
                if let Some(v) = v {
                    v.published.remove(target);
                }
                Ok(((), true))
            })
            .await?;
        // Without staging, the loop device lives as long as a publication does.
        let last = self.record(id).is_some_and(|v| v.published.is_empty());
        if rec.block && !self.cfg.stage_unstage && last {
            self.release_loop(id).await?;
        }
        Ok(())
    }
}

/// The shared backend's catalogue and controller publications, taken into this instance's
/// state; true when anything changed.
fn take_backend(s: &mut StateFile, b: &Backend) -> Result<bool, Status> {
    b.with_lock(|shared| {
        let mut changed = false;
        let before = s.volumes.len();
        s.volumes.retain(|id, _| shared.catalogue.contains_key(id));
        changed |= s.volumes.len() != before;
        for (id, entry) in &shared.catalogue {
            let v = s.volumes.entry(id.clone()).or_default();
            let publications = shared
                .attachments
                .get(id)
                .map(|a| a.publications.clone())
                .unwrap_or_default();
            if v.capacity_bytes != entry.capacity_bytes
                || v.parameters != entry.parameters
                || v.content_source != entry.content_source
                || v.controller_published != publications
            {
                v.capacity_bytes = entry.capacity_bytes;
                v.parameters.clone_from(&entry.parameters);
                v.content_source.clone_from(&entry.content_source);
                v.controller_published = publications;
                changed = true;
            }
        }
        Ok((changed, false))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_round_trip_and_reject_garbage() {
        for id in ["a", "sanity-123", "ünï", &"z".repeat(128)] {
            assert_eq!(decode_token(&encode_token(id)).as_deref(), Some(id));
        }
        for bad in ["invalid-token", "after:", "after:0", "after:zz", "after:ff"] {
            assert_eq!(decode_token(bad), None, "{bad}");
        }
    }
}
