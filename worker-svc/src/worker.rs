//! The worker core: sizes the arena from the memory budget, validates each
//! batch, hands it to the backend and picks the next tokens. Plain
//! synchronous Rust; `service.rs` puts it behind gRPC.

use std::path::Path;
use std::time::Instant;

use crate::arena::{ArenaLayout, SlotLedger, plan_blocks};
use crate::backend::cpu::{self, CpuBackend};
use crate::backend::{
    Backend, BackendChoice, BatchLogits, CudaOptions, Feed, KvDtype, PendingTokens, PhaseTimes,
};
use crate::batch::{self, Batch, Limits, SeqInput, TierCopyInput, TierDirection};
use crate::disk::{self, DiskTier, PoolGeometry};
use crate::error::{Error, Result};
use crate::grammar::Matchers;
use crate::history::Histories;
use crate::logprobs::{LogprobRow, RowLogprobs, batch_logprobs, rows_of};
use crate::model::ModelConfig;
use crate::model::weights::Weights;
use crate::sampling::{RowPick, pick_rows, row_pick};

/// Threads used when none are configured, at most: each thread holds its own
/// attention scratch (about 1 MiB for the default model), so the default
/// memory budget must not depend on how many cores the host has.
pub const DEFAULT_MAX_THREADS: usize = 8;

/// How the worker is sized.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WorkerOptions {
    /// Memory for weights, activations and KV together, in bytes.
    pub memory_budget_bytes: u64,
    /// Batch limits.
    pub limits: Limits,
    /// Compute threads; 0 = one per available core, at most
    /// [`DEFAULT_MAX_THREADS`].
    pub threads: usize,
    /// Blocks of the host-memory tier of every pool (0: no tier).
    pub host_blocks: u32,
}

/// One pool as `Describe` reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolInfo {
    /// Window in tokens; 0 = full attention.
    pub window: u32,
    /// Layers whose KV lives in the pool.
    pub num_layers: u32,
    /// Blocks that fit in the budget.
    pub num_blocks: u32,
    /// Bytes of one block.
    pub bytes_per_block: u64,
    /// Blocks of the pool's host tier (0: none).
    pub host_blocks: u32,
    /// Blocks of the pool's disk tier (0: none).
    pub disk_blocks: u32,
    /// The block files the disk tier found and verified at start.
    pub disk_held: Vec<crate::disk::Held>,
}

/// What `Describe` reports.
#[derive(Debug, Clone, PartialEq)]
pub struct WorkerInfo {
    /// The model shape.
    pub model: ModelConfig,
    /// One entry per pool.
    pub pools: Vec<PoolInfo>,
    /// Backend name.
    pub backend: &'static str,
    /// KV element type.
    pub kv_dtype: &'static str,
    /// The memory budget in bytes.
    pub memory_budget_bytes: u64,
    /// Bytes of the weights.
    pub weight_bytes: u64,
    /// Bytes of activations at the largest batch.
    pub activation_bytes: u64,
    /// Batch limits.
    pub limits: Limits,
    /// Device description.
    pub device: String,
    /// A number that differs on every start of the process (never 0): the
    /// cache forgets the device and host blocks of an earlier one.
    pub incarnation: u64,
}

/// A block pulled from a peer: `(pool, block, slots, bytes)`, the whole
/// block's bytes of which the leading `slots` slots hold K/V.
pub type PulledBlock = (usize, u32, usize, Vec<u8>);

/// The result for one sequence of a batch.
#[derive(Debug, Clone, PartialEq)]
pub struct SeqOutput {
    /// The scheduler's id.
    pub seq_id: u64,
    /// The token after the last input position.
    pub next_token: u32,
    /// Argmax after each input position (empty unless all positions were asked).
    pub argmax: Vec<u32>,
    /// This sequence's rows of [`ForwardOutput::logits`]: every position
    /// when asked, else the last one.
    pub rows: std::ops::Range<usize>,
    /// The log-probabilities it asked for (`logprobs::rows_of`:
    /// one per input position with `prompt`, else the next token's); empty
    /// when it asked for none.
    pub logprobs: Vec<RowLogprobs>,
}

/// What one [`Worker::forward`] produced. The logits stay in one buffer, as
/// the backend returned them: a decode step of a large vocabulary does not
/// copy them out per sequence.
#[derive(Debug, Clone, PartialEq)]
pub struct ForwardOutput {
    /// One per input sequence, in batch order.
    pub seqs: Vec<SeqOutput>,
    logits: BatchLogits,
}

impl ForwardOutput {
    /// Logits rows of the `i`-th sequence of the batch (`vocab` wide).
    ///
    /// # Panics
    /// When the batch has no `i`-th sequence.
    pub fn logits(&self, i: usize) -> &[f32] {
        let (rows, vocab) = (&self.seqs[i].rows, self.logits.vocab);
        &self.logits.values[rows.start * vocab..rows.end * vocab]
    }

    /// Vocabulary size: the width of a logits row.
    pub fn vocab(&self) -> usize {
        self.logits.vocab
    }
}

/// The worker: weights, arena and backend of one model replica.
#[derive(Debug)]
pub struct Worker {
    info: WorkerInfo,
    layout: ArenaLayout,
    ledger: SlotLedger,
    /// Validation's scratch marks on blocks, kept between batches.
    marks: batch::BlockMarks,
    /// The host tier's geometry (`num_blocks` = host blocks per pool) and
    /// which of its slots hold K/V.
    host_layout: ArenaLayout,
    host_ledger: SlotLedger,
    /// The disk tier below the host tier, if any.
    disk: Option<DiskTier>,
    backend: Box<dyn Backend>,
    /// Host milliseconds of the last pass spent validating and building the
    /// outputs (for [`Worker::last_profile`]).
    host_times: (f64, f64),
    /// Token counts of the penalised sequences.
    histories: Histories,
    /// Grammar matchers of the constrained sequences.
    matchers: Matchers,
}

impl Worker {
    /// A worker on the backend `choice` names: `Cpu` sizes the arena from
    /// `options.memory_budget_bytes`; `Cuda` from the device's free memory
    /// (see [`Worker::new_cuda`]); `Auto` takes CUDA when [`cuda_unavailable`]
    /// finds nothing wrong, else the CPU, saying why in one log line.
    pub fn new(
        weights: Weights,
        options: WorkerOptions,
        choice: BackendChoice,
        gpu: CudaOptions,
    ) -> Result<Self> {
        // The CPU arena is f32 whatever the flag says for the GPU's; an fp8
        // arena asks for twice the blocks, which the CPU would not give.
        let cpu = |weights, options, why: &str| {
            if gpu.kv_dtype == KvDtype::Fp8 {
                return Err(Error::Config(format!(
                    "--kv-dtype fp8 needs the cuda backend, and {why}"
                )));
            }
            Self::new_cpu(weights, options)
        };
        match choice {
            BackendChoice::Cpu => cpu(weights, options, "--backend cpu was asked for"),
            BackendChoice::Cuda => Self::new_cuda(weights, options, gpu),
            BackendChoice::Auto => match cuda_unavailable() {
                None => Self::new_cuda(weights, options, gpu),
                Some(reason) => {
                    tracing::info!(%reason, "backend auto: no usable CUDA device, running on the CPU");
                    cpu(
                        weights,
                        options,
                        &format!("backend auto found none usable: {reason}"),
                    )
                }
            },
        }
    }

    /// A CUDA worker: weights and activations on the device, the arena
    /// sized from the free device memory left after them times
    /// `gpu.memory_fraction` (`options.memory_budget_bytes` is not used;
    /// `Describe` reports the sum of what was placed). Fails with
    /// [`Error::Config`] when there is no device or the binary was built
    /// without the `cuda` feature.
    #[cfg(feature = "cuda")]
    pub fn new_cuda(weights: Weights, options: WorkerOptions, gpu: CudaOptions) -> Result<Self> {
        let config = weights.config.clone();
        config.validate()?;
        check_limits(options.limits)?;
        let (backend, sizing) = crate::backend::cuda::CudaBackend::new(
            weights,
            options.limits.max_batch_tokens,
            gpu,
            None,
        )?;
        let layout = backend.layout().clone();
        tracing::info!(
            free_bytes = sizing.free_bytes,
            memory_fraction = gpu.memory_fraction,
            kv_bytes = sizing.kv_bytes,
            "cuda arena sized from free device memory"
        );
        let budget = sizing.weight_bytes + sizing.activation_bytes + sizing.kv_bytes;
        Self::assemble(
            config,
            layout,
            Box::new(backend),
            options.limits,
            budget,
            sizing.weight_bytes,
            sizing.activation_bytes,
            gpu.kv_dtype.elem_bytes(),
            options.host_blocks,
        )
    }

    /// Without the `cuda` feature there is no CUDA backend: always an error.
    #[cfg(not(feature = "cuda"))]
    pub fn new_cuda(_weights: Weights, _options: WorkerOptions, _gpu: CudaOptions) -> Result<Self> {
        Err(Error::Config(
            "backend cuda requested, but this binary was built without the `cuda` feature".into(),
        ))
    }

    /// Turns per-phase device timing on or off (CUDA only).
    pub fn set_profiling(&mut self, on: bool) {
        self.backend.set_profiling(on);
    }

    /// Graphs the backend captured and passes it replayed from them.
    pub fn graph_counts(&self) -> crate::backend::GraphCounts {
        self.backend.graph_counts()
    }

    /// Phase times of the last profiled pass, if the backend times phases,
    /// with this worker's own host stages of the last pass.
    pub fn last_profile(&self) -> Option<PhaseTimes> {
        let mut p = self.backend.last_profile()?;
        (p.host.validate_ms, p.host.outputs_ms) = self.host_times;
        Some(p)
    }

    /// A CPU worker for `weights`, its arena sized from `options`.
    pub fn new_cpu(weights: Weights, options: WorkerOptions) -> Result<Self> {
        let config = weights.config.clone();
        config.validate()?;
        let limits = options.limits;
        check_limits(limits)?;
        let threads = if options.threads == 0 {
            std::thread::available_parallelism()
                .map_or(1, usize::from)
                .min(DEFAULT_MAX_THREADS)
        } else {
            options.threads
        };
        let weight_bytes = weights.bytes();
        let activation_bytes = cpu::activation_bytes(&config, limits.max_batch_tokens, threads);
        let num_blocks = plan_blocks(
            &config,
            options.memory_budget_bytes,
            weight_bytes,
            activation_bytes,
        )?;
        let layout = ArenaLayout::new(&config, &num_blocks);
        let backend = CpuBackend::new(weights, layout.clone(), threads)?;
        Self::assemble(
            config,
            layout,
            Box::new(backend),
            limits,
            options.memory_budget_bytes,
            weight_bytes,
            activation_bytes,
            crate::arena::KV_ELEM_BYTES,
            options.host_blocks,
        )
    }

    #[allow(clippy::too_many_arguments)] // the sizing figures, each reported once
    fn assemble(
        config: ModelConfig,
        layout: ArenaLayout,
        backend: Box<dyn Backend>,
        limits: Limits,
        memory_budget_bytes: u64,
        weight_bytes: u64,
        activation_bytes: u64,
        kv_elem_bytes: u64,
        host_blocks: u32,
    ) -> Result<Self> {
        let mut backend = backend;
        let host_counts = vec![host_blocks; layout.pools.len()];
        backend.set_host_tier(&host_counts)?;
        let host_layout = ArenaLayout::new(&config, &host_counts);
        let info = WorkerInfo {
            pools: layout
                .pools
                .iter()
                .map(|p| PoolInfo {
                    window: p.window,
                    num_layers: p.layers.len() as u32,
                    num_blocks: p.num_blocks,
                    bytes_per_block: p.elems_per_block() as u64 * kv_elem_bytes,
                    host_blocks,
                    disk_blocks: 0,
                    disk_held: Vec::new(),
                })
                .collect(),
            model: config,
            backend: backend.name(),
            kv_dtype: backend.kv_dtype(),
            memory_budget_bytes,
            weight_bytes,
            activation_bytes,
            limits,
            device: backend.device(),
            incarnation: fresh_incarnation(),
        };
        tracing::info!(
            backend = info.backend,
            weight_bytes,
            activation_bytes,
            kv_bytes = layout.bytes_with(kv_elem_bytes),
            device = %info.device,
            pools = ?info.pools,
            "worker arena sized"
        );
        Ok(Worker {
            info,
            ledger: SlotLedger::new(&layout),
            marks: batch::BlockMarks::default(),
            layout,
            host_ledger: SlotLedger::new(&host_layout),
            host_layout,
            disk: None,
            backend,
            host_times: (0.0, 0.0),
            histories: Histories::default(),
            matchers: Matchers::default(),
        })
    }

    /// Opens the disk tier in `dir` (at most `bytes`; see `disk`) below
    /// the host tier, whose files must match `identity` (what the weights
    /// come from, the tokenizer's fingerprint) and the arena's geometry:
    /// `Describe` then reports its blocks and the files that verified.
    pub fn open_disk_tier(&mut self, dir: &Path, bytes: u64, identity: &str) -> Result<()> {
        if self.info.pools.iter().any(|p| p.host_blocks == 0) {
            return Err(Error::Config(
                "--disk-tier-dir needs a host tier (--host-blocks)".into(),
            ));
        }
        if !self.backend.supports_disk_tier() {
            return Err(Error::Config(format!(
                "the {} backend has no disk tier yet; start it without --disk-tier-dir",
                self.backend.name()
            )));
        }
        let geometry: Vec<PoolGeometry> = self
            .info
            .pools
            .iter()
            .map(|p| PoolGeometry {
                window: p.window,
                payload_bytes: p.bytes_per_block as usize,
                ledger_words: self.ledger.words_per_block(),
            })
            .collect();
        let fingerprint = disk::fingerprint(
            format!(
                "{identity}|{:?}|{}|{geometry:?}",
                self.info.model, self.info.kv_dtype
            )
            .as_bytes(),
        );
        let tier = DiskTier::open(dir, bytes, fingerprint, &geometry)?;
        for (i, p) in self.info.pools.iter_mut().enumerate() {
            p.disk_blocks = tier.blocks();
            p.disk_held = tier.held(i).to_vec();
        }
        tracing::info!(
            dir = %dir.display(),
            blocks = tier.blocks(),
            held = ?self.info.pools.iter().map(|p| p.disk_held.len()).collect::<Vec<_>>(),
            "disk tier opened"
        );
        self.disk = Some(tier);
        Ok(())
    }

    /// Applies a Forward request's tier copies, before its sequences are
    /// validated and run: all are checked first and every load's file is
    /// read and verified (an error, a bad file included, copies nothing),
    /// then every spill runs, every demotion, every onboarding and every
    /// load, and the slot ledgers follow the blocks (a copy carries which
    /// slots hold K/V).
    pub fn apply_tier_copies(&mut self, copies: &[TierCopyInput]) -> Result<()> {
        if copies.is_empty() {
            return Ok(());
        }
        let disk_blocks = self.disk.as_ref().map_or(0, DiskTier::blocks);
        let plan =
            batch::validate_tier_copies(copies, &self.layout, &self.host_layout, disk_blocks)?;
        let (spills, moves, loads) = (plan.spills, plan.moves, plan.loads);
        let mut loaded = Vec::with_capacity(loads.len());
        if let Some(disk) = &self.disk {
            for l in &loads {
                loaded.push(disk.read(l.pool, l.disk.block, l.disk.hash)?);
            }
            for s in &spills {
                let payload = self.backend.host_block_bytes(s.pool, s.block)?;
                let ledger = self.host_ledger.block_words(s.pool, s.block);
                disk.write(
                    s.pool,
                    s.disk.block,
                    (s.disk.hash, s.disk.parent),
                    &ledger,
                    &payload,
                )?;
            }
        }
        self.backend.tier_copies(&moves)?;
        for (l, data) in loads.iter().zip(&loaded) {
            self.backend
                .write_device_block(l.pool, l.block, &data.payload)?;
            self.ledger.set_block_words(l.pool, l.block, &data.ledger);
        }
        for m in &moves {
            match m.direction {
                TierDirection::Demote => {
                    self.host_ledger
                        .copy_block(m.pool, m.host, &self.ledger, m.device)
                }
                TierDirection::Onboard => {
                    self.ledger
                        .copy_block(m.pool, m.device, &self.host_ledger, m.host)
                }
                // validation keeps disk copies out of the moves
                TierDirection::Spill | TierDirection::Load => {}
            }
        }
        Ok(())
    }

    /// The bytes of `block` of `pool` for a peer pull whose leading
    /// `slots` slots must hold K/V: every slot for a published block, the
    /// written ones for a hand-off's last block (anything less is a block
    /// the source lost or never wrote).
    pub fn peer_block(&self, pool: usize, block: u32, slots: usize) -> Result<Vec<u8>> {
        let geometry = self
            .layout
            .pools
            .get(pool)
            .ok_or_else(|| Error::InvalidPull(format!("no pool {pool}")))?;
        if !self
            .ledger
            .all_written(pool, block, 0..slots.clamp(1, geometry.tokens_per_block))
        {
            let which = match slots >= geometry.tokens_per_block {
                true => "every slot".to_string(),
                false => format!("its first {slots} slots"),
            };
            return Err(Error::Pull(format!(
                "block {block} of the pool of window {} does not hold K/V in {which}",
                geometry.window
            )));
        }
        self.backend.device_block_bytes(pool, block)
    }

    /// Writes blocks pulled from a peer, `(pool, block, slots, bytes)`
    /// (checked by `peer::check_peer_pull` and the assembler), before a
    /// pass that reads them: only the leading `slots` slots count as
    /// written.
    pub fn write_pulled(&mut self, blocks: &[PulledBlock]) -> Result<()> {
        for (pool, block, slots, bytes) in blocks {
            self.backend.write_device_block(*pool, *block, bytes)?;
            self.ledger.set_leading(*pool, *block, *slots);
        }
        Ok(())
    }

    /// The model's tokenizer, whose vocabulary constrained sequences'
    /// grammars compile against (none before: such a sequence is refused).
    pub fn set_tokenizer(&mut self, tokenizer: kvlease_tokenizer::Tokenizer) {
        self.matchers.set_tokenizer(tokenizer);
    }

    /// What `Describe` reports.
    pub fn info(&self) -> &WorkerInfo {
        &self.info
    }

    /// The arena layout.
    pub fn layout(&self) -> &ArenaLayout {
        &self.layout
    }

    /// Runs one batch: validates all of it (an error writes nothing), writes
    /// K/V, attends, and picks each sequence's next token on the host from
    /// the logits it returns.
    pub fn forward(&mut self, inputs: Vec<SeqInput>) -> Result<ForwardOutput> {
        let t_start = Instant::now();
        let (batch, picks, rows) = self.prepare(inputs)?;
        let t_validated = Instant::now();
        let logits = self.backend.forward(&batch)?;
        self.ledger.record(&batch.writes);
        let tokens = pick_rows(&logits, &picks);
        let logprobs = batch_logprobs(&logits, &tokens, &rows)?;
        let seqs = self.outputs(&batch, t_start, t_validated, &tokens, logprobs);
        Ok(ForwardOutput { seqs, logits })
    }

    /// Runs one batch as [`Worker::forward`] does, but keeps no logits: the
    /// backend picks the tokens where the logits are (on a GPU only one
    /// token per logits row comes back, sampled or greedy). The outputs are
    /// the same either way ([`SeqOutput::rows`] still numbers the logits
    /// rows the sequence had).
    pub fn forward_tokens(&mut self, inputs: Vec<SeqInput>) -> Result<Vec<SeqOutput>> {
        match self.begin_tokens(inputs, &[])? {
            Begun::Done(outputs) => Ok(outputs),
            Begun::Running(pass) => {
                let tokens = pass.tokens.wait()?;
                Ok(self.finish_tokens(pass.rest, tokens))
            }
        }
    }

    /// Starts one batch as [`Worker::forward_tokens`] runs it: validated
    /// (an error writes nothing) and, when the backend keeps the tokens on
    /// a device, begun there and returned before they are back
    /// ([`Begun::Running`]: wait for its tokens without this worker, then
    /// [`Worker::finish_tokens`]); the next batch can be begun meanwhile
    /// and runs after it. `feed` lists (index into `inputs`, logit row of
    /// the pass begun just before) of inputs whose one token is the argmax
    /// of that row, taken on the device; their tokens are placeholders.
    /// The pass's writes count as made from here on: the next batch may
    /// read them.
    pub fn begin_tokens(&mut self, inputs: Vec<SeqInput>, feed: &[(usize, u32)]) -> Result<Begun> {
        if inputs.is_empty() {
            // A request of host-tier copies only: nothing to compute.
            return Ok(Begun::Done(Vec::new()));
        }
        let t_start = Instant::now();
        let (batch, picks, rows) = self.prepare(inputs)?;
        let t_validated = Instant::now();
        let feed = device_feed(&batch, feed)?;
        if !picks.is_empty() || !rows.is_empty() {
            // sampled, adjusted or masked rows, or logprobs: picked and
            // computed where the logits are, in one go (a fed item's picks
            // never depend on its token: the service has penalised and
            // constrained ones fed from the host)
            let picked = self.backend.forward_picks(&batch, &feed, &picks, &rows)?;
            self.ledger.record(&batch.writes);
            return Ok(Begun::Done(self.outputs(
                &batch,
                t_start,
                t_validated,
                &picked.tokens,
                picked.logprobs,
            )));
        }
        let tokens = self.backend.begin_argmax(&batch, &feed)?;
        self.ledger.record(&batch.writes);
        let rest = BegunRest {
            batch,
            t_start,
            t_validated,
        };
        if tokens.is_on_device() {
            return Ok(Begun::Running(RunningPass { tokens, rest }));
        }
        let tokens = tokens.wait()?;
        Ok(Begun::Done(self.finish_tokens(rest, tokens)))
    }

    /// The outputs of a begun pass from its tokens (one per logit row), as
    /// [`BegunRest::outputs`] makes them, with this pass's host stages kept
    /// for [`Worker::last_profile`].
    pub fn finish_tokens(&mut self, rest: BegunRest, tokens: Vec<u32>) -> Vec<SeqOutput> {
        let BegunRest {
            batch,
            t_start,
            t_validated,
        } = rest;
        self.outputs(&batch, t_start, t_validated, &tokens, Vec::new())
    }

    /// Validates `inputs`, counts their tokens into the penalised
    /// sequences' histories and the constrained ones' matchers, and says
    /// how each sequence's last logits row becomes its next token where
    /// that is not the plain argmax, and which rows report
    /// log-probabilities.
    fn prepare(&mut self, inputs: Vec<SeqInput>) -> Result<(Batch, Vec<RowPick>, Vec<LogprobRow>)> {
        let batch = self.validate(inputs)?;
        self.histories.advance(&batch.seqs)?;
        self.matchers.advance(&batch.seqs)?;
        let vocab = self.info.model.vocab_size;
        let mut picks = Vec::new();
        let mut logprobs = Vec::new();
        let mut row = 0;
        for seq in &batch.seqs {
            logprobs.extend(rows_of(seq, row));
            row += seq.logit_rows();
            let next_pos = seq.start_pos + seq.tokens.len();
            let history = self.histories.get(seq.seq_id);
            let mask = if seq.sampling.constrained {
                self.matchers.mask(seq.seq_id, vocab)?
            } else {
                None
            };
            picks.extend(row_pick(row - 1, &seq.sampling, history, next_pos, mask));
        }
        Ok((batch, picks, logprobs))
    }

    fn validate(&mut self, inputs: Vec<SeqInput>) -> Result<Batch> {
        batch::validate(
            inputs,
            &self.info.model,
            &self.layout,
            &self.ledger,
            self.info.limits,
            &mut self.marks,
        )
    }

    /// After the backend ran `batch` (its writes recorded in the ledger):
    /// builds each sequence's output from `tokens`, the token picked at
    /// every logits row, and `logprobs`, the rows [`Worker::prepare`]
    /// asked for, in its order.
    fn outputs(
        &mut self,
        batch: &Batch,
        t_start: Instant,
        t_validated: Instant,
        tokens: &[u32],
        logprobs: Vec<RowLogprobs>,
    ) -> Vec<SeqOutput> {
        let t_forward = Instant::now();
        let mut outputs = seq_outputs(batch, tokens);
        let mut logprobs = logprobs.into_iter();
        for (out, seq) in outputs.iter_mut().zip(&batch.seqs) {
            let n = rows_of(seq, 0).len();
            out.logprobs = logprobs.by_ref().take(n).collect();
        }
        let ms = |a: Instant, b: Instant| (b - a).as_secs_f64() * 1e3;
        self.host_times = (ms(t_start, t_validated), ms(t_forward, Instant::now()));
        outputs
    }
}

/// Each sequence's output from `tokens`, the token picked at every logits
/// row: its last row's is its next token.
fn seq_outputs(batch: &Batch, tokens: &[u32]) -> Vec<SeqOutput> {
    let mut outputs = Vec::with_capacity(batch.seqs.len());
    let mut row = 0;
    for seq in &batch.seqs {
        let rows = row..row + seq.logit_rows();
        row = rows.end;
        let seq_tokens = tokens.get(rows.clone()).unwrap_or(&[]);
        outputs.push(SeqOutput {
            seq_id: seq.seq_id,
            next_token: seq_tokens.last().copied().unwrap_or(0),
            argmax: if seq.all_positions {
                seq_tokens.to_vec()
            } else {
                Vec::new()
            },
            rows,
            logprobs: Vec::new(),
        });
    }
    outputs
}

/// A batch begun by [`Worker::begin_tokens`].
#[derive(Debug)]
pub enum Begun {
    /// Run to the end: its outputs.
    Done(Vec<SeqOutput>),
    /// Running on the device.
    Running(RunningPass),
}

/// A pass running on the device: its tokens to wait for, and what
/// [`Worker::finish_tokens`] makes the outputs from.
#[derive(Debug)]
pub struct RunningPass {
    /// The pass's tokens, one per logit row.
    pub tokens: PendingTokens,
    /// What the outputs are made from.
    pub rest: BegunRest,
}

impl RunningPass {
    /// The last logit row of each sequence (by id): where the token it
    /// sampled is, for a pass fed from this one.
    pub fn last_rows(&self) -> impl Iterator<Item = (u64, u32)> + '_ {
        self.rest.batch.seqs.iter().scan(0usize, |row, seq| {
            *row += seq.logit_rows();
            Some((seq.seq_id, (*row - 1) as u32))
        })
    }
}

/// The batch of a begun pass and when its host stages happened.
#[derive(Debug)]
pub struct BegunRest {
    batch: Batch,
    t_start: Instant,
    t_validated: Instant,
}

impl BegunRest {
    /// The outputs of the pass from its tokens (one per logit row), made
    /// without the worker, so a pass's answer need not wait for the next
    /// pass's host work.
    pub fn outputs(&self, tokens: &[u32]) -> Vec<SeqOutput> {
        seq_outputs(&self.batch, tokens)
    }
}

/// [`Worker::begin_tokens`]'s feed (input index, row) as token indices of
/// `batch` (its sequences in input order): each fed input has one token.
fn device_feed(batch: &Batch, feed: &[(usize, u32)]) -> Result<Vec<Feed>> {
    if feed.is_empty() {
        return Ok(Vec::new());
    }
    let mut first_token = Vec::with_capacity(batch.seqs.len());
    let mut next = 0usize;
    for seq in &batch.seqs {
        first_token.push((next, seq.tokens.len()));
        next += seq.tokens.len();
    }
    feed.iter()
        .map(|&(input, row)| match first_token.get(input) {
            Some(&(token, 1)) => Ok(Feed {
                token: token as u32,
                row,
            }),
            _ => Err(Error::Backend(format!(
                "input {input} cannot be fed: it is not a one-token item of the batch"
            ))),
        })
        .collect()
}

/// Why the CUDA backend cannot run here, or `None` when it can.
pub fn cuda_unavailable() -> Option<String> {
    #[cfg(feature = "cuda")]
    {
        crate::backend::cuda::probe().err()
    }
    #[cfg(not(feature = "cuda"))]
    {
        Some("this binary was built without the `cuda` feature".into())
    }
}

fn check_limits(limits: Limits) -> Result<()> {
    if limits.max_batch_sequences == 0 || limits.max_batch_tokens == 0 {
        return Err(Error::Config(
            "max_batch_sequences and max_batch_tokens must be at least 1".into(),
        ));
    }
    Ok(())
}

/// A number that differs on every start of the worker process (never 0):
/// wall-clock nanoseconds mixed with the process id.
fn fresh_incarnation() -> u64 {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    (nanos ^ (u64::from(std::process::id()) << 40)).max(1)
}
