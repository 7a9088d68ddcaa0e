//! The gRPC edge: `kvlease.v1.WorkerService` over a [`Worker`]. The only
//! module that converts between protobuf messages and domain types.

use std::sync::{Arc, Mutex};
use std::time::Instant;

use kvlease_proto::v1 as pb;
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
}

impl WorkerGrpc {
    /// Serves `worker`.
    pub fn new(worker: Worker) -> Self {
        let describe = describe_response(worker.info());
        WorkerGrpc {
            worker: Arc::new(Mutex::new(worker)),
            describe,
        }
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

    async fn forward(
        &self,
        request: Request<pb::ForwardRequest>,
    ) -> Result<Response<pb::ForwardResponse>, Status> {
        let request = request.into_inner();
        let step = request.step;
        let sequences = request.sequences.len();
        let tokens: usize = request.sequences.iter().map(|s| s.tokens.len()).sum();
        let span = tracing::info_span!(
            "kvlease.v1.WorkerService/Forward",
            rpc.system = "grpc",
            rpc.service = "kvlease.v1.WorkerService",
            rpc.method = "Forward",
            kvlease.step = step,
            kvlease.sequences = sequences,
            kvlease.tokens = tokens,
        );
        let inputs: Vec<SeqInput> = request.sequences.into_iter().map(seq_input).collect();
        let worker = Arc::clone(&self.worker);
        async move {
            let outcome = tokio::task::spawn_blocking(move || {
                let mut worker = worker
                    .lock()
                    .map_err(|_| Status::internal("worker state poisoned by an earlier panic"))?;
                // Timed after the lock: queueing behind another pass is not compute.
                let started = Instant::now();
                let outputs = worker.forward(inputs).map_err(Status::from)?;
                Ok::<_, Status>((outputs, started.elapsed().as_micros() as u64))
            })
            .await
            .map_err(|e| Status::internal(format!("forward task failed: {e}")))?;
            match outcome {
                Ok((outputs, compute_us)) => {
                    tracing::info!(step, sequences, tokens, compute_us, "forward done");
                    Ok(Response::new(pb::ForwardResponse {
                        results: outputs.into_iter().map(forward_result).collect(),
                        compute_us,
                    }))
                }
                Err(status) => {
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

fn describe_response(info: &WorkerInfo) -> pb::DescribeResponse {
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
