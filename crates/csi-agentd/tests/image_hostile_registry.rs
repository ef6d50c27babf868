//! Issue #23, item 2, through the real daemon: a hostile registry on loopback
//! (`csi_agent_testkit::registry::hostile`) sending an endless manifest, or a 404 with an endless body,
//! to `csi-agentd` pulling for a plugin config and for `POST /v1/images/pull`. The pull fails
//! at the cap with a 400 naming the registry, the reference and the cap; the daemon's RSS
//! (`VmRSS`) stays under 64 MiB above its idle RSS; `GET /v1/health` and `GET /v1/plugins`
//! answer throughout. And item 4: a plugin whose image is cached restarts after a crash as
//! fast while another plugin's pull trickles below the throughput floor, which fails it.
//! Run under `unshare -m --propagation private`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::{Duration, Instant};

use serde_json::json;

use csi_agent_testkit::image::*;
use csi_agent_testkit::registry::hostile::{HostileRegistry, Hostility};
use csi_agent_testkit::registry::*;
use csi_agent_testkit::*;

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

/// A daemon (not started) pulling from `host` over plain HTTP, launching its plugins at
/// start, with `extra` flags.
fn starting_daemon(dir: &std::path::Path, host: &str, extra: &[&str]) -> Daemon {
    let mut args = vec![
        "--docker-registry",
        host,
        "--insecure-registry",
        host,
        "--start-plugins",
    ];
    args.extend_from_slice(extra);
    Daemon::new(dir, &args)
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
        let mut daemon = starting_daemon(dir.path(), &host, &[]);
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

const CACHED: &str = "org.example.cached";
const TRICKLED: &str = "org.example.trickled";

/// Kills the cached plugin's process and returns how long until it is ready again (a new
/// pid), polling every 10 ms.
async fn kill_and_time_restart(daemon: &Daemon) -> Duration {
    let info = wait_plugin(daemon, CACHED, "the cached plugin ready", |i| {
        ready_pid(i).is_some()
    })
    .await;
    let pid = ready_pid(&info).unwrap();
    let killed = Instant::now();
    assert!(
        std::process::Command::new("kill")
            .args(["-KILL", &pid.to_string()])
            .status()
            .unwrap()
            .success()
    );
    let api = daemon.api();
    loop {
        if let Ok(info) = api.plugin(CACHED).await
            && ready_pid(&info).is_some_and(|p| p != pid)
        {
            return killed.elapsed();
        }
        assert!(
            killed.elapsed() < Duration::from_secs(60),
            "not restarted: {}",
            std::fs::read_to_string(daemon.work.parent().unwrap().join("daemon.log"))
                .unwrap_or_default()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// The H3 through the real daemon, scaled down: plugin A runs `csi/good:v1` (cached
/// after its first start); plugin B names `csi/bad:v1`, whose layer the registry trickles at
/// 1 byte per second, under the default 30 s stall bound, with the floor set to 64 bytes/s
/// over 4 s (`--image-pull-min-bytes-per-sec`, `--image-pull-floor-window-secs`). A's
/// restart after a SIGKILL of its process, timed three times while B's pulls trickle (the
/// daemon restarted with B's config added), is within 1 s of its restart before B existed; B's pulls fail by the floor (its error says
/// "too slow") and are retried.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_trickled_pull_does_not_delay_a_cached_plugins_restart() {
    csi_agent::mounts::require_private_mount_namespace();
    let dir = tempfile::Builder::new()
        .prefix("csi-trickle-")
        .tempdir_in("/tmp")
        .unwrap();
    let plugin_dir = dir.path().join("plugin");
    std::fs::create_dir_all(&plugin_dir).unwrap();
    let layout = dir.path().join("layout");
    let good = plugin_image(&layout, &plugin_dir);
    let registry = HostileRegistry::start(
        &layout,
        &good,
        Hostility::TrickleLayer(Duration::from_secs(1)),
    );
    let host = registry.host();
    let containers = Containers(dir.path().join("sockets/runc"));
    let mut daemon = starting_daemon(
        dir.path(),
        &host,
        &[
            "--image-pull-min-bytes-per-sec",
            "64",
            "--image-pull-floor-window-secs",
            "4",
        ],
    );
    let backoff = json!({"initial_ms": 100, "max_ms": 100});
    let mut cached = image_plugin(CACHED, "csi/good:v1", vec![volume(&plugin_dir)], 20000);
    cached["restart_backoff"] = backoff.clone();
    daemon.add_config("cached.json", &cached);
    daemon.start();
    // Before B exists: the baseline restart, after one to warm up.
    kill_and_time_restart(&daemon).await;
    let baseline = kill_and_time_restart(&daemon).await;

    let mut trickled = image_plugin(TRICKLED, "csi/bad:v1", vec![], 20000);
    trickled["restart_backoff"] = backoff;
    daemon.add_config("trickled.json", &trickled);
    // Restarted with both (`--start-plugins` launches B at once; A's container is adopted).
    daemon.kill9();
    daemon.start();
    let waited = Instant::now();
    while registry.trickled.load(std::sync::atomic::Ordering::SeqCst) == 0 {
        assert!(waited.elapsed() < Duration::from_secs(20), "B never pulled");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let mut slowest = Duration::ZERO;
    for _ in 0..3 {
        let before = registry.trickled.load(std::sync::atomic::Ordering::SeqCst);
        let took = kill_and_time_restart(&daemon).await;
        slowest = slowest.max(took);
        // B was still trickling meanwhile (a byte a second), never ready.
        let info = daemon.api().plugin(TRICKLED).await.unwrap();
        assert!(ready_pid(&info).is_none(), "{info:?}");
        tokio::time::sleep(Duration::from_millis(1500)).await;
        assert!(
            registry.trickled.load(std::sync::atomic::Ordering::SeqCst) > before,
            "no pull was trickling"
        );
    }
    eprintln!("cached plugin restart: {baseline:?} alone, at most {slowest:?} while B trickles");
    assert!(
        slowest < baseline + Duration::from_secs(1),
        "restart {slowest:?} against {baseline:?} alone"
    );
    // B's pulls fail by the floor, not the stall bound, and are retried.
    let info = wait_plugin(&daemon, TRICKLED, "B failing by the floor", |i| {
        i.components.first().is_some_and(|c| {
            c.restarts >= 1 && c.error.as_deref().is_some_and(|e| e.contains("too slow"))
        })
    })
    .await;
    let error = info.components[0].error.clone().unwrap();
    for part in [host.as_str(), "csi/bad:v1", "64 bytes/s"] {
        assert!(error.contains(part), "{error} lacks {part}");
    }

    for file in ["cached.json", "trickled.json"] {
        std::fs::remove_file(daemon.configs.join(file)).unwrap();
    }
    daemon.api().reload().await.unwrap();
    containers.wait_gone().await;
    daemon.kill9();
}
