//! CPU time of the processes in a measured phase: where an operation's CPU goes (the
//! benchmark's own client, the daemon, the plugin) and how busy the machine was.
//!
//! A process's CPU time is the sum of its threads' time on a CPU, in nanoseconds, from
//! `/proc/<pid>/task/*/schedstat` (the first field; `/proc/<pid>/stat` only has clock ticks,
//! 10 ms each, too coarse for a phase of a few hundred milliseconds). A thread that exits
//! during a phase takes its time with it, so the figure is a lower bound; the processes
//! measured here keep their threads for the whole run (tokio workers, the store's writer).
//! The machine's busy fraction comes from the first line of `/proc/stat` (clock ticks).
//!
//! Reading `/proc` is best effort: a figure that cannot be read is reported as zero and the
//! benchmark goes on; these are diagnostics beside the measured rates, never a pass/fail.

use std::time::Duration;

use serde::Serialize;

use crate::stats::median_by;

/// CPU time of one process so far, and how many times its threads were switched in: the
/// sums over its live threads.
pub fn process_cpu(pid: u32) -> (Duration, u64) {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return (Duration::ZERO, 0);
    };
    let (mut total_ns, mut runs) = (0u64, 0u64);
    for task in tasks.flatten() {
        let Ok(text) = std::fs::read_to_string(task.path().join("schedstat")) else {
            continue;
        };
        // Fields: time on a CPU (ns), time waiting on a run queue (ns), times run.
        let fields: Vec<u64> = text
            .split_whitespace()
            .filter_map(|f| f.parse().ok())
            .collect();
        if let [ns, _, slices] = fields[..] {
            total_ns = total_ns.saturating_add(ns);
            runs = runs.saturating_add(slices);
        }
    }
    (Duration::from_nanos(total_ns), runs)
}

/// Busy and total clock ticks of all CPUs so far (`/proc/stat`, line `cpu`).
fn machine_ticks() -> (u64, u64) {
    let Ok(text) = std::fs::read_to_string("/proc/stat") else {
        return (0, 0);
    };
    let Some(line) = text.lines().find(|l| l.starts_with("cpu ")) else {
        return (0, 0);
    };
    // user nice system idle iowait irq softirq steal (guest time is already in user).
    let fields: Vec<u64> = line
        .split_whitespace()
        .skip(1)
        .take(8)
        .filter_map(|f| f.parse().ok())
        .collect();
    let total: u64 = fields.iter().sum();
    let idle = fields.get(3).copied().unwrap_or(0) + fields.get(4).copied().unwrap_or(0);
    (total.saturating_sub(idle), total)
}

/// The processes watched in a phase.
#[derive(Clone, Copy, Debug)]
pub struct Watched {
    pub daemon: u32,
    pub plugin: u32,
}

/// A reading of every watched process and of the machine.
#[derive(Clone, Copy, Debug)]
pub struct Sample {
    client: (Duration, u64),
    daemon: (Duration, u64),
    plugin: (Duration, u64),
    machine: (u64, u64),
}

impl Sample {
    pub fn take(watched: Watched) -> Self {
        Self {
            client: process_cpu(std::process::id()),
            daemon: process_cpu(watched.daemon),
            plugin: process_cpu(watched.plugin),
            machine: machine_ticks(),
        }
    }

    /// CPU per operation between `earlier` and this sample.
    pub fn per_op_since(&self, earlier: &Sample, ops: usize) -> CpuPerOp {
        let ops = ops.max(1) as f64;
        let us = |now: (Duration, u64), then: (Duration, u64)| {
            now.0.saturating_sub(then.0).as_secs_f64() * 1e6 / ops
        };
        let runs =
            |now: (Duration, u64), then: (Duration, u64)| now.1.saturating_sub(then.1) as f64 / ops;
        let busy = self.machine.0.saturating_sub(earlier.machine.0);
        let total = self.machine.1.saturating_sub(earlier.machine.1);
        CpuPerOp {
            client_us: us(self.client, earlier.client),
            daemon_us: us(self.daemon, earlier.daemon),
            plugin_us: us(self.plugin, earlier.plugin),
            client_runs: runs(self.client, earlier.client),
            daemon_runs: runs(self.daemon, earlier.daemon),
            plugin_runs: runs(self.plugin, earlier.plugin),
            machine_busy: if total > 0 {
                busy as f64 / total as f64
            } else {
                0.0
            },
        }
    }
}

/// CPU time per operation, in microseconds, by process; and the machine's busy fraction
/// (1.0: every CPU busy for the whole phase).
#[derive(Clone, Copy, Debug, Default, Serialize)]
pub struct CpuPerOp {
    /// The benchmark process: the raw client's RPCs, the in-process engine, or the HTTP
    /// client of the daemon contender.
    pub client_us: f64,
    pub daemon_us: f64,
    pub plugin_us: f64,
    /// Times a thread of the process was switched in, per operation: its wake-ups.
    pub client_runs: f64,
    pub daemon_runs: f64,
    pub plugin_runs: f64,
    pub machine_busy: f64,
}

impl CpuPerOp {
    pub fn total_us(&self) -> f64 {
        self.client_us + self.daemon_us + self.plugin_us
    }

    /// The element-wise median of `samples` (each field on its own).
    pub fn median(samples: &[CpuPerOp]) -> CpuPerOp {
        let field = |get: fn(&CpuPerOp) -> f64| median_by(samples.iter().map(get), f64::total_cmp);
        CpuPerOp {
            client_us: field(|c| c.client_us),
            daemon_us: field(|c| c.daemon_us),
            plugin_us: field(|c| c.plugin_us),
            client_runs: field(|c| c.client_runs),
            daemon_runs: field(|c| c.daemon_runs),
            plugin_runs: field(|c| c.plugin_runs),
            machine_busy: field(|c| c.machine_busy),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn own_cpu_time_grows_while_spinning() {
        use rustix::time::{ClockId, clock_gettime};
        let thread_cpu =
            || Duration::try_from(clock_gettime(ClockId::ThreadCPUTime)).unwrap_or_default();
        let (before, _) = process_cpu(std::process::id());
        // Spin for 30 ms of this thread's own CPU time (not wall time: the machine may be
        // busy with other tests).
        let start = thread_cpu();
        let mut x: u64 = 0;
        while thread_cpu().saturating_sub(start) < Duration::from_millis(30) {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1);
        }
        std::hint::black_box(x);
        let spent = process_cpu(std::process::id()).0.saturating_sub(before);
        // schedstat of a running thread lags by up to a scheduler tick.
        assert!(spent >= Duration::from_millis(20), "spent {spent:?}");
    }

    #[test]
    fn a_vanished_process_reads_zero() {
        assert_eq!(process_cpu(u32::MAX), (Duration::ZERO, 0));
    }

    #[test]
    fn medians_are_taken_per_field() {
        let s = |c, d| CpuPerOp {
            client_us: c,
            daemon_us: d,
            plugin_us: 1.0,
            machine_busy: 0.5,
            ..CpuPerOp::default()
        };
        let m = CpuPerOp::median(&[s(1.0, 30.0), s(3.0, 10.0), s(2.0, 20.0)]);
        assert_eq!((m.client_us, m.daemon_us), (2.0, 20.0));
    }
}
