//! `kvlease bench`: drive load (synthetic, or a Mooncake trace) through a
//! scheduler and print a table.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use kvlease::bench::Load;
use kvlease::commands::{self, Source};
use kvlease::mooncake::Expand;
use kvlease::workload::Synthetic;

use super::failed;

#[derive(Debug, clap::Args)]
pub(crate) struct BenchArgs {
    /// The scheduler's gRPC address.
    #[arg(
        long,
        env = "KVLEASE_SCHEDULER_ADDR",
        default_value = "127.0.0.1:50051"
    )]
    scheduler: String,
    /// Mooncake trace (JSON lines with timestamp, input_length, output_length, hash_ids).
    #[arg(long)]
    trace: Option<PathBuf>,
    /// Trace lengths (and 512-token blocks) are divided by this.
    #[arg(long, default_value_t = 32)]
    scale: u32,
    /// Trace prompts are cut to this many tokens (keeping their prefix); 0 = no cut.
    #[arg(long, default_value_t = 1024)]
    max_prompt: u32,
    /// Trace outputs are capped at this many tokens; 0 = no cap.
    #[arg(long, default_value_t = 128)]
    max_output: u32,
    /// Replay the trace's arrival times (divided by --speedup) instead of sending as fast as possible.
    #[arg(long)]
    replay: bool,
    /// With --replay: how many times faster than the trace's clock.
    #[arg(long, default_value_t = 1.0)]
    speedup: f64,
    /// Requests to send (synthetic), or the first N of the trace (0 = all).
    #[arg(long)]
    requests: Option<usize>,
    /// Requests in flight at most.
    #[arg(long, default_value_t = 16)]
    concurrency: usize,
    /// Requests per second (overrides trace arrivals); unset = as fast as concurrency allows.
    #[arg(long)]
    rate: Option<f64>,
    /// Synthetic: shared prefixes the prompts start with.
    #[arg(long, default_value_t = 4)]
    prefixes: u32,
    /// Synthetic: length of each shared prefix, in tokens.
    #[arg(long, default_value_t = 64)]
    prefix_tokens: u32,
    /// Synthetic: shortest unique prompt tail, in tokens.
    #[arg(long, default_value_t = 16)]
    tail_min: u32,
    /// Synthetic: longest unique prompt tail, in tokens.
    #[arg(long, default_value_t = 96)]
    tail_max: u32,
    /// Synthetic: shortest output, in tokens.
    #[arg(long, default_value_t = 8)]
    output_min: u32,
    /// Synthetic: longest output, in tokens.
    #[arg(long, default_value_t = 32)]
    output_max: u32,
    /// Synthetic: seed of the workload (the same seed sends the same requests).
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Bound on one request, in seconds.
    #[arg(long, default_value_t = 300)]
    timeout_s: u64,
    /// No progress bar.
    #[arg(long)]
    no_progress: bool,
    /// Exit 1 when any request ends in an error (rejects are answers, not errors).
    #[arg(long)]
    fail_on_error: bool,
    /// Parallel samples per request (OpenAI's n, 1 to 16): the prompt is leased and prefilled
    /// once and the samples fork from it; more than one samples at temperature 1, seeded with
    /// the request's index. A request counts every sample's tokens and ends with the first
    /// sample that did not complete.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=16))]
    samples: u32,
    /// Beam search of this width per request (1 to 10; 1: off): greedy beams over the raw
    /// distribution that share KV through forks; the request answers its best `--samples`
    /// hypotheses (at most the width) at the end.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=10))]
    beam_width: u32,
}

/// Runs `kvlease bench` with `a`.
pub(crate) async fn run(a: BenchArgs) -> ExitCode {
    let source = match a.trace {
        Some(path) => Source::Trace {
            path,
            expand: Expand {
                scale: a.scale.max(1),
                max_prompt: a.max_prompt,
                max_output: a.max_output,
                speedup: a.speedup,
            },
            limit: a.requests.unwrap_or(0),
            replay: a.replay,
        },
        None => Source::Synthetic(Synthetic {
            requests: a.requests.unwrap_or(100),
            prefixes: a.prefixes,
            prefix_tokens: a.prefix_tokens,
            tail_min: a.tail_min,
            tail_max: a.tail_max,
            output_min: a.output_min,
            output_max: a.output_max,
            seed: a.seed,
        }),
    };
    let load = Load {
        concurrency: a.concurrency.max(1),
        rate: a.rate,
        timeout: Duration::from_secs(a.timeout_s.max(1)),
        progress: !a.no_progress,
        samples: a.samples,
        beam_width: a.beam_width,
    };
    if a.beam_width > 1 && a.samples > a.beam_width {
        return failed(format!(
            "--samples {} is more than --beam-width {}: a beam search answers at most its width",
            a.samples, a.beam_width
        ));
    }
    match commands::bench(&a.scheduler, source, load).await {
        Ok(s) if a.fail_on_error && s.errors_total() > 0 => {
            failed(format!("{} request(s) ended in an error", s.errors_total()))
        }
        Ok(_) => ExitCode::SUCCESS,
        Err(e) => failed(e),
    }
}
