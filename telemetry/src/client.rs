//! Client side: the interceptor that carries the current trace context on every call, and an
//! optional client span per call.

use tonic::service::Interceptor;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::Channel;
use tracing::Span;

use crate::context::{current_context, inject_context};
use crate::server::{record_status, rpc_span};

/// Injects the current span's trace context into every request's metadata as
/// `traceparent`/`tracestate` (W3C). Use it as
/// `CacheServiceClient::with_interceptor(channel, TraceContextInterceptor::default())`.
///
/// The interceptor runs when the call starts, inside whatever span the calling future is
/// instrumented with, so wrap the call in [`client_span`] (or any span) to make it the parent
/// of the server's span.
#[derive(Debug, Clone, Copy, Default)]
pub struct TraceContextInterceptor {
    // Private so that callers write `TraceContextInterceptor::default()`, leaving room for
    // options later.
    _private: (),
}

impl Interceptor for TraceContextInterceptor {
    fn call(
        &mut self,
        mut request: tonic::Request<()>,
    ) -> Result<tonic::Request<()>, tonic::Status> {
        inject_context(&current_context(), request.metadata_mut());
        Ok(request)
    }
}

/// A channel whose calls carry trace context: `FooClient<TracedChannel>`.
pub type TracedChannel = InterceptedService<Channel, TraceContextInterceptor>;

/// Wraps a channel for `FooClient::new(traced(channel))`; same as `with_interceptor`.
pub fn traced(channel: Channel) -> TracedChannel {
    InterceptedService::new(channel, TraceContextInterceptor::default())
}

/// A client span named `{rpc_service}/{rpc_method}` (`otel.kind = "client"`, `rpc.*`
/// attributes). Instrument the call with it and record the outcome with
/// [`record_client_result`]:
///
/// ```ignore
/// let span = kvlease_telemetry::client_span("kvlease.v1.CacheService", "Lease");
/// let result = client.lease(request).instrument(span.clone()).await;
/// kvlease_telemetry::record_client_result(&span, &result);
/// ```
pub fn client_span(rpc_service: &str, rpc_method: &str) -> Span {
    rpc_span("client", rpc_service, rpc_method)
}

/// Records a call's gRPC status on its client span (`rpc.grpc.status_code`, and
/// `otel.status_code = "ERROR"` for anything but OK).
pub fn record_client_result<T>(span: &Span, result: &Result<T, tonic::Status>) {
    match result {
        Ok(_) => record_status(span, tonic::Code::Ok, ""),
        Err(status) => record_status(span, status.code(), status.message()),
    }
}
