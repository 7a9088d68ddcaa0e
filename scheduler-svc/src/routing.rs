//! Routing: which worker group (model replica) admits a new request when
//! several could.
//!
//! `kv-aware` (the default) scores each group that could admit the request
//! with a cost in the spirit of NVIDIA Dynamo's KV router, from the cache's
//! own exact index (the `Match` RPC) instead of an approximate one:
//!
//! ```text
//! cost(g) = prefill_weight * prefill_blocks_after_reuse(g) + committed_blocks(g)
//! prefill_blocks_after_reuse(g) = ceil((context - reused_tokens(g)) / tokens_per_block(g))
//! ```
//!
//! and picks the cheapest, ties to the least committed (then the first).
//! `committed_blocks` is what the capacity policy charges the group's running
//! sequences (every pool summed), the load figure admission already keeps.
//! Without a reuse figure for the request (a failed `Match`, or a single
//! group, where there is nothing to choose) the reuse counts as zero in every
//! group, which for groups of equal block size is `least-committed`.
//!
//! `least-committed` ignores reuse: the group with the fewest committed blocks.

use std::fmt;
use std::str::FromStr;

/// How admission picks among the groups that could admit a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Routing {
    /// Lowest `prefill_weight * prefill blocks after reuse + committed blocks`.
    KvAware,
    /// Fewest committed blocks.
    LeastCommitted,
}

impl Routing {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::KvAware => "kv-aware",
            Self::LeastCommitted => "least-committed",
        }
    }
}

impl fmt::Display for Routing {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Routing {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.to_ascii_lowercase().replace('_', "-").as_str() {
            "kv-aware" => Ok(Self::KvAware),
            "least-committed" => Ok(Self::LeastCommitted),
            other => Err(format!(
                "unknown routing policy {other:?} (kv-aware, least-committed)"
            )),
        }
    }
}

/// The weight of a prefill block against a committed block in the
/// `kv-aware` cost: a finite number >= 0 (0 routes by load alone).
#[derive(Debug, Clone, Copy)]
pub struct PrefillWeight(f64);

impl PrefillWeight {
    /// The default: eight blocks of load outweigh one block to prefill. A
    /// group's committed blocks are the whole lives the capacity policy
    /// charges its running sequences, so one running request weighs about
    /// as much as a whole cached prompt saves; at weight 1 a busy group's
    /// cached prefix rarely wins (README, Routing across replicas: the
    /// bench at 1 and at 8).
    pub const DEFAULT: Self = Self(8.0);

    pub fn get(self) -> f64 {
        self.0
    }
}

// A checked finite number: bit equality is value equality (the config
// compares its defaults).
impl PartialEq for PrefillWeight {
    fn eq(&self, other: &Self) -> bool {
        self.0.to_bits() == other.0.to_bits()
    }
}

impl Eq for PrefillWeight {}

impl fmt::Display for PrefillWeight {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

impl FromStr for PrefillWeight {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let w: f64 = s
            .trim()
            .parse()
            .map_err(|e| format!("routing prefill weight {s:?}: {e}"))?;
        if !w.is_finite() || !(0.0..=1e6).contains(&w) {
            return Err(format!(
                "routing prefill weight must be a number from 0 to 1000000, got {s:?}"
            ));
        }
        Ok(Self(w + 0.0)) // -0.0 reads as 0.0
    }
}

/// The routing knobs of the core.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RoutingConfig {
    pub policy: Routing,
    pub prefill_weight: PrefillWeight,
}

impl Default for RoutingConfig {
    fn default() -> Self {
        Self {
            policy: Routing::KvAware,
            prefill_weight: PrefillWeight::DEFAULT,
        }
    }
}

/// One group that could admit the request, as the cost sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Candidate {
    /// Blocks the policy charges the group's sequences (every pool).
    pub committed: u32,
    /// Context tokens the request would compute there (after reuse).
    pub prefill_tokens: u32,
    pub tokens_per_block: u32,
}

impl RoutingConfig {
    /// The cost of `c` (lower is better).
    pub fn cost(&self, c: Candidate) -> f64 {
        match self.policy {
            Routing::LeastCommitted => f64::from(c.committed),
            Routing::KvAware => {
                let blocks = c.prefill_tokens.div_ceil(c.tokens_per_block.max(1));
                self.prefill_weight.get() * f64::from(blocks) + f64::from(c.committed)
            }
        }
    }

    /// Whether `a` is a better pick than `b`: lower cost, ties to the least
    /// committed (and, equal in both, to `b`, the earlier group).
    pub fn better(&self, a: Candidate, b: Candidate) -> bool {
        let (ca, cb) = (self.cost(a), self.cost(b));
        ca < cb || (ca == cb && a.committed < b.committed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cand(committed: u32, prefill_tokens: u32) -> Candidate {
        Candidate {
            committed,
            prefill_tokens,
            tokens_per_block: 16,
        }
    }

    #[test]
    fn kv_aware_weighs_prefill_after_reuse_against_load() {
        let kv = RoutingConfig::default();
        assert_eq!(kv.prefill_weight.get(), 8.0);
        // 160 tokens to compute (10 blocks: 80) on an idle group vs 16 (1
        // block: 8) on a group with 5 blocks committed: the cached one wins
        assert!(kv.better(cand(5, 16), cand(0, 160)));
        // ... unless it is much more loaded (8 + 100 > 80)
        assert!(kv.better(cand(0, 160), cand(100, 16)));
        // equal cost (16 + 2 = 8 + 10): the least committed
        assert!(kv.better(cand(2, 32), cand(10, 16)));
        assert!(!kv.better(cand(10, 16), cand(2, 32)));
        // weight 0: load alone
        let load_only = RoutingConfig {
            prefill_weight: "0".parse().unwrap(),
            ..kv
        };
        assert!(load_only.better(cand(0, 160), cand(5, 16)));
    }

    #[test]
    fn least_committed_ignores_reuse() {
        let lc = RoutingConfig {
            policy: Routing::LeastCommitted,
            ..RoutingConfig::default()
        };
        assert!(lc.better(cand(0, 160), cand(5, 16)));
        assert!(
            !lc.better(cand(5, 0), cand(5, 160)),
            "a tie keeps the earlier group"
        );
    }

    #[test]
    fn flags_parse_and_refuse_nonsense() {
        assert_eq!("kv-aware".parse(), Ok(Routing::KvAware));
        assert_eq!("LEAST_COMMITTED".parse(), Ok(Routing::LeastCommitted));
        assert!("random".parse::<Routing>().is_err());
        assert_eq!(
            "2.5".parse::<PrefillWeight>().map(PrefillWeight::get),
            Ok(2.5)
        );
        for bad in ["-1", "NaN", "inf", "x", "1e9"] {
            assert!(bad.parse::<PrefillWeight>().is_err(), "{bad}");
        }
        let one: PrefillWeight = PrefillWeight::DEFAULT.to_string().parse().unwrap();
        assert_eq!(one, PrefillWeight::DEFAULT);
    }
}
