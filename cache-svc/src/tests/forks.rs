//! Forks (`SeqSpec::fork_of`): branches of a held sequence share its blocks
//! before their last prompt token by reference, copy the block holding it
//! on write, diverge, end and are pruned with fenced releases, and running
//! out of blocks while forking is a reject that takes nothing.

use super::{Fixture, spec, tokens, whole};
use crate::error::Error;
use crate::ids::SeqId;
use crate::lease::{BlockCopy, Growth, Prompt, RejectReason, SeqSpec};
use crate::pool::BlockState;

fn branch(seq_id: u64, parent: u64, prompt: Vec<u32>) -> SeqSpec {
    let mut s = spec(seq_id, Prompt::Tokens(prompt));
    s.fork_of = Some(SeqId(parent));
    s
}

/// A parent leased at step 1 with a 10-token prompt in blocks of 4 (two
/// full blocks and one holding 2 tokens), step 1 completed.
fn parent(pool_blocks: u32) -> Fixture {
    let mut f = Fixture::new(4, &[(0, pool_blocks)]);
    f.lease(1, false, &[spec(1, Prompt::Tokens(tokens(0, 10)))]);
    f.complete(1);
    f
}

#[test]
fn branches_share_the_full_blocks_and_copy_the_block_of_the_last_prompt_token() {
    let mut f = parent(32);
    let mother = f.cache.sequence_tables(f.session, SeqId(1)).unwrap()[0]
        .2
        .clone();
    let out = f.lease(
        2,
        false,
        &[branch(2, 1, tokens(0, 10)), branch(3, 1, tokens(0, 10))],
    );
    for o in &out {
        let g = o.grant().unwrap();
        assert_eq!(g.reused_tokens, 9, "all but the last prompt token");
        let t = &g.tables[0].block_ids;
        assert_eq!(t[..2], mother[..2], "full blocks shared by reference");
        assert_ne!(t[2], mother[2], "the block of the last token is its own");
        assert_eq!(
            g.copies,
            vec![BlockCopy {
                pool_id: g.tables[0].pool_id,
                window: 0,
                src_block: mother[2],
                dst_block: t[2],
                tokens: 1,
            }],
            "its one leading slot copied on write"
        );
    }
    // three branches hold 2 shared + 3 own blocks: what Estimate says of
    // the shape with beam width 3
    let mut shape = spec(9, Prompt::Tokens(tokens(0, 10)));
    shape.beam_width = 3;
    let est = f.cache.estimate(&[shape]).unwrap();
    assert_eq!(f.counts()[0].in_use, 5);
    assert_eq!(est[0].pools[0].total, 5);
    let stats = &f.cache.pools()[0].pool.counters;
    assert_eq!((stats.fork_shared, stats.fork_copies), (4, 2));
    assert_eq!(stats.reuse_hits, 0, "a fork is no prefix-cache hit");
    // the parent ends at once (fenced at the forks' step): the copy source
    // waits for the step whose pass copies it
    f.release(&[1], Some(2));
    let pool = &f.cache.pools()[0].pool;
    assert_eq!(pool.state(mother[2]), BlockState::Fenced);
    assert_eq!(
        pool.state(mother[0]),
        BlockState::InUse,
        "the branches hold it"
    );
    f.complete(2);
    // the branches diverge: each extends with its own tokens into its own
    // blocks
    let out = f.extend(
        3,
        &[
            (2, Growth::Tokens(vec![100, 101, 102])),
            (3, Growth::Tokens(vec![200, 201, 202])),
        ],
    );
    let a = out[0].grant().unwrap().tables[0].block_ids.clone();
    let b = out[1].grant().unwrap().tables[0].block_ids.clone();
    assert_eq!((a.len(), b.len()), (1, 1));
    assert_ne!(a, b);
    // one is pruned, the other ends: fenced releases, then the pool is whole
    f.release(&[3], Some(3));
    f.release(&[2], Some(4));
    f.complete(4);
    assert!(whole(&f.counts()));
    assert!(f.cache.audit().reclaimed.is_empty());
}

#[test]
fn a_prompt_ending_a_block_copies_all_but_the_last_slot() {
    let mut f = Fixture::new(4, &[(0, 16)]);
    f.lease(1, false, &[spec(1, Prompt::Tokens(tokens(0, 8)))]);
    f.complete(1);
    let mother = f.cache.sequence_tables(f.session, SeqId(1)).unwrap()[0]
        .2
        .clone();
    let out = f.lease(2, false, &[branch(2, 1, tokens(0, 8))]);
    let g = out[0].grant().unwrap();
    assert_eq!(g.reused_tokens, 7);
    assert_eq!(g.tables[0].block_ids[0], mother[0]);
    assert_ne!(g.tables[0].block_ids[1], mother[1]);
    assert_eq!(g.copies[0].tokens, 3);
    f.complete(2);
    f.release(&[1, 2], Some(3));
    f.complete(3);
    assert!(whole(&f.counts()));
}

#[test]
fn a_branch_shares_only_kv_that_a_completed_step_wrote() {
    // the parent's prompt pass (step 1) is in flight: it may still fail, so
    // a branch leased now shares none of it and computes its whole prompt
    let mut f = Fixture::new(4, &[(0, 32)]);
    f.lease(1, false, &[spec(1, Prompt::Tokens(tokens(0, 10)))]);
    let out = f.lease(2, false, &[branch(2, 1, tokens(0, 10))]);
    let g = out[0].grant().unwrap();
    assert_eq!(g.reused_tokens, 0, "nothing the parent has not written yet");
    assert!(g.copies.is_empty());
    // step 1 completes: the next branch shares the prompt's blocks; the
    // parent's decode at step 2 (not completed) adds nothing to the share
    f.complete(1);
    f.extend(2, &[(1, Growth::Tokens(vec![100, 101, 102]))]);
    let mut context = tokens(0, 10);
    context.extend([100, 101, 102]);
    let out = f.lease(3, false, &[branch(3, 1, context.clone())]);
    let g = out[0].grant().unwrap();
    assert_eq!(g.reused_tokens, 10, "the prompt, written by step 1");
    // once step 2 completes, a branch shares the decoded tokens too
    f.complete(2);
    f.complete(3);
    let out = f.lease(4, false, &[branch(4, 1, context)]);
    assert_eq!(out[0].grant().unwrap().reused_tokens, 12);
    f.release(&[1, 2, 3, 4], Some(4));
    f.complete(4);
    assert!(whole(&f.counts()));
    assert!(f.cache.audit().reclaimed.is_empty());
}

#[test]
fn exhaustion_while_forking_is_a_reject_that_takes_nothing() {
    // the parent takes 3 of 4 blocks; two branches need 2
    let mut f = parent(4);
    let before = f.counts();
    let out = f.lease(
        2,
        true,
        &[branch(2, 1, tokens(0, 10)), branch(3, 1, tokens(0, 10))],
    );
    let r = out[1].reject().unwrap();
    assert_eq!(r.reason, RejectReason::PoolExhausted);
    // its own block, with one free that the first branch would take
    assert_eq!((r.blocks_needed, r.blocks_free), (1, 1));
    assert_eq!(out[0].reject().unwrap().reason, RejectReason::RolledBack);
    assert_eq!(f.counts(), before, "nothing taken, nothing pinned");
    // one branch fits
    assert!(
        f.lease(2, false, &[branch(2, 1, tokens(0, 10))])[0]
            .grant()
            .is_some()
    );
    f.release(&[1, 2], Some(2));
    f.complete(2);
    assert!(whole(&f.counts()));
}

#[test]
fn a_parent_the_session_does_not_hold_is_a_reject() {
    let mut f = parent(16);
    let out = f.lease(2, false, &[branch(2, 7, tokens(0, 10))]);
    let r = out[0].reject().unwrap();
    assert_eq!(r.reason, RejectReason::UnknownSequence);
    assert!(r.message.contains("fork_of 7"), "{}", r.message);
}

#[test]
fn malformed_forks_are_invalid_arguments_naming_fork_of() {
    let mut f = parent(16);
    let mut beams = branch(2, 1, tokens(0, 10));
    beams.beam_width = 2;
    let mut salted = branch(2, 1, tokens(0, 10));
    salted.cache_salt = "other".into();
    for (bad, why) in [
        (branch(1, 1, tokens(0, 10)), "cannot fork itself"),
        (beams, "beam_width must be 1"),
        (
            branch(2, 1, tokens(1, 10)),
            "not the tokens the parent holds",
        ),
        (salted, "cache_salt"),
    ] {
        let before = f.counts();
        let err = f.try_lease(2, false, &[bad]).unwrap_err();
        let Error::InvalidArgument(message) = err else {
            panic!("{err:?}")
        };
        assert!(
            message.contains("fork_of") && message.contains(why),
            "{message}"
        );
        assert_eq!(f.counts(), before);
    }
}

#[test]
fn a_branch_of_a_parent_whose_window_slid_past_the_prompt_is_an_ordinary_lease() {
    // window 4, blocks of 4: after 12 more tokens the parent holds only the
    // blocks its window reaches
    let mut f = Fixture::new(4, &[(4, 16)]);
    f.lease(1, false, &[spec(1, Prompt::Tokens(tokens(0, 10)))]);
    f.complete(1);
    for step in 2..14 {
        f.extend(step, &[(1, Growth::Tokens(vec![step as u32 + 500]))]);
        f.complete(step);
    }
    let out = f.lease(14, false, &[branch(2, 1, tokens(0, 10))]);
    let g = out[0].grant().unwrap();
    assert!(g.copies.is_empty(), "nothing copied from the parent");
    assert_eq!(f.cache.pools()[0].pool.counters.fork_shared, 0);
    f.release(&[1, 2], Some(14));
    f.complete(14);
    assert!(whole(&f.counts()));
}

#[test]
fn a_beam_child_forks_with_its_own_last_token() {
    // a beam's parent decodes token 100 at position 10 in the step where
    // its second child forks with token 200 there: only the shared part
    // (the 10 prompt tokens) must match the parent
    let mut f = parent(32);
    let mother = f.cache.sequence_tables(f.session, SeqId(1)).unwrap()[0]
        .2
        .clone();
    f.extend(2, &[(1, Growth::Tokens(vec![100]))]);
    let mut child = tokens(0, 10);
    child.push(200);
    let out = f.lease(2, false, &[branch(2, 1, child.clone())]);
    let g = out[0].grant().unwrap();
    assert_eq!(
        g.reused_tokens, 10,
        "the parent's context before the new token"
    );
    assert_eq!(g.tables[0].block_ids[..2], mother[..2]);
    assert_ne!(g.tables[0].block_ids[2], mother[2], "copied on write");
    assert_eq!(g.copies[0].src_block, mother[2]);
    assert_eq!(g.copies[0].tokens, 2);
    // a child whose shared part differs from the parent is still refused
    let mut bad = tokens(0, 10);
    bad[9] = 999;
    bad.push(200);
    let before = f.counts();
    let err = f.try_lease(2, false, &[branch(3, 1, bad)]).unwrap_err();
    let Error::InvalidArgument(message) = err else {
        panic!("{err:?}")
    };
    assert!(
        message.contains("not the tokens the parent holds"),
        "{message}"
    );
    assert_eq!(f.counts(), before);
    f.complete(2);
    // the beams diverge, one is pruned, the other finishes
    f.extend(
        3,
        &[
            (1, Growth::Tokens(vec![101])),
            (2, Growth::Tokens(vec![201])),
        ],
    );
    f.release(&[1], Some(3));
    f.release(&[2], Some(4));
    f.complete(4);
    assert!(whole(&f.counts()));
    assert!(f.cache.audit().reclaimed.is_empty());
}
