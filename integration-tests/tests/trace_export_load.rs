#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a panic is a failed test

//! 2,000 over-subscribing requests against an OTLP receiver that answers
//! every export 300 ms late, at the default export settings: every
//! request's trace arrives whole (its `Generate` root, its cache lease and
//! its cache release), i.e. the exporter dropped none of them; and the
//! cache's evictions are summarized (`Evict` spans are at most a tenth of all
//! spans; a `Grant` says how many blocks its allocation evicted). (About 25 s on a loaded 2-core machine.)

use std::collections::HashMap;
use std::time::{Duration, Instant};

use kvlease_integration_tests as it;
use kvlease_integration_tests::otlp::{OversubscribedCluster, Receiver, traced_bench};
use kvlease_telemetry::TelemetryConfig;

const REQUESTS: u32 = 2000;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_thousand_requests_reach_a_slow_collector_without_drops() {
    let receiver = Receiver::start(Duration::from_millis(300)).unwrap();
    let config = TelemetryConfig {
        otlp_endpoint: Some(receiver.endpoint()),
        log_filter: "warn".into(),
        ..TelemetryConfig::new("kvlease-integration-tests")
    };
    let queue = config.batch.max_queue_size;
    let _telemetry = kvlease_telemetry::init_with(config).unwrap();

    let cluster = OversubscribedCluster::start().await.unwrap();

    let started = Instant::now();
    let sent = traced_bench(cluster.scheduler.addr, REQUESTS, 24, 8)
        .await
        .unwrap();
    let bench_time = started.elapsed();
    let wanted: Vec<[u8; 16]> = sent.iter().map(|s| s.trace).collect();
    let whole = |all: &[it::otlp::Received]| {
        let mut names: HashMap<&[u8], Vec<&str>> = HashMap::new();
        for s in all {
            names
                .entry(s.span.trace_id.as_slice())
                .or_default()
                .push(s.span.name.as_str());
        }
        wanted
            .iter()
            .filter(|t| {
                names.get(t.as_slice()).is_some_and(|n| {
                    n.contains(&"kvlease.v1.Scheduler/Generate")
                        && (n.contains(&"Grant") || n.contains(&"Reject"))
                        && n.contains(&"Release")
                })
            })
            .count()
    };
    let spans = receiver
        .until(Duration::from_secs(120), |all| whole(all) == wanted.len())
        .await;
    let arrived = whole(&spans);
    cluster.stop().await;
    let evicts = spans.iter().filter(|s| s.span.name == "Evict").count();
    // summarized, not gone: the grants whose allocation evicted say how much
    let evicting_grants = spans
        .iter()
        .filter(|s| s.span.name == "Grant")
        .filter(|s| it::otlp::attr_int(&s.span, "kvlease.blocks_evicted").is_some_and(|b| b > 0))
        .count();

    println!(
        "{REQUESTS} requests in {bench_time:.1?}; {arrived} whole traces; {} spans in {} exports (300 ms each); queue {queue}; Evict spans {evicts} ({:.1}%), grants that evicted {evicting_grants}",
        spans.len(),
        receiver.exports(),
        100.0 * evicts as f64 / spans.len().max(1) as f64
    );
    assert_eq!(
        arrived,
        wanted.len(),
        "traces lost on the way to a slow collector"
    );
    assert!(
        evicts * 10 <= spans.len(),
        "{evicts} of {} spans are Evict spans",
        spans.len()
    );
    assert!(
        evicting_grants > 0,
        "no Grant span shows the blocks its allocation evicted"
    );
}
