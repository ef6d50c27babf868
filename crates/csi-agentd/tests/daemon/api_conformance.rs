//! Answers that `openapi.yaml` documents, on the real daemon with the real test plugin: one
//! regression test for each defect `scripts/schemathesis` found (docs/reliability.md,
//! "Schemathesis"). Each fails without its fix.
//!
//! Run as root under `unshare -m --propagation private` like the other daemon tests.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use csi_agent_api::{ErrorCode, VolumeQuery};
use csi_agent_testkit::*;

/// ListVolumes' `ABORTED` means "starting_token is not valid" (CSI spec): the caller's mistake.
/// It was answered 503 `unavailable`, as if the plugin were down, telling the caller to retry
/// a request that can never succeed.
#[tokio::test]
async fn a_starting_token_the_plugin_does_not_know_is_a_400_not_a_503() {
    let dir = tempfile::tempdir().unwrap();
    let daemon = setup(dir.path(), &[]);
    let api = daemon.api();
    let page = api.backend_volumes(PLUGIN, Some(1), None).await.unwrap();
    assert_eq!(page.volumes.len(), 1, "{page:?}");

    let (status, body) = api_error(api.backend_volumes(PLUGIN, None, Some("0")).await);
    assert_eq!(status, 400, "{body:?}");
    assert_eq!(body.code, ErrorCode::InvalidRequest);
    assert_eq!(body.grpc_code.as_deref(), Some("ABORTED"));
    assert!(
        body.message.contains("starting_token \"0\" is not valid"),
        "{}",
        body.message
    );
    // The token the plugin gave out still works.
    let next = api
        .backend_volumes(PLUGIN, Some(1), Some(&page.next_token))
        .await
        .unwrap();
    assert_eq!(next.volumes.len(), 1, "{next:?}");
}

/// An empty filter (`?plugin=`) matched nothing and answered 200 with an empty list: a client
/// that built the query from an empty variable took it for "no volumes".
#[tokio::test]
async fn an_empty_filter_of_the_volume_list_is_refused_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    let daemon = setup(dir.path(), &[]);
    let api = daemon.api();
    api.publish(&publish_request("vol1", "w1")).await.unwrap();
    for (name, query) in [
        (
            "plugin",
            VolumeQuery {
                plugin: Some(String::new()),
                ..VolumeQuery::default()
            },
        ),
        (
            "state",
            VolumeQuery {
                state: Some(String::new()),
                ..VolumeQuery::default()
            },
        ),
        (
            "workload",
            VolumeQuery {
                workload: Some(String::new()),
                ..VolumeQuery::default()
            },
        ),
    ] {
        let (status, body) = api_error(api.volumes_matching(&query).await);
        assert_eq!(status, 400, "{name}: {body:?}");
        assert_eq!(body.code, ErrorCode::InvalidRequest);
        assert!(
            body.message.contains(&format!("{name}= is empty")),
            "{}",
            body.message
        );
    }
    // The other refusals of a bad query, which schemathesis's negative examples of this route
    // cannot be trusted with (docs/reliability.md, "Schemathesis").
    for (what, query) in [
        (
            "limit 0 is out of range",
            VolumeQuery {
                limit: Some(0),
                ..VolumeQuery::default()
            },
        ),
        (
            "limit 10001 is out of range",
            VolumeQuery {
                limit: Some(10_001),
                ..VolumeQuery::default()
            },
        ),
        (
            "is not one this API gave out",
            VolumeQuery {
                page_token: Some("bogus".to_owned()),
                ..VolumeQuery::default()
            },
        ),
    ] {
        let (status, body) = api_error(api.volumes_matching(&query).await);
        assert_eq!(status, 400, "{what}: {body:?}");
        assert!(body.message.contains(what), "{}", body.message);
    }
    // A filter with a value still filters.
    let list = api
        .volumes_matching(&VolumeQuery {
            workload: Some("w1".to_owned()),
            ..VolumeQuery::default()
        })
        .await
        .unwrap();
    assert_eq!(list.volumes.len(), 1, "{list:?}");
    api.unpublish(&unpublish_request("vol1", "w1"))
        .await
        .unwrap();
}

/// The spec lets a CO call ListVolumes and GetCapacity only when the plugin advertises
/// LIST_VOLUMES and GET_CAPACITY. A plugin without them is told apart before any RPC: 501
/// `unsupported`, naming the capability, and the plugin receives neither call.
#[tokio::test]
async fn an_optional_controller_rpc_the_plugin_does_not_advertise_is_a_501_before_any_rpc() {
    let dir = tempfile::tempdir().unwrap();
    csi_agent_testkit::require_private_mount_namespace();
    let mut config = managed_config(PLUGIN, &dir.path().join("plugin"), "vol1:1M");
    let args = config["containers"][0]["command"]["arguments"]
        .as_array_mut()
        .unwrap();
    args.push("--hide-controller-capabilities".into());
    args.push("LIST_VOLUMES,GET_CAPACITY".into());
    let daemon = Daemon::builder(dir.path())
        .plugin_config("test.json", config)
        .start();
    let api = daemon.api();

    let (status, body) = api_error(api.backend_volumes(PLUGIN, None, None).await);
    assert_eq!(status, 501, "{body:?}");
    assert_eq!(body.code, ErrorCode::Unsupported);
    assert!(body.message.contains("LIST_VOLUMES"), "{}", body.message);
    let capacity = csi_agent_api::CapacityRequest {
        plugin: PLUGIN.to_owned(),
        capabilities: Vec::new(),
        parameters: Default::default(),
        accessible_topology: None,
    };
    let (status, body) = api_error(api.capacity(&capacity).await);
    assert_eq!(status, 501, "{body:?}");
    assert!(body.message.contains("GET_CAPACITY"), "{}", body.message);

    let calls = std::fs::read_to_string(dir.path().join("plugin/calls.jsonl")).unwrap();
    assert!(!calls.contains("\"ListVolumes\""), "{calls}");
    assert!(!calls.contains("\"GetCapacity\""), "{calls}");
}
