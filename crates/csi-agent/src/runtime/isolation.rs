//! The isolation a Mesos component asks for: its `resources` (`cpus`, `mem`) and the parts of
//! its `container` (`ContainerInfo`) that confine it — `volumes`, `linux_info` capabilities
//! (effective and bounding), `rlimit_info`, `hostname` — parsed and validated the same way
//! whichever runtime runs the component (issue #29 item 3).
//!
//! It owns: what each of those fields means here ([`parse`]), which of them a component
//! actually asks for ([`requested`], used to run an image-less component that asks for any in
//! the oci runtime, to name them when that runtime is missing, and to say which the process
//! runtime leaves unapplied), and the one warning for each field no runtime honours
//! ([`unhonoured`]). It must not run anything or touch the host: applying the isolation is the
//! oci runtime's bundle's job (`super::oci::bundle`).
//!
//! An error is `(field relative to the component, message)`; the config parser puts the
//! `containers[i].` prefix in front.

use serde_json::Value;

use super::oci::{Limits, VolumeBind, canonical_capability, limits, volumes};

/// One rlimit, as the OCI spec takes it (`RLIMIT_NOFILE`, hard, soft).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Rlimit {
    /// The OCI / Linux name (`RLIMIT_NOFILE`), from Mesos's `RLMT_NOFILE`.
    pub typ: String,
    pub hard: u64,
    pub soft: u64,
}

/// The capability sets a component asks for (canonical names, `CAP_SYS_ADMIN`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CapabilitySets {
    /// Effective and permitted.
    pub effective: Vec<String>,
    /// Bounding: a superset of `effective`.
    pub bounding: Vec<String>,
}

/// Everything [`parse`] reads.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Isolation {
    pub limits: Limits,
    pub volumes: Vec<VolumeBind>,
    /// `None`: the config asks for no particular capabilities.
    pub capabilities: Option<CapabilitySets>,
    pub rlimits: Vec<Rlimit>,
    pub hostname: Option<String>,
}

/// Mesos's rlimit types (`RLimitInfo.RLimit.Type` without `UNKNOWN`), which are Linux's
/// `RLIMIT_*` under another prefix.
const RLIMIT_TYPES: &[&str] = &[
    "AS",
    "CORE",
    "CPU",
    "DATA",
    "FSIZE",
    "LOCKS",
    "MEMLOCK",
    "MSGQUEUE",
    "NICE",
    "NOFILE",
    "NPROC",
    "RSS",
    "RTPRIO",
    "RTTIME",
    "SIGPENDING",
    "STACK",
];

/// Longest hostname (`HOST_NAME_MAX`).
const MAX_HOSTNAME_LEN: usize = 64;

/// Parses and validates the isolation fields of one component.
pub fn parse(
    resources: &[Value],
    container: Option<&Value>,
) -> Result<Isolation, (String, String)> {
    let limits = limits(resources)?;
    let Some(container) = container.filter(|c| c.is_object()) else {
        return Ok(Isolation {
            limits,
            ..Isolation::default()
        });
    };
    let in_container = |(field, message): (String, String)| (format!("container.{field}"), message);
    Ok(Isolation {
        limits,
        volumes: volumes(container).map_err(in_container)?,
        capabilities: capability_sets(container).map_err(in_container)?,
        rlimits: rlimits(container).map_err(in_container)?,
        hostname: hostname(container).map_err(in_container)?,
    })
}

/// The isolation fields a component asks for, by name (`resources.cpus`,
/// `container.volumes`, ...), in a fixed order; empty when it asks for none. Only presence is
/// looked at (an empty list asks for nothing); [`parse`] validates.
pub fn requested(resources: &[Value], container: Option<&Value>) -> Vec<&'static str> {
    let mut fields = Vec::new();
    for (name, field) in [("cpus", "resources.cpus"), ("mem", "resources.mem")] {
        if resources
            .iter()
            .any(|r| r.get("name").and_then(Value::as_str) == Some(name))
        {
            fields.push(field);
        }
    }
    let Some(container) = container else {
        return fields;
    };
    let given = |value: Option<&Value>| match value {
        None | Some(Value::Null) => false,
        Some(Value::Array(items)) => !items.is_empty(),
        Some(Value::String(text)) => !text.is_empty(),
        Some(_) => true,
    };
    let linux = container.get("linux_info");
    let capabilities_of = |key: &str| {
        linux
            .and_then(|l| l.get(key))
            .and_then(|c| c.get("capabilities"))
    };
    for (present, field) in [
        (given(container.get("volumes")), "container.volumes"),
        (
            given(capabilities_of("effective_capabilities"))
                || given(capabilities_of("capability_info")),
            "container.linux_info.effective_capabilities",
        ),
        (
            given(capabilities_of("bounding_capabilities")),
            "container.linux_info.bounding_capabilities",
        ),
        (
            given(container.get("rlimit_info").and_then(|r| r.get("rlimits"))),
            "container.rlimit_info",
        ),
        (given(container.get("hostname")), "container.hostname"),
    ] {
        if present {
            fields.push(field);
        }
    }
    fields
}

/// The fields of `container` that ask for something neither runtime does, each with what
/// happens instead: the config parser logs one warning for each (they are never silently
/// dropped, and never fatal: Mesos configs carry some of them by habit). A field set to
/// `false`, `0`, `""` or `[]` asks for nothing and is not listed.
pub fn unhonoured(container: &Value) -> Vec<(String, &'static str)> {
    const FIELDS: &[(&str, &str, &str)] = &[
        (
            "linux_info",
            "share_pid_namespace",
            "runtime.host_pid decides whether the PID namespace is the host's",
        ),
        ("linux_info", "seccomp", "no seccomp filter is applied"),
        (
            "linux_info",
            "ipc_mode",
            "a container always has an IPC namespace of its own, a process component the host's",
        ),
        (
            "linux_info",
            "shm_size",
            "a container's /dev/shm is always 64 MiB",
        ),
        (
            "linux_info",
            "share_cgroups",
            "a container always has a cgroup of its own",
        ),
        (
            "",
            "network_infos",
            "no CNI networks: the host's network is shared unless runtime.host_network is false",
        ),
        (
            "",
            "tty_info",
            "stdin is /dev/null, stdout and stderr files",
        ),
        (
            "docker",
            "network",
            "the host's network is shared unless runtime.host_network is false",
        ),
        (
            "docker",
            "port_mappings",
            "the host's network is shared: nothing is mapped",
        ),
        (
            "docker",
            "parameters",
            "there is no docker CLI to pass them to",
        ),
        (
            "docker",
            "privileged",
            "runtime.privileged decides (default: true for a node component)",
        ),
        ("docker", "volume_driver", "no Docker volume drivers"),
    ];
    let mut found = Vec::new();
    for (parent, key, instead) in FIELDS {
        let object = if parent.is_empty() {
            Some(container)
        } else {
            container.get(*parent)
        };
        let asks = match object.and_then(|o| o.get(*key)) {
            None | Some(Value::Null | Value::Bool(false)) => false,
            Some(Value::Array(items)) => !items.is_empty(),
            Some(Value::Object(fields)) => !fields.is_empty(),
            // Mesos's default Docker network is the host's, which is what csi-agent gives.
            Some(Value::String(text)) => !text.is_empty() && text != "HOST",
            Some(Value::Number(n)) => n.as_f64() != Some(0.0),
            Some(Value::Bool(true)) => true,
        };
        if asks {
            let field = if parent.is_empty() {
                format!("container.{key}")
            } else {
                format!("container.{parent}.{key}")
            };
            found.push((field, *instead));
        }
    }
    found
}

/// One `CapabilityInfo.capabilities` list, canonicalized.
fn capability_list(linux: &Value, key: &str) -> Result<Option<Vec<String>>, (String, String)> {
    let Some(names) = linux.get(key).and_then(|c| c.get("capabilities")) else {
        return Ok(None);
    };
    let field = format!("linux_info.{key}.capabilities");
    let Some(names) = names.as_array() else {
        return Err((field, "must be a list".to_owned()));
    };
    let mut canonical = Vec::new();
    for (index, name) in names.iter().enumerate() {
        let Some(found) = name.as_str().and_then(canonical_capability) else {
            return Err((
                format!("{field}[{index}]"),
                format!(
                    "{name} is not a Linux capability; use a name like \"SYS_ADMIN\" (see capabilities(7))"
                ),
            ));
        };
        if !canonical.contains(&found) {
            canonical.push(found);
        }
    }
    Ok(Some(canonical))
}

/// `linux_info.effective_capabilities` (or Mesos's older `capability_info`) and
/// `linux_info.bounding_capabilities`, as Mesos's `linux/capabilities` isolator combines
/// them: one given alone is both sets; both given, the effective set must be within the
/// bounding one (Mesos refuses the task otherwise).
pub fn capability_sets(container: &Value) -> Result<Option<CapabilitySets>, (String, String)> {
    let Some(linux) = container.get("linux_info") else {
        return Ok(None);
    };
    let effective = match capability_list(linux, "effective_capabilities")? {
        Some(list) => Some(list),
        None => capability_list(linux, "capability_info")?,
    };
    let bounding = capability_list(linux, "bounding_capabilities")?;
    Ok(match (effective, bounding) {
        (None, None) => None,
        (Some(effective), None) => Some(CapabilitySets {
            bounding: effective.clone(),
            effective,
        }),
        (None, Some(bounding)) => Some(CapabilitySets {
            effective: bounding.clone(),
            bounding,
        }),
        (Some(effective), Some(bounding)) => {
            if let Some(outside) = effective.iter().find(|c| !bounding.contains(c)) {
                return Err((
                    "linux_info.effective_capabilities".to_owned(),
                    format!(
                        "{outside} is not in linux_info.bounding_capabilities: a process cannot hold a capability outside its bounding set; add it there or remove it here"
                    ),
                ));
            }
            Some(CapabilitySets {
                effective,
                bounding,
            })
        }
    })
}

/// `rlimit_info.rlimits` (Mesos `RLimitInfo`): `type` is `RLMT_<NAME>`; `soft` and `hard`
/// are both given (soft at most hard) or both absent (unlimited), as Mesos requires.
fn rlimits(container: &Value) -> Result<Vec<Rlimit>, (String, String)> {
    let Some(info) = container.get("rlimit_info").filter(|i| !i.is_null()) else {
        return Ok(Vec::new());
    };
    let Some(items) = info.get("rlimits") else {
        return Ok(Vec::new());
    };
    let Some(items) = items.as_array() else {
        return Err((
            "rlimit_info.rlimits".to_owned(),
            "must be a list".to_owned(),
        ));
    };
    let mut out: Vec<Rlimit> = Vec::new();
    for (index, item) in items.iter().enumerate() {
        let field = |key: &str| format!("rlimit_info.rlimits[{index}].{key}");
        let typ = item.get("type").and_then(Value::as_str);
        let Some(name) = typ
            .and_then(|t| t.strip_prefix("RLMT_"))
            .filter(|name| RLIMIT_TYPES.contains(name))
        else {
            return Err((
                field("type"),
                format!(
                    "{} is not an rlimit type; use one of {}",
                    item.get("type")
                        .map_or_else(|| "nothing".to_owned(), Value::to_string),
                    RLIMIT_TYPES
                        .iter()
                        .map(|t| format!("RLMT_{t}"))
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            ));
        };
        let number = |key: &str| -> Result<Option<u64>, (String, String)> {
            match item.get(key) {
                None | Some(Value::Null) => Ok(None),
                Some(value) => value
                    .as_u64()
                    .map(Some)
                    .ok_or_else(|| (field(key), format!("must be a whole number, not {value}"))),
            }
        };
        let (hard, soft) = match (number("hard")?, number("soft")?) {
            (None, None) => (u64::MAX, u64::MAX),
            (Some(hard), Some(soft)) if soft <= hard => (hard, soft),
            (Some(hard), Some(soft)) => {
                return Err((
                    field("soft"),
                    format!("{soft} is above hard ({hard}); make soft at most hard"),
                ));
            }
            (Some(_), None) => {
                return Err((
                    field("soft"),
                    "is required with hard (or remove both for unlimited)".to_owned(),
                ));
            }
            (None, Some(_)) => {
                return Err((
                    field("hard"),
                    "is required with soft (or remove both for unlimited)".to_owned(),
                ));
            }
        };
        let typ = format!("RLIMIT_{name}");
        if out.iter().any(|r| r.typ == typ) {
            return Err((
                field("type"),
                format!("RLMT_{name} is given twice; keep one"),
            ));
        }
        out.push(Rlimit { typ, hard, soft });
    }
    Ok(out)
}

/// `hostname`: an RFC 1123 host name (letters, digits, `-` and `.`), at most 64 bytes.
fn hostname(container: &Value) -> Result<Option<String>, (String, String)> {
    let name = match container.get("hostname") {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::String(name)) => name,
        Some(other) => {
            return Err((
                "hostname".to_owned(),
                format!("must be a string, not {other}"),
            ));
        }
    };
    let valid = !name.is_empty()
        && name.len() <= MAX_HOSTNAME_LEN
        && name.split('.').all(|label| {
            !label.is_empty()
                && !label.starts_with('-')
                && !label.ends_with('-')
                && label
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-')
        });
    if !valid {
        return Err((
            "hostname".to_owned(),
            format!(
                "{name:?} is not a host name: use letters, digits, '-' and '.' (labels not starting or ending with '-'), at most {MAX_HOSTNAME_LEN} bytes"
            ),
        ));
    }
    Ok(Some(name.clone()))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use serde_json::json;

    use super::*;

    #[test]
    fn every_field_is_read_and_a_bad_one_names_itself() {
        let container = json!({
            "volumes": [{"container_path": "/data", "host_path": "/srv", "mode": "RO"}],
            "linux_info": {
                "effective_capabilities": {"capabilities": ["SYS_ADMIN"]},
                "bounding_capabilities": {"capabilities": ["SYS_ADMIN", "CAP_CHOWN"]}
            },
            "rlimit_info": {"rlimits": [
                {"type": "RLMT_NOFILE", "hard": 4096, "soft": 1024},
                {"type": "RLMT_CORE"}
            ]},
            "hostname": "plugin-1.example"
        });
        let resources = vec![json!({"name": "cpus", "type": "SCALAR", "scalar": {"value": 0.5}})];
        let parsed = parse(&resources, Some(&container)).unwrap();
        assert_eq!(parsed.limits.cpus, Some(0.5));
        assert_eq!(parsed.volumes.len(), 1);
        assert_eq!(
            parsed.capabilities,
            Some(CapabilitySets {
                effective: vec!["CAP_SYS_ADMIN".to_owned()],
                bounding: vec!["CAP_SYS_ADMIN".to_owned(), "CAP_CHOWN".to_owned()],
            })
        );
        assert_eq!(
            parsed.rlimits,
            vec![
                Rlimit {
                    typ: "RLIMIT_NOFILE".to_owned(),
                    hard: 4096,
                    soft: 1024
                },
                Rlimit {
                    typ: "RLIMIT_CORE".to_owned(),
                    hard: u64::MAX,
                    soft: u64::MAX
                },
            ]
        );
        assert_eq!(parsed.hostname.as_deref(), Some("plugin-1.example"));
        assert_eq!(
            requested(&resources, Some(&container)),
            vec![
                "resources.cpus",
                "container.volumes",
                "container.linux_info.effective_capabilities",
                "container.linux_info.bounding_capabilities",
                "container.rlimit_info",
                "container.hostname"
            ]
        );

        let field = |container: Value| parse(&[], Some(&container)).unwrap_err().0;
        assert_eq!(
            field(
                json!({"linux_info": {"effective_capabilities": {"capabilities": ["CHOWN", "CAP_FLY"]}}})
            ),
            "container.linux_info.effective_capabilities.capabilities[1]"
        );
        assert_eq!(
            field(json!({"linux_info": {"bounding_capabilities": {"capabilities": ["FLY"]}}})),
            "container.linux_info.bounding_capabilities.capabilities[0]"
        );
        assert_eq!(
            field(json!({"linux_info": {
                "effective_capabilities": {"capabilities": ["SYS_ADMIN"]},
                "bounding_capabilities": {"capabilities": ["CHOWN"]}}})),
            "container.linux_info.effective_capabilities"
        );
        assert_eq!(
            field(json!({"rlimit_info": {"rlimits": [{"type": "RLMT_BOGUS"}]}})),
            "container.rlimit_info.rlimits[0].type"
        );
        assert_eq!(
            field(
                json!({"rlimit_info": {"rlimits": [{"type": "RLMT_NOFILE", "hard": 1, "soft": 2}]}})
            ),
            "container.rlimit_info.rlimits[0].soft"
        );
        assert_eq!(
            field(json!({"rlimit_info": {"rlimits": [{"type": "RLMT_NOFILE", "hard": 1}]}})),
            "container.rlimit_info.rlimits[0].soft"
        );
        // Mesos's older name for the effective set.
        assert_eq!(
            field(json!({"linux_info": {"capability_info": {"capabilities": ["NOPE"]}}})),
            "container.linux_info.capability_info.capabilities[0]"
        );
        assert_eq!(field(json!({"hostname": "a b"})), "container.hostname");
        assert_eq!(field(json!({"hostname": "-x"})), "container.hostname");
        let bad_cpus = vec![json!({"name": "cpus", "scalar": {"value": -1}})];
        assert_eq!(
            parse(&bad_cpus, None).unwrap_err().0,
            "resources[0].scalar.value"
        );
    }

    #[test]
    fn nothing_asked_is_nothing_requested_and_unhonoured_fields_are_listed() {
        let plain =
            json!({"type": "MESOS", "volumes": [], "linux_info": {"share_pid_namespace": false}});
        assert!(requested(&[json!({"name": "disk"})], Some(&plain)).is_empty());
        assert!(unhonoured(&plain).is_empty());
        let asking = json!({"linux_info": {"seccomp": {"profile_name": "default"}, "shm_size": 128},
                            "docker": {"image": "x", "network": "BRIDGE", "port_mappings": [{"host_port": 1}]}});
        let fields: Vec<String> = unhonoured(&asking).into_iter().map(|(f, _)| f).collect();
        assert_eq!(
            fields,
            vec![
                "container.linux_info.seccomp",
                "container.linux_info.shm_size",
                "container.docker.network",
                "container.docker.port_mappings"
            ]
        );
    }
}
