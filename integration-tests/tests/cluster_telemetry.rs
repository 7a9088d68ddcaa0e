//! Whole-cluster traces: cache, worker and scheduler run in this process and
//! export their spans over OTLP/gRPC to a real receiver (the
//! `opentelemetry-proto` tonic server) started by the test.
//!
//! - one request's trace holds the scheduler's and the cache's spans, and the
//!   worker's forward passes are one link away (the step trace's `Forward`
//!   call links to every request in its batch);
//! - a rejected request's trace holds the `Reject` span with the reason and
//!   the figures the client was told;
//! - a fenced `Release` is linked from the `CompleteStep` that freed it.
//!
//! The test binary installs the global subscriber once; each test starts its
//! own cluster and picks its spans out by trace id.

use std::collections::BTreeSet;
use std::sync::OnceLock;
use std::time::Duration;

use futures::future::join_all;
use kvlease_integration_tests as it;
use kvlease_integration_tests::otlp::{Received, Receiver, attr_bool, attr_int, attr_str, value};
use kvlease_proto::v1 as pb;
use kvlease_telemetry::attributes::{LINK_FENCED_RELEASE, LINK_KIND, REJECT_SPAN};
use kvlease_telemetry::{TelemetryConfig, TelemetryGuard};
use opentelemetry_proto::tonic::common::v1::any_value::Value as AnyValue;
use opentelemetry_proto::tonic::trace::v1::Span;
use opentelemetry_proto::tonic::trace::v1::status::StatusCode;

type TestResult = Result<(), Box<dyn std::error::Error + Send + Sync>>;

const SCHEDULER: &str = "kvlease-scheduler";
const CACHE: &str = "kvlease-cache";
const WORKER: &str = "kvlease-worker";

// === the receiver ===

#[derive(Debug)]
struct Collector {
    spans: Receiver,
    _telemetry: TelemetryGuard,
}

/// The receiver (on its own thread and runtime, so it outlives every test's
/// runtime) and the global telemetry exporting to it, set up once.
fn collector() -> Result<&'static Collector, String> {
    static COLLECTOR: OnceLock<Result<Collector, String>> = OnceLock::new();
    COLLECTOR
        .get_or_init(|| {
            let spans = Receiver::start(Duration::ZERO).map_err(|e| e.to_string())?;
            let telemetry = kvlease_telemetry::init_with(TelemetryConfig {
                otlp_endpoint: Some(spans.endpoint()),
                log_filter: "warn".into(),
                export_timeout: Duration::from_secs(5),
                ..TelemetryConfig::new("kvlease-integration-tests")
            })
            .map_err(|e| e.to_string())?;
            Ok(Collector {
                spans,
                _telemetry: telemetry,
            })
        })
        .as_ref()
        .map_err(Clone::clone)
}

/// Polls the received spans until `done` holds for them (the batch exporter
/// sends every second), or gives up and returns the last snapshot.
async fn spans_until(
    spans: &Receiver,
    within: Duration,
    done: impl Fn(&[Span]) -> bool,
) -> Vec<Span> {
    let only_spans = |all: &[Received]| all.iter().map(|r| r.span.clone()).collect::<Vec<_>>();
    let all = spans.until(within, |all| done(&only_spans(all))).await;
    only_spans(&all)
}

// === span helpers ===

fn service(span: &Span) -> String {
    attr_str(span, "kvlease.service").unwrap_or_default()
}

fn in_trace(spans: &[Span], trace_id: &[u8; 16]) -> Vec<Span> {
    spans
        .iter()
        .filter(|s| s.trace_id == trace_id)
        .cloned()
        .collect()
}

fn describe(spans: &[Span]) -> String {
    spans
        .iter()
        .map(|s| format!("{} [{}]", s.name, service(s)))
        .collect::<Vec<_>>()
        .join(", ")
}

/// A request carrying a W3C `traceparent` with our own trace id, so the test
/// knows which trace is this request's.
fn traced_request(
    request: pb::GenerateRequest,
    trace_id: [u8; 16],
) -> Result<tonic::Request<pb::GenerateRequest>, Box<dyn std::error::Error + Send + Sync>> {
    let mut r = tonic::Request::new(request);
    let parent = format!("00-{}-{}-01", hex(&trace_id), hex(&trace_id[..8]));
    r.metadata_mut().insert("traceparent", parent.parse()?);
    Ok(r)
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// A fresh trace id per request and test run.
fn trace_id(test: u8, n: u32) -> [u8; 16] {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    let mut id = [0u8; 16];
    id[..8].copy_from_slice(&nanos.to_be_bytes());
    id[8] = test;
    id[12..].copy_from_slice(&n.to_be_bytes());
    id[15] |= 1; // never all zero
    id
}

/// Runs a traced `Generate` to its end.
async fn generate(
    scheduler: std::net::SocketAddr,
    request: pb::GenerateRequest,
    trace: [u8; 16],
) -> Result<it::Generated, Box<dyn std::error::Error + Send + Sync>> {
    let mut client = it::scheduler_client(scheduler).await?;
    let mut stream = client
        .generate(traced_request(request, trace)?)
        .await?
        .into_inner();
    let mut g = it::Generated::default();
    while let Some(msg) = stream.message().await? {
        g.tokens.extend(&msg.tokens);
        if msg.finish_reason != 0 {
            g.finish = msg.finish_reason;
            g.reject = msg.reject;
            g.message = msg.message;
        }
    }
    Ok(g)
}

struct Cluster {
    cache: it::Service,
    worker: it::Service,
    scheduler: it::Service,
}

impl Cluster {
    async fn start(
        worker: worker_svc::Config,
        scheduler: scheduler_svc::Config,
    ) -> Result<Self, Box<dyn std::error::Error + Send + Sync>> {
        let cache = it::start_cache(cache_svc::Config::default()).await?;
        let worker = it::start_worker(worker).await?;
        let scheduler = it::start_scheduler(
            scheduler,
            &cache.url(),
            &[worker.url()],
            Duration::from_secs(60),
        )
        .await?;
        Ok(Self {
            cache,
            worker,
            scheduler,
        })
    }

    async fn stop(self) {
        let _ = self.scheduler.stop().await;
        let _ = self.worker.stop().await;
        let _ = self.cache.stop().await;
    }
}

// === tests ===

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_request_is_one_trace_across_scheduler_cache_and_worker() -> TestResult {
    let collector = collector()?;
    // every step trace exported, so the forward passes can be followed
    let cluster = Cluster::start(
        it::small_worker_with(16, 256),
        scheduler_svc::Config {
            trace_steps_one_in: 1,
            ..scheduler_svc::Config::default()
        },
    )
    .await?;
    let trace = trace_id(1, 0);
    let request = pb::GenerateRequest {
        text: "one trace, three services".into(),
        max_tokens: 6,
        ..Default::default()
    };
    let g = generate(cluster.scheduler.addr, request, trace).await?;
    assert!(
        matches!(
            g.finish_reason(),
            pb::FinishReason::Length | pb::FinishReason::Stop
        ),
        "the request did not complete: {g:?}"
    );

    let wanted: BTreeSet<&str> = [SCHEDULER, CACHE].into();
    // the worker's Forward server spans under a step's Forward call linked to this request
    let linked_forwards = |all: &[Span]| -> Vec<Span> {
        let calls: Vec<&Span> = all
            .iter()
            .filter(|s| {
                s.name == "kvlease.v1.WorkerService/Forward"
                    && service(s) == SCHEDULER
                    && s.links.iter().any(|l| l.trace_id == trace)
            })
            .collect();
        all.iter()
            .filter(|s| {
                service(s) == WORKER
                    && s.name == "kvlease.v1.WorkerService/Forward"
                    && calls.iter().any(|c| c.span_id == s.parent_span_id)
            })
            .cloned()
            .collect()
    };
    let spans = spans_until(&collector.spans, Duration::from_secs(15), |all| {
        let services: BTreeSet<String> = in_trace(all, &trace).iter().map(service).collect();
        wanted.iter().all(|w| services.contains(*w)) && !linked_forwards(all).is_empty()
    })
    .await;
    cluster.stop().await;

    let mine = in_trace(&spans, &trace);
    let services: BTreeSet<String> = mine.iter().map(service).collect();
    for w in &wanted {
        assert!(
            services.contains(*w),
            "no {w} span in the request's trace; it holds: {}",
            describe(&mine)
        );
    }
    // the scheduler's server span continues the client's context
    let generate_span = mine
        .iter()
        .find(|s| s.name == "kvlease.v1.Scheduler/Generate")
        .ok_or_else(|| format!("no Generate server span in: {}", describe(&mine)))?;
    assert_eq!(
        generate_span.parent_span_id,
        trace[..8].to_vec(),
        "the Generate span lost its remote parent"
    );
    // the cache granted the lease inside this trace, the scheduler summed up
    // the forward work, and the worker's passes are one link away
    assert!(
        mine.iter()
            .any(|s| s.name == "Grant" && service(s) == CACHE),
        "no cache Grant span in the trace: {}",
        describe(&mine)
    );
    assert!(
        mine.iter()
            .any(|s| s.name == "forward" && attr_int(s, "kvlease.forward_steps").unwrap_or(0) > 0),
        "no forward summary in the trace: {}",
        describe(&mine)
    );
    assert!(
        !linked_forwards(&spans).is_empty(),
        "no worker Forward span under a step's Forward call linked to the request"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rejected_request_trace_holds_the_reject_span_with_its_figures() -> TestResult {
    let collector = collector()?;
    // a pool of a few dozen blocks, far more demand, and rejection (not
    // preemption) when a running request cannot grow
    let scheduler = scheduler_svc::Config {
        on_exhausted: scheduler_svc::policy::OnExhausted::Reject,
        max_context: 256,
        max_tokens: 200,
        ..scheduler_svc::Config::default()
    };
    let cluster = Cluster::start(it::small_worker_with(2, 192), scheduler).await?;
    let pools = it::pool_stats(cluster.cache.addr, it::GROUP).await?;
    let total = pools.iter().map(|p| p.total).max().unwrap_or(0);
    let requests = 24u32;
    let calls = (0..requests).map(|n| {
        let request = pb::GenerateRequest {
            tokens: (0..48).map(|t| (t * 7 + n * 13) % 250 + 1).collect(),
            max_tokens: 200,
            ..Default::default()
        };
        let trace = trace_id(2, n);
        async move {
            (
                trace,
                generate(cluster.scheduler.addr, request, trace).await,
            )
        }
    });
    let results = join_all(calls).await;
    let mut rejected = Vec::new();
    for (trace, r) in results {
        let g = r?;
        if g.finish_reason() == pb::FinishReason::Rejected {
            let reject = g
                .reject
                .clone()
                .ok_or("REJECTED without the cache's reject")?;
            rejected.push((trace, reject));
        }
    }
    assert!(
        !rejected.is_empty(),
        "{requests} requests of 248 tokens over a pool of {total} blocks: none was rejected"
    );

    // the refusal that ended a request is one its scheduler did not retry;
    // a lease refused earlier (the request stayed queued, `kvlease.retried`)
    // has a Reject span of its own, which may be exported first
    let ending = |s: &Span| s.name == REJECT_SPAN && attr_bool(s, "kvlease.retried") != Some(true);
    let spans = spans_until(&collector.spans, Duration::from_secs(15), |all| {
        rejected
            .iter()
            .all(|(trace, _)| in_trace(all, trace).iter().any(ending))
    })
    .await;
    cluster.stop().await;

    for (trace, reject) in &rejected {
        let mine = in_trace(&spans, trace);
        let last_reject = mine
            .iter()
            .filter(|s| ending(s))
            .max_by_key(|s| s.end_time_unix_nano);
        let span = last_reject.ok_or_else(|| {
            format!(
                "the rejected request's trace has no {REJECT_SPAN} span: {}",
                describe(&mine)
            )
        })?;
        let reason = pb::RejectReason::try_from(reject.reason).map_or("?", |r| r.as_str_name());
        assert_eq!(
            attr_str(span, "kvlease.reject_reason").as_deref(),
            Some(reason),
            "{span:?}"
        );
        assert_eq!(
            attr_int(span, "kvlease.blocks_needed"),
            Some(i64::from(reject.blocks_needed)),
            "{span:?}"
        );
        assert_eq!(
            attr_int(span, "kvlease.blocks_free"),
            Some(i64::from(reject.blocks_free)),
            "{span:?}"
        );
        assert_eq!(
            attr_int(span, "kvlease.blocks_pending_free"),
            Some(i64::from(reject.blocks_pending_free)),
            "{span:?}"
        );
        assert_eq!(
            attr_int(span, "kvlease.window"),
            Some(i64::from(reject.window)),
            "{span:?}"
        );
        let status = span.status.as_ref().map(|s| s.code);
        assert_eq!(
            status,
            Some(StatusCode::Error as i32),
            "a reject is an error span: {span:?}"
        );
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fenced_release_is_linked_to_the_complete_step_that_freed_it() -> TestResult {
    let collector = collector()?;
    // every step trace exported: the CompleteStep spans live there
    let cluster = Cluster::start(
        it::small_worker_with(16, 256),
        scheduler_svc::Config {
            trace_steps_one_in: 1,
            ..scheduler_svc::Config::default()
        },
    )
    .await?;
    let traces: Vec<[u8; 16]> = (0..3).map(|n| trace_id(3, n)).collect();
    for (n, trace) in traces.iter().enumerate() {
        let request = pb::GenerateRequest {
            text: format!("fenced release {n}"),
            max_tokens: 3,
            ..Default::default()
        };
        let g = generate(cluster.scheduler.addr, request, *trace).await?;
        assert!(
            matches!(
                g.finish_reason(),
                pb::FinishReason::Length | pb::FinishReason::Stop
            ),
            "{g:?}"
        );
    }
    let is_link = |l: &opentelemetry_proto::tonic::trace::v1::span::Link| matches!(value(&l.attributes, LINK_KIND), Some(AnyValue::StringValue(k)) if k == LINK_FENCED_RELEASE);
    // a completion (a CompleteStep call, or a Step call's completion part) of
    // the cache linked to a Release span of one of our requests
    let completes = |s: &Span| s.name.ends_with("CompleteStep") || s.name.ends_with("/Step");
    let linked = |all: &[Span]| -> Option<(Span, Span)> {
        all.iter()
            .filter(|s| completes(s) && service(s) == CACHE)
            .find_map(|c| {
                c.links.iter().filter(|l| is_link(l)).find_map(|l| {
                    let release = all
                        .iter()
                        .find(|s| s.span_id == l.span_id && s.trace_id == l.trace_id)?;
                    let ours = traces.iter().any(|t| release.trace_id == t);
                    (ours && release.name.contains("Release")).then(|| (c.clone(), release.clone()))
                })
            })
    };
    let spans = spans_until(&collector.spans, Duration::from_secs(15), |all| {
        linked(all).is_some()
    })
    .await;
    cluster.stop().await;

    let complete_steps: Vec<&Span> = spans.iter().filter(|s| completes(s)).collect();
    let (complete, release) = linked(&spans).ok_or_else(|| {
        format!(
            "no cache CompleteStep span links a Release of our requests; CompleteStep spans: {}; their links: {:?}",
            complete_steps.len(),
            complete_steps.iter().map(|s| s.links.len()).collect::<Vec<_>>()
        )
    })?;
    assert_eq!(
        service(&release),
        CACHE,
        "the linked span is the cache's Release: {release:?}"
    );
    // the release was fenced at a step the CompleteStep covers
    if let (Some(fence), Some(step)) = (
        attr_int(&release, "kvlease.fence_step"),
        attr_int(&complete, "kvlease.step"),
    ) {
        assert!(
            fence <= step,
            "released fenced at step {fence} but freed by CompleteStep({step})"
        );
    }
    Ok(())
}
