//! What goes to the device: the weights once, the activation buffers once
//! (sized for the largest batch), and each batch's row and table metadata.

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, DeviceRepr};
use half::bf16;
use rayon::prelude::*;

use super::cuda_err;
use super::gemm::padded_rows;
use super::kernels::row_groups;
use crate::arena::ArenaLayout;
use crate::batch::Batch;
use crate::error::Result;
use crate::model::ModelConfig;
use crate::model::weights::Weights;

fn upload<T: DeviceRepr>(
    stream: &Arc<CudaStream>,
    v: &[T],
    what: &'static str,
) -> Result<CudaSlice<T>> {
    stream.clone_htod(v).map_err(cuda_err(what))
}

/// `parts` back to back, rounded to bf16 (nearest even).
fn bf16_concat(parts: &[&[f32]]) -> Vec<bf16> {
    let mut out = Vec::with_capacity(parts.iter().map(|p| p.len()).sum());
    for p in parts {
        out.par_extend(p.par_iter().map(|&v| bf16::from_f32(v)));
    }
    out
}

/// One layer's weights: the matrices in bf16 (the products' operand type),
/// Q/K/V and gate/up concatenated so each is one product; the norms in f32.
#[derive(Debug)]
pub(super) struct DeviceLayer {
    pub(super) attn_norm: CudaSlice<f32>,
    pub(super) wqkv: CudaSlice<bf16>,
    pub(super) wo: CudaSlice<bf16>,
    pub(super) mlp_norm: CudaSlice<f32>,
    pub(super) w_gate_up: CudaSlice<bf16>,
    pub(super) w_down: CudaSlice<bf16>,
    /// Q/K/V biases (Qwen2), f32.
    pub(super) qkv_bias: Option<CudaSlice<f32>>,
    /// Per-head norms of Q and K (Qwen3, Gemma 3).
    pub(super) qk_norm: Option<(CudaSlice<f32>, CudaSlice<f32>)>,
    /// Norms of the attention and MLP outputs (Gemma).
    pub(super) post_norms: Option<(CudaSlice<f32>, CudaSlice<f32>)>,
}

impl DeviceLayer {
    /// Bytes of the layer on the device.
    fn bytes(&self) -> u64 {
        let f32_bytes = |v: &CudaSlice<f32>| v.len() as u64 * 4;
        let bf16_bytes = |v: &CudaSlice<bf16>| v.len() as u64 * 2;
        let pair = |p: &Option<(CudaSlice<f32>, CudaSlice<f32>)>| {
            p.as_ref().map_or(0, |(a, b)| f32_bytes(a) + f32_bytes(b))
        };
        f32_bytes(&self.attn_norm)
            + f32_bytes(&self.mlp_norm)
            + self.qkv_bias.as_ref().map_or(0, f32_bytes)
            + pair(&self.qk_norm)
            + pair(&self.post_norms)
            + bf16_bytes(&self.wqkv)
            + bf16_bytes(&self.wo)
            + bf16_bytes(&self.w_gate_up)
            + bf16_bytes(&self.w_down)
    }
}

/// The model's weights in device memory. Host weights stay f32 whatever
/// their source; they are rounded to bf16 here, on upload.
#[derive(Debug)]
pub(super) struct DeviceWeights {
    /// The embedding table, f32: the lookup copies rows of it into the f32
    /// residual stream.
    pub(super) embed: CudaSlice<f32>,
    pub(super) layers: Vec<DeviceLayer>,
    pub(super) final_norm: CudaSlice<f32>,
    /// The LM head in bf16: its own matrix, or the embedding when tied.
    pub(super) head: CudaSlice<bf16>,
    /// Bytes of all of the above.
    pub(super) bytes: u64,
}

impl DeviceWeights {
    pub(super) fn upload(stream: &Arc<CudaStream>, weights: &Weights) -> Result<Self> {
        let up = |v: &[f32]| upload(stream, v, "upload");
        let up_bf16 = |parts: &[&[f32]]| upload(stream, &bf16_concat(parts), "upload");
        let up_pair = |p: &Option<(Vec<f32>, Vec<f32>)>| -> Result<_> {
            p.as_ref().map(|(a, b)| Ok((up(a)?, up(b)?))).transpose()
        };
        let layers = weights
            .layers
            .iter()
            .map(|l| {
                Ok(DeviceLayer {
                    attn_norm: up(&l.attn_norm)?,
                    wqkv: up_bf16(&[&l.wq.f32(), &l.wk.f32(), &l.wv.f32()])?,
                    wo: up_bf16(&[&l.wo.f32()])?,
                    mlp_norm: up(&l.mlp_norm)?,
                    w_gate_up: up_bf16(&[&l.w_gate.f32(), &l.w_up.f32()])?,
                    w_down: up_bf16(&[&l.w_down.f32()])?,
                    qkv_bias: l.qkv_bias.as_deref().map(up).transpose()?,
                    qk_norm: up_pair(&l.qk_norm)?,
                    post_norms: up_pair(&l.post_norms)?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let head = up_bf16(&[&weights.lm_head().f32()])?;
        let f32_bytes = |v: &CudaSlice<f32>| v.len() as u64 * 4;
        let bf16_bytes = |v: &CudaSlice<bf16>| v.len() as u64 * 2;
        let embed = up(&weights.embed.f32())?;
        let final_norm = up(&weights.final_norm)?;
        let bytes = f32_bytes(&embed)
            + f32_bytes(&final_norm)
            + bf16_bytes(&head)
            + layers.iter().map(DeviceLayer::bytes).sum::<u64>();
        Ok(DeviceWeights {
            embed,
            layers,
            final_norm,
            head,
            bytes,
        })
    }

    /// Bytes a decode step must read of the weights: every matrix and norm
    /// (not the embedding table, of which it reads one row per sequence).
    pub(super) fn bytes_read_per_step(&self) -> u64 {
        self.bytes - self.embed.len() as u64 * 4
    }
}

/// (query row × split) pairs the attention partials hold.
pub(super) fn part_capacity(max_tokens: usize) -> usize {
    max_tokens.max(4096)
}

/// Activation buffers, allocated once for the largest batch. The residual
/// stream, Q/K/V, the gate/up products and the logits are f32; what feeds a
/// product (normed rows, attention output, SwiGLU output) is bf16.
#[derive(Debug)]
pub(super) struct Activations {
    pub(super) x: CudaSlice<f32>,
    pub(super) normed: CudaSlice<bf16>,
    pub(super) qkv: CudaSlice<f32>,
    pub(super) attn: CudaSlice<bf16>,
    pub(super) gate_up: CudaSlice<f32>,
    pub(super) act: CudaSlice<bf16>,
    pub(super) final_rows: CudaSlice<bf16>,
    pub(super) logits: CudaSlice<f32>,
    /// The argmax of every logits row, when the pass picks tokens on the
    /// device.
    pub(super) argmax: CudaSlice<u32>,
    pub(super) part_o: CudaSlice<f32>,
    pub(super) part_ml: CudaSlice<f32>,
    /// The attention or MLP output before its post-norm (Gemma; empty
    /// otherwise).
    pub(super) branch: CudaSlice<f32>,
    /// RoPE frequencies: the model's, and those of its sliding-window
    /// layers when they differ (Gemma 3).
    pub(super) inv_freq: CudaSlice<f32>,
    pub(super) inv_freq_local: Option<CudaSlice<f32>>,
    /// (row × split) pairs `part_o` and `part_ml` hold.
    pub(super) part_cap: usize,
    /// Bytes of all of the above.
    pub(super) bytes: u64,
}

impl Activations {
    /// Buffers for batches of up to `max_tokens` rows of `cfg`.
    pub(super) fn alloc(
        stream: &Arc<CudaStream>,
        cfg: &ModelConfig,
        max_tokens: usize,
    ) -> Result<Self> {
        let (h, qd, kvd, f, d) = (
            cfg.hidden_size,
            cfg.q_dim(),
            cfg.kv_dim(),
            cfg.ffn_size,
            cfg.head_dim,
        );
        // Activations have whole GEMM_ROWS calls of rows (see `Products::linear`).
        let t = padded_rows(max_tokens.max(1));
        let part_cap = part_capacity(t);
        let zeros = |n: usize| stream.alloc_zeros::<f32>(n).map_err(cuda_err("alloc"));
        let zeros_bf16 = |n: usize| stream.alloc_zeros::<bf16>(n).map_err(cuda_err("alloc"));
        // The same frequencies as the CPU pass, RoPE scaling (llama3, GGUF
        // frequency factors) included.
        let to_f32 = |freqs: Vec<f64>| -> Vec<f32> { freqs.iter().map(|&f| f as f32).collect() };
        let inv_freq = to_f32(cfg.rope_inv_freq());
        let local = cfg
            .layer_windows
            .iter()
            .position(|&w| w > 0)
            .map(|layer| to_f32(cfg.layer_inv_freq(layer)))
            .filter(|local| *local != inv_freq);
        let branch = if cfg.arch.post_norms { t * h } else { 0 };
        let f32_elems = t * (h + qd + 2 * kvd + 2 * f + cfg.vocab_size)
            + branch
            + part_cap * cfg.num_heads * (d + 2)
            + d / 2 * (1 + usize::from(local.is_some()));
        let bf16_elems = t * (2 * h + qd + f);
        Ok(Activations {
            x: zeros(t * h)?,
            normed: zeros_bf16(t * h)?,
            qkv: zeros(t * (qd + 2 * kvd))?,
            attn: zeros_bf16(t * qd)?,
            gate_up: zeros(t * 2 * f)?,
            act: zeros_bf16(t * f)?,
            final_rows: zeros_bf16(t * h)?,
            logits: zeros(t * cfg.vocab_size)?,
            argmax: stream.alloc_zeros::<u32>(t).map_err(cuda_err("alloc"))?,
            part_o: zeros(part_cap * cfg.num_heads * d)?,
            part_ml: zeros(part_cap * cfg.num_heads * 2)?,
            // At least one element, so the buffer exists without post-norms.
            branch: zeros(branch.max(1))?,
            inv_freq: upload(stream, &inv_freq, "upload")?,
            inv_freq_local: local.map(|l| upload(stream, &l, "upload")).transpose()?,
            part_cap,
            bytes: f32_elems as u64 * 4 + bf16_elems as u64 * 2 + t as u64 * 4,
        })
    }
}

/// One pool's tables for a batch: every sequence's block ids back to back,
/// where each sequence's start, and the element offset of every row's
/// (block, slot).
#[derive(Debug)]
pub(super) struct PoolBatch {
    pub(super) tables: CudaSlice<u32>,
    pub(super) table_off: CudaSlice<i32>,
    pub(super) first_block: CudaSlice<i32>,
    pub(super) dst_base: CudaSlice<i64>,
    /// Most keys any row of the batch attends in this pool.
    pub(super) max_keys: usize,
    /// The attention kernel's row groups (`kernels::row_groups`), on the
    /// host and on the device.
    pub(super) group_first: Vec<i32>,
    pub(super) groups: CudaSlice<i32>,
}

/// A validated batch's metadata in device memory.
#[derive(Debug)]
pub(super) struct DeviceBatch {
    /// Rows (input tokens of every sequence, and any padding rows).
    pub(super) rows: usize,
    pub(super) tokens: CudaSlice<u32>,
    pub(super) positions: CudaSlice<i32>,
    /// Sequence index of every row.
    pub(super) tok_seq: CudaSlice<i32>,
    /// The rows whose logits the batch returns.
    pub(super) logit_rows: CudaSlice<u32>,
    pub(super) num_logit_rows: usize,
    /// Indexed like `ArenaLayout::pools`.
    pub(super) pools: Vec<PoolBatch>,
}

/// One pool's part of [`BatchMeta`].
#[derive(Debug)]
pub(super) struct PoolMeta {
    tables: Vec<u32>,
    table_off: Vec<i32>,
    first_block: Vec<i32>,
    dst_base: Vec<i64>,
    pub(super) max_keys: usize,
    group_first: Vec<i32>,
}

/// A validated batch's metadata on the host, as [`DeviceBatch`] holds it
/// on the device.
#[derive(Debug)]
pub(super) struct BatchMeta {
    rows: usize,
    tokens: Vec<u32>,
    positions: Vec<i32>,
    tok_seq: Vec<i32>,
    logit_rows: Vec<u32>,
    pub(super) pools: Vec<PoolMeta>,
}

impl BatchMeta {
    /// Rows, padding included.
    pub(super) fn rows(&self) -> usize {
        self.rows
    }

    /// The metadata of `batch`, which passed [`crate::batch::validate`]
    /// against `layout`; a pool's attention row groups hold at most
    /// `max_group(window, max_keys)` rows.
    ///
    /// With `rows` above the batch's token count, the last row is repeated
    /// up to `rows` rows, each a logit row and an attention group of its
    /// own: a padding row computes what the row it copies computes, bit for
    /// bit (every kernel and product treats rows alone), so its K/V writes
    /// land on that row's slot with the same values, and its outputs are
    /// never read.
    pub(super) fn build(
        batch: &Batch,
        layout: &ArenaLayout,
        cfg: &ModelConfig,
        max_group: impl Fn(u32, usize) -> usize,
        rows: usize,
    ) -> Self {
        let t = batch.total_tokens();
        let pad = rows.saturating_sub(t);
        let b = cfg.tokens_per_block as usize;
        let d = cfg.head_dim;
        let mut tokens = Vec::with_capacity(t + pad);
        let mut positions = Vec::with_capacity(t + pad);
        let mut tok_seq = Vec::with_capacity(t + pad);
        let mut logit_rows: Vec<u32> = Vec::with_capacity(batch.seqs.len() + pad);
        for (s, seq) in batch.seqs.iter().enumerate() {
            let row0 = tokens.len();
            tokens.extend(seq.tokens.iter().copied());
            positions.extend((seq.start_pos..seq.start_pos + seq.tokens.len()).map(|p| p as i32));
            tok_seq.extend(std::iter::repeat_n(s as i32, seq.tokens.len()));
            let n = seq.tokens.len();
            logit_rows.extend(((row0 + n - seq.logit_rows())..(row0 + n)).map(|r| r as u32));
        }
        if let (Some(&tok), Some(&pos), Some(&seq)) =
            (tokens.last(), positions.last(), tok_seq.last())
        {
            tokens.resize(t + pad, tok);
            positions.resize(t + pad, pos);
            tok_seq.resize(t + pad, seq);
            logit_rows.extend((t..t + pad).map(|r| r as u32));
        }
        let mut pools = Vec::with_capacity(layout.pools.len());
        for geometry in &layout.pools {
            let pi = pools.len();
            let mut flat = Vec::new();
            let mut offs = Vec::with_capacity(batch.seqs.len());
            let mut firsts = Vec::with_capacity(batch.seqs.len());
            let mut dst = Vec::with_capacity(t + pad);
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
            if let Some(&last) = dst.last() {
                dst.resize(t + pad, last);
            }
            if flat.is_empty() {
                flat.push(0);
            }
            let mut group_first = row_groups(
                batch.seqs.iter().map(|s| s.tokens.len()),
                max_group(geometry.window, max_keys),
            );
            group_first.extend((t + 1..=t + pad).map(|r| r as i32));
            pools.push(PoolMeta {
                tables: flat,
                table_off: offs,
                first_block: firsts,
                dst_base: dst,
                max_keys,
                group_first,
            });
        }
        BatchMeta {
            rows: tokens.len(),
            tokens,
            positions,
            tok_seq,
            logit_rows,
            pools,
        }
    }
}

impl DeviceBatch {
    /// `meta` in freshly allocated device buffers.
    pub(super) fn upload(stream: &Arc<CudaStream>, meta: BatchMeta) -> Result<Self> {
        let pools = meta
            .pools
            .into_iter()
            .map(|p| {
                Ok(PoolBatch {
                    groups: upload(stream, &p.group_first, "upload batch")?,
                    group_first: p.group_first,
                    tables: upload(stream, &p.tables, "upload batch")?,
                    table_off: upload(stream, &p.table_off, "upload batch")?,
                    first_block: upload(stream, &p.first_block, "upload batch")?,
                    dst_base: upload(stream, &p.dst_base, "upload batch")?,
                    max_keys: p.max_keys,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(DeviceBatch {
            rows: meta.rows,
            tokens: upload(stream, &meta.tokens, "upload batch")?,
            positions: upload(stream, &meta.positions, "upload batch")?,
            tok_seq: upload(stream, &meta.tok_seq, "upload batch")?,
            num_logit_rows: meta.logit_rows.len(),
            logit_rows: upload(stream, &meta.logit_rows, "upload batch")?,
            pools,
        })
    }

    /// Zeroed buffers of `room` times the lengths `meta` needs, and room
    /// for at least `min_rows` rows (no rows yet): room for batches like it
    /// to come, see [`Self::overwrite`].
    pub(super) fn alloc_for(
        stream: &Arc<CudaStream>,
        meta: &BatchMeta,
        room: usize,
        min_rows: usize,
    ) -> Result<Self> {
        fn zeros<T: DeviceRepr + cudarc::driver::ValidAsZeroBits>(
            stream: &Arc<CudaStream>,
            n: usize,
        ) -> Result<CudaSlice<T>> {
            stream
                .alloc_zeros::<T>(n.max(1))
                .map_err(cuda_err("alloc batch"))
        }
        let room = room.max(1);
        let rows = (meta.rows * room).max(min_rows);
        let pools = meta
            .pools
            .iter()
            .map(|p| {
                Ok(PoolBatch {
                    groups: zeros(stream, (p.group_first.len() * room).max(rows + 1))?,
                    group_first: Vec::new(),
                    tables: zeros(stream, p.tables.len() * room)?,
                    table_off: zeros(stream, (p.table_off.len() * room).max(rows))?,
                    first_block: zeros(stream, (p.first_block.len() * room).max(rows))?,
                    dst_base: zeros(stream, rows)?,
                    max_keys: 1,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(DeviceBatch {
            rows: 0,
            tokens: zeros(stream, rows)?,
            positions: zeros(stream, rows)?,
            tok_seq: zeros(stream, rows)?,
            num_logit_rows: 0,
            logit_rows: zeros(stream, (meta.logit_rows.len() * room).max(rows))?,
            pools,
        })
    }

    /// Copies `meta` into this batch's buffers, which keep their device
    /// addresses (a captured graph reads them there); false, with nothing
    /// copied, when a buffer is too short for it.
    pub(super) fn overwrite(&mut self, stream: &Arc<CudaStream>, meta: &BatchMeta) -> Result<bool> {
        let fits = self.tokens.len() >= meta.rows
            && self.positions.len() >= meta.rows
            && self.tok_seq.len() >= meta.rows
            && self.logit_rows.len() >= meta.logit_rows.len()
            && self.pools.len() == meta.pools.len()
            && self.pools.iter().zip(&meta.pools).all(|(d, h)| {
                d.tables.len() >= h.tables.len()
                    && d.table_off.len() >= h.table_off.len()
                    && d.first_block.len() >= h.first_block.len()
                    && d.dst_base.len() >= h.dst_base.len()
                    && d.groups.len() >= h.group_first.len()
            });
        if !fits {
            return Ok(false);
        }
        fn copy<T: DeviceRepr>(
            stream: &Arc<CudaStream>,
            src: &[T],
            dst: &mut CudaSlice<T>,
        ) -> Result<()> {
            stream
                .memcpy_htod(src, &mut dst.slice_mut(..src.len()))
                .map_err(cuda_err("upload batch"))
        }
        copy(stream, &meta.tokens, &mut self.tokens)?;
        copy(stream, &meta.positions, &mut self.positions)?;
        copy(stream, &meta.tok_seq, &mut self.tok_seq)?;
        copy(stream, &meta.logit_rows, &mut self.logit_rows)?;
        for (d, h) in self.pools.iter_mut().zip(&meta.pools) {
            copy(stream, &h.tables, &mut d.tables)?;
            copy(stream, &h.table_off, &mut d.table_off)?;
            copy(stream, &h.first_block, &mut d.first_block)?;
            copy(stream, &h.dst_base, &mut d.dst_base)?;
            copy(stream, &h.group_first, &mut d.groups)?;
            d.group_first.clone_from(&h.group_first);
            d.max_keys = h.max_keys;
        }
        self.rows = meta.rows;
        self.num_logit_rows = meta.logit_rows.len();
        Ok(true)
    }
}
