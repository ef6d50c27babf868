//! The boot id (docs/design.md, "The volume lifecycle"): recorded when a volume is staged, compared at recovery to
//! tell whether the node rebooted (every mount vanished with the reboot).
//!
//! This module only reads the id, behind a trait so that tests can simulate a reboot. It
//! must not decide what a changed boot id means (recovery does).

use std::path::PathBuf;
use std::sync::{Mutex, OnceLock, PoisonError};

/// Where Linux publishes the id of the current boot.
pub const BOOT_ID_PATH: &str = "/proc/sys/kernel/random/boot_id";

#[derive(Debug, thiserror::Error)]
pub enum BootIdError {
    #[error("read boot id from {}: {source}", path.display())]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("boot id at {} is empty", path.display())]
    Empty { path: PathBuf },
}

/// Gives the id of the current boot.
pub trait BootIdSource: Send + Sync + std::fmt::Debug {
    fn boot_id(&self) -> Result<String, BootIdError>;
}

/// Reads the kernel's boot id (trimmed). The value cannot change while the process lives, so
/// the first successful read is cached.
#[derive(Debug)]
pub struct ProcBootId {
    path: PathBuf,
    cached: OnceLock<String>,
}

impl Default for ProcBootId {
    fn default() -> Self {
        Self::new()
    }
}

impl ProcBootId {
    pub fn new() -> Self {
        Self::with_path(BOOT_ID_PATH)
    }

    /// Reads from another file (tests).
    pub fn with_path(path: impl Into<PathBuf>) -> Self {
        Self {
            path: path.into(),
            cached: OnceLock::new(),
        }
    }
}

impl BootIdSource for ProcBootId {
    fn boot_id(&self) -> Result<String, BootIdError> {
        if let Some(id) = self.cached.get() {
            return Ok(id.clone());
        }
        let text = std::fs::read_to_string(&self.path).map_err(|source| BootIdError::Read {
            path: self.path.clone(),
            source,
        })?;
        let id = text.trim();
        if id.is_empty() {
            return Err(BootIdError::Empty {
                path: self.path.clone(),
            });
        }
        Ok(self.cached.get_or_init(|| id.to_owned()).clone())
    }
}

/// A boot id set by tests; [`FixedBootId::set`] simulates a reboot.
#[derive(Debug)]
pub struct FixedBootId {
    id: Mutex<String>,
}

impl FixedBootId {
    pub fn new(id: impl Into<String>) -> Self {
        Self {
            id: Mutex::new(id.into()),
        }
    }

    pub fn set(&self, id: impl Into<String>) {
        *self.id.lock().unwrap_or_else(PoisonError::into_inner) = id.into();
    }
}

impl BootIdSource for FixedBootId {
    fn boot_id(&self) -> Result<String, BootIdError> {
        Ok(self
            .id
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone())
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    #[test]
    fn reads_and_trims_the_kernel_boot_id() {
        let id = ProcBootId::new().boot_id().unwrap();
        assert_eq!(id.len(), 36, "{id:?}");
        assert_eq!(id, id.trim());
        assert_eq!(ProcBootId::new().boot_id().unwrap(), id);
    }

    #[test]
    fn reports_missing_or_empty_files() {
        let dir = tempfile::tempdir().unwrap();
        assert!(matches!(
            ProcBootId::with_path(dir.path().join("none")).boot_id(),
            Err(BootIdError::Read { .. })
        ));
        std::fs::write(dir.path().join("empty"), "\n").unwrap();
        assert!(matches!(
            ProcBootId::with_path(dir.path().join("empty")).boot_id(),
            Err(BootIdError::Empty { .. })
        ));
    }

    #[test]
    fn fixed_boot_id_can_simulate_a_reboot() {
        let source = FixedBootId::new("boot-1");
        assert_eq!(source.boot_id().unwrap(), "boot-1");
        source.set("boot-2");
        assert_eq!(source.boot_id().unwrap(), "boot-2");
    }
}
