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
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(runtime) => runtime,
        Err(err) => {
            eprintln!("csi-agentd: cannot start the async runtime: {err}");
            return ExitCode::FAILURE;
        }
    };
    let result = runtime.block_on(async {
        match cli.command {
            Command::Serve(args) => match serve::settings(*args) {
                Ok(settings) => {
                    serve::init_logging(settings.log_format);
                    serve::run(settings).await
                }
                Err(err) => Err(err),
            },
            Command::Probe(args) => probe::run(args).await,
        }
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("csi-agentd: {err:#}");
            ExitCode::FAILURE
        }
    }
}
