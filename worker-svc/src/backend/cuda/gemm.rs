//! Matrix products: f32 cuBLAS GEMMs in calls of a fixed row count, so a
//! token's results do not depend on what else shares its batch.

use cudarc::cublas::{CudaBlas, Gemm, GemmConfig, sys::cublasOperation_t};
use cudarc::driver::{CudaSlice, CudaView, CudaViewMut};

use super::blas_err;
use crate::error::{Error, Result};

/// Rows per cuBLAS call. cuBLAS picks its kernel (tile shape, split-K) from
/// the problem's shape, and kernels sum in different orders; every product
/// here runs as calls of exactly this many rows (the activation buffers are
/// padded to a multiple), so a row takes the same kernel and the same
/// summation order whatever other rows share the pass. That keeps a token's
/// results independent of its batch, which exact prefix reuse needs. A
/// decode batch of up to this many sequences is one call, as before.
pub(super) const GEMM_ROWS: usize = 64;

/// `rows` rounded up to whole [`GEMM_ROWS`] calls.
pub(super) fn padded_rows(rows: usize) -> usize {
    rows.next_multiple_of(GEMM_ROWS)
}

/// `out[t × n] (+)= x[t × k] (row stride ldx) · w[n × k]ᵀ`, row-major, f32,
/// as calls of [`GEMM_ROWS`] rows; `x` and `out` hold [`padded_rows`]`(t)`
/// rows (what the padding rows compute is never read).
pub(super) fn linear(
    blas: &CudaBlas,
    x: &CudaView<'_, f32>,
    ldx: usize,
    w: &CudaSlice<f32>,
    out: &mut CudaViewMut<'_, f32>,
    (t, k, n): (usize, usize, usize),
    accumulate: bool,
) -> Result<()> {
    let rows = padded_rows(t);
    if rows == 0 {
        return Ok(());
    }
    if x.len() < (rows - 1) * ldx + k || out.len() < rows * n || w.len() < n * k {
        return Err(Error::Backend(format!(
            "linear ({t} x {k}) · ({n} x {k})ᵀ: buffers of {} / {} / {} elements are short of {rows} padded rows",
            x.len(),
            w.len(),
            out.len()
        )));
    }
    // Column-major view: out (n × GEMM_ROWS) = wᵀ (n × k) · x (k × GEMM_ROWS).
    let cfg = GemmConfig {
        transa: cublasOperation_t::CUBLAS_OP_T,
        transb: cublasOperation_t::CUBLAS_OP_N,
        m: n as i32,
        n: GEMM_ROWS as i32,
        k: k as i32,
        alpha: 1.0f32,
        lda: k as i32,
        ldb: ldx as i32,
        beta: if accumulate { 1.0 } else { 0.0 },
        ldc: n as i32,
    };
    for r0 in (0..rows).step_by(GEMM_ROWS) {
        let xs = x.slice(r0 * ldx..(r0 + GEMM_ROWS - 1) * ldx + k);
        let mut os = out.slice_mut(r0 * n..(r0 + GEMM_ROWS) * n);
        // SAFETY: checked above: w holds n × k, xs GEMM_ROWS rows of stride
        // ldx ≥ k, os GEMM_ROWS × n.
        unsafe { blas.gemm(cfg, w, &xs, &mut os) }.map_err(blas_err)?;
    }
    Ok(())
}
