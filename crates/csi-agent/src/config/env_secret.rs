//! The `secret` of a Mesos `Environment.Variable` of `type: SECRET` (Mesos `Secret`).
//!
//! This module owns reading an inline secret (`{"type": "VALUE", "value": {"data":
//! <base64>}}`, the protobuf JSON form of `bytes`, as Mesos parses it) into the variable's
//! value, and checking the form of a `REFERENCE` one (`{"type": "REFERENCE", "reference":
//! {"name": N, "key": K}}`, Mesos's `Secret.Reference`); the referenced file is read at
//! launch, not here ([`crate::secrets`]). It must never put the secret's value, nor its
//! encoded form, into an error message: errors name the field and say what to fix, and they
//! are logged and answered.

use base64::Engine;
use serde_json::Value;

use crate::secrets::SecretRef;

/// The largest decoded secret accepted, in bytes: an environment variable, not a file.
const MAX_SECRET_LEN: usize = 64 * 1024;

/// What a SECRET variable's `secret` gives.
pub(super) enum Secret {
    /// An inline value, decoded.
    Value(String),
    /// A reference, read at launch.
    Reference(SecretRef),
}

/// The secret of a SECRET variable. An error is `(field relative to the variable, message)`.
pub(super) fn secret(secret: Option<&Value>) -> Result<Secret, (String, String)> {
    if let Some(object) = secret.and_then(Value::as_object) {
        unknown_key(object, "secret", &["type", "value", "reference"])?;
        if object.get("type").and_then(Value::as_str) == Some("REFERENCE") {
            return reference(object).map(Secret::Reference);
        }
    }
    inline_secret(secret).map(Secret::Value)
}

/// A REFERENCE secret's `{name, key}` (Mesos's `Secret.Reference`; `key` is optional there,
/// but a file needs one).
fn reference(secret: &serde_json::Map<String, Value>) -> Result<SecretRef, (String, String)> {
    let err = |field: &str, message: &str| Err((field.to_owned(), message.to_owned()));
    if secret.get("value").is_some_and(|v| !v.is_null()) {
        return err("secret.value", "is only for VALUE secrets; remove it");
    }
    let Some(reference) = secret.get("reference").and_then(Value::as_object) else {
        return err(
            "secret.reference",
            "is required for a REFERENCE secret: {\"name\": \"<dir in --secret-dir>\", \"key\": \"<file in it>\"}",
        );
    };
    unknown_key(reference, "secret.reference", &["name", "key"])?;
    let mut parts = Vec::with_capacity(2);
    for field in ["name", "key"] {
        let Some(part) = reference.get(field).and_then(Value::as_str) else {
            return Err((
                format!("secret.reference.{field}"),
                "is required: a string naming a file of --secret-dir (<name>/<key>)".to_owned(),
            ));
        };
        crate::secrets::check_part(part).map_err(|why| {
            (
                format!("secret.reference.{field}"),
                format!("{part:?} {why} (it names a file beneath --secret-dir)"),
            )
        })?;
        parts.push(part.to_owned());
    }
    let key = parts.pop().unwrap_or_default();
    let name = parts.pop().unwrap_or_default();
    Ok(SecretRef { name, key })
}

/// The first key of `object` not in `known`, as an error on `<prefix>.<key>`.
fn unknown_key(
    object: &serde_json::Map<String, Value>,
    prefix: &str,
    known: &[&str],
) -> Result<(), (String, String)> {
    match object.keys().find(|k| !known.contains(&k.as_str())) {
        Some(key) => Err((
            format!("{prefix}.{key}"),
            format!("unknown field; known fields here: {}", known.join(", ")),
        )),
        None => Ok(()),
    }
}

/// The value of an inline secret. An error is `(field relative to the variable, message)`.
fn inline_secret(secret: Option<&Value>) -> Result<String, (String, String)> {
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
    match secret.get("type").and_then(Value::as_str) {
        Some("VALUE") => {}
        _ => return err("secret.type", "is required: \"VALUE\" or \"REFERENCE\""),
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
    unknown_key(value, "secret.value", &["data"])?;
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
        let inline = json!({"type": "VALUE", "value": {"data": "czNjcjN0LXZhbHVl"}});
        assert_eq!(inline_secret(Some(&inline)).unwrap(), "s3cr3t-value");

        for (bad, field) in [
            (json!(null), "secret"),
            (json!("x"), "secret"),
            (
                json!({"type": "REFERENCE", "reference": {"name": "n"}}),
                "secret.reference.key",
            ),
            (
                json!({"type": "REFERENCE", "reference": {"name": "..", "key": "k"}}),
                "secret.reference.name",
            ),
            (
                json!({"type": "REFERENCE", "reference": {"name": "n", "key": "a/b"}}),
                "secret.reference.key",
            ),
            (
                json!({"type": "REFERENCE", "reference": {"name": "", "key": "k"}}),
                "secret.reference.name",
            ),
            (json!({"type": "REFERENCE"}), "secret.reference"),
            (
                json!({"type": "REFERENCE", "reference": {"name": "n", "key": "k"}, "value": {"data": "czNjcjN0"}}),
                "secret.value",
            ),
            (json!({"type": "OTHER"}), "secret.type"),
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
            let Err((got, message)) = secret(Some(&bad)) else {
                panic!("{bad} accepted");
            };
            assert_eq!(got, field, "{bad}: {message}");
            // Neither the secret nor its encoding is ever part of a message.
            assert!(
                !message.contains("czNjcjN0") && !message.contains("s3cr3t"),
                "{message}"
            );
        }
        assert!(inline_secret(None).is_err());
        let Ok(Secret::Reference(reference)) = secret(Some(
            &json!({"type": "REFERENCE", "reference": {"name": "nfs", "key": "password"}}),
        )) else {
            panic!("a reference is refused");
        };
        assert_eq!(
            (reference.name.as_str(), reference.key.as_str()),
            ("nfs", "password")
        );
    }
}
