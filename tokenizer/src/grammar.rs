//! Structured output: a [`Constraint`] (any JSON object, a JSON schema, a
//! Lark grammar or a regex) compiled by `llguidance` against the model's
//! vocabulary into a [`Matcher`], which gives the token mask of each step.
//!
//! One [`Grammars`] per tokenizer (built on first use by
//! [`crate::Tokenizer::grammars`]: the vocabulary's trie and llguidance's
//! lexer slices) compiles every request's constraint. The scheduler compiles
//! once to refuse a bad one (INVALID_ARGUMENT / HTTP 400 naming the field
//! and llguidance's message); the worker compiles again and keeps the
//! matcher per sequence, advancing it with every output token and asking it
//! for the mask of the next one.
//!
//! The mask is one bit per model token (`words[t / 32] >> (t % 32) & 1`),
//! the layout the CUDA `mask_logits` kernel reads. Once the grammar is
//! complete only the model's end ids are allowed, so the sequence ends
//! `STOP` on its next token; an end id run by a pipelined pass after that
//! (the pass sent before the end came back) leaves the matcher as it is.

use std::sync::Arc;

use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{ApproximateTokEnv, TokEnv, TokRxInfo, TokTrie};
use llguidance::{ParserFactory, token_bytes_from_tokenizer_json};

use crate::{Tokenizer, TokenizerKind, byte_level};

/// What the output must follow.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Constraint {
    /// Any JSON object (OpenAI's `response_format` `json_object`).
    JsonObject,
    /// A JSON schema, as JSON text.
    JsonSchema(String),
    /// A grammar in llguidance's Lark dialect.
    Lark(String),
    /// A regular expression the whole output matches.
    Regex(String),
}

impl Constraint {
    /// The name of its kind, as the request fields say it: `json_object`,
    /// `json_schema`, `lark` or `regex`.
    pub fn kind(&self) -> &'static str {
        match self {
            Constraint::JsonObject => "json_object",
            Constraint::JsonSchema(_) => "json_schema",
            Constraint::Lark(_) => "lark",
            Constraint::Regex(_) => "regex",
        }
    }

    fn top_level(&self) -> Result<TopLevelGrammar, String> {
        Ok(match self {
            Constraint::JsonObject => {
                TopLevelGrammar::from_json_schema(compact(serde_json::json!({ "type": "object" })))
            }
            Constraint::JsonSchema(text) => {
                let schema: serde_json::Value = serde_json::from_str(text)
                    .map_err(|e| format!("the schema is not JSON: {e}"))?;
                if !(schema.is_object() || schema.is_boolean()) {
                    return Err("a JSON schema is an object or a boolean".into());
                }
                TopLevelGrammar::from_json_schema(compact(schema))
            }
            Constraint::Lark(text) => TopLevelGrammar::from_lark(text.clone()),
            Constraint::Regex(rx) => TopLevelGrammar::from_regex(rx),
        })
    }
}

/// A schema without its own `x-guidance` options gets compact JSON: no
/// whitespace between tokens, so the output is short and a sampled run
/// cannot pad it with spaces forever.
fn compact(mut schema: serde_json::Value) -> serde_json::Value {
    if let Some(map) = schema.as_object_mut()
        && !map.contains_key("x-guidance")
    {
        map.insert(
            "x-guidance".into(),
            serde_json::json!({ "whitespace_flexible": false }),
        );
    }
    schema
}

/// Longest engine message a refusal carries (a schema's error can quote a
/// large part of it).
pub const MAX_MESSAGE_CHARS: usize = 400;

/// Why a constraint was refused: the kind (the request field it came in)
/// and llguidance's message, truncated to [`MAX_MESSAGE_CHARS`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid {kind}: {message}")]
pub struct GrammarError {
    /// [`Constraint::kind`].
    pub kind: &'static str,
    pub message: String,
}

impl GrammarError {
    fn new(kind: &'static str, message: impl std::fmt::Display) -> Self {
        let message = message.to_string();
        let mut short: String = message.chars().take(MAX_MESSAGE_CHARS).collect();
        if short.len() < message.len() {
            short.push_str("...");
        }
        GrammarError {
            kind,
            message: short,
        }
    }
}

/// The compiler of one tokenizer's constraints.
pub struct Grammars {
    factory: ParserFactory,
    /// Token ids of the tokenizer are below this.
    vocab: usize,
}

impl std::fmt::Debug for Grammars {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Grammars")
            .field("vocab", &self.vocab)
            .finish_non_exhaustive()
    }
}

impl Grammars {
    /// The compiler for `tokenizer`'s vocabulary, its end ids the tokens
    /// that end a complete output.
    pub(crate) fn new(tokenizer: &Tokenizer) -> Result<Self, String> {
        let words = token_bytes(tokenizer)?;
        let vocab = words.len();
        let end_ids = tokenizer.end_ids();
        let Some(&eos) = end_ids.first() else {
            return Err("the model declares no end-of-sequence token to end a grammar".into());
        };
        let info = TokRxInfo::new(vocab as u32, eos);
        let mut trie = TokTrie::from(&info, &words);
        if end_ids.len() > 1 {
            trie = trie.with_eos_tokens(end_ids);
        }
        let env: TokEnv = Arc::new(ApproximateTokEnv::new(trie));
        let mut factory = ParserFactory::new_simple(&env).map_err(|e| e.to_string())?;
        factory.quiet();
        Ok(Grammars { factory, vocab })
    }

    /// A matcher at the start of `constraint`'s output, or why the
    /// constraint cannot be compiled.
    pub fn compile(&self, constraint: &Constraint) -> Result<Matcher, GrammarError> {
        let kind = constraint.kind();
        let grammar = constraint
            .top_level()
            .map_err(|m| GrammarError::new(kind, m))?;
        let parser = self
            .factory
            .create_parser(grammar)
            .map_err(|e| GrammarError::new(kind, e))?;
        let inner = llguidance::Matcher::new(Ok(parser));
        if let Some(e) = inner.get_error() {
            return Err(GrammarError::new(kind, e));
        }
        Ok(Matcher {
            inner,
            ended: false,
            vocab: self.vocab,
        })
    }
}

/// The bytes of every token of `tokenizer`, specials marked as toktrie
/// wants them (`0xFF` then the name).
fn token_bytes(tokenizer: &Tokenizer) -> Result<Vec<Vec<u8>>, String> {
    let parts = tokenizer.parts();
    match parts.kind {
        TokenizerKind::ByteLevel => Ok((0..byte_level::VOCAB_SIZE)
            .map(|t| match u8::try_from(t) {
                Ok(b) => vec![b],
                Err(_) => special(&format!("<[{t}]>")),
            })
            .collect()),
        TokenizerKind::HuggingFace => {
            let json: serde_json::Value = serde_json::from_str(&parts.tokenizer_json)
                .map_err(|e| format!("tokenizer.json: {e}"))?;
            let mut words = token_bytes_from_tokenizer_json(&json).map_err(|e| e.to_string())?;
            words.resize(tokenizer.vocab_size() as usize, Vec::new());
            for (t, w) in words.iter_mut().enumerate() {
                // no bytes: a hole in the vocabulary, never allowed as text
                if w.is_empty() {
                    *w = special(&format!("<[{t}]>"));
                }
            }
            Ok(words)
        }
    }
}

fn special(name: &str) -> Vec<u8> {
    let mut w = vec![TokTrie::SPECIAL_TOKEN_MARKER];
    w.extend_from_slice(name.as_bytes());
    w
}

/// One output's place in its constraint.
pub struct Matcher {
    inner: llguidance::Matcher,
    /// An end id was consumed: the output is over.
    ended: bool,
    vocab: usize,
}

impl std::fmt::Debug for Matcher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Matcher")
            .field("ended", &self.ended)
            .field("stopped", &self.inner.is_stopped())
            .finish_non_exhaustive()
    }
}

/// u32 words of a mask over `vocab` tokens.
pub fn mask_words(vocab: usize) -> usize {
    vocab.div_ceil(32)
}

impl Matcher {
    /// Advances past the output token `token`; an error when the
    /// constraint does not allow it there. After an end id (allowed once
    /// the grammar is complete) every token is ignored: the output is over.
    pub fn consume(&mut self, token: u32) -> Result<(), String> {
        if self.ended {
            return Ok(());
        }
        let trie = self.inner.tok_env().map_err(|e| e.to_string())?;
        if trie.tok_trie().eos_tokens().contains(&token) {
            let mask = self
                .inner
                .compute_mask_or_eos()
                .map_err(|e| e.to_string())?;
            if !mask.is_allowed(token) {
                return Err(format!("end token {token} before the output is complete"));
            }
            self.ended = true;
            return Ok(());
        }
        if self.inner.is_stopped() {
            return Err(format!("token {token} after the output is complete"));
        }
        self.inner.consume_token(token).map_err(|e| e.to_string())
    }

    /// Whether an end id was consumed: the output is over.
    pub fn ended(&self) -> bool {
        self.ended
    }

    /// Whether the output is complete: only an end id may follow.
    pub fn is_complete(&self) -> bool {
        self.ended || self.inner.is_stopped()
    }

    /// The tokens allowed next, as bits over a model vocabulary of `vocab`
    /// tokens ([`mask_words`] words; ids past the tokenizer's are never
    /// allowed), written into `words`.
    pub fn mask_into(&mut self, words: &mut Vec<u32>, vocab: usize) -> Result<(), String> {
        words.clear();
        words.resize(mask_words(vocab), 0);
        let mask = self
            .inner
            .compute_mask_or_eos()
            .map_err(|e| e.to_string())?;
        let allowed = mask.as_slice();
        let n = mask_words(self.vocab.min(vocab)).min(allowed.len());
        words[..n].copy_from_slice(&allowed[..n]);
        let tail = self.vocab.min(vocab) % 32;
        if tail != 0
            && let Some(last) = words.get_mut(n - 1)
        {
            *last &= (1u32 << tail) - 1;
        }
        Ok(())
    }
}

/// Whether `mask` allows token `t`.
pub fn allowed(mask: &[u32], t: u32) -> bool {
    mask.get(t as usize / 32)
        .is_some_and(|w| w >> (t % 32) & 1 == 1)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bytes() -> Grammars {
        Grammars::new(&Tokenizer::byte_level()).unwrap()
    }

    /// Greedy-by-mask: the lowest allowed token each step, until complete.
    fn walk(m: &mut Matcher, vocab: usize, prefer: &[u8]) -> Vec<u32> {
        let mut out = Vec::new();
        let mut words = Vec::new();
        for i in 0..200 {
            m.mask_into(&mut words, vocab).unwrap();
            let wanted = prefer.get(i).map(|&b| u32::from(b));
            let t = match wanted.filter(|&t| allowed(&words, t)) {
                Some(t) => t,
                None => (0..vocab as u32).find(|&t| allowed(&words, t)).unwrap(),
            };
            m.consume(t).unwrap();
            out.push(t);
            if t == byte_level::EOS {
                break;
            }
        }
        out
    }

    #[test]
    fn a_schema_masks_every_step_to_valid_json_and_ends_with_eos() {
        let g = bytes();
        let schema = r#"{"type":"object","properties":{"n":{"type":"integer"}},"required":["n"],"additionalProperties":false}"#;
        let mut m = g.compile(&Constraint::JsonSchema(schema.into())).unwrap();
        // a model vocabulary wider than the tokenizer's
        let out = walk(&mut m, 300, br#"{"n":42}"#);
        assert_eq!(out.last(), Some(&byte_level::EOS));
        let text = byte_level::decode(&out);
        assert_eq!(text, r#"{"n":42}"#);
        assert!(m.is_complete());
        // tokens past the end (a pipelined pass's) change nothing
        m.consume(b'x'.into()).unwrap();
    }

    #[test]
    fn the_mask_refuses_what_the_grammar_cannot_take() {
        let g = bytes();
        let mut m = g.compile(&Constraint::JsonObject).unwrap();
        let mut words = Vec::new();
        m.mask_into(&mut words, 300).unwrap();
        assert_eq!(words.len(), 10);
        assert!(allowed(&words, b'{'.into()));
        assert!(!allowed(&words, b'a'.into()) && !allowed(&words, b' '.into()));
        assert!(!allowed(&words, byte_level::EOS), "not complete yet");
        assert!(
            (258..300).all(|t| !allowed(&words, t)),
            "past the vocabulary"
        );
        assert!(m.consume(b'a'.into()).is_err());
        let mut r = g.compile(&Constraint::Regex("ab|ac".into())).unwrap();
        r.consume(b'a'.into()).unwrap();
        r.mask_into(&mut words, 258).unwrap();
        let next: Vec<u32> = (0..258).filter(|&t| allowed(&words, t)).collect();
        assert_eq!(next, [u32::from(b'b'), u32::from(b'c')]);
        r.consume(b'c'.into()).unwrap();
        r.mask_into(&mut words, 258).unwrap();
        let next: Vec<u32> = (0..258).filter(|&t| allowed(&words, t)).collect();
        assert_eq!(next, [byte_level::EOS], "complete: only the end");
        assert!(r.consume(b'x'.into()).is_err());
    }

    #[test]
    fn lark_grammars_constrain_too() {
        let g = bytes();
        let lark = r#"start: "yes" | "no""#;
        let mut m = g.compile(&Constraint::Lark(lark.into())).unwrap();
        let out = walk(&mut m, 258, b"no");
        assert_eq!(byte_level::decode(&out), "no");
    }

    #[test]
    fn bad_constraints_name_their_kind_and_the_engine_problem() {
        let g = bytes();
        let e = g
            .compile(&Constraint::JsonSchema("{not json".into()))
            .unwrap_err();
        assert_eq!(e.kind, "json_schema");
        assert!(e.message.contains("not JSON"), "{e}");
        let e = g
            .compile(&Constraint::JsonSchema(r#"{"type":"frobnicate"}"#.into()))
            .unwrap_err();
        assert!(e.message.contains("frobnicate"), "{e}");
        let e = g.compile(&Constraint::Lark("start: (".into())).unwrap_err();
        assert_eq!(e.kind, "lark");
        let e = g
            .compile(&Constraint::Regex("(unclosed".into()))
            .unwrap_err();
        assert_eq!(e.kind, "regex");
        let long = format!(r#"{{"type":"{}"}}"#, "x".repeat(5000));
        let e = g.compile(&Constraint::JsonSchema(long)).unwrap_err();
        assert!(e.message.chars().count() <= MAX_MESSAGE_CHARS + 3, "{e}");
    }
}
