//! The CUDA backend on a GPU (feature `cuda`): the paged tests of
//! `paged.rs` rerun on the device against the dense reference (random
//! shapes, shuffled tables, mixed prefill/decode batches, prefix reuse,
//! sliding windows whose blocks are reused), and the default model against
//! the CPU backend.
//!
//! Tolerance (max |gpu − reference| / max |reference| over a logits row):
//! 3e-2 with a bf16 arena, 5e-3 with f16; the products and activations are
//! f32, so the error is the K/V rounding. Without a usable GPU every test
//! prints why and returns; `KVLEASE_REQUIRE_GPU=1` turns that into a failure.
#![cfg(feature = "cuda")]

use worker_svc::backend::{CudaOptions, KvDtype};
use worker_svc::batch::{Limits, Sampling, SeqInput, TableInput};
use worker_svc::model::ModelConfig;
use worker_svc::model::weights::Weights;
use worker_svc::ops::window_start;
use worker_svc::reference::{DenseModel, DenseSequence};
use worker_svc::worker::{Worker, WorkerOptions};

/// A tiny deterministic generator for test shapes (SplitMix64).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    fn pick<T: Copy>(&mut self, items: &[T]) -> T {
        items[self.below(items.len())]
    }

    fn shuffle<T>(&mut self, items: &mut [T]) {
        for i in (1..items.len()).rev() {
            items.swap(i, self.below(i + 1));
        }
    }
}

fn tiny_config(rng: &mut Rng) -> ModelConfig {
    let head_dim = rng.pick(&[4, 8]);
    let num_kv_heads = rng.pick(&[1, 2]);
    let num_heads = num_kv_heads * rng.pick(&[1, 2, 3]);
    let layers = 1 + rng.below(3);
    ModelConfig {
        name: "tiny".into(),
        vocab_size: 40,
        hidden_size: rng.pick(&[16, 24, 32]),
        num_heads,
        num_kv_heads,
        head_dim,
        ffn_size: rng.pick(&[24, 40]),
        rope_theta: 10_000.0,
        rms_norm_eps: 1e-5,
        layer_windows: (0..layers).map(|_| rng.pick(&[0, 5, 8, 12])).collect(),
        max_context: 128,
        tokens_per_block: rng.pick(&[1, 2, 3, 4, 8]) as u32,
        tied_embeddings: rng.below(2) == 0,
    }
}

/// Whether a GPU is usable; prints why not (or fails when
/// `KVLEASE_REQUIRE_GPU=1`).
fn gpu_available(test: &str) -> bool {
    match worker_svc::backend::cuda::probe() {
        Ok(()) => true,
        Err(reason) => {
            if std::env::var("KVLEASE_REQUIRE_GPU").is_ok_and(|v| v == "1") {
                panic!("{test}: no usable GPU ({reason}) but KVLEASE_REQUIRE_GPU=1");
            }
            eprintln!("{test}: skipped, no usable GPU: {reason}");
            false
        }
    }
}

const DTYPE: KvDtype = KvDtype::Bf16;

fn tolerance(dtype: KvDtype) -> f32 {
    match dtype {
        KvDtype::Bf16 => 3e-2,
        KvDtype::F16 => 5e-3,
    }
}

fn options() -> WorkerOptions {
    WorkerOptions {
        memory_budget_bytes: 16 << 20,
        limits: Limits {
            max_batch_sequences: 16,
            max_batch_tokens: 512,
        },
        threads: 2,
    }
}

fn cuda_worker(weights: &Weights, kv_dtype: KvDtype) -> Worker {
    let gpu = CudaOptions {
        device: 0,
        kv_dtype,
        memory_fraction: 0.5,
        max_kv_bytes: 8 << 20,
    };
    match Worker::new_cuda(weights.clone(), options(), gpu) {
        Ok(w) => w,
        Err(e) => panic!("cuda worker: {e}"),
    }
}

fn worker_for(weights: &Weights) -> Worker {
    cuda_worker(weights, DTYPE)
}

/// Largest error seen by a test, printed at its end.
#[derive(Default)]
struct MaxErr(f32);

impl MaxErr {
    fn check(&mut self, err: f32, tol: f32, what: impl FnOnce() -> String) {
        self.0 = self.0.max(err);
        assert!(err <= tol, "{}: relative error {err} over {tol}", what());
    }
}

/// max |a - b| / max |b|: the error relative to the logits' scale.
fn relative_error(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    let scale = b.iter().fold(0.0f32, |m, v| m.max(v.abs())).max(1e-6);
    let diff = a
        .iter()
        .zip(b)
        .fold(0.0f32, |m, (x, y)| m.max((x - y).abs()));
    diff / scale
}

/// One sequence driven through the paged worker and the dense reference.
struct Driven {
    id: u64,
    tokens: Vec<u32>,
    done: usize,
    /// Per pool: (first block index, block ids).
    tables: Vec<(u32, Vec<u32>)>,
    dense: DenseSequence,
}

/// Hands out block ids from a shuffled list and takes back slid-out ones
/// (last freed, first reused, so freed blocks are rewritten at once).
struct Blocks {
    free: Vec<Vec<u32>>,
}

impl Blocks {
    fn new(worker: &Worker, rng: &mut Rng, per_pool: usize) -> Self {
        let free = worker
            .layout()
            .pools
            .iter()
            .map(|p| {
                let mut ids: Vec<u32> = (0..p.num_blocks).collect();
                rng.shuffle(&mut ids);
                ids.truncate(per_pool);
                ids
            })
            .collect();
        Blocks { free }
    }

    /// Grows/shrinks `seq`'s tables for a pass over `[start, end)`.
    fn fit(&mut self, worker: &Worker, seq: &mut Driven, start: usize, end: usize) {
        let b = worker.info().model.tokens_per_block as usize;
        for (pool, geometry) in worker.layout().pools.iter().enumerate() {
            let (first, ids) = &mut seq.tables[pool];
            let needed_first = window_start(start, geometry.window) / b;
            while (*first as usize) < needed_first && !ids.is_empty() {
                let freed = ids.remove(0);
                self.free[pool].push(freed);
                *first += 1;
            }
            while (*first as usize) + ids.len() <= (end - 1) / b {
                let id = match self.free[pool].pop() {
                    Some(id) => id,
                    None => panic!("test ran out of blocks in pool {pool}"),
                };
                ids.push(id);
            }
        }
    }
}

fn input(worker: &Worker, seq: &Driven, start: usize, end: usize) -> SeqInput {
    SeqInput {
        seq_id: seq.id,
        tokens: seq.tokens[start..end].to_vec(),
        start_pos: start as u32,
        tables: worker
            .layout()
            .pools
            .iter()
            .zip(&seq.tables)
            .map(|(p, (first, ids))| TableInput {
                window: p.window,
                beam: 0,
                first_block: *first,
                block_ids: ids.clone(),
            })
            .collect(),
        all_positions: true,
        sampling: Sampling::GREEDY,
    }
}

/// Shapes the tensor-core attention kernel takes (head width 64 or 128, up
/// to 8 query heads per KV head), with block sizes that do and do not
/// divide its 16-key tiles.
fn tensor_core_config(rng: &mut Rng) -> ModelConfig {
    let head_dim = rng.pick(&[64, 128]);
    let num_kv_heads = rng.pick(&[1, 2]);
    let num_heads = num_kv_heads * rng.pick(&[1, 2, 3, 4, 8]);
    let layers = 1 + rng.below(2);
    ModelConfig {
        name: "tensor-core".into(),
        vocab_size: 40,
        hidden_size: rng.pick(&[32, 64]),
        num_heads,
        num_kv_heads,
        head_dim,
        ffn_size: 48,
        rope_theta: 10_000.0,
        rms_norm_eps: 1e-5,
        layer_windows: (0..layers).map(|_| rng.pick(&[0, 5, 20, 33])).collect(),
        max_context: 128,
        tokens_per_block: rng.pick(&[4, 8, 16, 32]) as u32,
        tied_embeddings: rng.below(2) == 0,
    }
}

#[test]
fn paged_equals_dense_for_random_shapes_tables_and_mixed_batches() {
    if !gpu_available("paged_equals_dense") {
        return;
    }
    for dtype in [KvDtype::Bf16, KvDtype::F16] {
        let max = random_cases(dtype, tiny_config, 0xC0FFEE, 12);
        println!("paged vs dense, {dtype:?} arena: max relative error {max:.2e}");
    }
}

#[test]
fn paged_equals_dense_on_tensor_core_shapes() {
    if !gpu_available("paged_equals_dense_on_tensor_core_shapes") {
        return;
    }
    for dtype in [KvDtype::Bf16, KvDtype::F16] {
        let max = random_cases(dtype, tensor_core_config, 0x7E45, 8);
        println!("paged vs dense, head dims 64/128, {dtype:?} arena: max relative error {max:.2e}");
    }
}

fn random_cases(
    dtype: KvDtype,
    make_config: fn(&mut Rng) -> ModelConfig,
    seed: u64,
    cases: u64,
) -> f32 {
    let mut max = MaxErr::default();
    for case in 0..cases {
        let mut rng = Rng(seed + case);
        let config = make_config(&mut rng);
        let weights = match Weights::seeded(config.clone(), case) {
            Ok(w) => w,
            Err(e) => panic!("case {case}: {e}"),
        };
        let dense = DenseModel::new(&weights);
        let mut worker = cuda_worker(&weights, dtype);
        let mut blocks = Blocks::new(&worker, &mut rng, 400);
        let pools = worker.layout().pools.len();
        let mut seqs: Vec<Driven> = (0..1 + rng.below(4))
            .map(|i| Driven {
                id: 100 + i as u64,
                tokens: (0..8 + rng.below(40))
                    .map(|_| rng.below(40) as u32)
                    .collect(),
                done: 0,
                tables: vec![(0, Vec::new()); pools],
                dense: dense.sequence(),
            })
            .collect();

        while seqs.iter().any(|s| s.done < s.tokens.len()) {
            // Each unfinished sequence runs a chunk: a prefill piece or one
            // decode token, in random order within the batch.
            let mut order: Vec<usize> = (0..seqs.len())
                .filter(|&i| seqs[i].done < seqs[i].tokens.len())
                .collect();
            rng.shuffle(&mut order);
            let mut spans = Vec::new();
            let mut batch = Vec::new();
            for &i in &order {
                let seq = &mut seqs[i];
                let left = seq.tokens.len() - seq.done;
                let n = if rng.below(2) == 0 {
                    1
                } else {
                    1 + rng.below(left.min(9))
                };
                let (start, end) = (seq.done, seq.done + n.min(left));
                blocks.fit(&worker, seq, start, end);
                batch.push(input(&worker, seq, start, end));
                spans.push((i, start, end));
            }
            let outputs = match worker.forward(batch) {
                Ok(o) => o,
                Err(e) => panic!("case {case} ({config:?}): forward failed: {e}"),
            };
            for ((i, start, end), out) in spans.into_iter().zip(outputs) {
                let seq = &mut seqs[i];
                assert_eq!(out.seq_id, seq.id);
                let expected = dense.forward(&mut seq.dense, &seq.tokens[start..end]);
                let vocab = config.vocab_size;
                assert_eq!(out.logits.len(), (end - start) * vocab);
                for (row, want) in out.logits.chunks_exact(vocab).zip(&expected) {
                    let err = relative_error(row, want);
                    max.check(err, tolerance(dtype), || {
                        format!(
                            "case {case} seq {} positions {start}..{end} ({config:?})",
                            seq.id
                        )
                    });
                }
                assert_eq!(out.argmax.len(), end - start);
                seq.done = end;
            }
        }
    }
    max.0
}

fn fixed_model(windows: Vec<u32>, tokens_per_block: u32) -> Weights {
    let config = ModelConfig {
        name: "fixed".into(),
        vocab_size: 64,
        hidden_size: 32,
        num_heads: 4,
        num_kv_heads: 2,
        head_dim: 8,
        ffn_size: 48,
        rope_theta: 10_000.0,
        rms_norm_eps: 1e-5,
        layer_windows: windows,
        max_context: 256,
        tokens_per_block,
        tied_embeddings: false,
    };
    match Weights::seeded(config, 7) {
        Ok(w) => w,
        Err(e) => panic!("weights: {e}"),
    }
}

fn table(window: u32, first_block: u32, block_ids: &[u32]) -> TableInput {
    TableInput {
        window,
        beam: 0,
        first_block,
        block_ids: block_ids.to_vec(),
    }
}

fn run_one(
    worker: &mut Worker,
    seq_id: u64,
    tokens: &[u32],
    start: u32,
    tables: Vec<TableInput>,
) -> Vec<f32> {
    let input = SeqInput {
        seq_id,
        tokens: tokens.to_vec(),
        start_pos: start,
        tables,
        all_positions: true,
        sampling: Sampling::GREEDY,
    };
    match worker.forward(vec![input]) {
        Ok(mut out) => out.remove(0).logits,
        Err(e) => panic!("forward of {seq_id}: {e}"),
    }
}

#[test]
fn reused_prefix_gives_the_same_logits_as_recomputing_it() {
    if !gpu_available("reused_prefix") {
        return;
    }
    // Full attention and a window longer than the prompt, so both pools
    // share the prefix blocks.
    let weights = fixed_model(vec![0, 32, 0], 4);
    let mut worker = worker_for(&weights);
    let prefix: Vec<u32> = (0..12).map(|i| (i * 7 + 3) % 64).collect();
    let suffix: Vec<u32> = vec![5, 9, 33, 1, 60];
    let full: Vec<u32> = prefix.iter().chain(&suffix).copied().collect();

    // A: the prefix plus its own continuation, in blocks 10, 11, 12 (+13).
    let a_tokens: Vec<u32> = prefix.iter().chain(&[2, 4]).copied().collect();
    run_one(
        &mut worker,
        1,
        &a_tokens,
        0,
        vec![
            table(0, 0, &[10, 11, 12, 13]),
            table(32, 0, &[10, 11, 12, 13]),
        ],
    );

    // B reuses A's three full prefix blocks and computes only its suffix.
    let reused = run_one(
        &mut worker,
        2,
        &suffix,
        12,
        vec![
            table(0, 0, &[10, 11, 12, 20, 21]),
            table(32, 0, &[10, 11, 12, 20, 21]),
        ],
    );

    // C recomputes the whole of B's tokens in fresh blocks.
    let recomputed = run_one(
        &mut worker,
        3,
        &full,
        0,
        vec![
            table(0, 0, &[30, 31, 32, 33, 34]),
            table(32, 0, &[30, 31, 32, 33, 34]),
        ],
    );
    let vocab = weights.config.vocab_size;
    let recomputed_suffix = &recomputed[prefix.len() * vocab..];
    let err = relative_error(&reused, recomputed_suffix);
    println!("prefix reuse vs recompute on the GPU: relative error {err:.2e}");
    assert!(err <= 1e-3, "reuse vs recompute: relative error {err}");
    let argmax = |l: &[f32]| {
        l.chunks_exact(vocab)
            .map(worker_svc::ops::argmax)
            .collect::<Vec<_>>()
    };
    assert_eq!(argmax(&reused), argmax(recomputed_suffix));

    let dense = DenseModel::new(&weights);
    let mut d = dense.sequence();
    let expected = dense.forward(&mut d, &full);
    for (row, want) in reused.chunks_exact(vocab).zip(&expected[prefix.len()..]) {
        let err = relative_error(row, want);
        assert!(
            err <= tolerance(DTYPE),
            "reuse vs dense: relative error {err}"
        );
    }
}

#[test]
fn sliding_window_matches_dense_after_blocks_slide_out_and_are_reused() {
    if !gpu_available("sliding_window") {
        return;
    }
    // Window 6 with 4-token blocks: at most 3 blocks live per sequence.
    let weights = fixed_model(vec![6, 0, 6], 4);
    let mut worker = worker_for(&weights);
    let dense = DenseModel::new(&weights);
    let tokens_a: Vec<u32> = (0..40).map(|i| (i * 13 + 1) % 64).collect();
    let tokens_b: Vec<u32> = (0..24).map(|i| (i * 5 + 2) % 64).collect();
    let mut da = dense.sequence();
    let mut db = dense.sequence();
    let vocab = weights.config.vocab_size;

    // Window-pool blocks, recycled by hand: A's slid-out blocks go to B.
    let mut free: Vec<u32> = vec![7, 3, 11, 0, 9, 5, 2, 8, 1, 4, 6, 10];
    let (mut a_first, mut a_win) = (0u32, Vec::<u32>::new());
    let (mut b_first, mut b_win) = (0u32, Vec::<u32>::new());
    let a_full: Vec<u32> = (100..110).collect();
    let b_full: Vec<u32> = (200..206).collect();
    let mut reused_by_b = 0;
    let mut held_by_a: Vec<u32> = Vec::new();

    let mut pos_a = 0;
    let mut pos_b = 0;
    while pos_a < tokens_a.len() {
        // A: chunks of 3, then decode; B starts once A has slid out blocks.
        let n_a = if pos_a < 12 { 3 } else { 1 };
        let end_a = (pos_a + n_a).min(tokens_a.len());
        let a_ids = slide(&mut a_first, &mut a_win, &mut free, pos_a, end_a);
        held_by_a.extend(&a_ids);
        let mut batch = vec![SeqInput {
            seq_id: 1,
            tokens: tokens_a[pos_a..end_a].to_vec(),
            start_pos: pos_a as u32,
            tables: vec![table(6, a_first, &a_ids), table(0, 0, &a_full)],
            all_positions: true,
            sampling: Sampling::GREEDY,
        }];
        let mut b_span = None;
        if pos_a >= 16 && pos_b < tokens_b.len() {
            let end_b = (pos_b + 2).min(tokens_b.len());
            let before: Vec<u32> = b_win.clone();
            let b_ids = slide(&mut b_first, &mut b_win, &mut free, pos_b, end_b);
            reused_by_b += b_ids
                .iter()
                .filter(|id| !before.contains(id) && held_by_a.contains(id))
                .count();
            batch.push(SeqInput {
                seq_id: 2,
                tokens: tokens_b[pos_b..end_b].to_vec(),
                start_pos: pos_b as u32,
                tables: vec![table(6, b_first, &b_ids), table(0, 0, &b_full)],
                all_positions: true,
                sampling: Sampling::GREEDY,
            });
            b_span = Some((pos_b, end_b));
        }
        let outputs = match worker.forward(batch) {
            Ok(o) => o,
            Err(e) => panic!("forward at a={pos_a}: {e}"),
        };
        let want_a = dense.forward(&mut da, &tokens_a[pos_a..end_a]);
        for (row, want) in outputs[0].logits.chunks_exact(vocab).zip(&want_a) {
            let err = relative_error(row, want);
            assert!(
                err <= tolerance(DTYPE),
                "A at {pos_a}: relative error {err}"
            );
        }
        if let Some((start, end)) = b_span {
            let want_b = dense.forward(&mut db, &tokens_b[start..end]);
            for (row, want) in outputs[1].logits.chunks_exact(vocab).zip(&want_b) {
                let err = relative_error(row, want);
                assert!(
                    err <= tolerance(DTYPE),
                    "B at {start}: relative error {err}"
                );
            }
            pos_b = end;
        }
        pos_a = end_a;
    }
    assert!(
        a_first >= 8,
        "A's early blocks slid out (first_block {a_first})"
    );
    assert!(
        reused_by_b >= 2,
        "B reused blocks A released ({reused_by_b})"
    );
}

/// Moves a window-6, 4-token-block table to cover a pass over
/// `[start, end)`: slid-out blocks go to the front of `free` (reused first).
fn slide(
    first: &mut u32,
    win: &mut Vec<u32>,
    free: &mut Vec<u32>,
    start: usize,
    end: usize,
) -> Vec<u32> {
    let keep_from = window_start(start, 6) / 4;
    while (*first as usize) < keep_from {
        free.insert(0, win.remove(0));
        *first += 1;
    }
    while (*first as usize) + win.len() <= (end - 1) / 4 {
        win.push(free.remove(0));
    }
    win.clone()
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
        for (co, go) in c.iter().zip(&g) {
            for (cr, gr) in co
                .logits
                .chunks_exact(vocab)
                .zip(go.logits.chunks_exact(vocab))
            {
                max.check(relative_error(gr, cr), tolerance(DTYPE), || {
                    format!("{what}, seq {}", co.seq_id)
                });
            }
        }
        c.iter().map(|o| o.next_token).collect()
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
                sampling: Sampling::GREEDY,
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
                sampling: Sampling::GREEDY,
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
    let general = AttentionTuning {
        tensor_cores: false,
        ..AttentionTuning::default()
    };
    let small = AttentionTuning {
        warps: 2,
        stages: 2,
        ..AttentionTuning::default()
    };
    let wide = AttentionTuning {
        warps: 8,
        stages: 4,
        ctas_per_sm: 32,
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
