//! Rendering of API answers: aligned plain-text tables and `key: value` blocks for people, or
//! the API's JSON pretty-printed for programs.
//!
//! This module owns the look of csictl's output. It must not call the daemon, and it never
//! receives secrets (the API does not return them), so it cannot print one.

use std::fmt::Write as _;

use csi_agent_api::*;
use serde::Serialize;

/// Plain columns separated by two spaces; the last column is not padded. Empty cells show as
/// `-` so that columns stay countable by `awk`.
#[derive(Debug)]
pub struct Table {
    headers: Vec<String>,
    rows: Vec<Vec<String>>,
}

impl Table {
    pub fn new(headers: &[&str]) -> Table {
        Table {
            headers: headers.iter().map(|h| (*h).to_owned()).collect(),
            rows: Vec::new(),
        }
    }

    pub fn row(&mut self, cells: Vec<String>) {
        self.rows.push(cells.iter().map(|c| cell(c)).collect());
    }

    pub fn render(&self) -> String {
        let columns = self.headers.len();
        let mut widths: Vec<usize> = self.headers.iter().map(|h| h.chars().count()).collect();
        for row in &self.rows {
            for (i, text) in row.iter().enumerate().take(columns) {
                widths[i] = widths[i].max(text.chars().count());
            }
        }
        let mut out = String::new();
        for row in std::iter::once(&self.headers).chain(&self.rows) {
            let mut line = String::new();
            for (i, text) in row.iter().enumerate().take(columns) {
                line.push_str(text);
                if i + 1 < columns {
                    let pad = widths[i] - text.chars().count() + 2;
                    line.extend(std::iter::repeat_n(' ', pad));
                }
            }
            out.push_str(line.trim_end());
            out.push('\n');
        }
        out
    }
}

/// `key:  value` lines with the values aligned.
pub fn fields(pairs: &[(&str, String)]) -> String {
    let width = pairs
        .iter()
        .map(|(k, _)| k.chars().count())
        .max()
        .unwrap_or(0);
    let mut out = String::new();
    for (key, value) in pairs {
        let pad = width - key.chars().count() + 2;
        // `writeln!` into a String cannot fail.
        let _ = writeln!(out, "{key}:{}{}", " ".repeat(pad), cell(value));
    }
    out
}

/// A value as one safe cell: `-` when empty, control characters (a newline in a volume id
/// would break the table, an escape sequence could rewrite the terminal) shown escaped.
pub fn cell(text: &str) -> String {
    if text.is_empty() {
        return "-".to_owned();
    }
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        if c.is_control() {
            out.extend(c.escape_default());
        } else {
            out.push(c);
        }
    }
    out
}

fn yes_no(value: bool) -> String {
    if value { "yes" } else { "no" }.to_owned()
}

fn joined(items: &[String]) -> String {
    items.join(",")
}

fn pairs(map: &std::collections::BTreeMap<String, String>) -> String {
    map.iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(",")
}

/// `10737418240 (10Gi)`, or just `0`.
pub fn bytes_with_human(bytes: i64) -> String {
    if bytes < 1024 {
        bytes.to_string()
    } else {
        format!("{bytes} ({})", csi_agent_api::size::human(bytes))
    }
}

/// A word the shell passes through unchanged, quoted when needed, for the commands csictl
/// suggests.
pub fn shell_word(word: &str) -> String {
    let plain = !word.is_empty()
        && word
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"_-./:=@%+,".contains(&b));
    if plain {
        word.to_owned()
    } else {
        format!("'{}'", word.replace('\'', r"'\''"))
    }
}

/// The API's JSON, pretty-printed.
pub fn json<T: Serialize>(value: &T) -> Result<String, serde_json::Error> {
    let mut text = serde_json::to_string_pretty(value)?;
    text.push('\n');
    Ok(text)
}

pub fn health(health: &Health) -> String {
    fields(&[
        ("status", health.status.clone()),
        ("started", yes_no(health.started)),
        ("version", health.version.clone()),
    ])
}

pub fn start(answer: &StartResponse) -> String {
    match (answer.started, answer.opened_now) {
        (true, true) => "start gate opened\n".to_owned(),
        (true, false) => "start gate was already open\n".to_owned(),
        (false, _) => "start gate is still closed\n".to_owned(),
    }
}

fn config_errors(errors: &[ConfigErrorInfo]) -> String {
    if errors.is_empty() {
        return String::new();
    }
    let mut table = Table::new(&["FILE", "ERROR"]);
    for error in errors {
        table.row(vec![error.file.clone(), error.message.clone()]);
    }
    format!(
        "\nconfiguration files that failed to load:\n{}",
        table.render()
    )
}

pub fn plugins(list: &PluginList) -> String {
    let mut out = if list.plugins.is_empty() {
        "no plugins configured\n".to_owned()
    } else {
        let with_errors = list.plugins.iter().any(|p| p.error.is_some());
        let mut headers = vec![
            "TYPE",
            "NAME",
            "MANAGED",
            "STATE",
            "CSI",
            "COMPONENTS",
            "VOLUMES",
        ];
        if with_errors {
            headers.push("ERROR");
        }
        let mut table = Table::new(&headers);
        for plugin in &list.plugins {
            let mut row = vec![
                plugin.plugin_type.clone(),
                plugin.name.clone(),
                yes_no(plugin.managed),
                state_label(&plugin.state),
                plugin.csi_version.clone().unwrap_or_default(),
                components_summary(&plugin.components),
                plugin.volumes.to_string(),
            ];
            if with_errors {
                row.push(plugin.error.clone().unwrap_or_default());
            }
            table.row(row);
        }
        table.render()
    };
    out.push_str(&config_errors(&list.config_errors));
    out
}

/// A plugin state with what it means where that is not obvious: a lazily started plugin is
/// not a broken one.
fn state_label(state: &str) -> String {
    match state {
        "idle" => "idle (starts on first use)".to_owned(),
        "not_started" => {
            "not started (the start gate is closed, or start-up is still recovering it)".to_owned()
        }
        other => other.to_owned(),
    }
}

/// `ready/total`, or empty for an unmanaged plugin (no components of csi-agent's).
fn components_summary(components: &[ComponentInfo]) -> String {
    if components.is_empty() {
        return String::new();
    }
    let ready = components.iter().filter(|c| c.ready).count();
    format!("{ready}/{} ready", components.len())
}

pub fn plugin(plugin: &PluginInfo) -> String {
    let mut pairs = vec![
        ("type", plugin.plugin_type.clone()),
        ("name", plugin.name.clone()),
        ("managed", yes_no(plugin.managed)),
        ("state", state_label(&plugin.state)),
        (
            "csi version",
            plugin.csi_version.clone().unwrap_or_default(),
        ),
        ("config file", plugin.config_file.clone()),
        ("volumes", plugin.volumes.to_string()),
    ];
    if let Some(error) = &plugin.error {
        pairs.push(("error", error.clone()));
    }
    if let Some(node) = &plugin.node {
        pairs.extend(crate::topology::node_fields(node));
    }
    for pull in &plugin.image_pulls {
        pairs.push(("pulling", pull_progress(pull)));
    }
    let mut out = fields(&pairs);
    if !plugin.components.is_empty() {
        let mut table = Table::new(&[
            "COMPONENT",
            "SERVICES",
            "READY",
            "PID",
            "RESTARTS",
            "ENDPOINT",
        ]);
        for c in &plugin.components {
            table.row(vec![
                c.id.clone(),
                joined(&c.services),
                yes_no(c.ready),
                c.pid.map(|p| p.to_string()).unwrap_or_default(),
                c.restarts.to_string(),
                c.endpoint.clone().unwrap_or_default(),
            ]);
        }
        out.push('\n');
        out.push_str(&table.render());
    }
    out
}

/// One pull in flight: `REF: 3.1 MB of 5.6 MB (56 %), 1 of 2 blobs`.
pub fn pull_progress(pull: &ImagePullProgress) -> String {
    let percent = (pull.bytes_done.saturating_mul(100))
        .checked_div(pull.bytes_total)
        .unwrap_or(0);
    let complete = pull
        .blobs
        .iter()
        .filter(|b| b.bytes_done >= b.bytes_total)
        .count();
    let size = |bytes: u64| csi_agent_api::size::human(i64::try_from(bytes).unwrap_or(i64::MAX));
    if pull.blobs.is_empty() {
        return format!("{}: reading the manifest", pull.reference);
    }
    format!(
        "{}: {} of {} ({percent} %), {complete} of {} blobs",
        pull.reference,
        size(pull.bytes_done),
        size(pull.bytes_total),
        pull.blobs.len()
    )
}

pub fn reload(report: &ReloadReport) -> String {
    let mut out = fields(&[
        ("added", report.added.join(", ")),
        ("changed", report.changed.join(", ")),
        ("removed", report.removed.join(", ")),
    ]);
    out.push_str(&config_errors(&report.config_errors));
    out
}

pub fn drain(report: &DrainReport) -> String {
    let mut out = fields(&[
        ("claims released", report.released.len().to_string()),
        ("plugins stopped", report.stopped_plugins.join(", ")),
    ]);
    for claim in &report.released {
        let _ = writeln!(
            out,
            "released: {} {} (workload {})",
            claim.plugin, claim.volume_id, claim.workload
        );
    }
    for left in &report.left {
        let what = match (&left.path, left.volume_id.is_empty()) {
            (Some(path), _) => format!("{path} ({} {})", left.plugin, left.volume_id),
            (None, false) => format!("{} {}", left.plugin, left.volume_id),
            (None, true) => left.plugin.clone(),
        };
        let _ = writeln!(out, "left: {what}: {}", left.reason);
    }
    for failure in &report.failed {
        if failure.volume_id.is_empty() {
            let _ = writeln!(out, "not stopped: {}: {}", failure.plugin, failure.error);
        } else {
            let _ = writeln!(
                out,
                "not released: {} {} (workload {}): {}",
                failure.plugin, failure.volume_id, failure.workload, failure.error
            );
        }
    }
    out
}

pub fn publish(answer: &PublishResponse) -> String {
    let mut pairs = vec![
        ("state", answer.state.clone()),
        ("target path", answer.target_path.clone()),
        (
            "target path (work dir relative)",
            answer.target_path_relative.clone(),
        ),
    ];
    if let Some(bind_to) = &answer.bind_to {
        pairs.push(("bound to", bind_to.clone()));
    }
    fields(&pairs)
}

pub fn unpublish(answer: &UnpublishResponse) -> String {
    let mut out = fields(&[("state", answer.state.clone())]);
    if !answer.was_claimed {
        out.push_str("note: csi-agent tracked no such claim; nothing was changed\n");
    }
    out
}

pub fn volumes(list: &VolumeList) -> String {
    if list.volumes.is_empty() {
        return "no volumes tracked\n".to_owned();
    }
    let mut table = Table::new(&["PLUGIN", "VOLUME", "STATE", "CLAIMS", "TARGET"]);
    let mut abnormal = Vec::new();
    for v in &list.volumes {
        let mut state = v.state.clone();
        if let Some(c) = v.condition.as_ref().filter(|c| c.abnormal) {
            state.push_str(" (abnormal)");
            abnormal.push(format!(
                "volume {} of {} is {}",
                cell(&v.volume_id),
                cell(&v.plugin),
                crate::stats::condition(c)
            ));
        }
        table.row(vec![
            v.plugin.clone(),
            v.volume_id.clone(),
            state,
            joined(&v.claims),
            v.target_path.clone(),
        ]);
    }
    let mut out = table.render();
    for line in abnormal {
        let _ = writeln!(out, "{line}");
    }
    if let Some(token) = &list.next_page_token {
        let _ = writeln!(out, "more volumes follow: add --page-token {token}");
    }
    if list.recovering {
        out.push_str("the daemon is still recovering: more volumes may be listed soon\n");
    }
    out
}

fn capability(cap: &CapabilitySpec) -> String {
    let access = match (&cap.mount, &cap.block) {
        (_, Some(_)) => "block".to_owned(),
        (Some(mount), None) => {
            let fs = if mount.fs_type.is_empty() {
                "plugin's default fs"
            } else {
                &mount.fs_type
            };
            if mount.mount_flags.is_empty() {
                format!("mount ({fs})")
            } else {
                format!("mount ({fs}; {})", mount.mount_flags.join(","))
            }
        }
        (None, None) => "mount".to_owned(),
    };
    format!("{access}, {}", cap.access_mode)
}

pub fn volume(v: &VolumeInfo) -> String {
    let mut pairs = vec![
        ("plugin", v.plugin.clone()),
        ("volume", v.volume_id.clone()),
        ("state", v.state.clone()),
        ("origin", v.origin.clone()),
        ("claims", v.claims.join(", ")),
        (
            "capability",
            v.capability.as_ref().map(capability).unwrap_or_default(),
        ),
        ("readonly", yes_no(v.readonly)),
        ("volume context", pairs(&v.volume_context)),
        ("target path", v.target_path.clone()),
        (
            "target path (work dir relative)",
            v.target_path_relative.clone(),
        ),
        ("secrets stored", yes_no(v.has_secrets)),
    ];
    if let Some(bytes) = v.capacity_bytes {
        pairs.push(("capacity", bytes_with_human(bytes)));
    }
    if let Some(e) = &v.expansion {
        pairs.push((
            "expanding",
            format!(
                "to {}, next step: {}",
                bytes_with_human(e.capacity_bytes),
                e.next_step
            ),
        ));
    }
    pairs.extend(crate::topology::volume_fields(
        &v.accessible_topology,
        v.controller.as_ref(),
    ));
    if let Some(error) = &v.last_error {
        pairs.push(("last error", error.clone()));
    }
    if let Some(op) = &v.operation {
        pairs.push(("in progress", operation(op)));
    }
    if let Some(c) = &v.condition {
        pairs.push(("condition", crate::stats::condition(c)));
    }
    fields(&pairs)
}

/// `publish: node_stage, attempt 3, retrying in 2.0 s after: NodeStageVolume failed: …`.
fn operation(op: &OperationInfo) -> String {
    let mut out = op.operation.clone();
    if let Some(step) = &op.step {
        let _ = write!(out, ": {step}");
    }
    if op.attempt > 0 {
        let _ = write!(out, ", attempt {}", op.attempt);
    }
    if let Some(at) = op.next_retry_at_unix_ms {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64);
        let _ = write!(
            out,
            ", retrying in {:.1} s",
            at.saturating_sub(now) as f64 / 1000.0
        );
    }
    if let Some(error) = &op.last_error {
        let _ = write!(out, " after: {error}");
    }
    out
}

pub fn created(answer: &CreateVolumeResponse) -> String {
    let mut out = vec![
        ("volume", answer.volume_id.clone()),
        ("capacity", bytes_with_human(answer.capacity_bytes)),
        ("volume context", pairs(&answer.volume_context)),
    ];
    out.extend(crate::topology::volume_fields(
        &answer.accessible_topology,
        None,
    ));
    fields(&out)
}

pub fn deleted(answer: &DeleteVolumeResponse) -> String {
    fields(&[("deleted", yes_no(answer.deleted))])
}

pub fn validated(answer: &ValidateResponse) -> String {
    fields(&[
        ("confirmed", yes_no(answer.confirmed)),
        ("message", answer.message.clone()),
    ])
}

/// One page; when there are more, the command that prints the next one.
pub fn backend_volumes(plugin_type: &str, page: &BackendVolumePage) -> String {
    let mut out = if page.volumes.is_empty() {
        "no volumes\n".to_owned()
    } else {
        let mut table = Table::new(&["VOLUME", "CAPACITY", "CONTEXT"]);
        for v in &page.volumes {
            table.row(vec![
                v.volume_id.clone(),
                csi_agent_api::size::human(v.capacity_bytes),
                pairs(&v.volume_context),
            ]);
        }
        table.render()
    };
    if !page.next_token.is_empty() {
        let _ = writeln!(
            out,
            "\nmore: csictl backend-volumes --plugin {} --starting-token {}",
            shell_word(plugin_type),
            shell_word(&page.next_token)
        );
    }
    out
}

pub fn capacity(answer: &CapacityResponse) -> String {
    fields(&[("available", bytes_with_human(answer.available_capacity))])
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;

    #[test]
    fn capacity_is_printed_in_bytes_and_iec_units() {
        assert_eq!(
            capacity(&CapacityResponse {
                available_capacity: 10 << 30
            }),
            "available:  10737418240 (10Gi)\n"
        );
    }

    fn volume_info(plugin: &str, id: &str, state: &str, claims: &[&str]) -> VolumeInfo {
        VolumeInfo {
            plugin: plugin.to_owned(),
            volume_id: id.to_owned(),
            state: state.to_owned(),
            claims: claims.iter().map(|c| (*c).to_owned()).collect(),
            capability: Some(CapabilitySpec::mount(
                "SINGLE_NODE_WRITER",
                "ext4",
                vec!["noatime".to_owned()],
            )),
            readonly: false,
            volume_context: BTreeMap::from([("pool".to_owned(), "fast".to_owned())]),
            target_path: format!("/w/csi/{plugin}/default/mounts/{id}/target"),
            target_path_relative: format!("csi/{plugin}/default/mounts/{id}/target"),
            origin: "created".to_owned(),
            has_secrets: true,
            last_error: None,
            operation: None,
            capacity_bytes: None,
            expansion: None,
            condition: None,
            accessible_topology: vec![],
            controller: None,
        }
    }

    #[test]
    fn table_aligns_columns_and_dashes_empty_cells() {
        let mut table = Table::new(&["A", "LONGER", "C"]);
        table.row(vec!["xxxx".to_owned(), String::new(), "last".to_owned()]);
        table.row(vec!["y".to_owned(), "z".to_owned(), String::new()]);
        assert_eq!(
            table.render(),
            "A     LONGER  C\n\
             xxxx  -       last\n\
             y     z       -\n"
        );
    }

    #[test]
    fn cells_escape_control_characters() {
        assert_eq!(cell("a\nb\u{1b}[2J"), "a\\nb\\u{1b}[2J");
        assert_eq!(cell("é ok"), "é ok");
    }

    #[test]
    fn volumes_table() {
        let list = VolumeList {
            volumes: vec![
                volume_info("org.example.lvm", "vol-1", "PUBLISHED", &["c1", "c2"]),
                volume_info("org.example.nfs", "a/b", "CREATED", &[]),
            ],
            ..VolumeList::default()
        };
        assert_eq!(
            volumes(&list),
            "PLUGIN           VOLUME  STATE      CLAIMS  TARGET\n\
             org.example.lvm  vol-1   PUBLISHED  c1,c2   /w/csi/org.example.lvm/default/mounts/vol-1/target\n\
             org.example.nfs  a/b     CREATED    -       /w/csi/org.example.nfs/default/mounts/a/b/target\n"
        );
        assert_eq!(volumes(&VolumeList::default()), "no volumes tracked\n");
    }

    #[test]
    fn volume_details() {
        let info = volume_info("org.example.lvm", "vol-1", "PUBLISHED", &["c1"]);
        assert_eq!(
            volume(&info),
            "plugin:                           org.example.lvm\n\
             volume:                           vol-1\n\
             state:                            PUBLISHED\n\
             origin:                           created\n\
             claims:                           c1\n\
             capability:                       mount (ext4; noatime), SINGLE_NODE_WRITER\n\
             readonly:                         no\n\
             volume context:                   pool=fast\n\
             target path:                      /w/csi/org.example.lvm/default/mounts/vol-1/target\n\
             target path (work dir relative):  csi/org.example.lvm/default/mounts/vol-1/target\n\
             secrets stored:                   yes\n"
        );
    }

    #[test]
    fn plugins_table_with_config_errors() {
        let list = PluginList {
            plugins: vec![
                PluginInfo {
                    plugin_type: "org.example.lvm".to_owned(),
                    name: "default".to_owned(),
                    managed: true,
                    state: "ready".to_owned(),
                    csi_version: Some("1.9".to_owned()),
                    config_file: "/etc/csi/lvm.json".to_owned(),
                    error: None,
                    components: vec![ComponentInfo {
                        id: "lvm".to_owned(),
                        services: vec!["NODE_SERVICE".to_owned()],
                        ready: true,
                        pid: Some(42),
                        endpoint: None,
                        restarts: 0,
                        error: None,
                    }],
                    volumes: 3,
                    image_pulls: vec![],
                    node: None,
                },
                PluginInfo {
                    plugin_type: "org.example.nfs".to_owned(),
                    name: "default".to_owned(),
                    managed: false,
                    state: "idle".to_owned(),
                    csi_version: None,
                    config_file: "/etc/csi/nfs.json".to_owned(),
                    error: None,
                    components: vec![],
                    volumes: 0,
                    image_pulls: vec![],
                    node: None,
                },
            ],
            config_errors: vec![ConfigErrorInfo {
                file: "/etc/csi/bad.json".to_owned(),
                message: "no \"type\"".to_owned(),
            }],
        };
        assert_eq!(
            plugins(&list),
            "TYPE             NAME     MANAGED  STATE                       CSI  COMPONENTS  VOLUMES\n\
             org.example.lvm  default  yes      ready                       1.9  1/1 ready   3\n\
             org.example.nfs  default  no       idle (starts on first use)  -    -           0\n\
             \n\
             configuration files that failed to load:\n\
             FILE               ERROR\n\
             /etc/csi/bad.json  no \"type\"\n"
        );
    }

    #[test]
    fn plugin_details_with_components() {
        let info = PluginInfo {
            plugin_type: "org.example.lvm".to_owned(),
            name: "default".to_owned(),
            managed: true,
            state: "failed".to_owned(),
            csi_version: None,
            config_file: "/etc/csi/lvm.json".to_owned(),
            error: Some("probe failed".to_owned()),
            components: vec![ComponentInfo {
                id: "csi-org-example-lvm-default--NODE_SERVICE".to_owned(),
                services: vec!["CONTROLLER_SERVICE".to_owned(), "NODE_SERVICE".to_owned()],
                ready: false,
                pid: None,
                endpoint: Some("unix:///w/e.sock".to_owned()),
                restarts: 4,
                error: Some("no runc".to_owned()),
            }],
            volumes: 0,
            image_pulls: vec![ImagePullProgress {
                reference: "r.example/csi/lvm:1".to_owned(),
                started_at_unix_ms: 1,
                bytes_done: 3_000_000,
                bytes_total: 5_000_000,
                blobs: vec![
                    BlobPullProgress {
                        digest: "sha256:c".to_owned(),
                        bytes_done: 1_000,
                        bytes_total: 1_000,
                    },
                    BlobPullProgress {
                        digest: "sha256:l".to_owned(),
                        bytes_done: 2_999_000,
                        bytes_total: 4_999_000,
                    },
                ],
            }],
            node: None,
        };
        assert_eq!(
            plugin(&info),
            "type:         org.example.lvm\n\
             name:         default\n\
             managed:      yes\n\
             state:        failed\n\
             csi version:  -\n\
             config file:  /etc/csi/lvm.json\n\
             volumes:      0\n\
             error:        probe failed\n\
             pulling:      r.example/csi/lvm:1: 2.9Mi of 4.8Mi (60 %), 1 of 2 blobs\n\
             \n\
             COMPONENT                                  SERVICES                         READY  PID  RESTARTS  ENDPOINT\n\
             csi-org-example-lvm-default--NODE_SERVICE  CONTROLLER_SERVICE,NODE_SERVICE  no     -    4         unix:///w/e.sock\n"
        );
    }

    #[test]
    fn publish_answer() {
        let answer = PublishResponse {
            target_path: "/w/t".to_owned(),
            target_path_relative: "t".to_owned(),
            state: "PUBLISHED".to_owned(),
            bind_to: None,
        };
        assert_eq!(
            publish(&answer),
            "state:                            PUBLISHED\n\
             target path:                      /w/t\n\
             target path (work dir relative):  t\n"
        );
    }

    #[test]
    fn backend_page_suggests_next_command() {
        let page = BackendVolumePage {
            volumes: vec![BackendVolume {
                volume_id: "v1".to_owned(),
                capacity_bytes: 3 << 29,
                volume_context: BTreeMap::new(),
            }],
            next_token: "tok en'".to_owned(),
        };
        assert_eq!(
            backend_volumes("org.example.lvm", &page),
            "VOLUME  CAPACITY  CONTEXT\n\
             v1      1.5Gi     -\n\
             \n\
             more: csictl backend-volumes --plugin org.example.lvm --starting-token 'tok en'\\'''\n"
        );
    }

    #[test]
    fn health_and_start() {
        let h = Health {
            status: "ok".to_owned(),
            started: false,
            version: "0.1.0".to_owned(),
        };
        assert_eq!(health(&h), "status:   ok\nstarted:  no\nversion:  0.1.0\n");
        assert_eq!(
            start(&StartResponse {
                started: true,
                opened_now: false
            }),
            "start gate was already open\n"
        );
    }

    #[test]
    fn json_is_the_api_shape() -> Result<(), serde_json::Error> {
        let text = json(&DeleteVolumeResponse { deleted: true })?;
        assert_eq!(text, "{\n  \"deleted\": true\n}\n");
        Ok(())
    }
}
