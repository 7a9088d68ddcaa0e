//! `kvlease-cache`: serves the cache service.

use std::process::ExitCode;

#[tokio::main]
async fn main() -> ExitCode {
    kvlease_runtime::process::main(cache_svc::SERVICE, cache_svc::run).await
}
