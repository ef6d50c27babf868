//! End to end: the real `csi-agentd` process, the real `csi-testplugin` (launched by the
//! daemon, or started by the test for unmanaged plugins), the real API over its unix socket
//! (and TCP), and `csictl`. Real bind mounts: run under `unshare -m --propagation private`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use csi_agent::mounts::require_private_mount_namespace;
use csi_agent_api::{ApiClient, ErrorCode};
use serde_json::json;

use csi_agent_testkit::*;

#[tokio::test]
async fn publish_write_unpublish_through_csictl_leaves_nothing_mounted() {
    let dir = tempfile::tempdir().unwrap();
    let daemon = setup(dir.path(), &[]);
    let out = daemon.csictl(&[
        "--output",
        "json",
        "publish",
        "--plugin",
        PLUGIN,
        "--volume",
        "vol1",
        "--workload",
        "w1",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let published: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let target = PathBuf::from(published["target_path"].as_str().unwrap());
    assert_eq!(
        daemon
            .work
            .join(published["target_path_relative"].as_str().unwrap()),
        target
    );
    assert!(mounts_under(&daemon.work).contains(&target));
    std::fs::write(target.join("file"), b"through the target").unwrap();
    assert_eq!(
        std::fs::read(dir.path().join("plugin/volumes/vol1/file")).unwrap(),
        b"through the target"
    );
    let listed = daemon.csictl(&["volumes"]);
    assert!(String::from_utf8_lossy(&listed.stdout).contains("vol1"));
    let metrics = daemon.api().metrics().await.unwrap();
    assert!(
        metrics.contains(r#"csi_agent_volumes{plugin="org.example.test",state="PUBLISHED"} 1"#),
        "{metrics}"
    );
    assert!(metrics.contains("csi_agent_rpc_duration_seconds_count{plugin=\"org.example.test\",method=\"NodePublishVolume\",code=\"OK\"} 1"));
    let plugins = daemon.csictl(&["plugins"]);
    assert!(String::from_utf8_lossy(&plugins.stdout).contains(PLUGIN));

    let out = daemon.csictl(&[
        "unpublish",
        "--plugin",
        PLUGIN,
        "--volume",
        "vol1",
        "--workload",
        "w1",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(mounts_under(&daemon.work).is_empty());
    assert!(daemon.api().volumes().await.unwrap().volumes.is_empty());
}

#[tokio::test]
async fn bind_to_mounts_for_the_workload_and_readonly_refuses_writes() {
    let dir = tempfile::tempdir().unwrap();
    let sandboxes = dir.path().join("sandboxes");
    std::fs::create_dir_all(&sandboxes).unwrap();
    let daemon = setup(dir.path(), &["--bind-root", sandboxes.to_str().unwrap()]);
    let api = daemon.api();
    let bind = sandboxes.join("container-rootfs/data");
    let mut request = publish_request("vol1", "w1");
    request.bind_to = Some(bind.to_string_lossy().into_owned());
    let published = api.publish(&request).await.unwrap();
    assert_eq!(published.bind_to.as_deref(), Some(bind.to_str().unwrap()));
    std::fs::write(bind.join("seen"), b"1").unwrap();
    assert!(dir.path().join("plugin/volumes/vol1/seen").exists());
    api.unpublish(&unpublish_request("vol1", "w1"))
        .await
        .unwrap();
    assert!(!mounts_under(dir.path()).contains(&bind));
    assert!(mounts_under(&daemon.work).is_empty());

    // Read-only: the target and the workload's bind both refuse writes.
    let ro_bind = sandboxes.join("ro-rootfs/data");
    let mut request = publish_request("vol2", "w2");
    request.readonly = true;
    request.bind_to = Some(ro_bind.to_string_lossy().into_owned());
    let published = api.publish(&request).await.unwrap();
    for path in [PathBuf::from(&published.target_path), ro_bind.clone()] {
        let err = std::fs::write(path.join("x"), b"x").unwrap_err();
        assert_eq!(err.raw_os_error(), Some(30), "{}: {err}", path.display());
    }
    api.unpublish(&unpublish_request("vol2", "w2"))
        .await
        .unwrap();
    assert!(mounts_under(dir.path()).is_empty());

    // A read-write request for a read-only access mode is refused and changes nothing.
    let mut contradiction = publish_request("vol2", "w3");
    contradiction.capability.access_mode = "SINGLE_NODE_READER_ONLY".to_owned();
    let (status, body) = api_error(api.publish(&contradiction).await);
    assert_eq!(status, 400);
    assert!(body.message.contains("readonly"), "{}", body.message);
    assert!(api.volumes().await.unwrap().volumes.is_empty());
}

#[tokio::test]
async fn unpublish_after_the_daemon_was_killed_cleans_everything() {
    let dir = tempfile::tempdir().unwrap();
    let mut daemon = setup(dir.path(), &[]);
    let published = daemon
        .api()
        .publish(&publish_request("vol1", "w1"))
        .await
        .unwrap();
    daemon
        .api()
        .publish(&publish_request("vol2", "w2"))
        .await
        .unwrap();
    daemon.kill9();
    // Workloads keep their volumes while the daemon is down.
    assert!(mounts_under(&daemon.work).contains(&PathBuf::from(&published.target_path)));
    daemon.start();
    let api = daemon.api();
    // Mesos's UnpublishAfterAgentFailover.
    api.unpublish(&unpublish_request("vol1", "w1"))
        .await
        .unwrap();
    // A workload that ended while the daemon was down: the agent unpublishes it now.
    api.unpublish(&unpublish_request("vol2", "w2"))
        .await
        .unwrap();
    assert!(mounts_under(&daemon.work).is_empty());
    assert!(api.volumes().await.unwrap().volumes.is_empty());
    // The plugin was adopted, not relaunched.
    let plugin = api.plugin(PLUGIN).await.unwrap();
    assert_eq!(plugin.components[0].restarts, 0, "{plugin:?}");
}

#[tokio::test]
async fn on_request_start_holds_requests_and_launches_nothing_until_start() {
    let dir = tempfile::tempdir().unwrap();
    let mut daemon = setup(dir.path(), &[]);
    daemon
        .api()
        .publish(&publish_request("vol1", "w1"))
        .await
        .unwrap();
    daemon.kill9();
    // Stop the plugin too, so that "not launched before start" can be observed.
    let _ = Command::new("pkill")
        .arg("-f")
        .arg(dir.path().join("plugin"))
        .status();
    std::thread::sleep(Duration::from_millis(200));
    daemon.extra = vec!["--start".into(), "on-request".into()];
    daemon.start();
    let api = daemon.api();
    let health = api.health().await.unwrap();
    assert!(!health.started);
    let calls_before = std::fs::read_to_string(dir.path().join("plugin/calls.jsonl")).unwrap();
    let waiting = {
        let api = api.clone();
        tokio::spawn(async move { api.unpublish(&unpublish_request("vol1", "w1")).await })
    };
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(
        !waiting.is_finished(),
        "the unpublish did not wait for start"
    );
    let pgrep = Command::new("pgrep")
        .arg("-f")
        .arg(dir.path().join("plugin"))
        .output()
        .unwrap();
    assert!(
        pgrep.stdout.is_empty(),
        "a plugin was launched before start"
    );
    assert_eq!(
        std::fs::read_to_string(dir.path().join("plugin/calls.jsonl")).unwrap(),
        calls_before,
        "a CSI call was made before start"
    );
    let started = api.start().await.unwrap();
    assert!(started.opened_now);
    waiting.await.unwrap().unwrap();
    assert!(
        !api.start().await.unwrap().opened_now,
        "start is idempotent"
    );
    assert!(api.health().await.unwrap().started);
    assert!(mounts_under(&daemon.work).is_empty());
}

#[tokio::test]
async fn a_config_added_at_run_time_and_an_unmanaged_plugin_work() {
    let dir = tempfile::tempdir().unwrap();
    let daemon = setup(dir.path(), &[]);
    let api = daemon.api();
    // Unmanaged: started by the test, configured with `endpoints`.
    let unmanaged_socket = dir.path().join("unmanaged.sock");
    let mut plugin = Command::new(binary("csi-testplugin"))
        .arg("--endpoint")
        .arg(&unmanaged_socket)
        .arg("--work-dir")
        .arg(dir.path().join("unmanaged"))
        .args(["--volumes", "u1:1M", "--node-id", "node-1"])
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    daemon.add_config(
        "unmanaged.json",
        &json!({"type": "org.example.unmanaged", "endpoints": [
            {"csi_service": "NODE_SERVICE", "endpoint": format!("unix://{}", unmanaged_socket.display())},
            {"csi_service": "CONTROLLER_SERVICE", "endpoint": unmanaged_socket}
        ]}),
    );
    let mut request = publish_request("u1", "w1");
    request.plugin = "org.example.unmanaged".to_owned();
    let published = api.publish(&request).await.unwrap();
    assert!(mounts_under(&daemon.work).contains(&PathBuf::from(&published.target_path)));
    let mut undo = unpublish_request("u1", "w1");
    undo.plugin = "org.example.unmanaged".to_owned();
    api.unpublish(&undo).await.unwrap();
    let info = api.plugin("org.example.unmanaged").await.unwrap();
    assert!(!info.managed);
    let _ = plugin.kill();
    let _ = plugin.wait();
    assert!(mounts_under(&daemon.work).is_empty());
}

#[tokio::test]
async fn the_tcp_listener_requires_the_token_and_the_socket_is_private() {
    require_private_mount_namespace();
    let dir = tempfile::tempdir().unwrap();
    let token_file = dir.path().join("token");
    std::fs::write(&token_file, "s3cret-token-0123456789\n").unwrap();
    std::fs::set_permissions(&token_file, std::fs::Permissions::from_mode(0o600)).unwrap();
    let port = {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        listener.local_addr().unwrap().port()
    };
    let listen = format!("127.0.0.1:{port}");
    let mut daemon = Daemon::new(
        dir.path(),
        &[
            "--listen",
            &listen,
            "--token-file",
            token_file.to_str().unwrap(),
        ],
    );
    daemon.start();
    let mode = std::fs::metadata(&daemon.socket)
        .unwrap()
        .permissions()
        .mode()
        & 0o777;
    assert_eq!(mode, 0o600);
    let url = format!("http://{listen}");
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match ApiClient::tcp(&url, Some("s3cret-token-0123456789"))
            .unwrap()
            .health()
            .await
        {
            Ok(health) => {
                assert_eq!(health.status, "ok");
                break;
            }
            Err(_) if Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(20)).await
            }
            Err(err) => panic!("{err}"),
        }
    }
    let (status, body) = api_error(ApiClient::tcp(&url, None).unwrap().health().await);
    assert_eq!((status, body.code), (401, ErrorCode::Unauthorized));
    let (status, _) = api_error(ApiClient::tcp(&url, Some("wrong")).unwrap().health().await);
    assert_eq!(status, 401);
    let (status, _) = api_error(
        ApiClient::tcp(&url, Some("s3cret-token-0123456789-and-more"))
            .unwrap()
            .volumes()
            .await,
    );
    assert_eq!(status, 401);
}

#[tokio::test]
async fn bad_requests_get_clear_4xx_errors_and_change_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let daemon = setup(dir.path(), &[]);
    let api = daemon.api();
    api.publish(&publish_request("vol1", "w1")).await.unwrap();
    let before = api.volumes().await.unwrap();
    let records_before = csi_agent::store::db::dump(&daemon.work).unwrap().len();

    let mut unknown = publish_request("vol2", "w1");
    unknown.plugin = "org.example.nope".to_owned();
    let (status, body) = api_error(api.publish(&unknown).await);
    assert_eq!((status, body.code), (404, ErrorCode::NotFound));
    assert!(
        body.message.contains("org.example.nope"),
        "{}",
        body.message
    );

    let mut empty = publish_request("", "w1");
    let (status, body) = api_error(api.publish(&empty).await);
    assert_eq!(status, 400);
    assert!(
        body.message.contains("volume_id is empty"),
        "{}",
        body.message
    );
    empty.volume_id = "x".repeat(129);
    let (status, body) = api_error(api.publish(&empty).await);
    assert_eq!(status, 400);
    assert!(
        body.message.contains("at most 128 bytes"),
        "{}",
        body.message
    );

    let mut bad_mode = publish_request("vol2", "w1");
    bad_mode.capability.access_mode = "WRITE_MANY".to_owned();
    let (status, body) = api_error(api.publish(&bad_mode).await);
    assert_eq!(status, 400);
    assert!(body.message.contains("WRITE_MANY"));

    let mut both = publish_request("vol2", "w1");
    both.capability.block = Some(Default::default());
    let (status, _) = api_error(api.publish(&both).await);
    assert_eq!(status, 400);

    let mut conflict = publish_request("vol1", "w2");
    conflict.readonly = true;
    let (status, body) = api_error(api.publish(&conflict).await);
    assert_eq!((status, body.code), (409, ErrorCode::Conflict));

    // Raw bodies: malformed JSON, missing fields, unknown fields.
    for (body, expect) in [
        ("{not json", "not valid"),
        (
            r#"{"plugin": "org.example.test"}"#,
            "missing field `volume_id`",
        ),
        (
            r#"{"plugin":"org.example.test","volume_id":"vol2","capability":{"mount":{},"access_mode":"SINGLE_NODE_WRITER"},"bogus":1}"#,
            "unknown field `bogus`",
        ),
    ] {
        let out = Command::new("curl")
            .args(["-s", "-w", "\n%{http_code}", "--unix-socket"])
            .arg(&daemon.socket)
            .args([
                "-X",
                "POST",
                "http://localhost/v1/volumes/publish",
                "-H",
                "content-type: application/json",
                "-d",
                body,
            ])
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        let (json, code) = text.rsplit_once('\n').unwrap();
        assert_eq!(code, "400", "{body}: {text}");
        let error: serde_json::Value = serde_json::from_str(json).unwrap();
        assert_eq!(error["code"], "invalid_request");
        assert!(
            error["message"].as_str().unwrap().contains(expect),
            "{json}"
        );
    }
    let (status, _) = api_error(api.volume(PLUGIN, "never-published").await);
    assert_eq!(status, 404);
    // Nothing changed.
    assert_eq!(api.volumes().await.unwrap(), before);
    let records_after = csi_agent::store::db::dump(&daemon.work).unwrap().len();
    assert_eq!(records_after, records_before);
    api.unpublish(&unpublish_request("vol1", "w1"))
        .await
        .unwrap();
}

#[tokio::test]
async fn the_router_serves_exactly_the_documented_routes() {
    require_private_mount_namespace();
    let dir = tempfile::tempdir().unwrap();
    let mut daemon = Daemon::new(dir.path(), &["--start", "on-request"]);
    daemon.start();
    for (method, path) in csi_agent_api::routes::ALL_ROUTES {
        let url = format!(
            "http://localhost{}",
            path.replace("{type}", "org.example.none")
                .replace("{plugin}", "org.example.none")
                .replace("{volume_id}", "v")
        );
        // Requests that would wait for the start gate are cut short: only the routing matters.
        let out = Command::new("curl")
            .args(["-s", "-m", "1", "-w", "\n%{http_code}", "--unix-socket"])
            .arg(&daemon.socket)
            .args([
                "-X",
                method,
                &url,
                "-H",
                "content-type: application/json",
                "-d",
                "{}",
            ])
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout).to_string();
        let (body, code) = text.rsplit_once('\n').unwrap_or(("", &text));
        // A 404 from a handler (unknown plugin) is fine; the router's own fallback is not.
        assert!(
            code != "405" && !body.contains("no such route"),
            "{method} {path} is not routed (HTTP {code}: {body})"
        );
    }
    let out = Command::new("curl")
        .args([
            "-s",
            "-o",
            "/dev/null",
            "-w",
            "%{http_code}",
            "--unix-socket",
        ])
        .arg(&daemon.socket)
        .arg("http://localhost/v1/nothing-here")
        .output()
        .unwrap();
    assert_eq!(String::from_utf8_lossy(&out.stdout), "404");
    let out = Command::new("curl")
        .args(["-s", "-w", "\n%{http_code}", "-X", "PUT", "--unix-socket"])
        .arg(&daemon.socket)
        .arg("http://localhost/v1/volumes")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    let (body, code) = text.rsplit_once('\n').unwrap();
    assert_eq!(code, "405");
    let error: serde_json::Value = serde_json::from_str(body).unwrap();
    assert_eq!(error["code"], "invalid_request");
}

fn pid_alive(pid: u32) -> bool {
    Path::new(&format!("/proc/{pid}")).exists()
        && !std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .map(|s| s.contains(") Z "))
            .unwrap_or(true)
}

#[tokio::test]
async fn sigterm_leaves_plugins_and_mounts_in_place_and_sighup_reloads() {
    let dir = tempfile::tempdir().unwrap();
    let mut daemon = setup(dir.path(), &[]);
    let api = daemon.api();
    let published = api.publish(&publish_request("vol1", "w1")).await.unwrap();
    let plugin = api.plugin(PLUGIN).await.unwrap();
    let pid = plugin.components[0].pid.unwrap();

    // SIGHUP: a config added on disk shows up without a request for it.
    daemon.add_config(
        "second.json",
        &managed_config("org.example.second", &dir.path().join("plugin2"), "x:1M"),
    );
    let daemon_pid = daemon.child.as_ref().unwrap().id();
    rustix::process::kill_process(
        rustix::process::Pid::from_raw(daemon_pid as i32).unwrap(),
        rustix::process::Signal::HUP,
    )
    .unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let listed = api.plugins().await.unwrap();
        if listed
            .plugins
            .iter()
            .any(|p| p.plugin_type == "org.example.second")
        {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "SIGHUP did not reload: {listed:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    // SIGTERM: a clean exit that leaves the plugin running and the volume mounted.
    rustix::process::kill_process(
        rustix::process::Pid::from_raw(daemon_pid as i32).unwrap(),
        rustix::process::Signal::TERM,
    )
    .unwrap();
    let status = daemon.child.take().unwrap().wait().unwrap();
    assert!(status.success(), "{status:?}");
    assert!(
        !daemon.socket.exists(),
        "the API socket is removed at shutdown"
    );
    assert!(pid_alive(pid), "the plugin must outlive the daemon");
    assert!(mounts_under(&daemon.work).contains(&PathBuf::from(&published.target_path)));

    daemon.start();
    let api = daemon.api();
    api.unpublish(&unpublish_request("vol1", "w1"))
        .await
        .unwrap();
    assert_eq!(
        api.plugin(PLUGIN).await.unwrap().components[0].pid,
        Some(pid),
        "adopted, same pid"
    );
    assert!(mounts_under(&daemon.work).is_empty());
}

#[tokio::test]
async fn a_removed_plugin_outlives_its_published_volumes() {
    let dir = tempfile::tempdir().unwrap();
    let daemon = setup(dir.path(), &[]);
    let api = daemon.api();
    api.publish(&publish_request("vol1", "w1")).await.unwrap();
    let pid = api.plugin(PLUGIN).await.unwrap().components[0].pid.unwrap();
    std::fs::remove_file(daemon.configs.join("test.json")).unwrap();
    let report = api.reload().await.unwrap();
    assert_eq!(report.removed, vec![PLUGIN.to_owned()]);
    // Still in use: kept, and the unpublish works.
    assert!(pid_alive(pid));
    api.unpublish(&unpublish_request("vol1", "w1"))
        .await
        .unwrap();
    assert!(mounts_under(&daemon.work).is_empty());
    // Nothing in use any more: the next reload stops it.
    api.reload().await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(15);
    while pid_alive(pid) {
        assert!(
            Instant::now() < deadline,
            "the removed plugin was not stopped"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let (status, _) = api_error(api.plugin(PLUGIN).await);
    assert_eq!(status, 404);
}

#[tokio::test]
async fn a_plugin_whose_initialization_failed_is_retried_on_the_next_request() {
    let dir = tempfile::tempdir().unwrap();
    require_private_mount_namespace();
    let mut daemon = Daemon::new(dir.path(), &[]);
    daemon.add_config(
        "test.json",
        &managed_config(PLUGIN, &dir.path().join("plugin"), "vol1:1M"),
    );
    // Break the plugin's volumes dir: recovery cannot list it, so initialization fails.
    let volumes = daemon.work.join("csi/org.example.test/default/volumes");
    std::fs::create_dir_all(volumes.parent().unwrap()).unwrap();
    std::fs::write(&volumes, b"not a directory").unwrap();
    daemon.start();
    let api = daemon.api();
    let (status, body) = api_error(api.publish(&publish_request("vol1", "w1")).await);
    assert_eq!(status, 503, "{body:?}");
    assert!(
        body.message.contains("org.example.test"),
        "{}",
        body.message
    );
    let info = api.plugin(PLUGIN).await.unwrap();
    assert_eq!(info.state, "failed");
    // Repaired: the next request initializes it.
    std::fs::remove_file(&volumes).unwrap();
    api.publish(&publish_request("vol1", "w1")).await.unwrap();
    api.unpublish(&unpublish_request("vol1", "w1"))
        .await
        .unwrap();
    assert!(mounts_under(&daemon.work).is_empty());
}

#[tokio::test]
async fn secrets_reach_the_plugin_but_no_log_record_or_response() {
    let dir = tempfile::tempdir().unwrap();
    require_private_mount_namespace();
    let mut daemon = Daemon::new(dir.path(), &[]);
    let mut config = managed_config(PLUGIN, &dir.path().join("plugin"), "vol1:1M");
    config["containers"][0]["command"]["arguments"]
        .as_array_mut()
        .unwrap()
        .push(json!("--record-secrets"));
    daemon.add_config("test.json", &config);
    daemon.extra = vec!["--log-format".into(), "json".into()];
    daemon.start();
    let api = daemon.api();
    let mut request = publish_request("vol1", "w1");
    request.secrets = Some(csi_agent_api::SecretsSpec {
        node_stage: [("user".to_owned(), "stage-t0psecret".to_owned())].into(),
        node_publish: [("key".to_owned(), "publish-t0psecret".to_owned())].into(),
    });
    api.publish(&request).await.unwrap();
    let calls = std::fs::read_to_string(dir.path().join("plugin/calls.jsonl")).unwrap();
    assert!(calls.contains("stage-t0psecret") && calls.contains("publish-t0psecret"));
    let shown = serde_json::to_string(&api.volume(PLUGIN, "vol1").await.unwrap()).unwrap();
    assert!(!shown.contains("t0psecret"), "{shown}");
    assert!(shown.contains("\"has_secrets\":true"));
    let listed = serde_json::to_string(&api.volumes().await.unwrap()).unwrap();
    assert!(!listed.contains("t0psecret"));
    api.unpublish(&unpublish_request("vol1", "w1"))
        .await
        .unwrap();
    let log = std::fs::read_to_string(dir.path().join("daemon.log")).unwrap();
    assert!(!log.is_empty());
    assert!(
        !log.contains("t0psecret"),
        "a secret reached the daemon's log"
    );
    // Nothing of it stays on disk once the volume is gone.
    let leftover = Command::new("grep")
        .args(["-r", "-l", "t0psecret"])
        .arg(&daemon.work)
        .output()
        .unwrap();
    assert!(
        leftover.stdout.is_empty(),
        "{}",
        String::from_utf8_lossy(&leftover.stdout)
    );
}

#[tokio::test]
async fn a_publish_waits_no_longer_than_the_startup_timeout_and_says_so() {
    let dir = tempfile::tempdir().unwrap();
    let daemon = setup(dir.path(), &[]);
    // One plugin that never creates its socket, one that exits at once (a crash loop).
    for (plugin_type, command) in [
        ("org.example.silent", "sleep 600"),
        ("org.example.crashing", "exit 3"),
    ] {
        daemon.add_config(
            &format!("{plugin_type}.json"),
            &json!({
                "type": plugin_type,
                "containers": [{
                    "services": ["CONTROLLER_SERVICE", "NODE_SERVICE"],
                    "command": {"shell": true, "value": command}
                }],
                "startup_timeout_ms": 2000
            }),
        );
    }
    daemon.api().reload().await.unwrap();
    for plugin_type in ["org.example.silent", "org.example.crashing"] {
        let mut request = publish_request("vol1", "w1");
        request.plugin = plugin_type.to_owned();
        let started = Instant::now();
        let (status, body) = api_error(daemon.api().publish(&request).await);
        let took = started.elapsed();
        println!("{plugin_type}: publish answered {status} after {took:?}");
        assert_eq!(status, 503, "{}", body.message);
        assert!(
            body.message.contains("startup_timeout_ms"),
            "says which budget ran out: {}",
            body.message
        );
        // The startup timeout (2 s) plus the capability and RPC attempts of one operation,
        // far below the 120 s operation timeout the report measured.
        assert!(took < Duration::from_secs(10), "{plugin_type}: {took:?}");
    }
    // The working plugin was never held up.
    daemon
        .api()
        .publish(&publish_request("vol1", "w1"))
        .await
        .unwrap();
    daemon
        .api()
        .unpublish(&unpublish_request("vol1", "w1"))
        .await
        .unwrap();
}
