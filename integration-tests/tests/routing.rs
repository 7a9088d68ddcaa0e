//! KV-aware routing through a real cluster (cache, two CPU workers, a
//! scheduler on loopback ports): a conversation's second turn goes to the
//! replica that served its first turn and reuses its prefix there, where
//! least-committed routing sends it to the first idle replica, which must
//! recompute it. And the cache's `Match` RPC itself: what a lease would
//! reuse, only in the caller's own groups, malformed requests refused.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed unwrap fails the test

use std::net::SocketAddr;
use std::time::Duration;

use kvlease_integration_tests::{
    Generated, cache_client, collect, pool_stats, scheduler_client, small_worker, start_cache,
    start_scheduler, start_worker, tap, wait_whole,
};
use kvlease_proto::v1 as pb;
use scheduler_svc::routing::Routing;

const WITHIN: Duration = Duration::from_secs(60);
const R0: &str = "seeded-0/replica-0";
const R1: &str = "seeded-0/replica-1";

/// Sequences the cache granted in `group` so far.
async fn grants(cache: SocketAddr, group: &str) -> u64 {
    pool_stats(cache, group).await.unwrap()[0].grants
}

/// Reads a Generate stream to its end: the tokens, the finish reason and
/// the reused prompt tokens (first message).
async fn drain(mut stream: tonic::Streaming<pb::GenerateResponse>) -> Generated {
    let mut g = Generated::default();
    while let Some(msg) = stream.message().await.unwrap() {
        g.messages += 1;
        if g.messages == 1 {
            g.reused_tokens = msg.reused_tokens;
        }
        g.tokens.extend(&msg.tokens);
        if msg.finish_reason != 0 {
            g.finish = msg.finish_reason;
            g.message = msg.message;
        }
    }
    g
}

fn request(tokens: Vec<u32>, max_tokens: u32) -> pb::GenerateRequest {
    pb::GenerateRequest {
        tokens,
        max_tokens,
        ..Default::default()
    }
}

/// Conversation A's first turn holds replica 0 (its forward pass held at a
/// gate) while conversation B's first turn is admitted, on replica 1, the
/// least committed. Then, the cluster idle, B's second turn alone: returns
/// it and the replica that served it.
async fn second_turn(routing: Routing) -> (Generated, &'static str) {
    let cache = start_cache(cache_svc::Config::default()).await.unwrap();
    let w0 = start_worker(small_worker()).await.unwrap();
    let w1 = start_worker(small_worker()).await.unwrap();
    let (gated, gate) = tap::start_gate(w0.addr).await.unwrap();
    let config = scheduler_svc::Config {
        max_context: 256,
        max_tokens: 64,
        // B is leased while A's pass is held
        overlap: true,
        routing,
        ..scheduler_svc::Config::default()
    };
    let scheduler = start_scheduler(config, &cache.url(), &[gated.url(), w1.url()], WITHIN)
        .await
        .unwrap();
    let client = scheduler_client(scheduler.addr).await.unwrap();
    let prompt_a: Vec<u32> = (0..40).map(|i| (i * 11 + 5) % 250 + 1).collect();
    let prompt_b: Vec<u32> = (0..40).map(|i| (i * 7 + 3) % 250 + 1).collect();

    // A is leased on replica 0 (both idle: the first) and its first pass
    // held; B reaches the scheduler's intake (its Generate answered headers)
    // before the pass returns, so the step after it admits B while A is
    // still running (32 tokens to go): B goes to the least committed,
    // replica 1, under either policy
    let warm = grants(cache.addr, R1).await;
    gate.close();
    let mut c = client.clone();
    let a = tokio::spawn(async move { collect(&mut c, request(prompt_a, 32)).await });
    gate.holding().await;
    let mut c = client.clone();
    let b = c
        .generate(request(prompt_b.clone(), 4))
        .await
        .unwrap()
        .into_inner();
    gate.open();
    let turn_b = drain(b).await;
    let turn_a = a.await.unwrap().unwrap();
    for turn in [&turn_a, &turn_b] {
        assert_eq!(
            turn.finish_reason(),
            pb::FinishReason::Length,
            "{}",
            turn.message
        );
    }
    wait_whole(cache.addr, R0, WITHIN).await.unwrap();
    wait_whole(cache.addr, R1, WITHIN).await.unwrap();
    assert_eq!(
        grants(cache.addr, R1).await - warm,
        1,
        "B's first turn ran on replica 1"
    );

    let before = (grants(cache.addr, R0).await, grants(cache.addr, R1).await);
    let mut next = prompt_b;
    next.extend(&turn_b.tokens);
    next.extend([9, 8, 7, 6, 5, 4, 3]);
    let mut c = client.clone();
    let turn2 = collect(&mut c, request(next, 4)).await.unwrap();
    assert_eq!(
        turn2.finish_reason(),
        pb::FinishReason::Length,
        "{}",
        turn2.message
    );
    let after = (grants(cache.addr, R0).await, grants(cache.addr, R1).await);
    let served = match (after.0 - before.0, after.1 - before.1) {
        (1, 0) => R0,
        (0, 1) => R1,
        other => panic!("the second turn's grants per replica: {other:?}"),
    };
    for group in [R0, R1] {
        kvlease_integration_tests::assert_cache_sound(cache.addr, group, WITHIN)
            .await
            .unwrap();
    }
    scheduler.stop().await.unwrap();
    gated.stop().await.unwrap();
    w0.stop().await.unwrap();
    w1.stop().await.unwrap();
    cache.stop().await.unwrap();
    (turn2, served)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_turn_goes_to_the_replica_holding_its_prefix() {
    let (kv, kv_served) = second_turn(Routing::KvAware).await;
    assert_eq!(kv_served, R1, "kv-aware: the replica of the first turn");
    // the first turn wrote K/V for its 40 prompt tokens and the 3 outputs
    // it fed back: 2 full blocks of 16 (what Match reported) and 11 slots
    // of the third, copied (partial-block reuse)
    assert_eq!(kv.reused_tokens, 40 + 3, "the whole first turn is reused");
    let (lc, lc_served) = second_turn(Routing::LeastCommitted).await;
    assert_eq!(lc_served, R0, "least-committed: the first idle replica");
    assert_eq!(lc.reused_tokens, 0, "which must recompute the prefix");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn match_answers_only_in_the_callers_groups_and_refuses_malformed_requests() {
    let cache = start_cache(cache_svc::Config::default()).await.unwrap();
    let mut c = cache_client(cache.addr).await.unwrap();
    c.register_pool(pb::RegisterPoolRequest {
        pool_group: "m/r0".into(),
        tokens_per_block: 4,
        pools: vec![pb::PoolSpec {
            window: 0,
            num_blocks: 16,
            host_blocks: 0,
            ..Default::default()
        }],
        ..Default::default()
    })
    .await
    .unwrap();
    let s = c
        .open_session(pb::OpenSessionRequest {
            holder: "t".into(),
            ttl_ms: 10_000,
        })
        .await
        .unwrap()
        .into_inner();
    let prompt: Vec<u32> = (1..=10).collect();
    let lease = pb::LeaseRequest {
        session_id: s.session_id,
        epoch: s.epoch,
        step: 1,
        sequences: vec![pb::SequenceSpec {
            seq_id: 1,
            pool_group: "m/r0".into(),
            prompt_tokens: prompt.clone(),
            ..Default::default()
        }],
        ..Default::default()
    };
    c.lease(lease).await.unwrap();
    c.complete_step(pb::CompleteStepRequest {
        session_id: s.session_id,
        epoch: s.epoch,
        step: 1,
    })
    .await
    .unwrap();
    let ask = |groups: &[&str], prompts: Vec<Vec<u32>>| pb::MatchRequest {
        session_id: s.session_id,
        epoch: s.epoch,
        pool_groups: groups.iter().map(|g| g.to_string()).collect(),
        prompts: prompts
            .into_iter()
            .map(|t| pb::MatchPrompt {
                prompt_tokens: t,
                cache_salt: String::new(),
            })
            .collect(),
    };
    let mut longer = prompt.clone();
    longer.extend([77, 78, 79]);
    let r = c
        .r#match(ask(&["m/r0"], vec![longer.clone(), vec![5, 5, 5, 5, 5]]))
        .await
        .unwrap()
        .into_inner();
    let rows: Vec<Vec<u32>> = r.results.into_iter().map(|r| r.reused_tokens).collect();
    assert_eq!(rows, vec![vec![8], vec![0]]);

    let refused = |status: tonic::Status, code: tonic::Code, field: &str| {
        assert_eq!(status.code(), code, "{status:?}");
        assert!(status.message().contains(field), "{status:?} names {field}");
    };
    let status = c.r#match(ask(&[], vec![longer.clone()])).await.unwrap_err();
    refused(status, tonic::Code::InvalidArgument, "pool_groups");
    let status = c.r#match(ask(&["m/r0"], vec![])).await.unwrap_err();
    refused(status, tonic::Code::InvalidArgument, "prompts");
    let status = c.r#match(ask(&["m/r0"], vec![vec![]])).await.unwrap_err();
    refused(
        status,
        tonic::Code::InvalidArgument,
        "prompts[0].prompt_tokens",
    );
    let status = c
        .r#match(ask(&["m/nope"], vec![longer.clone()]))
        .await
        .unwrap_err();
    refused(status, tonic::Code::NotFound, "m/nope");
    let too_many = vec![vec![1u32]; cache_svc::Config::default().max_batch + 1];
    let status = c.r#match(ask(&["m/r0"], too_many)).await.unwrap_err();
    refused(status, tonic::Code::ResourceExhausted, "prompts");
    let mut stale = ask(&["m/r0"], vec![longer]);
    stale.epoch += 1;
    let status = c.r#match(stale).await.unwrap_err();
    assert_eq!(status.code(), tonic::Code::FailedPrecondition, "{status:?}");
    cache.stop().await.unwrap();
}
