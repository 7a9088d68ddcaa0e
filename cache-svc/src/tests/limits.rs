//! The limits of the core (issues 13 and 29): sessions, pool groups (in all
//! and per principal), the memory budget, blocks per principal, quotas,
//! unregistering, names, `CompleteStep(u64::MAX)` and the sliced audit.

use std::time::Instant;

use super::{Fixture, GROUP, spec, tokens, whole};
use crate::cache::{AuditCursor, AuditReport, Batch, Cache, CacheConfig, Registration, check_name};
use crate::error::Error;
use crate::eviction::{EvictionConfig, PolicyKind};
use crate::ids::Step;
use crate::lease::{Prompt, RejectReason};

#[test]
fn complete_step_at_u64_max_returns_every_fence_instead_of_overflowing() {
    let mut f = Fixture::new(4, &[(0, 16)]);
    f.lease(1, false, &[spec(1, Prompt::Tokens(tokens(0, 8)))]);
    f.lease(2, false, &[spec(2, Prompt::Count(8))]);
    f.release(&[1], Some(3));
    f.release(&[2], Some(1_000));
    assert_eq!(f.counts()[0].fenced, 4);
    assert_eq!(f.complete(u64::MAX), 4);
    assert!(whole(&f.counts()));
    // the published prompt blocks of sequence 1 are cached, not lost
    assert_eq!(f.counts()[0].cached, 2);
}

#[test]
fn sessions_are_limited_in_all_and_per_key_and_slots_come_back() {
    let mut cache = Cache::new(CacheConfig {
        max_sessions: 3,
        max_sessions_per_holder: 2,
        ..CacheConfig::default()
    });
    let now = Instant::now();
    let a = cache.open_session("a", None, now).unwrap();
    cache.open_session("a", None, now).unwrap();
    let err = cache.open_session("a", None, now).unwrap_err();
    assert!(matches!(err, Error::LimitExceeded(_)), "{err}");
    assert!(
        err.to_string()
            .contains("\"a\" has 2 sessions open, the limit per holder is 2")
    );
    // the key is a parameter: another principal may use the same holder name
    cache
        .open_session_for("principal-b", "a", None, now)
        .unwrap();
    let err = cache.open_session("c", None, now).unwrap_err();
    assert!(
        err.to_string()
            .contains("3 sessions are open, the service limit is 3"),
        "{err}"
    );
    cache.close_session(a.session_id, a.epoch, now).unwrap();
    cache.open_session("a", None, now).unwrap();
}

#[test]
fn names_that_reach_logs_hold_only_the_safe_characters() {
    assert!(check_name("holder", "sched-1/replica_0:a@b+c.d").is_ok());
    for bad in ["", "a\nb", "a b", "é", "a\u{1b}[31m", &"x".repeat(129)] {
        let err = check_name("holder", bad).unwrap_err();
        assert!(matches!(err, Error::InvalidArgument(_)), "{bad:?}: {err}");
        assert!(err.to_string().contains("holder"), "{err}");
    }
    let mut cache = Cache::new(CacheConfig::default());
    let err = cache.register_pool("g\nx", 4, &[(0, 4)]).unwrap_err();
    assert!(err.to_string().contains("'\\n' at byte 1"), "{err}");
}

#[test]
fn pool_groups_and_block_state_are_limited_with_figures() {
    let mut cache = Cache::new(CacheConfig {
        max_pool_groups: 2,
        pool_memory_budget: 96 * 1000,
        eviction: EvictionConfig {
            default: PolicyKind::Lru,
            groups: Vec::new(),
        },
        ..CacheConfig::default()
    });
    cache.register_pool("a", 4, &[(0, 400)]).unwrap();
    let err = cache
        .register_pool("b", 4, &[(0, 500), (64, 200)])
        .unwrap_err();
    assert!(matches!(err, Error::LimitExceeded(_)), "{err}");
    let text = err.to_string();
    for needle in [
        "asks for 700 blocks, 67200 bytes of cache state with eviction policy lru (96 bytes a block)",
        "with the 38400 bytes registered",
        "budget of 96000 bytes",
        "(57600 bytes left: 600 more blocks fit in one such pool)",
    ] {
        assert!(text.contains(needle), "{needle:?} not in {text}");
    }
    cache.register_pool("b", 4, &[(0, 300)]).unwrap();
    // the same geometry again is no new group
    cache.register_pool("b", 4, &[(0, 300)]).unwrap();
    let err = cache.register_pool("c", 4, &[(0, 1)]).unwrap_err();
    assert!(
        err.to_string()
            .contains("2 pool groups are registered, the limit is 2"),
        "{err}"
    );
}

#[test]
fn an_adaptive_pool_counts_its_three_policies_and_shadows_in_the_budget() {
    // 1,000 blocks at 96 bytes fit a budget of 1 MiB under `lru`; under
    // `adaptive` the two filters alone take 512 KiB, the shadows more.
    let config = |default| CacheConfig {
        pool_memory_budget: 1 << 20,
        eviction: EvictionConfig {
            default,
            groups: vec![("small".into(), PolicyKind::Adaptive)],
        },
        ..CacheConfig::default()
    };
    let mut cache = Cache::new(config(PolicyKind::Lru));
    cache.register_pool("a", 4, &[(0, 1000)]).unwrap();
    assert_eq!(cache.registered_bytes(), 96_000);
    let mut cache = Cache::new(config(PolicyKind::Adaptive));
    let err = cache.register_pool("a", 4, &[(0, 1000)]).unwrap_err();
    assert!(matches!(err, Error::LimitExceeded(_)), "{err}");
    let text = err.to_string();
    assert!(text.contains("with eviction policy adaptive"), "{text}");
    let need = 96_000 + PolicyKind::Adaptive.extra_bytes(1000);
    assert!(
        text.contains(&format!("{need} bytes of cache state")),
        "{text}"
    );
    // what fits is what the policy's own bytes leave, not budget / 96
    let fit = 96 + PolicyKind::Adaptive.extra_bytes(1);
    assert!(fit > 512 << 10, "{fit}");
    let n: u32 = text
        .split(" bytes left: ")
        .nth(1)
        .and_then(|t| t.split(' ').next())
        .and_then(|t| t.parse().ok())
        .unwrap_or_else(|| panic!("no blocks that fit in {text}"));
    assert!(n > 0 && n < 1000, "{text}");
    let at = |n: u32| 96 * u64::from(n) + PolicyKind::Adaptive.extra_bytes(n);
    assert!(at(n) <= 1 << 20 && at(n + 1) > 1 << 20, "{text}");
    // a smaller adaptive pool fits, and is counted with its policy's bytes
    cache.register_pool("small", 4, &[(0, 100)]).unwrap();
    assert_eq!(
        cache.registered_bytes(),
        9_600 + PolicyKind::Adaptive.extra_bytes(100)
    );
}

#[test]
fn unregister_waits_for_the_group_to_be_idle_then_frees_it_for_good() {
    let mut f = Fixture::new(4, &[(0, 8), (16, 8)]);
    f.lease(1, false, &[spec(1, Prompt::Tokens(tokens(0, 6)))]);
    let err = f.cache.unregister_pool(GROUP).unwrap_err();
    assert!(matches!(err, Error::GroupBusy { .. }), "{err}");
    assert!(
        err.to_string().contains("2 blocks in use and 0 fenced"),
        "{err}"
    );
    // released before its step completed: the hash waits on step 1
    f.release(&[1], None);
    let gone = f.cache.unregister_pool(GROUP).unwrap();
    assert_eq!((gone.pools, gone.blocks), (2, 16));
    assert_eq!(f.cache.registered_blocks(), 0);
    // completing the step publishes nothing into the removed pools
    f.complete(1);
    assert!(matches!(
        f.cache.unregister_pool(GROUP),
        Err(Error::UnknownGroup(_))
    ));
    assert!(matches!(
        f.cache.stats(Some(GROUP)),
        Err(Error::UnknownGroup(_))
    ));
    // the name can be registered again, with new pool ids
    let (infos, already) = f.cache.register_pool(GROUP, 4, &[(0, 4)]).unwrap();
    assert!(!already);
    assert_eq!(infos[0].pool_id, 3);
    let stats = f.cache.stats(Some(GROUP)).unwrap();
    assert_eq!(stats.pools.len(), 1);
    f.check();
}

#[test]
fn a_sliced_audit_finds_what_the_whole_audit_finds_and_no_more() {
    let mut f = Fixture::new(4, &[(0, 100), (8, 50)]);
    f.lease(1, false, &[spec(1, Prompt::Tokens(tokens(0, 40)))]);
    let leaked = [f.cache.leak_for_test(1), f.cache.leak_for_test(2)];
    let mut report = AuditReport::default();
    let mut cursor = AuditCursor::default();
    let mut slices = 0;
    let mut seq = 2;
    while let Some(next) = f.cache.audit_slice(cursor, 7, &mut report) {
        cursor = next;
        slices += 1;
        // the state changes between slices: no false finding (the leaks
        // break check_invariants until the audit is through, so no check)
        f.cache
            .lease(
                f.session,
                f.epoch,
                Batch {
                    step: Step(1),
                    ..Batch::default()
                },
                &[spec(seq, Prompt::Count(3))],
                f.now,
            )
            .unwrap();
        seq += 1;
    }
    assert_eq!(report.blocks_checked, 150);
    assert_eq!(slices, 100_usize.div_ceil(7) + 50_usize.div_ceil(7) - 1);
    let found: Vec<_> = report
        .reclaimed
        .iter()
        .map(|l| (l.pool_id, Some(l.block)))
        .collect();
    assert_eq!(found, vec![(1, leaked[0]), (2, leaked[1])]);
    f.check();
    assert!(f.cache.audit().reclaimed.is_empty());
}

/// Issue 29, point 3: a principal's registered blocks are capped, so one
/// principal cannot make the cache build (and keep) pools without end; the
/// refusal names the figures, and another principal still registers.
#[test]
fn blocks_per_principal_are_capped_with_figures() {
    let mut cache = Cache::new(CacheConfig {
        max_blocks_per_principal: 1000,
        ..CacheConfig::default()
    });
    cache
        .register_pool_for("a", "a/1", 4, &[(0, 600, 0)])
        .unwrap();
    let err = cache
        .register_pool_for("a", "a/2", 4, &[(0, 300, 200)])
        .unwrap_err();
    assert!(matches!(err, Error::LimitExceeded(_)), "{err}");
    let text = err.to_string();
    for needle in [
        "pool group \"a/2\" asks for 500 blocks",
        "principal a has 600 registered",
        "1100 in all is over the limit of 1000 blocks per principal",
        "400 more fit",
    ] {
        assert!(text.contains(needle), "{needle:?} not in {text}");
    }
    assert_eq!(cache.blocks_of("a"), 600, "nothing of the refused group");
    cache
        .register_pool_for("a", "a/2", 4, &[(0, 400, 0)])
        .unwrap();
    cache
        .register_pool_for("b", "b/1", 4, &[(0, 1000, 0)])
        .unwrap();
    // unregistering gives a principal's blocks back
    cache.unregister_pool("a/1").unwrap();
    cache
        .register_pool_for("a", "a/3", 4, &[(0, 600, 0)])
        .unwrap();
}

/// Issue 29, point 9: pool groups are capped per principal as well as in
/// all, so one principal cannot take every group.
#[test]
fn pool_groups_are_capped_per_principal() {
    let mut cache = Cache::new(CacheConfig {
        max_pool_groups: 3,
        max_pool_groups_per_principal: 2,
        ..CacheConfig::default()
    });
    cache
        .register_pool_for("a", "a/1", 4, &[(0, 4, 0)])
        .unwrap();
    cache
        .register_pool_for("a", "a/2", 4, &[(0, 4, 0)])
        .unwrap();
    let err = cache
        .register_pool_for("a", "a/3", 4, &[(0, 4, 0)])
        .unwrap_err();
    assert!(matches!(err, Error::LimitExceeded(_)), "{err}");
    assert!(
        err.to_string()
            .contains("principal a has registered 2 pool groups, the limit per principal is 2"),
        "{err}"
    );
    // registering one of its groups again is no new group
    cache
        .register_pool_for("a", "a/1", 4, &[(0, 4, 0)])
        .unwrap();
    cache
        .register_pool_for("b", "b/1", 4, &[(0, 4, 0)])
        .unwrap();
    let err = cache
        .register_pool_for("c", "c/1", 4, &[(0, 4, 0)])
        .unwrap_err();
    assert!(
        err.to_string()
            .contains("3 pool groups are registered, the limit is 3"),
        "{err}"
    );
}

/// A registration is checked, built without the cache, then committed: the
/// cache serves other calls between plan and commit, and a commit checks
/// again what changed meanwhile.
#[test]
fn a_registration_builds_its_pools_without_the_cache() {
    let mut cache = Cache::new(CacheConfig {
        max_blocks_per_principal: 100,
        ..CacheConfig::default()
    });
    let Registration::New(big) = cache
        .plan_registration("a", "big", 4, &[(0, 64, 0)])
        .unwrap()
    else {
        panic!("a new group");
    };
    let Registration::New(rival) = cache
        .plan_registration("a", "rival", 4, &[(0, 64, 0)])
        .unwrap()
    else {
        panic!("a new group");
    };
    // while `big` is built, the cache is free for anything else: another
    // group of the same principal registers (and takes its blocks)
    let built = big.build();
    cache.commit_registration(rival.build()).unwrap();
    let err = cache.commit_registration(built).unwrap_err();
    assert!(
        err.to_string()
            .contains("over the limit of 100 blocks per principal"),
        "{err}"
    );
    // the same group built twice: the second commit is answered as
    // registered already, with the first one's pools
    let plan = || match cache.plan_registration("a", "g", 4, &[(0, 8, 0)]).unwrap() {
        Registration::New(new) => new,
        Registration::Already(_) => panic!("a new group"),
    };
    let (first, second) = (plan(), plan());
    let (infos, already) = cache.commit_registration(first.build()).unwrap();
    assert!(!already);
    let (again, already) = cache.commit_registration(second.build()).unwrap();
    assert!(already);
    assert_eq!(infos, again);
}

/// Issue 29, point 9: a QUOTA_EXCEEDED reject names the pool the sequence
/// asked the most of and what is left under the quota.
#[test]
fn a_quota_reject_names_the_pool_and_what_is_left() {
    let config = CacheConfig {
        session_quota: 5,
        ..CacheConfig::default()
    };
    let mut f = Fixture::with_config(config, 4, &[(0, 16)]);
    let out = f.lease(1, false, &[spec(1, Prompt::Count(4))]);
    assert!(out[0].grant().is_some(), "{out:?}");
    // 20 tokens: 5 blocks, with the 1 held one past the quota of 5
    let out = f.lease(1, false, &[spec(2, Prompt::Count(20))]);
    let r = out[0].reject().expect("a reject");
    assert_eq!(r.reason, RejectReason::QuotaExceeded);
    assert_eq!((r.pool_id, r.window), (1, 0), "{r:?}");
    assert_eq!((r.blocks_needed, r.blocks_free), (5, 4), "{r:?}");
    assert!(
        r.message.contains("most in pool 1, window 0") && r.message.contains("4 free under it"),
        "{r:?}"
    );
}

/// Issue 29, point 9: a pool group nobody registered is named back clipped;
/// a 1 MB name was echoed whole, which pushed the reply over the message cap.
#[test]
fn an_unknown_groups_name_is_named_back_clipped() {
    let mut f = Fixture::new(4, &[(0, 16)]);
    let huge = "g".repeat(1 << 20);
    let mut leased = spec(1, Prompt::Count(4));
    leased.group = huge.clone();
    let errors = [
        f.try_lease(1, false, &[leased]).unwrap_err(),
        f.cache.stats(Some(&huge)).unwrap_err(),
    ];
    for err in errors {
        assert!(matches!(err, Error::UnknownGroup(_)), "{err:.200}");
        let text = err.to_string();
        assert!(text.len() < 1024, "a {} byte message", text.len());
        assert!(text.ends_with("... (1048576 bytes)"), "{text}");
    }
    // a name of valid length is named whole
    let err = f.cache.stats(Some("nope")).unwrap_err();
    assert_eq!(err.to_string(), "unknown pool group \"nope\"");
}
