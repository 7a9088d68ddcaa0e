//! The worker's Prometheus series.

use kvlease_telemetry::metrics::{self, Counter, Histogram, Registry, names};

use crate::worker::WorkerInfo;

/// The worker's Prometheus series.
#[derive(Debug, Clone)]
pub(crate) struct WorkerMetrics {
    pub(crate) forward_seconds: Histogram,
    pub(crate) forward_tokens: Counter,
    pub(crate) forward_rejected: Counter,
}

impl WorkerMetrics {
    /// Registers the worker's series in `registry`, with each pool's size.
    pub(crate) fn register(registry: &Registry, info: &WorkerInfo) -> crate::Result<Self> {
        let fail = |e: kvlease_telemetry::Error| crate::Error::Config(format!("metrics: {e}"));
        let pool_blocks = registry
            .gauge_vec(
                names::POOL_BLOCKS_TOTAL,
                "Blocks of each KV pool of the worker.",
                [names::WINDOW],
            )
            .map_err(fail)?;
        for pool in &info.pools {
            pool_blocks
                .with([&pool.window.to_string()])
                .set(f64::from(pool.num_blocks));
        }
        Ok(WorkerMetrics {
            forward_seconds: registry
                .histogram(
                    names::FORWARD_DURATION_SECONDS,
                    "Compute time of one Forward on the worker.",
                    metrics::DEFAULT_LATENCY_BUCKETS,
                )
                .map_err(fail)?,
            forward_tokens: registry
                .counter(
                    "kvlease_worker_forward_tokens_total",
                    "Input tokens run by accepted Forward calls.",
                )
                .map_err(fail)?,
            forward_rejected: registry
                .counter(
                    "kvlease_worker_forward_rejected_total",
                    "Forward calls refused (invalid batch or backend failure).",
                )
                .map_err(fail)?,
        })
    }
}
