//! One function per subcommand: turn the parsed arguments into an API request, call the
//! daemon, and render the answer.
//!
//! This module owns the mapping from subcommands to API calls. It talks to the daemon only
//! through `csi_agent_api::ApiClient` (csictl never links the engine) and returns the text to
//! print; it never prints itself and never puts a secret in its output.

use std::path::Path;

use csi_agent_api::*;
use serde::Serialize;

use crate::args::{self, Cli, Command, Global, OutputFormat};
use crate::failure::Failure;
use crate::output;

/// Runs the command; the text for stdout.
pub async fn run(cli: Cli) -> Result<String, Failure> {
    let client = client(&cli.global)?;
    let format = cli.global.output;
    match cli.command {
        Command::Health => render(format, &client.health().await?, output::health),
        Command::Start => render(format, &client.start().await?, output::start),
        // Prometheus text is already meant for programs; JSON would only wrap it.
        Command::Metrics => Ok(client.metrics().await?),
        Command::Plugins {
            plugin_flag,
            plugin_type,
        } => match plugin_flag.or(plugin_type) {
            None => render(format, &client.plugins().await?, output::plugins),
            Some(plugin_type) => {
                render(format, &client.plugin(&plugin_type).await?, output::plugin)
            }
        },
        Command::Reload => render(format, &client.reload().await?, output::reload),
        Command::Drain { wait } => {
            let report = client
                .drain_with(&DrainRequest { timeout_secs: wait })
                .await?;
            // `complete` is the daemon's word; a report that lists anything is never success.
            if report.complete && report.failed.is_empty() && report.left.is_empty() {
                render(format, &report, output::drain)
            } else {
                Err(Failure::Incomplete(output::drain(&report)))
            }
        }
        Command::Images => crate::image::images(&client, format).await,
        Command::Stats(volume) => crate::stats::stats(&client, format, &volume).await,
        Command::Image(command) => crate::image::run(&client, format, command).await,
        Command::Expand(args) => crate::expand::run(&client, format, &args).await,
        Command::Snapshot(command) => crate::snapshot::run(&client, format, command).await,
        Command::Cluster(command) => crate::cluster::run(&client, format, command).await,
        Command::Publish(args) => {
            let request = publish_request(&args)?;
            render(format, &client.publish(&request).await?, output::publish)
        }
        Command::Unpublish(args) => {
            let (plugin, volume_id) = args.volume.resolve()?;
            let request = UnpublishRequest {
                plugin,
                volume_id,
                workload: args.workload,
            };
            render(
                format,
                &client.unpublish(&request).await?,
                output::unpublish,
            )
        }
        Command::Volumes(args) => match args.one()? {
            Some((plugin, volume_id)) => render(
                format,
                &client.volume(&plugin, &volume_id).await?,
                output::volume,
            ),
            None => render(
                format,
                &client.volumes_matching(&args.query()?).await?,
                output::volumes,
            ),
        },
        Command::Create(args) => {
            let request = CreateVolumeRequest {
                capability: args.access_type.capability(&args.access_mode),
                plugin: args.plugin,
                name: args.name,
                capacity_bytes: args.capacity.unwrap_or(0),
                parameters: args::parse_pairs("--param", &args.params)?,
                accessibility_requirements: crate::topology::requirements(
                    &args.requisite,
                    &args.preferred,
                )?,
                content_source: (args.from_snapshot.is_some() || args.from_volume.is_some())
                    .then_some(csi_agent_api::ContentSource {
                        snapshot_id: args.from_snapshot,
                        volume_id: args.from_volume,
                    }),
            };
            render(
                format,
                &client.create_volume(&request).await?,
                output::created,
            )
        }
        Command::Delete(volume) => {
            let (plugin, volume_id) = volume.resolve()?;
            render(
                format,
                &client.delete_volume(&plugin, &volume_id).await?,
                output::deleted,
            )
        }
        Command::Validate(args) => {
            let (plugin, volume_id) = args.volume.resolve()?;
            let request = ValidateRequest {
                capabilities: args.capabilities(),
                volume_context: args::parse_pairs("--context", &args.context)?,
                parameters: args::parse_pairs("--param", &args.params)?,
                plugin,
                volume_id,
            };
            render(format, &client.validate(&request).await?, output::validated)
        }
        Command::BackendVolumes(args) => {
            let page = client
                .backend_volumes(
                    &args.plugin,
                    args.max_entries,
                    args.starting_token.as_deref(),
                )
                .await?;
            render(format, &page, |page| {
                output::backend_volumes(&args.plugin, page)
            })
        }
        Command::Capacity(args) => {
            let request = CapacityRequest {
                capabilities: args.capabilities(),
                parameters: args::parse_pairs("--param", &args.params)?,
                accessible_topology: args
                    .topology
                    .as_deref()
                    .map(|t| crate::topology::segments("--topology", t))
                    .transpose()?,
                plugin: args.plugin,
            };
            render(format, &client.capacity(&request).await?, output::capacity)
        }
    }
}

/// The client for `--url` (with its token) if given, else for `--socket`.
fn client(global: &Global) -> Result<ApiClient, Failure> {
    let client = match &global.url {
        Some(url) => {
            let token = match &global.token_file {
                Some(path) => Some(read_token(path)?),
                None => None,
            };
            ApiClient::tcp(url, token.as_deref())?
        }
        // The token, if any, is for TCP only: the socket's 0600 mode is its access control.
        None => ApiClient::unix(&global.socket),
    };
    Ok(client.with_timeout(global.timeout))
}

fn read_token(path: &Path) -> Result<String, Failure> {
    std::fs::read_to_string(path).map_err(|err| {
        Failure::Usage(format!(
            "cannot read --token-file {}: {err}",
            path.display()
        ))
    })
}

fn publish_request(args: &args::PublishArgs) -> Result<PublishRequest, Failure> {
    let volume_context = if args.context.is_empty() {
        // Absent, not empty: the daemon then uses the context from CreateVolume.
        None
    } else {
        Some(args::parse_pairs("--context", &args.context)?)
    };
    let mut secrets = match &args.secrets_file {
        Some(path) => read_secrets_file(path)?,
        None => SecretsSpec::default(),
    };
    merge_secrets(
        "--stage-secret",
        &mut secrets.node_stage,
        args::parse_secret_pairs("--stage-secret", &args.stage_secrets)?,
    )?;
    merge_secrets(
        "--publish-secret",
        &mut secrets.node_publish,
        args::parse_secret_pairs("--publish-secret", &args.publish_secrets)?,
    )?;
    let secrets =
        (!secrets.node_stage.is_empty() || !secrets.node_publish.is_empty()).then_some(secrets);
    let (plugin, volume_id) = args.volume.resolve()?;
    Ok(PublishRequest {
        plugin,
        volume_id,
        workload: args.workload.clone(),
        capability: args.access_type.capability(&args.access_mode),
        readonly: args.readonly,
        volume_context,
        secrets,
        bind_to: args.bind_to.clone(),
    })
}

fn merge_secrets(
    flag: &str,
    into: &mut std::collections::BTreeMap<String, String>,
    from: std::collections::BTreeMap<String, String>,
) -> Result<(), Failure> {
    for (key, value) in from {
        if into.insert(key.clone(), value).is_some() {
            return Err(Failure::Usage(format!(
                "{flag} gives the key '{key}', which --secrets-file already has"
            )));
        }
    }
    Ok(())
}

/// Reads `{"node_stage": {..}, "node_publish": {..}}`. serde_json's messages name the line and
/// column, never the values, so they are safe to show.
fn read_secrets_file(path: &Path) -> Result<SecretsSpec, Failure> {
    let text = std::fs::read_to_string(path).map_err(|err| {
        Failure::Usage(format!(
            "cannot read --secrets-file {}: {err}",
            path.display()
        ))
    })?;
    serde_json::from_str(&text).map_err(|err| {
        Failure::Usage(format!(
            "--secrets-file {} is not {{\"node_stage\": {{..}}, \"node_publish\": {{..}}}} with \
             string values: {}",
            path.display(),
            redact_serde_message(&err)
        ))
    })
}

/// serde_json quotes the offending value in some messages ("invalid type: integer `5`"); keep
/// the position and the category only.
fn redact_serde_message(err: &serde_json::Error) -> String {
    format!(
        "{:?} error at line {} column {}",
        err.classify(),
        err.line(),
        err.column()
    )
    .to_lowercase()
}

pub(crate) fn render<T: Serialize>(
    format: OutputFormat,
    value: &T,
    table: impl FnOnce(&T) -> String,
) -> Result<String, Failure> {
    match format {
        OutputFormat::Table => Ok(table(value)),
        OutputFormat::Json => output::json(value)
            .map_err(|err| Failure::Output(format!("cannot print the answer as JSON: {err}"))),
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    type TestResult<T = ()> = Result<T, Box<dyn std::error::Error>>;

    fn publish_args(args: &[&str]) -> TestResult<args::PublishArgs> {
        let cli = Cli::try_parse_from(
            ["csictl", "publish", "--plugin", "p", "--volume", "v"]
                .into_iter()
                .chain(args.iter().copied()),
        )?;
        match cli.command {
            Command::Publish(args) => Ok(args),
            other => Err(format!("parsed as {other:?}").into()),
        }
    }

    #[test]
    fn publish_without_context_sends_none() -> TestResult {
        let request = publish_request(&publish_args(&[])?).map_err(|e| e.to_string())?;
        assert_eq!(request.volume_context, None);
        assert_eq!(request.secrets, None);
        assert_eq!(request.workload, "default");
        Ok(())
    }

    #[test]
    fn publish_secrets_and_context() -> TestResult {
        let request = publish_request(&publish_args(&[
            "--context",
            "a=b",
            "--stage-secret",
            "user=u",
            "--publish-secret",
            "pass=p",
        ])?)
        .map_err(|e| e.to_string())?;
        assert_eq!(
            request.volume_context,
            Some([("a".to_owned(), "b".to_owned())].into())
        );
        let secrets = request.secrets.ok_or("no secrets")?;
        assert_eq!(
            secrets.node_stage.get("user").map(String::as_str),
            Some("u")
        );
        assert_eq!(
            secrets.node_publish.get("pass").map(String::as_str),
            Some("p")
        );
        Ok(())
    }

    #[test]
    fn bad_context_is_a_usage_error() -> TestResult {
        let Err(err) = publish_request(&publish_args(&["--context", "x"])?) else {
            return Err("accepted".into());
        };
        assert_eq!(err.to_string(), "--context expects KEY=VALUE, got 'x'");
        assert_eq!(err.exit_code(), 2);
        Ok(())
    }

    #[test]
    fn secrets_file_is_merged_and_errors_hide_values() -> Result<(), Box<dyn std::error::Error>> {
        let dir = tempfile::tempdir()?;
        let path = dir.path().join("secrets.json");
        std::fs::write(&path, r#"{"node_stage": {"user": "u"}}"#)?;
        let file = path.to_string_lossy().into_owned();
        let request = publish_request(&publish_args(&[
            "--secrets-file",
            &file,
            "--publish-secret",
            "pass=p",
        ])?)
        .map_err(|e| e.to_string())?;
        let secrets = request.secrets.ok_or("no secrets")?;
        assert_eq!(secrets.node_stage.len(), 1);
        assert_eq!(secrets.node_publish.len(), 1);

        let Err(err) = publish_request(&publish_args(&[
            "--secrets-file",
            &file,
            "--stage-secret",
            "user=hunter2",
        ])?) else {
            return Err("duplicate accepted".into());
        };
        assert!(err.to_string().contains("'user'"), "{err}");
        assert!(!err.to_string().contains("hunter2"), "{err}");

        std::fs::write(&path, r#"{"node_stage": {"user": 12345678}}"#)?;
        let Err(err) = publish_request(&publish_args(&["--secrets-file", &file])?) else {
            return Err("bad file accepted".into());
        };
        assert!(!err.to_string().contains("12345678"), "{err}");
        assert_eq!(err.exit_code(), 2);
        Ok(())
    }
}
