//! `csi-agentd`: the csi-agent daemon binary. It parses the command line, calls the engine
//! (`csi_agent`) and formats what comes back; behaviour lives in the engine.

mod api;
mod cluster_flags;
mod convert;
mod listener;
mod probe;
mod serve;
mod volume_list;
mod volume_plugin;

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

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use std::collections::BTreeSet;

    use clap::CommandFactory;

    use super::Cli;

    /// The `--flags` of one subcommand, as clap knows them (hidden ones too; not `--help`).
    fn flags(subcommand: &str) -> BTreeSet<String> {
        let cli = Cli::command();
        let command = cli
            .find_subcommand(subcommand)
            .unwrap_or_else(|| panic!("no subcommand {subcommand}"));
        command
            .get_arguments()
            .filter_map(|arg| arg.get_long())
            .filter(|long| *long != "help")
            .map(|long| format!("--{long}"))
            .collect()
    }

    /// The flags of the table rows (`| \`--flag …\` | …`) of one `## ` section of
    /// docs/configuration.md.
    fn documented(section_title: &str) -> BTreeSet<String> {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs/configuration.md");
        let doc = std::fs::read_to_string(path).unwrap();
        let section = doc
            .split("\n## ")
            .find(|s| s.starts_with(section_title))
            .unwrap_or_else(|| panic!("docs/configuration.md has no `## {section_title}`"));
        section
            .lines()
            .filter_map(|line| line.strip_prefix("| `--"))
            .map(|rest| {
                let name: String = rest
                    .chars()
                    .take_while(|c| c.is_ascii_alphanumeric() || *c == '-')
                    .collect();
                format!("--{name}")
            })
            .collect()
    }

    /// Every flag of `csi-agentd serve` and `csi-agentd probe` has its row in
    /// docs/configuration.md, and every row there names a flag that exists.
    #[test]
    fn every_flag_has_a_row_in_configuration_md_and_every_row_a_flag() {
        for (subcommand, section) in [
            ("serve", "Daemon flags (`csi-agentd serve`)"),
            ("probe", "Probing a plugin (`csi-agentd probe`)"),
        ] {
            let real = flags(subcommand);
            let rows = documented(section);
            assert!(!real.is_empty(), "{subcommand}: no flags found");
            let missing: Vec<_> = real.difference(&rows).collect();
            let stale: Vec<_> = rows.difference(&real).collect();
            assert!(
                missing.is_empty(),
                "flags of `csi-agentd {subcommand}` without a row in docs/configuration.md \
                 (`## {section}`): {missing:?}; add `| --flag | default | meaning |` for each"
            );
            assert!(
                stale.is_empty(),
                "rows of docs/configuration.md (`## {section}`) naming no flag of \
                 `csi-agentd {subcommand}`: {stale:?}; remove them or fix the name"
            );
        }
    }
}
