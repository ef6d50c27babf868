//! Test support: a real `docker-registry` (Debian's distribution 2.8) on a free loopback port
//! with its storage in a temp dir, and real OCI images built by the test and pushed there with
//! `skopeo`. Used by csi-agent's and csi-agentd's image tests and the bench; the images' files
//! are written by `testplugin_image` (csi-testplugin's `src/image.rs`).

pub mod hostile;
/// The test plugin's layer and image, and OCI layouts of any layers: the code
/// `csi-testplugin-image` (the demo's) runs too.
#[path = "../../../csi-testplugin/src/image.rs"]
pub mod testplugin_image;

pub use testplugin_image::{Image, oci_layout, oci_layout_with_diff_ids, sha256_hex};

use std::io::Write;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use flate2::Compression as GzLevel;
use flate2::write::GzEncoder;

/// A running registry; killed on drop.
#[derive(Debug)]
pub struct Registry {
    pub port: u16,
    pub dir: PathBuf,
    child: Option<Child>,
}

impl Registry {
    /// Starts a registry with storage and logs under `dir` (created).
    pub fn start(dir: &Path) -> anyhow::Result<Self> {
        std::fs::create_dir_all(dir)?;
        let port = {
            let listener = TcpListener::bind("127.0.0.1:0")?;
            listener.local_addr()?.port()
        };
        let mut registry = Self {
            port,
            dir: dir.to_path_buf(),
            child: None,
        };
        registry.spawn()?;
        Ok(registry)
    }

    fn spawn(&mut self) -> anyhow::Result<()> {
        let config = self.dir.join("config.yml");
        std::fs::write(
            &config,
            format!(
                "version: 0.1\nlog:\n  level: info\n  accesslog:\n    disabled: false\n\
                 storage:\n  filesystem:\n    rootdirectory: {}\n  delete:\n    enabled: true\n\
                 http:\n  addr: 127.0.0.1:{}\n",
                self.dir.join("storage").display(),
                self.port
            ),
        )?;
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.log_path())?;
        let child = Command::new("docker-registry")
            .arg("serve")
            .arg(&config)
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .context("docker-registry is installed (scripts/test installs it)")?;
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if http_get_status(self.port, "/v2/").ok() == Some(200) {
                return Ok(());
            }
            if Instant::now() > deadline {
                bail!(
                    "registry did not answer on port {}: {}",
                    self.port,
                    std::fs::read_to_string(self.log_path()).unwrap_or_default()
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// `127.0.0.1:PORT`.
    pub fn host(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    pub fn log_path(&self) -> PathBuf {
        self.dir.join("registry.log")
    }

    /// Blob GETs answered so far (the access log's lines), optionally only for one digest.
    pub fn blob_gets(&self, digest: Option<&str>) -> usize {
        let log = std::fs::read_to_string(self.log_path()).unwrap_or_default();
        log.lines()
            .filter(|l| l.contains("\"GET /v2/") && l.contains("/blobs/sha256:"))
            .filter(|l| digest.is_none_or(|d| l.contains(d)))
            .count()
    }

    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts it again on the same port and storage.
    pub fn restart(&mut self) -> anyhow::Result<()> {
        self.stop();
        self.spawn()
    }

    /// The file holding a blob's bytes in the registry's storage.
    pub fn blob_data_path(&self, hex: &str) -> PathBuf {
        self.dir
            .join("storage/docker/registry/v2/blobs/sha256")
            .join(&hex[..2])
            .join(hex)
            .join("data")
    }
}

impl Drop for Registry {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Registry settings for a plain-HTTP registry at `host` (a loopback one of the test): the
/// default registry, and the only one allowed without TLS.
pub fn loopback_registry(host: &str) -> csi_agent::image::reference::RegistrySettings {
    csi_agent::image::reference::RegistrySettings {
        default_registry: host.to_owned(),
        insecure: vec![host.to_owned()],
        ..csi_agent::image::reference::RegistrySettings::default()
    }
}

/// A minimal HTTP/1.0 GET on loopback, returning the status.
pub fn http_get_status(port: u16, path: &str) -> anyhow::Result<u16> {
    use std::io::Read;
    let mut stream = std::net::TcpStream::connect(("127.0.0.1", port))?;
    stream.set_read_timeout(Some(Duration::from_secs(2)))?;
    write!(stream, "GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")?;
    let mut buf = Vec::new();
    stream.read_to_end(&mut buf)?;
    let text = String::from_utf8_lossy(&buf);
    let status = text
        .split_whitespace()
        .nth(1)
        .context("no status")?
        .parse()?;
    Ok(status)
}

/// One file of a layer.
#[derive(Debug)]
pub enum Entry<'a> {
    File {
        path: &'a str,
        data: &'a [u8],
        mode: u32,
    },
    Dir {
        path: &'a str,
    },
    Symlink {
        path: &'a str,
        target: &'a str,
    },
    /// A `.wh.` whiteout of `path`.
    Whiteout {
        path: &'a str,
    },
    /// A regular file whose name is written into the header as it is, unchecked (hostile
    /// names such as `../x`, which `tar::Builder` refuses to write).
    RawName {
        name: &'a str,
        data: &'a [u8],
    },
}

/// A gzipped layer tar of `entries`.
pub fn layer_tar_gz(entries: &[Entry<'_>]) -> Vec<u8> {
    let mut builder = tar::Builder::new(GzEncoder::new(Vec::new(), GzLevel::fast()));
    for entry in entries {
        let mut header = tar::Header::new_gnu();
        header.set_uid(0);
        header.set_gid(0);
        header.set_mtime(1_700_000_000);
        match entry {
            Entry::File { path, data, mode } => {
                header.set_entry_type(tar::EntryType::Regular);
                header.set_mode(*mode);
                header.set_size(data.len() as u64);
                builder.append_data(&mut header, path, *data).unwrap();
            }
            Entry::Dir { path } => {
                header.set_entry_type(tar::EntryType::Directory);
                header.set_mode(0o755);
                header.set_size(0);
                builder.append_data(&mut header, path, &[][..]).unwrap();
            }
            Entry::Symlink { path, target } => {
                header.set_entry_type(tar::EntryType::Symlink);
                header.set_mode(0o777);
                header.set_size(0);
                builder.append_link(&mut header, path, target).unwrap();
            }
            Entry::RawName { name, data } => {
                header.set_entry_type(tar::EntryType::Regular);
                header.set_mode(0o644);
                header.set_size(data.len() as u64);
                let bytes = header.as_old_mut();
                bytes.name = [0; 100];
                bytes.name[..name.len()].copy_from_slice(name.as_bytes());
                header.set_cksum();
                builder.append(&header, *data).unwrap();
            }
            Entry::Whiteout { path } => {
                let (dir, name) = path.rsplit_once('/').unwrap_or(("", path));
                let wh = if dir.is_empty() {
                    format!(".wh.{name}")
                } else {
                    format!("{dir}/.wh.{name}")
                };
                header.set_entry_type(tar::EntryType::Regular);
                header.set_mode(0o644);
                header.set_size(0);
                builder.append_data(&mut header, wh, &[][..]).unwrap();
            }
        }
    }
    builder.into_inner().unwrap().finish().unwrap()
}

/// `skopeo copy oci:DIR docker://HOST/NAME` (plain HTTP).
pub fn push(layout: &Path, registry: &Registry, name: &str) -> anyhow::Result<()> {
    let out = Command::new("skopeo")
        .args(["--insecure-policy", "copy", "--dest-tls-verify=false", "-q"])
        .arg(format!("oci:{}", layout.display()))
        .arg(format!("docker://{}/{name}", registry.host()))
        .output()
        .context("skopeo is installed (scripts/test installs it)")?;
    if !out.status.success() {
        bail!("skopeo copy: {}", String::from_utf8_lossy(&out.stderr));
    }
    Ok(())
}

/// `skopeo copy oci:LAYOUT TRANSPORT:FILE:NAME`, e.g. `oci-archive` or `docker-archive`: an
/// image archive as a node without a registry receives it. No registry involved.
pub fn export(layout: &Path, transport: &str, file: &Path, name: &str) -> anyhow::Result<()> {
    let out = Command::new("skopeo")
        .args(["--insecure-policy", "copy", "-q"])
        .arg(format!("oci:{}", layout.display()))
        .arg(format!("{transport}:{}:{name}", file.display()))
        .output()
        .context("skopeo is installed (scripts/test installs it)")?;
    if !out.status.success() {
        bail!("skopeo copy: {}", String::from_utf8_lossy(&out.stderr));
    }
    Ok(())
}

/// Adds `org.opencontainers.image.ref.name` = `name` to every manifest of the layout's
/// `index.json` (what `skopeo copy … oci:DIR:NAME` writes).
pub fn name_layout(layout: &Path, name: &str) -> anyhow::Result<()> {
    let path = layout.join("index.json");
    let mut index: serde_json::Value = serde_json::from_slice(&std::fs::read(&path)?)?;
    for manifest in index["manifests"].as_array_mut().context("manifests")? {
        manifest["annotations"] = serde_json::json!({"org.opencontainers.image.ref.name": name});
    }
    std::fs::write(&path, serde_json::to_vec(&index)?)?;
    Ok(())
}

/// An archive entry, for hand-made (and hostile) image archives.
#[derive(Debug)]
pub enum ArchiveEntry<'a> {
    /// A regular file; the name is written into the header as it is (`../x` too).
    File {
        name: &'a str,
        data: &'a [u8],
    },
    Symlink {
        name: &'a str,
        target: &'a str,
    },
    HardLink {
        name: &'a str,
        target: &'a str,
    },
}

/// A tar of `entries`, names unchecked.
pub fn archive(entries: &[ArchiveEntry<'_>]) -> Vec<u8> {
    let mut builder = tar::Builder::new(Vec::new());
    for entry in entries {
        let mut header = tar::Header::new_gnu();
        header.set_uid(0);
        header.set_gid(0);
        header.set_mode(0o644);
        header.set_mtime(1_700_000_000);
        let (name, data, link): (&str, &[u8], Option<&str>) = match entry {
            ArchiveEntry::File { name, data } => {
                header.set_entry_type(tar::EntryType::Regular);
                (name, data, None)
            }
            ArchiveEntry::Symlink { name, target } => {
                header.set_entry_type(tar::EntryType::Symlink);
                (name, &[], Some(target))
            }
            ArchiveEntry::HardLink { name, target } => {
                header.set_entry_type(tar::EntryType::Link);
                (name, &[], Some(target))
            }
        };
        header.set_size(data.len() as u64);
        let bytes = header.as_old_mut();
        bytes.name = [0; 100];
        bytes.name[..name.len()].copy_from_slice(name.as_bytes());
        if let Some(link) = link {
            bytes.linkname = [0; 100];
            bytes.linkname[..link.len()].copy_from_slice(link.as_bytes());
        }
        header.set_cksum();
        builder.append(&header, data).unwrap();
    }
    builder.into_inner().unwrap()
}

/// The files of an OCI layout directory as archive entries' (name, content), sorted.
pub fn layout_files(layout: &Path) -> Vec<(String, Vec<u8>)> {
    let mut files = Vec::new();
    let mut stack = vec![layout.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                stack.push(path);
            } else {
                let name = path
                    .strip_prefix(layout)
                    .unwrap()
                    .to_string_lossy()
                    .into_owned();
                files.push((name, std::fs::read(&path).unwrap()));
            }
        }
    }
    files.sort();
    files
}

/// A tar of `files`.
pub fn archive_of(files: &[(String, Vec<u8>)]) -> Vec<u8> {
    let entries: Vec<ArchiveEntry<'_>> = files
        .iter()
        .map(|(name, data)| ArchiveEntry::File { name, data })
        .collect();
    archive(&entries)
}
