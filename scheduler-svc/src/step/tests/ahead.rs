//! Planning ahead (the overlap order with a pass in flight): a decode whose
//! step fits in the slots its lease covers launches before its extend is
//! answered; the extend, sent after the launch, grows the lease a step
//! ahead; a refused or missing extension holds back only its sequence.

use super::*;
use crate::policy::OnExhausted;

/// A grant of `blocks` covering `capacity` token slots.
fn grant_covering(seq_id: SeqId, blocks: Vec<u32>, capacity: u32) -> Outcome {
    Outcome::Grant(Grant {
        capacity_tokens: capacity,
        ..grant_of(seq_id, blocks)
    })
}

/// A core with one lookahead slot per lease and `on_exhausted`, with
/// requests 1 and 2 (4-token prompts: one block of 4) leased with one
/// block each and prefilled; their first tokens are 10 and 20.
fn two_decoding(on_exhausted: OnExhausted) -> Core {
    let mut c = Core::new(
        CoreConfig {
            lookahead: 1,
            on_exhausted,
            ..CoreConfig::default()
        },
        vec![group(100)],
    );
    c.submit(request(1, 4, 8));
    c.submit(request(2, 4, 8));
    c.begin_step();
    let leases = c.plan_admission();
    assert!(
        leases.iter().all(|l| l.extra.extra_decoding_steps == 1),
        "every lease keeps the lookahead slot: {leases:?}"
    );
    c.apply_leases(
        leases
            .iter()
            .map(|l| grant_covering(l.seq_id, vec![l.seq_id.get() as u32], 5))
            .collect(),
    );
    for (g, items) in c.plan_forward() {
        let results = items
            .iter()
            .map(|i| ForwardResult {
                seq_id: i.seq_id,
                next_token: 10 * i.seq_id.get() as u32,
                argmax: Vec::new(),
            })
            .collect();
        c.apply_forward(g, results);
    }
    c.drain_outputs();
    c
}

#[test]
fn a_decode_with_room_launches_before_its_extend_which_grows_the_lease_a_step_ahead() {
    let mut c = two_decoding(OnExhausted::Preempt);
    c.begin_step();
    // position 4 is the lookahead slot of the lease (5 slots): both run
    let extends = c.plan_extends(true);
    assert_eq!(
        extends,
        vec![
            ExtendSpec {
                seq_id: SeqId(1),
                new_tokens: vec![10],
                written_tokens: 0
            },
            ExtendSpec {
                seq_id: SeqId(2),
                new_tokens: vec![20],
                written_tokens: 0
            },
        ]
    );
    let batches = c.plan_forward();
    let launched: Vec<(u64, u32)> = batches[0]
        .1
        .iter()
        .map(|i| (i.seq_id.get(), i.start_pos))
        .collect();
    assert_eq!(launched, vec![(1, 4), (2, 4)]);
    // the extends, answered while the pass runs, grant the next block
    c.apply_extends(vec![
        grant_covering(SeqId(1), vec![11], 6),
        grant_covering(SeqId(2), vec![21], 6),
    ]);
    c.apply_forward(0, results(&batches[0].1, 7, false));
    c.begin_step();
    let extends = c.plan_extends(true);
    assert_eq!(extends.len(), 2, "the next fed tokens: {extends:?}");
    let batches = c.plan_forward();
    let tables: Vec<Vec<u32>> = batches[0]
        .1
        .iter()
        .map(|i| i.tables[0].block_ids.clone())
        .collect();
    assert_eq!(tables, vec![vec![1, 11], vec![2, 21]]);
}

#[test]
fn a_refused_extension_holds_back_its_sequence_alone_and_exhaustion_still_answers() {
    let mut c = two_decoding(OnExhausted::Reject);
    c.begin_step();
    c.plan_extends(true);
    let batches = c.plan_forward();
    assert_eq!(batches[0].1.len(), 2);
    // sent after the launch: sequence 2's growth is refused while its pass
    // runs; the pass had room and finishes
    c.apply_extends(vec![
        grant_covering(SeqId(1), vec![11], 6),
        exhausted(SeqId(2)),
    ]);
    assert!(
        c.drain_outputs().is_empty(),
        "nothing ends while the pass runs"
    );
    c.apply_forward(0, results(&batches[0].1, 7, false));
    assert_eq!(tokens_of(&c.drain_outputs(), 2), vec![7]);

    // no room for sequence 2's next token (6 > 5 slots): it sits this step
    // out and asks again for both tokens the cache has not seen
    c.begin_step();
    let extends = c.plan_extends(true);
    assert_eq!(
        extends,
        vec![
            ExtendSpec {
                seq_id: SeqId(1),
                new_tokens: vec![7],
                written_tokens: 0
            },
            ExtendSpec {
                seq_id: SeqId(2),
                new_tokens: vec![20, 7],
                written_tokens: 0
            },
        ]
    );
    let batches = c.plan_forward();
    let launched: Vec<u64> = batches[0].1.iter().map(|i| i.seq_id.get()).collect();
    assert_eq!(launched, vec![1], "only the sequence with room runs");

    // refused again, at rest: the pool's exhaustion is the request's answer
    c.apply_extends(vec![
        grant_covering(SeqId(1), vec![], 7),
        exhausted(SeqId(2)),
    ]);
    let out = c.drain_outputs();
    let ends = finishes(&out);
    assert_eq!(ends.len(), 1, "{out:?}");
    assert_eq!(ends[0].0, 2);
    assert!(
        matches!(&ends[0].1, Finish::Rejected(r) if r.reason == RejectReason::PoolExhausted),
        "{ends:?}"
    );
    // sequence 1 goes on
    c.apply_forward(0, results(&batches[0].1, 8, false));
    assert_eq!(tokens_of(&c.drain_outputs(), 1), vec![8]);
}

#[test]
fn a_granted_late_extension_lets_the_held_back_sequence_run_at_the_next_step() {
    let mut c = two_decoding(OnExhausted::Preempt);
    c.begin_step();
    c.plan_extends(true);
    let batches = c.plan_forward();
    c.apply_extends(vec![
        grant_covering(SeqId(1), vec![11], 6),
        exhausted(SeqId(2)),
    ]);
    c.apply_forward(0, results(&batches[0].1, 7, false));
    c.drain_outputs();
    c.begin_step();
    c.plan_extends(true);
    let batches = c.plan_forward();
    assert_eq!(batches[0].1.len(), 1);
    // this time the pool had a block: sequence 2 runs next step, on it
    c.apply_extends(vec![
        grant_covering(SeqId(1), vec![], 7),
        grant_covering(SeqId(2), vec![21], 7),
    ]);
    c.apply_forward(0, results(&batches[0].1, 8, false));
    assert!(finishes(&c.drain_outputs()).is_empty());
    c.begin_step();
    let extends = c.plan_extends(true);
    let reported: Vec<u64> = extends.iter().map(|e| e.seq_id.get()).collect();
    assert_eq!(
        reported,
        vec![1],
        "sequence 2's tokens are known: {extends:?}"
    );
    let batches = c.plan_forward();
    let launched: Vec<(u64, u32)> = batches[0]
        .1
        .iter()
        .map(|i| (i.seq_id.get(), i.start_pos))
        .collect();
    assert_eq!(launched, vec![(1, 6), (2, 5)]);
}
