//! Warm-up and capacity estimation plan: the largest request shapes the
//! scheduler will ever run, with every extra slot (draft tokens included),
//! and whether they fit in a group's pools. `bootstrap.rs` runs the plan
//! against the cache and the worker: atomic lease, forward, fenced release,
//! complete, and a check that every pool is whole again.

use crate::domain::{Extra, GroupGeometry};

/// Scheduler limits that decide the warm-up shapes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct WarmupLimits {
    /// Largest prompt + output, in tokens.
    pub max_context: u32,
    /// Largest `max_tokens` of a request.
    pub max_tokens: u32,
    /// Sequences running at once.
    pub max_seqs: u32,
    /// Tokens in one step's batch.
    pub max_tokens_per_step: u32,
    /// Draft tokens per decode step (0 = no speculation).
    pub draft_k: u32,
}

/// One warm-up shape: `num_seqs` identical sequences leased atomically.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct WarmupShape {
    pub name: &'static str,
    pub num_seqs: u32,
    pub prompt_len: u32,
    pub max_new_tokens: u32,
    pub extra: Extra,
}

impl WarmupShape {
    /// Token slots one sequence holds over its whole life.
    pub(crate) fn life_tokens(&self) -> u32 {
        self.prompt_len
            .saturating_add(self.max_new_tokens.saturating_sub(1))
            .saturating_add(self.extra.total())
    }

    /// Blocks the whole shape holds at its peak in a pool of `window`.
    pub(crate) fn peak_blocks(&self, group: &GroupGeometry, window: u32) -> u32 {
        self.num_seqs
            .saturating_mul(group.blocks_for(self.life_tokens(), window))
    }
}

/// The shapes to warm up with: the longest request, and the widest batch.
pub(crate) fn shapes(limits: WarmupLimits, group: &GroupGeometry) -> Vec<WarmupShape> {
    let extra = Extra {
        draft: limits.draft_k,
        ..Extra::default()
    };
    let max_context = limits.max_context.min(group.max_context).max(2);
    let max_tokens = limits.max_tokens.clamp(1, max_context - 1);
    let longest = WarmupShape {
        name: "longest",
        num_seqs: 1,
        prompt_len: max_context - max_tokens,
        max_new_tokens: max_tokens,
        extra,
    };
    // The widest batch: as many sequences as may run at once, but no more
    // than the pools can hold side by side. A pool too small for the
    // configured concurrency limits it (admission never exceeds the pools);
    // only the longest request is a hard requirement, since a request that
    // passes validation must be servable.
    let step_tokens = limits
        .max_tokens_per_step
        .min(group.max_batch_tokens)
        .max(1);
    let mut width = limits.max_seqs.min(group.max_batch_sequences).max(1);
    let per_seq = |width: u32| (step_tokens / width).clamp(1, group.tokens_per_block.max(1));
    let widest_life = |width: u32| per_seq(width) + 1 + extra.total();
    while width > 1
        && group.pools.iter().any(|p| {
            width.saturating_mul(group.blocks_for(widest_life(width), p.window)) > p.num_blocks
        })
    {
        width -= 1;
    }
    let widest = WarmupShape {
        name: "widest",
        num_seqs: width,
        prompt_len: per_seq(width),
        max_new_tokens: 2,
        extra,
    };
    vec![longest, widest]
}

/// A shape that does not fit in one of the group's pools.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct DoesNotFit {
    pub shape: WarmupShape,
    pub window: u32,
    pub needed: u32,
    pub available: u32,
}

/// Checks every shape against the group's (empty) pools with the local
/// block arithmetic; the cache's `Estimate` is checked as well by the caller.
pub(crate) fn check(shapes: &[WarmupShape], group: &GroupGeometry) -> Result<(), DoesNotFit> {
    for shape in shapes {
        for pool in &group.pools {
            let needed = shape.peak_blocks(group, pool.window);
            if needed > pool.num_blocks {
                return Err(DoesNotFit {
                    shape: shape.clone(),
                    window: pool.window,
                    needed,
                    available: pool.num_blocks,
                });
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::PoolGeometry;

    fn group(full_blocks: u32) -> GroupGeometry {
        GroupGeometry {
            name: "g".into(),
            tokens_per_block: 16,
            pools: vec![
                PoolGeometry {
                    host_blocks: 0,
                    pool_id: 1,
                    window: 0,
                    num_blocks: full_blocks,
                },
                PoolGeometry {
                    host_blocks: 0,
                    pool_id: 2,
                    window: 64,
                    num_blocks: 1000,
                },
            ],
            max_context: 2048,
            vocab_size: 258,
            max_batch_sequences: 8,
            max_batch_tokens: 256,
            peer: Default::default(),
            role: Default::default(),
        }
    }

    fn limits(draft_k: u32) -> WarmupLimits {
        WarmupLimits {
            max_context: 128,
            max_tokens: 32,
            max_seqs: 4,
            max_tokens_per_step: 64,
            draft_k,
        }
    }

    #[test]
    fn shapes_cover_longest_and_widest_with_drafts() {
        let s = shapes(limits(4), &group(100));
        assert_eq!(s[0].prompt_len + s[0].max_new_tokens, 128);
        assert_eq!(s[0].life_tokens(), 96 + 31 + 4);
        assert_eq!(s[1].num_seqs, 4);
        assert_eq!(s[1].prompt_len, 16);
        assert_eq!(s[1].extra.draft, 4);
    }

    #[test]
    fn widest_batch_is_limited_by_the_pools() {
        let g = group(6);
        let s = shapes(
            WarmupLimits {
                max_context: 64,
                ..limits(0)
            },
            &g,
        );
        // 4 sequences of 16 + 1 slots need 2 blocks each: only 3 fit in 6
        assert_eq!((s[1].num_seqs, s[1].prompt_len), (3, 16));
        assert!(check(&s, &g).is_ok());
    }

    /// 127 slots without drafts fit in 8 blocks of 16; the 4 draft slots make
    /// it 131, which needs 9. A plan that forgot the drafts would pass.
    #[test]
    fn draft_tokens_are_counted_in_the_estimate() {
        let g = group(8);
        assert!(check(&shapes(limits(0), &g), &g).is_ok());
        let err = check(&shapes(limits(4), &g), &g).err();
        assert_eq!(
            err.map(|e| (e.shape.name, e.window, e.needed, e.available)),
            Some(("longest", 0, 9, 8))
        );
    }
}
