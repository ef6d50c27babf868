//! End-to-end tests of the `csictl` binary: exit statuses, messages, and output against a
//! stand-in daemon.
//!
//! The stand-in is a small axum server with canned answers on a temporary unix socket; it tests
//! csictl's argument handling, transport and printing only, not the daemon's behaviour.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Output;
use std::sync::{Arc, Mutex};

use anyhow::{Context, Result, ensure};
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::{delete, get, post};
use axum::{Json, Router};
use csi_agent_api::*;
use tempfile::TempDir;

/// The request bodies the stand-in received, to check what csictl sent.
type Received = Arc<Mutex<Vec<String>>>;

struct FakeDaemon {
    _dir: TempDir,
    socket: PathBuf,
    received: Received,
    // Dropping the runtime stops the server.
    _runtime: tokio::runtime::Runtime,
}

fn volume(id: &str, state: &str, claims: &[&str]) -> VolumeInfo {
    VolumeInfo {
        plugin: "org.example.lvm".to_owned(),
        volume_id: id.to_owned(),
        state: state.to_owned(),
        claims: claims.iter().map(|c| (*c).to_owned()).collect(),
        capability: None,
        readonly: false,
        volume_context: BTreeMap::new(),
        target_path: format!("/w/csi/org.example.lvm/default/mounts/{id}/target"),
        target_path_relative: format!("csi/org.example.lvm/default/mounts/{id}/target"),
        origin: "created".to_owned(),
        has_secrets: true,
        last_error: None,
        operation: None,
        capacity_bytes: None,
        expansion: None,
        condition: None,
        accessible_topology: vec![],
        controller: None,
    }
}

fn fake_daemon() -> Result<FakeDaemon> {
    let dir = tempfile::tempdir()?;
    let socket = dir.path().join("api.sock");
    let received: Received = Arc::default();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?;
    let app = Router::new()
        .route(
            routes::VOLUMES,
            get(|| async {
                Json(VolumeList {
                    volumes: vec![
                        volume("vol-1", "PUBLISHED", &["c1", "c2"]),
                        volume("vol-2", "CREATED", &[]),
                    ],
                    ..VolumeList::default()
                })
            }),
        )
        .route(
            routes::PUBLISH,
            post(
                |State(received): State<Received>, body: String| async move {
                    if let Ok(mut received) = received.lock() {
                        received.push(body);
                    }
                    Json(PublishResponse {
                        target_path: "/w/csi/org.example.lvm/default/mounts/vol-1/target"
                            .to_owned(),
                        target_path_relative: "csi/org.example.lvm/default/mounts/vol-1/target"
                            .to_owned(),
                        state: "PUBLISHED".to_owned(),
                        bind_to: None,
                    })
                },
            ),
        )
        .route(
            routes::VOLUME,
            delete(|| async {
                (
                    StatusCode::CONFLICT,
                    Json(ErrorBody {
                        code: ErrorCode::Conflict,
                        message: "volume vol-1 is published for 2 workloads; unpublish it first"
                            .to_owned(),
                        grpc_code: None,
                    }),
                )
            }),
        )
        .route(
            routes::HEALTH,
            get(|| async {
                Json(Health {
                    status: "ok".to_owned(),
                    started: true,
                    version: "fake".to_owned(),
                })
            }),
        )
        .with_state(received.clone());
    let listener = {
        let _guard = runtime.enter();
        tokio::net::UnixListener::bind(&socket)?
    };
    runtime.spawn(async move { axum::serve(listener, app).await });
    Ok(FakeDaemon {
        _dir: dir,
        socket,
        received,
        _runtime: runtime,
    })
}

/// Runs csictl with a clean environment (no `CSI_AGENT_*` from the developer's shell).
fn csictl(args: &[&str]) -> Result<Output> {
    let mut cmd = assert_cmd::cargo::cargo_bin_cmd!("csictl");
    cmd.env_remove("CSI_AGENT_SOCKET")
        .env_remove("CSI_AGENT_URL")
        .env_remove("CSI_AGENT_TOKEN_FILE")
        .args(args);
    cmd.output().context("running csictl")
}

fn with_socket<'a>(socket: &'a Path, args: &[&'a str]) -> Vec<&'a str> {
    let mut all = vec!["--socket", socket.to_str().unwrap_or_default()];
    all.extend_from_slice(args);
    all
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

#[test]
fn health_with_missing_socket_exits_3_naming_the_socket() -> Result<()> {
    let out = csictl(&["--socket", "/nonexistent", "health"])?;
    let stderr = text(&out.stderr);
    ensure!(
        out.status.code() == Some(3),
        "status {:?}: {stderr}",
        out.status
    );
    ensure!(
        stderr.starts_with(
            "csictl: cannot connect to /nonexistent: No such file or directory; is csi-agentd \
             running with this work dir? (--socket)\n"
        ),
        "{stderr}"
    );
    ensure!(stderr.contains("hint: "), "{stderr}");
    ensure!(out.stdout.is_empty());
    Ok(())
}

#[test]
fn socket_comes_from_the_environment() -> Result<()> {
    let daemon = fake_daemon()?;
    let mut cmd = assert_cmd::cargo::cargo_bin_cmd!("csictl");
    let out = cmd
        .env("CSI_AGENT_SOCKET", &daemon.socket)
        .env_remove("CSI_AGENT_URL")
        .arg("health")
        .output()?;
    ensure!(out.status.success(), "{}", text(&out.stderr));
    ensure!(text(&out.stdout) == "status:   ok\nstarted:  yes\nversion:  fake\n");
    Ok(())
}

#[test]
fn volumes_table_against_fake_daemon() -> Result<()> {
    let daemon = fake_daemon()?;
    let out = csictl(&with_socket(&daemon.socket, &["volumes"]))?;
    ensure!(out.status.success(), "{}", text(&out.stderr));
    ensure!(
        text(&out.stdout)
            == "PLUGIN           VOLUME  STATE      CLAIMS  TARGET\n\
                org.example.lvm  vol-1   PUBLISHED  c1,c2   /w/csi/org.example.lvm/default/mounts/vol-1/target\n\
                org.example.lvm  vol-2   CREATED    -       /w/csi/org.example.lvm/default/mounts/vol-2/target\n",
        "{}",
        text(&out.stdout)
    );
    Ok(())
}

#[test]
fn volumes_json_is_the_api_json() -> Result<()> {
    let daemon = fake_daemon()?;
    let out = csictl(&with_socket(&daemon.socket, &["volumes", "-o", "json"]))?;
    ensure!(out.status.success(), "{}", text(&out.stderr));
    let list: VolumeList = parse_json(&text(&out.stdout))?;
    ensure!(list.volumes.len() == 2 && list.volumes[0].volume_id == "vol-1");
    Ok(())
}

fn parse_json<T: serde::de::DeserializeOwned>(text: &str) -> Result<T> {
    serde_json::from_str(text).with_context(|| format!("not JSON: {text}"))
}

#[test]
fn api_error_exits_1_with_message_and_hint() -> Result<()> {
    let daemon = fake_daemon()?;
    let out = csictl(&with_socket(
        &daemon.socket,
        &["delete", "--plugin", "org.example.lvm", "--volume", "vol-1"],
    ))?;
    let stderr = text(&out.stderr);
    ensure!(
        out.status.code() == Some(1),
        "status {:?}: {stderr}",
        out.status
    );
    ensure!(
        stderr
            == "csictl: volume vol-1 is published for 2 workloads; unpublish it first\n\
                hint: see the volume's claims and state with `csictl volumes PLUGIN VOLUME_ID`\n",
        "{stderr}"
    );
    Ok(())
}

#[test]
fn publish_sends_secrets_but_never_prints_them() -> Result<()> {
    let daemon = fake_daemon()?;
    let out = csictl(&with_socket(
        &daemon.socket,
        &[
            "publish",
            "--plugin",
            "org.example.lvm",
            "--volume",
            "vol-1",
            "--workload",
            "c1",
            "--stage-secret",
            "password=hunter2",
            "-o",
            "json",
        ],
    ))?;
    ensure!(out.status.success(), "{}", text(&out.stderr));
    ensure!(!text(&out.stdout).contains("hunter2") && !text(&out.stderr).contains("hunter2"));
    let answer: PublishResponse = parse_json(&text(&out.stdout))?;
    ensure!(answer.state == "PUBLISHED");

    let received = daemon
        .received
        .lock()
        .map_err(|_| anyhow::anyhow!("poisoned"))?
        .clone();
    ensure!(received.len() == 1);
    let request: PublishRequest = parse_json(&received[0])?;
    ensure!(request.workload == "c1");
    ensure!(
        request
            .secrets
            .and_then(|s| s.node_stage.get("password").cloned())
            .as_deref()
            == Some("hunter2")
    );
    ensure!(request.capability == CapabilitySpec::mount("SINGLE_NODE_WRITER", "", vec![]));
    Ok(())
}

#[test]
fn bad_context_exits_2_naming_the_flag() -> Result<()> {
    let out = csictl(&[
        "--socket",
        "/nonexistent",
        "publish",
        "--plugin",
        "p",
        "--volume",
        "v",
        "--context",
        "x",
    ])?;
    let stderr = text(&out.stderr);
    ensure!(
        out.status.code() == Some(2),
        "status {:?}: {stderr}",
        out.status
    );
    ensure!(
        stderr.starts_with("csictl: --context expects KEY=VALUE, got 'x'\n"),
        "{stderr}"
    );
    Ok(())
}

#[test]
fn bad_secret_is_not_echoed() -> Result<()> {
    let out = csictl(&[
        "--socket",
        "/nonexistent",
        "publish",
        "--plugin",
        "p",
        "--volume",
        "v",
        "--publish-secret",
        "hunter2",
    ])?;
    let stderr = text(&out.stderr);
    ensure!(
        out.status.code() == Some(2),
        "status {:?}: {stderr}",
        out.status
    );
    ensure!(
        stderr.contains("--publish-secret expects KEY=VALUE"),
        "{stderr}"
    );
    ensure!(!stderr.contains("hunter2"), "{stderr}");
    Ok(())
}

#[test]
fn clap_usage_errors_exit_2() -> Result<()> {
    for args in [
        &["publish", "--volume", "v"][..],
        &[
            "create",
            "--plugin",
            "p",
            "--name",
            "n",
            "--capacity",
            "1.5Gi",
        ],
        &[
            "publish",
            "--plugin",
            "p",
            "--volume",
            "v",
            "--access-mode",
            "rw",
        ],
        &["no-such-command"],
    ] {
        let out = csictl(args)?;
        ensure!(
            out.status.code() == Some(2),
            "{args:?}: status {:?}: {}",
            out.status,
            text(&out.stderr)
        );
    }
    Ok(())
}

#[test]
fn help_lists_every_subcommand() -> Result<()> {
    let out = csictl(&["--help"])?;
    ensure!(out.status.success());
    let help = text(&out.stdout);
    for command in [
        "health",
        "start",
        "metrics",
        "plugins",
        "reload",
        "publish",
        "unpublish",
        "volumes",
        "create",
        "delete",
        "validate",
        "backend-volumes",
        "capacity",
        "cluster",
    ] {
        ensure!(
            help.contains(&format!("  {command} ")),
            "{command} missing:\n{help}"
        );
    }
    Ok(())
}

/// A user who is not the daemon's gets `Permission denied` on its 0600 socket: the hint says
/// to run csictl as the daemon's user, with sudo (issue #30: a newcomer with sudo rights ran
/// csictl as themselves). The tests run as root; csictl runs here as `nobody` through setpriv,
/// from a copy in a dir `nobody` can reach.
#[test]
fn a_permission_denied_socket_hints_at_sudo() -> Result<()> {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir()?;
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755))?;
    let socket = dir.path().join("api.sock");
    let _listener = std::os::unix::net::UnixListener::bind(&socket)?;
    std::fs::set_permissions(&socket, std::fs::Permissions::from_mode(0o600))?;
    let copy = dir.path().join("csictl");
    std::fs::copy(env!("CARGO_BIN_EXE_csictl"), &copy)?;
    std::fs::set_permissions(&copy, std::fs::Permissions::from_mode(0o755))?;
    let out = std::process::Command::new("setpriv")
        .args(["--reuid=65534", "--regid=65534", "--clear-groups"])
        .arg(&copy)
        .arg("--socket")
        .arg(&socket)
        .arg("health")
        .env_remove("CSI_AGENT_SOCKET")
        .output()
        .context("running setpriv (util-linux): these tests run as root")?;
    let stderr = text(&out.stderr);
    ensure!(out.status.code() == Some(3), "{:?}: {stderr}", out.status);
    ensure!(stderr.contains("Permission denied"), "{stderr}");
    ensure!(
        stderr.contains("run csictl as that user, e.g. `sudo csictl …`"),
        "{stderr}"
    );
    Ok(())
}
