//! The JSON contract of the csi-agent HTTP API (docs/api.md): request and response bodies,
//! the one error shape, and the route paths; and [`ApiClient`], a client for it over the unix
//! socket (or the TCP listener with a bearer token). `openapi.yaml` in this crate describes the
//! same contract and `tests/openapi.rs` keeps the two in step.
//!
//! This crate must not depend on the engine: the CLI links it alone, and the daemon converts
//! between these types and the engine's.

pub mod client;
mod error;
pub mod routes;
pub mod size;
pub mod time;
pub mod types;

pub use client::ApiClient;
pub use error::ApiError;
pub use types::*;
