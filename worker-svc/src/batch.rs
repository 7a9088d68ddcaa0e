//! A Forward batch in domain terms, and its validation.
//!
//! [`validate`] checks the whole batch against the model, the arena and the
//! slot ledger before anything is written, and turns it into a [`Batch`]
//! whose tables are indexed by pool and whose every position is known to
//! lie in a listed, in-range block.

use std::collections::HashSet;

use crate::arena::{ArenaLayout, SlotLedger};
use crate::error::{Error, Result, SeqProblem};
use crate::model::ModelConfig;
use crate::ops::window_start;
use kvlease_tokenizer::grammar::Constraint;

/// The most alternatives a logprobs row may ask for (OpenAI's chat
/// `top_logprobs` maximum).
pub const MAX_TOP_LOGPROBS: usize = 20;

/// Limits on one Forward batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Sequences per batch.
    pub max_batch_sequences: usize,
    /// Input tokens per batch, all sequences together.
    pub max_batch_tokens: usize,
}

/// Sampling of the next token (`sampling` says how each parameter acts).
#[derive(Debug, Clone, PartialEq)]
pub struct Sampling {
    /// 0 = greedy.
    pub temperature: f32,
    /// Nucleus mass in (0, 1]; 0 is read as 1.
    pub top_p: f32,
    /// Keep the `top_k` most likely tokens; 0 = off.
    pub top_k: u32,
    /// Keep tokens at least `min_p` times as likely as the most likely; 0 = off.
    pub min_p: f32,
    /// Seed of the sequence's sampler.
    pub seed: u64,
    /// Frequency, presence and repetition penalties.
    pub penalties: Penalties,
    /// Added to these tokens' logits, ascending by token, each token once.
    pub logit_bias: Vec<(u32, f32)>,
    /// Positions before this are the prompt.
    pub prompt_len: u32,
    /// No token of `stop_ids` while fewer outputs than this precede the
    /// sampled position.
    pub min_tokens: u32,
    /// The end and stop tokens `min_tokens` holds back.
    pub stop_ids: Vec<u32>,
    /// The output follows a grammar whose matcher the worker keeps
    /// (`grammar`); only tokens it allows are picked.
    pub constrained: bool,
}

impl Sampling {
    /// Greedy decoding.
    pub const GREEDY: Sampling = Sampling {
        temperature: 0.0,
        top_p: 1.0,
        top_k: 0,
        min_p: 0.0,
        seed: 0,
        penalties: Penalties::NONE,
        logit_bias: Vec::new(),
        prompt_len: 0,
        min_tokens: 0,
        stop_ids: Vec::new(),
        constrained: false,
    };
}

/// The log-probabilities a sequence asks of a pass (`LogprobsParams` in
/// `worker.proto`; [`crate::logprobs`] says how they are computed).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LogprobsSpec {
    /// Alternatives per position, at most [`MAX_TOP_LOGPROBS`].
    pub top: u32,
    /// Every input position, not only the last: position `i`'s chosen
    /// token is `tokens[i + 1]`, the last one's the picked token (or
    /// `next_prompt_token`).
    pub prompt: bool,
    /// With `prompt`, for a chunk of a prompt that goes on: the token after
    /// the chunk, chosen at its last position instead of the picked one.
    pub next_prompt_token: Option<u32>,
}

/// Penalties on tokens a sequence already holds (OpenAI's frequency and
/// presence over its output, HF's repetition over prompt and output).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Penalties {
    /// Subtracted once per occurrence in the output.
    pub frequency: f32,
    /// Subtracted once if the token occurs in the output.
    pub presence: f32,
    /// A positive logit divided by it, a negative one multiplied; 1 = off.
    pub repetition: f32,
}

impl Penalties {
    /// No penalty.
    pub const NONE: Penalties = Penalties {
        frequency: 0.0,
        presence: 0.0,
        repetition: 1.0,
    };

    /// Whether any penalty applies (the sequence's token counts are kept).
    pub fn any(&self) -> bool {
        *self != Self::NONE
    }
}

/// One block table as the request gives it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TableInput {
    /// The pool's window (identifies the pool).
    pub window: u32,
    /// Beam index; must be 0.
    pub beam: u32,
    /// Block index of `block_ids[0]`.
    pub first_block: u32,
    /// Block ids in sequence order.
    pub block_ids: Vec<u32>,
}

/// One sequence of a Forward request.
#[derive(Debug, Clone, PartialEq)]
pub struct SeqInput {
    /// The scheduler's id, unique in the batch.
    pub seq_id: u64,
    /// Tokens to run.
    pub tokens: Vec<u32>,
    /// Position of `tokens[0]`.
    pub start_pos: u32,
    /// One table per pool.
    pub tables: Vec<TableInput>,
    /// Compute logits (and argmax) at every input position, not just the last.
    pub all_positions: bool,
    /// Log-probabilities to return; `None`: none.
    pub logprobs: Option<LogprobsSpec>,
    /// How to pick the next token.
    pub sampling: Sampling,
    /// Partial-block copies to apply before the pass.
    pub copies: Vec<CopyInput>,
    /// The tokens at positions `[0, start_pos)`, for penalties
    /// (`TokenHistory`); `None` when the worker keeps them.
    pub history: Option<Vec<u32>>,
    /// A constrained sequence's grammar, on its first pass (with its
    /// history), or why the message holds none; `None` when the worker
    /// keeps its matcher.
    pub grammar: Option<std::result::Result<Constraint, String>>,
}

/// A partial-block copy as the request gives it: slots `[0, tokens)` of
/// `src_block` into `dst_block`, every layer of the pool of `window`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CopyInput {
    /// The pool's window (identifies the pool).
    pub window: u32,
    /// Block to read.
    pub src_block: u32,
    /// Block to write.
    pub dst_block: u32,
    /// Slots to copy, from slot 0.
    pub tokens: u32,
}

/// A validated copy: slots `[0, slots)` of block `src` into block `dst` of
/// pool `pool`, every layer, K and V, every head; the source slots hold K/V
/// and nothing in the batch writes the source.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvCopy {
    /// Pool index (`ArenaLayout::pools`).
    pub pool: usize,
    /// Block read.
    pub src: u32,
    /// Block written.
    pub dst: u32,
    /// Slots copied.
    pub slots: usize,
}

/// Which way a tier copy goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TierDirection {
    /// Device block -> host block.
    Demote,
    /// Host block -> device block.
    Onboard,
    /// Host block -> disk block (a block file; see `disk`).
    Spill,
    /// Disk block -> device block.
    Load,
}

/// A host-tier copy as the request gives it: one whole block of the pool of
/// `window`, between its device arena and its host tier.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TierCopyInput {
    /// The pool's window (identifies the pool).
    pub window: u32,
    /// Which way.
    pub direction: TierDirection,
    /// Block of the device arena.
    pub device_block: u32,
    /// Block of the host tier.
    pub host_block: u32,
    /// The disk side of a `Spill` or `Load` (default otherwise).
    pub disk: DiskRef,
}

/// The disk block of a `Spill` or `Load` and the content it holds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DiskRef {
    /// The disk block (file slot).
    pub block: u32,
    /// The prefix hash of the content.
    pub hash: u64,
    /// Its parent's hash.
    pub parent: u64,
}

/// A validated disk copy: pool index resolved, blocks in range.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DiskMove {
    /// Pool index (`ArenaLayout::pools`).
    pub pool: usize,
    /// The host block (`Spill`) or device block (`Load`).
    pub block: u32,
    /// The disk block and its content.
    pub disk: DiskRef,
}

/// A request's tier copies, validated and in the order they run.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TierPlan {
    /// Host -> disk, first (a demotion may overwrite their host blocks).
    pub spills: Vec<DiskMove>,
    /// Device <-> host: every demotion, then every onboarding.
    pub moves: Vec<TierMove>,
    /// Disk -> device, last.
    pub loads: Vec<DiskMove>,
}

/// A validated host-tier copy (pool index resolved, blocks in range).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TierMove {
    /// Pool index (`ArenaLayout::pools`).
    pub pool: usize,
    /// Which way.
    pub direction: TierDirection,
    /// Device block.
    pub device: u32,
    /// Host block.
    pub host: u32,
}

/// Checks a request's tier copies against the device arena, the host tier
/// (`host.pools[i].num_blocks` host blocks in pool `i`) and the disk tier
/// (`disk_blocks` in every pool, 0: none) and puts them in the order they
/// run: every spill, every demotion, every onboarding, every load, each in
/// request order. An error names the copy; nothing is copied.
pub fn validate_tier_copies(
    copies: &[TierCopyInput],
    device: &ArenaLayout,
    host: &ArenaLayout,
    disk_blocks: u32,
) -> Result<TierPlan> {
    let mut plan = TierPlan::default();
    let mut moves = Vec::with_capacity(copies.len());
    for (index, c) in copies.iter().enumerate() {
        let bad = |message: String| Error::InvalidTierCopy { index, message };
        let Some(pool) = device.pool_of_window(c.window) else {
            return Err(bad(format!("the model has no pool of window {}", c.window)));
        };
        let (blocks, host_blocks) = (
            device.pools[pool].num_blocks,
            host.pools.get(pool).map_or(0, |p| p.num_blocks),
        );
        if host_blocks == 0 {
            return Err(bad(format!(
                "the pool of window {} has no host tier (start the worker with --host-blocks)",
                c.window
            )));
        }
        let disk = matches!(c.direction, TierDirection::Spill | TierDirection::Load);
        if disk && disk_blocks == 0 {
            return Err(bad(
                "the worker has no disk tier (start it with --disk-tier-dir)".to_owned(),
            ));
        }
        if disk && c.disk.block >= disk_blocks {
            return Err(bad(format!(
                "disk_block {} is out of range (the disk tier has {disk_blocks})",
                c.disk.block
            )));
        }
        let uses_device = c.direction != TierDirection::Spill;
        if uses_device && c.device_block >= blocks {
            return Err(bad(format!(
                "device_block {} is out of range (the pool has {blocks})",
                c.device_block
            )));
        }
        if c.direction == TierDirection::Load {
            plan.loads.push(DiskMove {
                pool,
                block: c.device_block,
                disk: c.disk,
            });
            continue;
        }
        if c.host_block >= host_blocks {
            return Err(bad(format!(
                "host_block {} is out of range (the host tier has {host_blocks})",
                c.host_block
            )));
        }
        if c.direction == TierDirection::Spill {
            plan.spills.push(DiskMove {
                pool,
                block: c.host_block,
                disk: c.disk,
            });
            continue;
        }
        moves.push(TierMove {
            pool,
            direction: c.direction,
            device: c.device_block,
            host: c.host_block,
        });
    }
    // Stable: demotions keep their order, then onboardings keep theirs.
    moves.sort_by_key(|m| m.direction == TierDirection::Onboard);
    plan.moves = moves;
    Ok(plan)
}

/// A validated table: block index `first_block + i` is `block_ids[i]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolTable {
    /// Block index of `block_ids[0]`.
    pub first_block: usize,
    /// Block ids; all in range for the pool.
    pub block_ids: Vec<u32>,
}

impl PoolTable {
    /// Block holding `pos`. Validation guarantees every position the pass
    /// touches is covered.
    pub fn block_for(&self, pos: usize, tokens_per_block: usize) -> u32 {
        let index = pos / tokens_per_block - self.first_block;
        debug_assert!(index < self.block_ids.len());
        self.block_ids[index]
    }
}

/// A validated sequence.
#[derive(Debug, Clone, PartialEq)]
pub struct PlannedSeq {
    /// The scheduler's id.
    pub seq_id: u64,
    /// Tokens to run.
    pub tokens: Vec<u32>,
    /// Position of `tokens[0]`.
    pub start_pos: usize,
    /// Tables indexed like `ArenaLayout::pools`.
    pub tables: Vec<PoolTable>,
    /// Logits at every position, not just the last.
    pub all_positions: bool,
    /// Log-probabilities to return.
    pub logprobs: Option<LogprobsSpec>,
    /// How to pick the next token.
    pub sampling: Sampling,
    /// Partial-block copies, applied before anything is computed.
    pub copies: Vec<KvCopy>,
    /// The tokens before `start_pos`, when the request sent them.
    pub history: Option<Vec<u32>>,
    /// The grammar, when the request sent it.
    pub grammar: Option<Constraint>,
}

impl PlannedSeq {
    /// Logit rows this sequence needs.
    pub fn logit_rows(&self) -> usize {
        if self.all_positions || self.logprobs.is_some_and(|l| l.prompt) {
            self.tokens.len()
        } else {
            1
        }
    }
}

/// A validated batch, ready for a backend.
#[derive(Debug, Clone, PartialEq)]
pub struct Batch {
    /// Sequences in request order.
    pub seqs: Vec<PlannedSeq>,
    /// `(pool, block, slot)` of every K/V row the pass writes.
    pub writes: Vec<(usize, u32, usize)>,
}

impl Batch {
    /// Input tokens of all sequences.
    pub fn total_tokens(&self) -> usize {
        self.seqs.iter().map(|s| s.tokens.len()).sum()
    }
}

/// Per-pool marks on blocks that validation keeps between batches, so that
/// each check of a block is an array access, not a hash: a batch of 256
/// decoding sequences reads thousands of blocks.
#[derive(Debug, Default)]
pub struct BlockMarks {
    /// The last stamp handed out (a table or a batch each take one).
    stamp: u32,
    /// Per pool: the stamp of the table that last listed each block.
    listed: Vec<Vec<u32>>,
    /// Per pool: the stamp of the batch whose runs [`Self::head`] indexes.
    written: Vec<Vec<u32>>,
    /// Per pool: the last of the batch's write runs in each block.
    head: Vec<Vec<u32>>,
}

impl BlockMarks {
    /// Sizes the marks for `layout`'s pools (after a new layout, cleared).
    fn fit(&mut self, layout: &ArenaLayout) {
        let fits = self.listed.len() == layout.pools.len()
            && self
                .listed
                .iter()
                .zip(&layout.pools)
                .all(|(l, p)| l.len() == p.num_blocks as usize);
        if !fits {
            let sized = || -> Vec<Vec<u32>> {
                layout
                    .pools
                    .iter()
                    .map(|p| vec![0; p.num_blocks as usize])
                    .collect()
            };
            (self.listed, self.written, self.head) = (sized(), sized(), sized());
            self.stamp = 0;
        }
    }

    /// A stamp no mark holds yet.
    fn next_stamp(&mut self) -> u32 {
        if self.stamp == u32::MAX {
            for marks in [&mut self.listed, &mut self.written] {
                marks.iter_mut().for_each(|m| m.fill(0));
            }
            self.stamp = 0;
        }
        self.stamp += 1;
        self.stamp
    }
}

/// Slots `lo..hi` of one block that one sequence writes in a batch; `prev`
/// is the block's previous run in the batch (`NO_RUN`: none).
#[derive(Debug, Clone, Copy)]
struct Run {
    seq_id: u64,
    lo: usize,
    hi: usize,
    prev: u32,
}

const NO_RUN: u32 = u32::MAX;

/// What a batch writes, block by block, over [`BlockMarks`].
struct BatchWrites<'m> {
    stamp: u32,
    written: &'m mut [Vec<u32>],
    head: &'m mut [Vec<u32>],
    runs: Vec<Run>,
}

impl BatchWrites<'_> {
    fn runs(&self, pool: usize, block: u32) -> impl Iterator<Item = &Run> {
        let b = block as usize;
        let mut at = if self.written[pool][b] == self.stamp {
            self.head[pool][b]
        } else {
            NO_RUN
        };
        std::iter::from_fn(move || {
            let run = self.runs.get(at as usize)?;
            at = run.prev;
            Some(run)
        })
    }

    fn touched(&self, pool: usize, block: u32) -> bool {
        self.written[pool][block as usize] == self.stamp
    }

    /// Whether a sequence of the batch writes any of `slots` of `block`.
    fn writes(&self, pool: usize, block: u32, slots: std::ops::Range<usize>) -> bool {
        self.runs(pool, block)
            .any(|r| r.lo < slots.end && slots.start < r.hi)
    }

    /// Adds a run; on a slot another sequence writes, that slot and
    /// sequence.
    fn add(
        &mut self,
        pool: usize,
        block: u32,
        slots: std::ops::Range<usize>,
        seq_id: u64,
    ) -> std::result::Result<(), (usize, u64)> {
        if let Some(other) = self
            .runs(pool, block)
            .find(|r| r.lo < slots.end && slots.start < r.hi)
        {
            return Err((slots.start.max(other.lo), other.seq_id));
        }
        let b = block as usize;
        let prev = if self.touched(pool, block) {
            self.head[pool][b]
        } else {
            NO_RUN
        };
        self.written[pool][b] = self.stamp;
        self.head[pool][b] = self.runs.len() as u32;
        self.runs.push(Run {
            seq_id,
            lo: slots.start,
            hi: slots.end,
            prev,
        });
        Ok(())
    }
}

/// Checks a batch and plans it. Nothing is written anywhere: an error leaves
/// the arena and the ledger as they were. `marks` is scratch kept between
/// calls (any state; sized here).
pub fn validate(
    inputs: Vec<SeqInput>,
    model: &ModelConfig,
    layout: &ArenaLayout,
    ledger: &SlotLedger,
    limits: Limits,
    marks: &mut BlockMarks,
) -> Result<Batch> {
    if inputs.len() > limits.max_batch_sequences {
        return Err(Error::BatchOverLimit {
            what: "sequences",
            got: inputs.len(),
            limit_name: "max_batch_sequences",
            limit: limits.max_batch_sequences,
        });
    }
    let total: usize = inputs.iter().map(|s| s.tokens.len()).sum();
    if total > limits.max_batch_tokens {
        return Err(Error::BatchOverLimit {
            what: "tokens",
            got: total,
            limit_name: "max_batch_tokens",
            limit: limits.max_batch_tokens,
        });
    }

    marks.fit(layout);
    let b = model.tokens_per_block as usize;
    let mut seen = HashSet::with_capacity(inputs.len());
    let mut seqs = Vec::with_capacity(inputs.len());
    for input in inputs {
        let seq_id = input.seq_id;
        let bad = |problem| Error::InvalidSequence { seq_id, problem };
        if !seen.insert(seq_id) {
            return Err(bad(SeqProblem::DuplicateId));
        }
        let planned = plan_sequence(input, model, layout, marks).map_err(bad)?;
        seqs.push(planned);
    }

    // Every slot written, and by whom, a run of slots per block; two
    // writers of one slot is a conflict.
    let stamp = marks.next_stamp();
    let mut batch = BatchWrites {
        stamp,
        written: &mut marks.written,
        head: &mut marks.head,
        runs: Vec::with_capacity(seqs.len() * layout.pools.len()),
    };
    let conflict = |seq_id, window, block_id, (slot, other): (usize, u64)| Error::InvalidSequence {
        seq_id,
        problem: SeqProblem::SlotConflict {
            window,
            block_id,
            slot: slot as u32,
            other_seq_id: other,
        },
    };
    let mut writes = Vec::with_capacity(total * layout.pools.len());
    for seq in &seqs {
        let end = seq.start_pos + seq.tokens.len();
        for (pool, table) in seq.tables.iter().enumerate() {
            let mut pos = seq.start_pos;
            while pos < end {
                let block = table.block_for(pos, b);
                let run_end = ((pos / b + 1) * b).min(end);
                let slots = pos % b..(run_end - 1) % b + 1;
                batch
                    .add(pool, block, slots.clone(), seq.seq_id)
                    .map_err(|c| conflict(seq.seq_id, layout.pools[pool].window, block, c))?;
                writes.extend(slots.map(|slot| (pool, block, slot)));
                pos = run_end;
            }
        }
    }

    // Partial-block copies: the source slots hold K/V and no sequence of the
    // batch writes them (all sources checked before any copy counts; the
    // copies run before the pass, so a sequence may write the source's
    // later slots: a fork's parent decoding into the block its branches
    // copy from); the copied slots count as written by the sequence (so
    // they conflict with any other writer, and satisfy the reads below).
    for seq in &seqs {
        for c in &seq.copies {
            let window = layout.pools[c.pool].window;
            let bad = |message: String| Error::InvalidSequence {
                seq_id: seq.seq_id,
                problem: SeqProblem::BadCopy { window, message },
            };
            if batch.writes(c.pool, c.src, 0..c.slots) {
                return Err(bad(format!(
                    "slots 0..{} of source block {} are written by this batch",
                    c.slots, c.src
                )));
            }
            if !ledger.all_written(c.pool, c.src, 0..c.slots) {
                return Err(bad(format!(
                    "slots 0..{} of source block {} do not all hold K/V",
                    c.slots, c.src
                )));
            }
        }
    }
    for seq in &seqs {
        for c in &seq.copies {
            let window = layout.pools[c.pool].window;
            batch
                .add(c.pool, c.dst, 0..c.slots, seq.seq_id)
                .map_err(|x| conflict(seq.seq_id, window, c.dst, x))?;
            writes.extend((0..c.slots).map(|slot| (c.pool, c.dst, slot)));
        }
    }

    // Positions before start_pos that the pass reads must hold K/V: written
    // earlier (and not in a block this batch restarts) or written now.
    // Checked a block at a time: most blocks read are not written this batch.
    for seq in &seqs {
        for (pool, table) in seq.tables.iter().enumerate() {
            let geometry = &layout.pools[pool];
            let mut pos = window_start(seq.start_pos, geometry.window);
            while pos < seq.start_pos {
                let block = table.block_for(pos, b);
                let run_end = ((pos / b + 1) * b).min(seq.start_pos);
                // Blocks this batch does not write (all but a decode step's
                // last): one mask test for the whole run.
                if !batch.touched(pool, block) {
                    if ledger.all_written(pool, block, pos % b..(run_end - 1) % b + 1) {
                        pos = run_end;
                        continue;
                    }
                    let missing = (pos..run_end)
                        .find(|&p| !ledger.is_written(pool, block, p % b))
                        .unwrap_or(pos);
                    return Err(missing_kv(seq, geometry.window, missing, block));
                }
                let restarted = batch.runs(pool, block).any(|r| r.lo == 0);
                for p in pos..run_end {
                    let slot = p % b;
                    let ok = batch
                        .runs(pool, block)
                        .any(|r| (r.lo..r.hi).contains(&slot))
                        || (!restarted && ledger.is_written(pool, block, slot));
                    if !ok {
                        return Err(missing_kv(seq, geometry.window, p, block));
                    }
                }
                pos = run_end;
            }
        }
    }
    Ok(Batch { seqs, writes })
}

/// The error of a read of position `position` in `block`, which holds no
/// K/V.
fn missing_kv(seq: &PlannedSeq, window: u32, position: usize, block_id: u32) -> Error {
    Error::InvalidSequence {
        seq_id: seq.seq_id,
        problem: SeqProblem::MissingKv {
            window,
            position: position as u64,
            block_id,
            start_pos: seq.start_pos as u32,
        },
    }
}

/// Checks one sequence on its own (tokens, positions, sampling, tables).
fn plan_sequence(
    input: SeqInput,
    model: &ModelConfig,
    layout: &ArenaLayout,
    marks: &mut BlockMarks,
) -> std::result::Result<PlannedSeq, SeqProblem> {
    if input.tokens.is_empty() {
        return Err(SeqProblem::NoTokens);
    }
    if let Some((index, &token)) = input
        .tokens
        .iter()
        .enumerate()
        .find(|(_, t)| **t as usize >= model.vocab_size)
    {
        return Err(SeqProblem::TokenOutOfVocab {
            index,
            token,
            vocab_size: model.vocab_size as u32,
        });
    }
    let start = input.start_pos as usize;
    let end = start + input.tokens.len();
    if end > model.max_context as usize {
        return Err(SeqProblem::PastMaxContext {
            end: end as u64,
            max_context: model.max_context,
        });
    }
    let sampling = check_sampling(input.sampling, model.vocab_size)?;
    if let Some(l) = &input.logprobs {
        check_logprobs(l, model.vocab_size)?;
    }
    if let Some(history) = &input.history {
        if history.len() != start {
            return Err(SeqProblem::BadHistory(format!(
                "holds {} tokens but start_pos is {start}",
                history.len()
            )));
        }
        if let Some(&token) = history.iter().find(|&&t| t as usize >= model.vocab_size) {
            return Err(SeqProblem::BadHistory(format!(
                "token {token} is outside the vocabulary of {}",
                model.vocab_size
            )));
        }
    }
    let grammar = input.grammar.transpose().map_err(SeqProblem::BadGrammar)?;
    if grammar.is_some() && !sampling.constrained {
        return Err(SeqProblem::BadGrammar(
            "sent for a sequence whose sampling is not constrained".into(),
        ));
    }
    if grammar.is_some() && input.history.is_none() {
        return Err(SeqProblem::BadGrammar(
            "sent without the sequence's history, whose output it replays".into(),
        ));
    }
    if sampling.constrained && input.all_positions {
        return Err(SeqProblem::BadSampling(
            "a grammar cannot be combined with return_all_argmax (draft verification)".into(),
        ));
    }
    if sampling.penalties.any() && input.all_positions {
        // drafts a pass may reject would be counted as output
        return Err(SeqProblem::BadSampling(
            "penalties cannot be combined with return_all_argmax (draft verification)".into(),
        ));
    }

    let b = model.tokens_per_block as usize;
    let mut tables: Vec<Option<PoolTable>> = vec![None; layout.pools.len()];
    for table in input.tables {
        let window = table.window;
        let pool = layout
            .pool_of_window(window)
            .ok_or(SeqProblem::UnknownWindow { window })?;
        // Beam first: a beam-search lease brings one table per (pool, beam),
        // and "beam 1" says more than "two tables".
        if table.beam != 0 {
            return Err(SeqProblem::BeamNotZero {
                window,
                beam: table.beam,
            });
        }
        if tables[pool].is_some() {
            return Err(SeqProblem::DuplicateTable { window });
        }
        let num_blocks = layout.pools[pool].num_blocks;
        let stamp = marks.next_stamp();
        let listed = &mut marks.listed[pool];
        for &block_id in &table.block_ids {
            if block_id >= num_blocks {
                return Err(SeqProblem::BlockOutOfRange {
                    window,
                    block_id,
                    num_blocks,
                });
            }
            let mark = &mut listed[block_id as usize];
            if *mark == stamp {
                return Err(SeqProblem::RepeatedBlock { window, block_id });
            }
            *mark = stamp;
        }
        // The pass reads from the window start of its first query and writes
        // up to its last token: both ends must lie in listed blocks.
        let first_pos = window_start(start, window);
        let first_needed = first_pos / b;
        let last_needed = (end - 1) / b;
        let covered =
            table.first_block as usize..table.first_block as usize + table.block_ids.len();
        if !(covered.contains(&first_needed) && covered.contains(&last_needed)) {
            return Err(SeqProblem::TableTooShort {
                window,
                first_pos: first_pos as u64,
                last_pos: (end - 1) as u64,
                first_block: table.first_block,
                num_blocks: table.block_ids.len(),
            });
        }
        tables[pool] = Some(PoolTable {
            first_block: table.first_block as usize,
            block_ids: table.block_ids,
        });
    }
    let tables = tables
        .into_iter()
        .zip(&layout.pools)
        .map(|(t, p)| t.ok_or(SeqProblem::MissingTable { window: p.window }))
        .collect::<std::result::Result<Vec<_>, _>>()?;
    let copies = plan_copies(&input.copies, start, &tables, layout)?;
    Ok(PlannedSeq {
        seq_id: input.seq_id,
        tokens: input.tokens,
        start_pos: start,
        tables,
        all_positions: input.all_positions,
        logprobs: input.logprobs,
        sampling,
        copies,
        history: input.history,
        grammar,
    })
}

/// Checks a sequence's partial-block copies on their own: a known pool, at
/// most one copy per pool, blocks in range and distinct, 1 to
/// `tokens_per_block - 1` slots, exactly the slots of `start`'s block
/// before `start`, into the sequence's own block holding `start`, from a
/// block not in its table.
fn plan_copies(
    copies: &[CopyInput],
    start: usize,
    tables: &[PoolTable],
    layout: &ArenaLayout,
) -> std::result::Result<Vec<KvCopy>, SeqProblem> {
    let mut planned: Vec<KvCopy> = Vec::with_capacity(copies.len());
    for c in copies {
        let window = c.window;
        let bad = |message: String| SeqProblem::BadCopy { window, message };
        let pool = layout
            .pool_of_window(window)
            .ok_or_else(|| bad("the model has no pool of this window".into()))?;
        let geometry = &layout.pools[pool];
        let b = geometry.tokens_per_block;
        if planned.iter().any(|p| p.pool == pool) {
            return Err(bad("two copies for one pool".into()));
        }
        for block in [c.src_block, c.dst_block] {
            if block >= geometry.num_blocks {
                return Err(bad(format!(
                    "block id {block} out of range ({} blocks)",
                    geometry.num_blocks
                )));
            }
        }
        if c.src_block == c.dst_block {
            return Err(bad(format!(
                "source and destination are the same block ({})",
                c.src_block
            )));
        }
        let slots = c.tokens as usize;
        if slots == 0 || slots >= b {
            return Err(bad(format!(
                "copies {slots} slots; a copy takes 1 to {} (tokens_per_block - 1)",
                b - 1
            )));
        }
        if slots != start % b {
            return Err(bad(format!(
                "copies {slots} slots, but start_pos {start} is {} slots into its block",
                start % b
            )));
        }
        let table = &tables[pool];
        let index = start / b;
        let own = index
            .checked_sub(table.first_block)
            .and_then(|i| table.block_ids.get(i))
            .copied();
        if own != Some(c.dst_block) {
            return Err(bad(format!(
                "destination block {} is not the sequence's block {index} (which is {})",
                c.dst_block,
                own.map_or("not in the table".to_string(), |b| b.to_string())
            )));
        }
        if table.block_ids.contains(&c.src_block) {
            return Err(bad(format!(
                "source block {} is one of the sequence's own blocks",
                c.src_block
            )));
        }
        planned.push(KvCopy {
            pool,
            src: c.src_block,
            dst: c.dst_block,
            slots,
        });
    }
    Ok(planned)
}

/// A sequence's [`LogprobsSpec`]: at most [`MAX_TOP_LOGPROBS`]
/// alternatives, a `next_prompt_token` only with `prompt` and inside the
/// vocabulary.
fn check_logprobs(l: &LogprobsSpec, vocab_size: usize) -> std::result::Result<(), SeqProblem> {
    let bad = |what: String| Err(SeqProblem::BadLogprobs(what));
    if l.top as usize > MAX_TOP_LOGPROBS {
        return bad(format!("top {} is more than {}", l.top, MAX_TOP_LOGPROBS));
    }
    match l.next_prompt_token {
        Some(_) if !l.prompt => bad("next_prompt_token is set without prompt".into()),
        Some(t) if t as usize >= vocab_size => bad(format!(
            "next_prompt_token {t} is outside the vocabulary of {vocab_size}"
        )),
        _ => Ok(()),
    }
}

fn check_sampling(s: Sampling, vocab_size: usize) -> std::result::Result<Sampling, SeqProblem> {
    let bad = |what: String| Err(SeqProblem::BadSampling(what));
    if !(s.temperature.is_finite() && s.temperature >= 0.0) {
        return bad(format!(
            "temperature {} must be finite and >= 0",
            s.temperature
        ));
    }
    if !(s.top_p.is_finite() && (0.0..=1.0).contains(&s.top_p)) {
        return bad(format!("top_p {} must be in (0, 1]", s.top_p));
    }
    if !(s.min_p.is_finite() && (0.0..=1.0).contains(&s.min_p)) {
        return bad(format!("min_p {} must be in [0, 1]", s.min_p));
    }
    let p = s.penalties;
    for (name, v) in [
        ("frequency_penalty", p.frequency),
        ("presence_penalty", p.presence),
    ] {
        if !(v.is_finite() && (-2.0..=2.0).contains(&v)) {
            return bad(format!("{name} {v} must be in [-2, 2]"));
        }
    }
    if !(p.repetition.is_finite() && p.repetition >= 0.0) {
        return bad(format!(
            "repetition_penalty {} must be finite and > 0",
            p.repetition
        ));
    }
    if let Some(&(token, bias)) = s.logit_bias.iter().find(|(t, b)| {
        *t as usize >= vocab_size || !(b.is_finite() && (-100.0..=100.0).contains(b))
    }) {
        return bad(format!(
            "logit_bias {bias} for token {token}: tokens must be inside the vocabulary of \
             {vocab_size} and biases in [-100, 100]"
        ));
    }
    if let Some(token) = s.stop_ids.iter().find(|&&t| t as usize >= vocab_size) {
        return bad(format!(
            "stop id {token} is outside the vocabulary of {vocab_size}"
        ));
    }
    let top_p = if s.top_p == 0.0 { 1.0 } else { s.top_p };
    let repetition = if p.repetition == 0.0 {
        1.0
    } else {
        p.repetition
    };
    let mut logit_bias = s.logit_bias;
    logit_bias.sort_by_key(|&(t, _)| t);
    logit_bias.dedup_by_key(|&mut (t, _)| t);
    Ok(Sampling {
        top_p,
        penalties: Penalties { repetition, ..p },
        logit_bias,
        ..s
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn model() -> ModelConfig {
        ModelConfig {
            layer_windows: vec![0],
            tokens_per_block: 4,
            ..ModelConfig::small()
        }
    }

    fn seq(seq_id: u64, n: usize, start_pos: u32, blocks: &[u32]) -> SeqInput {
        SeqInput {
            seq_id,
            tokens: vec![1; n],
            start_pos,
            tables: vec![TableInput {
                window: 0,
                beam: 0,
                first_block: 0,
                block_ids: blocks.to_vec(),
            }],
            all_positions: false,
            logprobs: None,
            sampling: Sampling::GREEDY,
            copies: Vec::new(),
            history: None,
            grammar: None,
        }
    }

    const LIMITS: Limits = Limits {
        max_batch_sequences: 8,
        max_batch_tokens: 64,
    };

    #[test]
    fn out_of_range_sampling_and_malformed_histories_name_the_parameter() {
        let (m, layout) = (model(), ArenaLayout::new(&model(), &[16]));
        let ledger = SlotLedger::new(&layout);
        let vocab = m.vocab_size as u32;
        let problem = |edit: &dyn Fn(&mut SeqInput)| {
            let mut s = seq(1, 2, 0, &[3]);
            edit(&mut s);
            let r = validate(
                vec![s],
                &m,
                &layout,
                &ledger,
                LIMITS,
                &mut BlockMarks::default(),
            );
            match r {
                Ok(_) => panic!("accepted"),
                Err(e) => e.to_string(),
            }
        };
        type Edit<'a> = &'a dyn Fn(&mut SeqInput);
        let cases: [(&str, Edit<'_>); 13] = [
            ("min_p 1.5", &|s| s.sampling.min_p = 1.5),
            ("frequency_penalty 3", &|s| {
                s.sampling.penalties.frequency = 3.0
            }),
            ("presence_penalty NaN", &|s| {
                s.sampling.penalties.presence = f32::NAN
            }),
            ("repetition_penalty -1", &|s| {
                s.sampling.penalties.repetition = -1.0
            }),
            ("logit_bias -101 for token 3", &|s| {
                s.sampling.logit_bias = vec![(3, -101.0)]
            }),
            ("for token 9999", &|s| {
                s.sampling.logit_bias = vec![(9999, 1.0)]
            }),
            ("stop id", &|s| s.sampling.stop_ids = vec![vocab]),
            ("history holds 1 tokens but start_pos is 0", &|s| {
                s.history = Some(vec![1])
            }),
            ("return_all_argmax", &|s| {
                s.all_positions = true;
                s.sampling.penalties.presence = 1.0;
            }),
            ("grammar: no kind set", &|s| {
                s.sampling.constrained = true;
                s.history = Some(Vec::new());
                s.grammar = Some(Err("no kind set".into()));
            }),
            (
                "grammar: sent for a sequence whose sampling is not constrained",
                &|s| {
                    s.history = Some(Vec::new());
                    s.grammar = Some(Ok(Constraint::JsonObject));
                },
            ),
            ("grammar: sent without the sequence's history", &|s| {
                s.sampling.constrained = true;
                s.grammar = Some(Ok(Constraint::JsonObject));
            }),
            (
                "a grammar cannot be combined with return_all_argmax",
                &|s| {
                    s.sampling.constrained = true;
                    s.all_positions = true;
                },
            ),
        ];
        for (want, edit) in cases {
            let got = problem(edit);
            assert!(got.contains(want), "{got:?} should name {want:?}");
        }
        // logprobs with a grammar: of the raw row, kept around the mask
        let mut both = seq(1, 2, 0, &[3]);
        both.sampling.constrained = true;
        both.history = Some(Vec::new());
        both.grammar = Some(Ok(Constraint::JsonObject));
        both.logprobs = Some(LogprobsSpec {
            top: 2,
            prompt: true,
            next_prompt_token: None,
        });
        let served = validate(
            vec![both],
            &m,
            &layout,
            &ledger,
            LIMITS,
            &mut BlockMarks::default(),
        );
        assert!(served.is_ok(), "{served:?}");
        let mut history = seq(1, 1, 2, &[3]);
        history.history = Some(vec![0, vocab]);
        let e = validate(
            vec![history],
            &m,
            &layout,
            &ledger,
            LIMITS,
            &mut BlockMarks::default(),
        );
        assert!(matches!(e, Err(Error::InvalidSequence { .. })), "{e:?}");
    }

    #[test]
    fn a_prefix_written_in_the_same_batch_may_be_read() {
        let (m, layout) = (model(), ArenaLayout::new(&model(), &[16]));
        let ledger = SlotLedger::new(&layout);
        // Sequence 2 reuses the block sequence 1 fills in this very batch.
        let batch = vec![seq(1, 4, 0, &[3]), seq(2, 2, 4, &[3, 5])];
        assert!(
            validate(
                batch,
                &m,
                &layout,
                &ledger,
                LIMITS,
                &mut BlockMarks::default()
            )
            .is_ok()
        );
        // Without sequence 1 the block holds nothing yet.
        let err = validate(
            vec![seq(2, 2, 4, &[3, 5])],
            &m,
            &layout,
            &ledger,
            LIMITS,
            &mut BlockMarks::default(),
        );
        assert!(matches!(
            err,
            Err(Error::InvalidSequence {
                seq_id: 2,
                problem: SeqProblem::MissingKv { position: 0, .. }
            })
        ));
    }

    #[test]
    fn a_restarted_block_forgets_its_old_slots() {
        let (m, layout) = (model(), ArenaLayout::new(&model(), &[16]));
        let mut ledger = SlotLedger::new(&layout);
        let first = validate(
            vec![seq(1, 4, 0, &[3])],
            &m,
            &layout,
            &ledger,
            LIMITS,
            &mut BlockMarks::default(),
        );
        match first {
            Ok(batch) => ledger.record(&batch.writes),
            Err(e) => panic!("{e}"),
        }
        assert!(
            validate(
                vec![seq(1, 1, 4, &[3, 4])],
                &m,
                &layout,
                &ledger,
                LIMITS,
                &mut BlockMarks::default()
            )
            .is_ok()
        );
        // Another sequence takes block 3 and writes slot 0 only: slots 1..4
        // are stale now.
        match validate(
            vec![seq(2, 1, 0, &[3])],
            &m,
            &layout,
            &ledger,
            LIMITS,
            &mut BlockMarks::default(),
        ) {
            Ok(batch) => ledger.record(&batch.writes),
            Err(e) => panic!("{e}"),
        }
        let stale = validate(
            vec![seq(2, 1, 3, &[3])],
            &m,
            &layout,
            &ledger,
            LIMITS,
            &mut BlockMarks::default(),
        );
        assert!(matches!(
            stale,
            Err(Error::InvalidSequence {
                problem: SeqProblem::MissingKv { position: 1, .. },
                ..
            })
        ));
    }
}
