//! The cache's online miss-ratio curve on a trace whose every request opens
//! with the same block (a system prompt shared by every session), at pool
//! sizes where the curve samples: each estimate against an LRU replay of the
//! trace at that size (the replay simulator shares none of the cache's code).

use cache_svc::mrc::MissRatioCurve;
use kvlease::replay::conversations::Conversations;
use kvlease::replay::sim::{self, Victim};

/// A shared-root conversation trace whose root block the curve of a
/// `blocks` pool samples (or not), with its chain keys.
fn shared_root_trace(blocks: u32, root_sampled: bool) -> Vec<Vec<u64>> {
    let curve = MissRatioCurve::new(blocks);
    (1u64..)
        .map(|seed| {
            let shape = Conversations {
                sessions: 6_000,
                shared_root_blocks: 1,
                system_prompts: 400,
                max_turns: 6,
                seed,
                ..Conversations::default()
            };
            let ids: Vec<Vec<u64>> = shape.records().into_iter().map(|r| r.hash_ids).collect();
            sim::chain_keys(&ids)
        })
        .find(|chains| curve.samples(chains[0][0]) == root_sampled)
        .unwrap_or_default()
}

fn assert_estimates_match_replays(blocks: u32, root_sampled: bool) {
    let chains = shared_root_trace(blocks, root_sampled);
    let mut curve = MissRatioCurve::new(blocks);
    assert!(curve.rate() < 1.0, "the curve samples at {blocks} blocks");
    for chain in &chains {
        curve.observe(chain);
    }
    let distinct: std::collections::HashSet<u64> = chains.iter().flatten().copied().collect();
    for e in curve.estimates() {
        let replayed = sim::simulate(&chains, e.blocks, Victim::Lru, 1).hit_rate();
        println!(
            "{blocks} blocks, root sampled {root_sampled}, {} distinct: scale {} ({} blocks) estimated {:.4}, replayed {replayed:.4}",
            distinct.len(),
            e.scale,
            e.blocks,
            e.hit_rate
        );
        assert!(
            (e.hit_rate - replayed).abs() <= 0.02,
            "{blocks} blocks, root sampled {root_sampled}, scale {}: estimated {} vs replayed {replayed}",
            e.scale,
            e.hit_rate
        );
    }
}

#[test]
fn estimates_hold_on_a_shared_root_at_16k_blocks() {
    assert_estimates_match_replays(16_384, true);
    assert_estimates_match_replays(16_384, false);
}

#[test]
fn estimates_hold_on_a_shared_root_at_64k_blocks() {
    assert_estimates_match_replays(65_536, true);
    assert_estimates_match_replays(65_536, false);
}
