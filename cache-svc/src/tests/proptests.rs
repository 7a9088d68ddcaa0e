//! Property tests: random operation sequences with `check_invariants()` after
//! every step, and the estimate against a real life of leases and extends.

use std::collections::HashMap;
use std::time::Duration;

use proptest::prelude::*;

use super::{Fixture, GROUP, spec};
use crate::cache::{Batch, CacheConfig, DiskPool};
use crate::estimate::{Shape, pool_need};
use crate::eviction::{EvictionConfig, PolicyKind};
use crate::ids::{SeqId, Step};
use crate::lease::{Extra, Growth, Outcome, Prompt, RejectReason};

#[derive(Clone, Debug)]
enum Op {
    Lease {
        /// (seq, prefix family, len, extra, beams, fork): a fork of a held
        /// sequence whose prompt the holder knows takes that prompt.
        seqs: Vec<(u8, u8, u8, u8, u8, Option<u8>)>,
        atomic: bool,
        warmup: bool,
        reserve: bool,
        /// The first chunk of a chunked prefill (0, or past the prompt:
        /// the whole prompt).
        prefill: u8,
        /// A retention hint on every sequence: (tokens, priority, ttl in
        /// seconds, tenant), tokens cut to the prompt.
        retain: Option<(u8, u8, u8, u8)>,
    },
    /// Time passes (retention hints expire), within the session's TTL.
    Tick(u8),
    /// Chunked-prefill progress reports.
    Progress {
        seqs: Vec<u8>,
        written: u8,
    },
    Extend {
        seqs: Vec<u8>,
        n: u8,
        with_ids: bool,
        /// Each item grows from a length one short of the sequence's (a
        /// retry of a growth whose answer was lost), else from its length.
        stale: bool,
    },
    Release {
        seqs: Vec<u8>,
        fenced: bool,
        /// As after a failed forward pass (`ReleaseMode::discard_unwritten`).
        failed: bool,
    },
    Complete,
    Expire,
    Audit,
    /// The worker starts again: a new incarnation announcing what its disk
    /// tiers hold (refused while a session holds or copies blocks).
    Restart,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (
            prop::collection::vec(
                (0u8..12, 0u8..3, 1u8..40, 0u8..4, 1u8..3, prop::option::weighted(0.3, 0u8..12)),
                1..4,
            ),
            any::<bool>(),
            prop::bool::weighted(0.1),
            prop::bool::weighted(0.2),
            0u8..48,
            prop::option::weighted(0.4, (1u8..40, 0u8..=100, 1u8..20, 0u8..2)),
        )
            .prop_map(|(seqs, atomic, warmup, reserve, prefill, retain)| Op::Lease { seqs, atomic, warmup, reserve, prefill, retain }),
        1 => (1u8..20).prop_map(Op::Tick),
        2 => (prop::collection::vec(0u8..12, 1..4), 1u8..48)
            .prop_map(|(seqs, written)| Op::Progress { seqs, written }),
        4 => (prop::collection::vec(0u8..12, 1..5), 1u8..6, prop::bool::weighted(0.8), prop::bool::weighted(0.15))
            .prop_map(|(seqs, n, with_ids, stale)| Op::Extend { seqs, n, with_ids, stale }),
        2 => (prop::collection::vec(0u8..12, 1..4), any::<bool>(), prop::bool::weighted(0.2))
            .prop_map(|(seqs, fenced, failed)| Op::Release { seqs, fenced, failed }),
        2 => Just(Op::Complete),
        1 => Just(Op::Expire),
        1 => Just(Op::Audit),
        1 => Just(Op::Restart),
    ]
}

fn prompt(family: u8, len: u8) -> Vec<u32> {
    // Families share long prefixes, so reuse and eviction are exercised.
    (0..u32::from(len))
        .map(|i| u32::from(family) * 1000 + i)
        .collect()
}

/// Content a holder's worker moves between tiers: demotions take the device
/// block's content into a pending host block (only what a completed step
/// vouches for becomes the host block's content: a failed pass may not have
/// run the copy), onboardings take a host block's content into a device
/// block. Every demotion of a grant comes before its onboardings. The disk
/// tier alike: a spill takes a host block's published content into a
/// pending disk block (before any demotion overwrites the host block), a
/// load a disk block's content into a device block.
#[derive(Default)]
pub(super) struct TierModel {
    pub(super) host: HashMap<(u32, u32), Vec<u32>>,
    pending: Vec<((u32, u32), Vec<u32>)>,
    disk: HashMap<(u32, u32), Vec<u32>>,
    pending_disk: Vec<((u32, u32), Vec<u32>)>,
}

impl TierModel {
    pub(super) fn apply(
        &mut self,
        content: &mut HashMap<(u32, u32), Vec<u32>>,
        copies: &[crate::lease::TierCopy],
    ) {
        use crate::lease::TierDirection;
        for c in copies
            .iter()
            .filter(|c| c.direction == TierDirection::Spill)
        {
            let held = self
                .host
                .get(&(c.pool_id, c.host_block))
                .cloned()
                .unwrap_or_default();
            self.disk.remove(&(c.pool_id, c.disk_block));
            self.pending_disk.push(((c.pool_id, c.disk_block), held));
        }
        for c in copies
            .iter()
            .filter(|c| c.direction == TierDirection::Demote)
        {
            let held = content
                .get(&(c.pool_id, c.device_block))
                .cloned()
                .unwrap_or_default();
            self.host.remove(&(c.pool_id, c.host_block));
            self.pending.push(((c.pool_id, c.host_block), held));
        }
        for c in copies
            .iter()
            .filter(|c| c.direction == TierDirection::Onboard)
        {
            match self.host.get(&(c.pool_id, c.host_block)) {
                Some(held) => content.insert((c.pool_id, c.device_block), held.clone()),
                None => content.remove(&(c.pool_id, c.device_block)),
            };
        }
        for c in copies.iter().filter(|c| c.direction == TierDirection::Load) {
            match self.disk.get(&(c.pool_id, c.disk_block)) {
                Some(held) => content.insert((c.pool_id, c.device_block), held.clone()),
                None => content.remove(&(c.pool_id, c.device_block)),
            };
        }
    }

    /// The step completed: its demotions ran.
    pub(super) fn complete(&mut self) {
        for (k, v) in self.pending.drain(..) {
            self.host.insert(k, v);
        }
        for (k, v) in self.pending_disk.drain(..) {
            self.disk.insert(k, v);
        }
    }

    /// The pass failed (or the session ended): its demotions may not have run.
    pub(super) fn fail(&mut self) {
        self.pending.clear();
        self.pending_disk.clear();
    }
}

/// Records the token ids of `tokens` in the blocks of `tables` that hold them.
pub(super) fn write_content(
    content: &mut HashMap<(u32, u32), Vec<u32>>,
    tables: &[crate::lease::Table],
    tokens: &[u32],
    b: u32,
) {
    for t in tables {
        for (i, &block) in t.block_ids.iter().enumerate() {
            let start = ((t.first_block as usize + i) * b as usize).min(tokens.len());
            let end = (start + b as usize).min(tokens.len());
            content.insert((t.pool_id, block), tokens[start..end].to_vec());
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 10_000, ..ProptestConfig::default() })]

    /// Invariants 1-5 and 10 after every operation of random sequences of
    /// lease / extend / release / fence / complete / expire / evict / audit.
    #[test]
    fn random_operations_keep_every_invariant(
        ops in prop::collection::vec(op(), 1..40),
        policy in prop::sample::select(PolicyKind::ALL.to_vec()),
        host in prop::sample::select(vec![0u32, 3, 12, 40]),
        disk in prop::sample::select(vec![0u32, 4, 30]),
    ) {
        let (b, w) = (4u32, 9u32);
        let config = CacheConfig {
            session_quota: 0,
            eviction: EvictionConfig { default: policy, groups: Vec::new() },
            ..CacheConfig::default()
        };
        let mut f = Fixture::with_tiers(config, b, &[(0, 24, host), (w, 14, host / 2)]);
        if host / 2 > 0 {
            // a disk tier below each host tier
            let disks = [0, w].map(|window| DiskPool { window, blocks: disk, held: Vec::new() });
            f.cache.register_incarnation(kvlease_auth::principal::ANONYMOUS, GROUP, 1, &disks, Some(f.session)).unwrap();
            f.check();
        }
        let mut tiers = TierModel::default();
        let mut incarnation = 1u64;
        let mut step = 1u64;
        let mut extra_of: HashMap<u64, u32> = HashMap::new();
        // What a holder knows: lease tables with every extend delta applied
        // (beam 0). Must equal the cache's own tables.
        let mut mirror: HashMap<u64, Vec<crate::lease::Table>> = HashMap::new();
        // The token ids each block's slots hold, as the holder writes them
        // (beam 0 of sequences whose ids are all known), and each such
        // sequence's ids: every partial-block copy must name a source whose
        // leading slots hold exactly the prompt's tokens.
        let mut content: HashMap<(u32, u32), Vec<u32>> = HashMap::new();
        let mut toks: HashMap<u64, Vec<u32>> = HashMap::new();
        // Prompts and how far the holder has written them.
        let mut prefill_of: HashMap<u64, (Vec<u32>, usize)> = HashMap::new();
        // How far a completed step wrote each prompt (what a fork may
        // share), and the writes of steps not completed yet.
        let mut prefill_done: HashMap<u64, usize> = HashMap::new();
        let mut writes: Vec<(u64, u64, usize)> = Vec::new();
        for op in ops {
            match op {
                Op::Lease { seqs, atomic, warmup, reserve, prefill, retain } => {
                    let specs: Vec<_> = seqs.iter().map(|&(id, fam, len, extra, beams, fork)| {
                        // a branch of a sequence whose prompt is known
                        // shares its blocks (and diverges by its extends);
                        // of one not held, it is refused
                        let parent = fork.map(u64::from).filter(|&p| {
                            p != u64::from(id) && (prefill_of.contains_key(&p) || !mirror.contains_key(&p))
                        });
                        let ids = match parent.and_then(|p| prefill_of.get(&p)) {
                            Some((ids, _)) => ids.clone(),
                            None => prompt(fam, len),
                        };
                        let mut s = spec(u64::from(id), Prompt::Tokens(ids));
                        s.fork_of = parent.map(SeqId);
                        s.extra = Extra { draft: u32::from(extra), ..Extra::default() };
                        s.beam_width = if parent.is_some() { 1 } else { u32::from(beams) };
                        s.max_new_tokens = 6;
                        s.reserve_full_life = reserve;
                        if u32::from(prefill) <= s.prompt.len() {
                            s.prefill_tokens = u32::from(prefill);
                        }
                        s.retain = retain.map(|(tokens, priority, ttl, tenant)| crate::lease::Retain {
                            tokens: u32::from(tokens).min(s.prompt.len()),
                            priority,
                            ttl: Duration::from_secs(ttl.into()),
                            tenant: format!("t{tenant}"),
                        });
                        s
                    }).collect();
                    let before = f.counts();
                    let out = f.cache
                        .lease(f.session, f.epoch, Batch { step: Step(step), atomic, warmup }, &specs, f.now)
                        .unwrap();
                    f.check();
                    prop_assert_eq!(out.len(), specs.len());
                    for p in f.cache.pools() {
                        let quota = (f64::from(p.pool.len()) * crate::cache::DEFAULT_RETENTION_SHARE) as u32;
                        for t in ["t0", "t1"] {
                            prop_assert!(p.pool.retention().tenant_blocks(t) <= quota);
                        }
                    }
                    for (o, s) in out.iter().zip(&specs) {
                        if let (Outcome::Reject(r), Some(_)) = (o, s.fork_of) {
                            prop_assert!(matches!(
                                r.reason,
                                RejectReason::PoolExhausted
                                    | RejectReason::ExceedsCapacity
                                    | RejectReason::UnknownSequence
                                    | RejectReason::DuplicateSequence
                                    | RejectReason::RolledBack
                                    | RejectReason::QuotaExceeded
                            ), "{:?}", r);
                        }
                        if let (Outcome::Grant(g), Some(parent)) = (o, s.fork_of) {
                            // a fork of a prefill written through its last
                            // token shares everything before that token
                            // (and has not grown, so no window slid)
                            let written = prefill_of.get(&parent.0).is_some_and(|(ids, _)| {
                                prefill_done.get(&parent.0).is_some_and(|&w| w >= ids.len() - 1)
                            });
                            let grown = toks.get(&parent.0).is_none_or(|t| t.len() as u32 != s.prompt.len());
                            if !warmup && written && !grown {
                                prop_assert_eq!(g.reused_tokens, s.prompt.len() - 1);
                            }
                        }
                        if let (Outcome::Grant(g), Some(r)) = (o, &s.retain) {
                            prop_assert!(g.retained_tokens <= r.tokens / b * b);
                        } else if let Outcome::Grant(g) = o {
                            prop_assert_eq!(g.retained_tokens, 0);
                        }
                    }
                    if atomic && out.iter().any(|o| o.reject().is_some()) {
                        prop_assert!(out.iter().all(|o| o.reject().is_some()));
                        prop_assert_eq!(f.counts(), before, "atomic reject changed the pools");
                    }
                    for (o, s) in out.iter().zip(&specs) {
                        if let Outcome::Grant(g) = o {
                            for c in &g.tier_copies {
                                let pool = f.cache.pools().iter().find(|p| p.id == c.pool_id).unwrap();
                                let state = pool.pool.host().state(c.host_block);
                                let disk_state = match c.direction {
                                    crate::lease::TierDirection::Spill | crate::lease::TierDirection::Load => pool.pool.disk().state(c.disk_block),
                                    _ => crate::tier::HostState::Free,
                                };
                                match c.direction {
                                    // a demotion in flight is never read
                                    crate::lease::TierDirection::Demote => prop_assert_eq!(state, crate::tier::HostState::Pending),
                                    crate::lease::TierDirection::Spill => prop_assert_eq!(disk_state, crate::tier::HostState::Pending),
                                    crate::lease::TierDirection::Onboard => {
                                        prop_assert!(!warmup);
                                        prop_assert_eq!(state, crate::tier::HostState::Pinned);
                                    }
                                    crate::lease::TierDirection::Load => {
                                        prop_assert!(!warmup);
                                        prop_assert_eq!(disk_state, crate::tier::HostState::Pinned);
                                    }
                                }
                            }
                            tiers.apply(&mut content, &g.tier_copies);
                            // A reserved life holds its future blocks on
                            // purpose; invariant 10 is about the sliding
                            // table of an ordinary lease.
                            if s.reserve_full_life {
                                extra_of.remove(&g.seq_id.0);
                            } else {
                                extra_of.insert(g.seq_id.0, s.extra.total());
                            }
                            mirror.insert(g.seq_id.0, g.tables.iter().filter(|t| t.beam == 0).cloned().collect());
                            prop_assert!(g.reused_tokens < s.prompt.len());
                            let Prompt::Tokens(ids) = &s.prompt else { continue };
                            let full = g.reused_tokens / b * b;
                            for c in &g.copies {
                                prop_assert!(s.beam_width == 1 && !warmup);
                                prop_assert!(c.tokens >= 1 && c.tokens < b && c.src_block != c.dst_block);
                                prop_assert_eq!(full + c.tokens, g.reused_tokens);
                                let t = g.tables.iter().find(|t| t.pool_id == c.pool_id && t.beam == 0).unwrap();
                                prop_assert_eq!(t.block_ids[(full / b - t.first_block) as usize], c.dst_block);
                                let want = &ids[full as usize..g.reused_tokens as usize];
                                let held = content.get(&(c.pool_id, c.src_block)).map(|v| &v[..]).unwrap_or(&[]);
                                prop_assert!(held.starts_with(want), "copy source {} holds {:?}, prompt wants {:?}", c.src_block, held, want);
                                // The source is pinned until the step completes.
                                let pool = f.cache.pools().iter().find(|p| p.id == c.pool_id).unwrap();
                                prop_assert_ne!(pool.pool.state(c.src_block), crate::pool::BlockState::Free);
                                prop_assert_ne!(pool.pool.state(c.src_block), crate::pool::BlockState::Cached);
                            }
                            if g.copies.is_empty() {
                                prop_assert_eq!(g.reused_tokens % b, 0);
                            }
                            if warmup {
                                continue;
                            }
                            // Every reused block holds what the holders wrote
                            // into it: this prompt's tokens (never KV a later
                            // prefill chunk had still to write).
                            for t in &mirror[&g.seq_id.0] {
                                for i in t.first_block..full / b {
                                    let block = t.block_ids[(i - t.first_block) as usize];
                                    let want = &ids[(i * b) as usize..((i + 1) * b) as usize];
                                    let held = content.get(&(t.pool_id, block)).map(|v| &v[..]).unwrap_or(&[]);
                                    prop_assert_eq!(held, want, "reused block {} (index {}) of pool {}", block, i, t.pool_id);
                                }
                                // the new blocks hold nothing until written
                                for &block in &t.block_ids[(full / b).saturating_sub(t.first_block) as usize..] {
                                    content.remove(&(t.pool_id, block));
                                }
                            }
                            // What the lease's step writes: the first chunk.
                            let written = match s.prefill_tokens {
                                0 => ids.len(),
                                p => ((g.reused_tokens + p) as usize).min(ids.len()),
                            };
                            write_content(&mut content, &mirror[&g.seq_id.0], &ids[..written], b);
                            prefill_of.insert(g.seq_id.0, (ids.clone(), written));
                            writes.push((g.seq_id.0, step, written));
                            if s.beam_width == 1 {
                                toks.insert(g.seq_id.0, ids.clone());
                            }
                        }
                    }
                }
                Op::Extend { seqs, n, with_ids, stale } => {
                    let ids_of = |s: u8| -> Vec<u32> { (0..u32::from(n)).map(|i| u32::from(s) * 7 + i).collect() };
                    let items: Vec<_> = seqs.iter().map(|&s| {
                        let g = if with_ids {
                            Growth::Tokens(ids_of(s))
                        } else {
                            Growth::Count(u32::from(n))
                        };
                        (u64::from(s), g)
                    }).collect();
                    // every item names the length it grows from (none for a
                    // sequence not held, or 0, which the wire reads as none)
                    let from: Vec<Option<u32>> = items.iter().map(|(s, _)| {
                        f.cache.sequence_len(f.session, SeqId(*s)).map(|len| len - u32::from(stale)).filter(|&l| l > 0)
                    }).collect();
                    let before = f.counts();
                    let checked: Vec<crate::lease::ExtendItem> = items.iter().zip(&from).map(|((s, g), from)| {
                        crate::lease::ExtendItem { from_length: *from, ..crate::lease::ExtendItem::grow(SeqId(*s), g.clone()) }
                    }).collect();
                    let out = f.cache.extend_items(
                        f.session,
                        f.epoch,
                        crate::cache::Batch { step: Step(step), ..crate::cache::Batch::default() },
                        &checked,
                        f.now,
                    ).unwrap();
                    f.check();
                    // a growth from a stale length is refused, a current one never
                    // (a sequence named again in the call is a duplicate)
                    for (i, ((o, (s, _)), from)) in out.iter().zip(&items).zip(&from).enumerate() {
                        let mismatch = o.reject().is_some_and(|r| r.reason == RejectReason::LengthMismatch);
                        let first = items.iter().position(|(t, _)| t == s) == Some(i);
                        prop_assert_eq!(mismatch, stale && from.is_some() && first, "{:?}", o);
                    }
                    let mut seen = std::collections::HashSet::new();
                    for (o, (s, _)) in out.iter().zip(&items) {
                        match o {
                            Outcome::Grant(g) => {
                                prop_assert!(g.tier_copies.iter().all(|c| matches!(c.direction, crate::lease::TierDirection::Demote | crate::lease::TierDirection::Spill)));
                                tiers.apply(&mut content, &g.tier_copies);
                                if let Some(known) = mirror.get_mut(s) {
                                    for delta in g.tables.iter().filter(|t| t.beam == 0) {
                                        if let Some(t) = known.iter_mut().find(|t| t.pool_id == delta.pool_id) {
                                            kvlease_proto::delta::apply_table_delta(
                                                &mut t.first_block, &mut t.block_ids, delta.first_block, &delta.block_ids);
                                        }
                                    }
                                }
                                if !with_ids {
                                    toks.remove(s);
                                } else if let Some(t) = toks.get_mut(s) {
                                    t.extend(ids_of(*s as u8));
                                    write_content(&mut content, &mirror[s], t, b);
                                }
                                let tables = f.cache.sequence_tables(f.session, SeqId(*s)).unwrap_or_default();
                                // The holder's merged view equals the cache's.
                                for (window, first, blocks) in &tables {
                                    let known = mirror.get(s).and_then(|m| m.iter().find(|t| t.window == *window));
                                    prop_assert!(known.is_some_and(|t| t.first_block == *first && &t.block_ids == blocks),
                                        "delta merge diverged: {:?} vs {} {:?}", known, first, blocks);
                                }
                                // Invariant 10: after an extend of n tokens, a
                                // windowed table spans at most
                                // ceil((W - 1 + n + extra) / B) + 1 blocks
                                // (one token: ceil((W + extra) / B) + 1).
                                let Some(e) = extra_of.get(s).copied() else { continue };
                                let bound = (w - 1 + u32::from(n) + e).div_ceil(b) + 1;
                                for (_, _, blocks) in tables.iter().filter(|t| t.0 == w) {
                                    prop_assert!(blocks.len() as u32 <= bound, "window table too long: {:?}", blocks);
                                }
                            }
                            Outcome::Reject(r) => {
                                prop_assert!(matches!(
                                    r.reason,
                                    RejectReason::PoolExhausted
                                        | RejectReason::ExceedsCapacity
                                        | RejectReason::UnknownSequence
                                        | RejectReason::DuplicateSequence
                                        | RejectReason::LengthMismatch
                                ), "{:?}", r);
                            }
                        }
                        seen.insert(*s);
                    }
                    if out.iter().all(|o| o.reject().is_some()) {
                        prop_assert_eq!(f.counts(), before);
                    }
                }
                Op::Progress { seqs, written } => {
                    let items: Vec<_> = seqs
                        .iter()
                        .map(|&s| crate::lease::ExtendItem::written(SeqId(u64::from(s)), u32::from(written)))
                        .collect();
                    let before = f.counts();
                    let out = f.cache.extend_items(
                        f.session,
                        f.epoch,
                        Batch { step: Step(step), ..Batch::default() },
                        &items,
                        f.now,
                    );
                    f.check();
                    // a report changes no table and takes no block
                    prop_assert_eq!(f.counts(), before);
                    match out {
                                    Ok(out) => {
                            for o in out {
                                match o {
                                    Outcome::Grant(g) => {
                                        prop_assert!(g.tables.is_empty());
                                        // the holder writes the chunk
                                        if let (Some((ids, done)), Some(tables)) =
                                            (prefill_of.get_mut(&g.seq_id.0), mirror.get(&g.seq_id.0))
                                        {
                                            let upto = (written as usize).min(ids.len());
                                            // only the blocks of the new chunk
                                            for t in tables.iter().filter(|_| upto > *done) {
                                                for (k, &block) in t.block_ids.iter().enumerate() {
                                                    let i = (t.first_block as usize + k) * b as usize;
                                                    if i < upto && i + b as usize > *done {
                                                        let end = (i + b as usize).min(upto);
                                                        content.insert((t.pool_id, block), ids[i..end].to_vec());
                                                    }
                                                }
                                            }
                                            *done = upto.max(*done);
                                            writes.push((g.seq_id.0, step, *done));
                                        }
                                    }
                                    Outcome::Reject(r) => prop_assert!(matches!(
                                        r.reason,
                                        RejectReason::UnknownSequence | RejectReason::DuplicateSequence
                                    ), "{:?}", r),
                                }
                            }
                        }
                        Err(e) => prop_assert!(e.to_string().contains("is beyond its length"), "{}", e),
                    }
                }
                Op::Release { seqs, fenced, failed } => {
                    let ids: Vec<u64> = seqs.iter().map(|&s| u64::from(s)).collect();
                    for id in &ids {
                        mirror.remove(id);
                        toks.remove(id);
                        prefill_of.remove(id);
                        prefill_done.remove(id);
                    }
                    writes.retain(|(id, _, _)| !ids.contains(id));
                    if failed {
                        tiers.fail();
                        f.release_failed(&ids, fenced.then_some(step));
                    } else {
                        f.release(&ids, fenced.then_some(step));
                    }
                }
                Op::Complete => {
                    f.complete(step);
                    for &(id, _, upto) in writes.iter().filter(|w| w.1 <= step) {
                        let done = prefill_done.entry(id).or_default();
                        *done = upto.max(*done);
                    }
                    writes.retain(|w| w.1 > step);
                    tiers.complete();
                    step += 1;
                }
                Op::Tick(secs) => {
                    f.now += Duration::from_secs(secs.into());
                    f.cache.keep_alive(f.session, f.epoch, f.now).unwrap();
                    f.check();
                }
                Op::Expire => {
                    f.now += Duration::from_secs(3600);
                    f.cache.expire_sessions(f.now);
                    tiers.fail();
                    f.check();
                    let opened = f.cache.open_session("test", None, f.now).unwrap();
                    f.session = opened.session_id;
                    extra_of.clear();
                    mirror.clear();
                    toks.clear();
                    prefill_of.clear();
                    prefill_done.clear();
                    writes.clear();
                }
                Op::Audit => {
                    let report = f.cache.audit();
                    prop_assert!(report.reclaimed.is_empty(), "leak: {:?}", report.reclaimed);
                }
                Op::Restart => {
                    incarnation += 1;
                    let disks: Vec<DiskPool> = f.cache.pools().iter().map(|p| {
                        let d = p.pool.disk();
                        let held = (0..d.len())
                            .filter_map(|b| d.content(b).map(|(h, parent)| (b, h, parent)))
                            .collect();
                        DiskPool { window: p.window, blocks: d.len(), held }
                    }).collect();
                    let before = f.counts();
                    match f.cache.register_incarnation(kvlease_auth::principal::ANONYMOUS, GROUP, incarnation, &disks, Some(f.session)) {
                        Ok(r) => {
                            prop_assert!(r.new_incarnation);
                            if r.memory_forgotten {
                                // device and host memory are gone; the files stay
                                tiers.host.clear();
                                for (c, b) in f.counts().iter().zip(&before) {
                                    prop_assert_eq!((c.cached, c.in_use, c.fenced), (0, 0, 0));
                                    prop_assert_eq!(c.free, b.total);
                                }
                            } else {
                                prop_assert_eq!(f.counts(), before, "a first incarnation is adopted");
                            }
                        }
                        Err(e) => {
                            prop_assert!(matches!(e, crate::Error::IncarnationBusy { .. }), "{}", e);
                            prop_assert_eq!(f.counts(), before, "a refused incarnation changed the pools");
                        }
                    }
                    f.check();
                }
            }
        }
        // Everything released and every fence completed: the pools are whole.
        let ids: Vec<u64> = (0..12).collect();
        f.release(&ids, Some(step));
        f.complete(step);
        for c in f.counts() {
            prop_assert_eq!(c.in_use, 0);
            prop_assert_eq!(c.fenced, 0);
            prop_assert_eq!(c.free + c.cached, c.total);
        }
        for p in f.cache.pools() {
            let h = p.pool.host().counts();
            prop_assert_eq!((h.pending, h.pinned), (0, 0));
            let d = p.pool.disk().counts();
            prop_assert_eq!((d.pending, d.pinned), (0, 0));
        }
    }

}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2_000, ..ProptestConfig::default() })]

    /// Invariant 6: Estimate equals what Lease plus every Extend of the
    /// shape's life take, in every pool, for random prompts, outputs,
    /// draft/extra tokens, beams and windows.
    #[test]
    fn estimate_equals_blocks_taken_over_the_life(
        prompt_len in 1u32..120,
        max_new in 1u32..60,
        draft in 0u32..6,
        extra_kv in 0u32..3,
        steps in 0u32..3,
        beams in 1u32..4,
        b in prop::sample::select(vec![1u32, 3, 4, 16]),
        window in prop::sample::select(vec![0u32, 5, 8, 16, 33, 64]),
        chunk in 1u32..4,
    ) {
        // A full-attention pool, the window under test, and a window longer
        // than any life (which must behave like full attention).
        let mut pools = vec![(0, 512), (1000, 512)];
        if window != 0 {
            pools.push((window, 512));
        }
        let mut f = Fixture::new(b, &pools);
        let mut s = spec(1, Prompt::Count(prompt_len));
        s.max_new_tokens = max_new;
        s.extra = Extra { draft, extra_kv, extra_decoding_steps: steps };
        s.beam_width = beams;
        let est = f.cache.estimate(std::slice::from_ref(&s)).unwrap().remove(0);
        let before: Vec<u64> = f.cache.pools().iter().map(|p| p.pool.counters.allocations).collect();
        let mut peak: Vec<u32> = vec![0; before.len()];
        let note_peak = |f: &Fixture, peak: &mut Vec<u32>| {
            for (i, p) in f.cache.pools().iter().enumerate() {
                let held = p.pool.counts().in_use;
                peak[i] = peak[i].max(held);
            }
        };
        f.lease(1, false, &[s]);
        note_peak(&f, &mut peak);
        f.complete(1);
        // Decode one token per step; sometimes several (speculation accepted).
        let mut done = 1u32;
        let mut step = 2;
        while done < max_new {
            let n = chunk.min(max_new - done);
            f.extend(step, &[(1, Growth::Count(n))]);
            note_peak(&f, &mut peak);
            f.complete(step);
            done += n;
            step += 1;
        }
        for (i, p) in f.cache.pools().iter().enumerate() {
            let taken = p.pool.counters.allocations - before[i];
            let e = est.pools.iter().find(|e| e.pool_id == p.id).unwrap();
            prop_assert_eq!(u64::from(e.total), taken, "pool window {}", p.window);
            if chunk == 1 {
                prop_assert_eq!(e.peak, peak[i], "peak, pool window {}", p.window);
            }
        }
        // And the closed form agrees with itself on the shape.
        let shape = Shape { prompt: prompt_len, max_new_tokens: max_new, extra: draft + extra_kv + steps, beam_width: beams };
        prop_assert_eq!(pool_need(shape, 0, b).total, est.pools[0].total);
    }

    /// Invariant 6 for forks: a parent leased with the prompt and `n - 1`
    /// branches forked from it once its prefill is written (parallel
    /// samples: each branch computes the last prompt token itself), every
    /// one decoding to the end, take exactly what Estimate says of the
    /// shape with beam width `n`, in every pool.
    #[test]
    fn estimate_equals_blocks_taken_by_a_forked_life(
        prompt_len in 1u32..120,
        max_new in 1u32..40,
        steps in 0u32..3,
        n in 1u32..5,
        b in prop::sample::select(vec![1u32, 3, 4, 16]),
        window in prop::sample::select(vec![0u32, 5, 8, 16, 33, 64]),
    ) {
        let mut pools = vec![(0, 1024)];
        if window != 0 {
            pools.push((window, 1024));
        }
        let mut f = Fixture::new(b, &pools);
        let ids: Vec<u32> = (0..prompt_len).collect();
        let extra = Extra { extra_decoding_steps: steps, ..Extra::default() };
        let mut shape = spec(1, Prompt::Tokens(ids.clone()));
        shape.max_new_tokens = max_new;
        shape.extra = extra;
        shape.beam_width = n;
        let est = f.cache.estimate(std::slice::from_ref(&shape)).unwrap().remove(0);
        let before: Vec<u64> = f.cache.pools().iter().map(|p| p.pool.counters.allocations).collect();
        let mut parent = spec(1, Prompt::Tokens(ids.clone()));
        parent.extra = extra;
        prop_assert!(f.lease(1, false, &[parent])[0].grant().is_some());
        // the parent's prefill is written (a branch shares only that)
        f.complete(1);
        let branches: Vec<_> = (2..=u64::from(n)).map(|id| {
            let mut s = spec(id, Prompt::Tokens(ids.clone()));
            s.extra = extra;
            s.fork_of = Some(SeqId(1));
            s
        }).collect();
        for o in f.lease(2, false, &branches) {
            let g = o.grant().unwrap();
            prop_assert_eq!(g.reused_tokens, prompt_len - 1);
            prop_assert_eq!(g.copies.len(), if (prompt_len - 1) % b == 0 { 0 } else { pools.len() });
        }
        f.complete(2);
        // every branch decodes its max_new - 1 fed tokens, each its own
        for step in 3..2 + u64::from(max_new) {
            let items: Vec<_> = (1..=u64::from(n)).map(|id| (id, Growth::Tokens(vec![7000 + id as u32]))).collect();
            for o in f.extend(step, &items) {
                prop_assert!(o.grant().is_some());
            }
            f.complete(step);
        }
        for (i, p) in f.cache.pools().iter().enumerate() {
            let taken = p.pool.counters.allocations - before[i];
            let e = est.pools.iter().find(|e| e.pool_id == p.id).unwrap();
            prop_assert_eq!(u64::from(e.total), taken, "pool window {}", p.window);
        }
        let all: Vec<u64> = (1..=u64::from(n)).collect();
        f.release(&all, Some(1_000));
        f.complete(1_000);
        prop_assert!(super::whole(&f.counts()));
    }
}
