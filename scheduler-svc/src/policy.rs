//! Capacity policies: what to admit this step, given the pool figures the
//! scheduler knows and each request's block needs.
//!
//! The scheduler keeps its own view of each pool: `committed` blocks are the
//! blocks its running sequences are charged for (the whole life under
//! `GUARANTEED_NO_EVICT` and `STATIC_BATCH`, the next step's need under
//! `MAX_UTILIZATION`). Blocks released under a fence are not charged: they are
//! pending-free, so parked frees never hold the queue back. The cache has the
//! last word: a lease the view lets through may still be refused, and the
//! refusal is handled as data by `step/` (the core).

use std::fmt;
use std::str::FromStr;

use crate::domain::GroupGeometry;

/// How the scheduler trades admission against the risk of running out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Policy {
    /// Reserve each request's whole life at admission; an admitted request is
    /// never rejected or preempted for capacity.
    GuaranteedNoEvict,
    /// Admit on the next step's need and over-subscribe; a mid-flight
    /// exhaustion preempts or rejects (see [`OnExhausted`]).
    MaxUtilization,
    /// Form a batch when nothing runs, reserve its whole life, and admit
    /// nothing more until the batch has finished.
    StaticBatch,
}

impl Policy {
    /// Whether leases reserve the whole life (`reserve_full_life`).
    pub fn reserves_full_life(self) -> bool {
        !matches!(self, Self::MaxUtilization)
    }

    /// The name used in configuration and status.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::GuaranteedNoEvict => "guaranteed-no-evict",
            Self::MaxUtilization => "max-utilization",
            Self::StaticBatch => "static-batch",
        }
    }

    /// Blocks a request or sequence is charged in a pool of `window`: with
    /// samples, the blocks they share once (none for a forked sample, whose
    /// parent is charged them) and the rest per sample, as the cache
    /// takes them.
    pub fn charge(self, group: &GroupGeometry, window: u32, demand: Demand) -> u32 {
        let tokens = if self.reserves_full_life() {
            demand.life_tokens
        } else {
            demand.next_tokens
        };
        let whole = group.blocks_for(tokens, window);
        let shared = match window {
            0 => (demand.shared_tokens / group.tokens_per_block.max(1)).min(whole),
            _ => 0,
        };
        let own = (whole - shared).saturating_mul(demand.branches.max(1));
        if demand.shared_elsewhere {
            own
        } else {
            own.saturating_add(shared)
        }
    }

    /// Whether to lease `demand` now. `loads` are the group's pools with
    /// what is committed in each; `batch_open` is true when no sequence of
    /// the scheduler was running at the start of this step.
    pub fn admit(
        self,
        group: &GroupGeometry,
        loads: &[PoolLoad],
        demand: Demand,
        batch_open: bool,
    ) -> Admission {
        // A request whose whole life cannot fit in an empty pool would wait
        // (or be preempted) forever: reject it at once, whatever the policy.
        for load in loads {
            let life = group.blocks_for(demand.life_tokens, load.window);
            if life > load.total {
                return Admission::Never {
                    window: load.window,
                    needed: life,
                    total: load.total,
                };
            }
        }
        if self == Self::StaticBatch && !batch_open {
            return Admission::Wait;
        }
        let fits = loads.iter().all(|load| {
            let need = self.charge(group, load.window, demand);
            load.committed.saturating_add(need) <= load.total
        });
        if fits {
            Admission::Admit
        } else {
            Admission::Wait
        }
    }
}

impl fmt::Display for Policy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Policy {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.to_ascii_lowercase().replace('_', "-").as_str() {
            "guaranteed-no-evict" => Ok(Self::GuaranteedNoEvict),
            "max-utilization" => Ok(Self::MaxUtilization),
            "static-batch" => Ok(Self::StaticBatch),
            other => Err(format!(
                "unknown policy {other:?} (guaranteed-no-evict, max-utilization, static-batch)"
            )),
        }
    }
}

/// What `MAX_UTILIZATION` does when a running sequence cannot grow.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OnExhausted {
    /// Release the sequence, requeue the request and recompute it later
    /// (bounded per request; past the bound the request is rejected).
    Preempt,
    /// Finish the request `REJECTED` with the cache's reason.
    Reject,
}

impl OnExhausted {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Preempt => "preempt",
            Self::Reject => "reject",
        }
    }
}

impl fmt::Display for OnExhausted {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for OnExhausted {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.to_ascii_lowercase().as_str() {
            "preempt" => Ok(Self::Preempt),
            "reject" => Ok(Self::Reject),
            other => Err(format!(
                "unknown on-exhausted mode {other:?} (preempt, reject)"
            )),
        }
    }
}

/// Token slots a request or sequence needs: next step, and whole life.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Demand {
    /// Slots held after the next lease or extend (extra slots included).
    pub next_tokens: u32,
    /// Slots over the whole life (extra slots included).
    pub life_tokens: u32,
    /// Samples it stands for (0 is read as 1): a request of several samples
    /// not forked yet is charged its shared blocks once and the rest per
    /// sample.
    pub branches: u32,
    /// Leading tokens whose full blocks the samples share (the prompt but
    /// its last token): in a full-attention pool they are charged once
    /// (windowed pools charge every sample whole: their blocks slide).
    pub shared_tokens: u32,
    /// A forked sample: its shared blocks are charged to the sequence it
    /// shares them with, not to it.
    pub shared_elsewhere: bool,
}

impl Demand {
    /// The demand of one sequence that shares nothing.
    pub fn new(next_tokens: u32, life_tokens: u32) -> Self {
        Self {
            next_tokens,
            life_tokens,
            branches: 1,
            shared_tokens: 0,
            shared_elsewhere: false,
        }
    }
}

/// One pool as the admission decision sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolLoad {
    pub window: u32,
    pub total: u32,
    /// Blocks charged to running sequences (and to admissions of this step).
    pub committed: u32,
}

/// The admission decision for the head of the queue.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admission {
    /// Lease it now.
    Admit,
    /// Not now; keep it at the head and stop admitting this step.
    Wait,
    /// Never fits: finish it rejected at once.
    Never {
        window: u32,
        needed: u32,
        total: u32,
    },
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::PoolGeometry;

    fn group(blocks: u32) -> GroupGeometry {
        GroupGeometry {
            name: "g".into(),
            tokens_per_block: 16,
            pools: vec![
                PoolGeometry {
                    host_blocks: 0,
                    pool_id: 1,
                    window: 0,
                    num_blocks: blocks,
                },
                PoolGeometry {
                    host_blocks: 0,
                    pool_id: 2,
                    window: 64,
                    num_blocks: blocks,
                },
            ],
            max_context: 4096,
            vocab_size: 258,
            max_batch_sequences: 64,
            max_batch_tokens: 4096,
            peer: Default::default(),
            role: Default::default(),
        }
    }

    fn loads(g: &GroupGeometry, committed: u32) -> Vec<PoolLoad> {
        g.pools
            .iter()
            .map(|p| PoolLoad {
                window: p.window,
                total: p.num_blocks,
                committed,
            })
            .collect()
    }

    #[test]
    fn max_utilization_admits_on_next_need_no_evict_on_life() {
        let g = group(10);
        // 32 tokens now (2 blocks), 160 over the life (10 blocks)
        let d = Demand::new(32, 160);
        let l = loads(&g, 8);
        assert_eq!(
            Policy::MaxUtilization.admit(&g, &l, d, false),
            Admission::Admit
        );
        assert_eq!(
            Policy::GuaranteedNoEvict.admit(&g, &l, d, false),
            Admission::Wait
        );
        assert_eq!(
            Policy::GuaranteedNoEvict.admit(&g, &loads(&g, 0), d, false),
            Admission::Admit
        );
    }

    #[test]
    fn never_fitting_request_is_refused_by_every_policy() {
        let g = group(10);
        let d = Demand::new(16, 161);
        for p in [
            Policy::MaxUtilization,
            Policy::GuaranteedNoEvict,
            Policy::StaticBatch,
        ] {
            assert_eq!(
                p.admit(&g, &loads(&g, 0), d, true),
                Admission::Never {
                    window: 0,
                    needed: 11,
                    total: 10
                }
            );
        }
    }

    #[test]
    fn static_batch_admits_only_into_an_open_batch() {
        let g = group(10);
        let d = Demand::new(16, 32);
        assert_eq!(
            Policy::StaticBatch.admit(&g, &loads(&g, 0), d, false),
            Admission::Wait
        );
        assert_eq!(
            Policy::StaticBatch.admit(&g, &loads(&g, 0), d, true),
            Admission::Admit
        );
        assert_eq!(
            Policy::StaticBatch.admit(&g, &loads(&g, 9), d, true),
            Admission::Wait
        );
    }

    #[test]
    fn samples_are_charged_their_shared_prompt_blocks_once() {
        // blocks of 16: a 41-token prompt shares 2 full blocks (40 tokens)
        let g = group(100);
        let mut d = Demand::new(41, 60);
        assert_eq!(Policy::GuaranteedNoEvict.charge(&g, 0, d), 4);
        d.branches = 3;
        d.shared_tokens = 40;
        // 2 shared + 3 x (4 - 2)
        assert_eq!(Policy::GuaranteedNoEvict.charge(&g, 0, d), 2 + 3 * 2);
        assert_eq!(Policy::MaxUtilization.charge(&g, 0, d), 2 + 3);
        // a forked sample: only its own blocks
        d.branches = 1;
        d.shared_elsewhere = true;
        assert_eq!(Policy::GuaranteedNoEvict.charge(&g, 0, d), 2);
        // a window pool charges every sample whole
        d.shared_elsewhere = false;
        d.branches = 3;
        assert_eq!(
            Policy::GuaranteedNoEvict.charge(&g, 32, d),
            3 * g.blocks_for(60, 32)
        );
    }

    #[test]
    fn names_round_trip() {
        for p in [
            Policy::MaxUtilization,
            Policy::GuaranteedNoEvict,
            Policy::StaticBatch,
        ] {
            assert_eq!(p.as_str().parse::<Policy>(), Ok(p));
        }
        assert_eq!(
            "MAX_UTILIZATION".parse::<Policy>(),
            Ok(Policy::MaxUtilization)
        );
        assert!("lru".parse::<Policy>().is_err());
        assert_eq!("reject".parse::<OnExhausted>(), Ok(OnExhausted::Reject));
    }
}
