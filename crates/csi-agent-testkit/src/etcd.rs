//! Real etcd for the tests: [`EtcdCluster`] runs 1 or 3 members of the installed etcd
//! (`/usr/bin/etcd`, or `$CSI_AGENT_ETCD_BIN`) on free loopback ports with their data under a
//! tempdir ([`EtcdCluster::start_tls`]: one member serving clients over TLS only, with a CA,
//! server and client certificates made by the `openssl` CLI in that tempdir), and [`EtcdProxy`] is a loopback TCP proxy a test puts between a client and a member
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
    /// Serves clients over TLS ([`EtcdCluster::start_tls`]); `/health` is then on
    /// `metrics_port`, plain HTTP.
    tls: Option<EtcdTls>,
    metrics_port: u16,
    data_dir: PathBuf,
    log: PathBuf,
    child: Option<Child>,
}

impl Member {
    fn client_url(&self) -> String {
        let scheme = if self.tls.is_some() { "https" } else { "http" };
        format!("{scheme}://127.0.0.1:{}", self.client_port)
    }

    /// The port answering `/health` over plain HTTP.
    fn health_port(&self) -> u16 {
        if self.tls.is_some() {
            self.metrics_port
        } else {
            self.client_port
        }
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
        Self::start_with(members, false)
    }

    /// One member serving clients over TLS only (`https://127.0.0.1:PORT`), asking every
    /// client for a certificate signed by its CA (`--client-cert-auth`); the files are in
    /// [`EtcdCluster::tls`]. Peers stay plain HTTP (loopback, one member).
    pub fn start_tls() -> EtcdCluster {
        Self::start_with(1, true)
    }

    /// The TLS files of a [`EtcdCluster::start_tls`] cluster.
    pub fn tls(&self) -> Option<&EtcdTls> {
        self.members.first().and_then(|m| m.tls.as_ref())
    }

    fn start_with(members: usize, tls: bool) -> EtcdCluster {
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
                tls: None,
                metrics_port: 0,
                data_dir: dir.path().join(format!("m{i}.etcd")),
                log: dir.path().join(format!("m{i}.log")),
                child: None,
            })
            .collect();
        let mut members = members;
        if tls {
            let files = EtcdTls::generate(&dir.path().join("tls"));
            for m in &mut members {
                m.tls = Some(files.clone());
                m.metrics_port = free_port();
            }
        }
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
        let mut command = Command::new(etcd_binary());
        if let Some(tls) = &m.tls {
            command
                .arg("--cert-file")
                .arg(&tls.server_cert)
                .arg("--key-file")
                .arg(&tls.server_key)
                .arg("--trusted-ca-file")
                .arg(&tls.ca)
                .arg("--client-cert-auth")
                .arg("--listen-metrics-urls")
                .arg(format!("http://127.0.0.1:{}", m.metrics_port));
        }
        let child = command
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

    /// Each member's client URL, `http://127.0.0.1:PORT` (`https://` with TLS), in member
    /// order.
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
        let addr = format!("127.0.0.1:{}", self.members[i].health_port());
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

/// The TLS files of a [`EtcdCluster::start_tls`] member, all PEM, made by the `openssl` CLI
/// (P-256 keys, valid 2 days): a CA, etcd's server certificate (SAN `IP:127.0.0.1`,
/// `DNS:localhost`) and a client certificate (CN `csi-agent`), both signed by the CA.
#[derive(Debug, Clone)]
pub struct EtcdTls {
    /// The CA's certificate (what a client trusts).
    pub ca: PathBuf,
    pub server_cert: PathBuf,
    pub server_key: PathBuf,
    /// The client certificate etcd accepts (`--client-cert-auth`).
    pub client_cert: PathBuf,
    pub client_key: PathBuf,
}

impl EtcdTls {
    /// Makes the CA, server and client certificates in `dir` (created).
    pub fn generate(dir: &Path) -> EtcdTls {
        std::fs::create_dir_all(dir).unwrap();
        let (ca, ca_key) = generate_ca(dir, "ca");
        let server_cert = dir.join("server.crt");
        let server_key = dir.join("server.key");
        // etcd 3.4's gRPC gateway dials etcd with the server certificate: clientAuth too.
        sign_leaf(
            dir,
            &ca,
            &ca_key,
            "localhost",
            "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth,clientAuth\nbasicConstraints=CA:FALSE\nkeyUsage=digitalSignature,keyEncipherment\n",
            &server_cert,
            &server_key,
        );
        let client_cert = dir.join("client.crt");
        let client_key = dir.join("client.key");
        sign_leaf(
            dir,
            &ca,
            &ca_key,
            "csi-agent",
            "extendedKeyUsage=clientAuth\nbasicConstraints=CA:FALSE\nkeyUsage=digitalSignature,keyEncipherment\n",
            &client_cert,
            &client_key,
        );
        EtcdTls {
            ca,
            server_cert,
            server_key,
            client_cert,
            client_key,
        }
    }
}

/// Runs the `openssl` CLI; panics with its stderr when it fails.
fn openssl(args: &[&std::ffi::OsStr]) {
    let out = Command::new("openssl")
        .args(args)
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("cannot run openssl (install it): {e}"));
    assert!(
        out.status.success(),
        "openssl {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A self-signed CA `NAME.crt` / `NAME.key` in `dir`: (certificate, key).
pub fn generate_ca(dir: &Path, name: &str) -> (PathBuf, PathBuf) {
    std::fs::create_dir_all(dir).unwrap();
    let cert = dir.join(format!("{name}.crt"));
    let key = dir.join(format!("{name}.key"));
    openssl(&[
        "req".as_ref(),
        "-x509".as_ref(),
        "-newkey".as_ref(),
        "ec".as_ref(),
        "-pkeyopt".as_ref(),
        "ec_paramgen_curve:prime256v1".as_ref(),
        "-nodes".as_ref(),
        "-days".as_ref(),
        "2".as_ref(),
        "-subj".as_ref(),
        format!("/CN=csi-agent test {name}").as_ref(),
        "-addext".as_ref(),
        "basicConstraints=critical,CA:TRUE".as_ref(),
        "-addext".as_ref(),
        "keyUsage=critical,keyCertSign,cRLSign".as_ref(),
        "-keyout".as_ref(),
        key.as_os_str(),
        "-out".as_ref(),
        cert.as_os_str(),
    ]);
    (cert, key)
}

/// A certificate for `cn` signed by the CA, with the extensions `ext` (an extfile's lines).
fn sign_leaf(dir: &Path, ca: &Path, ca_key: &Path, cn: &str, ext: &str, cert: &Path, key: &Path) {
    let csr = cert.with_extension("csr");
    let extfile = cert.with_extension("ext");
    std::fs::write(&extfile, ext).unwrap();
    openssl(&[
        "req".as_ref(),
        "-new".as_ref(),
        "-newkey".as_ref(),
        "ec".as_ref(),
        "-pkeyopt".as_ref(),
        "ec_paramgen_curve:prime256v1".as_ref(),
        "-nodes".as_ref(),
        "-subj".as_ref(),
        format!("/CN={cn}").as_ref(),
        "-keyout".as_ref(),
        key.as_os_str(),
        "-out".as_ref(),
        csr.as_os_str(),
    ]);
    let serial = dir.join("serial");
    openssl(&[
        "x509".as_ref(),
        "-req".as_ref(),
        "-in".as_ref(),
        csr.as_os_str(),
        "-CA".as_ref(),
        ca.as_os_str(),
        "-CAkey".as_ref(),
        ca_key.as_os_str(),
        "-CAserial".as_ref(),
        serial.as_os_str(),
        "-CAcreateserial".as_ref(),
        "-days".as_ref(),
        "2".as_ref(),
        "-extfile".as_ref(),
        extfile.as_os_str(),
        "-out".as_ref(),
        cert.as_os_str(),
    ]);
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
