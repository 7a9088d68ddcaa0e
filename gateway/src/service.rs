//! The HTTP routes: each handler parses the body, checks it
//! ([`crate::request`]), calls the scheduler's `Generate` over gRPC and
//! answers with one JSON body or a server-sent event stream.
//!
//! A streaming request waits for the scheduler's first message before it
//! answers, so that a request refused at admission gets its HTTP status
//! (429 / 400) rather than a 200 and an error event; a refusal after the
//! first token ends the stream with an error event and `data: [DONE]`.
//! Dropping the response (the client went away) drops the gRPC stream,
//! which cancels the request in the scheduler.
//!
//! With a token file (`--token-file`) every `/v1` route takes
//! `Authorization: Bearer TOKEN` of a principal with role `client` (401
//! without a known token, 403 without the role), and that principal is the
//! request's tenant: its name salts prefix reuse, so one principal cannot
//! probe another's cached prefixes. OpenAI's `user` is only a label
//! (issue 29, findings 4 and 5).

use std::convert::Infallible;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{Path, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use futures::{Stream, StreamExt};
use kvlease_auth::Role;
use kvlease_auth::tokens::Tokens;
use kvlease_proto::v1::scheduler_client::SchedulerClient;
use serde::de::DeserializeOwned;
use tonic::transport::Channel;
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;

use crate::convert::{self, End, Piece};
use crate::error::{ApiError, Result};
use crate::logprobs::{self, TokenLp};
use crate::openai::{
    AssistantMessage, ChatChoice, ChatChunk, ChatCompletion, ChunkChoice, Completion,
    CompletionChoice, Delta, Model, ModelList, Usage,
};
use crate::request::{Generate, Served};
use serde_json::Value;

/// What every handler shares: the scheduler channel and what is served.
#[derive(Debug, Clone)]
pub struct Gateway {
    channel: Channel,
    served: Served,
    /// The bearer tokens callers must bring; anyone may call without.
    tokens: Option<Arc<Tokens>>,
}

impl Gateway {
    /// A gateway open to any caller, all of one tenant.
    pub fn new(channel: Channel, served: Served) -> Self {
        Self {
            channel,
            served,
            tokens: None,
        }
    }

    /// The same, taking only callers with a bearer token of `tokens`.
    pub fn with_tokens(self, tokens: Option<Tokens>) -> Self {
        Self {
            tokens: tokens.map(Arc::new),
            ..self
        }
    }

    /// The tenant of a request with `headers`: the name of its bearer
    /// token's principal, or empty (one tenant) when the gateway takes no
    /// tokens; the 401/403 when it brings no valid token of a client.
    fn tenant(&self, headers: &HeaderMap) -> Result<String> {
        let Some(tokens) = &self.tokens else {
            return Ok(String::new());
        };
        let token = headers
            .get(header::AUTHORIZATION)
            .ok_or_else(|| ApiError::unauthenticated("no `Authorization: Bearer TOKEN` header"))?
            .to_str()
            .ok()
            .and_then(|v| v.strip_prefix("Bearer "))
            .ok_or_else(|| ApiError::unauthenticated("authorization is not `Bearer TOKEN`"))?;
        let principal = tokens
            .get(token.trim())
            .ok_or_else(|| ApiError::unauthenticated("unknown bearer token"))?;
        if !principal.has(Role::Client) {
            return Err(ApiError::forbidden(format!(
                "principal {} has roles {}; generating needs role client",
                principal.name(),
                principal.roles()
            )));
        }
        Ok(principal.name().to_string())
    }

    /// The routes.
    pub fn router(self) -> Router {
        Router::new()
            .route("/health", get(health))
            .route("/v1/models", get(models))
            .route("/v1/models/{model}", get(model))
            .route("/v1/completions", post(completions))
            .route("/v1/chat/completions", post(chat_completions))
            .fallback(not_found)
            .with_state(self)
    }
}

// === routes ===

impl Gateway {
    /// The 503 to answer with while the scheduler is unreachable or not
    /// serving: a model is listed only while it can be served, so that a
    /// client (or a load balancer) probing `/v1/models` does not send
    /// requests that would all fail.
    async fn scheduler_serving(&self) -> Result<()> {
        let mut client = HealthClient::new(self.channel.clone());
        let check = client.check(HealthCheckRequest {
            service: String::new(),
        });
        match check.await.map(|r| r.into_inner().status()) {
            Ok(ServingStatus::Serving) => Ok(()),
            Ok(other) => Err(ApiError::unavailable(format!(
                "the scheduler is not serving: {}",
                other.as_str_name()
            ))),
            Err(status) => Err(ApiError::unavailable(format!(
                "the scheduler's health check failed: {}",
                status.message()
            ))),
        }
    }
}

async fn health(State(g): State<Gateway>) -> Response {
    match g.scheduler_serving().await {
        Ok(()) => json_response(StatusCode::OK, r#"{"status":"ok"}"#.into()),
        Err(e) => e.into_response(),
    }
}

fn model_entry(id: &str) -> Model {
    Model {
        id: id.to_string(),
        object: "model",
        created: 0,
        owned_by: "kvlease",
    }
}

async fn models(State(g): State<Gateway>, headers: HeaderMap) -> Response {
    if let Err(e) = g.tenant(&headers) {
        return e.into_response();
    }
    if let Err(e) = g.scheduler_serving().await {
        return e.into_response();
    }
    let list = ModelList {
        object: "list",
        data: g.served.names().map(model_entry).collect(),
    };
    json(StatusCode::OK, &list)
}

async fn model(State(g): State<Gateway>, headers: HeaderMap, Path(id): Path<String>) -> Response {
    if let Err(e) = g.tenant(&headers) {
        return e.into_response();
    }
    if !g.served.serves(&id) {
        return ApiError::model_not_found(&id, &g.served.model).into_response();
    }
    match g.scheduler_serving().await {
        Ok(()) => json(StatusCode::OK, &model_entry(&id)),
        Err(e) => e.into_response(),
    }
}

async fn not_found() -> Response {
    ApiError {
        status: StatusCode::NOT_FOUND,
        kind: "invalid_request_error",
        code: Some("not_found".into()),
        param: None,
        message: "no such route: kvlease serves /v1/completions, /v1/chat/completions, /v1/models and /health".into(),
    }
    .into_response()
}

async fn completions(State(g): State<Gateway>, headers: HeaderMap, body: Bytes) -> Response {
    g.answer(Kind::Completion, &headers, &body).await
}

async fn chat_completions(State(g): State<Gateway>, headers: HeaderMap, body: Bytes) -> Response {
    g.answer(Kind::Chat, &headers, &body).await
}

fn parse<T: DeserializeOwned>(body: &[u8]) -> Result<T> {
    serde_json::from_slice(body).map_err(|e| {
        ApiError::invalid(format!(
            "invalid request body: {}",
            crate::error::clip_message(&e.to_string())
        ))
    })
}

// === generation ===

/// Which endpoint: the shapes of its answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Completion,
    Chat,
}

/// Usage figures gathered from the pieces.
#[derive(Debug, Default)]
struct Tally {
    prompt_tokens: u32,
    completion_tokens: u32,
    cached_tokens: u32,
    /// Whether the request gave a retention hint, and what the cache kept.
    hinted: bool,
    retained_tokens: u32,
}

impl Tally {
    fn add(&mut self, p: &Piece) {
        self.prompt_tokens = self.prompt_tokens.max(p.prompt_tokens);
        self.cached_tokens = self.cached_tokens.max(p.cached_tokens);
        self.retained_tokens = self.retained_tokens.max(p.retained_tokens);
        self.completion_tokens = self.completion_tokens.saturating_add(p.tokens);
    }

    fn new(hinted: bool) -> Self {
        Self {
            hinted,
            ..Self::default()
        }
    }

    fn usage(&self) -> Usage {
        let mut u = Usage::new(
            self.prompt_tokens,
            self.completion_tokens,
            self.cached_tokens,
        );
        u.prompt_tokens_details.kvlease_retained_tokens =
            self.hinted.then_some(self.retained_tokens);
        u
    }
}

/// Ids and names of one answer.
#[derive(Debug, Clone)]
struct Answer {
    kind: Kind,
    id: String,
    created: u64,
    model: String,
    /// Whether the request asked for logprobs.
    logprobs: bool,
}

impl Gateway {
    /// A generation endpoint's call: the caller's tenant, then the body
    /// parsed and checked as `kind`'s request, then the generation.
    async fn answer(&self, kind: Kind, headers: &HeaderMap, body: &[u8]) -> Response {
        let tenant = match self.tenant(headers) {
            Ok(t) => t,
            Err(e) => return e.into_response(),
        };
        let request = match kind {
            Kind::Completion => parse(body).and_then(|r| self.served.completion(r)),
            Kind::Chat => parse(body).and_then(|r| self.served.chat(r)),
        };
        match request {
            Ok(r) => self.generate(kind, r, &tenant).await,
            Err(e) => e.into_response(),
        }
    }

    async fn generate(&self, kind: Kind, g: Generate, tenant: &str) -> Response {
        let answer = Answer {
            kind,
            id: format!(
                "{}-{:016x}",
                match kind {
                    Kind::Completion => "cmpl",
                    Kind::Chat => "chatcmpl",
                },
                rand::random::<u64>()
            ),
            created: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
            model: self.served.model.clone(),
            logprobs: g.logprobs.is_some(),
        };
        let mut client = SchedulerClient::new(self.channel.clone());
        let stream = match client
            .generate(convert::generate_request(&g, &answer.id, tenant))
            .await
        {
            Ok(r) => r.into_inner(),
            Err(status) => return ApiError::from(status).into_response(),
        };
        let mut pieces = Box::pin(convert::pieces(stream, g.n));
        // a refusal before the first token gets its own HTTP status
        let Some(first) = pieces.next().await else {
            return ApiError::upstream("the scheduler sent no answer").into_response();
        };
        if let Some(End::Failed(e)) = first.end {
            return e.into_response();
        }
        if g.stream {
            let tally = Tally::new(g.retain.is_some());
            let events = sse(answer, g.include_usage, tally, g.n, first, pieces);
            let mut r = Response::new(Body::from_stream(events));
            let h = r.headers_mut();
            h.insert(
                header::CONTENT_TYPE,
                HeaderValue::from_static("text/event-stream"),
            );
            h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
            r
        } else {
            match whole(Tally::new(g.retain.is_some()), g.n, first, pieces).await {
                Ok((choices, tally)) => {
                    let choices = choices
                        .into_iter()
                        .map(|c| {
                            let logprobs = answer.logprobs_value(&c.logprobs, &mut Vec::new());
                            (c.text, logprobs, c.finish)
                        })
                        .collect();
                    answer.whole(choices, tally.usage())
                }
                Err(e) => e.into_response(),
            }
        }
    }
}

/// Reads every piece of `n` choices: each choice's text (an echoed
/// prompt's first), its tokens' logprobs and how it ended, in index order,
/// and the usage (the prompt counted once); or the error (any choice
/// failing fails the request).
async fn whole(
    mut tally: Tally,
    n: u32,
    first: Piece,
    mut rest: impl Stream<Item = Piece> + Unpin,
) -> Result<(Vec<WholeChoice>, Tally)> {
    let mut choices: Vec<(WholeChoice, bool)> = (0..n.max(1))
        .map(|_| (WholeChoice::default(), false))
        .collect();
    let mut echo = Echo::new(n);
    let mut p = first;
    loop {
        tally.add(&p);
        let (t, l) = echo.parts(&p);
        let Some((choice, ended)) = choices.get_mut(p.index as usize) else {
            return Err(ApiError::upstream(format!(
                "the scheduler answered choice {} of {n}",
                p.index
            )));
        };
        choice.text.push_str(&t);
        choice.logprobs.extend(l);
        match p.end {
            Some(End::Failed(e)) => return Err(e),
            Some(end) => {
                choice.finish = end.finish_reason().unwrap_or("stop");
                *ended = true;
            }
            None => {}
        }
        if choices.iter().all(|c| c.1) {
            return Ok((choices.into_iter().map(|(c, _)| c).collect(), tally));
        }
        p = rest.next().await.unwrap_or_else(Piece::unfinished);
    }
}

/// One choice of a whole (not streamed) answer.
#[derive(Debug, Default)]
struct WholeChoice {
    text: String,
    logprobs: Vec<TokenLp>,
    finish: &'static str,
}

/// The echoed prompt (its text, and its logprobs when asked), which the
/// scheduler sends once per request, in front of every choice's first
/// piece.
#[derive(Debug)]
struct Echo {
    text: String,
    logprobs: Vec<TokenLp>,
    /// Per choice: whether its answer already shows the prompt.
    shown: Vec<bool>,
}

impl Echo {
    fn new(n: u32) -> Self {
        Echo {
            text: String::new(),
            logprobs: Vec::new(),
            shown: vec![false; n.max(1) as usize],
        }
    }

    /// A piece's text and its tokens' logprobs as an answer shows them:
    /// the echoed prompt first in its choice's first piece that follows
    /// it.
    fn parts(&mut self, p: &Piece) -> (String, Vec<TokenLp>) {
        if !p.prompt_text.is_empty() || !p.prompt_logprobs.is_empty() {
            self.text.clone_from(&p.prompt_text);
            self.logprobs.clone_from(&p.prompt_logprobs);
        }
        let echoed = !self.text.is_empty() || !self.logprobs.is_empty();
        let (mut text, mut lps) = (String::new(), Vec::new());
        if let Some(shown) = self.shown.get_mut(p.index as usize)
            && echoed
            && !*shown
        {
            *shown = true;
            text.clone_from(&self.text);
            lps.clone_from(&self.logprobs);
        }
        text.push_str(&p.text);
        lps.extend(p.logprobs.iter().cloned());
        (text, lps)
    }
}

impl Answer {
    /// The logprobs object of `lps` in this answer's shape, when asked;
    /// `before` holds the bytes of the tokens the choice already showed
    /// (completions' `text_offset`).
    fn logprobs_value(&self, lps: &[TokenLp], before: &mut Vec<u8>) -> Option<Value> {
        if !self.logprobs {
            return None;
        }
        Some(match self.kind {
            Kind::Completion => logprobs::completion(lps, before),
            Kind::Chat => logprobs::chat(lps),
        })
    }

    fn whole(&self, choices: Vec<(String, Option<Value>, &'static str)>, usage: Usage) -> Response {
        let indexed = choices.into_iter().zip(0u32..);
        match self.kind {
            Kind::Completion => json(
                StatusCode::OK,
                &Completion {
                    id: self.id.clone(),
                    object: "text_completion",
                    created: self.created,
                    model: self.model.clone(),
                    choices: indexed
                        .map(|((text, logprobs, finish), index)| CompletionChoice {
                            index,
                            text,
                            logprobs,
                            finish_reason: Some(finish),
                        })
                        .collect(),
                    usage: Some(usage),
                },
            ),
            Kind::Chat => json(
                StatusCode::OK,
                &ChatCompletion {
                    id: self.id.clone(),
                    object: "chat.completion",
                    created: self.created,
                    model: self.model.clone(),
                    choices: indexed
                        .map(|((text, logprobs, finish), index)| ChatChoice {
                            index,
                            message: AssistantMessage {
                                role: "assistant",
                                content: text,
                            },
                            logprobs,
                            finish_reason: finish,
                        })
                        .collect(),
                    usage,
                },
            ),
        }
    }

    /// One streamed chunk of choice `index`: a text delta (with its tokens'
    /// logprobs), the role (chat's first chunk), a finish reason, or (with
    /// no choices) the usage.
    fn chunk(
        &self,
        index: u32,
        text: Option<String>,
        logprobs: Option<Value>,
        role: bool,
        finish: Option<&'static str>,
        usage: Option<Usage>,
    ) -> String {
        let with_choice = usage.is_none();
        let json = match self.kind {
            Kind::Completion => serde_json::to_string(&Completion {
                id: self.id.clone(),
                object: "text_completion",
                created: self.created,
                model: self.model.clone(),
                choices: with_choice
                    .then(|| CompletionChoice {
                        index,
                        text: text.unwrap_or_default(),
                        logprobs: logprobs.clone(),
                        finish_reason: finish,
                    })
                    .into_iter()
                    .collect(),
                usage,
            }),
            Kind::Chat => serde_json::to_string(&ChatChunk {
                id: self.id.clone(),
                object: "chat.completion.chunk",
                created: self.created,
                model: self.model.clone(),
                choices: with_choice
                    .then(|| ChunkChoice {
                        index,
                        delta: Delta {
                            role: role.then_some("assistant"),
                            content: text,
                        },
                        logprobs,
                        finish_reason: finish,
                    })
                    .into_iter()
                    .collect(),
                usage,
            }),
        };
        event(&json.unwrap_or_default())
    }
}

fn event(data: &str) -> String {
    format!("data: {data}\n\n")
}

const DONE: &str = "data: [DONE]\n\n";

struct SseState<S> {
    answer: Answer,
    include_usage: bool,
    tally: Tally,
    /// Choices not ended yet.
    left: u32,
    first: Option<Piece>,
    rest: S,
    started: bool,
    done: bool,
    /// Per choice, the bytes of the tokens streamed so far (completions'
    /// `text_offset`).
    streamed: Vec<Vec<u8>>,
    echo: Echo,
}

/// The SSE body: the chat role chunk, a chunk per piece with text, the
/// finish chunk, the usage chunk when asked for, `data: [DONE]`. A failure
/// mid-stream is an `{"error": ...}` event before `[DONE]`.
fn sse(
    answer: Answer,
    include_usage: bool,
    tally: Tally,
    n: u32,
    first: Piece,
    rest: impl Stream<Item = Piece> + Send + Unpin + 'static,
) -> impl Stream<Item = std::result::Result<Bytes, Infallible>> + Send + 'static {
    let state = SseState {
        answer,
        include_usage,
        tally,
        left: n.max(1),
        first: Some(first),
        rest,
        started: false,
        done: false,
        streamed: vec![Vec::new(); n.max(1) as usize],
        echo: Echo::new(n),
    };
    futures::stream::unfold(state, |mut st| async move {
        if st.done {
            return None;
        }
        let mut out = String::new();
        // a piece whose text is held back (a character split across
        // tokens) makes no event: read on, never send an empty chunk
        while out.is_empty() && !st.done {
            st.step(&mut out).await;
        }
        Some((Ok(Bytes::from(out)), st))
    })
}

impl<S: Stream<Item = Piece> + Unpin> SseState<S> {
    async fn step(&mut self, out: &mut String) {
        let st = self;
        if !st.started {
            st.started = true;
            if st.answer.kind == Kind::Chat {
                for index in 0..st.left {
                    out.push_str(&st.answer.chunk(
                        index,
                        Some(String::new()),
                        None,
                        true,
                        None,
                        None,
                    ));
                }
            }
        }
        let piece = match st.first.take() {
            Some(p) => p,
            None => match st.rest.next().await {
                Some(p) => p,
                None => Piece::unfinished(),
            },
        };
        st.tally.add(&piece);
        let index = piece.index;
        let (text, lps) = st.echo.parts(&piece);
        // a piece whose text is held back still shows its tokens' logprobs
        let logprobs = match st.streamed.get_mut(index as usize) {
            Some(before) if !lps.is_empty() => st.answer.logprobs_value(&lps, before),
            _ => None,
        };
        if !text.is_empty() || logprobs.is_some() {
            out.push_str(
                &st.answer
                    .chunk(index, Some(text), logprobs, false, None, None),
            );
        }
        match piece.end {
            None => {}
            Some(End::Failed(e)) => {
                st.done = true;
                out.push_str(&event(&e.to_json()));
                out.push_str(DONE);
            }
            Some(end) => {
                let content = (st.answer.kind == Kind::Chat).then(String::new);
                out.push_str(&st.answer.chunk(
                    index,
                    content,
                    None,
                    false,
                    end.finish_reason(),
                    None,
                ));
                st.left = st.left.saturating_sub(1);
                if st.left == 0 {
                    st.done = true;
                    if st.include_usage {
                        out.push_str(&st.answer.chunk(
                            0,
                            None,
                            None,
                            false,
                            None,
                            Some(st.tally.usage()),
                        ));
                    }
                    out.push_str(DONE);
                }
            }
        }
    }
}

fn json<T: serde::Serialize>(status: StatusCode, body: &T) -> Response {
    match serde_json::to_string(body) {
        Ok(text) => json_response(status, text),
        Err(e) => ApiError::upstream(format!("cannot encode the answer: {e}")).into_response(),
    }
}

fn json_response(status: StatusCode, text: String) -> Response {
    let mut r = (status, text).into_response();
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    fn answer(kind: Kind) -> Answer {
        Answer {
            kind,
            id: "x".into(),
            created: 1,
            model: "m".into(),
            logprobs: false,
        }
    }

    fn text(t: &str) -> Piece {
        Piece {
            index: 0,
            text: t.into(),
            logprobs: Vec::new(),
            prompt_logprobs: Vec::new(),
            prompt_text: String::new(),
            tokens: 1,
            prompt_tokens: 0,
            cached_tokens: 0,
            retained_tokens: 0,
            end: None,
        }
    }

    /// Issue 29, point 9: serde's message quotes a value it could not read
    /// whole, so a 1 MB string where a number belongs came back whole in the 400.
    #[test]
    fn a_body_serde_refuses_is_not_echoed_whole() {
        let refused = |body: &[u8]| match parse::<crate::openai::CompletionRequest>(body) {
            Ok(_) => panic!("accepted"),
            Err(e) => e,
        };
        let huge = "s".repeat(1 << 20);
        for body in [
            serde_json::json!({"model": "m", "prompt": "x", "max_tokens": huge}),
            serde_json::json!({"model": "m", "prompt": "x", "stream": huge}),
        ] {
            let e = refused(body.to_string().as_bytes());
            assert_eq!(e.status, StatusCode::BAD_REQUEST);
            assert!(e.message.len() < 1024, "a {} byte message", e.message.len());
            for needle in [
                "invalid request body: invalid type: string",
                "line 1 column",
            ] {
                assert!(
                    e.message.contains(needle),
                    "{needle:?} not in {}",
                    e.message
                );
            }
        }
        // a short one is left whole
        let e = refused(br#"{"model": "m", "prompt": 1.5}"#);
        assert!(!e.message.contains("bytes)"), "{}", e.message);
    }

    #[test]
    fn usage_names_the_retained_tokens_only_with_a_hint() {
        let mut t = Tally::new(true);
        t.add(&Piece {
            retained_tokens: 32,
            ..text("a")
        });
        let v = serde_json::to_value(t.usage()).unwrap();
        assert_eq!(v["prompt_tokens_details"]["kvlease_retained_tokens"], 32);
        let v = serde_json::to_value(Tally::new(false).usage()).unwrap();
        assert_eq!(
            v["prompt_tokens_details"].get("kvlease_retained_tokens"),
            None
        );
    }

    async fn body(kind: Kind, usage: bool, pieces: Vec<Piece>) -> Vec<String> {
        body_of(kind, usage, 1, pieces).await
    }

    async fn body_of(kind: Kind, usage: bool, n: u32, pieces: Vec<Piece>) -> Vec<String> {
        let mut it = pieces.into_iter();
        let first = it.next().unwrap();
        let frames: Vec<Bytes> = sse(
            answer(kind),
            usage,
            Tally::new(false),
            n,
            first,
            futures::stream::iter(it),
        )
        .map(|f| f.unwrap())
        .collect()
        .await;
        assert!(frames.iter().all(|f| !f.is_empty()), "no empty chunks");
        let all: String = frames
            .iter()
            .map(|f| String::from_utf8(f.to_vec()).unwrap())
            .collect();
        all.split("\n\n")
            .filter(|e| !e.is_empty())
            .map(|e| e.strip_prefix("data: ").unwrap().to_string())
            .collect()
    }

    #[tokio::test]
    async fn a_reject_mid_stream_ends_it_with_an_error_event_and_done() {
        let reject = Piece {
            end: Some(End::Failed(ApiError::rejected(
                "POOL_EXHAUSTED",
                true,
                "no blocks",
            ))),
            ..text("")
        };
        let events = body(
            Kind::Chat,
            true,
            vec![text("a"), text(""), text("b"), reject],
        )
        .await;
        assert_eq!(events.len(), 5, "{events:?}");
        let chunk = |i: usize| serde_json::from_str::<serde_json::Value>(&events[i]).unwrap();
        assert_eq!(chunk(0)["choices"][0]["delta"]["role"], "assistant");
        assert_eq!(chunk(1)["choices"][0]["delta"]["content"], "a");
        assert_eq!(chunk(2)["choices"][0]["delta"]["content"], "b");
        assert_eq!(chunk(3)["error"]["code"], "pool_exhausted");
        assert_eq!(chunk(3)["error"]["message"], "no blocks");
        assert_eq!(events[4], "[DONE]");
    }

    #[tokio::test]
    async fn a_finished_stream_sends_finish_usage_and_done() {
        let last = Piece {
            end: Some(End::Length),
            ..text("c")
        };
        let first = Piece {
            prompt_tokens: 7,
            cached_tokens: 3,
            ..text("ab")
        };
        let events = body(Kind::Completion, true, vec![first, last]).await;
        let chunk = |i: usize| serde_json::from_str::<serde_json::Value>(&events[i]).unwrap();
        assert_eq!(events.len(), 5, "{events:?}");
        assert_eq!(chunk(0)["choices"][0]["text"], "ab");
        assert_eq!(chunk(1)["choices"][0]["text"], "c");
        assert_eq!(chunk(2)["choices"][0]["finish_reason"], "length");
        let usage = &chunk(3)["usage"];
        assert_eq!(
            (
                &usage["prompt_tokens"],
                &usage["completion_tokens"],
                &usage["prompt_tokens_details"]["cached_tokens"]
            ),
            (
                &serde_json::json!(7),
                &serde_json::json!(2),
                &serde_json::json!(3)
            )
        );
        assert_eq!(events[4], "[DONE]");
    }

    /// Choice `index`'s piece of `t`.
    fn of(index: u32, t: &str, end: Option<End>) -> Piece {
        Piece {
            index,
            end,
            ..text(t)
        }
    }

    #[tokio::test]
    async fn an_echoed_prompt_leads_every_choice() {
        // the scheduler sends the prompt once, with the request's first piece
        let first = Piece {
            prompt_text: "P:".into(),
            ..of(0, "a", None)
        };
        let rest = vec![
            of(1, "x", None),
            of(0, "b", Some(End::Length)),
            of(1, "y", Some(End::Length)),
        ];
        let (choices, _) = whole(Tally::new(false), 2, first, futures::stream::iter(rest))
            .await
            .unwrap();
        let texts: Vec<&str> = choices.iter().map(|c| c.text.as_str()).collect();
        assert_eq!(texts, ["P:ab", "P:xy"]);
    }

    #[tokio::test]
    async fn choices_stream_with_their_index_and_end_once_every_choice_ended() {
        let pieces = vec![
            Piece {
                prompt_tokens: 5,
                ..of(0, "a", None)
            },
            of(1, "x", None),
            of(1, "y", Some(End::Stop)),
            of(0, "b", Some(End::Length)),
        ];
        let events = body_of(Kind::Chat, true, 2, pieces).await;
        let chunk = |i: usize| serde_json::from_str::<serde_json::Value>(&events[i]).unwrap();
        assert_eq!(events.len(), 10, "{events:?}");
        for (i, index) in [(0, 0), (1, 1)] {
            assert_eq!(chunk(i)["choices"][0]["index"], index);
            assert_eq!(chunk(i)["choices"][0]["delta"]["role"], "assistant");
        }
        let delta = |i: usize| {
            let c = chunk(i);
            let choice = &c["choices"][0];
            (
                choice["index"].as_u64().unwrap(),
                choice["delta"]["content"].as_str().unwrap().to_owned(),
                choice["finish_reason"].as_str().map(str::to_owned),
            )
        };
        assert_eq!(delta(2), (0, "a".into(), None));
        assert_eq!(delta(3), (1, "x".into(), None));
        assert_eq!(delta(4), (1, "y".into(), None));
        assert_eq!(delta(5), (1, String::new(), Some("stop".into())));
        assert_eq!(delta(6), (0, "b".into(), None));
        assert_eq!(delta(7), (0, String::new(), Some("length".into())));
        // the prompt counted once, every choice's tokens
        let usage = &chunk(8)["usage"];
        assert_eq!(
            (&usage["prompt_tokens"], &usage["completion_tokens"]),
            (&serde_json::json!(5), &serde_json::json!(4))
        );
        assert_eq!(events[9], "[DONE]");
    }

    #[tokio::test]
    async fn whole_answers_hold_every_choice_in_index_order() {
        let rest = vec![of(0, "b", Some(End::Length)), of(1, "y", Some(End::Stop))];
        let first = Piece {
            prompt_tokens: 5,
            ..of(1, "x", None)
        };
        let (choices, tally) = whole(Tally::new(false), 2, first, futures::stream::iter(rest))
            .await
            .unwrap();
        let got: Vec<(&str, &str)> = choices
            .iter()
            .map(|c| (c.text.as_str(), c.finish))
            .collect();
        assert_eq!(got, [("b", "length"), ("xy", "stop")]);
        assert_eq!((tally.prompt_tokens, tally.completion_tokens), (5, 3));
        // a choice past n is the scheduler's fault, answered as such
        let e = whole(
            Tally::new(false),
            1,
            of(3, "z", None),
            futures::stream::iter(Vec::new()),
        )
        .await
        .unwrap_err();
        assert!(e.message.contains("choice 3 of 1"), "{}", e.message);
    }
}
