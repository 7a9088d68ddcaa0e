//! Decode passes replayed from CUDA graphs.
//!
//! A decode step enqueues every launch and product of the model (about ten
//! per layer). Measured on an H200 (2026-12-03, `benches/gpu.rs`), replaying
//! them from a graph did not shorten the step at batch 64 or 256: the
//! device's work and the host's validation set its pace, not the launch
//! calls. A batch of decode rows (one token and one
//! logit row per sequence) is padded to a row bucket (see
//! [`BatchMeta::build`]) and its metadata copied into buffers that keep
//! their device addresses; the pass's launches for that bucket and each
//! pool's split plan are captured once into a graph and replayed by one
//! launch afterwards. A captured pass runs exactly the kernels and the
//! fixed-row products of the eager pass over the same rows, so a row's
//! results are the same bits either way.
//!
//! [`BatchMeta::build`]: super::uploads::BatchMeta::build

use std::collections::HashMap;
use std::fmt;

use cudarc::driver::CudaGraph;

use super::gemm::GEMM_ROWS;
use super::uploads::DeviceBatch;
use crate::batch::Batch;

/// The smallest row bucket: smaller batches share its graph.
const MIN_BUCKET: usize = 8;

/// Most rows a graphed decode pass takes: one call of every product.
pub(super) const MAX_GRAPH_ROWS: usize = GEMM_ROWS;

/// The rows of `batch` when it is a decode batch a graph can run (one
/// token and one logit row per sequence, at most [`MAX_GRAPH_ROWS`] rows).
pub(super) fn decode_rows(batch: &Batch) -> Option<usize> {
    let rows = batch.seqs.len();
    let decode = batch
        .seqs
        .iter()
        .all(|s| s.tokens.len() == 1 && s.logit_rows() == 1);
    (decode && (1..=MAX_GRAPH_ROWS).contains(&rows)).then_some(rows)
}

/// The row bucket a decode batch of `rows` rows is padded to.
pub(super) fn bucket(rows: usize) -> usize {
    rows.next_power_of_two()
        .clamp(MIN_BUCKET, MAX_GRAPH_ROWS.max(MIN_BUCKET))
}

/// The keys a pool's split plan is made for when its rows attend at most
/// `max_keys`: a power of two, so the plan (and the graph) changes only
/// when the context doubles. Splits past a row's keys are empty and add
/// nothing to its output.
pub(super) fn keys_bucket(max_keys: usize) -> usize {
    max_keys.max(1).next_power_of_two()
}

/// What a captured pass depends on besides the (fixed) buffer addresses:
/// its rows and each pool's [`keys_bucket`].
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(super) struct GraphKey {
    pub(super) rows: usize,
    pub(super) keys: Vec<usize>,
}

/// One instantiated graph of a decode pass.
pub(super) struct Graph(pub(super) CudaGraph);

// SAFETY: a CUDA graph may be used from any thread as long as no two
// threads use it at once (driver API, "Graph object thread safety"); a
// `Graph` lives in the backend and is only reached through `&mut
// CudaBackend`, so calls on it are serialized; cudarc binds the context to
// the calling thread before each call.
unsafe impl Send for Graph {}

impl fmt::Debug for Graph {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Graph")
    }
}

/// The graphs of decode passes and the metadata buffers they read.
#[derive(Debug, Default)]
pub(super) struct DecodeGraphs {
    /// Metadata of the graphed passes, at fixed device addresses; every
    /// graph reads it, so all are dropped when it is reallocated.
    pub(super) batch: Option<DeviceBatch>,
    pub(super) graphs: HashMap<GraphKey, Graph>,
    /// Passes captured and passes replayed so far.
    pub(super) captures: u64,
    pub(super) replays: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_are_powers_of_two_from_eight_to_the_product_rows() {
        assert_eq!(bucket(1), 8);
        assert_eq!(bucket(8), 8);
        assert_eq!(bucket(9), 16);
        assert_eq!(bucket(200), 256);
        assert_eq!(bucket(256), 256);
        assert_eq!(keys_bucket(0), 1);
        assert_eq!(keys_bucket(1025), 2048);
    }
}
