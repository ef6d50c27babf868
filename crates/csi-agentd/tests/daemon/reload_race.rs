//! A reload never races a volume operation (issue #24, item 2): 50 reloads of a changed
//! config under 6 clients publishing and unpublishing, on the real daemon and the real test
//! plugin (which advertises STAGE_UNSTAGE_VOLUME and refuses, and logs in its call log, a
//! NodePublishVolume without `staging_target_path`). No such call may go out, and every
//! volume converges. Run under `unshare -m --propagation private`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use csi_agent_testkit::*;

const CLIENTS: usize = 6;
const RELOADS: usize = 50;

/// The plugin's config, changed (a harmless flag flipped) for each reload.
fn config(dir: &std::path::Path, generation: usize) -> serde_json::Value {
    let mut config = managed_config(
        PLUGIN,
        &dir.join("plugin"),
        "v0:1M,v1:1M,v2:1M,v3:1M,v4:1M,v5:1M",
    );
    config["containers"][0]["command"]["arguments"]
        .as_array_mut()
        .unwrap()
        .extend([
            "--exit-delay-ms".into(),
            (generation % 2).to_string().into(),
        ]);
    config
}

fn calls(dir: &std::path::Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(dir.join("plugin/calls.jsonl"))
        .unwrap_or_default()
        .lines()
        .map(|line| serde_json::from_str(line).unwrap())
        .collect()
}

/// Stops the clients when the test ends, also by a panic (they would spin on a dead daemon).
struct StopOnDrop(Arc<AtomicBool>);

impl Drop for StopOnDrop {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Release);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn fifty_reloads_under_six_publishing_clients_send_no_publish_without_staging() {
    let started = Instant::now();
    let dir = tempfile::tempdir().unwrap();
    csi_agent::mounts::require_private_mount_namespace();
    let mut daemon = Daemon::new(dir.path(), &[]);
    daemon.add_config("test.json", &config(dir.path(), 0));
    daemon.start();
    let api = daemon.api();
    // The plugin initialized (the gate open) before the first reload, so that it changes it.
    api.publish(&publish_request("v0", "w0")).await.unwrap();
    api.unpublish(&unpublish_request("v0", "w0")).await.unwrap();

    let stop = Arc::new(AtomicBool::new(false));
    let _stop_on_panic = StopOnDrop(stop.clone());
    let done = Arc::new(AtomicUsize::new(0));
    let failed = Arc::new(AtomicUsize::new(0));
    let mut clients = Vec::new();
    for client in 0..CLIENTS {
        let (api, stop, done, failed) = (api.clone(), stop.clone(), done.clone(), failed.clone());
        clients.push(tokio::spawn(async move {
            let volume = format!("v{client}");
            let workload = format!("w{client}");
            while !stop.load(Ordering::Acquire) {
                // Errors are allowed (a plugin restarting may outlast a request); they are
                // counted, and the end state is checked below.
                match api.publish(&publish_request(&volume, &workload)).await {
                    Ok(_) => done.fetch_add(1, Ordering::Relaxed),
                    Err(_) => failed.fetch_add(1, Ordering::Relaxed),
                };
                match api.unpublish(&unpublish_request(&volume, &workload)).await {
                    Ok(_) => done.fetch_add(1, Ordering::Relaxed),
                    Err(_) => failed.fetch_add(1, Ordering::Relaxed),
                };
                // A failing daemon answers at once: let the runtime (and a failing test) in.
                tokio::task::yield_now().await;
            }
        }));
    }

    for generation in 1..=RELOADS {
        daemon.add_config("test.json", &config(dir.path(), generation));
        let report = api.reload().await.unwrap();
        assert_eq!(
            report.changed,
            vec![PLUGIN.to_owned()],
            "reload {generation}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    stop.store(true, Ordering::Release);
    for client in clients {
        client.await.unwrap();
    }
    println!(
        "{RELOADS} reloads: {} operations answered OK, {} failed, {:?}",
        done.load(Ordering::Relaxed),
        failed.load(Ordering::Relaxed),
        started.elapsed()
    );

    // The protocol rule: not one NodePublishVolume without staging_target_path.
    let calls = calls(dir.path());
    let violations: Vec<_> = calls
        .iter()
        .filter(|c| {
            c["method"] == "NodePublishVolume"
                && c["message"]
                    .as_str()
                    .is_some_and(|m| m.contains("staging_target_path is not set"))
        })
        .collect();
    assert!(
        violations.is_empty(),
        "NodePublish without staging: {violations:?}"
    );
    let published = calls
        .iter()
        .filter(|c| c["method"] == "NodePublishVolume" && c["code"] == "OK")
        .count();
    assert!(
        published >= CLIENTS,
        "the clients published during the reloads ({published})"
    );

    // Every volume converges: the last operation (or its reconciler) drives it to what its
    // claims want, and the clients ended with an unpublish.
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let listed = api.volumes().await.unwrap();
        let unsettled: Vec<_> = listed
            .volumes
            .iter()
            .filter(|v| {
                v.operation.is_some()
                    || if v.claims.is_empty() {
                        v.state != "CREATED"
                    } else {
                        v.state != "PUBLISHED"
                    }
            })
            .collect();
        if unsettled.is_empty() {
            break;
        }
        assert!(Instant::now() < deadline, "not converged: {unsettled:?}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // Final cleanup leaves nothing mounted.
    for client in 0..CLIENTS {
        api.unpublish(&unpublish_request(
            &format!("v{client}"),
            &format!("w{client}"),
        ))
        .await
        .unwrap();
    }
    assert!(
        mounts_under(&daemon.work).is_empty(),
        "{:?}",
        mounts_under(&daemon.work)
    );
    let log = std::fs::read_to_string(dir.path().join("daemon.log")).unwrap();
    assert_eq!(
        log.matches("components replaced").count(),
        RELOADS,
        "every reload replaced the plugin's components"
    );
}
