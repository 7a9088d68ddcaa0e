//! `cargo bench -p worker-svc --features cuda --bench gpu`: paged decode
//! attention on the GPU against the copy bandwidth measured in the same run,
//! and whole decode steps of a CUDA worker. Without a usable device it says
//! why and exits 0, unless `KVLEASE_REQUIRE_GPU=1` (then it fails).

use worker_svc::backend::KvDtype;
use worker_svc::backend::cuda::bench::{self, AttentionShape};
use worker_svc::model::ModelConfig;

fn main() {
    if let Err(reason) = worker_svc::backend::cuda::probe() {
        if std::env::var("KVLEASE_REQUIRE_GPU").is_ok_and(|v| v == "1") {
            eprintln!("gpu bench: no usable GPU ({reason}) and KVLEASE_REQUIRE_GPU=1");
            std::process::exit(1);
        }
        println!("gpu bench skipped: {reason}");
        return;
    }
    let shape = AttentionShape {
        batch: 64,
        context: 4096,
        num_heads: 32,
        num_kv_heads: 8,
        head_dim: 128,
        tokens_per_block: 16,
        kv_dtype: KvDtype::Bf16,
    };
    let a = bench::decode_attention(shape, 50).unwrap_or_else(|e| fail(e));
    println!("device: {}", a.device);
    println!(
        "paged decode attention: batch {} context {} heads {}/{} kv, head dim {}, {} tokens/block, bf16, blocks shuffled",
        shape.batch,
        shape.context,
        shape.num_heads,
        shape.num_kv_heads,
        shape.head_dim,
        shape.tokens_per_block
    );
    println!("| figure | value |");
    println!("|---|---:|");
    println!(
        "| time per call (attention + merge) | {:.1} us |",
        a.time_us
    );
    println!(
        "| K+V bytes read | {:.1} MiB |",
        a.kv_bytes as f64 / (1u64 << 20) as f64
    );
    println!("| achieved | {:.0} GB/s |", a.achieved_gbps);
    println!(
        "| device-to-device copy (read+write, 1 GiB) | {:.0} GB/s |",
        a.copy_gbps
    );
    println!("| achieved / copy | {:.2} |", a.achieved_gbps / a.copy_gbps);
    println!("| key splits per row | {} |", a.num_splits);
    println!(
        "| max rel. error vs f64 host (2 seqs, all heads) | {:.1e} |",
        a.max_rel_err
    );

    let model = ModelConfig {
        name: "bench-1b".into(),
        vocab_size: 32000,
        hidden_size: 2048,
        num_heads: 32,
        num_kv_heads: 8,
        head_dim: 64,
        ffn_size: 5632,
        rope_theta: 10_000.0,
        rms_norm_eps: 1e-5,
        layer_windows: vec![0; 16],
        max_context: 4096,
        tokens_per_block: 16,
        tied_embeddings: false,
    };
    let (batch, context, steps) = (64, 1024, 50);
    let r = bench::decode_step(model.clone(), batch, context, steps, KvDtype::Bf16)
        .unwrap_or_else(|e| fail(e));
    let p = r.phases;
    let total = p.matmul_ms + p.attention_ms + p.other_ms;
    println!(
        "decode step: {} layers, hidden {}, heads {}/{} kv x {}, ffn {}, vocab {}, {:.0} M params (f32 weights, bf16 KV), batch {batch}, context {context}",
        model.num_layers(),
        model.hidden_size,
        model.num_heads,
        model.num_kv_heads,
        model.head_dim,
        model.ffn_size,
        model.vocab_size,
        model.num_params() as f64 / 1e6
    );
    println!("| figure | value |");
    println!("|---|---:|");
    println!("| step (Worker::forward, wall) | {:.2} ms |", r.step_ms);
    println!("| tokens/s | {:.0} |", r.tokens_per_s);
    println!(
        "| device time of a profiled step | {total:.2} ms: matmul {:.0}%, attention {:.0}%, other {:.0}% |",
        100.0 * p.matmul_ms / total,
        100.0 * p.attention_ms / total,
        100.0 * p.other_ms / total
    );
    println!(
        "| prefill of {batch} x {context} tokens | {:.1} s |",
        r.prefill_s
    );
}

fn fail(e: impl std::fmt::Display) -> ! {
    eprintln!("gpu bench failed: {e}");
    std::process::exit(1);
}
