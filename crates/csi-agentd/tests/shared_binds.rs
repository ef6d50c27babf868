//! Workloads sharing a volume cannot block each other through their `bind_to` (issue #24,
//! M2 and L3), and a volume's claims are bounded so that its record always reads back
//! (issue #24, L2): on the real daemon with real bind mounts. Run under
//! `unshare -m --propagation private`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::path::{Path, PathBuf};

use common::*;

/// A daemon with `<dir>/sandboxes` as its bind root, and a victim dir outside it.
struct Scene {
    daemon: Daemon,
    root: PathBuf,
    victim: PathBuf,
    _dir: tempfile::TempDir,
}

impl Scene {
    fn new(extra: &[&str]) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("sandboxes");
        let victim = dir.path().join("victim");
        for w in ["w1", "w2", "w3"] {
            std::fs::create_dir_all(root.join(w)).unwrap();
        }
        std::fs::create_dir_all(&victim).unwrap();
        std::fs::write(victim.join("passwd"), "root:x:0:0").unwrap();
        let mut args = vec!["--bind-root", root.to_str().unwrap()];
        args.extend_from_slice(extra);
        let daemon = setup(dir.path(), &args);
        Self {
            daemon,
            root,
            victim,
            _dir: dir,
        }
    }

    fn bind_request(
        &self,
        volume: &str,
        workload: &str,
        bind: &Path,
    ) -> csi_agent_api::PublishRequest {
        let mut request = publish(volume, workload);
        request.bind_to = Some(bind.to_string_lossy().into_owned());
        request
    }

    fn binds(&self) -> Vec<PathBuf> {
        let mut binds = mounts_under(&self.root);
        binds.sort();
        binds
    }

    fn assert_victim_untouched(&self) {
        assert_eq!(dir_names(&self.victim), vec!["passwd".to_owned()]);
        assert!(mounts_under(&self.victim).is_empty());
    }
}

#[tokio::test]
async fn a_workload_that_swaps_its_bind_dir_for_a_symlink_blocks_only_itself() {
    let scene = Scene::new(&[]);
    let api = scene.daemon.api();
    let a_bind = scene.root.join("w1/rootfs/data");
    let b_bind = scene.root.join("w2/data");
    api.publish(&scene.bind_request("vol1", "w1", &a_bind))
        .await
        .unwrap();
    api.publish(&scene.bind_request("vol1", "w2", &b_bind))
        .await
        .unwrap();
    assert_eq!(scene.binds(), vec![a_bind.clone(), b_bind.clone()]);

    // Workload A renames its dir (its bind moves along) and plants a symlink in its place.
    let moved = scene.root.join("w1/moved");
    std::fs::rename(scene.root.join("w1/rootfs"), &moved).unwrap();
    std::os::unix::fs::symlink(&scene.victim, scene.root.join("w1/rootfs")).unwrap();

    // B unpublishes and publishes again, and a third workload joins: none of them is
    // answered with A's problem.
    api.unpublish(&unpublish("vol1", "w2")).await.unwrap();
    assert!(!scene.binds().contains(&b_bind), "{:?}", scene.binds());
    api.publish(&scene.bind_request("vol1", "w2", &b_bind))
        .await
        .unwrap();
    let c_bind = scene.root.join("w3/data");
    api.publish(&scene.bind_request("vol1", "w3", &c_bind))
        .await
        .unwrap();
    assert!(scene.binds().contains(&b_bind) && scene.binds().contains(&c_bind));

    // A's own publish fails, naming A's path and what is wrong with it.
    let (status, body) = api_error(
        api.publish(&scene.bind_request("vol1", "w1", &a_bind))
            .await,
    );
    assert_eq!(status, 409, "{}", body.message);
    assert!(
        body.message.contains(a_bind.to_str().unwrap()) && body.message.contains("symlink"),
        "{}",
        body.message
    );
    // Nothing was mounted through A's symlink.
    scene.assert_victim_untouched();

    // Everyone unpublishes; A's bind is found where it was moved and taken down there.
    for w in ["w2", "w3", "w1"] {
        api.unpublish(&unpublish("vol1", w)).await.unwrap();
    }
    assert!(scene.binds().is_empty(), "{:?}", scene.binds());
    let volumes = api.volumes().await.unwrap().volumes;
    assert!(volumes.iter().all(|v| v.claims.is_empty()), "{volumes:?}");
    scene.assert_victim_untouched();
}

#[tokio::test]
async fn a_bind_to_inside_another_workloads_moved_bind_is_refused() {
    let scene = Scene::new(&[]);
    let api = scene.daemon.api();
    let a_bind = scene.root.join("w1/rootfs/data");
    api.publish(&scene.bind_request("vol1", "w1", &a_bind))
        .await
        .unwrap();
    // A moves its bind elsewhere beneath the root, out of the path its claim reserved.
    let moved_dir = scene.root.join("w2/moved");
    std::fs::rename(scene.root.join("w1/rootfs"), &moved_dir).unwrap();
    let moved = moved_dir.join("data");
    assert_eq!(scene.binds(), vec![moved.clone()]);

    // Inside it (the same volume or another), or onto it (which would adopt A's mount as
    // B's and let B's unpublish take A's bind away): refused, naming A.
    for (volume, path) in [
        ("vol1", moved.join("inner")),
        ("vol2", moved.join("inner/deeper")),
        ("vol1", moved.clone()),
    ] {
        let (status, body) = api_error(api.publish(&scene.bind_request(volume, "w2", &path)).await);
        assert_eq!(status, 409, "{volume} {path:?}: {}", body.message);
        assert!(
            body.message.contains("lies in the bind mount") && body.message.contains("\"w1\""),
            "{}",
            body.message
        );
    }
    // No dir was left inside the volume, and nothing else was mounted.
    assert_eq!(dir_names(&moved), Vec::<String>::new());
    assert_eq!(scene.binds(), vec![moved.clone()]);

    // A's unpublish is not blocked by anything mounted in its bind.
    api.unpublish(&unpublish("vol1", "w1")).await.unwrap();
    assert!(scene.binds().is_empty(), "{:?}", scene.binds());
    // Once A's bind is gone, the same place is a plain dir that B may use.
    api.publish(&scene.bind_request("vol1", "w2", &moved))
        .await
        .unwrap();
    assert_eq!(scene.binds(), vec![moved.clone()]);
    api.unpublish(&unpublish("vol1", "w2")).await.unwrap();
    assert!(scene.binds().is_empty());
    scene.assert_victim_untouched();
}
