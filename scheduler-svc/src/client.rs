//! gRPC clients of the cache service and the workers: build the requests
//! (`convert` turns messages into the domain types of `domain.rs` and back)
//! and classify call failures (unreachable, lost session, other) into
//! [`Error`].

use std::sync::Arc;
use std::time::Duration;

use kvlease_auth::{Security, ServiceKind};
use kvlease_proto::v1 as pb;
use kvlease_proto::v1::cache_service_client::CacheServiceClient;
use kvlease_proto::v1::worker_service_client::WorkerServiceClient;
use kvlease_telemetry::{TracedChannel, traced};
use kvlease_tokenizer::{Specials, Tokenizer, TokenizerKind, TokenizerParts};
use tonic::transport::Channel;

use crate::convert::{self, match_results, outcomes, release_counts, sequence_spec};
use crate::domain::{
    Epoch, ExtendSpec, ForwardAnswer, ForwardItem, LeaseMode, LeaseSpec, Outcome, PoolGeometry,
    SeqId, SessionId, Step, StepCall, TierCopy, WorkerTiers,
};
use crate::error::{Error, Result};
use crate::session::{Session, SessionState};
use crate::step::MatchWanted;
use crate::traces::ChunkTrace;

fn endpoint(
    peer: ServiceKind,
    addr: &str,
    security: &Security,
    timeout: Option<Duration>,
    keepalive: Option<Duration>,
) -> Result<Channel> {
    let mut ep = security
        .endpoint(addr, Some(peer))
        .map_err(|message| Error::Address {
            peer: peer.name(),
            addr: addr.to_string(),
            message,
        })?
        .connect_timeout(Duration::from_secs(2))
        .tcp_nodelay(true);
    if let Some(t) = timeout {
        ep = ep.timeout(t);
    }
    if let Some(k) = keepalive {
        // a peer cut off mid-call answers no ping: the call fails within two
        // intervals instead of waiting for TCP to give up (many minutes)
        ep = ep
            .http2_keep_alive_interval(k)
            .keep_alive_timeout(k)
            .keep_alive_while_idle(true);
    }
    Ok(ep.connect_lazy())
}

/// What a [`CacheClient::step`] call answered, per part sent.
#[derive(Debug, Clone)]
pub(crate) struct StepAnswer {
    /// Blocks freed at once and blocks fenced by the release.
    pub released: Option<(u64, u64)>,
    /// One outcome per extend spec, in order (empty without an extend).
    pub extended: Vec<Outcome>,
}

/// One pool's state figures.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct PoolState {
    pub pool_id: u32,
    pub window: u32,
    pub total: u32,
    pub free: u32,
    pub cached_evictable: u32,
    pub in_use: u32,
    pub fenced: u32,
}

/// The cache service client, with the session state (`session.rs`) shared
/// by every clone.
#[derive(Debug, Clone)]
pub(crate) struct CacheClient {
    inner: CacheServiceClient<TracedChannel>,
    state: Arc<SessionState>,
}

impl CacheClient {
    /// A lazily connecting client of `addr` (over mTLS when `security` has TLS
    /// material); every call times out after `timeout`.
    pub(crate) fn new(addr: &str, security: &Security, timeout: Duration) -> Result<Self> {
        let channel = endpoint(ServiceKind::Cache, addr, security, Some(timeout), None)?;
        Ok(Self {
            inner: CacheServiceClient::new(traced(channel)),
            state: Arc::default(),
        })
    }

    /// The session in use.
    pub(crate) fn session(&self) -> Session {
        self.state.session()
    }

    /// What the calls so far say about the cache and the session.
    pub(crate) fn state(&self) -> &SessionState {
        &self.state
    }

    /// Whether the last call reached the cache service.
    pub(crate) fn is_up(&self) -> bool {
        self.state.is_up()
    }

    fn seen<T>(
        &self,
        method: &'static str,
        r: std::result::Result<tonic::Response<T>, tonic::Status>,
    ) -> Result<T> {
        match r {
            Ok(resp) => {
                self.state.saw(Ok(()));
                Ok(resp.into_inner())
            }
            Err(status) => {
                let e = Error::from_cache(method, &status);
                self.state.saw(Err(&e));
                Err(e)
            }
        }
    }

    /// Opens a new session (replacing the one held).
    pub(crate) async fn open_session(&self, holder: &str, ttl_ms: u64) -> Result<Session> {
        let r = self
            .inner
            .clone()
            .open_session(pb::OpenSessionRequest {
                holder: holder.to_string(),
                ttl_ms,
            })
            .await;
        let r = self.seen("OpenSession", r)?;
        let session = Session {
            id: SessionId(r.session_id),
            epoch: Epoch(r.epoch),
            ttl_ms: r.ttl_ms,
            max_batch: r.max_batch,
        };
        self.state.opened(session);
        Ok(session)
    }

    pub(crate) async fn keep_alive(&self) -> Result<u64> {
        let s = self.session();
        let r = self
            .inner
            .clone()
            .keep_alive(pb::KeepAliveRequest {
                session_id: s.id.get(),
                epoch: s.epoch.get(),
            })
            .await;
        Ok(self.seen("KeepAlive", r)?.ttl_ms)
    }

    pub(crate) async fn close_session(&self) -> Result<()> {
        let s = self.session();
        let r = self
            .inner
            .clone()
            .close_session(pb::CloseSessionRequest {
                session_id: s.id.get(),
                epoch: s.epoch.get(),
            })
            .await;
        self.seen("CloseSession", r).map(|_| ())
    }

    /// Registers a group's pools; returns them with their ids, in the order
    /// of `pools` (window, blocks, host-tier blocks), with the worker's
    /// incarnation and disk tiers (`tiers.disks` in the order of `pools`;
    /// default: none).
    pub(crate) async fn register_pool(
        &self,
        group: &str,
        tokens_per_block: u32,
        pools: &[(u32, u32, u32)],
        tiers: &WorkerTiers,
        peer: &crate::domain::PeerProfile,
    ) -> Result<Vec<PoolGeometry>> {
        let req = pb::RegisterPoolRequest {
            peer_key: peer.key.clone(),
            pool_group: group.to_string(),
            tokens_per_block: tokens_per_block.into(),
            pools: pools
                .iter()
                .enumerate()
                .map(|(i, &(window, num_blocks, host_blocks))| {
                    let (disk_blocks, held) = tiers
                        .disks
                        .get(i)
                        .map_or((0, &[][..]), |(n, held)| (*n, held.as_slice()));
                    pb::PoolSpec {
                        bytes_per_block: peer.block_bytes.get(i).copied().unwrap_or(0),
                        host_blocks: host_blocks.into(),
                        window: window.into(),
                        num_blocks: num_blocks.into(),
                        disk_blocks: disk_blocks.into(),
                        disk_held: held
                            .iter()
                            .map(|&(block, hash, parent)| pb::DiskBlock {
                                block,
                                hash,
                                parent,
                            })
                            .collect(),
                    }
                })
                .collect(),
            worker_incarnation: tiers.incarnation,
            // the session that drives the worker: its own leases do not hold
            // back the worker's new incarnation, another open session's do
            session_id: self.session().id.get(),
        };
        let r = self.inner.clone().register_pool(req).await;
        let r = self.seen("RegisterPool", r)?;
        Ok(r.pools
            .into_iter()
            .map(|p| PoolGeometry {
                pool_id: p.pool_id,
                window: p.window,
                num_blocks: p.num_blocks,
                host_blocks: p.host_blocks,
            })
            .collect())
    }

    /// One batched Lease of `step`, taken as `mode` says; one outcome per
    /// spec, in order. `traces[i]` is the `traceparent` of spec i's request
    /// (empty: none).
    pub(crate) async fn lease(
        &self,
        step: Step,
        mode: LeaseMode,
        specs: &[LeaseSpec],
        traces: &[String],
    ) -> Result<Vec<Outcome>> {
        let req = convert::lease_request(self.session(), step, mode, specs, traces);
        let r = self.inner.clone().lease(req).await;
        let r = self.seen("Lease", r)?;
        outcomes("Lease", r.outcomes, specs.iter().map(|s| s.seq_id))
    }

    /// For each wanted request, the context tokens a lease would reuse now in
    /// each of `groups` (in order): the cache's read-only `Match`.
    pub(crate) async fn match_prefixes(
        &self,
        groups: &[String],
        wanted: &[MatchWanted],
    ) -> Result<Vec<Vec<(u32, u32)>>> {
        let s = self.session();
        let req = pb::MatchRequest {
            session_id: s.id.get(),
            epoch: s.epoch.get(),
            pool_groups: groups.to_vec(),
            prompts: wanted
                .iter()
                .map(|w| pb::MatchPrompt {
                    prompt_tokens: w.context.clone(),
                    cache_salt: w.cache_salt.clone(),
                })
                .collect(),
        };
        let r = self.inner.clone().r#match(req).await;
        let r = self.seen("Match", r)?;
        match_results(r.results, wanted.len(), groups.len())
    }

    /// One batched Extend of `step`; one outcome per spec, in order;
    /// `traces` as for [`CacheClient::lease`].
    pub(crate) async fn extend(
        &self,
        step: Step,
        specs: &[ExtendSpec],
        traces: &[String],
    ) -> Result<Vec<Outcome>> {
        let req = convert::extend_request(self.session(), step, specs, traces);
        let r = self.inner.clone().extend(req).await;
        let r = self.seen("Extend", r)?;
        outcomes("Extend", r.outcomes, specs.iter().map(|s| s.seq_id))
    }

    /// Extends sequences by a number of tokens whose ids are not known
    /// (warm-up), all or nothing.
    pub(crate) async fn extend_by(
        &self,
        step: Step,
        items: &[(SeqId, u32)],
    ) -> Result<Vec<Outcome>> {
        let req = convert::extend_by_request(self.session(), step, items);
        let r = self.inner.clone().extend(req).await;
        let r = self.seen("Extend", r)?;
        outcomes("Extend", r.outcomes, items.iter().map(|i| i.0))
    }

    /// Releases sequences, fenced at `fence_step` when given; `traces` as for
    /// [`CacheClient::lease`]. Returns the blocks freed now and the blocks
    /// fenced.
    pub(crate) async fn release(
        &self,
        seq_ids: &[SeqId],
        fence_step: Option<Step>,
        discard_unwritten: bool,
        traces: &[String],
    ) -> Result<(u64, u64)> {
        let req = convert::release_request(
            self.session(),
            seq_ids,
            fence_step,
            discard_unwritten,
            traces,
        );
        let r = self.inner.clone().release(req).await;
        let r = self.seen("Release", r)?;
        Ok(release_counts(&r))
    }

    /// A step's release, completion and extends in one `Step` call (each
    /// part optional, applied in that order). Returns the blocks the release
    /// freed and fenced, and one extend outcome per spec. The request is
    /// built now and the call owns it, so the step loop can let it run while
    /// it waits for a forward pass.
    pub(crate) fn step(
        &self,
        call: StepCall<'_>,
    ) -> impl std::future::Future<Output = Result<StepAnswer>> + Send + 'static {
        let req = convert::step_request(self.session(), &call);
        let release = call.release.is_some();
        let complete = call.complete_step.is_some();
        let extended: Option<Vec<SeqId>> = call
            .extend
            .map(|e| e.specs.iter().map(|s| s.seq_id).collect());
        let client = self.clone();
        async move {
            let r = client.inner.clone().step(req).await;
            let r = client.seen("Step", r)?;
            let missing = |part: &str| Error::Protocol {
                peer: "cache",
                message: format!("Step answered without its {part} part"),
            };
            let released = match (release, r.release) {
                (true, Some(r)) => Some(release_counts(&r)),
                (true, None) => return Err(missing("release")),
                (false, _) => None,
            };
            // the loop reads no figure of the completion, only that it was done
            if complete && r.complete.is_none() {
                return Err(missing("complete"));
            }
            let extended = match (extended, r.extend) {
                (Some(ids), Some(x)) => outcomes("Step", x.outcomes, ids.into_iter())?,
                (Some(_), None) => return Err(missing("extend")),
                (None, _) => Vec::new(),
            };
            Ok(StepAnswer { released, extended })
        }
    }

    /// Reports `step` complete; returns the blocks returned to circulation.
    pub(crate) async fn complete_step(&self, step: Step) -> Result<u64> {
        let req = convert::complete_step_request(self.session(), step);
        let r = self.inner.clone().complete_step(req).await;
        Ok(self.seen("CompleteStep", r)?.blocks_returned)
    }

    /// Per shape, per pool: (window, peak blocks, pool blocks), and fits.
    pub(crate) async fn estimate(
        &self,
        shapes: &[LeaseSpec],
    ) -> Result<Vec<(Vec<(u32, u32, u32)>, bool)>> {
        let req = pb::EstimateRequest {
            shapes: shapes
                .iter()
                .map(|s| sequence_spec(s, String::new()))
                .collect(),
        };
        let r = self.inner.clone().estimate(req).await;
        let r = self.seen("Estimate", r)?;
        Ok(r.estimates
            .into_iter()
            .map(|e| {
                (
                    e.pools
                        .iter()
                        .map(|p| (p.window, p.peak_blocks, p.pool_blocks))
                        .collect(),
                    e.fits,
                )
            })
            .collect())
    }

    /// Pool figures of `group` (all groups when empty), as the protocol has them.
    pub(crate) async fn stats_raw(&self, group: &str) -> Result<pb::GetStatsResponse> {
        let r = self
            .inner
            .clone()
            .get_stats(pb::GetStatsRequest {
                pool_group: group.to_string(),
            })
            .await;
        self.seen("GetStats", r)
    }

    /// Pool states of `group`.
    pub(crate) async fn pool_states(&self, group: &str) -> Result<Vec<PoolState>> {
        let r = self.stats_raw(group).await?;
        Ok(r.pools
            .iter()
            .filter(|p| p.pool_group == group)
            .map(|p| PoolState {
                pool_id: p.pool_id,
                window: p.window,
                total: p.total,
                free: p.free,
                cached_evictable: p.cached_evictable,
                in_use: p.in_use,
                fenced: p.fenced,
            })
            .collect())
    }
}

/// What a worker says about itself.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct WorkerDescription {
    pub model_name: String,
    /// The fingerprint of the model's tokenizer.
    pub tokenizer_fingerprint: String,
    pub tokens_per_block: u32,
    /// (window, blocks, host-tier blocks) per pool.
    pub pools: Vec<(u32, u32, u32)>,
    /// The worker's incarnation and disk tiers.
    pub tiers: WorkerTiers,
    /// Peer pull's key (model, tokenizer, KV type, geometry) and each
    /// pool's block bytes; the address is the client's.
    pub peer: crate::domain::PeerProfile,
    pub max_context: u32,
    pub vocab_size: u32,
    pub max_batch_sequences: u32,
    pub max_batch_tokens: u32,
}

/// Peer pull's key of a worker: what its blocks' K/V depends on beyond
/// the pools' geometry (the model and its shape, the tokenizer, the KV
/// element type, tokens per block), in the cache's name alphabet.
fn peer_key(model: &pb::ModelShape, kv_dtype: &str, tokens_per_block: u32) -> String {
    let windows: Vec<String> = model.layer_windows.iter().map(u32::to_string).collect();
    let raw = format!(
        "{}:{}:{}x{}x{}x{}:{}:{}:w{}",
        model.name,
        model.tokenizer_fingerprint,
        model.num_layers,
        model.num_kv_heads,
        model.head_dim,
        model.hidden_size,
        kv_dtype,
        tokens_per_block,
        windows.join("-"),
    );
    // the cache takes 1 to 128 of A-Z a-z 0-9 . _ - / : @ +
    let mut key: String = raw
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || "._-/:@+".contains(c) {
                c
            } else {
                '-'
            }
        })
        .collect();
    if key.len() > 128 {
        // keep it unique: the tail is the shape, dtype and geometry
        key = key.split_off(key.len() - 128);
    }
    key
}

/// A worker client.
#[derive(Debug, Clone)]
pub(crate) struct WorkerClient {
    addr: String,
    inner: WorkerServiceClient<TracedChannel>,
    /// What [`Self::reconnected`] connects again with.
    security: Security,
    keepalive: Duration,
}

impl WorkerClient {
    /// A lazily connecting client of the worker at `addr` (over mTLS when
    /// `security` has TLS material). A forward pass has no time limit (a long
    /// prefill is legitimate), but the connection is pinged every
    /// `keepalive`: a call to a worker that stops answering fails after two.
    pub(crate) fn new(addr: &str, security: &Security, keepalive: Duration) -> Result<Self> {
        let channel = endpoint(ServiceKind::Worker, addr, security, None, Some(keepalive))?;
        Ok(Self {
            addr: addr.to_string(),
            // GetTokenizer answers with a whole tokenizer.json
            inner: WorkerServiceClient::new(traced(channel))
                .max_decoding_message_size(kvlease_tokenizer::MAX_MESSAGE_BYTES),
            security: security.clone(),
            keepalive,
        })
    }

    /// A client of the same worker over a connection of its own, whose
    /// tasks (the channel's buffer, the HTTP/2 connection) run on the
    /// runtime this is called from.
    pub(crate) fn reconnected(&self) -> Result<Self> {
        Self::new(&self.addr, &self.security, self.keepalive)
    }

    pub(crate) fn addr(&self) -> &str {
        &self.addr
    }

    pub(crate) async fn describe(&self) -> Result<WorkerDescription> {
        let r = self
            .inner
            .clone()
            .describe(pb::DescribeRequest {})
            .await
            .map_err(|s| Error::from_worker("Describe", &s))?
            .into_inner();
        let model = r.model.clone().unwrap_or_default();
        let key = peer_key(&model, &r.kv_dtype, r.tokens_per_block);
        Ok(WorkerDescription {
            model_name: model.name,
            tokenizer_fingerprint: model.tokenizer_fingerprint,
            tokens_per_block: r.tokens_per_block,
            pools: r
                .pools
                .iter()
                .map(|p| (p.window, p.num_blocks, p.host_blocks))
                .collect(),
            tiers: WorkerTiers {
                incarnation: r.incarnation,
                disks: r
                    .pools
                    .iter()
                    .map(|p| {
                        let held = p.disk_held.iter().map(|h| (h.block, h.hash, h.parent));
                        (p.disk_blocks, held.collect())
                    })
                    .collect(),
            },
            peer: crate::domain::PeerProfile {
                key,
                block_bytes: r.pools.iter().map(|p| p.bytes_per_block).collect(),
                address: self.addr.clone(),
            },
            max_context: model.max_context,
            vocab_size: model.vocab_size,
            max_batch_sequences: r.max_batch_sequences,
            max_batch_tokens: r.max_batch_tokens,
        })
    }

    /// The model's tokenizer, which must have `fingerprint`; its parts are
    /// checked against the fingerprint they arrive with.
    pub(crate) async fn get_tokenizer(&self, fingerprint: &str) -> Result<Tokenizer> {
        let r = self
            .inner
            .clone()
            .get_tokenizer(pb::GetTokenizerRequest {
                fingerprint: fingerprint.to_string(),
            })
            .await
            .map_err(|s| Error::from_worker("GetTokenizer", &s))?
            .into_inner();
        let bad = |message: String| Error::Protocol {
            peer: "worker",
            message: format!("GetTokenizer from {}: {message}", self.addr),
        };
        let kind = TokenizerKind::parse(&r.kind)
            .ok_or_else(|| bad(format!("unknown tokenizer kind {:?}", r.kind)))?;
        let text = |s: String| (!s.is_empty()).then_some(s);
        let parts = TokenizerParts {
            kind,
            tokenizer_json: r.tokenizer_json,
            chat_template: text(r.chat_template),
            specials: Specials::new(
                r.bos_id,
                text(r.bos_token),
                text(r.eos_token),
                r.end_ids,
                r.add_bos,
            ),
        };
        let tokenizer = Tokenizer::from_parts(parts).map_err(|e| bad(e.to_string()))?;
        if tokenizer.fingerprint() != r.fingerprint || r.fingerprint != fingerprint {
            return Err(bad(format!(
                "the tokenizer received has fingerprint {}, the worker said {} and Describe {}",
                tokenizer.fingerprint(),
                r.fingerprint,
                fingerprint
            )));
        }
        Ok(tokenizer)
    }

    /// One forward pass of `step`, run by the worker after its pass of
    /// `after` (if any: the pipelined order); one result per item, in order
    /// (`traces` as for `convert::forward_request`).
    pub(crate) async fn forward(
        &self,
        step: Step,
        after: Option<Step>,
        items: &[ForwardItem],
        tier_copies: &[TierCopy],
        traces: &[Option<ChunkTrace>],
    ) -> Result<ForwardAnswer> {
        let req = convert::forward_request(step, after, items, tier_copies, traces);
        let r = self
            .inner
            .clone()
            .forward(req)
            .await
            .map_err(|s| Error::from_worker("Forward", &s))?
            .into_inner();
        let pulls = r
            .results
            .iter()
            .filter(|x| x.pulled_bytes > 0)
            .map(|x| (x.pulled_bytes, x.pull_us))
            .collect();
        Ok(ForwardAnswer {
            results: convert::forward_results(r.results, items.len())?,
            compute_us: r.compute_us,
            pulls,
        })
    }
}
