//! Prometheus metrics of the scheduler (served on `--metrics-listen`):
//! step and forward latency, queue depth, running sequences, refusals by
//! operation and reason, finished requests by reason, preemptions.

use std::time::Duration;

use kvlease_telemetry::metrics::{
    Counter, CounterVec, DEFAULT_LATENCY_BUCKETS, Gauge, Histogram, Registry, names,
};

use crate::error::{Error, Result};
use crate::step::Counters;

/// Finished requests by reason.
const FINISHED_TOTAL: &str = "kvlease_requests_finished_total";
/// Requests preempted and requeued for recompute.
const PREEMPTIONS_TOTAL: &str = "kvlease_preemptions_total";

/// The scheduler's instruments.
#[derive(Debug, Clone)]
pub struct SchedulerMetrics {
    step: Histogram,
    forward: Histogram,
    queue: Gauge,
    running: Gauge,
    rejects: CounterVec<2>,
    finished: CounterVec<1>,
    preemptions: Counter,
}

impl SchedulerMetrics {
    /// Registers the instruments in `registry`.
    pub fn register(registry: &Registry) -> Result<Self> {
        let e = |e: kvlease_telemetry::Error| Error::Config(format!("metrics: {e}"));
        Ok(Self {
            step: registry
                .histogram(
                    names::STEP_DURATION_SECONDS,
                    "Scheduler step latency.",
                    DEFAULT_LATENCY_BUCKETS,
                )
                .map_err(e)?,
            forward: registry
                .histogram(
                    names::FORWARD_DURATION_SECONDS,
                    "Forward pass latency seen by the scheduler (RPC included).",
                    DEFAULT_LATENCY_BUCKETS,
                )
                .map_err(e)?,
            queue: registry
                .gauge(names::QUEUE_DEPTH, "Requests waiting for admission.")
                .map_err(e)?,
            running: registry
                .gauge(names::RUNNING_SEQUENCES, "Sequences leased and running.")
                .map_err(e)?,
            rejects: registry
                .counter_vec(
                    names::REJECTS_TOTAL,
                    "Sequences refused by the cache.",
                    [names::OP, names::REASON],
                )
                .map_err(e)?,
            finished: registry
                .counter_vec(
                    FINISHED_TOTAL,
                    "Requests finished, by reason.",
                    [names::REASON],
                )
                .map_err(e)?,
            preemptions: registry
                .counter(PREEMPTIONS_TOTAL, "Requests preempted for recompute.")
                .map_err(e)?,
        })
    }

    pub fn step(&self, d: Duration) {
        self.step.observe_duration(d);
    }

    pub fn forward(&self, d: Duration) {
        self.forward.observe_duration(d);
    }

    pub fn reject(&self, op: &str, reason: &str) {
        self.rejects.with([op, reason]).inc();
    }

    /// Sets the gauges and adds what the counters gained since `before`.
    pub fn update(&self, queued: u32, running: u32, before: &Counters, now: &Counters) {
        self.queue.set(f64::from(queued));
        self.running.set(f64::from(running));
        let gained = |a: u64, b: u64| b.saturating_sub(a);
        for (reason, n) in [
            (
                "length",
                gained(before.finished_length, now.finished_length),
            ),
            ("stop", gained(before.finished_stop, now.finished_stop)),
            ("cancelled", gained(before.cancelled, now.cancelled)),
            ("rejected", gained(before.rejected, now.rejected)),
            ("error", gained(before.errors, now.errors)),
        ] {
            if n > 0 {
                self.finished.with([reason]).inc_by(n);
            }
        }
        let p = gained(before.preemptions, now.preemptions);
        if p > 0 {
            self.preemptions.inc_by(p);
        }
    }
}
