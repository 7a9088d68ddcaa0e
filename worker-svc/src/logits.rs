//! The logits a forward pass hands back, below both what reads them
//! (`sampling`, `logprobs`) and what makes them (`backend`).

/// Logits of one batch: `rows × vocab`, row-major, the rows of each sequence
/// in batch order (all its positions when it asked for them, else its last).
#[derive(Debug, Clone, PartialEq)]
pub struct BatchLogits {
    /// Vocabulary size (row width).
    pub vocab: usize,
    /// The rows, concatenated.
    pub values: Vec<f32>,
}
