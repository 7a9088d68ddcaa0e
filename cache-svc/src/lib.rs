//! The kvlease cache service: paged KV block pools leased to schedulers with
//! an explicit grant or reject for every sequence.
//!
//! # Layout
//! - [`pool`]: one pool's blocks and their states (free, cached, in use,
//!   fenced), the prefix-hash index and the eviction hook.
//! - [`eviction`]: the swappable eviction policy (priority, then LRU, leaves
//!   before parents).
//! - [`prefix`]: chained block hashes; `partial`: the partly filled blocks
//!   kept for partial-block reuse (found by parent hash and token ids).
//! - [`mrc`]: online miss-ratio curves (hit rates at other pool sizes) from
//!   spatially sampled shadow LRUs.
//! - [`peer`]: peer pull's copies and its cost model (pull a prefix from
//!   another group's device, or compute it).
//! - [`lease`]: the domain types of requests and answers; `ids`: the
//!   numbers the cache is handed ([`SessionId`], [`Epoch`], [`SeqId`],
//!   [`Step`], [`BlockId`]).
//! - `session`: holder sessions, their sequences' block tables, fences and
//!   hashes waiting for a step to complete.
//! - [`cache`]: the protocol over all of the above ([`Cache`]), plain and
//!   synchronous; `estimate` derives block needs in closed form.
//! - `events`: the bounded stream of stored / removed hashes, and the
//!   index events and tiers it is made of (a leaf module).
//! - The gRPC edge: `convert` (protobuf <-> domain: ids wrapped, 32-bit
//!   fields narrowed), `service` (the `CacheService` handlers: one preamble,
//!   one core call each), `trace` (the spans of a call's outcomes and the
//!   fenced-release links), `server` ([`run`]: health, reflection, the
//!   metrics endpoint, session expiry and leak audits) and `metrics`
//!   (Prometheus, read from the core at scrape time). No other module knows
//!   protobuf.
//!
//! Data flows one way: `service` has `convert` turn a request into domain
//! types, calls `Cache` under a mutex, and has the outcomes converted back.

pub mod cache;
mod config;
mod convert;
mod error;
mod estimate;
mod events;
pub mod eviction;
mod ids;
pub mod lease;
mod metrics;
pub mod mrc;
mod partial;
pub mod peer;
pub mod pool;
pub mod prefix;
pub mod retention;
mod server;
mod service;
mod session;
pub mod tier;
mod trace;
mod watchers;

pub use cache::{Batch, Cache, CacheConfig};
pub use config::Config;
pub use error::{Error, Result};
pub use ids::{BlockId, Epoch, SeqId, SessionId, Step};
pub use metrics::metric_catalog;
pub use server::{SERVICE, run};

#[cfg(test)]
mod tests;
