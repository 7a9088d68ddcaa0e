//! The one cluster builder: the cache, workers and the scheduler, each
//! started from its library's `run` on listeners bound here, in-process (the
//! services still talk over gRPC). `kvlease up` and `kvlease demo` start a
//! whole [`Cluster`]; the integration tests start the same [`Service`]s one
//! by one ([`start_cache`], [`start_worker`], [`start_scheduler`]) when they
//! need something between them.
//!
//! Each start returns once its service answers health checks as SERVING, or
//! with the error it stopped with; a cluster starts the cache and the workers
//! before the scheduler, so the first error reported is the root cause (a
//! worker's budget, not the scheduler's failed `Describe` of it).

use std::future::Future;
use std::net::SocketAddr;
use std::time::Duration;

use kvlease_auth::{Security, SecurityArgs};
use kvlease_runtime::process::Shutdown;
use kvlease_runtime::serve::{Listeners, Stop};
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tonic_health::pb::health_check_response::ServingStatus;
use worker_svc::arena::ArenaLayout;
use worker_svc::backend::cpu::activation_bytes;
use worker_svc::model::ModelConfig;
use worker_svc::worker::DEFAULT_MAX_THREADS;

use crate::connect;
use crate::error::{Error, Result};

/// How often a starting service is asked whether it serves yet.
const READY_POLL: Duration = Duration::from_millis(20);

/// One running service.
#[derive(Debug)]
pub struct Service {
    /// `cache`, `worker` or `scheduler`.
    pub name: &'static str,
    /// Its gRPC address.
    pub addr: SocketAddr,
    /// Its Prometheus endpoint, when it has one.
    pub metrics: Option<SocketAddr>,
    stop: Stop,
    /// `None` once it was joined.
    task: Option<JoinHandle<Result<()>>>,
}

impl Service {
    /// `http://addr`, for clients and for the scheduler's flags.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Asks the service to stop and waits for it; the error it stopped with.
    pub async fn stop(mut self) -> Result<()> {
        self.stop.stop();
        match self.task.take() {
            Some(task) => joined(self.name, task.await),
            None => Ok(()),
        }
    }

    /// Resolves when the service stops by itself: the error it stopped with
    /// (or a note that it stopped).
    pub async fn stopped(&mut self) -> Error {
        let Some(task) = self.task.as_mut() else {
            return failed(self.name, "stopped");
        };
        let ended = task.await;
        self.task = None;
        match joined(self.name, ended) {
            Err(e) => e,
            Ok(()) => failed(self.name, "stopped"),
        }
    }

    /// Spawns `run` on `listeners` (in the trace service `trace_name`) and
    /// waits until it serves (gRPC health), or returns what it stopped with.
    /// `security` is the service's own: its health is checked over it (see
    /// `ready_as`).
    pub async fn start<F>(
        name: &'static str,
        trace_name: &'static str,
        listeners: Listeners,
        within: Duration,
        security: &SecurityArgs,
        run: impl FnOnce(Listeners, Shutdown) -> F,
    ) -> Result<Self>
    where
        F: Future<Output = Result<()>> + Send + 'static,
    {
        let addr = local_addr(&listeners.grpc)?;
        let metrics = listeners.metrics.as_ref().map(local_addr).transpose()?;
        let stop = Stop::new();
        let running = run(listeners, Box::pin(stop.watch().into_stopped()));
        let task = tokio::spawn(kvlease_telemetry::in_service(trace_name, running));
        let mut service = Self {
            name,
            addr,
            metrics,
            stop,
            task: Some(task),
        };
        if let Err(e) = service.wait_ready(&ready_as(security), within).await {
            // Not ready in time: stop it and wait, so it releases its ports.
            let _ = service.stop().await;
            return Err(e);
        }
        Ok(service)
    }

    async fn wait_ready(&mut self, security: &Security, within: Duration) -> Result<()> {
        let deadline = tokio::time::Instant::now() + within;
        let addr = self.addr.to_string();
        loop {
            if self.task.as_ref().is_none_or(JoinHandle::is_finished) {
                return Err(self.stopped().await);
            }
            if let Ok(ServingStatus::Serving) =
                connect::health_as(security, &addr, "", Duration::from_millis(500)).await
            {
                return Ok(());
            }
            if tokio::time::Instant::now() > deadline {
                return Err(Error::NotReady {
                    service: self.name,
                    within,
                });
            }
            tokio::time::sleep(READY_POLL).await;
        }
    }
}

/// What a starting service's health is checked with: under TLS its own
/// certificate (health takes any caller the CA vouches for, so starting a
/// service needs no other principal's credentials), else this process's
/// security ([`connect::security`]). Flags that do not load fall back too:
/// the service itself stops with what is wrong with them.
fn ready_as(own: &SecurityArgs) -> Security {
    match own.load() {
        Ok(security) if !security.is_plaintext() => security,
        _ => connect::security(),
    }
}

/// Binds a gRPC listener on `addr` (port 0 = any free port).
pub async fn bind(addr: SocketAddr) -> Result<TcpListener> {
    TcpListener::bind(addr)
        .await
        .map_err(|source| Error::Bind { addr, source })
}

/// Binds `grpc` and, when given, `metrics`.
pub async fn listeners(grpc: SocketAddr, metrics: Option<SocketAddr>) -> Result<Listeners> {
    let grpc = bind(grpc).await?;
    Ok(match metrics {
        Some(addr) => Listeners::from(grpc).with_metrics(bind(addr).await?),
        None => Listeners::from(grpc),
    })
}

/// Starts a cache service on `listeners`.
pub async fn start_cache(listeners: Listeners, config: cache_svc::Config) -> Result<Service> {
    Service::start(
        "cache",
        cache_svc::SERVICE,
        listeners,
        Duration::from_secs(30),
        &config.security.clone(),
        |l, stop| async move {
            cache_svc::run(l, config, stop)
                .await
                .map_err(|e| failed("cache", e))
        },
    )
    .await
}

/// Starts a worker on `listeners`; returns once its model is built and it
/// serves. A budget too small for the model is [`Error::MemoryBudget`].
pub async fn start_worker(
    listeners: Listeners,
    config: worker_svc::Config,
    within: Duration,
) -> Result<Service> {
    start_worker_for(listeners, config, 0, within).await
}

/// [`start_worker`] for a scheduler whose longest request is `context`
/// tokens (0: the model's context), which a too small budget's error counts
/// in what the budget must at least be.
pub async fn start_worker_for(
    listeners: Listeners,
    config: worker_svc::Config,
    context: u32,
    within: Duration,
) -> Result<Service> {
    Service::start(
        "worker",
        worker_svc::SERVICE,
        listeners,
        within,
        &config.security.clone(),
        move |l, stop| async move {
            let sizing = config.clone();
            worker_svc::run(l, config, stop)
                .await
                .map_err(|e| worker_error(&sizing, context, e))
        },
    )
    .await
}

/// Starts a scheduler on `listeners` and waits until it serves (its
/// start-up, warm-up included, succeeded) or returns its start-up error.
pub async fn start_scheduler(
    listeners: Listeners,
    config: scheduler_svc::Config,
    within: Duration,
) -> Result<Service> {
    Service::start(
        "scheduler",
        scheduler_svc::SERVICE,
        listeners,
        within,
        &config.security.clone(),
        |l, stop| async move {
            scheduler_svc::run(l, config, stop)
                .await
                .map_err(|e| failed("scheduler", e))
        },
    )
    .await
}

/// A worker's error as the cluster reports it: a budget too small for the
/// model says in one line what the budget must at least be.
fn worker_error(config: &worker_svc::Config, context: u32, e: worker_svc::Error) -> Error {
    match e {
        worker_svc::Error::MemoryBudget {
            weight_bytes,
            activation_bytes,
            ..
        } => {
            let fixed = weight_bytes + activation_bytes;
            Error::MemoryBudget {
                budget_mib: config.memory_budget_mib,
                taken_mib: fixed as f64 / MIB as f64,
                at_least_mib: (fixed + kv_bytes_for(config, context)).div_ceil(MIB),
            }
        }
        other => failed("worker", other),
    }
}

/// The KV bytes a worker's budget must leave so that one sequence of
/// `context` tokens fits in every pool (the scheduler's longest warm-up
/// shape).
fn kv_bytes_for(config: &worker_svc::Config, context: u32) -> u64 {
    config
        .model_shape()
        .map_or(0, |model| kv_bytes(&model, context, 1))
}

/// The KV bytes that hold `sequences` sequences of `context` tokens (0: the
/// model's context) in every pool: the worker splits its KV bytes over the
/// pools by layer count, so the pool that needs the most per layer decides.
fn kv_bytes(model: &ModelConfig, context: u32, sequences: u32) -> u64 {
    let layers = model.num_layers() as u64;
    let context = if context == 0 {
        model.max_context
    } else {
        context.min(model.max_context)
    };
    let tokens_per_block = model.tokens_per_block.max(1);
    let full = context.div_ceil(tokens_per_block);
    ArenaLayout::new(model, &[])
        .pools
        .iter()
        .map(|pool| {
            let blocks = match pool.window {
                0 => full,
                w => full.min(w.div_ceil(tokens_per_block) + 1),
            };
            // this pool's share of the KV bytes must hold `blocks` blocks
            (u64::from(blocks) * u64::from(sequences) * pool.bytes_per_block() * layers)
                .div_ceil(pool.layers.len().max(1) as u64)
        })
        .max()
        .unwrap_or(0)
}

/// Sequences of the longest context that the default budget of a worker
/// serving a real model (`kvlease up --model`) holds KV blocks for.
pub const MODEL_BUDGET_SEQUENCES: u32 = 4;

/// The memory budget, in MiB, in which a CPU worker with `config` holds its
/// model's weights (as the worker keeps them: quantized matrices packed),
/// its activations and the KV blocks of `sequences` sequences of `context`
/// tokens (0: the model's context). A real model is read from its file to
/// count its weights.
pub fn budget_for(config: &worker_svc::Config, context: u32, sequences: u32) -> Result<u64> {
    let model = config.model_shape().map_err(|e| failed("worker", e))?;
    // as the worker resolves 0 threads (the activations grow with them)
    let threads = match config.threads {
        0 => std::thread::available_parallelism()
            .map_or(1, usize::from)
            .min(DEFAULT_MAX_THREADS),
        n => n,
    };
    let weights = config.weight_bytes().map_err(|e| failed("worker", e))?;
    let activations = activation_bytes(&model, config.max_batch_tokens, threads);
    let kv = kv_bytes(&model, context, sequences);
    Ok((weights + activations + kv).div_ceil(MIB))
}

const MIB: u64 = 1 << 20;

fn local_addr(listener: &TcpListener) -> Result<SocketAddr> {
    listener.local_addr().map_err(|source| Error::Bind {
        addr: SocketAddr::from(([0, 0, 0, 0], 0)),
        source,
    })
}

fn failed(service: &'static str, e: impl std::fmt::Display) -> Error {
    Error::Service {
        service,
        message: e.to_string(),
    }
}

fn joined(
    service: &'static str,
    ended: std::result::Result<Result<()>, tokio::task::JoinError>,
) -> Result<()> {
    ended.map_err(|e| failed(service, e))?
}

// === the whole cluster ===

/// What to start and where.
#[derive(Debug, Clone)]
pub struct ClusterConfig {
    /// Scheduler API address (port 0 = any free port).
    pub scheduler_listen: SocketAddr,
    pub cache_listen: SocketAddr,
    /// One address per worker.
    pub worker_listens: Vec<SocketAddr>,
    /// Worker i's group role (disaggregated serving); a worker past the
    /// end of the list (every one, when it is empty) serves both.
    pub worker_roles: Vec<scheduler_svc::domain::Role>,
    pub cache: cache_svc::Config,
    /// Every worker's config (its `listen` is replaced).
    pub worker: worker_svc::Config,
    /// The scheduler's config (its addresses are replaced).
    pub scheduler: scheduler_svc::Config,
    /// How long each service's start-up (the scheduler's warm-up included)
    /// may take.
    pub ready_within: Duration,
    /// Prometheus endpoints on the listen host: the scheduler on `port`, the
    /// cache on `port + 1` and worker i on `port + 2 + i`; `None` turns them
    /// off.
    pub metrics_port: Option<u16>,
}

impl ClusterConfig {
    /// Default services on `host`, with the scheduler on `base_port`, the
    /// cache on `base_port + 1` and the workers from `base_port + 2` (with
    /// 50051 these are the services' own defaults). Port 0 = ephemeral ports.
    pub fn on_ports(host: std::net::IpAddr, base_port: u16, workers: usize) -> Self {
        let at = |offset: u16| {
            let port = if base_port == 0 {
                0
            } else {
                base_port.saturating_add(offset)
            };
            SocketAddr::new(host, port)
        };
        Self {
            scheduler_listen: at(0),
            cache_listen: at(1),
            worker_listens: (0..workers).map(|i| at(2 + i as u16)).collect(),
            worker_roles: Vec::new(),
            cache: cache_svc::Config::default(),
            worker: worker_svc::Config::default(),
            scheduler: scheduler_svc::Config::default(),
            ready_within: Duration::from_secs(120),
            metrics_port: None,
        }
    }

    /// Every worker serves the real model at `path` (a GGUF file or a
    /// Hugging Face directory) in `budget_mib` each or, when `None`, in the
    /// [`budget_for`] [`MODEL_BUDGET_SEQUENCES`] sequences of the
    /// scheduler's longest context. Set the workers' threads first (they
    /// size the activations). Returns the budget.
    pub fn serve_model(
        &mut self,
        path: std::path::PathBuf,
        budget_mib: Option<u64>,
    ) -> Result<u64> {
        self.worker.model = Some(path);
        let budget = match budget_mib {
            Some(b) => b,
            None => budget_for(
                &self.worker,
                self.scheduler.max_context,
                MODEL_BUDGET_SEQUENCES,
            )?,
        };
        self.worker.memory_budget_mib = budget;
        Ok(budget)
    }

    /// The metrics address of the service at `offset` (see `metrics_port`).
    fn metrics_at(&self, host: std::net::IpAddr, offset: usize) -> Option<SocketAddr> {
        self.metrics_port
            .map(|port| SocketAddr::new(host, port.saturating_add(offset as u16)))
    }
}

/// The running cluster.
#[derive(Debug)]
pub struct Cluster {
    pub scheduler: SocketAddr,
    pub cache: SocketAddr,
    pub workers: Vec<SocketAddr>,
    /// The Prometheus endpoints started: (service, address).
    pub metrics: Vec<(String, SocketAddr)>,
    scheduler_service: Service,
    rest: Vec<Service>,
}

impl Cluster {
    /// Starts the cache, then the workers, then the scheduler, each once the
    /// one before serves, and returns once the scheduler serves (its
    /// start-up, warm-up included, succeeded) or with the first error.
    pub async fn start(config: ClusterConfig) -> Result<Self> {
        let host = config.cache_listen.ip();
        let mut rest = Vec::new();
        let started = Self::start_all(&config, host, &mut rest).await;
        match started {
            Ok(scheduler_service) => {
                let mut metrics = Vec::new();
                if let Some(addr) = scheduler_service.metrics {
                    metrics.push(("scheduler".to_string(), addr));
                }
                let mut workers = Vec::new();
                for service in &rest {
                    if service.name == "worker" {
                        workers.push(service.addr);
                    }
                    if let Some(addr) = service.metrics {
                        let label = match service.name {
                            "worker" => format!("worker-{}", workers.len()),
                            other => other.to_string(),
                        };
                        metrics.push((label, addr));
                    }
                }
                Ok(Self {
                    scheduler: scheduler_service.addr,
                    cache: rest[0].addr,
                    workers,
                    metrics,
                    scheduler_service,
                    rest,
                })
            }
            Err(e) => {
                stop_all(rest).await;
                Err(e)
            }
        }
    }

    async fn start_all(
        config: &ClusterConfig,
        host: std::net::IpAddr,
        rest: &mut Vec<Service>,
    ) -> Result<Service> {
        // Bind everything first: a port in use fails before anything starts.
        let cache_listeners = listeners(
            config.cache_listen,
            config.metrics_at(host, 1).or(config.cache.metrics_listen),
        )
        .await?;
        let mut worker_listeners = Vec::new();
        for (i, addr) in config.worker_listens.iter().enumerate() {
            let metrics = config
                .metrics_at(host, 2 + i)
                .or(config.worker.metrics_listen);
            worker_listeners.push(listeners(*addr, metrics).await?);
        }
        let scheduler_listeners = listeners(
            config.scheduler_listen,
            config
                .metrics_at(host, 0)
                .or(config.scheduler.metrics_listen),
        )
        .await?;

        let cache = start_cache(cache_listeners, config.cache.clone()).await?;
        let cache_url = cache.url();
        rest.push(cache);
        let mut worker_urls = Vec::new();
        for (i, listeners) in worker_listeners.into_iter().enumerate() {
            let worker = start_worker_for(
                listeners,
                config.worker.clone(),
                config.scheduler.max_context,
                config.ready_within,
            )
            .await?;
            worker_urls.push(match config.worker_roles.get(i) {
                Some(role) => format!("{}#role={}", worker.url(), role.as_str()),
                None => worker.url(),
            });
            rest.push(worker);
        }
        let scheduler = scheduler_svc::Config {
            cache_addr: cache_url,
            worker_addrs: worker_urls,
            ..config.scheduler.clone()
        };
        start_scheduler(scheduler_listeners, scheduler, config.ready_within).await
    }

    /// Resolves when any service stops by itself: the error it stopped with
    /// (or a note that it stopped). A running cluster should never get here.
    pub async fn stopped(&mut self) -> Error {
        // `rest` holds the cache at least, so `select_all` has something to wait on.
        let rest = futures::future::select_all(self.rest.iter_mut().map(|s| Box::pin(s.stopped())));
        tokio::select! {
            e = self.scheduler_service.stopped() => e,
            (e, _, _) = rest => e,
        }
    }

    /// Stops the scheduler first (it finishes its open streams), then the
    /// workers and the cache, and waits for all of them.
    pub async fn shutdown(self) {
        log_end("scheduler", self.scheduler_service.stop().await);
        stop_all(self.rest).await;
    }
}

/// Stops `services` last to first (workers before the cache).
async fn stop_all(services: Vec<Service>) {
    for service in services.into_iter().rev() {
        let name = service.name;
        log_end(name, service.stop().await);
    }
}

fn log_end(service: &'static str, ended: Result<()>) {
    if let Err(e) = ended {
        tracing::warn!(service, error = %e, "service stopped with an error");
    }
}
