//! Issue #23, items 2 and 5, against a hostile registry on loopback
//! (`csi_agent_testkit::registry::hostile`): every answer bounded before it is buffered (an endless
//! manifest, 404 body, `/v2/` answer or token answer fails the pull at its cap with a final
//! error), and nothing a failed pull fetched outlives it (20 fresh refused layers leave the
//! store as it was; a start sweeps what a crash left unindexed); and item 4: a pull trickled
//! below the throughput floor blocks no other image and fails by the floor.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeSet;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use csi_agent::image::blobs::BlobStore;
use csi_agent::image::pull::{PullError, PullLimits, Puller};
use csi_agent::image::reference::ImageRef;
use csi_agent::image::store::{Composition, ImageStore, ImageStoreError, PullPolicy};
use csi_agent_testkit::registry::hostile::{HostileRegistry, Hostility, listing};
use csi_agent_testkit::registry::*;

fn good_image(dir: &std::path::Path) -> Image {
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
        data: b"hello\n",
        mode: 0o644,
    }]);
    oci_layout(
        dir,
        &[layer1, layer2],
        serde_json::json!({"Cmd": ["/bin/plugin"]}),
    )
    .unwrap()
}

fn limits() -> PullLimits {
    PullLimits {
        connect_timeout: Duration::from_secs(2),
        read_timeout: Duration::from_secs(5),
        manifest_timeout: Duration::from_secs(20),
        ..PullLimits::default()
    }
}

/// Each endless answer fails the pull at its cap, fast, with a final error naming the
/// registry, the reference and the cap; the registry then cannot write any more (the
/// connection was dropped, not drained).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn endless_answers_fail_the_pull_at_their_cap() {
    let tmp = tempfile::tempdir().unwrap();
    let layout = tmp.path().join("layout");
    let good = good_image(&layout);
    let defaults = PullLimits::default();
    for (hostility, name, cap, what) in [
        (
            Hostility::EndlessManifest,
            "csi/bad:v1",
            defaults.max_manifest_bytes,
            "the manifest",
        ),
        (
            Hostility::Endless404,
            "csi/bad:v1",
            defaults.max_error_bytes,
            "an error answer (HTTP 404)",
        ),
        (
            Hostility::EndlessPing,
            "csi/good:v1",
            defaults.max_error_bytes,
            "the /v2/ answer",
        ),
        (
            Hostility::EndlessToken,
            "csi/good:v1",
            defaults.max_token_bytes,
            "the token answer",
        ),
    ] {
        let registry = HostileRegistry::start(&layout, &good, hostility);
        let store = Arc::new(BlobStore::open(&tmp.path().join(format!("{hostility:?}"))).unwrap());
        let reference = ImageRef::parse(name, &registry.host()).unwrap();
        let started = Instant::now();
        let err = Puller::new(loopback_registry(&registry.host()), limits())
            .pull(&reference, &store)
            .await
            .unwrap_err();
        let took = started.elapsed();
        let PullError::AnswerTooLarge {
            registry: r,
            reference: n,
            what: w,
            received,
            max,
        } = &err
        else {
            panic!("{hostility:?}: {err:?}");
        };
        assert_eq!(*r, registry.host(), "{hostility:?}");
        assert_eq!(*n, reference.to_string(), "{hostility:?}");
        assert_eq!(w, what, "{hostility:?}");
        assert_eq!(*max, cap, "{hostility:?}");
        // Refused as soon as the cap was passed: at most one more chunk was read.
        assert!(
            *received > cap && *received <= cap + (1 << 20),
            "{hostility:?}: {received}"
        );
        assert!(
            !err.is_transient(),
            "{hostility:?}: a retry would get the same"
        );
        let text = err.to_string();
        for part in [registry.host(), reference.to_string(), cap.to_string()] {
            assert!(text.contains(&part), "{hostility:?}: {text} lacks {part}");
        }
        assert!(
            took < Duration::from_secs(5),
            "{hostility:?}: took {took:?}"
        );
        // The connection is gone: the registry's writes stop (socket buffers aside).
        tokio::time::sleep(Duration::from_millis(300)).await;
        let sent = registry.endless_bytes.load(Ordering::SeqCst);
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert_eq!(
            registry.endless_bytes.load(Ordering::SeqCst),
            sent,
            "{hostility:?}: still being read"
        );
        assert!(store.list().unwrap().is_empty(), "{hostility:?}");
    }
}

/// A plain-HTTP token realm on a host not in `--insecure-registry` is refused: the
/// credentials a registry would have us send there stay home.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_token_realm_over_plain_http_elsewhere_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let layout = tmp.path().join("layout");
    let good = good_image(&layout);
    let registry = HostileRegistry::start(&layout, &good, Hostility::EndlessToken);
    // The registry reached by its name `localhost:PORT` (insecure), its realm at
    // `127.0.0.1:PORT`, which is not in the insecure list.
    let host = format!("localhost:{}", registry.port);
    let settings = loopback_registry(&host);
    let store = Arc::new(BlobStore::open(&tmp.path().join("store")).unwrap());
    let reference = ImageRef::parse("csi/good:v1", &host).unwrap();
    let err = Puller::new(settings, limits())
        .pull(&reference, &store)
        .await
        .unwrap_err();
    assert!(matches!(err, PullError::AuthRefused { .. }), "{err:?}");
    assert!(err.to_string().contains("only https"), "{err}");
    assert_eq!(registry.endless_bytes.load(Ordering::SeqCst), 0);
}

/// 20 failed pulls of fresh hostile layers (10 whose tar escapes with `../`, refused when
/// unpacked; 10 whose bytes do not match their digest, refused while stored) leave the image
/// store exactly as it was, the good image's files included; and the good image is still
/// usable without the registry.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failed_pulls_of_fresh_hostile_layers_leave_the_store_as_it_was() {
    let tmp = tempfile::tempdir().unwrap();
    let layout = tmp.path().join("layout");
    let good = good_image(&layout);
    for composition in [Composition::Flattened, Composition::Overlay] {
        if composition == Composition::Overlay
            && Composition::detect(&tmp.path().join("probe")).0 != Composition::Overlay
        {
            eprintln!("overlay not usable here (not root?): only the flattened store is checked");
            continue;
        }
        let dir = tmp.path().join(format!("store-{composition:?}"));
        let mut before = None;
        let mut last_host = String::new();
        for hostility in [
            Hostility::FreshEscapingLayer,
            Hostility::FreshMismatchingLayer,
        ] {
            let registry = HostileRegistry::start(&layout, &good, hostility);
            last_host = registry.host();
            let store = ImageStore::open(
                &dir,
                Puller::new(loopback_registry(&registry.host()), limits()),
                Some(composition),
            )
            .unwrap();
            let good_ref = store.resolve("csi/good:v1").unwrap();
            store
                .ensure(&good_ref, PullPolicy::IfMissing)
                .await
                .unwrap();
            // Per registry: each has its own port, so the good image is indexed again under
            // another reference (the same blobs).
            let expected = listing(&dir);
            before = Some(expected.clone());
            let bad_ref = store.resolve("csi/bad:v1").unwrap();
            for i in 0..10 {
                let err = store
                    .ensure(&bad_ref, PullPolicy::Always)
                    .await
                    .unwrap_err();
                match hostility {
                    Hostility::FreshEscapingLayer => {
                        assert!(
                            matches!(err, ImageStoreError::Unpack { .. }),
                            "{i}: {err:?}"
                        );
                    }
                    _ => assert!(
                        matches!(err, ImageStoreError::Pull(PullError::DigestMismatch { .. })),
                        "{i}: {err:?}"
                    ),
                }
                assert!(!err.is_transient(), "{i}: {err}");
                assert_eq!(
                    listing(&dir),
                    expected,
                    "{composition:?} {hostility:?} pull {i}"
                );
            }
            assert_eq!(
                registry.bad_manifests.load(Ordering::SeqCst),
                10,
                "a fresh image each time"
            );
            let indexed: Vec<String> = store.list().into_keys().collect();
            assert!(
                indexed.iter().all(|k| k.ends_with("csi/good:v1")),
                "{indexed:?}"
            );
        }
        // The registry gone: the good image is still prepared from the store alone.
        let store = ImageStore::open(
            &dir,
            Puller::new(loopback_registry("127.0.0.1:9"), limits()),
            Some(composition),
        )
        .unwrap();
        let good_ref = ImageRef::parse("csi/good:v1", &last_host).unwrap();
        store
            .ensure(&good_ref, PullPolicy::IfMissing)
            .await
            .unwrap();
        assert_eq!(Some(listing(&dir)), before);
    }
}

/// What a crash mid-pull leaves (a blob, a layer dir and a rootfs dir no index entry names)
/// is swept when the store opens; the indexed image's blobs and rootfs stay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_start_sweeps_unindexed_leftovers_and_keeps_indexed_blobs() {
    let tmp = tempfile::tempdir().unwrap();
    let layout = tmp.path().join("layout");
    let good = good_image(&layout);
    let registry = HostileRegistry::start(&layout, &good, Hostility::Endless404);
    let dir = tmp.path().join("store");
    let open = || {
        ImageStore::open(
            &dir,
            Puller::new(loopback_registry(&registry.host()), limits()),
            Some(Composition::Flattened),
        )
        .unwrap()
    };
    let store = open();
    let good_ref = store.resolve("csi/good:v1").unwrap();
    store
        .ensure(&good_ref, PullPolicy::IfMissing)
        .await
        .unwrap();
    let indexed = listing(&dir);
    drop(store);

    let orphan = b"a layer a crashed pull stored, never indexed";
    let orphan_hex = sha256_hex(orphan);
    let blob = dir.join("blobs/sha256").join(&orphan_hex);
    std::fs::write(&blob, orphan).unwrap();
    let layer_dir = dir.join("layers").join(&orphan_hex);
    std::fs::create_dir_all(layer_dir.join("usr/bin")).unwrap();
    std::fs::write(layer_dir.join("usr/bin/x"), b"x").unwrap();
    let rootfs_dir = dir.join("rootfs").join(sha256_hex(b"another manifest"));
    std::fs::create_dir_all(rootfs_dir.join("etc")).unwrap();
    // Not ours (not a digest name): left alone.
    let foreign = dir.join("blobs/sha256/README");
    std::fs::write(&foreign, b"operator's note").unwrap();

    let store = open();
    assert!(!blob.exists() && !layer_dir.exists() && !rootfs_dir.exists());
    assert!(foreign.exists());
    std::fs::remove_file(&foreign).unwrap();
    assert_eq!(listing(&dir), indexed, "the indexed image's files stay");
    for hex in good.layer_hexes.iter().chain([&good.config_hex]) {
        assert!(dir.join("blobs/sha256").join(hex).exists(), "{hex}");
    }
    assert_eq!(
        store.blob_bytes().unwrap(),
        good.layer_hexes
            .iter()
            .chain([&good.config_hex])
            .map(|h| std::fs::metadata(dir.join("blobs/sha256").join(h))
                .unwrap()
                .len())
            .sum::<u64>()
    );
    store
        .ensure(&good_ref, PullPolicy::IfMissing)
        .await
        .unwrap();
}

/// The stalled pull scaled down 20×: a layer trickled at 1 byte per second (the issue:
/// per 20 s) under a stall bound of 3 s (30 s), with the floor at 64 bytes/s over 4 s. While
/// it trickles, the cached image is made ready (each time within 1 s), another registry's
/// image is pulled (its manifest fetched again) and a prune runs, none waiting for it; then it
/// fails by the floor (not the stall bound) as a transient error, leaving the store as it
/// was. In both compositions (overlay where the host can).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_trickled_pull_blocks_no_other_image_and_fails_by_the_floor() {
    let tmp = tempfile::tempdir().unwrap();
    let layout = tmp.path().join("layout");
    let good = good_image(&layout);
    let limits = PullLimits {
        read_timeout: Duration::from_secs(3),
        min_bytes_per_sec: 64,
        throughput_window: Duration::from_secs(4),
        ..limits()
    };
    for composition in [Composition::Flattened, Composition::Overlay] {
        if composition == Composition::Overlay
            && Composition::detect(&tmp.path().join("probe")).0 != Composition::Overlay
        {
            eprintln!("overlay not usable here (not root?): only the flattened store is checked");
            continue;
        }
        let slow_registry = HostileRegistry::start(
            &layout,
            &good,
            Hostility::TrickleLayer(Duration::from_secs(1)),
        );
        let other_registry = HostileRegistry::start(&layout, &good, Hostility::Endless404);
        let mut settings = loopback_registry(&slow_registry.host());
        settings.insecure.push(other_registry.host());
        let dir = tmp.path().join(format!("store-{composition:?}"));
        let store = Arc::new(
            ImageStore::open(
                &dir,
                Puller::new(settings, limits.clone()),
                Some(composition),
            )
            .unwrap(),
        );
        let good_ref = store.resolve("csi/good:v1").unwrap();
        store
            .ensure(&good_ref, PullPolicy::IfMissing)
            .await
            .unwrap();
        let before = listing(&dir);

        let bad_ref = store.resolve("csi/bad:v1").unwrap();
        let slow = tokio::spawn({
            let store = Arc::clone(&store);
            async move {
                let started = Instant::now();
                let result = store.ensure(&bad_ref, PullPolicy::Always).await;
                (result, started.elapsed())
            }
        });
        // Until the layer trickles: the pull is in its longest wait.
        let waited = Instant::now();
        while slow_registry.trickled.load(Ordering::SeqCst) == 0 {
            assert!(waited.elapsed() < Duration::from_secs(10), "no trickle");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        for i in 0..3 {
            let started = Instant::now();
            let prepared = store
                .ensure(&good_ref, PullPolicy::IfMissing)
                .await
                .unwrap();
            let took = started.elapsed();
            assert!(
                took < Duration::from_secs(1),
                "{composition:?} {i}: {took:?}"
            );
            assert!(prepared.downloaded.is_empty());
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
        let other_ref = ImageRef::parse("csi/good:v1", &other_registry.host()).unwrap();
        let started = Instant::now();
        store.ensure(&other_ref, PullPolicy::Always).await.unwrap();
        let took = started.elapsed();
        assert!(
            took < Duration::from_secs(1),
            "{composition:?} pull: {took:?}"
        );
        let started = Instant::now();
        store
            .prune(&BTreeSet::from([good_ref.to_string()]))
            .await
            .unwrap();
        let took = started.elapsed();
        assert!(
            took < Duration::from_secs(1),
            "{composition:?} prune: {took:?}"
        );
        assert!(!slow.is_finished(), "the trickled pull ended too early");

        let (result, took) = slow.await.unwrap();
        let err = result.unwrap_err();
        let ImageStoreError::Pull(PullError::TooSlow {
            received_in_window,
            floor,
            window,
            ..
        }) = &err
        else {
            panic!("{composition:?}: {err:?}");
        };
        assert_eq!((*floor, *window), (64, Duration::from_secs(4)));
        assert!(*received_in_window < 64 * 4, "{received_in_window}");
        assert!(err.is_transient(), "a slow registry may be faster later");
        assert!(err.to_string().contains("too slow"), "{err}");
        // Failed at the first window's end (after the manifest and config), not later.
        assert!(
            took >= Duration::from_secs(4) && took < Duration::from_secs(8),
            "{composition:?}: {took:?}"
        );
        let sent = slow_registry.trickled.load(Ordering::SeqCst);
        assert!((2..=8).contains(&sent), "{sent} bytes trickled");
        assert_eq!(
            listing(&dir),
            before,
            "{composition:?}: the failed pull left nothing"
        );
    }
}

/// The floor's abuse test from the other side: a layer that arrives slowly but above the
/// floor (about 40 bytes/s against 10 bytes/s over 500 ms windows) is pulled and prepared.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_pull_above_the_floor_succeeds() {
    let tmp = tempfile::tempdir().unwrap();
    let layout = tmp.path().join("layout");
    let good = good_image(&layout);
    let registry = HostileRegistry::start(
        &layout,
        &good,
        Hostility::TrickleLayer(Duration::from_millis(20)),
    );
    let limits = PullLimits {
        read_timeout: Duration::from_secs(3),
        min_bytes_per_sec: 10,
        throughput_window: Duration::from_millis(500),
        ..limits()
    };
    let store = ImageStore::open(
        &tmp.path().join("store"),
        Puller::new(loopback_registry(&registry.host()), limits),
        Some(Composition::Flattened),
    )
    .unwrap();
    let started = Instant::now();
    let prepared = store
        .ensure(&store.resolve("csi/bad:v1").unwrap(), PullPolicy::Always)
        .await
        .unwrap();
    let sent = registry.trickled.load(Ordering::SeqCst);
    // Long enough to have been judged more than once.
    assert!(started.elapsed() > Duration::from_secs(1), "{sent} bytes");
    assert!(prepared.flattened().unwrap().join("ok").is_file());
    assert_eq!(prepared.downloaded.len(), 2, "config and layer");
}
