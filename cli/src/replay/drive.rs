//! Drives a real cache service (started in-process on a loopback port, spoken
//! to over gRPC) through a block trace the way a scheduler does: request i is
//! leased at step i + 1 with its prompt's tokens, that step is reported
//! complete (publishing its blocks), and request i + 1 - concurrency is
//! released.
//!
//! One trace hash id is one block: its tokens are [`block_tokens`] of the id,
//! so equal ids give equal blocks. Each prompt ends with one token of its own,
//! so every full block can be reused (the cache reuses only the blocks before
//! a prompt's last token) and that token's block is never shared.

use std::net::SocketAddr;

use cache_svc::eviction::PolicyKind;
use kvlease_proto::v1 as pb;
use kvlease_proto::v1::cache_service_client::CacheServiceClient;
use tokio::sync::oneshot;
use tonic::transport::Channel;

use crate::error::{Error, Result};
use crate::workload::block_tokens;

/// Tokens per block in the replayed pool: small, so requests stay small on
/// the wire; the trace's blocks are the unit either way.
pub const REPLAY_BLOCK_TOKENS: u32 = 4;

const GROUP: &str = "replay";

/// What a replay through the service counted.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Replayed {
    /// Blocks reused (`reused_tokens` of the grants, in blocks).
    pub hits: u64,
    /// Blocks of every request, refused ones too.
    pub lookups: u64,
    /// Requests rejected.
    pub refused: u64,
    /// The pool's eviction counter at the end.
    pub evictions: u64,
}

impl Replayed {
    /// Hits over lookups (0 with no lookups).
    pub fn hit_rate(&self) -> f64 {
        if self.lookups == 0 {
            0.0
        } else {
            self.hits as f64 / self.lookups as f64
        }
    }
}

/// A cache service running in this process on a loopback port.
#[derive(Debug)]
pub struct LocalCache {
    /// Where it listens.
    pub addr: SocketAddr,
    stop: Option<oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<cache_svc::Result<()>>,
}

impl LocalCache {
    /// Starts a cache service with `config` on `127.0.0.1:0`.
    pub async fn start(config: cache_svc::Config) -> Result<Self> {
        let any: SocketAddr = ([127, 0, 0, 1], 0).into();
        let listener = tokio::net::TcpListener::bind(any)
            .await
            .map_err(|source| Error::Bind { addr: any, source })?;
        let addr = listener
            .local_addr()
            .map_err(|source| Error::Bind { addr: any, source })?;
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(cache_svc::run(listener, config, async {
            let _ = stopped.await;
        }));
        Ok(Self {
            addr,
            stop: Some(stop),
            task,
        })
    }

    /// A client of it.
    pub async fn client(&self) -> Result<CacheServiceClient<Channel>> {
        let uri = format!("http://{}", self.addr);
        let channel = Channel::from_shared(uri.clone())
            .map_err(|e| Error::Address {
                addr: uri.clone(),
                message: e.to_string(),
            })?
            .connect()
            .await
            .map_err(|e| Error::Connect {
                addr: uri,
                message: e.to_string(),
            })?;
        Ok(CacheServiceClient::new(channel))
    }

    /// Stops it and waits for it to end.
    pub async fn stop(mut self) -> Result<()> {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        match (&mut self.task).await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(Error::Service {
                service: "cache",
                message: e.to_string(),
            }),
            Err(e) => Err(Error::Service {
                service: "cache",
                message: e.to_string(),
            }),
        }
    }
}

/// The prompt of request `index`: its blocks, then one token of its own.
pub fn prompt_tokens(index: usize, hash_ids: &[u64]) -> Vec<u32> {
    let mut tokens: Vec<u32> = hash_ids
        .iter()
        .flat_map(|&h| block_tokens(h, REPLAY_BLOCK_TOKENS))
        .collect();
    tokens.extend(block_tokens((1 << 62) | index as u64, 1));
    tokens
}

/// A cache service config for a replay under `policy`.
pub fn service_config(policy: PolicyKind) -> cache_svc::Config {
    let mut config = cache_svc::Config::default();
    config.eviction_policy = policy;
    // a long replay must not outlive its session between calls
    config.session_ttl_ms = config.max_ttl_ms;
    // A trace names whole blocks only; each replayed prompt ends with one
    // token of its own, which partial-block reuse would keep (and never hit)
    // in a block of its own, so the replay would no longer be the block
    // stream the reference simulators replay.
    config.partial_reuse = false;
    config
}

/// Replays `hash_ids` (one prompt per request) through `client`'s service
/// in a fresh pool group `group` of `capacity` blocks.
pub async fn replay(
    client: &mut CacheServiceClient<Channel>,
    group: &str,
    hash_ids: &[Vec<u64>],
    capacity: u32,
    concurrency: usize,
) -> Result<Replayed> {
    replay_hinted(client, group, hash_ids, &[], capacity, concurrency).await
}

/// [`replay`] with request `i` hinted to retain `retain[i]` leading tokens
/// (see [`replay_hint`]).
pub async fn replay_hinted(
    client: &mut CacheServiceClient<Channel>,
    group: &str,
    hash_ids: &[Vec<u64>],
    retain: &[Option<u32>],
    capacity: u32,
    concurrency: usize,
) -> Result<Replayed> {
    let concurrency = concurrency.max(1);
    client
        .register_pool(pb::RegisterPoolRequest {
            pool_group: group.to_owned(),
            tokens_per_block: REPLAY_BLOCK_TOKENS.into(),
            pools: vec![pb::PoolSpec {
                host_blocks: 0,
                window: 0,
                num_blocks: capacity.into(),
                ..Default::default()
            }],
            ..Default::default()
        })
        .await
        .map_err(|s| Error::rpc("RegisterPool", s))?;
    let session = client
        .open_session(pb::OpenSessionRequest {
            holder: "cache-replay".into(),
            ttl_ms: 0,
        })
        .await
        .map_err(|s| Error::rpc("OpenSession", s))?
        .into_inner();
    let (session_id, epoch) = (session.session_id, session.epoch);
    let mut out = Replayed::default();
    let release = |client: &mut CacheServiceClient<Channel>, seq: usize| {
        let mut client = client.clone();
        async move {
            client
                .release(pb::ReleaseRequest {
                    session_id,
                    epoch,
                    seq_ids: vec![seq as u64],
                    fence_step: None,
                    traceparents: Vec::new(),
                    discard_unwritten: false,
                })
                .await
                .map_err(|s| Error::rpc("Release", s))
        }
    };
    for (i, ids) in hash_ids.iter().enumerate() {
        let step = i as u64 + 1;
        let response = client
            .lease(pb::LeaseRequest {
                session_id,
                epoch,
                step,
                atomic: false,
                sequences: vec![pb::SequenceSpec {
                    seq_id: i as u64,
                    pool_group: group.to_owned(),
                    prompt_tokens: prompt_tokens(i, ids),
                    max_new_tokens: 1,
                    retain: replay_hint(retain, i).map(|(tokens, priority, ttl)| {
                        pb::RetentionHint {
                            tokens,
                            priority: priority.into(),
                            ttl_ms: ttl.as_millis() as u32,
                            tenant: String::new(),
                        }
                    }),
                    ..pb::SequenceSpec::default()
                }],
                warmup: false,
            })
            .await
            .map_err(|s| Error::rpc("Lease", s))?
            .into_inner();
        out.lookups += ids.len() as u64;
        match response.outcomes.first().and_then(|o| o.outcome.as_ref()) {
            Some(pb::sequence_outcome::Outcome::Grant(g)) => {
                out.hits += u64::from(g.reused_tokens / REPLAY_BLOCK_TOKENS);
            }
            _ => out.refused += 1,
        }
        client
            .complete_step(pb::CompleteStepRequest {
                session_id,
                epoch,
                step,
            })
            .await
            .map_err(|s| Error::rpc("CompleteStep", s))?;
        if i + 1 >= concurrency {
            release(client, i + 1 - concurrency).await?;
        }
    }
    for i in hash_ids.len().saturating_sub(concurrency - 1)..hash_ids.len() {
        release(client, i).await?;
    }
    let stats = client
        .get_stats(pb::GetStatsRequest {
            pool_group: group.to_owned(),
        })
        .await
        .map_err(|s| Error::rpc("GetStats", s))?
        .into_inner();
    out.evictions = stats.pools.iter().map(|p| p.evictions).sum();
    client
        .close_session(pb::CloseSessionRequest { session_id, epoch })
        .await
        .map_err(|s| Error::rpc("CloseSession", s))?;
    Ok(out)
}

/// Replays `hash_ids` through a fresh in-process cache service whose pools
/// evict with `policy`.
pub async fn replay_fresh(
    hash_ids: &[Vec<u64>],
    capacity: u32,
    policy: PolicyKind,
    concurrency: usize,
) -> Result<Replayed> {
    replay_fresh_with(hash_ids, capacity, service_config(policy), concurrency).await
}

/// Replays `hash_ids` through a fresh in-process cache service with
/// `config`.
pub async fn replay_fresh_with(
    hash_ids: &[Vec<u64>],
    capacity: u32,
    config: cache_svc::Config,
    concurrency: usize,
) -> Result<Replayed> {
    replay_fresh_hinted(hash_ids, &[], capacity, config, concurrency).await
}

/// [`replay_fresh_with`] with request `i` hinted to retain `retain[i]`
/// leading tokens (see [`replay_hint`]).
pub async fn replay_fresh_hinted(
    hash_ids: &[Vec<u64>],
    retain: &[Option<u32>],
    capacity: u32,
    config: cache_svc::Config,
    concurrency: usize,
) -> Result<Replayed> {
    let service = LocalCache::start(config).await?;
    let mut client = service.client().await?;
    let out = replay_hinted(&mut client, GROUP, hash_ids, retain, capacity, concurrency).await;
    service.stop().await?;
    out
}

/// Replays `hash_ids` through a [`cache_svc::Cache`] in this thread (the
/// service's core with `config`, no gRPC, no service task): the same calls
/// in the same order as [`replay`], so the same hits and evictions, in a
/// fraction of the time (`cache-replay --in-process`; `cache_replay.rs`
/// holds the two equal).
pub fn replay_core(
    hash_ids: &[Vec<u64>],
    capacity: u32,
    config: &cache_svc::Config,
    concurrency: usize,
) -> Result<Replayed> {
    replay_core_hinted(hash_ids, &[], capacity, config, concurrency)
}

/// The retention hint a replay gives request `i` of `retain` (tokens; none
/// past its end): priority [`REPLAY_RETAIN_PRIORITY`], TTL the longest the
/// cache takes ([`cache_svc::lease::MAX_RETAIN_TTL`]: the replay has no
/// clock, every call happens at one instant), the session's own quota.
pub fn replay_hint(retain: &[Option<u32>], i: usize) -> Option<(u32, u8, std::time::Duration)> {
    let tokens = retain.get(i).copied().flatten().filter(|&t| t > 0)?;
    Some((
        tokens,
        REPLAY_RETAIN_PRIORITY,
        cache_svc::lease::MAX_RETAIN_TTL,
    ))
}

/// Priority of a replayed retention hint.
pub const REPLAY_RETAIN_PRIORITY: u8 = 50;

/// [`replay_core`] with request `i` hinted to retain `retain[i]` leading
/// tokens (see [`replay_hint`]).
pub fn replay_core_hinted(
    hash_ids: &[Vec<u64>],
    retain: &[Option<u32>],
    capacity: u32,
    config: &cache_svc::Config,
    concurrency: usize,
) -> Result<Replayed> {
    use cache_svc::lease::{Prompt, SeqSpec};
    use cache_svc::{Batch, SeqId, Step};

    let failed = |call: &'static str| {
        move |e: cache_svc::Error| Error::Service {
            service: "cache",
            message: format!("{call}: {e}"),
        }
    };
    let concurrency = concurrency.max(1);
    let mut cache = cache_svc::Cache::new(config.cache_config());
    let now = std::time::Instant::now();
    cache
        .register_pool(GROUP, REPLAY_BLOCK_TOKENS, &[(0, capacity)])
        .map_err(failed("RegisterPool"))?;
    let opened = cache
        .open_session("cache-replay", None, now)
        .map_err(failed("OpenSession"))?;
    let (session, epoch) = (opened.session_id, opened.epoch);
    let mut out = Replayed::default();
    for (i, ids) in hash_ids.iter().enumerate() {
        let step = Step(i as u64 + 1);
        let mut spec = SeqSpec::new(
            SeqId(i as u64),
            GROUP,
            Prompt::Tokens(prompt_tokens(i, ids)),
        );
        spec.max_new_tokens = 1;
        spec.retain =
            replay_hint(retain, i).map(|(tokens, priority, ttl)| cache_svc::lease::Retain {
                tokens,
                priority,
                ttl,
                tenant: String::new(),
            });
        let batch = Batch {
            step,
            atomic: false,
            warmup: false,
        };
        let outcomes = cache
            .lease(session, epoch, batch, &[spec], now)
            .map_err(failed("Lease"))?;
        out.lookups += ids.len() as u64;
        match outcomes.first().and_then(|o| o.grant()) {
            Some(g) => out.hits += u64::from(g.reused_tokens / REPLAY_BLOCK_TOKENS),
            None => out.refused += 1,
        }
        cache
            .complete_step(session, epoch, step, now)
            .map_err(failed("CompleteStep"))?;
        if i + 1 >= concurrency {
            let seq = SeqId((i + 1 - concurrency) as u64);
            cache
                .release(session, epoch, &[seq], None, now)
                .map_err(failed("Release"))?;
        }
    }
    for i in hash_ids.len().saturating_sub(concurrency - 1)..hash_ids.len() {
        cache
            .release(session, epoch, &[SeqId(i as u64)], None, now)
            .map_err(failed("Release"))?;
    }
    let stats = cache.stats(Some(GROUP)).map_err(failed("GetStats"))?;
    out.evictions = stats.pools.iter().map(|p| p.counters.evictions).sum();
    Ok(out)
}
