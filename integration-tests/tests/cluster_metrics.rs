//! Whole-cluster metrics: each service's Prometheus endpoint (cache, worker,
//! scheduler) is scraped over HTTP after real traffic, and its figures are
//! checked against the cache's `GetStats` and the scheduler's `GetStatus`.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::Duration;

use kvlease_integration_tests as it;
use kvlease_proto::v1 as pb;
use kvlease_telemetry::metrics::names;

type TestResult = Result<(), Box<dyn std::error::Error + Send + Sync>>;

/// One sample of the text format: name, labels, value.
#[derive(Debug, Clone, PartialEq)]
struct Sample {
    name: String,
    labels: BTreeMap<String, String>,
    value: f64,
}

/// Parses the Prometheus text format (comments skipped; label values
/// without escaped quotes, which is all kvlease emits).
fn parse(text: &str) -> Result<Vec<Sample>, String> {
    let mut samples = Vec::new();
    for line in text.lines().map(str::trim) {
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let (series, value) = line
            .rsplit_once(' ')
            .ok_or_else(|| format!("no value: {line}"))?;
        let value: f64 = value.parse().map_err(|_| format!("bad value: {line}"))?;
        let (name, labels) = match series.split_once('{') {
            None => (series.to_string(), BTreeMap::new()),
            Some((name, rest)) => {
                let body = rest
                    .strip_suffix('}')
                    .ok_or_else(|| format!("unclosed labels: {line}"))?;
                let mut labels = BTreeMap::new();
                for pair in body.split(',').filter(|p| !p.is_empty()) {
                    let (k, v) = pair
                        .split_once('=')
                        .ok_or_else(|| format!("bad label: {line}"))?;
                    labels.insert(k.trim().to_string(), v.trim().trim_matches('"').to_string());
                }
                (name.to_string(), labels)
            }
        };
        samples.push(Sample {
            name,
            labels,
            value,
        });
    }
    Ok(samples)
}

/// The value of `name` whose labels include all of `labels`.
fn value(samples: &[Sample], name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    samples
        .iter()
        .find(|s| {
            s.name == name
                && labels
                    .iter()
                    .all(|(k, v)| s.labels.get(*k).map(String::as_str) == Some(*v))
        })
        .map(|s| s.value)
}

/// The sum of every sample named `name`, whatever its labels.
fn sum(samples: &[Sample], name: &str) -> f64 {
    samples
        .iter()
        .filter(|s| s.name == name)
        .map(|s| s.value)
        .sum()
}

/// `GET /metrics` over a plain HTTP/1.0 connection.
async fn scrape(addr: SocketAddr) -> Result<Vec<Sample>, Box<dyn std::error::Error + Send + Sync>> {
    let (head, body) = it::metrics_page(addr).await?;
    assert!(
        head.starts_with("HTTP/1.") && head.contains(" 200"),
        "scrape of {addr}: {head}"
    );
    assert!(
        head.to_ascii_lowercase().contains("text/plain"),
        "content type: {head}"
    );
    Ok(parse(&body)?)
}

fn metrics_of(service: &it::Service) -> Result<SocketAddr, String> {
    service
        .metrics
        .ok_or_else(|| format!("{} has no metrics endpoint", service.name))
}

#[test]
fn the_text_format_parses() -> Result<(), String> {
    let text = "# HELP x y\n# TYPE x gauge\nkvlease_pool_blocks{pool_id=\"1\",window=\"0\",state=\"free\"} 12\nplain 3.5\n";
    let samples = parse(text)?;
    assert_eq!(
        value(
            &samples,
            "kvlease_pool_blocks",
            &[("state", "free"), ("window", "0")]
        ),
        Some(12.0)
    );
    assert_eq!(value(&samples, "plain", &[]), Some(3.5));
    assert_eq!(
        value(&samples, "kvlease_pool_blocks", &[("state", "fenced")]),
        None
    );
    assert!(parse("broken{a=\"1\" 3").is_err());
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_service_metrics_agree_with_get_stats() -> TestResult {
    let cache = it::start_cache(cache_svc::Config::default()).await?;
    let worker = it::start_worker(it::small_worker_with(16, 256)).await?;
    let scheduler = it::start_scheduler(
        scheduler_svc::Config::default(),
        &cache.url(),
        &[worker.url()],
        Duration::from_secs(60),
    )
    .await?;
    let (cache_metrics, worker_metrics) = (metrics_of(&cache)?, metrics_of(&worker)?);
    let scheduler_metrics = metrics_of(&scheduler)?;

    // traffic with a shared prefix, so grants and reuse move
    let mut client = it::scheduler_client(scheduler.addr).await?;
    let prefix: Vec<u32> = (0..64).map(|t| t % 200 + 1).collect();
    let (mut prompt_tokens, mut output_tokens, mut reused_tokens) = (0, 0, 0);
    for n in 0..6u32 {
        let mut tokens = prefix.clone();
        tokens.extend((0..20).map(|t| (t * 3 + n * 11) % 200 + 1));
        prompt_tokens += tokens.len();
        let g = it::collect(
            &mut client,
            pb::GenerateRequest {
                tokens,
                max_tokens: 8,
                ..Default::default()
            },
        )
        .await?;
        assert!(
            matches!(
                g.finish_reason(),
                pb::FinishReason::Length | pb::FinishReason::Stop
            ),
            "{g:?}"
        );
        output_tokens += g.tokens.len();
        reused_tokens += g.reused_tokens;
    }
    let pools = it::wait_whole(cache.addr, it::GROUP, Duration::from_secs(10)).await?;
    assert!(!pools.is_empty(), "the cache reports no pool");

    // cache: blocks by state, totals and per-pool counters are GetStats'
    let c = scrape(cache_metrics).await?;
    let stats = it::cache_client(cache.addr)
        .await?
        .get_stats(pb::GetStatsRequest::default())
        .await?
        .into_inner();
    assert!(!stats.pools.is_empty());
    for pool in &stats.pools {
        let (id, window) = (pool.pool_id.to_string(), pool.window.to_string());
        let at = |state: &str| {
            value(
                &c,
                names::POOL_BLOCKS,
                &[
                    (names::POOL_GROUP, &pool.pool_group),
                    (names::POOL_ID, &id),
                    (names::WINDOW, &window),
                    (names::STATE, state),
                ],
            )
        };
        assert_eq!(
            at(names::STATE_FREE),
            Some(f64::from(pool.free)),
            "free of {pool:?}"
        );
        assert_eq!(
            at(names::STATE_CACHED),
            Some(f64::from(pool.cached_evictable)),
            "cached of {pool:?}"
        );
        assert_eq!(
            at(names::STATE_IN_USE),
            Some(f64::from(pool.in_use)),
            "in use of {pool:?}"
        );
        assert_eq!(
            at(names::STATE_FENCED),
            Some(f64::from(pool.fenced)),
            "fenced of {pool:?}"
        );
        assert_eq!(
            value(
                &c,
                names::POOL_CAPACITY_BLOCKS,
                &[
                    (names::POOL_GROUP, &pool.pool_group),
                    (names::POOL_ID, &id),
                    (names::WINDOW, &window)
                ]
            ),
            Some(f64::from(pool.total)),
            "total of {pool:?}"
        );
        let per_pool = |name: &str| {
            value(
                &c,
                name,
                &[(names::POOL_GROUP, &pool.pool_group), (names::POOL_ID, &id)],
            )
            .unwrap_or(0.0)
        };
        assert_eq!(
            per_pool(names::POOL_GRANTS_TOTAL),
            pool.grants as f64,
            "grants of {pool:?}"
        );
        assert_eq!(
            per_pool(names::POOL_REJECTS_TOTAL),
            pool.rejects as f64,
            "rejects of {pool:?}"
        );
        assert_eq!(
            per_pool(names::REUSE_HIT_BLOCKS_TOTAL),
            pool.reuse_hits as f64,
            "reuse hits of {pool:?}"
        );
        assert_eq!(
            per_pool(names::REUSE_LOOKUP_BLOCKS_TOTAL),
            pool.reuse_lookups as f64,
            "lookups of {pool:?}"
        );
        assert_eq!(
            per_pool(names::EVICTIONS_TOTAL),
            pool.evictions as f64,
            "evictions of {pool:?}"
        );
    }
    // the shared prefix was found again
    assert!(
        stats.pools.iter().any(|p| p.reuse_hits > 0),
        "no reuse in {stats:?}"
    );
    let granted: f64 = c
        .iter()
        .filter(|s| s.name == names::GRANTS_TOTAL)
        .map(|s| s.value)
        .sum();
    assert!(granted > 0.0, "the cache counted no grant");

    // worker: its pool sizes are the cache's totals, and it ran forwards
    let w = scrape(worker_metrics).await?;
    for pool in &pools {
        let window = pool.window.to_string();
        assert_eq!(
            value(
                &w,
                names::WORKER_POOL_CAPACITY_BLOCKS,
                &[(names::WINDOW, &window)]
            ),
            Some(f64::from(pool.total)),
            "worker pool of window {window} vs GetStats {pool:?}"
        );
    }
    let forwards = value(
        &w,
        &format!("{}_count", names::FORWARD_COMPUTE_DURATION_SECONDS),
        &[],
    )
    .unwrap_or(0.0);
    assert!(forwards > 0.0, "the worker's forward histogram is empty");

    // scheduler: its counters are GetStatus', and it stepped
    let status = client
        .get_status(pb::GetStatusRequest {})
        .await?
        .into_inner();
    let s = scrape(scheduler_metrics).await?;
    let finished = |reason: &str| {
        value(
            &s,
            names::REQUESTS_FINISHED_TOTAL,
            &[(names::REASON, reason)],
        )
        .unwrap_or(0.0)
    };
    assert_eq!(
        finished("length") + finished("stop"),
        (status.finished_length + status.finished_stop) as f64,
        "{status:?}"
    );
    assert_eq!(finished("length") + finished("stop"), 6.0);
    assert_eq!(
        value(&s, names::QUEUE_DEPTH, &[]),
        Some(f64::from(status.queued)),
        "{status:?}"
    );
    assert_eq!(
        value(&s, names::RUNNING_SEQUENCES, &[]),
        Some(f64::from(status.running)),
        "{status:?}"
    );
    assert_eq!(sum(&s, names::PREEMPTIONS_TOTAL), status.preemptions as f64);
    // per request: six timed, their prompts and outputs counted
    let count = |name: &str| sum(&s, &format!("{name}_count"));
    assert_eq!(count(names::REQUEST_DURATION_SECONDS), 6.0);
    assert_eq!(count(names::TIME_TO_FIRST_TOKEN_SECONDS), 6.0);
    assert_eq!(count(names::QUEUE_WAIT_SECONDS), 6.0);
    assert_eq!(sum(&s, names::PROMPT_TOKENS_TOTAL), prompt_tokens as f64);
    assert_eq!(sum(&s, names::OUTPUT_TOKENS_TOTAL), output_tokens as f64);
    assert_eq!(sum(&s, names::REUSED_TOKENS_TOTAL), reused_tokens as f64);
    assert!(reused_tokens > 0, "the shared prefix was reused");
    let forward_rpcs = count(names::FORWARD_RPC_DURATION_SECONDS);
    assert!(
        forward_rpcs > 0.0,
        "the scheduler's forward histogram is empty"
    );
    let steps = value(&s, &format!("{}_count", names::STEP_DURATION_SECONDS), &[]).unwrap_or(0.0);
    assert!(steps > 0.0, "the scheduler's step histogram is empty");
    // the pools the scheduler reports are the cache's
    assert_eq!(
        status.pools, pools,
        "GetStatus pools vs the cache's GetStats"
    );

    scheduler.stop().await?;
    worker.stop().await?;
    cache.stop().await?;
    Ok(())
}
