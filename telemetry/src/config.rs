//! [`TelemetryConfig`]: what a binary's telemetry looks like, from the standard environment
//! variables or built directly (tests).

use std::time::Duration;

/// `OTEL_EXPORTER_OTLP_ENDPOINT`: the collector's OTLP/gRPC endpoint, e.g. `http://otel:4317`.
pub const ENV_OTLP_ENDPOINT: &str = "OTEL_EXPORTER_OTLP_ENDPOINT";
/// `OTEL_EXPORTER_OTLP_TIMEOUT`: per-export timeout in milliseconds (OTel spec).
pub const ENV_OTLP_TIMEOUT: &str = "OTEL_EXPORTER_OTLP_TIMEOUT";
/// `OTEL_SERVICE_NAME`: overrides the service name the binary passes in.
pub const ENV_SERVICE_NAME: &str = "OTEL_SERVICE_NAME";
/// `RUST_LOG`: the fmt log filter.
pub const ENV_LOG_FILTER: &str = "RUST_LOG";
/// `KVLEASE_TRACE_FILTER`: which spans reach OpenTelemetry (default `info`).
pub const ENV_TRACE_FILTER: &str = "KVLEASE_TRACE_FILTER";

/// `OTEL_BSP_MAX_QUEUE_SIZE`: spans the batch processor holds before it drops new ones.
pub const ENV_BSP_MAX_QUEUE_SIZE: &str = "OTEL_BSP_MAX_QUEUE_SIZE";
/// `OTEL_BSP_SCHEDULE_DELAY`: milliseconds between two exports.
pub const ENV_BSP_SCHEDULE_DELAY: &str = "OTEL_BSP_SCHEDULE_DELAY";
/// `OTEL_BSP_MAX_EXPORT_BATCH_SIZE`: spans per export request at most.
pub const ENV_BSP_MAX_EXPORT_BATCH_SIZE: &str = "OTEL_BSP_MAX_EXPORT_BATCH_SIZE";

/// Default for [`BatchSettings::max_queue_size`]: 32 times the OTel spec's 2,048. A step
/// makes a few spans per sequence, so a burst of a few thousand requests against a collector
/// that answers slowly fills 2,048 within seconds; 65,536 spans of a few hundred bytes each
/// stay within tens of MB. A span that still finds the queue full is dropped (never blocks the
/// service) and the SDK logs the count at shutdown.
pub const DEFAULT_BSP_MAX_QUEUE_SIZE: usize = 65_536;
/// Default for [`BatchSettings::scheduled_delay`] (the spec says 5 s; 1 s keeps the queue short).
pub const DEFAULT_BSP_SCHEDULE_DELAY: Duration = Duration::from_secs(1);
/// Default for [`BatchSettings::max_export_batch_size`] (the spec's 512).
pub const DEFAULT_BSP_MAX_EXPORT_BATCH_SIZE: usize = 512;

/// The batch span processor's settings (`OTEL_BSP_*`), per exported service.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BatchSettings {
    /// Spans queued for export at most; beyond it new spans are dropped.
    pub max_queue_size: usize,
    /// Time between two exports.
    pub scheduled_delay: Duration,
    /// Spans per export request at most.
    pub max_export_batch_size: usize,
}

impl Default for BatchSettings {
    fn default() -> Self {
        Self {
            max_queue_size: DEFAULT_BSP_MAX_QUEUE_SIZE,
            scheduled_delay: DEFAULT_BSP_SCHEDULE_DELAY,
            max_export_batch_size: DEFAULT_BSP_MAX_EXPORT_BATCH_SIZE,
        }
    }
}

/// Default for [`TelemetryConfig::log_filter`] and [`TelemetryConfig::trace_filter`].
pub const DEFAULT_FILTER: &str = "info";
/// Default for [`TelemetryConfig::export_timeout`] (the OTel spec's 10 s).
pub const DEFAULT_EXPORT_TIMEOUT: Duration = Duration::from_secs(10);

/// How one binary (or one test) sets up tracing, export and logs.
///
/// Build it with [`TelemetryConfig::from_env`] in a `main.rs`, or directly in tests:
/// `TelemetryConfig { otlp_endpoint: Some(url), ..TelemetryConfig::new("kvlease-cache") }`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TelemetryConfig {
    /// The `service.name` resource attribute, and the default `kvlease.service` span attribute.
    pub service_name: String,
    /// OTLP/gRPC collector endpoint; `None` means no export (propagation still works).
    pub otlp_endpoint: Option<String>,
    /// `RUST_LOG`-style directives for the fmt log output.
    pub log_filter: String,
    /// `RUST_LOG`-style directives for which spans become OpenTelemetry spans. The transport
    /// crates (h2, hyper, tower, the OTel SDK) are always turned off here, so the exporter's own
    /// requests never produce spans that it would then export.
    pub trace_filter: String,
    /// Bound on one export RPC, on a flush and on shutdown: a vanished collector never hangs
    /// the process for longer than this.
    pub export_timeout: Duration,
    /// The batch span processor's queue and timing (`OTEL_BSP_*`).
    pub batch: BatchSettings,
}

impl TelemetryConfig {
    /// Defaults: no export, `info` logs and traces, 10 s export timeout.
    pub fn new(service_name: impl Into<String>) -> Self {
        Self {
            service_name: service_name.into(),
            otlp_endpoint: None,
            log_filter: DEFAULT_FILTER.to_owned(),
            trace_filter: DEFAULT_FILTER.to_owned(),
            export_timeout: DEFAULT_EXPORT_TIMEOUT,
            batch: BatchSettings::default(),
        }
    }

    /// Reads `OTEL_EXPORTER_OTLP_ENDPOINT`, `OTEL_EXPORTER_OTLP_TIMEOUT` (ms),
    /// `OTEL_SERVICE_NAME` (overrides `service_name`), `RUST_LOG` and `KVLEASE_TRACE_FILTER`.
    /// Empty variables count as unset; an unparsable timeout keeps the default.
    pub fn from_env(service_name: &str) -> Self {
        Self::from_lookup(service_name, |key| std::env::var(key).ok())
    }

    /// [`TelemetryConfig::from_env`] over any variable lookup, so that the parsing is testable
    /// without touching the process environment.
    pub fn from_lookup(service_name: &str, lookup: impl Fn(&str) -> Option<String>) -> Self {
        let get = |key: &str| lookup(key).filter(|value| !value.trim().is_empty());
        let mut config =
            Self::new(get(ENV_SERVICE_NAME).unwrap_or_else(|| service_name.to_owned()));
        config.otlp_endpoint = get(ENV_OTLP_ENDPOINT);
        if let Some(filter) = get(ENV_LOG_FILTER) {
            config.log_filter = filter;
        }
        if let Some(filter) = get(ENV_TRACE_FILTER) {
            config.trace_filter = filter;
        }
        let number = |key: &str| get(key).and_then(|v| v.trim().parse::<u64>().ok());
        if let Some(millis) = number(ENV_OTLP_TIMEOUT) {
            config.export_timeout = Duration::from_millis(millis);
        }
        if let Some(n) = number(ENV_BSP_MAX_QUEUE_SIZE).filter(|n| *n > 0) {
            config.batch.max_queue_size = usize::try_from(n).unwrap_or(usize::MAX);
        }
        if let Some(millis) = number(ENV_BSP_SCHEDULE_DELAY) {
            config.batch.scheduled_delay = Duration::from_millis(millis);
        }
        if let Some(n) = number(ENV_BSP_MAX_EXPORT_BATCH_SIZE).filter(|n| *n > 0) {
            config.batch.max_export_batch_size = usize::try_from(n).unwrap_or(usize::MAX);
        }
        config
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn lookup(vars: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let vars: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        move |key| vars.get(key).cloned()
    }

    #[test]
    fn defaults_without_variables() {
        let config = TelemetryConfig::from_lookup("kvlease-cache", lookup(&[]));
        assert_eq!(config, TelemetryConfig::new("kvlease-cache"));
        assert_eq!(config.otlp_endpoint, None);
        assert_eq!(config.log_filter, "info");
    }

    #[test]
    fn standard_variables_are_read_and_service_name_overridden() {
        let config = TelemetryConfig::from_lookup(
            "kvlease-cache",
            lookup(&[
                (ENV_OTLP_ENDPOINT, "http://collector:4317"),
                (ENV_SERVICE_NAME, "cache-eu-1"),
                (ENV_LOG_FILTER, "debug,h2=warn"),
                (ENV_TRACE_FILTER, "kvlease=debug"),
                (ENV_OTLP_TIMEOUT, "2500"),
                (ENV_BSP_MAX_QUEUE_SIZE, "4096"),
                (ENV_BSP_SCHEDULE_DELAY, "250"),
                (ENV_BSP_MAX_EXPORT_BATCH_SIZE, "128"),
            ]),
        );
        assert_eq!(
            config.batch,
            BatchSettings {
                max_queue_size: 4096,
                scheduled_delay: Duration::from_millis(250),
                max_export_batch_size: 128,
            }
        );
        assert_eq!(config.service_name, "cache-eu-1");
        assert_eq!(
            config.otlp_endpoint.as_deref(),
            Some("http://collector:4317")
        );
        assert_eq!(config.log_filter, "debug,h2=warn");
        assert_eq!(config.trace_filter, "kvlease=debug");
        assert_eq!(config.export_timeout, Duration::from_millis(2500));
    }

    #[test]
    fn empty_variables_count_as_unset() {
        let config = TelemetryConfig::from_lookup(
            "kvlease-worker",
            lookup(&[
                (ENV_OTLP_ENDPOINT, ""),
                (ENV_SERVICE_NAME, " "),
                (ENV_OTLP_TIMEOUT, "soon"),
            ]),
        );
        assert_eq!(config, TelemetryConfig::new("kvlease-worker"));
    }
}
