//! The engine's one door to etcd: the few operations cluster mode needs, as a trait.
//!
//! Owns the shape of what is asked (a read, a prefix listing, a guarded write, leases) and of
//! the one error callers branch on ([`StoreError::is_unavailable`]: etcd cannot answer now →
//! refuse new cluster publishes, keep everything else). `csi-etcd`'s client implements it
//! (src/cluster/etcd.rs); nothing here knows the key layout or decides anything.

use futures::future::BoxFuture;

/// A value with the revision that last changed it (the compare-and-swap token).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Versioned {
    pub key: Vec<u8>,
    pub value: Vec<u8>,
    pub mod_revision: i64,
    /// The lease the key is attached to (0: none): a leader key without one is forged.
    pub lease: i64,
}

/// A read, with the etcd cluster it came from (a restored or replaced etcd has another id).
#[derive(Clone, Debug, Default)]
pub struct Read {
    pub kvs: Vec<Versioned>,
    pub cluster_id: u64,
}

/// One write of a guarded transaction.
#[derive(Clone, Debug)]
pub enum WriteOp {
    Put {
        key: Vec<u8>,
        value: Vec<u8>,
        lease: Option<i64>,
    },
    Delete {
        key: Vec<u8>,
    },
}

/// Writes applied only when every key's mod revision is as given (0: the key is absent).
#[derive(Clone, Debug, Default)]
pub struct Guarded {
    pub when: Vec<(Vec<u8>, i64)>,
    pub then: Vec<WriteOp>,
}

/// What went wrong talking to etcd.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// etcd cannot answer now (unreachable, no quorum, timed out): nothing is known to have
    /// been written.
    #[error("etcd unavailable: {message}")]
    Unavailable {
        message: String,
        #[source]
        source: Option<Box<dyn std::error::Error + Send + Sync>>,
    },
    /// etcd answered with an error that a retry will not fix.
    #[error("etcd refused the request: {message}")]
    Refused {
        message: String,
        #[source]
        source: Option<Box<dyn std::error::Error + Send + Sync>>,
    },
}

impl StoreError {
    pub fn is_unavailable(&self) -> bool {
        matches!(self, StoreError::Unavailable { .. })
    }
}

/// Changes to a watched key or prefix. A waiter wakes when something changed and reads what
/// is current; it never learns the change from here, so a missed or merged event costs only
/// a wake-up.
pub trait Changes: Send {
    /// Resolves when the watched keys changed (at least once since the last call). An error
    /// means the watch is over: read what is current and watch again. Unbounded: the caller
    /// waits on it beside its own timer.
    fn changed(&mut self) -> BoxFuture<'_, Result<(), StoreError>>;
}

/// The operations cluster mode uses. Every call is bounded by the implementation's request
/// timeout: a blackholed etcd answers `Unavailable`, never hangs a caller.
pub trait ClusterStore: Send + Sync + std::fmt::Debug {
    fn get(&self, key: Vec<u8>) -> BoxFuture<'_, Result<Read, StoreError>>;
    fn list(&self, prefix: Vec<u8>) -> BoxFuture<'_, Result<Read, StoreError>>;
    /// The store's revision after the writes when the guard held and they were applied (one
    /// revision: the written keys' new mod revision); `None` when the guard failed.
    fn write(&self, guarded: Guarded) -> BoxFuture<'_, Result<Option<i64>, StoreError>>;
    fn grant(&self, ttl_secs: i64) -> BoxFuture<'_, Result<i64, StoreError>>;
    /// The lease's remaining TTL (≤ 0: the lease is gone).
    fn keep_alive(&self, lease: i64) -> BoxFuture<'_, Result<i64, StoreError>>;
    fn revoke(&self, lease: i64) -> BoxFuture<'_, Result<(), StoreError>>;
    /// Watches `key` (every key under it with `prefix`) from `from_revision` on (0: from now);
    /// answers once the watch is in place, so no change from then on is missed.
    fn watch(
        &self,
        key: Vec<u8>,
        prefix: bool,
        from_revision: i64,
    ) -> BoxFuture<'_, Result<Box<dyn Changes>, StoreError>>;
}

/// A store whose every call is timed into `csi_agent_etcd_request_duration_seconds`
/// (docs/operations.md, "Metrics and logs").
#[derive(Debug)]
pub struct Measured {
    pub store: std::sync::Arc<dyn ClusterStore>,
    pub metrics: std::sync::Arc<crate::metrics::Metrics>,
    /// Put before each `op` label: `background_` for the session's background calls (the
    /// controller election, the leader's polling, the presence's refresh), so that they are
    /// told apart from the calls of publishes and unpublishes.
    pub prefix: &'static str,
}

impl Measured {
    fn timed<'a, T: Send + 'a>(
        &'a self,
        op: &'static str,
        call: BoxFuture<'a, Result<T, StoreError>>,
    ) -> BoxFuture<'a, Result<T, StoreError>> {
        Box::pin(async move {
            let started = std::time::Instant::now();
            let result = call.await;
            let outcome = match &result {
                Ok(_) => "ok",
                Err(err) if err.is_unavailable() => "unavailable",
                Err(_) => "error",
            };
            self.metrics
                .etcd_request_duration
                .get_or_create(&crate::metrics::EtcdLabels {
                    op: format!("{}{op}", self.prefix),
                    outcome: outcome.to_owned(),
                })
                .observe(started.elapsed().as_secs_f64());
            result
        })
    }
}

impl ClusterStore for Measured {
    fn get(&self, key: Vec<u8>) -> BoxFuture<'_, Result<Read, StoreError>> {
        self.timed("get", self.store.get(key))
    }

    fn list(&self, prefix: Vec<u8>) -> BoxFuture<'_, Result<Read, StoreError>> {
        self.timed("list", self.store.list(prefix))
    }

    fn write(&self, guarded: Guarded) -> BoxFuture<'_, Result<Option<i64>, StoreError>> {
        self.timed("txn", self.store.write(guarded))
    }

    fn grant(&self, ttl_secs: i64) -> BoxFuture<'_, Result<i64, StoreError>> {
        self.timed("lease_grant", self.store.grant(ttl_secs))
    }

    fn keep_alive(&self, lease: i64) -> BoxFuture<'_, Result<i64, StoreError>> {
        self.timed("lease_keepalive", self.store.keep_alive(lease))
    }

    fn revoke(&self, lease: i64) -> BoxFuture<'_, Result<(), StoreError>> {
        self.timed("lease_revoke", self.store.revoke(lease))
    }

    fn watch(
        &self,
        key: Vec<u8>,
        prefix: bool,
        from_revision: i64,
    ) -> BoxFuture<'_, Result<Box<dyn Changes>, StoreError>> {
        // The opening only: what a watch then delivers is not a request.
        self.timed("watch", self.store.watch(key, prefix, from_revision))
    }
}
