//! kvlease whole-system tests: real cache, worker and scheduler services on
//! loopback ports, started in-process from their libraries' `run`.
//!
//! # Layout
//!
//! - [`Service`]: one running server (address, shutdown, join).
//! - [`start_cache`], [`start_worker`], [`start_scheduler`]: start one
//!   service on `127.0.0.1:0`; `start_scheduler` waits until it serves, or
//!   returns its start-up error.
//! - [`small_worker`]: a small, fast CPU model for tests.
//! - [`collect`]: runs a `Generate` call to its end.
//! - [`pool_stats`], [`wait_whole`]: the cache's figures for one pool group.
//! - [`tap`]: recording pass-through proxies of the cache and a worker.
//!
//! The tests themselves are under `tests/`.

use std::future::Future;
use std::net::SocketAddr;
use std::time::Duration;

use kvlease_proto::v1 as pb;
use kvlease_proto::v1::cache_service_client::CacheServiceClient;
use kvlease_proto::v1::scheduler_client::SchedulerClient;
use kvlease_proto::v1::worker_service_client::WorkerServiceClient;
use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tonic::transport::Channel;

pub mod tap;

/// What can go wrong while setting up a cluster.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("cannot bind a loopback port: {0}")]
    Bind(#[from] std::io::Error),
    #[error("cannot connect to {addr}: {message}")]
    Connect { addr: SocketAddr, message: String },
    #[error("scheduler start-up failed: {0}")]
    SchedulerStart(scheduler_svc::Error),
    #[error("{service} stopped: {message}")]
    Stopped {
        service: &'static str,
        message: String,
    },
    #[error("{0} did not become ready in time")]
    NotReady(&'static str),
    #[error("rpc failed: {0}")]
    Rpc(#[from] tonic::Status),
}

/// One running service.
#[derive(Debug)]
pub struct Service {
    pub addr: SocketAddr,
    stop: Option<oneshot::Sender<()>>,
    task: JoinHandle<Result<(), String>>,
}

impl Service {
    /// `http://addr`, for clients and for the scheduler's flags.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Asks the service to stop and waits for it.
    pub async fn stop(mut self) -> Result<(), String> {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        self.task.await.map_err(|e| e.to_string())?
    }
}

async fn spawn<F, Fut, E>(service: &'static str, start: F) -> Result<Service, Error>
where
    F: FnOnce(TcpListener, oneshot::Receiver<()>) -> Fut,
    Fut: Future<Output = Result<(), E>> + Send + 'static,
    E: std::fmt::Display,
{
    spawn_on(TcpListener::bind("127.0.0.1:0").await?, service, start)
}

fn spawn_on<F, Fut, E>(
    listener: TcpListener,
    service: &'static str,
    start: F,
) -> Result<Service, Error>
where
    F: FnOnce(TcpListener, oneshot::Receiver<()>) -> Fut,
    Fut: Future<Output = Result<(), E>> + Send + 'static,
    E: std::fmt::Display,
{
    let addr = listener.local_addr()?;
    let (stop, stopped) = oneshot::channel();
    let fut = start(listener, stopped);
    let task = tokio::spawn(async move { fut.await.map_err(|e| format!("{service}: {e}")) });
    Ok(Service {
        addr,
        stop: Some(stop),
        task,
    })
}

async fn shutdown(rx: oneshot::Receiver<()>) {
    let _ = rx.await;
}

/// Starts a cache service.
pub async fn start_cache(config: cache_svc::Config) -> Result<Service, Error> {
    spawn("cache", |l, rx| cache_svc::run(l, config, shutdown(rx))).await
}

/// Starts a cache service on a given address (a restart on the same port).
pub async fn start_cache_on(addr: SocketAddr) -> Result<Service, Error> {
    let listener = TcpListener::bind(addr).await?;
    spawn_on(listener, "cache", |l, rx| {
        cache_svc::run(l, cache_svc::Config::default(), shutdown(rx))
    })
}

/// Starts a worker.
pub async fn start_worker(config: worker_svc::Config) -> Result<Service, Error> {
    spawn("worker", |l, rx| worker_svc::run(l, config, shutdown(rx))).await
}

/// Starts a CPU worker of `config`'s model that serves `tokenizer` instead
/// of the model's own (replicas that disagree, large tokenizers).
pub async fn start_worker_with_tokenizer(
    config: worker_svc::Config,
    tokenizer: kvlease_tokenizer::Tokenizer,
) -> Result<Service, Error> {
    use kvlease_proto::v1::worker_service_server::WorkerServiceServer;
    let failed = |e: worker_svc::Error| Error::Stopped {
        service: "worker",
        message: e.to_string(),
    };
    let worker = worker_svc::worker::Worker::new_cpu(
        config.load_weights().map_err(failed)?,
        config.worker_options(),
    )
    .map_err(failed)?;
    let registry = kvlease_telemetry::metrics::Registry::new();
    let metrics =
        worker_svc::service::WorkerMetrics::register(&registry, worker.info()).map_err(failed)?;
    let service = worker_svc::service::WorkerGrpc::new(worker, metrics)
        .with_tokenizer(tokenizer)
        .map_err(failed)?;
    spawn("worker", |l, rx| {
        tonic::transport::Server::builder()
            .add_service(
                WorkerServiceServer::new(service)
                    .max_encoding_message_size(kvlease_tokenizer::MAX_MESSAGE_BYTES),
            )
            .serve_with_incoming_shutdown(
                tokio_stream::wrappers::TcpListenerStream::new(l),
                shutdown(rx),
            )
    })
    .await
}

/// A small CPU model (two pools: windows 0 and 64, 16 tokens per block)
/// whose KV budget holds 20 blocks per pool, so tests can exhaust it.
pub fn small_worker() -> worker_svc::Config {
    small_worker_with(2, 192)
}

/// The small model with another budget: the pools get what `memory_budget_mib`
/// leaves after the weights (0.66 MB) and the activations of a
/// `max_batch_tokens` batch (5.6 KB a token), split over two pools of
/// 8 KiB blocks.
pub fn small_worker_with(memory_budget_mib: u64, max_batch_tokens: usize) -> worker_svc::Config {
    worker_svc::Config {
        hidden_size: 64,
        num_heads: 4,
        num_kv_heads: 2,
        head_dim: 16,
        ffn_size: 128,
        max_context: 512,
        memory_budget_mib,
        max_batch_sequences: 64,
        max_batch_tokens,
        threads: 1,
        ..worker_svc::Config::default()
    }
}

/// Starts a scheduler over `cache` and `workers` and waits until it serves;
/// a start-up failure is returned as [`Error::SchedulerStart`].
pub async fn start_scheduler(
    mut config: scheduler_svc::Config,
    cache: &str,
    workers: &[String],
    ready_within: Duration,
) -> Result<Service, Error> {
    config.cache_addr = cache.to_string();
    config.worker_addrs = workers.to_vec();
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let (stop, stopped) = oneshot::channel();
    let mut task = tokio::spawn(scheduler_svc::run(listener, config, shutdown(stopped)));
    let deadline = tokio::time::Instant::now() + ready_within;
    loop {
        if task.is_finished() {
            return match (&mut task).await {
                Ok(Err(e)) => Err(Error::SchedulerStart(e)),
                Ok(Ok(())) => Err(Error::Stopped {
                    service: "scheduler",
                    message: "exited".into(),
                }),
                Err(e) => Err(Error::Stopped {
                    service: "scheduler",
                    message: e.to_string(),
                }),
            };
        }
        if let Ok(mut client) = scheduler_client(addr).await {
            let probe = tokio::time::timeout(
                Duration::from_millis(300),
                client.get_status(pb::GetStatusRequest {}),
            );
            if let Ok(Ok(_)) = probe.await {
                break;
            }
        }
        if tokio::time::Instant::now() > deadline {
            task.abort();
            return Err(Error::NotReady("scheduler"));
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let task = tokio::spawn(async move {
        match task.await {
            Ok(r) => r.map_err(|e| format!("scheduler: {e}")),
            Err(e) => Err(e.to_string()),
        }
    });
    Ok(Service {
        addr,
        stop: Some(stop),
        task,
    })
}

/// Runs a scheduler to its start-up result (used when start-up must fail).
pub async fn run_scheduler_start(
    mut config: scheduler_svc::Config,
    cache: &str,
    workers: &[String],
) -> Result<(), scheduler_svc::Error> {
    config.cache_addr = cache.to_string();
    config.worker_addrs = workers.to_vec();
    let listener = TcpListener::bind("127.0.0.1:0")
        .await
        .map_err(|e| scheduler_svc::Error::Config(e.to_string()))?;
    // shut down as soon as it serves: this returns after start-up either way
    scheduler_svc::run(listener, config, async {}).await
}

async fn channel(addr: SocketAddr) -> Result<Channel, Error> {
    tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .map_err(|e| Error::Connect {
            addr,
            message: e.to_string(),
        })?
        .connect()
        .await
        .map_err(|e| Error::Connect {
            addr,
            message: e.to_string(),
        })
}

pub async fn scheduler_client(addr: SocketAddr) -> Result<SchedulerClient<Channel>, Error> {
    Ok(SchedulerClient::new(channel(addr).await?))
}

pub async fn cache_client(addr: SocketAddr) -> Result<CacheServiceClient<Channel>, Error> {
    Ok(CacheServiceClient::new(channel(addr).await?))
}

pub async fn worker_client(addr: SocketAddr) -> Result<WorkerServiceClient<Channel>, Error> {
    Ok(WorkerServiceClient::new(channel(addr).await?)
        .max_decoding_message_size(kvlease_tokenizer::MAX_MESSAGE_BYTES))
}

/// A whole Generate call.
#[derive(Debug, Clone, Default)]
pub struct Generated {
    pub tokens: Vec<u32>,
    pub text: String,
    pub finish: i32,
    pub reject: Option<pb::Reject>,
    pub message: String,
    pub reused_tokens: u32,
    pub preemptions: u32,
    pub messages: usize,
}

impl Generated {
    pub fn finish_reason(&self) -> pb::FinishReason {
        pb::FinishReason::try_from(self.finish).unwrap_or(pb::FinishReason::Unspecified)
    }
}

/// Runs `request` to the end of its stream.
pub async fn collect(
    client: &mut SchedulerClient<Channel>,
    request: pb::GenerateRequest,
) -> Result<Generated, tonic::Status> {
    let mut stream = client.generate(request).await?.into_inner();
    let mut g = Generated::default();
    while let Some(msg) = stream.message().await? {
        g.messages += 1;
        if g.messages == 1 {
            g.reused_tokens = msg.reused_tokens;
        }
        g.tokens.extend(&msg.tokens);
        g.text.push_str(&msg.text);
        if msg.finish_reason != 0 {
            g.finish = msg.finish_reason;
            g.reject = msg.reject;
            g.message = msg.message;
            g.preemptions = msg.preemptions;
        }
    }
    Ok(g)
}

/// The cache's figures for the pools of `group`.
pub async fn pool_stats(cache: SocketAddr, group: &str) -> Result<Vec<pb::PoolStats>, Error> {
    let mut c = cache_client(cache).await?;
    let r = c
        .get_stats(pb::GetStatsRequest {
            pool_group: group.to_string(),
        })
        .await?
        .into_inner();
    Ok(r.pools
        .into_iter()
        .filter(|p| p.pool_group == group)
        .collect())
}

/// Waits until every pool of `group` has nothing in use and nothing fenced.
pub async fn wait_whole(
    cache: SocketAddr,
    group: &str,
    within: Duration,
) -> Result<Vec<pb::PoolStats>, Error> {
    let deadline = tokio::time::Instant::now() + within;
    loop {
        let pools = pool_stats(cache, group).await?;
        let whole = !pools.is_empty() && pools.iter().all(|p| p.in_use == 0 && p.fenced == 0);
        if whole || tokio::time::Instant::now() > deadline {
            return Ok(pools);
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The pool group the scheduler registers for its first worker.
pub const GROUP: &str = "seeded-0/replica-0";
