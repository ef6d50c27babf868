//! The CSI client's volume expansion calls: `ControllerExpandVolume`, `NodeExpandVolume`,
//! and the `VolumeExpansion` plugin capability (ONLINE or OFFLINE).
//!
//! Owns: the wire calls and folding the plugin capability. Must not: decide when to expand
//! or retry (the volume manager's `volume/expand.rs` does). CSI 0.x has no expansion: on a
//! v0 plugin the calls answer UNIMPLEMENTED without reaching it, and the plugin capability
//! is absent.

use csi_proto::v1;
use v1::plugin_capability::volume_expansion::Type as ExpansionType;

use super::{CsiClient, RpcError, request};

/// The error of an expansion call on a CSI 0.x plugin: the plugin does not support it.
fn no_expansion_on_v0(method: &'static str) -> RpcError {
    RpcError::status(
        method,
        &tonic::Status::unimplemented(
            "CSI 0.x has no volume expansion; the plugin does not support it",
        ),
    )
}

/// The `VolumeExpansion` type a v1 plugin advertises (`UNKNOWN` and unknown values are
/// ignored; of several entries, the first known one counts).
pub fn fold_volume_expansion(
    response: &v1::GetPluginCapabilitiesResponse,
) -> Option<ExpansionType> {
    use v1::plugin_capability::Type;
    response
        .capabilities
        .iter()
        .find_map(|cap| match &cap.r#type {
            Some(Type::VolumeExpansion(e)) => ExpansionType::try_from(e.r#type)
                .ok()
                .filter(|t| *t != ExpansionType::Unknown),
            _ => None,
        })
}

impl CsiClient {
    pub async fn controller_expand_volume(
        &self,
        req: v1::ControllerExpandVolumeRequest,
    ) -> Result<v1::ControllerExpandVolumeResponse, RpcError> {
        const METHOD: &str = "ControllerExpandVolume";
        if self.version.is_v0() {
            return Err(no_expansion_on_v0(METHOD));
        }
        self.call(METHOD, |ch, d| async move {
            v1::controller_client::ControllerClient::new(ch)
                .controller_expand_volume(request(req, d))
                .await
        })
        .await
    }

    pub async fn node_expand_volume(
        &self,
        req: v1::NodeExpandVolumeRequest,
    ) -> Result<v1::NodeExpandVolumeResponse, RpcError> {
        const METHOD: &str = "NodeExpandVolume";
        if self.version.is_v0() {
            return Err(no_expansion_on_v0(METHOD));
        }
        self.call(METHOD, |ch, d| async move {
            v1::node_client::NodeClient::new(ch)
                .node_expand_volume(request(req, d))
                .await
        })
        .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use v1::plugin_capability::{Service, Type, VolumeExpansion};

    #[test]
    fn folds_the_expansion_type_and_skips_unknown() {
        let cap = |t| v1::PluginCapability { r#type: Some(t) };
        let response = v1::GetPluginCapabilitiesResponse {
            capabilities: vec![
                cap(Type::Service(Service { r#type: 1 })),
                cap(Type::VolumeExpansion(VolumeExpansion { r#type: 0 })),
                cap(Type::VolumeExpansion(VolumeExpansion { r#type: 99 })),
                cap(Type::VolumeExpansion(VolumeExpansion { r#type: 2 })),
            ],
        };
        assert_eq!(
            fold_volume_expansion(&response),
            Some(ExpansionType::Offline)
        );
        assert_eq!(
            fold_volume_expansion(&v1::GetPluginCapabilitiesResponse::default()),
            None
        );
    }
}
