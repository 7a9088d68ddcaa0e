//! The gRPC edge: the `CacheService` implementation over the core, with the
//! reject spans and fenced-release links of its calls.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use kvlease_auth::{Principal, Role};
use kvlease_proto::v1 as pb;
use kvlease_proto::v1::cache_service_server::CacheService;
use kvlease_runtime::serve::StopWatch;
use kvlease_telemetry::OpenTelemetrySpanExt as _;
use kvlease_telemetry::attributes;
use kvlease_telemetry::metrics::names;
use kvlease_telemetry::opentelemetry::Value;
use kvlease_telemetry::opentelemetry::trace::SpanContext;
use tokio::sync::{mpsc, watch};
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};
use tracing::Span;

use crate::cache::{
    AUDIT_SLICE_BLOCKS, AuditCursor, AuditReport, Batch, Cache, Evicted, MatchPrompt,
};
use crate::convert::{
    estimate_to_pb, event_to_pb, match_prompt_from_pb, outcomes_to_pb, spec_from_pb, stats_to_pb,
};
use crate::error::{Error, Result};
use crate::ids::{Epoch, SessionId};
use crate::lease::{ExtendItem, Growth, Outcome, ReleaseMode, ReleaseResult, ReleaseStatus};
use crate::metrics::CacheMetrics;

/// Events sent per read of the log by one WatchEvents stream.
const EVENT_CHUNK: usize = 256;

/// Fenced-release spans remembered per session, so the `CompleteStep` that
/// frees their blocks can link to them. Bounded: the oldest steps go first.
const FENCE_LINKS_PER_SESSION: usize = 4096;

/// The span contexts of fenced releases, by session and fence step.
#[derive(Debug, Default)]
struct FenceLinks {
    by_session: HashMap<u64, BTreeMap<u64, Vec<SpanContext>>>,
}

impl FenceLinks {
    fn remember(&mut self, session: u64, step: u64, cx: SpanContext) {
        if !cx.is_valid() {
            return;
        }
        let steps = self.by_session.entry(session).or_default();
        steps.entry(step).or_default().push(cx);
        while steps.values().map(Vec::len).sum::<usize>() > FENCE_LINKS_PER_SESSION {
            steps.pop_first();
        }
    }

    fn take_through(&mut self, session: u64, step: u64) -> Vec<SpanContext> {
        let Some(steps) = self.by_session.get_mut(&session) else {
            return Vec::new();
        };
        let later = steps.split_off(&(step.saturating_add(1)));
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
fn trace_outcomes(
    outcomes: &[pb::SequenceOutcome],
    traces: &[String],
    grants: bool,
    evicted: &[Evicted],
) {
    let batch = kvlease_telemetry::span_context(&Span::current());
    let item_trace = |i: usize| {
        traces
            .get(i)
            .map(|t| kvlease_telemetry::context_from_traceparent(t))
            .unwrap_or_default()
    };
    let mut index = HashMap::new();
    for (i, o) in outcomes.iter().enumerate().filter(|_| !evicted.is_empty()) {
        let seq_id = match &o.outcome {
            Some(pb::sequence_outcome::Outcome::Grant(g)) => g.seq_id,
            Some(pb::sequence_outcome::Outcome::Reject(r)) => r.seq_id,
            None => continue,
        };
        index.insert(seq_id, i);
    }
    // one span per sequence and call, whatever the number of pools
    let mut by_seq: BTreeMap<u64, Vec<&Evicted>> = BTreeMap::new();
    for e in evicted {
        by_seq.entry(e.seq_id).or_default().push(e);
    }
    for (seq_id, pools) in by_seq {
        let Some(cx) = index.get(&seq_id).map(|&i| item_trace(i)) else {
            continue;
        };
        if kvlease_telemetry::opentelemetry::trace::TraceContextExt::has_active_span(&cx) {
            let span = kvlease_telemetry::sequence_span(&cx, EVICT_SPAN, batch.clone());
            attributes::set_u64(&span, attributes::SEQ_ID, seq_id);
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
                if !kvlease_telemetry::opentelemetry::trace::TraceContextExt::has_active_span(&cx) {
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
fn trace_call(session_id: u64, step: Option<u64>) {
    let span = Span::current();
    attributes::set_u64(&span, attributes::SESSION_ID, session_id);
    if let Some(step) = step {
        attributes::set_u64(&span, attributes::STEP, step);
    }
}

/// The `CacheService` implementation.
#[derive(Debug, Clone)]
pub(crate) struct CacheServiceImpl {
    cache: Arc<Mutex<Cache>>,
    metrics: CacheMetrics,
    fence_links: Arc<Mutex<FenceLinks>>,
    max_batch: usize,
    max_message_bytes: usize,
    /// Most WatchEvents streams open at once, and the streams open now.
    max_watch_streams: usize,
    watchers: Arc<AtomicUsize>,
    /// Id of the newest event, for WatchEvents streams to wait on.
    events: watch::Sender<u64>,
    /// Set when the server starts shutting down, so streams end and
    /// graceful shutdown does not wait on them forever.
    stopping: StopWatch,
}

/// One open WatchEvents stream, counted while it lives.
#[derive(Debug)]
struct WatchSlot(Arc<AtomicUsize>);

impl WatchSlot {
    /// A slot, or `None` when `max` streams are open.
    fn take(open: &Arc<AtomicUsize>, max: usize) -> Option<Self> {
        open.fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
            (n < max).then_some(n + 1)
        })
        .ok()
        .map(|_| Self(Arc::clone(open)))
    }
}

impl Drop for WatchSlot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// A uint64 wire field that holds a 32-bit value, refused rather than
/// truncated when it does not fit.
/// How a release part gives its sequences back.
fn release_mode(part: &pb::StepRelease) -> ReleaseMode {
    ReleaseMode {
        fence_step: part.fence_step,
        discard_unwritten: part.discard_unwritten,
    }
}

fn narrow(field: &str, value: u64) -> Result<u32> {
    u32::try_from(value).map_err(|_| {
        Error::InvalidArgument(format!(
            "{field} is {value}, over its limit of {}",
            u32::MAX
        ))
    })
}

/// The time the core sees: tokio's clock, so paused-time tests drive TTLs.
pub(crate) fn now() -> Instant {
    tokio::time::Instant::now().into_std()
}

impl CacheServiceImpl {
    /// A service over `cache`.
    pub(crate) fn new(
        cache: Cache,
        metrics: CacheMetrics,
        max_batch: usize,
        max_message_bytes: usize,
        max_watch_streams: usize,
        stopping: StopWatch,
    ) -> Self {
        let (events, _) = watch::channel(cache.last_event_id());
        Self {
            cache: Arc::new(Mutex::new(cache)),
            metrics,
            fence_links: Arc::default(),
            max_batch,
            max_message_bytes,
            max_watch_streams,
            watchers: Arc::default(),
            events,
            stopping,
        }
    }

    /// Renders the Prometheus text of the service.
    pub(crate) fn render_metrics(&self) -> String {
        let cache = self.lock();
        self.metrics.render(&cache)
    }

    pub(crate) fn lock(&self) -> MutexGuard<'_, Cache> {
        // A panic while holding the lock cannot leave the pools half-changed
        // in a way later calls would trust less than a dead service, and the
        // audit re-derives every count; keep serving.
        self.cache
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn check_batch(&self, what: &str, n: usize) -> Result<()> {
        if n > self.max_batch {
            return Err(Error::LimitExceeded(format!(
                "{what} holds {n} entries, the batch limit is {}",
                self.max_batch
            )));
        }
        Ok(())
    }

    /// The message limit, answered with RESOURCE_EXHAUSTED as gRPC asks.
    /// tonic refuses a larger request before decoding it (same limit, and
    /// the shared status layer gives that RESOURCE_EXHAUSTED too); this
    /// check stays for a service built without that decoding limit.
    fn check_size(&self, message: &impl prost::Message) -> Result<()> {
        let len = message.encoded_len();
        if len > self.max_message_bytes {
            return Err(Error::LimitExceeded(format!(
                "request of {len} bytes exceeds the message size limit of {} bytes",
                self.max_message_bytes
            )));
        }
        Ok(())
    }

    /// Runs one `Lease` or `Extend` batch (`op`) on the cache and answers
    /// it: the outcomes counted, each sequence's outcome (and the blocks its
    /// allocation evicted) in its own trace.
    fn answer_batch(
        &self,
        op: &'static str,
        step: u64,
        session: SessionId,
        traces: &[String],
        run: impl FnOnce(&mut Cache) -> Result<Vec<Outcome>>,
    ) -> Result<Vec<pb::SequenceOutcome>> {
        let cache = self.lock();
        trace_call(session.0, Some(step));
        self.answer_locked(cache, op, traces, run)
    }

    /// [`Self::answer_batch`] under a lock the caller already holds (and
    /// that this call releases).
    fn answer_locked(
        &self,
        mut cache: MutexGuard<'_, Cache>,
        op: &'static str,
        traces: &[String],
        run: impl FnOnce(&mut Cache) -> Result<Vec<Outcome>>,
    ) -> Result<Vec<pb::SequenceOutcome>> {
        let outcomes = run(&mut cache);
        // what an earlier part of a `Step` call changed is announced even
        // when this part fails
        self.notify_events(&cache);
        let outcomes = outcomes?;
        let evicted = cache.take_evictions();
        drop(cache);
        self.metrics.record(op, &outcomes);
        let outcomes = outcomes_to_pb(outcomes);
        trace_outcomes(&outcomes, traces, op == names::OP_LEASE, &evicted);
        Ok(outcomes)
    }

    /// An Extend's items checked and parted: the items' trace contexts, the
    /// growth of each sequence, the batch.
    #[allow(clippy::type_complexity)]
    fn extend_part(
        &self,
        mut part: pb::StepExtend,
    ) -> Result<(Vec<String>, Vec<ExtendItem>, Batch)> {
        self.check_batch("items", part.items.len())?;
        let traces: Vec<String> = part
            .items
            .iter_mut()
            .map(|i| std::mem::take(&mut i.traceparent))
            .collect();
        let items = part
            .items
            .into_iter()
            .map(|i| {
                let growth = match (i.new_tokens.is_empty(), i.num_tokens) {
                    (false, 0) => Some(Growth::Tokens(i.new_tokens)),
                    (true, n) if n > 0 => Some(Growth::Count(n)),
                    // a chunked-prefill progress report only
                    (true, _) if i.written_tokens > 0 => None,
                    (true, _) => {
                        return Err(Error::InvalidArgument(format!(
                            "sequence {}: give new_tokens or num_tokens > 0, or written_tokens > 0",
                            i.seq_id
                        )));
                    }
                    (false, _) => {
                        return Err(Error::InvalidArgument(format!(
                            "sequence {}: give only one of new_tokens and num_tokens",
                            i.seq_id
                        )));
                    }
                };
                Ok(ExtendItem {
                    seq_id: i.seq_id,
                    growth,
                    written_tokens: i.written_tokens,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let batch = Batch {
            step: part.step,
            atomic: part.atomic,
            warmup: false,
        };
        Ok((traces, items, batch))
    }

    /// A release's answer, with each release in its request's trace and the
    /// fenced ones remembered for the `CompleteStep` that frees them.
    fn answer_release(
        &self,
        session_id: u64,
        part: &pb::StepRelease,
        results: Vec<ReleaseResult>,
    ) -> pb::ReleaseResponse {
        let batch = Span::current();
        if let Some(step) = part.fence_step {
            attributes::set_u64(&batch, attributes::FENCE_STEP, step);
        }
        // Each release in its request's trace; the CompleteStep that frees a
        // fence links to these (or to the batch call, for items without one).
        let mut fenced = Vec::new();
        let batch_cx = kvlease_telemetry::span_context(&batch);
        for (i, x) in results.iter().enumerate() {
            let cx = part
                .traceparents
                .get(i)
                .map(|t| kvlease_telemetry::context_from_traceparent(t))
                .unwrap_or_default();
            if !kvlease_telemetry::opentelemetry::trace::TraceContextExt::has_active_span(&cx) {
                continue;
            }
            let span = kvlease_telemetry::sequence_span(&cx, RELEASE_SPAN, batch_cx.clone());
            attributes::set_u64(&span, attributes::SEQ_ID, x.seq_id);
            attributes::set_u64(
                &span,
                attributes::BLOCKS_RETURNED,
                u64::from(x.blocks_freed),
            );
            attributes::set_u64(&span, attributes::BLOCKS_FENCED, u64::from(x.blocks_fenced));
            if let Some(step) = part.fence_step {
                attributes::set_u64(&span, attributes::FENCE_STEP, step);
                fenced.push(kvlease_telemetry::span_context(&span));
            }
        }
        if let Some(step) = part.fence_step {
            if fenced.is_empty() {
                fenced.push(batch_cx);
            }
            let mut links = self.fence_links.lock().unwrap_or_else(|p| p.into_inner());
            for cx in fenced {
                links.remember(session_id, step, cx);
            }
        }
        pb::ReleaseResponse {
            results: results
                .into_iter()
                .map(|x| pb::ReleaseResult {
                    seq_id: x.seq_id,
                    status: match x.status {
                        ReleaseStatus::Released => pb::ReleaseStatus::Released,
                        ReleaseStatus::AlreadyReleased => pb::ReleaseStatus::AlreadyReleased,
                        ReleaseStatus::Unknown => pb::ReleaseStatus::Unknown,
                    } as i32,
                    blocks_freed: x.blocks_freed,
                    blocks_fenced: x.blocks_fenced,
                })
                .collect(),
        }
    }

    /// A `CompleteStep`'s answer, its span linked to the fenced releases it
    /// freed.
    fn answer_complete(
        &self,
        session_id: u64,
        step: u64,
        returned: u64,
    ) -> pb::CompleteStepResponse {
        let span = Span::current();
        attributes::set_u64(&span, attributes::BLOCKS_RETURNED, returned);
        let released = self
            .fence_links
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take_through(session_id, step);
        for cx in released {
            attributes::add_link(&span, cx, attributes::LINK_FENCED_RELEASE);
        }
        pb::CompleteStepResponse {
            blocks_returned: returned,
        }
    }

    /// The leak audit, one slice of [`AUDIT_SLICE_BLOCKS`] blocks per hold
    /// of the lock, yielding between slices: a large pool's audit never
    /// holds other calls back for more than one slice.
    pub(crate) async fn audit_sliced(&self) -> AuditReport {
        let mut report = AuditReport::default();
        let mut cursor = AuditCursor::default();
        loop {
            let next = {
                let mut cache = self.lock();
                let next = cache.audit_slice(cursor, AUDIT_SLICE_BLOCKS, &mut report);
                self.notify_events(&cache);
                next
            };
            match next {
                Some(c) => cursor = c,
                None => return report,
            }
            tokio::task::yield_now().await;
        }
    }

    pub(crate) fn notify_events(&self, cache: &Cache) {
        let last = cache.last_event_id();
        self.events.send_if_modified(|v| {
            let changed = *v != last;
            *v = last;
            changed
        });
    }
}

// === ownership ===

/// The principal of a call, as the auth layer found it; a handler called without the layer
/// (a unit test) acts for `anonymous`.
fn caller<T>(request: &Request<T>) -> Principal {
    kvlease_auth::principal_of(request)
        .cloned()
        .unwrap_or_else(Principal::anonymous)
}

/// Refuses (and logs) `caller`'s use of a session another principal opened; `may_override`
/// lets an admin close it.
fn owned(cache: &Cache, session_id: u64, caller: &Principal, may_override: bool) -> Result<()> {
    cache
        .check_owner(SessionId(session_id), caller.name(), may_override)
        .inspect_err(|_| {
            tracing::warn!(
                session_id,
                principal = caller.name(),
                "session used by a principal that did not open it; refused"
            );
        })
}

// === the service ===

#[tonic::async_trait]
impl CacheService for CacheServiceImpl {
    async fn register_pool(
        &self,
        request: Request<pb::RegisterPoolRequest>,
    ) -> Result<Response<pb::RegisterPoolResponse>, Status> {
        let caller = caller(&request);
        let r = request.into_inner();
        self.check_size(&r)?;
        let pools = r
            .pools
            .iter()
            .map(|p| {
                Ok((
                    narrow("window", p.window)?,
                    narrow("num_blocks", p.num_blocks)?,
                    narrow("host_blocks", p.host_blocks)?,
                ))
            })
            .collect::<Result<Vec<(u32, u32, u32)>>>()?;
        let tokens_per_block = narrow("tokens_per_block", r.tokens_per_block)?;
        let (infos, already) = self.lock().register_pool_for(
            caller.name(),
            &r.pool_group,
            tokens_per_block,
            &pools,
        )?;
        tracing::info!(pool_group = %r.pool_group, pools = infos.len(), already, "pools registered");
        Ok(Response::new(pb::RegisterPoolResponse {
            pools: infos
                .into_iter()
                .map(|i| pb::PoolInfo {
                    pool_id: i.pool_id,
                    window: i.window,
                    num_blocks: i.num_blocks,
                    tokens_per_block: i.tokens_per_block,
                    host_blocks: i.host_blocks,
                })
                .collect(),
            already_registered: already,
        }))
    }

    async fn unregister_pool(
        &self,
        request: Request<pb::UnregisterPoolRequest>,
    ) -> Result<Response<pb::UnregisterPoolResponse>, Status> {
        let r = request.into_inner();
        let mut cache = self.lock();
        let gone = cache.unregister_pool(&r.pool_group)?;
        self.notify_events(&cache);
        drop(cache);
        tracing::info!(pool_group = %r.pool_group, pools = gone.pools, blocks = gone.blocks, "pool group unregistered");
        Ok(Response::new(pb::UnregisterPoolResponse {
            pools_removed: gone.pools,
            blocks_removed: gone.blocks,
        }))
    }

    async fn open_session(
        &self,
        request: Request<pb::OpenSessionRequest>,
    ) -> Result<Response<pb::OpenSessionResponse>, Status> {
        let caller = caller(&request);
        let r = request.into_inner();
        let ttl = (r.ttl_ms > 0).then(|| Duration::from_millis(r.ttl_ms));
        let opened = self
            .lock()
            .open_session_for(caller.name(), &r.holder, ttl, now())?;
        tracing::info!(session_id = opened.session_id.0, holder = %r.holder, principal = caller.name(), "session opened");
        Ok(Response::new(pb::OpenSessionResponse {
            session_id: opened.session_id.0,
            epoch: opened.epoch.0,
            ttl_ms: opened.ttl.as_millis() as u64,
            // a limit past u32 is no limit a holder could reach
            max_batch: u32::try_from(self.max_batch).unwrap_or(u32::MAX),
        }))
    }

    async fn keep_alive(
        &self,
        request: Request<pb::KeepAliveRequest>,
    ) -> Result<Response<pb::KeepAliveResponse>, Status> {
        let caller = caller(&request);
        let r = request.into_inner();
        let mut cache = self.lock();
        owned(&cache, r.session_id, &caller, false)?;
        let ttl = cache.keep_alive(SessionId(r.session_id), Epoch(r.epoch), now())?;
        Ok(Response::new(pb::KeepAliveResponse {
            ttl_ms: ttl.as_millis() as u64,
        }))
    }

    async fn close_session(
        &self,
        request: Request<pb::CloseSessionRequest>,
    ) -> Result<Response<pb::CloseSessionResponse>, Status> {
        let caller = caller(&request);
        let r = request.into_inner();
        let mut cache = self.lock();
        owned(&cache, r.session_id, &caller, caller.has(Role::Admin))?;
        let reclaimed = cache.close_session(SessionId(r.session_id), Epoch(r.epoch), now())?;
        self.notify_events(&cache);
        Ok(Response::new(pb::CloseSessionResponse {
            sequences_released: reclaimed.sequences,
            blocks_returned: reclaimed.blocks,
        }))
    }

    async fn lease(
        &self,
        request: Request<pb::LeaseRequest>,
    ) -> Result<Response<pb::LeaseResponse>, Status> {
        let caller = caller(&request);
        let mut r = request.into_inner();
        self.check_size(&r)?;
        self.check_batch("sequences", r.sequences.len())?;
        let traces: Vec<String> = r
            .sequences
            .iter_mut()
            .map(|s| std::mem::take(&mut s.traceparent))
            .collect();
        let specs = r
            .sequences
            .into_iter()
            .map(spec_from_pb)
            .collect::<Result<Vec<_>>>()?;
        let batch = Batch {
            step: r.step,
            atomic: r.atomic,
            warmup: r.warmup,
        };
        let (session, epoch) = (SessionId(r.session_id), Epoch(r.epoch));
        let outcomes = self.answer_batch(names::OP_LEASE, r.step, session, &traces, |cache| {
            owned(cache, session.0, &caller, false)?;
            cache.lease(session, epoch, batch, &specs, now())
        })?;
        Ok(Response::new(pb::LeaseResponse { outcomes }))
    }

    async fn extend(
        &self,
        request: Request<pb::ExtendRequest>,
    ) -> Result<Response<pb::ExtendResponse>, Status> {
        let caller = caller(&request);
        let r = request.into_inner();
        self.check_size(&r)?;
        let part = pb::StepExtend {
            step: r.step,
            atomic: r.atomic,
            items: r.items,
        };
        let (traces, items, batch) = self.extend_part(part)?;
        let (session, epoch) = (SessionId(r.session_id), Epoch(r.epoch));
        let outcomes =
            self.answer_batch(names::OP_EXTEND, batch.step, session, &traces, |cache| {
                owned(cache, session.0, &caller, false)?;
                cache.extend_items(session, epoch, batch, &items, now())
            })?;
        Ok(Response::new(pb::ExtendResponse { outcomes }))
    }

    async fn release(
        &self,
        request: Request<pb::ReleaseRequest>,
    ) -> Result<Response<pb::ReleaseResponse>, Status> {
        let caller = caller(&request);
        let r = request.into_inner();
        self.check_size(&r)?;
        let part = pb::StepRelease {
            seq_ids: r.seq_ids,
            fence_step: r.fence_step,
            traceparents: r.traceparents,
            discard_unwritten: r.discard_unwritten,
        };
        self.check_batch("seq_ids", part.seq_ids.len())?;
        let mut cache = self.lock();
        owned(&cache, r.session_id, &caller, false)?;
        trace_call(r.session_id, None);
        let results = cache.release_with(
            SessionId(r.session_id),
            Epoch(r.epoch),
            &part.seq_ids,
            release_mode(&part),
            now(),
        )?;
        self.notify_events(&cache);
        drop(cache);
        Ok(Response::new(self.answer_release(
            r.session_id,
            &part,
            results,
        )))
    }

    async fn complete_step(
        &self,
        request: Request<pb::CompleteStepRequest>,
    ) -> Result<Response<pb::CompleteStepResponse>, Status> {
        let caller = caller(&request);
        let r = request.into_inner();
        let mut cache = self.lock();
        owned(&cache, r.session_id, &caller, false)?;
        trace_call(r.session_id, Some(r.step));
        let returned =
            cache.complete_step(SessionId(r.session_id), Epoch(r.epoch), r.step, now())?;
        self.notify_events(&cache);
        drop(cache);
        Ok(Response::new(self.answer_complete(
            r.session_id,
            r.step,
            returned,
        )))
    }

    async fn step(
        &self,
        request: Request<pb::StepRequest>,
    ) -> Result<Response<pb::StepResponse>, Status> {
        let caller = caller(&request);
        let r = request.into_inner();
        self.check_size(&r)?;
        // every part checked before any is applied
        if let Some(release) = &r.release {
            self.check_batch("release.seq_ids", release.seq_ids.len())?;
        }
        let extend = r.extend.map(|part| self.extend_part(part)).transpose()?;
        let (session, epoch) = (SessionId(r.session_id), Epoch(r.epoch));
        let mut cache = self.lock();
        owned(&cache, r.session_id, &caller, false)?;
        // the extends' progress figures against the lengths before anything
        // is applied (a release in this call only makes an item unknown)
        if let Some((_, items, _)) = &extend {
            cache.check_extend_items(session, items)?;
        }
        // the span's step: the completion's, else the extends'
        trace_call(
            r.session_id,
            r.complete_step
                .or(extend.as_ref().map(|(_, _, batch)| batch.step)),
        );
        let released = match &r.release {
            Some(part) => Some(cache.release_with(
                session,
                epoch,
                &part.seq_ids,
                release_mode(part),
                now(),
            )?),
            None => None,
        };
        let returned = match r.complete_step {
            Some(step) => Some(cache.complete_step(session, epoch, step, now())?),
            None => None,
        };
        let extended = match extend {
            Some((traces, items, batch)) => Some(self.answer_locked(
                cache,
                names::OP_EXTEND,
                &traces,
                |cache| cache.extend_items(session, epoch, batch, &items, now()),
            )?),
            None => {
                self.notify_events(&cache);
                drop(cache);
                None
            }
        };
        Ok(Response::new(pb::StepResponse {
            release: r
                .release
                .as_ref()
                .zip(released)
                .map(|(part, results)| self.answer_release(r.session_id, part, results)),
            complete: r
                .complete_step
                .zip(returned)
                .map(|(step, n)| self.answer_complete(r.session_id, step, n)),
            extend: extended.map(|outcomes| pb::ExtendResponse { outcomes }),
        }))
    }

    async fn estimate(
        &self,
        request: Request<pb::EstimateRequest>,
    ) -> Result<Response<pb::EstimateResponse>, Status> {
        let r = request.into_inner();
        self.check_size(&r)?;
        self.check_batch("shapes", r.shapes.len())?;
        let specs = r
            .shapes
            .into_iter()
            .map(spec_from_pb)
            .collect::<Result<Vec<_>>>()?;
        let estimates = self.lock().estimate(&specs)?;
        Ok(Response::new(pb::EstimateResponse {
            estimates: estimates.into_iter().map(estimate_to_pb).collect(),
        }))
    }

    async fn get_stats(
        &self,
        request: Request<pb::GetStatsRequest>,
    ) -> Result<Response<pb::GetStatsResponse>, Status> {
        let r = request.into_inner();
        let group = (!r.pool_group.is_empty()).then_some(r.pool_group.as_str());
        let stats = self.lock().stats(group)?;
        Ok(Response::new(pb::GetStatsResponse {
            pools: stats.pools.into_iter().map(stats_to_pb).collect(),
            epoch: stats.epoch.0,
            sessions: stats.sessions,
            sequences: stats.sequences,
        }))
    }

    type WatchEventsStream = ReceiverStream<Result<pb::CacheEvent, Status>>;

    async fn watch_events(
        &self,
        request: Request<pb::WatchEventsRequest>,
    ) -> Result<Response<Self::WatchEventsStream>, Status> {
        let mut after = request.into_inner().after_id;
        let last = self.lock().last_event_id();
        if after > last {
            return Err(Status::out_of_range(format!(
                "after_id {after} is beyond the newest event {last}: ids belong to one start of the service; resume from 0"
            )));
        }
        let Some(slot) = WatchSlot::take(&self.watchers, self.max_watch_streams) else {
            return Err(Status::resource_exhausted(format!(
                "{} WatchEvents streams are open, the limit is {}",
                self.max_watch_streams, self.max_watch_streams
            )));
        };
        let (tx, rx) = mpsc::channel(EVENT_CHUNK);
        let cache = Arc::clone(&self.cache);
        let mut changed = self.events.subscribe();
        let mut stopping = self.stopping.clone();
        tokio::spawn(async move {
            // the stream's slot is given back when this task ends
            let _slot = slot;
            loop {
                let read = {
                    let cache = cache.lock().unwrap_or_else(|p| p.into_inner());
                    cache.events_since(after, EVENT_CHUNK)
                };
                if let Some(oldest) = read.lost_before {
                    let lost = pb::CacheEvent {
                        id: oldest.saturating_sub(1),
                        pool_id: 0,
                        kind: Some(pb::cache_event::Kind::Lost(pb::EventsLost {
                            oldest_available: oldest,
                        })),
                        tier: pb::Tier::Device as i32,
                    };
                    if tx.send(Ok(lost)).await.is_err() {
                        return;
                    }
                }
                let got = read.events.len();
                for event in read.events {
                    after = event.id;
                    if tx.send(Ok(event_to_pb(event))).await.is_err() {
                        return;
                    }
                }
                if got < EVENT_CHUNK {
                    // Caught up: wait for news, or for the service to stop.
                    tokio::select! {
                        res = changed.changed() => if res.is_err() { return },
                        () = tx.closed() => return,
                        () = stopping.stopped() => return,
                    }
                }
            }
        });
        Ok(Response::new(ReceiverStream::new(rx)))
    }

    async fn audit(
        &self,
        _request: Request<pb::AuditRequest>,
    ) -> Result<Response<pb::AuditResponse>, Status> {
        let report = self.audit_sliced().await;
        Ok(Response::new(pb::AuditResponse {
            reclaimed: report
                .reclaimed
                .into_iter()
                .map(|l| pb::LeakedBlock {
                    pool_id: l.pool_id,
                    block_id: l.block,
                    last_holder: if l.last_holder.session == 0 {
                        "unknown".to_owned()
                    } else {
                        format!(
                            "session {} sequence {}",
                            l.last_holder.session, l.last_holder.seq
                        )
                    },
                })
                .collect(),
            blocks_checked: report.blocks_checked,
        }))
    }

    async fn r#match(
        &self,
        request: Request<pb::MatchRequest>,
    ) -> Result<Response<pb::MatchResponse>, Status> {
        let caller = caller(&request);
        let r = request.into_inner();
        self.check_size(&r)?;
        self.check_batch("pool_groups", r.pool_groups.len())?;
        self.check_batch("prompts", r.prompts.len())?;
        let prompts: Vec<MatchPrompt> = r.prompts.into_iter().map(match_prompt_from_pb).collect();
        let mut cache = self.lock();
        owned(&cache, r.session_id, &caller, false)?;
        trace_call(r.session_id, None);
        let results = cache.match_prefixes(
            SessionId(r.session_id),
            Epoch(r.epoch),
            &r.pool_groups,
            &prompts,
            now(),
        )?;
        drop(cache);
        self.metrics.matched(prompts.len());
        Ok(Response::new(pb::MatchResponse {
            results: results
                .into_iter()
                .map(|reused_tokens| pb::MatchResult { reused_tokens })
                .collect(),
        }))
    }
}
