//! Pull progress (issue #13, item 2): a real registry (`docker-registry`) behind a throttling
//! TCP proxy so that a pull takes seconds, the real `csi-agentd` pulling the image of a Mesos
//! plugin config, and the progress seen from outside while it runs: on `GET /v1/images/pulls`
//! and on the waiting plugin (`GET /v1/plugins/{type}`), bytes growing toward the manifest's
//! sizes, then gone once the pull ends. Real containers: run under
//! `unshare -m --propagation private`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use serde_json::json;

use csi_agent_testkit::image::*;
use csi_agent_testkit::registry::*;
use csi_agent_testkit::*;

/// Forwards 127.0.0.1:<port> to `upstream`, the answers at about 6.5 MB/s (64 KiB every
/// 10 ms), so that a pull of a few MB lasts long enough to be watched. Stops with `stop`.
fn throttling_proxy(upstream: String, stop: Arc<AtomicBool>) -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    listener.set_nonblocking(true).unwrap();
    std::thread::spawn(move || {
        while !stop.load(Ordering::Relaxed) {
            let Ok((client, _)) = listener.accept() else {
                std::thread::sleep(Duration::from_millis(5));
                continue;
            };
            client.set_nonblocking(false).unwrap();
            let Ok(server) = TcpStream::connect(&upstream) else {
                continue;
            };
            let (mut client_in, mut server_out) =
                (client.try_clone().unwrap(), server.try_clone().unwrap());
            std::thread::spawn(move || {
                let _ = std::io::copy(&mut client_in, &mut server_out);
                let _ = server_out.shutdown(std::net::Shutdown::Write);
            });
            let (mut server_in, mut client_out) = (server, client);
            let stop = Arc::clone(&stop);
            std::thread::spawn(move || {
                let mut buf = vec![0u8; 64 * 1024];
                while !stop.load(Ordering::Relaxed) {
                    match server_in.read(&mut buf) {
                        Ok(0) | Err(_) => break,
                        Ok(n) => {
                            if client_out.write_all(&buf[..n]).is_err() {
                                break;
                            }
                            std::thread::sleep(Duration::from_millis(10));
                        }
                    }
                }
                let _ = client_out.shutdown(std::net::Shutdown::Write);
            });
        }
    });
    port
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pull_in_flight_shows_its_bytes_on_the_api_and_on_the_waiting_plugin() {
    csi_agent::mounts::require_private_mount_namespace();
    let dir = tempfile::Builder::new()
        .prefix("csi-progress-")
        .tempdir_in("/tmp")
        .unwrap();
    let registry = Registry::start(&dir.path().join("registry")).unwrap();
    let plugin_dir = dir.path().join("plugin");
    std::fs::create_dir_all(&plugin_dir).unwrap();
    let layout = dir.path().join("layout");
    plugin_image(&layout, &plugin_dir);
    push(&layout, &registry, "csi/testplugin:v1").unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let proxy = format!(
        "127.0.0.1:{}",
        throttling_proxy(registry.host(), Arc::clone(&stop))
    );

    let _containers = Containers(dir.path().join("sockets/runc"));
    let mut daemon = Daemon::new(
        dir.path(),
        &[
            "--docker-registry",
            &proxy,
            "--insecure-registry",
            &proxy,
            "--start-plugins",
        ],
    );
    daemon.add_config(
        "test.json",
        &json!({
            "type": PLUGIN,
            "containers": [component(
                &["CONTROLLER_SERVICE", "NODE_SERVICE"],
                json!({"type": "MESOS",
                       "mesos": {"image": {"type": "DOCKER", "docker": {"name": "csi/testplugin:v1"}}},
                       "volumes": [volume(&plugin_dir)]}),
            )],
            "startup_timeout_ms": 60000,
        }),
    );
    daemon.start();
    let api = daemon.api();
    let reference = format!("{proxy}/csi/testplugin:v1");

    // While the layer streams: the pull is listed with its blobs, part of the bytes done; the
    // plugin waiting for the image shows the same pull.
    let deadline = Instant::now() + Duration::from_secs(60);
    let first = loop {
        assert!(Instant::now() < deadline, "no pull in flight was ever seen");
        let pulls = api.image_pulls().await.unwrap().pulls;
        if let Some(pull) = pulls.first()
            && pull.bytes_done > 0
            && pull.bytes_done < pull.bytes_total
        {
            assert_eq!(pulls.len(), 1, "{pulls:?}");
            break pull.clone();
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert_eq!(first.reference, reference);
    assert_eq!(first.blobs.len(), 2, "config and one layer: {first:?}");
    assert_eq!(
        first.bytes_total,
        first.blobs.iter().map(|b| b.bytes_total).sum::<u64>()
    );
    assert!(
        first.blobs.iter().all(|b| b.digest.starts_with("sha256:")
            && b.bytes_done <= b.bytes_total
            && b.bytes_total > 0),
        "{first:?}"
    );
    let info = api.plugin(PLUGIN).await.unwrap();
    assert_eq!(info.image_pulls.len(), 1, "{info:?}");
    assert_eq!(info.image_pulls[0].reference, reference);
    assert!(
        info.image_pulls[0].bytes_done >= first.bytes_done,
        "{info:?}"
    );
    assert!(
        ready_pid(&info).is_none(),
        "ready before its image: {info:?}"
    );
    // It moves.
    let moved = loop {
        assert!(Instant::now() < deadline, "the pull's bytes never grew");
        let pulls = api.image_pulls().await.unwrap().pulls;
        match pulls.first() {
            Some(pull) if pull.bytes_done > first.bytes_done => break true,
            // Done between two looks: it grew to the end.
            None => break true,
            _ => tokio::time::sleep(Duration::from_millis(20)).await,
        }
    };
    assert!(moved);

    // Once the image is ready the plugin runs and no pull is listed any more.
    let info = wait_plugin(&daemon, PLUGIN, "the plugin ready", |i| {
        ready_pid(i).is_some()
    })
    .await;
    assert!(info.image_pulls.is_empty(), "{info:?}");
    assert!(api.image_pulls().await.unwrap().pulls.is_empty());
    let published = api.publish(&publish_request("vol1", "w1")).await.unwrap();
    assert!(is_mounted(std::path::Path::new(&published.target_path)));
    api.unpublish(&unpublish_request("vol1", "w1"))
        .await
        .unwrap();
    stop.store(true, Ordering::Relaxed);
}
