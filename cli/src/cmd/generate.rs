//! `kvlease generate`: stream a completion of TEXT from a scheduler.

use std::process::ExitCode;

use kvlease::commands::{self, GenerateOptions};

use super::failed;

#[derive(Debug, clap::Args)]
pub(crate) struct GenerateArgs {
    /// The prompt (with --chat, the user message).
    text: String,
    /// The scheduler's gRPC address.
    #[arg(
        long,
        env = "KVLEASE_SCHEDULER_ADDR",
        default_value = "127.0.0.1:50051"
    )]
    scheduler: String,
    /// Most tokens to generate (prompt + max tokens must fit in the
    /// scheduler's context).
    #[arg(long, default_value_t = 64)]
    max_tokens: u32,
    /// 0 = greedy.
    #[arg(long, default_value_t = 0.0)]
    temperature: f32,
    /// Nucleus sampling: sample among the most likely tokens whose
    /// probabilities add up to this (1 = all).
    #[arg(long, default_value_t = 1.0)]
    top_p: f32,
    /// Seed of the sampling (the same seed samples the same text).
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Partitions prefix reuse within the caller's tenant: only requests
    /// with the same salt share cached prefixes.
    #[arg(long, default_value = "")]
    cache_salt: String,
    /// Send TEXT as a user message, rendered with the model's chat template.
    #[arg(long)]
    chat: bool,
    /// Stop when the output contains this string (repeatable).
    #[arg(long)]
    stop: Vec<String>,
}

/// Runs `kvlease generate` with `a`: exit 1 when the request was rejected.
pub(crate) async fn run(a: GenerateArgs) -> ExitCode {
    let options = GenerateOptions {
        scheduler: a.scheduler,
        text: a.text,
        max_tokens: a.max_tokens,
        temperature: a.temperature,
        top_p: a.top_p,
        seed: a.seed,
        cache_salt: a.cache_salt,
        chat: a.chat,
        stop: a.stop,
    };
    match commands::generate(options).await {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => failed(e),
    }
}
