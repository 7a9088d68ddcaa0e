//! The traces of the cache's calls: each sequence's outcome in its own
//! request's trace (grants, rejects with their figures, evictions), releases
//! and the fenced-release links a `CompleteStep` carries to the releases
//! whose blocks it freed. Read by the handlers after the core answered;
//! nothing here changes the cache.

use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;

use kvlease_proto::v1 as pb;
use kvlease_telemetry::OpenTelemetrySpanExt as _;
use kvlease_telemetry::attributes;
use kvlease_telemetry::opentelemetry::Value;
use kvlease_telemetry::opentelemetry::trace::{SpanContext, TraceContextExt as _};
use tracing::Span;

use crate::cache::Evicted;
use crate::ids::{SeqId, SessionId, Step};
use crate::lease::ReleaseResult;

/// Fenced-release spans remembered per session, so the `CompleteStep` that
/// frees their blocks can link to them. Bounded: the oldest steps go first.
const FENCE_LINKS_PER_SESSION: usize = 4096;

/// The span contexts of fenced releases, by session and fence step.
#[derive(Debug, Default)]
pub(crate) struct FenceLinks {
    by_session: HashMap<SessionId, BTreeMap<Step, Vec<SpanContext>>>,
}

impl FenceLinks {
    pub(crate) fn remember(&mut self, session: SessionId, step: Step, cx: SpanContext) {
        if !cx.is_valid() {
            return;
        }
        let steps = self.by_session.entry(session).or_default();
        steps.entry(step).or_default().push(cx);
        while steps.values().map(Vec::len).sum::<usize>() > FENCE_LINKS_PER_SESSION {
            steps.pop_first();
        }
    }

    pub(crate) fn take_through(&mut self, session: SessionId, step: Step) -> Vec<SpanContext> {
        let Some(steps) = self.by_session.get_mut(&session) else {
            return Vec::new();
        };
        let later = steps.split_off(&Step(step.0.saturating_add(1)));
        let due = std::mem::replace(steps, later);
        if steps.is_empty() {
            self.by_session.remove(&session);
        }
        due.into_values().flatten().collect()
    }
}

/// Each sequence's outcome in its own request's trace (`traces[i]`, the
/// items' `traceparent`s), linked to this batch call's span: a `Reject`
/// error span with the figures for a refusal and, when `grants` is set (an
/// admission `Lease`, not every decode step's `Extend`), a `Grant` span.
/// Items without a trace context get their rejects under the call's span.
/// The cached blocks a sequence's allocation evicted get an `Evict` span
/// (pool, blocks) in its trace.
pub(crate) fn trace_outcomes(
    outcomes: &[pb::SequenceOutcome],
    traces: &[String],
    grants: bool,
    evicted: &[Evicted],
) {
    let batch = kvlease_telemetry::span_context(&Span::current());
    let item_trace = |i: usize| item_context(traces, i);
    let mut index = HashMap::new();
    for (i, o) in outcomes.iter().enumerate().filter(|_| !evicted.is_empty()) {
        let seq_id = match &o.outcome {
            Some(pb::sequence_outcome::Outcome::Grant(g)) => g.seq_id,
            Some(pb::sequence_outcome::Outcome::Reject(r)) => r.seq_id,
            None => continue,
        };
        index.insert(SeqId(seq_id), i);
    }
    // one span per sequence and call, whatever the number of pools
    let mut by_seq: BTreeMap<SeqId, Vec<&Evicted>> = BTreeMap::new();
    for e in evicted {
        by_seq.entry(e.seq_id).or_default().push(e);
    }
    for (seq_id, pools) in by_seq {
        let Some(cx) = index.get(&seq_id).map(|&i| item_trace(i)) else {
            continue;
        };
        if cx.has_active_span() {
            let span = kvlease_telemetry::sequence_span(&cx, EVICT_SPAN, batch.clone());
            attributes::set_u64(&span, attributes::SEQ_ID, seq_id.0);
            let ids: Vec<i64> = pools.iter().map(|e| i64::from(e.pool_id)).collect();
            let blocks: Vec<i64> = pools.iter().map(|e| e.blocks as i64).collect();
            span.set_attribute(attributes::POOL_IDS, Value::Array(ids.into()));
            span.set_attribute(attributes::BLOCKS_EVICTED, Value::Array(blocks.into()));
        }
    }
    // parsed only for the items that get a span: an Extend of 256 running
    // sequences is all grants, and it comes every step
    for (i, o) in outcomes.iter().enumerate() {
        match &o.outcome {
            Some(pb::sequence_outcome::Outcome::Reject(r)) => {
                let cx = item_trace(i);
                let _span = kvlease_telemetry::sequence_reject_span(&cx, r, batch.clone());
            }
            Some(pb::sequence_outcome::Outcome::Grant(g)) if grants && !traces.is_empty() => {
                let cx = item_trace(i);
                if !cx.has_active_span() {
                    continue;
                }
                let span = kvlease_telemetry::sequence_span(&cx, GRANT_SPAN, batch.clone());
                attributes::set_u64(&span, attributes::SEQ_ID, g.seq_id);
                let blocks: usize = g.tables.iter().map(|t| t.block_ids.len()).sum();
                attributes::set_u64(&span, attributes::BLOCKS_GRANTED, blocks as u64);
                attributes::set_u64(&span, attributes::REUSED_TOKENS, u64::from(g.reused_tokens));
            }
            _ => {}
        }
    }
}

/// Name of the span a granted sequence gets in its request's trace.
const GRANT_SPAN: &str = "Grant";
/// Name of the span for the cached blocks a sequence's allocation evicted.
const EVICT_SPAN: &str = "Evict";
/// Name of the span a released sequence gets in its request's trace.
const RELEASE_SPAN: &str = "Release";

/// Adds the session and step to the call's span.
pub(crate) fn trace_call(session_id: SessionId, step: Option<Step>) {
    let span = Span::current();
    attributes::set_u64(&span, attributes::SESSION_ID, session_id.0);
    if let Some(step) = step {
        attributes::set_u64(&span, attributes::STEP, step.0);
    }
}

/// The trace context of item `i`, from its `traceparent` (none: an empty one).
fn item_context(traceparents: &[String], i: usize) -> kvlease_telemetry::opentelemetry::Context {
    traceparents
        .get(i)
        .map(|t| kvlease_telemetry::context_from_traceparent(t))
        .unwrap_or_default()
}

/// Each release in its request's trace (`traceparents[i]`, linked to the
/// call's span), and the fenced ones remembered in `links` for the
/// `CompleteStep` that frees them (the call's span stands in for items
/// without a trace).
pub(crate) fn trace_releases(
    links: &Mutex<FenceLinks>,
    session_id: SessionId,
    fence_step: Option<Step>,
    traceparents: &[String],
    results: &[ReleaseResult],
) {
    let batch = Span::current();
    if let Some(step) = fence_step {
        attributes::set_u64(&batch, attributes::FENCE_STEP, step.0);
    }
    let mut fenced = Vec::new();
    let batch_cx = kvlease_telemetry::span_context(&batch);
    for (i, x) in results.iter().enumerate() {
        let cx = item_context(traceparents, i);
        if !cx.has_active_span() {
            continue;
        }
        let span = kvlease_telemetry::sequence_span(&cx, RELEASE_SPAN, batch_cx.clone());
        attributes::set_u64(&span, attributes::SEQ_ID, x.seq_id.0);
        attributes::set_u64(
            &span,
            attributes::BLOCKS_RETURNED,
            u64::from(x.blocks_freed),
        );
        attributes::set_u64(&span, attributes::BLOCKS_FENCED, u64::from(x.blocks_fenced));
        if let Some(step) = fence_step {
            attributes::set_u64(&span, attributes::FENCE_STEP, step.0);
            fenced.push(kvlease_telemetry::span_context(&span));
        }
    }
    if let Some(step) = fence_step {
        if fenced.is_empty() {
            fenced.push(batch_cx);
        }
        let mut links = links.lock().unwrap_or_else(|p| p.into_inner());
        for cx in fenced {
            links.remember(session_id, step, cx);
        }
    }
}

/// A completion on the call's span: the blocks it returned, and links to
/// the fenced releases (remembered in `links`) that it freed.
pub(crate) fn trace_complete(
    links: &Mutex<FenceLinks>,
    session_id: SessionId,
    step: Step,
    returned: u64,
) {
    let span = Span::current();
    attributes::set_u64(&span, attributes::BLOCKS_RETURNED, returned);
    let released = links
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .take_through(session_id, step);
    for cx in released {
        attributes::add_link(&span, cx, attributes::LINK_FENCED_RELEASE);
    }
}
