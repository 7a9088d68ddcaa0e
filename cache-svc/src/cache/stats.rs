//! Read-only figures: per-shape block estimates and pool stats.

use super::{Cache, PoolEntry, PoolInfo};
use crate::error::{Error, Result};
use crate::estimate::{self, Shape};
use crate::ids::Epoch;
use crate::lease::SeqSpec;
use crate::pool::{PoolCounters, PoolCounts};
use crate::tier::HostCounts;

/// Figures of one pool for `GetStats`.
#[derive(Clone, Debug, PartialEq)]
pub struct PoolStats {
    /// Its group.
    pub group: String,
    /// Pool and geometry.
    pub info: PoolInfo,
    /// Blocks by state.
    pub counts: PoolCounts,
    /// Counters since start.
    pub counters: PoolCounters,
    /// Host-tier blocks by state (all 0 without a tier).
    pub host: HostCounts,
    /// Disk-tier blocks by state (all 0 without a tier).
    pub disk: HostCounts,
    /// Estimated hit rates at other pool sizes (the miss-ratio curve).
    pub hit_rate_estimates: Vec<crate::mrc::HitRateEstimate>,
    /// Its eviction policy and, for an adaptive one, its choice.
    pub policy: PolicyStats,
}

/// A pool's eviction policy for `GetStats`.
#[derive(Clone, Debug, PartialEq)]
pub struct PolicyStats {
    /// As configured for its group.
    pub configured: crate::eviction::PolicyKind,
    /// Picking victims now (`configured`, unless that is adaptive).
    pub current: crate::eviction::PolicyKind,
    /// An adaptive pool's candidates and their recent estimated hit rates.
    pub estimates: Vec<(crate::eviction::PolicyKind, f64)>,
    /// An adaptive pool's switches so far.
    pub switches: u64,
}

/// Figures of the whole cache.
#[derive(Clone, Debug, PartialEq)]
pub struct Stats {
    /// Per pool.
    pub pools: Vec<PoolStats>,
    /// Current epoch.
    pub epoch: Epoch,
    /// Live sessions.
    pub sessions: u32,
    /// Leased sequences.
    pub sequences: u32,
}

/// Estimate of one shape in one pool.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PoolEstimate {
    /// The pool.
    pub pool_id: u32,
    /// Its window.
    pub window: u32,
    /// Blocks over the whole life.
    pub total: u32,
    /// Most held at once.
    pub peak: u32,
    /// Blocks in the pool.
    pub pool_blocks: u32,
}

/// Estimate of one shape.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShapeEstimate {
    /// Per pool of the group.
    pub pools: Vec<PoolEstimate>,
    /// Whether the peak fits every empty pool.
    pub fits: bool,
}

impl Cache {
    /// Blocks each shape needs in every pool of its group over its life.
    /// Takes no session and checks no owner: the answer follows from the
    /// shape and the group's geometry alone (what `GetStats` shows anyone
    /// the matrix lets read figures), never from what is cached.
    pub fn estimate(&self, specs: &[SeqSpec]) -> Result<Vec<ShapeEstimate>> {
        specs
            .iter()
            .map(|spec| {
                self.validate_spec(spec)?;
                let group = &self.groups[&spec.group];
                let shape = Shape {
                    prompt: spec.prompt.len(),
                    max_new_tokens: spec.max_new_tokens,
                    extra: spec.extra.total(),
                    beam_width: spec.beam_width,
                };
                let pools: Vec<PoolEstimate> = group
                    .pools
                    .iter()
                    .map(|&i| {
                        let entry = &self.pools[i];
                        let need = estimate::pool_need(shape, entry.window, entry.tokens_per_block);
                        PoolEstimate {
                            pool_id: entry.id,
                            window: entry.window,
                            total: need.total,
                            peak: if spec.reserve_full_life {
                                need.total
                            } else {
                                need.peak
                            },
                            pool_blocks: entry.pool.len(),
                        }
                    })
                    .collect();
                let fits = pools.iter().all(|p| p.peak <= p.pool_blocks);
                Ok(ShapeEstimate { pools, fits })
            })
            .collect()
    }

    /// The eviction policy of pool `p`, as `GetStats` reports it.
    pub(crate) fn policy_stats(&self, p: &PoolEntry) -> PolicyStats {
        let configured = self.config.eviction.for_group(&p.group);
        match p.pool.adaptive() {
            Some(a) => PolicyStats {
                configured,
                current: a.current,
                estimates: a.estimates,
                switches: a.switches,
            },
            None => PolicyStats {
                configured,
                current: configured,
                estimates: Vec::new(),
                switches: 0,
            },
        }
    }

    /// Pool figures, optionally for one group.
    pub fn stats(&self, group: Option<&str>) -> Result<Stats> {
        if let Some(g) = group
            && !self.groups.contains_key(g)
        {
            return Err(Error::UnknownGroup(g.to_owned()));
        }
        let pools = self
            .pools
            .iter()
            .enumerate()
            .filter(|(_, p)| !p.retired && group.is_none_or(|g| p.group == g))
            .map(|(i, p)| PoolStats {
                group: p.group.clone(),
                info: self.info(i),
                counts: p.pool.counts(),
                counters: p.pool.counters,
                host: p.pool.host().counts(),
                disk: p.pool.disk().counts(),
                hit_rate_estimates: p.pool.hit_rate_estimates(),
                policy: self.policy_stats(p),
            })
            .collect();
        Ok(Stats {
            pools,
            epoch: self.epoch,
            sessions: self.sessions.len() as u32,
            sequences: self.sessions.values().map(|s| s.seqs.len() as u32).sum(),
        })
    }
}
