//! The cache's online miss-ratio curve (`cache_svc::mrc`, the core behind
//! `GetStats.hit_rate_estimates`) on a trace whose every request opens with
//! the same block (a system prompt every session shares), at pool sizes where
//! the curve samples (16k and 64k blocks): each estimate, at 0.5x, 1x, 2x and
//! 4x, within 0.02 of the reference LRU replayed at that size (the simulator
//! that equals the service's LRU block for block, see `cache_replay.rs`; it
//! shares none of the curve's code). Issue 28, point 3.
//!
//! The curve is driven directly with the trace's chains, not over gRPC, and
//! each size is replayed once for every case, so the test stays in seconds.
//! A block's sampling depends on its hash alone, so each case renames the
//! trace's keys with a salt (a bijection: the replays are the same) chosen so
//! the shared root is sampled, or not: SHARDS' two failure modes.

use std::collections::BTreeMap;

use cache_svc::mrc::MissRatioCurve;
use kvlease::replay::conversations::Conversations;
use kvlease::replay::sim::{self, Victim};

/// A shared-root conversation trace: about 60k distinct blocks, so the
/// curves of a 16k pool (8k to 64k blocks) and the lower half of a 64k
/// pool's (32k, 64k) see evictions; the rest is capacity beyond the trace,
/// where the estimate must find the infinite-capacity hit rate.
fn shared_root_chains() -> Vec<Vec<u64>> {
    let shape = Conversations {
        sessions: 4_000,
        shared_root_blocks: 1,
        system_prompts: 200,
        think_ms: 400_000.0,
        ..Conversations::default()
    };
    let ids: Vec<Vec<u64>> = shape.records().into_iter().map(|r| r.hash_ids).collect();
    assert!(
        ids.iter().all(|c| c.first() == ids[0].first()),
        "every request opens with the same block"
    );
    sim::chain_keys(&ids)
}

fn rename(key: u64, salt: u64) -> u64 {
    // a bijection of u64 (xor, then an odd multiplier), so equal keys stay
    // equal and different ones different
    (key ^ salt).wrapping_mul(0x9e37_79b9_7f4a_7c15)
}

/// The estimates of a `blocks` pool's curve over `chains` renamed so the
/// shared root is sampled (or not), with the salt used.
fn estimate(chains: &[Vec<u64>], blocks: u32, root_sampled: bool) -> Vec<(u64, f64)> {
    let mut curve = MissRatioCurve::new(blocks);
    assert!(curve.rate() < 1.0, "a {blocks}-block pool's curve samples");
    let root = chains[0][0];
    let salt = (1u64..)
        .find(|&s| curve.samples(rename(root, s)) == root_sampled)
        .unwrap_or_default();
    let mut renamed = Vec::new();
    for chain in chains {
        renamed.clear();
        renamed.extend(chain.iter().map(|&k| rename(k, salt)));
        curve.observe(&renamed);
    }
    curve
        .estimates()
        .into_iter()
        .map(|e| (e.blocks, e.hit_rate))
        .collect()
}

#[test]
fn estimates_hold_within_two_points_on_a_shared_root_at_16k_and_64k_blocks() {
    let chains = shared_root_chains();
    let mut replayed: BTreeMap<u64, f64> = BTreeMap::new();
    let mut failures = Vec::new();
    for blocks in [16_384u32, 65_536] {
        for root_sampled in [true, false] {
            for (size, estimated) in estimate(&chains, blocks, root_sampled) {
                let real = *replayed
                    .entry(size)
                    .or_insert_with(|| sim::simulate(&chains, size, Victim::Lru, 1).hit_rate());
                println!(
                    "pool {blocks}, root sampled {root_sampled:5}: {size:>6} blocks estimated {estimated:.4}, replayed {real:.4}"
                );
                if (estimated - real).abs() > 0.02 {
                    failures.push(format!(
                        "pool {blocks}, root sampled {root_sampled}, {size} blocks: estimated {estimated:.4} vs replayed {real:.4}"
                    ));
                }
            }
        }
    }
    let infinite = sim::simulate(&chains, u64::MAX, Victim::Lru, 1).hit_rate();
    println!("infinite capacity {infinite:.4}");
    // the trace must make the curve's job real: evictions at the small
    // sizes, so the estimates are not all the infinite-capacity rate
    assert!(
        replayed
            .values()
            .next()
            .is_some_and(|&r| r < infinite - 0.05),
        "{replayed:?} vs infinite {infinite}"
    );
    assert!(failures.is_empty(), "{failures:#?}");
}
