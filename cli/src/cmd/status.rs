//! `kvlease status`: a scheduler's queue, counters and pool figures.

use std::process::ExitCode;

use kvlease::commands;

use super::failed;

/// Runs `kvlease status` against the scheduler at `scheduler`.
pub(crate) async fn run(scheduler: &str) -> ExitCode {
    match commands::status(scheduler).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => failed(e),
    }
}
