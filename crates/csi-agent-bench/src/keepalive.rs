//! A minimal HTTP/1.1 client that keeps one connection to the daemon's unix socket open
//! (keep-alive), as a diagnostic beside [`csi_agent_api::client::ApiClient`], which opens a
//! connection per request.

use std::path::Path;

use anyhow::{Context, bail};
use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper::client::conn::http1::SendRequest;
use hyper::header::{CONTENT_TYPE, HOST};
use hyper::{Method, Request};
use hyper_util::rt::TokioIo;
use serde::Serialize;
use tokio::net::UnixStream;

#[derive(Debug)]
pub struct KeepAlive {
    sender: SendRequest<Full<Bytes>>,
}

impl KeepAlive {
    pub async fn connect(socket: &Path) -> anyhow::Result<Self> {
        let stream = UnixStream::connect(socket)
            .await
            .with_context(|| format!("cannot connect to {}", socket.display()))?;
        let (sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .context("HTTP handshake")?;
        tokio::spawn(connection);
        Ok(Self { sender })
    }

    /// One request on the kept connection; fails on a non-2xx answer.
    pub async fn call(
        &mut self,
        method: Method,
        path: &str,
        body: Option<Vec<u8>>,
    ) -> anyhow::Result<Bytes> {
        self.sender.ready().await.context("connection closed")?;
        let mut builder = Request::builder()
            .method(method)
            .uri(path)
            .header(HOST, "localhost");
        if body.is_some() {
            builder = builder.header(CONTENT_TYPE, "application/json");
        }
        let request = builder.body(Full::new(Bytes::from(body.unwrap_or_default())))?;
        let response = self.sender.send_request(request).await?;
        let status = response.status();
        let bytes = response.into_body().collect().await?.to_bytes();
        if !status.is_success() {
            bail!("{path}: {status}: {}", String::from_utf8_lossy(&bytes));
        }
        Ok(bytes)
    }

    pub async fn post<T: Serialize>(&mut self, path: &str, body: &T) -> anyhow::Result<Bytes> {
        self.call(Method::POST, path, Some(serde_json::to_vec(body)?))
            .await
    }
}
