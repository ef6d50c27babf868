//! Properties of the functions that turn hostile text into names and paths, over arbitrary
//! input (proptest): `layout::encode_id`/`decode_id` round-trip, are injective and never
//! panic; the beneath checks and the O_PATH walk never yield a path outside their root for
//! any component strings, even with symlinks planted in the tree; config parsing never panics
//! on arbitrary JSON; the mountinfo parser never panics and reads back exactly what the
//! kernel's escaping wrote, whatever bytes a path holds; the record decoder never panics on
//! arbitrary bytes, arbitrary JSON or a damaged valid record, and a record it accepts
//! re-encodes to itself. No mounts: runs anywhere.
//!
//! `FUZZ_CASES=N` runs every property N times instead of its default (the long run outside
//! CI, docs/reliability.md); failures shrink and are kept in `fuzz_props.proptest-regressions`,
//! which is committed and replayed first on every run.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::os::fd::AsFd;
use std::path::{Path, PathBuf};

use csi_agent::beneath;
use csi_agent::layout::{decode_id, encode_id};
use csi_agent::mounts::{MountInfo, MountTable};
use csi_agent::store::{decode_record, encode_record};
use csi_agent::volume::bind::Binder;
use csi_agent::volume::{Origin, VolumeRecord, VolumeState};
use proptest::prelude::*;
use serde_json::Value;

/// The number of cases of each property: `default`, or `FUZZ_CASES` when set.
fn cases(default: u32) -> u32 {
    std::env::var("FUZZ_CASES")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(default)
}

/// Component strings an attacker would try, mixed with arbitrary ones.
fn component() -> impl Strategy<Value = String> {
    prop_oneof![
        Just("..".to_owned()),
        Just(".".to_owned()),
        Just(String::new()),
        Just("link".to_owned()),
        Just("a".to_owned()),
        Just("%2F".to_owned()),
        Just("a/../..".to_owned()),
        Just("x\0y".to_owned()),
        "[a-z./\\\\%]{1,6}",
        any::<String>(),
    ]
}

fn arbitrary_json() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(Value::from),
        any::<f64>()
            .prop_map(|f| serde_json::Number::from_f64(f).map_or(Value::Null, Value::Number)),
        ".{0,12}".prop_map(Value::String),
        prop_oneof![
            Just("type"),
            Just("containers"),
            Just("endpoints"),
            Just("services"),
            Just("command"),
            Just("NODE_SERVICE"),
            Just("CONTROLLER_SERVICE"),
            Just("shell"),
            Just("value"),
            Just("arguments"),
            Just("$CSI_ENDPOINT"),
            Just("runtime"),
            Just("kind"),
            Just("process"),
            Just("rpc_deadline_ms"),
            Just("node_id"),
        ]
        .prop_map(|s| Value::String(s.to_owned())),
    ];
    leaf.prop_recursive(4, 48, 6, |inner| {
        let key = prop_oneof![
            Just("type".to_owned()),
            Just("name".to_owned()),
            Just("containers".to_owned()),
            Just("endpoints".to_owned()),
            Just("services".to_owned()),
            Just("command".to_owned()),
            Just("shell".to_owned()),
            Just("value".to_owned()),
            Just("arguments".to_owned()),
            Just("environment".to_owned()),
            Just("variables".to_owned()),
            Just("runtime".to_owned()),
            Just("kind".to_owned()),
            Just("startup_timeout_ms".to_owned()),
            Just("rpc_deadline_ms".to_owned()),
            Just("stop_grace_ms".to_owned()),
            Just("restart_backoff".to_owned()),
            Just("initial_ms".to_owned()),
            Just("node_id".to_owned()),
            Just("target_path_root".to_owned()),
            Just("target_path_exists".to_owned()),
            Just("endpoint".to_owned()),
            Just("uris".to_owned()),
            ".{0,8}",
        ];
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
            prop::collection::btree_map(key, inner, 0..6)
                .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(512), ..ProptestConfig::default() })]

    #[test]
    fn encode_then_decode_is_the_identity(id in any::<String>()) {
        let encoded = encode_id(&id);
        prop_assert!(!encoded.is_empty() && !encoded.contains('/') && encoded != "." && encoded != "..");
        prop_assert!(encoded.bytes().all(|b| b.is_ascii_alphanumeric() || b"_-%".contains(&b)));
        prop_assert_eq!(decode_id(&encoded), Some(id));
    }

    #[test]
    fn encode_is_injective(a in any::<String>(), b in any::<String>()) {
        prop_assert_eq!(a == b, encode_id(&a) == encode_id(&b));
    }

    #[test]
    fn decode_never_panics_and_only_accepts_what_encode_makes(s in any::<String>()) {
        if let Some(id) = decode_id(&s) {
            // One id has exactly one name: what decodes must be what encode makes.
            prop_assert_eq!(encode_id(&id), s);
        }
    }

    #[test]
    fn decode_of_near_miss_escapes_never_panics(s in "[%0-9A-Fa-fg-z_./-]{0,12}") {
        if let Some(id) = decode_id(&s) {
            prop_assert_eq!(encode_id(&id), s);
        }
    }

    #[test]
    fn lexical_checks_never_yield_a_path_outside_the_root(parts in prop::collection::vec(component(), 0..6)) {
        let root = Path::new("/srv/sandboxes");
        let path = PathBuf::from(format!("{}/{}", root.display(), parts.join("/")));
        if let Ok(relative) = beneath::normalized_relative(root, &path) {
            prop_assert!(relative.is_relative());
            prop_assert!(relative.components().all(|c| matches!(c, std::path::Component::Normal(_))));
            prop_assert!(root.join(&relative).starts_with(root));
            prop_assert_eq!(root.join(&relative), path.clone());
        }
        // The bind check is the same rule plus the roots and forbidden paths.
        let binder = Binder::new(vec![root.to_path_buf()], Path::new("/srv/sandboxes/work"));
        if let Ok((found, relative)) = binder.check(&path) {
            prop_assert_eq!(found.as_path(), root);
            prop_assert!(relative.components().all(|c| matches!(c, std::path::Component::Normal(_))));
            prop_assert!(!path.starts_with("/srv/sandboxes/work"));
        }
    }

    #[test]
    fn config_parsing_never_panics_on_arbitrary_json(value in arbitrary_json()) {
        let text = value.to_string();
        let _ = csi_agent::config::parse_config(Path::new("fuzz.json"), &text);
    }

    #[test]
    fn config_parsing_never_panics_on_arbitrary_text(text in ".{0,200}") {
        let _ = csi_agent::config::parse_config(Path::new("fuzz.json"), &text);
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(256), ..ProptestConfig::default() })]

    /// The walk itself, on a real tree holding symlinks to outside (absolute and `..`), a
    /// file and a dir: whatever it opens or creates lies beneath the root.
    #[test]
    fn the_walk_never_leaves_its_root(parts in prop::collection::vec(component(), 1..5), create in any::<bool>()) {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("root");
        let outside = dir.path().join("outside");
        std::fs::create_dir_all(root.join("a")).unwrap();
        std::fs::create_dir_all(&outside).unwrap();
        std::os::unix::fs::symlink(&outside, root.join("link")).unwrap();
        std::os::unix::fs::symlink("../outside", root.join("a/up")).unwrap();
        std::fs::write(root.join("file"), b"x").unwrap();
        let path = PathBuf::from(format!("{}/{}", root.display(), parts.join("/")));
        let Ok(relative) = beneath::normalized_relative(&root, &path) else {
            return Ok(());
        };
        let root_fd = beneath::open_root(&root).unwrap();
        let mode = create.then(|| rustix::fs::Mode::from_raw_mode(0o755));
        if let Ok(opened) = beneath::open_dir(root_fd.as_fd(), &root, &relative, mode) {
            let at = std::fs::read_link(beneath::fd_path(opened.fd.as_fd())).unwrap();
            let canonical_root = std::fs::canonicalize(&root).unwrap();
            prop_assert!(at.starts_with(&canonical_root), "{} opened {}", path.display(), at.display());
        }
        // Nothing was ever created outside.
        prop_assert_eq!(std::fs::read_dir(&outside).unwrap().count(), 0);
    }
}

/// A path component as bytes: anything but `/` and NUL, with the bytes the kernel escapes in
/// mountinfo (space, tab, newline, backslash) and near-miss escapes over-represented.
fn path_bytes() -> impl Strategy<Value = Vec<u8>> {
    let piece = prop_oneof![
        Just(b" ".to_vec()),
        Just(b"\t".to_vec()),
        Just(b"\n".to_vec()),
        Just(b"\\".to_vec()),
        Just(b"\\040".to_vec()),
        Just(b"\\12".to_vec()),
        Just(b"-".to_vec()),
        Just(b"\xff\xfe".to_vec()),
        prop::collection::vec(
            any::<u8>().prop_filter("no / or NUL", |b| *b != b'/' && *b != 0),
            1..6
        ),
    ];
    prop::collection::vec(
        prop::collection::vec(piece, 1..4).prop_map(|p| p.concat()),
        1..4,
    )
    .prop_map(|components| {
        let mut path = Vec::new();
        for component in components {
            path.push(b'/');
            path.extend(component);
        }
        path
    })
}

/// The kernel's mountinfo escaping (`fs/proc_namespace.c`, `mangle`): space, tab, newline and
/// backslash as three-digit octal.
fn mangle(bytes: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    for &b in bytes {
        if matches!(b, b' ' | b'\t' | b'\n' | b'\\') {
            out.extend(format!("\\{b:03o}").into_bytes());
        } else {
            out.push(b);
        }
    }
    out
}

fn path_of(bytes: &[u8]) -> PathBuf {
    use std::os::unix::ffi::OsStrExt;
    PathBuf::from(std::ffi::OsStr::from_bytes(bytes))
}

fn a_valid_record() -> VolumeRecord {
    let mut record = VolumeRecord::new("vol-1", Origin::PreProvisioned);
    record.state = VolumeState::Published;
    record.claims.insert("workload-a".to_owned());
    record
        .volume_context
        .insert("k".to_owned(), "v \" \\ \u{1}".to_owned());
    record.boot_id = Some("b".to_owned());
    record
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(512), ..ProptestConfig::default() })]

    #[test]
    fn mountinfo_parsing_never_panics(bytes in prop::collection::vec(any::<u8>(), 0..400)) {
        let _ = MountTable::parse_bytes(&bytes);
    }

    #[test]
    fn mountinfo_parsing_never_panics_on_near_valid_lines(
        fields in prop::collection::vec(prop_oneof![
            Just("-".to_owned()), Just("36".to_owned()), Just("8:1".to_owned()),
            Just("/".to_owned()), Just("shared:1".to_owned()), Just("".to_owned()),
            "[0-9:a-z/\\\\-]{0,6}",
        ], 0..14)
    ) {
        let _ = MountTable::parse(&fields.join(" "));
    }

    #[test]
    fn mountinfo_reads_back_what_the_kernel_escaped(
        root in path_bytes(),
        point in path_bytes(),
        source in path_bytes(),
        ids in (0u64..1 << 40, 0u64..1 << 40, 0u32..4096, 0u32..1 << 20),
        shared in any::<bool>(),
    ) {
        let (mount_id, parent_id, major, minor) = ids;
        let mut line = format!("{mount_id} {parent_id} {major}:{minor} ").into_bytes();
        line.extend(mangle(&root));
        line.push(b' ');
        line.extend(mangle(&point));
        line.extend(b" rw,nosuid");
        if shared {
            line.extend(b" shared:7");
        }
        line.extend(b" - ext4 ");
        line.extend(mangle(&source));
        line.extend(b" rw\n");
        let table = MountTable::parse_bytes(&line).unwrap();
        let parsed: &MountInfo = &table.entries()[0];
        prop_assert_eq!(parsed.mount_id, mount_id);
        prop_assert_eq!(parsed.parent_id, parent_id);
        prop_assert_eq!((parsed.major, parsed.minor), (major, minor));
        prop_assert_eq!(&parsed.root, &path_of(&root));
        prop_assert_eq!(&parsed.mount_point, &path_of(&point));
        // The source is informational text (a device name), decoded lossily; the paths, which
        // csi-agent acts on, are bytes and must come back exactly.
        prop_assert_eq!(&parsed.source, &String::from_utf8_lossy(&source));
        prop_assert_eq!(parsed.is_shared(), shared);
        prop_assert_eq!(parsed.fs_type.as_str(), "ext4");
    }

    #[test]
    fn record_decoding_never_panics_on_bytes(bytes in prop::collection::vec(any::<u8>(), 0..300)) {
        let _ = decode_record::<VolumeRecord>(&bytes);
    }

    #[test]
    fn record_decoding_never_panics_on_json(value in arbitrary_json()) {
        let bytes = serde_json::to_vec(&value).unwrap();
        let _ = decode_record::<VolumeRecord>(&bytes);
        let wrapped = serde_json::to_vec(&serde_json::json!({"schema_version": 1, "record": value})).unwrap();
        let _ = decode_record::<VolumeRecord>(&wrapped);
    }

    #[test]
    fn a_damaged_record_is_refused_or_read_as_a_record_that_re_encodes_to_itself(
        cut in any::<prop::sample::Index>(),
        flip in any::<prop::sample::Index>(),
        byte in any::<u8>(),
    ) {
        let good = encode_record(&a_valid_record()).unwrap();
        let mut damaged = good.clone();
        damaged[flip.index(good.len())] = byte;
        damaged.truncate(cut.index(good.len() + 1));
        if let Ok(record) = decode_record::<VolumeRecord>(&damaged) {
            let again = encode_record(&record).unwrap();
            prop_assert_eq!(decode_record::<VolumeRecord>(&again).unwrap(), record);
        }
    }
}
