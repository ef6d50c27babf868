//! `csi-agentd probe <endpoint>`: describe a plugin as JSON, so an operator can check a plugin
//! before configuring it.

use std::time::Duration;

use anyhow::Context;
use csi_agent::client::{ClientOptions, CsiClient, parse_endpoint};

#[derive(Debug, clap::Args)]
pub struct ProbeArgs {
    /// The plugin's endpoint: `unix:///path/to/csi.sock` or `/path/to/csi.sock`.
    endpoint: String,
    /// Deadline of each RPC, in milliseconds.
    #[arg(long, default_value_t = 5000)]
    rpc_deadline_ms: u64,
}

pub async fn run(args: ProbeArgs) -> anyhow::Result<()> {
    let socket = parse_endpoint(&args.endpoint)?;
    let options = ClientOptions {
        rpc_deadline: Duration::from_millis(args.rpc_deadline_ms),
        ..ClientOptions::default()
    };
    let client = CsiClient::connect(&socket, options)
        .await
        .with_context(|| format!("cannot probe the plugin at {}", socket.display()))?;
    let description = client
        .describe()
        .await
        .with_context(|| format!("the plugin at {} did not describe itself", socket.display()))?;
    println!("{}", serde_json::to_string_pretty(&description)?);
    Ok(())
}
