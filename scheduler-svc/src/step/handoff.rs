//! Disaggregated serving: a request admitted to a `prefill` group is
//! handed off to a `decode` (or `both`) group once its prompt is in the KV
//! and its first token sampled.
//!
//! The hand-off is a lease in the decode group naming the prefill
//! sequence (`LeaseSpec::handoff_of`): the cache grants blocks for the
//! prompt plus the first token and a forced peer pull of every prompt
//! position's KV (pinned until the lease's step completes), so the decode
//! group's first pass computes only the first token's position. On the
//! grant the prefill sequence is released, fenced at that step (the
//! transfer's); the new sequence goes on as a recomputed one would
//! (`apply_leases`), its pull in its first pass.
//!
//! A refused hand-off is an answer, never a stuck transfer: a transient
//! refusal (the decode group's pool is full) keeps the prefill sequence
//! waiting for the next step (its blocks held, as a queued request waits)
//! up to the queue's maximum wait, or ends it `REJECTED` under
//! `--on-exhausted reject`, as a mid-flight exhaustion does; any other
//! refusal ends it `REJECTED`. A pull that fails (the prefill worker gone,
//! the stream cut) requeues the request to be recomputed in a decode group
//! (`peer_pull_failed`), bounded by `max_preemptions`.

use std::time::Instant;

use super::admission::{exceeds_capacity, timed_out};
use super::{Core, Leasing};
use crate::domain::{Finish, LeaseSpec, Reject, RejectReason, Role, SeqId};
use crate::policy::{Admission, OnExhausted, Policy, PoolLoad};
use crate::queue::Request;
use crate::routing::Candidate;

/// Where a sequence of a `prefill` group stands in its hand-off.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(super) struct HandoffState {
    /// Its lease in a decode group is in flight.
    pub(super) leasing: bool,
    /// When the decode groups first refused or had no room for it.
    pub(super) waiting_since: Option<Instant>,
    /// The decode group's last refusal.
    pub(super) last_refusal: Option<Reject>,
}

impl Core {
    /// Whether a request admitted to group `g` is handed off after its
    /// prefill: `g` is a prefill group and the request is one sample of
    /// one beam (several samples fork from the prefilled prompt, and a
    /// beam search keeps its beams together: those decode where they
    /// prefilled).
    pub(super) fn hands_off(&self, g: usize, request: &Request) -> bool {
        self.groups.get(g).is_some_and(|x| x.role == Role::Prefill)
            && request.beam_width <= 1
            && request.n <= 1
            && !self.branches_left.contains_key(&request.id)
    }

    /// Whether admission may lease `request` in group `g`: new requests in
    /// groups that prefill; one whose hand-off pull failed is recomputed
    /// in a group that decodes.
    pub(super) fn admits(&self, g: usize, request: &Request) -> bool {
        let role = self.groups.get(g).map_or(Role::Both, |x| x.role);
        match request.peer_pull_failed {
            false => role.prefills(),
            true => role.decodes(),
        }
    }

    /// The hand-off leases of this step: each prefill sequence whose prompt
    /// is in the KV (its first token sampled, no pass in flight) is leased
    /// in the decode group the routing prefers among those with room,
    /// computing one token there this step (a token of that group's
    /// budget). One that fits no decode group ends `REJECTED`.
    pub(super) fn plan_handoffs(
        &mut self,
        leases: &mut Vec<LeaseSpec>,
        loads: &mut [Vec<PoolLoad>],
        per_group: &mut [u32],
        reserve: &[u32],
    ) {
        let ready: Vec<SeqId> = self
            .running
            .values()
            .filter(|s| {
                s.handoff.as_ref().is_some_and(|h| !h.leasing)
                    && s.decoding()
                    && s.in_flight.is_empty()
                    && s.planned.is_none()
            })
            .map(|s| s.seq_id)
            .collect();
        let policy = self.config.policy;
        let routing = self.config.routing;
        let now = Instant::now();
        for src in ready {
            if self.running() >= self.config.max_seqs as usize || leases.len() >= self.batch_limit {
                break;
            }
            let Some(seq) = self.running.get(&src) else {
                continue;
            };
            let extra = self.extra_for(&seq.request);
            let demand = seq.request.demand(extra);
            let mut chosen: Option<(usize, Candidate)> = None;
            let mut never = None;
            let (mut decoders, mut nevers) = (0, 0);
            for (g, group) in self.groups.iter().enumerate() {
                if !group.role.decodes() {
                    continue;
                }
                decoders += 1;
                let down = self.down_until[g].is_some_and(|t| now < t);
                if down || per_group[g] >= group.max_batch_sequences || self.budget[g] <= reserve[g]
                {
                    continue;
                }
                match policy.admit(group, &loads[g], demand, self.batch_open) {
                    Admission::Admit => {
                        let here = Candidate {
                            committed: loads[g].iter().map(|l| l.committed).sum(),
                            prefill_tokens: 1,
                            tokens_per_block: group.tokens_per_block,
                        };
                        if chosen.is_none_or(|(_, best)| routing.better(here, best)) {
                            chosen = Some((g, here));
                        }
                    }
                    Admission::Never {
                        window,
                        needed,
                        total,
                    } => {
                        nevers += 1;
                        never = Some((g, window, needed, total));
                    }
                    Admission::Wait => {}
                }
            }
            let Some((g, _)) = chosen else {
                match never {
                    Some((g, window, needed, total)) if nevers == decoders => {
                        let reject = exceeds_capacity(&self.groups[g], window, needed, total);
                        self.end_sequence(src, Finish::Rejected(reject));
                    }
                    _ => {
                        if let Some(h) = self.running.get_mut(&src).and_then(|s| s.handoff.as_mut())
                        {
                            h.waiting_since.get_or_insert(now);
                        }
                    }
                }
                continue;
            };
            let Some(seq) = self.running.get_mut(&src) else {
                continue;
            };
            if let Some(h) = seq.handoff.as_mut() {
                h.leasing = true;
            }
            let request = seq.request.clone();
            let group = &self.groups[g];
            for load in loads[g].iter_mut() {
                load.committed += policy.charge(group, load.window, demand);
            }
            per_group[g] += 1;
            self.budget[g] -= 1;
            let seq_id = self.next_seq;
            self.next_seq = self.next_seq.next();
            let context = request.context();
            tracing::debug!(
                request = request.id.get(),
                from = %self.groups[seq.group].name,
                to = %group.name,
                "handing off"
            );
            leases.push(LeaseSpec {
                seq_id,
                request: request.id,
                pool_group: group.name.clone(),
                prompt_tokens: context.clone(),
                extra,
                max_new_tokens: request.remaining(),
                priority: request.priority,
                cache_salt: request.cache_salt.clone(),
                retain: None,
                reserve_full_life: policy.reserves_full_life(),
                // the first token's position: everything before is pulled
                prefill_tokens: 1,
                fork_of: None,
                reuse_prefix: !request.needs_prompt_logprobs(),
                peer_pull: self.config.peer_pull,
                handoff_of: Some(src),
            });
            self.leasing.push(Leasing {
                seq_id,
                group: g,
                extra,
                lease_len: u32::try_from(context.len()).unwrap_or(u32::MAX),
                first_chunk: 1,
                fork_of: None,
                handoff_of: Some(src),
                request,
            });
        }
    }

    /// A hand-off lease's outcome came back (or none did: `None`), before
    /// the new sequence is made: the prefill sequence `src` is released
    /// fenced at this step on a grant. Returns whether a grant goes on to
    /// become the decode sequence (false: `src` ended meanwhile, and the
    /// granted lease is given back).
    pub(super) fn handoff_granted(&mut self, src: SeqId, lease: SeqId) -> bool {
        match self.running.remove(&src) {
            Some(seq) => {
                // its blocks stay pinned by the decode lease until this
                // step completes; the release is fenced at it too
                self.release_ended(&seq);
                true
            }
            None => {
                self.releases.push(lease);
                false
            }
        }
    }

    /// A hand-off lease was refused (or the call failed, `reject` `None`):
    /// the prefill sequence waits for the next step, or ends by the rule
    /// in the module documentation.
    pub(super) fn handoff_refused(&mut self, src: SeqId, reject: Option<Reject>) {
        let now = Instant::now();
        let Some(h) = self.running.get_mut(&src).and_then(|s| s.handoff.as_mut()) else {
            return;
        };
        h.leasing = false;
        let Some(reject) = reject else {
            return;
        };
        let transient = matches!(
            reject.reason,
            RejectReason::PoolExhausted | RejectReason::RolledBack | RejectReason::QuotaExceeded
        );
        let rejects = self.config.policy == Policy::MaxUtilization
            && self.config.on_exhausted == OnExhausted::Reject;
        if transient && !rejects {
            h.waiting_since.get_or_insert(now);
            h.last_refusal = Some(reject);
            return;
        }
        self.end_sequence(
            src,
            Finish::Rejected(Reject {
                seq_id: src,
                ..reject
            }),
        );
    }

    /// Ends the prefill sequences that waited for a decode group longer
    /// than the queue's maximum wait: `REJECTED` with `QUEUE_TIMEOUT` and
    /// the decode group's last refusal. Returns how many.
    pub(super) fn expire_handoffs(&mut self, now: Instant) -> usize {
        let Some(max) = self.config.max_queue_wait else {
            return 0;
        };
        let expired: Vec<(SeqId, Option<Reject>, u128)> = self
            .running
            .values()
            .filter_map(|s| {
                let h = s.handoff.as_ref().filter(|h| !h.leasing)?;
                let waited = now.saturating_duration_since(h.waiting_since?);
                (waited > max).then(|| (s.seq_id, h.last_refusal.clone(), waited.as_millis()))
            })
            .collect();
        let n = expired.len();
        for (seq_id, last, waited) in expired {
            let cause = match &last {
                Some(r) => format!(
                    "the decode group's last refusal: {} ({} blocks needed, {} free, {} pending free)",
                    r.reason, r.blocks_needed, r.blocks_free, r.blocks_pending_free
                ),
                None => "no decode group had room for it".to_owned(),
            };
            let reject = timed_out(
                last,
                format!(
                    "its prefill done, it waited {waited} ms for a decode group, the limit is {} ms; {cause}",
                    max.as_millis()
                ),
            );
            self.end_sequence(seq_id, Finish::Rejected(reject));
        }
        n
    }
}
