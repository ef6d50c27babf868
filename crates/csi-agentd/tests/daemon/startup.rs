//! Start-up that tells the truth (issue #24, items 3, 7 and 8): a daemon started right after
//! its predecessor was SIGKILLed serves instead of naming the dead process; a live daemon still
//! keeps a second one out at once; and the messages an operator reads at start-up and in the
//! status say what is true. The real `csi-agentd` and `csictl`, the real test plugin, real
//! bind mounts: run as root under `unshare -m --propagation private`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::{Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use csi_agent_testkit::*;

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
    daemon
        .api()
        .publish(&publish_request("vol1", "w1"))
        .await
        .unwrap();
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
        .unpublish(&unpublish_request("vol1", "w1"))
        .await
        .unwrap();
}

/// `csi-agentd serve` on the work dir, configs and socket root of `daemon`, for a second
/// daemon started beside (or instead of) it.
fn serve_command(daemon: &Daemon) -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_csi-agentd"));
    daemon.serve_args(&mut command);
    command
}

#[tokio::test]
async fn a_live_daemon_still_keeps_a_second_one_out_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let mut daemon = Daemon::new(dir.path(), &[]);
    daemon.start();
    wait_serving(&mut daemon).await;
    let first = daemon.child.as_ref().unwrap().id();
    let started = Instant::now();
    let second = serve_command(&daemon)
        .arg("--api-socket")
        .arg(dir.path().join("second.sock"))
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
    daemon
        .api()
        .publish(&publish_request("vol1", "w1"))
        .await
        .unwrap();
    assert_eq!(daemon.api().plugin(PLUGIN).await.unwrap().state, "ready");
    daemon
        .api()
        .unpublish(&unpublish_request("vol1", "w1"))
        .await
        .unwrap();
}

/// Runs `csi-agentd serve` on the daemon's work dir with `extra` flags, expecting it to exit by
/// itself (a refusal) within 10 s: its output and how long it took.
fn serve_expecting_exit(daemon: &Daemon, extra: &[&str]) -> (std::process::Output, Duration) {
    let started = Instant::now();
    let mut child = serve_command(daemon)
        .args(extra)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    while child.try_wait().unwrap().is_none() {
        if started.elapsed() > Duration::from_secs(10) {
            let _ = child.kill();
            panic!("the daemon started instead of refusing");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let output = child.wait_with_output().unwrap();
    (output, started.elapsed())
}

/// Every secrets file under the work dir, with its content.
fn secrets_files(work: &std::path::Path) -> Vec<(std::path::PathBuf, Vec<u8>)> {
    let mut out = Vec::new();
    let mut dirs = vec![work.join("csi")];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
            let path = entry.path();
            let kind = entry.file_type().unwrap();
            // Never into a mount: the volumes' data is not ours to walk.
            if kind.is_dir() && !mounts_under(&dir).contains(&path) {
                dirs.push(path);
            } else if path.file_name().is_some_and(|n| n == "secrets.json") {
                out.push((path.clone(), std::fs::read(&path).unwrap()));
            }
        }
    }
    out.sort();
    out
}

/// Waits until the daemon has recovered every plugin's volumes.
async fn wait_recovered(daemon: &Daemon) -> csi_agent_api::VolumeList {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let list = daemon.api().volumes().await.unwrap();
        if !list.recovering {
            return list;
        }
        assert!(Instant::now() < deadline, "still recovering after 30 s");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn with_secrets(volume: &str, workload: &str) -> csi_agent_api::PublishRequest {
    let mut request = publish_request(volume, workload);
    request.secrets = Some(csi_agent_api::SecretsSpec {
        node_stage: [("user".to_owned(), format!("secret-of-{volume}"))].into(),
        node_publish: Default::default(),
    });
    request
}

const DB_FILES: [&str; 3] = ["state.db", "state.db-wal", "state.db-shm"];

#[tokio::test]
async fn a_vanished_state_db_is_refused_restored_or_reinitialized_and_nothing_is_deleted() {
    let dir = tempfile::tempdir().unwrap();
    let mut daemon = setup(dir.path(), &[]);
    for (volume, workload) in [("vol1", "w1"), ("vol2", "w2")] {
        daemon
            .api()
            .publish(&with_secrets(volume, workload))
            .await
            .unwrap();
    }
    daemon.kill9();
    let secrets = secrets_files(&daemon.work);
    let mounts = mounts_under(&daemon.work);
    assert_eq!(secrets.len(), 2, "{secrets:?}");
    assert!(mounts.len() >= 4, "{mounts:?}");
    // The operator's backup, taken while no daemon runs.
    let backup = dir.path().join("backup");
    std::fs::create_dir(&backup).unwrap();
    for file in DB_FILES {
        let _ = std::fs::copy(daemon.work.join(file), backup.join(file));
    }

    // Truncated to 0 bytes: refused, at once, naming what was found and the way out.
    std::fs::File::create(daemon.work.join("state.db")).unwrap();
    let (output, took) = serve_expecting_exit(&daemon, &[]);
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
    assert!(!output.status.success(), "{stderr}");
    assert!(took < Duration::from_secs(5), "{took:?}");
    for part in [
        "is empty (0 bytes)",
        "shows earlier state",
        "2 secrets file(s) (e.g. ",
        "2 volume mount dir(s)",
        "mount(s) beneath the work dir",
        "--reinitialize-state",
        "restore",
    ] {
        assert!(stderr.contains(part), "{part:?} not in {stderr}");
    }
    assert!(
        stderr.contains(&secrets[0].0.display().to_string()),
        "{stderr}"
    );
    assert_eq!(secrets_files(&daemon.work), secrets, "secrets changed");
    assert_eq!(mounts_under(&daemon.work), mounts, "mounts changed");

    // Restored from the copy: every claim is back, and an unpublish works.
    for file in DB_FILES {
        let _ = std::fs::remove_file(daemon.work.join(file));
        let _ = std::fs::copy(backup.join(file), daemon.work.join(file));
    }
    daemon.start();
    wait_serving(&mut daemon).await;
    let list = wait_recovered(&daemon).await;
    let claims: Vec<(String, Vec<String>)> = list
        .volumes
        .iter()
        .map(|v| (v.volume_id.clone(), v.claims.clone()))
        .collect();
    assert_eq!(
        claims,
        vec![
            ("vol1".to_owned(), vec!["w1".to_owned()]),
            ("vol2".to_owned(), vec!["w2".to_owned()])
        ]
    );
    daemon
        .api()
        .unpublish(&unpublish_request("vol1", "w1"))
        .await
        .unwrap();
    assert!(
        !mounts_under(&daemon.work)
            .iter()
            .any(|m| m.to_string_lossy().contains("vol1")),
        "{:?}",
        mounts_under(&daemon.work)
    );
    daemon.kill9();
    let secrets = secrets_files(&daemon.work);
    let mounts = mounts_under(&daemon.work);
    assert_eq!(
        secrets.len(),
        1,
        "vol2's secrets stay, vol1's went with its record"
    );

    // Removed: refused the same way.
    for file in DB_FILES {
        let _ = std::fs::remove_file(daemon.work.join(file));
    }
    let (output, _) = serve_expecting_exit(&daemon, &[]);
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
    assert!(!output.status.success(), "{stderr}");
    assert!(stderr.contains("is missing"), "{stderr}");
    assert!(
        !daemon.work.join("state.db").exists(),
        "the refusal created the database"
    );

    // --reinitialize-state: serves on an empty database and deletes nothing.
    daemon.extra = vec!["--reinitialize-state".to_owned()];
    daemon.start();
    wait_serving(&mut daemon).await;
    let list = wait_recovered(&daemon).await;
    assert!(list.volumes.is_empty(), "{list:?}");
    assert_eq!(secrets_files(&daemon.work), secrets, "secrets deleted");
    assert_eq!(mounts_under(&daemon.work), mounts, "mounts changed");
    let log = log_of(&daemon);
    assert!(
        log.contains("--reinitialize-state: the state database was missing"),
        "{log}"
    );
    assert!(
        log.contains("mount without a volume record; left in place"),
        "{log}"
    );

    // And at the next start, without the flag: the database is there, the secrets still kept.
    daemon.kill9();
    daemon.extra.clear();
    daemon.start();
    wait_serving(&mut daemon).await;
    wait_recovered(&daemon).await;
    assert_eq!(
        secrets_files(&daemon.work),
        secrets,
        "secrets deleted later"
    );
    assert!(
        log_of(&daemon).contains("secrets of a volume without a record kept"),
        "{}",
        log_of(&daemon)
    );
}
