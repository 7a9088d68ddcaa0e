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
//! Passes (`passes/`: prefill rows vs one-by-one decode, CUDA graphs vs
//! eager, passes fed on the device) and picks (`picks/`: greedy, sampling,
//! logprobs and grammar masks on the device vs the host) in their modules.
//! Without a usable GPU every test prints why and returns;
//! `KVLEASE_REQUIRE_GPU=1` turns that into a failure.
#![cfg(feature = "cuda")]

mod arch;
mod common;
mod fp8;
mod model_files;
mod passes;
mod picks;
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

/// Against the dense f32 reference with an fp8 (e4m3, unscaled) arena: K/V
/// keep 3 mantissa bits, and the tiny random models' values, many under
/// 2^-6, are subnormals of fewer (seen: 2.49e-1 on the head-width-16-to-64
/// models, 9.99e-2 on widths 64 and 128).
const FP8_TOLERANCE: f32 = 0.35;

/// Every arena type.
const DTYPES: [KvDtype; 3] = [KvDtype::Bf16, KvDtype::F16, KvDtype::Fp8];

/// Tolerance against the dense f32 reference on the tiny random models for
/// an arena of `dtype`.
fn dense_tolerance(dtype: KvDtype) -> f32 {
    match dtype {
        KvDtype::Fp8 => FP8_TOLERANCE,
        KvDtype::Bf16 | KvDtype::F16 => TINY_MODEL_TOLERANCE,
    }
}

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
    // Every arena type: the tier keeps K/V as the arena stores it.
    for dtype in DTYPES {
        let build = |w: &Weights, host_blocks: u32| tiered_cuda_worker(w, dtype, host_blocks);
        tiers::onboarded_kv_is_bit_identical(&build);
        tiers::copies_only_forward(&build);
    }
}

#[test]
fn kv_loaded_from_the_disk_tier_is_bit_identical_to_recomputed_kv() {
    if !gpu_available("disk_tier") {
        return;
    }
    // Every arena type: a block file holds K/V as the arena does.
    for dtype in DTYPES {
        let build = |w: &Weights, dir: &std::path::Path, identity: &str| {
            let mut worker = tiered_cuda_worker(w, dtype, 8);
            if let Err(e) = worker.open_disk_tier(dir, tiers::disk::DISK_BYTES, identity) {
                panic!("disk tier: {e}");
            }
            worker
        };
        tiers::disk::loaded_kv_is_bit_identical_also_after_a_restart(&build);
        tiers::disk::a_corrupted_file_fails_the_request_whole_and_is_gone(&build);
    }
}

#[test]
fn kv_pulled_from_another_gpu_worker_is_bit_identical_to_recomputed_kv() {
    if !gpu_available("peer_pull") {
        return;
    }
    for dtype in DTYPES {
        tiers::pulled_kv_is_bit_identical(&|w: &Weights| cuda_worker(w, dtype));
    }
}

#[test]
fn paged_equals_dense_for_random_shapes_tables_and_mixed_batches() {
    if !gpu_available("paged_equals_dense") {
        return;
    }
    for dtype in DTYPES {
        let build = |w: &Weights| cuda_worker(w, dtype);
        let max = common::paged_equals_dense(&build, dense_tolerance(dtype));
        println!("paged vs dense, {dtype:?} arena: max relative error {max:.2e}");
    }
}

#[test]
fn paged_equals_dense_on_tensor_core_shapes() {
    if !gpu_available("paged_equals_dense_on_tensor_core_shapes") {
        return;
    }
    for dtype in DTYPES {
        let build = |w: &Weights| cuda_worker(w, dtype);
        let max = common::paged_equals_dense_wide_heads(&build, dense_tolerance(dtype));
        println!("paged vs dense, head dims 64/128, {dtype:?} arena: max relative error {max:.2e}");
    }
}

#[test]
fn reused_prefix_gives_the_same_logits_as_recomputing_it() {
    if !gpu_available("reused_prefix") {
        return;
    }
    for dtype in DTYPES {
        let build = |w: &Weights| cuda_worker(w, dtype);
        common::reused_prefix_matches_recomputing(&build, dense_tolerance(dtype));
    }
}

#[test]
fn a_long_reused_prefix_is_bit_identical_in_any_batch_and_through_decode() {
    if !gpu_available("long_reused_prefix") {
        return;
    }
    for dtype in DTYPES {
        common::long_reused_prefix_is_bit_identical(&|w: &Weights| cuda_worker(w, dtype));
    }
}

#[test]
fn a_partial_block_copy_gives_the_same_logits_as_recomputing() {
    if !gpu_available("partial_block_copy") {
        return;
    }
    // Every arena type: the copy moves K/V as it is stored.
    for dtype in DTYPES {
        let build = |w: &Weights| cuda_worker(w, dtype);
        common::partial_block_copy_matches_recomputing(&build, dense_tolerance(dtype));
    }
}

#[test]
fn forked_branches_copy_on_write_and_match_recomputing() {
    if !gpu_available("forked_branches") {
        return;
    }
    for dtype in DTYPES {
        let build = |w: &Weights| cuda_worker(w, dtype);
        common::forked_branches_match_recomputing(&build, dense_tolerance(dtype));
    }
}

#[test]
fn sliding_window_matches_dense_after_blocks_slide_out_and_are_reused() {
    if !gpu_available("sliding_window") {
        return;
    }
    for dtype in DTYPES {
        let build = |w: &Weights| cuda_worker(w, dtype);
        common::sliding_window_matches_dense(&build, dense_tolerance(dtype));
    }
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
        // fp8 arenas (the reference reads the same e4m3 values): the
        // tensor-core kernel widening tiles to f16, and the general one
        (3, 300, 8, 2, 128, 16, KvDtype::Fp8, 0, 1),
        (2, 517, 16, 2, 64, 8, KvDtype::Fp8, 0, 5),
        (3, 333, 6, 2, 64, 3, KvDtype::Fp8, 100, 7),
        (2, 200, 8, 2, 96, 16, KvDtype::Fp8, 0, 2),
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
