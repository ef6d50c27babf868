//! `csictl images`, `csictl image pull REF` and `csictl image prune`: the daemon's plugin image
//! store, through the API (`GET /v1/images`, `POST /v1/images/pull`, `POST /v1/images/prune`).
//!
//! This module owns those subcommands' arguments, calls and tables. Like the rest of csictl it
//! talks to the daemon only through `csi_agent_api::ApiClient` and returns the text to print;
//! it must not read the store's files itself (the daemon owns them).

use clap::Subcommand;
use csi_agent_api::{ApiClient, ImageList, ImagePruneResponse, ImagePullResponse};

use crate::args::OutputFormat;
use crate::commands::render;
use crate::failure::Failure;
use crate::output::{Table, cell, fields};

#[derive(Debug, Subcommand)]
pub enum ImageCommand {
    /// Pull an image into the daemon's store and prepare it (the tag is looked up again;
    /// blobs already there are not downloaded).
    Pull {
        /// As a plugin config names it: `busybox`, `org/app:1`, `host:5000/org/app@sha256:…`.
        #[arg(value_name = "REF")]
        reference: String,
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
            render(format, &client.pull_image(&reference).await?, pulled)
        }
        ImageCommand::Prune => render(format, &client.prune_images().await?, pruned),
    }
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
    table.render()
}

fn pruned(answer: &ImagePruneResponse) -> String {
    fields(&[
        ("removed", answer.removed.join(", ")),
        (
            "root file systems removed",
            answer.rootfs_removed.to_string(),
        ),
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
    }
}
