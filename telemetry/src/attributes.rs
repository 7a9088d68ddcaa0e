//! `kvlease.*` span attribute keys, rejects as error spans, and span links.
//!
//! Attribute keys are plain `&str` constants so they work both as OpenTelemetry keys
//! (`span.set_attribute(attributes::SEQ_ID, 7)`) and, spelled out, as tracing field names
//! (`info_span!("lease", kvlease.seq_id = 7)`: tracing accepts dotted field names).
//!
//! Numbers: record them as `i64` (`kvlease.seq_id = seq_id as i64`) or with [`set_u64`].
//! tracing-opentelemetry 0.34 exports a `u64` tracing field as a *string* attribute, so a
//! `u64` field would not compare equal to an integer in a test that reads the spans.

use kvlease_proto::v1 as pb;
use opentelemetry::trace::{SpanContext, Status, TraceContextExt as _};
use opentelemetry::{Context, KeyValue};
use tracing::Span;
use tracing_opentelemetry::OpenTelemetrySpanExt as _;

/// The logical service a span belongs to (set on every span by the tracer provider).
pub const SERVICE: &str = "kvlease.service";
/// The instance of the logical service a span belongs to (its listener address; exported as
/// the `service.instance.id` resource attribute).
pub const SERVICE_INSTANCE: &str = "service.instance.id";
/// Sequence id.
pub const SEQ_ID: &str = "kvlease.seq_id";
/// Pool id.
pub const POOL_ID: &str = "kvlease.pool_id";
/// Attention window of the pool, in tokens (0 = full attention).
pub const WINDOW: &str = "kvlease.window";
/// Blocks a sequence needed.
pub const BLOCKS_NEEDED: &str = "kvlease.blocks_needed";
/// Blocks free (or evictable) now.
pub const BLOCKS_FREE: &str = "kvlease.blocks_free";
/// Blocks that become free once pending fences complete.
pub const BLOCKS_PENDING_FREE: &str = "kvlease.blocks_pending_free";
/// Why a sequence was rejected (`POOL_EXHAUSTED`, `EXCEEDS_CAPACITY`, ...).
pub const REJECT_REASON: &str = "kvlease.reject_reason";
/// The step a release is fenced at.
pub const FENCE_STEP: &str = "kvlease.fence_step";
/// The scheduler step a call belongs to (`Lease`/`Extend`/`Forward`/`CompleteStep`).
pub const STEP: &str = "kvlease.step";
/// Session id.
pub const SESSION_ID: &str = "kvlease.session_id";
/// Number of blocks freed or returned by a call.
pub const BLOCKS_RETURNED: &str = "kvlease.blocks_returned";
/// The sequence ids a request used (an integer array on its `Generate` span; a preempted request
/// gets a new sequence per admission).
pub const SEQ_IDS: &str = "kvlease.seq_ids";
/// The name of a step trace's root span.
pub const STEP_SPAN: &str = "step";
/// On a step trace's root: why the trace is exported (`reject`, `preemption`, `eviction`,
/// `one_in_n`), or `no`, in which case the step sampler drops the whole trace.
pub const STEP_SAMPLED: &str = "kvlease.step_sampled";
/// The request's id on its `Generate` span.
pub const REQUEST_ID: &str = "kvlease.request_id";
/// Prompt tokens of a request.
pub const PROMPT_TOKENS: &str = "kvlease.prompt_tokens";
/// Output tokens a request got.
pub const OUTPUT_TOKENS: &str = "kvlease.output_tokens";
/// Times a request was preempted and recomputed.
pub const PREEMPTIONS: &str = "kvlease.preemptions";
/// How a request ended (`LENGTH`, `STOP`, `CANCELLED`, `REJECTED`, `ERROR`).
pub const FINISH_REASON: &str = "kvlease.finish_reason";
/// Blocks granted to a sequence.
pub const BLOCKS_GRANTED: &str = "kvlease.blocks_granted";
/// Cached blocks a sequence's allocation evicted, per pool of `kvlease.pool_ids` (integer
/// arrays of one length).
pub const BLOCKS_EVICTED: &str = "kvlease.blocks_evicted";
/// Pool ids (an integer array).
pub const POOL_IDS: &str = "kvlease.pool_ids";
/// Blocks a release parked behind a fence.
pub const BLOCKS_FENCED: &str = "kvlease.blocks_fenced";
/// Leading prompt tokens served from reused blocks.
pub const REUSED_TOKENS: &str = "kvlease.reused_tokens";
/// Leading prompt tokens under the sequence's retention hint (its hint,
/// clamped to whole blocks and the tenant's quota); set only with a hint.
pub const RETAINED_TOKENS: &str = "kvlease.retained_tokens";
/// Tokens of one forward item (a prefill chunk).
pub const TOKENS: &str = "kvlease.tokens";
/// Position of a forward item's first token.
pub const START_POS: &str = "kvlease.start_pos";
/// Blocks onboarded from the host-memory tier (a grant's reused blocks that were demoted).
pub const ONBOARDED_BLOCKS: &str = "kvlease.onboarded_blocks";
/// Cached blocks a call demoted to the host-memory tier.
pub const DEMOTED_BLOCKS: &str = "kvlease.demoted_blocks";
/// Where a sequence's reused KV came from: [`TIER_DEVICE`] or [`TIER_HOST`].
pub const TIER: &str = "kvlease.tier";
/// [`TIER`]: the device's own cached blocks (or nothing reused).
pub const TIER_DEVICE: &str = "device";
/// [`TIER`]: at least one block onboarded from host memory.
pub const TIER_HOST: &str = "host";
/// Prompt tokens a partial-block copy supplied.
pub const COPIED_TOKENS: &str = "kvlease.copied_tokens";
/// Peer pull, on a `Grant` whose lease weighed one: the peer group, the
/// blocks and bytes it could bring, the estimated microseconds to pull
/// them and to compute them instead, and whether the grant pulls them.
pub const PEER_GROUP: &str = "kvlease.peer.group";
/// See [`PEER_GROUP`].
pub const PEER_BLOCKS: &str = "kvlease.peer.blocks";
/// See [`PEER_GROUP`].
pub const PEER_BYTES: &str = "kvlease.peer.bytes";
/// See [`PEER_GROUP`].
pub const PEER_PULL_US: &str = "kvlease.peer.pull_us";
/// See [`PEER_GROUP`].
pub const PEER_RECOMPUTE_US: &str = "kvlease.peer.recompute_us";
/// See [`PEER_GROUP`].
pub const PEER_PULLED: &str = "kvlease.peer.pulled";
/// On a hand-off's `Grant` (disaggregated serving): `true`, the pull is
/// forced, not weighed by the cost model.
pub const PEER_FORCED: &str = "kvlease.peer.forced";
/// The scheduler's `handoff` span of a request (disaggregated serving):
/// the prefill and decode groups, and the prompt tokens whose KV moves.
pub const HANDOFF_FROM: &str = "kvlease.handoff.from";
/// See [`HANDOFF_FROM`].
pub const HANDOFF_TO: &str = "kvlease.handoff.to";
/// See [`HANDOFF_FROM`].
pub const HANDOFF_TOKENS: &str = "kvlease.handoff.tokens";
/// See [`HANDOFF_FROM`]: the grant's transfer id (0: nothing to pull, the
/// decode group recomputes).
pub const HANDOFF_TRANSFER: &str = "kvlease.handoff.transfer_id";
/// The pool group (model replica) a sequence runs in.
pub const REPLICA: &str = "kvlease.replica";
/// Sequences of a call whose allocations evicted cached blocks (on its `Evict` span).
pub const SEQUENCES: &str = "kvlease.sequences";
/// On a refusal the holder retries (a `Reject` span without error status): `true`.
pub const RETRIED: &str = "kvlease.retried";
/// What a span link means (see [`LINK_FENCED_RELEASE`]).
pub const LINK_KIND: &str = "kvlease.link";
/// [`LINK_KIND`] value on the link from a `CompleteStep` span to a release it freed.
pub const LINK_FENCED_RELEASE: &str = "fenced_release";
/// Name of the span [`reject_span`] creates.
pub const REJECT_SPAN: &str = "Reject";
/// Name of the event [`record_reject`] adds.
pub const REJECT_EVENT: &str = "kvlease.reject";

/// What a reject says, for [`record_reject`] and [`reject_span`]. Services build it from the
/// protocol's reject (`RejectFigures::from(&pb::Reject)`), the one form both the cache and the
/// scheduler hold, so the figures are read in one place.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RejectFigures<'a> {
    /// The rejected sequence.
    pub seq_id: u64,
    /// The reason's name, e.g. `"POOL_EXHAUSTED"`.
    pub reason: &'a str,
    /// The pool that could not supply the blocks (0 when not pool-specific).
    pub pool_id: u32,
    /// That pool's window (0 = full attention).
    pub window: u32,
    /// Blocks the sequence needed from the pool.
    pub blocks_needed: u32,
    /// Blocks free (or evictable) in the pool now.
    pub blocks_free: u32,
    /// Blocks free once pending fences complete.
    pub blocks_pending_free: u32,
    /// Human-readable explanation (the span's status description).
    pub message: &'a str,
}

impl<'a> From<&'a pb::Reject> for RejectFigures<'a> {
    fn from(r: &'a pb::Reject) -> Self {
        Self {
            seq_id: r.seq_id,
            reason: r.reason().as_str_name(),
            pool_id: r.pool_id,
            window: r.window,
            blocks_needed: r.blocks_needed,
            blocks_free: r.blocks_free,
            blocks_pending_free: r.blocks_pending_free,
            message: &r.message,
        }
    }
}

impl RejectFigures<'_> {
    fn key_values(&self) -> Vec<KeyValue> {
        vec![
            KeyValue::new(SEQ_ID, seq_id_value(self.seq_id)),
            KeyValue::new(REJECT_REASON, self.reason.to_owned()),
            KeyValue::new(POOL_ID, i64::from(self.pool_id)),
            KeyValue::new(WINDOW, i64::from(self.window)),
            KeyValue::new(BLOCKS_NEEDED, i64::from(self.blocks_needed)),
            KeyValue::new(BLOCKS_FREE, i64::from(self.blocks_free)),
            KeyValue::new(BLOCKS_PENDING_FREE, i64::from(self.blocks_pending_free)),
        ]
    }
}

/// OpenTelemetry integers are `i64`; sequence ids are `u64`. Values above `i64::MAX` keep their
/// bit pattern (they read as negative), which is still unique and still matches by equality.
pub fn seq_id_value(value: u64) -> i64 {
    value as i64
}

/// Sets an integer attribute from a `u64` (sequence ids, steps, block counts), so that it is
/// exported as an integer (see the module doc).
pub fn set_u64(span: &Span, key: &'static str, value: u64) {
    span.set_attribute(key, seq_id_value(value));
}

/// Marks `span` as a reject: `kvlease.*` attributes with the figures, error status with the
/// message, and a `kvlease.reject` event carrying the same figures.
pub fn record_reject(span: &Span, reject: &RejectFigures<'_>) {
    record_figures(span, reject);
    let description = if reject.message.is_empty() {
        reject.reason
    } else {
        reject.message
    };
    span.set_status(Status::error(description.to_owned()));
}

/// The figures of `reject` as `kvlease.*` attributes and a `kvlease.reject` event.
fn record_figures(span: &Span, reject: &RejectFigures<'_>) {
    let attributes = reject.key_values();
    for kv in attributes.iter().cloned() {
        span.set_attribute(kv.key, kv.value);
    }
    span.add_event(REJECT_EVENT, attributes);
}

/// A child of the current span named `Reject`, marked with [`record_reject`]: one per rejected
/// sequence of a batch `Lease`/`Extend`, so the batch span itself stays OK while each reject is
/// an error span in the request's trace. It ends when the returned span is dropped.
pub fn reject_span(reject: &RejectFigures<'_>) -> Span {
    let span = tracing::info_span!("kvlease.reject", otel.name = REJECT_SPAN);
    record_reject(&span, reject);
    span
}

/// The rule for a refused sequence: a `Reject` error span with the reject's figures, in the
/// trace of the sequence itself (`sequence_trace`, the context its request's trace carries), not
/// in the trace of whatever batch call reported it; linked to that call's span (`batch`; an
/// invalid context adds no link). Without a valid `sequence_trace` the span is a child of the
/// current span. It ends when dropped.
pub fn sequence_reject_span(
    sequence_trace: &Context,
    reject: &pb::Reject,
    batch: SpanContext,
) -> Span {
    let figures = RejectFigures::from(reject);
    if !sequence_trace.span().span_context().is_valid() {
        return reject_span(&figures);
    }
    let span = sequence_span(sequence_trace, REJECT_SPAN, batch);
    record_reject(&span, &figures);
    span
}

/// Like [`sequence_reject_span`], for a refusal the holder retries (its request waits for
/// another lease, or is preempted and recomputed): the figures and the `kvlease.reject` event
/// with `kvlease.retried = true`, but no error status, since the request goes on. An ERROR span
/// in a request's trace is then always something that ended it.
pub fn sequence_retried_reject_span(
    sequence_trace: &Context,
    reject: &pb::Reject,
    batch: SpanContext,
) -> Span {
    let figures = RejectFigures::from(reject);
    let span = if sequence_trace.span().span_context().is_valid() {
        sequence_span(sequence_trace, REJECT_SPAN, batch)
    } else {
        tracing::info_span!("kvlease.reject", otel.name = REJECT_SPAN)
    };
    record_figures(&span, &figures);
    span.set_attribute(RETRIED, true);
    span
}

/// A span named `name` in the trace of one sequence of a batched call (`sequence_trace`, from
/// the item's `traceparent`), linked to the batch call's span (`LINK_BATCH`). The span has no
/// tracing parent, so it belongs to the sequence's trace, not the batch's.
pub fn sequence_span(sequence_trace: &Context, name: &'static str, batch: SpanContext) -> Span {
    let span = tracing::info_span!(parent: None, "kvlease.sequence", otel.name = name);
    // The span has not started, so the parent takes; a refusal is logged by `set_parent` and
    // leaves the span a root of its own, which the trace tests catch. The remote context carries
    // no logical service: take the current one, so the span stays this service's.
    let parent = crate::context::with_current_service(sequence_trace);
    let _ = crate::context::set_parent(&span, parent);
    add_link(&span, batch, LINK_BATCH);
    span
}

/// [`LINK_KIND`] value on the link from a sequence's span to the batched call that carried it.
pub const LINK_BATCH: &str = "batch";

/// Links `span` to `to` (an earlier span's [`crate::span_context`]). For a fenced release:
/// keep the release span's context with the fence; the `CompleteStep` span that frees it calls
/// `add_link(&span, release_cx, LINK_FENCED_RELEASE)`. Invalid contexts are ignored.
pub fn add_link(span: &Span, to: SpanContext, kind: &'static str) {
    span.add_link_with_attributes(to, vec![KeyValue::new(LINK_KIND, kind)]);
}
