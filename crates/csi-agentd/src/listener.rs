//! The API's listeners, at start: binding the unix socket safely, and the checks of the token
//! file and of the TCP address that refuse a weak setup before anything is served.
//!
//! This module owns those start-up checks. It must not know the routes, compare tokens
//! (`api::require_token` does), or touch the engine's state.

use std::io;
use std::net::SocketAddr;
use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::path::Path;
use std::time::Duration;

use anyhow::{Context, bail};
use tokio::net::UnixListener;

/// The shortest token the TCP listener accepts.
pub const MIN_TOKEN_BYTES: usize = 16;

/// Refuses `--listen` on an address other than loopback unless `allow_insecure`: the listener
/// speaks plain HTTP, so the token and volume secrets would cross the network in the clear.
pub fn check_listen_address(addr: SocketAddr, allow_insecure: bool) -> anyhow::Result<()> {
    if addr.ip().to_canonical().is_loopback() || allow_insecure {
        return Ok(());
    }
    bail!(
        "--listen {addr} is not a loopback address: csi-agentd has no TLS, so the bearer token \
         and volume secrets would cross the network in the clear; listen on 127.0.0.1 or ::1 and \
         put a TLS proxy or an SSH tunnel in front, or pass --allow-insecure-listen to accept the risk"
    )
}

/// The bearer token from `path`, refused when the file is readable by group or others or the
/// token is shorter than [`MIN_TOKEN_BYTES`]. Surrounding whitespace is not part of the token.
pub fn read_token(path: &Path) -> anyhow::Result<String> {
    let shown = path.display();
    let mode = std::fs::metadata(path)
        .with_context(|| format!("cannot read the token file {shown}"))?
        .permissions()
        .mode();
    if mode & 0o077 != 0 {
        bail!(
            "token file {shown} is readable by group or others (mode {:04o}): anyone who can \
             read it can publish volumes; run `chmod 600 {shown}`",
            mode & 0o7777
        );
    }
    let token = std::fs::read_to_string(path)
        .with_context(|| format!("cannot read the token file {shown}"))?
        .trim()
        .to_owned();
    if token.is_empty() {
        bail!("token file {shown} is empty: put the bearer token in it");
    }
    if token.len() < MIN_TOKEN_BYTES {
        bail!(
            "the token in {shown} is {} bytes long; at least {MIN_TOKEN_BYTES} are required \
             (e.g. `head -c 32 /dev/urandom | base64 > {shown}`)",
            token.len()
        );
    }
    Ok(token)
}

/// Binds the API's unix socket at `path`, created with mode 0600 (no window in which it is
/// more open). Only a stale socket (a socket nobody accepts on) is replaced; a live socket or
/// any other file (regular file, directory, symlink: never followed) is refused and left alone.
pub async fn bind_unix(path: &Path) -> anyhow::Result<UnixListener> {
    let shown = path.display();
    match std::fs::symlink_metadata(path) {
        Err(err) if err.kind() == io::ErrorKind::NotFound => {}
        Err(err) => {
            return Err(err).with_context(|| format!("cannot inspect the API socket path {shown}"));
        }
        Ok(meta) if meta.file_type().is_socket() => {
            let probe = tokio::time::timeout(
                Duration::from_secs(2),
                tokio::net::UnixStream::connect(path),
            )
            .await;
            match probe {
                Ok(Err(err)) if err.kind() == io::ErrorKind::ConnectionRefused => {
                    tracing::info!(socket = %shown, "replacing a stale API socket");
                    std::fs::remove_file(path)
                        .with_context(|| format!("cannot remove the stale API socket {shown}"))?;
                }
                Ok(Ok(_)) => bail!(
                    "another process is serving on the API socket {shown} (is another csi-agentd \
                     running with this work dir?); stop it, or give this daemon another --api-socket"
                ),
                Ok(Err(err)) => bail!(
                    "{shown} is a unix socket that may be in use (connecting to it failed: {err}); \
                     csi-agentd only replaces a socket that refuses connections: remove it if it is \
                     stale, or give another --api-socket"
                ),
                Err(_) => bail!(
                    "{shown} is a unix socket that accepts no connection within 2 s, so it may be \
                     in use; remove it if it is stale, or give another --api-socket"
                ),
            }
        }
        Ok(meta) => {
            let kind = if meta.file_type().is_symlink() {
                "a symbolic link"
            } else if meta.is_dir() {
                "a directory"
            } else if meta.is_file() {
                "a regular file"
            } else {
                "a special file"
            };
            bail!(
                "refusing to use --api-socket {shown}: it is {kind}, not a unix socket, and \
                 csi-agentd only replaces a stale socket; move it away or choose another path"
            );
        }
    }
    use rustix::fs::Mode;
    let previous = rustix::process::umask(Mode::from_raw_mode(0o177));
    let bound = UnixListener::bind(path);
    rustix::process::umask(previous);
    let listener = bound.with_context(|| format!("cannot listen on {shown}"))?;
    let mode = std::fs::symlink_metadata(path)
        .with_context(|| format!("cannot inspect the new API socket {shown}"))?
        .permissions()
        .mode()
        & 0o777;
    if mode != 0o600 {
        bail!("the API socket {shown} has mode {mode:04o}, not 0600");
    }
    Ok(listener)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::*;

    #[test]
    fn listen_addresses() {
        assert!(check_listen_address("127.0.0.1:1".parse().unwrap(), false).is_ok());
        assert!(check_listen_address("[::1]:1".parse().unwrap(), false).is_ok());
        assert!(check_listen_address("[::ffff:127.0.0.1]:1".parse().unwrap(), false).is_ok());
        let err = check_listen_address("0.0.0.0:1".parse().unwrap(), false).unwrap_err();
        assert!(err.to_string().contains("--allow-insecure-listen"), "{err}");
        assert!(check_listen_address("[::]:1".parse().unwrap(), false).is_err());
        assert!(check_listen_address("0.0.0.0:1".parse().unwrap(), true).is_ok());
    }
}
