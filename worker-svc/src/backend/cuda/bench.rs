//! Measurements behind `cargo bench -p worker-svc --features cuda --bench gpu`:
//! the paged decode attention kernel against the device's copy bandwidth
//! (with a host check of its output), cuBLAS's bf16 GEMM rate, a
//! worker's prefill and whole decode steps, and its pinned host tier
//! (onboarding a prefix against recomputing it).

use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaSlice, sys::CUevent_flags};
use half::bf16;

use super::gemm::Products;
use super::kernels::{AttentionTuning, KernelShape, Kernels, group_launches, row_groups};
use super::launches::{AttentionArgs, AttnOut, Launcher};
use super::uploads::part_capacity;
use super::{KvDtype, cuda_err};
use crate::error::{Error, Result};
use crate::model::ModelConfig;
use crate::model::weights::SplitMix64;

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

/// A NaN element of `dtype`, little-endian.
fn nan_bytes(dtype: KvDtype) -> &'static [u8] {
    match dtype {
        KvDtype::Bf16 => &[0xc0, 0x7f],
        KvDtype::F16 => &[0x00, 0x7e],
        KvDtype::Fp8 => &[0x7f],
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
            attn_softcap: None,
        },
        tuning,
    )?;
    let (kernel, func) = match &kernels.paged_attention_mma {
        Some(m) if query_rows > m.pack && window == 0 => (
            format!(
                "tensor cores, {} warps x {} stages, splits of {} keys, rows in groups of {}",
                m.tuning.warps,
                m.tuning.stages,
                m.tuning.split_keys,
                m.frags * m.pack
            ),
            &m.func_rows,
        ),
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
    let elem_bytes = kv_dtype.elem_bytes() as usize;
    let mut arena = stream
        .alloc_zeros::<u8>(arena_elems * elem_bytes)
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
        let nan = nan_bytes(kv_dtype);
        for &(at, len) in &poison {
            for i in at..at + len {
                host_arena[i * elem_bytes..(i + 1) * elem_bytes].copy_from_slice(nan);
            }
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
    let group_first = row_groups(
        std::iter::repeat_n(query_rows, batch),
        kernels.max_group(window as u32, plan),
    );
    let groups = stream
        .clone_htod(&group_first)
        .map_err(cuda_err("upload"))?;
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
                groups: &groups,
                group_first: &group_first,
                window: window as u32,
                rows,
                num_heads,
                num_kv_heads,
                head_dim: d,
                scale: 1.0 / (d as f32).sqrt(),
                plan,
            },
            &mut part_o,
            &mut part_ml,
            out.map(AttnOut::F32),
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
    let kv_bytes = (batch * keys_read * num_kv_heads * d * 2 * elem_bytes) as u64;

    // Host check of the first and last sequences, every head of their last
    // (at most 32) rows.
    let mut max_err = 0.0f64;
    let mut max_ref = 0.0f64;
    let mut checked = vec![0];
    if batch > 1 {
        checked.push(batch - 1);
    }
    for s in checked {
        for j in query_rows.saturating_sub(32)..query_rows {
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
                    f64::from(kv_dtype.value(&host_arena, off))
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
        launches: group_launches(&group_first, plan.rows_per_launch).len(),
        max_rel_err: max_err / max_ref.max(1e-12),
    })
}

/// [`copy_bandwidth`] on device 0.
pub fn device_copy_bandwidth(bytes: usize, iters: usize) -> Result<f64> {
    super::probe().map_err(Error::Backend)?;
    let ctx = CudaContext::new(0).map_err(cuda_err("context"))?;
    copy_bandwidth(&ctx, bytes, iters)
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

/// bf16 × bf16 → f32 GEMM rate cuBLAS reaches here: the best of `iters`
/// calls of `m × k · (n × k)ᵀ` (the products' own configuration, one call
/// of the whole shape) on random operands, TFLOP/s.
pub fn gemm_rate(m: usize, k: usize, n: usize, iters: usize) -> Result<f64> {
    super::probe().map_err(Error::Backend)?;
    let ctx = CudaContext::new(0).map_err(cuda_err("context"))?;
    let stream = ctx.default_stream();
    let products = Products::new(&ctx, &stream, 0)?;
    let mut rng = Mix(SplitMix64::new(5));
    let mut random = |len: usize| -> Result<CudaSlice<bf16>> {
        let host: Vec<bf16> = (0..len).map(|_| bf16::from_f32(rng.unit())).collect();
        stream.clone_htod(&host).map_err(cuda_err("upload"))
    };
    let a = random(n * k)?;
    let b = random(m * k)?;
    let mut c = stream
        .alloc_zeros::<f32>(m * n)
        .map_err(cuda_err("alloc"))?;
    let timed = Some(CUevent_flags::CU_EVENT_DEFAULT);
    products.gemm(&a, &b, k, &mut c, (m, k, n), false)?;
    let mut best = f64::INFINITY;
    for _ in 0..iters {
        let start = stream.record_event(timed).map_err(cuda_err("event"))?;
        products.gemm(&a, &b, k, &mut c, (m, k, n), false)?;
        let end = stream.record_event(timed).map_err(cuda_err("event"))?;
        end.synchronize().map_err(cuda_err("synchronize"))?;
        best = best.min(f64::from(
            start.elapsed_ms(&end).map_err(cuda_err("event"))?,
        ));
    }
    Ok(2.0 * (m * n * k) as f64 / (best * 1e-3) / 1e12)
}

/// Bytes of the weights a decode step reads: every matrix (bf16) and norm
/// (f32), the LM head included; not the embedding table, of which it reads
/// one row per sequence.
pub fn weight_bytes_per_step(model: &ModelConfig) -> u64 {
    let (h, qd, kvd, f) = (
        model.hidden_size,
        model.q_dim(),
        model.kv_dim(),
        model.ffn_size,
    );
    let matrices =
        model.num_layers() * (h * (qd + 2 * kvd) + qd * h + 3 * h * f) + model.vocab_size * h;
    let norms = (2 * model.num_layers() + 1) * h;
    (matrices * 2 + norms * 4) as u64
}

/// Bytes of K and V a row at position `pos` reads from an arena of `dtype`
/// (keys `0..=pos`, every layer; the bench's models have no windows).
pub fn kv_bytes_read(model: &ModelConfig, pos: usize, dtype: KvDtype) -> u64 {
    ((pos + 1) * model.num_layers() * 2 * model.kv_dim()) as u64 * dtype.elem_bytes()
}

/// FLOPs of prefilling one sequence of `n` tokens: the products over every
/// token (the LM head over the last only) and causal attention.
pub fn prefill_flops(model: &ModelConfig, n: usize) -> f64 {
    let (h, qd, kvd, f) = (
        model.hidden_size,
        model.q_dim(),
        model.kv_dim(),
        model.ffn_size,
    );
    let per_token = model.num_layers() * (h * (qd + 2 * kvd) + qd * h + 3 * h * f);
    let pairs = n * (n + 1) / 2;
    let attention = model.num_layers() * pairs * model.num_heads * model.head_dim * 4;
    2.0 * (per_token * n + model.vocab_size * h) as f64 + attention as f64
}

/// Pinned host <-> device copy of `bytes`, best of `iters`, GB/s each way
/// (host to device, device to host), and pageable host to device for
/// comparison: the link rates the tier's copies are measured against.
pub fn host_link_rates(bytes: usize, iters: usize) -> Result<(f64, f64, f64)> {
    super::probe().map_err(Error::Backend)?;
    let ctx = CudaContext::new(0).map_err(cuda_err("context"))?;
    let stream = ctx.default_stream();
    let mut device = stream.alloc_zeros::<u8>(bytes).map_err(cuda_err("alloc"))?;
    // SAFETY: the memory is only written by the copies below, and read by
    // none on the host.
    let mut pinned =
        unsafe { ctx.alloc_pinned_with_flags::<u8>(bytes, 0) }.map_err(cuda_err("pinned alloc"))?;
    let pageable = vec![1u8; bytes];
    let timed = Some(CUevent_flags::CU_EVENT_DEFAULT);
    let best = |copy: &mut dyn FnMut() -> Result<()>| -> Result<f64> {
        let mut best = f64::INFINITY;
        for _ in 0..iters {
            let start = stream.record_event(timed).map_err(cuda_err("event"))?;
            copy()?;
            let end = stream.record_event(timed).map_err(cuda_err("event"))?;
            end.synchronize().map_err(cuda_err("synchronize"))?;
            best = best.min(f64::from(
                start.elapsed_ms(&end).map_err(cuda_err("event"))?,
            ));
        }
        Ok(bytes as f64 / (best * 1e-3) / 1e9)
    };
    let dtoh = best(&mut || {
        stream
            .memcpy_dtoh(&device, &mut pinned)
            .map_err(cuda_err("copy"))
    })?;
    let htod = best(&mut || {
        stream
            .memcpy_htod(&pinned, &mut device)
            .map_err(cuda_err("copy"))
    })?;
    let pageable_htod = best(&mut || {
        stream
            .memcpy_htod(&pageable, &mut device)
            .map_err(cuda_err("copy"))
    })?;
    Ok((htod, dtoh, pageable_htod))
}
