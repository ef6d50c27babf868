//! Prometheus metrics owned by the engine (docs/operations.md).
//!
//! One [`Metrics`] value per engine holds the registry and every metric family; components
//! receive an `Arc<Metrics>` and record into it. This module only defines and encodes metrics;
//! it must not decide anything. Labels never carry secrets or mount flags.

use std::sync::atomic::AtomicU64;
use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::{Family, MetricConstructor};
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::{Metric, Registry};

/// Labels of one CSI RPC: which plugin, which method, which outcome (gRPC code name, `OK`, or
/// `TRANSPORT` when no status came back).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RpcLabels {
    pub plugin: String,
    pub method: String,
    pub code: String,
}

/// Labels of an RPC in flight (no outcome yet).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct MethodLabels {
    pub plugin: String,
    pub method: String,
}

/// Labels naming a plugin.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PluginLabels {
    pub plugin: String,
}

/// Labels naming a plugin component (container id).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ComponentLabels {
    pub plugin: String,
    pub component: String,
}

/// Labels of volumes counted by state.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct VolumeStateLabels {
    pub plugin: String,
    pub state: String,
}

/// Labels of a publish/unpublish request by outcome (`ok` or `error`).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OperationLabels {
    pub operation: String,
    pub outcome: String,
}

/// Labels of a configuration file that failed to load.
/// Labels of one etcd request (cluster mode): the call and how it ended (`ok`,
/// `unavailable`, `error`).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct EtcdLabels {
    pub op: String,
    pub outcome: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ConfigFileLabels {
    pub file: String,
}

/// Builds latency histograms with buckets from 50 µs to ~52 s (seconds).
#[derive(Clone, Copy, Debug)]
pub struct LatencyBuckets;

impl MetricConstructor<Histogram> for LatencyBuckets {
    fn new_metric(&self) -> Histogram {
        Histogram::new(latency_buckets())
    }
}

fn latency_buckets() -> impl Iterator<Item = f64> {
    prometheus_client::metrics::histogram::exponential_buckets(0.000_05, 4.0, 11)
}

/// The registry's prefix: every metric is named `csi_agent_…`.
const PREFIX: &str = "csi_agent";

/// A registry that also keeps the name and type of what it registers, which
/// `prometheus_client` does not expose (and does not encode for a family with no samples
/// yet): [`Metrics::families`] lists them for the docs' test.
#[derive(Debug)]
struct Registering {
    registry: Registry,
    families: Vec<(String, MetricType)>,
}

impl Registering {
    fn register(&mut self, name: &str, help: &str, metric: impl Metric) {
        self.families
            .push((format!("{PREFIX}_{name}"), metric.metric_type()));
        self.registry.register(name, help, metric);
    }
}

/// Every metric family of the engine, registered in one registry.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    families: Vec<(String, MetricType)>,
    pub rpc_duration: Family<RpcLabels, Histogram, LatencyBuckets>,
    pub rpcs_in_flight: Family<MethodLabels, Gauge>,
    pub probes: Family<RpcLabels, Counter>,
    pub component_terminations: Family<ComponentLabels, Counter>,
    pub component_restarts: Family<ComponentLabels, Counter>,
    pub plugin_ready: Family<PluginLabels, Gauge>,
    pub volumes: Family<VolumeStateLabels, Gauge>,
    pub operation_duration: Family<OperationLabels, Histogram, LatencyBuckets>,
    pub checkpoint_writes: Counter,
    pub checkpoint_lazy_commits: Counter,
    pub checkpoint_records: Counter,
    pub checkpoint_fsync_seconds: Histogram,
    pub recovery_seconds: Gauge<f64, AtomicU64>,
    pub config_errors: Family<ConfigFileLabels, Gauge>,
    /// Cluster mode: etcd request latency, leases lost, publishes refused across nodes.
    pub etcd_request_duration: Family<EtcdLabels, Histogram, LatencyBuckets>,
    pub cluster_lease_losses: Counter,
    pub cluster_conflicts: Family<PluginLabels, Counter>,
    /// A new controller leader of a cluster plugin seen by this node.
    pub cluster_leader_changes: Family<PluginLabels, Counter>,
    /// Per published volume, from the stats collector (`crate::volume::stats`).
    pub volume_stats: VolumeStatsGauges,
}

/// Labels of one published volume's stats: `plugin`, `volume_id`, and `workload` when exactly
/// one claim holds the volume (a list, because the label is there or not).
pub type VolumeLabels = Vec<(String, String)>;

/// The kubelet's volume-stats gauges (`kubelet_volume_stats_*`), per published volume.
#[derive(Debug, Default)]
pub struct VolumeStatsGauges {
    pub capacity_bytes: Family<VolumeLabels, Gauge>,
    pub available_bytes: Family<VolumeLabels, Gauge>,
    pub used_bytes: Family<VolumeLabels, Gauge>,
    pub inodes: Family<VolumeLabels, Gauge>,
    pub inodes_free: Family<VolumeLabels, Gauge>,
    pub inodes_used: Family<VolumeLabels, Gauge>,
    pub health_abnormal: Family<VolumeLabels, Gauge>,
}

impl VolumeStatsGauges {
    /// Every family with its name (after the `csi_agent` prefix).
    pub fn named(&self) -> [(&'static str, &Family<VolumeLabels, Gauge>); 7] {
        [
            ("volume_stats_capacity_bytes", &self.capacity_bytes),
            ("volume_stats_available_bytes", &self.available_bytes),
            ("volume_stats_used_bytes", &self.used_bytes),
            ("volume_stats_inodes", &self.inodes),
            ("volume_stats_inodes_free", &self.inodes_free),
            ("volume_stats_inodes_used", &self.inodes_used),
            ("volume_health_abnormal", &self.health_abnormal),
        ]
    }

    /// Removes every series of one volume.
    pub fn remove(&self, labels: &VolumeLabels) {
        for (_, family) in self.named() {
            family.remove(labels);
        }
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// Creates the registry with every family registered under the `csi_agent` prefix.
    pub fn new() -> Self {
        let mut registry = Registering {
            registry: Registry::with_prefix(PREFIX),
            families: Vec::new(),
        };
        let rpc_duration = Family::new_with_constructor(LatencyBuckets);
        registry.register(
            "rpc_duration_seconds",
            "CSI RPC latency by plugin, method and gRPC code",
            rpc_duration.clone(),
        );
        let rpcs_in_flight = Family::default();
        registry.register(
            "rpcs_in_flight",
            "CSI RPCs currently in flight",
            rpcs_in_flight.clone(),
        );
        let probes = Family::default();
        registry.register(
            "probes",
            "CSI Probe calls by plugin and outcome",
            probes.clone(),
        );
        let component_terminations = Family::default();
        registry.register(
            "component_terminations",
            "Plugin component processes that exited or were killed",
            component_terminations.clone(),
        );
        let component_restarts = Family::default();
        registry.register(
            "component_restarts",
            "Plugin component relaunches after a termination",
            component_restarts.clone(),
        );
        let plugin_ready = Family::default();
        registry.register(
            "plugin_ready",
            "1 when every component of the plugin answered Probe as ready",
            plugin_ready.clone(),
        );
        let volumes = Family::default();
        registry.register(
            "volumes",
            "Known volumes by plugin and state",
            volumes.clone(),
        );
        let operation_duration = Family::new_with_constructor(LatencyBuckets);
        registry.register(
            "operation_duration_seconds",
            "End-to-end publish/unpublish latency by outcome",
            operation_duration.clone(),
        );
        let checkpoint_writes = Counter::default();
        registry.register(
            "checkpoint_writes",
            "Durable writes: store commits (one fsync of the write-ahead log each, however many records they hold) and secrets files",
            checkpoint_writes.clone(),
        );
        let checkpoint_lazy_commits = Counter::default();
        registry.register(
            "checkpoint_lazy_commits",
            "Store commits that held only progress notes (nobody waited for them)",
            checkpoint_lazy_commits.clone(),
        );
        let checkpoint_records = Counter::default();
        registry.register(
            "checkpoint_records",
            "Record writes and deletes committed (group commit puts many in one commit; a row written several times before a commit counts once)",
            checkpoint_records.clone(),
        );
        let checkpoint_fsync_seconds = Histogram::new(latency_buckets());
        registry.register(
            "checkpoint_fsync_seconds",
            "Time per durable write (a whole store commit, or a secrets file)",
            checkpoint_fsync_seconds.clone(),
        );
        let recovery_seconds = Gauge::<f64, AtomicU64>::default();
        registry.register(
            "recovery_seconds",
            "Duration of the last recovery from disk",
            recovery_seconds.clone(),
        );
        let config_errors = Family::default();
        registry.register(
            "config_errors",
            "1 for each plugin configuration file that failed to load",
            config_errors.clone(),
        );
        let etcd_request_duration = Family::new_with_constructor(LatencyBuckets);
        registry.register(
            "etcd_request_duration_seconds",
            "etcd request latency in cluster mode, by call and outcome",
            etcd_request_duration.clone(),
        );
        let cluster_lease_losses = Counter::default();
        registry.register(
            "cluster_lease_losses",
            "Times this node lost its etcd lease and joined again (cluster mode)",
            cluster_lease_losses.clone(),
        );
        let cluster_conflicts = Family::default();
        registry.register(
            "cluster_conflicts",
            "Cluster publishes refused because other nodes hold the volume (409)",
            cluster_conflicts.clone(),
        );
        let cluster_leader_changes = Family::default();
        registry.register(
            "cluster_leader_changes",
            "Times this node saw a new controller leader of a cluster plugin",
            cluster_leader_changes.clone(),
        );
        let volume_stats = VolumeStatsGauges::default();
        for (name, family) in volume_stats.named() {
            let help = match name {
                "volume_stats_capacity_bytes" => {
                    "Capacity of a published volume's file system, in bytes (NodeGetVolumeStats)"
                }
                "volume_stats_available_bytes" => {
                    "Bytes available on a published volume (NodeGetVolumeStats)"
                }
                "volume_stats_used_bytes" => {
                    "Bytes used on a published volume (NodeGetVolumeStats)"
                }
                "volume_stats_inodes" => {
                    "Inodes of a published volume's file system (NodeGetVolumeStats)"
                }
                "volume_stats_inodes_free" => {
                    "Free inodes of a published volume (NodeGetVolumeStats)"
                }
                "volume_stats_inodes_used" => {
                    "Used inodes of a published volume (NodeGetVolumeStats)"
                }
                _ => {
                    "1 when the plugin reports a published volume's condition as abnormal, 0 when normal"
                }
            };
            registry.register(name, help, family.clone());
        }
        Self {
            volume_stats,
            registry: registry.registry,
            families: registry.families,
            rpc_duration,
            rpcs_in_flight,
            probes,
            component_terminations,
            component_restarts,
            plugin_ready,
            volumes,
            operation_duration,
            checkpoint_writes,
            checkpoint_lazy_commits,
            checkpoint_records,
            checkpoint_fsync_seconds,
            recovery_seconds,
            config_errors,
            etcd_request_duration,
            cluster_lease_losses,
            cluster_conflicts,
            cluster_leader_changes,
        }
    }

    /// Records one finished RPC.
    pub fn observe_rpc(&self, plugin: &str, method: &str, code: &str, elapsed: Duration) {
        self.rpc_duration
            .get_or_create(&RpcLabels {
                plugin: plugin.to_owned(),
                method: method.to_owned(),
                code: code.to_owned(),
            })
            .observe(elapsed.as_secs_f64());
    }

    /// Every registered metric family: its full name (as in `# TYPE`; a counter's samples add
    /// `_total`) and its type, whether or not it has samples yet.
    pub fn families(&self) -> impl Iterator<Item = (&str, MetricType)> {
        self.families
            .iter()
            .map(|(name, kind)| (name.as_str(), *kind))
    }

    /// Renders the registry in the Prometheus text format.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        // Writing into a String cannot fail; an error here would be a bug in the encoder.
        if prometheus_client::encoding::text::encode(&mut out, &self.registry).is_err() {
            out.clear();
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn encodes_rpc_latency_with_labels() {
        let metrics = Metrics::new();
        metrics.observe_rpc(
            "org.example.test",
            "NodePublishVolume",
            "OK",
            Duration::from_millis(2),
        );
        let text = metrics.encode();
        assert!(text.contains("csi_agent_rpc_duration_seconds_count{plugin=\"org.example.test\",method=\"NodePublishVolume\",code=\"OK\"} 1"), "{text}");
    }
}
