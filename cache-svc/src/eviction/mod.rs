//! Which cached block to evict next.
//!
//! A cached block (released, full, hashed, refcount 0) stays reusable until the
//! pool needs its slot. The [`EvictionPolicy`] trait keeps that choice
//! swappable; every policy here evicts leaves of the prefix tree before their
//! parents (evicting a parent first would strand its cached children, which are
//! only reachable through it), then the lowest retention priority, then what
//! the policy's own order says:
//! - [`PriorityLru`] (`lru`): least recently released first. A parent whose
//!   last cached child goes keeps its *own* recency: it is ordered among the
//!   leaves by when it was itself last released (the re-queue at the most
//!   recent end that this replaced let dead chains keep fresh heads).
//! - [`GreedyDual`] (`lfu`): LFU with dynamic aging (GreedyDual-Frequency):
//!   a block's credit is the cache's age plus how often it was used since it
//!   was published; each eviction raises the age to the victim's credit, so
//!   old frequency decays against fresh traffic.
//! - [`Probation`] (`chain`): scan-resistant and workload-aware: LRU in two
//!   classes, where blocks on probation (a hash not seen recently, on a chain
//!   nobody came back to) go before protected ones (seen before, by a
//!   bounded aging filter of hashes that outlives evictions; reused; or
//!   written below a reused block, i.e. a chain extended by a later turn).
//!
//! - [`Adaptive`] (`adaptive`): all three live on the pool, each also
//!   simulated on sampled lookups in a small shadow pool; the one with the
//!   best recent shadow hit rate picks victims (with hysteresis); while
//!   `lfu` picks, it passes over blocks that `chain` protects.
//!
//! All of them keep blocks in ordered sets keyed by (priority, class or
//! credit, recency): O(log n) per operation.

mod adaptive;
mod probation;
mod ranked;

use std::fmt;
use std::str::FromStr;

pub use adaptive::{Adaptive, AdaptiveState, CANDIDATES, Switch};
pub use probation::{Classes, Doorkeeper, Probation};
pub use ranked::{Frequency, GreedyDual, PriorityLru, Ranked, Recency};

use crate::ids::BlockId;

/// Bytes one more ordered set of evictable blocks takes per block (its
/// entry in a B-tree and the block's rank; `lru`'s measured 82-89).
const ORDERED_SET_BYTES: u64 = 88;

/// Bytes `lfu`'s state adds per block (its use count, rounded up).
const LFU_BYTES: u64 = 8;

/// Bytes `chain`'s state adds per block (flags, hash, fingerprint).
const CHAIN_BYTES: u64 = 24;

/// Retention priorities run from 0 (evict first) to this value (keep longest).
pub const MAX_PRIORITY: u8 = 100;

/// The eviction bookkeeping of one pool. Implementations hold only block ids;
/// the pool owns the blocks.
pub trait EvictionPolicy: Send + fmt::Debug {
    /// `block` became evictable (most recently used now).
    fn insert(&mut self, block: BlockId, priority: u8, leaf: bool);
    /// `block`, a kept partly filled block (always a leaf, never a hit:
    /// its slots are copied), became evictable. It ranks as released just
    /// before the most recently released block, so it goes before every
    /// full block of its own release (its parent among them, which it is
    /// useless without) and of any later one, and its credit is the lowest
    /// a released block can have.
    fn insert_partial(&mut self, block: BlockId, priority: u8) {
        self.insert(block, priority, true);
    }
    /// `block` is no longer evictable (reused, or evicted by the pool).
    fn remove(&mut self, block: BlockId);
    /// `block`'s leaf status changed while it is evictable.
    fn set_leaf(&mut self, block: BlockId, leaf: bool);
    /// The block to evict next, removed from the policy. Its history ends.
    fn pop_victim(&mut self) -> Option<BlockId>;
    /// Appends to `out` the next `k` blocks [`pop_victim`](Self::pop_victim)
    /// would take, in that order (nothing for a policy with no order to
    /// show).
    fn next_victims(&self, k: usize, out: &mut Vec<BlockId>) {
        let _ = (k, out);
    }
    /// Whether `block` is among what the policy evicts next: its priority
    /// and class or credit are no higher than those of its next victim
    /// (for `chain`: on probation, while any block is). True for a block it
    /// does not hold.
    fn ranks_low(&self, block: BlockId) -> bool {
        let _ = block;
        true
    }
    /// Whether `block` is held by the policy.
    fn contains(&self, block: BlockId) -> bool;
    /// Evictable blocks.
    fn len(&self) -> usize;
    /// Whether no block is evictable.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// `block`'s `hash` was published (a new life of the block starts);
    /// `parent` is the published block its parent hash names in this pool,
    /// if any.
    fn published(&mut self, block: BlockId, hash: u64, parent: Option<BlockId>) {
        let _ = (block, hash, parent);
    }
    /// A sequence took `block` for its published content (a prefix hit).
    fn reused(&mut self, block: BlockId) {
        let _ = block;
    }
    /// The pool evicted `block`, chosen by another policy that shares the
    /// pool ([`Adaptive`]): forget it as [`pop_victim`](Self::pop_victim)
    /// would have, except that an aging policy's clock moves only as far as
    /// its own next victim would have moved it (the victim was not chosen
    /// by its credit).
    fn evicted(&mut self, block: BlockId) {
        self.remove(block);
    }
    /// A lease looked up `chain` (its full blocks' hashes, parent first).
    fn observe(&mut self, chain: &[u64]) {
        let _ = chain;
    }
    /// The choice of an adaptive policy (None for a fixed one).
    fn adaptive(&self) -> Option<AdaptiveState> {
        None
    }
    /// The policy switches since the last call.
    fn take_switches(&mut self) -> Vec<Switch> {
        Vec::new()
    }
    /// Checks the policy's own bookkeeping.
    fn check(&self) -> Result<(), String> {
        Ok(())
    }
}

/// The policies a pool can be given, by name.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum PolicyKind {
    /// Leaf-first LRU within priorities.
    Lru,
    /// LFU with dynamic aging (GreedyDual-Frequency).
    Lfu,
    /// Leaf-first LRU with a probation class for one-off chains.
    Chain,
    /// Whichever of the others has hit best lately (shadow-simulated); the
    /// default.
    #[default]
    Adaptive,
}

impl PolicyKind {
    /// Every policy, in the order tables print them.
    pub const ALL: [PolicyKind; 4] = [
        PolicyKind::Lru,
        PolicyKind::Lfu,
        PolicyKind::Chain,
        PolicyKind::Adaptive,
    ];

    /// The flag value naming the policy.
    pub fn name(self) -> &'static str {
        match self {
            PolicyKind::Lru => "lru",
            PolicyKind::Lfu => "lfu",
            PolicyKind::Chain => "chain",
            PolicyKind::Adaptive => "adaptive",
        }
    }

    /// Bytes a pool of `num_blocks` blocks with this policy holds beyond
    /// the [`BLOCK_STATE_BYTES`](crate::cache::BLOCK_STATE_BYTES) of each
    /// block, which count `lru`'s ordered set. Measured (heap of each
    /// policy holding every block of a pool of 2^20 and 2^22 blocks, and its
    /// shadows full): `lru` 82-89 bytes a block, `lfu` 81-93, `chain`
    /// 72-102 (with its filter), `adaptive` 285-291.
    pub fn extra_bytes(self, num_blocks: u32) -> u64 {
        let n = num_blocks as usize;
        let blocks = u64::from(num_blocks);
        match self {
            PolicyKind::Lru => 0,
            // a use count per block, and room for its credit
            PolicyKind::Lfu => LFU_BYTES * blocks,
            // four flags, a hash and a child's fingerprint per block, and
            // the filter of hashes seen
            PolicyKind::Chain => CHAIN_BYTES * blocks + probation::filter_bytes(n),
            // two more ordered sets, the others' state, and three shadow
            // pools with the shadow `chain`'s filter
            PolicyKind::Adaptive => {
                let slots = adaptive::shadow_slots(n) as u64;
                (2 * ORDERED_SET_BYTES + LFU_BYTES + CHAIN_BYTES) * blocks
                    + probation::filter_bytes(n)
                    + adaptive::SHADOW_SLOT_BYTES * slots * CANDIDATES.len() as u64
                    + probation::filter_bytes(slots as usize)
            }
        }
    }

    /// A fresh policy for a pool of `num_blocks` blocks.
    pub fn build(self, num_blocks: usize) -> Box<dyn EvictionPolicy> {
        match self {
            PolicyKind::Lru => Box::new(PriorityLru::new(num_blocks)),
            PolicyKind::Lfu => Box::new(GreedyDual::new(num_blocks)),
            PolicyKind::Chain => Box::new(Probation::new(num_blocks)),
            PolicyKind::Adaptive => Box::new(Adaptive::new(num_blocks)),
        }
    }
}

impl fmt::Display for PolicyKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for PolicyKind {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::ALL
            .into_iter()
            .find(|k| k.name() == s)
            .ok_or_else(|| {
                let names: Vec<&str> = Self::ALL.iter().map(|k| k.name()).collect();
                format!(
                    "unknown eviction policy {s:?}, expected one of {}",
                    names.join(", ")
                )
            })
    }
}

/// Which policy each pool group gets.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct EvictionConfig {
    /// The policy of groups not named in `groups`.
    pub default: PolicyKind,
    /// Per-group choices, `(group, policy)`.
    pub groups: Vec<(String, PolicyKind)>,
}

impl EvictionConfig {
    /// The policy for the pools of `group`.
    pub fn for_group(&self, group: &str) -> PolicyKind {
        self.groups
            .iter()
            .find(|(g, _)| g == group)
            .map_or(self.default, |&(_, kind)| kind)
    }
}

/// Parses a `GROUP=POLICY` flag value.
pub fn parse_group_policy(s: &str) -> Result<(String, PolicyKind), String> {
    let (group, policy) = s
        .rsplit_once('=')
        .ok_or_else(|| format!("expected GROUP=POLICY, got {s:?}"))?;
    if group.is_empty() {
        return Err(format!("expected GROUP=POLICY, got {s:?}"));
    }
    Ok((group.to_owned(), policy.parse()?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn policies_parse_by_name_and_per_group() {
        for kind in PolicyKind::ALL {
            assert_eq!(kind.name().parse::<PolicyKind>(), Ok(kind));
        }
        let err = "mru".parse::<PolicyKind>().unwrap_err();
        assert!(err.contains("lru, lfu, chain, adaptive"), "{err}");
        assert_eq!(
            parse_group_policy("model/r0=chain"),
            Ok(("model/r0".to_owned(), PolicyKind::Chain))
        );
        assert!(parse_group_policy("=lru").is_err());
        assert!(parse_group_policy("model").is_err());
        assert!(parse_group_policy("model=arc").is_err());
        let config = EvictionConfig {
            default: PolicyKind::Lfu,
            groups: vec![("a".into(), PolicyKind::Chain)],
        };
        assert_eq!(config.for_group("a"), PolicyKind::Chain);
        assert_eq!(config.for_group("b"), PolicyKind::Lfu);
    }

    #[test]
    fn adaptive_counts_three_policies_and_bounded_shadows() {
        assert_eq!(PolicyKind::Lru.extra_bytes(1 << 20), 0);
        let chain = PolicyKind::Chain.extra_bytes(1 << 10);
        assert!(chain > 256 << 10, "{chain}: the filter is at least 256 KiB");
        let small = PolicyKind::Adaptive.extra_bytes(1 << 10);
        let large = PolicyKind::Adaptive.extra_bytes(1 << 22);
        // at least two filters and a shadow per candidate
        assert!(small > 512 << 10, "{small}");
        // at 2^22 blocks about 290 bytes a block in all, 96 counted already
        let per_block = large as f64 / f64::from(1u32 << 22);
        assert!((190.0..=220.0).contains(&per_block), "{per_block}");
    }

    #[test]
    fn the_flags_choose_policies() {
        let config = <crate::Config as clap::Parser>::try_parse_from([
            "kvlease-cache",
            "--eviction-policy",
            "lfu",
            "--group-eviction-policy",
            "a=chain",
            "--group-eviction-policy",
            "b=lru",
        ])
        .map_err(|e| e.to_string());
        let eviction = config.map(|c| c.cache_config().eviction);
        assert_eq!(
            eviction,
            Ok(EvictionConfig {
                default: PolicyKind::Lfu,
                groups: vec![
                    ("a".into(), PolicyKind::Chain),
                    ("b".into(), PolicyKind::Lru)
                ],
            })
        );
        let bad = <crate::Config as clap::Parser>::try_parse_from([
            "kvlease-cache",
            "--eviction-policy",
            "fifo",
        ]);
        assert!(bad.is_err());
    }
}
