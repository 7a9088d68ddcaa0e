//! `kvlease cache-trace`: write a generated multi-turn conversation trace
//! (Mooncake JSON lines).

use std::path::PathBuf;
use std::process::ExitCode;

use kvlease::replay::conversations::{self, Agent, Conversations};
use kvlease_runtime::process::EXIT_USAGE;

use super::failed;

#[derive(Debug, clap::Args)]
pub(crate) struct CacheTraceArgs {
    /// File to write.
    #[arg(long)]
    out: PathBuf,
    /// `conversations` (multi-turn chat) or `agent` (long shared tool
    /// prompts, sessions returning after long gaps between one-off flood
    /// requests, each session request with `retain_tokens` = its tool
    /// prompt's length; only `--sessions` and `--seed` apply,
    /// the other shape flags are the chat's).
    #[arg(long, value_enum, default_value_t = TraceKind::Conversations)]
    kind: TraceKind,
    /// Conversations (or agent sessions) in the trace.
    #[arg(long, default_value_t = Conversations::default().sessions)]
    sessions: usize,
    /// Blocks every request opens with, before its system prompt (a prompt
    /// every session shares; 0 = none).
    #[arg(long, default_value_t = Conversations::default().shared_root_blocks)]
    shared_root_blocks: u32,
    /// Distinct system prompts.
    #[arg(long, default_value_t = Conversations::default().system_prompts)]
    system_prompts: u32,
    /// Zipf exponent of system prompt popularity.
    #[arg(long, default_value_t = Conversations::default().zipf)]
    zipf: f64,
    /// Probability that a conversation comes back after a turn.
    #[arg(long, default_value_t = Conversations::default().return_probability)]
    return_probability: f64,
    /// Most turns of one conversation.
    #[arg(long, default_value_t = Conversations::default().max_turns)]
    max_turns: u32,
    /// Mean think time between turns, in milliseconds.
    #[arg(long, default_value_t = Conversations::default().think_ms)]
    think_ms: f64,
    /// Mean gap between new conversations, in milliseconds.
    #[arg(long, default_value_t = Conversations::default().arrival_gap_ms)]
    arrival_gap_ms: f64,
    /// Seed of the trace (the same flags and seed write the same trace).
    #[arg(long, default_value_t = 1)]
    seed: u64,
}

/// What `cache-trace` generates.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum TraceKind {
    Conversations,
    Agent,
}

/// Runs `kvlease cache-trace` with `a`.
pub(crate) fn run(a: CacheTraceArgs) -> ExitCode {
    if !(0.0..=1.0).contains(&a.return_probability) {
        eprintln!("kvlease: --return-probability must be in [0, 1]");
        return ExitCode::from(EXIT_USAGE);
    }
    let records = if a.kind == TraceKind::Agent {
        Agent {
            sessions: a.sessions,
            seed: a.seed,
            ..Agent::default()
        }
        .records()
    } else {
        Conversations {
            sessions: a.sessions,
            shared_root_blocks: a.shared_root_blocks,
            system_prompts: a.system_prompts,
            zipf: a.zipf,
            return_probability: a.return_probability,
            max_turns: a.max_turns,
            think_ms: a.think_ms,
            arrival_gap_ms: a.arrival_gap_ms,
            seed: a.seed,
            ..Conversations::default()
        }
        .records()
    };
    match std::fs::write(&a.out, conversations::to_jsonl(&records)) {
        Ok(()) => {
            println!("wrote {} requests to {}", records.len(), a.out.display());
            ExitCode::SUCCESS
        }
        Err(e) => failed(format!("cannot write {}: {e}", a.out.display())),
    }
}
