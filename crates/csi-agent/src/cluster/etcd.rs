//! [`ClusterStore`] over `csi-etcd`'s client: the one place cluster mode meets etcd's own
//! types.
//!
//! Must not: decide anything, or log values (they name volumes), the password or TLS keys.

use std::time::Duration;

pub use csi_etcd::TlsOptions;
use csi_etcd::{Client, Compare, CompareOp, ConnectOptions, EtcdError, Txn, TxnOp};
use futures::future::BoxFuture;

use super::store::{Changes, ClusterStore, Guarded, Read, StoreError, Versioned, WriteOp};

/// Most keys one listing returns; a cluster with more volumes per plugin than this is
/// listed partly (and says so in the log).
const LIST_LIMIT: i64 = 100_000;

/// etcd through `csi-etcd`.
#[derive(Clone, Debug)]
pub struct EtcdStore {
    client: Client,
}

impl EtcdStore {
    /// A client over `endpoints` (`https://` ones with `tls`); nothing is dialled until the
    /// first request, so a daemon starts while etcd is down.
    pub async fn connect(
        endpoints: Vec<String>,
        request_timeout: Duration,
        user: Option<(String, String)>,
        tls: Option<TlsOptions>,
    ) -> Result<Self, StoreError> {
        let client = Client::connect(ConnectOptions {
            endpoints,
            request_timeout,
            connect_timeout: request_timeout.min(Duration::from_secs(2)),
            user,
            tls,
        })
        .await
        .map_err(store_error)?;
        Ok(Self { client })
    }

    pub fn client(&self) -> &Client {
        &self.client
    }
}

fn store_error(err: EtcdError) -> StoreError {
    let message = err.to_string();
    if err.is_unavailable() {
        StoreError::Unavailable {
            message,
            source: Some(Box::new(err)),
        }
    } else {
        StoreError::Refused {
            message,
            source: Some(Box::new(err)),
        }
    }
}

fn read_of(result: csi_etcd::GetResult) -> Read {
    if result.more {
        tracing::warn!(
            limit = LIST_LIMIT,
            "an etcd listing was cut at its limit; keys beyond it were not seen"
        );
    }
    Read {
        kvs: result
            .kvs
            .into_iter()
            .map(|kv| Versioned {
                key: kv.key,
                value: kv.value,
                mod_revision: kv.mod_revision,
                lease: kv.lease,
            })
            .collect(),
        cluster_id: result.cluster_id,
    }
}

impl ClusterStore for EtcdStore {
    fn get(&self, key: Vec<u8>) -> BoxFuture<'_, Result<Read, StoreError>> {
        Box::pin(async move {
            self.client
                .get(&key)
                .await
                .map(read_of)
                .map_err(store_error)
        })
    }

    fn list(&self, prefix: Vec<u8>) -> BoxFuture<'_, Result<Read, StoreError>> {
        Box::pin(async move {
            self.client
                .get_prefix(&prefix, LIST_LIMIT)
                .await
                .map(read_of)
                .map_err(store_error)
        })
    }

    fn write(&self, guarded: Guarded) -> BoxFuture<'_, Result<Option<i64>, StoreError>> {
        Box::pin(async move {
            let compares = guarded
                .when
                .into_iter()
                .map(|(key, revision)| Compare::ModRevision(key, CompareOp::Equal, revision));
            let ops = guarded.then.into_iter().map(|op| match op {
                WriteOp::Put { key, value, lease } => TxnOp::Put { key, value, lease },
                WriteOp::Delete { key } => TxnOp::Delete { key },
            });
            self.client
                .txn(Txn::new().when(compares).and_then(ops))
                .await
                .map(|result| result.succeeded.then_some(result.revision))
                .map_err(store_error)
        })
    }

    fn grant(&self, ttl_secs: i64) -> BoxFuture<'_, Result<i64, StoreError>> {
        Box::pin(async move {
            self.client
                .lease_grant(ttl_secs)
                .await
                .map(|lease| lease.id)
                .map_err(store_error)
        })
    }

    fn keep_alive(&self, lease: i64) -> BoxFuture<'_, Result<i64, StoreError>> {
        Box::pin(async move {
            self.client
                .lease_keep_alive(lease)
                .await
                .map_err(store_error)
        })
    }

    fn revoke(&self, lease: i64) -> BoxFuture<'_, Result<(), StoreError>> {
        Box::pin(async move { self.client.lease_revoke(lease).await.map_err(store_error) })
    }

    fn watch(
        &self,
        key: Vec<u8>,
        prefix: bool,
        from_revision: i64,
    ) -> BoxFuture<'_, Result<Box<dyn Changes>, StoreError>> {
        Box::pin(async move {
            let watch = self
                .client
                .watch(&key, prefix, from_revision)
                .await
                .map_err(store_error)?;
            Ok(Box::new(EtcdChanges(watch)) as Box<dyn Changes>)
        })
    }
}

/// An etcd watch as [`Changes`]: the events themselves are dropped (the waiter reads).
struct EtcdChanges(csi_etcd::Watch);

impl Changes for EtcdChanges {
    fn changed(&mut self) -> BoxFuture<'_, Result<(), StoreError>> {
        Box::pin(async move { self.0.changes().await.map(drop).map_err(store_error) })
    }
}
