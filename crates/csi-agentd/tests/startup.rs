//! Start-up that tells the truth (issue #24, items 3, 7 and 8): a daemon started right after
//! its predecessor was SIGKILLed serves instead of naming the dead process; a live daemon still
//! keeps a second one out at once; and the messages an operator reads at start-up and in the
//! status say what is true. The real `csi-agentd` and `csictl`, the real test plugin, real
//! bind mounts: run as root under `unshare -m --propagation private`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::io::{Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::*;

/// How many kill -9 / restart rounds the restart test runs.
const RESTARTS: usize = 50;

fn log_of(daemon: &Daemon) -> String {
    std::fs::read_to_string(daemon.work.parent().unwrap().join("daemon.log")).unwrap_or_default()
}

/// Waits until the daemon answers `GET /v1/health` on its socket, failing the test if it
/// exits first or takes more than 20 s.
async fn wait_serving(daemon: &mut Daemon) -> Duration {
    let started = Instant::now();
    loop {
        if let Some(status) = daemon.child.as_mut().unwrap().try_wait().unwrap() {
            panic!("the daemon exited ({status}) instead of serving");
        }
        if daemon.socket.exists() && daemon.api().health().await.is_ok() {
            return started.elapsed();
        }
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "the daemon did not serve within 20 s"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

#[tokio::test]
async fn a_daemon_started_at_once_after_kill_9_serves_fifty_times_in_a_row() {
    let dir = tempfile::tempdir().unwrap();
    // A plugin with a published volume: the dying daemon has threads, sockets and a store
    // to let go of, as on a real node.
    let mut daemon = setup(dir.path(), &[]);
    daemon.api().publish(&publish("vol1", "w1")).await.unwrap();
    wait_serving(&mut daemon).await;
    let started = Instant::now();
    let mut slowest = Duration::ZERO;
    for round in 0..RESTARTS {
        // kill -9 and no wait: the next daemon starts while the kernel still tears the old
        // one down.
        let mut old = daemon.child.take().unwrap();
        old.kill().unwrap();
        daemon.start();
        let took = wait_serving(&mut daemon).await;
        slowest = slowest.max(took);
        old.wait().unwrap();
        assert!(
            took < Duration::from_secs(10),
            "round {round}: serving took {took:?}"
        );
    }
    let log = log_of(&daemon);
    let waited = log
        .matches("the work dir's lock is still held by a csi-agentd")
        .count();
    println!(
        "{RESTARTS} kill -9 + restart rounds in {:?}; slowest to serve {slowest:?}; \
         {waited} start(s) waited for the dying predecessor",
        started.elapsed()
    );
    assert!(!log.contains("is in use by another csi-agentd"), "{log}");
    // The volume survived every crash: still claimed, and its unpublish works.
    let volume = daemon.api().volume(PLUGIN, "vol1").await.unwrap();
    assert_eq!(volume.claims.len(), 1, "{volume:?}");
    daemon
        .api()
        .unpublish(&unpublish("vol1", "w1"))
        .await
        .unwrap();
}

#[tokio::test]
async fn a_live_daemon_still_keeps_a_second_one_out_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let mut daemon = Daemon::new(dir.path(), &[]);
    daemon.start();
    wait_serving(&mut daemon).await;
    let first = daemon.child.as_ref().unwrap().id();
    let started = Instant::now();
    let second = Command::new(env!("CARGO_BIN_EXE_csi-agentd"))
        .arg("serve")
        .arg("--work-dir")
        .arg(&daemon.work)
        .arg("--api-socket")
        .arg(dir.path().join("second.sock"))
        .arg("--plugin-config-dir")
        .arg(&daemon.configs)
        .arg("--socket-root")
        .arg(&daemon.socket_root)
        .stdout(Stdio::null())
        .output()
        .unwrap();
    let took = started.elapsed();
    let stderr = String::from_utf8_lossy(&second.stderr);
    assert!(!second.status.success(), "{stderr}");
    assert!(
        stderr.contains(&format!(
            "is in use by another csi-agentd (pid {first}): stop that daemon first"
        )),
        "{stderr}"
    );
    assert!(!stderr.contains("waiting"), "{stderr}");
    assert!(took < Duration::from_secs(3), "refused after {took:?}");
    // The first one was not disturbed.
    daemon.api().health().await.unwrap();
}

const TOKEN: &str = "a-test-token-of-32-bytes-long-xx";

/// The status of `GET /v1/health` over TCP with `authorization` as the header's value.
fn health_status(port: u16, authorization: &str) -> u16 {
    let mut stream = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    write!(
        stream,
        "GET /v1/health HTTP/1.1\r\nhost: localhost\r\nauthorization: {authorization}\r\nconnection: close\r\n\r\n"
    )
    .unwrap();
    let mut answer = String::new();
    let _ = stream.read_to_string(&mut answer);
    answer
        .split_whitespace()
        .nth(1)
        .and_then(|code| code.parse().ok())
        .unwrap_or_else(|| panic!("no status in {answer:?}"))
}

#[tokio::test]
async fn the_bearer_scheme_is_case_insensitive_and_nothing_else_gets_in() {
    let dir = tempfile::tempdir().unwrap();
    let token = dir.path().join("token");
    std::fs::write(&token, format!("{TOKEN}\n")).unwrap();
    std::fs::set_permissions(&token, std::fs::Permissions::from_mode(0o600)).unwrap();
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let listen = format!("127.0.0.1:{port}");
    let mut daemon = Daemon::new(
        dir.path(),
        &["--listen", &listen, "--token-file", token.to_str().unwrap()],
    );
    daemon.start();
    wait_serving(&mut daemon).await;
    // RFC 7235 section 2.1: the scheme is case-insensitive.
    for scheme in ["Bearer", "bearer", "BEARER", "bEaReR"] {
        assert_eq!(
            health_status(port, &format!("{scheme} {TOKEN}")),
            200,
            "{scheme}"
        );
    }
    // The token itself is not: nor is any other scheme, or a scheme glued to the token.
    for refused in [
        format!("bearer {}", TOKEN.to_uppercase()),
        format!("Basic {TOKEN}"),
        format!("bearer{TOKEN}"),
        format!("bearerx {TOKEN}"),
        "bearer ".to_owned(),
        TOKEN.to_owned(),
    ] {
        assert_eq!(health_status(port, &refused), 401, "{refused}");
    }
}

#[tokio::test]
async fn a_plugin_added_by_a_reload_is_not_said_to_wait_for_an_open_gate() {
    let dir = tempfile::tempdir().unwrap();
    // Gate closed (--start on-request): `not_started` is the truth, and says so.
    let mut daemon = Daemon::new(dir.path(), &["--start", "on-request"]);
    daemon.add_config(
        "first.json",
        &managed_config("org.example.first", &dir.path().join("p1"), "v:1M"),
    );
    daemon.start();
    wait_serving(&mut daemon).await;
    let before = daemon.api().plugin("org.example.first").await.unwrap();
    assert_eq!(before.state, "not_started");
    let text = String::from_utf8_lossy(&daemon.csictl(&["plugins"]).stdout).into_owned();
    assert!(text.contains("the start gate is closed"), "{text}");

    daemon.api().start().await.unwrap();
    daemon.add_config(
        "added.json",
        &managed_config(PLUGIN, &dir.path().join("plugin"), "vol1:1M"),
    );
    let report = daemon.api().reload().await.unwrap();
    assert_eq!(report.added, vec![PLUGIN.to_owned()], "{report:?}");
    let added = daemon.api().plugin(PLUGIN).await.unwrap();
    assert_eq!(added.state, "idle", "{added:?}");
    let output = daemon.csictl(&["plugins"]);
    let text = String::from_utf8_lossy(&output.stdout).into_owned();
    assert!(!text.contains("the start gate is closed"), "{text}");
    assert!(text.contains("idle (starts on first use)"), "{text}");
    // And it does start on first use.
    daemon.api().publish(&publish("vol1", "w1")).await.unwrap();
    assert_eq!(daemon.api().plugin(PLUGIN).await.unwrap().state, "ready");
    daemon
        .api()
        .unpublish(&unpublish("vol1", "w1"))
        .await
        .unwrap();
}
