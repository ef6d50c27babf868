//! Request and response bodies. Field names are the wire contract: renaming one is a
//! breaking change of the API.

use std::collections::BTreeMap;
use std::fmt;

use serde::{Deserialize, Serialize};

mod expand;
pub use expand::*;
mod stats;
pub use stats::{UsageFigures, VolumeCondition, VolumeStats};
mod topology;
pub use topology::{
    AccessibilityRequirements, ControllerVolumeStatus, PluginNodeInfo, TopologySegments,
};
mod snapshot;
pub use snapshot::*;
mod cluster;
pub use cluster::*;

/// The one error shape of every failed request.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorBody {
    /// Stable machine-readable kind (see [`ErrorCode`]).
    pub code: ErrorCode,
    /// What went wrong and what to do about it.
    pub message: String,
    /// The plugin's gRPC code (`NOT_FOUND`, …) when the error came from the plugin.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub grpc_code: Option<String>,
}

/// Kinds of errors, each with one HTTP status ([`ErrorCode::http_status`]); `invalid_request`
/// also comes with the statuses of the HTTP layer's refusals ([`ErrorCode::other_statuses`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorCode {
    /// 400: malformed JSON, missing or invalid fields.
    InvalidRequest,
    /// 401: missing or wrong bearer token (TCP listener).
    Unauthorized,
    /// 404: unknown plugin, volume or route.
    NotFound,
    /// 409: the request contradicts the volume's current use.
    Conflict,
    /// 422: the plugin answered with a final error (see `grpc_code`).
    PluginError,
    /// 502: the plugin broke the CSI specification.
    PluginProtocol,
    /// 501: the plugin does not advertise the CSI capability the request needs (e.g.
    /// GET_VOLUME_STATS); nothing was sent to it.
    Unsupported,
    /// 503: the plugin is unavailable or kept failing transiently; retry later.
    Unavailable,
    /// 500: csi-agent could not do its own part (disk, mounts).
    Internal,
}

impl ErrorCode {
    /// Every kind, for documentation and tests (`openapi.yaml` must list each one).
    pub const ALL: [ErrorCode; 9] = [
        ErrorCode::InvalidRequest,
        ErrorCode::Unauthorized,
        ErrorCode::NotFound,
        ErrorCode::Conflict,
        ErrorCode::PluginError,
        ErrorCode::PluginProtocol,
        ErrorCode::Unsupported,
        ErrorCode::Unavailable,
        ErrorCode::Internal,
    ];

    pub fn http_status(self) -> u16 {
        match self {
            ErrorCode::InvalidRequest => 400,
            ErrorCode::Unauthorized => 401,
            ErrorCode::NotFound => 404,
            ErrorCode::Conflict => 409,
            ErrorCode::PluginError => 422,
            ErrorCode::PluginProtocol => 502,
            ErrorCode::Unsupported => 501,
            ErrorCode::Unavailable => 503,
            ErrorCode::Internal => 500,
        }
    }

    /// The statuses other than [`Self::http_status`] this code comes with. Only
    /// `invalid_request` has any: a request refused at the HTTP level, before a route sees it,
    /// gets that level's status: method not allowed 405, body too slow 408, body too large 413,
    /// body not JSON 415, head too large 431.
    pub fn other_statuses(self) -> &'static [u16] {
        match self {
            ErrorCode::InvalidRequest => &[405, 408, 413, 415, 431],
            _ => &[],
        }
    }
}

impl fmt::Display for ErrorBody {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.grpc_code {
            // Said once: a message that already names the code (`NodeStageVolume failed:
            // NOT_FOUND: ...`) is not followed by it again.
            Some(grpc) if self.message.contains(grpc.as_str()) => f.write_str(&self.message),
            Some(grpc) => write!(f, "{} (plugin said {grpc})", self.message),
            None => f.write_str(&self.message),
        }
    }
}

/// `GET /v1/health`
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Health {
    /// Always `"ok"` when the daemon answers.
    pub status: String,
    /// True once the start gate is open (`POST /v1/start`, or `--start immediate`).
    pub started: bool,
    pub version: String,
}

/// `POST /v1/start`
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct StartResponse {
    pub started: bool,
    /// False when the gate was already open (start is idempotent).
    pub opened_now: bool,
}

/// `{"mount": {"fs_type": "", "mount_flags": []}, "access_mode": "SINGLE_NODE_WRITER"}` or
/// `{"block": {}, "access_mode": …}`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CapabilitySpec {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mount: Option<MountSpec>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub block: Option<BlockSpec>,
    /// A CSI access mode name: `SINGLE_NODE_WRITER`, `SINGLE_NODE_READER_ONLY`,
    /// `MULTI_NODE_READER_ONLY`, `MULTI_NODE_SINGLE_WRITER`, `MULTI_NODE_MULTI_WRITER`,
    /// `SINGLE_NODE_SINGLE_WRITER`, `SINGLE_NODE_MULTI_WRITER`.
    pub access_mode: String,
}

impl CapabilitySpec {
    /// The CSI access mode names `access_mode` accepts (CSI v1; v0 has the first five).
    pub const ACCESS_MODES: &'static [&'static str] = &[
        "SINGLE_NODE_WRITER",
        "SINGLE_NODE_READER_ONLY",
        "MULTI_NODE_READER_ONLY",
        "MULTI_NODE_SINGLE_WRITER",
        "MULTI_NODE_MULTI_WRITER",
        "SINGLE_NODE_SINGLE_WRITER",
        "SINGLE_NODE_MULTI_WRITER",
    ];

    /// A filesystem capability.
    pub fn mount(access_mode: &str, fs_type: &str, mount_flags: Vec<String>) -> CapabilitySpec {
        CapabilitySpec {
            mount: Some(MountSpec {
                fs_type: fs_type.to_owned(),
                mount_flags,
            }),
            block: None,
            access_mode: access_mode.to_owned(),
        }
    }

    /// A raw block device capability.
    pub fn block(access_mode: &str) -> CapabilitySpec {
        CapabilitySpec {
            mount: None,
            block: Some(BlockSpec {}),
            access_mode: access_mode.to_owned(),
        }
    }
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MountSpec {
    #[serde(default)]
    pub fs_type: String,
    #[serde(default)]
    pub mount_flags: Vec<String>,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BlockSpec {}

/// Secrets for the node RPCs. Never echoed back.
#[derive(Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SecretsSpec {
    #[serde(default)]
    pub node_stage: BTreeMap<String, String>,
    #[serde(default)]
    pub node_publish: BTreeMap<String, String>,
}

impl fmt::Debug for SecretsSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SecretsSpec")
            .field(
                "node_stage",
                &format_args!("<redacted {} entries>", self.node_stage.len()),
            )
            .field(
                "node_publish",
                &format_args!("<redacted {} entries>", self.node_publish.len()),
            )
            .finish()
    }
}

/// `POST /v1/volumes/publish`
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PublishRequest {
    pub plugin: String,
    pub volume_id: String,
    /// The consumer (usually a container id); `"default"` when absent.
    #[serde(default = "default_workload")]
    pub workload: String,
    pub capability: CapabilitySpec,
    #[serde(default)]
    pub readonly: bool,
    /// Absent: the context returned when the volume was created through csi-agent (if any).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub volume_context: Option<BTreeMap<String, String>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub secrets: Option<SecretsSpec>,
    /// An absolute path where csi-agent bind-mounts the target for the workload.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bind_to: Option<String>,
}

pub fn default_workload() -> String {
    "default".to_owned()
}

/// Answer to a publish.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PublishResponse {
    /// Absolute host path of the published volume.
    pub target_path: String,
    /// The same path relative to the daemon's work dir.
    pub target_path_relative: String,
    pub state: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bind_to: Option<String>,
}

/// `POST /v1/volumes/unpublish`
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UnpublishRequest {
    pub plugin: String,
    pub volume_id: String,
    #[serde(default = "default_workload")]
    pub workload: String,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct UnpublishResponse {
    /// The volume's state afterwards (`UNPUBLISHED` when csi-agent no longer tracks it; a pre-provisioned volume is forgotten once unpublished).
    pub state: String,
    /// False when the workload held no claim on the volume (or csi-agent does not track the
    /// volume): nothing was changed. Unpublish is idempotent, so this is not an error.
    #[serde(default = "yes")]
    pub was_claimed: bool,
}

fn yes() -> bool {
    true
}

/// One volume as csi-agent tracks it (`GET /v1/volumes`, `GET /v1/volumes/{plugin}/{id}`).
/// Secrets are never included; `has_secrets` says whether some are stored.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct VolumeInfo {
    pub plugin: String,
    pub volume_id: String,
    pub state: String,
    pub claims: Vec<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub capability: Option<CapabilitySpec>,
    pub readonly: bool,
    pub volume_context: BTreeMap<String, String>,
    pub target_path: String,
    pub target_path_relative: String,
    /// `created` (through csi-agent) or `pre_provisioned`.
    pub origin: String,
    pub has_secrets: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_error: Option<String>,
    /// The operation in progress on the volume (a request's, or a background reconciler
    /// waiting to retry); absent when none runs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub operation: Option<OperationInfo>,
    /// The volume's capacity in bytes as the plugin last reported it (at creation or
    /// expansion); absent when unknown.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub capacity_bytes: Option<i64>,
    /// An expansion in progress; absent when none is.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expansion: Option<ExpansionInfo>,
    /// The volume's condition from the latest stats of a published volume whose plugin
    /// advertises VOLUME_CONDITION; absent otherwise.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub condition: Option<VolumeCondition>,
    /// Where the volume is accessible from, as CreateVolume reported; absent when unknown.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub accessible_topology: Vec<TopologySegments>,
    /// ControllerGetVolume's answer, for plugins that advertise GET_VOLUME.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub controller: Option<ControllerVolumeStatus>,
}

/// What a volume's operation in progress is doing.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct OperationInfo {
    /// `publish`, `unpublish` or `reconcile`.
    pub operation: String,
    /// The lifecycle step being tried (`node_stage`, `node_publish`, …), once one started.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub step: Option<String>,
    /// Attempts so far (of the step, or of the reconciler's whole drive).
    pub attempt: u32,
    /// The last transient error, while retrying.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_error: Option<String>,
    /// When the next attempt is due, in milliseconds since the Unix epoch, while waiting.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub next_retry_at_unix_ms: Option<u64>,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct VolumeList {
    pub volumes: Vec<VolumeInfo>,
    /// Present when more volumes follow: pass it as `page_token` to get the next page.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub next_page_token: Option<String>,
    /// True while the daemon is still starting (the start gate closed, or plugins still
    /// recovering their volumes): the list holds what is known so far.
    #[serde(default)]
    pub recovering: bool,
}

/// The query of `GET /v1/volumes`: filters and paging, all optional.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VolumeQuery {
    /// Only this plugin's volumes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub plugin: Option<String>,
    /// Only volumes in this state (`PUBLISHED`, `NODE_STAGE`, ...).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub state: Option<String>,
    /// Only volumes this workload claims.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub workload: Option<String>,
    /// At most this many volumes (1 to 10,000; default: all).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limit: Option<usize>,
    /// The `next_page_token` of the previous page.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub page_token: Option<String>,
}

/// One component (process or container) of a managed plugin.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ComponentInfo {
    pub id: String,
    pub services: Vec<String>,
    pub ready: bool,
    /// The process (a container's init, in the host's PID namespace).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pid: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub endpoint: Option<String>,
    pub restarts: u64,
    /// Why the last launch or run failed, while the component is restarting.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// A plugin (`GET /v1/plugins`, `GET /v1/plugins/{type}`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PluginInfo {
    #[serde(rename = "type")]
    pub plugin_type: String,
    pub name: String,
    pub managed: bool,
    /// `not_started` (gate closed, or start-up still initializing the plugin), `idle`
    /// (launched lazily, not needed yet; also a plugin added by a reload after start-up,
    /// until its first use), `starting`, `ready`, `restarting` (a component is backing off after crashes), `failed` (bad config
    /// or probe; see `error`).
    pub state: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub csi_version: Option<String>,
    pub config_file: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    pub components: Vec<ComponentInfo>,
    pub volumes: usize,
    /// The pulls in flight of the images this plugin's components run (while it waits for
    /// them); absent when none.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub image_pulls: Vec<ImagePullProgress>,
    /// What the plugin's NodeGetInfo answered (node id, topology, volume limit); absent until
    /// the plugin was asked.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node: Option<PluginNodeInfo>,
}

/// A configuration file that failed to load.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ConfigErrorInfo {
    pub file: String,
    pub message: String,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PluginList {
    pub plugins: Vec<PluginInfo>,
    pub config_errors: Vec<ConfigErrorInfo>,
}

/// `POST /v1/plugins/reload`
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReloadReport {
    pub added: Vec<String>,
    pub changed: Vec<String>,
    pub removed: Vec<String>,
    pub config_errors: Vec<ConfigErrorInfo>,
}

/// `POST /v1/drain` (optional body): how long the drain waits.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DrainRequest {
    /// How long to wait for the operations in flight, and then again for the drain's own
    /// unpublishes (default 60). Absent means the default; `null` is refused (the schema
    /// says integer, and a client that sends null meant something).
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "present_not_null"
    )]
    pub timeout_secs: Option<u64>,
}

/// An optional field that, when present, must hold a value: `null` is an error.
fn present_not_null<'de, D, T>(deserializer: D) -> Result<Option<T>, D::Error>
where
    D: serde::Deserializer<'de>,
    T: Deserialize<'de>,
{
    T::deserialize(deserializer).map(Some)
}

/// `POST /v1/drain`: what the drain did. The node publishes nothing and starts no plugin
/// afterwards, until csi-agentd is restarted.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DrainReport {
    /// True only when the mount table shows nothing of csi-agent's (beneath the plugins'
    /// mount dirs, at the workloads' `bind_to`), every record is at rest, no operation runs
    /// and `failed` is empty.
    #[serde(default)]
    pub complete: bool,
    /// Every claim released (unpublished through the usual durable steps).
    pub released: Vec<ClaimRef>,
    /// What could not be released or stopped; those plugins keep running.
    pub failed: Vec<DrainFailure>,
    /// The plugin types whose components were stopped.
    pub stopped_plugins: Vec<String>,
    /// What is still on the node, with why; a later drain goes on from there.
    #[serde(default)]
    pub left: Vec<DrainLeft>,
}

/// One thing a drain could not take away: a mount (with `path`), a record not at rest or an
/// operation still in flight.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DrainLeft {
    pub plugin: String,
    /// Empty when it is not about one volume.
    pub volume_id: String,
    /// The mount point still mounted, if it is a mount.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path: Option<String>,
    pub reason: String,
}

/// One workload's claim on one volume.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClaimRef {
    pub plugin: String,
    pub volume_id: String,
    pub workload: String,
}

/// A claim (or, with empty `volume_id` and `workload`, a plugin) the drain could not finish.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DrainFailure {
    pub plugin: String,
    pub volume_id: String,
    pub workload: String,
    pub error: String,
}

/// One image of the daemon's image store (`GET /v1/images`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ImageInfo {
    /// The resolved reference (`registry/repository:tag` or `@sha256:…`).
    pub reference: String,
    /// The platform manifest's digest: the image's identity.
    pub manifest: String,
    pub config: String,
    /// Layer digests, in order.
    pub layers: Vec<String>,
    /// Config and layers as the manifest declares them (compressed bytes).
    pub size: u64,
    pub pulled_at_unix: u64,
    /// The types of the configured plugins that name this image.
    pub used_by: Vec<String>,
}

/// `GET /v1/images`
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ImageList {
    pub images: Vec<ImageInfo>,
    /// The bytes of every blob in the image store: the images as downloaded (compressed),
    /// shared layers counted once. Unpacked layers and roots are not counted. 0 from a daemon
    /// older than this field.
    #[serde(default)]
    pub blob_bytes: u64,
    /// The image store's size on disk: blobs, unpacked layers and root file systems, in
    /// allocated blocks as `du` counts — the measure its quota is checked against before an
    /// image is prepared. 0 from a daemon older than this field.
    #[serde(default)]
    pub store_bytes: u64,
    /// The store's quota (`--image-store-max-bytes`): an image is refused while
    /// `store_bytes` is at it, and its preparation may write only the room left. 0 from a
    /// daemon older than this field (the daemon always has a quota).
    #[serde(default)]
    pub store_max_bytes: u64,
}

/// A pull in flight: bytes stored of each blob, out of the manifest's sizes.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ImagePullProgress {
    /// The resolved reference being pulled.
    pub reference: String,
    pub started_at_unix_ms: u64,
    /// Sums over `blobs`.
    pub bytes_done: u64,
    pub bytes_total: u64,
    /// Config and layers, in the manifest's order; a blob already in the store counts as
    /// done. Empty until the manifest has been read.
    pub blobs: Vec<BlobPullProgress>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct BlobPullProgress {
    pub digest: String,
    pub bytes_done: u64,
    pub bytes_total: u64,
}

/// `GET /v1/images/pulls`
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ImagePullList {
    pub pulls: Vec<ImagePullProgress>,
}

/// `POST /v1/images/pull`
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ImagePullRequest {
    /// An image name as a plugin config gives it (`busybox`, `host:5000/org/app:1`).
    pub reference: String,
}

/// `POST /v1/images/prune`: what was removed.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ImagePruneResponse {
    /// The references no configured plugin named, now gone from the index.
    pub removed: Vec<String>,
    /// Flattened root file systems removed (a store without overlayfs).
    pub rootfs_removed: usize,
    /// Unpacked layer directories removed (a store with overlayfs).
    pub layers_removed: usize,
    /// Blobs removed (those still named by a kept image stay).
    pub blobs_removed: usize,
}

/// `POST /v1/images/pull`
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ImagePullResponse {
    pub reference: String,
    pub manifest: String,
    pub size: u64,
    /// The blobs this pull downloaded (empty when the store had them all).
    pub downloaded: Vec<String>,
}

/// `POST /v1/images/import` (the body is the archive, `Content-Type: application/x-tar`):
/// the images indexed, as `GET /v1/images` lists them.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ImageImportResponse {
    pub images: Vec<ImageInfo>,
}

/// `POST /v1/volumes` (CreateVolume)
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CreateVolumeRequest {
    pub plugin: String,
    pub name: String,
    #[serde(default)]
    pub capacity_bytes: i64,
    pub capability: CapabilitySpec,
    #[serde(default)]
    pub parameters: BTreeMap<String, String>,
    /// Where the volume must be accessible from. Default, for a plugin with topology: this
    /// node's topology as the only requisite and preferred one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub accessibility_requirements: Option<AccessibilityRequirements>,
    /// Restore a snapshot or clone a volume (`volume_content_source`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub content_source: Option<ContentSource>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CreateVolumeResponse {
    pub volume_id: String,
    pub capacity_bytes: i64,
    pub volume_context: BTreeMap<String, String>,
    /// Where the plugin says the volume is accessible from; absent when it said nothing.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub accessible_topology: Vec<TopologySegments>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeleteVolumeResponse {
    pub deleted: bool,
}

/// `POST /v1/volumes/validate` (ValidateVolumeCapabilities)
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ValidateRequest {
    pub plugin: String,
    pub volume_id: String,
    pub capabilities: Vec<CapabilitySpec>,
    #[serde(default)]
    pub volume_context: BTreeMap<String, String>,
    #[serde(default)]
    pub parameters: BTreeMap<String, String>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ValidateResponse {
    pub confirmed: bool,
    pub message: String,
}

/// `GET /v1/plugins/{type}/backend-volumes` (ListVolumes, one page)
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct BackendVolume {
    pub volume_id: String,
    pub capacity_bytes: i64,
    pub volume_context: BTreeMap<String, String>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct BackendVolumePage {
    pub volumes: Vec<BackendVolume>,
    /// Empty when this is the last page.
    pub next_token: String,
}

/// `POST /v1/capacity` (GetCapacity)
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CapacityRequest {
    pub plugin: String,
    #[serde(default)]
    pub capabilities: Vec<CapabilitySpec>,
    #[serde(default)]
    pub parameters: BTreeMap<String, String>,
    /// Only the capacity usable in this topology (GetCapacity's `accessible_topology`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub accessible_topology: Option<TopologySegments>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CapacityResponse {
    pub available_capacity: i64,
}
