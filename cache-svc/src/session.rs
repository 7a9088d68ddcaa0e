//! Holder sessions and the sequences they hold.
//!
//! A session owns its sequences' block tables, the fences it has parked and
//! the block hashes that wait for its steps to complete. Expiry or close hands
//! all of it back (see `Cache::reclaim_session`).

use std::collections::{BTreeMap, VecDeque};

use foldhash::{HashMap, HashMapExt, HashSet, HashSetExt};
use std::time::{Duration, Instant};

use crate::ids::{BlockId, SeqId, SessionId, Step};

/// The blocks of one beam of a sequence in one pool: block indices
/// `[first, first + blocks.len())` of the sequence.
#[derive(Clone, Debug, Default)]
pub(crate) struct BeamTable {
    /// Sequence block index of `blocks[0]`.
    pub first: u32,
    /// Block ids.
    pub blocks: VecDeque<BlockId>,
}

impl BeamTable {
    /// One past the last block index.
    pub(crate) fn end(&self) -> u32 {
        self.first + self.blocks.len() as u32
    }
}

/// A sequence's tables in one pool.
#[derive(Clone, Debug)]
pub(crate) struct PoolTables {
    /// Index of the pool in the cache's pool list.
    pub pool: usize,
    /// One table per beam.
    pub beams: Vec<BeamTable>,
}

/// A leased sequence.
#[derive(Clone, Debug)]
pub(crate) struct SeqState {
    /// Committed tokens (prompt plus extends).
    pub len: u32,
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
    /// The step whose forward pass writes the latest tokens (the lease's, or
    /// the last `Extend` with token ids): once it completes, `partial`'s KV
    /// is in the last block.
    pub write_step: Step,
    /// Whether token ids are known for every position (and caching is on).
    pub hashable: bool,
    /// Tables per pool of the group.
    pub tables: Vec<PoolTables>,
    /// Tokens whose KV a step is known to write (the lease's first chunk,
    /// then chunked-prefill progress reports); `len` once the prefill is
    /// whole.
    pub written: u32,
    /// Tokens whose KV a completed step wrote (reused blocks included):
    /// what a fork may share. `written` runs ahead of it by the steps in
    /// flight, whose reports wait in `writes_in_flight`.
    pub written_done: u32,
    /// `(step, written)` reported for steps not completed yet, oldest first.
    pub writes_in_flight: Vec<(Step, u32)>,
    /// Full prompt blocks past `written` (chunked prefill): their hashes are
    /// pending, but they publish only once a progress report covers them.
    /// Each with the token position its block ends at, in block order.
    pub held_back: Vec<(u32, BlockRef)>,
}

impl SeqState {
    /// Records that `step`'s pass writes this sequence's KV through
    /// `written` tokens; `completed`: the session's last completed step. A
    /// report for a step already completed is never known to be written (as
    /// its hashes are never published) and counts nothing. Steady decode
    /// keeps one or two entries: a step's reports share one.
    pub(crate) fn note_write(&mut self, step: Step, written: u32, completed: Option<Step>) {
        let done = |s: Step| completed.is_some_and(|c| s <= c);
        if self.writes_in_flight.first().is_some_and(|&(s, _)| done(s)) {
            self.settle_writes(completed);
        }
        if done(step) {
            return;
        }
        match self.writes_in_flight.last_mut() {
            Some((s, w)) if *s == step => *w = (*w).max(written),
            _ => self.writes_in_flight.push((step, written)),
        }
    }

    /// Tokens whose KV a step completed by `completed` wrote.
    pub(crate) fn written_by(&self, completed: Option<Step>) -> u32 {
        let done = |step: Step| completed.is_some_and(|c| step <= c);
        self.writes_in_flight
            .iter()
            .filter(|&&(step, _)| done(step))
            .fold(self.written_done, |acc, &(_, w)| acc.max(w))
            .min(self.len)
    }

    /// Folds the reports of steps completed by `completed` into
    /// `written_done`.
    fn settle_writes(&mut self, completed: Option<Step>) {
        self.written_done = self.written_by(completed);
        self.writes_in_flight
            .retain(|&(step, _)| completed.is_none_or(|c| step > c));
    }

    /// Slots the lease covers.
    pub(crate) fn capacity(&self) -> u32 {
        self.len
            .saturating_add(self.extra)
            .max(self.reserved_capacity)
    }

    /// Block references held (a shared block counts once per beam).
    pub(crate) fn references(&self) -> u64 {
        self.tables
            .iter()
            .flat_map(|t| &t.beams)
            .map(|b| b.blocks.len() as u64)
            .sum()
    }
}

/// A block parked or waiting on a step of the session.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct BlockRef {
    /// Pool index.
    pub pool: usize,
    /// Block id.
    pub block: BlockId,
    /// The block's generation when the reference was taken.
    pub generation: u32,
}

/// A host- or disk-tier block waiting on a step of the session.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct HostRef {
    /// Pool index.
    pub pool: usize,
    /// `Tier::Host` or `Tier::Disk`.
    pub tier: crate::events::Tier,
    /// Host block id.
    pub block: crate::tier::HostBlockId,
    /// Its generation when the reference was taken.
    pub generation: u32,
}

/// How many released sequence ids a session remembers to answer
/// `ALREADY_RELEASED` rather than `UNKNOWN`. A duplicate Release is a retry
/// that comes within seconds; at a few hundred releases a second this
/// covers tens of seconds, in well under a MiB.
const RELEASED_MEMORY: usize = 8_192;

/// A holder's session.
#[derive(Debug)]
pub(crate) struct Session {
    /// Its id.
    pub id: SessionId,
    /// The principal that opened it, the only one that may use it.
    pub owner: std::sync::Arc<str>,
    /// What the per-holder session limit counts it under.
    pub key: String,
    /// Time-to-live without a keep-alive.
    pub ttl: Duration,
    /// When it expires.
    pub expires_at: Instant,
    /// Leased sequences.
    pub seqs: HashMap<SeqId, SeqState>,
    /// Blocks released under a fence, by fence step.
    pub fences: BTreeMap<Step, Vec<BlockRef>>,
    /// Blocks whose hash publishes when the step completes, by step.
    pub pending: BTreeMap<Step, Vec<BlockRef>>,
    /// Host (and disk) blocks receiving demotions (and spills) named at a
    /// step, by step: published
    /// when it completes, dropped by a `discard_unwritten` release.
    pub demotions: BTreeMap<Step, Vec<HostRef>>,
    /// Host blocks read by onboarding copies at a step, by step: unpinned
    /// when it completes.
    pub host_pins: BTreeMap<Step, Vec<HostRef>>,
    /// Highest step reported complete.
    pub completed_step: Option<Step>,
    /// Block references held by its sequences (for the quota).
    pub references: u64,
    /// The pool groups it has leased in: while it is open, no other
    /// worker incarnation may take them (see `cache/incarnation.rs`).
    pub groups: HashSet<String>,
    released: Released,
}

/// The released sequence ids a session remembers, oldest forgotten first
/// once there are more than `RELEASED_MEMORY`: each id with the ordinal of
/// its release, and the ids by ordinal. Remembering, forgetting and the
/// lookup are O(log n) or better, whichever id it is.
#[derive(Debug, Default)]
struct Released {
    ordinal_of: HashMap<SeqId, u64>,
    by_ordinal: BTreeMap<u64, SeqId>,
    next: u64,
}

impl Released {
    fn remember(&mut self, seq_id: SeqId, limit: usize) {
        if self.ordinal_of.contains_key(&seq_id) {
            return;
        }
        self.ordinal_of.insert(seq_id, self.next);
        self.by_ordinal.insert(self.next, seq_id);
        self.next += 1;
        if self.by_ordinal.len() > limit
            && let Some((_, oldest)) = self.by_ordinal.pop_first()
        {
            self.ordinal_of.remove(&oldest);
        }
    }

    fn forget(&mut self, seq_id: SeqId) {
        if let Some(ordinal) = self.ordinal_of.remove(&seq_id) {
            self.by_ordinal.remove(&ordinal);
        }
    }

    fn contains(&self, seq_id: SeqId) -> bool {
        self.ordinal_of.contains_key(&seq_id)
    }
}

impl Session {
    /// A new session expiring `ttl` after `now`.
    pub(crate) fn new(
        id: SessionId,
        owner: std::sync::Arc<str>,
        key: String,
        ttl: Duration,
        now: Instant,
    ) -> Self {
        Self {
            key,
            id,
            owner,
            ttl,
            expires_at: now + ttl,
            seqs: HashMap::new(),
            fences: BTreeMap::new(),
            pending: BTreeMap::new(),
            demotions: BTreeMap::new(),
            host_pins: BTreeMap::new(),
            completed_step: None,
            references: 0,
            groups: HashSet::new(),
            released: Released::default(),
        }
    }

    /// Notes that it leases in `group`.
    pub(crate) fn leases_in(&mut self, group: &str) {
        if !self.groups.contains(group) {
            self.groups.insert(group.to_owned());
        }
    }

    /// Whether a fence at `step` is already satisfied.
    pub(crate) fn step_completed(&self, step: Step) -> bool {
        self.completed_step.is_some_and(|done| step <= done)
    }

    /// Remembers that `seq_id` was released.
    pub(crate) fn remember_released(&mut self, seq_id: SeqId) {
        self.released.remember(seq_id, RELEASED_MEMORY);
    }

    /// Forgets a released id that is being leased again.
    pub(crate) fn forget_released(&mut self, seq_id: SeqId) {
        self.released.forget(seq_id);
    }

    /// Whether `seq_id` was released before.
    pub(crate) fn was_released(&self, seq_id: SeqId) -> bool {
        self.released.contains(seq_id)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn released_ids_are_forgotten_oldest_first_and_on_demand() {
        let mut r = Released::default();
        for id in 1..=4 {
            r.remember(SeqId(id), 3);
        }
        // over the limit of 3: the oldest (1) went
        assert!(!r.contains(SeqId(1)));
        assert!((2..=4).all(|id| r.contains(SeqId(id))));
        // forgetting one in the middle leaves the order of the rest
        r.forget(SeqId(3));
        assert!(!r.contains(SeqId(3)));
        r.remember(SeqId(5), 3);
        r.remember(SeqId(6), 3);
        assert!(!r.contains(SeqId(2)), "2 is now the oldest and goes first");
        assert!([4, 5, 6].iter().all(|&id| r.contains(SeqId(id))));
        // an id remembered again after being forgotten counts as new
        r.forget(SeqId(4));
        r.remember(SeqId(4), 3);
        r.remember(SeqId(7), 3);
        assert!(!r.contains(SeqId(5)));
        assert!([6, 4, 7].iter().all(|&id| r.contains(SeqId(id))));
        assert_eq!((r.ordinal_of.len(), r.by_ordinal.len()), (3, 3));
    }

    #[test]
    fn forgetting_keeps_both_indexes_in_step() {
        let mut r = Released::default();
        for id in (0..1000).map(SeqId) {
            r.remember(id, 100);
            if id.0 % 3 == 0 {
                r.forget(id);
            }
        }
        assert_eq!(r.ordinal_of.len(), r.by_ordinal.len());
        assert!(r.by_ordinal.len() <= 100);
        for (ordinal, id) in &r.by_ordinal {
            assert_eq!(r.ordinal_of.get(id), Some(ordinal));
        }
    }
}
