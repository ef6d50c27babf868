//! [`ApiError`]: everything that can go wrong between a client and csi-agentd, each variant
//! with a message that says what to check.
//!
//! This module owns the wording of client-side failures. It must not decide how a program
//! reacts to them (exit codes, retries): that is the caller's.

use std::io;
use std::path::PathBuf;
use std::time::Duration;

use crate::types::{ErrorBody, ErrorCode};

/// A failed API call.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ApiError {
    /// The unix socket could not be connected to: the daemon is not running, or the path is
    /// wrong, or the caller may not open it.
    #[error(
        "cannot connect to {}: {}; {}",
        socket.display(),
        io_reason(source),
        unix_connect_hint(source)
    )]
    Connect { socket: PathBuf, source: io::Error },

    /// The TCP listener could not be connected to.
    #[error(
        "cannot connect to {url}: {}; is csi-agentd listening on TCP at this address? (--url)",
        io_reason(source)
    )]
    ConnectTcp { url: String, source: io::Error },

    /// The `--url` (or the address given to [`crate::ApiClient::tcp`]) is not usable.
    #[error("invalid API URL '{url}': {reason}")]
    InvalidUrl { url: String, reason: String },

    /// The bearer token cannot be sent (empty, or characters not allowed in a header). The
    /// message never contains the token.
    #[error("invalid bearer token: {reason}")]
    InvalidToken { reason: String },

    /// The request could not be encoded as JSON (a bug of the caller's value, not of the
    /// daemon).
    #[error("cannot encode the request as JSON: {0}")]
    Encode(#[source] serde_json::Error),

    /// The query could not be encoded into the URL.
    #[error("cannot encode the query string: {0}")]
    EncodeQuery(#[source] serde_urlencoded::ser::Error),

    /// The connection broke after it was made: the daemon stopped or restarted mid-request.
    #[error(
        "lost the connection to csi-agentd at {endpoint}: {}; the daemon may have stopped \
         or restarted (see its log); the request may or may not have taken effect, and repeating \
         it is safe",
        transport_reason(source.as_ref())
    )]
    Transport {
        endpoint: String,
        /// hyper's error, or the pooling client's error that holds it.
        source: Box<dyn std::error::Error + Send + Sync>,
    },

    /// No complete answer within the client's deadline.
    #[error(
        "no answer from csi-agentd at {endpoint} within {after:?}; the request may still complete \
         (check with `csictl volumes`), and repeating it is safe"
    )]
    Timeout { endpoint: String, after: Duration },

    /// The archive being uploaded could not be read (nothing was imported).
    #[error("cannot read the archive to send: {source}")]
    Archive {
        #[source]
        source: io::Error,
    },

    /// The daemon answered with a non-2xx status and the API's error shape.
    #[error("{body}")]
    Api { status: u16, body: ErrorBody },

    /// The daemon answered with something that is not what the API promises for this route.
    #[error(
        "unexpected answer from csi-agentd (HTTP {status}): {reason}; body: {body_excerpt}; \
         are csictl and csi-agentd the same version?"
    )]
    Decode {
        status: u16,
        reason: String,
        /// The first bytes of the body, lossily decoded, for the message.
        body_excerpt: String,
    },
}

impl ApiError {
    /// The API's error code, when the daemon answered with its error shape.
    pub fn code(&self) -> Option<ErrorCode> {
        match self {
            ApiError::Api { body, .. } => Some(body.code),
            _ => None,
        }
    }

    /// True when the request never reached a daemon (or the daemon never answered): a
    /// connection problem rather than a refused request.
    pub fn is_connection(&self) -> bool {
        matches!(
            self,
            ApiError::Connect { .. }
                | ApiError::ConnectTcp { .. }
                | ApiError::Transport { .. }
                | ApiError::Timeout { .. }
        )
    }

    pub(crate) fn decode(status: u16, reason: impl Into<String>, body: &[u8]) -> ApiError {
        ApiError::Decode {
            status,
            reason: reason.into(),
            body_excerpt: excerpt(body),
        }
    }
}

/// hyper's own words for a broken exchange ("connection closed before message completed"),
/// not the pooling client's wrapper around them ("client error (SendRequest)").
fn transport_reason(err: &(dyn std::error::Error + 'static)) -> String {
    let mut current = Some(err);
    while let Some(cause) = current {
        if let Some(hyper) = cause.downcast_ref::<hyper::Error>() {
            return hyper.to_string();
        }
        current = cause.source();
    }
    err.to_string()
}

/// The OS's reason without the trailing " (os error N)", which tells an operator nothing.
fn io_reason(err: &io::Error) -> String {
    let text = err.to_string();
    match text.rfind(" (os error ") {
        Some(at) => text[..at].to_owned(),
        None => text,
    }
}

/// What to check, by the kind of failure: the operator's next step differs for each.
fn unix_connect_hint(err: &io::Error) -> &'static str {
    match err.kind() {
        io::ErrorKind::PermissionDenied => {
            "the socket is mode 0600 and owned by the user csi-agentd runs as (root, as a rule): \
             run csictl as that user, e.g. `sudo csictl …` (--socket)"
        }
        io::ErrorKind::ConnectionRefused => {
            "the socket file exists but nobody listens on it: csi-agentd is not running (or \
             crashed); start it (--socket)"
        }
        io::ErrorKind::InvalidInput => {
            "unix socket paths are limited to 107 bytes: use a shorter (e.g. relative) path \
             (--socket)"
        }
        _ => "is csi-agentd running with this work dir? (--socket)",
    }
}

/// At most 200 characters of a body, for an error message: enough to recognise an HTML page
/// or a proxy's error, never a wall of text.
fn excerpt(body: &[u8]) -> String {
    const MAX: usize = 200;
    if body.is_empty() {
        return "(empty)".to_owned();
    }
    let text = String::from_utf8_lossy(body);
    let mut out: String = text.chars().take(MAX).collect();
    if text.chars().nth(MAX).is_some() {
        out.push('…');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn connect_message_names_socket_and_says_what_to_check() {
        let err = ApiError::Connect {
            socket: PathBuf::from("/x/api.sock"),
            source: io::Error::from_raw_os_error(2),
        };
        assert_eq!(
            err.to_string(),
            "cannot connect to /x/api.sock: No such file or directory; is csi-agentd running \
             with this work dir? (--socket)"
        );
    }

    #[test]
    fn permission_denied_mentions_mode() {
        let err = ApiError::Connect {
            socket: PathBuf::from("/x/api.sock"),
            source: io::Error::from_raw_os_error(13),
        };
        assert!(err.to_string().contains("0600"), "{err}");
    }

    #[test]
    fn api_message_includes_grpc_code() {
        let err = ApiError::Api {
            status: 422,
            body: ErrorBody {
                code: ErrorCode::PluginError,
                message: "volume v1 does not exist".to_owned(),
                grpc_code: Some("NOT_FOUND".to_owned()),
            },
        };
        assert_eq!(
            err.to_string(),
            "volume v1 does not exist (plugin said NOT_FOUND)"
        );
        assert_eq!(err.code(), Some(ErrorCode::PluginError));
        assert!(!err.is_connection());
    }

    #[test]
    fn excerpt_is_bounded() {
        assert_eq!(excerpt(b""), "(empty)");
        assert_eq!(excerpt(b"abc"), "abc");
        let long = "x".repeat(500);
        let cut = excerpt(long.as_bytes());
        assert_eq!(cut.chars().count(), 201);
        assert!(cut.ends_with('…'));
    }
}
