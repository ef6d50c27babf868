//! Serving: the unix socket, the gRPC router with the selected versions, and
//! the process lifecycle (slow start, signals, slow exit, socket removal).
//!
//! Owns: binding the endpoint (removing a stale socket first), registering
//! the v1 and/or v0 services on one router — an unselected version's paths
//! then answer UNIMPLEMENTED, as for any unknown service — and the orderly
//! shutdown on SIGTERM/SIGINT: optional delay, stop serving, remove the
//! socket file, exit 0.
//!
//! Must not: implement RPCs.

use std::os::unix::fs::FileTypeExt;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, bail};
use csi_proto::{v0, v1};
use tokio::net::UnixListener;
use tokio::signal::unix::{SignalKind, signal};
use tokio_stream::wrappers::UnixListenerStream;
use tonic::service::RoutesBuilder;

use crate::cli::Config;
use crate::plugin::Plugin;
use crate::v0::V0;
use crate::v1::V1;

/// How long a graceful stop may wait for in-flight calls before the socket is
/// removed and the process exits anyway.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(5);

/// Removes a leftover socket at `path` (a plugin killed earlier leaves one,
/// and binding over it fails); refuses to remove anything that is not a
/// socket.
fn remove_stale_socket(path: &Path) -> anyhow::Result<()> {
    match std::fs::symlink_metadata(path) {
        Ok(m) if m.file_type().is_socket() => std::fs::remove_file(path)
            .with_context(|| format!("removing stale socket {}", path.display())),
        Ok(_) => bail!(
            "{} exists and is not a socket; refusing to replace it",
            path.display()
        ),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e).with_context(|| format!("checking {}", path.display())),
    }
}

/// Runs the plugin until SIGTERM/SIGINT.
pub async fn serve(cfg: Config) -> anyhow::Result<()> {
    let plugin = Plugin::open(cfg.clone())?;

    // Register the signal handlers before the (optional) slow start so that
    // a supervisor stopping a starting plugin is obeyed.
    let mut sigterm = signal(SignalKind::terminate())?;
    let mut sigint = signal(SignalKind::interrupt())?;
    if !cfg.startup_delay.is_zero() {
        tracing::info!(delay = ?cfg.startup_delay, "slow start");
        tokio::select! {
            () = tokio::time::sleep(cfg.startup_delay) => {}
            _ = sigterm.recv() => return Ok(()),
            _ = sigint.recv() => return Ok(()),
        }
    }

    let mut routes = RoutesBuilder::default();
    if cfg.serve_v1 {
        let svc = V1::new(Arc::clone(&plugin));
        routes.add_service(v1::identity_server::IdentityServer::new(svc.clone()));
        routes.add_service(v1::controller_server::ControllerServer::new(svc.clone()));
        routes.add_service(v1::node_server::NodeServer::new(svc));
    }
    if let Some(flavour) = cfg.v0 {
        let svc = V0::new(Arc::clone(&plugin), flavour);
        routes.add_service(v0::identity_server::IdentityServer::new(svc.clone()));
        routes.add_service(v0::controller_server::ControllerServer::new(svc.clone()));
        routes.add_service(v0::node_server::NodeServer::new(svc));
    }

    if let Some(parent) = cfg.socket.parent() {
        std::fs::create_dir_all(parent)
            .with_context(|| format!("creating {}", parent.display()))?;
    }
    remove_stale_socket(&cfg.socket)?;
    let listener = UnixListener::bind(&cfg.socket)
        .with_context(|| format!("binding {}", cfg.socket.display()))?;
    tracing::info!(
        socket = %cfg.socket.display(),
        v1 = cfg.serve_v1,
        v0 = cfg.v0.map(|v| v.as_str()),
        node_id = %cfg.node_id,
        mount_mode = ?cfg.mount_mode,
        "serving"
    );

    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(
        tonic::transport::Server::builder()
            .add_routes(routes.routes())
            .serve_with_incoming_shutdown(UnixListenerStream::new(listener), async {
                let _ = stop_rx.await;
            }),
    );

    let which = tokio::select! {
        _ = sigterm.recv() => "SIGTERM",
        _ = sigint.recv() => "SIGINT",
    };
    tracing::info!("{which} received");
    if !cfg.exit_delay.is_zero() {
        // A slow exit: still serving while "shutting down".
        tracing::info!(delay = ?cfg.exit_delay, "slow exit");
        tokio::time::sleep(cfg.exit_delay).await;
    }
    let _ = stop_tx.send(());
    match tokio::time::timeout(DRAIN_TIMEOUT, server).await {
        Ok(Ok(Ok(()))) => {}
        Ok(Ok(Err(e))) => tracing::warn!("server ended with: {e}"),
        Ok(Err(e)) => tracing::warn!("server task failed: {e}"),
        Err(_) => tracing::warn!("in-flight calls did not finish within {DRAIN_TIMEOUT:?}"),
    }
    if cfg.leave_socket {
        tracing::info!(socket = %cfg.socket.display(), "leaving the socket behind (--leave-socket)");
    } else if let Err(e) = std::fs::remove_file(&cfg.socket) {
        tracing::warn!(socket = %cfg.socket.display(), "removing the socket: {e}");
    }
    tracing::info!("stopped");
    Ok(())
}
