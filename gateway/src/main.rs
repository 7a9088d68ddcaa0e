//! `kvlease-gateway`: the OpenAI-compatible HTTP front, as its own process.

use clap::Parser;
use kvlease_gateway::Config;

#[tokio::main]
async fn main() {
    let config = Config::parse();
    if let Err(e) = config.validate() {
        eprintln!("kvlease-gateway: {e}");
        std::process::exit(64);
    }
    // The guard flushes telemetry when main returns.
    let _telemetry = match kvlease_telemetry::init("kvlease-gateway") {
        Ok(guard) => guard,
        Err(e) => {
            eprintln!("kvlease-gateway: {e}");
            std::process::exit(1);
        }
    };
    let listener = match kvlease_runtime::serve::bind("http", config.listen).await {
        Ok(l) => l,
        Err(e) => {
            eprintln!("kvlease-gateway: {e}");
            std::process::exit(64);
        }
    };
    // SIGTERM too: Kubernetes stops a pod with it, and in-flight streams get to finish
    let shutdown = kvlease_runtime::process::shutdown_signal();
    if let Err(e) = kvlease_gateway::run(listener, config, shutdown).await {
        eprintln!("kvlease-gateway: {e}");
        std::process::exit(1);
    }
}
