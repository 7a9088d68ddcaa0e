//! A dense reference of the same model: one token at a time, contiguous K/V
//! per sequence, plain loops. It shares the weight structs and the small
//! elementwise helpers with the paged path, and no attention or projection
//! code, so tests can hold the paged backend to it.

use crate::model::weights::Weights;
use crate::ops::{Rope, rms_norm, softmax, swiglu, window_start};

/// The K/V of one sequence, every layer, every position so far.
#[derive(Debug, Clone, Default)]
pub struct DenseSequence {
    /// Per layer, `[position][kv_dim]` flattened.
    keys: Vec<Vec<f32>>,
    values: Vec<Vec<f32>>,
    len: usize,
}

impl DenseSequence {
    /// Positions run so far.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether nothing has run yet.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// The dense reference model.
#[derive(Debug)]
pub struct DenseModel<'w> {
    weights: &'w Weights,
    rope: Rope,
}

impl<'w> DenseModel<'w> {
    /// A reference over `weights`.
    pub fn new(weights: &'w Weights) -> Self {
        let c = &weights.config;
        DenseModel {
            weights,
            rope: Rope::for_model(c),
        }
    }

    /// An empty sequence.
    pub fn sequence(&self) -> DenseSequence {
        let layers = self.weights.config.num_layers();
        DenseSequence {
            keys: vec![Vec::new(); layers],
            values: vec![Vec::new(); layers],
            len: 0,
        }
    }

    /// Runs `tokens` after what `seq` holds; returns the logits after each.
    pub fn forward(&self, seq: &mut DenseSequence, tokens: &[u32]) -> Vec<Vec<f32>> {
        tokens.iter().map(|&t| self.step(seq, t)).collect()
    }

    fn step(&self, seq: &mut DenseSequence, token: u32) -> Vec<f32> {
        let w = self.weights;
        let c = &w.config;
        let (h, d) = (c.hidden_size, c.head_dim);
        let (qd, kvd) = (c.q_dim(), c.kv_dim());
        let group = c.num_heads / c.num_kv_heads;
        let pos = seq.len;
        let tok = token as usize;
        let mut x = vec![0.0; h];
        w.embed.row_into(tok, &mut x);
        let mut normed = vec![0.0; h];
        for (layer, lw) in w.layers.iter().enumerate() {
            rms_norm(&x, &lw.attn_norm, c.rms_norm_eps, &mut normed);
            let mut q = matvec(&lw.wq.f32(), &normed, qd);
            let mut k = matvec(&lw.wk.f32(), &normed, kvd);
            let v = matvec(&lw.wv.f32(), &normed, kvd);
            self.rope.apply(&mut q, pos);
            self.rope.apply(&mut k, pos);
            seq.keys[layer].extend_from_slice(&k);
            seq.values[layer].extend_from_slice(&v);

            let first = window_start(pos, c.layer_windows[layer]);
            let mut attn = vec![0.0; qd];
            for head in 0..c.num_heads {
                let kv_head = head / group;
                let qh = &q[head * d..(head + 1) * d];
                let mut scores: Vec<f32> = (first..=pos)
                    .map(|p| {
                        let kh = &seq.keys[layer][p * kvd + kv_head * d..][..d];
                        qh.iter().zip(kh).map(|(a, b)| a * b).sum::<f32>() / (d as f32).sqrt()
                    })
                    .collect();
                softmax(&mut scores);
                let out = &mut attn[head * d..(head + 1) * d];
                for (p, s) in (first..=pos).zip(&scores) {
                    let vh = &seq.values[layer][p * kvd + kv_head * d..][..d];
                    for (o, v) in out.iter_mut().zip(vh) {
                        *o += s * v;
                    }
                }
            }
            add(&mut x, &matvec(&lw.wo.f32(), &attn, h));

            rms_norm(&x, &lw.mlp_norm, c.rms_norm_eps, &mut normed);
            let mut gate = matvec(&lw.w_gate.f32(), &normed, c.ffn_size);
            let up = matvec(&lw.w_up.f32(), &normed, c.ffn_size);
            swiglu(&mut gate, &up);
            add(&mut x, &matvec(&lw.w_down.f32(), &gate, h));
        }
        seq.len += 1;
        rms_norm(&x, &w.final_norm, c.rms_norm_eps, &mut normed);
        matvec(&w.lm_head().f32(), &normed, c.vocab_size)
    }
}

/// `w[rows, x.len()] · x`.
fn matvec(w: &[f32], x: &[f32], rows: usize) -> Vec<f32> {
    let cols = x.len();
    (0..rows)
        .map(|r| {
            w[r * cols..(r + 1) * cols]
                .iter()
                .zip(x)
                .map(|(a, b)| a * b)
                .sum()
        })
        .collect()
}

fn add(x: &mut [f32], y: &[f32]) {
    for (a, b) in x.iter_mut().zip(y) {
        *a += b;
    }
}
