//! Retention hints: blocks a client asked the cache to keep, for a while.
//!
//! A request may mark a prefix of its prompt (a long shared tool prompt, a
//! conversation it will come back to) with a retention priority and a time
//! to live. While the hint lasts, the block is evicted only after every
//! unhinted evictable block of its pool, whatever the eviction policy says;
//! among hinted blocks, leaves before parents, then the lowest hint
//! priority, then the soonest expiry. When the hint expires the block goes
//! back to the policy (as a block released at that moment).
//!
//! A hint covers a prefix, so every ancestor of a hinted block is hinted
//! too, with at least its priority and expiry (a block's hint is the
//! strongest of the hints that cover it): keeping hinted blocks after the
//! unhinted ones never strands a cached child behind an evicted parent.
//!
//! Each block under a hint counts against its tenant's quota (`quota`
//! blocks per pool) until the hint expires or the block is freed; a hint
//! that would pass it covers only the leading blocks that fit (the grant
//! says how many tokens were retained).
//!
//! Every operation is O(log n): the evictable hinted blocks and the hints'
//! expiries are ordered sets.

use std::collections::BTreeSet;
use std::time::Instant;

use foldhash::{HashMap, HashMapExt};

use crate::ids::BlockId;

/// One block's hint.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Hint {
    priority: u8,
    expires: Instant,
    tenant: String,
}

/// Eviction order of an evictable hinted block: leaves (0) before parents
/// (1), then the lowest priority, then the soonest expiry.
type Key = (u8, u8, Instant, BlockId);

/// The hinted blocks of one pool.
#[derive(Debug)]
pub struct Retention {
    hint: Vec<Option<Hint>>,
    /// Per block: its key in `held` while it is evictable.
    key: Vec<Option<Key>>,
    held: BTreeSet<Key>,
    expiry: BTreeSet<(Instant, BlockId)>,
    per_tenant: HashMap<String, u32>,
    /// Blocks a tenant may hold under hints.
    quota: u32,
}

impl Retention {
    /// No hints, for a pool of `num_blocks`, each tenant allowed `quota`.
    pub fn new(num_blocks: usize, quota: u32) -> Self {
        Self {
            hint: vec![None; num_blocks],
            key: vec![None; num_blocks],
            held: BTreeSet::new(),
            expiry: BTreeSet::new(),
            per_tenant: HashMap::new(),
            quota,
        }
    }

    /// Whether `block` is under a hint (expired or not: expiry is applied
    /// by [`Self::expire`]).
    pub fn is_hinted(&self, block: BlockId) -> bool {
        self.hint.get(block as usize).is_some_and(Option::is_some)
    }

    /// Whether `block` is held here as evictable.
    pub fn holds(&self, block: BlockId) -> bool {
        self.key.get(block as usize).is_some_and(Option::is_some)
    }

    /// Evictable hinted blocks.
    pub fn len(&self) -> usize {
        self.held.len()
    }

    /// Whether no hinted block is evictable.
    pub fn is_empty(&self) -> bool {
        self.held.is_empty()
    }

    /// Blocks under `tenant`'s hints.
    pub fn tenant_blocks(&self, tenant: &str) -> u32 {
        self.per_tenant.get(tenant).copied().unwrap_or(0)
    }

    /// Blocks `tenant` may still put under hints.
    pub fn room(&self, tenant: &str) -> u32 {
        self.quota.saturating_sub(self.tenant_blocks(tenant))
    }

    /// Puts `block` (held by a sequence, not evictable) under `tenant`'s
    /// hint; a block already hinted keeps the stronger of the two (and its
    /// first tenant). Returns whether it counted as a new block of the
    /// tenant's quota.
    pub fn hint(&mut self, block: BlockId, tenant: &str, priority: u8, expires: Instant) -> bool {
        debug_assert!(!self.holds(block), "hinting an evictable block");
        let slot = &mut self.hint[block as usize];
        match slot {
            Some(h) => {
                if expires > h.expires {
                    self.expiry.remove(&(h.expires, block));
                    self.expiry.insert((expires, block));
                    h.expires = expires;
                }
                h.priority = h.priority.max(priority);
                false
            }
            None => {
                *slot = Some(Hint {
                    priority,
                    expires,
                    tenant: tenant.to_owned(),
                });
                self.expiry.insert((expires, block));
                *self.per_tenant.entry(tenant.to_owned()).or_insert(0) += 1;
                true
            }
        }
    }

    /// Holds `block`, hinted, as evictable (`leaf`: no cached children).
    pub fn hold(&mut self, block: BlockId, leaf: bool) {
        let Some(h) = &self.hint[block as usize] else {
            debug_assert!(false, "holding unhinted block {block}");
            return;
        };
        let key = (u8::from(!leaf), h.priority, h.expires, block);
        self.held.insert(key);
        self.key[block as usize] = Some(key);
    }

    /// `block` is no longer evictable (reused, or evicted by the pool).
    pub fn unhold(&mut self, block: BlockId) {
        if let Some(key) = self.key[block as usize].take() {
            self.held.remove(&key);
        }
    }

    /// `block`'s leaf status changed while it is evictable.
    pub fn set_leaf(&mut self, block: BlockId, leaf: bool) {
        if self.key[block as usize].is_some() {
            self.unhold(block);
            self.hold(block, leaf);
        }
    }

    /// The hinted block to evict next, taken out and its hint dropped.
    pub fn pop_victim(&mut self) -> Option<BlockId> {
        let key = self.held.pop_first()?;
        let block = key.3;
        self.key[block as usize] = None;
        self.forget(block);
        Some(block)
    }

    /// Drops `block`'s hint (it was freed or evicted), counting it off its
    /// tenant's quota. The block must not be held as evictable.
    pub fn forget(&mut self, block: BlockId) {
        debug_assert!(!self.holds(block), "forgetting an evictable block");
        let Some(h) = self.hint[block as usize].take() else {
            return;
        };
        self.expiry.remove(&(h.expires, block));
        if let Some(n) = self.per_tenant.get_mut(&h.tenant) {
            *n -= 1;
            if *n == 0 {
                self.per_tenant.remove(&h.tenant);
            }
        }
    }

    /// Drops the hints that expired by `now`; returns the blocks that were
    /// evictable here (the pool gives them to its policy), with their leaf
    /// status.
    pub fn expire(&mut self, now: Instant) -> Vec<(BlockId, bool)> {
        let mut released = Vec::new();
        while let Some(&(at, block)) = self.expiry.first() {
            if at > now {
                break;
            }
            if let Some(key) = self.key[block as usize] {
                released.push((block, key.0 == 0));
                self.unhold(block);
            }
            self.forget(block);
        }
        released
    }

    /// Checks the bookkeeping: evictable blocks are hinted, per-tenant
    /// counts add up, every hint has its expiry.
    pub fn check(&self) -> Result<(), String> {
        let mut per_tenant: HashMap<&str, u32> = HashMap::new();
        let mut hinted = 0;
        for (b, h) in self.hint.iter().enumerate() {
            if let Some(h) = h {
                hinted += 1;
                *per_tenant.entry(&h.tenant).or_insert(0) += 1;
                if !self.expiry.contains(&(h.expires, b as BlockId)) {
                    return Err(format!("hinted block {b} has no expiry entry"));
                }
            } else if self.key[b].is_some() {
                return Err(format!("block {b} is held as hinted without a hint"));
            }
        }
        if self.expiry.len() != hinted {
            return Err(format!(
                "{} hint expiries for {hinted} hinted blocks",
                self.expiry.len()
            ));
        }
        let held = self.key.iter().filter(|k| k.is_some()).count();
        if held != self.held.len() {
            return Err(format!(
                "{held} blocks keyed, {} held as hinted",
                self.held.len()
            ));
        }
        if per_tenant.len() != self.per_tenant.len()
            || per_tenant
                .iter()
                .any(|(t, n)| self.per_tenant.get(*t) != Some(n))
        {
            return Err(format!(
                "per-tenant hinted blocks {:?} != recount {per_tenant:?}",
                self.per_tenant
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn hinted_blocks_go_leaves_first_then_by_priority_then_expiry() {
        let now = Instant::now();
        let mut r = Retention::new(8, 8);
        let s = Duration::from_secs;
        r.hint(0, "a", 50, now + s(10));
        r.hint(1, "a", 10, now + s(30));
        r.hint(2, "a", 10, now + s(20));
        r.hint(3, "b", 90, now + s(5));
        r.hold(0, false);
        r.hold(1, true);
        r.hold(2, true);
        r.hold(3, true);
        assert_eq!((r.tenant_blocks("a"), r.tenant_blocks("b")), (3, 1));
        assert_eq!(r.check(), Ok(()));
        let order: Vec<_> = std::iter::from_fn(|| r.pop_victim()).collect();
        assert_eq!(order, [2, 1, 3, 0]);
        assert_eq!((r.tenant_blocks("a"), r.room("a")), (0, 8));
        assert_eq!(r.check(), Ok(()));
    }

    #[test]
    fn a_second_hint_strengthens_and_does_not_count_twice() {
        let now = Instant::now();
        let mut r = Retention::new(2, 1);
        assert!(r.hint(0, "a", 10, now + Duration::from_secs(1)));
        assert!(!r.hint(0, "a", 60, now + Duration::from_secs(9)));
        assert_eq!((r.tenant_blocks("a"), r.room("a")), (1, 0));
        r.hold(0, true);
        assert!(r.expire(now + Duration::from_secs(2)).is_empty());
        assert_eq!(r.expire(now + Duration::from_secs(9)), [(0, true)]);
        assert!(!r.is_hinted(0) && r.is_empty());
        assert_eq!(r.check(), Ok(()));
    }

    #[test]
    fn expiry_of_a_block_in_use_only_drops_the_hint() {
        let now = Instant::now();
        let mut r = Retention::new(2, 4);
        r.hint(1, "a", 10, now);
        assert!(r.expire(now).is_empty());
        assert_eq!((r.is_hinted(1), r.tenant_blocks("a")), (false, 0));
        assert_eq!(r.check(), Ok(()));
    }
}
