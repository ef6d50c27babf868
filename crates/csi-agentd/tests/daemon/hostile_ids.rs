//! Hostile ids through the HTTP API, on the real daemon with the real test plugin: volume ids,
//! workload ids and plugin types that are empty, 10 KiB long, hold NUL, a line break, `/`,
//! `..` or `%2F`; URLs whose ids are not UTF-8; bodies over the size limit. Each gets a clear
//! answer in the API's error shape naming the field, nothing is created on disk for it, and
//! no id can forge a line of the daemon's log.
//! Run under `unshare -m --propagation private`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeSet;
use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::Duration;

use csi_agent::mounts::require_private_mount_namespace;
use csi_agent_api::ApiError;
use csi_agent_testkit::node::*;
use csi_agent_testkit::*;
use serde_json::Value;

/// Every path under `dir` (not following symlinks).
fn tree(dir: &Path) -> BTreeSet<PathBuf> {
    let mut out = BTreeSet::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(dir) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for entry in entries.flatten() {
            let path = entry.path();
            if entry.file_type().is_ok_and(|t| t.is_dir()) {
                stack.push(path.clone());
            }
            out.insert(path);
        }
    }
    out
}

/// What the node keeps that a refused request must not change: the files of the work dir
/// (but the database's, which a read may checkpoint), its rows, and the plugin's calls.
#[derive(Debug, PartialEq, Eq)]
struct Footprint {
    files: BTreeSet<PathBuf>,
    rows: Vec<String>,
    calls: usize,
}

fn footprint(node: &Node) -> Footprint {
    Footprint {
        files: tree(&node.work)
            .into_iter()
            .filter(|p| {
                let name = p.file_name().unwrap().to_string_lossy();
                !name.starts_with("state.db")
                    && !p.starts_with(node.work.join("csi/org.example.test/default/containers"))
            })
            .collect(),
        rows: csi_agent::store::db::dump(&node.work)
            .unwrap_or_default()
            .into_iter()
            .map(|row| row.volume_key)
            .collect(),
        calls: node.calls().len(),
    }
}

/// A raw HTTP/1.1 exchange over the API socket: status and body.
fn raw(node: &Node, request: &[u8]) -> (u16, Vec<u8>) {
    let mut stream = UnixStream::connect(&node.socket).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(20)))
        .unwrap();
    // The daemon may answer (413) before the whole body is sent, and close.
    let _ = stream.write_all(request);
    let mut answer = Vec::new();
    let _ = stream.read_to_end(&mut answer);
    let text = String::from_utf8_lossy(&answer);
    let status = text
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no HTTP answer: {text:?}"));
    let body = match answer.windows(4).position(|w| w == b"\r\n\r\n") {
        Some(at) => answer[at + 4..].to_vec(),
        None => Vec::new(),
    };
    (status, body)
}

fn get(target: &[u8]) -> Vec<u8> {
    let mut request = b"GET ".to_vec();
    request.extend_from_slice(target);
    request.extend_from_slice(b" HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
    request
}

/// The error shape of docs/api.md: `{"code": ..., "message": ...}`.
fn error_body(body: &[u8]) -> (String, String) {
    let value: Value = serde_json::from_slice(body).unwrap_or_else(|e| {
        panic!(
            "not the API's error shape ({e}): {:?}",
            String::from_utf8_lossy(body)
        )
    });
    (
        value["code"].as_str().expect("a code").to_owned(),
        value["message"].as_str().expect("a message").to_owned(),
    )
}

fn refusal<T: std::fmt::Debug>(result: Result<T, ApiError>) -> (u16, String, String) {
    match result {
        Err(ApiError::Api { status, body }) => (status, format!("{:?}", body.code), body.message),
        other => panic!("expected a refusal, got {other:?}"),
    }
}

async fn started_node() -> Node {
    require_private_mount_namespace();
    let mut node = Node::new("vol1:1M");
    node.log_format = Some("human");
    node.start(None).await;
    node.wait_recovered().await;
    node
}

#[tokio::test]
async fn empty_and_oversized_ids_in_a_publish_are_refused_naming_the_field() {
    let node = started_node().await;
    let before = footprint(&node);
    let long = "v".repeat(10 * 1024);
    let cases: Vec<(&str, String, u16, String)> = vec![
        ("volume_id", String::new(), 400, "volume_id is empty".into()),
        (
            "volume_id",
            long.clone(),
            400,
            "volume_id is 10240 bytes long: at most 128".into(),
        ),
        ("workload", String::new(), 400, "workload is empty".into()),
        (
            "workload",
            long.clone(),
            400,
            "workload is 10240 bytes long: at most 128".into(),
        ),
        (
            "volume_id",
            "%".repeat(100),
            400,
            "volume_id has too many characters outside [A-Za-z0-9_-]".into(),
        ),
        ("plugin", String::new(), 400, "plugin is empty".into()),
        ("plugin", long.clone(), 404, "unknown plugin type".into()),
        (
            "plugin",
            "../../etc".into(),
            404,
            "unknown plugin type".into(),
        ),
    ];
    for (field, value, status, wanted) in cases {
        let mut request = publish_with_secrets("vol1", "w1");
        match field {
            "volume_id" => request.volume_id = value.clone(),
            "workload" => request.workload = value.clone(),
            _ => request.plugin = value.clone(),
        }
        let (got, code, message) = refusal(node.api().publish(&request).await);
        assert_eq!(got, status, "{field}={:.40?}: {message}", value);
        assert!(message.contains(&wanted), "{field}: {message}");
        assert!(!code.is_empty());
        // An unpublish of the same is refused the same way, and also changes nothing.
        if field != "plugin" {
            let mut request = unpublish_request("vol1", "w1");
            match field {
                "volume_id" => request.volume_id = value.clone(),
                _ => request.workload = value.clone(),
            }
            let (got, _, message) = refusal(node.api().unpublish(&request).await);
            assert_eq!(got, 400, "unpublish {field}: {message}");
            assert!(message.contains(&wanted), "unpublish {field}: {message}");
        }
    }
    assert_eq!(footprint(&node), before, "a refused request left a trace");
    // The daemon serves on.
    node.publish("vol1", "w1").await.unwrap();
}

#[tokio::test]
async fn ids_with_nul_line_breaks_slashes_and_dots_stay_one_encoded_name_and_forge_no_log_line() {
    let node = started_node().await;
    let outside = node.root.path().join("work/../escaped");
    let hostile = [
        "a\0b",
        "evil\nFORGED-LINE level=ERROR the daemon was compromised",
        "cr\rFORGED-CR",
        "/",
        "..",
        "../../escaped",
        "a/../../b",
        "%2F",
        "%2E%2E",
    ];
    for id in hostile {
        // The test plugin knows none of them: the publish fails at the plugin, cleanly.
        let (status, code, message) = refusal(node.publish(id, "w1").await);
        assert!(status >= 400, "{id:?}: {status} {message}");
        assert!(!code.is_empty() && !message.is_empty(), "{id:?}");
        // What the failed publish began is undone in the background (the plugin does not
        // know the volume either way): soon nothing is left of it.
        eventually(
            &format!("{id:?} to be forgotten"),
            Duration::from_secs(20),
            || async {
                match node.api().volume(PLUGIN, id).await {
                    Err(ApiError::Api { status: 404, .. }) => Ok(()),
                    other => Err(format!("{other:?}")),
                }
            },
        )
        .await;
    }
    assert!(!outside.exists());
    let work = tree(&node.work);
    for path in &work {
        // Every name the daemon made is one component, and decodes if it is an id.
        let name = path.file_name().unwrap().to_string_lossy();
        assert!(!name.contains('\n') && !name.contains('\0') && name != "..");
    }
    // Forgetting is a progress note, committed within 500 ms.
    eventually("no row left", Duration::from_secs(5), || async {
        let rows = csi_agent::store::db::dump(&node.work).unwrap();
        if rows.is_empty() {
            Ok(())
        } else {
            Err(format!("rows left: {rows:?}"))
        }
    })
    .await;
    // The line break was logged, escaped: no line of the log starts with the forged text.
    let log = node.log_text();
    assert!(
        log.contains("evil\\nFORGED-LINE"),
        "the hostile id was never logged: {log}"
    );
    for line in log.lines() {
        assert!(
            !line.starts_with("FORGED") && !line.contains("\rFORGED"),
            "a forged log line: {line:?}"
        );
    }
}

#[tokio::test]
async fn urls_that_are_not_utf8_and_bodies_over_the_limit_get_the_error_shape() {
    let node = started_node().await;
    node.publish("vol1", "w1").await.unwrap();
    let before = footprint(&node);

    // Ids in the URL path that are not UTF-8 once percent-decoded.
    for (target, field) in [
        (&b"/v1/volumes/org.example.test/%FF%FE"[..], "volume_id"),
        (b"/v1/volumes/%C3%28/vol1", "plugin"),
        (b"/v1/plugins/%FF", "type"),
        (b"/v1/plugins/%FF/backend-volumes", "type"),
    ] {
        let (status, body) = raw(&node, &get(target));
        assert_eq!(status, 400, "{:?}", String::from_utf8_lossy(&body));
        let (code, message) = error_body(&body);
        assert_eq!(code, "invalid_request", "{message}");
        assert!(
            message.contains(&format!("the {field} in the URL path is not UTF-8")),
            "{message}"
        );
    }
    let (status, body) = raw(&node, &{
        let mut r = b"DELETE /v1/volumes/org.example.test/%FF".to_vec();
        r.extend_from_slice(b" HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
        r
    });
    assert_eq!(status, 400);
    assert!(error_body(&body).1.contains("volume_id in the URL path"));

    // Escaped separators and dots in the URL are one id, not a path: unknown, 404, named.
    for (target, shown) in [
        (
            &b"/v1/volumes/org.example.test/..%2F..%2Fetc"[..],
            "../../etc",
        ),
        (b"/v1/volumes/org.example.test/%2F", "/"),
        (b"/v1/volumes/org.example.test/a%00b", "a\\0b"),
        (b"/v1/volumes/org.example.test/a%0AFORGED", "a\\nFORGED"),
    ] {
        let (status, body) = raw(&node, &get(target));
        assert_eq!(status, 404, "{:?}", String::from_utf8_lossy(&body));
        let (code, message) = error_body(&body);
        assert_eq!(code, "not_found", "{message}");
        assert!(
            message.contains(&format!("no volume \"{shown}\"")),
            "{message}"
        );
    }
    // A 10 KiB id in the URL is refused for its length before any lookup.
    let long = format!("/v1/volumes/org.example.test/{}", "v".repeat(10 * 1024));
    let (status, body) = raw(&node, &get(long.as_bytes()));
    assert_eq!(status, 400);
    assert!(
        error_body(&body)
            .1
            .contains("volume_id is 10240 bytes long"),
        "{:?}",
        String::from_utf8_lossy(&body)
    );

    // A publish body over the 1 MiB limit: 413 in the error shape, nothing done.
    let mut big = publish_with_secrets("vol1", "w2");
    big.volume_context = Some([("pad".to_owned(), "x".repeat(2 << 20))].into());
    let body = serde_json::to_vec(&big).unwrap();
    let mut request = format!(
        "POST /v1/volumes/publish HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    )
    .into_bytes();
    request.extend_from_slice(&body);
    let (status, answer) = raw(&node, &request);
    assert_eq!(status, 413, "{:?}", String::from_utf8_lossy(&answer));
    let (_, message) = error_body(&answer);
    assert!(message.contains("1048576"), "{message}");

    assert_eq!(footprint(&node), before, "a refused request left a trace");
    let vol1 = node.api().volume(PLUGIN, "vol1").await.unwrap();
    assert_eq!(vol1.claims, vec!["w1".to_owned()]);
}
