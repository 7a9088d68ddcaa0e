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
//!
//! The disk tier follows the same rules: a spill (host block -> disk block)
//! is a demotion of the disk tier, named in the same response just before
//! the host demotion that overwrites its source; a load (disk block ->
//! device block) is an onboarding that pins its disk block. One rule of its
//! own: a `discard_unwritten` release also drops from the disk index every
//! disk block the session's incomplete steps load (the worker fails a pass
//! whose block file is bad, and a file once doubted is never trusted
//! again), so the recompute that follows never meets it.

use super::Cache;
use crate::events::Tier;
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
                    if let Some(s) = d.spill {
                        entry
                            .pool
                            .tier_mut(Tier::Disk)
                            .discard(s.disk, s.generation);
                    }
                    entry.pool.host_mut().discard(d.host, d.generation);
                    entry.pool.counters.demotions_dropped += 1;
                    continue;
                }
                // the spill reads the host block the demotion overwrites:
                // named first (and a worker runs every spill first)
                if let Some(s) = d.spill {
                    copies.push(TierCopy {
                        pool_id: entry.id,
                        window: entry.window,
                        direction: TierDirection::Spill,
                        device_block: 0,
                        host_block: s.host,
                        disk_block: s.disk,
                        hash: s.hash,
                        parent: s.parent,
                    });
                    refs.push(HostRef {
                        pool: i,
                        tier: Tier::Disk,
                        block: s.disk,
                        generation: s.generation,
                    });
                }
                copies.push(TierCopy {
                    pool_id: entry.id,
                    window: entry.window,
                    direction: TierDirection::Demote,
                    device_block: d.device,
                    host_block: d.host,
                    disk_block: 0,
                    hash: 0,
                    parent: 0,
                });
                refs.push(HostRef {
                    pool: i,
                    tier: Tier::Host,
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
                    self.pools[r.pool].pool.tier_mut(r.tier).unpin(r.block);
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
                .tier_mut(r.tier)
                .publish(r.block, r.generation);
        }
        for r in pins.into_values().flatten() {
            self.pools[r.pool].pool.tier_mut(r.tier).unpin(r.block);
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
            pool.tier_mut(r.tier).discard(r.block, r.generation);
            if r.tier == Tier::Host {
                pool.counters.demotions_dropped += 1;
            }
        }
    }

    /// Drops from the disk index every disk block the incomplete steps of
    /// `session` load (its holder reported a failed pass, which a bad block
    /// file causes): the pins stay until the step completes, but no lease
    /// matches those blocks again.
    pub(super) fn distrust_loads(pools: &mut [super::PoolEntry], session: &Session) {
        for r in session
            .host_pins
            .values()
            .flatten()
            .filter(|r| r.tier == Tier::Disk)
        {
            let pool = &mut pools[r.pool].pool;
            if pool.tier(Tier::Disk).generation(r.block) == r.generation
                && pool.tier_mut(Tier::Disk).invalidate(r.block)
            {
                pool.counters.disk_invalidated += 1;
            }
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
            pools[r.pool].pool.tier_mut(r.tier).unpin(r.block);
        }
    }
}
