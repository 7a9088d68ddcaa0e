//! Requests of several samples (`n`): the prompt prefilled and leased once,
//! the other samples forked from it once it is (each computing the last
//! prompt token and sampling with its own seed), one stream of outputs per
//! sample, and what happens when a fork is refused, cancelled or never
//! made.

use super::*;
use crate::domain::BlockCopy;
use crate::queue::branch_seed;

fn sampled(id: u64, prompt_len: usize, max_tokens: u32, n: u32) -> Request {
    let mut r = request(id, prompt_len, max_tokens);
    r.n = n;
    r.sampling.temperature = 1.0;
    r.sampling.seed = 99;
    r
}

/// A fork's grant as the cache gives it: every prompt token but the last
/// reused, the block holding it copied from the parent's.
pub(super) fn fork_grant(l: &LeaseSpec) -> Outcome {
    let n = l.prompt_tokens.len() as u32;
    let own = 100 + l.seq_id.get() as u32;
    let mut g = grant_of(l.seq_id, vec![1, own]);
    g.reused_tokens = n - 1;
    g.copies = vec![BlockCopy {
        pool_id: 1,
        window: 0,
        src_block: 2,
        dst_block: own,
        tokens: (n - 1) % 4,
    }];
    Outcome::Grant(g)
}

/// One step: extends granted, leases granted (forks as the cache grants
/// them), every sequence answered with its own token (`10 * seq + step`).
fn step(c: &mut Core, lease: impl Fn(&LeaseSpec) -> Outcome) -> (Vec<LeaseSpec>, Vec<ForwardItem>) {
    let s = c.begin_step();
    let extends = c.plan_extends(false);
    c.apply_extends(c.step(), extends.iter().map(|e| grant(e.seq_id)).collect());
    let leases = c.plan_admission();
    c.apply_leases(leases.iter().map(&lease).collect());
    let mut all = Vec::new();
    for (g, items) in c.plan_forward() {
        let answers: Vec<ForwardResult> = items
            .iter()
            .map(|i| ForwardResult {
                seq_id: i.seq_id,
                next_token: (10 * i.seq_id.get() + s.get()) as u32,
                argmax: Vec::new(),
                logprobs: Vec::new(),
                error: None,
            })
            .collect();
        c.apply_forward(g, answers);
        all.extend(items);
    }
    (leases, all)
}

fn granting(l: &LeaseSpec) -> Outcome {
    match l.fork_of {
        Some(_) => fork_grant(l),
        None => grant(l.seq_id),
    }
}

/// Each sample's tokens, by index.
fn samples(outputs: &[Output], n: usize) -> Vec<Vec<u32>> {
    let mut by = vec![Vec::new(); n];
    for o in outputs {
        if let Output::Tokens { index, tokens, .. } = o {
            by[*index as usize].extend(tokens);
        }
    }
    by
}

fn lasts(outputs: &[Output]) -> Vec<(u32, bool)> {
    outputs
        .iter()
        .filter_map(|o| match o {
            Output::Finished { index, last, .. } => Some((*index, *last)),
            Output::Tokens { .. } => None,
        })
        .collect()
}

#[test]
fn the_prompt_is_leased_once_and_the_samples_fork_from_it_after_its_prefill() {
    let mut c = core(Policy::MaxUtilization, 100);
    c.submit(sampled(1, 6, 3, 3));
    // step 1: one lease, one prefill of the whole prompt
    let (leases, items) = step(&mut c, granting);
    assert_eq!(leases.len(), 1);
    assert_eq!(leases[0].fork_of, None);
    assert_eq!((items.len(), items[0].tokens.len()), (1, 6));
    assert_eq!(items[0].sampling.seed, 99, "sample 0 keeps the seed");
    // step 2: the two other samples fork from it, each computing the last
    // prompt token with the copy of the partial block applied first
    let (leases, items) = step(&mut c, granting);
    assert_eq!(leases.len(), 2);
    for l in &leases {
        assert_eq!(l.fork_of, Some(SeqId(1)));
        assert_eq!(l.prompt_tokens, request(1, 6, 3).prompt);
        assert_eq!(l.prefill_tokens, 1);
        assert!(l.retain.is_none());
    }
    let forked: Vec<&ForwardItem> = items.iter().filter(|i| i.seq_id != SeqId(1)).collect();
    assert_eq!(forked.len(), 2);
    let mut seeds = vec![99];
    for (k, i) in forked.iter().enumerate() {
        assert_eq!(
            (i.start_pos, i.tokens.clone()),
            (5, vec![request(1, 6, 3).prompt[5]])
        );
        assert_eq!(
            i.copies.len(),
            1,
            "the copy on write runs in the fork's pass"
        );
        assert_eq!(i.sampling.seed, branch_seed(99, k as u32 + 1));
        seeds.push(i.sampling.seed);
    }
    seeds.sort_unstable();
    seeds.dedup();
    assert_eq!(seeds.len(), 3, "three samples, three seeds");
    while !c.is_idle() {
        step(&mut c, granting);
    }
    let out = c.drain_outputs();
    let by = samples(&out, 3);
    assert!(by.iter().all(|t| t.len() == 3), "{by:?}");
    assert_ne!(by[0], by[1]);
    // each sample ends on its own; the request's last output says so
    let l = lasts(&out);
    assert_eq!(l.len(), 3);
    assert_eq!(l.iter().filter(|(_, last)| *last).count(), 1);
    assert!(l.last().is_some_and(|(_, last)| *last));
    let mut ended: Vec<u32> = l.iter().map(|(i, _)| *i).collect();
    ended.sort_unstable();
    assert_eq!(ended, vec![0, 1, 2]);
}

#[test]
fn a_parent_that_ends_at_its_first_token_stays_leased_until_its_forks_are_answered() {
    let mut c = core(Policy::MaxUtilization, 100);
    c.submit(sampled(1, 6, 1, 2));
    step(&mut c, granting);
    // it ended LENGTH; its release waits for the fork
    assert!(!c.has_releases());
    assert!(c.take_releases().seq_ids.is_empty());
    assert!(!c.is_idle(), "a fork is waiting");
    let (leases, _) = step(&mut c, granting);
    assert_eq!(leases[0].fork_of, Some(SeqId(1)));
    let batch = c.take_releases();
    assert!(batch.seq_ids.contains(&SeqId(1)), "{batch:?}");
    while !c.is_idle() {
        step(&mut c, granting);
    }
    let out = c.drain_outputs();
    assert_eq!(
        samples(&out, 2).iter().map(Vec::len).collect::<Vec<_>>(),
        vec![1, 1]
    );
    assert_eq!(lasts(&out), vec![(0, false), (1, true)]);
}

#[test]
fn a_refused_fork_waits_in_the_queue_as_any_request() {
    let mut c = core(Policy::MaxUtilization, 100);
    c.submit(sampled(1, 6, 2, 2));
    step(&mut c, granting);
    let (leases, _) = step(&mut c, |l| match l.fork_of {
        Some(_) => exhausted(l.seq_id),
        None => grant(l.seq_id),
    });
    assert_eq!(leases.len(), 1);
    assert_eq!(c.queued(), 1, "the refused sample waits");
    // leased later as an ordinary request (its parent may be gone)
    let (leases, _) = step(&mut c, granting);
    assert_eq!(leases.len(), 1);
    assert_eq!((leases[0].fork_of, leases[0].prefill_tokens), (None, 6));
    while !c.is_idle() {
        step(&mut c, granting);
    }
    let out = c.drain_outputs();
    assert_eq!(
        samples(&out, 2).iter().map(Vec::len).collect::<Vec<_>>(),
        vec![2, 2]
    );
    assert_eq!(lasts(&out).iter().filter(|(_, l)| *l).count(), 1);
}

#[test]
fn cancelling_a_request_ends_every_sample_wherever_it_is() {
    let mut c = core(Policy::MaxUtilization, 100);
    c.submit(sampled(1, 6, 8, 4));
    step(&mut c, granting);
    // forks waiting (not leased yet), the parent running
    c.cancel(RequestId(1), "client went away");
    let out = c.drain_outputs();
    let l = lasts(&out);
    assert_eq!(l.len(), 4);
    assert_eq!(l.iter().filter(|(_, last)| *last).count(), 1);
    assert!(c.is_idle());
    assert_eq!(c.take_releases().seq_ids, vec![SeqId(1)]);
}

#[test]
fn a_request_refused_before_its_prefill_ends_all_its_samples() {
    let mut c = core(Policy::MaxUtilization, 2);
    // 40 tokens cannot fit 2 blocks of 4
    c.submit(sampled(1, 40, 2, 3));
    let out = c.drain_outputs();
    assert_eq!(lasts(&out), vec![(0, false), (1, false), (2, true)]);
    assert!(
        finishes(&out)
            .iter()
            .all(|(_, f)| matches!(f, Finish::Rejected(_)))
    );
}

#[test]
fn guaranteed_no_evict_charges_the_samples_their_shared_prompt_once() {
    // 10 blocks of 4; a 9-token prompt shares 2 blocks; a life of 9 + 7
    // tokens is 4 blocks: 3 samples take 2 + 3 x 2 = 8
    let mut c = core(Policy::GuaranteedNoEvict, 10);
    c.submit(sampled(1, 9, 8, 3));
    c.submit(sampled(2, 9, 8, 3));
    let (leases, _) = step(&mut c, granting);
    assert_eq!(
        leases.len(),
        1,
        "the second request's samples would not fit"
    );
    assert_eq!(c.queued(), 1);
    // forked, the samples are charged the same 8: still no room
    step(&mut c, granting);
    assert_eq!(c.running(), 3);
    assert_eq!(c.queued(), 1);
    while c.queued() > 0 || c.running() > 0 {
        step(&mut c, granting);
    }
    let out = c.drain_outputs();
    assert_eq!(lasts(&out).iter().filter(|(_, l)| *l).count(), 2);
}

#[test]
fn a_sample_the_client_stopped_reading_ends_alone_and_is_released() {
    let mut c = core(Policy::MaxUtilization, 100);
    c.submit(sampled(1, 6, 8, 3));
    // the prompt, then the forks
    step(&mut c, granting);
    step(&mut c, granting);
    let branch_1 = c
        .running
        .values()
        .find(|s| s.request.index == 1)
        .map(|s| s.seq_id)
        .expect("sample 1 forked");
    c.drain_outputs();
    // its text ended at a stop string: only it ends, STOP, and is released
    c.end_branch(RequestId(1), 1);
    let out = c.drain_outputs();
    assert_eq!(lasts(&out), vec![(1, false)]);
    assert!(matches!(
        out.last(),
        Some(Output::Finished {
            finish: Finish::Stop,
            ..
        })
    ));
    assert_eq!(c.take_releases().seq_ids, vec![branch_1]);
    // asking again (the loop may) changes nothing
    c.end_branch(RequestId(1), 1);
    assert!(c.drain_outputs().is_empty());
    // the others go on to their length
    let mut rest = Vec::new();
    while !c.is_idle() {
        step(&mut c, granting);
        rest.extend(c.drain_outputs());
    }
    let by = samples(&rest, 3);
    assert!(by[1].is_empty(), "sample 1 made nothing more");
    assert!(by[0].len() + 2 >= 8 && !by[2].is_empty(), "{by:?}");
    let l = lasts(&rest);
    assert_eq!(l.len(), 2);
    assert!(l.last().is_some_and(|(_, last)| *last));
}
