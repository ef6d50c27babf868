//! [`ApiClient`]: a typed client for csi-agentd's HTTP/JSON API, over the unix socket or over
//! the TCP listener with a bearer token.
//!
//! This module owns the transport (HTTP/1.1, connections kept alive and reused through
//! hyper-util's pooling client, shared by every clone of a client) and the mapping of answers to
//! types or [`ApiError`]s. It must not interpret answers beyond that (no retries, no hints for a
//! particular program): callers decide what a failure means for them.

use std::error::Error as StdError;
use std::fmt;
use std::future::Future;
use std::io;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Bytes;
use hyper::header::{ACCEPT, AUTHORIZATION, CONTENT_TYPE, HeaderValue, USER_AGENT};
use hyper::{Method, Request, Uri};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use serde::Serialize;
use serde::de::DeserializeOwned;
use tokio::net::UnixStream;

use crate::error::ApiError;
use crate::routes;
use crate::types::*;

// Streaming uploads (`import_image`): beside the JSON transport, with a connection of their own.
mod cluster;
mod snapshot;
mod upload;

/// Bodies larger than this are refused rather than buffered: no legitimate answer comes near
/// it (10,000 volumes list in a few MiB), and a runaway peer must not exhaust memory.
const MAX_BODY_BYTES: usize = 256 * 1024 * 1024;

/// How long a connection may sit idle in the pool before it is closed. Well below the
/// daemon's own idle timeout (60 s by default, docs/configuration.md), so that the client, not
/// the daemon, closes an idle connection: a daemon closing one just as a request is written on
/// it would fail that request.
const POOL_IDLE_TIMEOUT: Duration = Duration::from_secs(5);

/// A client of one csi-agentd. Cheap to clone; clones share one pool of kept-alive
/// connections, so that a program making many calls (a scheduler, the benchmarks) pays the
/// connection set-up once per concurrent caller, not once per call.
#[derive(Clone)]
pub struct ApiClient {
    endpoint: Endpoint,
    pool: Pool,
    timeout: Option<Duration>,
}

/// A request body: a whole JSON document, or an archive streamed in chunks (`upload`).
type RequestBody = UnsyncBoxBody<Bytes, io::Error>;

/// The pooling HTTP client for the endpoint's transport.
#[derive(Clone)]
enum Pool {
    Unix(Client<UnixConnector, RequestBody>),
    Tcp(Client<HttpConnector, RequestBody>),
}

impl Pool {
    fn unix(socket: &Path) -> Pool {
        Pool::Unix(pool_builder().build(UnixConnector {
            socket: Arc::from(socket),
        }))
    }

    fn tcp() -> Pool {
        let mut connector = HttpConnector::new();
        // Requests are small and answered at once; Nagle would only add latency.
        connector.set_nodelay(true);
        Pool::Tcp(pool_builder().build(connector))
    }
}

fn pool_builder() -> hyper_util::client::legacy::Builder {
    let mut builder = Client::builder(TokioExecutor::new());
    builder
        .pool_idle_timeout(POOL_IDLE_TIMEOUT)
        .pool_timer(TokioTimer::new());
    builder
}

/// Connects to the daemon's unix socket, whatever the request's URI names.
#[derive(Clone)]
struct UnixConnector {
    socket: Arc<Path>,
}

impl tower::Service<Uri> for UnixConnector {
    type Response = TokioIo<UnixStream>;
    type Error = io::Error;
    type Future = Pin<Box<dyn Future<Output = io::Result<TokioIo<UnixStream>>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, _: Uri) -> Self::Future {
        let socket = Arc::clone(&self.socket);
        Box::pin(async move { UnixStream::connect(&*socket).await.map(TokioIo::new) })
    }
}

#[derive(Clone)]
enum Endpoint {
    Unix {
        socket: PathBuf,
    },
    Tcp {
        /// As the caller wrote it, for messages.
        url: String,
        /// `host:port` as in the URL, for connecting and the `Host` header.
        authority: String,
        /// `Bearer <token>`, marked sensitive so that hyper never logs it.
        authorization: Option<HeaderValue>,
    },
}

// By hand, so that the bearer token can never reach a log through `{:?}`.
impl fmt::Debug for ApiClient {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut s = f.debug_struct("ApiClient");
        match &self.endpoint {
            Endpoint::Unix { socket } => s.field("socket", socket),
            Endpoint::Tcp {
                url, authorization, ..
            } => s.field("url", url).field(
                "token",
                &if authorization.is_some() {
                    "<redacted>"
                } else {
                    "<none>"
                },
            ),
        };
        s.field("timeout", &self.timeout).finish()
    }
}

impl ApiClient {
    /// A client of the daemon listening on the unix socket at `socket` (usually
    /// `<work_dir>/api.sock`). Nothing is connected until the first call.
    pub fn unix(socket: impl Into<PathBuf>) -> ApiClient {
        let socket = socket.into();
        ApiClient {
            pool: Pool::unix(&socket),
            endpoint: Endpoint::Unix { socket },
            timeout: None,
        }
    }

    /// A client of the daemon's TCP listener at `url` (`http://host:port`), sending
    /// `Authorization: Bearer <token>` when a token is given. Surrounding whitespace of the token
    /// (a token file's trailing newline) is ignored.
    pub fn tcp(url: &str, token: Option<&str>) -> Result<ApiClient, ApiError> {
        let invalid = |reason: &str| ApiError::InvalidUrl {
            url: url.to_owned(),
            reason: reason.to_owned(),
        };
        let uri: Uri = url
            .parse()
            .map_err(|err| invalid(&format!("{err}; expected http://HOST:PORT")))?;
        match uri.scheme_str() {
            Some("http") => {}
            Some("https") => {
                return Err(invalid(
                    "https is not supported: csi-agentd's TCP listener speaks plain HTTP; \
                     use http://, behind a TLS proxy or an SSH tunnel if the network is untrusted",
                ));
            }
            _ => return Err(invalid("expected http://HOST:PORT")),
        }
        let Some(authority) = uri.authority() else {
            return Err(invalid("no host; expected http://HOST:PORT"));
        };
        if !matches!(uri.path(), "" | "/") || uri.query().is_some() {
            return Err(invalid(
                "a path or query is not allowed; expected http://HOST:PORT",
            ));
        }
        if authority.as_str().contains('@') {
            return Err(invalid(
                "credentials in the URL are not supported; use a token file",
            ));
        }
        let authorization = match token {
            Some(token) => Some(bearer(token.trim())?),
            None => None,
        };
        Ok(ApiClient {
            endpoint: Endpoint::Tcp {
                url: url.to_owned(),
                authority: authority.as_str().to_owned(),
                authorization,
            },
            pool: Pool::tcp(),
            timeout: None,
        })
    }

    /// Gives up on a call (connect, request and whole answer) after `timeout`. `None`, the
    /// default, waits as long as the daemon takes: a publish may legitimately wait through a
    /// plugin restart.
    pub fn with_timeout(mut self, timeout: Option<Duration>) -> ApiClient {
        self.timeout = timeout;
        self
    }

    /// The same client with a pool of its own, empty: its first call opens a new connection.
    /// For a request that cannot be sent again (a streamed upload): a kept-alive connection
    /// the daemon has just closed would fail it half-written.
    fn with_fresh_pool(&self) -> ApiClient {
        ApiClient {
            endpoint: self.endpoint.clone(),
            pool: match &self.endpoint {
                Endpoint::Unix { socket } => Pool::unix(socket),
                Endpoint::Tcp { .. } => Pool::tcp(),
            },
            timeout: self.timeout,
        }
    }

    /// The socket path or URL this client talks to, for messages.
    pub fn endpoint(&self) -> String {
        match &self.endpoint {
            Endpoint::Unix { socket } => socket.display().to_string(),
            Endpoint::Tcp { url, .. } => url.clone(),
        }
    }

    /// The unix socket path, when this client uses one.
    pub fn socket(&self) -> Option<&Path> {
        match &self.endpoint {
            Endpoint::Unix { socket } => Some(socket),
            Endpoint::Tcp { .. } => None,
        }
    }

    /// `GET /v1/health`
    pub async fn health(&self) -> Result<Health, ApiError> {
        self.get_json(routes::HEALTH).await
    }

    /// `POST /v1/start`: opens the start gate (idempotent).
    pub async fn start(&self) -> Result<StartResponse, ApiError> {
        self.call_json(Method::POST, routes::START, None).await
    }

    /// `GET /metrics`: the metrics text (OpenMetrics format, which Prometheus scrapes), as is.
    pub async fn metrics(&self) -> Result<String, ApiError> {
        let (status, body) = self.send(Method::GET, routes::METRICS, None).await?;
        if !is_success(status) {
            return Err(error_from(status, &body));
        }
        String::from_utf8(body.to_vec())
            .map_err(|_| ApiError::decode(status, "the metrics are not UTF-8 text", &body))
    }

    /// `GET /v1/plugins`
    pub async fn plugins(&self) -> Result<PluginList, ApiError> {
        self.get_json(routes::PLUGINS).await
    }

    /// `GET /v1/plugins/{type}`
    pub async fn plugin(&self, plugin_type: &str) -> Result<PluginInfo, ApiError> {
        self.get_json(&routes::plugin(plugin_type)).await
    }

    /// `POST /v1/plugins/reload`: re-reads the plugin configuration directory.
    pub async fn reload(&self) -> Result<ReloadReport, ApiError> {
        self.call_json(Method::POST, routes::PLUGINS_RELOAD, None)
            .await
    }

    /// `POST /v1/drain`: unpublishes every claim and stops every plugin. May take as long as
    /// the unpublishes do.
    pub async fn drain(&self) -> Result<DrainReport, ApiError> {
        self.call_json(Method::POST, routes::DRAIN, None).await
    }

    /// `POST /v1/drain` with its options (a timeout other than the default).
    pub async fn drain_with(&self, request: &DrainRequest) -> Result<DrainReport, ApiError> {
        self.post_json(routes::DRAIN, request).await
    }

    /// `GET /v1/images`
    pub async fn images(&self) -> Result<ImageList, ApiError> {
        self.get_json(routes::IMAGES).await
    }

    /// `POST /v1/images/prune`: removes the images no configured plugin names.
    pub async fn prune_images(&self) -> Result<ImagePruneResponse, ApiError> {
        self.call_json(Method::POST, routes::IMAGES_PRUNE, None)
            .await
    }

    /// `POST /v1/images/pull`: pulls and prepares an image (the tag re-checked).
    pub async fn pull_image(&self, reference: &str) -> Result<ImagePullResponse, ApiError> {
        let request = ImagePullRequest {
            reference: reference.to_owned(),
        };
        self.post_json(routes::IMAGES_PULL, &request).await
    }

    /// `GET /v1/images/pulls`: the pulls in flight, with their bytes per blob.
    pub async fn image_pulls(&self) -> Result<ImagePullList, ApiError> {
        self.get_json(routes::IMAGES_PULLS).await
    }

    /// `POST /v1/volumes/publish`
    pub async fn publish(&self, request: &PublishRequest) -> Result<PublishResponse, ApiError> {
        self.post_json(routes::PUBLISH, request).await
    }

    /// `POST /v1/volumes/unpublish`
    pub async fn unpublish(
        &self,
        request: &UnpublishRequest,
    ) -> Result<UnpublishResponse, ApiError> {
        self.post_json(routes::UNPUBLISH, request).await
    }

    /// `GET /v1/volumes`
    pub async fn volumes(&self) -> Result<VolumeList, ApiError> {
        self.get_json(routes::VOLUMES).await
    }

    /// `GET /v1/volumes?...`: one page of the volumes matching `query`.
    pub async fn volumes_matching(&self, query: &VolumeQuery) -> Result<VolumeList, ApiError> {
        let encoded = serde_urlencoded::to_string(query).map_err(ApiError::EncodeQuery)?;
        if encoded.is_empty() {
            return self.volumes().await;
        }
        self.get_json(&format!("{}?{encoded}", routes::VOLUMES))
            .await
    }

    /// `GET /v1/volumes/{plugin}/{volume_id}`
    pub async fn volume(&self, plugin: &str, volume_id: &str) -> Result<VolumeInfo, ApiError> {
        self.get_json(&routes::volume(plugin, volume_id)).await
    }

    /// `GET /v1/volumes/{plugin}/{volume_id}/stats` (NodeGetVolumeStats)
    pub async fn volume_stats(
        &self,
        plugin: &str,
        volume_id: &str,
    ) -> Result<crate::types::VolumeStats, ApiError> {
        self.get_json(&routes::volume_stats(plugin, volume_id))
            .await
    }

    /// `POST /v1/volumes` (CreateVolume)
    pub async fn create_volume(
        &self,
        request: &CreateVolumeRequest,
    ) -> Result<CreateVolumeResponse, ApiError> {
        self.post_json(routes::VOLUMES, request).await
    }

    /// `DELETE /v1/volumes/{plugin}/{volume_id}` (DeleteVolume)
    pub async fn delete_volume(
        &self,
        plugin: &str,
        volume_id: &str,
    ) -> Result<DeleteVolumeResponse, ApiError> {
        self.call_json(Method::DELETE, &routes::volume(plugin, volume_id), None)
            .await
    }

    /// `POST /v1/volumes/validate` (ValidateVolumeCapabilities)
    pub async fn validate(&self, request: &ValidateRequest) -> Result<ValidateResponse, ApiError> {
        self.post_json(routes::VALIDATE, request).await
    }

    /// `GET /v1/plugins/{type}/backend-volumes` (ListVolumes): one page. Pass the previous
    /// page's `next_token` as `starting_token` for the next one.
    pub async fn backend_volumes(
        &self,
        plugin_type: &str,
        max_entries: Option<u32>,
        starting_token: Option<&str>,
    ) -> Result<BackendVolumePage, ApiError> {
        let max_entries = max_entries.map(|n| n.to_string());
        let path = format!(
            "{}{}",
            routes::backend_volumes(plugin_type),
            routes::query(&[
                ("max_entries", max_entries.as_deref()),
                ("starting_token", starting_token),
            ])
        );
        self.get_json(&path).await
    }

    /// `POST /v1/capacity` (GetCapacity)
    pub async fn capacity(&self, request: &CapacityRequest) -> Result<CapacityResponse, ApiError> {
        self.post_json(routes::CAPACITY, request).await
    }

    /// `POST path` with a JSON `body`, answered with the status and the body as they came:
    /// for a protocol served beside the API on a socket of its own (the Docker volume plugin
    /// protocol of `--volume-plugin-socket`, docs/docker-podman.md), whose answers are not in
    /// the API's shape.
    pub async fn post_raw(
        &self,
        path: &str,
        body: &serde_json::Value,
    ) -> Result<(u16, serde_json::Value), ApiError> {
        let body = serde_json::to_vec(body).map_err(ApiError::Encode)?;
        let (status, bytes) = self.send(Method::POST, path, Some(body)).await?;
        let value = serde_json::from_slice(&bytes)
            .map_err(|err| ApiError::decode(status, format!("not JSON: {err}"), &bytes))?;
        Ok((status, value))
    }

    async fn get_json<T: DeserializeOwned>(&self, path: &str) -> Result<T, ApiError> {
        self.call_json(Method::GET, path, None).await
    }

    async fn post_json<B: Serialize, T: DeserializeOwned>(
        &self,
        path: &str,
        body: &B,
    ) -> Result<T, ApiError> {
        // The API's request types serialize infallibly (string-keyed maps, no custom
        // serializers); should that ever change, report it rather than panic.
        let body = serde_json::to_vec(body).map_err(ApiError::Encode)?;
        self.call_json(Method::POST, path, Some(body)).await
    }

    async fn call_json<T: DeserializeOwned>(
        &self,
        method: Method,
        path: &str,
        body: Option<Vec<u8>>,
    ) -> Result<T, ApiError> {
        let (status, bytes) = self.send(method, path, body).await?;
        if !is_success(status) {
            return Err(error_from(status, &bytes));
        }
        serde_json::from_slice(&bytes).map_err(|err| {
            ApiError::decode(status, format!("not the expected JSON: {err}"), &bytes)
        })
    }

    /// One request on a pooled connection; the status and the whole body.
    async fn send(
        &self,
        method: Method,
        path: &str,
        body: Option<Vec<u8>>,
    ) -> Result<(u16, Bytes), ApiError> {
        let exchange = self.send_untimed(method, path, body);
        match self.timeout {
            None => exchange.await,
            Some(after) => {
                tokio::time::timeout(after, exchange)
                    .await
                    .map_err(|_| ApiError::Timeout {
                        endpoint: self.endpoint(),
                        after,
                    })?
            }
        }
    }

    async fn send_untimed(
        &self,
        method: Method,
        path: &str,
        body: Option<Vec<u8>>,
    ) -> Result<(u16, Bytes), ApiError> {
        let mut builder = self.request_builder(method, path);
        if body.is_some() {
            builder = builder.header(CONTENT_TYPE, "application/json");
        }
        let body = Full::new(Bytes::from(body.unwrap_or_default()))
            .map_err(|never| match never {})
            .boxed_unsync();
        self.round_trip(builder, path, body).await
    }

    /// A request to `path` with the headers every call sends (the bearer token on TCP).
    fn request_builder(&self, method: Method, path: &str) -> hyper::http::request::Builder {
        // The pooling client wants an absolute URI: its authority keys the pool and is the
        // `Host` header. On a unix socket any host will do (HTTP/1.1 only requires one).
        let (authority, authorization) = match &self.endpoint {
            Endpoint::Unix { .. } => ("localhost", None),
            Endpoint::Tcp {
                authority,
                authorization,
                ..
            } => (authority.as_str(), authorization.clone()),
        };
        let mut builder = Request::builder()
            .method(method)
            .uri(format!("http://{authority}{path}"))
            .header(ACCEPT, "application/json")
            .header(
                USER_AGENT,
                concat!("csi-agent-api/", env!("CARGO_PKG_VERSION")),
            );
        if let Some(authorization) = authorization {
            builder = builder.header(AUTHORIZATION, authorization);
        }
        builder
    }

    /// Sends the request on a pooled connection and reads the whole answer, bounded.
    async fn round_trip(
        &self,
        builder: hyper::http::request::Builder,
        path: &str,
        body: RequestBody,
    ) -> Result<(u16, Bytes), ApiError> {
        let request = builder.body(body).map_err(|err| ApiError::InvalidUrl {
            url: path.to_owned(),
            reason: err.to_string(),
        })?;
        let response = match &self.pool {
            Pool::Unix(client) => client.request(request).await,
            Pool::Tcp(client) => client.request(request).await,
        }
        .map_err(|err| self.request_error(err))?;
        let status = response.status().as_u16();
        let body = Limited::new(response.into_body(), MAX_BODY_BYTES)
            .collect()
            .await
            .map_err(|err| match err.downcast::<hyper::Error>() {
                Ok(source) => ApiError::Transport {
                    endpoint: self.endpoint(),
                    source: source as Box<dyn StdError + Send + Sync>,
                },
                Err(other) => ApiError::decode(
                    status,
                    format!("body larger than {MAX_BODY_BYTES} bytes ({other})"),
                    b"",
                ),
            })?
            .to_bytes();
        Ok((status, body))
    }

    /// The pooling client's error as the [`ApiError`] that names its cause: the connect
    /// error's `io::Error` (whose kind the hints depend on), or hyper's own error. Both are
    /// found in the source chain, by type, not by text.
    fn request_error(&self, err: hyper_util::client::legacy::Error) -> ApiError {
        if err.is_connect()
            && let Some(source) = find_source::<io::Error>(&err)
        {
            // The hints depend on the kind; the OS's code keeps its exact wording.
            let source = match source.raw_os_error() {
                Some(code) => io::Error::from_raw_os_error(code),
                None => io::Error::new(source.kind(), source.to_string()),
            };
            return match &self.endpoint {
                Endpoint::Unix { socket } => ApiError::Connect {
                    socket: socket.clone(),
                    source,
                },
                Endpoint::Tcp { url, .. } => ApiError::ConnectTcp {
                    url: url.clone(),
                    source,
                },
            };
        }
        ApiError::Transport {
            endpoint: self.endpoint(),
            source: Box::new(err),
        }
    }

    /// `POST /v1/volumes/{plugin}/{volume_id}/expand` (ControllerExpandVolume, then
    /// NodeExpandVolume where needed): the volume with its capacity after the expansion.
    pub async fn expand_volume(
        &self,
        plugin: &str,
        volume_id: &str,
        capacity_bytes: i64,
    ) -> Result<VolumeInfo, ApiError> {
        self.post_json(
            &routes::volume_expand(plugin, volume_id),
            &ExpandRequest { capacity_bytes },
        )
        .await
    }
}

/// The first error of type `E` in `err`'s source chain (`err` itself excluded).
fn find_source<'a, E: StdError + 'static>(err: &'a (dyn StdError + 'static)) -> Option<&'a E> {
    let mut cause = err.source();
    while let Some(current) = cause {
        if let Some(found) = current.downcast_ref::<E>() {
            return Some(found);
        }
        cause = current.source();
    }
    None
}

fn is_success(status: u16) -> bool {
    (200..300).contains(&status)
}

/// A non-2xx answer as an [`ApiError`].
fn error_from(status: u16, body: &[u8]) -> ApiError {
    if let Ok(body) = serde_json::from_slice::<ErrorBody>(body) {
        return ApiError::Api { status, body };
    }
    // A newer daemon may send an error code this client does not know; keep its message
    // (which says what to fix) and take the kind from the status rather than hide it all
    // behind a decode error.
    #[derive(serde::Deserialize)]
    struct LooseErrorBody {
        message: String,
        #[serde(default)]
        grpc_code: Option<String>,
    }
    match serde_json::from_slice::<LooseErrorBody>(body) {
        Ok(loose) => ApiError::Api {
            status,
            body: ErrorBody {
                code: ErrorCode::ALL
                    .into_iter()
                    .find(|code| code.http_status() == status)
                    .unwrap_or(ErrorCode::Internal),
                message: loose.message,
                grpc_code: loose.grpc_code,
            },
        },
        Err(_) => ApiError::decode(status, "not the API's error shape", body),
    }
}

/// `Bearer <token>` as a sensitive header value.
fn bearer(token: &str) -> Result<HeaderValue, ApiError> {
    if token.is_empty() {
        return Err(ApiError::InvalidToken {
            reason: "the token is empty".to_owned(),
        });
    }
    // The token itself must never appear in the message.
    let mut value =
        HeaderValue::from_str(&format!("Bearer {token}")).map_err(|_| ApiError::InvalidToken {
            reason: "it holds characters that cannot be sent in an HTTP header (control \
                     characters or non-ASCII)"
                .to_owned(),
        })?;
    value.set_sensitive(true);
    Ok(value)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tcp_url_is_parsed() -> Result<(), ApiError> {
        let client = ApiClient::tcp("http://127.0.0.1:7070", Some("s3cret\n"))?;
        assert_eq!(client.endpoint(), "http://127.0.0.1:7070");
        let Endpoint::Tcp {
            authority,
            authorization,
            ..
        } = &client.endpoint
        else {
            panic!("not a TCP endpoint");
        };
        assert_eq!(authority, "127.0.0.1:7070");
        assert_eq!(
            authorization.as_ref().map(|v| v.as_bytes()),
            Some(&b"Bearer s3cret"[..])
        );
        Ok(())
    }

    #[test]
    fn ipv6_authority_keeps_its_brackets() -> Result<(), ApiError> {
        let client = ApiClient::tcp("http://[::1]/", None)?;
        let Endpoint::Tcp { authority, .. } = &client.endpoint else {
            panic!("not a TCP endpoint");
        };
        // The request URI is `http://{authority}{path}`: without the brackets it would not parse.
        assert_eq!(authority, "[::1]");
        Ok(())
    }

    #[test]
    fn bad_urls_are_refused_with_a_reason() {
        for (url, needle) in [
            ("https://h:1", "https is not supported"),
            ("h:1", "expected http://HOST:PORT"),
            ("http://h:1/v1", "path or query"),
            ("http://u:p@h:1", "credentials"),
            ("not a url", "expected http://HOST:PORT"),
        ] {
            match ApiClient::tcp(url, None) {
                Err(err) => assert!(err.to_string().contains(needle), "{url}: {err}"),
                Ok(client) => panic!("{url} accepted: {client:?}"),
            }
        }
    }

    #[test]
    fn token_never_appears_in_debug_or_errors() {
        let Ok(client) = ApiClient::tcp("http://h:1", Some("hunter2")) else {
            panic!("valid URL refused");
        };
        assert!(!format!("{client:?}").contains("hunter2"));
        let Err(err) = ApiClient::tcp("http://h:1", Some("hunter2\u{1}x")) else {
            panic!("control character accepted");
        };
        assert!(!err.to_string().contains("hunter2"), "{err}");
    }

    #[test]
    fn unknown_error_code_keeps_message_and_maps_status() {
        let err = error_from(
            503,
            br#"{"code":"brand_new","message":"try later","grpc_code":"UNAVAILABLE"}"#,
        );
        let ApiError::Api { status, body } = err else {
            panic!("not an Api error: {err}");
        };
        assert_eq!(status, 503);
        assert_eq!(body.code, ErrorCode::Unavailable);
        assert_eq!(body.message, "try later");
    }

    #[test]
    fn non_json_error_is_decode() {
        let err = error_from(502, b"<html>bad gateway</html>");
        assert!(matches!(err, ApiError::Decode { status: 502, .. }), "{err}");
        assert!(err.to_string().contains("bad gateway"), "{err}");
    }
}
