//! The Docker volume plugin protocol (`--volume-plugin-socket`, docs/docker-podman.md) spoken
//! to the real daemon by the test, as Docker and Podman speak it, over the real test plugin:
//! a volume name created, mounted for two mount ids (reference counted), unmounted in either
//! order and removed; bad options and hostile calls refused with nothing created; a name
//! adopted and forgotten, never deleted; the daemon SIGKILLed between Mount and Unmount, and
//! inside a create, losing nothing and creating no second volume. The same lifecycle through
//! real `dockerd` and `podman` is in `engines.rs`.
//!
//! Run as root under `unshare -m --propagation private` like the other daemon tests.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};

use csi_agent_api::ApiClient;
use csi_agent_testkit::*;
use serde_json::{Value, json};

/// The daemon with the test plugin (`vol1`, `vol2` pre-provisioned) and the protocol served on
/// `<dir>/csi.sock`.
fn daemon(dir: &Path) -> Daemon {
    require_private_mount_namespace();
    Daemon::builder(dir)
        .flag("--volume-plugin-socket")
        .flag(dir.join("csi.sock"))
        .test_plugin("vol1:1M,vol2:1M")
        .start()
}

struct Engine(ApiClient);

impl Engine {
    fn of(dir: &Path) -> Self {
        Self(ApiClient::unix(dir.join("csi.sock")))
    }

    /// One call: the status and the answer.
    async fn call(&self, route: &str, body: Value) -> (u16, Value) {
        self.0.post_raw(route, &body).await.unwrap()
    }

    /// A call that must succeed (200, `Err` empty); its answer.
    async fn ok(&self, route: &str, body: Value) -> Value {
        let (status, answer) = self.call(route, body.clone()).await;
        assert_eq!(status, 200, "{route} {body}: {answer}");
        assert_eq!(
            answer["Err"].as_str().unwrap_or(""),
            "",
            "{route}: {answer}"
        );
        answer
    }

    /// A call that must be refused (500, `{"Err": ...}`); the message.
    async fn refused(&self, route: &str, body: Value) -> String {
        let (status, answer) = self.call(route, body.clone()).await;
        assert_eq!(status, 500, "{route} {body} should be refused: {answer}");
        let message = answer["Err"].as_str().unwrap().to_owned();
        assert!(!message.is_empty(), "{route}: {answer}");
        message
    }

    async fn create(&self, name: &str, opts: Value) -> Value {
        self.ok("/VolumeDriver.Create", json!({"Name": name, "Opts": opts}))
            .await
    }

    async fn mount(&self, name: &str, id: &str) -> PathBuf {
        let answer = self
            .ok("/VolumeDriver.Mount", json!({"Name": name, "ID": id}))
            .await;
        PathBuf::from(answer["Mountpoint"].as_str().unwrap())
    }

    async fn unmount(&self, name: &str, id: &str) {
        self.ok("/VolumeDriver.Unmount", json!({"Name": name, "ID": id}))
            .await;
    }

    async fn status(&self, name: &str) -> Value {
        let answer = self.ok("/VolumeDriver.Get", json!({"Name": name})).await;
        assert_eq!(answer["Volume"]["Name"], name);
        answer["Volume"]["Status"].clone()
    }

    async fn names(&self) -> Vec<String> {
        let answer = self.ok("/VolumeDriver.List", json!({})).await;
        answer["Volumes"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v["Name"].as_str().unwrap().to_owned())
            .collect()
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_name_is_created_mounted_twice_unmounted_in_either_order_and_removed() {
    let tmp = tempfile::tempdir().unwrap();
    let daemon = daemon(tmp.path());
    let engine = Engine::of(tmp.path());
    let activated = engine.ok("/Plugin.Activate", json!(null)).await;
    assert_eq!(activated["Implements"], json!(["VolumeDriver"]));
    let caps = engine.ok("/VolumeDriver.Capabilities", json!(null)).await;
    assert_eq!(caps["Capabilities"]["Scope"], "local");
    let before = daemon.backend_volume_ids().await;

    engine
        .create(
            "v1",
            json!({"plugin": PLUGIN, "size": "2Mi", "param.tier": "fast"}),
        )
        .await;
    // Idempotent: the same create again is fine (Docker and Podman may repeat it).
    engine
        .create(
            "v1",
            json!({"plugin": PLUGIN, "size": "2Mi", "param.tier": "fast"}),
        )
        .await;
    let status = engine.status("v1").await;
    assert_eq!(status["origin"], "created");
    assert_eq!(status["state"], "CREATED");
    assert_eq!(status["capacity_bytes"], 2 << 20);
    let volume_id = status["volume_id"].as_str().unwrap().to_owned();
    let after = daemon.backend_volume_ids().await;
    assert_eq!(after.len(), before.len() + 1, "{before:?} → {after:?}");
    assert!(after.contains(&volume_id));
    assert_eq!(engine.names().await, ["v1"]);
    // Not mounted: no path is handed out (an engine binding it would write to the host).
    let path = engine.ok("/VolumeDriver.Path", json!({"Name": "v1"})).await;
    assert_eq!(path["Mountpoint"], "");

    // Two containers: two mount ids, one target.
    let first = engine.mount("v1", "aaaa").await;
    let second = engine.mount("v1", "bbbb").await;
    assert_eq!(first, second);
    assert!(is_mounted(&first), "{} is not a mount", first.display());
    std::fs::write(first.join("f"), "hi").unwrap();
    let status = engine.status("v1").await;
    assert_eq!(status["state"], "PUBLISHED");
    assert_eq!(status["mounts"], json!(["mount:aaaa", "mount:bbbb"]));
    let path = engine.ok("/VolumeDriver.Path", json!({"Name": "v1"})).await;
    assert_eq!(path["Mountpoint"], first.to_str().unwrap());

    // In use: not removed, and the message names the mounts.
    let refusal = engine
        .refused("/VolumeDriver.Remove", json!({"Name": "v1"}))
        .await;
    assert!(
        refusal.contains("in use") && refusal.contains("mount:bbbb"),
        "{refusal}"
    );

    // The first container stops: still mounted for the second.
    engine.unmount("v1", "aaaa").await;
    assert!(is_mounted(&first));
    assert_eq!(std::fs::read_to_string(first.join("f")).unwrap(), "hi");
    // An unmount repeated (an engine's retry) is no error and changes nothing.
    engine.unmount("v1", "aaaa").await;
    assert!(is_mounted(&first));
    engine.unmount("v1", "bbbb").await;
    assert!(!is_mounted(&first), "unmounted after the last mount");
    assert_eq!(engine.status("v1").await["mounts"], json!([]));

    // Mounted again later: the data is there (the same CSI volume).
    let again = engine.mount("v1", "cccc").await;
    assert_eq!(std::fs::read_to_string(again.join("f")).unwrap(), "hi");
    engine.unmount("v1", "cccc").await;

    engine
        .ok("/VolumeDriver.Remove", json!({"Name": "v1"}))
        .await;
    assert_eq!(
        daemon.backend_volume_ids().await,
        before,
        "the CSI volume is deleted"
    );
    assert!(engine.names().await.is_empty());
    let refusal = engine
        .refused("/VolumeDriver.Get", json!({"Name": "v1"}))
        .await;
    assert!(refusal.contains("no volume is named \"v1\""), "{refusal}");
    // A remove repeated (the answer of the first was lost) succeeds.
    engine
        .ok("/VolumeDriver.Remove", json!({"Name": "v1"}))
        .await;
    assert!(mounts_under(tmp.path()).is_empty());
}

#[tokio::test(flavor = "multi_thread")]
async fn bad_options_and_hostile_calls_are_refused_clearly_and_create_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let daemon = daemon(tmp.path());
    let engine = Engine::of(tmp.path());
    let before = daemon.backend_volume_ids().await;
    let long_name = "x".repeat(129);
    for (name, opts, expected) in [
        ("v1", json!({}), "option plugin is missing"),
        (
            "v1",
            json!({"plugin": PLUGIN, "colour": "red"}),
            "unknown option \"colour\"",
        ),
        (
            "v1",
            json!({"plugin": PLUGIN, "size": "big"}),
            "option size=\"big\"",
        ),
        (
            "v1",
            json!({"plugin": "org.example.none"}),
            "unknown plugin type \"org.example.none\"",
        ),
        (
            "v1",
            json!({"plugin": PLUGIN, "access_mode": "rw"}),
            "option access_mode",
        ),
        (
            "../etc",
            json!({"plugin": PLUGIN}),
            "volume name \"../etc\" is not valid",
        ),
        ("", json!({"plugin": PLUGIN}), "is not valid: it is empty"),
        (
            long_name.as_str(),
            json!({"plugin": PLUGIN}),
            "it is too long",
        ),
    ] {
        let refusal = engine
            .refused("/VolumeDriver.Create", json!({"Name": name, "Opts": opts}))
            .await;
        assert!(refusal.contains(expected), "{name} {opts}: {refusal}");
    }
    // A second create of a name with other options is refused, naming what it has.
    engine
        .create("v2", json!({"plugin": PLUGIN, "size": "1Mi"}))
        .await;
    let refusal = engine
        .refused(
            "/VolumeDriver.Create",
            json!({"Name": "v2", "Opts": {"plugin": PLUGIN, "size": "2Mi"}}),
        )
        .await;
    assert!(refusal.contains("exists with other options"), "{refusal}");
    // A mount id too long for a claim; a body that is not JSON; an unknown call.
    let refusal = engine
        .refused(
            "/VolumeDriver.Mount",
            json!({"Name": "v2", "ID": "f".repeat(200)}),
        )
        .await;
    assert!(refusal.contains("mount ID"), "{refusal}");
    let refusal = engine
        .refused("/VolumeDriver.Mount", json!({"Name": "nope", "ID": "a"}))
        .await;
    assert!(refusal.contains("no volume is named \"nope\""), "{refusal}");
    let refusal = engine.refused("/VolumeDriver.Create", json!([1, 2])).await;
    assert!(
        refusal.contains("body of VolumeDriver.Create is not valid"),
        "{refusal}"
    );
    let refusal = engine.refused("/VolumeDriver.Frobnicate", json!({})).await;
    assert!(refusal.contains("does not serve this call"), "{refusal}");

    // Nothing but v2 was created, here or in the plugin.
    assert_eq!(engine.names().await, ["v2"]);
    assert_eq!(daemon.backend_volume_ids().await.len(), before.len() + 1);
    assert!(mounts_under(tmp.path()).is_empty());
}

#[tokio::test(flavor = "multi_thread")]
async fn an_adopted_volume_is_mounted_and_forgotten_never_deleted() {
    let tmp = tempfile::tempdir().unwrap();
    let daemon = daemon(tmp.path());
    let engine = Engine::of(tmp.path());
    engine
        .create("data", json!({"plugin": PLUGIN, "volume_id": "vol1"}))
        .await;
    let status = engine.status("data").await;
    assert_eq!(status["origin"], "adopted");
    assert_eq!(status["volume_id"], "vol1");
    let target = engine.mount("data", "c1").await;
    assert!(is_mounted(&target));
    // The same volume through the HTTP API: one record, the protocol's claim on it.
    let info = daemon.api().volume(PLUGIN, "vol1").await.unwrap();
    assert_eq!(info.claims, ["mount:c1"]);
    engine.unmount("data", "c1").await;
    engine
        .ok("/VolumeDriver.Remove", json!({"Name": "data"}))
        .await;
    assert!(
        daemon
            .backend_volume_ids()
            .await
            .contains(&"vol1".to_owned())
    );
    assert!(engine.names().await.is_empty());
}

#[tokio::test(flavor = "multi_thread")]
async fn the_daemon_killed_between_mount_and_unmount_loses_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let mut daemon = daemon(tmp.path());
    let engine = Engine::of(tmp.path());
    engine
        .create("v1", json!({"plugin": PLUGIN, "secret.token": "s3cr3t"}))
        .await;
    let target = engine.mount("v1", "c1").await;
    std::fs::write(target.join("f"), "kept").unwrap();
    daemon.kill9();
    daemon.start();
    // The name, its mount and its data are all there after the restart: listed at once (its
    // plugin still loading), with its mount once recovery has read the volume's record, and
    // published again once recovery has repeated the steps whose progress notes the kill lost.
    let engine = Engine::of(tmp.path());
    assert_eq!(engine.names().await, ["v1"]);
    let mut status = json!(null);
    for _ in 0..400 {
        status = engine.status("v1").await;
        if status["state"] == "PUBLISHED" {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(25)).await;
    }
    assert_eq!(status["state"], "PUBLISHED", "{status}");
    assert_eq!(status["mounts"], json!(["mount:c1"]));
    assert_eq!(status["options"]["secret.token"], "<secret>");
    // A mount repeated by the engine's retry after the restart is the same claim.
    assert_eq!(engine.mount("v1", "c1").await, target);
    assert!(is_mounted(&target));
    assert_eq!(std::fs::read_to_string(target.join("f")).unwrap(), "kept");
    engine.unmount("v1", "c1").await;
    assert!(!is_mounted(&target));
    engine
        .ok("/VolumeDriver.Remove", json!({"Name": "v1"}))
        .await;
    // The secret never reached the database, and its file went with the name.
    let db = std::fs::read(daemon.work.join("state.db")).unwrap();
    assert!(!db.windows(6).any(|w| w == b"s3cr3t"));
    assert!(dir_names(&daemon.work.join("named")).is_empty());
    assert!(mounts_under(tmp.path()).is_empty());
}

/// The daemon SIGKILLed inside a create, at each of its failpoints (the intent committed; the
/// CreateVolume answered but its id not recorded) and inside a remove (the volume deleted, the
/// name not forgotten): the engine's repeated call finishes the job with one CSI volume, never
/// two, and none left behind.
#[tokio::test(flavor = "multi_thread")]
async fn the_daemon_killed_inside_a_create_or_a_remove_leaves_one_volume_or_none() {
    for point in [
        csi_agent::named::FP_NAME_CREATE_AFTER_INTENT,
        csi_agent::named::FP_NAME_CREATE_AFTER_RPC,
    ] {
        let tmp = tempfile::tempdir().unwrap();
        let mut daemon = daemon(tmp.path());
        let before = daemon.backend_volume_ids().await;
        daemon.stop_and_set_env("CSI_AGENT_FAILPOINTS", &format!("{point}=exit"));
        daemon.start();
        let engine = Engine::of(tmp.path());
        let lost = engine
            .0
            .post_raw(
                "/VolumeDriver.Create",
                &json!({"Name": "v1", "Opts": {"plugin": PLUGIN}}),
            )
            .await;
        assert!(lost.is_err(), "{point}: the daemon answered {lost:?}");
        daemon.wait_exit();
        daemon.set_env("CSI_AGENT_FAILPOINTS", None);
        daemon.start();
        let engine = Engine::of(tmp.path());
        // Listed meanwhile, its create unfinished.
        assert_eq!(engine.names().await, ["v1"], "{point}");
        assert_eq!(engine.status("v1").await["state"], "creating", "{point}");
        // The engine's retry finishes it: the same name, one volume.
        engine.create("v1", json!({"plugin": PLUGIN})).await;
        let volume_id = engine.status("v1").await["volume_id"]
            .as_str()
            .unwrap()
            .to_owned();
        let after = daemon.backend_volume_ids().await;
        assert_eq!(after.len(), before.len() + 1, "{point}: {after:?}");
        assert!(after.contains(&volume_id), "{point}");
    }

    let tmp = tempfile::tempdir().unwrap();
    let mut daemon = daemon(tmp.path());
    let before = daemon.backend_volume_ids().await;
    let engine = Engine::of(tmp.path());
    engine.create("v1", json!({"plugin": PLUGIN})).await;
    daemon.stop_and_set_env(
        "CSI_AGENT_FAILPOINTS",
        &format!("{}=exit", csi_agent::named::FP_NAME_REMOVE_AFTER_RPC),
    );
    daemon.start();
    let engine = Engine::of(tmp.path());
    assert!(
        engine
            .0
            .post_raw("/VolumeDriver.Remove", &json!({"Name": "v1"}))
            .await
            .is_err()
    );
    daemon.wait_exit();
    daemon.set_env("CSI_AGENT_FAILPOINTS", None);
    daemon.start();
    let engine = Engine::of(tmp.path());
    assert_eq!(engine.names().await, ["v1"], "the name outlived the kill");
    engine
        .ok("/VolumeDriver.Remove", json!({"Name": "v1"}))
        .await;
    assert!(engine.names().await.is_empty());
    assert_eq!(daemon.backend_volume_ids().await, before);
}
