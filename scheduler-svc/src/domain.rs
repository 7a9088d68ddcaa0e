//! Domain types shared by the core modules: sequences, block tables, lease
//! outcomes and forward items. No protobuf types here; `client.rs` converts.

use std::fmt;

/// A `u64` number of the protocol (or of the scheduler alone), typed so that
/// one kind cannot pass for another (a session id for an epoch, a step for
/// a sequence, a sequence for a request).
macro_rules! protocol_number {
    ($(#[$doc:meta])* $name:ident) => {
        $(#[$doc])*
        #[derive(Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
        pub struct $name(pub u64);

        impl $name {
            /// The number as the protocol carries it.
            pub fn get(self) -> u64 {
                self.0
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                self.0.fmt(f)
            }
        }
    };
}

protocol_number!(
    /// A step of the scheduler's session: fences and `CompleteStep` key on
    /// it. Step 0 is before the first; each step planned takes the next.
    Step
);

protocol_number!(
    /// The cache's id of this scheduler's session (a secret bound to it).
    SessionId
);

protocol_number!(
    /// The cache service's epoch: a restarted cache has a new one, and calls
    /// carrying the old one fail.
    Epoch
);

protocol_number!(
    /// The scheduler's id of one lease attempt of a request (unique within
    /// the session; a preempted request is leased again under a new id).
    SeqId
);

protocol_number!(
    /// The scheduler's id of one client request (stable across
    /// preemptions; also its arrival order). Never sent to the cache.
    RequestId
);

impl Step {
    /// The step after this one.
    pub fn next(self) -> Self {
        Self(self.0 + 1)
    }
}

impl SeqId {
    /// The id after this one.
    pub fn next(self) -> Self {
        Self(self.0 + 1)
    }
}

/// How a `Lease` call takes its sequences.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LeaseMode {
    /// The step loop's admissions: each sequence granted or refused on its
    /// own, reusing and publishing cached prefixes.
    Admit,
    /// Warm-up: all or nothing (a refusal rolls back the call's grants),
    /// neither reading nor feeding the cache's prefixes, and left out of its
    /// hit-rate figures.
    Warmup,
}

/// The parts of one `Step` call to the cache (each optional), which it
/// applies in this order: release, complete, extend.
#[derive(Debug, Clone, Copy, Default)]
pub struct StepCall<'a> {
    pub release: Option<StepRelease<'a>>,
    pub complete_step: Option<Step>,
    pub extend: Option<StepExtend<'a>>,
}

/// Sequences to release, fenced at `fence_step` when given, with their
/// requests' `traceparent`s.
#[derive(Debug, Clone, Copy)]
pub struct StepRelease<'a> {
    pub seq_ids: &'a [SeqId],
    pub fence_step: Option<Step>,
    /// See `ReleaseRequest.discard_unwritten`.
    pub discard_unwritten: bool,
    pub traces: &'a [String],
}

/// The extends of `step`, with their requests' `traceparent`s.
#[derive(Debug, Clone, Copy)]
pub struct StepExtend<'a> {
    pub step: Step,
    pub specs: &'a [ExtendSpec],
    pub traces: &'a [String],
}

/// One pool of a worker group as registered with the cache.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolGeometry {
    /// Cache-assigned pool id.
    pub pool_id: u32,
    /// Attention window in tokens; 0 is full attention.
    pub window: u32,
    /// Blocks in the pool.
    pub num_blocks: u32,
    /// Blocks of the pool's host-memory tier in the worker (0: none; a
    /// disk tier needs one).
    pub host_blocks: u32,
}

/// A worker (model replica) and its pools: one pool group of the cache.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GroupGeometry {
    /// The cache pool group name.
    pub name: String,
    /// Tokens per block, shared by every pool of the group.
    pub tokens_per_block: u32,
    /// The group's pools, one per distinct window.
    pub pools: Vec<PoolGeometry>,
    /// Largest prompt + output the group serves, in tokens.
    pub max_context: u32,
    /// Vocabulary size of the model.
    pub vocab_size: u32,
    /// Worker limits on one forward batch.
    pub max_batch_sequences: u32,
    /// Worker limit on tokens in one forward batch.
    pub max_batch_tokens: u32,
    /// What peer pull needs of the group.
    pub peer: PeerProfile,
    /// Which part of a request the group serves (disaggregated serving).
    pub role: Role,
}

/// Which part of a request a worker group serves. A request is admitted
/// to a `Prefill` or `Both` group; one whose prompt a `Prefill` group
/// computed is handed off to a `Decode` or `Both` group, whose worker
/// pulls the prompt's KV and decodes. `Both` (the default) serves a
/// request whole, as without roles.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub enum Role {
    Prefill,
    Decode,
    #[default]
    Both,
}

impl Role {
    /// The role's name, as in `URL#role=NAME` and `GetStatus`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Prefill => "prefill",
            Self::Decode => "decode",
            Self::Both => "both",
        }
    }

    /// Whether new requests (and recomputed ones) may be admitted here.
    pub fn prefills(self) -> bool {
        self != Self::Decode
    }

    /// Whether handed-off requests may decode here.
    pub fn decodes(self) -> bool {
        self != Self::Prefill
    }
}

impl std::str::FromStr for Role {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "prefill" => Ok(Self::Prefill),
            "decode" => Ok(Self::Decode),
            "both" => Ok(Self::Both),
            other => Err(format!(
                "role must be prefill, decode or both, got {:?}",
                kvlease_runtime::echo::clip(other, 32)
            )),
        }
    }
}

/// Peer pull (cache.proto `RegisterPoolRequest.peer_key`,
/// `PoolSpec.bytes_per_block`): what a group's blocks depend on beyond its
/// geometry, its blocks' sizes, and where its peers' workers pull from.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PeerProfile {
    /// The model, tokenizer fingerprint and KV element type (empty: the
    /// group takes no part in peer pulls).
    pub key: String,
    /// Bytes of one block of each pool, in the order of the group's pools.
    pub block_bytes: Vec<u64>,
    /// The address of the group's worker.
    pub address: String,
}

/// The rates a lease's peer-pull decision uses (cache.proto
/// `PeerPullRates`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PeerRates {
    pub link_bytes_per_s: u64,
    pub prefill_tokens_per_s: u64,
    pub overhead_us: u64,
}

/// One block a grant pulls from a peer group's device (cache.proto
/// `PeerCopy`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerCopy {
    pub window: u32,
    pub dst_block: u32,
    pub src_group: String,
    pub src_block: u32,
    pub transfer_id: u64,
    /// Leading slots copied (0: the whole block).
    pub tokens: u32,
}

/// What a sequence's worker pulls before its pass (worker.proto
/// `PeerPull`): from the worker at `address`, `(window, src_block,
/// dst_block, tokens)` per block (`tokens` 0: the whole block).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerPull {
    pub address: String,
    pub transfer_id: u64,
    pub blocks: Vec<(u32, u32, u32, u32)>,
}

impl GroupGeometry {
    /// Blocks that `tokens` token slots occupy at most in a pool of `window`.
    pub fn blocks_for(&self, tokens: u32, window: u32) -> u32 {
        blocks_for(tokens, window, self.tokens_per_block)
    }
}

/// Blocks that `tokens` token slots occupy at most in a pool of `window`
/// (0 = full attention) with `tokens_per_block` tokens per block. A window
/// pool never holds more than `ceil(window / tpb) + 1` blocks.
pub fn blocks_for(tokens: u32, window: u32, tokens_per_block: u32) -> u32 {
    let tpb = tokens_per_block.max(1);
    let full = tokens.div_ceil(tpb);
    if window == 0 {
        full
    } else {
        full.min(window.div_ceil(tpb) + 1)
    }
}

/// KV slots a sequence keeps beyond its tokens.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Extra {
    /// Speculative draft tokens verified per step.
    pub draft: u32,
    /// Extra KV tokens.
    pub extra_kv: u32,
    /// Extra decoding steps.
    pub extra_decoding_steps: u32,
}

impl Extra {
    /// All extra slots together.
    pub fn total(&self) -> u32 {
        self.draft + self.extra_kv + self.extra_decoding_steps
    }
}

/// The blocks of one sequence (beam 0) in one pool.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Table {
    pub pool_id: u32,
    pub window: u32,
    /// Index of `block_ids[0]` in the sequence (non-zero once blocks slid out).
    pub first_block: u32,
    pub block_ids: Vec<u32>,
}

impl Table {
    /// Applies an `Extend` grant's delta for this pool: the blocks before the
    /// delta's `first_block` slid out; its `block_ids` were appended.
    pub fn apply_delta(&mut self, delta: &Table) {
        kvlease_proto::delta::apply_table_delta(
            &mut self.first_block,
            &mut self.block_ids,
            delta.first_block,
            &delta.block_ids,
        );
    }
}

/// Applies the deltas of an `Extend` grant to a sequence's tables (matched by
/// pool id).
pub fn apply_extend(tables: &mut [Table], deltas: &[Table]) {
    for delta in deltas {
        if let Some(t) = tables.iter_mut().find(|t| t.pool_id == delta.pool_id) {
            t.apply_delta(delta);
        }
    }
}

/// Why the cache refused a sequence.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RejectReason {
    PoolExhausted,
    ExceedsCapacity,
    RolledBack,
    UnknownSequence,
    DuplicateSequence,
    QuotaExceeded,
    /// An extend grew the sequence from a length the cache does not have
    /// for it: the answer to an earlier growth the cache applied was lost.
    LengthMismatch,
    /// The scheduler's own reason: the cache service restarted and lost the
    /// lease of a live sequence, which is not recomputed (reject mode).
    CacheRestarted,
    /// The scheduler's own reason: the request waited in the queue longer
    /// than the maximum wait.
    QueueTimeout,
    /// A reason this scheduler does not know (newer cache service).
    Other,
}

impl RejectReason {
    /// The protocol's name of the reason, e.g. `POOL_EXHAUSTED`.
    pub fn protocol_name(self) -> &'static str {
        match self {
            Self::PoolExhausted => "POOL_EXHAUSTED",
            Self::ExceedsCapacity => "EXCEEDS_CAPACITY",
            Self::RolledBack => "ROLLED_BACK",
            Self::UnknownSequence => "UNKNOWN_SEQUENCE",
            Self::DuplicateSequence => "DUPLICATE_SEQUENCE",
            Self::QuotaExceeded => "QUOTA_EXCEEDED",
            Self::LengthMismatch => "LENGTH_MISMATCH",
            Self::CacheRestarted => "CACHE_RESTARTED",
            Self::QueueTimeout => "QUEUE_TIMEOUT",
            Self::Other => "REJECT_REASON_UNSPECIFIED",
        }
    }
}

impl fmt::Display for RejectReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = match self {
            Self::PoolExhausted => "pool exhausted",
            Self::ExceedsCapacity => "exceeds capacity",
            Self::RolledBack => "rolled back",
            Self::UnknownSequence => "unknown sequence",
            Self::DuplicateSequence => "duplicate sequence",
            Self::QuotaExceeded => "quota exceeded",
            Self::LengthMismatch => "length mismatch",
            Self::CacheRestarted => "cache restarted",
            Self::QueueTimeout => "queue timeout",
            Self::Other => "other",
        };
        f.write_str(s)
    }
}

/// A per-sequence refusal, with the cache's figures.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reject {
    pub seq_id: SeqId,
    pub reason: RejectReason,
    pub pool_id: u32,
    pub window: u32,
    pub blocks_needed: u32,
    pub blocks_free: u32,
    pub blocks_pending_free: u32,
    pub message: String,
}

/// A retention hint, as the cache takes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Retain {
    pub tokens: u32,
    pub priority: u32,
    pub ttl_ms: u32,
    /// Whose quota its blocks count against (the caller's tenant).
    pub tenant: String,
}

/// A per-sequence grant.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Grant {
    pub seq_id: SeqId,
    /// Beam-0 tables, one per pool.
    pub tables: Vec<Table>,
    /// Leading prompt tokens whose KV need not be computed: reused full
    /// blocks, plus the slots of `copies`.
    pub reused_tokens: u32,
    /// Token slots the lease now covers.
    pub capacity_tokens: u32,
    /// Partial-block copies the lease step's forward pass must apply first.
    pub copies: Vec<BlockCopy>,
    /// Host-tier copies the group's next forward pass must apply before
    /// anything else, done before the call's step completes (see
    /// [`TierCopy`]).
    pub tier_copies: Vec<TierCopy>,
    /// Prompt tokens kept under the sequence's retention hint.
    pub retained_tokens: u32,
    /// Blocks to pull from a peer group before the lease step's pass
    /// (counted in `reused_tokens`).
    pub peer_copies: Vec<PeerCopy>,
    /// Sequence blocks the peer copies bring (0: none).
    pub peer_blocks: u32,
}

/// Copy one whole block between two tiers of a pool in the worker
/// (cache.proto `TierCopy`): demotions of blocks the cache evicted (device
/// -> host), spills (host -> disk), onboardings of host-cached prefix
/// blocks and loads of disk-cached ones. The scheduler carries every one a
/// grant names to the group's worker in the forward pass of that step,
/// whatever becomes of the sequence.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TierCopy {
    pub pool_id: u32,
    pub window: u32,
    pub direction: TierDirection,
    pub device_block: u32,
    pub host_block: u32,
    /// The disk block, and the content's hash and parent (spills, loads).
    pub disk_block: u32,
    pub hash: u64,
    pub parent: u64,
}

/// Which way a [`TierCopy`] goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TierDirection {
    /// Device -> host.
    Demote,
    /// Host -> device.
    Onboard,
    /// Host -> disk.
    Spill,
    /// Disk -> device.
    Load,
}

impl TierCopy {
    /// Whether the copy brings a prompt block to the device.
    pub fn onboards(&self) -> bool {
        matches!(self.direction, TierDirection::Onboard | TierDirection::Load)
    }
}

/// What a worker's `Describe` says of its incarnation and disk tiers, for
/// `RegisterPool` (cache.proto `worker_incarnation`, `disk_blocks`,
/// `disk_held`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct WorkerTiers {
    /// Differs on every start of the worker (0: unknown, nothing to say).
    pub incarnation: u64,
    /// Per pool, in the order of the pools: disk blocks and the verified
    /// files found at the worker's start.
    pub disks: Vec<(u32, Vec<DiskFile>)>,
}

/// A verified block file of a worker's disk tier: `(block, hash, parent)`.
pub type DiskFile = (u32, u64, u64);

/// Copy slots `[0, tokens)` of `src_block` into `dst_block` in one pool, in
/// the worker, before a forward pass (partial-block reuse).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct BlockCopy {
    pub pool_id: u32,
    pub window: u32,
    pub src_block: u32,
    pub dst_block: u32,
    pub tokens: u32,
}

/// One per-sequence answer of a Lease or Extend.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    Grant(Grant),
    Reject(Reject),
}

/// One new sequence to lease.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaseSpec {
    pub seq_id: SeqId,
    /// The request the sequence serves (scheduler-side only, not sent).
    pub request: RequestId,
    pub pool_group: String,
    pub prompt_tokens: Vec<u32>,
    pub extra: Extra,
    pub max_new_tokens: u32,
    pub priority: u32,
    pub cache_salt: String,
    pub retain: Option<Retain>,
    pub reserve_full_life: bool,
    /// A branch of this running sequence (see `SequenceSpec.fork_of`): its
    /// blocks before the last prompt token are shared, the block holding
    /// it copied on write.
    pub fork_of: Option<SeqId>,
    /// Prompt tokens the lease's step computes beyond the reused ones (the
    /// first prefill chunk); the cache holds back the blocks of later chunks
    /// until an [`ExtendSpec::written_tokens`] reports them. 0: the whole
    /// prompt.
    pub prefill_tokens: u32,
    /// Reuse (and publish) cached prefix blocks: the prompt's token ids go
    /// to the cache. Off for a request whose prompt's logprobs are asked
    /// (every position must be computed): its lease names only a count.
    pub reuse_prefix: bool,
    /// Peer pull's rates (`None`: no peer pull).
    pub peer_pull: Option<PeerRates>,
    /// Disaggregated serving: this sequence takes over the running
    /// sequence `handoff_of` of a prefill group (`SequenceSpec.handoff_of`):
    /// every prompt position but the last is pulled from it.
    pub handoff_of: Option<SeqId>,
}

/// One sequence to grow.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExtendSpec {
    pub seq_id: SeqId,
    /// Token ids that now occupy the next slots.
    pub new_tokens: Vec<u32>,
    /// The sequence's length at the cache before `new_tokens`, as the core
    /// knows it (its `cache_len`): a growth the cache already applied (its
    /// answer lost) is then refused, not applied twice. 0: not checked.
    pub from_length: u32,
    /// Chunked prefill: the sequence's KV is written through this many
    /// tokens by this step's forward pass (0: no report). With no new tokens
    /// the item only reports progress.
    pub written_tokens: u32,
}

/// Sampling of one sequence (`SamplingParams` in `worker.proto` says how
/// each parameter acts).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Sampling {
    /// 0 is greedy.
    pub temperature: f32,
    pub top_p: f32,
    /// 0: off.
    pub top_k: u32,
    /// 0: off.
    pub min_p: f32,
    pub seed: u64,
    pub frequency_penalty: f32,
    pub presence_penalty: f32,
    /// 0 or 1: off.
    pub repetition_penalty: f32,
    /// (token, bias), ascending by token.
    pub logit_bias: Vec<(u32, f32)>,
    /// No stop or end token before this many output tokens.
    pub min_tokens: u32,
    /// Structured output: the grammar the output follows (compiled once
    /// at the edge to refuse a bad one; the worker keeps its matcher).
    /// Shared: every pass's item clones the sampling.
    pub grammar: Option<std::sync::Arc<kvlease_tokenizer::grammar::Constraint>>,
}

impl Sampling {
    /// Whether the next token is the argmax of the model's logits, which
    /// speculation requires (drafts are verified against that argmax).
    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0
            && !self.has_penalties()
            && self.logit_bias.is_empty()
            && self.min_tokens == 0
            && self.grammar.is_none()
    }

    /// Whether the worker needs the sequence's history on its first pass:
    /// for its token counts (penalties) or to replay its output into the
    /// grammar's matcher.
    pub fn needs_history(&self) -> bool {
        self.has_penalties() || self.grammar.is_some()
    }

    /// Whether the worker keeps the sequence's token counts.
    pub fn has_penalties(&self) -> bool {
        self.frequency_penalty != 0.0
            || self.presence_penalty != 0.0
            || !(self.repetition_penalty == 0.0 || self.repetition_penalty == 1.0)
    }
}

/// The log-probabilities a request asks for (`LogprobsRequest` in
/// `scheduler.proto`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Logprobs {
    /// Alternatives per token, at most 20.
    pub top: u32,
    /// The prompt's too.
    pub prompt: bool,
}

/// What one forward item asks of the worker (`LogprobsParams` in
/// `worker.proto`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ItemLogprobs {
    pub top: u32,
    /// Every input position (a prompt chunk).
    pub prompt: bool,
    /// With `prompt`, for a chunk the prompt goes on after.
    pub next_prompt_token: Option<u32>,
}

/// The log-probability of one token and the most likely alternatives
/// (the model's raw distribution, as the worker computes it).
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprob {
    pub token: u32,
    pub logprob: f32,
    /// (token, logprob), the most likely first.
    pub top: Vec<(u32, f32)>,
}

/// One sequence of a worker forward batch.
#[derive(Debug, Clone, PartialEq)]
pub struct ForwardItem {
    pub seq_id: SeqId,
    /// Empty when `feed_previous`.
    pub tokens: Vec<u32>,
    /// A pipelined decode: the one token to run is the one the worker
    /// sampled for the sequence in the pass this one follows
    /// (`ForwardSequence.feed_previous`).
    pub feed_previous: bool,
    pub start_pos: u32,
    pub tables: Vec<Table>,
    pub return_all_argmax: bool,
    pub sampling: Sampling,
    /// The request's prompt length (penalties and `min_tokens` count
    /// outputs from there).
    pub prompt_len: u32,
    /// The stop and end tokens `min_tokens` holds back; empty without it.
    pub stop_ids: Vec<u32>,
    /// The tokens before `start_pos`, on a penalised sequence's first pass
    /// (`ForwardSequence.history`).
    pub history: Option<Vec<u32>>,
    /// Partial-block copies to apply before the pass (the lease step's
    /// first chunk only).
    pub copies: Vec<BlockCopy>,
    /// Log-probabilities to return; `None`: none.
    pub logprobs: Option<ItemLogprobs>,
    /// Blocks to pull from a peer before the pass (the lease step's first
    /// chunk only).
    pub peer_pull: Option<PeerPull>,
}

/// One sequence's forward result.
#[derive(Debug, Clone, PartialEq)]
pub struct ForwardResult {
    pub seq_id: SeqId,
    pub next_token: u32,
    pub argmax: Vec<u32>,
    /// What the item's `logprobs` asked for: one per input position of a
    /// prompt chunk, else one.
    pub logprobs: Vec<TokenLogprob>,
    /// The sequence did not run: its peer pull failed (the worker's
    /// message). The rest of the batch ran.
    pub error: Option<String>,
}

/// A worker's answer to one Forward: its results, the pass's compute time
/// and what its peer pulls moved (for the measured rates).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct ForwardAnswer {
    pub results: Vec<ForwardResult>,
    /// The worker's time for the call (`ForwardResponse.compute_us`), its
    /// pulls included; 0 when not reported.
    pub compute_us: u64,
    /// (bytes, microseconds) of each sequence's pull.
    pub pulls: Vec<(u64, u64)>,
}

impl From<Vec<ForwardResult>> for ForwardAnswer {
    fn from(results: Vec<ForwardResult>) -> Self {
        ForwardAnswer {
            results,
            ..ForwardAnswer::default()
        }
    }
}

/// How a request ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Finish {
    /// `max_tokens` reached.
    Length,
    /// A stop token was generated.
    Stop,
    /// The client went away, or the scheduler shut down.
    Cancelled(String),
    /// The cache could not supply blocks.
    Rejected(Reject),
    /// A worker or the cache failed while serving the request.
    Error(String),
}

/// What the core tells a request's stream.
#[derive(Debug, Clone, PartialEq)]
pub enum Output {
    /// Tokens generated since the previous output.
    Tokens {
        request: RequestId,
        /// The branch (parallel sample) they belong to: 0 to `n - 1`.
        index: u32,
        tokens: Vec<u32>,
        /// Prompt tokens served from cached blocks and kept under the
        /// request's retention hint, on the first output.
        reused_tokens: Option<(u32, u32)>,
        /// With logprobs: one per token of `tokens`.
        logprobs: Vec<TokenLogprob>,
        /// With the prompt's logprobs, on the first output: one per prompt
        /// token after the first.
        prompt_logprobs: Option<Vec<TokenLogprob>>,
    },
    /// The last output of a branch of a request; `last`: of the request
    /// (every branch has finished).
    Finished {
        request: RequestId,
        index: u32,
        finish: Finish,
        preemptions: u32,
        last: bool,
        /// A beam search's hypothesis: its cumulative logprob.
        cumulative_logprob: Option<f32>,
    },
}

impl Output {
    /// The request the output belongs to.
    pub fn request(&self) -> RequestId {
        match self {
            Self::Tokens { request, .. } | Self::Finished { request, .. } => *request,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_for_full_and_window_pools() {
        assert_eq!(blocks_for(1, 0, 16), 1);
        assert_eq!(blocks_for(16, 0, 16), 1);
        assert_eq!(blocks_for(17, 0, 16), 2);
        assert_eq!(blocks_for(0, 0, 16), 0);
        // a window of 64 tokens holds at most 4 + 1 blocks of 16
        assert_eq!(blocks_for(1000, 64, 16), 5);
        assert_eq!(blocks_for(40, 64, 16), 3);
    }
}

#[cfg(test)]
mod table_tests {
    use super::*;

    #[test]
    fn extend_deltas_slide_and_append() {
        let mut tables = vec![
            Table {
                pool_id: 1,
                window: 0,
                first_block: 0,
                block_ids: vec![4, 5],
            },
            Table {
                pool_id: 2,
                window: 32,
                first_block: 0,
                block_ids: vec![7, 8, 9],
            },
        ];
        apply_extend(
            &mut tables,
            &[
                Table {
                    pool_id: 1,
                    window: 0,
                    first_block: 0,
                    block_ids: vec![6],
                },
                Table {
                    pool_id: 2,
                    window: 32,
                    first_block: 2,
                    block_ids: vec![3],
                },
            ],
        );
        assert_eq!(tables[0].block_ids, vec![4, 5, 6]);
        assert_eq!(
            (tables[1].first_block, tables[1].block_ids.clone()),
            (2, vec![9, 3])
        );
    }
}
