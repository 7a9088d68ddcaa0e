//! [`run`]: the cache service on its listeners, with gRPC health and
//! reflection, and background session expiry and leak audits.

use std::future::Future;
use std::time::Duration;

use kvlease_proto::v1::cache_service_server::CacheServiceServer;
use kvlease_runtime::process::RunError;
use kvlease_runtime::serve::{Listeners, ServerInfo, Stop, StopWatch, serve};

use crate::cache::Cache;
use crate::config::Config;
use crate::error::{Error, Result};
use crate::metrics::CacheMetrics;
use crate::service::{CacheServiceImpl, now};

/// The service name in traces and logs.
pub const SERVICE: &str = "kvlease-cache";

impl RunError for Error {
    /// `run` refuses a configuration [`Config::validate`] refuses.
    fn is_config(&self) -> bool {
        matches!(self, Error::Config(_))
    }
}

/// Serves the cache service on `listeners` until `shutdown` resolves: gRPC
/// with health and reflection, the metrics endpoint when there is a listener
/// for it, and background session expiry and leak audits. `config.listen` and
/// `config.metrics_listen` are not used: the caller binds the listeners.
pub async fn run(
    listeners: impl Into<Listeners>,
    config: Config,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<()> {
    config.validate().map_err(Error::Config)?;
    let security = config
        .security
        .load()
        .map_err(|e| Error::Config(e.to_string()))?;
    let cache = Cache::new(config.cache_config());
    let epoch = cache.epoch();
    let stop = Stop::new();
    let metrics = CacheMetrics::new()?;
    let service = CacheServiceImpl::new(
        cache,
        metrics,
        config.max_batch,
        config.max_message_bytes,
        (
            config.max_watch_streams,
            config.max_watch_streams_per_principal,
        ),
        stop.watch(),
    );
    let housekeeping = tokio::spawn(housekeeping(
        service.clone(),
        Duration::from_millis(config.expiry_interval_ms),
        (config.audit_interval_ms > 0).then(|| Duration::from_millis(config.audit_interval_ms)),
        stop.watch(),
    ));
    tracing::info!(epoch = epoch.0, "cache service starting");
    let grpc = CacheServiceServer::new(service.clone())
        // a request over the limit is refused by tonic before it is decoded
        // (RESOURCE_EXHAUSTED, through the shared StatusLayer)
        .max_decoding_message_size(config.max_message_bytes)
        .max_encoding_message_size(config.max_message_bytes.saturating_mul(4));
    let scrape = service.clone();
    // Streams (WatchEvents) and housekeeping end when the server starts
    // draining, so graceful shutdown does not wait on them forever.
    let served = serve(
        ServerInfo {
            name: SERVICE,
            descriptors: kvlease_proto::FILE_DESCRIPTOR_SET,
        },
        listeners.into(),
        &security,
        &config.limits,
        grpc,
        move || scrape.render_metrics(),
        stop.after(shutdown),
    )
    .await;
    stop.stop();
    let _ = housekeeping.await;
    served.map_err(Error::from)
}

/// Reclaims expired sessions and runs the periodic leak audit.
async fn housekeeping(
    service: CacheServiceImpl,
    expiry_every: Duration,
    audit_every: Option<Duration>,
    stop: StopWatch,
) {
    let stop_requested = stop.into_stopped();
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
                        session_id = r.session_id.0,
                        sequences = r.sequences,
                        blocks = r.blocks,
                        "session expired; reclaimed what it held"
                    );
                }
                service.notify_events(&cache);
            }
            _ = audit.tick(), if audit_every.is_some() => {
                let report = service.audit_sliced().await;
                if !report.reclaimed.is_empty() {
                    tracing::warn!(reclaimed = report.reclaimed.len(), "periodic leak audit reclaimed blocks");
                }
            }
        }
    }
}
