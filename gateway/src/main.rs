//! `kvlease-gateway`: the OpenAI-compatible HTTP front, as its own process,
//! on the `main` every kvlease binary shares (exit code 64 for usage and
//! configuration errors; SIGINT or SIGTERM stop it, in-flight streams finish).

use std::process::ExitCode;

#[tokio::main]
async fn main() -> ExitCode {
    kvlease_runtime::process::main(kvlease_gateway::SERVICE, |listeners, config, shutdown| {
        // the main listener serves HTTP here; the gateway has no metrics endpoint
        kvlease_gateway::run(listeners.grpc, config, shutdown)
    })
    .await
}
