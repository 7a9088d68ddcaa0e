//! The CPU backend: an f32 arena in host memory, projections as batched
//! matrix products over every token of the batch, and paged attention in
//! parallel over (sequence, KV head, chunk of queries).

use rayon::prelude::*;

use super::{Backend, BatchLogits};
use crate::arena::{ArenaLayout, PoolGeometry};
use crate::batch::{Batch, KvCopy, PlannedSeq, PoolTable, TierDirection, TierMove};
use crate::error::{Error, Result};
use crate::model::ModelConfig;
use crate::model::weights::{Matrix, Weights};
use crate::ops::{self, Rope, Threads};

/// Queries per attention task.
const QUERY_CHUNK: usize = 16;

/// Keys per attention tile. Tiles start at multiples of `KEY_TILE` in
/// absolute positions and the products over them are row-exact, so a query
/// visits the same tiles with the same arithmetic whatever chunk or batch it
/// is computed in: a reused prefix gives bit-identical results to a
/// recomputed one. A task's buffers are bounded by the tile, not the
/// context.
const KEY_TILE: usize = 256;

/// The CPU backend.
#[derive(Debug)]
pub struct CpuBackend {
    pool: rayon::ThreadPool,
    state: CpuState,
    /// The host tier: one array per pool, `ArenaLayout` order, in the
    /// device arena's block layout (empty: no tier). On this backend both
    /// arenas are host memory; the tier is what the cache may keep beyond
    /// the device pool.
    host_kv: Vec<Vec<f32>>,
}

/// Everything but the threads, so a pass can borrow it mutably inside
/// `ThreadPool::install`.
#[derive(Debug)]
struct CpuState {
    weights: CpuWeights,
    layout: ArenaLayout,
    /// One array per pool, `ArenaLayout` order.
    kv: Vec<Vec<f32>>,
    /// The distinct RoPEs of the layers (one, or Gemma 3's global and
    /// local) and which one each layer uses.
    ropes: Vec<Rope>,
    layer_rope: Vec<usize>,
}

/// The weights in the layout the CPU pass wants: Q, K and V stacked into one
/// `[q_dim + 2 kv_dim, hidden]` matrix and gate and up into one
/// `[2 ffn, hidden]`, so each is one matrix product per layer (the same
/// bytes as [`Weights`], rearranged once at start-up; packed matrices stay
/// packed).
#[derive(Debug)]
struct CpuWeights {
    config: ModelConfig,
    embed: Matrix,
    layers: Vec<CpuLayer>,
    final_norm: Vec<f32>,
    lm_head: Option<Matrix>,
}

#[derive(Debug)]
struct CpuLayer {
    attn_norm: Vec<f32>,
    wqkv: Matrix,
    qkv_bias: Option<Vec<f32>>,
    qk_norm: Option<(Vec<f32>, Vec<f32>)>,
    wo: Matrix,
    mlp_norm: Vec<f32>,
    w_gate_up: Matrix,
    w_down: Matrix,
    post_norms: Option<(Vec<f32>, Vec<f32>)>,
}

impl CpuWeights {
    fn new(weights: Weights) -> Self {
        let layers = weights
            .layers
            .into_iter()
            .map(|l| CpuLayer {
                attn_norm: l.attn_norm,
                wqkv: Matrix::stack(&[&l.wq, &l.wk, &l.wv]),
                qkv_bias: l.qkv_bias,
                qk_norm: l.qk_norm,
                wo: l.wo,
                mlp_norm: l.mlp_norm,
                w_gate_up: Matrix::stack(&[&l.w_gate, &l.w_up]),
                w_down: l.w_down,
                post_norms: l.post_norms,
            })
            .collect();
        CpuWeights {
            config: weights.config,
            embed: weights.embed,
            layers,
            final_norm: weights.final_norm,
            lm_head: weights.lm_head,
        }
    }

    fn lm_head(&self) -> &Matrix {
        self.lm_head.as_ref().unwrap_or(&self.embed)
    }
}

impl CpuBackend {
    /// A backend with a zeroed arena of `layout`, computing on `threads`
    /// threads (0 = one per available core).
    pub fn new(weights: Weights, layout: ArenaLayout, threads: usize) -> Result<Self> {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(|i| format!("kvlease-cpu-{i}"))
            .build()
            .map_err(|e| Error::Config(format!("cannot start the compute threads: {e}")))?;
        let kv = layout.pools.iter().map(|p| vec![0.0; p.elems()]).collect();
        let (ropes, layer_rope) = layer_ropes(&weights.config);
        Ok(CpuBackend {
            pool,
            state: CpuState {
                weights: CpuWeights::new(weights),
                layout,
                kv,
                ropes,
                layer_rope,
            },
            host_kv: Vec::new(),
        })
    }

    /// Threads the backend computes on.
    pub fn threads(&self) -> usize {
        self.pool.current_num_threads()
    }
}

impl CpuState {
    fn run(&mut self, batch: &Batch) -> BatchLogits {
        // The arena is written per layer while the weights are read: split
        // the borrows.
        let CpuState {
            weights,
            layout,
            kv,
            ropes,
            layer_rope,
        } = self;
        for seq in &batch.seqs {
            for c in &seq.copies {
                copy_slots(&layout.pools[c.pool], &mut kv[c.pool], c);
            }
        }
        let cfg = &weights.config;
        let (h, qd, kvd, f) = (cfg.hidden_size, cfg.q_dim(), cfg.kv_dim(), cfg.ffn_size);
        let qkv_dim = qd + 2 * kvd;
        let t = batch.total_tokens();

        // Row r of every activation is one token; `first_row[s]` is the row
        // of sequence s's first token.
        let mut first_row = Vec::with_capacity(batch.seqs.len());
        let mut positions = Vec::with_capacity(t);
        let mut tokens = Vec::with_capacity(t);
        for seq in &batch.seqs {
            first_row.push(positions.len());
            positions.extend(seq.start_pos..seq.start_pos + seq.tokens.len());
            tokens.extend(seq.tokens.iter().map(|&tok| tok as usize));
        }
        let rope_tables: Vec<Vec<Vec<(f32, f32)>>> = ropes
            .iter()
            .map(|rope| positions.par_iter().map(|&p| rope.table(p)).collect())
            .collect();

        let arch = &cfg.arch;
        let mut x = vec![0.0f32; t * h];
        x.par_chunks_mut(h).zip(&tokens).for_each(|(row, &tok)| {
            weights.embed.row_into(tok, row);
            if arch.embed_scale != 1.0 {
                row.iter_mut().for_each(|v| *v *= arch.embed_scale);
            }
        });
        let mut normed = vec![0.0f32; t * h];
        // Row r: [q | k | v] of token r.
        let mut qkv = vec![0.0f32; t * qkv_dim];
        let mut attn = vec![0.0f32; t * qd];
        // Row r: [gate | up] of token r; the gated activation leaves its
        // result in `gate`.
        let mut gate_up = vec![0.0f32; t * 2 * f];
        // The attention or MLP output before its post-norm (Gemma).
        let mut branch = if arch.post_norms {
            vec![0.0f32; t * h]
        } else {
            Vec::new()
        };

        for (layer, lw) in weights.layers.iter().enumerate() {
            norm_rows(&x, &lw.attn_norm, cfg.rms_norm_eps, &mut normed, h);
            lw.wqkv
                .matmul(&normed, h, &mut qkv, (t, h, qkv_dim), false, Threads::Pool);
            // Bias, per-head norms, then RoPE; Q and K heads are
            // consecutive head_dim chunks: rotate them all.
            let d = cfg.head_dim;
            qkv.par_chunks_mut(qkv_dim)
                .zip(&rope_tables[layer_rope[layer]])
                .for_each(|(row, cs)| {
                    if let Some(bias) = &lw.qkv_bias {
                        row.iter_mut().zip(bias).for_each(|(v, b)| *v += b);
                    }
                    if let Some((q_norm, k_norm)) = &lw.qk_norm {
                        let (q, k) = row[..qd + kvd].split_at_mut(qd);
                        head_norms(q, q_norm, cfg.rms_norm_eps, d);
                        head_norms(k, k_norm, cfg.rms_norm_eps, d);
                    }
                    Rope::apply_table(&mut row[..qd + kvd], cs);
                });

            write_kv(layout, kv, batch, layer, &qkv, qkv_dim, qd);
            attend(
                cfg, layout, kv, batch, layer, &first_row, &qkv, qkv_dim, &mut attn,
            );

            // Residual adds ride on the products' accumulate flag, or
            // follow the post-norm.
            let post = lw.post_norms.as_ref();
            residual_product(
                &attn,
                qd,
                &lw.wo,
                (t, qd, h),
                post.map(|(attn_post, _)| attn_post),
                cfg.rms_norm_eps,
                &mut branch,
                &mut x,
            );
            norm_rows(&x, &lw.mlp_norm, cfg.rms_norm_eps, &mut normed, h);
            lw.w_gate_up.matmul(
                &normed,
                h,
                &mut gate_up,
                (t, h, 2 * f),
                false,
                Threads::Pool,
            );
            gate_up.par_chunks_mut(2 * f).for_each(|row| {
                let (gate, up) = row.split_at_mut(f);
                arch.activation.glu(gate, up);
            });
            residual_product(
                &gate_up,
                2 * f,
                &lw.w_down,
                (t, f, h),
                post.map(|(_, mlp_post)| mlp_post),
                cfg.rms_norm_eps,
                &mut branch,
                &mut x,
            );
        }

        // Only the rows that need logits go through the final norm and head.
        let rows: Vec<usize> = batch
            .seqs
            .iter()
            .zip(&first_row)
            .flat_map(|(seq, &row0)| {
                let n = seq.tokens.len();
                let skip = n - seq.logit_rows();
                (row0 + skip)..(row0 + n)
            })
            .collect();
        let r = rows.len();
        let mut final_rows = vec![0.0f32; r * h];
        final_rows
            .par_chunks_mut(h)
            .zip(&rows)
            .for_each(|(out, &row)| {
                ops::rms_norm(
                    &x[row * h..(row + 1) * h],
                    &weights.final_norm,
                    cfg.rms_norm_eps,
                    out,
                );
            });
        let vocab = cfg.vocab_size;
        let mut logits = vec![0.0f32; r * vocab];
        weights.lm_head().matmul(
            &final_rows,
            h,
            &mut logits,
            (r, h, vocab),
            false,
            Threads::Pool,
        );
        if let Some(cap) = arch.final_softcap {
            logits
                .par_chunks_mut(vocab)
                .for_each(|row| ops::soft_cap(row, cap));
        }
        BatchLogits {
            vocab,
            values: logits,
        }
    }
}

/// The distinct RoPEs of `cfg`'s layers and the index of each layer's.
fn layer_ropes(cfg: &ModelConfig) -> (Vec<Rope>, Vec<usize>) {
    let mut freqs: Vec<Vec<f64>> = Vec::new();
    let mut layer_rope = Vec::with_capacity(cfg.num_layers());
    for layer in 0..cfg.num_layers() {
        let f = cfg.layer_inv_freq(layer);
        let index = freqs.iter().position(|g| *g == f).unwrap_or_else(|| {
            freqs.push(f);
            freqs.len() - 1
        });
        layer_rope.push(index);
    }
    let ropes = (0..freqs.len())
        .map(|i| {
            let layer = layer_rope.iter().position(|&r| r == i).unwrap_or(0);
            Rope::from_inv_freq(cfg.layer_inv_freq(layer))
        })
        .collect();
    (ropes, layer_rope)
}

/// RMSNorm of every `d`-wide head of `x` with the one weight `w`, in place.
fn head_norms(x: &mut [f32], w: &[f32], eps: f32, d: usize) {
    let mut head = vec![0.0f32; d];
    for chunk in x.chunks_exact_mut(d) {
        head.copy_from_slice(chunk);
        ops::rms_norm(&head, w, eps, chunk);
    }
}

/// `x += input · wᵀ` (input rows `stride` apart), through `post_norm`
/// first when the layer has one (`branch` holds the product then).
#[allow(clippy::too_many_arguments)] // the product's operands and the norm's
fn residual_product(
    input: &[f32],
    stride: usize,
    w: &Matrix,
    (t, k, h): (usize, usize, usize),
    post_norm: Option<&Vec<f32>>,
    eps: f32,
    branch: &mut [f32],
    x: &mut [f32],
) {
    let Some(norm) = post_norm else {
        w.matmul(input, stride, x, (t, k, h), true, Threads::Pool);
        return;
    };
    w.matmul(input, stride, branch, (t, k, h), false, Threads::Pool);
    x.par_chunks_mut(h)
        .zip(branch.par_chunks(h))
        .for_each(|(x_row, b_row)| {
            let mut normed = vec![0.0f32; h];
            ops::rms_norm(b_row, norm, eps, &mut normed);
            x_row.iter_mut().zip(&normed).for_each(|(x, n)| *x += n);
        });
}

/// Copies the new K and V rows of `layer` (columns `k_col..` of `qkv`) into
/// their slots.
fn write_kv(
    layout: &ArenaLayout,
    kv: &mut [Vec<f32>],
    batch: &Batch,
    layer: usize,
    qkv: &[f32],
    qkv_dim: usize,
    k_col: usize,
) {
    let (pool, layer_slot) = layout.layer_slots[layer];
    let geometry = &layout.pools[pool];
    let arena = &mut kv[pool];
    let (d, b) = (geometry.head_dim, geometry.tokens_per_block);
    let kvd = geometry.num_kv_heads * d;
    let mut row = 0;
    for seq in &batch.seqs {
        let table = &seq.tables[pool];
        for pos in seq.start_pos..seq.start_pos + seq.tokens.len() {
            let block = table.block_for(pos, b);
            for head in 0..geometry.num_kv_heads {
                let src_k = row * qkv_dim + k_col + head * d;
                let dst_k = geometry.offset(block, layer_slot, 0, head, pos % b);
                arena[dst_k..dst_k + d].copy_from_slice(&qkv[src_k..src_k + d]);
                let src_v = src_k + kvd;
                let dst_v = geometry.offset(block, layer_slot, 1, head, pos % b);
                arena[dst_v..dst_v + d].copy_from_slice(&qkv[src_v..src_v + d]);
            }
            row += 1;
        }
    }
}

/// Paged attention of `layer` for every query row (the first `q_dim` columns
/// of `qkv`) into `out`.
#[allow(clippy::too_many_arguments)] // the pass's buffers, each used once
fn attend(
    cfg: &ModelConfig,
    layout: &ArenaLayout,
    kv: &[Vec<f32>],
    batch: &Batch,
    layer: usize,
    first_row: &[usize],
    qkv: &[f32],
    qkv_dim: usize,
    out: &mut [f32],
) {
    let (pool, layer_slot) = layout.layer_slots[layer];
    let ctx = AttnCtx {
        cfg,
        geometry: &layout.pools[pool],
        arena: &kv[pool],
        layer_slot,
        q: qkv,
        q_stride: qkv_dim,
    };
    let tasks: Vec<AttnTask<'_>> = batch
        .seqs
        .iter()
        .zip(first_row)
        .flat_map(|(seq, &row0)| {
            let chunks = seq.tokens.len().div_ceil(QUERY_CHUNK);
            (0..cfg.num_kv_heads).flat_map(move |kv_head| {
                (0..chunks).map(move |c| AttnTask {
                    seq,
                    table: &seq.tables[pool],
                    row0,
                    kv_head,
                    queries: c * QUERY_CHUNK..((c + 1) * QUERY_CHUNK).min(seq.tokens.len()),
                })
            })
        })
        .collect();
    let results: Vec<Vec<f32>> = tasks.par_iter().map(|task| ctx.run(task)).collect();

    let (d, qd) = (cfg.head_dim, cfg.q_dim());
    let group = cfg.num_heads / cfg.num_kv_heads;
    for (task, o) in tasks.iter().zip(results) {
        for (r, o_row) in o.chunks_exact(d).enumerate() {
            let i = task.queries.start + r / group;
            let head = task.kv_head * group + r % group;
            let dst = (task.row0 + i) * qd + head * d;
            out[dst..dst + d].copy_from_slice(o_row);
        }
    }
}

/// One attention task: some queries of one sequence against one KV head.
struct AttnTask<'a> {
    seq: &'a PlannedSeq,
    table: &'a PoolTable,
    /// Batch row of the sequence's first token.
    row0: usize,
    kv_head: usize,
    /// Indices into the sequence's tokens.
    queries: std::ops::Range<usize>,
}

/// What every attention task of one layer reads.
struct AttnCtx<'a> {
    cfg: &'a ModelConfig,
    geometry: &'a crate::arena::PoolGeometry,
    arena: &'a [f32],
    layer_slot: usize,
    /// Query rows: row r starts at `q[r * q_stride]`.
    q: &'a [f32],
    q_stride: usize,
}

impl AttnCtx<'_> {
    /// Output rows `[queries × group, head_dim]`, query-major.
    fn run(&self, task: &AttnTask<'_>) -> Vec<f32> {
        let cfg = self.cfg;
        let d = cfg.head_dim;
        let group = cfg.num_heads / cfg.num_kv_heads;
        let window = self.geometry.window;
        let start = task.seq.start_pos;
        let first_pos = start + task.queries.start;
        let last_pos = start + task.queries.end - 1;
        let lo = ops::window_start(first_pos, window);

        // Queries of the group's heads, pre-scaled by the softmax scale. The
        // products run over `padded` rows (zero queries past `rows`), enough
        // for `gemm`'s main kernel, so no call makes a padded copy per tile.
        let rows = task.queries.len() * group;
        let padded = rows
            .max(ops::exact_rows(KEY_TILE, d))
            .max(ops::exact_rows(d, KEY_TILE));
        let scale = cfg.attn_scale();
        let softcap = cfg.arch.attn_softcap;
        let mut queries = vec![0.0f32; padded * d];
        for (r, dst) in queries.chunks_exact_mut(d).take(rows).enumerate() {
            let i = task.queries.start + r / group;
            let head = task.kv_head * group + r % group;
            let src = (task.row0 + i) * self.q_stride + head * d;
            for (o, s) in dst.iter_mut().zip(&self.q[src..src + d]) {
                *o = s * scale;
            }
        }

        // Online softmax over the tiles: per row the running max, the
        // running sum of exponentials, and the unnormalised output.
        let mut max = vec![f32::NEG_INFINITY; rows];
        let mut sum = vec![0.0f32; rows];
        let mut acc = vec![0.0f32; rows * d];
        // Per row, this tile's rescale of the earlier tiles (None: the tile
        // holds none of the row's keys and leaves it untouched).
        let mut corr: Vec<Option<f32>> = vec![None; rows];
        let mut keys = vec![0.0f32; KEY_TILE * d];
        let mut values = vec![0.0f32; KEY_TILE * d];
        let mut scores = vec![0.0f32; padded * KEY_TILE];
        let mut pv = vec![0.0f32; padded * d];
        let mut tile0 = lo / KEY_TILE * KEY_TILE;
        while tile0 <= last_pos {
            let tile_last = tile0 + KEY_TILE - 1;
            let (from, to) = (lo.max(tile0), last_pos.min(tile_last));
            // Slots outside [from, to] hold zeros; every row masks them.
            keys[..(from - tile0) * d].fill(0.0);
            keys[(to + 1 - tile0) * d..].fill(0.0);
            values[..(from - tile0) * d].fill(0.0);
            values[(to + 1 - tile0) * d..].fill(0.0);
            self.gather(task, from, to, &mut keys[(from - tile0) * d..], 0);
            self.gather(task, from, to, &mut values[(from - tile0) * d..], 1);

            ops::matmul_wt(
                &queries,
                &keys,
                &mut scores,
                (padded, d, KEY_TILE),
                false,
                Threads::One,
            );
            for (r, row) in scores.chunks_exact_mut(KEY_TILE).take(rows).enumerate() {
                let p = first_pos + r / group;
                let first = ops::window_start(p, window).max(tile0);
                let last = p.min(tile_last);
                if first > last {
                    row.fill(0.0);
                    corr[r] = None;
                    continue;
                }
                if let Some(cap) = softcap {
                    ops::soft_cap(&mut row[first - tile0..=last - tile0], cap);
                }
                row[..first - tile0].fill(f32::NEG_INFINITY);
                row[last + 1 - tile0..].fill(f32::NEG_INFINITY);
                let new_max = row.iter().copied().fold(max[r], f32::max);
                let mut tile_sum = 0.0f32;
                for v in row.iter_mut() {
                    *v = (*v - new_max).exp();
                    tile_sum += *v;
                }
                let c = (max[r] - new_max).exp();
                sum[r] = sum[r] * c + tile_sum;
                max[r] = new_max;
                corr[r] = Some(c);
            }
            ops::matmul(
                &scores,
                &values,
                &mut pv,
                (padded, KEY_TILE, d),
                Threads::One,
            );
            for ((a, p), c) in acc.chunks_exact_mut(d).zip(pv.chunks_exact(d)).zip(&corr) {
                if let Some(c) = *c {
                    for (a, p) in a.iter_mut().zip(p) {
                        *a = *a * c + p;
                    }
                }
            }
            tile0 += KEY_TILE;
        }
        for (a, s) in acc.chunks_exact_mut(d).zip(&sum) {
            for v in a {
                *v /= s;
            }
        }
        acc
    }

    /// Copies K (`kv` 0) or V (1) of this task's head at positions
    /// `from..=to` into `dst`, one run of slots per block.
    fn gather(&self, task: &AttnTask<'_>, from: usize, to: usize, dst: &mut [f32], kv: usize) {
        let d = self.cfg.head_dim;
        let b = self.geometry.tokens_per_block;
        let mut pos = from;
        while pos <= to {
            let block = task.table.block_for(pos, b);
            let slot = pos % b;
            let run = (b - slot).min(to + 1 - pos);
            let at = (pos - from) * d;
            let src = self
                .geometry
                .offset(block, self.layer_slot, kv, task.kv_head, slot);
            dst[at..at + run * d].copy_from_slice(&self.arena[src..src + run * d]);
            pos += run;
        }
    }
}

fn norm_rows(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32], h: usize) {
    out.par_chunks_mut(h)
        .zip(x.par_chunks(h))
        .for_each(|(o, row)| ops::rms_norm(row, weight, eps, o));
}

/// Bytes of activations the CPU forward pass allocates for a batch of
/// `max_tokens` tokens (every position asking for logits) whose attention
/// tasks run on `threads` threads; the sizes mirror `CpuBackend::run` and
/// `AttnCtx::run` buffer by buffer.
pub fn activation_bytes(cfg: &ModelConfig, max_tokens: usize, threads: usize) -> u64 {
    let (h, qd, kvd, f, d) = (
        cfg.hidden_size,
        cfg.q_dim(),
        cfg.kv_dim(),
        cfg.ffn_size,
        cfg.head_dim,
    );
    let t = max_tokens;
    let half = d / 2;
    // x, normed, qkv, attn, the attention tasks' outputs, gate_up, and
    // the branch before a post-norm.
    let branch = if cfg.arch.post_norms { h } else { 0 };
    let per_token = 2 * h + 3 * qd + 2 * kvd + 2 * f + branch;
    // Per-token bookkeeping: position, token, a RoPE table per distinct RoPE.
    let ropes = layer_ropes(cfg).0.len();
    let per_token_bytes = per_token * 4 + 2 * 8 + ropes * half * 8;
    // Rows through the final norm and the LM head, their row index, and the
    // per-sequence copy of the logits the worker hands back.
    let logit_rows = t * ((h + 2 * cfg.vocab_size) * 4 + 8);
    // Validation's bookkeeping: one (pool, block, slot) write record and one
    // writer-map entry (key, value, hash-table control byte) per token and pool.
    let pools = cfg.pools().len();
    let bookkeeping = t * pools * (24 + 32 + 1);
    // One attention task: a tile of keys and of values, its scores, and
    // per row the queries, the tile's product with the values, the running
    // output, and max, sum and rescale.
    let group = cfg.num_heads / cfg.num_kv_heads;
    let rows = QUERY_CHUNK * group;
    let padded = rows
        .max(ops::exact_rows(KEY_TILE, d))
        .max(ops::exact_rows(d, KEY_TILE));
    let per_task =
        (2 * KEY_TILE * d + padded * KEY_TILE + 2 * padded * d + rows * d + 4 * rows) * 4;
    (t * per_token_bytes + logit_rows + bookkeeping + threads.max(1) * per_task) as u64
}

impl Backend for CpuBackend {
    fn name(&self) -> &'static str {
        "cpu"
    }

    fn device(&self) -> String {
        cpu_model_name()
    }

    fn kv_dtype(&self) -> &'static str {
        "f32"
    }

    fn forward(&mut self, batch: &Batch) -> Result<BatchLogits> {
        let state = &mut self.state;
        Ok(self.pool.install(|| state.run(batch)))
    }

    fn set_host_tier(&mut self, host_blocks: &[u32]) -> Result<()> {
        let layout = &self.state.layout;
        self.host_kv = layout
            .pools
            .iter()
            .zip(host_blocks.iter().copied().chain(std::iter::repeat(0)))
            .map(|(p, n)| vec![0.0; n as usize * p.elems_per_block()])
            .collect();
        Ok(())
    }

    fn tier_copies(&mut self, moves: &[TierMove]) -> Result<()> {
        for m in moves {
            let geometry = &self.state.layout.pools[m.pool];
            let n = geometry.elems_per_block();
            let (device, host) = (m.device as usize * n, m.host as usize * n);
            let device_kv = &mut self.state.kv[m.pool];
            let Some(host_kv) = self.host_kv.get_mut(m.pool) else {
                return Err(Error::Backend(format!("pool {} has no host tier", m.pool)));
            };
            if device + n > device_kv.len() || host + n > host_kv.len() {
                return Err(Error::Backend(format!(
                    "tier copy of pool {} out of range (device block {}, host block {})",
                    m.pool, m.device, m.host
                )));
            }
            match m.direction {
                TierDirection::Demote => {
                    host_kv[host..host + n].copy_from_slice(&device_kv[device..device + n]);
                }
                TierDirection::Onboard => {
                    device_kv[device..device + n].copy_from_slice(&host_kv[host..host + n]);
                }
                TierDirection::Spill | TierDirection::Load => {
                    return Err(Error::Backend(
                        "a disk-tier copy is not a device <-> host move".into(),
                    ));
                }
            }
        }
        Ok(())
    }

    fn supports_disk_tier(&self) -> bool {
        true
    }

    fn host_block_bytes(&self, pool: usize, host_block: u32) -> Result<Vec<u8>> {
        let n = self.state.layout.pools[pool].elems_per_block();
        let at = host_block as usize * n;
        let block = self
            .host_kv
            .get(pool)
            .and_then(|kv| kv.get(at..at + n))
            .ok_or_else(|| {
                Error::Backend(format!(
                    "host block {host_block} of pool {pool} is out of range"
                ))
            })?;
        Ok(block.iter().flat_map(|x| x.to_le_bytes()).collect())
    }

    fn device_block_bytes(&self, pool: usize, block: u32) -> Result<Vec<u8>> {
        let n = self.state.layout.pools[pool].elems_per_block();
        let at = block as usize * n;
        let data = self
            .state
            .kv
            .get(pool)
            .and_then(|kv| kv.get(at..at + n))
            .ok_or_else(|| {
                Error::Backend(format!(
                    "device block {block} of pool {pool} is out of range"
                ))
            })?;
        Ok(data.iter().flat_map(|x| x.to_le_bytes()).collect())
    }

    fn write_device_block(&mut self, pool: usize, device_block: u32, bytes: &[u8]) -> Result<()> {
        let n = self.state.layout.pools[pool].elems_per_block();
        let at = device_block as usize * n;
        let block = self
            .state
            .kv
            .get_mut(pool)
            .and_then(|kv| kv.get_mut(at..at + n))
            .filter(|_| bytes.len() == n * 4)
            .ok_or_else(|| {
                Error::Backend(format!(
                    "device block {device_block} of pool {pool}: out of range or {} bytes for {n} elements",
                    bytes.len()
                ))
            })?;
        for (x, b) in block.iter_mut().zip(bytes.chunks_exact(4)) {
            *x = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
        }
        Ok(())
    }
}

/// Partial-block reuse: copies slots `[0, c.slots)` of block `c.src` into
/// block `c.dst`, for every layer of the pool, K and V, every head (each a
/// contiguous run of `slots * head_dim` values in the block layout).
fn copy_slots(geometry: &PoolGeometry, kv: &mut [f32], c: &KvCopy) {
    let len = c.slots * geometry.head_dim;
    for layer_slot in 0..geometry.layers.len() {
        for k_or_v in 0..2 {
            for head in 0..geometry.num_kv_heads {
                let from = geometry.offset(c.src, layer_slot, k_or_v, head, 0);
                let to = geometry.offset(c.dst, layer_slot, k_or_v, head, 0);
                kv.copy_within(from..from + len, to);
            }
        }
    }
}

/// The CPU model from /proc/cpuinfo, or the architecture when unknown.
pub fn cpu_model_name() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|info| {
            info.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split(':').nth(1))
                .map(|s| s.trim().to_string())
        })
        .unwrap_or_else(|| std::env::consts::ARCH.to_string())
}
