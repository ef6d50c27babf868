//! The CSI v1 services (`csi.v1.Identity`, `csi.v1.Controller`,
//! `csi.v1.Node`): translation between `csi_proto::v1` messages and the core
//! [`Plugin`].
//!
//! Owns: v1 message shapes (capability lists, `Confirmed`, `VolumeStatus`,
//! Probe's `ready`) and which v1 RPCs are not implemented.
//!
//! Must not: hold CSI semantics of its own; every decision is the core's, so
//! that v1 and v0 behave the same.

use std::collections::BTreeMap;
use std::sync::Arc;

use csi_proto::v1 as pb;
use pb::controller_server::Controller;
use pb::identity_server::Identity;
use pb::node_server::Node;
use tonic::{Request, Response, Status};

use crate::model::{AccessMode, AccessType, ApiVersion, CapArg, Capability};
use crate::plugin::{CreateArgs, Plugin, PublishArgs, SnapshotArgs, SnapshotInfo};
use crate::rpc::{self, CallCtx};
use crate::state::ContentSource;
use crate::topology;

const V: ApiVersion = ApiVersion::V1;

/// The v1 services; one value serves all three.
#[derive(Clone, Debug)]
pub struct V1 {
    p: Arc<Plugin>,
}

impl V1 {
    pub fn new(p: Arc<Plugin>) -> Self {
        Self { p }
    }

    fn ctx(&self, method: &'static str) -> CallCtx {
        CallCtx::new(method, V)
    }

    /// Logs the call, applies faults, and answers UNIMPLEMENTED: for RPCs
    /// whose capability this plugin does not advertise (spec: "Unsupported
    /// RPCs SHOULD return an appropriate error code").
    async fn unimplemented<T: Send + 'static>(
        &self,
        method: &'static str,
        volume_id: &str,
    ) -> Result<Response<T>, Status> {
        rpc::run(
            &self.p,
            self.ctx(method).volume(volume_id),
            move |_| async move {
                Err(Status::unimplemented(format!(
                    "{method} is not implemented by this plugin"
                )))
            },
        )
        .await
        .map(Response::new)
    }
}

/// Parses a v1 capability; a missing one or a missing required part is
/// INVALID_ARGUMENT ("Missing required field").
pub fn cap_from(c: Option<pb::VolumeCapability>) -> CapArg {
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
        .and_then(|m| AccessMode::from_i32(m.mode, V))
        .ok_or_else(|| {
            Status::invalid_argument("volume_capability.access_mode is required and must be known")
        })?;
    Ok(Capability { access, mode })
}

fn caps_from(v: Vec<pb::VolumeCapability>) -> Vec<CapArg> {
    v.into_iter().map(|c| cap_from(Some(c))).collect()
}

fn sorted(m: &std::collections::HashMap<String, String>) -> BTreeMap<String, String> {
    m.iter().map(|(k, v)| (k.clone(), v.clone())).collect()
}

fn segments(t: &pb::Topology) -> topology::Segments {
    sorted(&t.segments)
}

fn topologies(node: &topology::Segments) -> Vec<pb::Topology> {
    topology::volume_topology(node)
        .into_iter()
        .map(|s| pb::Topology {
            segments: s.into_iter().collect(),
        })
        .collect()
}

fn requirements(r: &pb::TopologyRequirement) -> topology::Requirements {
    topology::Requirements {
        requisite: r.requisite.iter().map(segments).collect(),
        preferred: r.preferred.iter().map(segments).collect(),
    }
}

fn content_source_from(c: Option<pb::VolumeContentSource>) -> Option<ContentSource> {
    use pb::volume_content_source::Type;
    match c?.r#type? {
        Type::Snapshot(s) => Some(ContentSource::Snapshot(s.snapshot_id)),
        Type::Volume(v) => Some(ContentSource::Volume(v.volume_id)),
    }
}

fn content_source_to(c: Option<ContentSource>) -> Option<pb::VolumeContentSource> {
    use pb::volume_content_source::{SnapshotSource, Type, VolumeSource};
    Some(pb::VolumeContentSource {
        r#type: Some(match c? {
            ContentSource::Snapshot(snapshot_id) => Type::Snapshot(SnapshotSource { snapshot_id }),
            ContentSource::Volume(volume_id) => Type::Volume(VolumeSource { volume_id }),
        }),
    })
}

fn snapshot_to(s: SnapshotInfo) -> pb::Snapshot {
    let mut out = pb::Snapshot {
        size_bytes: s.size_bytes,
        snapshot_id: s.id,
        source_volume_id: s.source_volume_id,
        ready_to_use: s.ready_to_use,
        ..Default::default()
    };
    // The Timestamp type is named through the field, so that this crate
    // needs no prost-types of its own.
    let mut at = out.creation_time.take().unwrap_or_default();
    at.seconds = i64::try_from(s.creation_time_ns / 1_000_000_000).unwrap_or(i64::MAX);
    at.nanos = i32::try_from(s.creation_time_ns % 1_000_000_000).unwrap_or(0);
    out.creation_time = Some(at);
    out
}

fn rpc_caps<T>(caps: Vec<i32>, make: impl Fn(i32) -> T) -> Vec<T> {
    caps.into_iter().map(make).collect()
}

#[tonic::async_trait]
impl Identity for V1 {
    async fn get_plugin_info(
        &self,
        _req: Request<pb::GetPluginInfoRequest>,
    ) -> Result<Response<pb::GetPluginInfoResponse>, Status> {
        rpc::run(&self.p, self.ctx("GetPluginInfo"), |p| async move {
            Ok(pb::GetPluginInfoResponse {
                name: p.plugin_name(V),
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
                capabilities: rpc_caps(p.plugin_caps(), |t| pb::PluginCapability {
                    r#type: Some(Type::Service(Service { r#type: t })),
                })
                .into_iter()
                .chain(p.expansion_type().map(|t| pb::PluginCapability {
                    r#type: Some(Type::VolumeExpansion(
                        pb::plugin_capability::VolumeExpansion { r#type: t },
                    )),
                }))
                .chain(
                    (!p.config().topology.is_empty()).then_some(pb::PluginCapability {
                        r#type: Some(Type::Service(Service {
                            r#type: crate::plugin::PLUGIN_CAP_VOLUME_ACCESSIBILITY_CONSTRAINTS,
                        })),
                    }),
                )
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
        rpc::run(&self.p, self.ctx("Probe"), |p| async move {
            Ok(pb::ProbeResponse { ready: p.probe(V)? })
        })
        .await
        .map(Response::new)
    }
}

#[tonic::async_trait]
impl Controller for V1 {
    async fn create_volume(
        &self,
        req: Request<pb::CreateVolumeRequest>,
    ) -> Result<Response<pb::CreateVolumeResponse>, Status> {
        let r = req.into_inner();
        let asked = r.accessibility_requirements.as_ref().map(requirements);
        let ctx =
            self.ctx("CreateVolume")
                .volume(&r.name)
                .secrets(&self.p, &r.secrets)
                .topology(asked.as_ref().map(
                    |a| serde_json::json!({"requisite": a.requisite, "preferred": a.preferred}),
                ));
        rpc::run(&self.p, ctx, move |p| async move {
            let range = r.capacity_range.unwrap_or_default();
            let v = p
                .create_volume(CreateArgs {
                    name: r.name,
                    required_bytes: range.required_bytes,
                    limit_bytes: range.limit_bytes,
                    capabilities: caps_from(r.volume_capabilities),
                    parameters: sorted(&r.parameters),
                    has_content_source: r.volume_content_source.is_some(),
                    content_source: content_source_from(r.volume_content_source),
                    has_mutable_parameters: !r.mutable_parameters.is_empty(),
                    accessibility: asked,
                })
                .await?;
            Ok(pb::CreateVolumeResponse {
                volume: Some(pb::Volume {
                    capacity_bytes: v.capacity_bytes,
                    volume_id: v.id,
                    volume_context: v.context,
                    content_source: content_source_to(v.content_source),
                    // "accessible_topology ... Specifies where (regions,
                    // zones, racks, etc.) the provisioned volume is
                    // accessible from."
                    accessible_topology: topologies(&p.config().topology),
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
            .secrets(&self.p, &r.secrets);
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
        let ctx = self
            .ctx("ControllerPublishVolume")
            .volume(&r.volume_id)
            .target_node(&r.node_id)
            .secrets(&self.p, &r.secrets);
        rpc::run(&self.p, ctx, move |p| async move {
            let publish_context = p
                .controller_publish(
                    &r.volume_id,
                    &r.node_id,
                    cap_from(r.volume_capability),
                    r.readonly,
                )
                .await?;
            Ok(pb::ControllerPublishVolumeResponse { publish_context })
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
            .secrets(&self.p, &r.secrets);
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
        let ctx = self
            .ctx("ValidateVolumeCapabilities")
            .volume(&r.volume_id)
            .secrets(&self.p, &r.secrets);
        rpc::run(&self.p, ctx, move |p| async move {
            let asked = r.volume_capabilities.clone();
            Ok(
                match p.validate_capabilities(&r.volume_id, caps_from(r.volume_capabilities))? {
                    // The CO compares what was confirmed with what it asked,
                    // so echo the request's own capabilities.
                    Ok(_) => pb::ValidateVolumeCapabilitiesResponse {
                        confirmed: Some(pb::validate_volume_capabilities_response::Confirmed {
                            volume_context: r.volume_context,
                            volume_capabilities: asked,
                            parameters: r.parameters,
                            mutable_parameters: Default::default(),
                        }),
                        message: String::new(),
                    },
                    Err(why) => pb::ValidateVolumeCapabilitiesResponse {
                        confirmed: None,
                        message: why.to_string(),
                    },
                },
            )
        })
        .await
        .map(Response::new)
    }

    async fn list_volumes(
        &self,
        req: Request<pb::ListVolumesRequest>,
    ) -> Result<Response<pb::ListVolumesResponse>, Status> {
        use pb::list_volumes_response::{Entry, VolumeStatus};
        let r = req.into_inner();
        rpc::run(&self.p, self.ctx("ListVolumes"), move |p| async move {
            let (page, next_token) = p.list_volumes(r.max_entries, &r.starting_token)?;
            // Status is REQUIRED with LIST_VOLUMES_PUBLISHED_NODES, which is
            // advertised together with PUBLISH_UNPUBLISH_VOLUME.
            let with_status = p.config().controller_publish;
            Ok(pb::ListVolumesResponse {
                entries: page
                    .into_iter()
                    .map(|v| Entry {
                        volume: Some(pb::Volume {
                            capacity_bytes: v.info.capacity_bytes,
                            volume_id: v.info.id,
                            volume_context: v.info.context,
                            content_source: content_source_to(v.info.content_source),
                            accessible_topology: topologies(&p.config().topology),
                        }),
                        status: with_status.then_some(VolumeStatus {
                            published_node_ids: v.published_nodes,
                            volume_condition: None,
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
        let wanted = r.accessible_topology.as_ref().map(segments);
        let ctx = self.ctx("GetCapacity").topology(
            wanted
                .as_ref()
                .map(|t| serde_json::json!({ "accessible_topology": t })),
        );
        rpc::run(&self.p, ctx, move |p| async move {
            let free = p.get_capacity(caps_from(r.volume_capabilities))?;
            Ok(pb::GetCapacityResponse {
                available_capacity: topology::capacity_in(
                    &p.config().topology,
                    wanted.as_ref(),
                    free,
                ),
                maximum_volume_size: None,
                minimum_volume_size: None,
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
        rpc::run(
            &self.p,
            self.ctx("ControllerGetCapabilities"),
            |p| async move {
                Ok(pb::ControllerGetCapabilitiesResponse {
                    capabilities: rpc_caps(p.controller_caps(V), |t| {
                        pb::ControllerServiceCapability {
                            r#type: Some(Type::Rpc(Rpc { r#type: t })),
                        }
                    }),
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
        if !self.p.config().snapshots {
            return self
                .unimplemented("CreateSnapshot", &req.get_ref().source_volume_id)
                .await;
        }
        let r = req.into_inner();
        let ctx = self
            .ctx("CreateSnapshot")
            .volume(&r.source_volume_id)
            .secrets(&self.p, &r.secrets);
        rpc::run(&self.p, ctx, move |p| async move {
            let s = p
                .create_snapshot(SnapshotArgs {
                    name: r.name,
                    source_volume_id: r.source_volume_id,
                    parameters: sorted(&r.parameters),
                })
                .await?;
            Ok(pb::CreateSnapshotResponse {
                snapshot: Some(snapshot_to(s)),
            })
        })
        .await
        .map(Response::new)
    }

    async fn delete_snapshot(
        &self,
        req: Request<pb::DeleteSnapshotRequest>,
    ) -> Result<Response<pb::DeleteSnapshotResponse>, Status> {
        if !self.p.config().snapshots {
            return self.unimplemented("DeleteSnapshot", "").await;
        }
        let r = req.into_inner();
        let ctx = self.ctx("DeleteSnapshot").secrets(&self.p, &r.secrets);
        rpc::run(&self.p, ctx, move |p| async move {
            p.delete_snapshot(&r.snapshot_id).await?;
            Ok(pb::DeleteSnapshotResponse {})
        })
        .await
        .map(Response::new)
    }

    async fn list_snapshots(
        &self,
        req: Request<pb::ListSnapshotsRequest>,
    ) -> Result<Response<pb::ListSnapshotsResponse>, Status> {
        if !self.p.config().snapshots {
            return self.unimplemented("ListSnapshots", "").await;
        }
        let r = req.into_inner();
        let ctx = self
            .ctx("ListSnapshots")
            .volume(&r.source_volume_id)
            .secrets(&self.p, &r.secrets);
        rpc::run(&self.p, ctx, move |p| async move {
            let (page, next_token) = p.list_snapshots(
                r.max_entries,
                &r.starting_token,
                &r.snapshot_id,
                &r.source_volume_id,
            )?;
            Ok(pb::ListSnapshotsResponse {
                entries: page
                    .into_iter()
                    .map(|s| pb::list_snapshots_response::Entry {
                        snapshot: Some(snapshot_to(s)),
                    })
                    .collect(),
                next_token,
            })
        })
        .await
        .map(Response::new)
    }

    async fn get_snapshot(
        &self,
        _req: Request<pb::GetSnapshotRequest>,
    ) -> Result<Response<pb::GetSnapshotResponse>, Status> {
        self.unimplemented("GetSnapshot", "").await
    }

    async fn controller_expand_volume(
        &self,
        req: Request<pb::ControllerExpandVolumeRequest>,
    ) -> Result<Response<pb::ControllerExpandVolumeResponse>, Status> {
        let r = req.into_inner();
        let ctx = self
            .ctx("ControllerExpandVolume")
            .volume(&r.volume_id)
            .secrets(&self.p, &r.secrets);
        rpc::run(&self.p, ctx, move |p| async move {
            let range = r.capacity_range.map(|c| (c.required_bytes, c.limit_bytes));
            let (capacity_bytes, node_expansion_required) =
                p.controller_expand(&r.volume_id, range).await?;
            Ok(pb::ControllerExpandVolumeResponse {
                capacity_bytes,
                node_expansion_required,
            })
        })
        .await
        .map(Response::new)
    }

    async fn controller_get_volume(
        &self,
        req: Request<pb::ControllerGetVolumeRequest>,
    ) -> Result<Response<pb::ControllerGetVolumeResponse>, Status> {
        use pb::controller_get_volume_response::VolumeStatus;
        if !self.p.config().get_volume {
            return self
                .unimplemented("ControllerGetVolume", &req.get_ref().volume_id)
                .await;
        }
        let r = req.into_inner();
        let ctx = self.ctx("ControllerGetVolume").volume(&r.volume_id);
        rpc::run(&self.p, ctx, move |p| async move {
            let v = p.get_volume(&r.volume_id)?;
            Ok(pb::ControllerGetVolumeResponse {
                volume: Some(pb::Volume {
                    capacity_bytes: v.info.capacity_bytes,
                    volume_id: v.info.id,
                    volume_context: v.info.context,
                    content_source: None,
                    accessible_topology: topologies(&p.config().topology),
                }),
                // "status ... This field is REQUIRED."; published_node_ids
                // "MUST be specified if the PUBLISH_UNPUBLISH_VOLUME
                // controller capability is supported by the SP."
                // "This field MUST be specified if the VOLUME_CONDITION controller capability
                // is supported by the SP" (advertised with --get-volume --volume-condition).
                status: Some(VolumeStatus {
                    published_node_ids: v.published_nodes,
                    volume_condition: p.config().volume_condition.then(|| {
                        match p.faults().abnormal(&r.volume_id) {
                            Some(message) => pb::VolumeCondition {
                                abnormal: true,
                                message,
                            },
                            None => pb::VolumeCondition {
                                abnormal: false,
                                message: String::new(),
                            },
                        }
                    }),
                }),
            })
        })
        .await
        .map(Response::new)
    }

    async fn controller_modify_volume(
        &self,
        req: Request<pb::ControllerModifyVolumeRequest>,
    ) -> Result<Response<pb::ControllerModifyVolumeResponse>, Status> {
        self.unimplemented("ControllerModifyVolume", &req.get_ref().volume_id)
            .await
    }
}

#[tonic::async_trait]
impl Node for V1 {
    async fn node_stage_volume(
        &self,
        req: Request<pb::NodeStageVolumeRequest>,
    ) -> Result<Response<pb::NodeStageVolumeResponse>, Status> {
        let r = req.into_inner();
        let ctx = self
            .ctx("NodeStageVolume")
            .volume(&r.volume_id)
            .secrets(&self.p, &r.secrets);
        rpc::run(&self.p, ctx, move |p| async move {
            p.node_stage(
                &r.volume_id,
                &r.staging_target_path,
                cap_from(r.volume_capability),
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
        let ctx = self
            .ctx("NodePublishVolume")
            .volume(&r.volume_id)
            .secrets(&self.p, &r.secrets);
        rpc::run(&self.p, ctx, move |p| async move {
            p.node_publish(PublishArgs {
                volume_id: r.volume_id,
                target_path: r.target_path,
                staging_path: r.staging_target_path,
                capability: cap_from(r.volume_capability),
                readonly: r.readonly,
                version: V,
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
        let ctx = self.ctx("NodeUnpublishVolume").volume(&r.volume_id);
        rpc::run(&self.p, ctx, move |p| async move {
            p.node_unpublish(&r.volume_id, &r.target_path, V).await?;
            Ok(pb::NodeUnpublishVolumeResponse {})
        })
        .await
        .map(Response::new)
    }

    async fn node_get_volume_stats(
        &self,
        req: Request<pb::NodeGetVolumeStatsRequest>,
    ) -> Result<Response<pb::NodeGetVolumeStatsResponse>, Status> {
        if !self.p.config().volume_stats {
            return self
                .unimplemented("NodeGetVolumeStats", &req.get_ref().volume_id)
                .await;
        }
        let r = req.into_inner();
        let ctx = self.ctx("NodeGetVolumeStats").volume(&r.volume_id);
        rpc::run(&self.p, ctx, move |p| async move {
            use pb::volume_usage::Unit;
            let s =
                p.node_get_volume_stats(&r.volume_id, &r.volume_path, &r.staging_target_path)?;
            let usage = |u: crate::stats::Usage, unit: Unit| pb::VolumeUsage {
                available: u.available,
                total: u.total,
                used: u.used,
                unit: unit as i32,
            };
            Ok(pb::NodeGetVolumeStatsResponse {
                usage: vec![usage(s.bytes, Unit::Bytes), usage(s.inodes, Unit::Inodes)],
                volume_condition: s
                    .condition
                    .map(|(abnormal, message)| pb::VolumeCondition { abnormal, message }),
            })
        })
        .await
        .map(Response::new)
    }

    async fn node_expand_volume(
        &self,
        req: Request<pb::NodeExpandVolumeRequest>,
    ) -> Result<Response<pb::NodeExpandVolumeResponse>, Status> {
        let r = req.into_inner();
        let ctx = self
            .ctx("NodeExpandVolume")
            .volume(&r.volume_id)
            .secrets(&self.p, &r.secrets);
        rpc::run(&self.p, ctx, move |p| async move {
            let range = r.capacity_range.map(|c| (c.required_bytes, c.limit_bytes));
            let capacity_bytes = p
                .node_expand(&r.volume_id, &r.volume_path, &r.staging_target_path, range)
                .await?;
            Ok(pb::NodeExpandVolumeResponse { capacity_bytes })
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
                capabilities: rpc_caps(p.node_caps(), |t| pb::NodeServiceCapability {
                    r#type: Some(Type::Rpc(Rpc { r#type: t })),
                }),
            })
        })
        .await
        .map(Response::new)
    }

    async fn node_get_info(
        &self,
        _req: Request<pb::NodeGetInfoRequest>,
    ) -> Result<Response<pb::NodeGetInfoResponse>, Status> {
        rpc::run(&self.p, self.ctx("NodeGetInfo"), |p| async move {
            Ok(pb::NodeGetInfoResponse {
                node_id: p.node_id().to_owned(),
                max_volumes_per_node: p.config().max_volumes_per_node,
                // "accessible_topology ... Specifies where (regions, zones,
                // racks, etc.) the node is accessible from."
                accessible_topology: topologies(&p.config().topology).into_iter().next(),
            })
        })
        .await
        .map(Response::new)
    }
}
