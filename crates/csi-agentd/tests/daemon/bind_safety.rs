//! `bind_to` as an attacker would use it, on the real daemon with real mounts: symlinks at
//! the end and in the middle of the path, components swapped between publish and unpublish,
//! foreign mount points, shared and nested paths, hand-edited records, a crash between the
//! bind and its record. Each case checks from outside (`/proc/self/mountinfo`, the victim
//! dirs) that nothing outside the bind root was mounted, created or unmounted.
//! Also: one daemon per work dir. Run under `unshare -m --propagation private`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use csi_agent_testkit::*;

/// A daemon with `<dir>/sandboxes` as its bind root, and a victim dir outside it holding a
/// tmpfs with a marker file (standing in for `/etc`: something a workload must never reach).
struct Scene {
    daemon: Daemon,
    root: PathBuf,
    victim: PathBuf,
    dir: tempfile::TempDir,
}

impl Scene {
    fn new() -> Self {
        Self::with_extra(&[])
    }

    fn with_extra(extra: &[&str]) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("sandboxes");
        let victim = dir.path().join("victim");
        std::fs::create_dir_all(root.join("w1")).unwrap();
        std::fs::create_dir_all(&victim).unwrap();
        mount_tmpfs(&victim);
        std::fs::write(victim.join("passwd"), "root:x:0:0").unwrap();
        let mut args = vec!["--bind-root", root.to_str().unwrap()];
        args.extend_from_slice(extra);
        let daemon = setup(dir.path(), &args);
        Self {
            daemon,
            root,
            victim,
            dir,
        }
    }

    /// The victim is still exactly one tmpfs with its marker, untouched and unshadowed.
    fn assert_victim_intact(&self) {
        let on_victim: Vec<_> = mounts_under(&self.victim);
        assert_eq!(
            on_victim,
            vec![self.victim.clone()],
            "mounts on the victim: {on_victim:?}"
        );
        assert_eq!(
            std::fs::read_to_string(self.victim.join("passwd")).unwrap(),
            "root:x:0:0"
        );
        let entries: Vec<_> = std::fs::read_dir(&self.victim)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(
            entries.len(),
            1,
            "something was created in the victim: {entries:?}"
        );
    }

    fn binds(&self) -> Vec<PathBuf> {
        mounts_under(&self.root)
    }
}

fn mount_tmpfs(at: &Path) {
    let status = Command::new("mount")
        .args(["-t", "tmpfs", "tmpfs"])
        .arg(at)
        .status()
        .unwrap();
    assert!(status.success(), "mount tmpfs on {}", at.display());
}

fn symlink(target: &Path, at: &Path) {
    std::os::unix::fs::symlink(target, at).unwrap();
}

async fn expect_refusal(
    scene: &Scene,
    request: &csi_agent_api::PublishRequest,
    status: u16,
    wanted: &str,
) {
    let (got, body) = api_error(scene.daemon.api().publish(request).await);
    assert_eq!(got, status, "{}", body.message);
    assert!(body.message.contains(wanted), "{}", body.message);
}

#[tokio::test]
async fn a_symlink_at_the_end_or_in_the_middle_of_bind_to_is_refused() {
    let scene = Scene::new();
    // The last component is a symlink to the victim (the /etc of the report).
    symlink(&scene.victim, &scene.root.join("w1/data"));
    let last = publish_bound("vol1", "w1", &scene.root.join("w1/data"));
    expect_refusal(&scene, &last, 409, "symlink").await;
    // A parent component is a symlink: nothing may be created or mounted through it.
    symlink(&scene.victim, &scene.root.join("w1/rootfs"));
    let middle = publish_bound("vol1", "w1", &scene.root.join("w1/rootfs/new/data"));
    expect_refusal(&scene, &middle, 409, "symlink").await;
    // A relative symlink climbing out is no better.
    symlink(Path::new("../../victim"), &scene.root.join("w1/up"));
    let up = publish_bound("vol1", "w1", &scene.root.join("w1/up/data"));
    expect_refusal(&scene, &up, 409, "symlink").await;
    scene.assert_victim_intact();
    assert!(scene.binds().is_empty());
    // The refused publishes withdrew their claim and left the volume idle.
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let volumes = scene.daemon.api().volumes().await.unwrap().volumes;
        if volumes
            .iter()
            .all(|v| v.claims.is_empty() && v.state == "CREATED")
        {
            break;
        }
        assert!(Instant::now() < deadline, "{volumes:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(mounts_under(&scene.daemon.work).is_empty());
}

#[tokio::test]
async fn bad_bind_paths_get_a_400_before_anything_happens() {
    let scene = Scene::new();
    let root = scene.root.to_str().unwrap().to_owned();
    let work = scene.daemon.work.to_str().unwrap().to_owned();
    let target = format!("{work}/csi/{PLUGIN}/default/mounts/vol1/target");
    for (path, wanted) in [
        ("/".to_owned(), "not beneath a --bind-root"),
        ("relative/data".to_owned(), "not an absolute path"),
        (
            scene.victim.to_str().unwrap().to_owned(),
            "not beneath a --bind-root",
        ),
        (format!("{root}/w1/../../victim"), "'..'"),
        (format!("{root}//w1/data"), "normalised"),
        (format!("{root}/w1/./data"), "'.'"),
        (format!("{root}/w1/data/"), "normalised"),
        (format!("{root}/w1/da\0ta"), "NUL"),
        (format!("{root}/{}", "a".repeat(300)), "longer than 255"),
        (root.clone(), "not beneath a --bind-root"),
        (target, "not beneath a --bind-root"),
        (format!("{work}/api.sock"), "not beneath a --bind-root"),
    ] {
        let mut request = publish_request("vol1", "w1");
        request.bind_to = Some(path.clone());
        expect_refusal(&scene, &request, 400, wanted).await;
    }
    // Nothing was recorded, so no RPC was made for any of them.
    assert!(
        scene
            .daemon
            .api()
            .volumes()
            .await
            .unwrap()
            .volumes
            .is_empty()
    );
    let calls =
        std::fs::read_to_string(scene.dir.path().join("plugin/calls.jsonl")).unwrap_or_default();
    assert!(!calls.contains("NodePublishVolume"), "{calls}");
    scene.assert_victim_intact();
}

#[tokio::test]
async fn without_a_bind_root_bind_to_is_refused_naming_the_flag() {
    let dir = tempfile::tempdir().unwrap();
    let daemon = setup(dir.path(), &[]);
    let mut request = publish_request("vol1", "w1");
    request.bind_to = Some(
        dir.path()
            .join("sandbox/data")
            .to_string_lossy()
            .into_owned(),
    );
    let (status, body) = api_error(daemon.api().publish(&request).await);
    assert_eq!(status, 400);
    assert!(body.message.contains("--bind-root"), "{}", body.message);
    assert!(!dir.path().join("sandbox").exists());
}

#[tokio::test]
async fn a_bind_root_overlapping_the_work_dir_or_missing_is_refused_at_start() {
    let dir = tempfile::tempdir().unwrap();
    let work = dir.path().join("work");
    std::fs::create_dir_all(&work).unwrap();
    for (root, wanted) in [
        (dir.path().to_path_buf(), "overlaps the work dir"),
        (work.join("csi"), "cannot resolve"),
        (PathBuf::from("/"), "whole host"),
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_csi-agentd"))
            .args(["serve", "--work-dir"])
            .arg(&work)
            .arg("--bind-root")
            .arg(&root)
            .output()
            .unwrap();
        assert!(!out.status.success());
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains(wanted), "{}: {stderr}", root.display());
    }
}

#[tokio::test]
async fn bind_creates_only_beneath_the_root_and_removes_what_it_created() {
    let scene = Scene::new();
    let api = scene.daemon.api();
    let bind = scene.root.join("w1/rootfs/mnt/data");
    let published = api
        .publish(&publish_bound("vol1", "w1", &bind))
        .await
        .unwrap();
    assert_eq!(published.bind_to.as_deref(), Some(bind.to_str().unwrap()));
    assert_eq!(scene.binds(), vec![bind.clone()]);
    std::fs::write(bind.join("seen"), b"1").unwrap();
    assert!(scene.dir.path().join("plugin/volumes/vol1/seen").exists());
    // The retried publish is idempotent and answers the same.
    let again = api
        .publish(&publish_bound("vol1", "w1", &bind))
        .await
        .unwrap();
    assert_eq!(again.bind_to, published.bind_to);
    assert_eq!(scene.binds(), vec![bind.clone()], "no second mount stacked");
    api.unpublish(&unpublish_request("vol1", "w1"))
        .await
        .unwrap();
    assert!(scene.binds().is_empty());
    assert!(
        !scene.root.join("w1/rootfs").exists(),
        "the dirs csi-agent created go with the bind"
    );
    assert!(scene.root.join("w1").is_dir(), "what existed before stays");
    scene.assert_victim_intact();
}

#[tokio::test]
async fn a_dir_created_for_one_claim_and_shared_by_another_goes_with_the_last() {
    let scene = Scene::new();
    let api = scene.daemon.api();
    // The first bind creates `pod/` and its own dirs; the second creates only its own below
    // the `pod/` the first made.
    let first = scene.root.join("pod/a/data");
    let second = scene.root.join("pod/b/data");
    api.publish(&publish_bound("vol1", "w1", &first))
        .await
        .unwrap();
    api.publish(&publish_bound("vol2", "w2", &second))
        .await
        .unwrap();
    let mut binds = scene.binds();
    binds.sort();
    assert_eq!(binds, vec![first.clone(), second.clone()]);
    api.unpublish(&unpublish_request("vol1", "w1"))
        .await
        .unwrap();
    assert!(
        !scene.root.join("pod/a").exists(),
        "the first claim's own dirs go"
    );
    assert!(
        second.is_dir(),
        "the shared parent stays while the second claim uses it"
    );
    api.unpublish(&unpublish_request("vol2", "w2"))
        .await
        .unwrap();
    assert!(
        !scene.root.join("pod").exists(),
        "the parent csi-agent created goes with the last claim beneath it"
    );
    assert!(scene.root.join("w1").is_dir(), "what existed before stays");
    scene.assert_victim_intact();
}

#[tokio::test]
async fn a_component_swapped_for_a_symlink_before_unpublish_never_unmounts_the_wrong_thing() {
    let scene = Scene::new();
    let api = scene.daemon.api();
    let bind = scene.root.join("w1/rootfs/data");
    std::fs::create_dir_all(scene.root.join("w1/rootfs")).unwrap();
    api.publish(&publish_bound("vol1", "w1", &bind))
        .await
        .unwrap();
    assert_eq!(scene.binds(), vec![bind.clone()]);

    // The workload renames its rootfs (the mount moves with it) and plants a symlink to the
    // victim where it was: `<bind>` now names the victim's tmpfs... if one followed links.
    let moved = scene.root.join("w1/moved");
    std::fs::rename(scene.root.join("w1/rootfs"), &moved).unwrap();
    std::fs::create_dir_all(scene.victim.join("data")).unwrap_or(());
    symlink(&scene.victim, &scene.root.join("w1/rootfs"));
    api.unpublish(&unpublish_request("vol1", "w1"))
        .await
        .unwrap();
    // Our mount was found by its id where it went (still beneath the root) and unmounted
    // there; the victim's tmpfs was not touched.
    assert!(scene.binds().is_empty(), "{:?}", scene.binds());
    std::fs::remove_dir(scene.victim.join("data")).unwrap();
    scene.assert_victim_intact();
    assert!(mounts_under(&scene.daemon.work).is_empty());
}

#[tokio::test]
async fn a_bind_moved_outside_the_roots_is_left_alone_and_the_claim_kept() {
    let scene = Scene::new();
    let api = scene.daemon.api();
    let bind = scene.root.join("w1/rootfs/data");
    std::fs::create_dir_all(scene.root.join("w1/rootfs")).unwrap();
    api.publish(&publish_bound("vol1", "w1", &bind))
        .await
        .unwrap();
    // Moved out of the bind root entirely (the same file system, so rename works).
    let outside = scene.dir.path().join("outside");
    std::fs::rename(scene.root.join("w1/rootfs"), &outside).unwrap();
    let (status, body) = api_error(api.unpublish(&unpublish_request("vol1", "w1")).await);
    assert!(status == 409 || status == 500, "{status}: {}", body.message);
    assert!(
        body.message.contains("outside every --bind-root"),
        "{}",
        body.message
    );
    // Nothing was unmounted: the bind is still there, and the claim still recorded.
    assert!(mounts_under(&outside).contains(&outside.join("data")));
    let volume = api.volume(PLUGIN, "vol1").await.unwrap();
    assert!(volume.claims.contains(&"w1".to_owned()), "{volume:?}");
    // Moved back, the unpublish completes.
    std::fs::rename(&outside, scene.root.join("w1/rootfs")).unwrap();
    api.unpublish(&unpublish_request("vol1", "w1"))
        .await
        .unwrap();
    assert!(scene.binds().is_empty());
    assert!(
        mounts_under(scene.dir.path())
            .iter()
            .all(|m| m.starts_with(&scene.victim))
    );
}

#[tokio::test]
async fn foreign_mount_points_shared_and_nested_paths_are_refused() {
    let scene = Scene::new();
    let api = scene.daemon.api();
    // A mount point that is not ours.
    let foreign = scene.root.join("w1/foreign");
    std::fs::create_dir_all(&foreign).unwrap();
    mount_tmpfs(&foreign);
    std::fs::write(foreign.join("theirs"), "x").unwrap();
    expect_refusal(
        &scene,
        &publish_bound("vol1", "w1", &foreign),
        409,
        "already a mount point",
    )
    .await;
    assert_eq!(
        std::fs::read_to_string(foreign.join("theirs")).unwrap(),
        "x"
    );

    // Two claims on one path, and paths nested inside or around another claim's.
    let bind = scene.root.join("w1/data");
    api.publish(&publish_bound("vol1", "w1", &bind))
        .await
        .unwrap();
    expect_refusal(
        &scene,
        &publish_bound("vol2", "w2", &bind),
        409,
        "already used by",
    )
    .await;
    expect_refusal(
        &scene,
        &publish_bound("vol2", "w2", &bind.join("inner")),
        409,
        "already used by",
    )
    .await;
    expect_refusal(
        &scene,
        &publish_bound("vol2", "w2", &scene.root.join("w1")),
        409,
        "already used by",
    )
    .await;
    // The same workload asking for another path for the same volume.
    expect_refusal(
        &scene,
        &publish_bound("vol1", "w1", &scene.root.join("w1/other")),
        409,
        "unpublish it first",
    )
    .await;
    api.unpublish(&unpublish_request("vol1", "w1"))
        .await
        .unwrap();
    // The foreign mount survived every unpublish.
    assert_eq!(mounts_under(&scene.root), vec![foreign.clone()]);
    // Freed, the path can be used by another claim.
    api.publish(&publish_bound("vol2", "w2", &bind))
        .await
        .unwrap();
    api.unpublish(&unpublish_request("vol2", "w2"))
        .await
        .unwrap();
    assert_eq!(mounts_under(&scene.root), vec![foreign]);
    scene.assert_victim_intact();
}

#[tokio::test]
async fn a_symlink_swapped_in_between_two_publishes_is_refused() {
    let scene = Scene::new();
    let api = scene.daemon.api();
    let bind = scene.root.join("w1/rootfs/data");
    api.publish(&publish_bound("vol1", "w1", &bind))
        .await
        .unwrap();
    api.unpublish(&unpublish_request("vol1", "w1"))
        .await
        .unwrap();
    std::fs::create_dir_all(scene.root.join("w1")).unwrap();
    let _ = std::fs::remove_dir_all(scene.root.join("w1/rootfs"));
    symlink(&scene.victim, &scene.root.join("w1/rootfs"));
    expect_refusal(&scene, &publish_bound("vol1", "w1", &bind), 409, "symlink").await;
    scene.assert_victim_intact();
    assert!(scene.binds().is_empty());
}

#[tokio::test]
async fn a_hand_edited_record_cannot_make_the_daemon_unmount_or_mount_outside() {
    let mut scene = Scene::new();
    let bind = scene.root.join("w1/data");
    scene
        .daemon
        .api()
        .publish(&publish_bound("vol1", "w1", &bind))
        .await
        .unwrap();
    scene.daemon.kill9();
    // Forge the record: the bind now "is" the victim (a mount point outside every root).
    edit_record(&scene.daemon.work, "vol1", |record| {
        record["bind_mounts"]["w1"]["path"] =
            serde_json::Value::String(scene.victim.to_string_lossy().into_owned());
    });
    scene.daemon.start();
    let api = scene.daemon.api();
    // The forged entry is refused, reported on the volume, and never acted on.
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let volume = api.volume(PLUGIN, "vol1").await.unwrap();
        if volume
            .last_error
            .as_deref()
            .is_some_and(|e| e.contains("not beneath a --bind-root"))
        {
            break;
        }
        assert!(Instant::now() < deadline, "not reported: {volume:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    scene.assert_victim_intact();
    api.unpublish(&unpublish_request("vol1", "w1"))
        .await
        .unwrap();
    scene.assert_victim_intact();
    // Our real bind at the old path is not in the record any more: it is left for the
    // operator (never guessed at), and the volume's own target is cleaned.
    assert!(mounts_under(&scene.daemon.work).is_empty());
    assert!(api.volumes().await.unwrap().volumes.is_empty());
}

#[tokio::test]
async fn a_crash_between_the_bind_and_its_record_is_adopted_not_doubled() {
    let mut scene = Scene::with_extra(&[]);
    scene
        .daemon
        .stop_and_set_env("CSI_AGENT_FAILPOINTS", "volume.bind.after_mount=exit");
    scene.daemon.start();
    let bind = scene.root.join("w1/data");
    let result = scene
        .daemon
        .api()
        .publish(&publish_bound("vol1", "w1", &bind))
        .await;
    assert!(
        result.is_err(),
        "the daemon dies at the failpoint: {result:?}"
    );
    scene.daemon.wait_exit();
    assert_eq!(
        scene.binds(),
        vec![bind.clone()],
        "mounted, not yet recorded"
    );
    scene.daemon.stop_and_set_env("CSI_AGENT_FAILPOINTS", "");
    scene.daemon.start();
    let api = scene.daemon.api();
    let published = api
        .publish(&publish_bound("vol1", "w1", &bind))
        .await
        .unwrap();
    assert_eq!(published.state, "PUBLISHED");
    assert_eq!(
        scene.binds(),
        vec![bind.clone()],
        "adopted, not mounted twice"
    );
    api.unpublish(&unpublish_request("vol1", "w1"))
        .await
        .unwrap();
    assert!(scene.binds().is_empty());
    assert!(mounts_under(&scene.daemon.work).is_empty());
}

#[tokio::test]
async fn a_crash_while_making_the_dirs_of_a_bind_leaves_nothing_once_unpublished() {
    crash_while_making_bind_dirs("beneath.mkdir.before_rename").await;
}

#[tokio::test]
async fn a_crash_before_a_new_dir_is_marked_leaves_nothing_once_unpublished() {
    // Killed between the temporary dir's mkdir and its mark: unmarked, it is still purged,
    // since it lies in a dir csi-agent made.
    crash_while_making_bind_dirs("beneath.mkdir.before_mark").await;
}

/// Kills the daemon at `point` while it makes `mnt` inside the `rootfs` it just made for a
/// bind; the retried publish and the unpublish must leave no dir behind.
async fn crash_while_making_bind_dirs(point: &str) {
    let mut scene = Scene::with_extra(&[]);
    // `rootfs` is made and renamed into place; the daemon dies while `mnt` is being made
    // inside it, leaving `mnt`'s temporary dir behind.
    scene
        .daemon
        .stop_and_set_env("CSI_AGENT_FAILPOINTS", &format!("{point}=2*exit"));
    scene.daemon.start();
    let bind = scene.root.join("w1/rootfs/mnt/data");
    let result = scene
        .daemon
        .api()
        .publish(&publish_bound("vol1", "w1", &bind))
        .await;
    assert!(
        result.is_err(),
        "the daemon dies at the failpoint: {result:?}"
    );
    scene.daemon.wait_exit();
    let left: Vec<String> = std::fs::read_dir(scene.root.join("w1/rootfs"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert!(
        left.len() == 1 && left[0].starts_with(".csi-agent-mkdir."),
        "only the temporary dir of `mnt` is there: {left:?}"
    );
    assert!(
        !scene.root.join("w1/rootfs/mnt").exists(),
        "never unmarked under its name"
    );
    scene.daemon.stop_and_set_env("CSI_AGENT_FAILPOINTS", "");
    scene.daemon.start();
    let api = scene.daemon.api();
    // Whatever recovery made of the lost attempt, the retried publish binds and the unpublish
    // removes every dir made for it, the stale temporary one included.
    api.publish(&publish_bound("vol1", "w1", &bind))
        .await
        .unwrap();
    assert_eq!(scene.binds(), vec![bind.clone()]);
    api.unpublish(&unpublish_request("vol1", "w1"))
        .await
        .unwrap();
    assert!(scene.binds().is_empty());
    assert!(
        !scene.root.join("w1/rootfs").exists(),
        "the dirs made for the bind are gone, the killed attempt's too"
    );
    assert!(scene.root.join("w1").is_dir(), "what existed before stays");
    scene.assert_victim_intact();
}

#[tokio::test]
async fn a_published_record_whose_bind_is_missing_is_bound_again() {
    let mut scene = Scene::new();
    let bind = scene.root.join("w1/data");
    scene
        .daemon
        .api()
        .publish(&publish_bound("vol1", "w1", &bind))
        .await
        .unwrap();
    // The bind vanishes behind the daemon's back (as after a crash before it was made).
    let umount = Command::new("umount").arg(&bind).status().unwrap();
    assert!(umount.success());
    // A retried publish checks the bind instead of trusting the record.
    let api = scene.daemon.api();
    api.publish(&publish_bound("vol1", "w1", &bind))
        .await
        .unwrap();
    assert_eq!(scene.binds(), vec![bind.clone()]);
    // And so does recovery after a restart.
    let umount = Command::new("umount").arg(&bind).status().unwrap();
    assert!(umount.success());
    scene.daemon.kill9();
    scene.daemon.start();
    let deadline = Instant::now() + Duration::from_secs(20);
    while scene.binds() != vec![bind.clone()] {
        assert!(Instant::now() < deadline, "recovery did not bind again");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    scene
        .daemon
        .api()
        .unpublish(&unpublish_request("vol1", "w1"))
        .await
        .unwrap();
    assert!(scene.binds().is_empty());
}

#[tokio::test]
async fn a_second_daemon_on_the_same_work_dir_is_refused_and_the_first_keeps_serving() {
    let scene = Scene::new();
    let other_socket = scene.dir.path().join("second.sock");
    let out = Command::new(env!("CARGO_BIN_EXE_csi-agentd"))
        .args(["serve", "--work-dir"])
        .arg(&scene.daemon.work)
        .arg("--api-socket")
        .arg(&other_socket)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("in use by another csi-agentd (pid"),
        "{stderr}"
    );
    assert!(!other_socket.exists());
    // The first one still answers on its own socket, which nobody removed.
    assert!(scene.daemon.socket.exists());
    scene.daemon.api().health().await.unwrap();
}

#[tokio::test]
async fn unbinds_blocked_in_the_kernel_stall_no_read() {
    // The daemon's one async worker (its default `--worker-threads`), two unpublishes each
    // stuck 3 s inside their unbind (a failpoint sleeping where the umount is): the blocking
    // calls must hand the worker's other tasks over, or the daemon could not answer anything
    // until they return.
    let mut scene = Scene::with_extra(&[]);
    let api = scene.daemon.api();
    for i in 1..=2 {
        let bind = scene.root.join(format!("w{i}/data"));
        api.publish(&publish_bound(&format!("vol{i}"), &format!("w{i}"), &bind))
            .await
            .unwrap();
    }
    scene.daemon.stop_and_set_env(
        "CSI_AGENT_FAILPOINTS",
        "volume.unbind.after_unmount=sleep(3000)",
    );
    scene.daemon.start();
    let api = scene.daemon.api();
    api.health().await.unwrap();
    let unpublishes: Vec<_> = (1..=2)
        .map(|i| {
            let api = api.clone();
            tokio::spawn(async move {
                api.unpublish(&unpublish_request(&format!("vol{i}"), &format!("w{i}")))
                    .await
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let started = Instant::now();
    let health = api.health().await;
    let listed = api.volumes().await;
    let took = started.elapsed();
    println!("health and list while two unbinds block: {took:?}");
    assert!(health.is_ok() && listed.is_ok(), "{health:?} {listed:?}");
    assert!(
        took < Duration::from_millis(500),
        "reads waited {took:?} behind blocking unbinds"
    );
    for unpublished in unpublishes {
        unpublished.await.unwrap().unwrap();
    }
    assert!(scene.binds().is_empty());
}
