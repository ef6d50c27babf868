//! The Mesos fetcher (`command.uris`, issue #29 item 4), end to end through the real
//! `csi-agentd`, the real `csi-testplugin` and a plain HTTP server on loopback this test
//! starts and stops:
//!
//! - Mesos's own sample SLRP config (`fixtures/mesos/slrp-sample.json`, from Mesos's
//!   `docs/csi.md`), unchanged but for the URI's host, fetches the plugin binary, runs
//!   `./test-csi-plugin` from the sandbox and serves a publish (its `resources` make it run in
//!   a container on the host's root, with the sandbox bound at its path: issue #29 item 3);
//! - the same plugin shipped in a `.tar.gz` or a `.zip` (`extract` by default) is extracted
//!   and runs (hostile zips: the fetch module's unit tests);
//! - hostile archives (`../escape`, an absolute name, a symlink then a file through it) are
//!   the component's launch error, naming the entry, and nothing is written outside the
//!   sandbox (nor anything left in it);
//! - an endless body is cut at `--fetch-max-bytes`, leaving no partial file;
//! - `cache: true` fetches once for two launches; `cache: false` fetches at each.
//!
//! Real bind mounts: run under `unshare -m --propagation private`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use csi_agent::mounts::require_private_mount_namespace;
use csi_agent_api::{CreateVolumeRequest, PluginInfo};
use serde_json::{Value, json};

use csi_agent_testkit::*;

const SAMPLE_TYPE: &str = "org.apache.mesos.csi.test";
const SAMPLE_PATH: &str = "/PATH/TO/test-csi-plugin";

/// What a path answers.
#[derive(Clone)]
enum Body {
    Bytes(Vec<u8>),
    /// 200 and a body that never ends (no `Content-Length`).
    Endless,
}

/// A loopback HTTP/1.0-style server: one thread per connection, one request each. Counts
/// GETs per path. Stopped on drop.
struct FileServer {
    port: u16,
    gets: Arc<Mutex<HashMap<String, usize>>>,
    stop: Arc<AtomicBool>,
}

impl FileServer {
    fn start(routes: HashMap<String, Body>) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        listener.set_nonblocking(true).unwrap();
        let gets = Arc::new(Mutex::new(HashMap::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let (routes, counter, stopped) = (Arc::new(routes), Arc::clone(&gets), Arc::clone(&stop));
        std::thread::spawn(move || {
            while !stopped.load(Ordering::SeqCst) {
                match listener.accept() {
                    Ok((conn, _)) => {
                        conn.set_nonblocking(false).unwrap();
                        let (routes, counter, stopped) = (
                            Arc::clone(&routes),
                            Arc::clone(&counter),
                            Arc::clone(&stopped),
                        );
                        std::thread::spawn(move || serve(conn, &routes, &counter, &stopped));
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(5)),
                }
            }
        });
        Self { port, gets, stop }
    }

    fn url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{path}", self.port)
    }

    fn gets(&self, path: &str) -> usize {
        self.gets.lock().unwrap().get(path).copied().unwrap_or(0)
    }
}

impl Drop for FileServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
    }
}

fn serve(
    conn: TcpStream,
    routes: &HashMap<String, Body>,
    gets: &Mutex<HashMap<String, usize>>,
    stop: &AtomicBool,
) {
    let mut reader = BufReader::new(conn.try_clone().unwrap());
    let mut line = String::new();
    if reader.read_line(&mut line).is_err() {
        return;
    }
    let path = line.split_whitespace().nth(1).unwrap_or("/").to_owned();
    loop {
        let mut header = String::new();
        if reader.read_line(&mut header).unwrap_or(0) == 0 || header.trim().is_empty() {
            break;
        }
    }
    *gets.lock().unwrap().entry(path.clone()).or_default() += 1;
    let mut conn = conn;
    match routes.get(&path) {
        Some(Body::Bytes(bytes)) => {
            let _ = write!(
                conn,
                "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
                bytes.len()
            );
            let _ = conn.write_all(bytes);
        }
        Some(Body::Endless) => {
            let _ = write!(conn, "HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n");
            let chunk = vec![b'x'; 64 * 1024];
            while !stop.load(Ordering::SeqCst) && conn.write_all(&chunk).is_ok() {}
        }
        None => {
            let _ = write!(
                conn,
                "HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
            );
        }
    }
}

/// Mesos's sample `CSIPluginInfo`, its URI pointed at `uri` (nothing else changed).
fn sample_plugin(uri: &str) -> Value {
    let text = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/mesos/slrp-sample.json"),
    )
    .unwrap();
    let slrp: Value = serde_json::from_str(&text).unwrap();
    let mut plugin = slrp["storage"]["plugin"].clone();
    assert_eq!(
        plugin["containers"][0]["command"]["uris"][0]["value"],
        SAMPLE_PATH
    );
    plugin["containers"][0]["command"]["uris"][0]["value"] = json!(uri);
    plugin
}

fn testplugin_bytes() -> Vec<u8> {
    std::fs::read(binary("csi-testplugin")).unwrap()
}

/// A gzipped tar: `(name, mode, data)` regular files, written with raw names (hostile ones
/// too); `symlinks` first as `(name, target)`.
fn tar_gz(symlinks: &[(&str, &str)], files: &[(&str, u32, &[u8])]) -> Vec<u8> {
    let mut builder = tar::Builder::new(flate2::write::GzEncoder::new(
        Vec::new(),
        flate2::Compression::fast(),
    ));
    for (name, target) in symlinks {
        let mut header = tar::Header::new_gnu();
        header.set_entry_type(tar::EntryType::Symlink);
        header.set_mode(0o777);
        header.set_size(0);
        builder.append_link(&mut header, name, target).unwrap();
    }
    for (name, mode, data) in files {
        let mut header = tar::Header::new_gnu();
        header.set_entry_type(tar::EntryType::Regular);
        header.set_mode(*mode);
        header.set_size(data.len() as u64);
        let raw = header.as_old_mut();
        raw.name = [0; 100];
        raw.name[..name.len()].copy_from_slice(name.as_bytes());
        header.set_cksum();
        builder.append(&header, *data).unwrap();
    }
    builder.into_inner().unwrap().finish().unwrap()
}

/// A deflated zip of `(name, mode, data)` files.
fn zip_of(files: &[(&str, u32, &[u8])]) -> Vec<u8> {
    let mut writer = zip::ZipWriter::new(std::io::Cursor::new(Vec::new()));
    for (name, mode, data) in files {
        let options = zip::write::SimpleFileOptions::default()
            .compression_method(zip::CompressionMethod::Deflated)
            .unix_permissions(*mode);
        writer.start_file(*name, options).unwrap();
        writer.write_all(data).unwrap();
    }
    writer.finish().unwrap().into_inner()
}

async fn plugin_info(daemon: &Daemon, plugin_type: &str) -> PluginInfo {
    daemon.api().plugin(plugin_type).await.unwrap()
}

/// Waits until the first component is ready with a pid other than `not`.
async fn ready(daemon: &Daemon, plugin_type: &str, not: Option<u32>) -> PluginInfo {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let info = plugin_info(daemon, plugin_type).await;
        if info
            .components
            .first()
            .is_some_and(|c| c.ready && c.pid.is_some() && c.pid != not)
        {
            return info;
        }
        assert!(
            Instant::now() < deadline,
            "{plugin_type} never ready: {info:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Waits for the first component's launch error.
async fn launch_error(daemon: &Daemon, plugin_type: &str) -> String {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let info = plugin_info(daemon, plugin_type).await;
        if let Some(error) = info.components.first().and_then(|c| c.error.clone()) {
            return error;
        }
        assert!(
            Instant::now() < deadline,
            "{plugin_type} never failed: {info:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Removes every config and reloads: the plugins stop, and (the sample asks for `resources`,
/// so it runs in a container on the host's root) their shared mount roots are released.
async fn stop_plugins(daemon: &Daemon) {
    for entry in std::fs::read_dir(&daemon.configs).unwrap().flatten() {
        std::fs::remove_file(entry.path()).unwrap();
    }
    daemon.api().reload().await.unwrap();
}

/// Creates and publishes a volume through the daemon's API, then unpublishes it.
async fn publish_through_the_daemon(daemon: &Daemon, plugin_type: &str) {
    let api = daemon.api();
    let created = api
        .create_volume(&CreateVolumeRequest {
            plugin: plugin_type.to_owned(),
            name: "fetched-vol".to_owned(),
            capacity_bytes: 1 << 20,
            capability: capability(),
            parameters: Default::default(),
            accessibility_requirements: None,
            content_source: None,
        })
        .await
        .unwrap();
    let mut request = publish_request(&created.volume_id, "w1");
    request.plugin = plugin_type.to_owned();
    let published = api.publish(&request).await.unwrap();
    assert!(Path::new(&published.target_path).is_dir());
    let mut request = unpublish_request(&created.volume_id, "w1");
    request.plugin = plugin_type.to_owned();
    api.unpublish(&request).await.unwrap();
}

/// The process's working directory.
fn cwd(pid: u32) -> PathBuf {
    std::fs::read_link(format!("/proc/{pid}/cwd")).unwrap()
}

fn exe(pid: u32) -> PathBuf {
    std::fs::read_link(format!("/proc/{pid}/exe")).unwrap_or_default()
}

fn children(pid: u32) -> Vec<u32> {
    std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children"))
        .unwrap_or_default()
        .split_whitespace()
        .filter_map(|p| p.parse().ok())
        .collect()
}

#[tokio::test]
async fn the_mesos_slrp_sample_fetches_its_plugin_and_serves_a_publish() {
    require_private_mount_namespace();
    let dir = tempfile::tempdir().unwrap();
    let server = FileServer::start(HashMap::from([
        (SAMPLE_PATH.to_owned(), Body::Bytes(testplugin_bytes())),
        (
            "/plugin.tar.gz".to_owned(),
            Body::Bytes(tar_gz(
                &[],
                &[("test-csi-plugin", 0o755, &testplugin_bytes())],
            )),
        ),
        (
            "/plugin.zip".to_owned(),
            Body::Bytes(zip_of(&[("test-csi-plugin", 0o755, &testplugin_bytes())])),
        ),
    ]));
    let mut daemon = Daemon::new(dir.path(), &["--start-plugins"]);
    daemon.add_config("slrp.json", &sample_plugin(&server.url(SAMPLE_PATH)));
    // The same plugin in a tar.gz: `extract` is Mesos's default; not executable.
    let mut tarred = sample_plugin(&server.url("/plugin.tar.gz"));
    tarred["type"] = json!("org.example.tarred");
    tarred["containers"][0]["command"]["uris"][0] = json!({"value": server.url("/plugin.tar.gz")});
    daemon.add_config("tarred.json", &tarred);
    // And in a zip.
    let mut zipped = sample_plugin(&server.url("/plugin.zip"));
    zipped["type"] = json!("org.example.zipped");
    zipped["containers"][0]["command"]["uris"][0] = json!({"value": server.url("/plugin.zip")});
    daemon.add_config("zipped.json", &zipped);
    daemon.start();

    for plugin_type in [SAMPLE_TYPE, "org.example.tarred", "org.example.zipped"] {
        let info = ready(&daemon, plugin_type, None).await;
        let pid = info.components[0].pid.unwrap();
        // The shell ran `./test-csi-plugin` in the sandbox: the component's dir in the work
        // dir, holding the fetched binary, executable.
        let sandbox = cwd(pid);
        assert!(sandbox.starts_with(&daemon.work), "{sandbox:?}");
        let fetched = sandbox.join("test-csi-plugin");
        // The sample's shell command does not `exec`: the plugin is the shell's child.
        let plugin = children(pid)
            .into_iter()
            .find(|child| exe(*child) == fetched)
            .unwrap_or_else(|| panic!("{plugin_type}: no child of {pid} runs {fetched:?}"));
        assert_eq!(cwd(plugin), sandbox);
        let mode = std::os::unix::fs::PermissionsExt::mode(
            &std::fs::metadata(&fetched).unwrap().permissions(),
        );
        assert_eq!(mode & 0o777, 0o755, "{plugin_type}");
        assert_eq!(std::fs::read(&fetched).unwrap(), testplugin_bytes());
        // `--work_dir=workdir` is relative: beneath the sandbox.
        assert!(sandbox.join("workdir").is_dir(), "{plugin_type}");
        publish_through_the_daemon(&daemon, plugin_type).await;
    }
    // No temp file left in the sandbox or the cache dir.
    let leftovers: Vec<_> = walk(&daemon.work)
        .into_iter()
        .filter(|p| p.to_string_lossy().contains(".tmp-"))
        .collect();
    assert_eq!(leftovers, Vec::<PathBuf>::new());
    stop_plugins(&daemon).await;
    assert_eq!(mounts_under(dir.path()), Vec::<PathBuf>::new());
}

#[tokio::test]
async fn hostile_archives_are_refused_and_write_nothing_outside_the_sandbox() {
    require_private_mount_namespace();
    let dir = tempfile::tempdir().unwrap();
    let outside = dir.path().join("outside");
    std::fs::create_dir(&outside).unwrap();
    let outside_str = outside.to_str().unwrap().to_owned();
    let abs_target = format!("{outside_str}/abs-escape");
    let stolen = format!("{outside_str}/stolen");
    let hostile: [(&str, Vec<u8>, &str); 4] = [
        (
            "dotdot",
            tar_gz(&[], &[("../../../../escape", 0o644, b"pwned")]),
            "\"../../../../escape\" refused: its name has a '..' component",
        ),
        (
            "absolute",
            tar_gz(&[], &[(abs_target.as_str(), 0o644, b"pwned")]),
            "refused: its name is an absolute path",
        ),
        (
            "symlink",
            tar_gz(
                &[("link", outside_str.as_str())],
                &[("link/through-link", 0o644, b"pwned")],
            ),
            "\"link/through-link\"",
        ),
        // A symlink named like the component's log: csi-agent would append the plugin's
        // output to its target.
        (
            "log-link",
            tar_gz(&[("stdout", stolen.as_str())], &[]),
            "top-level entry \"stdout\" would replace csi-agent's own file",
        ),
    ];
    let mut routes = HashMap::new();
    for (name, archive, _) in &hostile {
        routes.insert(format!("/{name}.tar.gz"), Body::Bytes(archive.clone()));
    }
    let server = FileServer::start(routes);
    let mut daemon = Daemon::new(dir.path(), &["--start-plugins"]);
    for (name, _, _) in &hostile {
        let mut config = sample_plugin(&server.url(&format!("/{name}.tar.gz")));
        config["type"] = json!(format!("org.example.{name}"));
        config["containers"][0]["command"]["uris"][0] =
            json!({"value": server.url(&format!("/{name}.tar.gz"))});
        daemon.add_config(&format!("{name}.json"), &config);
    }
    // A container with a root of its own does not see the sandbox: uris there are refused,
    // saying so, before anything is fetched (one on the host's root gets the sandbox).
    let mut oci = sample_plugin(&server.url("/dotdot.tar.gz"));
    oci["type"] = json!("org.example.oci");
    oci["runtime"] = json!({"kind": "oci", "rootfs": outside_str});
    daemon.add_config("oci.json", &oci);
    daemon.start();
    let error = launch_error(&daemon, "org.example.oci").await;
    assert!(
        error.contains("a container with a root file system of its own"),
        "oci: {error}"
    );
    for (name, _, expected) in &hostile {
        let error = launch_error(&daemon, &format!("org.example.{name}")).await;
        assert!(error.contains(expected), "{name}: {error}");
        assert!(
            error.contains(&format!("/{name}.tar.gz")),
            "{name}: {error}"
        );
    }
    // Nothing outside: not beside the work dir, not in `outside`, not at `/escape`.
    assert_eq!(dir_names(&outside), Vec::<String>::new());
    assert!(!dir.path().join("escape").exists());
    assert!(!Path::new("/escape").exists());
    // Nor anything of the archives inside a sandbox (a refused archive is discarded whole).
    let written: Vec<_> = walk(&daemon.work)
        .into_iter()
        .filter(|p| {
            let name = p.file_name().unwrap().to_string_lossy().into_owned();
            name == "link"
                || name.contains("escape")
                || name.contains(".tmp-")
                // Only csi-agent's own `endpoint` link is a symlink in a sandbox.
                || (name != "endpoint"
                    && std::fs::symlink_metadata(p).is_ok_and(|m| m.file_type().is_symlink()))
        })
        .collect();
    assert_eq!(written, Vec::<PathBuf>::new());
    let csictl = daemon.csictl(&["plugins"]);
    let text = String::from_utf8_lossy(&csictl.stdout);
    assert!(text.contains("refused"), "csictl plugins: {text}");
}

#[tokio::test]
async fn an_endless_body_is_cut_at_the_cap_and_cache_fetches_once() {
    require_private_mount_namespace();
    let dir = tempfile::tempdir().unwrap();
    let server = FileServer::start(HashMap::from([
        ("/endless/test-csi-plugin".to_owned(), Body::Endless),
        (
            "/cached/test-csi-plugin".to_owned(),
            Body::Bytes(testplugin_bytes()),
        ),
        (
            "/uncached/test-csi-plugin".to_owned(),
            Body::Bytes(testplugin_bytes()),
        ),
    ]));
    let cap = testplugin_bytes().len() as u64 + 4096;
    let mut daemon = Daemon::new(
        dir.path(),
        &["--start-plugins", "--fetch-max-bytes", &cap.to_string()],
    );
    let mut endless = sample_plugin(&server.url("/endless/test-csi-plugin"));
    endless["type"] = json!("org.example.endless");
    daemon.add_config("endless.json", &endless);
    let mut cached = sample_plugin(&server.url("/cached/test-csi-plugin"));
    cached["type"] = json!("org.example.cached");
    cached["containers"][0]["command"]["uris"][0]["cache"] = json!(true);
    daemon.add_config("cached.json", &cached);
    let mut uncached = sample_plugin(&server.url("/uncached/test-csi-plugin"));
    uncached["type"] = json!("org.example.uncached");
    daemon.add_config("uncached.json", &uncached);
    daemon.start();

    let error = launch_error(&daemon, "org.example.endless").await;
    assert!(
        error.contains(&format!("more than {cap} bytes")),
        "endless: {error}"
    );
    // The download stopped there (the cap plus what was in flight), and left no file.
    let cache = daemon.work.join("fetch-cache");
    let files: Vec<_> = walk(&cache);
    for file in &files {
        assert!(
            std::fs::metadata(file).unwrap().len() <= cap,
            "{file:?} holds more than the cap"
        );
        assert!(!file.to_string_lossy().contains(".tmp-"), "{file:?}");
    }

    // Two launches each: kill the plugin, wait for its relaunch.
    for plugin_type in ["org.example.cached", "org.example.uncached"] {
        let first = ready(&daemon, plugin_type, None).await;
        let pid = first.components[0].pid.unwrap();
        rustix::process::kill_process(
            rustix::process::Pid::from_raw(pid as i32).unwrap(),
            rustix::process::Signal::KILL,
        )
        .unwrap();
        let second = ready(&daemon, plugin_type, Some(pid)).await;
        assert!(second.components[0].restarts >= 1, "{second:?}");
    }
    assert_eq!(server.gets("/cached/test-csi-plugin"), 1, "cache: true");
    assert_eq!(server.gets("/uncached/test-csi-plugin"), 2, "cache: false");
    stop_plugins(&daemon).await;
    assert_eq!(mounts_under(dir.path()), Vec::<PathBuf>::new());
}

/// Every file and symlink beneath `dir` (not following links).
fn walk(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let Ok(entries) = std::fs::read_dir(dir) else {
        return out;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        match entry.file_type() {
            Ok(t) if t.is_dir() => out.extend(walk(&path)),
            Ok(_) => out.push(path),
            Err(_) => {}
        }
    }
    out
}
