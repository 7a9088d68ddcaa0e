//! kvlease's OpenAI-compatible HTTP front: `POST /v1/completions`,
//! `POST /v1/chat/completions` (both with and without `stream: true`),
//! `GET /v1/models`, `GET /health`, for the `openai` package, load
//! generators and anything else that speaks OpenAI's HTTP API.
//!
//! # Why a gateway crate rather than a route in the scheduler
//!
//! The gateway is a gRPC *client* of the scheduler's public `Scheduler` API,
//! like `kvlease generate`: it holds no state, so it scales and restarts
//! apart from the scheduler, and it cannot reach past the API the scheduler
//! offers every client. The scheduler keeps one job (continuous batching on
//! leased blocks) and one protocol; its validation stays the single check
//! of prompts, limits and sampling for both paths, because the gateway only
//! maps the scheduler's `INVALID_ARGUMENT` to 400 with its message. The
//! services' dependency rules hold (the gateway depends on the protocol and
//! the shared auth, telemetry and runtime crates, never on a service crate),
//! and `kvlease up` and compose run it as one more service. The cost, one
//! loopback gRPC hop per request, is measured by the HTTP-vs-gRPC bench
//! (`cargo bench -p kvlease-integration-tests --bench http_vs_grpc`).
//!
//! # Layout
//! - [`config`]: flags with environment fallbacks.
//! - [`openai`]: OpenAI's request and response bodies (serde types).
//! - [`request`]: what kvlease serves of a request, reduced to one
//!   [`request::Generate`]; refusals name the field.
//! - [`structured`]: `response_format` (json_object, json_schema) and the
//!   `kvlease.grammar` extension (lark, regex) into one grammar for the
//!   scheduler, which compiles it (its refusal is a 400 naming the param).
//! - [`convert`]: `Generate` to the scheduler's `GenerateRequest`; its
//!   response stream to [`convert::Piece`]s, rejects to errors with reason
//!   and figures.
//! - [`error`]: [`ApiError`], OpenAI's error shape and the HTTP status of
//!   each scheduler code and reject reason (never a 500).
//! - [`logprobs`]: log-probabilities in the completions' and chat's shapes.
//! - [`service`]: the axum routes, whole answers and server-sent events.
//!
//! Data flows: body -> `openai` type -> `Generate` -> gRPC `Generate` ->
//! pieces -> one JSON answer or SSE chunks, ending `data: [DONE]`.

use std::future::Future;
use std::net::SocketAddr;
use std::time::Duration;

use axum::body::Body;
use axum::extract::{ConnectInfo, Request, State};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::serve::ListenerExt;
use kvlease_runtime::limits::Gate;
use tokio::net::TcpListener;

pub mod config;
pub mod convert;
pub mod error;
pub mod logprobs;
pub mod openai;
pub mod request;
pub mod service;
pub mod structured;

pub use config::Config;
pub use error::ApiError;

/// The name the gateway's spans and messages go by.
pub const SERVICE: &str = "kvlease-gateway";

/// Why the gateway could not run.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("invalid configuration: {0}")]
    Config(String),
    #[error("http server error: {0}")]
    Serve(#[from] std::io::Error),
}

impl kvlease_runtime::process::RunError for Error {
    fn is_config(&self) -> bool {
        matches!(self, Error::Config(_))
    }
}

/// Serves the gateway on `listener` until `shutdown` resolves. The scheduler
/// channel connects lazily: the gateway starts before the scheduler does,
/// and `/health` says 503 until it serves.
pub async fn run(
    listener: TcpListener,
    config: Config,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), Error> {
    config.validate().map_err(Error::Config)?;
    // The gateway calls the scheduler as a principal of its own: over mTLS with its
    // certificate when it has one (role `client`).
    let security = config
        .security
        .load()
        .map_err(|e| Error::Config(e.to_string()))?;
    let channel = security
        .endpoint(
            &config.scheduler_addr,
            Some(kvlease_auth::ServiceKind::Scheduler),
        )
        .map_err(|e| Error::Config(format!("invalid scheduler address: {e}")))?
        .tcp_nodelay(true)
        .connect_lazy();
    let served = request::Served {
        model: config.model.clone(),
        aliases: config.model_aliases.clone(),
        default_max_tokens: config.default_max_tokens,
    };
    // Only a request whose headers arrived whole proves a connection, and
    // only requests keep it from going idle: a client trickling header
    // lines (slowloris) stays evictable and meets the handshake deadline
    // (issue 29, finding 2).
    let gate = config.limits.call_gate();
    let calls = Calls {
        gate: gate.clone(),
        body_timeout: Duration::from_millis(config.body_timeout_ms),
    };
    let app = service::Gateway::new(channel, served)
        .with_tokens(security.tokens().cloned())
        .router()
        .layer(axum::middleware::from_fn_with_state(calls, track_call));
    tracing::info!(listen = %config.listen, scheduler = %config.scheduler_addr,
        model = %config.model, "gateway serving");
    // Server-sent events are small writes, one per step: with Nagle's
    // algorithm on, one waits for the client's (delayed) ACK of the one
    // before, adding up to tens of milliseconds to a token's arrival.
    let listener = GatedListener { listener, gate }.tap_io(|conn| {
        if let Err(e) = conn.get_ref().set_nodelay(true) {
            tracing::warn!(error = %e, "cannot set TCP_NODELAY on an HTTP connection");
        }
    });
    axum::serve(
        listener,
        app.into_make_service_with_connect_info::<SocketAddr>(),
    )
    .with_graceful_shutdown(shutdown)
    .await?;
    Ok(())
}

/// What [`track_call`] needs.
#[derive(Debug, Clone)]
struct Calls {
    gate: Gate,
    body_timeout: Duration,
}

/// The most a request body may hold (axum's default limit).
const MAX_BODY: usize = 2 * 1024 * 1024;

/// Tells the gate about each request (its connection is proven and busy
/// until the response body is dropped) and reads the body whole within the
/// body deadline, so that a slowly sent body cannot hold a connection.
async fn track_call(
    State(calls): State<Calls>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    request: Request,
    next: Next,
) -> Response {
    let guard = calls.gate.call_began(peer);
    let (parts, body) = request.into_parts();
    let read = tokio::time::timeout(calls.body_timeout, axum::body::to_bytes(body, MAX_BODY));
    let body = match read.await {
        Ok(Ok(bytes)) => bytes,
        Ok(Err(e)) => return ApiError::body_unreadable(e.to_string()).into_response(),
        Err(_) => {
            return ApiError::body_timeout(format!(
                "the request body did not arrive within {} ms",
                calls.body_timeout.as_millis()
            ))
            .into_response();
        }
    };
    let response = next.run(Request::from_parts(parts, Body::from(body))).await;
    match guard {
        Some(guard) => response.map(|body| Body::new(guard.hold(body))),
        None => response,
    }
}

/// The HTTP listener under the shared connection limits
/// ([`kvlease_runtime::limits::Gate`]): a cap on open connections, caps on
/// connections no request has proven yet (overall and per peer address), a
/// deadline for a new connection's first whole request headers, an idle
/// deadline.
#[derive(Debug)]
struct GatedListener {
    listener: TcpListener,
    gate: Gate,
}

impl axum::serve::Listener for GatedListener {
    type Io = kvlease_runtime::limits::Guarded<tokio::net::TcpStream>;
    type Addr = std::net::SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        loop {
            let (conn, addr) = axum::serve::Listener::accept(&mut self.listener).await;
            // None: over the cap, closed by dropping it
            if let Some(conn) = self.gate.admit_from(conn, Some(addr)) {
                return (conn, addr);
            }
        }
    }

    fn local_addr(&self) -> std::io::Result<Self::Addr> {
        self.listener.local_addr()
    }
}
