//! Matrix products: bf16 × bf16 cuBLAS GEMMs on the tensor cores with f32
//! accumulation and f32 output, in calls of a fixed row count, so a token's
//! results do not depend on what else shares its batch.

use std::sync::Arc;

use cudarc::cublas::{CudaBlas, result::gemm_ex, sys};
use cudarc::driver::{CudaSlice, CudaStream, CudaView, CudaViewMut, DevicePtr, DevicePtrMut};
use half::bf16;

use super::blas_err;
use crate::error::{Error, Result};

/// Rows per cuBLAS call. cuBLAS picks its kernel (tile shape, split-K) from
/// the problem's shape, and kernels sum in different orders; every product
/// here runs as calls of exactly this many rows (the activation buffers are
/// padded to a multiple), so a row takes the same kernel and the same
/// summation order whatever other rows share the pass. That keeps a token's
/// results independent of its batch, which exact prefix reuse needs. 128
/// rows of bf16 products still read the weights at memory speed (a decode
/// batch of up to 128 sequences is one call that costs what 64 rows did),
/// while prefill calls get twice the tiles of 64-row calls.
pub(super) const GEMM_ROWS: usize = 128;

/// `rows` rounded up to whole [`GEMM_ROWS`] calls.
pub(super) fn padded_rows(rows: usize) -> usize {
    rows.next_multiple_of(GEMM_ROWS)
}

/// The cuBLAS handle and the stream its products run on.
#[derive(Debug)]
pub(super) struct Products {
    blas: CudaBlas,
    stream: Arc<CudaStream>,
}

impl Products {
    pub(super) fn new(stream: &Arc<CudaStream>) -> Result<Self> {
        Ok(Products {
            blas: CudaBlas::new(stream.clone()).map_err(blas_err)?,
            stream: stream.clone(),
        })
    }

    /// `out[t × n] (+)= x[t × k] (row stride ldx) · w[n × k]ᵀ`, row-major,
    /// bf16 inputs, f32 accumulation and output, as calls of [`GEMM_ROWS`]
    /// rows; `x` and `out` hold [`padded_rows`]`(t)` rows (what the padding
    /// rows compute is never read).
    #[allow(clippy::too_many_arguments)] // the GEMM's own parameters
    pub(super) fn linear(
        &self,
        x: &CudaView<'_, bf16>,
        ldx: usize,
        w: &CudaSlice<bf16>,
        out: &mut CudaViewMut<'_, f32>,
        (t, k, n): (usize, usize, usize),
        accumulate: bool,
    ) -> Result<()> {
        let rows = padded_rows(t);
        if rows == 0 {
            return Ok(());
        }
        if ldx < k || x.len() < (rows - 1) * ldx + k || out.len() < rows * n || w.len() < n * k {
            return Err(Error::Backend(format!(
                "linear ({t} x {k}) · ({n} x {k})ᵀ: buffers of {} / {} / {} elements are short of {rows} padded rows",
                x.len(),
                w.len(),
                out.len()
            )));
        }
        for r0 in (0..rows).step_by(GEMM_ROWS) {
            let xs = x.slice(r0 * ldx..(r0 + GEMM_ROWS - 1) * ldx + k);
            let mut os = out.slice_mut(r0 * n..(r0 + GEMM_ROWS) * n);
            self.gemm(w, &xs, ldx, &mut os, (GEMM_ROWS, k, n), accumulate)?;
        }
        Ok(())
    }

    /// One cuBLAS call: `c[m × n] (+)= b[m × k] (row stride ldb) · a[n ×
    /// k]ᵀ`, row-major, bf16 inputs, f32 accumulation and output.
    pub(super) fn gemm(
        &self,
        a: &impl DevicePtr<bf16>,
        b: &impl DevicePtr<bf16>,
        ldb: usize,
        c: &mut impl DevicePtrMut<f32>,
        (m, k, n): (usize, usize, usize),
        accumulate: bool,
    ) -> Result<()> {
        if m == 0 {
            return Ok(());
        }
        if ldb < k || b.len() < (m - 1) * ldb + k || c.len() < m * n || a.len() < n * k {
            return Err(Error::Backend(format!(
                "gemm ({m} x {k}) · ({n} x {k})ᵀ: buffers of {} / {} / {} elements are short",
                b.len(),
                a.len(),
                c.len()
            )));
        }
        let alpha = 1.0f32;
        let beta = if accumulate { 1.0f32 } else { 0.0 };
        let (a_ptr, _a_sync) = a.device_ptr(&self.stream);
        let (b_ptr, _b_sync) = b.device_ptr(&self.stream);
        let (c_ptr, _c_sync) = c.device_ptr_mut(&self.stream);
        // Column-major view: c (n × m) = aᵀ (n × k) · b (k × m).
        // SAFETY: `cublasGemmEx` with A = a (bf16, n × k, lda k, read
        // transposed), B = b (bf16, m columns of stride ldb ≥ k), C = c (f32,
        // n × m, ldc n): checked above that a holds n × k, b (m - 1) × ldb +
        // k and c m × n elements; alpha and beta are f32 host scalars, as the
        // f32 compute type requires; the allocations stay alive, and ordered
        // on the handle's stream, through the `_sync` guards.
        unsafe {
            gemm_ex(
                *self.blas.handle(),
                sys::cublasOperation_t::CUBLAS_OP_T,
                sys::cublasOperation_t::CUBLAS_OP_N,
                n as i32,
                m as i32,
                k as i32,
                (&alpha as *const f32).cast(),
                a_ptr as *const _,
                sys::cudaDataType_t::CUDA_R_16BF,
                k as i32,
                b_ptr as *const _,
                sys::cudaDataType_t::CUDA_R_16BF,
                ldb as i32,
                (&beta as *const f32).cast(),
                c_ptr as *mut _,
                sys::cudaDataType_t::CUDA_R_32F,
                n as i32,
                sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(blas_err)
    }
}
