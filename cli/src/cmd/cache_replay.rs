//! `kvlease cache-replay`: a block trace through in-process cache services,
//! one per policy and capacity, against the reference LRU, the offline
//! optimum and infinite capacity.

use std::path::PathBuf;
use std::process::ExitCode;

use cache_svc::eviction::PolicyKind;
use kvlease::replay::{self, ReplayOptions};
use kvlease_runtime::process::EXIT_USAGE;

use super::failed;

#[derive(Debug, clap::Args)]
pub(crate) struct CacheReplayArgs {
    /// Mooncake trace (JSON lines with hash_ids; one hash id = one block).
    #[arg(long)]
    trace: PathBuf,
    /// Pool sizes in blocks, comma-separated.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "1024,2048,4096,8192,16384"
    )]
    capacity: Vec<u32>,
    /// Eviction policies, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "lru,lfu,chain,adaptive")]
    policy: Vec<PolicyKind>,
    /// Requests held at once (interleaved replay).
    #[arg(long, default_value_t = 1)]
    concurrency: usize,
    /// Replay only the first N requests (0 = all).
    #[arg(long, default_value_t = 0)]
    requests: usize,
    /// Blocks prepended to every request: a system prompt that every
    /// session shares (0 = the trace as it is).
    #[arg(long, default_value_t = 0)]
    shared_root: u32,
    /// Replay with partial-block reuse on, keeping partly filled blocks of
    /// at least this many tokens (off when not given: the replayed prompts
    /// end with one token of their own, so 1 keeps one such block per
    /// request, and the simulations assume none).
    #[arg(long)]
    partial_min_tokens: Option<u32>,
    /// Drive the cache service's core in this process, not a service over
    /// gRPC: the same calls, the same figures, many times faster.
    #[arg(long)]
    in_process: bool,
    /// Pass each record's `retain_tokens` (written by `cache-trace --kind
    /// agent`) as a retention hint on the lease: priority 50, TTL 24 h (the
    /// longest the cache takes; the replay has no clock), the replay
    /// session's quota. Without it the field is ignored.
    #[arg(long)]
    hints: bool,
}

/// Runs `kvlease cache-replay` with `a`.
pub(crate) async fn run(a: CacheReplayArgs) -> ExitCode {
    let options = ReplayOptions {
        trace: a.trace,
        capacities: a.capacity,
        policies: a.policy,
        concurrency: a.concurrency,
        limit: a.requests,
        shared_root: a.shared_root,
        partial_min_tokens: a.partial_min_tokens,
        in_process: a.in_process,
        hints: a.hints,
    };
    match replay::run(options).await {
        Ok(_) => ExitCode::SUCCESS,
        Err(kvlease::Error::Usage(m)) => {
            eprintln!("kvlease: {m}");
            ExitCode::from(EXIT_USAGE)
        }
        Err(e) => failed(e),
    }
}
