//! `cargo bench -p worker-svc --bench validate`: the worker's host-side
//! check of a Forward batch ([`batch::validate`]) for decode steps of 256
//! sequences at the contexts of the end-to-end workloads (18 + 64 and
//! 512 + 64 tokens: half-way through 128 new tokens), and for a prefill
//! batch, on a model with a full-attention and a windowed pool. It prints
//! one row per batch: microseconds per check (best of repeated runs),
//! blocks the batch reads, and nanoseconds per block. The hot path's target
//! for a 256-sequence decode step is well under 100 us.

use std::time::{Duration, Instant};

use worker_svc::arena::{ArenaLayout, SlotLedger};
use worker_svc::batch::{self, BlockMarks, Limits, Sampling, SeqInput, TableInput};
use worker_svc::model::ModelConfig;

const BLOCKS: u32 = 40_000;

fn main() {
    let model = ModelConfig {
        layer_windows: vec![0, 64],
        max_context: 4096,
        ..ModelConfig::small()
    };
    let b = model.tokens_per_block as usize;
    let layout = ArenaLayout::new(&model, &[BLOCKS, BLOCKS]);
    let limits = Limits {
        max_batch_sequences: 256,
        max_batch_tokens: 256 * 640,
    };
    println!(
        "| batch | sequences | tokens | blocks read | us per check | ns per block |\n|---|---:|---:|---:|---:|---:|"
    );
    for (name, seqs, context, new) in [
        // (name, sequences, context before the step, tokens the step runs)
        ("decode, 18 + 64 context", 256_usize, 82_usize, 1_usize),
        ("decode, 512 + 64 context", 256, 576, 1),
        ("prefill, 512-token prompts", 64, 0, 512),
    ] {
        // each sequence owns consecutive blocks; the ledger holds their K/V
        let mut ledger = SlotLedger::new(&layout);
        let per_seq = (context + new).div_ceil(b) as u32;
        let mut inputs = Vec::new();
        let mut history = Vec::new();
        for s in 0..seqs {
            let first = s as u32 * per_seq;
            let ids: Vec<u32> = (first..first + per_seq).collect();
            for pool in 0..layout.pools.len() {
                for pos in 0..context {
                    history.push((pool, ids[pos / b], pos % b));
                }
            }
            let tables = layout
                .pools
                .iter()
                .map(|p| TableInput {
                    window: p.window,
                    beam: 0,
                    first_block: 0,
                    block_ids: ids.clone(),
                })
                .collect();
            inputs.push(SeqInput {
                seq_id: s as u64,
                tokens: vec![1; new],
                start_pos: context as u32,
                tables,
                all_positions: false,
                logprobs: None,
                sampling: Sampling::GREEDY,
                copies: Vec::new(),
                history: None,
                grammar: None,
            });
        }
        ledger.record(&history);
        let blocks_read: usize = seqs * layout.pools.len() * context.div_ceil(b).max(1);
        let mut marks = BlockMarks::default();
        let mut best = Duration::MAX;
        let deadline = Instant::now() + Duration::from_millis(700);
        while Instant::now() < deadline {
            let batch = inputs.clone();
            let t = Instant::now();
            let checked = batch::validate(batch, &model, &layout, &ledger, limits, &mut marks);
            best = best.min(t.elapsed());
            if let Err(e) = checked {
                panic!("{name}: {e}");
            }
        }
        let us = best.as_secs_f64() * 1e6;
        println!(
            "| {name} | {seqs} | {} | {blocks_read} | {us:.1} | {:.1} |",
            seqs * new,
            us * 1e3 / blocks_read as f64
        );
    }
}
