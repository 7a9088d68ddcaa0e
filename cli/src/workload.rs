//! Requests to send: a synthetic workload with shared prefixes, and the
//! deterministic token expansion that Mooncake traces use as well.

use std::time::Duration;

/// One request of a workload, ready to send as `Generate`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request {
    /// Position in the workload (0-based); also the request id.
    pub index: usize,
    /// When to send it, from the start of the run; `None` = as soon as a
    /// concurrency slot is free (or as the rate allows).
    pub at: Option<Duration>,
    /// Prompt token ids (bytes 1..=255: never BOS, EOS or a NUL byte).
    pub tokens: Vec<u32>,
    /// Output tokens to generate at most.
    pub max_tokens: u32,
}

/// A synthetic workload: `requests` prompts built from `prefixes` shared
/// prefixes (so prefix reuse appears) plus a unique tail each.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Synthetic {
    pub requests: usize,
    /// Shared prefixes to draw from; 0 makes every prompt unique.
    pub prefixes: u32,
    /// Length of each shared prefix in tokens.
    pub prefix_tokens: u32,
    /// Length of each unique tail: uniform in `[tail_min, tail_max]`.
    pub tail_min: u32,
    pub tail_max: u32,
    /// Output length: uniform in `[output_min, output_max]`.
    pub output_min: u32,
    pub output_max: u32,
    pub seed: u64,
}

impl Default for Synthetic {
    fn default() -> Self {
        Self {
            requests: 100,
            prefixes: 4,
            prefix_tokens: 64,
            tail_min: 16,
            tail_max: 96,
            output_min: 8,
            output_max: 32,
            seed: 1,
        }
    }
}

impl Synthetic {
    /// The requests, in order; the same config always gives the same requests.
    pub fn requests(&self) -> Vec<Request> {
        let mut rng = SplitMix64(self.seed);
        (0..self.requests)
            .map(|index| {
                let mut tokens = Vec::new();
                if self.prefixes > 0 && self.prefix_tokens > 0 {
                    let prefix = rng.below(u64::from(self.prefixes));
                    tokens.extend(block_tokens(prefix, self.prefix_tokens));
                }
                let tail = rng.between(self.tail_min, self.tail_max);
                tokens.extend(block_tokens(self.tail_key(index), tail));
                if tokens.is_empty() {
                    tokens.push(b'a'.into());
                }
                Request {
                    index,
                    at: None,
                    tokens,
                    max_tokens: rng.between(self.output_min, self.output_max).max(1),
                }
            })
            .collect()
    }

    /// The key of request `index`'s tail: from the seed and the index, so
    /// that workloads of different seeds (a warm-up wave and the measured
    /// ones) share no tail; the high bit, which no prefix key has, marks
    /// tails.
    fn tail_key(&self, index: usize) -> u64 {
        let mut rng = SplitMix64(self.seed ^ (index as u64).wrapping_mul(0xd605_bbb5_8c8a_bbbd));
        (1 << 63) | rng.next_u64()
    }
}

/// `len` token ids that depend only on `key`: equal keys give equal tokens,
/// so equal block ids give equal prefixes and the cache can reuse them.
/// Ids are printable-ish bytes in `1..=255`, never BOS (256) or EOS (257).
pub fn block_tokens(key: u64, len: u32) -> impl Iterator<Item = u32> {
    let mut rng = SplitMix64(key ^ 0x6b76_6c65_6173_6521);
    (0..len).map(move |_| (rng.next_u64() % 255) as u32 + 1)
}

/// A small, fast, seeded generator (SplitMix64): deterministic workloads
/// without a dependency.
#[derive(Debug, Clone)]
pub struct SplitMix64(pub u64);

impl SplitMix64 {
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (0 when `n` is 0).
    pub fn below(&mut self, n: u64) -> u64 {
        if n == 0 { 0 } else { self.next_u64() % n }
    }

    /// Uniform in `[lo, hi]`; `lo` when `hi < lo`.
    pub fn between(&mut self, lo: u32, hi: u32) -> u32 {
        if hi <= lo {
            lo
        } else {
            lo + self.below(u64::from(hi - lo) + 1) as u32
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn synthetic_is_deterministic_and_shares_prefixes() {
        let w = Synthetic {
            requests: 40,
            prefixes: 2,
            ..Synthetic::default()
        };
        let a = w.requests();
        assert_eq!(a, w.requests());
        assert_eq!(a.len(), 40);
        let prefix = |r: &Request| r.tokens[..64].to_vec();
        let distinct: std::collections::HashSet<_> = a.iter().map(prefix).collect();
        assert_eq!(distinct.len(), 2, "two shared prefixes");
        for r in &a {
            assert!((64 + 16..=64 + 96).contains(&(r.tokens.len() as u32)));
            assert!((8..=32).contains(&r.max_tokens));
            assert!(r.tokens.iter().all(|&t| (1..=255).contains(&t)));
        }
        // tails differ even under the same prefix
        assert_ne!(a[0].tokens[64..], a[1].tokens[64..]);
    }

    /// With no shared prefix every prompt is unique: within a workload and
    /// across seeds (the bench's warm-up wave and its measured waves), so
    /// the cache finds nothing to reuse, not even a first block.
    #[test]
    fn unique_prompts_share_no_block_within_or_across_seeds() {
        let wave = |seed, requests| Synthetic {
            requests,
            prefixes: 0,
            prefix_tokens: 0,
            tail_min: 18,
            tail_max: 18,
            seed,
            ..Synthetic::default()
        };
        let mut first_blocks = std::collections::HashSet::new();
        for r in wave(2, 256)
            .requests()
            .iter()
            .chain(&wave(1, 1024).requests())
        {
            assert!(
                first_blocks.insert(r.tokens[..16].to_vec()),
                "request {} repeats a first block",
                r.index
            );
        }
        assert_eq!(first_blocks.len(), 1280);
    }

    #[test]
    fn block_tokens_depend_only_on_the_key() {
        let a: Vec<u32> = block_tokens(7, 32).collect();
        let b: Vec<u32> = block_tokens(7, 32).collect();
        let c: Vec<u32> = block_tokens(8, 32).collect();
        assert_eq!(a, b);
        assert_ne!(a, c);
        let short: Vec<u32> = block_tokens(7, 10).collect();
        assert_eq!(short, a[..10]);
    }
}
