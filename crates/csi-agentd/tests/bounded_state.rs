//! Unknown ids create nothing: 100,000 requests naming distinct volumes, plugins and claims
//! that do not exist (a volume's status, a plugin's status, an unpublish) leave the daemon's
//! resident memory within 5 MiB of where it was, on the real daemon and the real test plugin.
//! An engine that made a map entry, a lock or a task per id it was asked about would grow by
//! tens of MiB here.
//!
//! Run as root under `unshare -m --propagation private`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use csi_agent::mounts::require_private_mount_namespace;
use csi_agent_api::ApiError;
use csi_agent_testkit::node::*;
use csi_agent_testkit::*;

const LOOKUPS: usize = 100_000;
/// Lookups made before the baseline is taken, so that what any first request allocates once
/// (connection buffers, the allocator's arenas, lazily built tables) is not counted as growth.
const WARM_UP: usize = 5_000;
const CLIENTS: usize = 8;
const BOUND_KIB: u64 = 5 * 1024;

fn rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|line| line.strip_prefix("VmRSS:"))
        .and_then(|rest| rest.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmRSS in /proc/PID/status")
}

/// One lookup of an id nobody created; each kind must answer 404 (or the idempotent 200 of an
/// unpublish of a claim that is not there) and change nothing.
async fn lookup(api: &csi_agent_api::ApiClient, n: usize) {
    let id = format!("unknown-{n:06}");
    match n % 3 {
        0 => match api.volume(PLUGIN, &id).await {
            Err(ApiError::Api { status: 404, .. }) => {}
            other => panic!("status of unknown volume {id}: {other:?}"),
        },
        1 => match api.plugin(&format!("org.example.{id}")).await {
            Err(ApiError::Api { status: 404, .. }) => {}
            other => panic!("status of unknown plugin {id}: {other:?}"),
        },
        _ => match api.unpublish(&unpublish_request(&id, "w-unknown")).await {
            Ok(_) => {}
            other => panic!("unpublish of unknown volume {id}: {other:?}"),
        },
    }
}

async fn lookups(node: &Node, from: usize, count: usize) {
    let next = Arc::new(AtomicUsize::new(from));
    let mut clients = Vec::new();
    for _ in 0..CLIENTS {
        let api = node.api();
        let next = next.clone();
        clients.push(tokio::spawn(async move {
            loop {
                let n = next.fetch_add(1, Ordering::Relaxed);
                if n >= from + count {
                    return;
                }
                lookup(&api, n).await;
            }
        }));
    }
    for client in clients {
        client.await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_hundred_thousand_unknown_ids_leave_memory_where_it_was() {
    require_private_mount_namespace();
    let mut node = Node::new("known:1Mi");
    node.start(None).await;
    node.wait_recovered().await;
    let pid = node.daemon_pid().unwrap();
    lookups(&node, 0, WARM_UP).await;
    let before = rss_kib(pid);
    let started = std::time::Instant::now();
    lookups(&node, WARM_UP, LOOKUPS).await;
    let took = started.elapsed();
    let after = rss_kib(pid);
    println!(
        "{LOOKUPS} unknown-id lookups in {took:?}: RSS {before} KiB -> {after} KiB ({:+} KiB)",
        after as i64 - before as i64
    );
    assert!(
        after <= before + BOUND_KIB,
        "resident memory grew from {before} KiB to {after} KiB over {LOOKUPS} unknown ids"
    );
    // Nothing was recorded or listed for any of them.
    let listed = node.api().volumes().await.unwrap();
    assert!(listed.volumes.is_empty(), "{:?}", listed.volumes);
    assert!(node.disk_record("unknown-000000").is_none());
    let plugins = node.api().plugins().await.unwrap();
    assert_eq!(plugins.plugins.len(), 1, "only the configured plugin");
}
