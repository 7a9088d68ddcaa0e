//! Retention hints through a real cluster (cache, CPU worker, scheduler on
//! loopback ports): a prompt prefix hinted in `Generate.retain` is still
//! reused after a flood of one-off prompts that evicts an unhinted prompt of
//! the same size; a hint past the tenant's quota is clamped and the first
//! response says so; malformed hints are INVALID_ARGUMENT naming the field.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed unwrap fails the test

use std::time::Duration;

use kvlease_integration_tests::{
    GROUP, Service, collect, pool_stats, scheduler_client, small_worker, start_small_cluster,
    wait_whole,
};
use kvlease_proto::v1 as pb;

const WITHIN: Duration = Duration::from_secs(60);
/// The small worker's block size.
const BLOCK: u32 = 16;
/// Prompt length of every request: 5 full blocks and one token.
const PROMPT: u32 = 5 * BLOCK + 1;

fn prompt(seed: u32) -> Vec<u32> {
    (0..PROMPT).map(|i| (seed * 31 + i * 7) % 250 + 1).collect()
}

fn request(seed: u32, retain: Option<pb::RetainPrefix>) -> pb::GenerateRequest {
    pb::GenerateRequest {
        tokens: prompt(seed),
        max_tokens: 2,
        retain,
        ..Default::default()
    }
}

fn hint(tokens: u32) -> Option<pb::RetainPrefix> {
    Some(pb::RetainPrefix {
        tokens,
        priority: 50,
        ttl_s: 600,
    })
}

/// A cache whose tenants may hold `percent`% of each pool under hints, a
/// small CPU worker and a scheduler over them.
async fn cluster(percent: u32) -> (Service, Service, Service) {
    let cache = cache_svc::Config {
        retention_percent: percent,
        ..cache_svc::Config::default()
    };
    start_small_cluster(cache, small_worker()).await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hinted_prefix_survives_a_flood_that_evicts_an_unhinted_one() {
    let (cache, worker, scheduler) = cluster(50).await;
    let mut client = scheduler_client(scheduler.addr).await.unwrap();

    let hinted = collect(&mut client, request(1, hint(4 * BLOCK)))
        .await
        .unwrap();
    assert_eq!(hinted.retained_tokens, 4 * BLOCK, "{}", hinted.message);
    let plain = collect(&mut client, request(2, None)).await.unwrap();
    assert_eq!(plain.retained_tokens, 0);
    let pools = wait_whole(cache.addr, GROUP, WITHIN).await.unwrap();
    // one-off prompts enough to fill every pool twice over
    let total = pools.iter().map(|p| p.total).max().unwrap();
    for seed in 0..2 * total / 5 {
        let g = collect(&mut client, request(1_000 + seed, None))
            .await
            .unwrap();
        assert_eq!(g.finish_reason(), pb::FinishReason::Length, "{}", g.message);
    }
    wait_whole(cache.addr, GROUP, WITHIN).await.unwrap();
    let evictions: u64 = pool_stats(cache.addr, GROUP)
        .await
        .unwrap()
        .iter()
        .map(|p| p.evictions)
        .sum();
    assert!(
        evictions > u64::from(total),
        "the flood evicted: {evictions}"
    );
    let again = collect(&mut client, request(1, None)).await.unwrap();
    assert_eq!(again.reused_tokens, 4 * BLOCK, "the hinted prefix is whole");
    let again = collect(&mut client, request(2, None)).await.unwrap();
    assert_eq!(again.reused_tokens, 0, "the unhinted prompt was evicted");

    // The quota (half the smallest pool) soon has room for less than a
    // whole 5-block hint more: clamped, answered, not refused.
    let smallest = pools.iter().map(|p| p.total).min().unwrap();
    let room = smallest / 2 - 4;
    let mut clamped = None;
    for seed in 3..3 + smallest {
        let g = collect(&mut client, request(seed, hint(5 * BLOCK)))
            .await
            .unwrap();
        assert_eq!(g.finish_reason(), pb::FinishReason::Length, "{}", g.message);
        if g.retained_tokens < 5 * BLOCK {
            clamped = Some((seed, g.retained_tokens));
            break;
        }
    }
    let (seed, retained) = clamped.expect("the quota clamps a hint");
    assert_eq!((seed - 3) * 5 + retained / BLOCK, room, "hinted blocks");

    scheduler.stop().await.unwrap();
    worker.stop().await.unwrap();
    cache.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_hints_are_invalid_argument_naming_the_field() {
    let (cache, worker, scheduler) = cluster(25).await;
    let mut client = scheduler_client(scheduler.addr).await.unwrap();
    let bad = |tokens, priority, ttl_s| {
        request(
            1,
            Some(pb::RetainPrefix {
                tokens,
                priority,
                ttl_s,
            }),
        )
    };
    for (r, field) in [
        (bad(PROMPT + 1, 0, 60), "retain.tokens"),
        (bad(0, 0, 60), "retain.tokens"),
        (bad(BLOCK, 101, 60), "retain.priority"),
        (bad(BLOCK, 0, 0), "retain.ttl_s"),
        (bad(BLOCK, 0, 86_401), "retain.ttl_s"),
    ] {
        let status = collect(&mut client, r).await.expect_err(field);
        assert_eq!(status.code(), tonic::Code::InvalidArgument, "{status:?}");
        assert_eq!(
            kvlease_integration_tests::invalid_field(&status),
            Some(field),
            "{status:?}"
        );
    }
    scheduler.stop().await.unwrap();
    worker.stop().await.unwrap();
    cache.stop().await.unwrap();
}
