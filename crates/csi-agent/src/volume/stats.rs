//! Volume stats and health of one plugin's published volumes (NodeGetVolumeStats).
//!
//! Owns: one collection round over the plugin's published volumes (bounded concurrency per
//! plugin, a deadline per call), the latest sample of each published volume (in memory
//! only), the per-volume gauges of [`crate::metrics::VolumeStatsGauges`], and the log line
//! said once per change of a volume's condition (abnormal, and back to normal).
//!
//! Must not: hold a volume's lock (a slot) across an RPC — stats are a read and never delay
//! a publish or unpublish of the volume; keep a sample or a gauge of a volume that is no
//! longer published ([`VolumeManager::forget_stats`] runs on every record change that leaves
//! `PUBLISHED`, and a sample is stored only while the read snapshot still says published);
//! call a plugin that does not advertise GET_VOLUME_STATS; decide when rounds run (that is
//! [`crate::stats`], the collector).

use std::collections::HashMap;
use std::sync::{Arc, Mutex as StdMutex, OnceLock};
use std::time::{Duration, Instant, SystemTime};

use csi_proto::v1::node_service_capability::rpc::Type as NodeCap;
use tokio::sync::Semaphore;

use super::{Advertised, VolumeError, VolumeManager, VolumeRecord, VolumeState, lock};
use crate::client::stats::VolumeStats;
use crate::client::{RpcError, RpcErrorKind};
use crate::config::Service;
use crate::metrics::VolumeLabels;

/// `--volume-stats-interval` by default (the kubelet's `--volume-stats-agg-period`).
pub const DEFAULT_INTERVAL: Duration = Duration::from_secs(60);
/// `--volume-stats-concurrency` by default: calls in flight per plugin.
pub const DEFAULT_CONCURRENCY: usize = 4;
/// `--volume-stats-timeout` by default: the deadline of one NodeGetVolumeStats.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(10);

/// How volume stats are collected.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StatsOptions {
    /// Time between a plugin's rounds, before jitter; zero disables the collector (the API
    /// still collects on demand).
    pub interval: Duration,
    /// NodeGetVolumeStats calls in flight at once, per plugin.
    pub concurrency: usize,
    /// Deadline of one call (and of getting a connection for it).
    pub timeout: Duration,
}

impl Default for StatsOptions {
    fn default() -> Self {
        Self {
            interval: DEFAULT_INTERVAL,
            concurrency: DEFAULT_CONCURRENCY,
            timeout: DEFAULT_TIMEOUT,
        }
    }
}

/// The latest stats of one published volume.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Sample {
    /// What the plugin reported; the condition only when it advertises VOLUME_CONDITION.
    pub stats: VolumeStats,
    pub collected_at: SystemTime,
    /// The labels its gauges carry (to remove exactly those).
    labels: VolumeLabels,
}

/// Per plugin: samples and the concurrency bound.
#[derive(Debug, Default)]
pub(super) struct StatsState {
    samples: StdMutex<HashMap<String, Arc<Sample>>>,
    /// Created by the first round, with that round's concurrency.
    permits: OnceLock<Arc<Semaphore>>,
}

/// Why a volume's stats cannot be given.
#[derive(Debug, thiserror::Error)]
pub enum StatsError {
    #[error("plugin {plugin} has no volume {volume_id:?} on this node")]
    UnknownVolume { plugin: String, volume_id: String },
    #[error(
        "volume {volume_id:?} of plugin {plugin} is {state}, not PUBLISHED: stats are \
         collected only for published volumes (publish it first)"
    )]
    NotPublished {
        plugin: String,
        volume_id: String,
        state: &'static str,
    },
    #[error(transparent)]
    Volume(#[from] VolumeError),
}

/// What one round did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RoundReport {
    /// Published volumes asked about.
    pub volumes: usize,
    pub collected: usize,
    pub failed: usize,
}

const METHOD: &str = "NodeGetVolumeStats";

fn labels_of(plugin: &str, record: &VolumeRecord) -> VolumeLabels {
    let mut labels = vec![
        ("plugin".to_owned(), plugin.to_owned()),
        ("volume_id".to_owned(), record.volume_id.clone()),
    ];
    let mut claims = record.claims.iter();
    if let (Some(only), None) = (claims.next(), claims.next()) {
        labels.push(("workload".to_owned(), only.clone()));
    }
    labels
}

fn gauge_value(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

impl VolumeManager {
    /// The latest sample of a published volume, if one was collected (never calls the plugin).
    pub fn stats_sample(&self, volume_id: &str) -> Option<Arc<Sample>> {
        lock(&self.inner.stats.samples).get(volume_id).cloned()
    }

    /// The stats of a published volume for the API: the latest sample, or, before the first
    /// round reached it (or always, when the collector is off), one collected now (bounded by
    /// `options.timeout`). Refused before
    /// any NodeGetVolumeStats when the plugin does not advertise GET_VOLUME_STATS.
    pub async fn volume_stats(
        &self,
        volume_id: &str,
        options: &StatsOptions,
    ) -> Result<Arc<Sample>, StatsError> {
        let plugin = &self.inner.config.plugin_type;
        let record = self
            .snapshot_of(volume_id)
            .ok_or_else(|| StatsError::UnknownVolume {
                plugin: plugin.clone(),
                volume_id: volume_id.to_owned(),
            })?;
        self.require_node_cap(NodeCap::GetVolumeStats, "volume stats")
            .await?;
        let not_published = |state: VolumeState| StatsError::NotPublished {
            plugin: plugin.clone(),
            volume_id: volume_id.to_owned(),
            state: state.as_str(),
        };
        if record.state != VolumeState::Published {
            return Err(not_published(record.state));
        }
        // With the collector off (interval 0) nothing refreshes a sample: every request asks.
        if !options.interval.is_zero()
            && let Some(sample) = self.stats_sample(volume_id)
        {
            return Ok(sample);
        }
        let caps = self.caps(Instant::now() + options.timeout).await?;
        let stats = self.ask_stats(volume_id, &caps, options).await?;
        self.store_sample(volume_id, stats).ok_or_else(|| {
            let state = self
                .snapshot_of(volume_id)
                .map_or(VolumeState::Created, |r| r.state);
            not_published(state)
        })
    }

    /// One round: NodeGetVolumeStats for every published volume, at most
    /// `options.concurrency` at once. Nothing is called when the plugin does not advertise
    /// GET_VOLUME_STATS (or cannot say what it advertises within the timeout).
    pub async fn collect_stats_round(&self, options: &StatsOptions) -> RoundReport {
        let published: Vec<String> = self
            .list_snapshot()
            .iter()
            .filter(|r| r.state == VolumeState::Published)
            .map(|r| r.volume_id.clone())
            .collect();
        let mut report = RoundReport {
            volumes: published.len(),
            ..RoundReport::default()
        };
        if published.is_empty() {
            return report;
        }
        let caps = match self.caps(Instant::now() + options.timeout).await {
            Ok(caps) => caps,
            Err(err) => {
                tracing::debug!(plugin = %self.inner.config.plugin_type, error = %err, "volume stats round skipped: the plugin's capabilities are unknown");
                return report;
            }
        };
        if !caps.node.contains(&NodeCap::GetVolumeStats) {
            return report;
        }
        let permits = Arc::clone(
            self.inner
                .stats
                .permits
                .get_or_init(|| Arc::new(Semaphore::new(options.concurrency.max(1)))),
        );
        let mut calls = tokio::task::JoinSet::new();
        for volume_id in published {
            let Ok(permit) = Arc::clone(&permits).acquire_owned().await else {
                break;
            };
            let this = self.clone();
            let caps = Arc::clone(&caps);
            let options = *options;
            calls.spawn(async move {
                let _permit = permit;
                let result = this.ask_stats(&volume_id, &caps, &options).await;
                (volume_id, result)
            });
        }
        let mut first_error = None;
        while let Some(joined) = calls.join_next().await {
            match joined {
                Ok((volume_id, Ok(stats))) => {
                    self.store_sample(&volume_id, stats);
                    report.collected += 1;
                }
                Ok((volume_id, Err(err))) => {
                    report.failed += 1;
                    first_error.get_or_insert_with(|| format!("{volume_id:?}: {err}"));
                }
                Err(err) => {
                    report.failed += 1;
                    first_error.get_or_insert_with(|| format!("task: {err}"));
                }
            }
        }
        if let Some(first) = first_error {
            // Once per round, not per volume: a sick plugin must not flood the log. The last
            // sample of each failed volume stays, with its `collected_at`.
            tracing::warn!(plugin = %self.inner.config.plugin_type, failed = report.failed, volumes = report.volumes, "volume stats: some NodeGetVolumeStats calls failed; first: {first}");
        }
        report
    }

    /// One NodeGetVolumeStats, the connection and the call each bounded by the timeout.
    async fn ask_stats(
        &self,
        volume_id: &str,
        caps: &Advertised,
        options: &StatsOptions,
    ) -> Result<VolumeStats, VolumeError> {
        let timed_out = || RpcError {
            method: METHOD,
            kind: RpcErrorKind::DeadlineExceeded,
        };
        // Ordered with reloads like every RPC attempt; a hanging call holds this (read) at
        // most for the timeout.
        let _step = tokio::time::timeout(options.timeout, self.inner.steps.read())
            .await
            .map_err(|_| timed_out())?;
        let client =
            tokio::time::timeout(options.timeout, self.inner.endpoints.client(Service::Node))
                .await
                .map_err(|_| timed_out())??;
        let target = self.target_path(volume_id);
        let staging = caps.lifecycle().stage.then(|| self.staging_path(volume_id));
        let mut stats = client
            .with_deadline(options.timeout)
            .node_get_volume_stats(
                volume_id,
                &target.to_string_lossy(),
                staging.as_deref().map(|p| p.to_string_lossy()).as_deref(),
            )
            .await?;
        if !caps.node.contains(&NodeCap::VolumeCondition) {
            // The condition is defined only where VOLUME_CONDITION is advertised.
            stats.condition = None;
        }
        Ok(stats)
    }

    /// Keeps `stats` as the volume's latest sample, sets its gauges and logs a change of its
    /// condition — only while the read snapshot says the volume is published (checked under
    /// the samples' lock, which [`Self::forget_stats`] takes after the snapshot changed, so a
    /// sample never outlives the publication). `None` when it is not published any more.
    fn store_sample(&self, volume_id: &str, stats: VolumeStats) -> Option<Arc<Sample>> {
        let plugin = &self.inner.config.plugin_type;
        let mut samples = lock(&self.inner.stats.samples);
        let record = self
            .snapshot_of(volume_id)
            .filter(|r| r.state == VolumeState::Published)?;
        let sample = Arc::new(Sample {
            stats,
            collected_at: SystemTime::now(),
            labels: labels_of(plugin, &record),
        });
        let old = samples.insert(volume_id.to_owned(), Arc::clone(&sample));
        let was = old.as_ref().and_then(|o| o.stats.condition.as_ref());
        match (&sample.stats.condition, was) {
            (Some(now), was) if now.abnormal && was.is_none_or(|w| w != now) => {
                tracing::warn!(plugin = %plugin, volume_id = %volume_id, message = %now.message, "volume condition abnormal");
            }
            (Some(now), Some(was)) if !now.abnormal && was.abnormal => {
                tracing::info!(plugin = %plugin, volume_id = %volume_id, message = %now.message, "volume condition normal again");
            }
            _ => {}
        }
        if let Some(metrics) = &self.inner.metrics {
            let gauges = &metrics.volume_stats;
            if let Some(old) = &old
                && old.labels != sample.labels
            {
                gauges.remove(&old.labels);
            }
            let labels = &sample.labels;
            let set = |family: &prometheus_client::metrics::family::Family<
                VolumeLabels,
                prometheus_client::metrics::gauge::Gauge,
            >,
                       value: Option<u64>| match value {
                Some(v) => {
                    family.get_or_create(labels).set(gauge_value(v));
                }
                None => {
                    family.remove(labels);
                }
            };
            let bytes = sample.stats.bytes.unwrap_or_default();
            let inodes = sample.stats.inodes.unwrap_or_default();
            set(&gauges.capacity_bytes, bytes.total);
            set(&gauges.available_bytes, bytes.available);
            set(&gauges.used_bytes, bytes.used);
            set(&gauges.inodes, inodes.total);
            set(&gauges.inodes_free, inodes.available);
            set(&gauges.inodes_used, inodes.used);
            set(
                &gauges.health_abnormal,
                sample
                    .stats
                    .condition
                    .as_ref()
                    .map(|c| u64::from(c.abnormal)),
            );
        }
        Some(sample)
    }

    /// Drops the sample and gauges of a volume that is no longer published. Called with every
    /// record change that is not `PUBLISHED` (cheap when there is nothing to drop).
    pub(super) fn forget_stats(&self, volume_id: &str) {
        let removed = lock(&self.inner.stats.samples).remove(volume_id);
        if let (Some(sample), Some(metrics)) = (removed, &self.inner.metrics) {
            metrics.volume_stats.remove(&sample.labels);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::volume::Origin;

    #[test]
    fn workload_label_only_for_exactly_one_claim() {
        let mut record = VolumeRecord::new("v", Origin::PreProvisioned);
        assert_eq!(labels_of("p", &record).len(), 2);
        record.claims.insert("w1".to_owned());
        assert_eq!(
            labels_of("p", &record).last(),
            Some(&("workload".to_owned(), "w1".to_owned()))
        );
        record.claims.insert("w2".to_owned());
        assert!(
            !labels_of("p", &record).iter().any(|(k, _)| k == "workload"),
            "two claims: no workload label"
        );
    }
}
