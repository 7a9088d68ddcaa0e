//! The host-memory tier: demotion on eviction, onboarding on a prefix hit,
//! the step rules of both, and exhaustion of either tier as an answer.

use super::{Fixture, spec, tokens};
use crate::cache::CacheConfig;
use crate::events::Tier;
use crate::lease::{Grant, Outcome, Prompt, RejectReason, TierCopy, TierDirection};
use crate::tier::HostState;

/// A fixture whose one full-attention pool has `device` blocks of 4 tokens
/// and a host tier of `host` blocks (partial-block reuse off, so only full
/// blocks stay cached).
fn tiered(device: u32, host: u32) -> Fixture {
    let config = CacheConfig {
        partial_reuse: false,
        ..CacheConfig::default()
    };
    Fixture::with_tiers(config, 4, &[(0, device, host)])
}

pub(super) fn grant(o: &Outcome) -> &Grant {
    match o {
        Outcome::Grant(g) => g,
        Outcome::Reject(r) => panic!("rejected: {r:?}"),
    }
}

pub(super) fn of(g: &Grant, direction: TierDirection) -> Vec<TierCopy> {
    g.tier_copies
        .iter()
        .copied()
        .filter(|c| c.direction == direction)
        .collect()
}

/// Leases `seq` with `prompt` at `step`, completes the step and releases it,
/// so its full blocks end up cached on the device.
pub(super) fn run_and_cache(f: &mut Fixture, seq: u64, prompt: Vec<u32>, step: u64) -> Grant {
    let out = f.lease(step, false, &[spec(seq, Prompt::Tokens(prompt))]);
    let g = grant(&out[0]).clone();
    f.complete(step);
    f.release(&[seq], None);
    g
}

fn host(f: &Fixture) -> crate::tier::HostCounts {
    f.cache.pools()[0].pool.host().counts()
}

#[test]
fn an_evicted_block_is_demoted_and_onboarded_on_the_next_hit() {
    // 4 device blocks; prompt A (9 tokens) caches 2 full blocks.
    let mut f = tiered(4, 16);
    let a = tokens(0, 9);
    run_and_cache(&mut f, 1, a.clone(), 1);
    assert_eq!(f.counts()[0].cached, 2);
    // Prompt B (16 tokens) needs 4 blocks: evicts A's 2 cached blocks.
    let out = f.lease(2, false, &[spec(2, Prompt::Tokens(tokens(100, 16)))]);
    let demoted = of(grant(&out[0]), TierDirection::Demote);
    assert_eq!(demoted.len(), 2, "both evicted blocks are demoted");
    assert_eq!(host(&f).pending, 2);
    // A demotion in flight is never read: A's prefix is not found yet.
    let probe = f.cache.pools()[0]
        .pool
        .host()
        .lookup(crate::prefix::chain(0, &a, 4)[0]);
    assert_eq!(probe, None);
    f.complete(2);
    assert_eq!(host(&f).cached, 2);
    f.release(&[2], None);
    // A again: 2 device blocks come back from the host (8 reused tokens).
    let out = f.lease(3, false, &[spec(3, Prompt::Tokens(a.clone()))]);
    let g = grant(&out[0]);
    assert_eq!(g.reused_tokens, 8);
    let onboard = of(g, TierDirection::Onboard);
    assert_eq!(onboard.len(), 2);
    let table = &g.tables[0].block_ids;
    assert_eq!(onboard[0].device_block, table[0]);
    assert_eq!(onboard[1].device_block, table[1]);
    assert_eq!(
        host(&f).pinned,
        2,
        "sources pinned until the step completes"
    );
    f.complete(3);
    assert_eq!(host(&f).pinned, 0);
    // A's two blocks stay on the host (now on both tiers), and the three of
    // B's blocks that A's lease evicted joined them.
    assert_eq!(host(&f).cached, 5);
    let chain = crate::prefix::chain(0, &a, 4);
    assert!(
        chain[..2]
            .iter()
            .all(|&h| f.cache.pools()[0].pool.host().lookup(h).is_some())
    );
    f.release(&[3], None);
    // Now on the device: a plain reuse, no copy.
    let out = f.lease(4, false, &[spec(4, Prompt::Tokens(a))]);
    let g = grant(&out[0]);
    assert_eq!(g.reused_tokens, 8);
    assert!(of(g, TierDirection::Onboard).is_empty());
    let p = &f.cache.pools()[0].pool;
    assert_eq!((p.counters.demotions, p.counters.onboards), (5, 2));
}

#[test]
fn a_demotion_in_flight_is_never_read() {
    let mut f = tiered(6, 16);
    let a = tokens(0, 9);
    run_and_cache(&mut f, 1, a.clone(), 1);
    // Step 2 evicts A's blocks (demotion pending at step 2); the sequence
    // ends at once (nothing in flight: its blocks are free again) ...
    let out = f.lease(2, false, &[spec(2, Prompt::Tokens(tokens(100, 24)))]);
    assert_eq!(of(grant(&out[0]), TierDirection::Demote).len(), 2);
    f.release(&[2], None);
    // ... and a lease in the same step (before CompleteStep) recomputes A:
    // no onboarding from a host block whose copy may not have run.
    let out = f.lease(2, false, &[spec(3, Prompt::Tokens(a.clone()))]);
    let g = grant(&out[0]);
    assert_eq!(g.reused_tokens, 0);
    assert!(of(g, TierDirection::Onboard).is_empty());
    for b in 0..16 {
        let state = f.cache.pools()[0].pool.host().state(b);
        assert_ne!(
            state,
            HostState::Pinned,
            "host block {b} read while pending"
        );
    }
    f.complete(2);
    f.check();
}

#[test]
fn a_failed_forward_never_publishes_its_demotions() {
    let mut f = tiered(4, 16);
    let a = tokens(0, 9);
    run_and_cache(&mut f, 1, a.clone(), 1);
    let out = f.lease(2, false, &[spec(2, Prompt::Tokens(tokens(100, 16)))]);
    assert_eq!(of(grant(&out[0]), TierDirection::Demote).len(), 2);
    // The pass of step 2 failed: the holder releases with discard_unwritten.
    f.release_failed(&[2], Some(2));
    assert_eq!(host(&f).pending, 0);
    assert_eq!(host(&f).free, 16);
    f.complete(2);
    assert_eq!(host(&f).cached, 0, "nothing published");
    let out = f.lease(3, false, &[spec(3, Prompt::Tokens(a))]);
    assert_eq!(grant(&out[0]).reused_tokens, 0);
    assert_eq!(f.cache.pools()[0].pool.counters.demotions_dropped, 2);
}

#[test]
fn a_demotion_at_a_completed_step_is_dropped_not_sent() {
    let mut f = tiered(4, 16);
    run_and_cache(&mut f, 1, tokens(0, 9), 1);
    f.lease(2, false, &[spec(2, Prompt::Count(4))]);
    f.complete(5);
    // An extend at step 3 (already complete: no later pass of it will run)
    // evicts A's two blocks.
    let out = f.extend(3, &[(2, crate::lease::Growth::Count(12))]);
    assert!(grant(&out[0]).tier_copies.is_empty());
    assert_eq!(host(&f).pending, 0);
    assert_eq!(f.cache.pools()[0].pool.counters.demotions_dropped, 2);
}

#[test]
fn no_host_room_is_a_plain_eviction_and_no_device_room_a_reject() {
    // Host tier of 1 block: of two evicted blocks one is kept.
    let mut f = tiered(3, 1);
    run_and_cache(&mut f, 1, tokens(0, 9), 1);
    let out = f.lease(2, false, &[spec(2, Prompt::Tokens(tokens(100, 12)))]);
    assert_eq!(of(grant(&out[0]), TierDirection::Demote).len(), 1);
    // Every device block in use, the host block pending: a third sequence
    // is refused by the device pool, as without a tier.
    let out = f.lease(2, false, &[spec(3, Prompt::Count(4))]);
    match &out[0] {
        Outcome::Reject(r) => assert_eq!(r.reason, RejectReason::PoolExhausted),
        Outcome::Grant(g) => panic!("granted {g:?}"),
    }
    f.complete(2);
    f.release(&[2], None);
    // The host block is cached, and B's three device blocks: evicting two
    // of them evicts the host block's hash to keep one, and drops the other.
    let out = f.lease(3, false, &[spec(4, Prompt::Tokens(tokens(200, 8)))]);
    assert_eq!(of(grant(&out[0]), TierDirection::Demote).len(), 1);
    f.complete(3);
    f.check();
}

#[test]
fn onboarding_sources_cannot_be_taken_by_demotions_of_the_same_lease() {
    // Device 3, host 2. A caches 2 blocks; B evicts them to the host.
    let mut f = tiered(3, 2);
    let a = tokens(0, 9);
    run_and_cache(&mut f, 1, a.clone(), 1);
    run_and_cache(&mut f, 2, tokens(100, 12), 2);
    assert_eq!(host(&f).cached, 2);
    // A again: onboards 2 blocks, needs 3 new device blocks, evicting B's
    // cached ones; their demotions find the host full of pinned sources
    // and are dropped (plain evictions), never overwriting a source.
    let out = f.lease(3, false, &[spec(3, Prompt::Tokens(a))]);
    let g = grant(&out[0]);
    assert_eq!(of(g, TierDirection::Onboard).len(), 2);
    assert!(of(g, TierDirection::Demote).is_empty());
    f.complete(3);
    f.check();
}

#[test]
fn session_expiry_drops_demotions_and_lifts_pins() {
    let mut f = tiered(4, 16);
    let a = tokens(0, 9);
    run_and_cache(&mut f, 1, a.clone(), 1);
    run_and_cache(&mut f, 2, tokens(100, 16), 2);
    f.lease(3, false, &[spec(3, Prompt::Tokens(a))]);
    f.lease(3, false, &[spec(4, Prompt::Tokens(tokens(300, 12)))]);
    assert!(host(&f).pinned > 0 && host(&f).pending > 0);
    f.cache.close_session(f.session, f.epoch, f.now).unwrap();
    let h = host(&f);
    assert_eq!((h.pinned, h.pending), (0, 0));
    f.check();
}

#[test]
fn events_say_which_tier() {
    let mut f = tiered(4, 16);
    run_and_cache(&mut f, 1, tokens(0, 9), 1);
    let before = f.cache.last_event_id();
    f.lease(2, false, &[spec(2, Prompt::Count(16))]);
    f.complete(2);
    let events = f.cache.events_since(before, 100).events;
    let mut tiers: Vec<Tier> = events.iter().map(|e| e.tier).collect();
    tiers.dedup();
    assert_eq!(tiers, vec![Tier::Device, Tier::Host], "{events:?}");
}
