//! The image tests' plugin images and containers (csi-agentd's `image_*` tests): an
//! image layer of the real `csi-testplugin` (the binary with the libraries and loader `ldd`
//! lists), the plugin config pieces naming an image, waiting for a plugin, and the runc
//! containers a test leaves, removed when it ends.
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use csi_agent_api::PluginInfo;
use serde_json::{Value, json};

use crate::registry::testplugin_image;
use crate::{Daemon, binary};

/// The files a dynamically linked binary needs, as `ldd` lists them.
pub fn shared_libraries(binary: &Path) -> Vec<PathBuf> {
    testplugin_image::shared_libraries(binary).unwrap()
}

/// A plain tar: `bin/csi-testplugin` plus its libraries and loader at their paths (what
/// `csi-testplugin-image`, the demo's, writes too).
pub fn plugin_layer() -> Vec<u8> {
    testplugin_image::plugin_layer(&binary("csi-testplugin")).unwrap()
}

/// The test plugin's image, written as an OCI layout at `layout`: [`plugin_layer`], run by
/// its `Entrypoint` with one 1 MiB volume `vol1`, its state in `plugin_dir` (from its `Env`).
pub fn plugin_image(layout: &Path, plugin_dir: &Path) -> crate::registry::Image {
    let cmd = ["--volumes", "vol1:1M", "--node-id", "node-1"].map(str::to_owned);
    let env = [format!("CSI_TESTPLUGIN_WORK_DIR={}", plugin_dir.display())];
    testplugin_image::plugin_image(layout, &binary("csi-testplugin"), &cmd, &env).unwrap()
}

pub fn component(services: &[&str], container: Value) -> Value {
    json!({"services": services, "container": container})
}

/// A daemon (not started) in `dir` pulling from the registry at `host` over plain HTTP.
pub fn registry_daemon(dir: &Path, host: &str) -> Daemon {
    Daemon::builder(dir).registry(host).build()
}

/// A plugin config of `plugin_type` whose one component (both services) runs `image`, named
/// the Mesos way (`container.mesos.image`), with `volumes`; failed launches are retried after
/// 100 ms, backing off to 500 ms.
pub fn image_plugin(
    plugin_type: &str,
    image: &str,
    volumes: Vec<Value>,
    startup_timeout_ms: u64,
) -> Value {
    json!({
        "type": plugin_type,
        "containers": [component(
            &["CONTROLLER_SERVICE", "NODE_SERVICE"],
            json!({"mesos": {"image": {"type": "DOCKER", "docker": {"name": image}}},
                   "volumes": volumes}),
        )],
        "startup_timeout_ms": startup_timeout_ms,
        "restart_backoff": {"initial_ms": 100, "max_ms": 500},
    })
}

pub fn volume(dir: &Path) -> Value {
    json!({"container_path": dir, "host_path": dir, "mode": "RW"})
}

pub async fn wait_plugin(
    daemon: &Daemon,
    plugin: &str,
    what: &str,
    check: impl FnMut(&PluginInfo) -> bool,
) -> PluginInfo {
    daemon
        .wait_plugin(plugin, what, Duration::from_secs(60), check)
        .await
}

pub fn ready_pid(info: &PluginInfo) -> Option<u32> {
    info.components
        .first()
        .filter(|c| c.ready)
        .and_then(|c| c.pid)
}

/// Force-deletes every container of the test's runc root when dropped (also on a failed
/// assertion): the daemon leaves its plugins running on purpose, and a plugin run from an
/// image has no test path in its command line for `Daemon`'s own cleanup to find.
#[derive(Debug)]
pub struct Containers(pub PathBuf);

impl Containers {
    pub fn list(&self) -> Vec<String> {
        let out = Command::new("runc")
            .arg("--root")
            .arg(&self.0)
            .args(["list", "-q"])
            .output()
            .expect("runc is installed");
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .map(str::to_owned)
            .collect()
    }
}

impl Containers {
    /// Waits (20 s at most) until runc lists none: the daemon stopped and deleted them.
    pub async fn wait_gone(&self) {
        let deadline = Instant::now() + Duration::from_secs(20);
        while !self.list().is_empty() {
            assert!(
                Instant::now() < deadline,
                "containers left: {:?}",
                self.list()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

impl Drop for Containers {
    fn drop(&mut self) {
        for id in self.list() {
            let _ = Command::new("runc")
                .arg("--root")
                .arg(&self.0)
                .args(["delete", "--force", &id])
                .status();
        }
    }
}
