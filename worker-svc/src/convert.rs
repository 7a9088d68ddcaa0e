//! Protobuf <-> domain conversion for the worker: Forward sequences into
//! [`SeqInput`]s, results and the Describe answer back into `kvlease.v1`
//! messages.

use kvlease_proto::v1 as pb;

use crate::batch::{
    CopyInput, DiskRef, LogprobsSpec, Penalties, Sampling, SeqInput, TableInput, TierCopyInput,
    TierDirection,
};
use crate::worker::{SeqOutput, WorkerInfo};
use kvlease_tokenizer::Tokenizer;
use kvlease_tokenizer::grammar::Constraint;

pub(crate) fn seq_input(seq: pb::ForwardSequence) -> SeqInput {
    let sampling = seq.sampling.map_or(Sampling::GREEDY, |s| Sampling {
        temperature: s.temperature,
        top_p: s.top_p,
        top_k: s.top_k,
        min_p: s.min_p,
        seed: s.seed,
        penalties: Penalties {
            frequency: s.frequency_penalty,
            presence: s.presence_penalty,
            repetition: s.repetition_penalty,
        },
        // validation sorts it by token
        logit_bias: s.logit_bias.into_iter().collect(),
        prompt_len: s.prompt_len,
        min_tokens: s.min_tokens,
        stop_ids: s.stop_ids,
        constrained: s.constrained,
    });
    let logprobs = seq.logprobs.map(|l| LogprobsSpec {
        top: l.top,
        prompt: l.prompt,
        next_prompt_token: l.next_prompt_token,
    });
    SeqInput {
        seq_id: seq.seq_id,
        tokens: seq.tokens,
        start_pos: seq.start_pos,
        tables: seq
            .tables
            .into_iter()
            .map(|t| TableInput {
                window: t.window,
                beam: t.beam,
                first_block: t.first_block,
                block_ids: t.block_ids,
            })
            .collect(),
        all_positions: seq.return_all_argmax,
        logprobs,
        sampling,
        copies: seq
            .copies
            .into_iter()
            .map(|c| CopyInput {
                window: c.window,
                src_block: c.src_block,
                dst_block: c.dst_block,
                tokens: c.tokens,
            })
            .collect(),
        history: seq.history.map(|h| h.tokens),
        grammar: seq.grammar.map(grammar),
    }
}

/// A `Grammar` message as a constraint, or why it is none (batch
/// validation refuses it, naming the sequence).
pub(crate) fn grammar(g: pb::Grammar) -> Result<Constraint, String> {
    use pb::grammar::Kind;
    match g.kind {
        Some(Kind::JsonObject(_)) => Ok(Constraint::JsonObject),
        Some(Kind::JsonSchema(s)) => Ok(Constraint::JsonSchema(s)),
        Some(Kind::Lark(s)) => Ok(Constraint::Lark(s)),
        Some(Kind::Regex(s)) => Ok(Constraint::Regex(s)),
        None => Err("no kind set (json_object, json_schema, lark or regex)".into()),
    }
}

pub(crate) fn tier_copy_input(c: &pb::TierCopy) -> TierCopyInput {
    let direction = match pb::tier_copy::Direction::try_from(c.direction) {
        Ok(pb::tier_copy::Direction::Onboard) => TierDirection::Onboard,
        Ok(pb::tier_copy::Direction::Spill) => TierDirection::Spill,
        Ok(pb::tier_copy::Direction::Load) => TierDirection::Load,
        // DEMOTE is 0; an unknown value is read as the default, like any
        // proto3 enum.
        _ => TierDirection::Demote,
    };
    TierCopyInput {
        window: c.window,
        direction,
        device_block: c.device_block,
        host_block: c.host_block,
        disk: DiskRef {
            block: c.disk_block,
            hash: c.hash,
            parent: c.parent,
        },
    }
}

/// A Forward sequence's peer pull (checked later, against its tables).
pub(crate) fn peer_pull_input(p: pb::PeerPull) -> crate::peer::PeerPullInput {
    crate::peer::PeerPullInput {
        address: p.address,
        transfer_id: p.transfer_id,
        blocks: p
            .blocks
            .into_iter()
            .map(|b| crate::peer::PeerBlockInput {
                window: b.window,
                src_block: b.src_block,
                dst_block: b.dst_block,
                tokens: b.tokens,
            })
            .collect(),
    }
}

pub(crate) fn forward_result(out: SeqOutput) -> pb::ForwardResult {
    pb::ForwardResult {
        seq_id: out.seq_id,
        next_token: out.next_token,
        argmax: out.argmax,
        logprobs: out
            .logprobs
            .into_iter()
            .map(|l| {
                let (top_tokens, top_logprobs) = l.top.into_iter().unzip();
                pb::PositionLogprobs {
                    token: l.token,
                    logprob: l.logprob,
                    top_tokens,
                    top_logprobs,
                }
            })
            .collect(),
        ..Default::default()
    }
}

pub(crate) fn tokenizer_response(model: String, tokenizer: &Tokenizer) -> pb::GetTokenizerResponse {
    let parts = tokenizer.parts();
    let s = &parts.specials;
    pb::GetTokenizerResponse {
        model,
        fingerprint: tokenizer.fingerprint().to_string(),
        kind: parts.kind.as_str().to_string(),
        tokenizer_json: parts.tokenizer_json.clone(),
        chat_template: parts.chat_template.clone().unwrap_or_default(),
        bos_id: s.bos_id,
        bos_token: s.bos_token.clone().unwrap_or_default(),
        eos_token: s.eos_token.clone().unwrap_or_default(),
        end_ids: s.end_ids.clone(),
        add_bos: s.add_bos,
    }
}

pub(crate) fn describe_response(info: &WorkerInfo, tokenizer: &Tokenizer) -> pb::DescribeResponse {
    let m = &info.model;
    pb::DescribeResponse {
        model: Some(pb::ModelShape {
            name: m.name.clone(),
            vocab_size: m.vocab_size as u32,
            hidden_size: m.hidden_size as u32,
            num_layers: m.num_layers() as u32,
            num_heads: m.num_heads as u32,
            num_kv_heads: m.num_kv_heads as u32,
            head_dim: m.head_dim as u32,
            ffn_size: m.ffn_size as u32,
            rope_theta: m.rope_theta,
            layer_windows: m.layer_windows.clone(),
            max_context: m.max_context,
            tokenizer_fingerprint: tokenizer.fingerprint().to_string(),
        }),
        tokens_per_block: m.tokens_per_block,
        pools: info
            .pools
            .iter()
            .map(|p| pb::WorkerPool {
                host_blocks: p.host_blocks,
                disk_blocks: p.disk_blocks,
                disk_held: p
                    .disk_held
                    .iter()
                    .map(|h| pb::DiskBlock {
                        block: h.block,
                        hash: h.hash,
                        parent: h.parent,
                    })
                    .collect(),
                window: p.window,
                num_layers: p.num_layers,
                num_blocks: p.num_blocks,
                bytes_per_block: p.bytes_per_block,
            })
            .collect(),
        backend: info.backend.to_string(),
        kv_dtype: info.kv_dtype.to_string(),
        memory_budget_bytes: info.memory_budget_bytes,
        incarnation: info.incarnation,
        weight_bytes: info.weight_bytes,
        activation_bytes: info.activation_bytes,
        max_batch_sequences: info.limits.max_batch_sequences as u32,
        max_batch_tokens: info.limits.max_batch_tokens as u32,
        device: info.device.clone(),
    }
}
