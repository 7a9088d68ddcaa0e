//! Span capture shared by the integration tests: a non-global provider with the SDK's
//! in-memory exporter and the crate's own subscriber, scoped to the test thread.

#![allow(dead_code, unreachable_pub)] // each test binary uses a different part

use kvlease_telemetry::opentelemetry::Value;
use kvlease_telemetry::opentelemetry_sdk::trace::{
    InMemorySpanExporter, SdkTracerProvider, SpanData,
};
use kvlease_telemetry::{TelemetryConfig, subscriber, tracer_provider_builder};

pub type TestResult = Result<(), Box<dyn std::error::Error + Send + Sync>>;

pub struct Capture {
    pub exporter: InMemorySpanExporter,
    pub provider: SdkTracerProvider,
    _default: tracing::subscriber::DefaultGuard,
}

/// Spans of this thread go to an in-memory exporter, synchronously (simple processor), so a
/// current-thread runtime sees every span the moment it ends.
pub fn capture(service: &str) -> Result<Capture, kvlease_telemetry::Error> {
    let config = TelemetryConfig {
        log_filter: "off".into(),
        ..TelemetryConfig::new(service)
    };
    let exporter = InMemorySpanExporter::default();
    let provider = tracer_provider_builder(&config)?
        .with_simple_exporter(exporter.clone())
        .build();
    let default = tracing::subscriber::set_default(subscriber(&config, &provider)?);
    Ok(Capture {
        exporter,
        provider,
        _default: default,
    })
}

impl Capture {
    pub fn spans(&self) -> Vec<SpanData> {
        self.exporter.get_finished_spans().unwrap_or_default()
    }

    pub fn span(&self, name: &str) -> Option<SpanData> {
        self.spans().into_iter().find(|s| s.name == name)
    }
}

pub fn attr(span: &SpanData, key: &str) -> Option<Value> {
    span.attributes
        .iter()
        .find(|kv| kv.key.as_str() == key)
        .map(|kv| kv.value.clone())
}

pub fn attr_str(span: &SpanData, key: &str) -> Option<String> {
    attr(span, key).map(|v| v.as_str().into_owned())
}
