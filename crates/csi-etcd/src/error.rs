//! [`EtcdError`]: what went wrong talking to etcd, typed so a caller can tell "etcd cannot answer
//! now" ([`EtcdError::is_unavailable`]: retry, or report 503) from a refusal. Owns the mapping of
//! gRPC statuses and etcd's error strings; must not carry a key's value or a password in a
//! message.

use std::time::Duration;

/// etcd's own messages (`etcdserver/api/v3rpc/rpctypes`) that mean "this member cannot serve the
/// request now, another one (or a later try) may".
const UNAVAILABLE_MESSAGES: &[&str] = &[
    "etcdserver: no leader",
    "etcdserver: request timed out",
    "etcdserver: leader changed",
    "etcdserver: too many requests",
    "etcdserver: unhealthy cluster",
    "etcdserver: not capable",
    "etcdserver: server stopped",
];

/// A failed etcd call.
#[derive(Debug, thiserror::Error)]
pub enum EtcdError {
    /// No endpoint at all.
    #[error("no etcd endpoint given: give at least one client URL, e.g. http://127.0.0.1:2379")]
    NoEndpoints,
    /// An endpoint is not a usable URL, or its scheme does not match the TLS settings.
    #[error("etcd endpoint {endpoint:?} is not usable: {reason}")]
    InvalidEndpoint {
        endpoint: String,
        /// What is wrong and what to give instead (shown in the message, not as a source).
        reason: Box<dyn std::error::Error + Send + Sync>,
    },
    /// No member could answer: connection refused or broken, no leader, etcd's own timeout.
    #[error("etcd {op} failed: etcd is unavailable at {endpoints} (is it running, with quorum?)")]
    Unavailable {
        op: &'static str,
        /// The endpoint(s) tried, comma-joined.
        endpoints: String,
        #[source]
        source: tonic::Status,
    },
    /// TLS to the member failed: the server certificate is not trusted, or etcd refused the
    /// client certificate (or its absence). Counted as unavailable (a caller retries; the
    /// operator fixes the files), never applied.
    #[error(
        "etcd {op} at {endpoint} failed over TLS: {reason}; check --cluster-etcd-ca, --cluster-etcd-cert and --cluster-etcd-key against etcd's --cert-file, --trusted-ca-file and --client-cert-auth"
    )]
    Tls {
        op: &'static str,
        endpoint: String,
        reason: String,
        #[source]
        source: tonic::Status,
    },
    /// The call did not finish within its time.
    #[error(
        "etcd {op} timed out after {timeout:?} at {endpoints} (a write may still have been applied)"
    )]
    Timeout {
        op: &'static str,
        endpoints: String,
        timeout: Duration,
        #[source]
        source: tokio::time::error::Elapsed,
    },
    /// etcd refused the credentials, or the user lacks permission.
    #[error(
        "etcd {op} at {endpoint} was refused: authentication or permission ({code:?}); check the etcd user and password"
    )]
    Auth {
        op: &'static str,
        endpoint: String,
        code: tonic::Code,
        #[source]
        source: tonic::Status,
    },
    /// Any other gRPC status (invalid argument, lease not found, ...).
    #[error("etcd {op} at {endpoint} failed: {code:?}: {message}")]
    Rpc {
        op: &'static str,
        endpoint: String,
        code: tonic::Code,
        message: String,
        #[source]
        source: tonic::Status,
    },
    /// etcd answered, but the answer says it refused (e.g. `LeaseGrant`'s `error` field).
    #[error("etcd {op} was refused: {message}")]
    Refused { op: &'static str, message: String },
    /// A watch is over: etcd cancelled it (e.g. its start revision was compacted) or closed its
    /// stream. Read what is current and watch again.
    #[error("etcd watch at {endpoint} ended: {reason}")]
    WatchEnded { endpoint: String, reason: String },
}

impl EtcdError {
    /// True for everything that means "etcd cannot answer now": a caller retries later or
    /// reports 503, it does not treat it as a refusal.
    pub fn is_unavailable(&self) -> bool {
        matches!(
            self,
            EtcdError::Unavailable { .. } | EtcdError::Timeout { .. } | EtcdError::Tls { .. }
        )
    }

    /// Maps a gRPC status of `op` at `endpoint`.
    pub(crate) fn from_status(op: &'static str, endpoint: &str, status: tonic::Status) -> Self {
        use tonic::Code;
        let code = status.code();
        let message = status.message();
        let etcd_unavailable = UNAVAILABLE_MESSAGES.iter().any(|m| message.contains(m));
        if matches!(
            code,
            Code::Unavailable | Code::DeadlineExceeded | Code::Cancelled
        ) || etcd_unavailable
            || transport_cause(&status).is_some()
        {
            return EtcdError::Unavailable {
                op,
                endpoints: endpoint.to_owned(),
                source: status,
            };
        }
        let auth_message = message.contains("etcdserver: authentication failed")
            || message.contains("etcdserver: invalid auth token")
            || message.contains("etcdserver: user name is empty")
            || message.contains("etcdserver: permission denied");
        if matches!(code, Code::Unauthenticated | Code::PermissionDenied) || auth_message {
            return EtcdError::Auth {
                op,
                endpoint: endpoint.to_owned(),
                code,
                source: status,
            };
        }
        EtcdError::Rpc {
            op,
            endpoint: endpoint.to_owned(),
            code,
            message: message.to_owned(),
            source: status,
        }
    }

    /// The connection itself failed (as opposed to etcd answering with an error).
    pub(crate) fn is_transport(&self) -> bool {
        match self {
            EtcdError::Tls { .. } => true,
            EtcdError::Unavailable { source, .. } => {
                transport_cause(source).is_some()
                    || !UNAVAILABLE_MESSAGES
                        .iter()
                        .any(|m| source.message().contains(m))
            }
            _ => false,
        }
    }

    /// The request certainly was not applied, so a write may be sent to another member: the
    /// connection could not be made, or the member refused before proposing (no leader).
    pub(crate) fn certainly_not_applied(&self) -> bool {
        // A refused handshake, or a connection etcd closed for its certificate: nothing read.
        if matches!(self, EtcdError::Tls { .. }) {
            return true;
        }
        let EtcdError::Unavailable { source, .. } = self else {
            return false;
        };
        if source.message().contains("etcdserver: no leader") {
            return true;
        }
        match transport_cause(source) {
            Some(io) => matches!(
                io.kind(),
                std::io::ErrorKind::ConnectionRefused
                    | std::io::ErrorKind::NotConnected
                    | std::io::ErrorKind::AddrNotAvailable
                    | std::io::ErrorKind::HostUnreachable
                    | std::io::ErrorKind::NetworkUnreachable
            ),
            // tonic reports a failed dial as "tcp connect error" / "error trying to connect".
            None => {
                let m = source.message();
                m.contains("tcp connect error") || m.contains("error trying to connect")
            }
        }
    }
}

/// The I/O error under a transport failure, if the status carries one.
fn transport_cause(status: &tonic::Status) -> Option<&std::io::Error> {
    let mut cause: Option<&(dyn std::error::Error + 'static)> = std::error::Error::source(status);
    while let Some(err) = cause {
        if let Some(io) = err.downcast_ref::<std::io::Error>() {
            return Some(io);
        }
        cause = err.source();
    }
    None
}
