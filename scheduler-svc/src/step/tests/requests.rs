//! A request's life in the core: prefill (chunked) then decode to its
//! length or a stop token, what each extend tells the cache, speculative
//! decoding, reused prefixes with partial-block copies, and the queue's
//! maximum wait.

use super::*;

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
    let e = c.plan_extends(false);
    assert_eq!(
        e,
        vec![ExtendSpec {
            seq_id: SeqId(1),
            new_tokens: vec![7],
            written_tokens: 0,
            from_length: 4,
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
    let mut c = core_with(config);
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
    let extends = core.plan_extends(false);
    core.apply_extends(
        core.step(),
        extends.iter().map(|e| grant(e.seq_id)).collect(),
    );
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
    let mut c = core_with(config);
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
            from_length: 0,
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
            from_length: 10,
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
            from_length: 0,
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
    let mut c = core_with(config);
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

#[test]
fn a_stop_token_before_min_tokens_does_not_finish() {
    let mut c = core(Policy::MaxUtilization, 100);
    let mut r = request(1, 4, 10);
    r.stop_tokens = vec![5];
    r.sampling.min_tokens = 2;
    c.submit(r);
    let first = step_granting(&mut c, 5);
    assert_eq!(
        first[0].stop_ids,
        vec![5],
        "the worker holds the stop ids back"
    );
    assert_eq!(first[0].prompt_len, 4);
    step_granting(&mut c, 5);
    step_granting(&mut c, 5);
    let out = c.drain_outputs();
    assert_eq!(tokens_of(&out, 1), vec![5, 5, 5]);
    assert_eq!(finishes(&out), vec![(1, Finish::Stop)]);
}

#[test]
fn a_penalised_sequence_sends_its_history_on_its_first_pass_only() {
    let mut c = core(Policy::MaxUtilization, 100);
    let mut r = request(1, 4, 10);
    r.sampling.presence_penalty = 0.5;
    c.submit(r);
    c.submit(request(2, 4, 10));
    let first = step_granting(&mut c, 3);
    let history = |items: &[ForwardItem], id| {
        items
            .iter()
            .find(|i| i.seq_id == SeqId(id))
            .map(|i| i.history.clone())
    };
    assert_eq!(
        history(&first, 1),
        Some(Some(Vec::new())),
        "nothing before position 0"
    );
    assert_eq!(history(&first, 2), Some(None), "no penalty, no history");
    let second = step_granting(&mut c, 3);
    assert_eq!(
        history(&second, 1),
        Some(None),
        "the worker counts from there"
    );
}

#[test]
fn a_constrained_sequence_sends_its_history_on_its_first_pass_only() {
    use kvlease_tokenizer::grammar::Constraint;
    let mut c = core(Policy::MaxUtilization, 100);
    let mut r = request(1, 4, 10);
    r.sampling.grammar = Some(std::sync::Arc::new(Constraint::JsonObject));
    c.submit(r);
    let first = step_granting(&mut c, 3);
    assert_eq!(first[0].history, Some(Vec::new()), "with its grammar");
    assert!(first[0].sampling.grammar.is_some());
    let second = step_granting(&mut c, 3);
    assert_eq!(second[0].history, None, "the worker's matcher follows");
    assert!(second[0].sampling.grammar.is_some(), "still constrained");
}

#[test]
fn speculative_decode_feeds_drafts_and_extends_by_accepted_plus_one() {
    let config = CoreConfig {
        draft_k: 3,
        ..CoreConfig::default()
    };
    let mut c = core_with(config);
    // prompt 1 2 3 1 2: after the model emits 3, "2 3" was seen -> draft "1 2 ..."
    c.submit(Request::new(RequestId(1), vec![1, 2, 3, 1, 2], 10));
    c.begin_step();
    let leases = c.plan_admission();
    assert_eq!(leases[0].extra.draft, 3);
    grant_all(&mut c, &leases);
    let b = c.plan_forward();
    c.apply_forward(0, results(&b[0].1, 3, false));
    // decode: feed 3 with drafts from the earlier "2 3" -> "1 2 3"
    c.begin_step();
    let e = c.plan_extends(false);
    assert_eq!(e[0].new_tokens, vec![3]);
    c.apply_extends(c.step(), e.iter().map(|e| grant(e.seq_id)).collect());
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
    let e = c.plan_extends(false);
    assert_eq!(e[0].new_tokens, vec![1, 2, 3, 9]);
}

#[test]
fn drafts_never_overshoot_max_tokens() {
    let config = CoreConfig {
        draft_k: 4,
        ..CoreConfig::default()
    };
    let mut c = core_with(config);
    c.submit(Request::new(RequestId(1), vec![1, 2, 1, 2, 1, 2], 3));
    step_granting(&mut c, 1);
    c.begin_step();
    let e = c.plan_extends(false);
    c.apply_extends(c.step(), e.iter().map(|e| grant(e.seq_id)).collect());
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
    let mut c = core_with(config);
    for id in 1..=3 {
        c.submit(request(id, 2, 8));
    }
    step_granting(&mut c, 1); // three running sequences, now decoding
    c.submit(request(4, 20, 4));
    c.begin_step();
    let leases = c.plan_admission();
    grant_all(&mut c, &leases);
    let e = c.plan_extends(false);
    assert_eq!(e.len(), 3, "every running request still decodes this step");
    c.apply_extends(c.step(), e.iter().map(|e| grant(e.seq_id)).collect());
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

/// A grant reusing two full blocks (8 tokens) and copying 2 more slots.
fn grant_with_copy(seq_id: SeqId) -> Outcome {
    Outcome::Grant(Grant {
        reused_tokens: 10,
        capacity_tokens: 14,
        copies: vec![crate::domain::BlockCopy {
            pool_id: 1,
            window: 0,
            src_block: 5,
            dst_block: 7,
            tokens: 2,
        }],
        ..grant_of(seq_id, vec![0, 1, 7, 8])
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
    let mut c = core_with(config);
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

/// The one `QUEUE_TIMEOUT` message of a core whose request waited out
/// 500 ms, after `refused` Lease steps, with the session at the cache
/// `missing` when it timed out.
fn timed_out_message(refused: usize, missing: Option<&str>) -> String {
    let config = CoreConfig {
        max_queue_wait: Some(Duration::from_millis(500)),
        ..CoreConfig::default()
    };
    let mut c = core_with(config);
    let t0 = Instant::now();
    c.submit(request(1, 8, 4));
    assert_eq!(c.expire_queue(t0), 0); // stamps it
    for _ in 0..refused {
        step_with(&mut c, |e| grant(e.seq_id), |l| exhausted(l.seq_id), 7);
    }
    c.set_session_missing(missing.map(str::to_owned));
    assert_eq!(c.expire_queue(t0 + Duration::from_millis(501)), 1);
    match &finishes(&c.drain_outputs())[..] {
        [(_, Finish::Rejected(r))] if r.reason == RejectReason::QueueTimeout => r.message.clone(),
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_request_starved_by_a_missing_cache_session_says_so() {
    let down = Some("the cache service cannot be reached");
    // never leased: no refusal and no running request kept it waiting
    let m = timed_out_message(0, down);
    assert!(
        m.contains("the scheduler has no usable session at the cache (the cache service cannot be reached), so nothing could be leased"),
        "{m}"
    );
    assert!(!m.contains("running requests filled the step"), "{m}");
    // refused while the session was there, then the cache went away
    let m = timed_out_message(1, down);
    assert!(
        m.contains("no usable session at the cache (the cache service cannot be reached); before that, the cache's last refusal: pool exhausted"),
        "{m}"
    );
    // with a session, the answers are as before
    let m = timed_out_message(0, None);
    assert!(m.contains("running requests filled the step"), "{m}");
    let m = timed_out_message(1, None);
    assert!(
        m.contains("the cache's last refusal: pool exhausted"),
        "{m}"
    );
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
    let mut c = core_with(config);
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
