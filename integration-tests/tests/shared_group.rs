//! Two schedulers started with one pool-group prefix, each over a worker of
//! its own (real cache, CPU workers and schedulers on loopback). The
//! second one's worker is another incarnation under the first one's group
//! name: before, the cache took it, forgot the first worker's blocks, and
//! each scheduler was then granted blocks the other's worker had written
//! (refused by the workers as never written, in a loop of errors). Now the
//! cache refuses the incarnation while the first scheduler's session is
//! open, the second scheduler's start-up fails saying why, and the first
//! serves on with its prefix cache intact.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed unwrap fails the test

use std::time::Duration;

use kvlease::cluster::Service;
use kvlease_integration_tests::{
    GROUP, Generated, assert_cache_sound, generate_settled, scheduler_client, small_worker,
    start_cache, start_scheduler, start_worker,
};

const WITHIN: Duration = Duration::from_secs(60);
const READY: Duration = Duration::from_secs(30);

fn prompt() -> Vec<u32> {
    (0..48).map(|j| (j * 11 + 3) % 250 + 1).collect()
}

async fn generate(cache: &Service, scheduler: &Service) -> Generated {
    let mut client = scheduler_client(scheduler.addr).await.unwrap();
    generate_settled(&mut client, cache.addr, prompt(), 4).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_scheduler_under_the_same_group_name_is_refused_and_the_first_serves_on() {
    let cache = start_cache(cache_svc::Config::default()).await.unwrap();
    let worker_a = start_worker(small_worker()).await.unwrap();
    let worker_b = start_worker(small_worker()).await.unwrap();
    // a short TTL: the second start-up waits about that long (plus a
    // second) for an earlier session of its own to end before it gives up
    let config = scheduler_svc::Config {
        session_ttl_ms: 500,
        max_context: 256,
        max_tokens: 64,
        ..scheduler_svc::Config::default()
    };
    let a = start_scheduler(config.clone(), &cache.url(), &[worker_a.url()], READY)
        .await
        .unwrap();
    let first = generate(&cache, &a).await;
    assert_eq!(first.tokens.len(), 4, "{first:?}");

    let err = start_scheduler(config, &cache.url(), &[worker_b.url()], READY)
        .await
        .expect_err("a second worker under the first one's group name");
    let message = format!("{err:#}");
    for want in [GROUP, "still open", "--pool-group-prefix"] {
        assert!(message.contains(want), "{message} lacks {want:?}");
    }

    // the first scheduler's worker kept its group: its prompt is reused
    let again = generate(&cache, &a).await;
    assert_eq!(again.tokens, first.tokens);
    assert!(again.reused_tokens > 0, "{again:?}");
    assert_cache_sound(cache.addr, GROUP, WITHIN).await.unwrap();
    a.stop().await.unwrap();
    worker_a.stop().await.unwrap();
    worker_b.stop().await.unwrap();
    cache.stop().await.unwrap();
}
