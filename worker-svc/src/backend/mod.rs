//! Compute backends: each owns the KV arena's memory and runs a validated
//! [`Batch`]. Only `cpu` exists today; a CUDA backend implements the same
//! trait over device memory.

pub mod cpu;

use crate::batch::Batch;
use crate::error::Result;

/// Logits of one batch: `rows × vocab`, row-major, the rows of each sequence
/// in batch order (all its positions when it asked for them, else its last).
#[derive(Debug, Clone, PartialEq)]
pub struct BatchLogits {
    /// Vocabulary size (row width).
    pub vocab: usize,
    /// The rows, concatenated.
    pub values: Vec<f32>,
}

/// A compute backend for the forward pass.
pub trait Backend: Send + std::fmt::Debug {
    /// Short name: "cpu" or "cuda".
    fn name(&self) -> &'static str;
    /// Device description, e.g. the CPU model.
    fn device(&self) -> String;
    /// Element type of the KV arena: "f32", "f16" or "bf16".
    fn kv_dtype(&self) -> &'static str;
    /// Writes the K/V of every token of `batch` into its slots, then attends
    /// and returns the logits rows. `batch` has been validated against the
    /// arena layout this backend was built with.
    fn forward(&mut self, batch: &Batch) -> Result<BatchLogits>;
}
