//! `Release` and `CompleteStep`: giving sequences back (at once or fenced at
//! a step), publishing a completed step's hashes and lifting its fences.
//!
//! A released sequence's partly filled last block is kept for partial-block
//! reuse when its KV is known to be written: at once if the step that wrote
//! its last token is complete, else when that step completes (the release
//! must then be fenced at or after it, so the block is still parked).

use std::time::Instant;

use super::{Cache, PoolEntry};
use crate::error::{Error, Result};
use crate::ids::{Epoch, SeqId, SessionId, Step};
use crate::lease::{ReleaseMode, ReleaseResult, ReleaseStatus};
use crate::prefix;
use crate::session::{BlockRef, SeqState, Session};

impl Cache {
    /// Releases sequences, optionally fenced at a step.
    pub fn release(
        &mut self,
        session_id: SessionId,
        epoch: Epoch,
        seq_ids: &[SeqId],
        fence_step: Option<Step>,
        now: Instant,
    ) -> Result<Vec<ReleaseResult>> {
        self.release_with(session_id, epoch, seq_ids, fence_step.into(), now)
    }

    /// Releases sequences as `mode` says: optionally fenced at a step, and
    /// with `discard_unwritten` after the holder's forward pass failed: the
    /// sequences' hashes that wait for a step not yet completed (their
    /// blocks' pending hashes) are dropped now, as an unfenced release drops
    /// them, while the blocks still wait for the fence (the failed worker
    /// may still be writing them).
    pub fn release_with(
        &mut self,
        session_id: SessionId,
        epoch: Epoch,
        seq_ids: &[SeqId],
        mode: ReleaseMode,
        now: Instant,
    ) -> Result<Vec<ReleaseResult>> {
        self.touch(session_id, epoch, now)?;
        let Some(session) = self.sessions.get_mut(&session_id) else {
            return Err(Error::UnknownSession(session_id));
        };
        let fence = mode.fence_step.filter(|&s| !session.step_completed(s));
        let partial_reuse = self.config.partial_reuse;
        let partial_min = self.config.partial_min_tokens;
        let mut results = Vec::with_capacity(seq_ids.len());
        for &seq_id in seq_ids {
            let Some(seq) = session.seqs.remove(&seq_id) else {
                let status = if session.was_released(seq_id) {
                    ReleaseStatus::AlreadyReleased
                } else {
                    ReleaseStatus::Unknown
                };
                results.push(ReleaseResult {
                    seq_id,
                    status,
                    blocks_freed: 0,
                    blocks_fenced: 0,
                });
                continue;
            };
            let mut result = ReleaseResult {
                seq_id,
                status: ReleaseStatus::Released,
                blocks_freed: 0,
                blocks_fenced: 0,
            };
            let mut fenced = Vec::new();
            if partial_reuse && !mode.discard_unwritten {
                keep_partial(&mut self.pools, session, &seq, fence, partial_min);
            }
            for t in &seq.tables {
                let pool = &mut self.pools[t.pool].pool;
                for bt in &t.beams {
                    for &block in &bt.blocks {
                        // A block with a pending hash is the sequence's own
                        // (others only ever share published blocks; a fork
                        // shares only what a completed step wrote), and
                        // its step is not complete (else it would have
                        // published): its `session.pending` reference then
                        // finds nothing to publish.
                        if mode.discard_unwritten {
                            pool.discard_pending(block);
                        }
                        pool.release(block, fence.is_some());
                        if pool.refs(block).0 == 0 {
                            if fence.is_some() {
                                result.blocks_fenced += 1;
                            } else {
                                result.blocks_freed += 1;
                            }
                        }
                        if fence.is_some() {
                            fenced.push(BlockRef {
                                pool: t.pool,
                                block,
                                generation: pool.generation(block),
                            });
                        }
                    }
                }
            }
            session.references = session.references.saturating_sub(seq.references());
            if let Some(step) = fence
                && !fenced.is_empty()
            {
                session.fences.entry(step).or_default().extend(fenced);
            }
            session.remember_released(seq_id);
            results.push(result);
        }
        if mode.discard_unwritten {
            // The failed pass may not have run the demotion copies of any
            // step not yet complete either: none of them may publish.
            Self::drop_demotions(&mut self.pools, session);
            // ... and one of its loads may have met a bad block file
            Self::distrust_loads(&mut self.pools, session);
        }
        self.flush_events();
        Ok(results)
    }

    /// The holder finished `step`: publish the hashes its forward pass wrote,
    /// then lift the fences at steps <= it. Returns the blocks that left the
    /// fenced state.
    pub fn complete_step(
        &mut self,
        session_id: SessionId,
        epoch: Epoch,
        step: Step,
        now: Instant,
    ) -> Result<u64> {
        self.touch(session_id, epoch, now)?;
        let Some(session) = self.sessions.get_mut(&session_id) else {
            return Err(Error::UnknownSession(session_id));
        };
        session.completed_step = Some(session.completed_step.map_or(step, |s| s.max(step)));
        // step u64::MAX completes everything: nothing lies after it
        let (later_pending, later_fences) = match step.next() {
            Some(after) => (
                session.pending.split_off(&after),
                session.fences.split_off(&after),
            ),
            None => Default::default(),
        };
        let due_pending = std::mem::replace(&mut session.pending, later_pending);
        let due_fences = std::mem::replace(&mut session.fences, later_fences);
        for r in due_pending.into_values().flatten() {
            self.pools[r.pool].pool.publish(r.block, r.generation);
        }
        self.complete_tier_steps(session_id, step);
        let mut returned = 0;
        for r in due_fences.into_values().flatten() {
            if self.pools[r.pool].pool.unfence(r.block) {
                returned += 1;
            }
        }
        self.flush_events();
        Ok(returned)
    }
}

/// Marks `seq`'s partly filled last block (in every pool that holds it) to be
/// kept once released: published now if the step that wrote its last token
/// is complete, or when that step completes if the release is fenced at or
/// after it. An unfenced release before then keeps nothing: its KV may never
/// have been written; nor does a release before a chunked prefill reported
/// the whole sequence written, nor one holding fewer than `min_tokens`
/// tokens: a copy saves at most what it holds, and it takes a whole block
/// that a full, reusable one could have. Held-back prompt blocks (`SeqState::held_back`)
/// go with the sequence: their pending hashes are never published and clear
/// when the blocks leave use (or their fence).
fn keep_partial(
    pools: &mut [PoolEntry],
    session: &mut Session,
    seq: &SeqState,
    fence: Option<Step>,
    min_tokens: u32,
) {
    if (seq.partial.len() as u64) < u64::from(min_tokens) {
        return;
    }
    // A chunked prefill not reported written through the end: the last
    // block's KV may never be written.
    if !seq.hashable || seq.beams != 1 || seq.partial.is_empty() || seq.written < seq.len {
        return;
    }
    let written = session.step_completed(seq.write_step);
    if !written && fence.is_none_or(|f| f < seq.write_step) {
        return;
    }
    let index = seq.hashes.len() as u32;
    let parent = seq.hashes.last().copied().unwrap_or(prefix::ROOT_PARENT);
    for t in &seq.tables {
        let Some(bt) = t.beams.first() else { continue };
        let Some(&block) = index
            .checked_sub(bt.first)
            .and_then(|i| bt.blocks.get(i as usize))
        else {
            continue;
        };
        let pool = &mut pools[t.pool].pool;
        pool.set_pending_partial(block, parent, seq.salt, &seq.partial);
        let generation = pool.generation(block);
        if written {
            pool.publish(block, generation);
        } else {
            session
                .pending
                .entry(seq.write_step)
                .or_default()
                .push(BlockRef {
                    pool: t.pool,
                    block,
                    generation,
                });
        }
    }
}
