//! Steps and fences: the founding rule of the protocol, kept where unit
//! tests reach it.
//!
//! A forward pass of step N reads the blocks of every sequence in its batch,
//! and those blocks must not reach another sequence before that pass
//! returned. So:
//! - a release is fenced at the step of the last forward pass that was
//!   launched and not yet handed to [`Core::complete_through`] (the cache
//!   parks the blocks until `CompleteStep` of that step); with no such pass,
//!   nothing can read the blocks and the release is not fenced;
//! - [`Core::complete_through`] names a step only once its forward pass,
//!   and every earlier one (the pipelined order has up to its depth in
//!   flight),
//!   returned from every group, never a step whose forward is in flight;
//! - a `CompleteStep` the cache did not acknowledge stays pending and is
//!   folded into the next one (completing N completes every step <= N);
//! - the sequences of a failed forward pass are released on their own, with
//!   `discard_unwritten` (the cache would otherwise publish, at
//!   `CompleteStep`, hashes of blocks the pass may never have written), and
//!   [`Core::complete_through`] names no step while such a release waits;
//! - a sequence that ends (stops, is cancelled, preempted) while passes of
//!   it are in flight is released only once they returned, and with
//!   `discard_unwritten` if one failed: its extends may already have
//!   reported what those passes write (`Core::release_ended`).
//!
//! And a release is never lost: the core forgets a sequence's release only
//! once the cache answered it, or once the session is gone (the cache
//! reclaimed everything the session held). A call that failed in any other
//! way (unreachable, timed out, refused with an error status) leaves its
//! sequences waiting for the next batch, fenced as that later moment says;
//! sending them again is safe because the cache's Release is idempotent. No
//! batch holds more than the cache's batch limit, so a backlog (releases
//! kept while the cache was unreachable, several groups' ends at once) is
//! never refused for its size.

use std::collections::{HashSet, VecDeque};

use super::Core;
use crate::domain::{SeqId, Step};

/// Sequences to release in one `Release` call, and the step the cache must
/// fence their blocks at (`None`: free them at once).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ReleaseBatch {
    pub seq_ids: Vec<SeqId>,
    pub fence_step: Option<Step>,
    /// The sequences' forward pass failed: the cache must never publish
    /// what their incomplete steps were to write.
    pub discard_unwritten: bool,
}

impl ReleaseBatch {
    /// Whether there is nothing to release.
    pub fn is_empty(&self) -> bool {
        // A discard with no sequence still drops the session's pending
        // host-tier demotions (see `tiers`).
        self.seq_ids.is_empty() && !self.discard_unwritten
    }
}

/// How a cache call failed, as far as the core's decisions go (the loop
/// classifies its errors).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CallFailure {
    /// No answer came back: the cache was unreachable or the call timed out
    /// (the cache may or may not have applied it).
    Unanswered,
    /// The cache answered with an error status (over a limit, malformed,
    /// not allowed), or with an answer the protocol does not allow; the same
    /// call is likely to fail again.
    Refused,
    /// The cache no longer knows the session (restart, expiry, stale
    /// epoch): it reclaimed everything the session held.
    SessionLost,
}

/// One forward pass launched by the core.
#[derive(Debug)]
struct Forward {
    step: Step,
    /// Groups whose results have not come back yet.
    out: Vec<usize>,
}

/// The step numbering and what the forward passes still hold.
#[derive(Debug, Default)]
pub(super) struct Steps {
    /// The step being planned (the last one begun).
    current: Step,
    /// The forward passes launched and not yet handed to
    /// `complete_through`, oldest first (those in flight, at most the
    /// pipelined order's depth, and returned ones a tier copy not run yet
    /// holds back).
    forwards: VecDeque<Forward>,
    /// The step of the last forward pass launched (since the session
    /// opened).
    last_launched: Option<Step>,
    /// A step handed to `complete_through` whose `CompleteStep` the cache
    /// has not acknowledged yet.
    pending_complete: Option<Step>,
}

impl Steps {
    fn fold_pending(&mut self, step: Step) {
        self.pending_complete = Some(self.pending_complete.map_or(step, |p| p.max(step)));
    }

    /// Hands the passes at the front that returned from every group to
    /// completion: each completes once every earlier one did, and none
    /// from `held` on (a tier copy named then has not run yet).
    fn fold_returned(&mut self, held: Option<Step>) {
        while self
            .forwards
            .front()
            .is_some_and(|f| f.out.is_empty() && held.is_none_or(|h| f.step < h))
        {
            if let Some(f) = self.forwards.pop_front() {
                self.fold_pending(f.step);
            }
        }
    }

    /// The oldest pass whose results `group` still owes: the one its next
    /// answer belongs to.
    pub(super) fn owed_by(&self, group: usize) -> Option<Step> {
        self.forwards
            .iter()
            .find(|f| f.out.contains(&group))
            .map(|f| f.step)
    }
}

impl Core {
    /// Continues the step numbering after `last` (the steps warm-up used).
    pub fn continue_after(&mut self, last: Step) {
        self.steps.current = self.steps.current.max(last);
    }

    /// The step being planned (the last one begun).
    pub fn step(&self) -> Step {
        self.steps.current
    }

    /// Starts planning the next step and returns its number; resets the
    /// token budgets.
    pub fn begin_step(&mut self) -> Step {
        self.steps.current = self.steps.current.next();
        self.batch_open = self.running.is_empty() && self.leasing.is_empty();
        self.exhausted_this_step = false;
        for (budget, group) in self.budget.iter_mut().zip(&self.groups) {
            *budget = self
                .config
                .max_tokens_per_step
                .min(group.max_batch_tokens)
                .max(1);
        }
        for seq in self.running.values_mut() {
            seq.planned = None;
        }
        self.steps.current
    }

    /// The current step's forward pass was launched on `groups` (from
    /// `plan_forward`).
    pub(super) fn forward_launched(&mut self, groups: Vec<usize>) {
        if groups.is_empty() {
            return;
        }
        // those that returned before this launch (the overlap orders launch
        // before they settle the previous pass) are complete
        self.steps.fold_returned(self.tiers.first_named());
        self.steps.last_launched = Some(self.steps.current);
        self.steps.forwards.push_back(Forward {
            step: self.steps.current,
            out: groups,
        });
    }

    /// One group's forward results came back (applied, or failed): those of
    /// the oldest pass it still owes (a worker runs its passes in order).
    pub(super) fn forward_returned(&mut self, group: usize) {
        if let Some(f) = self
            .steps
            .forwards
            .iter_mut()
            .find(|f| f.out.contains(&group))
            && let Some(i) = f.out.iter().position(|&g| g == group)
        {
            f.out.swap_remove(i);
        }
    }

    /// The step of the newest forward pass in flight (launched, not
    /// returned from every group), if any.
    pub fn forward_in_flight(&self) -> Option<Step> {
        self.steps
            .forwards
            .iter()
            .rev()
            .find(|f| !f.out.is_empty())
            .map(|f| f.step)
    }

    /// The step a settle's extends go at (`current`: the step being run):
    /// the last pass launched, whose completion covers every write their
    /// reports name (and after which no pass reads a block they slide out
    /// of a window), though a pipelined step that settles may launch
    /// nothing itself; `current` before any pass.
    pub fn settle_step(&self, current: Step) -> Step {
        self.steps.last_launched.unwrap_or(current)
    }

    /// The step of the pass `group`'s worker must finish before it runs the
    /// pass just launched (from `plan_forward`): the group's pass of an
    /// earlier step still in flight, whose samples the new pass's fed
    /// decodes take. `None`: nothing of the group is in flight before it.
    pub fn follows(&self, group: usize) -> Option<Step> {
        self.steps
            .forwards
            .iter()
            .rev()
            .filter(|f| f.step < self.steps.current)
            .find(|f| f.out.contains(&group))
            .map(|f| f.step)
    }

    /// Sequences to release now, fenced at the last step whose forward pass
    /// could read their blocks and is not complete yet (see the module
    /// documentation). Those of a failed forward pass come first, in a batch
    /// of their own with `discard_unwritten`; the others wait for the next
    /// call. At most [`Core::batch_limit`] sequences, the oldest first; the
    /// rest wait for the next call too ([`Core::has_releases`] says whether
    /// any is left). Send them, then call [`Core::releases_sent`] once the
    /// cache answered, or [`Core::release_failed`].
    pub fn take_releases(&mut self) -> ReleaseBatch {
        let parents = self.fork_parents();
        let discard_unwritten =
            self.failed_releases.iter().any(|s| !parents.contains(s)) || self.tiers.discard;
        let waiting = if discard_unwritten {
            // any discard drops every pending demotion of the session
            self.tiers.discard = false;
            &mut self.failed_releases
        } else {
            &mut self.releases
        };
        let (held, free): (Vec<SeqId>, Vec<SeqId>) =
            waiting.drain(..).partition(|s| parents.contains(s));
        *waiting = free;
        let n = waiting.len().min(self.batch_limit);
        let seq_ids = waiting.drain(..n).collect();
        waiting.extend(held);
        ReleaseBatch {
            seq_ids,
            fence_step: self.steps.forwards.back().map(|f| f.step),
            discard_unwritten,
        }
    }

    /// The cache answered a release: its sequences hold nothing there any
    /// more (whatever each one's status: released, already released or
    /// unknown).
    pub fn releases_sent(&mut self, batch: ReleaseBatch) {
        self.released.extend(batch.seq_ids);
    }

    /// A release call failed. Its sequences still hold their blocks at the
    /// cache, so they wait for the next batch (with the fence of that later
    /// moment; the cache's Release is idempotent, so what it may have taken
    /// already is not freed twice), however it failed: a refusal is logged
    /// by the loop at every try rather than dropped, since a dropped
    /// release leaks its blocks for the whole life of the session. Only
    /// when the session is gone are they forgotten: the cache reclaimed its
    /// blocks with it, and [`Core::leases_lost`] deals with the rest when
    /// the loop re-opens it.
    pub fn release_failed(&mut self, batch: ReleaseBatch, failure: CallFailure) {
        match failure {
            CallFailure::SessionLost => self.released.extend(batch.seq_ids),
            CallFailure::Unanswered | CallFailure::Refused => self.restore_releases(batch),
        }
    }

    /// Puts back releases whose call the cache did not answer, to try again
    /// (with the fence of that later moment).
    pub(super) fn restore_releases(&mut self, batch: ReleaseBatch) {
        if batch.discard_unwritten {
            self.tiers.discard = true;
            self.failed_releases.extend(batch.seq_ids);
        } else {
            self.releases.extend(batch.seq_ids);
        }
    }

    /// Whether any release is waiting to be sent (a parent whose branches
    /// wait for their fork is not, yet).
    pub fn has_releases(&self) -> bool {
        let parents = self.fork_parents();
        let sendable = |list: &[SeqId]| list.iter().any(|s| !parents.contains(s));
        sendable(&self.releases) || sendable(&self.failed_releases) || self.tiers.discard
    }

    /// Sequences whose branches wait for their fork (or its answer): each
    /// stays leased until then, so that the cache can share its blocks.
    fn fork_parents(&self) -> HashSet<SeqId> {
        self.forks
            .iter()
            .map(|f| f.parent)
            .chain(self.leasing.iter().filter_map(|l| l.fork_of))
            .collect()
    }

    /// The step to report complete now, if any: the last one whose forward
    /// pass returned from every group, or an earlier one whose
    /// `CompleteStep` was not acknowledged. Never a step whose forward pass
    /// is still in flight, nor any step while the release of a failed
    /// pass's sequences waits to be sent (the completion would publish what
    /// that pass was to write). Call [`Core::step_completed`] once the cache
    /// acknowledged it; until then it stays pending.
    pub fn complete_through(&mut self) -> Option<Step> {
        if !self.failed_releases.is_empty() || self.tiers.discard {
            return None;
        }
        let held = self.tiers.first_named();
        self.steps.fold_returned(held);
        // (one computed before a copy was named stays pending until it ran)
        self.steps
            .pending_complete
            .filter(|&p| held.is_none_or(|h| p < h))
    }

    /// [`Core::complete_through`] for a call whose extends, if any, name
    /// `extends_at` and follow the completion: with a host tier only a step
    /// before it, since the cache drops at once the demotions an extend
    /// names at a completed step (without one, completing first returns
    /// the fenced blocks the extends may need).
    pub fn complete_before(&mut self, extends_at: Option<Step>) -> Option<Step> {
        let held = extends_at.filter(|_| self.has_host_tier());
        self.complete_through()
            .filter(|&s| held.is_none_or(|named| s < named))
    }

    /// The cache acknowledged `CompleteStep(step)`.
    pub fn step_completed(&mut self, step: Step) {
        if self.steps.pending_complete.is_some_and(|p| p <= step) {
            self.steps.pending_complete = None;
        }
    }

    /// Whether nothing is left to do: no request, no forward pass, tier
    /// copy, release or `CompleteStep` outstanding.
    pub fn is_quiet(&self) -> bool {
        self.is_idle()
            && self.steps.forwards.is_empty()
            && self.tiers.first_named().is_none()
            && self.steps.pending_complete.is_none()
            && !self.has_releases()
    }

    /// Forgets the old session's steps (its leases are lost): nothing fenced
    /// there matters any more.
    pub(super) fn forget_fences(&mut self) {
        self.steps.forwards.clear();
        self.steps.last_launched = None;
        self.steps.pending_complete = None;
        self.tiers.forget();
    }
}
