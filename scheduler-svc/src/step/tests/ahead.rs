//! Planning ahead (the overlap order with a pass in flight): a decode whose
//! step fits in the slots its lease covers launches before its extend is
//! answered; the extend, sent after the launch, grows the lease a step
//! ahead; a refused or missing extension holds back only its sequence.
//! The pipelined order likewise, with a second pass fed the first one's
//! samples.

use super::*;
use crate::policy::OnExhausted;
use crate::step::Order;

/// A grant of `blocks` covering `capacity` token slots.
fn grant_covering(seq_id: SeqId, blocks: Vec<u32>, capacity: u32) -> Outcome {
    Outcome::Grant(Grant {
        capacity_tokens: capacity,
        ..grant_of(seq_id, blocks)
    })
}

/// A core in `order` (its lookahead slots per lease) and `on_exhausted`,
/// with requests 1 and 2 (4-token prompts: one block of 4, stopping on
/// token 99) leased with one block each, covering the prompt and the
/// lookahead, and prefilled; their first tokens are 10 and 20.
fn decoding_pair(order: Order, on_exhausted: OnExhausted) -> Core {
    let lookahead = order.lookahead();
    let mut c = Core::new(
        CoreConfig {
            lookahead,
            order,
            on_exhausted,
            ..CoreConfig::default()
        },
        vec![group(100)],
    );
    for id in [1, 2] {
        let mut r = request(id, 4, 8);
        r.stop_tokens = vec![99];
        c.submit(r);
    }
    c.begin_step();
    let leases = c.plan_admission();
    assert!(
        leases
            .iter()
            .all(|l| l.extra.extra_decoding_steps == lookahead),
        "every lease keeps the lookahead slots: {leases:?}"
    );
    c.apply_leases(
        leases
            .iter()
            .map(|l| grant_covering(l.seq_id, vec![l.seq_id.get() as u32], 4 + lookahead))
            .collect(),
    );
    for (g, items) in c.plan_forward() {
        let results: Vec<ForwardResult> = items
            .iter()
            .map(|i| ForwardResult {
                seq_id: i.seq_id,
                next_token: 10 * i.seq_id.get() as u32,
                argmax: Vec::new(),
                logprobs: Vec::new(),
                error: None,
            })
            .collect();
        c.apply_forward(g, results);
    }
    c.drain_outputs();
    c
}

/// [`decoding_pair`] in the overlap order: leases covering 5 slots.
fn two_decoding(on_exhausted: OnExhausted) -> Core {
    decoding_pair(Order::Overlap, on_exhausted)
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
                written_tokens: 0,
                from_length: 4,
            },
            ExtendSpec {
                seq_id: SeqId(2),
                new_tokens: vec![20],
                written_tokens: 0,
                from_length: 4,
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
    c.apply_extends(
        c.step(),
        vec![
            grant_covering(SeqId(1), vec![11], 6),
            grant_covering(SeqId(2), vec![21], 6),
        ],
    );
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
    c.apply_extends(
        c.step(),
        vec![grant_covering(SeqId(1), vec![11], 6), exhausted(SeqId(2))],
    );
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
                written_tokens: 0,
                from_length: 5,
            },
            ExtendSpec {
                seq_id: SeqId(2),
                new_tokens: vec![20, 7],
                written_tokens: 0,
                from_length: 4,
            },
        ]
    );
    let batches = c.plan_forward();
    let launched: Vec<u64> = batches[0].1.iter().map(|i| i.seq_id.get()).collect();
    assert_eq!(launched, vec![1], "only the sequence with room runs");

    // refused again, at rest: the pool's exhaustion is the request's answer
    c.apply_extends(
        c.step(),
        vec![grant_covering(SeqId(1), vec![], 7), exhausted(SeqId(2))],
    );
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

/// [`two_decoding`] after one step of both, sequence 2's extension (sent
/// after the launch) refused: its pass ran (token 7 for both), and it has
/// no room for its next token.
fn one_held_back(on_exhausted: OnExhausted) -> Core {
    let mut c = two_decoding(on_exhausted);
    c.begin_step();
    c.plan_extends(true);
    let batches = c.plan_forward();
    c.apply_extends(
        c.step(),
        vec![grant_covering(SeqId(1), vec![11], 6), exhausted(SeqId(2))],
    );
    c.apply_forward(0, results(&batches[0].1, 7, false));
    c.drain_outputs();
    c
}

#[test]
fn a_granted_late_extension_lets_the_held_back_sequence_run_at_the_next_step() {
    let mut c = one_held_back(OnExhausted::Preempt);
    c.begin_step();
    c.plan_extends(true);
    let batches = c.plan_forward();
    assert_eq!(batches[0].1.len(), 1);
    // this time the pool had a block: sequence 2 runs next step, on it
    c.apply_extends(
        c.step(),
        vec![
            grant_covering(SeqId(1), vec![], 7),
            grant_covering(SeqId(2), vec![21], 7),
        ],
    );
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

/// [`decoding_pair`] in the pipelined order: two lookahead slots, leases
/// covering 6 slots, sequences 1 and 2 decoding from position 4.
fn two_pipelined(on_exhausted: OnExhausted) -> Core {
    decoding_pair(Order::pipelined(), on_exhausted)
}

/// Plans and launches the next pipelined pass: `(seq, start, fed)` of each item.
fn launch(c: &mut Core) -> (Vec<(u64, u32, bool)>, Vec<ForwardItem>) {
    c.begin_step();
    c.plan_extends(true);
    let mut batches = c.plan_forward();
    let items = batches.pop().map(|(_, items)| items).unwrap_or_default();
    let seen = items
        .iter()
        .map(|i| (i.seq_id.get(), i.start_pos, i.feed_previous))
        .collect();
    (seen, items)
}

fn report(seq_id: u64, from_length: u32, new_tokens: Vec<u32>) -> ExtendSpec {
    ExtendSpec {
        seq_id: SeqId(seq_id),
        new_tokens,
        written_tokens: 0,
        from_length,
    }
}

#[test]
fn pipelined_a_second_pass_feeds_the_first_ones_samples_and_a_refused_extension_holds_back_its_sequence_alone()
 {
    let mut c = two_pipelined(OnExhausted::Reject);
    let (a, a_items) = launch(&mut c);
    assert_eq!(
        a,
        vec![(1, 4, false), (2, 4, false)],
        "the tokens are known"
    );
    let step_a = c.step();
    // the second pass goes in before the first is back: fed, one position on
    let (b, b_items) = launch(&mut c);
    assert_eq!(b, vec![(1, 5, true), (2, 5, true)]);
    assert!(b_items.iter().all(|i| i.tokens.is_empty()));
    assert_eq!(
        c.follows(0),
        Some(step_a),
        "the worker runs it after pass A"
    );
    let step_b = c.step();
    // nothing more fits: two passes in flight
    let (none, _) = launch(&mut c);
    assert!(none.is_empty());

    // pass A is back: the settle reports the tokens it told; sequence 2's
    // growth is refused while its pass B runs, and only holds it back
    c.apply_forward(0, results(&a_items, 7, false));
    assert_eq!(tokens_of(&c.drain_outputs(), 1), vec![7]);
    let extends = c.settle_extends(Vec::new());
    assert_eq!(
        extends,
        vec![report(1, 4, vec![10, 7]), report(2, 4, vec![20, 7])]
    );
    c.apply_extends(
        c.step(),
        vec![grant_covering(SeqId(1), vec![11], 8), exhausted(SeqId(2))],
    );
    assert!(
        finishes(&c.drain_outputs()).is_empty(),
        "nothing ends while B runs"
    );
    let (cc, c_items) = launch(&mut c);
    assert_eq!(
        cc,
        vec![(1, 6, true)],
        "sequence 2 has no room for position 6"
    );
    let step_c = c.step();

    // pass B is back; sequence 2, at rest now, is refused again: its answer
    c.apply_forward(0, results(&b_items, 8, false));
    let extends = c.settle_extends(Vec::new());
    // sequence 2 has no pass in flight: it reports only the tokens whose KV
    // is written (8 is sampled, its KV not written by any pass)
    assert_eq!(
        extends,
        vec![report(1, 6, vec![8]), report(2, 4, vec![20, 7])]
    );
    c.apply_extends(
        c.step(),
        vec![grant_covering(SeqId(1), vec![], 9), exhausted(SeqId(2))],
    );
    let out = c.drain_outputs();
    assert_eq!(tokens_of(&out, 2), vec![8]);
    let ends = finishes(&out);
    assert!(
        matches!(&ends[..], [(2, Finish::Rejected(r))] if r.reason == RejectReason::PoolExhausted),
        "{ends:?}"
    );
    // released behind pass C, the newest in flight
    let batch = c.take_releases();
    assert_eq!(
        (batch.seq_ids, batch.fence_step),
        (vec![SeqId(2)], Some(step_c))
    );
    assert!(c.complete_through().is_some_and(|s| s == step_b));
    c.apply_forward(0, results(&c_items, 9, false));
    assert_eq!(tokens_of(&c.drain_outputs(), 1), vec![9]);
}

#[test]
fn pipelined_a_sequence_that_stops_with_a_pass_in_flight_is_released_behind_it_and_its_result_dropped()
 {
    let mut c = two_pipelined(OnExhausted::Preempt);
    let (_, a_items) = launch(&mut c);
    let step_a = c.step();
    let (_, b_items) = launch(&mut c);
    let step_b = c.step();
    // sequence 1 samples its stop token in pass A; pass B ran it anyway
    let mut answer = results(&a_items, 7, false);
    answer[0].next_token = 99;
    c.apply_forward(0, answer);
    let out = c.drain_outputs();
    assert_eq!(finishes(&out), vec![(1, Finish::Stop)]);
    assert!(
        c.take_releases().is_empty(),
        "released once pass B, which runs it, is back"
    );
    assert_eq!(c.complete_through(), Some(step_a), "pass B is in flight");
    c.apply_forward(0, results(&b_items, 8, false));
    let out = c.drain_outputs();
    assert_eq!(
        tokens_of(&out, 1),
        Vec::<u32>::new(),
        "its B result is dropped"
    );
    assert_eq!(tokens_of(&out, 2), vec![8]);
    let batch = c.take_releases();
    assert_eq!(
        (batch.seq_ids, batch.fence_step, batch.discard_unwritten),
        (vec![SeqId(1)], Some(step_b), false),
        "fenced at pass B, not yet complete"
    );
    assert_eq!(c.complete_through(), Some(step_b));
}

#[test]
fn pipelined_three_deep_each_pass_feeds_the_one_before_and_a_stop_drops_the_two_behind_it() {
    let depth = 3;
    let mut c = decoding_pair(Order::Pipelined { depth }, OnExhausted::Preempt);
    // leases cover 4 + 3 slots: positions 4, 5 and 6 run before any answer
    let (a, a_items) = launch(&mut c);
    assert_eq!(a, vec![(1, 4, false), (2, 4, false)]);
    let step_a = c.step();
    let (b, b_items) = launch(&mut c);
    assert_eq!(b, vec![(1, 5, true), (2, 5, true)]);
    assert_eq!(c.follows(0), Some(step_a));
    let step_b = c.step();
    let (third, c_items) = launch(&mut c);
    assert_eq!(third, vec![(1, 6, true), (2, 6, true)]);
    assert_eq!(c.follows(0), Some(step_b), "pass C follows B, not A");
    let step_c = c.step();
    let (none, _) = launch(&mut c);
    assert!(none.is_empty(), "three passes in flight: the depth");

    // pass A is back: sequence 1 stopped there, B and C ran it anyway
    let mut answer = results(&a_items, 7, false);
    answer[0].next_token = 99;
    c.apply_forward(0, answer);
    let out = c.drain_outputs();
    assert_eq!(finishes(&out), vec![(1, Finish::Stop)]);
    assert_eq!(tokens_of(&out, 2), vec![7]);
    assert!(c.take_releases().is_empty(), "B and C run it still");
    assert_eq!(c.complete_through(), Some(step_a));
    // the settle reports what KV passes write through the token B is fed
    // and grows the lease three slots past it
    assert_eq!(
        c.settle_extends(Vec::new()),
        vec![report(2, 4, vec![20, 7])]
    );
    c.apply_extends(c.step(), vec![grant_covering(SeqId(2), vec![21], 9)]);
    let (d, d_items) = launch(&mut c);
    assert_eq!(d, vec![(2, 7, true)], "sequence 2 goes on past C");
    let step_d = c.step();
    assert_eq!(c.follows(0), Some(step_c));

    // B and C come back: sequence 1's results are dropped, and it is
    // released behind D, which is in flight
    c.apply_forward(0, results(&b_items, 8, false));
    assert!(c.take_releases().is_empty(), "C runs it still");
    c.apply_forward(0, results(&c_items, 9, false));
    let out = c.drain_outputs();
    assert_eq!(tokens_of(&out, 1), Vec::<u32>::new());
    assert_eq!(tokens_of(&out, 2), vec![8, 9]);
    let batch = c.take_releases();
    assert_eq!(
        (batch.seq_ids, batch.fence_step),
        (vec![SeqId(1)], Some(step_d))
    );
    assert_eq!(c.complete_through(), Some(step_c));
    c.apply_forward(0, results(&d_items, 10, false));
    assert_eq!(tokens_of(&c.drain_outputs(), 2), vec![10]);
    assert_eq!(c.complete_through(), Some(step_d));
}

/// A growth the cache applied though its call failed (the answer lost) is
/// refused `LENGTH_MISMATCH` when the sequence grows again from the same
/// length: the sequence is recomputed. With its pass in flight, which
/// wrote what the growth reported, it is released once the pass returns;
/// at rest, discarding what no pass wrote.
#[test]
fn a_growth_whose_answer_was_lost_is_refused_when_sent_again_and_its_sequence_recomputes() {
    let mut c = two_decoding(OnExhausted::Reject);
    c.begin_step();
    c.plan_extends(true);
    let batches = c.plan_forward();
    assert_eq!(batches[0].1.len(), 2);
    // sent after the launch: sequence 2's length is not the cache's
    c.apply_extends(
        c.step(),
        vec![
            grant_covering(SeqId(1), vec![11], 6),
            reject(SeqId(2), RejectReason::LengthMismatch),
        ],
    );
    assert_eq!(c.counters().preempted_by(PreemptCause::LengthMismatch), 1);
    assert_eq!(c.queued(), 1, "requeued for recompute");
    assert!(
        c.take_releases().is_empty(),
        "not while its pass is in flight"
    );
    c.apply_forward(0, results(&batches[0].1, 7, false));
    let release = c.take_releases();
    assert_eq!(release.seq_ids, vec![SeqId(2)]);
    assert!(
        !release.discard_unwritten,
        "its pass wrote what it reported"
    );
    c.releases_sent(release);

    // sequence 1 has room for one more token; its extend's call fails
    c.begin_step();
    c.plan_extends(true);
    let batches = c.plan_forward();
    let launched: Vec<u64> = batches[0].1.iter().map(|i| i.seq_id.get()).collect();
    assert_eq!(launched, vec![1]);
    c.apply_extends(c.step(), Vec::new());
    c.extends_failed();
    c.apply_forward(0, results(&batches[0].1, 8, false));
    c.drain_outputs();
    // no room now: it grows again from the length the cache had before
    c.begin_step();
    let extends = c.plan_extends(true);
    assert_eq!(
        extends,
        vec![ExtendSpec {
            seq_id: SeqId(1),
            new_tokens: vec![7, 8],
            written_tokens: 0,
            from_length: 5,
        }]
    );
    assert!(c.plan_forward().is_empty(), "no room: nothing runs");
    // the failed call had been applied: refused, at rest
    c.apply_extends(
        c.step(),
        vec![reject(SeqId(1), RejectReason::LengthMismatch)],
    );
    assert_eq!(c.counters().preempted_by(PreemptCause::LengthMismatch), 2);
    let release = c.take_releases();
    assert_eq!(release.seq_ids, vec![SeqId(1)]);
    assert!(
        release.discard_unwritten,
        "the cache holds tokens no pass may have written"
    );
}

/// A decode with no room sits its step out, and its extend reports the
/// token that step would have fed, whose KV no pass has written: a request
/// that ends then (cancelled) is released discarding, so the cache never
/// publishes a block with that slot unwritten.
#[test]
fn a_sequence_ended_after_reporting_a_token_no_pass_wrote_is_released_discarding() {
    let mut c = one_held_back(OnExhausted::Reject);
    // no room for sequence 2: its extend reports 20 (written) and 7 (not)
    c.begin_step();
    let extends = c.plan_extends(true);
    assert_eq!(extends[1].new_tokens, vec![20, 7], "{extends:?}");
    let batches = c.plan_forward();
    assert_eq!(batches[0].1.len(), 1, "only sequence 1 runs");
    c.apply_extends(
        c.step(),
        vec![
            grant_covering(SeqId(1), vec![], 7),
            grant_covering(SeqId(2), vec![22], 6),
        ],
    );
    c.cancel(RequestId(2), "gone");
    let release = c.take_releases();
    assert_eq!(release.seq_ids, vec![SeqId(2)]);
    assert!(release.discard_unwritten, "{release:?}");
    // one that ends at its KV's end is released plainly
    c.apply_forward(0, results(&batches[0].1, 8, false));
    c.releases_sent(release);
    c.cancel(RequestId(1), "gone");
    let release = c.take_releases();
    assert_eq!(release.seq_ids, vec![SeqId(1)]);
    assert!(!release.discard_unwritten, "{release:?}");
}
