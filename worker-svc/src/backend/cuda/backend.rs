//! [`CudaBackend`]: sizes and owns the device memory, and runs a validated
//! batch as a sequence of launches (see `launches`) and products (`gemm`).

use std::sync::{Arc, Mutex};
use std::time::Instant;

use cudarc::driver::sys::{CUevent_flags, CUgraphInstantiate_flags, CUstreamCaptureMode};
use cudarc::driver::{CudaContext, CudaEvent, CudaSlice, CudaStream, CudaView, PinnedHostSlice};
use half::bf16;

use super::gemm::{Products, padded_rows};
use super::graphs::{self, DecodeGraphs, Graph, GraphKey};
use super::kernels::{KernelShape, Kernels};
use super::launches::{AttentionArgs, AttnOut, Launcher};
use super::picks::{DeviceLogprobs, DevicePicks};
use super::tier::HostTier;
use super::uploads::{Activations, BatchMeta, DeviceBatch, DeviceWeights};
use super::{CudaOptions, KvDtype, cuda_err, probe};
use crate::arena::{ArenaLayout, split_kv_bytes};
use crate::backend::{
    Backend, BatchLogits, Feed, GraphCounts, HostTimes, PendingTokens, PhaseTimes, Picked,
};
use crate::batch::{Batch, TierMove};
use crate::error::{Error, Result};
use crate::logprobs::LogprobRow;
use crate::model::weights::Weights;
use crate::model::{Activation, ModelConfig};
use crate::sampling::RowPick;

/// The CUDA backend.
#[derive(Debug)]
pub struct CudaBackend {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    products: Products,
    kernels: Kernels,
    config: ModelConfig,
    layout: ArenaLayout,
    weights: DeviceWeights,
    acts: Activations,
    kv: Vec<CudaSlice<u8>>,
    /// Pinned host blocks per pool (`--host-blocks`), in the arena's block
    /// layout.
    host_tier: HostTier,
    kv_dtype: KvDtype,
    device_name: String,
    weight_bytes: u64,
    profiling: bool,
    last_profile: Option<PhaseTimes>,
    /// Decode passes from CUDA graphs (`CudaOptions::decode_graphs`).
    use_graphs: bool,
    graphs: DecodeGraphs,
    /// Pinned buffers the tokens of begun passes come back in.
    readback: Readback,
}

/// Pinned host buffers, each one pass's tokens long at most, that a begun
/// pass's tokens are copied into without stopping the stream; a waited-on
/// pass gives its buffer back.
#[derive(Debug, Default, Clone)]
struct Readback {
    free: Arc<Mutex<Vec<PinnedHostSlice<u32>>>>,
}

impl Readback {
    /// A free buffer of `len` tokens, or a new one.
    fn take(&self, ctx: &Arc<CudaContext>, len: usize) -> Result<PinnedHostSlice<u32>> {
        let reused = self
            .free
            .lock()
            .map_err(|_| Error::Backend("token readback buffers poisoned".into()))?
            .pop();
        match reused {
            Some(b) if b.len() >= len => Ok(b),
            _ => {
                // SAFETY: the buffer is only read after a copy of the
                // device's tokens into it completed (`PinnedHostSlice::
                // as_slice` waits for it), never before. Not write-combined:
                // the host reads it.
                unsafe { ctx.alloc_pinned_with_flags::<u32>(len, 0) }
                    .map_err(cuda_err("alloc pinned tokens"))
            }
        }
    }

    /// Puts a buffer back once its tokens were read.
    fn give_back(&self, buffer: PinnedHostSlice<u32>) {
        if let Ok(mut free) = self.free.lock() {
            free.push(buffer);
        }
    }
}

/// What sizing found: the device's memory and what the arena got.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceSizing {
    /// Bytes of weights uploaded.
    pub weight_bytes: u64,
    /// Bytes of activation buffers for the largest batch.
    pub activation_bytes: u64,
    /// Free device bytes after both.
    pub free_bytes: u64,
    /// Bytes given to the arena (free × fraction, whole blocks).
    pub kv_bytes: u64,
}

impl CudaBackend {
    /// Uploads `weights`, allocates activations for `max_tokens` rows, then
    /// sizes the arena from the device's free memory: `num_blocks` when
    /// given, else `free × options.memory_fraction` (at most
    /// `options.max_kv_bytes` when that is set) split across pools by layer
    /// count.
    pub fn new(
        weights: Weights,
        max_tokens: usize,
        options: CudaOptions,
        num_blocks: Option<&[u32]>,
    ) -> Result<(Self, DeviceSizing)> {
        probe().map_err(|reason| Error::Config(format!("cuda backend unavailable: {reason}")))?;
        if !(options.memory_fraction > 0.0 && options.memory_fraction <= 1.0) {
            return Err(Error::Config(format!(
                "gpu memory fraction {} must be in (0, 1]",
                options.memory_fraction
            )));
        }
        let cfg = weights.config.clone();
        let group = cfg.num_heads / cfg.num_kv_heads;
        if cfg.head_dim > 256 || group > 8 {
            return Err(Error::Config(format!(
                "the cuda backend supports head_dim up to 256 and up to 8 query heads per KV \
                 head (got head_dim {}, {group} per KV head)",
                cfg.head_dim
            )));
        }
        let ctx = CudaContext::new(options.device).map_err(cuda_err("context"))?;
        // A stream of its own: the legacy default stream cannot be captured
        // into a graph.
        let stream = ctx.new_stream().map_err(cuda_err("stream"))?;
        let products = Products::new(&ctx, &stream, options.gemm_streams)?;
        let kernels = Kernels::compile(
            &ctx,
            KernelShape {
                head_dim: cfg.head_dim,
                group,
                kv_heads: cfg.num_kv_heads,
                tokens_per_block: cfg.tokens_per_block as usize,
                kv_dtype: options.kv_dtype,
                attn_softcap: cfg.arch.attn_softcap,
            },
        )?;
        let device_name = ctx.name().map_err(cuda_err("device name"))?;

        let dev_weights = DeviceWeights::upload(&stream, &weights)?;
        let weight_bytes = dev_weights.bytes;
        let acts = Activations::alloc(&stream, &cfg, max_tokens)?;
        let activation_bytes = acts.bytes;
        stream.synchronize().map_err(cuda_err("synchronize"))?;

        let (free, _total) = ctx.mem_get_info().map_err(cuda_err("memory info"))?;
        let free_bytes = free as u64;
        let mut kv_budget = (free_bytes as f64 * options.memory_fraction) as u64;
        if options.max_kv_bytes > 0 {
            kv_budget = kv_budget.min(options.max_kv_bytes);
        }
        let blocks = match num_blocks {
            Some(b) => b.to_vec(),
            None => split_kv_bytes(&cfg, kv_budget, options.kv_dtype.elem_bytes()).ok_or(
                Error::MemoryBudget {
                    budget_bytes: weight_bytes + activation_bytes + kv_budget,
                    weight_bytes,
                    activation_bytes,
                },
            )?,
        };
        let layout = ArenaLayout::new(&cfg, &blocks);
        let kv = layout
            .pools
            .iter()
            .map(|p| {
                stream
                    .alloc_zeros::<u8>(p.elems() * options.kv_dtype.elem_bytes() as usize)
                    .map_err(cuda_err("arena alloc"))
            })
            .collect::<Result<Vec<_>>>()?;
        let sizing = DeviceSizing {
            weight_bytes,
            activation_bytes,
            free_bytes,
            kv_bytes: layout.bytes_with(options.kv_dtype.elem_bytes()),
        };
        Ok((
            CudaBackend {
                ctx,
                stream,
                products,
                kernels,
                config: cfg,
                layout,
                weights: dev_weights,
                acts,
                kv,
                host_tier: HostTier::default(),
                kv_dtype: options.kv_dtype,
                device_name,
                weight_bytes,
                profiling: false,
                last_profile: None,
                use_graphs: options.decode_graphs,
                graphs: DecodeGraphs::default(),
                readback: Readback::default(),
            },
            sizing,
        ))
    }

    /// The arena layout the backend allocated.
    pub fn layout(&self) -> &ArenaLayout {
        &self.layout
    }

    /// Bytes of one arena element.
    fn elem_bytes(&self) -> usize {
        self.kv_dtype.elem_bytes() as usize
    }

    /// Bytes of the weights on the device (matrices bf16, norms and the
    /// embedding table f32).
    pub fn weight_bytes(&self) -> u64 {
        self.weight_bytes
    }

    /// Bytes of the activation buffers.
    pub fn activation_bytes(&self) -> u64 {
        self.acts.bytes
    }

    /// Bytes a decode step must read of the weights: every matrix and norm,
    /// not the embedding table (one row per sequence).
    pub fn weight_bytes_per_step(&self) -> u64 {
        self.weights.bytes_read_per_step()
    }

    /// One pass up to the logits, which stay on the device in
    /// `acts.logits`: the batch's metadata uploaded, then the launches, from
    /// a graph for a decode batch (see `graphs`) or one by one. Returns how
    /// many logit rows the batch has (the first rows of `acts.logits`).
    /// Profiling marks go into `prof` (a profiled pass runs eagerly). The
    /// tokens `feed` names are taken on the device from the argmax of the
    /// pass before, after the metadata upload.
    fn pass(&mut self, batch: &Batch, feed: &[Feed], prof: &mut Profiler) -> Result<usize> {
        let graph_rows = graphs::decode_rows(batch).filter(|_| self.use_graphs && !prof.is_on());
        if let Some(rows) = graph_rows {
            let meta = self.batch_meta(batch, graphs::bucket(rows));
            let mut state = std::mem::take(&mut self.graphs);
            let replayed = self.replay(&mut state, batch, feed, &meta, prof);
            self.graphs = state;
            if replayed? {
                return Ok(rows);
            }
        }
        let meta = self.batch_meta(batch, batch.total_tokens());
        let mut dev = DeviceBatch::upload(&self.stream, meta)?;
        self.feed_tokens(&mut dev.tokens, batch.total_tokens(), dev.rows, feed)?;
        prof.uploaded();
        self.copy_partial_blocks(batch)?;
        self.launch_pass(&dev, prof)?;
        Ok(dev.num_logit_rows)
    }

    /// The metadata of `batch`, padded to `rows` rows.
    fn batch_meta(&self, batch: &Batch, rows: usize) -> BatchMeta {
        let (kernels, part_cap) = (&self.kernels, self.acts.part_cap);
        let max_group = |w, keys| kernels.max_group(w, kernels.split_plan(keys, part_cap));
        BatchMeta::build(batch, &self.layout, &self.config, max_group, rows)
    }

    /// A decode pass from the graph of its row and key buckets, captured
    /// first when there is none yet. False, with nothing run, when the
    /// capture failed: graphs are then off for good (the pass runs eagerly).
    fn replay(
        &mut self,
        state: &mut DecodeGraphs,
        batch: &Batch,
        feed: &[Feed],
        meta: &BatchMeta,
        prof: &mut Profiler,
    ) -> Result<bool> {
        let key = GraphKey {
            rows: meta.rows(),
            keys: meta
                .pools
                .iter()
                .map(|p| graphs::keys_bucket(p.max_keys))
                .collect(),
        };
        let fits = match state.batch.as_mut() {
            Some(dev) => dev.overwrite(&self.stream, meta)?,
            None => false,
        };
        if !fits {
            // New addresses: every graph captured so far reads the old ones.
            state.graphs.clear();
            let mut dev = DeviceBatch::alloc_for(&self.stream, meta, 2, graphs::MAX_GRAPH_ROWS)?;
            if !dev.overwrite(&self.stream, meta)? {
                return Err(Error::Backend(
                    "decode graph metadata does not fit the buffers made for it".into(),
                ));
            }
            state.batch = Some(dev);
        }
        let Some(dev) = state.batch.as_mut() else {
            return Err(Error::Backend("decode graph metadata missing".into()));
        };
        for (pool, &keys) in dev.pools.iter_mut().zip(&key.keys) {
            pool.max_keys = keys;
        }
        // before the capture, which runs nothing: the replay reads them
        self.feed_tokens(&mut dev.tokens, batch.total_tokens(), meta.rows(), feed)?;
        prof.uploaded();
        if !state.graphs.contains_key(&key) {
            match self.capture(dev) {
                Ok(graph) => {
                    state.captures += 1;
                    state.graphs.insert(key.clone(), graph);
                }
                Err(error) => {
                    tracing::warn!(%error, "cuda graph capture failed; decode passes run eagerly");
                    self.use_graphs = false;
                    return Ok(false);
                }
            }
        }
        let Some(graph) = state.graphs.get(&key) else {
            return Err(Error::Backend("decode graph missing after capture".into()));
        };
        self.copy_partial_blocks(batch)?;
        graph.0.launch().map_err(cuda_err("graph launch"))?;
        state.replays += 1;
        Ok(true)
    }

    /// Records the launches of a pass over `dev` into a graph (nothing runs).
    fn capture(&mut self, dev: &DeviceBatch) -> Result<Graph> {
        self.stream
            .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .map_err(cuda_err("begin capture"))?;
        let mut off = Profiler::start(&self.stream, false)?;
        let launched = self.launch_pass(dev, &mut off);
        // Ends the capture whatever happened, so the stream takes work again.
        let ended = self
            .stream
            .end_capture(CUgraphInstantiate_flags(0))
            .map_err(cuda_err("end capture"));
        launched?;
        match ended? {
            Some(graph) => Ok(Graph(graph)),
            None => Err(Error::Backend("cuda graph capture recorded nothing".into())),
        }
    }

    /// Writes the tokens `feed` names into `tokens` (the first `len` are
    /// the batch's, then padding up to `padded`): each the argmax of a
    /// logit row of the pass before, still in `acts.argmax` (a pass
    /// overwrites it only with its own argmax, after its tokens were
    /// embedded). Padding rows repeat the last token, position and slot
    /// (`BatchMeta::build`): when that token is fed, so are they, or they
    /// would write the placeholder's K/V into its slot.
    fn feed_tokens(
        &mut self,
        tokens: &mut CudaSlice<u32>,
        len: usize,
        padded: usize,
        feed: &[Feed],
    ) -> Result<()> {
        if feed.is_empty() {
            return Ok(());
        }
        let last = feed.iter().find(|f| f.token as usize + 1 == len).copied();
        let padding = (len..padded).filter_map(|t| {
            last.map(|f| Feed {
                token: t as u32,
                row: f.row,
            })
        });
        let feed: Vec<Feed> = feed.iter().copied().chain(padding).collect();
        let len = padded.max(len);
        let rows = self.acts.argmax.len();
        if let Some(f) = feed
            .iter()
            .find(|f| f.token as usize >= len.min(tokens.len()) || f.row as usize >= rows)
        {
            return Err(Error::Backend(format!(
                "fed token {} from row {} is outside the batch's {len} tokens or the {rows} rows of the pass before",
                f.token, f.row
            )));
        }
        let pairs: Vec<u32> = feed.iter().flat_map(|f| [f.token, f.row]).collect();
        let pairs = self
            .stream
            .clone_htod(&pairs)
            .map_err(cuda_err("upload fed tokens"))?;
        Launcher {
            stream: &self.stream,
            kernels: &self.kernels,
        }
        .feed_tokens(&self.acts.argmax, &pairs, feed.len(), tokens)
    }

    /// The partial-block copies of `batch`'s sequences: before the pass,
    /// whose attention reads them.
    fn copy_partial_blocks(&mut self, batch: &Batch) -> Result<()> {
        let launch = Launcher {
            stream: &self.stream,
            kernels: &self.kernels,
        };
        for seq in &batch.seqs {
            for c in &seq.copies {
                let geometry = &self.layout.pools[c.pool];
                let runs = geometry.layers.len() * 2 * geometry.num_kv_heads;
                launch.copy_kv_slots(
                    &mut self.kv[c.pool],
                    geometry.offset(c.src, 0, 0, 0, 0),
                    geometry.offset(c.dst, 0, 0, 0, 0),
                    runs,
                    (geometry.tokens_per_block, geometry.head_dim),
                    c.slots,
                )?;
            }
        }
        Ok(())
    }

    /// The launches of a pass over `dev`'s rows: embed, the layers, the
    /// final norm and LM head over the logit rows.
    fn launch_pass(&mut self, dev: &DeviceBatch, prof: &mut Profiler) -> Result<()> {
        let launch = Launcher {
            stream: &self.stream,
            kernels: &self.kernels,
        };
        let h = self.config.hidden_size;
        launch.embed(
            &self.weights.embed,
            &dev.tokens,
            &mut self.acts.x,
            dev.rows,
            h,
            self.config.arch.embed_scale,
        )?;
        prof.mark(Phase::Other)?;
        for layer in 0..self.weights.layers.len() {
            self.attention_block(layer, dev, prof)?;
            self.mlp_block(layer, dev, prof)?;
        }
        self.logits(dev, prof)
    }

    /// A pass, then the logits rows back to the host.
    fn run(&mut self, batch: &Batch) -> Result<BatchLogits> {
        let mut prof = Profiler::start(&self.stream, self.profiling)?;
        let rows = self.pass(batch, &[], &mut prof)?;
        prof.launched();
        let vocab = self.config.vocab_size;
        let values = self
            .stream
            .clone_dtoh(&self.acts.logits.slice(..rows * vocab))
            .map_err(cuda_err("download logits"))?;
        self.finish_profile(prof)?;
        Ok(BatchLogits { vocab, values })
    }

    /// A pass, then the argmax of every logits row on the device: one token
    /// per row comes back instead of the row.
    fn run_argmax(&mut self, batch: &Batch, feed: &[Feed]) -> Result<Vec<u32>> {
        let mut prof = Profiler::start(&self.stream, self.profiling)?;
        let rows = self.pass_argmax(batch, feed, &mut prof)?;
        self.tokens_back(rows, prof)
    }

    /// A pass, then one token per logits row picked on the device: the
    /// picks' adjustments, the argmax of every row, then the sampled rows
    /// drawn over theirs; with `logprobs`, the raw values of the adjusted
    /// logits and of the masked (constrained) rows are kept around the
    /// picking and put back, then `logprob_rows` reports each row asked
    /// for. One token per row, and
    /// each asked row's few values, come back instead of the rows.
    fn run_picks(
        &mut self,
        batch: &Batch,
        feed: &[Feed],
        picks: &[RowPick],
        logprobs: &[LogprobRow],
    ) -> Result<Picked> {
        let mut prof = Profiler::start(&self.stream, self.profiling)?;
        let vocab = self.config.vocab_size;
        let rows_needed: usize = batch.seqs.iter().map(|s| s.logit_rows()).sum();
        let device_picks = DevicePicks::upload(&self.stream, picks, rows_needed, vocab)?;
        let mut device_logprobs =
            DeviceLogprobs::upload(&self.stream, logprobs, rows_needed, vocab)?;
        let rows = self.pass(batch, feed, &mut prof)?;
        if rows != rows_needed {
            return Err(Error::Backend(format!(
                "the pass returned {rows} logits rows, its sequences need {rows_needed}"
            )));
        }
        let launch = Launcher {
            stream: &self.stream,
            kernels: &self.kernels,
        };
        // the raw values of the logits adjusted or masked, while logprobs
        // need them: a constrained row whole (its mask may clear any
        // token), the other adjusted logits one by one
        let (mut kept, mut kept_rows) = (None, None);
        if device_logprobs.is_some() {
            if let Some(m) = &device_picks.masks {
                let mut vals = self
                    .stream
                    .alloc_zeros::<f32>(m.n * vocab)
                    .map_err(cuda_err("allocate kept rows"))?;
                launch.keep_rows(&mut self.acts.logits, vocab, rows, m, &mut vals, false)?;
                kept_rows = Some(vals);
            }
            if let Some(a) = &device_picks.adjusts {
                let mut vals = self
                    .stream
                    .alloc_zeros::<f32>(a.n)
                    .map_err(cuda_err("allocate kept logits"))?;
                launch.keep_logits(&mut self.acts.logits, vocab, rows, a, &mut vals, false)?;
                kept = Some(vals);
            }
        }
        if let Some(a) = &device_picks.adjusts {
            launch.adjust_logits(&mut self.acts.logits, vocab, rows, a)?;
        }
        if let Some(m) = &device_picks.masks {
            launch.mask_logits(&mut self.acts.logits, vocab, rows, m)?;
        }
        launch.argmax_rows(&self.acts.logits, vocab, rows, &mut self.acts.argmax)?;
        if let Some(s) = &device_picks.samples {
            launch.sample_rows(&self.acts.logits, vocab, rows, s, &mut self.acts.argmax)?;
        }
        if let Some(l) = &mut device_logprobs {
            // both put raw values back, so their order does not matter
            if let (Some(a), Some(vals)) = (&device_picks.adjusts, &mut kept) {
                launch.keep_logits(&mut self.acts.logits, vocab, rows, a, vals, true)?;
            }
            if let (Some(m), Some(vals)) = (&device_picks.masks, &mut kept_rows) {
                launch.keep_rows(&mut self.acts.logits, vocab, rows, m, vals, true)?;
            }
            launch.logprob_rows(&self.acts.logits, vocab, rows, &self.acts.argmax, l)?;
        }
        prof.mark(Phase::Other)?;
        let tokens = self.tokens_back(rows, prof)?;
        let logprobs = match &device_logprobs {
            Some(l) => l.read(&self.stream)?,
            None => Vec::new(),
        };
        Ok(Picked { tokens, logprobs })
    }

    /// The first `rows` tokens of `acts.argmax` back on the host, once the
    /// pass enqueued with `prof` finished.
    fn tokens_back(&mut self, rows: usize, mut prof: Profiler) -> Result<Vec<u32>> {
        prof.launched();
        let tokens = self
            .stream
            .clone_dtoh(&self.acts.argmax.slice(..rows))
            .map_err(cuda_err("download tokens"))?;
        self.finish_profile(prof)?;
        Ok(tokens)
    }

    /// A pass and the argmax of its logit rows into `acts.argmax`; returns
    /// the rows.
    fn pass_argmax(&mut self, batch: &Batch, feed: &[Feed], prof: &mut Profiler) -> Result<usize> {
        let rows = self.pass(batch, feed, prof)?;
        let launch = Launcher {
            stream: &self.stream,
            kernels: &self.kernels,
        };
        let vocab = self.config.vocab_size;
        launch.argmax_rows(&self.acts.logits, vocab, rows, &mut self.acts.argmax)?;
        prof.mark(Phase::Other)?;
        Ok(rows)
    }

    /// Keeps the phase times of a profiled pass whose results came back.
    fn finish_profile(&mut self, prof: Profiler) -> Result<()> {
        if prof.is_on() {
            let downloaded = Instant::now();
            self.stream.synchronize().map_err(cuda_err("synchronize"))?;
            self.last_profile = Some(prof.finish(downloaded)?);
        }
        Ok(())
    }

    /// RMSNorm, the QKV product, its biases and per-head norms where the
    /// model has them, RoPE, the K/V scatter into the arena, paged attention
    /// and the output product added to the residual (through a post-norm
    /// where the model has one).
    fn attention_block(
        &mut self,
        layer: usize,
        dev: &DeviceBatch,
        prof: &mut Profiler,
    ) -> Result<()> {
        let cfg = &self.config;
        let (h, qd, kvd, d) = (cfg.hidden_size, cfg.q_dim(), cfg.kv_dim(), cfg.head_dim);
        let qkv_dim = qd + 2 * kvd;
        let (t, tp) = (dev.rows, padded_rows(dev.rows));
        let b = cfg.tokens_per_block as usize;
        let lw = &self.weights.layers[layer];
        let acts = &mut self.acts;
        let launch = Launcher {
            stream: &self.stream,
            kernels: &self.kernels,
        };
        let (pi, layer_slot) = self.layout.layer_slots[layer];
        let geometry = &self.layout.pools[pi];
        let pool = &dev.pools[pi];
        let layer_off = (layer_slot * 2 * kvd * b) as i64;

        let norm = RowNorm {
            launch: &launch,
            weight: &lw.attn_norm,
            eps: cfg.rms_norm_eps,
        };
        norm.then_product(
            &self.products,
            &acts.x,
            &mut acts.normed,
            &lw.wqkv,
            &mut acts.qkv,
            (t, h, qkv_dim),
            prof,
        )?;
        let shape = (qkv_dim, cfg.num_heads, cfg.num_kv_heads, d);
        if lw.qkv_bias.is_some() || lw.qk_norm.is_some() {
            let norms = lw.qk_norm.as_ref().map(|(q, k)| (q, k));
            launch.qkv_prep(
                &mut acts.qkv,
                shape,
                lw.qkv_bias.as_ref(),
                norms,
                cfg.rms_norm_eps,
                t,
            )?;
        }
        // Gemma 3's sliding layers rotate with a base of their own.
        let inv_freq = match &acts.inv_freq_local {
            Some(local) if geometry.window > 0 => local,
            _ => &acts.inv_freq,
        };
        launch.rope_write_kv(
            &mut acts.qkv,
            shape,
            &dev.positions,
            inv_freq,
            &pool.dst_base,
            layer_off,
            &mut self.kv[pi],
            t,
        )?;
        prof.mark(Phase::Other)?;
        let plan = self.kernels.split_plan(pool.max_keys, acts.part_cap);
        launch.attention(
            AttentionArgs {
                q: &acts.qkv,
                q_stride: qkv_dim,
                arena: &self.kv[pi],
                layer_off,
                elems_per_block: geometry.elems_per_block() as i64,
                tables: &pool.tables,
                table_off: &pool.table_off,
                first_block: &pool.first_block,
                tok_seq: &dev.tok_seq,
                tok_pos: &dev.positions,
                groups: &pool.groups,
                group_first: &pool.group_first,
                window: geometry.window,
                rows: t,
                num_heads: cfg.num_heads,
                num_kv_heads: cfg.num_kv_heads,
                head_dim: d,
                scale: cfg.attn_scale(),
                plan,
            },
            &mut acts.part_o,
            &mut acts.part_ml,
            Some(AttnOut::Bf16(&mut acts.attn)),
            qd,
        )?;
        prof.mark(Phase::Attention)?;
        let post = lw.post_norms.as_ref().map(|(attn_post, _)| attn_post);
        let residual = Residual {
            launch: &launch,
            products: &self.products,
            eps: cfg.rms_norm_eps,
        };
        residual.add_product(
            &acts.attn.slice(..tp * qd),
            &lw.wo,
            (t, qd, h),
            post,
            &mut acts.branch,
            &mut acts.x,
            prof,
        )
    }

    /// RMSNorm, the gate/up product, the gated activation and the down
    /// product added to the residual (through a post-norm where the model
    /// has one).
    fn mlp_block(&mut self, layer: usize, dev: &DeviceBatch, prof: &mut Profiler) -> Result<()> {
        let cfg = &self.config;
        let (h, f) = (cfg.hidden_size, cfg.ffn_size);
        let (t, tp) = (dev.rows, padded_rows(dev.rows));
        let lw = &self.weights.layers[layer];
        let acts = &mut self.acts;
        let launch = Launcher {
            stream: &self.stream,
            kernels: &self.kernels,
        };
        let norm = RowNorm {
            launch: &launch,
            weight: &lw.mlp_norm,
            eps: cfg.rms_norm_eps,
        };
        norm.then_product(
            &self.products,
            &acts.x,
            &mut acts.normed,
            &lw.w_gate_up,
            &mut acts.gate_up,
            (t, h, 2 * f),
            prof,
        )?;
        let gelu = cfg.arch.activation == Activation::GeluTanh;
        launch.swiglu(&acts.gate_up, f, t, &mut acts.act, gelu)?;
        prof.mark(Phase::Other)?;
        let post = lw.post_norms.as_ref().map(|(_, mlp_post)| mlp_post);
        let residual = Residual {
            launch: &launch,
            products: &self.products,
            eps: cfg.rms_norm_eps,
        };
        residual.add_product(
            &acts.act.slice(..tp * f),
            &lw.w_down,
            (t, f, h),
            post,
            &mut acts.branch,
            &mut acts.x,
            prof,
        )
    }

    /// The final norm of the logit rows and the LM head over them, into the
    /// first `dev.num_logit_rows` rows of `acts.logits`.
    fn logits(&mut self, dev: &DeviceBatch, prof: &mut Profiler) -> Result<()> {
        let cfg = &self.config;
        let (h, vocab) = (cfg.hidden_size, cfg.vocab_size);
        let r = dev.num_logit_rows;
        let acts = &mut self.acts;
        let launch = Launcher {
            stream: &self.stream,
            kernels: &self.kernels,
        };
        launch.rms_norm(
            &acts.x,
            Some(&dev.logit_rows),
            &self.weights.final_norm,
            &mut acts.final_rows,
            r,
            h,
            cfg.rms_norm_eps,
        )?;
        prof.mark(Phase::Other)?;
        self.products.linear(
            &acts.final_rows.slice(..padded_rows(r) * h),
            h,
            &self.weights.head,
            &mut acts.logits.slice_mut(..padded_rows(r) * vocab),
            (r, h, vocab),
            false,
        )?;
        prof.mark(Phase::Matmul)?;
        if let Some(cap) = cfg.arch.final_softcap {
            launch.soft_cap(&mut acts.logits, r * vocab, cap)?;
            prof.mark(Phase::Other)?;
        }
        Ok(())
    }
}

/// A product whose output joins the residual stream: added by the
/// product itself, or normed first (Gemma's post-norms) from `branch`.
struct Residual<'a> {
    launch: &'a Launcher<'a>,
    products: &'a Products,
    eps: f32,
}

impl Residual<'_> {
    /// `x += input · wᵀ`, or `x += rms_norm(input · wᵀ) * post`.
    #[allow(clippy::too_many_arguments)] // both buffers of each stage
    fn add_product(
        &self,
        input: &CudaView<'_, bf16>,
        w: &CudaSlice<bf16>,
        (t, k, h): (usize, usize, usize),
        post: Option<&CudaSlice<f32>>,
        branch: &mut CudaSlice<f32>,
        x: &mut CudaSlice<f32>,
        prof: &mut Profiler,
    ) -> Result<()> {
        let tp = padded_rows(t);
        let Some(norm) = post else {
            self.products
                .linear(input, k, w, &mut x.slice_mut(..tp * h), (t, k, h), true)?;
            return prof.mark(Phase::Matmul);
        };
        self.products.linear(
            input,
            k,
            w,
            &mut branch.slice_mut(..tp * h),
            (t, k, h),
            false,
        )?;
        prof.mark(Phase::Matmul)?;
        self.launch.rms_norm_add(x, branch, norm, t, h, self.eps)?;
        prof.mark(Phase::Other)
    }
}

/// The RMSNorm in front of a layer's first product.
struct RowNorm<'a> {
    launch: &'a Launcher<'a>,
    weight: &'a CudaSlice<f32>,
    eps: f32,
}

impl RowNorm<'_> {
    /// `out[t × n] = rms_norm(x[t × k]) · w[n × k]ᵀ`, the norm through `normed`.
    #[allow(clippy::too_many_arguments)] // both buffers of each stage
    fn then_product(
        &self,
        products: &Products,
        x: &CudaSlice<f32>,
        normed: &mut CudaSlice<bf16>,
        w: &CudaSlice<bf16>,
        out: &mut CudaSlice<f32>,
        (t, k, n): (usize, usize, usize),
        prof: &mut Profiler,
    ) -> Result<()> {
        let tp = padded_rows(t);
        self.launch
            .rms_norm(x, None, self.weight, normed, t, k, self.eps)?;
        prof.mark(Phase::Other)?;
        products.linear(
            &normed.slice(..tp * k),
            k,
            w,
            &mut out.slice_mut(..tp * n),
            (t, k, n),
            false,
        )?;
        prof.mark(Phase::Matmul)
    }
}

/// Which part of the pass a stretch of device time belongs to.
#[derive(Debug, Clone, Copy)]
enum Phase {
    Matmul,
    Attention,
    Other,
}

/// Device events between the phases of one pass, when profiling is on,
/// and the host's clock at its stages.
struct Profiler {
    stream: Arc<CudaStream>,
    start: Option<CudaEvent>,
    marks: Vec<(Phase, CudaEvent)>,
    /// Host instants: start, metadata uploaded, everything enqueued.
    host: [Instant; 3],
}

impl Profiler {
    fn start(stream: &Arc<CudaStream>, on: bool) -> Result<Self> {
        let now = Instant::now();
        let start = if on { Some(Self::event(stream)?) } else { None };
        Ok(Profiler {
            stream: stream.clone(),
            start,
            marks: Vec::new(),
            host: [now; 3],
        })
    }

    /// The batch's metadata is on the device.
    fn uploaded(&mut self) {
        self.host[1] = Instant::now();
    }

    /// Every launch of the pass is enqueued.
    fn launched(&mut self) {
        self.host[2] = Instant::now();
    }

    fn event(stream: &Arc<CudaStream>) -> Result<CudaEvent> {
        stream
            .record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
            .map_err(cuda_err("event"))
    }

    fn is_on(&self) -> bool {
        self.start.is_some()
    }

    /// Ends a stretch of `phase` work.
    fn mark(&mut self, phase: Phase) -> Result<()> {
        if self.is_on() {
            let e = Self::event(&self.stream)?;
            self.marks.push((phase, e));
        }
        Ok(())
    }

    /// The device time of each phase and the host's stages; called once
    /// the results are back (and the stream has finished).
    fn finish(self, downloaded: Instant) -> Result<PhaseTimes> {
        let ms = |a: Instant, b: Instant| (b - a).as_secs_f64() * 1e3;
        let [started, uploaded, launched] = self.host;
        let mut times = PhaseTimes {
            host: HostTimes {
                upload_ms: ms(started, uploaded),
                launch_ms: ms(uploaded, launched),
                download_ms: ms(launched, downloaded),
                ..HostTimes::default()
            },
            ..PhaseTimes::default()
        };
        let Some(start) = self.start else {
            return Ok(times);
        };
        let mut prev = &start;
        for (phase, e) in &self.marks {
            let ms = f64::from(prev.elapsed_ms(e).map_err(cuda_err("event"))?);
            match phase {
                Phase::Matmul => times.matmul_ms += ms,
                Phase::Attention => times.attention_ms += ms,
                Phase::Other => times.other_ms += ms,
            }
            prev = e;
        }
        Ok(times)
    }
}

impl Backend for CudaBackend {
    fn name(&self) -> &'static str {
        "cuda"
    }

    fn device(&self) -> String {
        format!("{} (cuda:{})", self.device_name, self.ctx.ordinal())
    }

    fn kv_dtype(&self) -> &'static str {
        self.kv_dtype.name()
    }

    fn forward(&mut self, batch: &Batch) -> Result<BatchLogits> {
        self.run(batch)
    }

    fn set_host_tier(&mut self, host_blocks: &[u32]) -> Result<()> {
        self.host_tier = HostTier::alloc(&self.ctx, &self.layout, self.elem_bytes(), host_blocks)?;
        if self.host_tier.bytes() == 0 {
            return Ok(());
        }
        tracing::info!(
            pinned_bytes = self.host_tier.bytes(),
            ?host_blocks,
            "cuda host tier allocated in pinned host memory"
        );
        Ok(())
    }

    fn tier_copies(&mut self, moves: &[TierMove]) -> Result<()> {
        let elem_bytes = self.elem_bytes();
        self.host_tier
            .copy(&self.stream, &mut self.kv, &self.layout, elem_bytes, moves)
    }

    fn supports_disk_tier(&self) -> bool {
        true
    }

    fn host_block_bytes(&self, pool: usize, host_block: u32) -> Result<Vec<u8>> {
        self.host_tier
            .block_bytes(&self.layout, self.elem_bytes(), pool, host_block)
    }

    fn device_block_bytes(&self, pool: usize, block: u32) -> Result<Vec<u8>> {
        super::tier::device_block_bytes(
            &self.stream,
            &self.kv,
            &self.layout,
            self.elem_bytes(),
            pool,
            block,
        )
    }

    fn write_device_block(&mut self, pool: usize, device_block: u32, bytes: &[u8]) -> Result<()> {
        let elem_bytes = self.elem_bytes();
        super::tier::write_device_block(
            &self.stream,
            &mut self.kv,
            &self.layout,
            elem_bytes,
            pool,
            device_block,
            bytes,
        )
    }

    fn forward_picks(
        &mut self,
        batch: &Batch,
        feed: &[Feed],
        picks: &[RowPick],
        logprobs: &[LogprobRow],
    ) -> Result<Picked> {
        self.run_picks(batch, feed, picks, logprobs)
    }

    /// Enqueues the pass, its argmax and the copy of the tokens into a
    /// pinned buffer, and returns: the stream runs this pass after the one
    /// begun before it, and the next one after it, without the host waiting
    /// in between. A profiled pass runs at once (its phases are timed).
    fn begin_argmax(&mut self, batch: &Batch, feed: &[Feed]) -> Result<PendingTokens> {
        if self.profiling {
            return Ok(PendingTokens::ready(self.run_argmax(batch, feed)?));
        }
        let rows = self.pass_argmax(batch, feed, &mut Profiler::start(&self.stream, false)?)?;
        let mut host = self.readback.take(&self.ctx, self.acts.argmax.len())?;
        self.stream
            .memcpy_dtoh(&self.acts.argmax.slice(..rows), &mut host)
            .map_err(cuda_err("download tokens"))?;
        // The buffer's own event is recorded only when cudarc tracks
        // streams, which this context does not (see `Products::new`).
        let copied = self
            .stream
            .record_event(None)
            .map_err(cuda_err("record token copy"))?;
        let readback = self.readback.clone();
        Ok(PendingTokens::on_device(move || {
            // the copy, hence this pass and those before it, finished
            copied.synchronize().map_err(cuda_err("wait for tokens"))?;
            let tokens = host
                .as_slice()
                .map_err(cuda_err("download tokens"))?
                .get(..rows)
                .map(<[u32]>::to_vec)
                .ok_or_else(|| Error::Backend("token readback buffer too short".into()));
            readback.give_back(host);
            tokens
        }))
    }

    fn set_profiling(&mut self, on: bool) {
        self.profiling = on;
    }

    fn last_profile(&self) -> Option<PhaseTimes> {
        self.last_profile
    }

    fn graph_counts(&self) -> GraphCounts {
        GraphCounts {
            captures: self.graphs.captures,
            replays: self.graphs.replays,
        }
    }
}
