//! Start-up: describe each worker, register its pools, and warm up with the
//! largest shapes (`warmup.rs`) using *atomic* leases, so a shape that does
//! not fit takes nothing; every warm-up sequence is released and the pools
//! must be whole again before the scheduler serves. The whole start-up runs
//! under a deadline and fails with a clear error instead of hanging, and
//! renews the cache session while it runs.

use std::sync::Mutex;
use std::time::Duration;

use kvlease_tokenizer::Tokenizer;

use crate::client::{CacheClient, WorkerClient, WorkerDescription};
use crate::config::Config;
use crate::domain::{
    ForwardItem, GroupGeometry, LeaseMode, LeaseSpec, Outcome, RequestId, SeqId, Step, Table,
    TierCopy,
};
use crate::error::{Error, Result};
use crate::keepalive;
use crate::warmup::{self, WarmupLimits, WarmupShape};

/// How long past a session's TTL the cache may take to reclaim it (its
/// expiry sweep runs every few hundred milliseconds).
const EXPIRY_SLACK: Duration = Duration::from_secs(1);

/// Warm-up sequence ids live far above the ids of real sequences.
const WARMUP_SEQ_BASE: SeqId = SeqId(1 << 62);

/// What start-up produced.
#[derive(Debug, Clone)]
pub(crate) struct Started {
    /// One group per worker, in the order of the worker addresses.
    pub groups: Vec<GroupGeometry>,
    /// The last step number warm-up used.
    pub last_step: Step,
    /// The models' tokenizer (every worker's is the same).
    pub tokenizer: Tokenizer,
}

/// Describes, registers and warms up every worker within the deadline.
pub(crate) async fn start(
    config: &Config,
    cache: &CacheClient,
    workers: &[WorkerClient],
) -> Result<Started> {
    let held = Mutex::new(Vec::new());
    let start = start_inner(config, cache, workers, &held);
    // warm-up may outlast the session's TTL (a debug build, a large model):
    // the session is renewed while it runs
    let run = async {
        tokio::select! {
            started = start => started,
            never = keepalive::keep_alive_while_awaited(cache) => match never {},
        }
    };
    match tokio::time::timeout(config.warmup_deadline(), run).await {
        Ok(result) => result,
        Err(_) => {
            let ids: Vec<SeqId> =
                std::mem::take(&mut *held.lock().unwrap_or_else(|e| e.into_inner()));
            if !ids.is_empty() {
                // best effort: closing the session reclaims them anyway
                let _ = release_all(cache, &ids, None, true).await;
            }
            Err(Error::WarmupDeadline {
                deadline_ms: config.warmup_deadline_ms,
            })
        }
    }
}

async fn start_inner(
    config: &Config,
    cache: &CacheClient,
    workers: &[WorkerClient],
    held: &Mutex<Vec<SeqId>>,
) -> Result<Started> {
    config.check_cache_batch_limit(workers.len(), cache.session().batch_limit())?;
    let mut descriptions = Vec::with_capacity(workers.len());
    for worker in workers {
        descriptions.push(worker.describe().await?);
    }
    let tokenizer = one_tokenizer(workers, &descriptions).await?;
    let roles: Vec<crate::domain::Role> = config.workers()?.into_iter().map(|(_, r)| r).collect();
    check_roles(workers, &roles, &descriptions)?;
    let mut groups = Vec::with_capacity(workers.len());
    let mut step = Step(0);
    let mut next_seq = WARMUP_SEQ_BASE;
    for (i, (worker, d)) in workers.iter().zip(descriptions).enumerate() {
        if d.pools.is_empty() || d.tokens_per_block == 0 {
            return Err(Error::Protocol {
                peer: "worker",
                message: format!(
                    "worker {} describes no pools or zero tokens per block",
                    worker.addr()
                ),
            });
        }
        let name = config.pool_group(&d.model_name, i);
        let pools = register_waiting(config, cache, &name, &d).await?;
        let max_context = match config.max_context {
            0 => d.max_context,
            c => c.min(d.max_context),
        };
        let group = GroupGeometry {
            name,
            tokens_per_block: d.tokens_per_block,
            pools,
            max_context,
            vocab_size: d.vocab_size,
            max_batch_sequences: d.max_batch_sequences.max(1),
            max_batch_tokens: d.max_batch_tokens.max(1),
            peer: d.peer.clone(),
            role: roles.get(i).copied().unwrap_or_default(),
        };
        tracing::info!(group = %group.name, worker = worker.addr(), tokens_per_block = group.tokens_per_block,
            pools = group.pools.len(), "pools registered");
        wait_for_an_earlier_session(config, cache, &group.name).await?;
        warm_up(
            config,
            cache,
            worker,
            &group,
            &mut step,
            &mut next_seq,
            held,
        )
        .await?;
        groups.push(group);
    }
    Ok(Started {
        groups,
        last_step: step,
        tokenizer,
    })
}

/// With roles (disaggregated serving), every prefill and decode group must
/// hold the same KV (the peer key: model, tokenizer and KV element type,
/// block size) for a hand-off to move it: a mismatch stops start-up.
fn check_roles(
    workers: &[WorkerClient],
    roles: &[crate::domain::Role],
    descriptions: &[crate::client::WorkerDescription],
) -> Result<()> {
    use crate::domain::Role;
    let split: Vec<(&WorkerClient, &crate::client::WorkerDescription)> = workers
        .iter()
        .zip(descriptions)
        .zip(roles)
        .filter(|(_, r)| **r != Role::Both)
        .map(|(wd, _)| wd)
        .collect();
    let Some((first, d0)) = split.first() else {
        return Ok(());
    };
    for (w, d) in &split[1..] {
        if d.peer.key != d0.peer.key || d.peer.block_bytes != d0.peer.block_bytes {
            return Err(Error::Config(format!(
                "workers {} and {} have roles but different KV ({:?} vs {:?}): a hand-off cannot move KV between them",
                first.addr(),
                w.addr(),
                d0.peer.key,
                d.peer.key
            )));
        }
    }
    if d0.peer.key.is_empty() || d0.peer.block_bytes.contains(&0) {
        return Err(Error::Config(format!(
            "worker {} has a role but describes no KV identity or block sizes: it cannot hand off",
            first.addr()
        )));
    }
    Ok(())
}

/// Registers a worker's pools with its incarnation and disk tiers. The
/// cache refuses a new incarnation (`ABORTED`) while an earlier
/// session of this scheduler (killed with its worker, not yet expired)
/// still holds blocks of the group: waits up to one session TTL for it, as
/// [`wait_for_an_earlier_session`] does, then fails with the cache's answer.
async fn register_waiting(
    config: &Config,
    cache: &CacheClient,
    group: &str,
    d: &WorkerDescription,
) -> Result<Vec<crate::domain::PoolGeometry>> {
    let deadline =
        tokio::time::Instant::now() + Duration::from_millis(config.session_ttl_ms) + EXPIRY_SLACK;
    let mut warned = false;
    loop {
        match cache
            .register_pool(group, d.tokens_per_block, &d.pools, &d.tiers, &d.peer)
            .await
        {
            Err(Error::Rpc {
                code: tonic::Code::Aborted,
                message,
                ..
            }) if tokio::time::Instant::now() < deadline => {
                if !warned {
                    tracing::warn!(group, %message, "the worker restarted while an earlier session holds its group's blocks: waiting up to its TTL");
                    warned = true;
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            other => return other,
        }
    }
}

/// A scheduler started again soon after it died (`kill -9`, no
/// `CloseSession`) finds its groups' blocks still held by its earlier
/// session until the cache expires it: waits up to one session TTL (its
/// own, the same configuration) for `group`'s pools to be whole, so that
/// warm-up finds them empty. After that warm-up runs anyway and says what
/// it found.
async fn wait_for_an_earlier_session(
    config: &Config,
    cache: &CacheClient,
    group: &str,
) -> Result<()> {
    let deadline =
        tokio::time::Instant::now() + Duration::from_millis(config.session_ttl_ms) + EXPIRY_SLACK;
    let mut waited = false;
    loop {
        let held = cache
            .pool_states(group)
            .await?
            .iter()
            .any(|p| p.in_use != 0 || p.fenced != 0);
        if !held || tokio::time::Instant::now() >= deadline {
            if waited {
                tracing::info!(
                    group,
                    whole = !held,
                    "done waiting for an earlier session's blocks"
                );
            }
            return Ok(());
        }
        if !waited {
            tracing::warn!(
                group,
                ttl_ms = config.session_ttl_ms,
                "pools hold blocks of an earlier session: waiting up to its TTL for the cache to reclaim them"
            );
            waited = true;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The tokenizer every worker serves, fetched from the first; start-up
/// fails, naming both, when two workers' fingerprints differ.
async fn one_tokenizer(
    workers: &[WorkerClient],
    descriptions: &[WorkerDescription],
) -> Result<Tokenizer> {
    let (Some(first), Some(d0)) = (workers.first(), descriptions.first()) else {
        return Err(Error::Config("no worker to serve".into()));
    };
    for (worker, d) in workers.iter().zip(descriptions).skip(1) {
        if d.tokenizer_fingerprint != d0.tokenizer_fingerprint {
            let side = |w: &WorkerClient, d: &WorkerDescription| {
                format!(
                    "{} serves {:?} (tokenizer {})",
                    w.addr(),
                    d.model_name,
                    d.tokenizer_fingerprint
                )
            };
            return Err(Error::TokenizerMismatch {
                first: side(first, d0),
                other: side(worker, d),
            });
        }
    }
    let tokenizer = first.get_tokenizer(&d0.tokenizer_fingerprint).await?;
    tracing::info!(model = %d0.model_name, fingerprint = tokenizer.fingerprint(),
        vocab_size = tokenizer.vocab_size(), chat_template = tokenizer.has_chat_template(), "tokenizer loaded");
    Ok(tokenizer)
}

/// The limits the warm-up shapes are built from.
pub(crate) fn limits(config: &Config, group: &GroupGeometry) -> WarmupLimits {
    WarmupLimits {
        max_context: group.max_context,
        // Without a max_tokens limit of its own (0), any split of the context
        // between prompt and output is servable and holds the same blocks
        // over its life: warm up with half the context as output, so the
        // warm-up's prefill stays as long as half the context, not all of it.
        max_tokens: match config.max_tokens {
            0 => (group.max_context / 2).max(1),
            n => n,
        },
        max_seqs: config.max_seqs,
        max_tokens_per_step: config.max_tokens_per_step,
        draft_k: config.spec_draft_k,
    }
}

fn describe(shape: &WarmupShape) -> String {
    format!(
        "{} x {} prompt + {} new + {} draft tokens",
        shape.num_seqs, shape.prompt_len, shape.max_new_tokens, shape.extra.draft
    )
}

async fn warm_up(
    config: &Config,
    cache: &CacheClient,
    worker: &WorkerClient,
    group: &GroupGeometry,
    step: &mut Step,
    next_seq: &mut SeqId,
    held: &Mutex<Vec<SeqId>>,
) -> Result<()> {
    let shapes = warmup::shapes(limits(config, group), group);
    if let Err(e) = warmup::check(&shapes, group) {
        return Err(Error::WarmupDoesNotFit {
            group: group.name.clone(),
            shape: e.shape.name.to_string(),
            detail: describe(&e.shape),
            window: e.window,
            needed: e.needed,
            available: e.available,
        });
    }
    for shape in &shapes {
        let specs: Vec<LeaseSpec> = (0..shape.num_seqs)
            .map(|n| {
                let seq_id = SeqId(next_seq.get() + u64::from(n));
                LeaseSpec {
                    seq_id,
                    request: RequestId(0),
                    pool_group: group.name.clone(),
                    // distinct per sequence so nothing is shared between them
                    prompt_tokens: (0..shape.prompt_len).map(|p| (p + n) % 250 + 1).collect(),
                    extra: shape.extra,
                    max_new_tokens: shape.max_new_tokens,
                    priority: 0,
                    cache_salt: "kvlease-warmup".into(),
                    retain: None,
                    reserve_full_life: true,
                    // warm-up: nothing is published, whatever the chunks
                    prefill_tokens: 0,
                    fork_of: None,
                    reuse_prefix: true,
                    peer_pull: None,
                    handoff_of: None,
                }
            })
            .collect();
        *next_seq = SeqId(next_seq.get() + u64::from(shape.num_seqs));
        // the cache's own estimate must agree that the shape fits
        if let Some(first) = specs.first() {
            let estimates = cache.estimate(std::slice::from_ref(first)).await?;
            for (pools, _fits) in &estimates {
                for &(window, peak, pool_blocks) in pools {
                    let needed = peak.saturating_mul(shape.num_seqs);
                    if needed > pool_blocks {
                        return Err(Error::WarmupDoesNotFit {
                            group: group.name.clone(),
                            shape: shape.name.to_string(),
                            detail: describe(shape),
                            window,
                            needed,
                            available: pool_blocks,
                        });
                    }
                }
            }
        }
        *step = step.next();
        let ids: Vec<SeqId> = specs.iter().map(|s| s.seq_id).collect();
        held.lock().unwrap_or_else(|e| e.into_inner()).extend(&ids);
        let outcome = run_shape(config, cache, worker, group, shape, &specs, step).await;
        // release whatever happened: atomic leases took all or nothing, and
        // release is idempotent; fenced at the last warm-up step, completed.
        // After a failure the cache must publish nothing of it: a pass or a
        // host-tier copy a grant named may not have run.
        let fence = *step;
        let released = release_all(cache, &ids, Some(fence), outcome.is_err()).await;
        let completed = cache.complete_step(fence).await;
        held.lock().unwrap_or_else(|e| e.into_inner()).clear();
        outcome?;
        released?;
        completed?;
        tracing::info!(group = %group.name, shape = shape.name, detail = %describe(shape), "warm-up shape ran");
    }
    for pool in cache.pool_states(&group.name).await? {
        if pool.in_use != 0 || pool.fenced != 0 {
            return Err(Error::PoolNotWhole {
                group: group.name.clone(),
                window: pool.window,
                in_use: pool.in_use,
                fenced: pool.fenced,
            });
        }
    }
    Ok(())
}

/// Leases one shape atomically, prefills it, extends by one and runs one
/// decode forward that fills the draft slots.
async fn run_shape(
    config: &Config,
    cache: &CacheClient,
    worker: &WorkerClient,
    group: &GroupGeometry,
    shape: &WarmupShape,
    specs: &[LeaseSpec],
    step: &mut Step,
) -> Result<()> {
    // A shape wider than the cache's batch limit is leased in several
    // atomic calls: all or nothing per call. A refusal of any still fails
    // the shape, and the caller releases every sequence of it either way.
    let mut outcomes = Vec::with_capacity(specs.len());
    for chunk in specs.chunks(batch_limit(cache)) {
        let answered = cache.lease(*step, LeaseMode::Warmup, chunk, &[]).await?;
        let refused = answered.iter().any(|o| matches!(o, Outcome::Reject(_)));
        outcomes.extend(answered);
        if refused {
            break;
        }
    }
    let mut tables: Vec<Vec<Table>> = Vec::with_capacity(specs.len());
    // Host-tier copies the lease named: the first forward of its step runs them.
    let mut tier_copies = Vec::new();
    for outcome in outcomes {
        match outcome {
            Outcome::Grant(g) => {
                tier_copies.extend(g.tier_copies);
                tables.push(g.tables);
            }
            Outcome::Reject(r) if r.reason == crate::domain::RejectReason::RolledBack => {}
            Outcome::Reject(r) => {
                return Err(Error::WarmupRejected {
                    group: group.name.clone(),
                    shape: shape.name.to_string(),
                    reason: format!(
                        "{} in pool window {}: {} blocks needed, {} free, {} pending free ({})",
                        r.reason,
                        r.window,
                        r.blocks_needed,
                        r.blocks_free,
                        r.blocks_pending_free,
                        r.message
                    ),
                });
            }
        }
    }
    if tables.len() != specs.len() {
        return Err(Error::Protocol {
            peer: "cache",
            message: "atomic warm-up lease partly granted".into(),
        });
    }
    let step_tokens = config
        .max_tokens_per_step
        .min(group.max_batch_tokens)
        .max(1);
    let chunk = config.prefill_chunk.min(step_tokens).max(1);
    let mut pos = 0;
    while pos < shape.prompt_len {
        let len = chunk.min(shape.prompt_len - pos);
        let items: Vec<ForwardItem> = specs
            .iter()
            .zip(&tables)
            .map(|(s, t)| ForwardItem {
                seq_id: s.seq_id,
                tokens: s.prompt_tokens[pos as usize..(pos + len) as usize].to_vec(),
                feed_previous: false,
                start_pos: pos,
                tables: t.clone(),
                return_all_argmax: false,
                sampling: Default::default(),
                prompt_len: 0,
                stop_ids: Vec::new(),
                history: None,
                copies: Vec::new(),
                logprobs: None,
                peer_pull: None,
            })
            .collect();
        let copies = std::mem::take(&mut tier_copies);
        forward_batched(worker, group, step_tokens, *step, &items, &copies).await?;
        *step = step.next();
        pos += len;
    }
    // one decode step feeding a token and the drafts into the reserved slots
    let drafts = shape
        .extra
        .draft
        .min(group.max_context.saturating_sub(shape.prompt_len + 1));
    let grow: Vec<(SeqId, u32)> = specs.iter().map(|s| (s.seq_id, 1)).collect();
    let mut outcomes = Vec::with_capacity(grow.len());
    for chunk in grow.chunks(batch_limit(cache)) {
        outcomes.extend(cache.extend_by(*step, chunk).await?);
    }
    let mut items = Vec::with_capacity(specs.len());
    for ((s, outcome), leased) in specs.iter().zip(outcomes).zip(&tables) {
        let tables = match outcome {
            Outcome::Grant(g) => {
                tier_copies.extend(g.tier_copies);
                let mut merged = leased.clone();
                crate::domain::apply_extend(&mut merged, &g.tables);
                merged
            }
            Outcome::Reject(r) => {
                return Err(Error::WarmupRejected {
                    group: group.name.clone(),
                    shape: shape.name.to_string(),
                    reason: format!(
                        "extend refused although the life was reserved: {} ({})",
                        r.reason, r.message
                    ),
                });
            }
        };
        items.push(ForwardItem {
            seq_id: s.seq_id,
            tokens: vec![1; 1 + drafts as usize],
            feed_previous: false,
            start_pos: shape.prompt_len,
            tables,
            return_all_argmax: drafts > 0,
            sampling: Default::default(),
            prompt_len: 0,
            stop_ids: Vec::new(),
            history: None,
            logprobs: None,
            copies: Vec::new(),
            peer_pull: None,
        });
    }
    forward_batched(worker, group, step_tokens, *step, &items, &tier_copies).await?;
    Ok(())
}

/// The most entries one cache call of the session may carry.
fn batch_limit(cache: &CacheClient) -> usize {
    cache.session().batch_limit().unwrap_or(usize::MAX).max(1)
}

/// Releases `ids` (fenced at `fence`; with `discard_unwritten` after a
/// failure) in calls of at most the cache's batch limit; every call is
/// tried, and the first failure is returned.
async fn release_all(
    cache: &CacheClient,
    ids: &[SeqId],
    fence: Option<Step>,
    discard_unwritten: bool,
) -> Result<()> {
    let mut first_failure = Ok(());
    for chunk in ids.chunks(batch_limit(cache)) {
        if let Err(e) = cache.release(chunk, fence, discard_unwritten, &[]).await
            && first_failure.is_ok()
        {
            first_failure = Err(e);
        }
    }
    first_failure
}

/// Splits `items` into forward calls within the worker's limits; the first
/// call carries `tier_copies` (they run before anything of the step).
async fn forward_batched(
    worker: &WorkerClient,
    group: &GroupGeometry,
    step_tokens: u32,
    step: Step,
    items: &[ForwardItem],
    tier_copies: &[TierCopy],
) -> Result<()> {
    let mut copies = tier_copies;
    let mut batch: Vec<ForwardItem> = Vec::new();
    let mut tokens = 0u32;
    for item in items {
        let n = item.tokens.len() as u32;
        if !batch.is_empty()
            && (batch.len() as u32 >= group.max_batch_sequences || tokens + n > step_tokens)
        {
            worker.forward(step, None, &batch, copies, &[]).await?;
            copies = &[];
            batch.clear();
            tokens = 0;
        }
        tokens += n;
        batch.push(item.clone());
    }
    if !batch.is_empty() || !copies.is_empty() {
        worker.forward(step, None, &batch, copies, &[]).await?;
    }
    Ok(())
}
