//! Durable-write budget and node-only plugins: a publish and an unpublish each cost one
//! durable write per RPC plus one (docs/benchmarks.md, "Targets": 3 with stage + publish), counted by the store's
//! own metric; a node-only deployment never calls the Controller service, whatever the plugin
//! advertises.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod volume_support;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use csi_agent::client::ClientOptions;
use csi_agent::config::Service;
use csi_agent::endpoints::FixedEndpoints;
use csi_agent::layout::Layout;
use csi_agent::metrics::Metrics;
use csi_agent::store::Store;
use csi_agent::volume::{NewVolume, NodeContext, PluginEndpoints, VolumeConfig, VolumeManager};
use volume_support::*;

fn counted_manager(
    work: &std::path::Path,
    endpoints: Arc<dyn PluginEndpoints>,
    metrics: Arc<Metrics>,
) -> VolumeManager {
    let layout = Layout::new(work);
    let store = Store::open(layout.clone(), Some(metrics.clone())).unwrap();
    let mut context = NodeContext::new(layout, store, "boot-a".to_owned());
    context.metrics = Some(metrics);
    VolumeManager::new(
        VolumeConfig::new(PLUGIN_TYPE, "default"),
        endpoints,
        context,
    )
}

fn options() -> ClientOptions {
    ClientOptions {
        rpc_deadline: Duration::from_secs(5),
        plugin: PLUGIN_TYPE.to_owned(),
        metrics: None,
    }
}

/// Durable writes (commits an operation waited for) during `work`. Commits of progress
/// notes alone, which nobody waits for, are not the operation's.
async fn writes_of(metrics: &Metrics, work: impl std::future::Future<Output = ()>) -> u64 {
    let durable = || metrics.checkpoint_writes.get() - metrics.checkpoint_lazy_commits.get();
    let before = durable();
    work.await;
    durable() - before
}

#[tokio::test]
async fn stage_and_publish_cost_one_durable_write_each_way() {
    // Without and with ControllerPublish: 3 or 4 RPCs each way, one durable write.
    for controller in ["--no-controller-publish", "--controller-publish"] {
        one_durable_write_each_way(controller).await;
    }
}

async fn one_durable_write_each_way(controller: &str) {
    let dir = tempfile::tempdir().unwrap();
    let plugin = TestPlugin::start(
        dir.path(),
        &["--mount-mode", "none", controller, "--volumes", "v:1M"],
    );
    let metrics = Arc::new(Metrics::new());
    let endpoints = Arc::new(FixedEndpoints::single(plugin.socket.clone(), options()));
    let manager = counted_manager(&dir.path().join("agent"), endpoints, metrics.clone());
    // Warm the capability cache so that only the operation itself is counted.
    manager.publish(publish_request("v", "warm")).await.unwrap();
    manager.unpublish("v", "warm").await.unwrap();
    let publish = writes_of(&metrics, async {
        manager.publish(publish_request("v", "w1")).await.unwrap();
    })
    .await;
    let unpublish = writes_of(&metrics, async {
        manager.unpublish("v", "w1").await.unwrap();
    })
    .await;
    // One durable write per operation, whatever the number of RPCs: the claim (or its
    // removal), before the first RPC; the steps after it are progress notes.
    assert_eq!((publish, unpublish), (1, 1), "{controller}");
    // A second workload on a published volume: one write (its claim), no RPC.
    manager.publish(publish_request("v", "w1")).await.unwrap();
    let calls = plugin.calls().len();
    let shared = writes_of(&metrics, async {
        manager.publish(publish_request("v", "w2")).await.unwrap();
    })
    .await;
    assert_eq!(shared, 1);
    assert_eq!(plugin.calls().len(), calls);
    manager.unpublish("v", "w1").await.unwrap();
    manager.unpublish("v", "w2").await.unwrap();
}

#[tokio::test]
async fn a_node_only_deployment_never_calls_the_controller() {
    let dir = tempfile::tempdir().unwrap();
    // The plugin serves and advertises CONTROLLER_SERVICE (real plugins do even when deployed
    // node-only); the configuration lists only the node endpoint, so csi-agent must not use it.
    let plugin = TestPlugin::start(
        dir.path(),
        &[
            "--mount-mode",
            "none",
            "--no-controller-publish",
            "--volumes",
            "v:1M",
        ],
    );
    let node = csi_agent::client::CsiClient::connect(&plugin.socket, options())
        .await
        .unwrap();
    assert!(
        node.get_plugin_capabilities()
            .await
            .unwrap()
            .services
            .contains(&csi_proto::v1::plugin_capability::service::Type::ControllerService)
    );
    let endpoints: Arc<dyn PluginEndpoints> = Arc::new(FixedEndpoints::new(
        HashMap::from([(Service::Node, plugin.socket.clone())]),
        options(),
    ));
    let metrics = Arc::new(Metrics::new());
    let manager = counted_manager(&dir.path().join("agent"), endpoints, metrics);
    manager.publish(publish_request("v", "w1")).await.unwrap();
    manager.unpublish("v", "w1").await.unwrap();
    let controller_calls: Vec<String> = plugin
        .calls()
        .iter()
        .filter_map(|c| c["method"].as_str().map(str::to_owned))
        .filter(|m| m.starts_with("Controller"))
        .collect();
    assert!(controller_calls.is_empty(), "{controller_calls:?}");
    let err = manager
        .create_volume(NewVolume::new("x", 0, &mount_capability()))
        .await
        .unwrap_err();
    assert!(err.to_string().contains("no CONTROLLER_SERVICE"), "{err}");
}
