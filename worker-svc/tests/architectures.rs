//! Every architecture kvlease serves, on the CPU backend, against
//! transformers: the fixtures of `tests/data/arch/` (see `arch/mod.rs` and
//! `scripts/make_arch_fixtures.py`). Per fixture: the directory loads with
//! the shape and family its config.json declares, the tokenizer encodes
//! (and the chat template renders) the prompts as transformers did, 32
//! greedy tokens on 4 prompts equal the reference's, every logit compared
//! is within 1e-4 of the reference relative to the row's scale, the paged
//! pass equals the dense reference, and a reused prefix is bit-identical
//! to recomputing it. Then the start-up errors for what is not supported.

mod arch;
// Only its temp directory and file helpers are used here.
#[allow(unused_imports)]
mod model_files;

use kvlease_tokenizer::Message;
use worker_svc::batch::Limits;
use worker_svc::model::load::{self, LoadedModel, ServingShape};
use worker_svc::model::{Activation, Family};
use worker_svc::worker::{Worker, WorkerOptions};

/// f32 against f32: only the order of the sums differs.
const CPU_TOLERANCE: f32 = 1e-4;

fn cpu_worker(weights: &worker_svc::model::weights::Weights) -> Worker {
    let options = WorkerOptions {
        host_blocks: 0,
        memory_budget_bytes: weights.bytes() + (256 << 20),
        limits: Limits {
            max_batch_sequences: 8,
            max_batch_tokens: 512,
        },
        threads: 2,
    };
    Worker::new_cpu(weights.clone(), options).unwrap_or_else(|e| panic!("{e}"))
}

fn check_fixture(name: &str) {
    check_loaded(name, &arch::load(name));
}

fn check_loaded(name: &str, loaded: &LoadedModel) {
    let reference = arch::reference(name);
    let config = &loaded.weights.config;
    println!(
        "{name}: {} ({:?}, windows {:?}) vs transformers {}",
        reference.architecture, config.arch.family, config.layer_windows, reference.transformers
    );
    for p in &reference.prompts {
        let ids = match &p.messages {
            Some(messages) => {
                let messages: Vec<Message> = messages
                    .iter()
                    .map(|m| Message {
                        role: m.role.clone(),
                        content: m.content.clone(),
                    })
                    .collect();
                let text = loaded
                    .tokenizer
                    .render_chat(&messages)
                    .unwrap_or_else(|e| panic!("{name}: chat template: {e}"));
                assert_eq!(
                    text, p.text,
                    "{name}: the chat template renders as transformers'"
                );
                loaded.tokenizer.encode_chat(&messages)
            }
            None => loaded.tokenizer.encode(&p.text),
        }
        .unwrap_or_else(|e| panic!("{name}: encode: {e}"));
        assert_eq!(ids, p.ids, "{name}/{}: token ids", p.name);
    }
    let mut worker = cpu_worker(&loaded.weights);
    let report = arch::compare(&mut worker, &reference);
    for (prompt, matched) in &report.greedy_match {
        assert_eq!(
            *matched, reference.new_tokens,
            "{name}/{prompt}: only {matched} leading greedy tokens equal transformers'"
        );
    }
    assert!(
        report.max_rel_err <= CPU_TOLERANCE,
        "{name}: logits {:.2e} from transformers' (tolerance {CPU_TOLERANCE:.0e})",
        report.max_rel_err
    );
    assert_eq!(
        report.top1_agree, report.positions,
        "{name}: teacher-forced top-1"
    );

    arch::check_paged_and_reuse(
        &mut worker,
        &loaded.weights,
        &reference,
        name,
        CPU_TOLERANCE,
    );
}

#[test]
fn llama3_matches_transformers() {
    let config = arch::load("llama3").weights.config;
    assert_eq!(config.arch.family, Family::Llama);
    assert!(matches!(
        config.rope_scaling,
        worker_svc::model::RopeScaling::Llama3 { .. }
    ));
    check_fixture("llama3");
}

#[test]
fn qwen2_matches_transformers() {
    let loaded = arch::load("qwen2");
    let c = &loaded.weights.config;
    assert!(c.arch.qkv_bias && c.tied_embeddings && loaded.weights.lm_head.is_none());
    check_fixture("qwen2");
}

#[test]
fn qwen3_matches_transformers() {
    let c = arch::load("qwen3").weights.config;
    assert!(c.arch.qk_norm);
    assert_eq!((c.head_dim, c.q_dim(), c.hidden_size), (32, 128, 64));
    check_fixture("qwen3");
}

#[test]
fn mistral_matches_transformers() {
    let c = arch::load("mistral").weights.config;
    assert_eq!(c.layer_windows, vec![8, 8]);
    check_fixture("mistral");
}

#[test]
fn gemma2_matches_transformers() {
    let c = arch::load("gemma2").weights.config;
    assert_eq!(c.layer_windows, vec![8, 0]);
    assert_eq!(c.arch.activation, Activation::GeluTanh);
    assert_eq!(
        (c.arch.attn_softcap, c.arch.final_softcap),
        (Some(4.0), Some(8.0))
    );
    assert_eq!(c.attn_scale(), (24f64).powf(-0.5) as f32);
    check_fixture("gemma2");
}

#[test]
fn gemma3_matches_transformers() {
    let c = arch::load("gemma3").weights.config;
    assert_eq!(c.layer_windows, vec![8, 8, 0]);
    assert!(c.arch.qk_norm && c.arch.post_norms);
    assert_eq!(c.arch.local_rope_theta, Some(10_000.0));
    assert_ne!(c.layer_inv_freq(0), c.layer_inv_freq(2));
    check_fixture("gemma3");
}

#[test]
fn phi3_matches_transformers() {
    let c = arch::load("phi3").weights.config;
    assert_eq!(c.arch.family, Family::Phi3);
    // LongRoPE's attention factor for max 1024 / original 256.
    let factor = (1.0 + 4f64.ln() / 256f64.ln()).sqrt();
    assert_eq!(c.attn_scale(), (factor * factor / 4.0) as f32);
    check_fixture("phi3");
}

/// llama.cpp's converter's GGUF of the qwen2 and qwen3 fixtures (bf16,
/// the same weights): the same tokens and logits as transformers.
#[test]
fn qwen2_and_qwen3_gguf_files_from_llama_cpps_converter_match_transformers() {
    for name in ["qwen2", "qwen3"] {
        let gguf = arch::load_gguf(name);
        let hf = arch::load(name);
        assert_eq!(gguf.weights.layers, hf.weights.layers, "{name}: layers");
        assert_eq!(
            gguf.weights.config.arch, hf.weights.config.arch,
            "{name}: arch"
        );
        check_loaded(name, &gguf);
    }
}

// === what is refused ===

/// The error loading a copy of the qwen2 fixture whose config.json has been
/// changed by `edit`.
fn config_error(tag: &str, edit: impl FnOnce(&mut serde_json::Value)) -> String {
    let dir = copy_fixture("qwen2", tag);
    let path = dir.0.join("config.json");
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{e}")))
            .unwrap_or_else(|e| panic!("{e}"));
    edit(&mut config);
    model_files::write(&path, &config.to_string());
    open_error(&dir.0)
}

fn copy_fixture(name: &str, tag: &str) -> model_files::TempDir {
    let dir = model_files::TempDir::new(&format!("arch-{name}-{tag}"));
    for entry in std::fs::read_dir(arch::dir(name)).unwrap_or_else(|e| panic!("{e}")) {
        let entry = entry.unwrap_or_else(|e| panic!("{e}"));
        std::fs::copy(entry.path(), dir.0.join(entry.file_name()))
            .unwrap_or_else(|e| panic!("{e}"));
    }
    dir
}

fn open_error(dir: &std::path::Path) -> String {
    let serving = ServingShape {
        max_context: 256,
        tokens_per_block: 4,
    };
    match load::open(dir, serving) {
        Ok(_) => panic!("{} loaded", dir.display()),
        Err(e) => e.to_string(),
    }
}

#[test]
fn unsupported_configs_are_start_up_errors_naming_the_field_and_what_is_supported() {
    let err = config_error("moe", |c| c["num_experts"] = 8.into());
    assert!(
        err.contains("mixture-of-experts") && err.contains("num_experts"),
        "{err}"
    );
    assert!(err.contains("Qwen2ForCausalLM, Qwen3ForCausalLM"), "{err}");

    let err = config_error("arch", |c| {
        c["architectures"] = serde_json::json!(["Qwen3MoeForCausalLM"]);
    });
    assert!(
        err.contains("unsupported architecture [\"Qwen3MoeForCausalLM\"]"),
        "{err}"
    );
    assert!(err.contains("Gemma3ForCausalLM"), "{err}");

    let err = config_error("vision", |c| c["vision_config"] = serde_json::json!({}));
    assert!(
        err.contains("vision_config") && err.contains("not supported"),
        "{err}"
    );

    let err = config_error("rope", |c| {
        c["rope_parameters"] = serde_json::json!({"rope_type": "yarn", "factor": 4.0});
    });
    assert!(
        err.contains("unsupported rope_scaling type \"yarn\""),
        "{err}"
    );
    assert!(err.contains("default, linear, llama3, longrope"), "{err}");

    let err = config_error("quant", |c| {
        c["quantization_config"] = serde_json::json!({"quant_method": "awq"});
    });
    assert!(
        err.contains("quantization_config.quant_method \"awq\""),
        "{err}"
    );

    let err = config_error("act", |c| c["hidden_act"] = "gelu".into());
    assert!(
        err.contains("hidden_act \"gelu\" is not supported"),
        "{err}"
    );
    assert!(err.contains("supported: silu"), "{err}");

    let err = config_error("partial", |c| c["partial_rotary_factor"] = 0.75.into());
    assert!(err.contains("partial_rotary_factor 0.75"), "{err}");

    let err = config_error("layers", |c| {
        c["layer_types"] = serde_json::json!(["full_attention", "chunked_attention"]);
    });
    assert!(
        err.contains("layer_types entry \"chunked_attention\""),
        "{err}"
    );
}

#[test]
fn a_truncated_or_missing_weight_file_is_an_error_naming_the_file() {
    let dir = copy_fixture("qwen2", "truncated");
    let weights = dir.0.join("model.safetensors");
    let bytes = std::fs::read(&weights).unwrap_or_else(|e| panic!("{e}"));
    std::fs::write(&weights, &bytes[..bytes.len() / 2]).unwrap_or_else(|e| panic!("{e}"));
    let err = open_error(&dir.0);
    assert!(err.contains(&weights.display().to_string()), "{err}");

    // A shard the index names is missing.
    let dir = copy_fixture("llama3", "missing-shard");
    let shard = dir.0.join("model-00002-of-00003.safetensors");
    std::fs::remove_file(&shard).unwrap_or_else(|e| panic!("{e}"));
    let err = open_error(&dir.0);
    assert!(err.contains(&shard.display().to_string()), "{err}");

    // A tensor the architecture needs is not in the file.
    let dir = copy_fixture("qwen2", "no-bias");
    let path = dir.0.join("config.json");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{e}"));
    // The same weights declared as Qwen3: q_norm is missing.
    model_files::write(&path, &text.replace("Qwen2ForCausalLM", "Qwen3ForCausalLM"));
    let err = open_error(&dir.0);
    assert!(
        err.contains("missing tensor model.layers.0.self_attn.q_norm.weight"),
        "{err}"
    );
}
