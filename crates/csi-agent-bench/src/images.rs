//! `images`: pulling and preparing a plugin image (issues #13 and #23), csi-agent's image store
//! against `skopeo copy` + `umoci unpack` (Debian's) of the same image from the same loopback
//! registry, side by side in one run; then the warm start of a second plugin on the cached
//! image; then the real daemon's peak memory while it pulls the image for a plugin's first use.
//!
//! - Two images, each built here and pushed with `skopeo` to a `docker-registry` started on a
//!   free loopback port with its storage in the run's temp dir:
//!   - `plugin`: the release `csi-testplugin` with the shared libraries and the loader `ldd`
//!     lists, one gzip layer;
//!   - `realistic` (issue #23): three layers, the plugin layer, one of 20,000 small files in
//!     200 dirs (text-like, compressible) and one of three 16 MiB incompressible files, about
//!     90 MiB unpacked: the shape of a real plugin image (a distribution's base, many small
//!     files, a few big binaries).
//! - Cold, csi-agent: a fresh store dir each run, `ImageStore::ensure` (manifest, config and
//!   layers downloaded and verified into the blob store, each layer unpacked beneath its dir,
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
//! - Daemon peak: a real `csi-agentd` whose plugin config names the image
//!   (`container.mesos.image`); a publish makes it pull, unpack and start the plugin in a runc
//!   container; the daemon's `VmHWM` after the publish is its peak resident memory over its
//!   whole life, the pull included. Then `drain` stops the container. Needs runc.
//!
//! It owns only its measurement; it must not leave a process or a dir behind (the registry is
//! killed and the scratch dir removed on drop; the daemon is drained and stopped).

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context, bail, ensure};
use csi_agent::image::pull::{PullLimits, Puller};
use csi_agent::image::reference::{ImageRef, RegistrySettings};
use csi_agent::image::store::{Composition, ImageStore, PreparedRoot, PullPolicy};
use serde::Serialize;

use crate::daemon::{Daemon, DaemonDirs, unpublish_request};
use crate::env::{Env, Machine, NODE_ID};
use crate::stats::Summary;

use csi_agent_testkit::registry::{
    Entry, Registry, layer_tar_gz, oci_layout, push, testplugin_image,
};

/// The targets of docs/benchmarks.md.
pub const MAX_COLD_RATIO: f64 = 1.0;
pub const MAX_WARM_MS: f64 = 50.0;
/// Issue #23: the daemon's peak resident memory while it pulls and unpacks an image.
pub const MAX_DAEMON_PEAK_MIB: f64 = 64.0;

#[derive(Clone, Debug, clap::Args)]
pub struct ImagesArgs {
    /// Runs of each measurement.
    #[arg(long, default_value_t = 5)]
    pub runs: usize,
    /// Skip the daemon's peak-memory measurement (it needs runc).
    #[arg(long)]
    pub no_daemon: bool,
}

#[derive(Clone, Debug, Serialize)]
pub struct ImagesReport {
    pub machine: Machine,
    pub runs: usize,
    /// `overlay` or `flattened` (and why not overlay).
    pub composition: String,
    pub cases: Vec<CaseReport>,
}

/// The figures of one image.
#[derive(Clone, Debug, Serialize)]
pub struct CaseReport {
    pub name: &'static str,
    pub description: String,
    pub layers: usize,
    /// The layers' compressed size, summed.
    pub compressed_bytes: u64,
    /// The bytes of the files in the layers (what an unpack writes).
    pub unpacked_bytes: u64,
    /// Entries in the layers (files and dirs).
    pub entries: u64,
    pub csi_agent_cold: Summary,
    pub skopeo_umoci_cold: Summary,
    pub skopeo_copy: Summary,
    pub umoci_unpack: Summary,
    pub csi_agent_warm: Summary,
    /// Blob GETs the warm starts made (must be 0).
    pub warm_blob_gets: usize,
    /// The real daemon pulling the image for a plugin's first use; `None` with `--no-daemon`.
    pub daemon: Option<DaemonPeak>,
}

#[derive(Clone, Debug, Serialize)]
pub struct DaemonPeak {
    /// `VmRSS` of the daemon once healthy, before the first publish.
    pub idle_rss_mib: f64,
    /// `VmHWM` after the publish that pulled the image and started the plugin.
    pub peak_mib: f64,
    /// The publish (pull + unpack + container start + CSI calls).
    pub first_publish_ms: f64,
}

/// An image to measure: its layers (gzip) and what they hold.
struct ImageCase {
    name: &'static str,
    description: String,
    layers: Vec<Vec<u8>>,
    unpacked_bytes: u64,
    entries: u64,
}

/// The files of a layer, owned, so that one builder serves every case.
struct LayerFiles {
    dirs: Vec<String>,
    files: Vec<(String, Vec<u8>, u32)>,
}

impl LayerFiles {
    fn bytes(&self) -> u64 {
        self.files
            .iter()
            .map(|(_, data, _)| data.len() as u64)
            .sum()
    }

    fn entries(&self) -> u64 {
        (self.dirs.len() + self.files.len()) as u64
    }

    fn tar_gz(&self) -> Vec<u8> {
        let entries: Vec<Entry<'_>> = self
            .dirs
            .iter()
            .map(|path| Entry::Dir { path })
            .chain(self.files.iter().map(|(path, data, mode)| Entry::File {
                path,
                data,
                mode: *mode,
            }))
            .collect();
        layer_tar_gz(&entries)
    }
}

/// The plugin layer's files: the binary and what `ldd` lists, as the tests' image has them.
fn plugin_files(binary: &Path) -> anyhow::Result<LayerFiles> {
    let read = |path: &Path| {
        std::fs::read(path).with_context(|| format!("cannot read {}", path.display()))
    };
    let mut files = vec![(
        testplugin_image::PLUGIN_PATH
            .trim_start_matches('/')
            .to_owned(),
        read(binary)?,
        0o755,
    )];
    for library in testplugin_image::shared_libraries(binary)? {
        files.push((
            library.to_string_lossy().trim_start_matches('/').to_owned(),
            read(&library)?,
            0o755,
        ));
    }
    Ok(LayerFiles {
        dirs: Vec::new(),
        files,
    })
}

/// A deterministic xorshift64* stream: the same image every run, data gzip cannot shrink
/// unless the alphabet says so.
struct Noise(u64);

impl Noise {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn bytes(&mut self, len: usize, alphabet: Option<&[u8]>) -> Vec<u8> {
        (0..len)
            .map(|_| {
                let word = self.next();
                match alphabet {
                    Some(letters) => letters[(word % letters.len() as u64) as usize],
                    None => (word >> 56) as u8,
                }
            })
            .collect()
    }
}

/// 20,000 text-like files of 256 B to 4 KiB in 200 dirs: a base distribution's many small files.
fn small_files(noise: &mut Noise) -> LayerFiles {
    const ALPHABET: &[u8] = b"abcdefghijklmnopqrstuvwxyz_ ;=(){}\n0123456789";
    let dirs: Vec<String> = (0..200)
        .map(|d| format!("usr/share/bench/d{d:03}"))
        .collect();
    let files = (0..20_000)
        .map(|i| {
            let len = 256 + (noise.next() % 3841) as usize;
            (
                format!("{}/f{i:05}.txt", dirs[i % dirs.len()]),
                noise.bytes(len, Some(ALPHABET)),
                0o644,
            )
        })
        .collect();
    let mut all_dirs = vec!["usr/share".to_owned(), "usr/share/bench".to_owned()];
    all_dirs.extend(dirs);
    LayerFiles {
        dirs: all_dirs,
        files,
    }
}

/// Three 16 MiB incompressible files: a plugin's big binaries.
fn big_files(noise: &mut Noise) -> LayerFiles {
    LayerFiles {
        dirs: vec!["opt".to_owned(), "opt/bench".to_owned()],
        files: (0..3)
            .map(|i| {
                (
                    format!("opt/bench/blob{i}.bin"),
                    noise.bytes(16 << 20, None),
                    0o644,
                )
            })
            .collect(),
    }
}

fn cases(plugin_bin: &Path) -> anyhow::Result<Vec<ImageCase>> {
    let plugin = plugin_files(plugin_bin)?;
    let plugin_layer = plugin.tar_gz();
    let mut noise = Noise(0x9e37_79b9_7f4a_7c15);
    let (small, big) = (small_files(&mut noise), big_files(&mut noise));
    let realistic = [&plugin, &small, &big];
    Ok(vec![
        ImageCase {
            name: "plugin",
            description: "one gzip layer: the release csi-testplugin and its libraries".to_owned(),
            layers: vec![plugin_layer.clone()],
            unpacked_bytes: plugin.bytes(),
            entries: plugin.entries(),
        },
        ImageCase {
            name: "realistic",
            description: "3 gzip layers: the plugin; 20,000 small text files in 200 dirs; 3 × 16 MiB incompressible files".to_owned(),
            layers: vec![plugin_layer, small.tar_gz(), big.tar_gz()],
            unpacked_bytes: realistic.iter().map(|l| l.bytes()).sum(),
            entries: realistic.iter().map(|l| l.entries()).sum(),
        },
    ])
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
    let (composition, why_not) = Composition::detect(&dir);
    let mut reports = Vec::new();
    for case in cases(&env.plugin_bin)? {
        let image = format!("csi/{}:v1", case.name);
        let layout = dir.join(format!("layout-{}", case.name));
        let plugin_dir = dir.join(format!("plugin-{}", case.name));
        std::fs::create_dir_all(&plugin_dir)?;
        oci_layout(
            &layout,
            &case.layers,
            serde_json::json!({
                "Entrypoint": ["/bin/csi-testplugin"],
                "Cmd": ["--volumes", "vol1:1M", "--node-id", NODE_ID],
                "Env": [format!("CSI_TESTPLUGIN_WORK_DIR={}", plugin_dir.display())],
            }),
        )?;
        push(&layout, &registry, &image)?;
        let mut report = measure(&dir, &registry, &image, &case, composition, args.runs).await?;
        if !args.no_daemon {
            report.daemon = Some(daemon_peak(env, &scratch, &registry, &image, &plugin_dir).await?);
        }
        reports.push(report);
    }
    Ok(ImagesReport {
        machine: Machine::describe(&dir),
        runs: args.runs.max(1),
        composition: match (composition, why_not) {
            (Composition::Overlay, _) => "overlay".to_owned(),
            (Composition::Flattened, reason) => {
                format!("flattened ({})", reason.unwrap_or_default())
            }
        },
        cases: reports,
    })
}

/// Cold and warm, csi-agent against skopeo + umoci, alternated in each run so that neither
/// always runs on a cold page cache.
async fn measure(
    dir: &Path,
    registry: &Registry,
    image: &str,
    case: &ImageCase,
    composition: Composition,
    runs: usize,
) -> anyhow::Result<CaseReport> {
    let host = registry.host();
    let reference = ImageRef::parse(image, &host)?;
    let settings = RegistrySettings {
        default_registry: host.clone(),
        insecure: vec![host.clone()],
        ..RegistrySettings::default()
    };
    let (mut ours, mut theirs, mut copies, mut unpacks, mut warm) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let mut warm_blob_gets = 0;
    for run in 0..runs.max(1) {
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
                .arg(format!("docker://{host}/{image}"))
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
    Ok(CaseReport {
        name: case.name,
        description: case.description.clone(),
        layers: case.layers.len(),
        compressed_bytes: case.layers.iter().map(|l| l.len() as u64).sum(),
        unpacked_bytes: case.unpacked_bytes,
        entries: case.entries,
        csi_agent_cold: Summary::of(&ours),
        skopeo_umoci_cold: Summary::of(&theirs),
        skopeo_copy: Summary::of(&copies),
        umoci_unpack: Summary::of(&unpacks),
        csi_agent_warm: Summary::of(&warm),
        warm_blob_gets,
        daemon: None,
    })
}

/// A real daemon pulls `image` for its plugin's first use: its peak resident memory.
async fn daemon_peak(
    env: &Env,
    scratch: &crate::procs::Scratch,
    registry: &Registry,
    image: &str,
    plugin_dir: &Path,
) -> anyhow::Result<DaemonPeak> {
    let host = registry.host();
    let name = format!("peak-{}", image.replace(['/', ':'], "-"));
    let dirs = DaemonDirs::new(scratch, &name)?;
    let plugin_type = format!("{}.image", crate::env::PLUGIN_TYPE);
    let config = serde_json::json!({
        "type": plugin_type,
        "containers": [{
            "services": ["CONTROLLER_SERVICE", "NODE_SERVICE"],
            "container": {
                "type": "MESOS",
                "mesos": {"image": {"type": "DOCKER", "docker": {"name": image}}},
                "volumes": [{"container_path": plugin_dir, "host_path": plugin_dir, "mode": "RW"}],
            },
        }],
        "startup_timeout_ms": 60000,
    });
    let file = dirs.config_dir.join("image.json");
    std::fs::write(&file, serde_json::to_string_pretty(&config)?)
        .with_context(|| format!("cannot write {}", file.display()))?;
    let extra = [
        "--docker-registry".to_owned(),
        host.clone(),
        "--insecure-registry".to_owned(),
        host,
    ];
    let (daemon, _) = Daemon::spawn_with(env, &dirs, &extra)?.ready().await?;
    let idle = daemon.memory()?;
    let started = Instant::now();
    daemon.publish(&plugin_type, "vol1", "w1").await?;
    let first_publish = started.elapsed();
    let peak = daemon.memory()?;
    daemon
        .api
        .unpublish(&unpublish_request(&plugin_type, "vol1", "w1"))
        .await
        .context("unpublish after the peak measurement")?;
    let drained = daemon
        .api
        .drain()
        .await
        .context("drain of the peak daemon")?;
    ensure!(
        drained.complete,
        "the peak daemon's drain left {:?}: the plugin's container may still run",
        drained.left
    );
    daemon.stop().await?;
    Ok(DaemonPeak {
        idle_rss_mib: idle.rss_mib(),
        peak_mib: peak.hwm_mib(),
        first_publish_ms: first_publish.as_secs_f64() * 1000.0,
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
    r.cases
        .iter()
        .map(|case| case_table(r, case))
        .collect::<Vec<_>>()
        .join("\n")
}

fn case_table(r: &ImagesReport, c: &CaseReport) -> String {
    let mib = |bytes: u64| bytes as f64 / (1 << 20) as f64;
    let ratio = c.csi_agent_cold.mean_ms / c.skopeo_umoci_cold.mean_ms;
    let row = |name: &str, s: &Summary| {
        format!(
            "| {name} | {:.1} | {:.1} | {:.1} | {:.1} |\n",
            s.mean_ms, s.p50_ms, s.min_ms, s.max_ms
        )
    };
    let mut out = format!(
        "#### Plugin image `{}`: pull + unpack ({} runs; {}; {:.1} MiB compressed, {:.1} MiB in {} entries unpacked; store: {})\n\n",
        c.name,
        r.runs,
        c.description,
        mib(c.compressed_bytes),
        mib(c.unpacked_bytes),
        c.entries,
        r.composition
    );
    out.push_str("| contender | mean (ms) | p50 | min | max |\n|---|---:|---:|---:|---:|\n");
    out.push_str(&row(
        "csi-agent cold: pull + verify + unpack + sync",
        &c.csi_agent_cold,
    ));
    out.push_str(&row("skopeo copy + umoci unpack", &c.skopeo_umoci_cold));
    out.push_str(&row("  of which skopeo copy", &c.skopeo_copy));
    out.push_str(&row("  of which umoci unpack", &c.umoci_unpack));
    out.push_str(&row(
        "csi-agent warm (cached image, second plugin: its root mounted)",
        &c.csi_agent_warm,
    ));
    out.push_str(&format!(
        "\n| target | measured | result |\n|---|---|---|\n\
         | cold pull+unpack ≤ {MAX_COLD_RATIO:.1}× skopeo+umoci | {:.1} vs {:.1} ms = {ratio:.2}× | **{}** |\n\
         | warm start: no copy, ≤ {MAX_WARM_MS:.0} ms for the root file system | {} blob GETs, mean {:.2} ms, max {:.2} ms | **{}** |\n",
        c.csi_agent_cold.mean_ms,
        c.skopeo_umoci_cold.mean_ms,
        if ratio <= MAX_COLD_RATIO { "PASS" } else { "FAIL" },
        c.warm_blob_gets,
        c.csi_agent_warm.mean_ms,
        c.csi_agent_warm.max_ms,
        if c.warm_blob_gets == 0 && c.csi_agent_warm.max_ms <= MAX_WARM_MS {
            "PASS"
        } else {
            "FAIL"
        },
    ));
    if let Some(d) = &c.daemon {
        out.push_str(&format!(
            "| daemon peak RSS (VmHWM) pulling it for a plugin's first publish ≤ {MAX_DAEMON_PEAK_MIB:.0} MiB | {:.1} MiB (idle {:.1} MiB; the publish: {:.0} ms) | **{}** |\n",
            d.peak_mib,
            d.idle_rss_mib,
            d.first_publish_ms,
            if d.peak_mib <= MAX_DAEMON_PEAK_MIB { "PASS" } else { "FAIL" },
        ));
    }
    out
}
