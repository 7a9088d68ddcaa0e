//! Peer pull: the domain types of a copy from another group's device
//! blocks, and the cost model that decides between pulling blocks and
//! computing them.
//!
//! The model is deliberately small, with every figure in the grant (and
//! its trace) so that it can be checked against what a pull really took:
//! pulling `n` blocks of `bytes` bytes each (every pool of the group
//! together) costs `overhead + n * bytes / link`, computing them
//! `n * tokens_per_block / prefill`; the lease pulls when the first is
//! smaller. The rates come from the holder, which measures them (or is
//! configured with them).

use crate::ids::BlockId;

/// The rates a lease's peer-pull decision uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PeerRates {
    /// Bytes per second of the link between workers (> 0).
    pub link_bytes_per_s: u64,
    /// Prefill tokens per second of the lease's group (> 0).
    pub prefill_tokens_per_s: u64,
    /// Fixed cost of one pull, in microseconds.
    pub overhead_us: u64,
}

/// What a lease's cost model weighed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PeerDecision {
    /// The peer group with the longest run of the prompt's blocks.
    pub src_group: String,
    /// Blocks it could bring (block indices of the sequence).
    pub blocks: u32,
    /// Their bytes, every pool of the group.
    pub bytes: u64,
    /// Estimated microseconds to pull them.
    pub pull_us: u64,
    /// Estimated microseconds to compute them instead.
    pub recompute_us: u64,
    /// Whether the grant pulls them.
    pub pulled: bool,
    /// A hand-off (`SeqSpec::handoff_of`): pulled whatever the figures.
    pub forced: bool,
}

/// One block to copy from a peer group's device into this sequence's own.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PeerCopy {
    /// The destination pool's id and window.
    pub pool_id: u32,
    /// The destination pool's window (0 = full).
    pub window: u32,
    /// The sequence's block to write.
    pub dst_block: BlockId,
    /// The source group.
    pub src_group: String,
    /// The source pool's id (same window).
    pub src_pool_id: u32,
    /// The source block, pinned until the lease's step completes.
    pub src_block: BlockId,
    /// The grant's transfer id.
    pub transfer_id: u64,
    /// Slots to copy from the block's first (0: the whole block; a
    /// hand-off's partly filled last block).
    pub tokens: u32,
}

/// Decides whether to pull `blocks` blocks of `bytes` bytes (all of them
/// together) rather than compute their `blocks * tokens_per_block` tokens.
pub fn decide(
    rates: &PeerRates,
    src_group: &str,
    blocks: u32,
    bytes: u64,
    tokens_per_block: u32,
) -> PeerDecision {
    let micros = |amount: u128, per_s: u64| -> u64 {
        let per_s = u128::from(per_s.max(1));
        u64::try_from((amount * 1_000_000).div_ceil(per_s)).unwrap_or(u64::MAX)
    };
    let pull_us = rates
        .overhead_us
        .saturating_add(micros(u128::from(bytes), rates.link_bytes_per_s));
    let tokens = u128::from(blocks) * u128::from(tokens_per_block);
    let recompute_us = micros(tokens, rates.prefill_tokens_per_s);
    PeerDecision {
        src_group: src_group.to_owned(),
        blocks,
        bytes,
        pull_us,
        recompute_us,
        pulled: blocks > 0 && pull_us < recompute_us,
        forced: false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rates(link: u64, prefill: u64, overhead_us: u64) -> PeerRates {
        PeerRates {
            link_bytes_per_s: link,
            prefill_tokens_per_s: prefill,
            overhead_us,
        }
    }

    #[test]
    fn pulls_when_moving_the_bytes_costs_less_than_computing_the_tokens() {
        // 10 blocks of 16 tokens, 1 MB each: 10 MB at 1 GB/s is 10 ms plus
        // 1 ms; 160 tokens at 1000 tok/s is 160 ms
        let d = decide(
            &rates(1_000_000_000, 1_000, 1_000),
            "g/a",
            10,
            10_000_000,
            16,
        );
        assert_eq!(
            (d.pull_us, d.recompute_us, d.pulled),
            (11_000, 160_000, true)
        );
        assert_eq!(
            (d.src_group.as_str(), d.blocks, d.bytes),
            ("g/a", 10, 10_000_000)
        );
        // a slow link: 10 MB at 10 MB/s is a second
        let d = decide(&rates(10_000_000, 1_000, 0), "g/a", 10, 10_000_000, 16);
        assert_eq!(
            (d.pull_us, d.recompute_us, d.pulled),
            (1_000_000, 160_000, false)
        );
    }

    #[test]
    fn the_overhead_decides_for_short_runs_and_nothing_is_never_pulled() {
        let r = rates(1_000_000_000, 10_000, 5_000);
        // one block of 16 tokens computes in 1.6 ms: under the 5 ms overhead
        assert!(!decide(&r, "g", 1, 1_000, 16).pulled);
        // 100 blocks compute in 160 ms: pulling 100 kB costs 5.1 ms
        assert!(decide(&r, "g", 100, 100_000, 16).pulled);
        assert!(!decide(&rates(u64::MAX, 1, 0), "g", 0, 0, 16).pulled);
    }

    #[test]
    fn huge_figures_saturate_instead_of_overflowing() {
        let d = decide(&rates(1, 1, u64::MAX), "g", u32::MAX, u64::MAX, 65_536);
        assert_eq!(d.pull_us, u64::MAX);
        assert!(!d.pulled);
    }
}
