//! `Lease`: plan what a new sequence takes from each pool of its group
//! (reusing published prefix blocks), check that it fits (alone, or with the
//! members of its atomic batch before it), then pin the reused blocks and
//! take the new ones.
//!
//! Partial-block reuse: after the reused full blocks, the prompt's next
//! tokens may match the leading tokens of a kept partly filled block (the
//! end of an earlier turn). The source is pinned like a reused block, then
//! fenced at the lease's step, and the grant tells the holder to copy the
//! matching slots into the sequence's own block at that index.
//!
//! Forks (`SeqSpec::fork_of`): a branch of a held sequence (parallel
//! samples, beams) reuses the parent's live blocks instead of published
//! ones: every block wholly before the branch's last prompt token by
//! reference, and the block holding that token by a partial-block copy of
//! the parent's leading slots into the branch's own block (copy on write:
//! the branch's first pass writes its last prompt token there, where the
//! branches diverge). The source is pinned and fenced at the lease's step
//! as for any copy, so the parent may end at once. A parent that cannot
//! give those blocks leaves the branch an ordinary lease.

use foldhash::{HashSet, HashSetExt};
use std::time::Instant;

use super::{Batch, Cache, PoolEntry, Tally, ceil_div};
use crate::error::{Error, Result};
use crate::events::Tier;
use crate::ids::{BlockId, Epoch, SeqId, SessionId, Step};
use crate::lease::{
    BlockCopy, Grant, MAX_RETAIN_TENANT_BYTES, MAX_RETAIN_TTL, Outcome, Prompt, Reject,
    RejectReason, Retain, SeqSpec, Table, TierCopy, TierDirection,
};
use crate::peer::{self, PeerCopy, PeerDecision};
use crate::pool::{BlockState, Holder};
use crate::prefix;
use crate::session::{BeamTable, BlockRef, HostRef, PoolTables, SeqState};
use crate::tier::HostBlockId;

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
    /// A kept partly filled block to copy from, into the block after the
    /// reused and onboarded ones.
    copy_src: Option<BlockId>,
    /// Host (or disk) blocks to onboard, for the indices after the reused
    /// ones: each gets a new device block and a copy.
    onboard: Vec<(Tier, HostBlockId)>,
    /// Peer pull: the peer's pool (an index into the cache's pools) and
    /// its blocks for the indices after the onboarded ones: each gets a
    /// new block and a peer copy.
    peer_pool: usize,
    peer: Vec<BlockId>,
    /// A hand-off's partly filled last block in the peer's pool, copied
    /// by its leading `LeasePlan::peer_last_tokens` slots into the block
    /// after the `peer` ones.
    peer_last: Option<BlockId>,
}

impl PoolLease {
    fn new_blocks(&self, beams: u32) -> u64 {
        self.onboard.len() as u64
            + self.peer.len() as u64
            + u64::from(self.shared_new)
            + u64::from(beams) * u64::from(self.per_beam())
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

    /// Existing blocks the lease pins: reused ones and the copy source.
    fn pinned(&self) -> impl Iterator<Item = BlockId> + '_ {
        self.reuse.iter().copied().chain(self.copy_src)
    }
}

#[derive(Clone, Debug)]
struct LeasePlan {
    seq_id: SeqId,
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
    /// Slots copied from each pool's `copy_src` (0: no copy).
    copy_tokens: u32,
    /// Prompt tokens the lease's step writes (reused ones included): full
    /// prompt blocks ending after it are held back (chunked prefill).
    written: u32,
    /// A fork: the reused blocks and the copy source are the parent's.
    fork: bool,
    /// The peer group the `peer` blocks come from, and what the cost
    /// model weighed (pulled or not).
    peer_group: String,
    peer_decision: Option<PeerDecision>,
    /// Slots of each pool's `peer_last` to copy.
    peer_last_tokens: u32,
}

/// What a fork takes from its parent: the blocks wholly before the
/// branch's last prompt token and the slots of the block holding it.
#[derive(Clone, Debug)]
struct ForkSource {
    /// Full blocks shared (block indices below it).
    reuse_blocks: u32,
    /// Leading slots of block `reuse_blocks` copied (0: no copy).
    copy_tokens: u32,
    /// Per pool of the group, in order: the parent's blocks from the
    /// pool's first held index to `reuse_blocks`, and the copy source.
    pools: Vec<(Vec<BlockId>, Option<BlockId>)>,
}

impl Cache {
    /// Leases blocks for new sequences; one outcome per spec, in order.
    /// Every spec must name a group the session's principal registered:
    /// one that does not fails the whole call with
    /// [`Error::GroupNotOwned`], nothing taken.
    pub fn lease(
        &mut self,
        session_id: SessionId,
        epoch: Epoch,
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
        if !warmup
            && let Some(completed) = self
                .sessions
                .get(&session_id)
                .and_then(|s| s.completed_step)
                .filter(|&done| step <= done)
        {
            return Err(Error::StepAlreadyCompleted { step, completed });
        }
        // Every sequence's group is its session principal's, or the whole
        // call is refused before anything is taken: an authorization
        // failure is a status, not a per-sequence reject.
        let principal = self.session_principal(session_id)?;
        for spec in specs {
            self.validate_spec(spec)?;
            self.validate_fork(session_id, spec)?;
            self.validate_handoff(session_id, spec)?;
            self.owned_group(&spec.group, &principal, "lease")?;
        }
        if let Some(session) = self.sessions.get_mut(&session_id) {
            for spec in specs {
                session.leases_in(&spec.group);
            }
        }
        // A fork's parent must be held before the call (a parent leased in
        // it has written nothing a branch could share, and was not checked).
        // Likewise a hand-off's source.
        let held_before = |seq: Option<SeqId>| {
            seq.is_none_or(|p| {
                self.sessions
                    .get(&session_id)
                    .is_some_and(|s| s.seqs.contains_key(&p))
            })
        };
        let parent_held: Vec<bool> = specs.iter().map(|s| held_before(s.fork_of)).collect();
        let source_held: Vec<bool> = specs.iter().map(|s| held_before(s.handoff_of)).collect();
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
            if let Some(parent) = spec.fork_of.filter(|_| !parent_held[i]) {
                outcomes[i] = Some(Outcome::Reject(Reject::plain(
                    spec.seq_id,
                    RejectReason::UnknownSequence,
                    format!(
                        "sequence {}: fork_of {parent} is not leased by this session",
                        spec.seq_id
                    ),
                )));
                continue;
            }
            if let Some(source) = spec.handoff_of.filter(|_| !source_held[i]) {
                outcomes[i] = Some(Outcome::Reject(Reject::plain(
                    spec.seq_id,
                    RejectReason::UnknownSequence,
                    format!(
                        "sequence {}: handoff_of {source} is not leased by this session",
                        spec.seq_id
                    ),
                )));
                continue;
            }
            if atomic {
                plans.push((i, self.plan_lease(session_id, spec, warmup)));
            } else {
                // One at a time: each plan sees the blocks earlier ones took.
                let plan = self.plan_lease(session_id, spec, warmup);
                let outcome = match self.check_lease(session_id, &plan, None) {
                    Ok(()) => Outcome::Grant(self.noting_evictions(spec.seq_id, |c| {
                        c.execute_lease(session_id, plan, step, holder(spec.seq_id))
                    })),
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
                    let grant = self.noting_evictions(seq_id, |c| {
                        c.execute_lease_pinned(session_id, plan, step, holder(seq_id))
                    });
                    outcomes[i] = Some(Outcome::Grant(grant));
                }
            }
            for (outcome, spec) in outcomes.iter().zip(specs) {
                if let Some(o) = outcome {
                    self.count_outcome(o, spec);
                }
            }
        }
        let mut outcomes: Vec<Outcome> = outcomes.into_iter().flatten().collect();
        for (outcome, spec) in outcomes.iter_mut().zip(specs) {
            if let (Outcome::Grant(grant), Some(retain)) = (outcome, &spec.retain) {
                let tenant = if retain.tenant.is_empty() {
                    &*principal
                } else {
                    &retain.tenant
                };
                grant.retained_tokens = self.retain(session_id, spec.seq_id, retain, tenant, now);
            }
        }
        self.flush_events();
        Ok(outcomes)
    }

    /// Puts the full blocks of `retain.tokens` leading prompt tokens of the
    /// just-granted `seq_id` under `tenant`'s hint, in order, as far as the
    /// tenant's quota has room in each pool; returns the tokens covered.
    fn retain(
        &mut self,
        session_id: SessionId,
        seq_id: SeqId,
        retain: &Retain,
        tenant: &str,
        now: Instant,
    ) -> u32 {
        let Some(seq) = self
            .sessions
            .get(&session_id)
            .and_then(|s| s.seqs.get(&seq_id))
        else {
            return 0;
        };
        let expires = now + retain.ttl;
        let mut covered = None::<u32>;
        for t in &seq.tables {
            let entry = &mut self.pools[t.pool];
            let b = entry.tokens_per_block;
            let want = retain.tokens.min(seq.len) / b;
            let Some(beam) = t.beams.first() else {
                continue;
            };
            // blocks before `first` slid out of this pool's window
            let mut end = beam.first.min(want);
            for (idx, &block) in (beam.first..want).zip(&beam.blocks) {
                let pool = &mut entry.pool;
                if !pool.retention().is_hinted(block) && pool.retention().room(tenant) == 0 {
                    break;
                }
                pool.hint(block, tenant, retain.priority, expires);
                end = idx + 1;
            }
            covered = Some(covered.map_or(end * b, |c| c.min(end * b)));
        }
        covered.unwrap_or(0)
    }

    pub(super) fn validate_spec(&self, spec: &SeqSpec) -> Result<()> {
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
        if let Some(r) = &spec.retain {
            validate_retain(spec.seq_id, r, spec.prompt.len())?;
        }
        if let Some(r) = &spec.peer_pull {
            for (field, rate) in [
                ("link_bytes_per_s", r.link_bytes_per_s),
                ("prefill_tokens_per_s", r.prefill_tokens_per_s),
            ] {
                if rate == 0 {
                    return Err(Error::InvalidArgument(format!(
                        "sequence {}: peer_pull.{field} must be greater than 0",
                        spec.seq_id
                    )));
                }
            }
        }
        if spec.prefill_tokens > spec.prompt.len() {
            return Err(Error::InvalidArgument(format!(
                "sequence {}: prefill_tokens {} is beyond its prompt of {} tokens",
                spec.seq_id,
                spec.prefill_tokens,
                spec.prompt.len()
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
    fn plan_lease(&self, session_id: SessionId, spec: &SeqSpec, warmup: bool) -> LeasePlan {
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
        let fork = match warmup {
            false => self.fork_source(session_id, spec),
            true => None,
        };
        let handoff = match warmup {
            false => self.handoff_source(session_id, spec),
            true => None,
        };
        // the device prefix, then what the host tier adds after it (a
        // hand-off pulls all of it instead)
        let (local_reuse, device_end) = match &fork {
            Some(f) => (f.reuse_blocks, vec![f.reuse_blocks; group.pools.len()]),
            None if hashable && handoff.is_none() => {
                self.reusable_blocks(group, &hashes, prompt_len)
            }
            None => (0, vec![0; group.pools.len()]),
        };
        // then what a peer group's device adds after that, when pulling it
        // costs less than computing it (always, for a hand-off)
        let mut peer_decision = None;
        let mut peer_run = None;
        if let Some(h) = &handoff {
            peer_decision = Some(h.decision.clone());
            peer_run = Some(h.run.clone());
        } else if let (Some(rates), None, true) = (&spec.peer_pull, &fork, hashable) {
            let most = (prompt_len.saturating_sub(1) / b).min(hashes.len() as u32);
            if let Some(run) = self.peer_run(&spec.group, group, &hashes, local_reuse, most) {
                let d = peer::decide(rates, &run.group, run.end - local_reuse, run.bytes, b);
                if d.pulled {
                    peer_run = Some(run);
                }
                peer_decision = Some(d);
            }
        }
        let reuse_blocks = peer_run.as_ref().map_or(local_reuse, |r| r.end);
        let first_of = |window: u32, r: u32| super::matching::first_block(window, r, b);
        let copy = match (&fork, &spec.prompt) {
            (Some(f), _) => f
                .pools
                .iter()
                .map(|p| p.1)
                .collect::<Option<Vec<BlockId>>>()
                .filter(|_| f.copy_tokens > 0)
                .map(|sources| (f.copy_tokens, sources)),
            (None, Prompt::Tokens(tokens))
                if hashable && spec.beam_width == 1 && handoff.is_none() =>
            {
                self.plan_copy(group, tokens, &hashes, salt, reuse_blocks)
            }
            _ => None,
        };
        let copy_tokens = copy.as_ref().map_or(0, |c| c.0);
        let capacity = prompt_len + extra;
        let final_len = prompt_len + spec.max_new_tokens.max(1) - 1;
        let reserved_capacity = if spec.reserve_full_life {
            final_len + extra
        } else {
            0
        };
        let end = ceil_div(capacity.max(reserved_capacity), b);
        // Beams share the blocks wholly before the last prompt token: each
        // computes that token itself, so its first sample is its own (as a
        // fork does). One beam holds its full prompt blocks as shared ones
        // (they are hashed and published).
        let shared_end = if spec.beam_width > 1 {
            (prompt_len - 1) / b
        } else {
            prompt_len / b
        };
        let pools = group
            .pools
            .iter()
            .enumerate()
            .map(|(j, &i)| {
                let entry = &self.pools[i];
                let first = match &handoff {
                    Some(h) => h.first[j],
                    None => first_of(entry.window, reuse_blocks),
                };
                let split = device_end[j].min(local_reuse).max(first);
                let reuse: Vec<BlockId> = match &fork {
                    Some(f) => f.pools[j].0.clone(),
                    None => (first..split)
                        .filter_map(|idx| entry.pool.lookup(hashes[idx as usize]))
                        .collect(),
                };
                // the host first (a faster copy), else the disk
                let onboard: Vec<(Tier, HostBlockId)> = (split..local_reuse)
                    .filter_map(|idx| {
                        let hash = hashes[idx as usize];
                        [Tier::Host, Tier::Disk]
                            .into_iter()
                            .find_map(|t| entry.pool.tier(t).lookup(hash).map(|b| (t, b)))
                    })
                    .collect();
                PoolLease {
                    pool: i,
                    first,
                    shared_new: shared_end.saturating_sub(reuse_blocks.max(first)),
                    reuse,
                    shared_end,
                    end,
                    copy_src: copy.as_ref().map(|c| c.1[j]),
                    onboard,
                    peer_pool: peer_run.as_ref().map_or(i, |r| r.pools[j].0),
                    peer: peer_run
                        .as_ref()
                        .map(|r| r.pools[j].1.clone())
                        .unwrap_or_default(),
                    peer_last: handoff.as_ref().and_then(|h| h.last[j]),
                }
            })
            .collect();
        let peer_last_tokens = handoff.as_ref().map_or(0, |h| h.last_tokens);
        let reused_tokens = reuse_blocks * b + copy_tokens + peer_last_tokens;
        // The first chunk starts after the reused tokens (the copied slots
        // are written by the copy, in the same forward pass).
        let written = match spec.prefill_tokens {
            0 => prompt_len,
            n => reused_tokens.saturating_add(n).min(prompt_len),
        };
        LeasePlan {
            seq_id: spec.seq_id,
            pools,
            hashes,
            reused_tokens,
            prompt_len,
            extra,
            reserved_capacity,
            beams: spec.beam_width,
            priority: spec.priority,
            salt,
            hashable,
            partial,
            copy_tokens,
            written,
            fork: fork.is_some(),
            peer_group: peer_run.map(|r| r.group).unwrap_or_default(),
            peer_decision,
            peer_last_tokens,
        }
    }

    /// Checks a fork's request against its parent, where the parent is held
    /// (an unknown parent is a per-sequence reject): not itself, one beam,
    /// the parent's salt, and a prompt whose tokens before its last the
    /// parent holds where the cache knows them.
    fn validate_fork(&self, session_id: SessionId, spec: &SeqSpec) -> Result<()> {
        let Some(parent_id) = spec.fork_of else {
            return Ok(());
        };
        let seq_id = spec.seq_id;
        let invalid = |why: String| {
            Err(Error::InvalidArgument(format!(
                "sequence {seq_id}: fork_of {parent_id}: {why}"
            )))
        };
        if parent_id == seq_id {
            return invalid("a sequence cannot fork itself".into());
        }
        if spec.beam_width > 1 {
            return invalid(format!(
                "a fork is one branch, beam_width must be 1, got {}",
                spec.beam_width
            ));
        }
        let Some(parent) = self
            .sessions
            .get(&session_id)
            .and_then(|s| s.seqs.get(&parent_id))
        else {
            return Ok(());
        };
        let (Prompt::Tokens(tokens), true) = (&spec.prompt, parent.hashable) else {
            return Ok(());
        };
        let Some(group) = self.groups.get(&spec.group) else {
            return Ok(());
        };
        if prefix::salt_hash(&spec.cache_salt) != parent.salt {
            return invalid("its cache_salt is not the parent's".into());
        }
        // only the shared part must match: the branch computes its own last
        // prompt token, which may differ from the parent's token there (a
        // beam's child continues its parent's context with another token)
        let k = (tokens.len() - 1).min(parent.len as usize);
        if !super::handoff::holds_tokens(parent, &tokens[..k], group.tokens_per_block) {
            return invalid("its prompt is not the tokens the parent holds".into());
        }
        Ok(())
    }

    /// What a fork takes from its parent, or `None` when the parent cannot
    /// give it (not held, several beams, another group, its table slid past
    /// the blocks, its prefill not written that far): the branch is then
    /// leased as any sequence.
    fn fork_source(&self, session_id: SessionId, spec: &SeqSpec) -> Option<ForkSource> {
        let parent = self.sessions.get(&session_id)?.seqs.get(&spec.fork_of?)?;
        let group = self.groups.get(&spec.group)?;
        if parent.beams != 1 || parent.tables.len() != group.pools.len() {
            return None;
        }
        let b = group.tokens_per_block;
        // only KV a completed step wrote: the parent's pass in flight may
        // still fail, and a branch must never read what it did not write
        let completed = self.sessions.get(&session_id)?.completed_step;
        let k = (spec.prompt.len() - 1).min(parent.written_by(completed));
        let (reuse_blocks, copy_tokens) = (k / b, k % b);
        let end = reuse_blocks + u32::from(copy_tokens > 0);
        let mut pools = Vec::with_capacity(group.pools.len());
        for (t, &i) in parent.tables.iter().zip(&group.pools) {
            let bt = t.beams.first()?;
            let first = super::matching::first_block(self.pools[i].window, reuse_blocks, b);
            if t.pool != i || (first < end && (first < bt.first || end > bt.end())) {
                return None;
            }
            let at = |idx: u32| bt.blocks.get((idx - bt.first) as usize).copied();
            let reuse = (first..reuse_blocks)
                .map(at)
                .collect::<Option<Vec<BlockId>>>()?;
            let src = match copy_tokens {
                0 => None,
                _ => Some(at(reuse_blocks)?),
            };
            pools.push((reuse, src));
        }
        Some(ForkSource {
            reuse_blocks,
            copy_tokens,
            pools,
        })
    }

    /// The partial-block copy a lease can take after `reused` full blocks:
    /// how many slots of the next block match a kept partly filled block in
    /// every pool of the group (the least of the pools' matches, at most
    /// `tokens_per_block - 1` and never the last prompt token, which is
    /// computed), and each pool's source block.
    fn plan_copy(
        &self,
        group: &super::Group,
        tokens: &[u32],
        hashes: &[u64],
        salt: u64,
        reused: u32,
    ) -> Option<(u32, Vec<BlockId>)> {
        if !self.config.partial_reuse {
            return None;
        }
        let b = group.tokens_per_block as usize;
        let start = reused as usize * b;
        let end = (start + b - 1).min(tokens.len().saturating_sub(1));
        let want = tokens.get(start..end).filter(|w| !w.is_empty())?;
        let parent = match reused {
            0 => prefix::ROOT_PARENT,
            r => *hashes.get(r as usize - 1)?,
        };
        let mut matched = u32::MAX;
        let mut sources = Vec::with_capacity(group.pools.len());
        for &i in &group.pools {
            let (src, k) = self.pools[i].pool.lookup_partial(parent, salt, want)?;
            matched = matched.min(k);
            sources.push(src);
        }
        Some((matched, sources))
    }

    /// Whether a planned lease fits now (and, for an atomic batch, together
    /// with the members before it in `tally`).
    fn check_lease(
        &self,
        session_id: SessionId,
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
                .pinned()
                .filter(|&b| entry.pool.state(b) == BlockState::Cached)
                .count() as u64;
            let mut need = p.new_blocks(plan.beams);
            if let Some(t) = tally.as_deref_mut() {
                let pinned = t.pinned.entry(p.pool).or_default();
                pinned_cached = 0;
                for b in p.pinned() {
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
                // The figures are the quota's, in block references (needed
                // now, left under the quota); the pool named is the one the
                // sequence asks the most references of, so a holder sees
                // where its quota goes.
                let clamp = |n: u64| u32::try_from(n).unwrap_or(u32::MAX);
                let left = quota.saturating_sub(held);
                let (pool_id, window) = plan
                    .pools
                    .iter()
                    .max_by_key(|p| p.references(plan.beams))
                    .map_or((0, 0), |p| {
                        (self.pools[p.pool].id, self.pools[p.pool].window)
                    });
                return Err(Reject {
                    pool_id,
                    window,
                    blocks_needed: clamp(refs),
                    blocks_free: clamp(left),
                    ..Reject::plain(
                        plan.seq_id,
                        RejectReason::QuotaExceeded,
                        format!(
                            "session holds {held} block references, {refs} more (most in pool {pool_id}, window {window}) would pass its quota of {quota}; {left} free under it"
                        ),
                    )
                });
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
            if let Some(src) = p.copy_src {
                pool.acquire(src, holder, plan.priority);
            }
            // Before any allocation: a demotion must not take the host
            // block this lease reads.
            for &(t, h) in &p.onboard {
                pool.tier_mut(t).pin(h);
            }
            // a peer's source blocks: in use by this sequence (so no
            // allocation evicts them) until the lease fences them
            let peer_pool = &mut self.pools[p.peer_pool].pool;
            for &src in p.peer.iter().chain(&p.peer_last) {
                peer_pool.acquire(src, holder, plan.priority);
            }
        }
    }

    fn execute_lease(
        &mut self,
        session_id: SessionId,
        plan: LeasePlan,
        step: Step,
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
        session_id: SessionId,
        plan: LeasePlan,
        step: Step,
        holder: Holder,
    ) -> Grant {
        let mut tables = Vec::with_capacity(plan.pools.len());
        let mut pending = Vec::new();
        let mut held_back = Vec::new();
        let mut copies = Vec::new();
        let mut copy_fences = Vec::new();
        let mut onboards = Vec::new();
        let mut host_pins = Vec::new();
        let mut peer_copies = Vec::new();
        let mut references = 0;
        let transfer_id = match plan
            .pools
            .iter()
            .any(|p| !p.peer.is_empty() || p.peer_last.is_some())
        {
            true => {
                self.last_transfer += 1;
                self.last_transfer
            }
            false => 0,
        };
        for p in &plan.pools {
            let src_pool_id = self.pools[p.peer_pool].id;
            let entry = &mut self.pools[p.pool];
            let b = entry.tokens_per_block;
            if plan.fork {
                entry.pool.counters.fork_shared += p.reuse.len() as u64;
                entry.pool.counters.fork_copies += u64::from(p.copy_src.is_some());
            } else if plan.peer_decision.as_ref().is_some_and(|d| d.forced) {
                entry.pool.counters.handoff_blocks +=
                    p.peer.len() as u64 + u64::from(p.peer_last.is_some());
            } else if plan.hashable {
                let eligible = ((plan.prompt_len - 1) / b).min(plan.hashes.len() as u32);
                entry.pool.counters.reuse_lookups += u64::from(eligible);
                entry.pool.counters.reuse_hits += u64::from(plan.reused_tokens / b);
                entry.pool.counters.onboards += p.onboard.len() as u64;
                entry.pool.counters.loads +=
                    p.onboard.iter().filter(|(t, _)| *t == Tier::Disk).count() as u64;
                entry
                    .pool
                    .observe_lookups(&plan.hashes[..eligible as usize]);
                for s in entry.pool.take_policy_switches() {
                    // an event of the call's span: in the trace of the
                    // Lease whose lookups ended the deciding window
                    tracing::info!(
                        pool_group = %entry.group,
                        pool_id = entry.id,
                        from = s.from.name(),
                        to = s.to.name(),
                        estimates = ?s.estimates,
                        "eviction policy switched"
                    );
                }
            }
            let (pool_id, window) = (entry.id, entry.window);
            let pool = &mut entry.pool;
            let mut shared: Vec<BlockId> = p.reuse.clone();
            let shared_start = p.first + p.reuse.len() as u32;
            let onboard_end = shared_start + p.onboard.len() as u32;
            let peer_end = onboard_end + p.peer.len() as u32;
            for idx in shared_start..peer_end + p.shared_new {
                let Some(block) = pool.allocate(holder, plan.priority) else {
                    break;
                };
                if let Some(&src) = idx
                    .checked_sub(onboard_end)
                    .and_then(|k| p.peer.get(k as usize))
                {
                    peer_copies.push(PeerCopy {
                        pool_id,
                        window,
                        dst_block: block,
                        src_group: plan.peer_group.clone(),
                        src_pool_id,
                        src_block: src,
                        transfer_id,
                        tokens: 0,
                    });
                }
                if let Some(&(tier, from)) = p.onboard.get((idx - shared_start) as usize) {
                    onboards.push(onboard_copy(
                        (pool_id, window),
                        tier,
                        from,
                        block,
                        &plan.hashes,
                        idx,
                    ));
                    host_pins.push(HostRef {
                        pool: p.pool,
                        tier,
                        block: from,
                        generation: pool.tier(tier).generation(from),
                    });
                }
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
                    let r = BlockRef {
                        pool: p.pool,
                        block,
                        generation: pool.generation(block),
                    };
                    // A block a later prefill chunk writes waits for the
                    // progress report that covers it.
                    let end = (idx + 1) * b;
                    if end <= plan.written {
                        pending.push(r);
                    } else {
                        held_back.push((end, r));
                    }
                }
                shared.push(block);
            }
            if shared.len() < (p.reuse.len() + p.onboard.len()) {
                // Allocation fell short (a defect path): the pins of the
                // onboardings that got no block must still be lifted.
                for &(t, h) in &p.onboard[shared.len() - p.reuse.len()..] {
                    pool.tier_mut(t).unpin(h);
                }
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
            // The copy source stays out of circulation until the forward
            // pass of this step (which reads it) is reported complete.
            if let (Some(src), Some(beam)) = (p.copy_src, beams.first()) {
                let dst_index = peer_end;
                if let Some(&dst) = dst_index
                    .checked_sub(beam.first)
                    .and_then(|i| beam.blocks.get(i as usize))
                {
                    copies.push(BlockCopy {
                        pool_id,
                        window,
                        src_block: src,
                        dst_block: dst,
                        tokens: plan.copy_tokens,
                    });
                }
                pool.release(src, true);
                copy_fences.push(BlockRef {
                    pool: p.pool,
                    block: src,
                    generation: pool.generation(src),
                });
            }
            // a hand-off's partly filled last block: into the block after
            // the pulled ones
            let last_dst = beams.first().and_then(|beam| {
                let i = peer_end.checked_sub(beam.first)?;
                beam.blocks.get(i as usize).copied()
            });
            if let (Some(src), Some(dst)) = (p.peer_last, last_dst) {
                peer_copies.push(PeerCopy {
                    pool_id,
                    window,
                    dst_block: dst,
                    src_group: plan.peer_group.clone(),
                    src_pool_id,
                    src_block: src,
                    transfer_id,
                    tokens: plan.peer_last_tokens,
                });
            }
            tables.push(PoolTables {
                pool: p.pool,
                beams,
            });
            // A peer's source blocks stay out of circulation until the
            // forward pass of this step (whose worker pulls them) is
            // reported complete, as a copy source does.
            let peer_pool = &mut self.pools[p.peer_pool].pool;
            for &src in p.peer.iter().chain(&p.peer_last) {
                peer_pool.release(src, true);
                copy_fences.push(BlockRef {
                    pool: p.peer_pool,
                    block: src,
                    generation: peer_pool.generation(src),
                });
            }
        }
        let seq = SeqState {
            len: plan.prompt_len,
            extra: plan.extra,
            reserved_capacity: plan.reserved_capacity,
            beams: plan.beams,
            priority: plan.priority,
            salt: plan.salt,
            hashes: plan.hashes,
            partial: plan.partial,
            hashable: plan.hashable && plan.beams == 1,
            write_step: step,
            tables,
            written: plan.written,
            // known once this step completes (`note_write` below): reused
            // blocks may be onboarded or copied by this step's pass too
            written_done: 0,
            writes_in_flight: Vec::new(),
            held_back,
        };
        let mut seq = seq;
        let completed = self
            .sessions
            .get(&session_id)
            .and_then(|session| session.completed_step);
        seq.note_write(step, plan.written, completed);
        let mut grant = self.grant_of(plan.seq_id, &seq, plan.reused_tokens);
        grant.copies = copies;
        grant.peer_copies = peer_copies;
        grant.peer_decision = plan.peer_decision;
        let pools: Vec<usize> = plan.pools.iter().map(|p| p.pool).collect();
        grant.tier_copies = self.take_demotions(session_id, &pools, step);
        grant.tier_copies.extend(onboards);
        self.pin_host_until(session_id, step, host_pins);
        if let Some(session) = self.sessions.get_mut(&session_id) {
            session.references += references;
            session.forget_released(plan.seq_id);
            // A lease at a step already reported complete cannot be known to
            // have written its KV: its hashes are not published.
            if !pending.is_empty() && !session.step_completed(step) {
                session.pending.entry(step).or_default().extend(pending);
            }
            if !copy_fences.is_empty() {
                session.fences.entry(step).or_default().extend(copy_fences);
            }
            session.seqs.insert(plan.seq_id, seq);
        }
        grant
    }

    fn grant_of(&self, seq_id: SeqId, seq: &SeqState, reused_tokens: u32) -> Grant {
        grant_of(&self.pools, seq_id, seq, reused_tokens)
    }
}

/// The copy that onboards prompt block `idx` (whose full-block hashes are
/// `hashes`) from block `from` of `tier` into device block `device`.
fn onboard_copy(
    (pool_id, window): (u32, u32),
    tier: Tier,
    from: HostBlockId,
    device: BlockId,
    hashes: &[u64],
    idx: u32,
) -> TierCopy {
    let i = idx as usize;
    let parent = match i {
        0 => prefix::ROOT_PARENT,
        _ => hashes.get(i - 1).copied().unwrap_or_default(),
    };
    let hash = hashes.get(i).copied().unwrap_or_default();
    let (direction, host_block, disk_block, hash, parent) = match tier {
        Tier::Disk => (TierDirection::Load, 0, from, hash, parent),
        Tier::Device | Tier::Host => (TierDirection::Onboard, from, 0, 0, 0),
    };
    TierCopy {
        pool_id,
        window,
        direction,
        device_block: device,
        host_block,
        disk_block,
        hash,
        parent,
    }
}

/// The grant describing `seq`'s current tables.
/// Checks a retention hint of sequence `seq_id`, whose prompt is
/// `prompt_len` tokens.
pub(crate) fn validate_retain(seq_id: SeqId, r: &Retain, prompt_len: u32) -> Result<()> {
    if r.tokens == 0 || r.tokens > prompt_len {
        return Err(Error::InvalidArgument(format!(
            "sequence {seq_id}: retain.tokens must be 1 to its prompt of {prompt_len} tokens, got {}",
            r.tokens
        )));
    }
    if r.priority > crate::eviction::MAX_PRIORITY {
        return Err(Error::InvalidArgument(format!(
            "sequence {seq_id}: retain.priority must be 0 to 100, got {}",
            r.priority
        )));
    }
    if r.tenant.len() > MAX_RETAIN_TENANT_BYTES {
        return Err(Error::InvalidArgument(format!(
            "sequence {seq_id}: retain.tenant must be at most {MAX_RETAIN_TENANT_BYTES} bytes, got {}",
            kvlease_runtime::echo::clip(&r.tenant, 64)
        )));
    }
    if r.ttl.is_zero() || r.ttl > MAX_RETAIN_TTL {
        return Err(Error::InvalidArgument(format!(
            "sequence {seq_id}: retain.ttl_ms must be 1 to {}, got {}",
            MAX_RETAIN_TTL.as_millis(),
            r.ttl.as_millis()
        )));
    }
    Ok(())
}

fn grant_of(pools: &[PoolEntry], seq_id: SeqId, seq: &SeqState, reused_tokens: u32) -> Grant {
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
        copies: Vec::new(),
        tier_copies: Vec::new(),
        peer_copies: Vec::new(),
        peer_decision: None,
        retained_tokens: 0,
    }
}
