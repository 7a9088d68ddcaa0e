//! GGML tensor types and their dequantization to f32, following
//! llama.cpp's `ggml-quants.c` (`dequantize_row_*`) and the Python `gguf`
//! package's `gguf.quants`, against which the tests hold golden values.
//!
//! A quantized row is a run of blocks; each block holds its scale(s) and
//! packed integers for a fixed number of elements (32, or 256 for the
//! "K" types' super-blocks).

use half::{bf16, f16};

/// The element types a tensor may have, with their GGML type ids.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GgmlType {
    /// 0: plain f32.
    F32,
    /// 1: IEEE half.
    F16,
    /// 2: 32 4-bit values, one f16 scale, offset −8.
    Q4_0,
    /// 3: 32 4-bit values, f16 scale and f16 minimum.
    Q4_1,
    /// 6: 32 5-bit values (4 low bits packed, the fifth in a 32-bit mask),
    /// one f16 scale, offset −16.
    Q5_0,
    /// 7: 32 5-bit values, f16 scale and f16 minimum.
    Q5_1,
    /// 8: 32 signed bytes, one f16 scale.
    Q8_0,
    /// 10: 256 2-bit values in 16 sub-blocks with 4-bit scales and minimums.
    Q2K,
    /// 11: 256 3-bit values (2 low bits, the third in a mask) in 16
    /// sub-blocks with 6-bit signed scales.
    Q3K,
    /// 12: 256 4-bit values in 8 sub-blocks with 6-bit scales and minimums.
    Q4K,
    /// 13: 256 5-bit values in 8 sub-blocks with 6-bit scales and minimums.
    Q5K,
    /// 14: 256 6-bit values in 16 sub-blocks with 8-bit scales.
    Q6K,
    /// 30: bfloat16.
    Bf16,
}

const QK: usize = 32;
const QK_K: usize = 256;

impl GgmlType {
    /// The type with GGML id `id`, when this reader supports it.
    pub fn from_id(id: u32) -> Option<Self> {
        Some(match id {
            0 => GgmlType::F32,
            1 => GgmlType::F16,
            2 => GgmlType::Q4_0,
            3 => GgmlType::Q4_1,
            6 => GgmlType::Q5_0,
            7 => GgmlType::Q5_1,
            8 => GgmlType::Q8_0,
            10 => GgmlType::Q2K,
            11 => GgmlType::Q3K,
            12 => GgmlType::Q4K,
            13 => GgmlType::Q5K,
            14 => GgmlType::Q6K,
            30 => GgmlType::Bf16,
            _ => return None,
        })
    }

    /// Elements per block.
    pub fn block_elems(self) -> usize {
        match self {
            GgmlType::F32 | GgmlType::F16 | GgmlType::Bf16 => 1,
            GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q5_0 | GgmlType::Q5_1 | GgmlType::Q8_0 => {
                QK
            }
            GgmlType::Q2K | GgmlType::Q3K | GgmlType::Q4K | GgmlType::Q5K | GgmlType::Q6K => QK_K,
        }
    }

    /// Bytes per block.
    pub fn block_bytes(self) -> usize {
        match self {
            GgmlType::F32 => 4,
            GgmlType::F16 | GgmlType::Bf16 => 2,
            GgmlType::Q4_0 => 2 + QK / 2,
            GgmlType::Q4_1 => 4 + QK / 2,
            GgmlType::Q5_0 => 2 + 4 + QK / 2,
            GgmlType::Q5_1 => 4 + 4 + QK / 2,
            GgmlType::Q8_0 => 2 + QK,
            GgmlType::Q2K => QK_K / 16 + QK_K / 4 + 4,
            GgmlType::Q3K => QK_K / 8 + QK_K / 4 + 12 + 2,
            GgmlType::Q4K => 4 + 12 + QK_K / 2,
            GgmlType::Q5K => 4 + 12 + QK_K / 8 + QK_K / 2,
            GgmlType::Q6K => QK_K / 2 + QK_K / 4 + QK_K / 16 + 2,
        }
    }

    /// Bytes of a tensor of `dims` (innermost first); `None` when its rows
    /// are not whole blocks or the size overflows.
    pub fn bytes_for(self, dims: &[u64]) -> Option<u64> {
        let block = self.block_elems() as u64;
        let row = *dims.first().unwrap_or(&1);
        if !row.is_multiple_of(block) {
            return None;
        }
        let elems = dims.iter().try_fold(1u64, |acc, &d| acc.checked_mul(d))?;
        (elems / block).checked_mul(self.block_bytes() as u64)
    }

    /// Dequantizes whole blocks of `data` (its length a multiple of
    /// [`GgmlType::block_bytes`]).
    pub fn dequantize(self, data: &[u8]) -> Vec<f32> {
        let blocks = data.chunks_exact(self.block_bytes());
        let mut out = Vec::with_capacity(blocks.len() * self.block_elems());
        for block in blocks {
            match self {
                GgmlType::F32 => {
                    out.push(f32::from_le_bytes([block[0], block[1], block[2], block[3]]))
                }
                GgmlType::F16 => out.push(half_at(block, 0)),
                GgmlType::Bf16 => out.push(bf16::from_le_bytes([block[0], block[1]]).to_f32()),
                GgmlType::Q4_0 => q4_0(block, &mut out),
                GgmlType::Q4_1 => q4_1(block, &mut out),
                GgmlType::Q5_0 => q5_0(block, &mut out),
                GgmlType::Q5_1 => q5_1(block, &mut out),
                GgmlType::Q8_0 => q8_0(block, &mut out),
                GgmlType::Q2K => q2_k(block, &mut out),
                GgmlType::Q3K => q3_k(block, &mut out),
                GgmlType::Q4K => q4_k(block, &mut out),
                GgmlType::Q5K => q5_k(block, &mut out),
                GgmlType::Q6K => q6_k(block, &mut out),
            }
        }
        out
    }
}

fn half_at(block: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([block[at], block[at + 1]]).to_f32()
}

/// `d: f16, qs: [u8; 16]`; element j is `(low nibble of qs[j] − 8)·d`,
/// element j + 16 the high nibble.
fn q4_0(block: &[u8], out: &mut Vec<f32>) {
    let d = half_at(block, 0);
    let qs = &block[2..];
    out.extend(qs.iter().map(|q| (i32::from(q & 0xF) - 8) as f32 * d));
    out.extend(qs.iter().map(|q| (i32::from(q >> 4) - 8) as f32 * d));
}

/// `d: f16, m: f16, qs: [u8; 16]`; element is `q·d + m`.
fn q4_1(block: &[u8], out: &mut Vec<f32>) {
    let (d, m) = (half_at(block, 0), half_at(block, 2));
    let qs = &block[4..];
    out.extend(qs.iter().map(|q| f32::from(q & 0xF) * d + m));
    out.extend(qs.iter().map(|q| f32::from(q >> 4) * d + m));
}

/// The 32 5-bit values of a Q5_0 / Q5_1 block: `qh` (4 bytes, little
/// endian) holds bit 4 of element j at bit j; `qs` the low nibbles,
/// elements j and j + 16 in byte j.
fn five_bit(qh: &[u8], qs: &[u8]) -> impl Iterator<Item = u8> {
    let high = u32::from_le_bytes([qh[0], qh[1], qh[2], qh[3]]);
    (0..QK).map(move |j| {
        let low = if j < 16 { qs[j] & 0xF } else { qs[j - 16] >> 4 };
        low | ((((high >> j) & 1) as u8) << 4)
    })
}

/// `d: f16, qh: u32, qs: [u8; 16]`; element is `(q − 16)·d`.
fn q5_0(block: &[u8], out: &mut Vec<f32>) {
    let d = half_at(block, 0);
    out.extend(five_bit(&block[2..6], &block[6..]).map(|q| (i32::from(q) - 16) as f32 * d));
}

/// `d: f16, m: f16, qh: u32, qs: [u8; 16]`; element is `q·d + m`.
fn q5_1(block: &[u8], out: &mut Vec<f32>) {
    let (d, m) = (half_at(block, 0), half_at(block, 2));
    out.extend(five_bit(&block[4..8], &block[8..]).map(|q| f32::from(q) * d + m));
}

/// `d: f16, qs: [i8; 32]`; element is `q·d`.
fn q8_0(block: &[u8], out: &mut Vec<f32>) {
    let d = half_at(block, 0);
    out.extend(block[2..].iter().map(|&q| f32::from(q as i8) * d));
}

/// The 6-bit scale and minimum of sub-block `j` of a Q4_K block's 12 packed
/// bytes (llama.cpp's `get_scale_min_k4`).
fn scale_min_k4(j: usize, s: &[u8]) -> (u8, u8) {
    if j < 4 {
        (s[j] & 63, s[j + 4] & 63)
    } else {
        (
            (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4),
            (s[j + 4] >> 4) | ((s[j] >> 6) << 4),
        )
    }
}

/// `d: f16, dmin: f16, scales: [u8; 12], qs: [u8; 128]`: 8 sub-blocks of 32;
/// each 64 elements share 32 bytes of `qs`, low nibbles then high.
fn q4_k(block: &[u8], out: &mut Vec<f32>) {
    let (d, dmin) = (half_at(block, 0), half_at(block, 2));
    let scales = &block[4..16];
    let qs = &block[16..];
    for (pair, q) in qs.chunks_exact(32).enumerate() {
        let (sc1, m1) = scale_min_k4(2 * pair, scales);
        let (sc2, m2) = scale_min_k4(2 * pair + 1, scales);
        let (d1, m1) = (d * f32::from(sc1), dmin * f32::from(m1));
        let (d2, m2) = (d * f32::from(sc2), dmin * f32::from(m2));
        out.extend(q.iter().map(|v| d1 * f32::from(v & 0xF) - m1));
        out.extend(q.iter().map(|v| d2 * f32::from(v >> 4) - m2));
    }
}

/// `scales: [u8; 16], qs: [u8; 64], d: f16, dmin: f16`: 16 sub-blocks of
/// 16; sub-block i has scale `d · (scales[i] & 15)` and minimum
/// `dmin · (scales[i] >> 4)`; element `128c + 32s + l` is bits `2s..2s+2`
/// of `qs[32c + l]`.
fn q2_k(block: &[u8], out: &mut Vec<f32>) {
    let (scales, rest) = block.split_at(QK_K / 16);
    let (qs, rest) = rest.split_at(QK_K / 4);
    let (d, dmin) = (half_at(rest, 0), half_at(rest, 2));
    for pos in 0..QK_K {
        let (c, s, l) = (pos / 128, pos / 32 % 4, pos % 32);
        let q = (qs[32 * c + l] >> (2 * s)) & 3;
        let sc = scales[pos / 16];
        let (dl, ml) = (d * f32::from(sc & 0xF), dmin * f32::from(sc >> 4));
        out.push(dl * f32::from(q) - ml);
    }
}

/// `hmask: [u8; 32], qs: [u8; 64], scales: [u8; 12], d: f16`: 16
/// sub-blocks of 16 with 6-bit scales (low 4 bits in `scales[0..8]`, two
/// per byte, the high 2 in `scales[8..12]`, four per byte) offset by −32;
/// element `128c + 32s + l` takes bits `2s..2s+2` of `qs[32c + l]`, less 4
/// unless bit `pos / 32` of `hmask[l]` is set.
fn q3_k(block: &[u8], out: &mut Vec<f32>) {
    let (hmask, rest) = block.split_at(QK_K / 8);
    let (qs, rest) = rest.split_at(QK_K / 4);
    let (packed, d) = rest.split_at(12);
    let d = half_at(d, 0);
    let scale = |i: usize| {
        let low = (packed[i % 8] >> (4 * (i / 8))) & 0xF;
        let high = (packed[8 + i % 4] >> (2 * (i / 4))) & 3;
        f32::from(((low | (high << 4)) as i8) - 32)
    };
    for pos in 0..QK_K {
        let (c, s, l) = (pos / 128, pos / 32 % 4, pos % 32);
        let low = ((qs[32 * c + l] >> (2 * s)) & 3) as i8;
        let high_clear = (hmask[l] >> (pos / 32)) & 1 == 0;
        let q = low - if high_clear { 4 } else { 0 };
        out.push(d * scale(pos / 16) * f32::from(q));
    }
}

/// `d: f16, dmin: f16, scales: [u8; 12], qh: [u8; 32], qs: [u8; 128]`: 8
/// sub-blocks of 32 with the scales and minimums of Q4_K; element
/// `64c + 32s + l` is nibble s of `qs[32c + l]` plus bit `pos / 32` of
/// `qh[l]` as its fifth bit.
fn q5_k(block: &[u8], out: &mut Vec<f32>) {
    let (d, dmin) = (half_at(block, 0), half_at(block, 2));
    let scales = &block[4..16];
    let (qh, qs) = block[16..].split_at(QK_K / 8);
    for pos in 0..QK_K {
        let (c, s, l) = (pos / 64, pos / 32 % 2, pos % 32);
        let low = (qs[32 * c + l] >> (4 * s)) & 0xF;
        let q = low | (((qh[l] >> (pos / 32)) & 1) << 4);
        let (sc, m) = scale_min_k4(pos / 32, scales);
        let (dl, ml) = (d * f32::from(sc), dmin * f32::from(m));
        out.push(dl * f32::from(q) - ml);
    }
}

/// `ql: [u8; 128], qh: [u8; 64], scales: [i8; 16], d: f16`: each half of
/// 128 elements takes 64 bytes of `ql` (low 4 bits), 32 of `qh` (2 high
/// bits each) and 8 scales.
fn q6_k(block: &[u8], out: &mut Vec<f32>) {
    let (ql_all, rest) = block.split_at(QK_K / 2);
    let (qh_all, rest) = rest.split_at(QK_K / 4);
    let (scales, d) = rest.split_at(QK_K / 16);
    let d = half_at(d, 0);
    for half in 0..2 {
        let ql = &ql_all[half * 64..];
        let qh = &qh_all[half * 32..];
        let sc = &scales[half * 8..];
        let mut y = [0.0f32; 128];
        for l in 0..32 {
            let is = l / 16;
            let q = |low: u8, shift: u8| i32::from(low | (((qh[l] >> shift) & 3) << 4)) - 32;
            let q1 = q(ql[l] & 0xF, 0);
            let q2 = q(ql[l + 32] & 0xF, 2);
            let q3 = q(ql[l] >> 4, 4);
            let q4 = q(ql[l + 32] >> 4, 6);
            let s = |k: usize| f32::from(sc[is + k] as i8);
            y[l] = d * s(0) * q1 as f32;
            y[l + 32] = d * s(2) * q2 as f32;
            y[l + 64] = d * s(4) * q3 as f32;
            y[l + 96] = d * s(6) * q4 as f32;
        }
        out.extend_from_slice(&y);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Golden values from the Python `gguf` package
    /// (`scripts/dequant_golden.py`): per type, raw block bytes and
    /// `gguf.quants.dequantize` of them.
    const GOLDEN: &str = include_str!("../tests/data/dequant_golden.json");

    fn hex(s: &str) -> Vec<u8> {
        (0..s.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap_or_else(|e| panic!("{e}")))
            .collect()
    }

    #[test]
    fn every_type_matches_the_gguf_python_package() {
        let golden: serde_json::Value =
            serde_json::from_str(GOLDEN).unwrap_or_else(|e| panic!("{e}"));
        let cases = golden
            .as_object()
            .unwrap_or_else(|| panic!("not an object"));
        let mut seen = Vec::new();
        for (name, case) in cases {
            let id = case["type_id"].as_u64().unwrap_or(u64::MAX) as u32;
            let ty = GgmlType::from_id(id).unwrap_or_else(|| panic!("{name}: id {id}"));
            let data = hex(case["bytes"].as_str().unwrap_or_default());
            let expected: Vec<f32> = case["values"]
                .as_array()
                .unwrap_or_else(|| panic!("{name}: values"))
                .iter()
                .map(|v| v.as_f64().unwrap_or(f64::NAN) as f32)
                .collect();
            assert_eq!(data.len() % ty.block_bytes(), 0, "{name}");
            let got = ty.dequantize(&data);
            assert_eq!(got.len(), expected.len(), "{name}");
            for (i, (g, e)) in got.iter().zip(&expected).enumerate() {
                // Bit-exact: the same f32 operations in the same order.
                assert_eq!(
                    g.to_bits(),
                    e.to_bits(),
                    "{name}[{i}]: got {g}, gguf gives {e}"
                );
            }
            seen.push(ty);
        }
        for ty in [
            GgmlType::F32,
            GgmlType::F16,
            GgmlType::Bf16,
            GgmlType::Q4_0,
            GgmlType::Q4_1,
            GgmlType::Q5_0,
            GgmlType::Q5_1,
            GgmlType::Q8_0,
            GgmlType::Q2K,
            GgmlType::Q3K,
            GgmlType::Q4K,
            GgmlType::Q5K,
            GgmlType::Q6K,
        ] {
            assert!(seen.contains(&ty), "no golden case for {ty:?}");
        }
    }

    #[test]
    fn rows_must_be_whole_blocks() {
        assert_eq!(GgmlType::Q8_0.bytes_for(&[64, 3]), Some(2 * 3 * 34));
        assert_eq!(GgmlType::Q8_0.bytes_for(&[48, 3]), None);
        assert_eq!(GgmlType::Q6K.bytes_for(&[256]), Some(210));
        assert_eq!(GgmlType::Q4K.bytes_for(&[256]), Some(144));
        assert_eq!(GgmlType::F32.bytes_for(&[u64::MAX, 2]), None);
    }
}
