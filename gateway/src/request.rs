//! What an OpenAI request asks for, checked for what kvlease can serve and
//! reduced to one [`Generate`]. The scheduler validates the rest (prompt
//! length, `max_tokens` limit, sampling ranges, stop strings, chat roles)
//! for the gRPC path and this one alike; its `INVALID_ARGUMENT` becomes a
//! 400 with its message.

use serde_json::{Value, json};

use crate::error::{ApiError, Result};
use crate::openai::{ChatRequest, Common, CompletionRequest, Content, Prompt, Stop, Unserved};

/// The prompt of a request.
#[derive(Debug, Clone, PartialEq)]
pub enum Input {
    Text(String),
    Tokens(Vec<u32>),
    /// (role, content) pairs, rendered by the model's chat template.
    Chat(Vec<(String, String)>),
}

/// One generation, as both endpoints ask for it.
#[derive(Debug, Clone, PartialEq)]
pub struct Generate {
    pub input: Input,
    pub max_tokens: u32,
    pub temperature: f32,
    pub top_p: f32,
    pub seed: u64,
    pub top_k: u32,
    pub min_p: f32,
    pub frequency_penalty: f32,
    pub presence_penalty: f32,
    /// 0 when not given (the scheduler reads it as 1).
    pub repetition_penalty: f32,
    /// (token, bias), ascending by token.
    pub logit_bias: Vec<(u32, f32)>,
    pub min_tokens: u32,
    pub stop: Vec<String>,
    /// vLLM's `stop_token_ids`: tokens that end the generation.
    pub stop_token_ids: Vec<u32>,
    /// OpenAI's end-user id, checked for length only: it is no tenant and
    /// no cache salt, since anyone may set it (the tenant is the bearer
    /// token's principal, see [`crate::service`]).
    pub user: Option<String>,
    pub stream: bool,
    /// Generate `max_tokens` even past an end-of-sequence token.
    pub ignore_eos: bool,
    /// `stream_options.include_usage`: a last chunk with the usage.
    pub include_usage: bool,
    /// `kvlease.retain`: keep a prefix of the prompt cached.
    pub retain: Option<Retain>,
    /// Choices (parallel samples), 1 to [`MAX_SAMPLES`].
    pub n: u32,
    /// Log-probabilities of each token with this many alternatives;
    /// `None`: none.
    pub logprobs: Option<u32>,
    /// Completions' `echo`: the prompt's text (and, with `logprobs`, its
    /// logprobs) first.
    pub echo: bool,
    /// `response_format` / `kvlease.grammar`: structured output.
    pub grammar: Option<crate::structured::Grammar>,
    /// `use_beam_search`: the beam width (`best_of`, else `n`); 1: off.
    pub beam_width: u32,
}

/// The most beams a request may ask (the scheduler's `beam_width` limit).
const MAX_BEAM_WIDTH: u64 = 10;

/// The beam width of `use_beam_search` (1: off): `best_of` when given
/// (at least `n`), else `n`. `best_of` without beams is refused unless 1:
/// no best-of sampling is served.
fn beam_width(use_beam_search: Option<&Value>, best_of: Option<u64>, n: u32) -> Result<u32> {
    let beams = match use_beam_search.filter(|v| !v.is_null()) {
        None | Some(Value::Bool(false)) => false,
        Some(Value::Bool(true)) => true,
        Some(v) => return Err(wrong_type("use_beam_search", v, "a boolean")),
    };
    match (beams, best_of) {
        (false, None | Some(1)) => Ok(1),
        (false, Some(_)) => Err(ApiError::invalid_param(
            "best_of",
            "best_of must be 1 unless use_beam_search is true (then it is the beam width)",
        )),
        (true, Some(b)) if b < u64::from(n) || b > MAX_BEAM_WIDTH => Err(ApiError::invalid_param(
            "best_of",
            format!("best_of (the beam width) must be n ({n}) to {MAX_BEAM_WIDTH}, got {b}"),
        )),
        (true, Some(b)) => Ok(b as u32),
        (true, None) if u64::from(n) > MAX_BEAM_WIDTH => Err(ApiError::invalid_param(
            "n",
            format!(
                "n (the beam width without best_of) must be 1 to {MAX_BEAM_WIDTH} with use_beam_search, got {n}"
            ),
        )),
        (true, None) => Ok(n),
    }
}

/// The most alternatives the completions' `logprobs` may ask (OpenAI's).
const MAX_COMPLETION_LOGPROBS: u64 = 5;
/// The most chat's `top_logprobs` may ask (OpenAI's).
const MAX_TOP_LOGPROBS: u64 = 20;

/// A count in `0..=max` or null, else a 400 naming `param`.
fn count(param: &'static str, v: Option<&Value>, max: u64) -> Result<Option<u32>> {
    match v.filter(|v| !v.is_null()) {
        None => Ok(None),
        Some(v) => match v.as_u64() {
            Some(n) if n <= max => Ok(Some(n as u32)),
            _ => Err(ApiError::invalid_param(
                param,
                format!(
                    "{param} must be an integer 0 to {max}, got {}",
                    crate::error::clip(&v.to_string())
                ),
            )),
        },
    }
}

/// Most choices (`n`) one request may ask for (the scheduler's limit).
pub const MAX_SAMPLES: u64 = 16;

/// A retention hint (`"kvlease": {"retain": {...}}`): the cache keeps the
/// full blocks of the prompt's first `tokens` tokens after every unhinted
/// block for `ttl_s` seconds, within the tenant's quota (the scheduler's
/// `Generate.retain`; it checks `tokens` against the prompt's length).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Retain {
    pub tokens: u32,
    /// 0 to 100; 0 when not given.
    pub priority: u32,
    pub ttl_s: u32,
}

/// The longest `kvlease.retain.ttl_s` (a day, as the scheduler allows).
const MAX_RETAIN_TTL_S: u64 = 86_400;

/// Reads the `kvlease` extension object: `retain` here, `grammar` in
/// [`crate::structured`].
fn kvlease_extension(v: Option<&Value>) -> Result<Option<Retain>> {
    let Some(v) = v.filter(|v| !v.is_null()) else {
        return Ok(None);
    };
    let Some(ext) = v.as_object() else {
        return Err(ApiError::invalid_param(
            "kvlease",
            "kvlease must be an object",
        ));
    };
    if let Some(k) = ext
        .keys()
        .find(|k| !["retain", "grammar"].contains(&k.as_str()))
    {
        return Err(ApiError::invalid_param(
            "kvlease",
            format!(
                "kvlease.{} is not a kvlease extension (known: retain, grammar)",
                crate::error::clip(k)
            ),
        ));
    }
    let Some(r) = ext.get("retain").filter(|r| !r.is_null()) else {
        return Ok(None);
    };
    let Some(r) = r.as_object() else {
        return Err(ApiError::invalid_param(
            "kvlease.retain",
            "kvlease.retain must be an object {tokens, priority, ttl_s}",
        ));
    };
    if let Some(k) = r
        .keys()
        .find(|k| !["tokens", "priority", "ttl_s"].contains(&k.as_str()))
    {
        return Err(ApiError::invalid_param(
            "kvlease.retain",
            format!(
                "kvlease.retain.{} is unknown (known: tokens, priority, ttl_s)",
                crate::error::clip(k)
            ),
        ));
    }
    let field =
        |name: &'static str, param: &'static str, lo: u64, hi: u64, default: Option<u64>| {
            let v = match r.get(name).filter(|v| !v.is_null()) {
                None => default.ok_or_else(|| {
                    ApiError::invalid_param(param, format!("{param} is required"))
                })?,
                Some(v) => v.as_u64().ok_or_else(|| {
                    ApiError::invalid_param(param, format!("{param} must be a whole number"))
                })?,
            };
            if !(lo..=hi).contains(&v) {
                return Err(ApiError::invalid_param(
                    param,
                    format!("{param} must be {lo} to {hi}, got {v}"),
                ));
            }
            Ok(v as u32)
        };
    Ok(Some(Retain {
        tokens: field(
            "tokens",
            "kvlease.retain.tokens",
            1,
            u64::from(u32::MAX),
            None,
        )?,
        priority: field("priority", "kvlease.retain.priority", 0, 100, Some(0))?,
        ttl_s: field("ttl_s", "kvlease.retain.ttl_s", 1, MAX_RETAIN_TTL_S, None)?,
    }))
}

/// What the gateway serves: the model name, other names requests may use
/// for it, and the default `max_tokens`.
#[derive(Debug, Clone)]
pub struct Served {
    /// The name answers carry.
    pub model: String,
    pub aliases: Vec<String>,
    pub default_max_tokens: u32,
}

/// A user id longer than this is refused (the scheduler's label limit).
const MAX_USER: usize = 256;
/// Stop strings: how many, and the bytes of each (the scheduler's limits).
const MAX_STOPS: usize = 16;
const MAX_STOP_BYTES: usize = 256;
/// Most `stop_token_ids` a request may send.
const MAX_STOP_TOKEN_IDS: usize = 64;

impl Served {
    /// `POST /v1/completions`.
    pub fn completion(&self, r: CompletionRequest) -> Result<Generate> {
        self.check_model(&r.model)?;
        // `false` reads as none, as OpenAI's clients send it
        let logprobs = match r.common.logprobs.as_ref() {
            Some(Value::Bool(false)) => None,
            v => count("logprobs", v, MAX_COMPLETION_LOGPROBS)?,
        };
        let echo = r.echo.unwrap_or(false);
        if r.suffix.as_ref().is_some_and(|s| !s.is_empty()) {
            return Err(ApiError::invalid_param("suffix", "suffix is not supported"));
        }
        let one = "one prompt per request: a list of prompts is not supported (n = 1)";
        let input = match r.prompt {
            Prompt::Text(t) => Input::Text(t),
            Prompt::Tokens(t) => Input::Tokens(token_ids(&t)?),
            Prompt::Texts(mut t) if t.len() == 1 => Input::Text(t.remove(0)),
            Prompt::TokenLists(t) if t.len() == 1 => Input::Tokens(token_ids(&t[0])?),
            Prompt::Texts(_) | Prompt::TokenLists(_) => {
                return Err(ApiError::invalid_param("prompt", one));
            }
        };
        // OpenAI's completions default
        let mut g = self.common(input, r.common, None, 16, r.best_of)?;
        g.logprobs = logprobs;
        g.echo = echo;
        Ok(g)
    }

    /// `POST /v1/chat/completions`.
    pub fn chat(&self, r: ChatRequest) -> Result<Generate> {
        self.check_model(&r.model)?;
        if r.tools.as_ref().is_some_and(|t| !t.is_empty()) {
            return Err(ApiError::invalid_param("tools", "tools are not supported"));
        }
        let asked = match r.common.logprobs.as_ref().filter(|v| !v.is_null()) {
            None | Some(Value::Bool(false)) => false,
            Some(Value::Bool(true)) => true,
            Some(v) => return Err(wrong_type("logprobs", v, "a boolean")),
        };
        let top = count("top_logprobs", r.top_logprobs.as_ref(), MAX_TOP_LOGPROBS)?;
        if top.is_some() && !asked {
            return Err(ApiError::invalid_param(
                "top_logprobs",
                "top_logprobs needs logprobs: true",
            ));
        }
        let logprobs = asked.then_some(top.unwrap_or(0));
        if r.messages.is_empty() {
            return Err(ApiError::invalid_param(
                "messages",
                "messages must hold at least one message",
            ));
        }
        let mut chat = Vec::with_capacity(r.messages.len());
        for (i, m) in r.messages.into_iter().enumerate() {
            let content = match m.content {
                None => String::new(),
                Some(Content::Text(t)) => t,
                Some(Content::Parts(parts)) => {
                    let mut text = String::new();
                    for p in parts {
                        match (p.kind.as_str(), p.text) {
                            ("text", Some(t)) => text.push_str(&t),
                            (kind, _) => {
                                return Err(ApiError::invalid_param(
                                    "messages",
                                    format!(
                                        "message {i}: content parts of type {} are not supported (text only)",
                                        crate::error::clip(kind)
                                    ),
                                ));
                            }
                        }
                    }
                    text
                }
            };
            if let Some(field) = m.unserved.first_set() {
                return Err(ApiError::invalid_param(
                    "messages",
                    format!("message {i}: {field} is not supported (role and content only)"),
                ));
            }
            chat.push((m.role, content));
        }
        let default = self.default_max_tokens;
        let mut g = self.common(
            Input::Chat(chat),
            r.common,
            r.max_completion_tokens,
            default,
            None,
        )?;
        g.logprobs = logprobs;
        Ok(g)
    }

    /// Whether a request naming `asked` is served here.
    pub fn serves(&self, asked: &str) -> bool {
        asked == self.model || self.aliases.iter().any(|a| a == asked)
    }

    /// Every name of the model: its own, then the aliases.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        std::iter::once(self.model.as_str()).chain(self.aliases.iter().map(String::as_str))
    }

    fn check_model(&self, asked: &str) -> Result<()> {
        if self.serves(asked) {
            Ok(())
        } else {
            Err(ApiError::model_not_found(asked, &self.model))
        }
    }

    fn common(
        &self,
        input: Input,
        c: Common,
        max_completion_tokens: Option<u64>,
        default_max_tokens: u32,
        best_of: Option<u64>,
    ) -> Result<Generate> {
        refuse_unserved(&c.unserved)?;
        let n = match c.n {
            None => 1,
            Some(n @ 1..=MAX_SAMPLES) => n as u32,
            Some(n) => {
                return Err(ApiError::invalid_param(
                    "n",
                    format!("n must be 1 to {MAX_SAMPLES} choices, got {n}"),
                ));
            }
        };
        let beam_width = beam_width(c.use_beam_search.as_ref(), best_of, n)?;
        if beam_width > 1 && c.stream == Some(true) {
            return Err(ApiError::invalid_param(
                "stream",
                "beam search answers at the end: stream is not served with use_beam_search",
            ));
        }
        for (param, label) in [
            ("user", &c.user),
            ("safety_identifier", &c.safety_identifier),
            ("prompt_cache_key", &c.prompt_cache_key),
        ] {
            if label.as_ref().is_some_and(|u| u.len() > MAX_USER) {
                return Err(ApiError::invalid_param(
                    param,
                    format!("{param} is limited to {MAX_USER} bytes"),
                ));
            }
        }
        if c.stream_options
            .as_ref()
            .is_some_and(|o| o.include_obfuscation == Some(true))
        {
            return Err(ApiError::invalid_param(
                "stream_options.include_obfuscation",
                "stream_options.include_obfuscation is not supported: kvlease never pads stream chunks (false is accepted)",
            ));
        }
        let stop = match c.stop {
            None => Vec::new(),
            Some(Stop::One(s)) => vec![s],
            Some(Stop::Many(v)) => v,
        };
        if stop.len() > MAX_STOPS {
            return Err(ApiError::invalid_param(
                "stop",
                format!("{} stop strings; at most {MAX_STOPS}", stop.len()),
            ));
        }
        if let Some(s) = stop
            .iter()
            .find(|s| s.is_empty() || s.len() > MAX_STOP_BYTES)
        {
            return Err(ApiError::invalid_param(
                "stop",
                format!(
                    "stop string {} must be 1 to {MAX_STOP_BYTES} bytes",
                    crate::error::clip(s)
                ),
            ));
        }
        let max_tokens = match (max_completion_tokens, c.max_tokens) {
            (Some(n), _) => narrow("max_completion_tokens", n)?,
            (None, Some(n)) => narrow("max_tokens", n)?,
            (None, None) => default_max_tokens,
        };
        let stream = c.stream.unwrap_or(false);
        let retain = kvlease_extension(c.kvlease.as_ref())?;
        let grammar =
            crate::structured::grammar(c.unserved.response_format.as_ref(), c.kvlease.as_ref())?;
        let f = &c.sampling;
        let number = |name, v: &Option<Value>| number(name, v.as_ref());
        Ok(Generate {
            top_k: top_k(f.top_k.as_ref())?,
            min_p: number("min_p", &f.min_p)?.unwrap_or(0.0),
            frequency_penalty: number("frequency_penalty", &f.frequency_penalty)?.unwrap_or(0.0),
            presence_penalty: number("presence_penalty", &f.presence_penalty)?.unwrap_or(0.0),
            repetition_penalty: number("repetition_penalty", &f.repetition_penalty)?.unwrap_or(0.0),
            logit_bias: logit_bias(f.logit_bias.as_ref())?,
            min_tokens: match f.min_tokens.as_ref().filter(|v| !v.is_null()) {
                None => 0,
                Some(v) => match v.as_u64() {
                    Some(n) => narrow("min_tokens", n)?,
                    None => return Err(wrong_type("min_tokens", v, "a non-negative integer")),
                },
            },
            stop_token_ids: stop_token_ids(f.stop_token_ids.as_ref())?,
            input,
            max_tokens,
            // OpenAI samples at temperature 1 unless told otherwise; beams
            // rank the raw distribution (the scheduler refuses a
            // temperature given with them)
            temperature: c
                .temperature
                .unwrap_or(if beam_width > 1 { 0.0 } else { 1.0 }),
            top_p: c.top_p.unwrap_or(1.0),
            // without a seed, each request samples differently
            seed: c.seed.unwrap_or_else(rand::random),
            stop,
            user: c.user.filter(|u| !u.is_empty()),
            stream,
            ignore_eos: c.ignore_eos.unwrap_or(false),
            include_usage: stream && c.stream_options.is_some_and(|o| o.include_usage),
            retain,
            n,
            beam_width,
            // the endpoints read their own shapes of these
            logprobs: None,
            echo: false,
            grammar,
        })
    }
}

/// One [`Unserved`] field: its name, its value, whether a value is a no-op,
/// and the no-op values as a refusal names them.
type NoOp<'a> = (
    &'static str,
    &'a Option<Value>,
    &'a dyn Fn(&Value) -> bool,
    &'static str,
);

/// Refuses each [`Unserved`] field set to anything but its no-op value,
/// naming it and the values that are accepted.
fn refuse_unserved(u: &Unserved) -> Result<()> {
    let empty = |v: &Value| {
        v.as_object().is_some_and(|o| o.is_empty()) || v.as_array().is_some_and(|a| a.is_empty())
    };
    let no = |v: &Value| *v == Value::Bool(false);
    let fields: [NoOp<'_>; 14] = [
        (
            "tool_choice",
            &u.tool_choice,
            &|v| v.as_str() == Some("none"),
            r#""none""#,
        ),
        ("functions", &u.functions, &empty, "[]"),
        (
            "function_call",
            &u.function_call,
            &|v| v.as_str() == Some("none"),
            r#""none""#,
        ),
        (
            "modalities",
            &u.modalities,
            &|v| *v == json!(["text"]),
            r#"["text"]"#,
        ),
        ("audio", &u.audio, &|_| false, "null"),
        ("prediction", &u.prediction, &|_| false, "null"),
        ("reasoning_effort", &u.reasoning_effort, &|_| false, "null"),
        ("verbosity", &u.verbosity, &|_| false, "null"),
        (
            "web_search_options",
            &u.web_search_options,
            &|_| false,
            "null",
        ),
        ("store", &u.store, &no, "false"),
        ("metadata", &u.metadata, &empty, "{}"),
        (
            "service_tier",
            &u.service_tier,
            &|v| matches!(v.as_str(), Some("auto" | "default")),
            r#""auto" or "default""#,
        ),
        (
            "prompt_cache_retention",
            &u.prompt_cache_retention,
            &|v| matches!(v.as_str(), Some("in-memory" | "in_memory")),
            r#""in-memory" (kvlease.retain keeps a prefix longer)"#,
        ),
        (
            "parallel_tool_calls",
            &u.parallel_tool_calls,
            &Value::is_boolean,
            "a boolean (no tools are served)",
        ),
    ];
    for (name, value, no_op, accepted) in fields {
        if let Some(v) = value
            && !v.is_null()
            && !no_op(v)
        {
            return Err(ApiError::invalid_param(
                name,
                format!(
                    "{name} is not supported: kvlease accepts it only as {accepted} (got {})",
                    crate::error::clip(&v.to_string())
                ),
            ));
        }
    }
    Ok(())
}

/// A 400 naming `param`, whose value `v` is not `expected`.
fn wrong_type(param: &'static str, v: &Value, expected: &str) -> ApiError {
    ApiError::invalid_param(
        param,
        format!(
            "{param} must be {expected}, got {}",
            crate::error::clip(&v.to_string())
        ),
    )
}

/// A sampling number: absent or `null` is `None`.
fn number(param: &'static str, v: Option<&Value>) -> Result<Option<f32>> {
    match v.filter(|v| !v.is_null()) {
        None => Ok(None),
        Some(v) => v
            .as_f64()
            .map(|n| Some(n as f32))
            .ok_or_else(|| wrong_type(param, v, "a number")),
    }
}

/// vLLM's `top_k`: -1 or 0 is off.
fn top_k(v: Option<&Value>) -> Result<u32> {
    let Some(v) = v.filter(|v| !v.is_null()) else {
        return Ok(0);
    };
    match v.as_i64() {
        Some(-1 | 0) => Ok(0),
        Some(k) if k > 0 => narrow("top_k", k as u64),
        _ => Err(wrong_type(
            "top_k",
            v,
            "a positive integer, or -1 or 0 for off",
        )),
    }
}

/// OpenAI's `logit_bias`: an object from token ids (as strings) to biases;
/// the scheduler checks ids and values.
fn logit_bias(v: Option<&Value>) -> Result<Vec<(u32, f32)>> {
    let Some(v) = v.filter(|v| !v.is_null()) else {
        return Ok(Vec::new());
    };
    let expected = "an object from token ids to numbers";
    let Some(map) = v.as_object() else {
        return Err(wrong_type("logit_bias", v, expected));
    };
    let mut out = Vec::with_capacity(map.len());
    for (token, bias) in map {
        let (Ok(token), Some(bias)) = (token.parse::<u32>(), bias.as_f64()) else {
            return Err(wrong_type("logit_bias", v, expected));
        };
        out.push((token, bias as f32));
    }
    out.sort_by_key(|&(t, _)| t);
    Ok(out)
}

/// A number the scheduler holds in 32 bits, refused rather than truncated
/// when it does not fit (issue 29, point 9).
/// vLLM's `stop_token_ids`: a list of token ids (absent or `null`: none);
/// the scheduler checks them against the vocabulary.
fn stop_token_ids(v: Option<&Value>) -> Result<Vec<u32>> {
    let Some(v) = v.filter(|v| !v.is_null()) else {
        return Ok(Vec::new());
    };
    let expected = "a list of token ids";
    let Some(ids) = v.as_array() else {
        return Err(wrong_type("stop_token_ids", v, expected));
    };
    if ids.len() > MAX_STOP_TOKEN_IDS {
        return Err(ApiError::invalid_param(
            "stop_token_ids",
            format!(
                "stop_token_ids has {} ids; at most {MAX_STOP_TOKEN_IDS}",
                ids.len()
            ),
        ));
    }
    ids.iter()
        .map(|id| match id.as_u64() {
            Some(n) => narrow("stop_token_ids", n),
            None => Err(wrong_type("stop_token_ids", v, expected)),
        })
        .collect()
}

fn narrow(param: &'static str, value: u64) -> Result<u32> {
    u32::try_from(value).map_err(|_| {
        ApiError::invalid_param(
            param,
            format!("{param} is {value}, over its limit of {}", u32::MAX),
        )
    })
}

/// A token-id prompt: every id must fit the scheduler's 32-bit token ids
/// (the scheduler checks them against the vocabulary).
fn token_ids(ids: &[u64]) -> Result<Vec<u32>> {
    ids.iter()
        .enumerate()
        .map(|(i, &id)| {
            u32::try_from(id).map_err(|_| {
                ApiError::invalid_param(
                    "prompt",
                    format!(
                        "prompt token {i} is {id}, over the limit of {} for a token id",
                        u32::MAX
                    ),
                )
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn served() -> Served {
        Served {
            model: "m".into(),
            aliases: vec!["m-alias".into()],
            default_max_tokens: 100,
        }
    }

    fn completion(json: serde_json::Value) -> Result<Generate> {
        served().completion(serde_json::from_value(json).expect("parses"))
    }

    fn chat(json: serde_json::Value) -> Result<Generate> {
        served().chat(serde_json::from_value(json).expect("parses"))
    }

    #[test]
    fn the_kvlease_retain_extension_becomes_a_hint_and_bad_ones_name_their_param() {
        let with = |ext: serde_json::Value| {
            completion(serde_json::json!({"model": "m", "prompt": "hi", "kvlease": ext}))
        };
        let g = with(serde_json::json!({"retain": {"tokens": 64, "priority": 70, "ttl_s": 600}}));
        let want = Retain {
            tokens: 64,
            priority: 70,
            ttl_s: 600,
        };
        assert_eq!(g.map(|g| g.retain), Ok(Some(want)));
        let g = with(serde_json::json!({"retain": {"tokens": 64, "ttl_s": 600}}));
        assert_eq!(g.map(|g| g.retain.map(|r| r.priority)), Ok(Some(0)));
        assert_eq!(with(serde_json::Value::Null).map(|g| g.retain), Ok(None));
        for (ext, param) in [
            ("3", "kvlease"),
            (r#"{"keep": {}}"#, "kvlease"),
            (r#"{"retain": 5}"#, "kvlease.retain"),
            (
                r#"{"retain": {"tokens": 1, "ttl_s": 1, "x": 1}}"#,
                "kvlease.retain",
            ),
            (r#"{"retain": {"ttl_s": 60}}"#, "kvlease.retain.tokens"),
            (
                r#"{"retain": {"tokens": 0, "ttl_s": 60}}"#,
                "kvlease.retain.tokens",
            ),
            (
                r#"{"retain": {"tokens": "8", "ttl_s": 60}}"#,
                "kvlease.retain.tokens",
            ),
            (
                r#"{"retain": {"tokens": 8, "priority": 101, "ttl_s": 60}}"#,
                "kvlease.retain.priority",
            ),
            (r#"{"retain": {"tokens": 8}}"#, "kvlease.retain.ttl_s"),
            (
                r#"{"retain": {"tokens": 8, "ttl_s": 0}}"#,
                "kvlease.retain.ttl_s",
            ),
            (
                r#"{"retain": {"tokens": 8, "ttl_s": 86401}}"#,
                "kvlease.retain.ttl_s",
            ),
        ] {
            let e = with(serde_json::from_str(ext).unwrap()).expect_err("refused");
            assert_eq!((e.status.as_u16(), e.param), (400, Some(param)), "{ext}");
        }
    }

    #[test]
    fn completion_fields_become_one_generation() {
        let g = completion(serde_json::json!({
            "model": "m", "prompt": ["hi"], "max_tokens": 5, "temperature": 0.0,
            "top_p": 0.5, "seed": 7, "stop": "x", "n": 1, "user": "u1",
            "stream": true, "stream_options": {"include_usage": true}, "ignore_eos": true,
        }))
        .unwrap();
        assert_eq!(g.input, Input::Text("hi".into()));
        assert_eq!(
            (g.max_tokens, g.temperature, g.top_p, g.seed),
            (5, 0.0, 0.5, 7)
        );
        assert_eq!(g.stop, vec!["x".to_string()]);
        assert_eq!(g.user.as_deref(), Some("u1"));
        assert!(g.stream && g.include_usage && g.ignore_eos);
        let t = completion(serde_json::json!({"model": "m", "prompt": [1, 2, 3]})).unwrap();
        assert_eq!(t.input, Input::Tokens(vec![1, 2, 3]));
        assert_eq!(t.max_tokens, 16, "OpenAI's completions default");
        assert_eq!(t.temperature, 1.0);
        assert!(!t.ignore_eos, "stops at end of sequence unless asked");
    }

    #[test]
    fn chat_takes_text_parts_and_max_completion_tokens() {
        let g = chat(serde_json::json!({
            "model": "m", "max_completion_tokens": 9, "max_tokens": 3,
            "messages": [
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            ],
        }))
        .unwrap();
        assert_eq!(
            g.input,
            Input::Chat(vec![
                ("system".into(), "be brief".into()),
                ("user".into(), "ab".into())
            ])
        );
        assert_eq!(g.max_tokens, 9);
        let d =
            chat(serde_json::json!({"model": "m", "messages": [{"role": "user", "content": "x"}]}))
                .unwrap();
        assert_eq!(d.max_tokens, 100, "the configured default");
    }

    #[test]
    fn n_choices_reach_the_request_for_completions_and_chat() {
        let c = completion(serde_json::json!({"model": "m", "prompt": "x", "n": 3})).unwrap();
        assert_eq!(c.n, 3);
        let c = chat(serde_json::json!({"model": "m", "n": 16,
            "messages": [{"role": "user", "content": "x"}]}))
        .unwrap();
        assert_eq!(c.n, 16);
        let c = completion(serde_json::json!({"model": "m", "prompt": "x"})).unwrap();
        assert_eq!(c.n, 1, "one choice unless asked");
    }

    #[test]
    fn logprobs_and_echo_are_read_per_endpoint_and_bad_ones_named() {
        let c = |v| completion(v).unwrap();
        let g = c(serde_json::json!({"model": "m", "prompt": "x", "logprobs": 5, "echo": true}));
        assert_eq!((g.logprobs, g.echo), (Some(5), true));
        let g = c(serde_json::json!({"model": "m", "prompt": "x", "logprobs": 0}));
        assert_eq!((g.logprobs, g.echo), (Some(0), false));
        let g = c(serde_json::json!({"model": "m", "prompt": "x", "logprobs": null}));
        assert_eq!(g.logprobs, None);
        let msgs = serde_json::json!([{"role": "user", "content": "x"}]);
        let g = chat(
            serde_json::json!({"model": "m", "messages": msgs, "logprobs": true,
            "top_logprobs": 20}),
        )
        .unwrap();
        assert_eq!(g.logprobs, Some(20));
        let g =
            chat(serde_json::json!({"model": "m", "messages": msgs, "logprobs": true})).unwrap();
        assert_eq!(g.logprobs, Some(0));
        let g =
            chat(serde_json::json!({"model": "m", "messages": msgs, "logprobs": false})).unwrap();
        assert_eq!(g.logprobs, None);
        for (body, param) in [
            (
                serde_json::json!({"model": "m", "messages": msgs, "logprobs": true,
                    "top_logprobs": 21}),
                "top_logprobs",
            ),
            (
                serde_json::json!({"model": "m", "messages": msgs, "logprobs": true,
                    "top_logprobs": -1}),
                "top_logprobs",
            ),
            (
                serde_json::json!({"model": "m", "messages": msgs, "top_logprobs": 2}),
                "top_logprobs",
            ),
            (
                serde_json::json!({"model": "m", "messages": msgs, "logprobs": 3}),
                "logprobs",
            ),
        ] {
            let e = chat(body).expect_err(param);
            assert_eq!((e.status.as_u16(), e.param), (400, Some(param)), "{e:?}");
        }
    }

    #[test]
    fn what_kvlease_cannot_serve_is_refused_naming_the_field() {
        let cases = [
            (
                serde_json::json!({"model": "m", "prompt": "x", "n": 17}),
                "n",
            ),
            (
                serde_json::json!({"model": "m", "prompt": "x", "n": 0}),
                "n",
            ),
            (
                serde_json::json!({"model": "m", "prompt": ["a", "b"]}),
                "prompt",
            ),
            (
                serde_json::json!({"model": "m", "prompt": "x", "logprobs": 6}),
                "logprobs",
            ),
            (
                serde_json::json!({"model": "m", "prompt": "x", "logprobs": -1}),
                "logprobs",
            ),
            (
                serde_json::json!({"model": "m", "prompt": "x", "logprobs": true}),
                "logprobs",
            ),
            (
                serde_json::json!({"model": "m", "prompt": "x", "best_of": 3}),
                "best_of",
            ),
            (
                serde_json::json!({"model": "m", "prompt": "x", "user": "u".repeat(300)}),
                "user",
            ),
        ];
        for (json, param) in cases {
            let e = completion(json).expect_err(param);
            assert_eq!(e.status.as_u16(), 400, "{e:?}");
            assert_eq!(e.param, Some(param), "{e:?}");
        }
        let e = chat(serde_json::json!({"model": "m", "messages": []})).unwrap_err();
        assert_eq!(e.param, Some("messages"));
        let e = chat(serde_json::json!({"model": "m", "messages": [
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}))
        .unwrap_err();
        assert!(e.message.contains("image_url"), "{e:?}");
        completion(serde_json::json!({"model": "m-alias", "prompt": "x"}))
            .expect("an alias is served");
        assert_eq!(served().names().collect::<Vec<_>>(), ["m", "m-alias"]);
        let e = completion(serde_json::json!({"model": "other", "prompt": "x"})).unwrap_err();
        assert_eq!(e.status.as_u16(), 404);
        assert_eq!(e.code.as_deref(), Some("model_not_found"));
    }

    #[test]
    fn use_beam_search_sets_the_beam_width_and_refuses_what_beams_cannot_serve() {
        let c = completion(serde_json::json!({"model": "m", "prompt": "x",
            "use_beam_search": true, "best_of": 4, "n": 2}))
        .unwrap();
        assert_eq!((c.beam_width, c.n), (4, 2));
        assert_eq!(c.temperature, 0.0, "beams rank the raw distribution");
        let c = chat(
            serde_json::json!({"model": "m", "use_beam_search": true, "n": 3,
            "messages": [{"role": "user", "content": "hi"}]}),
        )
        .unwrap();
        assert_eq!(c.beam_width, 3, "n is the width without best_of");
        for off in [json!(false), Value::Null] {
            let c = completion(serde_json::json!({"model": "m", "prompt": "x",
                "use_beam_search": off, "best_of": 1}))
            .unwrap();
            assert_eq!(c.beam_width, 1);
        }
        let cases = [
            (json!({"use_beam_search": true, "best_of": 11}), "best_of"),
            (
                json!({"use_beam_search": true, "best_of": 2, "n": 3}),
                "best_of",
            ),
            (json!({"use_beam_search": false, "best_of": 2}), "best_of"),
            (json!({"use_beam_search": true, "n": 12}), "n"),
            (json!({"use_beam_search": "yes"}), "use_beam_search"),
            (
                json!({"use_beam_search": true, "best_of": 2, "stream": true}),
                "stream",
            ),
        ];
        for (extra, param) in cases {
            let mut body = json!({"model": "m", "prompt": "x"});
            for (k, v) in extra.as_object().unwrap() {
                body[k] = v.clone();
            }
            let e = completion(body).expect_err(param);
            assert_eq!(e.status.as_u16(), 400, "{e:?}");
            assert_eq!(e.param, Some(param), "{e:?}");
        }
    }

    #[test]
    fn documented_fields_kvlease_does_not_serve_are_refused_naming_them() {
        let refused = [
            ("response_format", json!({"type": "xml"})),
            ("tool_choice", json!("auto")),
            ("functions", json!([{"name": "f"}])),
            ("function_call", json!("auto")),
            ("modalities", json!(["text", "audio"])),
            ("audio", json!({"voice": "alloy", "format": "wav"})),
            ("prediction", json!({"type": "content", "content": "x"})),
            ("reasoning_effort", json!("low")),
            ("verbosity", json!("low")),
            ("web_search_options", json!({})),
            ("store", json!(true)),
            ("metadata", json!({"k": "v"})),
            ("service_tier", json!("flex")),
            // a sampling field of the wrong type is refused naming it
            ("frequency_penalty", json!("high")),
            ("presence_penalty", json!([1])),
            ("repetition_penalty", json!(true)),
            ("min_p", json!("0.1")),
            ("top_k", json!(-2)),
            ("top_k", json!(1.5)),
            ("min_tokens", json!(-1)),
            ("logit_bias", json!([1, 2])),
            ("logit_bias", json!({"token": 1})),
            ("logit_bias", json!({"42": "ban"})),
            ("stop_token_ids", json!(2)),
            ("stop_token_ids", json!([1, "2"])),
            ("stop_token_ids", json!([-1])),
            ("stop_token_ids", json!([4_294_967_296u64])),
            ("stop_token_ids", json!(vec![1; 65])),
        ];
        for (field, value) in refused {
            for endpoint in ["completions", "chat"] {
                let mut body = json!({"model": "m", "prompt": "x",
                    "messages": [{"role": "user", "content": "x"}]});
                body[field] = value.clone();
                let r = if endpoint == "chat" {
                    chat(body)
                } else {
                    completion(body)
                };
                let e = r.expect_err(field);
                assert_eq!(
                    (e.status.as_u16(), e.param),
                    (400, Some(field)),
                    "{endpoint}: {e:?}"
                );
                assert!(e.message.contains(field), "{e:?}");
            }
        }
        // absent, null or the no-op value: served
        let no_ops = json!({"model": "m", "prompt": "x", "frequency_penalty": 0,
            "presence_penalty": 0.0, "repetition_penalty": 1, "logit_bias": {},
            "response_format": {"type": "text"}, "min_tokens": 0, "top_k": -1, "min_p": 0,
            "use_beam_search": false, "tool_choice": "none", "functions": [],
            "function_call": "none", "modalities": ["text"], "audio": null, "store": false,
            "metadata": {}, "service_tier": "auto", "n": 1});
        completion(no_ops).expect("no-op values are served");
    }

    /// Issue 25, point 5: the fields of OpenAI's completions and chat
    /// create that the gateway used to drop without a word.
    #[test]
    fn newer_documented_fields_are_served_or_refused_naming_them() {
        let body = |field: &str, value: Value| {
            let mut body = json!({"model": "m", "prompt": "x",
                "messages": [{"role": "user", "content": "x"}]});
            body[field] = value;
            body
        };
        let refused = [
            (
                "prompt_cache_retention",
                json!("24h"),
                "prompt_cache_retention",
            ),
            ("parallel_tool_calls", json!("yes"), "parallel_tool_calls"),
            (
                "stream_options",
                json!({"include_obfuscation": true}),
                "stream_options.include_obfuscation",
            ),
            ("user", json!("u".repeat(257)), "user"),
            (
                "safety_identifier",
                json!("s".repeat(257)),
                "safety_identifier",
            ),
            (
                "prompt_cache_key",
                json!("k".repeat(257)),
                "prompt_cache_key",
            ),
        ];
        for (field, value, param) in refused {
            for e in [
                completion(body(field, value.clone())).expect_err(field),
                chat(body(field, value.clone())).expect_err(field),
            ] {
                assert_eq!((e.status.as_u16(), e.param), (400, Some(param)), "{e:?}");
                assert!(e.message.contains(param), "{e:?}");
            }
        }
        let served = [
            ("prompt_cache_retention", json!("in-memory")),
            ("parallel_tool_calls", json!(false)),
            ("parallel_tool_calls", json!(true)),
            ("stream_options", json!({"include_obfuscation": false})),
            ("safety_identifier", json!("s".repeat(256))),
            ("prompt_cache_key", json!("conversation-1")),
        ];
        for (field, value) in served {
            completion(body(field, value.clone())).expect(field);
            chat(body(field, value)).expect(field);
        }
        // a message's fields besides role and content never reach the
        // template: refused naming the message, unless null or empty (as
        // clients echo an assistant message back)
        for (field, value) in [
            ("name", json!("alice")),
            ("tool_calls", json!([{"id": "c1", "type": "function"}])),
            ("tool_call_id", json!("c1")),
            ("function_call", json!({"name": "f", "arguments": "{}"})),
            ("audio", json!({"id": "a1"})),
            ("refusal", json!("no")),
        ] {
            let mut message = json!({"role": "assistant", "content": "x"});
            message[field] = value;
            let e = chat(
                json!({"model": "m", "messages": [{"role": "user", "content": "x"}, message]}),
            )
            .expect_err(field);
            assert_eq!(
                (e.status.as_u16(), e.param),
                (400, Some("messages")),
                "{e:?}"
            );
            assert!(e.message.contains(&format!("message 1: {field} ")), "{e:?}");
        }
        // a content part's type is echoed clipped (issue 29, point 9)
        let huge = "t".repeat(1 << 20);
        let e = chat(json!({"model": "m", "messages": [
            {"role": "user", "content": [{"type": huge, "text": "x"}]}]}))
        .expect_err("a content part of an unknown type");
        assert_eq!((e.status.as_u16(), e.param), (400, Some("messages")));
        assert!(e.message.len() < 1024, "a {} byte message", e.message.len());
        assert!(e.message.contains("(1048576 bytes)"), "{}", e.message);
        chat(
            json!({"model": "m", "messages": [{"role": "assistant", "content": "x",
            "name": "", "tool_calls": [], "refusal": null, "audio": null,
            "function_call": null, "tool_call_id": null}]}),
        )
        .expect("null and empty message fields are served");
    }

    #[test]
    fn response_format_and_the_grammar_extension_reach_the_generation() {
        use crate::structured::Grammar;
        let body = json!({"model": "m", "messages": [{"role": "user", "content": "x"}],
            "response_format": {"type": "json_object"}});
        assert_eq!(chat(body).unwrap().grammar, Some(Grammar::JsonObject));
        let body = json!({"model": "m", "prompt": "x",
            "kvlease": {"grammar": {"regex": "[ab]+"}, "retain": null}});
        assert_eq!(
            completion(body).unwrap().grammar,
            Some(Grammar::Regex("[ab]+".into()))
        );
        let plain = completion(json!({"model": "m", "prompt": "x"})).unwrap();
        assert_eq!(plain.grammar, None);
    }

    #[test]
    fn sampling_fields_and_vllm_extensions_reach_the_generation() {
        for endpoint in ["completions", "chat"] {
            let body = json!({"model": "m", "prompt": "x",
                "messages": [{"role": "user", "content": "x"}],
                "frequency_penalty": 0.5, "presence_penalty": -1, "repetition_penalty": 1.2,
                "logit_bias": {"42": -100, "7": 2.5}, "min_tokens": 4, "top_k": 5,
                "min_p": 0.1, "stop_token_ids": [9, 3]});
            let g = if endpoint == "chat" {
                chat(body)
            } else {
                completion(body)
            }
            .expect(endpoint);
            assert_eq!(
                (
                    g.frequency_penalty,
                    g.presence_penalty,
                    g.repetition_penalty
                ),
                (0.5, -1.0, 1.2)
            );
            assert_eq!(g.logit_bias, [(7, 2.5), (42, -100.0)]);
            assert_eq!(g.stop_token_ids, [9, 3]);
            assert_eq!((g.min_tokens, g.top_k, g.min_p), (4, 5, 0.1));
        }
        let off = completion(json!({"model": "m", "prompt": "x", "top_k": -1,
            "logit_bias": null}))
        .expect("off");
        assert_eq!(
            (off.top_k, off.min_tokens, off.repetition_penalty),
            (0, 0, 0.0)
        );
        assert!(off.logit_bias.is_empty());
    }

    #[test]
    fn numbers_over_32_bits_are_refused_naming_the_field_not_truncated() {
        let over = u64::from(u32::MAX) + 6;
        let cases = [
            (
                completion(serde_json::json!({"model": "m", "prompt": "x", "max_tokens": over})),
                "max_tokens",
                "max_tokens is 4294967301, over its limit of 4294967295",
            ),
            (
                chat(
                    serde_json::json!({"model": "m", "max_completion_tokens": over,
                    "messages": [{"role": "user", "content": "x"}]}),
                ),
                "max_completion_tokens",
                "max_completion_tokens is 4294967301, over its limit of 4294967295",
            ),
            (
                completion(serde_json::json!({"model": "m", "prompt": [1, 2, over]})),
                "prompt",
                "prompt token 2 is 4294967301, over the limit of 4294967295 for a token id",
            ),
            (
                completion(serde_json::json!({"model": "m", "prompt": [[over]]})),
                "prompt",
                "prompt token 0 is 4294967301",
            ),
            (
                completion(serde_json::json!({"model": "m", "prompt": "x", "n": over})),
                "n",
                "n must be 1 to 16 choices, got 4294967301",
            ),
        ];
        for (result, param, message) in cases {
            let e = result.expect_err(param);
            assert_eq!((e.status.as_u16(), e.param), (400, Some(param)), "{e:?}");
            assert!(e.message.contains(message), "{e:?}");
        }
        let top = completion(
            serde_json::json!({"model": "m", "prompt": [u32::MAX], "max_tokens": u32::MAX}),
        )
        .unwrap();
        assert_eq!(top.input, Input::Tokens(vec![u32::MAX]));
        assert_eq!(top.max_tokens, u32::MAX);
    }
}
