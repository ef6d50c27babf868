//! CSI volumes in real Docker and Podman containers through csi-agentd's volume plugin front
//! door (`--volume-plugin-socket`, docs/docker-podman.md): a real `dockerd` 20.10 and a real
//! `podman` 4.3 (Debian's), each on the test's own dirs (`csi_agent_testkit::engines`), the real
//! daemon and the real test plugin. Docker: create, write, read back in a second container, two
//! containers on one volume stopped in either order, csi-agentd SIGKILLed while a container
//! runs, dockerd restarted while one runs (live restore), remove (the CSI volume deleted), and a
//! bad option refused by `docker volume create`. Podman: the same create, run, run again, rm.
//!
//! Its own test binary: the engines' harness gives `/run/runc`, `/run/containerd` and friends a
//! private tmpfs for the whole process, which the daemon tests' runc containers must not share.
//! Run as root under `unshare -m --propagation private` (scripts/test does).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::Path;
use std::time::Duration;

use csi_agent_testkit::engines::{Dockerd, Engine, IMAGE, Podman};
use csi_agent_testkit::*;

/// The daemon with the test plugin and the protocol served on `socket`.
fn daemon(dir: &Path, socket: &Path) -> Daemon {
    require_private_mount_namespace();
    Daemon::builder(dir)
        .flag("--volume-plugin-socket")
        .flag(socket)
        .test_plugin("vol1:1M")
        .start()
}

/// The claims on the named volume's CSI volume, and whether its target is mounted.
async fn claims_and_mounted(daemon: &Daemon, volume_id: &str) -> (Vec<String>, bool) {
    let info = daemon.api().volume(PLUGIN, volume_id).await.unwrap();
    (info.claims, is_mounted(Path::new(&info.target_path)))
}

/// Waits (bounded) until the volume's claims are `expected` in number.
async fn wait_claims(daemon: &Daemon, volume_id: &str, expected: usize) {
    eventually(
        &format!("{expected} claims on {volume_id}"),
        Duration::from_secs(60),
        || async {
            let (claims, _) = claims_and_mounted(daemon, volume_id).await;
            if claims.len() == expected {
                Ok(())
            } else {
                Err(format!("claims {claims:?}"))
            }
        },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn docker_runs_containers_on_a_csi_volume_through_restarts_of_either_side() {
    let tmp = tempfile::tempdir().unwrap();
    // Discovered as an operator sets it up: the socket in /run/docker/plugins (here the
    // test's private copy of it), the driver named after the file.
    let driver = format!("csi-{}", std::process::id());
    let socket = Dockerd::plugin_socket_path(&driver);
    let mut daemon = daemon(tmp.path(), &socket);
    let mut docker = Dockerd::start(&tmp.path().join("docker"));
    docker.import_busybox();
    let before = daemon.backend_volume_ids().await;

    docker.run_ok([
        "volume",
        "create",
        "-d",
        &driver,
        "-o",
        &format!("plugin={PLUGIN}"),
        "-o",
        "size=16Mi",
        "v1",
    ]);
    let after = daemon.backend_volume_ids().await;
    assert_eq!(after.len(), before.len() + 1, "one CSI volume: {after:?}");
    let inspect = docker.run_ok(["volume", "inspect", "v1"]);
    let inspect: serde_json::Value = serde_json::from_str(&inspect).unwrap();
    let volume_id = inspect[0]["Status"]["volume_id"]
        .as_str()
        .unwrap_or_else(|| panic!("{inspect}"))
        .to_owned();
    assert!(after.contains(&volume_id));

    // Written by one container, read back by the next.
    let run = |args: &[&str]| {
        let mut all = vec!["run", "--network", "none"];
        all.extend_from_slice(args);
        docker.run_ok(all)
    };
    run(&[
        "--rm",
        "-v",
        "v1:/data",
        IMAGE,
        "sh",
        "-c",
        "echo hi > /data/f",
    ]);
    assert_eq!(
        run(&["--rm", "-v", "v1:/data", IMAGE, "cat", "/data/f"]),
        "hi"
    );
    let (claims, mounted) = claims_and_mounted(&daemon, &volume_id).await;
    assert!(claims.is_empty() && !mounted, "{claims:?} {mounted}");

    // Two containers at once, stopped in either order: mounted until the last one stops.
    for order in [["c1", "c2"], ["c2", "c1"]] {
        for name in ["c1", "c2"] {
            run(&[
                "-d", "--rm", "--name", name, "-v", "v1:/data", IMAGE, "sleep", "600",
            ]);
        }
        let (claims, mounted) = claims_and_mounted(&daemon, &volume_id).await;
        assert_eq!(claims.len(), 2, "{claims:?}");
        assert!(claims.iter().all(|c| c.starts_with("mount:")));
        assert!(mounted);
        docker.run_ok(["stop", "-t", "0", order[0]]);
        wait_claims(&daemon, &volume_id, 1).await;
        assert!(
            claims_and_mounted(&daemon, &volume_id).await.1,
            "still mounted"
        );
        assert_eq!(docker.run_ok(["exec", order[1], "cat", "/data/f"]), "hi");
        docker.run_ok(["stop", "-t", "0", order[1]]);
        wait_claims(&daemon, &volume_id, 0).await;
        assert!(
            !claims_and_mounted(&daemon, &volume_id).await.1,
            "unmounted"
        );
    }

    // csi-agentd SIGKILLed while a container runs, restarted, then the container stopped:
    // Docker's Unmount (retried) meets the restarted daemon, and nothing is left.
    run(&[
        "-d", "--rm", "--name", "c3", "-v", "v1:/data", IMAGE, "sleep", "600",
    ]);
    wait_claims(&daemon, &volume_id, 1).await;
    daemon.kill9();
    daemon.start();
    assert_eq!(docker.run_ok(["exec", "c3", "cat", "/data/f"]), "hi");
    docker.run_ok(["stop", "-t", "0", "c3"]);
    wait_claims(&daemon, &volume_id, 0).await;
    assert!(!claims_and_mounted(&daemon, &volume_id).await.1);

    // dockerd restarted while a container runs (live restore): the volume stays mounted and
    // the container keeps using it; stopping it afterwards unmounts. (Not a `--rm` one: dockerd
    // 20.10 removes those at a graceful restart's restore, live restore or not.)
    run(&[
        "-d", "--name", "c4", "-v", "v1:/data", IMAGE, "sleep", "600",
    ]);
    wait_claims(&daemon, &volume_id, 1).await;
    docker.restart();
    let (claims, mounted) = claims_and_mounted(&daemon, &volume_id).await;
    assert_eq!(claims.len(), 1, "{claims:?}");
    assert!(mounted, "the volume stays mounted across a dockerd restart");
    let running = docker.run(["inspect", "-f", "{{.State.Running}}", "c4"]);
    assert_eq!(
        String::from_utf8_lossy(&running.stdout).trim(),
        "true",
        "c4 after the dockerd restart: {}; dockerd's log: {}",
        String::from_utf8_lossy(&running.stderr),
        std::fs::read_to_string(docker.log_path()).unwrap_or_default()
    );
    assert_eq!(docker.run_ok(["exec", "c4", "cat", "/data/f"]), "hi");
    docker.run_ok(["stop", "-t", "0", "c4"]);
    docker.run_ok(["rm", "c4"]);
    wait_claims(&daemon, &volume_id, 0).await;
    assert!(!claims_and_mounted(&daemon, &volume_id).await.1);

    // Removed: the CSI volume csi-agent created is deleted.
    docker.run_ok(["volume", "rm", "v1"]);
    assert_eq!(daemon.backend_volume_ids().await, before);

    // A bad option: a clear error from `docker volume create`, and nothing created.
    let refused = docker.docker([
        "volume",
        "create",
        "-d",
        &driver,
        "-o",
        &format!("plugin={PLUGIN}"),
        "-o",
        "colour=red",
        "v2",
    ]);
    assert!(!refused.status.success());
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(stderr.contains("unknown option \"colour\""), "{stderr}");
    assert_eq!(daemon.backend_volume_ids().await, before);
    drop(docker);
    assert!(mounts_under(&tmp.path().join("work")).is_empty());
    drop(daemon);
    assert!(!socket.exists() || std::fs::remove_file(&socket).is_ok());
}

#[tokio::test(flavor = "multi_thread")]
async fn podman_runs_containers_on_a_csi_volume() {
    let tmp = tempfile::tempdir().unwrap();
    let socket = tmp.path().join("csi.sock");
    let daemon = daemon(tmp.path(), &socket);
    let mut podman = Podman::new(&tmp.path().join("podman"));
    podman.volume_plugin("csi", &socket);
    podman.import_busybox();
    let before = daemon.backend_volume_ids().await;

    podman.run_ok([
        "volume",
        "create",
        "--driver",
        "csi",
        "-o",
        &format!("plugin={PLUGIN}"),
        "-o",
        "size=16Mi",
        "v1",
    ]);
    assert_eq!(daemon.backend_volume_ids().await.len(), before.len() + 1);
    let run = |args: &[&str]| {
        let mut all = vec!["run", "--rm"];
        all.extend_from_slice(args);
        podman.run_ok(all)
    };
    run(&["-v", "v1:/data", IMAGE, "sh", "-c", "echo hi > /data/f"]);
    assert_eq!(run(&["-v", "v1:/data", IMAGE, "cat", "/data/f"]), "hi");
    let listed = podman.run_ok(["volume", "ls", "--format", "{{.Name}} {{.Driver}}"]);
    assert!(listed.lines().any(|l| l == "v1 csi"), "{listed}");
    // Nothing stays claimed or mounted once the containers are gone.
    let volumes = daemon.api().volumes().await.unwrap().volumes;
    assert!(volumes.iter().all(|v| v.claims.is_empty()), "{volumes:?}");
    assert!(mounts_under(&tmp.path().join("work")).is_empty());

    podman.run_ok(["volume", "rm", "v1"]);
    assert_eq!(daemon.backend_volume_ids().await, before);

    let refused = podman.podman([
        "volume",
        "create",
        "--driver",
        "csi",
        "-o",
        "size=lots",
        "-o",
        &format!("plugin={PLUGIN}"),
        "v2",
    ]);
    assert!(!refused.status.success());
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(stderr.contains("option size=\"lots\""), "{stderr}");
    assert_eq!(daemon.backend_volume_ids().await, before);
}
