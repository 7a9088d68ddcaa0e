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
    #[arg(long, value_delimiter = ',', default_value = "lru,lfu,chain")]
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
