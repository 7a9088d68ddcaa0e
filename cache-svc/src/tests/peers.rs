//! Peer pull: a lease continues its prompt into blocks a peer group
//! published on its device, when the cost model says pulling them costs
//! less than computing them; the sources stay pinned (fenced at the
//! lease's step) until that step completes.

use super::{Fixture, GROUP, spec, tokens, whole};
use crate::error::Error;
use crate::lease::{Prompt, SeqSpec};
use crate::peer::PeerRates;
use crate::{SeqId, Step};
use kvlease_auth::principal::ANONYMOUS;

pub(super) const PEER: &str = "model/r1";

/// A link fast enough that pulling always wins.
const FAST: PeerRates = PeerRates {
    link_bytes_per_s: 1_000_000_000,
    prefill_tokens_per_s: 1_000,
    overhead_us: 100,
};

/// Two groups of 16 blocks of 4 tokens, peers under `key` (each with
/// blocks of `bytes`).
pub(super) fn peers(key_a: &str, key_b: &str, bytes: u64) -> Fixture {
    let mut f = Fixture::new(4, &[(0, 16)]);
    f.cache
        .register_pool_for(ANONYMOUS, PEER, 4, &[(0, 16, 0)])
        .unwrap();
    f.cache
        .set_peer_profile(ANONYMOUS, GROUP, key_a, &[(0, bytes)])
        .unwrap();
    f.cache
        .set_peer_profile(ANONYMOUS, PEER, key_b, &[(0, bytes)])
        .unwrap();
    f
}

/// Serves `prompt` as sequence `seq` in GROUP at step `seq`, completes the
/// step (publishing its full blocks) and releases it; returns its table.
fn publish(f: &mut Fixture, seq: u64, prompt: &[u32]) -> Vec<u32> {
    let out = f.lease(seq, false, &[spec(seq, Prompt::Tokens(prompt.to_vec()))]);
    let table = out[0].grant().unwrap().tables[0].block_ids.clone();
    f.complete(seq);
    f.release(&[seq], None);
    table
}

fn in_peer(seq: u64, prompt: &[u32], rates: Option<PeerRates>) -> SeqSpec {
    let mut s = SeqSpec::new(SeqId(seq), PEER, Prompt::Tokens(prompt.to_vec()));
    s.peer_pull = rates;
    s
}

#[test]
fn a_lease_pulls_a_prefix_a_peer_published_and_pins_the_sources_until_its_step_completes() {
    let mut f = peers("m:fp:f32", "m:fp:f32", 4_096);
    let prompt = tokens(10, 11);
    let source = publish(&mut f, 1, &prompt);
    let out = f.lease(2, false, &[in_peer(2, &prompt, Some(FAST))]);
    let g = out[0].grant().unwrap();
    // two full blocks come from the peer; the partial third is computed
    assert_eq!(g.reused_tokens, 8);
    let d = g.peer_decision.as_ref().unwrap();
    assert_eq!((d.src_group.as_str(), d.blocks, d.bytes), (GROUP, 2, 8_192));
    assert!(d.pulled && d.pull_us < d.recompute_us, "{d:?}");
    let table = &g.tables[0].block_ids;
    let pairs: Vec<(u32, u32)> = g
        .peer_copies
        .iter()
        .map(|c| (c.src_block, c.dst_block))
        .collect();
    assert_eq!(pairs, vec![(source[0], table[0]), (source[1], table[1])]);
    assert!(g.peer_copies.iter().all(|c| c.src_group == GROUP
        && c.src_pool_id == 1
        && c.pool_id == 2
        && c.transfer_id == g.peer_copies[0].transfer_id
        && c.transfer_id > 0));
    // the sources are fenced at the lease's step: no allocation takes them
    assert_eq!(f.counts()[0].fenced, 2);
    f.complete(2);
    assert_eq!(f.counts()[0].fenced, 0);
    // the pulled blocks published in the peer group like computed ones
    let out = f.lease(3, false, &[in_peer(3, &prompt, Some(FAST))]);
    let g = out[0].grant().unwrap();
    assert_eq!(g.reused_tokens, 8);
    assert!(g.peer_copies.is_empty() && g.peer_decision.is_none());
    f.complete(3);
    f.release(&[2, 3], None);
    assert!(whole(&f.counts()), "{:?}", f.counts());
    assert_eq!(f.cache.audit().reclaimed.len(), 0);
}

#[test]
fn the_cost_model_declines_a_slow_link_and_the_figures_say_why() {
    let mut f = peers("k", "k", 1 << 20);
    let prompt = tokens(10, 11);
    publish(&mut f, 1, &prompt);
    let slow = PeerRates {
        link_bytes_per_s: 1_000_000,
        prefill_tokens_per_s: 1_000,
        overhead_us: 0,
    };
    let out = f.lease(2, false, &[in_peer(2, &prompt, Some(slow))]);
    let g = out[0].grant().unwrap();
    assert_eq!(g.reused_tokens, 0);
    assert!(g.peer_copies.is_empty());
    let d = g.peer_decision.as_ref().unwrap();
    // 2 MiB at 1 MB/s against 8 tokens at 1000 tok/s
    assert_eq!(
        (d.pull_us, d.recompute_us, d.pulled),
        (2_097_152, 8_000, false)
    );
    assert_eq!(f.counts()[0].fenced, 0, "nothing pinned");
    // and without rates there is no peer pull at all
    let out = f.lease(2, false, &[in_peer(3, &prompt, None)]);
    assert!(out[0].grant().unwrap().peer_decision.is_none());
}

#[test]
fn only_peers_of_the_same_owner_key_and_block_size_are_pulled_from() {
    let prompt = tokens(10, 11);
    // another key (another model, tokenizer or KV type)
    let mut f = peers("a", "b", 4_096);
    publish(&mut f, 1, &prompt);
    let out = f.lease(2, false, &[in_peer(2, &prompt, Some(FAST))]);
    assert!(out[0].grant().unwrap().peer_decision.is_none());
    // no key at all
    let mut f = peers("", "", 4_096);
    publish(&mut f, 1, &prompt);
    let out = f.lease(2, false, &[in_peer(2, &prompt, Some(FAST))]);
    assert!(out[0].grant().unwrap().peer_decision.is_none());
    // block sizes unknown (0)
    let mut f = peers("k", "k", 0);
    publish(&mut f, 1, &prompt);
    let out = f.lease(2, false, &[in_peer(2, &prompt, Some(FAST))]);
    assert!(out[0].grant().unwrap().peer_decision.is_none());
    // another principal's group with the same key is never a peer
    let mut f = peers("k", "k", 4_096);
    f.cache
        .register_pool_for("someone-else", "other/r0", 4, &[(0, 16, 0)])
        .unwrap();
    f.cache
        .set_peer_profile("someone-else", "other/r0", "k", &[(0, 4_096)])
        .unwrap();
    let now = f.now;
    let theirs = f
        .cache
        .open_session_for("someone-else", "theirs", None, now)
        .unwrap();
    let mut s = SeqSpec::new(SeqId(9), "other/r0", Prompt::Tokens(prompt.clone()));
    s.peer_pull = Some(FAST);
    publish(&mut f, 1, &prompt);
    let out = f
        .cache
        .lease(
            theirs.session_id,
            theirs.epoch,
            crate::cache::Batch {
                step: Step(1),
                ..Default::default()
            },
            &[s],
            now,
        )
        .unwrap();
    let g = out[0].grant().unwrap();
    assert_eq!(g.reused_tokens, 0);
    assert!(g.peer_decision.is_none());
}

#[test]
fn a_failed_pull_never_publishes_its_blocks_and_the_sources_return_at_the_step() {
    let mut f = peers("k", "k", 4_096);
    let prompt = tokens(10, 11);
    publish(&mut f, 1, &prompt);
    let out = f.lease(2, false, &[in_peer(2, &prompt, Some(FAST))]);
    assert_eq!(out[0].grant().unwrap().peer_copies.len(), 2);
    // the worker's pull failed: the holder releases with discard_unwritten
    f.release_failed(&[2], Some(2));
    f.complete(2);
    assert!(whole(&f.counts()), "{:?}", f.counts());
    // the peer group holds nothing of the prompt: the next lease pulls again
    let out = f.lease(3, false, &[in_peer(3, &prompt, Some(FAST))]);
    let g = out[0].grant().unwrap();
    assert_eq!((g.reused_tokens, g.peer_copies.len()), (8, 2));
    // a session's end gives the pinned sources back too
    let (session, epoch, now) = (f.session, f.epoch, f.now);
    f.cache.close_session(session, epoch, now).unwrap();
    f.check();
    assert!(whole(&f.counts()), "{:?}", f.counts());
    assert_eq!(f.cache.audit().reclaimed.len(), 0);
}

#[test]
fn match_counts_the_tokens_a_peer_pull_could_bring() {
    let mut f = peers("k", "k", 4_096);
    let prompt = tokens(10, 11);
    publish(&mut f, 1, &prompt);
    let (session, epoch, now) = (f.session, f.epoch, f.now);
    let prompts = [crate::cache::MatchPrompt {
        tokens: prompt,
        cache_salt: String::new(),
    }];
    let rows = f
        .cache
        .match_with_peers(session, epoch, &[GROUP.into(), PEER.into()], &prompts, now)
        .unwrap();
    let got: Vec<(u32, u32)> = rows[0]
        .iter()
        .map(|m| (m.reused_tokens, m.peer_tokens))
        .collect();
    assert_eq!(got, vec![(8, 0), (0, 8)]);
}

#[test]
fn malformed_peer_pull_rates_and_keys_are_refused_naming_the_field() {
    let mut f = peers("k", "k", 4_096);
    let mut s = in_peer(1, &tokens(0, 5), Some(FAST));
    s.peer_pull = Some(PeerRates {
        prefill_tokens_per_s: 0,
        ..FAST
    });
    let before = f.counts();
    match f.try_lease(1, false, &[s]) {
        Err(Error::InvalidArgument(m)) => assert_eq!(
            m,
            "sequence 1: peer_pull.prefill_tokens_per_s must be greater than 0"
        ),
        other => panic!("{other:?}"),
    }
    assert_eq!(f.counts(), before);
    let e = f
        .cache
        .set_peer_profile(ANONYMOUS, PEER, "bad key", &[])
        .unwrap_err();
    assert!(e.to_string().contains("peer_key"), "{e}");
    let e = f
        .cache
        .set_peer_profile(ANONYMOUS, PEER, "k", &[(8, 10)])
        .unwrap_err();
    assert!(e.to_string().contains("window 8"), "{e}");
    let e = f
        .cache
        .set_peer_profile("mallory", PEER, "k", &[])
        .unwrap_err();
    assert!(matches!(e, Error::GroupNotOwned { .. }), "{e}");
}
