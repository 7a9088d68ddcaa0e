//! `kvlease-cache`: serves the cache service.

use std::process::ExitCode;

use clap::Parser;

#[tokio::main]
async fn main() -> ExitCode {
    let config = cache_svc::Config::parse();
    if let Err(problem) = config.validate() {
        eprintln!("kvlease-cache: bad configuration: {problem}");
        return ExitCode::from(64);
    }
    let _telemetry = match kvlease_telemetry::init("kvlease-cache") {
        Ok(guard) => guard,
        Err(err) => {
            eprintln!("kvlease-cache: {err}");
            return ExitCode::from(64);
        }
    };
    let listener = match tokio::net::TcpListener::bind(config.listen).await {
        Ok(l) => l,
        Err(err) => {
            eprintln!("kvlease-cache: cannot listen on {}: {err}", config.listen);
            return ExitCode::from(64);
        }
    };
    let shutdown = async {
        // Ctrl-C for a terminal, SIGTERM for a container stop.
        let mut term =
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(s) => s,
                Err(err) => {
                    tracing::warn!(error = %err, "cannot watch SIGTERM; Ctrl-C only");
                    let _ = tokio::signal::ctrl_c().await;
                    return;
                }
            };
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = term.recv() => {}
        }
        tracing::info!("shutting down");
    };
    match cache_svc::run(listener, config, shutdown).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            tracing::error!(error = %err, "cache service failed");
            ExitCode::FAILURE
        }
    }
}
