//! The bad-config corpus: every bad file in `tests/fixtures/configs/` yields exactly one clear
//! error (file, field, what to fix), while the good files of the same directory load. Every
//! non-hidden file is a config whatever its name (as Mesos): `nfs.conf` loads, `README` is an
//! error, the hidden `.#lvm.json` (not JSON) and `.hidden-editor-backup.json` are skipped.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use csi_agent::config::{
    ConfigDiff, ConfigError, Deployment, RuntimeConfig, Service, load_dir, parse_config,
};
use csi_agent::metrics::Metrics;

fn corpus() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/configs")
}

fn file_name(err: &ConfigError) -> String {
    err.file()
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default()
}

#[test]
fn config_corpus_reports_each_bad_file_once_and_loads_the_good_ones() -> anyhow::Result<()> {
    let metrics = Metrics::new();
    let report = load_dir(&corpus(), Some(&metrics));

    let loaded: Vec<&str> = report.set.plugins.keys().map(String::as_str).collect();
    assert_eq!(
        loaded,
        vec![
            // DC/OS's name: a config is a config whatever its file is called.
            "nfs.csi.k8s.io",
            "org.apache.mesos.csi.managed-plugin",
            "org.example.managed",
            "org.example.tuned",
            "org.example.unmanaged",
        ]
    );
    assert_eq!(
        report.set.plugins["nfs.csi.k8s.io"]
            .file
            .file_name()
            .and_then(|n| n.to_str()),
        Some("nfs.conf")
    );

    // file -> substrings its one error message must contain.
    let expected: BTreeMap<&str, &[&str]> = BTreeMap::from([
        // Not a config, yet in the dir: an error on that file, not silence.
        (
            "README",
            &[
                "malformed JSON at line 1, column 1",
                "every non-hidden file of the config dir is read as a plugin config",
                "move other files out",
            ][..],
        ),
        (
            "bad-backoff.json",
            &["restart_backoff.max_ms", "at least initial_ms"][..],
        ),
        ("bad-both.json", &["both are given", "not both"][..]),
        (
            "bad-empty-command.json",
            &["containers[0].command.value", "is empty"][..],
        ),
        (
            "bad-empty-file.json",
            &["malformed JSON", "the file is empty"][..],
        ),
        (
            "bad-malformed.json",
            &[
                "malformed JSON at line 3, column 50",
                "expected `,` or `}`",
                "fix the syntax",
            ][..],
        ),
        (
            "bad-name-leading-dot.json",
            &["field `name`", "must not start with a dot"][..],
        ),
        (
            "bad-neither.json",
            &["neither is given", "add `containers`", "`endpoints`"][..],
        ),
        (
            "bad-not-an-object.json",
            &["(top level)", "must be an object, not a list"][..],
        ),
        (
            "bad-relative-endpoint.json",
            &["endpoints[0].endpoint", "unix:///absolute/path"][..],
        ),
        (
            "bad-runtime-kind.json",
            &["runtime.kind", "\"docker\"", "use \"process\""][..],
        ),
        (
            "bad-tcp-endpoint.json",
            &["endpoints[0].endpoint", "not a unix socket"][..],
        ),
        (
            "bad-type-chars.json",
            &["field `type`", "'/'", "only letters, digits"][..],
        ),
        (
            "bad-unknown-field.json",
            &[
                "field `startup_timeout`",
                "unknown field",
                "startup_timeout_ms",
            ][..],
        ),
        (
            "bad-unknown-service.json",
            &[
                "containers[0].services[1]",
                "STORAGE_SERVICE",
                "use \"CONTROLLER_SERVICE\" or \"NODE_SERVICE\"",
            ][..],
        ),
        (
            "zz-duplicate-type.json",
            &[
                "org.example.managed",
                "already configured by",
                "good-managed.json",
                "remove or rename",
            ][..],
        ),
    ]);

    let mut by_file: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for err in &report.errors {
        by_file
            .entry(file_name(err))
            .or_default()
            .push(err.to_string());
    }
    assert_eq!(
        by_file.keys().map(String::as_str).collect::<Vec<_>>(),
        expected.keys().copied().collect::<Vec<_>>(),
        "errors: {by_file:#?}"
    );
    for (file, needles) in &expected {
        let messages = &by_file[*file];
        assert_eq!(
            messages.len(),
            1,
            "{file}: one error per file: {messages:?}"
        );
        let message = &messages[0];
        assert!(
            message.contains(file),
            "{file}: message names the file: {message}"
        );
        for needle in *needles {
            assert!(
                message.contains(needle),
                "{file}: {message:?} lacks {needle:?}"
            );
        }
    }

    // Each bad file is counted in the metrics, by file name.
    let text = metrics.encode();
    for file in expected.keys() {
        assert!(
            text.contains(&format!("csi_agent_config_errors{{file=\"{file}\"}} 1")),
            "{file} not in metrics:\n{text}"
        );
    }
    // A reload without the errors resets the gauge.
    let clean = tempfile::tempdir()?;
    let _ = load_dir(clean.path(), Some(&metrics));
    assert!(!metrics.encode().contains("config_errors{file="));
    Ok(())
}

#[test]
fn config_good_files_carry_every_field() -> anyhow::Result<()> {
    let report = load_dir(&corpus(), None);
    let tuned = report
        .set
        .get("org.example.tuned")
        .ok_or_else(|| anyhow::anyhow!("tuned not loaded"))?;
    assert_eq!(tuned.name, "fast_1");
    assert_eq!(tuned.runtime, RuntimeConfig::Process);
    assert_eq!(tuned.startup_timeout, Duration::from_millis(5000));
    assert_eq!(tuned.rpc_deadline, Duration::from_millis(2500));
    assert_eq!(tuned.stop_grace, Duration::from_millis(3000));
    assert_eq!(tuned.restart_backoff.initial, Duration::from_millis(200));
    assert_eq!(tuned.restart_backoff.max, Duration::from_millis(10_000));
    assert_eq!(
        tuned.restart_backoff.reset_after,
        Duration::from_millis(30_000)
    );
    assert_eq!(tuned.node_id.as_deref(), Some("node-17"));

    let mesos = report
        .set
        .get("org.apache.mesos.csi.managed-plugin")
        .ok_or_else(|| anyhow::anyhow!("mesos example not loaded"))?;
    assert_eq!(mesos.name, "default");
    let Deployment::Managed(components) = &mesos.deployment else {
        anyhow::bail!("mesos example should be managed");
    };
    // Mesos's CommandInfo.shell defaults to true: the value runs through /bin/sh -c.
    let (program, argv) = components[0].command.argv(&[]);
    assert_eq!(program, "/bin/sh");
    assert_eq!(
        argv,
        vec!["sh", "-c", "/opt/plugin --endpoint=$CSI_ENDPOINT"]
    );
    assert_eq!(components[0].resources.len(), 2);

    let managed = report
        .set
        .get("org.example.managed")
        .ok_or_else(|| anyhow::anyhow!("managed not loaded"))?;
    let Deployment::Managed(components) = &managed.deployment else {
        anyhow::bail!("should be managed");
    };
    assert_eq!(
        components[0].serves,
        vec![Service::Controller, Service::Node]
    );
    assert_eq!(components[0].command.environment[0].name, "LOG");
    assert_eq!(
        managed.target_path_root.as_deref(),
        Some(Path::new("/var/lib/example-mounts"))
    );

    let unmanaged = report
        .set
        .get("org.example.unmanaged")
        .ok_or_else(|| anyhow::anyhow!("unmanaged not loaded"))?;
    let Deployment::Unmanaged(endpoints) = &unmanaged.deployment else {
        anyhow::bail!("should be unmanaged");
    };
    assert_eq!(endpoints[0].socket, Path::new("/run/example/node.sock"));
    assert_eq!(
        endpoints[1].socket,
        Path::new("/run/example/controller.sock")
    );
    Ok(())
}

#[test]
fn config_reload_diff_reports_added_changed_removed() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let write = |file: &str, text: &str| std::fs::write(dir.path().join(file), text);
    let plugin = |plugin_type: &str, socket: &str| {
        format!(
            r#"{{"type": "{plugin_type}", "endpoints": [{{"csi_service": "NODE_SERVICE", "endpoint": "{socket}"}}]}}"#
        )
    };
    write("a.json", &plugin("a", "/a.sock"))?;
    write("b.json", &plugin("b", "/b.sock"))?;
    write("c.json", &plugin("c", "/c.sock"))?;
    write("d.json", &plugin("d", "/d.sock"))?;
    let old = load_dir(dir.path(), None);
    assert!(old.errors.is_empty(), "{:?}", old.errors);

    // a unchanged (whitespace only), b changed, c broken, d removed, e added.
    write("a.json", &format!("\n{}\n", plugin("a", "/a.sock")))?;
    write("b.json", &plugin("b", "/b2.sock"))?;
    write("c.json", "{ broken")?;
    std::fs::remove_file(dir.path().join("d.json"))?;
    write("e.json", &plugin("e", "/e.sock"))?;
    let new = load_dir(dir.path(), None);
    let diff = ConfigDiff::between(&old.set, &new);
    assert_eq!(diff.added, vec!["e"]);
    assert_eq!(diff.changed, vec!["b"]);
    assert_eq!(diff.removed, vec!["d"]);
    // A file that broke keeps its plugin running on the old config instead of stopping it.
    assert_eq!(diff.kept_on_error, vec!["c"]);
    assert!(!diff.is_empty());
    Ok(())
}

#[test]
fn config_missing_dir_is_one_error_not_a_crash() {
    let report = load_dir(Path::new("/nonexistent/csi-agent/configs"), None);
    assert!(report.set.plugins.is_empty());
    assert_eq!(report.errors.len(), 1);
    assert!(
        report.errors[0]
            .to_string()
            .contains("cannot list the plugin config dir")
    );
}

#[test]
fn config_service_listed_twice_is_served_by_the_first_component() -> anyhow::Result<()> {
    let config = parse_config(
        Path::new("x.json"),
        r#"{"type": "t", "containers": [
            {"services": ["NODE_SERVICE"], "command": {"value": "/first"}},
            {"services": ["NODE_SERVICE"], "command": {"value": "/second"}}]}"#,
    )?;
    let Deployment::Managed(components) = &config.deployment else {
        anyhow::bail!("should be managed");
    };
    assert_eq!(components.len(), 1);
    assert_eq!(components[0].command.value, "/first");
    Ok(())
}

#[test]
fn config_dir_entries_links_dirs_fifos_and_dotfiles() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let outside = tempfile::tempdir()?;
    let plugin = |plugin_type: &str| {
        format!(
            r#"{{"type": "{plugin_type}", "endpoints": [{{"csi_service": "NODE_SERVICE", "endpoint": "/{plugin_type}.sock"}}]}}"#
        )
    };
    // Any name loads, extension or not.
    std::fs::write(dir.path().join("plain"), plugin("plain"))?;
    std::fs::write(dir.path().join("nfs.conf"), plugin("nfs"))?;
    // A symlink to a file elsewhere is followed (config management links files in).
    std::fs::write(outside.path().join("linked.json"), plugin("linked"))?;
    std::os::unix::fs::symlink(
        outside.path().join("linked.json"),
        dir.path().join("linked"),
    )?;
    // Directories are skipped, even one named like a config, as Mesos does.
    std::fs::create_dir(dir.path().join("subdir.json"))?;
    std::fs::write(dir.path().join("subdir.json/inner.json"), "{ broken")?;
    // Hidden entries are skipped: a broken swap file and a valid-looking hidden config alike.
    std::fs::write(dir.path().join(".plain.swp"), "\0\0 not json")?;
    std::fs::write(dir.path().join(".hidden.json"), plugin("hidden"))?;
    // A dangling symlink and a FIFO are errors on those entries; the FIFO is not opened (a
    // read would block the load forever: this test would hang).
    std::os::unix::fs::symlink("/nonexistent/csi-agent/x.json", dir.path().join("dangling"))?;
    let fifo = dir.path().join("fifo.json");
    let status = std::process::Command::new("mkfifo").arg(&fifo).status()?;
    assert!(status.success(), "mkfifo");

    let report = load_dir(dir.path(), None);
    let loaded: Vec<&str> = report.set.plugins.keys().map(String::as_str).collect();
    assert_eq!(loaded, vec!["linked", "nfs", "plain"]);
    let errors: BTreeMap<String, String> = report
        .errors
        .iter()
        .map(|err| (file_name(err), err.to_string()))
        .collect();
    assert_eq!(
        errors.keys().map(String::as_str).collect::<Vec<_>>(),
        vec!["dangling", "fifo.json"],
        "{errors:#?}"
    );
    assert!(
        errors["fifo.json"].contains("not a regular file"),
        "{errors:?}"
    );
    assert!(
        errors["dangling"].contains("cannot read the file"),
        "{errors:?}"
    );
    Ok(())
}
