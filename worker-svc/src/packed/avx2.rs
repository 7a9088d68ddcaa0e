//! The AVX2 + FMA kernels of [`super`]: block dequantization eight elements
//! at a time, and register-tiled dot products whose 16 running sums are two
//! 8-lane registers (lanes 0-7 and 8-15 of the portable order), reduced with
//! the same pairwise tree.
//!
//! Every function here needs a CPU with AVX2 and FMA; the caller checks it
//! once (`super::isa`).

use std::arch::x86_64::*;

use super::{QK, half_at};
use crate::dequant::GgmlType;

/// Dequantizes the blocks of `row` into `out` (32 elements per block) with
/// `dequant`'s arithmetic: a rounded multiply and a rounded add,
/// never fused.
///
/// # Safety
/// The CPU has AVX2 and FMA; `ty` is Q4_0, Q4_1 or Q8_0.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn dequantize_into(ty: GgmlType, row: &[u8], out: &mut [f32]) {
    let bb = ty.block_bytes();
    let blocks = row.chunks_exact(bb).zip(out.chunks_exact_mut(QK));
    // SAFETY: each load reads inside one block (Q4_0: 16 bytes at 2 of 18;
    // Q4_1: 16 at 4 of 20; Q8_0: 8 at 2, 10, 18, 26 of 34) and each store
    // writes 8 of the block's 32 output elements; the CPU has AVX2 (the
    // caller's contract).
    unsafe {
        let mask = _mm_set1_epi8(0xF);
        match ty {
            GgmlType::Q4_0 | GgmlType::Q4_1 => {
                let q4_1 = ty == GgmlType::Q4_1;
                let eight = _mm256_set1_epi32(8);
                for (block, dst) in blocks {
                    let d = _mm256_set1_ps(half_at(block, 0));
                    let (m, qs_at) = if q4_1 {
                        (_mm256_set1_ps(half_at(block, 2)), 4)
                    } else {
                        (_mm256_setzero_ps(), 2)
                    };
                    let qs = _mm_loadu_si128(block.as_ptr().add(qs_at).cast());
                    let lo = _mm_and_si128(qs, mask);
                    let hi = _mm_and_si128(_mm_srli_epi16(qs, 4), mask);
                    let p = dst.as_mut_ptr();
                    for (at, bytes) in [(0, lo), (8, _mm_srli_si128(lo, 8)), (16, hi)]
                        .into_iter()
                        .chain([(24, _mm_srli_si128(hi, 8))])
                    {
                        let q = _mm256_cvtepu8_epi32(bytes);
                        let v = if q4_1 {
                            _mm256_add_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(q), d), m)
                        } else {
                            _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(q, eight)), d)
                        };
                        _mm256_storeu_ps(p.add(at), v);
                    }
                }
            }
            GgmlType::Q8_0 => {
                for (block, dst) in blocks {
                    let d = _mm256_set1_ps(half_at(block, 0));
                    let p = dst.as_mut_ptr();
                    for at in (0..QK).step_by(8) {
                        let bytes = _mm_loadl_epi64(block.as_ptr().add(2 + at).cast());
                        let q = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
                        _mm256_storeu_ps(p.add(at), _mm256_mul_ps(q, d));
                    }
                }
            }
            _ => unreachable!("{ty:?} is not a packed type"),
        }
    }
}

/// `out[i * ldo + j] (+)= dot(a row i, tile row j)` for `i < rows`,
/// `j < nr`, in tiles of up to 3 rows × 2 columns (1 row × 6 columns for a
/// lone row).
///
/// # Safety
/// The CPU has AVX2 and FMA, and the bounds of `super::tile_product` hold
/// (`tile` holds `nr <= 6` rows of `k`, `k` a multiple of 16).
#[target_feature(enable = "avx2,fma")]
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
        let mr = (rows - i).min(3);
        // SAFETY: rows i..i+mr and columns 0..nr are inside the caller's
        // bounds.
        unsafe {
            let (a, out) = (a.add(i * lda), out.add(i * ldo));
            if mr == 1 {
                let acc = accumulate;
                match nr {
                    6 => micro::<1, 6>(a, lda, tile, k, out, ldo, acc),
                    5 => micro::<1, 5>(a, lda, tile, k, out, ldo, acc),
                    4 => micro::<1, 4>(a, lda, tile, k, out, ldo, acc),
                    3 => micro::<1, 3>(a, lda, tile, k, out, ldo, acc),
                    2 => micro::<1, 2>(a, lda, tile, k, out, ldo, acc),
                    _ => micro::<1, 1>(a, lda, tile, k, out, ldo, acc),
                }
            } else {
                let mut j = 0;
                while j < nr {
                    let (w, o) = (tile.add(j * k), out.add(j));
                    match (mr, nr - j >= 2) {
                        (3, true) => micro::<3, 2>(a, lda, w, k, o, ldo, accumulate),
                        (3, false) => micro::<3, 1>(a, lda, w, k, o, ldo, accumulate),
                        (_, true) => micro::<2, 2>(a, lda, w, k, o, ldo, accumulate),
                        (_, false) => micro::<2, 1>(a, lda, w, k, o, ldo, accumulate),
                    }
                    j += 2;
                }
            }
        }
        i += mr;
    }
}

/// One `MR × NR` register tile: `2·MR·NR` accumulators over the whole of
/// `k`, 16 elements a step.
///
/// # Safety
/// The CPU has AVX2 and FMA; `a` has `MR` rows of `k` at stride `lda`, `w`
/// has `NR` rows of `k` (contiguous), `out` has `MR` rows of `NR` at
/// stride `ldo`; `k` is a multiple of 16.
#[target_feature(enable = "avx2,fma")]
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
    // SAFETY: every load reads `a[i*lda + c..+8]` or `w[j*k + c..+8]` with
    // c + 16 <= k, every store one element of `out`'s tile (the contract).
    unsafe {
        let mut acc = [[[_mm256_setzero_ps(); 2]; NR]; MR];
        let mut c = 0;
        while c < k {
            for h in 0..2 {
                let at = c + 8 * h;
                let mut wv = [_mm256_setzero_ps(); NR];
                for (j, v) in wv.iter_mut().enumerate() {
                    *v = _mm256_loadu_ps(w.add(j * k + at));
                }
                for (i, acc_i) in acc.iter_mut().enumerate() {
                    let av = _mm256_loadu_ps(a.add(i * lda + at));
                    for (acc_ij, v) in acc_i.iter_mut().zip(&wv) {
                        acc_ij[h] = _mm256_fmadd_ps(av, *v, acc_ij[h]);
                    }
                }
            }
            c += 16;
        }
        for (i, acc_i) in acc.iter().enumerate() {
            for (j, acc_ij) in acc_i.iter().enumerate() {
                let d = reduce(acc_ij[0], acc_ij[1]);
                let o = out.add(i * ldo + j);
                *o = if accumulate { *o + d } else { d };
            }
        }
    }
}

/// `super::reduce` of the 16 sums held as lanes 0-7 (`lo`) and 8-15 (`hi`).
#[target_feature(enable = "avx2,fma")]
#[inline]
fn reduce(lo: __m256, hi: __m256) -> f32 {
    let s8 = _mm256_add_ps(lo, hi);
    let s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
    let s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    let s1 = _mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1));
    _mm_cvtss_f32(s1)
}
