//! Timing harness for CPU throughput (feature `bench`: `benches/forward.rs`
//! and `examples/cpu_throughput.rs` only): prefill and greedy decode of
//! sequences that each own a run of KV blocks, through the same
//! [`Worker::forward_tokens`] a Generate step takes.

use std::time::{Duration, Instant};

use crate::batch::{Limits, Sampling, SeqInput, TableInput};
use crate::error::Result;
use crate::model::ModelConfig;
use crate::model::weights::Weights;
use crate::worker::{Worker, WorkerOptions};

/// A CPU worker sized for `max_seqs` sequences of `max_context` tokens.
#[derive(Debug)]
pub struct Harness {
    worker: Worker,
    config: ModelConfig,
    blocks_per_seq: usize,
}

impl Harness {
    /// A CPU worker over `weights` on `threads` threads, with batches of up
    /// to `max_batch_tokens` tokens.
    pub fn new(
        weights: Weights,
        threads: usize,
        max_seqs: usize,
        max_context: usize,
        max_batch_tokens: usize,
    ) -> Result<Self> {
        let config = weights.config.clone();
        let block = config.tokens_per_block as usize;
        let blocks_per_seq = max_context.div_ceil(block);
        let pools = config.pools().len() as u64;
        let kv_bytes = (max_seqs * blocks_per_seq * block) as u64
            * config.num_layers() as u64
            * 2
            * config.kv_dim() as u64
            * 4;
        let options = WorkerOptions {
            host_blocks: 0,
            // Weights, the arena with a margin, and activations.
            memory_budget_bytes: weights.bytes() + kv_bytes * 2 * pools + (1 << 30),
            limits: Limits {
                max_batch_sequences: max_seqs,
                max_batch_tokens,
            },
            threads,
        };
        Ok(Harness {
            worker: Worker::new_cpu(weights, options)?,
            config,
            blocks_per_seq,
        })
    }

    /// The model's shape.
    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// Sequence `s`'s tokens `start..end` (deterministic ids spread over the
    /// vocabulary; `salt` varies them between repetitions).
    fn input(&self, s: usize, start: usize, end: usize, salt: usize) -> SeqInput {
        let ids = (s * self.blocks_per_seq) as u32..((s + 1) * self.blocks_per_seq) as u32;
        let vocab = self.config.vocab_size;
        SeqInput {
            seq_id: s as u64,
            tokens: (start..end)
                .map(|p| ((p * 7919 + s * 104_729 + salt * 31) % vocab) as u32)
                .collect(),
            start_pos: start as u32,
            tables: self
                .config
                .pools()
                .iter()
                .map(|p| TableInput {
                    window: p.window,
                    beam: 0,
                    first_block: 0,
                    block_ids: ids.clone().collect(),
                })
                .collect(),
            all_positions: false,
            logprobs: None,
            sampling: Sampling::GREEDY,
            copies: Vec::new(),
            history: None,
            grammar: None,
        }
    }

    /// Time of one forward pass prefilling `seqs` sequences of `len` tokens
    /// from position 0.
    pub fn prefill(&mut self, seqs: usize, len: usize, salt: usize) -> Result<Duration> {
        let batch = (0..seqs).map(|s| self.input(s, 0, len, salt)).collect();
        let started = Instant::now();
        self.worker.forward_tokens(batch)?;
        Ok(started.elapsed())
    }

    /// Prefills `seqs` sequences to `context` tokens (untimed, in batches
    /// of at most `chunk` tokens), then times `steps` decode steps of one
    /// token per sequence; returns each step's time.
    pub fn decode(
        &mut self,
        seqs: usize,
        context: usize,
        steps: usize,
        chunk: usize,
    ) -> Result<Vec<Duration>> {
        let per_batch = (chunk / context.max(1)).max(1);
        for first in (0..seqs).step_by(per_batch) {
            let batch = (first..(first + per_batch).min(seqs))
                .map(|s| self.input(s, 0, context, 0))
                .collect();
            self.worker.forward_tokens(batch)?;
        }
        let mut times = Vec::with_capacity(steps);
        for step in 0..steps {
            let pos = context + step;
            let batch = (0..seqs).map(|s| self.input(s, pos, pos + 1, 0)).collect();
            let started = Instant::now();
            self.worker.forward_tokens(batch)?;
            times.push(started.elapsed());
        }
        Ok(times)
    }
}
