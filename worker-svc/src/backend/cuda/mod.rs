//! The CUDA backend (feature `cuda`): weights, activations and a KV arena
//! (f16, bf16 or fp8 e4m3) in device memory; kernels compiled at start-up with
//! NVRTC (`kernels.cu`: embedding, RMSNorm, Q/K/V biases and per-head Q/K
//! norms, RoPE with the K/V scatter into the leased slots, SwiGLU or GeGLU,
//! post-norms added to the residual, split-key paged attention for decode and prefill rows
//! with per-layer windows — on the tensor cores for head widths 64 and 128,
//! see [`AttentionTuning`] — and the merge of the splits); matrix products
//! as f32 cuBLAS GEMMs over every token of the batch.
//!
//! `cudarc` loads libcuda, NVRTC and cuBLAS at run time, so building needs no
//! CUDA toolkit; [`probe`] checks for the driver and a device before anything
//! touches them (cudarc panics when libcuda is missing).
//!
//! # Layout
//!
//! - `kernels`: compiles `kernels.cu` for one model shape; the split plan of
//!   the attention kernels.
//! - `launches`: one typed, safe wrapper per kernel (the only `unsafe`
//!   launches).
//! - `gemm`: the matrix products, in calls of a fixed row count.
//! - `graphs`: decode passes captured once per row and key bucket and
//!   replayed from CUDA graphs.
//! - `uploads`: weights, activation buffers and each batch's metadata on the
//!   device.
//! - `tier`: the host tier in pinned host memory and the whole-block copies
//!   between it and the arena.
//! - `backend`: [`CudaBackend`], which sizes the arena and runs a batch.
//! - `bench` (feature `bench`, for `benches/gpu.rs` and the GPU tests only):
//!   measurements and the f64 check of the attention kernels.

mod backend;
#[cfg(feature = "bench")]
#[doc(hidden)]
pub mod bench;
mod gemm;
mod graphs;
mod kernels;
mod launches;
mod picks;
mod tier;
mod uploads;

use cudarc::driver::CudaContext;

pub use super::{CudaOptions, KvDtype};
use crate::error::Error;
pub use backend::{CudaBackend, DeviceSizing};
pub use kernels::AttentionTuning;

/// Checks that libcuda loads and that a device exists; the reason otherwise.
pub fn probe() -> std::result::Result<(), String> {
    // SAFETY: only tries to dlopen the library; no symbol is used.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Err("libcuda (the NVIDIA driver library) is not present".into());
    }
    // SAFETY: as above, for NVRTC and cuBLAS.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        return Err("libnvrtc (CUDA run-time compiler) is not present".into());
    }
    // SAFETY: as above.
    if !unsafe { cudarc::cublas::sys::is_culib_present() } {
        return Err("libcublas is not present".into());
    }
    match CudaContext::device_count() {
        Ok(n) if n > 0 => Ok(()),
        Ok(_) => Err("no CUDA device found".into()),
        Err(e) => Err(format!("cannot query CUDA devices: {e}")),
    }
}

fn cuda_err(what: &str) -> impl Fn(cudarc::driver::DriverError) -> Error + '_ {
    move |e| Error::Backend(format!("cuda {what}: {e}"))
}

fn blas_err(e: cudarc::cublas::result::CublasError) -> Error {
    Error::Backend(format!("cublas: {e}"))
}
