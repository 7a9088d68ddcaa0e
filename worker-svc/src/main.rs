//! `kvlease-worker`: serves one model replica's KV arena and forward pass.

use std::process::ExitCode;

use clap::Parser;

/// kvlease worker: a Llama-style model over leased KV blocks.
#[derive(Debug, Parser)]
#[command(name = "kvlease-worker", version)]
struct Cli {
    #[command(flatten)]
    config: worker_svc::Config,
}

/// Exit code for unusable configuration (EX_USAGE).
const EXIT_CONFIG: u8 = 64;

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    let _telemetry = match kvlease_telemetry::init("kvlease-worker") {
        Ok(guard) => guard,
        Err(e) => {
            eprintln!("kvlease-worker: {e}");
            return ExitCode::FAILURE;
        }
    };
    let listener = match tokio::net::TcpListener::bind(cli.config.listen).await {
        Ok(l) => l,
        Err(e) => {
            eprintln!(
                "kvlease-worker: cannot listen on {}: {e}",
                cli.config.listen
            );
            return ExitCode::from(EXIT_CONFIG);
        }
    };
    let shutdown = async {
        // If the signal handler cannot be installed, run until killed.
        if tokio::signal::ctrl_c().await.is_err() {
            std::future::pending::<()>().await;
        }
    };
    match worker_svc::run(listener, cli.config, shutdown).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(
            e @ (worker_svc::Error::Config(_)
            | worker_svc::Error::Weights { .. }
            | worker_svc::Error::MemoryBudget { .. }),
        ) => {
            eprintln!("kvlease-worker: {e}");
            ExitCode::from(EXIT_CONFIG)
        }
        Err(e) => {
            eprintln!("kvlease-worker: {e}");
            ExitCode::FAILURE
        }
    }
}
