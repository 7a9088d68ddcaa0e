//! [`run`]: builds the worker and serves `kvlease.v1.WorkerService` with
//! gRPC health and reflection.

use std::future::Future;

use kvlease_proto::v1::worker_service_server::WorkerServiceServer;

use crate::config::Config;
use crate::error::{Error, Result};
use crate::{service, worker};

/// Builds the worker from `config` and serves `kvlease.v1.WorkerService`
/// (plus gRPC health and reflection) on `listener` until `shutdown` resolves.
/// `config.listen` is not used: the caller binds the listener.
pub async fn run(
    listener: tokio::net::TcpListener,
    config: Config,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), Error> {
    let weights = config.load_weights()?;
    let worker = worker::Worker::new(
        weights,
        config.worker_options(),
        config.backend,
        config.cuda_options(),
    )?;
    let registry = kvlease_telemetry::metrics::Registry::new();
    let metrics = crate::metrics::WorkerMetrics::register(&registry, worker.info())?;
    let service = service::WorkerGrpc::new(worker, metrics);

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
        .add_service(WorkerServiceServer::new(service))
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
