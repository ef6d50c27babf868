//! Volume expansion (CSI `ControllerExpandVolume`, `NodeExpandVolume` and the plugin
//! capability `VolumeExpansion`), switched on by `--expansion online|offline`,
//! `--controller-expand` and `--node-expand` (all off by default).
//!
//! Owns: the validation order and error codes of the two RPCs, the growth of a volume's
//! recorded capacity (never a shrink), and the growth of its file system: by the controller
//! when no node step follows (`--node-expand` off), else by `NodeExpandVolume`; both through
//! [`backing::resize`], so that a `--volume-fs tmpfs` volume really has more room afterwards.
//!
//! Must not: know protobuf types (the adapters convert), or grow anything before the new
//! capacity is recorded: the record comes first (intent first, as everywhere in this
//! plugin), and the resize that follows is idempotent, so a repeated call after a crash
//! between the two finishes the job. Block volumes are not expanded here (yet).
//!
//! A child module of `plugin.rs` (declared there with `#[path]`) so that it reaches the
//! plugin's store and configuration without widening their visibility.

use std::path::Path;

use tonic::Status;

use super::{Plugin, check_absolute, internal, invalid, precondition};
use crate::backing;

/// Controller capability `EXPAND_VOLUME` (v1 only; CSI 0.x has no expansion).
pub const CAP_EXPAND_VOLUME: i32 = 9;
/// Node capability `EXPAND_VOLUME` (v1 only).
pub const NODE_CAP_EXPAND_VOLUME: i32 = 3;

/// `VolumeExpansion.Type`, as `--expansion` gives it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Expansion {
    /// `ONLINE = 1`: volumes grow while published.
    Online,
    /// `OFFLINE = 2`: volumes grow only while not published anywhere.
    Offline,
}

impl Expansion {
    pub fn number(self) -> i32 {
        match self {
            Expansion::Online => 1,
            Expansion::Offline => 2,
        }
    }
}

/// A CSI `CapacityRange` (`None`: the field was not set).
pub type Range = Option<(i64, i64)>;

/// The capacity a range asks a volume of `current` bytes to reach: never less than
/// `current`. "If a volume corresponding to the specified volume ID is already larger than
/// or equal to the target capacity of the expansion request, the plugin SHOULD reply 0 OK"
/// (ControllerExpandVolume), with the volume's current capacity.
fn target_capacity(current: i64, required: i64, limit: i64) -> Result<i64, Status> {
    // CapacityRange: "The value of this field MUST NOT be negative."
    if required < 0 || limit < 0 {
        return Err(invalid("capacity_range values must not be negative"));
    }
    if limit > 0 && required > limit {
        return Err(Status::out_of_range(format!(
            "capacity_range: required_bytes {required} exceeds limit_bytes {limit}"
        )));
    }
    let target = current.max(required);
    if limit > 0 && target > limit {
        // "Unsupported capacity | 11 OUT_OF_RANGE": growing cannot make it smaller.
        return Err(Status::out_of_range(format!(
            "the volume already has {current} bytes, more than limit_bytes {limit}; volumes never shrink"
        )));
    }
    Ok(target)
}

impl Plugin {
    /// The `VolumeExpansion` plugin capability advertised, if any (v1 only).
    pub fn expansion_type(&self) -> Option<i32> {
        self.cfg.expansion.map(Expansion::number)
    }

    /// Records `target` as the capacity of volume `id`, checking it against the pool (a
    /// volume larger than the pool, or than what is free with it, is OUT_OF_RANGE: "Indicates
    /// that the capacity range is not allowed by the Plugin"). With `offline`, refused while
    /// anything uses the volume. Returns the capacity recorded.
    async fn grow_record(&self, id: &str, target: i64, offline: bool) -> Result<i64, Status> {
        let total = self.cfg.capacity;
        self.store
            .update(|s| {
                let used: i64 = s.volumes.values().map(|v| v.capacity_bytes).sum();
                let v = s.volumes.get_mut(id).ok_or_else(|| Self::not_found(id))?;
                // ControllerExpandVolume: "Volume in use | 9 FAILED_PRECONDITION | Indicates
                // that the volume corresponding to the specified volume_id could not be
                // expanded because it is currently published on a node but the plugin does
                // not have ONLINE expansion capability."
                if offline && let Some(why) = v.in_use() {
                    return Err(precondition(format!(
                        "volume {id:?} cannot be expanded while in use (the plugin's expansion is OFFLINE): {why}"
                    )));
                }
                if target <= v.capacity_bytes {
                    return Ok((v.capacity_bytes, false));
                }
                if target > total {
                    return Err(Status::out_of_range(format!(
                        "{target} bytes exceeds the plugin's total capacity of {total} bytes"
                    )));
                }
                let after = used - v.capacity_bytes + target;
                if after > total {
                    return Err(Status::out_of_range(format!(
                        "not enough free capacity to grow volume {id:?} to {target} bytes: {} of {total} bytes free",
                        total - used
                    )));
                }
                // The size other nodes' instances see (`--backend-dir`).
                if let Some(b) = self.backend() {
                    b.with_lock(|shared| {
                        let entry = shared.catalogue.get_mut(id).ok_or_else(|| Self::not_found(id))?;
                        entry.capacity_bytes = target;
                        Ok(((), true))
                    })?;
                }
                v.capacity_bytes = target;
                Ok((target, true))
            })
            .await
    }

    /// Grows the volume's file system to `capacity` (a tmpfs remount; nothing for a plain
    /// directory). Idempotent.
    fn resize_backing(&self, id: &str, capacity: i64) -> Result<(), Status> {
        let dir = self.volume_dir(id);
        backing::resize(&dir, self.cfg.volume_fs, capacity)
            .map_err(|e| internal(&format!("growing the file system of {}", dir.display()), e))
    }

    /// ControllerExpandVolume: `(capacity_bytes, node_expansion_required)`.
    pub async fn controller_expand(&self, id: &str, range: Range) -> Result<(i64, bool), Status> {
        if !self.cfg.controller_expand {
            return Err(Status::unimplemented(
                "ControllerExpandVolume: EXPAND_VOLUME is not enabled (--controller-expand)",
            ));
        }
        // "volume_id: The ID of the volume to expand. This field is REQUIRED."
        if id.is_empty() {
            return Err(invalid("volume_id is required"));
        }
        // "capacity_range: This allows CO to specify the capacity requirements of the volume
        // after expansion. This field is REQUIRED."
        let Some((required, limit)) = range else {
            return Err(invalid("capacity_range is required"));
        };
        // "Volume does not exist | 5 NOT_FOUND".
        let current = self
            .record(id)
            .ok_or_else(|| Self::not_found(id))?
            .capacity_bytes;
        let target = target_capacity(current, required, limit)?;
        let offline = self.cfg.expansion == Some(Expansion::Offline);
        let capacity = self.grow_record(id, target, offline).await?;
        // "node_expansion_required: Whether node expansion is required for the volume. When
        // true the CO MUST make NodeExpandVolume RPC call on the node."
        let node_step = self.cfg.node_expand;
        if !node_step {
            self.resize_backing(id, capacity)?;
        }
        Ok((capacity, node_step))
    }

    /// NodeExpandVolume: the volume's capacity after growing its file system.
    pub async fn node_expand(
        &self,
        id: &str,
        volume_path: &str,
        staging_path: &str,
        range: Range,
    ) -> Result<i64, Status> {
        if !self.cfg.node_expand {
            return Err(Status::unimplemented(
                "NodeExpandVolume: EXPAND_VOLUME is not enabled (--node-expand)",
            ));
        }
        // "volume_id: The ID of the volume. This field is REQUIRED."
        if id.is_empty() {
            return Err(invalid("volume_id is required"));
        }
        // "volume_path: The path on which volume is available. This field is REQUIRED."
        if volume_path.is_empty() {
            return Err(invalid("volume_path is required"));
        }
        check_absolute(volume_path, "volume_path")?;
        if !staging_path.is_empty() {
            check_absolute(staging_path, "staging_target_path")?;
        }
        // "Volume not found | 5 NOT_FOUND | Indicates that a volume corresponding to the
        // specified volume_id could not be found."
        let rec = self.record(id).ok_or_else(|| Self::not_found(id))?;
        let available = rec.published.contains_key(volume_path)
            || rec.staged.as_ref().is_some_and(|st| st.path == volume_path);
        if !available {
            return Err(Status::not_found(format!(
                "volume {id:?} is neither staged nor published at volume_path {volume_path:?}"
            )));
        }
        let (required, limit) = range.unwrap_or((0, 0));
        let target = target_capacity(rec.capacity_bytes, required, limit)?;
        let capacity = if self.cfg.controller_expand {
            // The controller grows the volume; the node only its file system.
            if target > rec.capacity_bytes {
                return Err(Status::out_of_range(format!(
                    "volume {id:?} has {} bytes; ControllerExpandVolume must grow it to {target} first",
                    rec.capacity_bytes
                )));
            }
            rec.capacity_bytes
        } else {
            // A node-only plugin: the volume is local storage, grown right here.
            self.grow_record(id, target, false).await?
        };
        if self.bind_mode() && !super::is_mount_point(Path::new(volume_path))? {
            return Err(precondition(format!(
                "volume {id:?} is recorded at {volume_path:?} but nothing is mounted there"
            )));
        }
        self.resize_backing(id, capacity)?;
        Ok(capacity)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn targets_never_shrink_and_honour_the_limit() {
        assert_eq!(target_capacity(10, 20, 0).ok(), Some(20));
        assert_eq!(target_capacity(30, 20, 0).ok(), Some(30));
        assert_eq!(target_capacity(10, 0, 0).ok(), Some(10));
        assert_eq!(
            target_capacity(30, 20, 25).map_err(|s| s.code()).err(),
            Some(tonic::Code::OutOfRange)
        );
        assert_eq!(
            target_capacity(10, 20, 15).map_err(|s| s.code()).err(),
            Some(tonic::Code::OutOfRange)
        );
        assert_eq!(
            target_capacity(10, -1, 0).map_err(|s| s.code()).err(),
            Some(tonic::Code::InvalidArgument)
        );
    }
}
