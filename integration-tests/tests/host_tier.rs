//! The host-memory tier through a real cluster (cache, CPU worker with a
//! host tier, scheduler on loopback ports): a small device pool is filled
//! past its capacity with distinct prompts, so the first prompt's blocks are
//! evicted; with the tier they were demoted to host memory, and repeating
//! the first prompt onboards its prefix instead of recomputing it (reused
//! tokens > 0, where a cluster without the tier reuses nothing), with the
//! same greedy output as its first, solo run. The pools end whole and the
//! leak audit reclaims nothing.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed unwrap fails the test

use std::time::Duration;

use kvlease_integration_tests::{
    GROUP, Generated, assert_cache_sound, generate_settled, pool_stats, scheduler_client,
    start_tiered_cluster,
};
use kvlease_proto::v1 as pb;

const WITHIN: Duration = Duration::from_secs(60);

fn prompt(i: u32) -> Vec<u32> {
    (0..64).map(|j| (j * 13 + i * 37 + 5) % 250 + 1).collect()
}

struct Run {
    first: Generated,
    again: Generated,
    stats: Vec<pb::PoolStats>,
}

/// The first prompt, six others (each takes 5 of the pool's 20 blocks),
/// then the first again, one at a time, on a fresh cluster whose worker
/// has `host_blocks` host blocks per pool.
async fn fill_and_repeat(host_blocks: u32) -> Run {
    let (cache, worker, scheduler) = start_tiered_cluster(host_blocks).await.unwrap();
    let mut client = scheduler_client(scheduler.addr).await.unwrap();
    let mut generate =
        async |tokens: Vec<u32>| generate_settled(&mut client, cache.addr, tokens, 4).await;
    let first = generate(prompt(0)).await;
    for i in 1..=6 {
        generate(prompt(i)).await;
    }
    let again = generate(prompt(0)).await;
    let stats = pool_stats(cache.addr, GROUP).await.unwrap();
    assert_cache_sound(cache.addr, GROUP, WITHIN).await.unwrap();
    scheduler.stop().await.unwrap();
    worker.stop().await.unwrap();
    cache.stop().await.unwrap();
    Run {
        first,
        again,
        stats,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefix_evicted_from_the_device_comes_back_from_the_host_tier() {
    let tiered = fill_and_repeat(80).await;
    let plain = fill_and_repeat(0).await;

    // Without the tier the first prompt's blocks are gone: nothing reused.
    assert_eq!(plain.again.reused_tokens, 0);
    assert!(
        plain
            .stats
            .iter()
            .all(|p| p.host_total == 0 && p.demotions == 0)
    );
    // With it, its three full prompt blocks come back from host memory.
    assert_eq!(tiered.again.reused_tokens, 48);
    for p in &tiered.stats {
        assert_eq!(p.host_total, 80, "{p:?}");
        assert!(p.demotions > 0 && p.onboards >= 3, "{p:?}");
        assert_eq!((p.host_pending, p.host_pinned), (0, 0), "{p:?}");
        assert_eq!(
            p.host_free + p.host_cached + p.host_pending + p.host_pinned,
            p.host_total
        );
    }
    // The same greedy output as the solo run, and as the recomputed one.
    assert_eq!(tiered.again.tokens, tiered.first.tokens);
    assert_eq!(tiered.again.tokens, plain.again.tokens);
    assert_eq!(tiered.first.tokens, plain.first.tokens);
}

/// The default (pipelined) order sends a step's extends after its launch,
/// so a demotion an extend names cannot ride that step's pass: it rides the
/// next one, and the step completes with it. Five prompts leave the pool
/// full of cached blocks; a long decode then takes blocks at its extends,
/// evicting the first prompt's, which must reach the host tier (none
/// dropped) and come back from it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blocks_evicted_by_a_decodes_extends_reach_the_host_tier() {
    let (cache, worker, scheduler) = start_tiered_cluster(80).await.unwrap();
    let mut client = scheduler_client(scheduler.addr).await.unwrap();
    let first = generate_settled(&mut client, cache.addr, prompt(0), 1).await;
    for i in 1..5 {
        generate_settled(&mut client, cache.addr, prompt(i), 1).await;
    }
    let before = pool_stats(cache.addr, GROUP).await.unwrap();
    let long: Vec<u32> = (0..8).map(|j| j + 3).collect();
    generate_settled(&mut client, cache.addr, long, 64).await;
    let after = pool_stats(cache.addr, GROUP).await.unwrap();
    let again = generate_settled(&mut client, cache.addr, prompt(0), 1).await;
    assert_cache_sound(cache.addr, GROUP, WITHIN).await.unwrap();
    scheduler.stop().await.unwrap();
    worker.stop().await.unwrap();
    cache.stop().await.unwrap();

    for (b, a) in before.iter().zip(&after) {
        // the decode's lease took what was free: its extends evicted
        assert!(a.evictions > b.evictions, "{b:?}\n{a:?}");
        assert!(a.demotions > b.demotions, "{a:?}");
        assert_eq!(a.demotions_dropped, 0, "{a:?}");
    }
    // the first prompt's full blocks come back from the host tier
    assert_eq!(again.reused_tokens, 48);
    assert_eq!(again.tokens, first.tokens);
}
