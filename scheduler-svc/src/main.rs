//! `kvlease-scheduler`: the scheduler service binary.

use std::process::ExitCode;

#[tokio::main]
async fn main() -> ExitCode {
    kvlease_runtime::process::main(scheduler_svc::SERVICE, scheduler_svc::run).await
}
