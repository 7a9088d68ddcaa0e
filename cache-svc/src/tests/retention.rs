//! Retention hints through the cache's core: a hinted prefix outlives a
//! flood that evicts an unhinted one, the tenant's quota clamps a hint (an
//! answer, not an error), an expired hint falls back to the policy, and
//! malformed hints are refused naming the field.

use std::time::Duration;

use super::{Fixture, spec, tokens, whole};
use crate::cache::CacheConfig;
use crate::error::Error;
use crate::lease::{Prompt, Retain, SeqSpec};

const B: u32 = 4;
const HOUR: Duration = Duration::from_secs(3600);

fn hinted(seq: u64, prompt: Vec<u32>, tokens: u32, ttl: Duration) -> SeqSpec {
    let mut s = spec(seq, Prompt::Tokens(prompt));
    s.retain = Some(Retain {
        tokens,
        priority: 50,
        ttl,
        tenant: "tenant-a".into(),
    });
    s
}

/// Leases, completes and releases `spec` at `step` (the next step number).
fn serve(f: &mut Fixture, step: &mut u64, s: SeqSpec) -> (u32, u32) {
    let seq = s.seq_id.0;
    let out = f.lease(*step, false, &[s]);
    let g = out[0].grant().unwrap_or_else(|| panic!("{out:?}"));
    let got = (g.reused_tokens, g.retained_tokens);
    f.complete(*step);
    f.release(&[seq], None);
    f.check();
    *step += 1;
    got
}

/// A one-pool cache of `blocks` blocks, a tenant's hint quota `share` of it.
fn fixture(share: f64, blocks: u32) -> Fixture {
    let config = CacheConfig {
        retention_share: share,
        ..CacheConfig::default()
    };
    Fixture::with_config(config, B, &[(0, blocks)])
}

/// 40 one-off prompts of 4 full blocks and a partial one.
fn flood(f: &mut Fixture, step: &mut u64) {
    for i in 0..40u32 {
        let prompt = tokens(5000 + 100 * i, 17);
        serve(f, step, spec(10 + u64::from(i), Prompt::Tokens(prompt)));
    }
}

/// Two 8-block prompts (one hinted, one not), then 40 one-off 4-block
/// prompts through a 24-block pool: only the hinted one is still cached.
#[test]
fn a_hinted_prefix_survives_a_flood_that_evicts_an_unhinted_one() {
    let mut f = fixture(0.5, 24);
    let mut step = 1;
    let (_, retained) = serve(&mut f, &mut step, hinted(1, tokens(0, 33), 32, HOUR));
    assert_eq!(retained, 32, "8 full blocks hinted");
    serve(&mut f, &mut step, spec(2, Prompt::Tokens(tokens(1000, 33))));
    flood(&mut f, &mut step);
    let (reused, _) = serve(&mut f, &mut step, spec(100, Prompt::Tokens(tokens(0, 33))));
    assert_eq!(reused, 32, "the hinted prefix is whole");
    let (reused, _) = serve(
        &mut f,
        &mut step,
        spec(101, Prompt::Tokens(tokens(1000, 33))),
    );
    assert_eq!(reused, 0, "the unhinted one was flooded out");
    assert!(whole(&f.counts()));
}

#[test]
fn a_hint_past_the_tenants_quota_covers_the_blocks_that_fit() {
    // 16 blocks: a tenant may hold 4 under hints
    let mut f = fixture(0.25, 16);
    let mut step = 1;
    let (_, retained) = serve(&mut f, &mut step, hinted(1, tokens(0, 33), 33, HOUR));
    assert_eq!(retained, 16, "clamped to the quota's 4 blocks");
    // the same prefix again costs no quota; a new one finds none left
    let (_, retained) = serve(&mut f, &mut step, hinted(2, tokens(0, 13), 12, HOUR));
    assert_eq!(retained, 12);
    let (_, retained) = serve(&mut f, &mut step, hinted(3, tokens(500, 13), 12, HOUR));
    assert_eq!(
        retained, 0,
        "quota exhausted: the hint is refused, the lease granted"
    );
    let other = f.cache.pools()[0]
        .pool
        .retention()
        .tenant_blocks("tenant-a");
    assert_eq!(other, 4);
}

#[test]
fn an_expired_hint_falls_back_to_the_policy() {
    let mut f = fixture(0.5, 24);
    let mut step = 1;
    let (_, retained) = serve(
        &mut f,
        &mut step,
        hinted(1, tokens(0, 33), 32, Duration::from_secs(5)),
    );
    assert_eq!(retained, 32);
    f.now += Duration::from_secs(6);
    flood(&mut f, &mut step);
    assert_eq!(
        f.cache.pools()[0]
            .pool
            .retention()
            .tenant_blocks("tenant-a"),
        0
    );
    let (reused, _) = serve(&mut f, &mut step, spec(100, Prompt::Tokens(tokens(0, 33))));
    assert_eq!(reused, 0, "expired: evicted like any other block");
}

#[test]
fn malformed_hints_are_refused_naming_the_field() {
    let mut f = Fixture::with_config(CacheConfig::default(), B, &[(0, 16)]);
    let cases = [
        (34, 50, Duration::from_secs(1), "retain.tokens"),
        (0, 50, Duration::from_secs(1), "retain.tokens"),
        (8, 101, Duration::from_secs(1), "retain.priority"),
        (8, 50, Duration::ZERO, "retain.ttl_ms"),
        (8, 50, Duration::from_secs(2 * 86_400), "retain.ttl_ms"),
    ];
    for (tokens_, priority, ttl, field) in cases {
        let mut s = hinted(1, tokens(0, 33), tokens_, ttl);
        if let Some(r) = &mut s.retain {
            r.priority = priority;
        }
        let err = f.try_lease(1, false, &[s]).unwrap_err();
        assert!(
            matches!(&err, Error::InvalidArgument(m) if m.contains(field)),
            "{field}: {err:?}"
        );
    }
    assert!(whole(&f.counts()));
}
