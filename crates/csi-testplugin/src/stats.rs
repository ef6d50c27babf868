//! NodeGetVolumeStats (`--volume-stats`, node capability GET_VOLUME_STATS)
//! and the volume condition in its answer (`--volume-condition`, node
//! capability VOLUME_CONDITION).
//!
//! Owns: validating the request, deciding whether the volume is staged or
//! published at `volume_path`, measuring the volume's backing directory with
//! `statvfs`, and attaching the condition the fault file injects.
//!
//! Must not: measure the path the CO gave (that is the CO's directory, and in
//! `--mount-mode none` not the volume at all) — it measures the volume's own
//! backing, which with `--volume-fs tmpfs` is the volume's own file system
//! and with `dir` the file system holding the work dir (the host's); nor
//! change any state: the RPC is a read.

use std::path::Path;

use tonic::Status;

use crate::plugin::Plugin;

/// One `VolumeUsage` entry, version-neutral (CSI v1 only has this RPC).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Usage {
    pub total: i64,
    pub used: i64,
    pub available: i64,
}

/// What NodeGetVolumeStats answers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VolumeStats {
    pub bytes: Usage,
    pub inodes: Usage,
    /// `Some((abnormal, message))` only when `--volume-condition` is on.
    pub condition: Option<(bool, String)>,
}

fn to_i64(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

/// `statvfs` of `dir`, in the shape the kubelet reports (`used` is what is
/// allocated, `available` what an unprivileged writer may still use).
fn measure(dir: &Path) -> std::io::Result<(Usage, Usage)> {
    let s = rustix::fs::statvfs(dir)?;
    let frsize = if s.f_frsize > 0 {
        s.f_frsize
    } else {
        s.f_bsize
    };
    let bytes = Usage {
        total: to_i64(s.f_blocks.saturating_mul(frsize)),
        used: to_i64(s.f_blocks.saturating_sub(s.f_bfree).saturating_mul(frsize)),
        available: to_i64(s.f_bavail.saturating_mul(frsize)),
    };
    let inodes = Usage {
        total: to_i64(s.f_files),
        used: to_i64(s.f_files.saturating_sub(s.f_ffree)),
        available: to_i64(s.f_ffree),
    };
    Ok((bytes, inodes))
}

impl Plugin {
    /// NodeGetVolumeStats. The spec: `volume_id` "This field is REQUIRED";
    /// `volume_path` "It can be any valid path where volume was previously
    /// staged or published. It MUST be an absolute path in the root filesystem
    /// of the process serving this request. This is a REQUIRED field."; and
    /// "Volume does not exist | 5 NOT_FOUND | Indicates that a volume
    /// corresponding to the specified volume_id does not exist on specified
    /// volume_path."
    pub fn node_get_volume_stats(
        &self,
        volume_id: &str,
        volume_path: &str,
        staging_target_path: &str,
    ) -> Result<VolumeStats, Status> {
        if volume_id.is_empty() {
            return Err(Status::invalid_argument("volume_id is required"));
        }
        if volume_path.is_empty() {
            return Err(Status::invalid_argument("volume_path is required"));
        }
        if !Path::new(volume_path).is_absolute() {
            return Err(Status::invalid_argument(format!(
                "volume_path {volume_path:?} must be absolute"
            )));
        }
        if !staging_target_path.is_empty() && !Path::new(staging_target_path).is_absolute() {
            return Err(Status::invalid_argument(format!(
                "staging_target_path {staging_target_path:?} must be absolute"
            )));
        }
        let rec = self
            .record(volume_id)
            .ok_or_else(|| Status::not_found(format!("volume {volume_id:?} does not exist")))?;
        let staged_here = rec.staged.as_ref().is_some_and(|s| s.path == volume_path);
        if !staged_here && !rec.published.contains_key(volume_path) {
            return Err(Status::not_found(format!(
                "volume {volume_id:?} is neither staged nor published at {volume_path:?}"
            )));
        }
        let dir = self.volume_dir(volume_id);
        let (bytes, inodes) = measure(&dir)
            .map_err(|e| Status::internal(format!("statvfs of {}: {e}", dir.display())))?;
        let condition =
            self.config()
                .volume_condition
                .then(|| match self.faults().abnormal(volume_id) {
                    Some(message) => (true, message),
                    None => (false, String::new()),
                });
        Ok(VolumeStats {
            bytes,
            inodes,
            condition,
        })
    }
}
