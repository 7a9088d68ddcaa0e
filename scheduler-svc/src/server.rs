//! [`run`]: connect to the cache and the workers, start up (warm-up
//! included), then serve the Scheduler API with health and reflection until
//! the shutdown future resolves.

use std::future::Future;

use kvlease_proto::v1::scheduler_server::SchedulerServer;
use kvlease_runtime::process::RunError;
use kvlease_runtime::serve::{Listeners, ServerInfo, Stop, serve};

use crate::bootstrap;
use crate::client::{CacheClient, WorkerClient};
use crate::config::Config;
use crate::convert::Limits;
use crate::error::{Error, Result};
use crate::keepalive::keep_alive;
use crate::metrics::SchedulerMetrics;
use crate::service::SchedulerService;
use crate::step_loop::{StepLoop, StepLoopConfig};
use crate::tenant::Tenancy;
use crate::traces::SERVICE;
use kvlease_auth::salt::SaltKey;

impl RunError for Error {
    /// A configuration [`Config::validate`] refuses.
    fn is_config(&self) -> bool {
        matches!(self, Error::Config(_))
    }
}

/// Runs the scheduler on `listeners` until `shutdown` resolves. Start-up
/// (session, pool registration, warm-up) happens first and its failure is
/// returned before anything is served. `config.listen` and
/// `config.metrics_listen` are not used: the caller binds the listeners.
pub async fn run(
    listeners: impl Into<Listeners>,
    config: Config,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<()> {
    config.validate()?;
    let listeners = listeners.into();
    let security = config
        .security
        .load()
        .map_err(|e| Error::Config(e.to_string()))?;
    let salt_key = match &config.salt_secret_file {
        Some(path) => SaltKey::new(&std::fs::read(path).map_err(|e| {
            Error::Config(format!(
                "cannot read --salt-secret-file {}: {e}",
                path.display()
            ))
        })?),
        None => SaltKey::random(),
    };
    let tenancy = Tenancy::new(salt_key, &config.tenant_group, &config.tenant_asserter);
    let cache = CacheClient::new(&config.cache_addr, &security, config.cache_timeout())?;
    let workers = config
        .workers()?
        .iter()
        .map(|(url, _)| WorkerClient::new(url, &security, config.worker_keepalive()))
        .collect::<Result<Vec<_>>>()?;
    let session = cache
        .open_session(&config.holder, config.session_ttl_ms)
        .await?;
    tracing::info!(
        session_id = session.id.get(),
        epoch = session.epoch.get(),
        ttl_ms = session.ttl_ms,
        max_batch = session.max_batch,
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
        max_tokens: config.max_tokens_limit(),
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
    let group_names: Vec<(String, crate::domain::Role)> = started
        .groups
        .iter()
        .map(|g| (g.name.clone(), g.role))
        .collect();
    let tokenizer = started.tokenizer.clone();
    let mut registry = kvlease_telemetry::metrics::Registry::new();
    let metrics = SchedulerMetrics::register(&mut registry)?;
    let (step_loop, handle) = StepLoop::new(
        StepLoopConfig {
            core: config.core(),
            holder: config.holder.clone(),
            session_ttl_ms: config.session_ttl_ms,
            on_cache_restart: config.on_cache_restart,
            first_step: started.last_step,
            trace_steps_one_in: config.trace_steps_one_in,
            max_queue: config.max_queue,
        },
        started.groups,
        cache.clone(),
        workers,
        metrics,
    )?;
    let stop = Stop::new();
    let step_loop_done = step_loop.spawn_thread(stop.watch().receiver())?;
    let keep_alive_task = tokio::spawn(keep_alive(cache.clone(), stop.watch().receiver()));
    let service = SchedulerService::new(
        handle,
        cache,
        limits,
        tokenizer,
        config.policy,
        config.on_exhausted,
        group_names,
        tenancy,
    );
    // On shutdown the loop finishes every open stream first, so the server's
    // graceful shutdown is not held up by them.
    let served = serve(
        ServerInfo {
            name: SERVICE,
            descriptors: kvlease_proto::FILE_DESCRIPTOR_SET,
        },
        listeners,
        &security,
        &config.limits,
        SchedulerServer::new(service).max_decoding_message_size(config.max_message_bytes),
        move || registry.render(),
        stop.after(shutdown),
    )
    .await;
    stop.stop();
    if step_loop_done.await.is_err() {
        tracing::error!("the step loop's thread ended without finishing (it panicked)");
    }
    if let Err(e) = keep_alive_task.await {
        tracing::error!(error = %e, "keep-alive task failed");
    }
    served.map_err(Error::Serve)
}
