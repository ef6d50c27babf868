//! `csi-etcd` against real etcd 3.4 members started by the testkit harness: KV and Txn
//! semantics, leases, failover between members and loss of quorum, a blackholed member, and
//! Status/MemberList.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::{Duration, Instant};

use csi_agent_testkit::etcd::{EtcdCluster, EtcdProxy, ProxyMode};
use csi_etcd::{Client, Compare, CompareOp, ConnectOptions, TlsOptions, Txn, TxnOp, TxnResponse};

async fn client(endpoints: Vec<String>, request_timeout: Duration) -> Client {
    Client::connect(ConnectOptions {
        endpoints,
        request_timeout,
        connect_timeout: Duration::from_millis(500),
        user: None,
        tls: None,
    })
    .await
    .unwrap()
}

fn put(key: &[u8], value: &[u8]) -> TxnOp {
    TxnOp::Put {
        key: key.to_vec(),
        value: value.to_vec(),
        lease: None,
    }
}

/// A create-only transaction: put `key` if it does not exist, else read it.
fn create_only(key: &[u8], value: &[u8]) -> Txn {
    Txn::new()
        .when([Compare::CreateRevision(key.to_vec(), CompareOp::Equal, 0)])
        .and_then([put(key, value)])
        .or_else([TxnOp::Get { key: key.to_vec() }])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kv_round_trip_create_only_and_compare_and_swap() {
    let etcd = EtcdCluster::start(1);
    let c = client(etcd.client_urls(), Duration::from_secs(2)).await;

    let r1 = c.put(b"/t/a/1", b"one", None).await.unwrap();
    let r2 = c.put(b"/t/a/2", b"two", None).await.unwrap();
    c.put(b"/t/b", b"other", None).await.unwrap();
    assert!(r2 > r1, "revisions grow: {r1} then {r2}");

    let got = c.get(b"/t/a/1").await.unwrap();
    assert_eq!(got.kvs.len(), 1);
    assert_eq!(got.kvs[0].value, b"one");
    assert_eq!(got.kvs[0].create_revision, r1);
    assert_eq!(got.kvs[0].version, 1);
    assert!(got.revision >= r2 && got.cluster_id != 0);
    // `get` is exact: the prefix `/t/a` alone matches nothing.
    assert!(c.get(b"/t/a").await.unwrap().kvs.is_empty());

    let all = c.get_prefix(b"/t/a/", 0).await.unwrap();
    let keys: Vec<&[u8]> = all.kvs.iter().map(|kv| kv.key.as_slice()).collect();
    assert_eq!(
        keys,
        [b"/t/a/1".as_slice(), b"/t/a/2"],
        "prefix range excludes /t/b"
    );
    assert!(!all.more);
    let one = c.get_prefix(b"/t/a/", 1).await.unwrap();
    assert_eq!(one.kvs.len(), 1);
    assert!(one.more, "limit 1 of 2 says there is more");

    assert_eq!(c.delete(b"/t/a/1").await.unwrap(), 1);
    assert_eq!(
        c.delete(b"/t/a/1").await.unwrap(),
        0,
        "deleting twice deletes nothing"
    );
    assert!(c.get(b"/t/a/1").await.unwrap().kvs.is_empty());

    // Create-only: the first wins, the second sees the winner's value in its else branch.
    let first = c.txn(create_only(b"/t/claim", b"node-1")).await.unwrap();
    assert!(first.succeeded);
    assert_eq!(first.responses, [TxnResponse::Put]);
    let second = c.txn(create_only(b"/t/claim", b"node-2")).await.unwrap();
    assert!(
        !second.succeeded,
        "a second create of the same key must fail"
    );
    match &second.responses[..] {
        [TxnResponse::Get(kvs)] => assert_eq!(kvs[0].value, b"node-1"),
        other => panic!("else branch should be one Get, got {other:?}"),
    }
    assert_eq!(second.cluster_id, got.cluster_id);

    // CAS on mod_revision: fails once another writer changed the key.
    let seen = c.get(b"/t/claim").await.unwrap().kvs[0].mod_revision;
    c.put(b"/t/claim", b"node-3", None).await.unwrap();
    let cas = |rev| {
        Txn::new()
            .when([Compare::ModRevision(
                b"/t/claim".to_vec(),
                CompareOp::Equal,
                rev,
            )])
            .and_then([put(b"/t/claim", b"node-1-again")])
            .or_else([TxnOp::GetPrefix {
                prefix: b"/t/cl".to_vec(),
            }])
    };
    let stale = c.txn(cas(seen)).await.unwrap();
    assert!(!stale.succeeded, "CAS on a stale mod_revision must fail");
    match &stale.responses[..] {
        [TxnResponse::Get(kvs)] => assert_eq!(kvs[0].value, b"node-3"),
        other => panic!("else branch should be one Get, got {other:?}"),
    }
    let fresh = c.get(b"/t/claim").await.unwrap().kvs[0].mod_revision;
    assert!(c.txn(cas(fresh)).await.unwrap().succeeded);

    // Value and Version compares, and a Delete in a txn.
    let del = c
        .txn(
            Txn::new()
                .when([
                    Compare::Value(
                        b"/t/claim".to_vec(),
                        CompareOp::Equal,
                        b"node-1-again".to_vec(),
                    ),
                    Compare::Version(b"/t/claim".to_vec(), CompareOp::Greater, 1),
                ])
                .and_then([TxnOp::Delete {
                    key: b"/t/claim".to_vec(),
                }]),
        )
        .await
        .unwrap();
    assert!(del.succeeded);
    assert_eq!(del.responses, [TxnResponse::Delete { deleted: 1 }]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leased_key_lives_while_kept_alive_and_goes_when_the_lease_does() {
    let etcd = EtcdCluster::start(1);
    let c = client(etcd.client_urls(), Duration::from_secs(2)).await;

    let lease = c.lease_grant(2).await.unwrap();
    assert_eq!(lease.ttl, 2);
    c.put(b"/l/kept", b"v", Some(lease.id)).await.unwrap();
    assert_eq!(c.get(b"/l/kept").await.unwrap().kvs[0].lease, lease.id);

    // Kept alive for twice its TTL: still there.
    let kept_until = Instant::now() + Duration::from_secs(4);
    while Instant::now() < kept_until {
        let ttl = c.lease_keep_alive(lease.id).await.unwrap();
        assert!(ttl > 0, "a kept lease has TTL left, got {ttl}");
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    assert_eq!(
        c.get(b"/l/kept").await.unwrap().kvs.len(),
        1,
        "kept alive: still there"
    );

    // No more keepalives: gone after the TTL (etcd may add up to an election timeout).
    let stopped = Instant::now();
    while !c.get(b"/l/kept").await.unwrap().kvs.is_empty() {
        assert!(
            stopped.elapsed() < Duration::from_secs(5),
            "key still there {:?} after the last keepalive",
            stopped.elapsed()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let gone_after = stopped.elapsed();
    assert!(
        gone_after >= Duration::from_millis(1500),
        "expired too early: {gone_after:?}"
    );
    eprintln!("lease of 2 s expired {gone_after:?} after the last keepalive");
    assert!(
        c.lease_keep_alive(lease.id).await.unwrap() <= 0,
        "an expired lease is gone"
    );

    // Revoke: the key goes at once.
    let lease = c.lease_grant(60).await.unwrap();
    c.put(b"/l/revoked", b"v", Some(lease.id)).await.unwrap();
    c.lease_revoke(lease.id).await.unwrap();
    assert!(c.get(b"/l/revoked").await.unwrap().kvs.is_empty());
    assert!(c.lease_keep_alive(lease.id).await.unwrap() <= 0);
    // A put on a revoked lease is refused, not unavailable.
    let err = c.put(b"/l/x", b"v", Some(lease.id)).await.unwrap_err();
    assert!(!err.is_unavailable(), "{err}");
}

/// The index (in `urls`) of the member every member names as leader.
/// The next changes of `watch`, within 5 s.
async fn next(watch: &mut csi_etcd::Watch) -> Vec<csi_etcd::WatchEvent> {
    tokio::time::timeout(Duration::from_secs(5), watch.changes())
        .await
        .expect("a change within 5 s")
        .unwrap()
}

/// A watch sees the puts and deletes under its prefix (and nothing beside it), replays from a
/// past revision, and ends with an error, not a hang, when its member dies.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_watch_sees_changes_under_its_prefix_and_ends_when_its_member_dies() {
    use csi_etcd::WatchEvent;
    let mut etcd = EtcdCluster::start(1);
    let c = client(etcd.client_urls(), Duration::from_secs(2)).await;
    let before = c.put(b"/w/a", b"1", None).await.unwrap();

    let mut watch = c.watch(b"/w/", true, 0).await.unwrap();
    c.put(b"/x/beside", b"1", None).await.unwrap();
    let put = c.put(b"/w/b", b"2", None).await.unwrap();
    match next(&mut watch).await.as_slice() {
        [WatchEvent::Put(kv)] => {
            assert_eq!(
                (kv.key.as_slice(), kv.value.as_slice()),
                (&b"/w/b"[..], &b"2"[..])
            );
            assert_eq!(kv.mod_revision, put);
        }
        other => panic!("expected the put of /w/b alone: {other:?}"),
    }
    c.delete(b"/w/a").await.unwrap();
    assert!(
        matches!(next(&mut watch).await.as_slice(), [WatchEvent::Delete(kv)] if kv.key == b"/w/a"),
        "the delete of /w/a"
    );

    // From a past revision: the changes since then, in order (one key's watch).
    let mut replay = c.watch(b"/w/a", false, before).await.unwrap();
    let events = next(&mut replay).await;
    assert!(matches!(events.first(), Some(WatchEvent::Put(kv)) if kv.mod_revision == before));
    let all = if events.len() == 2 {
        events
    } else {
        [events, next(&mut replay).await].concat()
    };
    assert!(
        matches!(all.as_slice(), [WatchEvent::Put(_), WatchEvent::Delete(_)]),
        "{all:?}"
    );

    // Its member gone: the watch ends with an error (the caller reads and watches again).
    etcd.kill(0);
    let ended = tokio::time::timeout(Duration::from_secs(10), watch.changes())
        .await
        .expect("the watch ends within 10 s of its member's death");
    let err = ended.unwrap_err();
    assert!(
        err.is_unavailable() || matches!(err, csi_etcd::EtcdError::WatchEnded { .. }),
        "{err}"
    );
    // And no new watch opens while nobody answers.
    let err = c.watch(b"/w/", true, 0).await.unwrap_err();
    assert!(err.is_unavailable(), "{err}");
}

async fn leader_index(c: &Client, urls: &[String]) -> usize {
    let mut statuses = Vec::new();
    for url in urls {
        statuses.push(c.status(url).await.unwrap());
    }
    let leader = statuses[0].leader;
    assert!(statuses.iter().all(|s| s.leader == leader && leader != 0));
    statuses.iter().position(|s| s.member_id == leader).unwrap()
}

/// A create-only txn retried while etcd is unavailable, as a caller does; a retry that finds
/// the key already holding our value means the earlier, uncertain attempt committed.
async fn create_with_retries(c: &Client, key: &[u8], deadline: Instant) -> u32 {
    let mut retries = 0;
    loop {
        match c.txn(create_only(key, b"mine")).await {
            Ok(r) if r.succeeded => return retries,
            Ok(r) => {
                assert!(retries > 0, "first attempt lost to nobody: {r:?}");
                assert_eq!(
                    r.responses,
                    [TxnResponse::Get(c.get(key).await.unwrap().kvs)]
                );
                return retries;
            }
            Err(e) => {
                assert!(
                    e.is_unavailable(),
                    "only unavailability during an election: {e}"
                );
                assert!(Instant::now() < deadline, "no new leader in time: {e}");
                retries += 1;
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_members_survive_one_loss_and_report_unavailable_without_quorum() {
    let mut etcd = EtcdCluster::start(3);
    let urls = etcd.client_urls();
    let timeout = Duration::from_secs(2);
    let probe = client(urls.clone(), timeout).await;
    let leader = leader_index(&probe, &urls).await;
    // Calls start at the first endpoint: make it a follower that is about to die, so the
    // failover on a refused connection is what is tested (a leader's death is below).
    let follower = (leader + 1) % 3;
    let other = (leader + 2) % 3;
    let ordered = vec![
        urls[follower].clone(),
        urls[leader].clone(),
        urls[other].clone(),
    ];
    let c = client(ordered, timeout).await;
    assert!(
        c.txn(create_only(b"/q/warm", b"v"))
            .await
            .unwrap()
            .succeeded
    );

    etcd.kill(follower);
    let started = Instant::now();
    // A write already on the dying member's connection when it dies (the client had not yet
    // seen the connection close) comes back uncertain — it may have been applied — and is not
    // repeated by the client; the caller repeats it. The call after starts at the next member,
    // so at most one write of the twenty is uncertain.
    let mut uncertain = 0;
    for i in 0..20 {
        let key = format!("/q/k{i}");
        uncertain +=
            create_with_retries(&c, key.as_bytes(), started + Duration::from_secs(5)).await;
    }
    eprintln!(
        "20 txns with the first endpoint down: {:?}, {uncertain} uncertain",
        started.elapsed()
    );
    assert!(
        uncertain <= 1,
        "{uncertain} uncertain writes: the client stayed on the dead member"
    );
    assert_eq!(c.get_prefix(b"/q/k", 0).await.unwrap().kvs.len(), 20);

    // A second dies: no quorum. Calls fail in bounded time, as unavailable.
    etcd.kill(leader);
    for attempt in 0..3 {
        let t = Instant::now();
        let err = c.get(b"/q/k0").await.unwrap_err();
        let took = t.elapsed();
        assert!(err.is_unavailable(), "get without quorum: {err}");
        assert!(
            took <= timeout + Duration::from_millis(500),
            "get took {took:?}"
        );
        let t = Instant::now();
        let err = c.txn(create_only(b"/q/noquorum", b"v")).await.unwrap_err();
        let took_txn = t.elapsed();
        assert!(err.is_unavailable(), "txn without quorum: {err}");
        assert!(
            took_txn <= timeout + Duration::from_millis(500),
            "txn took {took_txn:?}"
        );
        eprintln!(
            "no quorum, attempt {attempt}: get failed in {took:?}, txn in {took_txn:?}: {err}"
        );
    }

    etcd.restart(follower);
    etcd.restart(leader);
    assert!(
        c.txn(create_only(b"/q/after", b"v"))
            .await
            .unwrap()
            .succeeded
    );
    assert_eq!(c.get_prefix(b"/q/k", 0).await.unwrap().kvs.len(), 20);
    assert!(
        c.get(b"/q/noquorum").await.unwrap().kvs.len() <= 1,
        "a timed-out write is uncertain, never doubled"
    );

    // The leader dies: writes in the election window fail as unavailable (never anything else)
    // and a caller retrying them is served by the new leader within a few election timeouts.
    let leader = leader_index(&c, &urls).await;
    etcd.kill(leader);
    let killed = Instant::now();
    let mut retries = 0;
    for i in 0..20 {
        let key = format!("/q/election{i}");
        retries += create_with_retries(&c, key.as_bytes(), killed + Duration::from_secs(10)).await;
    }
    eprintln!(
        "leader killed: 20 create-only txns done in {:?}, {retries} retries",
        killed.elapsed()
    );
    assert_eq!(c.get_prefix(b"/q/election", 0).await.unwrap().kvs.len(), 20);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_blackholed_member_fails_calls_in_time_and_is_used_again_after() {
    let etcd = EtcdCluster::start(1);
    let member = etcd.client_urls()[0].clone();
    let proxy = EtcdProxy::start(member.trim_start_matches("http://"));
    let timeout = Duration::from_secs(1);
    let c = client(vec![proxy.url()], timeout).await;
    c.put(b"/b/k", b"v", None).await.unwrap();

    proxy.set_mode(ProxyMode::Blackhole);
    for _ in 0..2 {
        let t = Instant::now();
        let err = c.get(b"/b/k").await.unwrap_err();
        assert!(err.is_unavailable(), "{err}");
        assert!(
            t.elapsed() <= timeout + Duration::from_millis(300),
            "took {:?}",
            t.elapsed()
        );
        let t = Instant::now();
        let err = c.put(b"/b/k", b"w", None).await.unwrap_err();
        assert!(err.is_unavailable(), "{err}");
        assert!(
            t.elapsed() <= timeout + Duration::from_millis(300),
            "took {:?}",
            t.elapsed()
        );
        eprintln!("blackholed: put failed in {:?}: {err}", t.elapsed());
    }

    proxy.set_mode(ProxyMode::Pass);
    assert_eq!(c.get(b"/b/k").await.unwrap().kvs.len(), 1);

    // Reset: refused at once, then usable again.
    proxy.set_mode(ProxyMode::Reset);
    let t = Instant::now();
    let err = c.get(b"/b/k").await.unwrap_err();
    assert!(err.is_unavailable(), "{err}");
    let err = c.put(b"/b/k", b"w", None).await.unwrap_err();
    assert!(err.is_unavailable(), "{err}");
    assert!(t.elapsed() <= timeout + Duration::from_millis(300));
    eprintln!("reset: get and put failed in {:?}: {err}", t.elapsed());
    proxy.set_mode(ProxyMode::Pass);
    assert_eq!(c.get(b"/b/k").await.unwrap().kvs.len(), 1);

    // A blackholed first endpoint does not stop a read the second one can serve.
    proxy.set_mode(ProxyMode::Blackhole);
    let both = client(vec![proxy.url(), member], Duration::from_secs(2)).await;
    let t = Instant::now();
    assert_eq!(both.get(b"/b/k").await.unwrap().kvs.len(), 1);
    assert!(t.elapsed() <= Duration::from_secs(2) + Duration::from_millis(300));
    eprintln!(
        "read failed over from a blackholed endpoint in {:?}",
        t.elapsed()
    );

    // A write that timed out may have been applied: it is reported as such and not sent to the
    // second endpoint (which would have applied it).
    let both = client(both.endpoints().to_vec(), Duration::from_secs(2)).await;
    let err = both.put(b"/b/once", b"v", None).await.unwrap_err();
    assert!(
        matches!(err, csi_etcd::EtcdError::Timeout { .. }),
        "a blackholed write times out: {err:?}"
    );
    // ... but the next write starts at the other member, so a writer is not stuck.
    both.put(b"/b/twice", b"v", None).await.unwrap();
    assert!(
        both.get(b"/b/once").await.unwrap().kvs.is_empty(),
        "not repeated elsewhere"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_and_member_list_describe_the_cluster() {
    let etcd = EtcdCluster::start(3);
    let urls = etcd.client_urls();
    let c = client(urls.clone(), Duration::from_secs(2)).await;
    let cluster_id = c.get(b"/s").await.unwrap().cluster_id;

    let members = c.member_list().await.unwrap();
    assert_eq!(members.len(), 3);
    let mut leaders = Vec::new();
    for url in &urls {
        let s = c.status(url).await.unwrap();
        assert!(s.version.starts_with("3.4."), "version {}", s.version);
        assert_eq!(s.cluster_id, cluster_id, "one cluster");
        assert!(s.db_size > 0 && s.raft_term > 0 && s.revision > 0);
        let me = members
            .iter()
            .find(|m| m.id == s.member_id)
            .expect("member in the list");
        assert_eq!(me.client_urls, std::slice::from_ref(url));
        assert!(!me.name.is_empty());
        leaders.push(s.leader);
    }
    assert!(
        leaders[0] != 0 && leaders.iter().all(|&l| l == leaders[0]),
        "one leader: {leaders:?}"
    );

    // A member that is down: its status is unavailable, in time.
    let mut etcd = etcd;
    etcd.kill(2);
    let t = Instant::now();
    let err = c.status(&urls[2]).await.unwrap_err();
    assert!(err.is_unavailable(), "{err}");
    assert!(
        err.to_string().contains(&urls[2]),
        "names the endpoint: {err}"
    );
    assert!(t.elapsed() <= Duration::from_millis(2300));
}

/// `etcdctl` (v3 API) against `endpoint`; panics with its output on failure.
fn etcdctl(endpoint: &str, args: &[&str]) {
    let out = std::process::Command::new("etcdctl")
        .env("ETCDCTL_API", "3")
        .arg("--endpoints")
        .arg(endpoint)
        .args(args)
        .output()
        .expect("etcdctl (package etcd-client) runs");
    assert!(out.status.success(), "etcdctl {args:?}: {out:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_auth_enabled_the_right_password_works_and_a_wrong_one_is_an_auth_error() {
    let etcd = EtcdCluster::start(1);
    let url = etcd.client_urls()[0].clone();
    etcdctl(&url, &["user", "add", "root:s3cret-pw"]);
    etcdctl(&url, &["user", "grant-role", "root", "root"]);
    etcdctl(&url, &["auth", "enable"]);

    let with = |user: Option<(&'static str, &'static str)>| {
        let url = url.clone();
        async move {
            Client::connect(ConnectOptions {
                endpoints: vec![url],
                request_timeout: Duration::from_secs(2),
                connect_timeout: Duration::from_millis(500),
                user: user.map(|(u, p)| (u.to_owned(), p.to_owned())),
                tls: None,
            })
            .await
            .unwrap()
        }
    };
    let good = with(Some(("root", "s3cret-pw"))).await;
    good.put(b"/a/k", b"v", None).await.unwrap();
    assert_eq!(good.get(b"/a/k").await.unwrap().kvs.len(), 1);
    let lease = good.lease_grant(5).await.unwrap();
    assert!(good.lease_keep_alive(lease.id).await.unwrap() > 0);
    good.member_list().await.unwrap();
    good.status(&url).await.unwrap();

    for (who, client) in [
        ("wrong password", with(Some(("root", "wrong"))).await),
        ("no user", with(None).await),
    ] {
        let err = client.get(b"/a/k").await.unwrap_err();
        assert!(
            matches!(err, csi_etcd::EtcdError::Auth { .. }),
            "{who}: {err:?}"
        );
        assert!(
            !err.is_unavailable(),
            "{who}: a refusal is not unavailability"
        );
        assert!(
            err.to_string().contains(&url),
            "{who}: names the endpoint: {err}"
        );
        let shown = format!("{err} {err:?}");
        assert!(
            !shown.contains("s3cret-pw"),
            "{who}: the password leaked: {shown}"
        );
    }
}

#[test]
fn dropping_the_cluster_kills_its_members_and_removes_their_data() {
    let etcd = EtcdCluster::start(1);
    let dir = etcd.dir().to_path_buf();
    let addr = etcd.client_urls()[0]
        .trim_start_matches("http://")
        .to_owned();
    assert!(
        dir.join("m0.etcd").is_dir(),
        "data dir under the cluster's dir"
    );
    assert!(
        std::net::TcpStream::connect(&addr).is_ok(),
        "member listens"
    );
    drop(etcd);
    assert!(!dir.exists(), "data removed: {}", dir.display());
    assert!(
        std::net::TcpStream::connect(&addr).is_err(),
        "member killed: nothing listens on {addr}"
    );
}

#[test]
fn a_missing_etcd_binary_says_what_to_install() {
    // The panic is checked in a child run of this very test (the environment of this process
    // is shared by the other tests and not ours to change).
    if std::env::var_os("CSI_ETCD_TEST_MISSING_CHILD").is_some() {
        EtcdCluster::start(1);
        return;
    }
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "a_missing_etcd_binary_says_what_to_install",
            "--nocapture",
        ])
        .env("CSI_ETCD_TEST_MISSING_CHILD", "1")
        .env("CSI_AGENT_ETCD_BIN", "/nonexistent/etcd")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "start without etcd must fail");
    assert!(
        stderr.contains("/nonexistent/etcd") && stderr.contains("apt-get install etcd-server"),
        "names the binary and the package: {stderr}"
    );
}

/// The error and every source under it, one line each: what an operator's log shows.
fn chain(err: &dyn std::error::Error) -> String {
    let mut text = err.to_string();
    let mut cause = err.source();
    while let Some(e) = cause {
        text.push_str(&format!("\n  caused by: {e}"));
        cause = e.source();
    }
    text
}

fn tls_options(
    ca: &std::path::Path,
    identity: Option<(&std::path::Path, &std::path::Path)>,
) -> TlsOptions {
    TlsOptions {
        ca_pem: std::fs::read(ca).unwrap(),
        identity: identity.map(|(c, k)| (std::fs::read(c).unwrap(), std::fs::read(k).unwrap())),
    }
}

async fn tls_client(
    endpoints: Vec<String>,
    tls: Option<TlsOptions>,
) -> Result<Client, csi_etcd::EtcdError> {
    Client::connect(ConnectOptions {
        endpoints,
        request_timeout: Duration::from_secs(2),
        connect_timeout: Duration::from_millis(500),
        user: None,
        tls,
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_tls_with_a_client_certificate_kv_and_txn_work() {
    let etcd = EtcdCluster::start_tls();
    let files = etcd.tls().unwrap().clone();
    let urls = etcd.client_urls();
    assert!(urls[0].starts_with("https://127.0.0.1:"), "{urls:?}");
    let client = tls_client(
        urls.clone(),
        Some(tls_options(
            &files.ca,
            Some((&files.client_cert, &files.client_key)),
        )),
    )
    .await
    .unwrap();
    client.put(b"/tls/a", b"1", None).await.unwrap();
    let read = client.get(b"/tls/a").await.unwrap();
    assert_eq!(read.kvs.len(), 1);
    assert_eq!(read.kvs[0].value, b"1");
    let created = client.txn(create_only(b"/tls/b", b"2")).await.unwrap();
    assert!(created.succeeded);
    let again = client.txn(create_only(b"/tls/b", b"3")).await.unwrap();
    assert!(!again.succeeded);
    let status = client.status(&urls[0]).await.unwrap();
    assert!(status.version.starts_with("3."), "{status:?}");
    let lease = client.lease_grant(5).await.unwrap();
    assert!(client.lease_keep_alive(lease.id).await.unwrap() > 0);
    // A localhost name is checked against the certificate's DNS SAN.
    let port = urls[0].rsplit(':').next().unwrap();
    let by_name = tls_client(
        vec![format!("https://localhost:{port}")],
        Some(tls_options(
            &files.ca,
            Some((&files.client_cert, &files.client_key)),
        )),
    )
    .await
    .unwrap();
    assert_eq!(by_name.get(b"/tls/a").await.unwrap().kvs.len(), 1);
    // Debug shows whether a CA and identity are set, never the PEM.
    let debug = format!(
        "{:?}",
        tls_options(&files.ca, Some((&files.client_cert, &files.client_key)))
    );
    assert!(!debug.contains("BEGIN"), "{debug}");
    assert!(debug.contains("identity: true"), "{debug}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_tls_a_missing_client_certificate_or_a_wrong_ca_is_refused_in_time_naming_tls() {
    let etcd = EtcdCluster::start_tls();
    let files = etcd.tls().unwrap().clone();
    let urls = etcd.client_urls();
    let (other_ca, _) = csi_agent_testkit::etcd::generate_ca(&etcd.dir().join("other"), "other-ca");
    for (what, tls, words) in [
        (
            "no client certificate",
            tls_options(&files.ca, None),
            &["certificate", "--cluster-etcd-cert"][..],
        ),
        (
            "a wrong CA",
            tls_options(&other_ca, Some((&files.client_cert, &files.client_key))),
            &["certificate", "UnknownIssuer", "--cluster-etcd-ca"][..],
        ),
    ] {
        let client = tls_client(urls.clone(), Some(tls)).await.unwrap();
        for round in 0..2 {
            let started = Instant::now();
            let err = client.get(b"/tls/a").await.unwrap_err();
            let took = started.elapsed();
            let text = chain(&err);
            eprintln!("{what} (round {round}): {err:?}\n{text}");
            assert!(
                took < Duration::from_secs(3),
                "{what}: took {took:?}: {text}"
            );
            for word in words {
                assert!(text.contains(word), "{what}: {word:?} not in: {text}");
            }
            let err = client.put(b"/tls/a", b"x", None).await.unwrap_err();
            assert!(
                chain(&err).contains("certificate"),
                "{what}: {}",
                chain(&err)
            );
        }
    }
}

#[tokio::test]
async fn connect_refuses_https_without_tls_options_and_tls_options_with_http() {
    let dir = std::env::temp_dir().join(format!("csi-etcd-tls-{}", std::process::id()));
    let files = csi_agent_testkit::etcd::EtcdTls::generate(&dir);
    let err = tls_client(vec!["https://127.0.0.1:1".into()], None)
        .await
        .unwrap_err();
    assert!(
        matches!(err, csi_etcd::EtcdError::InvalidEndpoint { .. }),
        "{err:?}"
    );
    let text = err.to_string();
    assert!(
        text.contains("https://127.0.0.1:1") && text.contains("--cluster-etcd-ca"),
        "{text}"
    );

    let err = tls_client(
        vec!["http://127.0.0.1:1".into()],
        Some(tls_options(&files.ca, None)),
    )
    .await
    .unwrap_err();
    assert!(
        matches!(err, csi_etcd::EtcdError::InvalidEndpoint { .. }),
        "{err:?}"
    );
    let text = err.to_string();
    assert!(
        text.contains("http://127.0.0.1:1") && text.contains("https://"),
        "{text}"
    );

    // Not PEM at all: refused at connect, naming the TLS settings.
    let err = tls_client(
        vec!["https://127.0.0.1:1".into()],
        Some(TlsOptions {
            ca_pem: b"not a certificate".to_vec(),
            identity: None,
        }),
    )
    .await;
    let _ = std::fs::remove_dir_all(&dir);
    if let Err(err) = err {
        assert!(err.to_string().contains("--cluster-etcd-ca"), "{err}");
    }
}
