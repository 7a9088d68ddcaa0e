//! Test helpers: where the SmolLM2 GGUF is (shared with the other crates'
//! tests), and a reader of a GGUF file's
//! metadata (just enough for the `tokenizer.*` keys; the worker's model
//! loader has the full reader).
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed unwrap fails the test
#![allow(dead_code, unreachable_pub)]

use std::collections::HashMap;
use std::io::{BufReader, Read};
use std::path::{Path, PathBuf};

use kvlease_tokenizer::GgufVocab;

/// The SmolLM2 GGUF, or `None` (a failure under `KVLEASE_REQUIRE_MODEL=1`).
pub use kvlease_tokenizer::testing::smollm2_gguf;

#[derive(Debug, Clone)]
pub enum Meta {
    Int(i64),
    Float(f64),
    Bool(bool),
    Str(String),
    Array(Vec<Meta>),
}

struct Reader<R>(R);

impl<R: Read> Reader<R> {
    fn bytes<const N: usize>(&mut self) -> [u8; N] {
        let mut b = [0; N];
        self.0.read_exact(&mut b).expect("GGUF truncated");
        b
    }
    fn u32(&mut self) -> u32 {
        u32::from_le_bytes(self.bytes())
    }
    fn u64(&mut self) -> u64 {
        u64::from_le_bytes(self.bytes())
    }
    fn string(&mut self) -> String {
        let n = self.u64() as usize;
        let mut b = vec![0; n];
        self.0.read_exact(&mut b).expect("GGUF truncated");
        String::from_utf8(b).expect("GGUF string is not UTF-8")
    }
    fn value(&mut self, ty: u32) -> Meta {
        match ty {
            0 => Meta::Int(i64::from(u8::from_le_bytes(self.bytes()))),
            1 => Meta::Int(i64::from(i8::from_le_bytes(self.bytes()))),
            2 => Meta::Int(i64::from(u16::from_le_bytes(self.bytes()))),
            3 => Meta::Int(i64::from(i16::from_le_bytes(self.bytes()))),
            4 => Meta::Int(i64::from(self.u32())),
            5 => Meta::Int(i64::from(i32::from_le_bytes(self.bytes()))),
            6 => Meta::Float(f64::from(f32::from_le_bytes(self.bytes()))),
            7 => Meta::Bool(self.bytes::<1>()[0] != 0),
            8 => Meta::Str(self.string()),
            9 => {
                let ty = self.u32();
                let n = self.u64() as usize;
                Meta::Array((0..n).map(|_| self.value(ty)).collect())
            }
            10 => Meta::Int(self.u64() as i64),
            11 => Meta::Int(i64::from_le_bytes(self.bytes())),
            12 => Meta::Float(f64::from_le_bytes(self.bytes())),
            other => panic!("unknown GGUF value type {other}"),
        }
    }
}

/// Every metadata key/value of a GGUF file.
pub fn read_metadata(path: &Path) -> HashMap<String, Meta> {
    let file = std::fs::File::open(path).expect("open GGUF");
    let mut r = Reader(BufReader::new(file));
    assert_eq!(&r.bytes::<4>(), b"GGUF", "not a GGUF file");
    let _version = r.u32();
    let _tensors = r.u64();
    let count = r.u64();
    (0..count)
        .map(|_| {
            let key = r.string();
            let ty = r.u32();
            (key, r.value(ty))
        })
        .collect()
}

/// The `tokenizer.*` metadata of a GGUF file as a [`GgufVocab`].
pub fn read_vocab(path: &Path) -> GgufVocab {
    let m = read_metadata(path);
    let s = |k: &str| match m.get(k) {
        Some(Meta::Str(s)) => Some(s.clone()),
        _ => None,
    };
    let id = |k: &str| match m.get(k) {
        Some(Meta::Int(i)) => Some(*i as u32),
        _ => None,
    };
    let flag = |k: &str| match m.get(k) {
        Some(Meta::Bool(b)) => Some(*b),
        _ => None,
    };
    let array = |k: &str| match m.get(k) {
        Some(Meta::Array(a)) => a.clone(),
        _ => Vec::new(),
    };
    let strings = |k: &str| {
        array(k)
            .into_iter()
            .map(|v| match v {
                Meta::Str(s) => s,
                other => panic!("{k}: {other:?} is not a string"),
            })
            .collect()
    };
    GgufVocab {
        model: s("tokenizer.ggml.model").unwrap_or_default(),
        pre: s("tokenizer.ggml.pre"),
        tokens: strings("tokenizer.ggml.tokens"),
        token_types: array("tokenizer.ggml.token_type")
            .into_iter()
            .map(|v| match v {
                Meta::Int(i) => i as i32,
                other => panic!("token type {other:?}"),
            })
            .collect(),
        scores: array("tokenizer.ggml.scores")
            .into_iter()
            .map(|v| match v {
                Meta::Float(f) => f as f32,
                other => panic!("score {other:?}"),
            })
            .collect(),
        merges: strings("tokenizer.ggml.merges"),
        bos_id: id("tokenizer.ggml.bos_token_id"),
        eos_id: id("tokenizer.ggml.eos_token_id"),
        eot_id: id("tokenizer.ggml.eot_token_id"),
        eom_id: id("tokenizer.ggml.eom_token_id"),
        unknown_id: id("tokenizer.ggml.unknown_token_id"),
        padding_id: id("tokenizer.ggml.padding_token_id"),
        add_bos: flag("tokenizer.ggml.add_bos_token"),
        add_eos: flag("tokenizer.ggml.add_eos_token"),
        add_space_prefix: flag("tokenizer.ggml.add_space_prefix"),
        chat_template: s("tokenizer.chat_template"),
    }
}

/// A fresh empty directory under the system's temp dir.
pub fn temp_dir(name: &str) -> PathBuf {
    use std::sync::atomic::{AtomicU32, Ordering};
    static N: AtomicU32 = AtomicU32::new(0);
    let dir = std::env::temp_dir().join(format!(
        "kvlease-tokenizer-{name}-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    ));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("create temp dir");
    dir
}
