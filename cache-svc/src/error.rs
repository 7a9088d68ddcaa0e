//! Errors of the cache service. Per-sequence outcomes (grants and rejects) are
//! data, never errors: these are for the call itself.

use crate::ids::{Epoch, SessionId, Step};

/// A cache service error.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The request is malformed; the message says which field and why.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// A batch or message limit was exceeded; the message names the limit.
    #[error("limit exceeded: {0}")]
    LimitExceeded(String),
    /// No such session (never opened, closed, or reclaimed after expiry).
    #[error("unknown session {0}")]
    UnknownSession(SessionId),
    /// The session was opened by another principal.
    #[error("session {session} belongs to another principal; {caller} may not use it")]
    NotOwner {
        /// The session.
        session: SessionId,
        /// The principal that tried.
        caller: String,
    },
    /// A pool group another principal registered (`Match`, `Lease`, or
    /// `RegisterPool` of it again).
    #[error("pool group {group:?} belongs to another principal; {caller} may not use it")]
    GroupNotOwned {
        /// The group.
        group: String,
        /// The principal that asked.
        caller: String,
    },
    /// The session's TTL ran out; everything it held was reclaimed.
    #[error("session expired: session {0} missed its keep-alive and was reclaimed")]
    SessionExpired(SessionId),
    /// The call carries the epoch of an earlier start of the service.
    #[error("stale epoch {got}: the cache service restarted, current epoch is {current}")]
    StaleEpoch {
        /// The epoch in the request.
        got: Epoch,
        /// The service's epoch.
        current: Epoch,
    },
    /// A Lease at a step the session already reported complete: its blocks
    /// could never be published for reuse.
    #[error(
        "lease at step {step}, but the session already completed step {completed}: lease at a later step so its blocks can be published"
    )]
    StepAlreadyCompleted {
        /// The step of the Lease.
        step: Step,
        /// The session's last completed step.
        completed: Step,
    },
    /// No pool group of that name is registered. The name is the caller's,
    /// never checked: it is named back clipped.
    #[error("unknown pool group {}", clip(.0))]
    UnknownGroup(String),
    /// The group is registered with another geometry.
    #[error("pool group {group:?} is registered with another geometry: {detail}")]
    GeometryConflict {
        /// The group.
        group: String,
        /// What differs.
        detail: String,
    },
    /// UnregisterPool of a group whose blocks are still held.
    #[error("pool group {group:?} is still in use: {detail}")]
    GroupBusy {
        /// The group.
        group: String,
        /// The pools that hold blocks, with their counts.
        detail: String,
    },
    /// A new worker incarnation of a group a session still holds blocks of
    /// or copies blocks of (`RegisterPool`): retry once it is done.
    #[error("pool group {group:?} cannot take a new worker incarnation yet: {detail}")]
    IncarnationBusy {
        /// The group.
        group: String,
        /// The pools that hold blocks, with their counts.
        detail: String,
    },
    /// The service's configuration is refused (a flag out of range, a
    /// certificate that does not load); `run` fails before serving.
    #[error("invalid configuration: {0}")]
    Config(String),
    /// An I/O error (binding, reading the listener address).
    #[error("io: {0}")]
    Io(#[from] std::io::Error),
    /// Serving failed (listeners, reflection, the gRPC server).
    #[error("{0}")]
    Serve(#[from] kvlease_runtime::Error),
}

/// A name the caller sent, quoted as far as the longest valid name (128
/// bytes) goes: a 1 MB one echoed whole pushed the reply over the message cap
/// (issue 29, point 9).
fn clip(name: &str) -> String {
    kvlease_runtime::echo::clip(name, 128)
}

/// Result alias of the crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl From<Error> for tonic::Status {
    fn from(err: Error) -> Self {
        let message = err.to_string();
        match err {
            Error::InvalidArgument(_) => tonic::Status::invalid_argument(message),
            Error::LimitExceeded(_) => tonic::Status::resource_exhausted(message),
            Error::NotOwner { .. } | Error::GroupNotOwned { .. } => {
                tonic::Status::permission_denied(message)
            }
            Error::UnknownSession(_)
            | Error::SessionExpired(_)
            | Error::StaleEpoch { .. }
            | Error::StepAlreadyCompleted { .. }
            | Error::GroupBusy { .. } => tonic::Status::failed_precondition(message),
            Error::IncarnationBusy { .. } => tonic::Status::aborted(message),
            Error::UnknownGroup(_) => tonic::Status::not_found(message),
            Error::GeometryConflict { .. } => tonic::Status::already_exists(message),
            Error::Config(_) | Error::Io(_) | Error::Serve(_) => tonic::Status::internal(message),
        }
    }
}
