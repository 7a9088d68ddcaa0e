//! The model check: a core driven through thousands of random steps by the
//! core's own [`StepPlan`], against a model of the cache's block
//! bookkeeping, panicking the moment a block reaches a sequence while a
//! forward pass in flight reads it for another; with a host tier, the
//! moment a pass uses a block before the copy that demotes its old content
//! ran, or a step completes (publishing a demotion) before that copy's
//! pass returned; the model worker fails passes now and then, and the
//! cache's calls fail now and then, applied (their answer lost) or not.

use std::collections::{HashSet, VecDeque};

use super::*;

/// The cache's block bookkeeping as the protocol specifies it, for one pool
/// of full attention: what `Lease`, `Extend`, `Release` (fenced or not) and
/// `CompleteStep` do to the blocks. Freed blocks are handed out first, so a
/// block released too early reaches another sequence at once.
struct ModelCache {
    tokens_per_block: u32,
    total: usize,
    free: Vec<u32>,
    /// Slots each lease covers (tokens and extra) and its blocks.
    held: HashMap<SeqId, (u32, Vec<u32>)>,
    /// Tokens each sequence reported (its prompt, then its extends).
    known: HashMap<SeqId, u32>,

    fenced: Vec<(Step, Vec<u32>)>,
    /// Holders of each block in use (a fork shares its parent's) and the
    /// fences on it: it is free again only once both are gone.
    refs: HashMap<u32, u32>,
    pins: HashMap<u32, u32>,
    /// Forks granted the parent's blocks.
    forks: usize,
    /// Another holder of the pool takes the free blocks now and then: an
    /// extend that needs a block is refused one time in this many.
    contested_one_in: u64,
    rng: u64,
    /// Extends refused as contested, and of those the ones sent while a
    /// forward pass was in flight.
    contested: usize,
    /// With a host tier, a block handed out again after it was written is
    /// demoted first: a copy named in the grant, published (matchable on
    /// the host) at the completion of the step the call named.
    tiered: bool,
    written: HashSet<u32>,
    /// Demotions named and not published yet.
    demotions: Vec<ModelDemotion>,
    /// The last step completed, and the demotions named at a step already
    /// completed, which the cache drops at once (as `take_demotions` does):
    /// the block is evicted without its copy.
    completed: Option<Step>,
    dropped: usize,
    /// Demotions a `discard_unwritten` release dropped.
    discarded: usize,
    /// Growths refused `LENGTH_MISMATCH`: a retry of one applied before.
    mismatches: usize,
    /// Sequences a growth was applied to behind a lost answer: the only
    /// ones the core may grow from a length the cache does not have.
    behind: HashSet<SeqId>,
}

/// A demotion of the model cache, and where the core's passes took it.
struct ModelDemotion {
    /// The step of the Lease or Extend call that named it.
    named: Step,
    block: u32,
    /// The pass that carries the copy, once one was launched with it.
    pass: Option<Step>,
    /// Whether that pass returned.
    ran: bool,
    /// Dropped by a `discard_unwritten` release: never published, whether
    /// its copy runs or not.
    discarded: bool,
}

impl ModelCache {
    fn new(blocks: u32, tokens_per_block: u32, tiered: bool) -> Self {
        Self {
            tokens_per_block,
            total: blocks as usize,
            free: (0..blocks).rev().collect(),
            held: HashMap::new(),
            known: HashMap::new(),
            fenced: Vec::new(),
            refs: HashMap::new(),
            pins: HashMap::new(),
            forks: 0,
            contested_one_in: 6,
            rng: 0x2545_f491_4f6c_dd1d,
            contested: 0,
            tiered,
            written: HashSet::new(),
            demotions: Vec::new(),
            completed: None,
            dropped: 0,
            discarded: 0,
            mismatches: 0,
            behind: HashSet::new(),
        }
    }

    fn take(&mut self, seq_id: SeqId, tokens: u32, delta: bool, step: Step) -> Outcome {
        let (had, mut blocks) = self.held.remove(&seq_id).unwrap_or_default();
        let need = (tokens.div_ceil(self.tokens_per_block) as usize).saturating_sub(blocks.len());
        if need > self.free.len() {
            if !blocks.is_empty() {
                self.held.insert(seq_id, (had, blocks));
            }
            return exhausted(seq_id);
        }
        let new: Vec<u32> = self.free.split_off(self.free.len() - need);
        for &b in &new {
            self.refs.insert(b, 1);
        }
        blocks.extend(&new);
        let mut tier_copies = Vec::new();
        for &b in &new {
            if self.tiered && !self.written.insert(b) {
                if self.completed.is_some_and(|c| step <= c) {
                    self.dropped += 1;
                    continue;
                }
                self.demotions.push(ModelDemotion {
                    named: step,
                    block: b,
                    pass: None,
                    ran: false,
                    discarded: false,
                });
                tier_copies.push(crate::domain::TierCopy {
                    pool_id: 1,
                    window: 0,
                    direction: crate::domain::TierDirection::Demote,
                    device_block: b,
                    host_block: b,
                    disk_block: 0,
                    hash: 0,
                    parent: 0,
                });
            }
        }
        let table = if delta { new } else { blocks.clone() };
        self.held.insert(seq_id, (tokens, blocks));
        Outcome::Grant(Grant {
            capacity_tokens: tokens,
            tier_copies,
            ..grant_of(seq_id, table)
        })
    }

    /// A pass of `step` launched, carrying `copies` (first) and using
    /// `blocks`: no block may be used while its demotion waits for a pass.
    /// Returns how many of the copies a call of an earlier step named.
    fn launched(
        &mut self,
        step: Step,
        copies: &[crate::domain::TierCopy],
        blocks: &HashSet<u32>,
    ) -> usize {
        let mut late = 0;
        for c in copies {
            // the live demotion of the block, else one a discard dropped
            // (the core may still carry its copy, which then runs for
            // nothing)
            let waiting = |d: &ModelDemotion| d.block == c.device_block && d.pass.is_none();
            let i = self
                .demotions
                .iter()
                .position(|d| waiting(d) && !d.discarded)
                .or_else(|| self.demotions.iter().position(waiting))
                .unwrap_or_else(|| {
                    panic!("a copy of block {} the cache did not name", c.device_block)
                });
            self.demotions[i].pass = Some(step);
            late += usize::from(self.demotions[i].named < step);
        }
        for d in &self.demotions {
            assert!(
                d.pass.is_some() || d.discarded || !blocks.contains(&d.block),
                "pass {step} uses block {} before the copy that demotes it (named at {})",
                d.block,
                d.named
            );
        }
        late
    }

    /// The pass of `step` returned: the copies it carried ran.
    fn returned(&mut self, step: Step) {
        for d in &mut self.demotions {
            d.ran |= d.pass == Some(step);
        }
    }

    /// Drops one holder of `block`, turning it into a fence at `fence`.
    fn put_back(&mut self, block: u32, fence: Option<Step>) {
        let refs = self.refs.entry(block).or_default();
        *refs = refs.saturating_sub(1);
        match fence {
            Some(step) => {
                *self.pins.entry(block).or_default() += 1;
                self.fenced.push((step, vec![block]));
            }
            None => self.settle(block),
        }
    }

    fn settle(&mut self, block: u32) {
        let held = self.refs.get(&block).copied().unwrap_or(0) > 0
            || self.pins.get(&block).copied().unwrap_or(0) > 0;
        if !held {
            self.refs.remove(&block);
            self.pins.remove(&block);
            self.free.push(block);
        }
    }

    /// A lease; a fork (`fork_of` a held sequence) shares the parent's
    /// blocks before its last prompt token and copies the next one's
    /// leading slots, whose source stays fenced at the lease's `step`.
    fn lease(&mut self, spec: &LeaseSpec, step: Step) -> Outcome {
        let tokens = spec.prompt_tokens.len() as u32 + spec.extra.total();
        let parent = spec
            .fork_of
            .and_then(|p| self.held.get(&p))
            .map(|(_, b)| b.clone());
        let k = spec.prompt_tokens.len() as u32 - 1;
        let shared: Vec<u32> = parent
            .as_ref()
            .map(|b| {
                b.iter()
                    .take((k / self.tokens_per_block) as usize)
                    .copied()
                    .collect()
            })
            .unwrap_or_default();
        if !shared.is_empty() {
            self.held.insert(spec.seq_id, (0, shared.clone()));
        }
        let outcome = self.take(spec.seq_id, tokens, false, step);
        let Outcome::Grant(mut g) = outcome else {
            self.held.remove(&spec.seq_id);
            return outcome;
        };
        if let Some(parent) = parent {
            self.forks += 1;
            for &b in &shared {
                *self.refs.entry(b).or_default() += 1;
            }
            g.reused_tokens = k / self.tokens_per_block * self.tokens_per_block;
            let slots = k % self.tokens_per_block;
            if let (Some(&src), Some(&dst)) = (
                parent.get(shared.len()),
                g.tables[0].block_ids.get(shared.len()),
            ) && slots > 0
            {
                *self.refs.entry(src).or_default() += 1;
                self.put_back(src, Some(step));
                g.reused_tokens = k;
                g.copies = vec![crate::domain::BlockCopy {
                    pool_id: 1,
                    window: 0,
                    src_block: src,
                    dst_block: dst,
                    tokens: slots,
                }];
            }
        }
        let outcome = Outcome::Grant(g);
        if matches!(outcome, Outcome::Grant(_)) {
            self.known
                .insert(spec.seq_id, spec.prompt_tokens.len() as u32);
        }
        outcome
    }

    fn extend(&mut self, spec: &ExtendSpec, step: Step) -> Outcome {
        let Some((tokens, blocks)) = self.held.get(&spec.seq_id) else {
            return reject(spec.seq_id, RejectReason::UnknownSequence);
        };
        let tokens = *tokens;
        let known = self.known.get(&spec.seq_id).copied().unwrap_or(0);
        if !spec.new_tokens.is_empty() && spec.from_length > 0 && spec.from_length != known {
            // a retry of a growth the cache applied, its answer lost
            assert!(
                self.behind.contains(&spec.seq_id) && spec.from_length < known,
                "sequence {} grows from {}, the cache holds {known} and lost no answer of it",
                spec.seq_id,
                spec.from_length
            );
            self.mismatches += 1;
            return reject(spec.seq_id, RejectReason::LengthMismatch);
        }
        assert!(
            spec.new_tokens.is_empty() || spec.from_length == known,
            "sequence {} grows from {} unchecked, at length {known}",
            spec.seq_id,
            spec.from_length
        );
        let grows = (tokens + spec.new_tokens.len() as u32).div_ceil(self.tokens_per_block)
            > blocks.len() as u32;
        self.rng ^= self.rng << 13;
        self.rng ^= self.rng >> 7;
        self.rng ^= self.rng << 17;
        if grows && self.rng.is_multiple_of(self.contested_one_in) {
            self.contested += 1;
            return exhausted(spec.seq_id);
        }
        let outcome = self.take(
            spec.seq_id,
            tokens + spec.new_tokens.len() as u32,
            true,
            step,
        );
        if matches!(outcome, Outcome::Grant(_)) {
            *self.known.entry(spec.seq_id).or_default() += spec.new_tokens.len() as u32;
        }
        outcome
    }

    /// A Lease or Extend call applied here whose answer was lost: its
    /// grants put the core behind the cache.
    fn answer_lost(&mut self, outcomes: &[Outcome]) {
        for outcome in outcomes {
            if let Outcome::Grant(g) = outcome {
                self.behind.insert(g.seq_id);
            }
        }
    }

    fn release(&mut self, batch: &ReleaseBatch) {
        if batch.discard_unwritten {
            // every demotion of an incomplete step is dropped
            for d in self.demotions.iter_mut().filter(|d| !d.discarded) {
                d.discarded = true;
                self.discarded += 1;
            }
        }
        for seq_id in &batch.seq_ids {
            self.known.remove(seq_id);
            self.behind.remove(seq_id);
            if let Some((_, blocks)) = self.held.remove(seq_id) {
                for b in blocks {
                    self.put_back(b, batch.fence_step);
                }
            }
        }
    }

    fn complete_step(&mut self, step: Step) {
        // the demotions of steps up to it are published: their copies ran
        for d in self.demotions.iter().filter(|d| d.named <= step) {
            assert!(
                d.ran || d.discarded,
                "CompleteStep({step}) publishes the demotion of block {} (named at {}) whose copy {}",
                d.block,
                d.named,
                match d.pass {
                    Some(p) => format!("rides pass {p}, which has not run (in flight, or failed)"),
                    None => "no pass carries yet".into(),
                }
            );
        }
        self.demotions.retain(|d| d.named > step);
        self.completed = Some(self.completed.map_or(step, |c| c.max(step)));
        let (due, parked): (Vec<_>, Vec<_>) = std::mem::take(&mut self.fenced)
            .into_iter()
            .partition(|(s, _)| *s <= step);
        self.fenced = parked;
        for b in due.into_iter().flat_map(|(_, b)| b) {
            if let Some(pins) = self.pins.get_mut(&b) {
                *pins = pins.saturating_sub(1);
            }
            self.settle(b);
        }
    }
}

/// The forward passes in flight in [`drive`], oldest first: each one's
/// step and batches.
type InFlight = VecDeque<(Step, Vec<(usize, Vec<ForwardItem>)>)>;

/// The token the model worker answers now and then: every request stops on
/// it, so sequences end while a later pass of theirs is in flight.
const STOP: u32 = 99;

/// What a run of [`drive`] exercised, so a test can tell it was not vacuous.
#[derive(Debug, Default)]
struct Exercised {
    grants: usize,
    /// Releases sent while a forward pass was in flight.
    released_in_flight: usize,
    completes: usize,
    finished: usize,
    /// Extend items sent while a forward pass was in flight.
    extended_in_flight: usize,
    /// Decodes launched before the cache knew the token they feed.
    launched_ahead: usize,
    /// Extends refused while a forward pass was in flight.
    refused_in_flight: usize,
    /// Decodes launched behind a pass of theirs in flight, fed its sample.
    fed: usize,
    /// Requests that stopped (a stop token) with a later pass in flight.
    stopped_in_flight: usize,
    /// Samples forked from their parent's blocks.
    forks: usize,
    /// Beam passes answered with a row (the search then forks, prunes,
    /// continues or ends beams).
    beam_rows: usize,
    /// The most passes in flight at once.
    deepest: usize,
    /// Settles whose answer the core took after it began the next step
    /// (sent after a launch, applied once the next pass is collected).
    settled_late: usize,
    /// Host-tier demotions the passes carried, and of those the ones a
    /// pass of a later step than the call that named them carried.
    demotions: usize,
    late_demotions: usize,
    /// Passes the model worker failed (one in 150 at random, and a pass fed
    /// from a failed one, as the worker fails it).
    failed_passes: usize,
    /// Demotions dropped by the discard a failed pass sends.
    discarded: usize,
    /// Cache calls that failed (one in 40), and of those the ones the cache
    /// had applied (their answer lost).
    failed_calls: usize,
    lost_answers: usize,
    /// Growths the model cache refused `LENGTH_MISMATCH` (a retry of one a
    /// lost answer had applied).
    mismatches: usize,
}

/// A settle's `Step` call the cache answered and the core has not taken
/// yet: the step loop sends it after a launch and applies its answer once
/// it needs it (`StepLoop::settled`).
struct Settling {
    /// The step the call was sent in.
    step: Step,
    /// The step its extends name (the last pass launched).
    named: Step,
    batch: crate::step::ReleaseBatch,
    completed: Option<Step>,
    outcomes: Option<Vec<Outcome>>,
    /// The call failed: no part of it is taken as done (the cache may
    /// have applied it).
    failed: bool,
}

impl Settling {
    fn apply(self, c: &mut Core, seen: &mut Exercised) {
        if c.step() != self.step {
            seen.settled_late += 1;
        }
        if self.failed {
            if !self.batch.is_empty() {
                c.release_failed(self.batch, crate::step::CallFailure::Unanswered);
            }
            if self.outcomes.is_some() {
                c.extends_failed();
            }
            return;
        }
        if !self.batch.is_empty() {
            c.releases_sent(self.batch);
        }
        if let Some(step) = self.completed {
            c.step_completed(step);
        }
        if let Some(outcomes) = self.outcomes {
            c.apply_extends(self.named, outcomes);
        }
    }
}

/// Every item of a launch writes only blocks the cache holds for its
/// sequence, at positions inside the slots its lease covers, and starts
/// where its item in the passes still in flight ends; a fed decode follows
/// an item of its sequence in the group's pass it names (`follows`), which
/// the worker runs first, and every pass follows that group's last one in
/// flight.
fn check_launch(
    batches: &[(usize, Vec<ForwardItem>)],
    follows: &[Option<Step>],
    in_flight: &InFlight,
    cache: &ModelCache,
    seen: &mut Exercised,
) {
    for ((g, items), after) in batches.iter().zip(follows) {
        let last = in_flight
            .iter()
            .rev()
            .find(|(_, b)| b.iter().any(|(bg, _)| bg == g))
            .map(|(s, _)| *s);
        assert_eq!(
            *after, last,
            "group {g}'s pass must follow its last one in flight"
        );
        for item in items {
            // the end of this sequence's item in the latest pass in flight
            let before = in_flight.iter().rev().find_map(|(step, b)| {
                b.iter()
                    .filter(|(bg, _)| bg == g)
                    .flat_map(|(_, i)| i)
                    .find(|i| i.seq_id == item.seq_id)
                    .map(|i| (*step, i.start_pos + i.tokens.len().max(1) as u32))
            });
            if item.feed_previous {
                // beam passes (the only ones asking logprobs here) are fed
                // the search's token, never the worker's pick
                assert!(
                    item.logprobs.is_none(),
                    "beam sequence {} fed the worker's pick",
                    item.seq_id
                );
                seen.fed += 1;
                assert!(item.tokens.is_empty(), "a fed decode carries no token");
                let (step, end) = before.unwrap_or_else(|| {
                    panic!("sequence {} fed with no pass of it in flight", item.seq_id)
                });
                assert_eq!(Some(step), *after, "fed from the pass it follows");
                assert_eq!(end, item.start_pos, "sequence {}", item.seq_id);
            } else if let Some((_, end)) = before {
                assert_eq!(end, item.start_pos, "sequence {}", item.seq_id);
            }
        }
    }
    for item in batches.iter().flat_map(|(_, items)| items) {
        let Some((capacity, blocks)) = cache.held.get(&item.seq_id) else {
            panic!("sequence {} launched without a lease", item.seq_id);
        };
        for block in item.tables.iter().flat_map(|t| &t.block_ids) {
            assert!(
                blocks.contains(block),
                "sequence {} launched on block {block}, which the cache does not hold for it",
                item.seq_id
            );
        }
        let end = item.start_pos + item.tokens.len().max(1) as u32;
        assert!(
            end <= *capacity,
            "sequence {} writes through position {end} but its lease covers {capacity} slots",
            item.seq_id
        );
        let known = cache.known.get(&item.seq_id).copied().unwrap_or(0);
        if item.tokens.len() <= 1 && known <= item.start_pos {
            seen.launched_ahead += 1;
        }
    }
}

/// Drives a core the way the step loop does, executing the core's
/// [`StepPlan`] for `order`, against the model cache, with clients that come and go at random (seeded); a forward pass
/// is "in flight" from `plan_forward` until its results are applied. Panics
/// the moment a block reaches a sequence while an in-flight forward pass
/// reads it for another, or a `CompleteStep` names a step whose forward is
/// in flight.
fn drive(order: Order, seed: u64) -> Exercised {
    let mut rng = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let mut rand = move |n: u64| {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng % n
    };
    // the loop's lookahead: the overlap orders plan ahead on it
    // every other seed with a host tier: blocks handed out again are
    // demoted first
    let tiered = seed % 2 == 1;
    let mut geometry = group(24);
    if tiered {
        geometry.pools[0].host_blocks = 400;
    }
    let mut c = Core::new(
        CoreConfig {
            lookahead: order.lookahead(),
            order,
            // prompts of 3-12 tokens run in up to three chunks
            prefill_chunk: 4,
            ..CoreConfig::default()
        },
        vec![geometry],
    );
    let mut cache = ModelCache::new(24, 4, tiered);
    let mut in_flight: InFlight = VecDeque::new();
    let mut seen = Exercised::default();
    let mut next_id = 1;
    // the extends `Plan` kept for the settle after a launch: a pipelined
    // step that only adds a pass leaves them to a later step's settle, as
    // the loop does (`StepLoop::planned_extends`)
    let mut planned: Option<Vec<ExtendSpec>> = None;
    // a settle the cache answered, its answer not applied yet
    let mut settling: Option<Settling> = None;
    // the pass each launched pass follows, and the passes that failed
    let mut followed: HashMap<Step, Option<Step>> = HashMap::new();
    let mut failed: HashSet<Step> = HashSet::new();
    let settled = |c: &mut Core, settling: &mut Option<Settling>, seen: &mut Exercised| {
        if let Some(answer) = settling.take() {
            answer.apply(c, seen);
        }
    };

    /// Every block a grant hands out that no other sequence holds (a fork
    /// shares its parent's, which the parent's passes read) is read by no
    /// pass in flight for another sequence.
    fn check_grants(
        outcomes: &[Outcome],
        cache: &ModelCache,
        in_flight: &InFlight,
        seen: &mut Exercised,
    ) {
        for outcome in outcomes {
            let Outcome::Grant(g) = outcome else {
                continue;
            };
            seen.grants += 1;
            for (step, batches) in in_flight {
                let fresh = g
                    .tables
                    .iter()
                    .flat_map(|t| &t.block_ids)
                    .filter(|b| cache.refs.get(b).copied() == Some(1));
                for block in fresh {
                    for item in batches.iter().flat_map(|(_, items)| items) {
                        let reads = item.tables.iter().any(|t| t.block_ids.contains(block));
                        assert!(
                            item.seq_id == g.seq_id || !reads,
                            "block {block} granted to sequence {} while forward {step} still reads it for sequence {}",
                            g.seq_id,
                            item.seq_id
                        );
                    }
                }
            }
        }
    }
    // Whether a call to the cache reaches it (`applies`) and answers: one
    // in 40 fails, half of those after the cache applied it.
    fn reaches(fails: bool, applied: bool, seen: &mut Exercised) -> (bool, bool) {
        if !fails {
            return (true, true);
        }
        seen.failed_calls += 1;
        seen.lost_answers += usize::from(applied);
        (applied, false)
    }
    let complete = |c: &mut Core,
                    cache: &mut ModelCache,
                    in_flight: &InFlight,
                    seen: &mut Exercised,
                    (fails, applied): (bool, bool)| {
        if let Some(step) = c.complete_through() {
            if let Some((running, _)) = in_flight.front() {
                assert!(
                    step < *running,
                    "CompleteStep({step}) sent while forward {running} is in flight"
                );
            }
            let (applies, answered) = reaches(fails, applied, seen);
            if applies {
                cache.complete_step(step);
            }
            if answered {
                c.step_completed(step);
                seen.completes += 1;
            }
        }
    };
    let flush = |c: &mut Core,
                 cache: &mut ModelCache,
                 in_flight: &InFlight,
                 seen: &mut Exercised,
                 (fails, applied): (bool, bool)| {
        let batch = c.take_releases();
        if batch.is_empty() {
            return;
        }
        if !in_flight.is_empty() {
            seen.released_in_flight += 1;
        }
        let (applies, answered) = reaches(fails, applied, seen);
        if applies {
            cache.release(&batch);
        }
        if answered {
            c.releases_sent(batch);
        } else {
            c.release_failed(batch, crate::step::CallFailure::Unanswered);
        }
    };

    for _ in 0..3_000 {
        // the loop's top: clients arrive and go away, with a forward pass
        // possibly in flight; a retry of CompleteStep may come at any time
        if next_id <= 80 && rand(2) == 0 {
            let prompt = 3 + rand(10) as usize;
            let mut r = request(next_id, prompt, 2 + rand(8) as u32);
            r.stop_tokens = vec![STOP];
            // a request of several samples now and then: they fork
            match rand(6) {
                0 | 1 => r.n = 2 + rand(2) as u32,
                // a beam search now and then: its beams fork, diverge,
                // end and are pruned
                2 => {
                    r.beam_width = 2 + rand(2) as u32;
                    r.n = 1 + rand(2) as u32;
                }
                _ => {}
            }
            c.submit(r);
            next_id += 1;
        }
        let live = c.live_requests();
        if !live.is_empty() && rand(4) == 0 {
            c.cancel(live[rand(live.len() as u64) as usize], "gone");
        }
        // (never while a settle's Step call is on its way: the loop makes
        // one call to the cache at a time)
        if rand(3) == 0 && settling.is_none() {
            let fail = (rand(40) == 0, rand(2) == 0);
            complete(&mut c, &mut cache, &in_flight, &mut seen, fail);
        }
        if c.is_quiet() && in_flight.is_empty() {
            if next_id > 80 {
                break;
            }
            continue;
        }
        let step = c.begin_step();
        let admit = |c: &mut Core,
                     cache: &mut ModelCache,
                     in_flight: &InFlight,
                     seen: &mut Exercised,
                     (fails, applied): (bool, bool)| {
            let specs = c.plan_admission();
            if specs.is_empty() {
                return;
            }
            let step = c.step();
            let (applies, answered) = reaches(fails, applied, seen);
            let outcomes: Vec<Outcome> = if applies {
                specs.iter().map(|s| cache.lease(s, step)).collect()
            } else {
                Vec::new()
            };
            if answered {
                check_grants(&outcomes, cache, in_flight, seen);
                c.apply_leases(outcomes);
            } else {
                c.leases_failed();
            }
        };
        let extend = |cache: &mut ModelCache,
                      specs: Vec<ExtendSpec>,
                      step: Step,
                      in_flight: &InFlight,
                      seen: &mut Exercised|
         -> Vec<Outcome> {
            let contested = cache.contested;
            // the cache refuses a batch naming a sequence twice
            // (`DUPLICATE_SEQUENCE`): the core must never send one
            let mut named = HashSet::new();
            for s in &specs {
                assert!(
                    named.insert(s.seq_id),
                    "one extend batch names sequence {} twice: {specs:?}",
                    s.seq_id
                );
            }
            let outcomes: Vec<Outcome> = specs.iter().map(|s| cache.extend(s, step)).collect();
            if !in_flight.is_empty() {
                seen.extended_in_flight += specs.len();
                seen.refused_in_flight += cache.contested - contested;
            }
            check_grants(&outcomes, cache, in_flight, seen);
            outcomes
        };
        // the loop's order, from the core: this driver only executes it
        let mut plan = StepPlan::new(order, in_flight.len());
        while let Some(call) = plan.next_call() {
            // the loop's rule: a settle's answer is applied before the core
            // plans or applies more, and before another call to the cache
            let settle_first = match call {
                Call::FlushReleases => c.has_releases(),
                Call::Admit => c.may_admit(),
                Call::Collect => false,
                _ => true,
            };
            if settle_first {
                settled(&mut c, &mut settling, &mut seen);
            }
            let fail = (rand(40) == 0, rand(2) == 0);
            match call {
                Call::FlushReleases => flush(&mut c, &mut cache, &in_flight, &mut seen, fail),
                Call::Admit => admit(&mut c, &mut cache, &in_flight, &mut seen, fail),
                Call::Extend => {
                    // (the loop makes no call without extends)
                    let specs = c.plan_extends(false);
                    if !specs.is_empty() {
                        let (applies, answered) = reaches(fail.0, fail.1, &mut seen);
                        let outcomes = if applies {
                            extend(&mut cache, specs, step, &in_flight, &mut seen)
                        } else {
                            Vec::new()
                        };
                        if answered {
                            c.apply_extends(c.step(), outcomes);
                        } else {
                            cache.answer_lost(&outcomes);
                            // as the loop: the answered calls' outcomes
                            // (none here), then the failure
                            c.apply_extends(c.step(), Vec::new());
                            c.extends_failed();
                        }
                    }
                }
                // a pipelined step that only adds a pass leaves its
                // planned extends to the next settle
                Call::Plan => planned
                    .get_or_insert_with(Vec::new)
                    .extend(c.plan_extends(true)),
                Call::Launch => {
                    let batches = c.plan_forward();
                    let follows: Vec<Option<Step>> =
                        batches.iter().map(|(g, _)| c.follows(*g)).collect();
                    check_launch(&batches, &follows, &in_flight, &cache, &mut seen);
                    // each group's pass runs the tier copies it carries
                    // first (as the loop sends them)
                    for (g, items) in &batches {
                        let copies = c.take_tier_copies(*g);
                        seen.demotions += copies.len();
                        let blocks: HashSet<u32> = items
                            .iter()
                            .flat_map(|i| i.tables.iter().flat_map(|t| t.block_ids.iter().copied()))
                            .collect();
                        seen.late_demotions += cache.launched(step, &copies, &blocks);
                    }
                    plan.launched(!batches.is_empty());
                    if !batches.is_empty() {
                        followed.insert(step, follows.iter().flatten().copied().max());
                        in_flight.push_back((step, batches));
                        assert!(
                            in_flight.len() <= order.depth(),
                            "{} passes in flight in {order:?}",
                            in_flight.len()
                        );
                        seen.deepest = seen.deepest.max(in_flight.len());
                    }
                }
                Call::Collect => {
                    if let Some((pass, batches)) = in_flight.pop_front() {
                        // the pass's answer is in: the settle sent meanwhile
                        // is applied first
                        settled(&mut c, &mut settling, &mut seen);
                        let later: HashSet<SeqId> = in_flight
                            .iter()
                            .flat_map(|(_, b)| b.iter().flat_map(|(_, i)| i))
                            .map(|i| i.seq_id)
                            .collect();
                        let mut pass_failed = false;
                        for (g, items) in batches {
                            // the worker fails a pass now and then, and one
                            // that feeds from a failed pass
                            let fed = items.iter().any(|i| i.feed_previous);
                            let after_failed = followed
                                .get(&pass)
                                .copied()
                                .flatten()
                                .is_some_and(|f| failed.contains(&f));
                            if rand(150) == 0 || (fed && after_failed) {
                                pass_failed = true;
                                seen.failed_passes += 1;
                                c.forward_failed(g, "the model worker failed");
                                continue;
                            }
                            let mut answer = results(&items, 7, false);
                            for (r, item) in answer.iter_mut().zip(&items) {
                                if let Some(l) = item.logprobs {
                                    // a beam's row: distinct tokens, the most
                                    // likely first, the stop token sometimes
                                    let base = rand(40) as u32;
                                    let stop_at = rand(2 * u64::from(l.top)) as u32;
                                    let top = (0..l.top)
                                        .map(|k| {
                                            let t = if k == stop_at {
                                                STOP
                                            } else {
                                                1 + (base + k) % 60
                                            };
                                            (t, -0.5 * k as f32 - rand(50) as f32 / 100.0)
                                        })
                                        .collect();
                                    r.logprobs = vec![crate::domain::TokenLogprob {
                                        token: r.next_token,
                                        logprob: 0.0,
                                        top,
                                    }];
                                    seen.beam_rows += 1;
                                    continue;
                                }
                                if rand(8) == 0 {
                                    r.next_token = STOP;
                                    seen.stopped_in_flight +=
                                        usize::from(later.contains(&r.seq_id));
                                }
                            }
                            c.apply_forward(g, answer);
                        }
                        if pass_failed {
                            failed.insert(pass);
                        } else {
                            cache.returned(pass);
                        }
                        seen.finished += finishes(&c.drain_outputs()).len();
                    }
                }
                // the cache applies a Step call's parts in this order
                Call::Settle {
                    extend: with_extends,
                } => {
                    // the cache answers at once; the core takes the answer
                    // now without a pass in flight, else where the loop
                    // does (`settled` above)
                    let batch = c.take_releases();
                    // the extends name the last pass launched, and the
                    // completion goes before them: only of a step before it
                    let named = c.settle_step(step);
                    let specs = with_extends.then(|| match planned.take() {
                        Some(planned) => c.settle_extends(planned),
                        None => c.plan_extends(false),
                    });
                    let extends = specs.as_ref().is_some_and(|s| !s.is_empty());
                    let completed = c.complete_before(extends.then_some(named));
                    // the loop makes no call for a settle with nothing in it
                    let empty = batch.is_empty() && completed.is_none() && !extends;
                    let (applies, answered) = if empty {
                        (false, true)
                    } else {
                        reaches(fail.0, fail.1, &mut seen)
                    };
                    if !batch.is_empty() && applies {
                        seen.released_in_flight += usize::from(!in_flight.is_empty());
                        cache.release(&batch);
                    }
                    if let Some(step) = completed {
                        if let Some((running, _)) = in_flight.front() {
                            assert!(
                                step < *running,
                                "CompleteStep({step}) sent while forward {running} is in flight"
                            );
                        }
                        if applies {
                            cache.complete_step(step);
                        }
                        seen.completes += usize::from(answered);
                    }
                    let outcomes = specs.filter(|s| !s.is_empty()).map(|specs| {
                        if applies {
                            extend(&mut cache, specs, named, &in_flight, &mut seen)
                        } else {
                            Vec::new()
                        }
                    });
                    if !answered {
                        cache.answer_lost(outcomes.as_deref().unwrap_or_default());
                    }
                    let answer = Settling {
                        step,
                        named,
                        batch,
                        completed,
                        outcomes,
                        failed: !answered,
                    };
                    if !empty && in_flight.is_empty() {
                        answer.apply(&mut c, &mut seen);
                    } else if !empty {
                        settling = Some(answer);
                    }
                }
                Call::RetryComplete => complete(&mut c, &mut cache, &in_flight, &mut seen, fail),
            }
        }
    }
    assert!(
        c.is_quiet() && in_flight.is_empty() && settling.is_none(),
        "the run did not drain"
    );
    assert!(
        cache.demotions.is_empty(),
        "every demotion published by the run's end"
    );
    assert_eq!(
        cache.dropped, 0,
        "demotions named at a step the core had completed (the cache drops them)"
    );
    assert_eq!(
        cache.free.len(),
        cache.total,
        "every block back after the run: {} held, {} fenced",
        cache.held.len(),
        cache.fenced.len()
    );
    seen.forks = cache.forks;
    seen.discarded = cache.discarded;
    seen.mismatches = cache.mismatches;
    seen
}

/// [`drive`] over 40 seeds, everything each run exercised added up.
fn drive_seeds(order: Order) -> Exercised {
    let mut total = Exercised::default();
    for seed in 1..=40 {
        let seen = drive(order, seed);
        total.grants += seen.grants;
        total.released_in_flight += seen.released_in_flight;
        total.completes += seen.completes;
        total.finished += seen.finished;
        total.extended_in_flight += seen.extended_in_flight;
        total.launched_ahead += seen.launched_ahead;
        total.refused_in_flight += seen.refused_in_flight;
        total.fed += seen.fed;
        total.stopped_in_flight += seen.stopped_in_flight;
        total.forks += seen.forks;
        total.beam_rows += seen.beam_rows;
        total.deepest = total.deepest.max(seen.deepest);
        total.settled_late += seen.settled_late;
        total.demotions += seen.demotions;
        total.late_demotions += seen.late_demotions;
        total.failed_passes += seen.failed_passes;
        total.discarded += seen.discarded;
        total.failed_calls += seen.failed_calls;
        total.lost_answers += seen.lost_answers;
        total.mismatches += seen.mismatches;
    }
    total
}

impl Exercised {
    /// Whether failed cache calls were exercised: answered and not, and
    /// growths retried after a lost answer the cache had applied.
    fn failed_calls_enough(&self) -> bool {
        self.failed_calls > 100
            && self.lost_answers > 50
            && self.failed_calls - self.lost_answers > 50
            && self.mismatches > 10
    }

    /// Whether the runs of an overlap order (`pipelined`: one that feeds
    /// decodes behind passes in flight) exercised every case.
    fn overlapped_enough(&self, pipelined: bool) -> bool {
        self.released_in_flight > 100
            && self.grants > 1_000
            && self.completes > 1_000
            && self.extended_in_flight > 1_000
            && self.launched_ahead > 1_000
            && self.refused_in_flight > 100
            && self.forks > 100
            && self.beam_rows > 100
            && self.settled_late > 1_000
            && self.demotions > 1_000
            && self.late_demotions > 100
            && self.failed_passes > 10
            && self.discarded > 10
            && self.failed_calls_enough()
            && (!pipelined || (self.fed > 1_000 && self.stopped_in_flight > 100))
    }
}

#[test]
fn overlap_no_block_reaches_another_sequence_before_the_forward_that_could_read_it_returned() {
    let total = drive_seeds(Order::Overlap);
    assert!(
        total.overlapped_enough(false),
        "the runs exercised too little: {total:?}"
    );
}

#[test]
fn pipelined_no_block_reaches_another_sequence_before_every_forward_that_could_read_it_returned() {
    for depth in 2..=crate::step::MAX_PIPELINE_DEPTH {
        let total = drive_seeds(Order::Pipelined { depth });
        assert!(
            total.overlapped_enough(true),
            "depth {depth}: the runs exercised too little: {total:?}"
        );
        assert_eq!(
            total.deepest, depth as usize,
            "the pipeline never filled to its depth"
        );
    }
}

#[test]
fn plain_no_block_reaches_another_sequence_early_and_every_fenced_block_comes_back() {
    let total = drive_seeds(Order::Plain);
    assert_eq!(
        (total.released_in_flight, total.extended_in_flight),
        (0, 0),
        "nothing is in flight at a release or an extend"
    );
    assert_eq!(total.launched_ahead, 0, "every decode waits for its extend");
    assert_eq!(total.fed, 0, "nothing is fed without a pass in flight");
    assert_eq!(
        total.late_demotions, 0,
        "every demotion rides the pass of the step that named it"
    );
    assert!(
        total.grants > 1_000
            && total.completes > 1_000
            && total.finished > 1_000
            && total.forks > 100
            && total.beam_rows > 100
            && total.demotions > 1_000
            && total.failed_passes > 10
            && total.discarded > 10
            && total.failed_calls_enough(),
        "the runs exercised too little: {total:?}"
    );
}
