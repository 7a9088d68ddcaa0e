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

use foldhash::{HashMap, HashMapExt, HashSet, HashSetExt};
use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use crate::estimate::{self, Shape};
use crate::events::{EventKind, EventLog, EventsSince};
use crate::lease::{
    Grant, Growth, Outcome, Prompt, Reject, RejectReason, ReleaseResult, ReleaseStatus, SeqSpec,
    Table,
};
use crate::pool::{BlockId, BlockPool, BlockState, Holder, IndexEvent, PoolCounters, PoolCounts};
use crate::prefix;
use crate::session::{BeamTable, BlockRef, PoolTables, SeqState, Session};

/// How a batch of `Lease` or `Extend` is applied.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Batch {
    /// The holder's step (fences and hash publication key on it).
    pub step: u64,
    /// All-or-nothing.
    pub atomic: bool,
    /// Warm-up traffic: not cached, not counted in hit rates (`Lease` only).
    pub warmup: bool,
}

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
}

impl Default for CacheConfig {
    fn default() -> Self {
        Self {
            default_ttl: Duration::from_secs(30),
            min_ttl: Duration::from_secs(1),
            max_ttl: Duration::from_secs(600),
            session_quota: 0,
            event_capacity: 65_536,
            max_pool_blocks: 1 << 24,
            max_beam_width: 64,
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
}

#[derive(Debug)]
struct Group {
    tokens_per_block: u32,
    /// Indices into `Cache::pools`, in registration order.
    pools: Vec<usize>,
}

/// A registered pool, as `RegisterPool` reports it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PoolInfo {
    /// Its id.
    pub pool_id: u32,
    /// Window (0 = full).
    pub window: u32,
    /// Blocks.
    pub num_blocks: u32,
    /// Tokens per block.
    pub tokens_per_block: u32,
}

/// Figures of one pool for `GetStats`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PoolStats {
    /// Its group.
    pub group: String,
    /// Pool and geometry.
    pub info: PoolInfo,
    /// Blocks by state.
    pub counts: PoolCounts,
    /// Counters since start.
    pub counters: PoolCounters,
}

/// Figures of the whole cache.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Stats {
    /// Per pool.
    pub pools: Vec<PoolStats>,
    /// Current epoch.
    pub epoch: u64,
    /// Live sessions.
    pub sessions: u32,
    /// Leased sequences.
    pub sequences: u32,
}

/// A session opened.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Opened {
    /// Its id.
    pub session_id: u64,
    /// The epoch to echo.
    pub epoch: u64,
    /// The TTL granted.
    pub ttl: Duration,
}

/// What closing (or expiring) a session gave back.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Reclaimed {
    /// The session.
    pub session_id: u64,
    /// Sequences it still held.
    pub sequences: u32,
    /// Blocks that returned to circulation.
    pub blocks: u64,
}

/// Estimate of one shape in one pool.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PoolEstimate {
    /// The pool.
    pub pool_id: u32,
    /// Its window.
    pub window: u32,
    /// Blocks over the whole life.
    pub total: u32,
    /// Most held at once.
    pub peak: u32,
    /// Blocks in the pool.
    pub pool_blocks: u32,
}

/// Estimate of one shape.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShapeEstimate {
    /// Per pool of the group.
    pub pools: Vec<PoolEstimate>,
    /// Whether the peak fits every empty pool.
    pub fits: bool,
}

/// A block the audit found unaccounted for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Leak {
    /// The pool.
    pub pool_id: u32,
    /// The block.
    pub block: BlockId,
    /// Who last held it.
    pub last_holder: Holder,
    /// References it had / should have had: (refcount, fences).
    pub found: (u32, u32),
    /// What holders account for.
    pub expected: (u32, u32),
}

/// What an audit did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct AuditReport {
    /// Blocks reconciled.
    pub reclaimed: Vec<Leak>,
    /// Blocks examined.
    pub blocks_checked: u64,
}

/// The cache service's state. Plain, synchronous, single-threaded: the gRPC
/// layer serialises calls through a mutex.
#[derive(Debug)]
pub struct Cache {
    config: CacheConfig,
    epoch: u64,
    groups: HashMap<String, Group>,
    pools: Vec<PoolEntry>,
    sessions: HashMap<u64, Session>,
    next_session: u64,
    events: EventLog,
}

// --- lease planning ---

/// The blocks one new sequence takes from one pool.
#[derive(Clone, Debug)]
struct PoolLease {
    pool: usize,
    /// First block index held.
    first: u32,
    /// Reused published blocks for indices `[first, first + reuse.len())`.
    reuse: Vec<BlockId>,
    /// New blocks shared by the beams (prompt blocks), after the reused ones.
    shared_new: u32,
    /// End of the shared (prompt) blocks.
    shared_end: u32,
    /// One past the last block index.
    end: u32,
}

impl PoolLease {
    fn new_blocks(&self, beams: u32) -> u64 {
        u64::from(self.shared_new) + u64::from(beams) * u64::from(self.per_beam())
    }

    fn per_beam(&self) -> u32 {
        self.end - self.shared_end.max(self.first)
    }

    fn held(&self, beams: u32) -> u64 {
        self.reuse.len() as u64 + self.new_blocks(beams)
    }

    fn references(&self, beams: u32) -> u64 {
        u64::from(beams) * u64::from(self.end - self.first)
    }
}

#[derive(Clone, Debug)]
struct LeasePlan {
    seq_id: u64,
    pools: Vec<PoolLease>,
    /// Full-block hashes of the prompt, when hashable.
    hashes: Vec<u64>,
    reused_tokens: u32,
    prompt_len: u32,
    extra: u32,
    reserved_capacity: u32,
    beams: u32,
    priority: u8,
    salt: u64,
    hashable: bool,
    partial: Vec<u32>,
    group: String,
}

/// The blocks an extend takes from (and slides out of) one pool.
#[derive(Clone, Copy, Debug)]
struct PoolExtend {
    /// Index into the sequence's tables.
    table: usize,
    pool: usize,
    new_first: u32,
    new_end: u32,
    new_blocks: u64,
}

/// Running totals of an atomic batch, per pool.
#[derive(Debug, Default)]
struct Tally {
    new_blocks: HashMap<usize, u64>,
    pinned: HashMap<usize, HashSet<BlockId>>,
    references: u64,
}

fn ceil_div(a: u32, b: u32) -> u32 {
    a.div_ceil(b)
}

impl Cache {
    /// An empty cache with a fresh epoch.
    pub fn new(config: CacheConfig) -> Self {
        Self::with_epoch(config, fresh_epoch())
    }

    /// An empty cache with the given epoch (tests).
    pub fn with_epoch(config: CacheConfig, epoch: u64) -> Self {
        let events = EventLog::new(config.event_capacity);
        Self {
            config,
            epoch,
            groups: HashMap::new(),
            pools: Vec::new(),
            sessions: HashMap::new(),
            next_session: 1,
            events,
        }
    }

    /// The epoch of this start.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// The configuration.
    pub fn config(&self) -> &CacheConfig {
        &self.config
    }

    /// The pools.
    pub fn pools(&self) -> &[PoolEntry] {
        &self.pools
    }

    /// The pool with `pool_id`.
    pub fn pool(&self, pool_id: u32) -> Option<&PoolEntry> {
        self.pools.get((pool_id as usize).checked_sub(1)?)
    }

    // === pools ===

    /// Declares the pools of a group: `(window, num_blocks)` per distinct
    /// window. Returns the pools and whether they were already registered.
    pub fn register_pool(
        &mut self,
        group: &str,
        tokens_per_block: u32,
        pools: &[(u32, u32)],
    ) -> Result<(Vec<PoolInfo>, bool)> {
        if group.is_empty() || group.len() > 128 {
            return Err(Error::InvalidArgument(
                "pool_group must be 1 to 128 characters".into(),
            ));
        }
        if tokens_per_block == 0 || tokens_per_block > 65_536 {
            return Err(Error::InvalidArgument(format!(
                "tokens_per_block must be 1 to 65536, got {tokens_per_block}"
            )));
        }
        if pools.is_empty() || pools.len() > 64 {
            return Err(Error::InvalidArgument(
                "pools must list 1 to 64 window sizes".into(),
            ));
        }
        let mut windows = HashSet::new();
        for &(window, num_blocks) in pools {
            if !windows.insert(window) {
                return Err(Error::InvalidArgument(format!(
                    "window {window} is listed twice"
                )));
            }
            if num_blocks == 0 || num_blocks > self.config.max_pool_blocks {
                return Err(Error::InvalidArgument(format!(
                    "num_blocks of window {window} must be 1 to {}, got {num_blocks}",
                    self.config.max_pool_blocks
                )));
            }
        }
        if let Some(existing) = self.groups.get(group) {
            let have: Vec<(u32, u32)> = existing
                .pools
                .iter()
                .map(|&i| (self.pools[i].window, self.pools[i].pool.len()))
                .collect();
            let mut want_sorted = pools.to_vec();
            want_sorted.sort_unstable();
            let mut have_sorted = have.clone();
            have_sorted.sort_unstable();
            if existing.tokens_per_block != tokens_per_block || want_sorted != have_sorted {
                return Err(Error::GeometryConflict {
                    group: group.to_owned(),
                    detail: format!(
                        "registered tokens_per_block {} and (window, blocks) {have:?}, asked {tokens_per_block} and {pools:?}",
                        existing.tokens_per_block
                    ),
                });
            }
            let infos = pools
                .iter()
                .filter_map(|&(w, _)| {
                    existing
                        .pools
                        .iter()
                        .find(|&&i| self.pools[i].window == w)
                        .map(|&i| self.info(i))
                })
                .collect();
            return Ok((infos, true));
        }
        let mut indices = Vec::with_capacity(pools.len());
        for &(window, num_blocks) in pools {
            let index = self.pools.len();
            self.pools.push(PoolEntry {
                id: index as u32 + 1,
                group: group.to_owned(),
                window,
                tokens_per_block,
                pool: BlockPool::new(num_blocks),
            });
            indices.push(index);
        }
        let infos = indices.iter().map(|&i| self.info(i)).collect();
        self.groups.insert(
            group.to_owned(),
            Group {
                tokens_per_block,
                pools: indices,
            },
        );
        Ok((infos, false))
    }

    fn info(&self, index: usize) -> PoolInfo {
        let p = &self.pools[index];
        PoolInfo {
            pool_id: p.id,
            window: p.window,
            num_blocks: p.pool.len(),
            tokens_per_block: p.tokens_per_block,
        }
    }

    // === sessions ===

    /// Opens a session; `ttl` None picks the default. The TTL is clamped.
    pub fn open_session(
        &mut self,
        holder: &str,
        ttl: Option<Duration>,
        now: Instant,
    ) -> Result<Opened> {
        if holder.is_empty() || holder.len() > 128 {
            return Err(Error::InvalidArgument(
                "holder must be 1 to 128 characters".into(),
            ));
        }
        let ttl = ttl
            .unwrap_or(self.config.default_ttl)
            .clamp(self.config.min_ttl, self.config.max_ttl);
        let id = self.next_session;
        self.next_session += 1;
        self.sessions
            .insert(id, Session::new(id, holder.to_owned(), ttl, now));
        Ok(Opened {
            session_id: id,
            epoch: self.epoch,
            ttl,
        })
    }

    /// Checks a session's id and epoch; reclaims it if it has expired.
    fn touch(&mut self, session_id: u64, epoch: u64, now: Instant) -> Result<()> {
        if epoch != self.epoch {
            return Err(Error::StaleEpoch {
                got: epoch,
                current: self.epoch,
            });
        }
        let session = self
            .sessions
            .get_mut(&session_id)
            .ok_or(Error::UnknownSession(session_id))?;
        if now >= session.expires_at {
            self.reclaim_session(session_id);
            return Err(Error::SessionExpired(session_id));
        }
        session.expires_at = now + session.ttl;
        Ok(())
    }

    /// Renews a session; returns the time left.
    pub fn keep_alive(&mut self, session_id: u64, epoch: u64, now: Instant) -> Result<Duration> {
        self.touch(session_id, epoch, now)?;
        Ok(self
            .sessions
            .get(&session_id)
            .map_or(Duration::ZERO, |s| s.ttl))
    }

    /// Closes a session, reclaiming everything it held.
    pub fn close_session(
        &mut self,
        session_id: u64,
        epoch: u64,
        now: Instant,
    ) -> Result<Reclaimed> {
        self.touch(session_id, epoch, now)?;
        Ok(self.reclaim_session(session_id))
    }

    /// Reclaims every session whose TTL ran out by `now`.
    pub fn expire_sessions(&mut self, now: Instant) -> Vec<Reclaimed> {
        let expired: Vec<u64> = self
            .sessions
            .values()
            .filter(|s| now >= s.expires_at)
            .map(|s| s.id)
            .collect();
        expired
            .into_iter()
            .map(|id| self.reclaim_session(id))
            .collect()
    }

    /// Gives back everything a session holds: live sequences (unfenced: the
    /// holder is gone), parked fences, and unpublished hashes (the steps that
    /// would have written them were never reported complete).
    fn reclaim_session(&mut self, session_id: u64) -> Reclaimed {
        let Some(mut session) = self.sessions.remove(&session_id) else {
            return Reclaimed::default();
        };
        let mut reclaimed = Reclaimed {
            session_id,
            ..Reclaimed::default()
        };
        for (_, seq) in session.seqs.drain() {
            reclaimed.sequences += 1;
            for t in &seq.tables {
                for beam in &t.beams {
                    for &b in &beam.blocks {
                        let pool = &mut self.pools[t.pool].pool;
                        pool.release(b, false);
                        if matches!(pool.state(b), BlockState::Free | BlockState::Cached) {
                            reclaimed.blocks += 1;
                        }
                    }
                }
            }
        }
        for (_, refs) in std::mem::take(&mut session.fences) {
            for r in refs {
                if self.pools[r.pool].pool.unfence(r.block) {
                    reclaimed.blocks += 1;
                }
            }
        }
        self.flush_events();
        reclaimed
    }

    // === lease ===

    /// Leases blocks for new sequences; one outcome per spec, in order.
    pub fn lease(
        &mut self,
        session_id: u64,
        epoch: u64,
        batch: Batch,
        specs: &[SeqSpec],
        now: Instant,
    ) -> Result<Vec<Outcome>> {
        let Batch {
            step,
            atomic,
            warmup,
        } = batch;
        self.touch(session_id, epoch, now)?;
        for spec in specs {
            self.validate_spec(spec)?;
        }
        let holder = |seq| Holder {
            session: session_id,
            seq,
        };
        let mut outcomes: Vec<Option<Outcome>> = vec![None; specs.len()];
        let mut seen = HashSet::new();
        let mut plans: Vec<(usize, LeasePlan)> = Vec::new();
        for (i, spec) in specs.iter().enumerate() {
            let held = self
                .sessions
                .get(&session_id)
                .is_some_and(|s| s.seqs.contains_key(&spec.seq_id));
            if !seen.insert(spec.seq_id) || held {
                outcomes[i] = Some(Outcome::Reject(Reject::plain(
                    spec.seq_id,
                    RejectReason::DuplicateSequence,
                    format!("sequence {} is already leased by this session", spec.seq_id),
                )));
                continue;
            }
            if atomic {
                plans.push((i, self.plan_lease(spec, warmup)));
            } else {
                // One at a time: each plan sees the blocks earlier ones took.
                let plan = self.plan_lease(spec, warmup);
                let outcome = match self.check_lease(session_id, &plan, None) {
                    Ok(()) => Outcome::Grant(self.execute_lease(
                        session_id,
                        plan,
                        step,
                        holder(spec.seq_id),
                    )),
                    Err(reject) => Outcome::Reject(reject),
                };
                self.count_outcome(&outcome, spec);
                outcomes[i] = Some(outcome);
            }
        }
        if atomic {
            let failed = outcomes.iter().position(Option::is_some);
            let mut tally = Tally::default();
            let mut first_reject = failed;
            if first_reject.is_none() {
                for (i, plan) in &plans {
                    if let Err(reject) = self.check_lease(session_id, plan, Some(&mut tally)) {
                        outcomes[*i] = Some(Outcome::Reject(reject));
                        first_reject = Some(*i);
                        break;
                    }
                }
            }
            if let Some(bad) = first_reject {
                let cause = specs[bad].seq_id;
                for (i, spec) in specs.iter().enumerate() {
                    if outcomes[i].is_none() {
                        outcomes[i] = Some(Outcome::Reject(Reject::plain(
                            spec.seq_id,
                            RejectReason::RolledBack,
                            format!("atomic batch rolled back: sequence {cause} was rejected"),
                        )));
                    }
                }
            } else {
                // Pin every reused block first, so no allocation of the batch
                // can evict a block that a later member planned to reuse.
                for (_, plan) in &plans {
                    self.pin_reused(plan, holder(plan.seq_id));
                }
                for (i, plan) in plans {
                    let seq_id = plan.seq_id;
                    let grant = self.execute_lease_pinned(session_id, plan, step, holder(seq_id));
                    outcomes[i] = Some(Outcome::Grant(grant));
                }
            }
            for (outcome, spec) in outcomes.iter().zip(specs) {
                if let Some(o) = outcome {
                    self.count_outcome(o, spec);
                }
            }
        }
        self.flush_events();
        Ok(outcomes.into_iter().flatten().collect())
    }

    fn validate_spec(&self, spec: &SeqSpec) -> Result<()> {
        if !self.groups.contains_key(&spec.group) {
            return Err(Error::UnknownGroup(spec.group.clone()));
        }
        if spec.prompt.is_empty() {
            return Err(Error::InvalidArgument(format!(
                "sequence {}: give prompt_tokens or num_tokens > 0",
                spec.seq_id
            )));
        }
        if spec.beam_width == 0 || spec.beam_width > self.config.max_beam_width {
            return Err(Error::InvalidArgument(format!(
                "sequence {}: beam_width must be 1 to {}, got {}",
                spec.seq_id, self.config.max_beam_width, spec.beam_width
            )));
        }
        if spec.priority > crate::eviction::MAX_PRIORITY {
            return Err(Error::InvalidArgument(format!(
                "sequence {}: priority must be 0 to 100, got {}",
                spec.seq_id, spec.priority
            )));
        }
        let life = u64::from(spec.prompt.len())
            + u64::from(spec.max_new_tokens)
            + u64::from(spec.extra.total());
        if life > u64::from(u32::MAX / 2) {
            return Err(Error::InvalidArgument(format!(
                "sequence {}: prompt + max_new_tokens + extra tokens is too large ({life})",
                spec.seq_id
            )));
        }
        Ok(())
    }

    fn count_outcome(&mut self, outcome: &Outcome, spec: &SeqSpec) {
        let Some(group) = self.groups.get(&spec.group) else {
            return;
        };
        match outcome {
            Outcome::Grant(_) => {
                for &i in &group.pools {
                    self.pools[i].pool.counters.grants += 1;
                }
            }
            Outcome::Reject(r) => {
                let target = group
                    .pools
                    .iter()
                    .copied()
                    .find(|&i| self.pools[i].id == r.pool_id)
                    .or(group.pools.first().copied());
                if let Some(i) = target {
                    self.pools[i].pool.counters.rejects += 1;
                }
            }
        }
    }

    /// Works out what a new sequence would take, without changing anything.
    fn plan_lease(&self, spec: &SeqSpec, warmup: bool) -> LeasePlan {
        let group = &self.groups[&spec.group];
        let b = group.tokens_per_block;
        let prompt_len = spec.prompt.len();
        let extra = spec.extra.total();
        let salt = prefix::salt_hash(&spec.cache_salt);
        let (hashable, hashes, partial) = match (&spec.prompt, warmup) {
            (Prompt::Tokens(tokens), false) => {
                let hashes = prefix::chain(salt, tokens, b as usize);
                let partial = tokens[hashes.len() * b as usize..].to_vec();
                (true, hashes, partial)
            }
            _ => (false, Vec::new(), Vec::new()),
        };
        // Reuse at most the full blocks before the last prompt token, so at
        // least one token is computed (its logits start the output).
        let mut reuse_blocks = if hashable {
            ((prompt_len - 1) / b).min(hashes.len() as u32)
        } else {
            0
        };
        let first_of = |window: u32, r: u32| {
            if window == 0 {
                0
            } else {
                (r * b + 1).saturating_sub(window) / b
            }
        };
        // The longest reusable prefix that every pool can serve: full-attention
        // pools need every block before it, windowed pools only those the
        // first computed token's window reaches.
        'shrink: while reuse_blocks > 0 {
            for &i in &group.pools {
                let entry = &self.pools[i];
                let first = first_of(entry.window, reuse_blocks);
                for idx in (first..reuse_blocks).rev() {
                    if entry.pool.lookup(hashes[idx as usize]).is_none() {
                        reuse_blocks = idx;
                        continue 'shrink;
                    }
                }
            }
            break;
        }
        let capacity = prompt_len + extra;
        let final_len = prompt_len + spec.max_new_tokens.max(1) - 1;
        let reserved_capacity = if spec.reserve_full_life {
            final_len + extra
        } else {
            0
        };
        let end = ceil_div(capacity.max(reserved_capacity), b);
        let shared_end = prompt_len / b;
        let pools = group
            .pools
            .iter()
            .map(|&i| {
                let entry = &self.pools[i];
                let first = first_of(entry.window, reuse_blocks);
                let reuse: Vec<BlockId> = (first..reuse_blocks)
                    .filter_map(|idx| entry.pool.lookup(hashes[idx as usize]))
                    .collect();
                PoolLease {
                    pool: i,
                    first,
                    shared_new: shared_end.saturating_sub(reuse_blocks.max(first)),
                    reuse,
                    shared_end,
                    end,
                }
            })
            .collect();
        LeasePlan {
            seq_id: spec.seq_id,
            pools,
            hashes,
            reused_tokens: reuse_blocks * b,
            prompt_len,
            extra,
            reserved_capacity,
            beams: spec.beam_width,
            priority: spec.priority,
            salt,
            hashable,
            partial,
            group: spec.group.clone(),
        }
    }

    fn pool_reject(
        &self,
        seq_id: u64,
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

    /// Whether a planned lease fits now (and, for an atomic batch, together
    /// with the members before it in `tally`).
    fn check_lease(
        &self,
        session_id: u64,
        plan: &LeasePlan,
        mut tally: Option<&mut Tally>,
    ) -> Result<(), Reject> {
        for p in &plan.pools {
            let entry = &self.pools[p.pool];
            let held = p.held(plan.beams);
            if held > u64::from(entry.pool.len()) {
                return Err(self.pool_reject(
                    plan.seq_id,
                    p.pool,
                    RejectReason::ExceedsCapacity,
                    held,
                    format!(
                        "needs {held} blocks in pool {} (window {}), which has {} in all",
                        entry.id,
                        entry.window,
                        entry.pool.len()
                    ),
                ));
            }
        }
        for p in &plan.pools {
            let entry = &self.pools[p.pool];
            let counts = entry.pool.counts();
            let mut pinned_cached: u64 = p
                .reuse
                .iter()
                .filter(|&&b| entry.pool.state(b) == BlockState::Cached)
                .count() as u64;
            let mut need = p.new_blocks(plan.beams);
            if let Some(t) = tally.as_deref_mut() {
                let pinned = t.pinned.entry(p.pool).or_default();
                pinned_cached = 0;
                for &b in &p.reuse {
                    if entry.pool.state(b) == BlockState::Cached {
                        pinned.insert(b);
                    }
                }
                pinned_cached += pinned.len() as u64;
                let taken = t.new_blocks.entry(p.pool).or_default();
                *taken += need;
                need = *taken;
            }
            let available = u64::from(counts.available()).saturating_sub(pinned_cached);
            if need > available {
                return Err(self.pool_reject(
                    plan.seq_id,
                    p.pool,
                    RejectReason::PoolExhausted,
                    p.new_blocks(plan.beams),
                    format!(
                        "pool {} (window {}) has {available} blocks free or evictable, {need} needed; {} wait on fences",
                        entry.id, entry.window, counts.fenced
                    ),
                ));
            }
        }
        let quota = self.config.session_quota;
        if quota > 0 {
            let mut refs: u64 = plan.pools.iter().map(|p| p.references(plan.beams)).sum();
            if let Some(t) = tally {
                t.references += refs;
                refs = t.references;
            }
            let held = self.sessions.get(&session_id).map_or(0, |s| s.references);
            if held + refs > quota {
                return Err(Reject::plain(
                    plan.seq_id,
                    RejectReason::QuotaExceeded,
                    format!(
                        "session holds {held} block references, {refs} more would pass its quota of {quota}"
                    ),
                ));
            }
        }
        Ok(())
    }

    fn pin_reused(&mut self, plan: &LeasePlan, holder: Holder) {
        for p in &plan.pools {
            let pool = &mut self.pools[p.pool].pool;
            for &b in &p.reuse {
                for _ in 0..plan.beams {
                    pool.acquire(b, holder, plan.priority);
                }
            }
        }
    }

    fn execute_lease(
        &mut self,
        session_id: u64,
        plan: LeasePlan,
        step: u64,
        holder: Holder,
    ) -> Grant {
        self.pin_reused(&plan, holder);
        self.execute_lease_pinned(session_id, plan, step, holder)
    }

    /// Takes the planned blocks (reused ones already pinned). Capacity was
    /// checked, so allocation cannot fail; if it ever did, the sequence keeps
    /// what it got and the audit sees a consistent (shorter) table.
    fn execute_lease_pinned(
        &mut self,
        session_id: u64,
        plan: LeasePlan,
        step: u64,
        holder: Holder,
    ) -> Grant {
        let mut tables = Vec::with_capacity(plan.pools.len());
        let mut pending = Vec::new();
        let mut references = 0;
        for p in &plan.pools {
            let entry = &mut self.pools[p.pool];
            if plan.hashable {
                let b = entry.tokens_per_block;
                let eligible = ((plan.prompt_len - 1) / b).min(plan.hashes.len() as u32);
                entry.pool.counters.reuse_lookups += u64::from(eligible);
                entry.pool.counters.reuse_hits += u64::from(plan.reused_tokens / b);
            }
            let pool = &mut entry.pool;
            let mut shared: Vec<BlockId> = p.reuse.clone();
            let shared_start = p.first + p.reuse.len() as u32;
            for idx in shared_start..shared_start + p.shared_new {
                let Some(block) = pool.allocate(holder, plan.priority) else {
                    break;
                };
                for _ in 1..plan.beams {
                    pool.acquire(block, holder, plan.priority);
                }
                if plan.hashable {
                    let i = idx as usize;
                    let parent = if i == 0 {
                        prefix::ROOT_PARENT
                    } else {
                        plan.hashes[i - 1]
                    };
                    pool.set_pending(block, plan.hashes[i], parent);
                    pending.push(BlockRef {
                        pool: p.pool,
                        block,
                        generation: pool.generation(block),
                    });
                }
                shared.push(block);
            }
            let mut beams = Vec::with_capacity(plan.beams as usize);
            for _ in 0..plan.beams {
                let mut blocks: std::collections::VecDeque<BlockId> =
                    shared.iter().copied().collect();
                for _ in 0..p.per_beam() {
                    match pool.allocate(holder, plan.priority) {
                        Some(b) => blocks.push_back(b),
                        None => break,
                    }
                }
                references += blocks.len() as u64;
                beams.push(BeamTable {
                    first: p.first,
                    blocks,
                });
            }
            tables.push(PoolTables {
                pool: p.pool,
                beams,
            });
        }
        let seq = SeqState {
            group: plan.group,
            len: plan.prompt_len,
            prompt_len: plan.prompt_len,
            extra: plan.extra,
            reserved_capacity: plan.reserved_capacity,
            beams: plan.beams,
            priority: plan.priority,
            salt: plan.salt,
            hashes: plan.hashes,
            partial: plan.partial,
            hashable: plan.hashable && plan.beams == 1,
            tables,
        };
        let grant = self.grant_of(plan.seq_id, &seq, plan.reused_tokens);
        if let Some(session) = self.sessions.get_mut(&session_id) {
            session.references += references;
            session.forget_released(plan.seq_id);
            // A lease at a step already reported complete cannot be known to
            // have written its KV: its hashes are not published.
            if !pending.is_empty() && !session.step_completed(step) {
                session.pending.entry(step).or_default().extend(pending);
            }
            session.seqs.insert(plan.seq_id, seq);
        }
        grant
    }

    fn grant_of(&self, seq_id: u64, seq: &SeqState, reused_tokens: u32) -> Grant {
        grant_of(&self.pools, seq_id, seq, reused_tokens)
    }

    // === extend ===

    /// Grows held sequences; one outcome per item, in order.
    pub fn extend(
        &mut self,
        session_id: u64,
        epoch: u64,
        batch: Batch,
        items: &[(u64, Growth)],
        now: Instant,
    ) -> Result<Vec<Outcome>> {
        let Batch { step, atomic, .. } = batch;
        self.touch(session_id, epoch, now)?;
        for (seq_id, growth) in items {
            if growth.is_empty() {
                return Err(Error::InvalidArgument(format!(
                    "sequence {seq_id}: give new_tokens or num_tokens > 0"
                )));
            }
        }
        let mut seen = HashSet::with_capacity(items.len());
        let duplicate = |seq_id: u64| {
            Outcome::Reject(Reject::plain(
                seq_id,
                RejectReason::DuplicateSequence,
                format!("sequence {seq_id} is named twice in one extend"),
            ))
        };
        if !atomic {
            // Per-sequence all-or-nothing: plan, check and execute each in
            // turn, reusing one plan buffer (a decode step's Extend carries
            // hundreds of sequences).
            let mut outcomes = Vec::with_capacity(items.len());
            let mut plan = Vec::new();
            for (seq_id, growth) in items {
                let outcome = if !seen.insert(*seq_id) {
                    duplicate(*seq_id)
                } else {
                    match self.plan_extend(session_id, *seq_id, growth.len(), &mut plan) {
                        Err(reject) => Outcome::Reject(reject),
                        Ok(()) => {
                            let outcome = match self.check_extend(*seq_id, &plan, None) {
                                Ok(()) => Outcome::Grant(
                                    self.execute_extend(session_id, *seq_id, growth, &plan, step),
                                ),
                                Err(reject) => Outcome::Reject(reject),
                            };
                            self.count_extend(&outcome, &plan);
                            outcome
                        }
                    }
                };
                outcomes.push(outcome);
            }
            self.flush_events();
            return Ok(outcomes);
        }
        let mut outcomes: Vec<Option<Outcome>> = vec![None; items.len()];
        let mut plans = Vec::new();
        for (i, (seq_id, growth)) in items.iter().enumerate() {
            if !seen.insert(*seq_id) {
                outcomes[i] = Some(duplicate(*seq_id));
                continue;
            }
            let mut plan = Vec::new();
            match self.plan_extend(session_id, *seq_id, growth.len(), &mut plan) {
                Ok(()) => plans.push((i, plan)),
                Err(reject) => outcomes[i] = Some(Outcome::Reject(reject)),
            }
        }
        let mut first_reject = outcomes.iter().position(Option::is_some);
        if first_reject.is_none() {
            let mut tally = Tally::default();
            for (i, plan) in &plans {
                if let Err(reject) = self.check_extend(items[*i].0, plan, Some(&mut tally)) {
                    outcomes[*i] = Some(Outcome::Reject(reject));
                    first_reject = Some(*i);
                    break;
                }
            }
        }
        if let Some(bad) = first_reject {
            let cause = items[bad].0;
            for (i, (seq_id, _)) in items.iter().enumerate() {
                if outcomes[i].is_none() {
                    outcomes[i] = Some(Outcome::Reject(Reject::plain(
                        *seq_id,
                        RejectReason::RolledBack,
                        format!("atomic batch rolled back: sequence {cause} was rejected"),
                    )));
                }
            }
        } else {
            for (i, plan) in &plans {
                let (seq_id, growth) = &items[*i];
                outcomes[*i] = Some(Outcome::Grant(
                    self.execute_extend(session_id, *seq_id, growth, plan, step),
                ));
            }
        }
        for (i, plan) in &plans {
            if let Some(o) = &outcomes[*i] {
                self.count_extend(o, plan);
            }
        }
        self.flush_events();
        Ok(outcomes.into_iter().flatten().collect())
    }

    fn count_extend(&mut self, outcome: &Outcome, plan: &[PoolExtend]) {
        match outcome {
            Outcome::Grant(_) => {}
            Outcome::Reject(r) => {
                if let Some(p) = plan.iter().find(|p| self.pools[p.pool].id == r.pool_id) {
                    self.pools[p.pool].pool.counters.rejects += 1;
                }
            }
        }
    }

    /// The per-pool plan of growing `seq_id` by `n` tokens, into `plan`.
    fn plan_extend(
        &self,
        session_id: u64,
        seq_id: u64,
        n: u32,
        plan: &mut Vec<PoolExtend>,
    ) -> Result<(), Reject> {
        let seq = self
            .sessions
            .get(&session_id)
            .and_then(|s| s.seqs.get(&seq_id))
            .ok_or_else(|| {
                Reject::plain(
                    seq_id,
                    RejectReason::UnknownSequence,
                    format!("sequence {seq_id} is not leased by this session"),
                )
            })?;
        let new_len = seq.len.saturating_add(n);
        let capacity = new_len.saturating_add(seq.extra).max(seq.reserved_capacity);
        plan.clear();
        plan.extend(seq.tables.iter().enumerate().map(|(ti, t)| {
            let entry = &self.pools[t.pool];
            let b = entry.tokens_per_block;
            let (first, end) = t.beams.first().map_or((0, 0), |bt| (bt.first, bt.end()));
            let new_first = if entry.window == 0 {
                first
            } else {
                first.max((seq.len + 1).saturating_sub(entry.window) / b)
            };
            let new_end = end.max(ceil_div(capacity, b));
            PoolExtend {
                table: ti,
                pool: t.pool,
                new_first,
                new_end,
                new_blocks: u64::from(seq.beams) * u64::from(new_end - end),
            }
        }));
        Ok(())
    }

    fn check_extend(
        &self,
        seq_id: u64,
        plan: &[PoolExtend],
        mut tally: Option<&mut Tally>,
    ) -> Result<(), Reject> {
        for p in plan {
            let entry = &self.pools[p.pool];
            // Blocks sliding out are fenced: they do not help this extend.
            let held_after = u64::from(p.new_end - p.new_first);
            if held_after > u64::from(entry.pool.len()) {
                return Err(self.pool_reject(
                    seq_id,
                    p.pool,
                    RejectReason::ExceedsCapacity,
                    held_after,
                    format!(
                        "would hold {held_after} blocks in pool {} (window {}), which has {} in all",
                        entry.id,
                        entry.window,
                        entry.pool.len()
                    ),
                ));
            }
            let mut need = p.new_blocks;
            if let Some(t) = tally.as_deref_mut() {
                let taken = t.new_blocks.entry(p.pool).or_default();
                *taken += need;
                need = *taken;
            }
            let counts = entry.pool.counts();
            if need > u64::from(counts.available()) {
                return Err(self.pool_reject(
                    seq_id,
                    p.pool,
                    RejectReason::PoolExhausted,
                    p.new_blocks,
                    format!(
                        "pool {} (window {}) has {} blocks free or evictable, {need} needed; {} wait on fences",
                        entry.id,
                        entry.window,
                        counts.available(),
                        counts.fenced
                    ),
                ));
            }
        }
        Ok(())
    }

    fn execute_extend(
        &mut self,
        session_id: u64,
        seq_id: u64,
        growth: &Growth,
        plan: &[PoolExtend],
        step: u64,
    ) -> Grant {
        let Some(session) = self.sessions.get_mut(&session_id) else {
            return Grant {
                seq_id,
                tables: Vec::new(),
                reused_tokens: 0,
                capacity_tokens: 0,
            };
        };
        let fence_done = session.step_completed(step);
        let Some(seq) = session.seqs.get_mut(&seq_id) else {
            return Grant {
                seq_id,
                tables: Vec::new(),
                reused_tokens: 0,
                capacity_tokens: 0,
            };
        };
        let holder = Holder {
            session: session_id,
            seq: seq_id,
        };
        let mut fenced = Vec::new();
        let mut added: i64 = 0;
        // The grant of an extend is a delta: per (pool, beam) the new first
        // block and only the blocks appended now.
        let mut tables = Vec::new();
        for p in plan {
            let entry = &mut self.pools[p.pool];
            let (pool_id, window) = (entry.id, entry.window);
            let pool = &mut entry.pool;
            let t = &mut seq.tables[p.table];
            for (beam, bt) in t.beams.iter_mut().enumerate() {
                let mut appended = Vec::new();
                let old_first = bt.first;
                while bt.first < p.new_first {
                    let Some(block) = bt.blocks.pop_front() else {
                        break;
                    };
                    bt.first += 1;
                    added -= 1;
                    pool.release(block, !fence_done);
                    if !fence_done {
                        fenced.push(BlockRef {
                            pool: p.pool,
                            block,
                            generation: pool.generation(block),
                        });
                    }
                }
                if bt.blocks.is_empty() {
                    bt.first = p.new_first;
                }
                while bt.end() < p.new_end {
                    match pool.allocate(holder, seq.priority) {
                        Some(block) => {
                            bt.blocks.push_back(block);
                            appended.push(block);
                            added += 1;
                        }
                        None => break,
                    }
                }
                // A table this call left alone (no slide, no new block) is
                // left out: most decode steps change no table at all.
                if bt.first != old_first || !appended.is_empty() {
                    tables.push(Table {
                        pool_id,
                        window,
                        beam: beam as u32,
                        first_block: bt.first,
                        block_ids: appended,
                    });
                }
            }
        }
        seq.len = seq.len.saturating_add(growth.len());
        // Hash the blocks the new tokens fill; they publish once this step
        // completes (its forward pass writes them).
        let mut pending = Vec::new();
        match growth {
            Growth::Tokens(tokens) if seq.hashable => {
                seq.partial.extend_from_slice(tokens);
                let b = self.pools[seq.tables[0].pool].tokens_per_block as usize;
                while seq.partial.len() >= b {
                    let parent = seq.hashes.last().copied().unwrap_or(prefix::ROOT_PARENT);
                    let hash = prefix::block_hash(parent, seq.salt, &seq.partial[..b]);
                    let idx = seq.hashes.len() as u32;
                    seq.hashes.push(hash);
                    seq.partial.drain(..b);
                    for t in &seq.tables {
                        let bt = &t.beams[0];
                        if idx >= bt.first && idx < bt.end() {
                            let block = bt.blocks[(idx - bt.first) as usize];
                            let pool = &mut self.pools[t.pool].pool;
                            pool.set_pending(block, hash, parent);
                            pending.push(BlockRef {
                                pool: t.pool,
                                block,
                                generation: pool.generation(block),
                            });
                        }
                    }
                }
            }
            Growth::Tokens(_) => {}
            Growth::Count(_) => {
                seq.hashable = false;
                seq.partial.clear();
            }
        }
        let grant = Grant {
            seq_id,
            tables,
            reused_tokens: 0,
            capacity_tokens: seq.capacity(),
        };
        session.references = (session.references as i64 + added).max(0) as u64;
        if !fenced.is_empty() {
            session.fences.entry(step).or_default().extend(fenced);
        }
        if !pending.is_empty() && !fence_done {
            session.pending.entry(step).or_default().extend(pending);
        }
        grant
    }

    // === release and fences ===

    /// Releases sequences, optionally fenced at a step.
    pub fn release(
        &mut self,
        session_id: u64,
        epoch: u64,
        seq_ids: &[u64],
        fence_step: Option<u64>,
        now: Instant,
    ) -> Result<Vec<ReleaseResult>> {
        self.touch(session_id, epoch, now)?;
        let Some(session) = self.sessions.get_mut(&session_id) else {
            return Err(Error::UnknownSession(session_id));
        };
        let fence = fence_step.filter(|&s| !session.step_completed(s));
        let mut results = Vec::with_capacity(seq_ids.len());
        for &seq_id in seq_ids {
            let Some(seq) = session.seqs.remove(&seq_id) else {
                let status = if session.was_released(seq_id) {
                    ReleaseStatus::AlreadyReleased
                } else {
                    ReleaseStatus::Unknown
                };
                results.push(ReleaseResult {
                    seq_id,
                    status,
                    blocks_freed: 0,
                    blocks_fenced: 0,
                });
                continue;
            };
            let mut result = ReleaseResult {
                seq_id,
                status: ReleaseStatus::Released,
                blocks_freed: 0,
                blocks_fenced: 0,
            };
            let mut fenced = Vec::new();
            for t in &seq.tables {
                let pool = &mut self.pools[t.pool].pool;
                for bt in &t.beams {
                    for &block in &bt.blocks {
                        pool.release(block, fence.is_some());
                        if pool.refs(block).0 == 0 {
                            if fence.is_some() {
                                result.blocks_fenced += 1;
                            } else {
                                result.blocks_freed += 1;
                            }
                        }
                        if fence.is_some() {
                            fenced.push(BlockRef {
                                pool: t.pool,
                                block,
                                generation: pool.generation(block),
                            });
                        }
                    }
                }
            }
            session.references = session.references.saturating_sub(seq.references());
            if let Some(step) = fence
                && !fenced.is_empty()
            {
                session.fences.entry(step).or_default().extend(fenced);
            }
            session.remember_released(seq_id);
            results.push(result);
        }
        self.flush_events();
        Ok(results)
    }

    /// The holder finished `step`: publish the hashes its forward pass wrote,
    /// then lift the fences at steps <= it. Returns the blocks that left the
    /// fenced state.
    pub fn complete_step(
        &mut self,
        session_id: u64,
        epoch: u64,
        step: u64,
        now: Instant,
    ) -> Result<u64> {
        self.touch(session_id, epoch, now)?;
        let Some(session) = self.sessions.get_mut(&session_id) else {
            return Err(Error::UnknownSession(session_id));
        };
        session.completed_step = Some(session.completed_step.map_or(step, |s| s.max(step)));
        let later_pending = session.pending.split_off(&(step + 1));
        let due_pending = std::mem::replace(&mut session.pending, later_pending);
        let later_fences = session.fences.split_off(&(step + 1));
        let due_fences = std::mem::replace(&mut session.fences, later_fences);
        for r in due_pending.into_values().flatten() {
            self.pools[r.pool].pool.publish(r.block, r.generation);
        }
        let mut returned = 0;
        for r in due_fences.into_values().flatten() {
            if self.pools[r.pool].pool.unfence(r.block) {
                returned += 1;
            }
        }
        self.flush_events();
        Ok(returned)
    }

    // === estimates, stats, events, audit ===

    /// Blocks each shape needs in every pool of its group over its life.
    pub fn estimate(&self, specs: &[SeqSpec]) -> Result<Vec<ShapeEstimate>> {
        specs
            .iter()
            .map(|spec| {
                self.validate_spec(spec)?;
                let group = &self.groups[&spec.group];
                let shape = Shape {
                    prompt: spec.prompt.len(),
                    max_new_tokens: spec.max_new_tokens,
                    extra: spec.extra.total(),
                    beam_width: spec.beam_width,
                };
                let pools: Vec<PoolEstimate> = group
                    .pools
                    .iter()
                    .map(|&i| {
                        let entry = &self.pools[i];
                        let need = estimate::pool_need(shape, entry.window, entry.tokens_per_block);
                        PoolEstimate {
                            pool_id: entry.id,
                            window: entry.window,
                            total: need.total,
                            peak: if spec.reserve_full_life {
                                need.total
                            } else {
                                need.peak
                            },
                            pool_blocks: entry.pool.len(),
                        }
                    })
                    .collect();
                let fits = pools.iter().all(|p| p.peak <= p.pool_blocks);
                Ok(ShapeEstimate { pools, fits })
            })
            .collect()
    }

    /// Pool figures, optionally for one group.
    pub fn stats(&self, group: Option<&str>) -> Result<Stats> {
        if let Some(g) = group
            && !self.groups.contains_key(g)
        {
            return Err(Error::UnknownGroup(g.to_owned()));
        }
        let pools = self
            .pools
            .iter()
            .enumerate()
            .filter(|(_, p)| group.is_none_or(|g| p.group == g))
            .map(|(i, p)| PoolStats {
                group: p.group.clone(),
                info: self.info(i),
                counts: p.pool.counts(),
                counters: p.pool.counters,
            })
            .collect();
        Ok(Stats {
            pools,
            epoch: self.epoch,
            sessions: self.sessions.len() as u32,
            sequences: self.sessions.values().map(|s| s.seqs.len() as u32).sum(),
        })
    }

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
            let kinds = raw
                .into_iter()
                .map(|e| match e {
                    IndexEvent::Stored { hash, parent } => EventKind::Stored {
                        hashes: vec![hash],
                        parent,
                    },
                    IndexEvent::Removed { hash } => EventKind::Removed { hashes: vec![hash] },
                })
                .collect();
            self.events.push_batch(entry.id, kinds);
        }
    }

    /// What holders account for, per pool and block: (refcount, fences).
    fn expected_refs(&self) -> Vec<Vec<(u32, u32)>> {
        let mut expected: Vec<Vec<(u32, u32)>> = self
            .pools
            .iter()
            .map(|p| vec![(0, 0); p.pool.len() as usize])
            .collect();
        for session in self.sessions.values() {
            for seq in session.seqs.values() {
                for t in &seq.tables {
                    for bt in &t.beams {
                        for &b in &bt.blocks {
                            expected[t.pool][b as usize].0 += 1;
                        }
                    }
                }
            }
            for r in session.fences.values().flatten() {
                expected[r.pool][r.block as usize].1 += 1;
            }
        }
        expected
    }

    /// Finds blocks whose references no lease or fence accounts for and sets
    /// them right (a block held by nobody returns to circulation). Never
    /// aborts; each finding is logged with its last holder.
    pub fn audit(&mut self) -> AuditReport {
        let expected = self.expected_refs();
        let mut report = AuditReport::default();
        for (i, entry) in self.pools.iter_mut().enumerate() {
            for block in 0..entry.pool.len() {
                report.blocks_checked += 1;
                let want = expected[i][block as usize];
                let found = entry.pool.refs(block);
                if found != want && entry.pool.reconcile(block, want.0, want.1) {
                    let leak = Leak {
                        pool_id: entry.id,
                        block,
                        last_holder: entry.pool.last_holder(block),
                        found,
                        expected: want,
                    };
                    tracing::warn!(
                        pool_id = leak.pool_id,
                        block,
                        last_session = leak.last_holder.session,
                        last_seq = leak.last_holder.seq,
                        found_refs = found.0,
                        found_fences = found.1,
                        expected_refs = want.0,
                        expected_fences = want.1,
                        "leak audit reconciled a block"
                    );
                    entry.pool.counters.leaks_reclaimed += 1;
                    report.reclaimed.push(leak);
                }
            }
        }
        self.flush_events();
        report
    }

    /// Checks every pool's invariants and that every block's references are
    /// exactly those its holders account for (no leak, no double grant).
    pub fn check_invariants(&self) -> Result<(), String> {
        let expected = self.expected_refs();
        for (i, entry) in self.pools.iter().enumerate() {
            entry
                .pool
                .check_invariants()
                .map_err(|e| format!("pool {}: {e}", entry.id))?;
            for block in 0..entry.pool.len() {
                let found = entry.pool.refs(block);
                let want = expected[i][block as usize];
                if found != want {
                    return Err(format!(
                        "pool {} block {block}: refs {found:?}, holders account for {want:?}",
                        entry.id
                    ));
                }
            }
        }
        for session in self.sessions.values() {
            let refs: u64 = session.seqs.values().map(SeqState::references).sum();
            if refs != session.references {
                return Err(format!(
                    "session {} counts {} references, its sequences hold {refs}",
                    session.id, session.references
                ));
            }
            for (seq_id, seq) in &session.seqs {
                for t in &seq.tables {
                    let entry = &self.pools[t.pool];
                    // No double grant: a block this sequence will still write
                    // (holding position `len` or later) is held by it alone;
                    // full blocks before it are read-only and may be shared.
                    for bt in &t.beams {
                        for (k, &b) in bt.blocks.iter().enumerate() {
                            let idx = bt.first + k as u32;
                            let writable = idx >= seq.len / entry.tokens_per_block;
                            let (refs, _) = entry.pool.refs(b);
                            // A writable index is past the prompt, so it
                            // is never one of the beams' shared blocks.
                            if writable && refs != 1 {
                                return Err(format!(
                                    "sequence {seq_id} block index {idx} (pool {}, block {b}) is writable but has {refs} holders",
                                    entry.id
                                ));
                            }
                        }
                    }
                }
            }
        }
        Ok(())
    }

    /// Takes a block that no holder records, as a bug would (tests of the
    /// audit).
    #[cfg(test)]
    pub(crate) fn leak_for_test(&mut self, pool_id: u32) -> Option<BlockId> {
        let holder = Holder {
            session: 99,
            seq: 42,
        };
        self.pools
            .get_mut(pool_id as usize - 1)?
            .pool
            .allocate(holder, 0)
    }

    /// The session's view of a sequence: (len, tables per pool as (first, blocks)).
    pub fn sequence_tables(
        &self,
        session_id: u64,
        seq_id: u64,
    ) -> Option<Vec<(u32, u32, Vec<BlockId>)>> {
        let seq = self.sessions.get(&session_id)?.seqs.get(&seq_id)?;
        Some(
            seq.tables
                .iter()
                .map(|t| {
                    let bt = &t.beams[0];
                    (
                        self.pools[t.pool].window,
                        bt.first,
                        bt.blocks.iter().copied().collect(),
                    )
                })
                .collect(),
        )
    }
}

/// The grant describing `seq`'s current tables.
fn grant_of(pools: &[PoolEntry], seq_id: u64, seq: &SeqState, reused_tokens: u32) -> Grant {
    let mut tables = Vec::with_capacity(seq.tables.len() * seq.beams as usize);
    for t in &seq.tables {
        let entry = &pools[t.pool];
        for (beam, bt) in t.beams.iter().enumerate() {
            tables.push(Table {
                pool_id: entry.id,
                window: entry.window,
                beam: beam as u32,
                first_block: bt.first,
                block_ids: bt.blocks.iter().copied().collect(),
            });
        }
    }
    Grant {
        seq_id,
        tables,
        reused_tokens,
        capacity_tokens: seq.capacity(),
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
