//! The gRPC edge: `kvlease.v1.WorkerService` over a [`Worker`]; `convert`
//! turns its messages into domain types and back.

use std::collections::HashMap;
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

use kvlease_proto::v1 as pb;
use kvlease_tokenizer::Tokenizer;
use tonic::{Request, Response, Status};
use tracing::Instrument;

use crate::batch::SeqInput;
use crate::convert::{
    describe_response, forward_result, peer_pull_input, seq_input, tier_copy_input,
    tokenizer_response,
};
use crate::metrics::WorkerMetrics;
use crate::peer::{Assembler, BlockRef, PeerPullInput, check_peer_pull, check_pull};
use crate::pipeline::PassLog;
use crate::worker::{Begun, Worker};

/// The gRPC service. Forward passes run one at a time on a blocking thread
/// (the worker owns one arena), a pipelined one only after the pass it
/// follows ([`crate::pipeline`]); Describe answers from a snapshot.
#[derive(Debug, Clone)]
pub(crate) struct WorkerGrpc {
    passes: Arc<Passes>,
    describe: pb::DescribeResponse,
    metrics: WorkerMetrics,
    tokenizer: Tokenizer,
    /// Whose Forward calls it serves.
    owner: Owner,
    /// What peer pulls need without the worker's lock.
    peers: Arc<Peers>,
}

/// Peer pull's view of this worker: its arena's geometry, each pool's
/// block bytes, how it dials a source, and the chunk size it streams.
#[derive(Debug)]
struct Peers {
    layout: crate::arena::ArenaLayout,
    block_bytes: Vec<u64>,
    security: kvlease_auth::Security,
    chunk_bytes: usize,
    /// Connections to source workers, by (address, stream of a pull),
    /// kept across pulls; one is dropped when a pull over it fails, so the
    /// next one connects anew.
    channels: std::sync::Mutex<HashMap<(String, usize), tonic::transport::Channel>>,
}

/// HTTP/2 receive windows of a pull's connection and stream: a source
/// sends this much before it waits for the puller to acknowledge (h2's
/// default of 64 KiB would make every 1 MiB chunk wait for about 16 round
/// trips).
const PULL_STREAM_WINDOW: u32 = 16 << 20;
const PULL_CONNECTION_WINDOW: u32 = 64 << 20;

impl WorkerGrpc {
    /// Serves `worker`, recording into `metrics`, with the seeded model's
    /// byte-level tokenizer.
    pub(crate) fn new(mut worker: Worker, metrics: WorkerMetrics) -> Self {
        let tokenizer = Tokenizer::byte_level();
        worker.set_tokenizer(tokenizer.clone());
        let describe = describe_response(worker.info(), &tokenizer);
        let peers = Arc::new(Peers {
            layout: worker.layout().clone(),
            block_bytes: worker
                .info()
                .pools
                .iter()
                .map(|p| p.bytes_per_block)
                .collect(),
            security: kvlease_auth::Security::loopback(),
            chunk_bytes: crate::peer::PULL_CHUNK_BYTES,
            channels: Mutex::default(),
        });
        WorkerGrpc {
            passes: Arc::new(Passes {
                worker: Mutex::new(worker),
                log: Mutex::new(Log::default()),
                changed: Condvar::new(),
            }),
            describe,
            metrics,
            tokenizer,
            owner: Owner::default(),
            peers,
        }
    }

    /// Dials source workers of peer pulls with `security` (the transport
    /// it serves with), streaming blocks in chunks of `chunk_bytes`.
    pub(crate) fn with_peer_transport(
        self,
        security: kvlease_auth::Security,
        chunk_bytes: usize,
    ) -> Self {
        let peers = Arc::new(Peers {
            layout: self.peers.layout.clone(),
            block_bytes: self.peers.block_bytes.clone(),
            security,
            chunk_bytes: chunk_bytes.clamp(1, crate::peer::PULL_CHUNK_BYTES),
            channels: Mutex::default(),
        });
        Self { peers, ..self }
    }

    fn fingerprint(&self) -> &str {
        self.describe
            .model
            .as_ref()
            .map_or("", |m| m.tokenizer_fingerprint.as_str())
    }

    /// Serves the model's own `tokenizer` (from its GGUF or tokenizer.json)
    /// instead; every id it can produce must be inside the model's
    /// vocabulary.
    pub(crate) fn with_tokenizer(mut self, tokenizer: Tokenizer) -> crate::Result<Self> {
        let model = self.describe.model.clone().unwrap_or_default();
        if tokenizer.vocab_size() > model.vocab_size {
            return Err(crate::Error::Config(format!(
                "the tokenizer of {} has {} tokens but the model's vocabulary only {}",
                model.name,
                tokenizer.vocab_size(),
                model.vocab_size
            )));
        }
        if let Some(m) = self.describe.model.as_mut() {
            m.tokenizer_fingerprint = tokenizer.fingerprint().to_string();
        }
        self.passes
            .worker
            .lock()
            .map_err(|_| crate::Error::Config("worker state poisoned".into()))?
            .set_tokenizer(tokenizer.clone());
        self.tokenizer = tokenizer;
        Ok(self)
    }

    /// Serves Forward calls of the principal `owner` only (`--owner`).
    pub(crate) fn with_owner(self, owner: &str) -> Self {
        Self {
            owner: Owner::named(owner),
            ..self
        }
    }
}

/// The worker, and the log of its passes under a lock of its own, so that a
/// pass's answer (which needs only the log) never waits for the next pass's
/// host work (which holds the worker); `changed` tells of every change to
/// the log. Lock order: the worker, then the log.
#[derive(Debug)]
struct Passes {
    worker: Mutex<Worker>,
    log: Mutex<Log>,
    changed: Condvar,
}

#[derive(Debug, Default)]
struct Log {
    passes: PassLog,
    /// When the last pass's tokens came back: a pass begun while another
    /// ran computes from then on.
    last_done: Option<Instant>,
}

/// A lock or wait on the worker's state after a panic elsewhere.
fn poisoned<E>(_: E) -> Status {
    Status::internal("worker state poisoned by an earlier panic")
}

/// Longest a pipelined pass waits for the pass it follows to begin (or
/// finish, where it cannot be fed on the device) before it fails.
const FOLLOW_WAIT: Duration = Duration::from_secs(10);

impl Passes {
    /// Waits on the log until `done` holds of it, or `deadline` passed
    /// (then `None`).
    fn wait_log<'a>(
        &'a self,
        mut log: std::sync::MutexGuard<'a, Log>,
        deadline: Instant,
        done: impl Fn(&Log) -> bool,
    ) -> Result<Option<std::sync::MutexGuard<'a, Log>>, Status> {
        while !done(&log) {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Ok(None);
            }
            log = self.changed.wait_timeout(log, left).map_err(poisoned)?.0;
        }
        Ok(Some(log))
    }

    /// Runs one pass of `step` once the pass of `after_step` (0: none) can
    /// be followed, feeding the items `feed` marks from it, and records its
    /// outcome for the pass that follows it. On a device the pass is begun
    /// under the worker's lock and its tokens awaited without it, so the
    /// pass that follows is begun (and its host work done) while this one
    /// runs. Returns the outputs, the compute time (from the later of the
    /// pass's start and the previous pass's end) and the time waited since
    /// `received` (in microseconds).
    fn run(
        &self,
        received: Instant,
        step: u64,
        after_step: u64,
        (copies, pulled): (
            &[crate::batch::TierCopyInput],
            &[crate::worker::PulledBlock],
        ),
        mut inputs: Vec<SeqInput>,
        feed: &[bool],
    ) -> Result<(Vec<crate::worker::SeqOutput>, u64, u64), Status> {
        let deadline = received + FOLLOW_WAIT;
        // A fed sequence whose penalty counts or grammar matcher take its
        // token on the host cannot be fed on the device: such a pass waits
        // for the one it follows to come back (the other fed sequences lose
        // the device overlap for this pass only; see worker-svc/README.md).
        let host_fed = inputs
            .iter()
            .zip(feed)
            .any(|(s, &f)| f && (s.sampling.penalties.any() || s.sampling.constrained));
        if after_step != 0 {
            let log = self.log.lock().map_err(poisoned)?;
            let ready = |l: &Log| {
                if host_fed {
                    l.passes.finished(after_step)
                } else {
                    l.passes.ready_to_follow(after_step)
                }
            };
            if self.wait_log(log, deadline, ready)?.is_none() {
                let late = || crate::Error::PreviousPass {
                    step: after_step,
                    problem: format!("did not finish within {} s", FOLLOW_WAIT.as_secs()),
                };
                self.record(step, received, &Err(late()))?;
                return Err(late().into());
            }
        }
        let mut worker = self.worker.lock().map_err(poisoned)?;
        // Timed after the lock: queueing behind another pass is not compute.
        let started = Instant::now();
        let wait_us = (started - received).as_micros() as u64;
        // no other pass begins while the worker is held: what the log
        // says of the pass followed holds until this one has begun
        let fed = self
            .log
            .lock()
            .map_err(poisoned)?
            .passes
            .feed(after_step, &mut inputs, feed);
        let begun = fed.and_then(|fed| {
            // The step's demotions and onboardings come first: the
            // demoted device blocks may be written by this very pass.
            worker.apply_tier_copies(copies)?;
            // then the blocks pulled from peers, which this pass reads
            worker.write_pulled(pulled)?;
            // Only the tokens: logits stay where the backend computed them.
            let begun = worker.begin_tokens(inputs, &fed.on_device)?;
            Ok((begun, !fed.on_device.is_empty()))
        });
        // a pass that failed to begin may have overwritten the device's
        // token rows too: then no pass can be fed from the device
        let rows = match &begun {
            Ok((Begun::Running(pass), _)) => Some(pass.last_rows().collect()),
            Ok((Begun::Done(_), _)) | Err(_) => None,
        };
        self.log.lock().map_err(poisoned)?.passes.begun(step, rows);
        self.changed.notify_all();
        drop(worker);
        let outcome = match begun {
            Ok((begun, fed_on_device)) => {
                let outputs = match begun {
                    Begun::Done(outputs) => Ok(outputs),
                    Begun::Running(pass) => pass.tokens.wait().map(|t| pass.rest.outputs(&t)),
                };
                // Fed on the device (a pass with picks or logprobs runs to
                // its end at once, but may be fed too): only as good as the
                // pass it followed, whose tokens came back before these
                // (its thread records it at once).
                let followed = if fed_on_device {
                    let log = self.log.lock().map_err(poisoned)?;
                    self.wait_log(log, deadline.max(Instant::now() + FOLLOW_WAIT), |l| {
                        l.passes.succeeded(after_step).is_some()
                    })?
                    .and_then(|l| l.passes.succeeded(after_step))
                } else {
                    Some(true)
                };
                outputs.and_then(|outputs| match followed {
                    Some(true) => Ok(outputs),
                    Some(false) => Err(crate::Error::PreviousPass {
                        step: after_step,
                        problem: "failed after this pass was fed from it".into(),
                    }),
                    None => Err(crate::Error::PreviousPass {
                        step: after_step,
                        problem: format!(
                            "did not finish within {} s of this pass, which was fed from it",
                            FOLLOW_WAIT.as_secs()
                        ),
                    }),
                })
            }
            Err(e) => Err(e),
        };
        let compute_us = self.record(step, started, &outcome)?;
        Ok((outcome.map_err(Status::from)?, compute_us, wait_us))
    }

    /// Records the outcome of the pass of `step` begun at `started`, for
    /// the pass that follows it; returns its compute time in microseconds,
    /// from the later of `started` and the previous pass's end.
    fn record(
        &self,
        step: u64,
        started: Instant,
        outcome: &crate::Result<Vec<crate::worker::SeqOutput>>,
    ) -> Result<u64, Status> {
        let done = Instant::now();
        let mut log = self.log.lock().map_err(poisoned)?;
        let from = log.last_done.map_or(started, |t| t.max(started));
        if outcome.is_ok() {
            log.last_done = Some(done);
        }
        log.passes.record(step, outcome.as_deref().ok());
        drop(log);
        self.changed.notify_all();
        Ok(done.saturating_duration_since(from).as_micros() as u64)
    }
}

/// The principal whose Forward calls a worker serves (the scheduler that owns its pool
/// group): named by `--owner`, or else the first principal that calls Forward.
#[derive(Debug, Clone, Default)]
pub(crate) struct Owner(Arc<OnceLock<String>>);

impl Owner {
    fn named(owner: &str) -> Self {
        let cell = OnceLock::new();
        let _ = cell.set(owner.to_string());
        Self(Arc::new(cell))
    }

    /// Refuses (and logs) a Forward from anyone but the owner; the first caller becomes the
    /// owner when there is none yet.
    fn check(&self, caller: &str) -> Result<(), Status> {
        self.check_rpc(caller, "Forward")
    }

    /// As [`Owner::check`], for the call `rpc` (`Forward`, or `PullBlocks`:
    /// a worker pulls blocks for its owner, with its owner's principal).
    fn check_rpc(&self, caller: &str, rpc: &str) -> Result<(), Status> {
        let owner = self.0.get_or_init(|| {
            tracing::info!(
                principal = caller,
                "first Forward: this worker now serves only its caller"
            );
            caller.to_string()
        });
        if owner == caller {
            return Ok(());
        }
        tracing::warn!(
            principal = caller,
            owner,
            rpc,
            "call from a principal that does not own this worker; refused"
        );
        Err(Status::permission_denied(format!(
            "this worker serves only its owner {owner}; principal {caller} may not {rpc}"
        )))
    }
}

#[tonic::async_trait]
impl pb::worker_service_server::WorkerService for WorkerGrpc {
    type PullBlocksStream = tokio_stream::wrappers::ReceiverStream<Result<pb::BlockChunk, Status>>;

    async fn pull_blocks(
        &self,
        request: Request<pb::PullBlocksRequest>,
    ) -> Result<Response<Self::PullBlocksStream>, Status> {
        let caller = kvlease_auth::principal_of(&request)
            .map_or(kvlease_auth::principal::ANONYMOUS, |p| p.name())
            .to_string();
        let is_worker = request.peer_certs().is_some_and(|certs| {
            certs.first().is_some_and(|der| {
                kvlease_auth::identity::services_of(der.as_ref())
                    .iter()
                    .any(|s| s == kvlease_auth::ServiceKind::Worker.name())
            })
        });
        let pull_for = request
            .metadata()
            .get(crate::peer::PULL_FOR_METADATA)
            .and_then(|v| v.to_str().ok());
        let acting = crate::peer::pulls_for(&caller, is_worker, pull_for).to_string();
        self.owner.check_rpc(&acting, "PullBlocks")?;
        let r = request.into_inner();
        let blocks: Vec<BlockRef> = r
            .blocks
            .iter()
            .map(|b| BlockRef {
                window: b.window,
                block: b.block,
                tokens: b.tokens,
            })
            .collect();
        let targets = check_pull(
            &self.peers.layout,
            (self.fingerprint(), &self.describe.kv_dtype),
            (&r.tokenizer_fingerprint, &r.kv_dtype),
            &blocks,
        )?;
        tracing::debug!(
            transfer_id = r.transfer_id,
            blocks = targets.len(),
            "serving a peer pull"
        );
        // two chunks in flight at most: a block is read from the arena
        // only once the puller took what came before (HTTP/2 flow control
        // holds the sender back)
        let (tx, rx) = tokio::sync::mpsc::channel(2);
        let passes = Arc::clone(&self.passes);
        let chunk_bytes = self.peers.chunk_bytes;
        let served = self.metrics.peer_served_bytes.clone();
        tokio::spawn(async move {
            for (index, (pool, block, slots)) in targets.into_iter().enumerate() {
                let p = Arc::clone(&passes);
                let read = tokio::task::spawn_blocking(move || {
                    let worker = p.worker.lock().map_err(poisoned)?;
                    worker.peer_block(pool, block, slots).map_err(Status::from)
                })
                .await
                .unwrap_or_else(|e| Err(Status::internal(format!("pull task failed: {e}"))));
                let data = match read {
                    Ok(data) => data,
                    Err(status) => {
                        let _ = tx.send(Err(status)).await;
                        return;
                    }
                };
                let block_bytes = data.len() as u64;
                served.inc_by(block_bytes);
                for (offset, piece) in crate::peer::chunks(&data, chunk_bytes) {
                    let chunk = pb::BlockChunk {
                        index: index as u32,
                        offset,
                        block_bytes,
                        data: piece.to_vec(),
                    };
                    if tx.send(Ok(chunk)).await.is_err() {
                        return; // the puller went away
                    }
                }
            }
        });
        Ok(Response::new(tokio_stream::wrappers::ReceiverStream::new(
            rx,
        )))
    }

    async fn describe(
        &self,
        _request: Request<pb::DescribeRequest>,
    ) -> Result<Response<pb::DescribeResponse>, Status> {
        Ok(Response::new(self.describe.clone()))
    }

    async fn get_tokenizer(
        &self,
        request: Request<pb::GetTokenizerRequest>,
    ) -> Result<Response<pb::GetTokenizerResponse>, Status> {
        let want = request.into_inner().fingerprint;
        let have = self.tokenizer.fingerprint();
        if !want.is_empty() {
            if want.len() != 16 || !want.bytes().all(|b| b.is_ascii_hexdigit()) {
                // named back as far as 16 digits go: a 1 MB one echoed whole
                // pushed the reply over the message cap (issue 29, point 9)
                let shown = kvlease_runtime::echo::clip(&want, 16);
                return Err(Status::invalid_argument(format!(
                    "fingerprint {shown} is not 16 hex digits"
                )));
            }
            if want != have {
                return Err(Status::failed_precondition(format!(
                    "this worker's tokenizer has fingerprint {have}, not {want}"
                )));
            }
        }
        let model = self.describe.model.as_ref().map(|m| m.name.clone());
        Ok(Response::new(tokenizer_response(
            model.unwrap_or_default(),
            &self.tokenizer,
        )))
    }

    async fn forward(
        &self,
        request: Request<pb::ForwardRequest>,
    ) -> Result<Response<pb::ForwardResponse>, Status> {
        // From here to the pass's start is the worker's share of the gap
        // between passes (conversion, the blocking thread, the lock).
        let received = Instant::now();
        let caller = kvlease_auth::principal_of(&request)
            .map_or(kvlease_auth::principal::ANONYMOUS, |p| p.name())
            .to_string();
        self.owner.check(&caller)?;
        let request = request.into_inner();
        let step = request.step;
        let sequences = request.sequences.len();
        // a fed item runs one token, the one its previous pass sampled
        let tokens: usize = request
            .sequences
            .iter()
            .map(|s| s.tokens.len().max(usize::from(s.feed_previous)))
            .sum();
        // A child of the server span that `GrpcTraceLayer` opens per request.
        // Integers as i64: a u64/usize field would be exported as a string.
        let span = tracing::info_span!(
            "compute",
            kvlease.step = step as i64,
            kvlease.sequences = sequences as i64,
            kvlease.tokens = tokens as i64,
            kvlease.compute_us = tracing::field::Empty,
        );
        // the prefill chunks of traced requests, each in its request's trace
        // (opened before the span is entered, so they start with the pass)
        let prefill_spans = prefill_spans(
            step,
            &request.sequences,
            kvlease_telemetry::span_context(&span),
        );
        let copies: Vec<_> = request.tier_copies.iter().map(tier_copy_input).collect();
        let after_step = request.after_step;
        let pulls: Vec<Option<PeerPullInput>> = request
            .sequences
            .iter()
            .map(|s| s.peer_pull.clone().map(peer_pull_input))
            .collect();
        let mut feed: Vec<bool> = request.sequences.iter().map(|s| s.feed_previous).collect();
        let mut inputs: Vec<SeqInput> = request.sequences.into_iter().map(seq_input).collect();
        // every pull is checked before any is made: a malformed one fails
        // the request, nothing written
        let mut targets = Vec::with_capacity(pulls.len());
        for (input, pull) in inputs.iter().zip(&pulls) {
            targets.push(match pull {
                Some(p) => Some(check_peer_pull(
                    &self.peers.layout,
                    input.seq_id,
                    input.start_pos,
                    &input.tables,
                    p,
                )?),
                None => None,
            });
        }
        let pulled = self.pull_all(step, &caller, &pulls, &targets).await;
        // a sequence whose pull failed sits this pass out; the rest runs
        let mut failed: Vec<(u64, String)> = Vec::new();
        let mut writes = Vec::new();
        let mut moved: Vec<(u64, u64, u64)> = Vec::new();
        let mut keep = Vec::with_capacity(inputs.len());
        for (input, result) in inputs.iter().zip(pulled) {
            match result {
                None => keep.push(true),
                Some(Ok(p)) => {
                    self.metrics.peer_pulled_bytes.inc_by(p.bytes);
                    moved.push((input.seq_id, p.bytes, p.micros));
                    writes.extend(p.blocks);
                    keep.push(true);
                }
                Some(Err(message)) => {
                    tracing::warn!(step, seq_id = input.seq_id, %message, "peer pull failed; the sequence sits this pass out");
                    self.metrics.peer_pull_failures.inc();
                    failed.push((input.seq_id, message));
                    keep.push(false);
                }
            }
        }
        let order: Vec<u64> = inputs.iter().map(|s| s.seq_id).collect();
        let mut k = keep.iter();
        inputs.retain(|_| k.next().copied().unwrap_or(true));
        let mut k = keep.iter();
        feed.retain(|_| k.next().copied().unwrap_or(true));
        let passes = Arc::clone(&self.passes);
        let metrics = self.metrics.clone();
        async move {
            let outcome = tokio::task::spawn_blocking(move || {
                passes.run(received, step, after_step, (&copies, &writes), inputs, &feed)
            })
            .await
            .map_err(|e| Status::internal(format!("forward task failed: {e}")))?;
            // the chunks end with the pass
            drop(prefill_spans);
            match outcome {
                Ok((outputs, compute_us, wait_us)) => {
                    tracing::Span::current().record("kvlease.compute_us", compute_us as i64);
                    metrics.forward_seconds.observe(compute_us as f64 / 1e6);
                    metrics.forward_tokens.inc_by(tokens as u64);
                    // one line per step: DEBUG, or a busy worker logs nothing else
                    tracing::debug!(step, sequences, tokens, compute_us, wait_us, "forward done");
                    Ok(Response::new(pb::ForwardResponse {
                        results: merge_results(&order, outputs, failed, &moved),
                        compute_us,
                    }))
                }
                Err(status) => {
                    metrics.forward_rejected.inc();
                    tracing::warn!(step, code = ?status.code(), message = status.message(), "forward rejected");
                    Err(status)
                }
            }
        }
        .instrument(span)
        .await
    }
}

/// What one sequence's pull brought: `(pool, block, slots, bytes)` to write, and
/// the bytes moved and microseconds it took.
#[derive(Debug)]
struct Pulled {
    blocks: Vec<crate::worker::PulledBlock>,
    bytes: u64,
    micros: u64,
}

/// Longest a sequence's pull may take, connection included.
const PULL_DEADLINE: Duration = Duration::from_secs(30);

impl WorkerGrpc {
    /// Makes every sequence's pull (at once), each `None` without one.
    async fn pull_all(
        &self,
        step: u64,
        owner: &str,
        pulls: &[Option<PeerPullInput>],
        targets: &[Option<Vec<crate::peer::PullTarget>>],
    ) -> Vec<Option<Result<Pulled, String>>> {
        let mut tasks = Vec::with_capacity(pulls.len());
        for (pull, target) in pulls.iter().zip(targets) {
            let (Some(pull), Some(target)) = (pull, target) else {
                tasks.push(None);
                continue;
            };
            let (peers, pull, target) = (Arc::clone(&self.peers), pull.clone(), target.clone());
            let identity = (
                self.fingerprint().to_owned(),
                self.describe.kv_dtype.clone(),
                owner.to_owned(),
            );
            tasks.push(Some(tokio::spawn(async move {
                match tokio::time::timeout(
                    PULL_DEADLINE,
                    pull_one(&peers, identity, &pull, &target),
                )
                .await
                {
                    Ok(result) => result,
                    Err(_) => Err(format!(
                        "the pull from {} took longer than {} s",
                        pull.address,
                        PULL_DEADLINE.as_secs()
                    )),
                }
            })));
        }
        let mut out = Vec::with_capacity(tasks.len());
        for task in tasks {
            out.push(match task {
                None => None,
                Some(t) => Some(
                    t.await
                        .unwrap_or_else(|e| Err(format!("pull task failed: {e}"))),
                ),
            });
        }
        tracing::debug!(
            step,
            pulls = out.iter().flatten().count(),
            "peer pulls done"
        );
        out
    }
}

/// Streams one pull runs over at once, each on a connection of its own
/// (one HTTP/2 connection is driven by one task, so one connection moves
/// the blocks one copy at a time), for pulls of at least
/// `PULL_STREAM_MIN_BLOCKS` blocks a stream.
const PULL_STREAMS: usize = 4;
const PULL_STREAM_MIN_BLOCKS: usize = 16;

/// Pulls one sequence's blocks from its source worker and checks what came
/// back; the error says what went wrong, for the sequence's result. A long
/// pull runs as up to [`PULL_STREAMS`] streams of consecutive blocks.
async fn pull_one(
    peers: &Peers,
    identity: (String, String, String),
    pull: &PeerPullInput,
    target: &[crate::peer::PullTarget],
) -> Result<Pulled, String> {
    let started = Instant::now();
    let n = pull.blocks.len();
    let streams = (n / PULL_STREAM_MIN_BLOCKS).clamp(1, PULL_STREAMS);
    let per = n.div_ceil(streams).max(1);
    let parts: Vec<(usize, PeerPullInput, &[crate::peer::PullTarget])> = (0..streams)
        .map(|k| {
            let range = (k * per).min(n)..((k + 1) * per).min(n);
            let part = PeerPullInput {
                address: pull.address.clone(),
                transfer_id: pull.transfer_id,
                blocks: pull.blocks[range.clone()].to_vec(),
            };
            (k, part, target.get(range).unwrap_or_default())
        })
        .collect();
    let pulled = futures::future::join_all(
        parts
            .iter()
            .map(|(k, part, t)| pull_part(peers, *k, part, t, identity.clone())),
    )
    .await;
    let (mut blocks, mut bytes) = (Vec::with_capacity(n), 0);
    for part in pulled {
        let (b, moved) = part?;
        blocks.extend(b);
        bytes += moved;
    }
    Ok(Pulled {
        blocks,
        bytes,
        micros: started.elapsed().as_micros() as u64,
    })
}

/// Stream `k` of a pull: over the `k`th connection kept to the source
/// (made on first use, dropped when a pull over it fails, so the next one
/// connects anew).
async fn pull_part(
    peers: &Peers,
    k: usize,
    pull: &PeerPullInput,
    target: &[crate::peer::PullTarget],
    identity: (String, String, String),
) -> Result<(Vec<crate::worker::PulledBlock>, u64), String> {
    let source = &pull.address;
    let key = (source.clone(), k);
    let cached = peers
        .channels
        .lock()
        .ok()
        .and_then(|c| c.get(&key).cloned());
    let channel = match cached {
        Some(channel) => channel,
        None => {
            let endpoint = peers
                .security
                .endpoint(source, Some(kvlease_auth::ServiceKind::Worker))
                .map_err(|e| format!("source worker {source}: {e}"))?
                .connect_timeout(Duration::from_secs(2))
                .tcp_nodelay(true)
                .initial_stream_window_size(PULL_STREAM_WINDOW)
                .initial_connection_window_size(PULL_CONNECTION_WINDOW);
            let channel = endpoint
                .connect()
                .await
                .map_err(|e| format!("cannot reach the source worker {source}: {e}"))?;
            if let Ok(mut c) = peers.channels.lock() {
                c.insert(key.clone(), channel.clone());
            }
            channel
        }
    };
    let pulled = pull_over(peers, channel, pull, target, identity).await;
    if pulled.is_err() {
        // the connection may be what failed: the next pull connects anew
        if let Ok(mut c) = peers.channels.lock() {
            c.remove(&key);
        }
    }
    pulled
}

/// One pull over `channel`: the stream of `pull`'s blocks, put back
/// together and checked against `target`.
async fn pull_over(
    peers: &Peers,
    channel: tonic::transport::Channel,
    pull: &PeerPullInput,
    target: &[crate::peer::PullTarget],
    (fingerprint, kv_dtype, owner): (String, String, String),
) -> Result<(Vec<crate::worker::PulledBlock>, u64), String> {
    let source = &pull.address;
    let mut client = pb::worker_service_client::WorkerServiceClient::new(channel)
        .max_decoding_message_size(crate::peer::PULL_CHUNK_BYTES + (64 << 10));
    let request = pb::PullBlocksRequest {
        transfer_id: pull.transfer_id,
        tokenizer_fingerprint: fingerprint,
        kv_dtype,
        blocks: pull
            .blocks
            .iter()
            .map(|b| pb::PeerBlock {
                window: b.window,
                block: b.src_block,
                tokens: b.tokens,
            })
            .collect(),
    };
    let failed = |s: Status| {
        format!(
            "source worker {source} answered {:?}: {}",
            s.code(),
            s.message()
        )
    };
    // the principal this pull is for: the owner of the Forward that asked
    let mut request = Request::new(request);
    if let Ok(v) = owner.parse() {
        request
            .metadata_mut()
            .insert(crate::peer::PULL_FOR_METADATA, v);
    }
    let mut stream = client
        .pull_blocks(request)
        .await
        .map_err(failed)?
        .into_inner();
    let expect: Vec<u64> = target
        .iter()
        .map(|&(pool, _, _)| peers.block_bytes.get(pool).copied().unwrap_or(0))
        .collect();
    let mut assembler = Assembler::new(expect);
    while let Some(chunk) = stream.message().await.map_err(failed)? {
        assembler
            .push(chunk.index, chunk.offset, chunk.block_bytes, &chunk.data)
            .map_err(|e| format!("source worker {source}: {e}"))?;
    }
    let blocks = assembler
        .finish()
        .map_err(|e| format!("source worker {source}: {e}"))?;
    let bytes = blocks.iter().map(|b| b.len() as u64).sum();
    let blocks = target
        .iter()
        .zip(blocks)
        .map(|(&(pool, block, slots), data)| (pool, block, slots, data))
        .collect();
    Ok((blocks, bytes))
}

/// The response's results in request order: each sequence's output, or its
/// failed pull's error; what its pull moved.
fn merge_results(
    order: &[u64],
    outputs: Vec<crate::worker::SeqOutput>,
    failed: Vec<(u64, String)>,
    moved: &[(u64, u64, u64)],
) -> Vec<pb::ForwardResult> {
    let mut outputs = outputs.into_iter().map(forward_result);
    order
        .iter()
        .filter_map(|&seq_id| {
            let mut result = match failed.iter().find(|(id, _)| *id == seq_id) {
                Some((_, error)) => pb::ForwardResult {
                    seq_id,
                    error: error.clone(),
                    ..Default::default()
                },
                None => outputs.next()?,
            };
            if let Some(&(_, bytes, us)) = moved.iter().find(|m| m.0 == seq_id) {
                result.pulled_bytes = bytes;
                result.pull_us = us;
            }
            Some(result)
        })
        .collect()
}

/// A `prefill` span per traced sequence of a Forward (those whose
/// `ForwardSequence.trace` is set: prefill chunks, never decode items), in
/// its request's trace and linked to `pass` (the pass's `compute` span): the chunk's tokens and start, the prompt tokens the sequence
/// reused (and how many of its blocks were onboarded from the host tier),
/// its partial-block copy and its replica.
fn prefill_spans(
    step: u64,
    sequences: &[pb::ForwardSequence],
    pass: kvlease_telemetry::opentelemetry::trace::SpanContext,
) -> Vec<tracing::Span> {
    use kvlease_telemetry::OpenTelemetrySpanExt as _;
    use kvlease_telemetry::attributes::{self, set_u64};
    let mut spans = Vec::new();
    for seq in sequences {
        let Some(trace) = &seq.trace else {
            continue;
        };
        let cx = kvlease_telemetry::context_from_traceparent(&trace.traceparent);
        if !kvlease_telemetry::opentelemetry::trace::TraceContextExt::has_active_span(&cx) {
            continue;
        }
        let span = kvlease_telemetry::sequence_span(&cx, PREFILL_SPAN, pass.clone());
        set_u64(&span, attributes::SEQ_ID, seq.seq_id);
        set_u64(&span, attributes::STEP, step);
        set_u64(&span, attributes::TOKENS, seq.tokens.len() as u64);
        set_u64(&span, attributes::START_POS, u64::from(seq.start_pos));
        set_u64(
            &span,
            attributes::REUSED_TOKENS,
            u64::from(trace.reused_tokens),
        );
        set_u64(
            &span,
            attributes::ONBOARDED_BLOCKS,
            u64::from(trace.onboarded_blocks),
        );
        let tier = if trace.onboarded_blocks > 0 {
            attributes::TIER_HOST
        } else {
            attributes::TIER_DEVICE
        };
        span.set_attribute(attributes::TIER, tier);
        let copied: u32 = seq.copies.iter().map(|c| c.tokens).sum();
        set_u64(&span, attributes::COPIED_TOKENS, u64::from(copied));
        span.set_attribute(attributes::REPLICA, trace.replica.clone());
        spans.push(span);
    }
    spans
}

/// Name of the span of one prefill chunk in its request's trace.
const PREFILL_SPAN: &str = "prefill";

#[cfg(test)]
mod tests {
    use super::*;
    use crate::batch::Limits;
    use crate::model::ModelConfig;
    use crate::model::weights::Weights;
    use crate::peer::Assembler;
    use crate::worker::WorkerOptions;
    use kvlease_telemetry::metrics::Registry;
    use pb::worker_service_server::WorkerService as _;

    #[test]
    fn only_the_owner_may_forward_named_or_first_come() {
        let named = Owner::named("scheduler");
        assert!(named.check("scheduler").is_ok());
        let err = named.check("mallory").unwrap_err();
        assert_eq!(err.code(), tonic::Code::PermissionDenied);
        assert_eq!(
            err.message(),
            "this worker serves only its owner scheduler; principal mallory may not Forward"
        );
        let learned = Owner::default();
        assert!(learned.check("first").is_ok());
        assert!(learned.check("first").is_ok());
        assert!(learned.check("second").is_err());
    }

    /// A CPU worker of a tiny seeded model (two pools: full and window 8).
    fn service(registry: &mut Registry) -> WorkerGrpc {
        let config = ModelConfig {
            hidden_size: 32,
            num_heads: 2,
            num_kv_heads: 1,
            head_dim: 8,
            ffn_size: 48,
            layer_windows: vec![0, 8],
            ..ModelConfig::small()
        };
        let weights = Weights::seeded(config, 3).unwrap_or_else(|e| panic!("{e}"));
        let options = WorkerOptions {
            host_blocks: 0,
            memory_budget_bytes: 8 << 20,
            limits: Limits {
                max_batch_sequences: 4,
                max_batch_tokens: 64,
            },
            threads: 1,
        };
        let worker = Worker::new_cpu(weights, options).unwrap_or_else(|e| panic!("{e}"));
        let metrics = WorkerMetrics::register(registry).unwrap_or_else(|e| panic!("{e}"));
        metrics.set_pools(worker.info());
        WorkerGrpc::new(worker, metrics)
    }

    fn table(window: u32) -> pb::BlockTable {
        pb::BlockTable {
            window,
            block_ids: vec![1],
            ..Default::default()
        }
    }

    /// Step `step` of sequence 1: `tokens` from `start_pos`, fed from the
    /// pass of `after_step` when `tokens` is empty.
    fn pass(
        step: u64,
        after_step: u64,
        tokens: Vec<u32>,
        start_pos: u32,
    ) -> Request<pb::ForwardRequest> {
        Request::new(pb::ForwardRequest {
            step,
            after_step,
            sequences: vec![pb::ForwardSequence {
                seq_id: 1,
                feed_previous: tokens.is_empty(),
                tokens,
                start_pos,
                tables: vec![table(0), table(8)],
                ..Default::default()
            }],
            tier_copies: Vec::new(),
        })
    }

    async fn next_token(
        svc: &WorkerGrpc,
        request: Request<pb::ForwardRequest>,
    ) -> Result<u32, Status> {
        let r = svc.forward(request).await?.into_inner();
        Ok(r.results[0].next_token)
    }

    #[tokio::test]
    async fn a_pipelined_pass_sent_first_waits_for_the_pass_it_follows_and_runs_its_token() {
        // the reference: one pass after the other, the token sent back
        let plain = service(&mut Registry::new());
        let first = next_token(&plain, pass(1, 0, vec![1, 2, 3], 0))
            .await
            .unwrap();
        let second = next_token(&plain, pass(2, 0, vec![first], 3))
            .await
            .unwrap();
        let third = next_token(&plain, pass(3, 0, vec![second], 4))
            .await
            .unwrap();

        // pipelined: pass 2 (and 3) reach the worker before the pass they follow
        let piped = service(&mut Registry::new());
        let (a, b, c) = (piped.clone(), piped.clone(), piped.clone());
        let p3 = tokio::spawn(async move { next_token(&c, pass(3, 2, vec![], 4)).await });
        let p2 = tokio::spawn(async move { next_token(&b, pass(2, 1, vec![], 3)).await });
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(
            !p2.is_finished() && !p3.is_finished(),
            "they wait for pass 1"
        );
        assert_eq!(
            next_token(&a, pass(1, 0, vec![1, 2, 3], 0)).await.unwrap(),
            first
        );
        assert_eq!(p2.await.unwrap().unwrap(), second);
        assert_eq!(p3.await.unwrap().unwrap(), third);
    }

    #[tokio::test]
    async fn a_pass_that_follows_a_failed_pass_fails_before_writing_anything() {
        let svc = service(&mut Registry::new());
        next_token(&svc, pass(1, 0, vec![1, 2, 3], 0))
            .await
            .unwrap();
        let mut bad = pass(2, 1, vec![4], 3);
        bad.get_mut().sequences[0].tables[1].window = 9;
        let e = svc.forward(bad).await.unwrap_err();
        assert_eq!(e.code(), tonic::Code::InvalidArgument);
        let e = next_token(&svc, pass(3, 2, vec![], 3)).await.unwrap_err();
        assert_eq!(e.code(), tonic::Code::FailedPrecondition);
        assert_eq!(e.message(), "the pass of step 2 this pass follows failed");
        // a fed item with tokens of its own is malformed
        let mut both = pass(4, 1, vec![5], 3);
        both.get_mut().sequences[0].feed_previous = true;
        let e = svc.forward(both).await.unwrap_err();
        assert_eq!(e.code(), tonic::Code::InvalidArgument);
        assert!(
            e.message()
                .contains("feed_previous is set but tokens holds 1"),
            "{e:?}"
        );
        // none of those passes wrote position 3
        let e = next_token(&svc, pass(5, 0, vec![6], 4)).await.unwrap_err();
        assert!(e.message().contains("position 3"), "{e:?}");
        assert!(e.message().contains("never written"), "{e:?}");
    }

    /// A sequence of `tokens` at `start_pos` over blocks `blocks` of both
    /// pools.
    fn seq_over(
        seq_id: u64,
        tokens: Vec<u32>,
        start_pos: u32,
        blocks: &[u32],
    ) -> pb::ForwardSequence {
        let t = |window| pb::BlockTable {
            window,
            block_ids: blocks.to_vec(),
            ..Default::default()
        };
        pb::ForwardSequence {
            seq_id,
            tokens,
            start_pos,
            tables: vec![t(0), t(8)],
            ..Default::default()
        }
    }

    fn forward_of(step: u64, sequences: Vec<pb::ForwardSequence>) -> Request<pb::ForwardRequest> {
        Request::new(pb::ForwardRequest {
            step,
            sequences,
            tier_copies: Vec::new(),
            after_step: 0,
        })
    }

    /// Serves `svc` on 127.0.0.1:0; returns its address and the stop.
    async fn serve(svc: WorkerGrpc) -> (String, tokio::sync::oneshot::Sender<()>) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = format!("http://{}", listener.local_addr().unwrap());
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        tokio::spawn(async move {
            tonic::transport::Server::builder()
                .add_service(pb::worker_service_server::WorkerServiceServer::new(svc))
                .serve_with_incoming_shutdown(
                    tokio_stream::wrappers::TcpListenerStream::new(listener),
                    async {
                        let _ = stopped.await;
                    },
                )
                .await
                .unwrap();
        });
        (addr, stop)
    }

    fn pull_req(blocks: &[(u32, u32)]) -> pb::PullBlocksRequest {
        pb::PullBlocksRequest {
            transfer_id: 1,
            tokenizer_fingerprint: Tokenizer::byte_level().fingerprint().to_string(),
            kv_dtype: "f32".into(),
            blocks: blocks
                .iter()
                .map(|&(window, block)| pb::PeerBlock {
                    window,
                    block,
                    tokens: 0,
                })
                .collect(),
        }
    }

    async fn pulled_chunks(
        svc: &WorkerGrpc,
        request: Request<pb::PullBlocksRequest>,
    ) -> Result<Vec<pb::BlockChunk>, Status> {
        let mut stream = svc.pull_blocks(request).await?.into_inner();
        let mut chunks = Vec::new();
        while let Some(c) = tokio_stream::StreamExt::next(&mut stream).await {
            chunks.push(c?);
        }
        Ok(chunks)
    }

    #[tokio::test]
    async fn pull_blocks_streams_whole_written_blocks_in_chunks_and_refuses_the_rest() {
        let svc = service(&mut Registry::new())
            .with_peer_transport(kvlease_auth::Security::loopback(), 100);
        // block 1 of both pools holds positions 0..16, block 0 nothing
        let tokens: Vec<u32> = (1..17).collect();
        svc.forward(forward_of(1, vec![seq_over(1, tokens, 0, &[1])]))
            .await
            .unwrap();
        let chunks = pulled_chunks(&svc, Request::new(pull_req(&[(0, 1), (8, 1)])))
            .await
            .unwrap();
        // 1 layer, K and V, 1 head of 8, 16 slots, f32: 1024 bytes a block,
        // in chunks of at most 100
        assert_eq!(chunks.len(), 2 * 11);
        assert!(
            chunks
                .iter()
                .all(|c| c.data.len() <= 100 && c.block_bytes == 1024)
        );
        let mut assembler = Assembler::new(vec![1024, 1024]);
        for c in &chunks {
            assembler
                .push(c.index, c.offset, c.block_bytes, &c.data)
                .unwrap();
        }
        assert_eq!(assembler.finish().unwrap().len(), 2);
        // what it cannot serve
        let code = |r: Result<Vec<pb::BlockChunk>, Status>| {
            let e = r.unwrap_err();
            (e.code(), e.message().to_string())
        };
        let (c, m) = code(pulled_chunks(&svc, Request::new(pull_req(&[(0, 1), (0, 0)]))).await);
        assert_eq!(c, tonic::Code::FailedPrecondition);
        assert_eq!(
            m,
            "peer pull: block 0 of the pool of window 0 does not hold K/V in every slot"
        );
        // a hand-off's last block: its written slots only, and no more
        // slots than a block has
        let mut leading = pull_req(&[(0, 0)]);
        leading.blocks[0].tokens = 3;
        let (c, m) = code(pulled_chunks(&svc, Request::new(leading.clone())).await);
        assert_eq!(c, tonic::Code::FailedPrecondition);
        assert!(m.contains("in its first 3 slots"), "{m}");
        leading.blocks[0].tokens = 17;
        let (c, m) = code(pulled_chunks(&svc, Request::new(leading)).await);
        assert_eq!(
            (c, m.as_str()),
            (
                tonic::Code::InvalidArgument,
                "blocks[0]: tokens 17 is more than a block's 16 slots"
            )
        );
        let (c, m) = code(pulled_chunks(&svc, Request::new(pull_req(&[]))).await);
        assert_eq!(
            (c, m.as_str()),
            (
                tonic::Code::InvalidArgument,
                "blocks must name 1 to 4096 blocks, got 0"
            )
        );
        let (c, m) =
            code(pulled_chunks(&svc, Request::new(pull_req(&[(0, 1), (8, 1 << 30)]))).await);
        assert_eq!(c, tonic::Code::InvalidArgument);
        assert!(
            m.starts_with("blocks[1]: block 1073741824 is out of range"),
            "{m}"
        );
        let mut other = pull_req(&[(0, 1)]);
        other.tokenizer_fingerprint = "0123456789abcdef".into();
        let (c, m) = code(pulled_chunks(&svc, Request::new(other)).await);
        assert_eq!(c, tonic::Code::FailedPrecondition);
        assert!(m.contains("fingerprint"), "{m}");
        // only the owner may pull
        let owned = service(&mut Registry::new()).with_owner("scheduler");
        let (c, m) = code(pulled_chunks(&owned, Request::new(pull_req(&[(0, 1)]))).await);
        assert_eq!(c, tonic::Code::PermissionDenied);
        assert_eq!(
            m,
            "this worker serves only its owner scheduler; principal anonymous may not PullBlocks"
        );
    }

    #[tokio::test]
    async fn a_pulled_prefix_continues_as_the_source_does_and_a_failed_pull_fails_only_its_sequence()
     {
        let source = service(&mut Registry::new())
            .with_peer_transport(kvlease_auth::Security::loopback(), 300);
        let tokens: Vec<u32> = (1..17).collect();
        let first = next_token(&source, forward_of(1, vec![seq_over(1, tokens, 0, &[1])]))
            .await
            .unwrap();
        let (addr, stop) = serve(source.clone()).await;
        let mut registry = Registry::new();
        let dest = service(&mut registry);
        let pulling = |seq_id, address: &str, blocks: [u32; 2]| pb::ForwardSequence {
            peer_pull: Some(pb::PeerPull {
                address: address.into(),
                transfer_id: 3,
                blocks: [0, 8]
                    .into_iter()
                    .map(|window| pb::PeerBlockCopy {
                        window,
                        src_block: 1,
                        dst_block: blocks[0],
                        tokens: 0,
                    })
                    .collect(),
            }),
            ..seq_over(seq_id, vec![first], 16, &blocks)
        };
        // the destination computes only the token after the pulled block;
        // a sequence of the same batch whose source is gone sits out
        let other = seq_over(9, vec![5, 6, 7], 0, &[4]);
        let r = dest
            .forward(forward_of(
                1,
                vec![
                    pulling(1, &addr, [2, 3]),
                    pulling(2, "http://127.0.0.1:9", [5, 6]),
                    other,
                ],
            ))
            .await
            .unwrap()
            .into_inner();
        let ids: Vec<u64> = r.results.iter().map(|x| x.seq_id).collect();
        assert_eq!(ids, vec![1, 2, 9]);
        assert!(r.results[0].error.is_empty() && r.results[2].error.is_empty());
        assert_eq!(r.results[0].pulled_bytes, 2048);
        assert!(
            r.results[1]
                .error
                .contains("cannot reach the source worker http://127.0.0.1:9"),
            "{:?}",
            r.results[1]
        );
        let text = registry.render();
        for line in [
            "kvlease_worker_peer_pulled_bytes_total 2048",
            "kvlease_worker_peer_pull_failures_total 1",
        ] {
            assert!(text.contains(line), "{line:?} not in\n{text}");
        }
        // the source, computing on: the same token
        let second = next_token(
            &source,
            forward_of(2, vec![seq_over(1, vec![first], 16, &[1, 3])]),
        )
        .await
        .unwrap();
        assert_eq!(r.results[0].next_token, second);
        // the failed sequence wrote nothing: its block is still unwritten
        let e = dest
            .forward(forward_of(2, vec![seq_over(2, vec![first], 16, &[5, 6])]))
            .await
            .unwrap_err();
        assert!(e.message().contains("never written"), "{e:?}");
        // a pull whose blocks are not the sequence's own is malformed
        let mut bad = pulling(4, &addr, [7, 8]);
        if let Some(p) = bad.peer_pull.as_mut() {
            p.blocks[0].dst_block = 3;
        }
        let e = dest.forward(forward_of(3, vec![bad])).await.unwrap_err();
        assert_eq!(e.code(), tonic::Code::InvalidArgument);
        assert!(
            e.message()
                .contains("sequence 4: peer_pull.blocks[0]: dst_block 3"),
            "{e:?}"
        );
        let mut bad = pulling(5, &addr, [7, 8]);
        if let Some(p) = bad.peer_pull.as_mut() {
            p.blocks[1].tokens = 17;
        }
        let e = dest.forward(forward_of(3, vec![bad])).await.unwrap_err();
        assert_eq!(e.code(), tonic::Code::InvalidArgument);
        assert!(
            e.message().contains(
                "sequence 5: peer_pull.blocks[1]: tokens 17 is more than a block's 16 slots"
            ),
            "{e:?}"
        );
        let _ = stop.send(());
    }

    #[tokio::test]
    async fn a_long_pull_runs_as_several_streams_and_continues_as_the_source_does() {
        let mut served = Registry::new();
        let source =
            service(&mut served).with_peer_transport(kvlease_auth::Security::loopback(), 300);
        // 20 written blocks of each pool: 320 tokens, 64 a pass
        let src_blocks: Vec<u32> = (1..=21).collect();
        let mut first = 0;
        for (step, start) in (0..320u32).step_by(64).enumerate() {
            let tokens: Vec<u32> = (start..start + 64).map(|t| t % 200 + 1).collect();
            first = next_token(
                &source,
                forward_of(
                    step as u64 + 1,
                    vec![seq_over(1, tokens, start, &src_blocks)],
                ),
            )
            .await
            .unwrap();
        }
        let (addr, stop) = serve(source.clone()).await;
        let mut pulled = Registry::new();
        let dest = service(&mut pulled);
        let dst_blocks: Vec<u32> = (31..=51).collect();
        let blocks: Vec<pb::PeerBlockCopy> = [0u32, 8]
            .into_iter()
            .flat_map(|window| {
                (0..20u32).map(move |i| pb::PeerBlockCopy {
                    window,
                    src_block: i + 1,
                    dst_block: i + 31,
                    tokens: 0,
                })
            })
            .collect();
        let pulling = pb::ForwardSequence {
            peer_pull: Some(pb::PeerPull {
                address: addr.clone(),
                transfer_id: 7,
                blocks,
            }),
            ..seq_over(1, vec![first], 320, &dst_blocks)
        };
        let r = dest
            .forward(forward_of(1, vec![pulling]))
            .await
            .unwrap()
            .into_inner();
        assert!(r.results[0].error.is_empty(), "{:?}", r.results[0]);
        // 40 blocks of 1,024 bytes, over two streams of their own connections
        assert_eq!(r.results[0].pulled_bytes, 40 * 1024);
        assert_eq!(dest.peers.channels.lock().unwrap().len(), 2);
        // both ends count the bytes
        let line = "kvlease_worker_peer_pulled_bytes_total 40960";
        assert!(pulled.render().contains(line), "{}", pulled.render());
        let line = "kvlease_worker_peer_served_bytes_total 40960";
        assert!(served.render().contains(line), "{}", served.render());
        let second = next_token(
            &source,
            forward_of(6, vec![seq_over(1, vec![first], 320, &src_blocks)]),
        )
        .await
        .unwrap();
        assert_eq!(r.results[0].next_token, second);
        let _ = stop.send(());
    }

    #[tokio::test]
    async fn forward_calls_are_counted_and_timed() {
        let mut registry = Registry::new();
        let svc = service(&mut registry);
        let table = |window| pb::BlockTable {
            window,
            block_ids: vec![1],
            ..Default::default()
        };
        let seq = |seq_id, block_window| pb::ForwardSequence {
            seq_id,
            tokens: vec![1, 2, 3],
            tables: vec![table(0), table(block_window)],
            ..Default::default()
        };
        // sequence `step` alone at step `step`, its second table naming window `block_window`
        let forward = |step: u64, block_window| {
            Request::new(pb::ForwardRequest {
                tier_copies: Vec::new(),
                step,
                sequences: vec![seq(step, block_window)],
                after_step: 0,
            })
        };
        let ok = svc.forward(forward(1, 8)).await;
        assert!(ok.is_ok(), "{ok:?}");
        let bad = svc.forward(forward(2, 9)).await;
        assert_eq!(
            bad.err().map(|s| s.code()),
            Some(tonic::Code::InvalidArgument)
        );
        let text = registry.render();
        for line in [
            "kvlease_forward_compute_duration_seconds_count 1",
            "kvlease_worker_forward_tokens_total 3",
            "kvlease_worker_forward_rejected_total 1",
            "kvlease_worker_pool_capacity_blocks{window=\"8\"}",
        ] {
            assert!(text.contains(line), "{line:?} not in\n{text}");
        }
    }
}
