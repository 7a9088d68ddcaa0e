//! Safetensors loading, with small model files the tests write themselves.

use std::path::PathBuf;

use safetensors::tensor::{Dtype, TensorView};
use worker_svc::Config;
use worker_svc::model::weights::Weights;
use worker_svc::model::{ModelConfig, RopeScaling};

fn small_config(tied: bool) -> ModelConfig {
    ModelConfig {
        name: String::new(),
        vocab_size: 30,
        hidden_size: 16,
        num_heads: 4,
        num_kv_heads: 2,
        head_dim: 4,
        ffn_size: 24,
        rope_theta: 10_000.0,
        rope_scaling: RopeScaling::None,
        rms_norm_eps: 1e-5,
        layer_windows: vec![0, 8],
        max_context: 64,
        tokens_per_block: 4,
        tied_embeddings: tied,
        arch: Default::default(),
    }
}

/// A path in the temp dir, removed on drop.
struct TempFile(PathBuf);

impl TempFile {
    fn new(name: &str) -> Self {
        TempFile(std::env::temp_dir().join(format!(
            "kvlease-worker-test-{}-{name}.safetensors",
            std::process::id()
        )))
    }
}

impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

fn seeded(tied: bool) -> Weights {
    match Weights::seeded(small_config(tied), 11) {
        Ok(w) => w,
        Err(e) => panic!("seeded: {e}"),
    }
}

#[test]
fn f32_round_trip_with_a_separate_lm_head() {
    let weights = seeded(false);
    let file = TempFile::new("f32-model");
    if let Err(e) = weights.save_safetensors(&file.0) {
        panic!("save: {e}");
    }
    let loaded = match Weights::load_safetensors(small_config(false), &file.0) {
        Ok(w) => w,
        Err(e) => panic!("load: {e}"),
    };
    assert!(loaded.lm_head.is_some());
    assert_eq!(
        loaded.config.name,
        format!("kvlease-worker-test-{}-f32-model", std::process::id())
    );
    assert_eq!(
        Weights {
            config: weights.config.clone(),
            ..loaded
        },
        weights
    );
}

/// Writes `weights` as F16 with the HF Llama names, independently of the
/// crate's own writer; returns the weights as F16 rounds them.
fn write_f16(weights: &Weights, path: &std::path::Path) -> Weights {
    let c = &weights.config;
    let h = c.hidden_size;
    let mut tensors: Vec<(String, Vec<usize>, Vec<f32>)> = vec![
        (
            "model.embed_tokens.weight".into(),
            vec![c.vocab_size, h],
            weights.embed.f32().into_owned(),
        ),
        (
            "model.norm.weight".into(),
            vec![h],
            weights.final_norm.clone(),
        ),
    ];
    for (i, l) in weights.layers.iter().enumerate() {
        let p = format!("model.layers.{i}.");
        tensors.extend([
            (
                format!("{p}input_layernorm.weight"),
                vec![h],
                l.attn_norm.clone(),
            ),
            (
                format!("{p}self_attn.q_proj.weight"),
                vec![c.q_dim(), h],
                l.wq.f32().into_owned(),
            ),
            (
                format!("{p}self_attn.k_proj.weight"),
                vec![c.kv_dim(), h],
                l.wk.f32().into_owned(),
            ),
            (
                format!("{p}self_attn.v_proj.weight"),
                vec![c.kv_dim(), h],
                l.wv.f32().into_owned(),
            ),
            (
                format!("{p}self_attn.o_proj.weight"),
                vec![h, c.q_dim()],
                l.wo.f32().into_owned(),
            ),
            (
                format!("{p}post_attention_layernorm.weight"),
                vec![h],
                l.mlp_norm.clone(),
            ),
            (
                format!("{p}mlp.gate_proj.weight"),
                vec![c.ffn_size, h],
                l.w_gate.f32().into_owned(),
            ),
            (
                format!("{p}mlp.up_proj.weight"),
                vec![c.ffn_size, h],
                l.w_up.f32().into_owned(),
            ),
            (
                format!("{p}mlp.down_proj.weight"),
                vec![h, c.ffn_size],
                l.w_down.f32().into_owned(),
            ),
        ]);
    }
    let bytes: Vec<(String, Vec<usize>, Vec<u8>)> = tensors
        .iter()
        .map(|(name, shape, t)| {
            let b = t
                .iter()
                .flat_map(|v| half::f16::from_f32(*v).to_le_bytes())
                .collect();
            (name.clone(), shape.clone(), b)
        })
        .collect();
    let views: Vec<(String, TensorView<'_>)> = bytes
        .iter()
        .map(
            |(name, shape, b)| match TensorView::new(Dtype::F16, shape.clone(), b) {
                Ok(v) => (name.clone(), v),
                Err(e) => panic!("view {name}: {e}"),
            },
        )
        .collect();
    if let Err(e) = safetensors::serialize_to_file(views, None, path) {
        panic!("write: {e}");
    }
    let round = |v: &[f32]| {
        v.iter()
            .map(|x| half::f16::from_f32(*x).to_f32())
            .collect::<Vec<f32>>()
    };
    let mut rounded = weights.clone();
    rounded.embed = round(&weights.embed.f32()).into();
    rounded.final_norm = round(&weights.final_norm);
    for l in &mut rounded.layers {
        for t in [
            &mut l.attn_norm,
            l.wq.f32_mut(),
            l.wk.f32_mut(),
            l.wv.f32_mut(),
            l.wo.f32_mut(),
            &mut l.mlp_norm,
            l.w_gate.f32_mut(),
            l.w_up.f32_mut(),
            l.w_down.f32_mut(),
        ] {
            *t = round(t);
        }
    }
    rounded
}

#[test]
fn f16_file_with_tied_embeddings_loads_converted() {
    let weights = seeded(true);
    let file = TempFile::new("f16-tied");
    let expected = write_f16(&weights, &file.0);
    let loaded = match Weights::load_safetensors(small_config(true), &file.0) {
        Ok(w) => w,
        Err(e) => panic!("load: {e}"),
    };
    assert!(loaded.lm_head.is_none() && loaded.config.tied_embeddings);
    assert_eq!(
        Weights {
            config: expected.config.clone(),
            ..loaded
        },
        expected
    );
}

#[test]
fn shape_mismatch_and_missing_tensors_are_clear_errors() {
    let weights = seeded(false);
    let file = TempFile::new("mismatch");
    if let Err(e) = weights.save_safetensors(&file.0) {
        panic!("save: {e}");
    }
    let wider = ModelConfig {
        ffn_size: 32,
        ..small_config(false)
    };
    let err = match Weights::load_safetensors(wider, &file.0) {
        Ok(_) => panic!("a wider ffn must not load"),
        Err(e) => e.to_string(),
    };
    assert!(
        err.contains("model.layers.0.mlp.gate_proj.weight") && err.contains("[32, 16]"),
        "{err}"
    );
    let deeper = ModelConfig {
        layer_windows: vec![0, 8, 0],
        ..small_config(false)
    };
    let err = match Weights::load_safetensors(deeper, &file.0) {
        Ok(_) => panic!("a third layer must not load"),
        Err(e) => e.to_string(),
    };
    assert!(err.contains("missing tensor model.layers.2."), "{err}");
    let err = match Weights::load_safetensors(small_config(false), &TempFile::new("absent").0) {
        Ok(_) => panic!("an absent file must not load"),
        Err(e) => e.to_string(),
    };
    assert!(err.starts_with("cannot load weights from"), "{err}");
}

#[tokio::test]
async fn the_server_serves_a_weights_file() {
    let weights = seeded(false);
    let file = TempFile::new("served");
    if let Err(e) = weights.save_safetensors(&file.0) {
        panic!("save: {e}");
    }
    let c = small_config(false);
    let config = Config {
        weights: Some(file.0.clone()),
        vocab_size: c.vocab_size,
        hidden_size: c.hidden_size,
        num_layers: 2,
        num_heads: c.num_heads,
        num_kv_heads: c.num_kv_heads,
        head_dim: c.head_dim,
        ffn_size: c.ffn_size,
        layer_windows: c.layer_windows.clone(),
        max_context: c.max_context,
        tokens_per_block: c.tokens_per_block,
        memory_budget_mib: 4,
        ..Config::default()
    };
    let listener = match tokio::net::TcpListener::bind("127.0.0.1:0").await {
        Ok(l) => l,
        Err(e) => panic!("bind: {e}"),
    };
    let addr = match listener.local_addr() {
        Ok(a) => a,
        Err(e) => panic!("addr: {e}"),
    };
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(worker_svc::run(listener, config, async {
        let _ = stopped.await;
    }));
    let mut client = match kvlease_proto::v1::worker_service_client::WorkerServiceClient::connect(
        format!("http://{addr}"),
    )
    .await
    {
        Ok(c) => c,
        Err(e) => panic!("connect: {e}"),
    };
    let described = match client.describe(kvlease_proto::v1::DescribeRequest {}).await {
        Ok(r) => r.into_inner(),
        Err(e) => panic!("describe: {e}"),
    };
    let model = described.model.unwrap_or_default();
    assert_eq!(
        model.name,
        format!("kvlease-worker-test-{}-served", std::process::id())
    );
    assert_eq!(
        (model.hidden_size, model.ffn_size, model.vocab_size),
        (16, 24, 30)
    );
    assert_eq!(described.weight_bytes, weights.bytes());
    let _ = stop.send(());
    match server.await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => panic!("server: {e}"),
        Err(e) => panic!("server task: {e}"),
    }
}
