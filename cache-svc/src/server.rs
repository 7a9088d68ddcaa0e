//! [`run`]: the cache service on its listeners, with gRPC health and
//! reflection, and background session expiry and leak audits.

use std::future::Future;
use std::time::Duration;

use kvlease_proto::v1::cache_service_server::CacheServiceServer;
use tokio::net::TcpListener;
use tokio::sync::watch;

use crate::cache::Cache;
use crate::config::Config;
use crate::error::{Error, Result};
use crate::metrics::CacheMetrics;
use crate::service::{CacheServiceImpl, now};

/// Serves the cache service on `listener` until `shutdown` resolves, with gRPC
/// health and reflection, and background session expiry and leak audits.
pub async fn run(
    listener: TcpListener,
    config: Config,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<()> {
    config.validate().map_err(Error::InvalidArgument)?;
    let cache = Cache::new(config.cache_config());
    let epoch = cache.epoch();
    let (stop_tx, stop_rx) = watch::channel(false);
    let metrics = CacheMetrics::new()?;
    let service = CacheServiceImpl::new(
        cache,
        metrics,
        config.max_batch,
        config.max_message_bytes,
        stop_rx.clone(),
    );
    let addr = listener.local_addr()?;

    let (health_reporter, health) = tonic_health::server::health_reporter();
    health_reporter
        .set_serving::<CacheServiceServer<CacheServiceImpl>>()
        .await;
    let reflection_v1 = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(kvlease_proto::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .build_v1()
        .map_err(|e| Error::InvalidArgument(format!("reflection: {e}")))?;
    let reflection_v1alpha = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(kvlease_proto::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .build_v1alpha()
        .map_err(|e| Error::InvalidArgument(format!("reflection: {e}")))?;

    let housekeeping = tokio::spawn(housekeeping(
        service.clone(),
        Duration::from_millis(config.expiry_interval_ms),
        (config.audit_interval_ms > 0).then(|| Duration::from_millis(config.audit_interval_ms)),
        stop_rx.clone(),
    ));

    let metrics_task = match config.metrics_listen {
        Some(metrics_addr) => {
            let metrics_listener = TcpListener::bind(metrics_addr).await.map_err(|e| {
                Error::InvalidArgument(format!("cannot listen for metrics on {metrics_addr}: {e}"))
            })?;
            tracing::info!(addr = %metrics_addr, "cache metrics serving");
            let scrape = service.clone();
            let mut stop = stop_rx.clone();
            Some(tokio::spawn(kvlease_telemetry::metrics::serve_metrics(
                metrics_listener,
                move || scrape.render_metrics(),
                async move {
                    let _ = stop.wait_for(|&s| s).await;
                },
            )))
        }
        None => None,
    };

    tracing::info!(%addr, epoch, "cache service listening");
    let grpc = CacheServiceServer::new(service.clone())
        .max_decoding_message_size(config.max_message_bytes.saturating_mul(4))
        .max_encoding_message_size(config.max_message_bytes.saturating_mul(4));
    let result = tonic::transport::Server::builder()
        .layer(kvlease_telemetry::GrpcTraceLayer::new("kvlease-cache"))
        .add_service(health)
        .add_service(reflection_v1)
        .add_service(reflection_v1alpha)
        .add_service(grpc)
        .serve_with_incoming_shutdown(kvlease_telemetry::incoming(listener), async move {
            shutdown.await;
            let _ = stop_tx.send(true);
        })
        .await;
    let _ = housekeeping.await;
    if let Some(task) = metrics_task {
        let _ = task.await;
    }
    tracing::info!(%addr, "cache service stopped");
    result.map_err(Error::from)
}

/// Reclaims expired sessions and runs the periodic leak audit.
async fn housekeeping(
    service: CacheServiceImpl,
    expiry_every: Duration,
    audit_every: Option<Duration>,
    mut stop: watch::Receiver<bool>,
) {
    let stop_requested = async move {
        let _ = stop.wait_for(|&s| s).await;
    };
    tokio::pin!(stop_requested);
    let mut expiry = tokio::time::interval(expiry_every);
    expiry.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut audit = tokio::time::interval(audit_every.unwrap_or(Duration::from_secs(3600)));
    audit.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    audit.tick().await;
    loop {
        tokio::select! {
            () = &mut stop_requested => return,
            _ = expiry.tick() => {
                let mut cache = service.lock();
                for r in cache.expire_sessions(now()) {
                    tracing::warn!(
                        session_id = r.session_id,
                        sequences = r.sequences,
                        blocks = r.blocks,
                        "session expired; reclaimed what it held"
                    );
                }
                service.notify_events(&cache);
            }
            _ = audit.tick(), if audit_every.is_some() => {
                let mut cache = service.lock();
                let report = cache.audit();
                if !report.reclaimed.is_empty() {
                    tracing::warn!(reclaimed = report.reclaimed.len(), "periodic leak audit reclaimed blocks");
                }
                service.notify_events(&cache);
            }
        }
    }
}
