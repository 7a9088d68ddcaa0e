//! `kvlease demo`: over-subscribe a small KV pool in an in-process cluster
//! and show what happened.

use std::process::ExitCode;

use kvlease::demo::{self, DemoOptions};
use scheduler_svc::policy::OnExhausted;

use super::failed;

#[derive(Debug, clap::Args)]
pub(crate) struct DemoArgs {
    /// Requests each phase sends.
    #[arg(long, default_value_t = DemoOptions::default().requests)]
    requests: usize,
    /// Requests in flight at once: far more than the pool holds.
    #[arg(long, default_value_t = DemoOptions::default().concurrency)]
    concurrency: usize,
    /// Worker memory budget in MiB (it sizes the KV pool).
    #[arg(long, default_value_t = DemoOptions::default().memory_budget_mib)]
    memory_budget_mib: u64,
    /// A running request that cannot grow: preempt (recompute later) or
    /// reject. Default: one phase of each, on a fresh cluster.
    #[arg(long)]
    on_exhausted: Option<OnExhausted>,
    /// Preemptions a request may suffer before it is rejected.
    #[arg(long, default_value_t = DemoOptions::default().max_preemptions)]
    max_preemptions: u32,
    /// Seed of the workload (prompt and output lengths, shared prefixes).
    #[arg(long, default_value_t = DemoOptions::default().seed)]
    seed: u64,
}

/// Runs `kvlease demo` with `a`.
pub(crate) async fn run(a: DemoArgs) -> ExitCode {
    let options = DemoOptions {
        requests: a.requests,
        concurrency: a.concurrency,
        memory_budget_mib: a.memory_budget_mib,
        modes: a
            .on_exhausted
            .map_or_else(|| DemoOptions::default().modes, |m| vec![m]),
        max_preemptions: a.max_preemptions,
        seed: a.seed,
    };
    match demo::run(options).await {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => failed("the cluster did not end whole (see above)"),
        Err(e) => failed(e),
    }
}
