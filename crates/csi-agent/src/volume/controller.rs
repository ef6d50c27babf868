//! Controller-side operations (the Mesos SLRP's part): create, delete, validate, list and
//! capacity. Create and delete retry transient errors with backoff (MESOS-9517); a created
//! volume gets a record so that a later publish uses the context returned at creation.
//!
//! This module only speaks to the Controller service and keeps the records of created
//! volumes; node-side work stays in the volume manager proper.

use std::collections::{BTreeMap, BTreeSet};
use std::future::Future;
use std::time::Instant;

use csi_proto::v1;

use super::refusal::{Conflict, InvalidRequest, ProtocolViolation};
use super::{
    Admission, Capability, Origin, VolumeError, VolumeManager, VolumeRecord, VolumeState, check_id,
    retry_transient_except, to_hash_map, validate_id,
};
use crate::client::{CsiClient, RpcError};
use crate::config::Service;
use v1::controller_service_capability::rpc::Type as ControllerCap;

/// A volume created through csi-agent.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CreatedVolume {
    pub volume_id: String,
    pub capacity_bytes: i64,
    pub volume_context: BTreeMap<String, String>,
    /// Where the plugin says the volume is accessible from (empty: not said).
    pub accessible_topology: Vec<BTreeMap<String, String>>,
}

/// A CreateVolume as csi-agent sends it: the fields of CreateVolumeRequest it fills.
#[derive(Clone, Debug)]
pub struct NewVolume<'a> {
    /// The CSI name: the idempotency key.
    pub name: &'a str,
    /// `required_bytes` (0: the plugin's default).
    pub capacity_bytes: i64,
    pub capability: &'a Capability,
    pub parameters: BTreeMap<String, String>,
    pub secrets: BTreeMap<String, String>,
    pub accessibility: Option<&'a super::topology::Requirements>,
    /// A snapshot to restore or a volume to clone.
    pub content_source: Option<super::snapshot::ContentSource>,
}

impl<'a> NewVolume<'a> {
    /// A volume of `capacity_bytes` with this capability, no parameters, secrets, topology or
    /// source.
    pub fn new(name: &'a str, capacity_bytes: i64, capability: &'a Capability) -> Self {
        Self {
            name,
            capacity_bytes,
            capability,
            parameters: BTreeMap::new(),
            secrets: BTreeMap::new(),
            accessibility: None,
            content_source: None,
        }
    }
}

/// One page of the plugin's volumes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VolumePage {
    pub volumes: Vec<CreatedVolume>,
    pub next_token: String,
}

/// The answer of ValidateVolumeCapabilities.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Validation {
    pub confirmed: bool,
    pub message: String,
}

impl VolumeManager {
    /// One Controller RPC, retried on transient errors (except `final_codes`) with backoff
    /// until the operation timeout, waiting for the plugin through its restarts.
    pub(super) async fn controller_rpc<Req, T, F, Fut>(
        &self,
        final_codes: &[tonic::Code],
        request: Req,
        call: F,
    ) -> Result<T, VolumeError>
    where
        Req: Clone,
        F: Fn(CsiClient, Req) -> Fut,
        Fut: Future<Output = Result<T, RpcError>>,
    {
        let deadline = Instant::now() + self.inner.config.operation_timeout;
        let endpoints = &self.inner.endpoints;
        retry_transient_except(self.inner.config.retry, deadline, final_codes, || {
            let request = request.clone();
            let call = &call;
            async move {
                let client = endpoints.client(Service::Controller).await?;
                call(client, request).await
            }
        })
        .await
    }

    fn require_controller(&self) -> Result<(), VolumeError> {
        if self.inner.endpoints.serves(Service::Controller) {
            Ok(())
        } else {
            Err(InvalidRequest::NoController {
                plugin: self.inner.config.plugin_type.clone(),
            }
            .into())
        }
    }

    /// CreateVolume, idempotent by name (the plugin guarantees it; retries rely on it). A
    /// `content_source` (a snapshot to restore, a volume to clone) is refused before any RPC
    /// when the plugin lacks the capability it needs (`volume::snapshot`).
    pub async fn create_volume(&self, new: NewVolume<'_>) -> Result<CreatedVolume, VolumeError> {
        let content_source = match new.content_source.clone() {
            None => None,
            Some(source) => Some(self.content_source(source).await?),
        };
        self.send_create_volume(&new, content_source).await
    }

    async fn send_create_volume(
        &self,
        new: &NewVolume<'_>,
        content_source: Option<v1::VolumeContentSource>,
    ) -> Result<CreatedVolume, VolumeError> {
        let NewVolume {
            name,
            capacity_bytes,
            capability,
            ref parameters,
            ref secrets,
            accessibility,
            ..
        } = *new;
        validate_id("name", name)?;
        if capacity_bytes < 0 {
            return Err(InvalidRequest::NegativeCapacity(capacity_bytes).into());
        }
        self.require_controller()?;
        let _ticket = self.enter(name, "create", Admission::Request)?;
        let accessibility_requirements = self.accessibility_for(accessibility).await?;
        let request = v1::CreateVolumeRequest {
            name: name.to_owned(),
            capacity_range: (capacity_bytes > 0).then_some(v1::CapacityRange {
                required_bytes: capacity_bytes,
                limit_bytes: 0,
            }),
            volume_capabilities: vec![capability.to_v1()],
            parameters: to_hash_map(parameters),
            secrets: to_hash_map(secrets),
            accessibility_requirements,
            volume_content_source: content_source,
            ..Default::default()
        };
        // With topology requirements, RESOURCE_EXHAUSTED is the spec's "Unable to provision
        // in `accessible_topology`": the requirements exclude what the plugin serves, and
        // asking again cannot change that.
        let final_codes: &[tonic::Code] = if request.accessibility_requirements.is_some() {
            &[tonic::Code::ResourceExhausted]
        } else {
            &[]
        };
        let response = self
            .controller_rpc(final_codes, request, |client, request| async move {
                client.create_volume(request).await
            })
            .await?;
        let Some(volume) = response.volume else {
            return Err(ProtocolViolation::NoVolume.into());
        };
        if volume.volume_id.is_empty() {
            return Err(ProtocolViolation::EmptyVolumeId.into());
        }
        check_id("volume_id returned by CreateVolume", &volume.volume_id)
            .map_err(ProtocolViolation::BadVolumeId)?;
        let created = CreatedVolume {
            volume_id: volume.volume_id.clone(),
            capacity_bytes: volume.capacity_bytes,
            volume_context: volume.volume_context.into_iter().collect(),
            accessible_topology: topologies(&volume.accessible_topology),
        };
        let slot = self.slot(&created.volume_id);
        let mut guard = slot.lock().await;
        let mut record = guard
            .record
            .as_deref()
            .cloned()
            .unwrap_or_else(|| VolumeRecord::new(&created.volume_id, Origin::Created));
        record.origin = Origin::Created;
        record.capacity_bytes = created.capacity_bytes;
        record
            .accessible_topology
            .clone_from(&created.accessible_topology);
        if record.claims.is_empty() && record.state == VolumeState::Created {
            record.volume_context = created.volume_context.clone();
        }
        self.persist(&mut guard, record).await?;
        Ok(created)
    }

    /// DeleteVolume. Refused while the volume is claimed or anything is left on this node.
    pub async fn delete_volume(
        &self,
        volume_id: &str,
        secrets: BTreeMap<String, String>,
    ) -> Result<(), VolumeError> {
        validate_id("volume_id", volume_id)?;
        self.require_controller()?;
        let _ticket = self.enter(volume_id, "delete", Admission::Request)?;
        let slot = self.slot(volume_id);
        let mut guard = slot.lock().await;
        if let Some(record) = &guard.record
            && (!record.claims.is_empty() || record.state != VolumeState::Created)
        {
            return Err(Conflict::DeleteInUse {
                volume_id: volume_id.to_owned(),
                state: record.state.as_str(),
                claims: record.claims.len(),
            }
            .into());
        }
        // A cluster plugin's volume may be held on another node, which this node's records
        // do not know: the deletion mark (cluster::deleting) refuses then, and keeps new
        // claims out until the RPC answered.
        let mark = match self.cluster() {
            Some((cluster, plugin)) => {
                Some((cluster, cluster.begin_delete(&plugin, volume_id).await?))
            }
            None => None,
        };
        let request = v1::DeleteVolumeRequest {
            volume_id: volume_id.to_owned(),
            secrets: to_hash_map(&secrets),
        };
        let deleted = self
            .controller_rpc(&[], request, |client, request| async move {
                client.delete_volume(request).await
            })
            .await;
        if let Some((cluster, mark)) = mark {
            cluster.end_delete(mark).await;
        }
        deleted?;
        if guard.record.is_some() {
            self.forget(&mut guard, volume_id).await?;
        }
        self.cleanup_mount_dir(volume_id);
        Ok(())
    }

    pub async fn validate_volume_capabilities(
        &self,
        volume_id: &str,
        capabilities: &[Capability],
        volume_context: BTreeMap<String, String>,
        parameters: BTreeMap<String, String>,
    ) -> Result<Validation, VolumeError> {
        validate_id("volume_id", volume_id)?;
        if capabilities.is_empty() {
            return Err(InvalidRequest::NoCapabilities.into());
        }
        self.require_controller()?;
        let _ticket = self.enter(volume_id, "validate", Admission::Request)?;
        let request = v1::ValidateVolumeCapabilitiesRequest {
            volume_id: volume_id.to_owned(),
            volume_context: to_hash_map(&volume_context),
            volume_capabilities: capabilities.iter().map(Capability::to_v1).collect(),
            parameters: to_hash_map(&parameters),
            ..Default::default()
        };
        let response = self
            .controller_rpc(&[], request, |client, request| async move {
                client.validate_volume_capabilities(request).await
            })
            .await?;
        Ok(Validation {
            confirmed: response.confirmed.is_some(),
            message: response.message,
        })
    }

    /// ListVolumes, one page. Duplicate entries from the plugin are dropped (MESOS-9956).
    pub async fn list_backend_volumes(
        &self,
        max_entries: i32,
        starting_token: &str,
    ) -> Result<VolumePage, VolumeError> {
        if max_entries < 0 {
            return Err(InvalidRequest::NegativeMaxEntries(max_entries).into());
        }
        self.require_controller()?;
        self.require_controller_cap(ControllerCap::ListVolumes, "listing volumes")
            .await?;
        let _ticket = self.enter("", "list_volumes", Admission::Request)?;
        let request = v1::ListVolumesRequest {
            max_entries,
            starting_token: starting_token.to_owned(),
        };
        // "ABORTED: Indicates that starting_token is not valid": final here.
        let response = self
            .controller_rpc(
                &[tonic::Code::Aborted],
                request,
                |client, request| async move { client.list_volumes(request).await },
            )
            .await?;
        let mut seen = BTreeSet::new();
        let mut volumes = Vec::new();
        for entry in response.entries {
            let Some(volume) = entry.volume else { continue };
            if !seen.insert(volume.volume_id.clone()) {
                tracing::warn!(
                    plugin = %self.inner.config.plugin_type,
                    volume_id = ?volume.volume_id,
                    "plugin listed a volume twice; ignoring the duplicate"
                );
                continue;
            }
            volumes.push(CreatedVolume {
                volume_id: volume.volume_id,
                capacity_bytes: volume.capacity_bytes,
                volume_context: volume.volume_context.into_iter().collect(),
                accessible_topology: topologies(&volume.accessible_topology),
            });
        }
        Ok(VolumePage {
            volumes,
            next_token: response.next_token,
        })
    }

    /// GetCapacity for the given capabilities and parameters.
    pub async fn get_capacity(
        &self,
        capabilities: &[Capability],
        parameters: BTreeMap<String, String>,
        accessible_topology: Option<&BTreeMap<String, String>>,
    ) -> Result<i64, VolumeError> {
        self.require_controller()?;
        self.require_controller_cap(ControllerCap::GetCapacity, "asking capacity")
            .await?;
        let accessible_topology = self.capacity_topology(accessible_topology).await?;
        let _ticket = self.enter("", "capacity", Admission::Request)?;
        let request = v1::GetCapacityRequest {
            volume_capabilities: capabilities.iter().map(Capability::to_v1).collect(),
            parameters: to_hash_map(&parameters),
            accessible_topology,
        };
        let response = self
            .controller_rpc(&[], request, |client, request| async move {
                client.get_capacity(request).await
            })
            .await?;
        Ok(response.available_capacity)
    }
}

/// A response's topologies as segment maps (empty ones dropped).
fn topologies(topologies: &[v1::Topology]) -> Vec<BTreeMap<String, String>> {
    topologies
        .iter()
        .map(|t| {
            t.segments
                .iter()
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect()
        })
        .filter(|s: &BTreeMap<String, String>| !s.is_empty())
        .collect()
}
