//! The kernels of `kernels.cu`, compiled with NVRTC for one model shape,
//! and how the attention kernels split a row's keys.

use std::sync::Arc;

use cudarc::driver::{
    CudaContext, CudaFunction, sys::CUdevice_attribute, sys::CUfunction_attribute,
};
use cudarc::nvrtc::CompileOptions;

use super::{KvDtype, cuda_err};
use crate::error::{Error, Result};

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
    /// Tensor-core A operands per warp for the rows of a prefill chunk: a
    /// CTA takes up to `prefill_frags × (8 / group)` consecutive rows of one
    /// sequence and loads each K and V tile once for all of them (1 for
    /// head width 128, where two operands would not fit the registers).
    pub prefill_frags: usize,
    /// Keys per split of a query row (a multiple of 32). A constant of the
    /// worker, never derived from the batch: a row's splits start at its
    /// window start and every `split_keys` after, so the row is computed the
    /// same way whatever shares the launch (batch-invariant results, which
    /// exact prefix reuse needs). 2048 by measurement on the H200: against
    /// 512, a decode step's attention at context 1024 took 41.5 us instead
    /// of 44.8 us per layer, a 2 x 4096-row prefill chunk's 2.08 ms instead
    /// of 3.06 ms (fewer partials to write and merge).
    pub split_keys: usize,
}

impl Default for AttentionTuning {
    fn default() -> Self {
        AttentionTuning {
            tensor_cores: true,
            warps: 4,
            stages: 3,
            prefill_frags: 2,
            split_keys: 2048,
        }
    }
}

/// The tensor-core attention kernel and how it is launched.
#[derive(Debug)]
pub(super) struct MmaAttention {
    /// For groups of up to `pack` rows (decode).
    pub(super) func: CudaFunction,
    /// For groups of up to `frags × pack` rows (prefill chunks).
    pub(super) func_rows: CudaFunction,
    /// Query rows one A operand holds: 8 / group.
    pub(super) pack: usize,
    /// A operands per warp of `func_rows`.
    pub(super) frags: usize,
    pub(super) tuning: AttentionTuning,
    /// Dynamic shared memory per CTA.
    pub(super) smem_bytes: u32,
}

/// The compiled kernels of one model shape.
#[derive(Debug)]
pub(super) struct Kernels {
    pub(super) embed: CudaFunction,
    pub(super) rms_norm: CudaFunction,
    pub(super) rope_write_kv: CudaFunction,
    pub(super) swiglu: CudaFunction,
    pub(super) qkv_prep: CudaFunction,
    pub(super) rms_norm_add: CudaFunction,
    pub(super) soft_cap: CudaFunction,
    pub(super) copy_kv_slots: CudaFunction,
    pub(super) paged_attention: CudaFunction,
    pub(super) paged_attention_mma: Option<MmaAttention>,
    /// [`AttentionTuning::split_keys`], for both attention kernels.
    pub(super) split_keys: usize,
    /// Bytes of one arena element (`kv_t`).
    pub(super) kv_elem_bytes: usize,
    /// The merge in f32, for the bench's check against f64.
    #[cfg(feature = "bench")]
    pub(super) attention_combine: CudaFunction,
    pub(super) attention_combine_bf16: CudaFunction,
    pub(super) argmax_rows: CudaFunction,
    pub(super) feed_tokens: CudaFunction,
    pub(super) adjust_logits: CudaFunction,
    pub(super) mask_logits: CudaFunction,
    pub(super) sample_rows: CudaFunction,
    pub(super) keep_logits: CudaFunction,
    pub(super) keep_rows: CudaFunction,
    pub(super) logprob_rows: CudaFunction,
    /// The bench's K/V filler.
    #[cfg(feature = "bench")]
    pub(super) fill_random: CudaFunction,
}

/// The compile-time constants of the kernels.
#[derive(Debug, Clone, Copy)]
pub(super) struct KernelShape {
    pub(super) head_dim: usize,
    pub(super) group: usize,
    pub(super) kv_heads: usize,
    pub(super) tokens_per_block: usize,
    pub(super) kv_dtype: KvDtype,
    /// Gemma 2's `cap * tanh(score / cap)` on the attention scores: only
    /// the general kernel applies it, so a capped model never takes the
    /// tensor-core one.
    pub(super) attn_softcap: Option<f32>,
}

impl Kernels {
    pub(super) fn compile(ctx: &Arc<CudaContext>, shape: KernelShape) -> Result<Self> {
        Self::compile_tuned(ctx, shape, AttentionTuning::default())
    }

    pub(super) fn compile_tuned(
        ctx: &Arc<CudaContext>,
        shape: KernelShape,
        tuning: AttentionTuning,
    ) -> Result<Self> {
        let (major, minor) = ctx
            .compute_capability()
            .map_err(cuda_err("compute capability"))?;
        if shape.kv_dtype == KvDtype::Fp8 && (major, minor) < (8, 9) {
            return Err(Error::Config(format!(
                "--kv-dtype fp8 needs a GPU of compute capability 8.9 or newer (fp8 conversions); \
                 this one is {major}.{minor}"
            )));
        }
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
        // A stage holds a K and a V tile in the arena's type; an fp8 arena
        // adds one K and V tile widened to f16 per warp.
        let tiles = 2 * MMA_TILE * shape.head_dim;
        let widened = if shape.kv_dtype == KvDtype::Fp8 {
            tiles * 2
        } else {
            0
        };
        let pipeline_bytes =
            warps * (stages * tiles * shape.kv_dtype.elem_bytes() as usize + widened);
        let frags = if shape.head_dim > 64 {
            1
        } else {
            tuning.prefill_frags.clamp(1, 4)
        };
        // The merge holds 8 (row, head) pairs per A operand and warp.
        let merge_bytes = warps * 8 * frags * (shape.head_dim + 4) * 4;
        let mma_smem = pipeline_bytes.max(merge_bytes);
        let use_mma = tuning.tensor_cores
            && shape.attn_softcap.is_none()
            && major >= 8
            && matches!(shape.head_dim, 64 | 128)
            && shape.group <= 8
            && warps <= 16
            && mma_smem <= smem_optin;
        let mma_defines = if use_mma {
            format!(
                "#define ATTN_MMA 1\n#define MMA_WARPS {warps}\n#define MMA_STAGES {stages}\n#define MMA_FRAGS {frags}\n"
            )
        } else {
            String::new()
        };
        let src = source(&shape, &mma_defines);
        let arch = match (major, minor) {
            (9, 0) => Some("compute_90"),
            (8, 0) => Some("compute_80"),
            (8, 6) => Some("compute_86"),
            (8, 9) => Some("compute_89"),
            // newer devices run compute_90 PTX (JIT-compiled by the driver)
            (major, _) if major >= 9 => Some("compute_90"),
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
            let with_smem = |name: &str| {
                let func = f(name)?;
                func.set_attribute(
                    CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    mma_smem as i32,
                )
                .map_err(cuda_err("shared memory limit"))?;
                Ok::<_, Error>(func)
            };
            Some(MmaAttention {
                func: with_smem("paged_attention_mma")?,
                func_rows: with_smem("paged_attention_mma_rows")?,
                pack: 8 / shape.group,
                frags,
                tuning: AttentionTuning {
                    warps,
                    stages,
                    prefill_frags: frags,
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
            rope_write_kv: f("rope_write_kv")?,
            swiglu: f("swiglu")?,
            qkv_prep: f("qkv_prep")?,
            rms_norm_add: f("rms_norm_add")?,
            soft_cap: f("soft_cap")?,
            copy_kv_slots: f("copy_kv_slots")?,
            paged_attention: f("paged_attention")?,
            paged_attention_mma,
            split_keys: tuning.split_keys,
            kv_elem_bytes: shape.kv_dtype.elem_bytes() as usize,
            #[cfg(feature = "bench")]
            attention_combine: f("attention_combine")?,
            attention_combine_bf16: f("attention_combine_bf16")?,
            argmax_rows: f("argmax_rows")?,
            feed_tokens: f("feed_tokens")?,
            adjust_logits: f("adjust_logits")?,
            mask_logits: f("mask_logits")?,
            sample_rows: f("sample_rows")?,
            keep_logits: f("keep_logits")?,
            keep_rows: f("keep_rows")?,
            logprob_rows: f("logprob_rows")?,
            #[cfg(feature = "bench")]
            fill_random: f("fill_random")?,
        })
    }
}

/// `kernels.cu` for `shape`, after the `#define`s it is compiled with
/// (`mma_defines`: the tensor-core kernel's, or empty).
fn source(shape: &KernelShape, mma_defines: &str) -> String {
    let dtype = match shape.kv_dtype {
        KvDtype::F16 => "KV_F16",
        KvDtype::Bf16 => "KV_BF16",
        KvDtype::Fp8 => "KV_FP8",
    };
    let softcap = match shape.attn_softcap {
        // `{:?}` always writes a decimal point, so `f` makes a float literal.
        Some(cap) => format!("#define ATTN_SOFTCAP {cap:?}f\n"),
        None => String::new(),
    };
    format!(
        "#define HEAD_DIM {}\n#define GROUP {}\n#define KV_HEADS {}\n#define TOKENS_PER_BLOCK {}\n#define {dtype} 1\n{mma_defines}{softcap}{KERNELS}",
        shape.head_dim, shape.group, shape.kv_heads, shape.tokens_per_block
    )
}

/// How one attention launch splits its keys: each row's keys, from its own
/// window start, in splits of [`Kernels::split_keys`] (see
/// [`AttentionTuning::split_keys`]); rows × splits stay within the partials'
/// capacity by running a long batch as several launches over row ranges.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct SplitPlan {
    pub(super) num_splits: usize,
    pub(super) split_len: usize,
    pub(super) rows_per_launch: usize,
}

impl Kernels {
    /// Most consecutive rows of one sequence a CTA of the attention kernel
    /// takes in a layer of `window` under `plan`: the tensor-core kernel's
    /// groups where the layer has no window (rows with windows start their
    /// keys at different tiles), else one; never more than a launch holds.
    pub(super) fn max_group(&self, window: u32, plan: SplitPlan) -> usize {
        match &self.paged_attention_mma {
            Some(mma) if window == 0 => (mma.frags * mma.pack).min(plan.rows_per_launch).max(1),
            _ => 1,
        }
    }

    /// The split plan for rows of at most `max_keys` keys each, with partials
    /// for `part_cap` (row × split) pairs.
    pub(super) fn split_plan(&self, max_keys: usize, part_cap: usize) -> SplitPlan {
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

/// Group boundaries for rows that come as `rows_per_seq` consecutive rows
/// of each sequence in turn: each sequence's rows cut into groups of at
/// most `max_group`; `first[i]` is group `i`'s first row and a last entry
/// the total row count.
pub(super) fn row_groups(
    rows_per_seq: impl IntoIterator<Item = usize>,
    max_group: usize,
) -> Vec<i32> {
    let mut first = vec![0i32];
    let mut row = 0usize;
    for n in rows_per_seq {
        let mut done = 0;
        while done < n {
            let take = (n - done).min(max_group.max(1));
            done += take;
            row += take;
            first.push(row as i32);
        }
    }
    first
}

/// The launches over `group_first`'s groups: `(g0, g1)` ranges of whole
/// groups of at most `rows_per_launch` rows together (a group larger than
/// that is a launch of its own).
pub(super) fn group_launches(group_first: &[i32], rows_per_launch: usize) -> Vec<(usize, usize)> {
    let groups = group_first.len().saturating_sub(1);
    let mut launches = Vec::new();
    let mut g0 = 0;
    while g0 < groups {
        let r0 = group_first[g0];
        let mut g1 = g0 + 1;
        while g1 < groups && (group_first[g1 + 1] - r0) as usize <= rows_per_launch {
            g1 += 1;
        }
        launches.push((g0, g1));
        g0 = g1;
    }
    launches
}

#[cfg(test)]
mod tests {
    use super::*;

    /// NVRTC alone, no device: the source compiles for the variants the
    /// models take (head widths 16 to 256, a soft-capped general kernel,
    /// the tensor-core kernel, every arena type). Without libnvrtc the test
    /// says so and returns; under `KVLEASE_REQUIRE_GPU=1` or
    /// `KVLEASE_REQUIRE_NVRTC=1` (CI, with NVRTC from PyPI and no GPU) that
    /// is a failure.
    #[test]
    fn the_kernel_source_compiles_for_every_variant() {
        // SAFETY: only tries to dlopen the library; no symbol is used.
        if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
            for required in ["KVLEASE_REQUIRE_GPU", "KVLEASE_REQUIRE_NVRTC"] {
                assert!(
                    std::env::var(required).map_or(true, |v| v != "1"),
                    "libnvrtc is not present but {required}=1"
                );
            }
            eprintln!("skipped: libnvrtc is not present");
            return;
        }
        let shape = |head_dim, group, kv_dtype, attn_softcap| KernelShape {
            head_dim,
            group,
            kv_heads: 2,
            tokens_per_block: 16,
            kv_dtype,
            attn_softcap,
        };
        let mma =
            "#define ATTN_MMA 1\n#define MMA_WARPS 4\n#define MMA_STAGES 3\n#define MMA_FRAGS 2\n";
        let variants = [
            (shape(16, 2, KvDtype::Bf16, Some(4.0)), ""),
            (shape(32, 2, KvDtype::F16, None), ""),
            (shape(256, 8, KvDtype::Bf16, Some(50.0)), ""),
            (shape(64, 4, KvDtype::Bf16, None), mma),
            (shape(128, 2, KvDtype::F16, None), mma),
            // fp8 arenas: loads of 8, 4 and 2 elements, and the widening
            // tensor-core kernel
            (shape(24, 2, KvDtype::Fp8, None), ""),
            (shape(20, 2, KvDtype::Fp8, Some(4.0)), ""),
            (shape(18, 1, KvDtype::Fp8, None), ""),
            (shape(64, 4, KvDtype::Fp8, None), mma),
            (shape(128, 8, KvDtype::Fp8, None), mma),
        ];
        // NVRTC passes inline PTX through unchecked: with `KVLEASE_PTXAS`
        // naming a ptxas binary, each variant's PTX is also assembled for
        // sm_90, as the driver will on the device.
        let ptxas = std::env::var_os("KVLEASE_PTXAS");
        let dir = std::env::temp_dir().join(format!("kvlease-ptx-{}", std::process::id()));
        for (i, (shape, defines)) in variants.into_iter().enumerate() {
            let options = CompileOptions {
                arch: Some("compute_90"),
                ..Default::default()
            };
            let ptx = cudarc::nvrtc::compile_ptx_with_opts(source(&shape, defines), options)
                .unwrap_or_else(|e| panic!("{shape:?} {defines:?}: {e}"));
            let Some(ptxas) = &ptxas else { continue };
            std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
            let file = dir.join(format!("variant-{i}.ptx"));
            std::fs::write(&file, ptx.to_src()).unwrap_or_else(|e| panic!("{e}"));
            let out = std::process::Command::new(ptxas)
                .args(["-arch=sm_90", "-o", "/dev/null"])
                .arg(&file)
                .output()
                .unwrap_or_else(|e| panic!("ptxas: {e}"));
            assert!(
                out.status.success(),
                "{shape:?} {defines:?}: ptxas: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        if ptxas.is_some() {
            let _ = std::fs::remove_dir_all(&dir);
            println!("every variant assembled by ptxas for sm_90");
        }
    }
}
