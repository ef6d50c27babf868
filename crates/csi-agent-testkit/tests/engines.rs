//! The engines harness itself, on real Debian `dockerd` 20.10 and `podman` 4.3 (as root, under
//! `unshare -m --propagation private`): each engine runs a container writing to a local named
//! volume and another reading it back; a detached container survives a dockerd crash and
//! restart (live restore); a plugin spec or socket is seen only inside the test's namespace;
//! two dockerds share nothing; and dropping the harness, even of a crashed dockerd, leaves no
//! process, cgroup or mount of it.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::Path;

use csi_agent_testkit::engines::{Dockerd, Engine, IMAGE, Podman, engine_pids};
use csi_agent_testkit::{mounts_under, pid_alive, require_private_mount_namespace};

/// Nothing the engine started is left: no process naming the dir or descending from one, not
/// the container's own process, no cgroup of the container, and no mount under the dir.
fn assert_nothing_left(dir: &Path, containers: &[(&str, i32)]) {
    assert!(
        engine_pids(dir).is_empty(),
        "processes left: {:?}",
        engine_pids(dir)
    );
    for (id, pid) in containers {
        assert!(!pid_alive(*pid), "container process {pid} left running");
        let cgroups = container_cgroup_dirs(id);
        assert!(cgroups.is_empty(), "cgroups left: {cgroups:?}");
    }
    assert!(
        mounts_under(dir).is_empty(),
        "mounts left: {:?}",
        mounts_under(dir)
    );
}

/// The cgroup dirs (any hierarchy, any engine's naming) whose name contains container `id`.
fn container_cgroup_dirs(id: &str) -> Vec<std::path::PathBuf> {
    let mut found = Vec::new();
    let mut stack = vec![std::path::PathBuf::from("/sys/fs/cgroup")];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
            if entry.file_type().is_ok_and(|t| t.is_dir()) {
                if entry.file_name().to_string_lossy().contains(id) {
                    found.push(entry.path());
                } else if dir.components().count() < 6 {
                    stack.push(entry.path());
                }
            }
        }
    }
    found
}

/// Starts `sleep 600` detached with `volume` on /data; its container id and the pid of its
/// process, checked alive.
fn run_detached(engine: &impl Engine, volume: &str) -> (String, i32) {
    let mount = format!("{volume}:/data");
    let id = engine.run_ok([
        "run",
        "-d",
        "--network",
        "none",
        "-v",
        &mount,
        IMAGE,
        "sleep",
        "600",
    ]);
    let pid: i32 = engine
        .run_ok(["inspect", "-f", "{{.State.Pid}}", &id])
        .parse()
        .unwrap();
    assert!(pid_alive(pid), "the detached container runs");
    (id, pid)
}

/// The nearest ancestor in another mount namespace than this process's.
fn host_namespace_pid() -> u32 {
    let own = std::fs::read_link("/proc/self/ns/mnt").unwrap();
    let mut pid = std::process::id();
    loop {
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
        pid = status
            .lines()
            .find_map(|line| line.strip_prefix("PPid:"))
            .unwrap()
            .trim()
            .parse()
            .unwrap();
        assert!(pid > 1, "no ancestor outside the test's mount namespace");
        if std::fs::read_link(format!("/proc/{pid}/ns/mnt")).unwrap() != own {
            return pid;
        }
    }
}

#[test]
fn dockerd_runs_containers_on_a_local_volume_and_keeps_them_across_a_crash() {
    require_private_mount_namespace();
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("docker");
    let mut dockerd = Dockerd::start(&dir);
    dockerd.import_busybox();

    let run = |dockerd: &Dockerd, script: &str| {
        dockerd.run_ok([
            "run",
            "--rm",
            "--network",
            "none",
            "-v",
            "lv:/data",
            IMAGE,
            "sh",
            "-c",
            script,
        ])
    };
    assert_eq!(run(&dockerd, "echo hi > /data/f"), "");
    assert_eq!(run(&dockerd, "cat /data/f"), "hi");
    // Another volume name is another volume: the harness's engine is a real one.
    let other = dockerd.docker([
        "run",
        "--rm",
        "--network",
        "none",
        "-v",
        "lv2:/data",
        IMAGE,
        "cat",
        "/data/f",
    ]);
    assert!(!other.status.success(), "lv2 has no f");

    let (id, pid) = run_detached(&dockerd, "lv");
    let dockerd_pid = dockerd.pid().unwrap();
    dockerd.kill();
    assert!(
        !pid_alive(i32::try_from(dockerd_pid).unwrap()),
        "dockerd was killed"
    );
    assert!(pid_alive(pid), "the container outlives dockerd's crash");
    dockerd.restart();
    assert_ne!(dockerd.pid().unwrap(), dockerd_pid);
    assert_eq!(
        dockerd.run_ok(["inspect", "-f", "{{.State.Running}} {{.State.Pid}}", &id]),
        format!("true {pid}"),
        "live restore: the same process still runs after dockerd's restart"
    );
    assert_eq!(
        dockerd.run_ok(["exec", &id, "cat", "/data/f"]),
        "hi",
        "and still sees its volume"
    );
    // A clean stop and start keeps it too (the SIGTERM path of restart()).
    dockerd.restart();
    assert!(pid_alive(pid));

    drop(dockerd);
    assert_nothing_left(&dir, &[(&id, pid)]);
}

/// The abuse: two test dockerds at once share nothing (containers, volumes), and dropping one
/// that crashed (SIGKILLed, never restarted) still leaves nothing of it, while the other one and
/// its container run on.
#[test]
fn two_dockerds_share_nothing_and_a_crashed_one_is_cleaned_up() {
    require_private_mount_namespace();
    let tmp = tempfile::tempdir().unwrap();
    let (dir_a, dir_b) = (tmp.path().join("a"), tmp.path().join("b"));
    let mut a = Dockerd::start(&dir_a);
    let b = Dockerd::start(&dir_b);
    a.import_busybox();
    b.import_busybox();
    let (id_a, pid_a) = run_detached(&a, "only-in-a");
    let (id_b, pid_b) = run_detached(&b, "only-in-b");
    assert_eq!(b.run_ok(["ps", "-q", "--no-trunc"]), id_b);
    assert_eq!(a.run_ok(["ps", "-q", "--no-trunc"]), id_a);
    assert_eq!(a.run_ok(["volume", "ls", "-q"]), "only-in-a");
    assert_eq!(b.run_ok(["volume", "ls", "-q"]), "only-in-b");

    a.kill();
    drop(a);
    assert_nothing_left(&dir_a, &[(&id_a, pid_a)]);
    assert!(pid_alive(pid_b), "b's container is not a's to kill");
    assert_eq!(
        b.run_ok(["inspect", "-f", "{{.State.Running}}", &id_b]),
        "true"
    );
    drop(b);
    assert_nothing_left(&dir_b, &[(&id_b, pid_b)]);
}

#[test]
fn plugin_specs_and_sockets_are_seen_only_inside_the_test_namespace() {
    require_private_mount_namespace();
    let tmp = tempfile::tempdir().unwrap();
    let socket = tmp.path().join("nowhere.sock");
    let driver = format!("csi-harness-spec-{}", std::process::id());
    let spec = Dockerd::plugin_spec(&driver, &socket);
    let spec_path = spec.path.clone();
    assert_eq!(
        spec_path,
        Path::new("/etc/docker/plugins").join(format!("{driver}.spec"))
    );
    assert_eq!(
        std::fs::read_to_string(&spec_path).unwrap(),
        format!("unix://{}\n", socket.display())
    );
    // An ancestor outside the test's namespace (the shell or cargo that ran `unshare`) sees
    // its own /etc through /proc/PID/root: the spec must not be there.
    let host = host_namespace_pid();
    let host_root = Path::new("/proc").join(host.to_string()).join("root");
    assert!(host_root.join("etc").is_dir(), "the probe itself works");
    assert!(
        !host_root
            .join(spec_path.strip_prefix("/").unwrap())
            .exists(),
        "the spec must not exist on the host"
    );
    assert!(
        !host_root
            .join("etc/docker/plugins")
            .join(format!("{driver}.spec"))
            .exists()
    );
    // The socket dir is private the same way.
    let socket_path = Dockerd::plugin_socket_path(&driver);
    assert_eq!(
        socket_path,
        Path::new("/run/docker/plugins").join(format!("{driver}.sock"))
    );
    std::fs::write(&socket_path, "").unwrap();
    assert!(
        !host_root
            .join(socket_path.strip_prefix("/").unwrap())
            .exists(),
        "the plugin socket dir must not be the host's"
    );
    std::fs::remove_file(&socket_path).unwrap();

    // Gone with its guard: a dangling spec would cost every later `docker run -v NEW:…` of
    // this process ~15 s of retries against a socket nobody serves.
    drop(spec);
    assert!(!spec_path.exists());
}

#[test]
fn podman_runs_containers_on_a_local_volume() {
    require_private_mount_namespace();
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("podman");
    let podman = Podman::new(&dir);
    podman.import_busybox();

    let run =
        |script: &str| podman.run_ok(["run", "--rm", "-v", "lv:/data", IMAGE, "sh", "-c", script]);
    assert_eq!(run("echo hi > /data/f"), "");
    assert_eq!(run("cat /data/f"), "hi");
    assert!(
        podman
            .run_ok(["volume", "ls", "-q"])
            .lines()
            .any(|v| v == "lv")
    );

    let (id, pid) = run_detached(&podman, "lv");
    assert!(
        !mounts_under(&dir).is_empty(),
        "a running container has its rootfs mounted"
    );

    drop(podman);
    assert_nothing_left(&dir, &[(&id, pid)]);
}
