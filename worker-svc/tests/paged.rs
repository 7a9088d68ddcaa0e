//! The paged CPU forward pass against the dense reference: random shapes,
//! shuffled block tables, mixed prefill/decode batches, prefix reuse and
//! sliding windows whose blocks are reused by other sequences (the
//! scenarios live in `common`, shared with the GPU tests of `cuda.rs`).

mod common;

use common::{fixed_model, relative_error};
use worker_svc::model::weights::Weights;
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

#[test]
fn paged_equals_dense_for_random_shapes_tables_and_mixed_batches() {
    let max = common::paged_equals_dense(&cpu_worker, TOLERANCE);
    println!("paged vs dense on the CPU: max relative error {max:.2e}");
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
