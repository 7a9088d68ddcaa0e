//! A dense reference of the same model: one token at a time, contiguous K/V
//! per sequence, plain loops. It shares the weight structs and the small
//! elementwise helpers with the paged path, and no attention or projection
//! code, so tests can hold the paged backend to it. [`max_abs_diff`] and
//! [`relative_error`] are the yardsticks they measure with (a NaN
//! anywhere gives NaN, which fails every tolerance).

use crate::model::weights::Weights;
use crate::ops::{Rope, rms_norm, soft_cap, softmax, window_start};

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
    /// One per layer.
    ropes: Vec<Rope>,
}

impl<'w> DenseModel<'w> {
    /// A reference over `weights`.
    pub fn new(weights: &'w Weights) -> Self {
        let c = &weights.config;
        DenseModel {
            weights,
            ropes: (0..c.num_layers())
                .map(|l| Rope::from_inv_freq(c.layer_inv_freq(l)))
                .collect(),
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
        let eps = c.rms_norm_eps;
        let mut x = vec![0.0; h];
        w.embed.row_into(tok, &mut x);
        for v in &mut x {
            *v *= c.arch.embed_scale;
        }
        let mut normed = vec![0.0; h];
        for (layer, lw) in w.layers.iter().enumerate() {
            rms_norm(&x, &lw.attn_norm, eps, &mut normed);
            let mut q = matvec(&lw.wq.f32(), &normed, qd);
            let mut k = matvec(&lw.wk.f32(), &normed, kvd);
            let mut v = matvec(&lw.wv.f32(), &normed, kvd);
            if let Some(bias) = &lw.qkv_bias {
                add(&mut q, &bias[..qd]);
                add(&mut k, &bias[qd..qd + kvd]);
                add(&mut v, &bias[qd + kvd..]);
            }
            if let Some((q_norm, k_norm)) = &lw.qk_norm {
                for (heads, weight) in [(&mut q, q_norm), (&mut k, k_norm)] {
                    for head in heads.chunks_exact_mut(d) {
                        let plain = head.to_vec();
                        rms_norm(&plain, weight, eps, head);
                    }
                }
            }
            self.ropes[layer].apply(&mut q, pos);
            self.ropes[layer].apply(&mut k, pos);
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
                        qh.iter().zip(kh).map(|(a, b)| a * b).sum::<f32>() * c.attn_scale()
                    })
                    .collect();
                if let Some(cap) = c.arch.attn_softcap {
                    soft_cap(&mut scores, cap);
                }
                softmax(&mut scores);
                let out = &mut attn[head * d..(head + 1) * d];
                for (p, s) in (first..=pos).zip(&scores) {
                    let vh = &seq.values[layer][p * kvd + kv_head * d..][..d];
                    for (o, v) in out.iter_mut().zip(vh) {
                        *o += s * v;
                    }
                }
            }
            let post = lw.post_norms.as_ref();
            let out = matvec(&lw.wo.f32(), &attn, h);
            add(&mut x, &post_norm(out, post.map(|p| &p.0), eps));

            rms_norm(&x, &lw.mlp_norm, eps, &mut normed);
            let mut gate = matvec(&lw.w_gate.f32(), &normed, c.ffn_size);
            let up = matvec(&lw.w_up.f32(), &normed, c.ffn_size);
            c.arch.activation.glu(&mut gate, &up);
            let out = matvec(&lw.w_down.f32(), &gate, h);
            add(&mut x, &post_norm(out, post.map(|p| &p.1), eps));
        }
        seq.len += 1;
        rms_norm(&x, &w.final_norm, eps, &mut normed);
        let mut logits = matvec(&w.lm_head().f32(), &normed, c.vocab_size);
        if let Some(cap) = c.arch.final_softcap {
            soft_cap(&mut logits, cap);
        }
        logits
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

/// `out` through `norm` when there is one (Gemma's post-norms).
fn post_norm(out: Vec<f32>, norm: Option<&Vec<f32>>, eps: f32) -> Vec<f32> {
    match norm {
        Some(w) => {
            let mut normed = vec![0.0; out.len()];
            rms_norm(&out, w, eps, &mut normed);
            normed
        }
        None => out,
    }
}

fn add(x: &mut [f32], y: &[f32]) {
    for (a, b) in x.iter_mut().zip(y) {
        *a += b;
    }
}

// === comparisons ===

/// The larger of `m` and `v`, NaN as soon as either is: `f32::max` returns
/// the other operand for a NaN, so a fold with it scores an all-NaN output
/// as 0 and lets it pass every tolerance. Tests keep their worst error
/// with it.
pub fn nan_max(m: f32, v: f32) -> f32 {
    if m.is_nan() || v.is_nan() {
        f32::NAN
    } else {
        m.max(v)
    }
}

/// max |v| over `values` (0 when empty); NaN when any value is NaN.
pub fn max_abs(values: &[f32]) -> f32 {
    values.iter().fold(0.0, |m, v| nan_max(m, v.abs()))
}

/// max |a - b| over paired elements; NaN when any element of either is NaN,
/// so every `err <= tolerance` check on it fails.
///
/// # Panics
/// When the lengths differ: a comparison of part of the output is no
/// comparison.
pub fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len(), "compared outputs differ in length");
    a.iter()
        .zip(b)
        .fold(0.0, |m, (x, y)| nan_max(m, (x - y).abs()))
}

/// max |a - b| / max |b|: the error of `a` relative to the scale of the
/// reference `b` (a scale under 1e-6 counts as 1e-6). NaN when either side
/// holds a NaN.
///
/// # Panics
/// When the lengths differ.
pub fn relative_error(a: &[f32], b: &[f32]) -> f32 {
    max_abs_diff(a, b) / nan_max(max_abs(b), 1e-6)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_nan_anywhere_fails_every_tolerance() {
        let good = [1.0, -2.0, 3.0];
        assert_eq!(max_abs_diff(&good, &good), 0.0);
        assert_eq!(max_abs(&good), 3.0);
        assert!((relative_error(&[1.0, -2.0, 3.3], &good) - 0.1).abs() < 1e-6);
        for i in 0..good.len() {
            let mut planted = good;
            planted[i] = f32::NAN;
            for err in [
                max_abs_diff(&planted, &good),
                max_abs_diff(&good, &planted),
                relative_error(&planted, &good),
                relative_error(&good, &planted),
                max_abs(&planted),
            ] {
                assert!(err.is_nan(), "NaN at {i} scored {err}");
            }
        }
        let all_nan = [f32::NAN; 3];
        assert!(relative_error(&all_nan, &good).is_nan());
        assert!(max_abs_diff(&[f32::INFINITY], &[1.0]).is_infinite());
        assert!(nan_max(f32::NAN, 1.0).is_nan() && nan_max(1.0, f32::NAN).is_nan());
        assert_eq!(nan_max(1.0, 2.0), 2.0);
    }
}
