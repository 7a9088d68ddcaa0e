//! The paged CPU forward pass against the dense reference: random shapes,
//! shuffled block tables, mixed prefill/decode batches, prefix reuse and
//! sliding windows whose blocks are reused by other sequences (the
//! scenarios live in `common`, shared with the GPU tests of `cuda.rs`).

mod common;

use common::{fixed_model, relative_error};
use worker_svc::batch::{Sampling, SeqInput};
use worker_svc::model::weights::{Matrix, Weights};
use worker_svc::packed::PackedMatrix;
use worker_svc::reference::DenseModel;
use worker_svc::worker::Worker;

/// Tolerance against the dense reference: both compute in f32.
const TOLERANCE: f32 = 1e-4;

fn cpu_worker(weights: &Weights) -> Worker {
    match Worker::new_cpu(weights.clone(), common::options()) {
        Ok(w) => w,
        Err(e) => panic!("worker: {e}"),
    }
}

/// `weights` with every matrix whose rows are whole 32-element blocks
/// quantized to Q8_0 and kept packed (the others, such as a 48-wide down
/// projection, stay f32), the way a GGUF file's would load.
fn pack_q8_0(weights: &Weights) -> Weights {
    let h = weights.config.hidden_size;
    let pack = |m: &mut Matrix, cols: usize| {
        if !cols.is_multiple_of(32) {
            return;
        }
        let values = m.f32().into_owned();
        let packed = PackedMatrix::quantize_q8_0(values.len() / cols, cols, &values)
            .unwrap_or_else(|e| panic!("pack: {e}"));
        *m = Matrix::Packed(packed);
    };
    let mut packed = weights.clone();
    let (q, f) = (packed.config.q_dim(), packed.config.ffn_size);
    pack(&mut packed.embed, h);
    if let Some(head) = &mut packed.lm_head {
        pack(head, h);
    }
    for l in &mut packed.layers {
        for m in [&mut l.wq, &mut l.wk, &mut l.wv, &mut l.w_gate, &mut l.w_up] {
            pack(m, h);
        }
        pack(&mut l.wo, q);
        pack(&mut l.w_down, f);
    }
    packed
}

fn packed_cpu_worker(weights: &Weights) -> Worker {
    cpu_worker(&pack_q8_0(weights))
}

#[test]
fn packed_weights_keep_a_long_reused_prefix_bit_identical() {
    common::long_reused_prefix_is_bit_identical(&packed_cpu_worker);
}

#[test]
fn packed_weights_match_the_dense_reference_on_their_values() {
    let packed = pack_q8_0(&fixed_model(vec![0, 8, 0], 4));
    assert!(matches!(packed.layers[0].wq, Matrix::Packed(_)));
    assert!(matches!(packed.layers[0].w_down, Matrix::F32(_)));
    // The reference multiplies by the same values, dequantized.
    let mut unpacked = packed.clone();
    unpacked.embed = unpacked.embed.f32().into_owned().into();
    for l in &mut unpacked.layers {
        for m in [
            &mut l.wq,
            &mut l.wk,
            &mut l.wv,
            &mut l.wo,
            &mut l.w_gate,
            &mut l.w_up,
        ] {
            m.f32_mut();
        }
    }
    if let Some(head) = &mut unpacked.lm_head {
        head.f32_mut();
    }
    let tokens: Vec<u32> = (0..30).map(|i| (i * 5 + 2) % 64).collect();
    let dense = DenseModel::new(&unpacked);
    let expected = dense.forward(&mut dense.sequence(), &tokens);
    let mut worker = cpu_worker(&packed);
    let out = worker
        .forward(vec![SeqInput {
            seq_id: 1,
            tokens: tokens.clone(),
            start_pos: 0,
            tables: vec![
                common::table(0, 0, &(0..8).collect::<Vec<u32>>()),
                common::table(8, 0, &(8..16).collect::<Vec<u32>>()),
            ],
            all_positions: true,
            logprobs: None,
            sampling: Sampling::GREEDY,
            copies: Vec::new(),
            history: None,
            grammar: None,
        }])
        .unwrap_or_else(|e| panic!("forward: {e}"));
    let vocab = packed.config.vocab_size;
    for (pos, (row, want)) in out.logits(0).chunks_exact(vocab).zip(&expected).enumerate() {
        let err = relative_error(row, want);
        assert!(err <= TOLERANCE, "position {pos}: relative error {err}");
    }
}

#[test]
fn paged_equals_dense_for_random_shapes_tables_and_mixed_batches() {
    let max = common::paged_equals_dense(&cpu_worker, TOLERANCE);
    println!("paged vs dense on the CPU: max relative error {max:.2e}");
}

/// A worker whose output is all NaN (a NaN final-norm weight) must fail
/// the comparison: a maximum taken with `f32::max` skips NaN and scored it 0.
#[test]
#[should_panic(expected = "relative error NaN")]
fn an_all_nan_output_fails_paged_vs_dense() {
    common::paged_equals_dense(
        &|weights| {
            let mut poisoned = weights.clone();
            poisoned.final_norm[0] = f32::NAN;
            cpu_worker(&poisoned)
        },
        TOLERANCE,
    );
}

#[test]
fn paged_equals_dense_for_head_widths_64_and_128() {
    let max = common::paged_equals_dense_wide_heads(&cpu_worker, TOLERANCE);
    println!("paged vs dense on the CPU, head dims 64/128: max relative error {max:.2e}");
}

#[test]
fn reused_prefix_gives_the_same_logits_as_recomputing_it() {
    common::reused_prefix_matches_recomputing(&cpu_worker, TOLERANCE);
}

#[test]
fn a_partial_block_copy_gives_the_same_logits_as_recomputing() {
    common::partial_block_copy_matches_recomputing(&cpu_worker, TOLERANCE);
}

#[test]
fn forked_branches_copy_on_write_and_match_recomputing() {
    common::forked_branches_match_recomputing(&cpu_worker, TOLERANCE);
}

#[test]
fn a_long_reused_prefix_is_bit_identical_in_any_batch_and_through_decode() {
    common::long_reused_prefix_is_bit_identical(&cpu_worker);
}

#[test]
fn sliding_window_matches_dense_after_blocks_slide_out_and_are_reused() {
    common::sliding_window_matches_dense(&cpu_worker, TOLERANCE);
}

#[test]
fn the_windowed_model_differs_from_full_attention() {
    // Guards the window tests: with the same weights, a window changes the
    // logits once the context is longer than it.
    let windowed = fixed_model(vec![6, 0, 6], 4);
    let mut full = windowed.clone();
    full.config.layer_windows = vec![0, 0, 0];
    let tokens: Vec<u32> = (0..20).map(|i| (i * 3 + 1) % 64).collect();
    let dw = DenseModel::new(&windowed);
    let df = DenseModel::new(&full);
    let lw = dw.forward(&mut dw.sequence(), &tokens);
    let lf = df.forward(&mut df.sequence(), &tokens);
    assert!(
        relative_error(&lw[3], &lf[3]) < 1e-6,
        "inside the window they agree"
    );
    assert!(
        relative_error(&lw[19], &lf[19]) > 1e-3,
        "past the window they differ"
    );
}
