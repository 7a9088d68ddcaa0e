//! The crate's one error type.

use std::time::Duration;

/// Result alias for this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Errors from telemetry set-up, shutdown and the metrics registry.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A `RUST_LOG`-style filter did not parse.
    #[error("invalid {what} filter {filter:?}: {source}")]
    Filter {
        /// Which filter: `log` or `trace`.
        what: &'static str,
        /// The directive string as given.
        filter: String,
        /// The parser's complaint.
        #[source]
        source: tracing_subscriber::filter::ParseError,
    },
    /// The exporter's private runtime could not be started.
    #[error("cannot start the otlp export runtime: {0}")]
    ExportRuntime(#[source] std::io::Error),
    /// The OTLP span exporter could not be built (bad endpoint, unsupported scheme).
    #[error("cannot build the otlp span exporter for {endpoint}: {source}")]
    Exporter {
        /// The configured collector endpoint.
        endpoint: String,
        /// The exporter's complaint.
        #[source]
        source: opentelemetry_otlp::ExporterBuildError,
    },
    /// Another global subscriber was installed first.
    #[error("cannot install the global tracing subscriber: {0}")]
    Subscriber(#[from] tracing_subscriber::util::TryInitError),
    /// Flushing or shutting down the tracer provider failed or ran out of time.
    #[error("tracer provider shutdown failed within {timeout:?}: {reason}")]
    Shutdown {
        /// The bound that applied.
        timeout: Duration,
        /// What the SDK reported.
        reason: String,
    },
    /// A metric or label name is not a valid Prometheus name.
    #[error("invalid metric or label name {0:?}")]
    InvalidMetricName(String),
    /// Histogram buckets must be finite, strictly increasing and not empty.
    #[error("invalid histogram buckets for {0:?}")]
    InvalidBuckets(String),
    /// Two metrics with one name were registered in one registry.
    #[error("metric {0:?} is already registered")]
    DuplicateMetric(String),
}

impl From<Error> for tonic::Status {
    fn from(err: Error) -> Self {
        // Telemetry errors never come from a caller's input: they are the server's own problem.
        tonic::Status::internal(err.to_string())
    }
}
