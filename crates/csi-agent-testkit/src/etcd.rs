//! Real etcd for the tests: [`EtcdCluster`] runs 1 or 3 members of the installed etcd
//! (`/usr/bin/etcd`, or `$CSI_AGENT_ETCD_BIN`) on free loopback ports with their data under a
//! tempdir, and [`EtcdProxy`] is a loopback TCP proxy a test puts between a client and a member
//! to pass, blackhole or reset its connections.
//!
//! Owns: the member processes it started (by their `Child`), their data dirs and logs, and the
//! proxy's threads and sockets. Must not: touch Debian's own etcd service or its ports 2379/2380,
//! or leave a member running after the cluster is dropped (Drop kills every member and removes
//! its data dir).

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

/// How long [`EtcdCluster::start`] and [`EtcdCluster::restart`] wait for health.
const START_TIMEOUT: Duration = Duration::from_secs(20);

/// The etcd binary: `$CSI_AGENT_ETCD_BIN` or `/usr/bin/etcd`; panics saying what to install.
pub fn etcd_binary() -> PathBuf {
    let path = std::env::var_os("CSI_AGENT_ETCD_BIN")
        .map_or_else(|| PathBuf::from("/usr/bin/etcd"), PathBuf::from);
    assert!(
        path.is_file(),
        "etcd binary {} not found: install etcd-server (apt-get install etcd-server) or set CSI_AGENT_ETCD_BIN",
        path.display()
    );
    path
}

/// A free loopback port, never Debian's etcd ports.
fn free_port() -> u16 {
    loop {
        let port = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        if port != 2379 && port != 2380 {
            return port;
        }
    }
}

#[derive(Debug)]
struct Member {
    name: String,
    client_port: u16,
    peer_port: u16,
    data_dir: PathBuf,
    log: PathBuf,
    child: Option<Child>,
}

impl Member {
    fn client_url(&self) -> String {
        format!("http://127.0.0.1:{}", self.client_port)
    }

    fn peer_url(&self) -> String {
        format!("http://127.0.0.1:{}", self.peer_port)
    }

    /// The last `lines` lines of this member's log, for a failure message.
    fn log_tail(&self, lines: usize) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let all: Vec<&str> = text.lines().collect();
        all[all.len().saturating_sub(lines)..].join("\n")
    }
}

/// 1 or 3 real etcd members on loopback; dropped, it kills them and removes their data.
#[derive(Debug)]
pub struct EtcdCluster {
    members: Vec<Member>,
    initial_cluster: String,
    token: String,
    // Last: removed after the members are killed.
    dir: tempfile::TempDir,
}

impl EtcdCluster {
    /// Starts `members` (1 or 3) members and waits until each reports healthy (20 s at most,
    /// else panics with the log tails).
    pub fn start(members: usize) -> EtcdCluster {
        assert!(
            members == 1 || members == 3,
            "EtcdCluster::start: 1 or 3 members, not {members}"
        );
        etcd_binary();
        // tmpfs when there is one: etcd fsyncs every write.
        let dir = if Path::new("/dev/shm").is_dir() {
            tempfile::Builder::new()
                .prefix("csi-etcd-")
                .tempdir_in("/dev/shm")
                .unwrap()
        } else {
            tempfile::Builder::new()
                .prefix("csi-etcd-")
                .tempdir()
                .unwrap()
        };
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let token = format!(
            "csi-test-{}-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed),
            dir.path().file_name().unwrap().to_string_lossy()
        );
        let members: Vec<Member> = (0..members)
            .map(|i| Member {
                name: format!("m{i}"),
                client_port: free_port(),
                peer_port: free_port(),
                data_dir: dir.path().join(format!("m{i}.etcd")),
                log: dir.path().join(format!("m{i}.log")),
                child: None,
            })
            .collect();
        let initial_cluster = members
            .iter()
            .map(|m| format!("{}={}", m.name, m.peer_url()))
            .collect::<Vec<_>>()
            .join(",");
        let mut cluster = EtcdCluster {
            members,
            initial_cluster,
            token,
            dir,
        };
        for i in 0..cluster.members.len() {
            cluster.spawn(i);
        }
        cluster.wait_healthy(START_TIMEOUT);
        cluster
    }

    fn spawn(&mut self, i: usize) {
        let m = &self.members[i];
        assert!(m.child.is_none(), "etcd member {i} is already running");
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&m.log)
            .unwrap();
        let child = Command::new(etcd_binary())
            .arg("--name")
            .arg(&m.name)
            .arg("--data-dir")
            .arg(&m.data_dir)
            .arg("--listen-client-urls")
            .arg(m.client_url())
            .arg("--advertise-client-urls")
            .arg(m.client_url())
            .arg("--listen-peer-urls")
            .arg(m.peer_url())
            .arg("--initial-advertise-peer-urls")
            .arg(m.peer_url())
            .arg("--initial-cluster")
            .arg(&self.initial_cluster)
            .arg("--initial-cluster-state")
            .arg("new")
            .arg("--initial-cluster-token")
            .arg(&self.token)
            .args(["--heartbeat-interval", "50", "--election-timeout", "500"])
            .args(["--logger", "zap", "--log-outputs", "stderr"])
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start etcd member {}: {e}", m.name));
        self.members[i].child = Some(child);
    }

    /// Each member's client URL, `http://127.0.0.1:PORT`, in member order.
    pub fn client_urls(&self) -> Vec<String> {
        self.members.iter().map(Member::client_url).collect()
    }

    /// The client URLs comma-joined, for `--cluster-etcd`.
    pub fn endpoints_flag(&self) -> String {
        self.client_urls().join(",")
    }

    /// The directory holding the members' data dirs and logs.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// SIGKILLs member `member` (its data dir stays, for [`EtcdCluster::restart`]).
    pub fn kill(&mut self, member: usize) {
        if let Some(mut child) = self.members[member].child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts a killed member again, same data dir and ports, and waits until it is healthy.
    pub fn restart(&mut self, member: usize) {
        self.kill(member);
        self.spawn(member);
        let deadline = Instant::now() + START_TIMEOUT;
        while !self.member_healthy(member) {
            if Instant::now() > deadline {
                panic!(
                    "etcd member {member} not healthy {START_TIMEOUT:?} after restart; log tail:\n{}",
                    self.members[member].log_tail(40)
                );
            }
            thread::sleep(Duration::from_millis(50));
        }
    }

    /// Waits until every running member answers `/health` with `true` (which needs a leader);
    /// panics with the log tails of the ones that do not.
    pub fn wait_healthy(&self, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        loop {
            let sick: Vec<usize> = (0..self.members.len())
                .filter(|&i| self.members[i].child.is_some() && !self.member_healthy(i))
                .collect();
            if sick.is_empty() {
                return;
            }
            if Instant::now() > deadline {
                let tails: Vec<String> = sick
                    .iter()
                    .map(|&i| {
                        format!(
                            "--- member {i} ({}):\n{}",
                            self.members[i].client_url(),
                            self.members[i].log_tail(40)
                        )
                    })
                    .collect();
                panic!(
                    "etcd members {sick:?} not healthy after {timeout:?}:\n{}",
                    tails.join("\n")
                );
            }
            thread::sleep(Duration::from_millis(50));
        }
    }

    /// etcd's own `/health` on the client port (HTTP/1.1 beside gRPC): `"health":"true"` only
    /// when the member has a leader and can serve a quorum read.
    fn member_healthy(&self, i: usize) -> bool {
        let addr = format!("127.0.0.1:{}", self.members[i].client_port);
        let Ok(mut stream) =
            TcpStream::connect_timeout(&addr.parse().unwrap(), Duration::from_millis(500))
        else {
            return false;
        };
        let _ = stream.set_read_timeout(Some(Duration::from_secs(3)));
        let _ = stream.set_write_timeout(Some(Duration::from_secs(1)));
        if stream
            .write_all(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
            .is_err()
        {
            return false;
        }
        let mut answer = String::new();
        let _ = stream.read_to_string(&mut answer);
        answer.contains("\"health\":\"true\"")
    }
}

impl Drop for EtcdCluster {
    fn drop(&mut self) {
        for i in 0..self.members.len() {
            self.kill(i);
        }
        if thread::panicking() {
            for m in &self.members {
                eprintln!("--- etcd member {} log tail:\n{}", m.name, m.log_tail(20));
            }
        }
    }
}

/// What an [`EtcdProxy`] does with its connections.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum ProxyMode {
    /// Forward bytes both ways.
    Pass = 0,
    /// Keep connections open (and accept new ones) but drop every byte.
    Blackhole = 1,
    /// Close every connection, and close new ones as soon as they are accepted.
    Reset = 2,
}

impl ProxyMode {
    fn from_u8(v: u8) -> ProxyMode {
        match v {
            1 => ProxyMode::Blackhole,
            2 => ProxyMode::Reset,
            _ => ProxyMode::Pass,
        }
    }
}

#[derive(Debug)]
struct ProxyShared {
    mode: AtomicU8,
    stop: AtomicBool,
}

impl ProxyShared {
    fn mode(&self) -> ProxyMode {
        ProxyMode::from_u8(self.mode.load(Ordering::SeqCst))
    }
}

/// A loopback TCP proxy in front of one etcd member, whose behaviour the test sets
/// ([`ProxyMode`]). A connection that lost bytes in Blackhole mode is closed when the mode goes
/// back to Pass: its HTTP/2 stream is corrupt, and the client must reconnect.
#[derive(Debug)]
pub struct EtcdProxy {
    port: u16,
    shared: Arc<ProxyShared>,
    threads: Mutex<Vec<thread::JoinHandle<()>>>,
}

impl EtcdProxy {
    /// Listens on a free loopback port and forwards to `upstream` (`127.0.0.1:PORT`).
    pub fn start(upstream: &str) -> EtcdProxy {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        listener.set_nonblocking(true).unwrap();
        let port = listener.local_addr().unwrap().port();
        let shared = Arc::new(ProxyShared {
            mode: AtomicU8::new(ProxyMode::Pass as u8),
            stop: AtomicBool::new(false),
        });
        let upstream = upstream
            .trim_start_matches("http://")
            .trim_end_matches('/')
            .to_owned();
        let accept_shared = shared.clone();
        let accept = thread::spawn(move || accept_loop(listener, &upstream, accept_shared));
        EtcdProxy {
            port,
            shared,
            threads: Mutex::new(vec![accept]),
        }
    }

    /// The proxy's client URL, `http://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    pub fn set_mode(&self, mode: ProxyMode) {
        self.shared.mode.store(mode as u8, Ordering::SeqCst);
    }
}

impl Drop for EtcdProxy {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        for t in self.threads.lock().unwrap().drain(..) {
            let _ = t.join();
        }
    }
}

fn accept_loop(listener: TcpListener, upstream: &str, shared: Arc<ProxyShared>) {
    let mut pumps = Vec::new();
    while !shared.stop.load(Ordering::SeqCst) {
        match listener.accept() {
            Ok((client, _)) => {
                if shared.mode() == ProxyMode::Reset {
                    drop(client);
                    continue;
                }
                client.set_nonblocking(false).unwrap();
                let Ok(server) = TcpStream::connect(upstream) else {
                    // Upstream down: the client sees its connection closed, as it would.
                    continue;
                };
                let tainted = Arc::new(AtomicBool::new(false));
                for (from, to) in [
                    (client.try_clone().unwrap(), server.try_clone().unwrap()),
                    (server, client),
                ] {
                    let shared = shared.clone();
                    let tainted = tainted.clone();
                    pumps.push(thread::spawn(move || pump(from, to, &shared, &tainted)));
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                thread::sleep(Duration::from_millis(10));
            }
            Err(_) => thread::sleep(Duration::from_millis(10)),
        }
        pumps.retain(|p: &thread::JoinHandle<()>| !p.is_finished());
    }
    for p in pumps {
        let _ = p.join();
    }
}

/// Copies `from` to `to` as the mode says; closes both ends when it stops.
fn pump(mut from: TcpStream, mut to: TcpStream, shared: &ProxyShared, tainted: &AtomicBool) {
    let _ = from.set_read_timeout(Some(Duration::from_millis(20)));
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        if shared.stop.load(Ordering::SeqCst) {
            break;
        }
        match shared.mode() {
            ProxyMode::Reset => break,
            ProxyMode::Pass if tainted.load(Ordering::SeqCst) => break,
            _ => {}
        }
        match from.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => match shared.mode() {
                ProxyMode::Pass if !tainted.load(Ordering::SeqCst) => {
                    if to.write_all(&buf[..n]).is_err() {
                        break;
                    }
                }
                ProxyMode::Reset => break,
                _ => tainted.store(true, Ordering::SeqCst),
            },
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) => {}
            Err(_) => break,
        }
    }
    let _ = from.shutdown(Shutdown::Both);
    let _ = to.shutdown(Shutdown::Both);
}
