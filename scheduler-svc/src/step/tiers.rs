//! Host-tier copies: the demotions and onboardings the cache names in
//! grants, carried to each group's worker in its next forward pass.
//!
//! The founding rule, as for fences: the cache publishes a demotion's host
//! block (and lifts an onboarding's pin) at `CompleteStep` of the step the
//! Lease or Extend call named, so the copy must have run by then. So:
//! - a grant's copies ride the group's next forward pass, whatever becomes
//!   of the sequence (cancelled, refused later, not planned this step); a
//!   group with copies and no sequence planned gets a forward of copies
//!   alone. That pass is the first planned after the grant, so it runs
//!   before any pass that writes a block the grant handed out (a worker
//!   runs a pass's copies first, and its passes in order);
//! - no step at or after the one a copy was named at is reported complete
//!   before the pass that carries it returned. In the plain order that is
//!   the step's own pass. In the overlap orders a step's extends follow its
//!   launch (and their answer may come once the next step began): their
//!   copies ride the next step's pass, and the step they were named at
//!   completes with that one;
//! - if a forward that carried copies failed, or a Lease or Extend call
//!   failed as a whole (the cache may have named copies no worker will
//!   run), the next release goes out with `discard_unwritten` (even with no
//!   sequence in it): the cache then drops every pending demotion of the
//!   session, and [`Core::complete_through`] names no step before it is
//!   sent.

use std::collections::BTreeMap;

use super::Core;
use crate::domain::{Outcome, Step, TierCopy};

/// Copies named by grants, per group index, not yet in a forward pass.
#[derive(Debug, Default)]
pub(super) struct TierCopies {
    /// Per group: the earliest step whose calls named its copies, and the
    /// copies in the order the cache named them.
    pending: BTreeMap<usize, (Step, Vec<TierCopy>)>,
    /// The forwards in flight that carry copies.
    carried: Vec<Carried>,
    /// The cache may hold demotions no worker ran: release with
    /// `discard_unwritten` before completing any step.
    pub(super) discard: bool,
}

/// A forward pass in flight with copies in it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Carried {
    /// The pass: its step and group.
    step: Step,
    group: usize,
    /// The earliest step whose calls named one of its copies.
    named: Step,
}

impl TierCopies {
    /// The earliest step a copy not run yet was named at: no step from it
    /// on may be reported complete.
    pub(super) fn first_named(&self) -> Option<Step> {
        let pending = self.pending.values().map(|(named, _)| *named);
        pending.chain(self.carried.iter().map(|c| c.named)).min()
    }

    /// The session is gone, and its copies with it.
    pub(super) fn forget(&mut self) {
        self.pending.clear();
        self.carried.clear();
    }
}

impl Core {
    /// Whether any group registered a host tier (a disk tier needs one).
    pub(super) fn has_host_tier(&self) -> bool {
        self.groups
            .iter()
            .any(|g| g.pools.iter().any(|p| p.host_blocks > 0))
    }

    /// Collects the tier copies of the grants among `outcomes`, which
    /// answered a Lease or Extend call that named `step`.
    pub(super) fn collect_tier_copies(&mut self, step: Step, outcomes: &[Outcome]) {
        for outcome in outcomes {
            let Outcome::Grant(g) = outcome else { continue };
            for c in &g.tier_copies {
                let group = self
                    .groups
                    .iter()
                    .position(|grp| grp.pools.iter().any(|p| p.pool_id == c.pool_id));
                match group {
                    Some(group) => {
                        let (named, copies) = self
                            .tiers
                            .pending
                            .entry(group)
                            .or_insert((step, Vec::new()));
                        *named = (*named).min(step);
                        copies.push(*c);
                    }
                    // A pool we do not know: nobody will run the copy.
                    None => self.tiers.discard = true,
                }
            }
        }
    }

    /// No pass will carry the copies not handed to one yet (the loop stops,
    /// or the session is lost): they are dropped, and the cache must drop
    /// their demotions before any step completes. Call it with no pass in
    /// flight.
    pub fn abandon_tier_copies(&mut self) {
        if !self.tiers.pending.is_empty() {
            self.tiers.pending.clear();
            self.tiers.discard = true;
        }
    }

    /// A Lease or Extend call failed as a whole: with a host tier, the
    /// cache may have named demotions that no worker will run.
    pub(super) fn tier_call_failed(&mut self) {
        if self.has_host_tier() {
            self.tiers.discard = true;
        }
    }

    /// Groups with copies to run, which get a forward even with no
    /// sequence planned.
    pub(super) fn groups_with_tier_copies(&self) -> Vec<usize> {
        self.tiers.pending.keys().copied().collect()
    }

    /// The tier copies group `g`'s forward of this step must carry; marks
    /// that forward as carrying them.
    pub fn take_tier_copies(&mut self, group: usize) -> Vec<TierCopy> {
        let Some((named, copies)) = self.tiers.pending.remove(&group) else {
            return Vec::new();
        };
        let step = self.step();
        match self
            .tiers
            .carried
            .iter_mut()
            .find(|c| (c.step, c.group) == (step, group))
        {
            Some(c) => c.named = c.named.min(named),
            None => self.tiers.carried.push(Carried { step, group, named }),
        }
        copies
    }

    /// Group `g`'s forward of `step` returned: `failed` when it did not
    /// run. (With passes in flight, another of the group's may carry
    /// copies while this one carries none.)
    pub(super) fn tier_forward_returned(&mut self, group: usize, step: Step, failed: bool) {
        if let Some(i) = self
            .tiers
            .carried
            .iter()
            .position(|c| (c.step, c.group) == (step, group))
        {
            self.tiers.carried.swap_remove(i);
            self.tiers.discard |= failed;
        }
    }
}
