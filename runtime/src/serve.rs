//! What every kvlease server wraps around its one gRPC service: listeners the
//! caller binds (tests bind port 0, so there is no port race), gRPC health and
//! reflection for exactly the service that port serves, the Prometheus
//! endpoint, the server span layer, transport security (mTLS when the
//! service has TLS material) and the authorization layer (`kvlease-auth`),
//! and the stop signal the server's background tasks watch. Connection
//! limits and timeouts belong next to the TLS set-up in [`serve`].
//!
//! It lives in `kvlease-runtime` because every binary needs it and the
//! service crates never depend on each other.

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;

use kvlease_auth::{AuthLayer, Security};
use tokio::net::TcpListener;
use tokio::sync::watch;
use tonic::server::NamedService;

use kvlease_telemetry::GrpcTraceLayer;

use crate::accept::incoming;
use crate::error::{Error, Result};
use crate::limits::{CallLayer, ServeLimits, StatusLayer};

/// The sockets one server serves on, bound before it starts.
#[derive(Debug)]
pub struct Listeners {
    /// The gRPC listener.
    pub grpc: TcpListener,
    /// The Prometheus `GET /metrics` listener; no endpoint when absent.
    pub metrics: Option<TcpListener>,
}

impl From<TcpListener> for Listeners {
    /// gRPC only, no metrics endpoint.
    fn from(grpc: TcpListener) -> Self {
        Self {
            grpc,
            metrics: None,
        }
    }
}

impl Listeners {
    /// Binds the gRPC address and, when given, the metrics address.
    pub async fn bind(grpc: SocketAddr, metrics: Option<SocketAddr>) -> Result<Self> {
        Self::bind_named("grpc", grpc, metrics).await
    }

    /// As [`Listeners::bind`], with the main listener named `what` in a bind
    /// error (the gateway's serves `http`).
    pub async fn bind_named(
        what: &'static str,
        main: SocketAddr,
        metrics: Option<SocketAddr>,
    ) -> Result<Self> {
        let grpc = bind(what, main).await?;
        let metrics = match metrics {
            Some(addr) => Some(bind("metrics", addr).await?),
            None => None,
        };
        Ok(Self { grpc, metrics })
    }

    /// These listeners with `metrics` as the metrics endpoint.
    pub fn with_metrics(self, metrics: TcpListener) -> Self {
        Self {
            metrics: Some(metrics),
            ..self
        }
    }
}

/// Pending-accept queue of every listener. tokio's default (1,024) overflows
/// when a few thousand clients connect at once (a reconnect storm after a
/// restart); the kernel then drops their handshakes and some see their
/// connection reset. The kernel caps it at `net.core.somaxconn`.
const LISTEN_BACKLOG: u32 = 8192;

/// Binds `addr` (with `SO_REUSEADDR`, as `TcpListener::bind` does); the
/// error names what the listener was for and where.
pub async fn bind(what: &'static str, addr: SocketAddr) -> Result<TcpListener> {
    let listen = || {
        let socket = if addr.is_ipv4() {
            tokio::net::TcpSocket::new_v4()?
        } else {
            tokio::net::TcpSocket::new_v6()?
        };
        socket.set_reuseaddr(true)?;
        socket.bind(addr)?;
        socket.listen(LISTEN_BACKLOG)
    };
    listen().map_err(|source| Error::Bind { what, addr, source })
}

// === stop signal ===

/// A server's stop signal: set once, seen by every task that watches it.
#[derive(Debug, Clone)]
pub struct Stop(watch::Sender<bool>);

/// One task's view of a [`Stop`].
#[derive(Debug, Clone)]
pub struct StopWatch(watch::Receiver<bool>);

impl Default for Stop {
    fn default() -> Self {
        Self::new()
    }
}

impl Stop {
    /// A signal not set yet.
    pub fn new() -> Self {
        Self(watch::Sender::new(false))
    }

    /// Sets the signal (again is harmless).
    pub fn stop(&self) {
        self.0.send_replace(true);
    }

    /// A watch on the signal.
    pub fn watch(&self) -> StopWatch {
        StopWatch(self.0.subscribe())
    }

    /// `shutdown`, then this signal set: give it to the gRPC server as its
    /// shutdown, so the server's tasks stop when it starts draining.
    pub fn after(
        &self,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> impl Future<Output = ()> + Send + 'static {
        let stop = self.clone();
        async move {
            shutdown.await;
            stop.stop();
        }
    }
}

impl StopWatch {
    /// Whether the signal is set.
    pub fn is_stopped(&self) -> bool {
        *self.0.borrow()
    }

    /// Resolves once the signal is set (or its [`Stop`] is gone, which means
    /// the same).
    pub async fn stopped(&mut self) {
        let _ = self.0.wait_for(|stop| *stop).await;
    }

    /// The underlying receiver, for a task that selects on `watch` itself.
    pub fn receiver(&self) -> watch::Receiver<bool> {
        self.0.clone()
    }

    /// [`stopped`](Self::stopped) as an owned future, for a task to own.
    pub async fn into_stopped(mut self) {
        self.stopped().await;
    }
}

// === serving ===

/// What one server serves: its logical name in traces, its gRPC service and
/// the descriptor set reflection answers from.
#[derive(Debug, Clone, Copy)]
pub struct ServerInfo {
    /// The logical service, e.g. `"kvlease-cache"` (traces and logs).
    pub name: &'static str,
    /// The encoded `FileDescriptorSet` that holds the service.
    pub descriptors: &'static [u8],
}

/// Serves `service` on `listeners.grpc` with gRPC health (the service
/// SERVING) and reflection (v1 and v1alpha) listing only that service and
/// health, every request in a server span ([`GrpcTraceLayer`]), with
/// tonic's own refusals given the documented codes ([`StatusLayer`]), then
/// authenticated and authorized ([`AuthLayer`]), over mTLS when `security`
/// has TLS material (plaintext only where [`Security::check_listener`]
/// allows it), under the transport limits of `limits` (connection gate
/// proven by authenticated calls, HTTP/2 keepalive, concurrent streams); serves
/// `render_metrics` on `listeners.metrics` when there is one. Returns once
/// `shutdown` resolved and the gRPC server drained, then stops the metrics
/// endpoint.
pub async fn serve<S>(
    info: ServerInfo,
    listeners: Listeners,
    security: &Security,
    limits: &ServeLimits,
    service: S,
    render_metrics: impl Fn() -> String + Send + Sync + 'static,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<()>
where
    S: tower::Service<
            http::Request<tonic::body::Body>,
            Response = http::Response<tonic::body::Body>,
            Error = Infallible,
        > + NamedService
        + Clone
        + Send
        + Sync
        + 'static,
    S::Future: Send + 'static,
{
    if let Ok(addr) = listeners.grpc.local_addr() {
        security.check_listener(info.name, addr)?;
    }
    let mut builder = tonic::transport::Server::builder();
    if let Some(tls) = security.server_tls() {
        builder = builder
            .tls_config(tls)
            .map_err(|e| Error::Security(kvlease_auth::Error::Tls(e)))?;
    }
    let (health_reporter, health) = tonic_health::server::health_reporter();
    health_reporter.set_serving::<S>().await;
    let reflection = || {
        tonic_reflection::server::Builder::configure()
            .register_encoded_file_descriptor_set(info.descriptors)
            .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
            .with_service_name(S::NAME)
            .with_service_name(HEALTH)
            .with_service_name(REFLECTION_V1)
            .with_service_name(REFLECTION_V1ALPHA)
    };
    let reflection_v1 = reflection()
        .build_v1()
        .map_err(|e| Error::Reflection(e.to_string()))?;
    let reflection_v1alpha = reflection()
        .build_v1alpha()
        .map_err(|e| Error::Reflection(e.to_string()))?;

    let metrics_stop = Stop::new();
    let metrics = match listeners.metrics {
        Some(listener) => {
            tracing::info!(service = info.name, addr = ?listener.local_addr().ok(), "metrics serving");
            Some(tokio::spawn(kvlease_telemetry::metrics::serve_metrics(
                listener,
                render_metrics,
                metrics_stop.watch().into_stopped(),
            )))
        }
        None => None,
    };

    let addr = listeners.grpc.local_addr().ok();
    tracing::info!(service = info.name, ?addr, "grpc serving");
    // Only authenticated calls prove a connection: PING-only or
    // certificate-less connections stay evictable (issue 29, finding 1).
    let gate = limits.call_gate();
    let served = builder
        .http2_keepalive_interval(Some(limits.keepalive_interval()))
        .http2_keepalive_timeout(Some(limits.keepalive_timeout()))
        .max_concurrent_streams(limits.max_concurrent_streams)
        .layer(match addr {
            Some(addr) => GrpcTraceLayer::new(info.name).with_instance(addr.to_string()),
            None => GrpcTraceLayer::new(info.name),
        })
        // inside the trace layer, so spans record the corrected code
        .layer(StatusLayer)
        .layer(AuthLayer::new(security.clone()))
        // inside the authorization layer: it sees only authenticated calls
        .layer(CallLayer::new(gate.clone()))
        .add_service(health)
        .add_service(reflection_v1)
        .add_service(reflection_v1alpha)
        .add_service(service)
        .serve_with_incoming_shutdown(incoming(listeners.grpc, gate), shutdown)
        .await;
    metrics_stop.stop();
    if let Some(task) = metrics
        && let Err(e) = task.await
    {
        tracing::error!(service = info.name, error = %e, "metrics endpoint task failed");
    }
    tracing::info!(service = info.name, ?addr, "grpc stopped");
    served.map_err(Error::Serve)
}

/// The services every server adds beside its own, as reflection lists them.
const HEALTH: &str = "grpc.health.v1.Health";
const REFLECTION_V1: &str = "grpc.reflection.v1.ServerReflection";
const REFLECTION_V1ALPHA: &str = "grpc.reflection.v1alpha.ServerReflection";
