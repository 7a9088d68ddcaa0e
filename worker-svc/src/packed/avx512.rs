//! The AVX-512 kernels of [`super`]: the 16 running sums of the portable
//! order are the 16 lanes of one `zmm` register, so a dot product is one
//! register, reduced at the end with the same pairwise tree.
//!
//! Two ways to a product, with the same arithmetic (so the same bits):
//! - [`fused_product`], for a few activation rows (decode): dequantizes each
//!   block in registers and multiplies it straight away, reading every
//!   weight byte once and writing no scratch;
//! - [`dequantize_into`] into a scratch tile, then [`tile_product`]'s
//!   register-blocked 4 × 6 microkernel, for many rows (prefill, batched
//!   decode), where one dequantized tile serves every row.
//!
//! Every function here needs a CPU with AVX-512F, AVX-512BW, F16C and FMA;
//! the caller checks it once (`super::isa`).

use std::arch::x86_64::*;

use super::QK;
use crate::dequant::GgmlType;

/// The packed types as const parameters (so a kernel's block decoding is
/// chosen at compile time, outside its loops).
const Q4_0: u8 = 0;
const Q4_1: u8 = 1;
const Q8_0: u8 = 2;

fn ggml_type(code: u8) -> GgmlType {
    match code {
        Q4_0 => GgmlType::Q4_0,
        Q4_1 => GgmlType::Q4_1,
        _ => GgmlType::Q8_0,
    }
}

/// Activation rows of the fused kernel's register tile (also the most rows
/// a product sends down the fused path).
pub(super) const FUSED_ROWS: usize = 4;
/// Weight rows of the fused kernel's register tile.
const FUSED_COLS: usize = 4;

/// The f16 at `p` as f32, broadcast to every lane.
///
/// # Safety
/// `p` addresses two readable bytes; the CPU has AVX-512F and F16C.
#[target_feature(enable = "avx512f,avx512bw,f16c,fma")]
#[inline]
unsafe fn half_splat(p: *const u8) -> __m512 {
    // SAFETY: the caller's contract.
    unsafe {
        let bits = p.cast::<u16>().read_unaligned();
        _mm512_set1_ps(_mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(i32::from(
            bits,
        )))))
    }
}

/// One block's 32 weights as two 16-lane registers (elements 0-15 and
/// 16-31), with `dequant`'s arithmetic: a rounded multiply and a
/// rounded add, never fused.
///
/// # Safety
/// `block` addresses one whole block of `ty` (Q4_0, Q4_1 or Q8_0); the CPU
/// has AVX-512F/BW, F16C and FMA.
#[target_feature(enable = "avx512f,avx512bw,f16c,fma")]
#[inline]
unsafe fn block_values(ty: GgmlType, block: *const u8) -> (__m512, __m512) {
    // SAFETY: each load reads inside the block (Q4_0: 16 bytes at 2 of 18;
    // Q4_1: 16 at 4 of 20; Q8_0: 16 at 2 and 18 of 34).
    unsafe {
        let d = half_splat(block);
        match ty {
            GgmlType::Q4_1 => {
                let m = half_splat(block.add(2));
                let qs = _mm_loadu_si128(block.add(4).cast());
                let mask = _mm_set1_epi8(0xF);
                let lo = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(qs, mask)));
                let hi = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(
                    _mm_srli_epi16(qs, 4),
                    mask,
                )));
                (
                    _mm512_add_ps(_mm512_mul_ps(lo, d), m),
                    _mm512_add_ps(_mm512_mul_ps(hi, d), m),
                )
            }
            GgmlType::Q4_0 => {
                let qs = _mm_loadu_si128(block.add(2).cast());
                let mask = _mm_set1_epi8(0xF);
                let eight = _mm512_set1_epi32(8);
                let lo = _mm512_sub_epi32(_mm512_cvtepu8_epi32(_mm_and_si128(qs, mask)), eight);
                let hi = _mm512_sub_epi32(
                    _mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(qs, 4), mask)),
                    eight,
                );
                (
                    _mm512_mul_ps(_mm512_cvtepi32_ps(lo), d),
                    _mm512_mul_ps(_mm512_cvtepi32_ps(hi), d),
                )
            }
            _ => {
                let lo = _mm512_cvtepi8_epi32(_mm_loadu_si128(block.add(2).cast()));
                let hi = _mm512_cvtepi8_epi32(_mm_loadu_si128(block.add(18).cast()));
                (
                    _mm512_mul_ps(_mm512_cvtepi32_ps(lo), d),
                    _mm512_mul_ps(_mm512_cvtepi32_ps(hi), d),
                )
            }
        }
    }
}

/// Dequantizes the blocks of `row` into `out` (32 elements per block), bit
/// for bit as `dequant` does.
///
/// # Safety
/// The CPU has AVX-512F/BW, F16C and FMA; `ty` is Q4_0, Q4_1 or Q8_0.
#[target_feature(enable = "avx512f,avx512bw,f16c,fma")]
pub(super) unsafe fn dequantize_into(ty: GgmlType, row: &[u8], out: &mut [f32]) {
    let bb = ty.block_bytes();
    for (block, dst) in row.chunks_exact(bb).zip(out.chunks_exact_mut(QK)) {
        // SAFETY: `block` is one whole block and `dst` 32 elements.
        unsafe {
            let (lo, hi) = block_values(ty, block.as_ptr());
            _mm512_storeu_ps(dst.as_mut_ptr(), lo);
            _mm512_storeu_ps(dst.as_mut_ptr().add(16), hi);
        }
    }
}

/// `super::reduce` of the 16 sums in the lanes of `acc`.
#[target_feature(enable = "avx512f,avx512bw,f16c,fma")]
#[inline]
fn reduce(acc: __m512) -> f32 {
    let s8 = _mm256_add_ps(
        _mm512_castps512_ps256(acc),
        _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc), 1)),
    );
    let s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
    let s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    let s1 = _mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1));
    _mm_cvtss_f32(s1)
}

/// Stores the reduced sums of an `MR × NR` register tile.
///
/// # Safety
/// `out` addresses `MR` rows of `NR` writable elements at stride `ldo`.
#[target_feature(enable = "avx512f,avx512bw,f16c,fma")]
#[inline]
unsafe fn store<const MR: usize, const NR: usize>(
    acc: &[[__m512; NR]; MR],
    out: *mut f32,
    ldo: usize,
    accumulate: bool,
) {
    for (i, acc_i) in acc.iter().enumerate() {
        for (j, acc_ij) in acc_i.iter().enumerate() {
            let d = reduce(*acc_ij);
            // SAFETY: the caller's contract.
            unsafe {
                let o = out.add(i * ldo + j);
                *o = if accumulate { *o + d } else { d };
            }
        }
    }
}

/// `out[i * ldo + j] (+)= dot(a row i, weight row j)` for `i < rows <=`
/// [`FUSED_ROWS`] and `j < nr`, where weight row `j` is the `row_bytes` of
/// blocks at `w + j * row_bytes`.
///
/// # Safety
/// The CPU has AVX-512F/BW, F16C and FMA; `ty` is Q4_0, Q4_1 or Q8_0; `a`
/// addresses `rows` rows of `k` readable elements at stride `lda`; `w`
/// addresses `nr` rows of `k / 32` blocks; `out` addresses `rows` rows of
/// `nr` writable elements at stride `ldo` that no other thread touches.
#[target_feature(enable = "avx512f,avx512bw,f16c,fma")]
#[allow(clippy::too_many_arguments)] // one tile's geometry
pub(super) unsafe fn fused_product(
    ty: GgmlType,
    a: *const f32,
    lda: usize,
    rows: usize,
    w: *const u8,
    k: usize,
    nr: usize,
    out: *mut f32,
    ldo: usize,
    accumulate: bool,
) {
    debug_assert!(rows <= FUSED_ROWS && k.is_multiple_of(QK));
    let rb = k / QK * ty.block_bytes();
    let mut j = 0;
    while j < nr {
        let cols = (nr - j).min(FUSED_COLS);
        // SAFETY: weight rows j..j+cols and output columns j..j+cols are
        // inside the caller's bounds.
        unsafe {
            let (w, o) = (w.add(j * rb), out.add(j));
            macro_rules! go {
                ($mr:literal; $($nr:literal),*) => {
                    match (ty, cols) {
                        $(
                            (GgmlType::Q4_1, $nr) => fused::<Q4_1, $mr, $nr>(a, lda, w, rb, k, o, ldo, accumulate),
                            (GgmlType::Q4_0, $nr) => fused::<Q4_0, $mr, $nr>(a, lda, w, rb, k, o, ldo, accumulate),
                            (_, $nr) => fused::<Q8_0, $mr, $nr>(a, lda, w, rb, k, o, ldo, accumulate),
                        )*
                        _ => unreachable!("a {rows} x {cols} fused tile"),
                    }
                };
            }
            macro_rules! rows {
                ($($nr:literal),*) => {
                    match rows {
                        1 => go!(1; $($nr),*),
                        2 => go!(2; $($nr),*),
                        3 => go!(3; $($nr),*),
                        _ => go!(4; $($nr),*),
                    }
                };
            }
            rows!(1, 2, 3, 4);
        }
        j += cols;
    }
}

/// One `MR × NR` fused register tile over the whole of `k`, a block (two
/// 16-element steps) at a time.
///
/// # Safety
/// As [`fused_product`], for `MR` rows and `NR` weight rows of `rb` bytes.
#[target_feature(enable = "avx512f,avx512bw,f16c,fma")]
#[inline]
#[allow(clippy::too_many_arguments)] // one tile's geometry
unsafe fn fused<const TY: u8, const MR: usize, const NR: usize>(
    a: *const f32,
    lda: usize,
    w: *const u8,
    rb: usize,
    k: usize,
    out: *mut f32,
    ldo: usize,
    accumulate: bool,
) {
    let ty = ggml_type(TY);
    let bb = ty.block_bytes();
    // SAFETY: block b of weight row j is at w + j*rb + b*bb, inside row j;
    // a[i*lda + 32b .. +32] is inside row i (32b + 32 <= k).
    unsafe {
        let mut acc = [[_mm512_setzero_ps(); NR]; MR];
        for b in 0..k / QK {
            let mut av = [[_mm512_setzero_ps(); 2]; MR];
            for (i, v) in av.iter_mut().enumerate() {
                let p = a.add(i * lda + b * QK);
                *v = [_mm512_loadu_ps(p), _mm512_loadu_ps(p.add(16))];
            }
            for j in 0..NR {
                let (lo, hi) = block_values(ty, w.add(j * rb + b * bb));
                for (acc_i, av_i) in acc.iter_mut().zip(&av) {
                    acc_i[j] = _mm512_fmadd_ps(av_i[0], lo, acc_i[j]);
                    acc_i[j] = _mm512_fmadd_ps(av_i[1], hi, acc_i[j]);
                }
            }
        }
        store(&acc, out, ldo, accumulate);
    }
}

/// `out[i * ldo + j] (+)= dot(a row i, tile row j)` for `i < rows`,
/// `j < nr <= 6`, in register tiles of up to 4 rows × 6 columns.
///
/// # Safety
/// The CPU has AVX-512F/BW, F16C and FMA, and the bounds of
/// `super::tile_product` hold (`tile` holds `nr <= 6` rows of `k`, `k` a
/// multiple of 16).
#[target_feature(enable = "avx512f,avx512bw,f16c,fma")]
#[allow(clippy::too_many_arguments)] // one tile's geometry
pub(super) unsafe fn tile_product(
    a: *const f32,
    lda: usize,
    rows: usize,
    tile: *const f32,
    k: usize,
    nr: usize,
    out: *mut f32,
    ldo: usize,
    accumulate: bool,
) {
    let mut i = 0;
    while i < rows {
        let mr = (rows - i).min(4);
        // SAFETY: rows i..i+mr and columns 0..nr are inside the caller's
        // bounds.
        unsafe {
            let (a, out) = (a.add(i * lda), out.add(i * ldo));
            macro_rules! go {
                ($mr:literal; $($nr:literal),*) => {
                    match nr {
                        $( $nr => micro::<$mr, $nr>(a, lda, tile, k, out, ldo, accumulate), )*
                        _ => unreachable!("a {mr} x {nr} tile"),
                    }
                };
            }
            macro_rules! rows {
                ($($nr:literal),*) => {
                    match mr {
                        1 => go!(1; $($nr),*),
                        2 => go!(2; $($nr),*),
                        3 => go!(3; $($nr),*),
                        _ => go!(4; $($nr),*),
                    }
                };
            }
            rows!(1, 2, 3, 4, 5, 6);
        }
        i += mr;
    }
}

/// One `MR × NR` register tile: `MR·NR` accumulators over the whole of `k`,
/// 16 elements a step.
///
/// # Safety
/// The CPU has AVX-512F/BW, F16C and FMA; `a` has `MR` rows of `k` at
/// stride `lda`, `w` has `NR` rows of `k` (contiguous), `out` has `MR` rows
/// of `NR` at stride `ldo`; `k` is a multiple of 16.
#[target_feature(enable = "avx512f,avx512bw,f16c,fma")]
#[inline]
unsafe fn micro<const MR: usize, const NR: usize>(
    a: *const f32,
    lda: usize,
    w: *const f32,
    k: usize,
    out: *mut f32,
    ldo: usize,
    accumulate: bool,
) {
    // SAFETY: every load reads `a[i*lda + c..+16]` or `w[j*k + c..+16]`
    // with c + 16 <= k, every store one element of `out`'s tile.
    unsafe {
        let mut acc = [[_mm512_setzero_ps(); NR]; MR];
        let mut c = 0;
        while c < k {
            let mut wv = [_mm512_setzero_ps(); NR];
            for (j, v) in wv.iter_mut().enumerate() {
                *v = _mm512_loadu_ps(w.add(j * k + c));
            }
            for (i, acc_i) in acc.iter_mut().enumerate() {
                let av = _mm512_loadu_ps(a.add(i * lda + c));
                for (acc_ij, v) in acc_i.iter_mut().zip(&wv) {
                    *acc_ij = _mm512_fmadd_ps(av, *v, *acc_ij);
                }
            }
            c += 16;
        }
        store(&acc, out, ldo, accumulate);
    }
}
