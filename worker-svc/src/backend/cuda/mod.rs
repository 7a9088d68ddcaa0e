//! The CUDA backend (feature `cuda`): weights, activations and a 16-bit KV
//! arena (f16 or bf16) in device memory; kernels compiled at start-up with
//! NVRTC (`kernels.cu`: embedding, RMSNorm, RoPE, SwiGLU, K/V scatter into
//! the leased slots, split-key paged attention for decode and prefill rows
//! with per-layer windows — on the tensor cores for head widths 64 and 128,
//! see [`AttentionTuning`] — and the merge of the splits); matrix products
//! as f32 cuBLAS GEMMs over every token of the batch.
//!
//! `cudarc` loads libcuda, NVRTC and cuBLAS at run time, so building needs no
//! CUDA toolkit; [`probe`] checks for the driver and a device before anything
//! touches them (cudarc panics when libcuda is missing).

pub mod bench;

use std::sync::Arc;
use std::time::Instant;

use cudarc::cublas::{CudaBlas, Gemm, GemmConfig, sys::cublasOperation_t};
use cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, CudaStream, CudaView, CudaViewMut, LaunchConfig,
    PushKernelArg, sys::CUdevice_attribute, sys::CUevent_flags, sys::CUfunction_attribute,
};
use cudarc::nvrtc::CompileOptions;

use super::{Backend, BatchLogits, HostTimes, PhaseTimes};
pub use super::{CudaOptions, GPU_KV_ELEM_BYTES, KvDtype};
use crate::arena::ArenaLayout;
use crate::batch::Batch;
use crate::error::{Error, Result};
use crate::model::ModelConfig;
use crate::model::weights::Weights;

const KERNELS: &str = include_str!("kernels.cu");

/// Keys per tile of the tensor-core attention kernel.
const MMA_TILE: usize = 16;

/// Launch shape of the tensor-core paged attention kernel
/// (`paged_attention_mma`), used where the model allows it: head width 64
/// or 128, at most 8 query heads per KV head, compute capability 8.0 or
/// newer. Elsewhere the general kernel runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AttentionTuning {
    /// Use the tensor-core kernel where the shape allows (else always the
    /// general one).
    pub tensor_cores: bool,
    /// Warps per CTA; each streams its own tiles of the CTA's key split.
    pub warps: usize,
    /// cp.async stages (16-key K and V tiles) per warp.
    pub stages: usize,
    /// Keys per split of a query row (a multiple of 32). A constant of the
    /// worker, never derived from the batch: a row's splits start at its
    /// window start and every `split_keys` after, so the row is computed the
    /// same way whatever shares the launch (batch-invariant results, which
    /// exact prefix reuse needs).
    pub split_keys: usize,
}

impl Default for AttentionTuning {
    fn default() -> Self {
        AttentionTuning {
            tensor_cores: true,
            warps: 4,
            stages: 3,
            split_keys: 512,
        }
    }
}

/// The tensor-core attention kernel and how it is launched.
#[derive(Debug)]
pub(crate) struct MmaAttention {
    pub(crate) func: CudaFunction,
    pub(crate) tuning: AttentionTuning,
    /// Dynamic shared memory per CTA.
    pub(crate) smem_bytes: u32,
}

/// Checks that libcuda loads and that a device exists; the reason otherwise.
pub fn probe() -> std::result::Result<(), String> {
    // SAFETY: only tries to dlopen the library; no symbol is used.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Err("libcuda (the NVIDIA driver library) is not present".into());
    }
    // SAFETY: as above, for NVRTC and cuBLAS.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        return Err("libnvrtc (CUDA run-time compiler) is not present".into());
    }
    // SAFETY: as above.
    if !unsafe { cudarc::cublas::sys::is_culib_present() } {
        return Err("libcublas is not present".into());
    }
    match CudaContext::device_count() {
        Ok(n) if n > 0 => Ok(()),
        Ok(_) => Err("no CUDA device found".into()),
        Err(e) => Err(format!("cannot query CUDA devices: {e}")),
    }
}

fn cuda_err(what: &str) -> impl Fn(cudarc::driver::DriverError) -> Error + '_ {
    move |e| Error::Backend(format!("cuda {what}: {e}"))
}

fn blas_err(e: cudarc::cublas::result::CublasError) -> Error {
    Error::Backend(format!("cublas: {e}"))
}

/// The compiled kernels of one model shape.
#[derive(Debug)]
pub(crate) struct Kernels {
    embed: CudaFunction,
    rms_norm: CudaFunction,
    rope: CudaFunction,
    swiglu: CudaFunction,
    write_kv: CudaFunction,
    pub(crate) paged_attention: CudaFunction,
    pub(crate) paged_attention_mma: Option<MmaAttention>,
    /// [`AttentionTuning::split_keys`], for both attention kernels.
    pub(crate) split_keys: usize,
    pub(crate) attention_combine: CudaFunction,
    pub(crate) fill_random: CudaFunction,
}

/// The compile-time constants of the kernels.
#[derive(Debug, Clone, Copy)]
pub(crate) struct KernelShape {
    pub(crate) head_dim: usize,
    pub(crate) group: usize,
    pub(crate) kv_heads: usize,
    pub(crate) tokens_per_block: usize,
    pub(crate) kv_dtype: KvDtype,
}

impl Kernels {
    pub(crate) fn compile(ctx: &Arc<CudaContext>, shape: KernelShape) -> Result<Self> {
        Self::compile_tuned(ctx, shape, AttentionTuning::default())
    }

    pub(crate) fn compile_tuned(
        ctx: &Arc<CudaContext>,
        shape: KernelShape,
        tuning: AttentionTuning,
    ) -> Result<Self> {
        let dtype = match shape.kv_dtype {
            KvDtype::F16 => "KV_F16",
            KvDtype::Bf16 => "KV_BF16",
        };
        let (major, minor) = ctx
            .compute_capability()
            .map_err(cuda_err("compute capability"))?;
        // The tensor-core kernel: its shared memory is the warps' pipelines
        // (K and V tiles of 16 keys), reused at the end for the warps' merge.
        let smem_optin = ctx
            .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)
            .map_err(cuda_err("attribute"))?
            .max(0) as usize;
        if tuning.split_keys == 0 || !tuning.split_keys.is_multiple_of(32) {
            return Err(Error::Config(format!(
                "attention split of {} keys: must be a positive multiple of 32",
                tuning.split_keys
            )));
        }
        let (warps, stages) = (tuning.warps.max(1), tuning.stages.max(2));
        let pipeline_bytes =
            warps * stages * 2 * MMA_TILE * shape.head_dim * GPU_KV_ELEM_BYTES as usize;
        let merge_bytes = warps * shape.group * (shape.head_dim + 4) * 4;
        let mma_smem = pipeline_bytes.max(merge_bytes);
        let use_mma = tuning.tensor_cores
            && major >= 8
            && matches!(shape.head_dim, 64 | 128)
            && shape.group <= 8
            && warps <= 16
            && mma_smem <= smem_optin;
        let mma_defines = if use_mma {
            format!("#define ATTN_MMA 1\n#define MMA_WARPS {warps}\n#define MMA_STAGES {stages}\n")
        } else {
            String::new()
        };
        let src = format!(
            "#define HEAD_DIM {}\n#define GROUP {}\n#define KV_HEADS {}\n#define TOKENS_PER_BLOCK {}\n#define {dtype} 1\n{mma_defines}{KERNELS}",
            shape.head_dim, shape.group, shape.kv_heads, shape.tokens_per_block
        );
        let arch = match (major, minor) {
            (9, 0) => Some("compute_90"),
            (8, 0) => Some("compute_80"),
            (8, 6) => Some("compute_86"),
            (8, 9) => Some("compute_89"),
            _ => None,
        };
        let opts = CompileOptions {
            arch,
            ..Default::default()
        };
        let ptx = cudarc::nvrtc::compile_ptx_with_opts(src, opts)
            .map_err(|e| Error::Backend(format!("nvrtc: {e}")))?;
        let module = ctx.load_module(ptx).map_err(cuda_err("load module"))?;
        let f = |name: &str| {
            module
                .load_function(name)
                .map_err(cuda_err("load function"))
        };
        let paged_attention_mma = if use_mma {
            let func = f("paged_attention_mma")?;
            func.set_attribute(
                CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                mma_smem as i32,
            )
            .map_err(cuda_err("shared memory limit"))?;
            Some(MmaAttention {
                func,
                tuning: AttentionTuning {
                    warps,
                    stages,
                    ..tuning
                },
                smem_bytes: mma_smem as u32,
            })
        } else {
            None
        };
        Ok(Kernels {
            embed: f("embed")?,
            rms_norm: f("rms_norm")?,
            rope: f("rope")?,
            swiglu: f("swiglu")?,
            write_kv: f("write_kv")?,
            paged_attention: f("paged_attention")?,
            paged_attention_mma,
            split_keys: tuning.split_keys,
            attention_combine: f("attention_combine")?,
            fill_random: f("fill_random")?,
        })
    }
}

#[derive(Debug)]
struct DeviceLayer {
    attn_norm: CudaSlice<f32>,
    wqkv: CudaSlice<f32>,
    wo: CudaSlice<f32>,
    mlp_norm: CudaSlice<f32>,
    w_gate_up: CudaSlice<f32>,
    w_down: CudaSlice<f32>,
}

#[derive(Debug)]
struct DeviceWeights {
    embed: CudaSlice<f32>,
    layers: Vec<DeviceLayer>,
    final_norm: CudaSlice<f32>,
    lm_head: Option<CudaSlice<f32>>,
}

/// Activation buffers, allocated once for the largest batch.
#[derive(Debug)]
struct Activations {
    x: CudaSlice<f32>,
    normed: CudaSlice<f32>,
    qkv: CudaSlice<f32>,
    attn: CudaSlice<f32>,
    gate_up: CudaSlice<f32>,
    final_rows: CudaSlice<f32>,
    logits: CudaSlice<f32>,
    part_o: CudaSlice<f32>,
    part_ml: CudaSlice<f32>,
    inv_freq: CudaSlice<f32>,
}

/// (query row × split) pairs the attention partials hold.
fn part_capacity(max_tokens: usize) -> usize {
    max_tokens.max(4096)
}

/// The CUDA backend.
#[derive(Debug)]
pub struct CudaBackend {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    blas: CudaBlas,
    kernels: Kernels,
    config: ModelConfig,
    layout: ArenaLayout,
    weights: DeviceWeights,
    acts: Activations,
    kv: Vec<CudaSlice<u16>>,
    kv_dtype: KvDtype,
    part_cap: usize,
    device_name: String,
    weight_bytes: u64,
    activation_bytes: u64,
    profiling: bool,
    last_profile: Option<PhaseTimes>,
}

/// What sizing found: the device's memory and what the arena got.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceSizing {
    /// Bytes of weights uploaded.
    pub weight_bytes: u64,
    /// Bytes of activation buffers for the largest batch.
    pub activation_bytes: u64,
    /// Free device bytes after both.
    pub free_bytes: u64,
    /// Bytes given to the arena (free × fraction, whole blocks).
    pub kv_bytes: u64,
}

/// Which part of the pass a stretch of device time belongs to.
#[derive(Debug, Clone, Copy)]
enum Phase {
    Matmul,
    Attention,
    Other,
}

impl CudaBackend {
    /// Uploads `weights`, allocates activations for `max_tokens` rows, then
    /// sizes the arena from the device's free memory: `num_blocks` when
    /// given, else `free × options.memory_fraction` (at most
    /// `options.max_kv_bytes` when that is set) split across pools by layer
    /// count.
    pub fn new(
        weights: Weights,
        max_tokens: usize,
        options: CudaOptions,
        num_blocks: Option<&[u32]>,
    ) -> Result<(Self, DeviceSizing)> {
        probe().map_err(|reason| Error::Config(format!("cuda backend unavailable: {reason}")))?;
        if !(options.memory_fraction > 0.0 && options.memory_fraction <= 1.0) {
            return Err(Error::Config(format!(
                "gpu memory fraction {} must be in (0, 1]",
                options.memory_fraction
            )));
        }
        let cfg = weights.config.clone();
        let group = cfg.num_heads / cfg.num_kv_heads;
        if cfg.head_dim > 256 || group > 8 {
            return Err(Error::Config(format!(
                "the cuda backend supports head_dim up to 256 and up to 8 query heads per KV \
                 head (got head_dim {}, {group} per KV head)",
                cfg.head_dim
            )));
        }
        let ctx = CudaContext::new(options.device).map_err(cuda_err("context"))?;
        let stream = ctx.default_stream();
        let blas = CudaBlas::new(stream.clone()).map_err(blas_err)?;
        let kernels = Kernels::compile(
            &ctx,
            KernelShape {
                head_dim: cfg.head_dim,
                group,
                kv_heads: cfg.num_kv_heads,
                tokens_per_block: cfg.tokens_per_block as usize,
                kv_dtype: options.kv_dtype,
            },
        )?;
        let device_name = ctx.name().map_err(cuda_err("device name"))?;

        let weight_bytes = weights.bytes();
        let up = |v: &[f32]| stream.clone_htod(v).map_err(cuda_err("upload"));
        let layers = weights
            .layers
            .iter()
            .map(|l| {
                Ok(DeviceLayer {
                    attn_norm: up(&l.attn_norm)?,
                    wqkv: up(&[l.wq.as_slice(), &l.wk, &l.wv].concat())?,
                    wo: up(&l.wo)?,
                    mlp_norm: up(&l.mlp_norm)?,
                    w_gate_up: up(&[l.w_gate.as_slice(), &l.w_up].concat())?,
                    w_down: up(&l.w_down)?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let dev_weights = DeviceWeights {
            embed: up(&weights.embed)?,
            layers,
            final_norm: up(&weights.final_norm)?,
            lm_head: weights.lm_head.as_deref().map(up).transpose()?,
        };

        let (h, qd, kvd, f, d) = (
            cfg.hidden_size,
            cfg.q_dim(),
            cfg.kv_dim(),
            cfg.ffn_size,
            cfg.head_dim,
        );
        // Activations have whole GEMM_ROWS calls of rows (see `linear`).
        let t = padded_rows(max_tokens.max(1));
        let part_cap = part_capacity(t);
        let zeros = |n: usize| stream.alloc_zeros::<f32>(n).map_err(cuda_err("alloc"));
        let inv_freq: Vec<f32> = (0..d / 2)
            .map(|i| (1.0 / f64::from(cfg.rope_theta).powf(2.0 * i as f64 / d as f64)) as f32)
            .collect();
        let acts = Activations {
            x: zeros(t * h)?,
            normed: zeros(t * h)?,
            qkv: zeros(t * (qd + 2 * kvd))?,
            attn: zeros(t * qd)?,
            gate_up: zeros(t * 2 * f)?,
            final_rows: zeros(t * h)?,
            logits: zeros(t * cfg.vocab_size)?,
            part_o: zeros(part_cap * cfg.num_heads * d)?,
            part_ml: zeros(part_cap * cfg.num_heads * 2)?,
            inv_freq: up(&inv_freq)?,
        };
        let activation_floats = t * (3 * h + qd + 2 * kvd + qd + 2 * f + cfg.vocab_size)
            + part_cap * cfg.num_heads * (d + 2)
            + d / 2;
        let activation_bytes = activation_floats as u64 * 4;
        stream.synchronize().map_err(cuda_err("synchronize"))?;

        let (free, _total) = ctx.mem_get_info().map_err(cuda_err("memory info"))?;
        let free_bytes = free as u64;
        let mut kv_budget = (free_bytes as f64 * options.memory_fraction) as u64;
        if options.max_kv_bytes > 0 {
            kv_budget = kv_budget.min(options.max_kv_bytes);
        }
        let blocks = match num_blocks {
            Some(b) => b.to_vec(),
            None => crate::worker::split_kv_bytes(&cfg, kv_budget, GPU_KV_ELEM_BYTES).ok_or(
                Error::MemoryBudget {
                    budget_bytes: weight_bytes + activation_bytes + kv_budget,
                    weight_bytes,
                    activation_bytes,
                },
            )?,
        };
        let layout = ArenaLayout::new(&cfg, &blocks);
        let kv = layout
            .pools
            .iter()
            .map(|p| {
                stream
                    .alloc_zeros::<u16>(p.elems())
                    .map_err(cuda_err("arena alloc"))
            })
            .collect::<Result<Vec<_>>>()?;
        let sizing = DeviceSizing {
            weight_bytes,
            activation_bytes,
            free_bytes,
            kv_bytes: layout.bytes_with(GPU_KV_ELEM_BYTES),
        };
        Ok((
            CudaBackend {
                ctx,
                stream,
                blas,
                kernels,
                config: cfg,
                layout,
                weights: dev_weights,
                acts,
                kv,
                kv_dtype: options.kv_dtype,
                part_cap,
                device_name,
                weight_bytes,
                activation_bytes,
                profiling: false,
                last_profile: None,
            },
            sizing,
        ))
    }

    /// The arena layout the backend allocated.
    pub fn layout(&self) -> &ArenaLayout {
        &self.layout
    }

    /// Bytes of the weights on the device.
    pub fn weight_bytes(&self) -> u64 {
        self.weight_bytes
    }

    /// Bytes of the activation buffers.
    pub fn activation_bytes(&self) -> u64 {
        self.activation_bytes
    }

    fn run(&mut self, batch: &Batch) -> Result<BatchLogits> {
        let t_start = Instant::now();
        let cfg = &self.config;
        let (h, qd, kvd, f, d) = (
            cfg.hidden_size,
            cfg.q_dim(),
            cfg.kv_dim(),
            cfg.ffn_size,
            cfg.head_dim,
        );
        let qkv_dim = qd + 2 * kvd;
        let t = batch.total_tokens();
        // Rows the products run over (see `linear`).
        let tp = padded_rows(t);
        let b = cfg.tokens_per_block as usize;
        let eps = cfg.rms_norm_eps;
        let vocab = cfg.vocab_size;

        // Per-row and per-sequence metadata.
        let mut tokens = Vec::with_capacity(t);
        let mut positions = Vec::with_capacity(t);
        let mut tok_seq = Vec::with_capacity(t);
        let mut logit_rows: Vec<u32> = Vec::new();
        for (s, seq) in batch.seqs.iter().enumerate() {
            let row0 = tokens.len();
            tokens.extend(seq.tokens.iter().copied());
            positions.extend((seq.start_pos..seq.start_pos + seq.tokens.len()).map(|p| p as i32));
            tok_seq.extend(std::iter::repeat_n(s as i32, seq.tokens.len()));
            let n = seq.tokens.len();
            logit_rows.extend(((row0 + n - seq.logit_rows())..(row0 + n)).map(|r| r as u32));
        }
        let r_rows = logit_rows.len();
        let upload = |stream: &Arc<CudaStream>, err: &'static str| {
            let stream = stream.clone();
            move |v: &[u32]| stream.clone_htod(v).map_err(cuda_err(err))
        };
        let up_u32 = upload(&self.stream, "upload batch");
        let tokens_d = up_u32(&tokens)?;
        let rows_d = up_u32(&logit_rows)?;
        let up_i32 = |v: &[i32]| self.stream.clone_htod(v).map_err(cuda_err("upload batch"));
        let positions_d = up_i32(&positions)?;
        let tok_seq_d = up_i32(&tok_seq)?;

        // Per pool: flat tables, where each sequence's starts, and the
        // element offset of every row's (block, slot).
        struct PoolBatch {
            tables: CudaSlice<u32>,
            table_off: CudaSlice<i32>,
            first_block: CudaSlice<i32>,
            dst_base: CudaSlice<i64>,
            max_keys: usize,
        }
        let mut pools = Vec::with_capacity(self.layout.pools.len());
        for (pi, geometry) in self.layout.pools.iter().enumerate() {
            let mut flat = Vec::new();
            let mut offs = Vec::with_capacity(batch.seqs.len());
            let mut firsts = Vec::with_capacity(batch.seqs.len());
            let mut dst = Vec::with_capacity(t);
            let mut max_keys = 1;
            let epb = geometry.elems_per_block() as i64;
            for seq in &batch.seqs {
                let table = &seq.tables[pi];
                offs.push(flat.len() as i32);
                firsts.push(table.first_block as i32);
                flat.extend(table.block_ids.iter().copied());
                for pos in seq.start_pos..seq.start_pos + seq.tokens.len() {
                    let block = table.block_for(pos, b);
                    dst.push(i64::from(block) * epb + ((pos % b) * d) as i64);
                    let lo = crate::ops::window_start(pos, geometry.window);
                    max_keys = max_keys.max(pos + 1 - lo);
                }
            }
            if flat.is_empty() {
                flat.push(0);
            }
            pools.push(PoolBatch {
                tables: up_u32(&flat)?,
                table_off: up_i32(&offs)?,
                first_block: up_i32(&firsts)?,
                dst_base: self
                    .stream
                    .clone_htod(&dst)
                    .map_err(cuda_err("upload batch"))?,
                max_keys,
            });
        }

        let t_uploaded = Instant::now();
        let mut marks: Vec<(Phase, cudarc::driver::CudaEvent)> = Vec::new();
        let start = if self.profiling {
            Some(
                self.stream
                    .record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
                    .map_err(cuda_err("event"))?,
            )
        } else {
            None
        };
        let profiling = self.profiling;
        let stream = self.stream.clone();
        let mut mark = |phase: Phase| -> Result<()> {
            if profiling {
                let e = stream
                    .record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
                    .map_err(cuda_err("event"))?;
                marks.push((phase, e));
            }
            Ok(())
        };

        let k = &self.kernels;
        let acts = &mut self.acts;
        let rows_cfg = |threads: u32| LaunchConfig {
            grid_dim: (t as u32, 1, 1),
            block_dim: (threads, 1, 1),
            shared_mem_bytes: 0,
        };
        let (h_i, qkv_i, qd_i, f_i) = (h as i32, qkv_dim as i32, qd as i32, f as i32);
        let zero = 0i32;
        let one = 1i32;
        // SAFETY (every launch below): the arguments match the kernel's
        // parameters in kernels.cu, and every buffer holds at least the rows
        // the grid touches (t ≤ max_tokens, validated table indices).
        unsafe {
            self.stream
                .launch_builder(&k.embed)
                .arg(&self.weights.embed)
                .arg(&tokens_d)
                .arg(&mut acts.x)
                .arg(&h_i)
                .launch(rows_cfg(256))
                .map_err(cuda_err("embed"))?;
        }
        mark(Phase::Other)?;

        for (layer, lw) in self.weights.layers.iter().enumerate() {
            let (pi, layer_slot) = self.layout.layer_slots[layer];
            let geometry = &self.layout.pools[pi];
            let pool = &pools[pi];
            let layer_off = (layer_slot * 2 * kvd * b) as i64;
            unsafe {
                self.stream
                    .launch_builder(&k.rms_norm)
                    .arg(&acts.x)
                    .arg(&rows_d)
                    .arg(&zero)
                    .arg(&lw.attn_norm)
                    .arg(&mut acts.normed)
                    .arg(&h_i)
                    .arg(&eps)
                    .launch(rows_cfg(256))
                    .map_err(cuda_err("rms_norm"))?;
            }
            mark(Phase::Other)?;
            linear(
                &self.blas,
                &acts.normed.slice(..tp * h),
                h,
                &lw.wqkv,
                &mut acts.qkv.slice_mut(..tp * qkv_dim),
                (t, h, qkv_dim),
                false,
            )?;
            mark(Phase::Matmul)?;
            let rope_heads = (cfg.num_heads + cfg.num_kv_heads) as i32;
            unsafe {
                self.stream
                    .launch_builder(&k.rope)
                    .arg(&mut acts.qkv)
                    .arg(&qkv_i)
                    .arg(&rope_heads)
                    .arg(&positions_d)
                    .arg(&acts.inv_freq)
                    .launch(rows_cfg(128))
                    .map_err(cuda_err("rope"))?;
                self.stream
                    .launch_builder(&k.write_kv)
                    .arg(&acts.qkv)
                    .arg(&qkv_i)
                    .arg(&qd_i)
                    .arg(&pool.dst_base)
                    .arg(&layer_off)
                    .arg(&mut self.kv[pi])
                    .launch(rows_cfg(128))
                    .map_err(cuda_err("write_kv"))?;
            }
            mark(Phase::Other)?;
            let plan = k.split_plan(pool.max_keys, self.part_cap);
            launch_attention(
                &self.stream,
                k,
                AttentionArgs {
                    q: &acts.qkv,
                    q_stride: qkv_dim,
                    arena: &self.kv[pi],
                    layer_off,
                    elems_per_block: geometry.elems_per_block() as i64,
                    tables: &pool.tables,
                    table_off: &pool.table_off,
                    first_block: &pool.first_block,
                    tok_seq: &tok_seq_d,
                    tok_pos: &positions_d,
                    window: geometry.window,
                    rows: t,
                    num_heads: cfg.num_heads,
                    num_kv_heads: cfg.num_kv_heads,
                    head_dim: d,
                    plan,
                },
                &mut acts.part_o,
                &mut acts.part_ml,
                Some(&mut acts.attn),
                qd,
            )?;
            mark(Phase::Attention)?;
            linear(
                &self.blas,
                &acts.attn.slice(..tp * qd),
                qd,
                &lw.wo,
                &mut acts.x.slice_mut(..tp * h),
                (t, qd, h),
                true,
            )?;
            mark(Phase::Matmul)?;
            unsafe {
                self.stream
                    .launch_builder(&k.rms_norm)
                    .arg(&acts.x)
                    .arg(&rows_d)
                    .arg(&zero)
                    .arg(&lw.mlp_norm)
                    .arg(&mut acts.normed)
                    .arg(&h_i)
                    .arg(&eps)
                    .launch(rows_cfg(256))
                    .map_err(cuda_err("rms_norm"))?;
            }
            mark(Phase::Other)?;
            linear(
                &self.blas,
                &acts.normed.slice(..tp * h),
                h,
                &lw.w_gate_up,
                &mut acts.gate_up.slice_mut(..tp * 2 * f),
                (t, h, 2 * f),
                false,
            )?;
            mark(Phase::Matmul)?;
            let n = (t * f) as i32;
            unsafe {
                self.stream
                    .launch_builder(&k.swiglu)
                    .arg(&mut acts.gate_up)
                    .arg(&f_i)
                    .arg(&n)
                    .launch(LaunchConfig::for_num_elems(n as u32))
                    .map_err(cuda_err("swiglu"))?;
            }
            mark(Phase::Other)?;
            linear(
                &self.blas,
                &acts.gate_up.slice(..tp * 2 * f),
                2 * f,
                &lw.w_down,
                &mut acts.x.slice_mut(..tp * h),
                (t, f, h),
                true,
            )?;
            mark(Phase::Matmul)?;
        }

        unsafe {
            self.stream
                .launch_builder(&k.rms_norm)
                .arg(&acts.x)
                .arg(&rows_d)
                .arg(&one)
                .arg(&self.weights.final_norm)
                .arg(&mut acts.final_rows)
                .arg(&h_i)
                .arg(&eps)
                .launch(LaunchConfig {
                    grid_dim: (r_rows as u32, 1, 1),
                    block_dim: (256, 1, 1),
                    shared_mem_bytes: 0,
                })
                .map_err(cuda_err("rms_norm"))?;
        }
        mark(Phase::Other)?;
        let head = self.weights.lm_head.as_ref().unwrap_or(&self.weights.embed);
        linear(
            &self.blas,
            &acts.final_rows.slice(..padded_rows(r_rows) * h),
            h,
            head,
            &mut acts.logits.slice_mut(..padded_rows(r_rows) * vocab),
            (r_rows, h, vocab),
            false,
        )?;
        mark(Phase::Matmul)?;
        let t_launched = Instant::now();
        let values = self
            .stream
            .clone_dtoh(&acts.logits.slice(..r_rows * vocab))
            .map_err(cuda_err("download logits"))?;
        let t_downloaded = Instant::now();
        if let Some(start) = start {
            self.stream.synchronize().map_err(cuda_err("synchronize"))?;
            let ms = |a: Instant, b: Instant| (b - a).as_secs_f64() * 1e3;
            let mut times = PhaseTimes {
                host: HostTimes {
                    upload_ms: ms(t_start, t_uploaded),
                    launch_ms: ms(t_uploaded, t_launched),
                    download_ms: ms(t_launched, t_downloaded),
                    ..HostTimes::default()
                },
                ..PhaseTimes::default()
            };
            let mut prev = &start;
            for (phase, e) in &marks {
                let ms = f64::from(prev.elapsed_ms(e).map_err(cuda_err("event"))?);
                match phase {
                    Phase::Matmul => times.matmul_ms += ms,
                    Phase::Attention => times.attention_ms += ms,
                    Phase::Other => times.other_ms += ms,
                }
                prev = e;
            }
            self.last_profile = Some(times);
        }
        Ok(BatchLogits { vocab, values })
    }
}

/// Rows per cuBLAS call. cuBLAS picks its kernel (tile shape, split-K) from
/// the problem's shape, and kernels sum in different orders; every product
/// here runs as calls of exactly this many rows (the activation buffers are
/// padded to a multiple), so a row takes the same kernel and the same
/// summation order whatever other rows share the pass. That keeps a token's
/// results independent of its batch, which exact prefix reuse needs. A
/// decode batch of up to this many sequences is one call, as before.
const GEMM_ROWS: usize = 64;

/// `rows` rounded up to whole [`GEMM_ROWS`] calls.
fn padded_rows(rows: usize) -> usize {
    rows.next_multiple_of(GEMM_ROWS)
}

/// `out[t × n] (+)= x[t × k] (row stride ldx) · w[n × k]ᵀ`, row-major, f32,
/// as calls of [`GEMM_ROWS`] rows; `x` and `out` hold [`padded_rows`]`(t)`
/// rows (what the padding rows compute is never read).
fn linear(
    blas: &CudaBlas,
    x: &CudaView<'_, f32>,
    ldx: usize,
    w: &CudaSlice<f32>,
    out: &mut CudaViewMut<'_, f32>,
    (t, k, n): (usize, usize, usize),
    accumulate: bool,
) -> Result<()> {
    let rows = padded_rows(t);
    if rows == 0 {
        return Ok(());
    }
    if x.len() < (rows - 1) * ldx + k || out.len() < rows * n || w.len() < n * k {
        return Err(Error::Backend(format!(
            "linear ({t} x {k}) · ({n} x {k})ᵀ: buffers of {} / {} / {} elements are short of {rows} padded rows",
            x.len(),
            w.len(),
            out.len()
        )));
    }
    // Column-major view: out (n × GEMM_ROWS) = wᵀ (n × k) · x (k × GEMM_ROWS).
    let cfg = GemmConfig {
        transa: cublasOperation_t::CUBLAS_OP_T,
        transb: cublasOperation_t::CUBLAS_OP_N,
        m: n as i32,
        n: GEMM_ROWS as i32,
        k: k as i32,
        alpha: 1.0f32,
        lda: k as i32,
        ldb: ldx as i32,
        beta: if accumulate { 1.0 } else { 0.0 },
        ldc: n as i32,
    };
    for r0 in (0..rows).step_by(GEMM_ROWS) {
        let xs = x.slice(r0 * ldx..(r0 + GEMM_ROWS - 1) * ldx + k);
        let mut os = out.slice_mut(r0 * n..(r0 + GEMM_ROWS) * n);
        // SAFETY: checked above: w holds n × k, xs GEMM_ROWS rows of stride
        // ldx ≥ k, os GEMM_ROWS × n.
        unsafe { blas.gemm(cfg, w, &xs, &mut os) }.map_err(blas_err)?;
    }
    Ok(())
}

/// How one attention launch splits its keys: each row's keys, from its own
/// window start, in splits of [`Kernels::split_keys`] (see
/// [`AttentionTuning::split_keys`]); rows × splits stay within the partials'
/// capacity by running a long batch as several launches over row ranges.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct SplitPlan {
    pub(crate) num_splits: usize,
    pub(crate) split_len: usize,
    pub(crate) rows_per_launch: usize,
}

impl Kernels {
    /// The split plan for rows of at most `max_keys` keys each, with partials
    /// for `part_cap` (row × split) pairs.
    pub(crate) fn split_plan(&self, max_keys: usize, part_cap: usize) -> SplitPlan {
        // The tensor-core kernel walks 16-key tiles from the tile of a row's
        // window start, so a row of `max_keys` keys spans up to
        // `(max_keys + 30) / 16` tiles.
        let span = if self.paged_attention_mma.is_some() {
            (max_keys + 2 * MMA_TILE - 2) / MMA_TILE * MMA_TILE
        } else {
            max_keys
        };
        let num_splits = span.div_ceil(self.split_keys).max(1);
        SplitPlan {
            num_splits,
            split_len: self.split_keys,
            rows_per_launch: (part_cap / num_splits).max(1),
        }
    }
}

/// Inputs of one paged-attention launch.
pub(crate) struct AttentionArgs<'a> {
    pub(crate) q: &'a CudaSlice<f32>,
    pub(crate) q_stride: usize,
    pub(crate) arena: &'a CudaSlice<u16>,
    pub(crate) layer_off: i64,
    pub(crate) elems_per_block: i64,
    pub(crate) tables: &'a CudaSlice<u32>,
    pub(crate) table_off: &'a CudaSlice<i32>,
    pub(crate) first_block: &'a CudaSlice<i32>,
    pub(crate) tok_seq: &'a CudaSlice<i32>,
    pub(crate) tok_pos: &'a CudaSlice<i32>,
    pub(crate) window: u32,
    pub(crate) rows: usize,
    pub(crate) num_heads: usize,
    pub(crate) num_kv_heads: usize,
    pub(crate) head_dim: usize,
    pub(crate) plan: SplitPlan,
}

/// Paged attention, then the merge of its splits into `out` (row stride
/// `out_stride`); with `out` None, only the partials (the bench times the
/// kernel alone that way).
pub(crate) fn launch_attention(
    stream: &Arc<CudaStream>,
    k: &Kernels,
    a: AttentionArgs<'_>,
    part_o: &mut CudaSlice<f32>,
    part_ml: &mut CudaSlice<f32>,
    out: Option<&mut CudaSlice<f32>>,
    out_stride: usize,
) -> Result<()> {
    if a.rows == 0 {
        return Ok(());
    }
    let scale = std::f32::consts::LOG2_E / (a.head_dim as f32).sqrt();
    let q_stride = a.q_stride as i32;
    let window = a.window as i32;
    let split_len = a.plan.split_len as i32;
    let num_splits = a.plan.num_splits as i32;
    let block_dim = match &k.paged_attention_mma {
        Some(mma) => (32 * mma.tuning.warps as u32, 1, 1),
        None => (32, 1, 1),
    };
    let (func, shared_mem_bytes) = match &k.paged_attention_mma {
        Some(mma) => (&mma.func, mma.smem_bytes),
        None => (&k.paged_attention, 0),
    };
    let mut out = out;
    let mut r0 = 0;
    while r0 < a.rows {
        let n = a.plan.rows_per_launch.min(a.rows - r0);
        let q = a.q.slice(r0 * a.q_stride..);
        let tok_seq = a.tok_seq.slice(r0..);
        let tok_pos = a.tok_pos.slice(r0..);
        // SAFETY: arguments match `paged_attention` (and
        // `paged_attention_mma`, which takes the same ones; split_len is a
        // multiple of 32, so of its 16-key tiles) and `attention_combine`;
        // the launch covers rows r0..r0 + n of q, tok_seq, tok_pos and out,
        // and the partials hold n × heads × splits ≤ part_cap entries
        // (`rows_per_launch`).
        unsafe {
            stream
                .launch_builder(func)
                .arg(&q)
                .arg(&q_stride)
                .arg(&scale)
                .arg(a.arena)
                .arg(&a.layer_off)
                .arg(&a.elems_per_block)
                .arg(a.tables)
                .arg(a.table_off)
                .arg(a.first_block)
                .arg(&tok_seq)
                .arg(&tok_pos)
                .arg(&window)
                .arg(&split_len)
                .arg(&mut *part_o)
                .arg(&mut *part_ml)
                .launch(LaunchConfig {
                    grid_dim: (a.plan.num_splits as u32, a.num_kv_heads as u32, n as u32),
                    block_dim,
                    shared_mem_bytes,
                })
                .map_err(cuda_err("paged_attention"))?;
            if let Some(out) = out.as_deref_mut() {
                let mut dst = out.slice_mut(r0 * out_stride..);
                let out_stride = out_stride as i32;
                stream
                    .launch_builder(&k.attention_combine)
                    .arg(&*part_o)
                    .arg(&*part_ml)
                    .arg(&num_splits)
                    .arg(&mut dst)
                    .arg(&out_stride)
                    .launch(LaunchConfig {
                        grid_dim: (n as u32, a.num_heads as u32, 1),
                        block_dim: (a.head_dim.min(128) as u32, 1, 1),
                        shared_mem_bytes: 0,
                    })
                    .map_err(cuda_err("attention_combine"))?;
            }
        }
        r0 += n;
    }
    Ok(())
}

impl Backend for CudaBackend {
    fn name(&self) -> &'static str {
        "cuda"
    }

    fn device(&self) -> String {
        format!("{} (cuda:{})", self.device_name, self.ctx.ordinal())
    }

    fn kv_dtype(&self) -> &'static str {
        self.kv_dtype.name()
    }

    fn forward(&mut self, batch: &Batch) -> Result<BatchLogits> {
        self.run(batch)
    }

    fn set_profiling(&mut self, on: bool) {
        self.profiling = on;
    }

    fn last_profile(&self) -> Option<PhaseTimes> {
        self.last_profile
    }
}
