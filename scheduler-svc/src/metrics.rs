//! Prometheus metrics of the scheduler (served on `--metrics-listen`): step
//! and forward-RPC latency, queue depth, running sequences, refusals by
//! operation and reason, finished requests and preemptions by reason, and
//! per request: latency, time to first token, queue wait and token counts.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use kvlease_telemetry::metrics::{
    Counter, CounterVec, DEFAULT_LATENCY_BUCKETS, Described, Gauge, Histogram, HistogramVec,
    REQUEST_LATENCY_BUCKETS, Registry, names,
};

use crate::domain::{Finish, LeaseSpec, Outcome, Output, RequestId};
use crate::error::{Error, Result};
use crate::step::{Counters, PreemptCause};

/// The scheduler's instruments, and the clock of each live request.
#[derive(Debug, Clone)]
pub(crate) struct SchedulerMetrics {
    step: Histogram,
    forward: Histogram,
    queue: Gauge,
    running: Gauge,
    rejects: CounterVec<2>,
    finished: CounterVec<1>,
    preemptions: CounterVec<1>,
    request_seconds: HistogramVec<1>,
    ttft_seconds: Histogram,
    queue_wait_seconds: Histogram,
    prompt_tokens: Counter,
    output_tokens: Counter,
    reused_tokens: Counter,
    match_failures: Counter,
    live: HashMap<RequestId, Clock>,
}

/// When a live request arrived, and which of its firsts were seen.
#[derive(Debug, Clone, Copy)]
struct Clock {
    arrived: Instant,
    admitted: bool,
    first_token: bool,
}

/// Every `reason` of [`names::REQUESTS_FINISHED_TOTAL`]: each series exists,
/// at 0, from registration on, so a ratio of two of them (the dashboard's
/// reject ratio: rejected over all finished) is defined from the first scrape
/// and every series starts at the same scrape.
const FINISH_REASONS: [&str; 5] = ["length", "stop", "rejected", "cancelled", "error"];

/// What the scheduler's metrics endpoint exports: every family it registers.
pub fn metric_catalog() -> Result<Vec<Described>> {
    let mut registry = Registry::new();
    SchedulerMetrics::register(&mut registry)?;
    Ok(registry.described().to_vec())
}

impl SchedulerMetrics {
    /// Registers the instruments in `registry`.
    pub(crate) fn register(registry: &mut Registry) -> Result<Self> {
        let e = |e: kvlease_telemetry::Error| Error::Config(format!("metrics: {e}"));
        let r = registry;
        let metrics = Self {
            step: r
                .histogram(
                    names::STEP_DURATION_SECONDS,
                    "Scheduler step latency.",
                    DEFAULT_LATENCY_BUCKETS,
                )
                .map_err(e)?,
            forward: r
                .histogram(
                    names::FORWARD_RPC_DURATION_SECONDS,
                    "A step's forward pass seen by the scheduler, launch to the last worker's answer (RPCs included).",
                    DEFAULT_LATENCY_BUCKETS,
                )
                .map_err(e)?,
            queue: r
                .gauge(names::QUEUE_DEPTH, "Requests waiting for admission.")
                .map_err(e)?,
            running: r
                .gauge(names::RUNNING_SEQUENCES, "Sequences leased and running.")
                .map_err(e)?,
            rejects: r
                .counter_vec(
                    names::REJECTS_TOTAL,
                    "Sequences the cache refused the scheduler, by call and reason.",
                    [names::OP, names::REASON],
                )
                .map_err(e)?,
            finished: r
                .counter_vec(
                    names::REQUESTS_FINISHED_TOTAL,
                    "Requests finished, by reason.",
                    [names::REASON],
                )
                .map_err(e)?,
            preemptions: r
                .counter_vec(
                    names::PREEMPTIONS_TOTAL,
                    "Running requests preempted and requeued for recompute, by cause.",
                    [names::REASON],
                )
                .map_err(e)?,
            request_seconds: r
                .histogram_vec(
                    names::REQUEST_DURATION_SECONDS,
                    "Request latency, arrival to the last output, by finish reason.",
                    [names::REASON],
                    REQUEST_LATENCY_BUCKETS,
                )
                .map_err(e)?,
            ttft_seconds: r
                .histogram(
                    names::TIME_TO_FIRST_TOKEN_SECONDS,
                    "Time to first token, arrival to the first output token.",
                    REQUEST_LATENCY_BUCKETS,
                )
                .map_err(e)?,
            queue_wait_seconds: r
                .histogram(
                    names::QUEUE_WAIT_SECONDS,
                    "Queue wait, arrival to the request's first granted lease.",
                    REQUEST_LATENCY_BUCKETS,
                )
                .map_err(e)?,
            prompt_tokens: r
                .counter(
                    names::PROMPT_TOKENS_TOTAL,
                    "Prompt tokens of the requests submitted.",
                )
                .map_err(e)?,
            output_tokens: r
                .counter(
                    names::OUTPUT_TOKENS_TOTAL,
                    "Tokens generated and streamed to clients.",
                )
                .map_err(e)?,
            reused_tokens: r
                .counter(
                    names::REUSED_TOKENS_TOTAL,
                    "Prompt tokens served from cached blocks instead of computed.",
                )
                .map_err(e)?,
            match_failures: r
                .counter(
                    names::ROUTING_MATCH_FAILURES_TOTAL,
                    "Match calls that failed: kv-aware routing fell back to least committed for the step.",
                )
                .map_err(e)?,
            live: HashMap::new(),
        };
        for reason in FINISH_REASONS {
            metrics.finished.with([reason]);
        }
        Ok(metrics)
    }

    /// A `Match` failed: the step routed by load alone.
    pub(crate) fn match_failed(&self) {
        self.match_failures.inc();
    }

    pub(crate) fn step(&self, d: Duration) {
        self.step.observe(d.as_secs_f64());
    }

    /// One step's forward pass, RPCs included.
    pub(crate) fn forward(&self, d: Duration) {
        self.forward.observe(d.as_secs_f64());
    }

    /// One refused sequence of a `method` call (`"Lease"`, `"Extend"`),
    /// counted under the lower-case op the cache uses too.
    pub(crate) fn reject(&self, method: &str, reason: &str) {
        let op = match method {
            "Lease" => names::OP_LEASE,
            "Extend" => names::OP_EXTEND,
            other => other,
        };
        self.rejects.with([op, reason]).inc();
    }

    /// A request entered the scheduler now.
    pub(crate) fn arrived(&mut self, id: RequestId, prompt_tokens: usize) {
        self.arrived_at(id, prompt_tokens, Instant::now());
    }

    fn arrived_at(&mut self, id: RequestId, prompt_tokens: usize, now: Instant) {
        self.prompt_tokens.inc_by(prompt_tokens as u64);
        self.live.insert(
            id,
            Clock {
                arrived: now,
                admitted: false,
                first_token: false,
            },
        );
    }

    /// The outcomes of one admission `Lease` over `specs`: the first grant of
    /// a request ends its queue wait.
    pub(crate) fn admitted(&mut self, specs: &[LeaseSpec], outcomes: &[Outcome]) {
        let now = Instant::now();
        for outcome in outcomes {
            let Outcome::Grant(grant) = outcome else {
                continue;
            };
            let Some(spec) = specs.iter().find(|s| s.seq_id == grant.seq_id) else {
                continue;
            };
            if let Some(clock) = self.live.get_mut(&spec.request)
                && !clock.admitted
            {
                clock.admitted = true;
                self.queue_wait_seconds
                    .observe(now.duration_since(clock.arrived).as_secs_f64());
            }
        }
    }

    /// An output on its way to the request's stream.
    pub(crate) fn output(&mut self, output: &Output) {
        self.output_at(output, Instant::now());
    }

    fn output_at(&mut self, output: &Output, now: Instant) {
        match output {
            Output::Tokens {
                request,
                tokens,
                reused_tokens,
                ..
            } => {
                self.output_tokens.inc_by(tokens.len() as u64);
                if let Some(n) = reused_tokens {
                    self.reused_tokens.inc_by(u64::from(n.0));
                }
                if let Some(clock) = self.live.get_mut(request)
                    && !clock.first_token
                    && !tokens.is_empty()
                {
                    clock.first_token = true;
                    self.ttft_seconds
                        .observe(now.duration_since(clock.arrived).as_secs_f64());
                }
            }
            // a request of several samples ends with its last
            Output::Finished {
                request,
                finish,
                last: true,
                ..
            } => {
                if let Some(clock) = self.live.remove(request) {
                    self.request_seconds
                        .with([finish_reason(finish)])
                        .observe(now.duration_since(clock.arrived).as_secs_f64());
                }
            }
            Output::Finished { .. } => {}
        }
    }

    /// Sets the gauges and adds what the counters gained since `before`.
    pub(crate) fn update(&self, queued: u32, running: u32, before: &Counters, now: &Counters) {
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
        for cause in PreemptCause::ALL {
            let n = gained(before.preempted_by(cause), now.preempted_by(cause));
            if n > 0 {
                self.preemptions.with([cause.as_str()]).inc_by(n);
            }
        }
    }
}

/// The `reason` label of a finished request, as in
/// [`names::REQUESTS_FINISHED_TOTAL`].
fn finish_reason(finish: &Finish) -> &'static str {
    match finish {
        Finish::Length => "length",
        Finish::Stop => "stop",
        Finish::Cancelled(_) => "cancelled",
        Finish::Rejected(_) => "rejected",
        Finish::Error(_) => "error",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn metrics() -> (Registry, SchedulerMetrics) {
        let mut registry = Registry::new();
        let m = SchedulerMetrics::register(&mut registry).unwrap_or_else(|e| panic!("{e}"));
        (registry, m)
    }

    /// Fails naming the first of `lines` that `registry` does not render.
    fn assert_renders<S: AsRef<str>>(registry: &Registry, lines: &[S]) {
        let text = registry.render();
        for line in lines {
            let line = line.as_ref();
            assert!(text.contains(line), "{line:?} not in\n{text}");
        }
    }

    #[test]
    fn a_request_is_timed_from_arrival_and_its_tokens_counted() {
        let (registry, mut m) = metrics();
        let t0 = Instant::now();
        let id = RequestId(7);
        m.arrived_at(id, 12, t0);
        let tokens = |tokens: Vec<u32>, reused| Output::Tokens {
            request: id,
            index: 0,
            tokens,
            reused_tokens: reused,
            logprobs: Vec::new(),
            prompt_logprobs: None,
        };
        m.output_at(
            &tokens(vec![5], Some((8, 0))),
            t0 + Duration::from_millis(300),
        );
        m.output_at(&tokens(vec![6, 7], None), t0 + Duration::from_millis(400));
        m.output_at(
            &Output::Finished {
                request: id,
                index: 0,
                finish: Finish::Length,
                preemptions: 0,
                last: true,
                cumulative_logprob: None,
            },
            t0 + Duration::from_millis(700),
        );
        assert!(m.live.is_empty(), "a finished request is forgotten");
        assert_renders(
            &registry,
            &[
                "kvlease_prompt_tokens_total 12\n",
                "kvlease_output_tokens_total 3\n",
                "kvlease_reused_tokens_total 8\n",
                // the first token at 300 ms, counted once
                "kvlease_time_to_first_token_seconds_bucket{le=\"0.25\"} 0\n",
                "kvlease_time_to_first_token_seconds_bucket{le=\"0.5\"} 1\n",
                "kvlease_time_to_first_token_seconds_count 1\n",
                "kvlease_request_duration_seconds_bucket{reason=\"length\",le=\"0.5\"} 0\n",
                "kvlease_request_duration_seconds_bucket{reason=\"length\",le=\"1\"} 1\n",
            ],
        );
    }

    #[test]
    fn every_finish_reason_is_exported_at_zero_before_any_request() {
        let (registry, m) = metrics();
        let zeros = FINISH_REASONS
            .map(|reason| format!("kvlease_requests_finished_total{{reason=\"{reason}\"}} 0\n"));
        assert_renders(&registry, &zeros);
        let after = Counters {
            rejected: 2,
            finished_length: 3,
            ..Counters::default()
        };
        m.update(0, 0, &Counters::default(), &after);
        assert_renders(
            &registry,
            &[
                "kvlease_requests_finished_total{reason=\"rejected\"} 2\n",
                "kvlease_requests_finished_total{reason=\"length\"} 3\n",
                "kvlease_requests_finished_total{reason=\"stop\"} 0\n",
            ],
        );
    }

    #[test]
    fn refusals_use_the_caches_lower_case_op_and_preemptions_their_cause() {
        let (registry, m) = metrics();
        m.reject("Extend", "POOL_EXHAUSTED");
        m.reject("Lease", "EXCEEDS_CAPACITY");
        let mut after = Counters {
            preemptions: 3,
            ..Counters::default()
        };
        after.preemptions_by[PreemptCause::PoolExhausted.index()] = 2;
        after.preemptions_by[PreemptCause::WorkerFailed.index()] = 1;
        m.update(0, 0, &Counters::default(), &after);
        assert_renders(
            &registry,
            &[
                "kvlease_rejects_total{op=\"extend\",reason=\"POOL_EXHAUSTED\"} 1\n",
                "kvlease_rejects_total{op=\"lease\",reason=\"EXCEEDS_CAPACITY\"} 1\n",
                "kvlease_preemptions_total{reason=\"POOL_EXHAUSTED\"} 2\n",
                "kvlease_preemptions_total{reason=\"WORKER_FAILED\"} 1\n",
            ],
        );
        let text = registry.render();
        assert!(!text.contains("QUOTA_EXCEEDED"), "{text}");
    }
}
