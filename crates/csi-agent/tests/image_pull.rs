//! Pulling from a real registry (`docker-registry` on loopback, images built here and pushed
//! with `skopeo`): blobs verified and stored once, and each failure typed.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod registry_support;

use std::sync::Arc;
use std::time::Duration;

use csi_agent::image::blobs::{BlobStore, Digest};
use csi_agent::image::pull::{PullError, PullLimits, Puller};
use csi_agent::image::reference::{ImageRef, RegistrySettings};
use registry_support::*;

fn puller(registry: &Registry) -> Puller {
    let settings = RegistrySettings {
        default_registry: registry.host(),
        insecure: vec![registry.host()],
        ..RegistrySettings::default()
    };
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
        assert!(
            matches!(err, PullError::Limit { what: w, .. } if w == what),
            "{what}: {err:?}"
        );
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
