//! The daemon-level tests that share one test binary: each module was a test binary of its
//! own, and each of those linked the whole engine again (issue #25). Run as root under
//! `unshare -m --propagation private` (`scripts/test` does); one module with
//! `cargo test -p csi-agentd --test daemon MODULE::`.
//!
//! Only modules without process-wide state belong here: no environment variable set, no
//! rlimit changed, no signal handler, no static shared between tests, nothing that counts
//! processes or mounts outside its own temp dir. Separate binaries, and why:
//! `api_abuse` (raises the open-file limit, floods the listeners against time limits),
//! `oci_runtime` (a process-wide `OnceLock` hiding runtimes; CI names `--test oci_runtime`),
//! `crash_matrix`, `soak` and `shared_binds` (long, named by the docs and run alone),
//! `bounded_state` (long), and the `image_*` tests (runc containers, registries, busybox).
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod api_conformance;
mod bind_safety;
mod block;
mod cluster_off;
mod drain;
mod drain_barrier;
mod e2e;
mod error_snapshots;
mod expand;
mod fuzz_props;
mod hostile_ids;
mod hostile_plugin;
mod hostile_records;
mod mesos_configs;
mod mesos_fetcher;
mod mesos_isolation;
mod plugin_start;
mod probe;
mod readme;
mod reads;
mod reload;
mod reload_race;
mod snapshots;
mod startup;
mod stats;
mod topology;
mod volume_plugin;
