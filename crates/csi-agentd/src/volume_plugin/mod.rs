//! The Docker volume plugin protocol (docs/docker-podman.md), which Docker and Podman speak to
//! external volume drivers, served on its own unix socket (`--volume-plugin-socket`): HTTP
//! POSTs of JSON bodies, `/Plugin.Activate` and `/VolumeDriver.{Create, Remove, Mount, Unmount,
//! Path, Get, List, Capabilities}`.
//!
//! Each handler parses the engine's request, calls csi-agent's volume names
//! (`csi_agent::named`) and formats the answer; behaviour stays in the engine. A refusal is
//! HTTP 500 with the protocol's error shape, `{"Err": "…"}`, carrying csi-agent's message:
//! Docker reads `Err` whatever the status, while Podman 4 reads it only from a status other
//! than 200.
//!
//! A mount id becomes the claim (workload) `mount:<ID>` of the named volume, so each of
//! Docker's per-container mounts is reference counted durably by the volume manager; Podman,
//! which keeps its own count and sends one constant id, holds one claim.
//!
//! This module must not wait on an operation in flight to answer `Get`, `List`, `Path` or
//! `Capabilities`, nor decide anything the engine decides (what is created, deleted or
//! unpublished, and when).

pub mod options;

use std::collections::BTreeMap;
use std::path::Path;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use csi_agent::named::{NamedError, NamedOrigin, NamedView};
use csi_agent::server::CsiServer;
use serde::{Deserialize, Serialize};
use serde_json::json;

/// The claim prefix of a mount id.
pub const WORKLOAD_PREFIX: &str = "mount:";

/// The routes of the protocol, each a POST.
pub fn router(server: CsiServer) -> Router {
    Router::new()
        .route("/Plugin.Activate", post(activate))
        .route("/VolumeDriver.Create", post(create))
        .route("/VolumeDriver.Remove", post(remove))
        .route("/VolumeDriver.Mount", post(mount))
        .route("/VolumeDriver.Unmount", post(unmount))
        .route("/VolumeDriver.Path", post(path))
        .route("/VolumeDriver.Get", post(get))
        .route("/VolumeDriver.List", post(list))
        .route("/VolumeDriver.Capabilities", post(capabilities))
        .fallback(unknown_call)
        .with_state(server)
}

/// A refusal in the protocol's shape.
struct Refusal(String);

impl IntoResponse for Refusal {
    fn into_response(self) -> Response {
        (
            StatusCode::INTERNAL_SERVER_ERROR,
            Json(json!({ "Err": self.0 })),
        )
            .into_response()
    }
}

impl From<NamedError> for Refusal {
    fn from(err: NamedError) -> Self {
        // The whole chain: a plugin's own message is in the sources.
        let mut message = err.to_string();
        let mut source = std::error::Error::source(&err);
        while let Some(cause) = source {
            let text = cause.to_string();
            if !message.contains(&text) {
                message.push_str(": ");
                message.push_str(&text);
            }
            source = cause.source();
        }
        Self(message)
    }
}

type Answer = Result<Json<serde_json::Value>, Refusal>;

/// The bodies the engines send: a name, an id, options. Unknown fields are ignored (the
/// protocol grows fields; refusing them would break an engine's upgrade).
#[derive(Debug, Default, Deserialize)]
struct Call {
    #[serde(rename = "Name", default)]
    name: String,
    #[serde(rename = "ID", default)]
    id: String,
    #[serde(rename = "Opts", default)]
    opts: Option<BTreeMap<String, String>>,
}

fn parse(route: &str, body: &Bytes) -> Result<Call, Refusal> {
    // Some calls (List, Capabilities, Activate) come with no body, or `null`.
    if body.iter().all(u8::is_ascii_whitespace) || body.as_ref() == b"null" {
        return Ok(Call::default());
    }
    serde_json::from_slice(body).map_err(|err| {
        Refusal(format!(
            "the body of {route} is not valid: {err}; see docs/docker-podman.md"
        ))
    })
}

fn workload(id: &str) -> Result<String, Refusal> {
    let workload = format!("{WORKLOAD_PREFIX}{id}");
    csi_agent::volume::check_id("mount ID", &workload).map_err(|err| {
        Refusal(format!(
            "{err} (the mount ID becomes the claim {WORKLOAD_PREFIX}ID)"
        ))
    })?;
    Ok(workload)
}

fn shown(path: Option<&Path>) -> String {
    path.map(|p| p.to_string_lossy().into_owned())
        .unwrap_or_default()
}

async fn activate() -> Json<serde_json::Value> {
    Json(json!({ "Implements": ["VolumeDriver"] }))
}

async fn capabilities() -> Json<serde_json::Value> {
    // Local: a volume's data and mounts are this node's (cluster mode is docs/design.md's).
    Json(json!({ "Capabilities": { "Scope": "local" } }))
}

async fn unknown_call() -> Refusal {
    Refusal(
        "csi-agentd does not serve this call of the volume plugin protocol; see docs/docker-podman.md"
            .to_owned(),
    )
}

async fn create(State(server): State<CsiServer>, body: Bytes) -> Answer {
    let call = parse("VolumeDriver.Create", &body)?;
    let spec = options::parse(&call.opts.unwrap_or_default())
        .map_err(|message| Refusal(format!("volume {:?}: {message}", call.name)))?;
    server.named_create(&call.name, spec).await?;
    Ok(Json(json!({ "Err": "" })))
}

async fn remove(State(server): State<CsiServer>, body: Bytes) -> Answer {
    let call = parse("VolumeDriver.Remove", &body)?;
    server.named_remove(&call.name).await?;
    Ok(Json(json!({ "Err": "" })))
}

async fn mount(State(server): State<CsiServer>, body: Bytes) -> Answer {
    let call = parse("VolumeDriver.Mount", &body)?;
    let workload = workload(&call.id)?;
    let target = server.named_mount(&call.name, &workload).await?;
    Ok(Json(
        json!({ "Mountpoint": shown(Some(&target)), "Err": "" }),
    ))
}

async fn unmount(State(server): State<CsiServer>, body: Bytes) -> Answer {
    let call = parse("VolumeDriver.Unmount", &body)?;
    let workload = workload(&call.id)?;
    server.named_unmount(&call.name, &workload).await?;
    Ok(Json(json!({ "Err": "" })))
}

async fn path(State(server): State<CsiServer>, body: Bytes) -> Answer {
    let call = parse("VolumeDriver.Path", &body)?;
    let view = known(&server, &call.name).await?;
    Ok(Json(
        json!({ "Mountpoint": shown(view.mountpoint.as_deref()), "Err": "" }),
    ))
}

async fn get(State(server): State<CsiServer>, body: Bytes) -> Answer {
    let call = parse("VolumeDriver.Get", &body)?;
    let view = known(&server, &call.name).await?;
    Ok(Json(json!({ "Volume": volume(&view, true), "Err": "" })))
}

async fn list(State(server): State<CsiServer>) -> Json<serde_json::Value> {
    let volumes: Vec<Volume> = server
        .named_list()
        .await
        .iter()
        .map(|view| volume(view, false))
        .collect();
    Json(json!({ "Volumes": volumes, "Err": "" }))
}

async fn known(server: &CsiServer, name: &str) -> Result<NamedView, Refusal> {
    server.named(name).await.ok_or_else(|| {
        Refusal(
            NamedError::UnknownName {
                name: name.to_owned(),
            }
            .to_string(),
        )
    })
}

/// A volume as the protocol shows it.
#[derive(Debug, Serialize)]
struct Volume {
    #[serde(rename = "Name")]
    name: String,
    #[serde(rename = "Mountpoint")]
    mountpoint: String,
    #[serde(rename = "CreatedAt", skip_serializing_if = "Option::is_none")]
    created_at: Option<String>,
    #[serde(rename = "Status", skip_serializing_if = "Option::is_none")]
    status: Option<Status>,
}

/// `Status` of `Get` (`docker volume inspect`, `podman volume inspect`): where the volume
/// stands in csi-agent.
#[derive(Debug, Serialize)]
struct Status {
    plugin: String,
    /// Empty while its CreateVolume is unfinished.
    volume_id: String,
    /// `created` (removing the name deletes the volume) or `adopted` (only forgotten).
    origin: &'static str,
    /// The volume's state on this node, or `creating` / `not_loaded`.
    state: String,
    capacity_bytes: i64,
    /// The claims (`mount:<ID>`) holding it published.
    mounts: Vec<String>,
    /// The options it was created with (secrets' values left out).
    options: BTreeMap<String, String>,
}

fn volume(view: &NamedView, with_status: bool) -> Volume {
    let record = &view.record;
    Volume {
        name: view.name.clone(),
        mountpoint: shown(view.mountpoint.as_deref()),
        created_at: i64::try_from(record.created_at_unix)
            .ok()
            .and_then(|secs| csi_agent_api::time::rfc3339(secs, 0)),
        status: with_status.then(|| Status {
            plugin: record.plugin.clone(),
            volume_id: record.volume_id.clone().unwrap_or_default(),
            origin: match record.origin {
                NamedOrigin::Created => "created",
                NamedOrigin::Adopted => "adopted",
            },
            state: match (&record.volume_id, view.state) {
                (None, _) => "creating".to_owned(),
                (Some(_), None) => "not_loaded".to_owned(),
                (Some(_), Some(state)) => state.as_str().to_owned(),
            },
            capacity_bytes: record.capacity_bytes,
            mounts: view.claims.clone(),
            options: record.options.clone(),
        }),
    }
}
