//! One typed, safe wrapper per kernel of `kernels.cu`.
//!
//! Each wrapper checks on the host that every buffer holds the rows its grid
//! touches, then launches in a single `unsafe` block whose `SAFETY` comment
//! names the kernel signature the arguments must match. Indices that arrive
//! from a peer (token ids, block ids) are read by the kernels from device
//! memory, where the host cannot check them per launch: they come from a
//! [`Batch`](crate::batch::Batch) that passed [`batch::validate`]
//! (token ids below the vocabulary, every position a pass touches covered by
//! a listed block id below the pool's block count), uploaded by
//! [`DeviceBatch::upload`](super::uploads::DeviceBatch::upload).
//!
//! [`batch::validate`]: crate::batch::validate

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, LaunchConfig, PushKernelArg};
use half::bf16;

use super::cuda_err;
use super::kernels::{Kernels, SplitPlan, group_launches};
use super::picks::{DeviceAdjusts, DeviceLogprobs, DeviceMasks, DeviceSamples};
use crate::error::{Error, Result};

/// Launches the kernels of one compiled module on one stream.
#[derive(Debug, Clone, Copy)]
pub(super) struct Launcher<'a> {
    pub(super) stream: &'a Arc<CudaStream>,
    pub(super) kernels: &'a Kernels,
}

/// A null device pointer, for a kernel's optional buffer.
const NULL: u64 = 0;

/// Fails unless a buffer of `have` elements holds the `need` a launch touches.
fn check_len(kernel: &str, buffer: &str, have: usize, need: usize) -> Result<()> {
    if have < need {
        return Err(Error::Backend(format!(
            "{kernel}: {buffer} holds {have} elements, the launch touches {need}"
        )));
    }
    Ok(())
}

/// One block of `threads` threads per row.
fn per_row(rows: usize, threads: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (rows as u32, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Inputs of one paged-attention launch.
pub(super) struct AttentionArgs<'a> {
    pub(super) q: &'a CudaSlice<f32>,
    pub(super) q_stride: usize,
    pub(super) arena: &'a CudaSlice<u8>,
    pub(super) layer_off: i64,
    pub(super) elems_per_block: i64,
    pub(super) tables: &'a CudaSlice<u32>,
    pub(super) table_off: &'a CudaSlice<i32>,
    pub(super) first_block: &'a CudaSlice<i32>,
    pub(super) tok_seq: &'a CudaSlice<i32>,
    pub(super) tok_pos: &'a CudaSlice<i32>,
    /// Row groups (see `kernels::row_groups`): first row of each, then the
    /// row count; on the device and on the host.
    pub(super) groups: &'a CudaSlice<i32>,
    pub(super) group_first: &'a [i32],
    pub(super) window: u32,
    pub(super) rows: usize,
    pub(super) num_heads: usize,
    pub(super) num_kv_heads: usize,
    pub(super) head_dim: usize,
    /// The softmax scale of the scores (`ModelConfig::attn_scale`).
    pub(super) scale: f32,
    pub(super) plan: SplitPlan,
}

impl Launcher<'_> {
    /// `x[r] = table[tokens[r]] * scale` for `rows` rows of width `h`.
    #[allow(clippy::too_many_arguments)] // the kernel's own parameters
    pub(super) fn embed(
        &self,
        table: &CudaSlice<f32>,
        tokens: &CudaSlice<u32>,
        x: &mut CudaSlice<f32>,
        rows: usize,
        h: usize,
        scale: f32,
    ) -> Result<()> {
        check_len("embed", "tokens", tokens.len(), rows)?;
        check_len("embed", "x", x.len(), rows * h)?;
        let h_i = h as i32;
        // SAFETY: matches `embed(const float*, const unsigned int*, float*,
        // int h, float scale)`; the grid covers `rows` rows of `tokens` and `x` (checked
        // above); every token id is below the vocabulary (`batch::validate`),
        // so `table` (vocab × h) holds the row read.
        unsafe {
            self.stream
                .launch_builder(&self.kernels.embed)
                .arg(table)
                .arg(tokens)
                .arg(x)
                .arg(&h_i)
                .arg(&scale)
                .launch(per_row(rows, 256))
        }
        .map_err(cuda_err("embed"))?;
        Ok(())
    }

    /// `out[r] = x[src] / rms(x[src]) * w` in bf16 for `rows` rows of width
    /// `h`, `src = gather[r]` when `gather` is given, else `r`.
    #[allow(clippy::too_many_arguments)] // the kernel's own parameters
    pub(super) fn rms_norm(
        &self,
        x: &CudaSlice<f32>,
        gather: Option<&CudaSlice<u32>>,
        w: &CudaSlice<f32>,
        out: &mut CudaSlice<bf16>,
        rows: usize,
        h: usize,
        eps: f32,
    ) -> Result<()> {
        check_len("rms_norm", "w", w.len(), h)?;
        check_len("rms_norm", "out", out.len(), rows * h)?;
        match gather {
            Some(g) => check_len("rms_norm", "gather", g.len(), rows)?,
            None => check_len("rms_norm", "x", x.len(), rows * h)?,
        }
        let h_i = h as i32;
        let use_rows = i32::from(gather.is_some());
        // SAFETY: matches `rms_norm(const float* x, const unsigned int* rows,
        // int use_rows, const float* w, act_t* out, int h, float eps)`; the
        // grid covers `rows` rows of `out` (and of `gather`, or of `x` when
        // there is none: the kernel reads `rows` only when use_rows is 1, so
        // a null pointer stands in). Gathered row indices are the batch's
        // own logit rows, below its token count (`DeviceBatch::upload`), so
        // inside `x`.
        unsafe {
            let mut b = self.stream.launch_builder(&self.kernels.rms_norm);
            b.arg(x);
            match gather {
                Some(g) => b.arg(g),
                None => b.arg(&NULL),
            };
            b.arg(&use_rows)
                .arg(w)
                .arg(out)
                .arg(&h_i)
                .arg(&eps)
                .launch(per_row(rows, 256))
        }
        .map_err(cuda_err("rms_norm"))?;
        Ok(())
    }

    /// RoPE over the `q_heads` query heads and the KV heads of every row
    /// of `qkv` (rows of `stride`, Q | K | V heads of `head_dim`), in
    /// place, then each row's K and V into the arena at `dst_base[r] +
    /// layer_off` (the layout of `ArenaLayout`): one launch for both.
    #[allow(clippy::too_many_arguments)] // the kernel's own parameters
    pub(super) fn rope_write_kv(
        &self,
        qkv: &mut CudaSlice<f32>,
        (stride, q_heads, kv_heads, head_dim): (usize, usize, usize, usize),
        positions: &CudaSlice<i32>,
        inv_freq: &CudaSlice<f32>,
        dst_base: &CudaSlice<i64>,
        layer_off: i64,
        arena: &mut CudaSlice<u8>,
        rows: usize,
    ) -> Result<()> {
        check_len("rope_write_kv", "positions", positions.len(), rows)?;
        check_len("rope_write_kv", "dst_base", dst_base.len(), rows)?;
        check_len("rope_write_kv", "inv_freq", inv_freq.len(), head_dim / 2)?;
        check_len("rope_write_kv", "qkv", qkv.len(), rows * stride)?;
        check_len(
            "rope_write_kv",
            "a qkv row",
            stride,
            (q_heads + 2 * kv_heads) * head_dim,
        )?;
        let (stride_i, q_heads_i) = (stride as i32, q_heads as i32);
        // SAFETY: matches `rope_write_kv(float* qkv, int stride, int
        // q_heads, const int* positions, const float* inv_freq, const long
        // long* dst_base, long long layer_off, kv_t* arena)`, compiled for
        // this model's HEAD_DIM and KV_HEADS; the grid covers `rows` rows of
        // `qkv` (each holding the Q, K and V heads, checked above),
        // `positions` and `dst_base`; `inv_freq` holds HEAD_DIM/2 entries.
        // Each `dst_base` is a (block, slot) offset of a block id that
        // `batch::validate` found below the pool's block count, and
        // `layer_off` a layer slot of the pool, so every element written
        // lies inside the pool's arena.
        unsafe {
            self.stream
                .launch_builder(&self.kernels.rope_write_kv)
                .arg(qkv)
                .arg(&stride_i)
                .arg(&q_heads_i)
                .arg(positions)
                .arg(inv_freq)
                .arg(dst_base)
                .arg(&layer_off)
                .arg(arena)
                .launch(per_row(rows, 128))
        }
        .map_err(cuda_err("rope_write_kv"))?;
        Ok(())
    }

    /// `out = act(gate) * up` in bf16 over `rows` rows `[gate | up]` of
    /// width `2f` (`out` rows are `f` wide); `act` is silu, or GELU (tanh)
    /// when `gelu`.
    pub(super) fn swiglu(
        &self,
        gate_up: &CudaSlice<f32>,
        f: usize,
        rows: usize,
        out: &mut CudaSlice<bf16>,
        gelu: bool,
    ) -> Result<()> {
        check_len("swiglu", "gate_up", gate_up.len(), rows * 2 * f)?;
        check_len("swiglu", "out", out.len(), rows * f)?;
        let (f_i, n, gelu_i) = (f as i32, (rows * f) as i32, i32::from(gelu));
        // a thread per 4 columns when rows are a multiple of 4 wide (the
        // kernel's own rule), else per column
        let threads = if f.is_multiple_of(4) { n / 4 } else { n };
        // SAFETY: matches `swiglu(const float* gate_up, int f, int n, act_t*
        // out, int gelu)`; threads past their count return; n = rows × f
        // elements of `out` and their rows of width 2f in `gate_up` exist
        // (checked above), and both are whole allocations, so the float4
        // and 8-byte accesses of rows a multiple of 4 wide are aligned.
        unsafe {
            self.stream
                .launch_builder(&self.kernels.swiglu)
                .arg(gate_up)
                .arg(&f_i)
                .arg(&n)
                .arg(out)
                .arg(&gelu_i)
                .launch(LaunchConfig::for_num_elems(threads as u32))
        }
        .map_err(cuda_err("swiglu"))?;
        Ok(())
    }

    /// Before RoPE, over `rows` rows of `qkv` (rows of `stride`, Q | K | V
    /// heads of `head_dim`): adds `bias` (all Q, K and V columns) when
    /// given, then RMSNorms every query head by `norms.0` and every key
    /// head by `norms.1` when given.
    #[allow(clippy::too_many_arguments)] // the kernel's own parameters
    pub(super) fn qkv_prep(
        &self,
        qkv: &mut CudaSlice<f32>,
        (stride, q_heads, kv_heads, head_dim): (usize, usize, usize, usize),
        bias: Option<&CudaSlice<f32>>,
        norms: Option<(&CudaSlice<f32>, &CudaSlice<f32>)>,
        eps: f32,
        rows: usize,
    ) -> Result<()> {
        let width = (q_heads + 2 * kv_heads) * head_dim;
        check_len("qkv_prep", "qkv", qkv.len(), rows * stride)?;
        check_len("qkv_prep", "a qkv row", stride, width)?;
        if let Some(b) = bias {
            check_len("qkv_prep", "bias", b.len(), width)?;
        }
        if let Some((q, k)) = norms {
            check_len("qkv_prep", "q_norm", q.len(), head_dim)?;
            check_len("qkv_prep", "k_norm", k.len(), head_dim)?;
        }
        let (stride_i, q_heads_i) = (stride as i32, q_heads as i32);
        let (has_bias, has_norm) = (i32::from(bias.is_some()), i32::from(norms.is_some()));
        // SAFETY: matches `qkv_prep(float* qkv, int stride, int q_heads, int
        // has_bias, const float* bias, int has_norm, const float* q_norm,
        // const float* k_norm, float eps)`, compiled for this model's
        // HEAD_DIM and KV_HEADS; the grid covers `rows` rows of `qkv`, each
        // holding the Q, K and V heads (checked above); `bias` holds every
        // column of a row and the norms `head_dim` entries (checked above);
        // the kernel reads a pointer only when its flag is 1, so a null
        // stands in for an absent one. 128 threads: whole warps, as the
        // per-head reductions need.
        unsafe {
            let mut b = self.stream.launch_builder(&self.kernels.qkv_prep);
            b.arg(qkv).arg(&stride_i).arg(&q_heads_i).arg(&has_bias);
            match bias {
                Some(v) => b.arg(v),
                None => b.arg(&NULL),
            };
            b.arg(&has_norm);
            match norms {
                Some((q, k)) => b.arg(q).arg(k),
                None => b.arg(&NULL).arg(&NULL),
            };
            b.arg(&eps).launch(per_row(rows, 128))
        }
        .map_err(cuda_err("qkv_prep"))?;
        Ok(())
    }

    /// `x[r] += y[r] / rms(y[r]) * w` for `rows` rows of width `h`.
    pub(super) fn rms_norm_add(
        &self,
        x: &mut CudaSlice<f32>,
        y: &CudaSlice<f32>,
        w: &CudaSlice<f32>,
        rows: usize,
        h: usize,
        eps: f32,
    ) -> Result<()> {
        check_len("rms_norm_add", "w", w.len(), h)?;
        check_len("rms_norm_add", "x", x.len(), rows * h)?;
        check_len("rms_norm_add", "y", y.len(), rows * h)?;
        let h_i = h as i32;
        // SAFETY: matches `rms_norm_add(float* x, const float* y, const
        // float* w, int h, float eps)`; the grid covers `rows` rows of `x`
        // and `y`, and `w` holds `h` entries (checked above).
        unsafe {
            self.stream
                .launch_builder(&self.kernels.rms_norm_add)
                .arg(x)
                .arg(y)
                .arg(w)
                .arg(&h_i)
                .arg(&eps)
                .launch(per_row(rows, 256))
        }
        .map_err(cuda_err("rms_norm_add"))?;
        Ok(())
    }

    /// `v = cap * tanh(v / cap)` over the first `n` values of `v`.
    pub(super) fn soft_cap(&self, v: &mut CudaSlice<f32>, n: usize, cap: f32) -> Result<()> {
        check_len("soft_cap", "v", v.len(), n)?;
        let n_i = n as i64;
        let blocks = n.div_ceil(256) as u32;
        // SAFETY: matches `soft_cap(float* v, long long n, float cap)`;
        // threads past n return and `v` holds n values (checked above).
        unsafe {
            self.stream
                .launch_builder(&self.kernels.soft_cap)
                .arg(v)
                .arg(&n_i)
                .arg(&cap)
                .launch(LaunchConfig {
                    grid_dim: (blocks.max(1), 1, 1),
                    block_dim: (256, 1, 1),
                    shared_mem_bytes: 0,
                })
        }
        .map_err(cuda_err("soft_cap"))?;
        Ok(())
    }

    /// `out[r]` = the first index of the largest value of row `r` of
    /// `logits` (`rows` rows of width `vocab`), as `ops::argmax`.
    pub(super) fn argmax_rows(
        &self,
        logits: &CudaSlice<f32>,
        vocab: usize,
        rows: usize,
        out: &mut CudaSlice<u32>,
    ) -> Result<()> {
        if rows == 0 {
            return Ok(());
        }
        check_len("argmax_rows", "logits", logits.len(), rows * vocab)?;
        check_len("argmax_rows", "out", out.len(), rows)?;
        let vocab_i = vocab as i32;
        // SAFETY: matches `argmax_rows(const float* logits, int vocab,
        // unsigned int* out)`; one block per row reads rows × vocab logits
        // and writes rows entries of `out` (checked above).
        unsafe {
            self.stream
                .launch_builder(&self.kernels.argmax_rows)
                .arg(logits)
                .arg(&vocab_i)
                .arg(out)
                .launch(per_row(rows, 1024))
        }
        .map_err(cuda_err("argmax_rows"))?;
        Ok(())
    }

    /// `tokens[pairs[2i]] = argmax[pairs[2i + 1]]` for the `n` pairs: a
    /// pass's tokens fed from the argmax of the pass before.
    pub(super) fn feed_tokens(
        &self,
        argmax: &CudaSlice<u32>,
        pairs: &CudaSlice<u32>,
        n: usize,
        tokens: &mut CudaSlice<u32>,
    ) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        check_len("feed_tokens", "pairs", pairs.len(), 2 * n)?;
        let n_i = n as i32;
        // SAFETY: matches `feed_tokens(unsigned int* tokens, const unsigned
        // int* argmax, const unsigned int* pairs, int n)`; the caller checked
        // every pair against both buffers' lengths.
        unsafe {
            self.stream
                .launch_builder(&self.kernels.feed_tokens)
                .arg(tokens)
                .arg(argmax)
                .arg(pairs)
                .arg(&n_i)
                .launch(LaunchConfig {
                    grid_dim: (n.div_ceil(256) as u32, 1, 1),
                    block_dim: (256, 1, 1),
                    shared_mem_bytes: 0,
                })
        }
        .map_err(cuda_err("feed_tokens"))?;
        Ok(())
    }

    /// Adjusts the logits `a` names (`rows` rows of width `vocab`), as
    /// [`crate::sampling::Adjust::apply`].
    pub(super) fn adjust_logits(
        &self,
        logits: &mut CudaSlice<f32>,
        vocab: usize,
        rows: usize,
        a: &DeviceAdjusts,
    ) -> Result<()> {
        check_len("adjust_logits", "logits", logits.len(), rows * vocab)?;
        for (name, len) in [
            ("rows", a.rows.len()),
            ("tokens", a.tokens.len()),
            ("bias", a.bias.len()),
            ("repetition", a.repetition.len()),
            ("penalty", a.penalty.len()),
        ] {
            check_len("adjust_logits", name, len, a.n)?;
        }
        let (vocab_i, n_i) = (vocab as i32, a.n as i32);
        // SAFETY: matches `adjust_logits(float* logits, int vocab, int n,
        // const unsigned* rows, const unsigned* tokens, const float* bias,
        // const float* repetition, const float* penalty)`; threads past n
        // return, each array holds n entries (checked above), and
        // `DevicePicks::upload` checked every row below the pass's logits
        // rows (`rows`, the pass's own count) and every token below the
        // vocabulary, each (row, token) once.
        unsafe {
            self.stream
                .launch_builder(&self.kernels.adjust_logits)
                .arg(logits)
                .arg(&vocab_i)
                .arg(&n_i)
                .arg(&a.rows)
                .arg(&a.tokens)
                .arg(&a.bias)
                .arg(&a.repetition)
                .arg(&a.penalty)
                .launch(LaunchConfig {
                    grid_dim: (a.n.div_ceil(256) as u32, 1, 1),
                    block_dim: (256, 1, 1),
                    shared_mem_bytes: 0,
                })
        }
        .map_err(cuda_err("adjust_logits"))?;
        Ok(())
    }

    /// -inf for every logit of the rows `m` names whose token their mask
    /// does not allow, as [`crate::sampling::apply_mask`].
    pub(super) fn mask_logits(
        &self,
        logits: &mut CudaSlice<f32>,
        vocab: usize,
        rows: usize,
        m: &DeviceMasks,
    ) -> Result<()> {
        check_len("mask_logits", "logits", logits.len(), rows * vocab)?;
        check_len("mask_logits", "rows", m.rows.len(), m.n)?;
        let words_per_row = vocab.div_ceil(32);
        check_len("mask_logits", "words", m.words.len(), m.n * words_per_row)?;
        let (vocab_i, words_i) = (vocab as i32, words_per_row as i32);
        // SAFETY: matches `mask_logits(float* logits, int vocab, int
        // words_per_row, const unsigned* rows, const unsigned* words)`;
        // threads past vocab return, blockIdx.y < n indexes `rows` (n
        // entries) and `words` (n * words_per_row, checked above), and
        // `DevicePicks::upload` checked every row below the pass's logits
        // rows (`rows`), each named once.
        unsafe {
            self.stream
                .launch_builder(&self.kernels.mask_logits)
                .arg(logits)
                .arg(&vocab_i)
                .arg(&words_i)
                .arg(&m.rows)
                .arg(&m.words)
                .launch(LaunchConfig {
                    grid_dim: (vocab.div_ceil(256) as u32, m.n as u32, 1),
                    block_dim: (256, 1, 1),
                    shared_mem_bytes: 0,
                })
        }
        .map_err(cuda_err("mask_logits"))?;
        Ok(())
    }

    /// `out[row]` = the token `sampling::pick` draws from the (adjusted)
    /// logits row, for every row `s` names.
    pub(super) fn sample_rows(
        &self,
        logits: &CudaSlice<f32>,
        vocab: usize,
        rows: usize,
        s: &DeviceSamples,
        out: &mut CudaSlice<u32>,
    ) -> Result<()> {
        check_len("sample_rows", "logits", logits.len(), rows * vocab)?;
        check_len("sample_rows", "out", out.len(), rows)?;
        for (name, len) in [
            ("rows", s.rows.len()),
            ("temperature", s.temperature.len()),
            ("top_k", s.top_k.len()),
            ("top_p", s.top_p.len()),
            ("min_p", s.min_p.len()),
            ("draw", s.draw.len()),
        ] {
            check_len("sample_rows", name, len, s.n)?;
        }
        let vocab_i = vocab as i32;
        // SAFETY: matches `sample_rows(const float* logits, int vocab,
        // const unsigned* rows, const float* temperature, const unsigned*
        // top_k, const float* top_p, const float* min_p, const double* draw,
        // unsigned* out)`; one block of 1024 threads (the kernel's
        // SAMPLE_THREADS, which its reductions assume) per pick, every array
        // holds n entries (checked above), and `DevicePicks::upload` checked
        // each row below `rows`, named once, so blocks write distinct
        // entries of `out`.
        unsafe {
            self.stream
                .launch_builder(&self.kernels.sample_rows)
                .arg(logits)
                .arg(&vocab_i)
                .arg(&s.rows)
                .arg(&s.temperature)
                .arg(&s.top_k)
                .arg(&s.top_p)
                .arg(&s.min_p)
                .arg(&s.draw)
                .arg(out)
                .launch(per_row(s.n, 1024))
        }
        .map_err(cuda_err("sample_rows"))?;
        Ok(())
    }

    /// Saves (`restore` false) the logits `a` names into `vals`, or puts
    /// them back from it (`restore` true): the raw values around
    /// `adjust_logits`, for the log-probabilities of the raw distribution.
    pub(super) fn keep_logits(
        &self,
        logits: &mut CudaSlice<f32>,
        vocab: usize,
        rows: usize,
        a: &DeviceAdjusts,
        vals: &mut CudaSlice<f32>,
        restore: bool,
    ) -> Result<()> {
        check_len("keep_logits", "logits", logits.len(), rows * vocab)?;
        for (name, len) in [
            ("rows", a.rows.len()),
            ("tokens", a.tokens.len()),
            ("vals", vals.len()),
        ] {
            check_len("keep_logits", name, len, a.n)?;
        }
        let (vocab_i, n_i, restore_i) = (vocab as i32, a.n as i32, i32::from(restore));
        // SAFETY: matches `keep_logits(float* logits, int vocab, int n,
        // const unsigned* rows, const unsigned* tokens, float* vals, int
        // restore)`; threads past n return, each array holds n entries
        // (checked above), and `DevicePicks::upload` checked every row below
        // the pass's logits rows and every token below the vocabulary, each
        // (row, token) once, as for `adjust_logits`.
        unsafe {
            self.stream
                .launch_builder(&self.kernels.keep_logits)
                .arg(logits)
                .arg(&vocab_i)
                .arg(&n_i)
                .arg(&a.rows)
                .arg(&a.tokens)
                .arg(vals)
                .arg(&restore_i)
                .launch(LaunchConfig {
                    grid_dim: (a.n.div_ceil(256) as u32, 1, 1),
                    block_dim: (256, 1, 1),
                    shared_mem_bytes: 0,
                })
        }
        .map_err(cuda_err("keep_logits"))?;
        Ok(())
    }

    /// Saves (`restore` false) the whole rows `m` masks into `vals` (`vocab`
    /// values per mask, in `m`'s order), or puts them back from it
    /// (`restore` true): a constrained row's raw values around
    /// `adjust_logits` and `mask_logits`, for the log-probabilities of the
    /// raw distribution.
    pub(super) fn keep_rows(
        &self,
        logits: &mut CudaSlice<f32>,
        vocab: usize,
        rows: usize,
        m: &DeviceMasks,
        vals: &mut CudaSlice<f32>,
        restore: bool,
    ) -> Result<()> {
        check_len("keep_rows", "logits", logits.len(), rows * vocab)?;
        check_len("keep_rows", "rows", m.rows.len(), m.n)?;
        check_len("keep_rows", "vals", vals.len(), m.n * vocab)?;
        let (vocab_i, restore_i) = (vocab as i32, i32::from(restore));
        // SAFETY: matches `keep_rows(float* logits, int vocab, const
        // unsigned* rows, float* vals, int restore)`; threads past vocab
        // return, blockIdx.y < n indexes `rows` (n entries) and `vals`
        // (n * vocab, checked above), and `DevicePicks::upload` checked
        // every masked row below the pass's logits rows (`rows`), each
        // named once, so blocks of different entries touch distinct rows.
        unsafe {
            self.stream
                .launch_builder(&self.kernels.keep_rows)
                .arg(logits)
                .arg(&vocab_i)
                .arg(&m.rows)
                .arg(vals)
                .arg(&restore_i)
                .launch(LaunchConfig {
                    grid_dim: (vocab.div_ceil(256) as u32, m.n as u32, 1),
                    block_dim: (256, 1, 1),
                    shared_mem_bytes: 0,
                })
        }
        .map_err(cuda_err("keep_rows"))?;
        Ok(())
    }

    /// The log-probabilities `l` asks of the (raw) logits, the tokens
    /// picked at the rows being `picked`, into `l.out`, as
    /// [`crate::logprobs::row_logprobs`].
    pub(super) fn logprob_rows(
        &self,
        logits: &CudaSlice<f32>,
        vocab: usize,
        rows: usize,
        picked: &CudaSlice<u32>,
        l: &mut DeviceLogprobs,
    ) -> Result<()> {
        check_len("logprob_rows", "logits", logits.len(), rows * vocab)?;
        check_len("logprob_rows", "picked", picked.len(), rows)?;
        for (name, len) in [
            ("rows", l.rows.len()),
            ("chosen", l.chosen.len()),
            ("top", l.top.len()),
        ] {
            check_len("logprob_rows", name, len, l.n)?;
        }
        check_len("logprob_rows", "out", l.out.len(), l.n * l.stride())?;
        let (vocab_i, kmax_i) = (vocab as i32, l.kmax as i32);
        // SAFETY: matches `logprob_rows(const float* logits, int vocab,
        // const unsigned* rows, const unsigned* chosen, const unsigned* top,
        // const unsigned* picked, int kmax, unsigned* out)`; one block of
        // 1024 threads (SAMPLE_THREADS, which its reductions assume) per
        // entry, each array holds n entries and `out` n strides (checked
        // above); `DeviceLogprobs::upload` checked each row below `rows`
        // (so `picked[row]` is in range), each top at most kmax, and each
        // chosen token below the vocabulary or the picked marker (a picked
        // token past the vocabulary is checked by the kernel).
        unsafe {
            self.stream
                .launch_builder(&self.kernels.logprob_rows)
                .arg(logits)
                .arg(&vocab_i)
                .arg(&l.rows)
                .arg(&l.chosen)
                .arg(&l.top)
                .arg(picked)
                .arg(&kmax_i)
                .arg(&mut l.out)
                .launch(per_row(l.n, 1024))
        }
        .map_err(cuda_err("logprob_rows"))?;
        Ok(())
    }

    /// Partial-block reuse: copies slots `[0, slots)` of the block at
    /// element offset `src_base` into the block at `dst_base`, in each of
    /// the block's `runs` runs of `b * d` elements (one per layer of the
    /// pool, K or V, KV head). `b` and `d` must be the kernels' `B` and `D`.
    #[allow(clippy::too_many_arguments)] // the copy's geometry
    pub(super) fn copy_kv_slots(
        &self,
        arena: &mut CudaSlice<u8>,
        src_base: usize,
        dst_base: usize,
        runs: usize,
        (b, d): (usize, usize),
        slots: usize,
    ) -> Result<()> {
        let block_elems = runs * b * d;
        let arena_elems = arena.len() / self.kernels.kv_elem_bytes;
        check_len(
            "copy_kv_slots",
            "arena",
            arena_elems,
            src_base + block_elems,
        )?;
        check_len(
            "copy_kv_slots",
            "arena",
            arena_elems,
            dst_base + block_elems,
        )?;
        if src_base.abs_diff(dst_base) < block_elems || slots >= b {
            return Err(Error::Backend(format!(
                "copy_kv_slots: blocks at {src_base} and {dst_base} overlap, or {slots} slots \
                 is not less than a block's {b}"
            )));
        }
        let (src, dst, n) = (src_base as i64, dst_base as i64, slots as i32);
        // SAFETY: matches `copy_kv_slots(kv_t* arena, long long src_base,
        // long long dst_base, int n)`; the grid has one block per run, and
        // the runs * B * D elements from either offset lie inside the arena
        // (checked above); each block copies n * D < B * D elements of its
        // run; the two blocks do not overlap (checked above).
        unsafe {
            self.stream
                .launch_builder(&self.kernels.copy_kv_slots)
                .arg(arena)
                .arg(&src)
                .arg(&dst)
                .arg(&n)
                .launch(per_row(runs, 128))
        }
        .map_err(cuda_err("copy_kv_slots"))?;
        Ok(())
    }

    /// Paged attention, then the merge of its splits into `out` (row stride
    /// `out_stride`); with `out` None, only the partials (the bench times the
    /// kernel alone that way).
    pub(super) fn attention(
        &self,
        a: AttentionArgs<'_>,
        part_o: &mut CudaSlice<f32>,
        part_ml: &mut CudaSlice<f32>,
        out: Option<AttnOut<'_>>,
        out_stride: usize,
    ) -> Result<()> {
        if a.rows == 0 {
            return Ok(());
        }
        let k = self.kernels;
        let heads_d = a.num_heads * a.head_dim;
        let per_launch = a.plan.rows_per_launch.min(a.rows);
        check_len(
            "paged_attention",
            "q",
            a.q.len(),
            (a.rows - 1) * a.q_stride + heads_d,
        )?;
        check_len("paged_attention", "tok_seq", a.tok_seq.len(), a.rows)?;
        check_len("paged_attention", "tok_pos", a.tok_pos.len(), a.rows)?;
        let partials = per_launch * a.num_heads * a.plan.num_splits;
        check_len(
            "paged_attention",
            "part_o",
            part_o.len(),
            partials * a.head_dim,
        )?;
        check_len("paged_attention", "part_ml", part_ml.len(), partials * 2)?;
        // The kernels' softmax is in base 2.
        let scale = std::f32::consts::LOG2_E * a.scale;
        let q_stride = a.q_stride as i32;
        let window = a.window as i32;
        let split_len = a.plan.split_len as i32;
        let groups = a.group_first.len().saturating_sub(1);
        let largest = a
            .group_first
            .windows(2)
            .map(|w| (w[1] - w[0]).max(0) as usize)
            .max()
            .unwrap_or(0);
        if a.group_first.first() != Some(&0)
            || a.group_first.last() != Some(&(a.rows as i32))
            || a.group_first.windows(2).any(|w| w[1] <= w[0])
        {
            return Err(Error::Backend(format!(
                "paged_attention: row groups {:?} do not cover {} rows",
                a.group_first, a.rows
            )));
        }
        check_len("paged_attention", "groups", a.groups.len(), groups + 1)?;
        // Groups of one row run the per-row kernels; larger ones (rows of
        // one prefill chunk) the tensor-core kernel whose warps hold several
        // A operands. A row's results are the same bits either way.
        let (func, block_dim, shared_mem_bytes, max_rows) = match &k.paged_attention_mma {
            Some(mma) if largest > mma.pack => (
                &mma.func_rows,
                (32 * mma.tuning.warps as u32, 1, 1),
                mma.smem_bytes,
                mma.frags * mma.pack,
            ),
            Some(mma) => (
                &mma.func,
                (32 * mma.tuning.warps as u32, 1, 1),
                mma.smem_bytes,
                mma.pack,
            ),
            None => (&k.paged_attention, (32, 1, 1), 0, 1),
        };
        if largest > max_rows || largest > a.plan.rows_per_launch {
            return Err(Error::Backend(format!(
                "paged_attention: a group of {largest} rows; the kernel takes {max_rows}, a launch {}",
                a.plan.rows_per_launch
            )));
        }
        let mut out = out;
        if let Some(AttnOut::Bf16(o)) = &out {
            let need = (a.rows - 1) * out_stride + heads_d;
            check_len("paged_attention", "out", o.len(), need)?;
        }
        let out_stride_i = out_stride as i32;
        for (g0, g1) in group_launches(a.group_first, a.plan.rows_per_launch) {
            let r0 = a.group_first[g0] as usize;
            let n = a.group_first[g1] as usize - r0;
            // With one split the kernel writes the bf16 rows itself (the
            // same bits the merge would), and no merge runs.
            let mut direct = match out.as_mut() {
                Some(AttnOut::Bf16(o)) if a.plan.num_splits == 1 => {
                    Some(o.slice_mut(r0 * out_stride..))
                }
                _ => None,
            };
            let q = a.q.slice(r0 * a.q_stride..);
            let tok_seq = a.tok_seq.slice(r0..);
            let tok_pos = a.tok_pos.slice(r0..);
            let group_first = a.groups.slice(g0..);
            let row_base = r0 as i32;
            // SAFETY: matches `paged_attention(const float* q, int q_stride,
            // float scale, const kv_t* arena, long long layer_off, long long
            // elems_per_block, const unsigned int* tables, const int*
            // seq_table_off, const int* seq_first_block, const int* tok_seq,
            // const int* tok_pos, const int* group_first, int row_base, int
            // window, int split_len, float* part_o, float* part_ml, act_t*
            // out, int out_stride)`, which `paged_attention_mma` and
            // `paged_attention_mma_rows` share (split_len is a multiple of
            // 32, so of their 16-key tiles). `out` is null, or (one split)
            // the bf16 output from row r0, which holds the launch's rows
            // at `out_stride` (checked above for all `a.rows`). The
            // launch covers groups g0..g1, whose rows r0..r0 + n (n ≤
            // `rows_per_launch`, each group within the kernel's group size,
            // checked above) index q, tok_seq and tok_pos from r0, and n ×
            // heads × splits partials (checked above). Each row reads the
            // keys of its window through its sequence's table:
            // `batch::validate` checked that every such position lies in a
            // listed block whose id is below the pool's block count (the
            // bench builds in-range tables itself); a group's rows are
            // consecutive rows of one sequence (`row_groups`).
            unsafe {
                let mut b = self.stream.launch_builder(func);
                b.arg(&q)
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
                    .arg(&group_first)
                    .arg(&row_base)
                    .arg(&window)
                    .arg(&split_len)
                    .arg(&mut *part_o)
                    .arg(&mut *part_ml);
                match direct.as_mut() {
                    Some(o) => b.arg(o),
                    None => b.arg(&NULL),
                };
                b.arg(&out_stride_i).launch(LaunchConfig {
                    grid_dim: (
                        a.plan.num_splits as u32,
                        a.num_kv_heads as u32,
                        (g1 - g0) as u32,
                    ),
                    block_dim,
                    shared_mem_bytes,
                })
            }
            .map_err(cuda_err("paged_attention"))?;
            if direct.is_some() {
                continue;
            }
            if let Some(out) = out.as_mut() {
                let merge = Merge {
                    num_splits: a.plan.num_splits,
                    rows: n,
                    heads: a.num_heads,
                    head_dim: a.head_dim,
                };
                match out {
                    #[cfg(feature = "bench")]
                    AttnOut::F32(o) => {
                        self.attention_combine(part_o, part_ml, merge, *o, r0, out_stride)?
                    }
                    AttnOut::Bf16(o) => {
                        self.attention_combine(part_o, part_ml, merge, *o, r0, out_stride)?
                    }
                }
            }
        }
        Ok(())
    }

    /// Merges the splits of `merge.rows` rows (every head) into rows
    /// `row0..` of `out` (row stride `out_stride`), f32 or bf16.
    fn attention_combine<T: CombineOut>(
        &self,
        part_o: &CudaSlice<f32>,
        part_ml: &CudaSlice<f32>,
        merge: Merge,
        out: &mut CudaSlice<T>,
        row0: usize,
        out_stride: usize,
    ) -> Result<()> {
        let Merge {
            num_splits,
            rows,
            heads,
            head_dim,
        } = merge;
        if rows == 0 {
            return Ok(());
        }
        let partials = rows * heads * num_splits;
        check_len(
            "attention_combine",
            "part_o",
            part_o.len(),
            partials * head_dim,
        )?;
        check_len("attention_combine", "part_ml", part_ml.len(), partials * 2)?;
        let need = (row0 + rows - 1) * out_stride + heads * head_dim;
        check_len("attention_combine", "out", out.len(), need)?;
        let mut dst = out.slice_mut(row0 * out_stride..);
        let (num_splits_i, out_stride_i) = (num_splits as i32, out_stride as i32);
        // SAFETY: matches `attention_combine(const float* part_o, const
        // float* part_ml, int num_splits, float* out, int out_stride)` (or
        // `attention_combine_bf16`, the same with `act_t* out`, which
        // `T::kernel` picks for bf16 `out`); the grid (rows × heads) reads
        // rows × heads × num_splits partials and writes rows rows of `out`
        // from `row0` (checked above).
        unsafe {
            self.stream
                .launch_builder(T::kernel(self.kernels))
                .arg(part_o)
                .arg(part_ml)
                .arg(&num_splits_i)
                .arg(&mut dst)
                .arg(&out_stride_i)
                .launch(LaunchConfig {
                    grid_dim: (rows as u32, heads as u32, 1),
                    block_dim: (head_dim.min(128) as u32, 1, 1),
                    shared_mem_bytes: 0,
                })
        }
        .map_err(cuda_err("attention_combine"))?;
        Ok(())
    }

    /// Fills `arena` with values in [-0.5, 0.5) hashed from (index, seed),
    /// on `ctas` blocks of 256 threads (the bench's K/V).
    #[cfg(feature = "bench")]
    pub(super) fn fill_random(
        &self,
        arena: &mut CudaSlice<u8>,
        seed: u32,
        ctas: u32,
    ) -> Result<()> {
        let n = (arena.len() / self.kernels.kv_elem_bytes) as i64;
        // SAFETY: matches `fill_random(kv_t* a, long long n, unsigned int
        // seed)`; the kernel's grid-stride loop stops at n, the arena's
        // elements.
        unsafe {
            self.stream
                .launch_builder(&self.kernels.fill_random)
                .arg(arena)
                .arg(&n)
                .arg(&seed)
                .launch(LaunchConfig {
                    grid_dim: (ctas.max(1), 1, 1),
                    block_dim: (256, 1, 1),
                    shared_mem_bytes: 0,
                })
        }
        .map_err(cuda_err("fill_random"))?;
        Ok(())
    }
}

/// Where the merged attention output goes: f32 rows (the kernel check) or
/// bf16 rows (the input of the output product).
#[derive(Debug)]
pub(super) enum AttnOut<'a> {
    #[cfg(feature = "bench")]
    F32(&'a mut CudaSlice<f32>),
    Bf16(&'a mut CudaSlice<bf16>),
}

/// Element types the merge writes, each with its kernel.
trait CombineOut: cudarc::driver::DeviceRepr {
    fn kernel(k: &Kernels) -> &cudarc::driver::CudaFunction;
}

#[cfg(feature = "bench")]
impl CombineOut for f32 {
    fn kernel(k: &Kernels) -> &cudarc::driver::CudaFunction {
        &k.attention_combine
    }
}

impl CombineOut for bf16 {
    fn kernel(k: &Kernels) -> &cudarc::driver::CudaFunction {
        &k.attention_combine_bf16
    }
}

/// The shape of one merge of attention splits.
#[derive(Debug, Clone, Copy)]
struct Merge {
    num_splits: usize,
    rows: usize,
    heads: usize,
    head_dim: usize,
}
