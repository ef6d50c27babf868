//! The service manager with real processes: the test plugin (`csi-testplugin`, built by
//! `cargo build -p csi-testplugin` or named by `CSI_TESTPLUGIN`) and small shell scripts.
//!
//! Run with `--nocapture` to see the observed timings.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use csi_agent::client::CsiVersion;
use csi_agent::config::{
    CommandConfig, ComponentConfig, Deployment, EndpointConfig, EnvVar, PluginConfig,
    RestartBackoff, RuntimeConfig, Service,
};
use csi_agent::layout::Layout;
use csi_agent::metrics::Metrics;
use csi_agent::service_manager::{
    ComponentState, ManagerError, ManagerOptions, ReadyEndpoint, ServiceManager, container_id,
    plugins_with_components, remove_components,
};

fn testplugin() -> PathBuf {
    csi_agent::binaries::required("csi-testplugin", Some("CSI_TESTPLUGIN"))
}

struct Fixture {
    _tmp: tempfile::TempDir,
    root: PathBuf,
    metrics: Arc<Metrics>,
}

impl Fixture {
    fn new() -> anyhow::Result<Self> {
        let tmp = tempfile::tempdir()?;
        let root = tmp.path().to_path_buf();
        Ok(Self {
            _tmp: tmp,
            root,
            metrics: Arc::new(Metrics::new()),
        })
    }

    fn layout(&self) -> Layout {
        Layout::new(self.root.join("work"))
    }

    fn options(&self) -> ManagerOptions {
        ManagerOptions {
            layout: self.layout(),
            node_id: "node-1".into(),
            socket_root: self.root.join("s"),
            metrics: Arc::clone(&self.metrics),
            oci_runtime: "runc".into(),
            images: None,
            fetch: csi_agent::fetch::FetchOptions::new(&self.root.join("work")),
            secret_dir: None,
        }
    }

    fn plugin_work_dir(&self, name: &str) -> PathBuf {
        self.root.join(format!("plugin-{name}"))
    }

    /// A managed test plugin serving both services; `extra` are extra flags.
    fn testplugin_config(&self, plugin_type: &str, extra: &[&str]) -> PluginConfig {
        let mut arguments = vec![
            "csi-testplugin".to_owned(),
            "--work-dir".to_owned(),
            self.plugin_work_dir(plugin_type).display().to_string(),
            "--mount-mode".to_owned(),
            "none".to_owned(),
        ];
        arguments.extend(extra.iter().map(|s| (*s).to_owned()));
        managed(
            plugin_type,
            CommandConfig {
                value: testplugin().display().to_string(),
                arguments,
                shell: false,
                environment: vec![],
                uris: vec![],
                user: None,
            },
        )
    }

    fn component_counter(&self, family: &str, plugin: &str) -> u64 {
        let text = self.metrics.encode();
        let prefix = format!("csi_agent_{family}_total{{plugin=\"{plugin}\"");
        text.lines()
            .filter(|line| line.starts_with(&prefix))
            .filter_map(|line| line.rsplit(' ').next()?.parse::<u64>().ok())
            .sum()
    }
}

fn managed(plugin_type: &str, command: CommandConfig) -> PluginConfig {
    PluginConfig {
        plugin_type: plugin_type.into(),
        name: "default".into(),
        deployment: Deployment::Managed(vec![ComponentConfig {
            services: vec![Service::Controller, Service::Node],
            serves: vec![Service::Controller, Service::Node],
            command,
            resources: vec![],
            container: None,
        }]),
        target_path_root: None,
        target_path_exists: false,
        runtime: RuntimeConfig::Process,
        startup_timeout: Duration::from_secs(20),
        rpc_deadline: Duration::from_secs(5),
        stop_grace: Duration::from_secs(5),
        restart_backoff: RestartBackoff {
            initial: Duration::from_millis(100),
            max: Duration::from_millis(400),
            reset_after: Duration::from_secs(10),
        },
        node_id: None,
        cluster: false,
    }
}

fn pid(endpoint: &ReadyEndpoint) -> anyhow::Result<i32> {
    match &endpoint.handle {
        Some(handle) => Ok(handle.pid()),
        None => anyhow::bail!("no runtime handle"),
    }
}

fn alive(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| !stat.contains(") Z "))
}

fn kill9(pid: i32) -> anyhow::Result<()> {
    let pid = rustix::process::Pid::from_raw(pid).ok_or_else(|| anyhow::anyhow!("bad pid"))?;
    rustix::process::kill_process(pid, rustix::process::Signal::KILL)?;
    Ok(())
}

/// Waits until the endpoint of `service` is a different generation than `old`.
async fn next_endpoint(
    manager: &ServiceManager,
    service: Service,
    old: &ReadyEndpoint,
) -> anyhow::Result<ReadyEndpoint> {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let endpoint = manager.endpoint(service).await?;
        if endpoint.generation != old.generation {
            return Ok(endpoint);
        }
        anyhow::ensure!(Instant::now() < deadline, "never restarted");
        tokio::task::yield_now().await;
    }
}

#[tokio::test]
async fn supervision_launch_ready_then_kill9_restarts_and_waiters_get_the_new_endpoint()
-> anyhow::Result<()> {
    let fx = Fixture::new()?;
    let config = fx.testplugin_config("org.example.test", &["--api-versions", "v1"]);
    let id = container_id(
        "org.example.test",
        "default",
        &[Service::Controller, Service::Node],
    );
    assert_eq!(
        id,
        "csi-agent-org-example-test-default--CONTROLLER_SERVICE-NODE_SERVICE"
    );
    let manager = ServiceManager::new(config, fx.options()).await?;
    // Lazy: nothing runs before a service is needed.
    assert!(matches!(manager.status()[0].state, ComponentState::Idle));

    let launched = Instant::now();
    let first = manager.endpoint(Service::Node).await?;
    let launch_to_ready = launched.elapsed();
    assert_eq!(first.version, CsiVersion::V1);
    assert_eq!(first.component, id);
    let first_pid = pid(&first)?;
    assert!(alive(first_pid));
    // Both services come from the one component.
    assert_eq!(
        manager.endpoint(Service::Controller).await?.generation,
        first.generation
    );

    // On disk: record, endpoint symlink to a short socket dir, logs.
    let container_dir = fx
        .layout()
        .container_dir("org.example.test", "default", &id);
    let record: serde_json::Value =
        serde_json::from_slice(&std::fs::read(container_dir.join("component.json"))?)?;
    assert_eq!(record["runtime"]["kind"], "process");
    assert_eq!(record["runtime"]["pid"], first_pid);
    assert!(
        record["runtime"]["start_time"]
            .as_u64()
            .is_some_and(|t| t > 0)
    );
    let socket_dir = std::fs::read_link(container_dir.join("endpoint"))?;
    assert_eq!(socket_dir.join("endpoint.sock"), first.socket);
    assert!(first.socket.as_os_str().len() < 108);
    assert!(container_dir.join("stderr").exists());
    assert!(
        fx.metrics
            .encode()
            .contains("csi_agent_plugin_ready{plugin=\"org.example.test\"} 1")
    );

    // kill -9: a caller waiting for the endpoint gets the restarted one.
    let killed = Instant::now();
    kill9(first_pid)?;
    let second = next_endpoint(&manager, Service::Node, &first).await?;
    let kill_to_ready = killed.elapsed();
    let second_pid = pid(&second)?;
    assert_ne!(second_pid, first_pid);
    assert!(alive(second_pid));
    assert_eq!(
        second.socket, first.socket,
        "same short socket dir across restarts"
    );
    // The new client works.
    assert!(second.client.probe().await?);
    assert_eq!(
        fx.component_counter("component_terminations", "org.example.test"),
        1
    );
    assert_eq!(
        fx.component_counter("component_restarts", "org.example.test"),
        1
    );

    eprintln!(
        "timings: launch->ready {launch_to_ready:?} (socket->ready {:?}); kill -9 -> ready again {kill_to_ready:?} (socket->ready {:?})",
        first.socket_to_ready, second.socket_to_ready
    );

    manager.stop().await?;
    assert!(!alive(second_pid));
    assert!(!container_dir.exists(), "stop cleans the container dir");
    assert!(!socket_dir.exists(), "stop removes the socket dir");
    assert!(matches!(
        manager.endpoint(Service::Node).await,
        Err(ManagerError::Stopped { .. })
    ));
    Ok(())
}

#[tokio::test]
async fn supervision_crash_loop_backs_off_and_never_gives_up() -> anyhow::Result<()> {
    let fx = Fixture::new()?;
    let starts = fx.root.join("starts");
    let config = managed(
        "org.example.crashy",
        CommandConfig {
            value: format!("date +%s%N >> {}; exit 1", starts.display()),
            arguments: vec![],
            shell: true,
            environment: vec![],
            uris: vec![],
            user: None,
        },
    );
    let mut config = config;
    config.restart_backoff = RestartBackoff {
        initial: Duration::from_millis(200),
        max: Duration::from_millis(600),
        reset_after: Duration::from_secs(10),
    };
    let manager = ServiceManager::new(config, fx.options()).await?;
    manager.start();
    tokio::time::sleep(Duration::from_millis(2500)).await;

    let launches: Vec<u128> = std::fs::read_to_string(&starts)?
        .lines()
        .map(str::parse)
        .collect::<Result<_, _>>()?;
    let gaps_ms: Vec<u128> = launches
        .windows(2)
        .map(|w| (w[1] - w[0]) / 1_000_000)
        .collect();
    eprintln!(
        "crash loop: {} launches, gaps (ms): {gaps_ms:?}",
        launches.len()
    );
    // Immediately the first time, then 200, 400, 600 (cap), 600, ...
    assert!(gaps_ms.len() >= 4, "{gaps_ms:?}");
    assert!(gaps_ms[0] < 150, "first restart is immediate: {gaps_ms:?}");
    assert!((195..390).contains(&gaps_ms[1]), "{gaps_ms:?}");
    assert!((395..590).contains(&gaps_ms[2]), "{gaps_ms:?}");
    for gap in &gaps_ms[3..] {
        assert!((595..900).contains(gap), "capped at 600 ms: {gaps_ms:?}");
    }
    assert!(launches.len() <= 8, "no tight loop: {gaps_ms:?}");

    // A caller gets a transient "not ready" that says why.
    let err = manager
        .endpoint_within(Service::Node, Duration::from_millis(50))
        .await
        .err()
        .ok_or_else(|| anyhow::anyhow!("a crashing plugin cannot be ready"))?;
    assert!(err.is_transient());
    assert!(err.to_string().contains("exited with code 1"), "{err}");

    // Never given up: it still relaunches.
    let before = launches.len();
    tokio::time::sleep(Duration::from_millis(1300)).await;
    let after = std::fs::read_to_string(&starts)?.lines().count();
    assert!(after > before, "still restarting ({before} -> {after})");
    Ok(())
}

#[tokio::test]
async fn supervision_recreated_manager_adopts_then_replaces_outdated_then_removes()
-> anyhow::Result<()> {
    let fx = Fixture::new()?;
    let plugin_type = "org.example.adopt";
    let config = fx.testplugin_config(plugin_type, &[]);

    let first = ServiceManager::new(config.clone(), fx.options()).await?;
    let endpoint = first.endpoint(Service::Node).await?;
    let original_pid = pid(&endpoint)?;
    drop(first); // as if csi-agent stopped: the component keeps running
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(alive(original_pid));

    // Same config: adopted, not relaunched.
    let second = ServiceManager::new(config.clone(), fx.options()).await?;
    let adopted = second.endpoint(Service::Node).await?;
    assert_eq!(pid(&adopted)?, original_pid, "adopted, same pid");
    assert_eq!(fx.component_counter("component_restarts", plugin_type), 0);

    // Changed config (an extra environment variable), as a reload does it while the old
    // manager is still referenced: the old component is killed at recovery and a new one
    // launched; the old manager no longer supervises anything.
    let mut changed = config.clone();
    if let Deployment::Managed(components) = &mut changed.deployment {
        components[0]
            .command
            .environment
            .push(EnvVar::plain("CHANGED", "1"));
    }
    let third = second.replace_with(changed.clone()).await?;
    assert!(
        !alive(original_pid),
        "outdated component killed during recovery"
    );
    let replaced = second.endpoint(Service::Node).await;
    assert!(
        matches!(replaced, Err(ManagerError::Replaced { .. })),
        "{replaced:?}"
    );
    drop(second);
    let relaunched = third.endpoint(Service::Node).await?;
    let new_pid = pid(&relaunched)?;
    assert_ne!(new_pid, original_pid);
    drop(third);

    // Its services change (so does its id): the old component is no longer configured,
    // so it is killed and its dir removed.
    let mut node_only = changed.clone();
    if let Deployment::Managed(components) = &mut node_only.deployment {
        components[0].services = vec![Service::Node];
        components[0].serves = vec![Service::Node];
    }
    let old_dir = fx.layout().container_dir(
        plugin_type,
        "default",
        &container_id(
            plugin_type,
            "default",
            &[Service::Controller, Service::Node],
        ),
    );
    assert!(old_dir.exists());
    let fourth = ServiceManager::new(node_only, fx.options()).await?;
    assert!(!alive(new_pid));
    assert!(!old_dir.exists());
    let node = fourth.endpoint(Service::Node).await?;
    let node_pid = pid(&node)?;
    assert!(matches!(
        fourth.endpoint(Service::Controller).await,
        Err(ManagerError::NotServed { .. })
    ));
    drop(fourth);

    // The plugin's config is removed altogether: the engine finds it on disk and removes
    // its components.
    assert!(
        plugins_with_components(&fx.layout())?
            .contains(&(plugin_type.to_owned(), "default".to_owned()))
    );
    let socket_dir = node
        .socket
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_default();
    let stopped = remove_components(
        &fx.layout(),
        plugin_type,
        "default",
        Duration::from_secs(5),
        &fx.options().runtime_options(),
    )
    .await?;
    assert_eq!(stopped, 1);
    assert!(!alive(node_pid));
    assert!(!fx.layout().containers_dir(plugin_type, "default").exists());
    assert!(!socket_dir.exists());
    Ok(())
}

#[tokio::test]
async fn supervision_unmanaged_plugin_started_elsewhere_is_awaited_probed_and_reprobed()
-> anyhow::Result<()> {
    let fx = Fixture::new()?;
    let socket = fx.root.join("elsewhere/csi.sock");
    let config = PluginConfig {
        deployment: Deployment::Unmanaged(vec![
            EndpointConfig {
                service: Service::Node,
                socket: socket.clone(),
            },
            EndpointConfig {
                service: Service::Controller,
                socket: socket.clone(),
            },
        ]),
        ..managed(
            "org.example.unmanaged",
            CommandConfig {
                value: "unused".into(),
                arguments: vec![],
                shell: false,
                environment: vec![],
                uris: vec![],
                user: None,
            },
        )
    };
    let manager = Arc::new(ServiceManager::new(config, fx.options()).await?);
    manager.start();
    // The caller waits before the plugin (or even its directory) exists.
    let waiter = tokio::spawn({
        let manager = Arc::clone(&manager);
        async move { manager.endpoint(Service::Node).await }
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    std::fs::create_dir_all(fx.root.join("elsewhere"))?;
    let spawn = |probe_not_ready: &str| {
        std::process::Command::new(testplugin())
            .args(["--endpoint", &format!("unix://{}", socket.display())])
            .args([
                "--work-dir",
                &fx.plugin_work_dir("unmanaged").display().to_string(),
            ])
            .args(["--mount-mode", "none", "--probe-not-ready", probe_not_ready])
            .stdout(std::process::Stdio::null())
            .spawn()
    };
    let mut plugin = spawn("3")?;
    let first = tokio::time::timeout(Duration::from_secs(20), waiter).await???;
    assert_eq!(first.version, CsiVersion::V1);
    assert!(first.handle.is_none());
    assert_eq!(
        manager.endpoint(Service::Controller).await?.generation,
        first.generation
    );
    assert!(
        fx.metrics
            .encode()
            .contains("csi_agent_probes_total{plugin=\"org.example.unmanaged\",method=\"Probe\",code=\"NOT_READY\"}"),
        "ready=false answers were retried"
    );

    // The plugin restarts (its new instance replaces the socket): probed again.
    plugin.kill()?;
    plugin.wait()?;
    let mut plugin = spawn("0")?;
    let second = next_endpoint(&manager, Service::Node, &first).await?;
    assert!(second.client.probe().await?);
    plugin.kill()?;
    plugin.wait()?;
    Ok(())
}

#[tokio::test]
async fn supervision_detects_csi_0_2_and_0_3_plugins() -> anyhow::Result<()> {
    let fx = Fixture::new()?;
    for (flag, expected) in [("v0.2", CsiVersion::V0_2), ("v0.3", CsiVersion::V0_3)] {
        let plugin_type = format!("org.example.{}", flag.replace('.', "-"));
        let config = fx.testplugin_config(&plugin_type, &["--api-versions", flag]);
        let manager = ServiceManager::new(config, fx.options()).await?;
        let endpoint = manager.endpoint(Service::Node).await?;
        assert_eq!(endpoint.version, expected, "{flag}");
        assert_eq!(manager.version(), Some(expected));
        assert!(endpoint.client.probe().await?);
        manager.stop().await?;
    }
    Ok(())
}

#[tokio::test]
async fn supervision_plugin_that_changes_version_is_an_error() -> anyhow::Result<()> {
    let fx = Fixture::new()?;
    let flag = fx.root.join("serve-v0");
    let script = format!(
        "if [ -e {flag} ]; then v=v0.3; else v=v1; fi; exec {bin} --work-dir {work} --mount-mode none --api-versions $v",
        flag = flag.display(),
        bin = testplugin().display(),
        work = fx.plugin_work_dir("flip").display(),
    );
    let config = managed(
        "org.example.flip",
        CommandConfig {
            value: script,
            arguments: vec![],
            shell: true,
            environment: vec![],
            uris: vec![],
            user: None,
        },
    );
    let manager = ServiceManager::new(config, fx.options()).await?;
    let first = manager.endpoint(Service::Node).await?;
    assert_eq!(first.version, CsiVersion::V1);
    std::fs::write(&flag, b"")?;
    kill9(pid(&first)?)?;
    // Until the exit is noticed the old endpoint may still be handed out; after that, the
    // relaunched plugin (now v0.3) must never be.
    let deadline = Instant::now() + Duration::from_secs(5);
    let err = loop {
        match manager
            .endpoint_within(Service::Node, Duration::from_millis(1500))
            .await
        {
            Ok(endpoint) if endpoint.generation == first.generation => {
                anyhow::ensure!(Instant::now() < deadline, "exit never noticed");
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            Ok(endpoint) => anyhow::bail!("ready again as {}", endpoint.version),
            Err(err) => break err,
        }
    };
    assert!(
        err.to_string()
            .contains("changed its CSI version from v1 to v0.3"),
        "{err}"
    );
    manager.stop().await?;
    Ok(())
}

#[tokio::test]
async fn supervision_slow_start_past_the_startup_timeout_is_restarted() -> anyhow::Result<()> {
    let fx = Fixture::new()?;
    let mut config = fx.testplugin_config("org.example.slow", &["--startup-delay-ms", "5000"]);
    config.startup_timeout = Duration::from_millis(300);
    // It also ignores SIGTERM while it starts: the grace period bounds that.
    config.stop_grace = Duration::from_millis(200);
    let manager = ServiceManager::new(config, fx.options()).await?;
    let err = manager
        .endpoint_within(Service::Node, Duration::from_millis(1500))
        .await
        .err()
        .ok_or_else(|| anyhow::anyhow!("cannot be ready before its socket exists"))?;
    assert!(err.is_transient());
    assert!(
        err.to_string().contains("startup timeout (300 ms)"),
        "{err}"
    );
    assert!(fx.component_counter("component_terminations", "org.example.slow") >= 2);
    manager.stop().await?;
    Ok(())
}

#[tokio::test]
async fn supervision_stale_socket_is_removed_before_each_relaunch_and_after_stop()
-> anyhow::Result<()> {
    let fx = Fixture::new()?;
    let seen = fx.root.join("seen");
    // Each launch reports whether a socket file is already there, then leaves one behind
    // (as a crashing plugin does) and exits.
    let script = format!(
        "s=\"${{CSI_ENDPOINT#unix://}}\"; if [ -e \"$s\" ]; then echo stale; else echo clean; fi >> {seen}; touch \"$s\"; exit 1",
        seen = seen.display()
    );
    let config = managed(
        "org.example.stale",
        CommandConfig {
            value: script,
            arguments: vec![],
            shell: true,
            environment: vec![],
            uris: vec![],
            user: None,
        },
    );
    let manager = ServiceManager::new(config, fx.options()).await?;
    manager.start();
    let deadline = Instant::now() + Duration::from_secs(10);
    while std::fs::read_to_string(&seen)
        .unwrap_or_default()
        .lines()
        .count()
        < 3
    {
        anyhow::ensure!(Instant::now() < deadline, "not relaunched");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let lines = std::fs::read_to_string(&seen)?;
    assert!(lines.lines().all(|l| l == "clean"), "MESOS-8429: {lines}");
    let id = container_id(
        "org.example.stale",
        "default",
        &[Service::Controller, Service::Node],
    );
    let link = fx
        .layout()
        .container_dir("org.example.stale", "default", &id)
        .join("endpoint");
    let socket_dir = std::fs::read_link(&link)?;
    manager.stop().await?;
    assert!(!socket_dir.join("endpoint.sock").exists());
    assert!(!socket_dir.exists());
    Ok(())
}

#[tokio::test]
async fn supervision_recovery_cleans_a_component_that_died_while_csi_agent_was_down()
-> anyhow::Result<()> {
    let fx = Fixture::new()?;
    let config = fx.testplugin_config("org.example.dead", &[]);
    let first = ServiceManager::new(config.clone(), fx.options()).await?;
    let endpoint = first.endpoint(Service::Node).await?;
    let dead_pid = pid(&endpoint)?;
    drop(first);
    kill9(dead_pid)?;
    let deadline = Instant::now() + Duration::from_secs(5);
    // Nobody reaps it while no manager runs; a zombie is dead enough.
    while alive(dead_pid) {
        anyhow::ensure!(Instant::now() < deadline, "kill -9 did not kill");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(endpoint.socket.exists(), "SIGKILL leaves the socket behind");
    let container_dir = fx.layout().container_dir(
        "org.example.dead",
        "default",
        &container_id(
            "org.example.dead",
            "default",
            &[Service::Controller, Service::Node],
        ),
    );

    let second = ServiceManager::new(config, fx.options()).await?;
    // Recovery removed the record, the stale socket and its dir (the logs stay).
    assert!(!container_dir.join("component.json").exists());
    assert!(!endpoint.socket.exists());
    assert!(container_dir.join("stderr").exists());
    let relaunched = second.endpoint(Service::Node).await?;
    assert_ne!(pid(&relaunched)?, dead_pid);
    second.stop().await?;
    Ok(())
}
