//! `cargo bench -p kvlease-proto --bench codec`: what the 32-bit check of
//! [`kvlease_proto::codec`] adds to decoding the hot path's messages: a
//! Forward request of a 256-sequence decode step (two pools, 18 + 64 and
//! 512 + 64 tokens of context, 16-token blocks) and its response. One row per
//! message: its size, prost's decode alone, the check alone, and the check's
//! share of check + decode (microseconds, best of repeated runs).

use std::time::{Duration, Instant};

use kvlease_proto::codec::check;
use kvlease_proto::v1 as pb;
use prost::{Message, Name};

fn main() {
    println!(
        "| message | bytes | decode, us | check, us | check / (check + decode) |\n|---|---:|---:|---:|---:|"
    );
    for context in [82_u32, 576] {
        row(
            &format!("ForwardRequest, 256 x {context} context"),
            &forward_request(256, context),
        );
    }
    row("ForwardResponse, 256 results", &forward_response(256));
}

fn forward_request(seqs: u64, context: u32) -> pb::ForwardRequest {
    let per_seq = context.div_ceil(16) + 1;
    let sequences = (0..seqs)
        .map(|s| {
            let first = s as u32 * per_seq;
            let table = |pool_id, window| pb::BlockTable {
                pool_id,
                window,
                block_ids: (first..first + per_seq).collect(),
                ..Default::default()
            };
            pb::ForwardSequence {
                seq_id: 1_000 + s,
                tokens: vec![12_345],
                start_pos: context,
                tables: vec![table(0, 0), table(1, 4096)],
                sampling: Some(pb::SamplingParams {
                    temperature: 0.7,
                    top_p: 0.9,
                    seed: s,
                    ..Default::default()
                }),
                ..Default::default()
            }
        })
        .collect();
    pb::ForwardRequest {
        after_step: 0,
        step: 123_456,
        sequences,
        tier_copies: Vec::new(),
    }
}

fn forward_response(seqs: u64) -> pb::ForwardResponse {
    pb::ForwardResponse {
        results: (0..seqs)
            .map(|s| pb::ForwardResult {
                seq_id: 1_000 + s,
                next_token: 4_321,
                ..Default::default()
            })
            .collect(),
        compute_us: 2_500,
    }
}

fn row<M: Message + Name + Default>(name: &str, message: &M) {
    let wire = message.encode_to_vec();
    let decode = best(|| {
        let m = M::decode(wire.as_slice()).unwrap_or_else(|e| panic!("{e}"));
        std::hint::black_box(m);
    });
    let checked = best(|| {
        check::<M>(std::hint::black_box(&wire)).unwrap_or_else(|e| panic!("{e}"));
    });
    println!(
        "| {name} | {} | {:.1} | {:.1} | {:.2} |",
        wire.len(),
        micros(decode),
        micros(checked),
        checked.as_secs_f64() / (checked + decode).as_secs_f64()
    );
}

/// The fastest of 20 rounds of 50 calls, per call.
fn best(mut f: impl FnMut()) -> Duration {
    (0..20)
        .map(|_| {
            let t = Instant::now();
            for _ in 0..50 {
                f();
            }
            t.elapsed() / 50
        })
        .min()
        .unwrap_or_default()
}

fn micros(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}
