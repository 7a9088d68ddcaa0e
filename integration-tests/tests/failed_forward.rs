//! A forward pass that fails through a real cluster (cache, CPU worker
//! behind a proxy that fails a pass without passing it on, scheduler on
//! loopback ports). The scheduler releases the pass's sequences fenced at
//! its step and then completes that step; the cache must not publish the
//! blocks that pass was to write: the requeued request and a later one with
//! the same prompt must never reuse KV that was never written (the CPU
//! worker refuses to read it), and both greedy outputs equal the prompt's
//! output run alone.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed unwrap fails the test

use std::time::Duration;

use kvlease_integration_tests::{
    GROUP, Generated, Service, assert_cache_sound, collect, scheduler_client, small_worker,
    start_cache, start_scheduler, start_worker, tap,
};
use kvlease_proto::v1 as pb;

const WITHIN: Duration = Duration::from_secs(60);
/// The small worker's block size.
const BLOCK: u32 = 16;
/// Four full blocks and a partly filled one.
const PROMPT: u32 = 4 * BLOCK + 5;

struct Cluster {
    cache: Service,
    worker: Service,
    proxy: Service,
    faults: tap::Faults,
    scheduler: Service,
}

impl Cluster {
    async fn start(overlap: bool) -> Self {
        let cache = start_cache(cache_svc::Config::default()).await.unwrap();
        let worker = start_worker(small_worker()).await.unwrap();
        let (proxy, faults) = tap::start_faulty(worker.addr).await.unwrap();
        let config = scheduler_svc::Config {
            max_context: 256,
            max_tokens: 64,
            overlap,
            ..scheduler_svc::Config::default()
        };
        let scheduler = start_scheduler(config, &cache.url(), &[proxy.url()], WITHIN)
            .await
            .unwrap();
        Self {
            cache,
            worker,
            proxy,
            faults,
            scheduler,
        }
    }

    async fn generate(&self) -> Generated {
        let mut client = scheduler_client(self.scheduler.addr).await.unwrap();
        let g = collect(
            &mut client,
            pb::GenerateRequest {
                tokens: prompt(),
                max_tokens: 12,
                ..Default::default()
            },
        )
        .await
        .unwrap();
        assert_eq!(g.finish_reason(), pb::FinishReason::Length, "{}", g.message);
        g
    }

    async fn stop(self) {
        assert_cache_sound(self.cache.addr, GROUP, WITHIN)
            .await
            .unwrap();
        self.scheduler.stop().await.unwrap();
        self.proxy.stop().await.unwrap();
        self.worker.stop().await.unwrap();
        self.cache.stop().await.unwrap();
    }
}

fn prompt() -> Vec<u32> {
    (0..PROMPT).map(|i| (i * 37 + 11) % 250 + 1).collect()
}

async fn a_failed_prefill_publishes_nothing(overlap: bool) {
    let alone = {
        let cluster = Cluster::start(overlap).await;
        let g = cluster.generate().await;
        cluster.stop().await;
        g
    };
    let cluster = Cluster::start(overlap).await;
    // the request's first pass (its prefill) fails; the scheduler requeues
    // it and computes it again once the worker is tried again
    cluster.faults.fail_next(1);
    let first = cluster.generate().await;
    assert_eq!(cluster.faults.left(), 0, "the failure was injected");
    assert_eq!(first.preemptions, 1, "requeued once after the failure");
    assert_eq!(
        first.reused_tokens, 0,
        "nothing the failed pass was to write is reused"
    );
    assert_eq!(first.tokens, alone.tokens, "the requeued request's output");
    // the recomputed prompt's blocks were written: a later request reuses them
    let second = cluster.generate().await;
    assert!(second.reused_tokens > 0, "{}", second.reused_tokens);
    assert_eq!(second.tokens, alone.tokens, "a later request's output");
    cluster.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_forward_pass_publishes_nothing_it_was_to_write() {
    a_failed_prefill_publishes_nothing(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_forward_pass_publishes_nothing_it_was_to_write_with_overlap() {
    a_failed_prefill_publishes_nothing(true).await;
}
