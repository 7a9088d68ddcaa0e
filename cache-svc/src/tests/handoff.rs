//! Hand-off (disaggregated serving): a sequence prefilled in one group is
//! leased in a peer group with `handoff_of`; the grant pulls every prompt
//! position's KV, the partly filled last block by its leading slots, and
//! pins the sources until the lease's step completes.

use super::peers::{PEER, peers};
use super::{Fixture, GROUP, spec, tokens, whole};
use crate::SeqId;
use crate::error::Error;
use crate::lease::{Outcome, Prompt, RejectReason, SeqSpec};

/// Prefills `prompt` as sequence 1 in GROUP at step 1 (completed); returns
/// its table.
fn prefill(f: &mut Fixture, prompt: &[u32]) -> Vec<u32> {
    let out = f.lease(1, false, &[spec(1, Prompt::Tokens(prompt.to_vec()))]);
    let table = out[0].grant().unwrap().tables[0].block_ids.clone();
    f.complete(1);
    table
}

/// The hand-off of sequence `src` (whose prompt is `prompt`, the first
/// token sampled `next`) as `seq` in PEER.
fn handoff(seq: u64, src: u64, prompt: &[u32], next: u32) -> SeqSpec {
    let mut tokens = prompt.to_vec();
    tokens.push(next);
    let mut s = SeqSpec::new(SeqId(seq), PEER, Prompt::Tokens(tokens));
    s.prefill_tokens = 1;
    s.handoff_of = Some(SeqId(src));
    s
}

#[test]
fn a_handoff_pulls_every_prompt_position_and_pins_the_sources_until_its_step_completes() {
    let mut f = peers("k", "k", 4_096);
    // 10 tokens: two full blocks and two slots of a third
    let prompt = tokens(10, 10);
    let source = prefill(&mut f, &prompt);
    let out = f.lease(2, false, &[handoff(2, 1, &prompt, 99)]);
    let g = out[0].grant().unwrap();
    assert_eq!(g.reused_tokens, 10, "everything but the sampled token");
    let table = &g.tables[0].block_ids;
    assert_eq!(table.len(), 3);
    let copies: Vec<(u32, u32, u32)> = g
        .peer_copies
        .iter()
        .map(|c| (c.src_block, c.dst_block, c.tokens))
        .collect();
    assert_eq!(
        copies,
        vec![
            (source[0], table[0], 0),
            (source[1], table[1], 0),
            (source[2], table[2], 2)
        ]
    );
    assert!(g.peer_copies.iter().all(|c| c.src_group == GROUP
        && c.transfer_id == g.peer_copies[0].transfer_id
        && c.transfer_id > 0));
    let d = g.peer_decision.as_ref().unwrap();
    assert!(d.forced && d.pulled, "{d:?}");
    assert_eq!(
        (d.src_group.as_str(), d.blocks, d.bytes),
        (GROUP, 3, 12_288)
    );
    // counted as a hand-off, not as reuse
    let stats = &f.cache.pools()[1].pool.counters;
    assert_eq!((stats.handoff_blocks, stats.reuse_hits), (3, 0));
    // the holder releases the prefill sequence fenced at the transfer's
    // step: its blocks stay out of circulation until then
    f.release(&[1], Some(2));
    assert_eq!(f.counts()[0].free, 16 - 3);
    f.complete(2);
    assert_eq!(f.counts()[0].in_use + f.counts()[0].fenced, 0);
    f.release(&[2], None);
    assert!(whole(&f.counts()), "{:?}", f.counts());
    assert_eq!(f.cache.audit().reclaimed.len(), 0);
}

#[test]
fn a_block_aligned_prompt_pulls_whole_blocks_only() {
    let mut f = peers("k", "k", 4_096);
    let prompt = tokens(10, 8);
    let source = prefill(&mut f, &prompt);
    let out = f.lease(2, false, &[handoff(2, 1, &prompt, 99)]);
    let g = out[0].grant().unwrap();
    assert_eq!(g.reused_tokens, 8);
    let src: Vec<(u32, u32)> = g
        .peer_copies
        .iter()
        .map(|c| (c.src_block, c.tokens))
        .collect();
    assert_eq!(src, vec![(source[0], 0), (source[1], 0)]);
    f.release(&[1], Some(2));
    f.complete(2);
    f.release(&[2], None);
    assert!(whole(&f.counts()), "{:?}", f.counts());
}

#[test]
fn a_source_not_written_through_its_prompt_leaves_an_ordinary_lease() {
    let mut f = peers("k", "k", 4_096);
    let prompt = tokens(10, 10);
    // chunked prefill: only the first 4 tokens are written
    let mut s = spec(1, Prompt::Tokens(prompt.clone()));
    s.prefill_tokens = 4;
    f.lease(1, false, &[s]);
    let out = f.lease(2, false, &[handoff(2, 1, &prompt, 99)]);
    let g = out[0].grant().unwrap();
    assert_eq!(g.reused_tokens, 0);
    assert!(g.peer_copies.is_empty() && g.peer_decision.is_none());
    f.release(&[1, 2], None);
    f.complete(2);
    assert!(whole(&f.counts()), "{:?}", f.counts());
}

#[test]
fn a_malformed_handoff_is_refused_naming_handoff_of_and_an_unknown_source_is_a_reject() {
    let mut f = peers("k", "k", 4_096);
    let prompt = tokens(10, 10);
    prefill(&mut f, &prompt);
    let before = f.counts();
    let refused = |f: &mut Fixture, s: SeqSpec| match f.try_lease(2, false, &[s]) {
        Err(Error::InvalidArgument(m)) => m,
        other => panic!("{other:?}"),
    };
    let mut s = handoff(2, 2, &prompt, 99);
    s.handoff_of = Some(SeqId(2));
    assert_eq!(
        refused(&mut f, s),
        "sequence 2: handoff_of 2: a sequence cannot hand itself off"
    );
    let mut s = handoff(2, 1, &prompt, 99);
    s.fork_of = Some(SeqId(1));
    assert!(refused(&mut f, s).contains("handoff_of 1: a sequence is a fork or a hand-off"));
    let mut s = handoff(2, 1, &prompt, 99);
    s.beam_width = 2;
    assert!(refused(&mut f, s).contains("handoff_of 1: a hand-off is one beam"));
    let s = handoff(2, 1, &prompt[..9], 99);
    assert!(refused(&mut f, s).contains("the prompt must be its 10 tokens and the one it sampled"));
    let mut other = prompt.clone();
    other[3] += 1;
    let s = handoff(2, 1, &other, 99);
    assert!(refused(&mut f, s).contains("its prompt is not the tokens the source holds"));
    let mut s = handoff(2, 1, &prompt, 99);
    s.group = GROUP.into();
    assert!(refused(&mut f, s).contains("the lease's own group"));
    assert_eq!(f.counts(), before, "nothing taken");
    // a source the session does not hold: that sequence's reject
    let out = f.lease(2, false, &[handoff(2, 7, &prompt, 99)]);
    match &out[0] {
        Outcome::Reject(r) => {
            assert_eq!(r.reason, RejectReason::UnknownSequence);
            assert!(r.message.contains("handoff_of 7"), "{}", r.message);
        }
        other => panic!("{other:?}"),
    }
    // groups that are not peers (another KV) never hand off
    let mut f = peers("a", "b", 4_096);
    prefill(&mut f, &prompt);
    let m = refused(&mut f, handoff(2, 1, &prompt, 99));
    assert!(m.contains("which is not a peer of model/r1"), "{m}");
}
