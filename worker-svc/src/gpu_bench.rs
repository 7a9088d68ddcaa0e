//! End-to-end GPU benches of the worker (feature `bench`, for
//! `benches/gpu.rs`, `benches/host_tier.rs` and the GPU tests only): a CUDA
//! [`Worker`] timed through `forward_tokens` and its host-tier copies. The
//! kernel-level measurements they build on (attention, copy and link rates,
//! bytes and FLOPs per step) are `backend::cuda::bench`'s; this module sits
//! above the worker so that the backend never reaches back up to it.

use std::time::Instant;

use crate::backend::PhaseTimes;
use crate::backend::cuda::bench::{kv_bytes_read, prefill_flops, weight_bytes_per_step};
use crate::backend::cuda::{CudaOptions, KvDtype};
use crate::batch::{Limits, Sampling, SeqInput, TableInput, TierCopyInput, TierDirection};
use crate::error::{Error, Result};
use crate::model::ModelConfig;
use crate::model::weights::{SplitMix64, Weights};
use crate::worker::{Worker, WorkerOptions};

/// One timed decode step size of [`model_bench`].
#[derive(Debug, Clone, PartialEq)]
pub struct DecodeFigures {
    /// Sequences per step.
    pub batch: usize,
    /// Mean wall time of one `Worker::forward_tokens` decode step, ms.
    pub step_ms: f64,
    /// Bytes the step must read: weights and every sequence's K/V (mean
    /// over the timed steps).
    pub bytes: u64,
    /// Device phase times (and host stages) of one profiled step.
    pub phases: PhaseTimes,
}

/// One timed prefill of [`model_bench`].
#[derive(Debug, Clone, PartialEq)]
pub struct PrefillFigures {
    /// Sequences.
    pub seqs: usize,
    /// Tokens per sequence.
    pub tokens: usize,
    /// Wall time of all of it, through `Worker::forward_tokens` in batches
    /// of [`PREFILL_BATCH_TOKENS`].
    pub seconds: f64,
    /// [`prefill_flops`] of every sequence.
    pub flops: f64,
    /// Device phase times (and host stages) of one more, profiled, forward
    /// of the same shape.
    pub phases: PhaseTimes,
}

/// Tokens per prefill forward in [`model_bench`].
pub const PREFILL_BATCH_TOKENS: usize = 8192;

/// What [`model_bench`] measured.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelReport {
    /// Prefills, in `prefills` order.
    pub prefills: Vec<PrefillFigures>,
    /// Decode steps, in `decode_batches` order.
    pub decodes: Vec<DecodeFigures>,
    /// Graphs captured and passes replayed from them over the whole bench.
    pub graphs: crate::backend::GraphCounts,
}

/// One table per pool window in `pools`, each `ids` from block index 0.
fn tables_from_zero(pools: &[u32], ids: &[u32]) -> Vec<TableInput> {
    pools
        .iter()
        .map(|&window| TableInput {
            window,
            beam: 0,
            first_block: 0,
            block_ids: ids.to_vec(),
        })
        .collect()
}

/// A CUDA worker for `model` (seeded weights, bf16 KV) that prefills
/// `(sequences, tokens)` for each of `prefills`, timed, then for each batch
/// of `decode_batches` prefills that many sequences to `context` tokens
/// (untimed) and times `steps` decode steps of the whole batch through
/// `Worker::forward_tokens` (validation, uploads, kernels, greedy tokens
/// back), and profiles one more (eagerly: a profiled pass is never a
/// graph's). Decode steps replay CUDA graphs when `decode_graphs`; a
/// prefill's product tiles spread over `gemm_streams` streams.
pub fn model_bench(
    model: &ModelConfig,
    prefills: &[(usize, usize)],
    decode_batches: &[usize],
    (context, steps): (usize, usize),
    (decode_graphs, gemm_streams): (bool, usize),
) -> Result<ModelReport> {
    let max_batch = decode_batches.iter().copied().max().unwrap_or(1);
    let weights = Weights::seeded(model.clone(), 3)?;
    let options = WorkerOptions {
        memory_budget_bytes: 0,
        limits: Limits {
            max_batch_sequences: max_batch.max(256),
            max_batch_tokens: PREFILL_BATCH_TOKENS.max(max_batch),
        },
        threads: 1,
        host_blocks: 0,
    };
    let gpu = CudaOptions {
        device: 0,
        kv_dtype: KvDtype::Bf16,
        memory_fraction: 0.6,
        max_kv_bytes: 0,
        decode_graphs,
        gemm_streams,
    };
    let mut worker = Worker::new_cuda(weights, options, gpu)?;
    let pools: Vec<u32> = model.pools().into_iter().map(|p| p.window).collect();
    let b = model.tokens_per_block as usize;
    let vocab = model.vocab_size as u64;
    let mut next_block = 0u32;
    let mut next_seq = 0u64;
    // A fresh sequence with room for `len` tokens in blocks nobody else holds.
    let mut new_seq = |len: usize| -> (u64, Vec<TableInput>) {
        let n = len.div_ceil(b) as u32;
        let ids: Vec<u32> = (next_block..next_block + n).collect();
        next_block += n;
        next_seq += 1;
        (next_seq, tables_from_zero(&pools, &ids))
    };
    let token = |s: u64, p: usize| ((s * 131 + p as u64 * 31) % vocab) as u32;
    let input = |s: u64, tables: &[TableInput], start: usize, end: usize| SeqInput {
        seq_id: s,
        tokens: (start..end).map(|p| token(s, p)).collect(),
        start_pos: start as u32,
        tables: tables.to_vec(),
        all_positions: false,
        logprobs: None,
        sampling: Sampling::GREEDY,
        copies: Vec::new(),
        history: None,
        grammar: None,
    };
    // Prefills `seqs` in forwards of up to PREFILL_BATCH_TOKENS tokens, in
    // chunks of at most that many per sequence; returns each one's next token.
    let prefill = |worker: &mut Worker, seqs: &[(u64, Vec<TableInput>)], len: usize| {
        let chunk = len.min(PREFILL_BATCH_TOKENS);
        let per_forward = (PREFILL_BATCH_TOKENS / chunk).max(1);
        let mut next = vec![0u32; seqs.len()];
        for (g, group) in seqs.chunks(per_forward).enumerate() {
            for start in (0..len).step_by(chunk) {
                let end = (start + chunk).min(len);
                let inputs = group
                    .iter()
                    .map(|(s, t)| input(*s, t, start, end))
                    .collect();
                for (i, out) in worker.forward_tokens(inputs)?.into_iter().enumerate() {
                    next[g * per_forward + i] = out.next_token;
                }
            }
        }
        Ok::<_, Error>(next)
    };

    let mut report = ModelReport {
        prefills: Vec::new(),
        decodes: Vec::new(),
        graphs: Default::default(),
    };
    for &(count, len) in prefills {
        let seqs: Vec<_> = (0..count).map(|_| new_seq(len)).collect();
        // One untimed forward first, so the timing starts warm.
        prefill(&mut worker, &seqs[..1], len.min(64))?;
        let t0 = Instant::now();
        prefill(&mut worker, &seqs, len)?;
        let seconds = t0.elapsed().as_secs_f64();
        let per_forward = (PREFILL_BATCH_TOKENS / len.min(PREFILL_BATCH_TOKENS)).clamp(1, count);
        let more: Vec<_> = (0..per_forward).map(|_| new_seq(len)).collect();
        worker.set_profiling(true);
        prefill(&mut worker, &more, len.min(PREFILL_BATCH_TOKENS))?;
        worker.set_profiling(false);
        report.prefills.push(PrefillFigures {
            seqs: count,
            tokens: len,
            seconds,
            flops: prefill_flops(model, len) * count as f64,
            phases: worker.last_profile().unwrap_or_default(),
        });
    }
    for &batch in decode_batches {
        let seqs: Vec<_> = (0..batch).map(|_| new_seq(context + steps + 2)).collect();
        let mut next = prefill(&mut worker, &seqs, context)?;
        let mut step = |worker: &mut Worker, pos: usize| -> Result<()> {
            let inputs = seqs
                .iter()
                .zip(&next)
                .map(|((s, t), &tok)| SeqInput {
                    seq_id: *s,
                    tokens: vec![tok],
                    start_pos: pos as u32,
                    tables: t.clone(),
                    all_positions: false,
                    logprobs: None,
                    sampling: Sampling::GREEDY,
                    copies: Vec::new(),
                    history: None,
                    grammar: None,
                })
                .collect();
            for (n, out) in next.iter_mut().zip(worker.forward_tokens(inputs)?) {
                *n = out.next_token;
            }
            Ok(())
        };
        step(&mut worker, context)?;
        let t1 = Instant::now();
        for i in 0..steps {
            step(&mut worker, context + 1 + i)?;
        }
        let elapsed = t1.elapsed().as_secs_f64();
        worker.set_profiling(true);
        step(&mut worker, context + 1 + steps)?;
        worker.set_profiling(false);
        let kv: u64 = (0..steps)
            .map(|i| kv_bytes_read(model, context + 1 + i, gpu.kv_dtype))
            .sum::<u64>()
            / steps.max(1) as u64;
        report.decodes.push(DecodeFigures {
            batch,
            step_ms: elapsed * 1e3 / steps.max(1) as f64,
            bytes: weight_bytes_per_step(model) + kv * batch as u64,
            phases: worker.last_profile().unwrap_or_default(),
        });
    }
    report.graphs = worker.graph_counts();
    Ok(report)
}

// === the host tier ===

/// One prompt length of [`host_tier_bench`].
#[derive(Debug, Clone, PartialEq)]
pub struct TierFigures {
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Full prefix blocks moved per pool (the prompt minus its last token,
    /// as much as the cache would reuse).
    pub blocks: usize,
    /// Bytes moved each way (every pool).
    pub bytes: u64,
    /// Best of the iterations: demoting the prefix (device blocks scattered).
    pub demote_ms: f64,
    /// Onboarding the prefix into scattered device blocks.
    pub onboard_ms: f64,
    /// Onboarding, then the forward of the tokens after the prefix.
    pub onboard_then_rest_ms: f64,
    /// The forward of the whole prompt (recomputing the prefix).
    pub recompute_ms: f64,
    /// Whether both ways picked the same next token.
    pub same_token: bool,
}

/// A CUDA worker for `model` (seeded weights, bf16 KV) with a host tier;
/// for each prompt length: prefill it, demote its full prefix blocks from
/// scattered device blocks, onboard them into other scattered ones and run
/// the rest of the prompt, against recomputing the whole prompt; best of
/// `iters`, through `Worker::apply_tier_copies` and
/// `Worker::forward_tokens` (validation, uploads, kernels, tokens back).
pub fn host_tier_bench(
    model: &ModelConfig,
    prompts: &[usize],
    iters: usize,
) -> Result<Vec<TierFigures>> {
    let b = model.tokens_per_block as usize;
    let longest = prompts.iter().copied().max().unwrap_or(1);
    let host_blocks = longest.div_ceil(b) as u32;
    let weights = Weights::seeded(model.clone(), 3)?;
    let options = WorkerOptions {
        memory_budget_bytes: 0,
        limits: Limits {
            max_batch_sequences: 16,
            max_batch_tokens: longest.max(1),
        },
        threads: 1,
        host_blocks,
    };
    let gpu = CudaOptions {
        device: 0,
        kv_dtype: KvDtype::Bf16,
        memory_fraction: 0.3,
        max_kv_bytes: 0,
        ..CudaOptions::default()
    };
    let mut worker = Worker::new_cuda(weights, options, gpu)?;
    let pools: Vec<u32> = model.pools().into_iter().map(|p| p.window).collect();
    let block_bytes: u64 = worker.info().pools.iter().map(|p| p.bytes_per_block).sum();
    let device_blocks = worker.info().pools[0].num_blocks as usize;
    let vocab = model.vocab_size as u64;
    let mut rng = SplitMix64::new(17);
    let mut perm: Vec<u32> = (0..device_blocks as u32).collect();
    for i in (1..perm.len()).rev() {
        perm.swap(i, (rng.next_u64() % (i as u64 + 1)) as usize);
    }
    let mut figures = Vec::new();
    for &len in prompts {
        let n = len.div_ceil(b);
        if 3 * n > device_blocks {
            return Err(Error::Backend(format!(
                "host tier bench: a {len}-token prompt needs {} device blocks, the arena has {device_blocks}",
                3 * n
            )));
        }
        let prefix = (len - 1) / b;
        // Three sequences in disjoint, shuffled device blocks.
        let ids = |k: usize| perm[k * n..(k + 1) * n].to_vec();
        let (a, onboarded, recomputed) = (ids(0), ids(1), ids(2));
        let prompt: Vec<u32> = (0..len as u64)
            .map(|p| ((p * 131 + 7) % vocab) as u32)
            .collect();
        let input = |seq_id: u64, ids: &[u32], start: usize| SeqInput {
            seq_id,
            tokens: prompt[start..].to_vec(),
            start_pos: start as u32,
            tables: tables_from_zero(&pools, ids),
            all_positions: false,
            logprobs: None,
            sampling: Sampling::GREEDY,
            copies: Vec::new(),
            history: None,
            grammar: None,
        };
        let copies = |direction: TierDirection, device: &[u32]| -> Vec<TierCopyInput> {
            pools
                .iter()
                .flat_map(|&window| {
                    device[..prefix]
                        .iter()
                        .enumerate()
                        .map(move |(i, &device_block)| TierCopyInput {
                            window,
                            direction,
                            device_block,
                            host_block: i as u32,
                            disk: Default::default(),
                        })
                })
                .collect()
        };
        let next_token = |out: Vec<crate::worker::SeqOutput>| out.first().map(|o| o.next_token);
        worker.forward_tokens(vec![input(1, &a, 0)])?;
        let (demote, onboard) = (
            copies(TierDirection::Demote, &a),
            copies(TierDirection::Onboard, &onboarded),
        );
        let mut f = TierFigures {
            prompt_tokens: len,
            blocks: prefix,
            bytes: prefix as u64 * block_bytes,
            demote_ms: f64::INFINITY,
            onboard_ms: f64::INFINITY,
            onboard_then_rest_ms: f64::INFINITY,
            recompute_ms: f64::INFINITY,
            same_token: true,
        };
        let ms = |t: Instant| t.elapsed().as_secs_f64() * 1e3;
        for _ in 0..iters.max(1) {
            let t = Instant::now();
            worker.apply_tier_copies(&demote)?;
            f.demote_ms = f.demote_ms.min(ms(t));
            let t = Instant::now();
            worker.apply_tier_copies(&onboard)?;
            f.onboard_ms = f.onboard_ms.min(ms(t));
            let rest = worker.forward_tokens(vec![input(2, &onboarded, prefix * b)])?;
            f.onboard_then_rest_ms = f.onboard_then_rest_ms.min(ms(t));
            let t = Instant::now();
            let whole = worker.forward_tokens(vec![input(3, &recomputed, 0)])?;
            f.recompute_ms = f.recompute_ms.min(ms(t));
            f.same_token &= next_token(rest) == next_token(whole);
        }
        figures.push(f);
    }
    Ok(figures)
}
