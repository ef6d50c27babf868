//! Cluster mode against forged keys (issue 28, docs/cluster.md "What etcd holds", "One
//! controller per plugin"): what a client with write access to etcd, or a buggy peer, can put
//! under `/csi-agent/<cluster>/v1/` — a leader key that is garbage, too large, or names a node
//! that does not lead; pending hints that name no work, another volume, or nothing readable,
//! by the hundred; hostile volume ids sent through a publish; a claim held by a node that does
//! not exist.
//!
//! Real etcd 3.4 and real csi-agentd daemons on the test plugin's shared backend, as in
//! `tests/cluster.rs`. What a forged key may never do is judged by the backend's own records
//! ([`BackendJudge`]: which instance sent which controller RPC for which node), never by
//! csi-agent's word: a forged key is never read as free, never as this node's leadership, and
//! never makes a leader send a controller RPC; the daemons keep answering, and real work goes
//! on once (or while) the forgery is there.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod cluster_support;

use std::collections::BTreeSet;
use std::process::Command;
use std::time::{Duration, Instant};

use csi_agent::layout::encode_id;
use csi_agent_api::ApiError;
use csi_agent_testkit::backend::BackendJudge;
use csi_agent_testkit::daemon::Daemon;
use csi_agent_testkit::etcd::EtcdCluster;
use csi_agent_testkit::{PLUGIN, api_error, eventually, publish_request};
use serde_json::{Value, json};

use cluster_support::*;

/// The cluster's key prefix.
fn prefix() -> String {
    format!("/csi-agent/{CLUSTER}/v1/")
}

/// The test plugin's leader key.
fn leader_key() -> String {
    format!("{}leaders/{}/default", prefix(), encode_id(PLUGIN))
}

/// The test plugin's pending prefix.
fn pending_prefix() -> String {
    format!("{}pending/{}/default/", prefix(), encode_id(PLUGIN))
}

/// The test plugin's volume prefix.
fn volume_prefix() -> String {
    format!("{}vol/{}/default/", prefix(), encode_id(PLUGIN))
}

/// A leader value as the daemons write it.
fn leader_value(node: &str, instance_id: &str, lease: i64) -> Vec<u8> {
    serde_json::to_vec(&json!({
        "schema": 1, "node": node, "instance_id": instance_id, "lease": lease, "since": 0
    }))
    .unwrap()
}

/// A pending hint as the daemons write it.
fn hint_value(volume: &str) -> Vec<u8> {
    serde_json::to_vec(&json!({"schema": 1, "volume_id": volume})).unwrap()
}

/// Every ControllerPublishVolume and ControllerUnpublishVolume the backend saw: (sender,
/// rpc, volume, target node, outcome).
fn controller_calls(judge: &BackendJudge) -> Vec<(String, String, String, String, String)> {
    judge
        .calls()
        .into_iter()
        .filter(|c| c.rpc.starts_with("Controller") && c.rpc.contains("ublish"))
        .map(|c| {
            (
                c.node,
                c.rpc,
                c.volume.unwrap_or_default(),
                c.target_node.unwrap_or_default(),
                c.outcome,
            )
        })
        .collect()
}

/// Whether `daemon` leads the test plugin's controller, by its `GET /v1/cluster`.
fn this_node_leads(status: &Value) -> bool {
    status["leaders"].as_array().is_some_and(|leaders| {
        leaders
            .iter()
            .any(|l| l["plugin"] == PLUGIN && l["this_node"] == true)
    })
}

/// `GET /v1/cluster` answers at once (within 500 ms), and `daemon` does not lead.
async fn answers_and_does_not_lead(daemon: &Daemon, who: &str) {
    let asked = Instant::now();
    let status = cluster_status(&daemon.api()).await.unwrap();
    assert!(
        asked.elapsed() < Duration::from_millis(500),
        "{who}: GET /v1/cluster took {:?}",
        asked.elapsed()
    );
    assert_eq!(status["state"], "HEALTHY", "{who}: {status}");
    assert!(!this_node_leads(&status), "{who} leads: {status}");
}

/// `daemon` shows no leader of the plugin (its leader key cannot be trusted), and its
/// status answers at once.
async fn shows_no_leader(daemon: &Daemon, who: &str) {
    answers_and_does_not_lead(daemon, who).await;
    // It reads the leader key once a second.
    let api = daemon.api();
    eventually(
        &format!("{who} to show no leader"),
        Duration::from_secs(5),
        || async {
            let status = cluster_status(&api).await?;
            let leaders = status["leaders"].as_array().cloned().unwrap_or_default();
            let none = leaders.iter().all(|l| l["plugin"] != PLUGIN);
            none.then_some(()).ok_or(format!("{leaders:?}"))
        },
    )
    .await;
}

/// The value and lease of `key` in etcd, if any.
async fn etcd_value(client: &csi_etcd::Client, key: &str) -> Option<(Vec<u8>, i64)> {
    let read = client.get(key.as_bytes()).await.unwrap();
    read.kvs.into_iter().next().map(|kv| (kv.value, kv.lease))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forged_leader_key_is_never_free_nor_this_nodes_leadership() {
    let (tmp, backend) = scratch();
    let etcd = EtcdCluster::start(1);
    let client = etcd_client(etcd.client_urls()).await;
    let judge = BackendJudge::new(&backend);
    let key = leader_key();

    // Garbage at the leader key, without a lease, before any daemon stands.
    let garbage: &[u8] = b"\xff\x00 not a leader {";
    client.put(key.as_bytes(), garbage, None).await.unwrap();
    let n1 = start_node(tmp.path(), "n1", &etcd.endpoints_flag(), &backend);
    let n2 = start_node(tmp.path(), "n2", &etcd.endpoints_flag(), &backend);
    joined(&n1).await;
    joined(&n2).await;
    // Both have read the key (a daemon reads it right after it joins, then every second).
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(
        etcd_value(&client, &key).await,
        Some((garbage.to_vec(), 0)),
        "a daemon took an unreadable leader key as free"
    );
    answers_and_does_not_lead(&n1, "n1").await;
    answers_and_does_not_lead(&n2, "n2").await;

    // A publish that needs ControllerPublish waits for a leader: it asks (its entry and a
    // pending hint) and nobody sends the RPC.
    let api = n1.api();
    let publish = tokio::spawn(async move { api.publish(&publish_request("vol1", "w1")).await });
    eventually(
        "n1's request for ControllerPublish in etcd",
        Duration::from_secs(10),
        || async {
            let entries = etcd_entries(&client).await;
            let asked = entries == [("vol1".to_owned(), "n1".to_owned(), "PUBLISHING".to_owned())];
            asked.then_some(()).ok_or(format!("{entries:?}"))
        },
    )
    .await;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert!(controller_calls(&judge).is_empty(), "{:?}", judge.calls());
    assert!(
        !publish.is_finished(),
        "the publish answered without a leader"
    );

    // A well-formed value naming a node that is no member, on no lease (a leader's key goes
    // with its lease, this one never would): nobody leads, nobody takes it.
    client
        .put(key.as_bytes(), &leader_value("ghost", "forged", 7), None)
        .await
        .unwrap();
    shows_no_leader(&n1, "n1").await;
    shows_no_leader(&n2, "n2").await;
    answers_and_does_not_lead(&n1, "n1").await;
    answers_and_does_not_lead(&n2, "n2").await;

    // n1's own name and instance id, with a lease that is not n1's: not n1's leadership.
    let status = cluster_status(&n1.api()).await.unwrap();
    let instance = status["instance_id"].as_str().unwrap().to_owned();
    let lease = status["lease_id"].as_i64().unwrap();
    client
        .put(
            key.as_bytes(),
            &leader_value("n1", &instance, lease + 1),
            None,
        )
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(1200)).await;
    shows_no_leader(&n1, "n1").await;
    answers_and_does_not_lead(&n1, "n1").await;
    answers_and_does_not_lead(&n2, "n2").await;

    // Over the size this build reads (a valid leader value, padded past 256 KiB).
    let huge = serde_json::to_vec(&json!({
        "schema": 1, "node": "n2", "instance_id": "forged", "lease": 7, "since": 0,
        "pad": "x".repeat(256 * 1024)
    }))
    .unwrap();
    assert!(huge.len() > 256 * 1024);
    client.put(key.as_bytes(), &huge, None).await.unwrap();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(
        etcd_value(&client, &key).await.map(|(v, l)| (v.len(), l)),
        Some((huge.len(), 0)),
        "a daemon took an oversized leader key as free"
    );
    answers_and_does_not_lead(&n1, "n1").await;
    answers_and_does_not_lead(&n2, "n2").await;
    eprintln!(
        "with an oversized leader key, n2 shows leaders {}",
        cluster_status(&n2.api()).await.unwrap()["leaders"]
    );
    assert!(controller_calls(&judge).is_empty(), "{:?}", judge.calls());
    assert!(
        !publish.is_finished(),
        "the publish answered without a leader"
    );
    assert!(n1.daemon_pid().is_some() && n2.daemon_pid().is_some());

    // The forgery deleted: a real daemon is elected (with its lease), serves the waiting
    // request, and the publish finishes, ControllerPublish sent by the leader's instance.
    client.delete(key.as_bytes()).await.unwrap();
    let deleted = Instant::now();
    let published = tokio::time::timeout(Duration::from_secs(15), publish)
        .await
        .expect("the publish still waits after the forged leader key was deleted")
        .unwrap()
        .unwrap();
    eprintln!(
        "publish finished {:?} after the forged leader key was deleted",
        deleted.elapsed()
    );
    let (value, lease) = etcd_value(&client, &key).await.expect("a leader key");
    assert_ne!(lease, 0, "the elected leader's key has no lease");
    let leader: Value = serde_json::from_slice(&value).unwrap();
    let leader = leader["node"].as_str().unwrap().to_owned();
    assert!(leader == "n1" || leader == "n2", "{leader}");
    assert_eq!(
        senders(&judge, "ControllerPublishVolume", "n1"),
        [leader.as_str()]
    );
    assert_eq!(judge.attachments()["vol1"], ["n1"]);
    in_node(&n1, &format!("echo hi > {}/data", published.target_path));
    assert_eq!(
        etcd_entries(&client).await,
        [("vol1".to_owned(), "n1".to_owned(), "ATTACHED".to_owned())]
    );

    // A live leader's key overwritten with garbage (a put without a lease takes the key off
    // the leader's lease): the leader stops leading, nobody takes the key, and a request
    // handed over meanwhile waits, with no RPC sent, until the key is deleted.
    client.put(key.as_bytes(), garbage, None).await.unwrap();
    let (leading, other) = if leader == "n1" {
        (&n1, &n2)
    } else {
        (&n2, &n1)
    };
    session_until(
        leading,
        "the leader to stop leading",
        Duration::from_secs(5),
        |s| !this_node_leads(s),
    )
    .await;
    let api = other.api();
    let publish = tokio::spawn(async move { api.publish(&publish_request("vol2", "w2")).await });
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert!(
        !publish.is_finished(),
        "the publish answered without a leader"
    );
    assert!(
        controller_calls(&judge).iter().all(|c| c.2 == "vol1"),
        "{:?}",
        controller_calls(&judge)
    );
    answers_and_does_not_lead(&n1, "n1").await;
    answers_and_does_not_lead(&n2, "n2").await;
    assert_eq!(etcd_value(&client, &key).await, Some((garbage.to_vec(), 0)));
    client.delete(key.as_bytes()).await.unwrap();
    tokio::time::timeout(Duration::from_secs(15), publish)
        .await
        .expect("the publish still waits after the garbage leader key was deleted")
        .unwrap()
        .unwrap();
    let target = if leader == "n1" { "n2" } else { "n1" };
    let sent = senders(&judge, "ControllerPublishVolume", target);
    assert_eq!(sent.len(), 1, "{sent:?}");
    assert_eq!(judge.attachments()["vol2"], [target]);
    judge.assert_no_double_attach();
}

/// Puts the forged hints of [`forged_pending_hints_send_no_rpc_and_real_work_goes_on`]: the
/// keys (unencoded volume part) of the hints that name no work but are readable, and of those
/// that are not to be trusted.
async fn forge_hints(client: &csi_etcd::Client, many: usize) -> (Vec<String>, Vec<String>) {
    let pending = pending_prefix();
    let mut readable = Vec::new();
    let mut untrusted = Vec::new();
    // A volume that has no claims key.
    client
        .put(
            format!("{pending}ghostvol").as_bytes(),
            &hint_value("ghostvol"),
            None,
        )
        .await
        .unwrap();
    readable.push("ghostvol".to_owned());
    // A value naming another volume than its key (one that exists on the backend).
    client
        .put(
            format!("{pending}vol2").as_bytes(),
            &hint_value("vol3"),
            None,
        )
        .await
        .unwrap();
    untrusted.push("vol2".to_owned());
    // Garbage bytes, another schema, a key of more than one segment.
    client
        .put(
            format!("{pending}garbage").as_bytes(),
            b"\xff\xfe\x00{{",
            None,
        )
        .await
        .unwrap();
    untrusted.push("garbage".to_owned());
    let schema2 = serde_json::to_vec(&json!({"schema": 2, "volume_id": "vol3"})).unwrap();
    client
        .put(format!("{pending}vol3").as_bytes(), &schema2, None)
        .await
        .unwrap();
    untrusted.push("vol3".to_owned());
    client
        .put(format!("{pending}a/b").as_bytes(), &hint_value("a/b"), None)
        .await
        .unwrap();
    untrusted.push("a/b".to_owned());
    // Many: a third well-formed for volumes nobody claims, a third naming vol1 (the volume a
    // real publish uses meanwhile) under other keys, a third garbage.
    for i in 0..many {
        let (name, value) = match i % 3 {
            0 => (format!("f{i:03}"), hint_value(&format!("f{i:03}"))),
            1 => (format!("m{i:03}"), hint_value("vol1")),
            _ => (format!("g{i:03}"), b"{\"schema\":1,\"volume_id\":".to_vec()),
        };
        client
            .put(format!("{pending}{name}").as_bytes(), &value, None)
            .await
            .unwrap();
        if i % 3 == 0 {
            readable.push(name);
        } else {
            untrusted.push(name);
        }
    }
    (readable, untrusted)
}

/// The hints under the test plugin's pending prefix, by the part of the key after it.
async fn hints(client: &csi_etcd::Client) -> BTreeSet<String> {
    let pending = pending_prefix();
    client
        .get_prefix(pending.as_bytes(), 0)
        .await
        .unwrap()
        .kvs
        .into_iter()
        .map(|kv| String::from_utf8_lossy(&kv.key[pending.len()..]).into_owned())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forged_pending_hints_send_no_rpc_and_real_work_goes_on() {
    let (tmp, backend) = scratch();
    let etcd = EtcdCluster::start(1);
    let client = etcd_client(etcd.client_urls()).await;
    let (mut n1, mut n2) = leader_and_follower(tmp.path(), &etcd.endpoints_flag(), &backend).await;
    let judge = BackendJudge::new(&backend);

    let (readable, untrusted) = forge_hints(&client, 300).await;
    // A few of the leader's rounds over them.
    tokio::time::sleep(Duration::from_millis(1000)).await;
    assert!(controller_calls(&judge).is_empty(), "{:?}", judge.calls());
    answers_and_does_not_lead(&n2, "n2").await;
    assert!(
        this_node_leads(&cluster_status(&n1.api()).await.unwrap()),
        "n1 stopped leading"
    );

    // A real publish on the node that does not lead, handed to the leader while the forged
    // hints are there.
    let asked = Instant::now();
    let published = n2
        .api()
        .with_timeout(Some(Duration::from_secs(20)))
        .publish(&publish_request("vol1", "w1"))
        .await
        .unwrap();
    let took = asked.elapsed();
    eprintln!(
        "publish handed to the leader took {took:?} with {} forged hints",
        readable.len() + untrusted.len()
    );
    assert!(took < Duration::from_secs(5), "{took:?}");
    in_node(&n2, &format!("echo hi > {}/data", published.target_path));
    assert_eq!(senders(&judge, "ControllerPublishVolume", "n2"), ["n1"]);

    // The hints that name a volume with nothing to do are deleted by the leader (as its own
    // are once served); the others stay, and are never work.
    eventually(
        "the readable hints to be cleared",
        Duration::from_secs(10),
        || async {
            let left = hints(&client).await;
            let want: BTreeSet<String> = untrusted.iter().cloned().collect();
            (left == want)
                .then_some(())
                .ok_or(format!("{} left, want {}", left.len(), want.len()))
        },
    )
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    // Every controller RPC the backend saw: the one for the real publish.
    assert_eq!(
        controller_calls(&judge),
        [(
            "n1".to_owned(),
            "ControllerPublishVolume".to_owned(),
            "vol1".to_owned(),
            "n2".to_owned(),
            "OK".to_owned()
        )]
    );
    assert!(!judge.attachments().contains_key("vol3"));
    assert_eq!(judge.attachments()["vol1"], ["n2"]);
    assert_eq!(
        etcd_entries(&client).await,
        [("vol1".to_owned(), "n2".to_owned(), "ATTACHED".to_owned())]
    );
    assert!(n1.daemon_alive() && n2.daemon_alive());
    answers_and_does_not_lead(&n2, "n2").await;
    // The untrusted hints stay, and the leader looks at them at every round: it warns of
    // each once, not at every round (which flooded the log with thousands of lines a second).
    let skipped = || {
        n1.log_text()
            .matches("unreadable pending hint skipped")
            .count()
    };
    let before = skipped();
    assert!(
        before <= untrusted.len(),
        "{before} warnings for {} hints",
        untrusted.len()
    );
    tokio::time::sleep(Duration::from_millis(2500)).await;
    assert_eq!(
        skipped(),
        before,
        "the leader warned again of the same hints"
    );
    judge.assert_no_double_attach();
}

/// One volume's unreadable claim key is that volume's problem ("A damaged key": refused,
/// listed under `damaged`), never every other node's: a hint for it, listed before a real
/// request, must not keep the leader from serving the real one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hint_for_a_damaged_claim_does_not_stop_the_leader_serving_others() {
    let (tmp, backend) = scratch();
    let etcd = EtcdCluster::start(1);
    let client = etcd_client(etcd.client_urls()).await;
    let (_n1, n2) = leader_and_follower(tmp.path(), &etcd.endpoints_flag(), &backend).await;
    let judge = BackendJudge::new(&backend);

    // A claim key nobody can read (as a newer schema, or a forgery, would be) and a hint for
    // it, listed before the real request.
    let damaged = format!("{}aaa", volume_prefix());
    client
        .put(damaged.as_bytes(), b"{not json", None)
        .await
        .unwrap();
    client
        .put(
            format!("{}aaa", pending_prefix()).as_bytes(),
            &hint_value("aaa"),
            None,
        )
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(500)).await;

    let asked = Instant::now();
    let published = n2
        .api()
        .with_timeout(Some(Duration::from_secs(10)))
        .publish(&publish_request("vol1", "w1"))
        .await;
    eprintln!(
        "publish handed to the leader answered after {:?}",
        asked.elapsed()
    );
    let published = published.expect(
        "a real publish handed to the leader while a hint names a damaged claim key: the leader \
         must serve it",
    );
    in_node(&n2, &format!("echo hi > {}/data", published.target_path));
    assert_eq!(senders(&judge, "ControllerPublishVolume", "n2"), ["n1"]);
    // Nothing sent for the damaged one; the key is left for the operator.
    assert!(
        controller_calls(&judge).iter().all(|c| c.2 == "vol1"),
        "{:?}",
        controller_calls(&judge)
    );
    assert_eq!(
        etcd_value(&client, &damaged).await.map(|(v, _)| v),
        Some(b"{not json".to_vec())
    );
}

/// Every key in etcd at each revision from `from` to `to`: what was ever there meanwhile,
/// also what was written and deleted again.
/// (csi-etcd reads no past revision: `etcdctl`, beside the etcd binary or on the `PATH`.)
fn keys_between(etcd_url: &str, from: i64, to: i64) -> BTreeSet<String> {
    let beside = csi_agent_testkit::etcd::etcd_binary().with_file_name("etcdctl");
    let etcdctl = if beside.is_file() {
        beside
    } else {
        "etcdctl".into()
    };
    let mut keys = BTreeSet::new();
    for rev in from..=to {
        let out = Command::new(&etcdctl)
            .env("ETCDCTL_API", "3")
            .args([
                "--endpoints",
                etcd_url,
                "get",
                "--prefix",
                "",
                "--keys-only",
                &format!("--rev={rev}"),
            ])
            .output()
            .expect("etcdctl (install etcd-client)");
        assert!(
            out.status.success(),
            "etcdctl: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        keys.extend(
            String::from_utf8_lossy(&out.stdout)
                .lines()
                .filter(|l| !l.is_empty())
                .map(str::to_owned),
        );
    }
    keys
}

async fn revision(client: &csi_etcd::Client) -> i64 {
    client.get(b"/").await.unwrap().revision
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_volume_ids_are_refused_or_one_key_segment_under_the_cluster_prefix() {
    let (tmp, backend) = scratch();
    let etcd = EtcdCluster::start(1);
    let url = etcd.client_urls()[0].clone();
    let client = etcd_client(etcd.client_urls()).await;
    let n1 = start_node(tmp.path(), "n1", &etcd.endpoints_flag(), &backend);
    joined(&n1).await;
    leads(&n1).await;
    let judge = BackendJudge::new(&backend);
    // A publish first, so that NodeGetInfo's presence refresh is behind us.
    n1.api()
        .publish(&publish_request("vol2", "w0"))
        .await
        .unwrap();
    let start = revision(&client).await;
    let before = keys_between(&url, start, start);

    // Empty, too long, too long once encoded: refused naming the field, before anything is
    // written to etcd.
    for bad in [String::new(), "x".repeat(1024), "%".repeat(128)] {
        let (status, body) = api_error(n1.api().publish(&publish_request(&bad, "w1")).await);
        assert_eq!(status, 400, "{} bytes: {body:?}", bad.len());
        assert!(body.message.contains("volume_id"), "{}", body.message);
    }
    let after_long = revision(&client).await;
    assert_eq!(
        keys_between(&url, start, after_long),
        before,
        "a refused id wrote to etcd"
    );

    // Accepted by design (every id is encoded into one key segment): the test plugin does
    // not know them, so each publish fails at ControllerPublish and gives its claim back.
    let ids = [
        "../../x",
        "a/b",
        "../../../members/n1",
        "nul\0id",
        "new\nline",
        "ünïcödé/∕",
        "..",
        "%2F",
        " ",
    ];
    let mut answers = Vec::new();
    for id in ids {
        let answer = n1.api().publish(&publish_request(id, "w1")).await;
        answers.push(format!("{id:?}: {answer:?}"));
        if let Err(ApiError::Api { status, .. }) = &answer {
            assert!(*status < 500, "{id:?}: {answer:?}");
        }
    }
    eprintln!("{}", answers.join("\n"));
    let end = revision(&client).await;
    let seen = keys_between(&url, after_long, end);
    let vol = volume_prefix();
    let pending = pending_prefix();
    let allowed: BTreeSet<String> = ids
        .iter()
        .flat_map(|id| {
            [
                format!("{vol}{}", encode_id(id)),
                format!("{pending}{}", encode_id(id)),
            ]
        })
        .collect();
    for key in &seen {
        assert!(
            key.starts_with(&prefix()),
            "a key outside the prefix: {key:?}"
        );
        if !before.contains(key) {
            assert!(allowed.contains(key), "an unexpected key: {key:?}");
        }
    }
    // Each id was claimed (one encoded segment under the plugin's volumes) and, its
    // ControllerPublish refused, given back.
    for id in ids {
        let claimed = format!("{vol}{}", encode_id(id));
        assert!(
            seen.contains(&claimed),
            "{id:?} never claimed as {claimed:?}"
        );
    }
    assert_eq!(
        etcd_entries(&client).await,
        [("vol2".to_owned(), "n1".to_owned(), "ATTACHED".to_owned())]
    );
    // Nothing else was touched: the nodes', members' and leaders' keys are as before.
    let now = keys_between(&url, end, end);
    let others = |keys: &BTreeSet<String>| -> BTreeSet<String> {
        keys.iter()
            .filter(|k| !k.starts_with(&vol) && !k.starts_with(&pending))
            .cloned()
            .collect()
    };
    assert_eq!(others(&now), others(&before));
    // The backend saw each id as sent, and attached none of them.
    for id in ids {
        assert!(!judge.attachments().contains_key(id), "{id:?}");
    }
    let sent: BTreeSet<String> = controller_calls(&judge).into_iter().map(|c| c.2).collect();
    for volume in &sent {
        assert!(
            volume == "vol2" || ids.contains(&volume.as_str()),
            "the plugin saw a volume id nobody sent: {volume:?}"
        );
    }
    // The daemon still serves a real publish.
    n1.api()
        .publish(&publish_request("vol1", "w1"))
        .await
        .unwrap();
    judge.assert_no_double_attach();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forged_claim_of_a_node_that_does_not_exist_holds_its_volume_as_suspect() {
    let (tmp, backend) = scratch();
    let etcd = EtcdCluster::start(1);
    let client = etcd_client(etcd.client_urls()).await;
    let n1 = start_node(tmp.path(), "n1", &etcd.endpoints_flag(), &backend);
    joined(&n1).await;
    leads(&n1).await;
    let judge = BackendJudge::new(&backend);
    // The shape of a real claim (vol2's), copied for the forgery.
    n1.api()
        .publish(&publish_request("vol2", "w0"))
        .await
        .unwrap();
    let real = etcd_value(&client, &format!("{}vol2", volume_prefix()))
        .await
        .unwrap()
        .0;
    let real: Value = serde_json::from_slice(&real).unwrap();
    let forged = json!({
        "schema": 1,
        "volume_id": "vol1",
        "capability": real["capability"],
        "nodes": {"ghost": {
            "claim_id": "forged", "csi_node_id": "ghost", "readonly": false,
            "state": "ATTACHED", "since": 0
        }}
    });
    let key = format!("{}vol1", volume_prefix());
    client
        .put(key.as_bytes(), &serde_json::to_vec(&forged).unwrap(), None)
        .await
        .unwrap();

    let refused = |round: &'static str| {
        let api = n1.api();
        let judge = judge.clone();
        async move {
            let (status, body) = api_error(api.publish(&publish_request("vol1", "w1")).await);
            assert_eq!(status, 409, "{round}: {body:?}");
            assert!(
                body.message.contains("node ghost") && body.message.contains("SUSPECT"),
                "{round}: {}",
                body.message
            );
            assert!(
                rpcs(&judge, "n1", "vol1").is_empty(),
                "{round}: {:?}",
                judge.calls_for_node("n1")
            );
        }
    };
    refused("at once").await;
    // Not freed on a timer: longer than a lease TTL later, still held.
    let ttl: u64 = LEASE_TTL_SECS.parse().unwrap();
    tokio::time::sleep(Duration::from_secs(ttl + 1)).await;
    refused("after a lease TTL").await;
    let claims = n1.api().cluster_claims(&Default::default()).await.unwrap();
    let ghost: Vec<_> = claims
        .claims
        .iter()
        .filter(|c| c.volume_id == "vol1")
        .collect();
    assert_eq!(ghost.len(), 1, "{claims:?}");
    assert!(
        ghost[0].node == "ghost" && ghost[0].state == "ATTACHED" && ghost[0].suspect,
        "{claims:?}"
    );
    assert!(!judge.attachments().contains_key("vol1"));
    assert_eq!(
        etcd_value(&client, &key).await.map(|(v, _)| v),
        Some(serde_json::to_vec(&forged).unwrap()),
        "the forged claim was changed"
    );
}
