//! The scheduler's own time per step (planning, applying lease outcomes and
//! forward results, releases, outputs: everything but the forward pass and
//! the RPC waits) for 256 running decode sequences, next to a real CPU
//! forward step of the default worker model over the same 256 sequences,
//! and the share the scheduler adds.
//!
//! `cargo bench -p kvlease-integration-tests --bench scheduler_share`
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed unwrap fails the bench

use std::hint::black_box;
use std::time::{Duration, Instant};

use kvlease_integration_tests::{start_worker, worker_client};
use kvlease_proto::v1 as pb;
use scheduler_svc::domain::{
    ForwardResult, Grant, GroupGeometry, Outcome, PoolGeometry, RequestId, SeqId, Table,
};
use scheduler_svc::queue::Request;
use scheduler_svc::step::{Core, CoreConfig};

const SEQS: u32 = 256;
const PROMPT: u32 = 64;
const BLOCKS: u32 = 5; // 80 slots: the prompt and 10 decode steps fit
const DECODE_STEPS: u32 = 10;
const TPB: u32 = 16;

fn tables(seq: u32) -> Vec<Table> {
    let ids: Vec<u32> = (seq * BLOCKS..(seq + 1) * BLOCKS).collect();
    vec![
        Table {
            pool_id: 1,
            window: 0,
            first_block: 0,
            block_ids: ids.clone(),
        },
        Table {
            pool_id: 2,
            window: 64,
            first_block: 0,
            block_ids: ids,
        },
    ]
}

fn prompt(seq: u32) -> Vec<u32> {
    (0..PROMPT).map(|p| (p % 37 + seq) % 250 + 1).collect()
}

fn pb_tables(seq: u32) -> Vec<pb::BlockTable> {
    tables(seq)
        .into_iter()
        .map(|t| pb::BlockTable {
            pool_id: t.pool_id,
            window: t.window,
            beam: 0,
            first_block: 0,
            block_ids: t.block_ids,
        })
        .collect()
}

/// Mean wall time of a decode forward step of `SEQS` sequences on the
/// default CPU worker model (gRPC on loopback included), and the worker's
/// own compute time.
async fn forward_step() -> (Duration, Duration) {
    let config = worker_svc::Config {
        memory_budget_mib: 512,
        max_batch_sequences: SEQS as usize,
        max_batch_tokens: 4096,
        ..worker_svc::Config::default()
    };
    let worker = start_worker(config).await.expect("worker");
    let mut w = worker_client(worker.addr).await.expect("client");
    let d = w
        .describe(pb::DescribeRequest {})
        .await
        .expect("describe")
        .into_inner();
    assert!(
        d.pools.iter().all(|p| p.num_blocks >= SEQS * BLOCKS),
        "{:?}",
        d.pools
    );
    assert_eq!(d.tokens_per_block, TPB);
    // prefill every sequence, 4096 tokens per call
    let per_call = 4096 / PROMPT;
    for first in (0..SEQS).step_by(per_call as usize) {
        let sequences = (first..(first + per_call).min(SEQS))
            .map(|s| pb::ForwardSequence {
                seq_id: u64::from(s),
                tokens: prompt(s),
                start_pos: 0,
                tables: pb_tables(s),
                ..Default::default()
            })
            .collect();
        w.forward(pb::ForwardRequest {
            after_step: 0,
            tier_copies: Vec::new(),
            step: 1,
            sequences,
        })
        .await
        .expect("prefill");
    }
    let mut wall = Duration::ZERO;
    let mut compute = Duration::ZERO;
    for i in 0..DECODE_STEPS {
        let sequences = (0..SEQS)
            .map(|s| pb::ForwardSequence {
                seq_id: u64::from(s),
                tokens: vec![5],
                start_pos: PROMPT + i,
                tables: pb_tables(s),
                ..Default::default()
            })
            .collect();
        let start = Instant::now();
        let r = w
            .forward(pb::ForwardRequest {
                after_step: 0,
                tier_copies: Vec::new(),
                step: 2 + u64::from(i),
                sequences,
            })
            .await
            .expect("decode");
        wall += start.elapsed();
        compute += Duration::from_micros(r.into_inner().compute_us);
    }
    let _ = worker.stop().await;
    (wall / DECODE_STEPS, compute / DECODE_STEPS)
}

fn group() -> GroupGeometry {
    GroupGeometry {
        name: "bench".into(),
        tokens_per_block: TPB,
        pools: vec![
            PoolGeometry {
                host_blocks: 0,
                pool_id: 1,
                window: 0,
                num_blocks: 1_000_000,
            },
            PoolGeometry {
                host_blocks: 0,
                pool_id: 2,
                window: 64,
                num_blocks: 1_000_000,
            },
        ],
        max_context: 1 << 20,
        vocab_size: 258,
        max_batch_sequences: 1024,
        max_batch_tokens: 1 << 20,
        peer: Default::default(),
        role: Default::default(),
    }
}

/// An Extend grant is a delta; within the 5 leased blocks a decode step
/// takes no new block.
fn extend_grant(seq_id: SeqId) -> Outcome {
    let tables = vec![
        Table {
            pool_id: 1,
            window: 0,
            first_block: 0,
            block_ids: Vec::new(),
        },
        Table {
            pool_id: 2,
            window: 64,
            first_block: 0,
            block_ids: Vec::new(),
        },
    ];
    Outcome::Grant(Grant {
        tier_copies: Vec::new(),
        retained_tokens: 0,
        seq_id,
        tables,
        reused_tokens: 0,
        capacity_tokens: 0,
        copies: Vec::new(),
        peer_copies: Vec::new(),
        peer_blocks: 0,
    })
}

fn grant(seq_id: SeqId) -> Outcome {
    Outcome::Grant(Grant {
        tier_copies: Vec::new(),
        retained_tokens: 0,
        seq_id,
        tables: tables(seq_id.get() as u32),
        reused_tokens: 0,
        capacity_tokens: 0,
        copies: Vec::new(),
        peer_copies: Vec::new(),
        peer_blocks: 0,
    })
}

/// Mean scheduler-core time per decode step for `SEQS` running sequences,
/// with the scripted answers' construction left out.
fn scheduler_step(draft_k: u32) -> Duration {
    let config = CoreConfig {
        max_seqs: SEQS,
        max_tokens_per_step: SEQS * PROMPT,
        prefill_chunk: PROMPT,
        draft_k,
        ..CoreConfig::default()
    };
    let mut core = Core::new(config, vec![group()]);
    for s in 0..SEQS {
        core.submit(Request::new(
            RequestId(u64::from(s) + 1),
            prompt(s),
            1_000_000,
        ));
    }
    core.begin_step();
    let leases = core.plan_admission();
    core.apply_leases(leases.iter().map(|l| grant(l.seq_id)).collect());
    for (g, items) in core.plan_forward() {
        core.apply_forward(
            g,
            items
                .iter()
                .map(|i| ForwardResult {
                    seq_id: i.seq_id,
                    next_token: 5,
                    argmax: vec![],
                    logprobs: Vec::new(),
                    error: None,
                })
                .collect::<Vec<_>>(),
        );
    }
    core.drain_outputs();
    let steps = 200;
    let mut own = Duration::ZERO;
    for _ in 0..steps {
        let mut scripting = Duration::ZERO;
        let start = Instant::now();
        core.begin_step();
        let extends = core.plan_extends(false);
        let t = Instant::now();
        let outcomes: Vec<Outcome> = extends.iter().map(|e| extend_grant(e.seq_id)).collect();
        scripting += t.elapsed();
        core.apply_extends(core.step(), outcomes);
        black_box(core.plan_admission());
        for (g, items) in core.plan_forward() {
            let t = Instant::now();
            let results: Vec<ForwardResult> = items
                .iter()
                .map(|i| {
                    let mut argmax = i.tokens[1..].to_vec();
                    argmax.push(7);
                    ForwardResult {
                        seq_id: i.seq_id,
                        next_token: 7,
                        argmax,
                        logprobs: Vec::new(),
                        error: None,
                    }
                })
                .collect();
            scripting += t.elapsed();
            core.apply_forward(g, results);
        }
        black_box(core.take_releases());
        black_box(core.drain_outputs());
        own += start.elapsed().saturating_sub(scripting);
    }
    own / steps
}

fn main() {
    let runtime = tokio::runtime::Runtime::new().expect("runtime");
    let (forward_wall, forward_compute) = runtime.block_on(forward_step());
    println!("{SEQS} running decode sequences; CPU forward step of the default worker model:");
    println!(
        "  forward (gRPC wall) {:>10.1} us   worker compute {:>10.1} us",
        us(forward_wall),
        us(forward_compute)
    );
    println!(
        "{:<22} {:>12} {:>18} {:>18}",
        "scheduler mode", "own us/step", "% of compute", "% of forward wall"
    );
    for (name, k) in [("greedy", 0), ("prompt-lookup k=4", 4)] {
        let own = scheduler_step(k);
        let of_compute = 100.0 * own.as_secs_f64() / forward_compute.as_secs_f64();
        let of_wall = 100.0 * own.as_secs_f64() / forward_wall.as_secs_f64();
        println!(
            "{name:<22} {:>12.1} {of_compute:>17.2}% {of_wall:>17.2}%",
            us(own)
        );
    }
}

fn us(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}
