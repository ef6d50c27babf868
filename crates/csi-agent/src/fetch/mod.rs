//! The Mesos fetcher for managed components: a component's `command.uris` (Mesos
//! `CommandInfo.URI`) are fetched into its sandbox (its container dir, the working directory
//! of the process runtime) before each launch, so `"value": "./test-csi-plugin"` runs what was
//! fetched, as under Mesos (`src/launcher/fetcher.cpp`).
//!
//! It owns: the schemes it accepts (`http`, `https`, `file://` and a plain absolute path), the
//! download (bounded in bytes by [`FetchOptions::max_bytes`] and in time by
//! [`FetchOptions::timeout`], written to a temp name, fsynced and renamed, so a partial
//! download is never used), the download cache (`<work>/fetch-cache/<sha256 of the URI>`,
//! used when a URI asks for `cache`), and what is put in the sandbox: the file under its name
//! (`output_file`, or the URI's last path component), made 0755 when `executable`, or an
//! archive's content when `extract` (and not `executable`) and the name ends in `.tar`,
//! `.tar.gz`, `.tgz` or `.zip` (a zip is rewritten as a tar first, [`zip`], so its entries
//! meet the same rules). Extraction is `crate::image::unpack::apply_archive_within`: the image
//! layer rules (nothing through `..`, an absolute name, a symlink; no device node; entries
//! and bytes bounded), into a fresh directory beneath the sandbox whose entries are then
//! renamed into place, so a refused archive leaves nothing in the sandbox.
//!
//! It must not decide when to fetch or retry (the service manager fetches before every launch
//! and a failure is that launch's error, retried with the restart backoff), nor run anything
//! it fetched, nor write anywhere but the sandbox and the cache dir.

use std::fs::File;
use std::io::{self, Write as _};
use std::os::unix::fs::PermissionsExt as _;
use std::path::{Path, PathBuf};
use std::time::Duration;

use sha2::{Digest as _, Sha256};

use crate::config::UriConfig;
use crate::durable::{self, IoError, Replace, TempFile};
use crate::image::registry::{self, RegistryError};
use crate::image::unpack::{self, UnpackError};

mod zip;

/// `--fetch-max-bytes`' default: 1 GiB per downloaded file.
pub const DEFAULT_MAX_BYTES: u64 = 1 << 30;
/// `--fetch-timeout`'s default: a whole download, from the request to the last byte.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(600);
/// The dir under the work dir holding cached downloads.
pub const CACHE_DIR: &str = "fetch-cache";
/// Extraction bounds: entries of one archive.
const MAX_ARCHIVE_ENTRIES: u64 = 100_000;
/// Extraction bounds: bytes written per archive, as a multiple of the download cap (a
/// compressed plugin tarball rarely expands more than a few times).
const EXTRACT_FACTOR: u64 = 4;

/// The daemon's fetch settings.
#[derive(Clone, Debug)]
pub struct FetchOptions {
    /// Where cached downloads live (`<work>/fetch-cache`).
    pub cache_dir: PathBuf,
    /// Bytes of one download (and of a copied local file).
    pub max_bytes: u64,
    /// The time one download may take in all.
    pub timeout: Duration,
}

impl FetchOptions {
    /// The defaults, the cache under `work_dir`.
    pub fn new(work_dir: &Path) -> Self {
        Self {
            cache_dir: work_dir.join(CACHE_DIR),
            max_bytes: DEFAULT_MAX_BYTES,
            timeout: DEFAULT_TIMEOUT,
        }
    }
}

/// Why a URI could not be fetched; each names the URI.
#[derive(Debug, thiserror::Error)]
pub enum FetchError {
    #[error("fetching {uri}: {source}")]
    Http {
        uri: String,
        #[source]
        source: Box<RegistryError>,
    },
    #[error("fetching {uri}: HTTP {status}")]
    Status { uri: String, status: u16 },
    #[error(
        "fetching {uri}: not done within {timeout:?}; raise --fetch-timeout or serve it faster"
    )]
    Timeout { uri: String, timeout: Duration },
    #[error("fetching {uri}: {} is more than {max} bytes; raise --fetch-max-bytes", path.display())]
    TooLarge {
        uri: String,
        path: PathBuf,
        max: u64,
    },
    #[error("fetching {uri}: {source}")]
    Io {
        uri: String,
        #[source]
        source: IoError,
    },
    #[error("extracting {uri} into {}: {source}; fix the archive or set \"extract\": false", sandbox.display())]
    Extract {
        uri: String,
        sandbox: PathBuf,
        #[source]
        source: Box<UnpackError>,
    },
    #[error("extracting the zip {uri}: {source}; fix the archive or set \"extract\": false")]
    Zip {
        uri: String,
        #[source]
        source: Box<zip::ZipError>,
    },
    #[error("fetching {uri}: {reason}")]
    Invalid { uri: String, reason: String },
    #[error("fetching {uri}: {source}")]
    Uri {
        uri: String,
        #[source]
        source: UriError,
    },
}

/// Why a URI's `value` or `output_file` is refused (at config load, and again at fetch).
#[derive(Debug, thiserror::Error)]
pub enum UriError {
    #[error("{value:?} is not a valid URL: {source}")]
    BadUrl {
        value: String,
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    #[error(
        "{value:?} is not fetchable: use http://, https://, file:///absolute/path or an absolute path"
    )]
    Unfetchable { value: String },
    #[error("{name:?} must be one file name (no '/', not starting with '.'), put in the sandbox")]
    NotOneName { name: String },
    #[error(
        "{name:?} is csi-agent's own file in the sandbox (stdout, stderr, endpoint, component.json, bundle); give another \"output_file\""
    )]
    Reserved { name: String },
    #[error(
        "{value:?} does not end in a file name to put in the sandbox ({source}); give \"output_file\""
    )]
    NoFileName {
        value: String,
        #[source]
        source: Box<UriError>,
    },
}

/// Where a URI's content comes from.
enum Source<'a> {
    Http(&'a str),
    Local(&'a Path),
}

fn source(value: &str) -> Result<Source<'_>, UriError> {
    if value.starts_with("http://") || value.starts_with("https://") {
        return reqwest::Url::parse(value)
            .map(|_| Source::Http(value))
            .map_err(|err| bad_url(value, err));
    }
    let path = value.strip_prefix("file://").unwrap_or(value);
    if path.starts_with('/') && !path.contains('\0') {
        return Ok(Source::Local(Path::new(path)));
    }
    Err(UriError::Unfetchable {
        value: value.to_owned(),
    })
}

fn bad_url(value: &str, err: impl std::error::Error + Send + Sync + 'static) -> UriError {
    UriError::BadUrl {
        value: value.to_owned(),
        source: Box::new(err),
    }
}

/// Config-time check of a URI's `value` (the message says what to fix).
pub fn check_uri(value: &str) -> Result<(), UriError> {
    source(value)?;
    file_name(value).map(|_| ())
}

/// Whether `name` (a top-level name in the sandbox) is, or starts like, one of csi-agent's
/// own files there: the logs (and their rotated copies), the endpoint link, the component
/// record, the oci bundle. A fetched file or an archive's entry there would be written
/// through by csi-agent (a `stdout` symlink to `/etc/shadow` would get the plugin's output).
fn reserved(name: &str) -> bool {
    crate::logs::LOG_FILES
        .iter()
        .chain(&[
            crate::service_manager::ENDPOINT_LINK,
            crate::service_manager::COMPONENT_RECORD,
            crate::runtime::oci::BUNDLE_DIR,
        ])
        .any(|own| name.starts_with(own))
}

/// Config-time check of `output_file`: one file name, as it is put in the sandbox.
pub fn check_output_file(name: &str) -> Result<(), UriError> {
    if name.is_empty() || name.contains('/') || name.contains('\0') || name.starts_with('.') {
        return Err(UriError::NotOneName {
            name: name.to_owned(),
        });
    }
    if reserved(name) {
        return Err(UriError::Reserved {
            name: name.to_owned(),
        });
    }
    Ok(())
}

/// The last path component of the URI (no query or fragment), as Mesos names the file.
fn file_name(value: &str) -> Result<String, UriError> {
    let path = match source(value)? {
        Source::Http(url) => reqwest::Url::parse(url)
            .map_err(|err| bad_url(value, err))?
            .path()
            .to_owned(),
        Source::Local(path) => path.to_string_lossy().into_owned(),
    };
    let name = path.rsplit('/').next().unwrap_or_default();
    check_output_file(name).map_err(|reason| UriError::NoFileName {
        value: value.to_owned(),
        source: Box::new(reason),
    })?;
    Ok(name.to_owned())
}

/// What to do with the fetched file.
#[derive(Debug, PartialEq, Eq)]
enum Action {
    Copy,
    Executable,
    ExtractTar,
    /// A `.zip`: rewritten as a tar, then extracted as one ([`zip`]).
    ExtractZip,
    /// A bare `.gz` file: decompressed to the name without `.gz`, as Mesos's `gunzip`.
    Gunzip,
}

fn action(uri: &UriConfig, name: &str) -> Result<Action, FetchError> {
    if uri.executable {
        // Mesos: an executable is never extracted.
        return Ok(Action::Executable);
    }
    if !uri.extract {
        return Ok(Action::Copy);
    }
    let lower = name.to_ascii_lowercase();
    if [".tar", ".tar.gz", ".tgz"]
        .iter()
        .any(|ext| lower.ends_with(ext))
    {
        return Ok(Action::ExtractTar);
    }
    if lower.ends_with(".gz") {
        return Ok(Action::Gunzip);
    }
    if lower.ends_with(".zip") {
        return Ok(Action::ExtractZip);
    }
    Ok(Action::Copy)
}

/// Fetches every URI into `sandbox` (an existing directory csi-agent owns), in order.
pub async fn fetch_all(
    uris: &[UriConfig],
    sandbox: &Path,
    options: &FetchOptions,
) -> Result<(), FetchError> {
    if uris.is_empty() {
        return Ok(());
    }
    let client = registry::http_client(Duration::from_secs(30), Duration::from_secs(60)).map_err(
        |source| FetchError::Http {
            uri: uris[0].value.clone(),
            source: Box::new(RegistryError::Request {
                url: uris[0].value.clone(),
                source,
            }),
        },
    )?;
    for uri in uris {
        fetch_one(&client, uri, sandbox, options).await?;
    }
    Ok(())
}

async fn fetch_one(
    client: &reqwest::Client,
    uri: &UriConfig,
    sandbox: &Path,
    options: &FetchOptions,
) -> Result<(), FetchError> {
    let invalid = |source: UriError| FetchError::Uri {
        uri: uri.value.clone(),
        source,
    };
    let name = match &uri.output_file {
        Some(name) => {
            check_output_file(name).map_err(invalid)?;
            name.clone()
        }
        None => file_name(&uri.value).map_err(invalid)?,
    };
    let action = action(uri, &name)?;
    // The file to install from, and the download to remove afterwards (dropped) if it is not
    // cached.
    let (file, download_temp) = match source(&uri.value).map_err(invalid)? {
        Source::Local(path) => (path.to_path_buf(), None),
        Source::Http(url) => {
            mkdir(&options.cache_dir, &uri.value)?;
            let cached = options.cache_dir.join(cache_key(&uri.value));
            if uri.cache && cached.is_file() {
                tracing::debug!(uri = %uri.value, "fetch: using the cached download");
                (cached, None)
            } else {
                let temp = download(client, url, &uri.value, options).await?;
                if uri.cache {
                    temp.persist(&cache_key(&uri.value), Replace::Overwrite)
                        .map_err(io_failure(&uri.value))?;
                    (cached, None)
                } else {
                    (temp.path(), Some(temp))
                }
            }
        }
    };
    let (uri_value, sandbox_dir, max) =
        (uri.value.clone(), sandbox.to_path_buf(), options.max_bytes);
    let install_file = file.clone();
    let installed = tokio::task::spawn_blocking(move || {
        install(&install_file, &uri_value, &sandbox_dir, &name, &action, max)
    })
    .await
    .map_err(|err| io_error(&uri.value, "installing", sandbox)(io::Error::other(err.to_string())))
    .and_then(|result| result);
    drop(download_temp);
    installed
}

/// `sha256(uri)` in hex: a cache name no URI can steer.
fn cache_key(uri: &str) -> String {
    let digest = Sha256::digest(uri.as_bytes());
    digest.iter().map(|b| format!("{b:02x}")).collect()
}

/// Downloads `url` to a temp file in the cache dir, whole and fsynced, or fails removing it.
async fn download(
    client: &reqwest::Client,
    url: &str,
    uri: &str,
    options: &FetchOptions,
) -> Result<TempFile, FetchError> {
    let mut temp = durable::Dir::open(&options.cache_dir)
        .and_then(|dir| dir.create_temp("download", 0o600))
        .map_err(io_failure(uri))?;
    let result = tokio::time::timeout(
        options.timeout,
        download_to(client, url, uri, &mut temp, options),
    )
    .await
    .unwrap_or_else(|_| {
        Err(FetchError::Timeout {
            uri: uri.to_owned(),
            timeout: options.timeout,
        })
    });
    // On error, dropping `temp` removes it.
    result.map(|()| temp)
}

async fn download_to(
    client: &reqwest::Client,
    url: &str,
    uri: &str,
    temp: &mut TempFile,
    options: &FetchOptions,
) -> Result<(), FetchError> {
    let http = |source: RegistryError| FetchError::Http {
        uri: uri.to_owned(),
        source: Box::new(source),
    };
    let response = client.get(url).send().await.map_err(|source| {
        http(RegistryError::Request {
            url: url.to_owned(),
            source,
        })
    })?;
    if !response.status().is_success() {
        return Err(FetchError::Status {
            uri: uri.to_owned(),
            status: response.status().as_u16(),
        });
    }
    let file = temp.file();
    registry::stream_capped(response, options.max_bytes, "the download", |chunk| {
        file.write_all(chunk)
    })
    .await
    .map_err(http)?;
    temp.sync().map(drop).map_err(io_failure(uri))
}

/// Puts `file` in the sandbox under `name` as `action` says.
fn install(
    file: &Path,
    uri: &str,
    sandbox: &Path,
    name: &str,
    action: &Action,
    max: u64,
) -> Result<(), FetchError> {
    let io = |op, path: &Path| io_error(uri, op, path);
    match action {
        Action::ExtractTar => extract(file, uri, sandbox, max, false),
        Action::ExtractZip => extract(file, uri, sandbox, max, true),
        Action::Copy | Action::Executable | Action::Gunzip => {
            let input = File::open(file).map_err(io("opening", file))?;
            let size = input.metadata().map_err(io("stat", file))?.len();
            if size > max {
                return Err(FetchError::TooLarge {
                    uri: uri.to_owned(),
                    path: file.to_path_buf(),
                    max,
                });
            }
            let (mut reader, name, cap): (Box<dyn io::Read>, &str, u64) = match action {
                Action::Gunzip => {
                    let plain = &name[..name.len() - ".gz".len()];
                    check_output_file(plain).map_err(|reason| FetchError::Invalid {
                        uri: uri.to_owned(),
                        reason: format!("cannot gunzip to {plain:?}: {reason}"),
                    })?;
                    let decoder = flate2::read::MultiGzDecoder::new(input);
                    (Box::new(decoder), plain, max.saturating_mul(EXTRACT_FACTOR))
                }
                _ => (Box::new(input), name, max),
            };
            let mut temp = durable::Dir::open(sandbox)
                .and_then(|dir| dir.create_temp(name, 0o600))
                .map_err(io_failure(uri))?;
            let temp_path = temp.path();
            {
                // `take` one byte past the cap: a local file growing while it is copied, or
                // a gzip bomb, stops there.
                let copied = io::copy(&mut io::Read::take(&mut reader, cap + 1), temp.file())
                    .map_err(io("copying to", &temp_path))?;
                if copied > cap {
                    return Err(FetchError::TooLarge {
                        uri: uri.to_owned(),
                        path: sandbox.join(name),
                        max: cap,
                    });
                }
                let mode = if *action == Action::Executable {
                    0o755
                } else {
                    0o644
                };
                temp.file()
                    .set_permissions(std::fs::Permissions::from_mode(mode))
                    .map_err(io("chmod", &temp_path))?;
            }
            // Replaces whatever is at the name (a symlink itself, never its target); an
            // error (or the early returns above) drops `temp`, which removes it.
            temp.persist(name, Replace::Overwrite)
                .map(drop)
                .map_err(io_failure(uri))
        }
    }
}

/// Extracts a tar (or a zip, rewritten as a tar first: [`zip`]) into a fresh dir beneath the
/// sandbox, then renames its top-level entries into the sandbox (replacing what an earlier
/// launch put there).
fn extract(
    file: &Path,
    uri: &str,
    sandbox: &Path,
    max: u64,
    is_zip: bool,
) -> Result<(), FetchError> {
    let io = |op, path: &Path| io_error(uri, op, path);
    let staging = sandbox.join(durable::temp_name("extract"));
    let rewritten = sandbox.join(durable::temp_name("zip-as-tar"));
    let scratch = sandbox.join(durable::temp_name("zip-scratch"));
    std::fs::create_dir(&staging).map_err(io("creating", &staging))?;
    let result = (|| {
        let tar = if is_zip {
            zip::to_tar(
                file,
                &rewritten,
                &scratch,
                MAX_ARCHIVE_ENTRIES,
                max.saturating_mul(EXTRACT_FACTOR),
            )
            .map_err(|source| FetchError::Zip {
                uri: uri.to_owned(),
                source: Box::new(source),
            })?;
            let _ = std::fs::remove_file(&scratch);
            rewritten.as_path()
        } else {
            file
        };
        let input = File::open(tar).map_err(io("opening", tar))?;
        let limits = unpack::Limits {
            max_entries: MAX_ARCHIVE_ENTRIES,
            max_file_bytes: max.saturating_mul(EXTRACT_FACTOR),
            max_layer_bytes: max.saturating_mul(EXTRACT_FACTOR).saturating_add(max),
            ..unpack::Limits::default()
        };
        unpack::apply_archive_within(
            &staging,
            input,
            &limits,
            &crate::image::budget::Budget::unlimited(),
        )
        .map_err(|source| FetchError::Extract {
            uri: uri.to_owned(),
            sandbox: sandbox.to_path_buf(),
            source: Box::new(source),
        })?;
        let mut entries = Vec::new();
        for entry in std::fs::read_dir(&staging).map_err(io("listing", &staging))? {
            let entry = entry.map_err(io("listing", &staging))?;
            let name = entry.file_name().to_string_lossy().into_owned();
            if reserved(&name) {
                return Err(FetchError::Invalid {
                    uri: uri.to_owned(),
                    reason: format!(
                        "the archive's top-level entry {name:?} would replace csi-agent's own file in the sandbox (stdout, stderr, endpoint, component.json, bundle); nothing was extracted"
                    ),
                });
            }
            entries.push(entry);
        }
        // Checked all first: a refused archive moves nothing into the sandbox.
        for entry in entries {
            let target = sandbox.join(entry.file_name());
            if std::fs::rename(entry.path(), &target).is_err() {
                // A directory left by an earlier launch: replace it. remove_dir_all does not
                // follow symlinks.
                match std::fs::symlink_metadata(&target) {
                    Ok(meta) if meta.is_dir() => {
                        std::fs::remove_dir_all(&target).map_err(io("replacing", &target))?;
                    }
                    _ => {}
                }
                rename(&entry.path(), &target, uri)?;
            }
        }
        durable::sync_dir(sandbox)
            .map(drop)
            .map_err(io_failure(uri))
    })();
    let _ = std::fs::remove_dir_all(&staging);
    let _ = std::fs::remove_file(&rewritten);
    let _ = std::fs::remove_file(&scratch);
    result
}

/// The [`FetchError::Io`] of `op` on `path`, for `map_err`.
fn io_error(
    uri: &str,
    op: &'static str,
    path: &Path,
) -> impl FnOnce(io::Error) -> FetchError + use<> {
    let (uri, path) = (uri.to_owned(), path.to_path_buf());
    move |source| FetchError::Io {
        uri,
        source: IoError::new(op, path, source),
    }
}

/// The [`FetchError::Io`] of a durable write's step, for `map_err`.
fn io_failure(uri: &str) -> impl FnOnce(IoError) -> FetchError + use<> {
    let uri = uri.to_owned();
    move |source| FetchError::Io { uri, source }
}

fn rename(from: &Path, to: &Path, uri: &str) -> Result<(), FetchError> {
    std::fs::rename(from, to).map_err(io_error(uri, "renaming into", to))
}

fn mkdir(dir: &Path, uri: &str) -> Result<(), FetchError> {
    std::fs::create_dir_all(dir).map_err(io_error(uri, "creating", dir))
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    #[test]
    fn schemes_and_names_follow_mesos() {
        assert!(check_uri("http://h/p/test-csi-plugin").is_ok());
        assert!(check_uri("https://h/a.tar.gz?x=1").is_ok());
        assert!(check_uri("file:///opt/plugin").is_ok());
        assert!(check_uri("/opt/plugin").is_ok());
        for bad in [
            "ftp://h/x",
            "hdfs://h/x",
            "relative/x",
            "file://relative",
            "",
            "http://h/",
        ] {
            assert!(check_uri(bad).is_err(), "{bad}");
        }
        assert_eq!(file_name("https://h/a/b.tgz?q#f").unwrap(), "b.tgz");
        for bad in [
            "a/b",
            "..",
            ".",
            ".hidden",
            "",
            "stdout",
            "stderr.1",
            "endpoint",
            "component.json",
        ] {
            assert!(check_output_file(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn executable_is_never_extracted_and_zip_is_extracted() {
        let uri = |executable, extract| UriConfig {
            value: "http://h/p.tar.gz".into(),
            executable,
            extract,
            cache: false,
            output_file: None,
        };
        assert_eq!(
            action(&uri(true, true), "p.tar.gz").unwrap(),
            Action::Executable
        );
        assert_eq!(
            action(&uri(false, true), "p.tar.gz").unwrap(),
            Action::ExtractTar
        );
        assert_eq!(
            action(&uri(false, false), "p.tar.gz").unwrap(),
            Action::Copy
        );
        assert_eq!(action(&uri(false, true), "p.bin").unwrap(), Action::Copy);
        assert_eq!(action(&uri(false, true), "p.gz").unwrap(), Action::Gunzip);
        assert_eq!(action(&uri(false, false), "p.gz").unwrap(), Action::Copy);
        assert_eq!(
            action(&uri(false, true), "p.zip").unwrap(),
            Action::ExtractZip
        );
        assert_eq!(action(&uri(false, false), "p.zip").unwrap(), Action::Copy);
    }

    /// A zip of `(name, unix mode, content)` entries; a symlink's content is its target.
    fn zip_of(entries: &[(&str, u32, &[u8])], method: ::zip::CompressionMethod) -> Vec<u8> {
        use std::io::Write as _;
        let mut writer = ::zip::ZipWriter::new(std::io::Cursor::new(Vec::new()));
        for (name, mode, content) in entries {
            let options = ::zip::write::SimpleFileOptions::default()
                .compression_method(method)
                .unix_permissions(*mode & 0o7777);
            if mode & 0o170_000 == 0o120_000 {
                writer
                    .add_symlink(*name, String::from_utf8_lossy(content), options)
                    .unwrap();
            } else if mode & 0o170_000 == 0o040_000 {
                writer.add_directory(*name, options).unwrap();
            } else {
                writer.start_file(*name, options).unwrap();
                writer.write_all(content).unwrap();
            }
        }
        writer.finish().unwrap().into_inner()
    }

    /// Every path beneath `dir`, relative, sorted (not following symlinks).
    fn tree(dir: &Path) -> Vec<String> {
        let mut out = Vec::new();
        let mut stack = vec![dir.to_path_buf()];
        while let Some(next) = stack.pop() {
            for entry in std::fs::read_dir(&next).unwrap() {
                let path = entry.unwrap().path();
                out.push(path.strip_prefix(dir).unwrap().display().to_string());
                if std::fs::symlink_metadata(&path).unwrap().is_dir() {
                    stack.push(path);
                }
            }
        }
        out.sort();
        out
    }

    #[test]
    fn a_zip_is_extracted_as_a_tar_and_hostile_ones_write_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let outside = dir.path().join("outside");
        std::fs::create_dir(&outside).unwrap();
        let sandbox = dir.path().join("work").join("sandbox");
        std::fs::create_dir_all(&sandbox).unwrap();
        let run = |name: &str, bytes: Vec<u8>, max: u64| {
            let source = dir.path().join(name);
            std::fs::write(&source, bytes).unwrap();
            install(
                &source,
                &format!("http://h/{name}"),
                &sandbox,
                name,
                &Action::ExtractZip,
                max,
            )
        };
        // A plugin in a dir, executable, deflated; a relative symlink inside the archive.
        let good = zip_of(
            &[
                ("bin/", 0o040_755, b""),
                ("bin/plugin", 0o100_755, b"#!/bin/sh\necho plugin\n"),
                ("plugin", 0o120_777, b"bin/plugin"),
            ],
            ::zip::CompressionMethod::Deflated,
        );
        run("good.zip", good, 1 << 20).unwrap();
        assert_eq!(tree(&sandbox), vec!["bin", "bin/plugin", "plugin"]);
        let meta = std::fs::metadata(sandbox.join("bin/plugin")).unwrap();
        assert_eq!(meta.permissions().mode() & 0o777, 0o755);
        assert_eq!(
            std::fs::read(sandbox.join("plugin")).unwrap(),
            b"#!/bin/sh\necho plugin\n"
        );

        let abs = format!("{}/abs", outside.display());
        let link_out = outside.display().to_string();
        let stored = ::zip::CompressionMethod::Stored;
        let hostile: Vec<(&str, Vec<u8>, &str)> = vec![
            (
                "dotdot.zip",
                zip_of(&[("../../x", 0o100_644, b"pwned")], stored),
                "'..'",
            ),
            (
                "abs.zip",
                zip_of(&[(abs.as_str(), 0o100_644, b"pwned")], stored),
                "absolute",
            ),
            (
                "link.zip",
                zip_of(
                    &[
                        ("out", 0o120_777, link_out.as_bytes()),
                        ("out/through", 0o100_644, b"pwned"),
                    ],
                    stored,
                ),
                "out/through",
            ),
            // 64 KiB of zeros deflate to well under the 1 KiB download cap, and expand past
            // the 4 KiB an archive may take.
            (
                "bomb.zip",
                zip_of(
                    &[("zeros", 0o100_644, &[0u8; 64 << 10])],
                    ::zip::CompressionMethod::Deflated,
                ),
                "zip bomb",
            ),
        ];
        for (name, bytes, expected) in hostile {
            assert!(bytes.len() < 1024, "{name}: {} bytes", bytes.len());
            let err = run(name, bytes, 1024).unwrap_err().to_string();
            assert!(err.contains(expected), "{name}: {err}");
            // Nothing outside, nothing new or temporary in the sandbox.
            assert_eq!(tree(&outside), Vec::<String>::new(), "{name}");
            assert!(!dir.path().join("x").exists() && !dir.path().join("work/x").exists());
            assert_eq!(
                tree(&sandbox),
                vec!["bin", "bin/plugin", "plugin"],
                "{name}"
            );
        }
    }

    #[test]
    fn a_bare_gz_is_gunzipped_and_a_bomb_stops_at_the_cap() {
        use std::io::Write as _;
        let dir = tempfile::tempdir().unwrap();
        let sandbox = dir.path().join("sandbox");
        std::fs::create_dir(&sandbox).unwrap();
        let gz = |data: &[u8]| {
            let mut encoder =
                flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
            encoder.write_all(data).unwrap();
            encoder.finish().unwrap()
        };
        let source = dir.path().join("tool.gz");
        std::fs::write(&source, gz(b"plain text")).unwrap();
        install(
            &source,
            "/x/tool.gz",
            &sandbox,
            "tool.gz",
            &Action::Gunzip,
            1024,
        )
        .unwrap();
        assert_eq!(std::fs::read(sandbox.join("tool")).unwrap(), b"plain text");
        // 1 MiB of zeros compresses to about 1 KiB: under the 1 KiB download cap, over the
        // 4 KiB the decompressed file may take.
        let bomb = dir.path().join("bomb.gz");
        std::fs::write(&bomb, gz(&vec![0; 1 << 20])).unwrap();
        let size = std::fs::metadata(&bomb).unwrap().len();
        let err = install(
            &bomb,
            "/x/bomb.gz",
            &sandbox,
            "bomb.gz",
            &Action::Gunzip,
            size,
        )
        .unwrap_err();
        assert!(matches!(err, FetchError::TooLarge { .. }), "{err}");
        assert!(!sandbox.join("bomb").exists());
        let names: Vec<_> = std::fs::read_dir(&sandbox)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(
            names,
            vec![std::ffi::OsString::from("tool")],
            "no temp file left"
        );
    }
}
