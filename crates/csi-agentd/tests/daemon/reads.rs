//! Reads never wait: `GET /v1/volumes` (filtered and paged), `GET /v1/plugins`, a volume's
//! status and the metrics answer from snapshots while a publish is stuck in a plugin RPC and
//! while a plugin is still starting after a restart, on the real daemon and the real test
//! plugin.
//!
//! Real bind mounts: run as root under `unshare -m --propagation private`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::{Duration, Instant};

use csi_agent::mounts::require_private_mount_namespace;
use csi_agent_api::{ApiError, VolumeQuery};
use csi_agent_testkit::node::*;
use csi_agent_testkit::*;
use serde_json::{Value, json};

/// A read that must not wait: an upper bound far above what a read takes (a few ms, printed),
/// and far below the plugin delays the tests inject.
const READ_BOUND: Duration = Duration::from_millis(100);
/// An operation on another volume, which makes its own RPCs and durable write.
const OTHER_OPERATION_BOUND: Duration = Duration::from_secs(1);

async fn timed<T>(what: &str, read: impl std::future::Future<Output = T>) -> T {
    timed_within(what, READ_BOUND, read).await
}

async fn timed_within<T>(
    what: &str,
    bound: Duration,
    read: impl std::future::Future<Output = T>,
) -> T {
    let started = Instant::now();
    let value = read.await;
    let took = started.elapsed();
    println!("{what}: {took:?}");
    assert!(took < bound, "{what} took {took:?}: it waited");
    value
}

fn query(f: impl FnOnce(&mut VolumeQuery)) -> VolumeQuery {
    let mut query = VolumeQuery::default();
    f(&mut query);
    query
}

fn ids(list: &csi_agent_api::VolumeList) -> Vec<String> {
    list.volumes.iter().map(|v| v.volume_id.clone()).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_volume_list_filters_and_pages_in_id_order() {
    require_private_mount_namespace();
    // `a-b` sorts before `a.b` raw, after it percent-encoded (`a%2Eb`): the page token
    // must follow the raw order the list is in.
    let mut node = Node::new("a-b:1Mi,a.b:1Mi,c:1Mi");
    node.start(None).await;
    node.wait_recovered().await;
    node.publish("a-b", "w1").await.unwrap();
    node.publish("a.b", "w2").await.unwrap();
    node.publish("c", "w1").await.unwrap();
    let api = node.api();

    let all = api.volumes().await.unwrap();
    assert_eq!(ids(&all), ["a-b", "a.b", "c"]);
    assert_eq!(all.next_page_token, None);
    assert!(!all.recovering, "recovery is over: {all:?}");

    let mut paged = Vec::new();
    let mut token = None;
    for page in 1.. {
        assert!(page <= 3, "more pages than volumes: {paged:?}");
        let list = api
            .volumes_matching(&query(|q| {
                q.limit = Some(1);
                q.page_token = token.clone();
            }))
            .await
            .unwrap();
        assert_eq!(list.volumes.len(), 1, "page {page}: {list:?}");
        paged.extend(ids(&list));
        token = list.next_page_token;
        if token.is_none() {
            break;
        }
    }
    assert_eq!(paged, ids(&all), "paging one by one gives the whole list");

    let two = api
        .volumes_matching(&query(|q| q.limit = Some(2)))
        .await
        .unwrap();
    assert_eq!(ids(&two), ["a-b", "a.b"]);
    let rest = api
        .volumes_matching(&query(|q| {
            q.limit = Some(2);
            q.page_token = two.next_page_token.clone();
        }))
        .await
        .unwrap();
    assert_eq!(ids(&rest), ["c"]);
    assert_eq!(rest.next_page_token, None, "the last page says so");

    let w1 = api
        .volumes_matching(&query(|q| q.workload = Some("w1".into())))
        .await
        .unwrap();
    assert_eq!(ids(&w1), ["a-b", "c"]);
    let published = api
        .volumes_matching(&query(|q| q.state = Some("PUBLISHED".into())))
        .await
        .unwrap();
    assert_eq!(ids(&published), ["a-b", "a.b", "c"]);
    let staged = api
        .volumes_matching(&query(|q| q.state = Some("NODE_STAGE".into())))
        .await
        .unwrap();
    assert!(staged.volumes.is_empty(), "{staged:?}");
    let other = api
        .volumes_matching(&query(|q| q.plugin = Some("org.example.other".into())))
        .await
        .unwrap();
    assert!(other.volumes.is_empty(), "{other:?}");
    let mine = api
        .volumes_matching(&query(|q| {
            q.plugin = Some(PLUGIN.into());
            q.workload = Some("w2".into());
        }))
        .await
        .unwrap();
    assert_eq!(ids(&mine), ["a.b"]);

    // Bad queries: a 400 that names what to fix.
    for (bad, names) in [
        (query(|q| q.limit = Some(0)), "limit 0"),
        (query(|q| q.limit = Some(10_001)), "limit 10001"),
        (
            query(|q| q.page_token = Some("garbage".into())),
            "page_token",
        ),
        (query(|q| q.page_token = Some("a.%zz".into())), "page_token"),
    ] {
        match api.volumes_matching(&bad).await {
            Err(ApiError::Api { status, body, .. }) => {
                assert_eq!(status, 400, "{bad:?}: {body:?}");
                assert!(body.message.contains(names), "{bad:?}: {}", body.message);
            }
            other => panic!("{bad:?} was accepted: {other:?}"),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_list_longer_than_a_chunk_reads_back_whole_and_pages() {
    // 300 volumes make a body of well over one 64 KiB chunk: the streamed list must read
    // back as one valid `VolumeList`, in order, with the page token at its end.
    require_private_mount_namespace();
    let names: Vec<String> = (0..300).map(|i| format!("vol{i:03}")).collect();
    let spec: Vec<String> = names.iter().map(|n| format!("{n}:1Mi")).collect();
    let mut node = Node::new(&spec.join(","));
    node.start(None).await;
    node.wait_recovered().await;
    for name in &names {
        node.publish(name, "w1").await.unwrap();
    }
    let api = node.api();
    let all = api.volumes().await.unwrap();
    assert_eq!(ids(&all), names);
    assert_eq!(all.next_page_token, None);
    let body = serde_json::to_vec(&all).unwrap().len();
    assert!(body > 64 * 1024, "only {body} bytes: not several chunks");

    let first = api
        .volumes_matching(&query(|q| q.limit = Some(250)))
        .await
        .unwrap();
    assert_eq!(ids(&first), names[..250]);
    let rest = api
        .volumes_matching(&query(|q| {
            q.limit = Some(250);
            q.page_token = first.next_page_token.clone();
        }))
        .await
        .unwrap();
    assert_eq!(ids(&rest), names[250..]);
    assert_eq!(rest.next_page_token, None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reads_answer_while_a_publish_is_stuck_in_the_plugin() {
    require_private_mount_namespace();
    let mut node = Node::new("fast:1Mi,slow:1Mi,other:1Mi");
    node.start(None).await;
    node.wait_recovered().await;
    node.publish("fast", "w1").await.unwrap();
    node.set_faults(&json!({"rules": [
        {"id": "stuck", "method": "NodeStageVolume", "delay_ms": 6000, "times": 1}
    ]}));
    let api = node.api();
    let stuck = tokio::spawn({
        let api = api.clone();
        async move { api.publish(&publish_with_secrets("slow", "w2")).await }
    });
    eventually(
        "the stuck NodeStageVolume to be in the plugin",
        Duration::from_secs(5),
        || async {
            if node.fault_fired("stuck") > 0 {
                Ok(())
            } else {
                Err("not yet".to_owned())
            }
        },
    )
    .await;

    for _ in 0..3 {
        let list = timed("GET /v1/volumes", api.volumes()).await.unwrap();
        assert!(
            ids(&list).starts_with(&["fast".to_owned(), "slow".to_owned()]),
            "the stuck volume is listed: {list:?}"
        );
        let slow = &list.volumes[1];
        assert_ne!(slow.state, "PUBLISHED", "not published yet: {slow:?}");
        let plugins = timed("GET /v1/plugins", api.plugins()).await.unwrap();
        assert_eq!(plugins.plugins.len(), 1);
        let fast = timed("GET /v1/volumes/{fast}", api.volume(PLUGIN, "fast"))
            .await
            .unwrap();
        assert_eq!(fast.state, "PUBLISHED");
        timed("GET /v1/volumes/{slow}", api.volume(PLUGIN, "slow"))
            .await
            .unwrap();
        let metrics = timed("GET /metrics", api.metrics()).await.unwrap();
        assert!(metrics.contains("csi_agent"), "{metrics}");
        let reload = timed("POST /v1/reload", api.reload()).await.unwrap();
        assert!(reload.config_errors.is_empty(), "{reload:?}");
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    // Operations on other volumes go on meanwhile.
    timed_within(
        "publish of another volume",
        OTHER_OPERATION_BOUND,
        node.publish("other", "w3"),
    )
    .await
    .unwrap();
    timed_within(
        "unpublish of another volume",
        OTHER_OPERATION_BOUND,
        node.unpublish("other", "w3"),
    )
    .await
    .unwrap();
    assert!(!stuck.is_finished(), "the publish was meant to be stuck");
    let published = stuck.await.unwrap().unwrap();
    assert_eq!(published.state, "PUBLISHED");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reads_answer_while_a_plugin_starts_after_a_restart() {
    require_private_mount_namespace();
    let mut node = Node::new("v:1Mi");
    node.start(None).await;
    node.wait_recovered().await;
    node.publish("v", "w1").await.unwrap();
    node.kill9();
    node.kill_plugins().await;

    // The plugin now takes 4 s to create its socket: the daemon's reconcile of the volume
    // waits that long; reads must not.
    let config_file = node.configs.join("test.json");
    let mut config: Value = serde_json::from_slice(&std::fs::read(&config_file).unwrap()).unwrap();
    let arguments = config["containers"][0]["command"]["arguments"]
        .as_array_mut()
        .unwrap();
    arguments.extend([json!("--startup-delay-ms"), json!("4000")]);
    std::fs::write(&config_file, serde_json::to_vec(&config).unwrap()).unwrap();

    // First with the start gate closed: the list answers at once and says it may grow.
    node.extra = vec!["--start".into(), "on-request".into()];
    node.start(None).await;
    let api = node.api();
    let gated = timed("GET /v1/volumes before the start", api.volumes())
        .await
        .unwrap();
    assert!(gated.recovering, "the gate is closed: {gated:?}");
    timed("GET /v1/plugins before the start", api.plugins())
        .await
        .unwrap();

    let started = Instant::now();
    api.start().await.unwrap();
    eventually(
        "the recovered volume to be listed",
        Duration::from_secs(3),
        || async {
            let list = api.volumes().await.map_err(|e| e.to_string())?;
            if ids(&list) == ["v"] {
                Ok(())
            } else {
                Err(format!("{list:?}"))
            }
        },
    )
    .await;
    for _ in 0..3 {
        let list = timed("GET /v1/volumes during the reconcile", api.volumes())
            .await
            .unwrap();
        assert_eq!(ids(&list), ["v"]);
        timed("GET /v1/plugins during the reconcile", api.plugins())
            .await
            .unwrap();
        timed(
            "GET /v1/volumes/{v} during the reconcile",
            api.volume(PLUGIN, "v"),
        )
        .await
        .unwrap();
    }
    assert!(
        started.elapsed() < Duration::from_secs(4),
        "the reads came before the plugin could be up: the test proves nothing otherwise"
    );

    eventually(
        "the reconcile to publish the volume again",
        Duration::from_secs(30),
        || async {
            let list = api.volumes().await.map_err(|e| e.to_string())?;
            match list.volumes.first() {
                Some(v) if !list.recovering && v.state == "PUBLISHED" => Ok(()),
                _ => Err(format!("{list:?}")),
            }
        },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_publish_in_a_retry_loop_shows_its_attempts_and_logs_each_at_info() {
    require_private_mount_namespace();
    let mut node = Node::new("busy:1Mi,other:1Mi");
    node.start(None).await;
    node.wait_recovered().await;
    node.publish("other", "w1").await.unwrap();
    // Seven UNAVAILABLE answers: with the 50 ms doubling backoff the publish retries for
    // about six seconds before it succeeds.
    node.set_faults(&json!({"rules": [
        {"id": "busy", "method": "NodeStageVolume", "fail": {"code": "UNAVAILABLE",
         "message": "backend busy"}, "times": 7}
    ]}));
    let api = node.api();
    let publishing = tokio::spawn({
        let api = api.clone();
        async move { api.publish(&publish_with_secrets("busy", "w2")).await }
    });
    let deadline = Instant::now() + Duration::from_secs(10);
    let op = loop {
        let volume = api.volume(PLUGIN, "busy").await;
        if let Ok(csi_agent_api::VolumeInfo {
            operation: Some(op),
            ..
        }) = &volume
            && op.attempt >= 3
        {
            break op.clone();
        }
        assert!(
            Instant::now() < deadline,
            "the retrying publish never showed its attempts: {volume:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    println!("operation while retrying: {op:?}");
    assert_eq!(op.operation, "publish");
    assert_eq!(op.step.as_deref(), Some("node_stage"));
    assert!(
        op.last_error
            .as_deref()
            .is_some_and(|e| e.contains("UNAVAILABLE") && e.contains("backend busy")),
        "{op:?}"
    );
    // Reads and another volume's operations do not wait for the retrying one.
    let list = timed("GET /v1/volumes", api.volumes()).await.unwrap();
    assert!(
        list.volumes
            .iter()
            .any(|v| v.volume_id == "busy" && v.operation.is_some())
    );
    timed("GET /v1/plugins", api.plugins()).await.unwrap();
    timed_within(
        "unpublish of another volume",
        OTHER_OPERATION_BOUND,
        node.unpublish("other", "w1"),
    )
    .await
    .unwrap();

    let published = publishing.await.unwrap().unwrap();
    assert_eq!(published.state, "PUBLISHED");
    let done = api.volume(PLUGIN, "busy").await.unwrap();
    assert_eq!(done.operation, None, "nothing in progress once published");
    let retries = node.log_events("transient error; retrying");
    assert_eq!(retries.len(), 7, "one info line per attempt: {retries:?}");
    assert!(
        retries
            .iter()
            .all(|event| event["code"] == "UNAVAILABLE" && event["step"] == "node_stage"),
        "{retries:?}"
    );
    node.unpublish("busy", "w2").await.unwrap();
}
