//! Protobuf <-> domain conversion for the cache service: requests into the
//! core's types (ids wrapped, 32-bit fields narrowed or refused), its answers
//! back into `kvlease.v1` messages.

use kvlease_proto::v1 as pb;

use crate::cache::{
    AuditReport, Batch, DiskPool, MatchPrompt, PoolInfo, PoolStats, ShapeEstimate, StepExtend,
    StepRelease,
};
use crate::error::{Error, Result};
use crate::events::{EventKind, Tier};
use crate::ids::{SeqId, Step};
use crate::lease::{
    DEFAULT_PRIORITY, ExtendItem, Extra, Grant, Growth, Outcome, Prompt, Reject, ReleaseMode,
    ReleaseResult, ReleaseStatus, Retain, SeqSpec, TierCopy, TierDirection,
};

/// What a sequence's pair of token fields (`tokens`, or a count of them)
/// gave: exactly one of them, or neither.
enum Tokens {
    Ids(Vec<u32>),
    Count(u32),
    Neither,
}

/// The token ids or the count of `seq_id`'s `{field}_tokens` / `num_tokens`
/// pair; both given is INVALID_ARGUMENT.
fn tokens(seq_id: u64, field: &str, ids: Vec<u32>, count: u32) -> Result<Tokens> {
    match (ids.is_empty(), count) {
        (false, 0) => Ok(Tokens::Ids(ids)),
        (true, 0) => Ok(Tokens::Neither),
        (true, n) => Ok(Tokens::Count(n)),
        (false, _) => Err(Error::InvalidArgument(format!(
            "sequence {seq_id}: give only one of {field}_tokens and num_tokens"
        ))),
    }
}

/// A pool spec's disk tier (checked by `check_disk_pool`).
pub(crate) fn disk_pool_from_pb(p: &pb::PoolSpec) -> Result<DiskPool> {
    Ok(DiskPool {
        window: narrow("window", p.window)?,
        blocks: narrow("disk_blocks", p.disk_blocks)?,
        held: p
            .disk_held
            .iter()
            .map(|h| (h.block, h.hash, h.parent))
            .collect(),
    })
}

/// A uint64 wire field that holds a 32-bit value, refused rather than
/// truncated when it does not fit.
pub(crate) fn narrow(field: &str, value: u64) -> Result<u32> {
    u32::try_from(value).map_err(|_| {
        Error::InvalidArgument(format!(
            "{field} is {value}, over its limit of {}",
            u32::MAX
        ))
    })
}

pub(crate) fn spec_from_pb(s: pb::SequenceSpec) -> Result<SeqSpec> {
    let prompt = match tokens(s.seq_id, "prompt", s.prompt_tokens, s.num_tokens)? {
        Tokens::Ids(ids) => Prompt::Tokens(ids),
        Tokens::Count(n) => Prompt::Count(n),
        Tokens::Neither => {
            return Err(Error::InvalidArgument(format!(
                "sequence {}: give prompt_tokens or num_tokens > 0",
                s.seq_id
            )));
        }
    };
    if s.pool_group.is_empty() {
        return Err(Error::InvalidArgument(format!(
            "sequence {}: pool_group is empty",
            s.seq_id
        )));
    }
    let priority = match s.priority {
        0 => DEFAULT_PRIORITY,
        p if p <= u32::from(crate::eviction::MAX_PRIORITY) => p as u8,
        p => {
            return Err(Error::InvalidArgument(format!(
                "sequence {}: priority must be 0 to 100, got {p}",
                s.seq_id
            )));
        }
    };
    let retain = match s.retain {
        None => None,
        Some(r) => {
            let bad = |field: &str, why: String| {
                Error::InvalidArgument(format!("sequence {}: retain.{field} {why}", s.seq_id))
            };
            let priority = u8::try_from(r.priority)
                .ok()
                .filter(|&p| p <= crate::eviction::MAX_PRIORITY)
                .ok_or_else(|| bad("priority", format!("must be 0 to 100, got {}", r.priority)))?;
            if r.tokens == 0 {
                return Err(bad("tokens", "must be at least 1".into()));
            }
            if r.ttl_ms == 0 {
                return Err(bad("ttl_ms", "must be at least 1".into()));
            }
            Some(Retain {
                tokens: r.tokens,
                priority,
                ttl: std::time::Duration::from_millis(r.ttl_ms.into()),
                tenant: r.tenant,
            })
        }
    };
    let extra = s.extra.unwrap_or_default();
    Ok(SeqSpec {
        seq_id: SeqId(s.seq_id),
        group: s.pool_group,
        prompt,
        extra: Extra {
            draft: extra.draft,
            extra_kv: extra.extra_kv,
            extra_decoding_steps: extra.extra_decoding_steps,
        },
        beam_width: s.beam_width.max(1),
        max_new_tokens: s.max_new_tokens,
        priority,
        cache_salt: s.cache_salt,
        reserve_full_life: s.reserve_full_life,
        prefill_tokens: s.prefill_tokens,
        retain,
        fork_of: s.fork_of.map(SeqId),
        handoff_of: s.handoff_of.map(SeqId),
        peer_pull: s.peer_pull.map(|r| crate::peer::PeerRates {
            link_bytes_per_s: r.link_bytes_per_s,
            prefill_tokens_per_s: r.prefill_tokens_per_s,
            overhead_us: r.overhead_us,
        }),
    })
}

/// An extend part's items (growth or a chunked-prefill progress report),
/// with their trace contexts taken out (`traces[i]` is item `i`'s).
pub(crate) fn extend_from_pb(part: pb::StepExtend) -> Result<(Vec<String>, StepExtend)> {
    let mut traces = Vec::with_capacity(part.items.len());
    let items = part
        .items
        .into_iter()
        .map(|i| {
            traces.push(i.traceparent);
            let growth = match tokens(i.seq_id, "new", i.new_tokens, i.num_tokens)? {
                Tokens::Ids(ids) => Some(Growth::Tokens(ids)),
                Tokens::Count(n) => Some(Growth::Count(n)),
                // a chunked-prefill progress report only
                Tokens::Neither if i.written_tokens > 0 => None,
                Tokens::Neither => {
                    return Err(Error::InvalidArgument(format!(
                        "sequence {}: give new_tokens or num_tokens > 0, or written_tokens > 0",
                        i.seq_id
                    )));
                }
            };
            Ok(ExtendItem {
                seq_id: SeqId(i.seq_id),
                growth,
                written_tokens: i.written_tokens,
                from_length: (i.from_length > 0).then_some(i.from_length),
            })
        })
        .collect::<Result<Vec<_>>>()?;
    let batch = Batch {
        step: Step(part.step),
        atomic: part.atomic,
        warmup: false,
    };
    Ok((traces, StepExtend { batch, items }))
}

/// A release part: its sequences and how they are given back, with their
/// trace contexts taken out (`traces[i]` is sequence `i`'s).
pub(crate) fn release_from_pb(part: pb::StepRelease) -> (Vec<String>, StepRelease) {
    let release = StepRelease {
        // collected in place: the wire's vector becomes the ids' own
        seq_ids: part.seq_ids.into_iter().map(SeqId).collect(),
        mode: ReleaseMode {
            fence_step: part.fence_step.map(Step),
            discard_unwritten: part.discard_unwritten,
        },
    };
    (part.traceparents, release)
}

pub(crate) fn release_to_pb(results: Vec<ReleaseResult>) -> pb::ReleaseResponse {
    pb::ReleaseResponse {
        results: results
            .into_iter()
            .map(|x| pb::ReleaseResult {
                seq_id: x.seq_id.0,
                status: match x.status {
                    ReleaseStatus::Released => pb::ReleaseStatus::Released,
                    ReleaseStatus::AlreadyReleased => pb::ReleaseStatus::AlreadyReleased,
                    ReleaseStatus::Unknown => pb::ReleaseStatus::Unknown,
                } as i32,
                blocks_freed: x.blocks_freed,
                blocks_fenced: x.blocks_fenced,
            })
            .collect(),
    }
}

pub(crate) fn pool_info_to_pb(i: PoolInfo) -> pb::PoolInfo {
    pb::PoolInfo {
        pool_id: i.pool_id,
        window: i.window,
        num_blocks: i.num_blocks,
        tokens_per_block: i.tokens_per_block,
        host_blocks: i.host_blocks,
        disk_blocks: i.disk_blocks,
    }
}

pub(crate) fn audit_to_pb(report: AuditReport) -> pb::AuditResponse {
    pb::AuditResponse {
        reclaimed: report
            .reclaimed
            .into_iter()
            .map(|l| pb::LeakedBlock {
                pool_id: l.pool_id,
                block_id: l.block,
                last_holder: if l.last_holder.session.0 == 0 {
                    "unknown".to_owned()
                } else {
                    format!(
                        "session {} sequence {}",
                        l.last_holder.session, l.last_holder.seq
                    )
                },
            })
            .collect(),
        blocks_checked: report.blocks_checked,
    }
}

pub(crate) fn grant_to_pb(g: Grant) -> pb::Grant {
    pb::Grant {
        seq_id: g.seq_id.0,
        tables: g
            .tables
            .into_iter()
            .map(|t| pb::BlockTable {
                pool_id: t.pool_id,
                window: t.window,
                beam: t.beam,
                first_block: t.first_block,
                block_ids: t.block_ids,
            })
            .collect(),
        reused_tokens: g.reused_tokens,
        capacity_tokens: g.capacity_tokens,
        copies: g
            .copies
            .into_iter()
            .map(|c| pb::BlockCopy {
                pool_id: c.pool_id,
                window: c.window,
                src_block: c.src_block,
                dst_block: c.dst_block,
                tokens: c.tokens,
            })
            .collect(),
        tier_copies: g.tier_copies.into_iter().map(tier_copy_to_pb).collect(),
        retained_tokens: g.retained_tokens,
        peer_copies: g
            .peer_copies
            .into_iter()
            .map(|c| pb::PeerCopy {
                pool_id: c.pool_id,
                window: c.window,
                dst_block: c.dst_block,
                src_group: c.src_group,
                src_pool_id: c.src_pool_id,
                src_block: c.src_block,
                transfer_id: c.transfer_id,
                tokens: c.tokens,
            })
            .collect(),
        peer_decision: g.peer_decision.map(|d| pb::PeerPullDecision {
            src_group: d.src_group,
            blocks: d.blocks,
            bytes: d.bytes,
            pull_us: d.pull_us,
            recompute_us: d.recompute_us,
            pulled: d.pulled,
            forced: d.forced,
        }),
    }
}

fn tier_copy_to_pb(c: TierCopy) -> pb::TierCopy {
    let direction = match c.direction {
        TierDirection::Demote => pb::tier_copy::Direction::Demote,
        TierDirection::Onboard => pb::tier_copy::Direction::Onboard,
        TierDirection::Spill => pb::tier_copy::Direction::Spill,
        TierDirection::Load => pb::tier_copy::Direction::Load,
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

pub(crate) fn reject_to_pb(r: Reject) -> pb::Reject {
    pb::Reject {
        seq_id: r.seq_id.0,
        reason: kvlease_proto::reject_reason(r.reason.as_str()) as i32,
        pool_id: r.pool_id,
        window: r.window,
        blocks_needed: r.blocks_needed,
        blocks_free: r.blocks_free,
        blocks_pending_free: r.blocks_pending_free,
        message: r.message,
    }
}

pub(crate) fn outcomes_to_pb(outcomes: Vec<Outcome>) -> Vec<pb::SequenceOutcome> {
    outcomes
        .into_iter()
        .map(|o| {
            if let Outcome::Reject(r) = &o {
                tracing::info!(
                    seq_id = r.seq_id.0,
                    reason = r.reason.as_str(),
                    pool_id = r.pool_id,
                    window = r.window,
                    blocks_needed = r.blocks_needed,
                    blocks_free = r.blocks_free,
                    blocks_pending_free = r.blocks_pending_free,
                    "sequence rejected"
                );
            }
            pb::SequenceOutcome {
                outcome: Some(match o {
                    Outcome::Grant(g) => pb::sequence_outcome::Outcome::Grant(grant_to_pb(g)),
                    Outcome::Reject(r) => pb::sequence_outcome::Outcome::Reject(reject_to_pb(r)),
                }),
            }
        })
        .collect()
}

pub(crate) fn stats_to_pb(p: PoolStats) -> pb::PoolStats {
    pb::PoolStats {
        pool_group: p.group,
        pool_id: p.info.pool_id,
        window: p.info.window,
        tokens_per_block: p.info.tokens_per_block,
        total: p.counts.total,
        free: p.counts.free,
        cached_evictable: p.counts.cached,
        in_use: p.counts.in_use,
        fenced: p.counts.fenced,
        grants: p.counters.grants,
        rejects: p.counters.rejects,
        evictions: p.counters.evictions,
        reuse_lookups: p.counters.reuse_lookups,
        reuse_hits: p.counters.reuse_hits,
        leaks_reclaimed: p.counters.leaks_reclaimed,
        hit_rate_estimates: p
            .hit_rate_estimates
            .iter()
            .map(|e| pb::HitRateEstimate {
                scale: e.scale,
                blocks: e.blocks,
                hit_rate: e.hit_rate,
                sampled_lookups: e.sampled_lookups,
            })
            .collect(),
        host_total: p.host.total,
        host_free: p.host.free,
        host_pending: p.host.pending,
        host_cached: p.host.cached,
        host_pinned: p.host.pinned,
        demotions: p.counters.demotions,
        onboards: p.counters.onboards,
        demotions_dropped: p.counters.demotions_dropped,
        fork_shared: p.counters.fork_shared,
        fork_copies: p.counters.fork_copies,
        disk_total: p.disk.total,
        disk_free: p.disk.free,
        disk_pending: p.disk.pending,
        disk_cached: p.disk.cached,
        disk_pinned: p.disk.pinned,
        spills: p.counters.spills,
        loads: p.counters.loads,
        handoff_blocks: p.counters.handoff_blocks,
        disk_invalidated: p.counters.disk_invalidated,
        eviction_policy: p.policy.configured.name().to_owned(),
        current_policy: p.policy.current.name().to_owned(),
        policy_estimates: p
            .policy
            .estimates
            .iter()
            .map(|&(policy, hit_rate)| pb::PolicyEstimate {
                policy: policy.name().to_owned(),
                hit_rate,
            })
            .collect(),
        policy_switches: p.policy.switches,
    }
}

pub(crate) fn estimate_to_pb(e: ShapeEstimate) -> pb::ShapeEstimate {
    pb::ShapeEstimate {
        pools: e
            .pools
            .into_iter()
            .map(|p| pb::PoolEstimate {
                pool_id: p.pool_id,
                window: p.window,
                total_blocks: p.total,
                peak_blocks: p.peak,
                pool_blocks: p.pool_blocks,
            })
            .collect(),
        fits: e.fits,
    }
}

pub(crate) fn event_to_pb(e: crate::events::Event) -> pb::CacheEvent {
    let kind = match e.kind {
        EventKind::Stored { hashes, parent } => pb::cache_event::Kind::Stored(pb::BlocksStored {
            block_hashes: hashes,
            parent_hash: parent,
        }),
        EventKind::Removed { hashes } => pb::cache_event::Kind::Removed(pb::BlocksRemoved {
            block_hashes: hashes,
        }),
    };
    pb::CacheEvent {
        id: e.id,
        pool_id: e.pool_id,
        kind: Some(kind),
        tier: match e.tier {
            Tier::Device => pb::Tier::Device,
            Tier::Host => pb::Tier::Host,
            Tier::Disk => pb::Tier::Disk,
        } as i32,
    }
}

pub(crate) fn match_prompt_from_pb(p: pb::MatchPrompt) -> MatchPrompt {
    MatchPrompt {
        tokens: p.prompt_tokens,
        cache_salt: p.cache_salt,
    }
}
