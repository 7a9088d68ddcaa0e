//! A Llama-family model from a Hugging Face directory: `config.json`
//! (`LlamaForCausalLM`), and `model.safetensors` or the shards that
//! `model.safetensors.index.json` names.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use serde::Deserialize;

use super::{ModelConfig, RopeScaling};

/// The `config.json` fields the model needs. Unknown fields are ignored.
#[derive(Debug, Deserialize)]
struct HfConfig {
    #[serde(default)]
    architectures: Vec<String>,
    #[serde(default)]
    model_type: Option<String>,
    vocab_size: usize,
    hidden_size: usize,
    num_hidden_layers: usize,
    num_attention_heads: usize,
    #[serde(default)]
    num_key_value_heads: Option<usize>,
    #[serde(default)]
    head_dim: Option<usize>,
    intermediate_size: usize,
    #[serde(default)]
    rope_theta: Option<f64>,
    /// transformers 4.x's name for the scaling (`{"rope_type": "llama3", ...}`).
    #[serde(default)]
    rope_scaling: Option<serde_json::Value>,
    /// transformers 5's home of `rope_theta` and the scaling.
    #[serde(default)]
    rope_parameters: Option<serde_json::Value>,
    rms_norm_eps: f64,
    #[serde(default)]
    tie_word_embeddings: Option<bool>,
    #[serde(default)]
    max_position_embeddings: Option<u64>,
    #[serde(default)]
    sliding_window: Option<u32>,
    #[serde(default)]
    attention_bias: bool,
    #[serde(default)]
    mlp_bias: bool,
    #[serde(default)]
    hidden_act: Option<String>,
}

/// Reads and checks `dir/config.json`: the model shape, with
/// `tied_embeddings` as `tie_word_embeddings` declares it (false when
/// absent, transformers' default for Llama). The error says what is wrong.
pub(crate) fn read_config(
    dir: &Path,
    max_context: u32,
    tokens_per_block: u32,
) -> Result<ModelConfig, String> {
    let path = dir.join("config.json");
    let text =
        std::fs::read_to_string(&path).map_err(|e| format!("cannot read config.json: {e}"))?;
    let hf: HfConfig = serde_json::from_str(&text)
        .map_err(|e| format!("config.json is not a Llama config: {e}"))?;
    let is_llama = hf.architectures.iter().any(|a| a == "LlamaForCausalLM")
        || (hf.architectures.is_empty() && hf.model_type.as_deref() == Some("llama"));
    if !is_llama {
        return Err(format!(
            "unsupported architecture {:?} (model_type {:?}); supported: LlamaForCausalLM",
            hf.architectures, hf.model_type
        ));
    }
    if hf.attention_bias || hf.mlp_bias {
        return Err("attention_bias and mlp_bias are not supported".into());
    }
    if let Some(act) = &hf.hidden_act
        && act != "silu"
    {
        return Err(format!("hidden_act {act:?} is not supported (silu is)"));
    }
    if hf.num_attention_heads == 0 {
        return Err("num_attention_heads is 0".into());
    }
    let rope = hf.rope_parameters.as_ref().or(hf.rope_scaling.as_ref());
    let rope_theta = hf
        .rope_theta
        .or_else(|| {
            rope.and_then(|r| r.get("rope_theta"))
                .and_then(serde_json::Value::as_f64)
        })
        .unwrap_or(10_000.0);
    let max_positions = hf.max_position_embeddings.unwrap_or(u64::from(max_context));
    let rope_scaling = rope_scaling(rope, max_positions)?;
    let window = hf.sliding_window.unwrap_or(0);
    let tied = hf.tie_word_embeddings.unwrap_or(false);
    let name = dir
        .file_name()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default();
    Ok(ModelConfig {
        name,
        vocab_size: hf.vocab_size,
        hidden_size: hf.hidden_size,
        num_heads: hf.num_attention_heads,
        num_kv_heads: hf.num_key_value_heads.unwrap_or(hf.num_attention_heads),
        head_dim: hf
            .head_dim
            .unwrap_or(hf.hidden_size / hf.num_attention_heads),
        ffn_size: hf.intermediate_size,
        rope_theta: rope_theta as f32,
        rope_scaling,
        rms_norm_eps: hf.rms_norm_eps as f32,
        layer_windows: vec![window; hf.num_hidden_layers],
        max_context: max_context.min(u32::try_from(max_positions).unwrap_or(u32::MAX)),
        tokens_per_block,
        tied_embeddings: tied,
    })
}

/// The scaling a `rope_scaling` / `rope_parameters` object describes.
fn rope_scaling(
    rope: Option<&serde_json::Value>,
    max_positions: u64,
) -> Result<RopeScaling, String> {
    let Some(rope) = rope.filter(|r| !r.is_null()) else {
        return Ok(RopeScaling::None);
    };
    let kind = rope
        .get("rope_type")
        .or_else(|| rope.get("type"))
        .and_then(serde_json::Value::as_str)
        .unwrap_or("default");
    let number = |key: &str| {
        rope.get(key)
            .and_then(serde_json::Value::as_f64)
            .ok_or_else(|| format!("rope_scaling of type llama3 needs a number {key}"))
    };
    match kind {
        "default" => Ok(RopeScaling::None),
        "llama3" => Ok(RopeScaling::Llama3 {
            factor: number("factor")?,
            low_freq_factor: number("low_freq_factor")?,
            high_freq_factor: number("high_freq_factor")?,
            original_context: rope
                .get("original_max_position_embeddings")
                .and_then(serde_json::Value::as_f64)
                .unwrap_or(max_positions as f64),
        }),
        other => Err(format!(
            "unsupported rope_scaling type {other:?} (default and llama3 are)"
        )),
    }
}

/// The safetensors files of the checkpoint: the shards the index names, or
/// `model.safetensors`.
pub(crate) fn weight_files(dir: &Path) -> Result<Vec<PathBuf>, String> {
    let index = dir.join("model.safetensors.index.json");
    if index.exists() {
        let text = std::fs::read_to_string(&index)
            .map_err(|e| format!("cannot read model.safetensors.index.json: {e}"))?;
        let json: serde_json::Value = serde_json::from_str(&text)
            .map_err(|e| format!("model.safetensors.index.json is not JSON: {e}"))?;
        let map = json
            .get("weight_map")
            .and_then(serde_json::Value::as_object)
            .ok_or("model.safetensors.index.json has no weight_map")?;
        let shards: BTreeSet<&str> = map.values().filter_map(serde_json::Value::as_str).collect();
        if shards.is_empty() {
            return Err("model.safetensors.index.json names no shard".into());
        }
        return shards
            .into_iter()
            .map(|s| {
                // A shard is a file beside the index, never a path elsewhere.
                if s.contains('/') || s.contains('\\') || s == ".." {
                    Err(format!(
                        "weight_map names {s:?}, not a file of the directory"
                    ))
                } else {
                    Ok(dir.join(s))
                }
            })
            .collect();
    }
    let single = dir.join("model.safetensors");
    if single.exists() {
        Ok(vec![single])
    } else {
        Err("no model.safetensors or model.safetensors.index.json".into())
    }
}
