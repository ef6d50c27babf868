//! The helpers of the cluster tests (`tests/cluster.rs`, `tests/cluster_chaos.rs`): nodes,
//! each a real csi-agentd in a mount namespace of its own on one shared backend, their
//! sessions, and etcd's and the backend's view of what is claimed.
// Each test binary uses a part of this module.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use csi_agent_api::ApiClient;
use csi_agent_testkit::backend::BackendJudge;
use csi_agent_testkit::daemon::Daemon;
use csi_agent_testkit::{PLUGIN, binary, eventually, publish_request};
use serde_json::{Value, json};

pub const CLUSTER: &str = "t";
/// Short, so that a lost node's presence vanishes within a test.
pub const LEASE_TTL_SECS: &str = "2";

/// The volumes of the shared backend of [`node_with`] (`--volumes`).
pub const VOLUMES: &str = "vol1:16Mi,vol2:16Mi,vol3:16Mi";

/// The test plugin of one node on the shared backend, `"cluster": true`, with these
/// pre-provisioned `volumes` (`name:size,...`).
pub fn plugin_config(dir: &Path, backend: &Path, node: &str, volumes: &str) -> Value {
    json!({
        "type": PLUGIN,
        "cluster": true,
        "containers": [{
            "services": ["CONTROLLER_SERVICE", "NODE_SERVICE"],
            "command": {
                "shell": false,
                "value": binary("csi-testplugin"),
                "arguments": ["csi-testplugin", "--endpoint", "$CSI_ENDPOINT",
                              "--work-dir", dir.join("plugin"), "--backend-dir", backend,
                              "--volumes", volumes, "--node-id", node]
            }
        }],
        "startup_timeout_ms": 20000
    })
}

/// A node: its daemon in a mount namespace of its own (its mounts are invisible to the other
/// nodes, as on separate machines), kept by a holder process so that a restarted daemon
/// finds its mounts again, as on a real node.
pub struct Node {
    daemon: Daemon,
    holder: Holder,
}

/// The process keeping a node's mount namespace, killed when dropped: also when the test
/// panics before its [`Node`] exists (a leaked holder would keep the namespace, and its
/// mounts, for good).
struct Holder(std::process::Child);

impl Drop for Holder {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

impl std::ops::Deref for Node {
    type Target = Daemon;
    fn deref(&self) -> &Daemon {
        &self.daemon
    }
}

impl std::ops::DerefMut for Node {
    fn deref_mut(&mut self) -> &mut Daemon {
        &mut self.daemon
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        // The daemon first, then (as a field, after this) its namespace's holder.
        self.daemon.kill9();
    }
}

pub fn node_with(root: &Path, node: &str, etcd: &str, backend: &Path, extra: &[&str]) -> Node {
    node_with_volumes(root, node, etcd, backend, extra, VOLUMES)
}

/// [`node_with`], its plugin with these pre-provisioned `volumes` (`name:size,...`).
pub fn node_with_volumes(
    root: &Path,
    node: &str,
    etcd: &str,
    backend: &Path,
    extra: &[&str],
    volumes: &str,
) -> Node {
    let config = plugin_config(&root.join(node), backend, node, volumes);
    node_with_config(root, node, etcd, extra, config)
}

/// A node whose plugin serves only the Node service here: its controller runs on other
/// nodes (as a plugin's controller is often deployed on a few nodes only).
pub fn node_only(root: &Path, node: &str, etcd: &str, backend: &Path) -> Node {
    let mut config = plugin_config(&root.join(node), backend, node, VOLUMES);
    config["containers"][0]["services"] = json!(["NODE_SERVICE"]);
    node_with_config(root, node, etcd, &[], config)
}

/// A node whose daemon runs the plugin `config`.
fn node_with_config(root: &Path, node: &str, etcd: &str, extra: &[&str], config: Value) -> Node {
    let dir = root.join(node);
    std::fs::create_dir_all(&dir).unwrap();
    // Without the test's stdout and stderr: cargo waits for every holder of its pipes.
    let holder = Holder(
        Command::new("unshare")
            .args(["-m", "--propagation", "private", "sleep", "infinity"])
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap(),
    );
    // The holder's namespace exists once unshare exec'd sleep.
    let ns = format!("/proc/{}/ns/mnt", holder.0.id());
    let own = std::fs::read_link("/proc/self/ns/mnt").unwrap();
    let deadline = Instant::now() + Duration::from_secs(5);
    while std::fs::read_link(&ns).map(|l| l == own).unwrap_or(true) {
        assert!(
            Instant::now() < deadline,
            "the namespace holder never started"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    let pid = holder.0.id().to_string();
    let daemon = Daemon::builder(&dir)
        .plugin_config("test.json", config)
        .wrapper(&["nsenter", "-t", &pid, "-m", "--"])
        .flags(&[
            "--cluster-etcd",
            etcd,
            "--cluster-name",
            CLUSTER,
            "--node-name",
            node,
            "--cluster-lease-ttl-secs",
            LEASE_TTL_SECS,
            "--cluster-etcd-timeout-ms",
            "500",
        ])
        .flags(extra)
        .start();
    Node { daemon, holder }
}

pub fn start_node(root: &Path, node: &str, etcd: &str, backend: &Path) -> Node {
    node_with(root, node, etcd, backend, &[])
}

/// Waits (`timeout` at most) until the node's `GET /v1/cluster` satisfies `reached`.
pub async fn session_until(
    daemon: &Daemon,
    what: &str,
    timeout: Duration,
    reached: impl Fn(&Value) -> bool,
) {
    let api = daemon.api();
    let reached = &reached;
    eventually(what, timeout, || {
        let api = api.clone();
        async move {
            let status = cluster_status(&api).await?;
            reached(&status).then_some(()).ok_or(format!("{status}"))
        }
    })
    .await;
}

/// Waits until the node's session is HEALTHY.
pub async fn joined(daemon: &Daemon) {
    session_until(
        daemon,
        "the node to join the cluster",
        Duration::from_secs(20),
        |s| s["state"] == "HEALTHY",
    )
    .await;
}

/// A test's scratch dir and the shared backend dir in it.
pub fn scratch() -> (tempfile::TempDir, PathBuf) {
    let tmp = tempfile::tempdir().unwrap();
    let backend = tmp.path().join("backend");
    std::fs::create_dir_all(&backend).unwrap();
    (tmp, backend)
}

pub async fn cluster_status(api: &ApiClient) -> Result<Value, String> {
    api.cluster()
        .await
        .map(|s| serde_json::to_value(s).unwrap())
        .map_err(|e| e.to_string())
}

/// Runs `script` with `sh -c` in the mount namespace of `daemon`.
pub fn in_node(daemon: &Daemon, script: &str) -> String {
    let pid = daemon.daemon_pid().unwrap().to_string();
    let out = Command::new("nsenter")
        .args(["-t", &pid, "-m", "--", "sh", "-c", script])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{script}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The node's claims on cluster volumes as etcd has them: (volume, node, state).
pub async fn etcd_entries(etcd: &csi_etcd::Client) -> Vec<(String, String, String)> {
    let read = etcd
        .get_prefix(format!("/csi-agent/{CLUSTER}/v1/vol/").as_bytes(), 0)
        .await
        .unwrap();
    let mut entries = Vec::new();
    for kv in read.kvs {
        let value: Value = serde_json::from_slice(&kv.value).unwrap();
        for (node, entry) in value["nodes"].as_object().unwrap() {
            entries.push((
                value["volume_id"].as_str().unwrap().to_owned(),
                node.clone(),
                entry["state"].as_str().unwrap().to_owned(),
            ));
        }
    }
    entries.sort();
    entries
}

pub async fn etcd_client(urls: Vec<String>) -> csi_etcd::Client {
    csi_etcd::Client::connect(csi_etcd::ConnectOptions {
        endpoints: urls,
        request_timeout: Duration::from_secs(2),
        connect_timeout: Duration::from_secs(1),
        user: None,
        tls: None,
    })
    .await
    .unwrap()
}

pub fn rpcs(judge: &BackendJudge, node: &str, volume: &str) -> Vec<String> {
    judge
        .calls_for_node(node)
        .into_iter()
        .filter(|c| c.volume.as_deref() == Some(volume))
        .map(|c| c.rpc)
        .collect()
}

pub fn with_mode(
    volume: &str,
    workload: &str,
    mode: &str,
    readonly: bool,
) -> csi_agent_api::PublishRequest {
    let mut request = publish_request(volume, workload);
    request.capability.access_mode = mode.to_owned();
    request.readonly = readonly;
    request
}

/// Waits until etcd no longer has `node`'s presence (its lease ran out).
pub async fn lease_gone(client: &csi_etcd::Client, node: &str) {
    let key = format!("/csi-agent/{CLUSTER}/v1/nodes/{node}");
    eventually(
        "the node's lease to run out",
        Duration::from_secs(15),
        || async {
            let read = client
                .get(key.as_bytes())
                .await
                .map_err(|e| e.to_string())?;
            read.kvs
                .is_empty()
                .then_some(())
                .ok_or(format!("{key} still there"))
        },
    )
    .await;
}

pub async fn no_entries_left(client: &csi_etcd::Client, what: &str) {
    eventually(what, Duration::from_secs(20), || async {
        let entries = etcd_entries(client).await;
        entries
            .is_empty()
            .then_some(())
            .ok_or(format!("{entries:?}"))
    })
    .await;
}

/// The node leading the test plugin's controller in a `GET /v1/cluster` answer.
pub fn leader_in(status: &Value) -> Option<String> {
    status["leaders"]
        .as_array()?
        .iter()
        .find(|l| l["plugin"] == PLUGIN)?
        .get("node")?
        .as_str()
        .map(str::to_owned)
}

/// Waits until `daemon` sees `node` lead the test plugin's controller.
pub async fn sees_leader(daemon: &Daemon, node: &str) {
    session_until(
        daemon,
        &format!("{node} to lead the plugin's controller"),
        Duration::from_secs(20),
        |s| leader_in(s).as_deref() == Some(node),
    )
    .await;
}

/// Waits until `daemon` itself leads the test plugin's controller (its own key, with its
/// current lease: a restarted daemon's old key names it too until its old lease runs out).
pub async fn leads(daemon: &Daemon) {
    session_until(
        daemon,
        "the node to lead the plugin's controller",
        Duration::from_secs(20),
        |s| {
            s["leaders"].as_array().is_some_and(|leaders| {
                leaders
                    .iter()
                    .any(|l| l["plugin"] == PLUGIN && l["this_node"] == true)
            })
        },
    )
    .await;
}

/// Two nodes on `etcd` and `backend`: n1, started first, leads the plugin's controller, and
/// n2 sees it lead (its controller steps are handed to n1).
pub async fn leader_and_follower(root: &Path, etcd: &str, backend: &Path) -> (Node, Node) {
    let n1 = start_node(root, "n1", etcd, backend);
    joined(&n1).await;
    leads(&n1).await;
    let n2 = start_node(root, "n2", etcd, backend);
    joined(&n2).await;
    sees_leader(&n2, "n1").await;
    (n1, n2)
}

/// The nodes whose plugin instance answered `rpc` (a Controller(Un)PublishVolume) for
/// `target` with OK, in order: in cluster mode, the plugin's controller leader at the time.
pub fn senders(judge: &BackendJudge, rpc: &str, target: &str) -> Vec<String> {
    judge
        .calls()
        .into_iter()
        .filter(|c| c.rpc == rpc && c.target_node.as_deref() == Some(target) && c.outcome == "OK")
        .map(|c| c.node)
        .collect()
}
