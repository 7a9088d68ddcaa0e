//! Building the tracer provider and the subscriber, installing them globally (`init`), and the
//! guard that flushes on shutdown.

use std::time::Duration;

use opentelemetry::trace::TracerProvider as _;
use opentelemetry::{Context, KeyValue};
use opentelemetry_otlp::WithExportConfig as _;
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::error::OTelSdkResult;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::{
    BatchConfigBuilder, BatchSpanProcessor, SdkTracerProvider, SpanData, SpanProcessor,
    TracerProviderBuilder,
};
use tracing::Subscriber;
use tracing_subscriber::layer::SubscriberExt as _;
use tracing_subscriber::registry::LookupSpan;
use tracing_subscriber::util::SubscriberInitExt as _;
use tracing_subscriber::{EnvFilter, Layer as _};

use crate::attributes::{SERVICE, SERVICE_INSTANCE};
use crate::config::TelemetryConfig;
use crate::context::{LogicalService, ServiceInstance};
use crate::error::{Error, Result};
use crate::export::{ServiceRouter, StepSampler};

/// `service.version` of every kvlease service: the workspace's version.
const VERSION: &str = env!("CARGO_PKG_VERSION");

/// `service.instance.id` of spans no server instance claims (background tasks): this process.
fn default_instance() -> String {
    format!("pid-{}", std::process::id())
}

/// Instrumentation scope of every kvlease span.
const SCOPE: &str = "kvlease";

/// Targets that never become OpenTelemetry spans: the transport under the OTLP exporter
/// (a span per export request would be exported in turn) and the SDK's own diagnostics.
const QUIET_TARGETS: &str = "h2=off,hyper=off,hyper_util=off,tower=off,tonic=off,\
                             opentelemetry=off,opentelemetry_sdk=off,opentelemetry_otlp=off";

/// Installs telemetry for the binary `service_name`: [`TelemetryConfig::from_env`] then
/// [`init_with`]. Keep the returned guard alive until the end of `main`.
pub fn init(service_name: &'static str) -> Result<TelemetryGuard> {
    init_with(TelemetryConfig::from_env(service_name))
}

/// Installs telemetry globally: the W3C trace-context propagator, the global tracer provider
/// (with the OTLP/gRPC exporter when `otlp_endpoint` is set) and the global subscriber
/// (fmt logs filtered by `log_filter`, OpenTelemetry spans filtered by `trace_filter`).
///
/// Fails if a global subscriber exists (a second `init` in one process).
pub fn init_with(config: TelemetryConfig) -> Result<TelemetryGuard> {
    opentelemetry::global::set_text_map_propagator(TraceContextPropagator::new());
    let provider = tracer_provider(&config)?;
    subscriber(&config, &provider)?.try_init()?;
    opentelemetry::global::set_tracer_provider(provider.clone());
    tracing::info!(
        service = %config.service_name,
        otlp_endpoint = config.otlp_endpoint.as_deref().unwrap_or("none"),
        "telemetry initialised"
    );
    Ok(TelemetryGuard {
        provider: Some(provider),
        timeout: config.export_timeout,
    })
}

/// A tracer provider for `config`, not installed anywhere: `service.name` resource, the
/// `kvlease.service` attribute on every span, and the OTLP/gRPC batch exporter when an
/// endpoint is configured. Tests use it (or [`tracer_provider_builder`]) with a scoped
/// subscriber from [`subscriber`]. Shut it down (or drop every clone) to flush.
pub fn tracer_provider(config: &TelemetryConfig) -> Result<SdkTracerProvider> {
    Ok(tracer_provider_builder(config)?.build())
}

/// [`tracer_provider`] before `build()`, so a test can add its own processor or exporter
/// (e.g. `.with_simple_exporter(InMemorySpanExporter::default())`).
pub fn tracer_provider_builder(config: &TelemetryConfig) -> Result<TracerProviderBuilder> {
    let instance = default_instance();
    let resource = crate::export::resource(&config.service_name, VERSION, &instance);
    let mut builder = SdkTracerProvider::builder()
        .with_resource(resource)
        .with_span_processor(ServiceAttributeProcessor {
            default_service: config.service_name.clone(),
        });
    if let Some(endpoint) = &config.otlp_endpoint {
        // Fail now on a bad endpoint rather than on the first span.
        drop(otlp_processor(endpoint, config)?);
        let (endpoint, config) = (endpoint.clone(), config.clone());
        let router =
            ServiceRouter::new(
                VERSION.to_owned(),
                instance,
                move |resource| match otlp_processor(&endpoint, &config) {
                    Ok(mut processor) => {
                        processor.set_resource(&resource);
                        Some(processor)
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "no span exporter for a service");
                        None
                    }
                },
            );
        builder = builder.with_span_processor(StepSampler::new(router));
    }
    Ok(builder)
}

/// The OTLP/gRPC batch processor, with its own one-thread tokio runtime for the exporter's
/// channel. The SDK's batch processor exports from its own thread; the tonic channel's I/O runs
/// on that private runtime, so export works whatever runtime (or none) the caller has, survives
/// the runtime it was created in (one per `#[tokio::test]`), and a shutdown that blocks a
/// current-thread runtime cannot starve it. Unlike the SDK's experimental async-runtime
/// processor, this one honours the shutdown timeout.
fn otlp_processor(endpoint: &str, config: &TelemetryConfig) -> Result<OtlpProcessor> {
    let timeout = config.export_timeout;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name("kvlease-otlp")
        .enable_all()
        .build()
        .map_err(Error::ExportRuntime)?;
    let exporter = {
        // The exporter's lazily connecting channel spawns its worker on the entered runtime.
        let _entered = runtime.enter();
        opentelemetry_otlp::SpanExporter::builder()
            .with_tonic()
            .with_endpoint(endpoint.to_owned())
            .with_timeout(timeout)
            .build()
            .map_err(|source| Error::Exporter {
                endpoint: endpoint.to_owned(),
                source,
            })?
    };
    let batch = BatchSpanProcessor::builder(exporter)
        .with_batch_config(
            BatchConfigBuilder::default()
                .with_scheduled_delay(config.batch.scheduled_delay)
                .with_max_queue_size(config.batch.max_queue_size)
                .with_max_export_batch_size(config.batch.max_export_batch_size)
                .build(),
        )
        .build();
    Ok(OtlpProcessor {
        batch,
        _runtime: ExportRuntime(Some(runtime)),
    })
}

/// The batch processor plus the runtime its exporter runs on. Fields drop in order: the
/// processor (and its export thread) first, then the runtime.
#[derive(Debug)]
struct OtlpProcessor {
    batch: BatchSpanProcessor,
    _runtime: ExportRuntime,
}

impl SpanProcessor for OtlpProcessor {
    fn on_start(&self, span: &mut opentelemetry_sdk::trace::Span, cx: &Context) {
        self.batch.on_start(span, cx);
    }

    fn on_end(&self, span: SpanData) {
        self.batch.on_end(span);
    }

    fn force_flush(&self) -> OTelSdkResult {
        self.batch.force_flush()
    }

    fn shutdown_with_timeout(&self, timeout: Duration) -> OTelSdkResult {
        self.batch.shutdown_with_timeout(timeout)
    }

    fn set_resource(&mut self, resource: &Resource) {
        self.batch.set_resource(resource);
    }
}

#[derive(Debug)]
struct ExportRuntime(Option<tokio::runtime::Runtime>);

impl Drop for ExportRuntime {
    fn drop(&mut self) {
        // A plain drop blocks, which panics inside an async context (the provider's last clone
        // may well be dropped there); nothing is left to wait for once the processor is gone.
        if let Some(runtime) = self.0.take() {
            runtime.shutdown_background();
        }
    }
}

/// The subscriber `init` installs, not installed: fmt logs filtered by `config.log_filter`
/// and an OpenTelemetry layer over `provider` filtered by `config.trace_filter`. Tests scope it
/// with `tracing::subscriber::set_default`.
pub fn subscriber(
    config: &TelemetryConfig,
    provider: &SdkTracerProvider,
) -> Result<impl Subscriber + for<'a> LookupSpan<'a> + Send + Sync + 'static> {
    let log_filter = parse_filter("log", &config.log_filter)?;
    let trace_filter = parse_filter("trace", &format!("{},{QUIET_TARGETS}", config.trace_filter))?;
    let tracer = provider.tracer(SCOPE);
    Ok(tracing_subscriber::registry()
        .with(tracing_subscriber::fmt::layer().with_filter(log_filter))
        .with(
            tracing_opentelemetry::layer()
                .with_tracer(tracer)
                .with_filter(trace_filter),
        ))
}

fn parse_filter(what: &'static str, filter: &str) -> Result<EnvFilter> {
    EnvFilter::try_new(filter).map_err(|source| Error::Filter {
        what,
        filter: filter.to_owned(),
        source,
    })
}

// === TelemetryGuard ===

/// Flushes and shuts down the tracer provider when dropped (or on [`TelemetryGuard::shutdown`]),
/// waiting at most the configured export timeout.
#[derive(Debug)]
#[must_use = "dropping the guard shuts telemetry down"]
pub struct TelemetryGuard {
    provider: Option<SdkTracerProvider>,
    timeout: Duration,
}

impl TelemetryGuard {
    /// Wraps a provider built with [`tracer_provider`], for code that installs its own
    /// subscriber but wants the same bounded shutdown.
    pub fn new(provider: SdkTracerProvider, timeout: Duration) -> Self {
        Self {
            provider: Some(provider),
            timeout,
        }
    }

    /// Exports what is buffered and shuts the provider down, within the export timeout.
    /// Blocks the calling thread for at most that long; the export itself runs on the
    /// exporter's own runtime, so this is safe at the end of any `main`, async or not.
    pub fn shutdown(mut self) -> Result<()> {
        self.shutdown_now()
    }

    fn shutdown_now(&mut self) -> Result<()> {
        let Some(provider) = self.provider.take() else {
            return Ok(());
        };
        provider
            .shutdown_with_timeout(self.timeout)
            .map_err(|err| Error::Shutdown {
                timeout: self.timeout,
                reason: err.to_string(),
            })
    }
}

impl Drop for TelemetryGuard {
    fn drop(&mut self) {
        if let Err(err) = self.shutdown_now() {
            // The subscriber is still installed, so this still reaches the logs.
            tracing::warn!(error = %err, "telemetry shutdown incomplete; some spans may be lost");
        }
    }
}

// === ServiceAttributeProcessor ===

/// Sets `kvlease.service` on every span from the [`LogicalService`] in its parent context,
/// falling back to the process's service name.
#[derive(Debug)]
struct ServiceAttributeProcessor {
    default_service: String,
}

impl SpanProcessor for ServiceAttributeProcessor {
    fn on_start(&self, span: &mut opentelemetry_sdk::trace::Span, cx: &Context) {
        use opentelemetry::trace::Span as _;
        let service = match cx.get::<LogicalService>() {
            Some(LogicalService(name)) => (*name).to_owned(),
            None => self.default_service.clone(),
        };
        span.set_attribute(KeyValue::new(SERVICE, service));
        if let Some(ServiceInstance(instance)) = cx.get::<ServiceInstance>() {
            span.set_attribute(KeyValue::new(SERVICE_INSTANCE, instance.to_string()));
        }
    }

    fn on_end(&self, _span: SpanData) {}

    fn force_flush(&self) -> OTelSdkResult {
        Ok(())
    }

    fn shutdown_with_timeout(&self, _timeout: Duration) -> OTelSdkResult {
        Ok(())
    }
}
