//! The scheduler's own time per step: everything but the forward pass and
//! the RPC waits (planning, applying lease outcomes and forward results,
//! releases, outputs), for 256 running decode sequences.
//!
//! `cargo bench -p scheduler-svc`. The share of a CPU forward step is
//! printed by `cargo bench -p kvlease-integration-tests --bench scheduler_share`,
//! which runs the real CPU worker (this crate may not depend on it).

use std::hint::black_box;
use std::time::{Duration, Instant};

use scheduler_svc::domain::{
    ForwardResult, Grant, GroupGeometry, Outcome, PoolGeometry, RequestId, SeqId, Table,
};
use scheduler_svc::queue::Request;
use scheduler_svc::step::{Core, CoreConfig};

const SEQS: u32 = 256;
const PROMPT: u32 = 512;

fn group() -> GroupGeometry {
    GroupGeometry {
        name: "bench".into(),
        tokens_per_block: 16,
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

fn tables(seq_id: u64, len: u32) -> Vec<Table> {
    let blocks = len.div_ceil(16);
    let base = (seq_id as u32) * 10_000;
    vec![
        Table {
            pool_id: 1,
            window: 0,
            first_block: 0,
            block_ids: (base..base + blocks).collect(),
        },
        Table {
            pool_id: 2,
            window: 64,
            first_block: blocks.saturating_sub(5),
            block_ids: (base..base + blocks.min(5)).collect(),
        },
    ]
}

/// An Extend grant is a delta: one new block per pool when the sequence
/// crosses a block boundary, nothing otherwise.
fn extend_grant(seq_id: SeqId, len: u32) -> Outcome {
    let crossed = (len - 1).is_multiple_of(16);
    let new: Vec<u32> = if crossed {
        vec![(seq_id.get() as u32) * 10_000 + len / 16]
    } else {
        Vec::new()
    };
    let blocks = len.div_ceil(16);
    let tables = vec![
        Table {
            pool_id: 1,
            window: 0,
            first_block: 0,
            block_ids: new.clone(),
        },
        Table {
            pool_id: 2,
            window: 64,
            first_block: blocks.saturating_sub(5),
            block_ids: new,
        },
    ];
    Outcome::Grant(Grant {
        tier_copies: Vec::new(),
        retained_tokens: 0,
        seq_id,
        tables,
        reused_tokens: 0,
        capacity_tokens: len,
        copies: Vec::new(),
        peer_copies: Vec::new(),
        peer_blocks: 0,
    })
}

fn grant(seq_id: SeqId, len: u32) -> Outcome {
    Outcome::Grant(Grant {
        tier_copies: Vec::new(),
        retained_tokens: 0,
        seq_id,
        tables: tables(seq_id.get(), len),
        reused_tokens: 0,
        capacity_tokens: len,
        copies: Vec::new(),
        peer_copies: Vec::new(),
        peer_blocks: 0,
    })
}

/// A core with `SEQS` sequences past prefill.
fn running_core(draft_k: u32) -> Core {
    let config = CoreConfig {
        max_seqs: SEQS,
        max_tokens_per_step: SEQS * PROMPT,
        prefill_chunk: PROMPT,
        draft_k,
        ..CoreConfig::default()
    };
    let mut core = Core::new(config, vec![group()]);
    for id in 1..=u64::from(SEQS) {
        // repetitive prompts so prompt lookup finds drafts
        let prompt = (0..PROMPT)
            .map(|p| (p % 37 + id as u32) % 250 + 1)
            .collect();
        core.submit(Request::new(RequestId(id), prompt, 1_000_000));
    }
    core.begin_step();
    let leases = core.plan_admission();
    core.apply_leases(leases.iter().map(|l| grant(l.seq_id, PROMPT)).collect());
    let batches = core.plan_forward();
    for (g, items) in batches {
        let results = items.iter().map(|i| ForwardResult {
            seq_id: i.seq_id,
            next_token: 5,
            argmax: vec![],
            logprobs: Vec::new(),
            error: None,
        });
        core.apply_forward(g, results.collect::<Vec<_>>());
    }
    core.drain_outputs();
    core
}

/// One step of scheduler work with scripted grants and results; the
/// scripting (building the answers) is timed separately and subtracted.
fn step(core: &mut Core, len: u32) -> (Duration, Duration) {
    let mut scripting = Duration::ZERO;
    let start = Instant::now();
    core.begin_step();
    let extends = core.plan_extends(false);
    let t = Instant::now();
    let outcomes: Vec<Outcome> = extends
        .iter()
        .map(|e| extend_grant(e.seq_id, len))
        .collect();
    scripting += t.elapsed();
    core.apply_extends(core.step(), outcomes);
    black_box(core.plan_admission());
    let batches = core.plan_forward();
    for (g, items) in batches {
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
    (start.elapsed(), scripting)
}

fn main() {
    println!(
        "scheduler core time per step, {SEQS} running decode sequences ({PROMPT}-token prompts)"
    );
    println!("{:<28} {:>12} {:>12}", "mode", "us/step", "steps");
    for (name, draft_k) in [("greedy", 0), ("prompt-lookup k=4", 4)] {
        let mut core = running_core(draft_k);
        let steps = 200;
        let mut own = Duration::ZERO;
        for i in 0..steps {
            let (total, scripting) = step(&mut core, PROMPT + 2 + i);
            own += total.saturating_sub(scripting);
        }
        let per_step = own.as_secs_f64() * 1e6 / f64::from(steps);
        println!("{name:<28} {per_step:>12.1} {steps:>12}");
    }
}
