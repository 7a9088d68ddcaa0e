//! Online miss-ratio curves: the hit rate a pool would have at other sizes,
//! estimated while it serves.
//!
//! SHARDS-style spatial sampling: a block hash is sampled when it falls in a
//! fixed fraction `rate` of the hash space, so every access to a sampled
//! block is seen and every access to an unsampled one is not. Each scale
//! keeps a shadow LRU of sampled hashes only, sized `scale * blocks * rate`;
//! its hit rate over sampled lookups estimates the pool's at `scale *
//! blocks`. The rate is chosen so the largest shadow holds at most
//! [`MAX_SHADOW_KEYS`] hashes: memory is bounded whatever the pool size
//! (small pools are tracked exactly).
//!
//! Sampling by hash weighs a block by whether it was drawn: a block that
//! every request reads (a shared system prompt) is either sampled, and then
//! counts once per request where it should count `rate` times, or missed.
//! SHARDS' adjustment corrects for it: the curve counts every lookup, sampled
//! or not, and adds the difference between the sampled lookups expected
//! (`lookups * rate`) and those seen to the hits at every size (a reference
//! at reuse distance 0), then divides by the expected count. Exact curves
//! (rate 1) are unchanged.
//!
//! A request touches its chain deepest block first, so within one request a
//! parent is more recent than its children and a plain LRU of the sampled
//! hashes evicts chains from the tail, as the pool's leaf-first LRU does.

use std::collections::BTreeMap;

use foldhash::{HashMap, HashMapExt};

/// The pool sizes estimated, as multiples of the real one.
pub const SCALES: [f64; 4] = [0.5, 1.0, 2.0, 4.0];

/// The most hashes the largest shadow holds.
pub const MAX_SHADOW_KEYS: usize = 16_384;

/// Sampling thresholds are in units of 2^-24 of the hash space.
const RATE_UNITS: u64 = 1 << 24;

/// The threshold that samples about `rate` of the hash space (at least one
/// unit of it, at most all).
pub(crate) fn threshold_for(rate: f64) -> u64 {
    ((rate * RATE_UNITS as f64) as u64).clamp(1, RATE_UNITS)
}

/// The fraction of the hash space below `threshold`.
pub(crate) fn rate_of(threshold: u64) -> f64 {
    threshold as f64 / RATE_UNITS as f64
}

/// Replaces `out` with the hashes of `chain` sampled at `threshold`, in
/// order (the low bits of a SipHash output are uniform).
pub(crate) fn sample_into(chain: &[u64], threshold: u64, out: &mut Vec<u64>) {
    out.clear();
    out.extend(
        chain
            .iter()
            .copied()
            .filter(|&h| h % RATE_UNITS < threshold),
    );
}

/// One estimated point of the curve.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct HitRateEstimate {
    /// Pool size over the real one.
    pub scale: f64,
    /// The pool size estimated, in blocks.
    pub blocks: u64,
    /// Estimated hit rate, SHARDS-adjusted, in `[0, 1]` (0 before any
    /// sampled lookup).
    pub hit_rate: f64,
    /// Sampled lookups behind the estimate.
    pub sampled_lookups: u64,
}

/// A shadow LRU of sampled hashes.
#[derive(Debug)]
struct Shadow {
    capacity: usize,
    stamp_of: HashMap<u64, u64>,
    by_stamp: BTreeMap<u64, u64>,
    hits: u64,
}

impl Shadow {
    fn new(capacity: usize) -> Self {
        Self {
            capacity,
            stamp_of: HashMap::new(),
            by_stamp: BTreeMap::new(),
            hits: 0,
        }
    }

    fn touch(&mut self, key: u64, stamp: u64) {
        if let Some(old) = self.stamp_of.insert(key, stamp) {
            self.by_stamp.remove(&old);
        }
        self.by_stamp.insert(stamp, key);
    }

    fn shrink(&mut self) {
        while self.stamp_of.len() > self.capacity {
            let Some((_, key)) = self.by_stamp.pop_first() else {
                break;
            };
            self.stamp_of.remove(&key);
        }
    }
}

/// The miss-ratio curve of one pool.
#[derive(Debug)]
pub struct MissRatioCurve {
    blocks: u64,
    /// Sampled when `hash % RATE_UNITS < threshold`.
    threshold: u64,
    shadows: Vec<Shadow>,
    /// Sampled lookups.
    lookups: u64,
    /// Every lookup, sampled or not.
    seen: u64,
    clock: u64,
    sampled: Vec<u64>,
}

impl MissRatioCurve {
    /// A curve for a pool of `blocks` blocks.
    pub fn new(blocks: u32) -> Self {
        let largest = SCALES.iter().copied().fold(1.0, f64::max);
        let want = (largest * f64::from(blocks)).max(1.0);
        let rate = (MAX_SHADOW_KEYS as f64 / want).min(1.0);
        let threshold = threshold_for(rate);
        let shadows = SCALES
            .iter()
            .map(|&s| {
                let keys = s * f64::from(blocks) * rate_of(threshold);
                Shadow::new(keys.round().max(1.0) as usize)
            })
            .collect();
        Self {
            blocks: u64::from(blocks),
            threshold,
            shadows,
            lookups: 0,
            seen: 0,
            clock: 0,
            sampled: Vec::new(),
        }
    }

    /// The fraction of hashes sampled.
    pub fn rate(&self) -> f64 {
        rate_of(self.threshold)
    }

    /// Whether lookups of `hash` are sampled.
    pub fn samples(&self, hash: u64) -> bool {
        // the low bits of a SipHash output are uniform
        hash % RATE_UNITS < self.threshold
    }

    /// One request looked up `chain` (its full-block hashes, parent first).
    pub fn observe(&mut self, chain: &[u64]) {
        self.seen += chain.len() as u64;
        sample_into(chain, self.threshold, &mut self.sampled);
        if self.sampled.is_empty() {
            return;
        }
        debug_assert!(self.sampled.iter().all(|&h| self.samples(h)));
        self.lookups += self.sampled.len() as u64;
        for shadow in &mut self.shadows {
            shadow.hits += self
                .sampled
                .iter()
                .filter(|h| shadow.stamp_of.contains_key(h))
                .count() as u64;
        }
        // deepest first: parents end up the more recent
        for &h in self.sampled.iter().rev() {
            self.clock += 1;
            for shadow in &mut self.shadows {
                shadow.touch(h, self.clock);
            }
        }
        for shadow in &mut self.shadows {
            shadow.shrink();
        }
    }

    /// The estimates, one per [`SCALES`] entry.
    pub fn estimates(&self) -> Vec<HitRateEstimate> {
        // SHARDS_adj: the sampled lookups a fair draw would have given, and
        // the surplus or shortfall of this draw, credited at distance 0.
        let expected = self.seen as f64 * self.rate();
        let correction = expected - self.lookups as f64;
        SCALES
            .iter()
            .zip(&self.shadows)
            .map(|(&scale, shadow)| HitRateEstimate {
                scale,
                blocks: (scale * self.blocks as f64).round() as u64,
                hit_rate: if self.lookups == 0 || expected <= 0.0 {
                    0.0
                } else {
                    ((shadow.hits as f64 + correction) / expected).clamp(0.0, 1.0)
                },
                sampled_lookups: self.lookups,
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn small_pools_are_tracked_exactly_and_large_ones_sampled() {
        let small = MissRatioCurve::new(1024);
        assert_eq!(small.rate(), 1.0);
        let large = MissRatioCurve::new(1 << 20);
        assert!(large.rate() < 0.01);
        let keys: usize = large.shadows.iter().map(|s| s.capacity).sum();
        assert!(keys <= 2 * MAX_SHADOW_KEYS, "{keys}");
    }

    #[test]
    fn a_working_set_between_two_scales_hits_only_in_the_larger() {
        // 8 blocks, reused round robin over a set of 12 distinct ones:
        // LRU at 8 or 4 blocks never hits, at 16 or 32 it always does
        // (after the first round).
        let mut mrc = MissRatioCurve::new(8);
        for round in 0..10 {
            for b in 0..12u64 {
                mrc.observe(&[b.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1]);
            }
            if round == 0 {
                assert!(mrc.estimates().iter().all(|e| e.hit_rate == 0.0));
            }
        }
        let e = mrc.estimates();
        assert_eq!(e[0].hit_rate, 0.0);
        assert_eq!(e[1].hit_rate, 0.0);
        assert!((e[2].hit_rate - 0.9).abs() < 1e-9, "{e:?}");
        assert!((e[3].hit_rate - 0.9).abs() < 1e-9);
        assert_eq!(e[2].blocks, 16);
    }

    /// Every request reads `root`, then a block never read again: the true
    /// hit rate at every size is 1/2.
    fn assert_half_hits(mrc: &mut MissRatioCurve, root: u64) {
        let mut fresh = 1u64;
        for _ in 0..40_000 {
            fresh = fresh
                .wrapping_mul(0x5851_f42d_4c95_7f2d)
                .wrapping_add(0x1405_7b7e_f767_814f);
            mrc.observe(&[root, fresh]);
        }
        for e in mrc.estimates() {
            assert!((e.hit_rate - 0.5).abs() < 0.02, "{e:?}");
        }
    }

    #[test]
    fn a_sampled_block_that_every_request_reads_is_weighed_by_the_rate() {
        // A pool sampled at 1/4 whose every request reads one shared,
        // sampled root and then a fresh block that is never read again: the
        // true hit rate is 1/2 (the root hits from the second request on).
        // Unadjusted, the root's hits are weighed as if every sampled lookup
        // were the root's: about 0.8.
        let mut mrc = MissRatioCurve::new(16_384);
        assert!((mrc.rate() - 0.25).abs() < 1e-6, "{}", mrc.rate());
        let root = (0u64..)
            .map(|i| i.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1)
            .find(|&h| mrc.samples(h));
        assert_half_hits(&mut mrc, root.unwrap_or_default());
    }

    #[test]
    fn a_missed_block_that_every_request_reads_still_counts() {
        // As above with the root not sampled: unadjusted, no sampled lookup
        // ever hits and the estimate is 0.
        let mut mrc = MissRatioCurve::new(16_384);
        let root = (0u64..)
            .map(|i| i.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1)
            .find(|&h| !mrc.samples(h));
        assert_half_hits(&mut mrc, root.unwrap_or_default());
    }

    #[test]
    fn chains_are_evicted_from_the_tail() {
        // A pool of 2 at scale 1: a 3-block chain keeps its 2 head blocks,
        // so the same chain again hits 2 of 3.
        let mut mrc = MissRatioCurve::new(2);
        mrc.observe(&[11, 12, 13]);
        mrc.observe(&[11, 12, 13]);
        let at_1 = mrc.estimates()[1];
        assert_eq!(at_1.sampled_lookups, 6);
        assert!((at_1.hit_rate - 2.0 / 6.0).abs() < 1e-9, "{at_1:?}");
    }
}
