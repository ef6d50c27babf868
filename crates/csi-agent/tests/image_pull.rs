//! Pulling from a real registry (`docker-registry` on loopback, images built here and pushed
//! with `skopeo`): blobs verified and stored once, and each failure typed.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;
use std::time::Duration;

use csi_agent::image::blobs::{BlobStore, Digest};
use csi_agent::image::pull::{PullError, PullLimits, Puller};
use csi_agent::image::reference::{ImageRef, RegistrySettings};
use csi_agent_testkit::registry::*;

fn puller(registry: &Registry) -> Puller {
    let settings = loopback_registry(&registry.host());
    let limits = PullLimits {
        connect_timeout: Duration::from_secs(2),
        read_timeout: Duration::from_secs(5),
        manifest_timeout: Duration::from_secs(10),
        ..PullLimits::default()
    };
    Puller::new(settings, limits)
}

fn simple_image(dir: &std::path::Path) -> Image {
    let layer1 = layer_tar_gz(&[
        Entry::Dir { path: "bin" },
        Entry::File {
            path: "bin/plugin",
            data: b"#!/bin/sh\necho plugin\n",
            mode: 0o755,
        },
    ]);
    let layer2 = layer_tar_gz(&[Entry::File {
        path: "etc/motd",
        data: b"hello from layer 2\n",
        mode: 0o644,
    }]);
    oci_layout(
        dir,
        &[layer1, layer2],
        serde_json::json!({"Entrypoint": ["/bin/plugin"], "Env": ["A=1"]}),
    )
    .unwrap()
}

fn digest(hex: &str) -> Digest {
    Digest::parse(&format!("sha256:{hex}")).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pull_verifies_stores_and_never_downloads_twice() {
    let tmp = tempfile::tempdir().unwrap();
    let registry = Registry::start(&tmp.path().join("registry")).unwrap();
    let image = simple_image(&tmp.path().join("layout"));
    push(&tmp.path().join("layout"), &registry, "csi/plugin:v1").unwrap();
    let store = Arc::new(BlobStore::open(&tmp.path().join("store")).unwrap());
    let puller = puller(&registry);

    // A short name resolves against the default registry (here the loopback one).
    let reference = ImageRef::parse("csi/plugin:v1", &registry.host()).unwrap();
    let gets_before = registry.blob_gets(None);
    let pulled = puller.pull(&reference, &store).await.unwrap();
    assert_eq!(pulled.manifest.hex(), image.manifest_hex);
    assert_eq!(pulled.config.digest.hex(), image.config_hex);
    let layers: Vec<&str> = pulled.layers.iter().map(|l| l.blob.digest.hex()).collect();
    assert_eq!(layers, image.layer_hexes);
    assert_eq!(pulled.downloaded.len(), 3, "config and two layers");
    for hex in image.layer_hexes.iter().chain([&image.config_hex]) {
        assert!(store.contains(&digest(hex)).unwrap(), "{hex} not stored");
        let stored = std::fs::read(store.path_of(&digest(hex))).unwrap();
        assert_eq!(sha256_hex(&stored), *hex);
    }
    assert_eq!(registry.blob_gets(None) - gets_before, 3);

    // Again: the manifest is re-read (the tag may have moved), no blob is.
    let gets_before = registry.blob_gets(None);
    let again = puller.pull(&reference, &store).await.unwrap();
    assert_eq!(again.manifest, pulled.manifest);
    assert!(again.downloaded.is_empty(), "{:?}", again.downloaded);
    assert_eq!(
        registry.blob_gets(None),
        gets_before,
        "a blob was downloaded again"
    );

    // By digest too.
    let pinned = ImageRef::parse(
        &format!(
            "{}/csi/plugin@sha256:{}",
            registry.host(),
            image.manifest_hex
        ),
        "unused.example",
    )
    .unwrap();
    let by_digest = puller.pull(&pinned, &store).await.unwrap();
    assert_eq!(by_digest.manifest, pulled.manifest);
    assert!(by_digest.downloaded.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_tag_or_repository_is_not_found() {
    let tmp = tempfile::tempdir().unwrap();
    let registry = Registry::start(&tmp.path().join("registry")).unwrap();
    simple_image(&tmp.path().join("layout"));
    push(&tmp.path().join("layout"), &registry, "csi/plugin:v1").unwrap();
    let store = Arc::new(BlobStore::open(&tmp.path().join("store")).unwrap());
    let puller = puller(&registry);
    for name in ["csi/plugin:nope", "csi/nothing:v1"] {
        let reference = ImageRef::parse(name, &registry.host()).unwrap();
        let err = puller.pull(&reference, &store).await.unwrap_err();
        assert!(matches!(err, PullError::NotFound { .. }), "{name}: {err:?}");
        assert!(!err.is_transient());
        assert!(std::error::Error::source(&err).is_some());
    }
    // A digest nobody pushed.
    let reference = ImageRef::parse(
        &format!("csi/plugin@sha256:{}", "0".repeat(64)),
        &registry.host(),
    )
    .unwrap();
    let err = puller.pull(&reference, &store).await.unwrap_err();
    assert!(matches!(err, PullError::NotFound { .. }), "{err:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_registry_is_unreachable_and_transient() {
    let tmp = tempfile::tempdir().unwrap();
    let mut registry = Registry::start(&tmp.path().join("registry")).unwrap();
    simple_image(&tmp.path().join("layout"));
    push(&tmp.path().join("layout"), &registry, "csi/plugin:v1").unwrap();
    let store = Arc::new(BlobStore::open(&tmp.path().join("store")).unwrap());
    let puller = puller(&registry);
    let reference = ImageRef::parse("csi/plugin:v1", &registry.host()).unwrap();
    registry.stop();
    let err = puller.pull(&reference, &store).await.unwrap_err();
    assert!(matches!(err, PullError::Unreachable { .. }), "{err:?}");
    assert!(err.is_transient());
    // Back: the same puller succeeds.
    registry.restart().unwrap();
    puller.pull(&reference, &store).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_blob_not_matching_its_digest_is_refused_and_not_stored() {
    let tmp = tempfile::tempdir().unwrap();
    let registry = Registry::start(&tmp.path().join("registry")).unwrap();
    let image = simple_image(&tmp.path().join("layout"));
    push(&tmp.path().join("layout"), &registry, "csi/plugin:v1").unwrap();
    // Tamper with the second layer in the registry's storage: same size, other bytes.
    let data = registry.blob_data_path(&image.layer_hexes[1]);
    let mut bytes = std::fs::read(&data).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 0xff;
    std::fs::write(&data, &bytes).unwrap();

    let store = Arc::new(BlobStore::open(&tmp.path().join("store")).unwrap());
    let reference = ImageRef::parse("csi/plugin:v1", &registry.host()).unwrap();
    let err = puller(&registry)
        .pull(&reference, &store)
        .await
        .unwrap_err();
    assert!(
        matches!(err, PullError::DigestMismatch { ref expected, .. } if expected.contains(&image.layer_hexes[1])),
        "{err:?}"
    );
    assert!(!err.is_transient());
    assert!(!store.contains(&digest(&image.layer_hexes[1])).unwrap());
    // Nothing at all under that name, not even a temp file left behind.
    let names: Vec<String> = std::fs::read_dir(tmp.path().join("store/blobs/sha256"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert!(
        names.iter().all(|n| !n.contains(&image.layer_hexes[1])),
        "{names:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn limits_refuse_before_downloading() {
    let tmp = tempfile::tempdir().unwrap();
    let registry = Registry::start(&tmp.path().join("registry")).unwrap();
    simple_image(&tmp.path().join("layout"));
    push(&tmp.path().join("layout"), &registry, "csi/plugin:v1").unwrap();
    let store = Arc::new(BlobStore::open(&tmp.path().join("store")).unwrap());
    let reference = ImageRef::parse("csi/plugin:v1", &registry.host()).unwrap();
    let settings = RegistrySettings {
        insecure: vec![registry.host()],
        ..RegistrySettings::default()
    };
    for (limits, what) in [
        (
            PullLimits {
                max_layers: 1,
                ..PullLimits::default()
            },
            "the number of layers",
        ),
        (
            PullLimits {
                max_total_bytes: 10,
                ..PullLimits::default()
            },
            "the sum of the layer sizes",
        ),
        (
            PullLimits {
                max_manifest_bytes: 100,
                ..PullLimits::default()
            },
            "the manifest",
        ),
    ] {
        let gets = registry.blob_gets(None);
        let err = Puller::new(settings.clone(), limits)
            .pull(&reference, &store)
            .await
            .unwrap_err();
        // The manifest is read under its cap (issue #23): over it, the answer is refused as
        // too large, with the registry named; the declared sizes are limits.
        assert!(
            matches!(&err, PullError::Limit { what: w, .. } if *w == what)
                || matches!(&err, PullError::AnswerTooLarge { what: w, max: 100, .. } if w == what),
            "{what}: {err:?}"
        );
        assert!(!err.is_transient(), "{what}: {err}");
        assert_eq!(registry.blob_gets(None), gets, "{what}: a blob was fetched");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn https_is_required_for_registries_not_named_insecure() {
    let tmp = tempfile::tempdir().unwrap();
    let registry = Registry::start(&tmp.path().join("registry")).unwrap();
    simple_image(&tmp.path().join("layout"));
    push(&tmp.path().join("layout"), &registry, "csi/plugin:v1").unwrap();
    let store = Arc::new(BlobStore::open(&tmp.path().join("store")).unwrap());
    let reference = ImageRef::parse("csi/plugin:v1", &registry.host()).unwrap();
    // Not in the insecure list: TLS to a plain HTTP server fails, nothing is fetched.
    let puller = Puller::new(RegistrySettings::docker_hub(), PullLimits::default());
    let err = puller.pull(&reference, &store).await.unwrap_err();
    assert!(matches!(err, PullError::Unreachable { .. }), "{err:?}");
    assert_eq!(registry.blob_gets(None), 0);
}

/// What the stalling registry does when asked for the layer blob.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum LayerAnswer {
    /// Headers (the whole length announced) and the first half of the body, then nothing,
    /// the connection kept open.
    StallMidBody,
    /// Reads the request and never answers, the connection kept open.
    StallBeforeHeaders,
    /// The whole blob.
    Whole,
}

/// A registry on loopback (plain HTTP, so an insecure one) serving one image,
/// `csi/plugin:v1`, from the OCI layout `layout`: `/v2/`, the manifest and the config as a
/// registry does, the layer as `answer` says. Counts the layer's requests.
struct StallingRegistry {
    port: u16,
    answer: Arc<std::sync::Mutex<LayerAnswer>>,
    layer_requests: Arc<std::sync::atomic::AtomicUsize>,
    task: tokio::task::JoinHandle<()>,
}

impl StallingRegistry {
    async fn start(layout: &std::path::Path, image: &Image) -> Self {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let blob = |hex: &str| std::fs::read(layout.join("blobs/sha256").join(hex)).unwrap();
        let manifest = blob(&image.manifest_hex);
        let config = blob(&image.config_hex);
        assert_eq!(image.layer_hexes.len(), 1, "one layer");
        let layer = blob(&image.layer_hexes[0]);
        let (manifest_hex, config_hex, layer_hex) = (
            image.manifest_hex.clone(),
            image.config_hex.clone(),
            image.layer_hexes[0].clone(),
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let answer = Arc::new(std::sync::Mutex::new(LayerAnswer::Whole));
        let layer_requests = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let (shared_answer, shared_requests) = (Arc::clone(&answer), Arc::clone(&layer_requests));
        let task = tokio::spawn(async move {
            loop {
                let Ok((mut conn, _)) = listener.accept().await else {
                    return;
                };
                let (manifest, config, layer) = (manifest.clone(), config.clone(), layer.clone());
                let (manifest_hex, config_hex, layer_hex) =
                    (manifest_hex.clone(), config_hex.clone(), layer_hex.clone());
                let (answer, requests) = (Arc::clone(&shared_answer), Arc::clone(&shared_requests));
                tokio::spawn(async move {
                    // One request per connection: read its head, answer, close (or stall).
                    let mut head = Vec::new();
                    let mut byte = [0u8; 1];
                    while !head.ends_with(b"\r\n\r\n") {
                        if conn.read(&mut byte).await.unwrap_or(0) == 0 {
                            return;
                        }
                        head.push(byte[0]);
                    }
                    let head = String::from_utf8_lossy(&head).into_owned();
                    let mut words = head.split_whitespace();
                    let (method, path) = (words.next().unwrap_or(""), words.next().unwrap_or(""));
                    let ok = |content_type: &str, body: &[u8], digest: Option<&str>| {
                        let mut text = format!(
                            "HTTP/1.1 200 OK\r\nContent-Type: {content_type}\r\n\
                             Content-Length: {}\r\nConnection: close\r\n\
                             Docker-Distribution-API-Version: registry/2.0\r\n",
                            body.len()
                        );
                        if let Some(digest) = digest {
                            text.push_str(&format!("Docker-Content-Digest: {digest}\r\n"));
                        }
                        text.push_str("\r\n");
                        let mut bytes = text.into_bytes();
                        if method != "HEAD" {
                            bytes.extend_from_slice(body);
                        }
                        bytes
                    };
                    let reply = if path == "/v2/" {
                        ok("application/json", b"{}", None)
                    } else if path == "/v2/csi/plugin/manifests/v1"
                        || path == format!("/v2/csi/plugin/manifests/sha256:{manifest_hex}")
                    {
                        ok(
                            "application/vnd.oci.image.manifest.v1+json",
                            &manifest,
                            Some(&format!("sha256:{manifest_hex}")),
                        )
                    } else if path == format!("/v2/csi/plugin/blobs/sha256:{config_hex}") {
                        ok("application/octet-stream", &config, None)
                    } else if path == format!("/v2/csi/plugin/blobs/sha256:{layer_hex}") {
                        requests.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                        let whole = ok("application/octet-stream", &layer, None);
                        let mode = *answer.lock().unwrap();
                        match mode {
                            LayerAnswer::Whole => whole,
                            LayerAnswer::StallMidBody => {
                                // Everything up to half the body, then silence.
                                let cut = whole.len() - layer.len() / 2;
                                let _ = conn.write_all(&whole[..cut]).await;
                                let _ = conn.flush().await;
                                std::future::pending::<()>().await;
                                return;
                            }
                            LayerAnswer::StallBeforeHeaders => {
                                std::future::pending::<()>().await;
                                return;
                            }
                        }
                    } else {
                        b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
                            .to_vec()
                    };
                    let _ = conn.write_all(&reply).await;
                    let _ = conn.shutdown().await;
                });
            }
        });
        Self {
            port,
            answer,
            layer_requests,
            task,
        }
    }

    fn host(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    fn answer(&self, answer: LayerAnswer) {
        *self.answer.lock().unwrap() = answer;
    }
}

impl Drop for StallingRegistry {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Issue #13: a registry that stalls, mid-body or before its headers, fails the pull within
/// `read_timeout` (not the 2 min blob deadline), as a transient error naming the blob and the
/// registry; no partial blob is left in the store, nothing is indexed; and once the registry
/// answers again, the same store pulls the image.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_registry_stalling_mid_blob_fails_the_pull_within_the_read_timeout() {
    use csi_agent::image::store::{
        Composition, ImageStore, ImageStoreError, PreparedRoot, PullPolicy,
    };
    let tmp = tempfile::tempdir().unwrap();
    // A layer of a few hundred KiB that gzip cannot shrink: half of it is a real part.
    let mut noise = Vec::with_capacity(300 << 10);
    let mut x: u32 = 0x9e37_79b9;
    while noise.len() < 300 << 10 {
        x ^= x << 13;
        x ^= x >> 17;
        x ^= x << 5;
        noise.extend_from_slice(&x.to_le_bytes());
    }
    let layer = layer_tar_gz(&[Entry::File {
        path: "data/noise",
        data: &noise,
        mode: 0o644,
    }]);
    let layout = tmp.path().join("layout");
    let image = oci_layout(&layout, &[layer], serde_json::json!({"Cmd": ["/x"]})).unwrap();
    let layer_digest = format!("sha256:{}", image.layer_hexes[0]);
    let registry = StallingRegistry::start(&layout, &image).await;
    let read_timeout = Duration::from_secs(1);
    for stall in [LayerAnswer::StallMidBody, LayerAnswer::StallBeforeHeaders] {
        registry.answer(stall);
        let settings = loopback_registry(&registry.host());
        let limits = PullLimits {
            connect_timeout: Duration::from_secs(2),
            read_timeout,
            manifest_timeout: Duration::from_secs(10),
            // Far longer: only the read timeout may end the stalled download.
            blob_timeout: Duration::from_secs(120),
            total_timeout: Duration::from_secs(300),
            ..PullLimits::default()
        };
        let dir = tmp.path().join(format!("store-{stall:?}"));
        let store = ImageStore::open(
            &dir,
            Puller::new(settings, limits),
            Some(Composition::Flattened),
        )
        .unwrap();
        let reference = store.resolve("csi/plugin:v1").unwrap();
        let requests = registry
            .layer_requests
            .load(std::sync::atomic::Ordering::SeqCst);
        let started = std::time::Instant::now();
        let err = store
            .ensure(&reference, PullPolicy::IfMissing)
            .await
            .unwrap_err();
        let took = started.elapsed();
        assert!(
            took >= read_timeout && took < read_timeout + Duration::from_secs(5),
            "{stall:?}: failed after {took:?}: {err}"
        );
        // Typed, transient, naming the blob and the registry.
        let ImageStoreError::Pull(pull) = &err else {
            panic!("{stall:?}: {err:?}");
        };
        assert!(
            matches!(pull, PullError::Stalled { blob, registry: r, after, .. }
                if *blob == layer_digest && *r == registry.host() && *after == read_timeout),
            "{stall:?}: {pull:?}"
        );
        assert!(err.is_transient(), "{stall:?}: {err}");
        let text = err.to_string();
        assert!(
            text.contains(&layer_digest) && text.contains(&registry.host()),
            "{stall:?}: {text}"
        );
        assert_eq!(
            registry
                .layer_requests
                .load(std::sync::atomic::Ordering::SeqCst)
                - requests,
            1,
            "{stall:?}: asked again"
        );
        // No partial blob: not under its name, no temp file; nothing indexed or prepared.
        let blobs: Vec<String> = std::fs::read_dir(dir.join("blobs/sha256"))
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        // Issue #23: not even the config this failed pull stored stays (nothing indexes it).
        assert!(blobs.is_empty(), "{stall:?}: {blobs:?}");
        assert!(store.list().is_empty(), "{stall:?}");
        assert_eq!(std::fs::read_dir(dir.join("rootfs")).unwrap().count(), 0);

        // The registry healthy again: the same store pulls the image, the layer whole.
        registry.answer(LayerAnswer::Whole);
        let prepared = store
            .ensure(&reference, PullPolicy::IfMissing)
            .await
            .unwrap();
        let stored = std::fs::read(dir.join("blobs/sha256").join(&image.layer_hexes[0])).unwrap();
        assert_eq!(sha256_hex(&stored), image.layer_hexes[0]);
        let PreparedRoot::Flattened(rootfs) = &prepared.root else {
            panic!("{:?}", prepared.root);
        };
        assert_eq!(std::fs::read(rootfs.join("data/noise")).unwrap(), noise);
    }
}
