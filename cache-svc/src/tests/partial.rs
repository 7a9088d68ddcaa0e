//! Partial-block reuse: a released sequence's partly filled last block kept
//! and granted as a copy of its matching slots.

use std::time::Duration;

use super::{Fixture, spec, tokens, whole};
use crate::cache::CacheConfig;
use crate::lease::{Growth, Prompt, RejectReason};
use crate::pool::BlockState;
/// Turn 1: a 10-token prompt (blocks of 4: two full, one holding 2 tokens),
/// step 1 completed, released fenced at step 2 and step 2 completed.
fn ended_turn(config: CacheConfig, pool_blocks: u32) -> Fixture {
    let mut f = Fixture::with_config(config, 4, &[(0, pool_blocks)]);
    f.lease(1, false, &[spec(1, Prompt::Tokens(tokens(0, 10)))]);
    f.complete(1);
    f.release(&[1], Some(2));
    f.complete(2);
    f
}

#[test]
fn partial_block_reuse_grants_a_copy_of_the_matching_slots_and_pins_the_source() {
    let mut f = ended_turn(CacheConfig::default(), 16);
    let c = f.counts()[0];
    assert_eq!(
        (c.cached, c.in_use),
        (3, 0),
        "two full blocks and the partial one stay cached"
    );
    assert_eq!(f.cache.pools()[0].pool.partial_blocks(), 1);
    let turn1 = [0, 1, 2]; // seq 1's blocks, allocated in order
    // Turn 2 repeats turn 1's 10 tokens and goes on.
    let out = f.lease(3, false, &[spec(2, Prompt::Tokens(tokens(0, 14)))]);
    let g = out[0].grant().unwrap();
    assert_eq!(g.reused_tokens, 10, "8 from full blocks, 2 copied");
    assert_eq!(g.tables[0].block_ids[..2], turn1[..2]);
    let dst = g.tables[0].block_ids[2];
    assert_ne!(dst, turn1[2], "the partial block is copied, never shared");
    assert_eq!(
        g.copies,
        vec![crate::lease::BlockCopy {
            pool_id: g.tables[0].pool_id,
            window: 0,
            src_block: turn1[2],
            dst_block: dst,
            tokens: 2,
        }]
    );
    let pool = &f.cache.pools()[0].pool;
    assert_eq!(
        pool.state(turn1[2]),
        BlockState::Fenced,
        "pinned until step 3 completes"
    );
    f.complete(3);
    let pool = &f.cache.pools()[0].pool;
    assert_eq!(
        pool.state(turn1[2]),
        BlockState::Cached,
        "back in the cache, still reusable"
    );
    assert!(f.cache.audit().reclaimed.is_empty());
    // A prompt that shares only the first kept token copies one slot; one
    // that diverges at once copies nothing.
    let mut one = tokens(0, 9);
    one.extend([99, 98]);
    let out = f.lease(4, false, &[spec(3, Prompt::Tokens(one))]);
    let g = out[0].grant().unwrap();
    assert_eq!((g.reused_tokens, g.copies[0].tokens), (9, 1));
    let mut none = tokens(0, 8);
    none.extend([99, 98]);
    let out = f.lease(4, false, &[spec(4, Prompt::Tokens(none))]);
    let g = out[0].grant().unwrap();
    assert_eq!((g.reused_tokens, g.copies.len()), (8, 0));
    // The last prompt token is always computed: a prompt that ends inside
    // the kept tokens copies all but its last.
    let out = f.lease(4, false, &[spec(5, Prompt::Tokens(tokens(0, 10)))]);
    let g = out[0].grant().unwrap();
    assert_eq!((g.reused_tokens, g.copies[0].tokens), (9, 1));
    f.release(&[2, 3, 4, 5], Some(4));
    f.complete(4);
    assert!(whole(&f.counts()));
}

#[test]
fn partial_block_reuse_off_keeps_and_copies_nothing() {
    let config = CacheConfig {
        partial_reuse: false,
        ..CacheConfig::default()
    };
    let mut f = ended_turn(config, 16);
    assert_eq!(f.counts()[0].cached, 2);
    let out = f.lease(3, false, &[spec(2, Prompt::Tokens(tokens(0, 14)))]);
    let g = out[0].grant().unwrap();
    assert_eq!((g.reused_tokens, g.copies.len()), (8, 0));
}

#[test]
fn the_copy_source_is_never_evicted_to_make_room_for_its_own_lease() {
    // 6 blocks: 2 full + 1 partial cached, 3 free. A 22-token prompt reuses
    // 2 blocks and needs 4 new ones: only by evicting its own copy source.
    let mut f = ended_turn(CacheConfig::default(), 6);
    let out = f.lease(3, false, &[spec(2, Prompt::Tokens(tokens(0, 22)))]);
    let r = out[0].reject().unwrap();
    assert_eq!(r.reason, RejectReason::PoolExhausted);
    assert_eq!(f.cache.pools()[0].pool.partial_blocks(), 1);
    // Without the partial match the same lease fits (it evicts the block).
    let mut other = tokens(0, 8);
    other.extend(tokens(500, 14));
    let out = f.lease(3, false, &[spec(3, Prompt::Tokens(other))]);
    assert!(out[0].grant().is_some_and(|g| g.copies.is_empty()));
    assert_eq!(f.cache.pools()[0].pool.partial_blocks(), 0);
}

#[test]
fn a_partial_block_is_kept_only_once_its_writing_step_completes() {
    let mut f = Fixture::new(4, &[(0, 16)]);
    // Released unfenced before step 1 completed: its KV may not be there.
    f.lease(1, false, &[spec(1, Prompt::Tokens(tokens(0, 10)))]);
    f.release(&[1], None);
    assert_eq!(f.cache.pools()[0].pool.partial_blocks(), 0);
    // Released fenced at the writing step: kept when that step completes.
    f.lease(2, false, &[spec(2, Prompt::Tokens(tokens(0, 10)))]);
    f.release(&[2], Some(2));
    let turn2 = |tail: u32| {
        let mut t = tokens(0, 10);
        t.extend(tokens(tail, 4));
        Prompt::Tokens(t)
    };
    let out = f.lease(2, false, &[spec(3, turn2(50))]);
    assert!(out[0].grant().is_some_and(|g| g.copies.is_empty()));
    f.complete(2);
    assert_eq!(f.cache.pools()[0].pool.partial_blocks(), 1);
    let out = f.lease(3, false, &[spec(4, turn2(60))]);
    assert_eq!(out[0].grant().unwrap().copies[0].tokens, 2);
    // An extend's tokens count from the extend's step: 10 + 1 tokens.
    f.lease(3, false, &[spec(5, Prompt::Tokens(tokens(1000, 10)))]);
    f.complete(3);
    f.extend(4, &[(5, Growth::Tokens(vec![1010]))]);
    f.release(&[5], None);
    let mut next = tokens(1000, 11);
    next.push(7);
    let out = f.lease(5, false, &[spec(6, Prompt::Tokens(next.clone()))]);
    assert!(
        out[0].grant().is_some_and(|g| g.copies.is_empty()),
        "step 4 never completed: nothing kept"
    );
    f.lease(5, false, &[spec(7, Prompt::Tokens(tokens(1000, 10)))]);
    f.complete(5);
    f.extend(6, &[(7, Growth::Tokens(vec![1010]))]);
    f.complete(6);
    f.release(&[7], None);
    let out = f.lease(7, false, &[spec(8, Prompt::Tokens(next))]);
    assert_eq!(out[0].grant().unwrap().copies[0].tokens, 3);
    assert!(f.cache.audit().reclaimed.is_empty());
}

#[test]
fn a_windowed_group_copies_in_every_pool_or_none() {
    let mut f = Fixture::new(4, &[(0, 16), (8, 16)]);
    f.lease(1, false, &[spec(1, Prompt::Tokens(tokens(0, 10)))]);
    f.complete(1);
    f.release(&[1], Some(1));
    let out = f.lease(2, false, &[spec(2, Prompt::Tokens(tokens(0, 14)))]);
    let g = out[0].grant().unwrap();
    assert_eq!(g.reused_tokens, 10);
    assert_eq!(g.copies.len(), 2);
    for c in &g.copies {
        let t = g.tables.iter().find(|t| t.pool_id == c.pool_id).unwrap();
        assert_eq!(t.block_ids[(2 - t.first_block) as usize], c.dst_block);
        assert_eq!(c.tokens, 2);
    }
}

#[test]
fn session_expiry_drops_pending_partial_blocks_and_lifts_copy_pins() {
    let mut f = ended_turn(CacheConfig::default(), 16);
    f.lease(3, false, &[spec(2, Prompt::Tokens(tokens(0, 14)))]);
    f.release(&[2], Some(3));
    f.now += Duration::from_secs(3600);
    f.cache.expire_sessions(f.now);
    f.check();
    let c = f.counts()[0];
    assert_eq!((c.in_use, c.fenced), (0, 0));
    // Turn 1's kept partial stays; turn 2's (pending on step 3) does not.
    assert_eq!(f.cache.pools()[0].pool.partial_blocks(), 1);
    assert!(f.cache.audit().reclaimed.is_empty());
}

#[test]
fn a_partial_block_holding_fewer_tokens_than_it_must_save_is_freed() {
    // Turn 1's partial block holds 2 tokens: kept at a minimum of 2, freed
    // (and never copied) at 3.
    for (min, kept) in [(2, true), (3, false)] {
        let config = CacheConfig {
            partial_min_tokens: min,
            ..CacheConfig::default()
        };
        let mut f = ended_turn(config, 16);
        let c = f.counts()[0];
        assert_eq!(c.cached, if kept { 3 } else { 2 }, "minimum {min}");
        assert_eq!(f.cache.pools()[0].pool.partial_blocks(), usize::from(kept));
        let out = f.lease(3, false, &[spec(2, Prompt::Tokens(tokens(0, 14)))]);
        let g = out[0].grant().unwrap();
        assert_eq!(g.copies.len(), usize::from(kept), "minimum {min}");
        assert_eq!(g.reused_tokens, if kept { 10 } else { 8 });
        f.check();
    }
}

#[test]
fn a_kept_partial_block_is_evicted_before_the_full_blocks_of_its_release() {
    // 4 blocks: turn 1 leaves full blocks 0 and 1 (1 the leaf) and the
    // partial block 2 cached, released together, and 1 free. A 5-token
    // prompt of other tokens needs 2 blocks: the one free and one victim,
    // which must be the partial block (useless without block 1), not the
    // full leaf 1 released just before it.
    let mut f = ended_turn(CacheConfig::default(), 4);
    assert_eq!(f.counts()[0].cached, 3);
    let out = f.lease(3, false, &[spec(2, Prompt::Tokens(tokens(500, 5)))]);
    assert!(out[0].grant().is_some());
    let pool = &f.cache.pools()[0].pool;
    assert_eq!(pool.partial_blocks(), 0, "the partial block went");
    assert_eq!(pool.state(1), BlockState::Cached, "the full leaf stays");
    f.check();
}
