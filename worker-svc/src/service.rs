//! The gRPC edge: `kvlease.v1.WorkerService` over a [`Worker`]. The only
//! module that converts between protobuf messages and domain types.

use std::sync::{Arc, Mutex};
use std::time::Instant;

use kvlease_proto::v1 as pb;
use kvlease_telemetry::metrics::{self, Counter, Histogram, Registry, names};
use kvlease_tokenizer::Tokenizer;
use tonic::{Request, Response, Status};
use tracing::Instrument;

use crate::batch::{Sampling, SeqInput, TableInput};
use crate::worker::{SeqOutput, Worker, WorkerInfo};

/// The gRPC service. Forward passes run one at a time on a blocking thread
/// (the worker owns one arena); Describe answers from a snapshot.
#[derive(Debug, Clone)]
pub struct WorkerGrpc {
    worker: Arc<Mutex<Worker>>,
    describe: pb::DescribeResponse,
    metrics: WorkerMetrics,
    tokenizer: Tokenizer,
}

/// The worker's Prometheus series.
#[derive(Debug, Clone)]
pub struct WorkerMetrics {
    forward_seconds: Histogram,
    forward_tokens: Counter,
    forward_rejected: Counter,
}

impl WorkerMetrics {
    /// Registers the worker's series in `registry`, with each pool's size.
    pub fn register(registry: &Registry, info: &WorkerInfo) -> crate::Result<Self> {
        let fail = |e: kvlease_telemetry::Error| crate::Error::Config(format!("metrics: {e}"));
        let pool_blocks = registry
            .gauge_vec(
                names::POOL_BLOCKS_TOTAL,
                "Blocks of each KV pool of the worker.",
                [names::WINDOW],
            )
            .map_err(fail)?;
        for pool in &info.pools {
            pool_blocks
                .with([&pool.window.to_string()])
                .set(f64::from(pool.num_blocks));
        }
        Ok(WorkerMetrics {
            forward_seconds: registry
                .histogram(
                    names::FORWARD_DURATION_SECONDS,
                    "Compute time of one Forward on the worker.",
                    metrics::DEFAULT_LATENCY_BUCKETS,
                )
                .map_err(fail)?,
            forward_tokens: registry
                .counter(
                    "kvlease_worker_forward_tokens_total",
                    "Input tokens run by accepted Forward calls.",
                )
                .map_err(fail)?,
            forward_rejected: registry
                .counter(
                    "kvlease_worker_forward_rejected_total",
                    "Forward calls refused (invalid batch or backend failure).",
                )
                .map_err(fail)?,
        })
    }
}

impl WorkerGrpc {
    /// Serves `worker`, recording into `metrics`.
    /// Serves `worker`, recording into `metrics`, with the seeded model's
    /// byte-level tokenizer.
    pub fn new(worker: Worker, metrics: WorkerMetrics) -> Self {
        let tokenizer = Tokenizer::byte_level();
        let describe = describe_response(worker.info(), &tokenizer);
        WorkerGrpc {
            worker: Arc::new(Mutex::new(worker)),
            describe,
            metrics,
            tokenizer,
        }
    }

    /// Serves the model's own `tokenizer` (from its GGUF or tokenizer.json)
    /// instead; every id it can produce must be inside the model's
    /// vocabulary.
    pub fn with_tokenizer(mut self, tokenizer: Tokenizer) -> crate::Result<Self> {
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
        self.tokenizer = tokenizer;
        Ok(self)
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
                return Err(Status::invalid_argument(format!(
                    "fingerprint {want:?} is not 16 hex digits"
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
        let request = request.into_inner();
        let step = request.step;
        let sequences = request.sequences.len();
        let tokens: usize = request.sequences.iter().map(|s| s.tokens.len()).sum();
        // A child of the server span that `GrpcTraceLayer` opens per request.
        let span = tracing::info_span!(
            "forward",
            kvlease.step = step,
            kvlease.sequences = sequences,
            kvlease.tokens = tokens,
        );
        let inputs: Vec<SeqInput> = request.sequences.into_iter().map(seq_input).collect();
        let worker = Arc::clone(&self.worker);
        let metrics = self.metrics.clone();
        async move {
            let outcome = tokio::task::spawn_blocking(move || {
                let mut worker = worker
                    .lock()
                    .map_err(|_| Status::internal("worker state poisoned by an earlier panic"))?;
                // Timed after the lock: queueing behind another pass is not compute.
                let started = Instant::now();
                // Only the tokens: logits stay where the backend computed them.
                let outputs = worker.forward_tokens(inputs).map_err(Status::from)?;
                Ok::<_, Status>((outputs, started.elapsed().as_micros() as u64))
            })
            .await
            .map_err(|e| Status::internal(format!("forward task failed: {e}")))?;
            match outcome {
                Ok((outputs, compute_us)) => {
                    metrics.forward_seconds.observe(compute_us as f64 / 1e6);
                    metrics.forward_tokens.inc_by(tokens as u64);
                    tracing::info!(step, sequences, tokens, compute_us, "forward done");
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

fn seq_input(seq: pb::ForwardSequence) -> SeqInput {
    let sampling = seq.sampling.map_or(Sampling::GREEDY, |s| Sampling {
        temperature: s.temperature,
        top_p: s.top_p,
        seed: s.seed,
    });
    SeqInput {
        seq_id: seq.seq_id,
        tokens: seq.tokens,
        start_pos: seq.start_pos,
        tables: seq
            .tables
            .into_iter()
            .map(|t| TableInput {
                window: t.window,
                beam: t.beam,
                first_block: t.first_block,
                block_ids: t.block_ids,
            })
            .collect(),
        all_positions: seq.return_all_argmax,
        sampling,
    }
}

fn forward_result(out: SeqOutput) -> pb::ForwardResult {
    pb::ForwardResult {
        seq_id: out.seq_id,
        next_token: out.next_token,
        argmax: out.argmax,
    }
}

fn tokenizer_response(model: String, tokenizer: &Tokenizer) -> pb::GetTokenizerResponse {
    let parts = tokenizer.parts();
    let s = &parts.specials;
    pb::GetTokenizerResponse {
        model,
        fingerprint: tokenizer.fingerprint().to_string(),
        kind: parts.kind.as_str().to_string(),
        tokenizer_json: parts.tokenizer_json.clone(),
        chat_template: parts.chat_template.clone().unwrap_or_default(),
        bos_id: s.bos_id,
        bos_token: s.bos_token.clone().unwrap_or_default(),
        eos_token: s.eos_token.clone().unwrap_or_default(),
        end_ids: s.end_ids.clone(),
        add_bos: s.add_bos,
    }
}

fn describe_response(info: &WorkerInfo, tokenizer: &Tokenizer) -> pb::DescribeResponse {
    let m = &info.model;
    pb::DescribeResponse {
        model: Some(pb::ModelShape {
            name: m.name.clone(),
            vocab_size: m.vocab_size as u32,
            hidden_size: m.hidden_size as u32,
            num_layers: m.num_layers() as u32,
            num_heads: m.num_heads as u32,
            num_kv_heads: m.num_kv_heads as u32,
            head_dim: m.head_dim as u32,
            ffn_size: m.ffn_size as u32,
            rope_theta: m.rope_theta,
            layer_windows: m.layer_windows.clone(),
            max_context: m.max_context,
            tokenizer_fingerprint: tokenizer.fingerprint().to_string(),
        }),
        tokens_per_block: m.tokens_per_block,
        pools: info
            .pools
            .iter()
            .map(|p| pb::WorkerPool {
                window: p.window,
                num_layers: p.num_layers,
                num_blocks: p.num_blocks,
                bytes_per_block: p.bytes_per_block,
            })
            .collect(),
        backend: info.backend.to_string(),
        kv_dtype: info.kv_dtype.to_string(),
        memory_budget_bytes: info.memory_budget_bytes,
        weight_bytes: info.weight_bytes,
        activation_bytes: info.activation_bytes,
        max_batch_sequences: info.limits.max_batch_sequences as u32,
        max_batch_tokens: info.limits.max_batch_tokens as u32,
        device: info.device.clone(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::batch::Limits;
    use crate::model::ModelConfig;
    use crate::model::weights::Weights;
    use crate::worker::WorkerOptions;
    use pb::worker_service_server::WorkerService as _;

    #[tokio::test]
    async fn forward_calls_are_counted_and_timed() {
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
            memory_budget_bytes: 8 << 20,
            limits: Limits {
                max_batch_sequences: 4,
                max_batch_tokens: 64,
            },
            threads: 1,
        };
        let worker = Worker::new_cpu(weights, options).unwrap_or_else(|e| panic!("{e}"));
        let registry = Registry::new();
        let metrics =
            WorkerMetrics::register(&registry, worker.info()).unwrap_or_else(|e| panic!("{e}"));
        let svc = WorkerGrpc::new(worker, metrics);
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
        let ok = svc
            .forward(Request::new(pb::ForwardRequest {
                step: 1,
                sequences: vec![seq(1, 8)],
            }))
            .await;
        assert!(ok.is_ok(), "{ok:?}");
        let bad = svc
            .forward(Request::new(pb::ForwardRequest {
                step: 2,
                sequences: vec![seq(2, 9)],
            }))
            .await;
        assert_eq!(
            bad.err().map(|s| s.code()),
            Some(tonic::Code::InvalidArgument)
        );
        let text = registry.render();
        for line in [
            "kvlease_forward_duration_seconds_count 1",
            "kvlease_worker_forward_tokens_total 3",
            "kvlease_worker_forward_rejected_total 1",
            "kvlease_pool_blocks_total{window=\"8\"}",
        ] {
            assert!(text.contains(line), "{line:?} not in\n{text}");
        }
    }
}
