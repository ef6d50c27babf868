//! Test support: a hostile registry on loopback (plain HTTP, one thread per connection)
//! speaking just enough of the distribution API: `/v2/`, a token realm, manifests and blobs.
//! It serves a well-behaved image, `csi/good:v1`, from an OCI layout the test wrote, and a
//! hostile one, `csi/bad:v1`, as its [`Hostility`] says: endless answers (manifest, 404 body,
//! `/v2/`, token), a fresh refused layer per manifest request, or a layer trickled one byte
//! at a time. It counts what it sent.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use super::{Entry, Image, layer_tar_gz, sha256_hex};

/// What `csi/bad:v1` (and, for the first two, the whole registry) does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Hostility {
    /// `/v2/` answers 200 with a body that never ends.
    EndlessPing,
    /// `/v2/` asks for a bearer token from this registry's `/token`, which answers 200 with a
    /// body that never ends.
    EndlessToken,
    /// The manifest: 200 and a body that never ends.
    EndlessManifest,
    /// The manifest: 404 and a body that never ends.
    Endless404,
    /// Each manifest request names a new layer, never seen before, whose tar has a `../`
    /// entry (refused when unpacked).
    FreshEscapingLayer,
    /// Each manifest request names a new layer, served with one byte changed (refused by its
    /// digest).
    FreshMismatchingLayer,
    /// Each manifest request names a new valid image whose layer is sent one byte per this
    /// interval, with its true `Content-Length`: never idle long enough to trip a stall
    /// bound longer than the interval. `trickled` counts the bytes sent so.
    TrickleLayer(std::time::Duration),
}

/// The registry; stopped (its listener closed, endless answers cut) on drop.
#[derive(Debug)]
pub struct HostileRegistry {
    pub port: u16,
    /// Bytes written in endless answers so far (all connections).
    pub endless_bytes: Arc<AtomicU64>,
    /// Manifest requests for `csi/bad`.
    pub bad_manifests: Arc<AtomicUsize>,
    /// Bytes of trickled layers sent so far ([`Hostility::TrickleLayer`]).
    pub trickled: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
}

struct Shared {
    good: HashMap<String, (String, Vec<u8>)>,
    good_manifest_hex: String,
    /// Blobs of the fresh bad images: path → body.
    bad_blobs: Mutex<HashMap<String, Vec<u8>>>,
    hostility: Hostility,
    port: u16,
    endless_bytes: Arc<AtomicU64>,
    bad_manifests: Arc<AtomicUsize>,
    trickled: Arc<AtomicU64>,
    /// The paths of the layers to trickle.
    trickle_paths: Mutex<std::collections::HashSet<String>>,
    stop: Arc<AtomicBool>,
    counter: AtomicU64,
}

impl HostileRegistry {
    /// Serves `good` (an OCI layout at `layout` written by [`super::oci_layout`]) as
    /// `csi/good:v1`, and `csi/bad:v1` as `hostility` says.
    pub fn start(layout: &std::path::Path, good: &Image, hostility: Hostility) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let blob = |hex: &str| std::fs::read(layout.join("blobs/sha256").join(hex)).unwrap();
        let mut map = HashMap::new();
        let manifest = blob(&good.manifest_hex);
        let manifest_type = "application/vnd.oci.image.manifest.v1+json".to_owned();
        map.insert(
            "/v2/csi/good/manifests/v1".to_owned(),
            (manifest_type.clone(), manifest.clone()),
        );
        map.insert(
            format!("/v2/csi/good/manifests/sha256:{}", good.manifest_hex),
            (manifest_type, manifest),
        );
        for hex in good.layer_hexes.iter().chain([&good.config_hex]) {
            map.insert(
                format!("/v2/csi/good/blobs/sha256:{hex}"),
                ("application/octet-stream".to_owned(), blob(hex)),
            );
        }
        let (endless_bytes, bad_manifests, stop) = (
            Arc::new(AtomicU64::new(0)),
            Arc::new(AtomicUsize::new(0)),
            Arc::new(AtomicBool::new(false)),
        );
        let trickled = Arc::new(AtomicU64::new(0));
        let shared = Arc::new(Shared {
            good: map,
            good_manifest_hex: good.manifest_hex.clone(),
            bad_blobs: Mutex::new(HashMap::new()),
            hostility,
            port,
            endless_bytes: Arc::clone(&endless_bytes),
            bad_manifests: Arc::clone(&bad_manifests),
            trickled: Arc::clone(&trickled),
            trickle_paths: Mutex::default(),
            stop: Arc::clone(&stop),
            counter: AtomicU64::new(0),
        });
        listener.set_nonblocking(true).unwrap();
        std::thread::spawn(move || {
            while !shared.stop.load(Ordering::SeqCst) {
                match listener.accept() {
                    Ok((conn, _)) => {
                        conn.set_nonblocking(false).unwrap();
                        let shared = Arc::clone(&shared);
                        std::thread::spawn(move || serve(&shared, conn));
                    }
                    Err(_) => std::thread::sleep(std::time::Duration::from_millis(5)),
                }
            }
        });
        Self {
            port,
            endless_bytes,
            bad_manifests,
            trickled,
            stop,
        }
    }

    /// `127.0.0.1:PORT`.
    pub fn host(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }
}

impl Drop for HostileRegistry {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
    }
}

/// Answers the requests of one connection (keep-alive) until it closes.
fn serve(shared: &Shared, conn: TcpStream) {
    let mut reader = BufReader::new(conn.try_clone().unwrap());
    let mut conn = conn;
    loop {
        let mut line = String::new();
        if reader.read_line(&mut line).unwrap_or(0) == 0 {
            return;
        }
        let mut words = line.split_whitespace();
        let (method, path) = (
            words.next().unwrap_or("").to_owned(),
            words.next().unwrap_or("").to_owned(),
        );
        // The rest of the head (requests have no bodies here).
        loop {
            let mut header = String::new();
            if reader.read_line(&mut header).unwrap_or(0) == 0 {
                return;
            }
            if header == "\r\n" {
                break;
            }
        }
        let path_only = path.split('?').next().unwrap_or("").to_owned();
        if !answer(shared, &mut conn, &method, &path_only) {
            return;
        }
    }
}

fn reply(conn: &mut TcpStream, method: &str, status: &str, headers: &str, body: &[u8]) -> bool {
    let head = format!(
        "HTTP/1.1 {status}\r\nContent-Length: {}\r\nDocker-Distribution-API-Version: registry/2.0\r\n{headers}\r\n",
        body.len()
    );
    let mut bytes = head.into_bytes();
    if method != "HEAD" {
        bytes.extend_from_slice(body);
    }
    conn.write_all(&bytes).is_ok()
}

/// A body that never ends (no length, `Connection: close`): writes until the client goes
/// away or the registry stops. Returns false (the connection is done).
fn endless(shared: &Shared, conn: &mut TcpStream, status: &str, content_type: &str) -> bool {
    let head = format!(
        "HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nConnection: close\r\nDocker-Distribution-API-Version: registry/2.0\r\n\r\n{{\"errors\": [{{\"code\": \"x\", \"message\": \""
    );
    if conn.write_all(head.as_bytes()).is_err() {
        return false;
    }
    let chunk = vec![b'a'; 64 << 10];
    while !shared.stop.load(Ordering::SeqCst) {
        if conn.write_all(&chunk).is_err() {
            break;
        }
        shared
            .endless_bytes
            .fetch_add(chunk.len() as u64, Ordering::SeqCst);
    }
    false
}

fn answer(shared: &Shared, conn: &mut TcpStream, method: &str, path: &str) -> bool {
    let json = "Content-Type: application/json\r\n";
    if path == "/v2/" {
        return match shared.hostility {
            Hostility::EndlessPing => endless(shared, conn, "200 OK", "application/json"),
            Hostility::EndlessToken => reply(
                conn,
                method,
                "401 Unauthorized",
                &format!(
                    "{json}WWW-Authenticate: Bearer realm=\"http://127.0.0.1:{}/token\",service=\"hostile\"\r\n",
                    shared.port
                ),
                b"{}",
            ),
            _ => reply(conn, method, "200 OK", json, b"{}"),
        };
    }
    if path == "/token" {
        return endless(shared, conn, "200 OK", "application/json");
    }
    if let Some((content_type, body)) = shared.good.get(path) {
        let digest = if path.contains("/manifests/") {
            format!(
                "Docker-Content-Digest: sha256:{}\r\n",
                shared.good_manifest_hex
            )
        } else {
            String::new()
        };
        return reply(
            conn,
            method,
            "200 OK",
            &format!("Content-Type: {content_type}\r\n{digest}"),
            body,
        );
    }
    if path == "/v2/csi/bad/manifests/v1" {
        shared.bad_manifests.fetch_add(1, Ordering::SeqCst);
        match shared.hostility {
            Hostility::EndlessManifest => {
                return endless(
                    shared,
                    conn,
                    "200 OK",
                    "application/vnd.oci.image.manifest.v1+json",
                );
            }
            Hostility::Endless404 => {
                return endless(shared, conn, "404 Not Found", "application/json");
            }
            Hostility::FreshEscapingLayer
            | Hostility::FreshMismatchingLayer
            | Hostility::TrickleLayer(_) => {
                let manifest = fresh_bad_image(shared);
                return reply(
                    conn,
                    method,
                    "200 OK",
                    "Content-Type: application/vnd.oci.image.manifest.v1+json\r\n",
                    &manifest,
                );
            }
            Hostility::EndlessPing | Hostility::EndlessToken => {}
        }
    }
    // Not in the `if let`: its lock would be held for the whole answer (a trickle's too).
    let bad = shared.bad_blobs.lock().unwrap().get(path).cloned();
    if let Some(body) = bad {
        if let Hostility::TrickleLayer(every) = shared.hostility
            && shared.trickle_paths.lock().unwrap().contains(path)
        {
            return trickle(shared, conn, method, &body, every);
        }
        return reply(
            conn,
            method,
            "200 OK",
            "Content-Type: application/octet-stream\r\n",
            &body,
        );
    }
    reply(
        conn,
        method,
        "404 Not Found",
        json,
        br#"{"errors": [{"code": "MANIFEST_UNKNOWN", "message": "unknown"}]}"#,
    )
}

/// Sends `body` one byte per `every` after a true head; stops when the client goes away or
/// the registry stops. Returns false (the connection is done).
fn trickle(
    shared: &Shared,
    conn: &mut TcpStream,
    method: &str,
    body: &[u8],
    every: std::time::Duration,
) -> bool {
    if !reply(
        conn,
        "HEAD",
        "200 OK",
        "Content-Type: application/octet-stream\r\n",
        body,
    ) || method == "HEAD"
    {
        return false;
    }
    for byte in body {
        if shared.stop.load(Ordering::SeqCst) || conn.write_all(&[*byte]).is_err() {
            return false;
        }
        shared.trickled.fetch_add(1, Ordering::SeqCst);
        let until = std::time::Instant::now() + every;
        while std::time::Instant::now() < until && !shared.stop.load(Ordering::SeqCst) {
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
    }
    false
}

/// A new bad image: its own config (a counter in it) and one layer never served before;
/// registers their blobs and returns the manifest.
fn fresh_bad_image(shared: &Shared) -> Vec<u8> {
    let n = shared.counter.fetch_add(1, Ordering::SeqCst);
    let unique = format!("fresh layer {n} {:?}\n", std::time::SystemTime::now());
    let layer = match shared.hostility {
        Hostility::FreshEscapingLayer => layer_tar_gz(&[
            Entry::File {
                path: "ok",
                data: unique.as_bytes(),
                mode: 0o644,
            },
            Entry::RawName {
                name: "../escaped",
                data: b"out of the root\n",
            },
        ]),
        _ => layer_tar_gz(&[Entry::File {
            path: "ok",
            data: unique.as_bytes(),
            mode: 0o644,
        }]),
    };
    let layer_hex = sha256_hex(&layer);
    let mut served = layer.clone();
    if shared.hostility == Hostility::FreshMismatchingLayer {
        let last = served.len() - 1;
        served[last] ^= 0xff;
    }
    let config = serde_json::to_vec(&serde_json::json!({
        "architecture": "amd64", "os": "linux",
        "config": {"Cmd": ["/ok"], "Env": [format!("N={n}")]},
        "rootfs": {"type": "layers", "diff_ids": [format!("sha256:{}", sha256_hex(b"unchecked"))]},
    }))
    .unwrap();
    let config_hex = sha256_hex(&config);
    {
        let mut blobs = shared.bad_blobs.lock().unwrap();
        blobs.insert(format!("/v2/csi/bad/blobs/sha256:{layer_hex}"), served);
        if let Hostility::TrickleLayer(_) = shared.hostility {
            shared
                .trickle_paths
                .lock()
                .unwrap()
                .insert(format!("/v2/csi/bad/blobs/sha256:{layer_hex}"));
        }
        blobs.insert(
            format!("/v2/csi/bad/blobs/sha256:{config_hex}"),
            config.clone(),
        );
    }
    serde_json::to_vec(&serde_json::json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                   "digest": format!("sha256:{config_hex}"), "size": config.len()},
        "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip",
                    "digest": format!("sha256:{layer_hex}"), "size": layer.len()}],
    }))
    .unwrap()
}

/// Every file under `dir` (relative paths, sorted), with its size: a store's listing to
/// compare before and after.
pub fn listing(dir: &std::path::Path) -> Vec<(PathBuf, u64)> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(at) = stack.pop() {
        for entry in std::fs::read_dir(&at).unwrap() {
            let entry = entry.unwrap();
            let meta = entry.metadata().unwrap();
            let rel = entry.path().strip_prefix(dir).unwrap().to_path_buf();
            if meta.is_dir() {
                stack.push(entry.path());
                out.push((rel, 0));
            } else {
                out.push((rel, meta.len()));
            }
        }
    }
    out.sort();
    out
}
