//! kvlease-tokenizer: the model's own tokenizer, shared by the worker (which
//! loads it with the model) and the scheduler (which gets it from the worker).
//!
//! # Layout
//!
//! - `gguf.rs`: [`GgufVocab`], the `tokenizer.*` metadata of a GGUF file.

#![forbid(unsafe_code)]

mod error;
pub mod gguf;

pub use error::{Error, Result};
pub use gguf::GgufVocab;
