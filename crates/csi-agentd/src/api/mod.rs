//! The HTTP/JSON API (docs/api.md): routes, request parsing and response formatting. Every
//! handler parses, calls the engine, and formats; behaviour stays in the engine.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{Path as UrlPath, Query, Request, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::{MethodRouter, delete, get, post};
use axum::{Json, Router};
use csi_agent::client::{RpcErrorKind, code_name};
use csi_agent::image::store::{ImageStore, PullPolicy};
use csi_agent::metrics::ComponentLabels;
use csi_agent::server::CsiServer;
use csi_agent::service_manager::ComponentState;
use csi_agent::volume::{NewVolume, PublishRequest, VolumeError, VolumeSecrets};
use csi_agent_api as api;
use serde::de::DeserializeOwned;

use crate::convert::{self, ApiFailure};

mod cluster;
mod expand;
use crate::volume_list::{PluginPart, VolumePage};

mod snapshot;
pub(crate) mod stats;
mod topology;

#[derive(Clone, Debug)]
pub struct AppState {
    pub server: CsiServer,
    pub import: ImportSettings,
    /// How volume stats are collected (the on-demand collection's deadline).
    pub stats: csi_agent::volume::stats::StatsOptions,
}

/// The bounds of `POST /v1/images/import`, whose body is streamed (see `listener::Upload`).
#[derive(Clone, Copy, Debug)]
pub struct ImportSettings {
    /// `--image-import-max-bytes`: the most read from the body.
    pub max_bytes: u64,
    /// The longest wait for the next piece of the body (`--body-timeout-ms`: a slow upload is
    /// fine, a stalled one is not).
    pub idle_timeout: std::time::Duration,
}

impl IntoResponse for ApiFailure {
    fn into_response(self) -> Response {
        let status = StatusCode::from_u16(self.0.code.http_status())
            .unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        (status, Json(self.0)).into_response()
    }
}

type ApiResult<T> = Result<Json<T>, ApiFailure>;

/// Parses a JSON body with a message that names the route and the problem.
fn parse_body<T: DeserializeOwned>(route: &str, body: &Bytes) -> Result<T, ApiFailure> {
    // serde fills a struct from a JSON array too (`["p"]` is a CapacityRequest for plugin
    // "p", `[]` a DrainRequest of defaults): every body of this API is an object
    // (openapi.yaml), so anything else is refused before serde sees it.
    if body.trim_ascii_start().first() != Some(&b'{') {
        return Err(ApiFailure::invalid(format!(
            "request body of {route} is not valid: it must be a JSON object ({{...}}); see docs/api.md for the expected fields"
        )));
    }
    serde_json::from_slice(body).map_err(|err| {
        ApiFailure::invalid(format!(
            "request body of {route} is not valid: {err}; see docs/api.md for the expected fields"
        ))
    })
}

/// Path parameters of a route. A rejection (a parameter that is not UTF-8 once
/// percent-decoded) is answered 400 in the API's error shape, naming the parameter, instead of
/// axum's plain-text answer.
struct Params<T>(T);

impl<S, T> axum::extract::FromRequestParts<S> for Params<T>
where
    T: DeserializeOwned + Send,
    S: Send + Sync,
{
    type Rejection = ApiFailure;

    async fn from_request_parts(
        parts: &mut axum::http::request::Parts,
        state: &S,
    ) -> Result<Self, Self::Rejection> {
        match <UrlPath<T> as axum::extract::FromRequestParts<S>>::from_request_parts(parts, state)
            .await
        {
            Ok(UrlPath(params)) => Ok(Params(params)),
            Err(rejection) => Err(path_failure(&rejection)),
        }
    }
}

fn path_failure(rejection: &axum::extract::rejection::PathRejection) -> ApiFailure {
    use axum::extract::path::ErrorKind;
    use axum::extract::rejection::PathRejection;
    let detail = match rejection {
        PathRejection::FailedToDeserializePathParams(err) => match err.kind() {
            ErrorKind::InvalidUtf8InPathParam { key } => {
                format!("the {key} in the URL path is not UTF-8 once percent-decoded")
            }
            _ => err.body_text(),
        },
        other => other.body_text(),
    };
    ApiFailure::invalid(format!(
        "{detail}: ids in the URL path must be percent-encoded UTF-8; see docs/api.md"
    ))
}

/// All routes of the API: exactly `routes::ALL_ROUTES`, each with its [`handler`]. The router
/// is built from that list, so that it cannot serve a route that `openapi.yaml` and
/// docs/api.md (both checked against `ALL_ROUTES` by csi-agent-api's tests) do not describe.
pub fn router(state: AppState) -> Router {
    let mut router = Router::new();
    for &(method, path) in api::routes::ALL_ROUTES {
        // Every route has a handler (`every_route_has_a_handler`); the same path named twice
        // with two methods merges into one method router.
        if let Some(handler) = handler(method, path) {
            router = router.route(path, handler);
        }
    }
    router
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .with_state(state)
}

/// The handler of one `(method, path)` of `routes::ALL_ROUTES`; `None` for any other pair.
fn handler(method: &str, path: &str) -> Option<MethodRouter<AppState>> {
    use api::routes as r;
    Some(match (method, path) {
        ("GET", r::HEALTH) => get(health),
        ("POST", r::START) => post(start),
        ("GET", r::METRICS) => get(metrics),
        ("GET", r::PLUGINS) => get(plugins),
        ("GET", r::PLUGIN) => get(plugin),
        ("POST", r::PLUGINS_RELOAD) => post(reload),
        ("GET", r::BACKEND_VOLUMES) => get(backend_volumes),
        ("POST", r::PUBLISH) => post(publish),
        ("POST", r::UNPUBLISH) => post(unpublish),
        ("GET", r::VOLUMES) => get(volumes),
        ("POST", r::VOLUMES) => post(create_volume),
        ("GET", r::VOLUME) => get(volume),
        ("DELETE", r::VOLUME) => delete(delete_volume),
        ("POST", r::VOLUME_EXPAND) => post(expand::expand_volume),
        ("GET", r::VOLUME_STATS) => get(stats::volume_stats),
        ("POST", r::VALIDATE) => post(validate),
        ("POST", r::CAPACITY) => post(capacity),
        ("POST", r::DRAIN) => post(drain),
        ("GET", r::IMAGES) => get(images),
        ("POST", r::IMAGES_PULL) => post(pull_image),
        ("GET", r::IMAGES_PULLS) => get(image_pulls),
        ("POST", r::IMAGES_PRUNE) => post(prune_images),
        ("POST", r::IMAGES_IMPORT) => post(import_images),
        ("POST", r::SNAPSHOTS) => post(snapshot::create_snapshot),
        ("DELETE", r::SNAPSHOT) => delete(snapshot::delete_snapshot),
        ("GET", r::PLUGIN_SNAPSHOTS) => get(snapshot::list_snapshots),
        ("GET", r::CLUSTER) => get(cluster::status),
        ("GET", r::CLUSTER_CLAIMS) => get(cluster::claims),
        ("POST", r::CLUSTER_FENCE) => post(cluster::fence),
        _ => return None,
    })
}

/// Requires `Authorization: Bearer <token>` (TCP listener only), compared in constant time.
pub async fn require_token(
    State(token): State<Arc<String>>,
    headers: HeaderMap,
    request: Request,
    next: Next,
) -> Response {
    use subtle::ConstantTimeEq;
    let given = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(bearer_credentials)
        .unwrap_or("");
    let ok: bool = given.as_bytes().ct_eq(token.as_bytes()).into();
    if ok && !given.is_empty() {
        next.run(request).await
    } else {
        ApiFailure::new(
            api::ErrorCode::Unauthorized,
            "missing or wrong bearer token: send \"Authorization: Bearer <token>\" with the token from the daemon's --token-file",
        )
        .into_response()
    }
}

/// The token of an `Authorization: <scheme> <token>` value whose scheme is `Bearer` in any
/// case (RFC 7235 section 2.1: the scheme is case-insensitive), after one or more spaces.
fn bearer_credentials(value: &str) -> Option<&str> {
    let (scheme, token) = value.split_once(' ')?;
    scheme
        .eq_ignore_ascii_case("bearer")
        .then(|| token.trim_start_matches(' '))
}

async fn not_found() -> ApiFailure {
    ApiFailure::new(
        api::ErrorCode::NotFound,
        "no such route; see docs/api.md for the routes of this API",
    )
}

async fn method_not_allowed() -> Response {
    let failure = ApiFailure::new(
        api::ErrorCode::InvalidRequest,
        "this route does not take that HTTP method; see docs/api.md for the methods of each route",
    );
    let mut response = failure.into_response();
    *response.status_mut() = StatusCode::METHOD_NOT_ALLOWED;
    response
}

async fn health(State(state): State<AppState>) -> Json<api::Health> {
    Json(api::Health {
        status: "ok".to_owned(),
        started: state.server.is_started(),
        version: env!("CARGO_PKG_VERSION").to_owned(),
    })
}

async fn start(State(state): State<AppState>) -> Json<api::StartResponse> {
    let opened_now = state.server.start().await;
    Json(api::StartResponse {
        started: true,
        opened_now,
    })
}

async fn metrics(State(state): State<AppState>) -> Response {
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        state.server.metrics().encode(),
    )
        .into_response()
}

async fn plugin_infos(state: &AppState) -> api::PluginList {
    state.server.load_configs().await;
    let (reports, errors) = state.server.plugins().await;
    // Which plugins wait for which pull: asked only while a pull is in flight.
    let pulls = pull_progress(state);
    let users = if pulls.is_empty() {
        BTreeMap::new()
    } else {
        state.server.image_users().await
    };
    let mut plugins = Vec::new();
    for report in reports {
        let config = &report.loaded.config;
        let (components, volumes, csi_version, ready) = match &report.plugin {
            None => (Vec::new(), 0, None, false),
            Some(plugin) => {
                let statuses = plugin.components();
                let mut version = None;
                let ready = !statuses.is_empty()
                    && statuses
                        .iter()
                        .all(|s| matches!(s.state, ComponentState::Ready(_)));
                let components = statuses
                    .iter()
                    .map(|s| {
                        let (pid, endpoint) = match &s.state {
                            ComponentState::Ready(ready) => {
                                version = Some(ready.version.as_str().to_owned());
                                (
                                    ready
                                        .handle
                                        .as_ref()
                                        .and_then(|h| u32::try_from(h.pid()).ok()),
                                    Some(ready.socket.to_string_lossy().into_owned()),
                                )
                            }
                            _ => (None, None),
                        };
                        api::ComponentInfo {
                            id: s.component.clone(),
                            services: s.serves.iter().map(|x| x.as_str().to_owned()).collect(),
                            ready: matches!(s.state, ComponentState::Ready(_)),
                            pid,
                            endpoint,
                            restarts: component_restarts(state, &config.plugin_type, &s.component),
                            error: match &s.state {
                                ComponentState::BackingOff { last_error, .. } => {
                                    Some(last_error.clone())
                                }
                                _ => None,
                            },
                        }
                    })
                    .collect();
                // Counted without waiting: a publish waiting for a restarting plugin must
                // not make the plugin's status wait too.
                let volumes = plugin.volumes.count();
                (components, volumes, version, ready)
            }
        };
        let node = report
            .plugin
            .as_ref()
            .and_then(|plugin| topology::node_info(&plugin.volumes, ready));
        let state_name = match (&report.error, &report.plugin) {
            (Some(_), _) => "failed",
            // Not initialized: before the gate opens, and while start-up initializes every
            // plugin (recovering its volumes), that is start-up's doing; after it (a plugin
            // added by a reload) the plugin starts on first use, like an idle one.
            (None, None) if !state.server.is_recovered() => "not_started",
            (None, None) => "idle",
            (None, Some(_)) if ready => "ready",
            (None, Some(plugin)) => {
                let statuses = plugin.components();
                if statuses
                    .iter()
                    .any(|s| matches!(s.state, ComponentState::BackingOff { .. }))
                {
                    "restarting"
                } else if statuses
                    .iter()
                    .all(|s| matches!(s.state, ComponentState::Idle))
                {
                    // Launched lazily, on first need.
                    "idle"
                } else {
                    "starting"
                }
            }
        };
        // A component that keeps failing (runc missing, a rootfs that does not exist, ...)
        // is the plugin's problem too: say so on the plugin, not only on the component.
        let error = report.error.clone().or_else(|| {
            components.iter().find_map(|c: &api::ComponentInfo| {
                c.error
                    .as_ref()
                    .map(|error| format!("component {}: {error}", c.id))
            })
        });
        plugins.push(api::PluginInfo {
            plugin_type: config.plugin_type.clone(),
            name: config.name.clone(),
            managed: config.is_managed(),
            state: state_name.to_owned(),
            csi_version,
            config_file: report.loaded.file.to_string_lossy().into_owned(),
            error,
            components,
            volumes,
            image_pulls: pulls
                .iter()
                .filter(|pull| {
                    users
                        .get(&pull.reference)
                        .is_some_and(|types| types.contains(&config.plugin_type))
                })
                .cloned()
                .collect(),
            node,
        });
    }
    api::PluginList {
        plugins,
        config_errors: config_errors(errors),
    }
}

/// Restarts of a component, as counted in the metrics.
fn component_restarts(state: &AppState, plugin_type: &str, component: &str) -> u64 {
    state
        .server
        .metrics()
        .component_restarts
        .get(&ComponentLabels {
            plugin: plugin_type.to_owned(),
            component: component.to_owned(),
        })
        .map(|c| c.get())
        .unwrap_or(0)
}

fn config_errors(errors: Vec<(PathBuf, String)>) -> Vec<api::ConfigErrorInfo> {
    errors
        .into_iter()
        .map(|(file, message)| api::ConfigErrorInfo {
            file: file.to_string_lossy().into_owned(),
            message,
        })
        .collect()
}

async fn plugins(State(state): State<AppState>) -> Json<api::PluginList> {
    Json(plugin_infos(&state).await)
}

async fn plugin(
    State(state): State<AppState>,
    Params(plugin_type): Params<String>,
) -> ApiResult<api::PluginInfo> {
    plugin_infos(&state)
        .await
        .plugins
        .into_iter()
        .find(|p| p.plugin_type == plugin_type)
        .map(Json)
        .ok_or_else(|| {
            ApiFailure::new(
                api::ErrorCode::NotFound,
                format!(
                    "unknown plugin type {plugin_type:?}: GET /v1/plugins lists the configured ones"
                ),
            )
        })
}

async fn reload(State(state): State<AppState>) -> Json<api::ReloadReport> {
    let (diff, errors) = state.server.reload().await;
    Json(api::ReloadReport {
        added: diff.added,
        changed: diff.changed,
        removed: diff.removed,
        config_errors: config_errors(errors),
    })
}

/// The longest drain timeout accepted (a day): anything longer is a mistake.
const MAX_DRAIN_TIMEOUT_SECS: u64 = 86_400;

async fn drain(State(state): State<AppState>, body: Bytes) -> ApiResult<api::DrainReport> {
    // No body (or an empty one): the defaults, as before the request had options.
    let request: api::DrainRequest = if body.iter().all(u8::is_ascii_whitespace) {
        api::DrainRequest::default()
    } else {
        parse_body("POST /v1/drain", &body)?
    };
    let timeout = match request.timeout_secs {
        None => csi_agent::server::DEFAULT_DRAIN_TIMEOUT,
        Some(secs @ 1..=MAX_DRAIN_TIMEOUT_SECS) => std::time::Duration::from_secs(secs),
        Some(other) => {
            return Err(ApiFailure::invalid(format!(
                "timeout_secs {other} is out of range: give 1 to {MAX_DRAIN_TIMEOUT_SECS}"
            )));
        }
    };
    let report = state.server.drain(timeout).await;
    let complete = report.is_complete();
    let claim = |claim: csi_agent::server::DrainedClaim| api::ClaimRef {
        plugin: claim.plugin,
        volume_id: claim.volume_id,
        workload: claim.workload,
    };
    Ok(Json(api::DrainReport {
        complete,
        released: report.released.into_iter().map(claim).collect(),
        failed: report
            .failed
            .into_iter()
            .map(|failure| api::DrainFailure {
                plugin: failure.plugin,
                volume_id: failure.volume_id,
                workload: failure.workload,
                error: failure.error,
            })
            .collect(),
        stopped_plugins: report.stopped,
        left: report
            .left
            .into_iter()
            .map(|left| api::DrainLeft {
                plugin: left.plugin,
                volume_id: left.volume_id,
                path: left.path.map(|p| p.to_string_lossy().into_owned()),
                reason: left.reason,
            })
            .collect(),
    }))
}

fn image_store(state: &AppState) -> Result<&Arc<ImageStore>, ApiFailure> {
    state.server.images().ok_or_else(|| {
        ApiFailure::new(
            api::ErrorCode::Internal,
            "the image store could not be opened; the daemon's log says why",
        )
    })
}

/// The pulls in flight, in the API's shape (none without an image store).
fn pull_progress(state: &AppState) -> Vec<api::ImagePullProgress> {
    let Some(store) = state.server.images() else {
        return Vec::new();
    };
    store
        .pulls()
        .into_iter()
        .map(|pull| api::ImagePullProgress {
            bytes_done: pull.bytes_done(),
            bytes_total: pull.bytes_total(),
            reference: pull.reference,
            started_at_unix_ms: pull.started_at_unix_ms,
            blobs: pull
                .blobs
                .into_iter()
                .map(|blob| api::BlobPullProgress {
                    digest: blob.digest,
                    bytes_done: blob.bytes_done,
                    bytes_total: blob.bytes_total,
                })
                .collect(),
        })
        .collect()
}

async fn image_pulls(State(state): State<AppState>) -> ApiResult<api::ImagePullList> {
    image_store(&state)?;
    Ok(Json(api::ImagePullList {
        pulls: pull_progress(&state),
    }))
}

async fn images(State(state): State<AppState>) -> ApiResult<api::ImageList> {
    let store = image_store(&state)?;
    let users = state.server.image_users().await;
    let images = store
        .list()
        .into_iter()
        .map(|(reference, entry)| api::ImageInfo {
            used_by: users.get(&reference).cloned().unwrap_or_default(),
            reference,
            manifest: entry.manifest,
            config: entry.config,
            layers: entry.layers.into_iter().map(|l| l.digest).collect(),
            size: entry.size,
            pulled_at_unix: entry.pulled_at,
        })
        .collect();
    // A listing and a stat per blob; no lock of a pull is taken.
    let blob_bytes = store
        .blob_bytes()
        .map_err(|err| ApiFailure::new(api::ErrorCode::Unavailable, err.to_string()))?;
    // A walk of the store's dir, the same measure the quota is checked with.
    let store_bytes = store
        .disk_bytes()
        .map_err(|err| ApiFailure::new(api::ErrorCode::Unavailable, err.to_string()))?;
    Ok(Json(api::ImageList {
        images,
        blob_bytes,
        store_bytes,
        store_max_bytes: store.image_limits().store_max_bytes,
    }))
}

async fn prune_images(State(state): State<AppState>) -> ApiResult<api::ImagePruneResponse> {
    let pruned = state.server.prune_images().await?;
    Ok(Json(api::ImagePruneResponse {
        removed: pruned.references,
        rootfs_removed: pruned.rootfs,
        layers_removed: pruned.layers,
        blobs_removed: pruned.blobs,
    }))
}

async fn pull_image(
    State(state): State<AppState>,
    body: Bytes,
) -> ApiResult<api::ImagePullResponse> {
    let request: api::ImagePullRequest = parse_body("POST /v1/images/pull", &body)?;
    let store = image_store(&state)?;
    let reference = store
        .resolve(&request.reference)
        .map_err(|err| ApiFailure::invalid(err.to_string()))?;
    let prepared = store
        .ensure(&reference, PullPolicy::Always)
        .await
        .map_err(ApiFailure::from)?;
    let size = store
        .list()
        .get(&prepared.reference)
        .map_or(0, |entry| entry.size);
    Ok(Json(api::ImagePullResponse {
        reference: prepared.reference,
        manifest: prepared.manifest.to_string(),
        size,
        downloaded: prepared
            .downloaded
            .iter()
            .map(ToString::to_string)
            .collect(),
    }))
}

/// What is read and dropped of an archive the engine refused before its end; past it the
/// connection is closed on the sender.
use crate::listener::MAX_DRAIN_BYTES;

#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct ImportQuery {
    name: Option<String>,
}

/// `POST /v1/images/import?name=REF`: the body, a tar archive, is streamed to the engine as it
/// arrives (never held whole), bounded by `--image-import-max-bytes` and, per wait, by
/// `--body-timeout-ms`.
async fn import_images(
    State(state): State<AppState>,
    query: Result<Query<ImportQuery>, axum::extract::rejection::QueryRejection>,
    body: axum::body::Body,
) -> Response {
    use futures::StreamExt;
    use std::sync::atomic::{AtomicBool, Ordering};
    let query = match query {
        Ok(Query(query)) => query,
        Err(e) => {
            return ApiFailure::invalid(format!(
                "query of POST /v1/images/import is not valid: {e}; use name=REF or nothing"
            ))
            .into_response();
        }
    };
    let store = match image_store(&state) {
        Ok(store) => Arc::clone(store),
        Err(failure) => return failure.into_response(),
    };
    let settings = state.import;
    let limits = csi_agent::image::import::ImportLimits {
        max_archive_bytes: settings.max_bytes,
        ..Default::default()
    };
    let (tx, rx) = tokio::sync::mpsc::channel::<std::io::Result<Bytes>>(16);
    let stalled = AtomicBool::new(false);
    let forward = async {
        let mut stream = body.into_data_stream();
        let mut drained: u64 = 0;
        loop {
            match tokio::time::timeout(settings.idle_timeout, stream.next()).await {
                Ok(Some(Ok(chunk))) => {
                    // The engine stops reading once it has refused the archive. The rest is
                    // read and dropped, up to a bound, so that the client (still sending)
                    // reads the answer instead of a broken pipe.
                    if drained > 0 || tx.send(Ok(chunk.clone())).await.is_err() {
                        drained += chunk.len() as u64;
                        if drained > MAX_DRAIN_BYTES {
                            break;
                        }
                    }
                }
                Ok(Some(Err(err))) => {
                    let _ = tx.send(Err(std::io::Error::other(err.to_string()))).await;
                    break;
                }
                Ok(None) => break,
                Err(_) => {
                    stalled.store(true, Ordering::SeqCst);
                    let _ = tx
                        .send(Err(std::io::Error::new(
                            std::io::ErrorKind::TimedOut,
                            "the upload stalled",
                        )))
                        .await;
                    break;
                }
            }
        }
        drop(tx);
    };
    let reader = csi_agent::image::pull::ChannelReader::new(rx);
    let import = store.import(reader, query.name.as_deref(), &limits);
    let ((), result) = tokio::join!(forward, import);
    let imported = match result {
        Ok(imported) => imported,
        Err(err) => {
            use csi_agent::image::import::ImportError;
            // The HTTP level first (the body was too large, or stalled), then the error's
            // own code (convert::import_code).
            let (status, code) = if matches!(err, ImportError::TooLarge { .. }) {
                (
                    StatusCode::PAYLOAD_TOO_LARGE,
                    api::ErrorCode::InvalidRequest,
                )
            } else if stalled.load(Ordering::SeqCst) {
                (StatusCode::REQUEST_TIMEOUT, api::ErrorCode::InvalidRequest)
            } else {
                let code = crate::convert::import_code(&err);
                (
                    StatusCode::from_u16(code.http_status())
                        .unwrap_or(StatusCode::INTERNAL_SERVER_ERROR),
                    code,
                )
            };
            let message = if status == StatusCode::PAYLOAD_TOO_LARGE {
                format!("{err} (--image-import-max-bytes)")
            } else if status == StatusCode::REQUEST_TIMEOUT {
                format!(
                    "{err}: no part of the archive arrived for {} ms (--body-timeout-ms)",
                    settings.idle_timeout.as_millis()
                )
            } else {
                err.to_string()
            };
            let mut response = ApiFailure::new(code, message).into_response();
            *response.status_mut() = status;
            // The rest of the body may be unread.
            response.headers_mut().insert(
                header::CONNECTION,
                header::HeaderValue::from_static("close"),
            );
            return response;
        }
    };
    let users = state.server.image_users().await;
    let images = imported
        .into_iter()
        .map(|image| api::ImageInfo {
            used_by: users.get(&image.reference).cloned().unwrap_or_default(),
            reference: image.reference,
            manifest: image.entry.manifest,
            config: image.entry.config,
            layers: image.entry.layers.into_iter().map(|l| l.digest).collect(),
            size: image.entry.size,
            pulled_at_unix: image.entry.pulled_at,
        })
        .collect();
    Json(api::ImageImportResponse { images }).into_response()
}

async fn publish(State(state): State<AppState>, body: Bytes) -> ApiResult<api::PublishResponse> {
    let request: api::PublishRequest = parse_body("POST /v1/volumes/publish", &body)?;
    if request.plugin.is_empty() {
        return Err(ApiFailure::invalid(
            "plugin is empty: give the plugin's type",
        ));
    }
    let capability = convert::capability(&request.capability)?;
    // The engine checks bind_to (roots, form, NUL) before anything else happens.
    let bind_to = request.bind_to.as_ref().map(PathBuf::from);
    let secrets = request.secrets.clone().unwrap_or_default();
    state.server.refuse_if_drained()?;
    let plugin = state.server.plugin(&request.plugin).await?;
    let published = plugin
        .volumes
        .publish(PublishRequest {
            volume_id: request.volume_id.clone(),
            workload: request.workload.clone(),
            capability,
            readonly: request.readonly,
            volume_context: request.volume_context.clone(),
            secrets: VolumeSecrets {
                node_stage: secrets.node_stage,
                node_publish: secrets.node_publish,
            },
            bind_to,
        })
        .await?;
    let work_dir = state.server.work_dir();
    Ok(Json(api::PublishResponse {
        target_path: published.target_path.to_string_lossy().into_owned(),
        target_path_relative: convert::relative(work_dir, &published.target_path),
        state: published.state.as_str().to_owned(),
        bind_to: published.bind_to.map(|p| p.to_string_lossy().into_owned()),
    }))
}

async fn unpublish(
    State(state): State<AppState>,
    body: Bytes,
) -> ApiResult<api::UnpublishResponse> {
    let request: api::UnpublishRequest = parse_body("POST /v1/volumes/unpublish", &body)?;
    let plugin = state.server.plugin(&request.plugin).await?;
    // From the read snapshot, before the operation: advisory (a publish racing with this
    // unpublish may be ordered either way), it only tells the caller nothing was there.
    let was_claimed = plugin
        .volumes
        .get(&request.volume_id)
        .await
        .is_some_and(|record| record.claims.contains(&request.workload));
    plugin
        .volumes
        .unpublish(&request.volume_id, &request.workload)
        .await?;
    let state_name = plugin
        .volumes
        .get(&request.volume_id)
        .await
        .map(|r| r.state.as_str().to_owned())
        .unwrap_or_else(|| "UNPUBLISHED".to_owned());
    Ok(Json(api::UnpublishResponse {
        state: state_name,
        was_claimed,
    }))
}

/// Refuses a filter given with an empty value: it would match nothing and answer an empty
/// list, silently, and a client that built `?plugin=$P` from an empty variable would take it
/// for "nothing there". `what` names what the list holds.
fn refuse_empty_filters(what: &str, filters: &[(&str, &Option<String>)]) -> Result<(), ApiFailure> {
    for (name, value) in filters {
        if value.as_deref() == Some("") {
            return Err(ApiFailure::invalid(format!(
                "{name}= is empty: give a value, or leave the {name} filter out to list every {what}"
            )));
        }
    }
    Ok(())
}

/// The most volumes one page holds.
const MAX_PAGE: usize = 10_000;

/// `GET /v1/volumes`: answered from the volume managers' read snapshots, never waiting for
/// the start gate or an operation in progress; `recovering` says the list may still grow.
async fn volumes(
    State(state): State<AppState>,
    query: Result<Query<api::VolumeQuery>, axum::extract::rejection::QueryRejection>,
) -> Result<VolumePage, ApiFailure> {
    let Query(query) = query.map_err(|e| {
        ApiFailure::invalid(format!(
            "query of GET /v1/volumes is not valid: {e}; use plugin=, state=, workload=, limit=<1..{MAX_PAGE}>, page_token="
        ))
    })?;
    refuse_empty_filters(
        "volume",
        &[
            ("plugin", &query.plugin),
            ("state", &query.state),
            ("workload", &query.workload),
        ],
    )?;
    let limit = match query.limit {
        None => usize::MAX,
        Some(limit @ 1..=MAX_PAGE) => limit,
        Some(other) => {
            return Err(ApiFailure::invalid(format!(
                "limit {other} is out of range: give 1 to {MAX_PAGE}"
            )));
        }
    };
    let after = match &query.page_token {
        None => None,
        Some(token) => Some(parse_page_token(token).ok_or_else(|| {
            ApiFailure::invalid(format!(
                "page_token {token:?} is not one this API gave out: pass next_page_token from the previous page unchanged"
            ))
        })?),
    };
    let recovering = !state.server.is_recovered();
    let (reports, _) = state.server.plugins().await;
    let mut plugins: Vec<String> = reports
        .iter()
        .map(|r| r.loaded.config.plugin_type.clone())
        .filter(|t| query.plugin.as_ref().is_none_or(|p| p == t))
        .collect();
    plugins.sort();
    let mut page = VolumePage {
        parts: Vec::new(),
        next_page_token: None,
        recovering,
        work_dir: state.server.work_dir().to_path_buf(),
    };
    let mut taken = 0;
    'plugins: for plugin_type in &plugins {
        let Some(plugin) = state.server.plugin_if_loaded(plugin_type).await else {
            continue;
        };
        let mut records = Vec::new();
        let mut full = false;
        for record in plugin.volumes.list_snapshot() {
            if after.as_ref().is_some_and(|(after_plugin, after_volume)| {
                (plugin_type.as_str(), record.volume_id.as_str())
                    <= (after_plugin.as_str(), after_volume.as_str())
            }) || query
                .state
                .as_ref()
                .is_some_and(|s| s != record.state.as_str())
                || query
                    .workload
                    .as_ref()
                    .is_some_and(|w| !record.claims.contains(w))
            {
                continue;
            }
            if taken == limit {
                full = true;
                break;
            }
            taken += 1;
            records.push(record);
        }
        page.parts.push(PluginPart {
            plugin_type: plugin_type.clone(),
            plugin,
            records,
        });
        if full {
            page.next_page_token = page
                .last()
                .map(|(plugin, volume_id)| page_token(plugin, volume_id));
            break 'plugins;
        }
    }
    Ok(page)
}

/// A position in the list, ordered as the list is (plugin, then volume id): each part is
/// percent-encoded (`layout::encode_id`), which never yields the `.` between them.
fn page_token(plugin_type: &str, volume_id: &str) -> String {
    format!(
        "{}.{}",
        csi_agent::layout::encode_id(plugin_type),
        csi_agent::layout::encode_id(volume_id)
    )
}

/// The raw (plugin, volume id) a [`page_token`] stands for; compared raw, because the
/// percent-encoding does not keep the order of the ids it encodes.
fn parse_page_token(token: &str) -> Option<(String, String)> {
    let (plugin, volume) = token.split_once('.')?;
    Some((
        csi_agent::layout::decode_id(plugin)?,
        csi_agent::layout::decode_id(volume)?,
    ))
}

async fn volume(
    State(state): State<AppState>,
    Params((plugin_type, volume_id)): Params<(String, String)>,
) -> ApiResult<api::VolumeInfo> {
    csi_agent::volume::validate_id("volume_id", &volume_id)?;
    let plugin = state.server.plugin(&plugin_type).await?;
    let record = plugin.volumes.get(&volume_id).await.ok_or_else(|| {
        ApiFailure::new(
            api::ErrorCode::NotFound,
            format!("plugin {plugin_type} has no volume {volume_id:?} on this node"),
        )
    })?;
    let mut info = volume_answer(&state, &plugin_type, &plugin.volumes, &record);
    // Only this single-volume read asks ControllerGetVolume (bounded, outside the volume lock).
    info.controller = topology::controller_status(&plugin.volumes, &volume_id).await;
    Ok(Json(info))
}

/// One tracked volume as the API shows it: its record, the operation in progress on it, and
/// its target path (absolute and relative to the work dir).
fn volume_answer(
    state: &AppState,
    plugin_type: &str,
    volumes: &csi_agent::volume::VolumeManager,
    record: &csi_agent::volume::VolumeRecord,
) -> api::VolumeInfo {
    let volume_id = &record.volume_id;
    let mut info = convert::volume_info(
        plugin_type,
        record,
        volumes.progress(volume_id),
        &volumes.target_path(volume_id),
        state.server.work_dir(),
    );
    info.condition = stats::volume_condition(volumes, volume_id);
    info
}

async fn create_volume(
    State(state): State<AppState>,
    body: Bytes,
) -> Result<(StatusCode, Json<api::CreateVolumeResponse>), ApiFailure> {
    let request: api::CreateVolumeRequest = parse_body("POST /v1/volumes", &body)?;
    let capability = convert::capability(&request.capability)?;
    state.server.refuse_if_drained()?;
    let source = snapshot::content_source(request.content_source)?;
    let plugin = state.server.plugin(&request.plugin).await?;
    let requirements = request
        .accessibility_requirements
        .as_ref()
        .map(topology::requirements);
    let created = plugin
        .volumes
        .create_volume(NewVolume {
            parameters: request.parameters,
            accessibility: requirements.as_ref(),
            content_source: source,
            ..NewVolume::new(&request.name, request.capacity_bytes, &capability)
        })
        .await
        .map_err(|err| {
            topology::create_failure(
                &plugin.volumes,
                request.accessibility_requirements.is_some(),
                err,
            )
        })?;
    Ok((
        StatusCode::CREATED,
        Json(api::CreateVolumeResponse {
            volume_id: created.volume_id,
            capacity_bytes: created.capacity_bytes,
            volume_context: created.volume_context,
            accessible_topology: created.accessible_topology,
        }),
    ))
}

async fn delete_volume(
    State(state): State<AppState>,
    Params((plugin_type, volume_id)): Params<(String, String)>,
) -> ApiResult<api::DeleteVolumeResponse> {
    let plugin = state.server.plugin(&plugin_type).await?;
    plugin
        .volumes
        .delete_volume(&volume_id, BTreeMap::new())
        .await?;
    Ok(Json(api::DeleteVolumeResponse { deleted: true }))
}

async fn validate(State(state): State<AppState>, body: Bytes) -> ApiResult<api::ValidateResponse> {
    let request: api::ValidateRequest = parse_body("POST /v1/volumes/validate", &body)?;
    let capabilities = request
        .capabilities
        .iter()
        .map(convert::capability)
        .collect::<Result<Vec<_>, _>>()?;
    let plugin = state.server.plugin(&request.plugin).await?;
    let validation = plugin
        .volumes
        .validate_volume_capabilities(
            &request.volume_id,
            &capabilities,
            request.volume_context,
            request.parameters,
        )
        .await?;
    Ok(Json(api::ValidateResponse {
        confirmed: validation.confirmed,
        message: validation.message,
    }))
}

#[derive(Debug, serde::Deserialize)]
struct PageQuery {
    #[serde(default)]
    max_entries: i32,
    #[serde(default)]
    starting_token: String,
}

async fn backend_volumes(
    State(state): State<AppState>,
    Params(plugin_type): Params<String>,
    query: Result<Query<PageQuery>, axum::extract::rejection::QueryRejection>,
) -> ApiResult<api::BackendVolumePage> {
    let Query(query) = query.map_err(|e| {
        ApiFailure::invalid(format!(
            "query of GET /v1/plugins/{{type}}/backend-volumes is not valid: {e}; use max_entries=<number>&starting_token=<token>"
        ))
    })?;
    let plugin = state.server.plugin(&plugin_type).await?;
    let page = plugin
        .volumes
        .list_backend_volumes(query.max_entries, &query.starting_token)
        .await
        .map_err(|err| list_failure(err, &query.starting_token))?;
    Ok(Json(api::BackendVolumePage {
        volumes: page
            .volumes
            .into_iter()
            .map(|v| api::BackendVolume {
                volume_id: v.volume_id,
                capacity_bytes: v.capacity_bytes,
                volume_context: v.volume_context,
            })
            .collect(),
        next_token: page.next_token,
    }))
}

/// A failed ListVolumes. Its `ABORTED` is the CSI spec's "starting_token is not valid": the
/// caller's mistake (400, with the plugin's code), not the plugin being unavailable (503),
/// which ABORTED means for every other RPC.
fn list_failure(err: VolumeError, starting_token: &str) -> ApiFailure {
    match &err {
        VolumeError::Plugin(rpc)
            if matches!(rpc.kind, RpcErrorKind::Status { .. })
                && code_name(rpc.code()) == "ABORTED" =>
        {
            ApiFailure(api::ErrorBody {
                code: api::ErrorCode::InvalidRequest,
                message: format!(
                    "starting_token {starting_token:?} is not valid ({err}): pass the next_token \
                     of the previous page unchanged, or none for the first page"
                ),
                grpc_code: Some(code_name(rpc.code()).to_owned()),
            })
        }
        _ => err.into(),
    }
}

async fn capacity(State(state): State<AppState>, body: Bytes) -> ApiResult<api::CapacityResponse> {
    let request: api::CapacityRequest = parse_body("POST /v1/capacity", &body)?;
    let capabilities = request
        .capabilities
        .iter()
        .map(convert::capability)
        .collect::<Result<Vec<_>, _>>()?;
    let plugin = state.server.plugin(&request.plugin).await?;
    let available = plugin
        .volumes
        .get_capacity(
            &capabilities,
            request.parameters,
            request.accessible_topology.as_ref(),
        )
        .await?;
    Ok(Json(api::CapacityResponse {
        available_capacity: available,
    }))
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    /// The router serves `routes::ALL_ROUTES` only through [`handler`]: a route added to the
    /// list without an arm there would be listed, documented and never served.
    #[test]
    fn every_route_has_a_handler() {
        let unserved: Vec<_> = api::routes::ALL_ROUTES
            .iter()
            .filter(|(method, path)| handler(method, path).is_none())
            .collect();
        assert!(
            unserved.is_empty(),
            "routes of routes::ALL_ROUTES without an arm in api.rs's `handler`: {unserved:?}; \
             add one for each"
        );
        assert!(handler("GET", "/v1/no-such-route").is_none());
        assert!(handler("POST", api::routes::HEALTH).is_none());
    }

    fn refusal<T: DeserializeOwned + std::fmt::Debug>(route: &str, body: &str) -> String {
        let failure = parse_body::<T>(route, &Bytes::from(body.to_owned()))
            .expect_err("a body that is not an object must be refused");
        failure.0.message
    }

    #[test]
    fn a_body_that_is_not_an_object_is_refused_naming_the_route() {
        // Arrays serde would have taken for structs, and other JSON values.
        for body in ["[]", " [\"p\"]", "null", "1", "\"x\""] {
            let message = refusal::<api::DrainRequest>("POST /v1/drain", body);
            assert!(
                message.contains("POST /v1/drain") && message.contains("JSON object"),
                "{body}: {message}"
            );
        }
        let message = refusal::<api::CapacityRequest>("POST /v1/capacity", "[\"p\"]");
        assert!(message.contains("JSON object"), "{message}");
        // An object still parses; leading whitespace is fine.
        let request: api::DrainRequest = parse_body(
            "POST /v1/drain",
            &Bytes::from_static(b" \n{\"timeout_secs\": 5}"),
        )
        .unwrap();
        assert_eq!(request.timeout_secs, Some(5));
    }

    #[test]
    fn a_null_drain_timeout_is_refused_not_taken_for_the_default() {
        let message = refusal::<api::DrainRequest>("POST /v1/drain", r#"{"timeout_secs": null}"#);
        assert!(message.contains("invalid type: null"), "{message}");
    }
}
