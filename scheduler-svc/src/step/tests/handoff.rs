//! Disaggregated serving: a request is prefilled in the prefill group,
//! then handed off to the decode group (a lease naming the prefill
//! sequence, whose grant's peer copies the decode worker pulls in the
//! first pass, which computes only the first sampled token); the prefill
//! sequence is released fenced at that step. A refused hand-off waits or
//! ends by policy; a failed pull is recomputed in the decode group.

use super::*;
use crate::domain::{PeerCopy, Role};

/// A prefill group `g0` (worker `http://w0`) and a decode group `g1`.
fn disaggregated(config: CoreConfig) -> Core {
    let mut groups = two_group_geometries();
    for (i, g) in groups.iter_mut().enumerate() {
        g.peer.address = format!("http://w{i}");
    }
    groups[0].role = Role::Prefill;
    groups[1].role = Role::Decode;
    Core::new(config, groups)
}

/// Prefills a 10-token request of 4 output tokens in g0 (token 7
/// sampled); returns its prefill sequence.
fn prefilled(c: &mut Core) -> SeqId {
    c.submit(request(1, 10, 4));
    c.begin_step();
    let leases = c.plan_admission();
    assert_eq!(leases.len(), 1);
    assert_eq!(leases[0].pool_group, "g0", "admitted to the prefill group");
    assert_eq!(leases[0].handoff_of, None);
    c.apply_leases(vec![Outcome::Grant(grant_of(
        leases[0].seq_id,
        vec![1, 2, 3],
    ))]);
    let batches = c.plan_forward();
    assert_eq!(batches.len(), 1);
    c.apply_forward(0, results(&batches[0].1, 7, false));
    assert_eq!(tokens_of(&c.drain_outputs(), 1), vec![7]);
    leases[0].seq_id
}

/// The next step's hand-off lease (no extend: the prefill group decodes
/// nothing).
fn handoff_lease(c: &mut Core) -> LeaseSpec {
    c.begin_step();
    assert!(c.plan_extends(false).is_empty());
    let leases = c.plan_admission();
    assert_eq!(leases.len(), 1, "{leases:?}");
    leases[0].clone()
}

/// The decode group's grant: blocks 20-22 of pool 2, the prompt's 10
/// positions pulled from g0's blocks 1-3 (two slots of the last).
fn handoff_grant(seq_id: SeqId) -> Outcome {
    let mut g = grant_of(seq_id, vec![20, 21, 22]);
    g.tables[0].pool_id = 2;
    g.reused_tokens = 10;
    g.peer_blocks = 3;
    g.peer_copies = [(1, 20, 0), (2, 21, 0), (3, 22, 2)]
        .into_iter()
        .map(|(src_block, dst_block, tokens)| PeerCopy {
            window: 0,
            dst_block,
            src_group: "g0".into(),
            src_block,
            transfer_id: 5,
            tokens,
        })
        .collect();
    Outcome::Grant(g)
}

#[test]
fn a_prefilled_request_is_handed_off_and_decodes_only_its_new_tokens_in_the_decode_group() {
    let mut c = disaggregated(CoreConfig::default());
    let src = prefilled(&mut c);
    let l = handoff_lease(&mut c);
    assert_eq!(l.pool_group, "g1");
    assert_eq!(l.handoff_of, Some(src));
    let mut want: Vec<u32> = request(1, 10, 4).prompt;
    want.push(7);
    assert_eq!(l.prompt_tokens, want, "the prompt and the sampled token");
    assert_eq!((l.prefill_tokens, l.max_new_tokens), (1, 3));
    c.apply_leases(vec![handoff_grant(l.seq_id)]);
    let batches = c.plan_forward();
    assert_eq!(batches.len(), 1);
    let (g, items) = &batches[0];
    assert_eq!(*g, 1, "only the decode group runs");
    // the first token's position only, after the pulled KV
    assert_eq!((items[0].start_pos, items[0].tokens.clone()), (10, vec![7]));
    let pull = items[0].peer_pull.as_ref().unwrap();
    assert_eq!(pull.address, "http://w0");
    assert_eq!(
        pull.blocks,
        vec![(0, 1, 20, 0), (0, 2, 21, 0), (0, 3, 22, 2)]
    );
    // the prefill sequence is released fenced at the transfer's step
    let batch = c.take_releases();
    assert_eq!(batch.seq_ids, vec![src]);
    assert_eq!(batch.fence_step, Some(c.step()));
    c.releases_sent(batch);
    c.apply_forward(1, results(items, 8, false));
    // then it decodes in g1 to its end
    for _ in 0..2 {
        let items = step_granting(&mut c, 9);
        assert!(
            items
                .iter()
                .all(|i| i.peer_pull.is_none() && i.tokens.len() == 1)
        );
    }
    let out = c.drain_outputs();
    assert_eq!(tokens_of(&out, 1), vec![8, 9, 9]);
    assert_eq!(finishes(&out), vec![(1, Finish::Length)]);
}

#[test]
fn a_handoff_refused_by_a_full_decode_group_waits_or_ends_by_policy() {
    // preempt (the default): it waits, holding its prefill, and is asked again
    let mut c = disaggregated(CoreConfig::default());
    let src = prefilled(&mut c);
    let l = handoff_lease(&mut c);
    c.apply_leases(vec![exhausted(l.seq_id)]);
    assert!(c.plan_forward().is_empty());
    assert!(c.take_releases().seq_ids.is_empty(), "nothing released");
    let again = handoff_lease(&mut c);
    assert_eq!(again.handoff_of, Some(src));
    // never fits: rejected with the cache's figures
    c.apply_leases(vec![reject(again.seq_id, RejectReason::ExceedsCapacity)]);
    let fin = finishes(&c.drain_outputs());
    assert!(
        matches!(&fin[..], [(1, Finish::Rejected(r))] if r.reason == RejectReason::ExceedsCapacity),
        "{fin:?}"
    );
    assert_eq!(c.take_releases().seq_ids, vec![src]);
    assert!(c.is_idle());

    // --on-exhausted reject: a mid-flight exhaustion ends it
    let mut c = disaggregated(CoreConfig {
        on_exhausted: OnExhausted::Reject,
        ..CoreConfig::default()
    });
    let src = prefilled(&mut c);
    let l = handoff_lease(&mut c);
    c.apply_leases(vec![exhausted(l.seq_id)]);
    let fin = finishes(&c.drain_outputs());
    assert!(
        matches!(&fin[..], [(1, Finish::Rejected(r))] if r.reason == RejectReason::PoolExhausted),
        "{fin:?}"
    );
    assert_eq!(c.take_releases().seq_ids, vec![src]);
}

#[test]
fn a_handoff_waiting_past_the_queues_limit_is_rejected_with_the_last_refusal() {
    let mut c = disaggregated(CoreConfig {
        max_queue_wait: Some(std::time::Duration::from_millis(10)),
        ..CoreConfig::default()
    });
    let src = prefilled(&mut c);
    let l = handoff_lease(&mut c);
    c.apply_leases(vec![exhausted(l.seq_id)]);
    assert_eq!(c.expire_queue(std::time::Instant::now()), 0);
    let later = std::time::Instant::now() + std::time::Duration::from_secs(1);
    assert_eq!(c.expire_queue(later), 1);
    let fin = finishes(&c.drain_outputs());
    match &fin[..] {
        [(1, Finish::Rejected(r))] => {
            assert_eq!(r.reason, RejectReason::QueueTimeout);
            assert!(
                r.message.contains("waited") && r.message.contains("decode group"),
                "{}",
                r.message
            );
            assert_eq!(r.blocks_free, 0, "the refusal's figures");
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(c.take_releases().seq_ids, vec![src]);
}

#[test]
fn a_failed_handoff_pull_is_recomputed_in_the_decode_group() {
    let mut c = disaggregated(CoreConfig::default());
    prefilled(&mut c);
    let l = handoff_lease(&mut c);
    c.apply_leases(vec![handoff_grant(l.seq_id)]);
    let batches = c.plan_forward();
    let mut answers = results(&batches[0].1, 8, false);
    answers[0].error = Some("the source worker went away".into());
    c.apply_forward(1, answers);
    // the prefill sequence (fenced) and the decode one (discarded) go back
    let failed = c.take_releases();
    assert!(failed.discard_unwritten);
    assert_eq!(failed.seq_ids, vec![l.seq_id]);
    c.releases_sent(failed);
    // requeued: leased again in the decode group, computing it all there
    c.begin_step();
    c.plan_extends(false);
    let leases = c.plan_admission();
    assert_eq!(leases.len(), 1);
    assert_eq!(leases[0].pool_group, "g1");
    assert_eq!(leases[0].handoff_of, None);
    assert_eq!(leases[0].prompt_tokens.len(), 11);
}

#[test]
fn a_request_cancelled_while_handing_off_finishes_once_and_both_leases_go_back() {
    let mut c = disaggregated(CoreConfig::default());
    let src = prefilled(&mut c);
    let l = handoff_lease(&mut c);
    c.cancel(RequestId(1), "client went away");
    c.apply_leases(vec![handoff_grant(l.seq_id)]);
    let fin = finishes(&c.drain_outputs());
    assert_eq!(fin.len(), 1, "{fin:?}");
    let mut released = c.take_releases().seq_ids;
    released.sort();
    assert_eq!(released, vec![src, l.seq_id]);
    assert!(c.plan_forward().is_empty());
}

#[test]
fn new_requests_are_admitted_to_prefill_groups_only() {
    let mut c = disaggregated(CoreConfig::default());
    for id in 1..=4 {
        c.submit(request(id, 10, 4));
    }
    c.begin_step();
    let leases = c.plan_admission();
    assert!(!leases.is_empty());
    assert!(leases.iter().all(|l| l.pool_group == "g0"), "{leases:?}");
}
