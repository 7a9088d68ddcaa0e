//! `kvlease up`: a whole cluster (cache, workers, scheduler, optionally the
//! HTTP gateway) in this process on loopback ports, until SIGINT or SIGTERM:
//! plaintext, or with `--tls` mTLS with credentials of its own
//! ([`kvlease::local_tls`]).

use std::net::IpAddr;
use std::process::ExitCode;

use kvlease::cluster::ClusterConfig;
use kvlease::local_tls::LocalTls;
use kvlease::{commands, models};
use kvlease_runtime::process::{self, EXIT_USAGE};
use scheduler_svc::policy::{OnExhausted, Policy};

use super::failed;

#[derive(Debug, clap::Args)]
pub(crate) struct UpArgs {
    /// Workers (model replicas) to start.
    #[arg(long, default_value_t = 2)]
    workers: usize,
    /// Address the services listen on. Without --tls they serve plaintext gRPC, where every
    /// caller on loopback is an admin: an address other than loopback also takes --insecure.
    #[arg(long, default_value = "127.0.0.1")]
    host: IpAddr,
    /// Serve plaintext gRPC on a non-loopback --host (logged as a warning).
    #[arg(long, conflicts_with = "tls")]
    insecure: bool,
    /// Serve mTLS only: a fresh development CA, one certificate per service, the clients
    /// admin, client and observer, and a bearer token of admin (admin.token, also taken by
    /// the HTTP gateway), written into --tls-dir; only who can read it is an admin.
    #[arg(long)]
    tls: bool,
    /// Where --tls writes its credentials (created for its owner only; an existing
    /// directory must be private). Default: a new directory in the temporary directory,
    /// removed when the cluster stops.
    #[arg(long, requires = "tls")]
    tls_dir: Option<std::path::PathBuf>,
    /// Scheduler port; the cache takes the next one and the workers the ones after (0 = any free ports).
    #[arg(long, default_value_t = 50051)]
    base_port: u16,
    /// Capacity policy. guaranteed-no-evict: reserve each request's whole life
    /// (prompt + max_tokens) at admission, so an admitted request is never
    /// preempted or rejected for blocks; max-utilization: admit on the next
    /// step's need and over-subscribe the pools, see --on-exhausted;
    /// static-batch: run one batch at a time, its whole life reserved.
    #[arg(long, default_value = "max-utilization")]
    policy: Policy,
    /// Under --policy max-utilization, what befalls a running request that
    /// cannot grow because the pool is exhausted. preempt: release its blocks,
    /// requeue it and recompute it later (rejected past the scheduler's
    /// preemption bound); reject: end it REJECTED with the cache's reason
    /// (HTTP 429).
    #[arg(long, default_value = "preempt")]
    on_exhausted: OnExhausted,
    /// Largest max_tokens a request may ask for; 0 = no limit but the
    /// context: prompt + max_tokens must fit in --max-context (or the model's
    /// context when that is 0), or the request is refused naming max_tokens.
    #[arg(long, default_value_t = 0)]
    max_tokens: u32,
    /// Which worker admits a request: kv-aware (prefill after the prefix
    /// cached there, plus load) or least-committed.
    #[arg(long, env = "KVLEASE_SCHEDULER_ROUTING", default_value = "kv-aware")]
    routing: scheduler_svc::routing::Routing,
    /// Weight of a block to prefill against a committed block (kv-aware).
    #[arg(
        long,
        env = "KVLEASE_SCHEDULER_ROUTING_PREFILL_WEIGHT",
        default_value = "8"
    )]
    routing_prefill_weight: scheduler_svc::routing::PrefillWeight,
    /// A real model on every worker: `smollm2` (after `kvlease model fetch
    /// smollm2`), or a GGUF file or Hugging Face directory. Default: the
    /// seeded model.
    #[arg(long, env = "KVLEASE_MODEL")]
    model: Option<String>,
    /// Each worker's memory for weights, activations and KV blocks, in MiB.
    /// Default: 64 for the seeded model; with --model, what holds the model,
    /// its activations and 4 sequences of the longest context.
    #[arg(long)]
    memory_budget_mib: Option<u64>,
    /// Blocks of a host-memory tier per pool on every worker (beyond the
    /// memory budget): the cache keeps blocks it evicts there and brings them
    /// back on a prefix hit; 0 = none.
    #[arg(long, default_value_t = 0)]
    host_blocks: u32,
    /// The longest request (prompt + output) in tokens, which limits
    /// max_tokens (see --max-tokens); 0 = the model's context. The scheduler's
    /// warm-up runs it, and a --model worker's default budget holds 4.
    #[arg(long, default_value_t = scheduler_svc::Config::default().max_context)]
    max_context: u32,
    /// Compute threads per worker; 0 = the cores divided among the workers.
    #[arg(long, default_value_t = 0)]
    threads: usize,
    /// Prometheus endpoints: the scheduler on this port, the cache on port + 1,
    /// the workers from port + 2; 0 turns them off.
    #[arg(long, default_value_t = 9090)]
    metrics_base_port: u16,
    /// Serve the OpenAI-compatible HTTP API (/v1/completions,
    /// /v1/chat/completions, /v1/models, /health) here, e.g. 127.0.0.1:8000;
    /// off when absent.
    #[arg(long)]
    http_listen: Option<std::net::SocketAddr>,
    /// The names HTTP requests may give as `model` (comma-separated; answers
    /// carry the first, /v1/models lists all; any other is a 404). Default:
    /// `kvlease` for the seeded model; with --model, the model's own name
    /// (GGUF general.name, else its file or directory name) and the --model
    /// value when it names a known model (e.g. smollm2).
    #[arg(long, value_delimiter = ',')]
    served_model_name: Vec<String>,
    /// Each worker's role, comma-separated, one per worker: `prefill`,
    /// `decode` or `both` (the default). `--workers 2 --roles prefill,decode`
    /// computes every prompt in the first worker and decodes in the second,
    /// which pulls the prompt's KV from it (disaggregated serving).
    #[arg(long, value_delimiter = ',')]
    roles: Vec<scheduler_svc::domain::Role>,
    /// Step traces the scheduler exports besides the steps that rejected or
    /// preempted (always exported): one in this many; 0 exports only those.
    #[arg(
        long,
        env = "KVLEASE_TRACE_STEPS_ONE_IN",
        default_value_t = scheduler_svc::Config::default().trace_steps_one_in
    )]
    trace_steps_one_in: u64,
}

/// The scheduler's settings that `up`'s flags give.
fn scheduler_flags(a: &UpArgs, scheduler: &mut scheduler_svc::Config) {
    scheduler.max_context = a.max_context;
    scheduler.max_tokens = a.max_tokens;
    scheduler.policy = a.policy;
    scheduler.on_exhausted = a.on_exhausted;
    scheduler.routing = a.routing;
    scheduler.routing_prefill_weight = a.routing_prefill_weight;
    scheduler.trace_steps_one_in = a.trace_steps_one_in;
}

/// Runs `kvlease up` with `a`.
pub(crate) async fn run(a: UpArgs) -> ExitCode {
    if a.workers == 0 {
        eprintln!("kvlease: --workers must be at least 1");
        return ExitCode::from(EXIT_USAGE);
    }
    if !a.roles.is_empty() && a.roles.len() != a.workers {
        eprintln!(
            "kvlease: --roles names {} roles for {} workers: give one per worker",
            a.roles.len(),
            a.workers
        );
        return ExitCode::from(EXIT_USAGE);
    }
    let mut config = ClusterConfig::on_ports(a.host, a.base_port, a.workers);
    config.worker_roles = a.roles.clone();
    config.cache.security.insecure = a.insecure;
    config.worker.security.insecure = a.insecure;
    config.scheduler.security.insecure = a.insecure;
    // the credentials' directory, and whether it is ours to remove at the end
    let tls = match (a.tls, &a.tls_dir) {
        (false, _) => None,
        (true, dir) => {
            let (dir, ours) = match dir {
                Some(dir) => (dir.clone(), false),
                None => (
                    std::env::temp_dir().join(format!("kvlease-up-{}", std::process::id())),
                    true,
                ),
            };
            // the services are reached at --host too when it is not loopback
            let hosts: Vec<String> = if a.host.is_loopback() {
                Vec::new()
            } else {
                vec![a.host.to_string()]
            };
            match LocalTls::create(&dir, &hosts) {
                Ok(tls) => {
                    tls.secure(&mut config);
                    Some((tls, ours))
                }
                Err(e) => {
                    eprintln!("kvlease: {e}");
                    return ExitCode::from(EXIT_USAGE);
                }
            }
        }
    };
    let cores = std::thread::available_parallelism().map_or(1, usize::from);
    scheduler_flags(&a, &mut config.scheduler);
    config.worker.threads = if a.threads == 0 {
        (cores / a.workers).max(1)
    } else {
        a.threads
    };
    let mut served = vec![kvlease_gateway::config::DEFAULT_MODEL.to_string()];
    match &a.model {
        Some(model) => {
            let path = match super::model_path(model) {
                Ok(path) => path,
                Err(code) => return code,
            };
            match config.serve_model(path.clone(), a.memory_budget_mib) {
                Ok(budget) => println!(
                    "kvlease up: model {} ({budget} MiB per worker)",
                    path.display()
                ),
                Err(e) => return failed(e),
            }
            let own = config
                .worker
                .model_shape()
                .map(|m| m.name)
                .unwrap_or_default();
            served = models::served_names(model, &path, &own);
        }
        None => {
            if let Some(budget) = a.memory_budget_mib {
                config.worker.memory_budget_mib = budget;
            }
        }
    }
    config.worker.host_blocks = a.host_blocks;
    config.metrics_port = (a.metrics_base_port != 0).then_some(a.metrics_base_port);
    let local = tls.as_ref().map(|(tls, _)| tls);
    if !a.served_model_name.is_empty() {
        if a.served_model_name.iter().any(|n| n.trim().is_empty()) {
            eprintln!("kvlease: --served-model-name must not hold an empty name");
            return ExitCode::from(EXIT_USAGE);
        }
        served = a.served_model_name.clone();
    }
    let http = a.http_listen.map(|listen| commands::HttpFront {
        listen,
        names: served,
    });
    let ended = commands::up(config, http, local, process::shutdown_signal()).await;
    if let Some((tls, true)) = &tls
        && let Err(e) = std::fs::remove_dir_all(tls.dir())
    {
        eprintln!("kvlease: cannot remove {}: {e}", tls.dir().display());
    }
    match ended {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => failed(e),
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser as _;

    use super::*;

    #[derive(Debug, clap::Parser)]
    struct Up {
        #[command(flatten)]
        a: UpArgs,
    }

    fn scheduler_of(args: &[&str]) -> scheduler_svc::Config {
        let up = Up::try_parse_from(std::iter::once("up").chain(args.iter().copied()))
            .unwrap_or_else(|e| panic!("{e}"));
        let mut scheduler = scheduler_svc::Config::default();
        scheduler_flags(&up.a, &mut scheduler);
        scheduler
    }

    /// Issue 29, point 15: the step sampling reaches the scheduler `up`
    /// starts (KVLEASE_TRACE_STEPS_ONE_IN had no effect under `up`), and so
    /// do the other scheduler flags.
    #[test]
    fn the_scheduler_flags_reach_the_scheduler() {
        let s = scheduler_of(&[
            "--trace-steps-one-in",
            "7",
            "--on-exhausted",
            "reject",
            "--max-context",
            "300",
            "--max-tokens",
            "20",
        ]);
        assert_eq!(s.trace_steps_one_in, 7);
        assert_eq!(s.on_exhausted, OnExhausted::Reject);
        assert_eq!((s.max_context, s.max_tokens), (300, 20));
    }
}
