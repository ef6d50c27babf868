//! Shared helpers of the volume tests: the real `csi-testplugin` binary as a child process
//! (optionally restarted whenever it exits), its call log, and a volume manager wired to it.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use csi_agent::client::ClientOptions;
use csi_agent::config::Service;
use csi_agent::endpoints::FixedEndpoints;
use csi_agent::layout::Layout;
use csi_agent::mounts::Mounter;
use csi_agent::store::Store;
use csi_agent::volume::bind::Binder;
use csi_agent::volume::{
    AccessMode, AccessType, Capability, NodeContext, PublishRequest, VolumeConfig, VolumeManager,
    VolumeSecrets,
};

pub const PLUGIN_TYPE: &str = "org.example.test";

/// The test plugin binary, built by `cargo build --workspace` (CI builds everything before
/// testing); `CSI_TESTPLUGIN` overrides.
pub fn testplugin_bin() -> PathBuf {
    csi_agent::binaries::required("csi-testplugin", Some("CSI_TESTPLUGIN"))
}

/// A running `csi-testplugin`.
#[derive(Debug)]
pub struct TestPlugin {
    pub work: PathBuf,
    pub socket: PathBuf,
    args: Vec<String>,
    child: Arc<Mutex<Option<Child>>>,
    supervising: Arc<AtomicBool>,
}

impl TestPlugin {
    /// Starts the plugin with its work dir and socket under `dir`, and waits for its socket.
    pub fn start(dir: &Path, extra: &[&str]) -> Self {
        let work = dir.join("plugin");
        std::fs::create_dir_all(&work).unwrap();
        let socket = dir.join("csi.sock");
        let mut args = vec![
            "--endpoint".to_owned(),
            format!("unix://{}", socket.display()),
            "--work-dir".to_owned(),
            work.display().to_string(),
            "--node-id".to_owned(),
            "node-1".to_owned(),
        ];
        args.extend(extra.iter().map(|s| (*s).to_owned()));
        let plugin = Self {
            work,
            socket,
            args,
            child: Arc::new(Mutex::new(None)),
            supervising: Arc::new(AtomicBool::new(false)),
        };
        plugin.spawn();
        plugin
    }

    fn spawn(&self) {
        let _ = std::fs::remove_file(&self.socket);
        let child = Command::new(testplugin_bin())
            .args(&self.args)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn csi-testplugin");
        *self.child.lock().unwrap() = Some(child);
        wait_for_path(&self.socket);
    }

    /// Restarts the plugin whenever it exits (like a supervisor would), until dropped.
    pub fn keep_restarting(&self) {
        self.supervising.store(true, Ordering::SeqCst);
        let child = self.child.clone();
        let supervising = self.supervising.clone();
        let args = self.args.clone();
        let socket = self.socket.clone();
        std::thread::spawn(move || {
            while supervising.load(Ordering::SeqCst) {
                std::thread::sleep(Duration::from_millis(20));
                let mut guard = child.lock().unwrap();
                let exited = match guard.as_mut() {
                    Some(c) => c.try_wait().ok().flatten().is_some(),
                    None => false,
                };
                if exited && supervising.load(Ordering::SeqCst) {
                    let _ = std::fs::remove_file(&socket);
                    *guard = Some(
                        Command::new(testplugin_bin())
                            .args(&args)
                            .stdout(Stdio::null())
                            .stderr(Stdio::null())
                            .spawn()
                            .expect("respawn csi-testplugin"),
                    );
                }
            }
        });
    }

    pub fn kill(&self) {
        self.supervising.store(false, Ordering::SeqCst);
        if let Some(mut child) = self.child.lock().unwrap().take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    pub fn restart(&self) {
        self.kill();
        self.spawn();
    }

    pub fn pid(&self) -> Option<u32> {
        self.child.lock().unwrap().as_ref().map(Child::id)
    }

    /// Writes the fault-injection file (re-read by the plugin at every RPC).
    pub fn set_faults(&self, faults: serde_json::Value) {
        let path = self.work.join("faults.json");
        let tmp = self.work.join("faults.json.tmp");
        std::fs::write(&tmp, serde_json::to_vec(&faults).unwrap()).unwrap();
        std::fs::rename(tmp, path).unwrap();
    }

    /// Every call-log line so far.
    pub fn calls(&self) -> Vec<serde_json::Value> {
        let Ok(text) = std::fs::read_to_string(self.work.join("calls.jsonl")) else {
            return Vec::new();
        };
        text.lines()
            .filter_map(|line| serde_json::from_str(line).ok())
            .collect()
    }

    pub fn count(&self, method: &str) -> usize {
        self.calls()
            .iter()
            .filter(|c| c["method"] == method)
            .count()
    }

    pub fn volume_dir(&self, volume_id: &str) -> PathBuf {
        self.work.join("volumes").join(volume_id)
    }
}

impl Drop for TestPlugin {
    fn drop(&mut self) {
        self.kill();
    }
}

pub fn wait_for_path(path: &Path) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !path.exists() {
        assert!(
            Instant::now() < deadline,
            "{} never appeared",
            path.display()
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// A volume manager over `work_dir` talking to the plugin's socket.
pub fn manager(work_dir: &Path, socket: &Path, boot_id: &str) -> VolumeManager {
    manager_with(
        work_dir,
        socket,
        boot_id,
        Duration::from_secs(5),
        Duration::from_secs(30),
    )
}

/// Like [`manager`] with an explicit per-RPC deadline and operation timeout.
pub fn manager_with(
    work_dir: &Path,
    socket: &Path,
    boot_id: &str,
    rpc_deadline: Duration,
    operation_timeout: Duration,
) -> VolumeManager {
    manager_configured(work_dir, socket, boot_id, rpc_deadline, |config| {
        config.operation_timeout = operation_timeout;
    })
}

/// A volume manager whose config `tweak` adjusts.
pub fn manager_configured(
    work_dir: &Path,
    socket: &Path,
    boot_id: &str,
    rpc_deadline: Duration,
    tweak: impl FnOnce(&mut VolumeConfig),
) -> VolumeManager {
    manager_in(work_dir, socket, boot_id, rpc_deadline, tweak, None)
}

/// A volume manager whose `bind_to`s may go beneath `bind_roots` and whose every mount,
/// unmount and mount-table read goes through `mounter` (a `FakeMounter`: no root needed).
pub fn manager_mounting(
    work_dir: &Path,
    socket: &Path,
    boot_id: &str,
    bind_roots: Vec<PathBuf>,
    mounter: Arc<dyn Mounter>,
) -> VolumeManager {
    let binder = Binder::with_mounter(bind_roots, work_dir, mounter);
    manager_in(
        work_dir,
        socket,
        boot_id,
        Duration::from_secs(5),
        |_| {},
        Some(Arc::new(binder)),
    )
}

fn manager_in(
    work_dir: &Path,
    socket: &Path,
    boot_id: &str,
    rpc_deadline: Duration,
    tweak: impl FnOnce(&mut VolumeConfig),
    binder: Option<Arc<Binder>>,
) -> VolumeManager {
    let layout = Layout::new(work_dir);
    let store = Store::open(layout.clone(), None).unwrap();
    let endpoints = FixedEndpoints::new(
        HashMap::from([
            (Service::Controller, socket.to_path_buf()),
            (Service::Node, socket.to_path_buf()),
        ]),
        ClientOptions {
            rpc_deadline,
            plugin: PLUGIN_TYPE.to_owned(),
            metrics: None,
        },
    );
    let mut config = VolumeConfig::new(PLUGIN_TYPE, "default");
    config.retry.initial = Duration::from_millis(10);
    config.retry.max = Duration::from_millis(200);
    config.operation_timeout = Duration::from_secs(30);
    tweak(&mut config);
    let mut context = NodeContext::new(layout, store, boot_id.to_owned());
    if let Some(binder) = binder {
        context.binder = binder;
    }
    VolumeManager::new(config, Arc::new(endpoints), context)
}

pub fn mount_capability() -> Capability {
    Capability {
        access_type: AccessType::Mount {
            fs_type: String::new(),
            mount_flags: Vec::new(),
        },
        access_mode: AccessMode::SingleNodeWriter,
    }
}

pub fn publish_request(volume_id: &str, workload: &str) -> PublishRequest {
    PublishRequest {
        volume_id: volume_id.to_owned(),
        workload: workload.to_owned(),
        capability: mount_capability(),
        readonly: false,
        volume_context: None,
        secrets: VolumeSecrets::default(),
        bind_to: None,
    }
}

pub fn secrets(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect()
}

// The mount-table helpers of every test that mounts: one copy, in the testkit.
// Each test binary uses a part of this module (as its `dead_code` allowance says).
#[allow(unused_imports)]
pub use csi_agent_testkit::{detach_mounts_under, mounts_under};

/// Volume records left in the work dir's database (volume ids), as committed so far.
pub fn records(work_dir: &Path) -> Vec<String> {
    csi_agent::store::db::dump(work_dir)
        .unwrap_or_default()
        .into_iter()
        .filter(|row| row.plugin_type == PLUGIN_TYPE)
        .filter_map(|row| csi_agent::layout::decode_id(&row.volume_key))
        .collect()
}

/// The committed record of `volume_id` as JSON (the daemon or manager must be gone).
pub fn record_json(work_dir: &Path, volume_id: &str) -> serde_json::Value {
    let key = csi_agent::layout::encode_id(volume_id);
    let row = csi_agent::store::db::dump(work_dir)
        .unwrap()
        .into_iter()
        .find(|row| row.plugin_type == PLUGIN_TYPE && row.volume_key == key)
        .unwrap_or_else(|| panic!("no record of {volume_id}"));
    serde_json::from_str(&row.record).unwrap()
}

/// Replaces the committed record of `volume_id` by `record` (a hand edit), raw.
pub fn set_record_raw(work_dir: &Path, volume_id: &str, record: &str) {
    csi_agent::store::db::put_raw(
        work_dir,
        &csi_agent::store::db::RawRow {
            plugin_type: PLUGIN_TYPE.to_owned(),
            plugin_name: "default".to_owned(),
            volume_key: csi_agent::layout::encode_id(volume_id),
            schema_version: 1,
            record: record.to_owned(),
        },
    )
    .unwrap();
}

/// Waits until `check` holds (for background reconciliation).
pub async fn eventually(what: &str, mut check: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !check() {
        assert!(Instant::now() < deadline, "timed out waiting for: {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
