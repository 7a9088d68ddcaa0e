//! The async step loop: drives `step::Core` with the cache and worker
//! clients, one batched Extend and one batched Lease per step, forwards on
//! the workers, streams outputs, sends the releases the core hands out with
//! the fence it chose, and sends `CompleteStep` for the step the core says
//! is complete. The rule behind both (no block reaches another sequence
//! before the forward pass that could read it returned) lives in
//! `step/fence.rs`, where unit tests pin it; this loop only does the I/O.
//! The order of a step's calls is the core's too ([`StepPlan`]): the loop
//! executes it call by call, as the core's model-checked test driver does.
//!
//! With overlap on, step N+1's releases and admission leases run while step
//! N's forward pass is in flight (so the core fences those releases at N),
//! and in the pipelined order (overlap without speculation) step N+1's pass
//! is sent while N's runs, so two (`--pipeline-depth`) are in flight;
//! without it, every call of a step runs before its forward pass.
//!
//! Failed cache calls: a release the cache did not answer is kept by the core
//! and sent again at the next step (`Core::release_failed`), whatever the
//! error, unless the session is gone; nothing is retried in a tight loop. No
//! call carries more entries than the cache's batch limit (`OpenSession`'s
//! `max_batch`): the core caps release batches and a step's leases, and the
//! loop splits a step's extends. When the cache refuses a call (an error
//! status, not an unreachable cache), the step's parts go in calls of their
//! own until a step passes without a refusal, so one part the cache keeps
//! refusing never holds back the others.
//!
//! # Layout
//! - `mod.rs`: the loop itself: start, run, shutdown, taking requests in,
//!   one step (the [`StepPlan`]'s calls), recovering a lost session.
//! - `handle.rs`: the service's side ([`StepLoopHandle`]: submit, status).
//! - `cache_calls.rs`: the calls to the cache (Release, Lease, Match,
//!   Extend, Step, CompleteStep) and how their failures are noted.
//! - `forward.rs`: launching a step's forward passes and collecting them.
//! - `report.rs`: outputs to the request streams, trace marks, metrics and
//!   the status snapshot.
//! - `delivery.rs`: a step's outputs handed to the request streams at once,
//!   from a task of the shared runtime.

mod cache_calls;
mod delivery;
mod forward;
mod handle;
mod report;

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use kvlease_telemetry::attributes::STEP_SPAN;
use tokio::sync::{mpsc, watch};
use tracing::Instrument;

use crate::client::{CacheClient, WorkerClient};
use crate::config::OnCacheRestart;
use crate::domain::{GroupGeometry, Output, RequestId, Step};
use crate::keepalive;
use crate::metrics::SchedulerMetrics;
use crate::step::{Call, Core, CoreConfig, Counters, StepPlan};
use crate::traces::{RequestTraces, StepSampling};

use forward::{BetweenPasses, InFlight};
pub(crate) use handle::{StatusSnapshot, StepLoopHandle, Submission};

/// Everything the loop needs besides the core.
#[derive(Debug, Clone)]
pub(crate) struct StepLoopConfig {
    pub core: CoreConfig,
    pub holder: String,
    pub session_ttl_ms: u64,
    pub on_cache_restart: OnCacheRestart,
    /// The last step warm-up used; the loop's steps come after it.
    pub first_step: Step,
    /// One in this many uneventful step traces is exported (0: none).
    pub trace_steps_one_in: u64,
    /// Most requests waiting in the queue (0: no limit); more are refused
    /// at submission.
    pub max_queue: usize,
}

/// The step loop. Build with [`StepLoop::new`], run with [`StepLoop::spawn_thread`].
#[derive(Debug)]
pub(crate) struct StepLoop {
    core: Core,
    config: StepLoopConfig,
    cache: CacheClient,
    workers: Vec<WorkerClient>,
    steps_run: u64,
    streams: HashMap<RequestId, mpsc::UnboundedSender<Output>>,
    /// Sends the outputs on to `streams` from the shared runtime.
    delivery: delivery::Delivery,
    /// Each stream's samples the client stopped reading (see `Submission`).
    branch_ends: HashMap<RequestId, mpsc::UnboundedReceiver<u32>>,
    /// The trace of each live request.
    traces: RequestTraces,
    /// Whether the current step refused or preempted a sequence (its trace
    /// is then exported).
    step_rejects: bool,
    step_preemptions: bool,
    intake: mpsc::UnboundedReceiver<Submission>,
    /// The handle's count of submissions not taken in yet.
    backlog: Arc<AtomicUsize>,
    status: watch::Sender<StatusSnapshot>,
    /// Forward passes launched and not collected, oldest first.
    in_flight: VecDeque<InFlight>,
    backoff: Duration,
    metrics: SchedulerMetrics,
    /// Counters as last reported to the metrics.
    reported: std::cell::Cell<Counters>,
    /// The cache refused a call of this step (see [`crate::step::CallFailure::Refused`]),
    /// and of the step before: while either is set, `settle` sends the
    /// step's parts in calls of their own instead of one `Step` call.
    refused: bool,
    refused_before: bool,
    /// The extends [`Call::Plan`] planned, to send after the launch.
    planned_extends: Option<Vec<crate::domain::ExtendSpec>>,
    /// A settle's `Step` call sent while a pass runs, its answer not yet
    /// applied ([`StepLoop::settled`]): only while a pass is in flight, so
    /// the collect of that pass (`finish_in_flight` too) applies it.
    pending_settle: Option<cache_calls::PendingSettle>,
    /// The last step's trace, when that step's settle was not answered
    /// by its end: marked once the answer is applied.
    unmarked: Option<UnmarkedStep>,
}

/// A step whose settle's answer was not applied when the step ended: the
/// root of its trace stays open until it is, so that a refusal or a
/// preemption the answer carries samples that step's trace (where the
/// `Step` call's span is), not the next one's.
#[derive(Debug)]
struct UnmarkedStep {
    span: tracing::Span,
    step: Step,
    rejects: bool,
    preemptions: bool,
}

impl UnmarkedStep {
    /// Marks the trace with why it is exported (or not) and ends its root.
    fn mark(self, one_in: u64) {
        StepSampling { one_in }.mark(&self.span, self.step, self.rejects, self.preemptions);
    }
}

const MIN_BACKOFF: Duration = Duration::from_millis(5);
const MAX_BACKOFF: Duration = Duration::from_millis(500);

impl StepLoop {
    /// A loop over `groups` (index i served by `workers[i]`); called from
    /// the service's runtime, which carries the request streams.
    pub(crate) fn new(
        config: StepLoopConfig,
        groups: Vec<GroupGeometry>,
        cache: CacheClient,
        workers: Vec<WorkerClient>,
        metrics: SchedulerMetrics,
    ) -> crate::error::Result<(Self, StepLoopHandle)> {
        let delivery = delivery::Delivery::start()?;
        let (submit, intake) = mpsc::unbounded_channel();
        let (status, status_rx) = watch::channel(StatusSnapshot::default());
        let backlog = Arc::new(AtomicUsize::new(0));
        let handle = StepLoopHandle::new(submit, status_rx, Arc::clone(&backlog), config.max_queue);
        let mut core = Core::new(config.core.clone(), groups);
        core.continue_after(config.first_step);
        core.set_batch_limit(cache.session().batch_limit());
        let step_loop = Self {
            core,
            config,
            cache,
            workers,
            steps_run: 0,
            streams: HashMap::new(),
            delivery,
            branch_ends: HashMap::new(),
            traces: RequestTraces::default(),
            step_rejects: false,
            step_preemptions: false,
            intake,
            backlog,
            status,
            in_flight: VecDeque::new(),
            backoff: MIN_BACKOFF,
            metrics,
            reported: std::cell::Cell::new(Counters::default()),
            refused: false,
            refused_before: false,
            planned_extends: None,
            pending_settle: None,
            unmarked: None,
        };
        Ok((step_loop, handle))
    }

    /// Runs the loop ([`Self::run`]) on a thread of its own, with a
    /// single-threaded runtime of its own that also carries its connections
    /// to the workers; the receiver resolves when it has finished (an error
    /// if it panicked).
    ///
    /// Why: a step's `Forward` call has to reach the worker while the pass
    /// before it runs (1.5-2.5 ms on an H200), and every hop between threads
    /// costs tens to hundreds of microseconds on a busy host. As a task of
    /// the shared runtime, a call spawned by the loop waited in the loop's
    /// worker's LIFO slot (which no other worker may steal) until the loop
    /// yielded, then queued behind the token streams the loop had just
    /// woken, and its connection's tasks ran wherever the runtime put them:
    /// the call's task began 0.3-2 ms after the launch on the H200. Here the
    /// call and its connection run on the loop's thread as soon as the loop
    /// awaits its next cache call (right after the launch), and a worker's
    /// answer wakes the loop's thread directly. Everything else (the cache
    /// connection, the request streams, the servers) stays on the shared
    /// runtime, which the loop's planning and bookkeeping no longer hold.
    pub(crate) fn spawn_thread(
        mut self,
        shutdown: watch::Receiver<bool>,
    ) -> crate::error::Result<tokio::sync::oneshot::Receiver<()>> {
        use crate::error::Error;
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(Error::StepThread)?;
        // a subscriber set for this thread only (tests) follows the loop
        let dispatch = tracing::dispatcher::get_default(|d| d.clone());
        let (done, finished) = tokio::sync::oneshot::channel();
        std::thread::Builder::new()
            .name("kvlease-step-loop".into())
            .spawn(move || {
                let run = async move {
                    // connections whose tasks run on this runtime
                    match self.workers.iter().map(|w| w.reconnected()).collect() {
                        Ok(workers) => self.workers = workers,
                        // the addresses connected once already: keep those
                        Err(e) => tracing::warn!(error = %e, "the step loop keeps the shared runtime's worker connections"),
                    }
                    self.run(shutdown).await
                };
                let run = kvlease_telemetry::in_service(crate::traces::SERVICE, run);
                tracing::dispatcher::with_default(&dispatch, || runtime.block_on(run));
                let _ = done.send(());
            })
            .map_err(Error::StepThread)?;
        Ok(finished)
    }

    /// Runs until `shutdown` turns true; then finishes every request
    /// (`CANCELLED`), releases what it holds and closes the session.
    pub(crate) async fn run(mut self, mut shutdown: watch::Receiver<bool>) {
        self.publish();
        loop {
            if *shutdown.borrow() {
                break;
            }
            self.take_submissions();
            self.reap_cancelled();
            // a request starved past the queue's maximum wait gets its
            // answer, which says so when the session at the cache is missing
            self.core.set_session_missing(self.cache.state().missing());
            if self
                .core
                .expire_queue(tokio::time::Instant::now().into_std())
                > 0
            {
                self.route_outputs();
                self.publish();
            }
            if self.core.is_quiet() {
                // The keep-alive task may find the session lost (the cache
                // restarted) while nothing runs: re-open it now rather than
                // on the next request, so the new epoch is in use at once.
                if self.cache.state().is_lost() {
                    self.recover().await;
                    if self.cache.state().is_lost() {
                        tokio::select! {
                            _ = tokio::time::sleep(IDLE_RECHECK) => {}
                            _ = shutdown.changed() => {}
                        }
                    }
                    continue;
                }
                self.publish();
                tokio::select! {
                    sub = self.intake.recv() => match sub {
                        Some(sub) => self.accept(sub),
                        None => break,
                    },
                    _ = shutdown.changed() => {}
                    _ = tokio::time::sleep(IDLE_RECHECK) => {}
                }
                continue;
            }
            if self.cache.state().is_lost() {
                self.recover().await;
            }
            let started = Instant::now();
            let step = self.core.begin_step();
            // Its own trace (no parent), exported when `mark` says so.
            let span = tracing::info_span!(parent: None, STEP_SPAN, kvlease.step = step.get() as i64,
                kvlease.step_sampled = tracing::field::Empty);
            // An explicit root starts from an empty context: give it the
            // scheduler's logical service (refusal logged; it only loses it).
            let _ = kvlease_telemetry::set_parent(
                &span,
                kvlease_telemetry::with_service(&Default::default(), crate::traces::SERVICE),
            );
            self.step_rejects = false;
            self.step_preemptions = false;
            let progressed = self.step_once(step).instrument(span.clone()).await;
            self.trace_preemptions();
            let ended = UnmarkedStep {
                span,
                step,
                rejects: self.step_rejects,
                preemptions: self.step_preemptions,
            };
            if self
                .pending_settle
                .as_ref()
                .is_some_and(|p| p.step() == step)
            {
                self.unmarked = Some(ended);
            } else {
                ended.mark(self.config.trace_steps_one_in);
            }
            if progressed {
                self.metrics.step(started.elapsed());
            }
            self.route_outputs();
            self.publish();
            if progressed {
                self.backoff = MIN_BACKOFF;
            } else {
                // nothing could run (cache unreachable, pool full with
                // nothing to free): wait a little instead of spinning
                tokio::select! {
                    _ = tokio::time::sleep(self.backoff) => {}
                    _ = shutdown.changed() => {}
                }
                self.backoff = (self.backoff * 2).min(MAX_BACKOFF);
            }
        }
        self.stop().await;
    }

    async fn stop(&mut self) {
        self.finish_in_flight().await;
        if let Some(u) = self.unmarked.take() {
            u.mark(self.config.trace_steps_one_in);
        }
        // no pass carries the copies the last extends named: the release
        // below drops them at the cache, and the last step completes
        self.core.abandon_tier_copies();
        self.take_submissions();
        self.core.cancel_all("the scheduler is shutting down");
        self.route_outputs();
        self.flush_releases().await;
        self.complete(None).await;
        if let Err(e) = self.cache.close_session().await {
            tracing::warn!(error = %e, "closing the cache session failed");
        }
        self.publish();
    }

    fn take_submissions(&mut self) {
        while let Ok(sub) = self.intake.try_recv() {
            self.accept(sub);
        }
    }

    fn accept(&mut self, sub: Submission) {
        self.backlog.fetch_sub(1, Ordering::AcqRel);
        let id = sub.request.id;
        self.metrics.arrived(id, sub.request.prompt.len());
        self.streams.insert(id, sub.events);
        self.branch_ends.insert(id, sub.ended);
        self.traces.accept(id, sub.trace);
        self.core.submit(sub.request);
        self.route_outputs();
    }

    fn reap_cancelled(&mut self) {
        let gone: Vec<RequestId> = self
            .streams
            .iter()
            .filter(|(_, tx)| tx.is_closed())
            .map(|(id, _)| *id)
            .collect();
        for id in gone {
            tracing::debug!(request = id.get(), "client went away");
            self.core.cancel(id, "client went away");
        }
        let mut ended = Vec::new();
        for (id, rx) in &mut self.branch_ends {
            while let Ok(index) = rx.try_recv() {
                ended.push((*id, index));
            }
        }
        for (id, index) in ended {
            tracing::debug!(
                request = id.get(),
                index,
                "sample's text ended: stopping it"
            );
            self.core.end_branch(id, index);
        }
    }

    /// One step (begun in the core): makes the calls of the core's
    /// [`StepPlan`] in its order; returns whether any forward pass ran or
    /// finished.
    async fn step_once(&mut self, step: Step) -> bool {
        self.refused_before = std::mem::take(&mut self.refused);
        let plan = StepPlan::new(self.core.config().order, self.in_flight.len());
        self.execute(step, plan).await
    }

    /// Waits for the forward passes in flight, if any, applies them, streams
    /// their tokens, releases what ended (fenced at their step) and completes
    /// the steps: the core's [`StepPlan::finish_in_flight`], once a pass.
    async fn finish_in_flight(&mut self) {
        while !self.in_flight.is_empty() {
            self.execute(self.core.step(), StepPlan::finish_in_flight())
                .await;
        }
    }

    /// Makes `plan`'s calls for `step`, in its order; returns whether a
    /// forward pass ran or finished.
    async fn execute(&mut self, step: Step, mut plan: StepPlan) -> bool {
        let mut between = BetweenPasses::default();
        while let Some(call) = plan.next_call() {
            // A settle's Step call may still be on its way (sent after the
            // launch): its answer is applied before the core plans or
            // applies anything more, and before the next call to the cache
            // (releases and leases only when there are some to send).
            let settle_first = match call {
                Call::FlushReleases => self.core.has_releases(),
                Call::Admit => self.core.may_admit(),
                // applied between the pass's answer and its results
                Call::Collect => false,
                _ => true,
            };
            if settle_first {
                self.settled().await;
            }
            match call {
                Call::FlushReleases => self.flush_releases().await,
                Call::Admit => self.admit(step).await,
                Call::Extend => self.extend(step).await,
                // a pipelined step that only added a pass leaves its
                // planned extends to the next settle: they add up
                Call::Plan => {
                    let planned = self.core.plan_extends(true);
                    self.planned_extends
                        .get_or_insert_with(Vec::new)
                        .extend(planned);
                }
                Call::Launch => {
                    let launched = self.launch(step);
                    plan.launched(launched);
                    between.log(step, launched);
                    between.launched = launched.then(Instant::now);
                }
                Call::Collect => {
                    if let Some(f) = self.in_flight.pop_front() {
                        between.arrived = Some(self.collect_forward(f).await);
                        between.applied = Some(Instant::now());
                        // when a launch follows, its tokens are streamed at
                        // the step's end, once the next pass is out
                        if !plan.launches_later() {
                            self.route_outputs();
                        }
                    }
                }
                Call::Settle { extend } => {
                    let at = self.core.settle_step(step);
                    // with a pass in flight the loop's next wait is for it:
                    // the call's answer is applied once that pass is back
                    let ahead = !self.in_flight.is_empty();
                    let arrived = between.launched.and(between.arrived);
                    self.settle(extend.then_some(at), ahead, arrived).await;
                    between.settled = Some(Instant::now());
                }
                // a CompleteStep the cache did not acknowledge is tried again
                Call::RetryComplete => self.complete(None).await,
            }
        }
        plan.progressed()
    }

    /// Re-opens the session after the cache lost it, re-registers the pools
    /// and re-leases (recompute) or rejects every live sequence.
    async fn recover(&mut self) {
        self.finish_in_flight().await;
        // the prefill progress `Plan` kept for a settle names the lost
        // session's leases: the re-leased sequences report afresh; the
        // copies its grants named are the lost session's too
        self.planned_extends = None;
        self.core.abandon_tier_copies();
        let reopened = keepalive::reopen(
            &self.cache,
            &self.config.holder,
            self.config.session_ttl_ms,
            self.core.groups(),
        )
        .await;
        let (session, groups) = match reopened {
            Ok(r) => r,
            Err(e) => {
                tracing::warn!(error = %e, "re-opening the cache session failed");
                return;
            }
        };
        self.core.set_groups(groups);
        // a restarted cache may have another batch limit
        self.core.set_batch_limit(session.batch_limit());
        let recompute = self.config.on_cache_restart == OnCacheRestart::Recompute;
        self.core
            .leases_lost(recompute, &self.cache.state().lost_why());
        self.cache.state().recovered();
        tracing::info!(
            session_id = session.id.get(),
            epoch = session.epoch.get(),
            max_batch = session.max_batch,
            recompute,
            "cache session re-opened"
        );
        self.route_outputs();
    }
}

/// How often an idle step loop looks at the session's health.
const IDLE_RECHECK: Duration = Duration::from_secs(1);
