//! `kvlease status`: the scheduler's `GetStatus` as text.

use std::fmt::Write as _;

use kvlease_proto::v1 as pb;

/// The status as a few aligned lines, then one line per pool.
pub fn render(s: &pb::GetStatusResponse) -> String {
    let policy = pb::CapacityPolicy::try_from(s.policy).map_or("UNSPECIFIED", |p| p.as_str_name());
    let mut out = String::new();
    let _ = writeln!(
        out,
        "policy        {policy} (on exhaustion: {})",
        s.on_exhausted
    );
    let _ = writeln!(out, "cache session {} (epoch {})", s.session_id, s.epoch);
    let _ = writeln!(
        out,
        "requests      queued {}, running {}, preempted now {}",
        s.queued, s.running, s.preempted
    );
    let _ = writeln!(
        out,
        "finished      length {}, stop {}, rejected {}, cancelled {}, errors {}; preemptions {}",
        s.finished_length, s.finished_stop, s.rejected, s.cancelled, s.errors, s.preemptions
    );
    let _ = writeln!(out, "steps         {}", s.steps);
    // disaggregated serving: which group prefills and which decodes
    if s.groups.iter().any(|g| g.role != "both") {
        let roles: Vec<String> = s
            .groups
            .iter()
            .map(|g| format!("{} {}", g.pool_group, g.role))
            .collect();
        let _ = writeln!(out, "roles         {}", roles.join(", "));
    }
    out.push_str(&render_pools(&s.pools));
    out
}

/// One line per pool: blocks by state and the pool's counters.
pub fn render_pools(pools: &[pb::PoolStats]) -> String {
    let mut out = String::new();
    if pools.is_empty() {
        out.push_str("pools         (none reported)\n");
        return out;
    }
    let _ = writeln!(
        out,
        "{:<24} {:>4} {:>6} {:>6} {:>6} {:>7} {:>6} {:>6} {:>8} {:>8} {:>9} {:>9}",
        "pool group",
        "id",
        "window",
        "total",
        "free",
        "cached",
        "in_use",
        "fenced",
        "grants",
        "rejects",
        "evictions",
        "hit rate"
    );
    for p in pools {
        let hit = if p.reuse_lookups == 0 {
            "-".to_string()
        } else {
            format!(
                "{:.1}%",
                100.0 * p.reuse_hits as f64 / p.reuse_lookups as f64
            )
        };
        let _ = writeln!(
            out,
            "{:<24} {:>4} {:>6} {:>6} {:>6} {:>7} {:>6} {:>6} {:>8} {:>8} {:>9} {:>9}",
            p.pool_group,
            p.pool_id,
            p.window,
            p.total,
            p.free,
            p.cached_evictable,
            p.in_use,
            p.fenced,
            p.grants,
            p.rejects,
            p.evictions,
            hit
        );
    }
    out
}

/// What `kvlease audit` found wrong with a cache: pools with blocks in use
/// or fenced (`--whole`: no request should be running) and blocks the leak
/// audit reclaimed. Empty when the cache is sound.
pub fn audit_problems(
    stats: &pb::GetStatsResponse,
    audit: &pb::AuditResponse,
    whole: bool,
) -> Vec<String> {
    let mut problems = Vec::new();
    if whole {
        for p in &stats.pools {
            if p.in_use != 0 || p.fenced != 0 {
                problems.push(format!(
                    "pool {} ({}) not whole: {} in use, {} fenced",
                    p.pool_id, p.pool_group, p.in_use, p.fenced
                ));
            }
        }
    }
    if !audit.reclaimed.is_empty() {
        problems.push(format!(
            "the audit reclaimed {} leaked blocks (first: pool {} block {}, last held by {})",
            audit.reclaimed.len(),
            audit.reclaimed[0].pool_id,
            audit.reclaimed[0].block_id,
            audit.reclaimed[0].last_holder
        ));
    }
    problems
}

/// `kvlease audit`'s report: the cache's sessions and pools, the audit's
/// figures, then one line per problem.
pub fn render_audit(
    stats: &pb::GetStatsResponse,
    audit: &pb::AuditResponse,
    problems: &[String],
) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "cache         epoch {}, {} sessions, {} sequences",
        stats.epoch, stats.sessions, stats.sequences
    );
    out.push_str(&render_pools(&stats.pools));
    let _ = writeln!(
        out,
        "audit         {} blocks checked, {} reclaimed",
        audit.blocks_checked,
        audit.reclaimed.len()
    );
    for p in problems {
        let _ = writeln!(out, "problem       {p}");
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn audit_names_pools_not_whole_and_leaked_blocks() {
        let pool = |id, in_use, fenced| pb::PoolStats {
            pool_group: "g/replica-0".into(),
            pool_id: id,
            total: 10,
            free: 10 - in_use - fenced,
            in_use,
            fenced,
            ..Default::default()
        };
        let stats = pb::GetStatsResponse {
            pools: vec![pool(1, 0, 0), pool(2, 3, 1)],
            epoch: 7,
            sessions: 1,
            sequences: 2,
        };
        let clean = pb::AuditResponse {
            reclaimed: vec![],
            blocks_checked: 20,
        };
        let problems = audit_problems(&stats, &clean, true);
        assert_eq!(
            problems,
            ["pool 2 (g/replica-0) not whole: 3 in use, 1 fenced"]
        );
        assert!(audit_problems(&stats, &clean, false).is_empty());
        let leaked = pb::AuditResponse {
            reclaimed: vec![pb::LeakedBlock {
                pool_id: 1,
                block_id: 4,
                last_holder: "unknown".into(),
            }],
            blocks_checked: 20,
        };
        let problems = audit_problems(&stats, &leaked, false);
        assert_eq!(problems.len(), 1);
        assert!(
            problems[0].contains("reclaimed 1 leaked blocks"),
            "{problems:?}"
        );
        let text = render_audit(&stats, &leaked, &problems);
        assert!(text.contains("epoch 7, 1 sessions"), "{text}");
        assert!(text.contains("20 blocks checked, 1 reclaimed"), "{text}");
        assert!(text.contains("problem       the audit"), "{text}");
    }

    #[test]
    fn render_names_policy_and_pool_figures() {
        let s = pb::GetStatusResponse {
            policy: pb::CapacityPolicy::MaxUtilization as i32,
            on_exhausted: "preempt".into(),
            epoch: 3,
            pools: vec![pb::PoolStats {
                pool_group: "seeded-0/replica-0".into(),
                pool_id: 1,
                total: 100,
                free: 60,
                cached_evictable: 30,
                in_use: 8,
                fenced: 2,
                reuse_lookups: 4,
                reuse_hits: 1,
                ..Default::default()
            }],
            ..Default::default()
        };
        let text = render(&s);
        assert!(
            text.contains("MAX_UTILIZATION (on exhaustion: preempt)"),
            "{text}"
        );
        assert!(text.contains("(epoch 3)"), "{text}");
        assert!(text.contains("seeded-0/replica-0"), "{text}");
        assert!(text.contains("25.0%"), "{text}");
        assert!(
            !text.contains("roles"),
            "no roles line when every group serves both: {text}"
        );
        assert!(render_pools(&[]).contains("none reported"));
        let group = |name: &str, role: &str| pb::WorkerGroup {
            pool_group: name.into(),
            role: role.into(),
        };
        let split = pb::GetStatusResponse {
            groups: vec![
                group("m/replica-0", "prefill"),
                group("m/replica-1", "decode"),
            ],
            ..s
        };
        assert!(
            render(&split).contains("roles         m/replica-0 prefill, m/replica-1 decode"),
            "{}",
            render(&split)
        );
    }
}
