//! The cluster routes on a daemon WITHOUT `--cluster-etcd`: each answers 404 `not_found`
//! saying that cluster mode is off and how to turn it on, `csictl cluster …` exits 1 printing
//! it, and a fence's body is judged before cluster mode (400 naming `reason`), so a malformed
//! fence is refused the same way on every daemon. The routes with etcd are tested end to end
//! with etcd-server (the cluster tests). Run under `unshare -m --propagation private`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use csi_agent_api::{ClusterClaimsQuery, ErrorCode, FenceRequest, routes};
use csi_agent_testkit::*;
use serde_json::json;

fn assert_cluster_off(what: &str, status: u16, body: &csi_agent_api::ErrorBody) {
    assert_eq!(status, 404, "{what}: {body:?}");
    assert_eq!(body.code, ErrorCode::NotFound, "{what}");
    assert!(
        body.message.contains("cluster mode is off") && body.message.contains("--cluster-etcd"),
        "{what}: {}",
        body.message
    );
}

#[tokio::test]
async fn without_cluster_mode_every_cluster_route_is_a_404_naming_the_flag() {
    let dir = tempfile::tempdir().unwrap();
    let daemon = setup(dir.path(), &[]);
    let api = daemon.api();

    let (status, body) = api_error(api.cluster().await);
    assert_cluster_off("GET /v1/cluster", status, &body);
    let (status, body) = api_error(api.cluster_claims(&ClusterClaimsQuery::default()).await);
    assert_cluster_off("GET /v1/cluster/claims", status, &body);
    let filtered = ClusterClaimsQuery {
        plugin: Some(PLUGIN.to_owned()),
        node: Some("n2".to_owned()),
        volume: Some("a/b".to_owned()),
    };
    let (status, body) = api_error(api.cluster_claims(&filtered).await);
    assert_cluster_off("GET /v1/cluster/claims?…", status, &body);
    let (status, body) = api_error(api.fence("n2", "powered off").await);
    assert_cluster_off("POST /v1/cluster/nodes/n2/fence", status, &body);
    // The longest reason allowed passes the body's check and meets cluster mode.
    let longest = "r".repeat(FenceRequest::MAX_REASON_BYTES);
    let (status, body) = api_error(api.fence("n2", &longest).await);
    assert_cluster_off("a fence with a 1024-byte reason", status, &body);

    let out = daemon.csictl(&["cluster", "status"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        out.stdout.is_empty(),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    assert!(
        stderr.contains("cluster mode is off: start csi-agentd with --cluster-etcd"),
        "{stderr}"
    );
    // The hint is about cluster mode, not the plugins and volumes of other 404s.
    assert!(
        stderr.contains("hint: this daemon runs without cluster mode"),
        "{stderr}"
    );
    let out = daemon.csictl(&["-o", "json", "cluster", "status"]);
    let error: serde_json::Value = serde_json::from_slice(&out.stderr).unwrap();
    assert_eq!(error["error"]["code"], "not_found", "{error}");
    assert_eq!(error["error"]["http_status"], 404, "{error}");
    assert_eq!(out.status.code(), Some(1), "{error}");
    for args in [
        &["cluster", "nodes"][..],
        &["cluster", "claims", "--node", "n2"],
        &["cluster", "fence", "n2", "--reason", "powered off"],
    ] {
        let out = daemon.csictl(args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {stderr}");
        assert!(stderr.contains("cluster mode is off"), "{args:?}: {stderr}");
    }
    // The daemon still serves everything else.
    api.publish(&publish_request("vol1", "w1")).await.unwrap();
}

#[tokio::test]
async fn a_fence_without_a_usable_reason_is_a_400_naming_reason_before_cluster_mode() {
    let dir = tempfile::tempdir().unwrap();
    let daemon = setup(dir.path(), &[]);
    let api = daemon.api();
    let path = routes::cluster_fence("n2");
    let too_long = "r".repeat(FenceRequest::MAX_REASON_BYTES + 1);
    for (what, body, says) in [
        ("no reason", json!({}), "missing field `reason`"),
        ("an empty reason", json!({"reason": ""}), "reason of"),
        ("a blank reason", json!({"reason": " \n\t"}), "is empty"),
        (
            "a reason of 1025 bytes",
            json!({"reason": too_long}),
            "1025 bytes long",
        ),
        (
            "a reason that is not text",
            json!({"reason": 7}),
            "must be a string",
        ),
        (
            "an unknown field",
            json!({"reason": "x", "force": true}),
            "unknown field `force`",
        ),
    ] {
        let (status, answer) = api.post_raw(&path, &body).await.unwrap();
        assert_eq!(status, 400, "{what}: {answer}");
        assert_eq!(answer["code"], "invalid_request", "{what}: {answer}");
        let message = answer["message"].as_str().unwrap_or_default();
        assert!(
            message.contains("reason") || what == "an unknown field",
            "{what}: {message}"
        );
        assert!(message.contains(says), "{what}: {message}");
        assert!(
            !message.contains("cluster mode is off"),
            "{what}: {message}"
        );
    }
    // A body that is not an object, and an empty filter of the claims, are refused too.
    let (status, answer) = api.post_raw(&path, &json!(["x"])).await.unwrap();
    assert_eq!(status, 400, "{answer}");
    let empty = ClusterClaimsQuery {
        plugin: Some(String::new()),
        ..ClusterClaimsQuery::default()
    };
    let (status, body) = api_error(api.cluster_claims(&empty).await);
    assert_eq!(status, 400, "{body:?}");
    assert!(
        body.message.contains("plugin= is empty"),
        "{}",
        body.message
    );

    let out = daemon.csictl(&["cluster", "fence", "n2", "--reason", ""]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("reason of") && stderr.contains("empty"),
        "{stderr}"
    );
}
