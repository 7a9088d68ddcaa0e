//! One module per subcommand: its flags (a clap `Args` struct, where it has
//! more than a few) and `run`, which turns them into the library's options,
//! calls it and maps the outcome to the exit code: 0, 1 for a failure,
//! [`EXIT_USAGE`](kvlease_runtime::process::EXIT_USAGE) for a usage error.

pub(crate) mod audit;
pub(crate) mod bench;
pub(crate) mod cache_replay;
pub(crate) mod cache_trace;
pub(crate) mod certs;
pub(crate) mod demo;
pub(crate) mod generate;
pub(crate) mod health;
pub(crate) mod model;
pub(crate) mod status;
pub(crate) mod up;

use std::process::ExitCode;

/// Prints `e` and gives exit code 1.
pub(crate) fn failed(e: impl std::fmt::Display) -> ExitCode {
    eprintln!("kvlease: {e}");
    ExitCode::FAILURE
}

/// The file a `--model` value names (a fetched known model, or a path), or
/// the usage error's exit code, printed.
pub(crate) fn model_path(model: &str) -> Result<std::path::PathBuf, ExitCode> {
    kvlease::models::home(|k| std::env::var_os(k))
        .and_then(|home| kvlease::models::resolve(model, &home))
        .map_err(|e| {
            eprintln!("kvlease: {e}");
            ExitCode::from(kvlease_runtime::process::EXIT_USAGE)
        })
}
