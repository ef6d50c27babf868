//! The CSI v0 (0.3 and 0.2) adapter: translates the engine's v1-shaped requests into v0
//! messages and v0 responses back into v1 messages.
//!
//! Enum values are mapped by their names, not their numbers, so that a value one version has
//! and the other lacks is dropped instead of silently meaning something else. This module is
//! pure data conversion: no I/O, no decisions.

use csi_proto::{v0, v1};

use super::{ControllerCapabilities, NodeCapabilities, PluginServices};

/// A v1 request that v0 cannot express.
pub type Untranslatable = String;

pub fn access_mode_to_v0(
    mode: &v1::volume_capability::AccessMode,
) -> v0::volume_capability::AccessMode {
    let name = v1::volume_capability::access_mode::Mode::try_from(mode.mode)
        .map(|m| m.as_str_name())
        .unwrap_or("UNKNOWN");
    let mode = v0::volume_capability::access_mode::Mode::from_str_name(name)
        .unwrap_or(v0::volume_capability::access_mode::Mode::Unknown);
    v0::volume_capability::AccessMode { mode: mode.into() }
}

pub fn access_mode_to_v1(
    mode: &v0::volume_capability::AccessMode,
) -> v1::volume_capability::AccessMode {
    let name = v0::volume_capability::access_mode::Mode::try_from(mode.mode)
        .map(|m| m.as_str_name())
        .unwrap_or("UNKNOWN");
    let mode = v1::volume_capability::access_mode::Mode::from_str_name(name)
        .unwrap_or(v1::volume_capability::access_mode::Mode::Unknown);
    v1::volume_capability::AccessMode { mode: mode.into() }
}

pub fn capability_to_v0(cap: v1::VolumeCapability) -> v0::VolumeCapability {
    use v0::volume_capability as c0;
    use v1::volume_capability as c1;
    let access_type = cap.access_type.map(|t| match t {
        c1::AccessType::Block(_) => c0::AccessType::Block(c0::BlockVolume {}),
        c1::AccessType::Mount(m) => c0::AccessType::Mount(c0::MountVolume {
            fs_type: m.fs_type,
            mount_flags: m.mount_flags,
        }),
    });
    v0::VolumeCapability {
        access_type,
        access_mode: cap.access_mode.as_ref().map(access_mode_to_v0),
    }
}

pub fn capability_to_v1(cap: v0::VolumeCapability) -> v1::VolumeCapability {
    use v0::volume_capability as c0;
    use v1::volume_capability as c1;
    let access_type = cap.access_type.map(|t| match t {
        c0::AccessType::Block(_) => c1::AccessType::Block(c1::BlockVolume {}),
        c0::AccessType::Mount(m) => c1::AccessType::Mount(c1::MountVolume {
            fs_type: m.fs_type,
            mount_flags: m.mount_flags,
            ..Default::default()
        }),
    });
    v1::VolumeCapability {
        access_type,
        access_mode: cap.access_mode.as_ref().map(access_mode_to_v1),
    }
}

fn topology_to_v0(t: v1::Topology) -> v0::Topology {
    v0::Topology {
        segments: t.segments,
    }
}

fn topology_to_v1(t: v0::Topology) -> v1::Topology {
    v1::Topology {
        segments: t.segments,
    }
}

pub fn volume_to_v1(volume: v0::Volume) -> v1::Volume {
    let content_source = volume.content_source.and_then(|source| {
        source.r#type.map(|t| match t {
            v0::volume_content_source::Type::Snapshot(s) => v1::VolumeContentSource {
                r#type: Some(v1::volume_content_source::Type::Snapshot(
                    v1::volume_content_source::SnapshotSource { snapshot_id: s.id },
                )),
            },
        })
    });
    v1::Volume {
        capacity_bytes: volume.capacity_bytes,
        volume_id: volume.id,
        volume_context: volume.attributes,
        content_source,
        accessible_topology: volume
            .accessible_topology
            .into_iter()
            .map(topology_to_v1)
            .collect(),
    }
}

pub fn plugin_info_to_v1(info: v0::GetPluginInfoResponse) -> v1::GetPluginInfoResponse {
    v1::GetPluginInfoResponse {
        name: info.name,
        vendor_version: info.vendor_version,
        manifest: info.manifest,
    }
}

pub fn plugin_services_to_v1(response: &v0::GetPluginCapabilitiesResponse) -> PluginServices {
    use v0::plugin_capability::Type;
    response
        .capabilities
        .iter()
        .filter_map(|cap| match &cap.r#type {
            Some(Type::Service(s)) => v0::plugin_capability::service::Type::try_from(s.r#type).ok(),
            None => None,
        })
        .filter_map(|t| v1::plugin_capability::service::Type::from_str_name(t.as_str_name()))
        .filter(|t| *t != v1::plugin_capability::service::Type::Unknown)
        .collect()
}

pub fn controller_capabilities_to_v1(
    response: &v0::ControllerGetCapabilitiesResponse,
) -> ControllerCapabilities {
    use v0::controller_service_capability::Type;
    response
        .capabilities
        .iter()
        .filter_map(|cap| match &cap.r#type {
            Some(Type::Rpc(r)) => {
                v0::controller_service_capability::rpc::Type::try_from(r.r#type).ok()
            }
            None => None,
        })
        .filter_map(|t| {
            v1::controller_service_capability::rpc::Type::from_str_name(t.as_str_name())
        })
        .filter(|t| *t != v1::controller_service_capability::rpc::Type::Unknown)
        .collect()
}

pub fn node_capabilities_to_v1(response: &v0::NodeGetCapabilitiesResponse) -> NodeCapabilities {
    use v0::node_service_capability::Type;
    response
        .capabilities
        .iter()
        .filter_map(|cap| match &cap.r#type {
            Some(Type::Rpc(r)) => v0::node_service_capability::rpc::Type::try_from(r.r#type).ok(),
            None => None,
        })
        .filter_map(|t| v1::node_service_capability::rpc::Type::from_str_name(t.as_str_name()))
        .filter(|t| *t != v1::node_service_capability::rpc::Type::Unknown)
        .collect()
}

pub fn node_info_to_v1(info: v0::NodeGetInfoResponse) -> v1::NodeGetInfoResponse {
    v1::NodeGetInfoResponse {
        node_id: info.node_id,
        max_volumes_per_node: info.max_volumes_per_node,
        accessible_topology: info.accessible_topology.map(topology_to_v1),
    }
}

pub fn create_volume_request(
    req: v1::CreateVolumeRequest,
) -> Result<v0::CreateVolumeRequest, Untranslatable> {
    let volume_content_source = match req.volume_content_source.and_then(|s| s.r#type) {
        None => None,
        Some(v1::volume_content_source::Type::Snapshot(s)) => Some(v0::VolumeContentSource {
            r#type: Some(v0::volume_content_source::Type::Snapshot(
                v0::volume_content_source::SnapshotSource { id: s.snapshot_id },
            )),
        }),
        Some(v1::volume_content_source::Type::Volume(_)) => {
            return Err("cloning from a volume source needs CSI v1; the plugin speaks v0".into());
        }
    };
    Ok(v0::CreateVolumeRequest {
        name: req.name,
        capacity_range: req.capacity_range.map(|r| v0::CapacityRange {
            required_bytes: r.required_bytes,
            limit_bytes: r.limit_bytes,
        }),
        volume_capabilities: req
            .volume_capabilities
            .into_iter()
            .map(capability_to_v0)
            .collect(),
        parameters: req.parameters,
        controller_create_secrets: req.secrets,
        volume_content_source,
        accessibility_requirements: req.accessibility_requirements.map(|t| {
            v0::TopologyRequirement {
                requisite: t.requisite.into_iter().map(topology_to_v0).collect(),
                preferred: t.preferred.into_iter().map(topology_to_v0).collect(),
            }
        }),
    })
}

pub fn create_volume_response(response: v0::CreateVolumeResponse) -> v1::CreateVolumeResponse {
    v1::CreateVolumeResponse {
        volume: response.volume.map(volume_to_v1),
    }
}

pub fn delete_volume_request(req: v1::DeleteVolumeRequest) -> v0::DeleteVolumeRequest {
    v0::DeleteVolumeRequest {
        volume_id: req.volume_id,
        controller_delete_secrets: req.secrets,
    }
}

pub fn controller_publish_request(
    req: v1::ControllerPublishVolumeRequest,
) -> v0::ControllerPublishVolumeRequest {
    v0::ControllerPublishVolumeRequest {
        volume_id: req.volume_id,
        node_id: req.node_id,
        volume_capability: req.volume_capability.map(capability_to_v0),
        readonly: req.readonly,
        controller_publish_secrets: req.secrets,
        volume_attributes: req.volume_context,
    }
}

pub fn controller_unpublish_request(
    req: v1::ControllerUnpublishVolumeRequest,
) -> v0::ControllerUnpublishVolumeRequest {
    v0::ControllerUnpublishVolumeRequest {
        volume_id: req.volume_id,
        node_id: req.node_id,
        controller_unpublish_secrets: req.secrets,
    }
}

pub fn validate_request(
    req: v1::ValidateVolumeCapabilitiesRequest,
) -> v0::ValidateVolumeCapabilitiesRequest {
    v0::ValidateVolumeCapabilitiesRequest {
        volume_id: req.volume_id,
        volume_capabilities: req
            .volume_capabilities
            .into_iter()
            .map(capability_to_v0)
            .collect(),
        volume_attributes: req.volume_context,
        accessible_topology: Vec::new(),
    }
}

/// v0 answers `supported: bool`; v1 answers with the confirmed capabilities, or none and a
/// message. A supported v0 answer confirms exactly what was asked.
pub fn validate_response(
    asked: &v1::ValidateVolumeCapabilitiesRequest,
    response: v0::ValidateVolumeCapabilitiesResponse,
) -> v1::ValidateVolumeCapabilitiesResponse {
    let confirmed =
        response
            .supported
            .then(|| v1::validate_volume_capabilities_response::Confirmed {
                volume_context: asked.volume_context.clone(),
                volume_capabilities: asked.volume_capabilities.clone(),
                parameters: asked.parameters.clone(),
                ..Default::default()
            });
    v1::ValidateVolumeCapabilitiesResponse {
        confirmed,
        message: response.message,
    }
}

pub fn list_volumes_response(response: v0::ListVolumesResponse) -> v1::ListVolumesResponse {
    v1::ListVolumesResponse {
        entries: response
            .entries
            .into_iter()
            .map(|entry| v1::list_volumes_response::Entry {
                volume: entry.volume.map(volume_to_v1),
                status: None,
            })
            .collect(),
        next_token: response.next_token,
    }
}

pub fn get_capacity_request(req: v1::GetCapacityRequest) -> v0::GetCapacityRequest {
    v0::GetCapacityRequest {
        volume_capabilities: req
            .volume_capabilities
            .into_iter()
            .map(capability_to_v0)
            .collect(),
        parameters: req.parameters,
        accessible_topology: req.accessible_topology.map(topology_to_v0),
    }
}

pub fn node_stage_request(req: v1::NodeStageVolumeRequest) -> v0::NodeStageVolumeRequest {
    v0::NodeStageVolumeRequest {
        volume_id: req.volume_id,
        publish_info: req.publish_context,
        staging_target_path: req.staging_target_path,
        volume_capability: req.volume_capability.map(capability_to_v0),
        node_stage_secrets: req.secrets,
        volume_attributes: req.volume_context,
    }
}

pub fn node_publish_request(req: v1::NodePublishVolumeRequest) -> v0::NodePublishVolumeRequest {
    v0::NodePublishVolumeRequest {
        volume_id: req.volume_id,
        publish_info: req.publish_context,
        staging_target_path: req.staging_target_path,
        target_path: req.target_path,
        volume_capability: req.volume_capability.map(capability_to_v0),
        readonly: req.readonly,
        node_publish_secrets: req.secrets,
        volume_attributes: req.volume_context,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rpc(t: v0::controller_service_capability::rpc::Type) -> v0::ControllerServiceCapability {
        v0::ControllerServiceCapability {
            r#type: Some(v0::controller_service_capability::Type::Rpc(
                v0::controller_service_capability::Rpc { r#type: t.into() },
            )),
        }
    }

    #[test]
    fn controller_capabilities_fold_duplicates_unknown_and_garbage() {
        use v0::controller_service_capability::rpc::Type as T0;
        use v1::controller_service_capability::rpc::Type as T1;
        let mut garbage = rpc(T0::Unknown);
        if let Some(v0::controller_service_capability::Type::Rpc(r)) = &mut garbage.r#type {
            r.r#type = 999;
        }
        let response = v0::ControllerGetCapabilitiesResponse {
            capabilities: vec![
                rpc(T0::CreateDeleteVolume),
                rpc(T0::CreateDeleteVolume),
                rpc(T0::Unknown),
                garbage,
                rpc(T0::PublishUnpublishVolume),
                v0::ControllerServiceCapability { r#type: None },
            ],
        };
        let folded = controller_capabilities_to_v1(&response);
        assert_eq!(
            folded.into_iter().collect::<Vec<_>>(),
            vec![T1::CreateDeleteVolume, T1::PublishUnpublishVolume]
        );
    }

    #[test]
    fn capabilities_round_trip_by_name() {
        use v1::volume_capability::access_mode::Mode;
        for mode in [
            Mode::SingleNodeWriter,
            Mode::SingleNodeReaderOnly,
            Mode::MultiNodeReaderOnly,
            Mode::MultiNodeSingleWriter,
            Mode::MultiNodeMultiWriter,
        ] {
            let cap = v1::VolumeCapability {
                access_type: Some(v1::volume_capability::AccessType::Mount(
                    v1::volume_capability::MountVolume {
                        fs_type: "ext4".into(),
                        mount_flags: vec!["noatime".into()],
                        ..Default::default()
                    },
                )),
                access_mode: Some(v1::volume_capability::AccessMode { mode: mode.into() }),
            };
            assert_eq!(capability_to_v1(capability_to_v0(cap.clone())), cap);
        }
        // A v1-only mode has no v0 name: it becomes UNKNOWN rather than another mode.
        let v1_only = v1::volume_capability::AccessMode {
            mode: Mode::SingleNodeMultiWriter.into(),
        };
        assert_eq!(access_mode_to_v0(&v1_only).mode, 0);
    }

    #[test]
    fn secrets_land_in_the_v0_fields() {
        let mut req = v1::NodeStageVolumeRequest {
            volume_id: "v".into(),
            ..Default::default()
        };
        req.secrets.insert("k".into(), "s".into());
        let v0_req = node_stage_request(req);
        assert_eq!(
            v0_req.node_stage_secrets.get("k").map(String::as_str),
            Some("s")
        );
    }
}
