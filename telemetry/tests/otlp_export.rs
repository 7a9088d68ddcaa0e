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

#[test]
fn an_endpoint_without_a_runtime_is_an_error_not_a_panic() {
    let config = TelemetryConfig {
        otlp_endpoint: Some("http://127.0.0.1:4317".into()),
        ..TelemetryConfig::new("kvlease-no-runtime")
    };
    assert!(matches!(
        tracer_provider(&config),
        Err(kvlease_telemetry::Error::NoRuntime { .. })
    ));
}
