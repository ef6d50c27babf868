//! The transaction builder ([`Txn`]) and its result ([`TxnResult`]): the mapping between these
//! types and etcd's `TxnRequest` / `TxnResponse`. Owns nothing else; must not run anything.

use crate::pb;
use crate::pb::etcdserverpb as rpc;
use crate::{KeyValue, prefix_end};

/// A comparison on one key; all of a [`Txn`]'s must hold for its `and_then` branch to run.
/// A key that does not exist has create_revision, mod_revision and version 0.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Compare {
    CreateRevision(Vec<u8>, CompareOp, i64),
    ModRevision(Vec<u8>, CompareOp, i64),
    Version(Vec<u8>, CompareOp, i64),
    Value(Vec<u8>, CompareOp, Vec<u8>),
}

/// How a [`Compare`] compares the key's current field with the given one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CompareOp {
    Equal,
    NotEqual,
    Greater,
    Less,
}

/// One operation of a [`Txn`] branch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TxnOp {
    Put {
        key: Vec<u8>,
        value: Vec<u8>,
        lease: Option<i64>,
    },
    Delete {
        key: Vec<u8>,
    },
    Get {
        key: Vec<u8>,
    },
    GetPrefix {
        prefix: Vec<u8>,
    },
}

/// A transaction: `when` every compare holds, run `and_then`, otherwise `or_else`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Txn {
    compares: Vec<Compare>,
    success: Vec<TxnOp>,
    failure: Vec<TxnOp>,
}

impl Txn {
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds compares (all must hold).
    pub fn when(mut self, c: impl IntoIterator<Item = Compare>) -> Self {
        self.compares.extend(c);
        self
    }

    /// Adds operations run when every compare holds.
    pub fn and_then(mut self, ops: impl IntoIterator<Item = TxnOp>) -> Self {
        self.success.extend(ops);
        self
    }

    /// Adds operations run when a compare does not hold.
    pub fn or_else(mut self, ops: impl IntoIterator<Item = TxnOp>) -> Self {
        self.failure.extend(ops);
        self
    }

    pub(crate) fn into_request(self) -> rpc::TxnRequest {
        rpc::TxnRequest {
            compare: self.compares.into_iter().map(compare).collect(),
            success: self.success.into_iter().map(request_op).collect(),
            failure: self.failure.into_iter().map(request_op).collect(),
        }
    }
}

/// The answer to a [`Txn`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TxnResult {
    /// Whether every compare held (so `and_then` ran, else `or_else`).
    pub succeeded: bool,
    pub revision: i64,
    pub cluster_id: u64,
    /// One per operation of the branch that ran, in order.
    pub responses: Vec<TxnResponse>,
}

/// The answer to one [`TxnOp`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TxnResponse {
    Put,
    Delete { deleted: i64 },
    Get(Vec<KeyValue>),
}

impl TxnResult {
    pub(crate) fn from_response(resp: rpc::TxnResponse) -> Self {
        let (revision, cluster_id) = crate::header(resp.header.as_ref());
        let responses = resp
            .responses
            .into_iter()
            .filter_map(|r| r.response)
            .filter_map(|r| match r {
                rpc::response_op::Response::ResponsePut(_) => Some(TxnResponse::Put),
                rpc::response_op::Response::ResponseDeleteRange(d) => {
                    Some(TxnResponse::Delete { deleted: d.deleted })
                }
                rpc::response_op::Response::ResponseRange(r) => Some(TxnResponse::Get(
                    r.kvs.into_iter().map(KeyValue::from).collect(),
                )),
                // We never send a nested txn.
                rpc::response_op::Response::ResponseTxn(_) => None,
            })
            .collect();
        TxnResult {
            succeeded: resp.succeeded,
            revision,
            cluster_id,
            responses,
        }
    }
}

fn compare(c: Compare) -> rpc::Compare {
    use rpc::compare::{CompareResult, CompareTarget, TargetUnion};
    let result = |op: CompareOp| match op {
        CompareOp::Equal => CompareResult::Equal,
        CompareOp::NotEqual => CompareResult::NotEqual,
        CompareOp::Greater => CompareResult::Greater,
        CompareOp::Less => CompareResult::Less,
    } as i32;
    let (key, op, target, union) = match c {
        Compare::CreateRevision(k, op, v) => {
            (k, op, CompareTarget::Create, TargetUnion::CreateRevision(v))
        }
        Compare::ModRevision(k, op, v) => (k, op, CompareTarget::Mod, TargetUnion::ModRevision(v)),
        Compare::Version(k, op, v) => (k, op, CompareTarget::Version, TargetUnion::Version(v)),
        Compare::Value(k, op, v) => (k, op, CompareTarget::Value, TargetUnion::Value(v)),
    };
    rpc::Compare {
        result: result(op),
        target: target as i32,
        key,
        target_union: Some(union),
        ..Default::default()
    }
}

fn request_op(op: TxnOp) -> rpc::RequestOp {
    use rpc::request_op::Request;
    let request = match op {
        TxnOp::Put { key, value, lease } => Request::RequestPut(pb::put_request(key, value, lease)),
        TxnOp::Delete { key } => Request::RequestDeleteRange(pb::delete_request(key)),
        TxnOp::Get { key } => Request::RequestRange(rpc::RangeRequest {
            key,
            ..Default::default()
        }),
        TxnOp::GetPrefix { prefix } => Request::RequestRange(rpc::RangeRequest {
            range_end: prefix_end(&prefix),
            key: prefix,
            ..Default::default()
        }),
    };
    rpc::RequestOp {
        request: Some(request),
    }
}
