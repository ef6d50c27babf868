//! `csictl drain` on the real daemon and the real test plugin: every claim is released
//! through the usual durable steps, nothing stays mounted, no plugin process stays running,
//! and the drained daemon publishes nothing more. Run under `unshare -m --propagation private`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use csi_agent_testkit::*;

/// The test plugin processes of the daemon in `dir`.
fn plugin_processes(dir: &std::path::Path) -> std::collections::BTreeSet<i32> {
    plugin_pids(&dir.join("plugin"))
}

#[tokio::test]
async fn drain_releases_every_claim_stops_every_plugin_and_refuses_new_work() {
    let dir = tempfile::tempdir().unwrap();
    let daemon = setup(dir.path(), &[]);
    let api = daemon.api();
    for (volume, workload) in [("vol1", "w1"), ("vol1", "w2"), ("vol2", "w3")] {
        api.publish(&publish_request(volume, workload))
            .await
            .unwrap();
    }
    assert_eq!(
        mounts_under(&daemon.work).len(),
        4,
        "two staged, two published"
    );
    assert_eq!(plugin_processes(dir.path()).len(), 1, "the plugin runs");

    let drained = daemon.csictl(&["drain"]);
    let stdout = String::from_utf8_lossy(&drained.stdout);
    assert!(
        drained.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&drained.stderr)
    );
    assert!(
        stdout.contains("claims released:  3") || stdout.contains("claims released: 3"),
        "{stdout}"
    );
    assert!(
        stdout.contains(PLUGIN),
        "the stopped plugin is named: {stdout}"
    );

    assert!(
        mounts_under(&daemon.work).is_empty(),
        "nothing stays mounted"
    );
    assert!(
        plugin_processes(dir.path()).is_empty(),
        "no plugin process stays running"
    );
    let listed = api.volumes().await.unwrap();
    assert!(
        listed.volumes.iter().all(|v| v.claims.is_empty()),
        "no claim is left: {:?}",
        listed.volumes
    );

    // Drained: a publish is refused, and starts no plugin again.
    let (status, body) = api_error(api.publish(&publish_request("vol1", "w1")).await);
    assert_eq!(status, 503);
    assert!(body.message.contains("drained"), "{}", body.message);
    assert!(plugin_processes(dir.path()).is_empty());
    assert!(mounts_under(&daemon.work).is_empty());

    // Repeating the drain is harmless.
    let again = api.drain().await.unwrap();
    assert!(
        again.released.is_empty() && again.failed.is_empty(),
        "{again:?}"
    );
}
