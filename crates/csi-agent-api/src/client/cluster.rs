//! The cluster routes' calls: the node's session, the claims in etcd, and a fence. Owns only
//! their URLs and bodies; what the routes do is the daemon's.

use super::ApiClient;
use crate::error::ApiError;
use crate::routes;
use crate::types::{ClusterClaims, ClusterClaimsQuery, ClusterStatus, FenceReport, FenceRequest};

impl ApiClient {
    /// `GET /v1/cluster`: this node's session and the members it sees (never waits on etcd).
    pub async fn cluster(&self) -> Result<ClusterStatus, ApiError> {
        self.get_json(routes::CLUSTER).await
    }

    /// `GET /v1/cluster/claims?plugin=&node=&volume=`: the claims held in etcd matching
    /// `query`, and every key that could not be read.
    pub async fn cluster_claims(
        &self,
        query: &ClusterClaimsQuery,
    ) -> Result<ClusterClaims, ApiError> {
        let path = format!(
            "{}{}",
            routes::CLUSTER_CLAIMS,
            routes::query(&[
                ("plugin", query.plugin.as_deref()),
                ("node", query.node.as_deref()),
                ("volume", query.volume.as_deref()),
            ])
        );
        self.get_json(&path).await
    }

    /// `POST /v1/cluster/nodes/{node}/fence`: declares `node` out of service (refused while
    /// its lease is alive); its volumes are detached and freed without its word.
    pub async fn fence(&self, node: &str, reason: &str) -> Result<FenceReport, ApiError> {
        let request = FenceRequest {
            reason: reason.to_owned(),
        };
        self.post_json(&routes::cluster_fence(node), &request).await
    }
}
