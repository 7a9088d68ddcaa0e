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
    /// Refused when true: the prompt is not echoed.
    #[serde(default)]
    pub echo: Option<bool>,
    /// Refused unless 1.
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
    /// Refused when more than 0.
    #[serde(default)]
    pub top_logprobs: Option<u64>,
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
    #[serde(default)]
    pub user: Option<String>,
    #[serde(default)]
    pub stream: Option<bool>,
    /// vLLM's extension: generate `max_tokens` even past an end-of-sequence
    /// token (load tests that need fixed output lengths).
    #[serde(default)]
    pub ignore_eos: Option<bool>,
    #[serde(default)]
    pub stream_options: Option<StreamOptions>,
    /// Refused when set to anything but `false` / `null`: no log-probs.
    #[serde(default)]
    pub logprobs: Option<serde_json::Value>,
    /// kvlease's own extensions: `{"retain": {"tokens": N, "priority": P,
    /// "ttl_s": T}}` (a retention hint, see [`crate::request::Retain`]).
    /// Read as a JSON value, so that a malformed one is refused naming its
    /// field.
    #[serde(default)]
    pub kvlease: Option<serde_json::Value>,
    /// OpenAI's penalties, `logit_bias`, and vLLM's sampling extensions
    /// (`top_k`, `min_p`, `repetition_penalty`, `min_tokens`).
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
    pub use_beam_search: Option<serde_json::Value>,
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
}

/// One chat message. `content` is a string or a list of parts, of which
/// only text parts are served.
#[derive(Debug, Clone, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    #[serde(default)]
    pub content: Option<Content>,
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
    pub logprobs: Option<()>,
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
    pub logprobs: Option<()>,
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
    pub logprobs: Option<()>,
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
