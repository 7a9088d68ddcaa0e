//! Routing inputs of admission: which queued requests the step loop should
//! ask the cache's `Match` about, and the per-group reuse it answers, which
//! [`Core::plan_admission`] consumes to score the groups
//! ([`crate::routing`]).

use std::collections::HashMap;

use super::Core;
use crate::domain::RequestId;
use crate::policy::Admission;
use crate::routing::Routing;

/// What a block a peer pull brings is worth against a block reused in
/// place, for routing: the share of its compute the pull saves,
/// `1 - pull time / compute time` at `rates` (0 when pulling costs more,
/// and for blocks of unknown size), the fixed cost of a pull left out.
pub(crate) fn peer_weight(
    rates: &crate::domain::PeerRates,
    block_bytes: u64,
    tokens_per_block: u32,
) -> f64 {
    if block_bytes == 0 || tokens_per_block == 0 {
        return 0.0;
    }
    let pull = block_bytes as f64 / rates.link_bytes_per_s.max(1) as f64;
    let compute = f64::from(tokens_per_block) / rates.prefill_tokens_per_s.max(1) as f64;
    (1.0 - pull / compute).clamp(0.0, 1.0)
}

/// Most queued requests one step asks `Match` about.
pub const MATCH_BATCH: usize = 64;

/// A queued request the loop should match: its id, the context a lease of
/// it would carry, and its cache salt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MatchWanted {
    pub request: RequestId,
    pub context: Vec<u32>,
    pub cache_salt: String,
}

impl Core {
    /// The requests admission may consider this step (the head of the
    /// queue, up to the free sequence slots), when routing has a choice to
    /// make: `kv-aware` with more than one group, and some group could
    /// admit the head now. Empty otherwise.
    pub fn match_wanted(&self) -> Vec<MatchWanted> {
        if self.config.routing.policy != Routing::KvAware
            || self.groups.len() < 2
            || self.exhausted_this_step
        {
            return Vec::new();
        }
        // nothing to route while no group could take the head now (a
        // saturated cluster would otherwise send the queue every step)
        let Some(head) = self.queue.front() else {
            return Vec::new();
        };
        let extra = self.extra_for(head);
        let demand = head.demand(extra);
        let admissible = self.groups.iter().enumerate().any(|(g, group)| {
            let loads = self.loads(g);
            self.config
                .policy
                .admit(group, &loads, demand, self.batch_open)
                == Admission::Admit
        });
        if !admissible {
            return Vec::new();
        }
        let slots = (self.config.max_seqs as usize).saturating_sub(self.running());
        self.queue
            // admission leases no more than the batch limit in a step
            .head(slots.min(MATCH_BATCH).min(self.batch_limit))
            .map(|r| MatchWanted {
                request: r.id,
                context: r.context(),
                cache_salt: r.cache_salt.clone(),
            })
            .collect()
    }

    /// The reused tokens `Match` reported, per request and group (in the
    /// order of [`Core::groups`]), for the next [`Core::plan_admission`]
    /// only. A request without an entry is routed as if nothing were
    /// cached for it (least committed, for groups of one block size).
    pub fn set_reuse(&mut self, reuse: HashMap<RequestId, Vec<u32>>) {
        self.reuse = reuse;
    }

    /// As [`Core::set_reuse`], from `Match`'s `(reused, peer)` tokens per
    /// group: the tokens a peer pull would bring count at
    /// `peer_weight` of a reused one (none without peer pull).
    pub fn set_matches(&mut self, matches: HashMap<RequestId, Vec<(u32, u32)>>) {
        let weights: Vec<f64> = self
            .groups
            .iter()
            .map(|g| match self.peer_rates() {
                Some(rates) => {
                    peer_weight(&rates, g.peer.block_bytes.iter().sum(), g.tokens_per_block)
                }
                None => 0.0,
            })
            .collect();
        self.reuse = matches
            .into_iter()
            .map(|(request, row)| {
                let row = row
                    .into_iter()
                    .zip(&weights)
                    .map(|((reused, peer), w)| reused + (f64::from(peer) * w) as u32)
                    .collect();
                (request, row)
            })
            .collect();
    }

    /// Tokens of `request`'s context cached in group `g`, as last matched.
    pub(super) fn reused_in(&self, request: RequestId, g: usize) -> u32 {
        self.reuse
            .get(&request)
            .and_then(|per_group| per_group.get(g))
            .copied()
            .unwrap_or(0)
    }
}
