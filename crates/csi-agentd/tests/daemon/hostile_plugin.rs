//! A hostile or broken plugin, on the real daemon with the real test plugin, whose fault file
//! (`faults.json`, see the test plugin's README) makes it hang on an RPC, answer an empty or
//! garbled name, hide the CSI versions it speaks, answer a huge message, answer a volume id
//! that is not one, or list a volume twice. The daemon never panics, bounds every wait,
//! answers reads meanwhile, refuses or reports each answer clearly, and records no wrong
//! state. Run under `unshare -m --propagation private`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::{Duration, Instant};

use csi_agent::mounts::require_private_mount_namespace;
use csi_agent_api::{ApiError, CreateVolumeRequest};
use csi_agent_testkit::node::*;
use csi_agent_testkit::*;
use serde_json::{Value, json};

const OTHER: &str = "org.example.other";

fn refusal<T: std::fmt::Debug>(result: Result<T, ApiError>) -> (u16, String) {
    match result {
        Err(ApiError::Api { status, body }) => (status, body.message),
        other => panic!("expected a refusal, got {other:?}"),
    }
}

/// Kills, when dropped, the plugin processes working on its dir (a second plugin that the
/// node's own cleanup does not know), by pid.
struct Reaper(std::path::PathBuf);

impl Drop for Reaper {
    fn drop(&mut self) {
        for pid in plugin_pids(&self.0) {
            kill9_pid(pid);
        }
    }
}

/// A node whose plugin config gets `extra` top-level fields.
fn node_with(volumes: &str, extra: &Value) -> Node {
    require_private_mount_namespace();
    let node = Node::new(volumes);
    let path = node.configs.join("test.json");
    let mut config: Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    for (key, value) in extra.as_object().unwrap() {
        config[key] = value.clone();
    }
    std::fs::write(&path, serde_json::to_vec_pretty(&config).unwrap()).unwrap();
    node
}

/// Waits until a publish of `volume` by `workload` fails with a message holding `wanted`
/// (the plugin is relaunched with backoff after each refused launch).
async fn publish_refused_with(node: &Node, volume: &str, workload: &str, wanted: &str) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let (_, message) = refusal(node.publish(volume, workload).await);
        if message.contains(wanted) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "last refusal {message:?} never held {wanted:?}\n{}",
            node.log_text()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[tokio::test]
async fn a_hung_rpc_is_answered_within_the_deadline_and_other_plugins_and_reads_go_on() {
    let mut node = node_with("vol1:1M", &json!({ "rpc_deadline_ms": 2000 }));
    // A second plugin, of its own type and state, that behaves.
    let mut other: Value =
        serde_json::from_slice(&std::fs::read(node.configs.join("test.json")).unwrap()).unwrap();
    other["type"] = json!(OTHER);
    let other_dir = node.root.path().join("other-plugin");
    let args = other["containers"][0]["command"]["arguments"]
        .as_array_mut()
        .unwrap();
    let at = args.iter().position(|a| a == "--work-dir").unwrap();
    args[at + 1] = json!(other_dir);
    let _reaper = Reaper(other_dir.clone());
    std::fs::write(
        node.configs.join("other.json"),
        serde_json::to_vec_pretty(&other).unwrap(),
    )
    .unwrap();
    node.set_faults(&json!({
        "rules": [{ "method": "NodeStageVolume", "delay_ms": 600000 }]
    }));
    node.start(None).await;
    node.wait_recovered().await;

    let api = node.api();
    let started = Instant::now();
    let hung = tokio::spawn({
        let api = node.api();
        async move { api.publish(&publish_with_secrets("vol1", "w1")).await }
    });
    // While NodeStage hangs: health, the plugin list and the other plugin answer promptly.
    tokio::time::sleep(Duration::from_millis(300)).await;
    for _ in 0..3 {
        let asked = Instant::now();
        api.health().await.unwrap();
        let plugins = api.plugins().await.unwrap();
        assert_eq!(plugins.plugins.len(), 2);
        api.plugin(PLUGIN).await.unwrap();
        assert!(
            asked.elapsed() < Duration::from_secs(1),
            "reads took {:?} during a hung RPC",
            asked.elapsed()
        );
    }
    let mut request = publish_with_secrets("vol1", "w2");
    request.plugin = OTHER.to_owned();
    api.publish(&request).await.unwrap();
    assert!(!hung.is_finished(), "the hung publish answered too early");

    // Each hung call ends at its RPC deadline (2 s), not at the plugin's leisure (10 min),
    // and is retried as a transient error while the operation's time lasts.
    eventually(
        "a NodeStage call cut at its deadline",
        Duration::from_secs(10),
        || async {
            let (count, sum) = deadline_metric(&node).await;
            if count >= 1.0 {
                Ok(())
            } else {
                Err(format!("{count} calls, {sum} s"))
            }
        },
    )
    .await;
    let (count, sum) = deadline_metric(&node).await;
    assert!(sum / count < 3.0, "{count} calls took {sum} s");
    assert!(!hung.is_finished(), "the publish gave up early");
    // The record says what is known meanwhile: the claim, and a stage whose outcome is
    // uncertain.
    let info = api.volume(PLUGIN, "vol1").await.unwrap();
    assert_eq!(info.state, "NODE_STAGE", "{info:?}");
    assert_eq!(info.claims, vec!["w1".to_owned()]);
    assert!(!node.plugin_holds("vol1").unwrap().published);

    // The plugin still sleeps in the first call. Once it is replaced by one that behaves,
    // the next try of the same request goes through, long before the operation's own limit
    // (120 s): the state recorded is the true one.
    node.clear_faults();
    node.kill_plugins().await;
    hung.await.unwrap().unwrap();
    assert!(started.elapsed() < Duration::from_secs(40));
    let info = api.volume(PLUGIN, "vol1").await.unwrap();
    assert_eq!(info.state, "PUBLISHED");
    assert!(node.plugin_holds("vol1").unwrap().published);
    assert!(node.mounts().contains(&node.target("vol1")));
}

/// The count and total seconds of NodeStageVolume calls that ended DEADLINE_EXCEEDED.
async fn deadline_metric(node: &Node) -> (f64, f64) {
    let text = node.api().metrics().await.unwrap();
    let labels =
        format!("{{plugin=\"{PLUGIN}\",method=\"NodeStageVolume\",code=\"DEADLINE_EXCEEDED\"}}");
    let value = |name: &str| {
        text.lines()
            .find_map(|line| line.strip_prefix(&format!("{name}{labels} ")))
            .map(|v| v.trim().parse::<f64>().unwrap())
            .unwrap_or(0.0)
    };
    (
        value("csi_agent_rpc_duration_seconds_count"),
        value("csi_agent_rpc_duration_seconds_sum"),
    )
}

#[tokio::test]
async fn an_empty_or_garbled_plugin_name_is_refused_at_launch_naming_it() {
    let mut node = node_with(
        "vol1:1M",
        &json!({
            "startup_timeout_ms": 3000,
            "restart_backoff": { "initial_ms": 100, "max_ms": 200, "reset_after_ms": 60000 }
        }),
    );
    node.set_faults(&json!({ "plugin_name": "" }));
    node.start(None).await;
    publish_refused_with(&node, "vol1", "w1", "the plugin answered an empty name").await;
    node.set_faults(&json!({ "plugin_name": "evil\nname" }));
    publish_refused_with(
        &node,
        "vol1",
        "w1",
        "the plugin's name \"evil\\nname\" holds whitespace or control characters",
    )
    .await;
    node.set_faults(&json!({ "plugin_name": "x".repeat(300) }));
    publish_refused_with(&node, "vol1", "w1", "name is 300 bytes long").await;
    // Nothing was staged or published meanwhile; the record holds only the wanted claim.
    assert_eq!(node.plugin_holds("vol1").unwrap(), PluginHolds::default());
    assert!(node.mounts().is_empty(), "{:?}", node.mounts());
    // A well-behaved plugin again: the same request goes through.
    node.clear_faults();
    eventually(
        "the publish to succeed",
        Duration::from_secs(30),
        || async {
            node.publish("vol1", "w1")
                .await
                .map(|_| ())
                .map_err(|e| e.to_string())
        },
    )
    .await;
    assert!(node.plugin_holds("vol1").unwrap().published);
}

#[tokio::test]
async fn a_plugin_that_hides_its_versions_is_refused_clearly() {
    let mut node = node_with(
        "vol1:1M",
        &json!({
            "startup_timeout_ms": 3000,
            "restart_backoff": { "initial_ms": 100, "max_ms": 200, "reset_after_ms": 60000 }
        }),
    );
    // Probe is what tells the version: unimplemented in v1 and in v0.
    node.set_faults(&json!({
        "rules": [{ "method": "Probe", "fail": { "code": "UNIMPLEMENTED", "message": "hidden" } }]
    }));
    node.start(None).await;
    let started = Instant::now();
    publish_refused_with(&node, "vol1", "w1", "Probe").await;
    assert!(started.elapsed() < Duration::from_secs(30));
    let (_, message) = refusal(node.publish("vol1", "w1").await);
    assert!(
        message.contains("UNIMPLEMENTED") || message.contains("Unimplemented"),
        "{message}"
    );
    let info = node.api().plugin(PLUGIN).await.unwrap();
    assert!(info.csi_version.is_none(), "{info:?}");
    assert_eq!(node.plugin_holds("vol1").unwrap(), PluginHolds::default());
    node.api().plugins().await.unwrap();
}

#[tokio::test]
async fn a_huge_answer_is_refused_by_size_and_the_plugin_still_serves() {
    let mut node = node_with("vol1:1M", &json!({}));
    // 5 MiB of vendor_version: more than a CSI message may be (4 MiB).
    node.set_faults(&json!({ "vendor_version_bytes": 5 << 20 }));
    node.start(None).await;
    node.wait_recovered().await;
    node.publish("vol1", "w1").await.unwrap();
    let warnings = node.log_events("GetPluginInfo failed; the plugin's name is not checked");
    assert!(!warnings.is_empty(), "{}", node.log_text());
    let error = warnings[0]["error"].as_str().unwrap();
    assert!(error.contains("GetPluginInfo"), "{error}");
    assert!(
        error.to_lowercase().contains("message") && error.contains("large"),
        "{error}"
    );
    assert!(node.plugin_holds("vol1").unwrap().published);
}

#[tokio::test]
async fn a_wrong_volume_id_is_refused_and_duplicates_are_listed_once() {
    let mut node = node_with("vol1:1M,vol2:1M", &json!({}));
    node.start(None).await;
    node.wait_recovered().await;
    let create = |name: &str| CreateVolumeRequest {
        plugin: PLUGIN.to_owned(),
        name: name.to_owned(),
        capacity_bytes: 1 << 20,
        capability: publish_with_secrets("x", "y").capability,
        parameters: Default::default(),
        accessibility_requirements: None,
        content_source: None,
    };
    for (answer, wanted) in [
        (String::new(), "CreateVolume returned an empty volume_id"),
        ("v".repeat(300), "300 bytes"),
    ] {
        node.set_faults(&json!({ "created_volume_id": answer }));
        let (status, message) = refusal(node.api().create_volume(&create("newvol")).await);
        assert!(status >= 400, "{status}");
        assert!(message.contains(wanted), "{message}");
    }
    // Nothing recorded for the answers that were refused.
    assert!(
        csi_agent::store::db::dump(&node.work)
            .unwrap_or_default()
            .is_empty()
    );
    node.set_faults(&json!({ "list_duplicates": true }));
    let page = node
        .api()
        .backend_volumes(PLUGIN, None, None)
        .await
        .unwrap();
    let mut ids: Vec<_> = page.volumes.iter().map(|v| v.volume_id.clone()).collect();
    let listed = ids.len();
    ids.dedup();
    assert_eq!(listed, ids.len(), "a duplicate was listed: {ids:?}");
    assert!(ids.contains(&"vol1".to_owned()) && ids.contains(&"vol2".to_owned()));
    assert!(
        node.log_text()
            .contains("plugin listed a volume twice; ignoring the duplicate")
    );
    // The plugin still serves the volumes it really has.
    node.clear_faults();
    node.publish("vol1", "w1").await.unwrap();
}
