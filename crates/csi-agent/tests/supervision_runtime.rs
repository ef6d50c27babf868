//! The process runtime with real processes (small shell scripts): launch, environment, logs,
//! own process group, adoption with pid-reuse protection, exit watching, reaping, stop.

use std::path::Path;
use std::time::{Duration, Instant};

use csi_agent::config::{CommandConfig, EnvVar, RuntimeConfig};
use csi_agent::runtime::{
    Component, ExitInfo, LaunchContext, LaunchSpec, ProcessRuntime, Runtime, RuntimeHandle,
};

fn spec(command: CommandConfig) -> LaunchSpec {
    LaunchSpec {
        container_id: "csi-agent-t-default--NODE_SERVICE".into(),
        command,
        node_id: "node-7".into(),
        resources: vec![],
        container: None,
        runtime: RuntimeConfig::Process,
    }
}

fn shell(script: &str) -> CommandConfig {
    CommandConfig {
        value: script.into(),
        arguments: vec![],
        shell: true,
        environment: vec![EnvVar::plain("FROM_CONFIG", "yes")],
        uris: vec![],
        user: None,
    }
}

fn context(dir: &Path) -> LaunchContext {
    LaunchContext {
        container_dir: dir.to_path_buf(),
        socket: dir.join("sock/endpoint.sock"),
        mount_roots: Vec::new(),
    }
}

fn pid_of(component: &dyn Component) -> i32 {
    component.handle().pid()
}

fn proc_exists(pid: i32) -> bool {
    Path::new(&format!("/proc/{pid}")).exists()
}

/// Field 5 of /proc/<pid>/stat: the process group.
fn pgrp(pid: i32) -> anyhow::Result<i32> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    let rest = &stat[stat.rfind(')').ok_or_else(|| anyhow::anyhow!("odd stat"))? + 1..];
    Ok(rest
        .split_whitespace()
        .nth(2)
        .ok_or_else(|| anyhow::anyhow!("odd stat"))?
        .parse()?)
}

async fn wait_for_file(path: &Path) -> anyhow::Result<String> {
    for _ in 0..500 {
        if let Ok(text) = std::fs::read_to_string(path)
            && text.ends_with('\n')
        {
            return Ok(text);
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    anyhow::bail!("{} never written", path.display())
}

#[tokio::test]
async fn supervision_process_launch_sets_env_logs_and_own_group() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let runtime = ProcessRuntime::new();
    let component = runtime
        .launch(
            &spec(shell(
                "echo \"$CSI_ENDPOINT $CSI_NODE_ID $FROM_CONFIG $(pwd)\"; echo oops >&2; exec sleep 1000",
            )),
            &context(dir.path()),
        )
        .await?;
    let pid = pid_of(component.as_ref());
    let stdout = wait_for_file(&dir.path().join("stdout")).await?;
    assert_eq!(
        stdout.trim(),
        format!(
            "unix://{} node-7 yes {}",
            dir.path().join("sock/endpoint.sock").display(),
            std::fs::canonicalize(dir.path())?.display()
        )
    );
    assert_eq!(wait_for_file(&dir.path().join("stderr")).await?, "oops\n");
    // Its own process group: a signal to the daemon's group does not reach it.
    assert_eq!(pgrp(pid)?, pid);
    assert_ne!(pgrp(pid)?, pgrp(std::process::id().try_into()?)?);

    let exit = component.stop(Duration::from_secs(5)).await;
    assert_eq!(exit, ExitInfo::Signal(15));
    assert!(!proc_exists(pid), "reaped, no zombie left");
    Ok(())
}

#[tokio::test]
async fn supervision_process_argv_follows_mesos_semantics() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let command = CommandConfig {
        value: "/bin/sh".into(),
        // argv[0] included; $CSI_ENDPOINT is substituted by csi-agent (no shell here).
        arguments: vec![
            "custom-argv0".into(),
            "-c".into(),
            // `sh -c script x` sets $0 to x; argv[0] itself is in /proc/$$/cmdline.
            "tr '\\0' '\\n' < /proc/$$/cmdline | head -n 1; echo \"$0\"".into(),
            "--endpoint=$CSI_ENDPOINT".into(),
        ],
        shell: false,
        environment: vec![],
        uris: vec![],
        user: None,
    };
    let component = runtime_launch(&spec(command), dir.path()).await?;
    assert_eq!(component.wait().await, ExitInfo::Code(0));
    let stdout = std::fs::read_to_string(dir.path().join("stdout"))?;
    assert_eq!(
        stdout.trim(),
        format!(
            "custom-argv0\n--endpoint=unix://{}",
            dir.path().join("sock/endpoint.sock").display()
        )
    );
    Ok(())
}

async fn runtime_launch(spec: &LaunchSpec, dir: &Path) -> anyhow::Result<Box<dyn Component>> {
    Ok(ProcessRuntime::new().launch(spec, &context(dir)).await?)
}

#[tokio::test]
async fn supervision_process_exit_is_seen_through_the_pidfd() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let component = runtime_launch(&spec(shell("exit 3")), dir.path()).await?;
    let pid = pid_of(component.as_ref());
    let exit = tokio::time::timeout(Duration::from_secs(5), component.wait()).await?;
    assert_eq!(exit, ExitInfo::Code(3));
    // Waiting again answers at once with the same status.
    assert_eq!(component.wait().await, ExitInfo::Code(3));
    assert!(!proc_exists(pid), "reaped, no zombie left");

    let spawn_error = runtime_launch(
        &spec(CommandConfig {
            value: "/nonexistent/plugin".into(),
            arguments: vec![],
            shell: false,
            environment: vec![],
            uris: vec![],
            user: None,
        }),
        dir.path(),
    )
    .await;
    let err = spawn_error.err().map(|e| e.to_string()).unwrap_or_default();
    assert!(err.contains("cannot start `/nonexistent/plugin`"), "{err}");
    Ok(())
}

#[tokio::test]
async fn supervision_process_adoption_checks_pid_and_start_time() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let runtime = ProcessRuntime::new();
    let component = runtime_launch(&spec(shell("exec sleep 1000")), dir.path()).await?;
    let handle = component.handle();
    let RuntimeHandle::Process {
        pid,
        start_time,
        boot_id,
    } = handle.clone()
    else {
        anyhow::bail!("the process runtime made a {} handle", handle.kind());
    };
    assert!(start_time > 0);
    assert!(boot_id.is_some());
    // The launching side goes away (as when the daemon restarts); the process stays.
    drop(component);
    assert!(proc_exists(pid));

    let adopted = runtime
        .adopt(&handle)
        .await?
        .ok_or_else(|| anyhow::anyhow!("not adopted"))?;
    assert_eq!(adopted.handle(), handle);

    // A pid whose start time differs is another process (pid reuse): not adopted.
    let reused = RuntimeHandle::Process {
        pid,
        start_time: start_time + 1,
        boot_id: boot_id.clone(),
    };
    assert!(runtime.adopt(&reused).await?.is_none());
    // Another boot: not adopted either.
    let other_boot = RuntimeHandle::Process {
        pid,
        start_time,
        boot_id: Some("00000000-0000-0000-0000-000000000000".into()),
    };
    assert!(runtime.adopt(&other_boot).await?.is_none());

    // The adopted process is watched too: a kill -9 is seen.
    rustix::process::kill_process(
        rustix::process::Pid::from_raw(pid).ok_or_else(|| anyhow::anyhow!("bad pid"))?,
        rustix::process::Signal::KILL,
    )?;
    let exit = tokio::time::timeout(Duration::from_secs(5), adopted.wait()).await?;
    // Still our child in this test process, so its status is known and it is reaped.
    assert_eq!(exit, ExitInfo::Signal(9));
    assert!(!proc_exists(pid));
    // Dead: not adoptable any more.
    assert!(runtime.adopt(&handle).await?.is_none());
    Ok(())
}

#[tokio::test]
async fn supervision_process_stop_escalates_to_sigkill_after_grace() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    // Ignores SIGTERM (as slow plugins effectively do) and has a child in its group.
    let component = runtime_launch(
        &spec(shell(
            "trap '' TERM; sleep 1000 & echo $! > child.pid; while :; do sleep 1; done",
        )),
        dir.path(),
    )
    .await?;
    let child: i32 = wait_for_file(&dir.path().join("child.pid"))
        .await?
        .trim()
        .parse()?;
    assert!(proc_exists(child));
    let started = Instant::now();
    let exit = component.stop(Duration::from_millis(300)).await;
    let took = started.elapsed();
    assert_eq!(exit, ExitInfo::Signal(9));
    assert!(took >= Duration::from_millis(300), "{took:?}");
    assert!(took < Duration::from_secs(3), "{took:?}");
    // The whole group went: nothing of the component lingers. (The grandchild was
    // reparented, so give its reaper a moment.)
    for _ in 0..100 {
        let state = std::fs::read_to_string(format!("/proc/{child}/stat")).unwrap_or_default();
        if state.is_empty() || state.contains(") Z ") {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    anyhow::bail!("grandchild {child} survived the stop")
}

/// A `sleep` with the given marker in its environment, optionally in its own process group and
/// as another user.
fn marked_sleep(
    marker: &str,
    own_group: bool,
    uid: Option<u32>,
) -> anyhow::Result<std::process::Child> {
    use std::os::unix::process::CommandExt;
    let mut command = std::process::Command::new("sleep");
    command
        .arg("30")
        .env(csi_agent::runtime::process::COMPONENT_MARKER_VAR, marker);
    if own_group {
        command.process_group(0);
    }
    if let Some(uid) = uid {
        command.uid(uid).gid(uid);
    }
    Ok(command.spawn()?)
}

#[tokio::test]
async fn supervision_process_untracked_component_processes_are_stopped_before_a_launch()
-> anyhow::Result<()> {
    // A daemon killed between spawning a component and writing its component.json leaves a
    // process nobody adopts: the next launch of that component must stop it first.
    let dir = tempfile::tempdir()?;
    let marker = dir.path().display().to_string();
    let mut untracked = marked_sleep(&marker, true, None)?;
    // Left alone: another component's marker, a marked process outside its own group, and a
    // marked process of another user (nobody could then make root signal a stranger).
    let mut other_component = marked_sleep(&format!("{marker}-other"), true, None)?;
    let mut not_a_leader = marked_sleep(&marker, false, None)?;
    let mut other_user = marked_sleep(&marker, true, Some(65534))?;
    let found = csi_agent::runtime::process::find_marked(&marker);
    let found: Vec<i32> = found.iter().map(|pid| pid.as_raw_pid()).collect();
    anyhow::ensure!(
        found == vec![untracked.id() as i32],
        "found {found:?}, expected only {}",
        untracked.id()
    );
    // A component run as `command.user` 65534 counts that user's marked processes too (it
    // could signal them itself), still no other user's and no other component's.
    let as_user = csi_agent::runtime::process::find_marked_owned_by(&marker, Some(65534));
    let mut as_user: Vec<i32> = as_user.iter().map(|pid| pid.as_raw_pid()).collect();
    as_user.sort_unstable();
    let mut expected = vec![untracked.id() as i32, other_user.id() as i32];
    expected.sort_unstable();
    anyhow::ensure!(
        as_user == expected,
        "found {as_user:?}, expected {expected:?}"
    );
    let as_other = csi_agent::runtime::process::find_marked_owned_by(&marker, Some(4242));
    anyhow::ensure!(
        as_other.len() == 1,
        "another user's process was taken: {as_other:?}"
    );

    let component = runtime_launch(
        &spec(shell("echo started > started; exec sleep 30")),
        dir.path(),
    )
    .await?;
    // The untracked one was killed before the launch (it is our child here: reap it).
    let status = untracked.wait()?;
    anyhow::ensure!(
        std::os::unix::process::ExitStatusExt::signal(&status) == Some(9),
        "untracked process ended with {status:?}, not SIGKILL"
    );
    for (name, child) in [
        ("other component", &mut other_component),
        ("not a group leader", &mut not_a_leader),
        ("other user", &mut other_user),
    ] {
        anyhow::ensure!(child.try_wait()?.is_none(), "{name}'s process was killed");
        child.kill()?;
        child.wait()?;
    }
    // The new component carries the marker, so a later daemon could find it the same way.
    let pid = pid_of(component.as_ref());
    let wanted = format!("CSI_AGENT_COMPONENT={marker}");
    // The shell execs `sleep` at its own pace: while the kernel sets up the new image,
    // /proc/PID/environ reads empty (seen under load), so the marker is looked for until the
    // exec is over, not once.
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let environ = std::fs::read(format!("/proc/{pid}/environ"))?;
        if environ
            .split(|b| *b == 0)
            .any(|var| var == wanted.as_bytes())
        {
            break;
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "the launched component has no marker: its environment is {:?}",
            String::from_utf8_lossy(&environ)
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    component.stop(Duration::from_secs(2)).await;
    Ok(())
}
