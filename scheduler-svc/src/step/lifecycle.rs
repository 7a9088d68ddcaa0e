//! Lifecycle: how requests and sequences end (finished, cancelled,
//! preempted and requeued, lost with the cache), and the outputs that say so.

use std::collections::HashSet;

use super::{Core, PreemptCause, Preemption, Sequence};
use crate::domain::{Finish, GroupGeometry, Output, Reject, RejectReason, RequestId, SeqId, Step};
use crate::queue::Request;

/// An ended sequence whose passes are still in flight: its extends may
/// have reported what those passes write (a prompt chunk's progress, the
/// token a decode is fed), which the cache publishes when their step
/// completes. Released once they returned, with `discard_unwritten` if one
/// of them failed or did not run it, so the cache never publishes KV a
/// pass did not write.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Draining {
    seq_id: SeqId,
    group: usize,
    /// The steps of its passes in flight, oldest first.
    steps: Vec<Step>,
}

impl Core {
    /// Queues the release of `seq`, just taken out of `running`: now, or,
    /// with passes of it in flight, once they returned ([`Draining`]).
    /// A decoding sequence at rest whose extends reported a token past its
    /// KV (a decode with no room sits its step out, and its extend reports
    /// the token that step would have fed) is released discarding: the
    /// cache would otherwise publish a block whose last slots no pass wrote.
    pub(super) fn release_ended(&mut self, seq: &Sequence) {
        if seq.in_flight.is_empty() {
            if seq.decoding() && seq.cache_len > seq.kv_len {
                self.failed_releases.push(seq.seq_id);
            } else {
                self.releases.push(seq.seq_id);
            }
        } else {
            self.draining.push(Draining {
                seq_id: seq.seq_id,
                group: seq.group,
                steps: seq.in_flight.iter().map(|(s, _)| *s).collect(),
            });
        }
    }

    /// Whether an ended sequence of `group` waits for its passes.
    pub(super) fn draining_in(&self, group: usize) -> bool {
        self.draining.iter().any(|d| d.group == group)
    }

    /// Group `group`'s pass of `step` came back having run the sequences
    /// `ran` (without an error): an ended sequence it was to run and did
    /// not is released with `discard_unwritten`; one whose last pass it was
    /// is released.
    pub(super) fn drain_answered(&mut self, group: usize, step: Step, ran: &HashSet<SeqId>) {
        self.drain(group, step, |d| ran.contains(&d.seq_id));
    }

    /// Group `group`'s pass of `step` failed: every ended sequence of the
    /// group with a pass at or after it is released with
    /// `discard_unwritten` (a later pass fed from it fails too).
    pub(super) fn drain_failed(&mut self, group: usize, step: Step) {
        self.drain(group, step, |_| false);
    }

    /// Moves the entries of `group` with a pass at or after `step` out:
    /// those whose pass of `step` went well (`ok`) once it was their last,
    /// the rest (a failed pass, or one that did not run them) at once, to
    /// be released discarding what they did not write.
    fn drain(&mut self, group: usize, step: Step, ok: impl Fn(&Draining) -> bool) {
        let mut still = Vec::with_capacity(self.draining.len());
        for mut d in std::mem::take(&mut self.draining) {
            let last = d.steps.last().copied();
            if d.group != group || last.is_none_or(|last| last < step) {
                still.push(d);
                continue;
            }
            let ran = !d.steps.contains(&step) || ok(&d);
            if !ran {
                self.failed_releases.push(d.seq_id);
                continue;
            }
            d.steps.retain(|&s| s > step);
            if d.steps.is_empty() {
                self.releases.push(d.seq_id);
            } else {
                still.push(d);
            }
        }
        self.draining = still;
    }

    /// Releases `seq_ids`, just ended by a pass that may not have written
    /// what their extends reported, with `discard_unwritten`, instead of
    /// as their end queued them (now, or after their passes).
    pub(super) fn release_discarding(&mut self, seq_ids: Vec<SeqId>) {
        self.releases.retain(|s| !seq_ids.contains(s));
        self.draining.retain(|d| !seq_ids.contains(&d.seq_id));
        self.failed_releases.extend(seq_ids);
    }

    /// Cancels a request wherever it is; a running one is released with the
    /// next release batch.
    /// Every branch of a request of several samples is cancelled, wherever
    /// each one is.
    pub fn cancel(&mut self, id: RequestId, why: &str) {
        while let Some(request) = self.queue.remove(id) {
            self.finish_request(&request, Finish::Cancelled(why.to_string()));
        }
        let (forks, kept) = std::mem::take(&mut self.forks)
            .into_iter()
            .partition(|f| f.request.id == id);
        self.forks = kept;
        for f in forks {
            self.finish_request(&f.request, Finish::Cancelled(why.to_string()));
        }
        if self.leasing.iter().any(|l| l.request.id == id) {
            self.cancelled_leasing.insert(id);
        }
        let seq_ids: Vec<SeqId> = self
            .running
            .values()
            .filter(|s| s.request.id == id)
            .map(|s| s.seq_id)
            .collect();
        for seq_id in seq_ids {
            self.end_sequence(seq_id, Finish::Cancelled(why.to_string()));
        }
    }

    /// Ends branch `index` of a request of several samples whose output the
    /// client no longer reads (its text ended at a stop string): finished
    /// `STOP` wherever it is, a running one released with the next release
    /// batch; the other samples go on. A branch 0 whose samples are not
    /// forked yet, a branch leasing now, a beam, or a branch that already
    /// ended, is left as it is (it ends on its own).
    pub fn end_branch(&mut self, id: RequestId, index: u32) {
        let is = |r: &Request| r.id == id && r.index == index && r.n == 1 && r.beam_width <= 1;
        let running = self
            .running
            .values()
            .find(|s| is(&s.request))
            .map(|s| s.seq_id);
        if let Some(seq_id) = running {
            self.end_sequence(seq_id, Finish::Stop);
        } else if let Some(at) = self.forks.iter().position(|f| is(&f.request)) {
            let f = self.forks.remove(at);
            self.finish_request(&f.request, Finish::Stop);
        } else if let Some(r) = self.queue.remove_branch(id, index) {
            if is(&r) {
                self.finish_request(&r, Finish::Stop);
            } else {
                self.queue.requeue(r);
            }
        }
    }

    /// Whether a transient refusal (`POOL_EXHAUSTED`) of `seq_id`'s extend,
    /// at rest, would preempt it (requeue its request for recompute) rather
    /// than end its request: the rule of `extend_refused` and `preempt`,
    /// asked before the call so the request's trace does not hold a refusal
    /// its request survives as an error.
    pub fn refusal_preempts(&self, seq_id: SeqId) -> bool {
        self.config.policy == crate::policy::Policy::MaxUtilization
            && self.config.on_exhausted == crate::policy::OnExhausted::Preempt
            && self
                .running
                .get(&seq_id)
                .is_some_and(|s| s.request.preemptions < self.config.max_preemptions)
    }

    /// Releases a running sequence and requeues its request for recompute
    /// (its tokens so far kept, a new lease taken when it is admitted
    /// again), counted as a preemption; a request already requeued
    /// `max_preemptions` times ends with `otherwise` instead.
    pub(super) fn preempt(&mut self, seq_id: SeqId, cause: PreemptCause, otherwise: Finish) {
        if self
            .running
            .get(&seq_id)
            .is_some_and(|s| s.request.is_started_beam())
        {
            // a beam is dropped, the search goes on (see `beams`)
            self.drop_beam(seq_id, otherwise);
            return;
        }
        let Some(seq) = self.running.remove(&seq_id) else {
            return;
        };
        self.release_ended(&seq);
        if seq.request.preemptions < self.config.max_preemptions {
            tracing::debug!(
                seq_id = seq_id.get(),
                request = seq.request.id.get(),
                cause = cause.as_str(),
                "requeued for recompute"
            );
            let mut request = seq.request;
            let tokens = request.prompt.len() + request.generated.len();
            self.preemptions.push(Preemption {
                request: request.id,
                seq_id,
                cause: cause.as_str(),
                tokens_to_recompute: u32::try_from(tokens).unwrap_or(u32::MAX),
            });
            request.preemptions += 1;
            // it ran: its wait in the queue starts again
            request.queued_at = None;
            self.counters.preemptions += 1;
            self.counters.preemptions_by[cause.index()] += 1;
            self.queue.requeue(request);
        } else {
            self.finish_request(&seq.request, otherwise);
        }
    }

    pub(super) fn end_sequence(&mut self, seq_id: SeqId, finish: Finish) {
        if let Some(seq) = self.running.remove(&seq_id) {
            self.release_ended(&seq);
            self.finish_request(&seq.request, finish);
        }
    }

    /// Finishes one branch of a request (the only one of a request of one
    /// sample), and with a branch 0 not forked yet the branches still to
    /// fork from it: the request's last output says so once none is left.
    /// A beam request ends whole (every rank with `finish`), once.
    pub(super) fn finish_request(&mut self, request: &Request, finish: Finish) {
        if request.beam_width > 1 {
            self.end_beams(request.id, Some(finish));
            return;
        }
        let unforked = (request.n > 1)
            .then_some(1..request.n)
            .into_iter()
            .flatten();
        for index in std::iter::once(request.index).chain(unforked) {
            self.count_finish(&finish);
            let last = match self.branches_left.get_mut(&request.id) {
                Some(left) if *left > 1 => {
                    *left -= 1;
                    false
                }
                _ => {
                    self.branches_left.remove(&request.id);
                    true
                }
            };
            self.outputs.push(Output::Finished {
                request: request.id,
                index,
                finish: finish.clone(),
                preemptions: request.preemptions,
                last,
                cumulative_logprob: None,
            });
        }
    }

    pub(super) fn count_finish(&mut self, finish: &Finish) {
        match finish {
            Finish::Length => self.counters.finished_length += 1,
            Finish::Stop => self.counters.finished_stop += 1,
            Finish::Cancelled(_) => self.counters.cancelled += 1,
            Finish::Rejected(_) => self.counters.rejected += 1,
            Finish::Error(_) => self.counters.errors += 1,
        }
    }

    /// Sequences preempted (released and requeued) since the last call.
    pub fn take_preemptions(&mut self) -> Vec<Preemption> {
        std::mem::take(&mut self.preemptions)
    }

    /// Outputs for the request streams since the last call.
    pub fn drain_outputs(&mut self) -> Vec<Output> {
        std::mem::take(&mut self.outputs)
    }

    /// Sequences that hold nothing at the cache any more, since the last
    /// call: refused or failed leases, releases the cache answered, leases
    /// the cache lost. The core never names them again, so the loop can
    /// forget what it kept for them (their trace contexts).
    pub fn take_released(&mut self) -> Vec<SeqId> {
        std::mem::take(&mut self.released)
    }

    /// The cache lost every lease (restart, expired session; `why`, as the
    /// cache said it): running requests are requeued for recompute (their
    /// tokens so far are kept), or finished `REJECTED` when `recompute` is
    /// false, with `CACHE_RESTARTED` and `why` in the message (an expired
    /// session is no restart). Pending releases are dropped and fences
    /// forgotten: the old session's blocks went with it.
    pub fn leases_lost(&mut self, recompute: bool, why: &str) {
        self.released.append(&mut self.releases);
        self.released.append(&mut self.failed_releases);
        let draining = std::mem::take(&mut self.draining);
        self.released.extend(draining.iter().map(|d| d.seq_id));
        self.forget_fences();
        self.leases_failed();
        let lost = cache_lost(
            SeqId(0),
            format!("the scheduler's cache session was lost ({why}), and the beams with it"),
        );
        self.beams_lost(recompute, &Finish::Rejected(lost));
        // branches waiting for a fork: their parent's lease is gone too
        for f in std::mem::take(&mut self.forks) {
            if recompute {
                self.queue.requeue(f.request);
            } else {
                let reject = cache_lost(
                    f.parent,
                    format!(
                        "the scheduler's cache session was lost ({why}) before the branch was forked"
                    ),
                );
                self.finish_request(&f.request, Finish::Rejected(reject));
            }
        }
        for (_, seq) in std::mem::take(&mut self.running) {
            self.released.push(seq.seq_id);
            if recompute {
                let mut request = seq.request;
                request.queued_at = None;
                self.queue.requeue(request);
            } else {
                let reject = cache_lost(
                    seq.seq_id,
                    format!(
                        "the scheduler's cache session was lost ({why}), and the lease with it"
                    ),
                );
                self.finish_request(&seq.request, Finish::Rejected(reject));
            }
        }
    }

    /// Finishes every request (shutdown); running ones are released.
    pub fn cancel_all(&mut self, why: &str) {
        self.leases_failed();
        for f in std::mem::take(&mut self.forks) {
            self.finish_request(&f.request, Finish::Cancelled(why.to_string()));
        }
        let queued: Vec<Request> = self.queue.drain().collect();
        for r in queued {
            self.finish_request(&r, Finish::Cancelled(why.to_string()));
        }
        let ids: Vec<SeqId> = self.running.keys().copied().collect();
        for seq_id in ids {
            self.end_sequence(seq_id, Finish::Cancelled(why.to_string()));
        }
    }

    /// Replaces a group's geometry (pools re-registered after a restart).
    pub fn set_groups(&mut self, groups: Vec<GroupGeometry>) {
        self.budget = vec![0; groups.len()];
        self.down_until = vec![None; groups.len()];
        self.groups = groups;
    }
}

/// A `CACHE_RESTARTED` refusal of `seq_id`: the session and its leases are
/// gone.
fn cache_lost(seq_id: SeqId, message: String) -> Reject {
    Reject {
        seq_id,
        reason: RejectReason::CacheRestarted,
        pool_id: 0,
        window: 0,
        blocks_needed: 0,
        blocks_free: 0,
        blocks_pending_free: 0,
        message,
    }
}
