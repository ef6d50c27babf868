//! Errors of CSI calls and their classification into transient and final.
//!
//! The classification is the one every retry decision in the engine relies on (docs/design.md, "The volume lifecycle"):
//! `DEADLINE_EXCEEDED`, `UNAVAILABLE`, `RESOURCE_EXHAUSTED`, `ABORTED` and transport failures
//! are transient; every other gRPC code is final. This module must not retry anything itself.

use std::fmt;
use std::path::PathBuf;

use tonic::Code;

/// Whether an error may go away if the same call is repeated later.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ErrorClass {
    /// Retry with backoff: the plugin is busy, restarting, or the call timed out (and so may or
    /// may not have happened).
    Transient,
    /// Report to the caller: repeating the call will not help.
    Final,
}

/// Classifies a gRPC status code.
pub fn classify(code: Code) -> ErrorClass {
    match code {
        Code::DeadlineExceeded | Code::Unavailable | Code::ResourceExhausted | Code::Aborted => {
            ErrorClass::Transient
        }
        _ => ErrorClass::Final,
    }
}

/// What went wrong in one CSI call.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RpcErrorKind {
    /// The plugin answered with a non-OK gRPC status.
    Status { code: Code, message: String },
    /// No answer within the per-RPC deadline. The call may still complete in the plugin, so
    /// callers must treat the operation as uncertain (k8s#82190).
    DeadlineExceeded,
    /// The connection could not be made or broke (socket missing, plugin died mid-call).
    Transport(String),
    /// The plugin answered, but the answer breaks the CSI specification.
    Protocol(String),
    /// The plugin did not become ready within its startup timeout. Transient (it may come up
    /// later, and the reconciler keeps trying), but the wait already spent the operation's
    /// budget for the plugin's start, so an operation answers at once instead of waiting again.
    NotReady(String),
}

/// An error of one CSI call, naming the method.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub struct RpcError {
    pub method: &'static str,
    pub kind: RpcErrorKind,
}

impl fmt::Display for RpcError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.kind {
            RpcErrorKind::Status { code, message } => {
                write!(
                    f,
                    "{} failed: {}: {}",
                    self.method,
                    code_name(*code),
                    message
                )
            }
            RpcErrorKind::DeadlineExceeded => {
                write!(f, "{} got no answer within its deadline", self.method)
            }
            RpcErrorKind::Transport(detail) => {
                write!(f, "{} could not reach the plugin: {}", self.method, detail)
            }
            RpcErrorKind::Protocol(detail) => {
                write!(f, "{} answer breaks the CSI spec: {}", self.method, detail)
            }
            RpcErrorKind::NotReady(detail) => write!(
                f,
                "{}: the plugin did not become ready within its startup_timeout_ms: {}",
                self.method, detail
            ),
        }
    }
}

impl RpcError {
    pub fn status(method: &'static str, status: &tonic::Status) -> Self {
        Self {
            method,
            kind: RpcErrorKind::Status {
                code: status.code(),
                message: status.message().to_owned(),
            },
        }
    }

    pub fn transport(method: &'static str, detail: impl fmt::Display) -> Self {
        Self {
            method,
            kind: RpcErrorKind::Transport(detail.to_string()),
        }
    }

    pub fn not_ready(method: &'static str, detail: impl fmt::Display) -> Self {
        Self {
            method,
            kind: RpcErrorKind::NotReady(detail.to_string()),
        }
    }

    /// True when waiting for the plugin's start ran out (see [`RpcErrorKind::NotReady`]).
    pub fn is_not_ready(&self) -> bool {
        matches!(self.kind, RpcErrorKind::NotReady(_))
    }

    pub fn protocol(method: &'static str, detail: impl Into<String>) -> Self {
        Self {
            method,
            kind: RpcErrorKind::Protocol(detail.into()),
        }
    }

    /// Transient or final (see the module doc). A spec violation is final: repeating the call
    /// would get the same broken answer.
    pub fn class(&self) -> ErrorClass {
        match &self.kind {
            RpcErrorKind::Status { code, .. } => classify(*code),
            RpcErrorKind::DeadlineExceeded
            | RpcErrorKind::Transport(_)
            | RpcErrorKind::NotReady(_) => ErrorClass::Transient,
            RpcErrorKind::Protocol(_) => ErrorClass::Final,
        }
    }

    pub fn is_transient(&self) -> bool {
        self.class() == ErrorClass::Transient
    }

    /// The gRPC code, as the API reports it (`DEADLINE_EXCEEDED` for a local timeout,
    /// `UNAVAILABLE` for a transport failure, `INTERNAL` for a broken answer).
    pub fn code(&self) -> Code {
        match &self.kind {
            RpcErrorKind::Status { code, .. } => *code,
            RpcErrorKind::DeadlineExceeded => Code::DeadlineExceeded,
            RpcErrorKind::Transport(_) | RpcErrorKind::NotReady(_) => Code::Unavailable,
            RpcErrorKind::Protocol(_) => Code::Internal,
        }
    }

    /// True when the plugin said it does not implement the method.
    pub fn is_unimplemented(&self) -> bool {
        matches!(
            &self.kind,
            RpcErrorKind::Status {
                code: Code::Unimplemented,
                ..
            }
        )
    }

    /// The label used in metrics: the gRPC code name, or `TRANSPORT`.
    pub fn metric_code(&self) -> &'static str {
        match &self.kind {
            RpcErrorKind::Transport(_) | RpcErrorKind::NotReady(_) => "TRANSPORT",
            RpcErrorKind::Protocol(_) => "PROTOCOL",
            _ => code_name(self.code()),
        }
    }
}

/// The canonical upper-case name of a gRPC code (`NOT_FOUND`, …).
pub fn code_name(code: Code) -> &'static str {
    match code {
        Code::Ok => "OK",
        Code::Cancelled => "CANCELLED",
        Code::Unknown => "UNKNOWN",
        Code::InvalidArgument => "INVALID_ARGUMENT",
        Code::DeadlineExceeded => "DEADLINE_EXCEEDED",
        Code::NotFound => "NOT_FOUND",
        Code::AlreadyExists => "ALREADY_EXISTS",
        Code::PermissionDenied => "PERMISSION_DENIED",
        Code::ResourceExhausted => "RESOURCE_EXHAUSTED",
        Code::FailedPrecondition => "FAILED_PRECONDITION",
        Code::Aborted => "ABORTED",
        Code::OutOfRange => "OUT_OF_RANGE",
        Code::Unimplemented => "UNIMPLEMENTED",
        Code::Internal => "INTERNAL",
        Code::Unavailable => "UNAVAILABLE",
        Code::DataLoss => "DATA_LOSS",
        Code::Unauthenticated => "UNAUTHENTICATED",
    }
}

/// A CSI endpoint string that is neither `unix:///abs/path` nor an absolute path.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("endpoint {given:?} is not a unix socket: use unix:///absolute/path or /absolute/path")]
pub struct EndpointError {
    pub given: String,
}

/// Parses a CSI endpoint: `unix:///abs/path` or a bare absolute path (real plugins use both
/// in `CSI_ENDPOINT`).
pub fn parse_endpoint(endpoint: &str) -> Result<PathBuf, EndpointError> {
    let path = endpoint.strip_prefix("unix://").unwrap_or(endpoint);
    if path.starts_with('/') && path.len() > 1 && !path.contains('\0') {
        Ok(PathBuf::from(path))
    } else {
        Err(EndpointError {
            given: endpoint.to_owned(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_code_lands_in_its_class() {
        let transient = [
            Code::DeadlineExceeded,
            Code::Unavailable,
            Code::ResourceExhausted,
            Code::Aborted,
        ];
        let all = [
            Code::Cancelled,
            Code::Unknown,
            Code::InvalidArgument,
            Code::DeadlineExceeded,
            Code::NotFound,
            Code::AlreadyExists,
            Code::PermissionDenied,
            Code::ResourceExhausted,
            Code::FailedPrecondition,
            Code::Aborted,
            Code::OutOfRange,
            Code::Unimplemented,
            Code::Internal,
            Code::Unavailable,
            Code::DataLoss,
            Code::Unauthenticated,
        ];
        for code in all {
            let expected = if transient.contains(&code) {
                ErrorClass::Transient
            } else {
                ErrorClass::Final
            };
            assert_eq!(classify(code), expected, "{code:?}");
            let err = RpcError::status("NodeStageVolume", &tonic::Status::new(code, "x"));
            assert_eq!(err.class(), expected);
        }
        assert!(RpcError::transport("Probe", "refused").is_transient());
        assert!(!RpcError::protocol("Probe", "bad").is_transient());
    }

    #[test]
    fn endpoints_accept_unix_urls_and_absolute_paths() {
        assert_eq!(
            parse_endpoint("unix:///run/x.sock"),
            Ok(PathBuf::from("/run/x.sock"))
        );
        assert_eq!(
            parse_endpoint("/run/x.sock"),
            Ok(PathBuf::from("/run/x.sock"))
        );
        for bad in [
            "",
            "unix://",
            "tcp://1.2.3.4:5",
            "relative.sock",
            "unix://rel",
            "/",
        ] {
            let err = parse_endpoint(bad).err();
            assert!(err.is_some(), "{bad:?} accepted");
        }
    }
}
