//! The tokenizer a GGUF file describes in its `tokenizer.*` metadata.
//!
//! [`GgufVocab`] is the plain input: whoever reads the GGUF header (the
//! worker's model loader) copies the metadata values into it, one field per
//! key, and [`crate::Tokenizer::from_gguf`] builds the same tokenizer the
//! model's `tokenizer.json` describes.

/// `tokenizer.ggml.token_type` values (llama.cpp's `llama_token_type`).
pub mod token_type {
    /// An ordinary token.
    pub const NORMAL: i32 = 1;
    /// The unknown token.
    pub const UNKNOWN: i32 = 2;
    /// A control token (`<|im_start|>`, `<s>`): matched whole, hidden when decoding.
    pub const CONTROL: i32 = 3;
    /// A user-defined added token (`<think>`): matched whole, shown when decoding.
    pub const USER_DEFINED: i32 = 4;
    /// Not used by the model.
    pub const UNUSED: i32 = 5;
    /// A byte token (`<0x0A>`) of a SentencePiece vocabulary with byte fallback.
    pub const BYTE: i32 = 6;
}

/// The `tokenizer.*` metadata of a GGUF file, as plain values. Optional keys
/// the file does not have are `None` (or empty vectors).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct GgufVocab {
    /// `tokenizer.ggml.model`: `"gpt2"` (byte-level BPE) or `"llama"`
    /// (SentencePiece-style BPE with byte fallback).
    pub model: String,
    /// `tokenizer.ggml.pre`: how text is split before BPE (`"smollm"`,
    /// `"llama-bpe"`, `"default"`, ...).
    pub pre: Option<String>,
    /// `tokenizer.ggml.tokens`: the vocabulary, indexed by token id.
    pub tokens: Vec<String>,
    /// `tokenizer.ggml.token_type`: one of [`token_type`] per token; empty
    /// when absent (every token normal).
    pub token_types: Vec<i32>,
    /// `tokenizer.ggml.scores`: one per token; empty when absent. For a
    /// `llama` vocabulary without merges they give the merge order.
    pub scores: Vec<f32>,
    /// `tokenizer.ggml.merges`: `"left right"` pairs, best first; empty when
    /// absent.
    pub merges: Vec<String>,
    /// `tokenizer.ggml.bos_token_id`.
    pub bos_id: Option<u32>,
    /// `tokenizer.ggml.eos_token_id`.
    pub eos_id: Option<u32>,
    /// `tokenizer.ggml.eot_token_id` (end of turn).
    pub eot_id: Option<u32>,
    /// `tokenizer.ggml.eom_token_id` (end of message).
    pub eom_id: Option<u32>,
    /// `tokenizer.ggml.unknown_token_id`.
    pub unknown_id: Option<u32>,
    /// `tokenizer.ggml.padding_token_id`.
    pub padding_id: Option<u32>,
    /// `tokenizer.ggml.add_bos_token`; absent means "yes" for a `llama`
    /// vocabulary and "no" for `gpt2` (as llama.cpp reads it).
    pub add_bos: Option<bool>,
    /// `tokenizer.ggml.add_eos_token`.
    pub add_eos: Option<bool>,
    /// `tokenizer.ggml.add_space_prefix`; absent means "yes" for `llama`.
    pub add_space_prefix: Option<bool>,
    /// `tokenizer.chat_template`: the model's Jinja chat template.
    pub chat_template: Option<String>,
}
