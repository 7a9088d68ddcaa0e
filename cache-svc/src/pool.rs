//! One pool of KV blocks: their states, the free list, the prefix-hash index
//! and the eviction policy.
//!
//! A block's state follows from two counters and its hash:
//! - `refcount > 0`: **in use** (one writer, or several readers of a full,
//!   shared prefix block);
//! - else `fenced > 0`: **fenced** (released, but a forward pass that may still
//!   read it has not been reported complete);
//! - else a published hash: **cached** (evictable, reusable by prefix);
//! - else **free**.
//!
//! `free + cached + in_use + fenced == total` holds after every public call;
//! [`BlockPool::check_invariants`] recounts from scratch.
//!
//! Hashes are *pending* from the lease that will write the block until the
//! holder reports that step complete; only then are they published (indexed
//! and reusable), so nobody reuses KV that was never written.
//!
//! A released sequence's last, partly filled block may be kept too (see
//! `partial`): it is then *cached* like a published block (evictable, a
//! leaf), found by its parent's hash and its token ids rather than by a hash
//! of its own, and only ever read by a copy, never shared.

use std::time::Instant;

use foldhash::{HashMap, HashMapExt};

pub use crate::events::{IndexEvent, Tier};
use crate::eviction::{EvictionPolicy, PriorityLru};
use crate::mrc::{HitRateEstimate, MissRatioCurve};
use crate::partial::PartialIndex;
use crate::retention::Retention;
use crate::tier::{Demotion, HostTier, Spill};

pub use crate::ids::BlockId;
use crate::ids::{SeqId, SessionId};

/// Who last held a block, for the leak audit's log.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Holder {
    /// Session id (0: none).
    pub session: SessionId,
    /// Sequence id within the session.
    pub seq: SeqId,
}

/// The state of one block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BlockState {
    /// In the free list.
    Free,
    /// Released, hashed and evictable.
    Cached,
    /// Held by one or more sequences.
    InUse,
    /// Released under a fence that has not completed.
    Fenced,
}

#[derive(Clone, Copy, Debug, Default)]
struct Meta {
    refcount: u32,
    fenced: u32,
    /// Published hash (present in `index`).
    hash: Option<u64>,
    /// Hash that becomes published when the writing step completes.
    pending: Option<u64>,
    parent: u64,
    /// Published blocks of this pool whose parent is this block's hash.
    children: u32,
    /// A published partly filled block (in `BlockPool::partials`).
    partial: bool,
    /// A pending partly filled block (in `BlockPool::partials`); a flag, so
    /// that freeing a block costs no lookup.
    partial_pending: bool,
    priority: u8,
    /// Bumped on every allocation, so stale references are recognised.
    generation: u32,
    last_holder: Holder,
}

/// Figures of one pool.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PoolCounts {
    /// Blocks in the pool.
    pub total: u32,
    /// In the free list.
    pub free: u32,
    /// Cached and evictable.
    pub cached: u32,
    /// Held by sequences.
    pub in_use: u32,
    /// Parked behind fences.
    pub fenced: u32,
}

impl PoolCounts {
    /// Blocks an allocation can take now (free or by evicting a cached one).
    pub fn available(&self) -> u32 {
        self.free + self.cached
    }
}

/// Monotonic counters of one pool.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PoolCounters {
    /// Sequences granted blocks.
    pub grants: u64,
    /// Sequences rejected by this pool.
    pub rejects: u64,
    /// Cached blocks evicted to make room.
    pub evictions: u64,
    /// Prompt blocks looked up in the index (warm-up excluded).
    pub reuse_lookups: u64,
    /// Prompt blocks found in the index (warm-up excluded).
    pub reuse_hits: u64,
    /// Blocks the leak audit reclaimed.
    pub leaks_reclaimed: u64,
    /// Blocks handed out for writing (free or evicted).
    pub allocations: u64,
    /// Evicted device blocks demoted to the host tier (copy named).
    pub demotions: u64,
    /// Prompt blocks onboarded from the host tier (warm-up excluded).
    pub onboards: u64,
    /// Demotions dropped before publication (the copy was not vouched for).
    pub demotions_dropped: u64,
    /// Blocks forks took by reference from their parents.
    pub fork_shared: u64,
    /// Partial-block copies granted to forks (copy on write).
    pub fork_copies: u64,
    /// Blocks granted by hand-offs, to be pulled from the prefill group.
    pub handoff_blocks: u64,
    /// Evicted host blocks spilled to the disk tier (copy named).
    pub spills: u64,
    /// Prompt blocks loaded from the disk tier (warm-up excluded; also in
    /// `onboards`).
    pub loads: u64,
    /// Disk blocks dropped from the index after a failed pass loaded them.
    pub disk_invalidated: u64,
}

/// One pool of blocks.
#[derive(Debug)]
pub struct BlockPool {
    meta: Vec<Meta>,
    free_list: Vec<BlockId>,
    index: HashMap<u64, BlockId>,
    eviction: Box<dyn EvictionPolicy>,
    counts: PoolCounts,
    /// Counters since start.
    pub counters: PoolCounters,
    events: Vec<IndexEvent>,
    mrc: MissRatioCurve,
    partials: PartialIndex,
    /// Blocks under retention hints: evicted only after the policy's.
    retention: Retention,
    /// The host tier (no blocks: none).
    host: HostTier,
    /// The disk tier below the host (no blocks: none).
    disk: HostTier,
    /// Demotions decided by evictions since the caller last took them.
    demotions: Vec<Demotion>,
}

impl BlockPool {
    /// A pool of `num_blocks` free blocks evicting with `lru`.
    pub fn new(num_blocks: u32) -> Self {
        Self::with_policy(num_blocks, Box::new(PriorityLru::new(num_blocks as usize)))
    }

    /// A pool with the given eviction policy (sized for `num_blocks`).
    pub fn with_policy(num_blocks: u32, eviction: Box<dyn EvictionPolicy>) -> Self {
        Self {
            meta: vec![Meta::default(); num_blocks as usize],
            // Pop order 0, 1, 2, ... makes tests and traces easy to read.
            free_list: (0..num_blocks).rev().collect(),
            index: HashMap::new(),
            eviction,
            counts: PoolCounts {
                total: num_blocks,
                free: num_blocks,
                ..PoolCounts::default()
            },
            counters: PoolCounters::default(),
            events: Vec::new(),
            mrc: MissRatioCurve::new(num_blocks),
            partials: PartialIndex::new(),
            retention: Retention::new(num_blocks as usize, 0),
            host: HostTier::new(0),
            disk: HostTier::disk(0),
            demotions: Vec::new(),
        }
    }

    /// Gives the pool a host tier of `host_blocks` (replacing an empty one).
    pub fn with_host_tier(mut self, host_blocks: u32) -> Self {
        self.host = HostTier::new(host_blocks);
        self
    }

    /// Lets each tenant hold up to `quota` blocks of this pool under
    /// retention hints (none by default).
    pub fn with_retention_quota(mut self, quota: u32) -> Self {
        self.retention = Retention::new(self.meta.len(), quota);
        self
    }

    /// The pool's retention hints.
    pub fn retention(&self) -> &Retention {
        &self.retention
    }

    /// Puts `block` (held by the caller) under `tenant`'s retention hint
    /// until `expires` (see [`crate::retention`]). Returns whether it counted
    /// as a new block of the tenant's quota (the caller checks the room
    /// first).
    pub fn hint(&mut self, block: BlockId, tenant: &str, priority: u8, expires: Instant) -> bool {
        debug_assert!(self.state(block) != BlockState::Cached);
        self.retention.hint(block, tenant, priority, expires)
    }

    /// Drops the retention hints that expired by `now`: their evictable
    /// blocks go to the eviction policy (as released now).
    pub fn expire_hints(&mut self, now: Instant) {
        for (block, leaf) in self.retention.expire(now) {
            let m = &self.meta[block as usize];
            if m.partial {
                self.eviction.insert_partial(block, m.priority);
            } else {
                self.eviction.insert(block, m.priority, leaf);
            }
        }
    }

    /// The host tier (empty when the pool has none).
    pub fn host(&self) -> &HostTier {
        &self.host
    }

    /// The host tier, to pin, unpin, publish or discard its blocks.
    pub fn host_mut(&mut self) -> &mut HostTier {
        &mut self.host
    }

    /// The disk tier (empty when the pool has none).
    pub fn disk(&self) -> &HostTier {
        &self.disk
    }

    /// Replaces the disk tier (a new worker incarnation's).
    pub fn set_disk_tier(&mut self, disk: HostTier) {
        self.disk = disk;
    }

    /// The host or disk tier (`Tier::Device` is not a tier of its own: the
    /// host's is answered).
    pub fn tier(&self, tier: Tier) -> &HostTier {
        match tier {
            Tier::Disk => &self.disk,
            Tier::Device | Tier::Host => &self.host,
        }
    }

    /// [`BlockPool::tier`], to pin, unpin, publish or discard its blocks.
    pub fn tier_mut(&mut self, tier: Tier) -> &mut HostTier {
        match tier {
            Tier::Disk => &mut self.disk,
            Tier::Device | Tier::Host => &mut self.host,
        }
    }

    /// Forgets every published hash of the device and the host tier (the
    /// worker restarted and lost that memory): cached blocks become free,
    /// held ones are never matched again. Pending hashes of held blocks stay
    /// (their holder's step publishes or discards them).
    pub fn forget_memory(&mut self) {
        for block in 0..self.counts.total {
            let m = &self.meta[block as usize];
            if m.hash.is_none() && !m.partial {
                continue;
            }
            let before = self.state(block);
            // a cached block leaves the policy and turns free, as evicted
            self.unpublish(block);
            self.settle(block, before);
        }
        self.host.forget_all();
    }

    /// Demotions decided since the last call, in the order the worker must
    /// apply them.
    pub fn take_demotions(&mut self) -> Vec<Demotion> {
        std::mem::take(&mut self.demotions)
    }

    /// Current figures.
    pub fn counts(&self) -> PoolCounts {
        self.counts
    }

    /// The state of `block`.
    pub fn state(&self, block: BlockId) -> BlockState {
        Self::state_of(&self.meta[block as usize])
    }

    fn state_of(m: &Meta) -> BlockState {
        if m.refcount > 0 {
            BlockState::InUse
        } else if m.fenced > 0 {
            BlockState::Fenced
        } else if m.hash.is_some() || m.partial {
            BlockState::Cached
        } else {
            BlockState::Free
        }
    }

    /// Number of blocks (valid ids are `0..len`).
    pub fn len(&self) -> u32 {
        self.counts.total
    }

    /// Whether the pool has no blocks.
    pub fn is_empty(&self) -> bool {
        self.counts.total == 0
    }

    /// The generation of `block` (changes on every allocation).
    pub fn generation(&self, block: BlockId) -> u32 {
        self.meta[block as usize].generation
    }

    /// Feeds the miss-ratio curve one request's looked-up chain.
    pub fn observe_lookups(&mut self, chain: &[u64]) {
        self.mrc.observe(chain);
        self.eviction.observe(chain);
    }

    /// The choice of an adaptive eviction policy (None for a fixed one).
    pub fn adaptive(&self) -> Option<crate::eviction::AdaptiveState> {
        self.eviction.adaptive()
    }

    /// Eviction policy switches since the last call.
    pub fn take_policy_switches(&mut self) -> Vec<crate::eviction::Switch> {
        self.eviction.take_switches()
    }

    /// Estimated hit rates at other sizes of this pool.
    pub fn hit_rate_estimates(&self) -> Vec<HitRateEstimate> {
        self.mrc.estimates()
    }

    /// Events of the prefix index since the last call.
    pub fn drain_events(&mut self) -> Vec<IndexEvent> {
        let mut events = std::mem::take(&mut self.events);
        events.extend(self.host.drain_events());
        events.extend(self.disk.drain_events());
        events
    }

    /// Who last held `block`.
    pub fn last_holder(&self, block: BlockId) -> Holder {
        self.meta[block as usize].last_holder
    }

    /// The published block holding `hash`, if any.
    pub fn lookup(&self, hash: u64) -> Option<BlockId> {
        self.index.get(&hash).copied()
    }

    /// The kept partly filled block after the full block `parent` (with
    /// `salt`) whose leading token ids match the most of `tokens`, and how
    /// many match (at least one).
    pub fn lookup_partial(&self, parent: u64, salt: u64, tokens: &[u32]) -> Option<(BlockId, u32)> {
        self.partials.find(parent, salt, tokens)
    }

    /// Partly filled blocks kept (cached) now.
    pub fn partial_blocks(&self) -> usize {
        self.partials.published()
    }

    // === state changes ===

    fn count_mut(&mut self, state: BlockState) -> &mut u32 {
        match state {
            BlockState::Free => &mut self.counts.free,
            BlockState::Cached => &mut self.counts.cached,
            BlockState::InUse => &mut self.counts.in_use,
            BlockState::Fenced => &mut self.counts.fenced,
        }
    }

    /// Moves the bookkeeping of `block` from state `before` to its current
    /// state: counts, free list and eviction membership.
    fn settle(&mut self, block: BlockId, before: BlockState) {
        let m = &self.meta[block as usize];
        if m.refcount == 0 && m.fenced == 0 {
            // Nobody will write it: an unpublished hash can never be trusted.
            self.discard_pending(block);
        }
        let m = &self.meta[block as usize];
        let after = Self::state_of(m);
        let (priority, leaf, partial) = (m.priority, m.children == 0, m.partial);
        if before == after {
            return;
        }
        *self.count_mut(before) -= 1;
        *self.count_mut(after) += 1;
        if before == BlockState::Cached {
            if self.retention.holds(block) {
                self.retention.unhold(block);
            } else {
                self.eviction.remove(block);
            }
        }
        match after {
            BlockState::Cached if self.retention.is_hinted(block) => {
                self.retention.hold(block, leaf)
            }
            BlockState::Cached if partial => self.eviction.insert_partial(block, priority),
            BlockState::Cached => self.eviction.insert(block, priority, leaf),
            BlockState::Free => {
                self.retention.forget(block);
                self.free_list.push(block);
            }
            BlockState::InUse | BlockState::Fenced => {}
        }
    }

    /// Takes a block for writing: from the free list, else by evicting a
    /// cached block. `None` when neither is left (the caller checks capacity
    /// first, so this is a defect path, never a panic).
    pub fn allocate(&mut self, holder: Holder, priority: u8) -> Option<BlockId> {
        let block = match self.free_list.pop() {
            Some(b) => b,
            None => {
                // hinted blocks only once the policy has none left
                let victim = match self.eviction.pop_victim() {
                    Some(v) => v,
                    None => self.retention.pop_victim()?,
                };
                self.demote(victim);
                // The policy no longer holds it; settle() must not remove it again.
                self.unpublish(victim);
                self.counters.evictions += 1;
                self.counts.cached -= 1;
                self.counts.free += 1;
                victim
            }
        };
        let m = &mut self.meta[block as usize];
        debug_assert!(m.refcount == 0 && m.fenced == 0 && m.hash.is_none() && !m.partial);
        m.refcount = 1;
        m.generation = m.generation.wrapping_add(1);
        m.priority = priority;
        m.pending = None;
        m.last_holder = holder;
        self.counts.free -= 1;
        self.counts.in_use += 1;
        self.counters.allocations += 1;
        Some(block)
    }

    /// Keeps the content of `victim` (a cached block being evicted) in the
    /// host tier when it has room and not already the same hash: reserves a
    /// pending host block and records the copy. Partly filled blocks are
    /// not demoted.
    fn demote(&mut self, victim: BlockId) {
        if self.host.is_empty() {
            return;
        }
        let m = &self.meta[victim as usize];
        let (Some(hash), false) = (m.hash, m.partial) else {
            return;
        };
        if self.host.lookup(hash).is_some() {
            return;
        }
        if let Some((host, evicted)) = self.host.reserve_evicting(hash, m.parent) {
            let spill = evicted.and_then(|(hash, parent)| self.spill(host, hash, parent));
            self.counters.demotions += 1;
            self.demotions.push(Demotion {
                device: victim,
                host,
                generation: self.host.generation(host),
                spill,
            });
        }
    }

    /// Keeps the content of host block `host` (`hash` after `parent`, being
    /// evicted from the host tier) on the disk tier when it has one with
    /// room and not already the same hash.
    fn spill(&mut self, host: u32, hash: u64, parent: u64) -> Option<Spill> {
        if self.disk.is_empty() || self.disk.lookup(hash).is_some() {
            return None;
        }
        let disk = self.disk.reserve(hash, parent)?;
        self.counters.spills += 1;
        Some(Spill {
            host,
            disk,
            generation: self.disk.generation(disk),
            hash,
            parent,
        })
    }

    /// Adds a reader to a published (cached, fenced or in-use) block.
    pub fn acquire(&mut self, block: BlockId, holder: Holder, priority: u8) {
        let before = self.state(block);
        let m = &mut self.meta[block as usize];
        m.refcount += 1;
        m.priority = m.priority.max(priority);
        m.last_holder = holder;
        if m.hash.is_some() || m.partial {
            self.eviction.reused(block);
        }
        self.settle(block, before);
    }

    /// Drops one reference. With `fenced`, the reference turns into a fence
    /// that [`BlockPool::unfence`] lifts.
    pub fn release(&mut self, block: BlockId, fenced: bool) {
        let before = self.state(block);
        let m = &mut self.meta[block as usize];
        debug_assert!(m.refcount > 0, "release of an unheld block");
        m.refcount = m.refcount.saturating_sub(1);
        if fenced {
            m.fenced += 1;
        }
        self.settle(block, before);
    }

    /// Lifts one fence from `block`. Returns whether it left the fenced state.
    pub fn unfence(&mut self, block: BlockId) -> bool {
        let before = self.state(block);
        let m = &mut self.meta[block as usize];
        debug_assert!(m.fenced > 0, "unfence of an unfenced block");
        m.fenced = m.fenced.saturating_sub(1);
        self.settle(block, before);
        before == BlockState::Fenced && self.state(block) != BlockState::Fenced
    }

    /// Drops `block`'s pending hash (or pending partial entry): its KV may
    /// never be written, so it must never publish. A published hash stays.
    pub fn discard_pending(&mut self, block: BlockId) {
        let m = &mut self.meta[block as usize];
        m.pending = None;
        if m.partial_pending {
            m.partial_pending = false;
            self.partials.remove(block);
        }
    }

    /// Records the hash `block` will have once its writing step completes.
    /// Ignored when the hash is already indexed (another block holds the same
    /// prefix) or the block is not held.
    pub fn set_pending(&mut self, block: BlockId, hash: u64, parent: u64) {
        if self.index.contains_key(&hash) {
            return;
        }
        let m = &mut self.meta[block as usize];
        if m.refcount == 0 && m.fenced == 0 {
            return;
        }
        if m.hash.is_none() {
            m.pending = Some(hash);
            m.parent = parent;
        }
    }

    /// Records that `block`, a sequence's partly filled last block holding
    /// `tokens` after the full block `parent`, is to be kept once published.
    /// Ignored when the block is not held or already published.
    pub fn set_pending_partial(&mut self, block: BlockId, parent: u64, salt: u64, tokens: &[u32]) {
        let m = &self.meta[block as usize];
        if (m.refcount == 0 && m.fenced == 0) || m.hash.is_some() || m.partial || tokens.is_empty()
        {
            return;
        }
        self.partials
            .set_pending(block, parent, salt, tokens.to_vec());
        self.meta[block as usize].partial_pending = true;
    }

    /// Publishes the pending hash (or pending partial entry) of `block` if it
    /// is still the allocation of `generation`. Returns whether anything was
    /// published.
    pub fn publish(&mut self, block: BlockId, generation: u32) -> bool {
        let m = self.meta[block as usize];
        let Some(hash) = m.pending else {
            return self.publish_partial(block, generation);
        };
        if m.generation != generation {
            // A stale reference (the block was freed and handed out again):
            // the pending hash is the new holder's, not this one's to drop.
            return false;
        }
        if self.index.contains_key(&hash) {
            self.meta[block as usize].pending = None;
            return false;
        }
        let before = self.state(block);
        {
            let m = &mut self.meta[block as usize];
            m.pending = None;
            m.hash = Some(hash);
        }
        self.index.insert(hash, block);
        let parent = self.index.get(&m.parent).copied();
        self.eviction.published(block, hash, parent);
        self.adjust_children(m.parent, true);
        self.events.push(IndexEvent::Stored {
            hash,
            parent: m.parent,
            tier: Tier::Device,
        });
        self.settle(block, before);
        true
    }

    fn publish_partial(&mut self, block: BlockId, generation: u32) -> bool {
        let m = &mut self.meta[block as usize];
        if !m.partial_pending || m.generation != generation {
            return false;
        }
        m.partial_pending = false;
        let before = self.state(block);
        if !self.partials.publish(block) {
            return false;
        }
        self.meta[block as usize].partial = true;
        self.settle(block, before);
        true
    }

    /// Removes `block`'s published hash (or partial entry) from the index.
    fn unpublish(&mut self, block: BlockId) {
        let m = &mut self.meta[block as usize];
        if m.partial {
            m.partial = false;
            self.partials.remove(block);
            return;
        }
        if let Some(hash) = m.hash.take() {
            let parent = m.parent;
            m.children = 0;
            self.index.remove(&hash);
            self.adjust_children(parent, false);
            self.events.push(IndexEvent::Removed {
                hash,
                tier: Tier::Device,
            });
        }
    }

    fn adjust_children(&mut self, parent_hash: u64, added: bool) {
        let Some(&parent) = self.index.get(&parent_hash) else {
            return;
        };
        let m = &mut self.meta[parent as usize];
        let was_leaf = m.children == 0;
        if added {
            m.children += 1;
        } else {
            m.children = m.children.saturating_sub(1);
        }
        let is_leaf = m.children == 0;
        if was_leaf != is_leaf {
            if self.retention.holds(parent) {
                self.retention.set_leaf(parent, is_leaf);
            } else if self.eviction.contains(parent) {
                self.eviction.set_leaf(parent, is_leaf);
            }
        }
    }

    /// Forces `block`'s reference counts to the given values (leak audit).
    /// Returns whether anything changed.
    pub fn reconcile(&mut self, block: BlockId, refcount: u32, fenced: u32) -> bool {
        let before = self.state(block);
        let m = &mut self.meta[block as usize];
        if m.refcount == refcount && m.fenced == fenced {
            return false;
        }
        m.refcount = refcount;
        m.fenced = fenced;
        if before == BlockState::Free && self.state(block) != BlockState::Free {
            // Only allocation takes blocks off the free list; do it here too.
            self.free_list.retain(|&b| b != block);
        }
        self.settle(block, before);
        true
    }

    /// Reference counts of `block` (readers, fences).
    pub fn refs(&self, block: BlockId) -> (u32, u32) {
        let m = &self.meta[block as usize];
        (m.refcount, m.fenced)
    }

    /// Recounts every state from scratch and checks it against the running
    /// figures, the free list, the index and the eviction policy.
    pub fn check_invariants(&self) -> Result<(), String> {
        let mut c = PoolCounts {
            total: self.meta.len() as u32,
            ..PoolCounts::default()
        };
        for (id, m) in self.meta.iter().enumerate() {
            let id = id as BlockId;
            match Self::state_of(m) {
                BlockState::Free => c.free += 1,
                BlockState::Cached => {
                    c.cached += 1;
                    if self.eviction.contains(id) == self.retention.holds(id) {
                        return Err(format!(
                            "cached block {id} is evictable {} times",
                            u8::from(self.eviction.contains(id)) * 2
                        ));
                    }
                    if self.retention.holds(id) != self.retention.is_hinted(id) {
                        return Err(format!("cached block {id} is hinted but not held so"));
                    }
                }
                BlockState::InUse => c.in_use += 1,
                BlockState::Fenced => c.fenced += 1,
            }
            if Self::state_of(m) == BlockState::Free && self.retention.is_hinted(id) {
                return Err(format!("free block {id} is under a retention hint"));
            }
            if let Some(h) = m.hash
                && self.index.get(&h) != Some(&id)
            {
                return Err(format!("block {id} has hash {h:#x} missing from the index"));
            }
        }
        if c != self.counts {
            return Err(format!("counts {:?} != recount {c:?}", self.counts));
        }
        if c.free + c.cached + c.in_use + c.fenced != c.total {
            return Err(format!("conservation broken: {c:?}"));
        }
        if self.free_list.len() != c.free as usize {
            return Err(format!(
                "free list holds {} blocks, {} are free",
                self.free_list.len(),
                c.free
            ));
        }
        if self.eviction.len() + self.retention.len() != c.cached as usize {
            return Err(format!(
                "eviction policy holds {} blocks and retention {}, {} are cached",
                self.eviction.len(),
                self.retention.len(),
                c.cached
            ));
        }
        self.eviction.check()?;
        self.retention.check()?;
        self.partials.check(
            |b| self.meta.get(b as usize).is_some_and(|m| m.partial),
            |b| self.meta.get(b as usize).is_some_and(|m| m.partial_pending),
        )?;
        if self.index.len() > self.meta.len() {
            return Err("index larger than the pool".into());
        }
        for (&h, &b) in &self.index {
            if self.meta.get(b as usize).and_then(|m| m.hash) != Some(h) {
                return Err(format!("index entry {h:#x} -> {b} is stale"));
            }
        }
        self.host.check_invariants()?;
        self.disk.check_invariants()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const H: Holder = Holder {
        session: SessionId(1),
        seq: SeqId(1),
    };

    #[test]
    fn allocate_release_conserves() {
        let mut p = BlockPool::new(4);
        let a = p.allocate(H, 35).unwrap();
        let b = p.allocate(H, 35).unwrap();
        assert_eq!(p.counts().in_use, 2);
        p.release(a, false);
        p.release(b, true);
        assert_eq!(p.counts().free, 3);
        assert_eq!(p.counts().fenced, 1);
        p.check_invariants().unwrap();
        assert!(p.unfence(b));
        assert_eq!(p.counts().free, 4);
        p.check_invariants().unwrap();
    }

    #[test]
    fn published_blocks_are_cached_then_evicted_leaf_first() {
        let mut p = BlockPool::new(2);
        let a = p.allocate(H, 35).unwrap();
        let b = p.allocate(H, 35).unwrap();
        p.set_pending(a, 11, 0);
        p.set_pending(b, 22, 11);
        assert!(p.publish(a, p.generation(a)));
        assert!(p.publish(b, p.generation(b)));
        p.release(b, false);
        p.release(a, false); // the parent is released last: most recent
        assert_eq!(p.counts().cached, 2);
        // Leaf b goes first even though a is... the parent.
        let c = p.allocate(H, 35).unwrap();
        assert_eq!(c, b);
        assert_eq!(p.lookup(22), None);
        assert_eq!(p.lookup(11), Some(a));
        p.check_invariants().unwrap();
        assert_eq!(
            p.drain_events(),
            vec![
                IndexEvent::Stored {
                    hash: 11,
                    parent: 0,
                    tier: Tier::Device
                },
                IndexEvent::Stored {
                    hash: 22,
                    parent: 11,
                    tier: Tier::Device
                },
                IndexEvent::Removed {
                    hash: 22,
                    tier: Tier::Device
                },
            ]
        );
    }

    #[test]
    fn unpublished_hash_is_dropped_on_unfenced_release() {
        let mut p = BlockPool::new(1);
        let a = p.allocate(H, 35).unwrap();
        let generation = p.generation(a);
        p.set_pending(a, 7, 0);
        p.release(a, false);
        assert!(!p.publish(a, generation));
        assert_eq!(p.state(a), BlockState::Free);
        p.check_invariants().unwrap();
    }

    #[test]
    fn fenced_release_keeps_pending_hash_until_published() {
        let mut p = BlockPool::new(1);
        let a = p.allocate(H, 35).unwrap();
        let generation = p.generation(a);
        p.set_pending(a, 7, 0);
        p.release(a, true);
        assert!(p.publish(a, generation));
        assert_eq!(p.state(a), BlockState::Fenced);
        p.unfence(a);
        assert_eq!(p.state(a), BlockState::Cached);
        p.check_invariants().unwrap();
    }

    #[test]
    fn nothing_left_is_none_not_a_panic() {
        let mut p = BlockPool::new(1);
        assert!(p.allocate(H, 35).is_some());
        assert!(p.allocate(H, 35).is_none());
        p.check_invariants().unwrap();
    }
}
