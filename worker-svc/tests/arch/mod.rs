//! The architecture fixtures (`tests/data/arch/<name>/`, written by
//! `scripts/make_arch_fixtures.py`): a tiny random-weight Hugging Face
//! checkpoint per architecture and what transformers (float32, CPU)
//! computed with it. Shared by `architectures.rs` (the CPU backend) and
//! `cuda.rs` (the GPU).
//!
//! Per fixture: greedy (all prompts in one batch: a prefill, then one decode
//! step per token over the paged KV cache, as the scheduler runs it), and
//! teacher-forced (one Forward over prompt + reference continuation with
//! logits at every position, compared at the reference's top-8 ids, and the
//! whole row after the prompt). The tables, inputs and greedy loop are
//! `model_files`' (SmolLM2's), on every pool of the model.

#![allow(dead_code, unreachable_pub)]

use std::path::{Path, PathBuf};

use serde::Deserialize;
use worker_svc::model::load::{self, LoadedModel, ServingShape};
use worker_svc::model::weights::Weights;
use worker_svc::reference::{self, DenseModel};
use worker_svc::worker::Worker;

use crate::model_files::{Prompt, Report, greedy, input, tables};

/// Every fixture, in the order of the acceptance list.
pub const NAMES: [&str; 7] = [
    "llama3", "qwen2", "qwen3", "mistral", "gemma2", "gemma3", "phi3",
];

/// A reference top-1 and another token whose logits differ by less than
/// this share of the row's largest |logit| are a near-tie (see
/// [`Report::top1_near`]): 1e-2, about what bf16 activations move a logit
/// of these fixtures by.
pub const NEAR_TIE: f32 = 1e-2;

/// Tokens per block the fixtures are served with: small, so the 8-token
/// windows of the Mistral and Gemma fixtures slide blocks out.
pub const TOKENS_PER_BLOCK: u32 = 4;

/// Fixture `name`'s directory: `$KVLEASE_ARCH_FIXTURES/<name>` when set,
/// else under this crate's source (where the test was built), else under
/// `worker-svc/tests/data/arch` of the working directory: a test binary
/// carried to a GPU machine runs from the repository root there
/// (`scripts/gpu_bench.sh run`).
pub fn dir(name: &str) -> PathBuf {
    let root = match std::env::var_os("KVLEASE_ARCH_FIXTURES") {
        Some(root) => PathBuf::from(root),
        None => {
            let built = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/arch");
            if built.is_dir() {
                built
            } else {
                PathBuf::from("worker-svc/tests/data/arch")
            }
        }
    };
    root.join(name)
}

#[derive(Debug, Deserialize)]
pub struct Reference {
    pub architecture: String,
    pub transformers: String,
    pub new_tokens: usize,
    pub prompts: Vec<Prompt>,
}

pub fn reference(name: &str) -> Reference {
    let path = dir(name).join("reference.json");
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

pub fn load(name: &str) -> LoadedModel {
    open(&dir(name))
}

/// The GGUF file llama.cpp's `convert_hf_to_gguf.py` made of fixture
/// `name` (bf16, so the same weights): `tests/data/arch/gguf/`.
pub fn load_gguf(name: &str) -> LoadedModel {
    open(&dir("gguf").join(format!("{name}-bf16.gguf")))
}

fn open(path: &Path) -> LoadedModel {
    let serving = ServingShape {
        max_context: 256,
        tokens_per_block: TOKENS_PER_BLOCK,
    };
    load::open(path, serving).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Runs every prompt of `reference` on `worker`.
pub fn compare(worker: &mut Worker, reference: &Reference) -> Report {
    let mut report = Report::default();
    let vocab = worker.info().model.vocab_size;
    let prompts: Vec<&[u32]> = reference.prompts.iter().map(|p| p.ids.as_slice()).collect();
    let ours = greedy(worker, &prompts, reference.new_tokens);
    for (p, ours) in reference.prompts.iter().zip(ours) {
        let matched = ours
            .iter()
            .zip(&p.greedy)
            .take_while(|(a, b)| a == b)
            .count();
        report.greedy_match.push((p.name.clone(), matched));

        let tokens: Vec<u32> = p.ids.iter().chain(&p.greedy).copied().collect();
        let tables = tables(worker, 0, tokens.len());
        let out = worker
            .forward(vec![input(1_000, &tokens, 0, tables, true)])
            .unwrap_or_else(|e| panic!("{}: teacher-forced forward: {e}", p.name));
        let logits = out.logits(0);
        assert_eq!(
            logits.len(),
            tokens.len() * vocab,
            "{}: logits of every position",
            p.name
        );
        for (pos, row) in logits.chunks_exact(vocab).enumerate() {
            let ids = &p.top_ids[pos];
            let want = &p.top_logits[pos];
            let got: Vec<f32> = ids.iter().map(|&i| row[i as usize]).collect();
            report.max_rel_err =
                reference::nan_max(report.max_rel_err, reference::relative_error(&got, want));
            report.positions += 1;
            let ours = worker_svc::ops::argmax(row);
            if ours == ids[0] as usize {
                report.top1_agree += 1;
            }
            // Ours is the reference's top-1, or one of its top 8 whose
            // reference logit is within NEAR_TIE of the top-1's (relative
            // to the row's scale): a tie closer than a 16-bit pass resolves.
            let scale = want.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            let near = ids
                .iter()
                .position(|&i| i as usize == ours)
                .is_some_and(|k| want[0] - want[k] <= NEAR_TIE * scale);
            if near {
                report.top1_near += 1;
            }
        }
        let last = &logits[(p.ids.len() - 1) * vocab..p.ids.len() * vocab];
        report.max_rel_err = reference::nan_max(
            report.max_rel_err,
            reference::relative_error(last, &p.last_logits),
        );
        println!(
            "  {:8} {:3} prompt tokens: {matched:2}/{} greedy tokens equal",
            p.name,
            p.ids.len(),
            p.greedy.len()
        );
    }
    println!(
        "  max relative logit error {:.2e}, teacher-forced top-1 agreement {}/{} \
         ({} counting near-ties)",
        report.max_rel_err, report.top1_agree, report.positions, report.top1_near
    );
    report
}

/// The first prompt of the fixture with its greedy continuation, run paged
/// (prefill chunks of 13 and 7 tokens, then one token at a time, on
/// reversed block tables) against the dense reference: the largest relative
/// error over every position's logits.
pub fn paged_vs_dense(worker: &mut Worker, weights: &Weights, prompt: &Prompt) -> f32 {
    let tokens: Vec<u32> = prompt.ids.iter().chain(&prompt.greedy).copied().collect();
    let mut tables = tables(worker, 0, tokens.len());
    for t in &mut tables {
        t.block_ids.reverse();
    }
    let dense = DenseModel::new(weights);
    let mut seq = dense.sequence();
    let expected = dense.forward(&mut seq, &tokens);
    let mut got: Vec<f32> = Vec::new();
    let mut start = 0;
    let mut chunks = vec![13, 7];
    chunks.resize(chunks.len() + tokens.len() - 20, 1);
    for chunk in chunks {
        let run = &tokens[start..start + chunk];
        let out = worker
            .forward(vec![input(7, run, start, tables.clone(), true)])
            .unwrap_or_else(|e| panic!("forward at {start}: {e}"));
        got.extend_from_slice(out.logits(0));
        start += chunk;
    }
    reference::relative_error(&got, &expected.concat())
}

/// The logits after a 24-token prefix and 6 more tokens, computed twice:
/// once from scratch, once with the prefix's blocks written by another
/// sequence in an earlier pass and reused (the new sequence starts at
/// position 24, a block boundary). Returns both, which must be
/// bit-identical.
pub fn reused_prefix(worker: &mut Worker, prompt: &Prompt) -> (Vec<f32>, Vec<f32>) {
    let tokens: Vec<u32> = prompt.ids.iter().chain(&prompt.greedy).copied().collect();
    let (prefix, rest) = tokens[..30].split_at(24);
    let b = worker.info().model.tokens_per_block as usize;
    assert_eq!(24 % b, 0, "the prefix ends on a block boundary");
    // Sequence 1: everything in one pass, blocks 0...
    let fresh = tables(worker, 0, 30);
    let out = worker
        .forward(vec![input(1, &tokens[..30], 0, fresh, true)])
        .unwrap_or_else(|e| panic!("fresh: {e}"));
    let vocab = out.vocab();
    let recomputed = out.logits(0)[24 * vocab..].to_vec();
    // Sequence 2 writes the prefix into blocks 100...; sequence 3 reuses
    // them and adds its own blocks after, in a batch with another sequence.
    let writer = tables(worker, 100, 24);
    worker
        .forward(vec![input(2, prefix, 0, writer, false)])
        .unwrap_or_else(|e| panic!("prefix writer: {e}"));
    let mut reuse = tables(worker, 100, 24);
    for t in &mut reuse {
        t.block_ids.extend(200..208);
    }
    let other = tables(worker, 300, 12);
    let out = worker
        .forward(vec![
            input(4, &tokens[..12], 0, other, true),
            input(3, rest, 24, reuse, true),
        ])
        .unwrap_or_else(|e| panic!("reuse: {e}"));
    (recomputed, out.logits(1).to_vec())
}

/// Paged == dense within `tolerance` on the first prompt, and a reused
/// prefix bit-identical to recomputing it on the third; panics naming
/// `name` otherwise.
pub fn check_paged_and_reuse(
    worker: &mut Worker,
    weights: &Weights,
    reference: &Reference,
    name: &str,
    tolerance: f32,
) {
    let err = paged_vs_dense(worker, weights, &reference.prompts[0]);
    println!("  paged vs dense {err:.2e}");
    assert!(err <= tolerance, "{name}: paged vs dense {err}");
    let (recomputed, reused) = reused_prefix(worker, &reference.prompts[2]);
    assert!(
        recomputed
            .iter()
            .zip(&reused)
            .all(|(a, b)| a.to_bits() == b.to_bits()),
        "{name}: a reused prefix gives other logits than recomputing it"
    );
}
