//! The OTLP/gRPC exporter really exports: a real OTLP trace receiver (the
//! `opentelemetry-proto` tonic server) runs in the test on 127.0.0.1:0.

mod common;

use std::time::{Duration, Instant};

use common::TestResult;
use kvlease_telemetry::{TelemetryConfig, TelemetryGuard, subscriber, tracer_provider};
use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::KeyValue;
use opentelemetry_proto::tonic::common::v1::any_value::Value as AnyValue;
use tokio::net::TcpListener;
use tokio::sync::mpsc;
use tokio_stream::wrappers::TcpListenerStream;

struct Receiver(mpsc::UnboundedSender<ExportTraceServiceRequest>);

#[tonic::async_trait]
impl TraceService for Receiver {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        let _ = self.0.send(request.into_inner());
        Ok(tonic::Response::new(ExportTraceServiceResponse {
            partial_success: None,
        }))
    }
}

fn string_attr(attributes: &[KeyValue], key: &str) -> Option<String> {
    attributes.iter().find(|kv| kv.key == key).and_then(|kv| {
        match kv.value.as_ref()?.value.as_ref()? {
            AnyValue::StringValue(s) => Some(s.clone()),
            _ => None,
        }
    })
}

// Multi-thread: the batch processor blocks its own thread on the export while the tonic
// channel's I/O runs on the runtime's workers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spans_reach_a_real_otlp_receiver_with_the_service_name() -> TestResult {
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let (tx, mut rx) = mpsc::unbounded_channel();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let collector = tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(TraceServiceServer::new(Receiver(tx)))
            .serve_with_incoming_shutdown(TcpListenerStream::new(listener), async {
                let _ = stopped.await;
            }),
    );

    let config = TelemetryConfig {
        otlp_endpoint: Some(format!("http://{addr}")),
        log_filter: "off".into(),
        export_timeout: Duration::from_secs(5),
        ..TelemetryConfig::new("kvlease-export-test")
    };
    let provider = tracer_provider(&config)?;
    let subscriber = subscriber(&config, &provider)?;
    tracing::subscriber::with_default(subscriber, || {
        let _span = tracing::info_span!("exported", kvlease.seq_id = 7_u64).entered();
    });

    // Shutdown exports the batch; it blocks, so off the runtime's workers.
    let guard = TelemetryGuard::new(provider, config.export_timeout);
    tokio::task::spawn_blocking(move || guard.shutdown()).await??;

    let request = tokio::time::timeout(Duration::from_secs(10), rx.recv())
        .await?
        .ok_or("receiver closed without a request")?;
    let resource_spans = request.resource_spans.first().ok_or("no resource spans")?;
    let resource = resource_spans.resource.as_ref().ok_or("no resource")?;
    assert_eq!(
        string_attr(&resource.attributes, "service.name").as_deref(),
        Some("kvlease-export-test")
    );
    let span = resource_spans
        .scope_spans
        .iter()
        .flat_map(|scope| scope.spans.iter())
        .find(|span| span.name == "exported")
        .ok_or("span not exported")?;
    assert_eq!(span.trace_id.len(), 16);
    assert_eq!(
        string_attr(&span.attributes, "kvlease.service").as_deref(),
        Some("kvlease-export-test")
    );

    let _ = stop.send(());
    collector.await??;
    Ok(())
}

/// A collector that accepts TCP but never speaks gRPC must not hang shutdown past the bound.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_is_bounded_when_the_collector_never_answers() -> TestResult {
    // Bound but never accepted: connections sit in the backlog, requests never complete.
    let black_hole = std::net::TcpListener::bind("127.0.0.1:0")?;
    let timeout = Duration::from_millis(300);
    let config = TelemetryConfig {
        otlp_endpoint: Some(format!("http://{}", black_hole.local_addr()?)),
        log_filter: "off".into(),
        export_timeout: timeout,
        ..TelemetryConfig::new("kvlease-black-hole")
    };
    let provider = tracer_provider(&config)?;
    tracing::subscriber::with_default(subscriber(&config, &provider)?, || {
        let _span = tracing::info_span!("lost").entered();
    });

    let guard = TelemetryGuard::new(provider, timeout);
    let started = Instant::now();
    // Dropping the guard is what a binary does at exit; it must return.
    tokio::task::spawn_blocking(move || drop(guard)).await?;
    let elapsed = started.elapsed();
    assert!(
        elapsed < Duration::from_secs(5),
        "shutdown took {elapsed:?}"
    );
    Ok(())
}

/// The provider is built with no runtime at all and outlives the runtime the receiver ran on
/// before: what happens when one test binary's `#[tokio::test]`s share one global provider.
#[test]
fn export_needs_no_caller_runtime_and_survives_a_dropped_one() -> TestResult {
    let first = tokio::runtime::Runtime::new()?;
    let second = tokio::runtime::Runtime::new()?;
    let listener = second.block_on(TcpListener::bind("127.0.0.1:0"))?;
    let addr = listener.local_addr()?;
    let (tx, mut rx) = mpsc::unbounded_channel();
    second.spawn(
        tonic::transport::Server::builder()
            .add_service(TraceServiceServer::new(Receiver(tx)))
            .serve_with_incoming(TcpListenerStream::new(listener)),
    );

    let config = TelemetryConfig {
        otlp_endpoint: Some(format!("http://{addr}")),
        log_filter: "off".into(),
        export_timeout: Duration::from_secs(5),
        ..TelemetryConfig::new("kvlease-no-runtime")
    };
    // Built outside any runtime; a span recorded while a (soon dropped) runtime is entered.
    let provider = tracer_provider(&config)?;
    {
        let _entered = first.enter();
        tracing::subscriber::with_default(subscriber(&config, &provider)?, || {
            let _span = tracing::info_span!("outlived").entered();
        });
    }
    drop(first);

    TelemetryGuard::new(provider, config.export_timeout).shutdown()?;
    let request = second
        .block_on(async { tokio::time::timeout(Duration::from_secs(10), rx.recv()).await })?
        .ok_or("receiver closed")?;
    let exported = request
        .resource_spans
        .iter()
        .flat_map(|r| r.scope_spans.iter())
        .flat_map(|s| s.spans.iter())
        .any(|span| span.name == "outlived");
    assert!(exported, "span not exported: {request:?}");
    Ok(())
}

/// Shutdown called from the only thread of a current-thread runtime (the end of a
/// `#[tokio::main(flavor = "current_thread")]`) still exports: the I/O is not on that thread.
#[tokio::test(flavor = "current_thread")]
async fn shutdown_on_a_current_thread_runtime_does_not_starve_the_export() -> TestResult {
    // The collector runs on another runtime, so that it keeps serving while this one blocks.
    let collector = tokio::runtime::Runtime::new()?;
    let std_listener = std::net::TcpListener::bind("127.0.0.1:0")?;
    std_listener.set_nonblocking(true)?;
    let addr = std_listener.local_addr()?;
    let (tx, mut rx) = mpsc::unbounded_channel();
    collector.spawn(async move {
        let listener = TcpListener::from_std(std_listener)?;
        tonic::transport::Server::builder()
            .add_service(TraceServiceServer::new(Receiver(tx)))
            .serve_with_incoming(TcpListenerStream::new(listener))
            .await
            .map_err(std::io::Error::other)
    });

    let config = TelemetryConfig {
        otlp_endpoint: Some(format!("http://{addr}")),
        log_filter: "off".into(),
        export_timeout: Duration::from_secs(5),
        ..TelemetryConfig::new("kvlease-current-thread")
    };
    let provider = tracer_provider(&config)?;
    tracing::subscriber::with_default(subscriber(&config, &provider)?, || {
        let _span = tracing::info_span!("blocking-shutdown").entered();
    });
    // Blocks this runtime's only thread, on purpose.
    TelemetryGuard::new(provider, config.export_timeout).shutdown()?;
    let request = rx
        .try_recv()
        .map_err(|e| format!("nothing exported before shutdown returned: {e}"))?;
    assert!(!request.resource_spans.is_empty());
    collector.shutdown_background();
    Ok(())
}
