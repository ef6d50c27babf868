//! `csi-etcd`: a thin etcd v3 client for csi-agent's cluster mode, generated at build time from
//! etcd's own `rpc.proto` with `protox` and `tonic-prost-build` (no `protoc` needed; the protos are
//! vendored unmodified in `proto/`, see `proto/README.md`).
//!
//! Owns: the wire calls below, the choice of member (failover between endpoints), the bound on
//! every call, and the mapping of gRPC and etcd errors to [`EtcdError`]. Must not: know what the
//! keys mean (claims, sessions and fencing live in the engine), retry on its own beyond trying the
//! next endpoint, or log a key's value, a password or TLS key material (values name volumes).
//!
//! # RPCs and fields used (checked against etcd 3.4.23)
//!
//! Every RPC and field below exists in etcd 3.4's `etcdserverpb/rpc.proto`, `mvccpb/kv.proto`
//! with the same number, type and label: checked against etcd 3.4.23 by the test
//! `tests/etcd34_protos.rs`, which decodes the file descriptors the installed `/usr/bin/etcd`
//! (Debian's 3.4.23) embeds and compares each one with the vendored protos; the other tests
//! exercise them against that binary. Fields newer than 3.4 (e.g.
//! `MemberListRequest.linearizable`, `StatusResponse.dbSizeQuota`, `RangeStream`) are never set
//! or read. Add a field here and to that test's list together.
//!
//! | service / RPC | request fields set | response fields read |
//! |---|---|---|
//! | `KV/Range` | `key`, `range_end`, `limit` | `header`, `kvs`, `more` |
//! | `KV/Put` | `key`, `value`, `lease` | `header.revision` |
//! | `KV/DeleteRange` | `key` | `deleted` |
//! | `KV/Txn` | `compare` (`result`, `target`, `key`, `version` / `create_revision` / `mod_revision` / `value`), `success`, `failure` (`RequestOp` `request_range` / `request_put` / `request_delete_range`) | `header`, `succeeded`, `responses` (`response_range.kvs`, `response_put`, `response_delete_range.deleted`) |
//! | `Lease/LeaseGrant` | `TTL` | `ID`, `TTL`, `error` |
//! | `Lease/LeaseKeepAlive` (one request on a short-lived stream) | `ID` | `TTL` |
//! | `Lease/LeaseRevoke` | `ID` | — |
//! | `Maintenance/Status` | — | `header` (`cluster_id`, `member_id`, `revision`), `version`, `dbSize`, `leader`, `raftTerm` |
//! | `Cluster/MemberList` | — | `members` (`ID`, `name`, `clientURLs`) |
//! | `Watch/Watch` (one watch per stream, kept open) | `create_request` (`key`, `range_end`, `start_revision`) | `created`, `canceled`, `compact_revision`, `cancel_reason`, `events` (`type`, `kv`) |
//! | `Auth/Authenticate` (only with [`ConnectOptions::user`]) | `name`, `password` | `token` |
//!
//! `ResponseHeader` fields read: `cluster_id`, `member_id`, `revision`, `raft_term`; `KeyValue`:
//! all six (`key`, `create_revision`, `mod_revision`, `version`, `value`, `lease`).
//!
//! # TLS
//!
//! `https://` endpoints need [`ConnectOptions::tls`] ([`TlsOptions`]: the CA PEM, trusted alone,
//! and optionally a client certificate and key for etcd's `--client-cert-auth`); `http://` ones
//! refuse it, so every endpoint of a client is one or the other. tonic's rustls (`tls-ring`)
//! carries the calls; the server certificate must name the URL's host (an IP address in its
//! IP SANs). The PEM is checked at [`Client::connect`]: unusable files are
//! [`EtcdError::InvalidEndpoint`], naming the daemon's flag to fix.
//!
//! | TLS failure | returned as |
//! |---|---|
//! | `https://` without `tls`, `tls` with `http://`, CA or identity PEM unusable | [`EtcdError::InvalidEndpoint`] at connect |
//! | server certificate not signed by the CA, not naming the host, expired | [`EtcdError::Tls`] (the rustls error under tonic's) |
//! | no client certificate where etcd asks for one, or one etcd does not trust | [`EtcdError::Tls`] (found by a probe: below) |
//!
//! With TLS 1.3, etcd judges the client certificate after the client's handshake is done: tonic
//! then reports only "connection closed". On such a transport failure of an `https://`
//! endpoint the client makes one more handshake with the same settings and reads etcd's alert
//! (the `tls` module), within the call's bound. [`EtcdError::Tls`] counts as unavailable
//! ([`EtcdError::is_unavailable`]): the call was not applied, and a caller retries as for a
//! member that is down, while the message says which file to fix.
//!
//! A watch ([`Client::watch`]) is opened like a read (failover until one member confirms
//! it); once open it stays on that member until it ends, and the caller opens another.
//!
//! # Endpoints, failover and bounds
//!
//! One lazy channel per endpoint. A call starts at the endpoint that answered last and, on an
//! error meaning "this member cannot answer now", tries the next one. Reads (`Range`, `Status`,
//! `MemberList`, `LeaseKeepAlive`) fail over on any such error; writes (`Put`, `DeleteRange`,
//! `Txn`, `LeaseGrant`, `LeaseRevoke`) only when the request certainly was not applied (the
//! connection could not be made, or the member said it has no leader), because a write that timed
//! out may still commit and repeating a compare-and-swap elsewhere would turn its success into a
//! failure. The whole call, failover included, is bounded by [`ConnectOptions::request_timeout`];
//! a read's attempt gets an even share of the time left among the endpoints not tried yet, a
//! write's all of it. A channel
//! that timed out or broke is replaced by a fresh one, so a stuck connection is not reused, and
//! a call that ends unavailable moves the next call's start to the next endpoint, so a caller
//! that only writes is not stuck on a dead member.
#![cfg_attr(test, allow(clippy::unwrap_used, clippy::expect_used))]

mod error;
// Generated code: keep future clippy/rustc lint additions from failing CI.
#[allow(
    missing_docs,
    missing_debug_implementations,
    dead_code,
    clippy::all,
    clippy::pedantic,
    clippy::nursery,
    clippy::unwrap_used,
    clippy::expect_used
)]
mod pb;
mod tls;
mod txn;
mod watch;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::time::Instant;
use tonic::metadata::MetadataValue;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint, Identity};

pub use error::EtcdError;
use pb::etcdserverpb as rpc;
use rpc::auth_client::AuthClient;
use rpc::cluster_client::ClusterClient;
use rpc::kv_client::KvClient;
use rpc::lease_client::LeaseClient;
use rpc::maintenance_client::MaintenanceClient;
pub use txn::{Compare, CompareOp, Txn, TxnOp, TxnResponse, TxnResult};
pub use watch::{Watch, WatchEvent};

/// The encoded `FileDescriptorSet` of the vendored protos this client is generated from: the
/// test `tests/etcd34_protos.rs` compares every field used with etcd 3.4's own.
#[doc(hidden)]
pub const FILE_DESCRIPTOR_SET: &[u8] =
    include_bytes!(concat!(env!("OUT_DIR"), "/etcd_file_descriptor_set.bin"));

/// How to reach etcd.
#[derive(Clone)]
pub struct ConnectOptions {
    /// Client URLs, e.g. `http://127.0.0.1:2379`; at least one.
    pub endpoints: Vec<String>,
    /// Bound of every call, failover to other endpoints included.
    pub request_timeout: Duration,
    /// Bound of one TCP connect.
    pub connect_timeout: Duration,
    /// User and password when etcd has auth enabled.
    pub user: Option<(String, String)>,
    /// TLS for `https://` endpoints (required for them, refused with `http://` ones).
    pub tls: Option<TlsOptions>,
}

/// TLS to etcd (`https://` endpoints): which CA to trust and, when etcd runs with
/// `--client-cert-auth`, the client's certificate.
#[derive(Clone)]
pub struct TlsOptions {
    /// PEM of the CA (one or more certificates) that signed etcd's server certificates: the only
    /// CA trusted (no system roots).
    pub ca_pem: Vec<u8>,
    /// The client's certificate chain and private key, both PEM, when etcd asks for one.
    pub identity: Option<(Vec<u8>, Vec<u8>)>,
}

impl TlsOptions {
    /// Checks the PEM as [`Client::connect`] will (a CA certificate at least; a certificate and
    /// a private key that fit together), so that a daemon refuses unusable files at start.
    /// The error names the daemon's flag to fix.
    pub fn check(&self) -> Result<(), String> {
        tls::probe_config(self).map(|_| ())
    }
}

impl std::fmt::Debug for TlsOptions {
    // Hand-written: key material must never reach a log.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TlsOptions")
            .field("ca", &!self.ca_pem.is_empty())
            .field("identity", &self.identity.is_some())
            .finish()
    }
}

impl std::fmt::Debug for ConnectOptions {
    // Hand-written: the password must never reach a log.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConnectOptions")
            .field("endpoints", &self.endpoints)
            .field("request_timeout", &self.request_timeout)
            .field("connect_timeout", &self.connect_timeout)
            .field("user", &self.user.as_ref().map(|(u, _)| (u, "<redacted>")))
            .field("tls", &self.tls)
            .finish()
    }
}

/// One key as etcd stores it.
#[derive(Clone, PartialEq, Eq)]
pub struct KeyValue {
    pub key: Vec<u8>,
    pub value: Vec<u8>,
    pub create_revision: i64,
    pub mod_revision: i64,
    pub version: i64,
    pub lease: i64,
}

impl std::fmt::Debug for KeyValue {
    // Values name volumes: show their size only.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KeyValue")
            .field("key", &String::from_utf8_lossy(&self.key))
            .field("value", &format_args!("<{} bytes>", self.value.len()))
            .field("create_revision", &self.create_revision)
            .field("mod_revision", &self.mod_revision)
            .field("version", &self.version)
            .field("lease", &self.lease)
            .finish()
    }
}

impl From<pb::mvccpb::KeyValue> for KeyValue {
    fn from(kv: pb::mvccpb::KeyValue) -> Self {
        KeyValue {
            key: kv.key,
            value: kv.value,
            create_revision: kv.create_revision,
            mod_revision: kv.mod_revision,
            version: kv.version,
            lease: kv.lease,
        }
    }
}

/// The answer to [`Client::get`] and [`Client::get_prefix`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GetResult {
    pub kvs: Vec<KeyValue>,
    /// The store's revision when the read was served (response header).
    pub revision: i64,
    pub cluster_id: u64,
    /// More keys matched than `limit` allowed.
    pub more: bool,
}

/// A granted lease.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Lease {
    pub id: i64,
    /// Seconds, as the server decided.
    pub ttl: i64,
}

/// One member's own view ([`Client::status`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EndpointStatus {
    pub endpoint: String,
    /// etcd's version, e.g. `3.4.23`.
    pub version: String,
    pub db_size: i64,
    /// Member id of the leader this member knows; 0 when it knows none.
    pub leader: u64,
    pub member_id: u64,
    pub raft_term: u64,
    pub cluster_id: u64,
    pub revision: i64,
}

/// A cluster member ([`Client::member_list`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Member {
    pub id: u64,
    /// Empty while the member has not started.
    pub name: String,
    pub client_urls: Vec<String>,
}

/// Whether a failed attempt may be repeated on another member.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// Repeating cannot change the outcome.
    Read,
    /// Repeat only if the first attempt certainly did not apply.
    Write,
}

/// A cheap-to-clone handle on the cluster (all clones share channels and the auth token).
#[derive(Clone)]
pub struct Client {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Client")
            .field("endpoints", &self.inner.endpoints)
            .finish_non_exhaustive()
    }
}

struct Inner {
    endpoints: Vec<String>,
    parsed: Vec<Endpoint>,
    /// One channel per endpoint, replaced after a timeout or a broken connection.
    channels: Vec<Mutex<Channel>>,
    /// The endpoint that answered last: calls start there.
    preferred: AtomicUsize,
    opts: ConnectOptions,
    /// The TLS diagnostic probe ([`ConnectOptions::tls`]) and each endpoint's host and port.
    probe: Option<tls::Probe>,
    hosts: Vec<(String, u16)>,
    /// The auth token, when [`ConnectOptions::user`] is set and a call has authenticated.
    token: tokio::sync::Mutex<Option<MetadataValue<tonic::metadata::Ascii>>>,
}

/// How one attempt ended, for the failover loop.
enum Attempt<T> {
    Done(Result<T, EtcdError>),
    /// Try the next endpoint; the error is the one to report if none answers.
    Next(EtcdError),
}

impl Client {
    /// Parses the endpoints and prepares one lazy channel each; nothing is dialled yet.
    pub async fn connect(opts: ConnectOptions) -> Result<Client, EtcdError> {
        if opts.endpoints.is_empty() {
            return Err(EtcdError::NoEndpoints);
        }
        let mut parsed = Vec::with_capacity(opts.endpoints.len());
        for endpoint in &opts.endpoints {
            parsed.push(endpoint_config(endpoint, &opts)?);
        }
        let probe = match &opts.tls {
            None => None,
            Some(tls) => {
                Some(
                    tls::probe_config(tls).map_err(|reason| EtcdError::InvalidEndpoint {
                        endpoint: opts.endpoints.join(","),
                        reason: reason.into(),
                    })?,
                )
            }
        };
        let hosts = parsed
            .iter()
            .map(|e| {
                let uri = e.uri();
                let host = uri.host().unwrap_or_default();
                let host = host
                    .trim_start_matches('[')
                    .trim_end_matches(']')
                    .to_owned();
                (host, uri.port_u16().unwrap_or(443))
            })
            .collect();
        let channels = parsed
            .iter()
            .map(|e| Mutex::new(e.connect_lazy()))
            .collect();
        Ok(Client {
            inner: Arc::new(Inner {
                endpoints: opts.endpoints.clone(),
                parsed,
                channels,
                preferred: AtomicUsize::new(0),
                probe,
                hosts,
                opts,
                token: tokio::sync::Mutex::new(None),
            }),
        })
    }

    /// The endpoints given to [`Client::connect`], in order.
    pub fn endpoints(&self) -> &[String] {
        &self.inner.endpoints
    }

    /// The value of exactly `key`, if any.
    pub async fn get(&self, key: &[u8]) -> Result<GetResult, EtcdError> {
        self.range("Range", key.to_vec(), Vec::new(), 0).await
    }

    /// Every key starting with `prefix`, at most `limit` (0: no limit), in key order.
    pub async fn get_prefix(&self, prefix: &[u8], limit: i64) -> Result<GetResult, EtcdError> {
        self.range("Range(prefix)", prefix.to_vec(), prefix_end(prefix), limit)
            .await
    }

    async fn range(
        &self,
        op: &'static str,
        key: Vec<u8>,
        range_end: Vec<u8>,
        limit: i64,
    ) -> Result<GetResult, EtcdError> {
        let req = rpc::RangeRequest {
            key,
            range_end,
            limit,
            ..Default::default()
        };
        let resp = self
            .call(op, Kind::Read, |ch, token| {
                let req = req.clone();
                async move { KvClient::new(ch).range(with_token(req, token)).await }
            })
            .await?;
        let (revision, cluster_id) = header(resp.header.as_ref());
        Ok(GetResult {
            kvs: resp.kvs.into_iter().map(KeyValue::from).collect(),
            revision,
            cluster_id,
            more: resp.more,
        })
    }

    /// Writes `key`; returns the store's revision after the write.
    pub async fn put(
        &self,
        key: &[u8],
        value: &[u8],
        lease: Option<i64>,
    ) -> Result<i64, EtcdError> {
        let req = pb::put_request(key.to_vec(), value.to_vec(), lease);
        let resp = self
            .call("Put", Kind::Write, |ch, token| {
                let req = req.clone();
                async move { KvClient::new(ch).put(with_token(req, token)).await }
            })
            .await?;
        Ok(header(resp.header.as_ref()).0)
    }

    /// Deletes exactly `key`; returns how many keys were deleted (0 or 1).
    pub async fn delete(&self, key: &[u8]) -> Result<i64, EtcdError> {
        let req = pb::delete_request(key.to_vec());
        let resp = self
            .call("DeleteRange", Kind::Write, |ch, token| {
                let req = req.clone();
                async move { KvClient::new(ch).delete_range(with_token(req, token)).await }
            })
            .await?;
        Ok(resp.deleted)
    }

    /// Runs a transaction: `when` all compares hold, `and_then`, else `or_else`.
    pub async fn txn(&self, txn: Txn) -> Result<TxnResult, EtcdError> {
        let req = txn.into_request();
        let resp = self
            .call("Txn", Kind::Write, |ch, token| {
                let req = req.clone();
                async move { KvClient::new(ch).txn(with_token(req, token)).await }
            })
            .await?;
        Ok(TxnResult::from_response(resp))
    }

    /// Grants a lease of `ttl_secs` seconds (the server may round it up).
    pub async fn lease_grant(&self, ttl_secs: i64) -> Result<Lease, EtcdError> {
        let req = rpc::LeaseGrantRequest {
            ttl: ttl_secs,
            id: 0,
        };
        let resp = self
            .call("LeaseGrant", Kind::Write, |ch, token| async move {
                LeaseClient::new(ch)
                    .lease_grant(with_token(req, token))
                    .await
            })
            .await?;
        if !resp.error.is_empty() {
            return Err(EtcdError::Refused {
                op: "LeaseGrant",
                message: resp.error,
            });
        }
        Ok(Lease {
            id: resp.id,
            ttl: resp.ttl,
        })
    }

    /// One keepalive round trip on a short-lived `LeaseKeepAlive` stream; returns the TTL left
    /// (seconds). `<= 0` means the lease is gone (expired or revoked).
    pub async fn lease_keep_alive(&self, id: i64) -> Result<i64, EtcdError> {
        let ttl = self
            .call("LeaseKeepAlive", Kind::Read, |ch, token| async move {
                let requests = tokio_stream::iter([rpc::LeaseKeepAliveRequest { id }]);
                let mut responses = LeaseClient::new(ch)
                    .lease_keep_alive(with_token(requests, token))
                    .await?
                    .into_inner();
                // The server answers each request before it reads the end of the stream.
                match responses.message().await? {
                    Some(resp) => Ok(tonic::Response::new(resp.ttl)),
                    None => Err(tonic::Status::unavailable(
                        "LeaseKeepAlive stream closed before its answer",
                    )),
                }
            })
            .await?;
        Ok(ttl)
    }

    /// Revokes a lease: every key attached to it is deleted at once.
    pub async fn lease_revoke(&self, id: i64) -> Result<(), EtcdError> {
        let req = rpc::LeaseRevokeRequest { id };
        self.call("LeaseRevoke", Kind::Write, |ch, token| async move {
            LeaseClient::new(ch)
                .lease_revoke(with_token(req, token))
                .await
        })
        .await?;
        Ok(())
    }

    /// The status of one member, asked of that member only (no failover): `endpoint` is one of
    /// [`Client::endpoints`] or any other client URL.
    pub async fn status(&self, endpoint: &str) -> Result<EndpointStatus, EtcdError> {
        let index = self.inner.endpoints.iter().position(|e| e == endpoint);
        let channel = match index {
            Some(i) => self.channel(i),
            None => endpoint_config(endpoint, &self.inner.opts)?.connect_lazy(),
        };
        let timeout = self.inner.opts.request_timeout;
        let attempt = async {
            let token = self.token(channel.clone(), endpoint).await?;
            MaintenanceClient::new(channel)
                .status(with_token(rpc::StatusRequest {}, token))
                .await
                .map(tonic::Response::into_inner)
                .map_err(|status| EtcdError::from_status("Status", endpoint, status))
        };
        let resp = match tokio::time::timeout(timeout, attempt).await {
            Ok(result) => result,
            Err(elapsed) => {
                if let Some(i) = index {
                    self.reset_channel(i);
                }
                Err(EtcdError::Timeout {
                    op: "Status",
                    endpoints: endpoint.to_owned(),
                    timeout,
                    source: elapsed,
                })
            }
        }?;
        let h = resp.header.unwrap_or_default();
        Ok(EndpointStatus {
            endpoint: endpoint.to_owned(),
            version: resp.version,
            db_size: resp.db_size,
            leader: resp.leader,
            member_id: h.member_id,
            raft_term: resp.raft_term,
            cluster_id: h.cluster_id,
            revision: h.revision,
        })
    }

    /// The cluster's members as the answering member knows them.
    pub async fn member_list(&self) -> Result<Vec<Member>, EtcdError> {
        let resp = self
            .call("MemberList", Kind::Read, |ch, token| async move {
                ClusterClient::new(ch)
                    .member_list(with_token(rpc::MemberListRequest::default(), token))
                    .await
            })
            .await?;
        Ok(resp
            .members
            .into_iter()
            .map(|m| Member {
                id: m.id,
                name: m.name,
                client_urls: m.client_ur_ls,
            })
            .collect())
    }

    fn channel(&self, i: usize) -> Channel {
        match self.inner.channels[i].lock() {
            Ok(guard) => guard.clone(),
            Err(poisoned) => poisoned.into_inner().clone(),
        }
    }

    /// A fresh lazy channel for endpoint `i`: the old connection may be stuck (blackholed).
    fn reset_channel(&self, i: usize) {
        let fresh = self.inner.parsed[i].connect_lazy();
        match self.inner.channels[i].lock() {
            Ok(mut guard) => *guard = fresh,
            Err(poisoned) => *poisoned.into_inner() = fresh,
        }
    }

    /// The auth token to send, authenticating through `channel` first if none is cached.
    async fn token(
        &self,
        channel: Channel,
        endpoint: &str,
    ) -> Result<Option<MetadataValue<tonic::metadata::Ascii>>, EtcdError> {
        let Some((user, password)) = &self.inner.opts.user else {
            return Ok(None);
        };
        let mut cached = self.inner.token.lock().await;
        if let Some(token) = cached.as_ref() {
            return Ok(Some(token.clone()));
        }
        let resp = AuthClient::new(channel)
            .authenticate(rpc::AuthenticateRequest {
                name: user.clone(),
                password: password.clone(),
            })
            .await
            .map_err(|status| EtcdError::from_status("Authenticate", endpoint, status))?
            .into_inner();
        let token =
            MetadataValue::try_from(resp.token.as_str()).map_err(|_| EtcdError::Refused {
                op: "Authenticate",
                message: "the token etcd returned is not valid ASCII metadata".to_owned(),
            })?;
        *cached = Some(token.clone());
        Ok(Some(token))
    }

    async fn forget_token(&self) {
        *self.inner.token.lock().await = None;
    }

    /// Maps a failed call's status; on an `https://` endpoint, a transport failure with a TLS
    /// cause (found under the status, or by a probe: see the `tls` module) becomes
    /// [`EtcdError::Tls`] saying what to fix.
    async fn status_error(
        &self,
        op: &'static str,
        i: usize,
        status: tonic::Status,
        probe_time: Duration,
    ) -> EtcdError {
        let endpoint = &self.inner.endpoints[i];
        let err = EtcdError::from_status(op, endpoint, status);
        let Some(probe) = &self.inner.probe else {
            return err;
        };
        if !err.is_transport() {
            return err;
        }
        let EtcdError::Unavailable { source, .. } = &err else {
            return err;
        };
        let reason = match tls::rustls_cause(probe, source) {
            Some(reason) => Some(reason),
            None => {
                let (host, port) = &self.inner.hosts[i];
                let bound = probe_time.min(self.inner.opts.connect_timeout);
                tls::probe(probe, host, *port, bound).await
            }
        };
        match (reason, err) {
            (Some(reason), EtcdError::Unavailable { source, .. }) => EtcdError::Tls {
                op,
                endpoint: endpoint.clone(),
                reason,
                source,
            },
            (_, err) => err,
        }
    }

    /// Runs `f` against the endpoints, starting at the preferred one, within `request_timeout`.
    async fn call<T, F, Fut>(&self, op: &'static str, kind: Kind, mut f: F) -> Result<T, EtcdError>
    where
        F: FnMut(Channel, Option<MetadataValue<tonic::metadata::Ascii>>) -> Fut,
        Fut: std::future::Future<Output = Result<tonic::Response<T>, tonic::Status>>,
    {
        let timeout = self.inner.opts.request_timeout;
        let deadline = Instant::now() + timeout;
        let n = self.inner.endpoints.len();
        let start = self.inner.preferred.load(Ordering::Relaxed) % n;
        let mut last: Option<EtcdError> = None;
        let mut reauthenticated = false;
        let mut tried = 0;
        while tried < n {
            let i = (start + tried) % n;
            let endpoint = &self.inner.endpoints[i];
            let now = Instant::now();
            if now >= deadline {
                break;
            }
            // A read gets an even share of the time left for each endpoint not tried yet; a write
            // all of it, since a write that timed out is never sent elsewhere.
            let share = match kind {
                Kind::Read => (deadline - now) / u32::try_from(n - tried).unwrap_or(1),
                Kind::Write => deadline - now,
            };
            let channel = self.channel(i);
            let attempt = async {
                let token = self.token(channel.clone(), endpoint).await?;
                match f(channel, token).await {
                    Ok(response) => Ok(response.into_inner()),
                    // The TLS probe gets half of the attempt's time left at most: a write that
                    // certainly was not applied must still end as such, not as a timeout.
                    Err(status) => {
                        let left = (now + share).saturating_duration_since(Instant::now());
                        Err(self.status_error(op, i, status, left / 2).await)
                    }
                }
            };
            let outcome = match tokio::time::timeout(share, attempt).await {
                Ok(Ok(value)) => {
                    self.inner.preferred.store(i, Ordering::Relaxed);
                    return Ok(value);
                }
                Ok(Err(EtcdError::Auth { .. }))
                    if self.inner.opts.user.is_some() && !reauthenticated =>
                {
                    // The cached token may have expired: authenticate once more, same endpoint.
                    reauthenticated = true;
                    self.forget_token().await;
                    continue;
                }
                Ok(Err(err)) => self.after_error(i, kind, err),
                Err(elapsed) => {
                    self.reset_channel(i);
                    let err = EtcdError::Timeout {
                        op,
                        endpoints: endpoint.clone(),
                        timeout: share,
                        source: elapsed,
                    };
                    match kind {
                        Kind::Read => Attempt::Next(err),
                        // It may still commit: the caller must treat it as uncertain.
                        Kind::Write => Attempt::Done(Err(err)),
                    }
                }
            };
            match outcome {
                Attempt::Done(Err(err)) if err.is_unavailable() => {
                    // An uncertain write is not repeated, but the next call starts at the next
                    // member: a caller that only writes must not stay stuck on a dead one.
                    let _ = self.inner.preferred.compare_exchange(
                        i,
                        (i + 1) % n,
                        Ordering::Relaxed,
                        Ordering::Relaxed,
                    );
                    return Err(err);
                }
                Attempt::Done(result) => return result,
                Attempt::Next(err) => {
                    tracing::debug!(op, endpoint = %endpoint, error = %err, "etcd member did not answer; trying the next endpoint");
                    last = Some(err);
                }
            }
            tried += 1;
        }
        Err(self.none_answered(op, timeout, last))
    }

    fn after_error<T>(&self, i: usize, kind: Kind, err: EtcdError) -> Attempt<T> {
        if !err.is_unavailable() {
            return Attempt::Done(Err(err));
        }
        if err.is_transport() {
            self.reset_channel(i);
        }
        match kind {
            Kind::Read => Attempt::Next(err),
            Kind::Write if err.certainly_not_applied() => Attempt::Next(err),
            Kind::Write => Attempt::Done(Err(err)),
        }
    }

    /// The error of a call no endpoint answered: names them all, keeps the last cause.
    fn none_answered(
        &self,
        op: &'static str,
        timeout: Duration,
        last: Option<EtcdError>,
    ) -> EtcdError {
        let endpoints = self.inner.endpoints.join(",");
        match last {
            Some(EtcdError::Unavailable { source, .. }) => EtcdError::Unavailable {
                op,
                endpoints,
                source,
            },
            Some(EtcdError::Timeout { source, .. }) => EtcdError::Timeout {
                op,
                endpoints,
                timeout,
                source,
            },
            Some(other) => other,
            None => EtcdError::Unavailable {
                op,
                endpoints,
                source: tonic::Status::deadline_exceeded("no time left to try an endpoint"),
            },
        }
    }
}

/// Parses one endpoint and applies the connection options.
fn endpoint_config(endpoint: &str, opts: &ConnectOptions) -> Result<Endpoint, EtcdError> {
    let https = endpoint.starts_with("https://");
    if !(endpoint.starts_with("http://") || https) {
        return Err(EtcdError::InvalidEndpoint {
            endpoint: endpoint.to_owned(),
            reason: "the scheme must be http:// or https:// (give http://HOST:PORT or https://HOST:PORT)".into(),
        });
    }
    let invalid = |why: &str| EtcdError::InvalidEndpoint {
        endpoint: endpoint.to_owned(),
        reason: why.into(),
    };
    let parsed =
        Endpoint::from_shared(endpoint.to_owned()).map_err(|e| EtcdError::InvalidEndpoint {
            endpoint: endpoint.to_owned(),
            reason: format!("not a valid client URL ({e}): give http://HOST:PORT").into(),
        })?;
    let parsed = match (&opts.tls, https) {
        (None, false) => parsed,
        (None, true) => {
            return Err(invalid(
                "an https:// endpoint needs TLS settings: give the CA of etcd's server certificates (--cluster-etcd-ca FILE), and a client certificate if etcd asks for one (--cluster-etcd-cert FILE --cluster-etcd-key FILE)",
            ));
        }
        (Some(_), false) => {
            return Err(invalid(
                "TLS settings (--cluster-etcd-ca, --cluster-etcd-cert, --cluster-etcd-key) are given but the endpoint is plain http://: give https://HOST:PORT, or drop the TLS settings",
            ));
        }
        (Some(tls), true) => {
            if tls.ca_pem.is_empty() {
                return Err(invalid(
                    "the CA (--cluster-etcd-ca) is empty: give the PEM of the CA that signed etcd's server certificates",
                ));
            }
            // The name checked against the server certificate: the URL's host (an IP address
            // is checked against the certificate's IP SANs), without IPv6 brackets.
            let host = parsed
                .uri()
                .host()
                .map(|h| h.trim_start_matches('[').trim_end_matches(']').to_owned())
                .ok_or_else(|| invalid("the URL has no host"))?;
            let mut config = ClientTlsConfig::new()
                .ca_certificate(Certificate::from_pem(&tls.ca_pem))
                .domain_name(host)
                .timeout(opts.connect_timeout);
            if let Some((cert, key)) = &tls.identity {
                config = config.identity(Identity::from_pem(cert, key));
            }
            parsed
                .tls_config(config)
                .map_err(|e| EtcdError::InvalidEndpoint {
                    endpoint: endpoint.to_owned(),
                    reason: format!(
                        "the TLS settings (--cluster-etcd-ca, --cluster-etcd-cert, --cluster-etcd-key) are not usable: {e}{}",
                        std::error::Error::source(&e)
                            .map(|s| format!(": {s}"))
                            .unwrap_or_default()
                    )
                    .into(),
                })?
        }
    };
    Ok(parsed
        .connect_timeout(opts.connect_timeout)
        .tcp_nodelay(true)
        // Notice a dead peer on an idle connection instead of hanging the next call.
        .http2_keep_alive_interval(opts.request_timeout.max(Duration::from_secs(1)))
        .keep_alive_timeout(opts.request_timeout.max(Duration::from_secs(1)))
        .keep_alive_while_idle(true))
}

/// Wraps a request with the metadata every call carries: `hasleader` and the auth token.
fn with_token<T>(
    message: T,
    token: Option<MetadataValue<tonic::metadata::Ascii>>,
) -> tonic::Request<T> {
    let mut request = tonic::Request::new(message);
    // etcd then refuses at once with "no leader" (not applied, safe to send elsewhere) instead of
    // waiting out its own timeout; clientv3's `WithRequireLeader` sets the same key.
    request
        .metadata_mut()
        .insert("hasleader", MetadataValue::from_static("true"));
    if let Some(token) = token {
        // etcd reads the token from the `token` metadata key (clientv3 does the same).
        request.metadata_mut().insert("token", token);
    }
    request
}

fn header(h: Option<&rpc::ResponseHeader>) -> (i64, u64) {
    h.map_or((0, 0), |h| (h.revision, h.cluster_id))
}

/// The `range_end` of every key starting with `prefix`: the prefix with its last byte below
/// 0xff incremented (trailing 0xff bytes dropped); `\0` (all keys from `prefix` on) when there is
/// no such byte.
pub(crate) fn prefix_end(prefix: &[u8]) -> Vec<u8> {
    let mut end = prefix.to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return end;
        }
    }
    vec![0]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefix_end_increments_the_last_byte_below_ff() {
        assert_eq!(prefix_end(b"a/b"), b"a/c".to_vec());
        assert_eq!(prefix_end(b"a\xff"), b"b".to_vec());
        assert_eq!(prefix_end(b"\xff\xff"), vec![0]);
        assert_eq!(prefix_end(b""), vec![0]);
    }

    #[tokio::test]
    async fn connect_rejects_a_bad_endpoint_naming_it() {
        let opts = |e: &str| ConnectOptions {
            endpoints: vec![e.to_owned()],
            request_timeout: Duration::from_secs(1),
            connect_timeout: Duration::from_secs(1),
            user: Some(("root".into(), "hunter2".into())),
            tls: None,
        };
        for bad in ["127.0.0.1:2379", "http://exa mple:1", "unix:///x"] {
            let err = Client::connect(opts(bad)).await.unwrap_err();
            assert!(
                matches!(err, EtcdError::InvalidEndpoint { .. }),
                "{bad}: {err}"
            );
            assert!(err.to_string().contains(bad), "{err}");
        }
        assert!(matches!(
            Client::connect(ConnectOptions {
                endpoints: vec![],
                ..opts("x")
            })
            .await
            .unwrap_err(),
            EtcdError::NoEndpoints
        ));
        assert!(!format!("{:?}", opts("http://a:1")).contains("hunter2"));
    }
}
