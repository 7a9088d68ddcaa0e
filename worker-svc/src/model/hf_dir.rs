//! A decoder from a Hugging Face directory: `config.json` (Llama, Mistral,
//! Qwen2/2.5, Qwen3, Gemma 2, Gemma 3 text, Phi-3; see `ARCHITECTURES`),
//! and `model.safetensors` or the shards that `model.safetensors.index.json`
//! names.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use serde::Deserialize;

use serde_json::Value;

use super::{Activation, Arch, Family, ModelConfig, RopeScaling};

/// The `config.json` fields the model needs. Unknown fields are ignored;
/// fields that would change the computation and that kvlease does not
/// implement are refused by name (see [`refuse_unsupported`]).
#[derive(Debug, Deserialize)]
struct HfConfig {
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
    rope_scaling: Option<Value>,
    /// transformers 5's home of `rope_theta` and the scaling (for Gemma 3,
    /// one object per layer type).
    #[serde(default)]
    rope_parameters: Option<Value>,
    /// Gemma 3 (transformers 4.x): the RoPE base of the sliding layers.
    #[serde(default)]
    rope_local_base_freq: Option<f64>,
    rms_norm_eps: f64,
    #[serde(default)]
    tie_word_embeddings: Option<bool>,
    #[serde(default)]
    max_position_embeddings: Option<u64>,
    #[serde(default)]
    original_max_position_embeddings: Option<u64>,
    #[serde(default)]
    sliding_window: Option<u32>,
    /// Qwen2/Qwen3: windows only when this is true.
    #[serde(default)]
    use_sliding_window: Option<bool>,
    #[serde(default)]
    max_window_layers: Option<usize>,
    /// Gemma 3 (transformers 4.x): every n-th layer is global.
    #[serde(default)]
    sliding_window_pattern: Option<usize>,
    /// `"sliding_attention"` / `"full_attention"` per layer.
    #[serde(default)]
    layer_types: Option<Vec<String>>,
    #[serde(default)]
    attention_bias: Option<bool>,
    #[serde(default)]
    mlp_bias: bool,
    #[serde(default)]
    hidden_act: Option<String>,
    /// Gemma's name for the activation.
    #[serde(default)]
    hidden_activation: Option<String>,
    #[serde(default)]
    query_pre_attn_scalar: Option<f64>,
    #[serde(default)]
    attn_logit_softcapping: Option<f64>,
    #[serde(default)]
    final_logit_softcapping: Option<f64>,
    #[serde(default)]
    partial_rotary_factor: Option<f64>,
}

/// The architectures read from `config.json`, by the `architectures` entry
/// (or `model_type`) that names them.
const ARCHITECTURES: &[(&str, &str, Family)] = &[
    ("LlamaForCausalLM", "llama", Family::Llama),
    ("MistralForCausalLM", "mistral", Family::Mistral),
    ("Qwen2ForCausalLM", "qwen2", Family::Qwen2),
    ("Qwen3ForCausalLM", "qwen3", Family::Qwen3),
    ("Gemma2ForCausalLM", "gemma2", Family::Gemma2),
    ("Gemma3ForCausalLM", "gemma3_text", Family::Gemma3),
    ("Phi3ForCausalLM", "phi3", Family::Phi3),
];

/// The RoPE scaling types read (`rope_type` of `rope_scaling` /
/// `rope_parameters`).
const ROPE_TYPES: &str = "default, linear, llama3, longrope";

/// Reads and checks `dir/config.json`: the model shape, with
/// `tied_embeddings` as `tie_word_embeddings` declares it (when absent,
/// transformers' default for the family). The error says what is wrong.
pub(crate) fn read_config(
    dir: &Path,
    max_context: u32,
    tokens_per_block: u32,
) -> Result<ModelConfig, String> {
    let path = dir.join("config.json");
    let text =
        std::fs::read_to_string(&path).map_err(|e| format!("cannot read config.json: {e}"))?;
    let raw: Value =
        serde_json::from_str(&text).map_err(|e| format!("config.json is not JSON: {e}"))?;
    refuse_unsupported(&raw)?;
    let family = family(&raw)?;
    let hf: HfConfig = serde_json::from_value(raw)
        .map_err(|e| format!("config.json is not a {} config: {e}", family.name()))?;
    check_layers(&hf, family)?;
    if hf.num_attention_heads == 0 {
        return Err("num_attention_heads is 0".into());
    }
    let head_dim = hf
        .head_dim
        .unwrap_or(hf.hidden_size / hf.num_attention_heads);
    let rope = rope_objects(&hf)?;
    if let Some(p) = number(rope.global, "partial_rotary_factor")
        && p != 1.0
    {
        return Err(format!(
            "rope_parameters.partial_rotary_factor {p} is not supported \
             (supported: 1.0, RoPE over the whole head)"
        ));
    }
    let rope_theta = hf
        .rope_theta
        .or_else(|| number(rope.global, "rope_theta"))
        .unwrap_or(10_000.0);
    let max_positions = hf.max_position_embeddings.unwrap_or(u64::from(max_context));
    let serving_context = max_context.min(u32::try_from(max_positions).unwrap_or(u32::MAX));
    let scaling = rope_scaling(rope.global, &hf, max_positions, serving_context, head_dim)?;
    let local_rope_theta = match family {
        Family::Gemma3 => Some(
            hf.rope_local_base_freq
                .or_else(|| number(rope.local, "rope_theta"))
                .unwrap_or(10_000.0) as f32,
        ),
        _ => None,
    };
    let gemma = matches!(family, Family::Gemma2 | Family::Gemma3);
    let tied = hf.tie_word_embeddings.unwrap_or(gemma);
    let name = dir
        .file_name()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default();
    let scale_base = match (gemma, hf.query_pre_attn_scalar) {
        (true, Some(q)) => q,
        _ => head_dim as f64,
    };
    let cap = |v: Option<f64>| v.filter(|c| *c > 0.0).map(|c| c as f32);
    let arch = Arch {
        family,
        qkv_bias: family == Family::Qwen2,
        qk_norm: matches!(family, Family::Qwen3 | Family::Gemma3),
        post_norms: gemma,
        activation: if gemma {
            Activation::GeluTanh
        } else {
            Activation::Silu
        },
        embed_scale: if gemma {
            (hf.hidden_size as f64).sqrt() as f32
        } else {
            1.0
        },
        attn_scale: (gemma || scaling.attention_factor != 1.0).then(|| {
            (scaling.attention_factor * scaling.attention_factor / scale_base.sqrt()) as f32
        }),
        attn_softcap: if family == Family::Gemma2 {
            cap(hf.attn_logit_softcapping)
        } else {
            None
        },
        final_softcap: if family == Family::Gemma2 {
            cap(hf.final_logit_softcapping)
        } else {
            None
        },
        local_rope_theta,
    };
    Ok(ModelConfig {
        name,
        vocab_size: hf.vocab_size,
        hidden_size: hf.hidden_size,
        num_heads: hf.num_attention_heads,
        num_kv_heads: hf.num_key_value_heads.unwrap_or(hf.num_attention_heads),
        head_dim,
        ffn_size: hf.intermediate_size,
        rope_theta: rope_theta as f32,
        rope_scaling: scaling.scaling,
        rms_norm_eps: hf.rms_norm_eps as f32,
        layer_windows: layer_windows(&hf, family)?,
        max_context: serving_context,
        tokens_per_block,
        tied_embeddings: tied,
        arch,
    })
}

/// Refuses what would silently compute something else: mixtures of
/// experts, vision towers, quantized checkpoints.
fn refuse_unsupported(raw: &Value) -> Result<(), String> {
    for field in [
        "num_experts",
        "num_local_experts",
        "n_routed_experts",
        "moe_intermediate_size",
    ] {
        if raw.get(field).is_some_and(|v| !v.is_null() && v != 0) {
            return Err(format!(
                "mixture-of-experts models are not supported (config.json sets {field}); \
                 supported: the dense decoders {}",
                supported_names()
            ));
        }
    }
    for field in ["vision_config", "vision_tower", "audio_config"] {
        if raw.get(field).is_some_and(|v| !v.is_null()) {
            return Err(format!(
                "multimodal checkpoints are not supported (config.json has {field}); \
                 serve the text model alone, one of {}",
                supported_names()
            ));
        }
    }
    if let Some(q) = raw.get("quantization_config").filter(|v| !v.is_null()) {
        let method = q.get("quant_method").and_then(Value::as_str).unwrap_or("?");
        return Err(format!(
            "quantized safetensors are not supported (config.json quantization_config.quant_method \
             {method:?}); supported: F32, F16 and BF16 safetensors, or a GGUF file"
        ));
    }
    Ok(())
}

fn supported_names() -> String {
    ARCHITECTURES
        .iter()
        .map(|(a, _, _)| *a)
        .collect::<Vec<_>>()
        .join(", ")
}

/// The family `architectures` (or, without it, `model_type`) names.
fn family(raw: &Value) -> Result<Family, String> {
    let architectures: Vec<&str> = raw
        .get("architectures")
        .and_then(Value::as_array)
        .map(|a| a.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default();
    let model_type = raw.get("model_type").and_then(Value::as_str);
    let found = if architectures.is_empty() {
        ARCHITECTURES
            .iter()
            .find(|(_, m, _)| Some(*m) == model_type)
    } else {
        ARCHITECTURES
            .iter()
            .find(|(a, _, _)| architectures.contains(a))
    };
    found.map(|(_, _, f)| *f).ok_or_else(|| {
        format!(
            "unsupported architecture {architectures:?} (model_type {model_type:?}); \
             supported: {}",
            supported_names()
        )
    })
}

/// Fields of a supported family that kvlease does not implement.
fn check_layers(hf: &HfConfig, family: Family) -> Result<(), String> {
    // Qwen2 has Q/K/V biases whatever attention_bias says; elsewhere a
    // bias would also sit on o_proj, which kvlease does not read.
    if family != Family::Qwen2 && hf.attention_bias == Some(true) {
        return Err(format!(
            "attention_bias true is not supported for {} (supported: false)",
            family.name()
        ));
    }
    if hf.mlp_bias {
        return Err("mlp_bias true is not supported (supported: false)".into());
    }
    let (field, act, expected) = match family {
        Family::Gemma2 | Family::Gemma3 => (
            "hidden_activation",
            hf.hidden_activation.as_ref().or(hf.hidden_act.as_ref()),
            "gelu_pytorch_tanh",
        ),
        _ => ("hidden_act", hf.hidden_act.as_ref(), "silu"),
    };
    if let Some(act) = act
        && act != expected
    {
        return Err(format!(
            "{field} {act:?} is not supported for {} (supported: {expected})",
            family.name()
        ));
    }
    if let Some(p) = hf.partial_rotary_factor
        && p != 1.0
    {
        return Err(format!(
            "partial_rotary_factor {p} is not supported (supported: 1.0, RoPE over the whole head)"
        ));
    }
    Ok(())
}

/// The attention window of every layer.
fn layer_windows(hf: &HfConfig, family: Family) -> Result<Vec<u32>, String> {
    let n = hf.num_hidden_layers;
    let window = hf.sliding_window.unwrap_or(0);
    if let Some(types) = &hf.layer_types {
        if types.len() != n {
            return Err(format!(
                "layer_types has {} entries for {n} layers",
                types.len()
            ));
        }
        return types
            .iter()
            .map(|t| match t.as_str() {
                "full_attention" => Ok(0),
                "sliding_attention" if window > 0 => Ok(window),
                "sliding_attention" => {
                    Err("layer_types names sliding_attention but sliding_window is not set".into())
                }
                other => Err(format!(
                    "layer_types entry {other:?} is not supported \
                     (supported: full_attention, sliding_attention)"
                )),
            })
            .collect();
    }
    Ok(match family {
        Family::Qwen2 | Family::Qwen3 => {
            let from = hf.max_window_layers.unwrap_or(n);
            (0..n)
                .map(|i| {
                    if hf.use_sliding_window == Some(true) && i >= from {
                        window
                    } else {
                        0
                    }
                })
                .collect()
        }
        // Gemma 2 alternates, starting with a sliding layer.
        Family::Gemma2 => (0..n)
            .map(|i| if i % 2 == 0 { window } else { 0 })
            .collect(),
        Family::Gemma3 => {
            let pattern = hf.sliding_window_pattern.unwrap_or(6).max(1);
            (0..n)
                .map(|i| if (i + 1) % pattern == 0 { 0 } else { window })
                .collect()
        }
        Family::Llama | Family::Mistral | Family::Phi3 => vec![window; n],
    })
}

/// The RoPE objects of a config: the global one (and, for Gemma 3 under
/// transformers 5, the sliding layers' one).
struct RopeObjects<'a> {
    global: Option<&'a Value>,
    local: Option<&'a Value>,
}

fn rope_objects(hf: &HfConfig) -> Result<RopeObjects<'_>, String> {
    let rope = hf
        .rope_parameters
        .as_ref()
        .or(hf.rope_scaling.as_ref())
        .filter(|r| !r.is_null());
    if let Some(r) = rope
        && !r.is_object()
    {
        return Err("rope_parameters / rope_scaling is not an object".into());
    }
    // transformers 5 keys Gemma 3's parameters by layer type.
    match rope.and_then(|r| r.get("full_attention")) {
        Some(full) => Ok(RopeObjects {
            global: Some(full),
            local: rope.and_then(|r| r.get("sliding_attention")),
        }),
        None => Ok(RopeObjects {
            global: rope,
            local: None,
        }),
    }
}

fn number(object: Option<&Value>, key: &str) -> Option<f64> {
    object.and_then(|o| o.get(key)).and_then(Value::as_f64)
}

/// A RoPE scaling and the factor transformers multiplies cos and sin by.
struct Scaling {
    scaling: RopeScaling,
    attention_factor: f64,
}

/// The scaling a `rope_scaling` / `rope_parameters` object describes.
/// LongRoPE keeps one set of factors: the long ones when the served context
/// (`serving_context`) passes the original one, else the short ones
/// (transformers switches per sequence length; kvlease's KV cache keeps
/// keys rotated once, so the set is fixed at start-up).
fn rope_scaling(
    rope: Option<&Value>,
    hf: &HfConfig,
    max_positions: u64,
    serving_context: u32,
    head_dim: usize,
) -> Result<Scaling, String> {
    let plain = |scaling| {
        Ok(Scaling {
            scaling,
            attention_factor: 1.0,
        })
    };
    let Some(rope) = rope else {
        return plain(RopeScaling::None);
    };
    let kind = rope
        .get("rope_type")
        .or_else(|| rope.get("type"))
        .and_then(Value::as_str)
        .unwrap_or("default");
    let need = |key: &str| {
        number(Some(rope), key)
            .ok_or_else(|| format!("rope_scaling of type {kind} needs a number {key}"))
    };
    let original = number(Some(rope), "original_max_position_embeddings")
        .or(hf.original_max_position_embeddings.map(|v| v as f64));
    match kind {
        "default" => plain(RopeScaling::None),
        "linear" => {
            let factor = need("factor")?;
            plain(RopeScaling::Factors(vec![factor as f32; head_dim / 2]))
        }
        "llama3" => plain(RopeScaling::Llama3 {
            factor: need("factor")?,
            low_freq_factor: need("low_freq_factor")?,
            high_freq_factor: need("high_freq_factor")?,
            original_context: original.unwrap_or(max_positions as f64),
        }),
        "longrope" => {
            let original = original
                .ok_or("rope_scaling of type longrope needs original_max_position_embeddings")?;
            let factors = |key: &str| -> Result<Vec<f32>, String> {
                let list = rope
                    .get(key)
                    .and_then(Value::as_array)
                    .ok_or_else(|| format!("rope_scaling of type longrope needs a list {key}"))?;
                let values: Option<Vec<f32>> =
                    list.iter().map(|v| v.as_f64().map(|f| f as f32)).collect();
                let values = values.ok_or_else(|| format!("{key} holds a non-number"))?;
                if values.len() != head_dim / 2 {
                    return Err(format!(
                        "{key} has {} entries, head_dim {head_dim} needs {}",
                        values.len(),
                        head_dim / 2
                    ));
                }
                Ok(values)
            };
            let long = f64::from(serving_context) > original;
            let chosen = factors(if long { "long_factor" } else { "short_factor" })?;
            let factor = number(Some(rope), "factor").unwrap_or(max_positions as f64 / original);
            let attention_factor = match number(Some(rope), "attention_factor") {
                Some(a) => a,
                None if factor <= 1.0 => 1.0,
                None => (1.0 + factor.ln() / original.ln()).sqrt(),
            };
            Ok(Scaling {
                scaling: RopeScaling::Factors(chosen),
                attention_factor,
            })
        }
        other => Err(format!(
            "unsupported rope_scaling type {other:?} (supported: {ROPE_TYPES})"
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
