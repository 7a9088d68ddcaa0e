//! The `kvlease.v1.Scheduler` API: validates requests, hands them to the
//! step loop and turns its outputs into the response stream. The only place
//! besides `client.rs` that knows protobuf types.

use std::pin::Pin;
use std::time::Duration;

use futures::Stream;
use kvlease_proto::v1 as pb;
use kvlease_proto::v1::scheduler_server::Scheduler;
use tokio::sync::mpsc;
use tokio::time::Instant;
use tonic::{Request as GrpcRequest, Response, Status};

use crate::client::{CacheClient, reject_to_proto};
use crate::domain::{Finish, Output, RequestId, Sampling};
use crate::error::Error;
use crate::policy::{OnExhausted, Policy};
use crate::queue::Request;
use crate::step_loop::StepLoopHandle;
use kvlease_tokenizer::{Message, StopStrings, StreamDecoder, Tokenizer};

/// Limits a request is validated against.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Limits {
    /// Largest `max_tokens`.
    pub max_tokens: u32,
    /// Largest prompt + `max_tokens`.
    pub max_context: u32,
    /// Token ids must be below this.
    pub vocab_size: u32,
}

/// The Scheduler service.
#[derive(Debug, Clone)]
pub struct SchedulerService {
    engine: StepLoopHandle,
    cache: CacheClient,
    limits: Limits,
    tokenizer: Tokenizer,
    policy: Policy,
    on_exhausted: OnExhausted,
    groups: Vec<String>,
}

impl SchedulerService {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        engine: StepLoopHandle,
        cache: CacheClient,
        limits: Limits,
        tokenizer: Tokenizer,
        policy: Policy,
        on_exhausted: OnExhausted,
        groups: Vec<String>,
    ) -> Self {
        Self {
            engine,
            cache,
            limits,
            tokenizer,
            policy,
            on_exhausted,
            groups,
        }
    }
}

const MAX_LABEL: usize = 256;
/// Limits on stop strings: how many, and the bytes of each.
const MAX_STOPS: usize = 16;
const MAX_STOP_BYTES: usize = 256;

/// How a request's output text is made: `None` for token-id prompts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TextOutput {
    /// Stop strings.
    pub stop: Vec<String>,
}

/// The prompt of a request: its text, its chat or its token ids.
fn prompt_ids(req: &pb::GenerateRequest, tokenizer: &Tokenizer) -> Result<Vec<u32>, Error> {
    let given = [
        !req.text.is_empty(),
        !req.tokens.is_empty(),
        !req.messages.is_empty(),
    ];
    if given.iter().filter(|g| **g).count() > 1 {
        return Err(Error::InvalidArgument(
            "give exactly one of text, tokens and messages".into(),
        ));
    }
    let failed = |e: kvlease_tokenizer::Error| match e {
        kvlease_tokenizer::Error::NoChatTemplate => Error::FailedPrecondition(
            "the model has no chat template: send text or tokens instead of messages".into(),
        ),
        other => Error::InvalidArgument(other.to_string()),
    };
    if !req.messages.is_empty() {
        if let Some((i, _)) = req
            .messages
            .iter()
            .enumerate()
            .find(|(_, m)| m.role.is_empty())
        {
            return Err(Error::InvalidArgument(format!("message {i} has no role")));
        }
        let messages: Vec<Message> = req
            .messages
            .iter()
            .map(|m| Message::new(m.role.clone(), m.content.clone()))
            .collect();
        return tokenizer.encode_chat(&messages).map_err(failed);
    }
    if !req.text.is_empty() {
        return tokenizer.encode(&req.text).map_err(failed);
    }
    Ok(req.tokens.clone())
}

/// Checks a Generate request and turns it into a queue request, with how
/// its output text is made (`None` for a token-id prompt).
pub fn validate(
    id: u64,
    req: &pb::GenerateRequest,
    limits: &Limits,
    tokenizer: &Tokenizer,
) -> Result<(Request, Option<TextOutput>), Error> {
    let bad = |m: String| Err(Error::InvalidArgument(m));
    let is_text = !req.text.is_empty() || !req.messages.is_empty();
    let prompt = prompt_ids(req, tokenizer)?;
    if prompt.is_empty() {
        return bad("empty prompt: give text or tokens".into());
    }
    if let Some((i, t)) = prompt
        .iter()
        .enumerate()
        .find(|(_, t)| **t >= limits.vocab_size)
    {
        return bad(format!(
            "prompt token {t} at index {i} is outside the vocabulary of {}",
            limits.vocab_size
        ));
    }
    if req.max_tokens == 0 {
        return bad("max_tokens must be at least 1".into());
    }
    if req.max_tokens > limits.max_tokens {
        return bad(format!(
            "max_tokens {} is over the limit of {}",
            req.max_tokens, limits.max_tokens
        ));
    }
    let total = prompt.len() as u64 + u64::from(req.max_tokens);
    if total > u64::from(limits.max_context) {
        return bad(format!(
            "prompt of {} tokens plus max_tokens {} exceeds the context limit of {} tokens",
            prompt.len(),
            req.max_tokens,
            limits.max_context
        ));
    }
    if !req.temperature.is_finite() || req.temperature < 0.0 {
        return bad(format!(
            "temperature must be a finite number >= 0, got {}",
            req.temperature
        ));
    }
    if !req.top_p.is_finite() || !(0.0..=1.0).contains(&req.top_p) {
        return bad(format!("top_p must be in [0, 1], got {}", req.top_p));
    }
    if let Some(t) = req.stop_tokens.iter().find(|t| **t >= limits.vocab_size) {
        return bad(format!(
            "stop token {t} is outside the vocabulary of {}",
            limits.vocab_size
        ));
    }
    if req.stop.len() > MAX_STOPS {
        return bad(format!(
            "{} stop strings; at most {MAX_STOPS}",
            req.stop.len()
        ));
    }
    if let Some(s) = req
        .stop
        .iter()
        .find(|s| s.is_empty() || s.len() > MAX_STOP_BYTES)
    {
        return bad(format!(
            "stop string {s:?} must be 1 to {MAX_STOP_BYTES} bytes"
        ));
    }
    if !req.stop.is_empty() && !is_text {
        return bad("stop strings need a text or messages prompt".into());
    }
    if req.priority > 100 {
        return bad(format!("priority must be 0 to 100, got {}", req.priority));
    }
    if req.cache_salt.len() > MAX_LABEL || req.request_id.len() > MAX_LABEL {
        return bad(format!(
            "cache_salt and request_id are limited to {MAX_LABEL} bytes"
        ));
    }
    let mut r = Request::new(RequestId(id), prompt, req.max_tokens);
    r.sampling = Sampling {
        temperature: req.temperature,
        top_p: req.top_p,
        seed: req.seed,
    };
    r.stop_tokens = req.stop_tokens.clone();
    if !req.ignore_eos {
        r.stop_tokens.extend_from_slice(tokenizer.end_ids());
    }
    r.priority = req.priority;
    r.cache_salt = req.cache_salt.clone();
    let text = is_text.then(|| TextOutput {
        stop: req.stop.clone(),
    });
    Ok((r, text))
}

type GenerateStream = Pin<Box<dyn Stream<Item = Result<pb::GenerateResponse, Status>> + Send>>;

struct StreamState {
    rx: mpsc::UnboundedReceiver<Output>,
    text: Option<TextStream>,
    deadline: Option<Instant>,
    done: bool,
}

/// The output text of a text or chat request.
struct TextStream {
    decoder: StreamDecoder,
    stops: StopStrings,
}

impl TextStream {
    fn push(&mut self, tokens: &[u32]) -> String {
        self.stops.push(&self.decoder.push(tokens))
    }

    fn finish(&mut self) -> String {
        let mut text = self.stops.push(&self.decoder.finish());
        text.push_str(&self.stops.finish());
        text
    }
}

/// The client's deadline from the `grpc-timeout` header (`<digits><unit>`,
/// unit one of H M S m u n), if any.
pub fn grpc_timeout(metadata: &tonic::metadata::MetadataMap) -> Option<Duration> {
    let v = metadata.get("grpc-timeout")?.to_str().ok()?;
    let (digits, unit) = v.split_at(v.len().checked_sub(1)?);
    let n: u64 = digits.parse().ok()?;
    Some(match unit {
        "H" => Duration::from_secs(n.saturating_mul(3600)),
        "M" => Duration::from_secs(n.saturating_mul(60)),
        "S" => Duration::from_secs(n),
        "m" => Duration::from_millis(n),
        "u" => Duration::from_micros(n),
        "n" => Duration::from_nanos(n),
        _ => return None,
    })
}

/// The response stream of one request: tokens as they come, then the last
/// message with the finish reason. Dropping it, or its deadline passing,
/// cancels the request (the step loop sees the receiver gone and releases
/// the request's blocks).
fn response_stream(
    rx: mpsc::UnboundedReceiver<Output>,
    text: Option<(TextOutput, &Tokenizer)>,
    deadline: Option<Instant>,
) -> GenerateStream {
    let state = StreamState {
        rx,
        text: text.map(|(out, tokenizer)| TextStream {
            decoder: tokenizer.stream(),
            stops: StopStrings::new(out.stop),
        }),
        deadline,
        done: false,
    };
    Box::pin(futures::stream::unfold(state, |mut st| async move {
        if st.done {
            return None;
        }
        let next = match st.deadline {
            Some(at) => tokio::time::timeout_at(at, st.rx.recv()).await,
            None => Ok(st.rx.recv().await),
        };
        let Ok(next) = next else {
            st.done = true;
            st.rx.close();
            let m = pb::GenerateResponse {
                finish_reason: pb::FinishReason::Cancelled as i32,
                message: "deadline exceeded".into(),
                ..Default::default()
            };
            return Some((Ok(m), st));
        };
        let msg = match next {
            Some(Output::Tokens {
                tokens,
                reused_tokens,
                ..
            }) => {
                let mut m = pb::GenerateResponse {
                    text: st
                        .text
                        .as_mut()
                        .map(|t| t.push(&tokens))
                        .unwrap_or_default(),
                    tokens,
                    reused_tokens: reused_tokens.unwrap_or(0),
                    ..Default::default()
                };
                if st.text.as_ref().is_some_and(|t| t.stops.stopped()) {
                    // a stop string ends the request here; the step loop
                    // sees the stream gone and releases its blocks
                    st.done = true;
                    st.rx.close();
                    m.finish_reason = pb::FinishReason::Stop as i32;
                }
                m
            }
            Some(Output::Finished {
                finish,
                preemptions,
                ..
            }) => {
                st.done = true;
                let mut m = pb::GenerateResponse {
                    text: st.text.as_mut().map(|t| t.finish()).unwrap_or_default(),
                    preemptions,
                    ..Default::default()
                };
                let stopped = st.text.as_ref().is_some_and(|t| t.stops.stopped());
                let reason = match finish {
                    Finish::Length | Finish::Stop if stopped => pb::FinishReason::Stop,
                    Finish::Length => pb::FinishReason::Length,
                    Finish::Stop => pb::FinishReason::Stop,
                    Finish::Cancelled(why) => {
                        m.message = why;
                        pb::FinishReason::Cancelled
                    }
                    Finish::Rejected(r) => {
                        m.message = format!("{}: {}", r.reason, r.message);
                        m.reject = Some(reject_to_proto(&r));
                        pb::FinishReason::Rejected
                    }
                    Finish::Error(why) => {
                        m.message = why;
                        pb::FinishReason::Error
                    }
                };
                m.finish_reason = reason as i32;
                m
            }
            None => {
                st.done = true;
                pb::GenerateResponse {
                    finish_reason: pb::FinishReason::Error as i32,
                    message: "the scheduler stopped before the request finished".into(),
                    ..Default::default()
                }
            }
        };
        Some((Ok(msg), st))
    }))
}

#[tonic::async_trait]
impl Scheduler for SchedulerService {
    type GenerateStream = GenerateStream;

    async fn generate(
        &self,
        request: GrpcRequest<pb::GenerateRequest>,
    ) -> Result<Response<Self::GenerateStream>, Status> {
        let deadline = grpc_timeout(request.metadata()).map(|t| Instant::now() + t);
        let req = request.into_inner();
        let id = self.engine.next_request_id();
        let (r, text) = validate(id.get(), &req, &self.limits, &self.tokenizer)?;
        if !self.cache.is_up() {
            return Err(Error::CacheUnavailable(
                "the cache service cannot be reached; try again later".into(),
            )
            .into());
        }
        tracing::debug!(request = id.get(), request_id = %req.request_id, prompt_tokens = r.prompt.len(),
            max_tokens = r.max_tokens, "generate");
        let rx = self
            .engine
            .submit(r, kvlease_telemetry::current_context())?;
        let text = text.map(|t| (t, &self.tokenizer));
        Ok(Response::new(response_stream(rx, text, deadline)))
    }

    async fn get_status(
        &self,
        _request: GrpcRequest<pb::GetStatusRequest>,
    ) -> Result<Response<pb::GetStatusResponse>, Status> {
        let s = self.engine.status();
        let mut pools = Vec::new();
        for group in &self.groups {
            match self.cache.stats_raw(group).await {
                Ok(r) => pools.extend(r.pools.into_iter().filter(|p| &p.pool_group == group)),
                Err(e) => tracing::debug!(error = %e, "pool figures unavailable for status"),
            }
        }
        let policy = match self.policy {
            Policy::GuaranteedNoEvict => pb::CapacityPolicy::GuaranteedNoEvict,
            Policy::MaxUtilization => pb::CapacityPolicy::MaxUtilization,
            Policy::StaticBatch => pb::CapacityPolicy::StaticBatch,
        };
        Ok(Response::new(pb::GetStatusResponse {
            policy: policy as i32,
            on_exhausted: self.on_exhausted.as_str().to_string(),
            queued: s.queued,
            running: s.running,
            preempted: s.preempted,
            steps: s.steps,
            session_id: s.session_id,
            epoch: s.epoch,
            pools,
            finished_length: s.counters.finished_length,
            finished_stop: s.counters.finished_stop,
            cancelled: s.counters.cancelled,
            rejected: s.counters.rejected,
            errors: s.counters.errors,
            preemptions: s.counters.preemptions,
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits() -> Limits {
        Limits {
            max_tokens: 64,
            max_context: 128,
            vocab_size: 258,
        }
    }

    fn validate_bytes(
        id: u64,
        req: &pb::GenerateRequest,
        limits: &Limits,
    ) -> Result<(Request, Option<TextOutput>), Error> {
        validate(id, req, limits, &Tokenizer::byte_level())
    }

    fn req(tokens: Vec<u32>, max_tokens: u32) -> pb::GenerateRequest {
        pb::GenerateRequest {
            tokens,
            max_tokens,
            ..Default::default()
        }
    }

    fn message(r: Result<(Request, Option<TextOutput>), Error>) -> String {
        match r {
            Ok(_) => "ok".into(),
            Err(e) => e.to_string(),
        }
    }

    #[test]
    fn validation_names_what_is_wrong() {
        let l = limits();
        assert!(message(validate_bytes(1, &req(vec![], 4), &l)).contains("empty prompt"));
        assert!(
            message(validate_bytes(1, &req(vec![1], 0), &l))
                .contains("max_tokens must be at least 1")
        );
        assert!(message(validate_bytes(1, &req(vec![1], 65), &l)).contains("over the limit of 64"));
        assert!(message(validate_bytes(1, &req(vec![1; 100], 64), &l)).contains("context limit"));
        assert!(
            message(validate_bytes(1, &req(vec![300], 4), &l)).contains("outside the vocabulary")
        );
        let both = pb::GenerateRequest {
            text: "a".into(),
            tokens: vec![1],
            max_tokens: 1,
            ..Default::default()
        };
        assert!(message(validate_bytes(1, &both, &l)).contains("exactly one"));
        let hot = pb::GenerateRequest {
            temperature: -1.0,
            ..req(vec![1], 1)
        };
        assert!(message(validate_bytes(1, &hot, &l)).contains("temperature"));
        let top = pb::GenerateRequest {
            top_p: 1.5,
            ..req(vec![1], 1)
        };
        assert!(message(validate_bytes(1, &top, &l)).contains("top_p"));
        let ok = validate_bytes(
            7,
            &pb::GenerateRequest {
                text: "hé".into(),
                max_tokens: 3,
                ..Default::default()
            },
            &l,
        );
        assert!(
            matches!(ok, Ok((r, Some(_))) if r.prompt == vec![104, 0xC3, 0xA9] && r.id == RequestId(7))
        );
    }

    #[test]
    fn grpc_timeout_header_is_parsed() {
        let mut m = tonic::metadata::MetadataMap::new();
        assert_eq!(grpc_timeout(&m), None);
        m.insert(
            "grpc-timeout",
            tonic::metadata::MetadataValue::from_static("150m"),
        );
        assert_eq!(grpc_timeout(&m), Some(Duration::from_millis(150)));
        m.insert(
            "grpc-timeout",
            tonic::metadata::MetadataValue::from_static("2S"),
        );
        assert_eq!(grpc_timeout(&m), Some(Duration::from_secs(2)));
        m.insert(
            "grpc-timeout",
            tonic::metadata::MetadataValue::from_static("x"),
        );
        assert_eq!(grpc_timeout(&m), None);
    }

    #[test]
    fn invalid_argument_maps_to_the_grpc_code() {
        let s: Status = Error::InvalidArgument("x".into()).into();
        assert_eq!(s.code(), tonic::Code::InvalidArgument);
        let s: Status = Error::CacheUnavailable("x".into()).into();
        assert_eq!(s.code(), tonic::Code::Unavailable);
    }
}
