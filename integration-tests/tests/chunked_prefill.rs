//! Chunked prefill through a real cluster (cache, CPU worker, scheduler on
//! loopback ports): a long prompt is prefilled a few tokens a step, and a
//! second request with the same prompt arrives while the first is still
//! prefilling. The cache must only let it reuse the blocks the first one's
//! finished steps wrote, never the blocks of chunks still to come: both
//! greedy outputs equal the output of the prompt run alone.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed unwrap fails the test

use std::time::Duration;

use kvlease_integration_tests::{
    GROUP, Generated, Service, assert_cache_sound, cache_client, collect, scheduler_client,
    small_worker_with, start_cache, start_scheduler, start_worker,
};
use kvlease_proto::v1 as pb;

const WITHIN: Duration = Duration::from_secs(60);
/// The small worker's block size.
const BLOCK: u32 = 16;
/// Eight blocks, prefilled four tokens a step: 32 steps.
const PROMPT: u32 = 8 * BLOCK;
const CHUNK: u32 = 4;

struct Cluster {
    cache: Service,
    worker: Service,
    scheduler: Service,
}

impl Cluster {
    async fn start(overlap: bool) -> Self {
        Self::start_with(scheduler_svc::Config {
            prefill_chunk: CHUNK,
            overlap,
            ..scheduler_svc::Config::default()
        })
        .await
    }

    async fn start_with(config: scheduler_svc::Config) -> Self {
        let cache = start_cache(cache_svc::Config::default()).await.unwrap();
        let worker = start_worker(small_worker_with(4, 192)).await.unwrap();
        let config = scheduler_svc::Config {
            max_context: 256,
            max_tokens: 64,
            ..config
        };
        let scheduler = start_scheduler(config, &cache.url(), &[worker.url()], WITHIN)
            .await
            .unwrap();
        Self {
            cache,
            worker,
            scheduler,
        }
    }

    async fn generate(&self, prompt: Vec<u32>) -> Generated {
        let mut client = scheduler_client(self.scheduler.addr).await.unwrap();
        let g = collect(
            &mut client,
            pb::GenerateRequest {
                tokens: prompt,
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
        self.worker.stop().await.unwrap();
        self.cache.stop().await.unwrap();
    }
}

fn prompt() -> Vec<u32> {
    (0..PROMPT).map(|i| (i * 37 + 11) % 250 + 1).collect()
}

async fn second_request_while_the_first_prefills(overlap: bool) {
    let alone = {
        let cluster = Cluster::start(overlap).await;
        let g = cluster.generate(prompt()).await;
        cluster.stop().await;
        g
    };
    let cluster = Cluster::start(overlap).await;
    let mut events = cache_client(cluster.cache.addr)
        .await
        .unwrap()
        .watch_events(pb::WatchEventsRequest { after_id: 0 })
        .await
        .unwrap()
        .into_inner();
    let first = {
        let cluster = &cluster;
        async move { cluster.generate(prompt()).await }
    };
    let second = {
        let cluster = &cluster;
        async move {
            // The first request's first chunk is published (its step
            // completed) while its later chunks are still to be computed.
            loop {
                let event = tokio::time::timeout(WITHIN, events.message())
                    .await
                    .expect("a block is published")
                    .unwrap()
                    .expect("the event stream stays open");
                if matches!(event.kind, Some(pb::cache_event::Kind::Stored(_))) {
                    break;
                }
            }
            cluster.generate(prompt()).await
        }
    };
    let (first, second) = tokio::join!(first, second);
    assert_eq!(first.reused_tokens, 0);
    assert!(
        second.reused_tokens > 0 && second.reused_tokens < PROMPT,
        "the second request reuses what the first wrote: {}",
        second.reused_tokens
    );
    assert_eq!(first.tokens, alone.tokens, "the first request's output");
    assert_eq!(
        second.tokens, alone.tokens,
        "the second request read only KV the first had written (it reused {} tokens)",
        second.reused_tokens
    );
    cluster.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_arriving_mid_prefill_reuses_only_written_blocks() {
    second_request_while_the_first_prefills(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_arriving_mid_prefill_reuses_only_written_blocks_with_overlap() {
    second_request_while_the_first_prefills(true).await;
}

/// A prompt of `depth + 1` chunks, alone on a pipelined scheduler: each of
/// the first `depth` steps adds a pass without collecting one, so the
/// settle after the first collect carries the progress of several chunks
/// of the one sequence. The cache must hear one report, the furthest (it
/// refuses a batch naming a sequence twice): then the whole prompt is
/// published once its steps complete, and the same prompt again reuses
/// all of it but the block holding its last token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prompt_of_several_chunks_on_a_filling_pipeline_is_published_whole() {
    const CHUNK: u32 = 2 * BLOCK;
    for depth in [2, 3] {
        let cluster = Cluster::start_with(scheduler_svc::Config {
            prefill_chunk: CHUNK,
            overlap: true,
            pipeline_depth: depth,
            ..scheduler_svc::Config::default()
        })
        .await;
        let prompt: Vec<u32> = (0..(depth + 1) * CHUNK)
            .map(|i| (i * 53 + 7) % 250 + 1)
            .collect();
        let first = cluster.generate(prompt.clone()).await;
        let again = cluster.generate(prompt.clone()).await;
        assert_eq!(again.tokens, first.tokens, "depth {depth}");
        assert!(
            again.reused_tokens >= prompt.len() as u32 - BLOCK,
            "depth {depth}: {} of the {}-token prompt reused",
            again.reused_tokens,
            prompt.len()
        );
        cluster.stop().await;
    }
}
