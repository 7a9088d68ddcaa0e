//! Domain types of leases: what a holder asks for and what it is answered.
//!
//! These mirror the `kvlease.v1` messages without depending on them; only
//! `convert` converts.

use crate::ids::{BlockId, SeqId, Step};

/// The tokens of a new sequence.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Prompt {
    /// Token ids: enables prefix reuse and caching.
    Tokens(Vec<u32>),
    /// A length only.
    Count(u32),
}

impl Prompt {
    /// Prompt length in tokens.
    pub fn len(&self) -> u32 {
        match self {
            Prompt::Tokens(t) => u32::try_from(t.len()).unwrap_or(u32::MAX),
            Prompt::Count(n) => *n,
        }
    }

    /// Whether the prompt is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// KV slots reserved beyond a sequence's tokens.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Extra {
    /// Speculative draft tokens.
    pub draft: u32,
    /// Extra KV tokens.
    pub extra_kv: u32,
    /// Extra decoding steps.
    pub extra_decoding_steps: u32,
}

impl Extra {
    /// All extra slots.
    pub fn total(&self) -> u32 {
        self.draft
            .saturating_add(self.extra_kv)
            .saturating_add(self.extra_decoding_steps)
    }
}

/// Default retention priority of cached blocks.
pub const DEFAULT_PRIORITY: u8 = 35;

/// A new sequence to lease (or a shape to estimate).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SeqSpec {
    /// The holder's id for it.
    pub seq_id: SeqId,
    /// The pool group to lease from.
    pub group: String,
    /// Its prompt.
    pub prompt: Prompt,
    /// Extra slots.
    pub extra: Extra,
    /// Beam width (>= 1).
    pub beam_width: u32,
    /// Output tokens over its life.
    pub max_new_tokens: u32,
    /// Retention priority of its cached blocks (0..=100).
    pub priority: u8,
    /// Salt mixed into its block hashes.
    pub cache_salt: String,
    /// Take the whole life's blocks now.
    pub reserve_full_life: bool,
    /// Chunked prefill: prompt tokens the lease's step computes beyond the
    /// reused ones (0: the whole prompt). Full prompt blocks past
    /// `reused_tokens + prefill_tokens` are held back until an
    /// [`ExtendItem::written_tokens`] covers them.
    pub prefill_tokens: u32,
    /// A retention hint on a prefix of the prompt (see [`Retain`]).
    pub retain: Option<Retain>,
    /// A branch of this held sequence (see [`crate::cache`]'s forks): the
    /// parent's blocks before the last prompt token are shared by
    /// reference, the block holding it copied on write.
    pub fork_of: Option<SeqId>,
    /// Peer pull: the rates its cost model uses (`None`: no peer pull).
    pub peer_pull: Option<crate::peer::PeerRates>,
    /// Disaggregated serving: the hand-off of this held sequence of
    /// another group (see [`crate::cache`]'s hand-offs), whose KV every
    /// prompt position but the last is pulled from.
    pub handoff_of: Option<SeqId>,
}

/// The longest retention hint a request may give.
pub const MAX_RETAIN_TTL: std::time::Duration = std::time::Duration::from_secs(24 * 3600);

/// The longest tenant name a retention hint may carry (a tenant is a
/// principal's or an asserted name, at most 64 characters at the
/// scheduler; the bound keeps a hint's quota key small).
pub const MAX_RETAIN_TENANT_BYTES: usize = 256;

/// A retention hint: keep the full blocks of the first `tokens` prompt
/// tokens after every unhinted block for `ttl` (see
/// [`crate::retention`]), counted against `tenant`'s quota.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Retain {
    /// Leading prompt tokens, 1 to the prompt's length.
    pub tokens: u32,
    /// 0 (evict first among hinted blocks) to 100.
    pub priority: u8,
    /// From the lease, 1 ms to [`MAX_RETAIN_TTL`].
    pub ttl: std::time::Duration,
    /// Whose quota the blocks count against (empty: the session's
    /// principal).
    pub tenant: String,
}

impl SeqSpec {
    /// A spec with defaults, for tests and tools.
    pub fn new(seq_id: SeqId, group: &str, prompt: Prompt) -> Self {
        Self {
            seq_id,
            group: group.to_owned(),
            prompt,
            extra: Extra::default(),
            beam_width: 1,
            max_new_tokens: 1,
            priority: DEFAULT_PRIORITY,
            cache_salt: String::new(),
            reserve_full_life: false,
            prefill_tokens: 0,
            retain: None,
            fork_of: None,
            peer_pull: None,
            handoff_of: None,
        }
    }
}

/// Growth of an existing sequence.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Growth {
    /// The new tokens' ids (lets the blocks they fill be cached).
    Tokens(Vec<u32>),
    /// A count only.
    Count(u32),
}

impl Growth {
    /// New tokens.
    pub fn len(&self) -> u32 {
        match self {
            Growth::Tokens(t) => u32::try_from(t.len()).unwrap_or(u32::MAX),
            Growth::Count(n) => *n,
        }
    }

    /// Whether it adds nothing.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// One item of an `Extend`: growth, progress of a chunked prefill, or both.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExtendItem {
    /// The sequence.
    pub seq_id: SeqId,
    /// New tokens (`None`: a progress report only, nothing grows).
    pub growth: Option<Growth>,
    /// The sequence's KV is written through this many tokens by the forward
    /// pass of the call's step (0: no report).
    pub written_tokens: u32,
    /// The length the holder grows the sequence from (`None`: not checked):
    /// any other length refuses the growth with `LENGTH_MISMATCH`, so a
    /// retried growth whose first call was applied is not applied twice.
    pub from_length: Option<u32>,
}

impl ExtendItem {
    /// Growth only, as before chunked-prefill progress existed.
    pub fn grow(seq_id: SeqId, growth: Growth) -> Self {
        Self {
            seq_id,
            growth: Some(growth),
            written_tokens: 0,
            from_length: None,
        }
    }

    /// A progress report only.
    pub fn written(seq_id: SeqId, written_tokens: u32) -> Self {
        Self {
            seq_id,
            growth: None,
            written_tokens,
            from_length: None,
        }
    }

    /// New tokens (0 for a progress report).
    pub fn new_tokens(&self) -> u32 {
        self.growth.as_ref().map_or(0, Growth::len)
    }
}

/// The blocks of one sequence (one beam) in one pool.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Table {
    /// The pool's id.
    pub pool_id: u32,
    /// The pool's window (0 = full attention).
    pub window: u32,
    /// Beam index.
    pub beam: u32,
    /// Sequence block index of `block_ids[0]`.
    pub first_block: u32,
    /// Block ids in sequence order.
    pub block_ids: Vec<BlockId>,
}

/// A sequence got its blocks.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Grant {
    /// The sequence.
    pub seq_id: SeqId,
    /// One table per (pool, beam). From `Lease`: the whole table. From
    /// `Extend`: a delta: `first_block` after any slide, and only the block
    /// ids appended by this call (see [`kvlease_proto::delta`]); tables the
    /// call did not change are left out.
    pub tables: Vec<Table>,
    /// Leading prompt tokens whose KV the holder need not compute: reused
    /// full blocks, plus the slots of `copies`.
    pub reused_tokens: u32,
    /// Token slots the lease covers.
    pub capacity_tokens: u32,
    /// Partial-block copies the forward pass of the lease's step applies
    /// first (`Lease` only; at most one per pool).
    pub copies: Vec<BlockCopy>,
    /// Copies between the device and host tiers the forward pass of the
    /// call's step applies before anything else, in order: demotions of
    /// device blocks this call's allocations evicted, then onboardings of
    /// this sequence's prefix blocks found on the host.
    pub tier_copies: Vec<TierCopy>,
    /// Leading prompt tokens whose full blocks are under the sequence's
    /// retention hint (`Lease` only): its `tokens` rounded down to whole
    /// blocks, fewer when the tenant's quota had no room for the rest, 0
    /// without a hint.
    pub retained_tokens: u32,
    /// Blocks pulled from a peer group's device before the lease's step's
    /// pass (`Lease` only; see [`crate::peer`]).
    pub peer_copies: Vec<crate::peer::PeerCopy>,
    /// What the peer-pull cost model weighed, when a peer held blocks this
    /// lease could pull (`Lease` only).
    pub peer_decision: Option<crate::peer::PeerDecision>,
}

/// Which way a [`TierCopy`] goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TierDirection {
    /// Device block -> host block (an evicted block kept on the host).
    Demote,
    /// Host block -> device block (a host-cached prefix block brought back).
    Onboard,
    /// Host block -> disk block (an evicted host block kept on disk).
    Spill,
    /// Disk block -> device block (a disk-cached prefix block brought back).
    Load,
}

/// Copy one whole block between two tiers (device, host, disk) of a pool.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TierCopy {
    /// The pool's service-wide id.
    pub pool_id: u32,
    /// The pool's window.
    pub window: u32,
    /// Which way.
    pub direction: TierDirection,
    /// The device block (`Demote`, `Onboard`, `Load`; 0 for `Spill`).
    pub device_block: BlockId,
    /// The host block (`Demote`, `Onboard`, `Spill`; 0 for `Load`).
    pub host_block: crate::tier::HostBlockId,
    /// The disk block (`Spill`, `Load`; 0 otherwise).
    pub disk_block: crate::tier::HostBlockId,
    /// The block's prefix hash (`Spill`, `Load`; 0 otherwise).
    pub hash: u64,
    /// Its parent's hash (`Spill`, `Load`; 0 otherwise).
    pub parent: u64,
}

/// Copy slots `[0, tokens)` of `src_block` into `dst_block`, in one pool.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlockCopy {
    /// The pool's service-wide id.
    pub pool_id: u32,
    /// The pool's window.
    pub window: u32,
    /// A kept partly filled block (fenced until the lease's step completes).
    pub src_block: BlockId,
    /// The sequence's own block at the same index.
    pub dst_block: BlockId,
    /// Slots to copy, from slot 0.
    pub tokens: u32,
}

/// Why a sequence got no blocks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RejectReason {
    /// Not enough blocks now; transient.
    PoolExhausted,
    /// Cannot fit even in an empty pool.
    ExceedsCapacity,
    /// Another member of an atomic batch failed.
    RolledBack,
    /// The session does not hold the sequence.
    UnknownSequence,
    /// The session already holds the sequence (or the batch names it twice).
    DuplicateSequence,
    /// The session's block quota would be exceeded.
    QuotaExceeded,
    /// An extend grows the sequence from a length it does not have.
    LengthMismatch,
}

impl RejectReason {
    /// The protocol name, for logs and metrics.
    pub fn as_str(self) -> &'static str {
        match self {
            RejectReason::PoolExhausted => "POOL_EXHAUSTED",
            RejectReason::ExceedsCapacity => "EXCEEDS_CAPACITY",
            RejectReason::RolledBack => "ROLLED_BACK",
            RejectReason::UnknownSequence => "UNKNOWN_SEQUENCE",
            RejectReason::DuplicateSequence => "DUPLICATE_SEQUENCE",
            RejectReason::QuotaExceeded => "QUOTA_EXCEEDED",
            RejectReason::LengthMismatch => "LENGTH_MISMATCH",
        }
    }
}

/// A rejection with the figures that explain it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Reject {
    /// The sequence.
    pub seq_id: SeqId,
    /// Why.
    pub reason: RejectReason,
    /// The pool that could not supply (0: not pool-specific).
    pub pool_id: u32,
    /// That pool's window.
    pub window: u32,
    /// Blocks needed from the pool.
    pub blocks_needed: u32,
    /// Blocks free or evictable there now.
    pub blocks_free: u32,
    /// Blocks there that pending fences will free.
    pub blocks_pending_free: u32,
    /// Explanation.
    pub message: String,
}

impl Reject {
    /// A reject that names no pool.
    pub fn plain(seq_id: SeqId, reason: RejectReason, message: String) -> Self {
        Self {
            seq_id,
            reason,
            pool_id: 0,
            window: 0,
            blocks_needed: 0,
            blocks_free: 0,
            blocks_pending_free: 0,
            message,
        }
    }
}

/// The answer for one sequence.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// Blocks granted.
    Grant(Grant),
    /// No blocks.
    Reject(Reject),
}

impl Outcome {
    /// The grant, if any.
    pub fn grant(&self) -> Option<&Grant> {
        match self {
            Outcome::Grant(g) => Some(g),
            Outcome::Reject(_) => None,
        }
    }

    /// The reject, if any.
    pub fn reject(&self) -> Option<&Reject> {
        match self {
            Outcome::Grant(_) => None,
            Outcome::Reject(r) => Some(r),
        }
    }
}

/// How a release gives its sequences' blocks back.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ReleaseMode {
    /// Keep the blocks out of circulation until this step completes (`None`:
    /// return them at once, discarding what an incomplete step wrote).
    pub fence_step: Option<Step>,
    /// The holder's forward pass of a step not yet completed failed: blocks
    /// written at such a step never publish, even behind the fence, and no
    /// partly filled block is kept.
    pub discard_unwritten: bool,
}

impl From<Option<Step>> for ReleaseMode {
    fn from(fence_step: Option<Step>) -> Self {
        Self {
            fence_step,
            discard_unwritten: false,
        }
    }
}

/// What a release did to one sequence.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReleaseStatus {
    /// Its blocks were released now.
    Released,
    /// It was released before.
    AlreadyReleased,
    /// The session never held it (or forgot it long ago).
    Unknown,
}

/// Result of releasing one sequence.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ReleaseResult {
    /// The sequence.
    pub seq_id: SeqId,
    /// What happened.
    pub status: ReleaseStatus,
    /// Blocks returned to circulation now.
    pub blocks_freed: u32,
    /// Blocks parked behind the fence.
    pub blocks_fenced: u32,
}
