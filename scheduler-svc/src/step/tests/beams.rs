//! Beam search on forks: the core feeds each beam the token the search
//! chose (never the worker's pick), asks every beam pass for its top
//! `2 * width` row, continues a beam in place, forks its other survivors
//! (the parent's context with their own last token), prunes and releases
//! the rest, and answers the best `n` hypotheses, equal to the rule of
//! `crate::beam` applied to exact contexts; exhaustion drops a beam.

use super::*;
use crate::beam::{self, Hypotheses, Hypothesis, Live};
use crate::domain::TokenLogprob;

const VOCAB: u32 = 6;
const STOP: u32 = 5;

/// The toy model's next-token log-softmax after `context`: fixed
/// pseudo-random logits per (context, token), the most likely first (ties
/// by lower id), as the worker's top list orders them.
fn row(context: &[u32]) -> Vec<(u32, f32)> {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &t in context {
        h = (h ^ u64::from(t)).wrapping_mul(0x0100_0000_01b3);
    }
    let logits: Vec<f64> = (0..VOCAB)
        .map(|t| {
            let x = (h ^ u64::from(t).wrapping_mul(0x9E37_79B9_7F4A_7C15))
                .wrapping_mul(0xBF58_476D_1CE4_E5B9);
            (x >> 40) as f64 / (1u64 << 24) as f64 * 4.0
        })
        .collect();
    let max = logits.iter().copied().fold(f64::MIN, f64::max);
    let sum: f64 = logits.iter().map(|l| (l - max).exp()).sum();
    let mut r: Vec<(u32, f32)> = logits
        .iter()
        .enumerate()
        .map(|(t, l)| (t as u32, (l - max - sum.ln()) as f32))
        .collect();
    r.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    r
}

/// The search done densely: `crate::beam`'s rule over exact contexts.
fn reference(prompt: &[u32], width: u32, max_tokens: u32) -> Vec<Hypothesis> {
    let mut live: Vec<(Vec<u32>, f64)> = vec![(Vec::new(), 0.0)];
    let mut hyps = Hypotheses::new(width);
    loop {
        live.sort_by(|a, b| b.1.total_cmp(&a.1));
        let rows: Vec<Vec<(u32, f32)>> = live
            .iter()
            .map(|(g, _)| {
                let mut c = prompt.to_vec();
                c.extend(g);
                row(&c)
            })
            .collect();
        let lives: Vec<Live<'_>> = live
            .iter()
            .zip(&rows)
            .map(|((g, lp), r)| Live {
                logprob: *lp,
                generated: g.len(),
                row: r,
            })
            .collect();
        let s = beam::select(width, &lives, &[STOP], max_tokens);
        for (c, stopped) in &s.ended {
            let mut tokens = live[c.beam].0.clone();
            tokens.push(c.token);
            hyps.add(Hypothesis {
                tokens,
                logprob: c.logprob,
                stopped: *stopped,
            });
        }
        let best = s
            .live
            .first()
            .map(|c| (c.logprob, live[c.beam].0.len() + 1));
        if hyps.is_done(best) {
            return hyps.ranked();
        }
        live = s
            .live
            .iter()
            .map(|c| {
                let mut g = live[c.beam].0.clone();
                g.push(c.token);
                (g, c.logprob)
            })
            .collect();
    }
}

fn beam_request(id: u64, prompt_len: usize, max_tokens: u32, width: u32, n: u32) -> Request {
    let mut r = request(id, prompt_len, max_tokens);
    r.beam_width = width;
    r.n = n;
    r.stop_tokens = vec![STOP];
    r
}

/// Runs the core to idle against the toy model: forks granted as the
/// cache grants them (or refused by `refuse_fork`), every pass answered
/// with its row and a worker pick the search must ignore; each step's
/// releases sent and the step completed. Returns the outputs, every
/// sequence leased and every one released.
struct Run {
    outputs: Vec<Output>,
    leased: Vec<SeqId>,
    released: Vec<SeqId>,
    forks: Vec<LeaseSpec>,
}

fn run(c: &mut Core, width: u32, refuse_fork: impl Fn(usize) -> bool) -> Run {
    let mut contexts: HashMap<SeqId, Vec<u32>> = HashMap::new();
    let mut out = Run {
        outputs: Vec::new(),
        leased: Vec::new(),
        released: Vec::new(),
        forks: Vec::new(),
    };
    let mut steps = 0;
    while !c.is_idle() {
        steps += 1;
        assert!(steps < 500, "the search never ended");
        let s = c.begin_step();
        let extends = c.plan_extends(false);
        c.apply_extends(c.step(), extends.iter().map(|e| grant(e.seq_id)).collect());
        let leases = c.plan_admission();
        let mut outcomes = Vec::new();
        for l in &leases {
            if l.fork_of.is_some() {
                let k = out.forks.len();
                out.forks.push(l.clone());
                if refuse_fork(k) {
                    outcomes.push(exhausted(l.seq_id));
                    continue;
                }
                outcomes.push(super::forks::fork_grant(l));
            } else {
                outcomes.push(grant(l.seq_id));
            }
            out.leased.push(l.seq_id);
            contexts.insert(l.seq_id, l.prompt_tokens.clone());
        }
        c.apply_leases(outcomes);
        for (g, items) in c.plan_forward() {
            let mut answers = Vec::new();
            for i in &items {
                assert!(!i.feed_previous, "a beam is never fed the worker's pick");
                let asked = i.logprobs.expect("a beam pass asks for its row");
                assert_eq!(asked.top, 2 * width);
                let ctx = contexts.get_mut(&i.seq_id).expect("leased");
                ctx.truncate(i.start_pos as usize);
                ctx.extend(&i.tokens);
                let r = row(ctx);
                answers.push(ForwardResult {
                    seq_id: i.seq_id,
                    // a pick the search must not use
                    next_token: STOP,
                    argmax: Vec::new(),
                    logprobs: vec![TokenLogprob {
                        token: STOP,
                        logprob: 0.0,
                        top: r.into_iter().take(asked.top as usize).collect(),
                    }],
                    error: None,
                });
            }
            c.apply_forward(g, answers);
        }
        let batch = c.take_releases();
        out.released.extend(&batch.seq_ids);
        c.releases_sent(batch);
        if let Some(done) = c.complete_through() {
            c.step_completed(done);
        }
        let _ = s;
        out.outputs.extend(c.drain_outputs());
    }
    out.outputs.extend(c.drain_outputs());
    out
}

/// One rank's answer: tokens, cumulative logprob, how it ended, whether
/// it was the request's last output.
type Answer<F> = (Vec<u32>, Option<f32>, F, bool);

fn answers(outputs: &[Output], n: usize) -> Vec<Answer<Finish>> {
    let mut by: Vec<Answer<Option<Finish>>> = vec![(Vec::new(), None, None, false); n];
    for o in outputs {
        match o {
            Output::Tokens { index, tokens, .. } => by[*index as usize].0.extend(tokens),
            Output::Finished {
                index,
                finish,
                cumulative_logprob,
                last,
                ..
            } => {
                let b = &mut by[*index as usize];
                assert!(b.2.is_none(), "rank {index} ended twice");
                b.1 = *cumulative_logprob;
                b.2 = Some(finish.clone());
                b.3 = *last;
            }
        }
    }
    by.into_iter()
        .map(|(t, lp, f, last)| (t, lp, f.expect("every rank ends"), last))
        .collect()
}

/// Answers every pass with a row of `top`.
fn answer_rows(c: &mut Core, top: &[(u32, f32)]) {
    for (g, items) in c.plan_forward() {
        let answers: Vec<ForwardResult> = items
            .iter()
            .map(|i| ForwardResult {
                seq_id: i.seq_id,
                next_token: 0,
                argmax: Vec::new(),
                logprobs: vec![TokenLogprob {
                    token: 0,
                    logprob: 0.0,
                    top: top.to_vec(),
                }],
                error: None,
            })
            .collect();
        c.apply_forward(g, answers);
    }
}

#[test]
fn beams_fork_diverge_end_and_answer_the_reference_search() {
    for (prompt_len, max_tokens) in [(6, 8), (9, 12), (3, 5)] {
        let mut c = core(Policy::MaxUtilization, 1000);
        c.submit(beam_request(1, prompt_len, max_tokens, 4, 3));
        let r = run(&mut c, 4, |_| false);
        let prompt = request(1, prompt_len, max_tokens).prompt;
        let want = reference(&prompt, 4, max_tokens);
        let got = answers(&r.outputs, 3);
        for (rank, (tokens, lp, finish, last)) in got.iter().enumerate() {
            let h = &want[rank];
            assert_eq!(tokens, &h.tokens, "rank {rank} (prompt {prompt_len})");
            let lp = lp.expect("a hypothesis carries its logprob");
            assert!(
                (f64::from(lp) - h.logprob).abs() < 1e-4,
                "{lp} vs {}",
                h.logprob
            );
            let f = if h.stopped {
                Finish::Stop
            } else {
                Finish::Length
            };
            assert_eq!(finish, &f);
            assert_eq!(*last, rank == 2);
        }
        // beams forked: each branch's context is its parent's with its own
        // last token, computed by the fork
        assert!(!r.forks.is_empty(), "no beam forked");
        for f in &r.forks {
            assert_eq!(f.prefill_tokens, 1);
            assert!(f.prompt_tokens.len() > prompt_len);
            assert_eq!(f.prompt_tokens[..prompt_len], prompt[..]);
        }
        // every sequence leased is released (pruned, finished or left)
        let mut leased = r.leased.clone();
        let mut released = r.released.clone();
        leased.sort_unstable();
        released.sort_unstable();
        assert_eq!(leased, released);
        assert_eq!(c.counters().finished_stop + c.counters().finished_length, 3);
    }
}

#[test]
fn a_refused_fork_drops_that_candidate_and_the_search_goes_on() {
    let mut c = core(Policy::MaxUtilization, 1000);
    c.submit(beam_request(1, 6, 8, 4, 2));
    // every other fork refused
    let r = run(&mut c, 4, |k| k % 2 == 0);
    let got = answers(&r.outputs, 2);
    assert!(r.forks.len() > 1);
    for (tokens, lp, finish, _) in &got {
        if matches!(finish, Finish::Stop | Finish::Length) {
            assert!(!tokens.is_empty());
            assert!(lp.is_some());
        } else {
            assert!(matches!(finish, Finish::Rejected(_)), "{finish:?}");
        }
    }
    let mut leased = r.leased.clone();
    let mut released = r.released.clone();
    leased.sort_unstable();
    released.sort_unstable();
    assert_eq!(
        leased, released,
        "refused forks hold nothing; the rest released"
    );
}

#[test]
fn every_fork_refused_leaves_the_root_beam() {
    // no fork ever granted: the root goes on alone, and answers what it
    // found; ranks no hypothesis fills are REJECTED with the refusal
    let mut c = core(Policy::MaxUtilization, 1000);
    c.submit(beam_request(1, 6, 8, 4, 4));
    let r = run(&mut c, 4, |_| true);
    let got = answers(&r.outputs, 4);
    assert!(
        matches!(got[0].2, Finish::Stop | Finish::Length),
        "{:?}",
        got[0].2
    );
    assert!(r.forks.len() > 1);
    for (tokens, lp, finish, _) in &got {
        let hypothesis = matches!(finish, Finish::Stop | Finish::Length);
        assert_eq!(hypothesis, lp.is_some());
        assert_eq!(hypothesis, !tokens.is_empty());
    }
    assert_eq!(r.leased, vec![SeqId(1)]);
    assert_eq!(r.released, vec![SeqId(1)]);
}

#[test]
fn a_cancelled_search_ends_every_rank_once_and_releases_every_beam() {
    let mut c = core(Policy::MaxUtilization, 1000);
    c.submit(beam_request(1, 6, 20, 3, 3));
    // prefill, then a step where beams fork
    for _ in 0..3 {
        c.begin_step();
        let e = c.plan_extends(false);
        c.apply_extends(c.step(), e.iter().map(|e| grant(e.seq_id)).collect());
        let leases = c.plan_admission();
        grant_all(&mut c, &leases);
        answer_rows(&mut c, &[(1, -0.5), (2, -0.6), (3, -0.7)]);
    }
    assert!(c.running() > 1, "beams forked");
    c.cancel(RequestId(1), "client went away");
    let out = c.drain_outputs();
    let got = answers(&out, 3);
    assert!(got.iter().all(|g| matches!(g.2, Finish::Cancelled(_))));
    assert!(c.is_idle());
    assert_eq!(c.counters().cancelled, 3);
}

#[test]
fn the_admission_charge_counts_every_beam() {
    // blocks of 4; a 6-token prompt (one full block shared) and 9 more
    // tokens: 4 blocks a beam's life, 1 shared, 3 per beam
    let g = group(100);
    let r = beam_request(1, 6, 10, 4, 1);
    let d = r.demand(Extra::default());
    assert_eq!(Policy::GuaranteedNoEvict.charge(&g, 0, d), 1 + 4 * 3);
    // a started beam is charged for itself
    let mut started = r.clone();
    started.generated.push(1);
    let d = started.demand(Extra::default());
    assert_eq!(Policy::GuaranteedNoEvict.charge(&g, 0, d), 4);
}

#[test]
fn a_search_left_with_no_beam_and_no_hypothesis_is_rejected_whole() {
    let mut c = core(Policy::MaxUtilization, 1000);
    c.submit(beam_request(1, 6, 20, 2, 2));
    // the root's prompt: its row chooses 1 (in place) and 2 (a fork)
    c.begin_step();
    let leases = c.plan_admission();
    grant_all(&mut c, &leases);
    answer_rows(&mut c, &[(1, -0.5), (2, -0.6)]);
    // the root cannot grow and its fork is refused: nothing is left
    c.begin_step();
    let e = c.plan_extends(false);
    assert_eq!(e.len(), 1);
    assert_eq!(
        e[0].new_tokens,
        vec![1],
        "the root is fed the token the search chose"
    );
    c.apply_extends(c.step(), vec![exhausted(e[0].seq_id)]);
    // the pool is full this step: the fork waits for the next
    assert!(c.plan_admission().is_empty());
    assert!(
        c.drain_outputs().is_empty(),
        "the fork is still owed its lease"
    );
    c.begin_step();
    let leases = c.plan_admission();
    assert_eq!(leases.len(), 1);
    assert_eq!(leases[0].fork_of, Some(SeqId(1)));
    assert_eq!(leases[0].prompt_tokens[6..], [2]);
    c.apply_leases(vec![exhausted(leases[0].seq_id)]);
    let got = answers(&c.drain_outputs(), 2);
    for (tokens, lp, finish, _) in &got {
        assert!(tokens.is_empty() && lp.is_none());
        let Finish::Rejected(r) = finish else {
            panic!("{finish:?}")
        };
        assert_eq!(r.reason, RejectReason::PoolExhausted);
    }
    let batch = c.take_releases();
    assert_eq!(batch.seq_ids, vec![SeqId(1)]);
    c.releases_sent(batch);
    assert!(c.is_idle());
}

#[test]
fn under_a_reserving_policy_a_refused_fork_waits_and_the_search_stays_exact() {
    // the blocks of beams pruned before it come back with their fences:
    // the fork is leased again (its parent held), no candidate is dropped
    let mut c = core(Policy::GuaranteedNoEvict, 1000);
    c.submit(beam_request(1, 6, 8, 4, 3));
    let r = run(&mut c, 4, |k| k < 3);
    let want = reference(&request(1, 6, 8).prompt, 4, 8);
    let got = answers(&r.outputs, 3);
    for (rank, (tokens, _, _, _)) in got.iter().enumerate() {
        assert_eq!(tokens, &want[rank].tokens, "rank {rank}");
    }
    let refused = &r.forks[..3];
    assert!(
        refused.iter().all(|f| r.forks[3..]
            .iter()
            .any(|g| g.prompt_tokens == f.prompt_tokens && g.fork_of == f.fork_of)),
        "every refused fork is leased again"
    );
    let mut leased = r.leased.clone();
    let mut released = r.released.clone();
    leased.sort_unstable();
    released.sort_unstable();
    assert_eq!(leased, released);
}
