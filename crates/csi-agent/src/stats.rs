//! The volume stats collector: when each plugin's round of NodeGetVolumeStats runs.
//!
//! Owns: one task per initialized plugin, which waits the interval jittered as the kubelet's
//! volume stats calculator does (`wait.JitterUntil(period, 1.0, sliding)`: each wait is
//! between one and two intervals, counted from the end of the previous round, so that rounds
//! of many plugins and nodes do not align) and then runs the plugin's round
//! ([`crate::volume::stats`]). A plugin whose calls hang delays only its own next round:
//! rounds of different plugins never wait for each other, and nothing here is run per
//! scrape or per API request.
//!
//! Must not: call a plugin itself, hold the plugin table across a round, or keep a task
//! for a plugin that is no longer loaded.

use std::collections::HashMap;
use std::time::Duration;

use crate::server::CsiServer;
use crate::volume::stats::StatsOptions;

/// How often the collector looks for plugins that were initialized since (a new plugin's
/// first round still waits a jittered interval; the API collects on demand meanwhile).
const DISCOVER_EVERY: Duration = Duration::from_secs(5);

/// The kubelet's jitter: `interval * (1 + rand[0, 1))`.
fn jittered(interval: Duration) -> Duration {
    interval.mul_f64(1.0 + rand::random::<f64>())
}

/// Starts the collector (nothing when the interval is zero). It ends with the runtime.
pub fn spawn_collector(server: CsiServer, options: StatsOptions) {
    if options.interval.is_zero() {
        tracing::info!("volume stats collector disabled (--volume-stats-interval 0)");
        return;
    }
    tokio::spawn(async move {
        let mut rounds: HashMap<String, tokio::task::JoinHandle<()>> = HashMap::new();
        loop {
            let (reports, _) = server.plugins().await;
            for report in reports {
                if report.plugin.is_none() {
                    continue;
                }
                let plugin_type = report.loaded.config.plugin_type.clone();
                if rounds.get(&plugin_type).is_some_and(|t| !t.is_finished()) {
                    continue;
                }
                let task =
                    tokio::spawn(plugin_rounds(server.clone(), plugin_type.clone(), options));
                rounds.insert(plugin_type, task);
            }
            rounds.retain(|_, task| !task.is_finished());
            tokio::time::sleep(DISCOVER_EVERY.min(options.interval)).await;
        }
    });
}

/// The rounds of one plugin, until it is no longer loaded.
async fn plugin_rounds(server: CsiServer, plugin_type: String, options: StatsOptions) {
    loop {
        tokio::time::sleep(jittered(options.interval)).await;
        // Looked up each time: a reload may have replaced the plugin.
        let Some(plugin) = server.plugin_if_loaded(&plugin_type).await else {
            return;
        };
        let report = plugin.volumes.collect_stats_round(&options).await;
        tracing::debug!(plugin = %plugin_type, volumes = report.volumes, collected = report.collected, failed = report.failed, "volume stats round");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn jitter_stays_between_one_and_two_intervals() {
        let interval = Duration::from_secs(60);
        let waits: Vec<Duration> = (0..1000).map(|_| jittered(interval)).collect();
        assert!(waits.iter().all(|w| *w >= interval && *w < interval * 2));
        // Spread, not a constant: some early, some late.
        assert!(waits.iter().any(|w| *w < Duration::from_secs(70)));
        assert!(waits.iter().any(|w| *w > Duration::from_secs(110)));
    }
}
