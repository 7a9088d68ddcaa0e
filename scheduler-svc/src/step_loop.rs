//! The async step loop: drives `step::Core` with the cache and worker
//! clients, one batched Extend and one batched Lease per step, forwards on
//! the workers, streams outputs, sends the releases the core hands out with
//! the fence it chose, and sends `CompleteStep` for the step the core says
//! is complete. The rule behind both (no block reaches another sequence
//! before the forward pass that could read it returned) lives in
//! `step/fence.rs`, where unit tests pin it; this loop only does the I/O.
//!
//! With overlap on, step N+1's releases and admission leases run while step
//! N's forward pass is in flight (so the core fences those releases at N);
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

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use kvlease_telemetry::attributes::STEP_SPAN;
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;
use tracing::Instrument;

use crate::client::{CacheClient, StepCall, StepExtend, StepRelease, WorkerClient};
use crate::config::OnCacheRestart;
use crate::domain::{
    ExtendSpec, ForwardResult, GroupGeometry, Outcome, Output, RequestId, SeqId, Step,
};
use crate::error::{Error, Result};
use crate::metrics::SchedulerMetrics;
use crate::queue::Request;
use crate::session;
use crate::step::{CallFailure, Core, CoreConfig, Counters, ReleaseBatch};
use crate::traces::{RequestTraces, StepSampling};

/// A request handed to the loop, with the stream its outputs go to and the
/// span of its `Generate` call (the root of the request's trace: the loop
/// adds its spans under it, see `traces.rs`).
#[derive(Debug)]
pub struct Submission {
    pub request: Request,
    pub events: mpsc::UnboundedSender<Output>,
    pub trace: tracing::Span,
}

/// What `GetStatus` shows of the loop.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StatusSnapshot {
    pub queued: u32,
    pub running: u32,
    pub preempted: u32,
    pub steps: u64,
    pub session_id: u64,
    pub epoch: u64,
    pub counters: Counters,
}

/// The service side of the loop: submit requests, read the status.
#[derive(Debug, Clone)]
pub struct StepLoopHandle {
    submit: mpsc::UnboundedSender<Submission>,
    status: watch::Receiver<StatusSnapshot>,
    next_id: Arc<AtomicU64>,
    /// Submissions the loop has not taken in yet.
    backlog: Arc<AtomicUsize>,
    /// Most requests waiting (0: no limit).
    max_queue: usize,
}

impl StepLoopHandle {
    /// A fresh request id (also its arrival order).
    pub fn next_request_id(&self) -> RequestId {
        RequestId(self.next_id.fetch_add(1, Ordering::Relaxed))
    }

    /// Hands a request to the loop; its outputs arrive on the receiver, the
    /// last one being `Output::Finished`. Dropping the receiver cancels it.
    pub fn submit(
        &self,
        request: Request,
        trace: tracing::Span,
    ) -> Result<mpsc::UnboundedReceiver<Output>> {
        let backlog = self.backlog.load(Ordering::Acquire);
        let queued = backlog + self.status.borrow().queued as usize;
        if self.max_queue > 0 && queued >= self.max_queue {
            return Err(Error::QueueFull {
                queued,
                limit: self.max_queue,
            });
        }
        let (events, rx) = mpsc::unbounded_channel();
        self.backlog.fetch_add(1, Ordering::AcqRel);
        self.submit
            .send(Submission {
                request,
                events,
                trace,
            })
            .map_err(|_| {
                self.backlog.fetch_sub(1, Ordering::AcqRel);
                Error::ShuttingDown
            })?;
        Ok(rx)
    }

    pub fn status(&self) -> StatusSnapshot {
        self.status.borrow().clone()
    }
}

/// Everything the loop needs besides the core.
#[derive(Debug, Clone)]
pub struct StepLoopConfig {
    pub core: CoreConfig,
    pub overlap: bool,
    pub holder: String,
    pub session_ttl_ms: u64,
    pub on_cache_restart: OnCacheRestart,
    /// The last step warm-up used; the loop's steps come after it.
    pub first_step: u64,
    /// One in this many uneventful step traces is exported (0: none).
    pub trace_steps_one_in: u64,
    /// Most requests waiting in the queue (0: no limit); more are refused
    /// at submission.
    pub max_queue: usize,
}

struct InFlight {
    step: Step,
    launched: Instant,
    tasks: Vec<ForwardTask>,
}

/// One group's forward call of a step: the group, its sequences, the task.
type ForwardTask = (usize, Vec<SeqId>, JoinHandle<Result<Vec<ForwardResult>>>);

/// The step loop. Build with [`StepLoop::new`], run with [`StepLoop::run`].
#[derive(Debug)]
pub struct StepLoop {
    core: Core,
    config: StepLoopConfig,
    cache: CacheClient,
    workers: Vec<WorkerClient>,
    steps_run: u64,
    streams: HashMap<RequestId, mpsc::UnboundedSender<Output>>,
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
    in_flight: Option<InFlight>,
    backoff: Duration,
    metrics: SchedulerMetrics,
    /// Counters as last reported to the metrics.
    reported: std::cell::Cell<Counters>,
    /// The cache refused a call of this step (see [`CallFailure::Refused`]),
    /// and of the step before: while either is set, `settle` sends the
    /// step's parts in calls of their own instead of one `Step` call.
    refused: bool,
    refused_before: bool,
}

impl std::fmt::Debug for InFlight {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("InFlight")
            .field("step", &self.step)
            .field("groups", &self.tasks.len())
            .finish()
    }
}

const MIN_BACKOFF: Duration = Duration::from_millis(5);
const MAX_BACKOFF: Duration = Duration::from_millis(500);

impl StepLoop {
    /// A loop over `groups` (index i served by `workers[i]`).
    pub fn new(
        config: StepLoopConfig,
        groups: Vec<GroupGeometry>,
        cache: CacheClient,
        workers: Vec<WorkerClient>,
        metrics: SchedulerMetrics,
    ) -> (Self, StepLoopHandle) {
        let (submit, intake) = mpsc::unbounded_channel();
        let (status, status_rx) = watch::channel(StatusSnapshot::default());
        let backlog = Arc::new(AtomicUsize::new(0));
        let handle = StepLoopHandle {
            submit,
            status: status_rx,
            next_id: Arc::new(AtomicU64::new(1)),
            backlog: Arc::clone(&backlog),
            max_queue: config.max_queue,
        };
        let mut core = Core::new(config.core.clone(), groups);
        core.continue_after(Step(config.first_step));
        core.set_batch_limit(cache.session().batch_limit());
        let step_loop = Self {
            core,
            config,
            cache,
            workers,
            steps_run: 0,
            streams: HashMap::new(),
            traces: RequestTraces::default(),
            step_rejects: false,
            step_preemptions: false,
            intake,
            backlog,
            status,
            in_flight: None,
            backoff: MIN_BACKOFF,
            metrics,
            reported: std::cell::Cell::new(Counters::default()),
            refused: false,
            refused_before: false,
        };
        (step_loop, handle)
    }

    /// Runs until `shutdown` turns true; then finishes every request
    /// (`CANCELLED`), releases what it holds and closes the session.
    pub async fn run(mut self, mut shutdown: watch::Receiver<bool>) {
        self.publish();
        loop {
            if *shutdown.borrow() {
                break;
            }
            self.take_submissions();
            self.reap_cancelled();
            // a request starved past the queue's maximum wait gets its answer
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
                kvlease_telemetry::with_service(&Default::default(), crate::server::SERVICE),
            );
            self.step_rejects = false;
            self.step_preemptions = false;
            let progressed = self.step_once(step).instrument(span.clone()).await;
            self.trace_preemptions();
            StepSampling {
                one_in: self.config.trace_steps_one_in,
            }
            .mark(&span, step, self.step_rejects, self.step_preemptions);
            drop(span);
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
        if let Some(f) = self.in_flight.take() {
            self.finish_forward(f).await;
        }
        self.take_submissions();
        self.core.cancel_all("the scheduler is shutting down");
        self.route_outputs();
        self.flush_releases().await;
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
    }

    /// One step (begun in the core); returns whether any forward pass ran
    /// or finished.
    async fn step_once(&mut self, step: Step) -> bool {
        self.refused_before = std::mem::take(&mut self.refused);
        let mut progressed = false;
        if self.config.overlap {
            self.flush_releases().await;
            self.admit(step).await;
            if let Some(f) = self.in_flight.take() {
                // between two forward passes, one round trip: the finished
                // pass's releases and completion with this step's extends
                let arrived = self.collect_forward(f).await;
                let applied = Instant::now();
                self.settle(Some(step)).await;
                let settled = Instant::now();
                progressed = true;
                let launched = self.launch(step);
                // what separates two forward passes on the scheduler's side
                // (the worker logs each pass's compute)
                tracing::debug!(
                    step = step.get(),
                    apply_us = (applied - arrived).as_micros() as u64,
                    settle_us = (settled - applied).as_micros() as u64,
                    launch_us = settled.elapsed().as_micros() as u64,
                    launched,
                    "between forward passes"
                );
            } else {
                self.extend(step).await;
                progressed |= self.launch(step);
            }
        } else {
            self.flush_releases().await;
            self.extend(step).await;
            self.admit(step).await;
            if self.launch(step) {
                if let Some(f) = self.in_flight.take() {
                    self.finish_forward(f).await;
                }
                progressed = true;
            }
        }
        if !progressed {
            // a CompleteStep the cache did not acknowledge is tried again
            self.complete().await;
        }
        progressed
    }

    async fn extend(&mut self, step: Step) {
        let specs = self.core.plan_extends();
        if specs.is_empty() {
            return;
        }
        let traces = self.traces.traceparents(specs.iter().map(|s| s.seq_id));
        let (outcomes, failed) = self.extend_calls(step, &specs, &traces).await;
        self.apply_extends(outcomes, failed);
    }

    /// Sends extends of `step` in `Extend` calls of at most the cache's
    /// batch limit each (`traces` as for `CacheClient::lease`), stopping at
    /// the first that fails; returns the outcomes of the calls answered, in
    /// order, and that failure.
    async fn extend_calls(
        &mut self,
        step: Step,
        specs: &[ExtendSpec],
        traces: &[String],
    ) -> (Vec<Outcome>, Option<Error>) {
        let mut outcomes = Vec::with_capacity(specs.len());
        let mut sent = 0;
        for chunk in specs.chunks(self.core.batch_limit().max(1)) {
            let end = (sent + chunk.len()).min(traces.len());
            let chunk_traces = traces.get(sent.min(end)..end).unwrap_or_default();
            sent += chunk.len();
            let span = self.batch_span("Extend", step);
            let result = self
                .cache
                .extend(step.get(), chunk, chunk_traces)
                .instrument(span.clone())
                .await;
            record_call(&span, &result);
            match result {
                Ok(answered) => outcomes.extend(answered),
                Err(e) => return (outcomes, Some(e)),
            }
        }
        (outcomes, None)
    }

    /// Applies a step's extend outcomes, all at once (a planned decode with
    /// no outcome does not run); `failed`: the call that failed after them.
    fn apply_extends(&mut self, outcomes: Vec<Outcome>, failed: Option<Error>) {
        self.trace_rejects("Extend", &outcomes);
        self.core.apply_extends(outcomes);
        self.trace_preemptions();
        if let Some(e) = failed {
            self.core.extends_failed();
            self.note("Extend", &e, None);
        }
    }

    async fn admit(&mut self, step: Step) {
        if !self.cache.is_up() {
            // probing with leases while the cache is down only adds load;
            // the keep-alive task notices when it is back
            return;
        }
        self.route().await;
        let specs = self.core.plan_admission();
        if specs.is_empty() {
            return;
        }
        let (lease_spans, traces) = self
            .traces
            .leasing(step, specs.iter().map(|s| (s.seq_id, s.request)));
        let span = self.batch_span("Lease", step);
        let result = self
            .cache
            .lease(step.get(), false, false, &specs, &traces)
            .instrument(span.clone())
            .await;
        record_call(&span, &result);
        for (lease, outcome) in lease_spans.iter().zip(result.iter().flatten()) {
            let granted = matches!(outcome, Outcome::Grant(_));
            lease.record("kvlease.outcome", if granted { "grant" } else { "reject" });
        }
        drop(lease_spans);
        match result {
            Ok(outcomes) => {
                self.metrics.admitted(&specs, &outcomes);
                self.trace_rejects("Lease", &outcomes);
                self.core.apply_leases(outcomes)
            }
            Err(e) => {
                self.core.leases_failed();
                self.note("Lease", &e, None);
            }
        }
    }

    /// Asks the cache what the queue head would reuse in each group, for
    /// kv-aware routing; a failed `Match` leaves this step's routing to load
    /// alone (least committed), logged and counted.
    async fn route(&mut self) {
        let wanted = self.core.match_wanted();
        if wanted.is_empty() {
            return;
        }
        let groups: Vec<String> = self.core.groups().iter().map(|g| g.name.clone()).collect();
        match self.cache.match_prefixes(&groups, &wanted).await {
            Ok(rows) => self
                .core
                .set_reuse(wanted.iter().map(|w| w.request).zip(rows).collect()),
            Err(e) => {
                self.metrics.match_failed();
                tracing::warn!(error = %e, "Match failed: this step routes by load alone");
            }
        }
    }

    fn launch(&mut self, step: Step) -> bool {
        let batches = self.core.plan_forward();
        if batches.is_empty() {
            return false;
        }
        let mut tasks = Vec::with_capacity(batches.len());
        for (g, items) in batches {
            let copies = self.core.take_tier_copies(g);
            let Some(worker) = self.workers.get(g).cloned() else {
                self.core.forward_failed(g, "no worker for the group");
                continue;
            };
            let seqs: Vec<SeqId> = items.iter().map(|i| i.seq_id).collect();
            let span = kvlease_telemetry::client_span("kvlease.v1.WorkerService", "Forward");
            span.record("kvlease.step", step.get() as i64);
            // every request in the batch, one click away from the step
            for link in self.traces.links(seqs.iter().copied()) {
                kvlease_telemetry::add_link(&span, link, LINK_BATCHED);
            }
            let call = async move {
                let result = worker.forward(step.get(), &items, &copies).await;
                record_call(&tracing::Span::current(), &result);
                result
            }
            .instrument(span);
            // the spawned task runs outside the loop's logical-service context
            let call = kvlease_telemetry::in_service(crate::server::SERVICE, call);
            tasks.push((g, seqs, tokio::spawn(call)));
        }
        self.steps_run += 1;
        self.in_flight = Some(InFlight {
            step,
            launched: Instant::now(),
            tasks,
        });
        true
    }

    /// Waits for a forward pass, applies it, streams its tokens, releases
    /// what ended (fenced at its step) and completes the step.
    async fn finish_forward(&mut self, f: InFlight) {
        self.collect_forward(f).await;
        self.settle(None).await;
    }

    /// Waits for a forward pass, applies its results and streams its tokens.
    /// Returns when the last group's answer arrived.
    async fn collect_forward(&mut self, f: InFlight) -> Instant {
        let launched = f.launched;
        let mut arrived = Instant::now();
        for (g, seqs, task) in f.tasks {
            let result = task.await;
            arrived = Instant::now();
            self.traces.forwarded(&seqs, launched.elapsed());
            match result {
                Ok(Ok(results)) => self.core.apply_forward(g, results),
                Ok(Err(e)) => {
                    tracing::warn!(step = f.step.get(), group = g, error = %e, "forward failed");
                    self.core.forward_failed(g, &e.to_string());
                }
                Err(e) => self
                    .core
                    .forward_failed(g, &format!("forward task failed: {e}")),
            }
        }
        self.metrics.forward(arrived - launched);
        self.route_outputs();
        arrived
    }

    /// After a forward pass returned: the releases the core hands out (what
    /// ended, fenced at the pass's step), the completion of the steps the
    /// core says are complete and, with `extend`, that step's extends, in
    /// one `Step` call (the cache applies them in that order). Extends past
    /// the cache's batch limit follow in `Extend` calls; releases past it
    /// wait for the next flush.
    async fn settle(&mut self, extend: Option<Step>) {
        if self.refused || self.refused_before {
            // The cache refused a call of this step or the last: each part
            // in its own call, so the one it refuses (an invalid item, a
            // limit it did not advertise) does not hold back the others.
            // The releases go alone at the next step's flush.
            self.complete().await;
            if let Some(step) = extend {
                self.extend(step).await;
            }
            return;
        }
        let batch = self.core.take_releases();
        let complete = self.core.complete_through();
        let specs = match extend {
            Some(_) => self.core.plan_extends(),
            None => Vec::new(),
        };
        if batch.is_empty() && complete.is_none() && specs.is_empty() {
            return;
        }
        let fence = batch.fence_step;
        let (release_spans, release_traces) = if batch.is_empty() {
            (Vec::new(), Vec::new())
        } else {
            self.traces.releasing(&batch.seq_ids, fence)
        };
        let extend_traces = self.traces.traceparents(specs.iter().map(|s| s.seq_id));
        // the first extends ride the Step call, the rest follow it
        let (first, rest) = specs.split_at(specs.len().min(self.core.batch_limit()));
        let (first_traces, rest_traces) =
            extend_traces.split_at(first.len().min(extend_traces.len()));
        let span_step = extend.or(complete).unwrap_or(self.core.step());
        let span = self.batch_span("Step", span_step);
        let call = StepCall {
            release: (!batch.is_empty()).then_some(StepRelease {
                seq_ids: &batch.seq_ids,
                fence_step: fence.map(Step::get),
                discard_unwritten: batch.discard_unwritten,
                traces: &release_traces,
            }),
            complete_step: complete.map(Step::get),
            extend: extend.filter(|_| !first.is_empty()).map(|step| StepExtend {
                step: step.get(),
                specs: first,
                traces: first_traces,
            }),
        };
        let result = self.cache.step(call).instrument(span.clone()).await;
        record_call(&span, &result);
        drop(release_spans);
        match result {
            Ok(answer) => {
                if let Some(counts) = answer.released {
                    log_released(&batch, counts);
                }
                if !batch.is_empty() {
                    self.core.releases_sent(batch);
                }
                if let Some(step) = complete {
                    self.core.step_completed(step);
                }
                if !specs.is_empty() {
                    let mut outcomes = answer.extended;
                    let mut failed = None;
                    if let Some(step) = extend.filter(|_| !rest.is_empty()) {
                        let (more, e) = self.extend_calls(step, rest, rest_traces).await;
                        outcomes.extend(more);
                        failed = e;
                    }
                    self.apply_extends(outcomes, failed);
                }
            }
            Err(e) => {
                // Nothing of it is taken as done: the releases wait for the
                // next batch (unless the session is gone), a pending
                // completion folds into the next, the decodes sit this
                // step out.
                let failure = self.note("Step", &e, Some(&batch));
                if !batch.is_empty() {
                    self.core.release_failed(batch, failure);
                }
                if !specs.is_empty() {
                    self.core.extends_failed();
                }
            }
        }
        self.forget_released();
    }

    /// Sends `CompleteStep` for the step the core says is complete, if any.
    async fn complete(&mut self) {
        let Some(step) = self.core.complete_through() else {
            return;
        };
        let span = self.batch_span("CompleteStep", step);
        match self.cache.complete_step(step.get()).instrument(span).await {
            Ok(_) => self.core.step_completed(step),
            Err(e) => {
                self.note("CompleteStep", &e, None);
            }
        }
    }

    /// Sends the releases the core hands out, fenced where it says, in
    /// `Release` calls of at most the cache's batch limit, until none is
    /// left or one fails (its sequences then wait for the next step).
    async fn flush_releases(&mut self) {
        while self.core.has_releases() {
            let batch = self.core.take_releases();
            if batch.is_empty() || !self.release(batch).await {
                break;
            }
        }
        self.forget_released();
    }

    /// One `Release` call; returns whether the cache answered it.
    async fn release(&mut self, batch: ReleaseBatch) -> bool {
        let fence = batch.fence_step;
        let span = self.batch_span("Release", fence.unwrap_or(self.core.step()));
        let (release_spans, traces) = self.traces.releasing(&batch.seq_ids, fence);
        let result = self
            .cache
            .release(
                &batch.seq_ids,
                fence.map(Step::get),
                batch.discard_unwritten,
                &traces,
            )
            .instrument(span.clone())
            .await;
        record_call(&span, &result);
        drop(release_spans);
        match result {
            Ok(counts) => {
                log_released(&batch, counts);
                self.core.releases_sent(batch);
                true
            }
            Err(e) => {
                let failure = self.note("Release", &e, Some(&batch));
                self.core.release_failed(batch, failure);
                false
            }
        }
    }

    /// Logs a failed cache call (with the releases it carried, which the
    /// core keeps to send again unless the session is gone) and notes a
    /// refusal for `settle`; returns how it failed.
    fn note(
        &mut self,
        method: &'static str,
        e: &Error,
        releases: Option<&ReleaseBatch>,
    ) -> CallFailure {
        let failure = call_failure(e);
        let kept = releases.map_or(0, |b| b.seq_ids.len());
        match failure {
            // the client flagged the session lost; the loop re-opens it, and
            // the cache reclaimed what the session held
            CallFailure::SessionLost => tracing::warn!(method, error = %e, "cache session lost"),
            _ if releases.is_some_and(|b| !b.is_empty()) => tracing::warn!(
                method,
                error = %e,
                sequences = kept,
                fence_step = releases.and_then(|b| b.fence_step).map(Step::get),
                "cache call failed: its releases are kept and sent again at the next step"
            ),
            _ => tracing::warn!(method, error = %e, "cache call failed"),
        }
        self.refused |= failure == CallFailure::Refused;
        failure
    }

    /// Re-opens the session after the cache lost it, re-registers the pools
    /// and re-leases (recompute) or rejects every live sequence.
    async fn recover(&mut self) {
        if let Some(f) = self.in_flight.take() {
            self.finish_forward(f).await;
        }
        let reopened = session::reopen(
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
        self.core.leases_lost(recompute);
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

    /// Drops the trace contexts of sequences the core says are released.
    fn forget_released(&mut self) {
        for seq_id in self.core.take_released() {
            self.traces.forget_seq(seq_id);
        }
    }

    fn route_outputs(&mut self) {
        self.forget_released();
        // the status is current before a client sees its request end
        self.publish();
        for output in self.core.drain_outputs() {
            let id = output.request();
            let last = matches!(output, Output::Finished { .. });
            self.metrics.output(&output);
            if let Some(tx) = self.streams.get(&id) {
                // a closed stream is reaped as a cancellation
                let _ = tx.send(output);
            }
            if last {
                self.streams.remove(&id);
                self.traces.finish(id);
            }
        }
    }

    /// The client span of one of the step's calls to the cache, in the
    /// step's trace (the current span); the requests it serves get their
    /// own spans through the items' trace contexts.
    fn batch_span(&self, method: &'static str, step: Step) -> tracing::Span {
        let span = kvlease_telemetry::client_span("kvlease.v1.CacheService", method);
        span.record("kvlease.step", step.get() as i64);
        span
    }

    /// The core's preemptions since the last call, as spans in their
    /// requests' traces.
    fn trace_preemptions(&mut self) {
        for p in self.core.take_preemptions() {
            self.step_preemptions = true;
            self.traces.preempted(&p);
        }
    }

    /// Counts the refused sequences (the cache recorded each one in its
    /// request's trace; the request's `Generate` span records the reject it
    /// ends with) and marks the step's trace for export.
    fn trace_rejects(&mut self, method: &'static str, outcomes: &[Outcome]) {
        for outcome in outcomes {
            let Outcome::Reject(r) = outcome else {
                continue;
            };
            self.step_rejects = true;
            self.metrics.reject(method, r.reason.protocol_name());
            tracing::debug!(method, seq_id = r.seq_id.get(), reason = %r.reason, blocks_needed = r.blocks_needed,
                blocks_free = r.blocks_free, blocks_pending_free = r.blocks_pending_free, "sequence refused");
        }
    }

    fn publish(&self) {
        let session = self.cache.session();
        let to_u32 = |n: usize| u32::try_from(n).unwrap_or(u32::MAX);
        let snapshot = StatusSnapshot {
            queued: to_u32(self.core.queued()),
            running: to_u32(self.core.running()),
            preempted: to_u32(self.core.preempted()),
            steps: self.steps_run,
            session_id: session.id.get(),
            epoch: session.epoch.get(),
            counters: self.core.counters(),
        };
        let counters = self.core.counters();
        self.metrics.update(
            snapshot.queued,
            snapshot.running,
            &self.reported.get(),
            &counters,
        );
        self.reported.set(counters);
        self.status.send_if_modified(|s| {
            let changed = *s != snapshot;
            *s = snapshot;
            changed
        });
    }
}

/// How a cache call failed, for the core's decisions: no answer (retry as
/// is), a refusal (retry, parts apart), or the session gone.
fn call_failure(e: &Error) -> CallFailure {
    match e {
        Error::SessionLost(_) => CallFailure::SessionLost,
        // an answer outside the protocol, or an error status
        Error::Rpc { .. } | Error::Protocol { .. } => CallFailure::Refused,
        _ => CallFailure::Unanswered,
    }
}

/// A release the cache took: blocks freed at once and blocks fenced.
fn log_released(batch: &crate::step::ReleaseBatch, (freed, fenced): (u64, u64)) {
    tracing::debug!(
        sequences = batch.seq_ids.len(),
        freed,
        fenced,
        fence_step = batch.fence_step.map(Step::get),
        "released"
    );
}

/// Records a call's outcome on its client span: the peer's status code when
/// it answered one, UNAVAILABLE when it could not be reached.
fn record_call<T>(span: &tracing::Span, result: &Result<T>) {
    let status = match result {
        Ok(_) => Ok(()),
        Err(Error::Rpc { code, message, .. }) => Err(tonic::Status::new(*code, message.clone())),
        Err(e @ Error::CacheUnavailable(_)) => Err(tonic::Status::unavailable(e.to_string())),
        Err(e @ Error::SessionLost(_)) => Err(tonic::Status::failed_precondition(e.to_string())),
        Err(e) => Err(tonic::Status::unknown(e.to_string())),
    };
    kvlease_telemetry::record_client_result(span, &status);
}

/// `kvlease.link` on the link from a step's `Forward` call to a request in it.
const LINK_BATCHED: &str = "batched";

/// How often an idle step loop looks at the session's health.
const IDLE_RECHECK: Duration = Duration::from_secs(1);
