//! Topology, the per-node volume limit and ControllerGetVolume of the test
//! plugin (`--topology`, `--max-volumes-per-node`, `--get-volume`).
//!
//! Owns: parsing `--topology KEY=VALUE,...`, deciding whether a CreateVolume's
//! `accessibility_requirements` or a GetCapacity's `accessible_topology` can
//! be served by this plugin's one node, and the answer of ControllerGetVolume
//! (published node ids from the controller publications).
//!
//! Must not: know protobuf types (the v1 adapter converts), or change volume
//! state. The plugin serves exactly one topology, its node's: every volume it
//! creates is accessible from that topology only.

use std::collections::BTreeMap;

use tonic::Status;

/// One topology segment map (`{"zone": "a", "rack": "1"}`).
pub type Segments = BTreeMap<String, String>;

/// CreateVolume's `accessibility_requirements`, version-neutral.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Requirements {
    pub requisite: Vec<Segments>,
    pub preferred: Vec<Segments>,
}

/// Parses `--topology zone=a,rack=1`. Keys follow the spec's rule for
/// topology keys ("an optional prefix and name, separated by a slash ...
/// name MUST be 63 characters or less"), checked loosely: non-empty, at most
/// 63 bytes after an optional `prefix/`, no `=` or `,`.
pub fn parse(spec: &str) -> anyhow::Result<Segments> {
    let mut out = Segments::new();
    for part in spec.split(',').filter(|p| !p.trim().is_empty()) {
        let (key, value) = part.split_once('=').ok_or_else(|| {
            anyhow::anyhow!("--topology entry {part:?} is not KEY=VALUE (e.g. zone=a,rack=1)")
        })?;
        let (key, value) = (key.trim(), value.trim());
        let name = key.rsplit_once('/').map_or(key, |(_, n)| n);
        if name.is_empty() || name.len() > 63 {
            anyhow::bail!("--topology key {key:?}: the name must be 1..=63 characters");
        }
        if value.len() > 63 {
            anyhow::bail!("--topology value {value:?} of key {key:?} is longer than 63 characters");
        }
        if out.insert(key.to_owned(), value.to_owned()).is_some() {
            anyhow::bail!("--topology key {key:?} given twice");
        }
    }
    Ok(out)
}

/// Whether the plugin's node serves `wanted`: every key of `wanted` is one of
/// the node's keys with the same value. A segment naming a key the plugin
/// does not know describes a place the plugin does not serve.
pub fn serves(node: &Segments, wanted: &Segments) -> bool {
    wanted.iter().all(|(k, v)| node.get(k) == Some(v))
}

/// Checks a CreateVolume's requirements against the node's topology. A
/// plugin without topology ignores them (it does not advertise
/// VOLUME_ACCESSIBILITY_CONSTRAINTS, so a CO does not send them).
pub fn check_create(node: &Segments, req: Option<&Requirements>) -> Result<(), Status> {
    let Some(req) = req else { return Ok(()) };
    if node.is_empty() {
        return Ok(());
    }
    // TopologyRequirement.requisite: "If requisite is specified, the
    // provisioned volume MUST be accessible from at least one of the
    // requisite topologies." and "Unable to provision in
    // `accessible_topology` | 8 RESOURCE_EXHAUSTED | Indicates that although
    // the `accessible_topology` field is valid, a new volume can not be
    // provisioned with the specified topology constraints."
    if !req.requisite.is_empty() && !req.requisite.iter().any(|t| serves(node, t)) {
        return Err(Status::resource_exhausted(format!(
            "cannot provision in the requisite topologies {:?}: this plugin serves only {node:?}",
            req.requisite
        )));
    }
    // "If requisite is not specified ... the SP MAY choose where the
    // provisioned volume is accessible from" (preferred is a preference; a
    // preferred topology that is not served is not an error).
    Ok(())
}

/// The capacity GetCapacity reports for `topology`: the free bytes if the
/// node serves it, else 0 (spec, GetCapacityRequest.accessible_topology: "If
/// specified, the Plugin SHALL report the capacity of the storage that can be
/// used to provision volumes in the specified accessible_topology.").
pub fn capacity_in(node: &Segments, topology: Option<&Segments>, free: i64) -> i64 {
    match topology {
        Some(t) if !node.is_empty() && !serves(node, t) => 0,
        _ => free,
    }
}

/// The `accessible_topology` of a volume this plugin created: its node's, or
/// none when the plugin has no topology.
pub fn volume_topology(node: &Segments) -> Vec<Segments> {
    if node.is_empty() {
        Vec::new()
    } else {
        vec![node.clone()]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seg(pairs: &[(&str, &str)]) -> Segments {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect()
    }

    #[test]
    fn parses_and_rejects() {
        assert_eq!(
            parse("zone=a,rack=1").unwrap_or_default(),
            seg(&[("zone", "a"), ("rack", "1")])
        );
        assert_eq!(parse("").unwrap_or_default(), Segments::new());
        for bad in [
            "zone",
            "=a",
            "zone=a,zone=b",
            &format!("{}=a", "k".repeat(64)),
        ] {
            assert!(parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn requisite_of_another_zone_is_refused() {
        let node = seg(&[("zone", "a"), ("rack", "1")]);
        let ok = Requirements {
            requisite: vec![seg(&[("zone", "b")]), seg(&[("zone", "a")])],
            preferred: vec![seg(&[("zone", "b")])],
        };
        assert!(check_create(&node, Some(&ok)).is_ok());
        let bad = Requirements {
            requisite: vec![seg(&[("zone", "b")])],
            preferred: Vec::new(),
        };
        let err = check_create(&node, Some(&bad)).err();
        assert_eq!(err.map(|e| e.code()), Some(tonic::Code::ResourceExhausted));
        assert!(check_create(&Segments::new(), Some(&bad)).is_ok());
        assert_eq!(capacity_in(&node, Some(&seg(&[("zone", "b")])), 10), 0);
        assert_eq!(capacity_in(&node, Some(&seg(&[("zone", "a")])), 10), 10);
        assert_eq!(capacity_in(&node, Some(&seg(&[("region", "x")])), 10), 0);
        assert_eq!(capacity_in(&node, None, 10), 10);
    }
}
