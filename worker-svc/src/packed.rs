//! Quantized matrices kept in their GGUF blocks (Q4_0, Q4_1, Q8_0), and
//! matrix products computed straight from the blocks.
//!
//! A product dequantizes a few weight rows at a time into an f32 scratch
//! tile, with the arithmetic of `dequant` (`q·d + m` as one rounded
//! multiply and one rounded add), so the weights it multiplies by are
//! bit-identical to the dequantized f32 matrix; then it multiplies every
//! activation row of a block of rows against the tile. A quantized model
//! reads about a seventh of the bytes of its f32 form per decode step.
//!
//! The products are *row-exact* like those of [`crate::ops`]: every output
//! element is one activation row dotted with one weight row in one fixed
//! order (16 running sums, sum `l` taking elements `l, l + 16, ...` with
//! fused multiply-adds, then a fixed pairwise tree, then the optional add
//! to the output), whatever tile, batch, thread or kernel computes it. The
//! AVX-512 kernels (one `zmm` register per dot product), the AVX2 ones (two
//! `ymm`) and the portable one follow that order, so they agree bit for bit;
//! the process picks the widest its CPU runs (`kernel_name`).
//!
//! With AVX-512, a product of at most `avx512::FUSED_ROWS` activation rows
//! (a decode step) skips the scratch tile: each block is dequantized in
//! registers and multiplied at once, so every weight byte is read once.

use rayon::prelude::*;

use crate::dequant::GgmlType;
use crate::threads::Threads;

#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;

/// Running sums of one dot product (the summation order's width).
const LANES: usize = 16;
/// Elements per block of the packed types.
const QK: usize = 32;
/// Weight rows dequantized into one scratch tile.
const GROUP: usize = 6;
/// Activation rows multiplied against a tile before the next tile: enough to
/// amortise dequantizing it, few enough to stay in the core's cache.
const ROW_BLOCK: usize = 64;

/// A `[rows, cols]` matrix in one of GGML's 32-element block formats, row
/// after row (the layout of a GGUF tensor whose `dims` are `[cols, rows]`).
#[derive(Clone, PartialEq)]
pub struct PackedMatrix {
    ty: GgmlType,
    rows: usize,
    cols: usize,
    data: Vec<u8>,
}

impl std::fmt::Debug for PackedMatrix {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PackedMatrix")
            .field("ty", &self.ty)
            .field("rows", &self.rows)
            .field("cols", &self.cols)
            .field("bytes", &self.data.len())
            .finish()
    }
}

impl PackedMatrix {
    /// Whether products can run from blocks of `ty` (other types are
    /// dequantized to f32 at load).
    pub fn supports(ty: GgmlType) -> bool {
        matches!(ty, GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q8_0)
    }

    /// `data` as a `[rows, cols]` matrix of `ty`; the error says why not.
    pub fn new(ty: GgmlType, rows: usize, cols: usize, data: Vec<u8>) -> Result<Self, String> {
        if !Self::supports(ty) {
            return Err(format!("{ty:?} blocks cannot be kept packed"));
        }
        if !cols.is_multiple_of(QK) {
            return Err(format!("{cols} columns are not whole {QK}-element blocks"));
        }
        let want = rows * (cols / QK) * ty.block_bytes();
        if data.len() != want {
            return Err(format!(
                "a [{rows}, {cols}] {ty:?} matrix takes {want} bytes, got {}",
                data.len()
            ));
        }
        Ok(PackedMatrix {
            ty,
            rows,
            cols,
            data,
        })
    }

    /// `values` (`[rows, cols]`, row-major) quantized to Q8_0 as llama.cpp's
    /// `quantize_row_q8_0_ref` does: per block `d = max|x| / 127` (as f16),
    /// `q = round(x / d)`.
    pub fn quantize_q8_0(rows: usize, cols: usize, values: &[f32]) -> Result<Self, String> {
        if values.len() != rows * cols || !cols.is_multiple_of(QK) {
            return Err(format!(
                "{} values are not a [{rows}, {cols}] matrix of whole blocks",
                values.len()
            ));
        }
        let mut data = Vec::with_capacity(values.len() / QK * GgmlType::Q8_0.block_bytes());
        for block in values.chunks_exact(QK) {
            let amax = block.iter().fold(0.0f32, |a, v| a.max(v.abs()));
            let d = amax / 127.0;
            let inv = if d > 0.0 { 1.0 / d } else { 0.0 };
            data.extend_from_slice(&half::f16::from_f32(d).to_le_bytes());
            data.extend(block.iter().map(|v| (v * inv).round() as i8 as u8));
        }
        Self::new(GgmlType::Q8_0, rows, cols, data)
    }

    /// The block type.
    pub fn ty(&self) -> GgmlType {
        self.ty
    }

    /// Output features.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Input features.
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// Bytes of the blocks.
    pub fn bytes(&self) -> usize {
        self.data.len()
    }

    /// The blocks, row after row (as a GGUF file stores them).
    pub fn blocks(&self) -> &[u8] {
        &self.data
    }

    fn row_bytes(&self) -> usize {
        self.cols / QK * self.ty.block_bytes()
    }

    /// The blocks of row `r`.
    fn row(&self, r: usize) -> &[u8] {
        let rb = self.row_bytes();
        &self.data[r * rb..(r + 1) * rb]
    }

    /// Every element as f32, row-major (what `dequant` gives).
    pub fn to_f32(&self) -> Vec<f32> {
        self.ty.dequantize(&self.data)
    }

    /// Row `r` as f32 into `out` (`cols` long).
    ///
    /// # Panics
    /// When `r` is out of range or `out` is not `cols` long.
    pub fn dequantize_row(&self, r: usize, out: &mut [f32]) {
        assert_eq!(out.len(), self.cols);
        dequantize_into(isa(), self.ty, self.row(r), out);
    }

    /// The rows of `parts` one after the other, when they share a type and
    /// a width.
    pub fn stack(parts: &[&PackedMatrix]) -> Option<PackedMatrix> {
        let first = parts.first()?;
        if parts
            .iter()
            .any(|p| p.ty != first.ty || p.cols != first.cols)
        {
            return None;
        }
        Some(PackedMatrix {
            ty: first.ty,
            rows: parts.iter().map(|p| p.rows).sum(),
            cols: first.cols,
            data: parts.iter().flat_map(|p| p.data.iter().copied()).collect(),
        })
    }
}

/// The kernels this process runs (chosen once; every product of a process
/// uses the same one, though they agree bit for bit anyway).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Isa {
    Portable,
    #[cfg(target_arch = "x86_64")]
    Avx2Fma,
    #[cfg(target_arch = "x86_64")]
    Avx512,
}

fn isa() -> Isa {
    static ISA: std::sync::OnceLock<Isa> = std::sync::OnceLock::new();
    *ISA.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::is_x86_feature_detected as has;
            let avx2 = has!("avx2") && has!("fma");
            if avx2 && has!("avx512f") && has!("avx512bw") && has!("f16c") {
                return Isa::Avx512;
            }
            if avx2 {
                return Isa::Avx2Fma;
            }
        }
        Isa::Portable
    })
}

/// Name of the kernels products run on here ("avx512", "avx2+fma" or
/// "portable").
pub fn kernel_name() -> &'static str {
    match isa() {
        Isa::Portable => "portable",
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2Fma => "avx2+fma",
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => "avx512",
    }
}

/// `out[m, n] = a[m, k] · wᵀ` (plus `out` when `accumulate`), where `w` is
/// `[n, k]` and row `i` of `a` starts at `a[i * lda]`. Row-exact (see the
/// module doc). Spreads over output columns when `threads` allows.
///
/// # Panics
/// When `lda < k` or a slice is shorter than its stated shape.
pub fn matmul_packed(
    a: &[f32],
    lda: usize,
    w: &PackedMatrix,
    out: &mut [f32],
    m: usize,
    accumulate: bool,
    threads: Threads,
) {
    run_product(isa(), a, lda, w, out, m, accumulate, threads);
}

#[allow(clippy::too_many_arguments)] // `matmul_packed` plus the kernel choice
fn run_product(
    isa: Isa,
    a: &[f32],
    lda: usize,
    w: &PackedMatrix,
    out: &mut [f32],
    m: usize,
    accumulate: bool,
    threads: Threads,
) {
    let (k, n) = (w.cols, w.rows);
    if m == 0 || n == 0 {
        return;
    }
    assert!(lda >= k && a.len() >= (m - 1) * lda + k && out.len() >= m * n);
    let workers = match threads {
        Threads::One => 1,
        Threads::Pool => rayon::current_num_threads(),
    };
    let groups = n.div_ceil(GROUP);
    // A few tasks per thread, so a thread slowed by other load does not
    // hold the whole product up.
    let per_task = groups.div_ceil(workers * 4).max(1);
    let tasks = groups.div_ceil(per_task);
    let out = OutPtr(out.as_mut_ptr());
    let task = |t: usize| {
        let groups = t * per_task..((t + 1) * per_task).min(groups);
        #[cfg(target_arch = "x86_64")]
        if isa == Isa::Avx512 && m <= avx512::FUSED_ROWS {
            let (j0, j1) = (groups.start * GROUP, (groups.end * GROUP).min(n));
            // SAFETY: chosen only when the CPU has AVX-512F/BW, F16C and
            // FMA; the m rows of `a` and of the output are in bounds by the
            // assert, weight rows j0..j1 exist, and this task alone writes
            // output columns j0..j1.
            unsafe {
                avx512::fused_product(
                    w.ty,
                    a.as_ptr(),
                    lda,
                    m,
                    w.row(j0).as_ptr(),
                    k,
                    j1 - j0,
                    out.at(j0),
                    n,
                    accumulate,
                );
            }
            return;
        }
        let mut tile = vec![0.0f32; GROUP * k];
        for r0 in (0..m).step_by(ROW_BLOCK) {
            let rows = ROW_BLOCK.min(m - r0);
            for g in groups.clone() {
                let j0 = g * GROUP;
                let nr = GROUP.min(n - j0);
                for (j, dst) in tile.chunks_exact_mut(k).take(nr).enumerate() {
                    dequantize_into(isa, w.ty, w.row(j0 + j), dst);
                }
                // SAFETY: rows r0..r0+rows of `a` (stride lda) are in bounds
                // by the assert; the tile holds `nr` rows of `k`; the output
                // rows r0.. (stride n) end within `m * n` elements, also
                // asserted; and this task alone writes columns j0..j0+nr
                // (each group belongs to one task), so no two threads write
                // one element.
                unsafe {
                    tile_product(
                        isa,
                        a[r0 * lda..].as_ptr(),
                        lda,
                        rows,
                        &tile[..nr * k],
                        k,
                        nr,
                        out.at(r0 * n + j0),
                        n,
                        accumulate,
                    );
                }
            }
        }
    };
    if workers == 1 || tasks == 1 {
        (0..tasks).for_each(task);
    } else {
        (0..tasks).into_par_iter().for_each(task);
    }
}

/// The output of a product, shared by the tasks that write its disjoint
/// column ranges.
#[derive(Clone, Copy)]
struct OutPtr(*mut f32);

impl OutPtr {
    /// The element `offset` past the start (a method, so closures capture
    /// the whole `Send + Sync` wrapper rather than its raw field).
    ///
    /// # Safety
    /// `offset` is within the output.
    unsafe fn at(self, offset: usize) -> *mut f32 {
        // SAFETY: the caller's contract.
        unsafe { self.0.add(offset) }
    }
}

// SAFETY: the tasks of one product write disjoint elements through it, and
// the product outlives them (rayon joins before `run_product` returns).
unsafe impl Send for OutPtr {}
// SAFETY: as above.
unsafe impl Sync for OutPtr {}

/// `out[i * ldo + j] (+)= dot(a row i, tile row j)` for `i < rows`,
/// `j < nr`.
///
/// # Safety
/// `a` addresses `rows` rows of `k` readable elements at stride `lda`,
/// `tile` holds `nr` rows of `k` (`k` a multiple of [`LANES`]), and `out`
/// addresses `rows` rows of `nr` writable elements at stride `ldo` that no
/// other thread touches meanwhile.
#[allow(clippy::too_many_arguments)] // one tile's geometry
unsafe fn tile_product(
    isa: Isa,
    a: *const f32,
    lda: usize,
    rows: usize,
    tile: &[f32],
    k: usize,
    nr: usize,
    out: *mut f32,
    ldo: usize,
    accumulate: bool,
) {
    debug_assert!(k.is_multiple_of(LANES) && tile.len() >= nr * k);
    match isa {
        Isa::Portable => {
            for i in 0..rows {
                // SAFETY: the caller's contract bounds row i of `a` and of
                // `out`.
                let (a_row, out_row) = unsafe {
                    (
                        std::slice::from_raw_parts(a.add(i * lda), k),
                        std::slice::from_raw_parts_mut(out.add(i * ldo), nr),
                    )
                };
                for (o, w_row) in out_row.iter_mut().zip(tile.chunks_exact(k)) {
                    let d = dot_portable(a_row, w_row);
                    *o = if accumulate { *o + d } else { d };
                }
            }
        }
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `Isa::Avx2Fma` is only chosen when the CPU has AVX2 and
        // FMA; the bounds are the caller's contract.
        Isa::Avx2Fma => unsafe {
            avx2::tile_product(a, lda, rows, tile.as_ptr(), k, nr, out, ldo, accumulate)
        },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `Isa::Avx512` is only chosen when the CPU has AVX-512F/BW,
        // F16C and FMA; the bounds are the caller's contract.
        Isa::Avx512 => unsafe {
            avx512::tile_product(a, lda, rows, tile.as_ptr(), k, nr, out, ldo, accumulate)
        },
    }
}

/// The dot product in the module's fixed order, one element at a time.
fn dot_portable(a: &[f32], w: &[f32]) -> f32 {
    let mut acc = [0.0f32; LANES];
    for (ac, wc) in a.chunks_exact(LANES).zip(w.chunks_exact(LANES)) {
        for l in 0..LANES {
            acc[l] = ac[l].mul_add(wc[l], acc[l]);
        }
    }
    reduce(&acc)
}

/// The pairwise tree over the 16 running sums: `l + 8`, then `l + 4`,
/// `l + 2`, `l + 1`.
fn reduce(acc: &[f32; LANES]) -> f32 {
    let mut s = *acc;
    let mut width = LANES / 2;
    while width >= 1 {
        for l in 0..width {
            s[l] += s[l + width];
        }
        width /= 2;
    }
    s[0]
}

/// Dequantizes one row of `ty` blocks into `out` (`32 ×` blocks long), with
/// `dequant`'s arithmetic.
fn dequantize_into(isa: Isa, ty: GgmlType, row: &[u8], out: &mut [f32]) {
    let bb = ty.block_bytes();
    debug_assert_eq!(row.len() / bb * QK, out.len());
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: chosen only when the CPU has AVX2 and FMA.
        Isa::Avx2Fma => unsafe { avx2::dequantize_into(ty, row, out) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: chosen only when the CPU has AVX-512F/BW, F16C and FMA.
        Isa::Avx512 => unsafe { avx512::dequantize_into(ty, row, out) },
        Isa::Portable => {
            for (block, dst) in row.chunks_exact(bb).zip(out.chunks_exact_mut(QK)) {
                dequantize_block(ty, block, dst);
            }
        }
    }
}

/// One block, element by element (the formulas of `dequant`).
fn dequantize_block(ty: GgmlType, block: &[u8], dst: &mut [f32]) {
    let d = half_at(block, 0);
    match ty {
        GgmlType::Q4_0 => {
            let (lo, hi) = dst.split_at_mut(QK / 2);
            for ((q, l), h) in block[2..].iter().zip(lo).zip(hi) {
                *l = (i32::from(q & 0xF) - 8) as f32 * d;
                *h = (i32::from(q >> 4) - 8) as f32 * d;
            }
        }
        GgmlType::Q4_1 => {
            let m = half_at(block, 2);
            let (lo, hi) = dst.split_at_mut(QK / 2);
            for ((q, l), h) in block[4..].iter().zip(lo).zip(hi) {
                *l = f32::from(q & 0xF) * d + m;
                *h = f32::from(q >> 4) * d + m;
            }
        }
        GgmlType::Q8_0 => {
            for (q, o) in block[2..].iter().zip(dst) {
                *o = f32::from(*q as i8) * d;
            }
        }
        // `PackedMatrix::new` admits no other type.
        _ => unreachable!("{ty:?} is not a packed type"),
    }
}

fn half_at(block: &[u8], at: usize) -> f32 {
    half::f16::from_le_bytes([block[at], block[at + 1]]).to_f32()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Bytes from a seeded xorshift.
    fn bytes(len: usize, seed: u64) -> Vec<u8> {
        let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        (0..len)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                (x >> 32) as u8
            })
            .collect()
    }

    /// A random `[rows, cols]` matrix of `ty` with modest f16 scales.
    fn random(ty: GgmlType, rows: usize, cols: usize, seed: u64) -> PackedMatrix {
        let bb = ty.block_bytes();
        let mut data = bytes(rows * cols / QK * bb, seed);
        for (i, block) in data.chunks_exact_mut(bb).enumerate() {
            let d = half::f16::from_f32(0.01 + (i % 7) as f32 * 0.003);
            block[..2].copy_from_slice(&d.to_le_bytes());
            if ty == GgmlType::Q4_1 {
                let m = half::f16::from_f32(-0.05 + (i % 5) as f32 * 0.02);
                block[2..4].copy_from_slice(&m.to_le_bytes());
            }
        }
        PackedMatrix::new(ty, rows, cols, data).unwrap_or_else(|e| panic!("{e}"))
    }

    fn noise(len: usize, seed: u64) -> Vec<f32> {
        bytes(len, seed)
            .iter()
            .map(|&b| f32::from(b) / 128.0 - 1.0)
            .collect()
    }

    const TYPES: [GgmlType; 3] = [GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q8_0];

    /// The portable kernels and every SIMD kernel this CPU can run.
    fn isas() -> Vec<Isa> {
        let mut all = vec![Isa::Portable];
        #[cfg(target_arch = "x86_64")]
        {
            if isa() != Isa::Portable {
                all.push(Isa::Avx2Fma);
            }
            if isa() == Isa::Avx512 {
                all.push(Isa::Avx512);
            }
        }
        all
    }

    #[test]
    fn rows_dequantize_bit_for_bit_as_model_dequant_does() {
        for ty in TYPES {
            let w = random(ty, 5, 96, 1);
            let expected = w.to_f32();
            for isa in isas() {
                let mut row = vec![0.0f32; 96];
                for r in 0..5 {
                    dequantize_into(isa, ty, w.row(r), &mut row);
                    let want = &expected[r * 96..(r + 1) * 96];
                    assert!(
                        row.iter()
                            .zip(want)
                            .all(|(a, b)| a.to_bits() == b.to_bits()),
                        "{ty:?} row {r} on {isa:?}"
                    );
                }
            }
        }
    }

    #[test]
    fn products_match_the_f32_matrix_and_agree_across_kernels() {
        for (si, ty) in TYPES.into_iter().enumerate() {
            // n not a multiple of GROUP, k of two block rows and more.
            for (k, n) in [(32, 1), (64, 13), (160, 40)] {
                let w = random(ty, n, k, 10 + si as u64);
                let wf = w.to_f32();
                // One row and a few (the fused kernels), and many (tiles).
                for m in [1, 3, 70] {
                    let a = noise(m * (k + 3), 20 + si as u64);
                    let acc = noise(m * n, 30 + si as u64);
                    let mut results = Vec::new();
                    for isa in isas() {
                        let mut out = acc.clone();
                        run_product(isa, &a, k + 3, &w, &mut out, m, true, Threads::Pool);
                        for i in 0..m {
                            for j in 0..n {
                                let dot: f64 = (0..k)
                                    .map(|l| {
                                        f64::from(a[i * (k + 3) + l]) * f64::from(wf[j * k + l])
                                    })
                                    .sum();
                                let want = f64::from(acc[i * n + j]) + dot;
                                let got = f64::from(out[i * n + j]);
                                assert!(
                                    (got - want).abs() < 1e-4 * (1.0 + want.abs()),
                                    "{ty:?} k={k} n={n} ({i}, {j}) on {isa:?}: {got} vs {want}"
                                );
                            }
                        }
                        results.push(out);
                    }
                    assert!(
                        results.windows(2).all(|p| p[0] == p[1]),
                        "{ty:?} k={k} n={n} m={m}: kernels disagree"
                    );
                }
            }
        }
    }

    #[test]
    fn packed_products_are_row_exact_whatever_the_batch() {
        let (k, n) = (192, 50);
        for (si, ty) in TYPES.into_iter().enumerate() {
            let w = random(ty, n, k, 40 + si as u64);
            let a = noise(150 * k, 50 + si as u64);
            let mut alone = vec![0.0f32; 150 * n];
            for i in 0..150 {
                let o = &mut alone[i * n..(i + 1) * n];
                matmul_packed(&a[i * k..(i + 1) * k], k, &w, o, 1, false, Threads::One);
            }
            for m in [2, 3, 4, 5, 7, 64, 65, 129, 150] {
                for threads in [Threads::One, Threads::Pool] {
                    let mut out = vec![0.0f32; m * n];
                    matmul_packed(&a[..m * k], k, &w, &mut out, m, false, threads);
                    assert!(
                        out == alone[..m * n],
                        "{ty:?}: rows of a {m}-row product differ from single rows"
                    );
                }
            }
        }
    }

    #[test]
    fn bad_shapes_are_refused_and_stacking_needs_one_type() {
        assert!(PackedMatrix::new(GgmlType::Q6K, 1, 256, vec![0; 210]).is_err());
        assert!(PackedMatrix::new(GgmlType::Q8_0, 1, 48, vec![0; 34]).is_err());
        assert!(PackedMatrix::new(GgmlType::Q8_0, 2, 32, vec![0; 34]).is_err());
        let a = random(GgmlType::Q4_1, 2, 64, 1);
        let b = random(GgmlType::Q4_1, 3, 64, 2);
        let stacked = PackedMatrix::stack(&[&a, &b]).unwrap_or_else(|| panic!("stack"));
        assert_eq!(stacked.rows(), 5);
        assert_eq!(stacked.to_f32(), [a.to_f32(), b.to_f32()].concat());
        let c = random(GgmlType::Q8_0, 3, 64, 3);
        let values = noise(3 * 64, 4);
        let q = PackedMatrix::quantize_q8_0(3, 64, &values).unwrap_or_else(|e| panic!("{e}"));
        let err = crate::reference::max_abs_diff(&q.to_f32(), &values);
        assert!(err > 0.0 && err < 0.01, "q8_0 round trip error {err}");
        assert!(PackedMatrix::quantize_q8_0(3, 60, &values[..180]).is_err());
        assert!(PackedMatrix::stack(&[&a, &c]).is_none());
        let mut row = vec![0.0; 64];
        stacked.dequantize_row(3, &mut row);
        assert_eq!(row, b.to_f32()[64..128]);
    }
}
