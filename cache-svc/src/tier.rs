//! The host-memory tier of one pool: a second, larger set of blocks in the
//! worker's host memory that keeps cached prefix blocks the device pool had
//! to evict.
//!
//! The cache owns the tier's state; the worker only copies. A host block is
//! - **free**: in the free list;
//! - **pending**: the target of a demotion (device block -> host block) named
//!   in a response at some step; not matchable until that step completes, and
//!   dropped (back to free) if the holder cannot vouch that the copy ran;
//! - **cached**: its hash is published (matchable) and it is evictable;
//! - **pinned**: the source of onboarding copies (host block -> device
//!   block) whose step has not completed; not evictable.
//!
//! `free + pending + cached + pinned == total` after every call;
//! [`HostTier::check_invariants`] recounts from scratch. Every operation is
//! O(1) plus the eviction policy's own cost.
//!
//! Host eviction is plain recency (every block a leaf): the device evicts
//! leaves first, so a chain reaches the host child before parent and leaves
//! it in the same order, and a block whose parent was dropped is merely
//! unreachable until it ages out.
//!
//! The disk tier below the host is the same state machine over the worker's
//! block files ([`HostTier::disk`]): a host block the host tier evicts is
//! *spilled* (host block -> disk block, pending until its step completes),
//! a disk-cached prefix block is *loaded* (disk block -> device block,
//! pinned until its step completes), eviction is the same recency. Two
//! things only the disk has: [`HostTier::index_held`] publishes what a
//! restarted worker found in its files, and [`HostTier::invalidate`] drops
//! a block whose file a failed pass may have found bad.

use foldhash::{HashMap, HashMapExt};

use crate::events::{IndexEvent, Tier};
use crate::eviction::{EvictionPolicy, PriorityLru};
use crate::ids::BlockId;

/// A block id of the host tier (indexes the worker's host arena), or of
/// the disk tier (a block file's slot).
pub type HostBlockId = u32;

/// The state of one host block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HostState {
    /// In the free list.
    Free,
    /// Target of a demotion whose step has not completed.
    Pending,
    /// Published and evictable.
    Cached,
    /// Read by onboarding copies whose step has not completed.
    Pinned,
}

/// Figures of one host tier.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HostCounts {
    /// Host blocks (0: no tier).
    pub total: u32,
    /// In the free list.
    pub free: u32,
    /// Demotion targets waiting for their step.
    pub pending: u32,
    /// Published and evictable.
    pub cached: u32,
    /// Onboarding sources waiting for their step.
    pub pinned: u32,
}

/// A demotion the cache decided: copy device block `device` into host block
/// `host` before anything writes `device` again.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Demotion {
    /// The evicted device block (its K/V is still intact).
    pub device: BlockId,
    /// The host block that receives it.
    pub host: HostBlockId,
    /// The host block's generation (publication checks it).
    pub generation: u32,
    /// The content `host` held before (a cached block it evicted) kept on
    /// disk: the worker writes it before this demotion overwrites `host`.
    pub spill: Option<Spill>,
}

/// A spill the cache decided: write host block `host` (its published
/// content, `hash` after `parent`) to disk block `disk`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Spill {
    /// The host block read.
    pub host: HostBlockId,
    /// The disk block written.
    pub disk: HostBlockId,
    /// The disk block's generation (publication checks it).
    pub generation: u32,
    /// The content's hash.
    pub hash: u64,
    /// Its parent's hash.
    pub parent: u64,
}

#[derive(Clone, Copy, Debug, Default)]
struct Meta {
    /// Published hash (in `index`).
    hash: Option<u64>,
    /// Hash a pending demotion publishes.
    pending: Option<u64>,
    parent: u64,
    pins: u32,
    /// Bumped on every reservation, so stale references are recognised.
    generation: u32,
}

/// One pool's host tier (or disk tier, see [`HostTier::disk`]).
#[derive(Debug)]
pub struct HostTier {
    /// Which tier the events name.
    tier: Tier,
    meta: Vec<Meta>,
    free_list: Vec<HostBlockId>,
    index: HashMap<u64, HostBlockId>,
    eviction: Box<dyn EvictionPolicy>,
    counts: HostCounts,
    events: Vec<IndexEvent>,
}

impl HostTier {
    /// A tier of `num_blocks` free host blocks (0: no tier).
    pub fn new(num_blocks: u32) -> Self {
        Self::of_tier(Tier::Host, num_blocks)
    }

    /// A disk tier of `num_blocks` free disk blocks (0: no tier).
    pub fn disk(num_blocks: u32) -> Self {
        Self::of_tier(Tier::Disk, num_blocks)
    }

    fn of_tier(tier: Tier, num_blocks: u32) -> Self {
        Self {
            tier,
            meta: vec![Meta::default(); num_blocks as usize],
            free_list: (0..num_blocks).rev().collect(),
            index: HashMap::new(),
            eviction: Box::new(PriorityLru::new(num_blocks as usize)),
            counts: HostCounts {
                total: num_blocks,
                free: num_blocks,
                ..HostCounts::default()
            },
            events: Vec::new(),
        }
    }

    /// Current figures.
    pub fn counts(&self) -> HostCounts {
        self.counts
    }

    /// Host blocks (valid ids are `0..len`).
    pub fn len(&self) -> u32 {
        self.counts.total
    }

    /// Whether the pool has no host tier.
    pub fn is_empty(&self) -> bool {
        self.counts.total == 0
    }

    /// The state of `block`.
    pub fn state(&self, block: HostBlockId) -> HostState {
        Self::state_of(&self.meta[block as usize])
    }

    fn state_of(m: &Meta) -> HostState {
        if m.pins > 0 {
            HostState::Pinned
        } else if m.hash.is_some() {
            HostState::Cached
        } else if m.pending.is_some() {
            HostState::Pending
        } else {
            HostState::Free
        }
    }

    fn count_mut(&mut self, state: HostState) -> &mut u32 {
        match state {
            HostState::Free => &mut self.counts.free,
            HostState::Pending => &mut self.counts.pending,
            HostState::Cached => &mut self.counts.cached,
            HostState::Pinned => &mut self.counts.pinned,
        }
    }

    fn settle(&mut self, block: HostBlockId, before: HostState) {
        let after = self.state(block);
        if before == after {
            return;
        }
        *self.count_mut(before) -= 1;
        *self.count_mut(after) += 1;
        if before == HostState::Cached {
            self.eviction.remove(block);
        }
        match after {
            HostState::Cached => self.eviction.insert(block, 0, true),
            HostState::Free => self.free_list.push(block),
            HostState::Pending | HostState::Pinned => {}
        }
    }

    /// The published host block holding `hash`, if any.
    pub fn lookup(&self, hash: u64) -> Option<HostBlockId> {
        self.index.get(&hash).copied()
    }

    /// Readers (onboarding copies in flight) of `block`.
    pub fn pins(&self, block: HostBlockId) -> u32 {
        self.meta[block as usize].pins
    }

    /// The generation of `block`.
    pub fn generation(&self, block: HostBlockId) -> u32 {
        self.meta[block as usize].generation
    }

    /// Events of the host index since the last call.
    pub fn drain_events(&mut self) -> Vec<IndexEvent> {
        std::mem::take(&mut self.events)
    }

    /// Takes a host block to receive `hash` (a free one, else the least
    /// recently used cached one, whose hash leaves the tier), pending until
    /// [`HostTier::publish`]. `None` when every block is pending or pinned:
    /// the device block is then simply dropped.
    pub fn reserve(&mut self, hash: u64, parent: u64) -> Option<HostBlockId> {
        self.reserve_evicting(hash, parent).map(|(b, _)| b)
    }

    /// [`HostTier::reserve`], also naming what the block held when it was
    /// taken by evicting a cached one: `(hash, parent)` of that content,
    /// still intact in the block until the new content is copied in.
    pub fn reserve_evicting(
        &mut self,
        hash: u64,
        parent: u64,
    ) -> Option<(HostBlockId, Option<(u64, u64)>)> {
        let mut evicted = None;
        let block = match self.free_list.pop() {
            Some(b) => b,
            None => {
                let victim = self.eviction.pop_victim()?;
                let m = &mut self.meta[victim as usize];
                if let Some(h) = m.hash.take() {
                    evicted = Some((h, m.parent));
                    self.index.remove(&h);
                    self.events.push(IndexEvent::Removed {
                        hash: h,
                        tier: self.tier,
                    });
                }
                // The policy no longer holds it: count it free, then take it.
                self.counts.cached -= 1;
                self.counts.free += 1;
                victim
            }
        };
        let m = &mut self.meta[block as usize];
        debug_assert!(m.pins == 0 && m.hash.is_none() && m.pending.is_none());
        m.pending = Some(hash);
        m.parent = parent;
        m.generation = m.generation.wrapping_add(1);
        self.counts.free -= 1;
        self.counts.pending += 1;
        Some((block, evicted))
    }

    /// Publishes the pending demotion into `block` if it is still the
    /// reservation of `generation`. Returns whether a hash was published (a
    /// hash already on the host frees the block instead).
    pub fn publish(&mut self, block: HostBlockId, generation: u32) -> bool {
        let m = self.meta[block as usize];
        let Some(hash) = m.pending else {
            return false;
        };
        if m.generation != generation {
            return false;
        }
        let before = self.state(block);
        self.meta[block as usize].pending = None;
        if self.index.contains_key(&hash) {
            self.settle(block, before);
            return false;
        }
        self.meta[block as usize].hash = Some(hash);
        self.index.insert(hash, block);
        self.events.push(IndexEvent::Stored {
            hash,
            parent: m.parent,
            tier: self.tier,
        });
        self.settle(block, before);
        true
    }

    /// The published `(hash, parent)` of `block`, if any.
    pub fn content(&self, block: HostBlockId) -> Option<(u64, u64)> {
        let m = &self.meta[block as usize];
        m.hash.map(|h| (h, m.parent))
    }

    /// Publishes what a restarted worker found in its files: `(block,
    /// hash, parent)` each, into free blocks of an empty tier. A block out
    /// of range or not free, or a hash already indexed, is skipped; returns
    /// the blocks published.
    pub fn index_held(&mut self, held: &[(HostBlockId, u64, u64)]) -> u32 {
        let mut published = 0;
        for &(block, hash, parent) in held {
            if block >= self.counts.total
                || self.state(block) != HostState::Free
                || self.index.contains_key(&hash)
            {
                continue;
            }
            self.free_list.retain(|&b| b != block);
            let m = &mut self.meta[block as usize];
            m.generation = m.generation.wrapping_add(1);
            m.hash = Some(hash);
            m.parent = parent;
            self.index.insert(hash, block);
            self.events.push(IndexEvent::Stored {
                hash,
                parent,
                tier: self.tier,
            });
            self.counts.free -= 1;
            self.counts.cached += 1;
            self.eviction.insert(block, 0, true);
            published += 1;
        }
        published
    }

    /// Forgets the content of `block` (its hash leaves the index): it is
    /// never matched again, and free once no reader pins it. Returns whether
    /// a hash was dropped.
    pub fn invalidate(&mut self, block: HostBlockId) -> bool {
        let before = self.state(block);
        let Some(hash) = self.meta[block as usize].hash.take() else {
            return false;
        };
        self.index.remove(&hash);
        self.events.push(IndexEvent::Removed {
            hash,
            tier: self.tier,
        });
        self.settle(block, before);
        true
    }

    /// Forgets every published hash (the worker lost the content): cached
    /// blocks become free, pinned ones free after their last reader.
    /// Pending reservations stay (their holders publish or discard them).
    pub fn forget_all(&mut self) {
        for block in 0..self.counts.total {
            self.invalidate(block);
        }
    }

    /// Whether a session's copy waits on a block (pending or pinned).
    pub fn is_quiet(&self) -> bool {
        self.counts.pending == 0 && self.counts.pinned == 0
    }

    /// Drops the pending demotion into `block` (the copy may never have
    /// run): the block is free again. Ignored for a stale `generation`.
    pub fn discard(&mut self, block: HostBlockId, generation: u32) {
        let m = &self.meta[block as usize];
        if m.generation != generation || m.pending.is_none() {
            return;
        }
        let before = self.state(block);
        self.meta[block as usize].pending = None;
        self.settle(block, before);
    }

    /// Adds a reader (an onboarding copy) to a published block.
    pub fn pin(&mut self, block: HostBlockId) {
        let before = self.state(block);
        debug_assert!(matches!(before, HostState::Cached | HostState::Pinned));
        self.meta[block as usize].pins += 1;
        self.settle(block, before);
    }

    /// Drops one reader; the block is evictable again after the last.
    pub fn unpin(&mut self, block: HostBlockId) {
        let before = self.state(block);
        let m = &mut self.meta[block as usize];
        debug_assert!(m.pins > 0, "unpin of an unpinned host block");
        m.pins = m.pins.saturating_sub(1);
        self.settle(block, before);
    }

    /// Recounts every state from scratch and checks it against the running
    /// figures, the free list, the index and the eviction policy.
    pub fn check_invariants(&self) -> Result<(), String> {
        let mut c = HostCounts {
            total: self.meta.len() as u32,
            ..HostCounts::default()
        };
        for (id, m) in self.meta.iter().enumerate() {
            let id = id as HostBlockId;
            match Self::state_of(m) {
                HostState::Free => c.free += 1,
                HostState::Pending => c.pending += 1,
                HostState::Cached => {
                    c.cached += 1;
                    if !self.eviction.contains(id) {
                        return Err(format!("cached host block {id} is not evictable"));
                    }
                }
                HostState::Pinned => c.pinned += 1,
            }
            if m.hash.is_some() && m.pending.is_some() {
                return Err(format!("host block {id} is both published and pending"));
            }
            if let Some(h) = m.hash
                && self.index.get(&h) != Some(&id)
            {
                return Err(format!(
                    "host block {id} has hash {h:#x} missing from the index"
                ));
            }
        }
        if c != self.counts {
            return Err(format!("host counts {:?} != recount {c:?}", self.counts));
        }
        if c.free + c.pending + c.cached + c.pinned != c.total {
            return Err(format!("host conservation broken: {c:?}"));
        }
        if self.free_list.len() != c.free as usize {
            return Err(format!(
                "host free list holds {} blocks, {} are free",
                self.free_list.len(),
                c.free
            ));
        }
        if self.eviction.len() != c.cached as usize {
            return Err(format!(
                "host eviction holds {} blocks, {} are cached",
                self.eviction.len(),
                c.cached
            ));
        }
        for (&h, &b) in &self.index {
            if self.meta.get(b as usize).and_then(|m| m.hash) != Some(h) {
                return Err(format!("host index entry {h:#x} -> {b} is stale"));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pending_is_not_matchable_until_published() {
        let mut t = HostTier::new(2);
        let h = t.reserve(7, 0).unwrap();
        assert_eq!(t.state(h), HostState::Pending);
        assert_eq!(t.lookup(7), None, "a demotion in flight is never found");
        assert!(t.publish(h, t.generation(h)));
        assert_eq!(t.lookup(7), Some(h));
        t.check_invariants().unwrap();
    }

    #[test]
    fn discarded_demotion_frees_the_block_and_never_publishes() {
        let mut t = HostTier::new(1);
        let h = t.reserve(7, 0).unwrap();
        let generation = t.generation(h);
        t.discard(h, generation);
        assert_eq!(t.state(h), HostState::Free);
        assert!(!t.publish(h, generation));
        assert_eq!(t.lookup(7), None);
        t.check_invariants().unwrap();
    }

    #[test]
    fn full_tier_evicts_lru_and_pinned_or_pending_blocks_are_never_taken() {
        let mut t = HostTier::new(2);
        let a = t.reserve(1, 0).unwrap();
        let b = t.reserve(2, 0).unwrap();
        assert!(t.publish(a, t.generation(a)));
        // b pending, a cached: a new reservation evicts a.
        let c = t.reserve(3, 0).unwrap();
        assert_eq!(c, a);
        assert_eq!(t.lookup(1), None);
        assert!(t.publish(b, t.generation(b)));
        assert!(t.publish(c, t.generation(c)));
        t.pin(b);
        t.pin(c);
        assert_eq!(t.reserve(4, 0), None, "exhaustion is an answer");
        t.unpin(c);
        assert_eq!(t.reserve(4, 0), Some(c));
        t.check_invariants().unwrap();
        assert_eq!(
            t.counts(),
            HostCounts {
                total: 2,
                free: 0,
                pending: 1,
                cached: 0,
                pinned: 1
            }
        );
    }

    #[test]
    fn a_stale_generation_neither_publishes_nor_discards() {
        let mut t = HostTier::new(1);
        let h = t.reserve(1, 0).unwrap();
        let old = t.generation(h);
        t.discard(h, old);
        let h2 = t.reserve(2, 0).unwrap();
        assert_eq!(h, h2);
        t.discard(h, old);
        assert!(!t.publish(h, old));
        assert_eq!(t.state(h), HostState::Pending);
        assert!(t.publish(h, t.generation(h)));
        assert_eq!(t.lookup(2), Some(h));
        t.check_invariants().unwrap();
    }
}
