//! The crate's one error type: why a server could not start or stopped
//! serving.

/// Result alias for this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Errors from binding listeners and serving.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A listener could not be bound.
    #[error("cannot listen for {what} on {addr}: {source}")]
    Bind {
        /// What the listener was for: `grpc`, `metrics` or `http`.
        what: &'static str,
        /// The address.
        addr: std::net::SocketAddr,
        /// The operating system's complaint.
        #[source]
        source: std::io::Error,
    },
    /// gRPC reflection could not read the descriptor set it was given.
    #[error("cannot build grpc reflection: {0}")]
    Reflection(String),
    /// The transport security does not allow serving (plaintext off loopback without
    /// `--insecure`, bad TLS material).
    #[error("{0}")]
    Security(#[from] kvlease_auth::Error),
    /// The gRPC server failed.
    #[error("grpc server: {0}")]
    Serve(#[source] tonic::transport::Error),
}

impl From<Error> for tonic::Status {
    fn from(err: Error) -> Self {
        // Runtime errors never come from a caller's input: they are the server's own problem.
        tonic::Status::internal(err.to_string())
    }
}
