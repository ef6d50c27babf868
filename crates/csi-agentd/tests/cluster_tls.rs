//! Cluster mode over TLS to etcd (issue 28, docs/cluster.md "Turning it on"): a real etcd 3.4
//! member serving clients over TLS only and asking for a client certificate
//! (`EtcdCluster::start_tls`), a real csi-agentd joining it with `--cluster-etcd-ca`,
//! `--cluster-etcd-cert` and `--cluster-etcd-key`, and the daemon's refusals of incomplete
//! TLS flags before it serves.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod cluster_support;

use std::path::Path;
use std::time::Duration;

use csi_agent_testkit::backend::BackendJudge;
use csi_agent_testkit::daemon::Daemon;
use csi_agent_testkit::etcd::EtcdCluster;
use csi_agent_testkit::{publish_request, unpublish_request};

use cluster_support::*;

fn path(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// A TLS client of the test's own, with the harness's client certificate.
async fn tls_client(etcd: &EtcdCluster) -> csi_etcd::Client {
    let files = etcd.tls().unwrap();
    csi_etcd::Client::connect(csi_etcd::ConnectOptions {
        endpoints: etcd.client_urls(),
        request_timeout: Duration::from_secs(2),
        connect_timeout: Duration::from_secs(1),
        user: None,
        tls: Some(csi_etcd::TlsOptions {
            ca_pem: std::fs::read(&files.ca).unwrap(),
            identity: Some((
                std::fs::read(&files.client_cert).unwrap(),
                std::fs::read(&files.client_key).unwrap(),
            )),
        }),
    })
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_tls_with_a_client_certificate_a_node_joins_and_publishes_and_unpublishes() {
    let (tmp, backend) = scratch();
    let etcd = EtcdCluster::start_tls();
    let files = etcd.tls().unwrap().clone();
    let endpoints = etcd.endpoints_flag();
    assert!(endpoints.starts_with("https://"), "{endpoints}");
    let n1 = node_with(
        tmp.path(),
        "n1",
        &endpoints,
        &backend,
        &[
            "--cluster-etcd-ca",
            path(&files.ca),
            "--cluster-etcd-cert",
            path(&files.client_cert),
            "--cluster-etcd-key",
            path(&files.client_key),
        ],
    );
    joined(&n1).await;
    leads(&n1).await;
    let judge = BackendJudge::new(&backend);
    let client = tls_client(&etcd).await;

    n1.api()
        .publish(&publish_request("vol1", "w1"))
        .await
        .unwrap();
    assert_eq!(
        etcd_entries(&client).await,
        [("vol1".to_owned(), "n1".to_owned(), "ATTACHED".to_owned())]
    );
    assert_eq!(rpcs(&judge, "n1", "vol1")[0], "ControllerPublishVolume");
    n1.api()
        .unpublish(&unpublish_request("vol1", "w1"))
        .await
        .unwrap();
    assert!(etcd_entries(&client).await.is_empty());
    assert_eq!(
        rpcs(&judge, "n1", "vol1").last().map(String::as_str),
        Some("ControllerUnpublishVolume")
    );
    judge.assert_no_double_attach();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_its_client_certificate_a_node_does_not_join_and_says_why() {
    let (tmp, backend) = scratch();
    let etcd = EtcdCluster::start_tls();
    let files = etcd.tls().unwrap().clone();
    let n1 = node_with(
        tmp.path(),
        "n1",
        &etcd.endpoints_flag(),
        &backend,
        &["--cluster-etcd-ca", path(&files.ca)],
    );
    // The daemon serves (etcd may come later) but cannot join; its session says what TLS
    // lacks (GET /v1/cluster, `csictl cluster`).
    session_until(
        &n1,
        "the session to name the missing client certificate",
        Duration::from_secs(15),
        |s| {
            s["state"] == "JOINING"
                && s["reason"].as_str().is_some_and(|r| {
                    r.contains("--cluster-etcd-cert") && r.contains("client certificate")
                })
        },
    )
    .await;
}

/// Runs a daemon with `flags` (beside `--cluster-etcd`), expecting it to exit before serving
/// with a message containing each of `words`.
fn refused_start(dir: &Path, flags: &[&str], words: &[&str]) {
    let daemon = Daemon::builder(dir).flags(flags).build();
    let out = daemon.command().output().unwrap();
    let log = daemon.full_log();
    assert!(!out.status.success(), "{flags:?} started: {log}");
    for word in words {
        assert!(log.contains(word), "{flags:?}: {word:?} not in: {log}");
    }
    assert!(
        !daemon.dir().join("work/api.sock").exists(),
        "{flags:?}: it served"
    );
}

#[test]
fn incomplete_tls_flags_stop_the_daemon_before_it_serves_naming_the_flag() {
    let tmp = tempfile::tempdir().unwrap();
    let files = csi_agent_testkit::etcd::EtcdTls::generate(&tmp.path().join("tls"));
    let https = "https://127.0.0.1:1";
    refused_start(
        &tmp.path().join("a"),
        &[
            "--cluster-etcd",
            https,
            "--cluster-etcd-ca",
            path(&files.ca),
            "--cluster-etcd-cert",
            path(&files.client_cert),
        ],
        &[
            "--cluster-etcd-cert",
            path(&files.client_cert),
            "without --cluster-etcd-key",
        ],
    );
    refused_start(
        &tmp.path().join("b"),
        &["--cluster-etcd", https],
        &["--cluster-etcd-ca FILE", https],
    );
    refused_start(
        &tmp.path().join("c"),
        &[
            "--cluster-etcd",
            "http://127.0.0.1:1",
            "--cluster-etcd-ca",
            path(&files.ca),
        ],
        &["--cluster-etcd-ca", "plain http://"],
    );
    let missing = tmp.path().join("no-such-ca.pem");
    refused_start(
        &tmp.path().join("d"),
        &["--cluster-etcd", https, "--cluster-etcd-ca", path(&missing)],
        &["--cluster-etcd-ca", path(&missing)],
    );
    let garbage = tmp.path().join("garbage.pem");
    std::fs::write(&garbage, "not a certificate\n").unwrap();
    refused_start(
        &tmp.path().join("e"),
        &["--cluster-etcd", https, "--cluster-etcd-ca", path(&garbage)],
        &["--cluster-etcd-ca", path(&garbage), "no PEM certificate"],
    );
    let big = tmp.path().join("big.pem");
    std::fs::write(&big, vec![b'a'; 2 * 1024 * 1024]).unwrap();
    refused_start(
        &tmp.path().join("f"),
        &[
            "--cluster-etcd",
            https,
            "--cluster-etcd-ca",
            path(&files.ca),
            "--cluster-etcd-cert",
            path(&files.client_cert),
            "--cluster-etcd-key",
            path(&big),
        ],
        &["--cluster-etcd-key", path(&big), "larger than"],
    );
}
