//! `kvlease-scheduler`: the scheduler service binary.

use clap::Parser;
use scheduler_svc::Config;

#[tokio::main]
async fn main() {
    let config = Config::parse();
    if let Err(e) = config.validate() {
        eprintln!("kvlease-scheduler: {e}");
        std::process::exit(64);
    }
    // The guard flushes telemetry when main returns.
    let _telemetry = match kvlease_telemetry::init("kvlease-scheduler") {
        Ok(guard) => guard,
        Err(e) => {
            eprintln!("kvlease-scheduler: {e}");
            std::process::exit(1);
        }
    };
    let listener = match tokio::net::TcpListener::bind(config.listen).await {
        Ok(l) => l,
        Err(e) => {
            eprintln!("kvlease-scheduler: cannot listen on {}: {e}", config.listen);
            std::process::exit(64);
        }
    };
    let shutdown = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    if let Err(e) = scheduler_svc::run(listener, config, shutdown).await {
        eprintln!("kvlease-scheduler: {e}");
        std::process::exit(1);
    }
}
