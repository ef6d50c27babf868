//! `POST /v1/images/import`: an image archive streamed as the request body, read from any
//! [`Read`] on a blocking thread a chunk at a time, so that an archive of gigabytes never sits
//! in memory.
//!
//! It owns that one request's body, a stream of chunks (the JSON calls buffer whole bodies,
//! which is right for them and wrong here), sent on a connection of its own; the request, the
//! bound on the answer and the errors are every call's (`ApiClient::round_trip`). It must not read the archive's
//! contents: what the archive holds is the daemon's to check.

use std::io::{self, Read};
use std::pin::Pin;
use std::task::{Context, Poll};

use http_body_util::BodyExt;
use hyper::Method;
use hyper::body::{Body, Bytes, Frame, SizeHint};
use hyper::header::CONTENT_TYPE;
use tokio::sync::mpsc;

use super::{ApiClient, error_from, is_success};
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
        let (tx, rx) = mpsc::channel(4);
        let failed = std::sync::Arc::new(std::sync::Mutex::new(None::<io::Error>));
        let reader_failed = std::sync::Arc::clone(&failed);
        // The reader stops as soon as the request is gone (the daemon answered early).
        let reader = tokio::task::spawn_blocking(move || pump(archive, &tx, &reader_failed));
        let builder = self
            .request_builder(Method::POST, &path)
            .header(CONTENT_TYPE, routes::TAR_MEDIA_TYPE);
        // On a new connection: the body streams once and cannot be sent again if a pooled
        // connection turned out closed (the daemon closes one after refusing an upload).
        let result = self
            .with_fresh_pool()
            .round_trip(builder, &path, ChannelBody { rx, length }.boxed_unsync())
            .await;
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
