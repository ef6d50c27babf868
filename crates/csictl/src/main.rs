//! `csictl`: the command-line client of csi-agentd's API. `main` only parses, runs one command
//! and prints; the subcommands live in `commands`, their arguments in `args`, the rendering in
//! `output`, and exit statuses and hints in `failure`.
//!
//! csictl talks to the daemon through `csi-agent-api` only: it must never link the engine.

mod args;
mod cluster;
mod commands;
mod expand;
mod failure;
mod image;
mod output;
mod snapshot;
mod stats;
mod topology;

use std::io::Write;
use std::process::ExitCode;

use clap::Parser;

fn main() -> ExitCode {
    // clap prints usage errors itself and exits 2; --help and --version exit 0.
    let cli = args::Cli::parse();
    let json_errors = cli.global.output == args::OutputFormat::Json;
    // One request at a time: a current-thread runtime is all csictl needs.
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(err) => {
            eprintln!("csictl: cannot start the async runtime: {err}");
            return ExitCode::from(failure::EXIT_API);
        }
    };
    match runtime.block_on(commands::run(cli)) {
        Ok(text) => {
            let mut stdout = std::io::stdout().lock();
            match stdout
                .write_all(text.as_bytes())
                .and_then(|()| stdout.flush())
            {
                Ok(()) => ExitCode::SUCCESS,
                // `csictl volumes | head`: the reader is gone, which is not an error of ours.
                Err(err) if err.kind() == std::io::ErrorKind::BrokenPipe => ExitCode::SUCCESS,
                Err(err) => {
                    eprintln!("csictl: cannot write the answer: {err}");
                    ExitCode::from(failure::EXIT_API)
                }
            }
        }
        Err(failure) => {
            if json_errors {
                eprintln!("{}", failure.to_json());
            } else {
                eprintln!("csictl: {failure}");
                if let Some(hint) = failure.hint() {
                    eprintln!("hint: {hint}");
                }
            }
            ExitCode::from(failure.exit_code())
        }
    }
}
