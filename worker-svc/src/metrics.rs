//! The worker's Prometheus series.

use kvlease_telemetry::metrics::{self, Counter, Described, GaugeVec, Histogram, Registry, names};

use crate::worker::WorkerInfo;

/// The worker's Prometheus series.
#[derive(Debug, Clone)]
pub(crate) struct WorkerMetrics {
    pub(crate) forward_seconds: Histogram,
    pub(crate) forward_tokens: Counter,
    pub(crate) forward_rejected: Counter,
    pub(crate) peer_pulled_bytes: Counter,
    pub(crate) peer_pull_failures: Counter,
    pub(crate) peer_served_bytes: Counter,
    pool_blocks: GaugeVec<1>,
}

/// What the worker's metrics endpoint exports: every family it registers.
pub fn metric_catalog() -> crate::Result<Vec<Described>> {
    let mut registry = Registry::new();
    WorkerMetrics::register(&mut registry)?;
    Ok(registry.described().to_vec())
}

impl WorkerMetrics {
    /// Registers the worker's series in `registry`.
    pub(crate) fn register(registry: &mut Registry) -> crate::Result<Self> {
        let fail = |e: kvlease_telemetry::Error| crate::Error::Config(format!("metrics: {e}"));
        Ok(WorkerMetrics {
            forward_seconds: registry
                .histogram(
                    names::FORWARD_COMPUTE_DURATION_SECONDS,
                    "Compute time of one Forward on the worker (lock wait excluded).",
                    metrics::DEFAULT_LATENCY_BUCKETS,
                )
                .map_err(fail)?,
            forward_tokens: registry
                .counter(
                    names::WORKER_FORWARD_TOKENS_TOTAL,
                    "Input tokens run by accepted Forward calls.",
                )
                .map_err(fail)?,
            forward_rejected: registry
                .counter(
                    names::WORKER_FORWARD_REJECTED_TOTAL,
                    "Forward calls refused (invalid batch or backend failure).",
                )
                .map_err(fail)?,
            peer_pulled_bytes: registry
                .counter(
                    names::WORKER_PEER_PULLED_BYTES_TOTAL,
                    "Bytes of K/V pulled from peer workers (peer pulls and hand-offs).",
                )
                .map_err(fail)?,
            peer_pull_failures: registry
                .counter(
                    names::WORKER_PEER_PULL_FAILURES_TOTAL,
                    "Sequences whose peer pull failed (each sat its pass out).",
                )
                .map_err(fail)?,
            peer_served_bytes: registry
                .counter(
                    names::WORKER_PEER_SERVED_BYTES_TOTAL,
                    "Bytes of K/V served to peer workers' pulls.",
                )
                .map_err(fail)?,
            pool_blocks: registry
                .gauge_vec(
                    names::WORKER_POOL_CAPACITY_BLOCKS,
                    "Blocks of each KV pool the worker allocated.",
                    [names::WINDOW],
                )
                .map_err(fail)?,
        })
    }

    /// Records each pool's size.
    pub(crate) fn set_pools(&self, info: &WorkerInfo) {
        for pool in &info.pools {
            self.pool_blocks
                .with([&pool.window.to_string()])
                .set(f64::from(pool.num_blocks));
        }
    }
}
