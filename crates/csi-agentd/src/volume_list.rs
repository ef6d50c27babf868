//! One page of `GET /v1/volumes`, written as `csi_agent_api::VolumeList` one volume at a
//! time. The page holds only shared references to the read snapshots' records; each
//! `VolumeInfo` is made while the JSON is written and dropped right after. Building every
//! `VolumeInfo` first cost about 1 KiB per volume at the peak (100 MiB for an unpaged list
//! of 100,000 volumes, issue #10's memory bound), and glibc kept most of it afterwards.
//!
//! Must not: filter or page (the handler in `api.rs` decides what the page holds), or wait
//! for anything.

use std::path::PathBuf;
use std::sync::Arc;

use csi_agent::server::Plugin;
use csi_agent::volume::VolumeRecord;
use serde::ser::{Serialize, SerializeStruct, Serializer};

use crate::convert;

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

/// The `volumes` array, made one `VolumeInfo` at a time.
struct Volumes<'a>(&'a VolumePage);

impl Serialize for Volumes<'_> {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let page = self.0;
        serializer.collect_seq(page.parts.iter().flat_map(|part| {
            part.records.iter().map(move |record| {
                let target = part.plugin.volumes.target_path(&record.volume_id);
                convert::volume_info(
                    &part.plugin_type,
                    record,
                    part.plugin.volumes.progress(&record.volume_id),
                    &target,
                    &page.work_dir,
                )
            })
        }))
    }
}

impl Serialize for VolumePage {
    // Field names, order and skip rules follow `csi_agent_api::VolumeList`; the API tests
    // read every answer back as that type, and openapi.rs checks it against the schema.
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let mut list = serializer.serialize_struct("VolumeList", 3)?;
        list.serialize_field("volumes", &Volumes(self))?;
        match &self.next_page_token {
            Some(token) => list.serialize_field("next_page_token", token)?,
            None => list.skip_field("next_page_token")?,
        }
        list.serialize_field("recovering", &self.recovering)?;
        list.end()
    }
}
