//! `csi-agentd probe` against the real test plugin in each version mode.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

fn probe(versions: &str) -> serde_json::Value {
    probe_with(versions, &[])
}

fn probe_with(versions: &str, flags: &[&str]) -> serde_json::Value {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("csi.sock");
    let testplugin = csi_agent::binaries::required("csi-testplugin", None);
    let mut plugin = Command::new(testplugin)
        .arg("--endpoint")
        .arg(&socket)
        .arg("--work-dir")
        .arg(dir.path().join("plugin"))
        .args(["--api-versions", versions, "--mount-mode", "none"])
        .args(flags)
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while !socket.exists() {
        assert!(Instant::now() < deadline, "plugin socket never appeared");
        std::thread::sleep(Duration::from_millis(5));
    }
    let output = assert_cmd::Command::cargo_bin("csi-agentd")
        .unwrap()
        .arg("probe")
        .arg(format!("unix://{}", socket.display()))
        .output()
        .unwrap();
    let _ = plugin.kill();
    let _ = plugin.wait();
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    serde_json::from_slice(&output.stdout).unwrap()
}

#[test]
fn probe_reports_v0_2() {
    let report = probe("v0.2");
    assert_eq!(report["version"], "v0.2");
    assert_eq!(report["name"], "org.example.test");
    assert!(
        report["node_capabilities"]
            .as_array()
            .unwrap()
            .iter()
            .any(|c| c == "STAGE_UNSTAGE_VOLUME")
    );
}

#[test]
fn probe_reports_v0_3() {
    assert_eq!(probe("v0.3")["version"], "v0.3");
}

#[test]
fn probe_reports_v1() {
    let report = probe("v1");
    assert_eq!(report["version"], "v1");
    assert_eq!(report["ready"], true);
    assert!(
        report["controller_capabilities"]
            .as_array()
            .unwrap()
            .iter()
            .any(|c| c == "CREATE_DELETE_VOLUME")
    );
}

#[test]
fn probe_shows_the_node_topology_and_limit() {
    let report = probe_with(
        "v1",
        &["--topology", "zone=a,rack=1", "--max-volumes-per-node", "2"],
    );
    assert!(
        report["plugin_capabilities"]
            .as_array()
            .unwrap()
            .iter()
            .any(|c| c == "VOLUME_ACCESSIBILITY_CONSTRAINTS"),
        "{report}"
    );
    assert_eq!(
        report["node"],
        serde_json::json!({
            "node_id": report["node"]["node_id"].clone(),
            "accessible_topology": {"zone": "a", "rack": "1"},
            "max_volumes_per_node": 2
        })
    );
    // The test plugin advertises no VolumeExpansion: absent, not an empty value.
    assert!(report.get("volume_expansion").is_none(), "{report}");
    // Without the flags: no topology, no limit (0, the spec's "no limit").
    let plain = probe("v1");
    assert!(
        plain["node"].get("accessible_topology").is_none(),
        "{plain}"
    );
    assert_eq!(plain["node"]["max_volumes_per_node"], 0);
    // CSI 0.2 knows only the node id (NodeGetId).
    assert!(probe("v0.2")["node"]["node_id"].is_string());
}

#[test]
fn probe_of_a_missing_socket_says_what_failed() {
    let output = assert_cmd::Command::cargo_bin("csi-agentd")
        .unwrap()
        .args(["probe", "/nonexistent/csi.sock"])
        .output()
        .unwrap();
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("/nonexistent/csi.sock"), "{stderr}");
}

#[test]
fn probe_rejects_a_non_unix_endpoint() {
    let output = assert_cmd::Command::cargo_bin("csi-agentd")
        .unwrap()
        .args(["probe", "tcp://1.2.3.4:5"])
        .output()
        .unwrap();
    assert!(!output.status.success());
    assert!(String::from_utf8_lossy(&output.stderr).contains("unix:///absolute/path"));
}
