//! Steps and fences, the founding rule: each release's fence, when a step
//! may be reported complete, releases and completions the cache did not
//! acknowledge, and the cache's batch limit on every call.

use super::*;

#[test]
fn steps_continue_after_warm_up() {
    let mut c = core(Policy::MaxUtilization, 100);
    c.continue_after(Step(7));
    assert_eq!(c.begin_step(), Step(8));
    assert_eq!(c.begin_step(), Step(9));
    assert_eq!(c.step(), Step(9));
}

#[test]
fn overlap_a_sequence_ended_mid_pass_is_released_once_the_pass_returned_fenced_at_its_step() {
    let mut c = core(Policy::MaxUtilization, 100);
    c.submit(request(1, 4, 8));
    c.submit(request(2, 4, 8));
    let first = c.begin_step();
    let leases = c.plan_admission();
    grant_all(&mut c, &leases);
    let batches = c.plan_forward();
    assert_eq!(c.forward_in_flight(), Some(first));
    // the client of request 1 goes away while forward `first` writes its
    // blocks: whether they may publish depends on how that pass ends
    c.cancel(RequestId(1), "gone");
    let next = c.begin_step();
    assert!(c.take_releases().is_empty(), "its pass is in flight");
    assert_eq!(c.complete_through(), None, "forward {first} is in flight");
    c.apply_forward(batches[0].0, results(&batches[0].1, 7, false));
    assert_eq!(c.forward_in_flight(), None);
    let batch = c.take_releases();
    assert_eq!(batch.seq_ids, vec![SeqId(1)]);
    assert_eq!(batch.fence_step, Some(first), "{batch:?}");
    assert!(!batch.discard_unwritten, "its pass wrote what it was to");
    c.releases_sent(batch);
    assert_eq!(c.complete_through(), Some(first));
    c.step_completed(first);
    assert_eq!(c.complete_through(), None);
    assert!(next > first);
}

/// Sequence 1 is released with `discard_unwritten`, and no step is
/// reported complete before that release is sent; then one is (returned).
fn discarded_then_complete(c: &mut Core) -> Step {
    assert_eq!(c.complete_through(), None, "not before the discard");
    let batch = c.take_releases();
    assert_eq!(
        (batch.seq_ids.clone(), batch.discard_unwritten),
        (vec![SeqId(1)], true),
        "{batch:?}"
    );
    c.releases_sent(batch);
    let step = c.complete_through();
    assert!(step.is_some(), "a step completes after the discard");
    step.unwrap_or_default()
}

#[test]
fn a_sequence_ended_mid_pass_whose_pass_fails_is_released_discarding_what_it_did_not_write() {
    let order = Order::pipelined();
    let mut c = Core::new(
        CoreConfig {
            lookahead: order.lookahead(),
            order,
            prefill_chunk: 2,
            ..CoreConfig::default()
        },
        vec![group(100)],
    );
    c.submit(request(1, 6, 8));
    c.begin_step();
    let leases = c.plan_admission();
    grant_all(&mut c, &leases);
    // chunk 0..2 in pass A; chunk 2..4 in pass B, whose progress report
    // (written 4) the cache hears before B returns
    let a = c.plan_forward();
    c.begin_step();
    let planned = c.plan_extends(true);
    let b = c.plan_forward();
    assert_eq!(b[0].1.len(), 1, "B runs the second chunk");
    c.apply_forward(a[0].0, results(&a[0].1, 7, false));
    assert_eq!(
        c.settle_extends(planned)
            .iter()
            .map(|e| e.written_tokens)
            .collect::<Vec<_>>(),
        vec![4]
    );
    // the client goes away while B runs, then B fails: the cache must not
    // publish what B was to write
    c.cancel(RequestId(1), "gone");
    assert!(c.take_releases().is_empty(), "B is in flight");
    c.forward_failed(b[0].0, "worker down");
    discarded_then_complete(&mut c);
}

#[test]
fn a_sequence_its_pass_answered_nothing_for_is_released_discarding_and_not_held() {
    let mut c = core(Policy::MaxUtilization, 100);
    c.submit(request(1, 4, 8));
    c.begin_step();
    let leases = c.plan_admission();
    grant_all(&mut c, &leases);
    let batches = c.plan_forward();
    // the worker's answer names no result for sequence 1
    c.apply_forward(batches[0].0, Vec::<ForwardResult>::new());
    let step = discarded_then_complete(&mut c);
    c.step_completed(step);
    assert!(c.is_quiet(), "nothing held back");
}

#[test]
fn an_ended_sequence_its_pass_did_not_run_is_released_discarding() {
    for error in [false, true] {
        let mut c = core(Policy::MaxUtilization, 100);
        c.submit(request(1, 4, 8));
        c.submit(request(2, 4, 8));
        c.begin_step();
        let leases = c.plan_admission();
        grant_all(&mut c, &leases);
        let batches = c.plan_forward();
        c.cancel(RequestId(1), "gone");
        // the pass comes back without sequence 1, or with an error for it
        // (its peer pull failed): it wrote nothing of 1's
        let mut answer = results(&batches[0].1, 7, false);
        if error {
            answer[0].error = Some("pull failed".into());
        } else {
            answer.retain(|r| r.seq_id != SeqId(1));
        }
        c.apply_forward(batches[0].0, answer);
        discarded_then_complete(&mut c);
    }
}

#[test]
fn plain_releases_after_a_forward_are_fenced_at_it_and_its_step_completes() {
    let mut c = core(Policy::MaxUtilization, 100);
    c.submit(request(1, 4, 1));
    let step = c.begin_step();
    let leases = c.plan_admission();
    grant_all(&mut c, &leases);
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
    grant_all(&mut c, &leases);
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
    let (mut c, step, batches) = two_passes(8);
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
    // one token each: the request whose pass returns finishes at once
    let (mut c, step, batches) = two_passes(1);
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
    let e = c.plan_extends(false);
    c.apply_extends(c.step(), e.iter().map(|e| grant(e.seq_id)).collect());
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
    grant_all(&mut c, &leases);
    // request 1 ends before its first pass; request 2's pass is in flight
    c.cancel(RequestId(1), "gone");
    let batches = c.plan_forward();
    let batch = c.take_releases();
    assert_eq!(
        (batch.seq_ids.clone(), batch.fence_step),
        (vec![SeqId(1)], Some(step))
    );
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
    assert!(
        c.take_released().is_empty(),
        "the cache may have leased them (the answer lost): released first"
    );
    let batch = c.take_releases();
    assert_eq!(batch.seq_ids, vec![SeqId(5), SeqId(6)]);
    assert!(batch.discard_unwritten, "no pass wrote their prompts");
    c.releases_sent(batch);
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
    grant_all(&mut c, &leases);
    c.cancel(RequestId(3), "gone");
    c.leases_lost(
        true,
        "stale epoch 1: the cache service restarted, current epoch is 2",
    );
    let mut released = c.take_released();
    released.sort_unstable();
    assert_eq!(released, vec![SeqId(7), SeqId(8)]);
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
    grant_all(&mut c, &leases);
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
    c.leases_lost(
        true,
        "stale epoch 1: the cache service restarted, current epoch is 2",
    );
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
    let e = c.plan_extends(false);
    c.apply_extends(c.step(), e.iter().map(|e| grant(e.seq_id)).collect());
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
        grant_all(&mut c, &leases);
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
    let extends = c.plan_extends(false);
    assert_eq!(extends.len(), 3);
    // the first call (two items) answered, the second failed
    c.apply_extends(
        c.step(),
        extends[..2].iter().map(|e| grant(e.seq_id)).collect(),
    );
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
    let next = c.plan_extends(false);
    assert_eq!(next.len(), 3);
    for e in &next {
        assert_eq!(e.new_tokens.len(), 1, "one new token each: {e:?}");
    }
}
