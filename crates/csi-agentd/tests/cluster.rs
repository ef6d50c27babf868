//! Cluster mode end to end (issue 28, docs/cluster.md): real etcd 3.4 on loopback, two or
//! three real csi-agentd daemons with their own work dirs, node names and mount namespaces,
//! each running the test plugin on one shared backend (`--backend-dir`), as networked
//! storage is. Double attach is judged by the backend's own records
//! ([`BackendJudge`]), never by csi-agent's word.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod cluster_support;

use std::path::PathBuf;
use std::time::{Duration, Instant};

use csi_agent_api::ApiClient;
use csi_agent_testkit::backend::BackendJudge;
use csi_agent_testkit::daemon::Daemon;
use csi_agent_testkit::etcd::{EtcdCluster, EtcdProxy, ProxyMode};
use csi_agent_testkit::{PLUGIN, api_error, eventually, publish_request, unpublish_request};
use serde_json::json;

use cluster_support::*;

/// Waits until the node refuses to join, for a reason containing `why`.
async fn refused(daemon: &Daemon, why: &str) {
    session_until(
        daemon,
        "the node to refuse to join",
        Duration::from_secs(10),
        |s| s["state"] == "REFUSED" && s["reason"].as_str().is_some_and(|r| r.contains(why)),
    )
    .await;
}

/// Repeats a publish of `volume` on `daemon` (15 s at most) until it is refused with
/// `status` and a message containing `why`.
async fn publish_refused(daemon: &Daemon, volume: &str, status: u16, why: &str) {
    let api = daemon.api();
    let what = format!("a publish of {volume} to be refused with {status} ({why})");
    eventually(&what, Duration::from_secs(15), || {
        let api = api.clone();
        async move {
            match api.publish(&publish_request(volume, "late")).await {
                Err(csi_agent_api::ApiError::Api { status: got, body })
                    if got == status && body.message.contains(why) =>
                {
                    Ok(())
                }
                other => Err(format!("{other:?}")),
            }
        }
    })
    .await;
}

/// The daemon's count of etcd calls `op` that succeeded (its metrics).
async fn etcd_calls(api: &ApiClient, op: &str) -> f64 {
    let metrics = api.metrics().await.unwrap();
    let series =
        format!("csi_agent_etcd_request_duration_seconds_count{{op=\"{op}\",outcome=\"ok\"}} ");
    metrics
        .lines()
        .find_map(|line| line.strip_prefix(&series))
        .map_or(0.0, |v| v.trim().parse().unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_single_node_volume_moves_between_nodes_only_after_its_unpublish() {
    let (tmp, backend) = scratch();
    let etcd = EtcdCluster::start(1);
    // n1 first, so that it leads the plugin's controller: its own steps are sent by itself,
    // n2's are handed to it.
    let (n1, n2) = leader_and_follower(tmp.path(), &etcd.endpoints_flag(), &backend).await;
    let judge = BackendJudge::new(&backend);
    let client = etcd_client(etcd.client_urls()).await;

    let reads = etcd_calls(&n1.api(), "get").await;
    let writes = etcd_calls(&n1.api(), "txn").await;
    let published = n1
        .api()
        .publish(&publish_request("vol1", "w1"))
        .await
        .unwrap();
    // One read (the claim's) and two guarded writes (the claim, ATTACHED): the node's own
    // last write stands in for a read before its next one.
    assert_eq!(etcd_calls(&n1.api(), "get").await - reads, 1.0);
    assert_eq!(etcd_calls(&n1.api(), "txn").await - writes, 2.0);
    // n1's presence now carries what its plugin answered to NodeGetInfo (asked by the
    // publish), as n2 sees it.
    session_until(
        &n2,
        "n1's CSI node id in its presence",
        Duration::from_secs(20),
        |s| {
            s["members"].as_array().is_some_and(|members| {
                members.iter().any(|m| {
                    m["node"] == "n1"
                        && m["csi_nodes"]
                            .as_array()
                            .is_some_and(|c| c.len() == 1 && c[0]["node_id"] == "n1")
                })
            })
        },
    )
    .await;
    let on_n1 = PathBuf::from(&published.target_path);
    in_node(&n1, &format!("echo hi > {}/data", on_n1.display()));
    assert_eq!(
        etcd_entries(&client).await,
        [("vol1".to_owned(), "n1".to_owned(), "ATTACHED".to_owned())]
    );

    // n2 is refused before any RPC, naming the holder.
    let (status, body) = api_error(n2.api().publish(&publish_request("vol1", "w2")).await);
    assert_eq!(status, 409, "{body:?}");
    assert!(
        body.message.contains("node n1 (ATTACHED)"),
        "{}",
        body.message
    );
    assert!(
        rpcs(&judge, "n2", "vol1").is_empty(),
        "{:?}",
        judge.calls_for_node("n2")
    );
    assert_eq!(
        judge.attachments().get("vol1").cloned(),
        Some(vec!["n1".to_owned()])
    );

    let metrics = n2.api().metrics().await.unwrap();
    let conflicts = format!("csi_agent_cluster_conflicts_total{{plugin=\"{PLUGIN}\"}} 1");
    assert!(metrics.contains(&conflicts), "{metrics}");
    let timed = "csi_agent_etcd_request_duration_seconds_count{op=\"txn\",outcome=\"ok\"}";
    assert!(metrics.contains(timed), "{metrics}");

    // The unpublish answers once the volume is free: ControllerUnpublish(n1) sent, the entry gone.
    let reads = etcd_calls(&n1.api(), "get").await;
    let writes = etcd_calls(&n1.api(), "txn").await;
    n1.api()
        .unpublish(&unpublish_request("vol1", "w1"))
        .await
        .unwrap();
    // NODE_DETACHED and the removal, from the publish's last write: no read.
    assert_eq!(etcd_calls(&n1.api(), "get").await - reads, 0.0);
    assert_eq!(etcd_calls(&n1.api(), "txn").await - writes, 2.0);
    let n1_rpcs = rpcs(&judge, "n1", "vol1");
    assert_eq!(
        n1_rpcs
            .iter()
            .rev()
            .take(3)
            .rev()
            .cloned()
            .collect::<Vec<_>>(),
        [
            "NodeUnpublishVolume",
            "NodeUnstageVolume",
            "ControllerUnpublishVolume"
        ],
        "{n1_rpcs:?}"
    );
    assert!(etcd_entries(&client).await.is_empty());

    let published = n2
        .api()
        .publish(&publish_request("vol1", "w2"))
        .await
        .unwrap();
    assert_eq!(
        in_node(&n2, &format!("cat {}/data", published.target_path)).trim(),
        "hi",
        "the data written through n1 is read through n2"
    );
    assert_eq!(rpcs(&judge, "n2", "vol1")[0], "ControllerPublishVolume");
    // n2 does not lead: its ControllerPublish was sent by the leader's plugin instance.
    assert_eq!(senders(&judge, "ControllerPublishVolume", "n2"), ["n1"]);
    assert_eq!(
        etcd_entries(&client).await,
        [("vol1".to_owned(), "n2".to_owned(), "ATTACHED".to_owned())]
    );
    // And its unpublish: ControllerUnpublish(n2) by the leader, the entry gone when it answers.
    n2.api()
        .unpublish(&unpublish_request("vol1", "w2"))
        .await
        .unwrap();
    assert!(etcd_entries(&client).await.is_empty());
    assert_eq!(senders(&judge, "ControllerUnpublishVolume", "n2"), ["n1"]);
    judge.assert_no_double_attach();

    // n2 waited for each of the leader's results on a watch of the volume's key, not by
    // reading it every 10 ms.
    assert_eq!(etcd_calls(&n2.api(), "watch").await, 2.0);
    // n1 leads with a watch on the plugin's pending hints (n2's requests woke it); idle, it
    // lists them once a second, where polling would every 100 ms.
    assert!(etcd_calls(&n1.api(), "background_watch").await >= 1.0);
    let lists = etcd_calls(&n1.api(), "background_list").await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let idle = etcd_calls(&n1.api(), "background_list").await - lists;
    eprintln!("n1 listed {idle} times in 3 s idle");
    assert!(idle <= 8.0, "{idle} listings in 3 s idle");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_leader_killed_after_a_controller_publish_for_another_node_is_replaced() {
    let (tmp, backend) = scratch();
    let etcd = EtcdCluster::start(1);
    let client = etcd_client(etcd.client_urls()).await;
    // n1 leads, and dies right after its ControllerPublish for another node answered, before
    // it wrote the result.
    let mut n1 = start_node(tmp.path(), "n1", &etcd.endpoints_flag(), &backend);
    arm(&mut n1, "cluster.leader.after_rpc");
    joined(&n1).await;
    leads(&n1).await;
    let n2 = start_node(tmp.path(), "n2", &etcd.endpoints_flag(), &backend);
    joined(&n2).await;
    sees_leader(&n2, "n1").await;
    let judge = BackendJudge::new(&backend);

    let api = n2.api();
    let publish = tokio::spawn(async move { api.publish(&publish_request("vol1", "w1")).await });
    exited_at_failpoint(&mut n1);
    let died = Instant::now();
    let published = publish.await.unwrap().unwrap();
    let took = died.elapsed();
    // Within the lease TTL (n1's leader key goes with its lease) + 2 s (issue 28).
    let ttl: u64 = LEASE_TTL_SECS.parse().unwrap();
    assert!(
        took <= Duration::from_secs(ttl + 2),
        "the publish finished {took:?} after the leader died"
    );
    eprintln!("publish finished {took:?} after the leader died");
    sees_leader(&n2, "n2").await;
    // Sent by both leaders (the RPC is idempotent), attached to n2 alone, and usable.
    assert_eq!(
        senders(&judge, "ControllerPublishVolume", "n2"),
        ["n1", "n2"]
    );
    assert_eq!(judge.attachments()["vol1"], ["n2"]);
    in_node(&n2, &format!("echo moved > {}/data", published.target_path));
    assert_eq!(
        etcd_entries(&client).await,
        [("vol1".to_owned(), "n2".to_owned(), "ATTACHED".to_owned())]
    );
    let metrics = n2.api().metrics().await.unwrap();
    let changes = format!("csi_agent_cluster_leader_changes_total{{plugin=\"{PLUGIN}\"}} 1");
    assert!(metrics.contains(&changes), "{metrics}");

    // n1 back: it follows n2, and its volume goes through n2 too.
    disarm(&mut n1);
    joined(&n1).await;
    sees_leader(&n1, "n2").await;
    n2.api()
        .unpublish(&unpublish_request("vol1", "w1"))
        .await
        .unwrap();
    n1.api()
        .publish(&publish_request("vol1", "w2"))
        .await
        .unwrap();
    assert_eq!(senders(&judge, "ControllerPublishVolume", "n1"), ["n2"]);
    assert!(judge.violations().is_empty(), "{:?}", judge.violations());
    judge.assert_no_double_attach();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn multi_node_modes_admit_readers_everywhere_and_one_writer() {
    let (tmp, backend) = scratch();
    let etcd = EtcdCluster::start(1);
    let nodes: Vec<Node> = ["n1", "n2", "n3"]
        .iter()
        .map(|n| start_node(tmp.path(), n, &etcd.endpoints_flag(), &backend))
        .collect();
    for node in &nodes {
        joined(node).await;
    }
    let judge = BackendJudge::new(&backend);
    let client = etcd_client(etcd.client_urls()).await;

    // MULTI_NODE_READER_ONLY: published on three nodes at once.
    for (i, node) in nodes.iter().enumerate() {
        node.api()
            .publish(&with_mode(
                "vol1",
                &format!("r{i}"),
                "MULTI_NODE_READER_ONLY",
                true,
            ))
            .await
            .unwrap();
    }
    let entries = etcd_entries(&client).await;
    assert_eq!(entries.len(), 3, "{entries:?}");
    assert!(
        entries
            .iter()
            .all(|(v, _, s)| v == "vol1" && s == "ATTACHED"),
        "{entries:?}"
    );
    let mut attached = judge.attachments()["vol1"].clone();
    attached.sort();
    assert_eq!(attached, ["n1", "n2", "n3"]);

    // Another capability on a held volume is refused, naming the held one.
    let (status, body) = api_error(
        nodes[0]
            .api()
            .publish(&with_mode("vol1", "x", "MULTI_NODE_MULTI_WRITER", false))
            .await,
    );
    assert_eq!(status, 409, "{body:?}");
    assert!(
        body.message.contains("MULTI_NODE_READER_ONLY"),
        "{}",
        body.message
    );

    // MULTI_NODE_SINGLE_WRITER: one writer, readers beside it, a second writer refused.
    let mode = "MULTI_NODE_SINGLE_WRITER";
    nodes[0]
        .api()
        .publish(&with_mode("vol2", "w", mode, false))
        .await
        .unwrap();
    nodes[1]
        .api()
        .publish(&with_mode("vol2", "r", mode, true))
        .await
        .unwrap();
    let (status, body) = api_error(
        nodes[2]
            .api()
            .publish(&with_mode("vol2", "w2", mode, false))
            .await,
    );
    assert_eq!(status, 409, "{body:?}");
    assert!(body.message.contains("node n1"), "{}", body.message);
    assert!(
        rpcs(&judge, "n3", "vol2").is_empty(),
        "{:?}",
        rpcs(&judge, "n3", "vol2")
    );
    judge.assert_no_double_attach();
}

/// The RPCs the backend saw from `node` since call number `from` (of that node's calls).
fn rpcs_since(judge: &BackendJudge, node: &str, from: usize) -> Vec<(String, String)> {
    judge
        .calls_for_node(node)
        .into_iter()
        .skip(from)
        .map(|c| (c.rpc, c.volume.unwrap_or_default()))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_cut_off_from_etcd_keeps_its_volume_until_fenced_and_uses_none_of_it_after() {
    let (tmp, backend) = scratch();
    let etcd = EtcdCluster::start(1);
    let upstream = etcd.client_urls()[0]
        .trim_start_matches("http://")
        .to_owned();
    let proxy = EtcdProxy::start(&upstream);
    let n1 = start_node(tmp.path(), "n1", &proxy.url(), &backend);
    let n2 = start_node(tmp.path(), "n2", &etcd.endpoints_flag(), &backend);
    joined(&n1).await;
    joined(&n2).await;
    let judge = BackendJudge::new(&backend);

    let published = n1
        .api()
        .publish(&publish_request("vol1", "w1"))
        .await
        .unwrap();
    in_node(&n1, &format!("echo hi > {}/data", published.target_path));

    // A live node cannot be fenced.
    let (status, body) = api_error(n2.api().fence("n1", "test").await);
    assert_eq!(status, 409, "{body:?}");
    assert!(body.message.contains("n1 is alive"), "{}", body.message);

    // Cut off: n1 keeps its mount, answers status at once, refuses new cluster publishes.
    proxy.set_mode(ProxyMode::Blackhole);
    session_until(
        &n1,
        "n1 to notice it is cut off",
        Duration::from_secs(10),
        |s| s["state"] != "HEALTHY",
    )
    .await;
    let asked = Instant::now();
    let volumes = n1.api().volumes().await.unwrap();
    let status = cluster_status(&n1.api()).await.unwrap();
    assert!(
        asked.elapsed() < Duration::from_millis(500),
        "{:?}",
        asked.elapsed()
    );
    assert!(
        volumes.volumes.iter().any(|v| v.volume_id == "vol1"),
        "{volumes:?}"
    );
    assert!(status["reason"].as_str().is_some(), "{status}");
    let (status, body) = api_error(n1.api().publish(&publish_request("vol2", "w1")).await);
    assert_eq!(status, 503, "{body:?}");
    assert!(
        body.message.contains("cannot be published now"),
        "{}",
        body.message
    );
    assert_eq!(
        in_node(&n1, &format!("cat {}/data", published.target_path)).trim(),
        "hi"
    );

    // Its claim stays: once its lease ran out, the volume still cannot move.
    publish_refused(&n2, "vol1", 409, "SUSPECT").await;
    assert!(
        rpcs(&judge, "n2", "vol1").is_empty(),
        "{:?}",
        rpcs(&judge, "n2", "vol1")
    );

    // Fenced: n2's daemon detaches it from n1 (n1's CSI node id) and the volume moves.
    let report = n2.api().fence("n1", "n1 is powered off").await.unwrap();
    assert_eq!(report.freed, ["vol1"], "{report:?}");
    assert!(
        judge.calls().iter().any(|c| c.node == "n2"
            && c.rpc == "ControllerUnpublishVolume"
            && c.target_node.as_deref() == Some("n1")
            && c.volume.as_deref() == Some("vol1")
            && c.outcome == "OK"),
        "{:?}",
        judge.calls()
    );
    let moved = n2
        .api()
        .publish(&publish_request("vol1", "w2"))
        .await
        .unwrap();
    assert_eq!(
        in_node(&n2, &format!("cat {}/data", moved.target_path)).trim(),
        "hi"
    );

    // n1 back: it releases vol1 on its side only, and uses none of it.
    let before = judge.calls_for_node("n1").len();
    proxy.set_mode(ProxyMode::Pass);
    session_until(
        &n1,
        "n1 to rejoin after its fenced cleanup",
        Duration::from_secs(20),
        |s| {
            s["state"] == "HEALTHY"
                && s["released_after_fence"]
                    .as_array()
                    .is_some_and(|v| v.iter().any(|x| x == "vol1"))
        },
    )
    .await;
    let after = rpcs_since(&judge, "n1", before);
    let kinds: Vec<&str> = after
        .iter()
        .filter(|(_, v)| v == "vol1")
        .map(|(r, _)| r.as_str())
        .collect();
    assert_eq!(
        kinds,
        ["NodeUnpublishVolume", "NodeUnstageVolume"],
        "{after:?}"
    );
    let volumes = n1.api().volumes().await.unwrap();
    assert!(
        volumes
            .volumes
            .iter()
            .all(|v| v.volume_id != "vol1" || v.claims.is_empty()),
        "{volumes:?}"
    );
    assert!(
        !in_node(&n1, "cat /proc/self/mountinfo").contains("/vol1/"),
        "n1 still mounts vol1"
    );
    // n2 still holds it, alone.
    assert_eq!(judge.attachments()["vol1"], ["n2"]);
    assert!(judge.violations().is_empty(), "{:?}", judge.violations());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn losing_one_etcd_member_of_three_is_not_noticed_and_losing_quorum_refuses_only_new_publishes()
 {
    let (tmp, backend) = scratch();
    let mut etcd = EtcdCluster::start(3);
    let n1 = start_node(tmp.path(), "n1", &etcd.endpoints_flag(), &backend);
    joined(&n1).await;
    n1.api()
        .publish(&publish_request("vol1", "w1"))
        .await
        .unwrap();

    etcd.kill(0);
    for i in 0..20 {
        let workload = format!("w{i}");
        n1.api()
            .publish(&publish_request("vol2", &workload))
            .await
            .unwrap();
        n1.api()
            .unpublish(&unpublish_request("vol2", &workload))
            .await
            .unwrap();
    }
    let status = cluster_status(&n1.api()).await.unwrap();
    assert_eq!(status["state"], "HEALTHY", "{status}");
    assert_eq!(status["lease_losses"], 0, "{status}");

    // Quorum lost: new cluster publishes refused with the reason; status and lists answer.
    etcd.kill(1);
    publish_refused(&n1, "vol3", 503, "cannot be published now").await;
    let asked = Instant::now();
    let volumes = n1.api().volumes().await.unwrap();
    cluster_status(&n1.api()).await.unwrap();
    assert!(
        asked.elapsed() < Duration::from_millis(500),
        "{:?}",
        asked.elapsed()
    );
    assert!(
        volumes
            .volumes
            .iter()
            .any(|v| v.volume_id == "vol1" && !v.claims.is_empty())
    );
    // An unpublish completes on the node; its release waits for etcd.
    n1.api()
        .unpublish(&unpublish_request("vol1", "w1"))
        .await
        .unwrap();

    // Quorum back: the pending release is written, and publishes work again.
    etcd.restart(0);
    etcd.restart(1);
    let client = etcd_client(etcd.client_urls()).await;
    eventually(
        "the pending release to reach etcd",
        Duration::from_secs(30),
        || {
            let client = client.clone();
            async move {
                let entries = etcd_entries(&client).await;
                entries
                    .is_empty()
                    .then_some(())
                    .ok_or(format!("{entries:?}"))
            }
        },
    )
    .await;
    joined(&n1).await;
    n1.api()
        .publish(&publish_request("vol3", "w1"))
        .await
        .unwrap();
    BackendJudge::new(&backend).assert_no_double_attach();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_name_belongs_to_the_first_daemon_and_a_work_dir_keeps_its_names() {
    let (tmp, backend) = scratch();
    let etcd = EtcdCluster::start(1);
    let mut first = start_node(tmp.path(), "n1", &etcd.endpoints_flag(), &backend);
    joined(&first).await;

    // Another daemon (another work dir) with the same node name is refused, and says why.
    let impostor = {
        let root = tmp.path().join("impostor");
        node_with(&root, "n1", &etcd.endpoints_flag(), &backend, &[])
    };
    refused(&impostor, "belongs to another csi-agentd").await;
    let (status, body) = api_error(impostor.api().publish(&publish_request("vol1", "w1")).await);
    assert_eq!(status, 503, "{body:?}");
    drop(impostor);

    // The first daemon's work dir refuses another node name.
    first.kill9();
    first.extra.iter_mut().for_each(|arg| {
        if arg == "n1" {
            *arg = "renamed".to_owned();
        }
    });
    let mut command = first.command();
    let out = command.output().unwrap();
    assert!(!out.status.success());
    let stderr = first.full_log();
    assert!(
        stderr.contains("joined cluster \"t\" as node \"n1\"") && stderr.contains("--node-name n1"),
        "{stderr}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_damaged_claim_reads_as_held_and_a_replaced_etcd_is_not_a_free_cluster() {
    let (tmp, backend) = scratch();
    let etcd = EtcdCluster::start(1);
    let mut n1 = start_node(tmp.path(), "n1", &etcd.endpoints_flag(), &backend);
    joined(&n1).await;
    n1.api()
        .publish(&publish_request("vol1", "w1"))
        .await
        .unwrap();
    let client = etcd_client(etcd.client_urls()).await;
    let key = format!(
        "/csi-agent/{CLUSTER}/v1/vol/{}/default/vol2",
        csi_agent::layout::encode_id(PLUGIN)
    );
    client
        .put(key.as_bytes(), b"{not json", None)
        .await
        .unwrap();
    let (status, body) = api_error(n1.api().publish(&publish_request("vol2", "w1")).await);
    assert_eq!(status, 409, "{body:?}");
    assert!(
        body.message.contains(&key) && body.message.contains("unknown holder"),
        "{}",
        body.message
    );
    assert!(rpcs(&BackendJudge::new(&backend), "n1", "vol2").is_empty());

    // A new, empty etcd on the same URL would look free: the node refuses it, keeps its mount.
    let mounted_before = in_node(&n1, "cat /proc/self/mountinfo");
    assert!(mounted_before.contains("/vol1/"));
    n1.kill9();
    drop(etcd);
    let fresh = EtcdCluster::start(1);
    n1.extra = n1
        .extra
        .iter()
        .map(|arg| {
            if arg.starts_with("http://") {
                fresh.endpoints_flag()
            } else {
                arg.clone()
            }
        })
        .collect();
    n1.start();
    refused(&n1, "another cluster").await;
    let (status, _) = api_error(n1.api().publish(&publish_request("vol3", "w1")).await);
    assert_eq!(status, 503);
    let volumes = n1.api().volumes().await.unwrap();
    assert!(
        volumes
            .volumes
            .iter()
            .any(|v| v.volume_id == "vol1" && !v.claims.is_empty())
    );
}

/// Arms `point` (the daemon exits there) for the next start of `daemon`, restarting it.
fn arm(daemon: &mut Daemon, point: &str) {
    daemon.stop_and_set_env("CSI_AGENT_FAILPOINTS", &format!("{point}=exit"));
    daemon.start();
}

/// Waits (20 s at most) until the daemon exited at its armed failpoint.
fn exited_at_failpoint(daemon: &mut Daemon) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while daemon.daemon_alive() {
        assert!(
            Instant::now() < deadline,
            "the daemon did not exit at its failpoint: {}",
            daemon.log_text()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn disarm(daemon: &mut Daemon) {
    exited_at_failpoint(daemon);
    daemon.wait_exit();
    daemon.set_env("CSI_AGENT_FAILPOINTS", None);
    daemon.start();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_daemon_killed_at_each_cluster_failpoint_converges() {
    let (tmp, backend) = scratch();
    let etcd = EtcdCluster::start(1);
    let client = etcd_client(etcd.client_urls()).await;
    let mut n1 = start_node(tmp.path(), "n1", &etcd.endpoints_flag(), &backend);
    let mut n2 = start_node(tmp.path(), "n2", &etcd.endpoints_flag(), &backend);
    joined(&n1).await;
    joined(&n2).await;
    let judge = BackendJudge::new(&backend);

    // A publish killed around its claim: what it left in etcd goes (an orphan is swept at
    // the next join), and the volume is free for another node.
    for point in ["cluster.claim.before_txn", "cluster.claim.after_txn"] {
        arm(&mut n1, point);
        joined(&n1).await;
        let lost = n1.api().publish(&publish_request("vol1", "w1")).await;
        assert!(lost.is_err(), "{point}: {lost:?}");
        disarm(&mut n1);
        joined(&n1).await;
        no_entries_left(&client, point).await;
        n2.api()
            .publish(&publish_request("vol1", "w2"))
            .await
            .unwrap();
        n2.api()
            .unpublish(&unpublish_request("vol1", "w2"))
            .await
            .unwrap();
    }

    // An unpublish killed around its release: the reconciler finishes it.
    for point in ["cluster.release.before_txn", "cluster.release.after_txn"] {
        n1.api()
            .publish(&publish_request("vol1", "w1"))
            .await
            .unwrap();
        arm(&mut n1, point);
        let lost = n1.api().unpublish(&unpublish_request("vol1", "w1")).await;
        assert!(lost.is_err(), "{point}: {lost:?}: {}", n1.log_text());
        disarm(&mut n1);
        no_entries_left(&client, point).await;
        n2.api()
            .publish(&publish_request("vol1", "w2"))
            .await
            .unwrap();
        n2.api()
            .unpublish(&unpublish_request("vol1", "w2"))
            .await
            .unwrap();
    }

    // A fence killed on the fencing daemon: its next sweep finishes it.
    for point in ["cluster.fence.after_mark", "cluster.fence.after_rpc"] {
        n1.api()
            .publish(&publish_request("vol1", "w1"))
            .await
            .unwrap();
        n1.kill9();
        arm(&mut n2, point);
        joined(&n2).await;
        lease_gone(&client, "n1").await;
        let lost = n2.api().fence("n1", "powered off").await;
        assert!(
            matches!(lost, Err(csi_agent_api::ApiError::Transport { .. })),
            "{point}: the daemon answered {lost:?}"
        );
        disarm(&mut n2);
        joined(&n2).await;
        no_entries_left(&client, point).await;
        assert!(
            judge.attachments().get("vol1").is_none_or(Vec::is_empty),
            "{point}"
        );
        n2.api()
            .publish(&publish_request("vol1", "w2"))
            .await
            .unwrap();
        n2.api()
            .unpublish(&unpublish_request("vol1", "w2"))
            .await
            .unwrap();
        // n1 back: it finds its fence, releases its side, joins again.
        n1.start();
        joined(&n1).await;
    }
    judge.assert_no_double_attach();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_controller_publish_gives_the_claim_back() {
    let (tmp, backend) = scratch();
    let etcd = EtcdCluster::start(1);
    let client = etcd_client(etcd.client_urls()).await;
    let n1 = start_node(tmp.path(), "n1", &etcd.endpoints_flag(), &backend);
    let n2 = start_node(tmp.path(), "n2", &etcd.endpoints_flag(), &backend);
    joined(&n1).await;
    joined(&n2).await;
    let faults = serde_json::to_vec(&json!({"rules": [{
        "method": "ControllerPublishVolume",
        "fail": {"code": "FAILED_PRECONDITION", "message": "the array is read-only today"},
        "times": 1
    }]}))
    .unwrap();
    let plugin_dir = tmp.path().join("n1/plugin");
    std::fs::create_dir_all(&plugin_dir).unwrap();
    std::fs::write(plugin_dir.join("faults.json"), faults).unwrap();

    let (status, body) = api_error(n1.api().publish(&publish_request("vol1", "w1")).await);
    assert_eq!(status, 422, "{body:?}");
    assert!(body.message.contains("read-only today"), "{}", body.message);
    // The claim is given back (after the idempotent ControllerUnpublish): the volume is free.
    no_entries_left(&client, "the failed publish's claim to be given back").await;
    n2.api()
        .publish(&publish_request("vol1", "w2"))
        .await
        .unwrap();
    BackendJudge::new(&backend).assert_no_double_attach();
}

/// The DeleteVolume calls of `volume` the shared backend answered.
fn deletes(judge: &BackendJudge, volume: &str) -> Vec<(String, String)> {
    judge
        .calls()
        .into_iter()
        .filter(|c| c.rpc == "DeleteVolume" && c.volume.as_deref() == Some(volume))
        .map(|c| (c.node, c.outcome))
        .collect()
}

/// A node's records know nothing of the other nodes: a DeleteVolume of a volume held on
/// another node is refused before the RPC, naming the holder, and while a node deletes a
/// volume (here: one that died during its DeleteVolume, its mark left) no node claims it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_volume_held_on_another_node_is_not_deleted_and_a_deletion_keeps_claims_out() {
    let (tmp, backend) = scratch();
    let etcd = EtcdCluster::start(1);
    let (n1, n2) = leader_and_follower(tmp.path(), &etcd.endpoints_flag(), &backend).await;
    let judge = BackendJudge::new(&backend);
    let client = etcd_client(etcd.client_urls()).await;

    n1.api()
        .publish(&publish_request("vol1", "w1"))
        .await
        .unwrap();
    let (status, body) = api_error(n2.api().delete_volume(PLUGIN, "vol1").await);
    assert_eq!(status, 409, "{body:?}");
    assert!(
        body.message.contains("held by node n1 (ATTACHED)"),
        "{}",
        body.message
    );
    assert!(deletes(&judge, "vol1").is_empty(), "{:?}", judge.calls());
    n1.api()
        .unpublish(&unpublish_request("vol1", "w1"))
        .await
        .unwrap();

    // n2 died during its DeleteVolume: its mark is left (the key as the daemon writes it).
    let mark = format!(
        "/csi-agent/{CLUSTER}/v1/deleting/{}/default/vol1",
        csi_agent::layout::encode_id(PLUGIN)
    );
    client
        .put(
            mark.as_bytes(),
            json!({"schema": 1, "node": "n2", "since": 0})
                .to_string()
                .as_bytes(),
            None,
        )
        .await
        .unwrap();
    let publishes = senders(&judge, "ControllerPublishVolume", "n1").len();
    let (status, body) = api_error(n1.api().publish(&publish_request("vol1", "w2")).await);
    assert_eq!(status, 409, "{body:?}");
    assert!(
        body.message.contains("being deleted by node n2"),
        "{}",
        body.message
    );
    assert!(etcd_entries(&client).await.is_empty(), "a claim was taken");
    assert_eq!(
        senders(&judge, "ControllerPublishVolume", "n1").len(),
        publishes
    );
    // Nor deleted elsewhere meanwhile.
    let (status, body) = api_error(n1.api().delete_volume(PLUGIN, "vol1").await);
    assert_eq!(status, 409, "{body:?}");
    assert!(deletes(&judge, "vol1").is_empty());

    // n2 deletes it again: its own mark is taken over, the RPC sent, the mark removed.
    n2.api().delete_volume(PLUGIN, "vol1").await.unwrap();
    assert_eq!(
        deletes(&judge, "vol1"),
        [("n2".to_owned(), "OK".to_owned())]
    );
    assert!(client.get(mark.as_bytes()).await.unwrap().kvs.is_empty());
    // A volume deleted and free again: another one is published as usual.
    n1.api()
        .publish(&publish_request("vol2", "w3"))
        .await
        .unwrap();
    judge.assert_no_double_attach();
}

/// A plugin's controller deployed on some nodes only: a node whose instance serves only the
/// Node service still gets ControllerPublish before its NodeStage (the backend refuses a
/// NodeStage on a node the volume is not published to), asked of the leader, and
/// ControllerUnpublish after its NodeUnstage.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_without_the_controller_service_asks_the_leader_for_its_controller_steps() {
    let (tmp, backend) = scratch();
    let etcd = EtcdCluster::start(1);
    let n1 = start_node(tmp.path(), "n1", &etcd.endpoints_flag(), &backend);
    joined(&n1).await;
    leads(&n1).await;
    let n2 = node_only(tmp.path(), "n2", &etcd.endpoints_flag(), &backend);
    joined(&n2).await;
    let judge = BackendJudge::new(&backend);

    let published = n2
        .api()
        .publish(&publish_request("vol1", "w1"))
        .await
        .unwrap();
    in_node(&n2, &format!("echo hi > {}/data", published.target_path));
    assert_eq!(senders(&judge, "ControllerPublishVolume", "n2"), ["n1"]);
    assert_eq!(judge.attachments()["vol1"], ["n2"]);
    n2.api()
        .unpublish(&unpublish_request("vol1", "w1"))
        .await
        .unwrap();
    assert_eq!(senders(&judge, "ControllerUnpublishVolume", "n2"), ["n1"]);
    let n2_rpcs = rpcs(&judge, "n2", "vol1");
    assert_eq!(
        n2_rpcs,
        [
            "ControllerPublishVolume",
            "NodeStageVolume",
            "NodePublishVolume",
            "NodeUnpublishVolume",
            "NodeUnstageVolume",
            "ControllerUnpublishVolume"
        ],
        "{n2_rpcs:?}"
    );
    // n2's own instance never stood for the leadership, and never sent a controller RPC.
    assert!(
        judge
            .calls()
            .iter()
            .all(|c| !(c.node == "n2" && c.rpc.starts_with("Controller"))),
        "{:?}",
        judge.calls()
    );
    judge.assert_no_double_attach();
}
