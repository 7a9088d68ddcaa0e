//! Protobuf <-> domain conversion for the scheduler: Generate requests into
//! queue requests (checked against the limits), the cache's messages into
//! the domain types of `domain.rs` and back.

use kvlease_proto::v1 as pb;

use crate::domain::{
    Extra, Grant, LeaseSpec, Outcome, Reject, RejectReason, RequestId, Sampling, SeqId, Table,
};
use crate::error::{Error, Result};
use crate::queue::Request;
use crate::service::Limits;
use kvlease_tokenizer::{Message, Tokenizer};

// === the Scheduler API ===

const MAX_LABEL: usize = 256;
/// Limits on stop strings: how many, and the bytes of each.
const MAX_STOPS: usize = 16;
const MAX_STOP_BYTES: usize = 256;

/// How a request's output text is made: `None` for token-id prompts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct TextOutput {
    /// Stop strings.
    pub(crate) stop: Vec<String>,
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
pub(crate) fn validate(
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
        // never the whole string: a 1 MB one echoed pushed the reply over the message cap
        let start: String = s.chars().take(64).collect();
        return bad(format!(
            "stop string of {} bytes ({start:?}...) must be 1 to {MAX_STOP_BYTES} bytes",
            s.len()
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

// === the cache's messages ===

pub(crate) fn sequence_spec(s: &LeaseSpec, traceparent: String) -> pb::SequenceSpec {
    pb::SequenceSpec {
        seq_id: s.seq_id.get(),
        pool_group: s.pool_group.clone(),
        prompt_tokens: s.prompt_tokens.clone(),
        num_tokens: 0,
        extra: Some(extra(s.extra)),
        beam_width: 1,
        max_new_tokens: s.max_new_tokens,
        priority: s.priority,
        cache_salt: s.cache_salt.clone(),
        reserve_full_life: s.reserve_full_life,
        traceparent,
        prefill_tokens: s.prefill_tokens,
    }
}

pub(crate) fn extra(e: Extra) -> pb::ExtraTokens {
    pb::ExtraTokens {
        draft: e.draft,
        extra_kv: e.extra_kv,
        extra_decoding_steps: e.extra_decoding_steps,
    }
}

pub(crate) fn outcomes(
    method: &'static str,
    raw: Vec<pb::SequenceOutcome>,
    asked: impl ExactSizeIterator<Item = SeqId>,
) -> Result<Vec<Outcome>> {
    if raw.len() != asked.len() {
        return Err(Error::Protocol {
            peer: "cache",
            message: format!(
                "{method} answered {} outcomes for {} sequences",
                raw.len(),
                asked.len()
            ),
        });
    }
    raw.into_iter()
        .zip(asked)
        .map(|(o, seq_id)| match o.outcome {
            Some(pb::sequence_outcome::Outcome::Grant(g)) => Ok(Outcome::Grant(grant(g, seq_id))),
            Some(pb::sequence_outcome::Outcome::Reject(r)) => {
                Ok(Outcome::Reject(reject(r, seq_id)))
            }
            None => Err(Error::Protocol {
                peer: "cache",
                message: format!("{method} outcome without grant or reject"),
            }),
        })
        .collect()
}

pub(crate) fn grant(g: pb::Grant, seq_id: SeqId) -> Grant {
    Grant {
        // outcomes are in request order; trust the order over the echoed id
        seq_id,
        tables: g
            .tables
            .into_iter()
            .filter(|t| t.beam == 0)
            .map(|t| Table {
                pool_id: t.pool_id,
                window: t.window,
                first_block: t.first_block,
                block_ids: t.block_ids,
            })
            .collect(),
        reused_tokens: g.reused_tokens,
        capacity_tokens: g.capacity_tokens,
        copies: g
            .copies
            .into_iter()
            .map(|c| crate::domain::BlockCopy {
                pool_id: c.pool_id,
                window: c.window,
                src_block: c.src_block,
                dst_block: c.dst_block,
                tokens: c.tokens,
            })
            .collect(),
        tier_copies: g.tier_copies.iter().map(tier_copy_from_pb).collect(),
    }
}

fn tier_copy_from_pb(c: &pb::TierCopy) -> crate::domain::TierCopy {
    crate::domain::TierCopy {
        pool_id: c.pool_id,
        window: c.window,
        // DEMOTE is 0: an unknown direction reads as it, like any proto3 enum.
        demote: c.direction != pb::tier_copy::Direction::Onboard as i32,
        device_block: c.device_block,
        host_block: c.host_block,
    }
}

pub(crate) fn tier_copy_to_pb(c: &crate::domain::TierCopy) -> pb::TierCopy {
    let direction = if c.demote {
        pb::tier_copy::Direction::Demote
    } else {
        pb::tier_copy::Direction::Onboard
    };
    pb::TierCopy {
        pool_id: c.pool_id,
        window: c.window,
        direction: direction as i32,
        device_block: c.device_block,
        host_block: c.host_block,
    }
}

pub(crate) fn reject(r: pb::Reject, seq_id: SeqId) -> Reject {
    Reject {
        seq_id,
        reason: reject_reason(r.reason()),
        pool_id: r.pool_id,
        window: r.window,
        blocks_needed: r.blocks_needed,
        blocks_free: r.blocks_free,
        blocks_pending_free: r.blocks_pending_free,
        message: r.message,
    }
}

pub(crate) fn reject_reason(r: pb::RejectReason) -> RejectReason {
    match r {
        pb::RejectReason::PoolExhausted => RejectReason::PoolExhausted,
        pb::RejectReason::ExceedsCapacity => RejectReason::ExceedsCapacity,
        pb::RejectReason::RolledBack => RejectReason::RolledBack,
        pb::RejectReason::UnknownSequence => RejectReason::UnknownSequence,
        pb::RejectReason::DuplicateSequence => RejectReason::DuplicateSequence,
        pb::RejectReason::QuotaExceeded => RejectReason::QuotaExceeded,
        pb::RejectReason::CacheRestarted => RejectReason::CacheRestarted,
        pb::RejectReason::QueueTimeout => RejectReason::QueueTimeout,
        pb::RejectReason::Unspecified => RejectReason::Other,
    }
}

/// The protocol's form of a domain reject (for the client stream).
pub(crate) fn reject_to_proto(r: &Reject) -> pb::Reject {
    pb::Reject {
        seq_id: r.seq_id.get(),
        reason: kvlease_proto::reject_reason(r.reason.protocol_name()) as i32,
        pool_id: r.pool_id,
        window: r.window,
        blocks_needed: r.blocks_needed,
        blocks_free: r.blocks_free,
        blocks_pending_free: r.blocks_pending_free,
        message: r.message.clone(),
    }
}

/// `Match`'s answer as reused tokens per prompt and group, checked against
/// what was asked (one row per prompt, one figure per group).
pub(crate) fn match_results(
    raw: Vec<pb::MatchResult>,
    prompts: usize,
    groups: usize,
) -> Result<Vec<Vec<u32>>> {
    if raw.len() != prompts || raw.iter().any(|r| r.reused_tokens.len() != groups) {
        return Err(Error::Protocol {
            peer: "cache",
            message: format!(
                "Match answered {} rows for {prompts} prompts of {groups} groups",
                raw.len()
            ),
        });
    }
    Ok(raw.into_iter().map(|r| r.reused_tokens).collect())
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
}
