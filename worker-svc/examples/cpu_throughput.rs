//! The kvlease side of `scripts/cpu_vs_llamacpp.py`: loads a model file on
//! the CPU backend once, then reads one workload name per line on stdin,
//! runs it once and prints `WORKLOAD TOKENS_PER_SECOND` (the script
//! alternates these runs with llama.cpp's on the same workloads).
//!
//! `cargo run --release -p worker-svc --example cpu_throughput -- MODEL THREADS`
//!
//! Workloads: `prefill512` (one 512-token prompt, one forward pass),
//! `decode1` and `decode16` (1 or 16 sequences holding a 128-token prompt,
//! then 64 greedy steps of one token per sequence; tokens/s in total).

use std::io::BufRead;
use std::path::Path;

use worker_svc::model::load::{self, ServingShape};
use worker_svc::throughput::Harness;

/// Prompt tokens of each decode workload's sequences.
const DECODE_CONTEXT: usize = 128;
/// Timed decode steps.
const DECODE_STEPS: usize = 64;
const PREFILL_LEN: usize = 512;
const MAX_SEQS: usize = 16;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let [_, model, threads] = args.as_slice() else {
        fail("usage: cpu_throughput MODEL THREADS");
    };
    let threads: usize = threads
        .parse()
        .unwrap_or_else(|e| fail(format!("threads {threads:?}: {e}")));
    let serving = ServingShape {
        max_context: 1024,
        tokens_per_block: 16,
    };
    let loaded = load::open(Path::new(model), serving).unwrap_or_else(|e| fail(e));
    let mut harness = Harness::new(
        loaded.weights,
        threads,
        MAX_SEQS,
        PREFILL_LEN.max(DECODE_CONTEXT + DECODE_STEPS),
        PREFILL_LEN.max(MAX_SEQS),
    )
    .unwrap_or_else(|e| fail(e));
    println!(
        "ready {} kernels={}",
        harness.config().name,
        worker_svc::packed::kernel_name()
    );
    let mut salt = 0;
    for line in std::io::stdin().lock().lines() {
        let line = line.unwrap_or_else(|e| fail(e));
        let workload = line.trim();
        salt += 1;
        let tps = match workload {
            "prefill512" => {
                let t = harness
                    .prefill(1, PREFILL_LEN, salt)
                    .unwrap_or_else(|e| fail(e));
                PREFILL_LEN as f64 / t.as_secs_f64()
            }
            "decode1" | "decode16" => {
                let seqs = if workload == "decode1" { 1 } else { 16 };
                let times = harness
                    .decode(seqs, DECODE_CONTEXT, DECODE_STEPS, PREFILL_LEN)
                    .unwrap_or_else(|e| fail(e));
                let total: f64 = times.iter().map(|t| t.as_secs_f64()).sum();
                (seqs * DECODE_STEPS) as f64 / total
            }
            "" => continue,
            other => fail(format!("unknown workload {other:?}")),
        };
        println!("{workload} {tps:.2}");
    }
}

fn fail(e: impl std::fmt::Display) -> ! {
    eprintln!("cpu_throughput: {e}");
    std::process::exit(1)
}
