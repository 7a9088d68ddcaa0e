//! [`Probation`]: leaf-first LRU in two classes. A block whose hash the pool
//! has not seen before, on a chain that nobody came back to, is on
//! probation and goes before any protected block:
//! - a block whose hash was seen recently (a [`Doorkeeper`] of hashes that
//!   outlives evictions) is protected: it came back once, it tends to come
//!   back again;
//! - a block that was reused while cached is protected;
//! - a block written below a reused block (a later turn extending a cached
//!   chain), and every block written below that one in the same chain, is
//!   protected: conversations that came back once come back again.
//!
//! A parent that two different children were written below is a *shared*
//! prefix (a system prompt that several sessions open with, or the one that
//! every request opens with): its reuse says the prefix is popular, not that
//! a conversation came back, so it protects no block written below it (the
//! parent itself stays protected by its own reuse). Without that rule a
//! block shared by every request protected every chain, and `chain` was
//! LRU (issue 28). A chain's own continuation is its parent's only child:
//! the same child written again after an eviction is not a branch.
//!
//! One-off prompts thus leave the cache first, whatever their recency.

use super::ranked::{Ranked, Ranker};
use crate::ids::BlockId;

const PROBATION: u64 = 0;
const PROTECTED: u64 = 1;

/// Hashes seen recently, in bounded memory: two generations of a two-probe
/// bit filter; when the current generation has taken its share of
/// insertions it becomes the previous one and a fresh one starts (aging).
#[derive(Debug)]
pub struct Doorkeeper {
    current: Vec<u64>,
    previous: Vec<u64>,
    /// `bits - 1` (bits is a power of two).
    mask: u64,
    inserted: usize,
    generation: usize,
}

impl Doorkeeper {
    /// A filter that remembers at least `span` insertions (and at most
    /// twice as many): two generations of `8 * span` bits (rounded up to a
    /// power of two), each rotated out after `span` insertions. Two probes
    /// in a filter an eighth full: about 5% false positives per generation.
    pub fn new(span: usize) -> Self {
        let bits = span.max(8).saturating_mul(8).next_power_of_two();
        Self {
            current: vec![0; bits / 64],
            previous: vec![0; bits / 64],
            mask: bits as u64 - 1,
            inserted: 0,
            generation: span.max(8),
        }
    }

    fn probes(&self, hash: u64) -> [u64; 2] {
        [hash & self.mask, hash.rotate_left(32) & self.mask]
    }

    fn test(words: &[u64], bit: u64) -> bool {
        words[(bit / 64) as usize] & (1 << (bit % 64)) != 0
    }

    /// Whether `hash` was inserted in this generation or the last one
    /// (false positives possible, false negatives only through aging).
    pub fn contains(&self, hash: u64) -> bool {
        let probes = self.probes(hash);
        probes.iter().all(|&b| Self::test(&self.current, b))
            || probes.iter().all(|&b| Self::test(&self.previous, b))
    }

    /// Records `hash`.
    pub fn insert(&mut self, hash: u64) {
        if self.inserted >= self.generation {
            std::mem::swap(&mut self.current, &mut self.previous);
            self.current.fill(0);
            self.inserted = 0;
        }
        for b in self.probes(hash) {
            self.current[(b / 64) as usize] |= 1 << (b % 64);
        }
        self.inserted += 1;
    }
}

/// The classes of [`Probation`] (see the module).
#[derive(Debug)]
pub struct Classes {
    seen: Doorkeeper,
    /// Per block: protected in its current life.
    protected: Vec<bool>,
    /// Per block: reused while published in its current life.
    reused: Vec<bool>,
    /// Per block: the hash of its current life.
    hash: Vec<u64>,
    /// Per block: a fingerprint of the first child written below it in its
    /// current life (0: none yet).
    first_child: Vec<u32>,
    /// Per block: a second, different child was written below it in its
    /// current life (a shared prefix).
    branched: Vec<bool>,
}

/// Leaf-first LRU with a probation class that goes first (see the module).
pub type Probation = Ranked<Classes>;

/// Insertions the filter of a pool of `num_blocks` blocks remembers.
fn span_for(num_blocks: usize) -> usize {
    num_blocks.saturating_mul(16).clamp(1 << 17, 1 << 22)
}

/// Bytes of the filter of a pool of `num_blocks` blocks (256 KiB to 8 MiB).
pub(super) fn filter_bytes(num_blocks: usize) -> u64 {
    let bits = span_for(num_blocks).saturating_mul(8).next_power_of_two();
    2 * (bits as u64 / 8)
}

impl Probation {
    /// A policy for a pool of `num_blocks` blocks. It remembers the hashes
    /// of the last 16 pool-fulls of blocks written or reused (at least
    /// 2^17, at most 2^22 of them: 8 to 64 bits of filter per block for
    /// pools up to 2^19 blocks, 8 MiB at most), far longer than they stay
    /// cached.
    pub fn new(num_blocks: usize) -> Self {
        let span = span_for(num_blocks);
        Self::with_ranker(
            num_blocks,
            Classes {
                seen: Doorkeeper::new(span),
                protected: vec![false; num_blocks],
                reused: vec![false; num_blocks],
                hash: vec![0; num_blocks],
                first_child: vec![0; num_blocks],
                branched: vec![false; num_blocks],
            },
        )
    }
}

fn flag(flags: &[bool], block: BlockId) -> bool {
    flags.get(block as usize).copied().unwrap_or(false)
}

/// A non-zero 32-bit fingerprint of a block hash.
fn fingerprint(hash: u64) -> u32 {
    ((hash ^ (hash >> 32)) as u32) | 1
}

impl Classes {
    /// `child` was written below `parent`: its first child, or a branch.
    fn add_child(&mut self, parent: BlockId, child: u64) {
        let p = parent as usize;
        let (Some(first), Some(branched)) = (self.first_child.get_mut(p), self.branched.get_mut(p))
        else {
            return;
        };
        let f = fingerprint(child);
        if *first == 0 {
            *first = f;
        } else if *first != f {
            *branched = true;
        }
    }
}

impl Ranker for Classes {
    fn credit(&self, block: BlockId) -> u64 {
        if flag(&self.protected, block) || flag(&self.reused, block) {
            PROTECTED
        } else {
            PROBATION
        }
    }

    fn published(&mut self, block: BlockId, hash: u64, parent: Option<BlockId>) {
        if let Some(p) = parent {
            self.add_child(p, hash);
        }
        let continues = parent.is_some_and(|p| {
            !flag(&self.branched, p) && (flag(&self.reused, p) || flag(&self.protected, p))
        });
        let protect = continues || self.seen.contains(hash);
        self.seen.insert(hash);
        let b = block as usize;
        if let (Some(p), Some(r), Some(h), Some(c), Some(br)) = (
            self.protected.get_mut(b),
            self.reused.get_mut(b),
            self.hash.get_mut(b),
            self.first_child.get_mut(b),
            self.branched.get_mut(b),
        ) {
            *p = protect;
            *r = false;
            *h = hash;
            *c = 0;
            *br = false;
        }
    }

    fn reused(&mut self, block: BlockId) {
        let b = block as usize;
        if let (Some(r), Some(&h)) = (self.reused.get_mut(b), self.hash.get(b)) {
            *r = true;
            // keep a hash that stays cached through hits in the filter
            self.seen.insert(h);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::eviction::EvictionPolicy;

    #[test]
    fn the_filter_takes_256_kib_to_8_mib() {
        assert_eq!(filter_bytes(1), 256 << 10);
        assert_eq!(filter_bytes(8_192), 256 << 10);
        assert_eq!(filter_bytes(1 << 16), 2 << 20);
        assert_eq!(filter_bytes(1 << 24), 8 << 20);
        let d = Doorkeeper::new(span_for(8_192));
        assert_eq!(
            8 * (d.current.len() + d.previous.len()) as u64,
            filter_bytes(8_192)
        );
    }

    #[test]
    fn doorkeeper_remembers_for_two_generations() {
        let mut d = Doorkeeper::new(128); // rotates every 128 insertions
        d.insert(0xdead_beef);
        assert!(d.contains(0xdead_beef));
        assert!(!d.contains(0x1234_5678_9abc));
        for h in 0..128u64 {
            d.insert(h.wrapping_mul(0x9e37_79b9_7f4a_7c15));
        }
        assert!(d.contains(0xdead_beef), "still in the previous generation");
        for h in 0..256u64 {
            d.insert(h.wrapping_mul(0xc2b2_ae3d_27d4_eb4f));
        }
        assert!(!d.contains(0xdead_beef), "aged out");
    }

    #[test]
    fn one_off_blocks_go_before_returning_ones_whatever_their_recency() {
        let mut p = Probation::new(8);
        // Block 0 holds a hash seen in an earlier life: protected.
        p.published(0, 77, None);
        p.insert(0, 5, true);
        assert_eq!(p.pop_victim(), Some(0));
        p.published(0, 77, None);
        p.insert(0, 5, true);
        // Blocks 1 and 2: new hashes, released later, still go first.
        p.published(1, 11, None);
        p.published(2, 22, None);
        p.insert(1, 5, true);
        p.insert(2, 5, true);
        assert_eq!(p.pop_victim(), Some(1));
        assert_eq!(p.pop_victim(), Some(2));
        assert_eq!(p.pop_victim(), Some(0));
    }

    #[test]
    fn reuse_and_chains_below_a_reused_block_are_protected() {
        let mut p = Probation::new(8);
        p.published(0, 100, None);
        p.published(1, 101, None);
        p.reused(0); // a later request hit block 0 ...
        p.published(2, 102, Some(0)); // ... and extended the chain below it
        p.published(3, 103, Some(2)); // deeper in the same extension
        p.published(4, 104, Some(1)); // below a block nobody reused
        for b in [0, 1, 2, 3, 4] {
            p.insert(b, 5, true);
        }
        assert_eq!(p.pop_victim(), Some(1));
        assert_eq!(p.pop_victim(), Some(4));
        assert_eq!(p.pop_victim(), Some(0));
        assert_eq!(p.pop_victim(), Some(2));
        assert_eq!(p.pop_victim(), Some(3));
    }

    #[test]
    fn a_root_that_every_session_shares_protects_no_chain_below_it() {
        let mut p = Probation::new(16);
        // Session A writes the shared root (block 0) and its turn (1, 2).
        p.published(0, 500, None);
        p.published(1, 501, Some(0));
        p.published(2, 502, Some(1));
        // Session B reuses the root and writes its own turn (3, 4) below
        // it: the root is reused, but a second child makes it shared.
        p.reused(0);
        p.published(3, 601, Some(0));
        p.published(4, 602, Some(3));
        // Session A comes back: reuses 1 and 2 and extends its chain (5).
        p.reused(0);
        p.reused(1);
        p.reused(2);
        p.published(5, 503, Some(2));
        for b in [5, 4, 3, 2, 1, 0] {
            p.insert(b, 5, true);
        }
        // B's one-off turn is on probation although its parent was reused;
        // A's continuation is protected like A's reused blocks.
        assert_eq!(p.pop_victim(), Some(4));
        assert_eq!(p.pop_victim(), Some(3));
        assert_eq!(p.pop_victim(), Some(5));
        assert_eq!(p.pop_victim(), Some(2));
    }

    #[test]
    fn the_same_child_written_again_is_no_branch() {
        let mut p = Probation::new(8);
        p.published(0, 700, None);
        p.published(1, 701, Some(0));
        // Block 1's content is evicted and written again in another slot:
        // still the parent's one continuation.
        p.published(2, 701, Some(0));
        assert!(!flag(&p.ranker().branched, 0));
        p.published(3, 702, Some(0));
        assert!(flag(&p.ranker().branched, 0));
        // a new life of block 0 starts unbranched
        p.published(0, 800, None);
        assert!(!flag(&p.ranker().branched, 0));
    }
}
