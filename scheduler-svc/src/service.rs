//! The `kvlease.v1.Scheduler` API: validates requests, hands them to the
//! step loop and turns its outputs into the response stream. The only place
//! besides `client.rs` that knows protobuf types.

use crate::tenant::{TENANT_METADATA, Tenancy};
use kvlease_auth::{Principal, Role};
use std::pin::Pin;
use std::time::Duration;

use futures::Stream;
use kvlease_proto::v1 as pb;
use kvlease_proto::v1::scheduler_server::Scheduler;
use kvlease_telemetry::OpenTelemetrySpanExt as _;
use kvlease_telemetry::attributes;
use kvlease_telemetry::opentelemetry::trace::Status as OtelStatus;
use tokio::sync::mpsc;
use tokio::time::Instant;
use tonic::{Request as GrpcRequest, Response, Status};

use crate::client::CacheClient;
use crate::convert::{Limits, TextOutput, reject_to_proto};
use crate::domain::{Finish, Output, TokenLogprob};
use crate::error::Error;
use crate::policy::{OnExhausted, Policy};
use crate::step_loop::StepLoopHandle;
use kvlease_tokenizer::{StopStrings, StreamDecoder, Tokenizer};

/// The Scheduler service.
#[derive(Debug, Clone)]
pub(crate) struct SchedulerService {
    step_loop: StepLoopHandle,
    cache: CacheClient,
    limits: Limits,
    tokenizer: Tokenizer,
    policy: Policy,
    on_exhausted: OnExhausted,
    /// Each worker group's pool group and role.
    groups: Vec<(String, crate::domain::Role)>,
    tenancy: Tenancy,
}

impl SchedulerService {
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        step_loop: StepLoopHandle,
        cache: CacheClient,
        limits: Limits,
        tokenizer: Tokenizer,
        policy: Policy,
        on_exhausted: OnExhausted,
        groups: Vec<(String, crate::domain::Role)>,
        tenancy: Tenancy,
    ) -> Self {
        Self {
            step_loop,
            cache,
            limits,
            tokenizer,
            policy,
            on_exhausted,
            groups,
            tenancy,
        }
    }
}

/// The principal of a call, as the auth layer found it; `anonymous` without the layer.
fn caller<T>(request: &GrpcRequest<T>) -> Principal {
    kvlease_auth::principal_of(request)
        .cloned()
        .unwrap_or_else(Principal::anonymous)
}

type GenerateStream = Pin<Box<dyn Stream<Item = Result<pb::GenerateResponse, Status>> + Send>>;

struct StreamState {
    rx: mpsc::UnboundedReceiver<Output>,
    /// Tells the step loop a sample's text ended at a stop string, so that
    /// it stops generating that sample (the others go on).
    ended: mpsc::UnboundedSender<u32>,
    /// One per sample (`GenerateRequest.n`), by index.
    branches: Vec<Branch>,
    deadline: Option<Instant>,
    done: bool,
    /// The prompt's length, sent on the first message and then cleared.
    prompt_tokens: Option<u32>,
    /// Output tokens so far, every sample's.
    output_tokens: u64,
    /// With echo: the prompt's text, sent on the first message.
    prompt_text: Option<String>,
    /// The prompt's first token, which leads its logprobs (it has none).
    prompt_first: Option<u32>,
    tokenizer: Tokenizer,
    /// The request's `Generate` span: its finish is recorded there.
    root: tracing::Span,
}

/// One sample of a request: its text and whether its last message went.
struct Branch {
    text: TextStream,
    /// Its output tokens so far.
    output_tokens: u64,
    done: bool,
}

/// The output text of a request.
struct TextStream {
    decoder: StreamDecoder,
    stops: StopStrings,
    /// Output tokens before which stop strings are not looked for (as
    /// vLLM: from the text of the chunk that reaches `min_tokens` on).
    min_tokens: u64,
}

impl TextStream {
    /// The text of `tokens`, output after `before` others.
    fn push(&mut self, tokens: &[u32], before: u64) -> String {
        let text = self.decoder.push(tokens);
        if before + (tokens.len() as u64) < self.min_tokens {
            self.stops.pass(&text)
        } else {
            self.stops.push(&text)
        }
    }

    fn finish(&mut self) -> String {
        let mut text = self.stops.push(&self.decoder.finish());
        text.push_str(&self.stops.finish());
        text
    }
}

/// The client's deadline from the `grpc-timeout` header (`<digits><unit>`,
/// unit one of H M S m u n), if any.
pub(crate) fn grpc_timeout(metadata: &tonic::metadata::MetadataMap) -> Option<Duration> {
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
#[allow(clippy::too_many_arguments)] // the stream's parts, each used once
fn response_stream(
    rx: mpsc::UnboundedReceiver<Output>,
    ended: mpsc::UnboundedSender<u32>,
    text: TextOutput,
    tokenizer: &Tokenizer,
    deadline: Option<Instant>,
    prompt_tokens: u32,
    samples: u32,
    prompt: &[u32],
    root: tracing::Span,
) -> GenerateStream {
    let branches = (0..samples.max(1))
        .map(|_| Branch {
            text: TextStream {
                decoder: tokenizer.stream(),
                stops: StopStrings::new(text.stop.clone()),
                min_tokens: u64::from(text.min_tokens),
            },
            output_tokens: 0,
            done: false,
        })
        .collect();
    let state = StreamState {
        prompt_text: text.echo.then(|| tokenizer.decode(prompt)),
        prompt_first: prompt.first().copied(),
        tokenizer: tokenizer.clone(),
        rx,
        ended,
        branches,
        deadline,
        done: false,
        prompt_tokens: Some(prompt_tokens),
        output_tokens: 0,
        root,
    };
    Box::pin(futures::stream::unfold(state, |mut st| async move {
        if st.done {
            return None;
        }
        let msg = loop {
            let next = match st.deadline {
                Some(at) => tokio::time::timeout_at(at, st.rx.recv()).await,
                None => Ok(st.rx.recv().await),
            };
            let Ok(next) = next else {
                st.done = true;
                st.rx.close();
                break pb::GenerateResponse {
                    finish_reason: pb::FinishReason::Cancelled as i32,
                    message: "deadline exceeded".into(),
                    ..Default::default()
                };
            };
            match next {
                Some(output) => match st.branch_message(output) {
                    Some(msg) => break msg,
                    // the request's last output, for a sample whose text
                    // already ended: every sample's last message went
                    None if st.done => {
                        st.rx.close();
                        return None;
                    }
                    None => {}
                },
                None => {
                    st.done = true;
                    break pb::GenerateResponse {
                        finish_reason: pb::FinishReason::Error as i32,
                        message: "the scheduler stopped before the request finished".into(),
                        ..Default::default()
                    };
                }
            }
        };
        let mut msg = msg;
        msg.prompt_tokens = st.prompt_tokens.take().unwrap_or(0);
        msg.prompt_text = st.prompt_text.take().unwrap_or_default();
        st.output_tokens += msg.tokens.len() as u64;
        if st.done {
            record_finish(&st.root, &msg, st.output_tokens);
        }
        Some((Ok(msg), st))
    }))
}

impl StreamState {
    /// The message of one sample's output, or `None` for the outputs of a
    /// sample whose text already ended at a stop string (its generation
    /// runs on unseen). Marks the stream done with the request's last
    /// output, or once every sample's text ended (which closes the
    /// receiver: the step loop cancels what still runs).
    fn branch_message(&mut self, output: Output) -> Option<pb::GenerateResponse> {
        let (index, last) = match &output {
            Output::Tokens { index, .. } => (*index, false),
            Output::Finished { index, last, .. } => (*index, *last),
        };
        if last {
            self.done = true;
        }
        let branch = self.branches.get_mut(index as usize)?;
        if branch.done {
            return None;
        }
        let mut m = match output {
            Output::Tokens {
                tokens,
                reused_tokens,
                logprobs,
                prompt_logprobs,
                ..
            } => {
                let tok = &self.tokenizer;
                let prompt_logprobs = match prompt_logprobs {
                    Some(lp) => {
                        // the first prompt token leads, without a logprob
                        let first = self.prompt_first.map(|t| pb::TokenLogprob {
                            token: t,
                            bytes: tok.token_bytes(t),
                            logprob: None,
                            top: Vec::new(),
                        });
                        first
                            .into_iter()
                            .chain(lp.iter().map(|l| token_logprob(tok, l)))
                            .collect()
                    }
                    None => Vec::new(),
                };
                let mut m = pb::GenerateResponse {
                    text: branch.text.push(&tokens, branch.output_tokens),
                    logprobs: logprobs.iter().map(|l| token_logprob(tok, l)).collect(),
                    prompt_logprobs,
                    reused_tokens: reused_tokens.map_or(0, |r| r.0),
                    retained_tokens: reused_tokens.map_or(0, |r| r.1),
                    ..Default::default()
                };
                branch.output_tokens += tokens.len() as u64;
                m.tokens = tokens;
                if branch.text.stops.stopped() {
                    // a stop string ends the sample's text here, and the
                    // step loop stops generating it (a closed loop has
                    // nothing left to stop)
                    branch.done = true;
                    m.finish_reason = pb::FinishReason::Stop as i32;
                    let _ = self.ended.send(index);
                }
                m
            }
            Output::Finished {
                finish,
                preemptions,
                cumulative_logprob,
                ..
            } => {
                branch.done = true;
                let mut m = pb::GenerateResponse {
                    text: branch.text.finish(),
                    preemptions,
                    cumulative_logprob,
                    ..Default::default()
                };
                let stopped = branch.text.stops.stopped();
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
        };
        m.index = index;
        if !self.done && self.branches.iter().all(|b| b.done) {
            // every sample's text ended at a stop string: the step loop
            // sees the stream gone and releases their blocks
            self.done = true;
            self.rx.close();
        }
        Some(m)
    }
}

/// One token's logprobs as the API shows them: with the bytes of it and of
/// each alternative.
fn token_logprob(tokenizer: &Tokenizer, l: &TokenLogprob) -> pb::TokenLogprob {
    pb::TokenLogprob {
        token: l.token,
        bytes: tokenizer.token_bytes(l.token),
        logprob: Some(l.logprob),
        top: l
            .top
            .iter()
            .map(|&(token, logprob)| pb::TopLogprob {
                token,
                bytes: tokenizer.token_bytes(token),
                logprob,
            })
            .collect(),
    }
}

/// Records how the request ended on its `Generate` span: output tokens,
/// finish reason, preemptions, and for `REJECTED` (or `ERROR`) error status,
/// with the reject's figures.
fn record_finish(root: &tracing::Span, last: &pb::GenerateResponse, output_tokens: u64) {
    attributes::set_u64(root, attributes::OUTPUT_TOKENS, output_tokens);
    attributes::set_u64(root, attributes::PREEMPTIONS, u64::from(last.preemptions));
    let reason = last.finish_reason();
    root.set_attribute(attributes::FINISH_REASON, reason.as_str_name());
    match (&last.reject, reason) {
        (Some(reject), _) => {
            kvlease_telemetry::record_reject(root, &kvlease_telemetry::RejectFigures::from(reject))
        }
        (None, pb::FinishReason::Rejected | pb::FinishReason::Error) => {
            root.set_status(OtelStatus::error(last.message.clone()));
        }
        _ => {}
    }
}

#[tonic::async_trait]
impl Scheduler for SchedulerService {
    type GenerateStream = GenerateStream;

    async fn generate(
        &self,
        request: GrpcRequest<pb::GenerateRequest>,
    ) -> Result<Response<Self::GenerateStream>, Status> {
        let deadline = grpc_timeout(request.metadata()).map(|t| Instant::now() + t);
        let caller = caller(&request);
        let asserted =
            match request.metadata().get(TENANT_METADATA) {
                Some(v) => Some(v.to_str().map_err(|_| {
                    Error::InvalidArgument(format!("{TENANT_METADATA} is not ASCII"))
                })?),
                None => None,
            };
        let tenant = self.tenancy.tenant_of(&caller, asserted)?;
        let req = request.into_inner();
        let id = self.step_loop.next_request_id();
        let (mut r, text) =
            crate::convert::validate(id.get(), &req, &self.limits, &self.tokenizer)?;
        r.cache_salt = self.tenancy.salt(&tenant, &req.cache_salt);
        if let Some(h) = &mut r.retain {
            h.tenant = tenant.to_string();
        }
        if !self.cache.is_up() {
            return Err(Error::CacheUnavailable(
                "the cache service cannot be reached; try again later".into(),
            )
            .into());
        }
        tracing::debug!(request = id.get(), request_id = %req.request_id, prompt_tokens = r.prompt.len(),
            max_tokens = r.max_tokens, "generate");
        let prompt_tokens = u32::try_from(r.prompt.len()).unwrap_or(u32::MAX);
        let samples = r.n;
        let prompt = if text.echo || r.logprobs.is_some_and(|l| l.prompt) {
            r.prompt.clone()
        } else {
            Vec::new()
        };
        let root = tracing::Span::current();
        attributes::set_u64(&root, attributes::REQUEST_ID, id.get());
        if !req.request_id.is_empty() {
            root.set_attribute("kvlease.client_request_id", req.request_id.clone());
        }
        root.set_attribute(attributes::PROMPT_TOKENS, i64::from(prompt_tokens));
        let (rx, ended) = self.step_loop.submit(r, root.clone())?;
        Ok(Response::new(response_stream(
            rx,
            ended,
            text,
            &self.tokenizer,
            deadline,
            prompt_tokens,
            samples,
            &prompt,
            root,
        )))
    }

    async fn get_status(
        &self,
        request: GrpcRequest<pb::GetStatusRequest>,
    ) -> Result<Response<pb::GetStatusResponse>, Status> {
        // The session id and epoch are the scheduler's credentials towards the cache: only
        // admins see them (0 for everyone else).
        let admin = caller(&request).has(Role::Admin);
        let s = self.step_loop.status();
        let mut pools = Vec::new();
        for (group, _) in &self.groups {
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
            session_id: if admin { s.session_id } else { 0 },
            epoch: if admin { s.epoch } else { 0 },
            pools,
            finished_length: s.counters.finished_length,
            finished_stop: s.counters.finished_stop,
            cancelled: s.counters.cancelled,
            rejected: s.counters.rejected,
            errors: s.counters.errors,
            preemptions: s.counters.preemptions,
            groups: self
                .groups
                .iter()
                .map(|(name, role)| pb::WorkerGroup {
                    pool_group: name.clone(),
                    role: role.as_str().to_string(),
                })
                .collect(),
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stop_strings_end_the_text_only_from_min_tokens_on() {
        let tokenizer = Tokenizer::byte_level();
        let tokens = |s: &str| tokenizer.encode(s).unwrap();
        let stream = |min_tokens| TextStream {
            decoder: tokenizer.stream(),
            stops: StopStrings::new(["x".to_string()]),
            min_tokens,
        };
        // without min_tokens the first "x" ends it
        let mut t = stream(0);
        assert_eq!(t.push(&tokens("ax"), 0), "a");
        assert!(t.stops.stopped());
        // with 4, the "x" among the first three outputs is text; the one
        // in the chunk that reaches the fourth ends it
        let mut t = stream(4);
        assert_eq!(t.push(&tokens("ax"), 0), "ax");
        assert_eq!(t.push(&tokens("b"), 2), "b");
        assert!(!t.stops.stopped());
        assert_eq!(t.push(&tokens("cx"), 3), "c");
        assert!(t.stops.stopped());
    }

    /// The messages of a request of `samples` samples whose step loop sends
    /// `outputs` (then drops its sender).
    async fn messages(
        samples: u32,
        stop: &[&str],
        outputs: Vec<Output>,
    ) -> Vec<pb::GenerateResponse> {
        messages_ending(samples, stop, outputs).await.0
    }

    /// [`messages`], and the samples the stream told the loop to end.
    async fn messages_ending(
        samples: u32,
        stop: &[&str],
        outputs: Vec<Output>,
    ) -> (Vec<pb::GenerateResponse>, Vec<u32>) {
        use futures::StreamExt;
        let tokenizer = Tokenizer::byte_level();
        let (end, mut ended) = mpsc::unbounded_channel();
        let (tx, rx) = mpsc::unbounded_channel();
        for o in outputs {
            tx.send(o).unwrap();
        }
        drop(tx);
        let text = TextOutput {
            stop: stop.iter().map(|s| s.to_string()).collect(),
            min_tokens: 0,
            echo: false,
        };
        let stream = response_stream(
            rx,
            end,
            text,
            &tokenizer,
            None,
            3,
            samples,
            &[],
            tracing::Span::none(),
        );
        let got = stream.map(|m| m.unwrap()).collect().await;
        let mut stopped = Vec::new();
        while let Ok(i) = ended.try_recv() {
            stopped.push(i);
        }
        (got, stopped)
    }

    fn tokens(index: u32, s: &str) -> Output {
        Output::Tokens {
            request: crate::domain::RequestId(1),
            index,
            tokens: s.bytes().map(u32::from).collect(),
            reused_tokens: None,
            logprobs: Vec::new(),
            prompt_logprobs: None,
        }
    }

    fn finished(index: u32, last: bool) -> Output {
        Output::Finished {
            request: crate::domain::RequestId(1),
            index,
            finish: Finish::Length,
            preemptions: 0,
            last,
            cumulative_logprob: None,
        }
    }

    #[tokio::test]
    async fn samples_stream_apart_and_the_stream_ends_with_the_last() {
        let (got, stopped) = messages_ending(
            2,
            &["x"],
            vec![
                tokens(0, "ab"),
                tokens(1, "cx"),
                // sample 1's text ended at the stop string: its later
                // outputs are not sent
                tokens(1, "dd"),
                tokens(0, "e"),
                finished(0, false),
                finished(1, true),
            ],
        )
        .await;
        let seen: Vec<(u32, String, i32)> = got
            .iter()
            .map(|m| (m.index, m.text.clone(), m.finish_reason))
            .collect();
        let (none, stop, length) = (
            0,
            pb::FinishReason::Stop as i32,
            pb::FinishReason::Length as i32,
        );
        assert_eq!(
            seen,
            vec![
                (0, "ab".into(), none),
                (1, "c".into(), stop),
                (0, "e".into(), none),
                (0, String::new(), length),
            ],
            "no error after the last output of a stopped sample"
        );
        assert_eq!(got[0].prompt_tokens, 3, "the prompt is reported once");
        assert!(got[1..].iter().all(|m| m.prompt_tokens == 0));
        assert_eq!(stopped, vec![1], "the loop is told to stop sample 1 only");
    }

    #[tokio::test]
    async fn a_stream_closed_before_every_sample_ended_is_an_error() {
        let got = messages(2, &[], vec![tokens(0, "a"), finished(0, false)]).await;
        let last = got.last().unwrap();
        assert_eq!(last.finish_reason, pb::FinishReason::Error as i32);
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
