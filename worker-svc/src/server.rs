//! [`run`]: builds the worker and serves `kvlease.v1.WorkerService` with
//! gRPC health and reflection.

use std::future::Future;

use kvlease_proto::v1::worker_service_server::WorkerServiceServer;
use kvlease_telemetry::metrics::Registry;
use kvlease_telemetry::process::RunError;
use kvlease_telemetry::serve::{Listeners, ServerInfo, serve};

use crate::config::Config;
use crate::error::{Error, Result};
use crate::metrics::WorkerMetrics;
use crate::service::WorkerGrpc;
use crate::worker::Worker;

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
/// the listeners.
pub async fn run(
    listeners: impl Into<Listeners>,
    config: Config,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), Error> {
    let weights = config.load_weights()?;
    let worker = Worker::new(
        weights,
        config.worker_options(),
        config.backend,
        config.cuda_options(),
    )?;
    let registry = Registry::new();
    let metrics = WorkerMetrics::register(&registry, worker.info())?;
    let service = WorkerGrpc::new(worker, metrics);
    serve(
        ServerInfo {
            name: SERVICE,
            descriptors: kvlease_proto::FILE_DESCRIPTOR_SET,
        },
        listeners.into(),
        WorkerServiceServer::new(service),
        move || registry.render(),
        shutdown,
    )
    .await?;
    Ok(())
}
