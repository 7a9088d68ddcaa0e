//! Peer pull through a real cluster (cache, two CPU workers of one model,
//! A behind a faulty proxy, and a scheduler over both that routes to the
//! least committed group, on loopback ports): a prompt served in group A
//! publishes its prefix there; while A is busy with another request, a
//! prompt sharing that prefix goes to group B, whose worker pulls the
//! prefix from A's over the workers' `PullBlocks` stream before its pass
//! and computes only the rest, with the greedy output of recomputing it
//! all. A pull cut mid-stream (the source going away) fails only that
//! sequence, which is recomputed with the same output. The pools end whole
//! and the leak audit reclaims nothing after each case. Who may pull is
//! `peer_pull_auth.rs` (an mTLS process of its own).
//!
//! Across schedulers: two schedulers share the cache, each over a worker
//! of its own (`--pool-group-prefix` a and b, one salt secret); a prompt
//! served through A is pulled into B's group from A's worker, which B's
//! `--peer-workers` names.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed unwrap fails the test

use std::time::Duration;

use kvlease_integration_tests::{
    Generated, Service, assert_cache_sound, collect, pool_stats, scheduler_client, small_worker,
    start_cache, start_scheduler, start_worker, tap,
};
use kvlease_proto::v1 as pb;

const WITHIN: Duration = Duration::from_secs(60);
/// The small worker's block size.
const BLOCK: usize = 16;
/// Group A (behind the proxy) and group B.
const A: &str = "seeded-0/replica-0";
const B: &str = "seeded-0/replica-1";

struct Cluster {
    cache: Service,
    a: Service,
    proxy: Service,
    faults: tap::Faults,
    b: Service,
    scheduler: Service,
}

impl Cluster {
    async fn start() -> Self {
        let cache = start_cache(cache_svc::Config::default()).await.unwrap();
        let a = start_worker(small_worker()).await.unwrap();
        let (proxy, faults) = tap::start_faulty(a.addr).await.unwrap();
        let b = start_worker(small_worker()).await.unwrap();
        let config = scheduler_svc::Config {
            max_context: 256,
            max_tokens: 64,
            peer_pull: true,
            // pinned (a rate given is not replaced by the measured one): a
            // slow prefill, so that every grant pulls, also after the first
            // pull measured the link and the passes the small model's prefill
            peer_prefill_tokens_per_s: Some(1_000),
            // by load: a busy A sends the next request to B whatever it holds
            routing: scheduler_svc::routing::Routing::LeastCommitted,
            ..scheduler_svc::Config::default()
        };
        let scheduler = start_scheduler(config, &cache.url(), &[proxy.url(), b.url()], WITHIN)
            .await
            .unwrap();
        Self {
            cache,
            a,
            proxy,
            faults,
            b,
            scheduler,
        }
    }

    fn request(tokens: Vec<u32>, max_tokens: u32, salt: &str) -> pb::GenerateRequest {
        pb::GenerateRequest {
            tokens,
            max_tokens,
            cache_salt: salt.into(),
            ignore_eos: true,
            ..Default::default()
        }
    }

    async fn generate(&self, tokens: Vec<u32>, salt: &str) -> Generated {
        let mut client = scheduler_client(self.scheduler.addr).await.unwrap();
        let g = collect(&mut client, Self::request(tokens, 4, salt))
            .await
            .unwrap();
        assert_eq!(g.finish_reason(), pb::FinishReason::Length, "{}", g.message);
        g
    }

    /// Generates `tokens` while A runs another request (64 tokens, admitted
    /// first, idle groups tie to A): the least committed group is B.
    async fn generate_while_a_is_busy(&self, tokens: Vec<u32>, seed: u32) -> Generated {
        let before = grants(self.cache.addr, A).await;
        let mut client = scheduler_client(self.scheduler.addr).await.unwrap();
        let mut busy = client
            .generate(Self::request(prompt(32, seed + 50), 64, ""))
            .await
            .unwrap()
            .into_inner();
        // its first tokens: it runs in A, for 60-odd steps more
        let first = busy.message().await.unwrap().unwrap();
        assert!(first.finish_reason == 0, "{first:?}");
        assert_eq!(grants(self.cache.addr, A).await, before + 2, "in A");
        let g = self.generate(tokens, "").await;
        while let Some(m) = busy.message().await.unwrap() {
            if m.finish_reason != 0 {
                assert_eq!(m.finish_reason, pb::FinishReason::Length as i32, "{m:?}");
            }
        }
        g
    }

    /// A 64-token prompt, served in A: its three full blocks are cached
    /// there once it is done.
    async fn publish_in_a(&self, seed: u32) -> Vec<u32> {
        let p = prompt(64, seed);
        let before = grants(self.cache.addr, A).await;
        let g = self.generate(p.clone(), "").await;
        assert_eq!(g.reused_tokens, 0);
        assert_cache_sound(self.cache.addr, A, WITHIN)
            .await
            .unwrap();
        assert_eq!(grants(self.cache.addr, A).await, before + 2, "it ran in A");
        p
    }

    async fn sound(&self) {
        for group in [A, B] {
            assert_cache_sound(self.cache.addr, group, WITHIN)
                .await
                .unwrap();
        }
    }

    async fn stop(self) {
        self.scheduler.stop().await.unwrap();
        self.proxy.stop().await.unwrap();
        self.b.stop().await.unwrap();
        self.a.stop().await.unwrap();
        self.cache.stop().await.unwrap();
    }
}

fn prompt(len: usize, seed: u32) -> Vec<u32> {
    (0..len as u32)
        .map(|j| (j * 13 + seed * 37 + 5) % 250 + 1)
        .collect()
}

/// A prompt sharing `prefix`'s first three blocks, then 32 tokens of its own.
fn sharing(prefix: &[u32], seed: u32) -> Vec<u32> {
    let mut p = prefix[..3 * BLOCK].to_vec();
    p.extend(prompt(32, seed + 100));
    p
}

/// Grants the cache gave in `group`'s pools (one per pool a lease) since
/// it started.
async fn grants(cache: std::net::SocketAddr, group: &str) -> u64 {
    pool_stats(cache, group)
        .await
        .unwrap()
        .iter()
        .map(|p| p.grants)
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefix_cached_in_one_group_is_pulled_into_another_and_a_cut_pull_recomputes() {
    let c = Cluster::start().await;

    // 1. Pulled: B computes only what follows the three pulled blocks.
    let p = c.publish_in_a(1).await;
    let long = sharing(&p, 1);
    let b_before = grants(c.cache.addr, B).await;
    let pulled = c.generate_while_a_is_busy(long.clone(), 1).await;
    assert_eq!(grants(c.cache.addr, B).await, b_before + 2, "it ran in B");
    assert_eq!(pulled.reused_tokens, 48, "three blocks pulled from A");
    assert_eq!(pulled.preemptions, 0);
    c.sound().await;
    // recomputing it all (another salt: nothing to reuse or pull)
    let recomputed = c.generate(long, "another tenant").await;
    assert_eq!(recomputed.reused_tokens, 0);
    assert_eq!(pulled.tokens, recomputed.tokens, "same greedy output");
    c.sound().await;

    // 2. The source goes away mid-pull (the stream ends after one chunk):
    // only that sequence fails; it is recomputed with the same output.
    let p = c.publish_in_a(2).await;
    let long = sharing(&p, 2);
    c.faults.cut_next_pulls(1);
    let cut = c.generate_while_a_is_busy(long.clone(), 2).await;
    assert_eq!(c.faults.pull_cuts_left(), 0, "the pull was cut");
    assert_eq!(cut.preemptions, 1, "recomputed once");
    c.sound().await;
    let recomputed = c.generate(long, "another tenant").await;
    assert_eq!(cut.tokens, recomputed.tokens, "same greedy output");
    c.sound().await;
    c.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefix_cached_by_another_scheduler_is_pulled_from_the_worker_peer_workers_names() {
    const GROUP_A: &str = "a/seeded-0/replica-0";
    const GROUP_B: &str = "b/seeded-0/replica-0";
    // one salt secret: the same prompt of the same principal hashes alike
    // in both schedulers (each would draw a random key otherwise)
    let secret = std::env::temp_dir().join(format!(
        "kvlease-peer-pull-salt-{}-{:?}",
        std::process::id(),
        std::thread::current().id()
    ));
    std::fs::write(&secret, b"one secret for both schedulers").unwrap();
    let cache = start_cache(cache_svc::Config::default()).await.unwrap();
    let a = start_worker(small_worker()).await.unwrap();
    let b = start_worker(small_worker()).await.unwrap();
    let config = |prefix: &str| scheduler_svc::Config {
        pool_group_prefix: prefix.into(),
        holder: format!("scheduler-{prefix}"),
        salt_secret_file: Some(secret.clone()),
        max_context: 256,
        max_tokens: 64,
        peer_pull: true,
        ..scheduler_svc::Config::default()
    };
    let sa = start_scheduler(config("a"), &cache.url(), &[a.url()], WITHIN)
        .await
        .unwrap();
    let sb = start_scheduler(
        scheduler_svc::Config {
            peer_workers: vec![format!("{GROUP_A}={}", a.url())],
            ..config("b")
        },
        &cache.url(),
        &[b.url()],
        WITHIN,
    )
    .await
    .unwrap();
    let generate = |scheduler: std::net::SocketAddr, tokens: Vec<u32>, salt: &'static str| async move {
        let mut client = scheduler_client(scheduler).await.unwrap();
        let g = collect(&mut client, Cluster::request(tokens, 4, salt))
            .await
            .unwrap();
        assert_eq!(g.finish_reason(), pb::FinishReason::Length, "{}", g.message);
        g
    };

    let p = prompt(64, 3);
    let first = generate(sa.addr, p.clone(), "").await;
    assert_eq!(first.reused_tokens, 0);
    assert_cache_sound(cache.addr, GROUP_A, WITHIN)
        .await
        .unwrap();
    // B holds none of it: the three full blocks before the last prompt
    // token come from A's worker
    let pulled = generate(sb.addr, p.clone(), "").await;
    assert_eq!(pulled.reused_tokens, 48, "three blocks pulled from A");
    assert_eq!(pulled.preemptions, 0);
    for group in [GROUP_A, GROUP_B] {
        assert_cache_sound(cache.addr, group, WITHIN).await.unwrap();
    }
    let recomputed = generate(sb.addr, p, "another tenant").await;
    assert_eq!(recomputed.reused_tokens, 0);
    assert_eq!(pulled.tokens, recomputed.tokens, "same greedy output");
    assert_eq!(first.tokens, recomputed.tokens, "same greedy output");
    for group in [GROUP_A, GROUP_B] {
        assert_cache_sound(cache.addr, group, WITHIN).await.unwrap();
    }
    sb.stop().await.unwrap();
    sa.stop().await.unwrap();
    b.stop().await.unwrap();
    a.stop().await.unwrap();
    cache.stop().await.unwrap();
    let _ = std::fs::remove_file(&secret);
}
