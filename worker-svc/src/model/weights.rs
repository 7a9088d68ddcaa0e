//! Model weights: drawn deterministically from a seed, or loaded from a
//! safetensors file with Hugging Face Llama tensor names.
//!
//! Every matrix is stored row-major as `[out_features, in_features]`, the
//! layout of `torch.nn.Linear` and of HF checkpoints.

use std::collections::HashMap;
use std::path::Path;

use safetensors::tensor::{Dtype, SafeTensors, TensorView};

use super::ModelConfig;
use crate::error::{Error, Result};

/// The weights of one decoder layer.
#[derive(Clone, PartialEq)]
pub struct LayerWeights {
    /// RMSNorm before attention, `[hidden]`.
    pub attn_norm: Vec<f32>,
    /// `[num_heads * head_dim, hidden]`.
    pub wq: Vec<f32>,
    /// `[num_kv_heads * head_dim, hidden]`.
    pub wk: Vec<f32>,
    /// `[num_kv_heads * head_dim, hidden]`.
    pub wv: Vec<f32>,
    /// `[hidden, num_heads * head_dim]`.
    pub wo: Vec<f32>,
    /// RMSNorm before the MLP, `[hidden]`.
    pub mlp_norm: Vec<f32>,
    /// `[ffn, hidden]`.
    pub w_gate: Vec<f32>,
    /// `[ffn, hidden]`.
    pub w_up: Vec<f32>,
    /// `[hidden, ffn]`.
    pub w_down: Vec<f32>,
}

impl std::fmt::Debug for LayerWeights {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LayerWeights")
            .field(
                "params",
                &self.tensors().iter().map(|(_, t)| t.len()).sum::<usize>(),
            )
            .finish()
    }
}

impl LayerWeights {
    fn tensors(&self) -> [(&'static str, &Vec<f32>); 9] {
        [
            ("input_layernorm.weight", &self.attn_norm),
            ("self_attn.q_proj.weight", &self.wq),
            ("self_attn.k_proj.weight", &self.wk),
            ("self_attn.v_proj.weight", &self.wv),
            ("self_attn.o_proj.weight", &self.wo),
            ("post_attention_layernorm.weight", &self.mlp_norm),
            ("mlp.gate_proj.weight", &self.w_gate),
            ("mlp.up_proj.weight", &self.w_up),
            ("mlp.down_proj.weight", &self.w_down),
        ]
    }
}

/// All weights of the model, with the config they were built for.
#[derive(Clone, PartialEq)]
pub struct Weights {
    /// The model shape.
    pub config: ModelConfig,
    /// `[vocab, hidden]`.
    pub embed: Vec<f32>,
    /// One entry per layer.
    pub layers: Vec<LayerWeights>,
    /// Final RMSNorm, `[hidden]`.
    pub final_norm: Vec<f32>,
    /// `[vocab, hidden]`; `None` when tied to the embedding.
    pub lm_head: Option<Vec<f32>>,
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
        let embed = (0..config.vocab_size * h)
            .map(|_| rng.uniform(0.1))
            .collect();
        let layers = (0..config.num_layers())
            .map(|_| LayerWeights {
                attn_norm: rng.norm(h),
                wq: rng.matrix(config.q_dim(), h),
                wk: rng.matrix(config.kv_dim(), h),
                wv: rng.matrix(config.kv_dim(), h),
                wo: rng.matrix(h, config.q_dim()),
                mlp_norm: rng.norm(h),
                w_gate: rng.matrix(config.ffn_size, h),
                w_up: rng.matrix(config.ffn_size, h),
                w_down: rng.matrix(h, config.ffn_size),
            })
            .collect();
        let final_norm = rng.norm(h);
        let lm_head = (!config.tied_embeddings).then(|| rng.matrix(config.vocab_size, h));
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
        let embed = read("model.embed_tokens.weight", config.vocab_size, h)?;
        let mut layers = Vec::with_capacity(config.num_layers());
        for i in 0..config.num_layers() {
            let p = format!("model.layers.{i}.");
            layers.push(LayerWeights {
                attn_norm: read(&format!("{p}input_layernorm.weight"), 1, h)?,
                wq: read(&format!("{p}self_attn.q_proj.weight"), config.q_dim(), h)?,
                wk: read(&format!("{p}self_attn.k_proj.weight"), config.kv_dim(), h)?,
                wv: read(&format!("{p}self_attn.v_proj.weight"), config.kv_dim(), h)?,
                wo: read(&format!("{p}self_attn.o_proj.weight"), h, config.q_dim())?,
                mlp_norm: read(&format!("{p}post_attention_layernorm.weight"), 1, h)?,
                w_gate: read(&format!("{p}mlp.gate_proj.weight"), config.ffn_size, h)?,
                w_up: read(&format!("{p}mlp.up_proj.weight"), config.ffn_size, h)?,
                w_down: read(&format!("{p}mlp.down_proj.weight"), h, config.ffn_size)?,
            });
        }
        let final_norm = read("model.norm.weight", 1, h)?;
        let lm_head = if source.contains("lm_head.weight") {
            Some(read("lm_head.weight", config.vocab_size, h)?)
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
        let h = self.config.hidden_size;
        let mut named: Vec<(String, Vec<usize>, &Vec<f32>)> = vec![
            (
                "model.embed_tokens.weight".into(),
                vec![self.config.vocab_size, h],
                &self.embed,
            ),
            ("model.norm.weight".into(), vec![h], &self.final_norm),
        ];
        if let Some(head) = &self.lm_head {
            named.push((
                "lm_head.weight".into(),
                vec![self.config.vocab_size, h],
                head,
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

    /// Bytes the weights take in memory.
    pub fn bytes(&self) -> u64 {
        let layer: usize = self
            .layers
            .iter()
            .map(|l| l.tensors().iter().map(|(_, t)| t.len()).sum::<usize>())
            .sum();
        let head = self.lm_head.as_ref().map_or(0, Vec::len);
        ((self.embed.len() + layer + self.final_norm.len() + head) * 4) as u64
    }

    /// The LM head matrix `[vocab, hidden]` (the embedding when tied).
    pub fn lm_head(&self) -> &[f32] {
        self.lm_head.as_deref().unwrap_or(&self.embed)
    }
}

/// Where a model's tensors come from, by HF Llama name.
pub(crate) trait TensorSource {
    /// Whether the source has tensor `name`.
    fn contains(&self, name: &str) -> bool;
    /// Tensor `name` as f32, checked to be `[rows, cols]` (or `[cols]` when
    /// `rows == 1`); the error says what is wrong.
    fn read(&self, name: &str, rows: usize, cols: usize) -> std::result::Result<Vec<f32>, String>;
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
