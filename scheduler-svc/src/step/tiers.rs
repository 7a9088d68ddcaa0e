//! Host-tier copies: the demotions and onboardings the cache names in
//! grants, carried to each group's worker in the forward pass of the step
//! whose Lease or Extend named them.
//!
//! The founding rule, as for fences: the cache publishes a demotion's host
//! block at `CompleteStep` of its step, so the copy must have run by then.
//! So:
//! - every grant's copies go to the group's forward of that step, whatever
//!   becomes of the sequence (cancelled, refused later, not planned this
//!   step); a group with copies and no sequence gets a forward of copies
//!   alone;
//! - if a forward that carried copies failed, or a Lease or Extend call
//!   failed as a whole (the cache may have named copies no worker will
//!   run), the next release goes out with `discard_unwritten` (even with no
//!   sequence in it): the cache then drops every pending demotion of the
//!   session, and [`Core::complete_through`] names no step before it is
//!   sent.

use std::collections::BTreeMap;

use super::Core;
use crate::domain::{Outcome, Step, TierCopy};

/// The tier copies of the step being planned, per group index.
#[derive(Debug, Default)]
pub(super) struct TierCopies {
    /// Named by this step's grants, not yet handed to a forward.
    pending: BTreeMap<usize, Vec<TierCopy>>,
    /// The forwards in flight that carry copies: (step, group index).
    carried: Vec<(Step, usize)>,
    /// The cache may hold demotions no worker ran: release with
    /// `discard_unwritten` before completing any step.
    pub(super) discard: bool,
}

impl Core {
    /// Whether any group registered a host tier (a disk tier needs one).
    fn has_host_tier(&self) -> bool {
        self.groups
            .iter()
            .any(|g| g.pools.iter().any(|p| p.host_blocks > 0))
    }

    /// Collects the tier copies of the grants among `outcomes`.
    pub(super) fn collect_tier_copies(&mut self, outcomes: &[Outcome]) {
        for outcome in outcomes {
            let Outcome::Grant(g) = outcome else { continue };
            for c in &g.tier_copies {
                let group = self
                    .groups
                    .iter()
                    .position(|grp| grp.pools.iter().any(|p| p.pool_id == c.pool_id));
                match group {
                    Some(group) => self.tiers.pending.entry(group).or_default().push(*c),
                    // A pool we do not know: nobody will run the copy.
                    None => self.tiers.discard = true,
                }
            }
        }
    }

    /// A Lease or Extend call failed as a whole: with a host tier, the
    /// cache may have named demotions that no worker will run.
    pub(super) fn tier_call_failed(&mut self) {
        if self.has_host_tier() {
            self.tiers.discard = true;
        }
    }

    /// Groups with copies but no sequence planned, to get a forward anyway.
    pub(super) fn groups_with_tier_copies(&self) -> Vec<usize> {
        self.tiers.pending.keys().copied().collect()
    }

    /// The tier copies group `g`'s forward of this step must carry; marks
    /// that forward as carrying them.
    pub fn take_tier_copies(&mut self, group: usize) -> Vec<TierCopy> {
        let copies = self.tiers.pending.remove(&group).unwrap_or_default();
        let pass = (self.step(), group);
        if !copies.is_empty() && !self.tiers.carried.contains(&pass) {
            self.tiers.carried.push(pass);
        }
        copies
    }

    /// A settle's answer was applied after the next step began (the step
    /// loop applies a `Step` call it sent after a launch once it collects
    /// the next pass): the copies its extends named were for the pass
    /// launched before it, so none can run before that step completes, as
    /// when [`Core::begin_step`] finds them. The loop applies such an
    /// answer before any other call of the step that may name copies.
    pub fn settle_answered_late(&mut self) {
        self.drop_stale_tier_copies();
    }

    /// A new step begins: copies of the last one that no forward took can
    /// no longer run before their step completes, so they must not publish.
    pub(super) fn drop_stale_tier_copies(&mut self) {
        if !self.tiers.pending.is_empty() {
            self.tiers.pending.clear();
            self.tiers.discard = true;
        }
    }

    /// Group `g`'s forward of `step` returned: `failed` when it did not
    /// run. (With passes in flight, another of the group's may carry
    /// copies while this one carries none.)
    pub(super) fn tier_forward_returned(&mut self, group: usize, step: Step, failed: bool) {
        if let Some(i) = self.tiers.carried.iter().position(|&p| p == (step, group)) {
            self.tiers.carried.swap_remove(i);
            self.tiers.discard |= failed;
        }
    }
}
