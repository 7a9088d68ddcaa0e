use std::path::PathBuf;

/// What can go wrong setting up the trust boundary (reading certificates, keys, token files;
/// generating certificates). Requests never see these: a refused call is a `tonic::Status`
/// made by [`crate::layer`].
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("cannot read {what} {path}: {source}")]
    Read {
        what: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot write {path}: {source}")]
    Write {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("token file {path} line {line}: {message}")]
    TokenFile {
        path: PathBuf,
        line: usize,
        message: String,
    },
    #[error("unknown role {0:?} (roles: scheduler, client, observer, admin)")]
    UnknownRole(String),
    #[error("{0}")]
    Config(String),
    #[error("the system's secure random generator failed")]
    Random,
    #[error("certificate generation failed: {0}")]
    Generate(#[from] rcgen::Error),
    #[error("tls set-up failed: {0}")]
    Tls(#[from] tonic::transport::Error),
}

pub type Result<T, E = Error> = std::result::Result<T, E>;
