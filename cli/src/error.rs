//! The crate's error type and its mapping to gRPC status codes.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

/// Result alias of the crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything the `kvlease` command can fail with.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A command-line value that cannot be used.
    #[error("invalid argument: {0}")]
    Usage(String),
    /// An address that is not a gRPC endpoint.
    #[error("invalid address {addr:?}: {message}")]
    Address { addr: String, message: String },
    /// A peer that cannot be reached.
    #[error("cannot connect to {addr}: {message}")]
    Connect { addr: String, message: String },
    /// A call that failed with a status.
    #[error("{method} failed ({code:?}): {message}")]
    Rpc {
        method: &'static str,
        code: tonic::Code,
        message: String,
    },
    /// A call that did not answer in time.
    #[error("{method} did not answer within {within:?}")]
    Timeout {
        method: &'static str,
        within: Duration,
    },
    /// A trace file that cannot be read.
    #[error("cannot read trace {path}: {source}")]
    TraceIo {
        path: PathBuf,
        source: std::io::Error,
    },
    /// A line of a trace file that is not a Mooncake record.
    #[error("trace {path} line {line}: {message}")]
    TraceParse {
        path: PathBuf,
        line: usize,
        message: String,
    },
    /// A loopback port that cannot be bound.
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        addr: SocketAddr,
        source: std::io::Error,
    },
    /// A model cannot be fetched or found.
    #[error("model: {0}")]
    Model(String),
    /// A service of the in-process cluster stopped or failed to start.
    #[error("{service} failed: {message}")]
    Service {
        service: &'static str,
        message: String,
    },
    /// A worker's memory budget cannot even hold the model.
    #[error(
        "--memory-budget-mib must be at least {at_least_mib} (got {budget_mib}): the model's \
         weights and activations take {taken_mib:.1} MiB, and the KV blocks of its longest \
         sequence the rest"
    )]
    MemoryBudget {
        budget_mib: u64,
        taken_mib: f64,
        at_least_mib: u64,
    },
    /// A service of the in-process cluster did not become ready.
    #[error("{service} did not become ready within {within:?}")]
    NotReady {
        service: &'static str,
        within: Duration,
    },
}

impl Error {
    /// Wraps the status of a failed call.
    pub fn rpc(method: &'static str, status: tonic::Status) -> Self {
        Self::Rpc {
            method,
            code: status.code(),
            message: status.message().to_string(),
        }
    }
}

impl From<Error> for tonic::Status {
    fn from(e: Error) -> Self {
        use tonic::Code;
        let code = match &e {
            Error::Usage(_)
            | Error::Address { .. }
            | Error::TraceParse { .. }
            | Error::MemoryBudget { .. } => Code::InvalidArgument,
            Error::Connect { .. } | Error::NotReady { .. } => Code::Unavailable,
            Error::Rpc { code, .. } => *code,
            Error::Timeout { .. } => Code::DeadlineExceeded,
            Error::TraceIo { .. } => Code::NotFound,
            Error::Bind { .. } | Error::Service { .. } | Error::Model(_) => Code::Internal,
        };
        tonic::Status::new(code, e.to_string())
    }
}
