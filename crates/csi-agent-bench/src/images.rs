//! `images`: pulling and preparing a plugin image (issue #13), csi-agent's image store against
//! `skopeo copy` + `umoci unpack` (Debian's) of the same image from the same loopback registry,
//! side by side in one run; then the warm start of a second plugin on the cached image.
//!
//! - The image: the release `csi-testplugin` with the shared libraries and the loader `ldd`
//!   lists, one gzip layer, built here and pushed with `skopeo` to a `docker-registry` started
//!   on a free loopback port with its storage in the run's temp dir.
//! - Cold, csi-agent: a fresh store dir each run, `ImageStore::ensure` (manifest, config and
//!   layer downloaded and verified into the blob store, the layer unpacked beneath its dir,
//!   the file system synced, the layer dir renamed into place), in the composition the
//!   daemon would use here (overlayfs where it works, detected once before the runs as the
//!   daemon does once per life).
//! - Cold, skopeo + umoci: `skopeo copy docker://… oci:DIR:tag` then `umoci unpack --image
//!   DIR:tag BUNDLE`, a fresh DIR and BUNDLE each run.
//! - Warm: `ensure` again on the same store (Mesos `cached: true`) and, with overlayfs, the
//!   container's root mounted as the runtime mounts it (fresh upper and work dirs, the overlay
//!   of the cached layers): what a second plugin of the image costs before its container
//!   starts; the registry's access log proves no blob is fetched. Needs a private mount
//!   namespace (`unshare -m`), like `all`.
//!
//! It owns only its measurement; it must not leave a process or a dir behind (the registry is
//! killed and the scratch dir removed on drop).

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context, bail, ensure};
use csi_agent::image::pull::{PullLimits, Puller};
use csi_agent::image::reference::{ImageRef, RegistrySettings};
use csi_agent::image::store::{Composition, ImageStore, PreparedRoot, PullPolicy};
use serde::Serialize;

use crate::env::{Env, Machine};
use crate::stats::Summary;

#[path = "../../csi-agent/tests/registry_support/mod.rs"]
mod registry_support;
use registry_support::{Entry, Registry, layer_tar_gz, oci_layout, push};

/// The targets of docs/benchmarks.md.
pub const MAX_COLD_RATIO: f64 = 1.0;
pub const MAX_WARM_MS: f64 = 50.0;

#[derive(Clone, Debug, clap::Args)]
pub struct ImagesArgs {
    /// Runs of each measurement.
    #[arg(long, default_value_t = 5)]
    pub runs: usize,
}

#[derive(Clone, Debug, Serialize)]
pub struct ImagesReport {
    pub machine: Machine,
    pub runs: usize,
    /// The layer's compressed size.
    pub layer_bytes: u64,
    pub csi_agent_cold: Summary,
    pub skopeo_umoci_cold: Summary,
    pub skopeo_copy: Summary,
    pub umoci_unpack: Summary,
    pub csi_agent_warm: Summary,
    /// `overlay` or `flattened` (and why not overlay).
    pub composition: String,
    /// Blob GETs the warm starts made (must be 0).
    pub warm_blob_gets: usize,
}

fn plugin_layer(binary: &Path) -> anyhow::Result<Vec<u8>> {
    let out = Command::new("ldd").arg(binary).output().context("ldd")?;
    let text = String::from_utf8_lossy(&out.stdout);
    let mut files: Vec<(String, Vec<u8>)> =
        vec![("bin/csi-testplugin".to_owned(), std::fs::read(binary)?)];
    if !text.contains("statically linked") && !text.contains("not a dynamic executable") {
        for line in text.lines() {
            let path = match line.split_once("=>") {
                Some((_, rest)) => rest.split_whitespace().next(),
                None => line.split_whitespace().next(),
            };
            if let Some(path) = path.filter(|p| p.starts_with('/')) {
                files.push((
                    path.trim_start_matches('/').to_owned(),
                    std::fs::read(path)?,
                ));
            }
        }
    }
    let entries: Vec<Entry<'_>> = files
        .iter()
        .map(|(path, data)| Entry::File {
            path,
            data,
            mode: 0o755,
        })
        .collect();
    Ok(layer_tar_gz(&entries))
}

fn run_cmd(what: &str, command: &mut Command) -> anyhow::Result<Duration> {
    let started = Instant::now();
    let out = command
        .output()
        .with_context(|| format!("cannot run {what}"))?;
    let took = started.elapsed();
    if !out.status.success() {
        bail!("{what} failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    Ok(took)
}

pub async fn run(env: &Env, args: &ImagesArgs) -> anyhow::Result<ImagesReport> {
    let scratch = env.scratch("images")?;
    let dir = scratch.path().to_path_buf();
    let registry = Registry::start(&dir.join("registry"))?;
    let layer = plugin_layer(&env.plugin_bin)?;
    let layer_bytes = layer.len() as u64;
    let layout = dir.join("layout");
    oci_layout(
        &layout,
        &[layer],
        serde_json::json!({"Entrypoint": ["/bin/csi-testplugin"]}),
    )?;
    push(&layout, &registry, "csi/testplugin:v1")?;
    let host = registry.host();
    let reference = ImageRef::parse("csi/testplugin:v1", &host)?;
    let settings = RegistrySettings {
        default_registry: host.clone(),
        insecure: vec![host.clone()],
        ..RegistrySettings::default()
    };

    let (mut ours, mut theirs, mut copies, mut unpacks, mut warm) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let mut warm_blob_gets = 0;
    let (composition, why_not) = Composition::detect(&dir);
    for run in 0..args.runs.max(1) {
        // Alternated, so neither always runs on a cold page cache.
        let store_dir = dir.join(format!("store-{run}"));
        let store = ImageStore::open(
            &store_dir,
            Puller::new(settings.clone(), PullLimits::default()),
            Some(composition),
        )?;
        let started = Instant::now();
        let prepared = store.ensure(&reference, PullPolicy::IfMissing).await?;
        ours.push(started.elapsed());
        let plugin_there = match &prepared.root {
            PreparedRoot::Flattened(rootfs) => rootfs.join("bin/csi-testplugin").is_file(),
            PreparedRoot::Layers(layers) => layers
                .iter()
                .any(|l| l.join("bin/csi-testplugin").is_file()),
        };
        ensure!(plugin_there, "the prepared image has no plugin");

        let oci = dir.join(format!("oci-{run}"));
        let bundle = dir.join(format!("bundle-{run}"));
        let copy = run_cmd(
            "skopeo copy",
            Command::new("skopeo")
                .args(["--insecure-policy", "copy", "-q", "--src-tls-verify=false"])
                .arg(format!("docker://{host}/csi/testplugin:v1"))
                .arg(format!("oci:{}:v1", oci.display())),
        )?;
        let unpack = run_cmd(
            "umoci unpack",
            Command::new("umoci")
                .args(["unpack", "--image"])
                .arg(format!("{}:v1", oci.display()))
                .arg(&bundle),
        )?;
        ensure!(
            bundle.join("rootfs/bin/csi-testplugin").is_file(),
            "umoci's rootfs has no plugin"
        );
        copies.push(copy);
        unpacks.push(unpack);
        theirs.push(copy + unpack);

        let gets = registry.blob_gets(None);
        let container = dir.join(format!("container-{run}"));
        let started = Instant::now();
        let again = store.ensure(&reference, PullPolicy::IfMissing).await?;
        if let PreparedRoot::Layers(layers) = &again.root {
            mount_root(layers, &container)?;
        }
        warm.push(started.elapsed());
        if let PreparedRoot::Layers(_) = &again.root {
            let rootfs = container.join("rootfs");
            let seen = rootfs.join("bin/csi-testplugin").is_file();
            rustix::mount::unmount(&rootfs, rustix::mount::UnmountFlags::DETACH)
                .with_context(|| format!("cannot unmount {}", rootfs.display()))?;
            ensure!(seen, "the overlay root has no plugin");
            std::fs::remove_dir_all(&container)?;
        }
        ensure!(again.downloaded.is_empty(), "the warm start downloaded");
        warm_blob_gets += registry.blob_gets(None) - gets;
        drop(store);
        for path in [&store_dir, &oci, &bundle] {
            std::fs::remove_dir_all(path)
                .with_context(|| format!("cannot remove {}", path.display()))?;
        }
    }
    Ok(ImagesReport {
        machine: Machine::describe(&dir),
        runs: args.runs.max(1),
        layer_bytes,
        csi_agent_cold: Summary::of(&ours),
        skopeo_umoci_cold: Summary::of(&theirs),
        skopeo_copy: Summary::of(&copies),
        umoci_unpack: Summary::of(&unpacks),
        csi_agent_warm: Summary::of(&warm),
        composition: match (composition, why_not) {
            (Composition::Overlay, _) => "overlay".to_owned(),
            (Composition::Flattened, reason) => {
                format!("flattened ({})", reason.unwrap_or_default())
            }
        },
        warm_blob_gets,
    })
}

/// The container's root as the oci runtime mounts it: fresh upper and work dirs under
/// `container`, the overlay of `layers` at `container/rootfs`.
fn mount_root(layers: &[std::path::PathBuf], container: &Path) -> anyhow::Result<()> {
    let (rootfs, upper, work) = (
        container.join("rootfs"),
        container.join("upper"),
        container.join("work"),
    );
    for dir in [&rootfs, &upper, &work] {
        std::fs::create_dir_all(dir)?;
    }
    csi_agent::image::overlay::mount(layers, Some((&upper, &work)), &rootfs)?;
    Ok(())
}

pub fn table(r: &ImagesReport) -> String {
    let ratio = r.csi_agent_cold.mean_ms / r.skopeo_umoci_cold.mean_ms;
    let row = |name: &str, s: &Summary| {
        format!(
            "| {name} | {:.1} | {:.1} | {:.1} | {:.1} |\n",
            s.mean_ms, s.p50_ms, s.min_ms, s.max_ms
        )
    };
    let mut out = format!(
        "#### Plugin image: pull + unpack ({} runs; one gzip layer of {:.1} MiB: the release csi-testplugin and its libraries; store: {})\n\n",
        r.runs,
        r.layer_bytes as f64 / (1 << 20) as f64,
        r.composition
    );
    out.push_str("| contender | mean (ms) | p50 | min | max |\n|---|---:|---:|---:|---:|\n");
    out.push_str(&row(
        "csi-agent cold: pull + verify + unpack + sync",
        &r.csi_agent_cold,
    ));
    out.push_str(&row("skopeo copy + umoci unpack", &r.skopeo_umoci_cold));
    out.push_str(&row("  of which skopeo copy", &r.skopeo_copy));
    out.push_str(&row("  of which umoci unpack", &r.umoci_unpack));
    out.push_str(&row(
        "csi-agent warm (cached image, second plugin: its root mounted)",
        &r.csi_agent_warm,
    ));
    out.push_str(&format!(
        "\n| target | measured | result |\n|---|---|---|\n\
         | cold pull+unpack ≤ {MAX_COLD_RATIO:.1}× skopeo+umoci | {:.1} vs {:.1} ms = {ratio:.2}× | **{}** |\n\
         | warm start: no copy, ≤ {MAX_WARM_MS:.0} ms for the root file system | {} blob GETs, mean {:.2} ms, max {:.2} ms | **{}** |\n",
        r.csi_agent_cold.mean_ms,
        r.skopeo_umoci_cold.mean_ms,
        if ratio <= MAX_COLD_RATIO { "PASS" } else { "FAIL" },
        r.warm_blob_gets,
        r.csi_agent_warm.mean_ms,
        r.csi_agent_warm.max_ms,
        if r.warm_blob_gets == 0 && r.csi_agent_warm.max_ms <= MAX_WARM_MS {
            "PASS"
        } else {
            "FAIL"
        },
    ));
    out
}
