//! OpenAI's request and response bodies, as serde types. Plain data: the
//! checks of what kvlease can serve are in [`crate::request`], the gRPC
//! messages in [`crate::convert`]. Integers a request sends are read 64 bits
//! wide, so that one over the protocol's 32-bit field is refused by
//! [`crate::request`] naming it, not by a parse error that does not.

use serde::{Deserialize, Serialize};

// === requests ===

/// `POST /v1/completions`.
#[derive(Debug, Clone, Deserialize)]
pub struct CompletionRequest {
    pub model: String,
    pub prompt: Prompt,
    #[serde(flatten)]
    pub common: Common,
    /// The prompt's text before the completion (and with `logprobs`, the
    /// prompt's logprobs before the completion's).
    #[serde(default)]
    pub echo: Option<bool>,
    /// With `use_beam_search`: the beam width (at least `n`); without it,
    /// refused unless 1 (no best-of sampling).
    #[serde(default)]
    pub best_of: Option<u64>,
    /// Refused when set: no insertion mode.
    #[serde(default)]
    pub suffix: Option<String>,
}

/// `POST /v1/chat/completions`.
#[derive(Debug, Clone, Deserialize)]
pub struct ChatRequest {
    pub model: String,
    pub messages: Vec<ChatMessage>,
    #[serde(flatten)]
    pub common: Common,
    /// The newer name of `max_tokens` in chat.
    #[serde(default)]
    pub max_completion_tokens: Option<u64>,
    /// Refused when not empty: no tool calls.
    #[serde(default)]
    pub tools: Option<Vec<serde_json::Value>>,
    /// 0 to 20 alternatives per token; needs `logprobs: true`. Read as a
    /// JSON value, so that a negative one is refused naming it.
    #[serde(default)]
    pub top_logprobs: Option<serde_json::Value>,
}

/// The fields both endpoints share.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct Common {
    #[serde(default)]
    pub max_tokens: Option<u64>,
    #[serde(default)]
    pub temperature: Option<f32>,
    #[serde(default)]
    pub top_p: Option<f32>,
    #[serde(default)]
    pub seed: Option<u64>,
    #[serde(default)]
    pub stop: Option<Stop>,
    #[serde(default)]
    pub n: Option<u64>,
    /// vLLM's extension: beam search, of width `best_of` (completions) or
    /// else `n`; the best `n` hypotheses are the choices. Read as a JSON
    /// value, so that a non-boolean is refused naming it.
    #[serde(default)]
    pub use_beam_search: Option<serde_json::Value>,
    #[serde(default)]
    pub user: Option<String>,
    /// OpenAI's newer end-user id (it replaces `user`): a label for the
    /// provider's abuse monitoring, checked for length as `user` is; it
    /// changes no output.
    #[serde(default)]
    pub safety_identifier: Option<String>,
    /// OpenAI's key for routing requests with shared prefixes to the same
    /// cache: checked for length. kvlease's prefix reuse and kv-aware routing
    /// go by the prompt's own tokens, which a key cannot improve on.
    #[serde(default)]
    pub prompt_cache_key: Option<String>,
    #[serde(default)]
    pub stream: Option<bool>,
    /// vLLM's extension: generate `max_tokens` even past an end-of-sequence
    /// token (load tests that need fixed output lengths).
    #[serde(default)]
    pub ignore_eos: Option<bool>,
    #[serde(default)]
    pub stream_options: Option<StreamOptions>,
    /// Completions: an integer 0 to 5 (alternatives per token); chat: a
    /// boolean. Read as a JSON value and checked per endpoint.
    #[serde(default)]
    pub logprobs: Option<serde_json::Value>,
    /// kvlease's own extensions: `{"retain": {"tokens": N, "priority": P,
    /// "ttl_s": T}}` (a retention hint, see [`crate::request::Retain`]).
    /// Read as a JSON value, so that a malformed one is refused naming its
    /// field.
    #[serde(default)]
    pub kvlease: Option<serde_json::Value>,
    /// OpenAI's penalties, `logit_bias`, and vLLM's sampling extensions
    /// (`top_k`, `min_p`, `repetition_penalty`, `min_tokens`,
    /// `stop_token_ids`).
    #[serde(flatten)]
    pub sampling: SamplingFields,
    #[serde(flatten)]
    pub unserved: Unserved,
}

/// Sampling fields read as JSON values, so that a value of the wrong type
/// is refused naming the field ([`crate::request`] reads them); the
/// scheduler checks their ranges.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct SamplingFields {
    #[serde(default)]
    pub frequency_penalty: Option<serde_json::Value>,
    #[serde(default)]
    pub presence_penalty: Option<serde_json::Value>,
    #[serde(default)]
    pub repetition_penalty: Option<serde_json::Value>,
    /// Token id (a string key, as JSON objects have) to bias.
    #[serde(default)]
    pub logit_bias: Option<serde_json::Value>,
    #[serde(default)]
    pub min_tokens: Option<serde_json::Value>,
    /// -1 or 0: off.
    #[serde(default)]
    pub top_k: Option<serde_json::Value>,
    #[serde(default)]
    pub min_p: Option<serde_json::Value>,
    /// vLLM's extension: token ids that end the generation (as the model's
    /// end tokens do; held back until `min_tokens`).
    #[serde(default)]
    pub stop_token_ids: Option<serde_json::Value>,
}

/// Fields the OpenAI API (or vLLM's extensions, which load generators send)
/// documents and kvlease does not implement yet. Each is refused with a 400
/// naming it unless absent, `null` or set to its no-op value
/// ([`crate::request`]), never silently ignored. Read as JSON values, so
/// that a value of the wrong type is refused naming the field too.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct Unserved {
    /// Served: read by [`crate::structured`] (structured output); kept
    /// here, beside the fields refused, as OpenAI documents it.
    #[serde(default)]
    pub response_format: Option<serde_json::Value>,
    #[serde(default)]
    pub tool_choice: Option<serde_json::Value>,
    #[serde(default)]
    pub functions: Option<serde_json::Value>,
    #[serde(default)]
    pub function_call: Option<serde_json::Value>,
    #[serde(default)]
    pub modalities: Option<serde_json::Value>,
    #[serde(default)]
    pub audio: Option<serde_json::Value>,
    #[serde(default)]
    pub prediction: Option<serde_json::Value>,
    #[serde(default)]
    pub reasoning_effort: Option<serde_json::Value>,
    #[serde(default)]
    pub verbosity: Option<serde_json::Value>,
    #[serde(default)]
    pub web_search_options: Option<serde_json::Value>,
    #[serde(default)]
    pub store: Option<serde_json::Value>,
    #[serde(default)]
    pub metadata: Option<serde_json::Value>,
    #[serde(default)]
    pub service_tier: Option<serde_json::Value>,
    /// OpenAI's `"in-memory"` (what kvlease's cache does) or `"24h"`
    /// (refused: `kvlease.retain` keeps a prefix for a given time).
    #[serde(default)]
    pub prompt_cache_retention: Option<serde_json::Value>,
    /// Only meaningful with `tools`, which are refused: any boolean is a
    /// no-op.
    #[serde(default)]
    pub parallel_tool_calls: Option<serde_json::Value>,
}

/// A completion prompt: a string, a list of one string, or token ids.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum Prompt {
    Text(String),
    Tokens(Vec<u64>),
    Texts(Vec<String>),
    TokenLists(Vec<Vec<u64>>),
}

/// `stop`: one string or a list of them.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum Stop {
    One(String),
    Many(Vec<String>),
}

#[derive(Debug, Clone, Default, Deserialize)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: bool,
    /// OpenAI pads stream chunks with an `obfuscation` field unless this is
    /// false; kvlease never does, so `true` is refused.
    #[serde(default)]
    pub include_obfuscation: Option<bool>,
}

/// One chat message. `content` is a string or a list of parts, of which
/// only text parts are served.
#[derive(Debug, Clone, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    #[serde(default)]
    pub content: Option<Content>,
    #[serde(flatten)]
    pub unserved: MessageUnserved,
}

/// A message's fields besides `role` and `content` that OpenAI documents:
/// none reaches the chat template, so each is refused unless absent, `null`
/// or empty ([`crate::request`]), never dropped.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct MessageUnserved {
    #[serde(default)]
    pub name: Option<serde_json::Value>,
    #[serde(default)]
    pub tool_calls: Option<serde_json::Value>,
    #[serde(default)]
    pub tool_call_id: Option<serde_json::Value>,
    #[serde(default)]
    pub function_call: Option<serde_json::Value>,
    #[serde(default)]
    pub audio: Option<serde_json::Value>,
    #[serde(default)]
    pub refusal: Option<serde_json::Value>,
}

impl MessageUnserved {
    /// The first field set to something: absent, `null`, `""` and `[]` are
    /// nothing.
    pub fn first_set(&self) -> Option<&'static str> {
        let set = |v: &Option<serde_json::Value>| {
            v.as_ref().is_some_and(|v| {
                !(v.is_null()
                    || v.as_str().is_some_and(str::is_empty)
                    || v.as_array().is_some_and(Vec::is_empty))
            })
        };
        [
            ("name", &self.name),
            ("tool_calls", &self.tool_calls),
            ("tool_call_id", &self.tool_call_id),
            ("function_call", &self.function_call),
            ("audio", &self.audio),
            ("refusal", &self.refusal),
        ]
        .into_iter()
        .find_map(|(field, v)| set(v).then_some(field))
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum Content {
    Text(String),
    Parts(Vec<ContentPart>),
}

#[derive(Debug, Clone, Deserialize)]
pub struct ContentPart {
    #[serde(rename = "type")]
    pub kind: String,
    #[serde(default)]
    pub text: Option<String>,
}

// === responses ===

/// Token counts of one request.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct Usage {
    pub prompt_tokens: u32,
    pub completion_tokens: u32,
    pub total_tokens: u32,
    pub prompt_tokens_details: PromptTokensDetails,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct PromptTokensDetails {
    /// Prompt tokens served from cached prefix blocks.
    pub cached_tokens: u32,
    /// With a `kvlease.retain` hint: the prompt tokens the cache keeps under
    /// it (fewer than asked when the tenant's quota had no room; 0 when it
    /// had none). Absent without a hint.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kvlease_retained_tokens: Option<u32>,
}

impl Usage {
    pub fn new(prompt_tokens: u32, completion_tokens: u32, cached_tokens: u32) -> Self {
        Self {
            prompt_tokens,
            completion_tokens,
            total_tokens: prompt_tokens.saturating_add(completion_tokens),
            prompt_tokens_details: PromptTokensDetails {
                cached_tokens,
                kvlease_retained_tokens: None,
            },
        }
    }
}

/// `text_completion` and its streamed chunks (same shape).
#[derive(Debug, Clone, Serialize)]
pub struct Completion {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub model: String,
    pub choices: Vec<CompletionChoice>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
}

#[derive(Debug, Clone, Serialize)]
pub struct CompletionChoice {
    pub index: u32,
    pub text: String,
    /// [`crate::logprobs::completion`]'s object, or null.
    pub logprobs: Option<serde_json::Value>,
    pub finish_reason: Option<&'static str>,
}

/// `chat.completion`.
#[derive(Debug, Clone, Serialize)]
pub struct ChatCompletion {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub model: String,
    pub choices: Vec<ChatChoice>,
    pub usage: Usage,
}

#[derive(Debug, Clone, Serialize)]
pub struct ChatChoice {
    pub index: u32,
    pub message: AssistantMessage,
    /// [`crate::logprobs::chat`]'s object, or null.
    pub logprobs: Option<serde_json::Value>,
    pub finish_reason: &'static str,
}

#[derive(Debug, Clone, Serialize)]
pub struct AssistantMessage {
    pub role: &'static str,
    pub content: String,
}

/// `chat.completion.chunk`.
#[derive(Debug, Clone, Serialize)]
pub struct ChatChunk {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub model: String,
    pub choices: Vec<ChunkChoice>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
}

#[derive(Debug, Clone, Serialize)]
pub struct ChunkChoice {
    pub index: u32,
    pub delta: Delta,
    pub logprobs: Option<serde_json::Value>,
    pub finish_reason: Option<&'static str>,
}

#[derive(Debug, Clone, Default, Serialize)]
pub struct Delta {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub role: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub content: Option<String>,
}

/// `GET /v1/models`.
#[derive(Debug, Clone, Serialize)]
pub struct ModelList {
    pub object: &'static str,
    pub data: Vec<Model>,
}

#[derive(Debug, Clone, Serialize)]
pub struct Model {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub owned_by: &'static str,
}
