//! The gRPC edge: the `CacheService` handlers over the core. Each handler
//! takes its call through [`CacheServiceImpl::accept`] (the caller, the
//! message size) and, for a session's calls, [`CacheServiceImpl::session`]
//! (the lock, ownership, the call's span), converts with `convert`, calls
//! the core once, and leaves the spans to `trace`.

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use kvlease_auth::{Principal, Role};
use kvlease_proto::v1 as pb;
use kvlease_proto::v1::cache_service_server::CacheService;
use kvlease_runtime::serve::StopWatch;
use kvlease_telemetry::metrics::names;
use tokio::sync::{mpsc, watch};
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};

use crate::cache::{
    AUDIT_SLICE_BLOCKS, AuditCursor, AuditReport, Batch, Cache, Registration, StepParts,
    check_disk_pool,
};
use crate::convert::{
    audit_to_pb, disk_pool_from_pb, estimate_to_pb, event_to_pb, extend_from_pb,
    match_prompt_from_pb, narrow, outcomes_to_pb, pool_info_to_pb, release_from_pb, release_to_pb,
    spec_from_pb, stats_to_pb,
};
use crate::error::{Error, Result};
use crate::ids::{Epoch, SessionId, Step};
use crate::lease::Outcome;
use crate::metrics::CacheMetrics;
use crate::trace::{
    FenceLinks, ItemTraces, trace_call, trace_complete, trace_outcomes, trace_releases,
};
use crate::watchers::WatchSlots;

/// Events sent per read of the log by one WatchEvents stream.
const EVENT_CHUNK: usize = 256;

/// The `CacheService` implementation.
#[derive(Debug, Clone)]
pub(crate) struct CacheServiceImpl {
    cache: Arc<Mutex<Cache>>,
    metrics: CacheMetrics,
    fence_links: Arc<Mutex<FenceLinks>>,
    max_batch: usize,
    max_message_bytes: usize,
    /// The WatchEvents streams open, and their limits.
    watchers: WatchSlots,
    /// Id of the newest event, for WatchEvents streams to wait on.
    events: watch::Sender<u64>,
    /// Set when the server starts shutting down, so streams end and
    /// graceful shutdown does not wait on them forever.
    stopping: StopWatch,
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
        max_watch_streams: (usize, usize),
        stopping: StopWatch,
    ) -> Self {
        let (events, _) = watch::channel(cache.last_event_id());
        Self {
            cache: Arc::new(Mutex::new(cache)),
            metrics,
            fence_links: Arc::default(),
            max_batch,
            max_message_bytes,
            watchers: WatchSlots::new(max_watch_streams.0, max_watch_streams.1),
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

    // === the preamble of every handler ===

    /// A call taken in: its principal, as the auth layer found it (a handler
    /// called without the layer, in a unit test, acts for `anonymous`), and
    /// its message, refused with RESOURCE_EXHAUSTED past the message limit.
    /// tonic refuses a larger request before decoding it (same limit, and the
    /// shared status layer gives that RESOURCE_EXHAUSTED too); this check
    /// stays for a service built without that decoding limit.
    fn accept<T: prost::Message>(&self, request: Request<T>) -> Result<(Principal, T)> {
        let caller = kvlease_auth::principal_of(&request)
            .cloned()
            .unwrap_or_else(Principal::anonymous);
        let message = request.into_inner();
        let len = message.encoded_len();
        if len > self.max_message_bytes {
            return Err(Error::LimitExceeded(format!(
                "request of {len} bytes exceeds the message size limit of {} bytes",
                self.max_message_bytes
            )));
        }
        Ok((caller, message))
    }

    /// The cache, locked for a call on `session_id` by `caller`: refused (and
    /// logged) when another principal opened the session, unless
    /// `may_override` (an admin closing it); the session and `step` go on the
    /// call's span.
    fn session(
        &self,
        caller: &Principal,
        session_id: SessionId,
        step: Option<Step>,
        may_override: bool,
    ) -> Result<MutexGuard<'_, Cache>> {
        let cache = self.lock();
        trace_call(session_id, step);
        cache
            .check_owner(session_id, caller.name(), may_override)
            .inspect_err(|_| {
                tracing::warn!(
                    session_id = session_id.0,
                    principal = caller.name(),
                    "session used by a principal that did not open it; refused"
                );
            })?;
        Ok(cache)
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

    // === answers ===

    /// Runs a `Lease` or `Extend` batch (`op`, at `step`) on `call`'s
    /// session (the caller, the session, its epoch) and answers it.
    fn run_batch(
        &self,
        call: (&Principal, SessionId, Epoch),
        step: Step,
        op: &'static str,
        traces: &ItemTraces,
        run: impl FnOnce(&mut Cache, SessionId, Epoch) -> Result<Vec<Outcome>>,
    ) -> Result<Vec<pb::SequenceOutcome>> {
        let (caller, session, epoch) = call;
        let mut cache = self.session(caller, session, Some(step), false)?;
        let outcomes = run(&mut cache, session, epoch);
        self.notify_events(&cache);
        Ok(self.answer_batch(cache, op, traces, outcomes?))
    }

    /// A `Lease` or `Extend` batch's answer (`op`), its outcomes counted and
    /// each sequence's outcome (and the blocks its allocation evicted) in its
    /// own trace. Takes the lock the call ran under and releases it.
    fn answer_batch(
        &self,
        mut cache: MutexGuard<'_, Cache>,
        op: &'static str,
        traces: &ItemTraces,
        outcomes: Vec<Outcome>,
    ) -> Vec<pb::SequenceOutcome> {
        let evicted = cache.take_evictions();
        drop(cache);
        self.metrics.record(op, &outcomes);
        let outcomes = outcomes_to_pb(outcomes);
        trace_outcomes(&outcomes, traces, op == names::OP_LEASE, &evicted);
        outcomes
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

// === the service ===

#[tonic::async_trait]
impl CacheService for CacheServiceImpl {
    async fn register_pool(
        &self,
        request: Request<pb::RegisterPoolRequest>,
    ) -> Result<Response<pb::RegisterPoolResponse>, Status> {
        let (caller, r) = self.accept(request)?;
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
        let disks = r
            .pools
            .iter()
            .map(disk_pool_from_pb)
            .collect::<Result<Vec<_>>>()?;
        let max_blocks = self.lock().config().max_pool_blocks;
        for (d, &(_, _, host_blocks)) in disks.iter().zip(&pools) {
            check_disk_pool(d, host_blocks, r.worker_incarnation, max_blocks)?;
        }
        // before anything is registered: a bad key registers nothing
        if !r.peer_key.is_empty() {
            crate::cache::check_name("peer_key", &r.peer_key)?;
        }
        // the session it comes from, before anything is registered
        let by = (r.session_id != 0).then_some(crate::SessionId(r.session_id));
        if let Some(session) = by {
            self.lock().check_session_of(session, caller.name())?;
        }
        let plan = self.lock().plan_registration(
            caller.name(),
            &r.pool_group,
            tokens_per_block,
            &pools,
        )?;
        let (infos, already) = match plan {
            Registration::Already(infos) => (infos, true),
            Registration::New(new) => {
                // Building the pools costs time linear in their blocks: not
                // under the lock every other call needs.
                let built = tokio::task::spawn_blocking(move || new.build())
                    .await
                    .map_err(|e| Status::internal(format!("building the pools failed: {e}")))?;
                self.lock().commit_registration(built)?
            }
        };
        // its peer key and block sizes (peer pull), once the group exists
        let block_bytes = r
            .pools
            .iter()
            .zip(&pools)
            .filter(|(p, _)| p.bytes_per_block > 0)
            .map(|(p, &(window, _, _))| (window, p.bytes_per_block))
            .collect::<Vec<_>>();
        self.lock()
            .set_peer_profile(caller.name(), &r.pool_group, &r.peer_key, &block_bytes)?;
        // the worker's incarnation and disk tiers, once the group exists
        let reindexed = self.lock().register_incarnation(
            caller.name(),
            &r.pool_group,
            r.worker_incarnation,
            &disks,
            by,
        )?;
        let infos = match reindexed.new_incarnation {
            true => self.lock().pool_infos(&infos),
            false => infos,
        };
        tracing::info!(pool_group = %r.pool_group, pools = infos.len(), already,
            new_incarnation = reindexed.new_incarnation,
            disk_blocks_indexed = reindexed.disk_blocks_indexed, "pools registered");
        Ok(Response::new(pb::RegisterPoolResponse {
            pools: infos.into_iter().map(pool_info_to_pb).collect(),
            already_registered: already,
        }))
    }

    async fn unregister_pool(
        &self,
        request: Request<pb::UnregisterPoolRequest>,
    ) -> Result<Response<pb::UnregisterPoolResponse>, Status> {
        let (_, r) = self.accept(request)?;
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
        let (caller, r) = self.accept(request)?;
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
        let (caller, r) = self.accept(request)?;
        let session = SessionId(r.session_id);
        let mut cache = self.session(&caller, session, None, false)?;
        let ttl = cache.keep_alive(session, Epoch(r.epoch), now())?;
        Ok(Response::new(pb::KeepAliveResponse {
            ttl_ms: ttl.as_millis() as u64,
        }))
    }

    async fn close_session(
        &self,
        request: Request<pb::CloseSessionRequest>,
    ) -> Result<Response<pb::CloseSessionResponse>, Status> {
        let (caller, r) = self.accept(request)?;
        let admin = caller.has(Role::Admin);
        let session = SessionId(r.session_id);
        let mut cache = self.session(&caller, session, None, admin)?;
        let reclaimed = cache.close_session(session, Epoch(r.epoch), now())?;
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
        let (caller, mut r) = self.accept(request)?;
        self.check_batch("sequences", r.sequences.len())?;
        let traces = ItemTraces {
            traceparents: r
                .sequences
                .iter_mut()
                .map(|s| std::mem::take(&mut s.traceparent))
                .collect(),
            retried: r.sequences.iter().map(|s| s.refusal_retried).collect(),
        };
        let specs = r
            .sequences
            .into_iter()
            .map(spec_from_pb)
            .collect::<Result<Vec<_>>>()?;
        let batch = Batch {
            step: Step(r.step),
            atomic: r.atomic,
            warmup: r.warmup,
        };
        let call = (&caller, SessionId(r.session_id), Epoch(r.epoch));
        let outcomes =
            self.run_batch(call, batch.step, names::OP_LEASE, &traces, |cache, s, e| {
                cache.lease(s, e, batch, &specs, now())
            })?;
        Ok(Response::new(pb::LeaseResponse { outcomes }))
    }

    async fn extend(
        &self,
        request: Request<pb::ExtendRequest>,
    ) -> Result<Response<pb::ExtendResponse>, Status> {
        let (caller, r) = self.accept(request)?;
        self.check_batch("items", r.items.len())?;
        let (traceparents, part) = extend_from_pb(pb::StepExtend {
            step: r.step,
            atomic: r.atomic,
            items: r.items,
        })?;
        let traces = ItemTraces::of(traceparents);
        let call = (&caller, SessionId(r.session_id), Epoch(r.epoch));
        let step = part.batch.step;
        let outcomes = self.run_batch(call, step, names::OP_EXTEND, &traces, |cache, s, e| {
            cache.extend_items(s, e, part.batch, &part.items, now())
        })?;
        Ok(Response::new(pb::ExtendResponse { outcomes }))
    }

    async fn release(
        &self,
        request: Request<pb::ReleaseRequest>,
    ) -> Result<Response<pb::ReleaseResponse>, Status> {
        let (caller, r) = self.accept(request)?;
        self.check_batch("seq_ids", r.seq_ids.len())?;
        let session = SessionId(r.session_id);
        let (traces, part) = release_from_pb(pb::StepRelease {
            seq_ids: r.seq_ids,
            fence_step: r.fence_step,
            traceparents: r.traceparents,
            discard_unwritten: r.discard_unwritten,
        });
        let mut cache = self.session(&caller, session, None, false)?;
        let results =
            cache.release_with(session, Epoch(r.epoch), &part.seq_ids, part.mode, now())?;
        self.notify_events(&cache);
        drop(cache);
        trace_releases(
            &self.fence_links,
            session,
            part.mode.fence_step,
            &traces,
            &results,
        );
        Ok(Response::new(release_to_pb(results)))
    }

    async fn complete_step(
        &self,
        request: Request<pb::CompleteStepRequest>,
    ) -> Result<Response<pb::CompleteStepResponse>, Status> {
        let (caller, r) = self.accept(request)?;
        let (session, step) = (SessionId(r.session_id), Step(r.step));
        let mut cache = self.session(&caller, session, Some(step), false)?;
        let returned = cache.complete_step(session, Epoch(r.epoch), step, now())?;
        self.notify_events(&cache);
        drop(cache);
        trace_complete(&self.fence_links, session, step, returned);
        Ok(Response::new(pb::CompleteStepResponse {
            blocks_returned: returned,
        }))
    }

    async fn step(
        &self,
        request: Request<pb::StepRequest>,
    ) -> Result<Response<pb::StepResponse>, Status> {
        let (caller, r) = self.accept(request)?;
        // the message's own checks, before the core checks the rest
        if let Some(release) = &r.release {
            self.check_batch("release.seq_ids", release.seq_ids.len())?;
        }
        if let Some(extend) = &r.extend {
            self.check_batch("items", extend.items.len())?;
        }
        let session = SessionId(r.session_id);
        let (traces, extend) = match r.extend {
            Some(part) => {
                let (traceparents, part) = extend_from_pb(part)?;
                (ItemTraces::of(traceparents), Some(part))
            }
            None => (ItemTraces::default(), None),
        };
        let (release_traces, release) = r.release.map(release_from_pb).unzip();
        let parts = StepParts {
            release,
            complete: r.complete_step.map(Step),
            extend,
        };
        // the span's step: the completion's, else the extends'
        let span_step = parts
            .complete
            .or(parts.extend.as_ref().map(|part| part.batch.step));
        let mut cache = self.session(&caller, session, span_step, false)?;
        let outcome = cache.step(session, Epoch(r.epoch), &parts, now());
        // what the applied parts changed is announced even when a later one failed
        self.notify_events(&cache);
        let outcome = outcome?;
        let extended = match outcome.extended {
            Some(outcomes) => Some(self.answer_batch(cache, names::OP_EXTEND, &traces, outcomes)),
            None => {
                drop(cache);
                None
            }
        };
        let release = parts.release.zip(outcome.released).map(|(part, results)| {
            trace_releases(
                &self.fence_links,
                session,
                part.mode.fence_step,
                release_traces.as_deref().unwrap_or_default(),
                &results,
            );
            release_to_pb(results)
        });
        let complete = parts
            .complete
            .zip(outcome.returned)
            .map(|(step, returned)| {
                trace_complete(&self.fence_links, session, step, returned);
                pb::CompleteStepResponse {
                    blocks_returned: returned,
                }
            });
        Ok(Response::new(pb::StepResponse {
            release,
            complete,
            extend: extended.map(|outcomes| pb::ExtendResponse { outcomes }),
        }))
    }

    async fn estimate(
        &self,
        request: Request<pb::EstimateRequest>,
    ) -> Result<Response<pb::EstimateResponse>, Status> {
        let (_, r) = self.accept(request)?;
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
        let (_, r) = self.accept(request)?;
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
        let (caller, r) = self.accept(request)?;
        let mut after = r.after_id;
        let last = self.lock().last_event_id();
        if after > last {
            return Err(Status::out_of_range(format!(
                "after_id {after} is beyond the newest event {last}: ids belong to one start of the service; resume from 0"
            )));
        }
        let slot = self.watchers.take(caller.name())?;
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
        Ok(Response::new(audit_to_pb(report)))
    }

    async fn r#match(
        &self,
        request: Request<pb::MatchRequest>,
    ) -> Result<Response<pb::MatchResponse>, Status> {
        let (caller, r) = self.accept(request)?;
        self.check_batch("pool_groups", r.pool_groups.len())?;
        self.check_batch("prompts", r.prompts.len())?;
        let prompts: Vec<_> = r.prompts.into_iter().map(match_prompt_from_pb).collect();
        let session = SessionId(r.session_id);
        let mut cache = self.session(&caller, session, None, false)?;
        let results =
            cache.match_with_peers(session, Epoch(r.epoch), &r.pool_groups, &prompts, now())?;
        drop(cache);
        self.metrics.matched(prompts.len());
        Ok(Response::new(pb::MatchResponse {
            results: results
                .into_iter()
                .map(|row| pb::MatchResult {
                    reused_tokens: row.iter().map(|m| m.reused_tokens).collect(),
                    peer_tokens: row.iter().map(|m| m.peer_tokens).collect(),
                })
                .collect(),
        }))
    }
}
