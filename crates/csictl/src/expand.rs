//! `csictl expand PLUGIN VOLUME SIZE`: grows a volume through the daemon
//! (`POST /v1/volumes/{plugin}/{volume_id}/expand`), then prints the volume with its new
//! capacity.
//!
//! This module owns that subcommand's arguments and call. Like the rest of csictl it talks to
//! the daemon only through `csi_agent_api::ApiClient`; it must not decide anything about the
//! expansion (the daemon refuses what the plugin cannot do).

use clap::Args;
use csi_agent_api::ApiClient;

use crate::args::{OutputFormat, UsageError};
use crate::commands::render;
use crate::failure::Failure;
use crate::output;

/// `csictl expand`: `PLUGIN VOLUME_ID SIZE`, or `--plugin`/`--volume` with `SIZE`.
#[derive(Debug, Args)]
pub struct ExpandArgs {
    /// The plugin's type, e.g. org.example.lvm.
    #[arg(long = "plugin", value_name = "TYPE")]
    plugin_flag: Option<String>,
    /// The CSI volume id.
    #[arg(long = "volume", value_name = "VOLUME_ID")]
    volume_flag: Option<String>,
    /// [PLUGIN VOLUME_ID] SIZE: the size to grow to, in bytes or with a suffix k M G T P
    /// (powers of 1000) or Ki Mi Gi Ti Pi (powers of 1024): `16Mi`, `1Gi`.
    #[arg(value_name = "PLUGIN VOLUME_ID SIZE", num_args = 1..=3, required = true)]
    positional: Vec<String>,
}

impl ExpandArgs {
    /// The plugin type, the volume id and the size in bytes.
    pub fn resolve(&self) -> Result<(String, String, i64), UsageError> {
        let Some((size, rest)) = self.positional.split_last() else {
            return Err(UsageError(
                "no size given: add SIZE (e.g. 16Mi, 1Gi)".to_owned(),
            ));
        };
        let bytes = csi_agent_api::size::parse_size(size)
            .map_err(|err| UsageError(format!("SIZE {size:?}: {err} (e.g. 16Mi, 1Gi)")))?;
        let (plugin, volume) =
            crate::args::plugin_and_volume(&self.plugin_flag, &self.volume_flag, rest)?;
        match (plugin, volume) {
            (Some(plugin), Some(volume)) => Ok((plugin, volume, bytes)),
            (None, _) => Err(UsageError(
                "no plugin given: add --plugin TYPE (or PLUGIN VOLUME_ID SIZE)".to_owned(),
            )),
            (Some(_), None) => Err(UsageError(
                "no volume given: add --volume VOLUME_ID (or PLUGIN VOLUME_ID SIZE)".to_owned(),
            )),
        }
    }
}

/// `csictl expand …`
pub async fn run(
    client: &ApiClient,
    format: OutputFormat,
    args: &ExpandArgs,
) -> Result<String, Failure> {
    let (plugin, volume_id, bytes) = args.resolve()?;
    render(
        format,
        &client.expand_volume(&plugin, &volume_id, bytes).await?,
        output::volume,
    )
}
