//! The model: its shape, its weights and its tokenizer.

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
            rms_norm_eps: 1e-5,
            layer_windows: vec![0, 64, 0, 64],
            max_context: 2048,
            tokens_per_block: 16,
            tied_embeddings: true,
        }
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
        if !(self.rms_norm_eps.is_finite() && self.rms_norm_eps > 0.0) {
            return Err(Error::Config("rms_norm_eps must be positive".into()));
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
        let per_layer = 2 * h
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
