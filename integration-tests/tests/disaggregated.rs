//! Disaggregated prefill/decode through a real cluster on loopback ports: a
//! cache, a prefill worker (behind a faulty proxy) and a decode worker of
//! one model, and a scheduler over both (`URL#role=prefill`,
//! `URL#role=decode`). A request's prompt is computed in the prefill group;
//! the decode worker pulls its KV over `PullBlocks` (forced, not weighed)
//! and computes only the tokens after the prompt, with the greedy output of
//! one group serving it whole. The seed scenarios (over-subscription under
//! preempt and reject) end every request with an answer; a transfer cut
//! mid-stream recomputes in the decode group, or ends `ERROR` when no
//! recompute is left. After every case both groups' pools are whole and the
//! leak audit reclaims nothing.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed unwrap fails the test

use std::net::SocketAddr;
use std::time::Duration;

use kvlease_integration_tests::{
    Generated, Service, assert_cache_sound, collect, pool_stats, scheduler_client, small_worker,
    start_cache, start_scheduler, start_worker, tap,
};
use kvlease_proto::v1 as pb;
use scheduler_svc::policy::OnExhausted;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const WITHIN: Duration = Duration::from_secs(60);
/// The prefill group (behind the proxy) and the decode group.
const P: &str = "seeded-0/replica-0";
const D: &str = "seeded-0/replica-1";

struct Cluster {
    cache: Service,
    prefill: Service,
    proxy: Service,
    faults: tap::Faults,
    decode: Service,
    scheduler: Service,
}

impl Cluster {
    async fn start(config: scheduler_svc::Config) -> Self {
        let cache = start_cache(cache_svc::Config::default()).await.unwrap();
        let prefill = start_worker(small_worker()).await.unwrap();
        let (proxy, faults) = tap::start_faulty(prefill.addr).await.unwrap();
        let decode = start_worker(small_worker()).await.unwrap();
        let workers = [
            format!("{}#role=prefill", proxy.url()),
            format!("{}#role=decode", decode.url()),
        ];
        let scheduler = start_scheduler(config, &cache.url(), &workers, WITHIN)
            .await
            .unwrap();
        Self {
            cache,
            prefill,
            proxy,
            faults,
            decode,
            scheduler,
        }
    }

    async fn generate(&self, tokens: Vec<u32>, max_tokens: u32) -> Generated {
        let mut client = scheduler_client(self.scheduler.addr).await.unwrap();
        collect(&mut client, request(tokens, max_tokens))
            .await
            .unwrap()
    }

    async fn sound(&self) {
        for group in [P, D] {
            assert_cache_sound(self.cache.addr, group, WITHIN)
                .await
                .unwrap();
        }
    }

    async fn status(&self) -> pb::GetStatusResponse {
        let mut client = scheduler_client(self.scheduler.addr).await.unwrap();
        client
            .get_status(pb::GetStatusRequest {})
            .await
            .unwrap()
            .into_inner()
    }

    async fn stop(self) {
        self.scheduler.stop().await.unwrap();
        self.proxy.stop().await.unwrap();
        self.decode.stop().await.unwrap();
        self.prefill.stop().await.unwrap();
        self.cache.stop().await.unwrap();
    }
}

fn config() -> scheduler_svc::Config {
    scheduler_svc::Config {
        max_context: 256,
        max_tokens: 64,
        ..scheduler_svc::Config::default()
    }
}

fn request(tokens: Vec<u32>, max_tokens: u32) -> pb::GenerateRequest {
    pb::GenerateRequest {
        tokens,
        max_tokens,
        ignore_eos: true,
        ..Default::default()
    }
}

fn prompt(len: usize, seed: u32) -> Vec<u32> {
    (0..len as u32)
        .map(|j| (j * 13 + seed * 37 + 5) % 250 + 1)
        .collect()
}

/// Tokens a worker's forward passes took since it started
/// (`kvlease_worker_forward_tokens_total`, from its metrics endpoint).
async fn forward_tokens(worker: &Service) -> u64 {
    let addr: SocketAddr = worker.metrics.expect("the worker serves metrics");
    let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    stream
        .write_all(b"GET /metrics HTTP/1.0\r\nHost: localhost\r\n\r\n")
        .await
        .unwrap();
    let mut body = String::new();
    stream.read_to_string(&mut body).await.unwrap();
    body.lines()
        .find_map(|l| l.strip_prefix("kvlease_worker_forward_tokens_total "))
        .map_or(0, |v| v.trim().parse::<f64>().unwrap() as u64)
}

/// Blocks the cache granted by hand-offs in `group`'s pools.
async fn handoff_blocks(cache: SocketAddr, group: &str) -> Vec<u64> {
    pool_stats(cache, group)
        .await
        .unwrap()
        .iter()
        .map(|p| p.handoff_blocks)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_decode_group_computes_only_the_tokens_after_the_prompt_with_one_groups_output() {
    let c = Cluster::start(config()).await;
    let status = c.status().await;
    let roles: Vec<(&str, &str)> = status
        .groups
        .iter()
        .map(|g| (g.pool_group.as_str(), g.role.as_str()))
        .collect();
    assert_eq!(roles, vec![(P, "prefill"), (D, "decode")]);
    // 40 tokens: two full blocks and half of a third move
    let p = prompt(40, 1);
    let (p_before, d_before) = (
        forward_tokens(&c.prefill).await,
        forward_tokens(&c.decode).await,
    );
    let split = c.generate(p.clone(), 8).await;
    assert_eq!(
        split.finish_reason(),
        pb::FinishReason::Length,
        "{}",
        split.message
    );
    assert_eq!(split.preemptions, 0);
    // the prefill worker computed the prompt, the decode worker the 7
    // tokens fed after it (the first sampled by the prefill, the last
    // sampled is never fed)
    assert_eq!(forward_tokens(&c.prefill).await - p_before, 40);
    assert_eq!(forward_tokens(&c.decode).await - d_before, 7);
    assert_eq!(handoff_blocks(c.cache.addr, D).await, vec![3, 3]);
    c.sound().await;

    // one group serving the same request whole
    let whole = start_worker(small_worker()).await.unwrap();
    let one = start_scheduler(
        scheduler_svc::Config {
            pool_group_prefix: "one".into(),
            holder: "one".into(),
            ..config()
        },
        &c.cache.url(),
        &[whole.url()],
        WITHIN,
    )
    .await
    .unwrap();
    let mut client = scheduler_client(one.addr).await.unwrap();
    let reference = collect(&mut client, request(p, 8)).await.unwrap();
    assert_eq!(split.tokens, reference.tokens, "same greedy output");
    one.stop().await.unwrap();
    whole.stop().await.unwrap();
    c.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transfer_cut_mid_stream_recomputes_in_the_decode_group_or_ends_by_policy() {
    let c = Cluster::start(config()).await;
    let p = prompt(40, 2);
    let clean = c.generate(p.clone(), 6).await;
    assert_eq!(clean.preemptions, 0);
    c.sound().await;

    // the prefill worker's stream ends after its first chunk: the decode
    // group recomputes the whole context, with the same output
    c.faults.cut_next_pulls(1);
    let cut = c.generate(p.clone(), 6).await;
    assert_eq!(c.faults.pull_cuts_left(), 0, "the pull was cut");
    assert_eq!(
        cut.finish_reason(),
        pb::FinishReason::Length,
        "{}",
        cut.message
    );
    assert_eq!(cut.preemptions, 1, "recomputed once");
    assert_eq!(cut.tokens, clean.tokens, "same greedy output");
    c.sound().await;
    c.stop().await;

    // no recompute left: the request ends ERROR, saying why
    let c = Cluster::start(scheduler_svc::Config {
        max_preemptions: 0,
        ..config()
    })
    .await;
    c.faults.cut_next_pulls(1);
    let cut = c.generate(p, 6).await;
    assert_eq!(cut.finish_reason(), pb::FinishReason::Error, "{cut:?}");
    assert!(cut.message.contains("peer pull failed"), "{}", cut.message);
    c.sound().await;
    c.stop().await;
}

/// The seed scenario of `exhaustion.rs` in disaggregated mode: many more
/// requests than the decode group's pool holds, at once. Every request
/// ends `LENGTH` or `REJECTED` with the cache's reason, the loop keeps
/// stepping, and both groups' pools end whole.
async fn over_subscribe(on_exhausted: OnExhausted) -> (Vec<Generated>, pb::GetStatusResponse) {
    let c = Cluster::start(scheduler_svc::Config {
        on_exhausted,
        max_preemptions: 3,
        max_seqs: 32,
        max_tokens_per_step: 384,
        prefill_chunk: 64,
        ..config()
    })
    .await;
    let decode_blocks = pool_stats(c.cache.addr, D)
        .await
        .unwrap()
        .iter()
        .find(|p| p.window == 0)
        .map_or(0, |p| p.total);
    // each request holds ceil((48 + 47) / 16) = 6 blocks of the full pool
    let requests = (5 * decode_blocks / 6) as usize;
    assert!(requests >= 15, "pool of {decode_blocks} blocks");
    let client = scheduler_client(c.scheduler.addr).await.unwrap();
    let mut tasks = Vec::new();
    for i in 0..requests {
        let mut client = client.clone();
        let mut p = prompt(32, 0);
        p.extend(prompt(16, i as u32 + 1));
        tasks.push(tokio::spawn(async move {
            collect(&mut client, request(p, 48)).await
        }));
    }
    let mut results = Vec::new();
    for t in tasks {
        let r = tokio::time::timeout(Duration::from_secs(180), t).await;
        let r = r
            .expect("every request ends in bounded time")
            .expect("task");
        results.push(r.expect("no request fails at the gRPC level"));
    }
    for (i, r) in results.iter().enumerate() {
        match r.finish_reason() {
            pb::FinishReason::Length => assert_eq!(r.tokens.len(), 48, "request {i}"),
            pb::FinishReason::Rejected => {
                let reject = r.reject.as_ref().expect("the cache's reason");
                assert_ne!(reject.reason, 0, "request {i}: {reject:?}");
                assert!(!r.message.is_empty());
            }
            other => panic!("request {i} ended {other:?}: {}", r.message),
        }
    }
    // still stepping: a new request is served
    let after = c.generate(prompt(20, 99), 4).await;
    assert_eq!(
        after.finish_reason(),
        pb::FinishReason::Length,
        "{}",
        after.message
    );
    c.sound().await;
    let status = c.status().await;
    assert_eq!((status.queued, status.running), (0, 0));
    assert!(
        handoff_blocks(c.cache.addr, D).await.iter().all(|&n| n > 0),
        "requests were handed off"
    );
    c.stop().await;
    (results, status)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_subscribed_disaggregated_serving_answers_every_request_under_preempt() {
    let (results, _) = over_subscribe(OnExhausted::Preempt).await;
    let completed = results
        .iter()
        .filter(|r| r.finish_reason() == pb::FinishReason::Length)
        .count();
    assert!(
        completed > results.len() / 2,
        "{completed} of {} completed",
        results.len()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_subscribed_disaggregated_serving_rejects_what_the_decode_group_cannot_hold() {
    let (results, status) = over_subscribe(OnExhausted::Reject).await;
    assert!(status.rejected > 0, "the decode group ran out");
    assert_eq!(status.preemptions, 0);
    assert!(
        results
            .iter()
            .any(|r| r.finish_reason() == pb::FinishReason::Length),
        "some were served"
    );
}
