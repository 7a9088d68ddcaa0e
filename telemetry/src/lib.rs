//! Telemetry shared by every kvlease binary: logs, OpenTelemetry traces exported over
//! OTLP/gRPC, W3C trace context carried in gRPC metadata, `kvlease.*` span attributes, and a
//! Prometheus text endpoint.
//!
//! A binary calls [`init`] once and keeps the guard; servers add [`GrpcTraceLayer`], clients
//! use [`TraceContextInterceptor`], and one request's trace then crosses every service.
//!
//! # Layout
//!
//! - `config`: [`TelemetryConfig`], from the `OTEL_*`/`RUST_LOG` environment or built directly.
//! - `setup`: [`init`]/[`init_with`] install the propagator, the [`tracer_provider`] (OTLP
//!   exporter when configured) and the [`subscriber`]; [`TelemetryGuard`] flushes on drop.
//! - `context`: W3C inject/extract over gRPC metadata and HTTP headers, the checked
//!   [`set_parent`], and [`LogicalService`], the context value that the provider turns into the
//!   `kvlease.service` attribute so several services can share one process.
//! - `client`: [`TraceContextInterceptor`], [`TracedChannel`], [`client_span`].
//! - `server`: [`GrpcTraceLayer`], the server span per request.
//! - `attributes`: the `kvlease.*` keys, [`record_reject`], [`add_link`].
//! - `metrics`: the Prometheus registry (on `prometheus-client`), the metric names every
//!   service uses, and [`metrics::serve_metrics`].
//!
//! The service runtime (process `main`, server wrapping, transport limits) lives in
//! `kvlease-runtime`, which builds on this crate.
//!
//! Data flow: the interceptor writes the current span's context into the request metadata;
//! the layer reads it from the headers into the server span's parent (plus the logical
//! service); handler spans are children of the server span; the tracer provider stamps
//! `kvlease.service` on each span and the batch processor exports them.

pub mod attributes;
mod client;
mod config;
mod context;
mod error;
mod export;
pub mod metrics;
mod server;
mod setup;

pub use attributes::{
    RejectFigures, add_link, record_reject, reject_span, sequence_reject_span,
    sequence_retried_reject_span, sequence_span,
};
pub use client::{
    TraceContextInterceptor, TracedChannel, client_span, record_client_result, traced,
};
pub use config::{
    BatchSettings, DEFAULT_BSP_MAX_EXPORT_BATCH_SIZE, DEFAULT_BSP_MAX_QUEUE_SIZE,
    DEFAULT_BSP_SCHEDULE_DELAY, DEFAULT_EXPORT_TIMEOUT, DEFAULT_FILTER,
    ENV_BSP_MAX_EXPORT_BATCH_SIZE, ENV_BSP_MAX_QUEUE_SIZE, ENV_BSP_SCHEDULE_DELAY, ENV_LOG_FILTER,
    ENV_OTLP_ENDPOINT, ENV_OTLP_TIMEOUT, ENV_SERVICE_NAME, ENV_TRACE_FILTER, TelemetryConfig,
};
pub use context::{
    LogicalService, ServiceInstance, SetParentError, context_from_traceparent, current_context,
    extract_context, extract_context_from_headers, in_service, inject_context, set_parent,
    span_context, traceparent, with_current_service, with_service,
};
pub use error::{Error, Result};
pub use server::{GrpcTraceLayer, GrpcTraceService, ResponseFuture, TracedBody};
pub use setup::{
    TelemetryGuard, init, init_with, subscriber, tracer_provider, tracer_provider_builder,
};

/// The OpenTelemetry crates at the versions this crate uses, for callers that need their
/// types (`Context`, `SpanContext`, the SDK's test exporter).
pub use opentelemetry;
pub use opentelemetry_sdk;
/// Span-level OpenTelemetry access (`context`, `set_attribute`, links) for crates that use
/// `tracing` spans.
pub use tracing_opentelemetry::OpenTelemetrySpanExt;
