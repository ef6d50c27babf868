//! Keeps `openapi.yaml` and the Rust contract in step: the routes it describes are exactly
//! `routes::ALL_ROUTES`, each schema's properties are exactly the serde field names of its Rust
//! type, its `required` lists are what serde really requires (requests) or always sends
//! (responses), and its error responses carry the statuses of `ErrorCode::http_status` (or
//! `ErrorCode::other_statuses`).
//!
//! Samples are built with every optional field set, so that serializing one shows every key.

use std::collections::{BTreeMap, BTreeSet};

use anyhow::{Context, Result, anyhow, bail, ensure};
use csi_agent_api::routes::{self, ALL_ROUTES};
use csi_agent_api::*;
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::{Value, json};

const HTTP_METHODS: &[&str] = &["get", "put", "post", "delete", "patch", "head", "options"];

fn spec() -> Result<Value> {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/openapi.yaml");
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {path}"))?;
    serde_norway::from_str(&text).with_context(|| format!("parsing {path}"))
}

fn object<'a>(value: &'a Value, what: &str) -> Result<&'a serde_json::Map<String, Value>> {
    value
        .as_object()
        .ok_or_else(|| anyhow!("{what} is not a mapping"))
}

fn keys(value: &Value, what: &str) -> Result<BTreeSet<String>> {
    Ok(object(value, what)?.keys().cloned().collect())
}

/// `#/components/schemas/X` → `X`.
fn schema_ref(value: &Value) -> Option<&str> {
    value
        .get("$ref")?
        .as_str()?
        .strip_prefix("#/components/schemas/")
}

fn map(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect()
}

fn mount_cap() -> CapabilitySpec {
    CapabilitySpec::mount("SINGLE_NODE_WRITER", "ext4", vec!["noatime".to_owned()])
}

/// Both `mount` and `block` set: not a valid request, but it shows every key.
fn full_cap() -> CapabilitySpec {
    CapabilitySpec {
        block: Some(BlockSpec {}),
        ..mount_cap()
    }
}

fn volume_info(full: bool) -> VolumeInfo {
    VolumeInfo {
        plugin: "org.example.lvm".to_owned(),
        volume_id: "v1".to_owned(),
        state: "PUBLISHED".to_owned(),
        claims: vec!["c1".to_owned()],
        capability: full.then(full_cap),
        readonly: false,
        volume_context: map(&[("k", "v")]),
        target_path: "/w/csi/org.example.lvm/default/mounts/v1/target".to_owned(),
        target_path_relative: "csi/org.example.lvm/default/mounts/v1/target".to_owned(),
        origin: "created".to_owned(),
        has_secrets: true,
        last_error: full.then(|| "boom".to_owned()),
        operation: full.then(|| operation_info(true)),
        capacity_bytes: full.then_some(1 << 30),
        expansion: full.then(|| ExpansionInfo {
            capacity_bytes: 2 << 30,
            next_step: "node".to_owned(),
        }),
        condition: full.then(|| csi_agent_api::VolumeCondition {
            abnormal: true,
            message: "disk on fire".to_owned(),
        }),
        accessible_topology: if full {
            vec![map(&[("zone", "a")])]
        } else {
            vec![]
        },
        controller: full.then(|| ControllerVolumeStatus {
            published_node_ids: vec!["node-1".to_owned()],
            condition: Some(VolumeCondition {
                abnormal: true,
                message: "disk on fire".to_owned(),
            }),
            error: Some("ControllerGetVolume did not answer within 2s".to_owned()),
        }),
    }
}

fn operation_info(full: bool) -> OperationInfo {
    OperationInfo {
        operation: "publish".to_owned(),
        step: full.then(|| "node_stage".to_owned()),
        attempt: 3,
        last_error: full.then(|| "NodeStageVolume failed: UNAVAILABLE: busy".to_owned()),
        next_retry_at_unix_ms: full.then_some(1_800_000_000_000),
    }
}

fn component(full: bool) -> ComponentInfo {
    ComponentInfo {
        id: "csi-org-example-lvm-default--CONTROLLER_SERVICE-NODE_SERVICE".to_owned(),
        services: vec!["CONTROLLER_SERVICE".to_owned()],
        ready: true,
        pid: full.then_some(42),
        endpoint: full.then(|| "unix:///run/x.sock".to_owned()),
        restarts: 0,
        error: full.then(|| "launch failed".to_owned()),
    }
}

fn plugin_info(full: bool) -> PluginInfo {
    PluginInfo {
        plugin_type: "org.example.lvm".to_owned(),
        name: "default".to_owned(),
        managed: true,
        state: "ready".to_owned(),
        csi_version: full.then(|| "1.x".to_owned()),
        config_file: "/etc/csi/lvm.json".to_owned(),
        error: full.then(|| "boom".to_owned()),
        components: vec![component(full)],
        volumes: 1,
        image_pulls: if full { vec![pull_progress()] } else { vec![] },
        node: full.then(|| PluginNodeInfo {
            node_id: "node-1".to_owned(),
            accessible_topology: Some(map(&[("zone", "a")])),
            max_volumes_per_node: Some(2),
        }),
    }
}

fn pull_progress() -> ImagePullProgress {
    ImagePullProgress {
        reference: "r/a:1".to_owned(),
        started_at_unix_ms: 1,
        bytes_done: 3,
        bytes_total: 7,
        blobs: vec![BlobPullProgress {
            digest: "sha256:l".to_owned(),
            bytes_done: 3,
            bytes_total: 7,
        }],
    }
}

fn config_error() -> ConfigErrorInfo {
    ConfigErrorInfo {
        file: "bad.json".to_owned(),
        message: "no type".to_owned(),
    }
}

fn backend_volume() -> BackendVolume {
    BackendVolume {
        volume_id: "v1".to_owned(),
        capacity_bytes: 1,
        volume_context: map(&[("k", "v")]),
    }
}

fn cluster_member() -> ClusterMember {
    ClusterMember {
        node: "n1".to_owned(),
        instance_id: "i1".to_owned(),
        version: "0.1.0".to_owned(),
        started_at_unix: 1,
        plugins: vec!["org.example.nfs/default".to_owned()],
        csi_nodes: vec![cluster_csi_node()],
    }
}

fn cluster_csi_node() -> ClusterCsiNode {
    ClusterCsiNode {
        plugin: "org.example.nfs/default".to_owned(),
        node_id: "node-1".to_owned(),
        topology: [("zone".to_owned(), "a".to_owned())].into(),
    }
}

fn cluster_status(full: bool) -> ClusterStatus {
    ClusterStatus {
        name: "c".to_owned(),
        node: "n1".to_owned(),
        instance_id: "i1".to_owned(),
        state: "HEALTHY".to_owned(),
        lease_id: 7,
        lease_ttl_secs: 10,
        lease_valid_for_ms: 9000,
        since_unix: 1,
        reason: full.then(|| "joined".to_owned()),
        etcd_cluster_id: full.then(|| "cdf818194e3a8c32".to_owned()),
        members: vec![cluster_member()],
        fenced: vec!["n3".to_owned()],
        released_after_fence: vec![],
        lease_losses: 0,
        leaders: vec![cluster_leader()],
    }
}

fn cluster_leader() -> ClusterLeader {
    ClusterLeader {
        plugin: "org.example.nfs".to_owned(),
        plugin_name: "default".to_owned(),
        node: "n1".to_owned(),
        revision: 3,
        this_node: true,
    }
}

fn cluster_claim() -> ClusterClaim {
    ClusterClaim {
        plugin: "org.example.nfs".to_owned(),
        plugin_name: "default".to_owned(),
        volume_id: "v1".to_owned(),
        access_mode: "SINGLE_NODE_WRITER".to_owned(),
        node: "n1".to_owned(),
        state: "ATTACHED".to_owned(),
        suspect: true,
        readonly: false,
        csi_node_id: "node-1".to_owned(),
        workloads: vec!["w".to_owned()],
        since_unix: 1,
    }
}

fn damaged_key() -> DamagedKey {
    DamagedKey {
        key: "/c/volumes/x".to_owned(),
        problem: "not JSON".to_owned(),
    }
}

/// How a schema's `required` list is checked.
enum Kind {
    /// Sent by clients: `required` must be exactly the fields serde cannot do without.
    Request(fn(Value) -> bool),
    /// Sent by the daemon: `required` must be exactly the keys a minimal value still sends.
    Response(Value),
}

struct Case {
    schema: &'static str,
    /// Serialized with every optional field set.
    full: Value,
    kind: Kind,
}

fn snapshot_info(full: bool) -> SnapshotInfo {
    SnapshotInfo {
        snapshot_id: "s".to_owned(),
        source_volume_id: "v".to_owned(),
        size_bytes: 1,
        creation_time: full.then(|| "2026-12-06T08:17:31Z".to_owned()),
        ready_to_use: true,
    }
}

fn parses<T: DeserializeOwned>(value: Value) -> bool {
    serde_json::from_value::<T>(value).is_ok()
}

fn to_json(value: impl Serialize) -> Result<Value> {
    Ok(serde_json::to_value(value)?)
}

fn request<T: Serialize + DeserializeOwned>(schema: &'static str, full: T) -> Result<Case> {
    Ok(Case {
        schema,
        full: to_json(full)?,
        kind: Kind::Request(parses::<T>),
    })
}

fn response<T: Serialize>(schema: &'static str, full: T, minimal: T) -> Result<Case> {
    Ok(Case {
        schema,
        full: to_json(full)?,
        kind: Kind::Response(to_json(minimal)?),
    })
}

fn cases() -> Result<Vec<Case>> {
    let secrets = SecretsSpec {
        node_stage: map(&[("a", "b")]),
        node_publish: map(&[("c", "d")]),
    };
    let error = |grpc: Option<&str>| ErrorBody {
        code: ErrorCode::PluginError,
        message: "m".to_owned(),
        grpc_code: grpc.map(str::to_owned),
    };
    let health = Health {
        status: "ok".to_owned(),
        started: true,
        version: "0.1.0".to_owned(),
    };
    let start = StartResponse {
        started: true,
        opened_now: true,
    };
    let published = |bind: bool| PublishResponse {
        target_path: "/w/t".to_owned(),
        target_path_relative: "t".to_owned(),
        state: "PUBLISHED".to_owned(),
        bind_to: bind.then(|| "/b".to_owned()),
    };
    let unpublished = UnpublishResponse {
        state: "CREATED".to_owned(),
        was_claimed: true,
    };
    let volumes = VolumeList {
        volumes: vec![volume_info(true)],
        next_page_token: Some("org-example.vol%2F1".to_owned()),
        recovering: true,
    };
    let plugins = PluginList {
        plugins: vec![plugin_info(true)],
        config_errors: vec![config_error()],
    };
    let reload = ReloadReport {
        added: vec!["a".to_owned()],
        changed: vec![],
        removed: vec![],
        config_errors: vec![config_error()],
    };
    let claim = ClaimRef {
        plugin: "p".to_owned(),
        volume_id: "v".to_owned(),
        workload: "w".to_owned(),
    };
    let drain_failure = DrainFailure {
        plugin: "p".to_owned(),
        volume_id: "v".to_owned(),
        workload: "w".to_owned(),
        error: "e".to_owned(),
    };
    let drain_left = |path: bool| DrainLeft {
        plugin: "p".to_owned(),
        volume_id: "v".to_owned(),
        path: path.then(|| "/m".to_owned()),
        reason: "r".to_owned(),
    };
    let drain = DrainReport {
        complete: false,
        released: vec![claim.clone()],
        failed: vec![drain_failure.clone()],
        stopped_plugins: vec!["p".to_owned()],
        left: vec![drain_left(true)],
    };
    let created = CreateVolumeResponse {
        volume_id: "v1".to_owned(),
        capacity_bytes: 1,
        volume_context: map(&[("k", "v")]),
        accessible_topology: vec![map(&[("zone", "a")])],
    };
    let validated = ValidateResponse {
        confirmed: true,
        message: String::new(),
    };
    let page = BackendVolumePage {
        volumes: vec![backend_volume()],
        next_token: String::new(),
    };
    let capacity = CapacityResponse {
        available_capacity: 1,
    };
    let image = ImageInfo {
        reference: "r/a:1".to_owned(),
        manifest: "sha256:m".to_owned(),
        config: "sha256:c".to_owned(),
        layers: vec!["sha256:l".to_owned()],
        size: 1,
        pulled_at_unix: 1,
        used_by: vec!["p".to_owned()],
    };
    let pruned = ImagePruneResponse {
        removed: vec!["r/a:1".to_owned()],
        rootfs_removed: 0,
        layers_removed: 1,
        blobs_removed: 2,
    };
    let pulled = ImagePullResponse {
        reference: "r/a:1".to_owned(),
        manifest: "sha256:m".to_owned(),
        size: 1,
        downloaded: vec![],
    };
    Ok(vec![
        response("ErrorBody", error(Some("NOT_FOUND")), error(None))?,
        response("ImagePruneResponse", pruned.clone(), pruned)?,
        response("Health", health.clone(), health)?,
        response("StartResponse", start.clone(), start)?,
        request("CapabilitySpec", full_cap())?,
        request("MountSpec", MountSpec::default())?,
        request("BlockSpec", BlockSpec {})?,
        request("SecretsSpec", secrets.clone())?,
        request(
            "PublishRequest",
            PublishRequest {
                plugin: "p".to_owned(),
                volume_id: "v".to_owned(),
                workload: "w".to_owned(),
                capability: mount_cap(),
                readonly: true,
                volume_context: Some(map(&[("k", "v")])),
                secrets: Some(secrets),
                bind_to: Some("/b".to_owned()),
            },
        )?,
        response("PublishResponse", published(true), published(false))?,
        request(
            "UnpublishRequest",
            UnpublishRequest {
                plugin: "p".to_owned(),
                volume_id: "v".to_owned(),
                workload: "w".to_owned(),
            },
        )?,
        response("UnpublishResponse", unpublished.clone(), unpublished)?,
        response("VolumeInfo", volume_info(true), volume_info(false))?,
        response(
            "UsageFigures",
            csi_agent_api::UsageFigures {
                total: Some(3),
                used: Some(1),
                available: Some(2),
            },
            csi_agent_api::UsageFigures::default(),
        )?,
        response(
            "VolumeCondition",
            csi_agent_api::VolumeCondition {
                abnormal: true,
                message: "m".to_owned(),
            },
            csi_agent_api::VolumeCondition::default(),
        )?,
        response(
            "VolumeStats",
            csi_agent_api::VolumeStats {
                bytes: Some(csi_agent_api::UsageFigures {
                    total: Some(16 << 20),
                    used: Some(4096),
                    available: Some((16 << 20) - 4096),
                }),
                inodes: Some(csi_agent_api::UsageFigures::default()),
                condition: Some(csi_agent_api::VolumeCondition {
                    abnormal: false,
                    message: String::new(),
                }),
                collected_at: "2026-12-06T08:31:47.997Z".to_owned(),
            },
            csi_agent_api::VolumeStats {
                collected_at: "2026-12-06T08:31:47.997Z".to_owned(),
                ..Default::default()
            },
        )?,
        response(
            "VolumeList",
            volumes.clone(),
            VolumeList {
                next_page_token: None,
                ..volumes
            },
        )?,
        response("ComponentInfo", component(true), component(false))?,
        response("OperationInfo", operation_info(true), operation_info(false))?,
        response(
            "ExpansionInfo",
            ExpansionInfo {
                capacity_bytes: 1 << 30,
                next_step: "controller".to_owned(),
            },
            ExpansionInfo {
                capacity_bytes: 1 << 30,
                next_step: "node".to_owned(),
            },
        )?,
        response("PluginInfo", plugin_info(true), plugin_info(false))?,
        response("ConfigErrorInfo", config_error(), config_error())?,
        response("PluginList", plugins.clone(), plugins)?,
        response("ReloadReport", reload.clone(), reload)?,
        response("DrainReport", drain.clone(), drain)?,
        response("ClaimRef", claim.clone(), claim)?,
        response("DrainFailure", drain_failure.clone(), drain_failure)?,
        response("DrainLeft", drain_left(true), drain_left(false))?,
        request(
            "DrainRequest",
            DrainRequest {
                timeout_secs: Some(5),
            },
        )?,
        request(
            "CreateVolumeRequest",
            CreateVolumeRequest {
                plugin: "p".to_owned(),
                name: "n".to_owned(),
                capacity_bytes: 1,
                capability: mount_cap(),
                parameters: map(&[("k", "v")]),
                accessibility_requirements: Some(AccessibilityRequirements {
                    requisite: vec![map(&[("zone", "a")])],
                    preferred: vec![map(&[("zone", "a"), ("rack", "1")])],
                }),
                content_source: Some(ContentSource {
                    snapshot_id: Some("s".to_owned()),
                    volume_id: None,
                }),
            },
        )?,
        response(
            "CreateVolumeResponse",
            created.clone(),
            CreateVolumeResponse {
                accessible_topology: vec![],
                ..created
            },
        )?,
        request(
            "ContentSource",
            ContentSource {
                snapshot_id: Some("s".to_owned()),
                volume_id: Some("v".to_owned()),
            },
        )?,
        request(
            "CreateSnapshotRequest",
            CreateSnapshotRequest {
                plugin: "p".to_owned(),
                source_volume_id: "v".to_owned(),
                name: "n".to_owned(),
                parameters: map(&[("k", "v")]),
            },
        )?,
        response("SnapshotInfo", snapshot_info(true), snapshot_info(false))?,
        response(
            "SnapshotPage",
            SnapshotPage {
                snapshots: vec![snapshot_info(true)],
                next_token: "t".to_owned(),
            },
            SnapshotPage {
                snapshots: vec![],
                next_token: String::new(),
            },
        )?,
        response(
            "DeleteSnapshotResponse",
            DeleteSnapshotResponse { deleted: true },
            DeleteSnapshotResponse { deleted: true },
        )?,
        response(
            "DeleteVolumeResponse",
            DeleteVolumeResponse { deleted: true },
            DeleteVolumeResponse { deleted: true },
        )?,
        request(
            "ValidateRequest",
            ValidateRequest {
                plugin: "p".to_owned(),
                volume_id: "v".to_owned(),
                capabilities: vec![mount_cap()],
                volume_context: map(&[("k", "v")]),
                parameters: map(&[("k", "v")]),
            },
        )?,
        response("ValidateResponse", validated.clone(), validated)?,
        response("BackendVolume", backend_volume(), backend_volume())?,
        response("BackendVolumePage", page.clone(), page)?,
        request(
            "CapacityRequest",
            CapacityRequest {
                plugin: "p".to_owned(),
                capabilities: vec![mount_cap()],
                parameters: map(&[("k", "v")]),
                accessible_topology: Some(map(&[("zone", "a")])),
            },
        )?,
        response("CapacityResponse", capacity.clone(), capacity)?,
        request(
            "ExpandRequest",
            ExpandRequest {
                capacity_bytes: 1 << 30,
            },
        )?,
        request(
            "AccessibilityRequirements",
            AccessibilityRequirements {
                requisite: vec![map(&[("zone", "a")])],
                preferred: vec![map(&[("zone", "a")])],
            },
        )?,
        response(
            "ControllerVolumeStatus",
            ControllerVolumeStatus {
                published_node_ids: vec!["node-1".to_owned()],
                condition: Some(VolumeCondition {
                    abnormal: false,
                    message: String::new(),
                }),
                error: Some("timed out".to_owned()),
            },
            ControllerVolumeStatus::default(),
        )?,
        response(
            "PluginNodeInfo",
            PluginNodeInfo {
                node_id: "node-1".to_owned(),
                accessible_topology: Some(map(&[("zone", "a")])),
                max_volumes_per_node: Some(2),
            },
            PluginNodeInfo {
                node_id: "node-1".to_owned(),
                ..PluginNodeInfo::default()
            },
        )?,
        response("ImageInfo", image.clone(), image.clone())?,
        response(
            "ImageList",
            ImageList {
                images: vec![image.clone()],
                blob_bytes: 1234,
                store_bytes: 8192,
                store_max_bytes: 1 << 35,
            },
            ImageList {
                images: vec![],
                blob_bytes: 0,
                store_bytes: 0,
                store_max_bytes: 1 << 35,
            },
        )?,
        request(
            "ImagePullRequest",
            ImagePullRequest {
                reference: "busybox".to_owned(),
            },
        )?,
        response("ImagePullResponse", pulled.clone(), pulled)?,
        response("ImagePullProgress", pull_progress(), pull_progress())?,
        response(
            "BlobPullProgress",
            pull_progress().blobs[0].clone(),
            pull_progress().blobs[0].clone(),
        )?,
        response(
            "ImagePullList",
            ImagePullList {
                pulls: vec![pull_progress()],
            },
            ImagePullList { pulls: vec![] },
        )?,
        response("ClusterStatus", cluster_status(true), cluster_status(false))?,
        response("ClusterMember", cluster_member(), cluster_member())?,
        response("ClusterLeader", cluster_leader(), cluster_leader())?,
        response("ClusterCsiNode", cluster_csi_node(), cluster_csi_node())?,
        response("ClusterClaim", cluster_claim(), cluster_claim())?,
        response("DamagedKey", damaged_key(), damaged_key())?,
        response(
            "ClusterClaims",
            ClusterClaims {
                claims: vec![cluster_claim()],
                damaged: vec![damaged_key()],
            },
            ClusterClaims::default(),
        )?,
        request(
            "FenceRequest",
            FenceRequest {
                reason: "n3 powered off".to_owned(),
            },
        )?,
        response(
            "FenceReport",
            FenceReport {
                node: "n3".to_owned(),
                freed: vec!["v1".to_owned()],
                left: vec!["v2: plugin not run here".to_owned()],
            },
            FenceReport::default(),
        )?,
        response(
            "ImageImportResponse",
            ImageImportResponse {
                images: vec![image.clone()],
            },
            ImageImportResponse { images: vec![] },
        )?,
    ])
}

/// Schemas that are not the body of one Rust struct.
const NON_STRUCT_SCHEMAS: &[&str] = &["ErrorCode", "StringMap", "AccessMode"];

#[test]
fn routes_are_exactly_all_routes() -> Result<()> {
    let spec = spec()?;
    let mut described = BTreeSet::new();
    for (path, item) in object(&spec["paths"], "paths")? {
        for method in keys(item, path)? {
            if HTTP_METHODS.contains(&method.as_str()) {
                described.insert((method.to_uppercase(), path.clone()));
            }
        }
    }
    let expected: BTreeSet<(String, String)> = ALL_ROUTES
        .iter()
        .map(|(m, p)| ((*m).to_owned(), (*p).to_owned()))
        .collect();
    ensure!(
        described == expected,
        "only in openapi.yaml: {:?}; only in routes::ALL_ROUTES: {:?}",
        described.difference(&expected).collect::<Vec<_>>(),
        expected.difference(&described).collect::<Vec<_>>()
    );
    Ok(())
}

#[test]
fn schema_properties_are_the_serde_fields() -> Result<()> {
    let spec = spec()?;
    let schemas = &spec["components"]["schemas"];
    let mut covered: BTreeSet<String> = NON_STRUCT_SCHEMAS.iter().map(|s| s.to_string()).collect();
    for case in cases()? {
        let name = case.schema;
        covered.insert(name.to_owned());
        let schema = schemas
            .get(name)
            .ok_or_else(|| anyhow!("openapi.yaml has no schema {name}"))?;
        let properties = keys(&schema["properties"], &format!("{name}.properties"))?;
        let fields = keys(&case.full, name)?;
        ensure!(
            properties == fields,
            "{name}: openapi.yaml properties {properties:?} != serde fields {fields:?}"
        );

        let required: BTreeSet<String> = match schema.get("required") {
            None => BTreeSet::new(),
            Some(list) => list
                .as_array()
                .ok_or_else(|| anyhow!("{name}.required is not a list"))?
                .iter()
                .map(|v| v.as_str().map(str::to_owned))
                .collect::<Option<_>>()
                .ok_or_else(|| anyhow!("{name}.required holds a non-string"))?,
        };
        ensure!(
            required.is_subset(&properties),
            "{name}: required {required:?} names unknown properties"
        );
        match &case.kind {
            Kind::Response(minimal) => {
                let always = keys(minimal, name)?;
                ensure!(
                    required == always,
                    "{name}: required {required:?} but the daemon always sends {always:?}"
                );
            }
            Kind::Request(parses) => {
                let full = object(&case.full, name)?;
                let only_required: serde_json::Map<String, Value> = full
                    .iter()
                    .filter(|(k, _)| required.contains(*k))
                    .map(|(k, v)| (k.clone(), v.clone()))
                    .collect();
                ensure!(
                    parses(Value::Object(only_required.clone())),
                    "{name}: a body with only the required fields {required:?} is refused"
                );
                for field in &required {
                    let mut without = only_required.clone();
                    without.remove(field);
                    ensure!(
                        !parses(Value::Object(without)),
                        "{name}: '{field}' is listed as required but serde accepts its absence"
                    );
                }
                let mut extra = full.clone();
                extra.insert("no_such_field".to_owned(), json!(1));
                let denies_unknown = !parses(Value::Object(extra));
                let closed = schema.get("additionalProperties") == Some(&json!(false));
                ensure!(
                    denies_unknown == closed,
                    "{name}: serde denies unknown fields: {denies_unknown}, but openapi.yaml \
                     additionalProperties: false is {closed}"
                );
            }
        }
    }
    let all = keys(schemas, "components.schemas")?;
    ensure!(
        all == covered,
        "schemas without a Rust sample in this test: {:?}; samples without a schema: {:?}",
        all.difference(&covered).collect::<Vec<_>>(),
        covered.difference(&all).collect::<Vec<_>>()
    );
    Ok(())
}

/// (method, path, request body schema, success response schema; `None` = OpenMetrics text).
const BODIES: &[(&str, &str, Option<&str>, Option<&str>)] = &[
    ("GET", routes::HEALTH, None, Some("Health")),
    ("POST", routes::START, None, Some("StartResponse")),
    ("GET", routes::METRICS, None, None),
    ("GET", routes::PLUGINS, None, Some("PluginList")),
    ("GET", routes::PLUGIN, None, Some("PluginInfo")),
    ("POST", routes::PLUGINS_RELOAD, None, Some("ReloadReport")),
    (
        "POST",
        routes::DRAIN,
        Some("DrainRequest"),
        Some("DrainReport"),
    ),
    (
        "GET",
        routes::BACKEND_VOLUMES,
        None,
        Some("BackendVolumePage"),
    ),
    (
        "POST",
        routes::PUBLISH,
        Some("PublishRequest"),
        Some("PublishResponse"),
    ),
    (
        "POST",
        routes::UNPUBLISH,
        Some("UnpublishRequest"),
        Some("UnpublishResponse"),
    ),
    ("GET", routes::VOLUMES, None, Some("VolumeList")),
    (
        "POST",
        routes::VOLUMES,
        Some("CreateVolumeRequest"),
        Some("CreateVolumeResponse"),
    ),
    ("GET", routes::VOLUME, None, Some("VolumeInfo")),
    (
        "POST",
        routes::SNAPSHOTS,
        Some("CreateSnapshotRequest"),
        Some("SnapshotInfo"),
    ),
    (
        "DELETE",
        routes::SNAPSHOT,
        None,
        Some("DeleteSnapshotResponse"),
    ),
    ("GET", routes::PLUGIN_SNAPSHOTS, None, Some("SnapshotPage")),
    ("DELETE", routes::VOLUME, None, Some("DeleteVolumeResponse")),
    ("GET", routes::VOLUME_STATS, None, Some("VolumeStats")),
    (
        "POST",
        routes::VOLUME_EXPAND,
        Some("ExpandRequest"),
        Some("VolumeInfo"),
    ),
    (
        "POST",
        routes::VALIDATE,
        Some("ValidateRequest"),
        Some("ValidateResponse"),
    ),
    (
        "POST",
        routes::CAPACITY,
        Some("CapacityRequest"),
        Some("CapacityResponse"),
    ),
    ("GET", routes::IMAGES, None, Some("ImageList")),
    ("GET", routes::IMAGES_PULLS, None, Some("ImagePullList")),
    (
        "POST",
        routes::IMAGES_PRUNE,
        None,
        Some("ImagePruneResponse"),
    ),
    (
        "POST",
        routes::IMAGES_PULL,
        Some("ImagePullRequest"),
        Some("ImagePullResponse"),
    ),
    ("GET", routes::CLUSTER, None, Some("ClusterStatus")),
    ("GET", routes::CLUSTER_CLAIMS, None, Some("ClusterClaims")),
    (
        "POST",
        routes::CLUSTER_FENCE,
        Some("FenceRequest"),
        Some("FenceReport"),
    ),
    // Its body is a tar archive, not JSON: checked on its own below.
    (
        "POST",
        routes::IMAGES_IMPORT,
        None,
        Some("ImageImportResponse"),
    ),
];

#[test]
fn each_route_carries_its_rust_types() -> Result<()> {
    let spec = spec()?;
    let listed: BTreeSet<(&str, &str)> = BODIES.iter().map(|(m, p, _, _)| (*m, *p)).collect();
    let all: BTreeSet<(&str, &str)> = ALL_ROUTES.iter().copied().collect();
    ensure!(listed == all, "BODIES in this test must list every route");

    for (method, path, request, response) in BODIES {
        let op = &spec["paths"][*path][method.to_lowercase()];
        ensure!(op.is_object(), "{method} {path} missing");
        let body = &op["requestBody"];
        match request {
            None if *path == routes::IMAGES_IMPORT => ensure!(
                body["required"] == json!(true)
                    && body["content"][routes::TAR_MEDIA_TYPE]["schema"]["format"]
                        == json!("binary"),
                "{method} {path}: a required {} body",
                routes::TAR_MEDIA_TYPE
            ),
            None => ensure!(body.is_null(), "{method} {path} takes no body"),
            Some(schema) => {
                // The drain's body is optional: without one it runs with the defaults.
                let required = *path != routes::DRAIN;
                ensure!(
                    body["required"] == json!(required),
                    "{method} {path}: body required: {required}"
                );
                let got = schema_ref(&body["content"]["application/json"]["schema"]);
                ensure!(
                    got == Some(*schema),
                    "{method} {path}: request {got:?} != {schema}"
                );
            }
        }
        // Exactly one success status: 201 for a creation, 200 for everything else.
        let success = if *method == "POST" && [routes::VOLUMES, routes::SNAPSHOTS].contains(path) {
            "201"
        } else {
            "200"
        };
        let statuses = keys(&op["responses"], "responses")?;
        let successes: Vec<&String> = statuses.iter().filter(|s| s.starts_with('2')).collect();
        ensure!(
            successes == [success],
            "{method} {path}: success statuses {successes:?}, expected [{success}]"
        );
        let ok = &op["responses"][success]["content"];
        match response {
            None => ensure!(
                ok["application/openmetrics-text"]["schema"]["type"] == json!("string"),
                "{method} {path}: OpenMetrics text answer"
            ),
            Some(schema) => {
                let got = schema_ref(&ok["application/json"]["schema"]);
                ensure!(
                    got == Some(*schema),
                    "{method} {path}: response {got:?} != {schema}"
                );
            }
        }
        // Every route may be refused for a bad token (TCP) or a head too large, fail
        // internally, or meet a listener at its connection cap.
        for status in ["401", "431", "500", "503"] {
            ensure!(
                op["responses"].get(status).is_some(),
                "{method} {path}: no {status} response"
            );
        }
        // Only a route that takes a body documents the refusals of a body.
        for status in ["408", "413", "415"] {
            ensure!(
                op["responses"].get(status).is_some()
                    == (request.is_some() || *path == routes::IMAGES_IMPORT),
                "{method} {path}: {status} response is for routes with a body, and only for them"
            );
        }
    }
    Ok(())
}

#[test]
fn error_responses_use_the_error_shape_and_statuses() -> Result<()> {
    let spec = spec()?;
    let codes: Vec<Value> = ErrorCode::ALL
        .iter()
        .map(serde_json::to_value)
        .collect::<Result<_, _>>()?;
    ensure!(
        spec["components"]["schemas"]["ErrorCode"]["enum"] == Value::Array(codes),
        "ErrorCode enum in openapi.yaml != ErrorCode::ALL"
    );

    let responses = object(&spec["components"]["responses"], "components.responses")?;
    // Response name → the code its description starts with (`` `not_found`: … ``).
    let mut code_of = BTreeMap::new();
    for (name, response) in responses {
        let description = response["description"].as_str().unwrap_or_default();
        let code_name = description
            .strip_prefix('`')
            .and_then(|rest| rest.split('`').next())
            .ok_or_else(|| anyhow!("response {name}: description must start with `code`"))?;
        let code: ErrorCode = serde_json::from_value(json!(code_name))
            .with_context(|| format!("response {name}: unknown code {code_name}"))?;
        ensure!(
            schema_ref(&response["content"]["application/json"]["schema"]) == Some("ErrorBody"),
            "response {name} is not the ErrorBody shape"
        );
        code_of.insert(format!("#/components/responses/{name}"), code);
    }

    let mut statuses_used = BTreeSet::new();
    for (path, item) in object(&spec["paths"], "paths")? {
        for (method, op) in object(item, path)? {
            if !HTTP_METHODS.contains(&method.as_str()) {
                continue;
            }
            for (status, response) in object(&op["responses"], "responses")? {
                if status.starts_with('2') {
                    continue;
                }
                let reference = response["$ref"].as_str().unwrap_or_default();
                let Some(code) = code_of.get(reference) else {
                    bail!("{method} {path} {status}: not a components/responses error");
                };
                let status: u16 = status.parse()?;
                ensure!(
                    status == code.http_status() || code.other_statuses().contains(&status),
                    "{method} {path}: {status} refers to {reference} ({} or {:?})",
                    code.http_status(),
                    code.other_statuses()
                );
                statuses_used.insert(status);
            }
        }
    }
    // Every status of every code appears, except 405: the spec describes only the methods
    // each route takes.
    let all: BTreeSet<u16> = ErrorCode::ALL
        .iter()
        .flat_map(|c| std::iter::once(c.http_status()).chain(c.other_statuses().iter().copied()))
        .filter(|status| *status != 405)
        .collect();
    ensure!(
        statuses_used == all,
        "statuses used {statuses_used:?} != {all:?}"
    );
    Ok(())
}

#[test]
fn access_modes_and_security_scheme() -> Result<()> {
    let spec = spec()?;
    ensure!(
        spec["components"]["schemas"]["AccessMode"]["enum"] == json!(CapabilitySpec::ACCESS_MODES),
        "AccessMode enum != CapabilitySpec::ACCESS_MODES"
    );
    let scheme = &spec["components"]["securitySchemes"]["bearerAuth"];
    ensure!(scheme["type"] == json!("http") && scheme["scheme"] == json!("bearer"));
    // Optional: none on the unix socket, the bearer token on TCP.
    ensure!(spec["security"] == json!([{}, {"bearerAuth": []}]));
    Ok(())
}
