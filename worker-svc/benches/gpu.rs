//! `cargo bench -p worker-svc --features cuda --bench gpu`: paged decode
//! attention on the GPU against the copy bandwidth measured in the same run,
//! and whole decode steps of a CUDA worker. Without a usable device it says
//! why and exits 0, unless `KVLEASE_REQUIRE_GPU=1` (then it fails).

use worker_svc::backend::KvDtype;
use worker_svc::backend::cuda::AttentionTuning;
use worker_svc::backend::cuda::bench::{self, AttentionShape};
use worker_svc::model::{ModelConfig, RopeScaling};

fn main() {
    if let Err(reason) = worker_svc::backend::cuda::probe() {
        if std::env::var("KVLEASE_REQUIRE_GPU").is_ok_and(|v| v == "1") {
            eprintln!("gpu bench: no usable GPU ({reason}) and KVLEASE_REQUIRE_GPU=1");
            std::process::exit(1);
        }
        println!("gpu bench skipped: {reason}");
        return;
    }
    let shape = AttentionShape::decode_bench();
    let a = bench::decode_attention(shape, 100).unwrap_or_else(|e| fail(e));
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
    println!(
        "kernel: {} ({} registers, {} bytes local)",
        a.kernel, a.regs, a.local_bytes
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
        "| attention kernel alone (no merge) | {:.1} us ({:.0} GB/s) |",
        a.kernel_us,
        a.kv_bytes as f64 / (a.kernel_us * 1e-6) / 1e9
    );
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

    // Launch variants of the same shape, `KVLEASE_ATTN_VARIANTS` (comma
    // separated: `general` or `WARPSxSTAGESxSPLIT_KEYS`; `none` for none).
    let variants = std::env::var("KVLEASE_ATTN_VARIANTS")
        .unwrap_or_else(|_| "general,4x2x512,4x3x256,4x3x1024,4x3x2048,8x3x1024".into());
    let mut rows = Vec::new();
    for v in variants
        .split(',')
        .map(str::trim)
        .filter(|v| !v.is_empty() && *v != "none")
    {
        let Some(tuning) = parse_tuning(v) else {
            eprintln!("variant {v}: not general or WxSxK, skipped");
            continue;
        };
        match bench::attention(shape, tuning, 100) {
            Ok(r) => rows.push((v.to_string(), r)),
            Err(e) => eprintln!("variant {v}: {e}"),
        }
    }
    if !rows.is_empty() {
        println!("variants of the same decode attention (each with its own copy figure):");
        println!(
            "| variant | kernel | regs | splits | time | kernel alone | GB/s | / copy | max rel. err |"
        );
        println!("|---|---|---:|---:|---:|---:|---:|---:|---:|");
        for (v, r) in rows {
            println!(
                "| {v} | {} | {} | {} | {:.1} us | {:.1} us | {:.0} | {:.2} | {:.1e} |",
                r.kernel,
                r.regs,
                r.num_splits,
                r.time_us,
                r.kernel_us,
                r.achieved_gbps,
                r.achieved_gbps / r.copy_gbps,
                r.max_rel_err
            );
        }
    }

    let model = ModelConfig {
        name: "bench-1b".into(),
        vocab_size: 32000,
        hidden_size: 2048,
        num_heads: 32,
        num_kv_heads: 8,
        head_dim: 64,
        ffn_size: 5632,
        rope_theta: 10_000.0,
        rope_scaling: RopeScaling::None,
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
    let h = p.host;
    println!(
        "| host wall of that step | validate {:.2} ms, metadata + uploads {:.2} ms, launches {:.2} ms, wait + logits download {:.2} ms, sampling + outputs {:.2} ms |",
        h.validate_ms, h.upload_ms, h.launch_ms, h.download_ms, h.outputs_ms
    );
    println!(
        "| prefill of {batch} x {context} tokens | {:.1} s |",
        r.prefill_s
    );
}

/// `general` (the one-warp kernel) or `WxSxK`: tensor cores with W warps
/// per CTA, S stages, splits of K keys.
fn parse_tuning(v: &str) -> Option<AttentionTuning> {
    if v == "general" {
        return Some(AttentionTuning {
            tensor_cores: false,
            ..AttentionTuning::default()
        });
    }
    let n: Vec<usize> = v
        .split('x')
        .map(|x| x.parse().ok())
        .collect::<Option<_>>()?;
    match n[..] {
        [warps, stages, split_keys] => Some(AttentionTuning {
            tensor_cores: true,
            warps,
            stages,
            split_keys,
        }),
        _ => None,
    }
}

fn fail(e: impl std::fmt::Display) -> ! {
    eprintln!("gpu bench failed: {e}");
    std::process::exit(1);
}
