//! The `secret` of a Mesos `Environment.Variable` of `type: SECRET` (Mesos `Secret`).
//!
//! This module owns reading an inline secret (`{"type": "VALUE", "value": {"data":
//! <base64>}}`, the protobuf JSON form of `bytes`, as Mesos parses it) into the variable's
//! value. It must never put the secret's value, nor its encoded form, into an error
//! message: errors name the field and say what to fix, and they are logged and answered.
//! `REFERENCE` secrets (resolved by a secret store) are refused: csi-agent has none yet.

use base64::Engine;
use serde_json::Value;

/// The largest decoded secret accepted, in bytes: an environment variable, not a file.
const MAX_SECRET_LEN: usize = 64 * 1024;

/// The value of an inline secret. An error is `(field relative to the variable, message)`.
pub(super) fn inline_secret(secret: Option<&Value>) -> Result<String, (String, String)> {
    let err = |field: &str, message: &str| Err((field.to_owned(), message.to_owned()));
    let Some(secret) = secret.filter(|s| !s.is_null()) else {
        return err(
            "secret",
            "is required for a SECRET variable: {\"type\": \"VALUE\", \"value\": {\"data\": \"<base64>\"}}",
        );
    };
    let Some(secret) = secret.as_object() else {
        return err("secret", "must be an object");
    };
    if let Some(key) = secret
        .keys()
        .find(|k| !matches!(k.as_str(), "type" | "value" | "reference"))
    {
        return Err((
            format!("secret.{key}"),
            "unknown field; known fields here: type, value, reference".to_owned(),
        ));
    }
    match secret.get("type").and_then(Value::as_str) {
        Some("VALUE") => {}
        Some("REFERENCE") => {
            return err(
                "secret.type",
                "REFERENCE secrets are not supported (csi-agent has no secret store); give the secret inline: {\"type\": \"VALUE\", \"value\": {\"data\": \"<base64>\"}}",
            );
        }
        _ => return err("secret.type", "is required: \"VALUE\""),
    }
    if secret.get("reference").is_some_and(|r| !r.is_null()) {
        return err(
            "secret.reference",
            "is only for REFERENCE secrets; remove it",
        );
    }
    let Some(value) = secret.get("value").and_then(Value::as_object) else {
        return err(
            "secret.value",
            "is required: {\"data\": \"<the secret, base64-encoded>\"}",
        );
    };
    if let Some(key) = value.keys().find(|k| k.as_str() != "data") {
        return Err((
            format!("secret.value.{key}"),
            "unknown field; known fields here: data".to_owned(),
        ));
    }
    let Some(data) = value.get("data").and_then(Value::as_str) else {
        return err(
            "secret.value.data",
            "is required: the secret, base64-encoded (a protobuf `bytes` field)",
        );
    };
    let Ok(bytes) = base64::engine::general_purpose::STANDARD.decode(data) else {
        return err(
            "secret.value.data",
            "is not valid base64; encode the secret with `base64 -w0`",
        );
    };
    if bytes.len() > MAX_SECRET_LEN {
        return Err((
            "secret.value.data".to_owned(),
            format!(
                "decodes to {} bytes; at most {MAX_SECRET_LEN} fit in an environment variable here",
                bytes.len()
            ),
        ));
    }
    String::from_utf8(bytes).or_else(|_| {
        err(
            "secret.value.data",
            "does not decode to UTF-8 text; an environment variable's value must be text",
        )
    })
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn an_inline_secret_decodes_and_errors_never_show_it() {
        let secret = json!({"type": "VALUE", "value": {"data": "czNjcjN0LXZhbHVl"}});
        assert_eq!(inline_secret(Some(&secret)).unwrap(), "s3cr3t-value");

        for (bad, field) in [
            (json!(null), "secret"),
            (json!("x"), "secret"),
            (
                json!({"type": "REFERENCE", "reference": {"name": "n"}}),
                "secret.type",
            ),
            (json!({"value": {"data": "czNjcjN0"}}), "secret.type"),
            (json!({"type": "VALUE"}), "secret.value"),
            (
                json!({"type": "VALUE", "value": {"data": "czNjcjN0", "x": 1}}),
                "secret.value.x",
            ),
            (
                json!({"type": "VALUE", "value": {"data": "not base64 czNjcjN0!"}}),
                "secret.value.data",
            ),
            (
                json!({"type": "VALUE", "value": {"data": "//79"}}),
                "secret.value.data",
            ),
            (
                json!({"type": "VALUE", "value": {"data": "czNjcjN0"}, "reference": {"name": "n"}}),
                "secret.reference",
            ),
            (json!({"type": "VALUE", "valu": {}}), "secret.valu"),
        ] {
            let (got, message) = inline_secret(Some(&bad)).unwrap_err();
            assert_eq!(got, field, "{bad}: {message}");
            // Neither the secret nor its encoding is ever part of a message.
            assert!(
                !message.contains("czNjcjN0") && !message.contains("s3cr3t"),
                "{message}"
            );
        }
        assert!(inline_secret(None).is_err());
    }
}
