//! The CSI 0.x services (`csi.v0.*`), in the 0.3 or the 0.2 flavour:
//! translation between `csi_proto::v0` messages and the core [`Plugin`].
//!
//! Owns: the differences of 0.x on the wire and in behaviour — per-RPC
//! secrets field names, `publish_info`/`volume_attributes`, the `supported`
//! flag of ValidateVolumeCapabilities, NodeGetId; in 0.2 mode NodeGetInfo is
//! UNIMPLEMENTED and Probe answers without `ready`; and the 0.x rule that the
//! CO creates (and keeps) the publish target, passed to the core through
//! [`ApiVersion`].
//!
//! Must not: hold CSI semantics of its own (the core decides).

use std::collections::BTreeMap;
use std::sync::Arc;

use csi_proto::v0 as pb;
use pb::controller_server::Controller;
use pb::identity_server::Identity;
use pb::node_server::Node;
use tonic::{Request, Response, Status};

use crate::model::{AccessMode, AccessType, ApiVersion, CapArg, Capability};
use crate::plugin::{
    CAP_LIST_VOLUMES_PUBLISHED_NODES, CAP_PUBLISH_READONLY, CreateArgs, Plugin, PublishArgs,
};
use crate::rpc::{self, CallCtx};

/// The v0 services in one flavour; one value serves all three.
#[derive(Clone, Debug)]
pub struct V0 {
    p: Arc<Plugin>,
    v: ApiVersion,
}

impl V0 {
    /// `v` is [`ApiVersion::V0_3`] or [`ApiVersion::V0_2`].
    pub fn new(p: Arc<Plugin>, v: ApiVersion) -> Self {
        Self { p, v }
    }

    fn ctx(&self, method: &'static str) -> CallCtx {
        CallCtx::new(method, self.v)
    }

    async fn unimplemented<T: Send + 'static>(
        &self,
        method: &'static str,
        volume_id: &str,
        why: &'static str,
    ) -> Result<Response<T>, Status> {
        rpc::run(
            &self.p,
            self.ctx(method).volume(volume_id),
            move |_| async move { Err(Status::unimplemented(format!("{method}: {why}"))) },
        )
        .await
        .map(Response::new)
    }
}

/// Parses a v0 capability (see `v1::cap_from`).
pub fn cap_from(c: Option<pb::VolumeCapability>, v: ApiVersion) -> CapArg {
    use pb::volume_capability::AccessType as At;
    let c = c.ok_or_else(|| Status::invalid_argument("volume_capability is required"))?;
    let access = match c.access_type {
        Some(At::Mount(m)) => AccessType::Mount {
            fs_type: m.fs_type,
            mount_flags: m.mount_flags,
        },
        Some(At::Block(_)) => AccessType::Block,
        None => {
            return Err(Status::invalid_argument(
                "volume_capability.access_type (mount or block) is required",
            ));
        }
    };
    let mode = c
        .access_mode
        .and_then(|m| AccessMode::from_i32(m.mode, v))
        .ok_or_else(|| {
            Status::invalid_argument("volume_capability.access_mode is required and must be known")
        })?;
    Ok(Capability { access, mode })
}

fn caps_from(caps: Vec<pb::VolumeCapability>, v: ApiVersion) -> Vec<CapArg> {
    caps.into_iter().map(|c| cap_from(Some(c), v)).collect()
}

fn sorted(m: &std::collections::HashMap<String, String>) -> BTreeMap<String, String> {
    m.iter().map(|(k, v)| (k.clone(), v.clone())).collect()
}

#[tonic::async_trait]
impl Identity for V0 {
    async fn get_plugin_info(
        &self,
        _req: Request<pb::GetPluginInfoRequest>,
    ) -> Result<Response<pb::GetPluginInfoResponse>, Status> {
        let v = self.v;
        rpc::run(&self.p, self.ctx("GetPluginInfo"), move |p| async move {
            Ok(pb::GetPluginInfoResponse {
                name: p.plugin_name(v),
                vendor_version: p.vendor_version(),
                manifest: Default::default(),
            })
        })
        .await
        .map(Response::new)
    }

    async fn get_plugin_capabilities(
        &self,
        _req: Request<pb::GetPluginCapabilitiesRequest>,
    ) -> Result<Response<pb::GetPluginCapabilitiesResponse>, Status> {
        use pb::plugin_capability::{Service, Type};
        rpc::run(&self.p, self.ctx("GetPluginCapabilities"), |p| async move {
            Ok(pb::GetPluginCapabilitiesResponse {
                capabilities: p
                    .plugin_caps()
                    .into_iter()
                    .map(|t| pb::PluginCapability {
                        r#type: Some(Type::Service(Service { r#type: t })),
                    })
                    .collect(),
            })
        })
        .await
        .map(Response::new)
    }

    async fn probe(
        &self,
        _req: Request<pb::ProbeRequest>,
    ) -> Result<Response<pb::ProbeResponse>, Status> {
        let v = self.v;
        rpc::run(&self.p, self.ctx("Probe"), move |p| async move {
            Ok(pb::ProbeResponse { ready: p.probe(v)? })
        })
        .await
        .map(Response::new)
    }
}

#[tonic::async_trait]
impl Controller for V0 {
    async fn create_volume(
        &self,
        req: Request<pb::CreateVolumeRequest>,
    ) -> Result<Response<pb::CreateVolumeResponse>, Status> {
        let r = req.into_inner();
        let v = self.v;
        let ctx = self
            .ctx("CreateVolume")
            .volume(&r.name)
            .secrets(&self.p, &r.controller_create_secrets);
        rpc::run(&self.p, ctx, move |p| async move {
            let range = r.capacity_range.unwrap_or_default();
            let vol = p
                .create_volume(CreateArgs {
                    name: r.name,
                    required_bytes: range.required_bytes,
                    limit_bytes: range.limit_bytes,
                    capabilities: caps_from(r.volume_capabilities, v),
                    parameters: sorted(&r.parameters),
                    has_content_source: r.volume_content_source.is_some(),
                    content_source: None,
                    has_mutable_parameters: false,
                    accessibility: None,
                })
                .await?;
            Ok(pb::CreateVolumeResponse {
                volume: Some(pb::Volume {
                    capacity_bytes: vol.capacity_bytes,
                    id: vol.id,
                    attributes: vol.context,
                    content_source: None,
                    accessible_topology: Vec::new(),
                }),
            })
        })
        .await
        .map(Response::new)
    }

    async fn delete_volume(
        &self,
        req: Request<pb::DeleteVolumeRequest>,
    ) -> Result<Response<pb::DeleteVolumeResponse>, Status> {
        let r = req.into_inner();
        let ctx = self
            .ctx("DeleteVolume")
            .volume(&r.volume_id)
            .secrets(&self.p, &r.controller_delete_secrets);
        rpc::run(&self.p, ctx, move |p| async move {
            p.delete_volume(&r.volume_id).await?;
            Ok(pb::DeleteVolumeResponse {})
        })
        .await
        .map(Response::new)
    }

    async fn controller_publish_volume(
        &self,
        req: Request<pb::ControllerPublishVolumeRequest>,
    ) -> Result<Response<pb::ControllerPublishVolumeResponse>, Status> {
        let r = req.into_inner();
        let v = self.v;
        let ctx = self
            .ctx("ControllerPublishVolume")
            .volume(&r.volume_id)
            .target_node(&r.node_id)
            .secrets(&self.p, &r.controller_publish_secrets);
        rpc::run(&self.p, ctx, move |p| async move {
            let publish_info = p
                .controller_publish(
                    &r.volume_id,
                    &r.node_id,
                    cap_from(r.volume_capability, v),
                    r.readonly,
                )
                .await?;
            Ok(pb::ControllerPublishVolumeResponse { publish_info })
        })
        .await
        .map(Response::new)
    }

    async fn controller_unpublish_volume(
        &self,
        req: Request<pb::ControllerUnpublishVolumeRequest>,
    ) -> Result<Response<pb::ControllerUnpublishVolumeResponse>, Status> {
        let r = req.into_inner();
        let ctx = self
            .ctx("ControllerUnpublishVolume")
            .volume(&r.volume_id)
            .target_node(&r.node_id)
            .secrets(&self.p, &r.controller_unpublish_secrets);
        rpc::run(&self.p, ctx, move |p| async move {
            p.controller_unpublish(&r.volume_id, &r.node_id).await?;
            Ok(pb::ControllerUnpublishVolumeResponse {})
        })
        .await
        .map(Response::new)
    }

    async fn validate_volume_capabilities(
        &self,
        req: Request<pb::ValidateVolumeCapabilitiesRequest>,
    ) -> Result<Response<pb::ValidateVolumeCapabilitiesResponse>, Status> {
        let r = req.into_inner();
        let v = self.v;
        let ctx = self.ctx("ValidateVolumeCapabilities").volume(&r.volume_id);
        rpc::run(&self.p, ctx, move |p| async move {
            let answer =
                p.validate_capabilities(&r.volume_id, caps_from(r.volume_capabilities, v))?;
            Ok(match answer {
                Ok(_) => pb::ValidateVolumeCapabilitiesResponse {
                    supported: true,
                    message: String::new(),
                },
                Err(why) => pb::ValidateVolumeCapabilitiesResponse {
                    supported: false,
                    message: why.to_string(),
                },
            })
        })
        .await
        .map(Response::new)
    }

    async fn list_volumes(
        &self,
        req: Request<pb::ListVolumesRequest>,
    ) -> Result<Response<pb::ListVolumesResponse>, Status> {
        let r = req.into_inner();
        rpc::run(&self.p, self.ctx("ListVolumes"), move |p| async move {
            let (page, next_token) = p.list_volumes(r.max_entries, &r.starting_token)?;
            Ok(pb::ListVolumesResponse {
                entries: page
                    .into_iter()
                    .map(|v| pb::list_volumes_response::Entry {
                        volume: Some(pb::Volume {
                            capacity_bytes: v.info.capacity_bytes,
                            id: v.info.id,
                            attributes: v.info.context,
                            content_source: None,
                            accessible_topology: Vec::new(),
                        }),
                    })
                    .collect(),
                next_token,
            })
        })
        .await
        .map(Response::new)
    }

    async fn get_capacity(
        &self,
        req: Request<pb::GetCapacityRequest>,
    ) -> Result<Response<pb::GetCapacityResponse>, Status> {
        let r = req.into_inner();
        let v = self.v;
        rpc::run(&self.p, self.ctx("GetCapacity"), move |p| async move {
            Ok(pb::GetCapacityResponse {
                available_capacity: p.get_capacity(caps_from(r.volume_capabilities, v))?,
            })
        })
        .await
        .map(Response::new)
    }

    async fn controller_get_capabilities(
        &self,
        _req: Request<pb::ControllerGetCapabilitiesRequest>,
    ) -> Result<Response<pb::ControllerGetCapabilitiesResponse>, Status> {
        use pb::controller_service_capability::{Rpc, Type};
        let v = self.v;
        rpc::run(
            &self.p,
            self.ctx("ControllerGetCapabilities"),
            move |p| async move {
                Ok(pb::ControllerGetCapabilitiesResponse {
                    capabilities: p
                        .controller_caps(v)
                        .into_iter()
                        // Defensive: these two do not exist in the 0.x enum.
                        .filter(|t| {
                            *t != CAP_PUBLISH_READONLY && *t != CAP_LIST_VOLUMES_PUBLISHED_NODES
                        })
                        .map(|t| pb::ControllerServiceCapability {
                            r#type: Some(Type::Rpc(Rpc { r#type: t })),
                        })
                        .collect(),
                })
            },
        )
        .await
        .map(Response::new)
    }

    async fn create_snapshot(
        &self,
        req: Request<pb::CreateSnapshotRequest>,
    ) -> Result<Response<pb::CreateSnapshotResponse>, Status> {
        self.unimplemented(
            "CreateSnapshot",
            &req.get_ref().source_volume_id,
            "snapshots are not supported",
        )
        .await
    }

    async fn delete_snapshot(
        &self,
        _req: Request<pb::DeleteSnapshotRequest>,
    ) -> Result<Response<pb::DeleteSnapshotResponse>, Status> {
        self.unimplemented("DeleteSnapshot", "", "snapshots are not supported")
            .await
    }

    async fn list_snapshots(
        &self,
        _req: Request<pb::ListSnapshotsRequest>,
    ) -> Result<Response<pb::ListSnapshotsResponse>, Status> {
        self.unimplemented("ListSnapshots", "", "snapshots are not supported")
            .await
    }
}

#[tonic::async_trait]
impl Node for V0 {
    async fn node_stage_volume(
        &self,
        req: Request<pb::NodeStageVolumeRequest>,
    ) -> Result<Response<pb::NodeStageVolumeResponse>, Status> {
        let r = req.into_inner();
        let v = self.v;
        let ctx = self
            .ctx("NodeStageVolume")
            .volume(&r.volume_id)
            .secrets(&self.p, &r.node_stage_secrets);
        rpc::run(&self.p, ctx, move |p| async move {
            p.node_stage(
                &r.volume_id,
                &r.staging_target_path,
                cap_from(r.volume_capability, v),
            )
            .await?;
            Ok(pb::NodeStageVolumeResponse {})
        })
        .await
        .map(Response::new)
    }

    async fn node_unstage_volume(
        &self,
        req: Request<pb::NodeUnstageVolumeRequest>,
    ) -> Result<Response<pb::NodeUnstageVolumeResponse>, Status> {
        let r = req.into_inner();
        let ctx = self.ctx("NodeUnstageVolume").volume(&r.volume_id);
        rpc::run(&self.p, ctx, move |p| async move {
            p.node_unstage(&r.volume_id, &r.staging_target_path).await?;
            Ok(pb::NodeUnstageVolumeResponse {})
        })
        .await
        .map(Response::new)
    }

    async fn node_publish_volume(
        &self,
        req: Request<pb::NodePublishVolumeRequest>,
    ) -> Result<Response<pb::NodePublishVolumeResponse>, Status> {
        let r = req.into_inner();
        let v = self.v;
        let ctx = self
            .ctx("NodePublishVolume")
            .volume(&r.volume_id)
            .secrets(&self.p, &r.node_publish_secrets);
        rpc::run(&self.p, ctx, move |p| async move {
            p.node_publish(PublishArgs {
                volume_id: r.volume_id,
                target_path: r.target_path,
                staging_path: r.staging_target_path,
                capability: cap_from(r.volume_capability, v),
                readonly: r.readonly,
                version: v,
            })
            .await?;
            Ok(pb::NodePublishVolumeResponse {})
        })
        .await
        .map(Response::new)
    }

    async fn node_unpublish_volume(
        &self,
        req: Request<pb::NodeUnpublishVolumeRequest>,
    ) -> Result<Response<pb::NodeUnpublishVolumeResponse>, Status> {
        let r = req.into_inner();
        let v = self.v;
        let ctx = self.ctx("NodeUnpublishVolume").volume(&r.volume_id);
        rpc::run(&self.p, ctx, move |p| async move {
            p.node_unpublish(&r.volume_id, &r.target_path, v).await?;
            Ok(pb::NodeUnpublishVolumeResponse {})
        })
        .await
        .map(Response::new)
    }

    async fn node_get_id(
        &self,
        _req: Request<pb::NodeGetIdRequest>,
    ) -> Result<Response<pb::NodeGetIdResponse>, Status> {
        // The 0.2 RPC; 0.3 deprecated it but still has it.
        rpc::run(&self.p, self.ctx("NodeGetId"), |p| async move {
            Ok(pb::NodeGetIdResponse {
                node_id: p.node_id().to_owned(),
            })
        })
        .await
        .map(Response::new)
    }

    async fn node_get_capabilities(
        &self,
        _req: Request<pb::NodeGetCapabilitiesRequest>,
    ) -> Result<Response<pb::NodeGetCapabilitiesResponse>, Status> {
        use pb::node_service_capability::{Rpc, Type};
        rpc::run(&self.p, self.ctx("NodeGetCapabilities"), |p| async move {
            Ok(pb::NodeGetCapabilitiesResponse {
                capabilities: p
                    .node_caps()
                    .into_iter()
                    .filter(|t| *t != crate::plugin::expand::NODE_CAP_EXPAND_VOLUME)
                    .map(|t| pb::NodeServiceCapability {
                        r#type: Some(Type::Rpc(Rpc { r#type: t })),
                    })
                    .collect(),
            })
        })
        .await
        .map(Response::new)
    }

    async fn node_get_info(
        &self,
        _req: Request<pb::NodeGetInfoRequest>,
    ) -> Result<Response<pb::NodeGetInfoResponse>, Status> {
        if self.v == ApiVersion::V0_2 {
            // CSI 0.2 has no NodeGetInfo: a CO tells 0.2 from 0.3 by this.
            return self
                .unimplemented("NodeGetInfo", "", "not part of CSI 0.2; use NodeGetId")
                .await;
        }
        rpc::run(&self.p, self.ctx("NodeGetInfo"), |p| async move {
            Ok(pb::NodeGetInfoResponse {
                node_id: p.node_id().to_owned(),
                max_volumes_per_node: 0,
                accessible_topology: None,
            })
        })
        .await
        .map(Response::new)
    }
}
