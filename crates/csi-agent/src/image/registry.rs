//! The HTTP conversation with one registry for one pull, on reqwest: the `/v2/` ping, the
//! token request, manifest and blob GETs, and every answer's body read through a size cap
//! ([`read_capped`]) before it is buffered.
//!
//! It owns the wire (URLs, `Accept`, `WWW-Authenticate` challenges, credentials on requests,
//! the classification of HTTP statuses) and the caps on what it buffers. It must not decide
//! what a manifest means, nor verify blobs (`super::pull` and `super::blobs` do), nor keep
//! anything beyond one pull (a token lives as long as its [`Session`]).
//!
//! ## Why our own client, not `oci-client`'s
//! `oci-client` 0.18 (used until issue #23) reads manifests, `/v2/` answers, token answers and
//! every error body whole (`Response::bytes()` / `text()`) before its caller can look at the
//! size: an endless manifest or 404 body took 3 GB in 1.6 s and the daemon was OOM-killed. Its
//! HTTP client cannot be wrapped (it builds its own `reqwest::Client`), and its blob stream
//! reads the body of an error answer whole too. What a pull needs of the distribution API is
//! small (four GETs and the bearer-token dance), so it is done here on the same reqwest
//! 0.13 / hyper 1 / rustls it was built on, with every body read chunk by chunk against a cap:
//! a manifest at [`super::pull::PullLimits::max_manifest_bytes`], a token answer at
//! `max_token_bytes`, a `/v2/` answer and any error body at `max_error_bytes`. Headers are
//! bounded by hyper (its header buffer and count limits); blobs stream into the blob store,
//! which stops at the size the manifest declared.
//!
//! Credentials: basic credentials (from `--docker-config`) go to the registry only when it
//! asks for Basic, or to a token realm that is HTTPS (or a host in `--insecure-registry`), so
//! a registry cannot send them to a plain-HTTP host of its choosing. reqwest drops the
//! `Authorization` header on a redirect to another host (blobs are often redirected to a CDN).

use std::time::Duration;

use reqwest::header::{ACCEPT, WWW_AUTHENTICATE};
use reqwest::{Response, StatusCode, Url};
use serde::Deserialize;

use super::reference::{ImageRef, RegistrySettings};

/// How much of an error body is kept for the message (the rest of what was read under the
/// cap is dropped).
const MESSAGE_CHARS: usize = 300;

/// Why a request to the registry (or its token service) failed, before a pull classifies it.
#[derive(Debug, thiserror::Error)]
pub enum RegistryError {
    /// Connecting, TLS, a reset, a read timeout: nothing usable came back.
    #[error("{url}: {source}")]
    Request {
        url: String,
        #[source]
        source: reqwest::Error,
    },
    /// An answer other than success; `codes` are the distribution API's error codes found in
    /// the body (read under the cap), `message` the start of that body.
    #[error("{url}: HTTP {status}{}: {message}", if codes.is_empty() { String::new() } else { format!(" ({})", codes.join(", ")) })]
    Status {
        url: String,
        status: u16,
        codes: Vec<String>,
        message: String,
    },
    /// The token service answered something unusable, or the challenge cannot be followed.
    #[error("{url}: {reason}")]
    Auth { url: String, reason: String },
    /// A body broke off mid-way (the connection reset or closed early).
    #[error("{url}: the answer broke off: {reason}")]
    BrokenOff { url: String, reason: String },
    /// An answer's body was larger than its cap; reading stopped there.
    #[error("{url}: {what} is more than {max} bytes (at least {received} received)")]
    TooLarge {
        url: String,
        what: String,
        received: u64,
        max: u64,
    },
    /// What was received could not be kept ([`stream_capped`]'s sink failed).
    #[error("{url}: keeping the answer: {source}")]
    Sink {
        url: String,
        #[source]
        source: std::io::Error,
    },
}

/// The caps on what is buffered from a registry (bytes).
#[derive(Clone, Copy, Debug)]
pub struct AnswerCaps {
    pub manifest: u64,
    pub token: u64,
    pub error: u64,
}

/// Reads `response`'s body, refusing it as soon as more than `max` bytes arrive (or the
/// declared `Content-Length` says so, before anything is read): at most `max` plus one
/// chunk (hyper's read buffer) is ever held. `what` names the answer in the error.
pub async fn read_capped(
    response: Response,
    max: u64,
    what: &str,
) -> Result<Vec<u8>, RegistryError> {
    let mut body = Vec::new();
    stream_capped(response, max, what, |chunk| {
        body.extend_from_slice(chunk);
        Ok(())
    })
    .await?;
    Ok(body)
}

/// [`read_capped`], handing each chunk to `sink` instead of buffering it (the fetcher
/// writes it to a file): the same cap, checked before a chunk is handed on. Returns the
/// bytes received.
pub async fn stream_capped(
    response: Response,
    max: u64,
    what: &str,
    mut sink: impl FnMut(&[u8]) -> std::io::Result<()>,
) -> Result<u64, RegistryError> {
    let url = response.url().to_string();
    let too_large = |received: u64| RegistryError::TooLarge {
        url: url.clone(),
        what: what.to_owned(),
        received,
        max,
    };
    if let Some(declared) = response.content_length()
        && declared > max
    {
        return Err(too_large(declared));
    }
    let mut response = response;
    let mut total: u64 = 0;
    loop {
        let chunk = response
            .chunk()
            .await
            .map_err(|source| RegistryError::Request {
                url: url.clone(),
                source,
            })?;
        let Some(chunk) = chunk else {
            return Ok(total);
        };
        let received = total.saturating_add(chunk.len() as u64);
        if received > max {
            return Err(too_large(received));
        }
        sink(&chunk).map_err(|source| RegistryError::Sink {
            url: url.clone(),
            source,
        })?;
        total = received;
    }
}

/// The authorization a session sends with each request.
#[derive(Clone)]
enum Authorization {
    None,
    Basic(String, String),
    Bearer(String),
}

/// One pull's conversation with one registry: the scheme, the repository and the
/// authorization obtained by [`Session::start`].
pub struct Session {
    http: reqwest::Client,
    base: String,
    repository: String,
    registry: String,
    settings: RegistrySettings,
    caps: AnswerCaps,
    authorization: tokio::sync::Mutex<Authorization>,
}

/// `WWW-Authenticate: Bearer realm="…",service="…"` (the parameters a pull needs).
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Challenge {
    pub scheme: String,
    pub realm: Option<String>,
    pub service: Option<String>,
}

/// Parses a challenge: a scheme, then `key=value` or `key="quoted \" value"` pairs separated
/// by commas. Unknown keys are ignored; `None` for a header with no scheme.
pub fn parse_challenge(header: &str) -> Option<Challenge> {
    let header = header.trim();
    let (scheme, mut rest) = match header.split_once(char::is_whitespace) {
        Some((scheme, rest)) => (scheme, rest.trim_start()),
        None => (header, ""),
    };
    if scheme.is_empty() {
        return None;
    }
    let mut challenge = Challenge {
        scheme: scheme.to_ascii_lowercase(),
        ..Challenge::default()
    };
    while !rest.is_empty() {
        let Some((key, after)) = rest.split_once('=') else {
            break;
        };
        let key = key
            .trim()
            .trim_start_matches(',')
            .trim()
            .to_ascii_lowercase();
        let after = after.trim_start();
        let (value, next) = if let Some(quoted) = after.strip_prefix('"') {
            let mut value = String::new();
            let mut chars = quoted.char_indices();
            let mut end = quoted.len();
            while let Some((i, c)) = chars.next() {
                match c {
                    '\\' => {
                        if let Some((_, escaped)) = chars.next() {
                            value.push(escaped);
                        }
                    }
                    '"' => {
                        end = i + 1;
                        break;
                    }
                    c => value.push(c),
                }
            }
            (value, quoted.get(end..).unwrap_or_default())
        } else {
            let end = after.find(',').unwrap_or(after.len());
            (
                after.get(..end).unwrap_or_default().trim().to_owned(),
                after.get(end..).unwrap_or_default(),
            )
        };
        match key.as_str() {
            "realm" => challenge.realm = Some(value),
            "service" => challenge.service = Some(value),
            _ => {}
        }
        rest = next.trim_start().trim_start_matches(',').trim_start();
    }
    Some(challenge)
}

#[derive(Deserialize)]
struct TokenAnswer {
    token: Option<String>,
    access_token: Option<String>,
}

impl std::fmt::Debug for Session {
    // Never the token nor the credentials.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Session")
            .field("base", &self.base)
            .field("repository", &self.repository)
            .finish_non_exhaustive()
    }
}

impl Session {
    /// Pings `/v2/` and follows its challenge: no authorization, Basic with the configured
    /// credentials, or a bearer token for `repository:<name>:pull` from the realm.
    pub async fn start(
        http: reqwest::Client,
        settings: &RegistrySettings,
        caps: AnswerCaps,
        reference: &ImageRef,
    ) -> Result<Self, RegistryError> {
        let registry = reference.registry().to_owned();
        let scheme = if settings.insecure.contains(&registry) {
            "http"
        } else {
            "https"
        };
        let session = Self {
            http,
            base: format!("{scheme}://{registry}"),
            repository: reference.repository().to_owned(),
            registry,
            settings: settings.clone(),
            caps,
            authorization: tokio::sync::Mutex::new(Authorization::None),
        };
        let authorization = session.authenticate().await?;
        *session.authorization.lock().await = authorization;
        Ok(session)
    }

    async fn authenticate(&self) -> Result<Authorization, RegistryError> {
        let url = format!("{}/v2/", self.base);
        let response = self.send(self.http.get(&url), &url).await?;
        let challenge = response
            .headers()
            .get(WWW_AUTHENTICATE)
            .and_then(|v| v.to_str().ok())
            .and_then(parse_challenge);
        let status = response.status();
        // Read (under the cap) even when unused, so an endless `/v2/` answer is refused.
        let body = read_capped(response, self.caps.error, "the /v2/ answer").await?;
        let credentials = self.settings.credentials.for_registry(&self.registry);
        let Some(challenge) = challenge else {
            if status.is_success() || status == StatusCode::UNAUTHORIZED {
                return Ok(Authorization::None);
            }
            return Err(status_error(&url, status, &body));
        };
        match challenge.scheme.as_str() {
            "basic" => Ok(match credentials {
                Some((user, password)) => {
                    Authorization::Basic(user.to_owned(), password.to_owned())
                }
                None => Authorization::None,
            }),
            "bearer" => self.token(&challenge, credentials).await,
            _ => Ok(Authorization::None),
        }
    }

    /// Asks the challenge's realm for a pull token.
    async fn token(
        &self,
        challenge: &Challenge,
        credentials: Option<(&str, &str)>,
    ) -> Result<Authorization, RegistryError> {
        let realm = challenge.realm.as_deref().unwrap_or_default();
        let refuse = |reason: String| RegistryError::Auth {
            url: realm.to_owned(),
            reason,
        };
        let mut url = Url::parse(realm)
            .map_err(|err| refuse(format!("the token realm is not a URL ({err})")))?;
        let realm_host = match (url.host_str(), url.port()) {
            (Some(host), Some(port)) => format!("{host}:{port}"),
            (Some(host), None) => host.to_owned(),
            (None, _) => return Err(refuse("the token realm has no host".to_owned())),
        };
        let plain_allowed = self.settings.insecure.contains(&realm_host);
        match url.scheme() {
            "https" => {}
            "http" if plain_allowed => {}
            other => {
                return Err(refuse(format!(
                    "the token realm's scheme {other:?} is refused: only https, or http to a host in --insecure-registry"
                )));
            }
        }
        {
            let mut query = url.query_pairs_mut();
            query.append_pair("scope", &format!("repository:{}:pull", self.repository));
            if let Some(service) = &challenge.service {
                query.append_pair("service", service);
            }
        }
        let mut request = self.http.get(url.clone());
        if let Some((user, password)) = credentials {
            request = request.basic_auth(user, Some(password));
        }
        let shown = url.to_string();
        let response = self.send(request, &shown).await?;
        let status = response.status();
        if !status.is_success() {
            let body = read_capped(
                response,
                self.caps.error,
                "the token service's error answer",
            )
            .await?;
            return Err(status_error(&shown, status, &body));
        }
        let body = read_capped(response, self.caps.token, "the token answer").await?;
        let answer: TokenAnswer =
            serde_json::from_slice(&body).map_err(|err| RegistryError::Auth {
                url: shown.clone(),
                reason: format!("the token answer is not JSON with a token: {err}"),
            })?;
        let token = answer
            .token
            .or(answer.access_token)
            .filter(|t| !t.is_empty())
            .ok_or_else(|| RegistryError::Auth {
                url: shown.clone(),
                reason: "the token answer has no \"token\" nor \"access_token\"".to_owned(),
            })?;
        Ok(Authorization::Bearer(token))
    }

    async fn send(
        &self,
        request: reqwest::RequestBuilder,
        url: &str,
    ) -> Result<Response, RegistryError> {
        request
            .send()
            .await
            .map_err(|source| RegistryError::Request {
                url: url.to_owned(),
                source,
            })
    }

    /// A GET with this session's authorization; a 401 after a bearer token (it expired
    /// during a long pull) authenticates again once. Any other unsuccessful answer is an
    /// error, its body read under the error cap.
    async fn get(&self, url: &str, accept: Option<&str>) -> Result<Response, RegistryError> {
        let mut renewed = false;
        loop {
            let authorization = self.authorization.lock().await.clone();
            let mut request = self.http.get(url);
            if let Some(accept) = accept {
                request = request.header(ACCEPT, accept);
            }
            request = match &authorization {
                Authorization::None => request,
                Authorization::Basic(user, password) => request.basic_auth(user, Some(password)),
                Authorization::Bearer(token) => request.bearer_auth(token),
            };
            let response = self.send(request, url).await?;
            let status = response.status();
            if status.is_success() {
                return Ok(response);
            }
            if status == StatusCode::UNAUTHORIZED
                && !renewed
                && matches!(authorization, Authorization::Bearer(_))
            {
                drop(read_capped(response, self.caps.error, "an error answer").await?);
                renewed = true;
                let fresh = self.authenticate().await?;
                *self.authorization.lock().await = fresh;
                continue;
            }
            let what = format!("an error answer (HTTP {})", status.as_u16());
            let body = read_capped(response, self.caps.error, &what).await?;
            return Err(status_error(url, status, &body));
        }
    }

    /// The manifest (or index) `target` names (a tag or a digest), read under the manifest
    /// cap.
    pub async fn manifest(&self, target: &str, accept: &str) -> Result<Vec<u8>, RegistryError> {
        let url = format!("{}/v2/{}/manifests/{target}", self.base, self.repository);
        let response = self.get(&url, Some(accept)).await?;
        read_capped(response, self.caps.manifest, "the manifest").await
    }

    /// A blob's answer, its body not read yet (the caller streams it into the store).
    pub async fn blob(&self, digest: &str) -> Result<Response, RegistryError> {
        let url = format!("{}/v2/{}/blobs/{digest}", self.base, self.repository);
        self.get(&url, None).await
    }
}

#[derive(Deserialize)]
struct ErrorEnvelope {
    errors: Vec<ErrorItem>,
}

#[derive(Deserialize)]
struct ErrorItem {
    code: String,
}

fn status_error(url: &str, status: StatusCode, body: &[u8]) -> RegistryError {
    let codes = serde_json::from_slice::<ErrorEnvelope>(body)
        .map(|e| e.errors.into_iter().map(|i| i.code).collect())
        .unwrap_or_default();
    let message: String = String::from_utf8_lossy(body)
        .chars()
        .take(MESSAGE_CHARS)
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect();
    RegistryError::Status {
        url: url.to_owned(),
        status: status.as_u16(),
        codes,
        message,
    }
}

/// The HTTP client of a daemon's pulls: its connect timeout, a read timeout as a backstop,
/// rustls with the platform's roots, proxies from the environment (reqwest's default).
pub fn http_client(
    connect_timeout: Duration,
    read_timeout: Duration,
) -> Result<reqwest::Client, reqwest::Error> {
    reqwest::Client::builder()
        .connect_timeout(connect_timeout)
        .read_timeout(read_timeout)
        .user_agent(concat!("csi-agent/", env!("CARGO_PKG_VERSION")))
        .build()
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    #[test]
    fn challenges_parse_quoted_and_plain_values() {
        let c = parse_challenge(
            r#"Bearer realm="https://auth.example/token",service="registry.example",scope="repository:a:pull""#,
        )
        .unwrap();
        assert_eq!(c.scheme, "bearer");
        assert_eq!(c.realm.as_deref(), Some("https://auth.example/token"));
        assert_eq!(c.service.as_deref(), Some("registry.example"));
        let c = parse_challenge(r#"Basic realm="a \"quoted\", realm""#).unwrap();
        assert_eq!(c.scheme, "basic");
        assert_eq!(c.realm.as_deref(), Some(r#"a "quoted", realm"#));
        let c = parse_challenge("Bearer realm=https://x/t, service=s").unwrap();
        assert_eq!(c.realm.as_deref(), Some("https://x/t"));
        assert_eq!(c.service.as_deref(), Some("s"));
        // Hostile shapes never panic.
        for s in [
            "",
            "Bearer",
            "Bearer =",
            "Bearer realm=\"unterminated",
            "Bearer ,,,=,",
        ] {
            let _ = parse_challenge(s);
        }
        assert!(parse_challenge("").is_none());
    }
}
