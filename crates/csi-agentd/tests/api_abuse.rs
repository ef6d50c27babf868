//! The API listeners under abuse: the real `csi-agentd` binary, no plugin, raw HTTP over its
//! unix socket and over TCP on 127.0.0.1 only.
//!
//! Run as root under `unshare -m --propagation private` like the other daemon tests.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::{ErrorKind, Read, Write};
use std::net::TcpStream;
use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const TOKEN: &str = "a-test-token-of-32-bytes-long-xx";
/// A daemon started by the test, killed when dropped.
struct Daemon {
    dir: PathBuf,
    socket: PathBuf,
    child: Child,
    port: Option<u16>,
}

fn free_port() -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.local_addr().unwrap().port()
}

/// A token file, 0600, holding `token`.
fn token_file(dir: &Path, token: &str) -> PathBuf {
    let path = dir.join("token");
    std::fs::write(&path, format!("{token}\n")).unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
    path
}

/// `csi-agentd serve` with its work dir, an empty plugin config dir and the socket root in
/// `dir`, its stderr appended to `dir/daemon.log`.
fn command(dir: &Path, extra: &[&str]) -> Command {
    command_via(dir, &[], extra)
}

/// The same, started through `wrapper` (e.g. `prlimit ...`, `sh -c ...`).
fn command_via(dir: &Path, wrapper: &[&str], extra: &[&str]) -> Command {
    let configs = dir.join("configs");
    std::fs::create_dir_all(&configs).unwrap();
    let binary = env!("CARGO_BIN_EXE_csi-agentd");
    let mut cmd = match wrapper.split_first() {
        None => Command::new(binary),
        Some((program, args)) => {
            let mut cmd = Command::new(program);
            cmd.args(args).arg(binary);
            cmd
        }
    };
    cmd.arg("serve")
        .arg("--work-dir")
        .arg(dir.join("work"))
        .arg("--plugin-config-dir")
        .arg(&configs)
        .arg("--socket-root")
        .arg(dir.join("sockets"))
        .args(extra)
        .env("CSI_AGENT_LOG", "info")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(dir.join("daemon.log"))
                .unwrap(),
        );
    cmd
}

impl Daemon {
    /// Starts the daemon and waits until it answers `GET /v1/health` on its socket.
    fn start(dir: &Path, extra: &[&str]) -> Daemon {
        Self::spawn(dir, command(dir, extra), extra)
    }

    fn spawn(dir: &Path, mut cmd: Command, extra: &[&str]) -> Daemon {
        let socket = extra
            .iter()
            .position(|a| *a == "--api-socket")
            .map(|i| PathBuf::from(extra[i + 1]))
            .unwrap_or_else(|| dir.join("work/api.sock"));
        let port = extra
            .iter()
            .position(|a| *a == "--listen")
            .map(|i| extra[i + 1].rsplit(':').next().unwrap().parse().unwrap())
            .filter(|p| *p != 0);
        let child = cmd.spawn().unwrap();
        let mut daemon = Daemon {
            dir: dir.to_owned(),
            socket,
            child,
            port,
        };
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Some(status) = daemon.child.try_wait().unwrap() {
                panic!("the daemon exited ({status}): {}", daemon.log());
            }
            if let Ok(mut s) = UnixStream::connect(&daemon.socket) {
                s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
                if s.write_all(&get("/v1/health", None)).is_ok()
                    && read_answer(&mut s).is_ok_and(|a| a.status == 200)
                {
                    return daemon;
                }
            }
            assert!(
                Instant::now() < deadline,
                "the daemon never answered: {}",
                daemon.log()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("daemon.log")).unwrap_or_default()
    }

    fn unix(&self) -> UnixStream {
        let s = UnixStream::connect(&self.socket).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        s.set_write_timeout(Some(Duration::from_secs(10))).unwrap();
        s
    }

    fn tcp(&self) -> TcpStream {
        let s = TcpStream::connect(("127.0.0.1", self.port.unwrap())).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        s.set_write_timeout(Some(Duration::from_secs(10))).unwrap();
        s
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn proc_status(pid: u32, key: &str) -> String {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix(key))
        .unwrap_or_else(|| panic!("no {key} in /proc/{pid}/status"))
        .trim()
        .to_owned()
}

/// Runs a daemon that must refuse to start; what it logged.
fn refused(dir: &Path, cmd: &mut Command) -> String {
    let log_file = dir.join("daemon.log");
    let before = std::fs::metadata(&log_file).map_or(0, |m| m.len() as usize);
    let mut child = cmd.spawn().unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("the daemon did not refuse to start within 20 s");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let log = std::fs::read_to_string(&log_file).unwrap_or_default()[before..].to_owned();
    assert!(!status.success(), "the daemon exited {status}: {log}");
    log
}

#[derive(Debug)]
struct Answer {
    status: u16,
    head: String,
    body: String,
}

impl Answer {
    fn json(&self) -> serde_json::Value {
        serde_json::from_str(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {} {}", self.head, self.body))
    }
}

/// Reads one HTTP response (a head and a `content-length` body).
fn read_answer(stream: &mut impl Read) -> std::io::Result<Answer> {
    let mut data = Vec::new();
    let mut chunk = [0u8; 4096];
    let head_end = loop {
        if let Some(at) = data.windows(4).position(|w| w == b"\r\n\r\n") {
            break at + 4;
        }
        let n = stream.read(&mut chunk)?;
        if n == 0 {
            return Err(std::io::Error::new(
                ErrorKind::UnexpectedEof,
                format!("closed after {:?}", String::from_utf8_lossy(&data)),
            ));
        }
        data.extend_from_slice(&chunk[..n]);
    };
    let head = String::from_utf8_lossy(&data[..head_end]).into_owned();
    let status = head
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let length: usize = head
        .lines()
        .find_map(|l| {
            let (name, value) = l.split_once(':')?;
            name.eq_ignore_ascii_case("content-length")
                .then(|| value.trim().parse().ok())?
        })
        .unwrap_or(0);
    while data.len() < head_end + length {
        let n = stream.read(&mut chunk)?;
        if n == 0 {
            break;
        }
        data.extend_from_slice(&chunk[..n]);
    }
    let body = String::from_utf8_lossy(&data[head_end..]).into_owned();
    Ok(Answer { status, head, body })
}

fn exchange(stream: &mut (impl Read + Write), request: &[u8]) -> Answer {
    stream.write_all(request).unwrap();
    read_answer(stream).unwrap()
}

fn get(path: &str, token: Option<&str>) -> Vec<u8> {
    let auth = token
        .map(|t| format!("authorization: Bearer {t}\r\n"))
        .unwrap_or_default();
    format!("GET {path} HTTP/1.1\r\nhost: localhost\r\n{auth}\r\n").into_bytes()
}

fn tcp_args<'a>(listen: &'a str, token: &'a Path, more: &[&'a str]) -> Vec<&'a str> {
    let mut args = vec!["--listen", listen, "--token-file", token.to_str().unwrap()];
    args.extend_from_slice(more);
    args
}

#[test]
fn api_socket_replaces_only_a_stale_socket() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("api.sock");
    let path_arg = path.to_str().unwrap().to_owned();
    let args = ["--api-socket", path_arg.as_str()];

    // A regular file.
    std::fs::write(&path, "keep me").unwrap();
    let log = refused(dir.path(), &mut command(dir.path(), &args));
    assert!(
        log.contains(&path_arg) && log.contains("regular file"),
        "{log}"
    );
    assert_eq!(std::fs::read_to_string(&path).unwrap(), "keep me");
    std::fs::remove_file(&path).unwrap();

    // A directory.
    std::fs::create_dir(&path).unwrap();
    std::fs::write(path.join("inside"), "keep me too").unwrap();
    let log = refused(dir.path(), &mut command(dir.path(), &args));
    assert!(
        log.contains(&path_arg) && log.contains("a directory"),
        "{log}"
    );
    assert_eq!(
        std::fs::read_to_string(path.join("inside")).unwrap(),
        "keep me too"
    );
    std::fs::remove_dir_all(&path).unwrap();

    // A symlink to a file: neither followed nor removed.
    let target = dir.path().join("precious");
    std::fs::write(&target, "precious").unwrap();
    std::os::unix::fs::symlink(&target, &path).unwrap();
    let log = refused(dir.path(), &mut command(dir.path(), &args));
    assert!(
        log.contains(&path_arg) && log.contains("symbolic link"),
        "{log}"
    );
    assert!(
        std::fs::symlink_metadata(&path)
            .unwrap()
            .file_type()
            .is_symlink()
    );
    assert_eq!(std::fs::read_link(&path).unwrap(), target);
    assert_eq!(std::fs::read_to_string(&target).unwrap(), "precious");
    std::fs::remove_file(&path).unwrap();

    // A live socket: another server is there.
    let live = UnixListener::bind(&path).unwrap();
    let inode = std::fs::symlink_metadata(&path).unwrap().ino();
    let log = refused(dir.path(), &mut command(dir.path(), &args));
    assert!(
        log.contains(&path_arg) && log.contains("another process is serving"),
        "{log}"
    );
    assert_eq!(std::fs::symlink_metadata(&path).unwrap().ino(), inode);
    let _client = UnixStream::connect(&path).unwrap();
    live.set_nonblocking(true).unwrap();
    // The daemon's probe and this client both reached the live server.
    assert!(live.accept().is_ok());
    drop(live);

    // Now stale (the file outlives its listener): replaced, and served.
    assert!(
        std::fs::symlink_metadata(&path)
            .unwrap()
            .file_type()
            .is_socket()
    );
    assert_eq!(
        UnixStream::connect(&path).unwrap_err().kind(),
        ErrorKind::ConnectionRefused
    );
    let daemon = Daemon::start(dir.path(), &args);
    assert!(
        daemon.log().contains("replacing a stale API socket"),
        "{}",
        daemon.log()
    );
    assert_eq!(
        exchange(&mut daemon.unix(), &get("/v1/health", None)).status,
        200
    );
}

#[test]
fn the_socket_is_created_0600_and_the_umask_restored() {
    use rustix::fs::inotify;
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    std::fs::create_dir(&run).unwrap();
    let socket = run.join("api.sock");
    let socket_arg = socket.to_str().unwrap().to_owned();
    let args = ["--api-socket", socket_arg.as_str()];
    // Any change of the socket's mode after it was made shows as IN_ATTRIB.
    let watch = inotify::init(inotify::CreateFlags::NONBLOCK).unwrap();
    inotify::add_watch(
        &watch,
        &run,
        inotify::WatchFlags::CREATE | inotify::WatchFlags::ATTRIB,
    )
    .unwrap();
    // The most permissive umask: without the daemon's own, the socket would start 0777.
    let cmd = command_via(
        dir.path(),
        &["sh", "-c", "umask 000; exec \"$0\" \"$@\""],
        &args,
    );
    let daemon = Daemon::spawn(dir.path(), cmd, &args);
    let meta = std::fs::symlink_metadata(&socket).unwrap();
    assert!(meta.file_type().is_socket());
    assert_eq!(meta.permissions().mode() & 0o777, 0o600);
    assert_eq!(proc_status(daemon.pid(), "Umask:"), "0000");

    let mut buf = [std::mem::MaybeUninit::uninit(); 4096];
    let mut events = inotify::Reader::new(&watch, &mut buf);
    let mut seen = Vec::new();
    loop {
        match events.next() {
            Ok(event) => seen.push((
                event.file_name().map(|n| n.to_string_lossy().into_owned()),
                event.events(),
            )),
            Err(rustix::io::Errno::AGAIN) => break,
            Err(err) => panic!("{err}"),
        }
    }
    let api_sock = Some("api.sock".to_owned());
    assert!(
        seen.iter()
            .any(|(name, ev)| *name == api_sock && ev.contains(inotify::ReadFlags::CREATE)),
        "{seen:?}"
    );
    assert!(
        !seen
            .iter()
            .any(|(name, ev)| *name == api_sock && ev.contains(inotify::ReadFlags::ATTRIB)),
        "the socket's mode was changed after it was created: {seen:?}"
    );
}

#[test]
fn weak_tokens_and_exposed_listeners_are_refused_before_serving() {
    let dir = tempfile::tempdir().unwrap();
    let token = token_file(dir.path(), TOKEN);
    let shown = token.to_str().unwrap();
    let socket = dir.path().join("work/api.sock");
    let port = free_port().to_string();
    let loopback = format!("127.0.0.1:{port}");

    std::fs::set_permissions(&token, std::fs::Permissions::from_mode(0o644)).unwrap();
    let args = tcp_args(&loopback, &token, &[]);
    let log = refused(dir.path(), &mut command(dir.path(), &args));
    assert!(log.contains(shown) && log.contains("chmod 600"), "{log}");
    assert!(!socket.exists(), "a socket was created");

    let short = token_file(dir.path(), "fifteen-bytes-x");
    let log = refused(
        dir.path(),
        &mut command(dir.path(), &tcp_args(&loopback, &short, &[])),
    );
    assert!(
        log.contains("15 bytes") && log.contains("at least 16"),
        "{log}"
    );
    assert!(!socket.exists(), "a socket was created");

    let token = token_file(dir.path(), TOKEN);
    let any = format!("0.0.0.0:{port}");
    let log = refused(
        dir.path(),
        &mut command(dir.path(), &tcp_args(&any, &token, &[])),
    );
    assert!(
        log.contains("0.0.0.0") && log.contains("--allow-insecure-listen"),
        "{log}"
    );
    assert!(!socket.exists(), "a socket was created");

    // Allowed: it starts, says so loudly, and is reached here through 127.0.0.1 only.
    let args = tcp_args(
        "0.0.0.0:0",
        &token,
        &["--allow-insecure-listen", "--log-format", "json"],
    );
    let mut daemon = Daemon::start(dir.path(), &args);
    let warning = daemon
        .log()
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .find(|l| l["level"] == "WARN" && l["fields"]["addr"].is_string())
        .unwrap_or_else(|| panic!("no warning: {}", daemon.log()));
    assert!(
        warning["fields"]["message"]
            .as_str()
            .unwrap()
            .contains("non-loopback"),
        "{warning}"
    );
    let addr = warning["fields"]["addr"].as_str().unwrap();
    assert!(addr.starts_with("0.0.0.0:"), "{addr}");
    daemon.port = Some(addr.rsplit(':').next().unwrap().parse().unwrap());
    let answer = exchange(&mut daemon.tcp(), &get("/v1/health", Some(TOKEN)));
    assert_eq!(answer.status, 200, "{answer:?}");
    assert_eq!(answer.json()["status"], "ok");
}
