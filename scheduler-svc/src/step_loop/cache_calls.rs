//! The step loop's calls to the cache: releases (alone or in a `Step`
//! call with the completion and the extends), leases with the `Match` that
//! routes them, extends split at the batch limit, `CompleteStep`; and how a
//! failed call is noted for the core.

use std::time::Instant;

use tokio::task::JoinHandle;
use tracing::Instrument;

use super::StepLoop;
use super::report::record_call;
use crate::client::StepAnswer;
use crate::domain::{ExtendSpec, LeaseMode, Outcome, Step, StepCall, StepExtend, StepRelease};
use crate::error::Error;
use crate::error::Result;
use crate::step::{CallFailure, ReleaseBatch};

impl StepLoop {
    pub(super) async fn extend(&mut self, step: Step) {
        let specs = self.take_extends();
        if specs.is_empty() {
            return;
        }
        let traces = self.extend_traceparents(&specs);
        let (outcomes, failed) = self.extend_calls(step, &specs, &traces).await;
        self.apply_extends(step, outcomes, failed);
    }

    /// The extends to send: those [`Call::Plan`](crate::step::Call::Plan)
    /// planned before the launch, else the work planned now (every decode
    /// waiting for its extend).
    fn take_extends(&mut self) -> Vec<ExtendSpec> {
        match self.planned_extends.take() {
            Some(planned) => self.core.settle_extends(planned),
            None => self.core.plan_extends(false),
        }
    }

    /// The trace context of each extend's request, none for a sequence
    /// whose pass is in flight: its extend, sent after the launch, grows the
    /// lease a step ahead, and a refusal only holds the sequence back a
    /// step, so it is not the request's `Reject` (a second refusal, at
    /// rest, is). None either for one that a refusal would preempt: the
    /// request goes on, so the refusal is no error of its trace (the
    /// request's `preempt` span says why; the cache's `Reject` is in the
    /// step's trace, which a preemption samples).
    fn extend_traceparents(&self, specs: &[ExtendSpec]) -> Vec<String> {
        // in steady decode most are in flight: no context cloned for those
        self.traces.traceparents(specs.iter().map(|s| {
            let untraced = self.core.in_flight(s.seq_id) || self.core.refusal_preempts(s.seq_id);
            (!untraced).then_some(s.seq_id)
        }))
    }

    /// Sends extends of `step` in `Extend` calls of at most the cache's
    /// batch limit each (`traces` as for `CacheClient::lease`), stopping at
    /// the first that fails; returns the outcomes of the calls answered, in
    /// order, and that failure.
    pub(super) async fn extend_calls(
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
                .extend(step, chunk, chunk_traces)
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

    /// Applies the outcomes of a step's extends (calls that named `step`),
    /// all at once (a planned decode with no outcome does not run);
    /// `failed`: the call that failed after them.
    pub(super) fn apply_extends(
        &mut self,
        step: Step,
        outcomes: Vec<Outcome>,
        failed: Option<Error>,
    ) {
        self.trace_rejects("Extend", &outcomes);
        self.core.apply_extends(step, outcomes);
        self.trace_preemptions();
        if let Some(e) = failed {
            self.core.extends_failed();
            self.note("Extend", &e, None);
        }
    }

    pub(super) async fn admit(&mut self, step: Step) {
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
        let (lease_spans, traces) = self.traces.leasing(step, &specs);
        let span = self.batch_span("Lease", step);
        let result = self
            .cache
            .lease(step, LeaseMode::Admit, &specs, &traces)
            .instrument(span.clone())
            .await;
        record_call(&span, &result);
        let answered = result.as_deref().unwrap_or_default();
        self.traces.leased(lease_spans, &specs, answered);
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
    pub(super) async fn route(&mut self) {
        let wanted = self.core.match_wanted();
        if wanted.is_empty() {
            return;
        }
        let groups: Vec<String> = self.core.groups().iter().map(|g| g.name.clone()).collect();
        match self.cache.match_prefixes(&groups, &wanted).await {
            Ok(rows) => self
                .core
                .set_matches(wanted.iter().map(|w| w.request).zip(rows).collect()),
            Err(e) => {
                self.metrics.match_failed();
                tracing::warn!(error = %e, "Match failed: this step routes by load alone");
            }
        }
    }

    /// After a forward pass returned: the releases the core hands out (what
    /// ended, fenced at the pass's step), the completion of the steps the
    /// core says are complete and, with `extend`, that step's extends (those
    /// planned before this step's launch, if it planned ahead), in
    /// one `Step` call (the cache applies them in that order). Extends past
    /// the cache's batch limit follow in `Extend` calls; releases past it
    /// wait for the next flush.
    ///
    /// With `ahead` (a pass is in flight, which the loop waits for next),
    /// the call goes out and the loop goes on: its answer is applied by
    /// [`StepLoop::settled`], which the loop calls before the core next
    /// needs it (before any other cache call, and before it applies the
    /// next pass), so the core sees the same order of events and the cache
    /// one call at a time, while the call's round trip overlaps the wait
    /// for the pass instead of coming before it.
    pub(super) async fn settle(
        &mut self,
        extend: Option<Step>,
        ahead: bool,
        arrived: Option<Instant>,
    ) {
        debug_assert!(
            self.pending_settle.is_none(),
            "the loop applies a settle's answer before the next settle"
        );
        if self.refused || self.refused_before {
            // The cache refused a call of this step or the last: each part
            // in its own call, so the one it refuses (an invalid item, a
            // limit it did not advertise) does not hold back the others.
            // The releases go alone at the next step's flush.
            self.complete(extend).await;
            if let Some(step) = extend {
                self.extend(step).await;
            }
            return;
        }
        let batch = self.core.take_releases();
        let specs = match extend {
            Some(_) => self.take_extends(),
            None => Vec::new(),
        };
        let complete = self
            .core
            .complete_before(extend.filter(|_| !specs.is_empty()));
        if batch.is_empty() && complete.is_none() && specs.is_empty() {
            return;
        }
        let fence = batch.fence_step;
        let (release_spans, release_traces) = if batch.is_empty() {
            (Vec::new(), Vec::new())
        } else {
            self.traces.releasing(&batch.seq_ids, fence)
        };
        let mut extend_traces = self.extend_traceparents(&specs);
        // the first extends ride the Step call, the rest follow it
        let first = specs.len().min(self.core.batch_limit());
        let rest_traces = extend_traces.split_off(first.min(extend_traces.len()));
        let span_step = extend.or(complete).unwrap_or(self.core.step());
        let span = self.batch_span("Step", span_step);
        let call = StepCall {
            release: (!batch.is_empty()).then_some(StepRelease {
                seq_ids: &batch.seq_ids,
                fence_step: fence,
                discard_unwritten: batch.discard_unwritten,
                traces: &release_traces,
            }),
            complete_step: complete,
            extend: extend.filter(|_| first > 0).map(|step| StepExtend {
                step,
                specs: &specs[..first],
                traces: &extend_traces,
            }),
        };
        let started = Instant::now();
        let call = self.cache.step(call).instrument(span.clone());
        // the spawned task runs outside the loop's logical-service context;
        // the call's spans end with its answer, not when it is applied
        let call = kvlease_telemetry::in_service(crate::traces::SERVICE, async move {
            let answer = call.await;
            let answered = Instant::now();
            record_call(&span, &answer);
            drop(release_spans);
            (answer, answered)
        });
        self.pending_settle = Some(PendingSettle {
            call: tokio::spawn(call),
            batch,
            complete,
            extend,
            specs,
            first,
            rest_traces,
            started,
            arrived: arrived.filter(|_| ahead),
            step: self.core.step(),
        });
        if ahead {
            // the loop's next await is the collect, after its bookkeeping:
            // let the pass just launched and this call go out first
            tokio::task::yield_now().await;
        } else {
            self.settled().await;
        }
    }

    /// Waits for the settle's `Step` call on its way, if any, and applies
    /// its answer (see [`StepLoop::settle`]).
    pub(super) async fn settled(&mut self) {
        let Some(p) = self.pending_settle.take() else {
            return;
        };
        // the answer to a step that has ended: what it refuses or preempts
        // marks that step's trace (the current step's marks are kept apart)
        let late = self.unmarked.take_if(|u| u.step == p.step);
        let current = late.is_some().then(|| {
            (
                std::mem::take(&mut self.step_rejects),
                std::mem::take(&mut self.step_preemptions),
            )
        });
        let waiting = Instant::now();
        let (result, answered) = match p.call.await {
            Ok(r) => r,
            Err(e) => (
                Err(Error::CacheUnavailable(format!(
                    "the Step call's task failed: {e}"
                ))),
                Instant::now(),
            ),
        };
        if let Some(arrived) = p.arrived {
            // the loop's turn: from the collected pass's answer to the call
            // sent, after which the loop waited for the next pass; `waited`:
            // how long it then waited for this answer
            tracing::debug!(
                step = p.step.get(),
                settle_us = (answered - p.started).as_micros() as u64,
                turn_us = (p.started - arrived).as_micros() as u64,
                waited_us = waiting.elapsed().as_micros() as u64,
                "settled after the launch"
            );
        }
        let batch = p.batch;
        match result {
            Ok(answer) => {
                if let Some(counts) = answer.released {
                    log_released(&batch, counts);
                }
                if !batch.is_empty() {
                    self.core.releases_sent(batch);
                }
                if let Some(step) = p.complete {
                    self.core.step_completed(step);
                }
                if !p.specs.is_empty() {
                    let mut outcomes = answer.extended;
                    let mut failed = None;
                    let rest = &p.specs[p.first..];
                    let step = p.extend.unwrap_or(p.step);
                    if !rest.is_empty() {
                        let (more, e) = self.extend_calls(step, rest, &p.rest_traces).await;
                        outcomes.extend(more);
                        failed = e;
                    }
                    self.apply_extends(step, outcomes, failed);
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
                if !p.specs.is_empty() {
                    self.core.extends_failed();
                }
            }
        }
        self.forget_released();
        if let (Some(mut u), Some((rejects, preemptions))) = (late, current) {
            // (apply_extends took the preemptions the answer caused)
            u.rejects |= self.step_rejects;
            u.preemptions |= self.step_preemptions;
            (self.step_rejects, self.step_preemptions) = (rejects, preemptions);
            u.mark(self.config.trace_steps_one_in);
        }
    }

    /// Sends `CompleteStep` for the step the core says is complete, if any
    /// (before `extends_at`, the step the extends that follow name).
    pub(super) async fn complete(&mut self, extends_at: Option<Step>) {
        let Some(step) = self.core.complete_before(extends_at) else {
            return;
        };
        let span = self.batch_span("CompleteStep", step);
        match self.cache.complete_step(step).instrument(span).await {
            Ok(_) => self.core.step_completed(step),
            Err(e) => {
                self.note("CompleteStep", &e, None);
            }
        }
    }

    /// Sends the releases the core hands out, fenced where it says, in
    /// `Release` calls of at most the cache's batch limit, until none is
    /// left or one fails (its sequences then wait for the next step).
    pub(super) async fn flush_releases(&mut self) {
        while self.core.has_releases() {
            let batch = self.core.take_releases();
            if batch.is_empty() || !self.release(batch).await {
                break;
            }
        }
        self.forget_released();
    }

    /// One `Release` call; returns whether the cache answered it.
    pub(super) async fn release(&mut self, batch: ReleaseBatch) -> bool {
        let fence = batch.fence_step;
        let span = self.batch_span("Release", fence.unwrap_or(self.core.step()));
        let (release_spans, traces) = self.traces.releasing(&batch.seq_ids, fence);
        let result = self
            .cache
            .release(&batch.seq_ids, fence, batch.discard_unwritten, &traces)
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
    pub(super) fn note(
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

    /// Drops the trace contexts of sequences the core says are released.
    pub(super) fn forget_released(&mut self) {
        for seq_id in self.core.take_released() {
            self.traces.forget_seq(seq_id);
        }
    }

    /// The client span of one of the step's calls to the cache, in the
    /// step's trace (the current span); the requests it serves get their
    /// own spans through the items' trace contexts.
    pub(super) fn batch_span(&self, method: &'static str, step: Step) -> tracing::Span {
        let span = kvlease_telemetry::client_span("kvlease.v1.CacheService", method);
        span.record("kvlease.step", step.get() as i64);
        span
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
fn log_released(batch: &ReleaseBatch, (freed, fenced): (u64, u64)) {
    tracing::debug!(
        sequences = batch.seq_ids.len(),
        freed,
        fenced,
        fence_step = batch.fence_step.map(Step::get),
        "released"
    );
}

/// A settle's `Step` call on its way ([`StepLoop::settle`]) and what it
/// carries, to apply its answer.
pub(super) struct PendingSettle {
    call: JoinHandle<(Result<StepAnswer>, Instant)>,
    batch: ReleaseBatch,
    complete: Option<Step>,
    extend: Option<Step>,
    specs: Vec<ExtendSpec>,
    /// How many of `specs` ride the call; the rest follow in `Extend` calls.
    first: usize,
    rest_traces: Vec<String>,
    started: Instant,
    /// When the pass collected before the call arrived (a settle after a
    /// launch), for the log of the loop's turn.
    arrived: Option<Instant>,
    step: Step,
}

impl PendingSettle {
    /// The step whose settle sent the call.
    pub(super) fn step(&self) -> Step {
        self.step
    }
}

impl std::fmt::Debug for PendingSettle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PendingSettle")
            .field("releases", &self.batch.seq_ids.len())
            .field("complete", &self.complete)
            .field("extends", &self.specs.len())
            .finish()
    }
}
