//! kvlease worker: model, KV arena and forward pass over leased blocks.
//!
//! The worker owns the physical KV memory of one model replica and runs
//! forward passes of a Llama-style decoder (RMSNorm, RoPE, grouped-query
//! attention, SwiGLU, per-layer sliding windows) over the blocks that the
//! scheduler's leases name. Default backend: CPU; with the `cuda` feature,
//! `--backend cuda|auto` runs on an NVIDIA GPU.
//!
//! # Layout
//!
//! - [`config`]: flags (`KVLEASE_WORKER_*` fallbacks) → model shape, weights, options.
//! - [`model`]: [`ModelConfig`](model::ModelConfig), [`Weights`](model::weights::Weights)
//!   (seeded or safetensors), the byte-level [`tokenizer`](model::tokenizer), and
//!   [`model::load`]: a real model from a GGUF file or a Hugging Face directory.
//! - [`arena`]: pool geometry (where each K/V row lives) and the ledger of written slots.
//! - [`batch`]: a Forward batch in domain terms; [`batch::validate`] checks all of it
//!   before anything is written.
//! - [`backend`]: the compute trait; [`backend::cpu`] owns the host arena and runs
//!   batched projections (`gemm`) and paged attention (rayon over sequences × KV heads);
//!   `backend::cuda` (feature `cuda`) keeps weights and a 16-bit arena on the GPU,
//!   with NVRTC kernels and cuBLAS products.
//! - [`worker`]: sizes the arena from the memory budget, then validate → backend → sample.
//! - [`sampling`]: greedy, or seeded temperature/top-p keyed by (seed, position).
//! - [`reference`](mod@reference): a dense, contiguous-KV reference of the same model for tests.
//! - [`service`]: the gRPC edge (`kvlease.v1.WorkerService`) and the worker's
//!   Prometheus series; the only place that touches protobuf types.
//!
//! Data flow of one Forward: `service` converts the request to
//! [`SeqInput`](batch::SeqInput)s → `Worker::forward` validates them against the
//! model, the arena layout and the slot ledger → the backend writes every new
//! K/V row, attends and returns logits → `sampling` picks the next tokens.

pub mod arena;
pub mod backend;
pub mod batch;
pub mod config;
pub mod error;
pub mod model;
pub mod ops;
pub mod reference;
pub mod sampling;
pub mod service;
pub mod worker;

use std::future::Future;

use kvlease_proto::v1::worker_service_server::WorkerServiceServer;

pub use config::Config;
pub use error::{Error, Result};

/// Builds the worker from `config` and serves `kvlease.v1.WorkerService`
/// (plus gRPC health and reflection) on `listener` until `shutdown` resolves.
/// `config.listen` is not used: the caller binds the listener.
pub async fn run(
    listener: tokio::net::TcpListener,
    config: Config,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), Error> {
    // A real model (`--model`) brings its own tokenizer; the seeded model
    // serves the byte-level one.
    let (weights, tokenizer) = match &config.model {
        Some(path) => {
            let model = config.load_model(path)?;
            (model.weights, Some(model.tokenizer))
        }
        None => (config.load_weights()?, None),
    };
    let worker = worker::Worker::new(
        weights,
        config.worker_options(),
        config.backend,
        config.cuda_options(),
    )?;
    let registry = kvlease_telemetry::metrics::Registry::new();
    let metrics = service::WorkerMetrics::register(&registry, worker.info())?;
    let mut service = service::WorkerGrpc::new(worker, metrics);
    if let Some(tokenizer) = tokenizer {
        service = service.with_tokenizer(tokenizer)?;
    }

    // One shutdown signal for the gRPC server and the metrics endpoint.
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let stopped = |mut rx: tokio::sync::watch::Receiver<bool>| async move {
        // An error means the sender is gone, which also means stop.
        let _ = rx.wait_for(|stop| *stop).await;
    };
    let metrics_task = match config.metrics_listen {
        Some(addr) => {
            let metrics_listener = tokio::net::TcpListener::bind(addr)
                .await
                .map_err(|e| Error::Config(format!("cannot listen for metrics on {addr}: {e}")))?;
            tracing::info!(%addr, "worker metrics serving");
            Some(tokio::spawn(kvlease_telemetry::metrics::serve_metrics(
                metrics_listener,
                move || registry.render(),
                stopped(stop_rx.clone()),
            )))
        }
        None => None,
    };
    let shutdown = async move {
        shutdown.await;
        let _ = stop_tx.send(true);
    };

    let (health_reporter, health_service) = tonic_health::server::health_reporter();
    health_reporter
        .set_serving::<WorkerServiceServer<service::WorkerGrpc>>()
        .await;
    let reflection = || {
        tonic_reflection::server::Builder::configure()
            .register_encoded_file_descriptor_set(kvlease_proto::FILE_DESCRIPTOR_SET)
            .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
    };
    let reflection_v1 = reflection()
        .build_v1()
        .map_err(|e| Error::Config(format!("cannot build gRPC reflection: {e}")))?;
    let reflection_v1alpha = reflection()
        .build_v1alpha()
        .map_err(|e| Error::Config(format!("cannot build gRPC reflection: {e}")))?;

    let addr = listener.local_addr().ok();
    tracing::info!(?addr, "worker serving");
    let served = tonic::transport::Server::builder()
        .layer(kvlease_telemetry::GrpcTraceLayer::new("kvlease-worker"))
        .add_service(health_service)
        .add_service(reflection_v1)
        .add_service(reflection_v1alpha)
        .add_service(
            WorkerServiceServer::new(service)
                .max_encoding_message_size(kvlease_tokenizer::MAX_MESSAGE_BYTES),
        )
        .serve_with_incoming_shutdown(kvlease_telemetry::incoming(listener), shutdown)
        .await;
    drop(stop_rx);
    if let Some(task) = metrics_task
        && let Err(e) = task.await
    {
        tracing::error!(error = %e, "metrics task failed");
    }
    served?;
    tracing::info!("worker stopped");
    Ok(())
}
