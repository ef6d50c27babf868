//! `csi-testplugin`: a real CSI plugin for tests, demos and benchmarks.
//!
//! This file only parses flags, sets up logging and runs the server; it must
//! not hold behaviour. The modules: `cli` (flags), `server` (socket, router,
//! signals), `v1`/`v0` (protocol adapters), `plugin` (the version-neutral
//! core), `rpc` (faults, in-flight tracking and call log around every RPC),
//! `state` (durable bookkeeping), `faults`, `calllog`, `mounts`, `model`.

mod backend;
mod backing;
mod block;
mod calllog;
mod cli;
mod faults;
mod model;
mod mounts;
mod plugin;
mod rpc;
mod server;
mod state;
mod stats;
mod topology;
mod v0;
mod v1;

use clap::Parser;
use tracing_subscriber::EnvFilter;

fn main() -> std::process::ExitCode {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info")),
        )
        .init();
    let args = cli::Args::parse();
    let result = args.into_config().and_then(|cfg| {
        tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .build()?
            .block_on(server::serve(cfg))
    });
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!("{e:#}");
            eprintln!("csi-testplugin: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
