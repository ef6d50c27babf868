//! The cluster routes (issue 28, items 6 and 8): `GET /v1/cluster`, `GET /v1/cluster/claims`
//! and `POST /v1/cluster/nodes/{node}/fence`.
//!
//! Owns: parsing, validation of the request and the conversion of the engine's cluster values
//! into the JSON contract. Must not: decide anything about claims or fences (the engine's
//! `cluster` module does), or wait on etcd for `GET /v1/cluster` (a status read answers even
//! with etcd unreachable).

use axum::Json;
use axum::body::Bytes;
use axum::extract::{Query, State};
use csi_agent::cluster;
use csi_agent_api as api;

use super::{ApiResult, AppState, Params, parse_body, refuse_empty_filters};
use crate::convert::ApiFailure;

const FENCE_ROUTE: &str = "POST /v1/cluster/nodes/{node}/fence";

/// `GET /v1/cluster`: the session's snapshot; never waits on etcd.
pub(super) async fn status(State(state): State<AppState>) -> ApiResult<api::ClusterStatus> {
    let cluster = state.server.cluster()?;
    Ok(Json(status_info(cluster.status())))
}

fn status_info(s: cluster::ClusterStatus) -> api::ClusterStatus {
    api::ClusterStatus {
        name: s.name,
        node: s.node,
        instance_id: s.instance_id,
        state: state_name(s.state).to_owned(),
        lease_id: s.lease_id,
        lease_ttl_secs: s.lease_ttl_secs,
        lease_valid_for_ms: s.lease_valid_for_ms,
        since_unix: s.since_unix,
        reason: s.reason,
        // Hex, as etcdctl shows it; a JSON number would lose the low bits in JavaScript.
        etcd_cluster_id: s.etcd_cluster_id.map(|id| format!("{id:x}")),
        members: s
            .members
            .into_iter()
            .map(|m| api::ClusterMember {
                node: m.node,
                instance_id: m.instance_id,
                version: m.version,
                started_at_unix: m.started_at,
                plugins: m.plugins,
                csi_nodes: m
                    .csi
                    .into_iter()
                    .map(|(plugin, csi)| api::ClusterCsiNode {
                        plugin,
                        node_id: csi.node_id,
                        topology: csi.topology,
                    })
                    .collect(),
            })
            .collect(),
        fenced: s.fenced,
        released_after_fence: s.released_after_fence,
        lease_losses: s.lease_losses,
        leaders: s
            .leaders
            .into_iter()
            .map(|l| api::ClusterLeader {
                plugin: l.plugin_type,
                plugin_name: l.plugin_name,
                node: l.node,
                revision: l.revision,
                this_node: l.this_node,
            })
            .collect(),
    }
}

/// The session state's wire name (the engine's `Serialize` spelling).
fn state_name(state: cluster::SessionState) -> &'static str {
    match state {
        cluster::SessionState::Joining => "JOINING",
        cluster::SessionState::Healthy => "HEALTHY",
        cluster::SessionState::Degraded => "DEGRADED",
        cluster::SessionState::Fenced => "FENCED",
        cluster::SessionState::Refused => "REFUSED",
    }
}

/// `GET /v1/cluster/claims?plugin=&node=&volume=`: reads etcd (bounded by its request
/// timeout), filters here.
pub(super) async fn claims(
    State(state): State<AppState>,
    query: Result<Query<api::ClusterClaimsQuery>, axum::extract::rejection::QueryRejection>,
) -> ApiResult<api::ClusterClaims> {
    let Query(query) = query.map_err(|e| {
        ApiFailure::invalid(format!(
            "query of GET /v1/cluster/claims is not valid: {e}; use plugin=<type>, node=<name>, volume=<id>"
        ))
    })?;
    refuse_empty_filters(
        "claim",
        &[
            ("plugin", &query.plugin),
            ("node", &query.node),
            ("volume", &query.volume),
        ],
    )?;
    let (views, damaged) = state.server.cluster()?.claims().await?;
    let matches =
        |filter: &Option<String>, value: &str| filter.as_deref().is_none_or(|f| f == value);
    let claims = views
        .into_iter()
        .filter(|v| {
            matches(&query.plugin, &v.plugin_type)
                && matches(&query.node, &v.node)
                && matches(&query.volume, &v.volume_id)
        })
        .map(|v| api::ClusterClaim {
            plugin: v.plugin_type,
            plugin_name: v.plugin_name,
            volume_id: v.volume_id,
            access_mode: v.access_mode,
            node: v.node,
            state: v.state.as_str().to_owned(),
            suspect: v.suspect,
            readonly: v.readonly,
            csi_node_id: v.csi_node_id,
            workloads: v.workloads,
            since_unix: v.since_unix,
        })
        .collect();
    Ok(Json(api::ClusterClaims {
        claims,
        damaged: damaged
            .into_iter()
            .map(|d| api::DamagedKey {
                key: d.key,
                problem: d.problem,
            })
            .collect(),
    }))
}

/// `POST /v1/cluster/nodes/{node}/fence`. The body is checked before anything else, so that
/// a malformed fence is refused the same way with cluster mode on or off.
pub(super) async fn fence(
    State(state): State<AppState>,
    Params(node): Params<String>,
    body: Bytes,
) -> ApiResult<api::FenceReport> {
    let request: api::FenceRequest = parse_body(FENCE_ROUTE, &body).map_err(|err| {
        // serde's type error says "expected a string at line 1 column 11" without naming
        // the field: name it.
        let reason = serde_json::from_slice::<serde_json::Value>(&body)
            .ok()
            .and_then(|value| value.get("reason").cloned());
        match reason {
            Some(value) if !value.is_string() => ApiFailure::invalid(format!(
                "reason of {FENCE_ROUTE} must be a string (why the node is out of service), \
                 not {value}"
            )),
            _ => err,
        }
    })?;
    let reason = fence_reason(&request.reason)?;
    let report = state.server.cluster()?.fence(&node, reason).await?;
    Ok(Json(api::FenceReport {
        node: report.node,
        freed: report.freed,
        left: report.left,
    }))
}

/// The fence's `reason`: required and recorded in etcd with the fence, so non-blank and bounded.
fn fence_reason(reason: &str) -> Result<&str, ApiFailure> {
    let trimmed = reason.trim();
    if trimmed.is_empty() {
        return Err(ApiFailure::invalid(format!(
            "reason of {FENCE_ROUTE} is empty: say why the node is out of service (it is \
             recorded with the fence)"
        )));
    }
    let max = api::FenceRequest::MAX_REASON_BYTES;
    if reason.len() > max {
        return Err(ApiFailure::invalid(format!(
            "reason of {FENCE_ROUTE} is {} bytes long; at most {max} bytes",
            reason.len()
        )));
    }
    Ok(trimmed)
}

#[cfg(test)]
mod tests {
    use csi_agent::cluster::store::{Guarded, Read, StoreError};
    use futures::future::BoxFuture;

    use super::*;

    #[test]
    fn a_fence_reason_must_be_non_blank_and_bounded() {
        let message = |r: &str| fence_reason(r).err().map(|e| e.0.message);
        assert_eq!(fence_reason("  powered off  ").ok(), Some("powered off"));
        for blank in ["", " \t\n"] {
            let m = message(blank).unwrap_or_default();
            assert!(m.starts_with("reason of ") && m.contains("empty"), "{m}");
        }
        let max = api::FenceRequest::MAX_REASON_BYTES;
        assert!(fence_reason(&"x".repeat(max)).is_ok());
        let m = message(&"x".repeat(max + 1)).unwrap_or_default();
        assert!(m.contains(&format!("{} bytes long", max + 1)), "{m}");
    }

    /// An etcd that never answers: every call stays pending.
    #[derive(Debug)]
    struct Silent;

    impl cluster::store::ClusterStore for Silent {
        fn get(&self, _: Vec<u8>) -> BoxFuture<'_, Result<Read, StoreError>> {
            Box::pin(std::future::pending())
        }
        fn list(&self, _: Vec<u8>) -> BoxFuture<'_, Result<Read, StoreError>> {
            Box::pin(std::future::pending())
        }
        fn write(&self, _: Guarded) -> BoxFuture<'_, Result<Option<i64>, StoreError>> {
            Box::pin(std::future::pending())
        }
        fn grant(&self, _: i64) -> BoxFuture<'_, Result<i64, StoreError>> {
            Box::pin(std::future::pending())
        }
        fn keep_alive(&self, _: i64) -> BoxFuture<'_, Result<i64, StoreError>> {
            Box::pin(std::future::pending())
        }
        fn revoke(&self, _: i64) -> BoxFuture<'_, Result<(), StoreError>> {
            Box::pin(std::future::pending())
        }
        fn watch(
            &self,
            _: Vec<u8>,
            _: bool,
            _: i64,
        ) -> BoxFuture<'_, Result<Box<dyn cluster::store::Changes>, StoreError>> {
            Box::pin(std::future::pending())
        }
    }

    /// What `GET /v1/cluster` answers comes from the session's snapshot: with etcd silent and
    /// the session trying to join, it is there at once, JOINING with its reason.
    #[tokio::test]
    async fn the_status_of_a_node_whose_etcd_never_answers_is_a_joining_snapshot_at_once() {
        let cluster = cluster::Cluster::new(
            cluster::ClusterOptions {
                name: "prod".to_owned(),
                node: "n1".to_owned(),
                lease_ttl: std::time::Duration::from_secs(10),
            },
            std::sync::Arc::new(Silent),
            cluster::Identity {
                instance_id: "i1".to_owned(),
                etcd_cluster_id: Some(0xcdf8_1819_4e3a_8c32),
            },
            Box::new(|_| Ok(())),
            None,
        );
        cluster.run();
        tokio::task::yield_now().await;
        let started = std::time::Instant::now();
        let status = status_info(cluster.status());
        assert!(started.elapsed() < std::time::Duration::from_millis(100));
        assert_eq!(status.state, "JOINING");
        assert_eq!((status.name.as_str(), status.node.as_str()), ("prod", "n1"));
        assert!(status.reason.is_some_and(|r| !r.is_empty()));
        assert_eq!(status.lease_id, 0);
        assert_eq!(status.lease_valid_for_ms, 0);
        assert_eq!(status.lease_ttl_secs, 10);
        assert!(status.members.is_empty());
    }

    #[test]
    fn the_etcd_cluster_id_is_hex_and_members_keep_their_fields() {
        let engine = cluster::ClusterStatus {
            name: "prod".to_owned(),
            node: "n1".to_owned(),
            instance_id: "i1".to_owned(),
            state: cluster::SessionState::Healthy,
            lease_id: 7,
            lease_ttl_secs: 10,
            lease_valid_for_ms: 9_000,
            since_unix: 5,
            reason: None,
            etcd_cluster_id: Some(0xcdf8_1819_4e3a_8c32),
            members: vec![cluster::keys::NodeInfo {
                schema: 1,
                node: "n2".to_owned(),
                instance_id: "i2".to_owned(),
                version: "0.1.0".to_owned(),
                started_at: 3,
                plugins: vec!["org.example.nfs/default".to_owned()],
                csi: [(
                    "org.example.nfs/default".to_owned(),
                    cluster::keys::CsiNode {
                        node_id: "node-2".to_owned(),
                        topology: [("zone".to_owned(), "a".to_owned())].into(),
                    },
                )]
                .into(),
            }],
            fenced: vec!["n3".to_owned()],
            released_after_fence: vec!["v9".to_owned()],
            lease_losses: 1,
            leaders: vec![cluster::LeaderView {
                plugin_type: "org.example.nfs".to_owned(),
                plugin_name: "default".to_owned(),
                node: "n2".to_owned(),
                revision: 42,
                this_node: false,
            }],
        };
        let status = status_info(engine);
        // 14841639068965178418 is above 2^53: as a JSON number, JavaScript reads another id.
        assert_eq!(status.etcd_cluster_id.as_deref(), Some("cdf818194e3a8c32"));
        assert_eq!(status.state, "HEALTHY");
        assert_eq!(
            status.members,
            vec![api::ClusterMember {
                node: "n2".to_owned(),
                instance_id: "i2".to_owned(),
                version: "0.1.0".to_owned(),
                started_at_unix: 3,
                plugins: vec!["org.example.nfs/default".to_owned()],
                csi_nodes: vec![api::ClusterCsiNode {
                    plugin: "org.example.nfs/default".to_owned(),
                    node_id: "node-2".to_owned(),
                    topology: [("zone".to_owned(), "a".to_owned())].into(),
                }],
            }]
        );
        assert_eq!(status.fenced, ["n3"]);
        assert_eq!(status.released_after_fence, ["v9"]);
        assert_eq!(
            status.leaders,
            vec![api::ClusterLeader {
                plugin: "org.example.nfs".to_owned(),
                plugin_name: "default".to_owned(),
                node: "n2".to_owned(),
                revision: 42,
                this_node: false,
            }]
        );
        assert_eq!((status.lease_losses, status.since_unix), (1, 5));
    }

    #[test]
    fn every_session_state_has_the_engines_wire_name() {
        use cluster::SessionState::*;
        for state in [Joining, Healthy, Degraded, Fenced, Refused] {
            let engine = serde_json::to_value(state).ok();
            assert_eq!(engine, Some(serde_json::json!(state_name(state))));
        }
    }
}
