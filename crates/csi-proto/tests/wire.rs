//! Wire-compatibility spot checks: field numbers, wire types and enum values
//! that a typo in the `.proto` files would silently break.
//!
//! Expected bytes are written by hand from the CSI specification: a field
//! key is `(field_number << 3) | wire_type` (0 = varint, 2 = length-delimited).

use std::collections::HashMap;

use csi_proto::{v0, v1};
use prost::Message;

fn key(field: u8, wire_type: u8) -> u8 {
    (field << 3) | wire_type
}

const VARINT: u8 = 0;
const LEN: u8 = 2;

/// Encodes a message made of a single map<string,string> entry `{k: v}` as
/// field `field` and returns the bytes.
fn single_map_entry(field: u8, k: &str, v: &str) -> Vec<u8> {
    let mut entry = vec![key(1, LEN), len(k)];
    entry.extend_from_slice(k.as_bytes());
    entry.extend([key(2, LEN), len(v)]);
    entry.extend_from_slice(v.as_bytes());
    let mut out = vec![key(field, LEN), len_bytes(&entry)];
    out.extend(entry);
    out
}

fn len(s: &str) -> u8 {
    u8::try_from(s.len()).unwrap_or(u8::MAX)
}

fn len_bytes(b: &[u8]) -> u8 {
    u8::try_from(b.len()).unwrap_or(u8::MAX)
}

// ----------------------------------------------------------------------------
// v1
// ----------------------------------------------------------------------------

#[test]
fn v1_node_publish_target_path_is_4_and_readonly_is_6() {
    let req = v1::NodePublishVolumeRequest {
        target_path: "/t".to_owned(),
        readonly: true,
        ..Default::default()
    };
    assert_eq!(
        req.encode_to_vec(),
        [key(4, LEN), 2, b'/', b't', key(6, VARINT), 1]
    );
}

#[test]
fn v1_node_publish_all_scalar_fields() {
    let req = v1::NodePublishVolumeRequest {
        volume_id: "v".to_owned(),
        staging_target_path: "s".to_owned(),
        target_path: "t".to_owned(),
        volume_capability: Some(v1::VolumeCapability::default()),
        ..Default::default()
    };
    assert_eq!(
        req.encode_to_vec(),
        [
            key(1, LEN),
            1,
            b'v',
            key(3, LEN),
            1,
            b's',
            key(4, LEN),
            1,
            b't',
            key(5, LEN),
            0,
        ]
    );
}

#[test]
fn v1_secrets_field_numbers() {
    let stage = v1::NodeStageVolumeRequest {
        secrets: HashMap::from([("a".to_owned(), "b".to_owned())]),
        ..Default::default()
    };
    assert_eq!(stage.encode_to_vec(), single_map_entry(5, "a", "b"));

    let publish = v1::NodePublishVolumeRequest {
        secrets: HashMap::from([("a".to_owned(), "b".to_owned())]),
        ..Default::default()
    };
    assert_eq!(publish.encode_to_vec(), single_map_entry(7, "a", "b"));

    let create = v1::CreateVolumeRequest {
        secrets: HashMap::from([("a".to_owned(), "b".to_owned())]),
        ..Default::default()
    };
    assert_eq!(create.encode_to_vec(), single_map_entry(5, "a", "b"));

    let cpub = v1::ControllerPublishVolumeRequest {
        secrets: HashMap::from([("a".to_owned(), "b".to_owned())]),
        ..Default::default()
    };
    assert_eq!(cpub.encode_to_vec(), single_map_entry(5, "a", "b"));

    let expand = v1::NodeExpandVolumeRequest {
        secrets: HashMap::from([("a".to_owned(), "b".to_owned())]),
        ..Default::default()
    };
    assert_eq!(expand.encode_to_vec(), single_map_entry(6, "a", "b"));
}

#[test]
fn v1_probe_ready_is_bool_value_field_1() {
    let resp = v1::ProbeResponse { ready: Some(true) };
    // google.protobuf.BoolValue { value = 1 } nested in field 1.
    assert_eq!(resp.encode_to_vec(), [key(1, LEN), 2, key(1, VARINT), 1]);

    // Present-but-false must be distinguishable from absent.
    let not_ready = v1::ProbeResponse::decode(&[key(1, LEN), 0][..]).ok();
    assert_eq!(not_ready.and_then(|r| r.ready), Some(false));
    let absent = v1::ProbeResponse::decode(&[][..]).ok();
    assert_eq!(absent.map(|r| r.ready), Some(None));
}

#[test]
fn v1_node_get_info_response_decodes() {
    // node_id = "n1" (1), max_volumes_per_node = 5 (2),
    // accessible_topology = { segments = {"z": "a"} } (3).
    let mut bytes = vec![key(1, LEN), 2, b'n', b'1', key(2, VARINT), 5];
    let topology = single_map_entry(1, "z", "a");
    bytes.extend([key(3, LEN), len_bytes(&topology)]);
    bytes.extend(topology);

    let resp = v1::NodeGetInfoResponse::decode(&bytes[..]).ok();
    let resp = resp.as_ref();
    assert_eq!(resp.map(|r| r.node_id.as_str()), Some("n1"));
    assert_eq!(resp.map(|r| r.max_volumes_per_node), Some(5));
    assert_eq!(
        resp.and_then(|r| r.accessible_topology.as_ref())
            .and_then(|t| t.segments.get("z"))
            .map(String::as_str),
        Some("a")
    );
}

#[test]
fn v1_capabilities_lists_are_field_1() {
    let caps = v1::GetPluginCapabilitiesResponse {
        capabilities: vec![v1::PluginCapability {
            r#type: Some(v1::plugin_capability::Type::Service(
                v1::plugin_capability::Service {
                    r#type: v1::plugin_capability::service::Type::ControllerService as i32,
                },
            )),
        }],
    };
    assert_eq!(
        caps.encode_to_vec(),
        [key(1, LEN), 4, key(1, LEN), 2, key(1, VARINT), 1]
    );

    let ctrl = v1::ControllerGetCapabilitiesResponse {
        capabilities: vec![v1::ControllerServiceCapability {
            r#type: Some(v1::controller_service_capability::Type::Rpc(
                v1::controller_service_capability::Rpc {
                    r#type: v1::controller_service_capability::rpc::Type::GetSnapshot as i32,
                },
            )),
        }],
    };
    assert_eq!(
        ctrl.encode_to_vec(),
        [key(1, LEN), 4, key(1, LEN), 2, key(1, VARINT), 15]
    );
}

#[test]
fn v1_enum_values() {
    use v1::controller_service_capability::rpc::Type as C;
    use v1::node_service_capability::rpc::Type as N;
    use v1::plugin_capability::service::Type as S;
    use v1::volume_capability::access_mode::Mode as M;

    assert_eq!(C::CreateDeleteVolume as i32, 1);
    assert_eq!(C::PublishUnpublishVolume as i32, 2);
    assert_eq!(C::ExpandVolume as i32, 9);
    assert_eq!(C::GetVolume as i32, 12);
    assert_eq!(C::ModifyVolume as i32, 14);
    assert_eq!(C::GetSnapshot as i32, 15);
    assert_eq!(N::StageUnstageVolume as i32, 1);
    assert_eq!(N::GetVolumeStats as i32, 2);
    assert_eq!(N::VolumeMountGroup as i32, 6);
    assert_eq!(S::VolumeAccessibilityConstraints as i32, 2);
    assert_eq!(S::SnapshotMetadataService as i32, 4);
    assert_eq!(M::MultiNodeMultiWriter as i32, 5);
    assert_eq!(M::SingleNodeMultiWriter as i32, 7);
    assert_eq!(v1::volume_usage::Unit::Inodes as i32, 2);
}

#[test]
fn v1_volume_capability_oneof_and_access_mode() {
    let cap = v1::VolumeCapability {
        access_type: Some(v1::volume_capability::AccessType::Mount(
            v1::volume_capability::MountVolume {
                fs_type: "x".to_owned(),
                mount_flags: vec![],
                volume_mount_group: "g".to_owned(),
            },
        )),
        access_mode: Some(v1::volume_capability::AccessMode {
            mode: v1::volume_capability::access_mode::Mode::SingleNodeWriter as i32,
        }),
    };
    assert_eq!(
        cap.encode_to_vec(),
        [
            key(2, LEN), // mount
            6,
            key(1, LEN), // fs_type
            1,
            b'x',
            key(3, LEN), // volume_mount_group
            1,
            b'g',
            key(3, LEN), // access_mode
            2,
            key(1, VARINT),
            1,
        ]
    );
    let block = v1::VolumeCapability {
        access_type: Some(v1::volume_capability::AccessType::Block(
            v1::volume_capability::BlockVolume {},
        )),
        access_mode: None,
    };
    assert_eq!(block.encode_to_vec(), [key(1, LEN), 0]);
}

#[test]
fn v1_snapshot_fields() {
    let snap = v1::Snapshot {
        size_bytes: 1,
        snapshot_id: "s".to_owned(),
        source_volume_id: "v".to_owned(),
        creation_time: Some(prost_types::Timestamp {
            seconds: 2,
            nanos: 0,
        }),
        ready_to_use: true,
        group_snapshot_id: "g".to_owned(),
    };
    assert_eq!(
        snap.encode_to_vec(),
        [
            key(1, VARINT),
            1,
            key(2, LEN),
            1,
            b's',
            key(3, LEN),
            1,
            b'v',
            key(4, LEN),
            2,
            key(1, VARINT),
            2,
            key(5, VARINT),
            1,
            key(6, LEN),
            1,
            b'g',
        ]
    );
}

#[test]
fn v1_create_volume_mutable_parameters_is_8() {
    let req = v1::CreateVolumeRequest {
        mutable_parameters: HashMap::from([("a".to_owned(), "b".to_owned())]),
        ..Default::default()
    };
    assert_eq!(req.encode_to_vec(), single_map_entry(8, "a", "b"));
}

#[test]
fn v1_get_capacity_wrappers() {
    let resp = v1::GetCapacityResponse {
        available_capacity: 3,
        maximum_volume_size: Some(4),
        minimum_volume_size: Some(0),
    };
    assert_eq!(
        resp.encode_to_vec(),
        [
            key(1, VARINT),
            3,
            key(2, LEN),
            2,
            key(1, VARINT),
            4,
            key(3, LEN),
            0
        ]
    );
}

// ----------------------------------------------------------------------------
// v0
// ----------------------------------------------------------------------------

#[test]
fn v0_node_get_id_response_node_id_is_1() {
    let resp = v0::NodeGetIdResponse {
        node_id: "n1".to_owned(),
    };
    assert_eq!(resp.encode_to_vec(), [key(1, LEN), 2, b'n', b'1']);
    let back = v0::NodeGetIdResponse::decode(&[key(1, LEN), 1, b'x'][..]).ok();
    assert_eq!(back.map(|r| r.node_id), Some("x".to_owned()));
}

#[test]
fn v0_capability_lists_are_field_2() {
    let caps = v0::GetPluginCapabilitiesResponse {
        capabilities: vec![v0::PluginCapability {
            r#type: Some(v0::plugin_capability::Type::Service(
                v0::plugin_capability::Service {
                    r#type: v0::plugin_capability::service::Type::ControllerService as i32,
                },
            )),
        }],
    };
    assert_eq!(
        caps.encode_to_vec(),
        [key(2, LEN), 4, key(1, LEN), 2, key(1, VARINT), 1]
    );

    let ctrl = v0::ControllerGetCapabilitiesResponse {
        capabilities: vec![v0::ControllerServiceCapability {
            r#type: Some(v0::controller_service_capability::Type::Rpc(
                v0::controller_service_capability::Rpc {
                    r#type: v0::controller_service_capability::rpc::Type::ListSnapshots as i32,
                },
            )),
        }],
    };
    assert_eq!(
        ctrl.encode_to_vec(),
        [key(2, LEN), 4, key(1, LEN), 2, key(1, VARINT), 6]
    );

    // ... but the node capability list is field 1.
    let node = v0::NodeGetCapabilitiesResponse {
        capabilities: vec![v0::NodeServiceCapability {
            r#type: Some(v0::node_service_capability::Type::Rpc(
                v0::node_service_capability::Rpc {
                    r#type: v0::node_service_capability::rpc::Type::StageUnstageVolume as i32,
                },
            )),
        }],
    };
    assert_eq!(
        node.encode_to_vec(),
        [key(1, LEN), 4, key(1, LEN), 2, key(1, VARINT), 1]
    );
}

#[test]
fn v0_node_publish_field_numbers() {
    let req = v0::NodePublishVolumeRequest {
        volume_id: "v".to_owned(),
        staging_target_path: "s".to_owned(),
        target_path: "t".to_owned(),
        readonly: true,
        ..Default::default()
    };
    assert_eq!(
        req.encode_to_vec(),
        [
            key(1, LEN),
            1,
            b'v',
            key(3, LEN),
            1,
            b's',
            key(4, LEN),
            1,
            b't',
            key(6, VARINT),
            1
        ]
    );

    let secrets = v0::NodePublishVolumeRequest {
        node_publish_secrets: HashMap::from([("a".to_owned(), "b".to_owned())]),
        ..Default::default()
    };
    assert_eq!(secrets.encode_to_vec(), single_map_entry(7, "a", "b"));
    let attrs = v0::NodePublishVolumeRequest {
        volume_attributes: HashMap::from([("a".to_owned(), "b".to_owned())]),
        ..Default::default()
    };
    assert_eq!(attrs.encode_to_vec(), single_map_entry(8, "a", "b"));
}

#[test]
fn v0_node_stage_and_controller_secrets() {
    let stage = v0::NodeStageVolumeRequest {
        node_stage_secrets: HashMap::from([("a".to_owned(), "b".to_owned())]),
        ..Default::default()
    };
    assert_eq!(stage.encode_to_vec(), single_map_entry(5, "a", "b"));
    let publish_info = v0::NodeStageVolumeRequest {
        publish_info: HashMap::from([("a".to_owned(), "b".to_owned())]),
        ..Default::default()
    };
    assert_eq!(publish_info.encode_to_vec(), single_map_entry(2, "a", "b"));

    let create = v0::CreateVolumeRequest {
        controller_create_secrets: HashMap::from([("a".to_owned(), "b".to_owned())]),
        ..Default::default()
    };
    assert_eq!(create.encode_to_vec(), single_map_entry(5, "a", "b"));
    let unpublish = v0::ControllerUnpublishVolumeRequest {
        controller_unpublish_secrets: HashMap::from([("a".to_owned(), "b".to_owned())]),
        ..Default::default()
    };
    assert_eq!(unpublish.encode_to_vec(), single_map_entry(3, "a", "b"));
}

#[test]
fn v0_volume_and_snapshot_use_id() {
    let vol = v0::Volume {
        capacity_bytes: 1,
        id: "v".to_owned(),
        ..Default::default()
    };
    assert_eq!(
        vol.encode_to_vec(),
        [key(1, VARINT), 1, key(2, LEN), 1, b'v']
    );

    let snap = v0::Snapshot {
        size_bytes: 0,
        id: "s".to_owned(),
        source_volume_id: String::new(),
        created_at: 7,
        status: Some(v0::SnapshotStatus {
            r#type: v0::snapshot_status::Type::Ready as i32,
            details: String::new(),
        }),
    };
    assert_eq!(
        snap.encode_to_vec(),
        [
            key(2, LEN),
            1,
            b's',
            key(4, VARINT),
            7,
            key(5, LEN),
            2,
            key(1, VARINT),
            1
        ]
    );
}

#[test]
fn v0_probe_ready_is_optional() {
    // A 0.2 plugin answers Probe with an empty message.
    let empty = v0::ProbeResponse::decode(&[][..]).ok();
    assert_eq!(empty.map(|r| r.ready), Some(None));
    let ready = v0::ProbeResponse::decode(&[key(1, LEN), 2, key(1, VARINT), 1][..]).ok();
    assert_eq!(ready.and_then(|r| r.ready), Some(true));
}

// ----------------------------------------------------------------------------
// Service names (the gRPC paths plugins serve)
// ----------------------------------------------------------------------------

#[test]
fn service_names() {
    assert_eq!(v1::identity_server::SERVICE_NAME, "csi.v1.Identity");
    assert_eq!(v1::controller_server::SERVICE_NAME, "csi.v1.Controller");
    assert_eq!(v1::node_server::SERVICE_NAME, "csi.v1.Node");
    assert_eq!(v0::identity_server::SERVICE_NAME, "csi.v0.Identity");
    assert_eq!(v0::controller_server::SERVICE_NAME, "csi.v0.Controller");
    assert_eq!(v0::node_server::SERVICE_NAME, "csi.v0.Node");
}

#[test]
fn file_descriptor_set_describes_both_packages() {
    let fds = prost_types::FileDescriptorSet::decode(csi_proto::FILE_DESCRIPTOR_SET).ok();
    let packages: Vec<String> = fds
        .map(|f| f.file.into_iter().map(|f| f.package().to_owned()).collect())
        .unwrap_or_default();
    assert!(packages.iter().any(|p| p == "csi.v1"), "{packages:?}");
    assert!(packages.iter().any(|p| p == "csi.v0"), "{packages:?}");
    assert!(
        packages.iter().any(|p| p == "google.protobuf"),
        "{packages:?}"
    );
}
