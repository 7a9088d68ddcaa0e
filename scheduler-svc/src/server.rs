//! [`run`]: connect to the cache and the workers, start up (warm-up
//! included), then serve the Scheduler API with health and reflection until
//! the shutdown future resolves.

use std::future::Future;

use kvlease_proto::v1::scheduler_server::SchedulerServer;
use tokio::net::TcpListener;
use tokio::sync::watch;

use crate::bootstrap;
use crate::client::{CacheClient, WorkerClient};
use crate::config::Config;
use crate::error::{Error, Result};
use crate::metrics::SchedulerMetrics;
use crate::service::{Limits, SchedulerService};
use crate::session::keep_alive;
use crate::step_loop::{StepLoop, StepLoopConfig};

/// The service name in traces.
pub const SERVICE: &str = "kvlease-scheduler";

/// Runs the scheduler on `listener` until `shutdown` resolves. Start-up
/// (session, pool registration, warm-up) happens first and its failure is
/// returned before anything is served.
pub async fn run(
    listener: TcpListener,
    config: Config,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<()> {
    config.validate()?;
    let cache = CacheClient::new(&config.cache_addr, config.cache_timeout())?;
    let workers = config
        .worker_addrs
        .iter()
        .filter(|a| !a.trim().is_empty())
        .map(|a| WorkerClient::new(a.trim()))
        .collect::<Result<Vec<_>>>()?;
    let session = cache
        .open_session(&config.holder, config.session_ttl_ms)
        .await?;
    tracing::info!(
        session_id = session.id.get(),
        epoch = session.epoch.get(),
        ttl_ms = session.ttl_ms,
        "cache session opened"
    );
    let started = match bootstrap::start(&config, &cache, &workers).await {
        Ok(s) => s,
        Err(e) => {
            tracing::error!(error = %e, "start-up failed");
            // closing the session reclaims anything a failed warm-up held
            let _ = cache.close_session().await;
            return Err(e);
        }
    };
    let limits = Limits {
        max_tokens: config.max_tokens,
        max_context: started
            .groups
            .iter()
            .map(|g| g.max_context)
            .min()
            .unwrap_or(0),
        vocab_size: started
            .groups
            .iter()
            .map(|g| g.vocab_size)
            .min()
            .unwrap_or(0),
    };
    let group_names: Vec<String> = started.groups.iter().map(|g| g.name.clone()).collect();
    let tokenizer = started.tokenizer.clone();
    let registry = kvlease_telemetry::metrics::Registry::new();
    let metrics = SchedulerMetrics::register(&registry)?;
    let (engine, handle) = StepLoop::new(
        StepLoopConfig {
            core: config.core(),
            overlap: config.overlap,
            holder: config.holder.clone(),
            session_ttl_ms: config.session_ttl_ms,
            on_cache_restart: config.on_cache_restart,
            first_step: started.last_step,
        },
        started.groups,
        cache.clone(),
        workers,
        metrics,
    );
    let (stop_tx, stop_rx) = watch::channel(false);
    let engine_task = tokio::spawn(kvlease_telemetry::in_service(
        SERVICE,
        engine.run(stop_rx.clone()),
    ));
    let keep_alive_task = tokio::spawn(keep_alive(cache.clone(), stop_rx.clone()));
    let metrics_task = match config.metrics_listen {
        Some(addr) => {
            let metrics_listener = TcpListener::bind(addr)
                .await
                .map_err(|e| Error::Config(format!("cannot listen for metrics on {addr}: {e}")))?;
            tracing::info!(%addr, "scheduler metrics serving");
            let mut stop = stop_rx.clone();
            let stopped = async move {
                let _ = stop.wait_for(|s| *s).await;
            };
            Some(tokio::spawn(kvlease_telemetry::metrics::serve_metrics(
                metrics_listener,
                move || registry.render(),
                stopped,
            )))
        }
        None => None,
    };

    let service = SchedulerService::new(
        handle,
        cache,
        limits,
        tokenizer,
        config.policy,
        config.on_exhausted,
        group_names,
    );
    let (health, health_service) = tonic_health::server::health_reporter();
    health
        .set_serving::<SchedulerServer<SchedulerService>>()
        .await;
    let reflection = || {
        tonic_reflection::server::Builder::configure()
            .register_encoded_file_descriptor_set(kvlease_proto::FILE_DESCRIPTOR_SET)
            .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
    };
    let reflection_v1 = reflection()
        .build_v1()
        .map_err(|e| Error::Config(format!("reflection: {e}")))?;
    let reflection_v1alpha = reflection()
        .build_v1alpha()
        .map_err(|e| Error::Config(format!("reflection: {e}")))?;

    // On shutdown the loop finishes every open stream first, so the server's
    // graceful shutdown is not held up by them.
    let stop_loop = stop_tx.clone();
    let shutdown = async move {
        shutdown.await;
        let _ = stop_loop.send(true);
    };
    tracing::info!(addr = ?listener.local_addr().ok(), "scheduler serving");
    let served = tonic::transport::Server::builder()
        .layer(kvlease_telemetry::GrpcTraceLayer::new(SERVICE))
        .add_service(health_service)
        .add_service(reflection_v1)
        .add_service(reflection_v1alpha)
        .add_service(SchedulerServer::new(service))
        .serve_with_incoming_shutdown(kvlease_telemetry::incoming(listener), shutdown)
        .await;
    let _ = stop_tx.send(true);
    if let Err(e) = engine_task.await {
        tracing::error!(error = %e, "step loop task failed");
    }
    if let Err(e) = keep_alive_task.await {
        tracing::error!(error = %e, "keep-alive task failed");
    }
    if let Some(task) = metrics_task
        && let Err(e) = task.await
    {
        tracing::error!(error = %e, "metrics task failed");
    }
    served.map_err(Error::Serve)
}
