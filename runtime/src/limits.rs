//! Transport limits every kvlease server shares: one set of flags
//! ([`ServeLimits`]) and the pieces that enforce them: a connection gate
//! ([`Gate`]: a cap on open connections, a deadline for a new connection's
//! first bytes, an idle deadline) and a status fix-up layer ([`StatusLayer`])
//! so that what tonic itself refuses answers with the codes the protocol
//! documents.
//!
//! The gRPC settings (HTTP/2 keepalive, concurrent streams, TCP keepalive)
//! are applied by [`crate::serve::serve`]; the gateway's HTTP server uses the
//! [`Gate`] alone. Transport security belongs next to these.

use std::collections::VecDeque;
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, ready};
use std::time::Duration;

use http::HeaderValue;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::oneshot;
use tokio::time::{Instant, Sleep};

/// Default cap on open connections per server.
pub const DEFAULT_MAX_CONNECTIONS: usize = 1024;
/// Default cap on connections that have not sent a byte yet.
pub const DEFAULT_MAX_PENDING_HANDSHAKES: usize = 128;
/// Default time a new connection has to send its first bytes, in milliseconds.
pub const DEFAULT_HANDSHAKE_TIMEOUT_MS: u64 = 10_000;
/// Default time a connection may stay without reading or writing a byte, in
/// milliseconds (HTTP/2 keepalive pings count, so a live peer never hits it).
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
    /// has not sent a byte yet, or is closed at once.
    #[arg(long, env = "KVLEASE_MAX_CONNECTIONS", default_value_t = DEFAULT_MAX_CONNECTIONS)]
    pub max_connections: usize,
    /// Most connections that have not sent a byte yet; over it the oldest of
    /// them is closed, so idle sockets cannot crowd out real clients.
    #[arg(long, env = "KVLEASE_MAX_PENDING_HANDSHAKES", default_value_t = DEFAULT_MAX_PENDING_HANDSHAKES)]
    pub max_pending_handshakes: usize,
    /// Milliseconds a new connection has to send its first bytes.
    #[arg(long, env = "KVLEASE_HANDSHAKE_TIMEOUT_MS", default_value_t = DEFAULT_HANDSHAKE_TIMEOUT_MS)]
    pub handshake_timeout_ms: u64,
    /// Milliseconds a connection may go without reading or writing a byte.
    #[arg(long, env = "KVLEASE_IDLE_TIMEOUT_MS", default_value_t = DEFAULT_IDLE_TIMEOUT_MS)]
    pub idle_timeout_ms: u64,
    /// Milliseconds between HTTP/2 keepalive pings.
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
                "--idle-timeout-ms ({}) must exceed --keepalive-interval-ms ({}): keepalive pings keep live connections from going idle",
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

    /// A gate enforcing these connection limits.
    pub fn gate(&self) -> Gate {
        Gate {
            inner: Arc::new(GateInner {
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
    max_connections: usize,
    max_pending: usize,
    handshake_timeout: Duration,
    idle_timeout: Duration,
    open: AtomicUsize,
    /// Connections that have not sent a byte yet, oldest first: sending on
    /// (or dropping) the sender closes that connection.
    pending: Mutex<VecDeque<oneshot::Sender<()>>>,
    refused: AtomicUsize,
    evicted: AtomicUsize,
}

impl GateInner {
    /// Closes the oldest connection still waiting for its first bytes;
    /// false when there is none.
    fn evict_oldest_pending(&self) -> bool {
        let mut pending = self.pending.lock().unwrap_or_else(|p| p.into_inner());
        while let Some(tx) = pending.pop_front() {
            // A closed receiver is a connection that already spoke or is gone.
            if !tx.is_closed() {
                let _ = tx.send(());
                self.evicted.fetch_add(1, Ordering::Relaxed);
                return true;
            }
        }
        false
    }

    fn pending_len(&self) -> usize {
        let mut pending = self.pending.lock().unwrap_or_else(|p| p.into_inner());
        pending.retain(|tx| !tx.is_closed());
        pending.len()
    }
}

/// Figures of a [`Gate`], for logs and tests.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GateStats {
    /// Connections open now.
    pub open: usize,
    /// Open connections that have not sent a byte yet.
    pub pending: usize,
    /// Connections closed at once because every slot was taken by talking
    /// connections.
    pub refused: usize,
    /// Silent connections closed to make room for newer ones.
    pub evicted: usize,
}

impl Gate {
    /// Admits `io`, or returns `None` (and `io` is dropped, closing it) when
    /// the server is full of connections that have all spoken. A connection
    /// over either cap first evicts the oldest silent one.
    pub fn admit<IO>(&self, io: IO) -> Option<Guarded<IO>> {
        let inner = &self.inner;
        let open = inner.open.fetch_add(1, Ordering::AcqRel) + 1;
        if open > inner.max_connections && !inner.evict_oldest_pending() {
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
        let (tx, rx) = oneshot::channel();
        let over = {
            let mut pending = inner.pending.lock().unwrap_or_else(|p| p.into_inner());
            pending.push_back(tx);
            if pending.len() > 2 * inner.max_pending {
                pending.retain(|tx| !tx.is_closed());
            }
            pending.len() > inner.max_pending
        };
        if over && inner.pending_len() > inner.max_pending {
            inner.evict_oldest_pending();
        }
        let now = Instant::now();
        Some(Guarded {
            io,
            gate: Arc::clone(inner),
            evict: Some(rx),
            deadline: Box::pin(tokio::time::sleep_until(now + inner.handshake_timeout)),
        })
    }

    /// What the gate has seen.
    pub fn stats(&self) -> GateStats {
        GateStats {
            open: self.inner.open.load(Ordering::Acquire),
            pending: self.inner.pending_len(),
            refused: self.inner.refused.load(Ordering::Relaxed),
            evicted: self.inner.evicted.load(Ordering::Relaxed),
        }
    }
}

/// A connection admitted by a [`Gate`]: it ends with `TimedOut` when it
/// sends nothing before the handshake deadline or stays idle past the idle
/// timeout, and with `ConnectionAborted` when a newer connection evicts it
/// while it is still silent. Its slot is given back when it is dropped.
#[derive(Debug)]
pub struct Guarded<IO> {
    io: IO,
    gate: Arc<GateInner>,
    /// Present until the first byte arrives.
    evict: Option<oneshot::Receiver<()>>,
    deadline: Pin<Box<Sleep>>,
}

impl<IO> Guarded<IO> {
    /// The wrapped connection.
    pub fn get_ref(&self) -> &IO {
        &self.io
    }

    /// Pushes the idle deadline forward after traffic.
    fn active(&mut self) {
        self.deadline
            .as_mut()
            .reset(Instant::now() + self.gate.idle_timeout);
    }

    /// The error ending the connection if its deadline passed or it was
    /// evicted; registers for both otherwise.
    fn expired(&mut self, cx: &mut Context<'_>) -> Option<io::Error> {
        if let Some(rx) = self.evict.as_mut()
            && Pin::new(rx).poll(cx).is_ready()
        {
            return Some(io::Error::new(
                io::ErrorKind::ConnectionAborted,
                "connection closed: it sent nothing and newer connections needed the slot",
            ));
        }
        if self.deadline.as_mut().poll(cx).is_ready() {
            let what = if self.evict.is_some() {
                "connection closed: nothing received before the handshake timeout"
            } else {
                "connection closed: idle past the idle timeout"
            };
            return Some(io::Error::new(io::ErrorKind::TimedOut, what));
        }
        None
    }
}

impl<IO> Drop for Guarded<IO> {
    fn drop(&mut self) {
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
        let before = buf.filled().len();
        match Pin::new(&mut this.io).poll_read(cx, buf) {
            Poll::Ready(Ok(())) => {
                if buf.filled().len() > before {
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
        if n > 0 && this.evict.is_none() {
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
        if n > 0 && this.evict.is_none() {
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
