//! `kvlease demo`: a whole cluster in this process with a deliberately small
//! KV pool, a synthetic workload that over-subscribes it, and an account of
//! what happened: completions, rejects by reason, preemptions, blocks parked
//! behind step fences and returned by `CompleteStep`, and the pool whole
//! again at the end.

use std::net::{IpAddr, Ipv4Addr};
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

use kvlease_proto::v1 as pb;
use tokio::sync::watch;
use tokio::time::Instant;

use scheduler_svc::policy::{OnExhausted, Policy};

use crate::bench::{self, Load};
use crate::cluster::{Cluster, ClusterConfig};
use crate::connect;
use crate::error::{Error, Result};
use crate::report::{ClusterDelta, Summary};
use crate::status;
use crate::workload::Synthetic;

/// The demo's knobs (flags of `kvlease demo`).
#[derive(Debug, Clone)]
pub struct DemoOptions {
    pub requests: usize,
    /// Requests in flight at once: far more than the pool holds.
    pub concurrency: usize,
    /// Worker memory budget in MiB; it sizes the KV pool.
    pub memory_budget_mib: u64,
    /// Under max-utilization, a mid-flight exhaustion: preempt or reject.
    /// One phase (a fresh cluster) per mode, in order.
    pub modes: Vec<OnExhausted>,
    /// Preemptions a request may suffer before it is rejected.
    pub max_preemptions: u32,
    pub seed: u64,
}

impl Default for DemoOptions {
    fn default() -> Self {
        Self {
            requests: 40,
            concurrency: 40,
            memory_budget_mib: 5,
            modes: vec![OnExhausted::Preempt, OnExhausted::Reject],
            max_preemptions: 1,
            seed: 7,
        }
    }
}

/// A small CPU model (two pools: full attention and a 64-token window) whose
/// KV pool is a few dozen blocks under the default budget.
pub fn demo_worker(memory_budget_mib: u64) -> worker_svc::Config {
    worker_svc::Config {
        hidden_size: 64,
        num_heads: 4,
        num_kv_heads: 2,
        head_dim: 16,
        ffn_size: 192,
        max_context: 384,
        memory_budget_mib,
        max_batch_sequences: 64,
        max_batch_tokens: 512,
        threads: 1,
        ..worker_svc::Config::default()
    }
}

/// The cluster the demo runs: ephemeral loopback ports, one small worker.
pub fn demo_cluster(options: &DemoOptions, mode: OnExhausted) -> ClusterConfig {
    let mut config = ClusterConfig::on_ports(IpAddr::V4(Ipv4Addr::LOCALHOST), 0, 1);
    config.worker = demo_worker(options.memory_budget_mib);
    config.scheduler = scheduler_svc::Config {
        policy: Policy::MaxUtilization,
        on_exhausted: mode,
        max_preemptions: options.max_preemptions,
        max_seqs: 32,
        max_tokens: 128,
        max_tokens_per_step: 512,
        prefill_chunk: 128,
        ..scheduler_svc::Config::default()
    };
    config
}

/// The demo's workload: prompts of 80 to 160 tokens sharing 4 prefixes of
/// 64 tokens, 64 to 128 output tokens each.
pub fn demo_workload(options: &DemoOptions) -> Synthetic {
    Synthetic {
        requests: options.requests,
        prefixes: 4,
        prefix_tokens: 64,
        tail_min: 16,
        tail_max: 96,
        output_min: 64,
        output_max: 128,
        seed: options.seed,
    }
}

/// What the sampler saw of the pools while the workload ran.
#[derive(Debug, Default)]
struct Peaks {
    in_use: AtomicU32,
    fenced: AtomicU32,
    fenced_samples: AtomicU64,
    samples: AtomicU64,
}

/// Polls the cache's figures until `stop`, keeping the peaks.
async fn sample(cache: String, peaks: Arc<Peaks>, mut stop: watch::Receiver<bool>) {
    let Ok(mut client) = connect::cache(&cache).await else {
        return;
    };
    loop {
        if let Ok(stats) = connect::stats(&mut client).await {
            let in_use = stats.pools.iter().map(|p| p.in_use).max().unwrap_or(0);
            let fenced: u32 = stats.pools.iter().map(|p| p.fenced).sum();
            peaks.in_use.fetch_max(in_use, Ordering::Relaxed);
            peaks.fenced.fetch_max(fenced, Ordering::Relaxed);
            peaks.samples.fetch_add(1, Ordering::Relaxed);
            if fenced > 0 {
                peaks.fenced_samples.fetch_add(1, Ordering::Relaxed);
            }
        }
        tokio::select! {
            () = tokio::time::sleep(Duration::from_millis(5)) => {}
            _ = stop.changed() => return,
        }
    }
}

/// How one phase ended.
#[derive(Debug)]
struct Phase {
    mode: OnExhausted,
    summary: Summary,
    preemptions: u64,
    fenced_peak: u32,
    /// No block in use or fenced at the end, the leak audit found nothing,
    /// no request ended in an error.
    clean: bool,
}

/// Runs the demo, one phase per mode, and prints its account; `Ok(true)`
/// when every phase ended clean (pool whole, nothing leaked, no errors).
pub async fn run(options: DemoOptions) -> Result<bool> {
    let requests = demo_workload(&options).requests();
    let mut phases = Vec::new();
    for (n, mode) in options.modes.iter().enumerate() {
        println!(
            "=== phase {}: {} with on-exhaustion {} ===",
            n + 1,
            Policy::MaxUtilization.as_str(),
            mode.as_str()
        );
        println!("kvlease demo: starting cache, worker and scheduler in this process ...");
        let started = Instant::now();
        let cluster = Cluster::start(demo_cluster(&options, *mode)).await?;
        println!(
            "  cluster up in {:.1} s: scheduler {}, cache {}, worker {}",
            started.elapsed().as_secs_f64(),
            cluster.scheduler,
            cluster.cache,
            cluster
                .workers
                .first()
                .map_or_else(String::new, ToString::to_string),
        );
        let phase = drive(&cluster, &options, *mode, requests.clone()).await;
        cluster.shutdown().await;
        phases.push(phase?);
        println!();
    }
    println!("=== in short ===");
    for p in &phases {
        println!(
            "  on-exhaustion {:<8} {} of {} completed, {} rejected ({}), {} preemption(s), up to {} blocks fenced at once, {}",
            p.mode.as_str(),
            p.summary.ok,
            p.summary.requests,
            p.summary.rejected_total(),
            reasons(&p.summary),
            p.preemptions,
            p.fenced_peak,
            if p.clean {
                "pool whole, nothing leaked"
            } else {
                "NOT CLEAN"
            },
        );
    }
    Ok(phases.iter().all(|p| p.clean))
}

fn reasons(summary: &Summary) -> String {
    if summary.rejected.is_empty() {
        "none".to_string()
    } else {
        summary
            .rejected
            .iter()
            .map(|(k, v)| format!("{v} {k}"))
            .collect::<Vec<_>>()
            .join(", ")
    }
}

async fn drive(
    cluster: &Cluster,
    options: &DemoOptions,
    mode: OnExhausted,
    requests: Vec<crate::workload::Request>,
) -> Result<Phase> {
    let scheduler_addr = cluster.scheduler.to_string();
    let cache_addr = cluster.cache.to_string();
    let mut scheduler = connect::scheduler(&scheduler_addr).await?;
    let before = connect::status(&mut scheduler).await?;

    let pool_total = before.pools.iter().map(|p| p.total).max().unwrap_or(0);
    let block_tokens = before
        .pools
        .first()
        .map_or(16, |p| p.tokens_per_block.max(1));
    let demand: u32 = requests
        .iter()
        .map(|r| (r.tokens.len() as u32 + r.max_tokens).div_ceil(block_tokens))
        .sum();
    println!(
        "  KV pool: {pool_total} blocks of {block_tokens} tokens per pool; policy {} with on-exhaustion {}{}",
        Policy::MaxUtilization.as_str(),
        mode.as_str(),
        match mode {
            OnExhausted::Preempt => format!(
                " (at most {} preemption(s) per request, then rejected)",
                options.max_preemptions
            ),
            OnExhausted::Reject => String::new(),
        },
    );
    println!(
        "  workload: {} requests, {} at once, needing {demand} blocks at full length in the full-attention pool ({:.1}x the pool)",
        requests.len(),
        options.concurrency,
        f64::from(demand) / f64::from(pool_total.max(1)),
    );

    let peaks = Arc::new(Peaks::default());
    let (stop_sampler, stop_rx) = watch::channel(false);
    let sampler = tokio::spawn(sample(cache_addr.clone(), peaks.clone(), stop_rx));
    let load = Load {
        concurrency: options.concurrency,
        rate: None,
        timeout: Duration::from_secs(120),
        progress: true,
        samples: 1,
        beam_width: 1,
    };
    let t0 = Instant::now();
    let outcomes = bench::drive(scheduler.clone(), requests, &load).await;
    let wall = t0.elapsed();
    let _ = stop_sampler.send(true);
    let _ = sampler.await;

    // fenced frees return once the step that could still read them completes
    let mut cache = connect::cache(&cache_addr).await?;
    let deadline = Instant::now() + Duration::from_secs(10);
    let stats = loop {
        let stats = connect::stats(&mut cache).await?;
        let idle = stats.pools.iter().all(|p| p.in_use == 0 && p.fenced == 0);
        if idle || Instant::now() > deadline {
            break stats;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let after = connect::status(&mut scheduler).await?;
    let audit = cache
        .audit(pb::AuditRequest {})
        .await
        .map_err(|s| Error::rpc("Audit", s))?
        .into_inner();

    let summary = Summary::new(
        &outcomes,
        wall,
        Some(ClusterDelta::between(&before, &after)),
    );
    println!();
    println!("what happened:");
    println!("{summary}");
    let preemptions = after.preemptions.saturating_sub(before.preemptions);
    println!(
        "  {} requests completed, {} rejected ({}), {preemptions} preemption(s) recomputed",
        summary.ok,
        summary.rejected_total(),
        reasons(&summary),
    );
    println!(
        "  pool pressure: up to {} of {pool_total} blocks in use at once; up to {} blocks parked behind step fences (seen in {} of {} samples), each returned by the CompleteStep of its step",
        peaks.in_use.load(Ordering::Relaxed),
        peaks.fenced.load(Ordering::Relaxed),
        peaks.fenced_samples.load(Ordering::Relaxed),
        peaks.samples.load(Ordering::Relaxed),
    );
    println!("\nthe cache at the end:");
    print!("{}", status::render_pools(&stats.pools));
    let whole = stats
        .pools
        .iter()
        .all(|p| p.in_use == 0 && p.fenced == 0 && p.free + p.cached_evictable == p.total);
    println!(
        "  pool whole again: {}; leak audit checked {} blocks, reclaimed {}",
        if whole { "yes" } else { "NO" },
        audit.blocks_checked,
        audit.reclaimed.len(),
    );
    let clean = whole && audit.reclaimed.is_empty() && summary.errors_total() == 0;
    println!("{}", summary.line());
    Ok(Phase {
        mode,
        preemptions,
        fenced_peak: peaks.fenced.load(Ordering::Relaxed),
        clean,
        summary,
    })
}
