//! How csictl fails: the message, the hint of what to fix, and the exit status.
//!
//! This module owns the mapping from errors to exit statuses (1: the daemon refused or failed
//! the request; 2: usage; 3: the daemon could not be reached) and the operator hints. It must
//! not print: `main` does, once.

use std::fmt;

use csi_agent_api::{ApiError, ErrorCode};

use crate::args::{DEFAULT_SOCKET, UsageError};

pub const EXIT_API: u8 = 1;
pub const EXIT_USAGE: u8 = 2;
pub const EXIT_CONNECT: u8 = 3;

#[derive(Debug)]
pub enum Failure {
    /// Bad input found after clap (clap reports its own and exits 2 by itself).
    Usage(String),
    /// The API call failed.
    Api(ApiError),
    /// Printing the answer failed (not a broken pipe, which is silent).
    Output(String),
    /// The daemon did only part of the work (a drain that left claims); what it did.
    Incomplete(String),
    /// The daemon refused the request, with a hint of the command's own instead of the error
    /// code's (a 404 of `csictl cluster` is about cluster mode, not a plugin or a volume).
    Refused { err: ApiError, hint: &'static str },
}

impl From<UsageError> for Failure {
    fn from(err: UsageError) -> Failure {
        Failure::Usage(err.0)
    }
}

impl From<ApiError> for Failure {
    fn from(err: ApiError) -> Failure {
        Failure::Api(err)
    }
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Failure::Usage(message) | Failure::Output(message) => f.write_str(message),
            Failure::Incomplete(report) => write!(f, "not everything was done:\n{report}"),
            Failure::Api(err) | Failure::Refused { err, .. } => write!(f, "{err}"),
        }
    }
}

impl Failure {
    pub fn exit_code(&self) -> u8 {
        match self {
            Failure::Usage(_) => EXIT_USAGE,
            Failure::Api(ApiError::InvalidUrl { .. } | ApiError::InvalidToken { .. }) => EXIT_USAGE,
            Failure::Api(err) if err.is_connection() => EXIT_CONNECT,
            Failure::Api(_)
            | Failure::Refused { .. }
            | Failure::Output(_)
            | Failure::Incomplete(_) => EXIT_API,
        }
    }

    /// What the operator should do next, when the message alone does not say it.
    pub fn hint(&self) -> Option<String> {
        let Failure::Api(err) = self else {
            return match self {
                Failure::Usage(_) => Some("see csictl COMMAND --help".to_owned()),
                Failure::Refused { hint, .. } => Some((*hint).to_owned()),
                Failure::Incomplete(_) => Some(
                    "the daemon's log says why each claim was not released; fix that and \
                     repeat the command (it is safe to repeat)"
                        .to_owned(),
                ),
                _ => None,
            };
        };
        let hint = match err {
            ApiError::Connect { .. } => format!(
                "csictl uses --socket, else $CSI_AGENT_SOCKET, else {DEFAULT_SOCKET}; start \
                 csi-agentd or point csictl at its <work dir>/api.sock"
            ),
            ApiError::ConnectTcp { .. } => {
                "--url (or $CSI_AGENT_URL) must be the address of csi-agentd's TCP listener"
                    .to_owned()
            }
            ApiError::Api { body, .. } => code_hint(body.code).to_owned(),
            ApiError::InvalidToken { .. } => {
                "--token-file (or $CSI_AGENT_TOKEN_FILE) must hold the token on one line".to_owned()
            }
            // The other messages already say what to check.
            _ => return None,
        };
        Some(hint)
    }
}

impl Failure {
    /// The failure as `-o json` prints it (on stderr, one object): the API's own error body
    /// when the daemon answered, else a `code` naming csictl's side (`usage`, `unreachable`,
    /// `client`), with the hint and exit status, so a script never parses the text.
    pub fn to_json(&self) -> serde_json::Value {
        let (code, message, grpc_code, status) = match self {
            Failure::Api(ApiError::Api { status, body })
            | Failure::Refused {
                err: ApiError::Api { status, body },
                ..
            } => (
                serde_json::to_value(body.code).unwrap_or(serde_json::Value::Null),
                body.message.clone(),
                body.grpc_code.clone(),
                Some(*status),
            ),
            Failure::Usage(_) => ("usage".into(), self.to_string(), None, None),
            failure if failure.exit_code() == EXIT_CONNECT => {
                ("unreachable".into(), self.to_string(), None, None)
            }
            failure if failure.exit_code() == EXIT_USAGE => {
                ("usage".into(), self.to_string(), None, None)
            }
            _ => ("client".into(), self.to_string(), None, None),
        };
        let mut error = serde_json::json!({
            "code": code,
            "message": message,
            "exit_code": self.exit_code(),
        });
        if let Some(grpc_code) = grpc_code {
            error["grpc_code"] = grpc_code.into();
        }
        if let Some(status) = status {
            error["http_status"] = status.into();
        }
        if let Some(hint) = self.hint() {
            error["hint"] = hint.into();
        }
        serde_json::json!({ "error": error })
    }
}

fn code_hint(code: ErrorCode) -> &'static str {
    match code {
        ErrorCode::InvalidRequest => {
            "fix the request as the message says; nothing was changed (csictl COMMAND --help \
             lists the options)"
        }
        ErrorCode::Unauthorized => {
            "--token-file (or $CSI_AGENT_TOKEN_FILE) must hold the token csi-agentd's TCP \
             listener was started with"
        }
        ErrorCode::NotFound => "see what exists with `csictl plugins` and `csictl volumes`",
        ErrorCode::Conflict => {
            "see the volume's claims and state with `csictl volumes PLUGIN VOLUME_ID`"
        }
        ErrorCode::PluginError => {
            "the plugin refused the request (see its gRPC code); the plugin's own logs say why \
             (<work dir>/csi/<type>/<name>/containers/*/stderr for a managed plugin)"
        }
        ErrorCode::PluginProtocol => {
            "the plugin does not follow the CSI specification; check its version and its logs \
             (<work dir>/csi/<type>/<name>/containers/*/stderr)"
        }
        ErrorCode::Unsupported => {
            "the plugin does not advertise the CSI capability this needs; `csictl plugins TYPE` \
             lists what it does advertise"
        }
        ErrorCode::Unavailable => {
            "the plugin is not ready or kept failing transiently; check `csictl plugins TYPE` \
             and retry (publish and unpublish are safe to repeat)"
        }
        ErrorCode::Internal => "csi-agentd could not do its own part; its log says why",
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use std::io;
    use std::path::PathBuf;

    use csi_agent_api::ErrorBody;

    use super::*;

    /// A refusal of the daemon with `code` and the message "m".
    pub(crate) fn api(code: ErrorCode) -> Failure {
        Failure::Api(ApiError::Api {
            status: code.http_status(),
            body: ErrorBody {
                code,
                message: "m".to_owned(),
                grpc_code: None,
            },
        })
    }

    #[test]
    fn exit_codes() {
        assert_eq!(Failure::Usage("x".to_owned()).exit_code(), 2);
        assert_eq!(api(ErrorCode::NotFound).exit_code(), 1);
        let connect = Failure::Api(ApiError::Connect {
            socket: PathBuf::from("/x"),
            source: io::Error::from_raw_os_error(2),
        });
        assert_eq!(connect.exit_code(), 3);
        assert!(
            connect
                .hint()
                .unwrap_or_default()
                .contains("CSI_AGENT_SOCKET")
        );
        let url = Failure::Api(ApiError::InvalidUrl {
            url: "x".to_owned(),
            reason: "y".to_owned(),
        });
        assert_eq!(url.exit_code(), 2);
    }

    #[test]
    fn a_refusal_with_its_own_hint_keeps_the_apis_message_code_and_status() {
        let Failure::Api(err) = api(ErrorCode::NotFound) else {
            unreachable!()
        };
        let refused = Failure::Refused {
            err,
            hint: "start it with --x",
        };
        assert_eq!(refused.exit_code(), 1);
        assert_eq!(refused.to_string(), "m");
        assert_eq!(refused.hint().as_deref(), Some("start it with --x"));
        let json = refused.to_json();
        assert_eq!(json["error"]["code"], "not_found");
        assert_eq!(json["error"]["http_status"], 404);
        assert_eq!(json["error"]["hint"], "start it with --x");
    }

    #[test]
    fn every_code_has_a_hint() {
        for code in ErrorCode::ALL {
            assert!(api(code).hint().is_some_and(|h| !h.is_empty()), "{code:?}");
        }
    }
}
