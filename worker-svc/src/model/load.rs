//! Opening a real model (`--model PATH`): a GGUF file or a Hugging Face
//! directory becomes f32 [`Weights`] whose shape comes from the file, and
//! the model's own [`Tokenizer`].
//!
//! Every problem (unreadable or truncated file, unknown tensor type,
//! unsupported architecture, shape or vocabulary mismatch, missing
//! tokenizer) is an [`Error::Weights`] naming the path and what is wrong.

use std::path::Path;

use kvlease_tokenizer::Tokenizer;
use safetensors::SafeTensors;

use super::ModelConfig;
use super::gguf::GgufFile;
use super::gguf_llama::{self, GgufSource};
use super::hf_dir;
use super::weights::{SafetensorsSource, Weights};
use crate::error::{Error, Result};

/// A model read from disk.
#[derive(Debug)]
pub struct LoadedModel {
    /// The weights, with the shape the file declares.
    pub weights: Weights,
    /// The tokenizer the file declares.
    pub tokenizer: Tokenizer,
}

/// What the serving side chooses, not the file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ServingShape {
    /// Largest context in tokens (capped at the model's trained context).
    pub max_context: u32,
    /// Tokens per KV block.
    pub tokens_per_block: u32,
}

/// Opens `path`: a directory is read as a Hugging Face checkpoint, a file
/// as GGUF.
pub fn open(path: &Path, serving: ServingShape) -> Result<LoadedModel> {
    let fail = |reason: String| Error::Weights {
        path: path.display().to_string(),
        reason,
    };
    if path.is_dir() {
        open_hf_dir(path, serving).map_err(fail)
    } else {
        open_gguf(path, serving).map_err(fail)
    }
}

/// The shape of the model at `path` (GGUF metadata or `config.json`)
/// without building its weights or tokenizer: what sizing a worker's
/// memory budget needs. Errors as [`open`]'s.
pub fn shape(path: &Path, serving: ServingShape) -> Result<ModelConfig> {
    let read = || -> Result<ModelConfig, String> {
        if path.is_dir() {
            hf_dir::read_config(path, serving.max_context, serving.tokens_per_block)
        } else {
            let bytes = std::fs::read(path).map_err(|e| e.to_string())?;
            let file = GgufFile::parse(bytes)?;
            gguf_llama::model_config(&file, serving.max_context, serving.tokens_per_block)
        }
    };
    read().map_err(|reason| Error::Weights {
        path: path.display().to_string(),
        reason,
    })
}

/// The tokenizer of the model at `path` alone, without building its
/// weights: the one [`open`] returns, for `kvlease model tokenizer` to
/// write out for clients. Errors as [`open`]'s.
pub fn tokenizer(path: &Path) -> Result<Tokenizer> {
    let read = || -> Result<Tokenizer, String> {
        if path.is_dir() {
            return Tokenizer::from_hf_dir(path).map_err(|e| format!("tokenizer: {e}"));
        }
        let bytes = std::fs::read(path).map_err(|e| e.to_string())?;
        let file = GgufFile::parse(bytes)?;
        // only the vocabulary's size is read from the shape
        let config = gguf_llama::model_config(&file, u32::MAX, 16)?;
        let vocab = gguf_llama::vocab(&file, config.vocab_size)?;
        Tokenizer::from_gguf(&vocab).map_err(|e| format!("tokenizer: {e}"))
    };
    read().map_err(|reason| Error::Weights {
        path: path.display().to_string(),
        reason,
    })
}

fn open_gguf(path: &Path, serving: ServingShape) -> Result<LoadedModel, String> {
    let bytes = std::fs::read(path).map_err(|e| e.to_string())?;
    let file = GgufFile::parse(bytes)?;
    let config = gguf_llama::model_config(&file, serving.max_context, serving.tokens_per_block)?;
    let vocab = gguf_llama::vocab(&file, config.vocab_size)?;
    let tokenizer = Tokenizer::from_gguf(&vocab).map_err(|e| format!("tokenizer: {e}"))?;
    let source = GgufSource {
        file: &file,
        num_heads: config.num_heads,
        num_kv_heads: config.num_kv_heads,
        permuted: config.arch.family == super::Family::Llama,
    };
    let weights = Weights::from_source(config, &source, path).map_err(reason)?;
    Ok(LoadedModel { weights, tokenizer })
}

fn open_hf_dir(dir: &Path, serving: ServingShape) -> Result<LoadedModel, String> {
    let config = hf_dir::read_config(dir, serving.max_context, serving.tokens_per_block)?;
    if !dir.join("tokenizer.json").is_file() {
        return Err("missing tokenizer: no tokenizer.json in the directory".into());
    }
    let tokenizer = Tokenizer::from_hf_dir(dir).map_err(|e| format!("tokenizer: {e}"))?;
    if tokenizer.vocab_size() as usize > config.vocab_size {
        return Err(format!(
            "vocab mismatch: the tokenizer has {} tokens but config.json's vocab_size is {}",
            tokenizer.vocab_size(),
            config.vocab_size
        ));
    }
    let files = hf_dir::weight_files(dir)?;
    let bytes = files
        .iter()
        .map(|f| std::fs::read(f).map_err(|e| format!("cannot read {}: {e}", f.display())))
        .collect::<Result<Vec<_>, _>>()?;
    let shards = files
        .iter()
        .zip(&bytes)
        .map(|(f, b)| SafeTensors::deserialize(b).map_err(|e| format!("{}: {e}", f.display())))
        .collect::<Result<Vec<_>, _>>()?;
    let tied = config.tied_embeddings;
    let mut weights =
        Weights::from_source(config, &SafetensorsSource { files: shards }, dir).map_err(reason)?;
    match (tied, weights.lm_head.is_some()) {
        // transformers ties the head to the embedding and ignores a stored copy.
        (true, true) => {
            weights.lm_head = None;
            weights.config.tied_embeddings = true;
        }
        (false, false) => {
            return Err(
                "config.json says tie_word_embeddings is false but there is no lm_head.weight"
                    .into(),
            );
        }
        _ => {}
    }
    Ok(LoadedModel { weights, tokenizer })
}

/// The reason inside an error of [`Weights::from_source`] (which names the
/// path itself; [`open`] names it once).
fn reason(e: Error) -> String {
    match e {
        Error::Weights { reason, .. } => reason,
        other => other.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::gguf::Value;
    use crate::model::gguf::write::gguf_bytes;
    use crate::model::{ModelConfig, RopeScaling};

    /// A byte-level BPE vocabulary of 8 tokens with one merge.
    const TOKENS: [&str; 8] = ["a", "b", "c", "d", "Ġ", "ab", "<|endoftext|>", "x"];

    fn config() -> ModelConfig {
        ModelConfig {
            name: "tiny".into(),
            vocab_size: TOKENS.len(),
            hidden_size: 16,
            num_heads: 2,
            num_kv_heads: 1,
            head_dim: 8,
            ffn_size: 24,
            rope_theta: 10_000.0,
            rope_scaling: RopeScaling::None,
            rms_norm_eps: 1e-5,
            layer_windows: vec![0, 0],
            max_context: 64,
            tokens_per_block: 16,
            tied_embeddings: true,
            arch: Default::default(),
        }
    }

    fn metadata() -> Vec<(&'static str, Value)> {
        let strings =
            |v: &[&str]| Value::Array(v.iter().map(|s| Value::Str((*s).into())).collect());
        vec![
            ("general.architecture", Value::Str("llama".into())),
            ("general.name", Value::Str("tiny".into())),
            ("llama.block_count", Value::U64(2)),
            ("llama.context_length", Value::U64(64)),
            ("llama.embedding_length", Value::U64(16)),
            ("llama.feed_forward_length", Value::U64(24)),
            ("llama.attention.head_count", Value::U64(2)),
            ("llama.attention.head_count_kv", Value::U64(1)),
            ("llama.rope.freq_base", Value::F64(10_000.0)),
            ("llama.attention.layer_norm_rms_epsilon", Value::F64(1e-5)),
            ("tokenizer.ggml.model", Value::Str("gpt2".into())),
            ("tokenizer.ggml.tokens", strings(&TOKENS)),
            ("tokenizer.ggml.merges", strings(&["a b"])),
            ("tokenizer.ggml.eos_token_id", Value::U64(6)),
        ]
    }

    fn f32_bytes(t: &[f32]) -> Vec<u8> {
        t.iter().flat_map(|v| v.to_le_bytes()).collect()
    }

    /// llama.cpp's permutation of Q/K rows (the inverse of `unpermute_rows`).
    fn permute(w: &[f32], heads: usize, cols: usize) -> Vec<f32> {
        let d = w.len() / cols / heads;
        let mut out = Vec::with_capacity(w.len());
        for h in 0..heads {
            for i in 0..d / 2 {
                for j in 0..2 {
                    let row = h * d + j * d / 2 + i;
                    out.extend_from_slice(&w[row * cols..(row + 1) * cols]);
                }
            }
        }
        out
    }

    /// The tensors of `weights` as a GGUF file stores them (F32, GGUF names,
    /// dims innermost first, Q/K permuted for a `llama` file).
    fn tensors(weights: &Weights) -> Vec<(String, Vec<u64>, u32, Vec<u8>)> {
        tensors_of(weights, true)
    }

    /// As [`tensors`], Q/K permuted or not, with the output matrix, biases
    /// and Q/K norms where the weights have them.
    fn tensors_of(weights: &Weights, permuted: bool) -> Vec<(String, Vec<u64>, u32, Vec<u8>)> {
        let c = &weights.config;
        let (h, q, kv, f) = (
            c.hidden_size as u64,
            c.q_dim() as u64,
            c.kv_dim() as u64,
            c.ffn_size as u64,
        );
        let mut out = vec![
            (
                "token_embd.weight".into(),
                vec![h, c.vocab_size as u64],
                0,
                f32_bytes(&weights.embed.f32()),
            ),
            (
                "output_norm.weight".into(),
                vec![h],
                0,
                f32_bytes(&weights.final_norm),
            ),
        ];
        if let Some(head) = &weights.lm_head {
            let dims = vec![h, c.vocab_size as u64];
            out.push(("output.weight".into(), dims, 0, f32_bytes(&head.f32())));
        }
        let hd = c.hidden_size;
        let maybe_permute = |w: &[f32], heads: usize| {
            if permuted {
                permute(w, heads, hd)
            } else {
                w.to_vec()
            }
        };
        for (i, l) in weights.layers.iter().enumerate() {
            let mut put = |name: &str, dims: Vec<u64>, t: &[f32]| {
                out.push((format!("blk.{i}.{name}"), dims, 0, f32_bytes(t)));
            };
            put("attn_norm.weight", vec![h], &l.attn_norm);
            put(
                "attn_q.weight",
                vec![h, q],
                &maybe_permute(&l.wq.f32(), c.num_heads),
            );
            put(
                "attn_k.weight",
                vec![h, kv],
                &maybe_permute(&l.wk.f32(), c.num_kv_heads),
            );
            put("attn_v.weight", vec![h, kv], &l.wv.f32());
            if let Some(bias) = &l.qkv_bias {
                let (bq, bkv) = bias.split_at(q as usize);
                let (bk, bv) = bkv.split_at(kv as usize);
                put("attn_q.bias", vec![q], bq);
                put("attn_k.bias", vec![kv], bk);
                put("attn_v.bias", vec![kv], bv);
            }
            if let Some((qn, kn)) = &l.qk_norm {
                put("attn_q_norm.weight", vec![qn.len() as u64], qn);
                put("attn_k_norm.weight", vec![kn.len() as u64], kn);
            }
            put("attn_output.weight", vec![q, h], &l.wo.f32());
            put("ffn_norm.weight", vec![h], &l.mlp_norm);
            put("ffn_gate.weight", vec![h, f], &l.w_gate.f32());
            put("ffn_up.weight", vec![h, f], &l.w_up.f32());
            put("ffn_down.weight", vec![f, h], &l.w_down.f32());
        }
        out
    }

    fn file_of(
        metadata: &[(&'static str, Value)],
        tensors: &[(String, Vec<u64>, u32, Vec<u8>)],
    ) -> Vec<u8> {
        let refs: Vec<(&str, Vec<u64>, u32, Vec<u8>)> = tensors
            .iter()
            .map(|(n, d, t, b)| (n.as_str(), d.clone(), *t, b.clone()))
            .collect();
        gguf_bytes(metadata, &refs)
    }

    /// A file in the temp dir, removed on drop.
    struct TempFile(std::path::PathBuf);

    impl TempFile {
        fn with(name: &str, bytes: &[u8]) -> Self {
            let path = std::env::temp_dir().join(format!(
                "kvlease-load-test-{}-{name}.gguf",
                std::process::id()
            ));
            std::fs::write(&path, bytes).unwrap_or_else(|e| panic!("{e}"));
            TempFile(path)
        }
    }

    impl Drop for TempFile {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(&self.0);
        }
    }

    const SERVING: ServingShape = ServingShape {
        max_context: 1024,
        tokens_per_block: 16,
    };

    fn open_error(name: &str, bytes: &[u8]) -> String {
        let file = TempFile::with(name, bytes);
        match open(&file.0, SERVING) {
            Ok(_) => panic!("{name}: the file loaded"),
            Err(e) => {
                let message = e.to_string();
                assert!(message.contains(&file.0.display().to_string()), "{message}");
                message
            }
        }
    }

    #[test]
    fn q8_0_matrices_load_packed_with_unpermuted_rows() {
        use crate::dequant::GgmlType;
        use crate::model::weights::Matrix;
        use crate::packed::PackedMatrix;
        // Rows of whole 32-element blocks.
        let config = ModelConfig {
            hidden_size: 32,
            head_dim: 16,
            ffn_size: 32,
            ..config()
        };
        let weights = Weights::seeded(config.clone(), 5).unwrap_or_else(|e| panic!("{e}"));
        let mut meta = metadata();
        for (key, value) in &mut meta {
            if matches!(*key, "llama.embedding_length" | "llama.feed_forward_length") {
                *value = Value::U64(32);
            }
        }
        let q8 = |values: &[f32]| {
            PackedMatrix::quantize_q8_0(values.len() / 32, 32, values)
                .unwrap_or_else(|e| panic!("{e}"))
        };
        let mut quantized = tensors(&weights);
        for (name, dims, ty, bytes) in &mut quantized {
            if dims.len() == 2 && !name.starts_with("output") {
                let values: Vec<f32> = bytes
                    .chunks_exact(4)
                    .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                    .collect();
                *bytes = q8(&values).blocks().to_vec();
                *ty = 8;
            }
        }
        let file = TempFile::with("q8", &file_of(&meta, &quantized));
        let loaded = open(&file.0, SERVING).unwrap_or_else(|e| panic!("{e}"));
        let w = &loaded.weights;
        let packed = |m: &Matrix| matches!(m, Matrix::Packed(p) if p.ty() == GgmlType::Q8_0);
        assert!(packed(&w.embed) && w.layers.iter().all(|l| packed(&l.wq) && packed(&l.wk)));
        // Row by row, Q8_0 of the HF matrix: the permutation moved whole rows.
        for (got, want) in w.layers.iter().zip(&weights.layers) {
            assert_eq!(got.wq.f32(), q8(&want.wq.f32()).to_f32());
            assert_eq!(got.wk.f32(), q8(&want.wk.f32()).to_f32());
            assert_eq!(got.w_down.f32(), q8(&want.w_down.f32()).to_f32());
        }
        assert!(w.bytes() < weights.bytes() / 3);
    }

    #[test]
    fn a_gguf_file_loads_with_its_shape_unpermuted_rows_and_tokenizer() {
        let weights = Weights::seeded(config(), 4).unwrap_or_else(|e| panic!("{e}"));
        let file = TempFile::with("good", &file_of(&metadata(), &tensors(&weights)));
        let loaded = open(&file.0, SERVING).unwrap_or_else(|e| panic!("{e}"));
        // max_context is capped at the file's context_length.
        assert_eq!(loaded.weights.config, config());
        assert_eq!(loaded.weights, weights);
        assert_eq!(loaded.tokenizer.vocab_size(), 8);
        assert_eq!(loaded.tokenizer.encode("ab").unwrap_or_default(), vec![5]);
    }

    #[test]
    fn bad_gguf_files_are_errors_naming_the_file_and_the_problem() {
        let weights = Weights::seeded(config(), 4).unwrap_or_else(|e| panic!("{e}"));
        let good = file_of(&metadata(), &tensors(&weights));

        let err = open_error("truncated", &good[..good.len() / 2]);
        assert!(err.contains("truncated"), "{err}");

        let mut unknown = tensors(&weights);
        unknown[1].2 = 99;
        let err = open_error("unknown-type", &file_of(&metadata(), &unknown));
        assert!(
            err.contains("output_norm.weight has unknown type id 99"),
            "{err}"
        );

        let mut arch = metadata();
        arch[0].1 = Value::Str("gemma2".into());
        let err = open_error("arch", &file_of(&arch, &tensors(&weights)));
        assert!(
            err.contains("unsupported architecture \"gemma2\" (supported: llama, qwen2, qwen3)"),
            "{err}"
        );

        let mut moe = metadata();
        moe.push(("llama.expert_count", Value::U64(8)));
        let err = open_error("moe", &file_of(&moe, &tensors(&weights)));
        assert!(
            err.contains("mixture-of-experts models are not supported (llama.expert_count is 8)"),
            "{err}"
        );

        let mut shape = tensors(&weights);
        if let Some(k) = shape.iter_mut().find(|t| t.0 == "blk.1.attn_k.weight") {
            // Same bytes, rows and columns swapped.
            k.1 = vec![8, 16];
        }
        let err = open_error("shape", &file_of(&metadata(), &shape));
        assert!(
            err.contains("tensor blk.1.attn_k.weight has dims [8, 16]"),
            "{err}"
        );

        let mut vocab = metadata();
        vocab[11].1 = Value::Array(
            TOKENS[..7]
                .iter()
                .map(|s| Value::Str((*s).into()))
                .collect(),
        );
        let err = open_error("vocab", &file_of(&vocab, &tensors(&weights)));
        assert!(
            err.contains("vocab mismatch: the tokenizer has 7 tokens"),
            "{err}"
        );

        let no_tokens: Vec<_> = metadata()
            .into_iter()
            .filter(|(k, _)| *k != "tokenizer.ggml.tokens")
            .collect();
        let err = open_error("no-tokenizer", &file_of(&no_tokens, &tensors(&weights)));
        assert!(err.contains("missing tokenizer"), "{err}");

        let err = open_error("not-gguf", b"{\"not\": \"a model\"}");
        assert!(err.contains("not a GGUF file"), "{err}");
    }

    /// The HF fixture `name` (`tests/data/arch/`) written as an F32 GGUF
    /// file the way `convert_hf_to_gguf.py` writes a Qwen model (no Q/K
    /// permutation), with its tokenizer's vocabulary and merges.
    fn qwen_gguf(name: &str, hf: &LoadedModel) -> Vec<u8> {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/data/arch")
            .join(name);
        let text =
            std::fs::read_to_string(dir.join("tokenizer.json")).unwrap_or_else(|e| panic!("{e}"));
        let json: serde_json::Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}"));
        let model = &json["model"];
        let vocab = model["vocab"]
            .as_object()
            .unwrap_or_else(|| panic!("vocab"));
        let mut tokens = vec![String::new(); vocab.len()];
        for (token, id) in vocab {
            tokens[id.as_u64().unwrap_or(u64::MAX) as usize] = token.clone();
        }
        let merges: Vec<Value> = model["merges"]
            .as_array()
            .unwrap_or_else(|| panic!("merges"))
            .iter()
            .map(|m| {
                Value::Str(format!(
                    "{} {}",
                    m[0].as_str().unwrap_or(""),
                    m[1].as_str().unwrap_or("")
                ))
            })
            .collect();
        let c = &hf.weights.config;
        let key = |k: &str| -> &'static str { Box::leak(format!("{name}.{k}").into_boxed_str()) };
        let meta = vec![
            ("general.architecture", Value::Str(name.into())),
            ("general.name", Value::Str(name.into())),
            (key("block_count"), Value::U64(c.num_layers() as u64)),
            (key("context_length"), Value::U64(512)),
            (key("embedding_length"), Value::U64(c.hidden_size as u64)),
            (key("feed_forward_length"), Value::U64(c.ffn_size as u64)),
            (key("attention.head_count"), Value::U64(c.num_heads as u64)),
            (
                key("attention.head_count_kv"),
                Value::U64(c.num_kv_heads as u64),
            ),
            (key("attention.key_length"), Value::U64(c.head_dim as u64)),
            (key("rope.freq_base"), Value::F64(f64::from(c.rope_theta))),
            (
                key("attention.layer_norm_rms_epsilon"),
                Value::F64(f64::from(c.rms_norm_eps)),
            ),
            ("tokenizer.ggml.model", Value::Str("gpt2".into())),
            ("tokenizer.ggml.pre", Value::Str("qwen2".into())),
            (
                "tokenizer.ggml.tokens",
                Value::Array(tokens.into_iter().map(Value::Str).collect()),
            ),
            ("tokenizer.ggml.merges", Value::Array(merges)),
            ("tokenizer.ggml.eos_token_id", Value::U64(1023)),
        ];
        file_of(&meta, &tensors_of(&hf.weights, false))
    }

    #[test]
    fn qwen2_and_qwen3_gguf_files_load_the_weights_and_tokenizer_of_their_hf_checkpoints() {
        for name in ["qwen2", "qwen3"] {
            let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("tests/data/arch")
                .join(name);
            let hf = open(&dir, SERVING).unwrap_or_else(|e| panic!("{name}: {e}"));
            let file = TempFile::with(name, &qwen_gguf(name, &hf));
            let gguf = open(&file.0, SERVING).unwrap_or_else(|e| panic!("{name} gguf: {e}"));
            let (mut got, want) = (gguf.weights, &hf.weights);
            got.config.name = want.config.name.clone();
            // The same weights and shape: the forward pass (held to
            // transformers on the HF directory by tests/architectures.rs)
            // is the same computation.
            assert_eq!(got.config, want.config, "{name}");
            assert_eq!(&got, want, "{name}");
            for text in ["The capital of France is", "def fibonacci(n):\n    return"] {
                assert_eq!(
                    gguf.tokenizer.encode(text).unwrap_or_default(),
                    hf.tokenizer.encode(text).unwrap_or_default(),
                    "{name}: {text:?}"
                );
            }
        }
    }

    #[test]
    fn llama3_rope_scaling_matches_transformers_frequencies() {
        let config = ModelConfig {
            rope_scaling: RopeScaling::Llama3 {
                factor: 8.0,
                low_freq_factor: 1.0,
                high_freq_factor: 4.0,
                original_context: 64.0,
            },
            ..config()
        };
        // transformers' `_compute_llama3_parameters` for head_dim 8, theta
        // 1e4: one frequency per band (kept, smoothed, scaled, scaled).
        let expected = [1.0, 0.013042256043820465, 0.00125, 0.000125];
        for (got, want) in config.rope_inv_freq().iter().zip(expected) {
            assert!((got - want).abs() <= 1e-12 * want, "{got} vs {want}");
        }
    }
}
