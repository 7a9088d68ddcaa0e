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

use serde_json::{Value, json};

use crate::error::{Error, Result};
use crate::{Specials, hf};

/// The end-of-generation tokens llama.cpp recognises by their text when a
/// vocabulary marks them as control tokens (`llama-vocab.cpp`).
const END_TOKEN_TEXTS: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "<|end_of_text|>",
    "<end_of_utterance>",
];

/// The pre-tokenizer of Llama 3 (`llama-bpe`) and the vocabularies that
/// copied it.
const LLAMA3_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// Qwen 2's pre-tokenizer: Llama 3's, with digits one by one.
const QWEN2_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

impl GgufVocab {
    /// The `tokenizer.json` this vocabulary describes, and its special ids.
    pub(crate) fn to_hf(&self) -> Result<(Value, Specials)> {
        let n = self.tokens.len();
        if n == 0 {
            return Err(Error::Invalid("tokenizer.ggml.tokens is empty".into()));
        }
        for (key, len) in [
            ("tokenizer.ggml.token_type", self.token_types.len()),
            ("tokenizer.ggml.scores", self.scores.len()),
        ] {
            if len != 0 && len != n {
                return Err(Error::Invalid(format!(
                    "{key} has {len} entries for {n} tokens"
                )));
            }
        }
        for (key, id) in [
            ("bos_token_id", self.bos_id),
            ("eos_token_id", self.eos_id),
            ("eot_token_id", self.eot_id),
            ("eom_token_id", self.eom_id),
            ("unknown_token_id", self.unknown_id),
            ("padding_token_id", self.padding_id),
        ] {
            if let Some(id) = id
                && id as usize >= n
            {
                return Err(Error::Invalid(format!(
                    "tokenizer.ggml.{key} {id} is outside the vocabulary of {n} tokens"
                )));
            }
        }
        let (tokenizer, add_bos) = match self.model.as_str() {
            "gpt2" => (self.byte_level_bpe()?, self.add_bos.unwrap_or(false)),
            "llama" => (self.sentencepiece_bpe()?, self.add_bos.unwrap_or(true)),
            other => {
                return Err(Error::Invalid(format!(
                    "tokenizer.ggml.model {other:?} is not supported (supported: \"gpt2\", \"llama\")"
                )));
            }
        };
        let mut end_ids: Vec<u32> = [self.eos_id, self.eot_id, self.eom_id]
            .into_iter()
            .flatten()
            .collect();
        for (id, token) in self.tokens.iter().enumerate() {
            if self.type_of(id) == token_type::CONTROL && END_TOKEN_TEXTS.contains(&token.as_str())
            {
                end_ids.push(id as u32);
            }
        }
        let token_text = |id: Option<u32>| id.map(|i| self.tokens[i as usize].clone());
        let specials = Specials::new(
            self.bos_id,
            token_text(self.bos_id),
            token_text(self.eos_id),
            end_ids,
            add_bos,
        );
        Ok((tokenizer, specials))
    }

    fn type_of(&self, id: usize) -> i32 {
        self.token_types
            .get(id)
            .copied()
            .unwrap_or(token_type::NORMAL)
    }

    /// `"left right"` merges as pairs, or (for a SentencePiece vocabulary
    /// without merges) the merges its scores imply.
    fn merge_pairs(&self) -> Result<Vec<(String, String)>> {
        if self.merges.is_empty() && self.model == "llama" {
            return Ok(merges_from_scores(&self.tokens, &self.scores));
        }
        self.merges
            .iter()
            .enumerate()
            .map(|(i, m)| match m.split_once(' ') {
                Some((l, r)) if !l.is_empty() && !r.is_empty() && !r.contains(' ') => {
                    Ok((l.to_string(), r.to_string()))
                }
                _ => Err(Error::Invalid(format!(
                    "tokenizer.ggml.merges[{i}] {m:?} is not two tokens separated by one space"
                ))),
            })
            .collect()
    }

    /// Added tokens: control tokens special, user-defined ones plain. A
    /// byte-level vocabulary spells every real token in the byte alphabet;
    /// a control token that does not is a mislabel and is left out (as
    /// transformers' GGUF converter does).
    fn added_tokens(&self, byte_level: bool) -> Vec<Value> {
        let alphabet = byte_alphabet();
        self.tokens
            .iter()
            .enumerate()
            .filter_map(|(id, token)| {
                let special = match self.type_of(id) {
                    token_type::CONTROL => true,
                    token_type::USER_DEFINED => false,
                    _ => return None,
                };
                if special && byte_level && !token.chars().all(|c| alphabet.contains(&c)) {
                    return None;
                }
                Some(json!({
                    "id": id, "content": token, "single_word": false, "lstrip": false,
                    "rstrip": false, "normalized": false, "special": special,
                }))
            })
            .collect()
    }

    /// Byte-level BPE (GPT-2 style) with the pre-tokenizer `pre` names.
    fn byte_level_bpe(&self) -> Result<Value> {
        let alphabet = byte_alphabet();
        let mut vocab = serde_json::Map::new();
        for (id, token) in self.tokens.iter().enumerate() {
            // a token outside the byte alphabet is respelled in it, as
            // transformers' converter does
            let spelled = if token.chars().all(|c| alphabet.contains(&c)) {
                token.clone()
            } else {
                token.bytes().map(|b| alphabet[b as usize]).collect()
            };
            vocab.insert(spelled, json!(id));
        }
        let byte_level = |use_regex: bool| json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": use_regex});
        let split = |regex: &str| {
            json!({"type": "Sequence", "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": false},
                byte_level(false),
            ]})
        };
        let pre = self.pre.as_deref().unwrap_or("default");
        let (pre_tokenizer, ignore_merges) = match pre {
            "default" | "gpt2" | "gpt-2" => (byte_level(true), false),
            // llama.cpp splits digits one by one first (`\p{N}`), then as GPT-2
            "smollm" | "starcoder" | "refact" => (
                json!({"type": "Sequence", "pretokenizers": [
                    {"type": "Digits", "individual_digits": true}, byte_level(true),
                ]}),
                false,
            ),
            // Llama 3 looks whole words up in the vocabulary before merging
            "llama-bpe" | "llama3" | "llama-v3" | "smaug-bpe" | "dbrx" | "falcon3" => {
                (split(LLAMA3_SPLIT), true)
            }
            "qwen2" | "deepseek-r1-qwen" => (split(QWEN2_SPLIT), false),
            other => {
                return Err(Error::Invalid(format!(
                    "tokenizer.ggml.pre {other:?} is not supported (supported: default, gpt2, smollm, starcoder, refact, llama-bpe, llama3, smaug-bpe, dbrx, falcon3, qwen2)"
                )));
            }
        };
        Ok(json!({
            "version": "1.0",
            "truncation": null,
            "padding": null,
            "added_tokens": self.added_tokens(true),
            "normalizer": null,
            "pre_tokenizer": pre_tokenizer,
            "post_processor": null,
            "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
            "model": hf::bpe_model(vocab, &self.merge_pairs()?, None, false, ignore_merges),
        }))
    }

    /// SentencePiece-style BPE with byte fallback (Llama 1/2, Mistral), as
    /// transformers' `LlamaTokenizer` builds it.
    fn sentencepiece_bpe(&self) -> Result<Value> {
        let mut vocab = serde_json::Map::new();
        for (id, token) in self.tokens.iter().enumerate() {
            vocab.insert(token.clone(), json!(id));
        }
        let unk = self
            .unknown_id
            .map(|id| self.tokens[id as usize].clone())
            .or_else(|| vocab.contains_key("<unk>").then(|| "<unk>".to_string()));
        let prefix = self.add_space_prefix.unwrap_or(true);
        let mut decoders = vec![
            json!({"type": "Replace", "pattern": {"String": "\u{2581}"}, "content": " "}),
            json!({"type": "ByteFallback"}),
            json!({"type": "Fuse"}),
        ];
        if prefix {
            decoders.push(json!({"type": "Strip", "content": " ", "start": 1, "stop": 0}));
        }
        Ok(json!({
            "version": "1.0",
            "truncation": null,
            "padding": null,
            "added_tokens": self.added_tokens(false),
            "normalizer": null,
            "pre_tokenizer": {
                "type": "Metaspace", "replacement": "\u{2581}",
                "prepend_scheme": if prefix { "first" } else { "never" }, "split": false,
            },
            "post_processor": null,
            "decoder": {"type": "Sequence", "decoders": decoders},
            "model": hf::bpe_model(vocab, &self.merge_pairs()?, unk, true, false),
        }))
    }
}

/// GPT-2's printable spelling of each byte (`bytes_to_unicode`).
pub(crate) fn byte_alphabet() -> [char; 256] {
    let mut out = ['\0'; 256];
    let mut extra = 0u32;
    for (b, slot) in out.iter_mut().enumerate() {
        let printable = matches!(b, 0x21..=0x7E | 0xA1..=0xAC | 0xAE..=0xFF);
        let code = if printable {
            b as u32
        } else {
            extra += 1;
            255 + extra
        };
        *slot = char::from_u32(code).unwrap_or('\u{FFFD}');
    }
    out
}

/// Merges implied by a SentencePiece vocabulary: every split of a token into
/// two tokens, best merged score first (transformers' `generate_merges`).
fn merges_from_scores(tokens: &[String], scores: &[f32]) -> Vec<(String, String)> {
    let ids: std::collections::HashMap<&str, usize> = tokens
        .iter()
        .enumerate()
        .map(|(i, t)| (t.as_str(), i))
        .collect();
    let mut merges: Vec<(String, String, f32)> = Vec::new();
    let mut seen = std::collections::HashSet::new();
    for token in tokens {
        // a duplicate token keeps its first place and its last score (as
        // a Python dict built from the list)
        if !seen.insert(token.as_str()) {
            continue;
        }
        let score = scores.get(ids[token.as_str()]).copied().unwrap_or(0.0);
        let mut local: Vec<(&str, &str)> = token
            .char_indices()
            .skip(1)
            .map(|(at, _)| token.split_at(at))
            .filter(|(l, r)| ids.contains_key(l) && ids.contains_key(r))
            .collect();
        local.sort_by_key(|(l, r)| (ids[l], ids[r]));
        merges.extend(
            local
                .into_iter()
                .map(|(l, r)| (l.to_string(), r.to_string(), score)),
        );
    }
    merges.sort_by(|a, b| {
        let key = |m: &(String, String, f32)| (m.0.chars().count(), m.1.chars().count());
        b.2.total_cmp(&a.2).then_with(|| key(b).cmp(&key(a)))
    });
    merges.into_iter().map(|(l, r, _)| (l, r)).collect()
}
