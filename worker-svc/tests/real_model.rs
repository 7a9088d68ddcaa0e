//! Real model files on the CPU backend: a tiny random Hugging Face
//! checkpoint (sharded safetensors, Llama 3.1 RoPE scaling) held to the
//! dense reference, and SmolLM2-135M-Instruct held to transformers
//! (`tests/data/smollm2_reference.json`): token ids, greedy continuations
//! identical, teacher-forced logits within 1e-2 of the reference's top-5.
//! The SmolLM2 test prints why and passes when the GGUF is not in the model
//! cache (`kvlease model fetch smollm2`).

mod model_files;

use model_files::{TempDir, paged_vs_dense, tiny_config, write_hf_checkpoint};
use worker_svc::batch::Limits;
use worker_svc::model::load::{self, ServingShape};
use worker_svc::model::weights::Matrix;
use worker_svc::worker::{Worker, WorkerOptions};

fn cpu_options(weight_bytes: u64) -> WorkerOptions {
    WorkerOptions {
        host_blocks: 0,
        memory_budget_bytes: weight_bytes + (512 << 20),
        limits: Limits {
            max_batch_sequences: 8,
            max_batch_tokens: 512,
        },
        threads: 2,
    }
}

#[test]
fn a_sharded_hf_checkpoint_loads_with_its_own_shape_and_runs_paged_equal_to_dense() {
    for llama3 in [false, true] {
        let dir = TempDir::new(&format!("hf-llama3-{llama3}"));
        let written = write_hf_checkpoint(&dir.0, llama3);
        let serving = ServingShape {
            max_context: 128,
            tokens_per_block: 8,
        };
        let loaded = load::open(&dir.0, serving).unwrap_or_else(|e| panic!("{e}"));
        let name = written.config.name.clone();
        assert_eq!(loaded.weights.config, tiny_config(&name, llama3, 128));
        let shape = load::shape(&dir.0, serving).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(
            shape, loaded.weights.config,
            "the shape alone equals the loaded one"
        );
        assert_eq!(loaded.weights.embed, written.embed);
        assert_eq!(loaded.weights.layers, written.layers);
        assert_eq!(loaded.weights.final_norm, written.final_norm);
        assert_eq!(loaded.weights.lm_head, written.lm_head);
        assert_eq!(loaded.tokenizer.vocab_size(), 64);
        assert_eq!(
            loaded.tokenizer.encode("w3 w17 w63").unwrap_or_default(),
            vec![3, 17, 63]
        );

        let weights = loaded.weights;
        let mut worker = Worker::new_cpu(weights.clone(), cpu_options(weights.bytes()))
            .unwrap_or_else(|e| panic!("{e}"));
        let err = paged_vs_dense(&mut worker, &weights);
        println!(
            "hf checkpoint (llama3 rope {llama3}): paged vs dense max relative error {err:.2e}"
        );
        assert!(err < 1e-4, "paged vs dense: {err}");
    }
}

#[test]
fn smollm2_on_the_cpu_matches_transformers() {
    let Some(path) = model_files::smollm2_gguf() else {
        return;
    };
    let fixture = model_files::fixture();
    let loaded = model_files::load(&path);
    let config = &loaded.weights.config;
    assert_eq!(
        (
            config.num_layers(),
            config.hidden_size,
            config.num_heads,
            config.num_kv_heads
        ),
        (30, 576, 9, 3)
    );
    assert_eq!(
        (config.head_dim, config.vocab_size, config.tied_embeddings),
        (64, 49152, true)
    );

    // The prompts' token ids from our tokenizer are transformers'.
    for p in &fixture.prompts {
        let ids = match &p.messages {
            Some(messages) => {
                let messages: Vec<kvlease_tokenizer::Message> = messages
                    .iter()
                    .map(|m| kvlease_tokenizer::Message::new(&m.role, &m.content))
                    .collect();
                loaded.tokenizer.encode_chat(&messages)
            }
            None => loaded.tokenizer.encode(&p.text),
        }
        .unwrap_or_else(|e| panic!("{}: {e}", p.name));
        assert_eq!(ids, p.ids, "{}: token ids of {:?}", p.name, p.text);
    }

    let weights = loaded.weights;
    // The CPU backend multiplies by the file's Q4_1 and Q8_0 blocks directly.
    assert!(matches!(weights.embed, Matrix::Packed(_)));
    assert!(
        weights
            .layers
            .iter()
            .all(|l| matches!(l.wq, Matrix::Packed(_)) && matches!(l.w_down, Matrix::Packed(_)))
    );
    let mut worker = Worker::new_cpu(weights.clone(), cpu_options(weights.bytes()))
        .unwrap_or_else(|e| panic!("{e}"));
    println!(
        "SmolLM2 on the CPU (Q4_1/Q8_0 weights kept packed, products from the blocks in f32) \
         vs transformers {}:",
        fixture.transformers
    );
    let report = model_files::compare(&mut worker, &fixture);
    for (name, matched) in &report.greedy_match {
        assert_eq!(
            *matched, fixture.new_tokens,
            "{name}: greedy continuation differs"
        );
    }
    assert!(
        report.max_abs_err <= 1e-2,
        "teacher-forced logits differ by {} (> 1e-2)",
        report.max_abs_err
    );
}

/// `load::open`'s error for `dir` after `spoil` changed the checkpoint.
fn hf_error(name: &str, spoil: impl FnOnce(&std::path::Path)) -> String {
    let dir = TempDir::new(name);
    write_hf_checkpoint(&dir.0, false);
    spoil(&dir.0);
    let serving = ServingShape {
        max_context: 128,
        tokens_per_block: 8,
    };
    match load::open(&dir.0, serving) {
        Ok(_) => panic!("{name}: the checkpoint loaded"),
        Err(e) => {
            let message = e.to_string();
            assert!(message.contains(&dir.0.display().to_string()), "{message}");
            message
        }
    }
}

/// Rewrites one field of `dir/config.json`.
fn set_config(dir: &std::path::Path, key: &str, value: serde_json::Value) {
    let path = dir.join("config.json");
    let text = std::fs::read_to_string(&path).unwrap_or_default();
    let mut json: serde_json::Value = serde_json::from_str(&text).unwrap_or_default();
    json[key] = value;
    model_files::write(&path, &json.to_string());
}

#[test]
fn bad_hf_checkpoints_are_errors_naming_the_directory_and_the_problem() {
    let err = hf_error("no-tokenizer", |d| {
        let _ = std::fs::remove_file(d.join("tokenizer.json"));
    });
    assert!(err.contains("missing tokenizer"), "{err}");

    let err = hf_error("arch", |d| {
        set_config(d, "architectures", serde_json::json!(["GPT2LMHeadModel"]));
    });
    assert!(err.contains("unsupported architecture"), "{err}");

    let err = hf_error("shape", |d| set_config(d, "intermediate_size", 64.into()));
    assert!(
        err.contains("tensor model.layers.0.mlp.gate_proj.weight has shape [48, 32]"),
        "{err}"
    );

    let err = hf_error("vocab", |d| set_config(d, "vocab_size", 32.into()));
    assert!(
        err.contains("vocab mismatch: the tokenizer has 64 tokens"),
        "{err}"
    );

    let err = hf_error("shard", |d| {
        let _ = std::fs::remove_file(d.join("model-00002-of-00002.safetensors"));
    });
    assert!(err.contains("model-00002-of-00002.safetensors"), "{err}");

    let err = hf_error("rope", |d| {
        set_config(
            d,
            "rope_scaling",
            serde_json::json!({"rope_type": "yarn", "factor": 4.0}),
        );
    });
    assert!(
        err.contains("unsupported rope_scaling type \"yarn\""),
        "{err}"
    );
}

#[test]
fn the_worker_binary_exits_64_naming_a_bad_model_file() {
    let dir = TempDir::new("bin");
    let path = dir.0.join("broken.gguf");
    model_files::write(&path, "GGUF");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_kvlease-worker"))
        .args(["--listen", "127.0.0.1:0", "--model"])
        .arg(&path)
        .output()
        .unwrap_or_else(|e| panic!("cannot run kvlease-worker: {e}"));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(64), "{stderr}");
    assert!(stderr.contains(&path.display().to_string()), "{stderr}");
    assert!(stderr.contains("truncated"), "{stderr}");
}

#[test]
fn smollm2_says_the_capital_of_france_is_paris() {
    let Some(path) = model_files::smollm2_gguf() else {
        return;
    };
    let loaded = model_files::load(&path);
    let serving = ServingShape {
        max_context: loaded.weights.config.max_context,
        tokens_per_block: loaded.weights.config.tokens_per_block,
    };
    let shape = load::shape(&path, serving).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        shape, loaded.weights.config,
        "the shape alone equals the loaded one"
    );
    // quantized matrices stay packed: far below the f32 size of the shape
    let f32_bytes = shape.num_params() as u64 * 4;
    assert!(
        loaded.weights.bytes() < f32_bytes / 4,
        "{} bytes of weights, {f32_bytes} as f32",
        loaded.weights.bytes()
    );
    let prompt = loaded
        .tokenizer
        .encode("The capital of France is")
        .unwrap_or_else(|e| panic!("{e}"));
    let weights = loaded.weights;
    let mut worker = Worker::new_cpu(weights.clone(), cpu_options(weights.bytes()))
        .unwrap_or_else(|e| panic!("{e}"));
    let tokens = model_files::greedy(&mut worker, &[&prompt], 4);
    let text = loaded.tokenizer.decode(&tokens[0]);
    println!("The capital of France is{text:?}");
    assert!(text.contains("Paris"), "{text:?}");
}

#[tokio::test]
async fn the_worker_serves_a_hf_directory_with_its_shape_and_its_tokenizer() {
    use kvlease_proto::v1 as pb;

    let dir = TempDir::new("serve");
    write_hf_checkpoint(&dir.0, false);
    let serving = ServingShape {
        max_context: 128,
        tokens_per_block: 8,
    };
    let expected = load::open(&dir.0, serving).unwrap_or_else(|e| panic!("{e}"));
    let config = worker_svc::Config {
        model: Some(dir.0.clone()),
        max_context: 128,
        tokens_per_block: 8,
        ..worker_svc::Config::default()
    };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .unwrap_or_else(|e| panic!("bind: {e}"));
    let addr = listener.local_addr().unwrap_or_else(|e| panic!("{e}"));
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(worker_svc::run(listener, config, async {
        let _ = stopped.await;
    }));
    let mut client =
        pb::worker_service_client::WorkerServiceClient::connect(format!("http://{addr}"))
            .await
            .unwrap_or_else(|e| panic!("connect: {e}"));
    let describe = client
        .describe(pb::DescribeRequest {})
        .await
        .unwrap_or_else(|e| panic!("describe: {e}"))
        .into_inner();
    let model = describe.model.unwrap_or_default();
    assert_eq!(model.name, expected.weights.config.name);
    assert_eq!(
        (
            model.vocab_size,
            model.hidden_size,
            model.num_layers,
            model.max_context
        ),
        (64, 32, 3, 128)
    );
    assert_eq!(describe.tokens_per_block, 8);
    assert_eq!(
        model.tokenizer_fingerprint,
        expected.tokenizer.fingerprint()
    );
    let _ = stop.send(());
    match server.await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => panic!("worker failed: {e}"),
        Err(e) => panic!("worker task: {e}"),
    }
}
