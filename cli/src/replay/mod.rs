//! `kvlease cache-replay`: how close the cache's eviction policies come to
//! the best any policy could do on a block trace.
//!
//! # Layout
//! - [`sim`]: in-process simulations with the service's mechanics: the
//!   reference leaf-first LRU, the offline optimum (leaf-only Belady) and
//!   infinite capacity.
//! - [`drive`]: the same trace through a real cache service over gRPC.
//! - [`conversations`]: a generator of multi-turn conversation traces.
//!
//! Per capacity, the table gives each policy's hit rate, its fraction of the
//! optimum, and the fraction of the gap between the reference LRU and the
//! optimum that it closes.

pub mod conversations;
pub mod drive;
pub mod sim;

use std::fmt::Write as _;
use std::path::PathBuf;

use cache_svc::eviction::PolicyKind;

use crate::error::{Error, Result};
use crate::mooncake;
use sim::{SimResult, Victim};

/// What `kvlease cache-replay` replays.
#[derive(Debug, Clone)]
pub struct ReplayOptions {
    pub trace: PathBuf,
    /// Pool sizes, in blocks.
    pub capacities: Vec<u32>,
    pub policies: Vec<PolicyKind>,
    /// Requests held at once.
    pub concurrency: usize,
    /// Replay only the first N requests (0 = all).
    pub limit: usize,
    /// Blocks prepended to every request (a system prompt every session
    /// shares; 0 = the trace as it is).
    pub shared_root: u32,
    /// Partial-block reuse in the replayed services, keeping partly filled
    /// blocks of at least this many tokens (None: off, as the reference
    /// simulations assume; each replayed prompt ends with one token of its
    /// own, in a block of its own).
    pub partial_min_tokens: Option<u32>,
    /// Drive the service's core in this process instead of a service over
    /// gRPC (the same calls, so the same figures, much faster).
    pub in_process: bool,
    /// Pass each record's `retain_tokens` as a retention hint
    /// ([`drive::replay_hint`]); off, the field is ignored.
    pub hints: bool,
}

/// `hash_ids` with the same `blocks` ids (ones no trace uses: counted down
/// from `u64::MAX`) opening every request.
pub fn with_shared_root(hash_ids: Vec<Vec<u64>>, blocks: u32) -> Vec<Vec<u64>> {
    if blocks == 0 {
        return hash_ids;
    }
    let root: Vec<u64> = (0..u64::from(blocks)).map(|j| u64::MAX - j).collect();
    hash_ids
        .into_iter()
        .map(|ids| root.iter().copied().chain(ids).collect())
        .collect()
}

/// One policy at one capacity.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PolicyRow {
    pub policy: PolicyKind,
    pub replayed: drive::Replayed,
}

/// One capacity's figures.
#[derive(Debug, Clone, PartialEq)]
pub struct CapacityRow {
    pub capacity: u32,
    /// The reference leaf-first LRU (simulated).
    pub reference: SimResult,
    /// The offline optimum (simulated).
    pub optimum: SimResult,
    pub policies: Vec<PolicyRow>,
}

impl CapacityRow {
    /// Fraction of the reference-LRU-to-optimum gap that `rate` closes.
    pub fn gap_closed(&self, rate: f64) -> Option<f64> {
        let (lru, opt) = (self.reference.hit_rate(), self.optimum.hit_rate());
        (opt - lru > 1e-12).then(|| (rate - lru) / (opt - lru))
    }
}

/// The whole replay.
#[derive(Debug, Clone, PartialEq)]
pub struct Report {
    pub requests: usize,
    pub blocks: u64,
    pub distinct_blocks: usize,
    pub concurrency: usize,
    pub infinite: SimResult,
    pub rows: Vec<CapacityRow>,
}

/// Replays `hash_ids` at every capacity: the simulations, then every policy
/// through a fresh in-process cache service.
pub async fn replay_all(
    hash_ids: &[Vec<u64>],
    retain: &[Option<u32>],
    capacities: &[u32],
    policies: &[PolicyKind],
    concurrency: usize,
    partial_min_tokens: Option<u32>,
    in_process: bool,
) -> Result<Report> {
    let chains = sim::chain_keys(hash_ids);
    let distinct: std::collections::HashSet<u64> = chains.iter().flatten().copied().collect();
    let infinite = sim::simulate(&chains, u64::MAX, Victim::Lru, concurrency);
    let mut rows = Vec::new();
    for &capacity in capacities {
        let cap = u64::from(capacity);
        let reference = sim::simulate(&chains, cap, Victim::Lru, concurrency);
        let optimum = sim::simulate(&chains, cap, Victim::Belady, concurrency);
        let mut row = CapacityRow {
            capacity,
            reference,
            optimum,
            policies: Vec::new(),
        };
        for &policy in policies {
            let mut config = drive::service_config(policy);
            if let Some(min) = partial_min_tokens {
                config.partial_reuse = true;
                config.partial_min_tokens = min;
            }
            let replayed = if in_process {
                drive::replay_core_hinted(hash_ids, retain, capacity, &config, concurrency)?
            } else {
                drive::replay_fresh_hinted(hash_ids, retain, capacity, config, concurrency).await?
            };
            row.policies.push(PolicyRow { policy, replayed });
        }
        rows.push(row);
    }
    Ok(Report {
        requests: hash_ids.len(),
        blocks: infinite.lookups,
        distinct_blocks: distinct.len(),
        concurrency,
        infinite,
        rows,
    })
}

/// `kvlease cache-replay`: reads the trace, replays it, prints the table.
pub async fn run(options: ReplayOptions) -> Result<Report> {
    if options.capacities.is_empty() || options.capacities.contains(&0) {
        return Err(Error::Usage("--capacity needs block counts > 0".into()));
    }
    if options.policies.is_empty() {
        return Err(Error::Usage("--policy needs at least one policy".into()));
    }
    let mut records = mooncake::read(&options.trace)?;
    if options.limit > 0 {
        records.truncate(options.limit);
    }
    // a shared root moves every prompt right by its blocks
    let root_tokens = options.shared_root * drive::REPLAY_BLOCK_TOKENS;
    let retain: Vec<Option<u32>> = if options.hints {
        records
            .iter()
            .map(|r| {
                r.retain_tokens.map(|t| {
                    let blocks = t / mooncake::MOONCAKE_BLOCK_TOKENS;
                    blocks * drive::REPLAY_BLOCK_TOKENS + root_tokens
                })
            })
            .collect()
    } else {
        Vec::new()
    };
    let hash_ids = with_shared_root(
        records.into_iter().map(|r| r.hash_ids).collect(),
        options.shared_root,
    );
    let report = replay_all(
        &hash_ids,
        &retain,
        &options.capacities,
        &options.policies,
        options.concurrency.max(1),
        options.partial_min_tokens,
        options.in_process,
    )
    .await?;
    print!("{}", render(&report, &options.trace.display().to_string()));
    Ok(report)
}

/// The report as a table.
pub fn render(report: &Report, trace: &str) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "cache-replay: {trace}: {} requests, {} blocks ({} distinct), concurrency {}",
        report.requests, report.blocks, report.distinct_blocks, report.concurrency
    );
    let _ = writeln!(
        out,
        "infinite capacity: hit rate {:.4}",
        report.infinite.hit_rate()
    );
    let _ = writeln!(
        out,
        "{:>8}  {:<12} {:>9} {:>10} {:>11} {:>10} {:>8}",
        "capacity", "policy", "hit rate", "x optimum", "gap closed", "evictions", "refused"
    );
    for row in &report.rows {
        let opt = row.optimum.hit_rate();
        let line = |out: &mut String, name: &str, rate: f64, evictions: u64, refused: u64| {
            let of_opt = if opt > 0.0 { rate / opt } else { 0.0 };
            let gap = row
                .gap_closed(rate)
                .map_or_else(|| "-".to_string(), |g| format!("{:.1}%", g * 100.0));
            let _ = writeln!(
                out,
                "{:>8}  {:<12} {:>9.4} {:>10.3} {:>11} {:>10} {:>8}",
                row.capacity, name, rate, of_opt, gap, evictions, refused
            );
        };
        for p in &row.policies {
            let r = &p.replayed;
            line(
                &mut out,
                p.policy.name(),
                r.hit_rate(),
                r.evictions,
                r.refused,
            );
        }
        let (reference, optimum) = (&row.reference, &row.optimum);
        line(
            &mut out,
            "ref-lru(sim)",
            reference.hit_rate(),
            reference.evictions,
            reference.refused,
        );
        line(
            &mut out,
            "optimum(sim)",
            optimum.hit_rate(),
            optimum.evictions,
            optimum.refused,
        );
        if let Some(lru) = row.policies.iter().find(|p| p.policy == PolicyKind::Lru) {
            let same = lru.replayed.hits == reference.hits
                && lru.replayed.evictions == reference.evictions;
            let _ = writeln!(
                out,
                "{:>8}  service lru == reference lru: {} ({} vs {} hits, {} vs {} evictions)",
                "",
                if same { "yes" } else { "NO" },
                lru.replayed.hits,
                reference.hits,
                lru.replayed.evictions,
                reference.evictions
            );
        }
    }
    out
}
