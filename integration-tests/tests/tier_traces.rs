//! Issue 29, point 13: no span showed the tier a request's reused KV came
//! from (blocks onboarded from host memory left nothing in any trace) or the
//! replica that ran it. A cluster whose worker has a host tier: a prompt's
//! blocks are evicted from the device by six others (demoted to host
//! memory), then the prompt comes again under a trace of its own. Its
//! `Grant` (the cache) and its `prefill` (the worker) say `kvlease.tier` =
//! `host` with the blocks onboarded, and the `prefill` names its replica.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed unwrap fails the test

use std::time::Duration;

use kvlease_integration_tests::otlp::{Received, Receiver, attr_int, attr_str, hex};
use kvlease_integration_tests::{
    collect, generate_settled, scheduler_client, start_tiered_cluster,
};
use kvlease_proto::v1 as pb;
use kvlease_telemetry::attributes::{ONBOARDED_BLOCKS, REPLICA, TIER, TIER_HOST};

/// 64 tokens: 4 of the pool's 20 blocks (as in `host_tier.rs`).
fn prompt(i: u32) -> Vec<u32> {
    (0..64).map(|j| (j * 13 + i * 37 + 5) % 250 + 1).collect()
}

/// The spans of trace `trace` named `name`.
fn named<'a>(spans: &'a [Received], trace: &[u8], name: &str) -> Vec<&'a Received> {
    spans
        .iter()
        .filter(|s| s.span.trace_id == trace && s.span.name == name)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefix_onboarded_from_host_memory_shows_its_tier_and_replica() {
    let receiver = Receiver::start(Duration::ZERO).unwrap();
    let _telemetry = receiver.export_here().unwrap();
    let (cache, worker, scheduler) = start_tiered_cluster(80).await.unwrap();
    let mut client = scheduler_client(scheduler.addr).await.unwrap();
    for i in 0..=6 {
        generate_settled(&mut client, cache.addr, prompt(i), 4).await;
    }
    let trace: [u8; 16] = *b"tier-trace-test1";
    let mut request = tonic::Request::new(pb::GenerateRequest {
        tokens: prompt(0),
        max_tokens: 4,
        ..Default::default()
    });
    let parent = format!("00-{}-{}-01", hex(&trace), hex(&trace[..8]));
    request
        .metadata_mut()
        .insert("traceparent", parent.parse().unwrap());
    let again = collect(&mut client, request).await.unwrap();
    assert_eq!(
        again.reused_tokens, 48,
        "the prefix came back from the host"
    );

    let spans = receiver
        .until(Duration::from_secs(60), |all| {
            !named(all, &trace, "Grant").is_empty() && !named(all, &trace, "prefill").is_empty()
        })
        .await;
    scheduler.stop().await.unwrap();
    worker.stop().await.unwrap();
    cache.stop().await.unwrap();

    // the cache's Grant and the worker's prefill
    for name in ["Grant", "prefill"] {
        let spans = named(&spans, &trace, name);
        assert!(
            spans.iter().any(|s| {
                attr_str(&s.span, TIER).as_deref() == Some(TIER_HOST)
                    && attr_int(&s.span, ONBOARDED_BLOCKS).is_some_and(|b| b >= 3)
            }),
            "no {name} span says its KV was onboarded from host memory: {spans:#?}"
        );
    }
    let prefills = named(&spans, &trace, "prefill");
    assert!(
        prefills
            .iter()
            .all(|p| attr_str(&p.span, REPLICA).is_some_and(|r| !r.is_empty())),
        "a prefill span without its replica: {prefills:#?}"
    );
}
