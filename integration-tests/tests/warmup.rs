//! The warm-up scenario: a pool too small for one warm-up shape fails
//! start-up with a clear error in bounded time and leaves the pool whole;
//! draft tokens are counted in the warm-up estimate; an atomic warm-up lease
//! that is refused takes nothing; a warm-up longer than the session TTL keeps
//! the session.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed unwrap fails the test

use std::time::Duration;

use kvlease_integration_tests::*;
use kvlease_proto::v1 as pb;

/// Blocks in the small worker's full-attention pool (what its budget leaves
/// after weights and activations; 23 of 16 tokens today), from `Describe`,
/// so the scenarios below sit exactly at the pool's edge.
async fn full_pool_blocks(worker: &Service) -> u32 {
    let mut w = worker_client(worker.addr).await.unwrap();
    let d = w
        .describe(pb::DescribeRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(d.tokens_per_block, 16);
    let pool = d
        .pools
        .iter()
        .find(|p| p.window == 0)
        .expect("a full-attention pool");
    assert!(pool.num_blocks < 32, "the 512-token context must not fit");
    pool.num_blocks
}

fn scheduler(max_context: u32, spec_draft_k: u32) -> scheduler_svc::Config {
    scheduler_svc::Config {
        max_context,
        max_tokens: 64,
        max_seqs: 8,
        max_tokens_per_step: 192,
        spec_draft_k,
        warmup_deadline_ms: 30_000,
        ..scheduler_svc::Config::default()
    }
}

async fn start_up(
    config: scheduler_svc::Config,
    cache: &Service,
    worker: &Service,
) -> Result<(), scheduler_svc::Error> {
    let (cache, workers) = (cache.url(), [worker.url()]);
    let bounded = tokio::time::timeout(
        Duration::from_secs(60),
        run_scheduler_start(config, &cache, &workers),
    );
    bounded.await.expect("start-up ends in bounded time")
}

async fn assert_whole(cache: &Service) {
    let pools = pool_stats(cache.addr, GROUP).await.unwrap();
    assert_eq!(pools.len(), 2, "both pools registered");
    for p in pools {
        assert_eq!(
            (p.in_use, p.fenced),
            (0, 0),
            "pool of window {} left whole",
            p.window
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pool_too_small_for_the_longest_shape_fails_start_up_and_stays_whole() {
    let cache = start_cache(cache_svc::Config::default()).await.unwrap();
    let worker = start_worker(small_worker()).await.unwrap();
    let blocks = full_pool_blocks(&worker).await;
    let started = std::time::Instant::now();
    let err = start_up(scheduler(512, 0), &cache, &worker).await.err();
    assert!(started.elapsed() < Duration::from_secs(30));
    let message = err.as_ref().map(ToString::to_string).unwrap_or_default();
    assert!(
        matches!(err, Some(scheduler_svc::Error::WarmupDoesNotFit { ref shape, window: 0, needed: 32, available, .. }) if shape == "longest" && available == blocks),
        "{message}"
    );
    assert!(
        message.contains("start-up aborted") && message.contains("needs 32 blocks"),
        "{message}"
    );
    assert_whole(&cache).await;
}

/// A context of 16 x blocks + 1 (its last token is never written) fills the
/// pool exactly; four draft slots need one block more. A warm-up that forgot
/// the drafts would start here.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn draft_tokens_are_counted_in_the_warm_up_estimate() {
    let cache = start_cache(cache_svc::Config::default()).await.unwrap();
    let worker = start_worker(small_worker()).await.unwrap();
    let blocks = full_pool_blocks(&worker).await;
    let max_context = blocks * 16 + 1;
    // without speculation the same limits fit, and the warm-up really runs
    let ok = start_up(scheduler(max_context, 0), &cache, &worker).await;
    assert!(ok.is_ok(), "{ok:?}");
    assert_whole(&cache).await;
    // warm-up traffic stays out of the hit-rate figures
    for p in pool_stats(cache.addr, GROUP).await.unwrap() {
        assert_eq!(
            (p.reuse_lookups, p.reuse_hits),
            (0, 0),
            "window {}",
            p.window
        );
        assert!(p.grants > 0, "warm-up leased in window {}", p.window);
    }
    let err = start_up(scheduler(max_context, 4), &cache, &worker)
        .await
        .err();
    let message = err.as_ref().map(ToString::to_string).unwrap_or_default();
    assert!(
        matches!(
            err,
            Some(scheduler_svc::Error::WarmupDoesNotFit {
                window: 0,
                needed,
                available,
                ..
            }) if needed == blocks + 1 && available == blocks
        ),
        "{message}"
    );
    assert!(message.contains("4 draft tokens"), "{message}");
    assert_whole(&cache).await;
}

/// Another holder keeps half of the full pool: the estimate fits (it is
/// about empty pools) but the atomic warm-up lease is refused, start-up
/// fails, and the pool holds exactly the other holder's blocks afterwards.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_atomic_warm_up_takes_nothing() {
    let cache = start_cache(cache_svc::Config::default()).await.unwrap();
    let worker = start_worker(small_worker()).await.unwrap();
    let mut w = worker_client(worker.addr).await.unwrap();
    let d = w
        .describe(pb::DescribeRequest {})
        .await
        .unwrap()
        .into_inner();
    let mut c = cache_client(cache.addr).await.unwrap();
    c.register_pool(pb::RegisterPoolRequest {
        pool_group: GROUP.into(),
        tokens_per_block: d.tokens_per_block.into(),
        pools: d
            .pools
            .iter()
            .map(|p| pb::PoolSpec {
                host_blocks: 0,
                window: p.window.into(),
                num_blocks: p.num_blocks.into(),
                ..Default::default()
            })
            .collect(),
        ..Default::default()
    })
    .await
    .unwrap();
    kvlease_integration_tests::hold_blocks(&mut c, "squatter", 160)
        .await
        .unwrap();
    let held = pool_stats(cache.addr, GROUP).await.unwrap();

    let blocks = full_pool_blocks(&worker).await;
    let err = start_up(scheduler(blocks * 16 + 1, 0), &cache, &worker)
        .await
        .err();
    let message = err.as_ref().map(ToString::to_string).unwrap_or_default();
    assert!(
        matches!(err, Some(scheduler_svc::Error::WarmupRejected { .. })),
        "{message}"
    );
    assert!(message.contains("pool exhausted"), "{message}");
    let after = pool_stats(cache.addr, GROUP).await.unwrap();
    for (b, a) in held.iter().zip(&after) {
        assert_eq!(
            (a.in_use, a.fenced),
            (b.in_use, b.fenced),
            "window {}: warm-up left nothing",
            a.window
        );
    }
    assert!(after.iter().any(|p| p.in_use == 10), "{after:?}");
}

/// A worker that takes far longer than the warm-up deadline: start-up fails
/// with the deadline error in bounded time and the pools are whole again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn warm_up_past_its_deadline_fails_in_bounded_time() {
    let cache = start_cache(cache_svc::Config::default()).await.unwrap();
    let worker = start_worker(small_worker()).await.unwrap();
    let (cache_tap, slow_worker, _log) = kvlease_integration_tests::tap::start_taps(
        cache.addr,
        worker.addr,
        Duration::from_secs(30),
    )
    .await
    .unwrap();
    let config = scheduler_svc::Config {
        warmup_deadline_ms: 500,
        ..scheduler(256, 0)
    };
    let started = std::time::Instant::now();
    let err = start_up(config, &cache_tap, &slow_worker).await.err();
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
    assert!(
        matches!(
            err,
            Some(scheduler_svc::Error::WarmupDeadline { deadline_ms: 500 })
        ),
        "{err:?}"
    );
    assert_whole(&cache).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_warm_up_longer_than_the_session_ttl_keeps_the_session() {
    let cache = start_cache(cache_svc::Config::default()).await.unwrap();
    let worker = start_worker(small_worker()).await.unwrap();
    let (gated, gate) = tap::start_gate(worker.addr).await.unwrap();
    let config = scheduler_svc::Config {
        session_ttl_ms: 1_000,
        ..scheduler(256, 0)
    };
    // the first warm-up forward pass is held for three TTLs: without
    // renewals the cache expires the session meanwhile, and the warm-up's
    // release and CompleteStep fail with FAILED_PRECONDITION
    gate.close();
    let (cache_url, workers) = (cache.url(), [gated.url()]);
    let start = tokio::spawn(async move {
        tokio::time::timeout(
            Duration::from_secs(60),
            run_scheduler_start(config, &cache_url, &workers),
        )
        .await
    });
    gate.holding().await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    gate.open();
    let started = start.await.unwrap().expect("start-up ends in bounded time");
    assert!(started.is_ok(), "{started:?}");
    assert_whole(&cache).await;
}
