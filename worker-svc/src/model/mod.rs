//! The model: its shape, its weights and its tokenizer.
//!
//! The seeded model (`weights::Weights::seeded`, byte-level `tokenizer`) is
//! the default; [`load::open`] reads a real one from a GGUF file (`gguf`
//! parses the container, [`crate::dequant`] the tensor types, `gguf_llama` maps
//! llama.cpp's names and layout onto ours) or a Hugging Face directory
//! (`hf_dir`).

pub mod gguf;
mod gguf_llama;
mod hf_dir;
pub mod load;
pub mod tokenizer;
pub mod weights;

use crate::error::{Error, Result};

/// The shape of a Llama-style decoder and of its KV blocks.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    /// Model name, reported by `Describe`.
    pub name: String,
    /// Vocabulary size (rows of the embedding).
    pub vocab_size: usize,
    /// Width of the residual stream.
    pub hidden_size: usize,
    /// Query heads.
    pub num_heads: usize,
    /// Key/value heads (grouped-query attention); divides `num_heads`.
    pub num_kv_heads: usize,
    /// Width of one head.
    pub head_dim: usize,
    /// Width of the SwiGLU feed-forward layer.
    pub ffn_size: usize,
    /// RoPE base frequency.
    pub rope_theta: f32,
    /// How the RoPE frequencies are rescaled for long contexts.
    pub rope_scaling: RopeScaling,
    /// RMSNorm epsilon.
    pub rms_norm_eps: f32,
    /// Attention window of each layer in tokens (0 = full attention); its
    /// length is the number of layers.
    pub layer_windows: Vec<u32>,
    /// Largest context (prompt + output) in tokens.
    pub max_context: u32,
    /// Tokens per KV block.
    pub tokens_per_block: u32,
    /// The LM head is the embedding matrix (no separate `lm_head.weight`).
    pub tied_embeddings: bool,
    /// What this architecture does differently from Llama.
    pub arch: Arch,
}

/// The architecture's departures from the Llama decoder, as parameters of
/// the one forward pass (every backend and the dense reference read them;
/// there is no copy of the pass per model). The default is Llama.
#[derive(Debug, Clone, PartialEq)]
pub struct Arch {
    /// Which family the checkpoint declared (reported, and named in errors).
    pub family: Family,
    /// Q, K and V projections carry biases (Qwen2).
    pub qkv_bias: bool,
    /// Per-head RMSNorm of Q and K before RoPE (Qwen3, Gemma 3).
    pub qk_norm: bool,
    /// RMSNorm of the attention and MLP outputs before they join the
    /// residual stream (Gemma 2 and 3).
    pub post_norms: bool,
    /// The MLP's gate activation.
    pub activation: Activation,
    /// Multiplier of the embedding rows (Gemma: `sqrt(hidden)`); 1 elsewhere.
    pub embed_scale: f32,
    /// Softmax scale of the attention scores when it is not
    /// `1/sqrt(head_dim)`: `1/sqrt(query_pre_attn_scalar)` for Gemma, or
    /// times the square of LongRoPE's attention factor (which transformers
    /// puts on cos and sin). See [`ModelConfig::attn_scale`].
    pub attn_scale: Option<f32>,
    /// `cap * tanh(score / cap)` on the attention scores (Gemma 2).
    pub attn_softcap: Option<f32>,
    /// `cap * tanh(logit / cap)` on the final logits (Gemma 2).
    pub final_softcap: Option<f32>,
    /// RoPE base of the sliding-window layers when it differs from
    /// `rope_theta` (Gemma 3's `rope_local_base_freq`); those layers use
    /// plain RoPE, unscaled.
    pub local_rope_theta: Option<f32>,
}

/// The architectures kvlease runs, by the family their config declares.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    /// `LlamaForCausalLM` / GGUF `llama` (Llama 2 and 3.x, SmolLM2).
    Llama,
    /// `MistralForCausalLM`.
    Mistral,
    /// `Qwen2ForCausalLM` (Qwen2 and Qwen2.5).
    Qwen2,
    /// `Qwen3ForCausalLM` (dense).
    Qwen3,
    /// `Gemma2ForCausalLM`.
    Gemma2,
    /// `Gemma3ForCausalLM` (the text model).
    Gemma3,
    /// `Phi3ForCausalLM` (Phi-3, Phi-3.5-mini).
    Phi3,
}

impl Family {
    /// The name of the family, as `Describe` and errors say it.
    pub fn name(self) -> &'static str {
        match self {
            Family::Llama => "llama",
            Family::Mistral => "mistral",
            Family::Qwen2 => "qwen2",
            Family::Qwen3 => "qwen3",
            Family::Gemma2 => "gemma2",
            Family::Gemma3 => "gemma3",
            Family::Phi3 => "phi3",
        }
    }
}

/// The activation of the gated MLP: `act(gate) * up`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activation {
    /// SiLU (SwiGLU): Llama, Mistral, Qwen, Phi-3.
    Silu,
    /// GELU with the tanh approximation (GeGLU): Gemma.
    GeluTanh,
}

impl Activation {
    /// `act(gate) * up`, into `gate`.
    pub fn glu(self, gate: &mut [f32], up: &[f32]) {
        match self {
            Activation::Silu => crate::ops::swiglu(gate, up),
            Activation::GeluTanh => crate::ops::geglu_tanh(gate, up),
        }
    }
}

impl Default for Arch {
    /// Llama's decoder.
    fn default() -> Self {
        Arch {
            family: Family::Llama,
            qkv_bias: false,
            qk_norm: false,
            post_norms: false,
            activation: Activation::Silu,
            embed_scale: 1.0,
            attn_scale: None,
            attn_softcap: None,
            final_softcap: None,
            local_rope_theta: None,
        }
    }
}

/// How RoPE frequencies are rescaled to stretch the context a model was
/// trained on.
#[derive(Debug, Clone, PartialEq)]
pub enum RopeScaling {
    /// Plain RoPE: frequency `i` is `theta^(-2i/head_dim)`.
    None,
    /// Llama 3.1's scheme (`rope_scaling.rope_type == "llama3"` in HF
    /// configs): long wavelengths are divided by `factor`, short ones kept,
    /// and the band between blended smoothly.
    Llama3 {
        /// Divisor of the low frequencies.
        factor: f64,
        /// Wavelengths longer than `original_context / low_freq_factor` are scaled fully.
        low_freq_factor: f64,
        /// Wavelengths shorter than `original_context / high_freq_factor` are kept.
        high_freq_factor: f64,
        /// Context length of the unscaled model.
        original_context: f64,
    },
    /// One divisor per frequency, as GGUF files store them (`rope_freqs.weight`,
    /// llama.cpp's precomputed form of the Llama 3 scheme).
    Factors(Vec<f32>),
}

/// The layers that share one attention window, and so one KV pool.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolLayers {
    /// Window in tokens; 0 = full attention.
    pub window: u32,
    /// Model layer indices whose KV lives in this pool, ascending.
    pub layers: Vec<usize>,
}

impl ModelConfig {
    /// The default CI-friendly model: byte-level vocabulary, hidden 256,
    /// 4 layers mixing full attention and a 64-token sliding window.
    pub fn small() -> Self {
        ModelConfig {
            name: String::new(),
            vocab_size: tokenizer::VOCAB_SIZE as usize,
            hidden_size: 256,
            num_heads: 8,
            num_kv_heads: 2,
            head_dim: 32,
            ffn_size: 768,
            rope_theta: 10_000.0,
            rope_scaling: RopeScaling::None,
            rms_norm_eps: 1e-5,
            layer_windows: vec![0, 64, 0, 64],
            max_context: 2048,
            tokens_per_block: 16,
            tied_embeddings: true,
            arch: Arch::default(),
        }
    }

    /// The softmax scale of the attention scores.
    pub fn attn_scale(&self) -> f32 {
        self.arch
            .attn_scale
            .unwrap_or_else(|| (self.head_dim as f64).powf(-0.5) as f32)
    }

    /// Number of decoder layers.
    pub fn num_layers(&self) -> usize {
        self.layer_windows.len()
    }

    /// Width of all query heads together.
    pub fn q_dim(&self) -> usize {
        self.num_heads * self.head_dim
    }

    /// Width of all key (or value) heads together.
    pub fn kv_dim(&self) -> usize {
        self.num_kv_heads * self.head_dim
    }

    /// The RoPE inverse frequencies of one head (`head_dim / 2` of them),
    /// with [`ModelConfig::rope_scaling`] applied; computed in f64 like
    /// transformers' `_compute_llama3_parameters`.
    pub fn rope_inv_freq(&self) -> Vec<f64> {
        self.inv_freq_with(self.rope_theta, &self.rope_scaling)
    }

    /// The RoPE inverse frequencies of `layer`: the model's, or for a
    /// sliding-window layer of a model with [`Arch::local_rope_theta`],
    /// plain RoPE of that base.
    pub fn layer_inv_freq(&self, layer: usize) -> Vec<f64> {
        match self.arch.local_rope_theta {
            Some(theta) if self.layer_windows.get(layer).is_some_and(|&w| w > 0) => {
                self.inv_freq_with(theta, &RopeScaling::None)
            }
            _ => self.rope_inv_freq(),
        }
    }

    fn inv_freq_with(&self, theta: f32, scaling: &RopeScaling) -> Vec<f64> {
        let d = self.head_dim;
        let base = f64::from(theta);
        let plain = (0..d / 2).map(|i| 1.0 / base.powf(2.0 * i as f64 / d as f64));
        match scaling {
            RopeScaling::None => plain.collect(),
            RopeScaling::Factors(factors) => plain
                .zip(factors)
                .map(|(f, &div)| f / f64::from(div))
                .collect(),
            &RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_context,
            } => {
                let low_freq_wavelen = original_context / low_freq_factor;
                let high_freq_wavelen = original_context / high_freq_factor;
                plain
                    .map(|f| {
                        let wavelen = 2.0 * std::f64::consts::PI / f;
                        if wavelen < high_freq_wavelen {
                            f
                        } else if wavelen > low_freq_wavelen {
                            f / factor
                        } else {
                            let smooth = (original_context / wavelen - low_freq_factor)
                                / (high_freq_factor - low_freq_factor);
                            (1.0 - smooth) * f / factor + smooth * f
                        }
                    })
                    .collect()
            }
        }
    }

    /// Checks that the shape is usable.
    pub fn validate(&self) -> Result<()> {
        let positive = [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("num_heads", self.num_heads),
            ("num_kv_heads", self.num_kv_heads),
            ("head_dim", self.head_dim),
            ("ffn_size", self.ffn_size),
            ("num_layers", self.num_layers()),
            ("max_context", self.max_context as usize),
            ("tokens_per_block", self.tokens_per_block as usize),
        ];
        for (name, value) in positive {
            if value == 0 {
                return Err(Error::Config(format!("{name} must be at least 1")));
            }
        }
        if !self.num_heads.is_multiple_of(self.num_kv_heads) {
            return Err(Error::Config(format!(
                "num_heads {} is not a multiple of num_kv_heads {}",
                self.num_heads, self.num_kv_heads
            )));
        }
        if !self.head_dim.is_multiple_of(2) {
            return Err(Error::Config(format!(
                "head_dim {} must be even for RoPE",
                self.head_dim
            )));
        }
        if self.vocab_size > u32::MAX as usize {
            return Err(Error::Config("vocab_size does not fit in u32".into()));
        }
        if !(self.rope_theta.is_finite() && self.rope_theta > 0.0) {
            return Err(Error::Config("rope_theta must be positive".into()));
        }
        match &self.rope_scaling {
            RopeScaling::None => {}
            RopeScaling::Factors(factors) => {
                if factors.len() != self.head_dim / 2 {
                    return Err(Error::Config(format!(
                        "rope frequency factors have {} entries, head_dim {} needs {}",
                        factors.len(),
                        self.head_dim,
                        self.head_dim / 2
                    )));
                }
                if factors.iter().any(|f| !(f.is_finite() && *f > 0.0)) {
                    return Err(Error::Config(
                        "rope frequency factors must be positive".into(),
                    ));
                }
            }
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_context,
            } => {
                let all_positive = [factor, low_freq_factor, high_freq_factor, original_context]
                    .iter()
                    .all(|v| v.is_finite() && **v > 0.0);
                if !all_positive || high_freq_factor <= low_freq_factor {
                    return Err(Error::Config(format!(
                        "llama3 rope scaling needs positive factors and high_freq_factor > \
                         low_freq_factor (got factor {factor}, low {low_freq_factor}, \
                         high {high_freq_factor}, original context {original_context})"
                    )));
                }
            }
        }
        if !(self.rms_norm_eps.is_finite() && self.rms_norm_eps > 0.0) {
            return Err(Error::Config("rms_norm_eps must be positive".into()));
        }
        let a = &self.arch;
        let positive = |v: f32| v.is_finite() && v > 0.0;
        if !positive(a.embed_scale) || !positive(self.attn_scale()) {
            return Err(Error::Config(format!(
                "embedding scale {} and attention scale {} must be positive",
                a.embed_scale,
                self.attn_scale()
            )));
        }
        for (name, cap) in [
            ("attn_logit_softcapping", a.attn_softcap),
            ("final_logit_softcapping", a.final_softcap),
        ] {
            if cap.is_some_and(|c| !positive(c)) {
                return Err(Error::Config(format!("{name} must be positive")));
            }
        }
        if a.local_rope_theta.is_some_and(|t| !positive(t)) {
            return Err(Error::Config("the local rope base must be positive".into()));
        }
        Ok(())
    }

    /// One pool per distinct window, in the order the windows first appear
    /// in `layer_windows`.
    pub fn pools(&self) -> Vec<PoolLayers> {
        let mut pools: Vec<PoolLayers> = Vec::new();
        for (layer, &window) in self.layer_windows.iter().enumerate() {
            match pools.iter_mut().find(|p| p.window == window) {
                Some(pool) => pool.layers.push(layer),
                None => pools.push(PoolLayers {
                    window,
                    layers: vec![layer],
                }),
            }
        }
        pools
    }

    /// Parameters of the model (weights count, not bytes).
    pub fn num_params(&self) -> usize {
        let h = self.hidden_size;
        let a = &self.arch;
        let extras = usize::from(a.qkv_bias) * (self.q_dim() + 2 * self.kv_dim())
            + usize::from(a.qk_norm) * 2 * self.head_dim
            + usize::from(a.post_norms) * 2 * h;
        let per_layer = 2 * h
            + extras
            + h * self.q_dim()
            + 2 * h * self.kv_dim()
            + self.q_dim() * h
            + 3 * h * self.ffn_size;
        let head = if self.tied_embeddings {
            0
        } else {
            self.vocab_size * h
        };
        self.vocab_size * h + self.num_layers() * per_layer + h + head
    }
}
