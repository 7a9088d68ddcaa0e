//! The crate's error type.

/// What went wrong building or using a tokenizer.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A tokenizer file or GGUF vocabulary that cannot be used as it is.
    #[error("{0}")]
    Invalid(String),
    /// Reading a tokenizer file failed.
    #[error("cannot read {path}: {message}")]
    Read { path: String, message: String },
    /// The `tokenizers` crate failed to encode or decode.
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    /// The chat template cannot be parsed or rendered.
    #[error("chat template: {0}")]
    Template(String),
    /// The model has no chat template.
    #[error("the model has no chat template")]
    NoChatTemplate,
}

/// `Result` with this crate's [`Error`].
pub type Result<T> = std::result::Result<T, Error>;
