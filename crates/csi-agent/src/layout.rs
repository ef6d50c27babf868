//! The on-disk layout of the work dir (docs/on-disk-format.md) and the encoding of ids into path
//! components.
//!
//! This module only computes paths; it never touches the file system. Every other module
//! asks it where things live, so that the layout is defined in exactly one place.
//!
//! ```text
//! <work_dir>/
//!   csi/<type>/<name>/
//!     containers/<container id>/   component.json, endpoint -> short socket dir, stdout, stderr
//!     volumes/<enc volume id>/volume.json
//!     mounts/<enc volume id>/staging
//!                           /target
//! ```

use std::path::{Path, PathBuf};

/// Encodes an arbitrary id (volume id, workload id) into exactly one safe path component:
/// every byte outside `[A-Za-z0-9_-]` becomes `%XX` (upper-case hex). The empty string
/// becomes `%` so that it still names a directory (it can never be produced otherwise, since
/// a `%` is always followed by two hex digits).
pub fn encode_id(id: &str) -> String {
    if id.is_empty() {
        return "%".to_owned();
    }
    let mut out = String::with_capacity(id.len());
    for byte in id.bytes() {
        if byte.is_ascii_alphanumeric() || byte == b'_' || byte == b'-' {
            out.push(char::from(byte));
        } else {
            out.push('%');
            out.push(hex_digit(byte >> 4));
            out.push(hex_digit(byte & 0x0f));
        }
    }
    out
}

fn hex_digit(nibble: u8) -> char {
    char::from(b"0123456789ABCDEF"[usize::from(nibble & 0x0f)])
}

/// Decodes a path component produced by [`encode_id`]. Returns `None` for anything
/// [`encode_id`] cannot have produced (stray files, hand-made directories), so recovery can
/// report them instead of guessing.
pub fn decode_id(component: &str) -> Option<String> {
    if component == "%" {
        return Some(String::new());
    }
    if component.is_empty() {
        return None;
    }
    let bytes = component.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let byte = bytes[i];
        if byte == b'%' {
            let hi = hex_value(*bytes.get(i + 1)?)?;
            let lo = hex_value(*bytes.get(i + 2)?)?;
            let decoded = (hi << 4) | lo;
            // A byte that encode_id would have left as is must not appear escaped: keeping the
            // mapping one-to-one means one id has exactly one directory.
            if decoded.is_ascii_alphanumeric() || decoded == b'_' || decoded == b'-' {
                return None;
            }
            out.push(decoded);
            i += 3;
        } else if byte.is_ascii_alphanumeric() || byte == b'_' || byte == b'-' {
            out.push(byte);
            i += 1;
        } else {
            return None;
        }
    }
    String::from_utf8(out).ok()
}

fn hex_value(byte: u8) -> Option<u8> {
    match byte {
        b'0'..=b'9' => Some(byte - b'0'),
        b'A'..=b'F' => Some(byte - b'A' + 10),
        _ => None,
    }
}

/// Paths inside one work dir.
#[derive(Clone, Debug)]
pub struct Layout {
    work_dir: PathBuf,
}

impl Layout {
    pub fn new(work_dir: impl Into<PathBuf>) -> Self {
        Self {
            work_dir: work_dir.into(),
        }
    }

    pub fn work_dir(&self) -> &Path {
        &self.work_dir
    }

    /// `<work_dir>/named`: the secrets files of the front doors' volume names (`crate::named`).
    pub fn named_dir(&self) -> PathBuf {
        self.work_dir.join("named")
    }

    /// `<work_dir>/csi`: the root of all per-plugin state.
    pub fn csi_root(&self) -> PathBuf {
        self.work_dir.join("csi")
    }

    /// `<work_dir>/csi/<type>/<name>`. `type` and `name` are validated by config loading
    /// (letters, digits, `.`, `-`, `_`, no leading dot) before they reach this function.
    pub fn plugin_dir(&self, plugin_type: &str, plugin_name: &str) -> PathBuf {
        self.csi_root().join(plugin_type).join(plugin_name)
    }

    pub fn containers_dir(&self, plugin_type: &str, plugin_name: &str) -> PathBuf {
        self.plugin_dir(plugin_type, plugin_name).join("containers")
    }

    pub fn container_dir(
        &self,
        plugin_type: &str,
        plugin_name: &str,
        container_id: &str,
    ) -> PathBuf {
        self.containers_dir(plugin_type, plugin_name)
            .join(container_id)
    }

    pub fn volumes_dir(&self, plugin_type: &str, plugin_name: &str) -> PathBuf {
        self.plugin_dir(plugin_type, plugin_name).join("volumes")
    }

    /// `<plugin>/volumes/<enc volume id>`: holds `volume.json` and the 0600 secrets file.
    pub fn volume_dir(&self, plugin_type: &str, plugin_name: &str, volume_id: &str) -> PathBuf {
        self.volumes_dir(plugin_type, plugin_name)
            .join(encode_id(volume_id))
    }

    pub fn mounts_dir(&self, plugin_type: &str, plugin_name: &str) -> PathBuf {
        self.plugin_dir(plugin_type, plugin_name).join("mounts")
    }

    /// `<plugin>/mounts/<enc volume id>`: the parent of the staging and target paths.
    pub fn volume_mount_dir(
        &self,
        plugin_type: &str,
        plugin_name: &str,
        volume_id: &str,
    ) -> PathBuf {
        self.mounts_dir(plugin_type, plugin_name)
            .join(encode_id(volume_id))
    }

    /// The NodeStage `staging_target_path`.
    pub fn staging_path(&self, plugin_type: &str, plugin_name: &str, volume_id: &str) -> PathBuf {
        self.volume_mount_dir(plugin_type, plugin_name, volume_id)
            .join("staging")
    }

    /// The NodePublish `target_path`: what the host agent bind-mounts into the workload.
    pub fn target_path(&self, plugin_type: &str, plugin_name: &str, volume_id: &str) -> PathBuf {
        self.volume_mount_dir(plugin_type, plugin_name, volume_id)
            .join("target")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn dangerous_ids_become_one_safe_component() {
        for id in ["", ".", "..", "a/b", "../../etc", "a\0b", "vol ü", "%41"] {
            let enc = encode_id(id);
            assert!(!enc.contains('/'), "{id:?} -> {enc}");
            assert!(enc != "." && enc != "..", "{id:?} -> {enc}");
            assert!(!enc.contains('\0'));
            assert_eq!(decode_id(&enc).as_deref(), Some(id));
        }
        assert_eq!(encode_id("vol-1_A"), "vol-1_A");
        assert_eq!(encode_id("a.b"), "a%2Eb");
    }

    #[test]
    fn rejects_components_encode_cannot_produce() {
        for bad in ["a.b", "%4", "%zz", "%41", "a b", "%2e", ""] {
            assert_eq!(decode_id(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn paths_follow_the_documented_layout() {
        let layout = Layout::new("/w");
        assert_eq!(
            layout.target_path("org.example.test", "default", "v/1"),
            PathBuf::from("/w/csi/org.example.test/default/mounts/v%2F1/target")
        );
        assert_eq!(
            layout.volume_dir("t", "n", "x"),
            PathBuf::from("/w/csi/t/n/volumes/x")
        );
    }

    proptest! {
        #[test]
        fn encoding_round_trips_and_is_injective(a in ".*", b in ".*") {
            let ea = encode_id(&a);
            prop_assert_eq!(decode_id(&ea), Some(a.clone()));
            prop_assert!(!ea.contains('/') && ea != "." && ea != "..");
            if a != b {
                prop_assert_ne!(ea, encode_id(&b));
            }
        }
    }
}
