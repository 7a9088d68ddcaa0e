//! The service runtime every kvlease binary shares: how a process starts and
//! stops, and what every server wraps around its one gRPC service.
//!
//! # Layout
//!
//! - [`process`]: what every binary's `main` does (flags parsed by clap, exit
//!   code 64 for usage and configuration errors, telemetry started, listeners
//!   bound, one SIGINT/SIGTERM handler).
//! - [`serve`]: what every kvlease server wraps around its one gRPC service
//!   (listeners bound by the caller, health, reflection, the metrics endpoint,
//!   transport security and authorization, the stop signal).
//! - [`limits`]: the transport limits every server shares ([`limits::ServeLimits`]
//!   flags, the connection gate, the status fix-up layer); the gateway's HTTP
//!   server uses the gate too.
//! - `accept`: the connections a gRPC server takes from its listener.
//! - [`echo`]: how much of a caller's input an error message may quote.
//! - `error`: [`Error`], why a server could not start or stopped serving.
//!
//! Data flow: `process::main` parses and checks a service's configuration,
//! starts `kvlease-telemetry`, binds [`serve::Listeners`] and calls the
//! service's `run`, which hands its service to [`serve::serve`]; that admits
//! connections through the [`limits::Gate`] and stops on the shutdown signal.
//!
//! It is a crate of its own, apart from `kvlease-telemetry` (logs, traces,
//! metrics), because every binary needs it and none of the service crates
//! depend on each other.

mod accept;
pub mod echo;
mod error;
pub mod limits;
pub mod process;
pub mod serve;

pub use error::{Error, Result};
