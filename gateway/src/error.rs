//! Errors as OpenAI's JSON error shape, with the HTTP status a client
//! library acts on: 400 for what the request got wrong (never retried), 429
//! for transient refusals (retried with backoff), 503 / 504 / 502 for the
//! cluster's own trouble. Nothing maps to 500.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::Serialize;

pub type Result<T, E = ApiError> = std::result::Result<T, E>;

/// One error answer: `{"error": {"message", "type", "param", "code"}}`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{status} {kind}: {message}")]
pub struct ApiError {
    pub status: StatusCode,
    /// OpenAI's `type`: `invalid_request_error`, `rate_limit_error`,
    /// `server_error`, ...
    pub kind: &'static str,
    /// A machine-readable code: the reject reason in lower case, or
    /// `model_not_found`, ...
    pub code: Option<String>,
    /// The request field at fault, when one is.
    pub param: Option<&'static str>,
    pub message: String,
}

#[derive(Serialize)]
struct Body<'a> {
    error: Detail<'a>,
}

/// The `error` object, as the body of an error answer and of an SSE error
/// event.
#[derive(Serialize)]
pub(crate) struct Detail<'a> {
    message: &'a str,
    #[serde(rename = "type")]
    kind: &'a str,
    param: Option<&'a str>,
    code: Option<&'a str>,
}

/// What of a caller's input an error message may echo: its first
/// [`ECHO_CHARS`] characters. A message that echoed a 1 MB field whole pushed
/// replies over the message cap (issue 29, point 9).
pub fn clip(input: &str) -> String {
    kvlease_runtime::echo::clip(input, ECHO_CHARS)
}

/// How many characters of an input [`clip`] keeps.
pub const ECHO_CHARS: usize = 64;

/// A message written by someone else that may quote the caller's input
/// whole (serde's "invalid type: string \"...\"" does), cut to its first
/// [`MESSAGE_CHARS`] characters and its last [`ECHO_CHARS`] (where serde says
/// the line and column).
pub fn clip_message(message: &str) -> String {
    let chars = message.chars().count();
    if chars <= MESSAGE_CHARS + ECHO_CHARS {
        return message.to_string();
    }
    let head: String = message.chars().take(MESSAGE_CHARS).collect();
    let tail: String = message.chars().skip(chars - ECHO_CHARS).collect();
    format!("{head}... ({} bytes) ...{tail}", message.len())
}

/// How many leading characters of a message [`clip_message`] keeps.
pub const MESSAGE_CHARS: usize = 256;

impl ApiError {
    fn new(status: StatusCode, kind: &'static str, message: impl Into<String>) -> Self {
        Self {
            status,
            kind,
            code: None,
            param: None,
            message: message.into(),
        }
    }

    fn code(mut self, code: impl Into<String>) -> Self {
        self.code = Some(code.into());
        self
    }

    /// 408: the request body did not arrive in time.
    pub fn body_timeout(message: impl Into<String>) -> Self {
        Self::new(
            StatusCode::REQUEST_TIMEOUT,
            "invalid_request_error",
            message,
        )
        .code("timeout")
    }

    /// 413 for a body over the limit, 400 for one that could not be read.
    pub fn body_unreadable(message: String) -> Self {
        if message.contains("length limit") {
            Self::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                "invalid_request_error",
                message,
            )
        } else {
            Self::new(StatusCode::BAD_REQUEST, "invalid_request_error", message)
        }
    }

    /// 401: no valid bearer token.
    pub fn unauthenticated(message: impl Into<String>) -> Self {
        Self::new(StatusCode::UNAUTHORIZED, "authentication_error", message).code("invalid_api_key")
    }

    /// 403: a principal without the role the route needs.
    pub fn forbidden(message: impl Into<String>) -> Self {
        Self::new(StatusCode::FORBIDDEN, "permission_error", message)
    }

    /// 400: the request is malformed or asks for what is not offered.
    pub fn invalid(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "invalid_request_error", message)
    }

    /// 400 naming the field at fault.
    pub fn invalid_param(param: &'static str, message: impl Into<String>) -> Self {
        Self {
            param: Some(param),
            ..Self::invalid(message)
        }
    }

    /// 404: a model this server does not serve.
    pub fn model_not_found(asked: &str, served: &str) -> Self {
        Self {
            param: Some("model"),
            ..Self::new(
                StatusCode::NOT_FOUND,
                "invalid_request_error",
                format!(
                    "the model {} does not exist; this server serves {served:?}",
                    clip(asked)
                ),
            )
            .code("model_not_found")
        }
    }

    /// The cache refused the request's KV blocks. `transient` reasons are
    /// 429 (retry later); one that can never succeed is 400, so that client
    /// libraries do not retry it.
    pub fn rejected(reason: &str, transient: bool, message: impl Into<String>) -> Self {
        let code = reason.to_ascii_lowercase();
        if transient {
            Self::new(StatusCode::TOO_MANY_REQUESTS, "rate_limit_error", message).code(code)
        } else {
            Self::new(StatusCode::BAD_REQUEST, "invalid_request_error", message).code(code)
        }
    }

    /// 503: the cluster cannot serve now (starting, shutting down, the
    /// cache unreachable).
    pub fn unavailable(message: impl Into<String>) -> Self {
        Self::new(StatusCode::SERVICE_UNAVAILABLE, "server_error", message)
            .code("service_unavailable")
    }

    /// 502: the cluster failed while serving the request (a worker error,
    /// a broken stream).
    pub fn upstream(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_GATEWAY, "server_error", message).code("upstream_error")
    }

    /// 504: the request ran past its deadline.
    pub fn timeout(message: impl Into<String>) -> Self {
        Self::new(StatusCode::GATEWAY_TIMEOUT, "server_error", message).code("timeout")
    }

    /// The `error` object of this error.
    pub(crate) fn detail(&self) -> Detail<'_> {
        Detail {
            message: &self.message,
            kind: self.kind,
            param: self.param,
            code: self.code.as_deref(),
        }
    }

    /// `{"error": {...}}` as JSON text.
    pub(crate) fn to_json(&self) -> String {
        serde_json::to_string(&Body {
            error: self.detail(),
        })
        .unwrap_or_else(|_| {
            r#"{"error":{"message":"unprintable error","type":"server_error"}}"#.into()
        })
    }
}

/// A gRPC status from the scheduler: its code decides the HTTP status, its
/// message (the scheduler's validation names what is wrong) is kept.
impl From<tonic::Status> for ApiError {
    fn from(s: tonic::Status) -> Self {
        use tonic::Code;
        let message = s.message().to_string();
        match s.code() {
            Code::InvalidArgument => {
                let param = s
                    .metadata()
                    .get(kvlease_proto::INVALID_FIELD_METADATA)
                    .and_then(|v| v.to_str().ok())
                    .and_then(openai_param);
                Self {
                    param,
                    ..Self::invalid(message)
                }
            }
            Code::FailedPrecondition | Code::OutOfRange => Self::invalid(message),
            Code::ResourceExhausted => {
                Self::new(StatusCode::TOO_MANY_REQUESTS, "rate_limit_error", message)
                    .code("resource_exhausted")
            }
            Code::Unauthenticated => {
                Self::new(StatusCode::UNAUTHORIZED, "authentication_error", message)
            }
            Code::PermissionDenied => Self::new(StatusCode::FORBIDDEN, "permission_error", message),
            Code::NotFound => Self::new(StatusCode::NOT_FOUND, "invalid_request_error", message),
            Code::DeadlineExceeded => Self::timeout(message),
            Code::Unavailable | Code::Cancelled | Code::Aborted => {
                Self::unavailable(format!("the scheduler is unavailable: {message}"))
            }
            code => Self::upstream(format!("the scheduler failed ({code:?}): {message}")),
        }
    }
}

/// The OpenAI request field that a scheduler `GenerateRequest` field came
/// from (see [`crate::convert::generate_request`]); `None` for a field the
/// gateway sets itself.
fn openai_param(field: &str) -> Option<&'static str> {
    Some(match field {
        "text" | "tokens" => "prompt",
        "messages" => "messages",
        "max_tokens" => "max_tokens",
        "temperature" => "temperature",
        "top_p" => "top_p",
        "top_k" => "top_k",
        "min_p" => "min_p",
        "frequency_penalty" => "frequency_penalty",
        "presence_penalty" => "presence_penalty",
        "repetition_penalty" => "repetition_penalty",
        "logit_bias" => "logit_bias",
        "min_tokens" => "min_tokens",
        "stop" => "stop",
        "retain.tokens" => "kvlease.retain.tokens",
        "retain.priority" => "kvlease.retain.priority",
        "retain.ttl_s" => "kvlease.retain.ttl_s",
        // a hint with the prompt's logprobs (echo and logprobs)
        "retain" => "kvlease.retain",
        // the gateway checks its own shapes first (0 to 5, 0 to 20)
        "logprobs.top" => "logprobs",
        "ignore_eos" => "ignore_eos",
        "stop_tokens" => "stop_token_ids",
        // JSON constraints come only from response_format
        "grammar" | "grammar.json_schema" => "response_format",
        "grammar.lark" => "kvlease.grammar.lark",
        "grammar.regex" => "kvlease.grammar.regex",
        _ => return None,
    })
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut r = (self.status, self.to_json()).into_response();
        r.headers_mut().insert(
            axum::http::header::CONTENT_TYPE,
            axum::http::HeaderValue::from_static("application/json"),
        );
        r
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scheduler_codes_map_to_http_statuses_and_never_500() {
        use tonic::Code::*;
        let cases = [
            (InvalidArgument, 400),
            (FailedPrecondition, 400),
            (ResourceExhausted, 429),
            (Unavailable, 503),
            (DeadlineExceeded, 504),
            (Internal, 502),
            (Unknown, 502),
        ];
        for (code, http) in cases {
            let e = ApiError::from(tonic::Status::new(code, "why"));
            assert_eq!(e.status.as_u16(), http, "{code:?}");
            assert!(e.message.contains("why"), "{e:?}");
        }
    }

    #[test]
    fn a_scheduler_refusal_naming_its_field_names_the_openai_param() {
        let refused = |field: &'static str| {
            let mut s = tonic::Status::invalid_argument("bad");
            s.metadata_mut().insert(
                kvlease_proto::INVALID_FIELD_METADATA,
                tonic::metadata::MetadataValue::from_static(field),
            );
            ApiError::from(s)
        };
        for (field, param) in [
            ("tokens", "prompt"),
            ("text", "prompt"),
            ("messages", "messages"),
            ("max_tokens", "max_tokens"),
            ("temperature", "temperature"),
            ("top_p", "top_p"),
            ("min_p", "min_p"),
            ("frequency_penalty", "frequency_penalty"),
            ("presence_penalty", "presence_penalty"),
            ("repetition_penalty", "repetition_penalty"),
            ("logit_bias", "logit_bias"),
            ("min_tokens", "min_tokens"),
            ("stop", "stop"),
            ("retain.tokens", "kvlease.retain.tokens"),
            ("grammar.json_schema", "response_format"),
            ("grammar.lark", "kvlease.grammar.lark"),
            ("grammar.regex", "kvlease.grammar.regex"),
            ("ignore_eos", "ignore_eos"),
            ("stop_tokens", "stop_token_ids"),
        ] {
            let e = refused(field);
            assert_eq!((e.status.as_u16(), e.param), (400, Some(param)), "{e:?}");
            let v: serde_json::Value = serde_json::from_str(&e.to_json()).unwrap();
            assert_eq!(v["error"]["param"], param);
        }
        assert_eq!(refused("request_id").param, None, "the gateway's own field");
        assert_eq!(
            ApiError::from(tonic::Status::invalid_argument("bad")).param,
            None
        );
    }

    #[test]
    fn rejects_are_429_when_transient_and_400_when_never_retryable() {
        let t = ApiError::rejected("POOL_EXHAUSTED", true, "m");
        assert_eq!(t.status, StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(t.code.as_deref(), Some("pool_exhausted"));
        let n = ApiError::rejected("EXCEEDS_CAPACITY", false, "m");
        assert_eq!(n.status, StatusCode::BAD_REQUEST);
        let v: serde_json::Value = serde_json::from_str(&n.to_json()).unwrap();
        assert_eq!(v["error"]["code"], "exceeds_capacity");
        assert_eq!(v["error"]["type"], "invalid_request_error");
        assert_eq!(v["error"]["message"], "m");
    }
}
