//! [`run`]: builds the worker and serves `kvlease.v1.WorkerService` with
//! gRPC health and reflection.

use std::future::Future;

use kvlease_proto::v1::worker_service_server::WorkerServiceServer;
use kvlease_runtime::process::RunError;
use kvlease_runtime::serve::{Listeners, ServerInfo, serve};
use kvlease_telemetry::metrics::Registry;

use crate::config::Config;
use crate::error::{Error, Result};
use crate::metrics::WorkerMetrics;
use crate::model::weights::Weights;
use crate::service::WorkerGrpc;
use crate::worker::Worker;
use kvlease_tokenizer::Tokenizer;

/// The service name in traces and logs.
pub const SERVICE: &str = "kvlease-worker";

impl RunError for Error {
    /// The flags, the weights file they name, or a budget too small for them.
    fn is_config(&self) -> bool {
        matches!(
            self,
            Error::Config(_) | Error::Weights { .. } | Error::MemoryBudget { .. }
        )
    }
}

/// Builds the worker from `config` and serves `kvlease.v1.WorkerService`
/// (plus gRPC health and reflection, and the metrics endpoint when there is a
/// listener for it) on `listeners` until `shutdown` resolves.
/// `config.listen` and `config.metrics_listen` are not used: the caller binds
/// the listeners. A real model (`--model`) brings its own tokenizer; the
/// seeded model serves the byte-level one.
pub async fn run(
    listeners: impl Into<Listeners>,
    config: Config,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), Error> {
    let (weights, tokenizer) = match &config.model {
        Some(path) => {
            let model = config.load_model(path)?;
            (model.weights, Some(model.tokenizer))
        }
        None => (config.load_weights()?, None),
    };
    serve_model(listeners.into(), &config, weights, tokenizer, shutdown).await
}

/// [`run`] with `tokenizer` served instead of the model's own: replicas that
/// disagree on their tokenizer, or one whose tokenizer.json is over 4 MiB.
pub async fn run_with_tokenizer(
    listeners: impl Into<Listeners>,
    config: Config,
    tokenizer: Tokenizer,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), Error> {
    let weights = config.load_weights()?;
    serve_model(
        listeners.into(),
        &config,
        weights,
        Some(tokenizer),
        shutdown,
    )
    .await
}

async fn serve_model(
    listeners: Listeners,
    config: &Config,
    weights: Weights,
    tokenizer: Option<Tokenizer>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), Error> {
    let security = config
        .security
        .load()
        .map_err(|e| Error::Config(e.to_string()))?;
    let mut worker = Worker::new(
        weights,
        config.worker_options(),
        config.backend,
        config.cuda_options(),
    )?;
    if let (Some(dir), Some(bytes)) = (&config.disk_tier_dir, config.disk_tier_bytes) {
        // what the K/V depends on beyond the shape: the weights' source
        // and the tokenizer
        let identity = format!(
            "model={:?} weights={:?} seed={} tokenizer={}",
            config.model,
            config.weights,
            config.seed,
            tokenizer
                .as_ref()
                .map_or_else(|| "byte-level".to_owned(), |t| t.fingerprint().to_string())
        );
        worker.open_disk_tier(dir, bytes, &identity)?;
    }
    let mut registry = Registry::new();
    let metrics = WorkerMetrics::register(&mut registry)?;
    metrics.set_pools(worker.info());
    let mut service = WorkerGrpc::new(worker, metrics);
    if let Some(tokenizer) = tokenizer {
        service = service.with_tokenizer(tokenizer)?;
    }
    config.check_owner()?;
    if let Some(owner) = &config.owner {
        service = service.with_owner(owner);
    }
    // a peer pull dials the source worker as this worker serves
    service = service.with_peer_transport(security.clone(), crate::peer::PULL_CHUNK_BYTES);
    serve(
        ServerInfo {
            name: SERVICE,
            descriptors: kvlease_proto::FILE_DESCRIPTOR_SET,
        },
        listeners,
        &security,
        &config.limits,
        // GetTokenizer answers with a whole tokenizer.json, over tonic's
        // default 4 MiB for real vocabularies.
        WorkerServiceServer::new(service)
            .max_encoding_message_size(kvlease_tokenizer::MAX_MESSAGE_BYTES)
            .max_decoding_message_size(config.max_message_bytes),
        move || registry.render(),
        shutdown,
    )
    .await?;
    Ok(())
}
