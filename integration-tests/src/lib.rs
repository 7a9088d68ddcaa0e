//! kvlease whole-system tests: real cache, worker and scheduler services on
//! loopback ports, started in-process from their libraries' `run`.
//!
//! # Layout
//!
//! - [`Service`]: one running server (address, metrics address, shutdown,
//!   join), from the one cluster builder (`kvlease::cluster`).
//! - [`start_cache`], [`start_worker`], [`start_scheduler`]: start one
//!   service on `127.0.0.1:0` (with a metrics endpoint) and wait until it
//!   serves, or return its start-up error; [`SmallCluster`]: the three
//!   together.
//! - [`small_worker`]: a small, fast CPU model for tests.
//! - [`collect`]: runs a `Generate` call to its end.
//! - [`pool_stats`], [`wait_whole`]: the cache's figures for one pool group.
//! - [`tap`]: recording pass-through proxies of the cache and a worker.
//! - [`secure`]: an mTLS cluster and channels that present any principal's certificate.
//! - [`gateway`]: the HTTP front on a loopback port in front of a scheduler,
//!   and a ChatML tokenizer for its chat requests.
//!
//! The tests themselves are under `tests/`, the whole-system benches under
//! `benches/`.

use std::net::SocketAddr;
use std::time::Duration;

use kvlease::cluster;
use kvlease_proto::v1 as pb;
use kvlease_proto::v1::cache_service_client::CacheServiceClient;
use kvlease_proto::v1::scheduler_client::SchedulerClient;
use kvlease_proto::v1::worker_service_client::WorkerServiceClient;
use kvlease_runtime::serve::Listeners;
use tokio::net::TcpListener;
use tonic::transport::Channel;

pub mod gateway;
pub mod otlp;
pub mod secure;
pub mod tap;

pub use kvlease::cluster::Service;

/// What can go wrong while setting up a cluster.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("cannot bind a loopback port: {0}")]
    Bind(#[from] std::io::Error),
    #[error(transparent)]
    Listen(#[from] kvlease_runtime::Error),
    #[error("cannot connect to {addr}: {message}")]
    Connect { addr: SocketAddr, message: String },
    #[error(transparent)]
    Cluster(#[from] kvlease::Error),
    #[error("rpc failed: {0}")]
    Rpc(#[from] tonic::Status),
    #[error("gateway: {0}")]
    Gateway(String),
    #[error("metrics: {0}")]
    Metrics(String),
}

/// How long a test service may take to start (a scheduler's warm-up included).
pub(crate) const READY_WITHIN: Duration = Duration::from_secs(60);

/// A gRPC and a metrics listener on `127.0.0.1:0`, bound as the services
/// bind theirs.
async fn loopback() -> Result<Listeners, Error> {
    let any = SocketAddr::from(([127, 0, 0, 1], 0));
    Ok(Listeners::bind(any, Some(any)).await?)
}

/// The request field an INVALID_ARGUMENT status names in its metadata.
pub fn invalid_field(status: &tonic::Status) -> Option<&str> {
    status
        .metadata()
        .get(kvlease_proto::INVALID_FIELD_METADATA)
        .and_then(|v| v.to_str().ok())
}

/// The Prometheus endpoint's answer at `addr` (`GET /metrics`): the HTTP
/// header and the body.
pub async fn metrics_page(addr: SocketAddr) -> Result<(String, String), Error> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let late = |_| Error::Metrics(format!("{addr} did not answer within 5 s"));
    let mut stream =
        tokio::time::timeout(Duration::from_secs(5), tokio::net::TcpStream::connect(addr))
            .await
            .map_err(late)??;
    stream
        .write_all(b"GET /metrics HTTP/1.0\r\nHost: localhost\r\n\r\n")
        .await?;
    let mut response = String::new();
    tokio::time::timeout(Duration::from_secs(5), stream.read_to_string(&mut response))
        .await
        .map_err(late)??;
    let (head, body) = response
        .split_once("\r\n\r\n")
        .ok_or_else(|| Error::Metrics(format!("{addr}: no HTTP header end")))?;
    Ok((head.to_owned(), body.to_owned()))
}

/// The value of the unlabelled series `name` on `service`'s metrics
/// endpoint (0 when it has none yet).
pub async fn metric_value(service: &Service, name: &str) -> Result<f64, Error> {
    metric_sum(service, name, |series| series == name).await
}

/// The sum of every series of the metric family `name` (whatever its
/// labels) on `service`'s metrics endpoint (0 when it has none yet).
pub async fn metric_total(service: &Service, name: &str) -> Result<f64, Error> {
    let labelled = format!("{name}{{");
    metric_sum(service, name, |series| {
        series == name || series.starts_with(&labelled)
    })
    .await
}

/// The sum of the series of `service`'s metrics page that `pick` takes.
async fn metric_sum(
    service: &Service,
    name: &str,
    pick: impl Fn(&str) -> bool,
) -> Result<f64, Error> {
    let addr = service
        .metrics
        .ok_or_else(|| Error::Metrics(format!("{} has no metrics endpoint", service.name)))?;
    let (_, body) = metrics_page(addr).await?;
    let mut sum = 0.0;
    for line in body.lines().filter(|l| !l.starts_with('#')) {
        let Some((series, v)) = line.rsplit_once(' ') else {
            continue;
        };
        if pick(series) {
            sum += v
                .trim()
                .parse::<f64>()
                .map_err(|e| Error::Metrics(format!("{name}: {v}: {e}")))?;
        }
    }
    Ok(sum)
}

/// Starts a cache service (with a metrics endpoint).
pub async fn start_cache(config: cache_svc::Config) -> Result<Service, Error> {
    Ok(cluster::start_cache(loopback().await?, config).await?)
}

/// Starts a cache service on a given address (a restart on the same port).
pub async fn start_cache_on(addr: SocketAddr) -> Result<Service, Error> {
    let listeners = Listeners::bind(addr, None).await?;
    Ok(cluster::start_cache(listeners, cache_svc::Config::default()).await?)
}

/// Starts a worker (with a metrics endpoint) and waits until it serves.
pub async fn start_worker(config: worker_svc::Config) -> Result<Service, Error> {
    Ok(cluster::start_worker(loopback().await?, config, READY_WITHIN).await?)
}

/// Starts a CPU worker of `config`'s model that serves `tokenizer` instead
/// of the model's own (replicas that disagree, large tokenizers).
pub async fn start_worker_with_tokenizer(
    config: worker_svc::Config,
    tokenizer: kvlease_tokenizer::Tokenizer,
) -> Result<Service, Error> {
    Ok(cluster::Service::start(
        "worker",
        worker_svc::SERVICE,
        loopback().await?,
        READY_WITHIN,
        &config.security.clone(),
        move |l, stop| async move {
            worker_svc::run_with_tokenizer(l, config, tokenizer, stop)
                .await
                .map_err(|e| kvlease::Error::Service {
                    service: "worker",
                    message: e.to_string(),
                })
        },
    )
    .await?)
}

/// A cache of `cache`, a CPU worker of `worker` and a scheduler over them
/// that takes contexts of up to 256 tokens and 64 new ones (what the small
/// worker's 20-block pools hold).
pub async fn start_small_cluster(
    cache: cache_svc::Config,
    worker: worker_svc::Config,
) -> Result<(Service, Service, Service), Error> {
    let cache = start_cache(cache).await?;
    let worker = start_worker(worker).await?;
    let config = scheduler_svc::Config {
        max_context: 256,
        max_tokens: 64,
        ..scheduler_svc::Config::default()
    };
    let scheduler = start_scheduler(config, &cache.url(), &[worker.url()], READY_WITHIN).await?;
    Ok((cache, worker, scheduler))
}

/// [`start_small_cluster`] with the default cache and a small worker that
/// keeps `host_blocks` host-tier blocks per pool.
pub async fn start_tiered_cluster(host_blocks: u32) -> Result<(Service, Service, Service), Error> {
    let worker = worker_svc::Config {
        host_blocks,
        ..small_worker()
    };
    start_small_cluster(cache_svc::Config::default(), worker).await
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

/// Starts a scheduler (with a metrics endpoint) over `cache` and `workers`
/// and waits until it serves; a start-up failure is returned as the
/// cluster's error.
pub async fn start_scheduler(
    mut config: scheduler_svc::Config,
    cache: &str,
    workers: &[String],
    ready_within: Duration,
) -> Result<Service, Error> {
    config.cache_addr = cache.to_string();
    config.worker_addrs = workers.to_vec();
    Ok(cluster::start_scheduler(loopback().await?, config, ready_within).await?)
}

/// A default cache, one [`small_worker`] and a scheduler over them.
#[derive(Debug)]
pub struct SmallCluster {
    pub cache: Service,
    pub worker: Service,
    pub scheduler: Service,
}

impl SmallCluster {
    /// Starts the three with the scheduler's `config`.
    pub async fn start(config: scheduler_svc::Config) -> Result<Self, Error> {
        let cache = start_cache(cache_svc::Config::default()).await?;
        let worker = start_worker(small_worker()).await?;
        let scheduler =
            start_scheduler(config, &cache.url(), &[worker.url()], READY_WITHIN).await?;
        Ok(Self {
            cache,
            worker,
            scheduler,
        })
    }

    /// A client of the scheduler.
    pub async fn client(&self) -> Result<SchedulerClient<Channel>, Error> {
        scheduler_client(self.scheduler.addr).await
    }

    /// Stops the scheduler, then the worker and the cache.
    pub async fn stop(self) -> Result<(), Error> {
        self.scheduler.stop().await?;
        self.worker.stop().await?;
        self.cache.stop().await?;
        Ok(())
    }
}

/// A scheduler that over-subscribes a small cluster's pool on purpose
/// (the n and beam over-subscription runs): pipelined, bounded
/// preemptions, `on_exhausted` for what cannot grow.
pub fn over_subscribed_config(
    on_exhausted: scheduler_svc::policy::OnExhausted,
) -> scheduler_svc::Config {
    scheduler_svc::Config {
        on_exhausted,
        overlap: true,
        max_preemptions: 3,
        max_seqs: 32,
        max_tokens_per_step: 192,
        max_tokens: 64,
        max_context: 256,
        ..scheduler_svc::Config::default()
    }
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
    /// The prompt's length as the scheduler encoded it (first message).
    pub prompt_tokens: u32,
    /// Prompt tokens kept under the request's retention hint (first
    /// message).
    pub retained_tokens: u32,
}

impl Generated {
    pub fn finish_reason(&self) -> pb::FinishReason {
        pb::FinishReason::try_from(self.finish).unwrap_or(pb::FinishReason::Unspecified)
    }
}

/// Runs `request` to the end of its stream.
pub async fn collect(
    client: &mut SchedulerClient<Channel>,
    request: impl tonic::IntoRequest<pb::GenerateRequest>,
) -> Result<Generated, tonic::Status> {
    let mut stream = client.generate(request).await?.into_inner();
    let mut g = Generated::default();
    while let Some(msg) = stream.message().await? {
        g.messages += 1;
        if g.messages == 1 {
            g.reused_tokens = msg.reused_tokens;
            g.prompt_tokens = msg.prompt_tokens;
            g.retained_tokens = msg.retained_tokens;
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

/// Generates `max_tokens` greedy tokens after `tokens`, asserts that the
/// request ends `LENGTH`, then waits for [`GROUP`]'s pools to be whole
/// again: its release and the CompleteStep after it are through, so its
/// blocks are cached and the tier copies its allocations caused are
/// published.
pub async fn generate_settled(
    client: &mut SchedulerClient<Channel>,
    cache: SocketAddr,
    tokens: Vec<u32>,
    max_tokens: u32,
) -> Generated {
    let request = pb::GenerateRequest {
        tokens,
        max_tokens,
        ..Default::default()
    };
    let out = match collect(client, request).await {
        Ok(out) => out,
        Err(status) => panic!("generate failed: {status:?}"),
    };
    assert_eq!(
        out.finish_reason(),
        pb::FinishReason::Length,
        "{}",
        out.message
    );
    if let Err(e) = wait_whole(cache, GROUP, Duration::from_secs(60)).await {
        panic!("pools: {e}");
    }
    out
}

/// Opens a session of another holder (`holder`, a 60 s TTL) and leases one
/// sequence of `num_tokens` in [`GROUP`], granted: blocks a scheduler
/// starting next finds held. Returns the session (id, epoch).
pub async fn hold_blocks(
    client: &mut CacheServiceClient<Channel>,
    holder: &str,
    num_tokens: u32,
) -> Result<(u64, u64), Error> {
    let s = client
        .open_session(pb::OpenSessionRequest {
            holder: holder.into(),
            ttl_ms: 60_000,
        })
        .await?
        .into_inner();
    let lease = client
        .lease(pb::LeaseRequest {
            session_id: s.session_id,
            epoch: s.epoch,
            step: 1,
            atomic: true,
            warmup: false,
            sequences: vec![pb::SequenceSpec {
                seq_id: 1,
                pool_group: GROUP.into(),
                num_tokens,
                ..Default::default()
            }],
        })
        .await?
        .into_inner();
    assert!(
        matches!(
            lease.outcomes.first().and_then(|o| o.outcome.as_ref()),
            Some(pb::sequence_outcome::Outcome::Grant(_))
        ),
        "{lease:?}"
    );
    Ok((s.session_id, s.epoch))
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

/// Asserts that the cache still answers, that `group`'s pools become whole
/// within `within` (nothing in use, nothing fenced, every block free or
/// cached) and that the leak audit reclaims nothing.
pub async fn assert_cache_sound(
    cache: SocketAddr,
    group: &str,
    within: Duration,
) -> Result<(), Error> {
    let pools = wait_whole(cache, group, within).await?;
    assert!(!pools.is_empty(), "no pools for {group}");
    for p in &pools {
        assert_eq!(
            (p.in_use, p.fenced),
            (0, 0),
            "pool {} not whole: {p:?}",
            p.pool_id
        );
        assert_eq!(p.free + p.cached_evictable, p.total, "{p:?}");
    }
    let audit = cache_client(cache)
        .await?
        .audit(pb::AuditRequest {})
        .await?
        .into_inner();
    assert!(audit.reclaimed.is_empty(), "{:?}", audit.reclaimed);
    assert!(audit.blocks_checked > 0);
    Ok(())
}

/// The pool group the scheduler registers for its first worker.
pub const GROUP: &str = "seeded-0/replica-0";
