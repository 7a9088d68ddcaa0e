//! kvlease scheduler: continuous batching on leased KV blocks.
//!
//! The scheduler serves `kvlease.v1.Scheduler` to clients, leases KV blocks
//! from the cache service and runs forward passes on the workers. Running out
//! of blocks is an answer, never a crash: a refused sequence is dropped from
//! its step and preempted or finished `REJECTED`, and the loop keeps stepping.
//!
//! # Layout
//!
//! - `domain.rs`: plain types (tables, grants, rejects, forward items, outputs).
//! - `queue.rs`: waiting requests, first come first served.
//! - `policy.rs`: the capacity policies (what to admit given pool figures).
//! - `routing.rs`: the routing policies (`kv-aware`: prefill after prefix
//!   reuse plus load, Dynamo's cost; `least-committed`) that pick the group
//!   admitting a request.
//! - `spec.rs`: prompt-lookup drafting and verification.
//! - `beam.rs`: beam search's choices (which continuations survive or end,
//!   when a search is done, how hypotheses rank), applied by `step::Core`.
//! - `step/`: the step loop's core (`step::Core`): plans each step
//!   (extends, admissions, forward batch), applies lease outcomes and
//!   forward results, says what to release, fenced at which step, and when a
//!   step is complete; and the order of a step's calls (`step::StepPlan`),
//!   which the loop and the core's model-checked test driver both execute.
//! - `warmup.rs`: the warm-up shapes and their block estimate.
//!   (All of the above are synchronous and free of protobuf types.)
//!   Prompts are encoded and output decoded with the model's tokenizer
//!   (`kvlease-tokenizer`), fetched from the workers at start-up.
//! - `client.rs`: the cache and worker gRPC clients (messages via `convert.rs`).
//! - `session.rs`: the cache session every client clone shares (id, epoch,
//!   up, lost).
//! - `keepalive.rs`: renewing that session, and re-opening it after a loss.
//! - `bootstrap.rs`: start-up: describe workers, register pools, warm up.
//! - `step_loop/`: the async step loop: drives `step::Core` over the
//!   clients (I/O only), one file per job (the loop, the service's handle,
//!   the cache calls, the forward passes, reporting).
//! - `traces.rs`: the service name in traces ([`SERVICE`]), what the loop writes into each request's trace (queue,
//!   lease, preempt, forward summary, release) and the step-trace sampling.
//! - `convert.rs`: protobuf <-> domain (Generate requests checked against the
//!   limits, every cache and worker request built from domain types, their
//!   answers read back); with `service.rs` and `client.rs` the only place
//!   that knows protobuf types.
//! - `service.rs`: the `Scheduler` API: hands requests to the step loop and
//!   streams its outputs.
//! - `metrics.rs`: Prometheus instruments the loop updates.
//! - `server.rs`: [`run`], which wires it all to its listeners (health,
//!   reflection and the metrics endpoint come from `kvlease-telemetry`).
//! - `config.rs`, `error.rs`.
//!
//! Only `domain`, `queue`, `policy`, `routing`, `beam`, `step` and `error` are public
//! modules (the benches, the CLI and the integration tests use them); the
//! rest is private behind [`run`] and [`Config`].
//!
//! Data flow: `service` -> (submission) -> `step_loop` -> `step::Core` plans ->
//! `client` RPCs -> outcomes back into `Core` -> outputs -> `service` streams.

pub mod beam;
mod bootstrap;
mod client;
mod config;
mod convert;
pub mod domain;
pub mod error;
mod keepalive;
mod metrics;
pub mod policy;
pub mod queue;
pub mod routing;
mod server;
mod service;
mod session;
mod spec;
pub mod step;
mod step_loop;
mod tenant;
mod traces;
mod warmup;

pub use config::{Config, OnCacheRestart};
pub use error::{Error, Result};
pub use metrics::metric_catalog;
pub use server::run;
pub use traces::SERVICE;
