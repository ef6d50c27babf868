//! csi-agent engine: the node side of the Container Storage Interface.
//!
//! This crate owns all behaviour: plugin configuration, supervision of plugin components
//! (service manager and runtimes), the version-neutral CSI client, the durable volume state
//! machine and its store, recovery, mounts and metrics. It must not parse command lines nor
//! format API responses: that is the daemon's job (`csi-agentd`).

pub mod backoff;
pub mod beneath;
pub mod binaries;
pub mod bootid;
pub mod client;
pub mod cluster;
pub mod config;
pub mod durable;
pub mod endpoints;
pub mod failpoint;
pub mod fetch;
pub mod image;
pub mod layout;
pub mod logs;
pub mod metrics;
pub mod mounts;
pub mod named;
pub mod runtime;
pub mod secrets;
pub mod server;
pub mod service_manager;
pub mod stats;
pub mod store;
pub mod sys;
pub mod volume;
pub mod workdir;
