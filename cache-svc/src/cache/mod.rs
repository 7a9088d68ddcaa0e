//! The cache: pool groups, sessions and the lease protocol over them.
//!
//! Every operation checks capacity for a sequence (or a whole atomic batch)
//! before it mutates anything, so a sequence gets all its blocks in every pool
//! or none (invariant 3), and running out of blocks is a [`Reject`], never a
//! panic (invariant 8).
//!
//! Positions and blocks: block `i` of a sequence holds positions
//! `[i * B, (i + 1) * B)`. A lease covers `len + extra` slots. In a pool of
//! window `W`, the query at position `p` reads keys `p - W + 1 ..= p`; an
//! `Extend` from length `L` keeps the blocks from `floor((L - W + 1) / B)` on
//! and releases the older ones fenced at the extend's step (the step before
//! may still read them), so after an extend a sequence holds at most
//! `ceil((W + extra) / B) + 1` blocks of a windowed pool (invariant 10). A
//! lease holds the whole prompt, which its own prefill reads.
//!
//! # Layout
//! This module holds the state ([`Cache`]) and what its operations share;
//! each submodule adds the `impl Cache` of one concern:
//! - `pools`: registering pool groups and looking pools up.
//! - `sessions`: opening, renewing, closing and expiring sessions, and
//!   reclaiming what they held.
//! - `lease`: `Lease` of new sequences (plan, check, pin, execute).
//! - `extend`: `Extend` of held sequences (plan, check, execute).
//! - `release`: `Release` and `CompleteStep` (fences and hash publication).
//! - `stats`: estimates and pool figures.
//! - `step`: `Step`, a holder's release, completion and extend in that
//!   order, every part checked before any is applied.
//! - `evictions`: which sequence's allocation evicted cached blocks.
//! - `matching`: `Match`, the read-only prefix lookup that routing asks
//!   (what a lease would reuse in each group, changing nothing).
//! - `peers`: which groups are peers (peer pull) and the run of a
//!   prompt's blocks a peer holds after what a lease reuses locally.
//! - `incarnation`: a restarted worker (memory forgotten, disk tier
//!   indexed from its files).
//! - `tiers`: the host and disk tiers' demotions, spills and onboarding
//!   pins per step, and what a failed pass or a worker restart drops.
//! - `audit`: the leak audit, `check_invariants` and views for tests.

mod audit;
mod evictions;
mod extend;
mod handoff;
mod incarnation;
mod lease;
mod matching;
mod peers;
mod pools;
mod release;
mod sessions;
mod stats;
mod step;
mod tiers;

use foldhash::{HashMap, HashMapExt, HashSet};
use std::time::Duration;

use crate::events::{EventKind, EventLog, EventsSince};
use crate::events::{IndexEvent, Tier};
use crate::ids::{BlockId, Epoch, SeqId, SessionId, Step};
use crate::lease::{Reject, RejectReason};
use crate::pool::BlockPool;
use crate::session::Session;

pub use audit::{AUDIT_SLICE_BLOCKS, AuditCursor, AuditReport, Leak};
pub use evictions::Evicted;
pub use incarnation::{DiskPool, Reindexed, check_disk_pool};
pub use matching::{MatchPrompt, Matched};
pub use pools::{BuiltGroup, NewGroup, PoolInfo, Registration, Unregistered};
pub use sessions::{Opened, Reclaimed};
pub use stats::{PoolEstimate, PoolStats, ShapeEstimate, Stats};
pub use step::{StepExtend, StepOutcome, StepParts, StepRelease};

/// How a batch of `Lease` or `Extend` is applied.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Batch {
    /// The holder's step (fences and hash publication key on it).
    pub step: Step,
    /// All-or-nothing.
    pub atomic: bool,
    /// Warm-up traffic: not cached, not counted in hit rates (`Lease` only).
    pub warmup: bool,
}

/// Share of each pool one tenant may hold under retention hints, unless
/// configured.
pub const DEFAULT_RETENTION_SHARE: f64 = 0.25;

/// Limits and defaults of the cache.
#[derive(Clone, Debug)]
pub struct CacheConfig {
    /// TTL of a session that asks for none.
    pub default_ttl: Duration,
    /// Smallest TTL granted.
    pub min_ttl: Duration,
    /// Largest TTL granted.
    pub max_ttl: Duration,
    /// Block references one session may hold (0: unlimited).
    pub session_quota: u64,
    /// Events kept for `WatchEvents`.
    pub event_capacity: usize,
    /// Largest pool accepted by `RegisterPool`, in blocks.
    pub max_pool_blocks: u32,
    /// Largest beam width accepted.
    pub max_beam_width: u32,
    /// Most sessions open at once (0: unlimited).
    pub max_sessions: usize,
    /// Most sessions open at once under one key (the holder name today, the
    /// caller's principal once callers are authenticated; 0: unlimited).
    pub max_sessions_per_holder: usize,
    /// Most pool groups registered at once (0: unlimited).
    pub max_pool_groups: usize,
    /// Most pool groups one principal may have registered at once (0:
    /// unlimited), so that no principal takes every group.
    pub max_pool_groups_per_principal: usize,
    /// Most blocks (device and host) of the groups one principal
    /// registered (0: unlimited): what one principal may make the cache
    /// build and keep.
    pub max_blocks_per_principal: u64,
    /// Bytes of block state all pools together may take; a `RegisterPool`
    /// that would pass it is refused (0: unlimited).
    pub pool_memory_budget: u64,
    /// The eviction policy of each pool group.
    pub eviction: crate::eviction::EvictionConfig,
    /// Keep released sequences' partly filled last blocks and grant copies
    /// of their matching slots (partial-block reuse).
    pub partial_reuse: bool,
    /// Keep a partly filled block only when it holds at least this many
    /// tokens (what reusing it can save at most).
    pub partial_min_tokens: u32,
    /// Share (0 to 1) of each pool's blocks one tenant may hold under
    /// retention hints.
    pub retention_share: f64,
}

impl Default for CacheConfig {
    fn default() -> Self {
        Self {
            default_ttl: Duration::from_secs(30),
            min_ttl: Duration::from_secs(1),
            max_ttl: Duration::from_secs(600),
            session_quota: 0,
            event_capacity: 8_192,
            max_pool_blocks: 1 << 24,
            max_beam_width: 64,
            max_sessions: 0,
            max_sessions_per_holder: 0,
            max_pool_groups: 0,
            max_pool_groups_per_principal: 0,
            max_blocks_per_principal: 0,
            pool_memory_budget: 0,
            eviction: crate::eviction::EvictionConfig::default(),
            partial_reuse: true,
            // like the limits above, off in the core: any partial is kept
            // (the service's flag defaults to DEFAULT_PARTIAL_MIN_TOKENS)
            partial_min_tokens: 1,
            retention_share: DEFAULT_RETENTION_SHARE,
        }
    }
}

/// A registered pool.
#[derive(Debug)]
pub struct PoolEntry {
    /// Service-wide id (from 1).
    pub id: u32,
    /// Its group.
    pub group: String,
    /// Attention window (0 = full).
    pub window: u32,
    /// Tokens per block.
    pub tokens_per_block: u32,
    /// The blocks.
    pub pool: BlockPool,
    /// Unregistered: its blocks are gone, its id is not reused.
    pub retired: bool,
}

#[derive(Debug)]
struct Group {
    tokens_per_block: u32,
    /// The principal that registered it first: only its sessions may
    /// `Match` or `Lease` in it, and only it may register it again.
    owner: String,
    /// Indices into `Cache::pools`, in registration order.
    pools: Vec<usize>,
    /// The worker incarnation last registered (0: none yet).
    incarnation: u64,
    /// The eviction policy of its pools.
    policy: crate::eviction::PolicyKind,
    /// Its peer key and block sizes (peer pull).
    peer: peers::PeerProfile,
}

/// The cache service's state. Plain, synchronous, single-threaded: the gRPC
/// layer serialises calls through a mutex.
#[derive(Debug)]
pub struct Cache {
    config: CacheConfig,
    epoch: Epoch,
    groups: HashMap<String, Group>,
    pools: Vec<PoolEntry>,
    sessions: HashMap<SessionId, Session>,
    /// Open sessions per key (see [`CacheConfig::max_sessions_per_holder`]).
    sessions_per_key: HashMap<String, usize>,
    events: EventLog,
    /// Evictions by sequence since the service last took them.
    evicted: Vec<Evicted>,
    /// The last peer-pull transfer id handed out.
    last_transfer: u64,
}

/// Running totals of an atomic batch, per pool.
#[derive(Debug, Default)]
struct Tally {
    new_blocks: HashMap<usize, u64>,
    pinned: HashMap<usize, HashSet<BlockId>>,
    references: u64,
}

/// Bytes of cache state one block costs (its slot in the pool's tables,
/// eviction bookkeeping and prefix index), measured: a pool of 2^24 blocks
/// took about 1.5 GiB.
pub const BLOCK_STATE_BYTES: u64 = 96;

/// Checks a name that reaches logs (a pool group, a holder): 1 to 128 of
/// `A-Z a-z 0-9 . _ - / : @ +`, so no name can forge or break a log line.
pub fn check_name(what: &str, name: &str) -> crate::error::Result<()> {
    let ok = |c: char| c.is_ascii_alphanumeric() || "._-/:@+".contains(c);
    if name.is_empty() || name.len() > 128 {
        return Err(crate::error::Error::InvalidArgument(format!(
            "{what} must be 1 to 128 characters, got {}",
            name.len()
        )));
    }
    if let Some((at, bad)) = name.char_indices().find(|&(_, c)| !ok(c)) {
        return Err(crate::error::Error::InvalidArgument(format!(
            "{what} may only hold A-Z a-z 0-9 . _ - / : @ +; character {bad:?} at byte {at} is not allowed"
        )));
    }
    Ok(())
}

fn ceil_div(a: u32, b: u32) -> u32 {
    a.div_ceil(b)
}

impl Cache {
    /// An empty cache with a fresh epoch.
    pub fn new(config: CacheConfig) -> Self {
        Self::with_epoch(config, Epoch(fresh_epoch()))
    }

    /// An empty cache with the given epoch (tests).
    pub fn with_epoch(config: CacheConfig, epoch: Epoch) -> Self {
        let events = EventLog::new(config.event_capacity);
        Self {
            config,
            epoch,
            groups: HashMap::new(),
            pools: Vec::new(),
            sessions: HashMap::new(),
            sessions_per_key: HashMap::new(),
            events,
            evicted: Vec::new(),
            last_transfer: 0,
        }
    }

    /// The epoch of this start.
    pub fn epoch(&self) -> Epoch {
        self.epoch
    }

    /// The configuration.
    pub fn config(&self) -> &CacheConfig {
        &self.config
    }

    // === events ===

    /// Events after `after`, at most `max`.
    pub fn events_since(&self, after: u64, max: usize) -> EventsSince {
        self.events.since(after, max)
    }

    /// Id of the newest event.
    pub fn last_event_id(&self) -> u64 {
        self.events.last_id()
    }

    fn flush_events(&mut self) {
        for entry in &mut self.pools {
            let raw = entry.pool.drain_events();
            if raw.is_empty() {
                continue;
            }
            for tier in [Tier::Device, Tier::Host, Tier::Disk] {
                let kinds: Vec<EventKind> = raw
                    .iter()
                    .filter_map(|e| match *e {
                        IndexEvent::Stored {
                            hash,
                            parent,
                            tier: t,
                        } if t == tier => Some(EventKind::Stored {
                            hashes: vec![hash],
                            parent,
                        }),
                        IndexEvent::Removed { hash, tier: t } if t == tier => {
                            Some(EventKind::Removed { hashes: vec![hash] })
                        }
                        _ => None,
                    })
                    .collect();
                if !kinds.is_empty() {
                    self.events.push_batch(entry.id, tier, kinds);
                }
            }
        }
    }

    // === rejects ===

    /// A reject naming one pool, with its current free and fenced counts.
    fn pool_reject(
        &self,
        seq_id: SeqId,
        pool: usize,
        reason: RejectReason,
        needed: u64,
        message: String,
    ) -> Reject {
        let entry = &self.pools[pool];
        let counts = entry.pool.counts();
        Reject {
            seq_id,
            reason,
            pool_id: entry.id,
            window: entry.window,
            blocks_needed: u32::try_from(needed).unwrap_or(u32::MAX),
            blocks_free: counts.available(),
            blocks_pending_free: counts.fenced,
            message,
        }
    }
}

/// An epoch that differs between starts: wall-clock nanoseconds mixed with the
/// process id.
fn fresh_epoch() -> u64 {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    let mixed = nanos ^ (u64::from(std::process::id()) << 48);
    mixed.max(1)
}
