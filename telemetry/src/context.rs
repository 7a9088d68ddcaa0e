//! W3C trace context in gRPC metadata and HTTP headers, the logical service a span belongs to,
//! and the checked `set_parent`.

use opentelemetry::Context;
use opentelemetry::propagation::{Extractor, Injector, TextMapPropagator};
use opentelemetry::trace::{SpanContext, TraceContextExt};
use opentelemetry_sdk::propagation::TraceContextPropagator;
use tonic::metadata::{KeyRef, MetadataKey, MetadataMap, MetadataValue};
use tracing::Span;
use tracing_opentelemetry::OpenTelemetrySpanExt;
pub use tracing_opentelemetry::SetParentError;

/// The logical service (`kvlease-cache`, `kvlease-scheduler`, ...) that spans started under
/// this context belong to. Carried as an OpenTelemetry [`Context`] value, so it flows from a
/// span to its children; the tracer provider copies it into the `kvlease.service` attribute of
/// every span (see [`crate::tracer_provider`]). This is what keeps three services apart when
/// they share one process and one global subscriber (integration tests, `kvlease up`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LogicalService(pub &'static str);

/// The instance of the logical service (its gRPC listener's address), carried like
/// [`LogicalService`] and exported as `service.instance.id`: two replicas of one service in one
/// process stay apart.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServiceInstance(pub std::sync::Arc<str>);

/// `remote` plus the logical service and instance of the current span, for a span that a
/// service starts in another trace (a sequence's, named by a batched item).
pub fn with_current_service(remote: &Context) -> Context {
    let current = current_context();
    let mut cx = remote.clone();
    if let Some(service) = current.get::<LogicalService>() {
        cx = cx.with_value(*service);
    }
    if let Some(instance) = current.get::<ServiceInstance>() {
        cx = cx.with_value(instance.clone());
    }
    cx
}

/// `parent` plus the logical service that spans started under it belong to.
pub fn with_service(parent: &Context, service: &'static str) -> Context {
    parent.with_value(LogicalService(service))
}

/// Runs `fut` with the spans it starts attributed to `service`: for background tasks such as
/// a step loop, which no incoming request parents. Spans it starts without another parent are
/// roots (a background task outlives whatever span spawned it); spans given a parent with
/// [`set_parent`] keep that parent's service.
///
/// ```ignore
/// tokio::spawn(kvlease_telemetry::in_service("kvlease-scheduler", step_loop(state)));
/// ```
pub fn in_service<F: std::future::Future>(
    service: &'static str,
    fut: F,
) -> opentelemetry::context::WithContext<F> {
    use opentelemetry::context::FutureExt as _;
    fut.with_context(with_service(&Context::new(), service))
}

/// Makes `parent` the OpenTelemetry parent of `span`. Call it after creating the span and
/// before entering it (or `.instrument(span)`): once a span has started, the parent can no
/// longer change and the SDK refuses with [`SetParentError::AlreadyStarted`]. A refusal is
/// logged here (a warning for `AlreadyStarted`, the bug that silently splits a trace) and
/// returned, so the caller can decide; do not discard it silently.
pub fn set_parent(span: &Span, parent: Context) -> Result<(), SetParentError> {
    let result = span.set_parent(parent);
    match &result {
        Ok(()) => {}
        Err(err @ SetParentError::AlreadyStarted) => {
            tracing::warn!(error = %err, span = ?span.metadata().map(|m| m.name()), "trace parent lost: span already started");
        }
        // No OpenTelemetry layer (a plain fmt subscriber) or a span filtered out: there is no
        // trace to break, so this is not worth a warning.
        Err(err) => tracing::debug!(error = %err, "trace parent not set"),
    }
    result
}

/// The OpenTelemetry span context of a tracing span (starting it if it has not started yet).
/// Keep it to link a later span to this one (see [`crate::add_link`]).
pub fn span_context(span: &Span) -> SpanContext {
    span.context().span().span_context().clone()
}

/// The W3C trace-context propagator; the only propagation format kvlease uses. The helpers of
/// this crate use it directly rather than the global propagator, so that propagation does not
/// depend on whether `init` ran (tests, libraries).
fn propagator() -> TraceContextPropagator {
    TraceContextPropagator::new()
}

/// The remote parent carried in request metadata (`traceparent`/`tracestate`); an empty context
/// when there is none or it does not parse.
pub fn extract_context(metadata: &MetadataMap) -> Context {
    propagator().extract_with_context(&Context::new(), &MetadataExtractor(metadata))
}

/// Writes `cx`'s span into `metadata` as `traceparent`/`tracestate`. Nothing is written for a
/// context without a valid span.
pub fn inject_context(cx: &Context, metadata: &mut MetadataMap) {
    propagator().inject_context(cx, &mut MetadataInjector(metadata));
}

/// The current span's context, falling back to the attached OpenTelemetry context when the
/// current tracing span has none (no OpenTelemetry layer, or outside any span).
pub fn current_context() -> Context {
    let cx = Span::current().context();
    if cx.span().span_context().is_valid() {
        cx
    } else {
        Context::current()
    }
}

/// The remote parent carried in HTTP headers (what the server layer sees).
pub fn extract_context_from_headers(headers: &http::HeaderMap) -> Context {
    propagator().extract_with_context(&Context::new(), &HeaderExtractor(headers))
}

/// `cx`'s span as one W3C `traceparent` value, for a protocol field that carries one item's
/// trace context inside a batched message (`SequenceSpec.traceparent`); empty when `cx` has
/// no valid span.
pub fn traceparent(cx: &Context) -> String {
    let mut fields = std::collections::HashMap::new();
    propagator().inject_context(cx, &mut fields);
    fields.remove(TRACEPARENT).unwrap_or_default()
}

/// The remote parent named by a `traceparent` value (see [`traceparent`]); an empty context for
/// an empty or malformed value, so that a bad field never fails a call.
pub fn context_from_traceparent(value: &str) -> Context {
    if value.is_empty() {
        return Context::new();
    }
    let fields = std::collections::HashMap::from([(TRACEPARENT.to_owned(), value.to_owned())]);
    propagator().extract_with_context(&Context::new(), &fields)
}

const TRACEPARENT: &str = "traceparent";

// === carriers ===

struct MetadataExtractor<'a>(&'a MetadataMap);

impl Extractor for MetadataExtractor<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|value| value.to_str().ok())
    }

    fn keys(&self) -> Vec<&str> {
        self.0
            .keys()
            .filter_map(|key| match key {
                KeyRef::Ascii(key) => Some(key.as_str()),
                KeyRef::Binary(_) => None,
            })
            .collect()
    }
}

struct MetadataInjector<'a>(&'a mut MetadataMap);

impl Injector for MetadataInjector<'_> {
    fn set(&mut self, key: &str, value: String) {
        // Both always parse for traceparent/tracestate; a value that does not is dropped
        // rather than sent malformed.
        if let (Ok(key), Ok(value)) = (
            MetadataKey::from_bytes(key.as_bytes()),
            MetadataValue::try_from(value.as_str()),
        ) {
            self.0.insert(key, value);
        }
    }
}

struct HeaderExtractor<'a>(&'a http::HeaderMap);

impl Extractor for HeaderExtractor<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|value| value.to_str().ok())
    }

    fn keys(&self) -> Vec<&str> {
        self.0.keys().map(http::HeaderName::as_str).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use opentelemetry::trace::{SpanId, TraceFlags, TraceId, TraceState};

    fn remote_context() -> Context {
        let sc = SpanContext::new(
            TraceId::from_hex("4bf92f3577b34da6a3ce929d0e0e4736").unwrap_or(TraceId::INVALID),
            SpanId::from_hex("00f067aa0ba902b7").unwrap_or(SpanId::INVALID),
            TraceFlags::SAMPLED,
            true,
            TraceState::default(),
        );
        Context::new().with_remote_span_context(sc)
    }

    #[test]
    fn inject_then_extract_round_trips_through_metadata() {
        let mut metadata = MetadataMap::new();
        inject_context(&remote_context(), &mut metadata);
        assert_eq!(
            metadata.get("traceparent").and_then(|v| v.to_str().ok()),
            Some("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")
        );
        let extracted = extract_context(&metadata);
        let sc = extracted.span().span_context().clone();
        assert!(sc.is_valid() && sc.is_remote());
        assert_eq!(
            sc.trace_id().to_string(),
            "4bf92f3577b34da6a3ce929d0e0e4736"
        );
        assert_eq!(sc.span_id().to_string(), "00f067aa0ba902b7");
    }

    #[test]
    fn nothing_injected_without_a_span_and_nothing_extracted_from_garbage() {
        let mut metadata = MetadataMap::new();
        inject_context(&Context::new(), &mut metadata);
        assert!(metadata.get("traceparent").is_none());

        let mut headers = http::HeaderMap::new();
        headers.insert("traceparent", http::HeaderValue::from_static("00-nonsense"));
        assert!(
            !extract_context_from_headers(&headers)
                .span()
                .span_context()
                .is_valid()
        );
    }

    #[test]
    fn traceparent_values_round_trip_and_bad_ones_are_empty() {
        let value = traceparent(&remote_context());
        assert_eq!(
            value,
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
        );
        let back = context_from_traceparent(&value);
        assert_eq!(
            back.span().span_context().trace_id(),
            remote_context().span().span_context().trace_id()
        );
        assert_eq!(traceparent(&Context::new()), "");
        for bad in ["", "00-zz", "not a traceparent"] {
            assert!(
                !context_from_traceparent(bad)
                    .span()
                    .span_context()
                    .is_valid()
            );
        }
    }

    #[test]
    fn logical_service_is_a_context_value() {
        let cx = with_service(&remote_context(), "kvlease-cache");
        assert_eq!(
            cx.get::<LogicalService>(),
            Some(&LogicalService("kvlease-cache"))
        );
        assert!(
            cx.span().span_context().is_valid(),
            "the remote parent survives"
        );
    }
}
