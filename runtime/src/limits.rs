//! Transport limits every kvlease server shares: one set of flags
//! ([`ServeLimits`]) and the pieces that enforce them: a connection gate
//! ([`Gate`]: a cap on open connections, caps on connections that have not
//! proven themselves yet, overall and per peer address, a deadline for a new
//! connection to prove itself, an idle deadline), the layer that tells a gRPC
//! server's gate about authenticated calls ([`CallLayer`]) and a status
//! fix-up layer ([`StatusLayer`]) so that what tonic itself refuses answers
//! with the codes the protocol documents.
//!
//! Every server's gate ([`ServeLimits::call_gate`]) is proven by calls, not
//! bytes. On a gRPC server only an authenticated call counts: an HTTP/2
//! connection that does nothing but answer PINGs (or a TLS connection
//! without a client certificate) stays evictable, is closed at the
//! handshake deadline, and its PINGs never reset the idle deadline (issue 29,
//! finding 1). On the gateway's HTTP server its middleware reports each
//! request whose headers arrived whole (before its bearer token is checked),
//! so a client trickling header lines stays evictable (issue 29, finding 2). A byte gate ([`ServeLimits::gate`]),
//! proven by a connection's first byte, is used by no server now.
//!
//! The gRPC settings (HTTP/2 keepalive, concurrent streams) are applied by
//! [`crate::serve::serve`]; the gateway's HTTP server uses the [`Gate`]
//! alone. Transport security belongs next to these.

use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::task::{Context, Poll, ready};
use std::time::Duration;

use http::HeaderValue;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::oneshot;
use tokio::time::{Instant, Sleep};

/// Default cap on open connections per server.
pub const DEFAULT_MAX_CONNECTIONS: usize = 1024;
/// Default cap on connections that have not proven themselves yet.
pub const DEFAULT_MAX_PENDING_HANDSHAKES: usize = 128;
/// Default cap on connections from one peer address that have not proven
/// themselves yet.
pub const DEFAULT_MAX_PENDING_PER_PEER: usize = 64;
/// Default time a new connection has to prove itself with its first call, in
/// milliseconds.
pub const DEFAULT_HANDSHAKE_TIMEOUT_MS: u64 = 10_000;
/// Default time a proven connection may stay without a call, in milliseconds
/// (HTTP/2 keepalive pings do not count: only calls keep a connection).
pub const DEFAULT_IDLE_TIMEOUT_MS: u64 = 300_000;
/// Default interval of HTTP/2 keepalive pings, in milliseconds.
pub const DEFAULT_KEEPALIVE_INTERVAL_MS: u64 = 30_000;
/// Default time a keepalive ping may wait for its answer, in milliseconds.
pub const DEFAULT_KEEPALIVE_TIMEOUT_MS: u64 = 20_000;
/// Default cap on concurrent HTTP/2 streams (calls) per connection.
pub const DEFAULT_MAX_CONCURRENT_STREAMS: u32 = 256;

/// The transport limits of one server; flags with environment fallbacks,
/// shared by every service binary (`#[command(flatten)]`).
#[derive(Clone, Debug, PartialEq, Eq, clap::Args)]
pub struct ServeLimits {
    /// Most open connections; a connection over it evicts the oldest one that
    /// has not proven itself yet (gRPC: made an authenticated call; HTTP: sent
    /// a request's headers whole), or is closed at once.
    #[arg(long, env = "KVLEASE_MAX_CONNECTIONS", default_value_t = DEFAULT_MAX_CONNECTIONS)]
    pub max_connections: usize,
    /// Most connections that have not proven themselves yet; over it the
    /// oldest of them is closed, so idle or PING-only sockets cannot crowd
    /// out real clients.
    #[arg(long, env = "KVLEASE_MAX_PENDING_HANDSHAKES", default_value_t = DEFAULT_MAX_PENDING_HANDSHAKES)]
    pub max_pending_handshakes: usize,
    /// Most connections from one peer address that have not proven
    /// themselves yet; over it that peer's oldest one is closed, so one
    /// address churning connections evicts only its own.
    #[arg(long, env = "KVLEASE_MAX_PENDING_PER_PEER", default_value_t = DEFAULT_MAX_PENDING_PER_PEER)]
    pub max_pending_per_peer: usize,
    /// Milliseconds a new connection has to prove itself (gRPC: its first
    /// authenticated call; HTTP: its first request's headers, whole); bytes
    /// and HTTP/2 PINGs before that do not count.
    #[arg(long, env = "KVLEASE_HANDSHAKE_TIMEOUT_MS", default_value_t = DEFAULT_HANDSHAKE_TIMEOUT_MS)]
    pub handshake_timeout_ms: u64,
    /// Milliseconds a proven connection may stay idle, counted from when its
    /// last call (gRPC) or request (HTTP) began or ended; one in flight keeps
    /// it open. Bytes, HTTP/2 PINGs included, do not count.
    #[arg(long, env = "KVLEASE_IDLE_TIMEOUT_MS", default_value_t = DEFAULT_IDLE_TIMEOUT_MS)]
    pub idle_timeout_ms: u64,
    /// Milliseconds between HTTP/2 keepalive pings (gRPC servers): they find
    /// peers that stopped answering, and keep no connection from going idle.
    #[arg(long, env = "KVLEASE_KEEPALIVE_INTERVAL_MS", default_value_t = DEFAULT_KEEPALIVE_INTERVAL_MS)]
    pub keepalive_interval_ms: u64,
    /// Milliseconds a keepalive ping waits for its answer before the
    /// connection is closed.
    #[arg(long, env = "KVLEASE_KEEPALIVE_TIMEOUT_MS", default_value_t = DEFAULT_KEEPALIVE_TIMEOUT_MS)]
    pub keepalive_timeout_ms: u64,
    /// Most concurrent HTTP/2 streams (calls) per connection.
    #[arg(long, env = "KVLEASE_MAX_CONCURRENT_STREAMS", default_value_t = DEFAULT_MAX_CONCURRENT_STREAMS)]
    pub max_concurrent_streams: u32,
}

impl Default for ServeLimits {
    fn default() -> Self {
        Self {
            max_connections: DEFAULT_MAX_CONNECTIONS,
            max_pending_handshakes: DEFAULT_MAX_PENDING_HANDSHAKES,
            max_pending_per_peer: DEFAULT_MAX_PENDING_PER_PEER,
            handshake_timeout_ms: DEFAULT_HANDSHAKE_TIMEOUT_MS,
            idle_timeout_ms: DEFAULT_IDLE_TIMEOUT_MS,
            keepalive_interval_ms: DEFAULT_KEEPALIVE_INTERVAL_MS,
            keepalive_timeout_ms: DEFAULT_KEEPALIVE_TIMEOUT_MS,
            max_concurrent_streams: DEFAULT_MAX_CONCURRENT_STREAMS,
        }
    }
}

impl ServeLimits {
    /// Checks values clap cannot.
    pub fn validate(&self) -> Result<(), String> {
        if self.max_connections == 0 {
            return Err("--max-connections must be at least 1".into());
        }
        if self.max_pending_handshakes == 0 {
            return Err("--max-pending-handshakes must be at least 1".into());
        }
        if self.max_pending_per_peer == 0 {
            return Err("--max-pending-per-peer must be at least 1".into());
        }
        if self.handshake_timeout_ms == 0 {
            return Err("--handshake-timeout-ms must be at least 1".into());
        }
        if self.max_concurrent_streams == 0 {
            return Err("--max-concurrent-streams must be at least 1".into());
        }
        if self.keepalive_interval_ms == 0 || self.keepalive_timeout_ms == 0 {
            return Err(
                "--keepalive-interval-ms and --keepalive-timeout-ms must be at least 1".into(),
            );
        }
        if self.idle_timeout_ms <= self.keepalive_interval_ms {
            return Err(format!(
                "--idle-timeout-ms ({}) must exceed --keepalive-interval-ms ({})",
                self.idle_timeout_ms, self.keepalive_interval_ms
            ));
        }
        Ok(())
    }

    /// The HTTP/2 keepalive ping interval.
    pub fn keepalive_interval(&self) -> Duration {
        Duration::from_millis(self.keepalive_interval_ms)
    }

    /// How long a keepalive ping waits for its answer.
    pub fn keepalive_timeout(&self) -> Duration {
        Duration::from_millis(self.keepalive_timeout_ms)
    }

    /// A gate enforcing these connection limits, where a connection proves
    /// itself by sending its first byte and any byte read or written keeps
    /// it from going idle.
    pub fn gate(&self) -> Gate {
        self.gate_proven_by(false)
    }

    /// A gate enforcing these connection limits, where a connection proves
    /// itself only by an authenticated call ([`CallLayer`] tells it) and
    /// only calls keep it from going idle (every gRPC server, and the
    /// gateway's HTTP server, whose requests count as calls).
    pub fn call_gate(&self) -> Gate {
        self.gate_proven_by(true)
    }

    fn gate_proven_by(&self, calls: bool) -> Gate {
        Gate {
            inner: Arc::new(GateInner {
                by_calls: calls,
                conns: Mutex::new(HashMap::new()),
                max_per_peer: self.max_pending_per_peer.max(1),
                max_connections: self.max_connections.max(1),
                max_pending: self.max_pending_handshakes.max(1),
                handshake_timeout: Duration::from_millis(self.handshake_timeout_ms),
                idle_timeout: Duration::from_millis(self.idle_timeout_ms),
                open: AtomicUsize::new(0),
                pending: Mutex::new(VecDeque::new()),
                refused: AtomicUsize::new(0),
                evicted: AtomicUsize::new(0),
            }),
        }
    }
}

// === connection gate ===

/// Admits connections under the limits; see [`ServeLimits`].
#[derive(Debug, Clone)]
pub struct Gate {
    inner: Arc<GateInner>,
}

#[derive(Debug)]
struct GateInner {
    /// Whether only authenticated calls prove a connection and keep it from
    /// going idle ([`ServeLimits::call_gate`]); otherwise bytes do.
    by_calls: bool,
    max_connections: usize,
    max_pending: usize,
    max_per_peer: usize,
    handshake_timeout: Duration,
    idle_timeout: Duration,
    open: AtomicUsize,
    /// Connections that have not proven themselves yet, oldest first:
    /// sending on (or dropping) the sender closes that connection.
    pending: Mutex<VecDeque<Pending>>,
    /// The open connections by peer address, for [`CallLayer`] to find the
    /// connection a call came on (call gates only).
    conns: Mutex<HashMap<SocketAddr, Weak<Conn>>>,
    refused: AtomicUsize,
    evicted: AtomicUsize,
}

/// One connection waiting to prove itself.
#[derive(Debug)]
struct Pending {
    conn: Arc<Conn>,
    evict: oneshot::Sender<()>,
}

impl Pending {
    /// Whether it no longer waits: it proved itself, or it is gone.
    fn settled(&self) -> bool {
        self.evict.is_closed() || self.conn.proven.load(Ordering::Acquire)
    }
}

/// What the gate knows of one open connection.
#[derive(Debug)]
struct Conn {
    peer: Option<IpAddr>,
    /// Set by the first authenticated call (call gates only).
    proven: AtomicBool,
    /// Calls in flight (call gates only).
    calls: AtomicUsize,
    /// When the last call began or ended (call gates only).
    last_call: Mutex<Instant>,
}

impl GateInner {
    /// Closes the oldest connection still waiting to prove itself, of `peer`
    /// when given; false when there is none.
    fn evict_oldest_pending(&self, peer: Option<IpAddr>) -> bool {
        let mut pending = self.pending.lock().unwrap_or_else(|p| p.into_inner());
        let mut i = 0;
        while i < pending.len() {
            if pending[i].settled() {
                pending.remove(i);
                continue;
            }
            if peer.is_some() && pending[i].conn.peer != peer {
                i += 1;
                continue;
            }
            if let Some(p) = pending.remove(i) {
                let _ = p.evict.send(());
                self.evicted.fetch_add(1, Ordering::Relaxed);
                return true;
            }
        }
        false
    }

    /// Connections waiting to prove themselves, and how many of them come
    /// from `peer`.
    fn pending_len(&self, peer: Option<IpAddr>) -> (usize, usize) {
        let mut pending = self.pending.lock().unwrap_or_else(|p| p.into_inner());
        pending.retain(|p| !p.settled());
        let of_peer = match peer {
            Some(_) => pending.iter().filter(|p| p.conn.peer == peer).count(),
            None => 0,
        };
        (pending.len(), of_peer)
    }
}

/// Figures of a [`Gate`], for logs and tests.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GateStats {
    /// Connections open now.
    pub open: usize,
    /// Open connections that have not proven themselves yet.
    pub pending: usize,
    /// Connections closed at once because every slot was taken by proven
    /// connections.
    pub refused: usize,
    /// Unproven connections closed to make room for newer ones.
    pub evicted: usize,
}

impl Gate {
    /// Admits `io` from an unknown peer; see [`admit_from`](Self::admit_from).
    pub fn admit<IO>(&self, io: IO) -> Option<Guarded<IO>> {
        self.admit_from(io, None)
    }

    /// Admits `io` from `peer`, or returns `None` (and `io` is dropped,
    /// closing it) when the server is full of proven connections. A
    /// connection over a cap first evicts the oldest unproven one: of its own
    /// peer over the per-peer cap, of anyone over the others.
    pub fn admit_from<IO>(&self, io: IO, peer: Option<SocketAddr>) -> Option<Guarded<IO>> {
        let inner = &self.inner;
        let open = inner.open.fetch_add(1, Ordering::AcqRel) + 1;
        if open > inner.max_connections && !inner.evict_oldest_pending(None) {
            inner.open.fetch_sub(1, Ordering::AcqRel);
            let refused = inner.refused.fetch_add(1, Ordering::Relaxed) + 1;
            if refused.is_power_of_two() {
                tracing::warn!(
                    max_connections = inner.max_connections,
                    refused,
                    "connection refused: every connection slot is taken"
                );
            }
            return None;
        }
        let ip = peer.map(|p| p.ip());
        if ip.is_some() && inner.pending_len(ip).1 >= inner.max_per_peer {
            inner.evict_oldest_pending(ip);
        }
        let now = Instant::now();
        let conn = Arc::new(Conn {
            peer: ip,
            proven: AtomicBool::new(false),
            calls: AtomicUsize::new(0),
            last_call: Mutex::new(now),
        });
        let (tx, rx) = oneshot::channel();
        let over = {
            let mut pending = inner.pending.lock().unwrap_or_else(|p| p.into_inner());
            pending.push_back(Pending {
                conn: Arc::clone(&conn),
                evict: tx,
            });
            if pending.len() > 2 * inner.max_pending {
                pending.retain(|p| !p.settled());
            }
            pending.len() > inner.max_pending
        };
        if over && inner.pending_len(None).0 > inner.max_pending {
            inner.evict_oldest_pending(None);
        }
        let addr = peer.filter(|_| inner.by_calls);
        if let Some(addr) = addr {
            let mut conns = inner.conns.lock().unwrap_or_else(|p| p.into_inner());
            conns.insert(addr, Arc::downgrade(&conn));
        }
        Some(Guarded {
            io,
            gate: Arc::clone(inner),
            conn,
            addr,
            evict: Some(rx),
            deadline: Box::pin(tokio::time::sleep_until(now + inner.handshake_timeout)),
        })
    }

    /// Tells the gate that an authenticated call began on the connection
    /// from `peer`: the connection is proven, and not idle until the
    /// returned guard is dropped (with the call's response). `None` for a
    /// byte gate or a peer it does not know.
    pub fn call_began(&self, peer: SocketAddr) -> Option<CallGuard> {
        if !self.inner.by_calls {
            return None;
        }
        let conn = {
            let conns = self.inner.conns.lock().unwrap_or_else(|p| p.into_inner());
            conns.get(&peer).and_then(Weak::upgrade)?
        };
        conn.proven.store(true, Ordering::Release);
        conn.calls.fetch_add(1, Ordering::AcqRel);
        *conn.last_call.lock().unwrap_or_else(|p| p.into_inner()) = Instant::now();
        Some(CallGuard { conn })
    }

    /// What the gate has seen.
    pub fn stats(&self) -> GateStats {
        GateStats {
            open: self.inner.open.load(Ordering::Acquire),
            pending: self.inner.pending_len(None).0,
            refused: self.inner.refused.load(Ordering::Relaxed),
            evicted: self.inner.evicted.load(Ordering::Relaxed),
        }
    }
}

/// One call in flight on a connection of a call gate; see [`Gate::call_began`].
#[derive(Debug)]
pub struct CallGuard {
    conn: Arc<Conn>,
}

impl Drop for CallGuard {
    fn drop(&mut self) {
        *self
            .conn
            .last_call
            .lock()
            .unwrap_or_else(|p| p.into_inner()) = Instant::now();
        self.conn.calls.fetch_sub(1, Ordering::AcqRel);
    }
}

/// A connection admitted by a [`Gate`]: it ends with `TimedOut` when it does
/// not prove itself before the handshake deadline or stays idle past the
/// idle timeout, and with `ConnectionAborted` when a newer connection evicts
/// it while it is still unproven. Its slot is given back when it is dropped.
#[derive(Debug)]
pub struct Guarded<IO> {
    io: IO,
    gate: Arc<GateInner>,
    conn: Arc<Conn>,
    /// Its key in the gate's map of connections (call gates only).
    addr: Option<SocketAddr>,
    /// Present until the connection proves itself.
    evict: Option<oneshot::Receiver<()>>,
    deadline: Pin<Box<Sleep>>,
}

impl<IO> Guarded<IO> {
    /// The wrapped connection.
    pub fn get_ref(&self) -> &IO {
        &self.io
    }

    /// Pushes the idle deadline forward after traffic (byte gates).
    fn active(&mut self) {
        self.deadline
            .as_mut()
            .reset(Instant::now() + self.gate.idle_timeout);
    }

    /// The error ending the connection if its deadline passed or it was
    /// evicted; registers for both otherwise.
    fn expired(&mut self, cx: &mut Context<'_>) -> Option<io::Error> {
        if self.gate.by_calls && self.evict.is_some() && self.conn.proven.load(Ordering::Acquire) {
            // Its first authenticated call: out of the queue, idle from now.
            self.evict = None;
            self.active();
        }
        if let Some(rx) = self.evict.as_mut()
            && Pin::new(rx).poll(cx).is_ready()
        {
            return Some(io::Error::new(
                io::ErrorKind::ConnectionAborted,
                "connection closed: it had not proven itself and newer connections needed the slot",
            ));
        }
        while self.deadline.as_mut().poll(cx).is_ready() {
            if self.evict.is_some() {
                let what = if self.gate.by_calls {
                    "connection closed: no authenticated call before the handshake timeout"
                } else {
                    "connection closed: nothing received before the handshake timeout"
                };
                return Some(io::Error::new(io::ErrorKind::TimedOut, what));
            }
            let next = self
                .gate
                .by_calls
                .then(|| self.next_idle_deadline())
                .flatten();
            match next {
                // a call in flight or one that ended lately: not idle yet
                Some(next) => self.deadline.as_mut().reset(next),
                None => {
                    return Some(io::Error::new(
                        io::ErrorKind::TimedOut,
                        "connection closed: idle past the idle timeout",
                    ));
                }
            }
        }
        None
    }

    /// When a call gate's connection goes idle next, if not now: its last
    /// call plus the idle timeout, or a full idle timeout from now while a
    /// call is in flight.
    fn next_idle_deadline(&self) -> Option<Instant> {
        let now = Instant::now();
        if self.conn.calls.load(Ordering::Acquire) > 0 {
            return Some(now + self.gate.idle_timeout);
        }
        let last = *self
            .conn
            .last_call
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        let next = last + self.gate.idle_timeout;
        (next > now).then_some(next)
    }
}

impl<IO> Drop for Guarded<IO> {
    fn drop(&mut self) {
        if let Some(addr) = self.addr {
            let mut conns = self.gate.conns.lock().unwrap_or_else(|p| p.into_inner());
            // the address may already name a newer connection (port reuse)
            if conns
                .get(&addr)
                .is_some_and(|w| std::ptr::eq(w.as_ptr(), Arc::as_ptr(&self.conn)))
            {
                conns.remove(&addr);
            }
        }
        self.gate.open.fetch_sub(1, Ordering::AcqRel);
    }
}

impl<IO: AsyncRead + Unpin> AsyncRead for Guarded<IO> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        // On a call gate bytes prove nothing: a peer that always has bytes
        // waiting (PINGs, a flood) must meet its deadlines all the same.
        if this.gate.by_calls
            && let Some(e) = this.expired(cx)
        {
            return Poll::Ready(Err(e));
        }
        let before = buf.filled().len();
        match Pin::new(&mut this.io).poll_read(cx, buf) {
            Poll::Ready(Ok(())) => {
                if buf.filled().len() > before && !this.gate.by_calls {
                    // It spoke: no longer evictable, idle deadline from now.
                    this.evict = None;
                    this.active();
                }
                Poll::Ready(Ok(()))
            }
            Poll::Ready(Err(e)) => Poll::Ready(Err(e)),
            Poll::Pending => match this.expired(cx) {
                Some(e) => Poll::Ready(Err(e)),
                None => Poll::Pending,
            },
        }
    }
}

impl<IO: AsyncWrite + Unpin> AsyncWrite for Guarded<IO> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let n = ready!(Pin::new(&mut this.io).poll_write(cx, buf))?;
        if n > 0 && this.evict.is_none() && !this.gate.by_calls {
            this.active();
        }
        Poll::Ready(Ok(n))
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let n = ready!(Pin::new(&mut this.io).poll_write_vectored(cx, bufs))?;
        if n > 0 && this.evict.is_none() && !this.gate.by_calls {
            this.active();
        }
        Poll::Ready(Ok(n))
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }
}

impl<IO: tonic::transport::server::Connected> tonic::transport::server::Connected for Guarded<IO> {
    type ConnectInfo = IO::ConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.io.connect_info()
    }
}

// === calls ===

/// Tells a call gate ([`ServeLimits::call_gate`]) about every call that
/// reaches it: put it inside the authorization layer, so that only
/// authenticated calls prove a connection and keep it from going idle.
#[derive(Debug, Clone)]
pub struct CallLayer {
    gate: Gate,
}

impl CallLayer {
    /// A layer reporting to `gate`.
    pub fn new(gate: Gate) -> Self {
        Self { gate }
    }
}

impl<S> tower::Layer<S> for CallLayer {
    type Service = CallService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        CallService {
            inner,
            gate: self.gate.clone(),
        }
    }
}

/// The service [`CallLayer`] wraps.
#[derive(Debug, Clone)]
pub struct CallService<S> {
    inner: S,
    gate: Gate,
}

/// The peer address of a request as tonic records it (plaintext or TLS).
fn remote_addr<B>(request: &http::Request<B>) -> Option<SocketAddr> {
    use tonic::transport::server::{TcpConnectInfo, TlsConnectInfo};
    let ext = request.extensions();
    match ext.get::<TlsConnectInfo<TcpConnectInfo>>() {
        Some(tls) => tls.get_ref().remote_addr(),
        None => ext.get::<TcpConnectInfo>().and_then(|t| t.remote_addr()),
    }
}

impl<S, B> tower::Service<http::Request<B>> for CallService<S>
where
    S: tower::Service<http::Request<B>, Response = http::Response<tonic::body::Body>>,
    S::Future: Send + 'static,
{
    type Response = http::Response<tonic::body::Body>;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Self::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<B>) -> Self::Future {
        let guard = remote_addr(&request).and_then(|addr| self.gate.call_began(addr));
        let fut = self.inner.call(request);
        Box::pin(async move {
            let response = fut.await?;
            Ok(match guard {
                // the call lasts as long as its response body (a stream)
                Some(guard) => response.map(|body| tonic::body::Body::new(guard.hold(body))),
                None => response,
            })
        })
    }
}

/// A response body holding its call's [`CallGuard`] until it is dropped, so
/// that a streaming answer keeps its connection from going idle.
#[derive(Debug)]
pub struct CallBody<B> {
    inner: B,
    _guard: CallGuard,
}

impl CallGuard {
    /// `body`, holding this guard until it is dropped.
    pub fn hold<B>(self, body: B) -> CallBody<B> {
        CallBody {
            inner: body,
            _guard: self,
        }
    }
}

impl<B: http_body::Body + Unpin> http_body::Body for CallBody<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
        Pin::new(&mut self.get_mut().inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

// === status fix-up ===

/// Rewrites the codes tonic gives to what the protocol documents, in
/// trailers-only answers (the form a refused request gets):
/// - a request over the message size limit: OUT_OF_RANGE becomes
///   RESOURCE_EXHAUSTED (gRPC's code for "a limit was hit");
/// - a request that does not decode (bad wire format, invalid UTF-8 in a
///   string): INTERNAL becomes INVALID_ARGUMENT (the caller's fault, not the
///   server's).
#[derive(Debug, Clone, Copy, Default)]
pub struct StatusLayer;

impl<S> tower::Layer<S> for StatusLayer {
    type Service = StatusService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        StatusService { inner }
    }
}

/// The service [`StatusLayer`] wraps.
#[derive(Debug, Clone)]
pub struct StatusService<S> {
    inner: S,
}

impl<S, B, R> tower::Service<http::Request<B>> for StatusService<S>
where
    S: tower::Service<http::Request<B>, Response = http::Response<R>>,
    S::Future: Send + 'static,
{
    type Response = http::Response<R>;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Self::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<B>) -> Self::Future {
        let fut = self.inner.call(request);
        Box::pin(async move {
            let mut response = fut.await?;
            fix_status(response.headers_mut());
            Ok(response)
        })
    }
}

/// The rewrite of [`StatusLayer`] on one response's headers.
pub fn fix_status(headers: &mut http::HeaderMap) {
    let code = headers
        .get("grpc-status")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<i32>().ok());
    let message = headers
        .get("grpc-message")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default();
    let fixed = match code {
        // tonic: "Error, decoded message length too large: found N bytes, the limit is: M bytes"
        Some(OUT_OF_RANGE)
            if message.contains("message%20length%20too%20large")
                || message.contains("message length too large") =>
        {
            Some(RESOURCE_EXHAUSTED)
        }
        // tonic-prost maps every prost DecodeError to INTERNAL
        Some(INTERNAL)
            if message.starts_with("failed%20to%20decode")
                || message.starts_with("failed to decode") =>
        {
            Some(INVALID_ARGUMENT)
        }
        _ => None,
    };
    if let Some(code) = fixed {
        headers.insert("grpc-status", HeaderValue::from(code));
    }
}

const INVALID_ARGUMENT: i32 = 3;
const RESOURCE_EXHAUSTED: i32 = 8;
const OUT_OF_RANGE: i32 = 11;
const INTERNAL: i32 = 13;

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(code: &str, message: &str) -> http::HeaderMap {
        let mut h = http::HeaderMap::new();
        h.insert("grpc-status", HeaderValue::from_str(code).unwrap());
        h.insert("grpc-message", HeaderValue::from_str(message).unwrap());
        h
    }

    #[test]
    fn oversized_requests_become_resource_exhausted() {
        let mut h = headers(
            "11",
            "Error,%20decoded%20message%20length%20too%20large:%20found%2099%20bytes",
        );
        fix_status(&mut h);
        assert_eq!(h["grpc-status"], "8");
    }

    #[test]
    fn undecodable_requests_become_invalid_argument() {
        let mut h = headers(
            "13",
            "failed%20to%20decode%20Protobuf%20message:%20invalid%20string",
        );
        fix_status(&mut h);
        assert_eq!(h["grpc-status"], "3");
    }

    #[test]
    fn other_statuses_are_left_alone() {
        for (code, message) in [
            ("13", "step loop gone"),
            ("11", "after_id beyond"),
            ("0", ""),
        ] {
            let mut h = headers(code, message);
            fix_status(&mut h);
            assert_eq!(h["grpc-status"], code);
        }
    }

    #[test]
    fn defaults_validate_and_bad_values_are_named() {
        assert_eq!(ServeLimits::default().validate(), Ok(()));
        let bad = ServeLimits {
            idle_timeout_ms: 1_000,
            ..ServeLimits::default()
        };
        assert!(bad.validate().unwrap_err().contains("--idle-timeout-ms"));
    }

    #[tokio::test(start_paused = true)]
    async fn a_silent_connection_is_closed_at_the_handshake_deadline() {
        use tokio::io::AsyncReadExt as _;
        let gate = ServeLimits {
            handshake_timeout_ms: 500,
            ..ServeLimits::default()
        }
        .gate();
        let (server, _client) = tokio::io::duplex(64);
        let mut conn = gate.admit(server).unwrap();
        assert_eq!(gate.stats().open, 1);
        let err = conn.read_u8().await.unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::TimedOut);
        drop(conn);
        assert_eq!(gate.stats().open, 0);
    }

    #[tokio::test(start_paused = true)]
    async fn silent_connections_over_the_cap_evict_the_oldest_and_talkers_are_kept() {
        use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
        let gate = ServeLimits {
            max_connections: 3,
            max_pending_handshakes: 2,
            ..ServeLimits::default()
        }
        .gate();
        // one connection that speaks: never evicted
        let (talker, mut talker_peer) = tokio::io::duplex(64);
        let mut talker = gate.admit(talker).unwrap();
        talker_peer.write_all(b"x").await.unwrap();
        assert_eq!(talker.read_u8().await.unwrap(), b'x');
        // two silent ones fill the pending cap; a third evicts the oldest
        let (a, _pa) = tokio::io::duplex(64);
        let mut a = gate.admit(a).unwrap();
        let (b, _pb) = tokio::io::duplex(64);
        let _b = gate.admit(b).unwrap();
        let (c, _pc) = tokio::io::duplex(64);
        let _c = gate.admit(c).unwrap();
        let err = a.read_u8().await.unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::ConnectionAborted);
        drop(a);
        assert_eq!(gate.stats().evicted, 1);
        // the cap (3) is full of one talker and two silent ones: a new one
        // evicts another silent one rather than being refused
        let (d, _pd) = tokio::io::duplex(64);
        assert!(gate.admit(d).is_some());
        assert_eq!(gate.stats().refused, 0);
        assert_eq!(gate.stats().evicted, 2);
    }

    #[tokio::test(start_paused = true)]
    async fn on_a_call_gate_bytes_prove_nothing_and_pings_do_not_keep_a_connection() {
        use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
        let gate = ServeLimits {
            max_connections: 2,
            handshake_timeout_ms: 500,
            idle_timeout_ms: 60_000,
            ..ServeLimits::default()
        }
        .call_gate();
        let addr = |port| SocketAddr::from(([10, 0, 0, 1], port));
        // a talker that never calls: still evictable
        let (pinger, mut pinger_peer) = tokio::io::duplex(64);
        let mut pinger = gate.admit_from(pinger, Some(addr(1))).unwrap();
        pinger_peer.write_all(b"PING").await.unwrap();
        pinger.read_exact(&mut [0; 4]).await.unwrap();
        assert_eq!(gate.stats().pending, 1);
        // a caller: proven by its call, kept while it runs
        let (caller, mut caller_peer) = tokio::io::duplex(64);
        let mut caller = gate.admit_from(caller, Some(addr(2))).unwrap();
        let call = gate.call_began(addr(2)).unwrap();
        assert_eq!(gate.stats().pending, 1);
        // the cap is full: a newcomer evicts the pinger, not the caller
        let (late, _p) = tokio::io::duplex(64);
        let _late = gate.admit_from(late, Some(addr(3))).unwrap();
        let err = pinger.read_u8().await.unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::ConnectionAborted);
        // a call in flight keeps the caller past the idle timeout
        let read = tokio::spawn(async move {
            loop {
                if let Err(e) = caller.read_u8().await {
                    return (e, tokio::time::Instant::now());
                }
            }
        });
        tokio::time::sleep(Duration::from_secs(120)).await;
        assert!(!read.is_finished());
        drop(call);
        let ended = tokio::time::Instant::now();
        // pings after the call do not reset the idle deadline
        for _ in 0..20 {
            // fails once the gate closed it
            let _ = caller_peer.write_all(b"P").await;
            tokio::time::sleep(Duration::from_secs(5)).await;
        }
        let (err, at) = read.await.unwrap();
        assert_eq!(err.kind(), io::ErrorKind::TimedOut);
        // closed one idle timeout after its call ended, pings or not
        assert!(at - ended >= Duration::from_secs(60), "{:?}", at - ended);
        assert!(at - ended < Duration::from_secs(61), "{:?}", at - ended);
    }

    #[tokio::test(start_paused = true)]
    async fn on_a_call_gate_a_pinger_is_closed_at_the_handshake_deadline() {
        use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
        let gate = ServeLimits {
            handshake_timeout_ms: 500,
            ..ServeLimits::default()
        }
        .call_gate();
        let (pinger, mut peer) = tokio::io::duplex(64);
        let mut pinger = gate
            .admit_from(pinger, Some(SocketAddr::from(([10, 0, 0, 1], 1))))
            .unwrap();
        let start = tokio::time::Instant::now();
        let mut buf = [0; 1];
        let err = loop {
            peer.write_all(b"P").await.unwrap();
            match tokio::time::timeout(Duration::from_millis(100), pinger.read_exact(&mut buf))
                .await
            {
                Ok(Ok(_)) => tokio::time::sleep(Duration::from_millis(100)).await,
                Ok(Err(e)) => break e,
                Err(_) => {}
            }
        };
        assert_eq!(err.kind(), io::ErrorKind::TimedOut);
        assert!(
            start.elapsed() < Duration::from_secs(1),
            "{:?}",
            start.elapsed()
        );
    }

    #[tokio::test(start_paused = true)]
    async fn one_peer_over_its_cap_evicts_only_its_own() {
        use tokio::io::AsyncReadExt as _;
        let gate = ServeLimits {
            max_pending_per_peer: 2,
            ..ServeLimits::default()
        }
        .gate();
        let from = |ip: [u8; 4], port| Some(SocketAddr::from((ip, port)));
        let (other, _po) = tokio::io::duplex(64);
        let mut other = gate.admit_from(other, from([10, 0, 0, 9], 1)).unwrap();
        let (a, _pa) = tokio::io::duplex(64);
        let mut a = gate.admit_from(a, from([10, 0, 0, 1], 1)).unwrap();
        let (b, _pb) = tokio::io::duplex(64);
        let _b = gate.admit_from(b, from([10, 0, 0, 1], 2)).unwrap();
        let (c, _pc) = tokio::io::duplex(64);
        let _c = gate.admit_from(c, from([10, 0, 0, 1], 3)).unwrap();
        let err = a.read_u8().await.unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::ConnectionAborted);
        assert_eq!(gate.stats().evicted, 1);
        // the other peer's connection, older than all, was left alone
        assert!(
            tokio::time::timeout(Duration::from_millis(100), other.read_u8())
                .await
                .is_err()
        );
        assert_eq!(gate.stats().pending, 3);
    }

    #[tokio::test(start_paused = true)]
    async fn a_server_full_of_talkers_refuses_new_connections() {
        use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
        let gate = ServeLimits {
            max_connections: 1,
            ..ServeLimits::default()
        }
        .gate();
        let (talker, mut peer) = tokio::io::duplex(64);
        let mut talker = gate.admit(talker).unwrap();
        peer.write_all(b"x").await.unwrap();
        talker.read_u8().await.unwrap();
        let (late, _p) = tokio::io::duplex(64);
        assert!(gate.admit(late).is_none());
        assert_eq!(gate.stats().refused, 1);
        assert_eq!(gate.stats().open, 1);
    }
}
