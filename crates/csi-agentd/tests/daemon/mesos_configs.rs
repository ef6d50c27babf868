//! Mesos plugin configs as Mesos runs them (issue #29), end to end through the real
//! `csi-agentd` and the real `csi-testplugin`:
//!
//! - every non-hidden file of the config dir is a config whatever its name (DC/OS's
//!   `nfs.conf`, a file without an extension), and a stray non-JSON `README` is an error on
//!   that file in the API and `csictl plugins` while the others serve;
//! - a plugin whose command takes its node id from `$MESOS_AGENT_ID` (a shell command, as in
//!   DC/OS's NFS config, and a non-shell argument csi-agent substitutes) answers
//!   `NodeGetInfo` with csi-agent's node id; `MESOS_AGENT_ID` wins over the config's own
//!   variable of that name and `MESOS_SANDBOX` does not (Mesos's order); `MESOS_SANDBOX` is
//!   the component's working directory;
//! - a SECRET variable given inline and one given as a REFERENCE to a file of
//!   `--secret-dir` reach the plugin's environment and appear in no API answer, metric,
//!   `csictl` output, daemon log line or `component.json`; a rotated secret file applies at
//!   the next launch; a reference to `..` is a config error naming the field;
//! - a reference to a symlink, a 0644 file or a missing file, or any reference without
//!   `--secret-dir`, fails the component's launch with an error naming the reference (and
//!   the flag), never the content.
//!
//! - a process-runtime plugin with `command.user: "nobody"` runs as uid and gid 65534 with no
//!   supplementary group (read from `/proc/<pid>/status`), its socket dir is nobody's (0700)
//!   and it serves a publish; an unknown user fails the launch naming `command.user` and the
//!   user.
//!
//! Real bind mounts: run under `unshare -m --propagation private`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use csi_agent::client::{ClientOptions, CsiClient};
use csi_agent::mounts::require_private_mount_namespace;
use csi_agent_api::PluginInfo;
use serde_json::json;

use csi_agent_testkit::*;

const DAEMON_NODE_ID: &str = "agent-7f3e";
const OTHER: &str = "org.example.other";

/// `NAME=value` entries of a process's environment.
fn environ(pid: u32) -> Vec<String> {
    std::fs::read(format!("/proc/{pid}/environ"))
        .unwrap()
        .split(|b| *b == 0)
        .filter(|v| !v.is_empty())
        .map(|v| String::from_utf8_lossy(v).into_owned())
        .collect()
}

fn var(environ: &[String], name: &str) -> Option<String> {
    environ
        .iter()
        .find_map(|entry| entry.strip_prefix(&format!("{name}=")).map(str::to_owned))
}

async fn ready_plugin(daemon: &Daemon, plugin_type: &str) -> PluginInfo {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let info = daemon.api().plugin(plugin_type).await.unwrap();
        if info
            .components
            .first()
            .is_some_and(|c| c.ready && c.pid.is_some())
        {
            return info;
        }
        assert!(
            Instant::now() < deadline,
            "{plugin_type} never ready: {info:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn node_id_answered(info: &PluginInfo) -> String {
    let socket = PathBuf::from(info.components[0].endpoint.clone().unwrap());
    let client = CsiClient::connect(&socket, ClientOptions::default())
        .await
        .unwrap();
    client.node_get_info().await.unwrap().node_id
}

#[tokio::test]
async fn any_file_name_loads_and_the_plugin_gets_the_agents_variables() {
    require_private_mount_namespace();
    let dir = tempfile::tempdir().unwrap();
    let mut daemon = Daemon::new(dir.path(), &["--node-id", DAEMON_NODE_ID]);
    let plugin_dir = dir.path().join("plugin");
    let other_dir = dir.path().join("other");
    let testplugin = binary("csi-testplugin");

    // DC/OS's shape: a shell command taking the node id from $MESOS_AGENT_ID, in `nfs.conf`.
    // Its environment names both Mesos variables: MESOS_AGENT_ID is csi-agent's (it wins, as
    // the service manager's does in Mesos), MESOS_SANDBOX the config's (as in Mesos).
    daemon.add_config(
        "nfs.conf",
        &json!({
            "type": PLUGIN,
            "containers": [{
                "services": ["CONTROLLER_SERVICE", "NODE_SERVICE"],
                "command": {
                    "value": format!(
                        "exec '{}' --endpoint=$CSI_ENDPOINT --work-dir '{}' --volumes vol1:1M --node-id=$MESOS_AGENT_ID",
                        testplugin.display(), plugin_dir.display()
                    ),
                    "environment": {"variables": [
                        {"name": "MESOS_AGENT_ID", "value": "from-the-config"},
                        {"name": "MESOS_SANDBOX", "value": "/from/the/config"}
                    ]}
                }
            }],
            "startup_timeout_ms": 20000
        }),
    );
    // No extension at all, a non-shell command (csi-agent substitutes the reference), and the
    // plugin's own node id.
    daemon.add_config(
        "other",
        &json!({
            "type": OTHER,
            "node_id": "node-of-other",
            "containers": [{
                "services": ["CONTROLLER_SERVICE", "NODE_SERVICE"],
                "command": {
                    "shell": false,
                    "value": testplugin,
                    "arguments": ["csi-testplugin", "--endpoint", "$CSI_ENDPOINT",
                                  "--work-dir", other_dir, "--volumes", "o1:1M",
                                  "--node-id=${MESOS_AGENT_ID}"]
                }
            }],
            "startup_timeout_ms": 20000
        }),
    );
    // Not a config, yet in the dir; and a hidden file, skipped.
    std::fs::write(
        daemon.configs.join("README"),
        "plugin configs for this node\n",
    )
    .unwrap();
    std::fs::write(daemon.configs.join(".nfs.conf.swp"), "\0\0binary").unwrap();
    daemon.start();
    let api = daemon.api();

    let list = api.plugins().await.unwrap();
    let mut types: Vec<&str> = list
        .plugins
        .iter()
        .map(|p| p.plugin_type.as_str())
        .collect();
    types.sort_unstable();
    assert_eq!(types, vec![OTHER, PLUGIN]);
    assert_eq!(list.config_errors.len(), 1, "{:?}", list.config_errors);
    assert!(list.config_errors[0].file.ends_with("README"), "{list:?}");
    assert!(
        list.config_errors[0].message.contains("malformed JSON"),
        "{list:?}"
    );
    let csictl = daemon.csictl(&["plugins"]);
    let text = String::from_utf8_lossy(&csictl.stdout);
    assert!(text.contains("README"), "csictl plugins: {text}");
    assert!(!text.contains(".nfs.conf.swp"), "csictl plugins: {text}");

    // Both serve: a publish goes through ControllerPublish with the node id NodeGetInfo gave.
    let published = api.publish(&publish_request("vol1", "w1")).await.unwrap();
    assert!(Path::new(&published.target_path).is_dir());
    let mut other = publish_request("o1", "w1");
    other.plugin = OTHER.to_owned();
    api.publish(&other).await.unwrap();

    let info = ready_plugin(&daemon, PLUGIN).await;
    assert_eq!(node_id_answered(&info).await, DAEMON_NODE_ID);
    let pid = info.components[0].pid.unwrap();
    let env = environ(pid);
    assert_eq!(var(&env, "MESOS_AGENT_ID").as_deref(), Some(DAEMON_NODE_ID));
    assert_eq!(var(&env, "CSI_NODE_ID").as_deref(), Some(DAEMON_NODE_ID));
    assert_eq!(
        var(&env, "MESOS_SANDBOX").as_deref(),
        Some("/from/the/config")
    );

    let info = ready_plugin(&daemon, OTHER).await;
    assert_eq!(node_id_answered(&info).await, "node-of-other");
    let pid = info.components[0].pid.unwrap();
    let env = environ(pid);
    assert_eq!(
        var(&env, "MESOS_AGENT_ID").as_deref(),
        Some("node-of-other")
    );
    // Without the config's, MESOS_SANDBOX is the component's dir, its working directory.
    let cwd = std::fs::read_link(format!("/proc/{pid}/cwd")).unwrap();
    assert_eq!(
        var(&env, "MESOS_SANDBOX").map(PathBuf::from),
        Some(cwd.clone())
    );
    assert!(cwd.starts_with(&daemon.work), "{cwd:?}");

    api.unpublish(&unpublish_request("vol1", "w1"))
        .await
        .unwrap();
    let mut other = unpublish_request("o1", "w1");
    other.plugin = OTHER.to_owned();
    api.unpublish(&other).await.unwrap();
    assert_eq!(mounts_under(dir.path()), Vec::<PathBuf>::new());
}

/// Every regular file beneath `dir` whose name is `name`.
fn files_named(dir: &Path, name: &str) -> Vec<PathBuf> {
    let mut found = Vec::new();
    let Ok(entries) = std::fs::read_dir(dir) else {
        return found;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        let Ok(kind) = entry.file_type() else {
            continue;
        };
        if kind.is_dir() {
            found.extend(files_named(&path, name));
        } else if kind.is_file() && entry.file_name() == name {
            found.push(path);
        }
    }
    found
}

#[tokio::test]
async fn a_secret_variable_reaches_the_plugin_and_nothing_else() {
    require_private_mount_namespace();
    let dir = tempfile::tempdir().unwrap();
    let secret_dir = dir.path().join("secrets");
    let mut daemon = Daemon::new(
        dir.path(),
        &[
            "--node-id",
            DAEMON_NODE_ID,
            "--secret-dir",
            secret_dir.to_str().unwrap(),
        ],
    );
    // A value found nowhere else, and its base64 form (as the config gives it).
    let secret = "s3cr3t-9c41e07b-only-in-the-plugin";
    let encoded = base64_encode(secret);
    // A referenced one, in <secret-dir>/nfs/password.
    let referenced = "r3f-5ecret-2d81aa40-in-a-file";
    write_secret(&secret_dir.join("nfs/password"), referenced, 0o600);
    let mut config = managed_config(PLUGIN, &dir.path().join("plugin"), "vol1:1M");
    config["containers"][0]["command"]["environment"] = json!({"variables": [
        {"name": "PLAIN", "value": "visible"},
        {"name": "TOKEN", "type": "SECRET",
         "secret": {"type": "VALUE", "value": {"data": encoded}}},
        {"name": "REF_TOKEN", "type": "SECRET",
         "secret": {"type": "REFERENCE", "reference": {"name": "nfs", "key": "password"}}}
    ]});
    daemon.add_config("test.json", &config);
    // A reference out of the secret dir is refused, naming the field, in the same dir (the
    // other loads).
    let mut reference = managed_config(OTHER, &dir.path().join("other"), "o1:1M");
    reference["containers"][0]["command"]["environment"] = json!({"variables": [
        {"name": "TOKEN", "type": "SECRET",
         "secret": {"type": "REFERENCE", "reference": {"name": "..", "key": "password"}}}
    ]});
    daemon.add_config("reference.json", &reference);
    daemon.start();
    let api = daemon.api();
    api.publish(&publish_request("vol1", "w1")).await.unwrap();
    let info = ready_plugin(&daemon, PLUGIN).await;

    // The plugin has them.
    let pid = info.components[0].pid.unwrap();
    let env = environ(pid);
    assert_eq!(var(&env, "TOKEN").as_deref(), Some(secret));
    assert_eq!(var(&env, "REF_TOKEN").as_deref(), Some(referenced));
    assert_eq!(var(&env, "PLAIN").as_deref(), Some("visible"));

    // Nothing else does: the API's answers, the metrics, csictl, the daemon's log, and the
    // records csi-agent keeps of the component.
    let list = api.plugins().await.unwrap();
    assert_eq!(list.config_errors.len(), 1, "{list:?}");
    assert!(
        list.config_errors[0]
            .message
            .contains("secret.reference.name"),
        "{list:?}"
    );
    let mut shown = vec![
        serde_json::to_string(&list).unwrap(),
        serde_json::to_string(&api.plugin(PLUGIN).await.unwrap()).unwrap(),
        api.metrics().await.unwrap(),
        String::from_utf8_lossy(&daemon.csictl(&["plugins"]).stdout).into_owned(),
        String::from_utf8_lossy(&daemon.csictl(&["plugins", PLUGIN]).stdout).into_owned(),
    ];
    let records = files_named(&daemon.work, "component.json");
    assert_eq!(records.len(), 1, "{records:?}");
    let record = std::fs::read_to_string(&records[0]).unwrap();
    assert!(record.contains("<redacted>"), "{record}");
    assert!(
        record.contains("visible"),
        "the plain variable is recorded: {record}"
    );
    shown.push(record);
    let log = dir.path().join("daemon.log");
    shown.push(std::fs::read_to_string(&log).unwrap());
    for text in &shown {
        assert!(!text.is_empty());
        assert!(!text.contains(secret), "the secret leaked: {text}");
        assert!(
            !text.contains(&encoded),
            "the encoded secret leaked: {text}"
        );
        assert!(
            !text.contains(referenced),
            "the referenced secret leaked: {text}"
        );
    }

    // Rotated: the next launch reads the new content.
    let rotated = "r0tated-77b3c1e9";
    write_secret(&secret_dir.join("nfs/password"), rotated, 0o600);
    rustix::process::kill_process(
        rustix::process::Pid::from_raw(i32::try_from(pid).unwrap()).unwrap(),
        rustix::process::Signal::KILL,
    )
    .unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    let new_pid = loop {
        let info = daemon.api().plugin(PLUGIN).await.unwrap();
        if let Some(c) = info.components.first()
            && c.ready
            && c.pid.is_some_and(|p| p != pid)
        {
            break c.pid.unwrap();
        }
        assert!(Instant::now() < deadline, "never relaunched: {info:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(
        var(&environ(new_pid), "REF_TOKEN").as_deref(),
        Some(rotated)
    );

    api.unpublish(&unpublish_request("vol1", "w1"))
        .await
        .unwrap();
    assert_eq!(mounts_under(dir.path()), Vec::<PathBuf>::new());
}

/// Writes a secret file (root-owned: the tests run as root) with `mode`.
fn write_secret(path: &Path, content: &str, mode: u32) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    std::fs::write(path, content).unwrap();
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).unwrap();
}

/// The launch error of `plugin_type`'s component, once it has one.
async fn launch_error(daemon: &Daemon, plugin_type: &str) -> String {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let info = daemon.api().plugin(plugin_type).await.unwrap();
        if let Some(error) = info.components.first().and_then(|c| c.error.clone()) {
            assert!(!info.components[0].ready, "{info:?}");
            return error;
        }
        assert!(
            Instant::now() < deadline,
            "{plugin_type} never failed: {info:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn a_bad_secret_reference_fails_the_launch_naming_it_never_its_content() {
    require_private_mount_namespace();
    let dir = tempfile::tempdir().unwrap();
    let secret_dir = dir.path().join("secrets");
    let content = "n3ver-shown-5e1f0c2a";
    write_secret(&secret_dir.join("nfs/open"), content, 0o644);
    write_secret(&dir.path().join("outside"), content, 0o600);
    std::os::unix::fs::symlink(dir.path().join("outside"), secret_dir.join("nfs/link")).unwrap();
    let cases = [
        ("org.example.open", "open", "mode 0644"),
        ("org.example.link", "link", "symlink"),
        ("org.example.missing", "missing", "does not exist"),
    ];
    let config = |plugin_type: &str, key: &str| {
        let mut config = managed_config(plugin_type, &dir.path().join(plugin_type), "v:1M");
        config["containers"][0]["command"]["environment"] = json!({"variables": [
            {"name": "TOKEN", "type": "SECRET",
             "secret": {"type": "REFERENCE", "reference": {"name": "nfs", "key": key}}}
        ]});
        config
    };
    let mut daemon = Daemon::new(
        dir.path(),
        &[
            "--start-plugins",
            "--secret-dir",
            secret_dir.to_str().unwrap(),
        ],
    );
    for (plugin_type, key, _) in cases {
        daemon.add_config(&format!("{plugin_type}.json"), &config(plugin_type, key));
    }
    daemon.start();
    for (plugin_type, key, problem) in cases {
        let error = launch_error(&daemon, plugin_type).await;
        assert!(
            error.contains(&format!("nfs/{key}")) && error.contains(problem),
            "{plugin_type}: {error}"
        );
        assert!(!error.contains(content), "{error}");
    }
    let log = std::fs::read_to_string(dir.path().join("daemon.log")).unwrap();
    assert!(!log.contains(content), "{log}");
    drop(daemon);

    // Without --secret-dir, any reference fails, naming the flag.
    let dir = tempfile::tempdir().unwrap();
    let mut daemon = Daemon::new(dir.path(), &["--start-plugins"]);
    daemon.add_config("a.json", &config(PLUGIN, "open"));
    daemon.start();
    let error = launch_error(&daemon, PLUGIN).await;
    assert!(
        error.contains("--secret-dir") && error.contains("nfs/open") && error.contains("TOKEN"),
        "{error}"
    );
}

fn base64_encode(text: &str) -> String {
    let out = std::process::Command::new("base64")
        .arg("-w0")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .and_then(|mut child| {
            use std::io::Write;
            child.stdin.take().unwrap().write_all(text.as_bytes())?;
            child.wait_with_output()
        })
        .unwrap();
    String::from_utf8(out.stdout).unwrap()
}

#[tokio::test]
async fn a_plugin_runs_as_its_command_user() {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    require_private_mount_namespace();
    let dir = tempfile::tempdir().unwrap();
    // nobody must reach its own dirs beneath the test's dir (the work dir stays root's 0700).
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o711)).unwrap();
    let plugin_dir = dir.path().join("plugin");
    std::fs::create_dir(&plugin_dir).unwrap();
    std::os::unix::fs::chown(&plugin_dir, Some(65534), Some(65534)).unwrap();
    let mut daemon = Daemon::new(dir.path(), &["--start-plugins"]);
    // Bookkeeping only: nobody cannot mount.
    let mut config = managed_config(PLUGIN, &plugin_dir, "vol1:1M");
    config["containers"][0]["command"]["user"] = json!("nobody");
    // The work dir (root's, 0700) is out of nobody's reach: its staging and target paths
    // go beneath a root it can traverse, as docs/configuration.md says.
    config["target_path_root"] = json!(dir.path().join("mounts"));
    // And csi-agent makes the target path (nobody cannot create it in a dir of root's).
    config["target_path_exists"] = json!(true);
    config["containers"][0]["command"]["arguments"]
        .as_array_mut()
        .unwrap()
        .extend([json!("--mount-mode"), json!("none")]);
    daemon.add_config("test.json", &config);
    let mut unknown = managed_config(OTHER, &dir.path().join("other"), "o1:1M");
    unknown["containers"][0]["command"]["user"] = json!("no-such-user-29");
    daemon.add_config("unknown.json", &unknown);
    daemon.start();

    let info = ready_plugin(&daemon, PLUGIN).await;
    let pid = info.components[0].pid.unwrap();
    assert_eq!(
        proc_ids(pid),
        (
            "65534 65534 65534 65534".to_owned(),
            "65534 65534 65534 65534".to_owned(),
            String::new()
        )
    );
    let socket_dir = PathBuf::from(info.components[0].endpoint.clone().unwrap())
        .parent()
        .unwrap()
        .to_path_buf();
    let meta = std::fs::metadata(&socket_dir).unwrap();
    assert_eq!(
        (meta.uid(), meta.gid(), meta.mode() & 0o777),
        (65534, 65534, 0o700)
    );
    // The work dir is not given away.
    let work = std::fs::metadata(&daemon.work).unwrap();
    assert_eq!((work.uid(), work.mode() & 0o777), (0, 0o700));

    let api = daemon.api();
    // It serves a publish (staging and target made by csi-agent, checked by the plugin as
    // nobody). Its unpublish is not asked: this plugin removes the target itself, which
    // nobody cannot do in a dir of root's (docs/configuration.md, `user`).
    let published = api.publish(&publish_request("vol1", "w1")).await.unwrap();
    assert!(
        published
            .target_path
            .starts_with(dir.path().join("mounts").to_str().unwrap()),
        "{published:?}"
    );
    assert_eq!(
        ready_plugin(&daemon, PLUGIN).await.components[0].pid,
        Some(pid)
    );

    let error = launch_error(&daemon, OTHER).await;
    assert!(
        error.contains("command.user") && error.contains("\"no-such-user-29\""),
        "{error}"
    );
}
