//! Between the gateway's values and the scheduler's protobuf messages: a
//! [`Generate`] becomes a `GenerateRequest`; the response stream becomes
//! [`Piece`]s, with a REJECTED / ERROR / CANCELLED finish turned into the
//! [`ApiError`] a client should see. The only module besides
//! [`crate::service`] that touches protobuf types.

use futures::{Stream, StreamExt};
use kvlease_proto::v1 as pb;

use crate::error::ApiError;
use crate::logprobs::TokenLp;
use crate::request::{Generate, Input};
use crate::structured::Grammar;

/// The scheduler request of `g` for `tenant`, traced under the
/// client-visible `id`.
pub fn generate_request(g: &Generate, id: &str, tenant: &str) -> pb::GenerateRequest {
    let mut r = pb::GenerateRequest {
        max_tokens: g.max_tokens,
        temperature: g.temperature,
        top_p: g.top_p,
        seed: g.seed,
        top_k: g.top_k,
        min_p: g.min_p,
        frequency_penalty: g.frequency_penalty,
        presence_penalty: g.presence_penalty,
        repetition_penalty: g.repetition_penalty,
        logit_bias: g.logit_bias.iter().copied().collect(),
        min_tokens: g.min_tokens,
        stop: g.stop.clone(),
        // The authenticated tenant's prefix reuse is kept apart from other
        // tenants'. Not `user`: anyone sets it, so salting by it let
        // `user=alice` read alice's cached prefixes (issue 29, finding 5).
        cache_salt: tenant.to_string(),
        request_id: id.to_string(),
        ignore_eos: g.ignore_eos,
        stop_tokens: g.stop_token_ids.clone(),
        n: g.n,
        beam_width: g.beam_width,
        retain: g.retain.map(|h| pb::RetainPrefix {
            tokens: h.tokens,
            priority: h.priority,
            ttl_s: h.ttl_s,
        }),
        logprobs: g.logprobs.map(|top| pb::LogprobsRequest {
            top,
            prompt: g.echo,
        }),
        echo: g.echo,
        grammar: g.grammar.as_ref().map(grammar_message),
        ..Default::default()
    };
    match &g.input {
        Input::Text(t) => r.text = t.clone(),
        Input::Tokens(t) => r.tokens = t.clone(),
        Input::Chat(messages) => {
            r.messages = messages
                .iter()
                .map(|(role, content)| pb::ChatMessage {
                    role: role.clone(),
                    content: content.clone(),
                })
                .collect();
        }
    }
    r
}

/// A structured-output request as the scheduler's `Grammar`.
fn grammar_message(g: &Grammar) -> pb::Grammar {
    use pb::grammar::Kind;
    let kind = match g {
        Grammar::JsonObject => Kind::JsonObject(true),
        Grammar::JsonSchema(s) => Kind::JsonSchema(s.clone()),
        Grammar::Lark(s) => Kind::Lark(s.clone()),
        Grammar::Regex(s) => Kind::Regex(s.clone()),
    };
    pb::Grammar { kind: Some(kind) }
}

/// How a request ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum End {
    /// `max_tokens` reached: OpenAI's `"length"`.
    Length,
    /// An end-of-sequence token or a stop string: `"stop"`.
    Stop,
    /// Rejected, failed or cancelled: the error to answer with.
    Failed(ApiError),
}

impl End {
    /// OpenAI's `finish_reason`, for the ends that have one.
    pub fn finish_reason(&self) -> Option<&'static str> {
        match self {
            End::Length => Some("length"),
            End::Stop => Some("stop"),
            End::Failed(_) => None,
        }
    }
}

/// One message of the response stream.
#[derive(Debug, Clone, PartialEq)]
pub struct Piece {
    /// The choice (parallel sample) it belongs to.
    pub index: u32,
    pub text: String,
    /// One per token, when logprobs were asked.
    pub logprobs: Vec<TokenLp>,
    /// With echo and logprobs, the first message: one per prompt token.
    pub prompt_logprobs: Vec<TokenLp>,
    /// With echo, the first message: the prompt's text.
    pub prompt_text: String,
    /// Tokens generated in this message.
    pub tokens: u32,
    /// The prompt's tokens (first message only; 0 elsewhere).
    pub prompt_tokens: u32,
    /// Prompt tokens served from cached blocks (first message only).
    pub cached_tokens: u32,
    /// Prompt tokens kept under the request's retention hint (first
    /// message only).
    pub retained_tokens: u32,
    /// Set on the last piece.
    pub end: Option<End>,
}

impl Piece {
    /// The end of a stream that closed without a finish reason.
    pub fn unfinished() -> Self {
        Self::failed(ApiError::upstream(
            "the scheduler closed the stream without a finish reason",
        ))
    }

    fn failed(e: ApiError) -> Self {
        Self {
            index: 0,
            text: String::new(),
            logprobs: Vec::new(),
            prompt_logprobs: Vec::new(),
            prompt_text: String::new(),
            tokens: 0,
            prompt_tokens: 0,
            cached_tokens: 0,
            retained_tokens: 0,
            end: Some(End::Failed(e)),
        }
    }
}

/// The scheduler's response stream of a request of `n` choices as pieces,
/// ending with the piece that ends the last choice, or with the first
/// [`End::Failed`]: a gRPC error mid-stream, or a stream that closes before
/// every choice ended, becomes one.
pub fn pieces<S>(stream: S, n: u32) -> impl Stream<Item = Piece> + Send + 'static
where
    S: Stream<Item = Result<pb::GenerateResponse, tonic::Status>> + Send + Unpin + 'static,
{
    futures::stream::unfold(Some((stream, n.max(1))), |state| async move {
        let (mut stream, mut left) = state?;
        let piece = match stream.next().await {
            Some(Ok(m)) => piece(m),
            Some(Err(status)) => Piece::failed(status.into()),
            None => Piece::unfinished(),
        };
        let next = match &piece.end {
            None => Some((stream, left)),
            Some(End::Failed(_)) => None,
            Some(_) => {
                left -= 1;
                (left > 0).then_some((stream, left))
            }
        };
        Some((piece, next))
    })
}

/// One response message as a piece.
pub fn piece(m: pb::GenerateResponse) -> Piece {
    let end = match pb::FinishReason::try_from(m.finish_reason) {
        Ok(pb::FinishReason::Unspecified) => None,
        Ok(pb::FinishReason::Length) => Some(End::Length),
        Ok(pb::FinishReason::Stop) => Some(End::Stop),
        Ok(pb::FinishReason::Rejected) => {
            Some(End::Failed(rejected(m.reject.as_ref(), &m.message)))
        }
        Ok(pb::FinishReason::Cancelled) => Some(End::Failed(if m.message.contains("deadline") {
            ApiError::timeout(format!("request cancelled: {}", m.message))
        } else {
            ApiError::unavailable(format!("request cancelled: {}", m.message))
        })),
        Ok(pb::FinishReason::Error) => Some(End::Failed(ApiError::upstream(format!(
            "the request failed in the cluster: {}",
            m.message
        )))),
        Err(_) => Some(End::Failed(ApiError::upstream(format!(
            "the scheduler sent an unknown finish reason {}",
            m.finish_reason
        )))),
    };
    let lps = |v: Vec<pb::TokenLogprob>| -> Vec<TokenLp> {
        v.into_iter()
            .map(|l| TokenLp {
                bytes: l.bytes,
                logprob: l.logprob,
                top: l.top.into_iter().map(|t| (t.bytes, t.logprob)).collect(),
            })
            .collect()
    };
    Piece {
        index: m.index,
        tokens: u32::try_from(m.tokens.len()).unwrap_or(u32::MAX),
        text: m.text,
        logprobs: lps(m.logprobs),
        prompt_logprobs: lps(m.prompt_logprobs),
        prompt_text: m.prompt_text,
        prompt_tokens: m.prompt_tokens,
        cached_tokens: m.reused_tokens,
        retained_tokens: m.retained_tokens,
        end,
    }
}

/// A REJECTED finish as the client's error: the reason, whether to retry,
/// and the cache's figures.
fn rejected(reject: Option<&pb::Reject>, message: &str) -> ApiError {
    let Some(r) = reject else {
        return ApiError::unavailable(format!("request rejected: {message}"));
    };
    let reason = pb::RejectReason::try_from(r.reason).unwrap_or(pb::RejectReason::Unspecified);
    let name = reason.as_str_name();
    let (transient, advice) = match reason {
        pb::RejectReason::ExceedsCapacity => (
            false,
            "the request cannot fit even in an empty pool: never retry it; send a shorter prompt or a smaller max_tokens",
        ),
        pb::RejectReason::PoolExhausted
        | pb::RejectReason::QuotaExceeded
        | pb::RejectReason::RolledBack
        | pb::RejectReason::CacheRestarted => (true, "transient: retry later"),
        pb::RejectReason::QueueTimeout => (
            true,
            "the request waited in the scheduler's queue past its maximum wait: the cluster is overloaded, retry later",
        ),
        _ => (true, "retry later"),
    };
    let mut text = format!(
        "request rejected: {name} in pool {} (window {}): {} blocks needed, {} free, {} pending free; {advice}",
        r.pool_id, r.window, r.blocks_needed, r.blocks_free, r.blocks_pending_free
    );
    if !r.message.is_empty() {
        text.push_str(&format!(" ({})", r.message));
    }
    ApiError::rejected(name, transient, text)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rejected_message(reason: pb::RejectReason) -> pb::GenerateResponse {
        pb::GenerateResponse {
            finish_reason: pb::FinishReason::Rejected as i32,
            reject: Some(pb::Reject {
                reason: reason as i32,
                pool_id: 1,
                window: 64,
                blocks_needed: 12,
                blocks_free: 3,
                blocks_pending_free: 2,
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    fn error_of(p: Piece) -> ApiError {
        match p.end {
            Some(End::Failed(e)) => e,
            other => panic!("not failed: {other:?}"),
        }
    }

    #[test]
    fn rejects_carry_reason_figures_and_whether_to_retry() {
        let e = error_of(piece(rejected_message(pb::RejectReason::PoolExhausted)));
        assert_eq!(e.status.as_u16(), 429);
        assert_eq!(e.code.as_deref(), Some("pool_exhausted"));
        for needle in [
            "POOL_EXHAUSTED",
            "pool 1 (window 64)",
            "12 blocks needed",
            "3 free",
            "2 pending free",
            "retry later",
        ] {
            assert!(
                e.message.contains(needle),
                "{needle:?} not in {:?}",
                e.message
            );
        }
        let e = error_of(piece(rejected_message(pb::RejectReason::QuotaExceeded)));
        assert_eq!(e.status.as_u16(), 429);
        let e = error_of(piece(rejected_message(pb::RejectReason::ExceedsCapacity)));
        assert_eq!(e.status.as_u16(), 400);
        assert!(e.message.contains("never retry"), "{}", e.message);
    }

    #[test]
    fn a_queue_timeout_is_a_429_that_says_the_cluster_is_overloaded() {
        let e = error_of(piece(rejected_message(pb::RejectReason::QueueTimeout)));
        assert_eq!(e.status.as_u16(), 429);
        assert_eq!(e.code.as_deref(), Some("queue_timeout"));
        assert!(e.message.contains("QUEUE_TIMEOUT"), "{}", e.message);
        assert!(
            e.message.contains("overloaded, retry later"),
            "{}",
            e.message
        );
    }

    #[test]
    fn other_ends_map_to_finish_reasons_or_gateway_errors() {
        let end = |reason: pb::FinishReason, message: &str| {
            piece(pb::GenerateResponse {
                finish_reason: reason as i32,
                message: message.into(),
                ..Default::default()
            })
            .end
        };
        assert_eq!(end(pb::FinishReason::Unspecified, ""), None);
        assert_eq!(end(pb::FinishReason::Length, ""), Some(End::Length));
        assert_eq!(end(pb::FinishReason::Stop, ""), Some(End::Stop));
        let status = |e: Option<End>| match e {
            Some(End::Failed(e)) => e.status.as_u16(),
            other => panic!("{other:?}"),
        };
        assert_eq!(status(end(pb::FinishReason::Error, "worker died")), 502);
        assert_eq!(
            status(end(pb::FinishReason::Cancelled, "deadline exceeded")),
            504
        );
        assert_eq!(
            status(end(pb::FinishReason::Cancelled, "shutting down")),
            503
        );
    }

    #[tokio::test]
    async fn a_stream_that_breaks_or_closes_early_ends_failed() {
        let tokens = pb::GenerateResponse {
            tokens: vec![1, 2],
            text: "ab".into(),
            prompt_tokens: 5,
            reused_tokens: 4,
            ..Default::default()
        };
        let got: Vec<Piece> = pieces(futures::stream::iter(vec![Ok(tokens.clone())]), 1)
            .collect()
            .await;
        assert_eq!(got.len(), 2);
        assert_eq!(
            (got[0].tokens, got[0].prompt_tokens, got[0].cached_tokens),
            (2, 5, 4)
        );
        assert_eq!(got[1], Piece::unfinished());
        let got: Vec<Piece> = pieces(
            futures::stream::iter(vec![
                Ok(tokens),
                Err(tonic::Status::unavailable("gone")),
                Ok(pb::GenerateResponse::default()),
            ]),
            1,
        )
        .collect()
        .await;
        assert_eq!(got.len(), 2, "nothing is read after the end");
        assert_eq!(error_of(got[1].clone()).status.as_u16(), 503);
    }

    #[tokio::test]
    async fn a_stream_of_choices_ends_with_the_last_choice_to_end() {
        let msg = |index: u32, reason: pb::FinishReason| pb::GenerateResponse {
            index,
            tokens: vec![1],
            text: "a".into(),
            finish_reason: reason as i32,
            ..Default::default()
        };
        let stream = || {
            futures::stream::iter(vec![
                Ok(msg(1, pb::FinishReason::Unspecified)),
                Ok(msg(1, pb::FinishReason::Stop)),
                Ok(msg(0, pb::FinishReason::Length)),
                Ok(msg(2, pb::FinishReason::Length)),
                Ok(pb::GenerateResponse::default()),
            ])
        };
        let got: Vec<Piece> = pieces(stream(), 3).collect().await;
        assert_eq!(got.len(), 4, "nothing is read after the last choice ends");
        assert_eq!(
            got.iter().map(|p| p.index).collect::<Vec<_>>(),
            vec![1, 1, 0, 2]
        );
        assert_eq!(got[3].end, Some(End::Length));
        // a stream that closes before every choice ended fails
        let got: Vec<Piece> = pieces(
            futures::stream::iter(vec![Ok(msg(0, pb::FinishReason::Length))]),
            2,
        )
        .collect()
        .await;
        assert_eq!(got.len(), 2);
        assert_eq!(got[1], Piece::unfinished());
    }
}
