//! Protobuf <-> domain conversion for the scheduler: Generate requests into
//! queue requests (checked against the limits), the cache's messages into
//! the domain types of `domain.rs` and back.

use kvlease_proto::v1 as pb;

use crate::domain::{
    ExtendSpec, Extra, ForwardItem, ForwardResult, Grant, LeaseMode, LeaseSpec, Logprobs, Outcome,
    Reject, RejectReason, RequestId, Retain, Sampling, SeqId, Step, StepCall, Table, TierCopy,
    TierDirection, TokenLogprob,
};
use crate::error::{Error, Result};
use crate::queue::Request;
use crate::session::Session;
use crate::traces::ChunkTrace;
use std::sync::Arc;

use kvlease_tokenizer::grammar::Constraint;
use kvlease_tokenizer::{Message, Tokenizer};

// === the Scheduler API ===

/// Limits a request is validated against.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Limits {
    /// Largest `max_tokens`.
    pub(crate) max_tokens: u32,
    /// Largest prompt + `max_tokens`.
    pub(crate) max_context: u32,
    /// Token ids must be below this.
    pub(crate) vocab_size: u32,
}

const MAX_LABEL: usize = 256;
/// Limits on stop strings: how many, and the bytes of each.
const MAX_STOPS: usize = 16;
const MAX_STOP_BYTES: usize = 256;
/// Most parallel samples (`GenerateRequest.n`) one request may ask for.
pub(crate) const MAX_SAMPLES: u32 = 16;
use crate::beam::MAX_BEAM_WIDTH;

/// How a request's output text is made. Every request gets its text, a
/// token-id prompt too: clients that tokenize themselves (load generators)
/// still read the output as text, and stop strings apply to it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct TextOutput {
    /// Stop strings.
    pub(crate) stop: Vec<String>,
    /// Output tokens before which no stop string ends the request.
    pub(crate) min_tokens: u32,
    /// Send the prompt's text on the first response (`echo`).
    pub(crate) echo: bool,
}

/// The field a request gives its prompt in: `messages`, `text` or `tokens`.
fn prompt_field(req: &pb::GenerateRequest) -> &'static str {
    if !req.messages.is_empty() {
        "messages"
    } else if !req.text.is_empty() {
        "text"
    } else {
        "tokens"
    }
}

/// An [`Error::InvalidField`] of `field`.
fn invalid(field: &'static str, message: String) -> Error {
    Error::InvalidField { field, message }
}

/// The prompt of a request: its text, its chat or its token ids.
fn prompt_ids(req: &pb::GenerateRequest, tokenizer: &Tokenizer) -> Result<Vec<u32>, Error> {
    let given = [
        !req.text.is_empty(),
        !req.tokens.is_empty(),
        !req.messages.is_empty(),
    ];
    if given.iter().filter(|g| **g).count() > 1 {
        return Err(invalid(
            prompt_field(req),
            "give exactly one of text, tokens and messages".into(),
        ));
    }
    let failed = |e: kvlease_tokenizer::Error| match e {
        kvlease_tokenizer::Error::NoChatTemplate => Error::FailedPrecondition(
            "the model has no chat template: send text or tokens instead of messages".into(),
        ),
        other => invalid(prompt_field(req), other.to_string()),
    };
    if !req.messages.is_empty() {
        if let Some((i, _)) = req
            .messages
            .iter()
            .enumerate()
            .find(|(_, m)| m.role.is_empty())
        {
            return Err(invalid("messages", format!("message {i} has no role")));
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
/// its output text is made. A refusal names the field at fault
/// ([`Error::InvalidField`]).
/// The longest retention hint a request may give, in seconds (a day, as
/// the cache allows).
const MAX_RETAIN_TTL_S: u32 = 86_400;

pub(crate) fn validate(
    id: u64,
    req: &pb::GenerateRequest,
    limits: &Limits,
    tokenizer: &Tokenizer,
) -> Result<(Request, TextOutput), Error> {
    let bad = |field: &'static str, m: String| Err(invalid(field, m));
    let prompt = prompt_ids(req, tokenizer)?;
    let prompt_field = prompt_field(req);
    if prompt.is_empty() {
        return bad(prompt_field, "empty prompt: give text or tokens".into());
    }
    if let Some((i, t)) = prompt
        .iter()
        .enumerate()
        .find(|(_, t)| **t >= limits.vocab_size)
    {
        return bad(
            prompt_field,
            format!(
                "prompt token {t} at index {i} is outside the vocabulary of {}",
                limits.vocab_size
            ),
        );
    }
    if req.max_tokens == 0 {
        return bad("max_tokens", "max_tokens must be at least 1".into());
    }
    if req.max_tokens > limits.max_tokens {
        return bad(
            "max_tokens",
            format!(
                "max_tokens {} is over the limit of {}",
                req.max_tokens, limits.max_tokens
            ),
        );
    }
    let total = prompt.len() as u64 + u64::from(req.max_tokens);
    if total > u64::from(limits.max_context) {
        // max_tokens is the field a client can shrink without changing the prompt
        return bad(
            "max_tokens",
            format!(
                "prompt of {} tokens plus max_tokens {} exceeds the context limit of {} tokens",
                prompt.len(),
                req.max_tokens,
                limits.max_context
            ),
        );
    }
    if let Some(t) = req.stop_tokens.iter().find(|t| **t >= limits.vocab_size) {
        return bad(
            "stop_tokens",
            format!(
                "stop token {t} is outside the vocabulary of {}",
                limits.vocab_size
            ),
        );
    }
    if req.stop.len() > MAX_STOPS {
        return bad(
            "stop",
            format!("{} stop strings; at most {MAX_STOPS}", req.stop.len()),
        );
    }
    if let Some(s) = req
        .stop
        .iter()
        .find(|s| s.is_empty() || s.len() > MAX_STOP_BYTES)
    {
        // never the whole string: a 1 MB one echoed pushed the reply over the message cap
        let start: String = s.chars().take(64).collect();
        return bad(
            "stop",
            format!(
                "stop string of {} bytes ({start:?}...) must be 1 to {MAX_STOP_BYTES} bytes",
                s.len()
            ),
        );
    }
    if req.n > MAX_SAMPLES {
        return bad(
            "n",
            format!("n must be 1 to {MAX_SAMPLES} samples, got {}", req.n),
        );
    }
    if req.priority > 100 {
        return bad(
            "priority",
            format!("priority must be 0 to 100, got {}", req.priority),
        );
    }
    if let Some(h) = &req.retain {
        if h.tokens == 0 || h.tokens as usize > prompt.len() {
            return bad(
                "retain.tokens",
                format!(
                    "retain.tokens must be 1 to the prompt's {} tokens, got {}",
                    prompt.len(),
                    h.tokens
                ),
            );
        }
        if h.priority > 100 {
            return bad(
                "retain.priority",
                format!("retain.priority must be 0 to 100, got {}", h.priority),
            );
        }
        if h.ttl_s == 0 || h.ttl_s > MAX_RETAIN_TTL_S {
            return bad(
                "retain.ttl_s",
                format!(
                    "retain.ttl_s must be 1 to {MAX_RETAIN_TTL_S}, got {}",
                    h.ttl_s
                ),
            );
        }
    }
    for (field, label) in [
        ("cache_salt", &req.cache_salt),
        ("request_id", &req.request_id),
    ] {
        if label.len() > MAX_LABEL {
            return bad(field, format!("{field} is limited to {MAX_LABEL} bytes"));
        }
    }
    let beam_width = beam_width(req)?;
    let logprobs = logprobs(req)?;
    let mut sampling = sampling(req, limits)?;
    sampling.grammar = constraint(req, tokenizer)?;
    let mut r = Request::new(RequestId(id), prompt, req.max_tokens);
    r.logprobs = logprobs;
    r.sampling = sampling;
    r.n = req.n.max(1);
    r.beam_width = beam_width;
    r.stop_tokens = req.stop_tokens.clone();
    if !req.ignore_eos {
        r.stop_tokens.extend_from_slice(tokenizer.end_ids());
    }
    r.priority = req.priority;
    r.cache_salt = req.cache_salt.clone();
    r.retain = req.retain.map(|h| Retain {
        tokens: h.tokens,
        priority: h.priority,
        ttl_ms: h.ttl_s * 1000,
        tenant: String::new(),
    });
    let text = TextOutput {
        stop: req.stop.clone(),
        min_tokens: req.min_tokens,
        echo: req.echo,
    };
    Ok((r, text))
}

/// A request's `logprobs`: at most [`MAX_TOP_LOGPROBS`] alternatives; the
/// prompt's are computed without prefix reuse, which a retention hint
/// needs, so the two do not go together.
/// The request's beam width (1: no beam search), and the fields that make
/// no sense with beams refused: beams rank the model's raw log-softmax, so
/// nothing that changes or constrains the distribution, no text-level stop
/// (a hypothesis ends at a token), no logprobs (a beam's row serves the
/// search), at most `beam_width` hypotheses.
fn beam_width(req: &pb::GenerateRequest) -> Result<u32, Error> {
    let width = req.beam_width.max(1);
    if width > MAX_BEAM_WIDTH {
        return Err(invalid(
            "beam_width",
            format!(
                "beam_width must be 1 to {MAX_BEAM_WIDTH}, got {}",
                req.beam_width
            ),
        ));
    }
    if width == 1 {
        return Ok(1);
    }
    if req.n > width {
        return Err(invalid(
            "n",
            format!(
                "n must be at most beam_width ({width}) with beam search, got {}",
                req.n
            ),
        ));
    }
    let off = |v: f32| v == 0.0;
    let refused = [
        ("temperature", !off(req.temperature)),
        ("top_p", !(off(req.top_p) || req.top_p == 1.0)),
        ("top_k", req.top_k != 0),
        ("min_p", !off(req.min_p)),
        ("frequency_penalty", !off(req.frequency_penalty)),
        ("presence_penalty", !off(req.presence_penalty)),
        (
            "repetition_penalty",
            !(off(req.repetition_penalty) || req.repetition_penalty == 1.0),
        ),
        ("logit_bias", !req.logit_bias.is_empty()),
        ("min_tokens", req.min_tokens != 0),
        ("stop", !req.stop.is_empty()),
        ("logprobs", req.logprobs.is_some()),
        ("grammar", req.grammar.is_some()),
    ];
    if let Some((field, _)) = refused.iter().find(|(_, set)| *set) {
        return Err(invalid(
            field,
            format!("{field} is not served with beam search (beam_width {width})"),
        ));
    }
    Ok(width)
}

fn logprobs(req: &pb::GenerateRequest) -> Result<Option<Logprobs>, Error> {
    let Some(l) = &req.logprobs else {
        return Ok(None);
    };
    if l.top > MAX_TOP_LOGPROBS {
        return Err(invalid(
            "logprobs.top",
            format!(
                "logprobs.top must be 0 to {MAX_TOP_LOGPROBS}, got {}",
                l.top
            ),
        ));
    }
    if l.prompt && req.retain.is_some() {
        return Err(invalid(
            "retain",
            "a retention hint cannot be combined with logprobs.prompt: the prompt's logprobs \
             compute every position and reuse no cached prefix"
                .into(),
        ));
    }
    Ok(Some(Logprobs {
        top: l.top,
        prompt: l.prompt,
    }))
}

/// Alternatives per token a request may ask (OpenAI's chat maximum).
pub(crate) const MAX_TOP_LOGPROBS: u32 = 20;

/// Entries of `logit_bias` a request may carry (OpenAI allows 300).
const MAX_LOGIT_BIAS: usize = 1024;

/// The sampling parameters of a Generate request, each checked against its
/// range (`scheduler.proto`); a refusal names the field.
fn sampling(req: &pb::GenerateRequest, limits: &Limits) -> Result<Sampling, Error> {
    let bad = |field: &'static str, m: String| Err(invalid(field, m));
    if !req.temperature.is_finite() || req.temperature < 0.0 {
        return bad(
            "temperature",
            format!(
                "temperature must be a finite number >= 0, got {}",
                req.temperature
            ),
        );
    }
    for (field, v, range) in [
        ("top_p", req.top_p, 0.0..=1.0),
        ("min_p", req.min_p, 0.0..=1.0),
        ("frequency_penalty", req.frequency_penalty, -2.0..=2.0),
        ("presence_penalty", req.presence_penalty, -2.0..=2.0),
    ] {
        if !v.is_finite() || !range.contains(&v) {
            return bad(
                field,
                format!(
                    "{field} must be in [{}, {}], got {v}",
                    range.start(),
                    range.end()
                ),
            );
        }
    }
    let rep = req.repetition_penalty;
    if !rep.is_finite() || rep < 0.0 || rep > i32::MAX as f32 {
        return bad(
            "repetition_penalty",
            format!("repetition_penalty must be > 0 (0 reads as 1), got {rep}"),
        );
    }
    if req.logit_bias.len() > MAX_LOGIT_BIAS {
        return bad(
            "logit_bias",
            format!(
                "{} logit_bias entries; at most {MAX_LOGIT_BIAS}",
                req.logit_bias.len()
            ),
        );
    }
    let mut logit_bias: Vec<(u32, f32)> = req.logit_bias.iter().map(|(&t, &b)| (t, b)).collect();
    logit_bias.sort_by_key(|&(t, _)| t);
    if let Some((t, b)) = logit_bias
        .iter()
        .find(|(t, b)| *t >= limits.vocab_size || !(b.is_finite() && (-100.0..=100.0).contains(b)))
    {
        return bad(
            "logit_bias",
            format!(
                "logit_bias {b} for token {t}: tokens must be inside the vocabulary of {} and \
                 biases in [-100, 100]",
                limits.vocab_size
            ),
        );
    }
    if req.min_tokens > req.max_tokens {
        return bad(
            "min_tokens",
            format!(
                "min_tokens {} is over max_tokens {}",
                req.min_tokens, req.max_tokens
            ),
        );
    }
    Ok(Sampling {
        temperature: req.temperature,
        top_p: req.top_p,
        top_k: req.top_k,
        min_p: req.min_p,
        seed: req.seed,
        frequency_penalty: req.frequency_penalty,
        presence_penalty: req.presence_penalty,
        repetition_penalty: rep,
        logit_bias,
        min_tokens: req.min_tokens,
        grammar: None,
    })
}

/// Longest schema, grammar or regex a request may carry.
const MAX_GRAMMAR_BYTES: usize = 256 << 10;

/// A request's `grammar`, compiled once against the model's vocabulary so
/// that a bad one is refused here, naming its field and the engine's
/// message; `None` when absent.
fn constraint(
    req: &pb::GenerateRequest,
    tokenizer: &Tokenizer,
) -> Result<Option<Arc<Constraint>>, Error> {
    use pb::grammar::Kind;
    let Some(g) = &req.grammar else {
        return Ok(None);
    };
    let (field, c) = match &g.kind {
        None => {
            return Err(invalid(
                "grammar",
                "grammar sets no kind (json_object, json_schema, lark or regex)".into(),
            ));
        }
        Some(Kind::JsonObject(_)) => ("grammar", Constraint::JsonObject),
        Some(Kind::JsonSchema(s)) => ("grammar.json_schema", Constraint::JsonSchema(s.clone())),
        Some(Kind::Lark(s)) => ("grammar.lark", Constraint::Lark(s.clone())),
        Some(Kind::Regex(s)) => ("grammar.regex", Constraint::Regex(s.clone())),
    };
    let text_len = match &c {
        Constraint::JsonObject => 0,
        Constraint::JsonSchema(s) | Constraint::Lark(s) | Constraint::Regex(s) => s.len(),
    };
    if text_len > MAX_GRAMMAR_BYTES {
        return Err(invalid(
            field,
            format!("{field} of {text_len} bytes; at most {MAX_GRAMMAR_BYTES}"),
        ));
    }
    if req.ignore_eos {
        return Err(invalid(
            "ignore_eos",
            "ignore_eos cannot be combined with a grammar: a complete output ends on the \
             model's end token"
                .into(),
        ));
    }
    if req.min_tokens > 0 {
        return Err(invalid(
            "min_tokens",
            "min_tokens cannot be combined with a grammar: a complete output ends on the \
             model's end token"
                .into(),
        ));
    }
    let grammars = tokenizer
        .grammars()
        .map_err(|e| invalid("grammar", format!("this model cannot serve a grammar: {e}")))?;
    grammars
        .compile(&c)
        .map_err(|e| invalid(field, e.to_string()))?;
    Ok(Some(Arc::new(c)))
}

/// A constraint as its `Grammar` message.
fn grammar_message(c: &Constraint) -> pb::Grammar {
    use pb::grammar::Kind;
    let kind = match c {
        Constraint::JsonObject => Kind::JsonObject(true),
        Constraint::JsonSchema(s) => Kind::JsonSchema(s.clone()),
        Constraint::Lark(s) => Kind::Lark(s.clone()),
        Constraint::Regex(s) => Kind::Regex(s.clone()),
    };
    pb::Grammar { kind: Some(kind) }
}

// === the cache's messages ===

/// Item `i`'s trace context among `traces` (the W3C `traceparent` of its
/// request, which a batched cache call carries per item); empty when there is
/// none, e.g. warm-up calls that pass no traces.
fn item_trace(traces: &[String], i: usize) -> String {
    traces.get(i).cloned().unwrap_or_default()
}

pub(crate) fn lease_request(
    session: Session,
    step: Step,
    mode: LeaseMode,
    specs: &[LeaseSpec],
    traces: &[String],
) -> pb::LeaseRequest {
    let warmup = mode == LeaseMode::Warmup;
    pb::LeaseRequest {
        session_id: session.id.get(),
        epoch: session.epoch.get(),
        step: step.get(),
        // warm-up leases a shape whole or not at all
        atomic: warmup,
        warmup,
        sequences: specs
            .iter()
            .enumerate()
            .map(|(i, spec)| {
                let mut s = sequence_spec(spec, item_trace(traces, i));
                // the loop's admission waits after these refusals and leases
                // again; warm-up fails instead
                s.refusal_retried = !warmup;
                s
            })
            .collect(),
    }
}

/// Extend items for `specs`, with their `traces` as for [`lease_request`].
fn extend_items(specs: &[ExtendSpec], traces: &[String]) -> Vec<pb::ExtendItem> {
    specs
        .iter()
        .enumerate()
        .map(|(i, e)| pb::ExtendItem {
            seq_id: e.seq_id.get(),
            new_tokens: e.new_tokens.clone(),
            num_tokens: 0,
            traceparent: item_trace(traces, i),
            written_tokens: e.written_tokens,
            from_length: e.from_length,
        })
        .collect()
}

pub(crate) fn extend_request(
    session: Session,
    step: Step,
    specs: &[ExtendSpec],
    traces: &[String],
) -> pb::ExtendRequest {
    pb::ExtendRequest {
        session_id: session.id.get(),
        epoch: session.epoch.get(),
        step: step.get(),
        atomic: false,
        items: extend_items(specs, traces),
    }
}

/// An all-or-nothing extend of each sequence by a number of tokens whose
/// ids are not known (warm-up).
pub(crate) fn extend_by_request(
    session: Session,
    step: Step,
    items: &[(SeqId, u32)],
) -> pb::ExtendRequest {
    pb::ExtendRequest {
        session_id: session.id.get(),
        epoch: session.epoch.get(),
        step: step.get(),
        atomic: true,
        items: items
            .iter()
            .map(|&(seq_id, n)| pb::ExtendItem {
                seq_id: seq_id.get(),
                new_tokens: Vec::new(),
                num_tokens: n,
                traceparent: String::new(),
                written_tokens: 0,
                from_length: 0,
            })
            .collect(),
    }
}

pub(crate) fn release_request(
    session: Session,
    seq_ids: &[SeqId],
    fence_step: Option<Step>,
    discard_unwritten: bool,
    traces: &[String],
) -> pb::ReleaseRequest {
    pb::ReleaseRequest {
        session_id: session.id.get(),
        epoch: session.epoch.get(),
        seq_ids: seq_ids.iter().map(|s| s.get()).collect(),
        fence_step: fence_step.map(Step::get),
        traceparents: traces.to_vec(),
        discard_unwritten,
    }
}

pub(crate) fn step_request(session: Session, call: &StepCall<'_>) -> pb::StepRequest {
    pb::StepRequest {
        session_id: session.id.get(),
        epoch: session.epoch.get(),
        release: call.release.map(|r| pb::StepRelease {
            seq_ids: r.seq_ids.iter().map(|s| s.get()).collect(),
            fence_step: r.fence_step.map(Step::get),
            traceparents: r.traces.to_vec(),
            discard_unwritten: r.discard_unwritten,
        }),
        complete_step: call.complete_step.map(Step::get),
        extend: call.extend.map(|e| pb::StepExtend {
            step: e.step.get(),
            atomic: false,
            items: extend_items(e.specs, e.traces),
        }),
    }
}

pub(crate) fn complete_step_request(session: Session, step: Step) -> pb::CompleteStepRequest {
    pb::CompleteStepRequest {
        session_id: session.id.get(),
        epoch: session.epoch.get(),
        step: step.get(),
    }
}

/// Blocks a release freed at once and blocks it fenced.
pub(crate) fn release_counts(r: &pb::ReleaseResponse) -> (u64, u64) {
    let freed = r.results.iter().map(|x| u64::from(x.blocks_freed)).sum();
    let fenced = r.results.iter().map(|x| u64::from(x.blocks_fenced)).sum();
    (freed, fenced)
}

pub(crate) fn sequence_spec(s: &LeaseSpec, traceparent: String) -> pb::SequenceSpec {
    pb::SequenceSpec {
        seq_id: s.seq_id.get(),
        pool_group: s.pool_group.clone(),
        // without reuse the cache gets only the count: it neither matches
        // nor publishes the prompt's blocks
        prompt_tokens: if s.reuse_prefix {
            s.prompt_tokens.clone()
        } else {
            Vec::new()
        },
        num_tokens: if s.reuse_prefix {
            0
        } else {
            u32::try_from(s.prompt_tokens.len()).unwrap_or(u32::MAX)
        },
        extra: Some(extra(s.extra)),
        beam_width: 1,
        max_new_tokens: s.max_new_tokens,
        priority: s.priority,
        cache_salt: s.cache_salt.clone(),
        reserve_full_life: s.reserve_full_life,
        traceparent,
        prefill_tokens: s.prefill_tokens,
        refusal_retried: false,
        fork_of: s.fork_of.map(SeqId::get),
        handoff_of: s.handoff_of.map(SeqId::get),
        peer_pull: s.peer_pull.map(|r| pb::PeerPullRates {
            link_bytes_per_s: r.link_bytes_per_s,
            prefill_tokens_per_s: r.prefill_tokens_per_s,
            overhead_us: r.overhead_us,
        }),
        retain: s.retain.as_ref().map(|h| pb::RetentionHint {
            tokens: h.tokens,
            priority: h.priority,
            ttl_ms: h.ttl_ms,
            tenant: h.tenant.clone(),
        }),
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
        retained_tokens: g.retained_tokens,
        peer_blocks: g
            .peer_decision
            .filter(|d| d.pulled && !g.peer_copies.is_empty())
            .map_or(0, |d| d.blocks),
        peer_copies: g
            .peer_copies
            .into_iter()
            .map(|c| crate::domain::PeerCopy {
                window: c.window,
                dst_block: c.dst_block,
                src_group: c.src_group,
                src_block: c.src_block,
                transfer_id: c.transfer_id,
                tokens: c.tokens,
            })
            .collect(),
    }
}

fn tier_copy_from_pb(c: &pb::TierCopy) -> TierCopy {
    use pb::tier_copy::Direction;
    let direction = match Direction::try_from(c.direction) {
        Ok(Direction::Onboard) => TierDirection::Onboard,
        Ok(Direction::Spill) => TierDirection::Spill,
        Ok(Direction::Load) => TierDirection::Load,
        // DEMOTE is 0: an unknown direction reads as it, like any proto3 enum.
        Ok(Direction::Demote) | Err(_) => TierDirection::Demote,
    };
    TierCopy {
        pool_id: c.pool_id,
        window: c.window,
        direction,
        device_block: c.device_block,
        host_block: c.host_block,
        disk_block: c.disk_block,
        hash: c.hash,
        parent: c.parent,
    }
}

fn tier_copy_to_pb(c: &TierCopy) -> pb::TierCopy {
    use pb::tier_copy::Direction;
    let direction = match c.direction {
        TierDirection::Demote => Direction::Demote,
        TierDirection::Onboard => Direction::Onboard,
        TierDirection::Spill => Direction::Spill,
        TierDirection::Load => Direction::Load,
    };
    pb::TierCopy {
        pool_id: c.pool_id,
        window: c.window,
        direction: direction as i32,
        device_block: c.device_block,
        host_block: c.host_block,
        disk_block: c.disk_block,
        hash: c.hash,
        parent: c.parent,
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
        pb::RejectReason::LengthMismatch => RejectReason::LengthMismatch,
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

// === the workers' messages ===

/// A Forward of `items`; `traces[i]`, when there is one, is what the worker
/// records of item `i` in its request's trace (shorter, or empty: the items
/// past its end have none).
pub(crate) fn forward_request(
    step: Step,
    after: Option<Step>,
    items: &[ForwardItem],
    tier_copies: &[TierCopy],
    traces: &[Option<ChunkTrace>],
) -> pb::ForwardRequest {
    pb::ForwardRequest {
        tier_copies: tier_copies.iter().map(tier_copy_to_pb).collect(),
        step: step.get(),
        after_step: after.map_or(0, Step::get),
        sequences: items
            .iter()
            .enumerate()
            .map(|(n, i)| forward_sequence(i, traces.get(n).and_then(Option::as_ref)))
            .collect(),
    }
}

fn forward_sequence(i: &ForwardItem, trace: Option<&ChunkTrace>) -> pb::ForwardSequence {
    pb::ForwardSequence {
        trace: trace.map(|t| pb::SequenceTrace {
            traceparent: t.traceparent.clone(),
            reused_tokens: t.reused_tokens,
            onboarded_blocks: t.onboarded_blocks,
            replica: t.replica.clone(),
        }),
        seq_id: i.seq_id.get(),
        tokens: i.tokens.clone(),
        feed_previous: i.feed_previous,
        start_pos: i.start_pos,
        tables: i
            .tables
            .iter()
            .map(|t| pb::BlockTable {
                pool_id: t.pool_id,
                window: t.window,
                beam: 0,
                first_block: t.first_block,
                block_ids: t.block_ids.clone(),
            })
            .collect(),
        return_all_argmax: i.return_all_argmax,
        sampling: Some(pb::SamplingParams {
            temperature: i.sampling.temperature,
            top_p: i.sampling.top_p,
            seed: i.sampling.seed,
            top_k: i.sampling.top_k,
            min_p: i.sampling.min_p,
            frequency_penalty: i.sampling.frequency_penalty,
            presence_penalty: i.sampling.presence_penalty,
            repetition_penalty: i.sampling.repetition_penalty,
            logit_bias: i.sampling.logit_bias.iter().copied().collect(),
            prompt_len: i.prompt_len,
            min_tokens: i.sampling.min_tokens,
            stop_ids: i.stop_ids.clone(),
            constrained: i.sampling.grammar.is_some(),
        }),
        history: i.history.as_ref().map(|tokens| pb::TokenHistory {
            tokens: tokens.clone(),
        }),
        logprobs: i.logprobs.map(|l| pb::LogprobsParams {
            top: l.top,
            prompt: l.prompt,
            next_prompt_token: l.next_prompt_token,
        }),
        // with the history only: the sequence's first pass
        grammar: i
            .history
            .as_ref()
            .and(i.sampling.grammar.as_deref())
            .map(grammar_message),
        copies: i
            .copies
            .iter()
            .map(|c| pb::BlockCopy {
                pool_id: c.pool_id,
                window: c.window,
                src_block: c.src_block,
                dst_block: c.dst_block,
                tokens: c.tokens,
            })
            .collect(),
        peer_pull: i.peer_pull.as_ref().map(|p| pb::PeerPull {
            address: p.address.clone(),
            transfer_id: p.transfer_id,
            blocks: p
                .blocks
                .iter()
                .map(
                    |&(window, src_block, dst_block, tokens)| pb::PeerBlockCopy {
                        window,
                        src_block,
                        dst_block,
                        tokens,
                    },
                )
                .collect(),
        }),
    }
}

/// A forward pass's results, checked against the `sent` sequences (one
/// result each, in order).
pub(crate) fn forward_results(
    raw: Vec<pb::ForwardResult>,
    sent: usize,
) -> Result<Vec<ForwardResult>> {
    if raw.len() != sent {
        return Err(Error::Protocol {
            peer: "worker",
            message: format!(
                "Forward answered {} results for {sent} sequences",
                raw.len()
            ),
        });
    }
    Ok(raw
        .into_iter()
        .map(|x| ForwardResult {
            seq_id: SeqId(x.seq_id),
            next_token: x.next_token,
            argmax: x.argmax,
            logprobs: x
                .logprobs
                .into_iter()
                .map(|p| TokenLogprob {
                    token: p.token,
                    logprob: p.logprob,
                    top: p.top_tokens.into_iter().zip(p.top_logprobs).collect(),
                })
                .collect(),
            error: (!x.error.is_empty()).then_some(x.error),
        })
        .collect())
}

/// `Match`'s answer as reused tokens per prompt and group, checked against
/// what was asked (one row per prompt, one figure per group).
pub(crate) fn match_results(
    raw: Vec<pb::MatchResult>,
    prompts: usize,
    groups: usize,
) -> Result<Vec<Vec<(u32, u32)>>> {
    // a cache from before peer pull sends no peer_tokens: none
    let peers_ok = |r: &pb::MatchResult| r.peer_tokens.is_empty() || r.peer_tokens.len() == groups;
    if raw.len() != prompts
        || raw
            .iter()
            .any(|r| r.reused_tokens.len() != groups || !peers_ok(r))
    {
        return Err(Error::Protocol {
            peer: "cache",
            message: format!(
                "Match answered {} rows for {prompts} prompts of {groups} groups",
                raw.len()
            ),
        });
    }
    Ok(raw
        .into_iter()
        .map(|r| {
            let peer = r.peer_tokens.iter().copied().chain(std::iter::repeat(0));
            r.reused_tokens.into_iter().zip(peer).collect()
        })
        .collect())
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
    ) -> Result<(Request, TextOutput), Error> {
        validate(id, req, limits, &Tokenizer::byte_level())
    }

    fn req(tokens: Vec<u32>, max_tokens: u32) -> pb::GenerateRequest {
        pb::GenerateRequest {
            tokens,
            max_tokens,
            ..Default::default()
        }
    }

    fn message(r: Result<(Request, TextOutput), Error>) -> String {
        match r {
            Ok(_) => "ok".into(),
            Err(e) => e.to_string(),
        }
    }

    fn session() -> Session {
        Session {
            id: crate::domain::SessionId(7),
            epoch: crate::domain::Epoch(3),
            ttl_ms: 1_000,
            max_batch: 0,
        }
    }

    #[test]
    fn lease_modes_and_ids_reach_the_protocol_unwrapped_here() {
        let spec = LeaseSpec {
            seq_id: SeqId(11),
            request: RequestId(1),
            pool_group: "g0".into(),
            prompt_tokens: vec![1, 2, 3],
            extra: Extra::default(),
            max_new_tokens: 4,
            priority: 0,
            cache_salt: String::new(),
            retain: Some(Retain {
                tokens: 3,
                priority: 70,
                ttl_ms: 5_000,
                tenant: "tenant-a".into(),
            }),
            reserve_full_life: false,
            prefill_tokens: 3,
            fork_of: Some(SeqId(9)),
            reuse_prefix: true,
            peer_pull: None,
            handoff_of: None,
        };
        let traces = ["00-t-s-01".to_string()];
        let admit = lease_request(
            session(),
            Step(5),
            LeaseMode::Admit,
            std::slice::from_ref(&spec),
            &traces,
        );
        assert_eq!(
            (
                admit.session_id,
                admit.epoch,
                admit.step,
                admit.atomic,
                admit.warmup
            ),
            (7, 3, 5, false, false)
        );
        assert_eq!(admit.sequences[0].seq_id, 11);
        assert_eq!(admit.sequences[0].fork_of, Some(9));
        assert_eq!(admit.sequences[0].traceparent, "00-t-s-01");
        assert_eq!(
            admit.sequences[0].retain,
            Some(pb::RetentionHint {
                tokens: 3,
                priority: 70,
                ttl_ms: 5_000,
                tenant: "tenant-a".into(),
            })
        );
        let warmup = lease_request(session(), Step(1), LeaseMode::Warmup, &[spec], &[]);
        assert!(warmup.atomic && warmup.warmup, "warm-up is all or nothing");
        assert_eq!(warmup.sequences[0].traceparent, "", "no trace: empty");

        let release = release_request(session(), &[SeqId(11)], Some(Step(4)), true, &[]);
        assert_eq!(
            (
                release.seq_ids,
                release.fence_step,
                release.discard_unwritten
            ),
            (vec![11], Some(4), true)
        );
        let call = StepCall {
            release: None,
            complete_step: Some(Step(4)),
            extend: None,
        };
        let step = step_request(session(), &call);
        assert_eq!(
            (step.complete_step, step.release, step.extend),
            (Some(4), None, None)
        );
        assert_eq!(complete_step_request(session(), Step(9)).step, 9);
    }

    #[test]
    fn a_forward_request_carries_each_item_and_the_step_and_its_answer_is_checked() {
        let item = ForwardItem {
            seq_id: SeqId(2),
            tokens: vec![5, 6],
            feed_previous: false,
            start_pos: 8,
            tables: vec![Table {
                pool_id: 1,
                window: 0,
                first_block: 2,
                block_ids: vec![4],
            }],
            return_all_argmax: true,
            sampling: Sampling::default(),
            prompt_len: 0,
            stop_ids: Vec::new(),
            history: None,
            copies: Vec::new(),
            logprobs: None,
            peer_pull: None,
        };
        let req = forward_request(Step(6), None, std::slice::from_ref(&item), &[], &[]);
        assert_eq!((req.step, req.after_step), (6, 0));
        assert!(!req.sequences[0].feed_previous);
        let fed = ForwardItem {
            tokens: Vec::new(),
            feed_previous: true,
            ..item.clone()
        };
        let piped = forward_request(Step(7), Some(Step(6)), &[fed], &[], &[]);
        assert_eq!((piped.step, piped.after_step), (7, 6));
        assert!(piped.sequences[0].feed_previous && piped.sequences[0].tokens.is_empty());
        let sent = &req.sequences[0];
        assert_eq!(
            (sent.seq_id, sent.start_pos, &sent.tokens),
            (2, 8, &vec![5, 6])
        );
        assert_eq!(
            (sent.tables[0].first_block, &sent.tables[0].block_ids),
            (2, &vec![4])
        );
        let answer = pb::ForwardResult {
            seq_id: 2,
            next_token: 9,
            argmax: vec![9],
            logprobs: Vec::new(),
            ..Default::default()
        };
        let results = forward_results(vec![answer.clone()], 1).unwrap();
        assert_eq!((results[0].seq_id, results[0].next_token), (SeqId(2), 9));
        let short = forward_results(vec![answer], 2).unwrap_err();
        assert!(
            short.to_string().contains("1 results for 2 sequences"),
            "{short}"
        );
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
            matches!(ok, Ok((r, _)) if r.prompt == vec![104, 0xC3, 0xA9] && r.id == RequestId(7))
        );
    }

    #[test]
    fn a_token_id_prompt_takes_stop_strings_and_gets_its_text() {
        let r = pb::GenerateRequest {
            stop: vec!["\n".into()],
            ..req(vec![104, 105], 4)
        };
        let (q, text) = validate_bytes(1, &r, &limits()).expect("token ids with a stop string");
        assert_eq!(q.prompt, vec![104, 105]);
        assert_eq!(text.stop, vec!["\n".to_string()]);
    }

    #[test]
    fn every_refusal_names_its_field_in_the_status() {
        let l = limits();
        let field = |r: pb::GenerateRequest| {
            let e = validate_bytes(1, &r, &l).map(|_| ()).expect_err("refused");
            let s = tonic::Status::from(e);
            assert_eq!(s.code(), tonic::Code::InvalidArgument, "{s:?}");
            s.metadata()
                .get(kvlease_proto::INVALID_FIELD_METADATA)
                .and_then(|v| v.to_str().ok())
                .map(str::to_string)
        };
        let base = || req(vec![1], 4);
        let retain = |tokens, priority, ttl_s| pb::GenerateRequest {
            retain: Some(pb::RetainPrefix {
                tokens,
                priority,
                ttl_s,
            }),
            ..base()
        };
        let cases = [
            (req(vec![], 4), "tokens"),
            (req(vec![300], 4), "tokens"),
            (
                pb::GenerateRequest {
                    text: "a".into(),
                    tokens: vec![1],
                    ..base()
                },
                "text",
            ),
            (
                pb::GenerateRequest {
                    messages: vec![pb::ChatMessage::default()],
                    ..base()
                },
                "messages",
            ),
            (req(vec![1], 0), "max_tokens"),
            (req(vec![1], 65), "max_tokens"),
            (req(vec![1; 100], 64), "max_tokens"),
            (
                pb::GenerateRequest {
                    temperature: f32::NAN,
                    ..base()
                },
                "temperature",
            ),
            (
                pb::GenerateRequest {
                    top_p: 2.0,
                    ..base()
                },
                "top_p",
            ),
            (
                pb::GenerateRequest {
                    stop_tokens: vec![999],
                    ..base()
                },
                "stop_tokens",
            ),
            (
                pb::GenerateRequest {
                    stop: vec![String::new()],
                    ..base()
                },
                "stop",
            ),
            (
                pb::GenerateRequest {
                    priority: 101,
                    ..base()
                },
                "priority",
            ),
            (
                pb::GenerateRequest {
                    n: MAX_SAMPLES + 1,
                    ..base()
                },
                "n",
            ),
            (retain(2, 0, 60), "retain.tokens"),
            (retain(0, 0, 60), "retain.tokens"),
            (retain(1, 101, 60), "retain.priority"),
            (retain(1, 0, 0), "retain.ttl_s"),
            (retain(1, 0, 86_401), "retain.ttl_s"),
            (
                pb::GenerateRequest {
                    request_id: "r".repeat(300),
                    ..base()
                },
                "request_id",
            ),
        ];
        for (r, want) in cases {
            assert_eq!(field(r).as_deref(), Some(want));
        }
        let (q, _) = validate_bytes(1, &retain(1, 50, 60), &l).expect("a valid hint");
        let want = Retain {
            tokens: 1,
            priority: 50,
            ttl_ms: 60_000,
            tenant: String::new(), // the service names the caller's tenant
        };
        assert_eq!(q.retain, Some(want));
        let sampling: [(pb::GenerateRequest, &str); 10] = [
            (
                pb::GenerateRequest {
                    min_p: -0.1,
                    ..base()
                },
                "min_p",
            ),
            (
                pb::GenerateRequest {
                    min_p: f32::NAN,
                    ..base()
                },
                "min_p",
            ),
            (
                pb::GenerateRequest {
                    frequency_penalty: 2.5,
                    ..base()
                },
                "frequency_penalty",
            ),
            (
                pb::GenerateRequest {
                    presence_penalty: -3.0,
                    ..base()
                },
                "presence_penalty",
            ),
            (
                pb::GenerateRequest {
                    repetition_penalty: -1.0,
                    ..base()
                },
                "repetition_penalty",
            ),
            (
                pb::GenerateRequest {
                    repetition_penalty: f32::INFINITY,
                    ..base()
                },
                "repetition_penalty",
            ),
            (
                pb::GenerateRequest {
                    logit_bias: [(999, 1.0)].into(),
                    ..base()
                },
                "logit_bias",
            ),
            (
                pb::GenerateRequest {
                    logit_bias: [(3, -101.0)].into(),
                    ..base()
                },
                "logit_bias",
            ),
            (
                pb::GenerateRequest {
                    logit_bias: (0..1025).map(|t| (t, 1.0)).collect(),
                    ..base()
                },
                "logit_bias",
            ),
            (
                pb::GenerateRequest {
                    min_tokens: 5,
                    ..req(vec![1], 4)
                },
                "min_tokens",
            ),
        ];
        for (r, want) in sampling {
            assert_eq!(field(r).as_deref(), Some(want));
        }
    }

    #[test]
    fn a_grammar_is_compiled_at_the_edge_and_a_bad_one_names_its_field() {
        use pb::grammar::Kind;
        let with = |kind: Option<Kind>| pb::GenerateRequest {
            grammar: Some(pb::Grammar { kind }),
            ..req(vec![1, 2], 8)
        };
        let l = limits();
        let refused = |r: pb::GenerateRequest| {
            let s =
                tonic::Status::from(validate_bytes(1, &r, &l).map(|_| ()).expect_err("refused"));
            assert_eq!(s.code(), tonic::Code::InvalidArgument, "{s:?}");
            let field = s
                .metadata()
                .get(kvlease_proto::INVALID_FIELD_METADATA)
                .and_then(|v| v.to_str().ok())
                .map(str::to_string);
            (field, s.message().to_string())
        };
        let schema = |s: &str| with(Some(Kind::JsonSchema(s.into())));
        let (field, message) = refused(schema(r#"{"type": "integr"}"#));
        assert_eq!(field.as_deref(), Some("grammar.json_schema"));
        assert!(
            message.contains("integr"),
            "the engine's message: {message}"
        );
        let (field, _) = refused(schema("{"));
        assert_eq!(field.as_deref(), Some("grammar.json_schema"));
        let (field, _) = refused(with(Some(Kind::Lark("start: ((".into()))));
        assert_eq!(field.as_deref(), Some("grammar.lark"));
        let (field, _) = refused(with(Some(Kind::Regex("[".into()))));
        assert_eq!(field.as_deref(), Some("grammar.regex"));
        assert_eq!(refused(with(None)).0.as_deref(), Some("grammar"));
        let huge = "a".repeat(MAX_GRAMMAR_BYTES + 1);
        assert_eq!(
            refused(with(Some(Kind::Regex(huge)))).0.as_deref(),
            Some("grammar.regex")
        );
        let json = || with(Some(Kind::JsonObject(true)));
        let eos = pb::GenerateRequest {
            ignore_eos: true,
            ..json()
        };
        assert_eq!(refused(eos).0.as_deref(), Some("ignore_eos"));
        let min = pb::GenerateRequest {
            min_tokens: 1,
            ..json()
        };
        assert_eq!(refused(min).0.as_deref(), Some("min_tokens"));
        // logprobs of the raw row, before the mask: served with a grammar
        let with_logprobs = pb::GenerateRequest {
            logprobs: Some(pb::LogprobsRequest {
                top: 2,
                prompt: false,
            }),
            ..json()
        };
        let (q, _) = validate_bytes(1, &with_logprobs, &l).expect("logprobs with a grammar");
        assert!(q.sampling.grammar.is_some());
        assert_eq!(q.logprobs.map(|l| l.top), Some(2));
        let (q, _) = validate_bytes(1, &json(), &l).expect("valid");
        assert_eq!(q.sampling.grammar.as_deref(), Some(&Constraint::JsonObject));
        assert!(
            !q.sampling.is_greedy(),
            "a grammar changes the argmax: no drafts"
        );
        assert!(q.sampling.needs_history() && !q.sampling.has_penalties());
    }

    #[test]
    fn a_grammar_travels_with_the_history_only() {
        let item = ForwardItem {
            seq_id: SeqId(2),
            tokens: vec![5, 6],
            feed_previous: false,
            start_pos: 0,
            tables: Vec::new(),
            return_all_argmax: false,
            sampling: Sampling {
                grammar: Some(Arc::new(Constraint::Regex("a+".into()))),
                ..Sampling::default()
            },
            prompt_len: 2,
            stop_ids: Vec::new(),
            history: Some(Vec::new()),
            copies: Vec::new(),
            logprobs: None,
            peer_pull: None,
        };
        let first = forward_request(Step(1), None, std::slice::from_ref(&item), &[], &[]);
        let s = &first.sequences[0];
        assert!(s.sampling.as_ref().is_some_and(|p| p.constrained));
        assert_eq!(
            s.grammar.as_ref().and_then(|g| g.kind.clone()),
            Some(pb::grammar::Kind::Regex("a+".into()))
        );
        let later = ForwardItem {
            history: None,
            ..item
        };
        let next = forward_request(Step(2), None, &[later], &[], &[]);
        let s = &next.sequences[0];
        assert!(s.sampling.as_ref().is_some_and(|p| p.constrained));
        assert_eq!(s.grammar, None, "a decode step sends no grammar");
    }

    #[test]
    fn every_sampling_parameter_reaches_the_request() {
        let r = pb::GenerateRequest {
            temperature: 0.7,
            top_p: 0.9,
            top_k: 20,
            min_p: 0.05,
            seed: 3,
            frequency_penalty: 0.5,
            presence_penalty: -0.5,
            repetition_penalty: 1.2,
            logit_bias: [(7, -100.0), (2, 3.5)].into(),
            min_tokens: 2,
            ..req(vec![1, 2], 4)
        };
        let (q, _) = validate_bytes(1, &r, &limits()).expect("valid");
        let s = &q.sampling;
        assert_eq!(
            (s.temperature, s.top_p, s.top_k, s.min_p, s.seed),
            (0.7, 0.9, 20, 0.05, 3)
        );
        assert_eq!(
            (
                s.frequency_penalty,
                s.presence_penalty,
                s.repetition_penalty
            ),
            (0.5, -0.5, 1.2)
        );
        assert_eq!(s.logit_bias, [(2, 3.5), (7, -100.0)]);
        assert_eq!(s.min_tokens, 2);
        assert!(s.has_penalties() && !s.is_greedy());
        // samples: 0 is read as 1, 16 is the most
        assert_eq!(q.n, 1);
        for n in [1, MAX_SAMPLES] {
            let r = pb::GenerateRequest {
                n,
                ..req(vec![1, 2], 4)
            };
            assert_eq!(validate_bytes(1, &r, &limits()).expect("valid").0.n, n);
        }
        let biased = Sampling {
            logit_bias: vec![(1, 1.0)],
            ..Sampling::default()
        };
        assert!(!biased.is_greedy(), "a bias changes the argmax: no drafts");
        assert!(Sampling::default().is_greedy());
    }
}
