//! The paged forward pass against the dense reference, shared by `paged.rs`
//! (CPU backend) and `cuda.rs` (GPU backend): random shapes, shuffled block
//! tables, mixed prefill/decode batches, prefix reuse and sliding windows
//! whose blocks are reused by other sequences. Each scenario takes the
//! backend as a function building a worker from weights and, where it
//! compares with the dense reference, the tolerated relative error.

use worker_svc::batch::{CopyInput, Limits, Sampling, SeqInput, TableInput};
use worker_svc::model::weights::{SplitMix64, Weights};
use worker_svc::model::{ModelConfig, RopeScaling};
use worker_svc::ops::window_start;
use worker_svc::reference::{DenseModel, DenseSequence};
use worker_svc::worker::{Worker, WorkerOptions};

/// Builds the worker under test for some weights.
pub(crate) type Build<'a> = &'a dyn Fn(&Weights) -> Worker;

/// A tiny deterministic generator for test shapes.
struct Rng(SplitMix64);

impl Rng {
    fn new(seed: u64) -> Self {
        Rng(SplitMix64::new(seed))
    }

    fn below(&mut self, n: usize) -> usize {
        (self.0.next_u64() % n as u64) as usize
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
        rope_scaling: RopeScaling::None,
        rms_norm_eps: 1e-5,
        layer_windows: (0..layers).map(|_| rng.pick(&[0, 5, 8, 12])).collect(),
        max_context: 128,
        tokens_per_block: rng.pick(&[1, 2, 3, 4, 8]) as u32,
        tied_embeddings: rng.below(2) == 0,
        arch: Default::default(),
    }
}

/// Worker options of the tests: 16 MiB, batches of 16 sequences and 512
/// tokens, 2 threads.
pub(crate) fn options() -> WorkerOptions {
    WorkerOptions {
        host_blocks: 0,
        memory_budget_bytes: 16 << 20,
        limits: Limits {
            max_batch_sequences: 16,
            max_batch_tokens: 512,
        },
        threads: 2,
    }
}

/// max |a - b| / max |b|, NaN when either holds one (see
/// [`worker_svc::reference::relative_error`]).
pub(crate) use worker_svc::reference::relative_error;

/// The largest relative error a test has seen; fails over the tolerance.
#[derive(Default)]
pub(crate) struct MaxErr(pub(crate) f32);

impl MaxErr {
    pub(crate) fn check(&mut self, err: f32, tol: f32, what: impl FnOnce() -> String) {
        self.0 = worker_svc::reference::nan_max(self.0, err);
        assert!(err <= tol, "{}: relative error {err} over {tol}", what());
    }
}

/// Panics at the first element where `a` and `b` differ in any bit.
pub(crate) fn assert_bit_identical(a: &[f32], b: &[f32], what: &str) {
    assert_eq!(a.len(), b.len(), "{what}: lengths");
    if let Some(i) = (0..a.len()).find(|&i| a[i].to_bits() != b[i].to_bits()) {
        panic!("{what}: element {i} differs: {} vs {}", a[i], b[i]);
    }
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
        logprobs: None,
        sampling: Sampling::GREEDY,
        copies: Vec::new(),
        history: None,
        grammar: None,
    }
}

/// Shapes the GPU's tensor-core attention kernel takes (head width 64 or
/// 128, up to 8 query heads per KV head), with block sizes that do and do not
/// divide its 16-key tiles.
fn wide_head_config(rng: &mut Rng) -> ModelConfig {
    let head_dim = rng.pick(&[64, 128]);
    let num_kv_heads = rng.pick(&[1, 2]);
    let num_heads = num_kv_heads * rng.pick(&[1, 2, 3, 4, 8]);
    let layers = 1 + rng.below(2);
    ModelConfig {
        name: "wide-heads".into(),
        vocab_size: 40,
        hidden_size: rng.pick(&[32, 64]),
        num_heads,
        num_kv_heads,
        head_dim,
        ffn_size: 48,
        rope_theta: 10_000.0,
        rope_scaling: RopeScaling::None,
        rms_norm_eps: 1e-5,
        layer_windows: (0..layers).map(|_| rng.pick(&[0, 5, 20, 33])).collect(),
        max_context: 128,
        tokens_per_block: rng.pick(&[4, 8, 16, 32]) as u32,
        tied_embeddings: rng.below(2) == 0,
        arch: Default::default(),
    }
}

/// Twelve random tiny models, each driving a few sequences in random chunks
/// through shuffled blocks, every logits row within `tol` of the dense
/// reference. Returns the largest relative error seen.
pub(crate) fn paged_equals_dense(build: Build<'_>, tol: f32) -> f32 {
    random_cases(build, tol, tiny_config, 0xC0FFEE, 12)
}

/// [`paged_equals_dense`] over eight models with head widths 64 and 128.
pub(crate) fn paged_equals_dense_wide_heads(build: Build<'_>, tol: f32) -> f32 {
    random_cases(build, tol, wide_head_config, 0x7E45, 8)
}

fn random_cases(
    build: Build<'_>,
    tol: f32,
    make_config: fn(&mut Rng) -> ModelConfig,
    seed: u64,
    cases: u64,
) -> f32 {
    let mut max = MaxErr::default();
    for case in 0..cases {
        let mut rng = Rng::new(seed + case);
        let config = make_config(&mut rng);
        let weights = match Weights::seeded(config.clone(), case) {
            Ok(w) => w,
            Err(e) => panic!("case {case}: {e}"),
        };
        let dense = DenseModel::new(&weights);
        let mut worker = build(&weights);
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
            for (k, (i, start, end)) in spans.into_iter().enumerate() {
                let (out, logits) = (&outputs.seqs[k], outputs.logits(k));
                let seq = &mut seqs[i];
                assert_eq!(out.seq_id, seq.id);
                let expected = dense.forward(&mut seq.dense, &seq.tokens[start..end]);
                let vocab = config.vocab_size;
                assert_eq!(logits.len(), (end - start) * vocab);
                for (row, want) in logits.chunks_exact(vocab).zip(&expected) {
                    max.check(relative_error(row, want), tol, || {
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

/// Three layers (32 wide, 4 heads over 2 KV heads, vocabulary 64) with the
/// given windows, up to 512 tokens of context.
pub(crate) fn fixed_model(windows: Vec<u32>, tokens_per_block: u32) -> Weights {
    let config = ModelConfig {
        name: "fixed".into(),
        vocab_size: 64,
        hidden_size: 32,
        num_heads: 4,
        num_kv_heads: 2,
        head_dim: 8,
        ffn_size: 48,
        rope_theta: 10_000.0,
        rope_scaling: RopeScaling::None,
        rms_norm_eps: 1e-5,
        layer_windows: windows,
        max_context: 512,
        tokens_per_block,
        tied_embeddings: false,
        arch: Default::default(),
    };
    match Weights::seeded(config, 7) {
        Ok(w) => w,
        Err(e) => panic!("weights: {e}"),
    }
}

pub(crate) fn table(window: u32, first_block: u32, block_ids: &[u32]) -> TableInput {
    TableInput {
        window,
        beam: 0,
        first_block,
        block_ids: block_ids.to_vec(),
    }
}

pub(crate) fn seq_input(
    seq_id: u64,
    tokens: &[u32],
    start: u32,
    tables: Vec<TableInput>,
) -> SeqInput {
    SeqInput {
        seq_id,
        tokens: tokens.to_vec(),
        start_pos: start,
        tables,
        all_positions: true,
        logprobs: None,
        sampling: Sampling::GREEDY,
        copies: Vec::new(),
        history: None,
        grammar: None,
    }
}

pub(crate) fn run_one(
    worker: &mut Worker,
    seq_id: u64,
    tokens: &[u32],
    start: u32,
    tables: Vec<TableInput>,
) -> Vec<f32> {
    match worker.forward(vec![seq_input(seq_id, tokens, start, tables)]) {
        Ok(out) => out.logits(0).to_vec(),
        Err(e) => panic!("forward of {seq_id}: {e}"),
    }
}

/// A sequence reusing another's 12-token prefix gets bit-identical logits
/// to recomputing it, and within `tol` of the dense reference.
pub(crate) fn reused_prefix_matches_recomputing(build: Build<'_>, tol: f32) {
    // Full attention and a window longer than the prompt, so both pools
    // share the prefix blocks.
    let weights = fixed_model(vec![0, 32, 0], 4);
    let mut worker = build(&weights);
    let prefix: Vec<u32> = (0..12).map(|i| (i * 7 + 3) % 64).collect();
    let suffix: Vec<u32> = vec![5, 9, 33, 1, 60];
    let full: Vec<u32> = prefix.iter().chain(&suffix).copied().collect();
    let both = |ids: &[u32]| vec![table(0, 0, ids), table(32, 0, ids)];

    // A: the prefix plus its own continuation, in blocks 10, 11, 12 (+13).
    let a_tokens: Vec<u32> = prefix.iter().chain(&[2, 4]).copied().collect();
    run_one(&mut worker, 1, &a_tokens, 0, both(&[10, 11, 12, 13]));

    // B reuses A's three full prefix blocks and computes only its suffix.
    let reused = run_one(&mut worker, 2, &suffix, 12, both(&[10, 11, 12, 20, 21]));

    // C recomputes the whole of B's tokens in fresh blocks.
    let recomputed = run_one(&mut worker, 3, &full, 0, both(&[30, 31, 32, 33, 34]));
    let vocab = weights.config.vocab_size;
    let recomputed_suffix = &recomputed[prefix.len() * vocab..];
    assert_bit_identical(&reused, recomputed_suffix, "reused prefix vs recomputed");

    let dense = DenseModel::new(&weights);
    let mut d = dense.sequence();
    let expected = dense.forward(&mut d, &full);
    for (row, want) in reused.chunks_exact(vocab).zip(&expected[prefix.len()..]) {
        let err = relative_error(row, want);
        assert!(
            err <= tol,
            "reuse vs dense: relative error {err} over {tol}"
        );
    }
}

/// Partial-block reuse: a sequence that reuses another's three full blocks
/// and copies the 2 slots the other wrote into its fourth (instead of
/// computing them) gets bit-identical logits to recomputing everything,
/// through prefill and a decode step that reads the copied slots, and
/// within `tol` of the dense reference. Without the copy the same pass is
/// refused: the slots would hold no K/V.
pub(crate) fn partial_block_copy_matches_recomputing(build: Build<'_>, tol: f32) {
    let weights = fixed_model(vec![0, 32, 0], 4);
    let mut worker = build(&weights);
    let vocab = weights.config.vocab_size;
    let shared: Vec<u32> = (0..14).map(|i| (i * 7 + 3) % 64).collect();
    let suffix: Vec<u32> = vec![5, 9, 33, 1, 60];
    let full: Vec<u32> = shared.iter().chain(&suffix).copied().collect();
    let both = |ids: &[u32]| vec![table(0, 0, ids), table(32, 0, ids)];

    // A (an earlier turn) wrote 14 tokens: blocks 10-12 full, 2 slots of 13.
    run_one(&mut worker, 1, &shared, 0, both(&[10, 11, 12, 13]));

    // B shares them: blocks 10-12 reused, slots 0-1 of 13 copied into its
    // own block 20, positions 14.. computed.
    let b_tables = || both(&[10, 11, 12, 20, 21]);
    let copies = [0, 32].map(|window| CopyInput {
        window,
        src_block: 13,
        dst_block: 20,
        tokens: 2,
    });
    let without = worker.forward(vec![seq_input(2, &suffix, 14, b_tables())]);
    assert!(without.is_err(), "no copy, no K/V for positions 12-13");
    let mut with_copy = seq_input(2, &suffix, 14, b_tables());
    with_copy.copies = copies.to_vec();
    let mut copied = match worker.forward(vec![with_copy]) {
        Ok(out) => out.logits(0).to_vec(),
        Err(e) => panic!("forward with the copy: {e}"),
    };
    copied.extend(run_one(&mut worker, 2, &[42], 19, b_tables()));

    // C recomputes all of B's tokens in fresh blocks, then decodes.
    let c_tables = || both(&[30, 31, 32, 33, 34]);
    let recomputed_all = run_one(&mut worker, 3, &full, 0, c_tables());
    let mut recomputed = recomputed_all[shared.len() * vocab..].to_vec();
    recomputed.extend(run_one(&mut worker, 3, &[42], 19, c_tables()));
    assert_bit_identical(&copied, &recomputed, "partial-block copy vs recomputed");

    let dense = DenseModel::new(&weights);
    let mut d = dense.sequence();
    let mut expected = dense.forward(&mut d, &full);
    expected.extend(dense.forward(&mut d, &[42]));
    for (row, want) in copied.chunks_exact(vocab).zip(&expected[shared.len()..]) {
        let err = relative_error(row, want);
        assert!(err <= tol, "copy vs dense: relative error {err} over {tol}");
    }
}

/// Forks (n > 1 parallel samples, beams): two branches of a 15-token
/// prompt share the parent's three full blocks, copy on write the 2 slots
/// before the last prompt token from the parent's fourth block into their
/// own, and compute that token themselves, in the same pass as the parent
/// writes its next token into the block they copy from (the copies run
/// first). Each branch then decodes its own token (they diverge). Every
/// branch's logits are bit-identical to recomputing its whole context in
/// fresh blocks, and within `tol` of the dense reference.
pub(crate) fn forked_branches_match_recomputing(build: Build<'_>, tol: f32) {
    let weights = fixed_model(vec![0, 32, 0], 4);
    let mut worker = build(&weights);
    let vocab = weights.config.vocab_size;
    let prompt: Vec<u32> = (0..15).map(|i| (i * 5 + 2) % 64).collect();
    let both = |ids: &[u32]| vec![table(0, 0, ids), table(32, 0, ids)];
    // the parent prefills the prompt: blocks 10-12 full, 3 slots of 13
    run_one(&mut worker, 1, &prompt, 0, both(&[10, 11, 12, 13]));
    let branch_tables = |own: u32| both(&[10, 11, 12, own, own + 1]);
    let fork = |seq_id: u64, own: u32| {
        let mut s = seq_input(seq_id, &prompt[14..], 14, branch_tables(own));
        s.copies = [0, 32]
            .map(|window| CopyInput {
                window,
                src_block: 13,
                dst_block: own,
                tokens: 2,
            })
            .to_vec();
        s
    };
    // one pass: the parent's decode writes slot 3 of block 13 while the
    // branches copy its slots 0-1
    let out = match worker.forward(vec![
        seq_input(1, &[7], 15, both(&[10, 11, 12, 13])),
        fork(2, 20),
        fork(3, 30),
    ]) {
        Ok(out) => out,
        Err(e) => panic!("forward of the forks: {e}"),
    };
    let mut rows: Vec<Vec<f32>> = (1..3).map(|i| out.logits(i).to_vec()).collect();
    // the branches diverge: each decodes its own token
    for (k, (seq_id, own, token)) in [(2u64, 20u32, 41u32), (3, 30, 9)].into_iter().enumerate() {
        rows[k].extend(run_one(
            &mut worker,
            seq_id,
            &[token],
            15,
            branch_tables(own),
        ));
    }
    let dense = DenseModel::new(&weights);
    for (k, token) in [41u32, 9].into_iter().enumerate() {
        let full: Vec<u32> = prompt.iter().copied().chain([token]).collect();
        let fresh = both(&[
            40 + 10 * k as u32,
            41 + 10 * k as u32,
            42 + 10 * k as u32,
            43 + 10 * k as u32,
            44 + 10 * k as u32,
        ]);
        let recomputed = run_one(&mut worker, 10 + k as u64, &full, 0, fresh);
        assert_bit_identical(
            &rows[k],
            &recomputed[14 * vocab..],
            "forked branch vs recomputed",
        );
        let mut d = dense.sequence();
        let expected = dense.forward(&mut d, &full);
        for (row, want) in rows[k].chunks_exact(vocab).zip(&expected[14..]) {
            let err = relative_error(row, want);
            assert!(err <= tol, "fork vs dense: relative error {err} over {tol}");
        }
    }
    assert_ne!(rows[0][vocab..], rows[1][vocab..], "the branches diverged");
}

/// A 300-token reused prefix gives bit-identical logits to recomputing it
/// in a batch with another sequence, through prefill and one decode step.
pub(crate) fn long_reused_prefix_is_bit_identical(build: Build<'_>) {
    // 300 prefix tokens span more than one attention key tile and many
    // query chunks; the window-40 layer reads only the prefix's last blocks.
    let weights = fixed_model(vec![0, 40, 0], 4);
    let mut worker = build(&weights);
    let vocab = weights.config.vocab_size;
    let prefix: Vec<u32> = (0..300).map(|i| (i * 11 + 5) % 64).collect();
    let suffix: Vec<u32> = vec![7, 3, 61, 20, 9, 14, 2];
    let full: Vec<u32> = prefix.iter().chain(&suffix).copied().collect();
    let ids = |from: u32, n: u32| (from..from + n).collect::<Vec<u32>>();

    // A writes the prefix (75 blocks) and one token more, alone.
    let a_blocks = ids(100, 76);
    let a_tokens: Vec<u32> = prefix.iter().chain(&[1]).copied().collect();
    run_one(
        &mut worker,
        1,
        &a_tokens,
        0,
        vec![table(0, 0, &a_blocks), table(40, 0, &a_blocks)],
    );

    // B reuses the 75 full prefix blocks (only the last 10 in the window
    // pool), prefills its suffix, then decodes one token.
    let b_new = ids(200, 3);
    let b_full: Vec<u32> = a_blocks[..75].iter().chain(&b_new).copied().collect();
    let b_window: Vec<u32> = a_blocks[65..75].iter().chain(&b_new).copied().collect();
    let b_tables = || vec![table(0, 0, &b_full), table(40, 65, &b_window)];
    let mut reused = run_one(&mut worker, 2, &suffix, 300, b_tables());
    reused.extend(run_one(&mut worker, 2, &[42], 307, b_tables()));

    // C recomputes everything in fresh blocks, in one batch with an
    // unrelated sequence D, then decodes the same token.
    let c_blocks = ids(300, 78);
    let d_blocks = ids(400, 10);
    let c_tables = || vec![table(0, 0, &c_blocks), table(40, 0, &c_blocks)];
    let d_tokens: Vec<u32> = (0..37).map(|i| (i * 3 + 1) % 64).collect();
    let d_tables = vec![table(0, 0, &d_blocks), table(40, 0, &d_blocks)];
    let both = vec![
        seq_input(4, &d_tokens, 0, d_tables),
        seq_input(3, &full, 0, c_tables()),
    ];
    let out = match worker.forward(both) {
        Ok(out) => out,
        Err(e) => panic!("forward of C and D: {e}"),
    };
    let c_out = out.logits(1);
    let mut recomputed = c_out[prefix.len() * vocab..].to_vec();
    recomputed.extend(run_one(&mut worker, 3, &[42], 307, c_tables()));

    assert_bit_identical(&reused, &recomputed, "long reused prefix vs recomputed");
}

/// Two sequences through window-6 layers, B reusing blocks that slid out
/// of A's window, every logits row within `tol` of the dense reference.
pub(crate) fn sliding_window_matches_dense(build: Build<'_>, tol: f32) {
    // Window 6 with 4-token blocks: at most 3 blocks live per sequence.
    let weights = fixed_model(vec![6, 0, 6], 4);
    let mut worker = build(&weights);
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
        let mut batch = vec![seq_input(
            1,
            &tokens_a[pos_a..end_a],
            pos_a as u32,
            vec![table(6, a_first, &a_ids), table(0, 0, &a_full)],
        )];
        let mut b_span = None;
        if pos_a >= 16 && pos_b < tokens_b.len() {
            let end_b = (pos_b + 2).min(tokens_b.len());
            let before: Vec<u32> = b_win.clone();
            let b_ids = slide(&mut b_first, &mut b_win, &mut free, pos_b, end_b);
            reused_by_b += b_ids
                .iter()
                .filter(|id| !before.contains(id) && held_by_a.contains(id))
                .count();
            batch.push(seq_input(
                2,
                &tokens_b[pos_b..end_b],
                pos_b as u32,
                vec![table(6, b_first, &b_ids), table(0, 0, &b_full)],
            ));
            b_span = Some((pos_b, end_b));
        }
        let outputs = match worker.forward(batch) {
            Ok(o) => o,
            Err(e) => panic!("forward at a={pos_a}: {e}"),
        };
        let want_a = dense.forward(&mut da, &tokens_a[pos_a..end_a]);
        for (row, want) in outputs.logits(0).chunks_exact(vocab).zip(&want_a) {
            let err = relative_error(row, want);
            assert!(err <= tol, "A at {pos_a}: relative error {err} over {tol}");
        }
        if let Some((start, end)) = b_span {
            let want_b = dense.forward(&mut db, &tokens_b[start..end]);
            for (row, want) in outputs.logits(1).chunks_exact(vocab).zip(&want_b) {
                let err = relative_error(row, want);
                assert!(err <= tol, "B at {start}: relative error {err} over {tol}");
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
