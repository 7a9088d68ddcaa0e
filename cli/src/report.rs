//! What a run did: latency percentiles, throughput, finishes by reason and
//! the cluster's own counters, as a closing table and one summary line.

use std::collections::BTreeMap;
use std::fmt;
use std::time::Duration;

use kvlease_proto::v1 as pb;

use crate::bench::{Finish, Outcome};

/// The scheduler and cache counters a run moved (after minus before).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ClusterDelta {
    pub preemptions: u64,
    pub rejected: u64,
    pub steps: u64,
    pub grants: u64,
    pub cache_rejects: u64,
    pub evictions: u64,
    pub reuse_lookups: u64,
    pub reuse_hits: u64,
    /// The cache epoch changed during the run (a cache restart); the cache
    /// counters then start from the new instance's zero.
    pub epoch_changed: bool,
}

impl ClusterDelta {
    /// The difference of two `GetStatus` answers.
    pub fn between(before: &pb::GetStatusResponse, after: &pb::GetStatusResponse) -> Self {
        let sum = |s: &pb::GetStatusResponse, f: fn(&pb::PoolStats) -> u64| -> u64 {
            s.pools.iter().map(f).sum()
        };
        let epoch_changed = before.epoch != after.epoch;
        let cache = |f: fn(&pb::PoolStats) -> u64| {
            let a = sum(after, f);
            if epoch_changed {
                a
            } else {
                a.saturating_sub(sum(before, f))
            }
        };
        Self {
            preemptions: after.preemptions.saturating_sub(before.preemptions),
            rejected: after.rejected.saturating_sub(before.rejected),
            steps: after.steps.saturating_sub(before.steps),
            grants: cache(|p| p.grants),
            cache_rejects: cache(|p| p.rejects),
            evictions: cache(|p| p.evictions),
            reuse_lookups: cache(|p| p.reuse_lookups),
            reuse_hits: cache(|p| p.reuse_hits),
            epoch_changed,
        }
    }
}

/// Nearest-rank percentile of sorted values.
pub fn percentile(sorted: &[Duration], p: f64) -> Option<Duration> {
    if sorted.is_empty() {
        return None;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    Some(sorted[rank.clamp(1, sorted.len()) - 1])
}

/// The closing table of a run.
#[derive(Debug, Clone, Default)]
pub struct Summary {
    pub requests: usize,
    pub ok: usize,
    pub rejected: BTreeMap<String, usize>,
    pub cancelled: usize,
    /// `ERROR` finishes and failed calls, by message.
    pub errors: BTreeMap<String, usize>,
    pub wall: Duration,
    pub output_tokens: u64,
    pub prompt_tokens: u64,
    pub reused_tokens: u64,
    /// Preemptions reported on the requests' last messages.
    pub preemptions: u64,
    pub latency: Vec<Duration>,
    pub ttft: Vec<Duration>,
    pub cluster: Option<ClusterDelta>,
}

impl Summary {
    pub fn new(outcomes: &[Outcome], wall: Duration, cluster: Option<ClusterDelta>) -> Self {
        let mut s = Self {
            requests: outcomes.len(),
            wall,
            cluster,
            ..Self::default()
        };
        for o in outcomes {
            s.output_tokens += u64::from(o.output_tokens);
            s.preemptions += u64::from(o.preemptions);
            match &o.finish {
                Finish::Length | Finish::Stop => {
                    s.ok += 1;
                    s.prompt_tokens += u64::from(o.prompt_tokens);
                    s.reused_tokens += u64::from(o.reused_tokens);
                    s.latency.push(o.latency);
                    s.ttft.extend(o.ttft);
                }
                Finish::Rejected(reason) => *s.rejected.entry(reason.clone()).or_default() += 1,
                Finish::Cancelled(_) => s.cancelled += 1,
                Finish::Error(m) | Finish::Failed(m) => {
                    *s.errors.entry(m.clone()).or_default() += 1
                }
            }
        }
        s.latency.sort();
        s.ttft.sort();
        s
    }

    pub fn rejected_total(&self) -> usize {
        self.rejected.values().sum()
    }

    pub fn errors_total(&self) -> usize {
        self.errors.values().sum()
    }

    /// One line for scripts: `key=value` pairs.
    pub fn line(&self) -> String {
        let reasons = |m: &BTreeMap<String, usize>| {
            m.iter()
                .map(|(k, v)| format!("{k}:{v}"))
                .collect::<Vec<_>>()
                .join(",")
        };
        format!(
            "summary: requests={} ok={} rejected={} cancelled={} errors={} reject_reasons={} error_reasons={:?}",
            self.requests,
            self.ok,
            self.rejected_total(),
            self.cancelled,
            self.errors_total(),
            reasons(&self.rejected),
            reasons(&self.errors),
        )
    }
}

fn ms(d: Option<Duration>) -> String {
    d.map_or_else(
        || "-".into(),
        |d| format!("{:.1} ms", d.as_secs_f64() * 1000.0),
    )
}

fn pct(part: u64, whole: u64) -> String {
    if whole == 0 {
        "-".into()
    } else {
        format!("{:.1}%", 100.0 * part as f64 / whole as f64)
    }
}

impl fmt::Display for Summary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let secs = self.wall.as_secs_f64().max(1e-9);
        let row = |f: &mut fmt::Formatter<'_>, k: &str, v: String| writeln!(f, "  {k:<20} {v}");
        writeln!(f, "  {:-<20} {:-<48}", "", "")?;
        row(
            f,
            "requests",
            format!(
                "{} (ok {}, rejected {}, cancelled {}, errors {})",
                self.requests,
                self.ok,
                self.rejected_total(),
                self.cancelled,
                self.errors_total()
            ),
        )?;
        row(f, "wall time", format!("{secs:.2} s"))?;
        row(
            f,
            "throughput",
            format!(
                "{:.2} req/s, {:.1} output tok/s",
                self.ok as f64 / secs,
                self.output_tokens as f64 / secs
            ),
        )?;
        row(
            f,
            "latency",
            format!(
                "p50 {}  p90 {}  p99 {}",
                ms(percentile(&self.latency, 50.0)),
                ms(percentile(&self.latency, 90.0)),
                ms(percentile(&self.latency, 99.0))
            ),
        )?;
        row(
            f,
            "TTFT",
            format!(
                "p50 {}  p90 {}  p99 {}",
                ms(percentile(&self.ttft, 50.0)),
                ms(percentile(&self.ttft, 90.0)),
                ms(percentile(&self.ttft, 99.0))
            ),
        )?;
        let rejects = if self.rejected.is_empty() {
            "none".to_string()
        } else {
            self.rejected
                .iter()
                .map(|(k, v)| format!("{k} {v}"))
                .collect::<Vec<_>>()
                .join(", ")
        };
        row(f, "rejects by reason", rejects)?;
        for (message, n) in &self.errors {
            row(f, "error", format!("{n} x {message}"))?;
        }
        let scheduler_preemptions = self.cluster.as_ref().map_or_else(String::new, |c| {
            format!(" (scheduler counted {})", c.preemptions)
        });
        row(
            f,
            "preemptions",
            format!("{}{scheduler_preemptions}", self.preemptions),
        )?;
        row(
            f,
            "prefix reuse",
            format!(
                "{} of {} prompt tokens from cached blocks ({})",
                self.reused_tokens,
                self.prompt_tokens,
                pct(self.reused_tokens, self.prompt_tokens)
            ),
        )?;
        if let Some(c) = &self.cluster {
            row(
                f,
                "cache hit rate",
                format!(
                    "{} ({} of {} prompt blocks looked up)",
                    pct(c.reuse_hits, c.reuse_lookups),
                    c.reuse_hits,
                    c.reuse_lookups
                ),
            )?;
            row(
                f,
                "cache",
                format!(
                    "{} grants, {} rejects, {} evictions, {} scheduler steps{}",
                    c.grants,
                    c.cache_rejects,
                    c.evictions,
                    c.steps,
                    if c.epoch_changed {
                        " (cache restarted: new epoch)"
                    } else {
                        ""
                    }
                ),
            )?;
        }
        write!(f, "  {:-<20} {:-<48}", "", "")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn outcome(index: usize, ms: u64, finish: Finish) -> Outcome {
        Outcome {
            index,
            latency: Duration::from_millis(ms),
            ttft: Some(Duration::from_millis(ms / 4)),
            prompt_tokens: 100,
            output_tokens: 10,
            reused_tokens: 50,
            preemptions: 1,
            finish,
        }
    }

    #[test]
    fn percentiles_are_nearest_rank() {
        let v: Vec<Duration> = (1..=100).map(Duration::from_millis).collect();
        assert_eq!(percentile(&v, 50.0), Some(Duration::from_millis(50)));
        assert_eq!(percentile(&v, 99.0), Some(Duration::from_millis(99)));
        assert_eq!(percentile(&v, 100.0), Some(Duration::from_millis(100)));
        assert_eq!(percentile(&v[..1], 90.0), Some(Duration::from_millis(1)));
        assert_eq!(percentile(&[], 50.0), None);
    }

    #[test]
    fn summary_counts_finishes_and_prints_the_table() {
        let outcomes = vec![
            outcome(0, 100, Finish::Length),
            outcome(1, 300, Finish::Stop),
            outcome(2, 50, Finish::Rejected("POOL_EXHAUSTED".into())),
            outcome(3, 60, Finish::Rejected("POOL_EXHAUSTED".into())),
            outcome(4, 70, Finish::Error("worker 1 unavailable".into())),
        ];
        let s = Summary::new(&outcomes, Duration::from_secs(2), None);
        assert_eq!(
            (s.requests, s.ok, s.rejected_total(), s.errors_total()),
            (5, 2, 2, 1)
        );
        assert_eq!(s.preemptions, 5);
        assert_eq!((s.prompt_tokens, s.reused_tokens), (200, 100));
        let table = s.to_string();
        assert!(table.contains("POOL_EXHAUSTED 2"), "{table}");
        assert!(table.contains("1.00 req/s"), "{table}");
        assert!(table.contains("p50 100.0 ms"), "{table}");
        assert!(table.contains("(50.0%)"), "{table}");
        assert!(s.line().contains("rejected=2"), "{}", s.line());
        assert!(s.line().contains("worker 1 unavailable:1"), "{}", s.line());
    }

    #[test]
    fn delta_restarts_cache_counters_on_a_new_epoch() {
        let pool = |hits| pb::PoolStats {
            reuse_hits: hits,
            reuse_lookups: 10 * hits,
            ..Default::default()
        };
        let before = pb::GetStatusResponse {
            epoch: 1,
            preemptions: 2,
            pools: vec![pool(5)],
            ..Default::default()
        };
        let same = pb::GetStatusResponse {
            epoch: 1,
            preemptions: 7,
            pools: vec![pool(8)],
            ..Default::default()
        };
        let d = ClusterDelta::between(&before, &same);
        assert_eq!((d.preemptions, d.reuse_hits, d.reuse_lookups), (5, 3, 30));
        let restarted = pb::GetStatusResponse {
            epoch: 2,
            pools: vec![pool(1)],
            ..same
        };
        let d = ClusterDelta::between(&before, &restarted);
        assert!(d.epoch_changed);
        assert_eq!(d.reuse_hits, 1);
    }
}
