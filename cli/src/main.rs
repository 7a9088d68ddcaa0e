//! `kvlease`: run a local cluster, talk to a scheduler, drive load.
//!
//! This file parses the flags and dispatches; each subcommand's flags and
//! its run live in `cmd/`, one module per subcommand.

mod cmd;

use std::process::ExitCode;

use clap::{Parser, Subcommand};
use kvlease_runtime::process::{self, EXIT_USAGE};

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
    Up(cmd::up::UpArgs),
    /// Over-subscribe a small KV pool in an in-process cluster and show what happened.
    Demo(cmd::demo::DemoArgs),
    /// Stream a completion of TEXT from a scheduler.
    Generate(cmd::generate::GenerateArgs),
    /// Drive load (synthetic, or a Mooncake trace) through a scheduler; print a table.
    Bench(cmd::bench::BenchArgs),
    /// Show a scheduler's queue, counters and pool figures.
    Status {
        /// The scheduler's gRPC address.
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
        /// The cache service's gRPC address.
        #[arg(long, env = "KVLEASE_CACHE_ADDR", default_value = "127.0.0.1:50052")]
        cache: String,
        /// Every pool must be whole too (nothing in use, nothing fenced): no
        /// request may be running.
        #[arg(long)]
        whole: bool,
    },
    /// Real models: `kvlease model fetch smollm2`; `kvlease model tokenizer smollm2 --out DIR`.
    Model {
        #[command(subcommand)]
        action: cmd::model::ModelAction,
    },
    /// Replay a block trace through in-process cache services, one per policy
    /// and capacity; compare with the reference LRU, the offline optimum and
    /// infinite capacity.
    CacheReplay(cmd::cache_replay::CacheReplayArgs),
    /// Write a generated multi-turn conversation trace (Mooncake JSON lines).
    CacheTrace(cmd::cache_trace::CacheTraceArgs),
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
        #[arg(long, value_parser = cmd::certs::parse_principal)]
        principal: Vec<(String, kvlease_auth::Roles)>,
    },
    /// Check a service's gRPC health: exit 0 when SERVING, 1 otherwise.
    Health {
        /// host:port of any kvlease service.
        addr: String,
        /// Service name to check; empty = the whole server.
        #[arg(long, default_value = "")]
        service: String,
        /// Milliseconds to wait for the answer (exit 1 after).
        #[arg(long, default_value_t = 2000)]
        timeout_ms: u64,
    },
}

fn log_filter_default(quiet: &str, service: &str) -> kvlease_telemetry::TelemetryConfig {
    let mut config = kvlease_telemetry::TelemetryConfig::from_env(service);
    if std::env::var_os(kvlease_telemetry::ENV_LOG_FILTER).is_none() {
        config.log_filter = quiet.to_string();
    }
    config
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
        Err(e) => return cmd::failed(e),
    };
    // `up` and `demo` serve; these flags name a client's credentials. Taken as the
    // services' own, one certificate would serve as every service (which the services'
    // identity checks refuse) and plaintext services were started under them (issue 29,
    // finding 8: `kvlease up` served plaintext, then gave up waiting for TLS health).
    if matches!(cli.command, Command::Up(_) | Command::Demo(_))
        && cli.security != kvlease_auth::SecurityArgs::default()
    {
        eprintln!(
            "kvlease: --tls-cert/--tls-key/--tls-ca/--insecure/--token-file (or their \
             KVLEASE_* variables) are a client's credentials; `kvlease up --tls` serves mTLS \
             with certificates of its own (and `kvlease up --insecure` plaintext off loopback)"
        );
        return ExitCode::from(EXIT_USAGE);
    }
    match cli.security.load() {
        Ok(security) => kvlease::connect::set_security(security),
        Err(e) => {
            eprintln!("kvlease: {e}");
            return ExitCode::from(EXIT_USAGE);
        }
    }
    match cli.command {
        Command::Up(a) => cmd::up::run(a).await,
        Command::Demo(a) => cmd::demo::run(a).await,
        Command::Generate(a) => cmd::generate::run(a).await,
        Command::Bench(a) => cmd::bench::run(a).await,
        Command::Model { action } => cmd::model::run(action),
        Command::CacheReplay(a) => cmd::cache_replay::run(a).await,
        Command::CacheTrace(a) => cmd::cache_trace::run(a),
        Command::Certs {
            out,
            host,
            principal,
        } => cmd::certs::run(&out, &host, &principal),
        Command::Status { scheduler } => cmd::status::run(&scheduler).await,
        Command::Audit { cache, whole } => cmd::audit::run(&cache, whole).await,
        Command::Health {
            addr,
            service,
            timeout_ms,
        } => cmd::health::run(&addr, &service, timeout_ms).await,
    }
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;
    use kvlease_runtime::process::missing_help;

    /// Issue 25, point 5: `--policy` and `--on-exhausted` had no help text.
    /// Every flag, positional argument and subcommand of every binary says
    /// what it is in `--help`: this one's and the four services'.
    #[test]
    fn every_argument_of_every_binary_has_help() {
        let binaries = [
            super::Cli::command(),
            <cache_svc::Config as CommandFactory>::command(),
            <scheduler_svc::Config as CommandFactory>::command(),
            <worker_svc::Config as CommandFactory>::command(),
            <kvlease_gateway::Config as CommandFactory>::command(),
        ];
        let missing: Vec<String> = binaries.iter().flat_map(missing_help).collect();
        assert!(
            missing.is_empty(),
            "arguments without help:\n  {}",
            missing.join("\n  ")
        );
    }
}
