//! Every RPC, field and enum value `csi-etcd` uses (the table in the crate doc) exists in etcd
//! 3.4 with the same number, type and label: compared with the file descriptors the installed
//! etcd binary embeds (Go's generated code keeps each `.proto` gzipped in the binary), not with a
//! copy of the protos. The vendored protos are newer than 3.4, so this is what stops the client
//! from relying on a field 3.4 silently ignores.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::Read;

use csi_agent_testkit::etcd::etcd_binary;
use prost::Message;
use prost_types::{
    DescriptorProto, EnumDescriptorProto, FieldDescriptorProto, FileDescriptorProto,
    FileDescriptorSet, ServiceDescriptorProto,
};

/// (message, fields) the client sets or reads. `mvccpb.` marks kv.proto; the rest is rpc.proto.
const FIELDS: &[(&str, &[&str])] = &[
    (
        "ResponseHeader",
        &["cluster_id", "member_id", "revision", "raft_term"],
    ),
    ("RangeRequest", &["key", "range_end", "limit"]),
    ("RangeResponse", &["header", "kvs", "more"]),
    ("PutRequest", &["key", "value", "lease"]),
    ("PutResponse", &["header"]),
    ("DeleteRangeRequest", &["key"]),
    ("DeleteRangeResponse", &["header", "deleted"]),
    (
        "RequestOp",
        &["request_range", "request_put", "request_delete_range"],
    ),
    (
        "ResponseOp",
        &["response_range", "response_put", "response_delete_range"],
    ),
    (
        "Compare",
        &[
            "result",
            "target",
            "key",
            "version",
            "create_revision",
            "mod_revision",
            "value",
        ],
    ),
    ("TxnRequest", &["compare", "success", "failure"]),
    ("TxnResponse", &["header", "succeeded", "responses"]),
    ("LeaseGrantRequest", &["TTL", "ID"]),
    ("LeaseGrantResponse", &["ID", "TTL", "error"]),
    ("LeaseKeepAliveRequest", &["ID"]),
    ("LeaseKeepAliveResponse", &["TTL"]),
    ("LeaseRevokeRequest", &["ID"]),
    (
        "StatusResponse",
        &["header", "version", "dbSize", "leader", "raftTerm"],
    ),
    ("MemberListResponse", &["members"]),
    ("Member", &["ID", "name", "clientURLs"]),
    ("AuthenticateRequest", &["name", "password"]),
    ("AuthenticateResponse", &["token"]),
    ("WatchRequest", &["create_request"]),
    (
        "WatchCreateRequest",
        &["key", "range_end", "start_revision"],
    ),
    (
        "WatchResponse",
        &[
            "header",
            "created",
            "canceled",
            "compact_revision",
            "cancel_reason",
            "events",
        ],
    ),
    ("mvccpb.Event", &["type", "kv"]),
    (
        "mvccpb.KeyValue",
        &[
            "key",
            "create_revision",
            "mod_revision",
            "version",
            "value",
            "lease",
        ],
    ),
];

/// (service, method) called.
const RPCS: &[(&str, &str)] = &[
    ("KV", "Range"),
    ("KV", "Put"),
    ("KV", "DeleteRange"),
    ("KV", "Txn"),
    ("Lease", "LeaseGrant"),
    ("Lease", "LeaseKeepAlive"),
    ("Lease", "LeaseRevoke"),
    ("Maintenance", "Status"),
    ("Cluster", "MemberList"),
    ("Auth", "Authenticate"),
    ("Watch", "Watch"),
];

/// (message, enum, values) sent.
const ENUMS: &[(&str, &str, &[&str])] = &[
    (
        "Compare",
        "CompareResult",
        &["EQUAL", "GREATER", "LESS", "NOT_EQUAL"],
    ),
    (
        "Compare",
        "CompareTarget",
        &["VERSION", "CREATE", "MOD", "VALUE"],
    ),
];

/// rpc.proto and kv.proto as compiled into the etcd binary.
fn etcd_binary_protos() -> (FileDescriptorProto, FileDescriptorProto) {
    let binary = std::fs::read(etcd_binary()).unwrap();
    let (mut rpc, mut kv) = (None, None);
    // Every gzip member start (magic, deflate) that decodes to a FileDescriptorProto.
    for start in binary
        .windows(3)
        .enumerate()
        .filter(|(_, w)| *w == [0x1f, 0x8b, 0x08])
        .map(|(i, _)| i)
    {
        let mut out = Vec::new();
        let mut gz = flate2::read::GzDecoder::new(&binary[start..]).take(1 << 20);
        if gz.read_to_end(&mut out).is_err() {
            continue;
        }
        let Ok(file) = FileDescriptorProto::decode(out.as_slice()) else {
            continue;
        };
        match (file.package(), file.name()) {
            ("etcdserverpb", name) if name.ends_with("rpc.proto") => rpc = Some(file),
            ("mvccpb", name) if name.ends_with("kv.proto") => kv = Some(file),
            _ => {}
        }
    }
    (
        rpc.expect("etcd binary embeds etcdserverpb rpc.proto"),
        kv.expect("etcd binary embeds mvccpb kv.proto"),
    )
}

fn ours() -> (FileDescriptorProto, FileDescriptorProto) {
    let set = FileDescriptorSet::decode(csi_etcd::FILE_DESCRIPTOR_SET).unwrap();
    let find = |name: &str| set.file.iter().find(|f| f.name() == name).unwrap().clone();
    (
        find("etcd/api/etcdserverpb/rpc.proto"),
        find("etcd/api/mvccpb/kv.proto"),
    )
}

fn message<'a>(file: &'a FileDescriptorProto, name: &str) -> &'a DescriptorProto {
    file.message_type
        .iter()
        .find(|m| m.name() == name)
        .unwrap_or_else(|| panic!("message {name} missing in {}", file.name()))
}

fn field<'a>(m: &'a DescriptorProto, name: &str, file: &str) -> &'a FieldDescriptorProto {
    m.field
        .iter()
        .find(|f| f.name() == name)
        .unwrap_or_else(|| panic!("field {}.{name} missing in {file}", m.name()))
}

fn enum_in<'a>(m: &'a DescriptorProto, name: &str) -> &'a EnumDescriptorProto {
    m.enum_type.iter().find(|e| e.name() == name).unwrap()
}

fn service<'a>(file: &'a FileDescriptorProto, name: &str) -> &'a ServiceDescriptorProto {
    file.service
        .iter()
        .find(|s| s.name() == name)
        .unwrap_or_else(|| panic!("service {name} missing in {}", file.name()))
}

#[test]
fn every_rpc_field_and_enum_used_exists_in_the_installed_etcd_with_the_same_number_and_type() {
    let (etcd_rpc, etcd_kv) = etcd_binary_protos();
    let (our_rpc, our_kv) = ours();
    let mut checked = 0;

    for (name, fields) in FIELDS {
        let (etcd_file, our_file, name) = match name.strip_prefix("mvccpb.") {
            Some(n) => (&etcd_kv, &our_kv, n),
            None => (&etcd_rpc, &our_rpc, *name),
        };
        let (theirs, ours) = (message(etcd_file, name), message(our_file, name));
        for f in *fields {
            let (t, o) = (
                field(theirs, f, "etcd 3.4"),
                field(ours, f, "the vendored protos"),
            );
            assert_eq!(
                (t.number(), t.r#type(), t.label(), t.type_name()),
                (o.number(), o.r#type(), o.label(), o.type_name()),
                "{name}.{f}: etcd 3.4 and the vendored proto differ"
            );
            checked += 1;
        }
    }
    for (m, e, values) in ENUMS {
        let theirs = enum_in(message(&etcd_rpc, m), e);
        let ours = enum_in(message(&our_rpc, m), e);
        for v in *values {
            let number = |e: &EnumDescriptorProto| {
                e.value.iter().find(|x| x.name() == *v).map(|x| x.number())
            };
            assert!(number(theirs).is_some(), "{m}.{e}.{v} missing in etcd 3.4");
            assert_eq!(number(theirs), number(ours), "{m}.{e}.{v}");
            checked += 1;
        }
    }
    for (s, rpc) in RPCS {
        let method = |file: &FileDescriptorProto| {
            let m = service(file, s)
                .method
                .iter()
                .find(|m| m.name() == *rpc)
                .unwrap_or_else(|| panic!("{s}/{rpc} missing in {}", file.name()))
                .clone();
            (
                m.input_type().to_owned(),
                m.output_type().to_owned(),
                m.client_streaming(),
                m.server_streaming(),
            )
        };
        assert_eq!(method(&etcd_rpc), method(&our_rpc), "{s}/{rpc}");
        checked += 1;
    }
    // The package (hence each gRPC path, /etcdserverpb.KV/Range) is the same.
    assert_eq!(etcd_rpc.package(), our_rpc.package());

    // Not vacuous: the binary's protos are really the older ones (3.5 added this field).
    let newer = message(&our_rpc, "MemberListRequest");
    assert!(newer.field.iter().any(|f| f.name() == "linearizable"));
    assert!(
        !message(&etcd_rpc, "MemberListRequest")
            .field
            .iter()
            .any(|f| f.name() == "linearizable"),
        "the installed etcd is expected to be 3.4"
    );
    eprintln!("{checked} fields, enum values and RPCs match etcd 3.4's own descriptors");
}
