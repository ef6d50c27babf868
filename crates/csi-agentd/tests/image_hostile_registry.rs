//! Issue #23, item 2, through the real daemon: a hostile registry on loopback
//! (`registry_support::hostile`) sending an endless manifest, or a 404 with an endless body,
//! to `csi-agentd` pulling for a plugin config and for `POST /v1/images/pull`. The pull fails
//! at the cap with a 400 naming the registry, the reference and the cap; the daemon's RSS
//! (`VmRSS`) stays under 64 MiB above its idle RSS; `GET /v1/health` and `GET /v1/plugins`
//! answer throughout. Run under `unshare -m --propagation private`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;
mod image_support;
#[path = "../../csi-agent/tests/registry_support/mod.rs"]
mod registry_support;

use std::time::{Duration, Instant};

use serde_json::json;

use common::*;
use image_support::*;
use registry_support::hostile::{HostileRegistry, Hostility};
use registry_support::*;

const PLUGIN: &str = "org.example.hostile";

fn vm_rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn endless_registry_answers_are_refused_at_the_cap_and_the_daemon_stays_small() {
    csi_agent::mounts::require_private_mount_namespace();
    let limit_kib = 64 * 1024;
    for (hostility, cap) in [
        (Hostility::EndlessManifest, 4u64 << 20),
        (Hostility::Endless404, 64 << 10),
    ] {
        let dir = tempfile::Builder::new()
            .prefix("csi-hostile-")
            .tempdir_in("/tmp")
            .unwrap();
        let layout = dir.path().join("layout");
        let good = oci_layout(
            &layout,
            &[layer_tar_gz(&[Entry::File {
                path: "x",
                data: b"x",
                mode: 0o644,
            }])],
            json!({"Cmd": ["/x"]}),
        )
        .unwrap();
        let registry = HostileRegistry::start(&layout, &good, hostility);
        let host = registry.host();
        let mut daemon = Daemon::new(
            dir.path(),
            &[
                "--docker-registry",
                &host,
                "--insecure-registry",
                &host,
                "--start-plugins",
            ],
        );
        daemon.add_config(
            "hostile.json",
            &json!({
                "type": PLUGIN,
                "containers": [component(
                    &["CONTROLLER_SERVICE", "NODE_SERVICE"],
                    json!({"type": "MESOS",
                           "mesos": {"image": {"type": "DOCKER", "docker": {"name": "csi/bad:v1"}}}}),
                )],
            }),
        );
        daemon.start();
        let pid = daemon.child.as_ref().unwrap().id();
        let api = daemon.api();
        api.health().await.unwrap();
        let idle = vm_rss_kib(pid);

        // The plugin's own pull, in the background; and one asked for on the API.
        let pull_api = daemon.api();
        let pull = tokio::spawn(async move { pull_api.pull_image("csi/bad:v1").await });
        let mut peak = idle;
        let mut slowest = Duration::ZERO;
        let started = Instant::now();
        let plugin_error = loop {
            peak = peak.max(vm_rss_kib(pid));
            let asked = Instant::now();
            api.health().await.unwrap();
            let plugins = api.plugins().await.unwrap();
            slowest = slowest.max(asked.elapsed());
            let info = plugins
                .plugins
                .iter()
                .find(|p| p.plugin_type == PLUGIN)
                .cloned();
            if pull.is_finished()
                && let Some(error) = info.and_then(|i| i.error).filter(|e| e.contains("bytes"))
            {
                break error;
            }
            assert!(
                started.elapsed() < Duration::from_secs(30),
                "{hostility:?}: no failure seen; {}",
                std::fs::read_to_string(dir.path().join("daemon.log")).unwrap_or_default()
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        };
        // A few more looks: the plugin's retries (if any) stay as small.
        for _ in 0..50 {
            peak = peak.max(vm_rss_kib(pid));
            api.health().await.unwrap();
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let (status, body) = api_error(pull.await.unwrap());
        assert_eq!(status, 400, "{hostility:?}: {body:?}");
        for message in [&body.message, &plugin_error] {
            for part in [host.as_str(), "csi/bad:v1", &cap.to_string()] {
                assert!(
                    message.contains(part),
                    "{hostility:?}: {message} lacks {part}"
                );
            }
        }
        eprintln!(
            "{hostility:?}: idle {idle} KiB, peak {peak} KiB (+{} KiB), slowest health+plugins {slowest:?}, registry wrote {} bytes",
            peak - idle,
            registry
                .endless_bytes
                .load(std::sync::atomic::Ordering::SeqCst)
        );
        assert!(
            peak < idle + limit_kib,
            "{hostility:?}: RSS {peak} KiB, idle {idle} KiB"
        );
        assert!(
            slowest < Duration::from_secs(1),
            "{hostility:?}: the API took {slowest:?}"
        );
        daemon.kill9();
    }
}
