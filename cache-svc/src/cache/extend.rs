//! `Extend`: grow held sequences, slide windowed tables (fencing the blocks
//! that slide out at the extend's step) and hash the blocks the new tokens
//! fill.

use foldhash::{HashSet, HashSetExt};
use std::time::Instant;

use super::{Batch, Cache, Tally, ceil_div};
use crate::error::{Error, Result};
use crate::ids::{Epoch, SessionId};
use crate::lease::{Grant, Growth, Outcome, Reject, RejectReason, Table};
use crate::pool::Holder;
use crate::prefix;
use crate::session::BlockRef;

/// The blocks an extend takes from (and slides out of) one pool.
#[derive(Clone, Copy, Debug)]
struct PoolExtend {
    /// Index into the sequence's tables.
    table: usize,
    pool: usize,
    new_first: u32,
    new_end: u32,
    new_blocks: u64,
}

impl Cache {
    /// Grows held sequences; one outcome per item, in order.
    pub fn extend(
        &mut self,
        session_id: SessionId,
        epoch: Epoch,
        batch: Batch,
        items: &[(u64, Growth)],
        now: Instant,
    ) -> Result<Vec<Outcome>> {
        let Batch { step, atomic, .. } = batch;
        self.touch(session_id, epoch, now)?;
        for (seq_id, growth) in items {
            if growth.is_empty() {
                return Err(Error::InvalidArgument(format!(
                    "sequence {seq_id}: give new_tokens or num_tokens > 0"
                )));
            }
        }
        let mut seen = HashSet::with_capacity(items.len());
        let duplicate = |seq_id: u64| {
            Outcome::Reject(Reject::plain(
                seq_id,
                RejectReason::DuplicateSequence,
                format!("sequence {seq_id} is named twice in one extend"),
            ))
        };
        if !atomic {
            // Per-sequence all-or-nothing: plan, check and execute each in
            // turn, reusing one plan buffer (a decode step's Extend carries
            // hundreds of sequences).
            let mut outcomes = Vec::with_capacity(items.len());
            let mut plan = Vec::new();
            for (seq_id, growth) in items {
                let outcome = if !seen.insert(*seq_id) {
                    duplicate(*seq_id)
                } else {
                    match self.plan_extend(session_id, *seq_id, growth.len(), &mut plan) {
                        Err(reject) => Outcome::Reject(reject),
                        Ok(()) => {
                            let outcome = match self.check_extend(*seq_id, &plan, None) {
                                Ok(()) => Outcome::Grant(self.noting_evictions(*seq_id, |c| {
                                    c.execute_extend(session_id, *seq_id, growth, &plan, step)
                                })),
                                Err(reject) => Outcome::Reject(reject),
                            };
                            self.count_extend(&outcome, &plan);
                            outcome
                        }
                    }
                };
                outcomes.push(outcome);
            }
            self.flush_events();
            return Ok(outcomes);
        }
        let mut outcomes: Vec<Option<Outcome>> = vec![None; items.len()];
        let mut plans = Vec::new();
        for (i, (seq_id, growth)) in items.iter().enumerate() {
            if !seen.insert(*seq_id) {
                outcomes[i] = Some(duplicate(*seq_id));
                continue;
            }
            let mut plan = Vec::new();
            match self.plan_extend(session_id, *seq_id, growth.len(), &mut plan) {
                Ok(()) => plans.push((i, plan)),
                Err(reject) => outcomes[i] = Some(Outcome::Reject(reject)),
            }
        }
        let mut first_reject = outcomes.iter().position(Option::is_some);
        if first_reject.is_none() {
            let mut tally = Tally::default();
            for (i, plan) in &plans {
                if let Err(reject) = self.check_extend(items[*i].0, plan, Some(&mut tally)) {
                    outcomes[*i] = Some(Outcome::Reject(reject));
                    first_reject = Some(*i);
                    break;
                }
            }
        }
        if let Some(bad) = first_reject {
            let cause = items[bad].0;
            for (i, (seq_id, _)) in items.iter().enumerate() {
                if outcomes[i].is_none() {
                    outcomes[i] = Some(Outcome::Reject(Reject::plain(
                        *seq_id,
                        RejectReason::RolledBack,
                        format!("atomic batch rolled back: sequence {cause} was rejected"),
                    )));
                }
            }
        } else {
            for (i, plan) in &plans {
                let (seq_id, growth) = &items[*i];
                outcomes[*i] = Some(Outcome::Grant(self.noting_evictions(*seq_id, |c| {
                    c.execute_extend(session_id, *seq_id, growth, plan, step)
                })));
            }
        }
        for (i, plan) in &plans {
            if let Some(o) = &outcomes[*i] {
                self.count_extend(o, plan);
            }
        }
        self.flush_events();
        Ok(outcomes.into_iter().flatten().collect())
    }

    fn count_extend(&mut self, outcome: &Outcome, plan: &[PoolExtend]) {
        match outcome {
            Outcome::Grant(_) => {}
            Outcome::Reject(r) => {
                if let Some(p) = plan.iter().find(|p| self.pools[p.pool].id == r.pool_id) {
                    self.pools[p.pool].pool.counters.rejects += 1;
                }
            }
        }
    }

    /// The per-pool plan of growing `seq_id` by `n` tokens, into `plan`.
    fn plan_extend(
        &self,
        session_id: SessionId,
        seq_id: u64,
        n: u32,
        plan: &mut Vec<PoolExtend>,
    ) -> Result<(), Reject> {
        let seq = self
            .sessions
            .get(&session_id)
            .and_then(|s| s.seqs.get(&seq_id))
            .ok_or_else(|| {
                Reject::plain(
                    seq_id,
                    RejectReason::UnknownSequence,
                    format!("sequence {seq_id} is not leased by this session"),
                )
            })?;
        let new_len = seq.len.saturating_add(n);
        let capacity = new_len.saturating_add(seq.extra).max(seq.reserved_capacity);
        plan.clear();
        plan.extend(seq.tables.iter().enumerate().map(|(ti, t)| {
            let entry = &self.pools[t.pool];
            let b = entry.tokens_per_block;
            let (first, end) = t.beams.first().map_or((0, 0), |bt| (bt.first, bt.end()));
            let new_first = if entry.window == 0 {
                first
            } else {
                first.max((seq.len + 1).saturating_sub(entry.window) / b)
            };
            let new_end = end.max(ceil_div(capacity, b));
            PoolExtend {
                table: ti,
                pool: t.pool,
                new_first,
                new_end,
                new_blocks: u64::from(seq.beams) * u64::from(new_end - end),
            }
        }));
        Ok(())
    }

    fn check_extend(
        &self,
        seq_id: u64,
        plan: &[PoolExtend],
        mut tally: Option<&mut Tally>,
    ) -> Result<(), Reject> {
        for p in plan {
            let entry = &self.pools[p.pool];
            // Blocks sliding out are fenced: they do not help this extend.
            let held_after = u64::from(p.new_end - p.new_first);
            if held_after > u64::from(entry.pool.len()) {
                return Err(self.pool_reject(
                    seq_id,
                    p.pool,
                    RejectReason::ExceedsCapacity,
                    held_after,
                    format!(
                        "would hold {held_after} blocks in pool {} (window {}), which has {} in all",
                        entry.id,
                        entry.window,
                        entry.pool.len()
                    ),
                ));
            }
            let mut need = p.new_blocks;
            if let Some(t) = tally.as_deref_mut() {
                let taken = t.new_blocks.entry(p.pool).or_default();
                *taken += need;
                need = *taken;
            }
            let counts = entry.pool.counts();
            if need > u64::from(counts.available()) {
                return Err(self.pool_reject(
                    seq_id,
                    p.pool,
                    RejectReason::PoolExhausted,
                    p.new_blocks,
                    format!(
                        "pool {} (window {}) has {} blocks free or evictable, {need} needed; {} wait on fences",
                        entry.id,
                        entry.window,
                        counts.available(),
                        counts.fenced
                    ),
                ));
            }
        }
        Ok(())
    }

    fn execute_extend(
        &mut self,
        session_id: SessionId,
        seq_id: u64,
        growth: &Growth,
        plan: &[PoolExtend],
        step: u64,
    ) -> Grant {
        // The plan found the sequence; should it be gone, grant nothing.
        let nothing = || Grant {
            seq_id,
            tables: Vec::new(),
            reused_tokens: 0,
            capacity_tokens: 0,
            copies: Vec::new(),
        };
        let Some(session) = self.sessions.get_mut(&session_id) else {
            return nothing();
        };
        let fence_done = session.step_completed(step);
        let Some(seq) = session.seqs.get_mut(&seq_id) else {
            return nothing();
        };
        let holder = Holder {
            session: session_id.0,
            seq: seq_id,
        };
        let mut fenced = Vec::new();
        let mut added: i64 = 0;
        // The grant of an extend is a delta: per (pool, beam) the new first
        // block and only the blocks appended now.
        let mut tables = Vec::new();
        for p in plan {
            let entry = &mut self.pools[p.pool];
            let (pool_id, window) = (entry.id, entry.window);
            let pool = &mut entry.pool;
            let t = &mut seq.tables[p.table];
            for (beam, bt) in t.beams.iter_mut().enumerate() {
                let mut appended = Vec::new();
                let old_first = bt.first;
                while bt.first < p.new_first {
                    let Some(block) = bt.blocks.pop_front() else {
                        break;
                    };
                    bt.first += 1;
                    added -= 1;
                    pool.release(block, !fence_done);
                    if !fence_done {
                        fenced.push(BlockRef {
                            pool: p.pool,
                            block,
                            generation: pool.generation(block),
                        });
                    }
                }
                if bt.blocks.is_empty() {
                    bt.first = p.new_first;
                }
                while bt.end() < p.new_end {
                    match pool.allocate(holder, seq.priority) {
                        Some(block) => {
                            bt.blocks.push_back(block);
                            appended.push(block);
                            added += 1;
                        }
                        None => break,
                    }
                }
                // A table this call left alone (no slide, no new block) is
                // left out: most decode steps change no table at all.
                if bt.first != old_first || !appended.is_empty() {
                    tables.push(Table {
                        pool_id,
                        window,
                        beam: beam as u32,
                        first_block: bt.first,
                        block_ids: appended,
                    });
                }
            }
        }
        seq.len = seq.len.saturating_add(growth.len());
        // Hash the blocks the new tokens fill; they publish once this step
        // completes (its forward pass writes them).
        let mut pending = Vec::new();
        match growth {
            Growth::Tokens(tokens) if seq.hashable => {
                seq.partial.extend_from_slice(tokens);
                seq.write_step = step;
                let b = self.pools[seq.tables[0].pool].tokens_per_block as usize;
                while seq.partial.len() >= b {
                    let parent = seq.hashes.last().copied().unwrap_or(prefix::ROOT_PARENT);
                    let hash = prefix::block_hash(parent, seq.salt, &seq.partial[..b]);
                    let idx = seq.hashes.len() as u32;
                    seq.hashes.push(hash);
                    seq.partial.drain(..b);
                    for t in &seq.tables {
                        let bt = &t.beams[0];
                        if idx >= bt.first && idx < bt.end() {
                            let block = bt.blocks[(idx - bt.first) as usize];
                            let pool = &mut self.pools[t.pool].pool;
                            pool.set_pending(block, hash, parent);
                            pending.push(BlockRef {
                                pool: t.pool,
                                block,
                                generation: pool.generation(block),
                            });
                        }
                    }
                }
            }
            Growth::Tokens(_) => {}
            Growth::Count(_) => {
                seq.hashable = false;
                seq.partial.clear();
            }
        }
        let grant = Grant {
            seq_id,
            tables,
            reused_tokens: 0,
            capacity_tokens: seq.capacity(),
            copies: Vec::new(),
        };
        session.references = (session.references as i64 + added).max(0) as u64;
        if !fenced.is_empty() {
            session.fences.entry(step).or_default().extend(fenced);
        }
        if !pending.is_empty() && !fence_done {
            session.pending.entry(step).or_default().extend(pending);
        }
        grant
    }
}
