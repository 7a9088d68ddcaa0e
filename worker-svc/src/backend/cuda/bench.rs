//! Measurements behind `cargo bench -p worker-svc --features cuda --bench gpu`:
//! the paged decode attention kernel against the device's copy bandwidth
//! (with a host check of its output), and whole decode steps of a worker.

use std::sync::Arc;
use std::time::Instant;

use cudarc::driver::{CudaContext, CudaSlice, sys::CUevent_flags};

use super::kernels::{AttentionTuning, KernelShape, Kernels};
use super::launches::{AttentionArgs, Launcher};
use super::uploads::part_capacity;
use super::{KvDtype, cuda_err};
use crate::backend::PhaseTimes;
use crate::batch::{Limits, Sampling, SeqInput, TableInput};
use crate::error::{Error, Result};
use crate::model::ModelConfig;
use crate::model::weights::{SplitMix64, Weights};
use crate::worker::{Worker, WorkerOptions};

/// Shape of the paged attention benchmark and check.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AttentionShape {
    /// Sequences.
    pub batch: usize,
    /// Keys per sequence (positions `0..context`).
    pub context: usize,
    /// Query heads.
    pub num_heads: usize,
    /// KV heads.
    pub num_kv_heads: usize,
    /// Head width.
    pub head_dim: usize,
    /// Tokens per block.
    pub tokens_per_block: usize,
    /// Arena element type.
    pub kv_dtype: KvDtype,
    /// Sliding window (0: none): a query at `p` sees `max(0, p-W+1)..=p`.
    pub window: usize,
    /// Query rows per sequence, at the last positions (1: decode; more: a
    /// prefill chunk, causal).
    pub query_rows: usize,
}

impl AttentionShape {
    /// The decode bench's shape: batch 64, context 4096, 32 query / 8 KV
    /// heads of 128, 16 tokens per block, bf16, one query row, no window.
    pub fn decode_bench() -> Self {
        AttentionShape {
            batch: 64,
            context: 4096,
            num_heads: 32,
            num_kv_heads: 8,
            head_dim: 128,
            tokens_per_block: 16,
            kv_dtype: KvDtype::Bf16,
            window: 0,
            query_rows: 1,
        }
    }
}

/// What the paged attention benchmark measured.
#[derive(Debug, Clone, PartialEq)]
pub struct AttentionReport {
    /// Device name.
    pub device: String,
    /// Which kernel ran and its launch shape.
    pub kernel: String,
    /// Registers per thread and local (spill) bytes of that kernel.
    pub regs: i32,
    /// Local memory bytes per thread (spills) of that kernel.
    pub local_bytes: i32,
    /// Mean time of one attention call (kernel and merge), microseconds
    /// (0 when not timed).
    pub time_us: f64,
    /// K and V bytes the rows' keys span, read once.
    pub kv_bytes: u64,
    /// `kv_bytes / time`, GB/s.
    pub achieved_gbps: f64,
    /// Mean time of the attention kernel alone (no merge), microseconds.
    pub kernel_us: f64,
    /// Device-to-device copy in the same run, (read + write) GB/s (0 when
    /// not timed).
    pub copy_gbps: f64,
    /// Key splits per query row.
    pub num_splits: usize,
    /// Launches the rows took (more than one when the partials are short).
    pub launches: usize,
    /// Largest |gpu − host| over the checked rows and heads, relative to
    /// the largest |host| (NaN when any output was NaN).
    pub max_rel_err: f64,
}

/// SplitMix64, for shuffled tables and queries.
struct Mix(SplitMix64);

impl Mix {
    fn next(&mut self) -> u64 {
        self.0.next_u64()
    }

    fn unit(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 24) as f32 - 0.5
    }
}

fn kv_value(bits: u16, dtype: KvDtype) -> f64 {
    match dtype {
        KvDtype::Bf16 => f64::from(f32::from_bits(u32::from(bits) << 16)),
        KvDtype::F16 => f64::from(half::f16::from_bits(bits).to_f32()),
    }
}

fn nan_bits(dtype: KvDtype) -> u16 {
    match dtype {
        KvDtype::Bf16 => 0x7fc0,
        KvDtype::F16 => 0x7e00,
    }
}

/// [`attention`] with the default tuning, `iters` timed calls.
pub fn decode_attention(shape: AttentionShape, iters: usize) -> Result<AttentionReport> {
    attention(shape, AttentionTuning::default(), iters)
}

/// Runs paged attention at `shape` (blocks shuffled across the arena,
/// random K/V and queries) with the kernels compiled for `tuning`; when
/// `iters > 0`, times `iters` calls after a warm-up and measures the copy
/// bandwidth of a 1 GiB buffer. Checks every query row and head of the
/// first and last sequence against f64 on the host. Arena slots no query
/// may see (after the last position, blocks before a window) hold NaN, so
/// a kernel that reads them shows it.
pub fn attention(
    shape: AttentionShape,
    tuning: AttentionTuning,
    iters: usize,
) -> Result<AttentionReport> {
    let rows = shape.batch * shape.query_rows;
    attention_with_partials(shape, tuning, iters, part_capacity(rows))
}

/// [`attention`] with partials for only `part_cap` (row × split) pairs, so
/// a batch with more runs as several launches over row ranges.
pub fn attention_with_partials(
    shape: AttentionShape,
    tuning: AttentionTuning,
    iters: usize,
    part_cap: usize,
) -> Result<AttentionReport> {
    super::probe().map_err(Error::Backend)?;
    let ctx = CudaContext::new(0).map_err(cuda_err("context"))?;
    let stream = ctx.default_stream();
    let device = ctx.name().map_err(cuda_err("device name"))?;
    let sm_count = ctx
        .attribute(
            cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
        )
        .map_err(cuda_err("attribute"))?
        .max(1) as usize;
    let AttentionShape {
        batch,
        context,
        num_heads,
        num_kv_heads,
        head_dim: d,
        tokens_per_block: b,
        kv_dtype,
        window,
        query_rows,
    } = shape;
    if batch == 0 || query_rows == 0 || query_rows > context {
        return Err(Error::Config(format!(
            "attention bench: bad shape {shape:?}"
        )));
    }
    let group = num_heads / num_kv_heads;
    let kernels = Kernels::compile_tuned(
        &ctx,
        KernelShape {
            head_dim: d,
            group,
            kv_heads: num_kv_heads,
            tokens_per_block: b,
            kv_dtype,
        },
        tuning,
    )?;
    let (kernel, func) = match &kernels.paged_attention_mma {
        Some(m) => (
            format!(
                "tensor cores, {} warps x {} stages, splits of {} keys",
                m.tuning.warps, m.tuning.stages, m.tuning.split_keys
            ),
            &m.func,
        ),
        None => (
            "general (one warp per split)".to_string(),
            &kernels.paged_attention,
        ),
    };
    let regs = func.num_regs().map_err(cuda_err("attribute"))?;
    let local_bytes = func.local_size_bytes().map_err(cuda_err("attribute"))?;

    let blocks_per_seq = context.div_ceil(b);
    let total_blocks = batch * blocks_per_seq;
    let epb = 2 * num_kv_heads * b * d;
    let arena_elems = total_blocks * epb;
    let mut arena = stream
        .alloc_zeros::<u16>(arena_elems)
        .map_err(cuda_err("alloc"))?;
    let launch = Launcher {
        stream: &stream,
        kernels: &kernels,
    };
    launch.fill_random(&mut arena, 7, sm_count as u32 * 8)?;

    let mut rng = Mix(SplitMix64::new(11));
    let mut perm: Vec<u32> = (0..total_blocks as u32).collect();
    for i in (1..perm.len()).rev() {
        perm.swap(i, (rng.next() % (i as u64 + 1)) as usize);
    }
    let first_pos = context - query_rows;
    let lo_of = |pos: usize| crate::ops::window_start(pos, window as u32);
    // Each sequence's table starts at the block of its first row's window.
    let first = lo_of(first_pos) / b;
    let offs: Vec<i32> = (0..batch)
        .map(|s| (s * blocks_per_seq + first) as i32)
        .collect();
    let firsts = vec![first as i32; batch];
    let rows = batch * query_rows;
    let tok_seq: Vec<i32> = (0..rows).map(|r| (r / query_rows) as i32).collect();
    let tok_pos: Vec<i32> = (0..rows)
        .map(|r| (first_pos + r % query_rows) as i32)
        .collect();
    let qd = num_heads * d;
    let q_host: Vec<f32> = (0..rows * qd).map(|_| rng.unit() * 2.0).collect();

    // Poison what no row may read: whole blocks before `first`, and the
    // slots after the last position in the last block.
    let per_kv = num_kv_heads * b * d;
    let mut poison: Vec<(usize, usize)> = Vec::new();
    for s in 0..batch {
        for blk in 0..first {
            let at = perm[s * blocks_per_seq + blk] as usize * epb;
            poison.push((at, epb));
        }
        let tail = context % b;
        if tail != 0 {
            let at = perm[s * blocks_per_seq + blocks_per_seq - 1] as usize * epb;
            for kv in 0..2 {
                for h in 0..num_kv_heads {
                    poison.push((at + kv * per_kv + h * b * d + tail * d, (b - tail) * d));
                }
            }
        }
    }
    let mut host_arena = stream.clone_dtoh(&arena).map_err(cuda_err("download"))?;
    if !poison.is_empty() {
        let nan = nan_bits(kv_dtype);
        for &(at, len) in &poison {
            host_arena[at..at + len].fill(nan);
        }
        stream
            .memcpy_htod(&host_arena, &mut arena)
            .map_err(cuda_err("upload"))?;
    }

    let up_i32 = |v: &[i32]| stream.clone_htod(v).map_err(cuda_err("upload"));
    let tables = stream.clone_htod(&perm).map_err(cuda_err("upload"))?;
    let table_off = up_i32(&offs)?;
    let first_block = up_i32(&firsts)?;
    let tok_seq_d = up_i32(&tok_seq)?;
    let tok_pos_d = up_i32(&tok_pos)?;
    let q = stream.clone_htod(&q_host).map_err(cuda_err("upload"))?;
    let max_keys = (first_pos..context)
        .map(|p| p + 1 - lo_of(p))
        .max()
        .unwrap_or(1);
    let plan = kernels.split_plan(max_keys, part_cap);
    let zeros = |n: usize| stream.alloc_zeros::<f32>(n).map_err(cuda_err("alloc"));
    let mut part_o = zeros(rows * num_heads * plan.num_splits * d)?;
    let mut part_ml = zeros(rows * num_heads * plan.num_splits * 2)?;
    let mut out = stream
        .clone_htod(&vec![f32::NAN; rows * qd])
        .map_err(cuda_err("upload"))?;

    let mut call = |out: Option<&mut CudaSlice<f32>>| {
        launch.attention(
            AttentionArgs {
                q: &q,
                q_stride: qd,
                arena: &arena,
                layer_off: 0,
                elems_per_block: epb as i64,
                tables: &tables,
                table_off: &table_off,
                first_block: &first_block,
                tok_seq: &tok_seq_d,
                tok_pos: &tok_pos_d,
                window: window as u32,
                rows,
                num_heads,
                num_kv_heads,
                head_dim: d,
                plan,
            },
            &mut part_o,
            &mut part_ml,
            out,
            qd,
        )
    };
    call(Some(&mut out))?;
    stream.synchronize().map_err(cuda_err("synchronize"))?;
    let gpu_out = stream.clone_dtoh(&out).map_err(cuda_err("download"))?;

    let mut time_us = 0.0;
    let mut kernel_us = 0.0;
    let mut copy_gbps = 0.0;
    if iters > 0 {
        let mut timed_calls = |merge: bool| -> Result<f64> {
            for _ in 0..3 {
                call(merge.then_some(&mut out))?;
            }
            let timed = Some(CUevent_flags::CU_EVENT_DEFAULT);
            let start = stream.record_event(timed).map_err(cuda_err("event"))?;
            for _ in 0..iters {
                call(merge.then_some(&mut out))?;
            }
            let end = stream.record_event(timed).map_err(cuda_err("event"))?;
            end.synchronize().map_err(cuda_err("synchronize"))?;
            let ms = f64::from(start.elapsed_ms(&end).map_err(cuda_err("event"))?);
            Ok(ms * 1000.0 / iters as f64)
        };
        time_us = timed_calls(true)?;
        kernel_us = timed_calls(false)?;
        copy_gbps = copy_bandwidth(&ctx, 1 << 30, 10)?;
    }
    let keys_read = context - lo_of(first_pos);
    let kv_bytes = (batch * keys_read * num_kv_heads * d * 2 * 2) as u64;

    // Host check of the first and last sequences, every row and head.
    let mut max_err = 0.0f64;
    let mut max_ref = 0.0f64;
    let mut checked = vec![0];
    if batch > 1 {
        checked.push(batch - 1);
    }
    for s in checked {
        for j in 0..query_rows {
            let r = s * query_rows + j;
            let pos = first_pos + j;
            let lo = lo_of(pos);
            for head in 0..num_heads {
                let kvh = head / group;
                let qrow = &q_host[r * qd + head * d..r * qd + (head + 1) * d];
                let scale = 1.0 / (d as f64).sqrt();
                let at = |p: usize, kv: usize, i: usize| {
                    let blk = perm[s * blocks_per_seq + p / b] as usize;
                    let off = blk * epb + kv * per_kv + kvh * b * d + (p % b) * d + i;
                    kv_value(host_arena[off], kv_dtype)
                };
                let scores: Vec<f64> = (lo..=pos)
                    .map(|p| {
                        (0..d)
                            .map(|i| f64::from(qrow[i]) * at(p, 0, i))
                            .sum::<f64>()
                            * scale
                    })
                    .collect();
                let mx = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let w: Vec<f64> = scores.iter().map(|v| (v - mx).exp()).collect();
                let sum: f64 = w.iter().sum();
                for i in 0..d {
                    let o = (lo..=pos)
                        .zip(&w)
                        .map(|(p, wp)| wp * at(p, 1, i))
                        .sum::<f64>()
                        / sum;
                    let g = f64::from(gpu_out[r * qd + head * d + i]);
                    if g.is_nan() {
                        max_err = f64::NAN;
                    } else if !max_err.is_nan() {
                        max_err = max_err.max((g - o).abs());
                    }
                    max_ref = max_ref.max(o.abs());
                }
            }
        }
    }
    Ok(AttentionReport {
        device,
        kernel,
        regs,
        local_bytes,
        time_us,
        kv_bytes,
        achieved_gbps: if time_us > 0.0 {
            kv_bytes as f64 / (time_us * 1e-6) / 1e9
        } else {
            0.0
        },
        kernel_us,
        copy_gbps,
        num_splits: plan.num_splits,
        launches: rows.div_ceil(plan.rows_per_launch),
        max_rel_err: max_err / max_ref.max(1e-12),
    })
}

/// Device-to-device copy of `bytes`, best of `iters`, as (read + write) GB/s.
pub fn copy_bandwidth(ctx: &Arc<CudaContext>, bytes: usize, iters: usize) -> Result<f64> {
    let stream = ctx.default_stream();
    let src = stream.alloc_zeros::<u8>(bytes).map_err(cuda_err("alloc"))?;
    let mut dst = stream.alloc_zeros::<u8>(bytes).map_err(cuda_err("alloc"))?;
    let timed = Some(CUevent_flags::CU_EVENT_DEFAULT);
    let mut best = f64::INFINITY;
    for _ in 0..iters {
        let start = stream.record_event(timed).map_err(cuda_err("event"))?;
        stream
            .memcpy_dtod(&src, &mut dst)
            .map_err(cuda_err("copy"))?;
        let end = stream.record_event(timed).map_err(cuda_err("event"))?;
        end.synchronize().map_err(cuda_err("synchronize"))?;
        best = best.min(f64::from(
            start.elapsed_ms(&end).map_err(cuda_err("event"))?,
        ));
    }
    Ok(2.0 * bytes as f64 / (best * 1e-3) / 1e9)
}

/// What the whole-decode-step benchmark measured.
#[derive(Debug, Clone, PartialEq)]
pub struct DecodeStepReport {
    /// Mean wall time of one `Worker::forward` decode step, ms.
    pub step_ms: f64,
    /// Sequences × steps / time.
    pub tokens_per_s: f64,
    /// Device phase times of one profiled step.
    pub phases: PhaseTimes,
    /// Seconds the prefill of every sequence took.
    pub prefill_s: f64,
}

/// Prefills `batch` sequences to `context` tokens on a CUDA worker for
/// `model` (seeded weights), then times `steps` decode steps of the whole
/// batch through `Worker::forward` (validation, uploads, kernels, logits
/// back, sampling), and profiles one more.
pub fn decode_step(
    model: ModelConfig,
    batch: usize,
    context: usize,
    steps: usize,
    kv_dtype: KvDtype,
) -> Result<DecodeStepReport> {
    let prefill_chunk = 1024usize;
    let seqs_per_prefill = (4096 / prefill_chunk).max(1);
    let weights = Weights::seeded(model.clone(), 3)?;
    let options = WorkerOptions {
        memory_budget_bytes: 0,
        limits: Limits {
            max_batch_sequences: batch.max(seqs_per_prefill),
            max_batch_tokens: (seqs_per_prefill * prefill_chunk).max(batch),
        },
        threads: 1,
    };
    let gpu = super::CudaOptions {
        device: 0,
        kv_dtype,
        memory_fraction: 0.5,
        max_kv_bytes: 0,
    };
    let mut worker = Worker::new_cuda(weights, options, gpu)?;
    let b = model.tokens_per_block as usize;
    let blocks_per_seq = (context + steps + 2).div_ceil(b);
    let tables = |s: usize| -> Vec<TableInput> {
        worker_pools(&model)
            .into_iter()
            .map(|window| TableInput {
                window,
                beam: 0,
                first_block: 0,
                block_ids: (0..blocks_per_seq)
                    .map(|i| (s * blocks_per_seq + i) as u32)
                    .collect(),
            })
            .collect()
    };
    let vocab = model.vocab_size as u64;
    let token = |s: usize, p: usize| ((s as u64 * 131 + p as u64 * 31) % vocab) as u32;
    let seq = |s: usize, start: usize, tokens: Vec<u32>| SeqInput {
        seq_id: s as u64,
        tokens,
        start_pos: start as u32,
        tables: tables(s),
        all_positions: false,
        sampling: Sampling::GREEDY,
    };

    let t0 = Instant::now();
    let mut next = vec![0u32; batch];
    for first in (0..batch).step_by(seqs_per_prefill) {
        for start in (0..context).step_by(prefill_chunk) {
            let end = (start + prefill_chunk).min(context);
            let inputs = (first..(first + seqs_per_prefill).min(batch))
                .map(|s| seq(s, start, (start..end).map(|p| token(s, p)).collect()))
                .collect();
            for out in worker.forward(inputs)?.seqs {
                next[out.seq_id as usize] = out.next_token;
            }
        }
    }
    let prefill_s = t0.elapsed().as_secs_f64();

    let mut pos = context;
    let step = |worker: &mut Worker, pos: usize, next: &mut Vec<u32>| -> Result<()> {
        let inputs = (0..batch).map(|s| seq(s, pos, vec![next[s]])).collect();
        for out in worker.forward(inputs)?.seqs {
            next[out.seq_id as usize] = out.next_token;
        }
        Ok(())
    };
    step(&mut worker, pos, &mut next)?;
    pos += 1;
    let t1 = Instant::now();
    for _ in 0..steps {
        step(&mut worker, pos, &mut next)?;
        pos += 1;
    }
    let elapsed = t1.elapsed().as_secs_f64();
    worker.set_profiling(true);
    step(&mut worker, pos, &mut next)?;
    let phases = worker.last_profile().unwrap_or_default();
    Ok(DecodeStepReport {
        step_ms: elapsed * 1e3 / steps as f64,
        tokens_per_s: (batch * steps) as f64 / elapsed,
        phases,
        prefill_s,
    })
}

fn worker_pools(model: &ModelConfig) -> Vec<u32> {
    model.pools().into_iter().map(|p| p.window).collect()
}
