//! A whole kvlease cluster in one process: the cache, N workers and the
//! scheduler, each started from its library's `run` on a loopback listener
//! (`kvlease up`, `kvlease demo`). The services still talk over gRPC.

use std::net::SocketAddr;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinSet;
use tonic_health::pb::health_check_response::ServingStatus;

use crate::connect;
use crate::error::{Error, Result};

/// What to start and where.
#[derive(Debug, Clone)]
pub struct ClusterConfig {
    /// Scheduler API address (port 0 = any free port).
    pub scheduler_listen: SocketAddr,
    pub cache_listen: SocketAddr,
    /// One address per worker.
    pub worker_listens: Vec<SocketAddr>,
    pub cache: cache_svc::Config,
    /// Every worker's config (its `listen` is replaced).
    pub worker: worker_svc::Config,
    /// The scheduler's config (its addresses are replaced).
    pub scheduler: scheduler_svc::Config,
    /// How long the scheduler's start-up (warm-up included) may take.
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
            cache: cache_svc::Config::default(),
            worker: worker_svc::Config::default(),
            scheduler: scheduler_svc::Config::default(),
            ready_within: Duration::from_secs(120),
            metrics_port: None,
        }
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
    stop_scheduler: watch::Sender<bool>,
    stop_rest: watch::Sender<bool>,
    scheduler_task: JoinSet<Result<()>>,
    tasks: JoinSet<Result<()>>,
}

async fn bind(addr: SocketAddr) -> Result<(TcpListener, SocketAddr)> {
    let listener = TcpListener::bind(addr)
        .await
        .map_err(|source| Error::Bind { addr, source })?;
    let local = listener
        .local_addr()
        .map_err(|source| Error::Bind { addr, source })?;
    Ok((listener, local))
}

async fn stopped(mut rx: watch::Receiver<bool>) {
    // an error means the sender is gone: stop as well
    let _ = rx.wait_for(|stop| *stop).await;
}

fn failed(service: &'static str, e: impl std::fmt::Display) -> Error {
    Error::Service {
        service,
        message: e.to_string(),
    }
}

impl Cluster {
    /// Binds every listener, starts the cache and the workers, then the
    /// scheduler, and returns once the scheduler reports SERVING (its
    /// start-up, warm-up included, succeeded) or with its start-up error.
    pub async fn start(config: ClusterConfig) -> Result<Self> {
        let (cache_listener, cache) = bind(config.cache_listen).await?;
        let mut worker_listeners = Vec::new();
        for addr in &config.worker_listens {
            worker_listeners.push(bind(*addr).await?);
        }
        let (scheduler_listener, scheduler) = bind(config.scheduler_listen).await?;
        let workers: Vec<SocketAddr> = worker_listeners.iter().map(|(_, a)| *a).collect();

        let mut metrics = Vec::new();
        let metrics_at = |offset: usize| {
            config
                .metrics_port
                .map(|port| SocketAddr::new(cache.ip(), port.saturating_add(offset as u16)))
        };
        let scheduler_metrics = metrics_at(0);
        if let Some(addr) = scheduler_metrics {
            metrics.push(("scheduler".to_string(), addr));
        }
        let cache_metrics = metrics_at(1);
        if let Some(addr) = cache_metrics {
            metrics.push(("cache".to_string(), addr));
        }

        let (stop_rest, rest_rx) = watch::channel(false);
        let (stop_scheduler, scheduler_rx) = watch::channel(false);
        let mut tasks = JoinSet::new();
        let cache_config = cache_svc::Config {
            listen: cache,
            metrics_listen: cache_metrics.or(config.cache.metrics_listen),
            ..config.cache
        };
        tasks.spawn(kvlease_telemetry::in_service("kvlease-cache", {
            let stop = stopped(rest_rx.clone());
            async move {
                cache_svc::run(cache_listener, cache_config, stop)
                    .await
                    .map_err(|e| failed("cache", e))
            }
        }));
        for (i, (listener, addr)) in worker_listeners.into_iter().enumerate() {
            let worker_metrics = metrics_at(2 + i);
            if let Some(addr) = worker_metrics {
                metrics.push((format!("worker-{}", i + 1), addr));
            }
            let worker_config = worker_svc::Config {
                listen: addr,
                metrics_listen: worker_metrics.or(config.worker.metrics_listen),
                ..config.worker.clone()
            };
            let stop = stopped(rest_rx.clone());
            tasks.spawn(kvlease_telemetry::in_service(
                "kvlease-worker",
                async move {
                    worker_svc::run(listener, worker_config, stop)
                        .await
                        .map_err(|e| failed("worker", e))
                },
            ));
        }
        let scheduler_config = scheduler_svc::Config {
            listen: scheduler,
            cache_addr: format!("http://{cache}"),
            worker_addrs: workers.iter().map(|a| format!("http://{a}")).collect(),
            metrics_listen: scheduler_metrics.or(config.scheduler.metrics_listen),
            ..config.scheduler
        };
        let mut scheduler_task = JoinSet::new();
        let stop = stopped(scheduler_rx);
        scheduler_task.spawn(kvlease_telemetry::in_service(
            "kvlease-scheduler",
            async move {
                scheduler_svc::run(scheduler_listener, scheduler_config, stop)
                    .await
                    .map_err(|e| failed("scheduler", e))
            },
        ));
        let mut cluster = Self {
            scheduler,
            cache,
            workers,
            metrics,
            stop_scheduler,
            stop_rest,
            scheduler_task,
            tasks,
        };
        if let Err(e) = cluster.wait_ready(config.ready_within).await {
            cluster.shutdown().await;
            return Err(e);
        }
        Ok(cluster)
    }

    async fn wait_ready(&mut self, within: Duration) -> Result<()> {
        let deadline = tokio::time::Instant::now() + within;
        let addr = self.scheduler.to_string();
        loop {
            // a cache or worker that stopped is the root cause of what the
            // scheduler then reports: check them first
            if let Some(ended) = self.tasks.try_join_next() {
                return Err(ended_early("cache or worker", ended));
            }
            if let Some(ended) = self.scheduler_task.try_join_next() {
                // give a failing peer a moment to report its own error
                tokio::time::sleep(Duration::from_millis(100)).await;
                if let Some(peer) = self.tasks.try_join_next() {
                    return Err(ended_early("cache or worker", peer));
                }
                return Err(ended_early("scheduler", ended));
            }
            if let Ok(ServingStatus::Serving) =
                connect::health(&addr, "", Duration::from_millis(500)).await
            {
                return Ok(());
            }
            if tokio::time::Instant::now() > deadline {
                return Err(Error::NotReady {
                    service: "scheduler",
                    within,
                });
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Resolves when any service stops by itself: the error it stopped with
    /// (or a note that it stopped). A running cluster should never get here.
    pub async fn stopped(&mut self) -> Error {
        tokio::select! {
            Some(ended) = self.scheduler_task.join_next() => ended_early("scheduler", ended),
            Some(ended) = self.tasks.join_next() => ended_early("cache or worker", ended),
        }
    }

    /// Stops the scheduler first (it finishes its open streams), then the
    /// workers and the cache, and waits for all of them.
    pub async fn shutdown(mut self) {
        let _ = self.stop_scheduler.send(true);
        while let Some(ended) = self.scheduler_task.join_next().await {
            log_end("scheduler", ended);
        }
        let _ = self.stop_rest.send(true);
        while let Some(ended) = self.tasks.join_next().await {
            log_end("cache or worker", ended);
        }
    }
}

fn ended_early(
    service: &'static str,
    ended: std::result::Result<Result<()>, tokio::task::JoinError>,
) -> Error {
    match ended {
        Ok(Err(e)) => e,
        Ok(Ok(())) => failed(service, "stopped"),
        Err(e) => failed(service, e),
    }
}

fn log_end(service: &'static str, ended: std::result::Result<Result<()>, tokio::task::JoinError>) {
    if let Err(e) = ended.map_err(|e| failed(service, e)).and_then(|r| r) {
        tracing::warn!(error = %e, "service stopped with an error");
    }
}
