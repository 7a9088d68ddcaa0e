//! `kvlease-worker`: serves one model replica's KV arena and forward pass.

use std::process::ExitCode;

#[tokio::main]
async fn main() -> ExitCode {
    kvlease_runtime::process::main(worker_svc::SERVICE, worker_svc::run).await
}
