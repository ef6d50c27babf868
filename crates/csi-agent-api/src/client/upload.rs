//! `POST /v1/images/import`: an image archive streamed as the request body, read from any
//! [`Read`] on a blocking thread a chunk at a time, so that an archive of gigabytes never sits
//! in memory.
//!
//! It owns that one request's transport: its own connection (the JSON calls' `send` buffers
//! whole bodies, which is right for them and wrong here), the body as a stream of chunks, and
//! the answer read with the same bound and mapped to the same errors as every other call. It
//! must not read the archive's contents: what the archive holds is the daemon's to check.

use std::io::{self, Read};
use std::pin::Pin;
use std::task::{Context, Poll};

use http_body_util::{BodyExt, Limited};
use hyper::body::{Body, Bytes, Frame, SizeHint};
use hyper::header::{ACCEPT, AUTHORIZATION, CONTENT_TYPE, HOST, HeaderValue, USER_AGENT};
use hyper::{Method, Request};
use hyper_util::rt::TokioIo;
use tokio::net::{TcpStream, UnixStream};
use tokio::sync::mpsc;

use super::{ApiClient, Endpoint, MAX_BODY_BYTES, error_from, is_success};
use crate::error::ApiError;
use crate::routes;
use crate::types::ImageImportResponse;

/// Bytes read from the archive at a time.
const CHUNK: usize = 256 * 1024;

impl ApiClient {
    /// `POST /v1/images/import[?name=REF]`: streams `archive` (a tar of an OCI image layout or
    /// a `docker save` archive) to the daemon, which imports its images, or its one image
    /// under `name`. `length`, when known (a file), is sent as `Content-Length`, so that a
    /// daemon whose limit it exceeds refuses at once; otherwise the body is chunked.
    pub async fn import_image<R: Read + Send + 'static>(
        &self,
        archive: R,
        length: Option<u64>,
        name: Option<&str>,
    ) -> Result<ImageImportResponse, ApiError> {
        let work = self.import_untimed(archive, length, name);
        let (status, body) = match self.timeout {
            None => work.await?,
            Some(after) => {
                tokio::time::timeout(after, work)
                    .await
                    .map_err(|_| ApiError::Timeout {
                        endpoint: self.endpoint(),
                        after,
                    })??
            }
        };
        if !is_success(status) {
            return Err(error_from(status, &body));
        }
        serde_json::from_slice(&body)
            .map_err(|err| ApiError::decode(status, format!("not the expected JSON: {err}"), &body))
    }

    async fn import_untimed<R: Read + Send + 'static>(
        &self,
        archive: R,
        length: Option<u64>,
        name: Option<&str>,
    ) -> Result<(u16, Bytes), ApiError> {
        let path = match name {
            Some(name) => format!(
                "{}?name={}",
                routes::IMAGES_IMPORT,
                routes::encode_segment(name)
            ),
            None => routes::IMAGES_IMPORT.to_owned(),
        };
        let (host, authorization) = match &self.endpoint {
            Endpoint::Unix { .. } => (HeaderValue::from_static("localhost"), None),
            Endpoint::Tcp {
                authority,
                authorization,
                ..
            } => (
                HeaderValue::from_str(authority).map_err(|err| ApiError::InvalidUrl {
                    url: self.endpoint(),
                    reason: err.to_string(),
                })?,
                authorization.clone(),
            ),
        };
        let (tx, rx) = mpsc::channel(4);
        let failed = std::sync::Arc::new(std::sync::Mutex::new(None::<io::Error>));
        let reader_failed = std::sync::Arc::clone(&failed);
        // The reader stops as soon as the request is gone (the daemon answered early).
        let reader = tokio::task::spawn_blocking(move || pump(archive, &tx, &reader_failed));
        let mut builder = Request::builder()
            .method(Method::POST)
            .uri(&path)
            .header(HOST, host)
            .header(ACCEPT, "application/json")
            .header(CONTENT_TYPE, routes::TAR_MEDIA_TYPE)
            .header(
                USER_AGENT,
                concat!("csi-agent-api/", env!("CARGO_PKG_VERSION")),
            );
        if let Some(authorization) = authorization {
            builder = builder.header(AUTHORIZATION, authorization);
        }
        let request =
            builder
                .body(ChannelBody { rx, length })
                .map_err(|err| ApiError::InvalidUrl {
                    url: path.clone(),
                    reason: err.to_string(),
                })?;
        let endpoint = self.endpoint();
        let result = match &self.endpoint {
            Endpoint::Unix { socket } => {
                let stream =
                    UnixStream::connect(socket)
                        .await
                        .map_err(|source| ApiError::Connect {
                            socket: socket.clone(),
                            source,
                        })?;
                upload(TokioIo::new(stream), request, &endpoint).await
            }
            Endpoint::Tcp {
                url, host, port, ..
            } => {
                let stream =
                    TcpStream::connect((host.as_str(), *port))
                        .await
                        .map_err(|source| ApiError::ConnectTcp {
                            url: url.clone(),
                            source,
                        })?;
                upload(TokioIo::new(stream), request, url).await
            }
        };
        drop(reader);
        // A local read failure explains a broken request better than the transport's error.
        let local = failed
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take();
        match (result, local) {
            (Err(_), Some(source)) => Err(ApiError::Archive { source }),
            (result, _) => result,
        }
    }
}

/// Reads `archive` a chunk at a time into the body's channel, until it ends, fails (recorded
/// in `failed` and sent as the body's error, which aborts the request) or nobody listens.
fn pump<R: Read>(
    mut archive: R,
    tx: &mpsc::Sender<io::Result<Bytes>>,
    failed: &std::sync::Mutex<Option<io::Error>>,
) {
    loop {
        let mut buf = vec![0u8; CHUNK];
        match archive.read(&mut buf) {
            Ok(0) => return,
            Ok(n) => {
                buf.truncate(n);
                if tx.blocking_send(Ok(Bytes::from(buf))).is_err() {
                    return;
                }
            }
            Err(err) if err.kind() == io::ErrorKind::Interrupted => {}
            Err(err) => {
                let message = err.to_string();
                *failed
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(err);
                let _ = tx.blocking_send(Err(io::Error::other(message)));
                return;
            }
        }
    }
}

/// A request body fed by [`pump`].
struct ChannelBody {
    rx: mpsc::Receiver<io::Result<Bytes>>,
    length: Option<u64>,
}

impl Body for ChannelBody {
    type Data = Bytes;
    type Error = io::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, io::Error>>> {
        self.rx
            .poll_recv(cx)
            .map(|item| item.map(|chunk| chunk.map(Frame::data)))
    }

    fn size_hint(&self) -> SizeHint {
        match self.length {
            Some(length) => SizeHint::with_exact(length),
            None => SizeHint::default(),
        }
    }
}

/// Sends the streamed request over an established stream and reads the whole answer. The
/// daemon may answer before the body is all sent (a limit, a refused archive): that answer
/// is what is returned, not the broken pipe that follows.
async fn upload<I>(
    io: I,
    request: Request<ChannelBody>,
    endpoint: &str,
) -> Result<(u16, Bytes), ApiError>
where
    I: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static,
{
    let transport = |source| ApiError::Transport {
        endpoint: endpoint.to_owned(),
        source,
    };
    let (mut sender, connection) = hyper::client::conn::http1::handshake(io)
        .await
        .map_err(transport)?;
    tokio::spawn(connection);
    let response = sender.send_request(request).await.map_err(transport)?;
    let status = response.status().as_u16();
    let body = Limited::new(response.into_body(), MAX_BODY_BYTES)
        .collect()
        .await
        .map_err(|err| match err.downcast::<hyper::Error>() {
            Ok(source) => transport(*source),
            Err(other) => ApiError::decode(
                status,
                format!("body larger than {MAX_BODY_BYTES} bytes ({other})"),
                b"",
            ),
        })?
        .to_bytes();
    Ok((status, body))
}
