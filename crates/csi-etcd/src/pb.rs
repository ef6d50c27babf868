//! The code `build.rs` generates from the vendored protos: prost messages and tonic clients of
//! the packages `etcdserverpb` (the RPCs), `mvccpb` (`KeyValue`) and `authpb`, which `rpc.proto`
//! references. Generated, not edited (the lints are relaxed on `mod pb` in `lib.rs`); nothing
//! outside this crate sees it. Also the two request builders a plain call and a `Txn` share.

pub mod etcdserverpb {
    tonic::include_proto!("etcdserverpb");
}

pub mod mvccpb {
    tonic::include_proto!("mvccpb");
}

pub mod authpb {
    tonic::include_proto!("authpb");
}

/// A `PutRequest` of `key` = `value`, attached to `lease` if any.
pub fn put_request(key: Vec<u8>, value: Vec<u8>, lease: Option<i64>) -> etcdserverpb::PutRequest {
    etcdserverpb::PutRequest {
        key,
        value,
        lease: lease.unwrap_or(0),
        ..Default::default()
    }
}

/// A `DeleteRangeRequest` of exactly `key`.
pub fn delete_request(key: Vec<u8>) -> etcdserverpb::DeleteRangeRequest {
    etcdserverpb::DeleteRangeRequest {
        key,
        ..Default::default()
    }
}
