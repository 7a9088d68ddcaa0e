//! What the step loop writes into each request's trace, and how it samples
//! its step traces.
//!
//! A request's trace has its `Generate` server span as root. The loop keeps
//! that span (not only its context) while the request lives and adds under
//! it: `queue` (from submission to the admission lease), one `lease` span
//! per admission (its context travels as the lease item's `traceparent`, so
//! the cache's span for the sequence is its child), `preempt` per
//! preemption, one `forward` summary (steps taken part in, time on the
//! worker) and one `release` span per release (the cache's release span is
//! its child). Each prefill chunk's Forward item carries the request's
//! context ([`ChunkTrace`]), so the worker records the chunk in the trace;
//! decode items carry none (a decode step of hundreds of sequences records
//! no span per sequence: the `forward` summary stands for them). Rejects are recorded by the cache in the same trace, and by
//! the `Generate` span itself (see `service.rs`).
//!
//! Steps are their own traces (`step` -> batched calls), exported when the
//! loop marks them: steps with a reject or a preemption always, others 1 in
//! N (see [`StepSampling`]); the telemetry crate's step sampler drops the
//! rest.

use std::collections::HashMap;
use std::time::Duration;

use kvlease_telemetry::OpenTelemetrySpanExt as _;
use kvlease_telemetry::attributes::{self, STEP_SAMPLED};
use kvlease_telemetry::opentelemetry::trace::SpanContext;
use tracing::Span;
use tracing::field::Empty;

use crate::domain::{ForwardItem, LeaseSpec, Outcome, RequestId, SeqId, Step};
use crate::step::Preemption;

/// The service name in traces (and the scheduler's logical service in
/// every span it starts).
pub const SERVICE: &str = "kvlease-scheduler";

/// One live request's spans.
#[derive(Debug)]
struct RequestTrace {
    root: Span,
    /// The root's `traceparent` and span context, taken once at submission
    /// (they never change): every step's batched calls name them for each
    /// of their sequences, and deriving them from the span costs a context
    /// lookup and a propagator map per sequence and step.
    traceparent: String,
    span_context: SpanContext,
    queue: Option<Span>,
    forward: Option<ForwardSummary>,
    seq_ids: Vec<i64>,
    /// Sequences still held at the cache: the trace outlives the request
    /// until their releases are recorded in it.
    held: std::collections::HashSet<SeqId>,
    finished: bool,
}

#[derive(Debug)]
struct ForwardSummary {
    span: Span,
    steps: u64,
    worker_time: Duration,
}

/// What the worker records of one traced prefill chunk, in its request's
/// trace (`ForwardSequence.trace`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ChunkTrace {
    /// The request's `Generate` span.
    pub traceparent: String,
    /// Prompt tokens the grant reused (partial copies included).
    pub reused_tokens: u32,
    /// Of those, blocks onboarded from the host tier.
    pub onboarded_blocks: u32,
    /// The pool group (replica) the sequence runs in.
    pub replica: String,
}

/// A granted sequence whose prompt is not all computed yet.
#[derive(Debug)]
struct Prefilling {
    /// Position after the lease's prompt: items before it are prefill.
    prompt_end: u32,
    chunk: ChunkTrace,
}

/// The traces of the live requests, by request and by sequence.
#[derive(Debug, Default)]
pub(crate) struct RequestTraces {
    requests: HashMap<RequestId, RequestTrace>,
    seqs: HashMap<SeqId, RequestId>,
    prefilling: HashMap<SeqId, Prefilling>,
}

impl RequestTraces {
    /// A request was submitted with `root` (its `Generate` span): its queue
    /// wait starts.
    pub(crate) fn accept(&mut self, id: RequestId, root: Span) {
        let queue = tracing::info_span!(parent: &root, "queue", kvlease.request = id.get() as i64);
        let context = root.context();
        self.requests.insert(
            id,
            RequestTrace {
                traceparent: kvlease_telemetry::traceparent(&context),
                span_context: kvlease_telemetry::opentelemetry::trace::TraceContextExt::span(
                    &context,
                )
                .span_context()
                .clone(),
                root,
                queue: Some(queue),
                forward: None,
                seq_ids: Vec::new(),
                held: Default::default(),
                finished: false,
            },
        );
    }

    /// The trace of `seq`'s request, if it has one.
    fn of_seq(&self, seq: SeqId) -> Option<&RequestTrace> {
        self.seqs.get(&seq).and_then(|r| self.requests.get(r))
    }

    /// The `traceparent` of each sequence's request (empty when it has
    /// none, or is `None`), for a batched call.
    pub(crate) fn traceparents(&self, seqs: impl Iterator<Item = Option<SeqId>>) -> Vec<String> {
        seqs.map(|s| {
            s.and_then(|s| self.of_seq(s))
                .map(|t| t.traceparent.clone())
                .unwrap_or_default()
        })
        .collect()
    }

    /// The span contexts of the requests `seqs` serve, to link a step's
    /// batched call to every request in it.
    pub(crate) fn links(&self, seqs: impl Iterator<Item = SeqId>) -> Vec<SpanContext> {
        seqs.filter_map(|s| self.of_seq(s))
            .map(|t| t.span_context.clone())
            .collect()
    }

    /// Admission leases for `specs`: ends the queue wait and opens a `lease`
    /// span per sequence (with the replica it was routed to). Returns the
    /// spans (kept open for the call) and their `traceparent`s (the items'
    /// trace contexts).
    pub(crate) fn leasing(&mut self, step: Step, specs: &[LeaseSpec]) -> (Vec<Span>, Vec<String>) {
        let mut spans = Vec::new();
        let mut parents = Vec::new();
        for spec in specs {
            let seq = spec.seq_id;
            self.seqs.insert(seq, spec.request);
            let span = match self.requests.get_mut(&spec.request) {
                // disaggregated serving: the decode group's lease, whose
                // grant's child span has the forced pull's figures
                Some(t) if spec.handoff_of.is_some() => {
                    t.held.insert(seq);
                    t.seq_ids.push(seq.get() as i64);
                    let tokens = spec.prompt_tokens.len().saturating_sub(1) as i64;
                    tracing::info_span!(parent: &t.root, "handoff", kvlease.seq_id = seq.get() as i64,
                        kvlease.step = step.get() as i64, kvlease.replica = spec.pool_group.as_str(),
                        kvlease.handoff.to = spec.pool_group.as_str(), kvlease.handoff.tokens = tokens,
                        kvlease.handoff.from = Empty, kvlease.handoff.transfer_id = Empty,
                        kvlease.outcome = Empty)
                }
                Some(t) => {
                    t.queue = None;
                    t.held.insert(seq);
                    t.seq_ids.push(seq.get() as i64);
                    tracing::info_span!(parent: &t.root, "lease", kvlease.seq_id = seq.get() as i64,
                        kvlease.step = step.get() as i64, kvlease.replica = spec.pool_group.as_str(),
                        kvlease.outcome = Empty)
                }
                None => Span::none(),
            };
            parents.push(kvlease_telemetry::traceparent(&span.context()));
            spans.push(span);
        }
        (spans, parents)
    }

    /// The cache's answers to the admission leases of `specs` (`spans`, from
    /// [`Self::leasing`]): each lease span's outcome and, for a granted
    /// sequence of a traced request, what its prefill chunks will show.
    pub(crate) fn leased(&mut self, spans: Vec<Span>, specs: &[LeaseSpec], outcomes: &[Outcome]) {
        for ((lease, spec), outcome) in spans.iter().zip(specs).zip(outcomes) {
            let Outcome::Grant(grant) = outcome else {
                lease.record("kvlease.outcome", "reject");
                continue;
            };
            lease.record("kvlease.outcome", "grant");
            if spec.handoff_of.is_some() {
                let transfer = grant.peer_copies.first();
                let from = transfer.map_or("", |c| c.src_group.as_str());
                lease.record(attributes::HANDOFF_FROM, from);
                let id = transfer.map_or(0, |c| c.transfer_id);
                lease.record(attributes::HANDOFF_TRANSFER, id as i64);
            }
            let Some(t) = self.requests.get(&spec.request) else {
                continue;
            };
            let onboarded = grant.tier_copies.iter().filter(|c| c.onboards()).count();
            self.prefilling.insert(
                spec.seq_id,
                Prefilling {
                    prompt_end: u32::try_from(spec.prompt_tokens.len()).unwrap_or(u32::MAX),
                    chunk: ChunkTrace {
                        traceparent: t.traceparent.clone(),
                        reused_tokens: grant.reused_tokens,
                        onboarded_blocks: u32::try_from(onboarded).unwrap_or(u32::MAX),
                        replica: spec.pool_group.clone(),
                    },
                },
            );
        }
    }

    /// For each item of a forward batch, what the worker records of it in
    /// its request's trace: a prefill chunk of a traced request gets its
    /// [`ChunkTrace`], anything else (every decode item) none. Empty when no
    /// sequence is prefilling (steady decode: no per-item work).
    pub(crate) fn forward_items(&mut self, items: &[ForwardItem]) -> Vec<Option<ChunkTrace>> {
        if self.prefilling.is_empty() {
            return Vec::new();
        }
        items
            .iter()
            .map(|item| {
                let p = self.prefilling.get(&item.seq_id)?;
                if item.start_pos >= p.prompt_end {
                    return None;
                }
                let chunk = p.chunk.clone();
                let end = item.start_pos as usize + item.tokens.len();
                if end >= p.prompt_end as usize {
                    // its last chunk: the rest of the sequence is decode
                    self.prefilling.remove(&item.seq_id);
                }
                Some(chunk)
            })
            .collect()
    }

    /// A preemption, as a span in the request's trace.
    pub(crate) fn preempted(&self, p: &Preemption) {
        if let Some(t) = self.requests.get(&p.request) {
            let _span = tracing::info_span!(parent: &t.root, "preempt",
                kvlease.seq_id = p.seq_id.get() as i64,
                kvlease.preempt_cause = p.cause,
                kvlease.tokens_to_recompute = i64::from(p.tokens_to_recompute));
        }
    }

    /// A forward pass that took `took` on the worker included `seqs`.
    pub(crate) fn forwarded(&mut self, seqs: &[SeqId], took: Duration) {
        for seq in seqs {
            let Some(t) = self.seqs.get(seq).and_then(|r| self.requests.get_mut(r)) else {
                continue;
            };
            let summary = t.forward.get_or_insert_with(|| ForwardSummary {
                span: tracing::info_span!(parent: &t.root, "forward",
                    kvlease.forward_steps = Empty, kvlease.worker_time_us = Empty),
                steps: 0,
                worker_time: Duration::ZERO,
            });
            // recorded once, when the request ends: a field recorded again
            // is exported again
            summary.steps += 1;
            summary.worker_time += took;
        }
    }

    /// `release` spans for a release batch (fenced at `fence`), in the
    /// traces of the sequences' requests; with their `traceparent`s.
    pub(crate) fn releasing(
        &self,
        seqs: &[SeqId],
        fence: Option<Step>,
    ) -> (Vec<Span>, Vec<String>) {
        let mut spans = Vec::new();
        let mut parents = Vec::new();
        for seq in seqs {
            let span = match self.seqs.get(seq).and_then(|r| self.requests.get(r)) {
                Some(t) => tracing::info_span!(parent: &t.root, "release",
                    kvlease.seq_id = seq.get() as i64,
                    kvlease.fence_step = fence.map_or(-1, |f| f.get() as i64)),
                None => Span::none(),
            };
            parents.push(kvlease_telemetry::traceparent(&span.context()));
            spans.push(span);
        }
        (spans, parents)
    }

    /// The core forgot `seq` (released, or never leased).
    pub(crate) fn forget_seq(&mut self, seq: SeqId) {
        self.prefilling.remove(&seq);
        let Some(id) = self.seqs.remove(&seq) else {
            return;
        };
        if let Some(t) = self.requests.get_mut(&id) {
            t.held.remove(&seq);
            if t.finished && t.held.is_empty() {
                self.requests.remove(&id);
            }
        }
    }

    /// The request ended: its queue and forward spans close; the trace (and
    /// its root) stays until the sequences it still holds are released.
    pub(crate) fn finish(&mut self, id: RequestId) {
        let Some(t) = self.requests.get_mut(&id) else {
            return;
        };
        t.queue = None;
        if let Some(summary) = t.forward.take() {
            summary
                .span
                .record("kvlease.forward_steps", summary.steps as i64);
            summary.span.record(
                "kvlease.worker_time_us",
                i64::try_from(summary.worker_time.as_micros()).unwrap_or(i64::MAX),
            );
        }
        // set once: `set_attribute` adds, it does not replace
        t.root.set_attribute(
            attributes::SEQ_IDS,
            kvlease_telemetry::opentelemetry::Value::Array(t.seq_ids.clone().into()),
        );
        t.finished = true;
        if t.held.is_empty() {
            self.requests.remove(&id);
        }
    }
}

/// Which step traces are exported: those with a reject or a preemption,
/// and every `one_in`-th step besides (0: none besides).
#[derive(Debug, Clone, Copy)]
pub(crate) struct StepSampling {
    pub one_in: u64,
}

impl StepSampling {
    /// Marks `span` (a step's root) with why it is exported, or `"no"`.
    pub(crate) fn mark(&self, span: &Span, step: Step, rejects: bool, preemptions: bool) {
        let why = if rejects {
            "reject"
        } else if preemptions {
            "preemption"
        } else if self.one_in > 0 && step.get().is_multiple_of(self.one_in) {
            "one_in_n"
        } else {
            "no"
        };
        span.record(STEP_SAMPLED, why);
    }
}
