//! The cache service's Prometheus series. Pool figures are read from the core
//! at scrape time, so they always agree with `GetStats`.

use std::sync::Arc;

use kvlease_telemetry::metrics::{Counter, CounterVec, Described, GaugeVec, Registry, names};

use crate::cache::Cache;
use crate::error::{Error, Result};
use crate::eviction::CANDIDATES;
use crate::lease::Outcome;

/// Handles to the series.
#[derive(Debug, Clone)]
pub(crate) struct CacheMetrics {
    registry: Arc<Registry>,
    blocks: GaugeVec<4>,
    capacity: GaugeVec<3>,
    pool_grants: CounterVec<2>,
    pool_rejects: CounterVec<2>,
    grants: CounterVec<1>,
    rejects: CounterVec<2>,
    evictions: CounterVec<2>,
    reuse_hits: CounterVec<2>,
    reuse_lookups: CounterVec<2>,
    hit_rate: GaugeVec<2>,
    estimated_hit_rate: GaugeVec<3>,
    eviction_policy: GaugeVec<3>,
    policy_estimated_hit_rate: GaugeVec<3>,
    policy_switches: CounterVec<2>,
    leaks: CounterVec<2>,
    matched: Counter,
    host_blocks: GaugeVec<3>,
    disk_blocks: GaugeVec<3>,
    tier_copies: CounterVec<3>,
}

/// What the cache's metrics endpoint exports: every family it registers.
pub fn metric_catalog() -> Result<Vec<Described>> {
    Ok(CacheMetrics::new()?.registry.described().to_vec())
}

impl CacheMetrics {
    /// Registers the series.
    pub(crate) fn new() -> Result<Self> {
        let mut registry = Registry::new();
        let r = &mut registry;
        let fail = |e: kvlease_telemetry::Error| Error::Config(format!("metrics: {e}"));
        let pool = [names::POOL_GROUP, names::POOL_ID];
        let blocks = r
            .gauge_vec(
                names::POOL_BLOCKS,
                "Blocks of a pool in each state (free, cached, in_use, fenced).",
                [
                    names::POOL_GROUP,
                    names::POOL_ID,
                    names::WINDOW,
                    names::STATE,
                ],
            )
            .map_err(fail)?;
        let capacity = r
            .gauge_vec(
                names::POOL_CAPACITY_BLOCKS,
                "Blocks of a pool, all states.",
                [names::POOL_GROUP, names::POOL_ID, names::WINDOW],
            )
            .map_err(fail)?;
        let pool_grants = r
            .counter_vec(
                names::POOL_GRANTS_TOTAL,
                "Sequences a pool granted blocks.",
                pool,
            )
            .map_err(fail)?;
        let pool_rejects = r
            .counter_vec(names::POOL_REJECTS_TOTAL, "Sequences a pool refused.", pool)
            .map_err(fail)?;
        let grants = r
            .counter_vec(
                names::GRANTS_TOTAL,
                "Sequences granted blocks, by call.",
                [names::OP],
            )
            .map_err(fail)?;
        let rejects = r
            .counter_vec(
                names::REJECTS_TOTAL,
                "Sequences refused, by call and reason.",
                [names::OP, names::REASON],
            )
            .map_err(fail)?;
        let evictions = r
            .counter_vec(
                names::EVICTIONS_TOTAL,
                "Cached blocks evicted to make room.",
                pool,
            )
            .map_err(fail)?;
        let reuse_hits = r
            .counter_vec(
                names::REUSE_HIT_BLOCKS_TOTAL,
                "Prompt blocks served from the prefix cache (warm-up excluded).",
                pool,
            )
            .map_err(fail)?;
        let reuse_lookups = r
            .counter_vec(
                names::REUSE_LOOKUP_BLOCKS_TOTAL,
                "Prompt blocks looked up in the prefix cache (warm-up excluded).",
                pool,
            )
            .map_err(fail)?;
        let hit_rate = r
            .gauge_vec(names::REUSE_HIT_RATE, "Prefix cache hit rate so far.", pool)
            .map_err(fail)?;
        let estimated_hit_rate = r
            .gauge_vec(
                names::ESTIMATED_HIT_RATE,
                "Estimated prefix hit rate at scale times the pool's size (miss-ratio curve).",
                [names::POOL_GROUP, names::POOL_ID, names::SCALE],
            )
            .map_err(fail)?;
        let policy = [names::POOL_GROUP, names::POOL_ID, names::POLICY];
        let eviction_policy = r
            .gauge_vec(
                names::EVICTION_POLICY,
                "1 for the eviction policy picking a pool's victims now, 0 for the other candidates.",
                policy,
            )
            .map_err(fail)?;
        let policy_estimated_hit_rate = r
            .gauge_vec(
                names::POLICY_ESTIMATED_HIT_RATE,
                "An adaptive pool's candidate policies' recent hit rates in their shadow pools.",
                policy,
            )
            .map_err(fail)?;
        let policy_switches = r
            .counter_vec(
                names::POLICY_SWITCHES_TOTAL,
                "Times an adaptive pool changed the policy it follows.",
                pool,
            )
            .map_err(fail)?;
        let leaks = r
            .counter_vec(
                names::LEAKED_BLOCKS_RECLAIMED_TOTAL,
                "Blocks the leak audit reclaimed.",
                pool,
            )
            .map_err(fail)?;
        let matched = r
            .counter(
                names::MATCH_PROMPTS_TOTAL,
                "Prompts Match looked up for routing (read-only).",
            )
            .map_err(fail)?;
        let host_blocks = r
            .gauge_vec(
                names::HOST_TIER_BLOCKS,
                "Blocks of a pool's host tier in each state (free, pending, cached, pinned).",
                [names::POOL_GROUP, names::POOL_ID, names::STATE],
            )
            .map_err(fail)?;
        let disk_blocks = r
            .gauge_vec(
                names::DISK_TIER_BLOCKS,
                "Blocks of a pool's disk tier in each state (free, pending, cached, pinned).",
                [names::POOL_GROUP, names::POOL_ID, names::STATE],
            )
            .map_err(fail)?;
        let tier_copies = r
            .counter_vec(
                names::TIER_COPY_BLOCKS_TOTAL,
                "Blocks copied between a pool's tiers (demoted, onboarded, demotion_dropped, spilled, loaded, disk_invalidated).",
                [names::POOL_GROUP, names::POOL_ID, names::DIRECTION],
            )
            .map_err(fail)?;
        Ok(Self {
            host_blocks,
            disk_blocks,
            tier_copies,
            registry: Arc::new(registry),
            blocks,
            capacity,
            pool_grants,
            pool_rejects,
            grants,
            rejects,
            evictions,
            reuse_hits,
            reuse_lookups,
            hit_rate,
            estimated_hit_rate,
            eviction_policy,
            policy_estimated_hit_rate,
            policy_switches,
            leaks,
            matched,
        })
    }

    /// Counts the outcomes of one `op` ([`names::OP_LEASE`] or [`names::OP_EXTEND`]).
    pub(crate) fn record(&self, op: &str, outcomes: &[Outcome]) {
        // One label lookup per call, not per sequence: a decode step's
        // Extend carries hundreds of grants.
        let mut grants = 0;
        for o in outcomes {
            match o {
                Outcome::Grant(_) => grants += 1,
                Outcome::Reject(r) => {
                    self.rejects.with([op, r.reason.as_str()]).inc();
                }
            }
        }
        if grants > 0 {
            self.grants.with([op]).inc_by(grants);
        }
    }

    /// Counts the prompts of one `Match` call.
    pub(crate) fn matched(&self, prompts: usize) {
        self.matched.inc_by(prompts as u64);
    }

    /// Mirrors the pools' figures and renders the text format.
    pub(crate) fn render(&self, cache: &Cache) -> String {
        for p in cache.pools() {
            let (group, id, window) = (p.group.as_str(), p.id.to_string(), p.window.to_string());
            let pool = [group, id.as_str()];
            if p.retired {
                self.forget(pool, &window);
                continue;
            }
            let c = p.pool.counts();
            for (state, n) in [
                (names::STATE_FREE, c.free),
                (names::STATE_CACHED, c.cached),
                (names::STATE_IN_USE, c.in_use),
                (names::STATE_FENCED, c.fenced),
            ] {
                self.blocks
                    .with([group, &id, &window, state])
                    .set(f64::from(n));
            }
            self.capacity
                .with([group, &id, &window])
                .set(f64::from(c.total));
            let k = p.pool.counters;
            catch_up(&self.pool_grants, pool, k.grants);
            catch_up(&self.pool_rejects, pool, k.rejects);
            catch_up(&self.evictions, pool, k.evictions);
            catch_up(&self.reuse_hits, pool, k.reuse_hits);
            catch_up(&self.reuse_lookups, pool, k.reuse_lookups);
            catch_up(&self.leaks, pool, k.leaks_reclaimed);
            let h = p.pool.host().counts();
            if h.total > 0 {
                for (state, n) in [
                    (names::STATE_FREE, h.free),
                    (names::STATE_PENDING, h.pending),
                    (names::STATE_CACHED, h.cached),
                    (names::STATE_PINNED, h.pinned),
                ] {
                    self.host_blocks.with([group, &id, state]).set(f64::from(n));
                }
                for (direction, n) in [
                    (names::DIRECTION_DEMOTED, k.demotions),
                    (names::DIRECTION_ONBOARDED, k.onboards),
                    (names::DIRECTION_DEMOTION_DROPPED, k.demotions_dropped),
                ] {
                    catch_up(&self.tier_copies, [group, &id, direction], n);
                }
            }
            let d = p.pool.disk().counts();
            if d.total > 0 {
                for (state, n) in [
                    (names::STATE_FREE, d.free),
                    (names::STATE_PENDING, d.pending),
                    (names::STATE_CACHED, d.cached),
                    (names::STATE_PINNED, d.pinned),
                ] {
                    self.disk_blocks.with([group, &id, state]).set(f64::from(n));
                }
                for (direction, n) in [
                    (names::DIRECTION_SPILLED, k.spills),
                    (names::DIRECTION_LOADED, k.loads),
                    (names::DIRECTION_DISK_INVALIDATED, k.disk_invalidated),
                ] {
                    catch_up(&self.tier_copies, [group, &id, direction], n);
                }
            }
            let rate = if k.reuse_lookups == 0 {
                0.0
            } else {
                k.reuse_hits as f64 / k.reuse_lookups as f64
            };
            self.hit_rate.with(pool).set(rate);
            for e in p.pool.hit_rate_estimates() {
                self.estimated_hit_rate
                    .with([group, &id, &e.scale.to_string()])
                    .set(e.hit_rate);
            }
            let policy = cache.policy_stats(p);
            for kind in CANDIDATES {
                let current = if kind == policy.current { 1.0 } else { 0.0 };
                self.eviction_policy
                    .with([group, &id, kind.name()])
                    .set(current);
            }
            for (kind, rate) in &policy.estimates {
                self.policy_estimated_hit_rate
                    .with([group, &id, kind.name()])
                    .set(*rate);
            }
            catch_up(&self.policy_switches, pool, policy.switches);
        }
        self.registry.render()
    }

    /// Removes every series of an unregistered pool, so a dashboard no
    /// longer shows it (its id is never reused).
    fn forget(&self, pool: [&str; 2], window: &str) {
        let [group, id] = pool;
        for state in [
            names::STATE_FREE,
            names::STATE_CACHED,
            names::STATE_IN_USE,
            names::STATE_FENCED,
        ] {
            self.blocks.remove([group, id, window, state]);
        }
        self.capacity.remove([group, id, window]);
        for counter in [
            &self.pool_grants,
            &self.pool_rejects,
            &self.evictions,
            &self.reuse_hits,
            &self.reuse_lookups,
            &self.leaks,
            &self.policy_switches,
        ] {
            counter.remove(pool);
        }
        for kind in CANDIDATES {
            self.eviction_policy.remove([group, id, kind.name()]);
            self.policy_estimated_hit_rate
                .remove([group, id, kind.name()]);
        }
        self.hit_rate.remove(pool);
        for scale in crate::mrc::SCALES {
            self.estimated_hit_rate
                .remove([group, id, &scale.to_string()]);
        }
        for state in [
            names::STATE_FREE,
            names::STATE_PENDING,
            names::STATE_CACHED,
            names::STATE_PINNED,
        ] {
            self.host_blocks.remove([group, id, state]);
            self.disk_blocks.remove([group, id, state]);
        }
        for direction in [
            names::DIRECTION_DEMOTED,
            names::DIRECTION_ONBOARDED,
            names::DIRECTION_DEMOTION_DROPPED,
            names::DIRECTION_SPILLED,
            names::DIRECTION_LOADED,
            names::DIRECTION_DISK_INVALIDATED,
        ] {
            self.tier_copies.remove([group, id, direction]);
        }
    }
}

/// Advances a counter to the core's monotonic figure.
fn catch_up<const N: usize>(counter: &CounterVec<N>, labels: [&str; N], value: u64) {
    let c = counter.with(labels);
    c.inc_by(value.saturating_sub(c.get()));
}

#[cfg(test)]
mod tests {
    use std::time::Instant;

    use super::*;
    use crate::cache::{Batch, CacheConfig};
    use crate::lease::{Prompt, SeqSpec};

    #[test]
    fn rendered_pool_figures_match_the_core() {
        // a fixed policy (the default is `adaptive`)
        let mut config = CacheConfig::default();
        config.eviction.default = crate::eviction::PolicyKind::Lru;
        let mut cache = Cache::with_epoch(config, crate::Epoch(1));
        cache.register_pool("g", 4, &[(0, 8)]).unwrap();
        let now = Instant::now();
        let s = cache.open_session("t", None, now).unwrap();
        let specs = [
            SeqSpec::new(crate::SeqId(1), "g", Prompt::Count(9)),
            SeqSpec::new(crate::SeqId(2), "g", Prompt::Count(99)),
        ];
        let out = cache
            .lease(s.session_id, s.epoch, Batch::default(), &specs, now)
            .unwrap();
        let metrics = CacheMetrics::new().unwrap();
        metrics.record(names::OP_LEASE, &out);
        let text = metrics.render(&cache);
        assert!(
            text.contains(
                r#"kvlease_pool_blocks{pool_group="g",pool_id="1",window="0",state="in_use"} 3.0"#
            ),
            "{text}"
        );
        assert!(
            text.contains(
                r#"kvlease_pool_blocks{pool_group="g",pool_id="1",window="0",state="free"} 5.0"#
            ),
            "{text}"
        );
        assert!(
            text.contains(r#"kvlease_rejects_total{op="lease",reason="EXCEEDS_CAPACITY"} 1"#),
            "{text}"
        );
        assert!(
            text.contains(r#"kvlease_grants_total{op="lease"} 1"#),
            "{text}"
        );
        assert!(
            text.contains(r#"kvlease_pool_rejects_total{pool_group="g",pool_id="1"} 1"#),
            "{text}"
        );
        assert!(
            text.contains(
                r#"kvlease_pool_capacity_blocks{pool_group="g",pool_id="1",window="0"} 8.0"#
            ),
            "{text}"
        );
        assert!(
            text.contains(
                r#"kvlease_cache_estimated_hit_rate{pool_group="g",pool_id="1",scale="0.5"} 0.0"#
            ),
            "{text}"
        );
        for (policy, current) in [("lru", "1.0"), ("lfu", "0.0"), ("chain", "0.0")] {
            let line = format!(
                r#"kvlease_cache_eviction_policy{{pool_group="g",pool_id="1",policy="{policy}"}} {current}"#
            );
            assert!(text.contains(&line), "{line} in {text}");
        }
        assert!(
            !text.contains("kvlease_cache_policy_estimated_hit_rate{"),
            "a fixed policy has no candidates: {text}"
        );
    }

    #[test]
    fn an_adaptive_pool_exports_its_choice_candidates_and_switches() {
        let mut config = CacheConfig::default();
        config.eviction.default = crate::eviction::PolicyKind::Adaptive;
        let mut cache = Cache::with_epoch(config, crate::Epoch(1));
        cache.register_pool("g", 4, &[(0, 8)]).unwrap();
        let stats = cache.stats(Some("g")).unwrap();
        let policy = &stats.pools[0].policy;
        assert_eq!(policy.configured, crate::eviction::PolicyKind::Adaptive);
        assert_eq!(policy.current, crate::eviction::PolicyKind::Lru);
        let names: Vec<&str> = policy.estimates.iter().map(|e| e.0.name()).collect();
        assert_eq!(names, ["lru", "lfu", "chain"]);
        let text = CacheMetrics::new().unwrap().render(&cache);
        for policy in ["lru", "lfu", "chain"] {
            let line = format!(
                r#"kvlease_cache_policy_estimated_hit_rate{{pool_group="g",pool_id="1",policy="{policy}"}} 0.0"#
            );
            assert!(text.contains(&line), "{line} in {text}");
        }
        assert!(
            text.contains(r#"kvlease_cache_policy_switches_total{pool_group="g",pool_id="1"} 0"#),
            "{text}"
        );
    }

    #[test]
    fn an_unregistered_groups_series_are_removed() {
        let mut cache = Cache::with_epoch(CacheConfig::default(), crate::Epoch(1));
        cache
            .register_pool_for("p", "gone", 4, &[(0, 8, 4), (16, 8, 0)])
            .unwrap();
        cache.register_pool("kept", 4, &[(0, 8)]).unwrap();
        let metrics = CacheMetrics::new().unwrap();
        let text = metrics.render(&cache);
        assert!(text.contains(r#"pool_group="gone""#), "{text}");
        cache.unregister_pool("gone").unwrap();
        let text = metrics.render(&cache);
        let left: Vec<&str> = text
            .lines()
            .filter(|l| l.contains(r#"pool_group="gone""#))
            .collect();
        assert!(
            left.is_empty(),
            "series of the unregistered group: {left:#?}"
        );
        assert!(
            text.contains(
                r#"kvlease_pool_capacity_blocks{pool_group="kept",pool_id="3",window="0"} 8.0"#
            ),
            "{text}"
        );
    }
}
