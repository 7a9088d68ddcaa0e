//! Hugging Face tokenizer files: `tokenizer.json` with the special tokens
//! and chat template of `tokenizer_config.json` (and the end-of-sequence ids
//! of `generation_config.json` / `config.json` when present).

use std::path::Path;

use serde_json::{Value, json};

use crate::error::{Error, Result};
use crate::{Specials, Tokenizer, TokenizerKind};

/// A BPE `model` object of `tokenizer.json`.
pub(crate) fn bpe_model(
    vocab: serde_json::Map<String, Value>,
    merges: &[(String, String)],
    unk_token: Option<String>,
    byte_fallback: bool,
    ignore_merges: bool,
) -> Value {
    json!({
        "type": "BPE",
        "dropout": null,
        "unk_token": unk_token,
        "continuing_subword_prefix": null,
        "end_of_word_suffix": null,
        "fuse_unk": byte_fallback,
        "byte_fallback": byte_fallback,
        "ignore_merges": ignore_merges,
        "vocab": vocab,
        "merges": merges.iter().map(|(l, r)| json!([l, r])).collect::<Vec<_>>(),
    })
}

impl Tokenizer {
    /// This tokenizer as the files of a Hugging Face tokenizer directory:
    /// `tokenizer.json`, `tokenizer_config.json` (special tokens, chat
    /// template, a fast tokenizer's class) and `generation_config.json`
    /// (every end id). [`Tokenizer::from_hf_dir`] reads them back into an
    /// equal tokenizer (the same fingerprint), and transformers'
    /// `AutoTokenizer.from_pretrained(DIR)` as a fast tokenizer: what load
    /// generators that make prompts with the model's tokenizer need, with no
    /// hub to download it from. The seeded model's byte-level tokenizer has
    /// no `tokenizer.json`: an error.
    pub fn hf_files(&self) -> Result<Vec<(&'static str, String)>> {
        let parts = self.parts();
        if parts.kind != TokenizerKind::HuggingFace {
            return Err(Error::Invalid(
                "the byte-level tokenizer has no tokenizer.json".into(),
            ));
        }
        let s = &parts.specials;
        let mut config = json!({
            "tokenizer_class": "PreTrainedTokenizerFast",
            "add_bos_token": s.add_bos,
            "clean_up_tokenization_spaces": false,
        });
        for (key, value) in [
            ("bos_token", &s.bos_token),
            ("eos_token", &s.eos_token),
            ("chat_template", &parts.chat_template),
        ] {
            if let Some(v) = value {
                config[key] = json!(v);
            }
        }
        let pretty = |v: &Value| {
            serde_json::to_string_pretty(v).map_err(|e| Error::Tokenizer(e.to_string()))
        };
        Ok(vec![
            ("tokenizer.json", parts.tokenizer_json.clone()),
            ("tokenizer_config.json", pretty(&config)?),
            (
                "generation_config.json",
                pretty(&json!({ "eos_token_id": s.end_ids }))?,
            ),
        ])
    }
}

/// The files of a Hugging Face model directory the tokenizer is made of.
#[derive(Debug, Clone, Default)]
pub(crate) struct HfFiles {
    pub(crate) tokenizer_json: String,
    pub(crate) tokenizer_config: Option<Value>,
    /// `generation_config.json` and `config.json`, for their `eos_token_id`.
    pub(crate) other_configs: Vec<Value>,
}

fn read_json(path: &Path) -> Result<Option<Value>> {
    match std::fs::read_to_string(path) {
        Ok(text) => serde_json::from_str(&text)
            .map(Some)
            .map_err(|e| Error::Read {
                path: path.display().to_string(),
                message: format!("not valid JSON: {e}"),
            }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(Error::Read {
            path: path.display().to_string(),
            message: e.to_string(),
        }),
    }
}

impl HfFiles {
    /// Reads `dir`; `tokenizer.json` must be there, the rest is optional.
    pub(crate) fn read(dir: &Path) -> Result<Self> {
        let path = dir.join("tokenizer.json");
        let tokenizer_json = std::fs::read_to_string(&path).map_err(|e| Error::Read {
            path: path.display().to_string(),
            message: e.to_string(),
        })?;
        let tokenizer_config = read_json(&dir.join("tokenizer_config.json"))?;
        let mut other_configs = Vec::new();
        for name in ["generation_config.json", "config.json"] {
            other_configs.extend(read_json(&dir.join(name))?);
        }
        Ok(Self {
            tokenizer_json,
            tokenizer_config,
            other_configs,
        })
    }

    /// The chat template: a string, or the one named "default" of a list.
    pub(crate) fn chat_template(&self) -> Option<String> {
        match self.tokenizer_config.as_ref()?.get("chat_template")? {
            Value::String(s) => Some(s.clone()),
            Value::Array(list) => list
                .iter()
                .find(|t| t.get("name").and_then(Value::as_str) == Some("default"))
                .and_then(|t| t.get("template")?.as_str().map(str::to_string)),
            _ => None,
        }
    }

    /// The special tokens, with ids looked up in `tokenizer`.
    pub(crate) fn specials(&self, tokenizer: &tokenizers::Tokenizer) -> Specials {
        let config = self.tokenizer_config.as_ref();
        // a token is written as a string or as an AddedToken object
        let token = |key: &str| -> Option<String> {
            match config?.get(key)? {
                Value::String(s) => Some(s.clone()),
                Value::Object(o) => o.get("content")?.as_str().map(str::to_string),
                _ => None,
            }
        };
        let bos_token = token("bos_token");
        let eos_token = token("eos_token");
        let bos_id = bos_token.as_deref().and_then(|t| tokenizer.token_to_id(t));
        let mut end_ids: Vec<u32> = eos_token
            .as_deref()
            .and_then(|t| tokenizer.token_to_id(t))
            .into_iter()
            .collect();
        for c in &self.other_configs {
            match c.get("eos_token_id") {
                Some(Value::Number(n)) => end_ids.extend(n.as_u64().map(|n| n as u32)),
                Some(Value::Array(ids)) => {
                    end_ids.extend(ids.iter().filter_map(|n| n.as_u64()).map(|n| n as u32))
                }
                _ => {}
            }
        }
        // without a word from tokenizer_config.json, BOS is added when the
        // tokenizer's own post-processor adds it
        let add_bos = config
            .and_then(|c| c.get("add_bos_token"))
            .and_then(Value::as_bool)
            .unwrap_or_else(|| {
                bos_id.is_some()
                    && tokenizer
                        .encode("a", true)
                        .is_ok_and(|e| e.get_ids().first() == bos_id.as_ref())
            });
        Specials::new(bos_id, bos_token, eos_token, end_ids, add_bos)
    }
}
