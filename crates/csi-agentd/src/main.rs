//! `csi-agentd`: the csi-agent daemon binary. It parses the command line, calls the engine
//! (`csi_agent`) and formats what comes back; behaviour lives in the engine.

mod api;
mod convert;
mod listener;
mod probe;
mod serve;
mod volume_list;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

#[derive(Debug, Parser)]
#[command(
    name = "csi-agentd",
    version,
    about = "The csi-agent daemon: the node side of CSI"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run the daemon: supervise plugins and serve the HTTP/JSON API.
    Serve(Box<serve::ServeArgs>),
    /// Connect to a CSI plugin endpoint and print, as JSON, its CSI version, name, vendor
    /// version and capabilities.
    Probe(probe::ProbeArgs),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Serve(args) => serve::settings(*args).and_then(|settings| {
            let runtime = runtime(settings.worker_threads.get())?;
            serve::init_logging(settings.log_format);
            runtime.block_on(serve::run(settings))
        }),
        Command::Probe(args) => runtime(1).and_then(|runtime| runtime.block_on(probe::run(args))),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("csi-agentd: {err:#}");
            ExitCode::FAILURE
        }
    }
}

/// The async runtime: `workers` threads for async tasks (the multi-thread flavour even with
/// one, so that `csi_agent::sys::blocking` can hand a worker's tasks to a fresh thread while a
/// system call blocks), plus tokio's pool for blocking work.
fn runtime(workers: usize) -> anyhow::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(workers)
        .enable_all()
        .build()
        .map_err(|err| anyhow::anyhow!("cannot start the async runtime: {err}"))
}
