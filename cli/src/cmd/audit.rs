//! `kvlease audit`: a cache's leak audit, its sessions and pools.

use std::process::ExitCode;

use kvlease::commands;

use super::failed;

/// Runs `kvlease audit` against the cache at `cache`: exit 1 when the audit
/// reclaimed blocks or, with `whole`, a pool is not whole.
pub(crate) async fn run(cache: &str, whole: bool) -> ExitCode {
    match commands::audit(cache, whole).await {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => failed(e),
    }
}
