#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a panic is a failed test

//! Traces a dashboard user can read (issue 14): an over-subscribed bench of
//! 200 requests across two workers, exported over OTLP/gRPC to a receiver in
//! the test, then read the way a tracing dashboard shows them.
//!
//! - at least 95% of requests have a complete trace: the `Generate` root, their
//!   lease at the cache (its `Grant` or `Reject` span), their forward work
//!   (the `forward` summary span) and their release at the cache;
//! - every rejected request has the cache's `Reject` in its own trace, with
//!   the figures the client was told, and an ERROR root;
//! - no successful request's trace holds another request's reject;
//! - root spans are only `Generate` and sampled `step`s;
//! - the median request trace has at most 30 spans;
//! - the cache, the scheduler and both workers export under their own
//!   `service.name` (and the workers under two `service.instance.id`s);
//! - every request that finished `LENGTH`/`STOP` holds its prefill work on the
//!   worker: `prefill` spans of a worker (tokens, reused tokens, replica) that
//!   cover its prompt, and no ERROR span (a preemption or a refused
//!   admission that was retried is not an error);
//! - no span links to a span that was not exported (an unsampled step).
//!
//! It prints the figures and one rejected request's trace as a tree.

use std::collections::{BTreeSet, HashMap};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use kvlease_integration_tests::metric_total;
use kvlease_integration_tests::otlp::{
    OversubscribedCluster, Received, Receiver, Sent, attr_int, attr_ints, attr_str, hex,
    traced_bench, tree,
};
use kvlease_proto::v1 as pb;
use kvlease_telemetry::attributes::{REJECT_SPAN, STEP_SAMPLED, STEP_SPAN};
use kvlease_telemetry::metrics::names::REJECTS_TOTAL;

const SCHEDULER: &str = "kvlease-scheduler";
const CACHE: &str = "kvlease-cache";
const WORKER: &str = "kvlease-worker";
const GENERATE: &str = "kvlease.v1.Scheduler/Generate";
const ERROR: i32 = 2;
/// The worker's span for one prefill chunk of a sequence, in its request's
/// trace.
const PREFILL: &str = "prefill";
const PROMPT: u32 = 48;

/// The cache's `Reject` spans that started at or after `since`: one per
/// sequence it refused, in the request's trace or in the step's.
fn cache_rejects(spans: &[Received], since: u64) -> usize {
    spans
        .iter()
        .filter(|s| {
            s.service == CACHE && s.span.name == REJECT_SPAN && s.span.start_time_unix_nano >= since
        })
        .count()
}

fn rejected(s: &Sent) -> bool {
    s.result.finish_reason() == pb::FinishReason::Rejected
}

fn finished(s: &Sent) -> bool {
    matches!(
        s.result.finish_reason(),
        pb::FinishReason::Length | pb::FinishReason::Stop
    )
}

fn is_error(s: &Received) -> bool {
    s.span.status.as_ref().map(|st| st.code) == Some(ERROR)
}

/// The links among `spans` whose target span was not exported, as
/// "name -> trace/span".
/// Spans started from `since` on whose parent has not arrived (yet): a
/// step's root is exported when the step's span ends, after the Forward
/// and cache spans under it.
fn orphans(spans: &[Received], since: u64) -> usize {
    let ids: BTreeSet<(&[u8], &[u8])> = spans
        .iter()
        .map(|s| (s.span.trace_id.as_slice(), s.span.span_id.as_slice()))
        .collect();
    spans
        .iter()
        .filter(|s| {
            s.span.start_time_unix_nano >= since
                // a Generate root's parent is the client's, never exported
                && s.span.name != GENERATE
                && !s.span.parent_span_id.is_empty()
                && !ids.contains(&(s.span.trace_id.as_slice(), s.span.parent_span_id.as_slice()))
        })
        .count()
}

fn dangling_links(spans: &[Received]) -> Vec<String> {
    let ids: BTreeSet<(&[u8], &[u8])> = spans
        .iter()
        .map(|s| (s.span.trace_id.as_slice(), s.span.span_id.as_slice()))
        .collect();
    spans
        .iter()
        .flat_map(|s| s.span.links.iter().map(move |l| (s, l)))
        .filter(|(_, l)| !ids.contains(&(l.trace_id.as_slice(), l.span_id.as_slice())))
        .map(|(s, l)| {
            format!(
                "{} [{}] -> {}/{}",
                s.span.name,
                s.service,
                hex(&l.trace_id),
                hex(&l.span_id)
            )
        })
        .collect()
}

/// Whether the worker's `prefill` spans of one sequence of the trace cover
/// the prompt: its reused tokens plus the tokens of its chunks.
fn prefilled_on_worker(trace: &[&Received]) -> bool {
    let mut by_seq: HashMap<i64, (i64, i64)> = HashMap::new();
    for p in named(trace, PREFILL, WORKER) {
        let (Some(seq), Some(tokens), Some(reused)) = (
            attr_int(&p.span, "kvlease.seq_id"),
            attr_int(&p.span, "kvlease.tokens"),
            attr_int(&p.span, "kvlease.reused_tokens"),
        ) else {
            continue;
        };
        let e = by_seq.entry(seq).or_default();
        e.0 = reused;
        e.1 += tokens;
    }
    by_seq
        .values()
        .any(|(reused, tokens)| reused + tokens >= i64::from(PROMPT))
}

/// The spans of each trace.
fn by_trace(spans: &[Received]) -> HashMap<&[u8], Vec<&Received>> {
    let mut traces: HashMap<&[u8], Vec<&Received>> = HashMap::new();
    for s in spans {
        traces
            .entry(s.span.trace_id.as_slice())
            .or_default()
            .push(s);
    }
    traces
}

fn named<'a>(trace: &[&'a Received], name: &str, service: &str) -> Vec<&'a Received> {
    trace
        .iter()
        .filter(|s| s.span.name == name && s.service == service)
        .copied()
        .collect()
}

/// Whether the spans of one request's trace can all be there: its root, a
/// `Release` once it holds a `Grant`, and, unless it was rejected, a
/// `forward` span with steps.
fn settled(trace: &[&Received], rejected: bool) -> bool {
    let root = !named(trace, GENERATE, SCHEDULER).is_empty();
    let granted = !named(trace, "Grant", CACHE).is_empty();
    let released = !named(trace, "Release", CACHE).is_empty();
    root && (released || !granted) && (rejected || forwarded(trace))
}

/// Whether the trace has a `forward` summary span with at least one step.
fn forwarded(trace: &[&Received]) -> bool {
    named(trace, "forward", SCHEDULER)
        .iter()
        .any(|f| attr_int(&f.span, "kvlease.forward_steps").unwrap_or(0) > 0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_oversubscribed_bench_gives_one_readable_trace_per_request() {
    let receiver = Receiver::start(Duration::ZERO).unwrap();
    let _telemetry = receiver.export_here().unwrap();

    // two small workers, far more demand than blocks: admissions wait,
    // decode steps are refused; a refused sequence is preempted once, then
    // rejected
    let cluster = OversubscribedCluster::start().await.unwrap();

    let started = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_nanos() as u64;
    let refused_before = metric_total(&cluster.cache, REJECTS_TOTAL).await.unwrap();
    let sent = traced_bench(cluster.scheduler.addr, 200, PROMPT, 120)
        .await
        .unwrap();
    // every refusal the cache answered (its metric), each a Reject span in
    // an exported trace: a step's trace whose settle carried a refusal is
    // sampled, even when the answer came after the step ended
    let refused =
        (metric_total(&cluster.cache, REJECTS_TOTAL).await.unwrap() - refused_before) as usize;
    // every request's trace has arrived: its root, the release of every
    // lease it was granted, and for one that was not rejected its forward
    // work (the forward and release spans of the last steps end after the
    // roots), and every span a link points at (a sampled step trace is
    // exported when its root ends), and every span's parent (a sampled
    // step's root ends after its Forward and cache spans; an unsampled
    // step's children are not exported). A trace that never settles is judged
    // below as it is.
    receiver
        .until(Duration::from_secs(60), |all| {
            let traces = by_trace(all);
            sent.iter().all(|s| {
                let trace = traces.get(s.trace.as_slice()).cloned().unwrap_or_default();
                settled(&trace, rejected(s))
            }) && dangling_links(all).is_empty()
                && orphans(all, started) == 0
                && cache_rejects(all, started) >= refused
        })
        .await;
    let spans: Vec<Received> = receiver
        .snapshot()
        .into_iter()
        .filter(|s| s.span.start_time_unix_nano >= started)
        .collect();
    assert!(!spans.is_empty());
    cluster.stop().await;

    let traces = by_trace(&spans);
    assert_eq!(
        cache_rejects(&spans, started),
        refused,
        "the cache refused {refused} sequences; Reject spans exported"
    );
    let rejects = sent.iter().filter(|s| rejected(s)).count();
    let preemptions: u32 = sent.iter().map(|s| s.result.preemptions).sum();
    assert!(rejects > 0, "no request was rejected");
    assert!(preemptions > 0, "no request was preempted");

    let mut complete = 0;
    let mut missing = Vec::new();
    let mut per_request = Vec::new();
    let mut foreign_rejects = Vec::new();
    let mut not_prefilled = Vec::new();
    let mut finished_with_errors = Vec::new();
    for s in &sent {
        let trace = traces.get(s.trace.as_slice()).cloned().unwrap_or_default();
        per_request.push(trace.len());
        if finished(s) {
            if !prefilled_on_worker(&trace) {
                not_prefilled.push(hex(&s.trace));
            }
            let errors: Vec<String> = trace
                .iter()
                .filter(|r| is_error(r))
                .map(|r| format!("{} [{}]", r.span.name, r.service))
                .collect();
            if !errors.is_empty() {
                finished_with_errors.push((hex(&s.trace), s.result.preemptions, errors));
            }
        }
        let root = named(&trace, GENERATE, SCHEDULER);
        let leased = !named(&trace, "Grant", CACHE).is_empty()
            || !named(&trace, REJECT_SPAN, CACHE).is_empty();
        let forward = forwarded(&trace);
        let released = !named(&trace, "Release", CACHE).is_empty();
        if root.len() == 1 && leased && forward && released {
            complete += 1;
        } else {
            missing.push(format!(
                "{}: root {} lease {leased} forward {forward} release {released}",
                hex(&s.trace),
                root.len()
            ));
        }
        // rejects in this trace belong to this request's sequences
        let mine: Vec<i64> = root
            .first()
            .map(|r| attr_ints(&r.span, "kvlease.seq_ids"))
            .unwrap_or_default();
        if !rejected(s) {
            for r in named(&trace, REJECT_SPAN, CACHE) {
                let seq = attr_int(&r.span, "kvlease.seq_id").unwrap_or(-1);
                if !mine.contains(&seq) {
                    foreign_rejects.push((hex(&s.trace), seq, mine.clone()));
                }
            }
        }
    }

    // rejected requests: the cache's reject with the client's figures, and
    // an ERROR root
    let mut rejected_ok = 0;
    let mut shown = None;
    for s in sent.iter().filter(|s| rejected(s)) {
        let trace = traces.get(s.trace.as_slice()).cloned().unwrap_or_default();
        let reject = s.result.reject.as_ref().expect("REJECTED without a reject");
        let reason = pb::RejectReason::try_from(reject.reason).map_or("?", |r| r.as_str_name());
        let cache_reject = named(&trace, REJECT_SPAN, CACHE).into_iter().any(|r| {
            attr_int(&r.span, "kvlease.seq_id") == Some(reject.seq_id as i64)
                && attr_str(&r.span, "kvlease.reject_reason").as_deref() == Some(reason)
                && attr_int(&r.span, "kvlease.blocks_needed")
                    == Some(i64::from(reject.blocks_needed))
                && attr_int(&r.span, "kvlease.blocks_free") == Some(i64::from(reject.blocks_free))
                && r.span.status.as_ref().map(|st| st.code) == Some(ERROR)
        });
        let root_error = named(&trace, GENERATE, SCHEDULER)
            .iter()
            .any(|r| r.span.status.as_ref().map(|st| st.code) == Some(ERROR));
        if cache_reject && root_error {
            rejected_ok += 1;
            if shown.is_none() || s.result.preemptions > 0 {
                shown = Some(tree(&trace));
            }
        } else {
            println!(
                "incomplete rejected trace {}:\n{}",
                hex(&s.trace),
                tree(&trace)
            );
        }
    }

    // roots: spans whose parent is not in the received spans
    let ids: BTreeSet<(&[u8], &[u8])> = spans
        .iter()
        .map(|s| (s.span.trace_id.as_slice(), s.span.span_id.as_slice()))
        .collect();
    let mut roots: HashMap<String, usize> = HashMap::new();
    let mut bad_roots = Vec::new();
    for s in &spans {
        let parent = (s.span.trace_id.as_slice(), s.span.parent_span_id.as_slice());
        if ids.contains(&parent) {
            continue;
        }
        *roots.entry(s.span.name.clone()).or_default() += 1;
        let sampled_step = s.span.name == STEP_SPAN
            && attr_str(&s.span, STEP_SAMPLED).is_some_and(|why| why != "no");
        if s.span.name != GENERATE && !sampled_step {
            bad_roots.push(format!("{} [{}]", s.span.name, s.service));
        }
    }
    let services: BTreeSet<&str> = spans.iter().map(|s| s.service.as_str()).collect();
    let worker_instances: BTreeSet<&str> = spans
        .iter()
        .filter(|s| s.service == WORKER)
        .map(|s| s.instance.as_str())
        .collect();
    per_request.sort_unstable();
    let median = per_request[per_request.len() / 2];
    let dangling = dangling_links(&spans);
    let links: usize = spans.iter().map(|s| s.span.links.len()).sum();
    let finished_n = sent.iter().filter(|s| finished(s)).count();

    let n = sent.len();
    println!("requests {n}, rejected {rejects}, preemptions {preemptions}");
    println!(
        "complete traces {complete}/{n} ({:.1}%), rejected with the cache's reject and an ERROR root {rejected_ok}/{rejects}",
        100.0 * complete as f64 / n as f64
    );
    println!(
        "spans per request trace: median {median}, min {}, max {}; spans received {}; roots by name {roots:?}",
        per_request[0],
        per_request[n - 1],
        spans.len()
    );
    println!("service.name: {services:?}; worker instances: {worker_instances:?}");
    println!(
        "finished LENGTH/STOP {finished_n}: without their prefill on a worker {}, with an ERROR span {}; links {links}, to spans never exported {}",
        not_prefilled.len(),
        finished_with_errors.len(),
        dangling.len()
    );
    if let Some((trace, preemptions, errors)) = finished_with_errors.first() {
        println!("e.g. {trace} (preemptions {preemptions}): {errors:?}");
        if let Some(t) = sent.iter().find(|s| hex(&s.trace) == *trace) {
            let spans = traces.get(t.trace.as_slice()).cloned().unwrap_or_default();
            println!("{}", tree(&spans));
        }
    }
    println!(
        "one rejected request's trace:\n{}",
        shown.clone().unwrap_or_default()
    );

    assert!(
        complete * 100 >= n * 95,
        "only {complete} of {n} traces are complete"
    );
    assert_eq!(
        rejected_ok, rejects,
        "rejected requests without the cache's reject or an ERROR root"
    );
    assert!(
        foreign_rejects.is_empty(),
        "successful requests hold other requests' rejects: {foreign_rejects:?}"
    );
    assert!(
        bad_roots.is_empty(),
        "root spans other than Generate and sampled steps: {bad_roots:?}"
    );
    assert!(median <= 30, "median spans per request {median}");
    assert!(finished_n > 0, "no request finished LENGTH/STOP");
    assert!(
        not_prefilled.is_empty(),
        "{} of {finished_n} finished requests lack their prefill on a worker, e.g. {:?}",
        not_prefilled.len(),
        not_prefilled.first()
    );
    assert!(
        finished_with_errors.is_empty(),
        "{} of {finished_n} finished requests hold ERROR spans, e.g. {:?}",
        finished_with_errors.len(),
        finished_with_errors.first()
    );
    assert!(
        dangling.is_empty(),
        "{} of {links} links point at spans never exported, e.g. {:?}",
        dangling.len(),
        dangling.first()
    );
    for service in [SCHEDULER, CACHE, WORKER] {
        assert!(
            services.contains(service),
            "no span under service.name {service}: {services:?}"
        );
    }
    assert_eq!(
        worker_instances.len(),
        2,
        "two workers, instances {worker_instances:?}"
    );
}
