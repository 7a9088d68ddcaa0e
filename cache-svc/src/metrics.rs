//! The cache service's Prometheus series. Pool figures are read from the core
//! at scrape time, so they always agree with `GetStats`.

use kvlease_telemetry::metrics::{CounterVec, GaugeVec, Registry, names};

use crate::cache::Cache;
use crate::error::{Error, Result};
use crate::lease::Outcome;

/// Handles to the series.
#[derive(Debug, Clone)]
pub(crate) struct CacheMetrics {
    registry: Registry,
    blocks: GaugeVec<3>,
    blocks_total: GaugeVec<2>,
    grants: CounterVec<1>,
    rejects: CounterVec<2>,
    evictions: CounterVec<1>,
    reuse_hits: CounterVec<1>,
    reuse_lookups: CounterVec<1>,
    hit_rate: GaugeVec<1>,
    estimated_hit_rate: GaugeVec<2>,
    leaks: CounterVec<1>,
}

impl CacheMetrics {
    /// Registers the series.
    pub(crate) fn new() -> Result<Self> {
        let registry = Registry::new();
        let fail = |e: kvlease_telemetry::Error| Error::InvalidArgument(format!("metrics: {e}"));
        Ok(Self {
            blocks: registry
                .gauge_vec(
                    names::POOL_BLOCKS,
                    "Blocks of a pool in each state.",
                    [names::POOL_ID, names::WINDOW, names::STATE],
                )
                .map_err(fail)?,
            blocks_total: registry
                .gauge_vec(
                    names::POOL_BLOCKS_TOTAL,
                    "Blocks of a pool.",
                    [names::POOL_ID, names::WINDOW],
                )
                .map_err(fail)?,
            grants: registry
                .counter_vec(
                    names::GRANTS_TOTAL,
                    "Sequences granted blocks.",
                    [names::OP],
                )
                .map_err(fail)?,
            rejects: registry
                .counter_vec(
                    names::REJECTS_TOTAL,
                    "Sequences rejected, by reason.",
                    [names::OP, names::REASON],
                )
                .map_err(fail)?,
            evictions: registry
                .counter_vec(
                    names::EVICTIONS_TOTAL,
                    "Cached blocks evicted to make room.",
                    [names::POOL_ID],
                )
                .map_err(fail)?,
            reuse_hits: registry
                .counter_vec(
                    names::REUSE_HIT_BLOCKS_TOTAL,
                    "Prompt blocks served from the prefix cache (warm-up excluded).",
                    [names::POOL_ID],
                )
                .map_err(fail)?,
            reuse_lookups: registry
                .counter_vec(
                    names::REUSE_LOOKUP_BLOCKS_TOTAL,
                    "Prompt blocks looked up in the prefix cache (warm-up excluded).",
                    [names::POOL_ID],
                )
                .map_err(fail)?,
            hit_rate: registry
                .gauge_vec(
                    names::REUSE_HIT_RATE,
                    "Prefix cache hit rate so far.",
                    [names::POOL_ID],
                )
                .map_err(fail)?,
            estimated_hit_rate: registry
                .gauge_vec(
                    names::ESTIMATED_HIT_RATE,
                    "Estimated prefix hit rate at scale times the pool's size (miss-ratio curve).",
                    [names::POOL_ID, names::SCALE],
                )
                .map_err(fail)?,
            leaks: registry
                .counter_vec(
                    names::LEAKED_BLOCKS_RECLAIMED_TOTAL,
                    "Blocks the leak audit reclaimed.",
                    [names::POOL_ID],
                )
                .map_err(fail)?,
            registry,
        })
    }

    /// Counts the outcomes of one `op` ("lease" or "extend").
    pub(crate) fn record(&self, op: &str, outcomes: &[Outcome]) {
        // One label lookup per call, not per sequence: a decode step's
        // Extend carries hundreds of grants.
        let mut grants = 0;
        for o in outcomes {
            match o {
                Outcome::Grant(_) => grants += 1,
                Outcome::Reject(r) => self.rejects.with([op, r.reason.as_str()]).inc(),
            }
        }
        if grants > 0 {
            self.grants.with([op]).inc_by(grants);
        }
    }

    /// Mirrors the pools' figures and renders the text format.
    pub(crate) fn render(&self, cache: &Cache) -> String {
        for p in cache.pools() {
            let (id, window) = (p.id.to_string(), p.window.to_string());
            let c = p.pool.counts();
            for (state, n) in [
                (names::STATE_FREE, c.free),
                (names::STATE_CACHED, c.cached),
                (names::STATE_IN_USE, c.in_use),
                (names::STATE_FENCED, c.fenced),
            ] {
                self.blocks.with([&id, &window, state]).set(f64::from(n));
            }
            self.blocks_total
                .with([&id, &window])
                .set(f64::from(c.total));
            let k = p.pool.counters;
            catch_up(&self.evictions, &id, k.evictions);
            catch_up(&self.reuse_hits, &id, k.reuse_hits);
            catch_up(&self.reuse_lookups, &id, k.reuse_lookups);
            catch_up(&self.leaks, &id, k.leaks_reclaimed);
            let rate = if k.reuse_lookups == 0 {
                0.0
            } else {
                k.reuse_hits as f64 / k.reuse_lookups as f64
            };
            self.hit_rate.with([&id]).set(rate);
            for e in p.pool.hit_rate_estimates() {
                self.estimated_hit_rate
                    .with([&id, &e.scale.to_string()])
                    .set(e.hit_rate);
            }
        }
        self.registry.render()
    }
}

/// Advances a counter to the core's monotonic figure.
fn catch_up(counter: &CounterVec<1>, label: &str, value: u64) {
    let c = counter.with([label]);
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
        let mut cache = Cache::with_epoch(CacheConfig::default(), crate::Epoch(1));
        cache.register_pool("g", 4, &[(0, 8)]).unwrap();
        let now = Instant::now();
        let s = cache.open_session("t", None, now).unwrap();
        let specs = [
            SeqSpec::new(1, "g", Prompt::Count(9)),
            SeqSpec::new(2, "g", Prompt::Count(99)),
        ];
        let out = cache
            .lease(s.session_id, s.epoch, Batch::default(), &specs, now)
            .unwrap();
        let metrics = CacheMetrics::new().unwrap();
        metrics.record("lease", &out);
        let text = metrics.render(&cache);
        assert!(
            text.contains(r#"kvlease_pool_blocks{pool_id="1",window="0",state="in_use"} 3"#),
            "{text}"
        );
        assert!(
            text.contains(r#"kvlease_pool_blocks{pool_id="1",window="0",state="free"} 5"#),
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
            text.contains(r#"kvlease_cache_estimated_hit_rate{pool_id="1",scale="0.5"} 0"#),
            "{text}"
        );
    }
}
