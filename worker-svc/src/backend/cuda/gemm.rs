//! Matrix products: bf16 × bf16 cuBLAS GEMMs on the tensor cores with f32
//! accumulation and f32 output, in calls of a fixed row count, so a token's
//! results do not depend on what else shares its batch.

use std::sync::Arc;

use cudarc::cublas::{CudaBlas, result::gemm_ex, sys};
use cudarc::driver::{
    CudaContext, CudaSlice, CudaStream, CudaView, CudaViewMut, DevicePtr, DevicePtrMut,
};
use half::bf16;

use super::{blas_err, cuda_err};
use crate::error::{Error, Result};

/// Rows per cuBLAS call. cuBLAS picks its kernel (tile shape, split-K) from
/// the problem's shape, and kernels sum in different orders; every product
/// here runs as calls of exactly this many rows (the activation buffers are
/// padded to a multiple), so a row takes the same kernel and the same
/// summation order whatever other rows share the pass. That keeps a token's
/// results independent of its batch, which exact prefix reuse needs. 256
/// rows of bf16 products are still about as fast as the weights can be read
/// (a decode batch of up to 256 sequences is one call, each weight read
/// once), and a prefill's calls are large enough to use the tensor cores
/// well (128-row calls ran prefill's products at 0.48 of cuBLAS's rate for
/// one large product, 64-row calls were launch-bound).
pub(super) const GEMM_ROWS: usize = 256;

/// `rows` rounded up to whole [`GEMM_ROWS`] calls.
pub(super) fn padded_rows(rows: usize) -> usize {
    rows.next_multiple_of(GEMM_ROWS)
}

/// Products of at least this many row tiles spread over the side streams;
/// shorter ones (decode steps) run on the pass's stream alone.
const SPREAD_TILES: usize = 4;

/// The cuBLAS handles and streams the products run on.
#[derive(Debug)]
pub(super) struct Products {
    blas: CudaBlas,
    stream: Arc<CudaStream>,
    /// Streams forked from `stream`, each with its own handle: the tiles of
    /// a prefill's product run on them at once, so the GPU is filled by
    /// several fixed-shape calls rather than one call of a shape derived
    /// from the batch (every tile still runs the same kernel).
    side: Vec<(Arc<CudaStream>, CudaBlas)>,
}

impl Products {
    /// Handles on `stream` and on `side_streams` streams forked from it.
    /// The context's automatic event tracking is off (see the SAFETY note);
    /// `linear` orders the side streams against `stream` with events.
    pub(super) fn new(
        ctx: &Arc<CudaContext>,
        stream: &Arc<CudaStream>,
        side_streams: usize,
    ) -> Result<Self> {
        // SAFETY: with more than one stream, cudarc would record an event
        // for every buffer a launch touches; we order the streams ourselves
        // instead. Every buffer is allocated, used and freed on `stream`,
        // except that `linear` lets the side streams read its inputs and
        // write disjoint row tiles of its output between a fork event (they
        // wait for `stream`'s work so far) and a join (`stream` waits for all
        // of theirs) before returning, so no buffer is freed or reused on
        // `stream` while a side stream may still touch it, none is used
        // before it exists, and no two streams write the same elements.
        unsafe { ctx.disable_event_tracking() };
        let side = (0..side_streams)
            .map(|_| {
                let s = stream.fork().map_err(cuda_err("fork stream"))?;
                let blas = CudaBlas::new(s.clone()).map_err(blas_err)?;
                Ok((s, blas))
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Products {
            blas: CudaBlas::new(stream.clone()).map_err(blas_err)?,
            stream: stream.clone(),
            side,
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
        let tiles = rows / GEMM_ROWS;
        let spread = tiles >= SPREAD_TILES && !self.side.is_empty();
        if spread {
            let fork = self.stream.record_event(None).map_err(cuda_err("event"))?;
            for (s, _) in &self.side {
                s.wait(&fork).map_err(cuda_err("stream wait"))?;
            }
        }
        for (i, r0) in (0..rows).step_by(GEMM_ROWS).enumerate() {
            let xs = x.slice(r0 * ldx..(r0 + GEMM_ROWS - 1) * ldx + k);
            let mut os = out.slice_mut(r0 * n..(r0 + GEMM_ROWS) * n);
            let (blas, stream) = if spread {
                let (s, b) = &self.side[i % self.side.len()];
                (b, s)
            } else {
                (&self.blas, &self.stream)
            };
            gemm(
                blas,
                stream,
                w,
                &xs,
                ldx,
                &mut os,
                (GEMM_ROWS, k, n),
                accumulate,
            )?;
        }
        if spread {
            for (s, _) in &self.side {
                self.stream.join(s).map_err(cuda_err("stream join"))?;
            }
        }
        Ok(())
    }

    /// One cuBLAS call on the pass's stream (see [`gemm`]); the bench
    /// times cuBLAS's rate with it.
    #[cfg(feature = "bench")]
    pub(super) fn gemm(
        &self,
        a: &impl DevicePtr<bf16>,
        b: &impl DevicePtr<bf16>,
        ldb: usize,
        c: &mut impl DevicePtrMut<f32>,
        mkn: (usize, usize, usize),
        accumulate: bool,
    ) -> Result<()> {
        gemm(&self.blas, &self.stream, a, b, ldb, c, mkn, accumulate)
    }
}

/// One cuBLAS call on `stream` (whose handle `blas` is): `c[m × n] (+)=
/// b[m × k] (row stride ldb) · a[n × k]ᵀ`, row-major, bf16 inputs, f32
/// accumulation and output.
#[allow(clippy::too_many_arguments)] // the GEMM's own parameters
fn gemm(
    blas: &CudaBlas,
    stream: &CudaStream,
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
    let (a_ptr, _a_sync) = a.device_ptr(stream);
    let (b_ptr, _b_sync) = b.device_ptr(stream);
    let (c_ptr, _c_sync) = c.device_ptr_mut(stream);
    // Column-major view: c (n × m) = aᵀ (n × k) · b (k × m).
    // SAFETY: `cublasGemmEx` with A = a (bf16, n × k, lda k, read
    // transposed), B = b (bf16, m columns of stride ldb ≥ k), C = c (f32,
    // n × m, ldc n): checked above that a holds n × k, b (m - 1) × ldb +
    // k and c m × n elements; alpha and beta are f32 host scalars, as the
    // f32 compute type requires; `blas` is bound to `stream`, on which the
    // operands were written before (the pass's stream, or a side stream
    // after `linear`'s fork event), and the caller holds them past the
    // join that orders later work after this call.
    unsafe {
        gemm_ex(
            *blas.handle(),
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
