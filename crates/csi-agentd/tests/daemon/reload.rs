//! A reload never stalls the rest of the daemon: while a changed plugin's old component takes
//! its time to exit (its stop grace), `GET /v1/plugins` and another plugin's publish and
//! unpublish answer at once. The real daemon and two real test plugins; run under
//! `unshare -m --propagation private`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::{Duration, Instant};

use csi_agent_testkit::*;

const OTHER: &str = "org.example.other";
/// How long the changed plugin's old process keeps serving after SIGTERM.
const SLOW_EXIT_MS: u64 = 3000;

#[tokio::test]
async fn a_reload_waiting_for_a_slow_stop_blocks_no_read_and_no_other_plugin() {
    let dir = tempfile::tempdir().unwrap();
    let mut daemon = Daemon::new(dir.path(), &[]);
    let mut slow = managed_config(PLUGIN, &dir.path().join("plugin"), "vol1:1Mi");
    slow["containers"][0]["command"]["arguments"]
        .as_array_mut()
        .unwrap()
        .extend(["--exit-delay-ms".into(), SLOW_EXIT_MS.to_string().into()]);
    slow["stop_grace_ms"] = 10_000.into();
    daemon.add_config("test.json", &slow);
    daemon.add_config(
        "other.json",
        &managed_config(OTHER, &dir.path().join("plugin2"), "v:1Mi"),
    );
    csi_agent::mounts::require_private_mount_namespace();
    daemon.start();
    let api = daemon.api();
    api.publish(&publish_request("vol1", "w1")).await.unwrap();
    let mut other = publish_request("v", "w1");
    other.plugin = OTHER.to_owned();
    api.publish(&other).await.unwrap();

    // Change the slow plugin's config: its component is replaced, and the old one takes
    // SLOW_EXIT_MS to go.
    slow["node_id"] = "node-2".into();
    daemon.add_config("test.json", &slow);
    let started = Instant::now();
    let reload = tokio::spawn({
        let api = api.clone();
        async move { api.reload().await }
    });
    tokio::time::sleep(Duration::from_millis(300)).await;

    let timed = Instant::now();
    let plugins = api.plugins().await.unwrap();
    let plugins_took = timed.elapsed();
    assert_eq!(plugins.plugins.len(), 2);
    let timed = Instant::now();
    api.unpublish(&csi_agent_api::UnpublishRequest {
        plugin: OTHER.to_owned(),
        volume_id: "v".to_owned(),
        workload: "w1".to_owned(),
    })
    .await
    .unwrap();
    let other_took = timed.elapsed();
    println!(
        "during the reload: GET /v1/plugins {plugins_took:?}, other plugin's unpublish {other_took:?}"
    );
    assert!(
        plugins_took < Duration::from_millis(100),
        "GET /v1/plugins waited {plugins_took:?} for the reload"
    );
    assert!(
        other_took < Duration::from_secs(1),
        "the other plugin's unpublish waited {other_took:?} for the reload"
    );

    let report = reload.await.unwrap().unwrap();
    let reload_took = started.elapsed();
    println!("the reload itself took {reload_took:?}");
    assert_eq!(report.changed, vec![PLUGIN.to_owned()]);
    assert!(
        reload_took >= Duration::from_millis(SLOW_EXIT_MS - 500),
        "the reload did wait for the old component ({reload_took:?}): the test measured \
         something real"
    );
    // The replaced plugin keeps its volume and serves on its new component.
    api.unpublish(&unpublish_request("vol1", "w1"))
        .await
        .unwrap();
    assert!(mounts_under(&daemon.work).is_empty());
}
