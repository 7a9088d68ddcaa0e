//! Parallel samples (`GenerateRequest.n`) over real gRPC (cache, CPU
//! worker, scheduler on loopback ports), in the plain and the pipelined
//! order: n = 3 with a seed gives three different completions, the same
//! ones again, each equal to a request of one sample with that sample's
//! seed (so the KV the forks share and copy on write is what computing the
//! prompt gives); the prompt's blocks are leased once (the cache's fork
//! figures); n out of range is INVALID_ARGUMENT naming `n`; and an
//! over-subscribed run of n = 4 requests ends every sample and leaves the
//! pools whole with nothing for the audit to reclaim.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed unwrap fails the test

use std::time::Duration;

use kvlease_integration_tests::*;
use kvlease_proto::v1 as pb;
use kvlease_proto::v1::scheduler_client::SchedulerClient;
use scheduler_svc::policy::OnExhausted;
use scheduler_svc::queue::branch_seed;
use tonic::transport::Channel;

const WITHIN: Duration = Duration::from_secs(60);

/// One sample of a request's stream.
#[derive(Debug, Default, Clone, PartialEq)]
struct Sample {
    tokens: Vec<u32>,
    finish: i32,
    /// Messages after its last one (must stay 0).
    after_last: usize,
}

/// Runs `request` to the end of its stream, its messages sorted by
/// sample; also the prompt tokens the stream reported (once).
async fn samples(
    client: &mut SchedulerClient<Channel>,
    request: pb::GenerateRequest,
) -> Result<(Vec<Sample>, u32), tonic::Status> {
    let mut stream = client.generate(request).await?.into_inner();
    let mut by: Vec<Sample> = Vec::new();
    let mut prompt_reports = Vec::new();
    while let Some(msg) = stream.message().await? {
        if msg.prompt_tokens > 0 {
            prompt_reports.push(msg.prompt_tokens);
        }
        let i = msg.index as usize;
        if by.len() <= i {
            by.resize(i + 1, Sample::default());
        }
        let s = &mut by[i];
        if s.finish != 0 {
            s.after_last += 1;
        }
        s.tokens.extend(&msg.tokens);
        if msg.finish_reason != 0 {
            s.finish = msg.finish_reason;
        }
    }
    assert!(
        prompt_reports.len() <= 1,
        "the prompt is reported once: {prompt_reports:?}"
    );
    Ok((by, prompt_reports.first().copied().unwrap_or(0)))
}

fn fork_figures(pools: &[pb::PoolStats]) -> (u64, u64) {
    (
        pools.iter().map(|p| p.fork_shared).sum(),
        pools.iter().map(|p| p.fork_copies).sum(),
    )
}

async fn three_samples(overlap: bool) {
    let config = scheduler_svc::Config {
        max_context: 256,
        max_tokens: 64,
        overlap,
        ..scheduler_svc::Config::default()
    };
    let cluster = SmallCluster::start(config).await.unwrap();
    let mut client = cluster.client().await.unwrap();
    let prompt: Vec<u32> = (0..21).map(|i| (i * 7 + 3) % 250 + 1).collect();
    let request = pb::GenerateRequest {
        tokens: prompt.clone(),
        max_tokens: 12,
        temperature: 1.0,
        seed: 11,
        n: 3,
        ignore_eos: true,
        ..Default::default()
    };
    let pools = pool_stats(cluster.cache.addr, GROUP).await.unwrap();
    let before = fork_figures(&pools);
    let (got, prompt_tokens) = samples(&mut client, request.clone()).await.unwrap();
    assert_eq!(prompt_tokens, 21);
    assert_eq!(got.len(), 3, "{got:?}");
    for s in &got {
        assert_eq!(s.finish, pb::FinishReason::Length as i32, "{got:?}");
        assert_eq!((s.tokens.len(), s.after_last), (12, 0), "{got:?}");
    }
    assert!(
        got[0].tokens != got[1].tokens
            && got[1].tokens != got[2].tokens
            && got[0].tokens != got[2].tokens,
        "three seeds, three completions: {got:?}"
    );
    // the forks shared the prompt's blocks and copied the block of its last
    // token (20 = 16 + 4 tokens before it: one block shared, 4 slots copied)
    let pools = pool_stats(cluster.cache.addr, GROUP).await.unwrap();
    let (shared, copies) = fork_figures(&pools);
    assert!(shared - before.0 >= 2, "{pools:?}");
    assert_eq!(copies - before.1, 2 * pools.len() as u64, "{pools:?}");
    // reproducible, and each sample is the request of one sample with its
    // seed: shared and copied KV is what computing the prompt gives
    let (again, _) = samples(&mut client, request.clone()).await.unwrap();
    assert_eq!(again, got);
    for (i, s) in got.iter().enumerate() {
        let one = pb::GenerateRequest {
            n: 1,
            seed: branch_seed(11, i as u32),
            ..request.clone()
        };
        let g = collect(&mut client, one).await.unwrap();
        assert_eq!(g.tokens, s.tokens, "sample {i}");
    }
    for n in [17, 1_000] {
        let status = samples(
            &mut client,
            pb::GenerateRequest {
                n,
                ..request.clone()
            },
        )
        .await
        .unwrap_err();
        assert_eq!(status.code(), tonic::Code::InvalidArgument, "{status:?}");
        assert_eq!(invalid_field(&status), Some("n"), "{status:?}");
    }
    assert_cache_sound(cluster.cache.addr, GROUP, WITHIN)
        .await
        .unwrap();
    cluster.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_samples_fork_one_prompt_over_grpc() {
    three_samples(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_samples_fork_alike_in_the_pipelined_order() {
    three_samples(true).await;
}

/// A sample whose text ends at a stop string stops generating (its blocks
/// released) while the others go on: the scheduler counts it `STOP`, not
/// run on unseen to its length.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sample_stopped_by_a_stop_string_ends_alone() {
    let config = scheduler_svc::Config {
        max_context: 256,
        max_tokens: 64,
        ..scheduler_svc::Config::default()
    };
    let cluster = SmallCluster::start(config).await.unwrap();
    let mut client = cluster.client().await.unwrap();
    let prompt: Vec<u32> = (0..21).map(|i| (i * 7 + 3) % 250 + 1).collect();
    let request = pb::GenerateRequest {
        tokens: prompt,
        max_tokens: 48,
        temperature: 1.0,
        seed: 11,
        n: 3,
        ignore_eos: true,
        ..Default::default()
    };
    // sample 1's text on its own, to stop it right at its start
    let one = collect(
        &mut client,
        pb::GenerateRequest {
            n: 1,
            seed: branch_seed(11, 1),
            ..request.clone()
        },
    )
    .await
    .unwrap();
    let stop: String = one.text.chars().take(3).collect();
    assert_eq!(stop.chars().count(), 3, "{:?}", one.text);
    let status = |c: &mut SchedulerClient<Channel>| {
        let mut c = c.clone();
        async move {
            c.get_status(pb::GetStatusRequest {})
                .await
                .unwrap()
                .into_inner()
        }
    };
    let before = status(&mut client).await;
    let (got, _) = samples(
        &mut client,
        pb::GenerateRequest {
            stop: vec![stop],
            ..request
        },
    )
    .await
    .unwrap();
    assert_eq!(got.len(), 3);
    assert_eq!(got[1].finish, pb::FinishReason::Stop as i32, "{got:?}");
    let stopped = got
        .iter()
        .filter(|s| s.finish == pb::FinishReason::Stop as i32)
        .count() as u64;
    let after = status(&mut client).await;
    assert_eq!(
        after.finished_stop - before.finished_stop,
        stopped,
        "each stopped sample ended STOP at the scheduler"
    );
    assert_eq!(
        after.finished_length - before.finished_length,
        3 - stopped,
        "the others ran to their length"
    );
    assert_eq!(after.cancelled, before.cancelled);
    assert_cache_sound(cluster.cache.addr, GROUP, WITHIN)
        .await
        .unwrap();
    cluster.stop().await.unwrap();
}

/// Requests of 4 samples about 17 times past the pool, preempting or
/// rejecting what cannot grow: every sample ends (its length, or `REJECTED`
/// with the cache's figures), and the pools are whole with nothing for the
/// leak audit afterwards.
async fn over_subscribed(on_exhausted: OnExhausted) -> (usize, usize) {
    const MAX_TOKENS: u32 = 60;
    let cluster = SmallCluster::start(over_subscribed_config(on_exhausted))
        .await
        .unwrap();
    let pools = pool_stats(cluster.cache.addr, GROUP).await.unwrap();
    let total = pools.iter().find(|p| p.window == 0).map_or(0, |p| p.total);
    // 20-token prompts, 4 samples of 60 tokens: 1 + 4 x 4 blocks each (of
    // 16 tokens), most of them taken while decoding
    let requests = total.max(8) as usize;
    let client = cluster.client().await.unwrap();
    let mut tasks = Vec::new();
    for i in 0..requests {
        let mut c = client.clone();
        tasks.push(tokio::spawn(async move {
            let tokens: Vec<u32> = (0..20)
                .map(|t| ((i * 31 + t * 13) % 250 + 1) as u32)
                .collect();
            let r = pb::GenerateRequest {
                tokens,
                max_tokens: MAX_TOKENS,
                temperature: 0.8,
                seed: i as u64,
                n: 4,
                ignore_eos: true,
                ..Default::default()
            };
            samples(&mut c, r).await
        }));
    }
    let (mut served, mut refused) = (0, 0);
    for t in tasks {
        let (got, _) = tokio::time::timeout(Duration::from_secs(120), t)
            .await
            .expect("every request ends in bounded time")
            .expect("task")
            .expect("no request fails at the gRPC level");
        assert_eq!(got.len(), 4, "{got:?}");
        for s in &got {
            match pb::FinishReason::try_from(s.finish) {
                Ok(pb::FinishReason::Length) => {
                    assert_eq!(s.tokens.len(), MAX_TOKENS as usize);
                    served += 1;
                }
                Ok(pb::FinishReason::Rejected) => refused += 1,
                other => panic!("a sample ended {other:?}: {s:?}"),
            }
        }
    }
    let pools = pool_stats(cluster.cache.addr, GROUP).await.unwrap();
    let (shared, copies) = fork_figures(&pools);
    println!(
        "{requests} requests of 4 samples on {total} blocks: {served} samples served, {refused} refused; \
         forks shared {shared} blocks and copied {copies}"
    );
    assert!(copies > 0, "forks were made: {pools:?}");
    assert!(served > 0, "samples were served");
    assert_cache_sound(cluster.cache.addr, GROUP, WITHIN)
        .await
        .unwrap();
    cluster.stop().await.unwrap();
    (served, refused)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_over_subscribed_run_of_samples_preempting_leaves_the_pools_whole() {
    over_subscribed(OnExhausted::Preempt).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_over_subscribed_run_of_samples_rejecting_leaves_the_pools_whole() {
    let (_, refused) = over_subscribed(OnExhausted::Reject).await;
    assert!(
        refused > 0,
        "a pool 17 times over-subscribed refuses samples"
    );
}
