//! Model weights: drawn deterministically from a seed, or loaded from a
//! safetensors file with Hugging Face Llama tensor names.
//!
//! Every matrix is stored row-major as `[out_features, in_features]`, the
//! layout of `torch.nn.Linear` and of HF checkpoints.

use std::borrow::Cow;
use std::collections::HashMap;
use std::path::Path;

use safetensors::tensor::{Dtype, SafeTensors, TensorView};

use super::{Family, ModelConfig};
use crate::error::{Error, Result};
use crate::packed::PackedMatrix;
use crate::threads::Threads;

/// A weight matrix `[out_features, in_features]`: f32, or still in the
/// quantized blocks of the GGUF file it came from (which the CPU backend
/// multiplies by directly; other consumers take [`Matrix::f32`]).
#[derive(Debug, Clone, PartialEq)]
pub enum Matrix {
    /// Row-major f32.
    F32(Vec<f32>),
    /// Quantized blocks, row after row.
    Packed(PackedMatrix),
}

impl Matrix {
    /// [`crate::ops::matmul_wt_strided`] by this weight: an f32 one
    /// through `gemm`, a packed one straight from its blocks
    /// ([`crate::packed::matmul_packed`]). Row-exact either way.
    ///
    /// # Panics
    /// When a packed matrix is not `[n, k]`, or as
    /// [`crate::ops::matmul_wt_strided`].
    pub fn matmul(
        &self,
        a: &[f32],
        lda: usize,
        out: &mut [f32],
        (m, k, n): (usize, usize, usize),
        accumulate: bool,
        threads: Threads,
    ) {
        match self {
            Matrix::F32(w) => {
                crate::ops::matmul_wt_strided(a, lda, w, out, (m, k, n), accumulate, threads)
            }
            Matrix::Packed(p) => {
                assert!(p.rows() == n && p.cols() == k, "{p:?} is not [{n}, {k}]");
                crate::packed::matmul_packed(a, lda, p, out, m, accumulate, threads);
            }
        }
    }
}

impl From<Vec<f32>> for Matrix {
    fn from(values: Vec<f32>) -> Self {
        Matrix::F32(values)
    }
}

impl Matrix {
    /// The elements as f32, row-major (dequantized when packed).
    pub fn f32(&self) -> Cow<'_, [f32]> {
        match self {
            Matrix::F32(v) => Cow::Borrowed(v),
            Matrix::Packed(p) => Cow::Owned(p.to_f32()),
        }
    }

    /// The elements as a mutable f32 vector, dequantizing a packed matrix
    /// in place first.
    pub fn f32_mut(&mut self) -> &mut Vec<f32> {
        if let Matrix::Packed(p) = self {
            *self = Matrix::F32(p.to_f32());
        }
        match self {
            Matrix::F32(v) => v,
            // Made F32 just above.
            Matrix::Packed(_) => unreachable!("unpacked above"),
        }
    }

    /// Number of elements.
    pub fn elems(&self) -> usize {
        match self {
            Matrix::F32(v) => v.len(),
            Matrix::Packed(p) => p.rows() * p.cols(),
        }
    }

    /// Bytes in memory.
    pub fn bytes(&self) -> usize {
        match self {
            Matrix::F32(v) => v.len() * 4,
            Matrix::Packed(p) => p.bytes(),
        }
    }

    /// Row `r` of a matrix of `cols` columns as f32, into `out`.
    ///
    /// # Panics
    /// When `r` is out of range or `out` is not `cols` long.
    pub fn row_into(&self, r: usize, out: &mut [f32]) {
        let cols = out.len();
        match self {
            Matrix::F32(v) => out.copy_from_slice(&v[r * cols..(r + 1) * cols]),
            Matrix::Packed(p) => p.dequantize_row(r, out),
        }
    }

    /// The rows of `parts` one after the other: packed when all of them are
    /// packed alike, else f32.
    pub fn stack(parts: &[&Matrix]) -> Matrix {
        let packed: Option<Vec<&PackedMatrix>> = parts
            .iter()
            .map(|m| match m {
                Matrix::Packed(p) => Some(p),
                Matrix::F32(_) => None,
            })
            .collect();
        if let Some(stacked) = packed.and_then(|p| PackedMatrix::stack(&p)) {
            return Matrix::Packed(stacked);
        }
        Matrix::F32(parts.iter().flat_map(|m| m.f32().into_owned()).collect())
    }
}

/// The weights of one decoder layer.
#[derive(Clone, PartialEq)]
pub struct LayerWeights {
    /// RMSNorm before attention, `[hidden]`.
    pub attn_norm: Vec<f32>,
    /// `[num_heads * head_dim, hidden]`.
    pub wq: Matrix,
    /// `[num_kv_heads * head_dim, hidden]`.
    pub wk: Matrix,
    /// `[num_kv_heads * head_dim, hidden]`.
    pub wv: Matrix,
    /// `[hidden, num_heads * head_dim]`.
    pub wo: Matrix,
    /// RMSNorm before the MLP, `[hidden]`.
    pub mlp_norm: Vec<f32>,
    /// `[ffn, hidden]`.
    pub w_gate: Matrix,
    /// `[ffn, hidden]`.
    pub w_up: Matrix,
    /// `[hidden, ffn]`.
    pub w_down: Matrix,
    /// Biases of Q, K and V back to back, `[q_dim + 2 kv_dim]` (Qwen2).
    pub qkv_bias: Option<Vec<f32>>,
    /// Per-head RMSNorm of the queries and of the keys, `[head_dim]` each
    /// (Qwen3, Gemma 3).
    pub qk_norm: Option<(Vec<f32>, Vec<f32>)>,
    /// RMSNorm of the attention output and of the MLP output before each
    /// joins the residual, `[hidden]` each (Gemma 2 and 3).
    pub post_norms: Option<(Vec<f32>, Vec<f32>)>,
}

impl std::fmt::Debug for LayerWeights {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LayerWeights")
            .field("bytes", &self.bytes())
            .finish()
    }
}

impl LayerWeights {
    /// Every tensor under its HF name, as f32 (dequantized when packed).
    fn tensors(&self) -> [(&'static str, Cow<'_, [f32]>); 9] {
        [
            ("input_layernorm.weight", Cow::Borrowed(&self.attn_norm[..])),
            ("self_attn.q_proj.weight", self.wq.f32()),
            ("self_attn.k_proj.weight", self.wk.f32()),
            ("self_attn.v_proj.weight", self.wv.f32()),
            ("self_attn.o_proj.weight", self.wo.f32()),
            (
                "post_attention_layernorm.weight",
                Cow::Borrowed(&self.mlp_norm[..]),
            ),
            ("mlp.gate_proj.weight", self.w_gate.f32()),
            ("mlp.up_proj.weight", self.w_up.f32()),
            ("mlp.down_proj.weight", self.w_down.f32()),
        ]
    }

    /// Bytes of the layer in memory.
    fn bytes(&self) -> usize {
        let matrices = [
            &self.wq,
            &self.wk,
            &self.wv,
            &self.wo,
            &self.w_gate,
            &self.w_up,
            &self.w_down,
        ];
        let vectors = self.attn_norm.len()
            + self.mlp_norm.len()
            + self.qkv_bias.as_ref().map_or(0, Vec::len)
            + self.qk_norm.as_ref().map_or(0, |(q, k)| q.len() + k.len())
            + self
                .post_norms
                .as_ref()
                .map_or(0, |(a, m)| a.len() + m.len());
        vectors * 4 + matrices.iter().map(|m| m.bytes()).sum::<usize>()
    }
}

/// All weights of the model, with the config they were built for.
#[derive(Clone, PartialEq)]
pub struct Weights {
    /// The model shape.
    pub config: ModelConfig,
    /// `[vocab, hidden]`.
    pub embed: Matrix,
    /// One entry per layer.
    pub layers: Vec<LayerWeights>,
    /// Final RMSNorm, `[hidden]`.
    pub final_norm: Vec<f32>,
    /// `[vocab, hidden]`; `None` when tied to the embedding.
    pub lm_head: Option<Matrix>,
}

impl std::fmt::Debug for Weights {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Weights")
            .field("config", &self.config)
            .field("bytes", &self.bytes())
            .finish()
    }
}

/// SplitMix64: a tiny, fixed generator so that seeded weights are the same
/// on every platform and every version of every dependency.
#[derive(Debug, Clone)]
pub struct SplitMix64(u64);

impl SplitMix64 {
    /// The generator seeded with `seed`.
    pub fn new(seed: u64) -> Self {
        SplitMix64(seed)
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Uniform in [-scale, scale).
    fn uniform(&mut self, scale: f32) -> f32 {
        ((self.next_f64() * 2.0 - 1.0) as f32) * scale
    }

    fn matrix(&mut self, rows: usize, cols: usize) -> Vec<f32> {
        // Scaled like a default Linear init, so activations stay O(1) through
        // the layers and logits are well separated.
        let scale = 1.0 / (cols as f32).sqrt();
        (0..rows * cols).map(|_| self.uniform(scale)).collect()
    }

    fn norm(&mut self, len: usize) -> Vec<f32> {
        (0..len).map(|_| 1.0 + self.uniform(0.1)).collect()
    }
}

impl Weights {
    /// Weights drawn deterministically from `seed`.
    pub fn seeded(config: ModelConfig, seed: u64) -> Result<Self> {
        config.validate()?;
        let mut rng = SplitMix64::new(seed);
        let h = config.hidden_size;
        // Small embeddings (as in GPT-style inits): the layers' outputs, not
        // the token's own embedding, dominate the residual stream, so a tied
        // head does not just echo the input token.
        let embed = Matrix::F32(
            (0..config.vocab_size * h)
                .map(|_| rng.uniform(0.1))
                .collect(),
        );
        let arch = config.arch.clone();
        let qkv = config.q_dim() + 2 * config.kv_dim();
        let d = config.head_dim;
        let layers = (0..config.num_layers())
            .map(|_| LayerWeights {
                attn_norm: rng.norm(h),
                wq: rng.matrix(config.q_dim(), h).into(),
                wk: rng.matrix(config.kv_dim(), h).into(),
                wv: rng.matrix(config.kv_dim(), h).into(),
                wo: rng.matrix(h, config.q_dim()).into(),
                mlp_norm: rng.norm(h),
                w_gate: rng.matrix(config.ffn_size, h).into(),
                w_up: rng.matrix(config.ffn_size, h).into(),
                w_down: rng.matrix(h, config.ffn_size).into(),
                // Drawn after the Llama tensors, so a Llama model's weights
                // stay what they were for its seed.
                qkv_bias: arch
                    .qkv_bias
                    .then(|| (0..qkv).map(|_| rng.uniform(0.5)).collect()),
                qk_norm: arch.qk_norm.then(|| (rng.norm(d), rng.norm(d))),
                post_norms: arch.post_norms.then(|| (rng.norm(h), rng.norm(h))),
            })
            .collect();
        let final_norm = rng.norm(h);
        let lm_head = (!config.tied_embeddings).then(|| rng.matrix(config.vocab_size, h).into());
        Ok(Weights {
            config,
            embed,
            layers,
            final_norm,
            lm_head,
        })
    }

    /// Weights read from a safetensors file with HF Llama names
    /// (`model.embed_tokens.weight`, `model.layers.N.self_attn.q_proj.weight`,
    /// ..., `model.norm.weight`, optional `lm_head.weight`). F32, F16 and BF16
    /// tensors are accepted; every shape must match `config`. A file without
    /// `lm_head.weight` is read as tied embeddings.
    pub fn load_safetensors(mut config: ModelConfig, path: &Path) -> Result<Self> {
        let fail = |reason: String| Error::Weights {
            path: path.display().to_string(),
            reason,
        };
        let bytes = std::fs::read(path).map_err(|e| fail(e.to_string()))?;
        let file = SafeTensors::deserialize(&bytes).map_err(|e| fail(e.to_string()))?;
        if config.name.is_empty() {
            config.name = path
                .file_stem()
                .map(|s| s.to_string_lossy().into_owned())
                .unwrap_or_default();
        }
        Self::from_source(config, &SafetensorsSource { files: vec![file] }, path)
    }

    /// Weights read by HF Llama name from `source`, every shape checked
    /// against `config`; tied when the source has no `lm_head.weight`.
    /// Errors name `path`.
    pub(crate) fn from_source(
        mut config: ModelConfig,
        source: &dyn TensorSource,
        path: &Path,
    ) -> Result<Self> {
        config.validate()?;
        let fail = |reason: String| Error::Weights {
            path: path.display().to_string(),
            reason,
        };
        let h = config.hidden_size;
        let read = |name: &str, rows: usize, cols: usize| -> Result<Vec<f32>> {
            source.read(name, rows, cols).map_err(fail)
        };
        let matrix = |name: &str, rows: usize, cols: usize| -> Result<Matrix> {
            source.read_matrix(name, rows, cols).map_err(fail)
        };
        let embed = matrix("model.embed_tokens.weight", config.vocab_size, h)?;
        let arch = config.arch.clone();
        let (qd, kvd, f, d) = (
            config.q_dim(),
            config.kv_dim(),
            config.ffn_size,
            config.head_dim,
        );
        // Gemma's RMSNorm scales by `1 + w`: the offset is added once here,
        // so every backend runs the one `x / rms(x) * w` norm.
        let offset = if matches!(arch.family, Family::Gemma2 | Family::Gemma3) {
            1.0
        } else {
            0.0
        };
        let norm = |name: &str, len: usize| -> Result<Vec<f32>> {
            let mut w = read(name, 1, len)?;
            w.iter_mut().for_each(|v| *v += offset);
            Ok(w)
        };
        let mut layers = Vec::with_capacity(config.num_layers());
        for i in 0..config.num_layers() {
            let p = format!("model.layers.{i}.");
            // Phi-3 stores Q, K and V as one matrix, and gate and up.
            let (wq, wk, wv) = if arch.family == Family::Phi3 {
                let qkv = read(&format!("{p}self_attn.qkv_proj.weight"), qd + 2 * kvd, h)?;
                let (q, kv) = qkv.split_at(qd * h);
                let (k, v) = kv.split_at(kvd * h);
                (q.to_vec().into(), k.to_vec().into(), v.to_vec().into())
            } else {
                (
                    matrix(&format!("{p}self_attn.q_proj.weight"), qd, h)?,
                    matrix(&format!("{p}self_attn.k_proj.weight"), kvd, h)?,
                    matrix(&format!("{p}self_attn.v_proj.weight"), kvd, h)?,
                )
            };
            let (w_gate, w_up) = if arch.family == Family::Phi3 {
                let gate_up = read(&format!("{p}mlp.gate_up_proj.weight"), 2 * f, h)?;
                let (gate, up) = gate_up.split_at(f * h);
                (gate.to_vec().into(), up.to_vec().into())
            } else {
                (
                    matrix(&format!("{p}mlp.gate_proj.weight"), f, h)?,
                    matrix(&format!("{p}mlp.up_proj.weight"), f, h)?,
                )
            };
            let qkv_bias = if arch.qkv_bias {
                let mut bias = read(&format!("{p}self_attn.q_proj.bias"), 1, qd)?;
                bias.extend(read(&format!("{p}self_attn.k_proj.bias"), 1, kvd)?);
                bias.extend(read(&format!("{p}self_attn.v_proj.bias"), 1, kvd)?);
                Some(bias)
            } else {
                None
            };
            let qk_norm = if arch.qk_norm {
                Some((
                    norm(&format!("{p}self_attn.q_norm.weight"), d)?,
                    norm(&format!("{p}self_attn.k_norm.weight"), d)?,
                ))
            } else {
                None
            };
            // Gemma's `post_attention_layernorm` is the norm of the
            // attention output; the MLP's input norm is
            // `pre_feedforward_layernorm`.
            let (mlp_norm, post_norms) = if arch.post_norms {
                (
                    norm(&format!("{p}pre_feedforward_layernorm.weight"), h)?,
                    Some((
                        norm(&format!("{p}post_attention_layernorm.weight"), h)?,
                        norm(&format!("{p}post_feedforward_layernorm.weight"), h)?,
                    )),
                )
            } else {
                (
                    norm(&format!("{p}post_attention_layernorm.weight"), h)?,
                    None,
                )
            };
            layers.push(LayerWeights {
                attn_norm: norm(&format!("{p}input_layernorm.weight"), h)?,
                wq,
                wk,
                wv,
                wo: matrix(&format!("{p}self_attn.o_proj.weight"), h, qd)?,
                mlp_norm,
                w_gate,
                w_up,
                w_down: matrix(&format!("{p}mlp.down_proj.weight"), h, f)?,
                qkv_bias,
                qk_norm,
                post_norms,
            });
        }
        let final_norm = norm("model.norm.weight", h)?;
        let lm_head = if source.contains("lm_head.weight") {
            Some(matrix("lm_head.weight", config.vocab_size, h)?)
        } else {
            None
        };
        config.tied_embeddings = lm_head.is_none();
        Ok(Weights {
            config,
            embed,
            layers,
            final_norm,
            lm_head,
        })
    }

    /// Writes the weights as an F32 safetensors file with HF Llama names.
    pub fn save_safetensors(&self, path: &Path) -> Result<()> {
        let fail = |reason: String| Error::Weights {
            path: path.display().to_string(),
            reason,
        };
        if self.config.arch.family != Family::Llama {
            return Err(fail(format!(
                "only Llama weights are written (these are {})",
                self.config.arch.family.name()
            )));
        }
        let h = self.config.hidden_size;
        let mut named: Vec<(String, Vec<usize>, Cow<'_, [f32]>)> = vec![
            (
                "model.embed_tokens.weight".into(),
                vec![self.config.vocab_size, h],
                self.embed.f32(),
            ),
            (
                "model.norm.weight".into(),
                vec![h],
                Cow::Borrowed(&self.final_norm[..]),
            ),
        ];
        if let Some(head) = &self.lm_head {
            named.push((
                "lm_head.weight".into(),
                vec![self.config.vocab_size, h],
                head.f32(),
            ));
        }
        for (i, layer) in self.layers.iter().enumerate() {
            for (suffix, tensor) in layer.tensors() {
                // Norms are vectors; o_proj and down_proj map into the hidden
                // size ([hidden, in]); every other matrix maps out of it.
                let shape = if suffix.contains("layernorm") {
                    vec![h]
                } else if suffix.contains("o_proj") || suffix.contains("down_proj") {
                    vec![h, tensor.len() / h]
                } else {
                    vec![tensor.len() / h, h]
                };
                named.push((format!("model.layers.{i}.{suffix}"), shape, tensor));
            }
        }
        let raw: Vec<(String, Vec<usize>, Vec<u8>)> = named
            .into_iter()
            .map(|(name, shape, t)| {
                let bytes = t.iter().flat_map(|v| v.to_le_bytes()).collect();
                (name, shape, bytes)
            })
            .collect();
        let views = raw
            .iter()
            .map(|(name, shape, bytes)| {
                TensorView::new(Dtype::F32, shape.clone(), bytes).map(|v| (name.clone(), v))
            })
            .collect::<Result<HashMap<String, TensorView<'_>>, _>>()
            .map_err(|e| fail(e.to_string()))?;
        safetensors::serialize_to_file(views, None, path).map_err(|e| fail(e.to_string()))
    }

    /// Bytes the weights take in memory (packed matrices at their packed
    /// size).
    pub fn bytes(&self) -> u64 {
        let layers: usize = self.layers.iter().map(LayerWeights::bytes).sum();
        let head = self.lm_head.as_ref().map_or(0, Matrix::bytes);
        (self.embed.bytes() + layers + self.final_norm.len() * 4 + head) as u64
    }

    /// The LM head matrix `[vocab, hidden]` (the embedding when tied).
    pub fn lm_head(&self) -> &Matrix {
        self.lm_head.as_ref().unwrap_or(&self.embed)
    }
}

/// Where a model's tensors come from, by HF Llama name.
pub(crate) trait TensorSource {
    /// Whether the source has tensor `name`.
    fn contains(&self, name: &str) -> bool;
    /// Tensor `name` as f32, checked to be `[rows, cols]` (or `[cols]` when
    /// `rows == 1`); the error says what is wrong.
    fn read(&self, name: &str, rows: usize, cols: usize) -> std::result::Result<Vec<f32>, String>;
    /// Matrix `name`, checked as [`TensorSource::read`]; a source may keep
    /// it packed. The default reads f32.
    fn read_matrix(
        &self,
        name: &str,
        rows: usize,
        cols: usize,
    ) -> std::result::Result<Matrix, String> {
        self.read(name, rows, cols).map(Matrix::F32)
    }
}

/// One or more safetensors files (the shards of one checkpoint).
pub(crate) struct SafetensorsSource<'a> {
    pub(crate) files: Vec<SafeTensors<'a>>,
}

impl TensorSource for SafetensorsSource<'_> {
    fn contains(&self, name: &str) -> bool {
        self.files.iter().any(|f| f.names().contains(&name))
    }

    fn read(&self, name: &str, rows: usize, cols: usize) -> std::result::Result<Vec<f32>, String> {
        let view = self
            .files
            .iter()
            .find_map(|f| f.tensor(name).ok())
            .ok_or_else(|| format!("missing tensor {name}"))?;
        tensor_to_f32(&view, name, rows, cols)
    }
}

/// Converts one tensor to f32, checking its shape is `[rows, cols]` (or `[cols]`
/// when `rows == 1`).
fn tensor_to_f32(
    view: &TensorView<'_>,
    name: &str,
    rows: usize,
    cols: usize,
) -> std::result::Result<Vec<f32>, String> {
    let shape = view.shape();
    let shape_ok = shape == [rows, cols] || (rows == 1 && shape == [cols]);
    if !shape_ok {
        return Err(format!(
            "tensor {name} has shape {shape:?}, the config needs [{rows}, {cols}]"
        ));
    }
    let data = view.data();
    let values = match view.dtype() {
        Dtype::F32 => data
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect(),
        Dtype::F16 => data
            .chunks_exact(2)
            .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        Dtype::BF16 => data
            .chunks_exact(2)
            .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        other => {
            return Err(format!(
                "tensor {name} has dtype {other:?}; only F32, F16 and BF16 are supported"
            ));
        }
    };
    Ok(values)
}
