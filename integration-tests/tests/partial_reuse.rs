//! Partial-block reuse through a real cluster (cache, CPU worker, scheduler
//! on loopback ports): a second conversation turn repeats the first turn's
//! context, which ended mid-block. With partial reuse the cache grants the
//! full blocks plus a copy of the slots the first turn wrote into its last
//! block, so the scheduler computes that many fewer prompt tokens; the
//! greedy output equals a cluster's with partial reuse off.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed unwrap fails the test

use std::time::Duration;

use kvlease_integration_tests::{
    GROUP, Generated, collect, scheduler_client, small_worker, start_small_cluster, wait_whole,
};
use kvlease_proto::v1 as pb;

const WITHIN: Duration = Duration::from_secs(60);
/// The small worker's block size.
const BLOCK: u32 = 16;

/// Runs turn 1 (21 prompt tokens, 6 generated) and turn 2 (turn 1's prompt
/// and output, then 5 new tokens) on a fresh cluster.
async fn two_turns(partial_reuse: bool) -> (Generated, Generated) {
    let config = cache_svc::Config {
        partial_reuse,
        ..cache_svc::Config::default()
    };
    let (cache, worker, scheduler) = start_small_cluster(config, small_worker()).await.unwrap();
    let mut client = scheduler_client(scheduler.addr).await.unwrap();
    let request = |tokens: Vec<u32>| pb::GenerateRequest {
        tokens,
        max_tokens: 6,
        ..Default::default()
    };
    let prompt: Vec<u32> = (0..21).map(|i| (i * 7 + 3) % 250 + 1).collect();
    let turn1 = collect(&mut client, request(prompt.clone())).await.unwrap();
    assert_eq!(
        turn1.finish_reason(),
        pb::FinishReason::Length,
        "{}",
        turn1.message
    );
    // Turn 1's release and the CompleteStep after it: its blocks are cached.
    wait_whole(cache.addr, GROUP, WITHIN).await.unwrap();
    let mut next = prompt;
    next.extend(&turn1.tokens);
    next.extend([9, 8, 7, 6, 5]);
    let turn2 = collect(&mut client, request(next)).await.unwrap();
    assert_eq!(
        turn2.finish_reason(),
        pb::FinishReason::Length,
        "{}",
        turn2.message
    );
    let pools = wait_whole(cache.addr, GROUP, WITHIN).await.unwrap();
    for p in &pools {
        assert_eq!((p.in_use, p.fenced), (0, 0), "{p:?}");
        assert_eq!(p.free + p.cached_evictable, p.total, "{p:?}");
    }
    scheduler.stop().await.unwrap();
    worker.stop().await.unwrap();
    cache.stop().await.unwrap();
    (turn1, turn2)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_turn_copies_the_first_turns_partial_block_instead_of_recomputing_it() {
    let (on1, on2) = two_turns(true).await;
    let (off1, off2) = two_turns(false).await;
    // Turn 1 wrote K/V for its 21 prompt tokens and the 5 generated tokens
    // it fed back (the 6th was never fed): 26 positions, one full block and
    // k = 10 slots of the next.
    let k = 21 + 5 - BLOCK;
    assert_eq!(off2.reused_tokens, BLOCK, "full blocks only");
    assert_eq!(
        on2.reused_tokens,
        BLOCK + k,
        "the copied slots are not recomputed"
    );
    let recomputed = |g: &Generated| g.prompt_tokens - g.reused_tokens;
    assert_eq!(recomputed(&off2) - recomputed(&on2), k);
    // The same greedy tokens, turn by turn.
    assert_eq!(on1.tokens, off1.tokens);
    assert_eq!(on2.tokens, off2.tokens);
}
