//! A thin, typed wrapper around the `runc` command line (`crun` takes the same commands and
//! flags). Every call is bounded in time and its failure keeps runc's own message.
//!
//! It owns nothing but the command lines: no bundle, no supervision. All containers live
//! under one state root (`runc --root`), so that csi-agent's containers are never mixed with
//! anyone else's and `runc --root <root> list` shows exactly them.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use serde::Deserialize;
use tokio::process::Command;

/// How long a quick runc command (`state`, `kill`, `delete`, `list`, `start`) may take.
pub const QUICK_TIMEOUT: Duration = Duration::from_secs(15);
/// How long `runc create` may take (it sets up namespaces, mounts and cgroups).
pub const CREATE_TIMEOUT: Duration = Duration::from_secs(60);

#[derive(Debug, thiserror::Error)]
pub enum RuncError {
    #[error(
        "cannot run the OCI runtime `{}` (the daemon's --oci-runtime; is runc installed?): {source}",
        binary.display()
    )]
    Missing {
        binary: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("`{command}` failed ({status}): {message}")]
    Failed {
        command: String,
        status: String,
        message: String,
    },
    #[error("`{command}` did not finish within {} ms", after.as_millis())]
    Timeout { command: String, after: Duration },
    #[error("`{command}` printed something that is not the expected JSON: {source}")]
    Output {
        command: String,
        #[source]
        source: serde_json::Error,
    },
    #[error("cannot open {}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// What `runc state` and `runc list --format json` say of one container.
#[derive(Clone, Debug, Deserialize, PartialEq, Eq)]
pub struct ContainerState {
    pub id: String,
    /// The container's init process (0 once stopped, for some runtimes).
    #[serde(default)]
    pub pid: i32,
    /// `creating`, `created`, `running`, `paused` or `stopped`.
    pub status: String,
    #[serde(default)]
    pub bundle: PathBuf,
}

/// One OCI runtime binary and its state root.
#[derive(Clone, Debug)]
pub struct Runc {
    binary: PathBuf,
    root: PathBuf,
}

impl Runc {
    pub fn new(binary: impl Into<PathBuf>, root: impl Into<PathBuf>) -> Self {
        Self {
            binary: binary.into(),
            root: root.into(),
        }
    }

    pub fn binary(&self) -> &Path {
        &self.binary
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    fn command(&self, args: &[OsString]) -> (Command, String) {
        let mut command = Command::new(&self.binary);
        command.arg("--root").arg(&self.root).args(args);
        // Never left running if we give up on it (timeouts).
        command.kill_on_drop(true).stdin(Stdio::null());
        let text = std::iter::once(self.binary.display().to_string())
            .chain(["--root".to_owned(), self.root.display().to_string()])
            .chain(args.iter().map(|a| a.to_string_lossy().into_owned()))
            .collect::<Vec<_>>()
            .join(" ");
        (command, text)
    }

    /// Runs a quick command, returning its stdout.
    async fn run(&self, args: &[OsString]) -> Result<Vec<u8>, RuncError> {
        let (mut command, text) = self.command(args);
        command.stdout(Stdio::piped()).stderr(Stdio::piped());
        let output = match tokio::time::timeout(QUICK_TIMEOUT, command.output()).await {
            Err(_) => {
                return Err(RuncError::Timeout {
                    command: text,
                    after: QUICK_TIMEOUT,
                });
            }
            Ok(Err(source)) => {
                return Err(RuncError::Missing {
                    binary: self.binary.clone(),
                    source,
                });
            }
            Ok(Ok(output)) => output,
        };
        if output.status.success() {
            Ok(output.stdout)
        } else {
            Err(RuncError::Failed {
                command: text,
                status: output.status.to_string(),
                message: runc_message(&output.stderr),
            })
        }
    }

    /// `runc create`: sets the container up (namespaces, mounts, cgroup) with its init
    /// waiting to exec the process. The container inherits `stdout` and `stderr` (runc's
    /// "pass-through" mode), so they must be files, never pipes we would wait on. runc's own
    /// log goes to `log`, where a failure's reason is read back from.
    pub async fn create(
        &self,
        id: &str,
        bundle: &Path,
        pid_file: &Path,
        log: &Path,
        stdout: std::fs::File,
        stderr: std::fs::File,
    ) -> Result<(), RuncError> {
        let args: Vec<OsString> = vec![
            "--log".into(),
            log.into(),
            "--log-format".into(),
            "json".into(),
            "create".into(),
            "--bundle".into(),
            bundle.into(),
            "--pid-file".into(),
            pid_file.into(),
            id.into(),
        ];
        let (mut command, text) = self.command(&args);
        // Its own process group: a Ctrl-C or a signal to the daemon's group must not reach
        // the container's init, which inherits the group.
        command
            .stdout(Stdio::from(stdout))
            .stderr(Stdio::from(stderr))
            .process_group(0);
        let mut child = command.spawn().map_err(|source| RuncError::Missing {
            binary: self.binary.clone(),
            source,
        })?;
        let status = match tokio::time::timeout(CREATE_TIMEOUT, child.wait()).await {
            Err(_) => {
                let _ = child.kill().await;
                return Err(RuncError::Timeout {
                    command: text,
                    after: CREATE_TIMEOUT,
                });
            }
            Ok(Err(source)) => {
                return Err(RuncError::Io {
                    path: self.binary.clone(),
                    source,
                });
            }
            Ok(Ok(status)) => status,
        };
        if status.success() {
            return Ok(());
        }
        let message = std::fs::read(log)
            .map(|bytes| runc_message(&bytes))
            .unwrap_or_else(|err| format!("(no runc log at {}: {err})", log.display()));
        Err(RuncError::Failed {
            command: text,
            status: status.to_string(),
            message,
        })
    }

    /// `runc start`: execs the process of a created container.
    pub async fn start(&self, id: &str) -> Result<(), RuncError> {
        self.run(&["start".into(), id.into()]).await.map(|_| ())
    }

    /// `runc state`; `Ok(None)` when the runtime knows no such container.
    pub async fn state(&self, id: &str) -> Result<Option<ContainerState>, RuncError> {
        match self.run(&["state".into(), id.into()]).await {
            Ok(stdout) => {
                serde_json::from_slice(&stdout)
                    .map(Some)
                    .map_err(|source| RuncError::Output {
                        command: format!("runc state {id}"),
                        source,
                    })
            }
            Err(err @ RuncError::Failed { .. }) => {
                // runc and crun word "no such container" differently: ask the list, which
                // both answer the same way.
                if self.list().await?.iter().any(|c| c.id == id) {
                    Err(err)
                } else {
                    Ok(None)
                }
            }
            Err(err) => Err(err),
        }
    }

    /// `runc list --format json`: every container under the root.
    pub async fn list(&self) -> Result<Vec<ContainerState>, RuncError> {
        let stdout = self
            .run(&["list".into(), "--format".into(), "json".into()])
            .await?;
        // runc prints `null` for an empty list.
        let parsed: Option<Vec<ContainerState>> =
            serde_json::from_slice(&stdout).map_err(|source| RuncError::Output {
                command: "runc list --format json".to_owned(),
                source,
            })?;
        Ok(parsed.unwrap_or_default())
    }

    /// `runc kill [--all] <id> <signal>`.
    pub async fn kill(&self, id: &str, signal: &str, all: bool) -> Result<(), RuncError> {
        let mut args: Vec<OsString> = vec!["kill".into()];
        if all {
            args.push("--all".into());
        }
        args.push(id.into());
        args.push(signal.into());
        self.run(&args).await.map(|_| ())
    }

    /// `runc delete --force <id>`: kills what is left, removes the state and the cgroup.
    /// A container that does not exist is deleted already.
    pub async fn delete(&self, id: &str) -> Result<(), RuncError> {
        match self
            .run(&["delete".into(), "--force".into(), id.into()])
            .await
        {
            Ok(_) => Ok(()),
            Err(err @ RuncError::Failed { .. }) => {
                if self.list().await?.iter().any(|c| c.id == id) {
                    Err(err)
                } else {
                    Ok(())
                }
            }
            Err(err) => Err(err),
        }
    }
}

/// The useful part of runc's output: the `msg` of its JSON log lines at level error (or
/// the plain text when it is not JSON), bounded in length.
fn runc_message(bytes: &[u8]) -> String {
    let text = String::from_utf8_lossy(bytes);
    let mut messages: Vec<String> = Vec::new();
    for line in text.lines() {
        match serde_json::from_str::<serde_json::Value>(line) {
            Ok(value) if value.get("msg").is_some() => {
                let level = value.get("level").and_then(|l| l.as_str()).unwrap_or("");
                if matches!(level, "error" | "fatal")
                    && let Some(msg) = value.get("msg").and_then(|m| m.as_str())
                {
                    messages.push(msg.to_owned());
                }
            }
            _ if !line.trim().is_empty() => messages.push(line.trim().to_owned()),
            _ => {}
        }
    }
    let mut message = messages.join("; ");
    if message.is_empty() {
        message = "(no message)".to_owned();
    }
    const MAX: usize = 2000;
    if message.len() > MAX {
        let mut cut = MAX;
        while !message.is_char_boundary(cut) {
            cut -= 1;
        }
        message.truncate(cut);
        message.push('…');
    }
    message
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_come_from_error_lines_or_plain_text() {
        let log = br#"{"level":"info","msg":"starting"}
{"level":"error","msg":"runc create failed: no such file"}
"#;
        assert_eq!(runc_message(log), "runc create failed: no such file");
        assert_eq!(
            runc_message(b"container \"x\" does not exist\n"),
            "container \"x\" does not exist"
        );
        assert_eq!(runc_message(b""), "(no message)");
    }

    #[tokio::test]
    async fn a_missing_binary_is_named() {
        let runc = Runc::new("/nonexistent/runc", "/tmp");
        let Err(err) = runc.list().await else {
            panic!("listing with a missing runc succeeded");
        };
        assert!(matches!(err, RuncError::Missing { .. }), "{err:?}");
        assert!(err.to_string().contains("/nonexistent/runc"), "{err}");
    }
}
