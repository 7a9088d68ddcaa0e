//! Releases the cache does not take at once, through real services on
//! loopback ports: a release is forgotten only once the cache answered it,
//! since a dropped one leaves its blocks held by the live session (kept
//! alive by keep-alives) for as long as it lives, where the leak audit does
//! not see them.
//!
//! - A cache that takes at most 4 entries a batch (`--max-batch 4`) under a
//!   scheduler that runs 16 sequences at once. The scheduler learns the
//!   limit from `OpenSession` and fits every call to it: warm-up's widest
//!   shape (16 sequences) is leased in atomic calls of 4, a step leases at
//!   most 4, a step's 16 extends go in calls of 4. Then the forward pass of
//!   all 16 fails at once (a proxy fails it without passing it on): their 16
//!   releases, more than the cache takes in one call, go in batches of 4.
//!   Every request is answered (recomputed once the worker is tried again).
//! - A cache that refuses every release for a while (a proxy answers
//!   RESOURCE_EXHAUSTED): the releases are kept and sent again, and the
//!   steps' completions and extends, which would otherwise ride the same
//!   `Step` call, go on their own, so requests still run to their end.
//!
//! Afterwards the pools are whole and the leak audit reclaims nothing.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed unwrap fails the test

use std::time::Duration;

use kvlease_integration_tests::{
    GROUP, assert_cache_sound, collect, pool_stats, scheduler_client, small_worker,
    small_worker_with, start_cache, start_scheduler, start_worker, tap,
};
use kvlease_proto::v1 as pb;

const WITHIN: Duration = Duration::from_secs(60);
/// The cache's batch limit.
const LIMIT: usize = 4;
/// Requests running at once: four times the limit.
const REQUESTS: usize = 16;
/// Long enough that none ends between the moment all 16 run and the pass
/// that fails.
const MAX_TOKENS: u32 = 200;

fn prompt(i: usize) -> Vec<u32> {
    (0..8)
        .map(|t| ((i * 31 + t * 7) % 250 + 1) as u32)
        .collect()
}

async fn releases_past_the_limit_are_split_and_none_is_lost(overlap: bool) {
    let cache = start_cache(cache_svc::Config {
        max_batch: LIMIT,
        ..cache_svc::Config::default()
    })
    .await
    .unwrap();
    // about 900 blocks a pool: 16 requests of 208 tokens fit side by side
    let worker = start_worker(small_worker_with(16, 192)).await.unwrap();
    let (proxy, faults) = tap::start_faulty(worker.addr).await.unwrap();
    let config = scheduler_svc::Config {
        max_seqs: REQUESTS as u32,
        max_tokens: 256,
        max_context: 512,
        overlap,
        ..scheduler_svc::Config::default()
    };
    let scheduler = start_scheduler(config, &cache.url(), &[proxy.url()], WITHIN)
        .await
        .unwrap();
    let client = scheduler_client(scheduler.addr).await.unwrap();
    let mut tasks = Vec::new();
    for i in 0..REQUESTS {
        let mut c = client.clone();
        tasks.push(tokio::spawn(async move {
            let req = pb::GenerateRequest {
                tokens: prompt(i),
                max_tokens: MAX_TOKENS,
                ..Default::default()
            };
            collect(&mut c, req).await
        }));
    }
    // all 16 running (admitted 4 a step), then their next pass fails
    let mut status = client.clone();
    let deadline = tokio::time::Instant::now() + WITHIN;
    loop {
        let s = status
            .get_status(pb::GetStatusRequest {})
            .await
            .unwrap()
            .into_inner();
        if s.running as usize == REQUESTS {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the 16 requests never ran at once: {s:?}"
        );
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    faults.fail_next(1);
    for (i, task) in tasks.into_iter().enumerate() {
        let g = tokio::time::timeout(Duration::from_secs(120), task)
            .await
            .expect("every request ends in bounded time")
            .expect("task")
            .expect("no request fails at the gRPC level");
        assert_eq!(
            g.finish_reason(),
            pb::FinishReason::Length,
            "request {i}: {}",
            g.message
        );
        assert_eq!(g.tokens.len(), MAX_TOKENS as usize, "request {i}");
        assert_eq!(g.preemptions, 1, "request {i} was in the pass that failed");
    }
    assert_eq!(faults.left(), 0, "the failure was injected");
    assert_cache_sound(cache.addr, GROUP, WITHIN).await.unwrap();
    scheduler.stop().await.unwrap();
    proxy.stop().await.unwrap();
    worker.stop().await.unwrap();
    cache.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn releases_past_the_caches_batch_limit_are_split_and_none_is_lost() {
    releases_past_the_limit_are_split_and_none_is_lost(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn releases_past_the_caches_batch_limit_are_split_and_none_is_lost_with_overlap() {
    releases_past_the_limit_are_split_and_none_is_lost(true).await;
}

/// With overlap on, a step's completion and extends ride the `Step` call
/// that carries its releases. While the cache refuses every release, the
/// scheduler sends them on their own: the steps of a running request still
/// complete (so its prompt blocks are published and a second request with
/// the same prompt reuses them), and requests run to their end. The refused
/// releases are kept (their blocks still held, nothing dropped) and go
/// through once the cache takes them again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cache_that_keeps_refusing_releases_holds_back_nothing_else() {
    let cache = start_cache(cache_svc::Config::default()).await.unwrap();
    let (refusing, refusals) = tap::start_refusing_cache(cache.addr).await.unwrap();
    let worker = start_worker(small_worker()).await.unwrap();
    let config = scheduler_svc::Config {
        max_context: 256,
        max_tokens: 64,
        overlap: true,
        ..scheduler_svc::Config::default()
    };
    let scheduler = start_scheduler(config, &refusing.url(), &[worker.url()], WITHIN)
        .await
        .unwrap();
    refusals.refuse_releases(true);
    let mut client = scheduler_client(scheduler.addr).await.unwrap();
    let generate = |tokens: Vec<u32>, max_tokens: u32| pb::GenerateRequest {
        tokens,
        max_tokens,
        ..Default::default()
    };
    // a request that ends: from now on a release waits, refused at every try
    let first = collect(&mut client, generate(prompt(0), 4)).await.unwrap();
    assert_eq!(first.finish_reason(), pb::FinishReason::Length);
    // a long request, running while the release is refused
    let shared: Vec<u32> = (0..50).map(|t| (t * 13 + 5) % 250 + 1).collect();
    let mut running = client
        .generate(generate(shared.clone(), 48))
        .await
        .unwrap()
        .into_inner();
    let mut tokens = 0;
    while tokens < 5 {
        let msg = tokio::time::timeout(WITHIN, running.message())
            .await
            .expect("the running request streams while releases are refused")
            .unwrap()
            .expect("not ended yet");
        tokens += msg.tokens.len();
    }
    // its prefill's step completed (with the release refused) and
    // published its prompt blocks
    let second = tokio::time::timeout(WITHIN, collect(&mut client, generate(shared, 4)))
        .await
        .expect("a request ends while releases are refused")
        .unwrap();
    assert_eq!(second.finish_reason(), pb::FinishReason::Length);
    assert_eq!(second.reused_tokens, 48, "the first 3 blocks of the prompt");
    while let Some(msg) = tokio::time::timeout(WITHIN, running.message())
        .await
        .expect("the running request ends while releases are refused")
        .unwrap()
    {
        tokens += msg.tokens.len();
        if msg.finish_reason != 0 {
            assert_eq!(msg.finish_reason, pb::FinishReason::Length as i32);
        }
    }
    assert_eq!(tokens, 48);
    assert!(refusals.refused() > 0, "releases were refused");
    let held: u32 = pool_stats(cache.addr, GROUP)
        .await
        .unwrap()
        .iter()
        .map(|p| p.in_use + p.fenced)
        .sum();
    assert!(held > 0, "the refused releases' blocks are still held");
    refusals.refuse_releases(false);
    assert_cache_sound(cache.addr, GROUP, WITHIN).await.unwrap();
    scheduler.stop().await.unwrap();
    worker.stop().await.unwrap();
    refusing.stop().await.unwrap();
    cache.stop().await.unwrap();
}
