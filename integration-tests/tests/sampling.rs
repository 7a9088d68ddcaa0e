//! The sampling set over real gRPC (cache, CPU worker, scheduler on
//! loopback ports), in the plain and the pipelined order (where a decode's
//! token is fed on the worker, so the worker's own token counts must follow
//! it): a `logit_bias` of -100 bans the token greedy decoding emits most, a
//! frequency penalty cuts repeats, a hot seeded run with every parameter
//! reproduces itself and never emits the banned token, and out-of-range
//! values are INVALID_ARGUMENT naming the field.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed unwrap fails the test

use std::collections::HashMap;
use std::time::Duration;

use kvlease_integration_tests::{
    GROUP, Generated, collect, scheduler_client, small_worker, start_cache, start_scheduler,
    start_worker, wait_whole,
};
use kvlease_proto::v1 as pb;
use kvlease_proto::v1::scheduler_client::SchedulerClient;
use tonic::transport::Channel;

const WITHIN: Duration = Duration::from_secs(60);

/// Occurrences of the most repeated token, and that token.
fn most_repeated(tokens: &[u32]) -> (usize, u32) {
    let mut counts: HashMap<u32, usize> = HashMap::new();
    for &t in tokens {
        *counts.entry(t).or_default() += 1;
    }
    counts
        .into_iter()
        .map(|(t, n)| (n, t))
        .max()
        .unwrap_or((0, 0))
}

/// The tokens of a generation that ran to its length.
async fn run(client: &mut SchedulerClient<Channel>, r: pb::GenerateRequest) -> Vec<u32> {
    let g: Generated = collect(client, r).await.unwrap();
    assert_eq!(g.finish_reason(), pb::FinishReason::Length, "{}", g.message);
    g.tokens
}

async fn sampling_set(overlap: bool) {
    let cache = start_cache(cache_svc::Config::default()).await.unwrap();
    let worker = start_worker(small_worker()).await.unwrap();
    let config = scheduler_svc::Config {
        max_context: 256,
        max_tokens: 64,
        overlap,
        ..scheduler_svc::Config::default()
    };
    let scheduler = start_scheduler(config, &cache.url(), &[worker.url()], WITHIN)
        .await
        .unwrap();
    let mut client = scheduler_client(scheduler.addr).await.unwrap();
    let prompt: Vec<u32> = (0..21).map(|i| (i * 7 + 3) % 250 + 1).collect();
    let base = pb::GenerateRequest {
        tokens: prompt,
        max_tokens: 40,
        ignore_eos: true,
        ..Default::default()
    };
    let greedy = run(&mut client, base.clone()).await;
    let (repeats, banned) = most_repeated(&greedy);
    assert!(repeats > 1, "the seeded model repeats itself: {greedy:?}");

    let ban = pb::GenerateRequest {
        logit_bias: [(banned, -100.0)].into(),
        ..base.clone()
    };
    let unbanned = run(&mut client, ban.clone()).await;
    assert!(!unbanned.contains(&banned), "{banned} in {unbanned:?}");

    let penalised = run(
        &mut client,
        pb::GenerateRequest {
            frequency_penalty: 2.0,
            ..base.clone()
        },
    )
    .await;
    let (penalised_repeats, _) = most_repeated(&penalised);
    assert!(
        penalised_repeats < repeats,
        "{penalised_repeats} repeats with the penalty, {repeats} without: {penalised:?}"
    );

    let everything = pb::GenerateRequest {
        temperature: 1.2,
        seed: 7,
        top_k: 50,
        top_p: 0.95,
        min_p: 0.01,
        presence_penalty: 0.5,
        frequency_penalty: 0.3,
        repetition_penalty: 1.1,
        min_tokens: 5,
        ..ban
    };
    let hot = run(&mut client, everything.clone()).await;
    assert!(!hot.contains(&banned), "{banned} in {hot:?}");
    assert_eq!(
        hot,
        run(&mut client, everything).await,
        "seeded: reproducible"
    );

    let out_of_range = [
        (
            pb::GenerateRequest {
                min_p: 2.0,
                ..base.clone()
            },
            "min_p",
        ),
        (
            pb::GenerateRequest {
                logit_bias: [(1, -500.0)].into(),
                ..base.clone()
            },
            "logit_bias",
        ),
        (
            pb::GenerateRequest {
                presence_penalty: 9.0,
                ..base.clone()
            },
            "presence_penalty",
        ),
    ];
    for (r, field) in out_of_range {
        let status = collect(&mut client, r).await.unwrap_err();
        assert_eq!(status.code(), tonic::Code::InvalidArgument, "{status:?}");
        assert_eq!(
            kvlease_integration_tests::invalid_field(&status),
            Some(field),
            "{status:?}"
        );
    }

    let pools = wait_whole(cache.addr, GROUP, WITHIN).await.unwrap();
    for p in &pools {
        assert_eq!((p.in_use, p.fenced), (0, 0), "{p:?}");
    }
    scheduler.stop().await.unwrap();
    worker.stop().await.unwrap();
    cache.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sampling_parameters_act_as_documented_over_grpc() {
    sampling_set(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sampling_parameters_act_alike_in_the_pipelined_order() {
    sampling_set(true).await;
}
