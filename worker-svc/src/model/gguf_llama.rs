//! A decoder from a GGUF file (`general.architecture` `llama`, `qwen2` or
//! `qwen3`): the shape from the `<arch>.*` metadata, the weights under
//! their HF names, and the `tokenizer.*` metadata as a [`GgufVocab`].
//!
//! Trap: for `llama` only, `convert_hf_to_gguf.py` permutes the rows of
//! `attn_q` and `attn_k` so that llama.cpp's RoPE can rotate adjacent pairs
//! `(2i, 2i + 1)`; our model rotates halves `(i, i + d/2)` as HF does, so
//! [`unpermute_rows`] puts the rows back at load (transformers'
//! `reverse_permute_weights`). Qwen's files keep HF's order (llama.cpp
//! rotates them "NEOX" style, as HF does).

use kvlease_tokenizer::GgufVocab;

use super::gguf::{GgufFile, TensorInfo, Value};
use super::weights::{Matrix, TensorSource};
use super::{Arch, Family, ModelConfig, RopeScaling};
use crate::packed::PackedMatrix;

/// The architectures this loader reads (`general.architecture`).
const ARCHITECTURES: &[(&str, Family)] = &[
    ("llama", Family::Llama),
    ("qwen2", Family::Qwen2),
    ("qwen3", Family::Qwen3),
];

/// The model shape a GGUF file's metadata describes; `max_context` and
/// `tokens_per_block` are the caller's. The error says what is missing.
pub(crate) fn model_config(
    file: &GgufFile,
    max_context: u32,
    tokens_per_block: u32,
) -> Result<ModelConfig, String> {
    let arch = file
        .get_str("general.architecture")
        .ok_or("no general.architecture in the metadata")?;
    let Some(&(_, family)) = ARCHITECTURES.iter().find(|(a, _)| *a == arch) else {
        let names: Vec<&str> = ARCHITECTURES.iter().map(|(a, _)| *a).collect();
        return Err(format!(
            "unsupported architecture {arch:?} (supported: {})",
            names.join(", ")
        ));
    };
    if let Some(experts) = file.get_u64(&format!("{arch}.expert_count"))
        && experts > 0
    {
        return Err(format!(
            "mixture-of-experts models are not supported ({arch}.expert_count is {experts})"
        ));
    }
    let int = |key: &str| -> Result<usize, String> {
        let full = format!("{arch}.{key}");
        file.get_u64(&full)
            .and_then(|v| usize::try_from(v).ok())
            .ok_or_else(|| format!("metadata {full} is missing or not an integer"))
    };
    let hidden_size = int("embedding_length")?;
    let num_layers = int("block_count")?;
    let num_heads = int("attention.head_count")?;
    let num_kv_heads = int("attention.head_count_kv").unwrap_or(num_heads);
    if num_heads == 0 {
        return Err(format!("{arch}.attention.head_count is 0"));
    }
    let head_dim = int("attention.key_length").unwrap_or(hidden_size / num_heads);
    if let Ok(rope_dims) = int("rope.dimension_count")
        && rope_dims != head_dim
    {
        return Err(format!(
            "partial RoPE ({arch}.rope.dimension_count {rope_dims} of head_dim {head_dim}) is not supported"
        ));
    }
    if let Some(kind) = file.get_str(&format!("{arch}.rope.scaling.type"))
        && kind != "none"
    {
        return Err(format!("unsupported RoPE scaling type {kind:?}"));
    }
    let rms_norm_eps = file
        .get_f64(&format!("{arch}.attention.layer_norm_rms_epsilon"))
        .ok_or_else(|| format!("metadata {arch}.attention.layer_norm_rms_epsilon is missing"))?;
    let rope_theta = file
        .get_f64(&format!("{arch}.rope.freq_base"))
        .unwrap_or(10_000.0);
    let context = int("context_length")?;
    let embed = file
        .tensor("token_embd.weight")
        .ok_or("missing tensor token_embd.weight")?;
    let vocab_size = match embed.dims.as_slice() {
        [cols, rows] if *cols as usize == hidden_size => *rows as usize,
        dims => {
            return Err(format!(
                "tensor token_embd.weight has dims {dims:?}, the metadata needs [{hidden_size}, vocab]"
            ));
        }
    };
    if let Ok(declared) = int("vocab_size")
        && declared != vocab_size
    {
        return Err(format!(
            "{arch}.vocab_size is {declared} but token_embd.weight has {vocab_size} rows"
        ));
    }
    let rope_scaling = match file.tensor("rope_freqs.weight") {
        Some(info) => RopeScaling::Factors(file.tensor_f32(info)),
        None => RopeScaling::None,
    };
    let ffn_size = int("feed_forward_length")?;
    let name = file.get_str("general.name").unwrap_or_default().to_string();
    Ok(ModelConfig {
        name,
        vocab_size,
        hidden_size,
        num_heads,
        num_kv_heads,
        head_dim,
        ffn_size,
        rope_theta: rope_theta as f32,
        rope_scaling,
        rms_norm_eps: rms_norm_eps as f32,
        layer_windows: vec![0; num_layers],
        max_context: max_context.min(u32::try_from(context).unwrap_or(u32::MAX)),
        tokens_per_block,
        tied_embeddings: file.tensor("output.weight").is_none(),
        arch: Arch {
            family,
            qkv_bias: family == Family::Qwen2,
            qk_norm: family == Family::Qwen3,
            ..Arch::default()
        },
    })
}

/// The `tokenizer.*` metadata, checked to have one token per embedding row.
pub(crate) fn vocab(file: &GgufFile, vocab_size: usize) -> Result<GgufVocab, String> {
    let strings = |key: &str| -> Result<Vec<String>, String> {
        match file.get(key) {
            None => Ok(Vec::new()),
            Some(v) => v
                .as_array()
                .and_then(|items| {
                    items
                        .iter()
                        .map(|i| i.as_str().map(str::to_string))
                        .collect::<Option<Vec<_>>>()
                })
                .ok_or_else(|| format!("metadata {key} is not an array of strings")),
        }
    };
    let numbers = |key: &str| -> Result<Vec<f64>, String> {
        match file.get(key) {
            None => Ok(Vec::new()),
            Some(v) => v
                .as_array()
                .and_then(|items| items.iter().map(Value::as_f64).collect::<Option<Vec<_>>>())
                .ok_or_else(|| format!("metadata {key} is not an array of numbers")),
        }
    };
    let id = |key: &str| {
        file.get_u64(&format!("tokenizer.ggml.{key}"))
            .and_then(|v| u32::try_from(v).ok())
    };
    let flag = |key: &str| {
        file.get(&format!("tokenizer.ggml.{key}"))
            .and_then(Value::as_bool)
    };
    let model = file
        .get_str("tokenizer.ggml.model")
        .ok_or("missing tokenizer: no tokenizer.ggml.model in the metadata")?
        .to_string();
    let tokens = strings("tokenizer.ggml.tokens")?;
    if tokens.is_empty() {
        return Err("missing tokenizer: no tokenizer.ggml.tokens in the metadata".into());
    }
    if tokens.len() != vocab_size {
        return Err(format!(
            "vocab mismatch: the tokenizer has {} tokens but token_embd.weight has {vocab_size} rows",
            tokens.len()
        ));
    }
    Ok(GgufVocab {
        model,
        pre: file.get_str("tokenizer.ggml.pre").map(str::to_string),
        tokens,
        token_types: numbers("tokenizer.ggml.token_type")?
            .into_iter()
            .map(|v| v as i32)
            .collect(),
        scores: numbers("tokenizer.ggml.scores")?
            .into_iter()
            .map(|v| v as f32)
            .collect(),
        merges: strings("tokenizer.ggml.merges")?,
        bos_id: id("bos_token_id"),
        eos_id: id("eos_token_id"),
        eot_id: id("eot_token_id"),
        eom_id: id("eom_token_id"),
        unknown_id: id("unknown_token_id"),
        padding_id: id("padding_token_id"),
        add_bos: flag("add_bos_token"),
        add_eos: flag("add_eos_token"),
        add_space_prefix: flag("add_space_prefix"),
        chat_template: file.get_str("tokenizer.chat_template").map(str::to_string),
    })
}

/// The GGUF tensors under their HF names.
pub(crate) struct GgufSource<'a> {
    pub(crate) file: &'a GgufFile,
    pub(crate) num_heads: usize,
    pub(crate) num_kv_heads: usize,
    /// Whether the converter permuted Q and K (`llama` files).
    pub(crate) permuted: bool,
}

impl GgufSource<'_> {
    /// The GGUF name of an HF Llama tensor, and the head count whose rows
    /// llama.cpp permuted (Q and K), if any.
    fn gguf_name(&self, hf: &str) -> Option<(String, Option<usize>)> {
        let plain = |n: &str| Some((n.to_string(), None));
        match hf {
            "model.embed_tokens.weight" => return plain("token_embd.weight"),
            "model.norm.weight" => return plain("output_norm.weight"),
            "lm_head.weight" => return plain("output.weight"),
            _ => {}
        }
        let rest = hf.strip_prefix("model.layers.")?;
        let (layer, suffix) = rest.split_once('.')?;
        let permuted = |heads| self.permuted.then_some(heads);
        let (short, heads) = match suffix {
            "input_layernorm.weight" => ("attn_norm.weight", None),
            "self_attn.q_proj.weight" => ("attn_q.weight", permuted(self.num_heads)),
            "self_attn.k_proj.weight" => ("attn_k.weight", permuted(self.num_kv_heads)),
            "self_attn.v_proj.weight" => ("attn_v.weight", None),
            "self_attn.q_proj.bias" => ("attn_q.bias", None),
            "self_attn.k_proj.bias" => ("attn_k.bias", None),
            "self_attn.v_proj.bias" => ("attn_v.bias", None),
            "self_attn.q_norm.weight" => ("attn_q_norm.weight", None),
            "self_attn.k_norm.weight" => ("attn_k_norm.weight", None),
            "self_attn.o_proj.weight" => ("attn_output.weight", None),
            "post_attention_layernorm.weight" => ("ffn_norm.weight", None),
            "mlp.gate_proj.weight" => ("ffn_gate.weight", None),
            "mlp.up_proj.weight" => ("ffn_up.weight", None),
            "mlp.down_proj.weight" => ("ffn_down.weight", None),
            _ => return None,
        };
        Some((format!("blk.{layer}.{short}"), heads))
    }
}

impl TensorSource for GgufSource<'_> {
    fn contains(&self, name: &str) -> bool {
        self.gguf_name(name)
            .is_some_and(|(g, _)| self.file.tensor(&g).is_some())
    }

    fn read(&self, name: &str, rows: usize, cols: usize) -> Result<Vec<f32>, String> {
        let (info, heads) = self.checked(name, rows, cols)?;
        let values = self.file.tensor_f32(info);
        Ok(match heads {
            Some(heads) => unpermute_rows(&values, heads, cols),
            None => values,
        })
    }

    /// Q4_0, Q4_1 and Q8_0 matrices stay in their blocks (un-permuting Q
    /// and K moves whole rows of blocks); other types become f32.
    fn read_matrix(&self, name: &str, rows: usize, cols: usize) -> Result<Matrix, String> {
        let (info, heads) = self.checked(name, rows, cols)?;
        if !PackedMatrix::supports(info.ty) {
            return self.read(name, rows, cols).map(Matrix::F32);
        }
        let bytes = self.file.tensor_bytes(info);
        let row_bytes = bytes.len() / rows.max(1);
        let bytes = match heads {
            Some(heads) => unpermute_rows(bytes, heads, row_bytes),
            None => bytes.to_vec(),
        };
        PackedMatrix::new(info.ty, rows, cols, bytes)
            .map(Matrix::Packed)
            .map_err(|e| format!("tensor {}: {e}", info.name))
    }
}

impl GgufSource<'_> {
    /// The tensor behind HF name `name`, checked to be `[rows, cols]`, and
    /// the head count whose rows llama.cpp permuted, if any.
    fn checked(
        &self,
        name: &str,
        rows: usize,
        cols: usize,
    ) -> Result<(&TensorInfo, Option<usize>), String> {
        let (gguf, heads) = self
            .gguf_name(name)
            .ok_or_else(|| format!("no GGUF name for tensor {name}"))?;
        let info = self
            .file
            .tensor(&gguf)
            .ok_or_else(|| format!("missing tensor {gguf}"))?;
        let dims: Vec<usize> = info.dims.iter().map(|&d| d as usize).collect();
        let shape_ok = dims == [cols, rows] || (rows == 1 && dims == [cols]);
        if !shape_ok {
            return Err(format!(
                "tensor {gguf} has dims {dims:?}, the model needs [{cols}, {rows}] (innermost first)"
            ));
        }
        Ok((info, heads))
    }
}

/// Undoes llama.cpp's permutation of a Q or K projection `[heads × d, cols]`
/// (of f32 elements, or of bytes holding rows of quantized blocks):
/// within each head, GGUF row `2i + j` is HF row `j·d/2 + i`.
pub(crate) fn unpermute_rows<T: Copy + Default>(w: &[T], heads: usize, cols: usize) -> Vec<T> {
    let rows = w.len() / cols;
    let d = rows / heads;
    let half = d / 2;
    let mut out = vec![T::default(); w.len()];
    for h in 0..heads {
        for i in 0..half {
            for j in 0..2 {
                let src = (h * d + 2 * i + j) * cols;
                let dst = (h * d + j * half + i) * cols;
                out[dst..dst + cols].copy_from_slice(&w[src..src + cols]);
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// llama.cpp's `permute` (convert_hf_to_gguf.py), applied to row indices.
    fn permute(rows: &[f32], heads: usize) -> Vec<f32> {
        // reshape(heads, 2, d/2).swapaxes(1, 2): new (h, i, j) = old (h, j, i)
        let d = rows.len() / heads;
        let half = d / 2;
        let mut out = Vec::with_capacity(rows.len());
        for h in 0..heads {
            for i in 0..half {
                for j in 0..2 {
                    out.push(rows[h * d + j * half + i]);
                }
            }
        }
        out
    }

    #[test]
    fn unpermute_inverts_the_converters_permutation() {
        let heads = 3;
        let rows: Vec<f32> = (0..heads * 8).map(|r| r as f32).collect();
        let permuted = permute(&rows, heads);
        assert_ne!(permuted, rows);
        assert_eq!(unpermute_rows(&permuted, heads, 1), rows);
        // Two columns: whole rows move.
        let wide: Vec<f32> = rows.iter().flat_map(|&r| [r, -r]).collect();
        let permuted_wide: Vec<f32> = permuted.iter().flat_map(|&r| [r, -r]).collect();
        assert_eq!(unpermute_rows(&permuted_wide, heads, 2), wide);
    }
}
