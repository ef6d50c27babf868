//! A real Debian `podman` (4.3) on a test's dir: no daemon, one CLI process per command, all
//! its state under the dir.
//!
//! Every command runs `/usr/bin/podman --root <dir>/root --runroot <dir>/runroot --tmpdir
//! <dir>/tmp` with `CONTAINERS_CONF` and `CONTAINERS_STORAGE_CONF` naming files the harness
//! writes (so `/etc/containers` and the system's storage are never used). `containers.conf`
//! carries what podman 4.3 needs on these machines: `cgroup_manager = "cgroupfs"` (no
//! systemd), `runtime = "runc"`, explicit `nofile`/`nproc` ulimits (runc cannot set the
//! inherited unlimited ones: "error setting rlimit type 7"), `netns = "none"`, a file events
//! log, `volume_plugin_timeout`, and `[engine.volume_plugins]`: podman calls only the plugins
//! named there (it does not scan `/run/docker/plugins`).
//!
//! Must not: leave a container, conmon, mount or file outside the dir behind (Drop removes the
//! containers through podman, then kills by pid whatever is left under the dir and detaches its
//! mounts; podman's `/run/containers` and `/var/lib/containers/cache` and runc's `/run/runc`
//! are private tmpfs: [`private_engine_paths`]).

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use super::{Engine, kill_everything_under, private_engine_paths};

pub const PODMAN: &str = "/usr/bin/podman";
/// podman's own default, kept explicit: how long it waits for a volume plugin's answer (s).
pub const VOLUME_PLUGIN_TIMEOUT_S: u32 = 5;

/// podman on a test's dir; its containers removed, with all they left, on drop.
#[derive(Debug)]
pub struct Podman {
    pub dir: PathBuf,
    plugins: Vec<(String, PathBuf)>,
    volume_plugin_timeout_s: u32,
}

impl Podman {
    /// Writes the configuration under `dir` (created). Nothing runs until a command does.
    ///
    /// # Panics
    /// When not root in a private mount namespace.
    pub fn new(dir: &Path) -> Self {
        private_engine_paths();
        std::fs::create_dir_all(dir.join("tmp")).unwrap();
        std::fs::write(
            dir.join("storage.conf"),
            format!(
                "[storage]\ndriver = \"overlay\"\ngraphroot = \"{}\"\nrunroot = \"{}\"\n",
                dir.join("root").display(),
                dir.join("runroot").display()
            ),
        )
        .unwrap();
        let this = Self {
            dir: dir.to_path_buf(),
            plugins: Vec::new(),
            volume_plugin_timeout_s: VOLUME_PLUGIN_TIMEOUT_S,
        };
        this.write_conf();
        this
    }

    /// Adds a volume plugin `name` served on `socket` to `containers.conf`.
    pub fn volume_plugin(&mut self, name: &str, socket: &Path) {
        self.plugins.push((name.to_owned(), socket.to_path_buf()));
        self.write_conf();
    }

    /// Sets `volume_plugin_timeout` (seconds) in `containers.conf`.
    pub fn volume_plugin_timeout(&mut self, seconds: u32) {
        self.volume_plugin_timeout_s = seconds;
        self.write_conf();
    }

    pub fn conf_path(&self) -> PathBuf {
        self.dir.join("containers.conf")
    }

    /// Runs `/usr/bin/podman` (with the dir's root, runroot, tmpdir and configuration) `ARGS`
    /// ([`Engine::run`]).
    pub fn podman<I, S>(&self, args: I) -> Output
    where
        I: IntoIterator<Item = S>,
        S: AsRef<std::ffi::OsStr>,
    {
        self.run(args)
    }

    fn write_conf(&self) {
        let plugins: String = self
            .plugins
            .iter()
            .map(|(name, socket)| format!("{name} = \"{}\"\n", socket.display()))
            .collect();
        std::fs::write(
            self.conf_path(),
            format!(
                "[containers]\nnetns = \"none\"\n\
                 default_ulimits = [\"nofile=1024:1024\", \"nproc=4096:4096\"]\n\
                 [engine]\ncgroup_manager = \"cgroupfs\"\nruntime = \"runc\"\n\
                 events_logger = \"file\"\nevents_logfile_path = \"{events}\"\n\
                 tmp_dir = \"{tmp}\"\nvolume_plugin_timeout = {timeout}\n\
                 [engine.volume_plugins]\n{plugins}",
                events = self.dir.join("events.log").display(),
                tmp = self.dir.join("tmp").display(),
                timeout = self.volume_plugin_timeout_s,
            ),
        )
        .unwrap();
    }
}

impl Engine for Podman {
    /// `/usr/bin/podman --root … --runroot … --tmpdir …` of the dir, with `CONTAINERS_CONF`
    /// and `CONTAINERS_STORAGE_CONF` naming the harness's files.
    fn command(&self) -> Command {
        let mut command = Command::new(PODMAN);
        command
            .env("CONTAINERS_CONF", self.conf_path())
            .env("CONTAINERS_STORAGE_CONF", self.dir.join("storage.conf"))
            .arg("--root")
            .arg(self.dir.join("root"))
            .arg("--runroot")
            .arg(self.dir.join("runroot"))
            .arg("--tmpdir")
            .arg(self.dir.join("tmp"));
        command
    }

    fn dir(&self) -> &Path {
        &self.dir
    }
}

impl Drop for Podman {
    fn drop(&mut self) {
        // Through podman first (it unmounts and tells the volume plugins), then by pid.
        let _ = self.podman(["rm", "-af", "-t", "0"]);
        kill_everything_under(&self.dir);
    }
}
