//! Tests of `ApiClient`'s transport, request encoding and answer decoding against a small real
//! HTTP server (axum) on a temporary unix socket or loopback TCP port.
//!
//! The server here is a stand-in with canned answers: it tests the client only (what it sends,
//! how it reads answers and errors), not the daemon's behaviour, which has its own tests.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use anyhow::{Result, bail, ensure};
use axum::extract::{Path, Query};
use axum::http::{HeaderMap, StatusCode, Uri};
use axum::response::IntoResponse;
use axum::routing::{get, post};
use axum::serve::ListenerExt;
use axum::{Json, Router};
use csi_agent_api::*;
use tempfile::TempDir;

fn volume(plugin: String, volume_id: String, raw_path: String) -> VolumeInfo {
    VolumeInfo {
        plugin,
        volume_id,
        state: "PUBLISHED".to_owned(),
        claims: vec!["c1".to_owned()],
        capability: None,
        readonly: false,
        volume_context: BTreeMap::new(),
        // The raw request path, so the test can see what went on the wire.
        target_path: raw_path,
        target_path_relative: String::new(),
        origin: "created".to_owned(),
        has_secrets: false,
        last_error: None,
        operation: None,
        capacity_bytes: None,
        expansion: None,
        condition: None,
        accessible_topology: vec![],
        controller: None,
    }
}

fn app() -> Router {
    Router::new()
        .route(
            routes::HEALTH,
            get(|| async {
                Json(Health {
                    status: "ok".to_owned(),
                    started: false,
                    version: "test".to_owned(),
                })
            }),
        )
        .route(
            routes::VOLUME,
            get(
                |Path((plugin, id)): Path<(String, String)>, uri: Uri| async move {
                    Json(volume(plugin, id, uri.path().to_owned()))
                },
            )
            .delete(|| async {
                (
                    StatusCode::CONFLICT,
                    Json(ErrorBody {
                        code: ErrorCode::Conflict,
                        message: "volume v1 is published for 1 workload; unpublish it first"
                            .to_owned(),
                        grpc_code: Some("FAILED_PRECONDITION".to_owned()),
                    }),
                )
            }),
        )
        .route(
            routes::PUBLISH,
            // `Json` insists on `Content-Type: application/json`, so this also checks the
            // client sends it.
            post(|Json(req): Json<PublishRequest>| async move {
                Json(PublishResponse {
                    target_path: format!("/w/{}/{}", req.plugin, req.volume_id),
                    target_path_relative: req.workload,
                    state: req.capability.access_mode,
                    bind_to: req.secrets.and_then(|s| s.node_publish.get("k").cloned()),
                })
            }),
        )
        .route(
            routes::BACKEND_VOLUMES,
            get(
                |Path(plugin): Path<String>,
                 Query(query): Query<BTreeMap<String, String>>,
                 uri: Uri| async move {
                    Json(BackendVolumePage {
                        volumes: vec![BackendVolume {
                            volume_id: plugin,
                            capacity_bytes: 0,
                            volume_context: query,
                        }],
                        next_token: uri.query().unwrap_or_default().to_owned(),
                    })
                },
            ),
        )
        .route(routes::METRICS, get(|| async { "# HELP up 1\nup 1\n" }))
        .route(
            routes::PLUGINS,
            get(|| async { (StatusCode::BAD_GATEWAY, "<html>bad gateway</html>") }),
        )
        .route(
            routes::VOLUMES,
            get(|| async { Json(serde_json::json!({"nope": 1})) }),
        )
        .route(
            routes::START,
            post(|| async {
                tokio::time::sleep(Duration::from_secs(30)).await;
                "late"
            }),
        )
}

/// Serves `app()` on a fresh unix socket in a temp dir.
async fn unix_server() -> Result<(TempDir, PathBuf)> {
    let dir = tempfile::tempdir()?;
    let socket = dir.path().join("api.sock");
    let listener = tokio::net::UnixListener::bind(&socket)?;
    tokio::spawn(async move { axum::serve(listener, app()).await });
    Ok((dir, socket))
}

#[tokio::test]
async fn health_over_unix_socket() -> Result<()> {
    let (_dir, socket) = unix_server().await?;
    let health = ApiClient::unix(&socket).health().await?;
    ensure!(health.status == "ok" && !health.started && health.version == "test");
    Ok(())
}

#[tokio::test]
async fn path_segments_are_percent_encoded_and_round_trip() -> Result<()> {
    let (_dir, socket) = unix_server().await?;
    let client = ApiClient::unix(&socket);
    let id = "pool/vol 1?#%é";
    let info = client.volume("org.example.lvm", id).await?;
    ensure!(
        info.target_path == "/v1/volumes/org.example.lvm/pool%2Fvol%201%3F%23%25%C3%A9",
        "sent {}",
        info.target_path
    );
    ensure!(
        info.plugin == "org.example.lvm" && info.volume_id == id,
        "{info:?}"
    );
    Ok(())
}

#[tokio::test]
async fn query_values_are_encoded_and_absent_ones_omitted() -> Result<()> {
    let (_dir, socket) = unix_server().await?;
    let client = ApiClient::unix(&socket);
    let page = client
        .backend_volumes("org.example.lvm", Some(5), Some("a b&c=d"))
        .await?;
    ensure!(page.next_token == "max_entries=5&starting_token=a%20b%26c%3Dd");
    let context = &page.volumes[0].volume_context;
    ensure!(context.get("starting_token").map(String::as_str) == Some("a b&c=d"));
    ensure!(page.volumes[0].volume_id == "org.example.lvm");

    let page = client
        .backend_volumes("org.example.lvm", None, None)
        .await?;
    ensure!(page.next_token.is_empty(), "query {:?}", page.next_token);
    Ok(())
}

#[tokio::test]
async fn publish_sends_json_body() -> Result<()> {
    let (_dir, socket) = unix_server().await?;
    let request = PublishRequest {
        plugin: "p".to_owned(),
        volume_id: "v".to_owned(),
        workload: "w".to_owned(),
        capability: CapabilitySpec::mount("MULTI_NODE_READER_ONLY", "", vec![]),
        readonly: true,
        volume_context: None,
        secrets: Some(SecretsSpec {
            node_stage: BTreeMap::new(),
            node_publish: [("k".to_owned(), "s".to_owned())].into(),
        }),
        bind_to: None,
    };
    let answer = ApiClient::unix(&socket).publish(&request).await?;
    ensure!(answer.target_path == "/w/p/v");
    ensure!(answer.target_path_relative == "w");
    ensure!(answer.state == "MULTI_NODE_READER_ONLY");
    ensure!(answer.bind_to.as_deref() == Some("s"));
    Ok(())
}

#[tokio::test]
async fn metrics_are_text() -> Result<()> {
    let (_dir, socket) = unix_server().await?;
    let text = ApiClient::unix(&socket).metrics().await?;
    ensure!(text == "# HELP up 1\nup 1\n");
    Ok(())
}

#[tokio::test]
async fn non_2xx_with_error_shape_is_api_error() -> Result<()> {
    let (_dir, socket) = unix_server().await?;
    let err = match ApiClient::unix(&socket).delete_volume("p", "v1").await {
        Ok(answer) => bail!("expected an error, got {answer:?}"),
        Err(err) => err,
    };
    let ApiError::Api { status, body } = &err else {
        bail!("expected ApiError::Api, got {err:?}");
    };
    ensure!(*status == 409);
    ensure!(body.code == ErrorCode::Conflict);
    ensure!(body.grpc_code.as_deref() == Some("FAILED_PRECONDITION"));
    ensure!(
        err.to_string()
            == "volume v1 is published for 1 workload; unpublish it first (plugin said \
                FAILED_PRECONDITION)"
    );
    Ok(())
}

#[tokio::test]
async fn non_2xx_without_error_shape_is_decode_error() -> Result<()> {
    let (_dir, socket) = unix_server().await?;
    let err = match ApiClient::unix(&socket).plugins().await {
        Ok(answer) => bail!("expected an error, got {answer:?}"),
        Err(err) => err,
    };
    ensure!(
        matches!(err, ApiError::Decode { status: 502, .. }),
        "{err:?}"
    );
    ensure!(
        err.to_string().contains("<html>bad gateway</html>"),
        "{err}"
    );
    Ok(())
}

#[tokio::test]
async fn unexpected_2xx_body_is_decode_error() -> Result<()> {
    let (_dir, socket) = unix_server().await?;
    let err = match ApiClient::unix(&socket).volumes().await {
        Ok(answer) => bail!("expected an error, got {answer:?}"),
        Err(err) => err,
    };
    ensure!(
        matches!(err, ApiError::Decode { status: 200, .. }),
        "{err:?}"
    );
    ensure!(err.to_string().contains("missing field `volumes`"), "{err}");
    Ok(())
}

#[tokio::test]
async fn missing_socket_is_connect_error_with_hint() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let socket = dir.path().join("api.sock");
    let err = match ApiClient::unix(&socket).health().await {
        Ok(answer) => bail!("expected an error, got {answer:?}"),
        Err(err) => err,
    };
    ensure!(matches!(err, ApiError::Connect { .. }), "{err:?}");
    ensure!(err.is_connection());
    ensure!(
        err.to_string()
            == format!(
                "cannot connect to {}: No such file or directory; is csi-agentd running with \
                 this work dir? (--socket)",
                socket.display()
            ),
        "{err}"
    );
    Ok(())
}

#[tokio::test]
async fn stale_socket_is_connect_error_saying_nobody_listens() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let socket = dir.path().join("api.sock");
    // Bound, then closed: the file stays but nobody accepts.
    drop(std::os::unix::net::UnixListener::bind(&socket)?);
    let err = match ApiClient::unix(&socket).health().await {
        Ok(answer) => bail!("expected an error, got {answer:?}"),
        Err(err) => err,
    };
    ensure!(matches!(err, ApiError::Connect { .. }), "{err:?}");
    ensure!(err.to_string().contains("nobody listens"), "{err}");
    Ok(())
}

#[tokio::test]
async fn timeout_is_reported() -> Result<()> {
    let (_dir, socket) = unix_server().await?;
    let client = ApiClient::unix(&socket).with_timeout(Some(Duration::from_millis(100)));
    let err = match client.start().await {
        Ok(answer) => bail!("expected an error, got {answer:?}"),
        Err(err) => err,
    };
    ensure!(matches!(err, ApiError::Timeout { .. }), "{err:?}");
    Ok(())
}

#[tokio::test]
async fn tcp_sends_bearer_token() -> Result<()> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let address = listener.local_addr()?;
    let router = Router::new().route(
        routes::HEALTH,
        get(|headers: HeaderMap| async move {
            let auth = headers.get("authorization").and_then(|v| v.to_str().ok());
            if auth != Some("Bearer s3cret") {
                return (
                    StatusCode::UNAUTHORIZED,
                    Json(ErrorBody {
                        code: ErrorCode::Unauthorized,
                        message: "missing or wrong bearer token".to_owned(),
                        grpc_code: None,
                    }),
                )
                    .into_response();
            }
            Json(Health {
                status: "ok".to_owned(),
                started: true,
                version: "tcp".to_owned(),
            })
            .into_response()
        }),
    );
    tokio::spawn(async move { axum::serve(listener, router).await });
    let url = format!("http://{address}");

    let health = ApiClient::tcp(&url, Some("s3cret\n"))?.health().await?;
    ensure!(health.version == "tcp");

    let err = match ApiClient::tcp(&url, Some("wrong"))?.health().await {
        Ok(answer) => bail!("expected an error, got {answer:?}"),
        Err(err) => err,
    };
    ensure!(err.code() == Some(ErrorCode::Unauthorized), "{err:?}");
    Ok(())
}

#[tokio::test]
async fn tcp_connection_refused_is_connect_error() -> Result<()> {
    // Bind then drop to find a port nobody listens on.
    let address = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?;
    let url = format!("http://{address}");
    let err = match ApiClient::tcp(&url, None)?.health().await {
        Ok(answer) => bail!("expected an error, got {answer:?}"),
        Err(err) => err,
    };
    ensure!(matches!(err, ApiError::ConnectTcp { .. }), "{err:?}");
    ensure!(err.to_string().contains(&url), "{err}");
    Ok(())
}

/// Serves `app()` on a fresh unix socket and counts the connections it accepts.
async fn counting_unix_server() -> Result<(TempDir, PathBuf, Arc<AtomicUsize>)> {
    let dir = tempfile::tempdir()?;
    let socket = dir.path().join("api.sock");
    let accepted = Arc::new(AtomicUsize::new(0));
    let counter = Arc::clone(&accepted);
    let listener = tokio::net::UnixListener::bind(&socket)?.tap_io(move |_| {
        counter.fetch_add(1, Ordering::SeqCst);
    });
    tokio::spawn(async move { axum::serve(listener, app()).await });
    Ok((dir, socket, accepted))
}

#[tokio::test]
async fn sequential_calls_reuse_one_kept_alive_connection() -> Result<()> {
    let (_dir, socket, accepted) = counting_unix_server().await?;
    let client = ApiClient::unix(&socket);
    for _ in 0..20 {
        client.health().await?;
    }
    // A clone shares the pool.
    client.clone().health().await?;
    let connections = accepted.load(Ordering::SeqCst);
    ensure!(
        connections == 1,
        "21 calls opened {connections} connections"
    );
    Ok(())
}

#[tokio::test]
async fn concurrent_calls_open_one_connection_each_and_reuse_them() -> Result<()> {
    let (_dir, socket, accepted) = counting_unix_server().await?;
    let client = ApiClient::unix(&socket);
    for _ in 0..5 {
        let calls: Vec<_> = (0..8)
            .map(|_| {
                let client = client.clone();
                tokio::spawn(async move { client.health().await })
            })
            .collect();
        for call in calls {
            call.await??;
        }
    }
    let connections = accepted.load(Ordering::SeqCst);
    ensure!(
        (1..=8).contains(&connections),
        "5 rounds of 8 concurrent calls opened {connections} connections (at most 8 expected)"
    );
    Ok(())
}

#[tokio::test]
async fn a_connection_the_server_closed_is_not_reused() -> Result<()> {
    // A server that answers one request per connection and closes it (`Connection: close`),
    // as a daemon does when it restarts: the next call must open a new connection, not fail.
    let dir = tempfile::tempdir()?;
    let socket = dir.path().join("api.sock");
    let accepted = Arc::new(AtomicUsize::new(0));
    let counter = Arc::clone(&accepted);
    let listener = tokio::net::UnixListener::bind(&socket)?.tap_io(move |_| {
        counter.fetch_add(1, Ordering::SeqCst);
    });
    let router = app().layer(axum::middleware::map_response(
        |mut response: axum::response::Response| async move {
            response.headers_mut().insert(
                axum::http::header::CONNECTION,
                axum::http::HeaderValue::from_static("close"),
            );
            response
        },
    ));
    tokio::spawn(async move { axum::serve(listener, router).await });
    let client = ApiClient::unix(&socket);
    for _ in 0..3 {
        client.health().await?;
    }
    let connections = accepted.load(Ordering::SeqCst);
    ensure!(
        connections == 3,
        "3 calls on closing connections made {connections} connections"
    );
    Ok(())
}

#[tokio::test]
async fn tcp_calls_reuse_one_kept_alive_connection() -> Result<()> {
    let accepted = Arc::new(AtomicUsize::new(0));
    let counter = Arc::clone(&accepted);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let address = listener.local_addr()?;
    let listener = listener.tap_io(move |_| {
        counter.fetch_add(1, Ordering::SeqCst);
    });
    tokio::spawn(async move { axum::serve(listener, app()).await });
    let client = ApiClient::tcp(&format!("http://{address}"), None)?;
    for _ in 0..10 {
        client.health().await?;
    }
    let connections = accepted.load(Ordering::SeqCst);
    ensure!(
        connections == 1,
        "10 calls opened {connections} connections"
    );
    Ok(())
}
