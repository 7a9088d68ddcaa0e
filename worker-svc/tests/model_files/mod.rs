//! Real model files for `real_model.rs` (CPU) and `cuda.rs` (GPU): a tiny
//! random Hugging Face checkpoint written to a temp directory, and
//! SmolLM2-135M-Instruct (the Q4_1 GGUF) against transformers' reference
//! outputs (`tests/data/smollm2_reference.json`, written by
//! `scripts/reference_fixture.py`).
//!
//! SmolLM2, two comparisons per prompt: teacher-forced (one Forward over the prompt
//! and the reference's greedy continuation, logits at every position,
//! compared on the reference's top-5 ids), and greedy (prefill, then one
//! decode step per token with the KV cache, as the scheduler runs it).

#![allow(dead_code, unreachable_pub)]

use std::path::{Path, PathBuf};

use safetensors::tensor::{Dtype, TensorView};
use serde::Deserialize;
use worker_svc::batch::{Sampling, SeqInput, TableInput};
use worker_svc::model::load::{self, LoadedModel, ServingShape};
use worker_svc::model::weights::Weights;
use worker_svc::model::{ModelConfig, RopeScaling};
use worker_svc::reference::{self, DenseModel};
use worker_svc::worker::Worker;

// === a tiny Hugging Face checkpoint ===

/// A directory under the temp dir, removed on drop.
pub struct TempDir(pub PathBuf);

impl TempDir {
    pub fn new(name: &str) -> Self {
        let path =
            std::env::temp_dir().join(format!("kvlease-worker-test-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&path);
        std::fs::create_dir_all(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        TempDir(path)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Words of the tiny checkpoint's word-level tokenizer; id = index.
pub const TINY_VOCAB: usize = 64;

/// The tiny checkpoint's shape (3 layers, GQA 4/2 heads of 8, untied head),
/// with Llama 3.1 RoPE scaling when `llama3` (original context 64, so
/// the three bands of the scheme all occur with head_dim 8).
pub fn tiny_config(name: &str, llama3: bool, max_context: u32) -> ModelConfig {
    ModelConfig {
        name: name.to_string(),
        vocab_size: TINY_VOCAB,
        hidden_size: 32,
        num_heads: 4,
        num_kv_heads: 2,
        head_dim: 8,
        ffn_size: 48,
        rope_theta: 10_000.0,
        rope_scaling: if llama3 {
            RopeScaling::Llama3 {
                factor: 8.0,
                low_freq_factor: 1.0,
                high_freq_factor: 4.0,
                original_context: 64.0,
            }
        } else {
            RopeScaling::None
        },
        rms_norm_eps: 1e-5,
        layer_windows: vec![0; 3],
        max_context,
        tokens_per_block: 8,
        tied_embeddings: false,
        arch: Default::default(),
    }
}

/// Name, shape, bytes and dtype of one tensor of a shard.
type ShardTensor = (String, Vec<usize>, Vec<u8>, Dtype);

/// Writes a random `LlamaForCausalLM` checkpoint into `dir`: config.json,
/// two shards (the first F32, the second BF16) with
/// `model.safetensors.index.json`, and a word-level tokenizer.json. Returns
/// the weights as written (BF16 tensors rounded as stored).
pub fn write_hf_checkpoint(dir: &Path, llama3: bool) -> Weights {
    let name = dir
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let mut weights =
        Weights::seeded(tiny_config(&name, llama3, 256), 21).unwrap_or_else(|e| panic!("{e}"));
    let rope_scaling = if llama3 {
        serde_json::json!({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
    } else {
        serde_json::Value::Null
    };
    let config = serde_json::json!({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": TINY_VOCAB, "hidden_size": 32, "num_hidden_layers": 3,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
        "intermediate_size": 48, "rope_theta": 10000.0, "rope_scaling": rope_scaling,
        "rms_norm_eps": 1e-5, "tie_word_embeddings": false, "bos_token_id": 1,
        "eos_token_id": 2, "max_position_embeddings": 256, "hidden_act": "silu",
        "torch_dtype": "float32"
    });
    write(&dir.join("config.json"), &config.to_string());

    let h = 32;
    let round_bf16 = |t: &mut Vec<f32>| {
        for v in t.iter_mut() {
            *v = half::bf16::from_f32(*v).to_f32();
        }
    };
    // Shard 2 holds layers 1.. and the head, in BF16.
    for layer in &mut weights.layers[1..] {
        for t in [
            &mut layer.attn_norm,
            layer.wq.f32_mut(),
            layer.wk.f32_mut(),
            layer.wv.f32_mut(),
            layer.wo.f32_mut(),
            &mut layer.mlp_norm,
            layer.w_gate.f32_mut(),
            layer.w_up.f32_mut(),
            layer.w_down.f32_mut(),
        ] {
            round_bf16(t);
        }
    }
    round_bf16(&mut weights.final_norm);
    if let Some(head) = &mut weights.lm_head {
        round_bf16(head.f32_mut());
    }
    let mut shards: [Vec<ShardTensor>; 2] = [Vec::new(), Vec::new()];
    let f32_bytes = |t: &[f32]| t.iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<u8>>();
    let bf16_bytes = |t: &[f32]| {
        t.iter()
            .flat_map(|v| half::bf16::from_f32(*v).to_le_bytes())
            .collect::<Vec<u8>>()
    };
    let mut put = |shard: usize, name: String, shape: Vec<usize>, t: &[f32]| {
        let (bytes, dtype) = if shard == 0 {
            (f32_bytes(t), Dtype::F32)
        } else {
            (bf16_bytes(t), Dtype::BF16)
        };
        shards[shard].push((name, shape, bytes, dtype));
    };
    put(
        0,
        "model.embed_tokens.weight".into(),
        vec![TINY_VOCAB, h],
        &weights.embed.f32(),
    );
    for (i, l) in weights.layers.iter().enumerate() {
        let shard = usize::from(i > 0);
        let p = format!("model.layers.{i}.");
        let tensors: [(&str, Vec<usize>, &[f32]); 9] = [
            ("input_layernorm.weight", vec![h], &l.attn_norm),
            ("self_attn.q_proj.weight", vec![32, h], &l.wq.f32()),
            ("self_attn.k_proj.weight", vec![16, h], &l.wk.f32()),
            ("self_attn.v_proj.weight", vec![16, h], &l.wv.f32()),
            ("self_attn.o_proj.weight", vec![h, 32], &l.wo.f32()),
            ("post_attention_layernorm.weight", vec![h], &l.mlp_norm),
            ("mlp.gate_proj.weight", vec![48, h], &l.w_gate.f32()),
            ("mlp.up_proj.weight", vec![48, h], &l.w_up.f32()),
            ("mlp.down_proj.weight", vec![h, 48], &l.w_down.f32()),
        ];
        for (suffix, shape, t) in tensors {
            put(shard, format!("{p}{suffix}"), shape, t);
        }
    }
    put(1, "model.norm.weight".into(), vec![h], &weights.final_norm);
    let head = weights
        .lm_head
        .as_ref()
        .map(|m| m.f32().into_owned())
        .unwrap_or_default();
    put(1, "lm_head.weight".into(), vec![TINY_VOCAB, h], &head);

    let mut weight_map = serde_json::Map::new();
    for (k, shard) in shards.iter().enumerate() {
        let file = format!("model-{:05}-of-00002.safetensors", k + 1);
        let views: Vec<(String, TensorView<'_>)> = shard
            .iter()
            .map(|(name, shape, bytes, dtype)| {
                weight_map.insert(name.clone(), file.clone().into());
                let view = TensorView::new(*dtype, shape.clone(), bytes)
                    .unwrap_or_else(|e| panic!("{name}: {e}"));
                (name.clone(), view)
            })
            .collect();
        safetensors::serialize_to_file(views, None, &dir.join(&file))
            .unwrap_or_else(|e| panic!("{file}: {e}"));
    }
    let index = serde_json::json!({"metadata": {"total_size": 0}, "weight_map": weight_map});
    write(
        &dir.join("model.safetensors.index.json"),
        &index.to_string(),
    );
    write(&dir.join("tokenizer.json"), &tiny_tokenizer_json());
    weights
}

/// A word-level tokenizer of [`TINY_VOCAB`] words: `<unk>`, `<s>`, `</s>`,
/// then `w3` .. `w63`, split on whitespace.
pub fn tiny_tokenizer_json() -> String {
    let mut vocab = serde_json::Map::new();
    for (i, word) in ["<unk>", "<s>", "</s>"].iter().enumerate() {
        vocab.insert((*word).to_string(), i.into());
    }
    for i in 3..TINY_VOCAB {
        vocab.insert(format!("w{i}"), i.into());
    }
    serde_json::json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
        "normalizer": null, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": null,
        "decoder": null, "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<unk>"}
    })
    .to_string()
}

pub fn write(path: &Path, text: &str) {
    std::fs::write(path, text).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
}

/// Runs a 40-token prompt on `worker` as a prefill of 25 then 15 tokens and
/// 5 decode steps, on a reversed block table, and returns the largest
/// |paged − dense| over every position's logits, relative to the largest
/// dense logit.
pub fn paged_vs_dense(worker: &mut Worker, weights: &Weights) -> f32 {
    let tokens: Vec<u32> = (0..45u32)
        .map(|i| (i * 11 + 3) % TINY_VOCAB as u32)
        .collect();
    let b = weights.config.tokens_per_block as usize;
    let blocks: Vec<u32> = (0..tokens.len().div_ceil(b) as u32).rev().collect();
    let tables = || {
        vec![TableInput {
            window: 0,
            beam: 0,
            first_block: 0,
            block_ids: blocks.clone(),
        }]
    };
    let dense = DenseModel::new(weights);
    let mut seq = dense.sequence();
    let expected = dense.forward(&mut seq, &tokens);
    let mut got: Vec<Vec<f32>> = Vec::new();
    let vocab = weights.config.vocab_size;
    let mut start = 0;
    for chunk in [25, 15, 1, 1, 1, 1, 1] {
        let run = &tokens[start..start + chunk];
        let out = worker
            .forward(vec![input(9, run, start, tables(), true)])
            .unwrap_or_else(|e| panic!("forward at {start}: {e}"));
        got.extend(out.logits(0).chunks_exact(vocab).map(<[f32]>::to_vec));
        start += chunk;
    }
    // NaN anywhere makes the error NaN, which fails every tolerance
    reference::relative_error(&got.concat(), &expected.concat())
}

// === SmolLM2 against transformers ===

/// The SmolLM2 GGUF (`kvlease model fetch smollm2`), or `None` with the
/// reason printed; a missing file fails the test under
/// `KVLEASE_REQUIRE_MODEL=1`.
pub use kvlease_tokenizer::testing::smollm2_gguf;

/// The reference outputs: `$KVLEASE_SMOLLM2_FIXTURE`, else the committed file.
pub fn fixture() -> Fixture {
    let path = std::env::var_os("KVLEASE_SMOLLM2_FIXTURE").map_or_else(
        || Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/smollm2_reference.json"),
        PathBuf::from,
    );
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("cannot read the fixture {}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("fixture {}: {e}", path.display()))
}

#[derive(Debug, Deserialize)]
pub struct Fixture {
    pub model: String,
    pub transformers: String,
    pub new_tokens: usize,
    pub prompts: Vec<Prompt>,
}

#[derive(Debug, Deserialize)]
pub struct Message {
    pub role: String,
    pub content: String,
}

#[derive(Debug, Deserialize)]
pub struct Prompt {
    pub name: String,
    pub text: String,
    #[serde(default)]
    pub messages: Option<Vec<Message>>,
    pub ids: Vec<u32>,
    pub greedy: Vec<u32>,
    pub top_ids: Vec<Vec<u32>>,
    pub top_logits: Vec<Vec<f32>>,
    /// The whole logits row after the prompt (the architecture fixtures).
    #[serde(default)]
    pub last_logits: Vec<f32>,
}

/// Loads the GGUF (the model's context cut to 512 tokens, 16 per block).
pub fn load(path: &Path) -> LoadedModel {
    let serving = ServingShape {
        max_context: 512,
        tokens_per_block: 16,
    };
    load::open(path, serving).unwrap_or_else(|e| panic!("{e}"))
}

/// How one backend did on the fixture.
#[derive(Debug, Default)]
pub struct Report {
    /// Largest |ours − reference| over every position's reference top-5.
    pub max_abs_err: f32,
    /// Largest |ours − reference| / max |reference| over the compared
    /// logits of one position (the architecture fixtures).
    pub max_rel_err: f32,
    /// Teacher-forced positions where our argmax is the reference's.
    pub top1_agree: usize,
    /// Teacher-forced positions where our argmax is the reference's or a
    /// near-tie of it (the architecture fixtures, `arch::NEAR_TIE`).
    pub top1_near: usize,
    /// Teacher-forced positions compared.
    pub positions: usize,
    /// Per prompt: how many leading greedy tokens match the reference.
    pub greedy_match: Vec<(String, usize)>,
}

impl Report {
    pub fn top1_rate(&self) -> f64 {
        self.top1_agree as f64 / self.positions.max(1) as f64
    }
}

/// One table per pool of `worker` (every window it has), each naming
/// blocks `first_id..`, enough for `len` tokens.
pub fn tables(worker: &Worker, first_id: u32, len: usize) -> Vec<TableInput> {
    let b = worker.info().model.tokens_per_block as usize;
    worker
        .info()
        .pools
        .iter()
        .map(|p| TableInput {
            window: p.window,
            beam: 0,
            first_block: 0,
            block_ids: (first_id..first_id + len.div_ceil(b) as u32).collect(),
        })
        .collect()
}

/// A greedy sequence of `tokens` from `start`, logits at every position
/// when `all`.
pub fn input(
    seq_id: u64,
    tokens: &[u32],
    start: usize,
    tables: Vec<TableInput>,
    all: bool,
) -> SeqInput {
    SeqInput {
        seq_id,
        tokens: tokens.to_vec(),
        start_pos: start as u32,
        tables,
        all_positions: all,
        logprobs: None,
        sampling: Sampling::GREEDY,
        copies: Vec::new(),
        history: None,
        grammar: None,
    }
}

/// `n` greedy tokens after each prompt, all prompts in one batch: a
/// prefill, then one decode step per token with the KV cache, as the
/// scheduler runs it.
pub fn greedy(worker: &mut Worker, prompts: &[&[u32]], n: usize) -> Vec<Vec<u32>> {
    let per_seq = prompts.iter().map(|p| p.len() + n).max().unwrap_or(0);
    let b = worker.info().model.tokens_per_block as usize;
    let stride = per_seq.div_ceil(b) as u32;
    let prefill = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| {
            input(
                i as u64,
                p,
                0,
                tables(worker, i as u32 * stride, per_seq),
                false,
            )
        })
        .collect();
    let out = worker
        .forward(prefill)
        .unwrap_or_else(|e| panic!("prefill: {e}"));
    let mut tokens: Vec<Vec<u32>> = out.seqs.iter().map(|s| vec![s.next_token]).collect();
    for step in 1..n {
        let decode = prompts
            .iter()
            .zip(&tokens)
            .enumerate()
            .map(|(i, (p, t))| {
                let tables = tables(worker, i as u32 * stride, per_seq);
                input(i as u64, &t[step - 1..], p.len() + step - 1, tables, false)
            })
            .collect();
        let out = worker
            .forward(decode)
            .unwrap_or_else(|e| panic!("decode step {step}: {e}"));
        for (t, s) in tokens.iter_mut().zip(&out.seqs) {
            t.push(s.next_token);
        }
    }
    tokens
}

/// Runs every prompt of `fixture` on `worker`, printing a line per prompt
/// and, where greedy decoding leaves the reference, both logit margins there.
pub fn compare(worker: &mut Worker, fixture: &Fixture) -> Report {
    let mut report = Report::default();
    let vocab = worker.info().model.vocab_size;
    let prompts: Vec<&[u32]> = fixture.prompts.iter().map(|p| p.ids.as_slice()).collect();
    let greedy = greedy(worker, &prompts, fixture.new_tokens);
    for (p, ours) in fixture.prompts.iter().zip(greedy) {
        // Teacher-forced: prompt + reference continuation in one pass.
        let tokens: Vec<u32> = p.ids.iter().chain(&p.greedy).copied().collect();
        let tables = tables(worker, 0, tokens.len());
        let out = worker
            .forward(vec![input(1, &tokens, 0, tables, true)])
            .unwrap_or_else(|e| panic!("{}: teacher-forced forward: {e}", p.name));
        let logits = out.logits(0);
        assert_eq!(logits.len(), tokens.len() * vocab, "{}", p.name);
        assert_eq!(p.top_ids.len(), tokens.len(), "{}: fixture rows", p.name);
        let mut prompt_err = 0.0f32;
        for (pos, (ids, values)) in p.top_ids.iter().zip(&p.top_logits).enumerate() {
            let row = &logits[pos * vocab..(pos + 1) * vocab];
            let ours: Vec<f32> = ids.iter().map(|&id| row[id as usize]).collect();
            // a NaN stays NaN, so the tolerance check fails on it
            prompt_err = reference::nan_max(prompt_err, reference::max_abs_diff(&ours, values));
            report.positions += 1;
            if out.seqs[0].argmax[pos] == ids[0] {
                report.top1_agree += 1;
            }
        }
        report.max_abs_err = reference::nan_max(report.max_abs_err, prompt_err);

        let matched = ours
            .iter()
            .zip(&p.greedy)
            .take_while(|(a, b)| a == b)
            .count();
        println!(
            "{:>10}: {} prompt ids, teacher-forced max |err| {prompt_err:.2e}, greedy matches {matched}/{}",
            p.name,
            p.ids.len(),
            p.greedy.len()
        );
        if matched < p.greedy.len() {
            // Row of the position that picked the first differing token.
            let row = p.ids.len() - 1 + matched;
            let reference_margin = p.top_logits[row][0] - p.top_logits[row][1];
            let ours_row = &logits[row * vocab..(row + 1) * vocab];
            let ours_margin =
                ours_row[p.top_ids[row][0] as usize] - ours_row[p.top_ids[row][1] as usize];
            println!(
                "{:>10}  first difference at new token {matched}: reference {} (top-2 margin {reference_margin:.4}), \
                 ours {}; our teacher-forced logit gap between the reference's top two there: {ours_margin:.4}",
                "", p.greedy[matched], ours[matched]
            );
        }
        report.greedy_match.push((p.name.clone(), matched));
    }
    println!(
        "teacher-forced: max |err| over the reference top-5 {:.3e}, top-1 agreement {}/{} ({:.2}%)",
        report.max_abs_err,
        report.top1_agree,
        report.positions,
        100.0 * report.top1_rate()
    );
    report
}
