//! The exhaustion scenario against real cache and worker services:
//! `MAX_UTILIZATION` with prefix reuse at 10x over-subscription. Every
//! request ends (completed, or `REJECTED` with a reason), the step loop is
//! still stepping afterwards, and every pool is whole once the queue drains.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed unwrap fails the test

use std::time::Duration;

use kvlease_integration_tests::*;
use kvlease_proto::v1 as pb;
use scheduler_svc::policy::{OnExhausted, Policy};

const PREFIX: usize = 32;
const SUFFIX: usize = 16;
const MAX_TOKENS: u32 = 48;

fn prompt(i: usize) -> Vec<u32> {
    let mut p: Vec<u32> = (0..PREFIX as u32).map(|t| t * 7 % 250 + 1).collect();
    p.extend((0..SUFFIX).map(|t| ((i * 31 + t * 13) % 250 + 1) as u32));
    p
}

struct Outcome {
    results: Vec<Generated>,
    steps_after: u64,
    status: pb::GetStatusResponse,
    pools: Vec<pb::PoolStats>,
    total_blocks: u32,
}

async fn over_subscribe(policy: Policy, on_exhausted: OnExhausted, overlap: bool) -> Outcome {
    let config = scheduler_svc::Config {
        policy,
        on_exhausted,
        overlap,
        max_preemptions: 3,
        // room for every request the first steps find queued: they grow
        // together, so the overlap order's mid-flight refusals reach
        // sequences at rest (with 16 and 192 a slower arrival admitted
        // them in small waves and, 3 runs in 14, nothing was rejected)
        max_seqs: 32,
        max_tokens_per_step: 384,
        prefill_chunk: 64,
        max_tokens: 64,
        max_context: 256,
        ..scheduler_svc::Config::default()
    };
    let cluster = SmallCluster::start(config).await.unwrap();
    let pools = pool_stats(cluster.cache.addr, GROUP).await.unwrap();
    let total_blocks = pools.iter().find(|p| p.window == 0).map_or(0, |p| p.total);
    // each request holds up to ceil((48 + 47) / 16) = 6 blocks of the full pool
    let per_request = (PREFIX + SUFFIX + MAX_TOKENS as usize - 1).div_ceil(16) as u32;
    let requests = (10 * total_blocks / per_request) as usize;
    assert!(requests >= 30, "pool of {total_blocks} blocks");

    // Another holder takes the whole pool until every request is queued, so
    // the first leases are granted together and their sequences grow in
    // step: the mid-flight exhaustion this scenario is about then happens
    // whatever the arrival times (admitted one by one, the sequences could
    // be served in waves that never ran out at rest).
    let mut cache = cache_client(cluster.cache.addr).await.unwrap();
    let (session_id, epoch) = hold_blocks(&mut cache, "squatter", total_blocks * 16)
        .await
        .unwrap();

    let client = cluster.client().await.unwrap();
    let mut tasks = Vec::new();
    for i in 0..requests {
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
    let mut c = client.clone();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let status = c.get_status(pb::GetStatusRequest {}).await.unwrap();
        if status.into_inner().queued as usize == requests {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "every request queued behind the held pool"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let closed = cache
        .close_session(pb::CloseSessionRequest { session_id, epoch })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(closed.sequences_released, 1);

    let mut results = Vec::new();
    for t in tasks {
        let r = tokio::time::timeout(Duration::from_secs(120), t).await;
        let r = r
            .expect("every request ends in bounded time")
            .expect("task");
        results.push(r.expect("no request fails at the gRPC level"));
    }
    let mut c = client.clone();
    let before = c
        .get_status(pb::GetStatusRequest {})
        .await
        .unwrap()
        .into_inner()
        .steps;
    // the loop is still stepping: a new request is served
    let after = collect(
        &mut c,
        pb::GenerateRequest {
            tokens: prompt(9999),
            max_tokens: 8,
            ..Default::default()
        },
    )
    .await
    .unwrap();
    assert_eq!(after.finish_reason(), pb::FinishReason::Length);
    assert_eq!(after.tokens.len(), 8);
    let status = c
        .get_status(pb::GetStatusRequest {})
        .await
        .unwrap()
        .into_inner();
    let pools = wait_whole(cluster.cache.addr, GROUP, Duration::from_secs(5))
        .await
        .unwrap();
    cluster.stop().await.unwrap();
    Outcome {
        results,
        steps_after: status.steps.saturating_sub(before),
        status,
        pools,
        total_blocks,
    }
}

fn check_common(o: &Outcome) {
    for (i, r) in o.results.iter().enumerate() {
        match r.finish_reason() {
            pb::FinishReason::Length => {
                assert_eq!(r.tokens.len(), MAX_TOKENS as usize, "request {i}")
            }
            pb::FinishReason::Rejected => {
                let reject = r
                    .reject
                    .as_ref()
                    .expect("a rejected request carries the cache's reason");
                assert_ne!(reject.reason, 0, "request {i}: {reject:?}");
                assert!(!r.message.is_empty());
            }
            other => panic!("request {i} ended {other:?}: {}", r.message),
        }
    }
    assert!(
        o.steps_after >= 4,
        "the loop kept stepping ({} steps after)",
        o.steps_after
    );
    for p in &o.pools {
        assert_eq!(
            (p.in_use, p.fenced),
            (0, 0),
            "pool {p:?} is whole once the queue drained"
        );
        assert_eq!(p.free + p.cached_evictable + p.in_use + p.fenced, p.total);
    }
    assert_eq!((o.status.queued, o.status.running), (0, 0));
    assert!(
        o.results.iter().any(|r| r.reused_tokens >= 16),
        "prefix reuse happened"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_utilization_preempt_survives_ten_times_over_subscription() {
    let o = over_subscribe(Policy::MaxUtilization, OnExhausted::Preempt, false).await;
    check_common(&o);
    let completed = o
        .results
        .iter()
        .filter(|r| r.finish_reason() == pb::FinishReason::Length)
        .count();
    assert!(
        completed > o.results.len() / 2,
        "{completed} of {} completed",
        o.results.len()
    );
    assert!(
        o.status.preemptions > 0,
        "the pool was exhausted mid-flight ({} blocks)",
        o.total_blocks
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_utilization_reject_survives_ten_times_over_subscription_with_overlap() {
    let o = over_subscribe(Policy::MaxUtilization, OnExhausted::Reject, true).await;
    check_common(&o);
    assert!(
        o.status.rejected > 0,
        "mid-flight exhaustion rejected some requests"
    );
    assert_eq!(o.status.preemptions, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn guaranteed_no_evict_never_rejects_an_admitted_request() {
    let o = over_subscribe(Policy::GuaranteedNoEvict, OnExhausted::Preempt, false).await;
    check_common(&o);
    for r in &o.results {
        assert_eq!(r.finish_reason(), pb::FinishReason::Length, "{}", r.message);
    }
    assert_eq!((o.status.rejected, o.status.preemptions), (0, 0));
}
