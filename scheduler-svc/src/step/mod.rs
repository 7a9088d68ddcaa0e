//! The scheduler core: the step loop's decisions, in plain synchronous code.
//! Which sequences run each step and how, what to lease, extend and
//! release, what each lease outcome and forward result means for the
//! requests, the order of a step's calls ([`StepPlan`]), and the founding
//! rule of the protocol: blocks a forward pass could read never reach
//! another sequence before that pass returned. The async loop in
//! `step_loop/` only does the I/O around these calls:
//!
//! ```text
//! begin_step -> plan_extends -> [Extend] -> apply_extends
//!            -> plan_admission -> [Lease] -> apply_leases
//!            -> plan_forward -> [Forward] -> apply_forward (per group)
//!            -> take_releases -> [Release fenced at batch.fence_step] -> releases_sent
//!               (a failed pass's sequences first, alone, with discard_unwritten;
//!               at most the cache's batch limit a batch; a call that failed:
//!               release_failed, which keeps the batch to send again)
//!            -> complete_through -> [CompleteStep] -> step_completed
//! ```
//!
//! With overlap on, the loop takes step N+1's releases and leases while step
//! N's forward pass is in flight; `take_releases` then fences them at N, and
//! `complete_through` never names a step whose forward has not returned.
//! Which of these calls come in which order, with overlap on and off, is
//! `plan`'s [`StepPlan`]: the loop and the model-checked test driver both
//! execute it.
//!
//! A sequence is one lease of a request. Its KV bookkeeping: `kv_len`
//! positions hold KV; the cache has accounted `cache_len` slots (plus the
//! lease's extra slots). In decode, the token fed next is `context[kv_len]`
//! and each step first extends the lease by `kv_len + 1 - cache_len` tokens
//! (accepted drafts whose KV is already written, plus the fed token).
//!
//! # Layout
//! This module holds the state ([`Core`]) and its small accessors; each
//! submodule adds the `impl Core` of one concern:
//! - `fence`: step numbering, the fence of each release, when a step may be
//!   reported complete (the founding rule).
//! - `admission`: submitting requests, planning the step's leases (the group
//!   by the routing cost), applying the Lease outcomes.
//! - `routing`: what to ask the cache's `Match` for (the queue head) and the
//!   per-group reuse it answered, which admission's routing cost reads.
//! - `outcomes`: planning the running sequences' extends and forward batches,
//!   applying the Extend outcomes and the forward results.
//! - `tiers`: the host-tier copies grants name, carried to the workers in
//!   the group's next forward pass, and the steps they hold from completing.
//! - `plan`: the call order of a step ([`StepPlan`], [`Call`], [`Order`]).
//! - `beams`: beam search on forks (which beams continue in place, fork,
//!   end or are pruned; the answer), with `crate::beam`'s choices.
//! - `handoff`: disaggregated serving, a prefill group's sequence leased
//!   in a decode group once its prompt is in the KV, the KV pulled.
//! - `lifecycle`: cancellation, preemption and requeue, finishing requests,
//!   lost leases, and the outputs that tell the loop about each of them.

mod admission;
mod beams;
mod fence;
mod handoff;
mod lifecycle;
mod outcomes;
mod plan;
mod rates;
mod routing;

pub use rates::PinnedRates;
mod tiers;

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::time::{Duration, Instant};

use crate::domain::{Extra, GroupGeometry, Output, RequestId, SeqId, Step, Table};
use crate::policy::{Demand, OnExhausted, Policy};
use crate::queue::{Queue, Request};

pub use fence::{CallFailure, ReleaseBatch};
pub use plan::{Call, DEFAULT_PIPELINE_DEPTH, MAX_PIPELINE_DEPTH, Order, StepPlan};
pub use routing::{MATCH_BATCH, MatchWanted};

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
    /// Longest a request may wait in the queue before it ends `REJECTED`
    /// with `QUEUE_TIMEOUT` (None: forever).
    pub max_queue_wait: Option<Duration>,
    /// How admission picks among the groups that could admit a request.
    pub routing: crate::routing::RoutingConfig,
    /// Token slots every lease keeps past the sequence's length
    /// (`extra_decoding_steps`), so that a decode step has room in the
    /// blocks already granted: with [`Order::Overlap`], a decode launches
    /// before its extend is answered and the extend, sent after the launch,
    /// grows the lease a step ahead of need ([`Order::lookahead`]: 1; the
    /// depth for [`Order::Pipelined`], whose decodes run that many passes
    /// ahead of the cache's answer).
    pub lookahead: u32,
    /// The order of a step's calls ([`StepPlan`]); with `Pipelined`, a
    /// sequence may have up to its depth of passes in flight and is planned
    /// from where they leave it.
    pub order: Order,
    /// Peer pull's rates, sent with every admission lease (`None`: off):
    /// where to start, each replaced by its measured value unless pinned.
    pub peer_pull: Option<crate::domain::PeerRates>,
    /// Which of `peer_pull`'s rates stay as configured (given on the
    /// command line) instead of following what is measured.
    pub peer_pinned: PinnedRates,
    /// Worker addresses of peer groups that are not ours (another
    /// scheduler's, sharing the cache), by group name: a grant's copies
    /// from one of them are pulled from there.
    pub peer_workers: Vec<(String, String)>,
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
            max_queue_wait: None,
            routing: crate::routing::RoutingConfig::default(),
            lookahead: 0,
            order: Order::Plain,
            peer_pull: None,
            peer_pinned: PinnedRates::default(),
            peer_workers: Vec::new(),
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
    /// `preemptions` by cause, indexed by [`PreemptCause::index`].
    pub preemptions_by: [u64; PreemptCause::ALL.len()],
}

impl Counters {
    /// Preemptions for `cause` so far.
    pub fn preempted_by(&self, cause: PreemptCause) -> u64 {
        self.preemptions_by[cause.index()]
    }
}

/// Why a running request was preempted (released and requeued for recompute).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PreemptCause {
    /// Its Extend was refused: the pool had no block to give.
    PoolExhausted,
    /// Its Extend was refused: the tenant's quota was used up.
    QuotaExceeded,
    /// The worker of its group failed the forward pass.
    WorkerFailed,
    /// Its Extend was refused `LENGTH_MISMATCH`: the cache applied a growth
    /// whose answer never arrived.
    LengthMismatch,
}

impl PreemptCause {
    /// Every cause, in [`index`](Self::index) order.
    pub const ALL: [Self; 4] = [
        Self::PoolExhausted,
        Self::QuotaExceeded,
        Self::WorkerFailed,
        Self::LengthMismatch,
    ];

    /// The cause as a metric label and log field: reject reasons keep their protocol name.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::PoolExhausted => "POOL_EXHAUSTED",
            Self::QuotaExceeded => "QUOTA_EXCEEDED",
            Self::WorkerFailed => "WORKER_FAILED",
            Self::LengthMismatch => "LENGTH_MISMATCH",
        }
    }

    /// Position in [`ALL`](Self::ALL) and in [`Counters::preemptions_by`].
    pub fn index(self) -> usize {
        self as usize
    }
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
    /// Tokens the cache knows the sequence holds (sent in extends).
    cache_len: u32,
    /// The length the sequence's last extend report asked for (the cache's
    /// length once it is granted).
    reporting: u32,
    /// Token slots the lease covers, as its last grant said (the cache's
    /// `capacity_tokens`: tokens plus extra slots).
    capacity: u32,
    reused_tokens: u32,
    /// Partial-block copies for the first forward pass, which runs in the
    /// lease's step (the cache pins the sources only until it completes).
    copies: Vec<crate::domain::BlockCopy>,
    /// The peer pull of the first forward pass, likewise.
    peer: Option<crate::domain::PeerPull>,
    /// Its first pass pulls from a peer and has not returned: nothing more
    /// is planned behind it (a pass after a failed pull would fail whole).
    pulling: bool,
    /// Planned this step, not yet sent to the worker.
    planned: Option<Work>,
    /// Sent to the worker, results not yet applied, oldest first, with the
    /// step of the pass: one at most, the depth with [`Order::Pipelined`].
    in_flight: VecDeque<(Step, Work)>,
    /// Whether a pass carried its history to the worker (penalised
    /// sequences only; see `ForwardItem::history`).
    history_sent: bool,
    /// A forked sample holding its parent's blocks before its last prompt
    /// token by reference (charged to the parent).
    shares_parent: bool,
    /// A beam's row (the most likely next tokens) waiting for its
    /// search's step (see `beams`).
    beam_row: Option<Vec<(u32, f32)>>,
    /// A sequence of a prefill group that decodes elsewhere: once its
    /// prompt is in the KV it is handed off (see `handoff`), never
    /// decoded here.
    handoff: Option<handoff::HandoffState>,
}

/// What the passes in flight will have done to a sequence once they return.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Ahead {
    /// Positions that will hold KV (`kv_len` plus the passes' tokens).
    kv_len: u32,
    /// Tokens the passes will emit (a decode's, a last prefill chunk's).
    emits: u32,
}

impl Sequence {
    fn decoding(&self) -> bool {
        self.kv_len >= self.lease_len
    }

    /// Where the sequence will be once its passes in flight returned (a
    /// pipelined plan starts there). Drafts never run pipelined, so a
    /// decode in flight advances one position.
    fn ahead(&self) -> Ahead {
        let mut ahead = Ahead {
            kv_len: self.kv_len,
            emits: 0,
        };
        for (_, work) in &self.in_flight {
            match work {
                Work::Prefill { len } => {
                    ahead.kv_len += len;
                    ahead.emits += u32::from(ahead.kv_len >= self.lease_len);
                }
                Work::Decode { drafts } => {
                    ahead.kv_len += 1 + drafts.len() as u32;
                    ahead.emits += 1;
                }
            }
        }
        ahead
    }

    fn demand(&self) -> Demand {
        let next = if self.decoding() {
            self.kv_len.saturating_add(2)
        } else {
            self.lease_len
        };
        let mut d = Demand {
            next_tokens: next.saturating_add(self.extra.total()),
            ..self.request.demand(self.extra)
        };
        if self.shares_parent {
            // its prompt but the last token is the parent's
            d.shared_tokens = self.lease_len.saturating_sub(1);
            d.shared_elsewhere = true;
        }
        d
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
    /// A branch forked from this running sequence.
    fork_of: Option<SeqId>,
    /// The hand-off of this running prefill sequence (see `handoff`).
    handoff_of: Option<SeqId>,
}

/// A branch of a request of several samples waiting for its lease: forked
/// from `parent` (branch 0, whose prompt is prefilled) in `group`.
#[derive(Debug)]
struct Fork {
    parent: SeqId,
    group: usize,
    request: Request,
}

/// A running sequence the core released and requeued for recompute, for the
/// loop to record in its request's trace.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Preemption {
    pub request: RequestId,
    pub seq_id: SeqId,
    /// What refused the sequence ([`PreemptCause::as_str`], e.g. `"POOL_EXHAUSTED"`).
    pub cause: &'static str,
    /// Tokens the request will compute again (prompt plus generated).
    pub tokens_to_recompute: u32,
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
    /// Branches waiting for a lease forked from their parent (whose
    /// release waits until then, see `take_releases`).
    forks: Vec<Fork>,
    /// Branches of a request of several samples not finished yet.
    branches_left: HashMap<RequestId, u32>,
    /// Beam searches not answered yet.
    beams: HashMap<RequestId, beams::BeamSearch>,
    /// Ended sequences whose blocks are still held at the cache.
    releases: Vec<SeqId>,
    /// Sequences of a failed forward pass whose blocks are still held at
    /// the cache, released apart with `discard_unwritten`.
    failed_releases: Vec<SeqId>,
    /// Ended sequences with passes still in flight (see
    /// [`Core::release_ended`]): released once those passes returned,
    /// with `discard_unwritten` if one failed.
    draining: Vec<lifecycle::Draining>,
    outputs: Vec<Output>,
    /// Sequences that hold nothing at the cache any more (see
    /// [`Core::take_released`]).
    released: Vec<SeqId>,
    /// Preemptions since the last [`Core::take_preemptions`].
    preemptions: Vec<Preemption>,
    /// The step numbering and what each step's forward pass still holds.
    steps: fence::Steps,
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
    /// Reused tokens per queued request and group, from this step's
    /// `Match` (see [`Core::set_reuse`]); cleared by admission.
    reuse: HashMap<RequestId, Vec<u32>>,
    /// Host-tier copies not run yet, and whether the cache must drop its
    /// pending demotions.
    tiers: tiers::TierCopies,
    /// Most entries the cache takes in one batched list (`usize::MAX`: it
    /// advertised no limit). See [`Core::set_batch_limit`].
    batch_limit: usize,
    /// Why the scheduler has no usable session at the cache now, if it has
    /// none. See [`Core::set_session_missing`].
    session_missing: Option<String>,
    /// Peer pull's link and prefill rates as measured (see
    /// [`Core::peer_rates`]).
    measured: rates::MeasuredRates,
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
            forks: Vec::new(),
            branches_left: HashMap::new(),
            beams: HashMap::new(),
            releases: Vec::new(),
            failed_releases: Vec::new(),
            draining: Vec::new(),
            outputs: Vec::new(),
            released: Vec::new(),
            preemptions: Vec::new(),
            steps: fence::Steps::default(),
            next_seq: SeqId(1),
            budget,
            batch_open: true,
            exhausted_this_step: false,
            down_until,
            counters: Counters::default(),
            reuse: HashMap::new(),
            tiers: tiers::TierCopies::default(),
            batch_limit: usize::MAX,
            session_missing: None,
            measured: rates::MeasuredRates::default(),
        }
    }

    /// The rates a peer-pull decision uses (`None`: peer pull is off): the
    /// configured ones, each replaced by its measured running mean once the
    /// workers' answers gave one (the link rate from what pulls moved, the
    /// prefill rate from passes that were mostly prefill).
    pub fn peer_rates(&self) -> Option<crate::domain::PeerRates> {
        self.config
            .peer_pull
            .map(|c| self.measured.over(c, self.config.peer_pinned))
    }

    /// Why the scheduler has no usable session at the cache (the cache
    /// cannot be reached, or it lost the session and it is not re-opened
    /// yet), or `None` while it has one. The loop sets it before
    /// [`Core::expire_queue`], so that a request that waited out its time
    /// because nothing could be leased says so, rather than blaming a
    /// refusal or the running requests.
    pub fn set_session_missing(&mut self, why: Option<String>) {
        self.session_missing = why;
    }

    /// The cache's batch limit (`OpenSession.max_batch`; `None`: it
    /// advertised none), learned anew with every session: no release batch
    /// the core hands out, and no step's leases, hold more, and the loop
    /// splits the step's extends into calls of at most that many.
    pub fn set_batch_limit(&mut self, limit: Option<usize>) {
        self.batch_limit = limit.unwrap_or(usize::MAX).max(1);
    }

    /// The most entries one batched cache call may carry (`usize::MAX`: no
    /// limit).
    pub fn batch_limit(&self) -> usize {
        self.batch_limit
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

    /// Whether anything is waiting, forking, leasing or running.
    pub fn is_idle(&self) -> bool {
        self.queue.is_empty()
            && self.running.is_empty()
            && self.leasing.is_empty()
            && self.forks.is_empty()
    }

    /// Requests the core holds (queued, forking, leasing or running).
    pub fn live_requests(&self) -> Vec<RequestId> {
        let mut ids: Vec<RequestId> = self.queue.ids().collect();
        ids.extend(self.forks.iter().map(|f| f.request.id));
        ids.extend(self.leasing.iter().map(|l| l.request.id));
        ids.extend(self.running.values().map(|s| s.request.id));
        ids
    }
}

#[cfg(test)]
mod tests;
