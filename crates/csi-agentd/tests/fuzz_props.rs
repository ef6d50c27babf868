//! Properties of the functions that turn hostile text into names and paths, over arbitrary
//! input (proptest): `layout::encode_id`/`decode_id` round-trip, are injective and never
//! panic; the beneath checks and the O_PATH walk never yield a path outside their root for
//! any component strings, even with symlinks planted in the tree; config parsing never panics
//! on arbitrary JSON. No mounts: runs anywhere.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::os::fd::AsFd;
use std::path::{Path, PathBuf};

use csi_agent::beneath;
use csi_agent::layout::{decode_id, encode_id};
use csi_agent::volume::bind::Binder;
use proptest::prelude::*;
use serde_json::Value;

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
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

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
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

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
