//! One page of `GET /v1/volumes`, written as `csi_agent_api::VolumeList` one volume at a
//! time into a streamed body. The page holds only shared references to the read snapshots'
//! records; each `VolumeInfo` is made while its JSON is written and dropped right after, and
//! the JSON goes out in chunks of [`CHUNK_BYTES`]. Building every `VolumeInfo` first cost about
//! 1 KiB per volume at the peak, and even serialized one at a time into one buffer, an unpaged
//! list of 100,000 volumes (a 50 MB body, its buffer doubled as it grew) lifted the daemon's
//! peak resident memory to 139.5 MiB, over issue #10's bound of 128 (docs/benchmarks.md).
//!
//! Must not: filter or page (the handler in `api.rs` decides what the page holds), or wait
//! for anything.

use std::path::PathBuf;
use std::sync::Arc;

use axum::body::{Body, Bytes};
use axum::http::header;
use axum::response::{IntoResponse, Response};
use csi_agent::server::Plugin;
use csi_agent::volume::VolumeRecord;

use crate::convert::{self, ApiFailure};

/// The volumes of one plugin on the page, in list order.
pub struct PluginPart {
    pub plugin_type: String,
    pub plugin: Arc<Plugin>,
    pub records: Vec<Arc<VolumeRecord>>,
}

/// A page of the volume list, serialized exactly as `csi_agent_api::VolumeList`.
pub struct VolumePage {
    pub parts: Vec<PluginPart>,
    pub next_page_token: Option<String>,
    pub recovering: bool,
    pub work_dir: PathBuf,
}

impl VolumePage {
    /// The plugin and volume id of the page's last volume.
    pub fn last(&self) -> Option<(&str, &str)> {
        let part = self.parts.iter().rev().find(|p| !p.records.is_empty())?;
        let record = part.records.last()?;
        Some((part.plugin_type.as_str(), record.volume_id.as_str()))
    }
}

/// A chunk of the body is sent once it holds this many bytes.
const CHUNK_BYTES: usize = 64 * 1024;

/// Where [`Chunks`] is in the page.
enum Position {
    Start,
    /// The next volume to write: part and record index.
    At(usize, usize),
    Done,
}

/// The page's JSON, in chunks. Field names, order and skip rules follow
/// `csi_agent_api::VolumeList`; the API tests read every answer back as that type, and
/// openapi.rs checks it against the schema.
struct Chunks {
    page: VolumePage,
    position: Position,
    /// A volume has been written (the next one needs a comma first).
    wrote_volume: bool,
}

impl Chunks {
    /// The next chunk; `None` after the last.
    fn next_chunk(&mut self) -> Option<Result<Vec<u8>, serde_json::Error>> {
        let mut out = Vec::with_capacity(CHUNK_BYTES + 2048);
        loop {
            match self.position {
                Position::Done => {
                    return (!out.is_empty()).then_some(Ok(out));
                }
                Position::Start => {
                    out.extend_from_slice(b"{\"volumes\":[");
                    self.position = Position::At(0, 0);
                }
                Position::At(part_index, record_index) => {
                    let Some(part) = self.page.parts.get(part_index) else {
                        out.push(b']');
                        if let Some(token) = &self.page.next_page_token {
                            out.extend_from_slice(b",\"next_page_token\":");
                            if let Err(err) = serde_json::to_writer(&mut out, token) {
                                return Some(Err(err));
                            }
                        }
                        out.extend_from_slice(if self.page.recovering {
                            b",\"recovering\":true}"
                        } else {
                            b",\"recovering\":false}"
                        });
                        self.position = Position::Done;
                        continue;
                    };
                    let Some(record) = part.records.get(record_index) else {
                        self.position = Position::At(part_index + 1, 0);
                        continue;
                    };
                    if self.wrote_volume {
                        out.push(b',');
                    }
                    self.wrote_volume = true;
                    let target = part.plugin.volumes.target_path(&record.volume_id);
                    let mut info = convert::volume_info(
                        &part.plugin_type,
                        record,
                        part.plugin.volumes.progress(&record.volume_id),
                        &target,
                        &self.page.work_dir,
                    );
                    info.condition = crate::api::stats::volume_condition(
                        &part.plugin.volumes,
                        &record.volume_id,
                    );
                    if let Err(err) = serde_json::to_writer(&mut out, &info) {
                        return Some(Err(err));
                    }
                    self.position = Position::At(part_index, record_index + 1);
                    if out.len() >= CHUNK_BYTES {
                        return Some(Ok(out));
                    }
                }
            }
        }
    }
}

impl IntoResponse for VolumePage {
    /// A page that fits in one chunk is sent whole, with its length; a longer one is streamed
    /// (chunked transfer encoding).
    fn into_response(self) -> Response {
        let mut chunks = Chunks {
            page: self,
            position: Position::Start,
            wrote_volume: false,
        };
        let body = match chunks.next_chunk() {
            Some(Ok(first)) if matches!(chunks.position, Position::Done) => Body::from(first),
            Some(Ok(first)) => {
                let rest = std::iter::from_fn(move || chunks.next_chunk());
                Body::from_stream(futures::stream::iter(
                    std::iter::once(Ok(first))
                        .chain(rest)
                        .map(|chunk| chunk.map(Bytes::from).map_err(std::io::Error::other)),
                ))
            }
            Some(Err(err)) => {
                return ApiFailure::new(
                    csi_agent_api::ErrorCode::Internal,
                    format!("cannot write the volume list: {err}"),
                )
                .into_response();
            }
            None => Body::empty(),
        };
        ([(header::CONTENT_TYPE, "application/json")], body).into_response()
    }
}
