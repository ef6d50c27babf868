//! `csictl snapshot create|delete|list`: a plugin's snapshots, through the API
//! (`POST /v1/snapshots`, `DELETE /v1/snapshots/{plugin}/{snapshot_id}`,
//! `GET /v1/plugins/{type}/snapshots`).
//!
//! This module owns those subcommands' arguments, calls and tables. Like the rest of csictl it
//! talks to the daemon only through `csi_agent_api::ApiClient` and returns the text to print.

use std::fmt::Write as _;

use clap::Subcommand;
use csi_agent_api::{ApiClient, CreateSnapshotRequest, SnapshotInfo, SnapshotPage};

use crate::args::{OutputFormat, parse_pairs};
use crate::commands::render;
use crate::failure::Failure;
use crate::output::{Table, bytes_with_human, fields, shell_word};

#[derive(Debug, Subcommand)]
pub enum SnapshotCommand {
    /// Snapshot a volume (CreateSnapshot); idempotent by NAME. Restore it with
    /// `csictl create --from-snapshot SNAPSHOT_ID`.
    Create {
        /// The plugin's type, e.g. org.example.lvm.
        #[arg(value_name = "PLUGIN")]
        plugin: String,
        /// The volume to snapshot.
        #[arg(value_name = "SOURCE_VOLUME_ID")]
        source_volume_id: String,
        /// The snapshot's name: the idempotency key of the creation.
        #[arg(value_name = "NAME")]
        name: String,
        /// A CreateSnapshot parameter; repeat for several.
        #[arg(long = "param", value_name = "KEY=VALUE")]
        params: Vec<String>,
    },
    /// Delete a snapshot (DeleteSnapshot); deleting an unknown one succeeds.
    Delete {
        #[arg(value_name = "PLUGIN")]
        plugin: String,
        #[arg(value_name = "SNAPSHOT_ID")]
        snapshot_id: String,
    },
    /// List one page of the plugin's snapshots (ListSnapshots).
    List {
        #[arg(value_name = "PLUGIN")]
        plugin: String,
        /// Only the snapshots of this volume.
        #[arg(long, value_name = "VOLUME_ID")]
        source_volume: Option<String>,
        /// Only this snapshot.
        #[arg(long, value_name = "SNAPSHOT_ID")]
        snapshot: Option<String>,
        /// At most this many entries (default: the plugin's choice).
        #[arg(long, value_name = "N")]
        max_entries: Option<u32>,
        /// The next_token of the previous page.
        #[arg(long, value_name = "TOKEN")]
        starting_token: Option<String>,
    },
}

/// `csictl snapshot …`
pub async fn run(
    client: &ApiClient,
    format: OutputFormat,
    command: SnapshotCommand,
) -> Result<String, Failure> {
    match command {
        SnapshotCommand::Create {
            plugin,
            source_volume_id,
            name,
            params,
        } => {
            let request = CreateSnapshotRequest {
                plugin,
                source_volume_id,
                name,
                parameters: parse_pairs("--param", &params)?,
            };
            render(format, &client.create_snapshot(&request).await?, created)
        }
        SnapshotCommand::Delete {
            plugin,
            snapshot_id,
        } => render(
            format,
            &client.delete_snapshot(&plugin, &snapshot_id).await?,
            |_| format!("deleted snapshot {snapshot_id}\n"),
        ),
        SnapshotCommand::List {
            plugin,
            source_volume,
            snapshot,
            max_entries,
            starting_token,
        } => {
            let page = client
                .snapshots(
                    &plugin,
                    max_entries,
                    starting_token.as_deref(),
                    source_volume.as_deref(),
                    snapshot.as_deref(),
                )
                .await?;
            render(format, &page, |page| listed(&plugin, page))
        }
    }
}

fn created(s: &SnapshotInfo) -> String {
    fields(&[
        ("snapshot", s.snapshot_id.clone()),
        ("source volume", s.source_volume_id.clone()),
        ("size", bytes_with_human(s.size_bytes)),
        (
            "created",
            s.creation_time.clone().unwrap_or_else(|| "-".to_owned()),
        ),
        (
            "ready to use",
            if s.ready_to_use {
                "yes".to_owned()
            } else {
                "no (the plugin still processes it: repeat the command)".to_owned()
            },
        ),
    ])
}

fn listed(plugin: &str, page: &SnapshotPage) -> String {
    let mut out = if page.snapshots.is_empty() {
        "no snapshots\n".to_owned()
    } else {
        let mut table = Table::new(&["SNAPSHOT", "SOURCE VOLUME", "SIZE", "CREATED", "READY"]);
        for s in &page.snapshots {
            table.row(vec![
                s.snapshot_id.clone(),
                s.source_volume_id.clone(),
                csi_agent_api::size::human(s.size_bytes),
                s.creation_time.clone().unwrap_or_else(|| "-".to_owned()),
                if s.ready_to_use { "yes" } else { "no" }.to_owned(),
            ]);
        }
        table.render()
    };
    if !page.next_token.is_empty() {
        let _ = writeln!(
            out,
            "\nmore: csictl snapshot list {} --starting-token {}",
            shell_word(plugin),
            shell_word(&page.next_token)
        );
    }
    out
}
