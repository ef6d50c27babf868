//! ControllerGetVolume (CSI v1 only; CSI 0.x has no such RPC).
//!
//! Owns the call and its deadline like every other RPC of [`CsiClient`]; must not decide
//! whether the plugin may be asked (the volume manager checks GET_VOLUME first).

use csi_proto::v1;

use super::{CsiClient, RpcError, request};

impl CsiClient {
    /// `ControllerGetVolume`. On a CSI 0.x plugin: `UNIMPLEMENTED` without a call.
    pub async fn controller_get_volume(
        &self,
        req: v1::ControllerGetVolumeRequest,
    ) -> Result<v1::ControllerGetVolumeResponse, RpcError> {
        const METHOD: &str = "ControllerGetVolume";
        if self.version.is_v0() {
            return Err(RpcError::status(
                METHOD,
                &tonic::Status::unimplemented("ControllerGetVolume is not part of CSI 0.x"),
            ));
        }
        self.call(METHOD, |ch, d| async move {
            v1::controller_client::ControllerClient::new(ch)
                .controller_get_volume(request(req, d))
                .await
        })
        .await
    }
}

/// NodeGetInfo as `csi-agentd probe` shows it.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct NodeDescription {
    pub node_id: String,
    /// Absent when the plugin reports none.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub accessible_topology: Option<std::collections::BTreeMap<String, String>>,
    /// 0: no limit (the spec's "CO SHALL decide").
    pub max_volumes_per_node: i64,
}

impl CsiClient {
    /// NodeGetInfo for a description.
    pub(super) async fn describe_node(&self) -> Result<NodeDescription, RpcError> {
        let info = self.node_get_info().await?;
        Ok(NodeDescription {
            node_id: info.node_id,
            accessible_topology: info
                .accessible_topology
                .map(|t| t.segments.into_iter().collect())
                .filter(|s: &std::collections::BTreeMap<String, String>| !s.is_empty()),
            max_volumes_per_node: info.max_volumes_per_node,
        })
    }
}
