//! Volume stats and health through the real daemon and the real test plugin
//! (`--volume-fs tmpfs --volume-stats --volume-condition`: each volume is a tmpfs of its own,
//! measured with `statvfs`): figures that follow writes, an injected abnormal condition seen
//! in the API, `/metrics`, `csictl` and exactly once in the log, a plugin whose
//! NodeGetVolumeStats hangs delaying nobody else, and a plugin without GET_VOLUME_STATS
//! refused before any RPC.
//!
//! Run as root under `unshare -m --propagation private` like the other daemon tests.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::Path;
use std::time::{Duration, Instant};

use csi_agent_api::{ApiClient, ErrorCode, PublishRequest};
use csi_agent_testkit::*;

const MIB: u64 = 1 << 20;
const SLOW: &str = "org.example.slow";

/// A managed test plugin config with volumes of their own file system and stats on.
fn stats_config(
    plugin_type: &str,
    plugin_dir: &Path,
    volumes: &str,
    extra: &[&str],
) -> serde_json::Value {
    let mut config = managed_config(plugin_type, plugin_dir, volumes);
    let args = config["containers"][0]["command"]["arguments"]
        .as_array_mut()
        .unwrap();
    for arg in ["--volume-fs", "tmpfs"].iter().chain(extra) {
        args.push((*arg).into());
    }
    config
}

fn publish_of(plugin: &str, volume: &str, workload: &str) -> PublishRequest {
    let mut request = publish_request(volume, workload);
    request.plugin = plugin.to_owned();
    request
}

/// The value of the one sample of `metric` whose labels include all of `labels`.
fn sample(metrics: &str, metric: &str, labels: &[&str]) -> Option<f64> {
    metrics
        .lines()
        .filter(|l| l.starts_with(&format!("{metric}{{")))
        .find(|l| labels.iter().all(|want| l.contains(want)))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

async fn used_bytes(api: &ApiClient, plugin: &str, volume: &str) -> Result<u64, String> {
    let stats = api
        .volume_stats(plugin, volume)
        .await
        .map_err(|e| e.to_string())?;
    stats
        .bytes
        .and_then(|b| b.used)
        .ok_or_else(|| format!("no used bytes: {stats:?}"))
}

/// Used bytes grow by what was written, total is the volume's capacity; an injected abnormal
/// condition shows on the stats, the volume, `csictl`, `/metrics`, and once in the log, as
/// does the return to normal; unpublishing drops the volume's series.
#[tokio::test]
async fn stats_follow_writes_and_an_abnormal_condition_shows_everywhere_once() {
    let dir = tempfile::tempdir().unwrap();
    require_private_mount_namespace();
    let plugin_dir = dir.path().join("plugin");
    let daemon = Daemon::builder(dir.path())
        .flags(&["--volume-stats-interval", "200ms"])
        .plugin_config(
            "test.json",
            stats_config(
                PLUGIN,
                &plugin_dir,
                "vol1:16Mi",
                &["--volume-stats", "--volume-condition"],
            ),
        )
        .start();
    let api = daemon.api();
    let published = api.publish(&publish_request("vol1", "w1")).await.unwrap();
    let target = Path::new(&published.target_path);

    let first = api.volume_stats(PLUGIN, "vol1").await.unwrap();
    let bytes = first.bytes.unwrap();
    assert_eq!(
        bytes.total,
        Some(16 * MIB),
        "the volume's own file system: {first:?}"
    );
    let used0 = bytes.used.unwrap();
    assert!(
        first.inodes.and_then(|i| i.total).is_some_and(|t| t > 0),
        "{first:?}"
    );
    assert_eq!(
        first.condition.as_ref().map(|c| c.abnormal),
        Some(false),
        "{first:?}"
    );
    assert!(
        first.collected_at.ends_with('Z') && first.collected_at.contains('T'),
        "{first:?}"
    );

    // 4 MiB written through the published target: the next rounds see them.
    std::fs::write(target.join("data"), vec![0x5a_u8; 4 * MIB as usize]).unwrap();
    eventually(
        "used bytes to grow by the write",
        Duration::from_secs(10),
        || async {
            let used = used_bytes(&api, PLUGIN, "vol1").await?;
            let grown = used.saturating_sub(used0);
            if (4 * MIB..4 * MIB + 256 * 1024).contains(&grown) {
                Ok(())
            } else {
                Err(format!("grew by {grown} bytes"))
            }
        },
    )
    .await;
    let metrics = api.metrics().await.unwrap();
    let labels = [
        r#"plugin="org.example.test""#,
        r#"volume_id="vol1""#,
        r#"workload="w1""#,
    ];
    assert_eq!(
        sample(&metrics, "csi_agent_volume_stats_capacity_bytes", &labels),
        Some((16 * MIB) as f64),
        "{metrics}"
    );
    assert!(
        sample(&metrics, "csi_agent_volume_stats_used_bytes", &labels)
            .is_some_and(|u| u >= (used0 + 4 * MIB) as f64),
        "{metrics}"
    );
    for metric in [
        "csi_agent_volume_stats_available_bytes",
        "csi_agent_volume_stats_inodes",
        "csi_agent_volume_stats_inodes_free",
        "csi_agent_volume_stats_inodes_used",
    ] {
        assert!(
            sample(&metrics, metric, &labels).is_some(),
            "{metric}: {metrics}"
        );
    }
    assert_eq!(
        sample(&metrics, "csi_agent_volume_health_abnormal", &labels),
        Some(0.0)
    );
    let out = daemon.csictl(&["stats", PLUGIN, "vol1"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text} {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(text.contains("total 16777216 (16Mi)"), "{text}");
    assert!(
        text.contains("condition") && text.contains("normal"),
        "{text}"
    );

    // Abnormal: in the stats, on the volume, in csictl, in /metrics; logged once although
    // every round (every 200-400 ms) sees it.
    std::fs::write(
        plugin_dir.join("faults.json"),
        r#"{"abnormal": {"vol1": "disk on fire"}}"#,
    )
    .unwrap();
    eventually(
        "the abnormal condition",
        Duration::from_secs(10),
        || async {
            let stats = api
                .volume_stats(PLUGIN, "vol1")
                .await
                .map_err(|e| e.to_string())?;
            match stats.condition {
                Some(c) if c.abnormal && c.message == "disk on fire" => Ok(()),
                other => Err(format!("{other:?}")),
            }
        },
    )
    .await;
    let volume = api.volume(PLUGIN, "vol1").await.unwrap();
    assert_eq!(
        volume
            .condition
            .as_ref()
            .map(|c| (c.abnormal, c.message.as_str())),
        Some((true, "disk on fire")),
        "{volume:?}"
    );
    let listed = api.volumes().await.unwrap();
    assert!(
        listed.volumes[0]
            .condition
            .as_ref()
            .is_some_and(|c| c.abnormal),
        "{listed:?}"
    );
    let out = daemon.csictl(&["volumes"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("PUBLISHED (abnormal)"), "{text}");
    assert!(
        text.contains("volume vol1 of org.example.test is abnormal: disk on fire"),
        "{text}"
    );
    let metrics = api.metrics().await.unwrap();
    assert_eq!(
        sample(&metrics, "csi_agent_volume_health_abnormal", &labels),
        Some(1.0),
        "{metrics}"
    );
    tokio::time::sleep(Duration::from_millis(1500)).await; // several more rounds
    let log = daemon.log_text();
    assert_eq!(log.matches("volume condition abnormal").count(), 1, "{log}");
    assert!(log.contains("disk on fire"), "{log}");

    // Back to normal: said once too.
    std::fs::write(plugin_dir.join("faults.json"), r#"{"abnormal": {}}"#).unwrap();
    eventually(
        "the condition to be normal again",
        Duration::from_secs(10),
        || async {
            let metrics = api.metrics().await.map_err(|e| e.to_string())?;
            match sample(&metrics, "csi_agent_volume_health_abnormal", &labels) {
                Some(0.0) => Ok(()),
                other => Err(format!("{other:?}")),
            }
        },
    )
    .await;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let log = daemon.log_text();
    assert_eq!(
        log.matches("volume condition normal again").count(),
        1,
        "{log}"
    );
    assert_eq!(log.matches("volume condition abnormal").count(), 1, "{log}");

    // Unpublished: its series go (the pre-provisioned volume is forgotten: 404).
    api.unpublish(&unpublish_request("vol1", "w1"))
        .await
        .unwrap();
    let metrics = api.metrics().await.unwrap();
    assert!(!metrics.contains(r#"volume_id="vol1""#), "{metrics}");
    let (status, _) = api_error(api.volume_stats(PLUGIN, "vol1").await);
    assert_eq!(status, 404);
    // A volume known but not published: 409, and the plugin is never asked about it.
    let created = api
        .create_volume(&csi_agent_api::CreateVolumeRequest {
            accessibility_requirements: None,
            content_source: None,
            plugin: PLUGIN.to_owned(),
            name: "idle".to_owned(),
            capacity_bytes: MIB as i64,
            capability: capability(),
            parameters: Default::default(),
        })
        .await
        .unwrap();
    let (status, body) = api_error(api.volume_stats(PLUGIN, &created.volume_id).await);
    assert_eq!((status, body.code), (409, ErrorCode::Conflict), "{body:?}");
    assert!(body.message.contains("not PUBLISHED"), "{}", body.message);
    let calls = std::fs::read_to_string(plugin_dir.join("calls.jsonl")).unwrap();
    assert!(
        !calls
            .lines()
            .any(|l| l.contains("\"NodeGetVolumeStats\"") && l.contains("\"idle\"")),
        "{calls}"
    );
}

/// A plugin whose NodeGetVolumeStats hangs (60 s, longer than the 3 s deadline) delays
/// neither another plugin's stats, nor `GET /v1/plugins`, nor a publish (of the other plugin,
/// nor of the hanging plugin's other volume); its own on-demand stats answer 503 at the
/// deadline.
#[tokio::test]
async fn a_plugin_hanging_in_node_get_volume_stats_delays_nobody_else() {
    let dir = tempfile::tempdir().unwrap();
    require_private_mount_namespace();
    let fast_dir = dir.path().join("plugin");
    let slow_dir = dir.path().join("slow");
    std::fs::create_dir_all(&slow_dir).unwrap();
    std::fs::write(
        slow_dir.join("faults.json"),
        r#"{"rules": [{"method": "NodeGetVolumeStats", "delay_ms": 60000}]}"#,
    )
    .unwrap();
    let daemon = Daemon::builder(dir.path())
        .flags(&[
            "--volume-stats-interval",
            "200ms",
            "--volume-stats-timeout",
            "3s",
        ])
        .plugin_config(
            "test.json",
            stats_config(PLUGIN, &fast_dir, "f1:16Mi,f2:16Mi", &["--volume-stats"]),
        )
        .plugin_config(
            "slow.json",
            stats_config(SLOW, &slow_dir, "s1:16Mi,s2:16Mi", &["--volume-stats"]),
        )
        .start();
    let api = daemon.api();
    let fast = api.publish(&publish_of(PLUGIN, "f1", "w1")).await.unwrap();
    api.publish(&publish_of(SLOW, "s1", "w1")).await.unwrap();
    // The slow plugin's round is stuck in its call.
    eventually(
        "the slow plugin's stats call in flight",
        Duration::from_secs(10),
        || async {
            let metrics = api.metrics().await.map_err(|e| e.to_string())?;
            match sample(
                &metrics,
                "csi_agent_rpcs_in_flight",
                &[
                    r#"plugin="org.example.slow""#,
                    r#"method="NodeGetVolumeStats""#,
                ],
            ) {
                Some(n) if n >= 1.0 => Ok(()),
                other => Err(format!("{other:?}")),
            }
        },
    )
    .await;

    let used0 = used_bytes(&api, PLUGIN, "f1").await.unwrap();
    std::fs::write(
        Path::new(&fast.target_path).join("data"),
        vec![1u8; 2 * MIB as usize],
    )
    .unwrap();
    let started = Instant::now();
    eventually(
        "the fast plugin's next round",
        Duration::from_secs(10),
        || async {
            let used = used_bytes(&api, PLUGIN, "f1").await?;
            if used >= used0 + 2 * MIB {
                Ok(())
            } else {
                Err(format!("{used}"))
            }
        },
    )
    .await;
    let fresh = started.elapsed();
    // Rounds every 200-400 ms: well within the 3 s the slow call holds its round.
    assert!(
        fresh < Duration::from_millis(1500),
        "fast stats took {fresh:?}"
    );

    let started = Instant::now();
    api.plugins().await.unwrap();
    api.volumes().await.unwrap();
    assert!(
        started.elapsed() < Duration::from_millis(500),
        "status calls took {:?}",
        started.elapsed()
    );
    let started = Instant::now();
    api.publish(&publish_of(PLUGIN, "f2", "w2")).await.unwrap();
    api.publish(&publish_of(SLOW, "s2", "w2")).await.unwrap();
    assert!(
        started.elapsed() < Duration::from_millis(1500),
        "publishes took {:?}",
        started.elapsed()
    );

    // s2 has no sample yet (its plugin's round is stuck): one is asked now, bounded by the
    // 3 s deadline, and the plugin's slowness is a 503 to retry.
    let started = Instant::now();
    let (status, body) = api_error(api.volume_stats(SLOW, "s2").await);
    let waited = started.elapsed();
    assert_eq!(
        (status, body.code),
        (503, ErrorCode::Unavailable),
        "{body:?}"
    );
    assert!(
        waited >= Duration::from_secs(3) && waited < Duration::from_secs(5),
        "{waited:?}"
    );
}

/// With the collector off (`--volume-stats-interval 0`) no round runs, and each request asks
/// the plugin: the figures are never a stale first sample.
#[tokio::test]
async fn with_the_collector_off_each_request_collects() {
    let dir = tempfile::tempdir().unwrap();
    require_private_mount_namespace();
    let plugin_dir = dir.path().join("plugin");
    let daemon = Daemon::builder(dir.path())
        .flags(&["--volume-stats-interval", "0"])
        .plugin_config(
            "test.json",
            stats_config(PLUGIN, &plugin_dir, "vol1:16Mi", &["--volume-stats"]),
        )
        .start();
    let api = daemon.api();
    let published = api.publish(&publish_request("vol1", "w1")).await.unwrap();
    let used0 = used_bytes(&api, PLUGIN, "vol1").await.unwrap();
    std::fs::write(
        Path::new(&published.target_path).join("data"),
        vec![3u8; MIB as usize],
    )
    .unwrap();
    let used1 = used_bytes(&api, PLUGIN, "vol1").await.unwrap();
    assert!(used1 >= used0 + MIB, "{used0} -> {used1}");
    tokio::time::sleep(Duration::from_millis(500)).await;
    let calls = std::fs::read_to_string(plugin_dir.join("calls.jsonl")).unwrap();
    assert_eq!(
        calls.matches("\"NodeGetVolumeStats\"").count(),
        2,
        "one call per request, none from a collector: {calls}"
    );
    assert!(
        daemon
            .log_text()
            .contains("volume stats collector disabled")
    );
}

/// A plugin without GET_VOLUME_STATS: 501 `unsupported` naming the capability, and neither
/// the route nor the collector ever sends it NodeGetVolumeStats.
#[tokio::test]
async fn a_plugin_without_get_volume_stats_is_a_501_before_any_rpc() {
    let dir = tempfile::tempdir().unwrap();
    let daemon = setup(dir.path(), &["--volume-stats-interval", "100ms"]);
    let api = daemon.api();
    api.publish(&publish_request("vol1", "w1")).await.unwrap();
    let (status, body) = api_error(api.volume_stats(PLUGIN, "vol1").await);
    assert_eq!(
        (status, body.code),
        (501, ErrorCode::Unsupported),
        "{body:?}"
    );
    assert!(
        body.message.contains("GET_VOLUME_STATS"),
        "{}",
        body.message
    );
    let out = daemon.csictl(&["stats", PLUGIN, "vol1"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("GET_VOLUME_STATS"));
    tokio::time::sleep(Duration::from_millis(800)).await; // several collector rounds
    let calls = std::fs::read_to_string(dir.path().join("plugin/calls.jsonl")).unwrap();
    assert!(calls.contains("\"NodePublishVolume\""), "{calls}");
    assert!(!calls.contains("\"NodeGetVolumeStats\""), "{calls}");
    let metrics = api.metrics().await.unwrap();
    assert!(
        !metrics.contains("csi_agent_volume_stats_capacity_bytes{"),
        "{metrics}"
    );
}
