//! Image import (issue #13): real archives written by `skopeo` (`oci-archive:` and
//! `docker-archive:`, from an OCI layout built here) imported into a real store and prepared
//! as after a pull, then used with Mesos `cached` semantics without any registry; and hostile
//! archives, each refused with a typed error naming the file, nothing indexed, no blob or temp
//! file left, nothing written outside the store.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod registry_support;

use std::path::{Path, PathBuf};
use std::time::Duration;

use csi_agent::image::import::{ImportError, ImportLimits};
use csi_agent::image::pull::{PullLimits, Puller};
use csi_agent::image::reference::RegistrySettings;
use csi_agent::image::store::{Composition, ImageStore, PullPolicy};
use registry_support::*;

/// Nothing listens there: a store that tried to pull would fail.
const NO_REGISTRY: &str = "127.0.0.1:9";

fn open_store(dir: &Path) -> ImageStore {
    let settings = RegistrySettings {
        default_registry: NO_REGISTRY.to_owned(),
        insecure: vec![NO_REGISTRY.to_owned()],
        ..RegistrySettings::default()
    };
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
