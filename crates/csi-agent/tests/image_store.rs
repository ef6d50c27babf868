//! The image store against a real registry: pull + prepare, the config read, Mesos `cached`
//! semantics, crash leftovers cleaned and re-prepared, garbage collection, hostile input.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::time::Duration;

use csi_agent::image::pull::{PullError, PullLimits, Puller};
use csi_agent::image::reference::{ImageRef, RegistrySettings};
use std::os::unix::fs::MetadataExt;

use csi_agent::image::store::{Composition, ImageStore, ImageStoreError, PreparedRoot, PullPolicy};
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

fn base_layer() -> Vec<u8> {
    layer_tar_gz(&[
        Entry::Dir { path: "bin" },
        Entry::File {
            path: "bin/plugin",
            data: b"#!/bin/sh\n",
            mode: 0o755,
        },
        Entry::File {
            path: "etc/removed",
            data: b"gone in layer 2",
            mode: 0o644,
        },
        Entry::File {
            path: "etc/keep",
            data: b"kept",
            mode: 0o600,
        },
    ])
}

/// Two layers: the upper one deletes `etc/removed` and adds `etc/motd`.
fn push_image(tmp: &Path, registry: &Registry, name: &str, motd: &[u8]) -> Image {
    let upper = layer_tar_gz(&[
        Entry::Whiteout {
            path: "etc/removed",
        },
        Entry::File {
            path: "etc/motd",
            data: motd,
            mode: 0o644,
        },
        Entry::Symlink {
            path: "bin/sh",
            target: "/bin/plugin",
        },
    ]);
    let layout = tmp.join(format!("layout-{}", name.replace([':', '/'], "-")));
    let image = oci_layout(
        &layout,
        &[base_layer(), upper],
        serde_json::json!({
            "Entrypoint": ["/bin/plugin", "--csi"],
            "Cmd": ["serve"],
            "Env": ["PATH=/bin", "MODE=image"],
            "WorkingDir": "/var/lib/plugin",
            "User": "0:0",
        }),
    )
    .unwrap();
    push(&layout, registry, name).unwrap();
    image
}

fn names(dir: &Path) -> BTreeSet<String> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect()
}

fn reference(registry: &Registry, name: &str) -> ImageRef {
    ImageRef::parse(name, &registry.host()).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ensure_prepares_the_rootfs_reads_the_config_and_honours_cached() {
    let tmp = tempfile::tempdir().unwrap();
    let mut registry = Registry::start(&tmp.path().join("registry")).unwrap();
    let image = push_image(tmp.path(), &registry, "csi/plugin:v1", b"motd v1\n");
    let dir = tmp.path().join("images");
    let store = ImageStore::open(&dir, puller(&registry), Some(Composition::Flattened)).unwrap();
    let r = reference(&registry, "csi/plugin:v1");

    let prepared = store.ensure(&r, PullPolicy::IfMissing).await.unwrap();
    assert_eq!(prepared.manifest.hex(), image.manifest_hex);
    assert_eq!(
        prepared.flattened().unwrap().to_path_buf(),
        dir.join("rootfs").join(&image.manifest_hex)
    );
    assert_eq!(prepared.downloaded.len(), 3);
    let root = &prepared.flattened().unwrap().to_path_buf();
    assert_eq!(std::fs::read(root.join("etc/motd")).unwrap(), b"motd v1\n");
    assert_eq!(std::fs::read(root.join("etc/keep")).unwrap(), b"kept");
    assert!(!root.join("etc/removed").exists(), "whiteout not applied");
    assert!(!root.join("etc/.wh.removed").exists());
    assert_eq!(
        std::fs::read_link(root.join("bin/sh")).unwrap(),
        PathBuf::from("/bin/plugin")
    );
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(root.join("bin/plugin"))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o7777, 0o755);
    }
    let config = &prepared.config;
    assert_eq!(config.entrypoint, ["/bin/plugin", "--csi"]);
    assert_eq!(config.cmd, ["serve"]);
    assert_eq!(config.env, ["PATH=/bin", "MODE=image"]);
    assert_eq!(config.working_dir.as_deref(), Some("/var/lib/plugin"));
    assert_eq!(config.user.as_deref(), Some("0:0"));
    // The index names it, durably (re-read from disk).
    let index: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("index.json")).unwrap()).unwrap();
    let entry = &index["images"][r.to_string()];
    assert_eq!(entry["manifest"], format!("sha256:{}", image.manifest_hex));
    assert_eq!(entry["layers"].as_array().unwrap().len(), 2);
    assert!(entry["pulled_at"].as_u64().unwrap() > 0);

    // cached (IfMissing): no registry needed at all.
    registry.stop();
    let again = store.ensure(&r, PullPolicy::IfMissing).await.unwrap();
    assert_eq!(again.manifest, prepared.manifest);
    assert!(again.downloaded.is_empty());
    // Always: the tag is re-checked, so a stopped registry is an error (transient)...
    let err = store.ensure(&r, PullPolicy::Always).await.unwrap_err();
    assert!(
        matches!(err, ImageStoreError::Pull(PullError::Unreachable { .. })),
        "{err:?}"
    );
    assert!(err.is_transient());
    // ...and a moved tag is followed, the shared base layer not fetched again.
    registry.restart().unwrap();
    let base_hex = image.layer_hexes[0].clone();
    let moved = push_image(tmp.path(), &registry, "csi/plugin:v1", b"motd v2\n");
    let gets = registry.blob_gets(Some(&base_hex));
    let updated = store.ensure(&r, PullPolicy::Always).await.unwrap();
    assert_eq!(updated.manifest.hex(), moved.manifest_hex);
    assert_eq!(
        std::fs::read(updated.flattened().unwrap().to_path_buf().join("etc/motd")).unwrap(),
        b"motd v2\n"
    );
    assert_eq!(registry.blob_gets(Some(&base_hex)), gets);
    assert_eq!(updated.downloaded.len(), 2, "{:?}", updated.downloaded);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crash_leftovers_are_removed_and_the_image_re_prepared() {
    let tmp = tempfile::tempdir().unwrap();
    let mut registry = Registry::start(&tmp.path().join("registry")).unwrap();
    let image = push_image(tmp.path(), &registry, "csi/plugin:v1", b"motd\n");
    let dir = tmp.path().join("images");
    let r = reference(&registry, "csi/plugin:v1");
    let rootfs = dir.join("rootfs").join(&image.manifest_hex);
    {
        let store =
            ImageStore::open(&dir, puller(&registry), Some(Composition::Flattened)).unwrap();
        store.ensure(&r, PullPolicy::IfMissing).await.unwrap();
    }
    // What a SIGKILL at various points leaves: a rootfs being built (its final name not yet
    // taken), a half-written blob, a half-written index temp file.
    let partial = dir
        .join("rootfs")
        .join(format!(".tmp-{}-00000000deadbeef", image.manifest_hex));
    std::fs::rename(&rootfs, &partial).unwrap();
    std::fs::remove_file(partial.join("etc/motd")).unwrap();
    let blob_temp = dir.join(format!("blobs/sha256/.tmp-{}-1-0", "ab".repeat(32)));
    std::fs::write(&blob_temp, b"half").unwrap();
    let index_temp = dir.join(".tmp-index.json-0000000000000001");
    std::fs::write(&index_temp, b"{\"version\": 1, \"ima").unwrap();

    // No registry: everything must come from the store.
    registry.stop();
    let store = ImageStore::open(&dir, puller(&registry), Some(Composition::Flattened)).unwrap();
    assert!(!partial.exists(), "partial rootfs not removed");
    assert!(!blob_temp.exists(), "partial blob not removed");
    assert!(!index_temp.exists(), "index temp file not removed");
    assert_eq!(
        names(&dir.join("rootfs")),
        BTreeSet::new(),
        "only complete rootfs dirs may remain"
    );
    let prepared = store.ensure(&r, PullPolicy::IfMissing).await.unwrap();
    assert_eq!(prepared.flattened().unwrap().to_path_buf(), rootfs);
    assert_eq!(std::fs::read(rootfs.join("etc/motd")).unwrap(), b"motd\n");
    assert!(prepared.downloaded.is_empty());

    // A layer blob lost from the store: the image is pulled again (only that blob).
    drop(store);
    std::fs::remove_dir_all(&rootfs).unwrap();
    std::fs::remove_file(dir.join("blobs/sha256").join(&image.layer_hexes[1])).unwrap();
    registry.restart().unwrap();
    let store = ImageStore::open(&dir, puller(&registry), Some(Composition::Flattened)).unwrap();
    let prepared = store.ensure(&r, PullPolicy::IfMissing).await.unwrap();
    assert_eq!(
        prepared
            .downloaded
            .iter()
            .map(|d| d.hex().to_owned())
            .collect::<Vec<_>>(),
        vec![image.layer_hexes[1].clone()]
    );
    assert_eq!(std::fs::read(rootfs.join("etc/motd")).unwrap(), b"motd\n");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prune_removes_what_no_used_image_needs() {
    let tmp = tempfile::tempdir().unwrap();
    let registry = Registry::start(&tmp.path().join("registry")).unwrap();
    let a = push_image(tmp.path(), &registry, "csi/a:v1", b"a\n");
    let b = push_image(tmp.path(), &registry, "csi/b:v1", b"b\n");
    assert_eq!(
        a.layer_hexes[0], b.layer_hexes[0],
        "the base layer is shared"
    );
    let dir = tmp.path().join("images");
    let store = ImageStore::open(&dir, puller(&registry), Some(Composition::Flattened)).unwrap();
    let (ra, rb) = (
        reference(&registry, "csi/a:v1"),
        reference(&registry, "csi/b:v1"),
    );
    store.ensure(&ra, PullPolicy::IfMissing).await.unwrap();
    store.ensure(&rb, PullPolicy::IfMissing).await.unwrap();
    let blobs = dir.join("blobs/sha256");
    assert_eq!(
        names(&blobs).len(),
        5,
        "shared base, two uppers, two configs"
    );

    let pruned = store
        .prune(&BTreeSet::from([ra.to_string()]))
        .await
        .unwrap();
    assert_eq!(pruned.references, vec![rb.to_string()]);
    assert_eq!((pruned.rootfs, pruned.blobs), (1, 2));
    assert_eq!(
        names(&blobs),
        BTreeSet::from([
            a.layer_hexes[0].clone(),
            a.layer_hexes[1].clone(),
            a.config_hex.clone()
        ])
    );
    assert_eq!(
        names(&dir.join("rootfs")),
        BTreeSet::from([a.manifest_hex.clone()])
    );
    assert_eq!(
        store.list().keys().cloned().collect::<Vec<_>>(),
        vec![ra.to_string()]
    );
    // Durable: a re-opened store agrees.
    drop(store);
    let store = ImageStore::open(&dir, puller(&registry), Some(Composition::Flattened)).unwrap();
    assert_eq!(store.list().len(), 1);
    // Nothing used: everything goes.
    let pruned = store.prune(&BTreeSet::new()).await.unwrap();
    assert_eq!((pruned.rootfs, pruned.blobs), (1, 3));
    assert!(names(&blobs).is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hostile_layer_is_refused_and_leaves_no_rootfs() {
    let tmp = tempfile::tempdir().unwrap();
    let registry = Registry::start(&tmp.path().join("registry")).unwrap();
    let hostile = layer_tar_gz(&[
        Entry::File {
            path: "ok",
            data: b"fine",
            mode: 0o644,
        },
        Entry::RawName {
            name: "../escaped",
            data: b"out",
        },
    ]);
    let layout = tmp.path().join("layout");
    let image = oci_layout(&layout, &[hostile], serde_json::json!({})).unwrap();
    push(&layout, &registry, "csi/evil:v1").unwrap();
    let dir = tmp.path().join("images");
    let store = ImageStore::open(&dir, puller(&registry), Some(Composition::Flattened)).unwrap();
    let err = store
        .ensure(&reference(&registry, "csi/evil:v1"), PullPolicy::IfMissing)
        .await
        .unwrap_err();
    assert!(matches!(err, ImageStoreError::Unpack { .. }), "{err:?}");
    assert!(!err.is_transient());
    assert!(
        names(&dir.join("rootfs")).is_empty(),
        "a partial rootfs is left"
    );
    assert!(!dir.join("rootfs/escaped").exists() && !dir.join("escaped").exists());
    assert!(store.list().is_empty(), "a refused image is in the index");
    let _ = image;
}

#[test]
fn a_hostile_index_is_refused_not_followed() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("images");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(
        dir.join("index.json"),
        br#"{"version": 1, "images": {"x/y:z": {"manifest": "sha256:../../../etc",
            "config": "sha256:00", "layers": [], "size": 0, "pulled_at": 0}}}"#,
    )
    .unwrap();
    let err = ImageStore::open(
        &dir,
        Puller::new(RegistrySettings::docker_hub(), PullLimits::default()),
        None,
    )
    .unwrap_err();
    assert!(
        matches!(err, ImageStoreError::IndexCorrupt { .. }),
        "{err:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_overlayfs_each_layer_is_unpacked_once_shared_stacked_and_pruned() {
    // Real overlay mounts: as root, in a private mount namespace.
    csi_agent::mounts::require_private_mount_namespace();
    let tmp = tempfile::tempdir().unwrap();
    let registry = Registry::start(&tmp.path().join("registry")).unwrap();
    let a = push_image(tmp.path(), &registry, "csi/a:v1", b"a\n");
    let b = push_image(tmp.path(), &registry, "csi/b:v1", b"b\n");
    let dir = tmp.path().join("images");
    assert_eq!(Composition::detect(&dir), (Composition::Overlay, None));
    let store = ImageStore::open(&dir, puller(&registry), None).unwrap();
    let (ra, rb) = (
        reference(&registry, "csi/a:v1"),
        reference(&registry, "csi/b:v1"),
    );
    let prepared_a = store.ensure(&ra, PullPolicy::IfMissing).await.unwrap();
    assert_eq!(store.composition(), Composition::Overlay);
    let PreparedRoot::Layers(layers_a) = &prepared_a.root else {
        panic!("{:?}", prepared_a.root);
    };
    let layers = dir.join("layers");
    assert_eq!(names(&layers).len(), 2);
    // The first layer's dir is named by its digest, the second by its chain id.
    assert_eq!(layers_a[0], layers.join(&a.layer_hexes[0]));
    assert_ne!(layers_a[1], layers.join(&a.layer_hexes[1]));
    assert!(
        names(&dir.join("rootfs")).is_empty(),
        "a flattened copy was made"
    );
    let base_inode = std::fs::metadata(&layers_a[0]).unwrap().ino();

    // The second image shares the base layer: only its own upper layer is unpacked.
    let prepared_b = store.ensure(&rb, PullPolicy::IfMissing).await.unwrap();
    let PreparedRoot::Layers(layers_b) = &prepared_b.root else {
        panic!("{:?}", prepared_b.root);
    };
    assert_eq!(names(&layers).len(), 3);
    assert_eq!(layers_b[0], layers_a[0]);
    assert_eq!(std::fs::metadata(&layers_b[0]).unwrap().ino(), base_inode);

    // Stacked, each is exactly its image: the whiteout hides the base's file.
    for (layers, motd) in [(layers_a, b"a\n"), (layers_b, b"b\n")] {
        let merged = tmp.path().join("merged");
        std::fs::create_dir_all(&merged).unwrap();
        csi_agent::image::overlay::mount(layers, None, &merged).unwrap();
        let seen = (
            std::fs::read(merged.join("etc/motd")).unwrap(),
            merged.join("etc/removed").exists(),
            std::fs::read(merged.join("etc/keep")).unwrap(),
            std::fs::read_link(merged.join("bin/sh")).unwrap(),
        );
        rustix::mount::unmount(&merged, rustix::mount::UnmountFlags::DETACH).unwrap();
        assert_eq!(
            seen,
            (
                motd.to_vec(),
                false,
                b"kept".to_vec(),
                PathBuf::from("/bin/plugin")
            )
        );
    }

    // A layer dir half-built when a crash came is removed by the next open.
    let partial = layers.join(format!(".tmp-{}-0000000000000000", b.layer_hexes[1]));
    std::fs::create_dir(&partial).unwrap();
    drop(store);
    let store = ImageStore::open(&dir, puller(&registry), None).unwrap();
    assert!(!partial.exists());

    // Pruning b removes only its own layer; the shared base stays for a.
    let pruned = store
        .prune(&BTreeSet::from([ra.to_string()]))
        .await
        .unwrap();
    assert_eq!(
        (pruned.rootfs, pruned.layers, pruned.blobs),
        (0, 1, 2),
        "{pruned:?}"
    );
    let kept: BTreeSet<String> = layers_a
        .iter()
        .map(|l| l.file_name().unwrap().to_string_lossy().into_owned())
        .collect();
    assert_eq!(names(&layers), kept);
    // A warm ensure of a uses what is there.
    let again = store.ensure(&ra, PullPolicy::IfMissing).await.unwrap();
    assert!(again.downloaded.is_empty());
    assert_eq!(again.root, prepared_a.root);
    let pruned = store.prune(&BTreeSet::new()).await.unwrap();
    assert_eq!(pruned.layers, 2, "{pruned:?}");
    assert!(names(&layers).is_empty());
}
