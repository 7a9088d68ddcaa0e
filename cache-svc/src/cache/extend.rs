//! `Extend`: grow held sequences, slide windowed tables (fencing the blocks
//! that slide out at the extend's step) and hash the blocks the new tokens
//! fill; take chunked-prefill progress reports, which release held-back
//! prompt blocks to the step's publication.

use foldhash::{HashSet, HashSetExt};
use std::time::Instant;

use super::{Batch, Cache, Tally, ceil_div};
use crate::error::{Error, Result};
use crate::ids::{Epoch, SeqId, SessionId, Step};
use crate::lease::{ExtendItem, Grant, Growth, Outcome, Reject, RejectReason, Table};
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
        items: &[(SeqId, Growth)],
        now: Instant,
    ) -> Result<Vec<Outcome>> {
        let items: Vec<ExtendItem> = items
            .iter()
            .map(|(seq_id, growth)| ExtendItem::grow(*seq_id, growth.clone()))
            .collect();
        self.extend_items(session_id, epoch, batch, &items, now)
    }

    /// Checks an Extend's items without changing anything: each grows by
    /// some tokens or reports progress, and no progress report passes its
    /// sequence's length (a sequence the session does not hold is left to
    /// the extend itself, which answers it `UNKNOWN_SEQUENCE`).
    pub fn check_extend_items(&self, session_id: SessionId, items: &[ExtendItem]) -> Result<()> {
        let session = self.sessions.get(&session_id);
        for item in items {
            let seq_id = item.seq_id;
            match &item.growth {
                Some(growth) if growth.is_empty() => {
                    return Err(Error::InvalidArgument(format!(
                        "sequence {seq_id}: give new_tokens or num_tokens > 0"
                    )));
                }
                None if item.written_tokens == 0 => {
                    return Err(Error::InvalidArgument(format!(
                        "sequence {seq_id}: give new_tokens or num_tokens > 0, or written_tokens > 0"
                    )));
                }
                _ => {}
            }
            if item.written_tokens == 0 {
                continue;
            }
            if let Some(seq) = session.and_then(|s| s.seqs.get(&seq_id)) {
                let len = u64::from(seq.len) + u64::from(item.new_tokens());
                if u64::from(item.written_tokens) > len {
                    return Err(Error::InvalidArgument(format!(
                        "sequence {seq_id}: written_tokens {} is beyond its length of {len} tokens",
                        item.written_tokens
                    )));
                }
            }
        }
        Ok(())
    }

    /// Grows held sequences and takes chunked-prefill progress reports; one
    /// outcome per item, in order.
    pub fn extend_items(
        &mut self,
        session_id: SessionId,
        epoch: Epoch,
        batch: Batch,
        items: &[ExtendItem],
        now: Instant,
    ) -> Result<Vec<Outcome>> {
        let Batch { step, atomic, .. } = batch;
        self.touch(session_id, epoch, now)?;
        self.check_extend_items(session_id, items)?;
        let mut seen = HashSet::with_capacity(items.len());
        let duplicate = |seq_id: SeqId| {
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
            for item in items {
                let seq_id = &item.seq_id;
                let outcome = if !seen.insert(*seq_id) {
                    duplicate(*seq_id)
                } else {
                    match self.plan_item(session_id, item, &mut plan) {
                        Err(reject) => Outcome::Reject(reject),
                        Ok(()) => {
                            let outcome = match self.check_extend(*seq_id, &plan, None) {
                                Ok(()) => Outcome::Grant(self.noting_evictions(*seq_id, |c| {
                                    c.execute_item(session_id, item, &plan, step)
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
        for (i, item) in items.iter().enumerate() {
            let seq_id = &item.seq_id;
            if !seen.insert(*seq_id) {
                outcomes[i] = Some(duplicate(*seq_id));
                continue;
            }
            let mut plan = Vec::new();
            match self.plan_item(session_id, item, &mut plan) {
                Ok(()) => plans.push((i, plan)),
                Err(reject) => outcomes[i] = Some(Outcome::Reject(reject)),
            }
        }
        let mut first_reject = outcomes.iter().position(Option::is_some);
        if first_reject.is_none() {
            let mut tally = Tally::default();
            for (i, plan) in &plans {
                if let Err(reject) = self.check_extend(items[*i].seq_id, plan, Some(&mut tally)) {
                    outcomes[*i] = Some(Outcome::Reject(reject));
                    first_reject = Some(*i);
                    break;
                }
            }
        }
        if let Some(bad) = first_reject {
            let cause = items[bad].seq_id;
            for (i, item) in items.iter().enumerate() {
                if outcomes[i].is_none() {
                    outcomes[i] = Some(Outcome::Reject(Reject::plain(
                        item.seq_id,
                        RejectReason::RolledBack,
                        format!("atomic batch rolled back: sequence {cause} was rejected"),
                    )));
                }
            }
        } else {
            for (i, plan) in &plans {
                let item = &items[*i];
                outcomes[*i] = Some(Outcome::Grant(self.noting_evictions(item.seq_id, |c| {
                    c.execute_item(session_id, item, plan, step)
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

    /// The plan of one item, into `plan`: a progress report alone changes no
    /// table (its plan is empty), but its sequence must be held.
    fn plan_item(
        &self,
        session_id: SessionId,
        item: &ExtendItem,
        plan: &mut Vec<PoolExtend>,
    ) -> Result<(), Reject> {
        match &item.growth {
            Some(growth) => self.plan_extend(session_id, item, growth.len(), plan),
            None => {
                plan.clear();
                let held = self
                    .sessions
                    .get(&session_id)
                    .is_some_and(|s| s.seqs.contains_key(&item.seq_id));
                if held {
                    Ok(())
                } else {
                    Err(Reject::plain(
                        item.seq_id,
                        RejectReason::UnknownSequence,
                        format!("sequence {} is not leased by this session", item.seq_id),
                    ))
                }
            }
        }
    }

    /// Carries out one checked item: its growth (if any), then its progress
    /// report (if any).
    fn execute_item(
        &mut self,
        session_id: SessionId,
        item: &ExtendItem,
        plan: &[PoolExtend],
        step: Step,
    ) -> Grant {
        let grant = match &item.growth {
            Some(growth) => self.execute_extend(session_id, item.seq_id, growth, plan, step),
            None => Grant {
                seq_id: item.seq_id,
                tables: Vec::new(),
                reused_tokens: 0,
                capacity_tokens: self
                    .sessions
                    .get(&session_id)
                    .and_then(|s| s.seqs.get(&item.seq_id))
                    .map_or(0, |seq| seq.capacity()),
                copies: Vec::new(),
                tier_copies: Vec::new(),
                peer_copies: Vec::new(),
                peer_decision: None,
                retained_tokens: 0,
            },
        };
        let mut grant = grant;
        let pools: Vec<usize> = plan.iter().map(|p| p.pool).collect();
        grant.tier_copies = self.take_demotions(session_id, &pools, step);
        if item.written_tokens > 0 {
            self.record_progress(session_id, item.seq_id, item.written_tokens, step);
        }
        grant
    }

    /// The forward pass of `step` writes `seq_id`'s KV through `written`
    /// tokens: the held-back prompt blocks that now lie within it publish
    /// when that step completes. A report for a step already completed
    /// publishes nothing, as a lease or extend at such a step does not.
    fn record_progress(&mut self, session_id: SessionId, seq_id: SeqId, written: u32, step: Step) {
        let Some(session) = self.sessions.get_mut(&session_id) else {
            return;
        };
        let done = session.step_completed(step);
        let completed = session.completed_step;
        let Some(seq) = session.seqs.get_mut(&seq_id) else {
            return;
        };
        let written = written.min(seq.len);
        if written <= seq.written {
            return;
        }
        seq.written = written;
        seq.note_write(step, written, completed);
        if written == seq.len {
            // the partly filled last block is written by this step too
            seq.write_step = step;
        }
        let (covered, later): (Vec<_>, Vec<_>) = std::mem::take(&mut seq.held_back)
            .into_iter()
            .partition(|&(end, _)| end <= written);
        seq.held_back = later;
        if !covered.is_empty() && !done {
            session
                .pending
                .entry(step)
                .or_default()
                .extend(covered.into_iter().map(|(_, r)| r));
        }
    }

    /// The per-pool plan of growing `item`'s sequence by `n` tokens, into
    /// `plan`; refused `LENGTH_MISMATCH` when it grows from a length the
    /// sequence does not have.
    fn plan_extend(
        &self,
        session_id: SessionId,
        item: &ExtendItem,
        n: u32,
        plan: &mut Vec<PoolExtend>,
    ) -> Result<(), Reject> {
        let seq_id = item.seq_id;
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
        // A growth from a length the sequence does not have: the holder is
        // behind the cache, as when the answer to a growth applied here
        // never reached it, and applying this one would record its tokens
        // twice.
        if let Some(from) = item.from_length.filter(|&from| from != seq.len) {
            return Err(Reject::plain(
                seq_id,
                RejectReason::LengthMismatch,
                format!(
                    "sequence {seq_id} is {} tokens long here, not the {from} this growth starts from (an earlier growth's answer was lost?): nothing taken",
                    seq.len
                ),
            ));
        }
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
        seq_id: SeqId,
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
        seq_id: SeqId,
        growth: &Growth,
        plan: &[PoolExtend],
        step: Step,
    ) -> Grant {
        // The plan found the sequence; should it be gone, grant nothing.
        let nothing = || Grant {
            seq_id,
            tables: Vec::new(),
            reused_tokens: 0,
            capacity_tokens: 0,
            copies: Vec::new(),
            tier_copies: Vec::new(),
            peer_copies: Vec::new(),
            peer_decision: None,
            retained_tokens: 0,
        };
        let Some(session) = self.sessions.get_mut(&session_id) else {
            return nothing();
        };
        let fence_done = session.step_completed(step);
        let completed = session.completed_step;
        let Some(seq) = session.seqs.get_mut(&seq_id) else {
            return nothing();
        };
        let holder = Holder {
            session: session_id,
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
                    // A held-back prompt block that slides out was never
                    // written by this sequence's passes: it never publishes.
                    if !seq.held_back.is_empty() {
                        seq.held_back
                            .retain(|(_, r)| (r.pool, r.block) != (p.pool, block));
                    }
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
        // Tokens written through the old end: so are the new ones, by this
        // step. A prefill still short of it holds their blocks back too.
        let whole = seq.written >= seq.len;
        seq.len = seq.len.saturating_add(growth.len());
        if whole {
            seq.written = seq.len;
            seq.note_write(step, seq.len, completed);
        }
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
                            let r = BlockRef {
                                pool: t.pool,
                                block,
                                generation: pool.generation(block),
                            };
                            let end = (idx + 1) * b as u32;
                            if end <= seq.written {
                                pending.push(r);
                            } else {
                                seq.held_back.push((end, r));
                            }
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
            tier_copies: Vec::new(),
            peer_copies: Vec::new(),
            peer_decision: None,
            retained_tokens: 0,
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
