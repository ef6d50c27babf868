//! `csi-testplugin-image`: writes the test plugin as a container for `./scripts/demo --oci`
//! (a root file system dir) and `--image` (an OCI image layout that skopeo pushes), with the
//! code the image tests use (`src/image.rs`), so that the demo runs what the tests test.
//!
//! Must not: run the plugin, start a registry or push (the demo script does, as the tests do
//! with skopeo); it only writes files beneath the dir it is given.

#[path = "../image.rs"]
mod image;

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "csi-testplugin-image", version)]
struct Args {
    /// The csi-testplugin binary to put in (default: the one beside this program).
    #[arg(long, global = true)]
    plugin: Option<PathBuf>,
    #[command(subcommand)]
    what: What,
}

#[derive(Subcommand)]
enum What {
    /// Unpacks the plugin's root file system (the binary, its libraries and loader) into DIR.
    Rootfs { dir: PathBuf },
    /// Writes the plugin's image as an OCI layout at DIR: Entrypoint /bin/csi-testplugin,
    /// the arguments after `--` as its Cmd.
    Layout {
        dir: PathBuf,
        /// An `Env` entry of the image (NAME=value); repeatable.
        #[arg(long = "env")]
        env: Vec<String>,
        /// The image's Cmd: the plugin's arguments.
        #[arg(last = true)]
        cmd: Vec<String>,
    },
}

fn run(args: Args) -> anyhow::Result<()> {
    let plugin = match args.plugin {
        Some(path) => path,
        None => std::env::current_exe()
            .context("finding this program's path")?
            .with_file_name("csi-testplugin"),
    };
    anyhow::ensure!(
        plugin.is_file(),
        "no csi-testplugin binary at {} (build it: cargo build -p csi-testplugin, or pass --plugin)",
        plugin.display()
    );
    match args.what {
        What::Rootfs { dir } => image::write_rootfs(&plugin, &dir),
        What::Layout { dir, env, cmd } => image::plugin_image(&dir, &plugin, &cmd, &env).map(drop),
    }
}

fn main() -> ExitCode {
    match run(Args::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("csi-testplugin-image: {e:#}");
            ExitCode::FAILURE
        }
    }
}
