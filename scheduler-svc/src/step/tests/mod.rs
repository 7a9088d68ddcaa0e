//! Deterministic tests of the core: scripted cache outcomes and worker
//! results in, decisions out. This file holds the builders every test
//! shares; each submodule tests one concern.

use super::*;
use std::collections::HashMap;

use crate::domain::{
    ExtendSpec, Finish, ForwardItem, ForwardResult, Grant, LeaseSpec, Outcome, PoolGeometry,
    Reject, RejectReason, Step,
};
use crate::policy::OnExhausted;

mod ahead;
mod beams;
mod fences;
mod forks;
mod handoff;
mod model;
mod peers;
mod policies;
mod recovery;
mod requests;
mod routing;
mod tiers;

fn group(blocks: u32) -> GroupGeometry {
    GroupGeometry {
        name: "g0".into(),
        tokens_per_block: 4,
        pools: vec![PoolGeometry {
            host_blocks: 0,
            pool_id: 1,
            window: 0,
            num_blocks: blocks,
        }],
        max_context: 1024,
        vocab_size: 258,
        max_batch_sequences: 64,
        max_batch_tokens: 1024,
        peer: Default::default(),
        role: Default::default(),
    }
}

fn core(policy: Policy, blocks: u32) -> Core {
    let config = CoreConfig {
        policy,
        ..CoreConfig::default()
    };
    Core::new(config, vec![group(blocks)])
}

/// A core with `config` over one group of 100 blocks.
fn core_with(config: CoreConfig) -> Core {
    Core::new(config, vec![group(100)])
}

fn request(id: u64, prompt_len: usize, max_tokens: u32) -> Request {
    Request::new(
        RequestId(id),
        (0..prompt_len as u32).map(|t| t % 200 + 1).collect(),
        max_tokens,
    )
}

/// A grant of `block_ids` in pool 1 (full attention) from block 0, reusing
/// nothing, with no copies.
fn grant_of(seq_id: SeqId, block_ids: Vec<u32>) -> Grant {
    Grant {
        tier_copies: Vec::new(),
        retained_tokens: 0,
        seq_id,
        tables: vec![Table {
            pool_id: 1,
            window: 0,
            first_block: 0,
            block_ids,
        }],
        reused_tokens: 0,
        capacity_tokens: 0,
        copies: Vec::new(),
        peer_copies: Vec::new(),
        peer_blocks: 0,
    }
}

/// A grant of one block, numbered after the sequence.
fn grant(seq_id: SeqId) -> Outcome {
    Outcome::Grant(grant_of(seq_id, vec![seq_id.get() as u32]))
}

/// Grants every lease in `leases` (one block each).
fn grant_all(c: &mut Core, leases: &[LeaseSpec]) {
    c.apply_leases(leases.iter().map(|l| grant(l.seq_id)).collect());
}

/// Two groups of 100 blocks of 4 tokens: `g0` (pool 1) and `g1` (pool 2).
fn two_group_geometries() -> Vec<GroupGeometry> {
    let mut second = group(100);
    second.name = "g1".into();
    second.pools[0].pool_id = 2;
    vec![group(100), second]
}

/// A core over [`two_group_geometries`], routed by `routing`.
fn two_groups(routing: crate::routing::Routing) -> Core {
    let config = CoreConfig {
        routing: crate::routing::RoutingConfig {
            policy: routing,
            ..Default::default()
        },
        ..CoreConfig::default()
    };
    Core::new(config, two_group_geometries())
}

/// Two requests of `max_tokens` admitted (granted) and launched over
/// [`two_groups_one_sequence_each`]: one forward pass in each group.
fn two_passes(max_tokens: u32) -> (Core, Step, Vec<(usize, Vec<ForwardItem>)>) {
    let mut c = Core::new(CoreConfig::default(), two_groups_one_sequence_each());
    c.submit(request(1, 4, max_tokens));
    c.submit(request(2, 4, max_tokens));
    let step = c.begin_step();
    let leases = c.plan_admission();
    grant_all(&mut c, &leases);
    let batches = c.plan_forward();
    assert_eq!(batches.len(), 2);
    (c, step, batches)
}

/// [`two_group_geometries`] with one sequence per forward batch, so two
/// sequences make a pass in each group.
fn two_groups_one_sequence_each() -> Vec<GroupGeometry> {
    let mut groups = two_group_geometries();
    for g in &mut groups {
        g.max_batch_sequences = 1;
    }
    groups
}

fn exhausted(seq_id: SeqId) -> Outcome {
    Outcome::Reject(Reject {
        seq_id,
        reason: RejectReason::PoolExhausted,
        pool_id: 1,
        window: 0,
        blocks_needed: 1,
        blocks_free: 0,
        blocks_pending_free: 0,
        message: "no free blocks".into(),
    })
}

fn reject(seq_id: SeqId, reason: RejectReason) -> Outcome {
    match exhausted(seq_id) {
        Outcome::Reject(r) => Outcome::Reject(Reject { reason, ..r }),
        other => other,
    }
}

/// The worker answers `token` for every sequence, and echoes the drafts as
/// its argmax when `accept_drafts` (so every draft is accepted).
fn results(items: &[ForwardItem], token: u32, accept_drafts: bool) -> Vec<ForwardResult> {
    items
        .iter()
        .map(|i| {
            let mut argmax: Vec<u32> = if accept_drafts {
                i.tokens[1..].to_vec()
            } else {
                vec![]
            };
            argmax.push(token);
            if !i.return_all_argmax {
                argmax.clear();
            }
            ForwardResult {
                seq_id: i.seq_id,
                next_token: token,
                argmax,
                logprobs: Vec::new(),
                error: None,
            }
        })
        .collect()
}

/// Runs one whole step, granting every extend and lease unless a script
/// says otherwise; returns the forward batch.
fn step_with(
    core: &mut Core,
    extend: impl Fn(&ExtendSpec) -> Outcome,
    lease: impl Fn(&LeaseSpec) -> Outcome,
    token: u32,
) -> Vec<ForwardItem> {
    core.begin_step();
    let extends = core.plan_extends(false);
    core.apply_extends(core.step(), extends.iter().map(extend).collect());
    let leases = core.plan_admission();
    core.apply_leases(leases.iter().map(lease).collect());
    let batches = core.plan_forward();
    let mut all = Vec::new();
    for (g, items) in batches {
        core.apply_forward(g, results(&items, token, false));
        all.extend(items);
    }
    all
}

fn step_granting(core: &mut Core, token: u32) -> Vec<ForwardItem> {
    step_with(core, |e| grant(e.seq_id), |l| grant(l.seq_id), token)
}

/// The requests that finished, by id, and how.
fn finishes(outputs: &[Output]) -> Vec<(u64, Finish)> {
    outputs
        .iter()
        .filter_map(|o| match o {
            Output::Finished {
                request, finish, ..
            } => Some((request.get(), finish.clone())),
            Output::Tokens { .. } => None,
        })
        .collect()
}

fn tokens_of(outputs: &[Output], id: u64) -> Vec<u32> {
    outputs
        .iter()
        .filter_map(|o| match o {
            Output::Tokens {
                request, tokens, ..
            } if request.get() == id => Some(tokens.clone()),
            _ => None,
        })
        .flatten()
        .collect()
}

/// `n` requests running (prefilled, decoding), admitted over as many steps
/// as the batch limit takes.
fn running(c: &mut Core, n: u64) {
    for id in 1..=n {
        c.submit(request(id, 4, 8));
    }
    while c.queued() > 0 {
        step_granting(c, 7);
    }
    assert_eq!(c.running(), n as usize);
}
