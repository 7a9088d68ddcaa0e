//! The leak audit, `check_invariants`, and views of the state for tests.

use super::Cache;
use crate::events::Tier;
use crate::ids::{BlockId, SeqId, SessionId};
use crate::pool::Holder;
use crate::session::SeqState;

/// A block the audit found unaccounted for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Leak {
    /// The pool.
    pub pool_id: u32,
    /// The block.
    pub block: BlockId,
    /// Who last held it.
    pub last_holder: Holder,
    /// References it had / should have had: (refcount, fences).
    pub found: (u32, u32),
    /// What holders account for.
    pub expected: (u32, u32),
}

/// What an audit did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct AuditReport {
    /// Blocks reconciled.
    pub reclaimed: Vec<Leak>,
    /// Blocks examined.
    pub blocks_checked: u64,
}

/// Blocks one audit slice examines: the lock is held for one slice at a
/// time, so a large pool's audit never stalls other calls for long.
pub const AUDIT_SLICE_BLOCKS: u32 = 16_384;

/// Where an audit goes next: pool index and first block of the next slice.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AuditCursor {
    pool: usize,
    block: u32,
}

impl Cache {
    /// What holders account for, per pool and block: (refcount, fences).
    fn expected_refs(&self) -> Vec<Vec<(u32, u32)>> {
        (0..self.pools.len())
            .map(|i| self.expected_range(i, 0, self.pools[i].pool.len()))
            .collect()
    }

    /// What holders account for in blocks `[start, end)` of pool `pool`:
    /// one walk over the holders' tables, counting only that range.
    fn expected_range(&self, pool: usize, start: u32, end: u32) -> Vec<(u32, u32)> {
        let mut expected = vec![(0, 0); end.saturating_sub(start) as usize];
        let slot = |b: BlockId| (b >= start && b < end).then(|| (b - start) as usize);
        for session in self.sessions.values() {
            for seq in session.seqs.values() {
                for t in seq.tables.iter().filter(|t| t.pool == pool) {
                    for bt in &t.beams {
                        for &b in &bt.blocks {
                            if let Some(i) = slot(b) {
                                expected[i].0 += 1;
                            }
                        }
                    }
                }
            }
            for r in session.fences.values().flatten().filter(|r| r.pool == pool) {
                if let Some(i) = slot(r.block) {
                    expected[i].1 += 1;
                }
            }
        }
        expected
    }

    /// Finds blocks whose references no lease or fence accounts for and sets
    /// them right (a block held by nobody returns to circulation). Never
    /// aborts; each finding is logged with its last holder. The whole audit
    /// at once: the service runs it slice by slice ([`Cache::audit_slice`]).
    pub fn audit(&mut self) -> AuditReport {
        let mut report = AuditReport::default();
        let mut cursor = AuditCursor::default();
        while let Some(next) = self.audit_slice(cursor, u32::MAX, &mut report) {
            cursor = next;
        }
        report
    }

    /// Audits at most `max_blocks` blocks from `cursor` (within one pool),
    /// adding to `report`; returns where to go on, or `None` when every pool
    /// was audited. Each slice is consistent on its own (holders are counted
    /// for its range under the same `&mut self`), so the state may change
    /// between slices without false findings.
    pub fn audit_slice(
        &mut self,
        cursor: AuditCursor,
        max_blocks: u32,
        report: &mut AuditReport,
    ) -> Option<AuditCursor> {
        let i = cursor.pool;
        let len = self.pools.get(i)?.pool.len();
        let start = cursor.block.min(len);
        let end = start.saturating_add(max_blocks.max(1)).min(len);
        let expected = self.expected_range(i, start, end);
        let entry = &mut self.pools[i];
        for block in start..end {
            report.blocks_checked += 1;
            let want = expected[(block - start) as usize];
            let found = entry.pool.refs(block);
            if found != want && entry.pool.reconcile(block, want.0, want.1) {
                let leak = Leak {
                    pool_id: entry.id,
                    block,
                    last_holder: entry.pool.last_holder(block),
                    found,
                    expected: want,
                };
                tracing::warn!(
                    pool_id = leak.pool_id,
                    block,
                    last_session = leak.last_holder.session.0,
                    last_seq = leak.last_holder.seq.0,
                    found_refs = found.0,
                    found_fences = found.1,
                    expected_refs = want.0,
                    expected_fences = want.1,
                    "leak audit reconciled a block"
                );
                entry.pool.counters.leaks_reclaimed += 1;
                report.reclaimed.push(leak);
            }
        }
        self.flush_events();
        let next = if end >= len {
            AuditCursor {
                pool: i + 1,
                block: 0,
            }
        } else {
            AuditCursor {
                pool: i,
                block: end,
            }
        };
        (next.pool < self.pools.len()).then_some(next)
    }

    /// Checks every pool's invariants and that every block's references are
    /// exactly those its holders account for (no leak, no double grant).
    pub fn check_invariants(&self) -> Result<(), String> {
        let expected = self.expected_refs();
        for (i, entry) in self.pools.iter().enumerate() {
            entry
                .pool
                .check_invariants()
                .map_err(|e| format!("pool {}: {e}", entry.id))?;
            for block in 0..entry.pool.len() {
                let found = entry.pool.refs(block);
                let want = expected[i][block as usize];
                if found != want {
                    return Err(format!(
                        "pool {} block {block}: refs {found:?}, holders account for {want:?}",
                        entry.id
                    ));
                }
            }
        }
        self.check_tier_invariants()?;
        for session in self.sessions.values() {
            let refs: u64 = session.seqs.values().map(SeqState::references).sum();
            if refs != session.references {
                return Err(format!(
                    "session {} counts {} references, its sequences hold {refs}",
                    session.id, session.references
                ));
            }
            for (seq_id, seq) in &session.seqs {
                for t in &seq.tables {
                    let entry = &self.pools[t.pool];
                    // No double grant: a block this sequence will still write
                    // (holding position `len` or later) is held by it alone;
                    // full blocks before it are read-only and may be shared.
                    for bt in &t.beams {
                        for (k, &b) in bt.blocks.iter().enumerate() {
                            let idx = bt.first + k as u32;
                            let writable = idx >= seq.len / entry.tokens_per_block;
                            let (refs, _) = entry.pool.refs(b);
                            // A writable index is past the prompt, so it
                            // is never one of the beams' shared blocks.
                            if writable && refs != 1 {
                                return Err(format!(
                                    "sequence {seq_id} block index {idx} (pool {}, block {b}) is writable but has {refs} holders",
                                    entry.id
                                ));
                            }
                        }
                    }
                }
            }
        }
        Ok(())
    }

    /// The host and disk tiers: every pin is an onboarding (or load) of a
    /// session's step not yet complete, every pending block a demotion (or
    /// spill) of one.
    fn check_tier_invariants(&self) -> Result<(), String> {
        for (i, entry) in self.pools.iter().enumerate() {
            for tier in [Tier::Host, Tier::Disk] {
                self.check_one_tier(i, entry, tier)?;
            }
        }
        Ok(())
    }

    fn check_one_tier(&self, i: usize, entry: &super::PoolEntry, tier: Tier) -> Result<(), String> {
        let blocks = entry.pool.tier(tier);
        let mut pins = vec![0u32; blocks.len() as usize];
        let mut pending = vec![0u32; blocks.len() as usize];
        for session in self.sessions.values() {
            let mine = |r: &&crate::session::HostRef| r.pool == i && r.tier == tier;
            for r in session.host_pins.values().flatten().filter(mine) {
                pins[r.block as usize] += 1;
            }
            for r in session.demotions.values().flatten().filter(mine) {
                if blocks.generation(r.block) != r.generation {
                    return Err(format!(
                        "pool {}: demotion into {tier:?} block {} is stale",
                        entry.id, r.block
                    ));
                }
                pending[r.block as usize] += 1;
            }
        }
        for b in 0..blocks.len() {
            let (found, want) = (blocks.pins(b), pins[b as usize]);
            if found != want {
                return Err(format!(
                    "pool {} {tier:?} block {b}: {found} pins, sessions account for {want}",
                    entry.id
                ));
            }
            let is_pending = blocks.state(b) == crate::tier::HostState::Pending;
            if is_pending != (pending[b as usize] == 1) || pending[b as usize] > 1 {
                return Err(format!(
                    "pool {} {tier:?} block {b}: pending={is_pending}, {} demotions name it",
                    entry.id, pending[b as usize]
                ));
            }
        }
        Ok(())
    }

    /// Takes a block that no holder records, as a bug would (tests of the
    /// audit).
    #[cfg(test)]
    pub(crate) fn leak_for_test(&mut self, pool_id: u32) -> Option<BlockId> {
        let holder = Holder {
            session: SessionId(99),
            seq: SeqId(42),
        };
        self.pools
            .get_mut(pool_id as usize - 1)?
            .pool
            .allocate(holder, 0)
    }

    /// The length (tokens) the session's sequence has here.
    pub fn sequence_len(&self, session_id: SessionId, seq_id: SeqId) -> Option<u32> {
        Some(self.sessions.get(&session_id)?.seqs.get(&seq_id)?.len)
    }

    /// The session's view of a sequence: (len, tables per pool as (first, blocks)).
    pub fn sequence_tables(
        &self,
        session_id: SessionId,
        seq_id: SeqId,
    ) -> Option<Vec<(u32, u32, Vec<BlockId>)>> {
        let seq = self.sessions.get(&session_id)?.seqs.get(&seq_id)?;
        Some(
            seq.tables
                .iter()
                .map(|t| {
                    let bt = &t.beams[0];
                    (
                        self.pools[t.pool].window,
                        bt.first,
                        bt.blocks.iter().copied().collect(),
                    )
                })
                .collect(),
        )
    }
}
