//! `kvlease health`: a service's gRPC health check.

use std::process::ExitCode;
use std::time::Duration;

use kvlease::commands;

use super::failed;

/// Runs `kvlease health`: exit 0 when `service` at `addr` is SERVING within
/// `timeout_ms` (at least 1), 1 otherwise.
pub(crate) async fn run(addr: &str, service: &str, timeout_ms: u64) -> ExitCode {
    match commands::health(addr, service, Duration::from_millis(timeout_ms.max(1))).await {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => failed(e),
    }
}
