//! Named tests of DESIGN.md's invariants and the two seed scenarios, on the
//! plain core, with the fixture the other files share. Property tests live
//! in `proptests.rs`; partial-block reuse, chunked prefill, `Step`, limits and
//! tiers have a file each.
//!
//! The fixture takes sequence ids and steps as bare numbers and wraps them:
//! the tests read as the scenarios they are.

mod adaptive;
mod chunked;
mod disk;
mod forks;
mod handoff;
mod limits;
mod partial;
mod peers;
pub(super) mod proptests;
mod retention;
mod retries;
mod step;
mod tiers;

use std::time::{Duration, Instant};

use crate::cache::{Batch, Cache, CacheConfig};
use crate::ids::{SeqId, Step};
use crate::lease::{Extra, Growth, Outcome, Prompt, RejectReason, ReleaseStatus, SeqSpec};
use crate::pool::PoolCounts;

pub(super) const GROUP: &str = "model/r0";

pub(super) struct Fixture {
    pub(super) cache: Cache,
    pub(super) session: crate::SessionId,
    pub(super) epoch: crate::Epoch,
    pub(super) now: Instant,
}

impl Fixture {
    pub(super) fn new(tokens_per_block: u32, pools: &[(u32, u32)]) -> Self {
        Self::with_config(CacheConfig::default(), tokens_per_block, pools)
    }

    pub(super) fn with_tiers(
        config: CacheConfig,
        tokens_per_block: u32,
        pools: &[(u32, u32, u32)],
    ) -> Self {
        let mut cache = Cache::with_epoch(config, crate::Epoch(7));
        cache
            .register_pool_for(
                kvlease_auth::principal::ANONYMOUS,
                GROUP,
                tokens_per_block,
                pools,
            )
            .unwrap();
        let now = Instant::now();
        let opened = cache.open_session("test", None, now).unwrap();
        Self {
            cache,
            session: opened.session_id,
            epoch: opened.epoch,
            now,
        }
    }

    pub(super) fn with_config(
        config: CacheConfig,
        tokens_per_block: u32,
        pools: &[(u32, u32)],
    ) -> Self {
        let tiered: Vec<(u32, u32, u32)> = pools.iter().map(|&(w, n)| (w, n, 0)).collect();
        Self::with_tiers(config, tokens_per_block, &tiered)
    }

    pub(super) fn lease(&mut self, step: u64, atomic: bool, specs: &[SeqSpec]) -> Vec<Outcome> {
        self.try_lease(step, atomic, specs).unwrap()
    }

    /// A lease whose call may fail as a whole (malformed specs).
    pub(super) fn try_lease(
        &mut self,
        step: u64,
        atomic: bool,
        specs: &[SeqSpec],
    ) -> crate::Result<Vec<Outcome>> {
        let out = self.cache.lease(
            self.session,
            self.epoch,
            Batch {
                step: Step(step),
                atomic,
                warmup: false,
            },
            specs,
            self.now,
        );
        self.check();
        out
    }

    pub(super) fn extend(&mut self, step: u64, items: &[(u64, Growth)]) -> Vec<Outcome> {
        let items: Vec<(SeqId, Growth)> = items
            .iter()
            .map(|(seq_id, growth)| (SeqId(*seq_id), growth.clone()))
            .collect();
        let out = self
            .cache
            .extend(
                self.session,
                self.epoch,
                Batch {
                    step: Step(step),
                    ..Batch::default()
                },
                &items,
                self.now,
            )
            .unwrap();
        self.check();
        out
    }

    pub(super) fn release(
        &mut self,
        seqs: &[u64],
        fence: Option<u64>,
    ) -> Vec<crate::lease::ReleaseResult> {
        let seqs = seq_ids(seqs);
        let out = self
            .cache
            .release(self.session, self.epoch, &seqs, fence.map(Step), self.now)
            .unwrap();
        self.check();
        out
    }

    /// A release after the holder's forward pass failed
    /// (`ReleaseMode::discard_unwritten`), fenced at `fence`.
    pub(super) fn release_failed(
        &mut self,
        seqs: &[u64],
        fence: Option<u64>,
    ) -> Vec<crate::lease::ReleaseResult> {
        let mode = crate::lease::ReleaseMode {
            fence_step: fence.map(Step),
            discard_unwritten: true,
        };
        let seqs = seq_ids(seqs);
        let out = self
            .cache
            .release_with(self.session, self.epoch, &seqs, mode, self.now)
            .unwrap();
        self.check();
        out
    }

    pub(super) fn complete(&mut self, step: u64) -> u64 {
        let n = self
            .cache
            .complete_step(self.session, self.epoch, Step(step), self.now)
            .unwrap();
        self.check();
        n
    }

    pub(super) fn counts(&self) -> Vec<PoolCounts> {
        self.cache.pools().iter().map(|p| p.pool.counts()).collect()
    }

    pub(super) fn check(&self) {
        if let Err(e) = self.cache.check_invariants() {
            panic!("invariant broken: {e}");
        }
    }
}

pub(super) fn spec(seq_id: u64, prompt: Prompt) -> SeqSpec {
    SeqSpec::new(SeqId(seq_id), GROUP, prompt)
}

pub(super) fn seq_ids(ids: &[u64]) -> Vec<SeqId> {
    ids.iter().copied().map(SeqId).collect()
}

pub(super) fn tokens(start: u32, n: u32) -> Vec<u32> {
    (start..start + n).collect()
}

pub(super) fn whole(counts: &[PoolCounts]) -> bool {
    counts
        .iter()
        .all(|c| c.in_use == 0 && c.fenced == 0 && c.free + c.cached == c.total)
}

#[test]
fn invariant_1_conservation_holds_through_every_state() {
    let mut f = Fixture::new(4, &[(0, 10)]);
    let g = f.lease(1, false, &[spec(1, Prompt::Tokens(tokens(0, 9)))]);
    assert!(g[0].grant().is_some());
    f.complete(1);
    f.release(&[1], Some(2)); // fenced
    let c = f.counts()[0];
    assert_eq!(c.free + c.cached + c.in_use + c.fenced, c.total);
    assert!(c.fenced > 0 && c.cached == 0);
    f.complete(2);
    let c = f.counts()[0];
    assert_eq!(
        (c.cached, c.fenced),
        (3, 0),
        "two full prompt blocks and the partly filled one stay cached: {c:?}"
    );
    assert_eq!(c.free + c.cached + c.in_use + c.fenced, c.total);
}

#[test]
fn invariant_2_no_double_grant_shared_blocks_are_full_and_read_only() {
    let mut f = Fixture::new(4, &[(0, 16)]);
    let prompt = tokens(100, 10);
    let a = f.lease(1, false, &[spec(1, Prompt::Tokens(prompt.clone()))]);
    f.complete(1);
    let b = f.lease(2, false, &[spec(2, Prompt::Tokens(prompt))]);
    let (a, b) = (a[0].grant().unwrap(), b[0].grant().unwrap());
    assert_eq!(b.reused_tokens, 8);
    let (ta, tb) = (&a.tables[0].block_ids, &b.tables[0].block_ids);
    assert_eq!(ta[..2], tb[..2], "full prompt blocks are shared");
    assert_ne!(ta[2], tb[2], "the partial block is each sequence's own");
    // check_invariants (run by the fixture) verifies every non-shared block
    // has exactly one holder.
    let pool = &f.cache.pools()[0].pool;
    assert_eq!(pool.refs(ta[0]).0, 2);
    assert_eq!(pool.refs(ta[2]).0, 1);
}

#[test]
fn invariant_3_no_half_allocation_across_pools() {
    // The windowed pool is big enough, the full one is not: nothing is taken.
    let mut f = Fixture::new(4, &[(0, 4), (8, 10)]);
    let before = f.counts();
    let out = f.lease(1, false, &[spec(1, Prompt::Count(20))]);
    let r = out[0].reject().unwrap();
    assert_eq!(r.reason, RejectReason::ExceedsCapacity);
    assert_eq!(r.blocks_needed, 5);
    assert_eq!(f.counts(), before);
    // Extend likewise: a sequence that fits, then an extend the full pool
    // cannot serve leaves both pools untouched.
    f.lease(2, false, &[spec(2, Prompt::Count(12))]);
    f.lease(2, false, &[spec(3, Prompt::Count(1))]);
    let before = f.counts();
    let out = f.extend(3, &[(3, Growth::Count(4))]);
    assert_eq!(out[0].reject().unwrap().reason, RejectReason::PoolExhausted);
    assert_eq!(f.counts(), before);
}

#[test]
fn invariant_4_release_is_idempotent() {
    let mut f = Fixture::new(4, &[(0, 8)]);
    f.lease(1, false, &[spec(1, Prompt::Count(10))]);
    let first = f.release(&[1], None);
    assert_eq!(first[0].status, ReleaseStatus::Released);
    assert_eq!(first[0].blocks_freed, 3);
    let second = f.release(&[1, 99], None);
    assert_eq!(second[0].status, ReleaseStatus::AlreadyReleased);
    assert_eq!(second[0].blocks_freed, 0);
    assert_eq!(second[1].status, ReleaseStatus::Unknown);
    assert_eq!(f.counts()[0].free, 8);
}

#[test]
fn invariant_5_fenced_blocks_wait_for_their_step_and_count_as_pending() {
    let mut f = Fixture::new(4, &[(0, 4)]);
    f.lease(1, false, &[spec(1, Prompt::Count(16))]);
    let rel = f.release(&[1], Some(5));
    assert_eq!(rel[0].blocks_fenced, 4);
    // The pool is full of fenced blocks: a new lease is told they are coming.
    let out = f.lease(2, false, &[spec(2, Prompt::Count(4))]);
    let r = out[0].reject().unwrap();
    assert_eq!(r.reason, RejectReason::PoolExhausted);
    assert_eq!((r.blocks_free, r.blocks_pending_free), (0, 4));
    assert_eq!(f.complete(4), 0, "an earlier step does not lift the fence");
    assert_eq!(f.complete(5), 4);
    assert!(
        f.lease(6, false, &[spec(2, Prompt::Count(4))])[0]
            .grant()
            .is_some()
    );
}

#[test]
fn invariant_5_session_expiry_lifts_fences() {
    let mut f = Fixture::new(4, &[(0, 4)]);
    f.lease(1, false, &[spec(1, Prompt::Count(8))]);
    f.lease(1, false, &[spec(2, Prompt::Count(8))]);
    f.release(&[1], Some(3));
    let later = f.now + Duration::from_secs(3600);
    let reclaimed = f.cache.expire_sessions(later);
    assert_eq!(reclaimed.len(), 1);
    assert_eq!(reclaimed[0].sequences, 1);
    assert_eq!(reclaimed[0].blocks, 4);
    f.check();
    assert!(whole(&f.counts()));
    let err = f.cache.keep_alive(f.session, f.epoch, later).unwrap_err();
    assert!(err.to_string().contains("unknown session"), "{err}");
}

#[test]
fn invariant_6_estimate_counts_draft_extra_tokens_and_beams() {
    let mut f = Fixture::new(16, &[(0, 64)]);
    let mut s = spec(1, Prompt::Count(32));
    s.max_new_tokens = 16;
    s.extra = Extra {
        draft: 4,
        extra_kv: 0,
        extra_decoding_steps: 0,
    };
    let est = f.cache.estimate(std::slice::from_ref(&s)).unwrap();
    assert_eq!(est[0].pools[0].total, 4);
    let allocs_before = f.cache.pools()[0].pool.counters.allocations;
    f.lease(1, false, &[s]);
    for step in 2..=16 {
        f.extend(step, &[(1, Growth::Count(1))]);
        f.complete(step);
    }
    let taken = f.cache.pools()[0].pool.counters.allocations - allocs_before;
    assert_eq!(taken, 4);
}

#[test]
fn invariant_7_a_sequence_that_cannot_fit_an_empty_pool_is_rejected_at_once() {
    let mut f = Fixture::new(16, &[(0, 4)]);
    let out = f.lease(1, false, &[spec(1, Prompt::Count(65))]);
    let r = out[0].reject().unwrap();
    assert_eq!(r.reason, RejectReason::ExceedsCapacity);
    assert_eq!((r.blocks_needed, r.blocks_free), (5, 4));
}

#[test]
fn invariant_9_stale_epoch_is_refused() {
    let mut f = Fixture::new(4, &[(0, 4)]);
    let err = f
        .cache
        .lease(
            f.session,
            crate::Epoch(f.epoch.0 + 1),
            Batch::default(),
            &[spec(1, Prompt::Count(1))],
            f.now,
        )
        .unwrap_err();
    assert!(matches!(err, crate::Error::StaleEpoch { .. }), "{err}");
}

#[test]
fn invariant_10_windowed_pool_holds_at_most_window_over_block_plus_one() {
    let (b, w) = (4u32, 10u32);
    let mut f = Fixture::new(b, &[(0, 64), (w, 64)]);
    f.lease(1, false, &[spec(1, Prompt::Tokens(tokens(0, 30)))]);
    f.complete(1);
    let bound = w.div_ceil(b) as usize + 1;
    for step in 2..40 {
        let out = f.extend(step, &[(1, Growth::Tokens(vec![step as u32]))]);
        assert!(out[0].grant().is_some());
        let tables = f.cache.sequence_tables(f.session, SeqId(1)).unwrap();
        let (_, first, blocks) = tables.iter().find(|t| t.0 == w).unwrap();
        assert!(blocks.len() <= bound, "step {step}: {first} {blocks:?}");
        let len = 30 + step as u32 - 1;
        // Every position the next query reads is still there.
        assert!(
            first * b <= (len + 1).saturating_sub(w),
            "{first} {blocks:?}"
        );
        let full = tables.iter().find(|t| t.0 == 0).unwrap();
        assert_eq!(full.1, 0);
        f.complete(step);
    }
    // What slid out went back to the pool once its step completed.
    let windowed = f.counts()[1];
    assert_eq!(windowed.fenced, 0);
    assert!(windowed.in_use as usize <= bound);
}

/// Another principal's group, `m/theirs` (8 blocks of 4 tokens) with the
/// 2 full blocks of `prompt` published and cached, and its owner's session.
fn theirs(f: &mut Fixture, prompt: &[u32]) -> (crate::SessionId, crate::Epoch) {
    f.cache
        .register_pool_for("principal-b", "m/theirs", 4, &[(0, 8, 0)])
        .unwrap();
    let b = f
        .cache
        .open_session_for("principal-b", "b", None, f.now)
        .unwrap();
    let batch = |step| Batch {
        step: Step(step),
        ..Batch::default()
    };
    let own = SeqSpec::new(SeqId(1), "m/theirs", Prompt::Tokens(prompt.to_vec()));
    let out = f
        .cache
        .lease(b.session_id, b.epoch, batch(1), &[own], f.now)
        .unwrap();
    assert!(out[0].grant().is_some(), "{out:?}");
    f.cache
        .complete_step(b.session_id, b.epoch, Step(1), f.now)
        .unwrap();
    f.cache
        .release(b.session_id, b.epoch, &[SeqId(1)], None, f.now)
        .unwrap();
    f.check();
    (b.session_id, b.epoch)
}

#[test]
fn invariant_11_a_session_leases_only_in_its_principals_groups() {
    let mut f = Fixture::new(4, &[(0, 8)]);
    let prompt = tokens(40, 9);
    let (b, b_epoch) = theirs(&mut f, &prompt);
    let before = (f.counts(), f.cache.stats(None).unwrap());
    // two full blocks and the kept partly filled one
    assert_eq!(
        before.0[1].cached, 3,
        "the other principal's prefix is cached"
    );
    let probe = |seq| SeqSpec::new(SeqId(seq), "m/theirs", Prompt::Tokens(prompt.clone()));
    // alone, after a sequence of its own group (taken one at a time in a
    // batch that is not atomic), and in an atomic batch: the whole call is
    // refused before anything is taken, naming the group
    for (atomic, specs) in [
        (false, vec![probe(7)]),
        (false, vec![spec(6, Prompt::Tokens(tokens(0, 9))), probe(7)]),
        (true, vec![spec(6, Prompt::Count(5)), probe(7)]),
    ] {
        let batch = Batch {
            step: Step(1),
            atomic,
            warmup: false,
        };
        let err = f
            .cache
            .lease(f.session, f.epoch, batch, &specs, f.now)
            .unwrap_err();
        assert!(
            matches!(&err, crate::Error::GroupNotOwned { group, caller }
                if group == "m/theirs" && caller == kvlease_auth::principal::ANONYMOUS),
            "{err}"
        );
        assert!(err.to_string().contains("\"m/theirs\""), "{err}");
        f.check();
        assert_eq!(
            (f.counts(), f.cache.stats(None).unwrap()),
            before,
            "a refused lease took, pinned or counted something"
        );
    }
    // the refused sequences are not held: their ids are free to lease
    let out = f.lease(
        2,
        false,
        &[spec(6, Prompt::Count(5)), spec(7, Prompt::Count(5))],
    );
    assert!(out.iter().all(|o| o.grant().is_some()), "{out:?}");
    f.release(&[6, 7], None);
    // its owner's sessions still lease there, reusing the cached prefix
    let out = f
        .cache
        .lease(
            b,
            b_epoch,
            Batch {
                step: Step(2),
                ..Batch::default()
            },
            &[probe(8)],
            f.now,
        )
        .unwrap();
    assert_eq!(out[0].grant().map(|g| g.reused_tokens), Some(8), "{out:?}");
    f.check();
}

#[test]
fn invariant_11_a_group_is_registered_again_only_by_its_principal() {
    let mut f = Fixture::new(4, &[(0, 8)]);
    let (_, _) = theirs(&mut f, &tokens(40, 9));
    let before = f.cache.stats(None).unwrap();
    // the same geometry (not an idempotent success: the caller could never
    // use the group) and another one (refused before the geometry is told)
    for pools in [[(0, 8, 0)], [(0, 9, 0)]] {
        let err = f
            .cache
            .register_pool_for(kvlease_auth::principal::ANONYMOUS, "m/theirs", 4, &pools)
            .unwrap_err();
        assert!(
            matches!(&err, crate::Error::GroupNotOwned { group, .. } if group == "m/theirs"),
            "{err}"
        );
    }
    assert_eq!(f.cache.stats(None).unwrap(), before);
    let (_, again) = f
        .cache
        .register_pool_for("principal-b", "m/theirs", 4, &[(0, 8, 0)])
        .unwrap();
    assert!(again, "its own principal registers it again idempotently");
    f.check();
}

#[test]
fn seed_exhaustion_saturated_pool_under_reuse_and_oversubscription() {
    // MAX_UTILIZATION-style: admit on the next step's need only, ten times more
    // sequences than fit, with a shared system prompt so reuse is in play.
    let b = 4;
    let mut f = Fixture::new(b, &[(0, 40), (16, 40)]);
    let system: Vec<u32> = tokens(1000, 12);
    let mut live: Vec<u64> = Vec::new();
    let mut rejects = 0;
    let mut grants = 0;
    let mut step = 0;
    for wave in 0..10u64 {
        step += 1;
        let specs: Vec<SeqSpec> = (0..10)
            .map(|i| {
                let id = wave * 100 + i;
                let mut p = system.clone();
                p.extend(tokens(id as u32 * 7, 3 + (i as u32 % 5)));
                spec(id, Prompt::Tokens(p))
            })
            .collect();
        for o in f.lease(step, false, &specs) {
            match o {
                Outcome::Grant(g) => {
                    grants += 1;
                    live.push(g.seq_id.0);
                }
                Outcome::Reject(r) => {
                    rejects += 1;
                    assert!(
                        matches!(
                            r.reason,
                            RejectReason::PoolExhausted | RejectReason::ExceedsCapacity
                        ),
                        "{r:?}"
                    );
                }
            }
        }
        // Decode a few steps: extends that run out are rejects, not panics;
        // rejected sequences are released fenced at this step (the in-flight
        // forward pass may still read them).
        for _ in 0..4 {
            step += 1;
            let items: Vec<(u64, Growth)> = live
                .iter()
                .map(|&s| (s, Growth::Tokens(vec![s as u32])))
                .collect();
            let out = f.extend(step, &items);
            let dropped: Vec<u64> = out
                .iter()
                .filter_map(|o| o.reject().map(|r| r.seq_id.0))
                .collect();
            rejects += dropped.len();
            f.release(&dropped, Some(step));
            live.retain(|s| !dropped.contains(s));
            f.complete(step);
        }
        // Finish the oldest half each wave.
        let done: Vec<u64> = live.drain(..live.len() / 2).collect();
        f.release(&done, Some(step));
        f.complete(step);
    }
    assert!(
        grants > 0 && rejects > 0,
        "grants {grants} rejects {rejects}"
    );
    f.release(&live, Some(step + 1));
    f.complete(step + 1);
    assert!(whole(&f.counts()), "pools not whole: {:?}", f.counts());
    assert!(
        f.cache.audit().reclaimed.is_empty(),
        "the audit found leaks"
    );
}

#[test]
fn seed_warmup_atomic_batch_whose_third_member_fails_leaves_the_pool_exactly_as_it_was() {
    let mut f = Fixture::new(4, &[(0, 12), (8, 12)]);
    // Some cached state, so "exactly as it was" covers the index and LRU too.
    f.lease(1, false, &[spec(1, Prompt::Tokens(tokens(0, 9)))]);
    f.complete(1);
    f.release(&[1], None);
    let before = f.counts();
    let stats_before = f.cache.stats(None).unwrap();
    let mut third = spec(12, Prompt::Count(20));
    third.extra.draft = 8; // 28 slots: 7 blocks, with the others' 6 > 12 - ...
    let batch = [
        spec(10, Prompt::Tokens(tokens(0, 9))), // reuses the cached prefix
        spec(11, Prompt::Count(12)),
        third,
    ];
    let out = f
        .cache
        .lease(
            f.session,
            f.epoch,
            Batch {
                step: Step(2),
                atomic: true,
                warmup: true,
            },
            &batch,
            f.now,
        )
        .unwrap();
    f.check();
    let reasons: Vec<RejectReason> = out.iter().map(|o| o.reject().unwrap().reason).collect();
    assert_eq!(
        reasons,
        vec![
            RejectReason::RolledBack,
            RejectReason::RolledBack,
            RejectReason::PoolExhausted
        ]
    );
    assert_eq!(f.counts(), before);
    let mut stats_after = f.cache.stats(None).unwrap();
    // Only the reject counter may move.
    for p in &mut stats_after.pools {
        p.counters.rejects = 0;
    }
    let mut stats_before = stats_before;
    for p in &mut stats_before.pools {
        p.counters.rejects = 0;
    }
    assert_eq!(stats_after, stats_before);
    // The cached prefix is still reusable.
    let g = f.lease(3, false, &[spec(20, Prompt::Tokens(tokens(0, 9)))]);
    assert_eq!(g[0].grant().unwrap().reused_tokens, 8);
}

#[test]
fn hashes_publish_only_when_the_writing_step_completes() {
    let mut f = Fixture::new(4, &[(0, 16)]);
    f.lease(1, false, &[spec(1, Prompt::Tokens(tokens(0, 9)))]);
    let early = f.lease(1, false, &[spec(2, Prompt::Tokens(tokens(0, 9)))]);
    assert_eq!(
        early[0].grant().unwrap().reused_tokens,
        0,
        "KV not written yet"
    );
    f.complete(1);
    let later = f.lease(2, false, &[spec(3, Prompt::Tokens(tokens(0, 9)))]);
    assert_eq!(later[0].grant().unwrap().reused_tokens, 8);
    // Decoded tokens fill blocks that become reusable too.
    f.extend(3, &[(1, Growth::Tokens(vec![9, 10, 11]))]);
    f.complete(3);
    let grown = f.lease(4, false, &[spec(4, Prompt::Tokens(tokens(0, 13)))]);
    assert_eq!(grown[0].grant().unwrap().reused_tokens, 12);
}

// === failed forward passes ===

#[test]
fn a_failed_pass_publishes_nothing_its_release_may_not_have_written() {
    let mut f = Fixture::new(4, &[(0, 16)]);
    // two full blocks and a partly filled one, written by step 1's pass
    f.lease(1, false, &[spec(1, Prompt::Tokens(tokens(0, 9)))]);
    // step 1's pass failed: the worker may still be writing, so the blocks
    // stay fenced, but what they hold is never to be read
    let rel = f.release_failed(&[1], Some(1));
    assert_eq!((rel[0].blocks_freed, rel[0].blocks_fenced), (0, 3));
    assert_eq!(f.counts()[0].fenced, 3, "the fence still holds them");
    assert_eq!(f.complete(1), 3);
    assert!(whole(&f.counts()));
    assert_eq!(f.counts()[0].cached, 0, "nothing was published");
    assert_eq!(f.cache.pools()[0].pool.partial_blocks(), 0);
    assert!(f.cache.audit().reclaimed.is_empty());
    // the same prompt and one token more (a copy never covers the last token)
    let again = f.lease(2, false, &[spec(2, Prompt::Tokens(tokens(0, 10)))]);
    let g = again[0].grant().unwrap();
    assert_eq!(g.reused_tokens, 0, "never-written KV is not reused");
    assert!(g.copies.is_empty(), "nor is a partly filled block kept");
}

#[test]
fn a_fenced_release_without_the_flag_still_publishes_at_completion() {
    let mut f = Fixture::new(4, &[(0, 16)]);
    f.lease(1, false, &[spec(1, Prompt::Tokens(tokens(0, 9)))]);
    let rel = f.release(&[1], Some(1));
    assert_eq!(rel[0].blocks_fenced, 3);
    f.complete(1);
    assert!(whole(&f.counts()));
    assert_eq!(
        f.counts()[0].cached,
        3,
        "two full blocks and the partial one"
    );
    assert!(f.cache.audit().reclaimed.is_empty());
    // the same prompt and one token more (a copy never covers the last token)
    let again = f.lease(2, false, &[spec(2, Prompt::Tokens(tokens(0, 10)))]);
    let g = again[0].grant().unwrap();
    assert_eq!(g.reused_tokens, 9, "8 from full blocks, 1 copied");
    assert_eq!(g.copies.len(), 1);
}

#[test]
fn a_failed_release_drops_only_its_own_sequences_hashes() {
    let mut f = Fixture::new(4, &[(0, 32)]);
    // seq 1's prompt published at step 1; its decode fills a block at step 2
    f.lease(1, false, &[spec(1, Prompt::Tokens(tokens(0, 9)))]);
    f.complete(1);
    f.extend(2, &[(1, Growth::Tokens(vec![9, 10, 11]))]);
    // seq 2 is leased in step 2 too, and its pass does not fail
    f.lease(2, false, &[spec(2, Prompt::Tokens(tokens(100, 9)))]);
    // step 2's pass failed for seq 1 only
    f.release_failed(&[1], Some(2));
    f.complete(2);
    let grown = f.lease(3, false, &[spec(3, Prompt::Tokens(tokens(0, 13)))]);
    assert_eq!(
        grown[0].grant().unwrap().reused_tokens,
        8,
        "the prompt blocks step 1 wrote, not the block of the failed step 2"
    );
    let other = f.lease(3, false, &[spec(4, Prompt::Tokens(tokens(100, 9)))]);
    assert_eq!(
        other[0].grant().unwrap().reused_tokens,
        8,
        "seq 2's step-2 blocks published as usual"
    );
    f.release(&[2, 3, 4], None);
    assert!(whole(&f.counts()));
    assert!(f.cache.audit().reclaimed.is_empty());
}

#[test]
fn salts_and_warmup_do_not_share() {
    let mut f = Fixture::new(4, &[(0, 16)]);
    let mut salted = spec(1, Prompt::Tokens(tokens(0, 9)));
    salted.cache_salt = "tenant-a".into();
    f.lease(1, false, &[salted]);
    f.complete(1);
    let other = f.lease(2, false, &[spec(2, Prompt::Tokens(tokens(0, 9)))]);
    assert_eq!(other[0].grant().unwrap().reused_tokens, 0);
    let warm = f
        .cache
        .lease(
            f.session,
            f.epoch,
            Batch {
                step: Step(3),
                atomic: true,
                warmup: true,
            },
            &[spec(3, Prompt::Tokens(tokens(50, 9)))],
            f.now,
        )
        .unwrap();
    assert!(warm[0].grant().is_some());
    f.complete(3);
    let after = f.lease(4, false, &[spec(4, Prompt::Tokens(tokens(50, 9)))]);
    assert_eq!(
        after[0].grant().unwrap().reused_tokens,
        0,
        "warm-up is not cached"
    );
    let stats = f.cache.stats(None).unwrap();
    assert_eq!(
        stats.pools[0].counters.reuse_lookups, 6,
        "warm-up not counted"
    );
}

#[test]
fn eviction_takes_cached_blocks_lowest_priority_first() {
    // Partial-block reuse off: only the full blocks are cached.
    let config = CacheConfig {
        partial_reuse: false,
        ..CacheConfig::default()
    };
    let mut f = Fixture::with_config(config, 4, &[(0, 4)]);
    let mut keep = spec(1, Prompt::Tokens(tokens(0, 5)));
    keep.priority = 90;
    let mut drop = spec(2, Prompt::Tokens(tokens(100, 5)));
    drop.priority = 10;
    f.lease(1, false, &[keep, drop]);
    f.complete(1);
    f.release(&[1, 2], None);
    assert_eq!(f.counts()[0].cached, 2);
    // Needs 3 of 4 blocks: 2 free + 1 evicted, the low-priority one.
    f.lease(2, false, &[spec(3, Prompt::Count(12))]);
    f.release(&[3], None);
    let hit = f.lease(3, false, &[spec(4, Prompt::Tokens(tokens(0, 5)))]);
    assert_eq!(hit[0].grant().unwrap().reused_tokens, 4);
    let miss = f.lease(3, false, &[spec(5, Prompt::Tokens(tokens(100, 5)))]);
    assert_eq!(miss[0].grant().unwrap().reused_tokens, 0);
    assert_eq!(f.cache.stats(None).unwrap().pools[0].counters.evictions, 1);
}

#[test]
fn audit_reclaims_a_leaked_block_and_names_its_last_holder() {
    let mut f = Fixture::new(4, &[(0, 8)]);
    f.lease(1, false, &[spec(1, Prompt::Count(4))]);
    f.release(&[1], None);
    let block = f.cache.leak_for_test(1).unwrap();
    assert!(f.cache.check_invariants().is_err());
    let report = f.cache.audit();
    assert_eq!(report.reclaimed.len(), 1);
    assert_eq!(report.reclaimed[0].block, block);
    assert_eq!(report.reclaimed[0].last_holder.seq, SeqId(42));
    f.check();
    assert_eq!(f.counts()[0].free, 8);
}

#[test]
fn quota_caps_a_session() {
    let config = CacheConfig {
        session_quota: 3,
        ..CacheConfig::default()
    };
    let mut f = Fixture::with_config(config, 4, &[(0, 16)]);
    assert!(
        f.lease(1, false, &[spec(1, Prompt::Count(8))])[0]
            .grant()
            .is_some()
    );
    let out = f.lease(1, false, &[spec(2, Prompt::Count(8))]);
    assert_eq!(out[0].reject().unwrap().reason, RejectReason::QuotaExceeded);
}

#[test]
fn beams_share_prompt_blocks_and_grow_apart() {
    let mut f = Fixture::new(4, &[(0, 32)]);
    let mut s = spec(1, Prompt::Count(9));
    s.beam_width = 3;
    let g = f.lease(1, false, &[s]);
    let g = g[0].grant().unwrap();
    assert_eq!(g.tables.len(), 3);
    assert_eq!(g.tables[0].block_ids[..2], g.tables[2].block_ids[..2]);
    assert_ne!(g.tables[0].block_ids[2], g.tables[1].block_ids[2]);
    assert_eq!(f.counts()[0].in_use, 2 + 3);
    f.release(&[1], None);
    assert_eq!(f.counts()[0].free, 32);
}

#[test]
fn reserve_full_life_takes_the_life_up_front() {
    let mut f = Fixture::new(4, &[(0, 32)]);
    let mut s = spec(1, Prompt::Count(8));
    s.max_new_tokens = 9;
    s.reserve_full_life = true;
    let g = f.lease(1, false, &[s]);
    assert_eq!(g[0].grant().unwrap().tables[0].block_ids.len(), 4);
    let before = f.counts();
    for step in 2..=9 {
        assert!(
            f.extend(step, &[(1, Growth::Count(1))])[0]
                .grant()
                .is_some()
        );
    }
    assert_eq!(
        f.counts(),
        before,
        "extends within the reserved life take nothing"
    );
}

#[test]
fn duplicates_and_unknown_sequences_are_rejects() {
    let mut f = Fixture::new(4, &[(0, 8)]);
    let out = f.lease(
        1,
        false,
        &[spec(1, Prompt::Count(4)), spec(1, Prompt::Count(4))],
    );
    assert!(out[0].grant().is_some());
    assert_eq!(
        out[1].reject().unwrap().reason,
        RejectReason::DuplicateSequence
    );
    let again = f.lease(2, false, &[spec(1, Prompt::Count(4))]);
    assert_eq!(
        again[0].reject().unwrap().reason,
        RejectReason::DuplicateSequence
    );
    let ext = f.extend(2, &[(5, Growth::Count(1))]);
    assert_eq!(
        ext[0].reject().unwrap().reason,
        RejectReason::UnknownSequence
    );
}

#[test]
fn register_pool_is_idempotent_and_refuses_a_conflict() {
    let mut cache = Cache::with_epoch(CacheConfig::default(), crate::Epoch(1));
    let (a, again) = cache.register_pool("g", 16, &[(0, 10), (64, 10)]).unwrap();
    assert!(!again);
    let (b, again) = cache.register_pool("g", 16, &[(64, 10), (0, 10)]).unwrap();
    assert!(again);
    assert_eq!(a[0].pool_id, b[1].pool_id);
    assert!(matches!(
        cache.register_pool("g", 16, &[(0, 11), (64, 10)]),
        Err(crate::Error::GeometryConflict { .. })
    ));
    assert!(matches!(
        cache.register_pool("g", 8, &[(0, 10), (64, 10)]),
        Err(crate::Error::GeometryConflict { .. })
    ));
}

#[test]
fn a_lease_at_a_completed_step_is_refused_naming_the_step() {
    let mut f = Fixture::new(4, &[(0, 8)]);
    f.lease(3, false, &[spec(1, Prompt::Tokens(tokens(0, 9)))]);
    f.complete(3);
    for step in [0, 3] {
        let err = f
            .cache
            .lease(
                f.session,
                f.epoch,
                Batch {
                    step: Step(step),
                    ..Batch::default()
                },
                &[spec(2, Prompt::Tokens(tokens(0, 9)))],
                f.now,
            )
            .unwrap_err();
        assert!(
            matches!(
                err,
                crate::Error::StepAlreadyCompleted {
                    completed: Step(3),
                    ..
                }
            ),
            "{err}"
        );
        assert!(err.to_string().contains("completed step 3"), "{err}");
        assert_eq!(
            tonic::Status::from(err).code(),
            tonic::Code::FailedPrecondition
        );
    }
    f.check();
    // A later step is fine, and reuses what step 3 published.
    let out = f.lease(4, false, &[spec(2, Prompt::Tokens(tokens(0, 9)))]);
    assert_eq!(out[0].grant().unwrap().reused_tokens, 8);
}
