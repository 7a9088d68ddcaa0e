//! Measurements behind `cargo bench -p worker-svc --features cuda --bench gpu`:
//! the paged decode attention kernel against the device's copy bandwidth
//! (with a host check of its output), and whole decode steps of a worker.

use std::sync::Arc;
use std::time::Instant;

use cudarc::driver::{CudaContext, CudaSlice, LaunchConfig, PushKernelArg, sys::CUevent_flags};

use super::{
    AttentionArgs, KernelShape, Kernels, KvDtype, SplitPlan, cuda_err, launch_attention,
    part_capacity,
};
use crate::backend::PhaseTimes;
use crate::batch::{Limits, Sampling, SeqInput, TableInput};
use crate::error::{Error, Result};
use crate::model::ModelConfig;
use crate::model::weights::Weights;
use crate::worker::{Worker, WorkerOptions};

/// Shape of the decode attention benchmark.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AttentionShape {
    /// Sequences, one query row each.
    pub batch: usize,
    /// Keys per sequence.
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
}

/// What the decode attention benchmark measured.
#[derive(Debug, Clone, PartialEq)]
pub struct AttentionReport {
    /// Device name.
    pub device: String,
    /// Mean time of one decode attention (kernel and merge), microseconds.
    pub time_us: f64,
    /// K and V bytes read per call.
    pub kv_bytes: u64,
    /// `kv_bytes / time`, GB/s.
    pub achieved_gbps: f64,
    /// Device-to-device copy in the same run, (read + write) GB/s.
    pub copy_gbps: f64,
    /// Key splits per query row.
    pub num_splits: usize,
    /// Largest |gpu − host| over the checked heads, relative to the largest |host|.
    pub max_rel_err: f64,
}

/// SplitMix64, for shuffled tables and queries.
struct Mix(u64);

impl Mix {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
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

/// Times paged decode attention at `shape` (blocks shuffled across the
/// arena) over `iters` calls, measures the copy bandwidth of a 1 GiB
/// buffer, and checks the first and last sequence against f64 on the host.
pub fn decode_attention(shape: AttentionShape, iters: usize) -> Result<AttentionReport> {
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
    } = shape;
    let group = num_heads / num_kv_heads;
    let kernels = Kernels::compile(
        &ctx,
        KernelShape {
            head_dim: d,
            group,
            kv_heads: num_kv_heads,
            tokens_per_block: b,
            kv_dtype,
        },
    )?;
    let blocks_per_seq = context.div_ceil(b);
    let total_blocks = batch * blocks_per_seq;
    let epb = 2 * num_kv_heads * b * d;
    let arena_elems = total_blocks * epb;
    let mut arena = stream
        .alloc_zeros::<u16>(arena_elems)
        .map_err(cuda_err("alloc"))?;
    let n = arena_elems as i64;
    let seed = 7u32;
    // SAFETY: fill_random(kv_t*, long long, unsigned) over the whole arena.
    unsafe {
        stream
            .launch_builder(&kernels.fill_random)
            .arg(&mut arena)
            .arg(&n)
            .arg(&seed)
            .launch(LaunchConfig {
                grid_dim: (sm_count as u32 * 8, 1, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            })
            .map_err(cuda_err("fill"))?;
    }

    let mut rng = Mix(11);
    let mut perm: Vec<u32> = (0..total_blocks as u32).collect();
    for i in (1..perm.len()).rev() {
        perm.swap(i, (rng.next() % (i as u64 + 1)) as usize);
    }
    let offs: Vec<i32> = (0..batch).map(|s| (s * blocks_per_seq) as i32).collect();
    let firsts = vec![0i32; batch];
    let tok_seq: Vec<i32> = (0..batch as i32).collect();
    let tok_pos = vec![context as i32 - 1; batch];
    let qd = num_heads * d;
    let q_host: Vec<f32> = (0..batch * qd).map(|_| rng.unit() * 2.0).collect();
    let up_i32 = |v: &[i32]| stream.clone_htod(v).map_err(cuda_err("upload"));
    let tables = stream.clone_htod(&perm).map_err(cuda_err("upload"))?;
    let table_off = up_i32(&offs)?;
    let first_block = up_i32(&firsts)?;
    let tok_seq_d = up_i32(&tok_seq)?;
    let tok_pos_d = up_i32(&tok_pos)?;
    let q = stream.clone_htod(&q_host).map_err(cuda_err("upload"))?;
    let part_cap = part_capacity(batch);
    let plan = SplitPlan::new(context, batch, num_kv_heads, sm_count, part_cap);
    let zeros = |n: usize| stream.alloc_zeros::<f32>(n).map_err(cuda_err("alloc"));
    let mut part_o = zeros(batch * num_heads * plan.num_splits * d)?;
    let mut part_ml = zeros(batch * num_heads * plan.num_splits * 2)?;
    let mut out = zeros(batch * qd)?;

    let mut call = |out: &mut CudaSlice<f32>| {
        launch_attention(
            &stream,
            &kernels,
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
                window: 0,
                rows: batch,
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
    for _ in 0..3 {
        call(&mut out)?;
    }
    let timed = Some(CUevent_flags::CU_EVENT_DEFAULT);
    let start = stream.record_event(timed).map_err(cuda_err("event"))?;
    for _ in 0..iters {
        call(&mut out)?;
    }
    let end = stream.record_event(timed).map_err(cuda_err("event"))?;
    end.synchronize().map_err(cuda_err("synchronize"))?;
    let ms = f64::from(start.elapsed_ms(&end).map_err(cuda_err("event"))?);
    let time_us = ms * 1000.0 / iters as f64;
    let kv_bytes = (batch * context * num_kv_heads * d * 2 * 2) as u64;

    let copy_gbps = copy_bandwidth(&ctx, 1 << 30, 10)?;

    // Host check of the first and last sequences, every head.
    let gpu_out = stream.clone_dtoh(&out).map_err(cuda_err("download"))?;
    let host_arena = stream.clone_dtoh(&arena).map_err(cuda_err("download"))?;
    let mut max_err = 0.0f64;
    let mut max_ref = 0.0f64;
    for s in [0, batch - 1] {
        for head in 0..num_heads {
            let kvh = head / group;
            let qrow = &q_host[s * qd + head * d..s * qd + (head + 1) * d];
            let scale = 1.0 / (d as f64).sqrt();
            let at = |pos: usize, kv: usize, i: usize| {
                let blk = perm[s * blocks_per_seq + pos / b] as usize;
                let off = blk * epb + kv * num_kv_heads * b * d + kvh * b * d + (pos % b) * d + i;
                kv_value(host_arena[off], kv_dtype)
            };
            let scores: Vec<f64> = (0..context)
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
                let o = (0..context).map(|p| w[p] * at(p, 1, i)).sum::<f64>() / sum;
                let g = f64::from(gpu_out[s * qd + head * d + i]);
                max_err = max_err.max((g - o).abs());
                max_ref = max_ref.max(o.abs());
            }
        }
    }
    Ok(AttentionReport {
        device,
        time_us,
        kv_bytes,
        achieved_gbps: kv_bytes as f64 / (time_us * 1e-6) / 1e9,
        copy_gbps,
        num_splits: plan.num_splits,
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
            for out in worker.forward(inputs)? {
                next[out.seq_id as usize] = out.next_token;
            }
        }
    }
    let prefill_s = t0.elapsed().as_secs_f64();

    let mut pos = context;
    let step = |worker: &mut Worker, pos: usize, next: &mut Vec<u32>| -> Result<()> {
        let inputs = (0..batch).map(|s| seq(s, pos, vec![next[s]])).collect();
        for out in worker.forward(inputs)? {
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
