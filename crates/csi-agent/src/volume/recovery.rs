//! Recovery of one plugin's volumes from disk after a restart of csi-agent or of the node.
//!
//! Recovery is declarative: it loads every record (moving unreadable ones aside), resets the
//! node-side states of records written before a reboot (every mount vanished with it),
//! confirms the records against the live mount table, and hands every volume whose actual
//! state differs from what its claims want to the background reconciler, which keeps retrying
//! while the plugin is absent. It then removes empty, unmounted mount dirs that no record
//! owns. It never deletes across a mount point and never drops a volume because the plugin
//! is missing.

use std::time::Instant;

use super::{VolumeError, VolumeManager, VolumeRecord, VolumeState, blocking};
use crate::layout::decode_id;
use crate::store::LoadAll;

/// What recovery found.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RecoveryReport {
    /// Records loaded.
    pub records: usize,
    /// Unreadable records (moved aside) and other problems, one line each.
    pub problems: Vec<String>,
    /// Records whose node-side state was reset because the node rebooted.
    pub reset_by_reboot: usize,
    /// Records corrected because the mount table showed a mount they did not expect.
    pub corrected_by_mount_table: usize,
    /// Volumes handed to the reconciler.
    pub reconciling: Vec<String>,
    /// Mount dirs without a record that still hold a mount (left alone, reported).
    pub stray_mounts: Vec<String>,
}

impl VolumeManager {
    /// Raises a record going down to the step the mount table shows done (`mounted`: the
    /// mount points under the plugin's mounts dir; `volume_dir`: this volume's, resolved the
    /// same way), marking that step uncertain so that going down undoes it. True when the
    /// record changed.
    pub(super) fn raise_to_mounts(
        &self,
        record: &mut VolumeRecord,
        volume_dir: &std::path::Path,
        mounted: &std::collections::HashSet<std::path::PathBuf>,
    ) -> bool {
        let target_mounted = mounted.contains(&volume_dir.join("target"));
        let staging_mounted = mounted.contains(&volume_dir.join("staging"));
        let raised = if target_mounted && record.state.level() < VolumeState::NodePublish.level() {
            VolumeState::NodePublish
        } else if staging_mounted && record.state.level() < VolumeState::NodeStage.level() {
            VolumeState::NodeStage
        } else {
            return false;
        };
        record.state = raised;
        record.boot_id = Some(self.inner.boot_id.clone());
        true
    }

    /// The mount points of `table` under this plugin's mounts dir, and the dir as they name
    /// it: one lookup set for the whole plugin instead of resolving two paths per record
    /// (10,000 records would mean hundreds of thousands of readlink calls).
    pub(super) fn mounted_under_mounts_root(
        &self,
        table: &crate::mounts::MountTable,
    ) -> (
        std::path::PathBuf,
        std::collections::HashSet<std::path::PathBuf>,
    ) {
        let mounts_root =
            std::fs::canonicalize(self.mounts_root()).unwrap_or_else(|_| self.mounts_root());
        let mounted = table
            .mounts_under(&mounts_root)
            .into_iter()
            .map(|m| m.mount_point.clone())
            .collect();
        (mounts_root, mounted)
    }

    /// Loads and repairs every record, then starts reconciling the volumes that need it.
    pub async fn recover(&self) -> Result<RecoveryReport, VolumeError> {
        let started = Instant::now();
        let store = self.inner.store.clone();
        let c = self.inner.config.clone();
        let loaded: LoadAll<VolumeRecord> =
            blocking(move || store.load_all(&c.plugin_type, &c.plugin_name)).await?;
        let mut report = RecoveryReport {
            records: loaded.records.len(),
            problems: loaded.problems.iter().map(ToString::to_string).collect(),
            ..RecoveryReport::default()
        };
        for problem in &report.problems {
            tracing::error!(plugin = %self.inner.config.plugin_type, %problem, "volume record unreadable");
        }
        let table = self.mount_table()?;
        let (mounts_root, mounted) = self.mounted_under_mounts_root(&table);
        for entry in loaded.records {
            let mut record = entry.record;
            // The directory name is the truth for which volume this is.
            record.volume_id = entry.volume_id;
            let mut changed = false;
            let rebooted = record
                .boot_id
                .as_deref()
                .is_some_and(|boot| boot != self.inner.boot_id);
            if rebooted && record.state.is_node_side() {
                // Every mount vanished with the reboot; the controller side (an attachment
                // to this node) did not, and the plugin's bookkeeping may not have either.
                // Make the node steps uncertain: going down they are undone (clearing the
                // plugin's bookkeeping), going up the volume is staged again first.
                record.state = if record.state.level() >= VolumeState::NodePublish.level() {
                    VolumeState::NodeUnpublish
                } else {
                    VolumeState::NodeUnstage
                };
                record.node_state_lost = true;
                record.boot_id = Some(self.inner.boot_id.clone());
                report.reset_by_reboot += 1;
                changed = true;
            }
            // A mount the record does not account for (its progress notes were lost in a
            // crash): when the volume is to go down, make the step uncertain so that the
            // reconciler undoes it instead of leaking it. A volume going up needs no
            // correction: it repeats every step from where the record is, and CSI makes each
            // one idempotent — which also gets back a publish_context a lost note held. But
            // until it has, a claim removed meanwhile would take it down from the recorded
            // step: the slot remembers that the record is unconfirmed (see `drive`).
            let volume_dir = mounts_root.join(crate::layout::encode_id(&record.volume_id));
            let unconfirmed = record.wants_published() && record.state != VolumeState::Published;
            if !record.wants_published() && self.raise_to_mounts(&mut record, &volume_dir, &mounted)
            {
                report.corrected_by_mount_table += 1;
                changed = true;
            }
            // Every recorded bind is held to the rules of a new request, and its path is
            // reserved so that no new claim can take it.
            for (workload, bind) in &record.bind_mounts {
                let owner = self.bind_owner(&record.volume_id, workload);
                let checked = self.inner.binder.check(&bind.path).and_then(|_| {
                    self.inner.binder.reserve(&bind.path, &owner)?;
                    // A mount made this boot is known before anything else runs: no new
                    // claim's bind_to may lie in it.
                    if let Some(mount_id) = bind.mount_id
                        && bind.boot_id.as_deref() == Some(self.inner.boot_id.as_str())
                    {
                        self.inner.binder.note_mount(&bind.path, &owner, mount_id);
                    }
                    Ok(())
                });
                if let Err(err) = checked {
                    tracing::error!(plugin = %self.inner.config.plugin_type, volume_id = ?record.volume_id, workload = ?workload, error = %err, "recorded bind_to refused");
                    report.problems.push(format!(
                        "volume {:?}: recorded bind_to of workload {workload:?}: {err}",
                        record.volume_id
                    ));
                }
            }
            // A published volume's binds are verified (and redone) by the reconciler: a
            // crash may have come between recording a bind and mounting it.
            let needs_work = record.state.is_transient()
                || (record.state == VolumeState::Published && !record.bind_mounts.is_empty())
                || (record.wants_published() && record.state != VolumeState::Published)
                || (!record.wants_published()
                    && (record.state != VolumeState::Created
                        || record.origin == super::Origin::PreProvisioned));
            let expanding = record.expansion.is_some();
            let volume_id = record.volume_id.clone();
            let slot = self.slot(&volume_id);
            let mut guard = slot.lock().await;
            guard.unconfirmed = unconfirmed;
            if changed {
                self.persist(&mut guard, record).await?;
            } else {
                self.set_record(&mut guard, Some(record));
            }
            drop(guard);
            if expanding {
                // An expansion interrupted by the crash: finished in the background.
                self.resume_expansion(&volume_id);
            }
            if needs_work {
                report.reconciling.push(volume_id.clone());
                self.spawn_reconcile(&volume_id);
            }
        }
        report.stray_mounts = self.collect_garbage(&table).await;
        let snapshots = self.recover_snapshots().await;
        if let Some(metrics) = &self.inner.metrics {
            metrics
                .recovery_seconds
                .set(started.elapsed().as_secs_f64());
        }
        tracing::info!(
            plugin = %self.inner.config.plugin_type,
            records = report.records,
            problems = report.problems.len(),
            reset_by_reboot = report.reset_by_reboot,
            reconciling = report.reconciling.len(),
            snapshots_resumed = snapshots,
            "volumes recovered"
        );
        Ok(report)
    }

    /// Removes mount dirs that no record owns when they are empty and unmounted; reports the
    /// ones that hold a mount.
    async fn collect_garbage(&self, table: &crate::mounts::MountTable) -> Vec<String> {
        let c = &self.inner.config;
        let mounts_dir = self.mounts_root();
        let Ok(entries) = std::fs::read_dir(&mounts_dir) else {
            return Vec::new();
        };
        let mut stray = Vec::new();
        for entry in entries.flatten() {
            let name = entry.file_name();
            let Some(volume_id) = name.to_str().and_then(decode_id) else {
                continue;
            };
            if self.get(&volume_id).await.is_some() {
                continue;
            }
            let dir = entry.path();
            if !table.mounts_under(&dir).is_empty() {
                tracing::error!(
                    plugin = %c.plugin_type,
                    dir = %dir.display(),
                    "mount without a volume record; left in place (see docs/operations.md: stray mounts)"
                );
                stray.push(volume_id);
                continue;
            }
            self.cleanup_mount_dir(&volume_id);
        }
        stray
    }
}
