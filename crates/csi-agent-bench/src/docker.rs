//! `csi-agent-bench docker`: `docker run` of a short container (`true`) on a csi-agent volume
//! (the volume plugin protocol on `--volume-plugin-socket`, docs/docker-podman.md) against
//! the same container on a local (built-in) volume, alternately in one run on one real
//! `dockerd` (Debian's 20.10, started on the run's own dirs by the test kit), and the raw CSI
//! publish + unpublish sequence on the same plugin. Target (issue 27): csi − local ≤ raw
//! publish + unpublish + 20 ms, at the median.
//!
//! It owns this benchmark's setup and figures; it must not change what it measures (Docker
//! through its CLI, the daemon through its sockets, the plugin through its socket).

use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use csi_agent_testkit::engines::{Dockerd, Engine, IMAGE};
use serde::Serialize;

use crate::daemon::{Daemon, DaemonDirs, PluginSpec};
use crate::env::{Env, PLUGIN_TYPE, in_private_mount_namespace};
use crate::raw::Raw;
use crate::stats::Summary;

/// The driver's name (the socket's file name in `/run/docker/plugins`).
const DRIVER: &str = "csi-bench";

#[derive(Debug, clap::Args)]
pub struct DockerArgs {
    /// `docker run`s per volume kind.
    #[arg(long, default_value_t = 20)]
    pub rounds: usize,
}

#[derive(Debug, Serialize)]
pub struct DockerReport {
    pub rounds: usize,
    /// `docker run --rm -v local:/mnt/v IMG true`.
    pub local: Summary,
    /// `docker run --rm -v csi:/mnt/v IMG true`, the volume csi-agent's.
    pub csi: Summary,
    /// ControllerPublish? + NodeStage + NodePublish, then the reverse, on the plugin's socket.
    pub raw_publish_unpublish: Summary,
    /// `VolumeDriver.Mount` alone, sent to the socket as an engine sends it (the first mount
    /// of the volume: the whole publish); Podman's default bound on it is 5 s.
    pub mount: Summary,
    /// `Plugin.Activate` (Podman sends one from every CLI process).
    pub activate: Summary,
    /// csi p50 − local p50, in ms.
    pub overhead_p50_ms: f64,
    /// raw publish + unpublish p50 + 20 ms.
    pub target_p50_ms: f64,
}

fn timed(docker: &Dockerd, args: &[&str]) -> Duration {
    let started = Instant::now();
    docker.run_ok(args);
    started.elapsed()
}

/// The Docker half, blocking (the test kit's engines run their CLIs synchronously).
fn docker_rounds(scratch: std::path::PathBuf, rounds: usize) -> (Vec<Duration>, Vec<Duration>) {
    let docker = Dockerd::start(&scratch.join("docker"));
    docker.import_busybox();
    let plugin = format!("plugin={PLUGIN_TYPE}");
    docker.run_ok(["volume", "create", "-d", DRIVER, "-o", &plugin, "csi"]);
    docker.run_ok(["volume", "create", "local"]);
    let run = |volume: &str| {
        let mount = format!("{volume}:/mnt/v");
        timed(
            &docker,
            &[
                "run",
                "--rm",
                "--network",
                "none",
                "-v",
                &mount,
                IMAGE,
                "true",
            ],
        )
    };
    // Warm-up: the image's layers, the driver's activation, the plugin's first publish.
    for _ in 0..2 {
        run("local");
        run("csi");
    }
    let (mut local, mut csi) = (Vec::new(), Vec::new());
    for _ in 0..rounds {
        local.push(run("local"));
        csi.push(run("csi"));
    }
    docker.run_ok(["volume", "rm", "csi", "local"]);
    (local, csi)
}

pub async fn run(env: &Env, args: &DockerArgs) -> anyhow::Result<DockerReport> {
    if !in_private_mount_namespace() {
        bail!("run under `unshare -m --propagation private` (the engines and publishes mount)");
    }
    let scratch = env.scratch("docker")?;
    let dirs = DaemonDirs::new(&scratch, "daemon")?;
    let spec = PluginSpec::new(
        PLUGIN_TYPE,
        scratch.join("plugin"),
        &["--volumes", "pre:1Mi"],
    );
    dirs.add_plugin(env, &spec)?;
    let socket = Dockerd::plugin_socket_path(DRIVER);
    let (daemon, _) = Daemon::spawn_with(
        env,
        &dirs,
        &[
            "--volume-plugin-socket".into(),
            socket.display().to_string(),
        ],
    )?
    .ready()
    .await?;

    let rounds = args.rounds;
    let dir = scratch.path().to_path_buf();
    let (local, csi) = tokio::task::spawn_blocking(move || docker_rounds(dir, rounds))
        .await
        .context("the docker rounds failed (dockerd's log is under the run's temp dir)")?;

    let (plugin_socket, _) = daemon.plugin_socket(PLUGIN_TYPE).await?;
    let raw = Raw::connect(&plugin_socket, scratch.join("raw"), PLUGIN_TYPE).await?;
    let mut cycles = Vec::new();
    for _ in 0..rounds {
        let started = Instant::now();
        raw.publish("pre").await?;
        raw.unpublish("pre").await?;
        cycles.push(started.elapsed());
    }
    // The protocol's calls alone, as an engine sends them.
    let door = csi_agent_api::ApiClient::unix(&socket);
    let (mut mounts, mut activations) = (Vec::new(), Vec::new());
    door.post_raw(
        "/VolumeDriver.Create",
        &serde_json::json!({"Name": "direct", "Opts": {"plugin": PLUGIN_TYPE}}),
    )
    .await?;
    for i in 0..rounds {
        let started = Instant::now();
        door.post_raw("/Plugin.Activate", &serde_json::json!(null))
            .await?;
        activations.push(started.elapsed());
        let call = serde_json::json!({"Name": "direct", "ID": format!("m{i}")});
        let started = Instant::now();
        let (status, answer) = door.post_raw("/VolumeDriver.Mount", &call).await?;
        mounts.push(started.elapsed());
        if status != 200 {
            bail!("Mount answered {status}: {answer}");
        }
        door.post_raw("/VolumeDriver.Unmount", &call).await?;
    }
    door.post_raw(
        "/VolumeDriver.Remove",
        &serde_json::json!({"Name": "direct"}),
    )
    .await?;
    daemon.stop().await?;
    let (mount, activate) = (Summary::of(&mounts), Summary::of(&activations));
    let (local, csi, raw_publish_unpublish) =
        (Summary::of(&local), Summary::of(&csi), Summary::of(&cycles));
    Ok(DockerReport {
        rounds,
        overhead_p50_ms: csi.p50_ms - local.p50_ms,
        target_p50_ms: raw_publish_unpublish.p50_ms + 20.0,
        local,
        csi,
        raw_publish_unpublish,
        mount,
        activate,
    })
}

/// The markdown table of docs/benchmarks.md.
pub fn table(r: &DockerReport) -> String {
    let row = |name: &str, s: &Summary| {
        format!(
            "| {name} | {:.1} | {:.1} | {:.1} |\n",
            s.p50_ms, s.p99_ms, s.mean_ms
        )
    };
    let mut out = String::from(
        "| `docker run --rm … true` | p50 ms | p99 ms | mean ms |\n|---|---|---|---|\n",
    );
    out.push_str(&row("on a local volume", &r.local));
    out.push_str(&row("on a csi-agent volume", &r.csi));
    out.push_str(&row(
        "raw CSI publish + unpublish",
        &r.raw_publish_unpublish,
    ));
    out.push_str(&row("`VolumeDriver.Mount` alone (a first mount)", &r.mount));
    out.push_str(&row("`Plugin.Activate`", &r.activate));
    out.push_str(&format!(
        "\n{} runs each, alternating; csi − local at p50: {:.1} ms ({:.2}× local); target (raw publish + unpublish + 20 ms) at p50: {:.1} ms: {}\n",
        r.rounds,
        r.overhead_p50_ms,
        r.csi.p50_ms / r.local.p50_ms,
        r.target_p50_ms,
        if r.overhead_p50_ms <= r.target_p50_ms {
            "met"
        } else {
            "NOT met"
        }
    ));
    out
}
