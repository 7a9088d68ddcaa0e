//! The CUDA backend on a GPU (feature `cuda`): the paged scenarios of
//! `common` that `paged.rs` runs on the CPU, rerun on the device (random
//! shapes, shuffled tables, mixed prefill/decode batches, prefix reuse,
//! sliding windows whose blocks are reused), and the default model against
//! the CPU backend.
//!
//! Tolerance (max |gpu − reference| / max |reference| over a logits row):
//! the products are bf16 (weights and inputs rounded, f32 accumulation) and
//! K/V 16-bit, so 8e-2 on the tiny random models against the dense f32
//! reference (before the products were bf16: 3e-2 with a bf16 arena, 5e-3
//! with f16) and 3e-2 on the default model against the CPU backend. A reused
//! prefix must give logits bit-identical to recomputing it, whatever the
//! batch, as on the CPU. Greedy tokens picked on the device must equal the
//! host's argmax of the same logits.
//! Real model files: a tiny sharded HF checkpoint against the dense
//! reference, and SmolLM2 against transformers (bf16 weights and products,
//! bf16 arena): teacher-forced top-1 agreement >= 98% and the first 16
//! greedy tokens of every prompt identical.
//! The host tier in pinned memory: a demoted prefix onboarded back gives
//! logits bit-identical to recomputing it (the scenarios of `host_tier.rs`).
//! Every architecture fixture of `tests/data/arch/` (`arch/mod.rs`) against
//! transformers: teacher-forced top-1 agreement >= 99% of positions, logits
//! within the tiny-model tolerance, paged == dense, a reused prefix
//! bit-identical to recomputing it.
//! Without a usable GPU every test prints why and returns;
//! `KVLEASE_REQUIRE_GPU=1` turns that into a failure.
#![cfg(feature = "cuda")]

mod arch;
mod common;
mod model_files;
mod tiers;

use common::{MaxErr, fixed_model, options, relative_error, table};
use worker_svc::backend::{CudaOptions, KvDtype};
use worker_svc::batch::{Limits, Sampling, SeqInput, TableInput};
use worker_svc::model::weights::Weights;
use worker_svc::model::{ModelConfig, RopeScaling};
use worker_svc::worker::{Worker, WorkerOptions};

/// Whether a GPU is usable; prints why not (or fails when
/// `KVLEASE_REQUIRE_GPU=1`).
fn gpu_available(test: &str) -> bool {
    match worker_svc::backend::cuda::probe() {
        Ok(()) => true,
        Err(reason) => {
            if gpu_required() {
                panic!("{test}: no usable GPU ({reason}) but KVLEASE_REQUIRE_GPU=1");
            }
            eprintln!("{test}: skipped, no usable GPU: {reason}");
            false
        }
    }
}

/// `KVLEASE_REQUIRE_GPU=1`: the GPU run of CI, where a skip is a failure.
fn gpu_required() -> bool {
    std::env::var("KVLEASE_REQUIRE_GPU").is_ok_and(|v| v == "1")
}

const DTYPE: KvDtype = KvDtype::Bf16;

/// Against the dense f32 reference on the tiny random models of `common`
/// (hidden widths of 16 to 64): the bf16 rounding of the weights and of
/// every product's inputs dominates, whatever the arena's type (seen: 5.1e-2
/// with a bf16 arena, 5.5e-3 on a head-width-128 model with f16).
const TINY_MODEL_TOLERANCE: f32 = 8e-2;

/// Against the CPU backend on the default model: bf16 products and the
/// arena's rounding (seen: 1.1e-2 with a bf16 arena).
const CPU_TOLERANCE: f32 = 3e-2;

fn cuda_worker(weights: &Weights, kv_dtype: KvDtype) -> Worker {
    let gpu = CudaOptions {
        device: 0,
        kv_dtype,
        memory_fraction: 0.5,
        max_kv_bytes: 8 << 20,
        ..CudaOptions::default()
    };
    match Worker::new_cuda(weights.clone(), options(), gpu) {
        Ok(w) => w,
        Err(e) => panic!("cuda worker: {e}"),
    }
}

fn gpu_worker(weights: &Weights) -> Worker {
    cuda_worker(weights, DTYPE)
}

/// The small seeded model with a 3001-token vocabulary (over the sampling
/// kernel's 1024 threads, so each thread walks a run of ids) on the GPU.
fn wide_vocab_gpu_worker(seed: u64) -> (Weights, Worker) {
    let config = ModelConfig {
        vocab_size: 3001,
        ..ModelConfig::small()
    };
    let weights = match Weights::seeded(config, seed) {
        Ok(w) => w,
        Err(e) => panic!("weights: {e}"),
    };
    let worker = gpu_worker(&weights);
    (weights, worker)
}

/// A CUDA worker with a host tier of `host_blocks` pinned blocks per pool.
fn tiered_cuda_worker(weights: &Weights, kv_dtype: KvDtype, host_blocks: u32) -> Worker {
    let gpu = CudaOptions {
        device: 0,
        kv_dtype,
        memory_fraction: 0.5,
        max_kv_bytes: 8 << 20,
        ..CudaOptions::default()
    };
    let options = WorkerOptions {
        host_blocks,
        ..options()
    };
    match Worker::new_cuda(weights.clone(), options, gpu) {
        Ok(w) => w,
        Err(e) => panic!("cuda worker with a host tier: {e}"),
    }
}

#[test]
fn a_host_tier_larger_than_host_memory_is_a_clear_start_up_error() {
    if !gpu_available("host_tier_too_large") {
        return;
    }
    // 2^31 blocks of 512 + 256 bytes: 1.5 TiB, more than the host has;
    // refused before the driver is asked to pin it.
    let weights = fixed_model(vec![0, 32, 0], 4);
    let options = WorkerOptions {
        host_blocks: 1 << 31,
        ..options()
    };
    let gpu = CudaOptions {
        max_kv_bytes: 8 << 20,
        ..CudaOptions::default()
    };
    match Worker::new_cuda(weights, options, gpu) {
        Err(e) => {
            let message = e.to_string();
            assert!(
                message.contains("needs 1572864 MiB of pinned host memory"),
                "{message}"
            );
        }
        Ok(_) => panic!("a 1.5 TiB pinned host tier was granted"),
    }
}

#[test]
fn onboarded_kv_from_the_pinned_host_tier_is_bit_identical_to_recomputed_kv() {
    if !gpu_available("pinned_host_tier") {
        return;
    }
    // Both arena types: the tier keeps 16-bit K/V as the arena stores it.
    for dtype in [KvDtype::Bf16, KvDtype::F16] {
        let build = |w: &Weights, host_blocks: u32| tiered_cuda_worker(w, dtype, host_blocks);
        tiers::onboarded_kv_is_bit_identical(&build);
        tiers::copies_only_forward(&build);
    }
}

#[test]
fn paged_equals_dense_for_random_shapes_tables_and_mixed_batches() {
    if !gpu_available("paged_equals_dense") {
        return;
    }
    for dtype in [KvDtype::Bf16, KvDtype::F16] {
        let build = |w: &Weights| cuda_worker(w, dtype);
        let max = common::paged_equals_dense(&build, TINY_MODEL_TOLERANCE);
        println!("paged vs dense, {dtype:?} arena: max relative error {max:.2e}");
    }
}

#[test]
fn paged_equals_dense_on_tensor_core_shapes() {
    if !gpu_available("paged_equals_dense_on_tensor_core_shapes") {
        return;
    }
    for dtype in [KvDtype::Bf16, KvDtype::F16] {
        let build = |w: &Weights| cuda_worker(w, dtype);
        let max = common::paged_equals_dense_wide_heads(&build, TINY_MODEL_TOLERANCE);
        println!("paged vs dense, head dims 64/128, {dtype:?} arena: max relative error {max:.2e}");
    }
}

#[test]
fn reused_prefix_gives_the_same_logits_as_recomputing_it() {
    if !gpu_available("reused_prefix") {
        return;
    }
    common::reused_prefix_matches_recomputing(&gpu_worker, TINY_MODEL_TOLERANCE);
}

#[test]
fn a_long_reused_prefix_is_bit_identical_in_any_batch_and_through_decode() {
    if !gpu_available("long_reused_prefix") {
        return;
    }
    common::long_reused_prefix_is_bit_identical(&gpu_worker);
}

#[test]
fn a_partial_block_copy_gives_the_same_logits_as_recomputing() {
    if !gpu_available("partial_block_copy") {
        return;
    }
    // Both arena types: the copy moves 16-bit K/V as it is stored.
    for dtype in [KvDtype::Bf16, KvDtype::F16] {
        let build = |w: &Weights| cuda_worker(w, dtype);
        common::partial_block_copy_matches_recomputing(&build, TINY_MODEL_TOLERANCE);
    }
}

#[test]
fn forked_branches_copy_on_write_and_match_recomputing() {
    if !gpu_available("forked_branches") {
        return;
    }
    for dtype in [KvDtype::Bf16, KvDtype::F16] {
        let build = |w: &Weights| cuda_worker(w, dtype);
        common::forked_branches_match_recomputing(&build, TINY_MODEL_TOLERANCE);
    }
}

#[test]
fn sliding_window_matches_dense_after_blocks_slide_out_and_are_reused() {
    if !gpu_available("sliding_window") {
        return;
    }
    common::sliding_window_matches_dense(&gpu_worker, TINY_MODEL_TOLERANCE);
}

#[test]
fn gpu_matches_the_cpu_backend_on_the_default_model() {
    if !gpu_available("gpu_matches_cpu") {
        return;
    }
    let weights = match Weights::seeded(ModelConfig::small(), 5) {
        Ok(w) => w,
        Err(e) => panic!("weights: {e}"),
    };
    let options = WorkerOptions {
        memory_budget_bytes: 64 << 20,
        limits: Limits {
            max_batch_sequences: 64,
            max_batch_tokens: 1024,
        },
        threads: 2,
        host_blocks: 0,
    };
    let mut cpu = match Worker::new_cpu(weights.clone(), options) {
        Ok(w) => w,
        Err(e) => panic!("cpu worker: {e}"),
    };
    let gpu_options = CudaOptions {
        device: 0,
        kv_dtype: DTYPE,
        memory_fraction: 0.5,
        max_kv_bytes: 16 << 20,
        ..CudaOptions::default()
    };
    let mut gpu = match Worker::new_cuda(weights.clone(), options, gpu_options) {
        Ok(w) => w,
        Err(e) => panic!("cuda worker: {e}"),
    };
    assert_eq!(gpu.info().backend, "cuda");
    assert_eq!(gpu.info().kv_dtype, "bf16");
    println!("device: {}", gpu.info().device);
    let windows: Vec<u32> = gpu.layout().pools.iter().map(|p| p.window).collect();
    let per_seq = 25u32;
    let seq_tables = |s: u32| -> Vec<TableInput> {
        windows
            .iter()
            .map(|&w| table(w, 0, &(s * per_seq..(s + 1) * per_seq).collect::<Vec<_>>()))
            .collect()
    };
    let vocab = weights.config.vocab_size;
    let prompts: Vec<Vec<u32>> = (0..6u32)
        .map(|s| (0..100 + 40 * s).map(|i| (i * 7 + s * 13) % 256).collect())
        .collect();
    let mut max = MaxErr::default();
    let mut compare = |batch: Vec<SeqInput>, what: &str| -> Vec<u32> {
        let c = match cpu.forward(batch.clone()) {
            Ok(o) => o,
            Err(e) => panic!("cpu {what}: {e}"),
        };
        let g = match gpu.forward(batch) {
            Ok(o) => o,
            Err(e) => panic!("gpu {what}: {e}"),
        };
        for (k, co) in c.seqs.iter().enumerate() {
            for (cr, gr) in c
                .logits(k)
                .chunks_exact(vocab)
                .zip(g.logits(k).chunks_exact(vocab))
            {
                max.check(relative_error(gr, cr), CPU_TOLERANCE, || {
                    format!("{what}, seq {}", co.seq_id)
                });
            }
        }
        c.seqs.iter().map(|o| o.next_token).collect()
    };
    // Prefill in chunks of up to 96 tokens, all sequences in each batch.
    let mut done = vec![0usize; prompts.len()];
    while done.iter().zip(&prompts).any(|(d, p)| *d < p.len()) {
        let mut batch = Vec::new();
        for (s, p) in prompts.iter().enumerate() {
            if done[s] >= p.len() {
                continue;
            }
            let end = (done[s] + 96).min(p.len());
            batch.push(SeqInput {
                seq_id: s as u64,
                tokens: p[done[s]..end].to_vec(),
                start_pos: done[s] as u32,
                tables: seq_tables(s as u32),
                all_positions: true,
                logprobs: None,
                sampling: Sampling::GREEDY,
                copies: Vec::new(),
                history: None,
                grammar: None,
            });
            done[s] = end;
        }
        compare(batch, "prefill");
    }
    // Decode 20 steps of the whole batch, fed the CPU's greedy tokens.
    // The first decoded token is any byte: here, the last prompt byte + 1.
    let mut next: Vec<u32> = prompts.iter().map(|p| (p[p.len() - 1] + 1) % 256).collect();
    let mut pos: Vec<usize> = prompts.iter().map(Vec::len).collect();
    for step in 0..20 {
        let batch = (0..prompts.len())
            .map(|s| SeqInput {
                seq_id: s as u64,
                tokens: vec![next[s]],
                start_pos: pos[s] as u32,
                tables: seq_tables(s as u32),
                all_positions: false,
                logprobs: None,
                sampling: Sampling::GREEDY,
                copies: Vec::new(),
                history: None,
                grammar: None,
            })
            .collect();
        next = compare(batch, &format!("decode step {step}"));
        for p in &mut pos {
            *p += 1;
        }
    }
    println!(
        "gpu vs cpu backend, default model, bf16 arena: max relative error {:.2e}",
        max.0
    );
}

#[test]
fn prefill_rows_are_bit_identical_to_decoding_them_one_by_one() {
    if !gpu_available("prefill_rows_equal_decode_rows") {
        return;
    }
    // Tensor-core shapes: query rows of one chunk share K/V tiles (and A
    // operands) in the attention kernel, a decode row runs alone; group
    // sizes 1, 2, 4 and 8 rows (8, 4, 2 and 1 query heads per KV head).
    for (heads, kv_heads, head_dim) in [(8, 1, 64), (8, 2, 64), (8, 4, 64), (4, 4, 64), (8, 2, 128)]
    {
        let config = ModelConfig {
            name: "tensor-core rows".into(),
            vocab_size: 50,
            hidden_size: 64,
            num_heads: heads,
            num_kv_heads: kv_heads,
            head_dim,
            ffn_size: 96,
            rope_theta: 10_000.0,
            rope_scaling: RopeScaling::None,
            rms_norm_eps: 1e-5,
            layer_windows: vec![0, 0],
            max_context: 512,
            tokens_per_block: 16,
            tied_embeddings: false,
            arch: Default::default(),
        };
        let weights = match Weights::seeded(config, 21) {
            Ok(w) => w,
            Err(e) => panic!("weights: {e}"),
        };
        let mut worker = gpu_worker(&weights);
        let tokens: Vec<u32> = (0..500).map(|i| (i * 7 + 3) % 50).collect();
        let run = |worker: &mut Worker, seq: u64, blocks: u32, start: usize, n: usize| {
            let ids: Vec<u32> = (blocks..blocks + 32).collect();
            let input = SeqInput {
                seq_id: seq,
                tokens: tokens[start..start + n].to_vec(),
                start_pos: start as u32,
                tables: vec![table(0, 0, &ids)],
                all_positions: true,
                logprobs: None,
                sampling: Sampling::GREEDY,
                copies: Vec::new(),
                history: None,
                grammar: None,
            };
            match worker.forward(vec![input]) {
                Ok(o) => o.logits(0).to_vec(),
                Err(e) => panic!("forward of {seq} at {start}: {e}"),
            }
        };
        // The whole sequence as one chunk (its products spread over several
        // streams), then again as a 400-token chunk followed by one decode
        // step per token (products of one row tile on the pass's stream).
        let chunk = run(&mut worker, 1, 0, 0, tokens.len());
        let mut stepped = run(&mut worker, 2, 40, 0, 400);
        for p in 400..tokens.len() {
            stepped.extend(run(&mut worker, 2, 40, p, 1));
        }
        assert_eq!(chunk.len(), stepped.len());
        if let Some(i) = (0..chunk.len()).find(|&i| chunk[i].to_bits() != stepped[i].to_bits()) {
            panic!(
                "{heads}/{kv_heads} heads of {head_dim}: logit {i} (row {}) differs: {} chunked vs {} decoded",
                i / 50,
                chunk[i],
                stepped[i]
            );
        }
    }
}

#[test]
fn decode_from_graphs_is_bit_identical_to_eager_decode() {
    if !gpu_available("decode_graphs_equal_eager") {
        return;
    }
    // Two pools (full and a window of 32), tensor-core heads; batches of 1
    // to 24 decode rows (row buckets 8, 16 and 32) whose keys grow from 6 to
    // 114 (key buckets 8 to 128), so graphs are captured for several
    // buckets and replayed over new metadata each step.
    let config = ModelConfig {
        name: "graphs".into(),
        vocab_size: 50,
        hidden_size: 64,
        num_heads: 8,
        num_kv_heads: 2,
        head_dim: 64,
        ffn_size: 96,
        rope_theta: 10_000.0,
        rope_scaling: RopeScaling::None,
        rms_norm_eps: 1e-5,
        layer_windows: vec![0, 32],
        max_context: 512,
        tokens_per_block: 16,
        tied_embeddings: false,
        arch: Default::default(),
    };
    let weights = match Weights::seeded(config, 23) {
        Ok(w) => w,
        Err(e) => panic!("weights: {e}"),
    };
    let worker = |decode_graphs: bool| {
        let options = WorkerOptions {
            limits: Limits {
                max_batch_sequences: 64,
                max_batch_tokens: 4096,
            },
            ..options()
        };
        let gpu = CudaOptions {
            max_kv_bytes: 8 << 20,
            decode_graphs,
            ..CudaOptions::default()
        };
        match Worker::new_cuda(weights.clone(), options, gpu) {
            Ok(w) => w,
            Err(e) => panic!("cuda worker: {e}"),
        }
    };
    let (mut graphed, mut eager) = (worker(true), worker(false));
    const SEQS: usize = 24;
    let token = |s: usize, p: usize| ((s * 7 + p * 3) % 50) as u32;
    let input = |s: usize, start: usize, end: usize| {
        let ids: Vec<u32> = (s as u32 * 8..s as u32 * 8 + 8).collect();
        SeqInput {
            seq_id: s as u64 + 1,
            tokens: (start..end).map(|p| token(s, p)).collect(),
            start_pos: start as u32,
            tables: vec![table(0, 0, &ids), table(32, 0, &ids)],
            all_positions: false,
            logprobs: None,
            sampling: Sampling::GREEDY,
            copies: Vec::new(),
            history: None,
            grammar: None,
        }
    };
    let mut both = |inputs: Vec<SeqInput>, what: &str| {
        let a = match graphed.forward(inputs.clone()) {
            Ok(o) => o,
            Err(e) => panic!("{what}, graphs: {e}"),
        };
        let b = match eager.forward(inputs.clone()) {
            Ok(o) => o,
            Err(e) => panic!("{what}, eager: {e}"),
        };
        for (k, seq) in inputs.iter().enumerate() {
            let (x, y) = (a.logits(k), b.logits(k));
            if let Some(i) = (0..x.len()).find(|&i| x[i].to_bits() != y[i].to_bits()) {
                panic!(
                    "{what}: sequence {} at {}, logit {i}: {} from a graph, {} eager",
                    seq.seq_id, seq.start_pos, x[i], y[i]
                );
            }
        }
    };
    let mut pos: Vec<usize> = (0..SEQS).map(|s| 5 + 3 * s).collect();
    both((0..SEQS).map(|s| input(s, 0, pos[s])).collect(), "prefill");
    let sizes = [24, 13, 1, 7, 3, 24, 16, 9];
    let steps = 40;
    for step in 0..steps {
        let n = sizes[step % sizes.len()];
        let chosen: Vec<usize> = (0..n).map(|i| (step * 5 + i) % SEQS).collect();
        let inputs = chosen
            .iter()
            .map(|&s| input(s, pos[s], pos[s] + 1))
            .collect();
        both(inputs, &format!("decode step {step} of {n} sequences"));
        for s in chosen {
            pos[s] += 1;
        }
    }
    let (g, e) = (graphed.graph_counts(), eager.graph_counts());
    assert_eq!(g.replays, steps as u64, "every decode step from a graph");
    assert!(
        g.captures >= 3 && g.captures < g.replays,
        "graphs of several buckets, reused: {g:?}"
    );
    assert_eq!(e.replays + e.captures, 0, "no graph with decode_graphs off");
}

#[test]
fn passes_fed_on_the_device_while_the_pass_before_runs_equal_passes_fed_from_the_host() {
    if !gpu_available("device_fed_passes") {
        return;
    }
    // Six sequences prefill at step 0 and then decode, each pass begun
    // while the one before still runs, its tokens taken on the device from
    // that pass's argmax rows; a seventh joins with a prefill chunk at step
    // 5 (a mixed batch: no graph) and is fed from step 6 on. The tokens
    // must equal those of passes run one at a time with every token fed
    // from the host.
    let weights = fixed_model(vec![0], 4);
    const SEQS: usize = 7;
    const STEPS: usize = 24;
    let prompt =
        |s: usize| -> Vec<u32> { (0..3 + s).map(|p| ((s * 11 + p * 5) % 64) as u32).collect() };
    let joins = |s: usize| if s == SEQS - 1 { 5 } else { 0 };
    let input = |s: usize, tokens: Vec<u32>, start: usize| {
        let ids: Vec<u32> = (s as u32 * 16..s as u32 * 16 + 16).collect();
        SeqInput {
            seq_id: s as u64 + 1,
            tokens,
            start_pos: start as u32,
            tables: vec![table(0, 0, &ids)],
            all_positions: false,
            logprobs: None,
            sampling: Sampling::GREEDY,
            copies: Vec::new(),
            history: None,
            grammar: None,
        }
    };
    // per step, the sequences it runs: (sequence, prefill?)
    let schedule = |step: usize| -> Vec<(usize, bool)> {
        (0..SEQS)
            .filter(|&s| step >= joins(s))
            .map(|s| (s, step == joins(s)))
            .collect()
    };
    let mut host = gpu_worker(&weights);
    let mut sampled = vec![Vec::new(); SEQS];
    let mut pos = [0usize; SEQS];
    for step in 0..STEPS {
        let runs = schedule(step);
        let inputs = runs
            .iter()
            .map(|&(s, prefill)| {
                let tokens = if prefill {
                    prompt(s)
                } else {
                    vec![*sampled[s].last().unwrap()]
                };
                input(s, tokens, pos[s])
            })
            .collect();
        let outputs = host.forward_tokens(inputs).unwrap();
        for (&(s, _), o) in runs.iter().zip(&outputs) {
            pos[s] += if sampled[s].is_empty() {
                prompt(s).len()
            } else {
                1
            };
            sampled[s].push(o.next_token);
        }
    }
    let mut device = gpu_worker(&weights);
    let mut fed = vec![Vec::new(); SEQS];
    let mut pos = [0usize; SEQS];
    let mut running: Option<(Vec<(usize, bool)>, worker_svc::worker::RunningPass)> = None;
    let finish =
        |device: &mut Worker,
         fed: &mut Vec<Vec<u32>>,
         (runs, pass): (Vec<(usize, bool)>, worker_svc::worker::RunningPass)| {
            let tokens = pass.tokens.wait().unwrap();
            for (&(s, _), o) in runs.iter().zip(device.finish_tokens(pass.rest, tokens)) {
                fed[s].push(o.next_token);
            }
        };
    for step in 0..STEPS {
        let runs = schedule(step);
        let rows: std::collections::HashMap<u64, u32> = running
            .as_ref()
            .map(|(_, p)| p.last_rows().collect())
            .unwrap_or_default();
        let mut feed = Vec::new();
        let inputs = runs
            .iter()
            .enumerate()
            .map(|(i, &(s, prefill))| {
                let tokens = if prefill {
                    prompt(s)
                } else {
                    feed.push((i, rows[&(s as u64 + 1)]));
                    vec![0]
                };
                let start = pos[s];
                pos[s] += tokens.len();
                input(s, tokens, start)
            })
            .collect();
        let begun = device.begin_tokens(inputs, &feed).unwrap();
        let worker_svc::worker::Begun::Running(pass) = begun else {
            panic!("step {step}: a greedy pass on the GPU keeps its tokens on the device");
        };
        // the pass before is finished only now, with this one begun behind it
        if let Some(before) = running.replace((runs, pass)) {
            finish(&mut device, &mut fed, before);
        }
    }
    if let Some(last) = running.take() {
        finish(&mut device, &mut fed, last);
    }
    assert_eq!(
        fed, sampled,
        "tokens fed on the device == tokens fed from the host"
    );
    assert!(
        device.graph_counts().replays > 0,
        "decode passes from graphs were fed too"
    );
}

/// A pass with picks and logprobs (run to its end at once) may be fed on
/// the device from the greedy pass running before it: a new sampled
/// request with logprobs joins decoding greedy ones (it failed before).
/// Its tokens and logprobs equal those of the same passes fed from the host.
#[test]
fn a_pass_with_picks_and_logprobs_is_fed_on_the_device_like_from_the_host() {
    use worker_svc::batch::LogprobsSpec;
    if !gpu_available("a_pass_with_picks_is_fed_on_the_device") {
        return;
    }
    let weights = fixed_model(vec![0], 4);
    let input = |s: u32, tokens: Vec<u32>, start: u32, sampling: Sampling, logprobs| {
        let ids: Vec<u32> = (s * 16..s * 16 + 16).collect();
        SeqInput {
            seq_id: u64::from(s),
            tokens,
            start_pos: start,
            tables: vec![table(0, 0, &ids)],
            all_positions: false,
            logprobs,
            sampling,
            copies: Vec::new(),
            history: None,
            grammar: None,
        }
    };
    let prompt: Vec<u32> = (0..9).map(|p| (p * 7 + 3) % 64).collect();
    let hot = Sampling {
        temperature: 0.9,
        seed: 4,
        ..Sampling::GREEDY
    };
    let asked = Some(LogprobsSpec {
        top: 3,
        prompt: false,
        next_prompt_token: None,
    });
    let second = |first: u32| {
        vec![
            input(1, vec![first], 9, Sampling::GREEDY, None),
            input(2, prompt.clone(), 0, hot.clone(), asked),
        ]
    };
    let mut host = gpu_worker(&weights);
    let a = host
        .forward_tokens(vec![input(1, prompt.clone(), 0, Sampling::GREEDY, None)])
        .unwrap();
    let b = host.forward_tokens(second(a[0].next_token)).unwrap();

    let mut device = gpu_worker(&weights);
    let begun = device
        .begin_tokens(
            vec![input(1, prompt.clone(), 0, Sampling::GREEDY, None)],
            &[],
        )
        .unwrap();
    let worker_svc::worker::Begun::Running(pass) = begun else {
        panic!("a greedy pass on the GPU keeps its tokens on the device");
    };
    let row = pass.last_rows().next().unwrap().1;
    let fed = match device.begin_tokens(second(0), &[(0, row)]).unwrap() {
        worker_svc::worker::Begun::Done(outputs) => outputs,
        worker_svc::worker::Begun::Running(_) => panic!("a pass with picks runs to its end"),
    };
    let tokens = pass.tokens.wait().unwrap();
    let first = device.finish_tokens(pass.rest, tokens);
    assert_eq!(first[0].next_token, a[0].next_token);
    assert_eq!(
        fed.iter().map(|o| o.next_token).collect::<Vec<_>>(),
        b.iter().map(|o| o.next_token).collect::<Vec<_>>(),
        "fed on the device == fed from the host"
    );
    assert_eq!(fed[1].logprobs.len(), 1);
    let (d, h) = (&fed[1].logprobs[0], &b[1].logprobs[0]);
    assert_eq!((d.token, d.top.len()), (h.token, 3));
    assert!((d.logprob - h.logprob).abs() <= 1e-5 * h.logprob.abs().max(1.0));
}

/// A pass with sampled rows fed on the device from the greedy pass running
/// before it (a sampled request joining greedy decodes: its picks need no
/// fed token) picks what the same passes pick fed from the host.
#[test]
fn a_sampled_pass_fed_on_the_device_equals_one_fed_from_the_host() {
    use worker_svc::worker::Begun;
    if !gpu_available("sampled_pass_fed_on_the_device") {
        return;
    }
    let weights = fixed_model(vec![0], 4);
    let input = |s: u64, tokens: Vec<u32>, start: u32, sampling: Sampling| {
        let ids: Vec<u32> = (s as u32 * 16..s as u32 * 16 + 16).collect();
        SeqInput {
            seq_id: s,
            tokens,
            start_pos: start,
            tables: vec![table(0, 0, &ids)],
            all_positions: false,
            sampling,
            copies: Vec::new(),
            history: None,
            grammar: None,
            logprobs: None,
        }
    };
    let greedy = || Sampling::GREEDY;
    let hot = Sampling {
        temperature: 0.9,
        seed: 3,
        ..Sampling::GREEDY
    };
    let prompt = |s: u64| -> Vec<u32> { (0..4).map(|p| ((s * 7 + p * 5) % 64) as u32).collect() };
    let first = || {
        vec![
            input(1, prompt(1), 0, greedy()),
            input(2, prompt(2), 0, greedy()),
        ]
    };
    let second = |a: u32, b: u32| {
        vec![
            input(1, vec![a], 4, greedy()),
            input(2, vec![b], 4, greedy()),
            input(3, prompt(3), 0, hot.clone()),
        ]
    };
    let next =
        |o: &[worker_svc::worker::SeqOutput]| o.iter().map(|s| s.next_token).collect::<Vec<_>>();
    let mut host = gpu_worker(&weights);
    let first_host = next(&host.forward_tokens(first()).unwrap());
    let second_host = next(
        &host
            .forward_tokens(second(first_host[0], first_host[1]))
            .unwrap(),
    );
    let mut device = gpu_worker(&weights);
    let Begun::Running(pass) = device.begin_tokens(first(), &[]).unwrap() else {
        panic!("a greedy pass on the GPU keeps its tokens on the device");
    };
    let rows: std::collections::HashMap<u64, u32> = pass.last_rows().collect();
    let begun = device
        .begin_tokens(second(0, 0), &[(0, rows[&1]), (1, rows[&2])])
        .unwrap();
    let Begun::Done(second_device) = begun else {
        panic!("sampled rows are picked at once");
    };
    let tokens = pass.tokens.wait().unwrap();
    let first_device = next(&device.finish_tokens(pass.rest, tokens));
    assert_eq!(first_device, first_host);
    assert_eq!(
        next(&second_device),
        second_host,
        "fed on the device == fed from the host"
    );
}

#[test]
fn greedy_tokens_picked_on_the_device_equal_the_hosts_argmax() {
    if !gpu_available("greedy_tokens_on_the_device") {
        return;
    }
    let weights = match Weights::seeded(ModelConfig::small(), 9) {
        Ok(w) => w,
        Err(e) => panic!("weights: {e}"),
    };
    let mut worker = gpu_worker(&weights);
    let windows: Vec<u32> = worker.layout().pools.iter().map(|p| p.window).collect();
    let tables = |s: u32| -> Vec<TableInput> {
        let ids: Vec<u32> = (s * 20..(s + 1) * 20).collect();
        windows.iter().map(|&w| table(w, 0, &ids)).collect()
    };
    let vocab = weights.config.vocab_size as u32;
    let seq = |s: u32, n: u32, start: u32, all_positions: bool, sampling: Sampling| SeqInput {
        seq_id: u64::from(s),
        tokens: (0..n).map(|i| (i * 11 + s * 29 + 3) % vocab).collect(),
        start_pos: start,
        tables: tables(s),
        all_positions,
        logprobs: None,
        sampling,
        copies: Vec::new(),
        history: None,
        grammar: None,
    };
    let sampled = Sampling {
        temperature: 0.8,
        top_p: 0.9,
        seed: 17,
        ..Sampling::GREEDY
    };
    // Greedy prefill rows (every position, and the last only), then a batch
    // with a sampled sequence (drawn on the device too).
    let batches = [
        vec![
            seq(0, 40, 0, true, Sampling::GREEDY),
            seq(1, 25, 0, false, Sampling::GREEDY),
            seq(2, 7, 0, true, Sampling::GREEDY),
        ],
        vec![
            seq(0, 1, 40, false, Sampling::GREEDY),
            seq(1, 3, 25, true, sampled),
            seq(2, 1, 7, false, Sampling::GREEDY),
        ],
    ];
    for (i, batch) in batches.into_iter().enumerate() {
        // The same batch twice writes the same K/V into the same slots.
        let with_logits = match worker.forward(batch.clone()) {
            Ok(o) => o,
            Err(e) => panic!("forward of batch {i}: {e}"),
        };
        let tokens_only = match worker.forward_tokens(batch) {
            Ok(o) => o,
            Err(e) => panic!("forward_tokens of batch {i}: {e}"),
        };
        assert_eq!(tokens_only, with_logits.seqs, "batch {i}");
        println!(
            "batch {i}: {:?}",
            tokens_only.iter().map(|o| o.next_token).collect::<Vec<_>>()
        );
    }
}

/// `batch` run twice (the same K/V written into the same slots): with its
/// logits downloaded and picked on the host (`forward`), then picked on the
/// device (`forward_tokens`).
fn host_and_device(
    worker: &mut Worker,
    batch: Vec<SeqInput>,
) -> (
    worker_svc::worker::ForwardOutput,
    Vec<worker_svc::worker::SeqOutput>,
) {
    let on_host = match worker.forward(batch.clone()) {
        Ok(o) => o,
        Err(e) => panic!("forward: {e}"),
    };
    match worker.forward_tokens(batch) {
        Ok(o) => (on_host, o),
        Err(e) => panic!("forward_tokens: {e}"),
    }
}

/// A row's logprobs from the device `d` against the host's `h`: the same
/// tokens, the values within 1e-5 relative (the device's sums reduce in
/// another order).
fn assert_logprobs_match(
    d: &worker_svc::logprobs::RowLogprobs,
    h: &worker_svc::logprobs::RowLogprobs,
    what: &str,
) {
    assert_eq!(d.token, h.token, "{what}");
    let close = |a: f32, b: f32| (a - b).abs() <= 1e-5 * b.abs().max(1.0);
    assert!(
        close(d.logprob, h.logprob),
        "{what}: {} on the device, {} on the host",
        d.logprob,
        h.logprob
    );
    let tokens =
        |r: &worker_svc::logprobs::RowLogprobs| r.top.iter().map(|t| t.0).collect::<Vec<_>>();
    assert_eq!(tokens(d), tokens(h), "{what}");
    for (a, b) in d.top.iter().zip(&h.top) {
        assert!(
            close(a.1, b.1),
            "{what}: {a:?} on the device, {b:?} on the host"
        );
    }
}

/// Every sampling parameter, alone and together, picked on the device
/// (`forward_tokens`: `adjust_logits`, `argmax_rows`, `sample_rows`) equals
/// the host's pick from the same logits (`forward` downloads them), over
/// many seeds; a vocabulary over the kernel's 1024 threads so each thread
/// walks a run of ids.
#[test]
fn device_sampling_equals_the_hosts_for_every_parameter() {
    use worker_svc::batch::Penalties;
    if !gpu_available("device_sampling_equals_the_hosts") {
        return;
    }
    let (weights, mut worker) = wide_vocab_gpu_worker(5);
    let windows: Vec<u32> = worker.layout().pools.iter().map(|p| p.window).collect();
    let vocab = weights.config.vocab_size as u32;
    let prompt: Vec<u32> = (0..24).map(|i| (i * 37 + 11) % vocab).collect();
    let hot = |seed: u64| Sampling {
        temperature: 1.3,
        seed,
        prompt_len: 20,
        ..Sampling::GREEDY
    };
    let penalties = |frequency, presence, repetition| Penalties {
        frequency,
        presence,
        repetition,
    };
    let cases = |seed: u64| -> Vec<(&'static str, Sampling)> {
        vec![
            ("temperature", hot(seed)),
            (
                "cold",
                Sampling {
                    temperature: 0.3,
                    ..hot(seed)
                },
            ),
            (
                "top_k",
                Sampling {
                    top_k: 5,
                    ..hot(seed)
                },
            ),
            (
                "top_k 1",
                Sampling {
                    top_k: 1,
                    ..hot(seed)
                },
            ),
            (
                "top_p",
                Sampling {
                    top_p: 0.5,
                    ..hot(seed)
                },
            ),
            (
                "min_p",
                Sampling {
                    min_p: 0.05,
                    ..hot(seed)
                },
            ),
            (
                "frequency",
                Sampling {
                    penalties: penalties(1.5, 0.0, 1.0),
                    ..hot(seed)
                },
            ),
            (
                "presence",
                Sampling {
                    penalties: penalties(0.0, -1.0, 1.0),
                    ..hot(seed)
                },
            ),
            (
                "repetition",
                Sampling {
                    penalties: penalties(0.0, 0.0, 1.7),
                    ..hot(seed)
                },
            ),
            (
                "logit_bias",
                Sampling {
                    logit_bias: vec![(3, -100.0), (7, 4.0), (2999, 2.5)],
                    ..hot(seed)
                },
            ),
            (
                "min_tokens",
                Sampling {
                    min_tokens: 10,
                    stop_ids: (0..40).collect(),
                    ..hot(seed)
                },
            ),
            (
                "greedy with bias and penalties",
                Sampling {
                    logit_bias: vec![(5, 3.0)],
                    penalties: penalties(0.5, 0.5, 1.2),
                    ..Sampling::GREEDY
                },
            ),
            (
                "all of them",
                Sampling {
                    top_k: 40,
                    top_p: 0.8,
                    min_p: 0.01,
                    penalties: penalties(0.7, 0.3, 1.1),
                    logit_bias: vec![(1, -100.0), (9, 1.0)],
                    min_tokens: 6,
                    stop_ids: vec![0, 2],
                    ..hot(seed)
                },
            ),
        ]
    };
    let mut compared = 0;
    for seed in 0..24u64 {
        let batch: Vec<SeqInput> = cases(seed)
            .into_iter()
            .enumerate()
            .map(|(s, (_, sampling))| {
                let s = s as u32;
                let ids: Vec<u32> = (s * 4..(s + 1) * 4).collect();
                SeqInput {
                    seq_id: u64::from(s),
                    // a different last token per sequence and seed
                    tokens: prompt
                        .iter()
                        .map(|t| (t + s * 13 + seed as u32 * 7) % vocab)
                        .collect(),
                    start_pos: 0,
                    tables: windows.iter().map(|&w| table(w, 0, &ids)).collect(),
                    all_positions: false,
                    logprobs: None,
                    sampling,
                    copies: Vec::new(),
                    history: Some(Vec::new()),
                    grammar: None,
                }
            })
            .collect();
        let (on_host, on_device) = host_and_device(&mut worker, batch);
        for (i, (name, _)) in cases(seed).iter().enumerate() {
            assert_eq!(
                on_device[i].next_token, on_host.seqs[i].next_token,
                "{name}, seed {seed}"
            );
            compared += 1;
        }
        assert_ne!(on_device[9].next_token, 3, "a bias of -100 bans the token");
        assert!(
            on_device[10].next_token >= 40,
            "min_tokens holds the stop ids back"
        );
    }
    println!("{compared} picks equal on the device and the host");
}

/// Log-probabilities computed on the device (`forward_tokens`:
/// `keep_logits` around the picking, `logprob_rows`) equal the host's
/// (`forward` downloads the logits and runs `logprobs::row_logprobs`) from
/// the same logits: greedy and sampled rows, adjusted rows (the raw values
/// put back), a prompt's every position with the next chunk's token, 0 to
/// 20 alternatives, a vocabulary over the kernel's 1024 threads.
#[test]
fn device_logprobs_equal_the_hosts() {
    use worker_svc::batch::{LogprobsSpec, Penalties};
    if !gpu_available("device_logprobs_equal_the_hosts") {
        return;
    }
    let (weights, mut worker) = wide_vocab_gpu_worker(5);
    let windows: Vec<u32> = worker.layout().pools.iter().map(|p| p.window).collect();
    let vocab = weights.config.vocab_size as u32;
    let spec = |top: u32, prompt: bool, next_prompt_token: Option<u32>| {
        Some(LogprobsSpec {
            top,
            prompt,
            next_prompt_token,
        })
    };
    let hot = Sampling {
        temperature: 1.1,
        seed: 3,
        prompt_len: 20,
        ..Sampling::GREEDY
    };
    let adjusted = Sampling {
        logit_bias: vec![(3, -100.0), (7, 40.0)],
        penalties: Penalties {
            frequency: 1.0,
            presence: 0.5,
            repetition: 1.5,
        },
        ..hot.clone()
    };
    let cases = [
        ("greedy, top 5", Sampling::GREEDY, spec(5, false, None)),
        ("sampled, top 20", hot.clone(), spec(20, false, None)),
        ("adjusted, top 3", adjusted.clone(), spec(3, false, None)),
        ("no alternatives", Sampling::GREEDY, spec(0, false, None)),
        (
            "a prompt chunk",
            Sampling::GREEDY,
            spec(4, true, Some(vocab - 1)),
        ),
        ("a prompt's last chunk", adjusted, spec(2, true, None)),
        ("no logprobs", hot, None),
    ];
    for round in 0..4u32 {
        let batch: Vec<SeqInput> = cases
            .iter()
            .enumerate()
            .map(|(s, (_, sampling, logprobs))| {
                let s = s as u32;
                let ids: Vec<u32> = (s * 4..(s + 1) * 4).collect();
                SeqInput {
                    seq_id: u64::from(s),
                    tokens: (0..24)
                        .map(|i| (i * 37 + 11 + s * 13 + round * 7) % vocab)
                        .collect(),
                    start_pos: 0,
                    tables: windows.iter().map(|&w| table(w, 0, &ids)).collect(),
                    all_positions: false,
                    logprobs: *logprobs,
                    sampling: sampling.clone(),
                    copies: Vec::new(),
                    history: Some(Vec::new()),
                    grammar: None,
                }
            })
            .collect();
        let (on_host, on_device) = host_and_device(&mut worker, batch);
        for (i, (name, _, logprobs)) in cases.iter().enumerate() {
            let (host, device) = (&on_host.seqs[i], &on_device[i]);
            assert_eq!(device.next_token, host.next_token, "{name}, round {round}");
            let rows = match logprobs {
                Some(l) if l.prompt => 24,
                Some(_) => 1,
                None => 0,
            };
            assert_eq!(device.logprobs.len(), rows, "{name}");
            assert_eq!(host.logprobs.len(), rows, "{name}");
            for (d, h) in device.logprobs.iter().zip(&host.logprobs) {
                assert_logprobs_match(d, h, &format!("{name}, round {round}"));
            }
            if let Some(l) = logprobs {
                let last = &device.logprobs[rows - 1];
                assert_eq!(last.top.len(), l.top as usize, "{name}");
                match l.next_prompt_token {
                    Some(t) => assert_eq!(last.token, t, "{name}"),
                    None => assert_eq!(last.token, device.next_token, "{name}"),
                }
            }
        }
    }
}

#[test]
fn attention_kernels_match_f64_for_decode_prefill_and_windows() {
    use worker_svc::backend::cuda::AttentionTuning;
    use worker_svc::backend::cuda::bench::{self, AttentionShape};
    if !gpu_available("attention_kernels_match_f64") {
        return;
    }
    // Splits of 512 keys besides the default's 2048, so rows of up to
    // 1100 keys merge several splits in both kernels.
    let general = AttentionTuning {
        tensor_cores: false,
        split_keys: 512,
        ..AttentionTuning::default()
    };
    let small = AttentionTuning {
        warps: 2,
        stages: 2,
        split_keys: 512,
        ..AttentionTuning::default()
    };
    let wide = AttentionTuning {
        warps: 8,
        stages: 4,
        split_keys: 128,
        ..AttentionTuning::default()
    };
    // (batch, context, heads, kv heads, head dim, block, dtype, window, rows)
    let cases = [
        (3, 300, 8, 2, 128, 16, KvDtype::Bf16, 0, 1),
        (2, 1000, 32, 8, 128, 16, KvDtype::Bf16, 0, 1),
        (2, 517, 16, 2, 64, 8, KvDtype::F16, 0, 5),
        (3, 333, 6, 2, 64, 3, KvDtype::Bf16, 100, 7),
        (2, 700, 4, 4, 128, 32, KvDtype::F16, 250, 3),
        (2, 90, 10, 2, 64, 16, KvDtype::Bf16, 37, 20),
        (2, 200, 8, 2, 96, 16, KvDtype::Bf16, 0, 2),
    ];
    let mut worst = 0.0f64;
    for (i, &(batch, context, heads, kv, d, b, dtype, window, rows)) in cases.iter().enumerate() {
        let shape = AttentionShape {
            batch,
            context,
            num_heads: heads,
            num_kv_heads: kv,
            head_dim: d,
            tokens_per_block: b,
            kv_dtype: dtype,
            window,
            query_rows: rows,
        };
        let tunings: &[AttentionTuning] = if i < 2 {
            &[AttentionTuning::default(), general, small, wide]
        } else {
            &[AttentionTuning::default(), general]
        };
        for &tuning in tunings {
            let r = match bench::attention(shape, tuning, 0) {
                Ok(r) => r,
                Err(e) => panic!("{shape:?} {tuning:?}: {e}"),
            };
            println!(
                "{shape:?}: {} ({} splits): max rel err {:.2e}",
                r.kernel, r.num_splits, r.max_rel_err
            );
            assert!(
                r.max_rel_err <= 2e-4,
                "{shape:?} {tuning:?} ({}): relative error {} over 2e-4",
                r.kernel,
                r.max_rel_err
            );
            worst = worst.max(r.max_rel_err);
        }
    }
    // Partials for fewer (row x split) pairs than the batch needs: the rows
    // run as several launches, each row computed exactly as in one launch.
    let prefill = AttentionShape {
        batch: 2,
        context: 1100,
        num_heads: 16,
        num_kv_heads: 2,
        head_dim: 64,
        tokens_per_block: 8,
        kv_dtype: KvDtype::Bf16,
        window: 0,
        query_rows: 9,
    };
    for tuning in [AttentionTuning::default(), general] {
        let whole = bench::attention(prefill, tuning, 0);
        let chunked = bench::attention_with_partials(prefill, tuning, 0, 7);
        let (whole, chunked) = match (whole, chunked) {
            (Ok(w), Ok(c)) => (w, c),
            (w, c) => panic!("{tuning:?}: {w:?} / {c:?}"),
        };
        println!(
            "{}: {} launches of {} splits: max rel err {:.2e} (one launch: {:.2e})",
            chunked.kernel,
            chunked.launches,
            chunked.num_splits,
            chunked.max_rel_err,
            whole.max_rel_err
        );
        assert!(whole.launches == 1 && chunked.launches > 1);
        assert_eq!(
            chunked.max_rel_err.to_bits(),
            whole.max_rel_err.to_bits(),
            "row-range launches changed the result"
        );
        assert!(chunked.max_rel_err <= 2e-4);
    }
    println!("attention kernels vs f64: max relative error {worst:.2e}");
}

#[test]
fn cuda_without_a_device_is_a_clear_error_and_auto_falls_back() {
    // Runs everywhere: on a GPU machine `cuda` works; elsewhere it must be
    // an error (never a panic) and `auto` must give a CPU worker.
    let weights = match Weights::seeded(fixed_model(vec![0], 4).config, 1) {
        Ok(w) => w,
        Err(e) => panic!("weights: {e}"),
    };
    let gpu = CudaOptions {
        max_kv_bytes: 1 << 20,
        ..CudaOptions::default()
    };
    let auto = Worker::new(
        weights.clone(),
        options(),
        worker_svc::backend::BackendChoice::Auto,
        gpu,
    );
    let auto = match auto {
        Ok(w) => w,
        Err(e) => panic!("auto: {e}"),
    };
    match worker_svc::worker::cuda_unavailable() {
        None => {
            assert_eq!(auto.info().backend, "cuda");
            assert!(Worker::new_cuda(weights, options(), gpu).is_ok());
        }
        Some(reason) => {
            println!("no GPU here ({reason}): checking the fallback and the error");
            assert_eq!(auto.info().backend, "cpu");
            match Worker::new_cuda(weights, options(), gpu) {
                Ok(_) => panic!("cuda without a device must fail"),
                Err(e) => assert!(e.to_string().contains("cuda backend unavailable"), "{e}"),
            }
        }
    }
}

#[test]
fn a_sharded_hf_checkpoint_runs_paged_equal_to_dense() {
    if !gpu_available("hf_checkpoint") {
        return;
    }
    // Plain RoPE: the CUDA kernels compute their own frequencies and do not
    // apply `rope_scaling` yet.
    let dir = model_files::TempDir::new("cuda-hf");
    model_files::write_hf_checkpoint(&dir.0, false);
    let serving = worker_svc::model::load::ServingShape {
        max_context: 128,
        tokens_per_block: 8,
    };
    let loaded = worker_svc::model::load::open(&dir.0, serving).unwrap_or_else(|e| panic!("{e}"));
    let mut worker = gpu_worker(&loaded.weights);
    let err = model_files::paged_vs_dense(&mut worker, &loaded.weights);
    println!("hf checkpoint on the GPU: paged vs dense max relative error {err:.2e}");
    assert!(err < TINY_MODEL_TOLERANCE, "paged vs dense: {err}");
}

#[test]
fn smollm2_on_the_gpu_agrees_with_transformers() {
    if !gpu_available("smollm2") {
        return;
    }
    let Some(path) = model_files::smollm2_gguf() else {
        // the GPU run checks the real model too: without it, it proves less
        assert!(
            !gpu_required(),
            "smollm2: no SmolLM2 file but KVLEASE_REQUIRE_GPU=1 (run `kvlease model fetch smollm2`)"
        );
        return;
    };
    let fixture = model_files::fixture();
    let loaded = model_files::load(&path);
    let gpu = CudaOptions {
        device: 0,
        kv_dtype: DTYPE,
        memory_fraction: 0.5,
        max_kv_bytes: 256 << 20,
        ..CudaOptions::default()
    };
    let mut worker = Worker::new_cuda(loaded.weights, options(), gpu)
        .unwrap_or_else(|e| panic!("cuda worker: {e}"));
    println!(
        "SmolLM2 on {} (bf16 weights and products, {DTYPE:?} arena) vs transformers {}:",
        worker.info().device,
        fixture.transformers
    );
    let report = model_files::compare(&mut worker, &fixture);
    assert!(
        report.top1_rate() >= 0.98,
        "teacher-forced top-1 agreement {:.2}% < 98%",
        100.0 * report.top1_rate()
    );
    for (name, matched) in &report.greedy_match {
        assert!(
            *matched >= 16,
            "{name}: only {matched} leading greedy tokens match"
        );
    }
}

// === the architecture fixtures ===

/// One fixture on the GPU: see the file's doc.
fn architecture_on_the_gpu(name: &str) {
    if !gpu_available(name) {
        return;
    }
    gpu_agrees_with_transformers(name, &arch::load(name));
}

/// `loaded` (fixture `name`, from its directory or a GGUF file) on the GPU.
fn gpu_agrees_with_transformers(name: &str, loaded: &worker_svc::model::load::LoadedModel) {
    let reference = arch::reference(name);
    let mut worker = gpu_worker(&loaded.weights);
    println!(
        "{name} on {} (bf16 weights and products, {DTYPE:?} arena) vs transformers {}:",
        worker.info().device,
        reference.transformers
    );
    let report = arch::compare(&mut worker, &reference);
    // Strict, as the acceptance reads. The near-tie figure says whether a
    // miss was a rounding of a near-tied pair (the random fixtures other
    // than qwen3 have reference top-2 margins down to 3.5e-5 of the row's
    // scale; qwen3's are at least 4x its emulated bf16 error, see the
    // generator's docstring) or a wrong pass.
    let near = report.top1_near as f64 / report.positions.max(1) as f64;
    println!(
        "  top-1 agreement {:.2}%, {:.2}% counting near-ties",
        100.0 * report.top1_rate(),
        100.0 * near
    );
    assert!(
        report.top1_rate() >= 0.99,
        "{name}: teacher-forced top-1 agreement {}/{} ({:.2}%; {:.2}% counting near-ties) < 99%",
        report.top1_agree,
        report.positions,
        100.0 * report.top1_rate(),
        100.0 * near
    );
    assert!(
        report.max_rel_err <= TINY_MODEL_TOLERANCE,
        "{name}: logits {:.2e} from transformers'",
        report.max_rel_err
    );
    arch::check_paged_and_reuse(
        &mut worker,
        &loaded.weights,
        &reference,
        name,
        TINY_MODEL_TOLERANCE,
    );
}

#[test]
fn llama3_fixture_on_the_gpu_agrees_with_transformers() {
    architecture_on_the_gpu("llama3");
}

#[test]
fn qwen2_fixture_on_the_gpu_agrees_with_transformers() {
    architecture_on_the_gpu("qwen2");
}

#[test]
fn qwen3_fixture_on_the_gpu_agrees_with_transformers() {
    architecture_on_the_gpu("qwen3");
}

#[test]
fn mistral_fixture_on_the_gpu_agrees_with_transformers() {
    architecture_on_the_gpu("mistral");
}

#[test]
fn gemma3_fixture_on_the_gpu_agrees_with_transformers() {
    architecture_on_the_gpu("gemma3");
}

#[test]
fn phi3_fixture_on_the_gpu_agrees_with_transformers() {
    architecture_on_the_gpu("phi3");
}

#[test]
fn qwen2_and_qwen3_gguf_fixtures_on_the_gpu_agree_with_transformers() {
    if !gpu_available("qwen gguf") {
        return;
    }
    for name in ["qwen2", "qwen3"] {
        gpu_agrees_with_transformers(name, &arch::load_gguf(name));
    }
}

#[test]
fn gemma2_fixture_on_the_gpu_agrees_with_transformers() {
    // Soft-capped scores: the general attention kernel, never the
    // tensor-core one.
    architecture_on_the_gpu("gemma2");
}

/// Structured output: grammar masks applied on the device (`mask_logits`
/// after `adjust_logits`, then `argmax_rows` / `sample_rows`;
/// `forward_tokens`) pick what the host picks from the same logits with the
/// same mask (`forward`), greedy and sampled, with a bias pulling towards a
/// token the grammar refuses, mid-grammar and once complete (the end token
/// alone); every pick is one the grammar allows. The byte-level tokenizer
/// over a 3001-token model: ids past it are never allowed. Run again with
/// logprobs (the next token's, 0 to 20 alternatives, and one sequence's
/// every prompt position): the device keeps a constrained row's raw values
/// around the mask (`keep_rows`), so its logprobs equal the host's and
/// `logprobs::row_logprobs` of the raw logits the host downloaded, the
/// picks being the same as without logprobs.
#[test]
fn grammar_masks_applied_on_the_device_pick_as_the_host() {
    use kvlease_tokenizer::grammar::{Constraint, allowed};
    use kvlease_tokenizer::{Tokenizer, byte_level};
    use worker_svc::batch::LogprobsSpec;
    use worker_svc::logprobs::row_logprobs;
    if !gpu_available("grammar_masks_applied_on_the_device") {
        return;
    }
    let (weights, mut worker) = wide_vocab_gpu_worker(9);
    let tokenizer = Tokenizer::byte_level();
    worker.set_tokenizer(tokenizer.clone());
    let windows: Vec<u32> = worker.layout().pools.iter().map(|p| p.window).collect();
    let vocab = weights.config.vocab_size;
    let hot = |seed: u64| Sampling {
        temperature: 1.2,
        seed,
        ..Sampling::GREEDY
    };
    let cases =
        |seed: u64| -> Vec<(&'static str, Sampling, Constraint, &'static str)> {
            vec![
            (
                "greedy regex",
                Sampling::GREEDY,
                Constraint::Regex("ab[0-9]{2,5}".into()),
                "ab1",
            ),
            ("sampled json_object", hot(seed), Constraint::JsonObject, "{\"k\":"),
            (
                "top_k regex",
                Sampling { top_k: 3, ..hot(seed) },
                Constraint::Regex("(yes|no|maybe)".into()),
                "m",
            ),
            (
                "a bias towards a refused token",
                Sampling {
                    logit_bias: vec![(u32::from(b'a'), 100.0), (2000, 100.0)],
                    ..Sampling::GREEDY
                },
                Constraint::Regex("[0-9]+x".into()),
                "7",
            ),
            (
                "sampled lark",
                hot(seed ^ 5),
                Constraint::Lark("start: \"x\" NUM\nNUM: /[0-9]+/".into()),
                "x",
            ),
            (
                "a json schema",
                hot(seed ^ 9),
                Constraint::JsonSchema(
                    r#"{"type":"object","properties":{"n":{"type":"integer"}},"required":["n"]}"#
                        .into(),
                ),
                "{\"n\":4",
            ),
            ("complete", hot(seed), Constraint::Regex("ok".into()), "ok"),
        ]
        };
    // with logprobs: (alternatives, every prompt position) per case
    let asked = [
        (5, false),
        (20, false),
        (0, false),
        (3, false),
        (2, true),
        (1, false),
        (4, false),
    ];
    let mut compared = 0;
    let mut picks_without: Vec<Vec<u32>> = Vec::new();
    for (seed, with_logprobs) in (0..16u64)
        .map(|s| (s, false))
        .chain((0..16u64).map(|s| (s, true)))
    {
        let batch: Vec<SeqInput> = cases(seed)
            .into_iter()
            .enumerate()
            .map(|(s, (_, sampling, grammar, output))| {
                let s = s as u32;
                let ids: Vec<u32> = (s * 4..(s + 1) * 4).collect();
                let mut tokens: Vec<u32> = (0..20)
                    .map(|i| (i * 37 + s * 13 + seed as u32 * 7) % vocab as u32)
                    .collect();
                tokens.extend(byte_level::encode(output, false));
                SeqInput {
                    seq_id: u64::from(s),
                    tokens,
                    start_pos: 0,
                    tables: windows.iter().map(|&w| table(w, 0, &ids)).collect(),
                    all_positions: false,
                    sampling: Sampling {
                        constrained: true,
                        prompt_len: 20,
                        ..sampling
                    },
                    copies: Vec::new(),
                    history: Some(Vec::new()),
                    logprobs: with_logprobs.then_some(LogprobsSpec {
                        top: asked[s as usize].0,
                        prompt: asked[s as usize].1,
                        next_prompt_token: None,
                    }),
                    grammar: Some(Ok(grammar)),
                }
            })
            .collect();
        let (on_host, on_device) = host_and_device(&mut worker, batch);
        let picks: Vec<u32> = on_device.iter().map(|o| o.next_token).collect();
        if with_logprobs {
            assert_eq!(
                picks, picks_without[seed as usize],
                "logprobs change no pick, seed {seed}"
            );
            for (i, (name, ..)) in cases(seed).into_iter().enumerate() {
                let (host, device) = (&on_host.seqs[i], &on_device[i]);
                let raw = on_host.logits(i);
                let rows = raw.len() / on_host.vocab();
                assert_eq!(device.logprobs.len(), rows, "{name}");
                assert_eq!(host.logprobs.len(), rows, "{name}");
                for (r, (d, h)) in device.logprobs.iter().zip(&host.logprobs).enumerate() {
                    // row r chooses the next input token, the last the pick
                    let row = &raw[r * on_host.vocab()..(r + 1) * on_host.vocab()];
                    let want = row_logprobs(row, h.token, asked[i].0 as usize);
                    assert_eq!(
                        h, &want,
                        "{name}, seed {seed}: the host's are of the raw row"
                    );
                    assert_logprobs_match(d, h, &format!("{name}, seed {seed}, row {r}"));
                }
                assert_eq!(device.logprobs[rows - 1].token, device.next_token, "{name}");
            }
        } else {
            picks_without.push(picks);
        }
        let grammars = match tokenizer.grammars() {
            Ok(g) => g,
            Err(e) => panic!("grammars: {e}"),
        };
        for (i, (name, _, grammar, output)) in cases(seed).into_iter().enumerate() {
            let t = on_device[i].next_token;
            assert_eq!(t, on_host.seqs[i].next_token, "{name}, seed {seed}");
            let mut m = match grammars.compile(&grammar) {
                Ok(m) => m,
                Err(e) => panic!("{name}: {e}"),
            };
            for tok in byte_level::encode(output, false) {
                if let Err(e) = m.consume(tok) {
                    panic!("{name}: {e}");
                }
            }
            let mut words = Vec::new();
            if let Err(e) = m.mask_into(&mut words, vocab) {
                panic!("{name}: {e}");
            }
            assert!(allowed(&words, t), "{name}, seed {seed}: {t} is refused");
            compared += 1;
        }
        assert_eq!(
            on_device[6].next_token,
            byte_level::EOS,
            "complete: the end"
        );
        assert_ne!(on_device[3].next_token, u32::from(b'a'), "a refused token");
    }
    println!("{compared} masked picks equal on the device and the host, half with raw logprobs");
}
