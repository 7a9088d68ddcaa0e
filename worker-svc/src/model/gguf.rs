//! A reader for GGUF files (llama.cpp's model format, versions 2 and 3):
//! the header, the metadata key/values and the tensor table, with the
//! tensors' bytes left in place until [`GgufFile::tensor_f32`] dequantizes
//! one (see [`crate::dequant`]).
//!
//! Our own reader rather than a crate: the GGUF crates on crates.io (`gguf`,
//! `ggus`, `gguf-rs-lib`) parse the container but do not dequantize, or do
//! so for fewer types, and the format is small and stable. Every read is
//! bounds-checked, so a truncated or corrupt file is an error naming what
//! was being read, never a panic.
//!
//! Layout (little-endian): magic `GGUF`, version u32, tensor count u64,
//! metadata count u64; the metadata (key string, value type u32, value);
//! the tensor infos (name, dims u32, dims × u64 innermost first, type u32,
//! offset u64); then, aligned to `general.alignment` (default 32), the
//! tensor data, each tensor at its offset from the start of that region.

use std::collections::HashMap;

use crate::dequant::GgmlType;

/// One metadata value.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    /// Any unsigned integer type.
    U64(u64),
    /// Any signed integer type.
    I64(i64),
    /// FLOAT32 or FLOAT64.
    F64(f64),
    /// BOOL.
    Bool(bool),
    /// STRING.
    Str(String),
    /// ARRAY (of any one type).
    Array(Vec<Value>),
}

impl Value {
    /// The value as an unsigned integer, when it is a non-negative integer.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Value::U64(v) => Some(v),
            Value::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    /// The value as a float, when it is a number.
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Value::F64(v) => Some(v),
            Value::U64(v) => Some(v as f64),
            Value::I64(v) => Some(v as f64),
            _ => None,
        }
    }

    /// The value as a string, when it is one.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::Str(s) => Some(s),
            _ => None,
        }
    }

    /// The value as a bool, when it is one.
    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            Value::Bool(b) => Some(b),
            _ => None,
        }
    }

    /// The elements, when the value is an array.
    pub fn as_array(&self) -> Option<&[Value]> {
        match self {
            Value::Array(a) => Some(a),
            _ => None,
        }
    }
}

/// One entry of the tensor table.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorInfo {
    /// Tensor name (`blk.0.attn_q.weight`).
    pub name: String,
    /// Dimensions, innermost first (GGUF order): a `[rows, cols]` matrix is
    /// `[cols, rows]` here.
    pub dims: Vec<u64>,
    /// Element type.
    pub ty: GgmlType,
    /// Byte offset of the data from the start of the data region.
    pub offset: u64,
}

impl TensorInfo {
    /// Number of elements.
    pub fn elems(&self) -> u64 {
        self.dims.iter().product()
    }
}

/// A parsed GGUF file, holding its bytes.
#[derive(Debug)]
pub struct GgufFile {
    /// Format version (2 or 3).
    pub version: u32,
    /// Metadata by key.
    pub metadata: HashMap<String, Value>,
    /// The tensor table, in file order.
    pub tensors: Vec<TensorInfo>,
    bytes: Vec<u8>,
    data_start: usize,
}

const MAGIC: &[u8; 4] = b"GGUF";
const DEFAULT_ALIGNMENT: u64 = 32;
/// Nesting limit of metadata arrays (real files nest at most once).
const MAX_DEPTH: usize = 4;

impl GgufFile {
    /// Parses `bytes` as a GGUF file. The error says what could not be read.
    pub fn parse(bytes: Vec<u8>) -> Result<Self, String> {
        let mut r = Reader {
            bytes: &bytes,
            pos: 0,
        };
        let magic = r.take(4, "the magic number")?;
        if magic != MAGIC {
            return Err(format!(
                "not a GGUF file (magic {magic:02x?}, expected \"GGUF\")"
            ));
        }
        let version = r.u32("the version")?;
        if !(2..=3).contains(&version) {
            return Err(format!(
                "unsupported GGUF version {version} (2 and 3 are read)"
            ));
        }
        let tensor_count = r.u64("the tensor count")?;
        let kv_count = r.u64("the metadata count")?;
        let mut metadata = HashMap::new();
        for i in 0..kv_count {
            let key = r.string(|| format!("metadata key {i}"))?;
            let ty = r.u32(&format!("the type of metadata {key}"))?;
            let value = r.value(ty, &key, 0)?;
            metadata.insert(key, value);
        }
        let mut tensors = Vec::new();
        for i in 0..tensor_count {
            let name = r.string(|| format!("the name of tensor {i}"))?;
            let n_dims = r.u32(&format!("the rank of tensor {name}"))?;
            if n_dims > 4 {
                return Err(format!("tensor {name} has {n_dims} dimensions (at most 4)"));
            }
            let dims = (0..n_dims)
                .map(|_| r.u64(&format!("the dimensions of tensor {name}")))
                .collect::<Result<Vec<_>, _>>()?;
            let raw_ty = r.u32(&format!("the type of tensor {name}"))?;
            let ty = GgmlType::from_id(raw_ty)
                .ok_or_else(|| format!("tensor {name} has unknown type id {raw_ty}"))?;
            let offset = r.u64(&format!("the offset of tensor {name}"))?;
            tensors.push(TensorInfo {
                name,
                dims,
                ty,
                offset,
            });
        }
        let alignment = match metadata.get("general.alignment") {
            None => DEFAULT_ALIGNMENT,
            Some(v) => v
                .as_u64()
                .filter(|a| *a > 0)
                .ok_or("general.alignment is not a positive integer")?,
        };
        let data_start = (r.pos as u64).div_ceil(alignment) * alignment;
        let data_len = (bytes.len() as u64).saturating_sub(data_start);
        for t in &tensors {
            let size = t.ty.bytes_for(&t.dims).ok_or_else(|| {
                format!(
                    "tensor {} ({:?}, dims {:?}) is not a whole number of {}-element blocks",
                    t.name,
                    t.ty,
                    t.dims,
                    t.ty.block_elems()
                )
            })?;
            let end = t.offset.checked_add(size);
            if end.is_none_or(|end| end > data_len) {
                return Err(format!(
                    "file truncated: tensor {} needs bytes {}..{} of the data region, which has {data_len}",
                    t.name,
                    t.offset,
                    t.offset.saturating_add(size)
                ));
            }
        }
        let data_start = data_start as usize;
        Ok(GgufFile {
            version,
            metadata,
            tensors,
            bytes,
            data_start,
        })
    }

    /// The tensor named `name`.
    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensors.iter().find(|t| t.name == name)
    }

    /// The raw bytes of a tensor (bounds checked at parse time).
    pub fn tensor_bytes(&self, info: &TensorInfo) -> &[u8] {
        let start = self.data_start + info.offset as usize;
        // `parse` checked offset + size against the data region.
        let size = info.ty.bytes_for(&info.dims).unwrap_or(0) as usize;
        &self.bytes[start..start + size]
    }

    /// The tensor dequantized to f32, elements in GGUF order (row-major with
    /// `dims[0]` innermost).
    pub fn tensor_f32(&self, info: &TensorInfo) -> Vec<f32> {
        info.ty.dequantize(self.tensor_bytes(info))
    }

    /// Metadata value by key.
    pub fn get(&self, key: &str) -> Option<&Value> {
        self.metadata.get(key)
    }

    /// A string metadata value.
    pub fn get_str(&self, key: &str) -> Option<&str> {
        self.get(key).and_then(Value::as_str)
    }

    /// An unsigned integer metadata value.
    pub fn get_u64(&self, key: &str) -> Option<u64> {
        self.get(key).and_then(Value::as_u64)
    }

    /// A numeric metadata value.
    pub fn get_f64(&self, key: &str) -> Option<f64> {
        self.get(key).and_then(Value::as_f64)
    }
}

/// A cursor over the file's bytes.
struct Reader<'a> {
    bytes: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8], String> {
        let end = self
            .pos
            .checked_add(n)
            .filter(|end| *end <= self.bytes.len());
        match end {
            Some(end) => {
                let out = &self.bytes[self.pos..end];
                self.pos = end;
                Ok(out)
            }
            None => Err(format!(
                "file truncated while reading {what} (at byte {}, {} bytes long)",
                self.pos,
                self.bytes.len()
            )),
        }
    }

    fn array<const N: usize>(&mut self, what: &str) -> Result<[u8; N], String> {
        let bytes = self.take(N, what)?;
        let mut out = [0u8; N];
        out.copy_from_slice(bytes);
        Ok(out)
    }

    fn u32(&mut self, what: &str) -> Result<u32, String> {
        self.array(what).map(u32::from_le_bytes)
    }

    fn u64(&mut self, what: &str) -> Result<u64, String> {
        self.array(what).map(u64::from_le_bytes)
    }

    fn string(&mut self, what: impl Fn() -> String) -> Result<String, String> {
        let len = self.u64(&what())?;
        let len = usize::try_from(len).map_err(|_| format!("{} is too long", what()))?;
        let bytes = self.take(len, &what())?;
        String::from_utf8(bytes.to_vec()).map_err(|_| format!("{} is not UTF-8", what()))
    }

    fn value(&mut self, ty: u32, key: &str, depth: usize) -> Result<Value, String> {
        let what = || format!("metadata {key}");
        Ok(match ty {
            0 => Value::U64(u64::from(self.array::<1>(&what())?[0])),
            1 => Value::I64(i64::from(i8::from_le_bytes(self.array(&what())?))),
            2 => Value::U64(u64::from(u16::from_le_bytes(self.array(&what())?))),
            3 => Value::I64(i64::from(i16::from_le_bytes(self.array(&what())?))),
            4 => Value::U64(u64::from(self.u32(&what())?)),
            5 => Value::I64(i64::from(i32::from_le_bytes(self.array(&what())?))),
            6 => Value::F64(f64::from(f32::from_le_bytes(self.array(&what())?))),
            7 => Value::Bool(self.array::<1>(&what())?[0] != 0),
            8 => Value::Str(self.string(what)?),
            9 => {
                if depth >= MAX_DEPTH {
                    return Err(format!("metadata {key} nests arrays too deeply"));
                }
                let elem_ty = self.u32(&what())?;
                let count = self.u64(&what())?;
                // Every element takes at least one byte: a count past the
                // bytes left is a corrupt file, not an allocation to try.
                let left = (self.bytes.len() - self.pos) as u64;
                if count > left {
                    return Err(format!(
                        "file truncated while reading metadata {key} ({count} elements, {left} bytes left)"
                    ));
                }
                let mut items = Vec::with_capacity(count as usize);
                for _ in 0..count {
                    items.push(self.value(elem_ty, key, depth + 1)?);
                }
                Value::Array(items)
            }
            10 => Value::U64(self.u64(&what())?),
            11 => Value::I64(i64::from_le_bytes(self.array(&what())?)),
            12 => Value::F64(f64::from_le_bytes(self.array(&what())?)),
            other => return Err(format!("metadata {key} has unknown value type {other}")),
        })
    }
}

/// Builds GGUF files in memory, for tests (here and in the loader's).
#[cfg(test)]
pub(crate) mod write {
    use super::Value;

    /// A GGUF v3 file with `metadata` and `tensors` (name, GGUF dims, type
    /// id, raw bytes), data aligned to 32.
    pub(crate) fn gguf_bytes(
        metadata: &[(&str, Value)],
        tensors: &[(&str, Vec<u64>, u32, Vec<u8>)],
    ) -> Vec<u8> {
        let mut out = Vec::new();
        out.extend_from_slice(b"GGUF");
        out.extend_from_slice(&3u32.to_le_bytes());
        out.extend_from_slice(&(tensors.len() as u64).to_le_bytes());
        out.extend_from_slice(&(metadata.len() as u64).to_le_bytes());
        for (key, value) in metadata {
            string(&mut out, key);
            typed_value(&mut out, value);
        }
        let mut offset = 0u64;
        let mut offsets = Vec::new();
        for (name, dims, ty, data) in tensors {
            string(&mut out, name);
            out.extend_from_slice(&(dims.len() as u32).to_le_bytes());
            for d in dims {
                out.extend_from_slice(&d.to_le_bytes());
            }
            out.extend_from_slice(&ty.to_le_bytes());
            out.extend_from_slice(&offset.to_le_bytes());
            offsets.push(offset);
            offset = (offset + data.len() as u64).div_ceil(32) * 32;
        }
        out.resize(out.len().div_ceil(32) * 32, 0);
        let data_start = out.len();
        for ((_, _, _, data), off) in tensors.iter().zip(offsets) {
            out.resize(data_start + off as usize, 0);
            out.extend_from_slice(data);
        }
        out
    }

    fn string(out: &mut Vec<u8>, s: &str) {
        out.extend_from_slice(&(s.len() as u64).to_le_bytes());
        out.extend_from_slice(s.as_bytes());
    }

    fn type_id(value: &Value) -> u32 {
        match value {
            Value::U64(_) => 10,
            Value::I64(_) => 11,
            Value::F64(_) => 12,
            Value::Bool(_) => 7,
            Value::Str(_) => 8,
            Value::Array(_) => 9,
        }
    }

    fn typed_value(out: &mut Vec<u8>, value: &Value) {
        out.extend_from_slice(&type_id(value).to_le_bytes());
        untyped_value(out, value);
    }

    fn untyped_value(out: &mut Vec<u8>, value: &Value) {
        match value {
            Value::U64(v) => out.extend_from_slice(&v.to_le_bytes()),
            Value::I64(v) => out.extend_from_slice(&v.to_le_bytes()),
            Value::F64(v) => out.extend_from_slice(&v.to_le_bytes()),
            Value::Bool(b) => out.push(u8::from(*b)),
            Value::Str(s) => string(out, s),
            Value::Array(items) => {
                let elem = items.first().map_or(8, type_id);
                out.extend_from_slice(&elem.to_le_bytes());
                out.extend_from_slice(&(items.len() as u64).to_le_bytes());
                for item in items {
                    untyped_value(out, item);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::write::gguf_bytes;
    use super::*;

    fn f32_bytes(values: &[f32]) -> Vec<u8> {
        values.iter().flat_map(|v| v.to_le_bytes()).collect()
    }

    fn sample() -> Vec<u8> {
        gguf_bytes(
            &[
                ("general.architecture", Value::Str("llama".into())),
                ("llama.block_count", Value::U64(2)),
                ("llama.rope.freq_base", Value::F64(10_000.0)),
                (
                    "tokenizer.ggml.tokens",
                    Value::Array(vec![Value::Str("a".into()), Value::Str("b".into())]),
                ),
            ],
            &[
                (
                    "x",
                    vec![3, 2],
                    0,
                    f32_bytes(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]),
                ),
                ("y", vec![1], 0, f32_bytes(&[7.0])),
            ],
        )
    }

    #[test]
    fn reads_metadata_and_tensors() {
        let file = GgufFile::parse(sample()).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(file.version, 3);
        assert_eq!(file.get_str("general.architecture"), Some("llama"));
        assert_eq!(file.get_u64("llama.block_count"), Some(2));
        assert_eq!(file.get_f64("llama.rope.freq_base"), Some(10_000.0));
        let tokens = file.get("tokenizer.ggml.tokens").and_then(Value::as_array);
        assert_eq!(tokens.map(<[Value]>::len), Some(2));
        let x = file.tensor("x").unwrap_or_else(|| panic!("no x"));
        assert_eq!(x.dims, vec![3, 2]);
        assert_eq!(file.tensor_f32(x), vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
        let y = file.tensor("y").unwrap_or_else(|| panic!("no y"));
        assert_eq!(file.tensor_f32(y), vec![7.0]);
    }

    #[test]
    fn every_truncation_is_an_error_not_a_panic() {
        let bytes = sample();
        for len in 0..bytes.len() {
            let err = GgufFile::parse(bytes[..len].to_vec())
                .err()
                .unwrap_or_else(|| panic!("a file cut at {len} bytes parsed"));
            assert!(
                err.contains("truncated") || err.contains("not a GGUF file"),
                "cut at {len}: {err}"
            );
        }
    }

    #[test]
    fn unknown_tensor_type_and_bad_magic_are_named() {
        let bytes = gguf_bytes(&[], &[("w", vec![4], 99, vec![0; 16])]);
        let err = GgufFile::parse(bytes).err().unwrap_or_default();
        assert!(err.contains("tensor w has unknown type id 99"), "{err}");

        let mut bytes = sample();
        bytes[0] = b'X';
        let err = GgufFile::parse(bytes).err().unwrap_or_default();
        assert!(err.contains("not a GGUF file"), "{err}");
    }

    #[test]
    fn a_huge_array_count_is_refused_before_allocating() {
        let mut bytes = Vec::new();
        bytes.extend_from_slice(b"GGUF");
        bytes.extend_from_slice(&3u32.to_le_bytes());
        bytes.extend_from_slice(&0u64.to_le_bytes());
        bytes.extend_from_slice(&1u64.to_le_bytes());
        bytes.extend_from_slice(&1u64.to_le_bytes());
        bytes.push(b'k');
        bytes.extend_from_slice(&9u32.to_le_bytes());
        bytes.extend_from_slice(&0u32.to_le_bytes());
        bytes.extend_from_slice(&u64::MAX.to_le_bytes());
        let err = GgufFile::parse(bytes).err().unwrap_or_default();
        assert!(err.contains("metadata k"), "{err}");
    }
}
