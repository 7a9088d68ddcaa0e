//! The capacity policies: what each admits and what happens when a pool runs
//! out (MAX_UTILIZATION preempts or rejects; GUARANTEED_NO_EVICT reserves
//! whole lives; STATIC_BATCH admits between batches), and admission's
//! answers to refusals (transient waits, permanent rejects, head of line).

use super::*;

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
        [1, 0, 0, 0],
        "counted as a pool-exhausted preemption"
    );
    // next step: the request comes back under a new sequence and recomputes
    // its prompt plus the token it had generated
    c.begin_step();
    let ext = c.plan_extends(false);
    c.apply_extends(c.step(), ext.iter().map(|e| grant(e.seq_id)).collect());
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
    let mut c = core_with(config);
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
    let mut c = core_with(config);
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
