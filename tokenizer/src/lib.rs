//! kvlease-tokenizer: the model's own tokenizer, shared by the worker (which
//! loads it with the model) and the scheduler (which gets it from the worker
//! over gRPC as [`TokenizerParts`], so both use one source of truth).
//!
//! # Layout
//!
//! - `gguf.rs`: [`GgufVocab`], the `tokenizer.*` metadata of a GGUF file,
//!   and the `tokenizer.json` it describes (byte-level BPE or
//!   SentencePiece-style BPE).
//! - `hf.rs`: a Hugging Face directory's `tokenizer.json`,
//!   `tokenizer_config.json` (special tokens, chat template) and
//!   end-of-sequence ids.
//! - `byte_level.rs`: the seeded model's byte-level tokenizer.
//! - `pieces.rs`: the bytes of one token ([`Tokenizer::token_bytes`]), for
//!   logprobs answers.
//! - `stream.rs`: [`StreamDecoder`] (text as tokens arrive, only complete
//!   characters) and [`StopStrings`].
//! - `chat.rs`: chat templates rendered with `minijinja`.
//! - [`grammar`]: structured output; a constraint (JSON object, JSON schema,
//!   Lark grammar, regex) compiled by `llguidance` against this vocabulary
//!   into a matcher that gives each step's token mask
//!   ([`Tokenizer::grammars`], built once per tokenizer).
//! - `testing.rs` (feature `testing`, tests only): where the SmolLM2 GGUF of
//!   the real-model tests is, and `KVLEASE_REQUIRE_MODEL`.
//!
//! Data flow: the worker builds a [`Tokenizer`] from its model file, reports
//! its [`Tokenizer::fingerprint`] in `Describe` and hands its
//! [`Tokenizer::parts`] to the scheduler, which rebuilds the same tokenizer
//! with [`Tokenizer::from_parts`] to encode prompts, render chats and decode
//! the output stream.

#![forbid(unsafe_code)]

pub mod byte_level;
mod chat;
mod error;
pub mod gguf;
pub mod grammar;
mod hf;
mod pieces;
mod stream;
#[cfg(feature = "testing")]
pub mod testing;

use std::path::Path;
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

pub use chat::Message;
pub use error::{Error, Result};
pub use gguf::GgufVocab;
pub use stream::{StopStrings, StreamDecoder};

/// The largest tokenizer message (a `tokenizer.json` with its chat template)
/// the services send and accept: tonic's default cap of 4 MiB is below the
/// size of large vocabularies' files (Llama 3's is 9 MB).
pub const MAX_MESSAGE_BYTES: usize = 64 << 20;

/// Which tokenizer [`TokenizerParts::tokenizer_json`] describes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum TokenizerKind {
    /// The seeded model's: ids 0 to 255 are the bytes themselves, 256 is
    /// BOS and 257 EOS (no JSON).
    ByteLevel,
    /// A Hugging Face `tokenizer.json`.
    HuggingFace,
}

impl TokenizerKind {
    /// The name on the wire: `"byte-level"` or `"hf"`.
    pub fn as_str(self) -> &'static str {
        match self {
            TokenizerKind::ByteLevel => "byte-level",
            TokenizerKind::HuggingFace => "hf",
        }
    }

    /// The kind named `name` (see [`TokenizerKind::as_str`]).
    pub fn parse(name: &str) -> Option<Self> {
        match name {
            "byte-level" => Some(TokenizerKind::ByteLevel),
            "hf" => Some(TokenizerKind::HuggingFace),
            _ => None,
        }
    }
}

/// The special tokens a model declares.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Specials {
    /// Beginning of sequence.
    pub bos_id: Option<u32>,
    /// The text of BOS and EOS, for chat templates.
    pub bos_token: Option<String>,
    pub eos_token: Option<String>,
    /// Every id that ends a generation (eos, eot, `<|im_end|>`, ...),
    /// ascending, without repeats.
    pub end_ids: Vec<u32>,
    /// Whether a text prompt starts with BOS.
    pub add_bos: bool,
}

impl Specials {
    /// Specials with `end_ids` sorted and deduplicated.
    pub fn new(
        bos_id: Option<u32>,
        bos_token: Option<String>,
        eos_token: Option<String>,
        mut end_ids: Vec<u32>,
        add_bos: bool,
    ) -> Self {
        end_ids.sort_unstable();
        end_ids.dedup();
        Specials {
            bos_id,
            bos_token,
            eos_token,
            end_ids,
            add_bos,
        }
    }
}

/// A tokenizer as plain data: what the worker sends the scheduler.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TokenizerParts {
    pub kind: TokenizerKind,
    /// The `tokenizer.json` (as the `tokenizers` crate writes it, so equal
    /// tokenizers give equal text); empty for [`TokenizerKind::ByteLevel`].
    pub tokenizer_json: String,
    /// The Jinja chat template, if the model has one.
    pub chat_template: Option<String>,
    pub specials: Specials,
}

/// The model's tokenizer. Cheap to clone (shared).
#[derive(Clone)]
pub struct Tokenizer(Arc<Shared>);

struct Shared {
    parts: TokenizerParts,
    hf: Option<tokenizers::Tokenizer>,
    chat: Option<chat::ChatTemplate>,
    fingerprint: String,
    vocab_size: u32,
    /// Whether each id is a byte-fallback token (`<0x41>`); empty when the
    /// tokenizer has none.
    byte_tokens: Vec<bool>,
    /// Special tokens (left out of decoded text).
    special_tokens: Vec<bool>,
    /// The compiler of structured-output constraints, built on first use
    /// (the vocabulary's trie costs tens of milliseconds for 50k tokens).
    grammars: std::sync::OnceLock<std::result::Result<grammar::Grammars, String>>,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("kind", &self.0.parts.kind)
            .field("vocab_size", &self.0.vocab_size)
            .field("specials", &self.0.parts.specials)
            .field("fingerprint", &self.0.fingerprint)
            .finish_non_exhaustive()
    }
}

impl Tokenizer {
    /// The seeded model's byte-level tokenizer.
    // Its parts are constants with no tokenizer.json, no template and ids
    // inside the vocabulary, so `build` cannot fail on them (a unit test
    // builds it); no request or peer input reaches this.
    #[allow(clippy::expect_used)]
    pub fn byte_level() -> Self {
        Self::build(TokenizerParts {
            kind: TokenizerKind::ByteLevel,
            tokenizer_json: String::new(),
            chat_template: None,
            specials: byte_level::specials(),
        })
        .expect("the byte-level tokenizer has no parts that can fail")
    }

    /// The tokenizer of a Hugging Face model directory (`tokenizer.json`,
    /// and `tokenizer_config.json` when present).
    pub fn from_hf_dir(dir: &Path) -> Result<Self> {
        let files = hf::HfFiles::read(dir)?;
        let path = dir.join("tokenizer.json").display().to_string();
        let tokenizer = load_json(&files.tokenizer_json).map_err(|e| Error::Read {
            path,
            message: e.to_string(),
        })?;
        Self::build(TokenizerParts {
            kind: TokenizerKind::HuggingFace,
            tokenizer_json: to_json(&tokenizer)?,
            chat_template: files.chat_template(),
            specials: files.specials(&tokenizer),
        })
    }

    /// The tokenizer a GGUF file's `tokenizer.*` metadata describes.
    pub fn from_gguf(vocab: &GgufVocab) -> Result<Self> {
        let (json, specials) = vocab.to_hf()?;
        let tokenizer = load_json(&json.to_string())?;
        Self::build(TokenizerParts {
            kind: TokenizerKind::HuggingFace,
            tokenizer_json: to_json(&tokenizer)?,
            chat_template: vocab.chat_template.clone(),
            specials,
        })
    }

    /// The tokenizer `parts` describe (as [`Tokenizer::parts`] gave them).
    pub fn from_parts(parts: TokenizerParts) -> Result<Self> {
        Self::build(parts)
    }

    fn build(parts: TokenizerParts) -> Result<Self> {
        let hf = match parts.kind {
            TokenizerKind::ByteLevel if !parts.tokenizer_json.is_empty() => {
                return Err(Error::Invalid(
                    "a byte-level tokenizer has no tokenizer.json".into(),
                ));
            }
            TokenizerKind::ByteLevel => None,
            TokenizerKind::HuggingFace => Some(load_json(&parts.tokenizer_json)?),
        };
        let vocab_size = match &hf {
            Some(t) => t.get_vocab_size(true) as u32,
            None => byte_level::VOCAB_SIZE,
        };
        let s = &parts.specials;
        if let Some(id) = s
            .bos_id
            .iter()
            .chain(&s.end_ids)
            .find(|&&id| id >= vocab_size)
        {
            return Err(Error::Invalid(format!(
                "special token id {id} is outside the vocabulary of {vocab_size}"
            )));
        }
        let chat = parts
            .chat_template
            .as_deref()
            .map(|source| chat::ChatTemplate::new(source, s))
            .transpose()?;
        let fingerprint = fingerprint(&parts)?;
        let byte_tokens = hf
            .as_ref()
            .map(|t| byte_fallback_tokens(t, &parts.tokenizer_json, vocab_size))
            .unwrap_or_default();
        let mut special_tokens = Vec::new();
        if let Some(t) = &hf {
            special_tokens = vec![false; vocab_size as usize];
            for (id, token) in t.get_added_tokens_decoder() {
                if let Some(slot) = special_tokens.get_mut(id as usize) {
                    *slot = token.special;
                }
            }
        }
        Ok(Tokenizer(Arc::new(Shared {
            parts,
            hf,
            chat,
            fingerprint,
            vocab_size,
            byte_tokens,
            special_tokens,
            grammars: std::sync::OnceLock::new(),
        })))
    }

    /// The plain data this tokenizer is built from.
    pub fn parts(&self) -> &TokenizerParts {
        &self.0.parts
    }

    /// A digest of [`Tokenizer::parts`] (tokenizer, chat template and
    /// special tokens): two tokenizers with the same fingerprint encode,
    /// decode and render chats the same way.
    pub fn fingerprint(&self) -> &str {
        &self.0.fingerprint
    }

    /// Token ids are below this.
    pub fn vocab_size(&self) -> u32 {
        self.0.vocab_size
    }

    pub fn specials(&self) -> &Specials {
        &self.0.parts.specials
    }

    /// Every id that ends a generation.
    pub fn end_ids(&self) -> &[u32] {
        &self.0.parts.specials.end_ids
    }

    /// Whether the model has a chat template.
    pub fn has_chat_template(&self) -> bool {
        self.0.chat.is_some()
    }

    /// A text prompt's ids: BOS first when the model wants it; special
    /// tokens written in the text (`<|im_start|>`) are matched whole.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        self.encode_with(text, self.0.parts.specials.add_bos)
    }

    /// `text`'s ids with BOS first only when `add_bos` (and the model has one).
    pub fn encode_with(&self, text: &str, add_bos: bool) -> Result<Vec<u32>> {
        let mut ids = Vec::with_capacity(text.len() / 3 + 2);
        if add_bos && let Some(bos) = self.0.parts.specials.bos_id {
            ids.push(bos);
        }
        match &self.0.hf {
            None => ids.extend(byte_level::bytes(text)),
            Some(t) => ids.extend_from_slice(
                t.encode(text, false)
                    .map_err(|e| Error::Tokenizer(e.to_string()))?
                    .get_ids(),
            ),
        }
        Ok(ids)
    }

    /// The text of `ids` at once, without special tokens (ids outside the
    /// vocabulary are dropped; invalid UTF-8 becomes U+FFFD).
    pub fn decode(&self, ids: &[u32]) -> String {
        match &self.0.hf {
            None => byte_level::decode(ids),
            // decoding fails only inside a custom decoder, which a
            // tokenizer.json cannot name
            Some(t) => t.decode(ids, true).unwrap_or_default(),
        }
    }

    /// The bytes token `id` stands for on its own (a piece of a character
    /// split across tokens stays that piece; a special token is its own
    /// text; the byte-level tokenizer's BOS and EOS are `<s>` and `</s>`);
    /// empty for an id outside the vocabulary.
    pub fn token_bytes(&self, id: u32) -> Vec<u8> {
        let Some(hf) = &self.0.hf else {
            return match id {
                byte_level::BOS => b"<s>".to_vec(),
                byte_level::EOS => b"</s>".to_vec(),
                _ => u8::try_from(id).map_or_else(|_| Vec::new(), |b| vec![b]),
            };
        };
        match hf.id_to_token(id) {
            Some(piece) => pieces::piece_bytes(
                &piece,
                hf.get_decoder(),
                self.is_byte_token(id),
                self.is_special(id),
            ),
            None => Vec::new(),
        }
    }

    /// Whether `id` is a byte-fallback token (`<0x41>`).
    pub fn is_byte_token(&self, id: u32) -> bool {
        self.0
            .byte_tokens
            .get(id as usize)
            .copied()
            .unwrap_or(false)
    }

    /// Whether `id` is a special token of a Hugging Face tokenizer (left out
    /// of decoded text).
    pub fn is_special(&self, id: u32) -> bool {
        self.0
            .special_tokens
            .get(id as usize)
            .copied()
            .unwrap_or(false)
    }

    /// The compiler of structured-output constraints over this vocabulary;
    /// an error when the vocabulary cannot carry one (no end id, a
    /// tokenizer.json llguidance cannot read).
    pub fn grammars(&self) -> std::result::Result<&grammar::Grammars, String> {
        self.0
            .grammars
            .get_or_init(|| grammar::Grammars::new(self))
            .as_ref()
            .map_err(Clone::clone)
    }

    /// A decoder of an output stream.
    pub fn stream(&self) -> StreamDecoder {
        StreamDecoder::new(self.clone())
    }

    /// `messages` rendered with the model's chat template, the generation
    /// prompt added.
    pub fn render_chat(&self, messages: &[Message]) -> Result<String> {
        self.0
            .chat
            .as_ref()
            .ok_or(Error::NoChatTemplate)?
            .render(messages)
    }

    /// The ids of a chat: its rendered text, encoded without an extra BOS
    /// (the template writes the specials it wants).
    pub fn encode_chat(&self, messages: &[Message]) -> Result<Vec<u32>> {
        self.encode_with(&self.render_chat(messages)?, false)
    }
}

fn load_json(json: &str) -> Result<tokenizers::Tokenizer> {
    json.parse::<tokenizers::Tokenizer>()
        .map_err(|e| Error::Invalid(format!("not a usable tokenizer.json: {e}")))
}

/// Which ids are `<0xNN>` byte tokens, when the model falls back to bytes.
fn byte_fallback_tokens(t: &tokenizers::Tokenizer, json: &str, vocab_size: u32) -> Vec<bool> {
    #[derive(Deserialize)]
    struct Model {
        #[serde(default)]
        byte_fallback: bool,
    }
    #[derive(Deserialize)]
    struct File {
        model: Model,
    }
    if !serde_json::from_str::<File>(json).is_ok_and(|f| f.model.byte_fallback) {
        return Vec::new();
    }
    let mut out = vec![false; vocab_size as usize];
    for (token, id) in t.get_vocab(false) {
        let is_byte = token.len() == 6
            && token.starts_with("<0x")
            && token.ends_with('>')
            && u8::from_str_radix(&token[3..5], 16).is_ok();
        if let Some(slot) = out.get_mut(id as usize) {
            *slot = is_byte;
        }
    }
    out
}

fn to_json(tokenizer: &tokenizers::Tokenizer) -> Result<String> {
    tokenizer
        .to_string(false)
        .map_err(|e| Error::Tokenizer(e.to_string()))
}

/// The first 16 hex digits of the SHA-256 of the parts' JSON.
fn fingerprint(parts: &TokenizerParts) -> Result<String> {
    let bytes = serde_json::to_vec(parts).map_err(|e| Error::Tokenizer(e.to_string()))?;
    let digest = Sha256::digest(&bytes);
    Ok(digest[..8].iter().map(|b| format!("{b:02x}")).collect())
}
