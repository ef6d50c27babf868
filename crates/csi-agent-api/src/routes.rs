//! Route paths, shared by the server and the clients, and the helpers that fill their
//! `{placeholders}` with percent-encoded values.
//!
//! This module owns the URL shape of the API only: what a route does is the daemon's business,
//! and which body it carries is `types`'s.

pub const HEALTH: &str = "/v1/health";
pub const START: &str = "/v1/start";
pub const METRICS: &str = "/metrics";
pub const PLUGINS: &str = "/v1/plugins";
/// `/v1/plugins/{type}`
pub const PLUGIN: &str = "/v1/plugins/{type}";
pub const PLUGINS_RELOAD: &str = "/v1/plugins/reload";
/// `GET /v1/plugins/{type}/backend-volumes?max_entries=&starting_token=` (ListVolumes)
pub const BACKEND_VOLUMES: &str = "/v1/plugins/{type}/backend-volumes";
pub const PUBLISH: &str = "/v1/volumes/publish";
pub const UNPUBLISH: &str = "/v1/volumes/unpublish";
/// `GET` lists known volumes; `POST` creates one (CreateVolume).
pub const VOLUMES: &str = "/v1/volumes";
/// `GET` one volume; `DELETE` deletes it (DeleteVolume).
pub const VOLUME: &str = "/v1/volumes/{plugin}/{volume_id}";
/// `GET`: a published volume's stats and condition (NodeGetVolumeStats).
pub const VOLUME_STATS: &str = "/v1/volumes/{plugin}/{volume_id}/stats";
pub const VALIDATE: &str = "/v1/volumes/validate";
/// `POST`: ControllerExpandVolume (and NodeExpandVolume) of one volume.
pub const VOLUME_EXPAND: &str = "/v1/volumes/{plugin}/{volume_id}/expand";
pub const CAPACITY: &str = "/v1/capacity";
/// `POST`: unpublish every claim and stop every plugin (`csictl drain`).
pub const DRAIN: &str = "/v1/drain";
/// `GET`: the image store's images.
pub const IMAGES: &str = "/v1/images";
/// `POST`: pull and prepare an image (re-checking its tag).
pub const IMAGES_PULL: &str = "/v1/images/pull";
/// `GET`: the pulls in flight, with their bytes per blob.
pub const IMAGES_PULLS: &str = "/v1/images/pulls";
/// `POST`: remove the images no configured plugin names.
pub const IMAGES_PRUNE: &str = "/v1/images/prune";
/// `POST ?name=REF`: import the images of the archive in the body (`application/x-tar`).
pub const IMAGES_IMPORT: &str = "/v1/images/import";
/// `POST`: create a snapshot (CreateSnapshot).
pub const SNAPSHOTS: &str = "/v1/snapshots";
/// `DELETE`: delete a snapshot (DeleteSnapshot).
pub const SNAPSHOT: &str = "/v1/snapshots/{plugin}/{snapshot_id}";
/// `GET /v1/plugins/{type}/snapshots?max_entries=&starting_token=&source_volume_id=&snapshot_id=`
/// (ListSnapshots)
pub const PLUGIN_SNAPSHOTS: &str = "/v1/plugins/{type}/snapshots";
/// `GET`: this node's cluster session and members (cluster mode).
pub const CLUSTER: &str = "/v1/cluster";
/// `GET ?plugin=&node=&volume=`: the claims held in etcd (cluster mode).
pub const CLUSTER_CLAIMS: &str = "/v1/cluster/claims";
/// `POST`: declare a lost node out of service, freeing its volumes (cluster mode).
pub const CLUSTER_FENCE: &str = "/v1/cluster/nodes/{node}/fence";
/// The media type of `POST /v1/images/import`'s body.
pub const TAR_MEDIA_TYPE: &str = "application/x-tar";

/// Every `(method, path)` the API serves. `openapi.yaml` describes exactly these (checked by
/// `tests/openapi.rs`), and the daemon's router must serve exactly these.
pub const ALL_ROUTES: &[(&str, &str)] = &[
    ("GET", HEALTH),
    ("POST", START),
    ("GET", METRICS),
    ("GET", PLUGINS),
    ("GET", PLUGIN),
    ("POST", PLUGINS_RELOAD),
    ("GET", BACKEND_VOLUMES),
    ("POST", PUBLISH),
    ("POST", UNPUBLISH),
    ("GET", VOLUMES),
    ("POST", VOLUMES),
    ("GET", VOLUME),
    ("DELETE", VOLUME),
    ("POST", VOLUME_EXPAND),
    ("GET", VOLUME_STATS),
    ("POST", VALIDATE),
    ("POST", CAPACITY),
    ("POST", DRAIN),
    ("GET", IMAGES),
    ("POST", IMAGES_PULL),
    ("GET", IMAGES_PULLS),
    ("POST", IMAGES_PRUNE),
    ("POST", IMAGES_IMPORT),
    ("POST", SNAPSHOTS),
    ("DELETE", SNAPSHOT),
    ("GET", PLUGIN_SNAPSHOTS),
    ("GET", CLUSTER),
    ("GET", CLUSTER_CLAIMS),
    ("POST", CLUSTER_FENCE),
];

/// `/v1/plugins/{type}` for one plugin type.
pub fn plugin(plugin_type: &str) -> String {
    format!("{PLUGINS}/{}", encode_segment(plugin_type))
}

/// `/v1/plugins/{type}/backend-volumes` for one plugin type, without a query.
pub fn backend_volumes(plugin_type: &str) -> String {
    format!("{}/backend-volumes", plugin(plugin_type))
}

/// `/v1/snapshots/{plugin}/{snapshot_id}` for one snapshot.
pub fn snapshot(plugin_type: &str, snapshot_id: &str) -> String {
    format!(
        "{SNAPSHOTS}/{}/{}",
        encode_segment(plugin_type),
        encode_segment(snapshot_id)
    )
}

/// `/v1/plugins/{type}/snapshots` for one plugin type, without a query.
pub fn plugin_snapshots(plugin_type: &str) -> String {
    format!("{}/snapshots", plugin(plugin_type))
}

/// `/v1/volumes/{plugin}/{volume_id}` for one volume.
pub fn volume(plugin_type: &str, volume_id: &str) -> String {
    format!(
        "{VOLUMES}/{}/{}",
        encode_segment(plugin_type),
        encode_segment(volume_id)
    )
}

/// `/v1/volumes/{plugin}/{volume_id}/expand` for one volume.
pub fn volume_expand(plugin_type: &str, volume_id: &str) -> String {
    format!("{}/expand", volume(plugin_type, volume_id))
}

/// `/v1/volumes/{plugin}/{volume_id}/stats` for one volume.
pub fn volume_stats(plugin_type: &str, volume_id: &str) -> String {
    format!("{}/stats", volume(plugin_type, volume_id))
}

/// `/v1/cluster/nodes/{node}/fence` for one node.
pub fn cluster_fence(node: &str) -> String {
    format!("{CLUSTER}/nodes/{}/fence", encode_segment(node))
}

/// Percent-encodes every byte outside `[A-Za-z0-9_.~-]` (RFC 3986's unreserved set).
///
/// Volume ids are arbitrary strings from users and plugins: they may hold `/`, `?`, `#`, `%`,
/// spaces or non-ASCII, any of which would change the meaning of the URL if left raw. Encoding
/// everything but the unreserved set is always correct, in a path segment and in a query value
/// alike, so one function serves both.
///
/// The one exception: a value that is exactly `.` or `..` has its dots encoded too (`%2E`),
/// because as a whole path segment it is a dot-segment that a proxy or URL normalizer may
/// resolve away (RFC 3986 §5.2.4), addressing another route.
pub fn encode_segment(raw: &str) -> String {
    const HEX: &[u8; 16] = b"0123456789ABCDEF";
    let dot_segment = raw == "." || raw == "..";
    let mut out = String::with_capacity(raw.len());
    for &byte in raw.as_bytes() {
        let unreserved = byte.is_ascii_alphanumeric() || matches!(byte, b'_' | b'.' | b'~' | b'-');
        if unreserved && !(dot_segment && byte == b'.') {
            out.push(char::from(byte));
        } else {
            out.push('%');
            out.push(char::from(HEX[usize::from(byte >> 4)]));
            out.push(char::from(HEX[usize::from(byte & 0x0f)]));
        }
    }
    out
}

/// A query string (`?k=v&…`, or empty) from the pairs whose value is present, every key and
/// value percent-encoded.
pub fn query(pairs: &[(&str, Option<&str>)]) -> String {
    let mut out = String::new();
    for (key, value) in pairs {
        let Some(value) = value else { continue };
        out.push(if out.is_empty() { '?' } else { '&' });
        out.push_str(&encode_segment(key));
        out.push('=');
        out.push_str(&encode_segment(value));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unreserved_bytes_pass_through() {
        let raw = "AZaz09_.~-";
        assert_eq!(encode_segment(raw), raw);
    }

    #[test]
    fn reserved_and_non_ascii_bytes_are_encoded() {
        assert_eq!(encode_segment("a/b c"), "a%2Fb%20c");
        assert_eq!(encode_segment("%?#&=+"), "%25%3F%23%26%3D%2B");
        assert_eq!(encode_segment("é"), "%C3%A9");
        assert_eq!(encode_segment("\0\n"), "%00%0A");
        assert_eq!(encode_segment(""), "");
    }

    #[test]
    fn dot_segments_are_encoded_whole() {
        assert_eq!(encode_segment("."), "%2E");
        assert_eq!(encode_segment(".."), "%2E%2E");
        assert_eq!(encode_segment("..."), "...");
        assert_eq!(encode_segment("a.."), "a..");
    }

    #[test]
    fn every_byte_outside_unreserved_is_encoded() {
        for byte in 0u8..=127 {
            let s = char::from(byte).to_string();
            if s == "." {
                continue; // a lone dot is a dot-segment; see dot_segments_are_encoded_whole
            }
            let encoded = encode_segment(&s);
            let unreserved = byte.is_ascii_alphanumeric() || b"_.~-".contains(&byte);
            if unreserved {
                assert_eq!(encoded, s);
            } else {
                assert_eq!(encoded, format!("%{byte:02X}"));
            }
        }
    }

    #[test]
    fn concrete_paths_fill_placeholders() {
        assert_eq!(plugin("org.example.lvm"), "/v1/plugins/org.example.lvm");
        assert_eq!(
            backend_volumes("org.example.lvm"),
            "/v1/plugins/org.example.lvm/backend-volumes"
        );
        assert_eq!(
            volume("org.example.lvm", "pool/vol 1"),
            "/v1/volumes/org.example.lvm/pool%2Fvol%201"
        );
        assert_eq!(cluster_fence("n/1"), "/v1/cluster/nodes/n%2F1/fence");
    }

    #[test]
    fn query_skips_absent_values_and_encodes_present_ones() {
        assert_eq!(query(&[("a", None)]), "");
        assert_eq!(
            query(&[
                ("max_entries", Some("10")),
                ("starting_token", Some("a b&c"))
            ]),
            "?max_entries=10&starting_token=a%20b%26c"
        );
        assert_eq!(query(&[("a", None), ("b", Some(""))]), "?b=");
    }

    #[test]
    fn all_routes_has_no_duplicates() {
        let mut seen = std::collections::BTreeSet::new();
        for route in ALL_ROUTES {
            assert!(seen.insert(*route), "duplicate route {route:?}");
        }
    }
}
