//! The version-neutral CSI client.
//!
//! One internal, v1-shaped model — the CSI v1 message types of `csi_proto::v1` — is what the
//! rest of the engine speaks. [`CsiClient`] detects which CSI version a plugin serves (probe v1,
//! fall back to v0 only on `UNIMPLEMENTED`, then tell 0.3 from 0.2) and, for v0 plugins,
//! translates every request and response through the adapter in [`v0`].
//!
//! Every call has a deadline and is measured (latency by plugin, method and code). This module
//! never retries and never decides what an error means for a volume: it reports the error with
//! its class ([`ErrorClass`]) and leaves the decision to its callers.

mod error;
pub mod expand;
pub mod stats;
mod topology;
pub use topology::NodeDescription;
mod snapshot;
pub mod v0;

use std::collections::BTreeSet;
use std::future::Future;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use csi_proto::v1;
use hyper_util::rt::TokioIo;
use tonic::transport::{Channel, Endpoint, Uri};

pub use error::{
    EndpointError, ErrorClass, RpcError, RpcErrorKind, classify, code_name, parse_endpoint,
};

use crate::metrics::{MethodLabels, Metrics};

/// The CSI version a plugin speaks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum CsiVersion {
    #[serde(rename = "v1")]
    V1,
    #[serde(rename = "v0.3")]
    V0_3,
    #[serde(rename = "v0.2")]
    V0_2,
}

impl CsiVersion {
    pub fn as_str(self) -> &'static str {
        match self {
            CsiVersion::V1 => "v1",
            CsiVersion::V0_3 => "v0.3",
            CsiVersion::V0_2 => "v0.2",
        }
    }

    pub fn is_v0(self) -> bool {
        !matches!(self, CsiVersion::V1)
    }
}

impl std::fmt::Display for CsiVersion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Settings of one client.
#[derive(Clone, Debug)]
pub struct ClientOptions {
    /// Deadline of every RPC. An RPC without an answer by then fails with
    /// [`RpcErrorKind::DeadlineExceeded`] (transient and uncertain).
    pub rpc_deadline: Duration,
    /// The plugin's name in metric labels (its type).
    pub plugin: String,
    pub metrics: Option<Arc<Metrics>>,
}

impl Default for ClientOptions {
    fn default() -> Self {
        Self {
            rpc_deadline: Duration::from_secs(10),
            plugin: String::new(),
            metrics: None,
        }
    }
}

/// Plugin services advertised by `GetPluginCapabilities`.
pub type PluginServices = BTreeSet<v1::plugin_capability::service::Type>;

/// `GetPluginCapabilities`, folded: the services and the `VolumeExpansion` type (`None`: not
/// advertised, and always on CSI 0.x, which has no such capability).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PluginCapabilities {
    pub services: PluginServices,
    pub volume_expansion: Option<v1::plugin_capability::volume_expansion::Type>,
}
/// RPCs advertised by `ControllerGetCapabilities`.
pub type ControllerCapabilities = BTreeSet<v1::controller_service_capability::rpc::Type>;
/// RPCs advertised by `NodeGetCapabilities`.
pub type NodeCapabilities = BTreeSet<v1::node_service_capability::rpc::Type>;

/// A connection to one plugin endpoint, with its detected version. Cheap to clone; clones
/// share the connection.
#[derive(Clone, Debug)]
pub struct CsiClient {
    channel: Channel,
    version: CsiVersion,
    socket: Arc<PathBuf>,
    options: Arc<ClientOptions>,
}

/// Opens a lazy channel to a unix socket. The channel reconnects on its own after the plugin
/// restarts on the same path.
pub fn unix_channel(socket: &Path) -> Channel {
    let socket = socket.to_path_buf();
    // The URI is required by tonic but never resolved: the connector below ignores it.
    Endpoint::from_static("http://csi.plugin").connect_with_connector_lazy(tower::service_fn(
        move |_: Uri| {
            let socket = socket.clone();
            async move {
                let stream = tokio::net::UnixStream::connect(socket).await?;
                Ok::<_, std::io::Error>(TokioIo::new(stream))
            }
        },
    ))
}

impl CsiClient {
    /// Connects to the plugin at `socket` and detects its CSI version.
    pub async fn connect(socket: &Path, options: ClientOptions) -> Result<Self, RpcError> {
        Ok(Self::connect_and_probe(socket, options).await?.0)
    }

    /// Like [`CsiClient::connect`], also returning whether the detection's `Probe` answered
    /// ready, so that a supervisor needs no second Probe when it did.
    pub async fn connect_and_probe(
        socket: &Path,
        options: ClientOptions,
    ) -> Result<(Self, bool), RpcError> {
        let channel = unix_channel(socket);
        let mut client = Self {
            channel,
            version: CsiVersion::V1,
            socket: Arc::new(socket.to_path_buf()),
            options: Arc::new(options),
        };
        let (version, ready) = client.detect().await?;
        client.version = version;
        Ok((client, ready))
    }

    /// A client for a plugin whose version is already known (e.g. recorded at an earlier
    /// probe): no RPC is made.
    pub fn with_version(socket: &Path, version: CsiVersion, options: ClientOptions) -> Self {
        Self {
            channel: unix_channel(socket),
            version,
            socket: Arc::new(socket.to_path_buf()),
            options: Arc::new(options),
        }
    }

    pub fn version(&self) -> CsiVersion {
        self.version
    }

    pub fn socket(&self) -> &Path {
        &self.socket
    }

    pub fn options(&self) -> &ClientOptions {
        &self.options
    }

    /// Detects the version again, without changing this client. Supervisors call it on every
    /// re-probe: a plugin that changes version between probes is an error.
    ///
    /// Probe v1 first and fall back to v0 only on `UNIMPLEMENTED` (any other error is
    /// reported, since the plugin may simply not be up yet). For v0, CSI 0.3 has `NodeGetInfo`
    /// and 0.2 only `NodeGetId`; a controller-only v0 plugin implements neither, and is taken
    /// as 0.3 (the difference only matters for node calls).
    pub async fn detect_version(&self) -> Result<CsiVersion, RpcError> {
        Ok(self.detect().await?.0)
    }

    /// The version and the readiness its `Probe` reported (a missing `ready` means ready).
    async fn detect(&self) -> Result<(CsiVersion, bool), RpcError> {
        match self.probe_v1().await {
            Ok(response) => return Ok((CsiVersion::V1, response.ready.unwrap_or(true))),
            Err(err) if err.is_unimplemented() => {}
            Err(err) => return Err(err),
        }
        let ready = self.probe_v0().await?.ready.unwrap_or(true);
        match self.v0_node_get_info().await {
            Ok(_) => return Ok((CsiVersion::V0_3, ready)),
            Err(err) if err.is_unimplemented() => {}
            // Answered, just not happily (e.g. FAILED_PRECONDITION): the method exists.
            Err(err) if matches!(err.kind, RpcErrorKind::Status { .. }) => {
                return Ok((CsiVersion::V0_3, ready));
            }
            Err(err) => return Err(err),
        }
        let version = match self.v0_node_get_id().await {
            Ok(_) => CsiVersion::V0_2,
            Err(err) if err.is_unimplemented() => CsiVersion::V0_3,
            Err(err) if matches!(err.kind, RpcErrorKind::Status { .. }) => CsiVersion::V0_2,
            Err(err) => return Err(err),
        };
        Ok((version, ready))
    }

    /// Runs one RPC under the deadline, measuring it.
    async fn call<T, F, Fut>(&self, method: &'static str, rpc: F) -> Result<T, RpcError>
    where
        F: FnOnce(Channel, Duration) -> Fut,
        Fut: Future<Output = Result<tonic::Response<T>, tonic::Status>>,
    {
        let deadline = self.options.rpc_deadline;
        let labels = MethodLabels {
            plugin: self.options.plugin.clone(),
            method: method.to_owned(),
        };
        if let Some(metrics) = &self.options.metrics {
            metrics.rpcs_in_flight.get_or_create(&labels).inc();
        }
        let started = Instant::now();
        let outcome = tokio::time::timeout(deadline, rpc(self.channel.clone(), deadline)).await;
        let result = match outcome {
            Err(_elapsed) => Err(RpcError {
                method,
                kind: RpcErrorKind::DeadlineExceeded,
            }),
            Ok(Ok(response)) => Ok(response.into_inner()),
            // The plugin gave up when our `grpc-timeout` ran out (tonic servers answer
            // CANCELLED then): that is our deadline, not a cancellation, and the call's
            // outcome is just as uncertain.
            Ok(Err(status))
                if status.code() == tonic::Code::Cancelled && started.elapsed() >= deadline / 2 =>
            {
                Err(RpcError {
                    method,
                    kind: RpcErrorKind::DeadlineExceeded,
                })
            }
            Ok(Err(status)) if is_transport_failure(&status) => {
                Err(RpcError::transport(method, transport_detail(&status)))
            }
            Ok(Err(status)) => Err(RpcError::status(method, &status)),
        };
        if let Some(metrics) = &self.options.metrics {
            metrics.rpcs_in_flight.get_or_create(&labels).dec();
            let code = match &result {
                Ok(_) => "OK",
                Err(err) => err.metric_code(),
            };
            metrics.observe_rpc(&labels.plugin, method, code, started.elapsed());
        }
        result
    }

    // ----- Identity -----

    async fn probe_v1(&self) -> Result<v1::ProbeResponse, RpcError> {
        self.call("Probe", |ch, d| async move {
            v1::identity_client::IdentityClient::new(ch)
                .probe(request(v1::ProbeRequest {}, d))
                .await
        })
        .await
    }

    async fn probe_v0(&self) -> Result<csi_proto::v0::ProbeResponse, RpcError> {
        self.call("Probe", |ch, d| async move {
            csi_proto::v0::identity_client::IdentityClient::new(ch)
                .probe(request(csi_proto::v0::ProbeRequest {}, d))
                .await
        })
        .await
    }

    /// `Probe`: is the plugin ready? A v1 `ready == false` means not yet; a missing `ready`
    /// (empty response, or CSI 0.2 which has no such field) means ready.
    pub async fn probe(&self) -> Result<bool, RpcError> {
        let ready = if self.version.is_v0() {
            self.probe_v0().await?.ready
        } else {
            self.probe_v1().await?.ready
        };
        Ok(ready.unwrap_or(true))
    }

    pub async fn get_plugin_info(&self) -> Result<v1::GetPluginInfoResponse, RpcError> {
        if self.version.is_v0() {
            let response = self
                .call("GetPluginInfo", |ch, d| async move {
                    csi_proto::v0::identity_client::IdentityClient::new(ch)
                        .get_plugin_info(request(csi_proto::v0::GetPluginInfoRequest {}, d))
                        .await
                })
                .await?;
            Ok(v0::plugin_info_to_v1(response))
        } else {
            self.call("GetPluginInfo", |ch, d| async move {
                v1::identity_client::IdentityClient::new(ch)
                    .get_plugin_info(request(v1::GetPluginInfoRequest {}, d))
                    .await
            })
            .await
        }
    }

    /// `GetPluginCapabilities`, folded into the advertised services and expansion type;
    /// duplicate and `UNKNOWN` entries are tolerated (real plugins send both). The one call of
    /// this RPC: every caller (topology, expansion, probe) reads what it needs of its answer.
    pub async fn get_plugin_capabilities(&self) -> Result<PluginCapabilities, RpcError> {
        if self.version.is_v0() {
            let response = self
                .call("GetPluginCapabilities", |ch, d| async move {
                    csi_proto::v0::identity_client::IdentityClient::new(ch)
                        .get_plugin_capabilities(request(
                            csi_proto::v0::GetPluginCapabilitiesRequest {},
                            d,
                        ))
                        .await
                })
                .await?;
            Ok(PluginCapabilities {
                services: v0::plugin_services_to_v1(&response),
                volume_expansion: None,
            })
        } else {
            let response = self
                .call("GetPluginCapabilities", |ch, d| async move {
                    v1::identity_client::IdentityClient::new(ch)
                        .get_plugin_capabilities(request(v1::GetPluginCapabilitiesRequest {}, d))
                        .await
                })
                .await?;
            Ok(PluginCapabilities {
                services: fold_plugin_services(&response),
                volume_expansion: expand::fold_volume_expansion(&response),
            })
        }
    }

    // ----- Controller -----

    pub async fn controller_get_capabilities(&self) -> Result<ControllerCapabilities, RpcError> {
        if self.version.is_v0() {
            let response = self
                .call("ControllerGetCapabilities", |ch, d| async move {
                    csi_proto::v0::controller_client::ControllerClient::new(ch)
                        .controller_get_capabilities(request(
                            csi_proto::v0::ControllerGetCapabilitiesRequest {},
                            d,
                        ))
                        .await
                })
                .await?;
            Ok(v0::controller_capabilities_to_v1(&response))
        } else {
            let response = self
                .call("ControllerGetCapabilities", |ch, d| async move {
                    v1::controller_client::ControllerClient::new(ch)
                        .controller_get_capabilities(request(
                            v1::ControllerGetCapabilitiesRequest {},
                            d,
                        ))
                        .await
                })
                .await?;
            Ok(fold_controller_capabilities(&response))
        }
    }

    pub async fn create_volume(
        &self,
        req: v1::CreateVolumeRequest,
    ) -> Result<v1::CreateVolumeResponse, RpcError> {
        const METHOD: &str = "CreateVolume";
        if self.version.is_v0() {
            let req = v0::create_volume_request(req).map_err(|e| RpcError::protocol(METHOD, e))?;
            let response = self
                .call(METHOD, |ch, d| async move {
                    csi_proto::v0::controller_client::ControllerClient::new(ch)
                        .create_volume(request(req, d))
                        .await
                })
                .await?;
            Ok(v0::create_volume_response(response))
        } else {
            self.call(METHOD, |ch, d| async move {
                v1::controller_client::ControllerClient::new(ch)
                    .create_volume(request(req, d))
                    .await
            })
            .await
        }
    }

    pub async fn delete_volume(&self, req: v1::DeleteVolumeRequest) -> Result<(), RpcError> {
        const METHOD: &str = "DeleteVolume";
        if self.version.is_v0() {
            let req = v0::delete_volume_request(req);
            self.call(METHOD, |ch, d| async move {
                csi_proto::v0::controller_client::ControllerClient::new(ch)
                    .delete_volume(request(req, d))
                    .await
            })
            .await?;
        } else {
            self.call(METHOD, |ch, d| async move {
                v1::controller_client::ControllerClient::new(ch)
                    .delete_volume(request(req, d))
                    .await
            })
            .await?;
        }
        Ok(())
    }

    pub async fn controller_publish_volume(
        &self,
        req: v1::ControllerPublishVolumeRequest,
    ) -> Result<v1::ControllerPublishVolumeResponse, RpcError> {
        const METHOD: &str = "ControllerPublishVolume";
        if self.version.is_v0() {
            let req = v0::controller_publish_request(req);
            let response = self
                .call(METHOD, |ch, d| async move {
                    csi_proto::v0::controller_client::ControllerClient::new(ch)
                        .controller_publish_volume(request(req, d))
                        .await
                })
                .await?;
            Ok(v1::ControllerPublishVolumeResponse {
                publish_context: response.publish_info,
            })
        } else {
            self.call(METHOD, |ch, d| async move {
                v1::controller_client::ControllerClient::new(ch)
                    .controller_publish_volume(request(req, d))
                    .await
            })
            .await
        }
    }

    pub async fn controller_unpublish_volume(
        &self,
        req: v1::ControllerUnpublishVolumeRequest,
    ) -> Result<(), RpcError> {
        const METHOD: &str = "ControllerUnpublishVolume";
        if self.version.is_v0() {
            let req = v0::controller_unpublish_request(req);
            self.call(METHOD, |ch, d| async move {
                csi_proto::v0::controller_client::ControllerClient::new(ch)
                    .controller_unpublish_volume(request(req, d))
                    .await
            })
            .await?;
        } else {
            self.call(METHOD, |ch, d| async move {
                v1::controller_client::ControllerClient::new(ch)
                    .controller_unpublish_volume(request(req, d))
                    .await
            })
            .await?;
        }
        Ok(())
    }

    pub async fn validate_volume_capabilities(
        &self,
        req: v1::ValidateVolumeCapabilitiesRequest,
    ) -> Result<v1::ValidateVolumeCapabilitiesResponse, RpcError> {
        const METHOD: &str = "ValidateVolumeCapabilities";
        if self.version.is_v0() {
            let asked = req.clone();
            let req = v0::validate_request(req);
            let response = self
                .call(METHOD, |ch, d| async move {
                    csi_proto::v0::controller_client::ControllerClient::new(ch)
                        .validate_volume_capabilities(request(req, d))
                        .await
                })
                .await?;
            Ok(v0::validate_response(&asked, response))
        } else {
            self.call(METHOD, |ch, d| async move {
                v1::controller_client::ControllerClient::new(ch)
                    .validate_volume_capabilities(request(req, d))
                    .await
            })
            .await
        }
    }

    pub async fn list_volumes(
        &self,
        req: v1::ListVolumesRequest,
    ) -> Result<v1::ListVolumesResponse, RpcError> {
        const METHOD: &str = "ListVolumes";
        if self.version.is_v0() {
            let req = csi_proto::v0::ListVolumesRequest {
                max_entries: req.max_entries,
                starting_token: req.starting_token,
            };
            let response = self
                .call(METHOD, |ch, d| async move {
                    csi_proto::v0::controller_client::ControllerClient::new(ch)
                        .list_volumes(request(req, d))
                        .await
                })
                .await?;
            Ok(v0::list_volumes_response(response))
        } else {
            self.call(METHOD, |ch, d| async move {
                v1::controller_client::ControllerClient::new(ch)
                    .list_volumes(request(req, d))
                    .await
            })
            .await
        }
    }

    pub async fn get_capacity(
        &self,
        req: v1::GetCapacityRequest,
    ) -> Result<v1::GetCapacityResponse, RpcError> {
        const METHOD: &str = "GetCapacity";
        if self.version.is_v0() {
            let req = v0::get_capacity_request(req);
            let response = self
                .call(METHOD, |ch, d| async move {
                    csi_proto::v0::controller_client::ControllerClient::new(ch)
                        .get_capacity(request(req, d))
                        .await
                })
                .await?;
            Ok(v1::GetCapacityResponse {
                available_capacity: response.available_capacity,
                ..Default::default()
            })
        } else {
            self.call(METHOD, |ch, d| async move {
                v1::controller_client::ControllerClient::new(ch)
                    .get_capacity(request(req, d))
                    .await
            })
            .await
        }
    }

    // ----- Node -----

    pub async fn node_get_capabilities(&self) -> Result<NodeCapabilities, RpcError> {
        if self.version.is_v0() {
            let response = self
                .call("NodeGetCapabilities", |ch, d| async move {
                    csi_proto::v0::node_client::NodeClient::new(ch)
                        .node_get_capabilities(request(
                            csi_proto::v0::NodeGetCapabilitiesRequest {},
                            d,
                        ))
                        .await
                })
                .await?;
            Ok(v0::node_capabilities_to_v1(&response))
        } else {
            let response = self
                .call("NodeGetCapabilities", |ch, d| async move {
                    v1::node_client::NodeClient::new(ch)
                        .node_get_capabilities(request(v1::NodeGetCapabilitiesRequest {}, d))
                        .await
                })
                .await?;
            Ok(fold_node_capabilities(&response))
        }
    }

    async fn v0_node_get_info(&self) -> Result<csi_proto::v0::NodeGetInfoResponse, RpcError> {
        self.call("NodeGetInfo", |ch, d| async move {
            csi_proto::v0::node_client::NodeClient::new(ch)
                .node_get_info(request(csi_proto::v0::NodeGetInfoRequest {}, d))
                .await
        })
        .await
    }

    async fn v0_node_get_id(&self) -> Result<csi_proto::v0::NodeGetIdResponse, RpcError> {
        self.call("NodeGetId", |ch, d| async move {
            csi_proto::v0::node_client::NodeClient::new(ch)
                .node_get_id(request(csi_proto::v0::NodeGetIdRequest {}, d))
                .await
        })
        .await
    }

    /// `NodeGetInfo` (v1, 0.3), or `NodeGetId` on CSI 0.2, which only knows the node id.
    pub async fn node_get_info(&self) -> Result<v1::NodeGetInfoResponse, RpcError> {
        match self.version {
            CsiVersion::V1 => {
                self.call("NodeGetInfo", |ch, d| async move {
                    v1::node_client::NodeClient::new(ch)
                        .node_get_info(request(v1::NodeGetInfoRequest {}, d))
                        .await
                })
                .await
            }
            CsiVersion::V0_3 => Ok(v0::node_info_to_v1(self.v0_node_get_info().await?)),
            CsiVersion::V0_2 => Ok(v1::NodeGetInfoResponse {
                node_id: self.v0_node_get_id().await?.node_id,
                ..Default::default()
            }),
        }
    }

    pub async fn node_stage_volume(&self, req: v1::NodeStageVolumeRequest) -> Result<(), RpcError> {
        const METHOD: &str = "NodeStageVolume";
        if self.version.is_v0() {
            let req = v0::node_stage_request(req);
            self.call(METHOD, |ch, d| async move {
                csi_proto::v0::node_client::NodeClient::new(ch)
                    .node_stage_volume(request(req, d))
                    .await
            })
            .await?;
        } else {
            self.call(METHOD, |ch, d| async move {
                v1::node_client::NodeClient::new(ch)
                    .node_stage_volume(request(req, d))
                    .await
            })
            .await?;
        }
        Ok(())
    }

    pub async fn node_unstage_volume(
        &self,
        req: v1::NodeUnstageVolumeRequest,
    ) -> Result<(), RpcError> {
        const METHOD: &str = "NodeUnstageVolume";
        if self.version.is_v0() {
            let req = csi_proto::v0::NodeUnstageVolumeRequest {
                volume_id: req.volume_id,
                staging_target_path: req.staging_target_path,
            };
            self.call(METHOD, |ch, d| async move {
                csi_proto::v0::node_client::NodeClient::new(ch)
                    .node_unstage_volume(request(req, d))
                    .await
            })
            .await?;
        } else {
            self.call(METHOD, |ch, d| async move {
                v1::node_client::NodeClient::new(ch)
                    .node_unstage_volume(request(req, d))
                    .await
            })
            .await?;
        }
        Ok(())
    }

    pub async fn node_publish_volume(
        &self,
        req: v1::NodePublishVolumeRequest,
    ) -> Result<(), RpcError> {
        const METHOD: &str = "NodePublishVolume";
        if self.version.is_v0() {
            let req = v0::node_publish_request(req);
            self.call(METHOD, |ch, d| async move {
                csi_proto::v0::node_client::NodeClient::new(ch)
                    .node_publish_volume(request(req, d))
                    .await
            })
            .await?;
        } else {
            self.call(METHOD, |ch, d| async move {
                v1::node_client::NodeClient::new(ch)
                    .node_publish_volume(request(req, d))
                    .await
            })
            .await?;
        }
        Ok(())
    }

    pub async fn node_unpublish_volume(
        &self,
        req: v1::NodeUnpublishVolumeRequest,
    ) -> Result<(), RpcError> {
        const METHOD: &str = "NodeUnpublishVolume";
        if self.version.is_v0() {
            let req = csi_proto::v0::NodeUnpublishVolumeRequest {
                volume_id: req.volume_id,
                target_path: req.target_path,
            };
            self.call(METHOD, |ch, d| async move {
                csi_proto::v0::node_client::NodeClient::new(ch)
                    .node_unpublish_volume(request(req, d))
                    .await
            })
            .await?;
        } else {
            self.call(METHOD, |ch, d| async move {
                v1::node_client::NodeClient::new(ch)
                    .node_unpublish_volume(request(req, d))
                    .await
            })
            .await?;
        }
        Ok(())
    }
}

/// Wraps a message, telling the plugin our deadline (`grpc-timeout`), so that it can give up
/// when we do.
fn request<T>(message: T, deadline: Duration) -> tonic::Request<T> {
    let mut request = tonic::Request::new(message);
    request.set_timeout(deadline);
    request
}

/// A status produced by the transport (connection refused, socket gone, connection reset)
/// rather than sent by the plugin.
fn is_transport_failure(status: &tonic::Status) -> bool {
    use std::error::Error as _;
    status.code() == tonic::Code::Unavailable
        && status
            .source()
            .is_some_and(|source| source.downcast_ref::<tonic::transport::Error>().is_some())
        // Told apart by type, not by text: a status the plugin itself sent arrives in
        // trailers and has no source; one made from a local hyper/h2 error keeps it. That
        // covers UNKNOWN (a broken HTTP/2 stream) and CANCELLED (the plugin died mid-call:
        // hyper reports the dropped connection as a cancellation).
        || matches!(status.code(), tonic::Code::Unknown | tonic::Code::Cancelled)
            && status.source().is_some()
}

/// The causes of a transport failure, each said once: tonic's status message repeats its
/// source's text, and its `transport error` wrapper says nothing the next link does not.
fn transport_detail(status: &tonic::Status) -> String {
    use std::error::Error as _;
    let mut links = vec![status.message().to_owned()];
    let mut source = status.source();
    while let Some(err) = source {
        links.push(err.to_string());
        source = err.source();
    }
    let mut detail = String::new();
    for (i, link) in links.iter().enumerate() {
        let last = i + 1 == links.len();
        if link.is_empty() || detail.contains(link.as_str()) || (link == "transport error" && !last)
        {
            continue;
        }
        // A later link that contains everything said so far replaces it.
        if !detail.is_empty() && link.contains(detail.as_str()) {
            detail.clear();
        }
        if !detail.is_empty() {
            detail.push_str(": ");
        }
        detail.push_str(link);
    }
    detail
}

/// Folds v1 plugin capabilities into a set, dropping `UNKNOWN` and values this build does not
/// know.
pub fn fold_plugin_services(response: &v1::GetPluginCapabilitiesResponse) -> PluginServices {
    use v1::plugin_capability::{Type, service};
    response
        .capabilities
        .iter()
        .filter_map(|cap| match &cap.r#type {
            Some(Type::Service(service)) => service::Type::try_from(service.r#type).ok(),
            _ => None,
        })
        .filter(|t| *t != v1::plugin_capability::service::Type::Unknown)
        .collect()
}

/// Folds v1 controller capabilities into a set (duplicates and `UNKNOWN` tolerated).
pub fn fold_controller_capabilities(
    response: &v1::ControllerGetCapabilitiesResponse,
) -> ControllerCapabilities {
    use v1::controller_service_capability::{Type, rpc};
    response
        .capabilities
        .iter()
        .filter_map(|cap| match &cap.r#type {
            Some(Type::Rpc(r)) => rpc::Type::try_from(r.r#type).ok(),
            _ => None,
        })
        .filter(|t| *t != rpc::Type::Unknown)
        .collect()
}

/// Folds v1 node capabilities into a set (duplicates and `UNKNOWN` tolerated).
pub fn fold_node_capabilities(response: &v1::NodeGetCapabilitiesResponse) -> NodeCapabilities {
    use v1::node_service_capability::{Type, rpc};
    response
        .capabilities
        .iter()
        .filter_map(|cap| match &cap.r#type {
            Some(Type::Rpc(r)) => rpc::Type::try_from(r.r#type).ok(),
            _ => None,
        })
        .filter(|t| *t != rpc::Type::Unknown)
        .collect()
}

/// What `csi-agentd probe` reports about a plugin: version, identity and capabilities, with
/// capability names as the spec spells them (`STAGE_UNSTAGE_VOLUME`, …).
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct PluginDescription {
    pub version: CsiVersion,
    pub name: String,
    pub vendor_version: String,
    pub ready: bool,
    pub plugin_capabilities: Vec<String>,
    /// The VolumeExpansion plugin capability (`ONLINE`, `OFFLINE`); absent when not advertised.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub volume_expansion: Option<String>,
    /// `None` when the endpoint does not serve the Controller service (`UNIMPLEMENTED`).
    pub controller_capabilities: Option<Vec<String>>,
    /// `None` when the endpoint does not serve the Node service (`UNIMPLEMENTED`).
    pub node_capabilities: Option<Vec<String>>,
    /// NodeGetInfo (node id, topology, volume limit); `None` when the endpoint does not serve
    /// the Node service.
    pub node: Option<NodeDescription>,
}

impl CsiClient {
    /// Asks the plugin everything an operator wants to know before using it.
    pub async fn describe(&self) -> Result<PluginDescription, RpcError> {
        let info = self.get_plugin_info().await?;
        let ready = self.probe().await?;
        let capabilities = self.get_plugin_capabilities().await?;
        let plugin_capabilities = capabilities
            .services
            .iter()
            .map(|c| c.as_str_name().to_owned())
            .collect();
        let controller_capabilities =
            optional(self.controller_get_capabilities().await)?.map(|set| {
                set.into_iter()
                    .map(|c| c.as_str_name().to_owned())
                    .collect()
            });
        let node_capabilities = optional(self.node_get_capabilities().await)?.map(|set| {
            set.into_iter()
                .map(|c| c.as_str_name().to_owned())
                .collect()
        });
        let volume_expansion = capabilities
            .volume_expansion
            .map(|t| t.as_str_name().to_owned());
        let node = optional(self.describe_node().await)?;
        Ok(PluginDescription {
            version: self.version,
            name: info.name,
            vendor_version: info.vendor_version,
            ready,
            plugin_capabilities,
            volume_expansion,
            controller_capabilities,
            node_capabilities,
            node,
        })
    }
}

/// `UNIMPLEMENTED` means "this endpoint does not serve that service", not a failure.
fn optional<T>(result: Result<T, RpcError>) -> Result<Option<T>, RpcError> {
    match result {
        Ok(value) => Ok(Some(value)),
        Err(err) if err.is_unimplemented() => Ok(None),
        Err(err) => Err(err),
    }
}
