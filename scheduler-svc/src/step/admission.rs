//! Admission: which queued requests to lease this step, and what the Lease
//! outcomes mean for them.

use std::collections::{BTreeMap, VecDeque};
use std::time::Instant;

use super::{Core, Leasing, Sequence, Work};
use crate::domain::{Extra, Finish, LeaseSpec, Outcome, Reject, RejectReason, SeqId};
use crate::policy::{Admission, Demand, PoolLoad};
use crate::queue::Request;
use crate::routing::Candidate;

impl Core {
    /// Extra slots the lease of `request` keeps: drafts for greedy requests
    /// when speculation is on, and the lookahead.
    pub fn extra_for(&self, request: &Request) -> Extra {
        // drafts are verified against the argmax, and report no logprobs
        let draft = if self.config.draft_k > 0
            && request.sampling.is_greedy()
            && request.logprobs.is_none()
            && request.beam_width <= 1
        {
            self.config.draft_k
        } else {
            0
        };
        Extra {
            draft,
            extra_decoding_steps: self.config.lookahead,
            ..Extra::default()
        }
    }

    /// Queues a new request, or finishes it `REJECTED` at once when its whole
    /// life cannot fit in any group's empty pools.
    /// A beam request (`beam_width > 1`) answers its best `n` hypotheses
    /// (see `beams`); its beams are sequences of one sample each.
    pub fn submit(&mut self, mut request: Request) {
        if request.beam_width > 1 {
            let n = std::mem::replace(&mut request.n, 1);
            self.open_beams(&request, n);
        }
        if request.n > 1 {
            self.branches_left.insert(request.id, request.n);
        }
        let extra = self.extra_for(&request);
        // whether one sample's life fits an empty pool (the others may
        // wait for theirs)
        let demand = Demand {
            branches: 1,
            ..request.demand(extra)
        };
        let mut never = None;
        for (g, group) in self.groups.iter().enumerate() {
            if !self.admits(g, &request) {
                continue;
            }
            let empty: Vec<PoolLoad> = group
                .pools
                .iter()
                .map(|p| PoolLoad {
                    window: p.window,
                    total: p.num_blocks,
                    committed: 0,
                })
                .collect();
            match self.config.policy.admit(group, &empty, demand, true) {
                Admission::Never {
                    window,
                    needed,
                    total,
                } => never = Some(exceeds_capacity(group, window, needed, total)),
                Admission::Admit | Admission::Wait => {
                    never = None;
                    break;
                }
            }
        }
        match never {
            Some(reject) if !self.groups.is_empty() => {
                self.finish_request(&request, Finish::Rejected(reject))
            }
            _ => self.queue.push(request),
        }
    }

    /// Stamps the requests that entered the queue since the last call with
    /// `now`, and finishes those that waited longer than the maximum wait
    /// `REJECTED` with `QUEUE_TIMEOUT`: the figures of the cache's last
    /// refusal, and a message with the wait, the limit, the position and
    /// what kept it waiting (no session at the cache, the cache's last
    /// refusal, or the running requests).
    /// Returns how many it finished. The step loop calls it every iteration,
    /// so a starved request gets its answer within one step of the limit.
    pub fn expire_queue(&mut self, now: Instant) -> usize {
        let max = self.config.max_queue_wait;
        let queued = self.queue.len();
        let expired = self.queue.take_expired(|r| {
            let since = *r.queued_at.get_or_insert(now);
            max.is_some_and(|max| now.saturating_duration_since(since) > max)
        });
        let n = expired.len();
        for (at, request) in expired {
            let waited = request
                .queued_at
                .map_or(0, |t| now.saturating_duration_since(t).as_millis());
            let limit = max.map_or(0, |m| m.as_millis());
            let last = request.last_refusal.clone();
            let refusal = last.as_ref().map(|r| {
                format!(
                    "the cache's last refusal: {} ({} blocks needed, {} free, {} pending free)",
                    r.reason, r.blocks_needed, r.blocks_free, r.blocks_pending_free
                )
            });
            let cause = match (&self.session_missing, refusal) {
                (Some(why), None) => format!(
                    "the scheduler has no usable session at the cache ({why}), so nothing could be leased"
                ),
                (Some(why), Some(refusal)) => format!(
                    "the scheduler has no usable session at the cache ({why}); before that, {refusal}"
                ),
                (None, Some(refusal)) => refusal,
                (None, None) => {
                    "the cache never refused it: running requests filled the step".to_owned()
                }
            };
            let reject = timed_out(
                last,
                format!(
                    "waited {waited} ms in the queue, the limit is {limit} ms; it was at position {} of {queued}; {cause}",
                    at + 1
                ),
            );
            tracing::warn!(
                request = request.id.get(),
                waited_ms = waited as u64,
                limit_ms = limit as u64,
                position = at + 1,
                queued,
                "request timed out in the queue"
            );
            self.finish_request(&request, Finish::Rejected(reject));
        }
        n + self.expire_handoffs(now)
    }

    /// Whether [`Core::plan_admission`] may lease anything: a request
    /// waits in the queue, a fork for its branches, or a sequence for its
    /// handoff. Without any, admission is a no-op, and the loop need not
    /// wait for a `Step` answer on its way before it.
    pub fn may_admit(&self) -> bool {
        !self.queue.is_empty()
            || !self.forks.is_empty()
            || self.running.values().any(|s| s.handoff.is_some())
    }

    /// Admits requests from the head of the queue while the policy lets them
    /// in, and returns the leases to take: at most [`Core::batch_limit`] a
    /// step, so they go in one Lease call the cache takes (the queue's next
    /// requests are admitted at the next step).
    pub fn plan_admission(&mut self) -> Vec<LeaseSpec> {
        let policy = self.config.policy;
        let mut leases = Vec::new();
        if self.exhausted_this_step {
            self.reuse.clear();
            return leases;
        }
        let mut loads: Vec<Vec<PoolLoad>> = (0..self.groups.len()).map(|g| self.loads(g)).collect();
        let mut per_group: Vec<u32> = vec![0; self.groups.len()];
        // running sequences not planned yet (in flight under overlap, or
        // left without budget) keep a token each: newcomers never take the
        // decode budget of running requests
        let mut reserve: Vec<u32> = vec![0; self.groups.len()];
        for seq in self.running.values() {
            per_group[seq.group] += 1;
            if seq.planned.is_none() {
                reserve[seq.group] += 1;
            }
        }
        for l in &self.leasing {
            per_group[l.group] += 1;
        }
        self.plan_forks(&mut leases, &mut per_group, &reserve);
        self.plan_handoffs(&mut leases, &mut loads, &mut per_group, &reserve);
        loop {
            if self.running() >= self.config.max_seqs as usize || leases.len() >= self.batch_limit {
                break;
            }
            let Some(head) = self.queue.front() else {
                break;
            };
            let extra = self.extra_for(head);
            let demand = head.demand(extra);
            let lease_len = u32::try_from(head.context_len()).unwrap_or(u32::MAX);
            let head_id = head.id;
            let routing = self.config.routing;
            let mut chosen: Option<(usize, Candidate)> = None;
            let (mut never, mut excluded) = (0, 0);
            let now = Instant::now();
            for (g, group) in self.groups.iter().enumerate() {
                if !self.admits(g, head) {
                    excluded += 1;
                    continue;
                }
                if per_group[g] >= group.max_batch_sequences || self.budget[g] <= reserve[g] {
                    continue;
                }
                if self
                    .down_until
                    .get(g)
                    .copied()
                    .flatten()
                    .is_some_and(|t| now < t)
                {
                    continue;
                }
                match policy.admit(group, &loads[g], demand, self.batch_open) {
                    Admission::Admit => {
                        let here = Candidate {
                            committed: loads[g].iter().map(|l| l.committed).sum(),
                            prefill_tokens: lease_len
                                .saturating_sub(self.reused_in(head_id, g).min(lease_len)),
                            tokens_per_block: group.tokens_per_block,
                        };
                        if chosen.is_none_or(|(_, best)| routing.better(here, best)) {
                            chosen = Some((g, here));
                        }
                    }
                    Admission::Never { .. } => never += 1,
                    Admission::Wait => {}
                }
            }
            let Some((g, _)) = chosen else {
                if never > 0 && never + excluded == self.groups.len() {
                    if let Some(request) = self.queue.pop() {
                        // capacity shrank (re-registered pools): finish it
                        self.submit(request);
                    }
                    continue;
                }
                break;
            };
            let Some(request) = self.queue.pop() else {
                break;
            };
            let group = &self.groups[g];
            for load in loads[g].iter_mut() {
                load.committed += policy.charge(group, load.window, demand);
            }
            per_group[g] += 1;
            let seq_id = self.next_seq;
            self.next_seq = self.next_seq.next();
            let context = request.context();
            let lease_len = u32::try_from(context.len()).unwrap_or(u32::MAX);
            // the first prefill chunk is taken from this step's budget (at
            // least a token: the loop admits only while budget is left over
            // the reserve)
            let first = self
                .config
                .prefill_chunk
                .max(1)
                .min(lease_len)
                .min(self.budget[g].saturating_sub(reserve[g]));
            self.budget[g] -= first;
            if self.groups.len() > 1 {
                tracing::debug!(
                    request = request.id.get(),
                    pool_group = %group.name,
                    reused_tokens = self.reused_in(request.id, g),
                    routing = %routing.policy,
                    "routed"
                );
            }
            leases.push(LeaseSpec {
                seq_id,
                request: request.id,
                pool_group: group.name.clone(),
                prompt_tokens: context,
                extra,
                max_new_tokens: request.remaining(),
                priority: request.priority,
                cache_salt: request.cache_salt.clone(),
                retain: request.retain.clone(),
                reserve_full_life: policy.reserves_full_life(),
                // the cache publishes only the blocks this step's pass
                // writes; later chunks report their progress (plan_extends)
                prefill_tokens: first,
                fork_of: None,
                handoff_of: None,
                reuse_prefix: !request.needs_prompt_logprobs(),
                // a request whose pull failed is recomputed; one that
                // computes every position (prompt logprobs) reuses nothing
                peer_pull: self
                    .peer_rates()
                    .filter(|_| !request.peer_pull_failed && !request.needs_prompt_logprobs()),
            });
            self.leasing.push(Leasing {
                seq_id,
                request,
                group: g,
                extra,
                lease_len,
                first_chunk: first,
                fork_of: None,
                handoff_of: None,
            });
        }
        // a match answers for this step only: the pools change under it
        self.reuse.clear();
        leases
    }

    /// The leases of the branches waiting to fork (before the queue: their
    /// parent's prompt is prefilled and held for them), in the parent's
    /// group, each computing its last prompt token this step (a token of
    /// the step's budget). The cache has the last word: a branch it
    /// refuses waits in the queue as any request (`apply_leases`).
    fn plan_forks(&mut self, leases: &mut Vec<LeaseSpec>, per_group: &mut [u32], reserve: &[u32]) {
        let policy = self.config.policy;
        let mut waiting = Vec::new();
        for f in std::mem::take(&mut self.forks) {
            let g = f.group;
            let room = self.running() < self.config.max_seqs as usize
                && leases.len() < self.batch_limit
                && self.budget.get(g).is_some_and(|&b| b > reserve[g])
                && per_group[g] < self.groups[g].max_batch_sequences;
            if !room {
                waiting.push(f);
                continue;
            }
            self.budget[g] -= 1;
            per_group[g] += 1;
            let seq_id = self.next_seq;
            self.next_seq = self.next_seq.next();
            let extra = self.extra_for(&f.request);
            let context = f.request.context();
            let lease_len = u32::try_from(context.len()).unwrap_or(u32::MAX);
            leases.push(LeaseSpec {
                seq_id,
                request: f.request.id,
                pool_group: self.groups[g].name.clone(),
                prompt_tokens: context,
                extra,
                max_new_tokens: f.request.remaining(),
                priority: f.request.priority,
                cache_salt: f.request.cache_salt.clone(),
                retain: None,
                reserve_full_life: policy.reserves_full_life(),
                prefill_tokens: 1,
                fork_of: Some(f.parent),
                // a branch asks no prompt logprobs (sample 0 reports them)
                reuse_prefix: true,
                peer_pull: None,
                handoff_of: None,
            });
            self.leasing.push(Leasing {
                seq_id,
                request: f.request,
                group: g,
                extra,
                lease_len,
                first_chunk: 1,
                fork_of: Some(f.parent),
                handoff_of: None,
            });
        }
        self.forks = waiting;
    }

    /// The pools of group `g` with what running sequences are charged.
    pub(super) fn loads(&self, g: usize) -> Vec<PoolLoad> {
        let group = &self.groups[g];
        group
            .pools
            .iter()
            .map(|pool| {
                let mut committed = 0u32;
                for seq in self.running.values().filter(|s| s.group == g) {
                    committed = committed.saturating_add(self.config.policy.charge(
                        group,
                        pool.window,
                        seq.demand(),
                    ));
                }
                PoolLoad {
                    window: pool.window,
                    total: pool.num_blocks,
                    committed,
                }
            })
            .collect()
    }

    /// The pull a grant's peer copies make (one source group and transfer,
    /// by the grant's construction), or `None` when there are none or
    /// their source is neither a group of ours with an address to pull
    /// from nor one named in `peer_workers`.
    fn peer_pull(&self, copies: &[crate::domain::PeerCopy]) -> Option<crate::domain::PeerPull> {
        let first = copies.first()?;
        let address = match self.groups.iter().find(|g| g.name == first.src_group) {
            Some(source) => &source.peer.address,
            None => {
                &self
                    .config
                    .peer_workers
                    .iter()
                    .find(|(group, _)| *group == first.src_group)?
                    .1
            }
        };
        if address.is_empty()
            || copies
                .iter()
                .any(|c| c.src_group != first.src_group || c.transfer_id != first.transfer_id)
        {
            return None;
        }
        Some(crate::domain::PeerPull {
            address: address.clone(),
            transfer_id: first.transfer_id,
            blocks: copies
                .iter()
                .map(|c| (c.window, c.src_block, c.dst_block, c.tokens))
                .collect(),
        })
    }

    /// The Lease RPC failed as a whole: the requests go back to the queue.
    /// The cache may have taken the call before its answer was lost (a
    /// timeout, a dropped connection): each sequence is released all the
    /// same (idempotent: a no-op for one the cache never leased), with
    /// `discard_unwritten`, since no pass wrote the prompt blocks it would
    /// publish, and no step completes before that release went out.
    pub fn leases_failed(&mut self) {
        self.tier_call_failed();
        for l in std::mem::take(&mut self.leasing) {
            self.failed_releases.push(l.seq_id);
            if let Some(src) = l.handoff_of {
                self.handoff_refused(src, None);
            } else if self.cancelled_leasing.contains(&l.request.id) {
                self.finish_request(&l.request, Finish::Cancelled("client went away".into()));
            } else if let Some(parent) = l.fork_of {
                // its parent is still held for it: fork again next step
                self.forks.push(super::Fork {
                    parent,
                    group: l.group,
                    request: l.request,
                });
            } else {
                self.queue.requeue(l.request);
            }
        }
        self.cancelled_leasing.clear();
        self.advance_beams();
    }

    /// Applies the Lease outcomes: granted sequences start prefilling this
    /// step; transient refusals wait at the head of the queue; a refusal
    /// that can never succeed finishes the request `REJECTED` at once.
    pub fn apply_leases(&mut self, outcomes: Vec<Outcome>) {
        self.collect_tier_copies(self.step(), &outcomes);
        let mut leasing: BTreeMap<SeqId, Leasing> = std::mem::take(&mut self.leasing)
            .into_iter()
            .map(|l| (l.seq_id, l))
            .collect();
        let have_running = !self.running.is_empty();
        for outcome in outcomes {
            match outcome {
                Outcome::Grant(grant) => {
                    let Some(l) = leasing.remove(&grant.seq_id) else {
                        // a grant for nothing we asked: give it back
                        self.releases.push(grant.seq_id);
                        continue;
                    };
                    if let Some(src) = l.handoff_of {
                        if !self.handoff_granted(src, l.seq_id) {
                            continue;
                        }
                    } else if self.cancelled_leasing.contains(&l.request.id) {
                        self.releases.push(l.seq_id);
                        self.finish_request(
                            &l.request,
                            Finish::Cancelled("client went away".into()),
                        );
                        continue;
                    }
                    let mut reused = grant.reused_tokens.min(l.lease_len.saturating_sub(1));
                    let mut copies = grant.copies;
                    let copied = copies.first().map_or(0, |c| c.tokens);
                    // A peer pull runs in this step's pass, from a group of
                    // ours (the cache pins its sources until the step
                    // completes); otherwise the pass computes those blocks
                    // itself, from the first one on (and the partial copy
                    // after them cannot run either).
                    let mut peer = self.peer_pull(&grant.peer_copies);
                    if !grant.peer_copies.is_empty()
                        && (peer.is_none() || l.first_chunk == 0 || reused != grant.reused_tokens)
                    {
                        let tpb = self.groups.get(l.group).map_or(0, |g| g.tokens_per_block);
                        let pulled = grant.peer_blocks.saturating_mul(tpb);
                        reused = reused.min(grant.reused_tokens.saturating_sub(copied + pulled));
                        copies.clear();
                        peer = None;
                    }
                    // The copies must run in this step's pass; without a
                    // first chunk this step (or with a grant that does not
                    // add up), start at the last reused full block instead.
                    if !copies.is_empty()
                        && (l.first_chunk == 0
                            || reused != grant.reused_tokens
                            || copies.iter().any(|c| c.tokens != copied))
                    {
                        reused = reused.min(grant.reused_tokens.saturating_sub(copied));
                        copies.clear();
                    }
                    // The cache counts the first chunk from the grant's
                    // reused tokens: starting earlier (copies dropped), the
                    // pass also computes the tokens the copy would have
                    // given, so it writes exactly what the cache expects.
                    let dropped = grant.reused_tokens.saturating_sub(reused);
                    let len = (l.first_chunk + dropped).min(l.lease_len - reused);
                    if let Some(budget) = self.budget.get_mut(l.group) {
                        *budget = budget.saturating_sub(dropped);
                    }
                    let context = l.request.context();
                    let handoff = self.hands_off(l.group, &l.request).then(Default::default);
                    let mut request = l.request;
                    request.retained_tokens = grant.retained_tokens;
                    self.running.insert(
                        l.seq_id,
                        Sequence {
                            seq_id: l.seq_id,
                            group: l.group,
                            context,
                            tables: grant.tables,
                            extra: l.extra,
                            lease_len: l.lease_len,
                            kv_len: reused,
                            cache_len: l.lease_len,
                            reporting: l.lease_len,
                            capacity: grant.capacity_tokens,
                            reused_tokens: reused,
                            copies,
                            pulling: peer.is_some(),
                            peer,
                            planned: (len > 0).then_some(Work::Prefill { len }),
                            in_flight: VecDeque::new(),
                            history_sent: false,
                            // a fork granted what it asked: the parent's
                            // blocks before its last prompt token
                            shares_parent: l.fork_of.is_some()
                                && reused == l.lease_len.saturating_sub(1),
                            beam_row: None,
                            handoff,
                            request,
                        },
                    );
                }
                Outcome::Reject(reject) => {
                    let Some(l) = leasing.remove(&reject.seq_id) else {
                        continue;
                    };
                    // a refused lease holds nothing: the sequence id is done
                    self.released.push(l.seq_id);
                    if let Some(src) = l.handoff_of {
                        self.handoff_refused(src, Some(reject));
                        continue;
                    }
                    if self.cancelled_leasing.contains(&l.request.id) {
                        self.finish_request(
                            &l.request,
                            Finish::Cancelled("client went away".into()),
                        );
                        continue;
                    }
                    if l.request.is_started_beam() {
                        let transient = matches!(
                            reject.reason,
                            RejectReason::PoolExhausted | RejectReason::RolledBack
                        );
                        match l.fork_of {
                            // a reserving policy reserved the beam's blocks:
                            // they come back with the fences of the beams
                            // pruned before it, so the fork waits for them
                            // (its parent held) and the search stays exact
                            Some(parent)
                                if transient && self.config.policy.reserves_full_life() =>
                            {
                                self.forks.push(super::Fork {
                                    parent,
                                    group: l.group,
                                    request: l.request,
                                });
                            }
                            // exhaustion while forking drops that candidate
                            _ => self.beam_dropped(l.request.id, Finish::Rejected(reject)),
                        }
                        continue;
                    }
                    let wait = match reject.reason {
                        RejectReason::PoolExhausted | RejectReason::RolledBack => true,
                        // a branch whose parent the cache no longer holds
                        // is leased as any request
                        RejectReason::UnknownSequence => l.fork_of.is_some(),
                        // a quota frees up only when something of ours ends
                        RejectReason::QuotaExceeded => have_running,
                        _ => false,
                    };
                    if wait {
                        tracing::debug!(seq_id = reject.seq_id.get(), reason = %reject.reason,
                            blocks_needed = reject.blocks_needed, blocks_free = reject.blocks_free,
                            blocks_pending_free = reject.blocks_pending_free, "lease refused, waiting");
                        let mut request = l.request;
                        request.last_refusal = Some(reject);
                        self.queue.requeue(request);
                    } else {
                        self.finish_request(&l.request, Finish::Rejected(reject));
                    }
                }
            }
        }
        // leases with no outcome: nothing was taken, try again later
        for (seq_id, l) in leasing {
            self.released.push(seq_id);
            if let Some(src) = l.handoff_of {
                self.handoff_refused(src, None);
                continue;
            }
            match l.fork_of.filter(|_| l.request.is_started_beam()) {
                // a beam's fork: its parent is still held for it
                Some(parent) => self.forks.push(super::Fork {
                    parent,
                    group: l.group,
                    request: l.request,
                }),
                None => self.queue.requeue(l.request),
            }
        }
        self.cancelled_leasing.clear();
        self.advance_beams();
    }
}

/// The refusal of a request whose life never fits `group`'s pool of
/// `window`: it needs `needed` blocks of the pool's `total`.
pub(super) fn exceeds_capacity(
    group: &crate::domain::GroupGeometry,
    window: u32,
    needed: u32,
    total: u32,
) -> Reject {
    let pool_id = group
        .pools
        .iter()
        .find(|p| p.window == window)
        .map_or(0, |p| p.pool_id);
    Reject {
        seq_id: SeqId(0),
        reason: RejectReason::ExceedsCapacity,
        pool_id,
        window,
        blocks_needed: needed,
        blocks_free: total,
        blocks_pending_free: 0,
        message: format!(
            "request needs {needed} blocks over its life in pool window {window}, which has {total}"
        ),
    }
}

/// A `QUEUE_TIMEOUT` refusal saying `message`, with the figures of the
/// cache's `last` refusal when there was one.
pub(super) fn timed_out(last: Option<Reject>, message: String) -> Reject {
    Reject {
        seq_id: SeqId(0),
        reason: RejectReason::QueueTimeout,
        message,
        ..last.unwrap_or(Reject {
            seq_id: SeqId(0),
            reason: RejectReason::QueueTimeout,
            pool_id: 0,
            window: 0,
            blocks_needed: 0,
            blocks_free: 0,
            blocks_pending_free: 0,
            message: String::new(),
        })
    }
}
