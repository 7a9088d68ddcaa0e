//! The crate's error type and its mapping to gRPC status codes.

use tonic::{Code, Status};

/// Result alias of the crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong in the scheduler.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Bad configuration (exit code 64 in the binary).
    #[error("invalid configuration: {0}")]
    Config(String),
    /// A client request is malformed.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// A field of a client request is out of range or malformed: the status
    /// names it in [`kvlease_proto::INVALID_FIELD_METADATA`].
    #[error("invalid argument: {message}")]
    InvalidField {
        /// The `GenerateRequest` field.
        field: &'static str,
        message: String,
    },
    /// The caller may not do what it asked (name a tenant, see the cache session).
    #[error("permission denied: {0}")]
    PermissionDenied(String),
    /// The cache service cannot be reached (or timed out).
    #[error("cache service unavailable: {0}")]
    CacheUnavailable(String),
    /// The cache no longer knows the session (restart, expiry, stale epoch).
    #[error("cache session lost: {0}")]
    SessionLost(String),
    /// A peer answered a call with an error status.
    #[error("{peer} {method} failed ({code:?}): {message}")]
    Rpc {
        peer: &'static str,
        method: &'static str,
        code: Code,
        message: String,
    },
    /// A peer address is not a valid endpoint.
    #[error("invalid {peer} address {addr:?}: {message}")]
    Address {
        peer: &'static str,
        addr: String,
        message: String,
    },
    /// A peer answered with something the protocol does not allow.
    #[error("protocol violation by {peer}: {message}")]
    Protocol { peer: &'static str, message: String },
    /// A warm-up shape cannot fit in a pool: start-up fails.
    #[error(
        "warm-up shape {shape:?} of group {group:?} ({detail}) needs {needed} blocks in the pool of window {window}, which has {available}; start-up aborted"
    )]
    WarmupDoesNotFit {
        group: String,
        shape: String,
        detail: String,
        window: u32,
        needed: u32,
        available: u32,
    },
    /// The cache refused a warm-up lease.
    #[error(
        "warm-up shape {shape:?} of group {group:?} was refused by the cache: {reason}; start-up aborted"
    )]
    WarmupRejected {
        group: String,
        shape: String,
        reason: String,
    },
    /// Blocks were still held after warm-up.
    #[error(
        "pool of window {window} in group {group:?} is not whole after warm-up: {in_use} in use, {fenced} fenced; start-up aborted"
    )]
    PoolNotWhole {
        group: String,
        window: u32,
        in_use: u32,
        fenced: u32,
    },
    /// Warm-up did not finish before its deadline.
    #[error("warm-up did not finish within {deadline_ms} ms; start-up aborted")]
    WarmupDeadline { deadline_ms: u64 },
    /// The request needs something the model does not have (a chat
    /// template).
    #[error("failed precondition: {0}")]
    FailedPrecondition(String),
    /// Two workers serve models whose tokenizers differ: start-up fails.
    /// Each side reads "ADDR serves MODEL (tokenizer FINGERPRINT)".
    #[error("workers disagree on the tokenizer: {first} but {other}; start-up aborted")]
    TokenizerMismatch { first: String, other: String },
    /// The step loop has stopped.
    #[error("the scheduler is shutting down")]
    ShuttingDown,
    /// The queue holds as many requests as it may.
    #[error(
        "the scheduler's queue is full: {queued} requests wait, the limit is {limit}; retry later"
    )]
    QueueFull {
        /// Requests waiting (or on their way to the queue).
        queued: usize,
        /// The limit.
        limit: usize,
    },
    /// Serving failed (reflection, the gRPC server).
    #[error("{0}")]
    Serve(#[from] kvlease_runtime::Error),
    /// The operating system refused the step loop a thread (or its runtime
    /// its I/O driver).
    #[error("cannot start the step loop's thread or runtime: {0}")]
    StepThread(std::io::Error),
}

impl Error {
    /// Classifies a status returned by the cache service.
    pub fn from_cache(method: &'static str, status: &Status) -> Self {
        match status.code() {
            Code::Unavailable | Code::DeadlineExceeded | Code::Cancelled | Code::Unknown => {
                Self::CacheUnavailable(format!("{method}: {}", status.message()))
            }
            Code::FailedPrecondition => Self::SessionLost(status.message().to_string()),
            code => Self::Rpc {
                peer: "cache",
                method,
                code,
                message: status.message().to_string(),
            },
        }
    }

    /// Classifies a status returned by a worker.
    pub fn from_worker(method: &'static str, status: &Status) -> Self {
        Self::Rpc {
            peer: "worker",
            method,
            code: status.code(),
            message: status.message().to_string(),
        }
    }
}

impl From<Error> for Status {
    fn from(e: Error) -> Self {
        let message = e.to_string();
        match e {
            Error::Config(_) | Error::InvalidArgument(_) => Status::invalid_argument(message),
            Error::InvalidField { field, .. } => {
                let mut s = Status::invalid_argument(message);
                s.metadata_mut().insert(
                    kvlease_proto::INVALID_FIELD_METADATA,
                    tonic::metadata::MetadataValue::from_static(field),
                );
                s
            }
            Error::PermissionDenied(_) => Status::permission_denied(message),
            Error::CacheUnavailable(_) | Error::ShuttingDown => Status::unavailable(message),
            Error::QueueFull { .. } => Status::resource_exhausted(message),
            Error::SessionLost(_) => Status::unavailable(message),
            Error::FailedPrecondition(_)
            | Error::TokenizerMismatch { .. }
            | Error::WarmupDoesNotFit { .. }
            | Error::WarmupRejected { .. }
            | Error::PoolNotWhole { .. } => Status::failed_precondition(message),
            Error::WarmupDeadline { .. } => Status::deadline_exceeded(message),
            Error::Rpc { .. }
            | Error::Address { .. }
            | Error::Protocol { .. }
            | Error::Serve(_)
            | Error::StepThread(_) => Status::internal(message),
        }
    }
}
