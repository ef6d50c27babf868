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

/// The operations cluster mode uses. Every call is bounded by the implementation's request
/// timeout: a blackholed etcd answers `Unavailable`, never hangs a caller.
pub trait ClusterStore: Send + Sync + std::fmt::Debug {
    fn get(&self, key: Vec<u8>) -> BoxFuture<'_, Result<Read, StoreError>>;
    fn list(&self, prefix: Vec<u8>) -> BoxFuture<'_, Result<Read, StoreError>>;
    /// True when the guard held and the writes were applied (one revision).
    fn write(&self, guarded: Guarded) -> BoxFuture<'_, Result<bool, StoreError>>;
    fn grant(&self, ttl_secs: i64) -> BoxFuture<'_, Result<i64, StoreError>>;
    /// The lease's remaining TTL (≤ 0: the lease is gone).
    fn keep_alive(&self, lease: i64) -> BoxFuture<'_, Result<i64, StoreError>>;
    fn revoke(&self, lease: i64) -> BoxFuture<'_, Result<(), StoreError>>;
}
