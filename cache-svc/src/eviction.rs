//! Which cached block to evict next.
//!
//! A cached block (released, full, hashed, refcount 0) stays reusable until the
//! pool needs its slot. The [`EvictionPolicy`] trait keeps that choice
//! swappable; [`PriorityLru`] is the first policy: lowest retention priority
//! first, then least recently used, and leaves of the prefix tree before their
//! parents (evicting a parent first would strand its cached children, which are
//! only reachable through it). Every operation is O(1).

use std::fmt;

use crate::pool::BlockId;

/// Retention priorities run from 0 (evict first) to this value (keep longest).
pub const MAX_PRIORITY: u8 = 100;

/// The eviction bookkeeping of one pool. Implementations hold only block ids;
/// the pool owns the blocks.
pub trait EvictionPolicy: Send + fmt::Debug {
    /// `block` became evictable (most recently used now).
    fn insert(&mut self, block: BlockId, priority: u8, leaf: bool);
    /// `block` is no longer evictable (reused, or evicted by the pool).
    fn remove(&mut self, block: BlockId);
    /// `block`'s leaf status changed while it is evictable.
    fn set_leaf(&mut self, block: BlockId, leaf: bool);
    /// The block to evict next, removed from the policy.
    fn pop_victim(&mut self) -> Option<BlockId>;
    /// Whether `block` is held by the policy.
    fn contains(&self, block: BlockId) -> bool;
    /// Evictable blocks.
    fn len(&self) -> usize;
    /// Whether no block is evictable.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

const NONE: u32 = u32::MAX;
const LEVELS: usize = MAX_PRIORITY as usize + 1;
/// Tier 0 holds leaves, tier 1 blocks with cached children.
const TIERS: usize = 2;

/// Priority buckets of intrusive LRU lists, one set per tier, with a bitmap of
/// non-empty buckets so the victim is found with two `trailing_zeros`.
#[derive(Debug)]
pub struct PriorityLru {
    prev: Vec<u32>,
    next: Vec<u32>,
    /// Bucket index of each block, or `NONE` when not held.
    bucket_of: Vec<u32>,
    /// Least recently used end of each bucket.
    head: Vec<u32>,
    /// Most recently used end of each bucket.
    tail: Vec<u32>,
    /// Non-empty buckets, per tier, bit i = priority i.
    nonempty: [[u64; 2]; TIERS],
    len: usize,
}

impl PriorityLru {
    /// A policy for a pool of `num_blocks` blocks.
    pub fn new(num_blocks: usize) -> Self {
        Self {
            prev: vec![NONE; num_blocks],
            next: vec![NONE; num_blocks],
            bucket_of: vec![NONE; num_blocks],
            head: vec![NONE; LEVELS * TIERS],
            tail: vec![NONE; LEVELS * TIERS],
            nonempty: [[0; 2]; TIERS],
            len: 0,
        }
    }

    fn bucket(priority: u8, leaf: bool) -> usize {
        let tier = usize::from(!leaf);
        tier * LEVELS + usize::from(priority.min(MAX_PRIORITY))
    }

    fn push_back(&mut self, block: BlockId, bucket: usize) {
        let b = block as usize;
        let tail = self.tail[bucket];
        self.prev[b] = tail;
        self.next[b] = NONE;
        if tail == NONE {
            self.head[bucket] = block;
            let (tier, level) = (bucket / LEVELS, bucket % LEVELS);
            self.nonempty[tier][level / 64] |= 1 << (level % 64);
        } else {
            self.next[tail as usize] = block;
        }
        self.tail[bucket] = block;
        self.bucket_of[b] = bucket as u32;
        self.len += 1;
    }

    fn unlink(&mut self, block: BlockId) -> Option<usize> {
        let b = block as usize;
        let bucket = *self.bucket_of.get(b)?;
        if bucket == NONE {
            return None;
        }
        let bucket = bucket as usize;
        let (prev, next) = (self.prev[b], self.next[b]);
        if prev == NONE {
            self.head[bucket] = next;
        } else {
            self.next[prev as usize] = next;
        }
        if next == NONE {
            self.tail[bucket] = prev;
        } else {
            self.prev[next as usize] = prev;
        }
        if self.head[bucket] == NONE {
            let (tier, level) = (bucket / LEVELS, bucket % LEVELS);
            self.nonempty[tier][level / 64] &= !(1 << (level % 64));
        }
        self.bucket_of[b] = NONE;
        self.len -= 1;
        Some(bucket)
    }
}

impl EvictionPolicy for PriorityLru {
    fn insert(&mut self, block: BlockId, priority: u8, leaf: bool) {
        self.unlink(block);
        self.push_back(block, Self::bucket(priority, leaf));
    }

    fn remove(&mut self, block: BlockId) {
        self.unlink(block);
    }

    fn set_leaf(&mut self, block: BlockId, leaf: bool) {
        // Moving tiers keeps the block's place in recency only approximately
        // (it becomes the most recent of its new bucket); that is the cheap
        // O(1) choice and errs towards keeping it.
        if let Some(bucket) = self.unlink(block) {
            let priority = (bucket % LEVELS) as u8;
            self.push_back(block, Self::bucket(priority, leaf));
        }
    }

    fn pop_victim(&mut self) -> Option<BlockId> {
        for tier in 0..TIERS {
            let bits = self.nonempty[tier];
            let level = if bits[0] != 0 {
                bits[0].trailing_zeros() as usize
            } else if bits[1] != 0 {
                64 + bits[1].trailing_zeros() as usize
            } else {
                continue;
            };
            let victim = self.head[tier * LEVELS + level];
            self.unlink(victim);
            return Some(victim);
        }
        None
    }

    fn contains(&self, block: BlockId) -> bool {
        self.bucket_of
            .get(block as usize)
            .is_some_and(|&b| b != NONE)
    }

    fn len(&self) -> usize {
        self.len
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lowest_priority_then_least_recent() {
        let mut p = PriorityLru::new(8);
        p.insert(0, 50, true);
        p.insert(1, 10, true);
        p.insert(2, 10, true);
        p.insert(3, 90, true);
        assert_eq!(p.pop_victim(), Some(1));
        assert_eq!(p.pop_victim(), Some(2));
        assert_eq!(p.pop_victim(), Some(0));
        assert_eq!(p.pop_victim(), Some(3));
        assert_eq!(p.pop_victim(), None);
    }

    #[test]
    fn leaves_before_parents_whatever_the_priority() {
        let mut p = PriorityLru::new(8);
        p.insert(0, 0, false); // a parent, lowest priority
        p.insert(1, 100, true); // a leaf, highest priority
        assert_eq!(p.pop_victim(), Some(1));
        assert_eq!(p.pop_victim(), Some(0));
    }

    #[test]
    fn reinsert_moves_to_most_recent_and_remove_forgets() {
        let mut p = PriorityLru::new(8);
        p.insert(0, 5, true);
        p.insert(1, 5, true);
        p.insert(0, 5, true);
        assert_eq!(p.len(), 2);
        p.remove(1);
        assert!(!p.contains(1));
        assert_eq!(p.pop_victim(), Some(0));
        assert!(p.is_empty());
    }

    #[test]
    fn set_leaf_moves_tier() {
        let mut p = PriorityLru::new(4);
        p.insert(0, 3, false);
        p.insert(1, 7, true);
        p.set_leaf(0, true);
        assert_eq!(p.pop_victim(), Some(0));
        assert_eq!(p.pop_victim(), Some(1));
    }
}
