//! `cargo bench -p worker-svc --features cuda --bench gpu`: paged decode
//! attention on the GPU against the copy bandwidth measured in the same run;
//! then issue 12's targets 1 and 2: decode steps of a CUDA worker against
//! the memory-bandwidth limit (bytes the step must read / copy bandwidth),
//! and prefill against the bf16 GEMM rate cuBLAS reaches, both limits
//! measured in the same run. Without a usable device it says
//! why and exits 0, unless `KVLEASE_REQUIRE_GPU=1` (then it fails).

use worker_svc::backend::CudaOptions;
use worker_svc::backend::cuda::AttentionTuning;
use worker_svc::backend::cuda::bench::{self, AttentionShape};
use worker_svc::gpu_bench;
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
    // The same shape over an fp8 (e4m3) arena: half the bytes, widened to
    // f16 in shared memory.
    let fp8_shape = AttentionShape {
        kv_dtype: worker_svc::backend::KvDtype::Fp8,
        ..shape
    };
    let f = bench::decode_attention(fp8_shape, 100).unwrap_or_else(|e| fail(e));
    println!(
        "| fp8 arena: time per call (attention + merge) | {:.1} us ({:.2}x bf16's) |",
        f.time_us,
        a.time_us / f.time_us
    );
    println!(
        "| fp8 arena: K+V bytes read, achieved | {:.1} MiB, {:.0} GB/s ({:.2} of copy) |",
        f.kv_bytes as f64 / (1u64 << 20) as f64,
        f.achieved_gbps,
        f.achieved_gbps / a.copy_gbps
    );
    println!(
        "| fp8 arena: max rel. error vs f64 host (same e4m3 values) | {:.1e} |",
        f.max_rel_err
    );

    // Launch variants of the same shape, `KVLEASE_ATTN_VARIANTS` (comma
    // separated: `general` or `WARPSxSTAGESxSPLIT_KEYS`; `none` for none).
    let variants = std::env::var("KVLEASE_ATTN_VARIANTS")
        .unwrap_or_else(|_| "general,4x3x512,4x3x1024".into());
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

    // The attention of the model bench below, at a decode step's shape and
    // at a prefill chunk's, by launch shape (`KVLEASE_MODEL_ATTN_VARIANTS`,
    // as above, plus `fN`: N A operands per warp for grouped rows).
    let step_shape = AttentionShape {
        context: 1024,
        head_dim: 64,
        ..shape
    };
    let chunk_shape = AttentionShape {
        batch: 2,
        context: 4096,
        head_dim: 64,
        query_rows: 4096,
        ..shape
    };
    let variants = std::env::var("KVLEASE_MODEL_ATTN_VARIANTS")
        .unwrap_or_else(|_| "4x3x512,4x3x1024,4x3x2048,f1".into());
    println!("attention at the model's shapes (head dim 64, 32/8 heads, bf16 KV):");
    println!(
        "| shape | variant | kernel | regs | local bytes | time per layer | figure | max rel. err |"
    );
    println!("|---|---|---|---:|---:|---:|---:|---:|");
    for (name, s, iters) in [
        ("decode, 64 x 1 row, context 1024", step_shape, 50),
        ("prefill, 2 x 4096 rows", chunk_shape, 5),
    ] {
        for v in variants
            .split(',')
            .map(str::trim)
            .filter(|v| !v.is_empty() && *v != "none")
        {
            let tuning = match v.strip_prefix('f').and_then(|n| n.parse().ok()) {
                Some(frags) => Some(AttentionTuning {
                    prefill_frags: frags,
                    ..AttentionTuning::default()
                }),
                None => parse_tuning(v),
            };
            let Some(tuning) = tuning else {
                eprintln!("variant {v}: not general, WxSxK or fN, skipped");
                continue;
            };
            match bench::attention(s, tuning, iters) {
                Ok(r) => {
                    let figure = if s.query_rows == 1 {
                        format!(
                            "{:.0} GB/s ({:.2} of copy)",
                            r.achieved_gbps,
                            r.achieved_gbps / r.copy_gbps
                        )
                    } else {
                        let pairs = (s.context * (s.context + 1) / 2 * s.batch) as f64;
                        let flops = 4.0 * pairs * (s.num_heads * s.head_dim) as f64;
                        format!("{:.0} TFLOP/s", flops / (r.time_us * 1e-6) / 1e12)
                    };
                    println!(
                        "| {name} | {v} | {} | {} | {} | {:.1} us | {figure} | {:.1e} |",
                        r.kernel, r.regs, r.local_bytes, r.time_us, r.max_rel_err
                    );
                }
                Err(e) => eprintln!("{name} {v}: {e}"),
            }
        }
    }

    // Decode steps against the byte limit and prefill against cuBLAS's
    // rate (issue 12's targets 1 and 2, issue 23's), each limit measured
    // here, for each model shape of `KVLEASE_BENCH_MODELS` (comma
    // separated; default all three). Decode steps run twice: from CUDA
    // graphs, and launched one by one (`decode_graphs` off).
    let copy_gbps = bench::device_copy_bandwidth(1 << 30, 20).unwrap_or_else(|e| fail(e));
    let (gm, gk, gn) = (8192, 8192, 8192);
    let gemm_tflops = bench::gemm_rate(gm, gk, gn, 20).unwrap_or_else(|e| fail(e));
    println!(
        "limits measured in this run: device-to-device copy {copy_gbps:.0} GB/s (read + write, 1 GiB); cuBLAS bf16 GEMM {gm}x{gk}x{gn} (f32 accumulation) {gemm_tflops:.0} TFLOP/s"
    );
    let names = std::env::var("KVLEASE_BENCH_MODELS")
        .unwrap_or_else(|_| "smollm2-135m,llama-1.1b,bench-1b".into());
    for name in names.split(',').map(str::trim).filter(|n| !n.is_empty()) {
        let Some(model) = bench_model(name) else {
            eprintln!("model {name}: not smollm2-135m, llama-1.1b or bench-1b, skipped");
            continue;
        };
        model_tables(&model, copy_gbps, gemm_tflops);
    }
}

/// The model shapes of the decode and prefill bench (seeded weights: the
/// speed does not depend on their values).
fn bench_model(name: &str) -> Option<ModelConfig> {
    let base = ModelConfig {
        name: name.into(),
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
        arch: Default::default(),
    };
    match name {
        "bench-1b" => Some(base),
        // SmolLM2-135M's shape.
        "smollm2-135m" => Some(ModelConfig {
            vocab_size: 49152,
            hidden_size: 576,
            num_heads: 9,
            num_kv_heads: 3,
            ffn_size: 1536,
            rope_theta: 100_000.0,
            layer_windows: vec![0; 30],
            tied_embeddings: true,
            ..base
        }),
        // The 1.1B Llama shape of issue 23 (TinyLlama's, SmolLM2's vocabulary).
        "llama-1.1b" => Some(ModelConfig {
            vocab_size: 49152,
            num_kv_heads: 4,
            layer_windows: vec![0; 22],
            ..base
        }),
        _ => None,
    }
}

/// Prefill and decode of one model, decode from graphs and eager.
fn model_tables(model: &ModelConfig, copy_gbps: f64, gemm_tflops: f64) {
    let (context, steps) = (1024, 50);
    let prefills = [(64, 1024), (8, 4096)];
    let batches = [64, 256];
    let default_streams = CudaOptions::default().gemm_streams;
    let graphed = gpu_bench::model_bench(
        model,
        &prefills,
        &batches,
        (context, steps),
        (true, default_streams),
    )
    .unwrap_or_else(|e| fail(e));
    let eager = gpu_bench::model_bench(
        model,
        &[],
        &batches,
        (context, steps),
        (false, default_streams),
    )
    .unwrap_or_else(|e| fail(e));
    // Prefill with the product tiles over other stream counts
    // (`KVLEASE_BENCH_GEMM_STREAMS`, comma separated; none by default).
    let streams: Vec<usize> = std::env::var("KVLEASE_BENCH_GEMM_STREAMS")
        .unwrap_or_default()
        .split(',')
        .filter_map(|n| n.trim().parse().ok())
        .collect();
    let mut prefill_rows: Vec<(usize, gpu_bench::PrefillFigures)> = graphed
        .prefills
        .iter()
        .map(|p| (default_streams, p.clone()))
        .collect();
    for n in streams {
        let r = gpu_bench::model_bench(model, &prefills, &[], (context, steps), (true, n))
            .unwrap_or_else(|e| fail(e));
        prefill_rows.extend(r.prefills.into_iter().map(|p| (n, p)));
    }
    println!(
        "model {}: {} layers, hidden {}, heads {}/{} kv x {}, ffn {}, vocab {}, {:.0} M params; bf16 weights and products (f32 accumulation, calls of a fixed row count), bf16 KV",
        model.name,
        model.num_layers(),
        model.hidden_size,
        model.num_heads,
        model.num_kv_heads,
        model.head_dim,
        model.ffn_size,
        model.vocab_size,
        model.num_params() as f64 / 1e6
    );
    println!(
        "decode step (Worker::forward_tokens, greedy tokens back), context {context}; graphs: {} captured, {} passes replayed; eager run: {} replayed",
        graphed.graphs.captures, graphed.graphs.replays, eager.graphs.replays
    );
    println!(
        "| model | batch | step, graphs | step, eager | bytes it must read | limit at copy bandwidth | limit / step (graphs) | limit / step (eager) |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|---:|");
    for (g, e) in graphed.decodes.iter().zip(&eager.decodes) {
        let limit_ms = g.bytes as f64 / (copy_gbps * 1e9) * 1e3;
        println!(
            "| {} | {} | {:.3} ms | {:.3} ms | {:.2} GB | {:.3} ms | {:.2} | {:.2} |",
            model.name,
            g.batch,
            g.step_ms,
            e.step_ms,
            g.bytes as f64 / 1e9,
            limit_ms,
            limit_ms / g.step_ms,
            limit_ms / e.step_ms
        );
    }
    println!(
        "prefill (Worker::forward_tokens, {} tokens per forward)",
        gpu_bench::PREFILL_BATCH_TOKENS
    );
    println!("| model | prefill | product streams | time | TFLOP | TFLOP/s | / cuBLAS bf16 rate |");
    println!("|---|---|---:|---:|---:|---:|---:|");
    for (streams, p) in &prefill_rows {
        let rate = p.flops / p.seconds / 1e12;
        println!(
            "| {} | {} x {} | {streams} | {:.3} s | {:.1} | {:.0} | {:.2} |",
            model.name,
            p.seqs,
            p.tokens,
            p.seconds,
            p.flops / 1e12,
            rate,
            rate / gemm_tflops
        );
    }
    println!("profile of one eager forward (device time by phase, ms; host wall by stage, ms):");
    println!(
        "| model | forward | device | matmul | attention | other | host: validate | upload | launch | wait + tokens back | outputs |"
    );
    println!("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    let rows = graphed
        .decodes
        .iter()
        .map(|d| (format!("decode step, batch {}", d.batch), d.phases))
        .chain(graphed.prefills.iter().map(|p| {
            let len = p.tokens.min(gpu_bench::PREFILL_BATCH_TOKENS);
            let per_forward = (gpu_bench::PREFILL_BATCH_TOKENS / len).clamp(1, p.seqs);
            (format!("prefill, {per_forward} x {len}"), p.phases)
        }));
    for (what, p) in rows {
        let h = p.host;
        let total = p.matmul_ms + p.attention_ms + p.other_ms;
        println!(
            "| {} | {what} | {total:.3} | {:.3} | {:.3} | {:.3} | {:.3} | {:.3} | {:.3} | {:.3} | {:.3} |",
            model.name,
            p.matmul_ms,
            p.attention_ms,
            p.other_ms,
            h.validate_ms,
            h.upload_ms,
            h.launch_ms,
            h.download_ms,
            h.outputs_ms
        );
    }
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
            prefill_frags: AttentionTuning::default().prefill_frags,
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
