//! Image import (issue #13): real archives written by `skopeo` (`oci-archive:` and
//! `docker-archive:`, from an OCI layout built here) imported into a real store and prepared
//! as after a pull, then used with Mesos `cached` semantics without any registry; and hostile
//! archives, each refused with a typed error naming the file, nothing indexed, no blob or temp
//! file left, nothing written outside the store.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};
use std::time::Duration;

use csi_agent::image::import::{ImportError, ImportLimits};
use csi_agent::image::pull::{PullLimits, Puller};
use csi_agent::image::store::{Composition, ImageStore, PreparedRoot, PullPolicy};
use csi_agent_testkit::registry::*;

/// Nothing listens there: a store that tried to pull would fail.
const NO_REGISTRY: &str = "127.0.0.1:9";

fn open_store(dir: &Path) -> ImageStore {
    let settings = loopback_registry(NO_REGISTRY);
    let limits = PullLimits {
        connect_timeout: Duration::from_secs(1),
        manifest_timeout: Duration::from_secs(2),
        ..PullLimits::default()
    };
    ImageStore::open(
        dir,
        Puller::new(settings, limits),
        Some(Composition::Flattened),
    )
    .unwrap()
}

fn layers() -> Vec<Vec<u8>> {
    vec![
        layer_tar_gz(&[
            Entry::Dir { path: "bin" },
            Entry::File {
                path: "bin/plugin",
                data: b"#!/bin/sh\n",
                mode: 0o755,
            },
        ]),
        layer_tar_gz(&[Entry::File {
            path: "etc/motd",
            data: b"imported",
            mode: 0o644,
        }]),
    ]
}

fn layout(dir: &Path) -> (PathBuf, Image) {
    let layout = dir.join("layout");
    let image = oci_layout(
        &layout,
        &layers(),
        serde_json::json!({"Entrypoint": ["/bin/plugin"], "Cmd": ["serve"]}),
    )
    .unwrap();
    (layout, image)
}

/// Every name in `dir`, recursively, relative to it.
fn tree(dir: &Path) -> Vec<String> {
    let mut names = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(at) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&at) else {
            continue;
        };
        for entry in entries {
            let path = entry.unwrap().path();
            names.push(
                path.strip_prefix(dir)
                    .unwrap()
                    .to_string_lossy()
                    .into_owned(),
            );
            if path.is_dir() && !path.is_symlink() {
                stack.push(path);
            }
        }
    }
    names.sort();
    names
}

async fn import_bytes(
    store: &ImageStore,
    bytes: Vec<u8>,
    name: Option<&str>,
    limits: &ImportLimits,
) -> Result<Vec<csi_agent::image::import::Imported>, ImportError> {
    store
        .import(std::io::Cursor::new(bytes), name, limits)
        .await
}

#[tokio::test]
async fn skopeo_archives_import_and_start_without_a_registry() {
    let dir = tempfile::tempdir().unwrap();
    let (layout, image) = layout(dir.path());
    for (transport, name) in [
        ("oci-archive", "csi/plugin:oci"),
        ("docker-archive", "csi/plugin:docker"),
    ] {
        let file = dir.path().join(format!("{transport}.tar"));
        export(&layout, transport, &file, name).unwrap();
        let work = dir.path().join(format!("store-{transport}"));
        let store = open_store(&work);
        let imported = store
            .import(
                std::fs::File::open(&file).unwrap(),
                None,
                &ImportLimits::default(),
            )
            .await
            .unwrap();
        // Named as the archive names it, resolved like a pull's reference: skopeo writes
        // docker.io/ names into a docker archive, which is Docker Hub's host.
        let expected = if transport == "oci-archive" {
            format!("{NO_REGISTRY}/csi/plugin:oci")
        } else {
            "registry-1.docker.io/csi/plugin:docker".to_owned()
        };
        assert_eq!(imported.len(), 1, "{imported:?}");
        assert_eq!(imported[0].reference, expected, "{transport}");
        let entry = &imported[0].entry;
        assert_eq!(entry.layers.len(), 2, "{entry:?}");
        assert_eq!(entry.config, format!("sha256:{}", image.config_hex));
        if transport == "oci-archive" {
            // The layout's own manifest, kept as it was.
            assert_eq!(entry.manifest, format!("sha256:{}", image.manifest_hex));
            assert!(entry.layers.iter().all(|l| l.gzip));
        }
        assert_eq!(store.list().get(&expected), Some(entry));
        // Every blob the entry names is stored and hashes to its name; nothing else is (the
        // manifest blob of the archive is not kept, as a pull keeps none).
        let blobs = work.join("blobs/sha256");
        let mut names: Vec<String> = std::fs::read_dir(&blobs)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        let mut wanted: Vec<String> = std::iter::once(&entry.config)
            .chain(entry.layers.iter().map(|l| &l.digest))
            .map(|d| d.trim_start_matches("sha256:").to_owned())
            .collect();
        wanted.sort();
        assert_eq!(names, wanted, "{transport}");
        for name in &names {
            assert_eq!(&sha256_hex(&std::fs::read(blobs.join(name)).unwrap()), name);
        }
        // Prepared as after a pull, and `cached: true` uses it with no registry there.
        // (A config naming the docker archive's image must name it as the archive does,
        // Docker Hub included, or it is imported with --name.)
        let reference = store.resolve(&expected).unwrap();
        let prepared = store
            .ensure(&reference, PullPolicy::IfMissing)
            .await
            .unwrap();
        assert!(prepared.downloaded.is_empty());
        assert_eq!(
            std::fs::read(prepared.flattened().unwrap().to_path_buf().join("etc/motd")).unwrap(),
            b"imported"
        );
        assert!(
            prepared
                .flattened()
                .unwrap()
                .to_path_buf()
                .join("bin/plugin")
                .is_file()
        );
        assert_eq!(prepared.config.entrypoint, vec!["/bin/plugin".to_owned()]);
        assert_eq!(prepared.config.cmd, vec!["serve".to_owned()]);
        // A pull would have failed: the tag re-check (cached: false) does.
        assert!(store.ensure(&reference, PullPolicy::Always).await.is_err());
    }
}

#[tokio::test]
async fn a_name_given_wins_and_several_images_import_together() {
    let dir = tempfile::tempdir().unwrap();
    let (layout, image) = layout(dir.path());
    name_layout(&layout, "csi/plugin:v1").unwrap();
    let bytes = archive_of(&layout_files(&layout));
    let store = open_store(&dir.path().join("store"));
    let imported = import_bytes(
        &store,
        bytes.clone(),
        Some("other/name:v2"),
        &ImportLimits::default(),
    )
    .await
    .unwrap();
    assert_eq!(
        imported[0].reference,
        format!("{NO_REGISTRY}/other/name:v2")
    );
    assert_eq!(store.list().len(), 1);
    // A pinned name must pin this very manifest.
    let wrong = format!("x/y@sha256:{}", "0".repeat(64));
    let err = import_bytes(
        &store,
        bytes.clone(),
        Some(&wrong),
        &ImportLimits::default(),
    )
    .await
    .unwrap_err();
    assert!(matches!(err, ImportError::PinnedDigest { .. }), "{err}");
    let pinned = format!("x/y@sha256:{}", image.manifest_hex);
    import_bytes(&store, bytes, Some(&pinned), &ImportLimits::default())
        .await
        .unwrap();

    // Two images in one layout, each named: both imported, no --name needed.
    let two = dir.path().join("two");
    oci_layout(
        &two,
        &[layer_tar_gz(&[Entry::File {
            path: "a",
            data: b"second",
            mode: 0o644,
        }])],
        serde_json::json!({}),
    )
    .unwrap();
    let second: serde_json::Value =
        serde_json::from_slice(&std::fs::read(two.join("index.json")).unwrap()).unwrap();
    let mut files = layout_files(&layout);
    files.extend(
        layout_files(&two)
            .into_iter()
            .filter(|(n, _)| n.starts_with("blobs/")),
    );
    files.sort();
    files.dedup_by(|a, b| a.0 == b.0);
    let mut index: serde_json::Value =
        serde_json::from_slice(&files.iter().find(|(n, _)| n == "index.json").unwrap().1).unwrap();
    let mut entry = second["manifests"][0].clone();
    entry["annotations"] =
        serde_json::json!({"org.opencontainers.image.ref.name": "csi/second:v1"});
    index["manifests"].as_array_mut().unwrap().push(entry);
    for file in &mut files {
        if file.0 == "index.json" {
            file.1 = serde_json::to_vec(&index).unwrap();
        }
    }
    let fresh = open_store(&dir.path().join("fresh"));
    let imported = import_bytes(&fresh, archive_of(&files), None, &ImportLimits::default())
        .await
        .unwrap();
    let names: Vec<&str> = imported.iter().map(|i| i.reference.as_str()).collect();
    assert_eq!(
        names,
        vec![
            format!("{NO_REGISTRY}/csi/plugin:v1"),
            format!("{NO_REGISTRY}/csi/second:v1")
        ]
    );
    // With --name, two images are ambiguous.
    let err = import_bytes(
        &fresh,
        archive_of(&files),
        Some("one:v1"),
        &ImportLimits::default(),
    )
    .await
    .unwrap_err();
    assert!(matches!(err, ImportError::Ambiguous { .. }), "{err}");
}

/// Imports `bytes` into a fresh store under `dir` and checks that it is refused without a
/// trace: nothing indexed, no blob, no temp file, nothing new beside the store.
async fn refused(dir: &Path, bytes: Vec<u8>, limits: &ImportLimits) -> ImportError {
    let work = dir.join("store");
    let _ = std::fs::remove_dir_all(&work);
    let store = open_store(&work);
    let before_store = tree(&work);
    let before_dir = tree(dir);
    let err = import_bytes(&store, bytes, None, limits).await.unwrap_err();
    assert!(store.list().is_empty(), "indexed after {err}");
    assert!(
        !work.join("index.json").exists(),
        "an index was written after {err}"
    );
    assert_eq!(tree(&work), before_store, "the store changed after {err}");
    assert_eq!(
        tree(dir),
        before_dir,
        "something was written beside the store after {err}"
    );
    err
}

#[tokio::test]
async fn hostile_archives_are_refused_without_a_trace() {
    let dir = tempfile::tempdir().unwrap();
    let (layout, image) = layout(dir.path());
    name_layout(&layout, "csi/plugin:v1").unwrap();
    let good = layout_files(&layout);
    let limits = ImportLimits::default();
    let work = dir.path().join("work");
    std::fs::create_dir_all(&work).unwrap();

    // `../x`: a name that would escape, were names paths.
    let mut files = good.clone();
    files.push(("../x".to_owned(), b"escaped".to_vec()));
    let err = refused(&work, archive_of(&files), &limits).await;
    assert!(
        matches!(&err, ImportError::UnsafeName { name, .. } if name == "../x"),
        "{err}"
    );
    assert!(!dir.path().join("x").exists());

    // Symlinks out of the archive, or posing as a blob, and a hard link, inside the archive
    // itself.
    for (entry, kind) in [
        (
            ArchiveEntry::Symlink {
                name: "abc/layer.tar",
                target: "/etc/passwd",
            },
            "symlink to \"/etc/passwd\"",
        ),
        (
            ArchiveEntry::Symlink {
                name: "abc/layer.tar",
                target: "../../x",
            },
            "symlink to \"../../x\"",
        ),
        (
            ArchiveEntry::Symlink {
                name: "blobs/sha256/link",
                target: "index.json",
            },
            "symlink to \"index.json\"",
        ),
        (
            ArchiveEntry::HardLink {
                name: "hard",
                target: "index.json",
            },
            "hard link",
        ),
    ] {
        let mut entries: Vec<ArchiveEntry<'_>> = good
            .iter()
            .map(|(name, data)| ArchiveEntry::File { name, data })
            .collect();
        entries.insert(0, entry);
        let err = refused(&work, archive(&entries), &limits).await;
        assert!(
            matches!(&err, ImportError::UnsupportedEntry { kind: k, .. } if k == kind),
            "{err}"
        );
    }

    // A blob whose content does not match its name (the first layer's bytes changed).
    let layer_name = format!("blobs/sha256/{}", image.layer_hexes[0]);
    let mut files = good.clone();
    for file in &mut files {
        if file.0 == layer_name {
            file.1[20] ^= 0xff;
        }
    }
    let err = refused(&work, archive_of(&files), &limits).await;
    assert!(
        matches!(&err, ImportError::BlobMismatch { file, .. } if *file == layer_name),
        "{err}"
    );
    assert!(err.to_string().contains(&layer_name), "{err}");

    // The index (via the manifest) naming a blob the archive lacks.
    let files: Vec<_> = good
        .iter()
        .filter(|(n, _)| *n != layer_name)
        .cloned()
        .collect();
    let err = refused(&work, archive_of(&files), &limits).await;
    assert!(
        matches!(&err, ImportError::Missing { file, .. } if *file == layer_name),
        "{err}"
    );

    // index.json naming a manifest that is not there.
    let manifest_name = format!("blobs/sha256/{}", image.manifest_hex);
    let files: Vec<_> = good
        .iter()
        .filter(|(n, _)| *n != manifest_name)
        .cloned()
        .collect();
    let err = refused(&work, archive_of(&files), &limits).await;
    assert!(
        matches!(&err, ImportError::Missing { file, .. } if *file == manifest_name),
        "{err}"
    );

    // A name twice (two spellings of one).
    let mut files = good.clone();
    files.push(("./index.json".to_owned(), b"{}".to_vec()));
    let err = refused(&work, archive_of(&files), &limits).await;
    assert!(
        matches!(&err, ImportError::Duplicate { name } if name == "index.json"),
        "{err}"
    );

    // A manifest.json larger than the JSON limit (a docker archive).
    let small = ImportLimits {
        max_json_bytes: 1024,
        ..ImportLimits::default()
    };
    let mut big = b"[".to_vec();
    big.extend(std::iter::repeat_n(b' ', 2048));
    big.extend(b"]");
    let files = vec![("manifest.json".to_owned(), big)];
    let err = refused(&work, archive_of(&files), &small).await;
    assert!(
        matches!(&err, ImportError::JsonTooLarge { file, max: 1024 } if file == "manifest.json"),
        "{err}"
    );

    // A whole archive over the limit: reading stops there, the blobs already stored go.
    let total: usize = good.iter().map(|(_, d)| d.len()).sum();
    let tight = ImportLimits {
        max_archive_bytes: total as u64 / 2,
        ..ImportLimits::default()
    };
    let err = refused(&work, archive_of(&good), &tight).await;
    assert!(matches!(err, ImportError::TooLarge { .. }), "{err}");

    // A layer of an unsupported media type.
    let mut files = good.clone();
    let manifest: serde_json::Value =
        serde_json::from_slice(&good.iter().find(|(n, _)| *n == manifest_name).unwrap().1).unwrap();
    let mut zstd = manifest.clone();
    zstd["layers"][0]["mediaType"] = "application/vnd.oci.image.layer.v1.tar+zstd".into();
    let zstd = serde_json::to_vec(&zstd).unwrap();
    let zstd_hex = sha256_hex(&zstd);
    files.push((format!("blobs/sha256/{zstd_hex}"), zstd.clone()));
    for file in &mut files {
        if file.0 == "index.json" {
            let mut index: serde_json::Value = serde_json::from_slice(&file.1).unwrap();
            index["manifests"][0]["digest"] = format!("sha256:{zstd_hex}").into();
            index["manifests"][0]["size"] = zstd.len().into();
            file.1 = serde_json::to_vec(&index).unwrap();
        }
    }
    let err = refused(&work, archive_of(&files), &limits).await;
    assert!(matches!(err, ImportError::Manifest { .. }), "{err}");
    assert!(err.to_string().contains("zstd"), "{err}");

    // Not an image archive at all.
    let err = refused(
        &work,
        archive_of(&[("hello".to_owned(), b"x".to_vec())]),
        &limits,
    )
    .await;
    assert!(matches!(err, ImportError::UnknownFormat), "{err}");
    // Not even a tar.
    let err = refused(&work, vec![0x42; 1500], &limits).await;
    assert!(matches!(err, ImportError::Read { .. }), "{err}");

    // And the good archive still imports after all that.
    let store = open_store(&dir.path().join("ok"));
    import_bytes(&store, archive_of(&good), None, &limits)
        .await
        .unwrap();
    assert_eq!(store.list().len(), 1);
}

/// An image whose upper layer writes `etc/motd` = `motd` over the shared base of [`layers`].
fn image_layers(motd: &[u8]) -> Vec<Vec<u8>> {
    let mut layers = layers();
    layers[1] = layer_tar_gz(&[Entry::File {
        path: "etc/motd",
        data: motd,
        mode: 0o644,
    }]);
    layers
}

/// Every image the store indexes is complete: each blob it names is in `blobs/` and hashes
/// to its name, and its prepared root (rootfs dir, or every layer dir) is there.
fn assert_indexed_images_complete(store: &ImageStore, dir: &Path, composition: Composition) {
    use csi_agent::image::blobs::Digest;
    for (reference, entry) in store.list() {
        let mut blobs = vec![entry.config.clone()];
        blobs.extend(entry.layers.iter().map(|l| l.digest.clone()));
        for digest in &blobs {
            let hex = digest.strip_prefix("sha256:").unwrap();
            let bytes = std::fs::read(dir.join("blobs/sha256").join(hex))
                .unwrap_or_else(|err| panic!("{reference}: blob {digest}: {err}"));
            assert_eq!(
                sha256_hex(&bytes),
                hex,
                "{reference}: blob {digest} damaged"
            );
        }
        let manifest = entry.manifest.strip_prefix("sha256:").unwrap();
        match composition {
            Composition::Flattened => assert!(
                dir.join("rootfs").join(manifest).is_dir(),
                "{reference}: its rootfs is missing"
            ),
            Composition::Overlay => {
                let digests: Vec<Digest> = entry
                    .layers
                    .iter()
                    .map(|l| Digest::parse(&l.digest).unwrap())
                    .collect();
                for chain in csi_agent::image::store::chain_ids(&digests) {
                    assert!(
                        dir.join("layers").join(chain.hex()).is_dir(),
                        "{reference}: layer dir {chain} is missing"
                    );
                }
            }
        }
    }
}

/// What a fresh container of a prepared image sees at `etc/motd`.
fn motd_of(root: &PreparedRoot, scratch: &Path) -> Vec<u8> {
    match root {
        PreparedRoot::Flattened(rootfs) => std::fs::read(rootfs.join("etc/motd")).unwrap(),
        PreparedRoot::Layers(layers) => {
            let merged = scratch.join("merged");
            std::fs::create_dir_all(&merged).unwrap();
            csi_agent::image::overlay::mount(layers, None, &merged).unwrap();
            let motd = std::fs::read(merged.join("etc/motd"));
            rustix::mount::unmount(&merged, rustix::mount::UnmountFlags::DETACH).unwrap();
            motd.unwrap()
        }
    }
}

/// Issue #13: `prune` takes the store's busy lock, but an import stores its blobs while it
/// reads the archive, before it takes the lock. Many rounds of prunes racing imports of the
/// same image (under two names: its blobs then already present), of another one sharing its
/// base layer (a docker-archive, whose blobs are stored under computed digests) and a pull:
/// every import and pull must succeed, every image indexed after each round must be complete,
/// and in the end a fresh root prepared from each must be the image.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn prunes_racing_imports_and_a_pull_never_leave_an_indexed_image_incomplete() {
    // Real overlay mounts for the overlay form: as root, in a private mount namespace.
    csi_agent::mounts::require_private_mount_namespace();
    let tmp = tempfile::tempdir().unwrap();
    let registry = Registry::start(&tmp.path().join("registry")).unwrap();
    let host = registry.host();
    let layout_a = tmp.path().join("layout-a");
    oci_layout(&layout_a, &image_layers(b"a\n"), serde_json::json!({})).unwrap();
    name_layout(&layout_a, "csi/a:v1").unwrap();
    let archive_a = archive_of(&layout_files(&layout_a));
    let layout_b = tmp.path().join("layout-b");
    oci_layout(&layout_b, &image_layers(b"b\n"), serde_json::json!({})).unwrap();
    let file_b = tmp.path().join("b.tar");
    export(&layout_b, "docker-archive", &file_b, "csi/b:v1").unwrap();
    let archive_b = std::fs::read(&file_b).unwrap();
    let layout_c = tmp.path().join("layout-c");
    oci_layout(&layout_c, &image_layers(b"c\n"), serde_json::json!({})).unwrap();
    push(&layout_c, &registry, "csi/c:v1").unwrap();
    let expected = [
        (format!("{host}/csi/a:v1"), b"a\n"),
        (format!("{host}/csi/a:v2"), b"a\n"),
        (format!("{host}/csi/b:v1"), b"b\n"),
        (format!("{host}/csi/c:v1"), b"c\n"),
    ];

    for composition in [Composition::Flattened, Composition::Overlay] {
        let dir = tmp.path().join(format!("store-{composition:?}"));
        let settings = loopback_registry(&host);
        let limits = PullLimits {
            connect_timeout: Duration::from_secs(2),
            manifest_timeout: Duration::from_secs(10),
            ..PullLimits::default()
        };
        let store = std::sync::Arc::new(
            ImageStore::open(&dir, Puller::new(settings, limits), Some(composition)).unwrap(),
        );
        let c = store.resolve("csi/c:v1").unwrap();
        for round in 0..25 {
            let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
            // Prunes all along the round; every other round keeps a:v1.
            let pruner = {
                let (store, done) = (std::sync::Arc::clone(&store), std::sync::Arc::clone(&done));
                let used: std::collections::BTreeSet<String> = if round % 2 == 0 {
                    std::collections::BTreeSet::new()
                } else {
                    [format!("{host}/csi/a:v1")].into()
                };
                tokio::spawn(async move {
                    let mut prunes = 0;
                    while !done.load(std::sync::atomic::Ordering::SeqCst) {
                        store.prune(&used).await.unwrap();
                        prunes += 1;
                        tokio::task::yield_now().await;
                    }
                    prunes
                })
            };
            let import = |bytes: Vec<u8>, name: Option<&'static str>| {
                let store = std::sync::Arc::clone(&store);
                tokio::spawn(async move {
                    store
                        .import(std::io::Cursor::new(bytes), name, &ImportLimits::default())
                        .await
                })
            };
            let imports = [
                import(archive_a.clone(), None),
                import(archive_a.clone(), Some("csi/a:v2")),
                import(archive_b.clone(), Some("csi/b:v1")),
            ];
            let pull = {
                let (store, c) = (std::sync::Arc::clone(&store), c.clone());
                tokio::spawn(async move { store.ensure(&c, PullPolicy::Always).await })
            };
            for (i, import) in imports.into_iter().enumerate() {
                if let Err(err) = import.await.unwrap() {
                    panic!("{composition:?} round {round}: import {i} failed: {err}");
                }
            }
            if let Err(err) = pull.await.unwrap() {
                panic!("{composition:?} round {round}: the pull failed: {err}");
            }
            done.store(true, std::sync::atomic::Ordering::SeqCst);
            let prunes = pruner.await.unwrap();
            assert!(prunes > 0);
            assert_indexed_images_complete(&store, &dir, composition);
        }

        // In the end, with no prune: each image indexed once more, then, its prepared root
        // removed, prepared again from the store alone (the imported ones without a
        // registry): a fresh root that is the image.
        for (name, motd) in [
            ("csi/a:v1", archive_a.as_slice()),
            ("csi/a:v2", archive_a.as_slice()),
            ("csi/b:v1", archive_b.as_slice()),
        ] {
            store
                .import(
                    std::io::Cursor::new(motd.to_vec()),
                    Some(name),
                    &ImportLimits::default(),
                )
                .await
                .unwrap();
        }
        store.ensure(&c, PullPolicy::IfMissing).await.unwrap();
        assert_indexed_images_complete(&store, &dir, composition);
        for sub in ["rootfs", "layers"] {
            std::fs::remove_dir_all(dir.join(sub)).unwrap();
            std::fs::create_dir(dir.join(sub)).unwrap();
        }
        let gets = registry.blob_gets(None);
        for (reference, motd) in &expected {
            let image = store.resolve(reference).unwrap();
            let prepared = store.ensure(&image, PullPolicy::IfMissing).await.unwrap();
            assert!(prepared.downloaded.is_empty(), "{reference}: pulled again");
            assert_eq!(
                &motd_of(&prepared.root, &tmp.path().join("scratch")),
                motd,
                "{reference}"
            );
        }
        assert_eq!(registry.blob_gets(None), gets, "a blob was fetched again");
    }
}
