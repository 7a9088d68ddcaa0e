//! `cargo bench -p worker-svc`: prefill and decode throughput of the CPU
//! backend on the default model, the GFLOP/s that achieves, and the rate of
//! the same matrix-product crate (`gemm`) at the same shapes in the same run.
//!
//! Then, when the SmolLM2-135M-Instruct GGUF is in the model cache
//! (`kvlease model fetch smollm2`; `KVLEASE_SMOLLM2_GGUF` names another
//! path), the same for that model with its Q4_1/Q8_0 weights kept packed:
//! prefill and decode tokens/s at batch 1, 16 and 64, beside the packed
//! product's and `gemm`'s (f32, the same weights dequantized) GFLOP/s at
//! its MLP shape in the same run. Without the file it prints why it skipped.
//!
//! Every figure is the best of repeated timings, so that other load on a
//! shared machine disturbs the ratio as little as possible.

use std::time::{Duration, Instant};

use std::path::PathBuf;

use worker_svc::backend::cpu::cpu_model_name;
use worker_svc::batch::{Limits, Sampling, SeqInput, TableInput};
use worker_svc::model::ModelConfig;
use worker_svc::model::load::{self, ServingShape};
use worker_svc::model::weights::Matrix;
use worker_svc::model::weights::Weights;
use worker_svc::ops::{self, Threads};
use worker_svc::throughput::Harness;
use worker_svc::worker::{Worker, WorkerOptions};

const PREFILL_SEQS: usize = 4;
const PREFILL_LEN: usize = 256;
const DECODE_SEQS: usize = 32;
const DECODE_CONTEXT: usize = 256;
const DECODE_STEPS: usize = 48;

fn main() {
    let config = ModelConfig {
        name: "bench".into(),
        ..ModelConfig::small()
    };
    let threads = std::thread::available_parallelism().map_or(1, usize::from);
    let weights = Weights::seeded(config.clone(), 1).unwrap_or_else(|e| fail(e));
    let options = WorkerOptions {
        host_blocks: 0,
        memory_budget_bytes: 1 << 30,
        limits: Limits {
            max_batch_sequences: DECODE_SEQS,
            max_batch_tokens: PREFILL_SEQS * PREFILL_LEN,
        },
        threads,
    };
    let mut worker = Worker::new_cpu(weights, options).unwrap_or_else(|e| fail(e));
    let blocks_per_seq = (DECODE_CONTEXT + DECODE_STEPS).div_ceil(config.tokens_per_block as usize);
    let tables: Vec<Vec<TableInput>> = (0..DECODE_SEQS)
        .map(|s| seq_tables(&config, s, blocks_per_seq))
        .collect();

    // --- prefill: 4 sequences x 256 tokens per Forward ---
    let prefill_batch = |rep: usize| -> Vec<SeqInput> {
        (0..PREFILL_SEQS)
            .map(|s| seq_input(&tables[s], s, rep, 0, PREFILL_LEN))
            .collect()
    };
    let prefill_flops = batch_flops(&config, &[(0, PREFILL_LEN); PREFILL_SEQS]);
    let prefill_time = best_of(Duration::from_secs(10), 3, |rep| {
        let batch = prefill_batch(rep);
        let started = Instant::now();
        worker.forward(batch).unwrap_or_else(|e| fail(e));
        started.elapsed()
    });
    let prefill_tps = (PREFILL_SEQS * PREFILL_LEN) as f64 / prefill_time;
    let prefill_gflops = prefill_flops / prefill_time / 1e9;

    // --- decode: 32 sequences at context 256, one token each per Forward ---
    for chunk in (0..DECODE_SEQS).collect::<Vec<_>>().chunks(PREFILL_SEQS) {
        let batch = chunk
            .iter()
            .map(|&s| seq_input(&tables[s], s, 0, 0, DECODE_CONTEXT))
            .collect();
        worker.forward(batch).unwrap_or_else(|e| fail(e));
    }
    // Each step is timed; the best step's rate counts.
    let mut best_step = f64::INFINITY;
    let mut best_flops = 0.0;
    for step in 0..DECODE_STEPS {
        let pos = DECODE_CONTEXT + step;
        let batch = (0..DECODE_SEQS)
            .map(|s| seq_input(&tables[s], s, 0, pos, pos + 1))
            .collect();
        let started = Instant::now();
        worker.forward(batch).unwrap_or_else(|e| fail(e));
        let took = started.elapsed().as_secs_f64();
        if took < best_step {
            best_step = took;
            best_flops = batch_flops(&config, &[(pos, pos + 1); DECODE_SEQS]);
        }
    }
    let decode_tps = DECODE_SEQS as f64 / best_step;
    let decode_gflops = best_flops / best_step / 1e9;

    // --- the matrix-product crate alone, at the MLP's shapes ---
    let (h, f) = (config.hidden_size, config.ffn_size);
    let gemm_prefill = gemm_gflops(PREFILL_SEQS * PREFILL_LEN, h, f);
    let gemm_decode = gemm_gflops(DECODE_SEQS, h, f);

    println!("worker-svc CPU forward benchmark (best of repeated timings)");
    println!("cpu: {} ({threads} threads)", cpu_model_name());
    println!(
        "model: vocab {}, hidden {h}, layers {} (windows {:?}), heads {}/{} kv, head dim {}, \
         ffn {f}, tokens/block {}, {:.1} M params, f32",
        config.vocab_size,
        config.num_layers(),
        config.layer_windows,
        config.num_heads,
        config.num_kv_heads,
        config.head_dim,
        config.tokens_per_block,
        config.num_params() as f64 / 1e6
    );
    println!();
    println!(
        "| phase | batch | tokens/s | achieved GFLOP/s | gemm GFLOP/s (same shapes) | ratio |"
    );
    println!("|---|---|---:|---:|---:|---:|");
    println!(
        "| prefill | {PREFILL_SEQS} seqs x {PREFILL_LEN} tokens | {prefill_tps:.0} | \
         {prefill_gflops:.1} | {gemm_prefill:.1} ({}x{h}x{f}) | {:.2} |",
        PREFILL_SEQS * PREFILL_LEN,
        prefill_gflops / gemm_prefill
    );
    println!(
        "| decode | {DECODE_SEQS} seqs at context {DECODE_CONTEXT} | {decode_tps:.0} | \
         {decode_gflops:.1} | {gemm_decode:.1} ({DECODE_SEQS}x{h}x{f}) | {:.2} |",
        decode_gflops / gemm_decode
    );
    smollm2(threads);
}

/// Prompt tokens per forward pass of the SmolLM2 prefill rows.
const SMOL_PREFILL_TOKENS: usize = 512;
const SMOL_DECODE_CONTEXT: usize = 128;
const SMOL_DECODE_STEPS: usize = 16;

/// The SmolLM2 rows (see the module doc).
fn smollm2(threads: usize) {
    println!();
    let path = match std::env::var_os("KVLEASE_SMOLLM2_GGUF") {
        Some(p) => PathBuf::from(p),
        None => std::env::var_os("KVLEASE_HOME")
            .map(PathBuf::from)
            .or_else(|| {
                std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/kvlease/models"))
            })
            .unwrap_or_default()
            .join("smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
    };
    if !path.is_file() {
        println!(
            "SmolLM2 rows SKIPPED: no GGUF at {}; run `kvlease model fetch smollm2` or set \
             KVLEASE_SMOLLM2_GGUF",
            path.display()
        );
        return;
    }
    let serving = ServingShape {
        max_context: 1024,
        tokens_per_block: 16,
    };
    let loaded = load::open(&path, serving).unwrap_or_else(|e| fail(e));
    let config = loaded.weights.config.clone();
    let gate = loaded.weights.layers[0].w_gate.clone();
    let mut harness = Harness::new(
        loaded.weights,
        threads,
        64,
        SMOL_PREFILL_TOKENS.max(SMOL_DECODE_CONTEXT + SMOL_DECODE_STEPS),
        SMOL_PREFILL_TOKENS.max(64 * SMOL_DECODE_CONTEXT / 16),
    )
    .unwrap_or_else(|e| fail(e));

    println!(
        "SmolLM2 ({}) on the CPU, weights kept packed, {} kernels, {threads} threads",
        config.name,
        worker_svc::packed::kernel_name()
    );
    println!(
        "| phase | batch | tokens/s | packed GFLOP/s (MLP gate) | gemm f32 GFLOP/s (same shape) | ratio |"
    );
    println!("|---|---|---:|---:|---:|---:|");
    let (h, f) = (config.hidden_size, config.ffn_size);
    for seqs in [1, 16, 64] {
        let len = SMOL_PREFILL_TOKENS / seqs;
        let time = best_of(Duration::from_secs(5), 3, |rep| {
            harness.prefill(seqs, len, rep).unwrap_or_else(|e| fail(e))
        });
        let (packed, gemm) = product_rates(&gate, seqs * len, h, f);
        println!(
            "| prefill | {seqs} seqs x {len} tokens | {:.0} | {packed:.1} | {gemm:.1} ({}x{h}x{f}) | {:.2} |",
            (seqs * len) as f64 / time,
            seqs * len,
            packed / gemm
        );
    }
    for seqs in [1, 16, 64] {
        let times = harness
            .decode(
                seqs,
                SMOL_DECODE_CONTEXT,
                SMOL_DECODE_STEPS,
                SMOL_PREFILL_TOKENS,
            )
            .unwrap_or_else(|e| fail(e));
        let best = times.iter().min().copied().unwrap_or(Duration::MAX);
        let (packed, gemm) = product_rates(&gate, seqs, h, f);
        println!(
            "| decode | {seqs} seqs at context {SMOL_DECODE_CONTEXT} | {:.0} | {packed:.1} | \
             {gemm:.1} ({seqs}x{h}x{f}) | {:.2} |",
            seqs as f64 / best.as_secs_f64(),
            packed / gemm
        );
    }
}

/// GFLOP/s of `[m, k] x w^T` with `w` packed, and with `w` dequantized
/// through `gemm`.
fn product_rates(w: &Matrix, m: usize, k: usize, n: usize) -> (f64, f64) {
    let a: Vec<f32> = (0..m * k).map(|i| (i % 17) as f32 * 0.01).collect();
    let mut out = vec![0.0f32; m * n];
    let flops = 2.0 * (m * k * n) as f64;
    let mut rate = |w: &Matrix| {
        let time = best_of(Duration::from_secs(1), 5, |_| {
            let started = Instant::now();
            w.matmul(&a, k, &mut out, (m, k, n), false, Threads::Pool);
            started.elapsed()
        });
        flops / time / 1e9
    };
    let packed = rate(w);
    let gemm = rate(&Matrix::F32(w.f32().into_owned()));
    (packed, gemm)
}

/// Every pool gets blocks [s*n, (s+1)*n) (each pool has its own arena). No
/// sliding: the table lists every block.
fn seq_tables(config: &ModelConfig, s: usize, blocks_per_seq: usize) -> Vec<TableInput> {
    let ids = (s * blocks_per_seq) as u32..((s + 1) * blocks_per_seq) as u32;
    config
        .pools()
        .iter()
        .map(|p| TableInput {
            window: p.window,
            beam: 0,
            first_block: 0,
            block_ids: ids.clone().collect(),
        })
        .collect()
}

fn seq_input(tables: &[TableInput], s: usize, rep: usize, start: usize, end: usize) -> SeqInput {
    SeqInput {
        seq_id: s as u64,
        tokens: (start..end)
            .map(|p| ((p * 31 + s * 7 + rep) % 256) as u32)
            .collect(),
        start_pos: start as u32,
        tables: tables.to_vec(),
        all_positions: false,
        logprobs: None,
        sampling: Sampling::GREEDY,
        copies: Vec::new(),
        history: None,
        grammar: None,
    }
}

/// FLOPs of one batch: projections and MLP per token, attention over the
/// keys each query actually sees (window-aware), LM head per sequence.
fn batch_flops(config: &ModelConfig, spans: &[(usize, usize)]) -> f64 {
    let h = config.hidden_size as f64;
    let (qd, kvd, f) = (
        config.q_dim() as f64,
        config.kv_dim() as f64,
        config.ffn_size as f64,
    );
    let per_token_linear =
        2.0 * (h * qd + 2.0 * h * kvd + qd * h + 3.0 * h * f) * config.num_layers() as f64;
    let mut flops = 0.0;
    for &(start, end) in spans {
        flops += per_token_linear * (end - start) as f64;
        for pos in start..end {
            for &w in &config.layer_windows {
                let keys = (pos + 1 - ops::window_start(pos, w)) as f64;
                // QK^T and PV over every head.
                flops += 4.0 * config.num_heads as f64 * config.head_dim as f64 * keys;
            }
        }
        flops += 2.0 * h * config.vocab_size as f64;
    }
    flops
}

/// GFLOP/s of `gemm` for `[m, k] x [k, n]` over the rayon pool.
fn gemm_gflops(m: usize, k: usize, n: usize) -> f64 {
    let a: Vec<f32> = (0..m * k).map(|i| (i % 17) as f32 * 0.01).collect();
    let w: Vec<f32> = (0..n * k).map(|i| (i % 13) as f32 * 0.01).collect();
    let mut out = vec![0.0f32; m * n];
    let time = best_of(Duration::from_secs(3), 5, |_| {
        let started = Instant::now();
        ops::matmul_wt(&a, &w, &mut out, (m, k, n), false, Threads::Pool);
        started.elapsed()
    });
    2.0 * (m * k * n) as f64 / time / 1e9
}

/// Runs `f` (which times itself) until `budget` has passed, at least
/// `min_reps` times; returns the shortest time in seconds.
fn best_of(budget: Duration, min_reps: usize, mut f: impl FnMut(usize) -> Duration) -> f64 {
    let started = Instant::now();
    let mut best = Duration::MAX;
    let mut reps = 0;
    while reps < min_reps || started.elapsed() < budget {
        best = best.min(f(reps + 1));
        reps += 1;
    }
    best.as_secs_f64()
}

fn fail(e: impl std::fmt::Display) -> ! {
    eprintln!("bench failed: {e}");
    std::process::exit(1)
}
