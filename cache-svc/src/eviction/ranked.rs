//! The policies, on one ordered structure: [`LeafFirst`] keeps the evictable
//! blocks in two ordered sets (leaves, and blocks with cached children), each
//! keyed by a [`Rank`]; a policy only decides the rank a block gets.

use std::collections::BTreeSet;
use std::fmt;

use super::{EvictionPolicy, MAX_PRIORITY};
use crate::ids::BlockId;

/// Eviction order: the smallest rank goes first.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord)]
struct Rank {
    priority: u8,
    /// The policy's credit (0 for LRU).
    credit: u64,
    /// When the block last became evictable; breaks ties, oldest first.
    stamp: u64,
}

const NOT_HELD: u8 = u8::MAX;
const LEAF: u8 = 0;
const PARENT: u8 = 1;

/// Evictable blocks by rank, leaves apart from parents. A block keeps its
/// rank when it moves between the two.
#[derive(Debug)]
struct LeafFirst {
    rank: Vec<Rank>,
    /// `LEAF`, `PARENT` or `NOT_HELD`, per block.
    tier: Vec<u8>,
    sets: [BTreeSet<(Rank, BlockId)>; 2],
    /// Stamps handed out so far.
    clock: u64,
}

impl LeafFirst {
    fn new(num_blocks: usize) -> Self {
        Self {
            rank: vec![Rank::default(); num_blocks],
            tier: vec![NOT_HELD; num_blocks],
            sets: [BTreeSet::new(), BTreeSet::new()],
            clock: 0,
        }
    }

    fn tier_of(&self, block: BlockId) -> Option<usize> {
        match self.tier.get(block as usize) {
            Some(&t) if t != NOT_HELD => Some(usize::from(t)),
            _ => None,
        }
    }

    /// Holds `block` (again) as the most recent of its `priority` and
    /// `credit`. Stamps go in steps of 2, so that a kept partial block can
    /// rank between the two most recent releases ([`Self::insert_partial`]).
    fn insert(&mut self, block: BlockId, priority: u8, credit: u64, leaf: bool) {
        self.clock += 2;
        self.hold(block, priority, credit, leaf, self.clock);
    }

    /// Holds `block`, a kept partial block, as released just before the
    /// most recent release.
    fn insert_partial(&mut self, block: BlockId, priority: u8, credit: u64) {
        let stamp = self.clock.saturating_sub(1);
        self.hold(block, priority, credit, true, stamp);
    }

    fn hold(&mut self, block: BlockId, priority: u8, credit: u64, leaf: bool, stamp: u64) {
        let Some(slot) = self.tier.get(block as usize) else {
            debug_assert!(false, "block {block} is outside the pool");
            return;
        };
        if *slot != NOT_HELD {
            self.remove(block);
        }
        let rank = Rank {
            priority: priority.min(MAX_PRIORITY),
            credit,
            stamp,
        };
        let tier = if leaf { LEAF } else { PARENT };
        self.rank[block as usize] = rank;
        self.tier[block as usize] = tier;
        self.sets[usize::from(tier)].insert((rank, block));
    }

    fn remove(&mut self, block: BlockId) -> bool {
        let Some(tier) = self.tier_of(block) else {
            return false;
        };
        self.sets[tier].remove(&(self.rank[block as usize], block));
        self.tier[block as usize] = NOT_HELD;
        true
    }

    fn set_leaf(&mut self, block: BlockId, leaf: bool) {
        let Some(tier) = self.tier_of(block) else {
            return;
        };
        let want = if leaf { LEAF } else { PARENT };
        if tier == usize::from(want) {
            return;
        }
        let entry = (self.rank[block as usize], block);
        self.sets[tier].remove(&entry);
        self.sets[usize::from(want)].insert(entry);
        self.tier[block as usize] = want;
    }

    fn pop(&mut self) -> Option<(BlockId, Rank)> {
        let (rank, block) = self.sets.iter_mut().find_map(|set| set.pop_first())?;
        self.tier[block as usize] = NOT_HELD;
        Some((block, rank))
    }

    /// The rank of the block [`Self::pop`] would take next.
    fn peek(&self) -> Option<Rank> {
        self.sets
            .iter()
            .find_map(|set| set.first())
            .map(|&(rank, _)| rank)
    }

    fn contains(&self, block: BlockId) -> bool {
        self.tier_of(block).is_some()
    }

    fn rank_of(&self, block: BlockId) -> Option<Rank> {
        self.tier_of(block).map(|_| self.rank[block as usize])
    }

    fn len(&self) -> usize {
        self.sets[0].len() + self.sets[1].len()
    }
}

// === impl Ranked ===

/// What a policy decides: the credit (class or value) a block gets when it
/// becomes evictable, and what it learns from the pool's hooks.
pub(super) trait Ranker: Send + fmt::Debug {
    /// The credit of `block` released now (lower goes first).
    fn credit(&self, block: BlockId) -> u64;
    /// `block` was evicted; its history ends. `clock` is how far the
    /// eviction moves the policy's clock (an aging policy's age): the
    /// victim's credit when the policy chose it, at most the credit of its
    /// own next victim when another policy sharing the pool did
    /// ([`EvictionPolicy::evicted`]).
    fn evicted(&mut self, block: BlockId, clock: u64) {
        let _ = (block, clock);
    }
    /// See [`EvictionPolicy::published`].
    fn published(&mut self, block: BlockId, hash: u64, parent: Option<BlockId>) {
        let _ = (block, hash, parent);
    }
    /// See [`EvictionPolicy::reused`].
    fn reused(&mut self, block: BlockId) {
        let _ = block;
    }
    /// The credit of a kept partial block released now: that of a block
    /// never reused.
    fn partial_credit(&self) -> u64 {
        0
    }
}

/// A leaf-first policy whose order within a priority is its ranker's credit,
/// then recency.
#[derive(Debug)]
pub struct Ranked<R> {
    blocks: LeafFirst,
    ranker: R,
}

impl<R: Ranker> EvictionPolicy for Ranked<R> {
    fn insert(&mut self, block: BlockId, priority: u8, leaf: bool) {
        let credit = self.ranker.credit(block);
        self.blocks.insert(block, priority, credit, leaf);
    }

    fn insert_partial(&mut self, block: BlockId, priority: u8) {
        let credit = self.ranker.partial_credit();
        self.blocks.insert_partial(block, priority, credit);
    }

    fn remove(&mut self, block: BlockId) {
        self.blocks.remove(block);
    }

    fn set_leaf(&mut self, block: BlockId, leaf: bool) {
        // The block keeps its own rank (recency included) in its new tier.
        self.blocks.set_leaf(block, leaf);
    }

    fn pop_victim(&mut self) -> Option<BlockId> {
        let (block, rank) = self.blocks.pop()?;
        self.ranker.evicted(block, rank.credit);
        Some(block)
    }

    fn evicted(&mut self, block: BlockId) {
        if let Some(rank) = self.blocks.rank_of(block) {
            self.blocks.remove(block);
            // Another policy chose this victim, not by this one's credit:
            // the eviction moves the clock only as far as this policy's own
            // choice would have. Moving it to the victim's credit (a block
            // this policy valued, say) put every held block below the age
            // at once, so the frequencies `lfu` had learnt were gone when an
            // adaptive pool switched to it (issue 28).
            let own = self.blocks.peek().map_or(rank.credit, |next| next.credit);
            self.ranker.evicted(block, rank.credit.min(own));
        }
    }

    fn next_victims(&self, k: usize, out: &mut Vec<BlockId>) {
        let order = self.blocks.sets.iter().flat_map(|set| set.iter());
        out.extend(order.take(k).map(|&(_, block)| block));
    }

    fn ranks_low(&self, block: BlockId) -> bool {
        match (self.blocks.rank_of(block), self.blocks.peek()) {
            (Some(rank), Some(next)) => {
                (rank.priority, rank.credit) <= (next.priority, next.credit)
            }
            _ => true,
        }
    }

    fn contains(&self, block: BlockId) -> bool {
        self.blocks.contains(block)
    }

    fn len(&self) -> usize {
        self.blocks.len()
    }

    fn published(&mut self, block: BlockId, hash: u64, parent: Option<BlockId>) {
        self.ranker.published(block, hash, parent);
    }

    fn reused(&mut self, block: BlockId) {
        self.ranker.reused(block);
    }
}

impl<R> Ranked<R> {
    pub(super) fn with_ranker(num_blocks: usize, ranker: R) -> Self {
        Self {
            blocks: LeafFirst::new(num_blocks),
            ranker,
        }
    }

    /// The policy's own state, for its tests.
    #[cfg(test)]
    pub(super) fn ranker(&self) -> &R {
        &self.ranker
    }
}

// === impl PriorityLru ===

/// Recency alone: every block gets the same credit.
#[derive(Debug)]
pub struct Recency;

impl Ranker for Recency {
    fn credit(&self, _block: BlockId) -> u64 {
        0
    }
}

/// Leaf-first LRU within retention priorities: leaves before parents, then
/// the lowest priority, then the least recently released.
pub type PriorityLru = Ranked<Recency>;

impl PriorityLru {
    /// A policy for a pool of `num_blocks` blocks.
    pub fn new(num_blocks: usize) -> Self {
        Self::with_ranker(num_blocks, Recency)
    }
}

// === impl GreedyDual ===

/// Credit units per use, so the aging (which moves in whole credits) has
/// room below one use.
const SCALE: u64 = 16;

/// LFU with dynamic aging (GreedyDual-Frequency): a block released now gets
/// the credit `age + (1 + uses) * SCALE`; evicting a block raises `age` to its
/// credit. Blocks that stop being used sink below fresh ones however often
/// they were used.
#[derive(Debug)]
pub struct Frequency {
    age: u64,
    /// Prefix hits on each block since it was published.
    uses: Vec<u32>,
}

/// LFU with dynamic aging, leaf first (see [`Frequency`]).
pub type GreedyDual = Ranked<Frequency>;

impl GreedyDual {
    /// A policy for a pool of `num_blocks` blocks.
    pub fn new(num_blocks: usize) -> Self {
        Self::with_ranker(
            num_blocks,
            Frequency {
                age: 0,
                uses: vec![0; num_blocks],
            },
        )
    }
}

impl Frequency {
    fn forget(&mut self, block: BlockId) {
        if let Some(u) = self.uses.get_mut(block as usize) {
            *u = 0;
        }
    }
}

impl Ranker for Frequency {
    fn credit(&self, block: BlockId) -> u64 {
        let uses = u64::from(self.uses.get(block as usize).copied().unwrap_or(0));
        self.age + (1 + uses) * SCALE
    }

    fn evicted(&mut self, block: BlockId, clock: u64) {
        self.age = self.age.max(clock);
        self.forget(block);
    }

    fn published(&mut self, block: BlockId, _hash: u64, _parent: Option<BlockId>) {
        self.forget(block);
    }

    fn partial_credit(&self) -> u64 {
        self.age + SCALE
    }

    fn reused(&mut self, block: BlockId) {
        if let Some(u) = self.uses.get_mut(block as usize) {
            *u = u.saturating_add(1);
        }
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
    fn a_kept_partial_block_ranks_just_before_the_latest_release() {
        for kind in crate::eviction::PolicyKind::ALL {
            let mut p = kind.build(8);
            p.published(0, 10, None);
            p.published(1, 11, Some(0));
            p.insert(0, 5, false);
            p.insert(1, 5, true); // the latest release
            p.insert_partial(2, 5); // released with it
            p.published(3, 13, None);
            p.insert(3, 5, true); // a later release
            assert_eq!(p.pop_victim(), Some(2), "{kind}");
        }
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

    #[test]
    fn a_parent_that_becomes_a_leaf_keeps_its_own_recency() {
        let mut p = PriorityLru::new(8);
        p.insert(0, 5, false); // parent of 2, released first
        p.insert(1, 5, true);
        p.insert(2, 5, true); // child of 0
        p.insert(3, 5, true);
        p.remove(1);
        p.insert(1, 5, true); // 1 is now the most recent
        // Evicting 2 makes 0 a leaf; it is older than 3 and 1, so it goes
        // next (the old re-queue made it the most recent and kept it longest).
        p.remove(2);
        p.set_leaf(0, true);
        assert_eq!(p.pop_victim(), Some(0));
        assert_eq!(p.pop_victim(), Some(3));
        assert_eq!(p.pop_victim(), Some(1));
    }

    #[test]
    fn a_victim_another_policy_chose_does_not_age_away_what_lfu_learnt() {
        let mut p = GreedyDual::new(8);
        for b in 0..4 {
            p.published(b, b.into(), None);
        }
        for _ in 0..10 {
            p.reused(0); // credit 11 uses
        }
        p.reused(1);
        p.reused(1); // credit 3 uses
        for b in 0..3 {
            p.insert(b, 5, true); // block 2: credit 1 use
        }
        // An adaptive pool following `lru` evicts block 0, the one `lfu`
        // valued most: the age moves only to what `lfu` would have evicted
        // (block 2's credit), not to block 0's 11 uses.
        p.evicted(0);
        assert!(!p.contains(0));
        p.insert(3, 5, true); // fresh: age + 1 use
        // So block 1, used twice, still outranks a fresh block (with the
        // age at 11 uses the fresh one would outrank it), and block 2 goes
        // first.
        assert_eq!(p.pop_victim(), Some(2));
        assert_eq!(p.pop_victim(), Some(3));
        assert_eq!(p.pop_victim(), Some(1));
        // Its own victims move the age to their credit, as before.
        assert_eq!(p.ranker().age, 3 * SCALE);
    }

    #[test]
    fn greedy_dual_keeps_used_blocks_until_age_catches_up() {
        let mut p = GreedyDual::new(8);
        for b in 0..3 {
            p.published(b, b.into(), None);
        }
        p.reused(0);
        p.reused(0);
        p.insert(0, 5, true); // value 3
        p.insert(1, 5, true); // value 1
        p.insert(2, 5, true); // value 1
        assert_eq!(p.pop_victim(), Some(1));
        assert_eq!(p.pop_victim(), Some(2));
        // Age is now 1 use: a fresh block (credit 2 uses) still loses to
        // block 0 (3 uses) ...
        p.published(3, 3, None);
        p.insert(3, 5, true);
        assert_eq!(p.pop_victim(), Some(3));
        // ... but after more evictions the age passes it and a block with
        // one use released now outranks it.
        p.published(4, 4, None);
        p.reused(4);
        p.insert(4, 5, true); // 2 uses of age + 2 uses
        assert_eq!(p.pop_victim(), Some(0));
        assert_eq!(p.pop_victim(), Some(4));
    }
}
