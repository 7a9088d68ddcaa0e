//! The step loop's forward passes: launching a step's batches on the
//! workers (one task per group, linked to every request in it) and
//! collecting their results into the core.

use std::time::Instant;

use tokio::task::JoinHandle;
use tracing::Instrument;

use super::StepLoop;
use super::report::record_call;
use crate::domain::{ForwardAnswer, SeqId, Step};
use crate::error::Result;

/// The forward pass of a step, launched and not collected yet.
pub(super) struct InFlight {
    step: Step,
    launched: Instant,
    tasks: Vec<ForwardTask>,
}

/// One group's forward call of a step: the group, its sequences, the task.
type ForwardTask = (usize, Vec<SeqId>, JoinHandle<Result<ForwardAnswer>>);

impl std::fmt::Debug for InFlight {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("InFlight")
            .field("step", &self.step)
            .field("groups", &self.tasks.len())
            .finish()
    }
}

impl StepLoop {
    /// Launches the step's forward batches, one task per group (with the
    /// host-tier copies the group's grants named since its last pass);
    /// returns whether any was launched.
    pub(super) fn launch(&mut self, step: Step) -> bool {
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
            // the group's pass still in flight, which the worker runs first
            let after = self.core.follows(g);
            let chunks = self.traces.forward_items(&items);
            let span = kvlease_telemetry::client_span("kvlease.v1.WorkerService", "Forward");
            span.record("kvlease.step", step.get() as i64);
            // every request in the batch, one click away from the step
            for link in self.traces.links(seqs.iter().copied()) {
                kvlease_telemetry::add_link(&span, link, LINK_BATCHED);
            }
            let call = async move {
                let sent = Instant::now();
                let result = worker.forward(step, after, &items, &copies, &chunks).await;
                // the worker logs its compute and its wait for the pass;
                // the rest of this is both messages' way there and back
                tracing::debug!(
                    step = step.get(),
                    group = g,
                    round_trip_us = sent.elapsed().as_micros() as u64,
                    "forward answered"
                );
                record_call(&tracing::Span::current(), &result);
                result
            }
            .instrument(span);
            // the spawned task runs outside the loop's logical-service context
            let call = kvlease_telemetry::in_service(crate::traces::SERVICE, call);
            tasks.push((g, seqs, tokio::spawn(call)));
        }
        self.steps_run += 1;
        self.in_flight.push_back(InFlight {
            step,
            launched: Instant::now(),
            tasks,
        });
        true
    }

    /// Waits for a forward pass and applies its results (the caller streams
    /// its tokens: `route_outputs`). A settle's `Step` call sent meanwhile is
    /// applied once the first answer is in, before any result, so the core
    /// sees the settle, then the pass, as if it had waited. Returns when
    /// the last answer and that call's were both in.
    pub(super) async fn collect_forward(&mut self, f: InFlight) -> Instant {
        let launched = f.launched;
        let mut arrived = Instant::now();
        let mut ready = arrived;
        for (g, seqs, task) in f.tasks {
            let result = task.await;
            arrived = Instant::now();
            self.traces.forwarded(&seqs, arrived - launched);
            self.settled().await;
            ready = Instant::now();
            match result {
                Ok(Ok(answer)) => self.core.apply_forward(g, answer),
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
        ready
    }
}

/// When the scheduler's work between two forward passes happened (overlap:
/// a pass collected, settled, the next launched); the worker logs each
/// pass's compute.
#[derive(Debug, Default)]
pub(super) struct BetweenPasses {
    pub(super) arrived: Option<Instant>,
    pub(super) applied: Option<Instant>,
    pub(super) settled: Option<Instant>,
    /// The step's pass went out (`None`: it launched none, or not yet).
    pub(super) launched: Option<Instant>,
}

impl BetweenPasses {
    /// Logs the gap after a launch that followed a collected pass: the
    /// settle's share is 0 when the order settles after the launch (the
    /// overlap order planning ahead).
    pub(super) fn log(&self, step: Step, launched: bool) {
        let (Some(arrived), Some(applied)) = (self.arrived, self.applied) else {
            return;
        };
        let ready = self.settled.unwrap_or(applied);
        tracing::debug!(
            step = step.get(),
            apply_us = (applied - arrived).as_micros() as u64,
            settle_us = (ready - applied).as_micros() as u64,
            launch_us = ready.elapsed().as_micros() as u64,
            launched,
            "between forward passes"
        );
    }
}

/// `kvlease.link` on the link from a step's `Forward` call to a request in it.
const LINK_BATCHED: &str = "batched";
