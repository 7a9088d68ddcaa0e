//! Small numeric building blocks shared by the paged backend and the dense
//! reference: RMSNorm, RoPE, SiLU, softmax, argmax, and a safe wrapper over
//! the `gemm` crate's matrix product.
//!
//! The matrix products are *row-exact*: row `i` of a product is the same
//! bits whatever other rows share the call, so a token's K/V, hidden state
//! and logits do not depend on the batch it was computed in (that is what
//! makes a reused prefix bit-identical to a recomputed one). `gemm` sums in
//! the same order for every row of its main kernel, but takes other paths,
//! with other summation orders, for one row (a GEMV), for products of at
//! most 256 outputs (a horizontal kernel), and it blocks the inner dimension
//! differently for `m, n <= 64` when `k > 512`. [`exact_rows`] says how many
//! rows keep a call on the main kernel; smaller products are padded with
//! zero rows up to it.

pub use crate::threads::Threads;

/// `out[m, n] = a[m, k] · w[n, k]ᵀ` (plus `out` when `accumulate`), all
/// row-major: the product of activations with a `[out, in]` weight matrix.
/// Row-exact (see the module doc).
///
/// # Panics
/// When a slice is shorter than its stated shape (a bug in the caller; the
/// check is what keeps the raw-pointer call below sound).
pub fn matmul_wt(
    a: &[f32],
    w: &[f32],
    out: &mut [f32],
    (m, k, n): (usize, usize, usize),
    accumulate: bool,
    threads: Threads,
) {
    matmul_wt_strided(a, k, w, out, (m, k, n), accumulate, threads);
}

/// [`matmul_wt`] where row `i` of `a` starts at `a[i * lda]` (`lda >= k`):
/// the first `k` columns of a wider matrix.
///
/// # Panics
/// When `lda < k` or a slice is shorter than its stated shape.
pub fn matmul_wt_strided(
    a: &[f32],
    lda: usize,
    w: &[f32],
    out: &mut [f32],
    (m, k, n): (usize, usize, usize),
    accumulate: bool,
    threads: Threads,
) {
    if m == 0 || n == 0 {
        return;
    }
    assert!(lda >= k && a.len() >= (m - 1) * lda + k && w.len() >= n * k && out.len() >= m * n);
    let rhs = Rhs {
        ptr: w.as_ptr(),
        cs: k as isize,
        rs: 1,
    };
    with_exact_rows(a, lda, out, (m, k, n), accumulate, |a, lda, out, rows| {
        // SAFETY: `with_exact_rows` hands `rows` rows of `lda` and of `n`
        // (both bounded as above, or freshly allocated at that size) and
        // the assert bounds w[j*k + l] for j < n, l < k.
        unsafe { gemm_raw(a, lda, rhs, out, (rows, k, n), accumulate, threads) }
    });
}

/// `out[m, n] = a[m, k] · b[k, n]`, all row-major. Row-exact.
///
/// # Panics
/// When a slice is shorter than its stated shape.
pub fn matmul(
    a: &[f32],
    b: &[f32],
    out: &mut [f32],
    (m, k, n): (usize, usize, usize),
    threads: Threads,
) {
    assert!(a.len() >= m * k && b.len() >= k * n && out.len() >= m * n);
    if m == 0 || n == 0 {
        return;
    }
    let rhs = Rhs {
        ptr: b.as_ptr(),
        cs: 1,
        rs: n as isize,
    };
    with_exact_rows(a, k, out, (m, k, n), false, |a, lda, out, rows| {
        // SAFETY: as in `matmul_wt_strided`; the assert bounds b[l*n + j].
        unsafe { gemm_raw(a, lda, rhs, out, (rows, k, n), false, threads) }
    });
}

/// Fewest rows for which `gemm` runs an `[m, k] x [k, n]` product on its
/// main kernel, whose per-row summation order does not depend on `m`.
pub fn exact_rows(n: usize, k: usize) -> usize {
    let mut rows = 2usize.max(256 / n.max(1) + 1);
    if n <= 64 && k > 512 {
        rows = rows.max(65);
    }
    rows
}

/// Calls `f(a, lda, out, rows)` with at least [`exact_rows`] rows: the
/// caller's buffers when `m` is enough, else zero-padded copies (whose
/// first `m` output rows are copied back).
fn with_exact_rows(
    a: &[f32],
    lda: usize,
    out: &mut [f32],
    (m, k, n): (usize, usize, usize),
    accumulate: bool,
    f: impl FnOnce(&[f32], usize, &mut [f32], usize),
) {
    let rows = exact_rows(n, k);
    if m >= rows {
        return f(a, lda, out, m);
    }
    let mut pa = vec![0.0f32; rows * k];
    for (dst, i) in pa.chunks_exact_mut(k).zip(0..m) {
        dst.copy_from_slice(&a[i * lda..i * lda + k]);
    }
    let mut po = vec![0.0f32; rows * n];
    if accumulate {
        po[..m * n].copy_from_slice(&out[..m * n]);
    }
    f(&pa, k, &mut po, rows);
    out[..m * n].copy_from_slice(&po[..m * n]);
}

/// The right-hand matrix of a product: element `(l, j)` at
/// `ptr[l * rs + j * cs]`.
#[derive(Clone, Copy)]
struct Rhs {
    ptr: *const f32,
    cs: isize,
    rs: isize,
}

/// `out[rows, n] (+)= a[rows, k] · rhs[k, n]`.
///
/// # Safety
/// `a` holds `rows` rows of stride `lda >= k`, `out` holds `rows * n`
/// elements, and `rhs` addresses `k x n` readable elements.
unsafe fn gemm_raw(
    a: &[f32],
    lda: usize,
    rhs: Rhs,
    out: &mut [f32],
    (rows, k, n): (usize, usize, usize),
    accumulate: bool,
    threads: Threads,
) {
    debug_assert!(a.len() >= (rows - 1) * lda + k && out.len() >= rows * n);
    // SAFETY: the caller's contract bounds every element the strides reach.
    unsafe {
        gemm::gemm(
            rows,
            n,
            k,
            out.as_mut_ptr(),
            1,
            n as isize,
            accumulate,
            a.as_ptr(),
            1,
            lda as isize,
            rhs.ptr,
            rhs.cs,
            rhs.rs,
            if accumulate { 1.0 } else { 0.0 },
            1.0,
            false,
            false,
            false,
            parallelism(threads),
        );
    }
}

fn parallelism(threads: Threads) -> gemm::Parallelism {
    match threads {
        Threads::One => gemm::Parallelism::None,
        Threads::Pool if rayon::current_num_threads() > 1 => gemm::Parallelism::Rayon(0),
        Threads::Pool => gemm::Parallelism::None,
    }
}

/// `out = x / rms(x) * weight`.
pub fn rms_norm(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let mean_sq = x.iter().map(|v| v * v).sum::<f32>() / x.len() as f32;
    let scale = 1.0 / (mean_sq + eps).sqrt();
    for ((o, v), w) in out.iter_mut().zip(x).zip(weight) {
        *o = v * scale * w;
    }
}

/// Rotary position embedding in the "rotate half" layout of HF Llama: pairs
/// are `(i, i + head_dim/2)`.
#[derive(Debug, Clone)]
pub struct Rope {
    inv_freq: Vec<f64>,
}

impl Rope {
    /// RoPE for heads of `head_dim` (even) with base `theta`.
    pub fn new(head_dim: usize, theta: f32) -> Self {
        let half = head_dim / 2;
        let inv_freq = (0..half)
            .map(|i| 1.0 / f64::from(theta).powf(2.0 * i as f64 / head_dim as f64))
            .collect();
        Rope { inv_freq }
    }

    /// RoPE with these frequencies (`ModelConfig::layer_inv_freq`: a
    /// model's, possibly rescaled, or one layer's own base).
    pub fn from_inv_freq(inv_freq: Vec<f64>) -> Self {
        Rope { inv_freq }
    }

    /// Cosine and sine of every frequency at `pos`.
    pub fn table(&self, pos: usize) -> Vec<(f32, f32)> {
        self.inv_freq
            .iter()
            .map(|f| {
                let (s, c) = (pos as f64 * f).sin_cos();
                (c as f32, s as f32)
            })
            .collect()
    }

    /// Rotates every head of `x` (concatenated heads of `head_dim`) to `pos`.
    pub fn apply(&self, x: &mut [f32], pos: usize) {
        Self::apply_table(x, &self.table(pos));
    }

    /// Rotates every head of `x` with a precomputed [`Rope::table`].
    pub fn apply_table(x: &mut [f32], cos_sin: &[(f32, f32)]) {
        let half = cos_sin.len();
        for head in x.chunks_exact_mut(2 * half) {
            let (lo, hi) = head.split_at_mut(half);
            for ((a, b), (c, s)) in lo.iter_mut().zip(hi.iter_mut()).zip(cos_sin) {
                let (x1, x2) = (*a, *b);
                *a = x1 * c - x2 * s;
                *b = x2 * c + x1 * s;
            }
        }
    }
}

/// `silu(gate) * up`, into `gate`.
pub fn swiglu(gate: &mut [f32], up: &[f32]) {
    for (g, u) in gate.iter_mut().zip(up) {
        *g = *g / (1.0 + (-*g).exp()) * u;
    }
}

/// `gelu_tanh(gate) * up`, into `gate`: GELU with the tanh approximation
/// (PyTorch's `gelu(approximate="tanh")`, Gemma's `gelu_pytorch_tanh`).
pub fn geglu_tanh(gate: &mut [f32], up: &[f32]) {
    // sqrt(2 / pi), as PyTorch's kernel computes it.
    const BETA: f32 = std::f32::consts::SQRT_2 * std::f32::consts::FRAC_2_SQRT_PI * 0.5;
    const KAPPA: f32 = 0.044715;
    for (g, u) in gate.iter_mut().zip(up) {
        let x = *g;
        let inner = BETA * (x + KAPPA * x * x * x);
        *g = 0.5 * x * (1.0 + inner.tanh()) * u;
    }
}

/// `cap * tanh(v / cap)` over `values` (Gemma 2's soft-capping of
/// attention scores and logits).
pub fn soft_cap(values: &mut [f32], cap: f32) {
    for v in values {
        *v = (*v / cap).tanh() * cap;
    }
}

/// Softmax in place; entries equal to `-inf` get probability 0.
pub fn softmax(row: &mut [f32]) {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    if max == f32::NEG_INFINITY {
        row.fill(0.0);
        return;
    }
    let mut sum = 0.0;
    for v in row.iter_mut() {
        *v = (*v - max).exp();
        sum += *v;
    }
    for v in row.iter_mut() {
        *v /= sum;
    }
}

/// Index of the largest value (the first one on ties; NaN never wins; 0
/// when no value is a number).
pub fn argmax(row: &[f32]) -> usize {
    // Two plain passes (the maximum, then where it first is) run several
    // times faster over a vocabulary-wide row than one pass that tracks an
    // index.
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    row.iter().position(|&v| v == max).unwrap_or(0)
}

/// First key position a query at `pos` attends to under `window` (0 = full).
pub fn window_start(pos: usize, window: u32) -> usize {
    if window == 0 {
        0
    } else {
        (pos + 1).saturating_sub(window as usize)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matmul_wt_matches_loops() {
        let (m, k, n) = (3, 5, 4);
        let a: Vec<f32> = (0..m * k).map(|i| i as f32 * 0.5 - 3.0).collect();
        let w: Vec<f32> = (0..n * k).map(|i| (i as f32).sin()).collect();
        let mut out = vec![1.0; m * n];
        matmul_wt(&a, &w, &mut out, (m, k, n), true, Threads::Pool);
        for i in 0..m {
            for j in 0..n {
                let dot: f32 = (0..k).map(|l| a[i * k + l] * w[j * k + l]).sum();
                assert!((out[i * n + j] - (1.0 + dot)).abs() < 1e-4);
            }
        }
        let b: Vec<f32> = (0..k * n).map(|i| (i as f32).cos()).collect();
        matmul(&a, &b, &mut out, (m, k, n), Threads::One);
        for i in 0..m {
            for j in 0..n {
                let dot: f32 = (0..k).map(|l| a[i * k + l] * b[l * n + j]).sum();
                assert!((out[i * n + j] - dot).abs() < 1e-4);
            }
        }
    }

    /// Values in [-1, 1) from a seeded xorshift, for product inputs.
    fn noise(len: usize, seed: u64) -> Vec<f32> {
        let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        (0..len)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                (x >> 40) as f32 / (1u64 << 23) as f32 - 1.0
            })
            .collect()
    }

    #[test]
    fn products_are_row_exact_whatever_the_batch() {
        // (k, n): model-like shapes, tiny ones (horizontal kernel), n <= 64
        // with k > 512 (other inner blocking), and a GEMV-sized one.
        let shapes = [
            (32, 64),
            (8, 16),
            (48, 192),
            (256, 1000),
            (700, 32),
            (64, 5),
            (1100, 300),
        ];
        for (si, &(k, n)) in shapes.iter().enumerate() {
            let w = noise(n * k, 100 + si as u64);
            let b = noise(k * n, 200 + si as u64);
            let a = noise(130 * k, 300 + si as u64);
            let acc = noise(130 * n, 400 + si as u64);
            // Each row alone is the reference.
            let mut alone_wt = vec![0.0f32; 130 * n];
            let mut alone = vec![0.0f32; 130 * n];
            for i in 0..130 {
                let row = &a[i * k..(i + 1) * k];
                let o = &mut alone_wt[i * n..(i + 1) * n];
                o.copy_from_slice(&acc[i * n..(i + 1) * n]);
                matmul_wt(row, &w, o, (1, k, n), true, Threads::One);
                matmul(
                    row,
                    &b,
                    &mut alone[i * n..(i + 1) * n],
                    (1, k, n),
                    Threads::One,
                );
            }
            for m in [2, 3, 5, 9, 17, 33, 64, 65, 100, 130] {
                for threads in [Threads::One, Threads::Pool] {
                    let mut out = acc[..m * n].to_vec();
                    matmul_wt(&a[..m * k], &w, &mut out, (m, k, n), true, threads);
                    assert!(
                        out == alone_wt[..m * n],
                        "matmul_wt k={k} n={n}: rows of a {m}-row product differ from single rows"
                    );
                    let mut out = vec![0.0f32; m * n];
                    matmul(&a[..m * k], &b, &mut out, (m, k, n), threads);
                    assert!(
                        out == alone[..m * n],
                        "matmul k={k} n={n}: rows of a {m}-row product differ from single rows"
                    );
                }
            }
        }
    }

    #[test]
    fn rope_at_zero_is_identity_and_preserves_norm() {
        let rope = Rope::new(8, 10_000.0);
        let x: Vec<f32> = (0..16).map(|i| i as f32 - 7.0).collect();
        let mut y = x.clone();
        rope.apply(&mut y, 0);
        assert_eq!(x, y);
        rope.apply(&mut y, 37);
        let n = |v: &[f32]| v.iter().map(|a| a * a).sum::<f32>();
        assert!((n(&x) - n(&y)).abs() < 1e-3);
        assert_ne!(x, y);
    }

    #[test]
    fn windows_and_argmax() {
        assert_eq!(window_start(10, 0), 0);
        assert_eq!(window_start(10, 4), 7);
        assert_eq!(window_start(2, 4), 0);
        assert_eq!(argmax(&[1.0, 3.0, 3.0, -1.0]), 1);
        assert_eq!(argmax(&[f32::NAN, -1.0, 2.0, f32::NAN, 2.0]), 2);
        assert_eq!(argmax(&[f32::NAN, f32::NEG_INFINITY]), 1);
        assert_eq!(argmax(&[f32::NAN, f32::NAN]), 0);
        let mut row = [0.0, f32::NEG_INFINITY, 0.0];
        softmax(&mut row);
        assert_eq!(row, [0.5, 0.0, 0.5]);
    }
}
