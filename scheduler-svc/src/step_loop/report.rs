//! What the step loop reports: outputs to the request streams, the
//! preemptions and refusals of a step into its traces and metrics, each
//! call's outcome on its client span, and the status snapshot `GetStatus`
//! reads.

use super::{StatusSnapshot, StepLoop};
use crate::domain::{Outcome, Output};
use crate::error::{Error, Result};

impl StepLoop {
    pub(super) fn route_outputs(&mut self) {
        self.forget_released();
        // the status is current before a client sees its request end
        self.publish();
        for output in self.core.drain_outputs() {
            let id = output.request();
            let last = matches!(output, Output::Finished { last: true, .. });
            self.metrics.output(&output);
            if let Some(tx) = self.streams.get(&id) {
                self.delivery.push(tx, output);
            }
            if last {
                self.streams.remove(&id);
                self.branch_ends.remove(&id);
                self.traces.finish(id);
            }
        }
        self.delivery.flush();
    }

    /// The core's preemptions since the last call, as spans in their
    /// requests' traces.
    pub(super) fn trace_preemptions(&mut self) {
        for p in self.core.take_preemptions() {
            self.step_preemptions = true;
            self.traces.preempted(&p);
        }
    }

    /// Counts the refused sequences (the cache recorded each one in its
    /// request's trace; the request's `Generate` span records the reject it
    /// ends with) and marks the step's trace for export.
    pub(super) fn trace_rejects(&mut self, method: &'static str, outcomes: &[Outcome]) {
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

    pub(super) fn publish(&self) {
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

/// Records a call's outcome on its client span: the peer's status code when
/// it answered one, UNAVAILABLE when it could not be reached.
pub(super) fn record_call<T>(span: &tracing::Span, result: &Result<T>) {
    let status = match result {
        Ok(_) => Ok(()),
        Err(Error::Rpc { code, message, .. }) => Err(tonic::Status::new(*code, message.clone())),
        Err(e @ Error::CacheUnavailable(_)) => Err(tonic::Status::unavailable(e.to_string())),
        Err(e @ Error::SessionLost(_)) => Err(tonic::Status::failed_precondition(e.to_string())),
        Err(e) => Err(tonic::Status::unknown(e.to_string())),
    };
    kvlease_telemetry::record_client_result(span, &status);
}
