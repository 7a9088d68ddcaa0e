//! `cargo bench -p worker-svc --features cuda --bench host_tier`: the CUDA
//! worker's host tier in pinned memory. For a prompt whose prefix was
//! demoted to the host, onboarding it back and computing the rest against
//! recomputing the whole prompt, on two model shapes (SmolLM2-135M, which
//! kvlease serves, and a 1B Llama); the copies' rates against the pinned
//! link rates measured in the same run. Without a usable device it says why
//! and exits 0, unless `KVLEASE_REQUIRE_GPU=1` (then it fails).

use worker_svc::backend::cuda::bench;
use worker_svc::gpu_bench;
use worker_svc::model::{ModelConfig, RopeScaling};

fn main() {
    if let Err(reason) = worker_svc::backend::cuda::probe() {
        if std::env::var("KVLEASE_REQUIRE_GPU").is_ok_and(|v| v == "1") {
            eprintln!("host tier bench: no usable GPU ({reason}) and KVLEASE_REQUIRE_GPU=1");
            std::process::exit(1);
        }
        println!("host tier bench skipped: {reason}");
        return;
    }
    let (htod, dtoh, pageable) = bench::host_link_rates(256 << 20, 10).unwrap_or_else(|e| fail(e));
    println!(
        "link rates measured in this run (256 MiB, best of 10): pinned host to device {htod:.1} GB/s, device to host {dtoh:.1} GB/s; pageable host to device {pageable:.1} GB/s"
    );
    let shape = |name: &str, layers, hidden, heads, kv_heads, ffn, vocab| ModelConfig {
        name: name.into(),
        vocab_size: vocab,
        hidden_size: hidden,
        num_heads: heads,
        num_kv_heads: kv_heads,
        head_dim: 64,
        ffn_size: ffn,
        rope_theta: 10_000.0,
        rope_scaling: RopeScaling::None,
        rms_norm_eps: 1e-5,
        layer_windows: vec![0; layers],
        max_context: 8192,
        tokens_per_block: 16,
        tied_embeddings: false,
        arch: Default::default(),
    };
    let models = [
        shape("smollm2-135m", 30, 576, 9, 3, 1536, 49152),
        shape("llama-1b", 16, 2048, 32, 8, 5632, 32000),
    ];
    println!(
        "| model | prompt | prefix blocks | bytes each way | demote | GB/s | onboard | GB/s | / pinned link | onboard + rest of prompt | recompute whole prompt | recompute / onboard | same next token |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|");
    for model in &models {
        let figures =
            gpu_bench::host_tier_bench(model, &[1024, 4096, 8192], 5).unwrap_or_else(|e| fail(e));
        for f in figures {
            let gbps = |ms: f64| f.bytes as f64 / (ms * 1e-3) / 1e9;
            println!(
                "| {} | {} | {} | {:.1} MB | {:.2} ms | {:.1} | {:.2} ms | {:.1} | {:.2} | {:.2} ms | {:.2} ms | {:.2} | {} |",
                model.name,
                f.prompt_tokens,
                f.blocks,
                f.bytes as f64 / 1e6,
                f.demote_ms,
                gbps(f.demote_ms),
                f.onboard_ms,
                gbps(f.onboard_ms),
                gbps(f.onboard_ms) / htod,
                f.onboard_then_rest_ms,
                f.recompute_ms,
                f.recompute_ms / f.onboard_then_rest_ms,
                if f.same_token { "yes" } else { "NO" }
            );
        }
    }
}

fn fail(e: impl std::fmt::Display) -> ! {
    eprintln!("host tier bench failed: {e}");
    std::process::exit(1);
}
