//! kvlease worker: model, KV arena and forward pass over leased blocks.
//!
//! The worker owns the physical KV memory of one model replica and runs
//! forward passes of a Llama-style decoder (RMSNorm, RoPE, grouped-query
//! attention, SwiGLU, per-layer sliding windows) over the blocks that the
//! scheduler's leases name. Default backend: CPU; with the `cuda` feature,
//! `--backend cuda|auto` runs on an NVIDIA GPU.
//!
//! # Layout
//!
//! - `config`: flags (`KVLEASE_WORKER_*` fallbacks) → model shape, weights, options ([`Config`]).
//! - [`model`]: [`ModelConfig`](model::ModelConfig), [`Weights`](model::weights::Weights)
//!   (seeded or safetensors), the byte-level [`tokenizer`](model::tokenizer), and
//!   [`model::load`]: a real model from a GGUF file or a Hugging Face directory.
//! - [`arena`]: pool geometry (where each K/V row lives) and the ledger of written slots.
//! - [`batch`]: a Forward batch in domain terms; [`batch::validate`] checks all of it
//!   before anything is written.
//! - [`disk`]: the file-backed disk tier below the host tier (one checksummed,
//!   fingerprinted file per block; kept across restarts), which `worker` writes on a
//!   spill and reads on a load.
//! - [`ops`]: the numeric building blocks (RMSNorm, RoPE, softmax, row-exact
//!   `gemm` products) of the CPU backend and the reference; [`threads`]: whether a
//!   product may spread over the rayon pool, a leaf both `ops` and `packed` use.
//! - [`dequant`]: the GGUF tensor types and their dequantization, a leaf that
//!   [`model`] (loading) and [`packed`] (products over quantized blocks) both use.
//! - [`packed`]: Q4_0/Q4_1/Q8_0 matrices kept in their GGUF blocks, and row-exact
//!   products (AVX2+FMA or portable) that dequantize tiles of them on the fly.
//! - [`backend`]: the compute trait; [`backend::cpu`] owns the host arena and runs
//!   batched projections (`gemm`) and paged attention (rayon over sequences × KV heads);
//!   `backend::cuda` (feature `cuda`) keeps weights and a 16-bit arena on the GPU,
//!   with NVRTC kernels and cuBLAS products.
//! - [`worker`]: sizes the arena from the memory budget, then validate → backend → sample.
//! - [`sampling`]: how a logits row becomes a token (logit bias, penalties, min_tokens,
//!   temperature, top-k/top-p/min-p, a grammar's mask), seeded by (seed, position);
//!   `history`: the token counts of penalised sequences, and `grammar`: the grammar
//!   matchers of constrained ones (structured output), both kept between passes.
//! - [`logits`]: a pass's logits rows ([`logits::BatchLogits`]), read by
//!   `sampling` and `logprobs`.
//! - [`logprobs`]: a logits row's log-probabilities (the chosen token's and the top
//!   alternatives, of the raw distribution), asked per row of a pass
//!   ([`logprobs::LogprobRow`]) and computed by the backend where the logits are.
//! - [`reference`](mod@reference): a dense, contiguous-KV reference of the same model for tests.
//! - `gpu_bench` (features `cuda` and `bench`): a CUDA [`worker::Worker`] timed end to end,
//!   for the GPU benches; it sits above the worker, which never reaches back to it.
//! - [`peer`]: peer pull's plain parts (a `PullBlocks` request checked against
//!   the arena, blocks cut into chunks and put back together, a Forward
//!   sequence's pull checked against its tables); `service` makes the calls.
//! - The gRPC edge: `convert` (protobuf <-> domain; with `service` the only
//!   place that touches protobuf types), `service` (`kvlease.v1.WorkerService`),
//!   `metrics` (the worker's Prometheus series) and `server` ([`run`]: health,
//!   reflection and the metrics endpoint).
//!
//! Data flow of one Forward: `service` has `convert` turn the request into
//! [`SeqInput`](batch::SeqInput)s → `Worker::forward` validates them against the
//! model, the arena layout and the slot ledger → the backend writes every new
//! K/V row, attends and returns logits → `sampling` picks the next tokens.

pub mod arena;
pub mod backend;
pub mod batch;
mod config;
mod convert;
pub mod dequant;
pub mod disk;
mod error;
#[cfg(all(feature = "cuda", feature = "bench"))]
pub mod gpu_bench;
mod grammar;
mod history;
pub mod logits;
pub mod logprobs;
mod metrics;
pub mod model;
pub mod ops;
pub mod packed;
pub mod peer;
mod pipeline;
pub mod reference;
pub mod sampling;
mod server;
mod service;
pub mod threads;
#[cfg(feature = "bench")]
pub mod throughput;
pub mod worker;

pub use config::Config;
pub use error::{Error, Result};
pub use metrics::metric_catalog;
pub use server::{SERVICE, run, run_with_tokenizer};
