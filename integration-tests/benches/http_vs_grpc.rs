//! The HTTP front's cost: the same streaming chat load over HTTP (through
//! the gateway) and over gRPC (straight to the scheduler), one after the
//! other on one in-process cluster, in one run. Prints TTFT p50 and output
//! throughput of each and the ratios. Each phase's prompts begin with a tag
//! of their own (path, think time, round), so no phase reuses another's
//! cached prefixes: the gateway ignores OpenAI's `user` field and, with no
//! token file, sends every HTTP phase under the same cache salt, so only the
//! prompts can keep them apart. Both paths' tags are as long, so their
//! prompts are too.
//!
//! The load is CONCURRENCY users sharing REQUESTS requests, each sending its
//! next request when its last answer has ended, twice: once with no pause
//! between requests, once after a think time drawn from an exponential
//! distribution of mean THINK_MS (default 20 ms, about one decode step of
//! this load). Without think time every user's next request is sent the
//! moment a step's output ends it, so arrivals are locked to the step
//! loop's phase: a request that reaches the scheduler before the next
//! step's admission is planned starts a step earlier than one that reaches
//! it just after. The gateway's hop (0.4 ms at one request in flight) can
//! move HTTP arrivals past that point, and they lose a whole step; with think
//! time arrivals fall anywhere in a step, as independent users' do, and the
//! hop costs what it takes.
//!
//! The machine the bench runs on is often shared and noisy, and the phase
//! that runs second in a round was seen to be slower whichever path it is,
//! so it runs ROUNDS rounds per think time (even, default 4), the order
//! alternating (gRPC first in even rounds, HTTP first in odd ones), prints
//! each round and the medians over rounds, and the ratios of the medians.
//!
//! `cargo bench -p kvlease-integration-tests --bench http_vs_grpc [-- REQUESTS CONCURRENCY ROUNDS THINK_MS]`

#![allow(clippy::unwrap_used, clippy::expect_used)] // a bench: a failed setup ends the run

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use futures::StreamExt;
use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper_util::rt::TokioIo;
use kvlease_integration_tests::gateway::{Gateway, chatml_tokenizer};
use kvlease_integration_tests::*;
use kvlease_proto::v1 as pb;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

const MAX_TOKENS: u32 = 32;

/// Request `i` of the phase tagged `phase`; the tag comes first, so the
/// first block of the prompt differs from every other phase's.
fn question(phase: &str, i: usize) -> String {
    format!("[{phase}] Request {i}: say something about paged KV caches and their blocks.")
}

/// The tag of one phase: the path (`grpc` or `http`, as long as each other),
/// the think time and the round.
fn phase(path: &str, think: Duration, round: usize) -> String {
    format!("{path} {} {round}", think.as_millis())
}

/// (time to the first text, output tokens) of one request: both paths
/// count from the call, on a connection the server has already accepted,
/// to the first message with text.
type One = (Duration, u32);

async fn grpc_one(addr: SocketAddr, i: usize, phase: String) -> One {
    let mut c = scheduler_client(addr).await.expect("connects");
    let start = Instant::now();
    let mut stream = c
        .generate(pb::GenerateRequest {
            messages: vec![pb::ChatMessage {
                role: "user".into(),
                content: question(&phase, i),
            }],
            max_tokens: MAX_TOKENS,
            ..Default::default()
        })
        .await
        .expect("generate")
        .into_inner();
    let mut ttft = None;
    let mut tokens = 0;
    while let Some(m) = stream.next().await {
        let m = m.expect("message");
        if !m.text.is_empty() && ttft.is_none() {
            ttft = Some(start.elapsed());
        }
        tokens += m.tokens.len() as u32;
    }
    (ttft.unwrap_or_else(|| start.elapsed()), tokens)
}

async fn http_one(addr: SocketAddr, i: usize, phase: String) -> One {
    let body = serde_json::json!({
        // greedy, as the gRPC request (OpenAI's default would sample at 1)
        "model": "kvlease", "max_tokens": MAX_TOKENS, "temperature": 0, "stream": true,
        "stream_options": {"include_usage": true},
        "messages": [{"role": "user", "content": question(&phase, i)}],
    })
    .to_string();
    let stream = tokio::net::TcpStream::connect(addr)
        .await
        .expect("connects");
    stream.set_nodelay(true).expect("nodelay");
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .expect("handshake");
    tokio::spawn(conn);
    // an established connection, as the gRPC path's (its connect includes
    // the HTTP/2 handshake): the server has accepted it before the clock runs
    let models = hyper::Request::get("/v1/models")
        .header("host", addr.to_string())
        .body(Full::new(Bytes::new()))
        .expect("request");
    let warm = sender.send_request(models).await.expect("models");
    warm.into_body().collect().await.expect("models body");
    let start = Instant::now();
    let req = hyper::Request::post("/v1/chat/completions")
        .header("host", addr.to_string())
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body)))
        .expect("request");
    let mut body = sender
        .send_request(req)
        .await
        .expect("response")
        .into_body();
    let mut ttft = None;
    let mut text = String::new();
    while let Some(frame) = body.frame().await {
        if let Ok(data) = frame.expect("frame").into_data() {
            let chunk = String::from_utf8_lossy(&data);
            if ttft.is_none() && events(&chunk).any(|v| has_content(&v)) {
                ttft = Some(start.elapsed());
            }
            text.push_str(&chunk);
        }
    }
    let usage = events(&text)
        .find_map(|v| v["usage"]["completion_tokens"].as_u64())
        .expect("a usage chunk");
    (ttft.unwrap_or_else(|| start.elapsed()), usage as u32)
}

/// The JSON events of SSE text.
fn events(text: &str) -> impl Iterator<Item = serde_json::Value> + '_ {
    text.split("\n\n")
        .filter_map(|e| e.strip_prefix("data: "))
        .filter_map(|e| serde_json::from_str(e).ok())
}

fn has_content(v: &serde_json::Value) -> bool {
    v["choices"][0]["delta"]["content"]
        .as_str()
        .is_some_and(|c| !c.is_empty())
}

/// `concurrency` users share `requests` requests: each user sends one,
/// reads its whole answer, pauses for a think time drawn from an
/// exponential distribution of mean `think` (0: none) and sends the next,
/// until none is left. Returns TTFT p50 and output tokens per second.
/// The think times come from `seed`, so both paths of a round see the same.
async fn load<F, Fut>(
    requests: usize,
    concurrency: usize,
    think: Duration,
    seed: u64,
    one: F,
) -> (Duration, f64)
where
    F: Fn(usize) -> Fut + Clone + Send + 'static,
    Fut: std::future::Future<Output = One> + Send + 'static,
{
    let next = Arc::new(AtomicUsize::new(0));
    let start = Instant::now();
    let users: Vec<_> = (0..concurrency)
        .map(|user| {
            let (next, one) = (next.clone(), one.clone());
            tokio::spawn(async move {
                let mut rng = StdRng::seed_from_u64(seed ^ user as u64);
                let mut done = Vec::new();
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= requests {
                        return done;
                    }
                    done.push(one(i).await);
                    if !think.is_zero() {
                        // inverse transform: -mean * ln(1 - u), u in [0, 1)
                        let u: f64 = rng.random();
                        tokio::time::sleep(think.mul_f64(-(1.0 - u).ln())).await;
                    }
                }
            })
        })
        .collect();
    let mut ttfts = Vec::new();
    let mut tokens = 0u64;
    for user in users {
        for (ttft, n) in user.await.expect("user task") {
            ttfts.push(ttft);
            tokens += u64::from(n);
        }
    }
    let wall = start.elapsed();
    ttfts.sort();
    (ttfts[ttfts.len() / 2], tokens as f64 / wall.as_secs_f64())
}

/// Medians over rounds: (TTFT p50 in ms, output tokens/s).
fn median(runs: &[(Duration, f64)]) -> (f64, f64) {
    let mut ttft: Vec<f64> = runs.iter().map(|r| r.0.as_secs_f64() * 1e3).collect();
    let mut tps: Vec<f64> = runs.iter().map(|r| r.1).collect();
    ttft.sort_by(f64::total_cmp);
    tps.sort_by(f64::total_cmp);
    let mid = |v: &[f64]| (v[(v.len() - 1) / 2] + v[v.len() / 2]) / 2.0;
    (mid(&ttft), mid(&tps))
}

/// User + system CPU time of this process so far (Linux: `/proc/self/stat`,
/// in clock ticks of 10 ms); `None` elsewhere.
fn process_cpu() -> Option<Duration> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    // the fields after the command name, which is in parentheses
    let rest = stat.rsplit_once(')')?.1;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // utime and stime are fields 14 and 15 of the line, 12 and 13 here
    let ticks: u64 = fields.get(11)?.parse::<u64>().ok()? + fields.get(12)?.parse::<u64>().ok()?;
    Some(Duration::from_millis(ticks * 10))
}

#[tokio::main(flavor = "multi_thread")]
async fn main() {
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .filter_map(|a| a.parse().ok())
        .collect();
    let requests = args.first().copied().unwrap_or(256);
    let concurrency = args.get(1).copied().unwrap_or(64);
    // even, so that each path runs first as often as the other
    let rounds = args.get(2).copied().unwrap_or(4).max(1).next_multiple_of(2);
    let think_ms = args.get(3).copied().unwrap_or(20) as u64;
    let cache = start_cache(cache_svc::Config::default())
        .await
        .expect("cache");
    let worker = start_worker_with_tokenizer(
        small_worker_with(64, 2048),
        chatml_tokenizer().expect("the ChatML tokenizer builds"),
    )
    .await
    .expect("worker");
    let scheduler = start_scheduler(
        scheduler_svc::Config {
            max_context: 256,
            max_tokens: 64,
            ..scheduler_svc::Config::default()
        },
        &cache.url(),
        &[worker.url()],
        Duration::from_secs(120),
    )
    .await
    .expect("scheduler");
    let gateway = Gateway::start(scheduler.url()).await.expect("gateway");
    let http = gateway.http;
    let s = scheduler.addr;
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    // the users of the first mode send their next request the moment an
    // answer ends; those of the second think first (see the module doc)
    let modes: Vec<Duration> = if think_ms == 0 {
        vec![0]
    } else {
        vec![0, think_ms]
    }
    .into_iter()
    .map(Duration::from_millis)
    .collect();
    println!(
        "streaming chat, {requests} requests, {concurrency} users, max_tokens {MAX_TOKENS}, {rounds} rounds per think time, one run"
    );
    println!(
        "| think (ms) | round | gRPC TTFT p50 (ms) | HTTP TTFT p50 (ms) | gRPC tokens/s | HTTP tokens/s | gRPC CPU ms/request | HTTP CPU ms/request |"
    );
    println!("|---:|---|---:|---:|---:|---:|---:|---:|");
    // the CPU time of the whole process (client, gateway, scheduler, cache
    // and worker share it) per request of a phase
    let per_request = |cpu: Option<Duration>| cpu.map_or(f64::NAN, |c| ms(c) / requests as f64);
    let mut summary = Vec::new();
    for &think in &modes {
        let (mut grpc, mut http_runs) = (Vec::new(), Vec::new());
        for round in 0..rounds {
            let seed = round as u64;
            let grpc_load = || async move {
                let before = process_cpu();
                let tag = phase("grpc", think, round);
                let r = load(requests, concurrency, think, seed, move |i| {
                    grpc_one(s, i, tag.clone())
                })
                .await;
                (
                    r,
                    process_cpu().zip(before).map(|(a, b)| a.saturating_sub(b)),
                )
            };
            let http_load = || async move {
                let before = process_cpu();
                let tag = phase("http", think, round);
                let r = load(requests, concurrency, think, seed, move |i| {
                    http_one(http, i, tag.clone())
                })
                .await;
                (
                    r,
                    process_cpu().zip(before).map(|(a, b)| a.saturating_sub(b)),
                )
            };
            let ((g, g_cpu), (h, h_cpu)) = if round % 2 == 0 {
                let g = grpc_load().await;
                (g, http_load().await)
            } else {
                let h = http_load().await;
                (grpc_load().await, h)
            };
            println!(
                "| {} | {round} ({} first) | {:.1} | {:.1} | {:.1} | {:.1} | {:.2} | {:.2} |",
                think.as_millis(),
                if round % 2 == 0 { "gRPC" } else { "HTTP" },
                ms(g.0),
                ms(h.0),
                g.1,
                h.1,
                per_request(g_cpu),
                per_request(h_cpu)
            );
            grpc.push(g);
            http_runs.push(h);
        }
        summary.push((think, median(&grpc), median(&http_runs)));
    }
    println!();
    println!(
        "| think (ms) | gRPC TTFT p50 (ms) | HTTP TTFT p50 (ms) | gRPC tokens/s | HTTP tokens/s | TTFT HTTP / gRPC | tokens/s HTTP / gRPC |"
    );
    println!("|---:|---:|---:|---:|---:|---:|---:|");
    for (think, (g_ttft, g_tps), (h_ttft, h_tps)) in summary {
        println!(
            "| {} | {g_ttft:.1} | {h_ttft:.1} | {g_tps:.1} | {h_tps:.1} | {:.3} | {:.3} |",
            think.as_millis(),
            h_ttft / g_ttft,
            h_tps / g_tps
        );
    }
    let _ = gateway.stop().await;
    let _ = scheduler.stop().await;
    let _ = worker.stop().await;
    let _ = cache.stop().await;
}
