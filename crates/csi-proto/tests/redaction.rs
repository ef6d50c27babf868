//! Secrets must never show up in `Debug` output, while every other field does.

use std::collections::HashMap;

use csi_proto::{v0, v1};

const SECRET: &str = "s3cr3t-value";
const SECRET_KEY: &str = "password";

fn secrets() -> HashMap<String, String> {
    HashMap::from([
        (SECRET_KEY.to_owned(), SECRET.to_owned()),
        ("token".to_owned(), format!("Bearer {SECRET}")),
    ])
}

fn context() -> HashMap<String, String> {
    HashMap::from([("ctx-key".to_owned(), "ctx-value".to_owned())])
}

/// Asserts that `dbg` hides the secret (value and key) and shows the expected
/// non-secret values and the redaction marker.
fn check(dbg: &str, expected: &[&str]) {
    assert!(!dbg.contains(SECRET), "secret value leaked: {dbg}");
    assert!(!dbg.contains(SECRET_KEY), "secret key leaked: {dbg}");
    assert!(
        dbg.contains("<redacted 2 entries>"),
        "no redaction marker: {dbg}"
    );
    for want in expected {
        assert!(dbg.contains(want), "missing {want:?} in {dbg}");
    }
}

fn v1_mount_capability() -> v1::VolumeCapability {
    v1::VolumeCapability {
        access_type: Some(v1::volume_capability::AccessType::Mount(
            v1::volume_capability::MountVolume {
                fs_type: "ext4".to_owned(),
                mount_flags: vec!["noatime".to_owned()],
                volume_mount_group: String::new(),
            },
        )),
        access_mode: Some(v1::volume_capability::AccessMode {
            mode: v1::volume_capability::access_mode::Mode::SingleNodeWriter as i32,
        }),
    }
}

fn v0_mount_capability() -> v0::VolumeCapability {
    v0::VolumeCapability {
        access_type: Some(v0::volume_capability::AccessType::Mount(
            v0::volume_capability::MountVolume {
                fs_type: "xfs".to_owned(),
                mount_flags: vec![],
            },
        )),
        access_mode: None,
    }
}

#[test]
fn v1_node_stage_volume_request() {
    let req = v1::NodeStageVolumeRequest {
        volume_id: "vol-1".to_owned(),
        publish_context: HashMap::from([("dev".to_owned(), "/dev/sdb".to_owned())]),
        staging_target_path: "/staging/vol-1".to_owned(),
        volume_capability: Some(v1_mount_capability()),
        secrets: secrets(),
        volume_context: context(),
    };
    let dbg = format!("{req:?}");
    check(
        &dbg,
        &[
            "NodeStageVolumeRequest",
            "vol-1",
            "/dev/sdb",
            "/staging/vol-1",
            "ext4",
            "noatime",
            "ctx-value",
        ],
    );
    // The pretty form goes through the same impl.
    let pretty = format!("{req:#?}");
    check(&pretty, &["vol-1", "secrets: <redacted 2 entries>"]);
}

#[test]
fn v1_node_publish_volume_request() {
    let req = v1::NodePublishVolumeRequest {
        volume_id: "vol-2".to_owned(),
        publish_context: HashMap::new(),
        staging_target_path: "/staging/vol-2".to_owned(),
        target_path: "/target/vol-2".to_owned(),
        volume_capability: Some(v1_mount_capability()),
        readonly: true,
        secrets: secrets(),
        volume_context: context(),
    };
    let dbg = format!("{req:?}");
    check(
        &dbg,
        &[
            "vol-2",
            "/staging/vol-2",
            "/target/vol-2",
            "readonly: true",
            "ctx-value",
        ],
    );
}

#[test]
fn v1_create_volume_request() {
    let req = v1::CreateVolumeRequest {
        name: "pvc-123".to_owned(),
        capacity_range: Some(v1::CapacityRange {
            required_bytes: 1 << 30,
            limit_bytes: 0,
        }),
        volume_capabilities: vec![v1_mount_capability()],
        parameters: HashMap::from([("tier".to_owned(), "gold".to_owned())]),
        secrets: secrets(),
        volume_content_source: Some(v1::VolumeContentSource {
            r#type: Some(v1::volume_content_source::Type::Snapshot(
                v1::volume_content_source::SnapshotSource {
                    snapshot_id: "snap-9".to_owned(),
                },
            )),
        }),
        accessibility_requirements: None,
        mutable_parameters: HashMap::from([("iops".to_owned(), "3000".to_owned())]),
    };
    let dbg = format!("{req:?}");
    check(
        &dbg,
        &["pvc-123", "1073741824", "gold", "snap-9", "3000", "ext4"],
    );
}

#[test]
fn v1_other_secret_requests() {
    let dbg = format!(
        "{:?}",
        v1::ControllerPublishVolumeRequest {
            volume_id: "vol-3".to_owned(),
            node_id: "node-a".to_owned(),
            secrets: secrets(),
            ..Default::default()
        }
    );
    check(&dbg, &["vol-3", "node-a"]);

    let dbg = format!(
        "{:?}",
        v1::NodeExpandVolumeRequest {
            volume_id: "vol-4".to_owned(),
            volume_path: "/target/vol-4".to_owned(),
            secrets: secrets(),
            ..Default::default()
        }
    );
    check(&dbg, &["vol-4", "/target/vol-4"]);

    let dbg = format!(
        "{:?}",
        v1::GetSnapshotRequest {
            snapshot_id: "snap-1".to_owned(),
            secrets: secrets(),
        }
    );
    check(&dbg, &["snap-1"]);
}

#[test]
fn v0_node_stage_volume_request() {
    let req = v0::NodeStageVolumeRequest {
        volume_id: "old-vol-1".to_owned(),
        publish_info: HashMap::from([("lun".to_owned(), "7".to_owned())]),
        staging_target_path: "/staging/old-vol-1".to_owned(),
        volume_capability: Some(v0_mount_capability()),
        node_stage_secrets: secrets(),
        volume_attributes: context(),
    };
    let dbg = format!("{req:?}");
    check(
        &dbg,
        &["old-vol-1", "lun", "/staging/old-vol-1", "xfs", "ctx-value"],
    );
    assert!(
        dbg.contains("node_stage_secrets: <redacted 2 entries>"),
        "{dbg}"
    );
}

#[test]
fn v0_node_publish_volume_request() {
    let req = v0::NodePublishVolumeRequest {
        volume_id: "old-vol-2".to_owned(),
        publish_info: HashMap::new(),
        staging_target_path: String::new(),
        target_path: "/target/old-vol-2".to_owned(),
        volume_capability: Some(v0_mount_capability()),
        readonly: false,
        node_publish_secrets: secrets(),
        volume_attributes: context(),
    };
    let dbg = format!("{req:?}");
    check(&dbg, &["old-vol-2", "/target/old-vol-2", "ctx-value"]);
    assert!(
        dbg.contains("node_publish_secrets: <redacted 2 entries>"),
        "{dbg}"
    );
}

#[test]
fn v0_create_volume_request() {
    let req = v0::CreateVolumeRequest {
        name: "old-pvc".to_owned(),
        parameters: HashMap::from([("tier".to_owned(), "silver".to_owned())]),
        controller_create_secrets: secrets(),
        ..Default::default()
    };
    let dbg = format!("{req:?}");
    check(&dbg, &["old-pvc", "silver"]);
    assert!(
        dbg.contains("controller_create_secrets: <redacted 2 entries>"),
        "{dbg}"
    );
}

#[test]
fn empty_and_single_secret_maps() {
    let mut req = v1::DeleteVolumeRequest {
        volume_id: "vol-5".to_owned(),
        secrets: HashMap::new(),
    };
    assert!(format!("{req:?}").contains("secrets: <redacted 0 entries>"));
    req.secrets.insert("k".to_owned(), SECRET.to_owned());
    let dbg = format!("{req:?}");
    assert!(dbg.contains("secrets: <redacted 1 entry>"), "{dbg}");
    assert!(!dbg.contains(SECRET), "{dbg}");
}

#[test]
fn every_secret_bearing_message_is_redacted() {
    let mut v1_names = v1::REDACTED_DEBUG_MESSAGES.to_vec();
    v1_names.sort_unstable();
    assert_eq!(
        v1_names,
        [
            "ControllerExpandVolumeRequest",
            "ControllerModifyVolumeRequest",
            "ControllerPublishVolumeRequest",
            "ControllerUnpublishVolumeRequest",
            "CreateSnapshotRequest",
            "CreateVolumeRequest",
            "DeleteSnapshotRequest",
            "DeleteVolumeRequest",
            "GetSnapshotRequest",
            "ListSnapshotsRequest",
            "NodeExpandVolumeRequest",
            "NodePublishVolumeRequest",
            "NodeStageVolumeRequest",
            "ValidateVolumeCapabilitiesRequest",
        ]
    );

    let mut v0_names = v0::REDACTED_DEBUG_MESSAGES.to_vec();
    v0_names.sort_unstable();
    assert_eq!(
        v0_names,
        [
            "ControllerPublishVolumeRequest",
            "ControllerUnpublishVolumeRequest",
            "CreateSnapshotRequest",
            "CreateVolumeRequest",
            "DeleteSnapshotRequest",
            "DeleteVolumeRequest",
            "NodePublishVolumeRequest",
            "NodeStageVolumeRequest",
        ]
    );
}
