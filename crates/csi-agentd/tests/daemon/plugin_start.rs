//! When plugins start: lazily by default (and `csictl plugins` says so, so that `0/1 ready`
//! is not mistaken for a failure), or all at once with `csi-agentd serve --start-plugins`.
//! The real daemon and the real test plugin; run under `unshare -m --propagation private`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::{Duration, Instant};

use csi_agent_testkit::*;

fn plugin_running(dir: &std::path::Path) -> bool {
    !plugin_pids(&dir.join("plugin")).is_empty()
}

#[tokio::test]
async fn a_lazily_started_plugin_is_shown_idle_and_starts_on_first_use() {
    let dir = tempfile::tempdir().unwrap();
    let daemon = setup(dir.path(), &[]);
    let api = daemon.api();
    // The gate opens at start (`--start immediate`); until then the plugin is `not_started`.
    let deadline = Instant::now() + Duration::from_secs(20);
    let plugin = loop {
        let plugin = api.plugin(PLUGIN).await.unwrap();
        if plugin.state != "not_started" || Instant::now() > deadline {
            break plugin;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    assert_eq!(plugin.state, "idle", "{plugin:?}");
    assert!(
        !plugin_running(dir.path()),
        "nothing launched before first use"
    );
    let shown = daemon.csictl(&["plugins"]);
    let text = String::from_utf8_lossy(&shown.stdout);
    assert!(
        text.contains("idle (starts on first use)"),
        "csictl explains the idle plugin: {text}"
    );
    api.publish(&publish_request("vol1", "w1")).await.unwrap();
    assert!(plugin_running(dir.path()));
    assert_eq!(api.plugin(PLUGIN).await.unwrap().state, "ready");
    api.unpublish(&unpublish_request("vol1", "w1"))
        .await
        .unwrap();
}

#[tokio::test]
async fn start_plugins_launches_every_plugin_when_the_daemon_starts() {
    let dir = tempfile::tempdir().unwrap();
    let daemon = setup(dir.path(), &["--start-plugins"]);
    let api = daemon.api();
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let plugin = api.plugin(PLUGIN).await.unwrap();
        if plugin.state == "ready" {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the plugin never became ready without a request: {plugin:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(plugin_running(dir.path()), "launched with no request made");
}
