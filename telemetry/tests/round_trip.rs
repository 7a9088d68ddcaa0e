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
