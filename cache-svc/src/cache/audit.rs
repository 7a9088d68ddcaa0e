//! The leak audit, `check_invariants`, and views of the state for tests.

use super::Cache;
use crate::ids::{BlockId, SessionId};
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

impl Cache {
    /// What holders account for, per pool and block: (refcount, fences).
    fn expected_refs(&self) -> Vec<Vec<(u32, u32)>> {
        let mut expected: Vec<Vec<(u32, u32)>> = self
            .pools
            .iter()
            .map(|p| vec![(0, 0); p.pool.len() as usize])
            .collect();
        for session in self.sessions.values() {
            for seq in session.seqs.values() {
                for t in &seq.tables {
                    for bt in &t.beams {
                        for &b in &bt.blocks {
                            expected[t.pool][b as usize].0 += 1;
                        }
                    }
                }
            }
            for r in session.fences.values().flatten() {
                expected[r.pool][r.block as usize].1 += 1;
            }
        }
        expected
    }

    /// Finds blocks whose references no lease or fence accounts for and sets
    /// them right (a block held by nobody returns to circulation). Never
    /// aborts; each finding is logged with its last holder.
    pub fn audit(&mut self) -> AuditReport {
        let expected = self.expected_refs();
        let mut report = AuditReport::default();
        for (i, entry) in self.pools.iter_mut().enumerate() {
            for block in 0..entry.pool.len() {
                report.blocks_checked += 1;
                let want = expected[i][block as usize];
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
                        last_session = leak.last_holder.session,
                        last_seq = leak.last_holder.seq,
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
        }
        self.flush_events();
        report
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

    /// Takes a block that no holder records, as a bug would (tests of the
    /// audit).
    #[cfg(test)]
    pub(crate) fn leak_for_test(&mut self, pool_id: u32) -> Option<BlockId> {
        let holder = Holder {
            session: 99,
            seq: 42,
        };
        self.pools
            .get_mut(pool_id as usize - 1)?
            .pool
            .allocate(holder, 0)
    }

    /// The session's view of a sequence: (len, tables per pool as (first, blocks)).
    pub fn sequence_tables(
        &self,
        session_id: SessionId,
        seq_id: u64,
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
