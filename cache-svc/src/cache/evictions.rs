//! Which sequence's allocation evicted cached blocks, and from which pool,
//! so the service can record evictions in the trace of the request that
//! caused them.

use super::Cache;
use crate::ids::SeqId;

/// Cached blocks one sequence's allocation evicted from one pool.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Evicted {
    /// The sequence whose lease or extend took the blocks.
    pub seq_id: SeqId,
    /// The pool they were evicted from.
    pub pool_id: u32,
    /// How many.
    pub blocks: u64,
}

impl Cache {
    /// Runs `allocate` (one sequence's allocation) and notes, per pool, the
    /// cached blocks it evicted.
    pub(super) fn noting_evictions<T>(
        &mut self,
        seq_id: SeqId,
        allocate: impl FnOnce(&mut Self) -> T,
    ) -> T {
        let before: Vec<u64> = self
            .pools
            .iter()
            .map(|p| p.pool.counters.evictions)
            .collect();
        let out = allocate(self);
        let evicted: Vec<Evicted> = self
            .pools
            .iter()
            .zip(before)
            .filter_map(|(p, before)| {
                let blocks = p.pool.counters.evictions.saturating_sub(before);
                (blocks > 0).then_some(Evicted {
                    seq_id,
                    pool_id: p.id,
                    blocks,
                })
            })
            .collect();
        self.evicted.extend(evicted);
        out
    }

    /// The evictions noted since the last call, in allocation order.
    pub fn take_evictions(&mut self) -> Vec<Evicted> {
        std::mem::take(&mut self.evicted)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cache::{Batch, CacheConfig};
    use crate::ids::{Epoch, Step};
    use crate::lease::{Outcome, Prompt, SeqSpec};
    use std::time::Instant;

    fn spec(seq_id: u64, tokens: Vec<u32>) -> SeqSpec {
        SeqSpec {
            max_new_tokens: 0,
            ..SeqSpec::new(SeqId(seq_id), "g", Prompt::Tokens(tokens))
        }
    }

    #[test]
    fn a_lease_that_evicts_cached_blocks_is_noted_with_its_pool() {
        let now = Instant::now();
        let mut cache = Cache::with_epoch(CacheConfig::default(), Epoch(1));
        let (pools, _) = cache.register_pool("g", 4, &[(0, 4)]).unwrap();
        let pool_id = pools[0].pool_id;
        let session = cache.open_session("s", None, now).unwrap();
        let (sid, epoch) = (session.session_id, session.epoch);
        let batch = |step| Batch {
            step: Step(step),
            atomic: false,
            warmup: false,
        };
        // 16 tokens fill the 4 blocks; published, then released, they stay cached
        let first = cache
            .lease(sid, epoch, batch(1), &[spec(1, (1..=16).collect())], now)
            .unwrap();
        assert!(matches!(first[0], Outcome::Grant(_)));
        cache.complete_step(sid, epoch, Step(1), now).unwrap();
        cache.release(sid, epoch, &[SeqId(1)], None, now).unwrap();
        assert!(cache.take_evictions().is_empty());
        // other tokens need the blocks back: all four cached ones are evicted
        let second = cache
            .lease(sid, epoch, batch(2), &[spec(2, (101..=116).collect())], now)
            .unwrap();
        assert!(matches!(second[0], Outcome::Grant(_)), "{second:?}");
        let evicted = cache.take_evictions();
        let blocks: u64 = evicted.iter().map(|e| e.blocks).sum();
        assert!(blocks > 0, "{evicted:?}");
        assert!(
            evicted
                .iter()
                .all(|e| e.seq_id == SeqId(2) && e.pool_id == pool_id)
        );
        assert!(cache.take_evictions().is_empty());
    }
}
