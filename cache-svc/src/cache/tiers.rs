//! The host tier's step bookkeeping: which demotions and onboarding pins
//! wait on which step of which session, and what a step's completion, a
//! failed forward pass or a session's end does to them.
//!
//! The rules, each a test in `tests::tiers`:
//! - a demotion named at step N is *pending* (never matchable, so never
//!   read) until `CompleteStep(>= N)`; a `Release` with `discard_unwritten`
//!   (the holder's forward pass failed, so it cannot vouch that the copy
//!   ran) drops every demotion of the session whose step is not complete;
//! - a demotion named at a step already reported complete is dropped at
//!   once and not sent: no later pass of that step will run it;
//! - an onboarding source is pinned (not evictable, so no demotion can
//!   overwrite it) until `CompleteStep(>= N)` of the lease's step;
//! - a session's end drops its pending demotions and lifts its pins.

use super::Cache;
use crate::ids::{SessionId, Step};
use crate::lease::{TierCopy, TierDirection};
use crate::session::{HostRef, Session};

impl Cache {
    /// Takes the demotions the last allocations in `pools` decided, records
    /// them as pending on `step` of the session and returns the copies to
    /// name in the response (none when the step is already complete: they
    /// are dropped).
    pub(super) fn take_demotions(
        &mut self,
        session_id: SessionId,
        pools: &[usize],
        step: Step,
    ) -> Vec<TierCopy> {
        let completed = self
            .sessions
            .get(&session_id)
            .is_none_or(|s| s.step_completed(step));
        let mut copies = Vec::new();
        let mut refs = Vec::new();
        for &i in pools {
            let entry = &mut self.pools[i];
            for d in entry.pool.take_demotions() {
                if completed {
                    entry.pool.host_mut().discard(d.host, d.generation);
                    entry.pool.counters.demotions_dropped += 1;
                    continue;
                }
                copies.push(TierCopy {
                    pool_id: entry.id,
                    window: entry.window,
                    direction: TierDirection::Demote,
                    device_block: d.device,
                    host_block: d.host,
                });
                refs.push(HostRef {
                    pool: i,
                    block: d.host,
                    generation: d.generation,
                });
            }
        }
        if !refs.is_empty()
            && let Some(session) = self.sessions.get_mut(&session_id)
        {
            session.demotions.entry(step).or_default().extend(refs);
        }
        copies
    }

    /// Keeps onboarding sources (already pinned) pinned until `step`
    /// completes.
    pub(super) fn pin_host_until(&mut self, session_id: SessionId, step: Step, pins: Vec<HostRef>) {
        if pins.is_empty() {
            return;
        }
        match self.sessions.get_mut(&session_id) {
            Some(session) => session.host_pins.entry(step).or_default().extend(pins),
            None => {
                for r in pins {
                    self.pools[r.pool].pool.host_mut().unpin(r.block);
                }
            }
        }
    }

    /// Publishes the demotions and lifts the pins of `session`'s steps
    /// through `step` (all of them for `u64::MAX`).
    pub(super) fn complete_tier_steps(&mut self, session_id: SessionId, step: Step) {
        let Some(session) = self.sessions.get_mut(&session_id) else {
            return;
        };
        let (demotions, pins) = match step.next() {
            Some(after) => {
                let later_d = session.demotions.split_off(&after);
                let later_p = session.host_pins.split_off(&after);
                (
                    std::mem::replace(&mut session.demotions, later_d),
                    std::mem::replace(&mut session.host_pins, later_p),
                )
            }
            None => (
                std::mem::take(&mut session.demotions),
                std::mem::take(&mut session.host_pins),
            ),
        };
        for r in demotions.into_values().flatten() {
            self.pools[r.pool]
                .pool
                .host_mut()
                .publish(r.block, r.generation);
        }
        for r in pins.into_values().flatten() {
            self.pools[r.pool].pool.host_mut().unpin(r.block);
        }
    }

    /// Drops every pending demotion of `session` (its holder cannot vouch
    /// that the copies ran).
    pub(super) fn drop_demotions(pools: &mut [super::PoolEntry], session: &mut Session) {
        for r in std::mem::take(&mut session.demotions)
            .into_values()
            .flatten()
        {
            let pool = &mut pools[r.pool].pool;
            pool.host_mut().discard(r.block, r.generation);
            pool.counters.demotions_dropped += 1;
        }
    }

    /// Gives back a gone session's host-tier state: pending demotions are
    /// dropped, onboarding pins lifted.
    pub(super) fn reclaim_tiers(pools: &mut [super::PoolEntry], session: &mut Session) {
        Self::drop_demotions(pools, session);
        for r in std::mem::take(&mut session.host_pins)
            .into_values()
            .flatten()
        {
            pools[r.pool].pool.host_mut().unpin(r.block);
        }
    }
}
