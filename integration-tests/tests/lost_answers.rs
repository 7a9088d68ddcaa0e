//! Calls the cache applied whose answers never came back, through real
//! services on loopback ports: a proxy in front of the cache passes a call
//! that grows sequences on, then answers the scheduler DEADLINE_EXCEEDED,
//! as when a timeout or a dropped connection loses the answer.
//!
//! - A lost `Lease`: the scheduler requeues its requests and releases its
//!   sequences all the same (the cache holds them), discarding what no pass
//!   wrote; nothing stays held.
//! - Lost `Step` calls carrying decode extends: the scheduler grows those
//!   sequences again from the length it knows, which the cache refuses
//!   `LENGTH_MISMATCH` (it applied the first call) instead of recording the
//!   tokens twice; the scheduler recomputes them.
//!
//! Every request ends `LENGTH` with the tokens of a run with no loss, and
//! the pools are whole while the scheduler still runs.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed unwrap fails the test

use std::time::Duration;

use kvlease_integration_tests::{
    GROUP, assert_cache_sound, collect, metric_value, scheduler_client, small_worker, start_cache,
    start_scheduler, start_worker, tap,
};
use kvlease_proto::v1 as pb;

const WITHIN: Duration = Duration::from_secs(60);
const REQUESTS: usize = 6;
const MAX_TOKENS: u32 = 40;

fn request(i: usize) -> pb::GenerateRequest {
    pb::GenerateRequest {
        tokens: (0..12)
            .map(|t| ((i * 37 + t * 11) % 250 + 1) as u32)
            .collect(),
        max_tokens: MAX_TOKENS,
        ..Default::default()
    }
}

/// Every request at once, each one's tokens (asserting it ended `LENGTH`).
async fn run_all(scheduler: std::net::SocketAddr) -> Vec<Vec<u32>> {
    let runs = (0..REQUESTS).map(|i| async move {
        let mut client = scheduler_client(scheduler).await.unwrap();
        let g = collect(&mut client, request(i)).await.unwrap();
        assert_eq!(g.finish_reason(), pb::FinishReason::Length, "{}", g.message);
        g.tokens
    });
    futures::future::join_all(runs).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn growths_applied_behind_lost_answers_are_not_applied_twice_and_nothing_leaks() {
    let cache = start_cache(cache_svc::Config::default()).await.unwrap();
    let (proxy, answers) = tap::start_refusing_cache(cache.addr).await.unwrap();
    let worker = start_worker(small_worker()).await.unwrap();
    let config = scheduler_svc::Config {
        max_context: 256,
        max_tokens: 64,
        ..scheduler_svc::Config::default()
    };
    let scheduler = start_scheduler(config, &proxy.url(), &[worker.url()], WITHIN)
        .await
        .unwrap();
    let reference = run_all(scheduler.addr).await;

    // the first Lease's answer is lost
    answers.lose_growth_answers(1);
    assert_eq!(run_all(scheduler.addr).await, reference);
    assert_eq!(answers.lost(), 1);
    assert_cache_sound(cache.addr, GROUP, WITHIN).await.unwrap();

    // decode extends' answers lost while every request runs
    let mut streams = Vec::new();
    for i in 0..REQUESTS {
        let mut client = scheduler_client(scheduler.addr).await.unwrap();
        streams.push(client.generate(request(i)).await.unwrap().into_inner());
    }
    let mut tokens = vec![Vec::new(); REQUESTS];
    for (stream, tokens) in streams.iter_mut().zip(&mut tokens) {
        while tokens.len() < 2 {
            let msg = tokio::time::timeout(WITHIN, stream.message())
                .await
                .expect("tokens stream")
                .unwrap()
                .expect("not ended yet");
            tokens.extend(msg.tokens);
        }
    }
    answers.lose_growth_answers(3);
    for (stream, tokens) in streams.iter_mut().zip(&mut tokens) {
        while let Some(msg) = tokio::time::timeout(WITHIN, stream.message())
            .await
            .expect("the request ends")
            .unwrap()
        {
            tokens.extend(msg.tokens);
            if msg.finish_reason != 0 {
                assert_eq!(
                    msg.finish_reason,
                    pb::FinishReason::Length as i32,
                    "{}",
                    msg.message
                );
            }
        }
    }
    assert_eq!(tokens, reference, "recomputed, the same tokens");
    assert_eq!(answers.lost(), 4);
    let recomputed = metric_value(
        &scheduler,
        "kvlease_preemptions_total{reason=\"LENGTH_MISMATCH\"}",
    )
    .await
    .unwrap();
    assert!(
        recomputed >= 1.0,
        "a growth sent again after its lost answer was refused: {recomputed}"
    );
    // nothing held once every request ended, the scheduler still running
    assert_cache_sound(cache.addr, GROUP, WITHIN).await.unwrap();
    scheduler.stop().await.unwrap();
    worker.stop().await.unwrap();
    proxy.stop().await.unwrap();
    cache.stop().await.unwrap();
}
