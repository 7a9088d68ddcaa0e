//! The scheduler core: which sequences run this step and how, what to lease,
//! extend and release, and what each lease outcome and forward result means
//! for the requests. Plain synchronous code; the async loop in `engine.rs`
//! calls it around the cache and worker RPCs:
//!
//! ```text
//! begin_step -> plan_extends -> [Extend] -> apply_extends
//!            -> plan_admission -> [Lease] -> apply_leases
//!            -> plan_forward -> [Forward] -> apply_forward
//!            -> take_releases -> [Release fenced at the step] -> [CompleteStep]
//! ```
//!
//! A sequence is one lease of a request. Its KV bookkeeping: `kv_len`
//! positions hold KV; the cache has accounted `cache_len` slots (plus the
//! lease's extra slots). In decode, the token fed next is `context[kv_len]`
//! and each step first extends the lease by `kv_len + 1 - cache_len` tokens
//! (accepted drafts whose KV is already written, plus the fed token).

use std::collections::{BTreeMap, HashSet};
use std::time::{Duration, Instant};

use crate::domain::{
    ExtendSpec, Extra, Finish, ForwardItem, ForwardResult, GroupGeometry, LeaseSpec, Outcome,
    Output, Reject, RejectReason, RequestId, SeqId, Table,
};
use crate::policy::{Admission, Demand, OnExhausted, Policy, PoolLoad};
use crate::queue::{Queue, Request};
use crate::spec;

/// The knobs of the core.
#[derive(Debug, Clone)]
pub struct CoreConfig {
    pub policy: Policy,
    pub on_exhausted: OnExhausted,
    /// Times a request may be requeued for recompute (preempted when a
    /// pool ran out, or its worker failed a forward pass) before it ends
    /// instead (`REJECTED` or `ERROR`).
    pub max_preemptions: u32,
    /// Sequences running (leased) at once, at most.
    pub max_seqs: u32,
    /// Tokens in one step's forward batch, at most (per worker group).
    pub max_tokens_per_step: u32,
    /// Prompt tokens one sequence prefills per step, at most.
    pub prefill_chunk: u32,
    /// Prompt-lookup draft tokens per decode step; 0 turns speculation off.
    pub draft_k: u32,
}

impl Default for CoreConfig {
    fn default() -> Self {
        Self {
            policy: Policy::MaxUtilization,
            on_exhausted: OnExhausted::Preempt,
            max_preemptions: 4,
            max_seqs: 256,
            max_tokens_per_step: 2048,
            prefill_chunk: 512,
            draft_k: 0,
        }
    }
}

/// Requests finished by reason, and preemptions, since start.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counters {
    pub finished_length: u64,
    pub finished_stop: u64,
    pub cancelled: u64,
    pub rejected: u64,
    pub errors: u64,
    pub preemptions: u64,
}

/// What a sequence does in the step being planned or run.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Work {
    /// Prefill `len` context tokens from `kv_len`.
    Prefill { len: u32 },
    /// Feed `context[kv_len]` and verify `drafts`.
    Decode { drafts: Vec<u32> },
}

#[derive(Debug)]
struct Sequence {
    seq_id: SeqId,
    request: Request,
    group: usize,
    /// Prompt and generated tokens.
    context: Vec<u32>,
    tables: Vec<Table>,
    extra: Extra,
    /// Context length the lease was taken for.
    lease_len: u32,
    kv_len: u32,
    cache_len: u32,
    reused_tokens: u32,
    /// Planned this step, not yet sent to the worker.
    planned: Option<Work>,
    /// Sent to the worker, result not yet applied.
    in_flight: Option<Work>,
}

impl Sequence {
    fn decoding(&self) -> bool {
        self.kv_len >= self.lease_len
    }

    fn demand(&self) -> Demand {
        let next = if self.decoding() {
            self.kv_len.saturating_add(2)
        } else {
            self.lease_len
        };
        Demand {
            next_tokens: next.saturating_add(self.extra.total()),
            life_tokens: self.request.full_life_tokens(self.extra),
        }
    }
}

#[derive(Debug)]
struct Leasing {
    seq_id: SeqId,
    request: Request,
    group: usize,
    extra: Extra,
    lease_len: u32,
    /// Prompt tokens budgeted for the first prefill chunk this step.
    first_chunk: u32,
}

/// The scheduler core. See the module documentation for the call order.
#[derive(Debug)]
pub struct Core {
    config: CoreConfig,
    groups: Vec<GroupGeometry>,
    queue: Queue,
    running: BTreeMap<SeqId, Sequence>,
    leasing: Vec<Leasing>,
    /// Requests cancelled while their lease was in flight.
    cancelled_leasing: HashSet<RequestId>,
    releases: Vec<SeqId>,
    outputs: Vec<Output>,
    next_seq: SeqId,
    /// Tokens left in this step's batch, per group.
    budget: Vec<u32>,
    batch_open: bool,
    /// The cache refused to grow a sequence this step: the pool is full, so
    /// admitting more this step would only be refused too.
    exhausted_this_step: bool,
    /// Groups whose worker failed a forward pass: no admissions until then,
    /// so new requests go to the replicas that still answer.
    down_until: Vec<Option<Instant>>,
    counters: Counters,
}

/// How long a group whose worker failed is left out of admission before it
/// is tried again.
pub const WORKER_RETRY_AFTER: Duration = Duration::from_secs(5);

impl Core {
    /// A core serving `groups` (at least one).
    pub fn new(config: CoreConfig, groups: Vec<GroupGeometry>) -> Self {
        let budget = vec![0; groups.len()];
        let down_until = vec![None; groups.len()];
        Self {
            config,
            groups,
            queue: Queue::new(),
            running: BTreeMap::new(),
            leasing: Vec::new(),
            cancelled_leasing: HashSet::new(),
            releases: Vec::new(),
            outputs: Vec::new(),
            next_seq: 1,
            budget,
            batch_open: true,
            exhausted_this_step: false,
            down_until,
            counters: Counters::default(),
        }
    }

    pub fn config(&self) -> &CoreConfig {
        &self.config
    }

    pub fn groups(&self) -> &[GroupGeometry] {
        &self.groups
    }

    pub fn counters(&self) -> Counters {
        self.counters
    }

    pub fn queued(&self) -> usize {
        self.queue.len()
    }

    pub fn preempted(&self) -> usize {
        self.queue.preempted()
    }

    pub fn running(&self) -> usize {
        self.running.len() + self.leasing.len()
    }

    /// Whether anything is waiting, leasing or running.
    pub fn is_idle(&self) -> bool {
        self.queue.is_empty() && self.running.is_empty() && self.leasing.is_empty()
    }

    /// Requests the core holds (queued, leasing or running).
    pub fn live_requests(&self) -> Vec<RequestId> {
        let mut ids: Vec<RequestId> = self.queue.ids().collect();
        ids.extend(self.leasing.iter().map(|l| l.request.id));
        ids.extend(self.running.values().map(|s| s.request.id));
        ids
    }

    /// Extra slots the lease of `request` keeps: drafts for greedy requests
    /// when speculation is on.
    pub fn extra_for(&self, request: &Request) -> Extra {
        let draft = if self.config.draft_k > 0 && request.sampling.is_greedy() {
            self.config.draft_k
        } else {
            0
        };
        Extra {
            draft,
            ..Extra::default()
        }
    }

    /// Queues a new request, or finishes it `REJECTED` at once when its whole
    /// life cannot fit in any group's empty pools.
    pub fn submit(&mut self, request: Request) {
        let extra = self.extra_for(&request);
        let demand = Demand {
            next_tokens: request.lease_tokens(extra),
            life_tokens: request.full_life_tokens(extra),
        };
        let mut never = None;
        for group in &self.groups {
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
                } => {
                    let pool_id = group
                        .pools
                        .iter()
                        .find(|p| p.window == window)
                        .map_or(0, |p| p.pool_id);
                    never = Some(Reject {
                        seq_id: 0,
                        reason: RejectReason::ExceedsCapacity,
                        pool_id,
                        window,
                        blocks_needed: needed,
                        blocks_free: total,
                        blocks_pending_free: 0,
                        message: format!(
                            "request needs {needed} blocks over its life in pool window {window}, which has {total}"
                        ),
                    });
                }
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

    /// Cancels a request wherever it is; a running one is released at the
    /// next release (fenced by the caller).
    pub fn cancel(&mut self, id: RequestId, why: &str) {
        if let Some(request) = self.queue.remove(id) {
            self.finish_request(&request, Finish::Cancelled(why.to_string()));
            return;
        }
        if self.leasing.iter().any(|l| l.request.id == id) {
            self.cancelled_leasing.insert(id);
            return;
        }
        let seq_id = self
            .running
            .values()
            .find(|s| s.request.id == id)
            .map(|s| s.seq_id);
        if let Some(seq_id) = seq_id {
            self.end_sequence(seq_id, Finish::Cancelled(why.to_string()));
        }
    }

    /// Starts planning a step: resets the token budgets.
    pub fn begin_step(&mut self) {
        self.batch_open = self.running.is_empty() && self.leasing.is_empty();
        self.exhausted_this_step = false;
        for (budget, group) in self.budget.iter_mut().zip(&self.groups) {
            *budget = self
                .config
                .max_tokens_per_step
                .min(group.max_batch_tokens)
                .max(1);
        }
        for seq in self.running.values_mut() {
            seq.planned = None;
        }
    }

    /// Plans the running sequences' work for this step (decode first, then
    /// prefill chunks) and returns the extends decode needs.
    pub fn plan_extends(&mut self) -> Vec<ExtendSpec> {
        let mut extends = Vec::new();
        let draft_k = self.config.draft_k;
        for seq in self.running.values_mut() {
            if !seq.decoding() || seq.in_flight.is_some() || seq.planned.is_some() {
                continue;
            }
            let budget = &mut self.budget[seq.group];
            if *budget == 0 {
                continue;
            }
            let remaining = seq.request.remaining();
            let room = (*budget - 1)
                .min(remaining.saturating_sub(1))
                .min(seq.extra.draft);
            let drafts = if draft_k > 0 && room > 0 {
                spec::draft(&seq.context[..=seq.kv_len as usize], room as usize)
            } else {
                Vec::new()
            };
            *budget -= 1 + drafts.len() as u32;
            let from = seq.cache_len as usize;
            let to = seq.kv_len as usize + 1;
            extends.push(ExtendSpec {
                seq_id: seq.seq_id,
                new_tokens: seq.context[from.min(to)..to].to_vec(),
            });
            seq.planned = Some(Work::Decode { drafts });
        }
        let chunk_limit = self.config.prefill_chunk.max(1);
        for seq in self.running.values_mut() {
            if seq.decoding() || seq.in_flight.is_some() || seq.planned.is_some() {
                continue;
            }
            let budget = &mut self.budget[seq.group];
            let len = chunk_limit.min(seq.lease_len - seq.kv_len).min(*budget);
            if len > 0 {
                *budget -= len;
                seq.planned = Some(Work::Prefill { len });
            }
        }
        extends
    }

    /// The Extend RPC failed as a whole (cache unreachable): decode sequences
    /// sit this step out and try again next step.
    pub fn extends_failed(&mut self) {
        for seq in self.running.values_mut() {
            if matches!(seq.planned, Some(Work::Decode { .. })) {
                seq.planned = None;
            }
        }
    }

    /// Applies the Extend outcomes: grants update tables; a refused sequence
    /// is dropped from the step and preempted or finished `REJECTED`.
    pub fn apply_extends(&mut self, outcomes: Vec<Outcome>) {
        for outcome in outcomes {
            match outcome {
                Outcome::Grant(grant) => {
                    if let Some(seq) = self.running.get_mut(&grant.seq_id) {
                        crate::domain::apply_extend(&mut seq.tables, &grant.tables);
                        seq.cache_len = seq.kv_len + 1;
                    }
                }
                Outcome::Reject(reject) => self.extend_refused(reject),
            }
        }
        // a planned decode that got no outcome at all must not run
        for seq in self.running.values_mut() {
            if matches!(seq.planned, Some(Work::Decode { .. })) && seq.cache_len < seq.kv_len + 1 {
                seq.planned = None;
            }
        }
    }

    fn extend_refused(&mut self, reject: Reject) {
        let seq_id = reject.seq_id;
        let Some(seq) = self.running.get(&seq_id) else {
            return;
        };
        let transient = matches!(
            reject.reason,
            RejectReason::PoolExhausted | RejectReason::QuotaExceeded
        );
        self.exhausted_this_step |= transient;
        let preempt = transient
            && self.config.policy == Policy::MaxUtilization
            && self.config.on_exhausted == OnExhausted::Preempt
            && seq.request.preemptions < self.config.max_preemptions;
        if preempt {
            if let Some(seq) = self.running.remove(&seq_id) {
                tracing::debug!(seq_id, request = seq.request.id, "preempting for recompute");
                self.releases.push(seq_id);
                let mut request = seq.request;
                request.preemptions += 1;
                self.counters.preemptions += 1;
                self.queue.requeue(request);
            }
        } else {
            if self.config.policy != Policy::MaxUtilization {
                tracing::error!(seq_id, reason = %reject.reason, "extend refused under a reserving policy");
            }
            self.end_sequence(seq_id, Finish::Rejected(reject));
        }
    }

    /// Admits requests from the head of the queue while the policy lets them
    /// in, and returns the leases to take.
    pub fn plan_admission(&mut self) -> Vec<LeaseSpec> {
        let policy = self.config.policy;
        let mut leases = Vec::new();
        if self.exhausted_this_step {
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
        loop {
            if self.running() >= self.config.max_seqs as usize {
                break;
            }
            let Some(head) = self.queue.front() else {
                break;
            };
            let extra = self.extra_for(head);
            let demand = Demand {
                next_tokens: head.lease_tokens(extra),
                life_tokens: head.full_life_tokens(extra),
            };
            let mut chosen: Option<(usize, u32)> = None;
            let mut never = 0;
            let now = Instant::now();
            for (g, group) in self.groups.iter().enumerate() {
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
                        let committed: u32 = loads[g].iter().map(|l| l.committed).sum();
                        if chosen.is_none_or(|(_, c)| committed < c) {
                            chosen = Some((g, committed));
                        }
                    }
                    Admission::Never { .. } => never += 1,
                    Admission::Wait => {}
                }
            }
            let Some((g, _)) = chosen else {
                if never == self.groups.len() {
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
            self.next_seq += 1;
            let context = request.context();
            let lease_len = u32::try_from(context.len()).unwrap_or(u32::MAX);
            leases.push(LeaseSpec {
                seq_id,
                request: request.id,
                pool_group: group.name.clone(),
                prompt_tokens: context,
                extra,
                max_new_tokens: request.remaining(),
                priority: request.priority,
                cache_salt: request.cache_salt.clone(),
                reserve_full_life: policy.reserves_full_life(),
            });
            // the first prefill chunk is taken from this step's budget
            let first = self
                .config
                .prefill_chunk
                .max(1)
                .min(lease_len)
                .min(self.budget[g].saturating_sub(reserve[g]));
            self.budget[g] -= first;
            self.leasing.push(Leasing {
                seq_id,
                request,
                group: g,
                extra,
                lease_len,
                first_chunk: first,
            });
        }
        leases
    }

    /// The pools of group `g` with what running sequences are charged.
    fn loads(&self, g: usize) -> Vec<PoolLoad> {
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

    /// The Lease RPC failed as a whole: the requests go back to the queue.
    pub fn leases_failed(&mut self) {
        for l in std::mem::take(&mut self.leasing) {
            if self.cancelled_leasing.remove(&l.request.id) {
                self.finish_request(&l.request, Finish::Cancelled("client went away".into()));
            } else {
                self.queue.requeue(l.request);
            }
        }
    }

    /// Applies the Lease outcomes: granted sequences start prefilling this
    /// step; transient refusals wait at the head of the queue; a refusal
    /// that can never succeed finishes the request `REJECTED` at once.
    pub fn apply_leases(&mut self, outcomes: Vec<Outcome>) {
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
                    if self.cancelled_leasing.remove(&l.request.id) {
                        self.releases.push(l.seq_id);
                        self.finish_request(
                            &l.request,
                            Finish::Cancelled("client went away".into()),
                        );
                        continue;
                    }
                    let reused = grant.reused_tokens.min(l.lease_len.saturating_sub(1));
                    let len = l.first_chunk.min(l.lease_len - reused);
                    let context = l.request.context();
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
                            reused_tokens: reused,
                            planned: (len > 0).then_some(Work::Prefill { len }),
                            in_flight: None,
                            request: l.request,
                        },
                    );
                }
                Outcome::Reject(reject) => {
                    let Some(l) = leasing.remove(&reject.seq_id) else {
                        continue;
                    };
                    if self.cancelled_leasing.remove(&l.request.id) {
                        self.finish_request(
                            &l.request,
                            Finish::Cancelled("client went away".into()),
                        );
                        continue;
                    }
                    let wait = match reject.reason {
                        RejectReason::PoolExhausted | RejectReason::RolledBack => true,
                        // a quota frees up only when something of ours ends
                        RejectReason::QuotaExceeded => have_running,
                        _ => false,
                    };
                    if wait {
                        tracing::debug!(seq_id = reject.seq_id, reason = %reject.reason,
                            blocks_needed = reject.blocks_needed, blocks_free = reject.blocks_free,
                            blocks_pending_free = reject.blocks_pending_free, "lease refused, waiting");
                        self.queue.requeue(l.request);
                    } else {
                        self.finish_request(&l.request, Finish::Rejected(reject));
                    }
                }
            }
        }
        // leases with no outcome: nothing was taken, try again later
        for (_, l) in leasing {
            self.queue.requeue(l.request);
        }
    }

    /// The forward batches of this step, per group index. Planned sequences
    /// become in flight.
    pub fn plan_forward(&mut self) -> Vec<(usize, Vec<ForwardItem>)> {
        let mut batches: Vec<Vec<ForwardItem>> = vec![Vec::new(); self.groups.len()];
        for seq in self.running.values_mut() {
            let Some(work) = seq.planned.take() else {
                continue;
            };
            let start = seq.kv_len as usize;
            let (tokens, all_argmax) = match &work {
                Work::Prefill { len } => {
                    (seq.context[start..start + *len as usize].to_vec(), false)
                }
                Work::Decode { drafts } => {
                    let mut t = Vec::with_capacity(1 + drafts.len());
                    t.push(seq.context[start]);
                    t.extend_from_slice(drafts);
                    (t, !drafts.is_empty())
                }
            };
            batches[seq.group].push(ForwardItem {
                seq_id: seq.seq_id,
                tokens,
                start_pos: seq.kv_len,
                tables: seq.tables.clone(),
                return_all_argmax: all_argmax,
                sampling: seq.request.sampling,
            });
            seq.in_flight = Some(work);
        }
        batches
            .into_iter()
            .enumerate()
            .filter(|(_, b)| !b.is_empty())
            .collect()
    }

    /// Applies one group's forward results: prefill progress, new tokens,
    /// finished requests. An in-flight sequence without a result fails.
    pub fn apply_forward(&mut self, group: usize, results: Vec<ForwardResult>) {
        for result in results {
            let Some(seq) = self.running.get_mut(&result.seq_id) else {
                continue;
            };
            let Some(work) = seq.in_flight.take() else {
                continue;
            };
            let emit = match work {
                Work::Prefill { len } => {
                    seq.kv_len += len;
                    if seq.kv_len < seq.lease_len {
                        continue;
                    }
                    vec![result.next_token]
                }
                Work::Decode { drafts } => {
                    if drafts.is_empty() {
                        seq.kv_len += 1;
                        vec![result.next_token]
                    } else {
                        match spec::verify(&drafts, &result.argmax) {
                            Some((accepted, emit)) => {
                                seq.kv_len += 1 + accepted as u32;
                                emit
                            }
                            None => {
                                let id = seq.seq_id;
                                self.end_sequence(
                                    id,
                                    Finish::Error("worker returned too few argmax tokens".into()),
                                );
                                continue;
                            }
                        }
                    }
                }
            };
            self.emit(result.seq_id, emit);
        }
        let missing: Vec<SeqId> = self
            .running
            .values()
            .filter(|s| s.group == group && s.in_flight.is_some())
            .map(|s| s.seq_id)
            .collect();
        for seq_id in missing {
            self.end_sequence(
                seq_id,
                Finish::Error("worker returned no result for the sequence".into()),
            );
        }
    }

    /// One group's forward pass failed: the group takes no new requests for
    /// [`WORKER_RETRY_AFTER`], and its in-flight requests are requeued for
    /// recompute on whichever replica admits them next (their tokens so far
    /// kept, their blocks released), like a preemption; a request already
    /// requeued `max_preemptions` times ends `ERROR`, naming the group.
    pub fn forward_failed(&mut self, group: usize, message: &str) {
        if let Some(slot) = self.down_until.get_mut(group) {
            *slot = Some(Instant::now() + WORKER_RETRY_AFTER);
        }
        let message = match self.groups.get(group) {
            Some(g) => format!("worker of group {} failed: {message}", g.name),
            None => message.to_owned(),
        };
        let message = message.as_str();
        let failed: Vec<SeqId> = self
            .running
            .values()
            .filter(|s| s.group == group && s.in_flight.is_some())
            .map(|s| s.seq_id)
            .collect();
        for seq_id in failed {
            let retry = self
                .running
                .get(&seq_id)
                .is_some_and(|s| s.request.preemptions < self.config.max_preemptions);
            match self.running.remove(&seq_id) {
                Some(seq) if retry => {
                    tracing::warn!(seq_id, request = seq.request.id, %message, "requeued for recompute after a worker failure");
                    self.releases.push(seq_id);
                    let mut request = seq.request;
                    request.preemptions += 1;
                    self.counters.preemptions += 1;
                    self.queue.requeue(request);
                }
                Some(seq) => {
                    self.releases.push(seq_id);
                    self.finish_request(
                        &seq.request,
                        Finish::Error(format!("forward failed: {message}")),
                    );
                }
                None => {}
            }
        }
    }

    fn emit(&mut self, seq_id: SeqId, tokens: Vec<u32>) {
        let Some(seq) = self.running.get_mut(&seq_id) else {
            return;
        };
        let mut out = Vec::with_capacity(tokens.len());
        let mut finish = None;
        for t in tokens {
            out.push(t);
            seq.context.push(t);
            seq.request.generated.push(t);
            if seq.request.stop_tokens.contains(&t) {
                finish = Some(Finish::Stop);
                break;
            }
            if seq.request.remaining() == 0 {
                finish = Some(Finish::Length);
                break;
            }
        }
        let reused_tokens = if seq.request.reported_reuse {
            None
        } else {
            seq.request.reported_reuse = true;
            Some(seq.reused_tokens)
        };
        self.outputs.push(Output::Tokens {
            request: seq.request.id,
            tokens: out,
            reused_tokens,
        });
        if let Some(finish) = finish {
            self.end_sequence(seq_id, finish);
        }
    }

    fn end_sequence(&mut self, seq_id: SeqId, finish: Finish) {
        if let Some(seq) = self.running.remove(&seq_id) {
            self.releases.push(seq_id);
            self.finish_request(&seq.request, finish);
        }
    }

    fn finish_request(&mut self, request: &Request, finish: Finish) {
        match &finish {
            Finish::Length => self.counters.finished_length += 1,
            Finish::Stop => self.counters.finished_stop += 1,
            Finish::Cancelled(_) => self.counters.cancelled += 1,
            Finish::Rejected(_) => self.counters.rejected += 1,
            Finish::Error(_) => self.counters.errors += 1,
        }
        self.outputs.push(Output::Finished {
            request: request.id,
            finish,
            preemptions: request.preemptions,
        });
    }

    /// Sequences to release now (the caller fences them at the last step
    /// whose forward pass could read them).
    pub fn take_releases(&mut self) -> Vec<SeqId> {
        std::mem::take(&mut self.releases)
    }

    /// Puts back releases whose RPC failed, to try again.
    pub fn restore_releases(&mut self, seq_ids: Vec<SeqId>) {
        self.releases.extend(seq_ids);
    }

    /// Whether any release is waiting to be sent.
    pub fn has_releases(&self) -> bool {
        !self.releases.is_empty()
    }

    /// Outputs for the request streams since the last call.
    pub fn drain_outputs(&mut self) -> Vec<Output> {
        std::mem::take(&mut self.outputs)
    }

    /// The cache lost every lease (restart, expired session): running
    /// requests are requeued for recompute (their tokens so far are kept), or
    /// finished `REJECTED` when `recompute` is false. Pending releases are
    /// dropped: the old session's blocks went with it.
    pub fn leases_lost(&mut self, recompute: bool) {
        self.releases.clear();
        self.leases_failed();
        for (_, seq) in std::mem::take(&mut self.running) {
            if recompute {
                self.queue.requeue(seq.request);
            } else {
                let reject = Reject {
                    seq_id: seq.seq_id,
                    reason: RejectReason::UnknownSequence,
                    pool_id: 0,
                    window: 0,
                    blocks_needed: 0,
                    blocks_free: 0,
                    blocks_pending_free: 0,
                    message: "the cache service restarted and lost the lease".into(),
                };
                self.finish_request(&seq.request, Finish::Rejected(reject));
            }
        }
    }

    /// Finishes every request (shutdown); running ones are released.
    pub fn cancel_all(&mut self, why: &str) {
        self.leases_failed();
        let queued: Vec<Request> = self.queue.drain().collect();
        for r in queued {
            self.finish_request(&r, Finish::Cancelled(why.to_string()));
        }
        let ids: Vec<SeqId> = self.running.keys().copied().collect();
        for seq_id in ids {
            self.end_sequence(seq_id, Finish::Cancelled(why.to_string()));
        }
    }

    /// Replaces a group's geometry (pools re-registered after a restart).
    pub fn set_groups(&mut self, groups: Vec<GroupGeometry>) {
        self.budget = vec![0; groups.len()];
        self.down_until = vec![None; groups.len()];
        self.groups = groups;
    }
}

#[cfg(test)]
mod tests;
