//! One trace id across a real gRPC call: a tonic-health server behind `GrpcTraceLayer`, a client
//! with `TraceContextInterceptor`, on 127.0.0.1:0.

mod common;

use common::{TestResult, attr, attr_str, capture};
use kvlease_telemetry::opentelemetry::Value;
use kvlease_telemetry::opentelemetry::trace::{SpanKind, Status};
use kvlease_telemetry::{
    GrpcTraceLayer, TraceContextInterceptor, client_span, record_client_result, span_context,
};
use tokio::net::TcpListener;
use tokio_stream::wrappers::TcpListenerStream;
use tonic::transport::{Endpoint, Server};
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_client::HealthClient;
use tracing::Instrument as _;

// Current-thread runtime: the server's connection tasks run on this thread, under the test's
// scoped subscriber.
#[tokio::test(flavor = "current_thread")]
async fn one_trace_id_across_client_and_server_spans() -> TestResult {
    let capture = capture("kvlease-test-client")?;

    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let (_reporter, health) = tonic_health::server::health_reporter();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(
        Server::builder()
            .layer(GrpcTraceLayer::new("kvlease-cache"))
            .add_service(health)
            .serve_with_incoming_shutdown(TcpListenerStream::new(listener), async {
                let _ = stopped.await;
            }),
    );

    let channel = Endpoint::from_shared(format!("http://{addr}"))?
        .connect()
        .await?;
    let mut client = HealthClient::with_interceptor(channel, TraceContextInterceptor::default());

    // A successful call inside a plain caller span.
    let caller = tracing::info_span!("caller");
    let caller_cx = span_context(&caller);
    let ok = client
        .check(HealthCheckRequest {
            service: String::new(),
        })
        .instrument(caller.clone())
        .await;
    assert!(ok.is_ok(), "health check failed: {ok:?}");
    drop(caller);

    // A failing call (unknown service -> NOT_FOUND) inside the crate's client span.
    let call = client_span("grpc.health.v1.Health", "Check");
    let call_cx = span_context(&call);
    let not_found = client
        .check(HealthCheckRequest {
            service: "no.such.Service".into(),
        })
        .instrument(call.clone())
        .await;
    assert_eq!(
        not_found.as_ref().err().map(tonic::Status::code),
        Some(tonic::Code::NotFound)
    );
    record_client_result(&call, &not_found);
    drop(call);

    drop(client);
    let _ = stop.send(());
    server.await??;

    let servers: Vec<_> = capture
        .spans()
        .into_iter()
        .filter(|s| s.name == "grpc.health.v1.Health/Check" && s.span_kind == SpanKind::Server)
        .collect();
    assert_eq!(servers.len(), 2, "one server span per call: {servers:#?}");

    let ok_span = servers
        .iter()
        .find(|s| s.span_context.trace_id() == caller_cx.trace_id())
        .ok_or("no server span in the caller's trace")?;
    assert_eq!(
        ok_span.parent_span_id,
        caller_cx.span_id(),
        "server span's parent is the caller"
    );
    assert!(ok_span.parent_span_is_remote);
    assert_eq!(attr_str(ok_span, "rpc.system").as_deref(), Some("grpc"));
    assert_eq!(
        attr_str(ok_span, "rpc.service").as_deref(),
        Some("grpc.health.v1.Health")
    );
    assert_eq!(attr_str(ok_span, "rpc.method").as_deref(), Some("Check"));
    assert_eq!(attr(ok_span, "rpc.grpc.status_code"), Some(Value::I64(0)));
    assert_eq!(
        attr_str(ok_span, "kvlease.service").as_deref(),
        Some("kvlease-cache")
    );
    assert_eq!(ok_span.status, Status::Unset);

    let failed = servers
        .iter()
        .find(|s| s.span_context.trace_id() == call_cx.trace_id())
        .ok_or("no server span in the client span's trace")?;
    assert_eq!(failed.parent_span_id, call_cx.span_id());
    assert_eq!(attr(failed, "rpc.grpc.status_code"), Some(Value::I64(5)));
    assert!(
        matches!(failed.status, Status::Error { .. }),
        "{:?}",
        failed.status
    );

    let client_side = capture
        .spans()
        .into_iter()
        .find(|s| s.span_kind == SpanKind::Client)
        .ok_or("no client span")?;
    assert_eq!(client_side.name, "grpc.health.v1.Health/Check");
    assert_eq!(client_side.span_context.span_id(), call_cx.span_id());
    assert_eq!(
        attr(&client_side, "rpc.grpc.status_code"),
        Some(Value::I64(5))
    );
    assert!(matches!(client_side.status, Status::Error { .. }));
    // The client side belongs to the process's own service, the server side to its layer's.
    assert_eq!(
        attr_str(&client_side, "kvlease.service").as_deref(),
        Some("kvlease-test-client")
    );
    Ok(())
}

/// Two logical services in one process and one subscriber, one real hop between them: a
/// "scheduler" handler (behind its own layer) calls the "cache" (a health server behind
/// another layer) with a traced client. One trace; each span names its own service.
#[tokio::test(flavor = "current_thread")]
async fn a_chain_of_logical_services_in_one_process_is_one_trace() -> TestResult {
    use std::convert::Infallible;

    use http_body_util::{BodyExt as _, Full};
    use hyper::body::Bytes;
    use kvlease_telemetry::TracedChannel;
    use tower::{Layer as _, ServiceExt as _};

    let capture = capture("kvlease-process")?;

    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let (_reporter, health) = tonic_health::server::health_reporter();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let cache = tokio::spawn(
        Server::builder()
            .layer(GrpcTraceLayer::new("kvlease-cache"))
            .add_service(health)
            .serve_with_incoming_shutdown(TcpListenerStream::new(listener), async {
                let _ = stopped.await;
            }),
    );
    let channel = Endpoint::from_shared(format!("http://{addr}"))?
        .connect()
        .await?;
    let cache_client: HealthClient<TracedChannel> =
        HealthClient::new(kvlease_telemetry::traced(channel));

    // The scheduler's handler: a span of its own, then a call to the cache.
    let scheduler = GrpcTraceLayer::new("kvlease-scheduler").layer(tower::service_fn(
        move |_request: http::Request<Full<Bytes>>| {
            let mut cache_client = cache_client.clone();
            async move {
                let step = tracing::info_span!("step");
                let code = match cache_client
                    .check(HealthCheckRequest {
                        service: String::new(),
                    })
                    .instrument(step)
                    .await
                {
                    Ok(_) => "0",
                    Err(_) => "13",
                };
                let mut response = http::Response::new(Full::new(Bytes::new()));
                response
                    .headers_mut()
                    .insert("grpc-status", http::HeaderValue::from_static(code));
                Ok::<_, Infallible>(response)
            }
        },
    ));

    // The user's call into the scheduler, from a root span of the process.
    let user = tracing::info_span!("user");
    let user_cx = span_context(&user);
    let mut request = http::Request::builder()
        .uri("http://scheduler/kvlease.v1.Scheduler/Generate")
        .body(Full::new(Bytes::new()))?;
    // What the user's client interceptor would send.
    let metadata = user.in_scope(|| {
        let mut metadata = tonic::metadata::MetadataMap::new();
        kvlease_telemetry::inject_context(&kvlease_telemetry::current_context(), &mut metadata);
        metadata
    });
    *request.headers_mut() = metadata.into_headers();
    drop(user);
    let response = scheduler.oneshot(request).await?;
    assert_eq!(
        response.headers().get("grpc-status").map(|v| v.as_bytes()),
        Some(&b"0"[..])
    );
    let _ = response.into_body().collect().await?;

    let _ = stop.send(());
    cache.await??;

    let spans = capture.spans();
    let by_name = |name: &str| {
        spans
            .iter()
            .find(|s| s.name == name)
            .cloned()
            .ok_or(format!("no {name} span"))
    };
    let generate = by_name("kvlease.v1.Scheduler/Generate")?;
    let step = by_name("step")?;
    let check = by_name("grpc.health.v1.Health/Check")?;

    for span in [&generate, &step, &check] {
        assert_eq!(
            span.span_context.trace_id(),
            user_cx.trace_id(),
            "{} left the trace",
            span.name
        );
    }
    assert_eq!(generate.parent_span_id, user_cx.span_id());
    assert_eq!(step.parent_span_id, generate.span_context.span_id());
    assert_eq!(check.parent_span_id, step.span_context.span_id());
    assert_eq!(
        attr_str(&generate, "kvlease.service").as_deref(),
        Some("kvlease-scheduler")
    );
    assert_eq!(
        attr_str(&step, "kvlease.service").as_deref(),
        Some("kvlease-scheduler")
    );
    assert_eq!(
        attr_str(&check, "kvlease.service").as_deref(),
        Some("kvlease-cache")
    );
    Ok(())
}
