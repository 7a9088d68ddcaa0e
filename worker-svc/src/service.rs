//! The gRPC edge: `kvlease.v1.WorkerService` over a [`Worker`]; `convert`
//! turns its messages into domain types and back.

use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

use kvlease_proto::v1 as pb;
use kvlease_tokenizer::Tokenizer;
use tonic::{Request, Response, Status};
use tracing::Instrument;

use crate::batch::SeqInput;
use crate::convert::{
    describe_response, forward_result, seq_input, tier_copy_input, tokenizer_response,
};
use crate::metrics::WorkerMetrics;
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
}

impl WorkerGrpc {
    /// Serves `worker`, recording into `metrics`, with the seeded model's
    /// byte-level tokenizer.
    pub(crate) fn new(mut worker: Worker, metrics: WorkerMetrics) -> Self {
        let tokenizer = Tokenizer::byte_level();
        worker.set_tokenizer(tokenizer.clone());
        let describe = describe_response(worker.info(), &tokenizer);
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
        }
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
        copies: &[crate::batch::TierCopyInput],
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
            "Forward from a principal that does not own this worker; refused"
        );
        Err(Status::permission_denied(format!(
            "this worker serves only its owner {owner}; principal {caller} may not Forward"
        )))
    }
}

#[tonic::async_trait]
impl pb::worker_service_server::WorkerService for WorkerGrpc {
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
        let feed: Vec<bool> = request.sequences.iter().map(|s| s.feed_previous).collect();
        let inputs: Vec<SeqInput> = request.sequences.into_iter().map(seq_input).collect();
        let passes = Arc::clone(&self.passes);
        let metrics = self.metrics.clone();
        async move {
            let outcome = tokio::task::spawn_blocking(move || {
                passes.run(received, step, after_step, &copies, inputs, &feed)
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
                        results: outputs.into_iter().map(forward_result).collect(),
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
