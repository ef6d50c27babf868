//! What an operator reads when something fails, pinned by snapshots (insta): `csi-agentd
//! probe` of a missing socket, and `csictl publish` (text and `-o json`) against a
//! controller-only config, a plugin that exits at once, and a plugin failing with each final
//! gRPC code. Each message must say what failed and what to do, and name each cause once.
//! The real daemon and the real test plugin; run under `unshare -m --propagation private`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::Path;
use std::process::Command;

use csi_agent_testkit::*;
use serde_json::json;

/// The final gRPC codes (`csi_agent::client::classify`): repeating the call will not help, so
/// the daemon reports them instead of retrying.
const FINAL_CODES: &[&str] = &[
    "CANCELLED",
    "UNKNOWN",
    "INVALID_ARGUMENT",
    "NOT_FOUND",
    "ALREADY_EXISTS",
    "PERMISSION_DENIED",
    "FAILED_PRECONDITION",
    "OUT_OF_RANGE",
    "UNIMPLEMENTED",
    "INTERNAL",
    "DATA_LOSS",
    "UNAUTHENTICATED",
];

/// A crash-looping plugin's status says how many failures in a row it has seen and when it
/// starts again, which changes from one moment to the next: that part is cut out.
fn without_restart_count(text: &str) -> String {
    const MARK: &str = " failure(s) in a row, next attempt after ";
    let mut out = text.replace("starting again after: ", "");
    while let Some(at) = out.find(MARK) {
        let start = out[..at].rfind("; ").unwrap_or(at);
        let end = out[at + MARK.len()..]
            .find(" ms")
            .map_or(out.len(), |i| at + MARK.len() + i + " ms".len());
        out.replace_range(start..end, "");
    }
    out
}

/// Exit status, stdout and stderr of a command, with `dir` (a temp dir) written `[DIR]`.
fn rendered(output: &std::process::Output, dir: &Path) -> String {
    let dir = dir.to_string_lossy();
    let text = |bytes: &[u8]| {
        without_restart_count(&String::from_utf8_lossy(bytes).replace(dir.as_ref(), "[DIR]"))
    };
    format!(
        "exit: {}\n--- stdout\n{}--- stderr\n{}",
        output
            .status
            .code()
            .map_or("signal".to_owned(), |c| c.to_string()),
        text(&output.stdout),
        text(&output.stderr),
    )
}

/// The text and the JSON form of one csictl failure, after checking they agree.
fn both_forms(daemon: &Daemon, dir: &Path, args: &[&str]) -> String {
    let text = daemon.csictl(args);
    let mut json_args = vec!["-o", "json"];
    json_args.extend_from_slice(args);
    let as_json = daemon.csictl(&json_args);
    assert!(!text.status.success(), "{args:?} must fail");
    assert_eq!(
        text.status.code(),
        as_json.status.code(),
        "same exit status"
    );
    let error: serde_json::Value = serde_json::from_slice(&as_json.stderr)
        .unwrap_or_else(|e| panic!("-o json prints the error as JSON ({e}): {as_json:?}"));
    assert_eq!(
        error["error"]["exit_code"].as_i64(),
        text.status.code().map(i64::from)
    );
    format!("{}\n{}", rendered(&text, dir), rendered(&as_json, dir))
}

#[test]
fn probe_of_a_missing_socket_names_it_once() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("no-such-plugin/csi.sock");
    let output = Command::new(env!("CARGO_BIN_EXE_csi-agentd"))
        .arg("probe")
        .arg(&socket)
        .output()
        .unwrap();
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(
        stderr.matches("No such file or directory").count(),
        1,
        "the cause is printed once: {stderr}"
    );
    insta::assert_snapshot!("probe_missing_socket", rendered(&output, dir.path()));
}

#[test]
fn publish_failures_say_what_failed_and_what_to_do() {
    let dir = tempfile::tempdir().unwrap();
    let plugin_dir = dir.path().join("plugin");
    let volumes: Vec<String> = (0..FINAL_CODES.len()).map(|i| format!("f{i}")).collect();
    let spec: Vec<String> = volumes.iter().map(|v| format!("{v}:1M")).collect();
    let mut daemon = Daemon::new(dir.path(), &[]);
    daemon.add_config(
        "test.json",
        &managed_config(PLUGIN, &plugin_dir, &spec.join(",")),
    );
    let mut controller_only = managed_config("org.example.controller-only", &plugin_dir, "");
    controller_only["containers"][0]["services"] = json!(["CONTROLLER_SERVICE"]);
    daemon.add_config("controller-only.json", &controller_only);
    daemon.add_config(
        "exits.json",
        &json!({
            "type": "org.example.exits",
            "containers": [{
                "services": ["CONTROLLER_SERVICE", "NODE_SERVICE"],
                "command": {"shell": true, "value": "echo 'cannot open /dev/fake0' >&2; exit 3"}
            }],
            "startup_timeout_ms": 2000,
            "restart_backoff": {"initial_ms": 100, "max_ms": 200}
        }),
    );
    csi_agent::mounts::require_private_mount_namespace();
    daemon.start();

    let publish = |plugin: &'static str, volume: &'static str| {
        vec![
            "publish",
            "--plugin",
            plugin,
            "--volume",
            volume,
            "--workload",
            "w1",
        ]
    };
    insta::assert_snapshot!(
        "publish_controller_only",
        both_forms(
            &daemon,
            dir.path(),
            &publish("org.example.controller-only", "v")
        )
    );
    insta::assert_snapshot!(
        "publish_plugin_exits_at_once",
        both_forms(&daemon, dir.path(), &publish("org.example.exits", "v"))
    );

    std::fs::create_dir_all(&plugin_dir).unwrap();
    let mut all = String::new();
    for (code, volume) in FINAL_CODES.iter().zip(&volumes) {
        // The plugin re-reads its fault file at each call; replaced whole (rename).
        let faults = json!({"rules": [{"method": "NodePublishVolume",
            "fail": {"code": code, "message": format!("injected {code}")}}]});
        let tmp = plugin_dir.join("faults.json.tmp");
        std::fs::write(&tmp, serde_json::to_vec(&faults).unwrap()).unwrap();
        std::fs::rename(&tmp, plugin_dir.join("faults.json")).unwrap();
        let args = [
            "publish",
            "--plugin",
            PLUGIN,
            "--volume",
            volume,
            "--workload",
            "w1",
        ];
        let forms = both_forms(&daemon, dir.path(), &args);
        assert!(forms.contains(code), "{code} is reported: {forms}");
        all.push_str(&format!("=== {code}\n{forms}\n"));
    }
    insta::assert_snapshot!("publish_final_codes", all);
}
