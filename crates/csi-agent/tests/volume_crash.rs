//! Crash safety: for every failpoint of the volume path, a child process running the engine
//! is killed there (SIGKILL, from the armed failpoint), a fresh engine recovers from disk, and
//! the volume must converge to what its claims want — no leaked mount, no lost claim, no
//! orphan record. One test per point; the list is documented in docs/recovery.md (a test
//! below keeps the two in step).
//!
//! Runs under `unshare -m --propagation private` (real bind mounts through the real
//! `csi-testplugin`).
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod volume_support;

use std::path::{Path, PathBuf};
use std::process::Command;

use csi_agent::failpoint::{self, Action};
use csi_agent::mounts::require_private_mount_namespace;
use csi_agent::volume::{VolumeSecrets, VolumeState};
use volume_support::*;

/// Which half of the cycle the crash happens in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    Publish,
    Unpublish,
}

/// Every crash point: (name, nth hit within the phase, phase, whether the claim was durable
/// when the crash happened — for the unpublish phase: whether its removal was not). Each
/// operation makes one durable write (its desired state: the claim or its removal, commit #1
/// of the phase); every step after it is a progress note, committed by commit #2 (the child
/// flushes after the operation, as a later operation's commit would).
const POINTS: &[(&str, u64, Phase, bool)] = &[
    ("volume.secrets.after_write", 1, Phase::Publish, false),
    ("store.write.before_rename", 1, Phase::Publish, false),
    ("store.write.after_rename", 1, Phase::Publish, false),
    ("volume.desire.before_write", 1, Phase::Publish, false),
    ("store.commit.before", 1, Phase::Publish, false),
    ("store.commit.after", 1, Phase::Publish, true),
    ("volume.desire.after_write", 1, Phase::Publish, true),
    (
        "volume.controller_publish.before_intent",
        1,
        Phase::Publish,
        true,
    ),
    (
        "volume.controller_publish.before_rpc",
        1,
        Phase::Publish,
        true,
    ),
    (
        "volume.controller_publish.after_rpc",
        1,
        Phase::Publish,
        true,
    ),
    ("volume.node_stage.before_intent", 1, Phase::Publish, true),
    ("volume.node_stage.before_rpc", 1, Phase::Publish, true),
    ("volume.node_stage.after_rpc", 1, Phase::Publish, true),
    ("volume.node_publish.before_intent", 1, Phase::Publish, true),
    ("volume.node_publish.before_rpc", 1, Phase::Publish, true),
    ("volume.node_publish.after_rpc", 1, Phase::Publish, true),
    ("volume.final.before_write", 1, Phase::Publish, true),
    ("volume.final.after_write", 1, Phase::Publish, true),
    ("volume.publish.before_answer", 1, Phase::Publish, true),
    ("store.commit.before", 2, Phase::Publish, true),
    ("store.commit.after", 2, Phase::Publish, true),
    ("volume.desire.before_write", 1, Phase::Unpublish, true),
    ("store.commit.before", 1, Phase::Unpublish, true),
    ("store.commit.after", 1, Phase::Unpublish, false),
    ("volume.desire.after_write", 1, Phase::Unpublish, false),
    (
        "volume.node_unpublish.before_intent",
        1,
        Phase::Unpublish,
        false,
    ),
    (
        "volume.node_unpublish.before_rpc",
        1,
        Phase::Unpublish,
        false,
    ),
    (
        "volume.node_unpublish.after_rpc",
        1,
        Phase::Unpublish,
        false,
    ),
    (
        "volume.node_unstage.before_intent",
        1,
        Phase::Unpublish,
        false,
    ),
    ("volume.node_unstage.before_rpc", 1, Phase::Unpublish, false),
    ("volume.node_unstage.after_rpc", 1, Phase::Unpublish, false),
    (
        "volume.controller_unpublish.before_intent",
        1,
        Phase::Unpublish,
        false,
    ),
    (
        "volume.controller_unpublish.before_rpc",
        1,
        Phase::Unpublish,
        false,
    ),
    (
        "volume.controller_unpublish.after_rpc",
        1,
        Phase::Unpublish,
        false,
    ),
    ("volume.record.before_delete", 1, Phase::Unpublish, false),
    ("volume.record.after_delete", 1, Phase::Unpublish, false),
    ("store.commit.before", 2, Phase::Unpublish, false),
    ("store.commit.after", 2, Phase::Unpublish, false),
];

const VOLUME: &str = "vol";
const WORKLOAD: &str = "w1";
const BOOT: &str = "boot-a";

fn request() -> csi_agent::volume::PublishRequest {
    let mut request = publish_request(VOLUME, WORKLOAD);
    request.secrets = VolumeSecrets {
        node_stage: secrets(&[("k", "v")]),
        node_publish: secrets(&[]),
    };
    request
}

/// The child: runs one phase with the failpoint armed, and must be killed by it.
#[tokio::test]
#[ignore = "run by crash_at() in a child process"]
async fn child_scenario() {
    let (Ok(work), Ok(socket), Ok(phase), Ok(point), Ok(nth)) = (
        std::env::var("CRASH_WORK"),
        std::env::var("CRASH_SOCKET"),
        std::env::var("CRASH_PHASE"),
        std::env::var("CRASH_POINT"),
        std::env::var("CRASH_NTH"),
    ) else {
        panic!("child_scenario only runs as a child of crash_at()");
    };
    let nth: u64 = nth.parse().unwrap();
    let manager = manager(Path::new(&work), Path::new(&socket), BOOT);
    if phase == "unpublish" {
        manager.publish(request()).await.unwrap();
        // Its notes committed, so that the unpublish's commits are counted from its own.
        manager.flush().await.unwrap();
    }
    failpoint::arm_nth(&point, nth, Action::Exit);
    if phase == "publish" {
        let _ = manager.publish(request()).await;
    } else {
        let _ = manager.unpublish(VOLUME, WORKLOAD).await;
    }
    // The operation's progress notes, committed as a later operation's write would.
    let _ = manager.flush().await;
    println!("CHILD COMPLETED WITHOUT CRASHING");
}

async fn crash_at(point: &str, nth: u64, phase: Phase, claim_durable: bool) {
    require_private_mount_namespace();
    let dir = tempfile::tempdir().unwrap();
    let plugin = TestPlugin::start(dir.path(), &["--volumes", "vol:1M"]);
    let work = dir.path().join("agent");
    let output = Command::new(std::env::current_exe().unwrap())
        .args([
            "child_scenario",
            "--exact",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("CRASH_WORK", &work)
        .env("CRASH_SOCKET", &plugin.socket)
        .env(
            "CRASH_PHASE",
            if phase == Phase::Publish {
                "publish"
            } else {
                "unpublish"
            },
        )
        .env("CRASH_POINT", point)
        .env("CRASH_NTH", nth.to_string())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    use std::os::unix::process::ExitStatusExt;
    assert_eq!(
        output.status.signal(),
        Some(9),
        "the child was not killed at {point} (#{nth}): {:?}\n{stdout}\n{}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(!stdout.contains("CHILD COMPLETED"));

    // A fresh engine over the same work dir, same boot.
    let manager = manager(&work, &plugin.socket, BOOT);
    manager.recover().await.unwrap();
    let target = manager.target_path(VOLUME);
    if claim_durable {
        // The claim survived: the volume must end up published for it.
        eventually(&format!("published again after a crash at {point}"), || {
            mounts_under(&work).contains(&target)
        })
        .await;
        let record = manager.get(VOLUME).await.unwrap();
        assert!(record.claims.contains(WORKLOAD), "claim lost at {point}");
        wait_for_state(&manager, VolumeState::Published).await;
    } else {
        // No claim: nothing may stay mounted, no record may stay behind.
        eventually(&format!("cleaned after a crash at {point}"), || {
            mounts_under(&work).is_empty() && records(&work).is_empty()
        })
        .await;
        assert!(manager.get(VOLUME).await.is_none());
    }
    // Whatever happened, the workload's unpublish cleans everything.
    manager.unpublish(VOLUME, WORKLOAD).await.unwrap();
    manager.flush().await.unwrap();
    assert!(mounts_under(&work).is_empty(), "{:?}", mounts_under(&work));
    assert!(records(&work).is_empty(), "{:?}", records(&work));
    assert!(mounts_under(&plugin.work).is_empty());
    assert_no_stray_dirs(&work);
    // The plugin agrees: nothing of the volume is staged or published any more.
    let state = std::fs::read_to_string(plugin.work.join("state.json")).unwrap_or_default();
    assert!(
        !state.contains("/mounts/vol/"),
        "plugin still tracks a path: {state}"
    );
}

async fn wait_for_state(manager: &csi_agent::volume::VolumeManager, state: VolumeState) {
    for _ in 0..1500 {
        if manager.get(VOLUME).await.map(|r| r.state) == Some(state) {
            return;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    panic!(
        "volume never reached {state:?}: {:?}",
        manager.get(VOLUME).await
    );
}

fn assert_no_stray_dirs(work: &Path) {
    let mounts = csi_agent::layout::Layout::new(work).mounts_dir(PLUGIN_TYPE, "default");
    let left: Vec<PathBuf> = std::fs::read_dir(&mounts)
        .map(|entries| entries.flatten().map(|e| e.path()).collect())
        .unwrap_or_default();
    assert!(left.is_empty(), "mount dirs left behind: {left:?}");
}

macro_rules! crash_tests {
    ($($name:ident => $index:expr;)*) => {
        $(
            #[tokio::test]
            async fn $name() {
                let (point, nth, phase, durable) = POINTS[$index];
                crash_at(point, nth, phase, durable).await;
            }
        )*
        #[test]
        fn every_point_has_a_test() {
            let indices: Vec<usize> = vec![$($index),*];
            let mut sorted = indices.clone();
            sorted.sort_unstable();
            sorted.dedup();
            assert_eq!(sorted, (0..POINTS.len()).collect::<Vec<_>>());
        }
    };
}

crash_tests! {
    crash_publish_after_secrets_write => 0;
    crash_publish_secrets_write_before_rename => 1;
    crash_publish_secrets_write_after_rename => 2;
    crash_publish_before_claim_write => 3;
    crash_publish_claim_commit_before => 4;
    crash_publish_claim_commit_after => 5;
    crash_publish_after_claim_write => 6;
    crash_before_controller_publish_intent => 7;
    crash_before_controller_publish_rpc => 8;
    crash_after_controller_publish_rpc => 9;
    crash_before_node_stage_intent => 10;
    crash_before_node_stage_rpc => 11;
    crash_after_node_stage_rpc => 12;
    crash_before_node_publish_intent => 13;
    crash_before_node_publish_rpc => 14;
    crash_after_node_publish_rpc => 15;
    crash_before_final_publish_note => 16;
    crash_after_final_publish_note => 17;
    crash_before_publish_answer => 18;
    crash_publish_notes_commit_before => 19;
    crash_publish_notes_commit_after => 20;
    crash_unpublish_before_claim_removal => 21;
    crash_unpublish_removal_commit_before => 22;
    crash_unpublish_removal_commit_after => 23;
    crash_unpublish_after_claim_removal => 24;
    crash_before_node_unpublish_intent => 25;
    crash_before_node_unpublish_rpc => 26;
    crash_after_node_unpublish_rpc => 27;
    crash_before_node_unstage_intent => 28;
    crash_before_node_unstage_rpc => 29;
    crash_after_node_unstage_rpc => 30;
    crash_before_controller_unpublish_intent => 31;
    crash_before_controller_unpublish_rpc => 32;
    crash_after_controller_unpublish_rpc => 33;
    crash_before_record_delete => 34;
    crash_after_record_delete => 35;
    crash_unpublish_notes_commit_before => 36;
    crash_unpublish_notes_commit_after => 37;
}

#[test]
fn the_documented_list_matches_the_tested_points() {
    let doc = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/recovery.md"),
    )
    .expect("docs/recovery.md");
    for (point, _, _, _) in POINTS {
        assert!(
            doc.contains(point),
            "docs/recovery.md does not list {point}"
        );
    }
}
