//! Deterministic tests of the core: scripted cache outcomes and worker
//! results in, decisions out.

use super::*;
use std::collections::HashMap;

use crate::domain::{
    ExtendSpec, Finish, ForwardItem, ForwardResult, Grant, LeaseSpec, Outcome, PoolGeometry,
    Reject, RejectReason, Step,
};
use crate::policy::OnExhausted;

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
    }
}

fn core(policy: Policy, blocks: u32) -> Core {
    let config = CoreConfig {
        policy,
        ..CoreConfig::default()
    };
    Core::new(config, vec![group(blocks)])
}

fn request(id: u64, prompt_len: usize, max_tokens: u32) -> Request {
    Request::new(
        RequestId(id),
        (0..prompt_len as u32).map(|t| t % 200 + 1).collect(),
        max_tokens,
    )
}

fn grant(seq_id: SeqId) -> Outcome {
    Outcome::Grant(Grant {
        tier_copies: Vec::new(),
        seq_id,
        tables: vec![Table {
            pool_id: 1,
            window: 0,
            first_block: 0,
            block_ids: vec![seq_id.get() as u32],
        }],
        reused_tokens: 0,
        capacity_tokens: 0,
        copies: Vec::new(),
    })
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
    let extends = core.plan_extends();
    core.apply_extends(extends.iter().map(extend).collect());
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

#[test]
fn request_runs_prefill_then_decode_to_length() {
    let mut c = core(Policy::MaxUtilization, 100);
    c.submit(request(1, 6, 3));
    let b = step_granting(&mut c, 42);
    assert_eq!(b.len(), 1);
    assert_eq!((b[0].start_pos, b[0].tokens.len()), (0, 6));
    let b = step_granting(&mut c, 43);
    assert_eq!((b[0].start_pos, b[0].tokens.clone()), (6, vec![42]));
    step_granting(&mut c, 44);
    let out = c.drain_outputs();
    assert_eq!(tokens_of(&out, 1), vec![42, 43, 44]);
    assert_eq!(finishes(&out), vec![(1, Finish::Length)]);
    assert_eq!(c.take_releases().seq_ids, vec![SeqId(1)]);
    assert!(c.is_idle());
}

#[test]
fn extend_reports_the_fed_token_ids() {
    let mut c = core(Policy::MaxUtilization, 100);
    c.submit(request(1, 4, 5));
    step_granting(&mut c, 7);
    c.begin_step();
    let e = c.plan_extends();
    assert_eq!(
        e,
        vec![ExtendSpec {
            seq_id: SeqId(1),
            new_tokens: vec![7],
            written_tokens: 0
        }]
    );
}

#[test]
fn chunked_prefill_respects_chunk_and_step_budget() {
    let config = CoreConfig {
        prefill_chunk: 4,
        max_tokens_per_step: 6,
        ..CoreConfig::default()
    };
    let mut c = Core::new(config, vec![group(100)]);
    c.submit(request(1, 10, 2));
    c.submit(request(2, 3, 2));
    let b = step_granting(&mut c, 9);
    // seq 1 takes a chunk of 4, seq 2 the 2 tokens left in the budget
    let shape: Vec<(u64, u32, usize)> = b
        .iter()
        .map(|i| (i.seq_id.get(), i.start_pos, i.tokens.len()))
        .collect();
    assert_eq!(shape, vec![(1, 0, 4), (2, 0, 2)]);
    let b = step_granting(&mut c, 9);
    let shape: Vec<(u64, u32, usize)> = b
        .iter()
        .map(|i| (i.seq_id.get(), i.start_pos, i.tokens.len()))
        .collect();
    assert_eq!(shape, vec![(1, 4, 4), (2, 2, 1)]);
    let out = c.drain_outputs();
    assert_eq!(tokens_of(&out, 1), Vec::<u32>::new());
    assert_eq!(tokens_of(&out, 2), vec![9]);
}

/// One step driven by hand: the extends and leases the core asks for
/// (granted with `lease`'s grants) and the forward batch.
fn step_recording(
    core: &mut Core,
    lease: impl Fn(&LeaseSpec) -> Outcome,
    token: u32,
) -> (Vec<ExtendSpec>, Vec<LeaseSpec>, Vec<ForwardItem>) {
    core.begin_step();
    let extends = core.plan_extends();
    core.apply_extends(extends.iter().map(|e| grant(e.seq_id)).collect());
    let leases = core.plan_admission();
    core.apply_leases(leases.iter().map(lease).collect());
    let mut all = Vec::new();
    for (g, items) in core.plan_forward() {
        core.apply_forward(g, results(&items, token, false));
        all.extend(items);
    }
    (extends, leases, all)
}

#[test]
fn chunked_prefill_tells_the_cache_what_each_step_writes() {
    let config = CoreConfig {
        prefill_chunk: 4,
        ..CoreConfig::default()
    };
    let mut c = Core::new(config, vec![group(100)]);
    c.submit(request(1, 10, 2));
    let (extends, leases, b) = step_recording(&mut c, |l| grant(l.seq_id), 9);
    assert!(extends.is_empty());
    assert_eq!(leases.len(), 1);
    assert_eq!(
        leases[0].prefill_tokens, 4,
        "the lease's step writes one chunk"
    );
    assert_eq!((b[0].start_pos, b[0].tokens.len()), (0, 4));
    let tables = b[0].tables.clone();
    // every later chunk reports how far its pass writes the KV
    let progress = |written_tokens| {
        vec![ExtendSpec {
            seq_id: SeqId(1),
            new_tokens: Vec::new(),
            written_tokens,
        }]
    };
    let (extends, _, b) = step_recording(&mut c, |l| grant(l.seq_id), 9);
    assert_eq!(extends, progress(8));
    assert_eq!((b[0].start_pos, b[0].tokens.len()), (4, 4));
    assert_eq!(b[0].tables, tables, "a progress grant changes no table");
    let (extends, _, b) = step_recording(&mut c, |l| grant(l.seq_id), 9);
    assert_eq!(extends, progress(10));
    assert_eq!((b[0].start_pos, b[0].tokens.len()), (8, 2));
    assert_eq!(b[0].tables, tables);
    // then decode, whose extend carries the token and no progress figure
    let (extends, _, b) = step_recording(&mut c, |l| grant(l.seq_id), 9);
    assert_eq!(
        extends,
        vec![ExtendSpec {
            seq_id: SeqId(1),
            new_tokens: vec![9],
            written_tokens: 0,
        }]
    );
    assert_eq!((b[0].start_pos, b[0].tokens.clone()), (10, vec![9]));
    assert_eq!(finishes(&c.drain_outputs()), vec![(1, Finish::Length)]);

    // With reused tokens the chunks start after them; with a partial-block
    // copy it cannot run, the first pass computes the copied slots too, so
    // it still ends where the cache counts (reused_tokens + prefill_tokens).
    c.submit(request(2, 13, 1));
    let reusing = |l: &LeaseSpec| match grant(l.seq_id) {
        Outcome::Grant(g) => Outcome::Grant(Grant {
            reused_tokens: 6,
            // copies that disagree: the scheduler cannot apply them
            copies: [2, 3]
                .map(|tokens| crate::domain::BlockCopy {
                    pool_id: 1,
                    window: 0,
                    src_block: 50,
                    dst_block: 51,
                    tokens,
                })
                .to_vec(),
            ..g
        }),
        other => other,
    };
    let (_, leases, b) = step_recording(&mut c, reusing, 9);
    assert_eq!(leases[0].prefill_tokens, 4);
    // the copies are dropped: the pass starts before the copied slots (at
    // 6 - 2) and writes through 6 + 4, as the cache counts
    assert!(b[0].copies.is_empty());
    assert_eq!((b[0].start_pos, b[0].tokens.len()), (4, 6));
    let (extends, _, b) = step_recording(&mut c, |l| grant(l.seq_id), 9);
    assert_eq!(
        extends,
        vec![ExtendSpec {
            seq_id: SeqId(2),
            new_tokens: Vec::new(),
            written_tokens: 13,
        }]
    );
    assert_eq!((b[0].start_pos, b[0].tokens.len()), (10, 3));
}

#[test]
fn a_refused_progress_report_ends_the_sequence_like_any_refused_extend() {
    let config = CoreConfig {
        prefill_chunk: 4,
        ..CoreConfig::default()
    };
    let mut c = Core::new(config, vec![group(100)]);
    c.submit(request(1, 10, 2));
    step_granting(&mut c, 9);
    let b = step_with(
        &mut c,
        |e| reject(e.seq_id, RejectReason::UnknownSequence),
        |l| grant(l.seq_id),
        9,
    );
    assert!(b.is_empty(), "the refused sequence does not run its chunk");
    assert!(matches!(
        &finishes(&c.drain_outputs())[..],
        [(1, Finish::Rejected(r))] if r.reason == RejectReason::UnknownSequence
    ));
    assert_eq!(c.take_releases().seq_ids, vec![SeqId(1)]);
}

#[test]
fn stop_token_finishes_with_stop() {
    let mut c = core(Policy::MaxUtilization, 100);
    let mut r = request(1, 4, 10);
    r.stop_tokens = vec![5];
    c.submit(r);
    step_granting(&mut c, 3);
    step_granting(&mut c, 5);
    let out = c.drain_outputs();
    assert_eq!(tokens_of(&out, 1), vec![3, 5]);
    assert_eq!(finishes(&out), vec![(1, Finish::Stop)]);
}

// === MAX_UTILIZATION ===

#[test]
fn max_utilization_over_subscribes_admission() {
    // 5 blocks of 4 tokens; each request needs 2 blocks now, 5 over its life
    let mut c = core(Policy::MaxUtilization, 5);
    for id in 1..=3 {
        c.submit(request(id, 8, 10));
    }
    c.begin_step();
    let leases = c.plan_admission();
    assert_eq!(leases.len(), 2, "admits on the next step's need");
    assert!(leases.iter().all(|l| !l.reserve_full_life));
    let mut c = core(Policy::GuaranteedNoEvict, 5);
    for id in 1..=3 {
        c.submit(request(id, 8, 10));
    }
    c.begin_step();
    assert_eq!(
        c.plan_admission().len(),
        1,
        "no-evict admits on the whole life"
    );
}

#[test]
fn max_utilization_preempts_on_mid_flight_exhaustion_and_keeps_stepping() {
    let mut c = core(Policy::MaxUtilization, 100);
    c.submit(request(1, 4, 4));
    c.submit(request(2, 4, 4));
    step_granting(&mut c, 7);
    // seq 2 cannot grow: preempted, released, requeued; seq 1 keeps going
    let b = step_with(
        &mut c,
        |e| {
            if e.seq_id == SeqId(2) {
                exhausted(SeqId(2))
            } else {
                grant(e.seq_id)
            }
        },
        |l| grant(l.seq_id),
        8,
    );
    assert_eq!(
        b.iter().map(|i| i.seq_id.get()).collect::<Vec<_>>(),
        vec![1]
    );
    assert_eq!(c.take_releases().seq_ids, vec![SeqId(2)]);
    assert_eq!((c.queued(), c.preempted()), (1, 1));
    assert_eq!(c.counters().preemptions, 1);
    assert_eq!(
        PreemptCause::ALL.map(|cause| c.counters().preempted_by(cause)),
        [1, 0, 0],
        "counted as a pool-exhausted preemption"
    );
    // next step: the request comes back under a new sequence and recomputes
    // its prompt plus the token it had generated
    c.begin_step();
    let ext = c.plan_extends();
    c.apply_extends(ext.iter().map(|e| grant(e.seq_id)).collect());
    let leases = c.plan_admission();
    assert_eq!(leases.len(), 1);
    assert_eq!(leases[0].seq_id, SeqId(3));
    assert_eq!(leases[0].prompt_tokens.len(), 5);
    assert_eq!(leases[0].max_new_tokens, 3);
    let out = c.drain_outputs();
    assert!(finishes(&out).is_empty(), "nobody finished: {out:?}");
}

#[test]
fn max_utilization_reject_mode_finishes_rejected_with_reason() {
    let config = CoreConfig {
        on_exhausted: OnExhausted::Reject,
        ..CoreConfig::default()
    };
    let mut c = Core::new(config, vec![group(100)]);
    c.submit(request(1, 4, 4));
    step_granting(&mut c, 7);
    let b = step_with(&mut c, |e| exhausted(e.seq_id), |l| grant(l.seq_id), 8);
    assert!(b.is_empty());
    let out = c.drain_outputs();
    let f = finishes(&out);
    assert_eq!(f.len(), 1);
    assert!(matches!(&f[0].1, Finish::Rejected(r) if r.reason == RejectReason::PoolExhausted));
    assert_eq!(c.take_releases().seq_ids, vec![SeqId(1)]);
    assert_eq!(c.counters().rejected, 1);
}

#[test]
fn preemptions_are_bounded_per_request() {
    let config = CoreConfig {
        max_preemptions: 1,
        ..CoreConfig::default()
    };
    let mut c = Core::new(config, vec![group(100)]);
    c.submit(request(1, 4, 8));
    step_granting(&mut c, 7);
    step_with(&mut c, |e| exhausted(e.seq_id), |l| grant(l.seq_id), 7); // preempted, requeued
    step_granting(&mut c, 7); // re-leased, recomputed
    step_with(&mut c, |e| exhausted(e.seq_id), |l| grant(l.seq_id), 7); // over the bound
    let out = c.drain_outputs();
    let f = finishes(&out);
    assert_eq!(f.len(), 1);
    assert!(matches!(&f[0].1, Finish::Rejected(_)));
    assert!(matches!(
        out.last(),
        Some(Output::Finished { preemptions: 1, .. })
    ));
    assert!(c.is_idle());
}

// === admission outcomes and head of line ===

#[test]
fn transient_lease_refusal_waits_permanent_one_rejects() {
    let mut c = core(Policy::MaxUtilization, 100);
    c.submit(request(1, 4, 4));
    c.submit(request(2, 4, 4));
    step_with(
        &mut c,
        |e| grant(e.seq_id),
        |l| {
            if l.seq_id == SeqId(1) {
                exhausted(SeqId(1))
            } else {
                reject(SeqId(2), RejectReason::ExceedsCapacity)
            }
        },
        7,
    );
    let out = c.drain_outputs();
    let f = finishes(&out);
    assert_eq!(f.len(), 1);
    assert_eq!(f[0].0, 2);
    assert_eq!(c.queue.front().map(|r| r.id.get()), Some(1));
    assert_eq!(c.queued(), 1);
}

#[test]
fn never_fitting_request_is_rejected_at_submit() {
    let mut c = core(Policy::MaxUtilization, 4);
    c.submit(request(1, 8, 20)); // 8 + 19 = 27 slots > 16
    let out = c.drain_outputs();
    let f = finishes(&out);
    assert!(
        matches!(&f[..], [(1, Finish::Rejected(r))] if r.reason == RejectReason::ExceedsCapacity && r.blocks_needed == 7)
    );
    assert_eq!(c.queued(), 0);
}

#[test]
fn head_of_line_is_not_skipped() {
    let mut c = core(Policy::GuaranteedNoEvict, 10);
    c.submit(request(1, 16, 9)); // 24 slots: 6 blocks
    c.submit(request(2, 16, 9)); // 6 more: does not fit now
    c.submit(request(3, 2, 2)); // would fit, but waits behind 2
    c.begin_step();
    let leases = c.plan_admission();
    assert_eq!(
        leases.iter().map(|l| l.seq_id.get()).collect::<Vec<_>>(),
        vec![1]
    );
    assert_eq!(
        c.queue.ids().map(RequestId::get).collect::<Vec<_>>(),
        vec![2, 3]
    );
}

// === GUARANTEED_NO_EVICT ===

#[test]
fn no_evict_reserves_the_whole_life_and_admits_what_fits() {
    let mut c = core(Policy::GuaranteedNoEvict, 10);
    for id in 1..=3 {
        c.submit(request(id, 8, 9)); // 16 slots: 4 blocks each
    }
    c.begin_step();
    let leases = c.plan_admission();
    assert_eq!(leases.len(), 2);
    assert!(
        leases
            .iter()
            .all(|l| l.reserve_full_life && l.max_new_tokens == 9)
    );
}

#[test]
fn no_evict_admitted_request_runs_to_completion() {
    let mut c = core(Policy::GuaranteedNoEvict, 10);
    for id in 1..=3 {
        c.submit(request(id, 8, 9));
    }
    for _ in 0..40 {
        step_granting(&mut c, 1);
    }
    let out = c.drain_outputs();
    let f = finishes(&out);
    assert_eq!(f.len(), 3);
    assert!(f.iter().all(|(_, f)| *f == Finish::Length));
    assert_eq!(c.counters().preemptions, 0);
}

// === STATIC_BATCH ===

#[test]
fn static_batch_admits_only_between_batches() {
    let mut c = core(Policy::StaticBatch, 100);
    c.submit(request(1, 4, 3));
    c.submit(request(2, 4, 3));
    step_granting(&mut c, 1);
    c.submit(request(3, 4, 1));
    // 1 and 2 are running: 3 waits although it fits
    for _ in 0..2 {
        let b = step_granting(&mut c, 1);
        assert!(b.iter().all(|i| i.seq_id != SeqId(3)));
    }
    assert_eq!(finishes(&c.drain_outputs()).len(), 2);
    c.take_releases();
    let b = step_granting(&mut c, 1);
    assert_eq!(
        b.iter().map(|i| i.seq_id.get()).collect::<Vec<_>>(),
        vec![3]
    );
}

// === cancellation and recovery ===

#[test]
fn cancelled_running_request_is_released_and_finished() {
    let mut c = core(Policy::MaxUtilization, 100);
    c.submit(request(1, 4, 8));
    c.submit(request(2, 4, 8));
    step_granting(&mut c, 1);
    c.cancel(RequestId(2), "client went away");
    c.cancel(RequestId(99), "unknown is fine");
    assert_eq!(c.take_releases().seq_ids, vec![SeqId(2)]);
    let out = c.drain_outputs();
    assert!(matches!(finishes(&out)[..], [(2, Finish::Cancelled(_))]));
    let b = step_granting(&mut c, 1);
    assert_eq!(
        b.iter().map(|i| i.seq_id.get()).collect::<Vec<_>>(),
        vec![1]
    );
}

#[test]
fn cancel_during_lease_releases_the_grant() {
    let mut c = core(Policy::MaxUtilization, 100);
    c.submit(request(1, 4, 8));
    c.begin_step();
    let leases = c.plan_admission();
    c.cancel(RequestId(1), "gone");
    c.apply_leases(leases.iter().map(|l| grant(l.seq_id)).collect());
    assert_eq!(c.take_releases().seq_ids, vec![SeqId(1)]);
    assert!(c.is_idle());
}

#[test]
fn lost_leases_are_recomputed_with_their_tokens() {
    let mut c = core(Policy::MaxUtilization, 100);
    c.submit(request(1, 4, 8));
    step_granting(&mut c, 5);
    step_granting(&mut c, 6);
    c.leases_lost(true);
    assert_eq!(c.take_releases().seq_ids, Vec::<SeqId>::new());
    c.begin_step();
    let leases = c.plan_admission();
    assert_eq!(leases[0].prompt_tokens[4..], [5, 6]);
}

#[test]
fn forward_failure_with_no_requeues_left_ends_in_flight_requests_with_error() {
    let config = CoreConfig {
        max_preemptions: 0,
        ..CoreConfig::default()
    };
    let mut c = Core::new(config, vec![group(100)]);
    c.submit(request(1, 4, 8));
    c.begin_step();
    let leases = c.plan_admission();
    c.apply_leases(leases.iter().map(|l| grant(l.seq_id)).collect());
    let batches = c.plan_forward();
    c.forward_failed(batches[0].0, "worker down");
    assert!(matches!(
        finishes(&c.drain_outputs())[..],
        [(1, Finish::Error(_))]
    ));
    assert_eq!(c.take_releases().seq_ids, vec![SeqId(1)]);
}

#[test]
fn a_failed_worker_takes_no_new_requests_the_other_replica_does() {
    let config = CoreConfig {
        policy: Policy::MaxUtilization,
        ..CoreConfig::default()
    };
    let mut second = group(100);
    second.name = "g1".into();
    second.pools[0].pool_id = 2;
    let mut c = Core::new(config, vec![group(100), second]);
    c.submit(request(1, 4, 8));
    c.begin_step();
    let leases = c.plan_admission();
    assert_eq!(leases[0].pool_group, "g0");
    c.apply_leases(leases.iter().map(|l| grant(l.seq_id)).collect());
    let batches = c.plan_forward();
    c.forward_failed(batches[0].0, "connection refused");
    // The request does not end: its blocks are released and it is requeued.
    assert!(finishes(&c.drain_outputs()).is_empty());
    assert_eq!(c.counters().preempted_by(PreemptCause::WorkerFailed), 1);
    assert_eq!(c.take_releases().seq_ids.len(), 1);
    // It and new requests go to the replica that still answers, even though
    // g0 is emptier.
    c.submit(request(2, 4, 8));
    c.submit(request(3, 4, 8));
    c.begin_step();
    let leases = c.plan_admission();
    assert_eq!(leases.len(), 3);
    assert!(leases.iter().all(|l| l.pool_group == "g1"), "{leases:?}");
    c.apply_leases(leases.iter().map(|l| grant(l.seq_id)).collect());
    let batches = c.plan_forward();
    assert_eq!(batches.len(), 1);
    c.apply_forward(batches[0].0, results(&batches[0].1, 5, false));
    assert!(finishes(&c.drain_outputs()).is_empty());
}

#[test]
fn a_request_whose_worker_keeps_failing_ends_with_an_error_naming_the_group() {
    let config = CoreConfig {
        policy: Policy::MaxUtilization,
        max_preemptions: 1,
        ..CoreConfig::default()
    };
    let mut second = group(100);
    second.name = "g1".into();
    second.pools[0].pool_id = 2;
    let mut c = Core::new(config, vec![group(100), second]);
    c.submit(request(1, 4, 8));
    for (attempt, name) in ["g0", "g1"].into_iter().enumerate() {
        c.begin_step();
        let leases = c.plan_admission();
        assert_eq!(leases.len(), 1, "attempt {attempt}");
        assert_eq!(leases[0].pool_group, name);
        c.apply_leases(leases.iter().map(|l| grant(l.seq_id)).collect());
        let batches = c.plan_forward();
        c.forward_failed(batches[0].0, "connection refused");
        assert_eq!(c.take_releases().seq_ids.len(), 1);
    }
    let ended = finishes(&c.drain_outputs());
    assert!(
        matches!(&ended[..], [(1, Finish::Error(m))] if m.contains("g1") && m.contains("connection refused")),
        "{ended:?}"
    );
}

// === speculative decoding ===

#[test]
fn speculative_decode_feeds_drafts_and_extends_by_accepted_plus_one() {
    let config = CoreConfig {
        draft_k: 3,
        ..CoreConfig::default()
    };
    let mut c = Core::new(config, vec![group(100)]);
    // prompt 1 2 3 1 2: after the model emits 3, "2 3" was seen -> draft "1 2 ..."
    c.submit(Request::new(RequestId(1), vec![1, 2, 3, 1, 2], 10));
    c.begin_step();
    let leases = c.plan_admission();
    assert_eq!(leases[0].extra.draft, 3);
    c.apply_leases(leases.iter().map(|l| grant(l.seq_id)).collect());
    let b = c.plan_forward();
    c.apply_forward(0, results(&b[0].1, 3, false));
    // decode: feed 3 with drafts from the earlier "2 3" -> "1 2 3"
    c.begin_step();
    let e = c.plan_extends();
    assert_eq!(e[0].new_tokens, vec![3]);
    c.apply_extends(e.iter().map(|e| grant(e.seq_id)).collect());
    let b = c.plan_forward();
    let item = &b[0].1[0];
    assert_eq!(item.tokens, vec![3, 1, 2, 3]);
    assert!(item.return_all_argmax);
    assert_eq!(item.start_pos, 5);
    // the worker accepts every draft and adds 9
    c.apply_forward(0, results(&b[0].1, 9, true));
    let out = c.drain_outputs();
    assert_eq!(tokens_of(&out, 1), vec![3, 1, 2, 3, 9]);
    // next extend covers the 3 accepted drafts and the fed token
    c.begin_step();
    let e = c.plan_extends();
    assert_eq!(e[0].new_tokens, vec![1, 2, 3, 9]);
}

#[test]
fn drafts_never_overshoot_max_tokens() {
    let config = CoreConfig {
        draft_k: 4,
        ..CoreConfig::default()
    };
    let mut c = Core::new(config, vec![group(100)]);
    c.submit(Request::new(RequestId(1), vec![1, 2, 1, 2, 1, 2], 3));
    step_granting(&mut c, 1);
    c.begin_step();
    let e = c.plan_extends();
    c.apply_extends(e.iter().map(|e| grant(e.seq_id)).collect());
    let b = c.plan_forward();
    // 1 generated, 2 left: at most 1 draft
    assert_eq!(b[0].1[0].tokens.len(), 2);
    c.apply_forward(0, results(&b[0].1, 7, true));
    let out = c.drain_outputs();
    assert_eq!(tokens_of(&out, 1).len(), 3);
    assert_eq!(finishes(&out), vec![(1, Finish::Length)]);
}

#[test]
fn newcomers_do_not_take_the_decode_budget_of_running_requests() {
    // overlap order: admission runs before the running sequences are planned
    let config = CoreConfig {
        max_tokens_per_step: 8,
        prefill_chunk: 8,
        ..CoreConfig::default()
    };
    let mut c = Core::new(config, vec![group(100)]);
    for id in 1..=3 {
        c.submit(request(id, 2, 8));
    }
    step_granting(&mut c, 1); // three running sequences, now decoding
    c.submit(request(4, 20, 4));
    c.begin_step();
    let leases = c.plan_admission();
    c.apply_leases(leases.iter().map(|l| grant(l.seq_id)).collect());
    let e = c.plan_extends();
    assert_eq!(e.len(), 3, "every running request still decodes this step");
    c.apply_extends(e.iter().map(|e| grant(e.seq_id)).collect());
    let b = c.plan_forward();
    let tokens: usize = b[0].1.iter().map(|i| i.tokens.len()).sum();
    assert_eq!(tokens, 8);
    assert_eq!(
        b[0].1
            .iter()
            .find(|i| i.seq_id == SeqId(4))
            .map(|i| i.tokens.len()),
        Some(5)
    );
}

#[test]
fn lost_leases_can_be_rejected_cleanly() {
    let mut c = core(Policy::MaxUtilization, 100);
    c.submit(request(1, 4, 8));
    c.submit(request(2, 4, 8));
    step_granting(&mut c, 5);
    c.cancel(RequestId(2), "gone");
    c.drain_outputs();
    c.leases_lost(false);
    let out = c.drain_outputs();
    assert!(
        matches!(&finishes(&out)[..], [(1, Finish::Rejected(r))] if r.message.contains("restarted"))
    );
    assert!(
        c.take_releases().is_empty(),
        "the old session's releases are moot"
    );
    assert!(c.is_idle());
}

// === steps and fences: the founding rule ===

#[test]
fn steps_continue_after_warm_up() {
    let mut c = core(Policy::MaxUtilization, 100);
    c.continue_after(Step(7));
    assert_eq!(c.begin_step(), Step(8));
    assert_eq!(c.begin_step(), Step(9));
    assert_eq!(c.step(), Step(9));
}

#[test]
fn overlap_a_release_while_a_forward_is_in_flight_is_fenced_at_its_step() {
    let mut c = core(Policy::MaxUtilization, 100);
    c.submit(request(1, 4, 8));
    c.submit(request(2, 4, 8));
    let first = c.begin_step();
    let leases = c.plan_admission();
    c.apply_leases(leases.iter().map(|l| grant(l.seq_id)).collect());
    let batches = c.plan_forward();
    assert_eq!(c.forward_in_flight(), Some(first));
    // the client of request 1 goes away while forward `first` reads its blocks
    c.cancel(RequestId(1), "gone");
    let next = c.begin_step();
    let batch = c.take_releases();
    assert_eq!(batch.seq_ids, vec![SeqId(1)]);
    assert_eq!(batch.fence_step, Some(first), "{batch:?}");
    assert_eq!(c.complete_through(), None, "forward {first} is in flight");
    c.releases_sent(batch);
    c.apply_forward(batches[0].0, results(&batches[0].1, 7, false));
    assert_eq!(c.forward_in_flight(), None);
    assert_eq!(c.complete_through(), Some(first));
    c.step_completed(first);
    assert_eq!(c.complete_through(), None);
    assert!(next > first);
}

#[test]
fn plain_releases_after_a_forward_are_fenced_at_it_and_its_step_completes() {
    let mut c = core(Policy::MaxUtilization, 100);
    c.submit(request(1, 4, 1));
    let step = c.begin_step();
    let leases = c.plan_admission();
    c.apply_leases(leases.iter().map(|l| grant(l.seq_id)).collect());
    let batches = c.plan_forward();
    assert_eq!(c.complete_through(), None, "forward {step} is in flight");
    c.apply_forward(batches[0].0, results(&batches[0].1, 7, false));
    // request 1 ended LENGTH in forward `step`: released fenced at it
    let batch = c.take_releases();
    assert_eq!(
        (batch.seq_ids.clone(), batch.fence_step),
        (vec![SeqId(1)], Some(step))
    );
    c.releases_sent(batch);
    assert_eq!(c.complete_through(), Some(step));
    c.step_completed(step);
    // with no forward pass left to complete, a release is not fenced
    c.submit(request(2, 4, 8));
    c.begin_step();
    let leases = c.plan_admission();
    c.apply_leases(leases.iter().map(|l| grant(l.seq_id)).collect());
    c.cancel(RequestId(2), "gone");
    let batch = c.take_releases();
    assert_eq!(
        (batch.seq_ids.clone(), batch.fence_step),
        (vec![SeqId(2)], None)
    );
    c.releases_sent(batch);
    assert!(c.is_quiet());
}

#[test]
fn a_step_completes_only_once_every_group_returned() {
    let mut second = group(100);
    second.name = "g1".into();
    second.pools[0].pool_id = 2;
    second.max_batch_sequences = 1;
    let mut first = group(100);
    first.max_batch_sequences = 1;
    let mut c = Core::new(CoreConfig::default(), vec![first, second]);
    c.submit(request(1, 4, 8));
    c.submit(request(2, 4, 8));
    let step = c.begin_step();
    let leases = c.plan_admission();
    c.apply_leases(leases.iter().map(|l| grant(l.seq_id)).collect());
    let batches = c.plan_forward();
    assert_eq!(batches.len(), 2);
    c.apply_forward(batches[0].0, results(&batches[0].1, 7, false));
    assert_eq!(
        c.forward_in_flight(),
        Some(step),
        "group 1 has not returned"
    );
    assert_eq!(c.complete_through(), None);
    assert_eq!(c.take_releases().fence_step, Some(step));
    c.forward_failed(batches[1].0, "connection refused");
    // the failed pass's sequences are released first (see below)
    assert!(c.take_releases().discard_unwritten);
    assert_eq!(c.complete_through(), Some(step));
}

/// A failed forward pass may not have written its sequences' blocks: their
/// release goes first, alone, fenced at the step and with
/// `discard_unwritten`, before the step is reported complete; a sequence
/// that finished normally in the same step is released as before.
#[test]
fn a_failed_pass_releases_its_sequences_apart_with_discard_unwritten() {
    let mut second = group(100);
    second.name = "g1".into();
    second.pools[0].pool_id = 2;
    second.max_batch_sequences = 1;
    let mut first = group(100);
    first.max_batch_sequences = 1;
    let mut c = Core::new(CoreConfig::default(), vec![first, second]);
    // one token each: the request whose pass returns finishes at once
    c.submit(request(1, 4, 1));
    c.submit(request(2, 4, 1));
    let step = c.begin_step();
    let leases = c.plan_admission();
    c.apply_leases(leases.iter().map(|l| grant(l.seq_id)).collect());
    let batches = c.plan_forward();
    assert_eq!(batches.len(), 2);
    let seq = |b: &(usize, Vec<ForwardItem>)| b.1[0].seq_id;
    let (done, failed) = (seq(&batches[0]), seq(&batches[1]));
    c.apply_forward(batches[0].0, results(&batches[0].1, 7, false));
    c.forward_failed(batches[1].0, "connection refused");
    assert!(c.has_releases());
    assert_eq!(
        c.complete_through(),
        None,
        "no completion before the failed pass's release"
    );
    let batch = c.take_releases();
    assert_eq!(
        batch,
        ReleaseBatch {
            seq_ids: vec![failed],
            fence_step: Some(step),
            discard_unwritten: true,
        }
    );
    // the call did not reach the cache: it goes again, flag and all
    c.restore_releases(batch);
    assert_eq!(c.complete_through(), None);
    let batch = c.take_releases();
    assert_eq!(
        (batch.seq_ids.clone(), batch.discard_unwritten),
        (vec![failed], true)
    );
    c.releases_sent(batch);
    // sent with the completion (the loop's one Step call)
    assert_eq!(c.complete_through(), Some(step));
    c.step_completed(step);
    let batch = c.take_releases();
    assert_eq!(
        batch,
        ReleaseBatch {
            seq_ids: vec![done],
            fence_step: None,
            discard_unwritten: false,
        },
        "a normal finish keeps today's release"
    );
    c.releases_sent(batch);
    assert!(!c.has_releases());
}

#[test]
fn an_unacknowledged_complete_step_is_retried_but_never_for_a_step_in_flight() {
    let mut c = core(Policy::MaxUtilization, 100);
    c.submit(request(1, 4, 8));
    step_granting(&mut c, 7);
    let first = c.step();
    assert_eq!(c.complete_through(), Some(first));
    // the cache did not acknowledge it; the next forward is launched
    let second = c.begin_step();
    let e = c.plan_extends();
    c.apply_extends(e.iter().map(|e| grant(e.seq_id)).collect());
    let batches = c.plan_forward();
    assert_eq!(
        c.complete_through(),
        Some(first),
        "retried, not folded into the step in flight"
    );
    c.apply_forward(batches[0].0, results(&batches[0].1, 7, false));
    assert_eq!(c.complete_through(), Some(second));
    c.step_completed(second);
    assert_eq!(c.complete_through(), None);
}

#[test]
fn releases_that_did_not_reach_the_cache_are_sent_again_with_the_fence_of_then() {
    let mut c = core(Policy::MaxUtilization, 100);
    c.submit(request(1, 4, 8));
    c.submit(request(2, 4, 8));
    let step = c.begin_step();
    let leases = c.plan_admission();
    c.apply_leases(leases.iter().map(|l| grant(l.seq_id)).collect());
    let batches = c.plan_forward();
    c.cancel(RequestId(1), "gone");
    let batch = c.take_releases();
    assert_eq!(batch.fence_step, Some(step));
    c.restore_releases(batch);
    assert!(c.take_released().is_empty(), "still held at the cache");
    c.apply_forward(batches[0].0, results(&batches[0].1, 7, false));
    assert_eq!(c.complete_through(), Some(step));
    c.step_completed(step);
    let batch = c.take_releases();
    assert_eq!(
        (batch.seq_ids.clone(), batch.fence_step),
        (vec![SeqId(1)], None)
    );
    c.releases_sent(batch);
    assert_eq!(c.take_released(), vec![SeqId(1)]);
}

#[test]
fn released_names_every_sequence_once_it_holds_nothing() {
    let mut c = core(Policy::MaxUtilization, 100);
    for id in 1..=4 {
        c.submit(request(id, 4, 8));
    }
    c.begin_step();
    let leases = c.plan_admission();
    // 1 granted, 2 refused for good, 3 waits, 4 gets no outcome at all
    c.apply_leases(vec![
        grant(SeqId(1)),
        reject(SeqId(2), RejectReason::ExceedsCapacity),
        exhausted(SeqId(3)),
    ]);
    assert_eq!(leases.len(), 4);
    let mut released = c.take_released();
    released.sort_unstable();
    assert_eq!(released, vec![SeqId(2), SeqId(3), SeqId(4)]);
    c.begin_step();
    let leases = c.plan_admission();
    assert_eq!(leases.len(), 2);
    c.leases_failed();
    assert_eq!(c.take_released(), vec![SeqId(5), SeqId(6)]);
    c.cancel(RequestId(1), "gone");
    let batch = c.take_releases();
    assert!(
        c.take_released().is_empty(),
        "not before the cache answered"
    );
    c.releases_sent(batch);
    assert_eq!(c.take_released(), vec![SeqId(1)]);
    // lost leases: running sequences and unsent releases alike
    c.begin_step();
    let leases = c.plan_admission();
    assert_eq!(
        leases.iter().map(|l| l.request.get()).collect::<Vec<_>>(),
        vec![3, 4]
    );
    c.apply_leases(leases.iter().map(|l| grant(l.seq_id)).collect());
    c.cancel(RequestId(3), "gone");
    c.leases_lost(true);
    let mut released = c.take_released();
    released.sort_unstable();
    assert_eq!(released, vec![SeqId(7), SeqId(8)]);
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

/// A release is forgotten only once the cache answered it: a call the cache
/// refused (an error status such as RESOURCE_EXHAUSTED or INVALID_ARGUMENT)
/// leaves its sequences held at the cache, so they go again with the next
/// batch, as after a call that never reached it; dropping them would leak
/// their blocks for the life of the session.
#[test]
fn a_release_the_cache_refused_or_did_not_answer_is_kept_and_sent_again() {
    for failure in [CallFailure::Refused, CallFailure::Unanswered] {
        let mut c = core(Policy::MaxUtilization, 100);
        running(&mut c, 2);
        c.take_released();
        c.cancel(RequestId(1), "gone");
        let batch = c.take_releases();
        assert_eq!(batch.seq_ids, vec![SeqId(1)]);
        c.release_failed(batch, failure);
        assert!(c.take_released().is_empty(), "{failure:?}: still held");
        assert!(c.has_releases(), "{failure:?}");
        assert!(!c.is_quiet());
        // tried again, and again, until the cache answers
        for _ in 0..3 {
            let again = c.take_releases();
            assert_eq!(again.seq_ids, vec![SeqId(1)], "{failure:?}");
            c.release_failed(again, failure);
        }
        c.cancel(RequestId(2), "gone");
        let batch = c.take_releases();
        assert_eq!(batch.seq_ids, vec![SeqId(1), SeqId(2)], "{failure:?}");
        c.releases_sent(batch);
        assert_eq!(c.take_released(), vec![SeqId(1), SeqId(2)], "{failure:?}");
        assert!(!c.has_releases());
    }
}

/// A refused release of a failed pass's sequences keeps its
/// `discard_unwritten` and keeps holding back the step's completion.
#[test]
fn a_refused_discard_release_is_kept_with_its_flag_and_still_holds_back_completion() {
    let mut c = core(Policy::MaxUtilization, 100);
    c.submit(request(1, 4, 8));
    let step = c.begin_step();
    let leases = c.plan_admission();
    c.apply_leases(leases.iter().map(|l| grant(l.seq_id)).collect());
    let batches = c.plan_forward();
    c.forward_failed(batches[0].0, "connection refused");
    let batch = c.take_releases();
    assert!(batch.discard_unwritten);
    c.release_failed(batch, CallFailure::Refused);
    assert_eq!(c.complete_through(), None, "the discard goes first");
    let batch = c.take_releases();
    assert_eq!(
        (batch.seq_ids.clone(), batch.discard_unwritten),
        (vec![SeqId(1)], true)
    );
    c.releases_sent(batch);
    assert_eq!(c.complete_through(), Some(step));
}

/// Once the session is gone the cache has reclaimed everything it held: a
/// release that failed so is forgotten at once, and the loss of the leases
/// (the loop re-opening the session) does not name it a second time; a
/// release kept from an unanswered call is forgotten there, once.
#[test]
fn releases_of_a_lost_session_are_forgotten_exactly_once() {
    let mut c = core(Policy::MaxUtilization, 100);
    running(&mut c, 3);
    c.take_released();
    c.cancel(RequestId(1), "gone");
    let batch = c.take_releases();
    c.release_failed(batch, CallFailure::SessionLost);
    assert_eq!(c.take_released(), vec![SeqId(1)]);
    assert!(!c.has_releases());
    c.cancel(RequestId(2), "gone");
    let batch = c.take_releases();
    c.release_failed(batch, CallFailure::Unanswered);
    assert!(c.take_released().is_empty());
    c.leases_lost(true);
    let mut released = c.take_released();
    released.sort_unstable();
    assert_eq!(released, vec![SeqId(2), SeqId(3)], "each once");
    assert!(!c.has_releases());
}

/// No release batch holds more than the cache's batch limit: a backlog
/// (several requests ending at once, releases kept while the cache was
/// unreachable) goes in several batches, oldest first, the failed pass's
/// sequences first and alone, and completion waits for all of those.
#[test]
fn release_batches_never_exceed_the_caches_batch_limit() {
    let mut c = core(Policy::MaxUtilization, 100);
    c.set_batch_limit(Some(4));
    running(&mut c, 10);
    c.take_released();
    for id in 1..=10 {
        c.cancel(RequestId(id), "gone");
    }
    let mut sizes = Vec::new();
    let mut sent = Vec::new();
    while c.has_releases() {
        let batch = c.take_releases();
        sizes.push(batch.seq_ids.len());
        sent.extend(batch.seq_ids.iter().map(|s| s.get()));
        // the first try fails: kept, sent again with the next batches
        if sizes.len() == 1 {
            c.release_failed(batch, CallFailure::Refused);
            sent.clear();
            continue;
        }
        c.releases_sent(batch);
    }
    assert_eq!(sizes, vec![4, 4, 4, 2]);
    sent.sort_unstable();
    assert_eq!(sent, (1..=10).collect::<Vec<_>>(), "every one, once");
    // a failed pass of 6 sequences: 4 then 2, with discard_unwritten,
    // before any completion
    let mut c = core(Policy::MaxUtilization, 100);
    c.set_batch_limit(Some(4));
    running(&mut c, 6);
    let step = c.begin_step();
    let e = c.plan_extends();
    c.apply_extends(e.iter().map(|e| grant(e.seq_id)).collect());
    let batches = c.plan_forward();
    c.forward_failed(batches[0].0, "connection refused");
    for n in [4, 2] {
        assert_eq!(c.complete_through(), None);
        let batch = c.take_releases();
        assert_eq!((batch.seq_ids.len(), batch.discard_unwritten), (n, true));
        c.releases_sent(batch);
    }
    assert_eq!(c.complete_through(), Some(step));
    // no advertised limit: one batch
    let mut c = core(Policy::MaxUtilization, 100);
    c.set_batch_limit(Some(4));
    running(&mut c, 6);
    c.set_batch_limit(None);
    c.cancel_all("stop");
    assert_eq!(c.take_releases().seq_ids.len(), 6);
}

/// A step never leases more than the cache's batch limit, nor asks Match
/// about more requests: the rest of the queue is admitted at later steps.
#[test]
fn a_steps_leases_and_matches_never_exceed_the_caches_batch_limit() {
    let mut c = core(Policy::MaxUtilization, 100);
    c.set_batch_limit(Some(3));
    for id in 1..=7 {
        c.submit(request(id, 4, 8));
    }
    let mut per_step = Vec::new();
    while c.queued() > 0 {
        c.begin_step();
        let leases = c.plan_admission();
        per_step.push(leases.len());
        c.apply_leases(leases.iter().map(|l| grant(l.seq_id)).collect());
    }
    assert_eq!(per_step, vec![3, 3, 1]);
    let mut two = two_groups(crate::routing::Routing::KvAware);
    two.set_batch_limit(Some(2));
    for id in 1..=5 {
        two.submit(request(id, 8, 4));
    }
    assert_eq!(two.match_wanted().len(), 2);
}

/// The loop splits a step's extends into calls of at most the batch limit
/// and stops at the first that fails: the sequences the answered calls grew
/// keep their decode this step (planning them again would grow them at the
/// cache twice), the others sit it out and are planned again next step.
#[test]
fn extends_answered_before_a_failed_call_keep_their_decode() {
    let mut c = core(Policy::MaxUtilization, 100);
    running(&mut c, 3);
    c.begin_step();
    let extends = c.plan_extends();
    assert_eq!(extends.len(), 3);
    // the first call (two items) answered, the second failed
    c.apply_extends(extends[..2].iter().map(|e| grant(e.seq_id)).collect());
    c.extends_failed();
    let batches = c.plan_forward();
    let ran: Vec<SeqId> = batches
        .iter()
        .flat_map(|(_, items)| items.iter().map(|i| i.seq_id))
        .collect();
    assert_eq!(ran, vec![extends[0].seq_id, extends[1].seq_id]);
    for (g, items) in &batches {
        c.apply_forward(*g, results(items, 7, false));
    }
    c.begin_step();
    let next = c.plan_extends();
    assert_eq!(next.len(), 3);
    for e in &next {
        assert_eq!(e.new_tokens.len(), 1, "one new token each: {e:?}");
    }
}

/// The cache's block bookkeeping as the protocol specifies it, for one pool
/// of full attention: what `Lease`, `Extend`, `Release` (fenced or not) and
/// `CompleteStep` do to the blocks. Freed blocks are handed out first, so a
/// block released too early reaches another sequence at once.
struct ModelCache {
    tokens_per_block: u32,
    total: usize,
    free: Vec<u32>,
    held: HashMap<SeqId, (u32, Vec<u32>)>,
    fenced: Vec<(Step, Vec<u32>)>,
}

impl ModelCache {
    fn new(blocks: u32, tokens_per_block: u32) -> Self {
        Self {
            tokens_per_block,
            total: blocks as usize,
            free: (0..blocks).rev().collect(),
            held: HashMap::new(),
            fenced: Vec::new(),
        }
    }

    fn take(&mut self, seq_id: SeqId, tokens: u32, delta: bool) -> Outcome {
        let (had, mut blocks) = self.held.remove(&seq_id).unwrap_or_default();
        let need = (tokens.div_ceil(self.tokens_per_block) as usize).saturating_sub(blocks.len());
        if need > self.free.len() {
            if !blocks.is_empty() {
                self.held.insert(seq_id, (had, blocks));
            }
            return exhausted(seq_id);
        }
        let new: Vec<u32> = self.free.split_off(self.free.len() - need);
        blocks.extend(&new);
        let table = if delta { new } else { blocks.clone() };
        self.held.insert(seq_id, (tokens, blocks));
        Outcome::Grant(Grant {
            tier_copies: Vec::new(),
            seq_id,
            tables: vec![Table {
                pool_id: 1,
                window: 0,
                first_block: 0,
                block_ids: table,
            }],
            reused_tokens: 0,
            capacity_tokens: tokens,
            copies: Vec::new(),
        })
    }

    fn lease(&mut self, spec: &LeaseSpec) -> Outcome {
        let tokens = spec.prompt_tokens.len() as u32 + spec.extra.total();
        self.take(spec.seq_id, tokens, false)
    }

    fn extend(&mut self, spec: &ExtendSpec) -> Outcome {
        let Some(&(tokens, _)) = self.held.get(&spec.seq_id) else {
            return reject(spec.seq_id, RejectReason::UnknownSequence);
        };
        self.take(spec.seq_id, tokens + spec.new_tokens.len() as u32, true)
    }

    fn release(&mut self, batch: &ReleaseBatch) {
        for seq_id in &batch.seq_ids {
            if let Some((_, blocks)) = self.held.remove(seq_id) {
                match batch.fence_step {
                    Some(step) => self.fenced.push((step, blocks)),
                    None => self.free.extend(blocks),
                }
            }
        }
    }

    fn complete_step(&mut self, step: Step) {
        let (due, parked): (Vec<_>, Vec<_>) = std::mem::take(&mut self.fenced)
            .into_iter()
            .partition(|(s, _)| *s <= step);
        self.fenced = parked;
        self.free.extend(due.into_iter().flat_map(|(_, b)| b));
    }
}

/// The forward pass in flight in [`drive`]: its step and its batches.
type InFlight = Option<(Step, Vec<(usize, Vec<ForwardItem>)>)>;

/// What a run of [`drive`] exercised, so a test can tell it was not vacuous.
#[derive(Debug, Default)]
struct Exercised {
    grants: usize,
    /// Releases sent while a forward pass was in flight.
    released_in_flight: usize,
    completes: usize,
    finished: usize,
}

/// Drives a core the way the step loop does, executing the core's
/// [`StepPlan`] for `order`, against the model cache, with clients that come and go at random (seeded); a forward pass
/// is "in flight" from `plan_forward` until its results are applied. Panics
/// the moment a block reaches a sequence while an in-flight forward pass
/// reads it for another, or a `CompleteStep` names a step whose forward is
/// in flight.
fn drive(order: Order, seed: u64) -> Exercised {
    let mut rng = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let mut rand = move |n: u64| {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng % n
    };
    let mut c = core(Policy::MaxUtilization, 24);
    let mut cache = ModelCache::new(24, 4);
    let mut in_flight: InFlight = None;
    let mut seen = Exercised::default();
    let mut next_id = 1;

    fn check_grants(outcomes: &[Outcome], in_flight: &InFlight, seen: &mut Exercised) {
        for outcome in outcomes {
            let Outcome::Grant(g) = outcome else {
                continue;
            };
            seen.grants += 1;
            let Some((step, batches)) = in_flight else {
                continue;
            };
            for block in g.tables.iter().flat_map(|t| &t.block_ids) {
                for item in batches.iter().flat_map(|(_, items)| items) {
                    let reads = item.tables.iter().any(|t| t.block_ids.contains(block));
                    assert!(
                        item.seq_id == g.seq_id || !reads,
                        "block {block} granted to sequence {} while forward {step} still reads it for sequence {}",
                        g.seq_id,
                        item.seq_id
                    );
                }
            }
        }
    }
    let complete =
        |c: &mut Core, cache: &mut ModelCache, in_flight: &InFlight, seen: &mut Exercised| {
            if let Some(step) = c.complete_through() {
                if let Some((running, _)) = in_flight {
                    assert!(
                        step < *running,
                        "CompleteStep({step}) sent while forward {running} is in flight"
                    );
                }
                cache.complete_step(step);
                c.step_completed(step);
                seen.completes += 1;
            }
        };
    let flush =
        |c: &mut Core, cache: &mut ModelCache, in_flight: &InFlight, seen: &mut Exercised| {
            let batch = c.take_releases();
            if batch.is_empty() {
                return;
            }
            if in_flight.is_some() {
                seen.released_in_flight += 1;
            }
            cache.release(&batch);
            c.releases_sent(batch);
        };

    for _ in 0..3_000 {
        // the loop's top: clients arrive and go away, with a forward pass
        // possibly in flight; a retry of CompleteStep may come at any time
        if next_id <= 80 && rand(2) == 0 {
            let prompt = 3 + rand(10) as usize;
            c.submit(request(next_id, prompt, 2 + rand(8) as u32));
            next_id += 1;
        }
        let live = c.live_requests();
        if !live.is_empty() && rand(4) == 0 {
            c.cancel(live[rand(live.len() as u64) as usize], "gone");
        }
        if rand(3) == 0 {
            complete(&mut c, &mut cache, &in_flight, &mut seen);
        }
        if c.is_quiet() && in_flight.is_none() {
            if next_id > 80 {
                break;
            }
            continue;
        }
        let step = c.begin_step();
        let admit =
            |c: &mut Core, cache: &mut ModelCache, in_flight: &InFlight, seen: &mut Exercised| {
                let specs = c.plan_admission();
                let outcomes: Vec<Outcome> = specs.iter().map(|s| cache.lease(s)).collect();
                check_grants(&outcomes, in_flight, seen);
                c.apply_leases(outcomes);
            };
        let extend = |c: &mut Core, cache: &mut ModelCache, seen: &mut Exercised| {
            let specs = c.plan_extends();
            let outcomes: Vec<Outcome> = specs.iter().map(|s| cache.extend(s)).collect();
            check_grants(&outcomes, &None, seen);
            c.apply_extends(outcomes);
        };
        // the loop's order, from the core: this driver only executes it
        let mut plan = StepPlan::new(order, in_flight.is_some());
        while let Some(call) = plan.next_call() {
            match call {
                Call::FlushReleases => flush(&mut c, &mut cache, &in_flight, &mut seen),
                Call::Admit => admit(&mut c, &mut cache, &in_flight, &mut seen),
                Call::Extend => extend(&mut c, &mut cache, &mut seen),
                Call::Launch => {
                    let batches = c.plan_forward();
                    plan.launched(!batches.is_empty());
                    if !batches.is_empty() {
                        in_flight = Some((step, batches));
                    }
                }
                Call::Collect => {
                    if let Some((_, batches)) = in_flight.take() {
                        for (g, items) in batches {
                            c.apply_forward(g, results(&items, 7, false));
                        }
                        seen.finished += finishes(&c.drain_outputs()).len();
                    }
                }
                // the cache applies a Step call's parts in this order
                Call::Settle {
                    extend: with_extends,
                } => {
                    flush(&mut c, &mut cache, &in_flight, &mut seen);
                    complete(&mut c, &mut cache, &in_flight, &mut seen);
                    if with_extends {
                        extend(&mut c, &mut cache, &mut seen);
                    }
                }
                Call::RetryComplete => complete(&mut c, &mut cache, &in_flight, &mut seen),
            }
        }
    }
    assert!(c.is_quiet() && in_flight.is_none(), "the run did not drain");
    assert_eq!(
        cache.free.len(),
        cache.total,
        "every block back after the run: {} held, {} fenced",
        cache.held.len(),
        cache.fenced.len()
    );
    seen
}

#[test]
fn overlap_no_block_reaches_another_sequence_before_the_forward_that_could_read_it_returned() {
    let mut total = Exercised::default();
    for seed in 1..=40 {
        let seen = drive(Order::Overlap, seed);
        total.grants += seen.grants;
        total.released_in_flight += seen.released_in_flight;
        total.completes += seen.completes;
        total.finished += seen.finished;
    }
    assert!(
        total.released_in_flight > 100 && total.grants > 1_000 && total.completes > 1_000,
        "the runs exercised too little: {total:?}"
    );
}

#[test]
fn plain_no_block_reaches_another_sequence_early_and_every_fenced_block_comes_back() {
    let mut total = Exercised::default();
    for seed in 1..=40 {
        let seen = drive(Order::Plain, seed);
        total.grants += seen.grants;
        total.completes += seen.completes;
        total.finished += seen.finished;
    }
    assert_eq!(
        total.released_in_flight, 0,
        "nothing is in flight at a release"
    );
    assert!(
        total.grants > 1_000 && total.completes > 1_000 && total.finished > 1_000,
        "the runs exercised too little: {total:?}"
    );
}

#[test]
fn live_sequences_lost_to_a_cache_restart_in_reject_mode_end_rejected_cache_restarted() {
    let mut c = core(Policy::MaxUtilization, 100);
    c.submit(request(1, 4, 8));
    c.submit(request(2, 4, 8));
    step_granting(&mut c, 5);
    c.submit(request(3, 4, 8)); // queued: kept, leased again later
    c.drain_outputs();
    c.leases_lost(false);
    let ended = finishes(&c.drain_outputs());
    assert_eq!(ended.len(), 2, "{ended:?}");
    for (_, finish) in &ended {
        assert!(
            matches!(finish, Finish::Rejected(r) if r.reason == RejectReason::CacheRestarted
                && r.reason.protocol_name() == "CACHE_RESTARTED"),
            "{finish:?}"
        );
    }
    assert_eq!(c.queued(), 1);
}

/// A grant reusing two full blocks (8 tokens) and copying 2 more slots.
fn grant_with_copy(seq_id: SeqId) -> Outcome {
    Outcome::Grant(Grant {
        tier_copies: Vec::new(),
        seq_id,
        tables: vec![Table {
            pool_id: 1,
            window: 0,
            first_block: 0,
            block_ids: vec![0, 1, 7, 8],
        }],
        reused_tokens: 10,
        capacity_tokens: 14,
        copies: vec![crate::domain::BlockCopy {
            pool_id: 1,
            window: 0,
            src_block: 5,
            dst_block: 7,
            tokens: 2,
        }],
    })
}

#[test]
fn a_partial_block_copy_rides_the_first_forward_pass_only() {
    let mut c = core(Policy::MaxUtilization, 100);
    c.submit(request(1, 14, 2));
    let b = step_with(
        &mut c,
        |e| grant(e.seq_id),
        |l| grant_with_copy(l.seq_id),
        3,
    );
    assert_eq!((b[0].start_pos, b[0].tokens.len()), (10, 4));
    assert_eq!(b[0].copies.len(), 1);
    assert_eq!((b[0].copies[0].dst_block, b[0].copies[0].tokens), (7, 2));
    let b = step_granting(&mut c, 4);
    assert_eq!(b[0].start_pos, 14);
    assert!(b[0].copies.is_empty(), "the copy is done once");
}

#[test]
fn a_grant_whose_copies_do_not_add_up_is_recomputed_from_its_full_blocks() {
    // Two pools' copies that disagree on the slot count: the scheduler
    // cannot trust either, so it starts at the last reused full block.
    let mut c = core(Policy::MaxUtilization, 100);
    c.submit(request(1, 14, 2));
    let odd = |l: &LeaseSpec| match grant_with_copy(l.seq_id) {
        Outcome::Grant(mut g) => {
            let mut other = g.copies[0];
            other.tokens = 3;
            g.copies.push(other);
            Outcome::Grant(g)
        }
        o => o,
    };
    let b = step_with(&mut c, |e| grant(e.seq_id), odd, 3);
    assert_eq!((b[0].start_pos, b[0].tokens.len()), (8, 6));
    assert!(b[0].copies.is_empty());
}

#[test]
fn a_starved_request_ends_queue_timeout_with_the_last_refusals_figures() {
    let config = CoreConfig {
        max_queue_wait: Some(Duration::from_millis(500)),
        ..CoreConfig::default()
    };
    let mut c = Core::new(config, vec![group(100)]);
    let t0 = Instant::now();
    c.submit(request(1, 8, 4));
    c.submit(request(2, 8, 4));
    assert_eq!(c.expire_queue(t0), 0); // stamps both
    // another holder has the pool: every lease is refused, they wait
    step_with(&mut c, |e| grant(e.seq_id), |l| exhausted(l.seq_id), 7);
    assert_eq!(c.queued(), 2);
    assert_eq!(c.expire_queue(t0 + Duration::from_millis(500)), 0);
    assert_eq!(c.expire_queue(t0 + Duration::from_millis(501)), 2);
    let out = c.drain_outputs();
    let f = finishes(&out);
    assert_eq!(f.len(), 2);
    for (i, (_, finish)) in f.iter().enumerate() {
        let Finish::Rejected(r) = finish else {
            panic!("{finish:?}");
        };
        assert_eq!(r.reason, RejectReason::QueueTimeout);
        // the cache's figures from the refusal that kept it waiting
        assert_eq!((r.pool_id, r.blocks_needed, r.blocks_free), (1, 1, 0));
        for needle in [
            "waited 501 ms in the queue, the limit is 500 ms".to_owned(),
            format!("position {} of 2", i + 1),
            "pool exhausted".to_owned(),
        ] {
            assert!(
                r.message.contains(&needle),
                "{needle:?} not in {}",
                r.message
            );
        }
    }
    assert!(c.is_idle());
    assert_eq!(c.counters().rejected, 2);
}

#[test]
fn without_a_maximum_wait_nothing_times_out_and_a_preempted_request_waits_anew() {
    let mut c = core(Policy::MaxUtilization, 100);
    let t0 = Instant::now();
    c.submit(request(1, 8, 4));
    c.expire_queue(t0);
    assert_eq!(c.expire_queue(t0 + Duration::from_secs(3600)), 0);
    assert_eq!(c.queued(), 1);

    let config = CoreConfig {
        max_queue_wait: Some(Duration::from_millis(500)),
        ..CoreConfig::default()
    };
    let mut c = Core::new(config, vec![group(100)]);
    c.submit(request(1, 4, 8));
    c.expire_queue(t0);
    step_granting(&mut c, 7);
    // it ran, then the pool ran out under it: preempted and requeued
    step_with(&mut c, |e| exhausted(e.seq_id), |l| grant(l.seq_id), 8);
    assert_eq!(c.queued(), 1);
    // its wait starts when it is back in the queue, not at its arrival
    assert_eq!(c.expire_queue(t0 + Duration::from_millis(400)), 0);
    assert_eq!(c.expire_queue(t0 + Duration::from_millis(800)), 0);
    assert_eq!(c.expire_queue(t0 + Duration::from_millis(901)), 1);
}

// === host-tier copies ===

fn tiered_group() -> GroupGeometry {
    let mut g = group(100);
    g.pools[0].host_blocks = 400;
    g
}

fn demotion(device_block: u32, host_block: u32) -> crate::domain::TierCopy {
    crate::domain::TierCopy {
        pool_id: 1,
        window: 0,
        demote: true,
        device_block,
        host_block,
    }
}

fn grant_with_copies(seq_id: SeqId, copies: Vec<crate::domain::TierCopy>) -> Outcome {
    match grant(seq_id) {
        Outcome::Grant(g) => Outcome::Grant(Grant {
            tier_copies: copies,
            ..g
        }),
        other => other,
    }
}

#[test]
fn tier_copies_of_a_step_ride_its_forward_even_when_their_sequence_does_not() {
    let mut c = Core::new(CoreConfig::default(), vec![tiered_group()]);
    c.submit(request(1, 4, 8));
    c.begin_step();
    let leases = c.plan_admission();
    // The request is cancelled while its lease is in flight: the grant's
    // sequence never runs, but the demotion its allocation caused must.
    c.cancel(RequestId(1), "client went away");
    c.apply_leases(vec![grant_with_copies(
        leases[0].seq_id,
        vec![demotion(3, 7)],
    )]);
    let batches = c.plan_forward();
    assert_eq!(batches.len(), 1, "a forward of copies alone");
    assert!(batches[0].1.is_empty());
    assert_eq!(c.take_tier_copies(batches[0].0), vec![demotion(3, 7)]);
    assert!(c.take_tier_copies(batches[0].0).is_empty(), "taken once");
    c.apply_forward(batches[0].0, Vec::new());
    let release = c.take_releases();
    assert!(!release.discard_unwritten);
    c.releases_sent(release);
    assert!(c.complete_through().is_some());
}

#[test]
fn a_failed_forward_that_carried_demotions_releases_with_discard_before_completing() {
    let mut c = Core::new(CoreConfig::default(), vec![tiered_group()]);
    c.submit(request(1, 4, 8));
    c.begin_step();
    let leases = c.plan_admission();
    c.apply_leases(vec![grant_with_copies(
        leases[0].seq_id,
        vec![demotion(3, 7)],
    )]);
    let batches = c.plan_forward();
    let g = batches[0].0;
    assert_eq!(c.take_tier_copies(g).len(), 1);
    c.forward_failed(g, "worker down");
    assert_eq!(c.complete_through(), None, "not before the discard release");
    let release = c.take_releases();
    assert!(release.discard_unwritten);
    c.releases_sent(release);
    assert!(c.complete_through().is_some());
}

#[test]
fn a_lease_call_that_failed_with_a_host_tier_sends_a_discard_even_with_no_sequence() {
    let mut c = Core::new(CoreConfig::default(), vec![tiered_group()]);
    c.submit(request(1, 4, 8));
    c.begin_step();
    c.plan_admission();
    c.leases_failed();
    assert!(c.has_releases());
    let release = c.take_releases();
    assert!(release.discard_unwritten && !release.is_empty());
    // Without a host tier a failed lease call needs no such release.
    let mut plain = core(Policy::MaxUtilization, 100);
    plain.submit(request(1, 4, 8));
    plain.begin_step();
    plain.plan_admission();
    plain.leases_failed();
    assert!(!plain.take_releases().discard_unwritten);
}

// === routing ===

/// Two groups of 100 blocks of 4 tokens, `g0` and `g1`, routed by `routing`.
fn two_groups(routing: crate::routing::Routing) -> Core {
    let mut second = group(100);
    second.name = "g1".into();
    second.pools[0].pool_id = 2;
    let config = CoreConfig {
        routing: crate::routing::RoutingConfig {
            policy: routing,
            ..Default::default()
        },
        ..CoreConfig::default()
    };
    Core::new(config, vec![group(100), second])
}

/// Admits `request` with `reuse` (per group) as this step's `Match`
/// answered; returns the group it went to.
fn route(c: &mut Core, request: Request, reuse: Option<[u32; 2]>) -> String {
    let id = request.id;
    c.submit(request);
    c.begin_step();
    let asked = c.match_wanted();
    if let Some(reuse) = reuse {
        assert_eq!(
            asked.iter().map(|w| w.request).collect::<Vec<_>>(),
            vec![id]
        );
        c.set_reuse(HashMap::from([(id, reuse.to_vec())]));
    }
    let leases = c.plan_admission();
    assert_eq!(leases.len(), 1);
    c.apply_leases(leases.iter().map(|l| grant(l.seq_id)).collect());
    for (g, items) in c.plan_forward() {
        c.apply_forward(g, results(&items, 7, false));
    }
    leases[0].pool_group.clone()
}

#[test]
fn kv_aware_routing_sends_a_request_to_the_group_holding_its_prefix() {
    let mut c = two_groups(crate::routing::Routing::KvAware);
    // 5 blocks committed on g0 (ties go to the first group)
    assert_eq!(route(&mut c, request(1, 20, 64), Some([0, 0])), "g0");
    // 80 tokens, 76 cached on g0: 1 block to prefill there against 20 on
    // the idle g1; g0 wins despite its load
    assert_eq!(route(&mut c, request(2, 80, 64), Some([76, 0])), "g0");
    // the same without a Match answer (a failed call): least committed
    assert_eq!(route(&mut c, request(3, 80, 64), None), "g1");
}

#[test]
fn kv_aware_routing_leaves_a_much_more_loaded_group() {
    let mut c = two_groups(crate::routing::Routing::KvAware);
    // 50 blocks committed on g0
    assert_eq!(route(&mut c, request(1, 200, 64), Some([0, 0])), "g0");
    // its prefix saves 2 blocks on g0 (16 at the default weight 8), the
    // load there costs 50 more
    assert_eq!(route(&mut c, request(2, 80, 64), Some([8, 0])), "g1");
}

#[test]
fn least_committed_routing_ignores_the_prefix_and_asks_no_match() {
    let mut c = two_groups(crate::routing::Routing::LeastCommitted);
    assert_eq!(route(&mut c, request(1, 20, 64), None), "g0");
    c.submit(request(2, 80, 64));
    assert!(c.match_wanted().is_empty(), "no Match for least-committed");
    c.begin_step();
    c.set_reuse(HashMap::from([(RequestId(2), vec![76, 0])]));
    let leases = c.plan_admission();
    assert_eq!(leases[0].pool_group, "g1");
}

#[test]
fn match_is_asked_for_the_queue_head_only_with_a_choice_to_make() {
    // one group: nothing to choose
    let mut one = core(Policy::MaxUtilization, 100);
    one.submit(request(1, 8, 4));
    assert!(one.match_wanted().is_empty());
    // two groups: the head, up to the free sequence slots
    let mut c = two_groups(crate::routing::Routing::KvAware);
    c.config.max_seqs = 2;
    for id in 1..=3 {
        let mut r = request(id, 8, 4);
        r.cache_salt = format!("salt-{id}");
        c.submit(r);
    }
    let wanted = c.match_wanted();
    assert_eq!(
        wanted
            .iter()
            .map(|w| (w.request.get(), w.cache_salt.as_str()))
            .collect::<Vec<_>>(),
        vec![(1, "salt-1"), (2, "salt-2")]
    );
    assert_eq!(wanted[0].context.len(), 8);
    // an answer serves one admission only
    c.set_reuse(HashMap::from([(RequestId(3), vec![4, 0])]));
    c.begin_step();
    let _ = c.plan_admission();
    assert!(c.reuse.is_empty());
}
