//! The server layer sets the remote parent before the span starts, and handler spans are its
//! children. Fails if the parent is lost (e.g. the span is entered before `set_parent`).

mod common;

use std::convert::Infallible;

use common::{TestResult, attr_str, capture};
use http_body_util::{BodyExt as _, Full};
use hyper::body::Bytes;
use kvlease_telemetry::opentelemetry::trace::{SpanKind, TraceContextExt as _};
use kvlease_telemetry::{GrpcTraceLayer, SetParentError, extract_context_from_headers, set_parent};
use tower::{Layer as _, ServiceExt as _};

const TRACE_ID: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const PARENT_ID: &str = "00f067aa0ba902b7";

#[tokio::test(flavor = "current_thread")]
async fn server_span_keeps_the_remote_parent_and_parents_handler_spans() -> TestResult {
    let capture = capture("kvlease-test")?;

    let handler = tower::service_fn(|_request: http::Request<Full<Bytes>>| async {
        // A span made in the handler, as a service's code would.
        let _work = tracing::info_span!("lease.work").entered();
        let mut response = http::Response::new(Full::new(Bytes::new()));
        // Trailers-only style: the status in the headers.
        response
            .headers_mut()
            .insert("grpc-status", http::HeaderValue::from_static("0"));
        Ok::<_, Infallible>(response)
    });
    let service = GrpcTraceLayer::new("kvlease-cache").layer(handler);

    let request = http::Request::builder()
        .uri("http://cache/kvlease.v1.CacheService/Lease")
        .header("traceparent", format!("00-{TRACE_ID}-{PARENT_ID}-01"))
        .body(Full::new(Bytes::new()))?;
    let response = service.oneshot(request).await?;
    // Drain and drop the body: the server span ends with the response.
    let _ = response.into_body().collect().await?;

    let server = capture
        .span("kvlease.v1.CacheService/Lease")
        .ok_or("no server span")?;
    assert_eq!(server.span_kind, SpanKind::Server);
    assert_eq!(
        server.span_context.trace_id().to_string(),
        TRACE_ID,
        "trace id lost"
    );
    assert_eq!(
        server.parent_span_id.to_string(),
        PARENT_ID,
        "remote parent lost"
    );
    assert_eq!(attr_str(&server, "kvlease.parent_lost"), None);

    let work = capture.span("lease.work").ok_or("no handler span")?;
    assert_eq!(work.span_context.trace_id(), server.span_context.trace_id());
    assert_eq!(
        work.parent_span_id,
        server.span_context.span_id(),
        "handler span not a child"
    );
    assert_eq!(
        attr_str(&work, "kvlease.service").as_deref(),
        Some("kvlease-cache")
    );
    Ok(())
}

#[tokio::test(flavor = "current_thread")]
async fn set_parent_after_enter_is_reported_not_swallowed() -> TestResult {
    let _capture = capture("kvlease-test")?;
    let mut headers = http::HeaderMap::new();
    headers.insert(
        "traceparent",
        format!("00-{TRACE_ID}-{PARENT_ID}-01").parse()?,
    );
    let remote = extract_context_from_headers(&headers);
    assert!(remote.span().span_context().is_valid());

    // The right order works...
    let span = tracing::info_span!("right");
    assert!(set_parent(&span, remote.clone()).is_ok());

    // ...the wrong one (entered first) is refused, and the refusal reaches the caller.
    let span = tracing::info_span!("wrong");
    drop(span.enter());
    assert!(matches!(
        set_parent(&span, remote),
        Err(SetParentError::AlreadyStarted)
    ));
    Ok(())
}

/// Polls (health, KeepAlive, GetStatus, GetStats) without a caller's context make no span, so no
/// root trace; with one they are traced like any call. Other calls always get a span.
#[tokio::test(flavor = "current_thread")]
async fn polls_are_traced_only_when_their_caller_traces_them() -> TestResult {
    let capture = capture("kvlease-test")?;
    let handler = tower::service_fn(|_request: http::Request<Full<Bytes>>| async {
        let mut response = http::Response::new(Full::new(Bytes::new()));
        response
            .headers_mut()
            .insert("grpc-status", http::HeaderValue::from_static("0"));
        Ok::<_, Infallible>(response)
    });
    let layer = GrpcTraceLayer::new("kvlease-cache").with_instance("127.0.0.1:1");
    let call = |path: &str, traced: bool| {
        let mut request = http::Request::builder().uri(format!("http://cache{path}"));
        if traced {
            request = request.header("traceparent", format!("00-{TRACE_ID}-{PARENT_ID}-01"));
        }
        let request = request.body(Full::new(Bytes::new()));
        let service = layer.clone().layer(handler);
        async move {
            let response = service.oneshot(request?).await?;
            let _ = response.into_body().collect().await?;
            Ok::<_, Box<dyn std::error::Error + Send + Sync>>(())
        }
    };
    call("/grpc.health.v1.Health/Check", false).await?;
    call("/kvlease.v1.CacheService/KeepAlive", false).await?;
    call("/kvlease.v1.CacheService/GetStats", false).await?;
    call("/kvlease.v1.CacheService/Lease", false).await?;
    call("/kvlease.v1.CacheService/GetStats", true).await?;

    let names: Vec<String> = capture
        .spans()
        .into_iter()
        .map(|s| s.name.into_owned())
        .collect();
    assert_eq!(
        names,
        [
            "kvlease.v1.CacheService/Lease",
            "kvlease.v1.CacheService/GetStats"
        ]
    );
    let traced = capture
        .span("kvlease.v1.CacheService/GetStats")
        .ok_or("no traced poll")?;
    assert_eq!(traced.span_context.trace_id().to_string(), TRACE_ID);
    assert_eq!(
        attr_str(&traced, "service.instance.id").as_deref(),
        Some("127.0.0.1:1")
    );
    Ok(())
}
