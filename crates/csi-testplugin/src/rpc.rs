//! The wrapper every RPC goes through, whatever its version.
//!
//! Owns, in this order: the injected `exit` (the process ends without
//! answering), the per-volume in-flight check (a second call for a volume
//! with one in flight is answered `ABORTED` and marked `overlap` — the spec's
//! "operation pending for volume"), injected delays and failures, running the
//! operation itself in its own task, and writing the call-log line.
//!
//! The operation runs in a spawned task on purpose: when the client gives up
//! (deadline, cancelled stream) the operation still completes, like a real
//! plugin's would, and the volume stays "in flight" until it does. A CO that
//! retries too early sees `ABORTED`, and the call log shows when the
//! operation really ended.
//!
//! Must not: implement CSI semantics (that is `plugin.rs`) or know protobuf
//! types (the adapters build the [`CallCtx`]).

use std::collections::{BTreeMap, HashSet};
use std::future::Future;
use std::sync::{Arc, Mutex};

use tonic::Status;

use crate::calllog::{Entry, now_ns};
use crate::model::{ApiVersion, code_name};
use crate::plugin::Plugin;

/// What the wrapper needs to know about a call.
#[derive(Debug)]
pub struct CallCtx {
    pub method: &'static str,
    pub version: ApiVersion,
    pub volume_id: Option<String>,
    /// The node a Controller(Un)Publish is about (the request's node id).
    pub target_node: Option<String>,
    pub secrets: Option<BTreeMap<String, String>>,
    pub topology: Option<serde_json::Value>,
}

impl CallCtx {
    pub fn new(method: &'static str, version: ApiVersion) -> Self {
        Self {
            method,
            version,
            volume_id: None,
            target_node: None,
            secrets: None,
            topology: None,
        }
    }

    /// The request's topology, for the call log.
    pub fn topology(mut self, topology: Option<serde_json::Value>) -> Self {
        self.topology = topology;
        self
    }

    /// The volume the call is about; an empty id (a missing required field)
    /// is not tracked.
    pub fn volume(mut self, id: &str) -> Self {
        if !id.is_empty() {
            self.volume_id = Some(id.to_owned());
        }
        self
    }

    /// The node a controller call publishes to or unpublishes from, for the backend's log.
    pub fn target_node(mut self, node_id: &str) -> Self {
        self.target_node = Some(node_id.to_owned());
        self
    }

    /// The request's secrets, kept only if the plugin records them.
    pub fn secrets(
        mut self,
        plugin: &Plugin,
        secrets: &std::collections::HashMap<String, String>,
    ) -> Self {
        if plugin.config().record_secrets {
            self.secrets = Some(
                secrets
                    .iter()
                    .map(|(k, v)| (k.clone(), v.clone()))
                    .collect(),
            );
        }
        self
    }
}

/// Volumes with an RPC in flight.
#[derive(Debug, Default)]
pub struct Inflight {
    set: Mutex<HashSet<String>>,
}

/// Removes its volume from the in-flight set when dropped.
#[derive(Debug)]
pub struct InflightGuard<'a> {
    owner: &'a Inflight,
    id: String,
}

impl Drop for InflightGuard<'_> {
    fn drop(&mut self) {
        self.owner
            .set
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&self.id);
    }
}

impl Inflight {
    /// Marks `id` in flight; `None` if it already was (an overlap).
    pub fn enter(&self, id: &str) -> Option<InflightGuard<'_>> {
        let mut set = self.set.lock().unwrap_or_else(|p| p.into_inner());
        set.insert(id.to_owned()).then(|| InflightGuard {
            owner: self,
            id: id.to_owned(),
        })
    }
}

/// The Identity service's RPCs: no volume, no node, not recorded in the shared backend.
fn is_identity(method: &str) -> bool {
    matches!(method, "GetPluginInfo" | "GetPluginCapabilities" | "Probe")
}

/// Runs one RPC: see the module documentation for the order of events.
pub async fn run<T, F, Fut>(plugin: &Arc<Plugin>, ctx: CallCtx, op: F) -> Result<T, Status>
where
    T: Send + 'static,
    F: FnOnce(Arc<Plugin>) -> Fut + Send + 'static,
    Fut: Future<Output = Result<T, Status>> + Send + 'static,
{
    let plugin = Arc::clone(plugin);
    let task = tokio::spawn(async move {
        let start_ns = now_ns();
        let faults = plugin.faults();
        if let Some(code) = faults.take_exit(ctx.method, ctx.version) {
            plugin.calls().write(&Entry {
                method: ctx.method,
                version: ctx.version.as_str(),
                volume_id: ctx.volume_id.clone(),
                start_ns,
                end_ns: now_ns(),
                code: "EXIT",
                overlap: false,
                message: Some(format!("injected exit({code})")),
                secrets: ctx.secrets.clone(),
                topology: ctx.topology.clone(),
            });
            tracing::warn!(method = ctx.method, "injected fault: exiting with {code}");
            std::process::exit(code);
        }

        let guard = ctx
            .volume_id
            .as_deref()
            .map(|id| plugin.inflight().enter(id));
        let overlap = matches!(guard, Some(None));
        let result = if overlap {
            Err(Status::aborted(format!(
                "an operation is already pending for volume {:?}",
                ctx.volume_id.as_deref().unwrap_or_default()
            )))
        } else {
            let actions = faults.take_actions(ctx.method, ctx.version);
            if !actions.delay.is_zero() {
                tokio::time::sleep(actions.delay).await;
            }
            match actions.fail {
                Some(status) => Err(status),
                // With a shared backend, the call starts from its current truth.
                None if is_identity(ctx.method) => op(Arc::clone(&plugin)).await,
                None => match plugin.sync_backend().await {
                    Ok(()) => op(Arc::clone(&plugin)).await,
                    Err(e) => Err(e),
                },
            }
        };
        drop(guard);

        let code = match &result {
            Ok(_) => tonic::Code::Ok,
            Err(s) => s.code(),
        };
        plugin.calls().write(&Entry {
            method: ctx.method,
            version: ctx.version.as_str(),
            volume_id: ctx.volume_id.clone(),
            start_ns,
            end_ns: now_ns(),
            code: code_name(code),
            overlap,
            message: result.as_ref().err().map(|s| s.message().to_owned()),
            secrets: ctx.secrets,
            topology: ctx.topology,
        });
        if let Some(backend) = plugin.backend()
            && !is_identity(ctx.method)
        {
            backend.record_call(
                ctx.method,
                ctx.volume_id.as_deref(),
                ctx.target_node.as_deref(),
                code_name(code),
            );
        }
        match &result {
            Err(s) if s.code() == tonic::Code::Internal => {
                tracing::warn!(method = ctx.method, volume = ?ctx.volume_id, "INTERNAL: {}", s.message());
            }
            _ => {
                tracing::debug!(method = ctx.method, version = ctx.version.as_str(), volume = ?ctx.volume_id, code = code_name(code))
            }
        }
        result
    });
    task.await
        .unwrap_or_else(|e| Err(Status::internal(format!("operation task failed: {e}"))))
}
