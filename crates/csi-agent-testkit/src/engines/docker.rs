//! A real Debian `dockerd` (20.10) on a test's dir, with a containerd of its own.
//!
//! Everything lives under the dir: `data/` (`--data-root`), `exec/` (`--exec-root`),
//! `docker.sock`, `docker.pid`, `daemon.json` (`--config-file`, so the host's
//! `/etc/docker/daemon.json` is never read; it moves `key.json` here too), `dockerd.log`, and
//! `containerd/` (its config, root, state, socket and `containerd.log`). The containerd is
//! started by the harness and passed with `--containerd`: without that flag dockerd 20.10 uses
//! a system containerd whenever `/run/containerd/containerd.sock` exists
//! (`systemContainerdRunning`), and only otherwise starts its own; an explicit one per test
//! dockerd shares nothing with another test's or the system's (shim sockets under
//! `/run/containerd/s` are named by a hash of the containerd address, and that dir is a private
//! tmpfs anyway: [`private_engine_paths`]). `--live-restore` keeps containers running across a
//! dockerd restart (containerd and the shims stay up), which the front door's tests need.
//!
//! Must not: use the host's docker config, sockets or data; leave any process or mount behind
//! (Drop removes the containers through dockerd, stops it and containerd, then kills by pid
//! whatever is left under the dir and detaches its mounts).

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use super::{Engine, kill_everything_under, private_engine_paths, wait_gone};

/// Debian docker.io's daemon and its client (never `/usr/local/bin/docker`: a newer client
/// than the daemon on some machines).
pub const DOCKERD: &str = "/usr/sbin/dockerd";
pub const DOCKER: &str = "/usr/bin/docker";
pub const CONTAINERD: &str = "/usr/bin/containerd";
/// Where Docker discovers volume plugin spec files (besides `/usr/lib/docker/plugins`, and
/// sockets in `/run/docker/plugins`): a private tmpfs in the test's namespace.
pub const PLUGIN_SPEC_DIR: &str = "/etc/docker/plugins";
/// Where Docker discovers volume plugin sockets (`<driver>.sock`): a private tmpfs in the
/// test's namespace.
pub const PLUGIN_SOCKET_DIR: &str = "/run/docker/plugins";
/// How long [`Dockerd::start`] and [`Dockerd::restart`] wait for `docker version` to answer.
const READY_WITHIN: Duration = Duration::from_secs(30);

/// A running dockerd (and its containerd) on a test's dir; stopped, with all it started, on
/// drop.
#[derive(Debug)]
pub struct Dockerd {
    pub dir: PathBuf,
    dockerd: Option<Child>,
    containerd: Option<Child>,
}

impl Dockerd {
    /// Starts containerd and dockerd with all their state under `dir` (created), and waits
    /// until `docker version` answers.
    ///
    /// # Panics
    /// When not root in a private mount namespace, or either daemon does not come up within
    /// 30 s (the message names its log).
    pub fn start(dir: &Path) -> Self {
        private_engine_paths();
        std::fs::create_dir_all(dir.join("containerd")).unwrap();
        let mut this = Self {
            dir: dir.to_path_buf(),
            dockerd: None,
            containerd: None,
        };
        this.start_containerd();
        this.spawn_dockerd();
        this
    }

    pub fn socket(&self) -> PathBuf {
        self.dir.join("docker.sock")
    }

    pub fn log_path(&self) -> PathBuf {
        self.dir.join("dockerd.log")
    }

    /// The pid of the running dockerd, if it runs.
    pub fn pid(&self) -> Option<u32> {
        self.dockerd.as_ref().map(Child::id)
    }

    /// Runs `/usr/bin/docker -H unix://<dir>/docker.sock ARGS` ([`Engine::run`]).
    pub fn docker<I, S>(&self, args: I) -> Output
    where
        I: IntoIterator<Item = S>,
        S: AsRef<std::ffi::OsStr>,
    {
        self.run(args)
    }

    /// SIGTERMs dockerd and waits for it (30 s, then SIGKILL). Containers keep running
    /// (`--live-restore`), and so does containerd.
    pub fn stop(&mut self) {
        if let Some(mut child) = self.dockerd.take() {
            signal(&child, rustix::process::Signal::TERM);
            wait_child(&mut child, Duration::from_secs(30));
        }
    }

    /// SIGKILLs dockerd only (a crash): containerd, the shims and the containers stay.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.dockerd.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Stops dockerd if it runs, starts it again on the same dir and containerd, and waits
    /// until it answers.
    pub fn restart(&mut self) {
        self.stop();
        self.spawn_dockerd();
    }

    /// Makes the spec file `/etc/docker/plugins/<driver>.spec` saying `unix://<socket>`, seen
    /// only by this test process's engines (a private tmpfs: [`private_engine_paths`]), until
    /// the returned guard drops. Drivers are global to the process: name them uniquely per
    /// test. Keep a spec no longer than its plugin serves: for a volume name it does not know,
    /// dockerd asks every discovered driver, and one whose socket does not answer costs each
    /// such `docker run -v NAME:…` about 15 s of retries.
    pub fn plugin_spec(driver: &str, socket: &Path) -> PluginSpec {
        private_engine_paths();
        let path = Path::new(PLUGIN_SPEC_DIR).join(format!("{driver}.spec"));
        std::fs::write(&path, format!("unix://{}\n", socket.display())).unwrap();
        PluginSpec { path }
    }

    /// `/run/docker/plugins/<driver>.sock`, where a test's plugin (csi-agentd's
    /// `--volume-plugin-socket`) listens to be discovered by the test's dockerd; the dir is
    /// made in the private tmpfs first. Ask for it before making the socket: the tmpfs, mounted
    /// once per process by the first engine call, would hide a socket made there earlier.
    pub fn plugin_socket_path(driver: &str) -> PathBuf {
        private_engine_paths();
        std::fs::create_dir_all(PLUGIN_SOCKET_DIR).unwrap();
        Path::new(PLUGIN_SOCKET_DIR).join(format!("{driver}.sock"))
    }

    fn start_containerd(&mut self) {
        let dir = self.dir.join("containerd");
        let socket = dir.join("containerd.sock");
        let config = dir.join("config.toml");
        // No CRI (not needed, and it wants CNI), no debug or metrics listeners, a ttrpc
        // socket beside the grpc one: nothing at containerd's default paths.
        std::fs::write(
            &config,
            format!(
                "version = 2\nroot = \"{root}\"\nstate = \"{state}\"\n\
                 disabled_plugins = [\"io.containerd.grpc.v1.cri\"]\n\
                 [grpc]\n  address = \"{socket}\"\n[ttrpc]\n  address = \"{socket}.ttrpc\"\n\
                 [debug]\n  address = \"\"\n[metrics]\n  address = \"\"\n",
                root = dir.join("root").display(),
                state = dir.join("state").display(),
                socket = socket.display(),
            ),
        )
        .unwrap();
        let child = Command::new(CONTAINERD)
            .arg("--config")
            .arg(&config)
            .stdin(Stdio::null())
            .stdout(log_file(&dir.join("containerd.log")))
            .stderr(log_file(&dir.join("containerd.log")))
            .spawn()
            .unwrap_or_else(|err| panic!("{CONTAINERD}: {err} (install containerd, docker.io)"));
        self.containerd = Some(child);
        let deadline = Instant::now() + READY_WITHIN;
        while !socket.exists() {
            assert!(
                Instant::now() < deadline,
                "containerd did not make {} within {READY_WITHIN:?}: see {}",
                socket.display(),
                dir.join("containerd.log").display()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn spawn_dockerd(&mut self) {
        let config = self.dir.join("daemon.json");
        // The trust key goes to /etc/docker/key.json unless the config file says otherwise
        // (no such command-line flag in 20.10).
        std::fs::write(
            &config,
            serde_json::json!({ "deprecated-key-path": self.dir.join("key.json") }).to_string(),
        )
        .unwrap();
        let log = self.log_path();
        let child = Command::new(DOCKERD)
            .arg("--config-file")
            .arg(&config)
            .arg("--data-root")
            .arg(self.dir.join("data"))
            .arg("--exec-root")
            .arg(self.dir.join("exec"))
            .arg("--pidfile")
            .arg(self.dir.join("docker.pid"))
            .arg("-H")
            .arg(format!("unix://{}", self.socket().display()))
            .arg("--containerd")
            .arg(self.dir.join("containerd/containerd.sock"))
            .args([
                "--iptables=false",
                "--ip-masq=false",
                "--bridge=none",
                "--userland-proxy=false",
                "--live-restore",
            ])
            .stdin(Stdio::null())
            .stdout(log_file(&log))
            .stderr(log_file(&log))
            .spawn()
            .unwrap_or_else(|err| panic!("{DOCKERD}: {err} (install docker.io)"));
        self.dockerd = Some(child);
        let deadline = Instant::now() + READY_WITHIN;
        loop {
            if self.docker(["version"]).status.success() {
                return;
            }
            if let Some(Ok(Some(status))) = self.dockerd.as_mut().map(Child::try_wait) {
                self.dockerd = None;
                panic!("dockerd exited ({status}): see {}", log.display());
            }
            assert!(
                Instant::now() < deadline,
                "dockerd did not answer within {READY_WITHIN:?}: see {}",
                log.display()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

impl Engine for Dockerd {
    /// `/usr/bin/docker -H unix://<dir>/docker.sock`, with a client config dir of its own
    /// under the dir.
    fn command(&self) -> Command {
        let mut command = Command::new(DOCKER);
        command
            .env("DOCKER_CONFIG", self.dir.join("client"))
            .arg("-H")
            .arg(format!("unix://{}", self.socket().display()));
        command
    }

    fn dir(&self) -> &Path {
        &self.dir
    }
}

impl Drop for Dockerd {
    fn drop(&mut self) {
        // Through dockerd first, so that it unmounts and tells volume plugins (live restore
        // would otherwise keep the containers running past its stop).
        if self.dockerd.is_some() {
            let ids = self.docker(["ps", "-aq"]);
            let ids = String::from_utf8_lossy(&ids.stdout).into_owned();
            let ids: Vec<&str> = ids.split_whitespace().collect();
            if !ids.is_empty() {
                let _ = self.docker(["rm", "-f"].into_iter().chain(ids));
            }
            self.stop();
        }
        if let Some(mut child) = self.containerd.take() {
            signal(&child, rustix::process::Signal::TERM);
            wait_child(&mut child, Duration::from_secs(10));
        }
        kill_everything_under(&self.dir);
    }
}

/// A plugin spec file in `/etc/docker/plugins`, removed on drop.
#[derive(Debug)]
pub struct PluginSpec {
    pub path: PathBuf,
}

impl Drop for PluginSpec {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

fn log_file(path: &Path) -> std::fs::File {
    std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .unwrap_or_else(|err| panic!("{}: {err}", path.display()))
}

fn signal(child: &Child, signal: rustix::process::Signal) {
    if let Some(pid) = rustix::process::Pid::from_raw(i32::try_from(child.id()).unwrap()) {
        let _ = rustix::process::kill_process(pid, signal);
    }
}

/// Waits for `child` for `within`, then SIGKILLs it; always reaps it.
fn wait_child(child: &mut Child, within: Duration) {
    if !wait_gone(i32::try_from(child.id()).unwrap(), within) {
        let _ = child.kill();
    }
    let _ = child.wait();
}
