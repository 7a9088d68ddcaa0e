//! The traces of the cache's calls: each sequence's outcome in its own
//! request's trace (grants, rejects with their figures), each call's
//! evictions summarized, releases
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
use crate::ids::{SessionId, Step};
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

/// The trace contexts of a `Lease`/`Extend` batch's items: `traceparents[i]`
/// is item `i`'s request (empty: none), `retried[i]` whether the holder
/// retries it after a transient refusal (`SequenceSpec.refusal_retried`;
/// shorter than the items: not retried).
#[derive(Debug, Default)]
pub(crate) struct ItemTraces {
    pub(crate) traceparents: Vec<String>,
    pub(crate) retried: Vec<bool>,
}

impl ItemTraces {
    /// Items no refusal of which is retried (an `Extend`'s).
    pub(crate) fn of(traceparents: Vec<String>) -> Self {
        Self {
            traceparents,
            retried: Vec::new(),
        }
    }

    /// Whether a refusal of item `i` for `reason` leaves its request going:
    /// the holder retries it, and the reason is one it can retry.
    fn retried(&self, i: usize, reason: pb::RejectReason) -> bool {
        self.retried.get(i).copied().unwrap_or(false)
            && matches!(
                reason,
                pb::RejectReason::PoolExhausted | pb::RejectReason::RolledBack
            )
    }
}

/// Each sequence's outcome in its own request's trace (`traces`, the items'
/// contexts), linked to this batch call's span: a `Reject` span with the
/// figures for a refusal (an error span, unless the holder retries it, see
/// [`ItemTraces`]) and, when `grants` is set (an admission `Lease`, not every
/// decode step's `Extend`), a `Grant` span with the blocks, the reused tokens,
/// the host-tier onboardings and the cached blocks its allocation evicted.
/// Items without a trace context get their rejects under the call's span.
/// The call's evictions are summarized in one `Evict` span under the call's
/// span (sequences that evicted, blocks per pool): one per call, not one per
/// allocation, so they stay a small share of the spans.
pub(crate) fn trace_outcomes(
    outcomes: &[pb::SequenceOutcome],
    traces: &ItemTraces,
    grants: bool,
    evicted: &[Evicted],
) {
    let batch = kvlease_telemetry::span_context(&Span::current());
    let item_trace = |i: usize| item_context(&traces.traceparents, i);
    let _evict = evict_summary(evicted);
    // parsed only for the items that get a span: an Extend of 256 running
    // sequences is all grants, and it comes every step
    for (i, o) in outcomes.iter().enumerate() {
        match &o.outcome {
            Some(pb::sequence_outcome::Outcome::Reject(r)) => {
                let cx = item_trace(i);
                if traces.retried(i, r.reason()) {
                    let _span =
                        kvlease_telemetry::sequence_retried_reject_span(&cx, r, batch.clone());
                } else {
                    let _span = kvlease_telemetry::sequence_reject_span(&cx, r, batch.clone());
                }
            }
            Some(pb::sequence_outcome::Outcome::Grant(g))
                if grants && !traces.traceparents.is_empty() =>
            {
                let cx = item_trace(i);
                if !cx.has_active_span() {
                    continue;
                }
                let span = kvlease_telemetry::sequence_span(&cx, GRANT_SPAN, batch.clone());
                attributes::set_u64(&span, attributes::SEQ_ID, g.seq_id);
                let blocks: usize = g.tables.iter().map(|t| t.block_ids.len()).sum();
                attributes::set_u64(&span, attributes::BLOCKS_GRANTED, blocks as u64);
                attributes::set_u64(&span, attributes::REUSED_TOKENS, u64::from(g.reused_tokens));
                if g.retained_tokens > 0 {
                    attributes::set_u64(
                        &span,
                        attributes::RETAINED_TOKENS,
                        u64::from(g.retained_tokens),
                    );
                }
                record_tiers(&span, &g.tier_copies);
                if let Some(d) = &g.peer_decision {
                    span.set_attribute(attributes::PEER_GROUP, d.src_group.clone());
                    attributes::set_u64(&span, attributes::PEER_BLOCKS, u64::from(d.blocks));
                    attributes::set_u64(&span, attributes::PEER_BYTES, d.bytes);
                    attributes::set_u64(&span, attributes::PEER_PULL_US, d.pull_us);
                    attributes::set_u64(&span, attributes::PEER_RECOMPUTE_US, d.recompute_us);
                    span.set_attribute(attributes::PEER_PULLED, d.pulled);
                    if d.forced {
                        span.set_attribute(attributes::PEER_FORCED, true);
                    }
                }
                let evicted: u64 = evicted
                    .iter()
                    .filter(|e| e.seq_id.0 == g.seq_id)
                    .map(|e| e.blocks)
                    .sum();
                if evicted > 0 {
                    attributes::set_u64(&span, attributes::BLOCKS_EVICTED, evicted);
                }
            }
            _ => {}
        }
    }
}

/// The `Evict` span of a call whose allocations evicted cached blocks (none
/// when nothing was evicted), a child of the call's span: how many
/// sequences' allocations evicted, and the blocks evicted per pool.
fn evict_summary(evicted: &[Evicted]) -> Option<Span> {
    if evicted.is_empty() {
        return None;
    }
    let mut by_pool: BTreeMap<u32, u64> = BTreeMap::new();
    let mut seqs = std::collections::BTreeSet::new();
    for e in evicted {
        *by_pool.entry(e.pool_id).or_default() += e.blocks;
        seqs.insert(e.seq_id);
    }
    let span = tracing::info_span!("kvlease.evict", otel.name = EVICT_SPAN);
    attributes::set_u64(&span, attributes::SEQUENCES, seqs.len() as u64);
    let ids: Vec<i64> = by_pool.keys().map(|&p| i64::from(p)).collect();
    let blocks: Vec<i64> = by_pool.values().map(|&b| b as i64).collect();
    span.set_attribute(attributes::POOL_IDS, Value::Array(ids.into()));
    span.set_attribute(attributes::BLOCKS_EVICTED, Value::Array(blocks.into()));
    Some(span)
}

/// The host tier on a grant's span: the blocks onboarded from host memory
/// and demoted to it, and the tier its reused KV came from.
fn record_tiers(span: &Span, copies: &[pb::TierCopy]) {
    let onboarded = copies
        .iter()
        .filter(|c| c.direction() == pb::tier_copy::Direction::Onboard)
        .count() as u64;
    let demoted = copies.len() as u64 - onboarded;
    attributes::set_u64(span, attributes::ONBOARDED_BLOCKS, onboarded);
    if demoted > 0 {
        attributes::set_u64(span, attributes::DEMOTED_BLOCKS, demoted);
    }
    let tier = if onboarded > 0 {
        attributes::TIER_HOST
    } else {
        attributes::TIER_DEVICE
    };
    span.set_attribute(attributes::TIER, tier);
}

/// Name of the span a granted sequence gets in its request's trace.
const GRANT_SPAN: &str = "Grant";
/// Name of the span that summarizes the cached blocks a call's allocations
/// evicted.
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
