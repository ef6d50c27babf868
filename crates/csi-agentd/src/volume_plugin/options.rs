//! The `-o KEY=VALUE` options of `docker volume create -d DRIVER` / `podman volume create
//! --driver DRIVER` (the table of docs/docker-podman.md), parsed into the engine's
//! [`NamedSpec`]. Every refusal names the option and says what to give instead; nothing is
//! created for a create whose options do not parse.

use std::collections::BTreeMap;

use csi_agent::named::NamedSpec;
use csi_agent::volume::{AccessMode, AccessType, Capability};

use crate::convert;

/// Options without a prefix; `param.`, `secret.` and `context.` take a key after the dot.
const OPTIONS: [&str; 6] = [
    "plugin",
    "size",
    "fs_type",
    "access_mode",
    "mount_flags",
    "volume_id",
];
/// The most options one create takes (parameters, secrets and context included).
pub const MAX_OPTIONS: usize = 128;
/// The longest option value, in bytes (CSI's size limit for a map's values is 128 bytes for
/// keys and 4 KiB in all; a value past this is no plugin's).
pub const MAX_VALUE_BYTES: usize = 4096;

/// Parses the options of a create; the message names the option at fault.
pub fn parse(options: &BTreeMap<String, String>) -> Result<NamedSpec, String> {
    if options.len() > MAX_OPTIONS {
        return Err(format!(
            "{} options given, at most {MAX_OPTIONS} are taken",
            options.len()
        ));
    }
    let mut plugin = None;
    let mut spec = NamedSpec {
        plugin: String::new(),
        volume_id: None,
        capacity_bytes: 0,
        capability: Capability {
            access_type: AccessType::Mount {
                fs_type: String::new(),
                mount_flags: Vec::new(),
            },
            access_mode: AccessMode::SingleNodeWriter,
        },
        parameters: BTreeMap::new(),
        volume_context: BTreeMap::new(),
        secrets: BTreeMap::new(),
        options: BTreeMap::new(),
    };
    let mut fs_type = String::new();
    let mut mount_flags = Vec::new();
    for (key, value) in options {
        if value.len() > MAX_VALUE_BYTES {
            return Err(format!(
                "option {key}: its value is {} bytes, at most {MAX_VALUE_BYTES} are taken",
                value.len()
            ));
        }
        let shown = if key.starts_with("secret.") {
            "<secret>".to_owned()
        } else {
            value.clone()
        };
        spec.options.insert(key.clone(), shown);
        if let Some((prefix, inner)) = key.split_once('.') {
            if inner.is_empty() {
                return Err(format!(
                    "option {key}: give a key after \"{prefix}.\", e.g. {prefix}.KEY=VALUE"
                ));
            }
            let map = match prefix {
                "param" => &mut spec.parameters,
                "secret" => &mut spec.secrets,
                "context" => &mut spec.volume_context,
                _ => return Err(unknown(key)),
            };
            map.insert(inner.to_owned(), value.clone());
            continue;
        }
        match key.as_str() {
            "plugin" => plugin = Some(value.clone()),
            "size" => {
                spec.capacity_bytes = csi_agent_api::size::parse_size(value)
                    .map_err(|err| format!("option size={value:?}: {err}"))?;
            }
            "fs_type" => fs_type.clone_from(value),
            "access_mode" => {
                spec.capability.access_mode = convert::access_mode(&value.to_ascii_uppercase())
                    .map_err(|failure| format!("option access_mode: {}", failure.0.message))?;
            }
            "mount_flags" => {
                mount_flags = value
                    .split(',')
                    .filter(|flag| !flag.is_empty())
                    .map(str::to_owned)
                    .collect();
            }
            "volume_id" => spec.volume_id = Some(value.clone()),
            _ => return Err(unknown(key)),
        }
    }
    spec.plugin = plugin.filter(|p| !p.is_empty()).ok_or_else(|| {
        "option plugin is missing: give -o plugin=TYPE, a plugin type csi-agentd serves (csictl plugins lists them)"
            .to_owned()
    })?;
    if spec.volume_id.is_none() && !spec.volume_context.is_empty() {
        return Err(
            "options context.*: a volume's context is given only when naming an existing volume (with -o volume_id=ID); a created volume gets the plugin's"
                .to_owned(),
        );
    }
    if spec.volume_id.is_some() && spec.capacity_bytes != 0 {
        return Err(
            "option size: an existing volume (-o volume_id=ID) is named as it is; leave size out"
                .to_owned(),
        );
    }
    spec.capability.access_type = AccessType::Mount {
        fs_type,
        mount_flags,
    };
    Ok(spec)
}

fn unknown(key: &str) -> String {
    format!(
        "unknown option {key:?}: the options are {}, and param.KEY, secret.KEY, context.KEY (docs/docker-podman.md)",
        OPTIONS.join(", ")
    )
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn options(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect()
    }

    #[test]
    fn every_option_lands_in_its_field() {
        let spec = parse(&options(&[
            ("plugin", "org.example.test"),
            ("size", "16Mi"),
            ("fs_type", "ext4"),
            ("access_mode", "single_node_multi_writer"),
            ("mount_flags", "noatime,nodev"),
            ("param.tier", "fast"),
            ("secret.token", "s3cr3t"),
        ]))
        .unwrap();
        assert_eq!(spec.plugin, "org.example.test");
        assert_eq!(spec.capacity_bytes, 16 << 20);
        assert_eq!(
            spec.capability.access_type,
            AccessType::Mount {
                fs_type: "ext4".into(),
                mount_flags: vec!["noatime".into(), "nodev".into()],
            }
        );
        assert_eq!(
            spec.capability.access_mode,
            AccessMode::SingleNodeMultiWriter
        );
        assert_eq!(spec.parameters, options(&[("tier", "fast")]));
        assert_eq!(spec.secrets, options(&[("token", "s3cr3t")]));
        // The options kept (and shown) never hold a secret's value.
        assert_eq!(spec.options["secret.token"], "<secret>");
        assert!(!format!("{:?}", spec.options).contains("s3cr3t"));
    }

    #[test]
    fn bad_options_name_the_option_and_say_what_to_give() {
        for (given, expected) in [
            (vec![("size", "1Gi")], "option plugin is missing"),
            (
                vec![("plugin", "p"), ("size", "lots")],
                "option size=\"lots\"",
            ),
            (
                vec![("plugin", "p"), ("colour", "red")],
                "unknown option \"colour\"",
            ),
            (
                vec![("plugin", "p"), ("parm.x", "1")],
                "unknown option \"parm.x\"",
            ),
            (
                vec![("plugin", "p"), ("param.", "1")],
                "give a key after \"param.\"",
            ),
            (
                vec![("plugin", "p"), ("access_mode", "rw")],
                "option access_mode: capability.access_mode \"RW\"",
            ),
            (
                vec![("plugin", "p"), ("context.a", "1")],
                "options context.*",
            ),
            (
                vec![("plugin", "p"), ("volume_id", "v"), ("size", "1")],
                "option size: an existing volume",
            ),
        ] {
            let err = parse(&options(&given)).unwrap_err();
            assert!(err.contains(expected), "{given:?}: {err}");
        }
        let huge = "x".repeat(MAX_VALUE_BYTES + 1);
        let err = parse(&options(&[("plugin", "p"), ("param.k", &huge)])).unwrap_err();
        assert!(
            err.contains("option param.k: its value is 4097 bytes"),
            "{err}"
        );
        let many: BTreeMap<String, String> = (0..=MAX_OPTIONS)
            .map(|i| (format!("param.k{i}"), "v".to_owned()))
            .collect();
        assert!(parse(&many).unwrap_err().contains("at most 128"));
    }
}
