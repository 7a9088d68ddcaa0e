//! The disk tier: spills on host eviction, loads on a prefix hit, the step
//! rules of both, a failed pass that distrusts what it loaded, and a new
//! worker incarnation that forgets memory and indexes the files it found.

use super::tiers::{grant, of, run_and_cache};
use super::{Fixture, GROUP, spec, tokens};
use crate::cache::{CacheConfig, DiskPool};
use crate::error::Error;
use crate::events::{EventKind, Tier};
use crate::lease::{Outcome, Prompt, TierDirection};
use crate::tier::{HostCounts, HostState};
use kvlease_auth::principal::ANONYMOUS;

/// One full-attention pool of `device` blocks of 4 tokens, a host tier of
/// `host` blocks and a disk tier of `disk` blocks (incarnation 1; partial
/// reuse off, so only full blocks stay cached).
fn tiered(device: u32, host: u32, disk: u32) -> Fixture {
    let config = CacheConfig {
        partial_reuse: false,
        ..CacheConfig::default()
    };
    let mut f = Fixture::with_tiers(config, 4, &[(0, device, host)]);
    let disks = [DiskPool {
        window: 0,
        blocks: disk,
        held: Vec::new(),
    }];
    f.cache
        .register_incarnation(ANONYMOUS, GROUP, 1, &disks, Some(f.session))
        .unwrap();
    f.check();
    f
}

fn disk(f: &Fixture) -> HostCounts {
    f.cache.pools()[0].pool.disk().counts()
}

/// Caches prompt A (2 full blocks), pushes it to the host with B (4
/// blocks), then to the disk with C (4 blocks): A's 2 blocks end on disk.
/// Returns A.
fn a_on_disk(f: &mut Fixture) -> Vec<u32> {
    let a = tokens(0, 9);
    run_and_cache(f, 1, a.clone(), 1);
    let b = run_and_cache(f, 2, tokens(100, 16), 2);
    assert_eq!(of(&b, TierDirection::Demote).len(), 2);
    assert!(of(&b, TierDirection::Spill).is_empty(), "the host had room");
    let out = f.lease(3, false, &[spec(3, Prompt::Tokens(tokens(200, 16)))]);
    let c = grant(&out[0]);
    let spills = of(c, TierDirection::Spill);
    assert_eq!(spills.len(), 2, "A's host blocks are spilled: {c:?}");
    // Every spill is named before the demotion that overwrites its host block.
    for s in &spills {
        let spill_at = c.tier_copies.iter().position(|x| x == s).unwrap();
        let demote_at = c
            .tier_copies
            .iter()
            .position(|x| x.direction == TierDirection::Demote && x.host_block == s.host_block)
            .unwrap();
        assert!(spill_at < demote_at);
    }
    let chain = crate::prefix::chain(0, &a, 4);
    assert_eq!(
        spills[0].hash, chain[1],
        "leaves first, as they left the device"
    );
    assert_eq!(disk(f).pending, 2);
    assert_eq!(
        f.cache.pools()[0].pool.disk().lookup(chain[0]),
        None,
        "a spill in flight is never read"
    );
    f.complete(3);
    f.release(&[3], None);
    assert_eq!(disk(f).cached, 2);
    a
}

#[test]
fn a_prefix_evicted_from_device_and_host_is_loaded_from_disk() {
    let mut f = tiered(4, 2, 8);
    let a = a_on_disk(&mut f);
    let out = f.lease(4, false, &[spec(4, Prompt::Tokens(a.clone()))]);
    let g = grant(&out[0]);
    assert_eq!(g.reused_tokens, 8);
    let loads = of(g, TierDirection::Load);
    assert_eq!(loads.len(), 2);
    let chain = crate::prefix::chain(0, &a, 4);
    assert_eq!(loads[0].device_block, g.tables[0].block_ids[0]);
    assert_eq!((loads[0].hash, loads[0].parent), (chain[0], 0));
    assert_eq!((loads[1].hash, loads[1].parent), (chain[1], chain[0]));
    assert_eq!(
        disk(&f).pinned,
        2,
        "sources pinned until the step completes"
    );
    for l in &loads {
        assert_eq!(
            f.cache.pools()[0].pool.disk().state(l.disk_block),
            HostState::Pinned
        );
    }
    f.complete(4);
    assert_eq!(disk(&f).pinned, 0);
    // A stays on disk too; the lease's allocations pushed B from the host
    // to the disk as well.
    let d = f.cache.pools()[0].pool.disk();
    assert!(chain[..2].iter().all(|&h| d.lookup(h).is_some()));
    assert_eq!(disk(&f).cached, 4);
    f.release(&[4], None);
    let p = &f.cache.pools()[0].pool;
    assert_eq!((p.counters.spills, p.counters.loads), (4, 2));
    assert_eq!(p.counters.onboards, 2, "loads count as onboards");
    f.check();
}

#[test]
fn a_failed_pass_drops_the_disk_blocks_it_loaded_and_a_retry_recomputes() {
    let mut f = tiered(4, 2, 8);
    let a = a_on_disk(&mut f);
    let out = f.lease(4, false, &[spec(4, Prompt::Tokens(a.clone()))]);
    assert_eq!(of(grant(&out[0]), TierDirection::Load).len(), 2);
    // The worker found a bad file and failed the pass.
    f.release_failed(&[4], None);
    let chain = crate::prefix::chain(0, &a, 4);
    let d = f.cache.pools()[0].pool.disk();
    assert!(chain[..2].iter().all(|&h| d.lookup(h).is_none()));
    assert_eq!(disk(&f).pinned, 2, "pins stay until the step completes");
    assert_eq!(f.cache.pools()[0].pool.counters.disk_invalidated, 2);
    f.complete(4);
    assert_eq!(disk(&f).pinned, 0);
    assert_eq!(disk(&f).free, 8, "the distrusted blocks are free again");
    // The retry recomputes: nothing is loaded again.
    let out = f.lease(5, false, &[spec(5, Prompt::Tokens(a))]);
    let g = grant(&out[0]);
    assert_eq!(g.reused_tokens, 0);
    assert!(of(g, TierDirection::Load).is_empty());
    f.check();
}

#[test]
fn a_failed_pass_never_publishes_its_spills() {
    let mut f = tiered(4, 2, 8);
    let a = tokens(0, 9);
    run_and_cache(&mut f, 1, a.clone(), 1);
    run_and_cache(&mut f, 2, tokens(100, 16), 2);
    let out = f.lease(3, false, &[spec(3, Prompt::Tokens(tokens(200, 16)))]);
    assert_eq!(of(grant(&out[0]), TierDirection::Spill).len(), 2);
    f.release_failed(&[3], None);
    assert_eq!(disk(&f).pending, 0);
    f.complete(3);
    assert_eq!(disk(&f).cached, 0, "the spill may never have run");
    let out = f.lease(4, false, &[spec(4, Prompt::Tokens(a))]);
    assert_eq!(grant(&out[0]).reused_tokens, 0);
    f.check();
}

#[test]
fn a_full_disk_evicts_its_oldest_block_and_pinned_ones_are_never_taken() {
    // 1 disk block: the second spill takes the first one's block.
    let mut f = tiered(4, 2, 1);
    run_and_cache(&mut f, 1, tokens(0, 9), 1);
    run_and_cache(&mut f, 2, tokens(100, 16), 2);
    let c = run_and_cache(&mut f, 3, tokens(200, 16), 3);
    assert_eq!(
        of(&c, TierDirection::Spill).len(),
        1,
        "one disk block, one spill (the other host block is dropped)"
    );
    assert_eq!(disk(&f).cached, 1);
    let d = run_and_cache(&mut f, 4, tokens(300, 16), 4);
    assert_eq!(of(&d, TierDirection::Spill).len(), 1);
    assert_eq!(disk(&f).cached, 1);
    f.check();
}

#[test]
fn session_end_drops_spills_and_lifts_load_pins() {
    let mut f = tiered(4, 2, 8);
    let a = a_on_disk(&mut f);
    let out = f.lease(4, false, &[spec(4, Prompt::Tokens(a))]);
    assert_eq!(of(grant(&out[0]), TierDirection::Load).len(), 2);
    f.cache.close_session(f.session, f.epoch, f.now).unwrap();
    assert_eq!(disk(&f).pinned, 0);
    assert_eq!(disk(&f).cached, 2, "a session's end distrusts nothing");
    f.check();
}

#[test]
fn events_name_the_disk_tier() {
    let mut f = tiered(4, 2, 8);
    let a = a_on_disk(&mut f);
    let chain = crate::prefix::chain(0, &a, 4);
    let events = f.cache.events_since(0, 1000).events;
    let stored_on_disk: Vec<u64> = events
        .iter()
        .filter(|e| e.tier == Tier::Disk)
        .flat_map(|e| match &e.kind {
            EventKind::Stored { hashes, .. } => hashes.clone(),
            EventKind::Removed { .. } => Vec::new(),
        })
        .collect();
    let mut want = chain[..2].to_vec();
    want.sort_unstable();
    let mut got = stored_on_disk;
    got.sort_unstable();
    assert_eq!(got, want);
}

#[test]
fn a_new_incarnation_forgets_memory_and_indexes_the_files_it_found() {
    let mut f = tiered(4, 2, 8);
    let a = tokens(0, 9);
    run_and_cache(&mut f, 1, a.clone(), 1);
    let chain = crate::prefix::chain(0, &a, 4);
    // The worker restarted; it found two files of A's blocks (blocks 5, 6)
    // and one of an unknown hash.
    let disks = [DiskPool {
        window: 0,
        blocks: 8,
        held: vec![(5, chain[0], 0), (6, chain[1], chain[0]), (7, 0xdead, 0)],
    }];
    let r = f
        .cache
        .register_incarnation(ANONYMOUS, GROUP, 2, &disks, Some(f.session))
        .unwrap();
    assert!(r.new_incarnation && r.memory_forgotten);
    assert_eq!(r.disk_blocks_indexed, 3);
    f.check();
    let p = &f.cache.pools()[0].pool;
    assert_eq!(p.counts().cached, 0, "device content is gone");
    assert_eq!(p.counts().free, 4);
    assert_eq!(disk(&f).cached, 3);
    // A comes back from the files.
    let out = f.lease(2, false, &[spec(2, Prompt::Tokens(a))]);
    let g = grant(&out[0]);
    assert_eq!(g.reused_tokens, 8);
    let loads = of(g, TierDirection::Load);
    assert_eq!(
        loads.iter().map(|l| l.disk_block).collect::<Vec<_>>(),
        [5, 6]
    );
    // The same incarnation again (a scheduler restart) changes nothing ...
    let again = f
        .cache
        .register_incarnation(ANONYMOUS, GROUP, 2, &[], Some(f.session))
        .unwrap();
    assert!(!again.new_incarnation);
    // ... and another one waits while a session loads from the disk.
    let busy = f
        .cache
        .register_incarnation(ANONYMOUS, GROUP, 3, &disks, Some(f.session))
        .unwrap_err();
    assert!(matches!(busy, Error::IncarnationBusy { .. }), "{busy}");
    f.complete(2);
    f.release(&[2], None);
    f.cache
        .register_incarnation(ANONYMOUS, GROUP, 3, &disks, Some(f.session))
        .unwrap();
    f.check();
}

#[test]
fn a_new_incarnation_waits_while_a_session_holds_blocks_and_then_forgets_them() {
    let mut f = tiered(8, 2, 8);
    let a = tokens(0, 9);
    let out = f.lease(1, false, &[spec(1, Prompt::Tokens(a.clone()))]);
    grant(&out[0]);
    f.complete(1);
    // held by sequence 1 (published) when the worker restarts: refused,
    // nothing changed
    let busy = f
        .cache
        .register_incarnation(ANONYMOUS, GROUP, 2, &[], Some(f.session))
        .unwrap_err();
    assert!(matches!(busy, Error::IncarnationBusy { .. }), "{busy}");
    assert!(busy.to_string().contains("in use"), "{busy}");
    f.check();
    f.release(&[1], Some(2));
    assert!(
        f.cache
            .register_incarnation(ANONYMOUS, GROUP, 2, &[], Some(f.session))
            .is_err(),
        "fenced blocks are held too"
    );
    f.complete(2);
    assert_eq!(f.counts()[0].cached, 2);
    let r = f
        .cache
        .register_incarnation(ANONYMOUS, GROUP, 2, &[], Some(f.session))
        .unwrap();
    assert!(r.new_incarnation);
    f.check();
    assert_eq!(f.counts()[0].cached, 0);
    let out = f.lease(3, false, &[spec(2, Prompt::Tokens(a))]);
    assert_eq!(grant(&out[0]).reused_tokens, 0, "forgotten");
    f.release(&[2], None);
    let c = f.counts()[0];
    assert_eq!(c.free + c.cached, c.total);
    f.check();
}

#[test]
fn malformed_disk_tiers_are_refused_and_change_nothing() {
    let mut f = tiered(4, 2, 8);
    let cases = [
        (
            1,
            DiskPool {
                window: 5,
                blocks: 4,
                held: vec![],
            },
            "no pool of that window",
        ),
        (
            9,
            DiskPool {
                window: 0,
                blocks: 4,
                held: vec![(4, 1, 0)],
            },
            "block 4 is out of range",
        ),
        (
            9,
            DiskPool {
                window: 0,
                blocks: 4,
                held: vec![(1, 1, 0), (1, 2, 0)],
            },
            "listed twice",
        ),
        (
            0,
            DiskPool {
                window: 0,
                blocks: 4,
                held: vec![],
            },
            "needs a worker_incarnation",
        ),
        (
            9,
            DiskPool {
                window: 0,
                blocks: u32::MAX,
                held: vec![],
            },
            "disk_blocks of window 0 must be",
        ),
    ];
    for (incarnation, d, want) in cases {
        let err = f
            .cache
            .register_incarnation(ANONYMOUS, GROUP, incarnation, &[d], Some(f.session))
            .unwrap_err();
        assert!(matches!(err, Error::InvalidArgument(_)), "{err}");
        assert!(err.to_string().contains(want), "{err} lacks {want:?}");
        assert_eq!(disk(&f).total, 8, "nothing changed");
    }
    // no host tier, no disk tier
    let mut bare = Fixture::with_tiers(CacheConfig::default(), 4, &[(0, 4, 0)]);
    let d = DiskPool {
        window: 0,
        blocks: 4,
        held: vec![],
    };
    let err = bare
        .cache
        .register_incarnation(ANONYMOUS, GROUP, 1, &[d], Some(bare.session))
        .unwrap_err();
    assert!(err.to_string().contains("needs a host tier"), "{err}");
    bare.check();
}

mod conservation {
    //! A property test aimed at the disk tier: tiny device and host pools
    //! push prompts through the host to the disk and back, with failed
    //! passes and worker restarts between them. After every operation the
    //! invariants hold (conservation per pool and tier, pins and pending
    //! blocks accounted to steps); every block a lease reuses (device, host
    //! or disk) holds that prompt's tokens, as the holder's worker moved
    //! them; at the end nothing is pending or pinned and the pools are whole.

    use std::collections::HashMap;

    use proptest::prelude::*;

    use super::super::proptests::{TierModel, write_content};
    use super::*;

    #[derive(Debug, Clone)]
    enum Op {
        /// Serve a prompt of `len` tokens of family `fam`: lease, complete
        /// (or fail the pass), release.
        Serve { fam: u8, len: u8, fail: bool },
        /// The worker starts again with its files.
        Restart,
    }

    /// Loads the runs named, so a test can tell the generator reaches them.
    static LOADS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            8 => (0u8..5, 5u8..24, prop::bool::weighted(0.1))
                .prop_map(|(fam, len, fail)| Op::Serve { fam, len, fail }),
            1 => Just(Op::Restart),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 2_000, ..ProptestConfig::default() })]

        #[test]
        fn disk_spills_and_loads_conserve_blocks_and_content(
            ops in prop::collection::vec(op(), 1..40),
            host in 1u32..4,
            disk_blocks in prop::sample::select(vec![2u32, 6, 20]),
        ) {
            let mut f = tiered(7, host, disk_blocks);
            let mut tiers = TierModel::default();
            let mut content: HashMap<(u32, u32), Vec<u32>> = HashMap::new();
            let (mut step, mut incarnation, mut loads) = (1u64, 1u64, 0usize);
            for op in ops {
                match op {
                    Op::Serve { fam, len, fail } => {
                        let ids: Vec<u32> = (0..u32::from(len)).map(|i| u32::from(fam) * 100 + i).collect();
                        let out = f.lease(step, false, &[spec(1, Prompt::Tokens(ids.clone()))]);
                        if let Outcome::Grant(g) = &out[0] {
                            for c in &g.tier_copies {
                                let d = f.cache.pools()[0].pool.disk();
                                match c.direction {
                                    TierDirection::Spill => prop_assert_eq!(d.state(c.disk_block), HostState::Pending),
                                    TierDirection::Load => prop_assert_eq!(d.state(c.disk_block), HostState::Pinned),
                                    _ => {}
                                }
                            }
                            loads += of(g, TierDirection::Load).len();
                            tiers.apply(&mut content, &g.tier_copies);
                            let full = (g.reused_tokens / 4) as usize;
                            let t = &g.tables[0];
                            for (i, &block) in t.block_ids.iter().enumerate().take(full) {
                                let held = content.get(&(t.pool_id, block)).cloned().unwrap_or_default();
                                prop_assert_eq!(&held[..], &ids[i * 4..(i + 1) * 4], "reused block {} (index {})", block, i);
                            }
                            if fail {
                                tiers.fail();
                                f.release_failed(&[1], None);
                            } else {
                                write_content(&mut content, &g.tables, &ids, 4);
                                f.complete(step);
                                tiers.complete();
                                f.release(&[1], None);
                            }
                        }
                        if fail {
                            f.complete(step);
                        }
                        step += 1;
                    }
                    Op::Restart => {
                        incarnation += 1;
                        let d = f.cache.pools()[0].pool.disk();
                        let held = (0..d.len())
                            .filter_map(|b| d.content(b).map(|(h, p)| (b, h, p)))
                            .collect();
                        let disks = [DiskPool { window: 0, blocks: d.len(), held }];
                        f.cache.register_incarnation(ANONYMOUS, GROUP, incarnation, &disks, Some(f.session)).unwrap();
                        // device and host memory are gone, the files stay
                        tiers.host.clear();
                        content.clear();
                        f.check();
                    }
                }
            }
            let c = f.counts()[0];
            prop_assert_eq!((c.in_use, c.fenced), (0, 0));
            prop_assert_eq!(c.free + c.cached, c.total);
            let d = disk(&f);
            prop_assert_eq!((d.pending, d.pinned), (0, 0));
            prop_assert_eq!(d.free + d.cached, d.total);
            LOADS.fetch_add(loads, std::sync::atomic::Ordering::Relaxed);
        }
    }

    #[test]
    fn the_generator_reaches_disk_loads() {
        disk_spills_and_loads_conserve_blocks_and_content();
        assert!(
            LOADS.load(std::sync::atomic::Ordering::Relaxed) > 100,
            "the property test hardly ever loads from disk"
        );
    }
}

#[test]
fn a_first_incarnation_is_adopted_without_forgetting_even_while_blocks_are_held() {
    // registered by an older holder (no incarnation); a sequence holds blocks
    let mut f = Fixture::with_tiers(CacheConfig::default(), 4, &[(0, 8, 2)]);
    let out = f.lease(1, false, &[spec(1, Prompt::Tokens(tokens(0, 9)))]);
    grant(&out[0]);
    f.complete(1);
    let before = f.counts();
    let disks = [DiskPool {
        window: 0,
        blocks: 4,
        held: vec![(2, 0xbeef, 0)],
    }];
    let r = f
        .cache
        .register_incarnation(ANONYMOUS, GROUP, 5, &disks, Some(f.session))
        .unwrap();
    assert!(r.new_incarnation && !r.memory_forgotten);
    assert_eq!(f.counts(), before);
    assert_eq!(disk(&f).cached, 1);
    f.check();
}

/// Two schedulers with one group name: the second one's worker (another
/// incarnation) may not take the group while the first one's session, which
/// leased in it, is open, even with nothing held; the first may register its
/// own worker's restart; once it is gone the second takes the group.
#[test]
fn a_new_incarnation_waits_while_another_open_session_drives_the_group() {
    let mut f = tiered(8, 2, 8);
    let a = tokens(0, 9);
    run_and_cache(&mut f, 1, a, 1);
    assert_eq!(f.counts()[0].cached, 2, "idle: nothing in use or fenced");
    let other = f.cache.open_session("scheduler-b", None, f.now).unwrap();
    let busy = f
        .cache
        .register_incarnation(ANONYMOUS, GROUP, 2, &[], Some(other.session_id))
        .unwrap_err();
    assert!(matches!(busy, Error::IncarnationBusy { .. }), "{busy}");
    let message = busy.to_string();
    for want in [
        format!("session {}", f.session),
        "still open".to_string(),
        "--pool-group-prefix".to_string(),
    ] {
        assert!(message.contains(&want), "{message} lacks {want:?}");
    }
    // without a session the driver counts as well; nothing was forgotten
    assert!(
        f.cache
            .register_incarnation(ANONYMOUS, GROUP, 2, &[], None)
            .is_err()
    );
    assert_eq!(f.counts()[0].cached, 2);
    f.check();
    // a session that is not the caller's, or not open, registers nothing
    let stranger = f
        .cache
        .open_session_for("mallory", "m", None, f.now)
        .unwrap();
    let err = f
        .cache
        .register_incarnation(ANONYMOUS, GROUP, 2, &[], Some(stranger.session_id))
        .unwrap_err();
    assert!(matches!(err, Error::NotOwner { .. }), "{err}");
    let err = f
        .cache
        .register_incarnation(ANONYMOUS, GROUP, 2, &[], Some(crate::SessionId(7)))
        .unwrap_err();
    assert!(matches!(err, Error::UnknownSession(_)), "{err}");
    // the driving session may register its own worker's restart (its
    // worker came back as incarnation 3): memory forgotten
    let own = f
        .cache
        .register_incarnation(ANONYMOUS, GROUP, 3, &[], Some(f.session))
        .unwrap();
    assert!(own.memory_forgotten, "{own:?}");
    assert_eq!(f.counts()[0].cached, 0);
    f.check();
    // once the first scheduler's session is gone, the second one's worker
    // takes the group
    f.cache.close_session(f.session, f.epoch, f.now).unwrap();
    let taken = f
        .cache
        .register_incarnation(ANONYMOUS, GROUP, 4, &[], Some(other.session_id))
        .unwrap();
    assert!(taken.new_incarnation, "{taken:?}");
}
