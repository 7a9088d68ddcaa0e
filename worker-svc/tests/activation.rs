//! The activation bytes `Describe` reports bound what a forward pass at the
//! largest batch really allocates (measured with a counting allocator).
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed unwrap fails the test

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicIsize, Ordering};

use worker_svc::batch::{Limits, Sampling, SeqInput, TableInput};
use worker_svc::model::ModelConfig;
use worker_svc::model::weights::Weights;
use worker_svc::worker::{Worker, WorkerOptions};

/// Counts live heap bytes and their high-water mark.
struct Counting;

static LIVE: AtomicIsize = AtomicIsize::new(0);
static PEAK: AtomicIsize = AtomicIsize::new(0);

// SAFETY: delegates every call to `System` unchanged; only counts.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller upholds `GlobalAlloc::alloc`'s contract, which `System` has too.
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            let live =
                LIVE.fetch_add(layout.size() as isize, Ordering::SeqCst) + layout.size() as isize;
            PEAK.fetch_max(live, Ordering::SeqCst);
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` came from `System` with `layout` (every allocation here does).
        unsafe { System.dealloc(ptr, layout) };
        LIVE.fetch_sub(layout.size() as isize, Ordering::SeqCst);
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: as for `alloc`.
        let p = unsafe { System.alloc_zeroed(layout) };
        if !p.is_null() {
            let live =
                LIVE.fetch_add(layout.size() as isize, Ordering::SeqCst) + layout.size() as isize;
            PEAK.fetch_max(live, Ordering::SeqCst);
        }
        p
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: `ptr` came from `System` with `layout`; the caller upholds the rest.
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            let delta = new_size as isize - layout.size() as isize;
            let live = LIVE.fetch_add(delta, Ordering::SeqCst) + delta;
            PEAK.fetch_max(live, Ordering::SeqCst);
        }
        p
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

#[test]
fn a_full_batch_stays_within_the_reported_activation_bytes() {
    let config = ModelConfig {
        layer_windows: vec![0, 64],
        max_context: 512,
        ..ModelConfig::small()
    };
    let limits = Limits {
        max_batch_sequences: 4,
        max_batch_tokens: 256,
    };
    let weights = Weights::seeded(config.clone(), 5).unwrap_or_else(|e| panic!("{e}"));
    let options = WorkerOptions {
        host_blocks: 0,
        memory_budget_bytes: 64 << 20,
        limits,
        threads: 2,
    };
    let mut worker = Worker::new_cpu(weights, options).unwrap_or_else(|e| panic!("{e}"));
    let reported = worker.info().activation_bytes as isize;

    // The largest batch: every token, every position asking for logits, the
    // longest context on the full-attention layers.
    let b = config.tokens_per_block as usize;
    let tables = |s: u32| -> Vec<TableInput> {
        let blocks = (config.max_context as usize / b) as u32;
        [0, 64]
            .iter()
            .map(|&window| TableInput {
                window,
                beam: 0,
                first_block: 0,
                block_ids: (s * blocks..(s + 1) * blocks).collect(),
            })
            .collect()
    };
    // Fill the context of sequence 0 first, so the measured pass attends over
    // (almost) max_context keys.
    let fill = |start: usize, n: usize| SeqInput {
        seq_id: 0,
        tokens: vec![7; n],
        start_pos: start as u32,
        tables: tables(0),
        all_positions: false,
        logprobs: None,
        sampling: Sampling::GREEDY,
        copies: Vec::new(),
        history: None,
        grammar: None,
    };
    worker
        .forward(vec![fill(0, 256)])
        .unwrap_or_else(|e| panic!("{e}"));
    let batch: Vec<SeqInput> = (0..4u32)
        .map(|s| SeqInput {
            all_positions: true,
            logprobs: None,
            ..if s == 0 {
                fill(256, 64)
            } else {
                SeqInput {
                    seq_id: u64::from(s),
                    tokens: vec![3; 64],
                    start_pos: 0,
                    tables: tables(s),
                    all_positions: true,
                    logprobs: None,
                    sampling: Sampling::GREEDY,
                    copies: Vec::new(),
                    history: None,
                    grammar: None,
                }
            }
        })
        .collect();
    let input_bytes: isize = batch
        .iter()
        .map(|s| {
            (s.tokens.len() * 4
                + s.tables
                    .iter()
                    .map(|t| t.block_ids.len() * 4)
                    .sum::<usize>()) as isize
        })
        .sum();

    let baseline = LIVE.load(Ordering::SeqCst);
    PEAK.store(baseline, Ordering::SeqCst);
    let outputs = worker.forward(batch).unwrap_or_else(|e| panic!("{e}"));
    let peak = PEAK.load(Ordering::SeqCst) - baseline;
    drop(outputs);
    eprintln!("reported {reported} bytes, measured peak {peak} bytes (inputs {input_bytes})");
    assert!(peak <= reported, "measured {peak} > reported {reported}");
    assert!(
        peak * 4 >= reported,
        "the estimate is not grossly loose: {peak} vs {reported}"
    );
}
