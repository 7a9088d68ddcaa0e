//! Holder sessions and the sequences they hold.
//!
//! A session owns its sequences' block tables, the fences it has parked and
//! the block hashes that wait for its steps to complete. Expiry or close hands
//! all of it back (see `Cache::reclaim_session`).

use std::collections::{BTreeMap, VecDeque};

use foldhash::{HashMap, HashMapExt, HashSet, HashSetExt};
use std::time::{Duration, Instant};

use crate::pool::BlockId;

/// The blocks of one beam of a sequence in one pool: block indices
/// `[first, first + blocks.len())` of the sequence.
#[derive(Clone, Debug, Default)]
pub struct BeamTable {
    /// Sequence block index of `blocks[0]`.
    pub first: u32,
    /// Block ids.
    pub blocks: VecDeque<BlockId>,
}

impl BeamTable {
    /// One past the last block index.
    pub fn end(&self) -> u32 {
        self.first + self.blocks.len() as u32
    }
}

/// A sequence's tables in one pool.
#[derive(Clone, Debug)]
pub struct PoolTables {
    /// Index of the pool in the cache's pool list.
    pub pool: usize,
    /// One table per beam.
    pub beams: Vec<BeamTable>,
}

/// A leased sequence.
#[derive(Clone, Debug)]
pub struct SeqState {
    /// Pool group.
    pub group: String,
    /// Committed tokens (prompt plus extends).
    pub len: u32,
    /// Prompt length.
    pub prompt_len: u32,
    /// Extra slots kept beyond `len`.
    pub extra: u32,
    /// Slots reserved at lease time for the whole life (0 when not reserved).
    pub reserved_capacity: u32,
    /// Beam width.
    pub beams: u32,
    /// Retention priority.
    pub priority: u8,
    /// Salt hash.
    pub salt: u64,
    /// Hashes of the full blocks so far (block index order), while hashable.
    pub hashes: Vec<u64>,
    /// Tokens of the partly filled block, while hashable.
    pub partial: Vec<u32>,
    /// Whether token ids are known for every position (and caching is on).
    pub hashable: bool,
    /// Tables per pool of the group.
    pub tables: Vec<PoolTables>,
}

impl SeqState {
    /// Slots the lease covers.
    pub fn capacity(&self) -> u32 {
        self.len
            .saturating_add(self.extra)
            .max(self.reserved_capacity)
    }

    /// Distinct blocks held in the pool at position `i` of `tables`.
    pub fn held_in(&self, i: usize) -> u32 {
        let t = &self.tables[i];
        let mut seen = HashSet::new();
        for beam in &t.beams {
            seen.extend(beam.blocks.iter().copied());
        }
        seen.len() as u32
    }

    /// Block references held (a shared block counts once per beam).
    pub fn references(&self) -> u64 {
        self.tables
            .iter()
            .flat_map(|t| &t.beams)
            .map(|b| b.blocks.len() as u64)
            .sum()
    }
}

/// A block parked or waiting on a step of the session.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlockRef {
    /// Pool index.
    pub pool: usize,
    /// Block id.
    pub block: BlockId,
    /// The block's generation when the reference was taken.
    pub generation: u32,
}

/// How many released sequence ids a session remembers to answer
/// `ALREADY_RELEASED` rather than `UNKNOWN`.
const RELEASED_MEMORY: usize = 65_536;

/// A holder's session.
#[derive(Debug)]
pub struct Session {
    /// Its id.
    pub id: u64,
    /// The holder's name.
    pub holder: String,
    /// Time-to-live without a keep-alive.
    pub ttl: Duration,
    /// When it expires.
    pub expires_at: Instant,
    /// Leased sequences.
    pub seqs: HashMap<u64, SeqState>,
    /// Blocks released under a fence, by fence step.
    pub fences: BTreeMap<u64, Vec<BlockRef>>,
    /// Blocks whose hash publishes when the step completes, by step.
    pub pending: BTreeMap<u64, Vec<BlockRef>>,
    /// Highest step reported complete.
    pub completed_step: Option<u64>,
    /// Block references held by its sequences (for the quota).
    pub references: u64,
    released: HashSet<u64>,
    released_order: VecDeque<u64>,
}

impl Session {
    /// A new session expiring `ttl` after `now`.
    pub fn new(id: u64, holder: String, ttl: Duration, now: Instant) -> Self {
        Self {
            id,
            holder,
            ttl,
            expires_at: now + ttl,
            seqs: HashMap::new(),
            fences: BTreeMap::new(),
            pending: BTreeMap::new(),
            completed_step: None,
            references: 0,
            released: HashSet::new(),
            released_order: VecDeque::new(),
        }
    }

    /// Whether a fence at `step` is already satisfied.
    pub fn step_completed(&self, step: u64) -> bool {
        self.completed_step.is_some_and(|done| step <= done)
    }

    /// Remembers that `seq_id` was released.
    pub fn remember_released(&mut self, seq_id: u64) {
        if self.released.insert(seq_id) {
            self.released_order.push_back(seq_id);
            if self.released_order.len() > RELEASED_MEMORY
                && let Some(old) = self.released_order.pop_front()
            {
                self.released.remove(&old);
            }
        }
    }

    /// Forgets a released id that is being leased again.
    pub fn forget_released(&mut self, seq_id: u64) {
        if self.released.remove(&seq_id) {
            self.released_order.retain(|&s| s != seq_id);
        }
    }

    /// Whether `seq_id` was released before.
    pub fn was_released(&self, seq_id: u64) -> bool {
        self.released.contains(&seq_id)
    }

    /// Fenced block references, over all steps.
    pub fn fenced_blocks(&self) -> usize {
        self.fences.values().map(Vec::len).sum()
    }
}
