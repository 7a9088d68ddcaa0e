//! Server side: a tower layer that gives every gRPC request a server span in the caller's
//! trace, named and attributed by the OpenTelemetry RPC conventions.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context as TaskContext, Poll, ready};

use http_body::{Body, Frame, SizeHint};
use opentelemetry::trace::Status;
use tracing::{Instrument as _, Span};
use tracing_opentelemetry::OpenTelemetrySpanExt as _;

use opentelemetry::trace::TraceContextExt as _;

use crate::context::{ServiceInstance, extract_context_from_headers, set_parent, with_service};

/// Layer for `tonic::transport::Server::builder().layer(GrpcTraceLayer::new("kvlease-cache"))`.
///
/// For each request it extracts the W3C parent from the headers, creates the server span
/// `{package.Service}/{Method}` (`otel.kind = "server"`, `rpc.system = "grpc"`, `rpc.service`,
/// `rpc.method`), sets the parent before the span starts (a refusal is logged), attributes the
/// span and everything under it to the logical service (`kvlease.service`), runs the handler
/// inside it and records `rpc.grpc.status_code` (and error status for non-OK) when the response
/// ends, so a streaming response's span covers the whole stream.
///
/// Polls (health checks, reflection, `KeepAlive`, `GetStatus`, `GetStats`) that arrive without
/// a trace context get no span, so they make no root traces; with a caller's context they are
/// traced like any call.
#[derive(Debug, Clone)]
pub struct GrpcTraceLayer {
    service: &'static str,
    instance: Option<ServiceInstance>,
}

impl GrpcTraceLayer {
    /// A layer for the logical service `service` (e.g. `"kvlease-scheduler"`).
    pub fn new(service: &'static str) -> Self {
        Self {
            service,
            instance: None,
        }
    }

    /// The same, for the instance `instance` of the service (e.g. its listener address).
    pub fn with_instance(self, instance: impl Into<std::sync::Arc<str>>) -> Self {
        Self {
            instance: Some(ServiceInstance(instance.into())),
            ..self
        }
    }
}

/// Whether a call is a poll: traced only when its caller traces it.
fn is_poll(rpc_service: &str, rpc_method: &str) -> bool {
    rpc_service.starts_with("grpc.health.")
        || rpc_service.starts_with("grpc.reflection.")
        || matches!(
            rpc_method,
            "KeepAlive" | "GetStatus" | "GetStats" | "WatchEvents"
        )
}

impl<S> tower::Layer<S> for GrpcTraceLayer {
    type Service = GrpcTraceService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        GrpcTraceService {
            inner,
            service: self.service,
            instance: self.instance.clone(),
        }
    }
}

/// The service [`GrpcTraceLayer`] wraps around a server's routes.
#[derive(Debug, Clone)]
pub struct GrpcTraceService<S> {
    inner: S,
    service: &'static str,
    instance: Option<ServiceInstance>,
}

/// The boxed response future of [`GrpcTraceService`].
pub type ResponseFuture<T, E> = Pin<Box<dyn Future<Output = Result<T, E>> + Send + 'static>>;

impl<S, ReqBody, ResBody> tower::Service<http::Request<ReqBody>> for GrpcTraceService<S>
where
    S: tower::Service<http::Request<ReqBody>, Response = http::Response<ResBody>>
        + Clone
        + Send
        + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    ReqBody: Send + 'static,
{
    type Response = http::Response<TracedBody<ResBody>>;
    type Error = S::Error;
    type Future = ResponseFuture<Self::Response, Self::Error>;

    fn poll_ready(&mut self, cx: &mut TaskContext<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<ReqBody>) -> Self::Future {
        // The clone is not ready; the one that was polled ready serves this call.
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);

        let (rpc_service, rpc_method) = split_path(request.uri().path());
        let remote = extract_context_from_headers(request.headers());
        let traced = remote.span().span_context().is_valid() || !is_poll(rpc_service, rpc_method);
        let span = if traced {
            rpc_span("server", rpc_service, rpc_method)
        } else {
            Span::none()
        };
        let mut parent = with_service(&remote, self.service);
        if let Some(instance) = &self.instance {
            parent = parent.with_value(instance.clone());
        }
        // Before the span is entered or instrumented: afterwards the parent cannot change.
        // A refusal is already logged by `set_parent`; the request is served either way.
        if traced && set_parent(&span, parent).is_err() {
            span.record("kvlease.parent_lost", true);
        }

        let future = span.in_scope(|| inner.call(request));
        Box::pin(
            async move {
                let span = Span::current();
                match future.await {
                    Ok(response) => {
                        // Trailers-only responses (every handler error) carry the status in
                        // the headers; otherwise it comes in the body's trailers.
                        let status = grpc_status(response.headers());
                        if let Some((code, message)) = &status {
                            record_status(&span, *code, message);
                        }
                        let recorded = status.is_some();
                        Ok(response.map(|inner| TracedBody {
                            inner,
                            span,
                            recorded,
                        }))
                    }
                    Err(err) => {
                        span.set_status(Status::error("the server's service failed"));
                        Err(err)
                    }
                }
            }
            .instrument(span),
        )
    }
}

/// A response body that keeps the server span open until the response ends, polls the inner
/// body inside it, and records the status from the trailers.
#[derive(Debug)]
pub struct TracedBody<B> {
    inner: B,
    span: Span,
    recorded: bool,
}

impl<B> Body for TracedBody<B>
where
    B: Body + Unpin,
{
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut TaskContext<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        let this = self.get_mut();
        let _entered = this.span.enter();
        let frame = ready!(Pin::new(&mut this.inner).poll_frame(cx));
        match &frame {
            Some(Ok(frame)) => {
                if let Some(trailers) = frame.trailers_ref()
                    && !this.recorded
                    && let Some((code, message)) = grpc_status(trailers)
                {
                    record_status(&this.span, code, &message);
                    this.recorded = true;
                }
            }
            Some(Err(_)) => {
                if !this.recorded {
                    record_status(&this.span, tonic::Code::Internal, "response body failed");
                    this.recorded = true;
                }
            }
            // Ended without trailers or a status in the headers: nothing to record, and not
            // a cancellation either.
            None => this.recorded = true,
        }
        Poll::Ready(frame)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

impl<B> Drop for TracedBody<B> {
    fn drop(&mut self) {
        // Dropped before the trailers: the client went away (or the connection did).
        if !self.recorded {
            record_status(&self.span, tonic::Code::Cancelled, "response not completed");
        }
    }
}

// === helpers shared with the client side ===

/// `"/kvlease.v1.CacheService/Lease"` -> `("kvlease.v1.CacheService", "Lease")`.
fn split_path(path: &str) -> (&str, &str) {
    let path = path.strip_prefix('/').unwrap_or(path);
    path.split_once('/').unwrap_or((path, ""))
}

/// The RPC span both sides use; `kind` is `"server"` or `"client"`.
pub(crate) fn rpc_span(kind: &'static str, rpc_service: &str, rpc_method: &str) -> Span {
    let name = format!("{rpc_service}/{rpc_method}");
    tracing::info_span!(
        "grpc",
        otel.name = name.as_str(),
        otel.kind = kind,
        rpc.system = "grpc",
        rpc.service = rpc_service,
        rpc.method = rpc_method,
        rpc.grpc.status_code = tracing::field::Empty,
        otel.status_code = tracing::field::Empty,
        kvlease.parent_lost = tracing::field::Empty,
    )
}

/// Records the gRPC status code, and error status with the message for anything but OK.
pub(crate) fn record_status(span: &Span, code: tonic::Code, message: &str) {
    span.record("rpc.grpc.status_code", code as i64);
    if code != tonic::Code::Ok {
        span.record("otel.status_code", "ERROR");
        let description = if message.is_empty() {
            code.description()
        } else {
            message
        };
        span.set_status(Status::error(description.to_owned()));
    }
}

fn grpc_status(headers: &http::HeaderMap) -> Option<(tonic::Code, String)> {
    let code = headers.get("grpc-status")?;
    let code = tonic::Code::from_bytes(code.as_bytes());
    let message = headers
        .get("grpc-message")
        .and_then(|m| m.to_str().ok())
        .unwrap_or_default()
        .to_owned();
    Some((code, message))
}

/// The connections a gRPC server should serve from `listener`, with Nagle's
/// algorithm off. tonic sets TCP_NODELAY only on listeners it binds itself;
/// without it a response spanning several segments, or a stream of small
/// messages, waits out the peer's delayed ACK (about 40 ms each time).
pub fn incoming(
    listener: tokio::net::TcpListener,
    gate: crate::limits::Gate,
) -> impl tokio_stream::Stream<Item = std::io::Result<crate::limits::Guarded<tokio::net::TcpStream>>>
{
    use tokio_stream::StreamExt;
    tokio_stream::wrappers::TcpListenerStream::new(listener).filter_map(move |conn| {
        let conn = match conn {
            Ok(conn) => conn,
            Err(e) => return Some(Err(e)),
        };
        if let Err(e) = conn.set_nodelay(true) {
            return Some(Err(e));
        }
        // None: over the connection cap, closed here
        let peer = conn.peer_addr().ok();
        gate.admit_from(conn, peer).map(Ok)
    })
}

#[cfg(test)]
mod tests {
    use super::split_path;

    #[test]
    fn paths_split_into_service_and_method() {
        assert_eq!(
            split_path("/kvlease.v1.CacheService/Lease"),
            ("kvlease.v1.CacheService", "Lease")
        );
        assert_eq!(
            split_path("/grpc.health.v1.Health/Check"),
            ("grpc.health.v1.Health", "Check")
        );
        assert_eq!(split_path("/odd"), ("odd", ""));
    }
}
