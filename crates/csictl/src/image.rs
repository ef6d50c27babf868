//! `csictl images`, `csictl image pull REF`, `csictl image import FILE` and `csictl image
//! prune`: the daemon's plugin image store, through the API (`GET /v1/images`,
//! `POST /v1/images/pull`, `POST /v1/images/import`, `POST /v1/images/prune`).
//!
//! This module owns those subcommands' arguments, calls and tables. Like the rest of csictl it
//! talks to the daemon only through `csi_agent_api::ApiClient` and returns the text to print;
//! it must not read the store's files itself (the daemon owns them).

use std::path::{Path, PathBuf};

use clap::Subcommand;
use csi_agent_api::{
    ApiClient, ImageImportResponse, ImageList, ImagePruneResponse, ImagePullProgress,
    ImagePullResponse,
};

use crate::args::OutputFormat;
use crate::commands::render;
use crate::failure::Failure;
use crate::output::{Table, bytes_with_human, cell, fields};

#[derive(Debug, Subcommand)]
pub enum ImageCommand {
    /// Pull an image into the daemon's store and prepare it (the tag is looked up again;
    /// blobs already there are not downloaded).
    Pull {
        /// As a plugin config names it: `busybox`, `org/app:1`, `host:5000/org/app@sha256:…`.
        #[arg(value_name = "REF")]
        reference: String,
    },
    /// Import the images of an archive into the daemon's store, for nodes without a registry:
    /// a tar of an OCI image layout (`skopeo copy … oci-archive:FILE:REF`), a `docker save`
    /// archive (`skopeo copy … docker-archive:FILE:REF`), or an OCI layout directory (sent as
    /// a tar made on the fly). Each image is imported under its name in the archive.
    Import {
        /// The archive (or OCI layout directory).
        #[arg(value_name = "FILE")]
        file: PathBuf,
        /// Import the archive's one image under this reference instead.
        #[arg(long, value_name = "REF")]
        name: Option<String>,
    },
    /// Remove the images no configured plugin names (and their root file systems and blobs).
    Prune,
}

/// `csictl images`
pub async fn images(client: &ApiClient, format: OutputFormat) -> Result<String, Failure> {
    render(format, &client.images().await?, images_table)
}

/// `csictl image …`
pub async fn run(
    client: &ApiClient,
    format: OutputFormat,
    command: ImageCommand,
) -> Result<String, Failure> {
    match command {
        ImageCommand::Pull { reference } => {
            let answer = pull_with_progress(client, format, &reference).await?;
            render(format, &answer, pulled)
        }
        ImageCommand::Import { file, name } => {
            let answer = import(client, &file, name.as_deref()).await?;
            render(format, &answer, imported)
        }
        ImageCommand::Prune => render(format, &client.prune_images().await?, pruned),
    }
}

/// How often the progress bar asks the daemon how far the pull has come.
const PROGRESS_EVERY: std::time::Duration = std::time::Duration::from_millis(250);

/// `POST /v1/images/pull`, with a progress line on stderr while it runs (text output to a
/// terminal only: a script reading stderr gets no carriage returns).
async fn pull_with_progress(
    client: &ApiClient,
    format: OutputFormat,
    reference: &str,
) -> Result<ImagePullResponse, Failure> {
    use std::io::{IsTerminal, Write};
    let draw = matches!(format, OutputFormat::Table) && std::io::stderr().is_terminal();
    let pull = client.pull_image(reference);
    if !draw {
        return Ok(pull.await?);
    }
    tokio::pin!(pull);
    let mut ticker = tokio::time::interval(PROGRESS_EVERY);
    let mut drawn = false;
    let answer = loop {
        tokio::select! {
            answer = &mut pull => break answer,
            _ = ticker.tick() => {
                // A failed progress read only means no bar this tick.
                if let Ok(pulls) = client.image_pulls().await
                    && let Some(progress) = this_pull(&pulls.pulls, reference)
                {
                    let mut err = std::io::stderr().lock();
                    let _ = write!(err, "\r\x1b[2K{}", crate::output::pull_progress(progress));
                    let _ = err.flush();
                    drawn = true;
                }
            }
        }
    };
    if drawn {
        let _ = write!(std::io::stderr().lock(), "\r\x1b[2K");
    }
    Ok(answer?)
}

/// The pull in flight that is this command's: the daemon lists references resolved against
/// its default registry (`busybox` is `docker.io/library/busybox:latest`), so the one that
/// ends with the name given (and its default tag) is it; failing that, the only one.
fn this_pull<'a>(pulls: &'a [ImagePullProgress], reference: &str) -> Option<&'a ImagePullProgress> {
    let tagged = format!("{reference}:latest");
    let ends = |pull: &&ImagePullProgress| {
        [reference, tagged.as_str()]
            .iter()
            .any(|name| pull.reference == *name || pull.reference.ends_with(&format!("/{name}")))
    };
    pulls
        .iter()
        .find(ends)
        .or_else(|| (pulls.len() == 1).then(|| &pulls[0]))
}

/// Streams `file` (or the tar of the OCI layout directory `file`) to the daemon.
async fn import(
    client: &ApiClient,
    file: &Path,
    name: Option<&str>,
) -> Result<ImageImportResponse, Failure> {
    let usage = |message: String| Failure::Usage(message);
    let meta = std::fs::metadata(file)
        .map_err(|err| usage(format!("cannot read {}: {err}", file.display())))?;
    if meta.is_dir() {
        if !file.join("oci-layout").is_file() {
            return Err(usage(format!(
                "{} is a directory but not an OCI image layout (no oci-layout file)",
                file.display()
            )));
        }
        let (reader, writer) = std::io::pipe()
            .map_err(|err| usage(format!("cannot make a pipe for the tar stream: {err}")))?;
        let dir = file.to_path_buf();
        // Packed as the body is sent; the pipe bounds what is held in memory. A failure
        // closes the pipe early, which fails the upload (the daemon indexes nothing).
        std::thread::spawn(move || {
            let mut builder = tar::Builder::new(writer);
            // Symlinks are sent as symlinks (the daemon refuses them), never followed.
            builder.follow_symlinks(false);
            let packed = builder
                .append_dir_all(".", &dir)
                .and_then(|()| builder.finish());
            if let Err(err) = packed {
                eprintln!("csictl: packing {}: {err}", dir.display());
            }
        });
        Ok(client.import_image(reader, None, name).await?)
    } else {
        let archive = std::fs::File::open(file)
            .map_err(|err| usage(format!("cannot open {}: {err}", file.display())))?;
        Ok(client.import_image(archive, Some(meta.len()), name).await?)
    }
}

fn imported(answer: &ImageImportResponse) -> String {
    let mut table = Table::new(&["REFERENCE", "MANIFEST", "SIZE", "LAYERS"]);
    for image in &answer.images {
        table.row(vec![
            cell(&image.reference),
            cell(short(&image.manifest)),
            image.size.to_string(),
            image.layers.len().to_string(),
        ]);
    }
    table.render()
}

fn images_table(list: &ImageList) -> String {
    let mut table = Table::new(&["REFERENCE", "MANIFEST", "SIZE", "LAYERS", "USED BY"]);
    for image in &list.images {
        table.row(vec![
            cell(&image.reference),
            cell(short(&image.manifest)),
            image.size.to_string(),
            image.layers.len().to_string(),
            cell(&image.used_by.join(",")),
        ]);
    }
    format!(
        "{}{}\nblobs: {} bytes (images as downloaded)\n",
        table.render(),
        store_line(list.store_bytes, list.store_max_bytes),
        list.blob_bytes
    )
}

/// `store: 8192 (8Ki) on disk of a 34359738368 (32Gi) quota (0.1 %)`: the store's size on
/// disk against `--image-store-max-bytes`, the measure the daemon refuses images by.
fn store_line(store_bytes: u64, max_bytes: u64) -> String {
    let human = |n: u64| bytes_with_human(i64::try_from(n).unwrap_or(i64::MAX));
    if max_bytes == 0 {
        // A daemon older than the fields.
        return format!(
            "store: {} on disk (this daemon does not report its quota)",
            human(store_bytes)
        );
    }
    // One decimal, computed in integers (per mille, rounded down): 100.0 % only when full.
    let per_mille = u128::from(store_bytes) * 1000 / u128::from(max_bytes);
    format!(
        "store: {} on disk of a {} quota ({}.{} %)",
        human(store_bytes),
        human(max_bytes),
        per_mille / 10,
        per_mille % 10
    )
}

fn pruned(answer: &ImagePruneResponse) -> String {
    fields(&[
        ("removed", answer.removed.join(", ")),
        (
            "root file systems removed",
            answer.rootfs_removed.to_string(),
        ),
        ("layers removed", answer.layers_removed.to_string()),
        ("blobs removed", answer.blobs_removed.to_string()),
    ])
}

fn pulled(answer: &ImagePullResponse) -> String {
    fields(&[
        ("reference", answer.reference.clone()),
        ("manifest", answer.manifest.clone()),
        ("size", answer.size.to_string()),
        ("downloaded", format!("{} blob(s)", answer.downloaded.len())),
    ])
}

/// `sha256:` and the first 12 hex digits, as `docker images` shows an id.
fn short(digest: &str) -> &str {
    digest.get(..19).unwrap_or(digest)
}

#[cfg(test)]
mod tests {
    use super::*;
    use csi_agent_api::ImageInfo;

    #[test]
    fn the_images_table_names_each_image_and_its_users() {
        let list = ImageList {
            images: vec![ImageInfo {
                reference: "127.0.0.1:5000/csi/plugin:v1".to_owned(),
                manifest: format!("sha256:{}", "ab".repeat(32)),
                config: String::new(),
                layers: vec![String::new(), String::new()],
                size: 1234,
                pulled_at_unix: 1,
                used_by: vec!["org.example.a".to_owned(), "org.example.b".to_owned()],
            }],
            blob_bytes: 98765,
            store_bytes: 3 << 20,
            store_max_bytes: 32 << 30,
        };
        let text = images_table(&list);
        let row = text.lines().nth(1).unwrap_or_default();
        for part in [
            "127.0.0.1:5000/csi/plugin:v1",
            "sha256:abababababab",
            "1234",
            "org.example.a,org.example.b",
        ] {
            assert!(row.contains(part), "{part:?} missing in {text}");
        }
        assert!(
            !row.contains(&"ab".repeat(20)),
            "the digest is not shortened"
        );
        assert!(
            text.lines().last().unwrap_or_default().contains("98765"),
            "the blobs' size: {text}"
        );
        assert!(
            text.contains("store: 3145728 (3Mi) on disk of a 34359738368 (32Gi) quota (0.0 %)"),
            "the store's size against its quota: {text}"
        );
    }

    #[test]
    fn the_store_line_shows_the_share_of_the_quota_and_a_full_store() {
        assert_eq!(
            store_line(1 << 30, 4 << 30),
            "store: 1073741824 (1Gi) on disk of a 4294967296 (4Gi) quota (25.0 %)"
        );
        // Over the quota (images already prepared before it was lowered): shown as it is.
        assert!(store_line(5000, 4000).ends_with("quota (125.0 %)"));
        // u64::MAX bytes must not overflow the share.
        assert!(store_line(u64::MAX, u64::MAX).ends_with("(100.0 %)"));
        assert_eq!(
            store_line(512, 0),
            "store: 512 on disk (this daemon does not report its quota)"
        );
    }

    fn pull(reference: &str) -> ImagePullProgress {
        ImagePullProgress {
            reference: reference.to_owned(),
            started_at_unix_ms: 0,
            bytes_done: 0,
            bytes_total: 0,
            blobs: vec![],
        }
    }

    #[test]
    fn the_bar_follows_the_pull_of_the_name_given() {
        let pulls = [
            pull("docker.io/library/busybox:latest"),
            pull("r.example:5000/csi/lvm:1"),
        ];
        let found = |name| this_pull(&pulls, name).map(|p| p.reference.as_str());
        assert_eq!(found("csi/lvm:1"), Some("r.example:5000/csi/lvm:1"));
        assert_eq!(found("busybox"), Some("docker.io/library/busybox:latest"));
        assert_eq!(
            found("r.example:5000/csi/lvm:1"),
            Some("r.example:5000/csi/lvm:1")
        );
        // Not a suffix on a component boundary, and two pulls in flight: no bar.
        assert_eq!(found("vm:1"), None);
        // The only pull in flight is shown whatever its name (the daemon's resolution may
        // differ from the name's text, e.g. a digest).
        assert_eq!(
            this_pull(&pulls[1..], "other").map(|p| p.reference.as_str()),
            Some("r.example:5000/csi/lvm:1")
        );
    }
}
