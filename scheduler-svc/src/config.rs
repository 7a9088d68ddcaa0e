//! Scheduler configuration: flags with `KVLEASE_SCHEDULER_*` environment
//! fallbacks. Tests build it with `Config::default()` and field updates.
//! Each default is one const that both clap and [`Default`] use.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::time::Duration;

use clap::Parser;
use kvlease_runtime::process::{ListenAddrs, ServiceConfig};

use crate::domain::Role;
use crate::error::{Error, Result};
use crate::policy::{OnExhausted, Policy};
use crate::routing::{PrefillWeight, Routing, RoutingConfig};
use crate::step::{CoreConfig, DEFAULT_PIPELINE_DEPTH, MAX_PIPELINE_DEPTH, Order};

/// What to do with live sequences when the cache service lost them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum OnCacheRestart {
    /// Re-lease them and recompute their KV.
    Recompute,
    /// Finish them `REJECTED`.
    Reject,
}

const DEFAULT_LISTEN: SocketAddr = SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 50051);
const DEFAULT_CACHE_ADDR: &str = "http://127.0.0.1:50052";
const DEFAULT_WORKER_ADDR: &str = "http://127.0.0.1:50053";
const DEFAULT_POLICY: Policy = Policy::MaxUtilization;
const DEFAULT_ON_EXHAUSTED: OnExhausted = OnExhausted::Preempt;
const DEFAULT_MAX_PREEMPTIONS: u32 = 4;
const DEFAULT_MAX_SEQS: u32 = 256;
const DEFAULT_MAX_TOKENS_PER_STEP: u32 = 2048;
const DEFAULT_PREFILL_CHUNK: u32 = 512;
const DEFAULT_MAX_TOKENS: u32 = 1024;
/// Peer pull's starting link rate, until a pull measures it.
const DEFAULT_PEER_LINK_BYTES_PER_S: u64 = 1_000_000_000;
/// Peer pull's starting prefill rate, until a prefill pass measures it.
const DEFAULT_PEER_PREFILL_TOKENS_PER_S: u64 = 4_000;
const DEFAULT_MAX_CONTEXT: u32 = 0;
const DEFAULT_SPEC_DRAFT_K: u32 = 0;
const DEFAULT_OVERLAP: bool = true;
/// One step trace in this many is exported besides the eventful ones.
const DEFAULT_TRACE_STEPS_ONE_IN: u64 = 100;
const DEFAULT_WARMUP_DEADLINE_MS: u64 = 60_000;
const DEFAULT_SESSION_TTL_MS: u64 = 10_000;
const DEFAULT_CACHE_TIMEOUT_MS: u64 = 5_000;
const DEFAULT_WORKER_KEEPALIVE_MS: u64 = 2_000;
const DEFAULT_HOLDER: &str = "kvlease-scheduler";
const DEFAULT_POOL_GROUP_PREFIX: &str = "";
const DEFAULT_ON_CACHE_RESTART: OnCacheRestart = OnCacheRestart::Recompute;
const DEFAULT_MAX_MESSAGE_BYTES: usize = 4 << 20;
const DEFAULT_MAX_QUEUE: usize = 4096;
const DEFAULT_MAX_QUEUE_WAIT_MS: u64 = 60_000;
const DEFAULT_ROUTING: Routing = Routing::KvAware;
const DEFAULT_ROUTING_PREFILL_WEIGHT: PrefillWeight = PrefillWeight::DEFAULT;

/// The scheduler's configuration.
#[derive(Debug, Clone, PartialEq, Eq, Parser)]
#[command(
    name = "kvlease-scheduler",
    about = "kvlease scheduler: continuous batching on leased KV blocks"
)]
pub struct Config {
    /// Address the Scheduler API listens on.
    #[arg(
        long,
        env = "KVLEASE_SCHEDULER_LISTEN",
        default_value_t = DEFAULT_LISTEN
    )]
    pub listen: SocketAddr,
    /// Transport security: mTLS material, `--insecure`, accepted bearer tokens.
    #[command(flatten)]
    pub security: kvlease_auth::SecurityArgs,
    /// Puts a tenant in a group whose tenants share cached prefixes, as TENANT=GROUP;
    /// repeatable. Every other tenant is a group of its own.
    #[arg(long, value_parser = crate::tenant::parse_tenant_group)]
    pub tenant_group: Vec<(String, String)>,
    /// A principal that may name the tenant it acts for (`kvlease-tenant` metadata): a
    /// front end of your own that serves several tenants under one identity; repeatable.
    /// kvlease's HTTP gateway sends no such metadata and needs none (it keeps its callers
    /// apart by `cache_salt`).
    #[arg(long, env = "KVLEASE_SCHEDULER_TENANT_ASSERTER", value_delimiter = ',')]
    pub tenant_asserter: Vec<String>,
    /// File whose bytes key the tenants' cache salts (HMAC); a random key per start when
    /// absent (prefixes are not shared across restarts anyway).
    #[arg(long, env = "KVLEASE_SCHEDULER_SALT_SECRET_FILE")]
    pub salt_secret_file: Option<std::path::PathBuf>,
    /// Address of the Prometheus `GET /metrics` endpoint; off when absent.
    #[arg(long, env = "KVLEASE_SCHEDULER_METRICS_LISTEN")]
    pub metrics_listen: Option<SocketAddr>,
    /// Cache service endpoint.
    #[arg(
        long,
        env = "KVLEASE_SCHEDULER_CACHE_ADDR",
        default_value = DEFAULT_CACHE_ADDR
    )]
    pub cache_addr: String,
    /// Worker endpoints (one per model replica), comma separated. A
    /// `#role=prefill`, `#role=decode` or `#role=both` after a URL gives its
    /// group's role (disaggregated serving; `both` when absent).
    #[arg(
        long,
        env = "KVLEASE_SCHEDULER_WORKER_ADDRS",
        value_delimiter = ',',
        default_value = DEFAULT_WORKER_ADDR
    )]
    pub worker_addrs: Vec<String>,
    /// Capacity policy: guaranteed-no-evict, max-utilization or static-batch.
    #[arg(
        long,
        env = "KVLEASE_SCHEDULER_POLICY",
        default_value_t = DEFAULT_POLICY
    )]
    pub policy: Policy,
    /// Under max-utilization, a mid-flight exhaustion: preempt or reject.
    #[arg(
        long,
        env = "KVLEASE_SCHEDULER_ON_EXHAUSTED",
        default_value_t = DEFAULT_ON_EXHAUSTED
    )]
    pub on_exhausted: OnExhausted,
    /// Preemptions a request may suffer before it is rejected.
    #[arg(long, env = "KVLEASE_SCHEDULER_MAX_PREEMPTIONS", default_value_t = DEFAULT_MAX_PREEMPTIONS)]
    pub max_preemptions: u32,
    /// Sequences running at once.
    #[arg(long, env = "KVLEASE_SCHEDULER_MAX_SEQS", default_value_t = DEFAULT_MAX_SEQS)]
    pub max_seqs: u32,
    /// Tokens in one step's forward batch.
    #[arg(
        long,
        env = "KVLEASE_SCHEDULER_MAX_TOKENS_PER_STEP",
        default_value_t = DEFAULT_MAX_TOKENS_PER_STEP
    )]
    pub max_tokens_per_step: u32,
    /// Prompt tokens one sequence prefills per step (chunked prefill).
    #[arg(long, env = "KVLEASE_SCHEDULER_PREFILL_CHUNK", default_value_t = DEFAULT_PREFILL_CHUNK)]
    pub prefill_chunk: u32,
    /// Largest max_tokens a request may ask for; 0 = no limit but the context
    /// (prompt + max_tokens <= --max-context).
    #[arg(long, env = "KVLEASE_SCHEDULER_MAX_TOKENS", default_value_t = DEFAULT_MAX_TOKENS)]
    pub max_tokens: u32,
    /// Largest prompt + output in tokens; 0 uses the model's limit.
    #[arg(long, env = "KVLEASE_SCHEDULER_MAX_CONTEXT", default_value_t = DEFAULT_MAX_CONTEXT)]
    pub max_context: u32,
    /// Prompt-lookup draft tokens per decode step; 0 turns speculation off.
    #[arg(long, env = "KVLEASE_SCHEDULER_SPEC_DRAFT_K", default_value_t = DEFAULT_SPEC_DRAFT_K)]
    pub spec_draft_k: u32,
    /// Schedule step N+1 while step N's forward pass runs, and (without
    /// --spec-draft-k) send its pass to the worker before N's answer is back,
    /// its decodes fed the tokens N samples (--pipeline-depth passes in
    /// flight).
    #[arg(long, env = "KVLEASE_SCHEDULER_OVERLAP", default_value_t = DEFAULT_OVERLAP, action = clap::ArgAction::Set)]
    pub overlap: bool,
    /// Forward passes a worker may hold at once with --overlap and no
    /// speculation, 1 to 4 (1: each pass is sent once the one before it
    /// returned). A deeper pipeline hides a longer turnaround between a
    /// pass's answer and the next pass's launch, for one more lookahead
    /// slot per lease and one more pass of work thrown away when a
    /// sequence stops.
    #[arg(long, env = "KVLEASE_SCHEDULER_PIPELINE_DEPTH", default_value_t = DEFAULT_PIPELINE_DEPTH)]
    pub pipeline_depth: u32,
    /// Step traces exported besides the steps that rejected or preempted
    /// (always exported): one in this many; 0 exports only those.
    #[arg(long, env = "KVLEASE_TRACE_STEPS_ONE_IN", default_value_t = DEFAULT_TRACE_STEPS_ONE_IN)]
    pub trace_steps_one_in: u64,
    /// Warm-up must finish within this many milliseconds.
    #[arg(
        long,
        env = "KVLEASE_SCHEDULER_WARMUP_DEADLINE_MS",
        default_value_t = DEFAULT_WARMUP_DEADLINE_MS
    )]
    pub warmup_deadline_ms: u64,
    /// Cache session time-to-live in milliseconds (keep-alive every third).
    #[arg(
        long,
        env = "KVLEASE_SCHEDULER_SESSION_TTL_MS",
        default_value_t = DEFAULT_SESSION_TTL_MS
    )]
    pub session_ttl_ms: u64,
    /// Time limit of one cache RPC in milliseconds.
    #[arg(
        long,
        env = "KVLEASE_SCHEDULER_CACHE_TIMEOUT_MS",
        default_value_t = DEFAULT_CACHE_TIMEOUT_MS
    )]
    pub cache_timeout_ms: u64,
    /// HTTP/2 ping interval on the worker connections, in milliseconds: a
    /// forward pass to a worker that answers no ping within as long again
    /// fails, and its requests are requeued on another replica.
    #[arg(
        long,
        env = "KVLEASE_SCHEDULER_WORKER_KEEPALIVE_MS",
        default_value_t = DEFAULT_WORKER_KEEPALIVE_MS
    )]
    pub worker_keepalive_ms: u64,
    /// Holder name of the cache session.
    #[arg(
        long,
        env = "KVLEASE_SCHEDULER_HOLDER",
        default_value = DEFAULT_HOLDER
    )]
    pub holder: String,
    /// Prefix of the pool groups this scheduler registers (`<prefix>/<model>/replica-<i>`;
    /// `<model>/replica-<i>` when empty). Schedulers that share one cache service must each
    /// take their own: a group's blocks live in one worker's memory.
    #[arg(
        long,
        env = "KVLEASE_SCHEDULER_POOL_GROUP_PREFIX",
        default_value = DEFAULT_POOL_GROUP_PREFIX
    )]
    pub pool_group_prefix: String,
    /// Live sequences when the cache service lost them: recompute or reject.
    #[arg(
        long,
        env = "KVLEASE_SCHEDULER_ON_CACHE_RESTART",
        value_enum,
        default_value_t = DEFAULT_ON_CACHE_RESTART
    )]
    pub on_cache_restart: OnCacheRestart,
    /// Largest request message (a Generate's prompt), in bytes; a larger one
    /// is refused with RESOURCE_EXHAUSTED.
    #[arg(long, env = "KVLEASE_SCHEDULER_MAX_MESSAGE_BYTES", default_value_t = DEFAULT_MAX_MESSAGE_BYTES)]
    pub max_message_bytes: usize,
    /// Most requests waiting in the queue; a Generate over it is refused
    /// with RESOURCE_EXHAUSTED. 0 for no limit.
    #[arg(long, env = "KVLEASE_SCHEDULER_MAX_QUEUE", default_value_t = DEFAULT_MAX_QUEUE)]
    pub max_queue: usize,
    /// Longest a request waits in the queue, in milliseconds, before it ends
    /// REJECTED with QUEUE_TIMEOUT. 0 for no limit.
    #[arg(long, env = "KVLEASE_SCHEDULER_MAX_QUEUE_WAIT_MS", default_value_t = DEFAULT_MAX_QUEUE_WAIT_MS)]
    pub max_queue_wait_ms: u64,
    /// Which worker group admits a request when several could: kv-aware (the
    /// lowest prefill-weight x blocks to prefill after the prefix the cache
    /// holds there, plus blocks committed; ties to the least committed) or
    /// least-committed. Only matters with more than one worker.
    #[arg(long, env = "KVLEASE_SCHEDULER_ROUTING", default_value_t = DEFAULT_ROUTING)]
    pub routing: Routing,
    /// Weight of one block to prefill against one committed block in the
    /// kv-aware routing cost (0 to 1000000; 0 routes by load alone).
    #[arg(
        long,
        env = "KVLEASE_SCHEDULER_ROUTING_PREFILL_WEIGHT",
        default_value_t = DEFAULT_ROUTING_PREFILL_WEIGHT
    )]
    pub routing_prefill_weight: PrefillWeight,
    /// Peer pull: an admission lease may pull its prompt's prefix from
    /// another worker group of the same model (same tokenizer, geometry and
    /// KV type) instead of computing it, when moving the blocks costs less
    /// than computing them at the rates below (the cache decides, per
    /// grant, with the figures in the grant's trace). Off by default.
    #[arg(long, env = "KVLEASE_SCHEDULER_PEER_PULL", default_value_t = false)]
    pub peer_pull: bool,
    /// Peer pull's link rate between workers, in bytes per second: fixed
    /// when given; unset, 1 GB/s until the first pull measures it (then a
    /// running mean of what pulls moved).
    #[arg(long, env = "KVLEASE_SCHEDULER_PEER_LINK_BYTES_PER_S",
        value_parser = clap::value_parser!(u64).range(1..))]
    pub peer_link_bytes_per_s: Option<u64>,
    /// Peer pull's prefill rate of a worker group, in tokens per second:
    /// fixed when given; unset, 4,000 until a pass of mostly prompt tokens
    /// measures it (then a running mean of such passes).
    #[arg(long, env = "KVLEASE_SCHEDULER_PEER_PREFILL_TOKENS_PER_S",
        value_parser = clap::value_parser!(u64).range(1..))]
    pub peer_prefill_tokens_per_s: Option<u64>,
    /// Peer pull's fixed cost of one pull (connection, first byte), in
    /// microseconds.
    #[arg(
        long,
        env = "KVLEASE_SCHEDULER_PEER_PULL_OVERHEAD_US",
        default_value_t = 1_000
    )]
    pub peer_pull_overhead_us: u64,
    /// Peer pull from the worker groups of other schedulers sharing the
    /// cache (same principal, same salt secret): where each such group's
    /// worker listens, as GROUP=ADDR; comma separated or repeated. A grant
    /// that copies from a group of this scheduler's own pulls from that
    /// group's worker; one from another group pulls only when it is named
    /// here, and is computed instead otherwise.
    #[arg(
        long,
        env = "KVLEASE_SCHEDULER_PEER_WORKERS",
        value_delimiter = ',',
        requires = "peer_pull"
    )]
    pub peer_workers: Vec<String>,
    /// Transport limits (connections, keepalive, streams).
    #[command(flatten)]
    pub limits: kvlease_runtime::limits::ServeLimits,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            listen: DEFAULT_LISTEN,
            security: kvlease_auth::SecurityArgs::default(),
            tenant_group: Vec::new(),
            tenant_asserter: Vec::new(),
            salt_secret_file: None,
            metrics_listen: None,
            cache_addr: DEFAULT_CACHE_ADDR.into(),
            worker_addrs: vec![DEFAULT_WORKER_ADDR.into()],
            policy: DEFAULT_POLICY,
            on_exhausted: DEFAULT_ON_EXHAUSTED,
            max_preemptions: DEFAULT_MAX_PREEMPTIONS,
            max_seqs: DEFAULT_MAX_SEQS,
            max_tokens_per_step: DEFAULT_MAX_TOKENS_PER_STEP,
            prefill_chunk: DEFAULT_PREFILL_CHUNK,
            max_tokens: DEFAULT_MAX_TOKENS,
            max_context: DEFAULT_MAX_CONTEXT,
            spec_draft_k: DEFAULT_SPEC_DRAFT_K,
            overlap: DEFAULT_OVERLAP,
            pipeline_depth: DEFAULT_PIPELINE_DEPTH,
            trace_steps_one_in: DEFAULT_TRACE_STEPS_ONE_IN,
            warmup_deadline_ms: DEFAULT_WARMUP_DEADLINE_MS,
            session_ttl_ms: DEFAULT_SESSION_TTL_MS,
            cache_timeout_ms: DEFAULT_CACHE_TIMEOUT_MS,
            worker_keepalive_ms: DEFAULT_WORKER_KEEPALIVE_MS,
            holder: DEFAULT_HOLDER.into(),
            pool_group_prefix: DEFAULT_POOL_GROUP_PREFIX.into(),
            on_cache_restart: DEFAULT_ON_CACHE_RESTART,
            max_message_bytes: DEFAULT_MAX_MESSAGE_BYTES,
            max_queue: DEFAULT_MAX_QUEUE,
            max_queue_wait_ms: DEFAULT_MAX_QUEUE_WAIT_MS,
            routing: DEFAULT_ROUTING,
            routing_prefill_weight: DEFAULT_ROUTING_PREFILL_WEIGHT,
            peer_pull: false,
            peer_link_bytes_per_s: None,
            peer_prefill_tokens_per_s: None,
            peer_pull_overhead_us: 1_000,
            peer_workers: Vec::new(),
            limits: Default::default(),
        }
    }
}

impl ServiceConfig for Config {
    fn listen_addrs(&self) -> std::result::Result<ListenAddrs, String> {
        ListenAddrs::checked(self.validate(), self.listen, self.metrics_listen)
    }
}

impl Config {
    /// The largest `max_tokens` a request may ask for: `--max-tokens`, or
    /// with 0 no limit of its own (the context still limits the request).
    pub fn max_tokens_limit(&self) -> u32 {
        match self.max_tokens {
            0 => u32::MAX,
            n => n,
        }
    }

    /// Checks the values that have no meaning when zero or out of range.
    pub fn validate(&self) -> Result<()> {
        let bad = |m: &str| Err(Error::Config(m.to_string()));
        if self.worker_addrs.iter().all(|a| a.trim().is_empty()) {
            return bad("at least one worker address is required");
        }
        let roles: Vec<Role> = self.workers()?.into_iter().map(|(_, r)| r).collect();
        let (prefills, decodes) = (
            roles.iter().any(|r| r.prefills()),
            roles.iter().any(|r| r.decodes()),
        );
        if !prefills || !decodes {
            return bad(
                "worker roles: at least one worker must prefill (role prefill or both) and one decode (role decode or both)",
            );
        }
        if self.max_seqs == 0 {
            return bad("max_seqs must be at least 1");
        }
        if self.max_tokens_per_step == 0 {
            return bad("max_tokens_per_step must be at least 1");
        }
        if self.prefill_chunk == 0 {
            return bad("prefill_chunk must be at least 1");
        }
        if self.spec_draft_k > 32 {
            return bad("spec_draft_k must be at most 32");
        }
        if !(1..=MAX_PIPELINE_DEPTH).contains(&self.pipeline_depth) {
            return Err(Error::Config(format!(
                "pipeline_depth must be 1 to {MAX_PIPELINE_DEPTH}, not {}",
                self.pipeline_depth
            )));
        }
        if self.session_ttl_ms < 30 {
            return bad("session_ttl_ms must be at least 30");
        }
        if self.worker_keepalive_ms < 100 {
            return bad("worker_keepalive_ms must be at least 100");
        }
        if self.warmup_deadline_ms == 0 || self.cache_timeout_ms == 0 {
            return bad("deadlines and timeouts must be positive");
        }
        if self.holder.is_empty() || self.holder.len() > 128 {
            return bad("holder must be 1 to 128 characters");
        }
        if self.pool_group_prefix.len() > 64
            || !self.pool_group_prefix.chars().all(is_group_name_char)
        {
            return bad("pool_group_prefix must be at most 64 of A-Z a-z 0-9 . _ - : @ +");
        }
        if self.max_message_bytes < 1024 {
            return bad("max_message_bytes must be at least 1024");
        }
        self.peer_workers()?;
        self.limits.validate().map_err(Error::Config)
    }

    /// Checks the scheduler's batches against the cache's batch limit
    /// (`OpenSession.max_batch`; `None`: the cache advertised none). The
    /// step loop fits every batch it builds to the limit (release batches
    /// and a step's leases are capped, a step's extends split into several
    /// calls, warm-up leases split into several atomic ones) except one: a
    /// kv-aware `Match` names every worker group in one list, so more groups
    /// than the limit is refused here, naming both numbers.
    pub fn check_cache_batch_limit(&self, groups: usize, limit: Option<usize>) -> Result<()> {
        let Some(limit) = limit else {
            return Ok(());
        };
        if self.routing == Routing::KvAware && groups > 1 && groups > limit {
            return Err(Error::Config(format!(
                "{groups} worker groups with --routing kv-aware, but the cache takes at most {limit} entries in one batch (its --max-batch) and a Match names every group: raise the cache's --max-batch to {groups} or more, or use --routing least-committed"
            )));
        }
        Ok(())
    }

    /// The worker endpoints (`--worker-addrs`), each with its group's role
    /// from a `#role=NAME` suffix (`both` without one).
    pub fn workers(&self) -> Result<Vec<(String, Role)>> {
        self.worker_addrs
            .iter()
            .map(|a| a.trim())
            .filter(|a| !a.is_empty())
            .map(|a| match a.split_once('#') {
                None => Ok((a.to_owned(), Role::Both)),
                Some((url, suffix)) => match suffix.strip_prefix("role=") {
                    Some(role) => role
                        .parse()
                        .map(|r| (url.to_owned(), r))
                        .map_err(|e| Error::Config(format!("worker address {url}: {e}"))),
                    None => Err(Error::Config(format!(
                        "worker address {url}: after '#' only role=prefill, role=decode or role=both is understood"
                    ))),
                },
            })
            .collect()
    }

    /// The order of a step's calls: `--overlap` pipelines
    /// (`--pipeline-depth` passes in flight) unless speculation needs each
    /// token back first.
    pub fn order(&self) -> Order {
        Order::from_overlap(self.overlap, self.spec_draft_k, self.pipeline_depth)
    }

    /// The core's knobs.
    pub fn core(&self) -> CoreConfig {
        CoreConfig {
            policy: self.policy,
            on_exhausted: self.on_exhausted,
            max_preemptions: self.max_preemptions,
            max_seqs: self.max_seqs,
            max_tokens_per_step: self.max_tokens_per_step,
            prefill_chunk: self.prefill_chunk,
            draft_k: self.spec_draft_k,
            max_queue_wait: (self.max_queue_wait_ms > 0)
                .then(|| Duration::from_millis(self.max_queue_wait_ms)),
            routing: RoutingConfig {
                policy: self.routing,
                prefill_weight: self.routing_prefill_weight,
            },
            // with overlap, a decode launches on slots granted ahead and its
            // extend follows the launch (the depth's passes ahead when
            // pipelined)
            lookahead: self.order().lookahead(),
            order: self.order(),
            peer_pull: self.peer_pull.then_some(crate::domain::PeerRates {
                link_bytes_per_s: self
                    .peer_link_bytes_per_s
                    .unwrap_or(DEFAULT_PEER_LINK_BYTES_PER_S)
                    .max(1),
                prefill_tokens_per_s: self
                    .peer_prefill_tokens_per_s
                    .unwrap_or(DEFAULT_PEER_PREFILL_TOKENS_PER_S)
                    .max(1),
                overhead_us: self.peer_pull_overhead_us,
            }),
            peer_pinned: crate::step::PinnedRates {
                link: self.peer_link_bytes_per_s.is_some(),
                prefill: self.peer_prefill_tokens_per_s.is_some(),
            },
            // validate() refused a malformed entry before the core is built
            peer_workers: self.peer_workers().unwrap_or_default(),
        }
    }

    /// `--peer-workers` as (group, worker address) pairs.
    pub fn peer_workers(&self) -> Result<Vec<(String, String)>> {
        self.peer_workers
            .iter()
            .filter(|w| !w.trim().is_empty())
            .map(|w| match w.trim().split_once('=') {
                Some((group, addr))
                    if !group.is_empty()
                        && group.len() <= 128
                        && group.chars().all(|c| c == '/' || is_group_name_char(c))
                        && !addr.is_empty() =>
                {
                    Ok((group.to_owned(), addr.to_owned()))
                }
                _ => Err(Error::Config(format!(
                    "peer_workers entry {w:?} is not GROUP=ADDR (a pool group name of 1 to 128 of A-Z a-z 0-9 . _ - / : @ +, and a worker address)"
                ))),
            })
            .collect()
    }

    /// The pool group of replica `replica` serving `model` (any name; the
    /// characters the cache refuses become `-`).
    pub fn pool_group(&self, model: &str, replica: usize) -> String {
        let model = if model.is_empty() { "model" } else { model };
        // The cache takes names of A-Z a-z 0-9 . _ - / : @ + only (names reach
        // its logs); a model name may hold spaces or more.
        let model: String = model
            .chars()
            .take(100)
            .map(|c| if is_group_name_char(c) { c } else { '-' })
            .collect();
        match self.pool_group_prefix.as_str() {
            "" => format!("{model}/replica-{replica}"),
            prefix => format!("{prefix}/{model}/replica-{replica}"),
        }
    }

    pub fn warmup_deadline(&self) -> Duration {
        Duration::from_millis(self.warmup_deadline_ms)
    }

    pub fn cache_timeout(&self) -> Duration {
        Duration::from_millis(self.cache_timeout_ms)
    }

    pub fn worker_keepalive(&self) -> Duration {
        Duration::from_millis(self.worker_keepalive_ms)
    }
}

/// A character of a pool group name besides the `/` that joins its parts.
fn is_group_name_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || "._-:@+".contains(c)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn peer_workers_parse_as_group_and_address_and_need_peer_pull() {
        let c = Config::try_parse_from([
            "kvlease-scheduler",
            "--peer-pull",
            "--peer-workers",
            "a/m/replica-0=127.0.0.1:1,a/m/replica-1=http://h:2",
        ])
        .map_err(|e| e.to_string());
        assert!(c.is_ok(), "{c:?}");
        if let Ok(c) = c {
            assert!(c.validate().is_ok());
            let pairs = vec![
                ("a/m/replica-0".to_string(), "127.0.0.1:1".to_string()),
                ("a/m/replica-1".to_string(), "http://h:2".to_string()),
            ];
            assert_eq!(c.core().peer_workers, pairs);
        }
        // without --peer-pull the flag means nothing: refused
        assert!(Config::try_parse_from(["kvlease-scheduler", "--peer-workers", "a=b:1"]).is_err());
        for bad in ["no-address=", "=127.0.0.1:1", "no-equals", "bad name=h:1"] {
            let c = Config {
                peer_pull: true,
                peer_workers: vec![bad.into()],
                ..Config::default()
            };
            let err = c.validate().map(|_| ()).map_err(|e| e.to_string());
            assert!(
                matches!(&err, Err(m) if m.contains("is not GROUP=ADDR")),
                "{bad}: {err:?}"
            );
        }
    }

    #[test]
    fn worker_roles_come_from_the_url_and_a_bad_one_is_named() {
        let with = |addrs: &[&str]| Config {
            worker_addrs: addrs.iter().map(|a| a.to_string()).collect(),
            ..Config::default()
        };
        let c = with(&[
            "http://p:1#role=prefill",
            " http://d:2#role=decode ",
            "http://b:3",
        ]);
        assert_eq!(
            c.workers().unwrap(),
            vec![
                ("http://p:1".to_string(), Role::Prefill),
                ("http://d:2".to_string(), Role::Decode),
                ("http://b:3".to_string(), Role::Both),
            ]
        );
        assert!(c.validate().is_ok());
        let msg = |c: Config| c.validate().unwrap_err().to_string();
        let m = msg(with(&["http://p:1#role=prefil"]));
        assert!(m.contains("worker address http://p:1: role must be"), "{m}");
        assert!(msg(with(&["http://p:1#x=1"])).contains("only role=prefill"));
        // a prefill group with nowhere to decode, and the reverse
        assert!(msg(with(&["http://p:1#role=prefill"])).contains("one decode"));
        assert!(msg(with(&["http://d:1#role=decode"])).contains("must prefill"));
    }

    #[test]
    fn flags_parse_and_default_matches_clap_defaults() {
        let c = Config::try_parse_from([
            "kvlease-scheduler",
            "--policy",
            "guaranteed-no-evict",
            "--worker-addrs",
            "http://a:1,http://b:2",
            "--overlap",
            "false",
            "--routing",
            "least-committed",
            "--routing-prefill-weight",
            "0.5",
        ]);
        let c = c.map_err(|e| e.to_string());
        assert!(c.is_ok(), "{c:?}");
        if let Ok(c) = c {
            assert_eq!(c.policy, Policy::GuaranteedNoEvict);
            assert_eq!(c.worker_addrs.len(), 2);
            assert!(!c.overlap);
            assert_eq!(c.order(), Order::Plain);
            assert_eq!(c.core().routing.policy, Routing::LeastCommitted);
            assert_eq!(c.core().routing.prefill_weight.get(), 0.5);
        }
        assert!(Config::default().validate().is_ok());
        // pipelined by default; speculation keeps the overlap one pass deep
        assert_eq!(Config::default().order(), Order::pipelined());
        let spec = Config {
            overlap: true,
            spec_draft_k: 3,
            ..Config::default()
        };
        assert_eq!((spec.order(), spec.core().lookahead), (Order::Overlap, 1));
        let parsed = kvlease_runtime::process::parse_without_env::<Config, _, _>(
            "kvlease-scheduler",
            ["kvlease-scheduler"],
        );
        assert_eq!(parsed.map_err(|e| e.to_string()), Ok(Config::default()));
        let context_only = Config {
            max_tokens: 0,
            ..Config::default()
        };
        assert!(
            context_only.validate().is_ok(),
            "0: only the context limits"
        );
        assert_eq!(context_only.max_tokens_limit(), u32::MAX);
        assert_eq!(Config::default().max_tokens_limit(), DEFAULT_MAX_TOKENS);
    }

    #[test]
    fn the_pipeline_depth_is_one_to_four_and_sets_the_order_and_lookahead() {
        for (depth, order, lookahead) in [
            (1, Order::Overlap, 1),
            (2, Order::Pipelined { depth: 2 }, 2),
            (4, Order::Pipelined { depth: 4 }, 4),
        ] {
            let c = Config::try_parse_from([
                "kvlease-scheduler",
                "--pipeline-depth",
                &depth.to_string(),
            ])
            .map_err(|e| e.to_string());
            assert_eq!(
                c.as_ref()
                    .map(|c| (c.validate().is_ok(), c.order(), c.core().lookahead)),
                Ok((true, order, lookahead)),
                "depth {depth}"
            );
        }
        for depth in [0, 5] {
            let c = Config {
                pipeline_depth: depth,
                ..Config::default()
            };
            let err = c.validate().map(|_| ()).map_err(|e| e.to_string());
            assert_eq!(
                err,
                Err(format!(
                    "invalid configuration: pipeline_depth must be 1 to 4, not {depth}"
                )),
            );
        }
    }

    #[test]
    fn a_cache_batch_limit_below_the_groups_a_match_names_is_refused_naming_both() {
        let c = Config::default();
        assert!(
            c.check_cache_batch_limit(3, None).is_ok(),
            "no limit advertised"
        );
        assert!(c.check_cache_batch_limit(3, Some(3)).is_ok());
        assert!(
            c.check_cache_batch_limit(1, Some(1)).is_ok(),
            "one group asks no Match"
        );
        let err = c
            .check_cache_batch_limit(3, Some(2))
            .map_err(|e| e.to_string());
        assert!(
            matches!(&err, Err(m) if m.contains("3 worker groups") && m.contains("at most 2 entries")),
            "{err:?}"
        );
        let least = Config {
            routing: Routing::LeastCommitted,
            ..Config::default()
        };
        assert!(
            least.check_cache_batch_limit(3, Some(2)).is_ok(),
            "no Match asked"
        );
    }

    #[test]
    fn pool_groups_carry_the_prefix_and_only_names_the_cache_takes() {
        let plain = Config::default();
        assert_eq!(plain.pool_group("seeded-0", 1), "seeded-0/replica-1");
        assert_eq!(plain.pool_group("", 0), "model/replica-0");
        assert_eq!(
            plain.pool_group("Llama 3 (8B)", 0),
            "Llama-3--8B-/replica-0"
        );
        let a = Config {
            pool_group_prefix: "sched-a".into(),
            ..Config::default()
        };
        assert!(a.validate().is_ok());
        assert_eq!(a.pool_group("seeded-0", 0), "sched-a/seeded-0/replica-0");
        for bad in ["a/b", "a b", &"x".repeat(65)] {
            let c = Config {
                pool_group_prefix: bad.to_string(),
                ..Config::default()
            };
            let err = c.validate().map_err(|e| e.to_string());
            assert!(
                matches!(&err, Err(m) if m.contains("pool_group_prefix")),
                "{bad:?}: {err:?}"
            );
        }
    }
}
