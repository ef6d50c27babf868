//! The API's listeners: binding the unix socket and the TCP address safely, checking the token
//! file, and serving a [`Router`] on each listener with hyper's HTTP/1 connection builder under
//! bounds that a hostile or broken client cannot lift: a cap on open connections, a deadline for
//! each request head, an idle timeout, limits on the size of heads and bodies, a deadline for
//! reading a body, and the `Content-Type` rule (see docs/api.md, "Limits and timeouts").
//!
//! Connections that have not yet sent a complete request head wait in a pool of their own
//! (issue #24, M4): they never take one of the `max_connections` slots, which only a
//! connection with a request gets; when the pool is full, its oldest connection is answered
//! 503 and closed to make room, so that clients sending partial heads cannot keep a new client
//! (who sends its head at once) from being served. A request answered 401 closes its
//! connection, so that a client without the token holds a slot only while it is refused.
//!
//! This module owns connections and the framing of requests. It must not know the routes, parse
//! request bodies as JSON, compare tokens (`api::require_token` does, layered outside
//! [`guard`] so that it runs before any body is read), or touch the engine's state.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::num::{NonZeroU64, NonZeroUsize};
use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::path::Path;
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context as TaskContext, Poll};
use std::time::Duration;

use anyhow::{Context, bail};
use axum::Router;
use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use csi_agent_api as api;
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, UnixListener};
use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore, watch};
use tokio::task::JoinSet;
use tokio::time::Instant;

use crate::convert::ApiFailure;

/// Request heads (request line and header fields) larger than this are answered 431 in the
/// error shape.
pub const MAX_HEAD_BYTES: usize = 16 * 1024;
/// The most hyper buffers for one connection. A head that does not fit is answered 431 by hyper
/// itself, without a body, and the connection is closed.
pub const READ_BUFFER_BYTES: usize = 128 * 1024;
/// How much of an upload over its limit is read and dropped before the 413, so that the client
/// gets to read it (see `guard_upload` and the import handler).
pub const MAX_DRAIN_BYTES: u64 = 64 << 20;
/// Request bodies larger than this are answered 413.
pub const MAX_BODY_BYTES: usize = 1024 * 1024;
/// The shortest token the TCP listener accepts.
pub const MIN_TOKEN_BYTES: usize = 16;
/// File descriptors kept for everything but API connections (plugin sockets, store files, the
/// runtime) when the connection cap is fitted to the process's limit.
const RESERVED_FDS: u64 = 128;
/// How much of a new connection's first bytes is looked at for a complete request head.
const PEEK_BYTES: usize = 4096;
/// The pool of connections without a complete request head holds a quarter of
/// `max_connections`, and at least this many.
const MIN_PENDING: usize = 16;
/// Pause after a failed accept (EMFILE, ENFILE, ENOBUFS, ...) before the next try.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(100);
/// At most one warning per this long about refused connections, and one about failed accepts.
const WARN_EVERY: Duration = Duration::from_secs(10);

/// The bounds each listener enforces; the defaults are those documented in
/// docs/configuration.md.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Open connections per listener; more are answered 503 and closed at once.
    pub max_connections: usize,
    /// From accepting a connection, or from the first byte of a later request, to the end of
    /// its head.
    pub header_timeout: Duration,
    /// A connection with no request in flight and no traffic for this long is closed.
    pub idle_timeout: Duration,
    /// From the end of a request head to the end of its body.
    pub body_timeout: Duration,
    /// The one route whose body is streamed to its handler instead of read whole here (an
    /// image archive), with its own size bound; `None`: every body is JSON, small.
    pub upload: Option<Upload>,
}

/// A route taking a large, non-JSON body, streamed: [`guard`] checks its declared length and
/// its `Content-Type` and leaves the reading (and the bound on what is actually sent, and on
/// each wait for more) to the handler.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Upload {
    /// `POST` to exactly this path.
    pub path: &'static str,
    pub content_type: &'static str,
    pub max_bytes: u64,
    /// The flag that sets `max_bytes`, for the 413's message.
    pub flag: &'static str,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_connections: 1024,
            header_timeout: Duration::from_secs(10),
            idle_timeout: Duration::from_secs(60),
            body_timeout: Duration::from_secs(30),
            upload: None,
        }
    }
}

impl Limits {
    /// The defaults, with what the flags or the config file set.
    pub fn new(
        max_connections: Option<NonZeroUsize>,
        header_timeout_ms: Option<NonZeroU64>,
        idle_timeout_ms: Option<NonZeroU64>,
        body_timeout_ms: Option<NonZeroU64>,
    ) -> Self {
        let default = Self::default();
        let ms =
            |v: Option<NonZeroU64>, d: Duration| v.map_or(d, |v| Duration::from_millis(v.get()));
        Self {
            max_connections: max_connections.map_or(default.max_connections, NonZeroUsize::get),
            header_timeout: ms(header_timeout_ms, default.header_timeout),
            idle_timeout: ms(idle_timeout_ms, default.idle_timeout),
            body_timeout: ms(body_timeout_ms, default.body_timeout),
            upload: None,
        }
    }

    /// Makes room for `listeners × max_connections` descriptors: raises the soft `RLIMIT_NOFILE`
    /// as far as needed (up to the hard limit), and lowers the cap, loudly, when even the hard
    /// limit is too low. A process out of descriptors can accept nothing on any listener.
    pub fn fit_fd_limit(&mut self, listeners: usize) {
        let listeners = listeners.max(1) as u64;
        let per_listener = (self.max_connections + self.max_pending()) as u64;
        let needed = per_listener
            .saturating_mul(listeners)
            .saturating_add(RESERVED_FDS);
        let usable = raise_open_file_limit(needed);
        if usable < needed {
            // A quarter more for the pool of connections without a request head.
            let fit = (usable.saturating_sub(RESERVED_FDS) / listeners * 4 / 5).max(1);
            tracing::warn!(
                max_connections = self.max_connections,
                lowered_to = fit,
                open_file_limit = usable,
                "the open file limit is too low for --max-connections on every listener: \
                 lowering the connection cap; raise the limit (LimitNOFILE=, ulimit -n) instead"
            );
            self.max_connections = usize::try_from(fit).unwrap_or(1);
        }
    }
}

impl Limits {
    /// How many connections without a complete request head a listener keeps at once
    /// (a quarter of `max_connections`, at least [`MIN_PENDING`]).
    pub fn max_pending(&self) -> usize {
        (self.max_connections / 4).max(MIN_PENDING)
    }
}

/// Raises the soft `RLIMIT_NOFILE` to `needed` descriptors, or as far as the hard limit allows,
/// and returns the soft limit in force afterwards (which may still be below `needed`; the
/// caller decides what that means). Never lowers it.
pub fn raise_open_file_limit(needed: u64) -> u64 {
    use rustix::process::{Resource, Rlimit, getrlimit, setrlimit};
    let limit = getrlimit(Resource::Nofile);
    let soft = limit.current.unwrap_or(u64::MAX);
    let hard = limit.maximum.unwrap_or(u64::MAX);
    if soft >= needed || hard <= soft {
        return soft;
    }
    let target = needed.min(hard);
    match setrlimit(
        Resource::Nofile,
        Rlimit {
            current: Some(target),
            maximum: limit.maximum,
        },
    ) {
        Ok(()) => {
            tracing::info!(from = soft, to = target, "raised the open file limit");
            target
        }
        Err(err) => {
            tracing::warn!(error = %err, soft, "cannot raise the open file limit");
            soft
        }
    }
}

/// Refuses `--listen` on an address other than loopback unless `allow_insecure`: the listener
/// speaks plain HTTP, so the token and volume secrets would cross the network in the clear.
pub fn check_listen_address(addr: SocketAddr, allow_insecure: bool) -> anyhow::Result<()> {
    if addr.ip().to_canonical().is_loopback() || allow_insecure {
        return Ok(());
    }
    bail!(
        "--listen {addr} is not a loopback address: csi-agentd has no TLS, so the bearer token \
         and volume secrets would cross the network in the clear; listen on 127.0.0.1 or ::1 and \
         put a TLS proxy or an SSH tunnel in front, or pass --allow-insecure-listen to accept the risk"
    )
}

/// The bearer token from `path`, refused when the file is readable by group or others or the
/// token is shorter than [`MIN_TOKEN_BYTES`]. Surrounding whitespace is not part of the token.
pub fn read_token(path: &Path) -> anyhow::Result<String> {
    let shown = path.display();
    let mode = std::fs::metadata(path)
        .with_context(|| format!("cannot read the token file {shown}"))?
        .permissions()
        .mode();
    if mode & 0o077 != 0 {
        bail!(
            "token file {shown} is readable by group or others (mode {:04o}): anyone who can \
             read it can publish volumes; run `chmod 600 {shown}`",
            mode & 0o7777
        );
    }
    let token = std::fs::read_to_string(path)
        .with_context(|| format!("cannot read the token file {shown}"))?
        .trim()
        .to_owned();
    if token.is_empty() {
        bail!("token file {shown} is empty: put the bearer token in it");
    }
    if token.len() < MIN_TOKEN_BYTES {
        bail!(
            "the token in {shown} is {} bytes long; at least {MIN_TOKEN_BYTES} are required \
             (e.g. `head -c 32 /dev/urandom | base64 > {shown}`)",
            token.len()
        );
    }
    Ok(token)
}

/// Binds a unix socket of the daemon (the API's, or the volume plugin protocol's: `flag`
/// names its option, `--api-socket` or `--volume-plugin-socket`) at `path`, created with mode 0600 (no window in which it is
/// more open). Only a stale socket (a socket nobody accepts on) is replaced; a live socket or
/// any other file (regular file, directory, symlink: never followed) is refused and left alone.
pub async fn bind_unix(path: &Path, flag: &str) -> anyhow::Result<UnixListener> {
    let what = if flag == "--api-socket" {
        "API"
    } else {
        "volume plugin"
    };
    let shown = path.display();
    match std::fs::symlink_metadata(path) {
        Err(err) if err.kind() == io::ErrorKind::NotFound => {}
        Err(err) => {
            return Err(err)
                .with_context(|| format!("cannot inspect the {what} socket path {shown}"));
        }
        Ok(meta) if meta.file_type().is_socket() => {
            let probe = tokio::time::timeout(
                Duration::from_secs(2),
                tokio::net::UnixStream::connect(path),
            )
            .await;
            match probe {
                Ok(Err(err)) if err.kind() == io::ErrorKind::ConnectionRefused => {
                    tracing::info!(socket = %shown, "replacing a stale {what} socket");
                    std::fs::remove_file(path).with_context(|| {
                        format!("cannot remove the stale {what} socket {shown}")
                    })?;
                }
                Ok(Ok(_)) => bail!(
                    "another process is serving on the {what} socket {shown} (is another csi-agentd \
                     running with this work dir?); stop it, or give this daemon another {flag}"
                ),
                Ok(Err(err)) => bail!(
                    "{shown} is a unix socket that may be in use (connecting to it failed: {err}); \
                     csi-agentd only replaces a socket that refuses connections: remove it if it is \
                     stale, or give another {flag}"
                ),
                Err(_) => bail!(
                    "{shown} is a unix socket that accepts no connection within 2 s, so it may be \
                     in use; remove it if it is stale, or give another {flag}"
                ),
            }
        }
        Ok(meta) => {
            let kind = if meta.file_type().is_symlink() {
                "a symbolic link"
            } else if meta.is_dir() {
                "a directory"
            } else if meta.is_file() {
                "a regular file"
            } else {
                "a special file"
            };
            bail!(
                "refusing to use {flag} {shown}: it is {kind}, not a unix socket, and \
                 csi-agentd only replaces a stale socket; move it away or choose another path"
            );
        }
    }
    // Bound and listening under a temporary name, then renamed into place: `bind(2)` creates
    // the file before `listen(2)` makes it accept, and a client that waits for the file (as
    // orchestrators and the tests do) and connects in between is refused. Seen under load.
    let staged = staging_name(path);
    let bind_at = staged.as_deref().unwrap_or(path);
    if staged.is_some() {
        let _ = std::fs::remove_file(bind_at);
    }
    use rustix::fs::Mode;
    let previous = rustix::process::umask(Mode::from_raw_mode(0o177));
    let bound = UnixListener::bind(bind_at);
    rustix::process::umask(previous);
    let listener = bound.with_context(|| format!("cannot listen on {shown}"))?;
    let mode = std::fs::symlink_metadata(bind_at)
        .with_context(|| format!("cannot inspect the new {what} socket {shown}"))?
        .permissions()
        .mode()
        & 0o777;
    if mode != 0o600 {
        let _ = std::fs::remove_file(bind_at);
        bail!("the {what} socket {shown} has mode {mode:04o}, not 0600");
    }
    if let Some(staged) = &staged
        && let Err(err) = std::fs::rename(staged, path)
    {
        let _ = std::fs::remove_file(staged);
        return Err(err)
            .with_context(|| format!("cannot move the {what} socket into place at {shown}"));
    }
    Ok(listener)
}

/// `<dir>/.<name>.<pid>`, when it fits a unix socket address (107 bytes); `None`: bind in place.
fn staging_name(path: &Path) -> Option<std::path::PathBuf> {
    use std::os::unix::ffi::OsStrExt;
    let name = path.file_name()?;
    let mut staged = std::ffi::OsString::from(".");
    staged.push(name);
    staged.push(format!(".{}", std::process::id()));
    let staged = path.with_file_name(staged);
    (staged.as_os_str().as_bytes().len() <= 107).then_some(staged)
}

/// A source of connections; one implementation per kind of listener.
pub trait Accept: Send + 'static {
    type Io: AsyncRead + AsyncWrite + Unpin + Send + 'static;
    fn accept(&mut self) -> impl Future<Output = io::Result<Self::Io>> + Send;
    /// True when a complete request head already waits on `io` (looked at, not taken).
    fn head_buffered(_io: &Self::Io) -> bool {
        false
    }
}

/// Whether the socket's receive queue already holds a whole request head (the first
/// [`PEEK_BYTES`] of it are looked at without being taken).
fn head_buffered(fd: std::os::fd::BorrowedFd<'_>) -> bool {
    let mut buf = [0u8; PEEK_BYTES];
    match rustix::net::recv(
        fd,
        &mut buf[..],
        rustix::net::RecvFlags::PEEK | rustix::net::RecvFlags::DONTWAIT,
    ) {
        Ok((got, _)) => buf[..got.min(PEEK_BYTES)]
            .windows(4)
            .any(|w| w == b"\r\n\r\n"),
        Err(_) => false,
    }
}

impl Accept for UnixListener {
    type Io = tokio::net::UnixStream;
    async fn accept(&mut self) -> io::Result<Self::Io> {
        UnixListener::accept(self).await.map(|(io, _)| io)
    }
    fn head_buffered(io: &Self::Io) -> bool {
        use std::os::fd::AsFd;
        head_buffered(io.as_fd())
    }
}

impl Accept for TcpListener {
    type Io = tokio::net::TcpStream;
    async fn accept(&mut self) -> io::Result<Self::Io> {
        let (io, _) = TcpListener::accept(self).await?;
        let _ = io.set_nodelay(true);
        Ok(io)
    }
    fn head_buffered(io: &Self::Io) -> bool {
        use std::os::fd::AsFd;
        head_buffered(io.as_fd())
    }
}

/// Pending connections the kernel may queue for the TCP listener before `accept`.
///
/// tokio's `TcpListener::bind` asks for 128; a scheduler that opens a few hundred connections at
/// once then overflows the queue, and each dropped SYN costs its client a one-second
/// retransmission (`TcpExtListenOverflows` counted them in `api_abuse`'s TCP flood). The kernel
/// caps this at `net.core.somaxconn` (4096 by default since Linux 5.4), as for the socket.
const TCP_BACKLOG: u32 = 4096;

/// Binds the TCP listener on `addr` with [`TCP_BACKLOG`] and `SO_REUSEADDR` (so that a restart
/// does not wait out `TIME_WAIT` connections of the previous run).
pub fn bind_tcp(addr: SocketAddr) -> io::Result<TcpListener> {
    let socket = match addr {
        SocketAddr::V4(_) => tokio::net::TcpSocket::new_v4()?,
        SocketAddr::V6(_) => tokio::net::TcpSocket::new_v6()?,
    };
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    socket.listen(TCP_BACKLOG)
}

/// Counts occurrences of one problem and says when to log them: the first at once, then at
/// most once per [`WARN_EVERY`], so that a flood cannot flood the log too.
#[derive(Debug, Default)]
struct Throttled {
    last: Option<Instant>,
    unlogged: u64,
}

impl Throttled {
    /// One more occurrence; `Some(count since the last log)` when it is time to log.
    fn hit(&mut self) -> Option<u64> {
        self.unlogged += 1;
        let now = Instant::now();
        if self.last.is_some_and(|last| now < last + WARN_EVERY) {
            return None;
        }
        self.last = Some(now);
        Some(std::mem::take(&mut self.unlogged))
    }
}

/// Serves `app` on `listener` until `shutdown` turns true, then lets the requests in flight
/// finish. Accept errors (EMFILE, ...) never end it: they are logged (at most every
/// [`WARN_EVERY`]) and retried after a short pause.
pub async fn serve<A: Accept>(
    mut listener: A,
    name: &'static str,
    app: Router,
    limits: Limits,
    mut shutdown: watch::Receiver<bool>,
) {
    let slots = Arc::new(Semaphore::new(limits.max_connections));
    let pending = Arc::new(Pending::new(limits.max_pending()));
    let mut connections = JoinSet::new();
    let mut accept_errors = Throttled::default();
    let mut evicted = Throttled::default();
    loop {
        while connections.try_join_next().is_some() {}
        let accepted = tokio::select! {
            _ = shutdown.wait_for(|stop| *stop) => break,
            accepted = listener.accept() => accepted,
        };
        let io = match accepted {
            Ok(io) => io,
            Err(err) => {
                if let Some(count) = accept_errors.hit() {
                    tracing::warn!(
                        listener = name,
                        error = %err,
                        count,
                        "cannot accept connections; retrying after {ACCEPT_BACKOFF:?} each time \
                         (logged at most every {WARN_EVERY:?})"
                    );
                }
                if !matches!(
                    err.kind(),
                    io::ErrorKind::ConnectionAborted
                        | io::ErrorKind::ConnectionReset
                        | io::ErrorKind::Interrupted
                ) {
                    tokio::select! {
                        _ = shutdown.wait_for(|stop| *stop) => break,
                        () = tokio::time::sleep(ACCEPT_BACKOFF) => {}
                    }
                }
                continue;
            }
        };
        // A client that sent its whole head with the connect (and under a flood of accepts,
        // every prompt client has by the time it is accepted) skips the pool: it is never
        // the oldest there, whatever the rate of new connections.
        let (ticket, made_room) = if A::head_buffered(&io) {
            (None, false)
        } else {
            let (ticket, made_room) = pending.admit();
            (Some(ticket), made_room)
        };
        if made_room && let Some(count) = evicted.hit() {
            tracing::warn!(
                listener = name,
                max_pending = limits.max_pending(),
                closed = count,
                "connection cap reached for connections without a complete request head: the \
                 oldest is answered 503 and closed for each new one (logged at most every \
                 {WARN_EVERY:?})"
            );
        }
        let admission = Arc::new(Admission {
            ticket: Mutex::new(ticket),
            slot: Mutex::new(None),
            slots: slots.clone(),
            max_connections: limits.max_connections,
        });
        connections.spawn(connection(
            io,
            app.clone(),
            limits,
            admission,
            shutdown.clone(),
        ));
    }
    drop(listener);
    while connections.join_next().await.is_some() {}
}

/// The error shape's body of a 503 for a connection refused for want of room.
fn unavailable_body(message: String) -> String {
    let body = api::ErrorBody {
        code: api::ErrorCode::Unavailable,
        message,
        grpc_code: None,
    };
    serde_json::to_string(&body).unwrap_or_default()
}

/// A complete HTTP response in the error shape, written on a connection closed to make room
/// for newer ones before it sent a complete request head.
fn made_room_response(max_pending: usize) -> Vec<u8> {
    let body = unavailable_body(format!(
        "csi-agentd closed this connection: it had not sent a complete request head while \
         more than {max_pending} such connections were open on this listener; send the request \
         at once after connecting, and retry"
    ));
    format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n\
         content-length: {}\r\nretry-after: 1\r\nconnection: close\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

/// The 503 for a request on a connection that found every slot taken.
fn over_capacity(max: usize) -> Response {
    let body = unavailable_body(format!(
        "csi-agentd already serves {max} connections on this listener (--max-connections); \
         retry shortly"
    ));
    let mut response = (
        StatusCode::SERVICE_UNAVAILABLE,
        [
            (header::CONTENT_TYPE, "application/json"),
            (header::RETRY_AFTER, "1"),
            (header::CONNECTION, "close"),
        ],
        body,
    )
        .into_response();
    *response.status_mut() = StatusCode::SERVICE_UNAVAILABLE;
    response
}

/// The connections of one listener that have not yet sent a complete request head, oldest
/// first. Full, the oldest is told to go for each new one: a client that sends its head at
/// once is served before it is the oldest, whatever the number of connections that never do.
#[derive(Debug)]
struct Pending {
    cap: usize,
    waiting: Mutex<PendingQueue>,
}

#[derive(Debug, Default)]
struct PendingQueue {
    next: u64,
    by_age: BTreeMap<u64, Arc<Notify>>,
}

impl Pending {
    fn new(cap: usize) -> Self {
        Self {
            cap: cap.max(1),
            waiting: Mutex::new(PendingQueue::default()),
        }
    }

    /// Adds a new connection; true when the oldest had to go to make room.
    fn admit(self: &Arc<Self>) -> (Ticket, bool) {
        let mut queue = self.waiting.lock().unwrap_or_else(PoisonError::into_inner);
        let mut made_room = false;
        while queue.by_age.len() >= self.cap {
            let Some((_, oldest)) = queue.by_age.pop_first() else {
                break;
            };
            // Stored if the connection is not waiting for it yet: never lost.
            oldest.notify_one();
            made_room = true;
        }
        let seq = queue.next;
        queue.next += 1;
        let evicted = Arc::new(Notify::new());
        queue.by_age.insert(seq, evicted.clone());
        (
            Ticket {
                pool: self.clone(),
                seq,
                evicted,
            },
            made_room,
        )
    }
}

/// A connection's place in [`Pending`]; dropping it leaves.
#[derive(Debug)]
struct Ticket {
    pool: Arc<Pending>,
    seq: u64,
    evicted: Arc<Notify>,
}

impl Ticket {
    /// Leaves the pool; false when the connection was told to go meanwhile.
    fn leave(&self) -> bool {
        let mut queue = self
            .pool
            .waiting
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        queue.by_age.remove(&self.seq).is_some()
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        self.leave();
    }
}

/// Where a connection stands: in the pending pool (with its ticket) until its first request
/// head is complete, then holding one of the listener's slots.
#[derive(Debug)]
struct Admission {
    ticket: Mutex<Option<Ticket>>,
    slot: Mutex<Option<OwnedSemaphorePermit>>,
    slots: Arc<Semaphore>,
    max_connections: usize,
}

impl Admission {
    /// For each request: the first one moves the connection from the pending pool to a slot.
    /// False when there is no slot (or the connection was told to go meanwhile).
    fn admit_request(&self) -> bool {
        let mut slot = self.slot.lock().unwrap_or_else(PoisonError::into_inner);
        if slot.is_some() {
            return true;
        }
        let ticket = self
            .ticket
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        if ticket.is_some_and(|t| !t.leave()) {
            return false;
        }
        match self.slots.clone().try_acquire_owned() {
            Ok(permit) => {
                *slot = Some(permit);
                true
            }
            Err(_) => false,
        }
    }

    /// Told to go while still without a request, if it is.
    fn evicted(&self) -> Option<Arc<Notify>> {
        self.ticket
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .as_ref()
            .map(|t| t.evicted.clone())
    }
}

/// One connection, from accept to close: in the pending pool until its first request, then
/// holding its slot.
async fn connection<I>(
    io: I,
    app: Router,
    limits: Limits,
    admission: Arc<Admission>,
    mut shutdown: watch::Receiver<bool>,
) where
    I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let activity = Arc::new(Activity::new());
    let evicted = admission.evicted();
    let service = Tracked {
        app,
        activity: activity.clone(),
        admission,
    };
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        // The watchdog below enforces the header and idle timeouts; hyper's own timer (which
        // starts when a connection goes idle) is only a backstop behind both.
        .header_read_timeout(limits.header_timeout + limits.idle_timeout)
        .max_buf_size(READ_BUFFER_BYTES)
        .keep_alive(true);
    let mut conn = builder.serve_connection(
        TokioIo::new(Watched {
            inner: io,
            activity: activity.clone(),
        }),
        service,
    );
    let mut stopping = false;
    let mut pending = evicted.is_some();
    loop {
        let changed = activity.changed.notified();
        let deadline = activity.deadline(&limits);
        let mut make_room = false;
        let told_to_go = async {
            match &evicted {
                Some(evicted) => evicted.notified().await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            () = told_to_go, if pending => {
                pending = false;
                make_room = matches!(activity.phase(), Phase::Head(_));
            }
            done = Pin::new(&mut conn) => {
                if let Err(err) = done {
                    tracing::debug!(error = %err, "API connection ended with an error");
                }
                return;
            }
            () = changed => {}
            () = sleep_until(deadline) => {
                if activity.deadline(&limits).is_some_and(|d| d <= Instant::now()) {
                    tracing::debug!(phase = ?activity.phase(), "closing an API connection that timed out");
                    return;
                }
            }
            _ = shutdown.wait_for(|stop| *stop), if !stopping => {
                stopping = true;
                if matches!(activity.phase(), Phase::Head(_)) {
                    // No request yet: nothing to finish.
                    return;
                }
                Pin::new(&mut conn).graceful_shutdown();
            }
        }
        if make_room {
            // Told to go with still no request: answer 503 on the bare connection, close it.
            let mut io = conn.into_parts().io.into_inner().inner;
            let answer = made_room_response(limits.max_pending());
            let _ = tokio::time::timeout(
                Duration::from_millis(100),
                tokio::io::AsyncWriteExt::write_all(&mut io, &answer),
            )
            .await;
            return;
        }
    }
}

async fn sleep_until(deadline: Option<Instant>) {
    match deadline {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// Where a connection is in its request cycle, for the header and idle timeouts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    /// Waiting for the rest of a request head, since then.
    Head(Instant),
    /// This many requests are being served (their bodies read, their handlers running).
    Busy(usize),
    /// Nothing in flight; the last traffic was then.
    Idle(Instant),
}

#[derive(Debug)]
struct Activity {
    phase: Mutex<Phase>,
    changed: Notify,
}

impl Activity {
    fn new() -> Self {
        Self {
            phase: Mutex::new(Phase::Head(Instant::now())),
            changed: Notify::new(),
        }
    }

    fn phase(&self) -> Phase {
        *self.phase.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn update(&self, f: impl FnOnce(Phase) -> Phase) {
        let mut phase = self.phase.lock().unwrap_or_else(PoisonError::into_inner);
        let before = *phase;
        *phase = f(before);
        let wake = matches!(
            (before, *phase),
            (Phase::Idle(_), Phase::Head(_)) | (Phase::Busy(_), Phase::Idle(_))
        );
        drop(phase);
        if wake {
            self.changed.notify_one();
        }
    }

    fn deadline(&self, limits: &Limits) -> Option<Instant> {
        match self.phase() {
            Phase::Head(since) => Some(since + limits.header_timeout),
            Phase::Idle(since) => Some(since + limits.idle_timeout),
            Phase::Busy(_) => None,
        }
    }

    fn on_read(&self) {
        self.update(|phase| match phase {
            Phase::Idle(_) => Phase::Head(Instant::now()),
            other => other,
        });
    }

    fn on_write(&self) {
        self.update(|phase| match phase {
            Phase::Idle(_) => Phase::Idle(Instant::now()),
            other => other,
        });
    }

    fn request_started(self: &Arc<Self>) -> InFlight {
        self.update(|phase| match phase {
            Phase::Busy(n) => Phase::Busy(n + 1),
            _ => Phase::Busy(1),
        });
        InFlight(self.clone())
    }
}

/// A request being served; dropping it (done or cancelled) ends it.
struct InFlight(Arc<Activity>);

/// The connection a request came on, in the request's extensions, so that a refused body's
/// drain ([`linger`]) counts as that connection's work.
#[derive(Clone)]
struct ConnectionActivity(Arc<Activity>);

/// A request in flight on the connection of the request with these `extensions`, for work that
/// outlives its handler.
fn still_busy(extensions: &axum::http::Extensions) -> Option<InFlight> {
    extensions
        .get::<ConnectionActivity>()
        .map(|connection| connection.0.request_started())
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.update(|phase| match phase {
            Phase::Busy(n) if n > 1 => Phase::Busy(n - 1),
            _ => Phase::Idle(Instant::now()),
        });
    }
}

/// The connection's I/O, reporting traffic to its [`Activity`].
struct Watched<I> {
    inner: I,
    activity: Arc<Activity>,
}

impl<I: AsyncRead + Unpin> AsyncRead for Watched<I> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut TaskContext<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        let polled = Pin::new(&mut this.inner).poll_read(cx, buf);
        if matches!(polled, Poll::Ready(Ok(()))) && buf.filled().len() > before {
            this.activity.on_read();
        }
        polled
    }
}

impl<I: AsyncWrite + Unpin> AsyncWrite for Watched<I> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut TaskContext<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let polled = Pin::new(&mut this.inner).poll_write(cx, buf);
        if matches!(polled, Poll::Ready(Ok(n)) if n > 0) {
            this.activity.on_write();
        }
        polled
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut TaskContext<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let polled = Pin::new(&mut this.inner).poll_write_vectored(cx, bufs);
        if matches!(polled, Poll::Ready(Ok(n)) if n > 0) {
            this.activity.on_write();
        }
        polled
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut TaskContext<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut TaskContext<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}

/// The router as hyper's service, marking each request in flight while it is served, moving
/// the connection out of the pending pool at its first request, and closing it after a 401.
#[derive(Clone)]
struct Tracked {
    app: Router,
    activity: Arc<Activity>,
    admission: Arc<Admission>,
}

impl hyper::service::Service<hyper::Request<Incoming>> for Tracked {
    type Response = Response;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Response, Infallible>> + Send>>;

    fn call(&self, mut request: hyper::Request<Incoming>) -> Self::Future {
        use tower::ServiceExt;
        let in_flight = self.activity.request_started();
        request
            .extensions_mut()
            .insert(ConnectionActivity(Arc::clone(&self.activity)));
        if !self.admission.admit_request() {
            let refused = over_capacity(self.admission.max_connections);
            return Box::pin(async move {
                drop(in_flight);
                Ok(refused)
            });
        }
        let app = self.app.clone();
        Box::pin(async move {
            let mut response = app.oneshot(request).await;
            if let Ok(response) = &mut response
                && response.status() == StatusCode::UNAUTHORIZED
            {
                // Without the token a connection holds a slot only while it is refused.
                response
                    .headers_mut()
                    .insert(header::CONNECTION, HeaderValue::from_static("close"));
            }
            drop(in_flight);
            response
        })
    }
}

/// Adds the framing checks to every route of `router` (and its fallbacks): the head size, the
/// body's size, type and reading time. Layer the token check outside it, so that it runs first.
pub fn guard(router: Router, limits: &Limits) -> Router {
    router.layer(axum::middleware::from_fn_with_state(*limits, guard_request))
}

/// A refusal in the error shape (`invalid_request`) with a status of the HTTP layer; the
/// connection is closed after it, as the body may be unread.
fn refusal(status: StatusCode, message: impl Into<String>) -> Response {
    let mut response = ApiFailure::invalid(message).into_response();
    *response.status_mut() = status;
    response
        .headers_mut()
        .insert(header::CONNECTION, HeaderValue::from_static("close"));
    response
}

/// The size of the request line and header fields, as sent.
fn head_len(request: &Request) -> usize {
    let line = request.method().as_str().len() + request.uri().to_string().len() + 11;
    request.headers().iter().fold(line, |total, (name, value)| {
        total + name.as_str().len() + value.len() + 4
    })
}

/// `Content-Type` absent (taken as JSON), `application/json`, or a JSON-based type with the
/// `+json` suffix (RFC 6839: Podman sends `application/vnd.docker.plugins.v1.1+json` to the
/// volume plugin socket), with any parameters.
fn is_json(headers: &HeaderMap) -> bool {
    match headers.get(header::CONTENT_TYPE) {
        None => true,
        Some(value) => value
            .to_str()
            .ok()
            .and_then(|v| v.split(';').next())
            .map(|media| media.trim().to_ascii_lowercase())
            .is_some_and(|media| {
                media == "application/json"
                    || media.starts_with("application/") && media.ends_with("+json")
            }),
    }
}

async fn guard_request(State(limits): State<Limits>, request: Request, next: Next) -> Response {
    let body_timeout = limits.body_timeout;
    if head_len(&request) > MAX_HEAD_BYTES {
        return refusal(
            StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
            format!(
                "the request line and header fields exceed {MAX_HEAD_BYTES} bytes; send fewer or \
                 shorter headers"
            ),
        );
    }
    let headers = request.headers();
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    let has_body = match declared {
        Some(len) => len > 0,
        None => headers.contains_key(header::TRANSFER_ENCODING),
    };
    if !has_body {
        return next.run(request).await;
    }
    if let Some(upload) = limits.upload
        && request.method() == axum::http::Method::POST
        && request.uri().path() == upload.path
    {
        return guard_upload(upload, body_timeout, declared, request, next).await;
    }
    if let Some(len) = declared
        && len > MAX_BODY_BYTES as u64
    {
        if len <= MAX_BODY_BYTES as u64 + MAX_DRAIN_BYTES {
            let busy = still_busy(request.extensions());
            linger(request.into_body().into_data_stream(), body_timeout, busy);
        }
        return too_large();
    }
    if !is_json(headers) {
        return refusal(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "request bodies are JSON: send \"Content-Type: application/json\" (or no Content-Type)",
        );
    }
    let (parts, body) = request.into_parts();
    let mut stream = body.into_data_stream();
    let read = tokio::time::timeout(body_timeout, async {
        let mut collected: Vec<u8> = Vec::new();
        while let Some(chunk) = futures::StreamExt::next(&mut stream).await {
            let chunk = chunk?;
            if collected.len() + chunk.len() > MAX_BODY_BYTES {
                return Ok(None);
            }
            collected.extend_from_slice(&chunk);
        }
        Ok::<_, axum::Error>(Some(collected))
    });
    match read.await {
        Ok(Ok(Some(collected))) => {
            let request = Request::from_parts(parts, Body::from(collected));
            next.run(request).await
        }
        Ok(Ok(None)) => {
            linger(stream, body_timeout, still_busy(&parts.extensions));
            too_large()
        }
        Ok(Err(err)) => refusal(
            StatusCode::BAD_REQUEST,
            format!("the request body could not be read: {err}"),
        ),
        Err(_) => refusal(
            StatusCode::REQUEST_TIMEOUT,
            format!(
                "the request body did not arrive within {} ms (--body-timeout-ms)",
                body_timeout.as_millis()
            ),
        ),
    }
}

/// Reads and drops what is left of a refused body in the background, at most
/// [`MAX_DRAIN_BYTES`] and within `timeout`, while the refusal is answered at once (a lingering
/// close): a client sends its whole body before it reads the answer, so one whose connection
/// closed while it still sends would read a broken pipe instead of the refusal. Past the bound
/// (or the time) the connection is closed on it; nothing read is kept either way, and the
/// connection cap bounds how many linger. `busy` keeps the connection's request in flight until
/// then, so that the wait for the next request's head (`--header-timeout-ms`, shorter) does not
/// cut the drain.
fn linger(mut stream: axum::body::BodyDataStream, timeout: Duration, busy: Option<InFlight>) {
    tokio::spawn(async move {
        let _busy = busy;
        let _ = tokio::time::timeout(timeout, async {
            let mut dropped: u64 = 0;
            while dropped <= MAX_DRAIN_BYTES {
                match futures::StreamExt::next(&mut stream).await {
                    Some(Ok(chunk)) => dropped += chunk.len() as u64,
                    _ => break,
                }
            }
        })
        .await;
    });
}

/// The upload route: a body declared too large is refused before a byte of it is read, one of
/// another type too; the rest is streamed to the handler.
async fn guard_upload(
    upload: Upload,
    limits_body_timeout: Duration,
    declared: Option<u64>,
    request: Request,
    next: Next,
) -> Response {
    if declared.is_some_and(|len| len > upload.max_bytes) {
        // A client sends its body before it reads an answer: a body not much over the limit
        // is read and dropped first, so that it reads this answer, not a broken pipe. Past
        // that bound the connection is just closed on it (nothing is kept either way).
        if declared.is_some_and(|len| len <= upload.max_bytes.saturating_add(MAX_DRAIN_BYTES)) {
            let busy = still_busy(request.extensions());
            linger(
                request.into_body().into_data_stream(),
                limits_body_timeout,
                busy,
            );
        }
        return refusal(
            StatusCode::PAYLOAD_TOO_LARGE,
            format!(
                "the request body is declared {} bytes; {} takes at most {} bytes ({})",
                declared.unwrap_or_default(),
                upload.path,
                upload.max_bytes,
                upload.flag
            ),
        );
    }
    let media = request
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split(';').next())
        .map(str::trim);
    if !media.is_some_and(|m| m.eq_ignore_ascii_case(upload.content_type)) {
        return refusal(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            format!(
                "{} takes a tar archive: send \"Content-Type: {}\"",
                upload.path, upload.content_type
            ),
        );
    }
    next.run(request).await
}

fn too_large() -> Response {
    refusal(
        StatusCode::PAYLOAD_TOO_LARGE,
        format!("request bodies are limited to {MAX_BODY_BYTES} bytes"),
    )
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use std::collections::VecDeque;

    use axum::routing::get;
    use tokio::io::{AsyncReadExt, AsyncWriteExt, DuplexStream};

    use super::*;

    /// For a test that holds `needed` descriptors at once: a login's default soft limit is 1024
    /// (issue #30), so it is raised here to the hard limit (not to `needed`: the tests of this
    /// process run at the same time and their needs add up); a hard limit too low to allow it
    /// fails the test with what to change.
    fn need_open_files(needed: u64) {
        let usable = raise_open_file_limit(u64::MAX);
        assert!(
            usable >= needed,
            "this test holds {needed} file descriptors, and the hard open-file limit allows \
             {usable}: raise it (ulimit -Hn {needed})"
        );
    }

    /// Hands out what it was given, then waits forever.
    struct Scripted(VecDeque<io::Result<DuplexStream>>);

    impl Accept for Scripted {
        type Io = DuplexStream;
        async fn accept(&mut self) -> io::Result<DuplexStream> {
            match self.0.pop_front() {
                Some(next) => next,
                None => std::future::pending().await,
            }
        }
    }

    fn app() -> Router {
        Router::new().route("/ping", get(|| async { "pong" }))
    }

    async fn ask(client: &mut DuplexStream) -> String {
        client
            .write_all(b"GET /ping HTTP/1.1\r\nhost: x\r\n\r\n")
            .await
            .unwrap();
        let mut answer = vec![0; 4096];
        let n = tokio::time::timeout(Duration::from_secs(5), client.read(&mut answer))
            .await
            .expect("an answer within 5 s")
            .unwrap();
        String::from_utf8_lossy(&answer[..n]).into_owned()
    }

    #[tokio::test]
    async fn accept_errors_do_not_end_the_listener() {
        let (mut client, server) = tokio::io::duplex(4096);
        let script = Scripted(VecDeque::from([
            Err(io::Error::from_raw_os_error(24)),  // EMFILE
            Err(io::Error::from_raw_os_error(23)),  // ENFILE
            Err(io::Error::from_raw_os_error(103)), // ECONNABORTED
            Ok(server),
        ]));
        let (_stop, stopped) = watch::channel(false);
        let served = tokio::spawn(serve(script, "test", app(), Limits::default(), stopped));
        let answer = ask(&mut client).await;
        assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
        assert!(answer.ends_with("pong"), "{answer}");
        assert!(!served.is_finished());
        served.abort();
    }

    #[tokio::test]
    async fn over_the_cap_is_refused_and_the_holder_keeps_its_connection() {
        let (mut first, first_server) = tokio::io::duplex(4096);
        let (mut second, second_server) = tokio::io::duplex(4096);
        let script = Scripted(VecDeque::from([Ok(first_server), Ok(second_server)]));
        let limits = Limits {
            max_connections: 1,
            ..Limits::default()
        };
        let (stop, stopped) = watch::channel(false);
        let served = tokio::spawn(serve(script, "test", app(), limits, stopped));
        // The first request takes the one slot; the second connection's request finds none.
        let answer = ask(&mut first).await;
        assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
        let refused = ask(&mut second).await;
        assert!(refused.starts_with("HTTP/1.1 503"), "{refused}");
        assert!(refused.contains("\"code\":\"unavailable\""), "{refused}");
        assert!(refused.contains("--max-connections"), "{refused}");
        let mut buf = [0; 16];
        let n = tokio::time::timeout(Duration::from_secs(5), second.read(&mut buf))
            .await
            .expect("the refused connection is closed")
            .unwrap();
        assert_eq!(n, 0);
        let answer = ask(&mut first).await;
        assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
        stop.send(true).unwrap();
        tokio::time::timeout(Duration::from_secs(5), served)
            .await
            .expect("shutdown completes")
            .unwrap();
    }

    /// A burst far above tokio's default backlog of 128 queues in the kernel while nothing
    /// accepts: no SYN is dropped, so no client waits a second for its retransmission, and no
    /// client is left believing it is connected while the daemon never sees it (which happens
    /// when the final ACK meets a full queue and the client then only reads).
    #[test]
    fn the_tcp_listener_queues_a_burst_while_nothing_accepts() {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_io()
            .build()
            .unwrap();
        let listener = runtime
            .block_on(async { bind_tcp("127.0.0.1:0".parse().unwrap()) })
            .unwrap();
        let addr = listener.local_addr().unwrap();
        need_open_files(1000 + RESERVED_FDS);
        let queued: Vec<_> = (0..1000)
            .map(|i| {
                std::net::TcpStream::connect_timeout(&addr, Duration::from_millis(500))
                    .unwrap_or_else(|e| panic!("connection {i} not queued within 500 ms: {e}"))
            })
            .collect();
        assert_eq!(queued.len(), 1000);
    }

    /// On real TCP sockets: a burst of partial heads far over the pool for connections
    /// without a request. The oldest are answered 503 in the error shape as newer ones arrive
    /// (none is closed without an answer), the newest stay open, a connection holding a slot
    /// keeps it, and a new client that sends its request at once is served in the middle of
    /// it all; no connect is dropped by an overflowing accept queue (a dropped SYN would stall
    /// its `connect` for a second).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn partial_heads_over_the_pool_make_room_and_a_new_request_is_served() {
        const BURST: usize = 600;
        // Both ends of every connection are in this process.
        need_open_files(2 * BURST as u64 + RESERVED_FDS);
        let listener = bind_tcp("127.0.0.1:0".parse().unwrap()).unwrap();
        let addr = listener.local_addr().unwrap();
        let limits = Limits {
            max_connections: 2,
            ..Limits::default()
        };
        let pool = limits.max_pending();
        let (_stop, stopped) = watch::channel(false);
        let served = tokio::spawn(serve(listener, "tcp", app(), limits, stopped));
        let request = b"GET /ping HTTP/1.1\r\nhost: x\r\n\r\n";
        let exchange = |s: &mut std::net::TcpStream| {
            std::io::Write::write_all(s, request).unwrap();
            let mut answer = vec![0; 4096];
            let n = std::io::Read::read(s, &mut answer).unwrap();
            String::from_utf8_lossy(&answer[..n]).into_owned()
        };
        let result = tokio::task::spawn_blocking(move || {
            let mut holder = std::net::TcpStream::connect(addr).unwrap();
            assert!(exchange(&mut holder).starts_with("HTTP/1.1 200"));
            let started = std::time::Instant::now();
            let burst: Vec<_> = (0..BURST)
                .map(|_| {
                    let mut s = std::net::TcpStream::connect(addr).unwrap();
                    let _ = std::io::Write::write_all(&mut s, b"GET /ping HTTP/1.1\r\nhost: ");
                    s
                })
                .collect();
            let connected_in = started.elapsed();
            let mut fresh = std::net::TcpStream::connect(addr).unwrap();
            fresh
                .set_read_timeout(Some(Duration::from_secs(5)))
                .unwrap();
            let fresh_answer = exchange(&mut fresh);
            let answers: Vec<String> = burst
                .into_iter()
                .map(|mut s| {
                    s.set_read_timeout(Some(Duration::from_millis(300)))
                        .unwrap();
                    let mut answer = String::new();
                    let _ = std::io::Read::read_to_string(&mut s, &mut answer);
                    answer
                })
                .collect();
            let holder_again = exchange(&mut holder);
            (connected_in, fresh_answer, answers, holder_again)
        });
        let (connected_in, fresh_answer, answers, holder_again) = result.await.unwrap();
        assert!(fresh_answer.starts_with("HTTP/1.1 200"), "{fresh_answer}");
        assert!(holder_again.starts_with("HTTP/1.1 200"), "{holder_again}");
        // All but the newest `pool` (the fresh one among them) were made room for.
        let made_room = &answers[..BURST - pool];
        let unanswered = made_room
            .iter()
            .filter(|a| !a.starts_with("HTTP/1.1 503"))
            .count();
        assert_eq!(
            unanswered,
            0,
            "{:?}",
            made_room.iter().find(|a| !a.starts_with("HTTP/1.1 503"))
        );
        assert!(
            made_room[0].contains("\"code\":\"unavailable\""),
            "{}",
            made_room[0]
        );
        assert!(
            answers[BURST - pool + 1..].iter().all(String::is_empty),
            "the newest partial heads are still waiting"
        );
        assert!(
            connected_in < Duration::from_secs(1),
            "{BURST} connects took {connected_in:?}"
        );
        served.abort();
    }

    #[tokio::test]
    async fn a_silent_connection_is_closed_after_the_header_timeout() {
        let (mut client, server) = tokio::io::duplex(4096);
        let script = Scripted(VecDeque::from([Ok(server)]));
        let limits = Limits {
            header_timeout: Duration::from_millis(200),
            ..Limits::default()
        };
        let (_stop, stopped) = watch::channel(false);
        let served = tokio::spawn(serve(script, "test", app(), limits, stopped));
        client.write_all(b"GET /ping HTTP/1.1\r\n").await.unwrap();
        let started = std::time::Instant::now();
        let n = tokio::time::timeout(Duration::from_secs(5), client.read(&mut [0; 16]))
            .await
            .expect("closed within 5 s")
            .unwrap();
        assert_eq!(n, 0);
        assert!(started.elapsed() >= Duration::from_millis(150));
        served.abort();
    }

    /// A body refused by its declared size is drained after the answer; the drain may take
    /// longer than the header timeout (a slow sender, a loaded machine) and must not be cut by
    /// it, or the client, still sending, reads a broken pipe instead of the 413.
    #[tokio::test]
    async fn a_refused_body_is_drained_past_the_header_timeout() {
        let (mut client, server) = tokio::io::duplex(64 * 1024);
        let script = Scripted(VecDeque::from([Ok(server)]));
        let limits = Limits {
            header_timeout: Duration::from_millis(200),
            ..Limits::default()
        };
        let (_stop, stopped) = watch::channel(false);
        let app = guard(
            Router::new().route("/echo", axum::routing::post(|| async { "never" })),
            &limits,
        );
        let served = tokio::spawn(serve(script, "test", app, limits, stopped));
        let length = MAX_BODY_BYTES + 256 * 1024;
        let head = format!(
            "POST /echo HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n\
             content-length: {length}\r\n\r\n"
        );
        client.write_all(head.as_bytes()).await.unwrap();
        // The body in ten slices over ~1 s: five times the header timeout.
        let slice = vec![b' '; length / 10];
        for _ in 0..10 {
            tokio::time::sleep(Duration::from_millis(100)).await;
            client
                .write_all(&slice)
                .await
                .expect("the connection stays open while the refused body drains");
        }
        let mut answer = Vec::new();
        let _ = tokio::time::timeout(Duration::from_secs(5), client.read_to_end(&mut answer))
            .await
            .expect("closed within 5 s");
        let answer = String::from_utf8_lossy(&answer);
        assert!(answer.starts_with("HTTP/1.1 413"), "{answer}");
        served.abort();
    }

    #[test]
    fn repeated_warnings_are_throttled() {
        let mut throttled = Throttled::default();
        assert_eq!(throttled.hit(), Some(1));
        assert_eq!(throttled.hit(), None);
        assert_eq!(throttled.hit(), None);
        throttled.last = Some(Instant::now() - WARN_EVERY);
        assert_eq!(throttled.hit(), Some(3));
    }

    #[test]
    fn content_types() {
        let with = |v: &str| {
            let mut h = HeaderMap::new();
            h.insert(header::CONTENT_TYPE, HeaderValue::from_str(v).unwrap());
            is_json(&h)
        };
        assert!(is_json(&HeaderMap::new()));
        assert!(with("application/json"));
        assert!(with("Application/JSON; charset=utf-8"));
        assert!(!with("text/plain"));
        assert!(!with("application/x-www-form-urlencoded"));
        assert!(!with("application/jsonx"));
    }

    #[test]
    fn listen_addresses() {
        assert!(check_listen_address("127.0.0.1:1".parse().unwrap(), false).is_ok());
        assert!(check_listen_address("[::1]:1".parse().unwrap(), false).is_ok());
        assert!(check_listen_address("[::ffff:127.0.0.1]:1".parse().unwrap(), false).is_ok());
        let err = check_listen_address("0.0.0.0:1".parse().unwrap(), false).unwrap_err();
        assert!(err.to_string().contains("--allow-insecure-listen"), "{err}");
        assert!(check_listen_address("[::]:1".parse().unwrap(), false).is_err());
        assert!(check_listen_address("0.0.0.0:1".parse().unwrap(), true).is_ok());
    }
}
