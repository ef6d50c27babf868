//! Summaries of latency samples (milliseconds) and Prometheus text parsing.

use std::time::Duration;

use serde::Serialize;

/// Mean and percentiles of a set of samples, in milliseconds.
#[derive(Clone, Copy, Debug, Default, Serialize)]
pub struct Summary {
    pub n: usize,
    pub mean_ms: f64,
    pub p50_ms: f64,
    pub p90_ms: f64,
    pub p99_ms: f64,
    pub min_ms: f64,
    pub max_ms: f64,
}

impl Summary {
    pub fn of(samples: &[Duration]) -> Self {
        if samples.is_empty() {
            return Self::default();
        }
        let mut ms: Vec<f64> = samples.iter().map(|d| d.as_secs_f64() * 1e3).collect();
        ms.sort_by(f64::total_cmp);
        let n = ms.len();
        let mean = ms.iter().sum::<f64>() / n as f64;
        Self {
            n,
            mean_ms: mean,
            p50_ms: percentile(&ms, 50.0),
            p90_ms: percentile(&ms, 90.0),
            p99_ms: percentile(&ms, 99.0),
            min_ms: ms[0],
            max_ms: ms[n - 1],
        }
    }
}

/// The median of a set of rounds: the middle value once sorted by `order` (the upper one of
/// two), or the default of none. Every median of a round's figures goes through it.
pub fn median_by<T: Copy + Default>(
    values: impl IntoIterator<Item = T>,
    order: impl FnMut(&T, &T) -> std::cmp::Ordering,
) -> T {
    let mut sorted: Vec<T> = values.into_iter().collect();
    sorted.sort_by(order);
    sorted.get(sorted.len() / 2).copied().unwrap_or_default()
}

/// Nearest-rank percentile of sorted values.
fn percentile(sorted: &[f64], p: f64) -> f64 {
    let n = sorted.len();
    let rank = ((p / 100.0) * n as f64).ceil() as usize;
    sorted[rank.clamp(1, n) - 1]
}

/// The value of one sample in a Prometheus/OpenMetrics text exposition: the line of metric
/// `name` whose labels include every pair of `labels`. Values of several matching lines are
/// added up.
pub fn metric(text: &str, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    let mut total = None;
    for line in text.lines() {
        let Some(rest) = line.strip_prefix(name) else {
            continue;
        };
        let (label_text, value_text) = if let Some(inner) = rest.strip_prefix('{') {
            match inner.split_once('}') {
                Some((l, v)) => (l, v),
                None => continue,
            }
        } else if rest.starts_with(' ') {
            ("", rest)
        } else {
            // Another metric whose name starts with `name`.
            continue;
        };
        let matches = labels
            .iter()
            .all(|(k, v)| label_text.contains(&format!("{k}=\"{v}\"")));
        if !matches {
            continue;
        }
        if let Some(value) = value_text
            .split_whitespace()
            .next()
            .and_then(|v| v.parse::<f64>().ok())
        {
            *total.get_or_insert(0.0) += value;
        }
    }
    total
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn medians_take_the_middle_or_the_upper_of_two() {
        assert_eq!(median_by([3, 1, 2], Ord::cmp), 2);
        assert_eq!(median_by([4.0, 1.0, 3.0, 2.0], f64::total_cmp), 3.0);
        assert_eq!(median_by(Vec::<u32>::new(), Ord::cmp), 0);
    }

    #[test]
    fn percentiles() {
        let samples: Vec<Duration> = (1..=100).map(Duration::from_millis).collect();
        let s = Summary::of(&samples);
        assert_eq!(s.n, 100);
        assert!((s.mean_ms - 50.5).abs() < 1e-9);
        assert!((s.p50_ms - 50.0).abs() < 1e-9);
        assert!((s.p90_ms - 90.0).abs() < 1e-9);
        assert!((s.p99_ms - 99.0).abs() < 1e-9);
        assert!((s.max_ms - 100.0).abs() < 1e-9);
    }

    #[test]
    fn parses_metrics() {
        let text = "# TYPE csi_agent_checkpoint_writes counter\n\
                    csi_agent_checkpoint_writes_total 42\n\
                    csi_agent_checkpoint_fsync_seconds_sum 0.5\n\
                    csi_agent_operation_duration_seconds_sum{operation=\"publish\",outcome=\"ok\"} 1.5\n\
                    csi_agent_operation_duration_seconds_sum{operation=\"unpublish\",outcome=\"ok\"} 2.5\n";
        assert_eq!(
            metric(text, "csi_agent_checkpoint_writes_total", &[]),
            Some(42.0)
        );
        assert_eq!(
            metric(text, "csi_agent_checkpoint_fsync_seconds_sum", &[]),
            Some(0.5)
        );
        assert_eq!(
            metric(
                text,
                "csi_agent_operation_duration_seconds_sum",
                &[("operation", "unpublish")]
            ),
            Some(2.5)
        );
        assert_eq!(metric(text, "csi_agent_checkpoint_writes", &[]), None);
    }
}
