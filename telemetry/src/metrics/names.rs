//! The metric names and labels kvlease services expose, in one place so that services,
//! dashboards and tests agree. Counters end in `_total`, durations are seconds, sizes name
//! their unit (`_blocks`, `_tokens`). The catalog in `docs/metrics.md` documents each one; a test
//! checks it against what the services register.

// === cache service ===

/// Gauge, labels [`POOL_GROUP`], [`POOL_ID`], [`WINDOW`], [`STATE`]: blocks of a pool in each
/// state ([`STATE_FREE`], [`STATE_CACHED`], [`STATE_IN_USE`], [`STATE_FENCED`]); the states sum
/// to [`POOL_CAPACITY_BLOCKS`].
pub const POOL_BLOCKS: &str = "kvlease_pool_blocks";
/// Gauge, labels [`POOL_GROUP`], [`POOL_ID`], [`WINDOW`]: a pool's size in blocks.
pub const POOL_CAPACITY_BLOCKS: &str = "kvlease_pool_capacity_blocks";
/// Counter, labels [`POOL_GROUP`], [`POOL_ID`]: sequences a pool granted blocks (GetStats'
/// `grants`).
pub const POOL_GRANTS_TOTAL: &str = "kvlease_pool_grants_total";
/// Counter, labels [`POOL_GROUP`], [`POOL_ID`]: sequences a pool refused (GetStats' `rejects`).
pub const POOL_REJECTS_TOTAL: &str = "kvlease_pool_rejects_total";
/// Counter, label [`OP`] (`lease`, `extend`): sequences granted.
pub const GRANTS_TOTAL: &str = "kvlease_grants_total";
/// Counter, labels [`OP`] (`lease`, `extend`), [`REASON`] (`POOL_EXHAUSTED`, ...): sequences
/// refused; the cache counts what it refused, the scheduler what it was refused.
pub const REJECTS_TOTAL: &str = "kvlease_rejects_total";
/// Counter, labels [`POOL_GROUP`], [`POOL_ID`]: cached blocks evicted to make room.
pub const EVICTIONS_TOTAL: &str = "kvlease_evictions_total";
/// Counter, labels [`POOL_GROUP`], [`POOL_ID`]: prompt blocks served from the prefix cache
/// (warm-up excluded).
pub const REUSE_HIT_BLOCKS_TOTAL: &str = "kvlease_reuse_hit_blocks_total";
/// Counter, labels [`POOL_GROUP`], [`POOL_ID`]: full prompt blocks looked up in the prefix
/// cache (warm-up excluded).
pub const REUSE_LOOKUP_BLOCKS_TOTAL: &str = "kvlease_reuse_lookup_blocks_total";
/// Gauge, labels [`POOL_GROUP`], [`POOL_ID`]: hits / lookups so far (0 before any lookup).
pub const REUSE_HIT_RATE: &str = "kvlease_reuse_hit_rate";
/// Gauge, labels [`POOL_GROUP`], [`POOL_ID`], [`SCALE`]: the prefix hit rate a pool would have
/// at `scale` times its size (the cache's online miss-ratio curve).
pub const ESTIMATED_HIT_RATE: &str = "kvlease_cache_estimated_hit_rate";
/// Gauge, labels [`POOL_GROUP`], [`POOL_ID`], [`POLICY`]: 1 for the eviction policy picking a
/// pool's victims now (an adaptive pool's current choice), 0 for the other candidates.
pub const EVICTION_POLICY: &str = "kvlease_cache_eviction_policy";
/// Gauge, labels [`POOL_GROUP`], [`POOL_ID`], [`POLICY`]: an adaptive pool's candidates' recent
/// hit rates in their shadow pools.
pub const POLICY_ESTIMATED_HIT_RATE: &str = "kvlease_cache_policy_estimated_hit_rate";
/// Counter, labels [`POOL_GROUP`], [`POOL_ID`]: times an adaptive pool changed the policy it
/// follows.
pub const POLICY_SWITCHES_TOTAL: &str = "kvlease_cache_policy_switches_total";
/// Counter, labels [`POOL_GROUP`], [`POOL_ID`]: blocks the leak audit reclaimed.
pub const LEAKED_BLOCKS_RECLAIMED_TOTAL: &str = "kvlease_leaked_blocks_reclaimed_total";
/// Counter: prompts `Match` looked up for routing (read-only; one per prompt, whatever the
/// number of groups).
pub const MATCH_PROMPTS_TOTAL: &str = "kvlease_match_prompts_total";
/// Gauge, labels [`POOL_GROUP`], [`POOL_ID`], [`STATE`]: blocks of a pool's host-memory tier
/// in each state ([`STATE_FREE`], [`STATE_PENDING`], [`STATE_CACHED`], [`STATE_PINNED`]); only
/// for pools registered with a host tier.
pub const HOST_TIER_BLOCKS: &str = "kvlease_host_tier_blocks";
/// Gauge, labels [`POOL_GROUP`], [`POOL_ID`], [`STATE`]: blocks of a pool's disk tier in each
/// state (as [`HOST_TIER_BLOCKS`]); only for pools with a disk tier.
pub const DISK_TIER_BLOCKS: &str = "kvlease_disk_tier_blocks";
/// Counter, labels [`POOL_GROUP`], [`POOL_ID`], [`DIRECTION`] ([`DIRECTION_DEMOTED`],
/// [`DIRECTION_ONBOARDED`], [`DIRECTION_DEMOTION_DROPPED`], and with a disk tier
/// [`DIRECTION_SPILLED`], [`DIRECTION_LOADED`], [`DIRECTION_DISK_INVALIDATED`]): blocks copied
/// between a pool's tiers (GetStats' `demotions`, `onboards`, `demotions_dropped`, `spills`,
/// `loads`, `disk_invalidated`).
pub const TIER_COPY_BLOCKS_TOTAL: &str = "kvlease_tier_copy_blocks_total";

// === scheduler ===

/// Histogram: one scheduler step, schedule to `CompleteStep`.
pub const STEP_DURATION_SECONDS: &str = "kvlease_step_duration_seconds";
/// Histogram: one step's forward pass as the scheduler sees it, launch to the last worker's
/// answer (RPCs included). The worker's own compute time is
/// [`FORWARD_COMPUTE_DURATION_SECONDS`].
pub const FORWARD_RPC_DURATION_SECONDS: &str = "kvlease_forward_rpc_duration_seconds";
/// Gauge: requests waiting in the scheduler's queue.
pub const QUEUE_DEPTH: &str = "kvlease_queue_depth";
/// Gauge: sequences running in the current batch.
pub const RUNNING_SEQUENCES: &str = "kvlease_running_sequences";
/// Counter, label [`REASON`] (`length`, `stop`, `rejected`, `cancelled`, `error`): requests
/// finished.
pub const REQUESTS_FINISHED_TOTAL: &str = "kvlease_requests_finished_total";
/// Counter, label [`REASON`] (the refusal that caused it, e.g. `POOL_EXHAUSTED` or
/// `LENGTH_MISMATCH`, or `WORKER_FAILED`): running requests preempted and requeued for
/// recompute.
pub const PREEMPTIONS_TOTAL: &str = "kvlease_preemptions_total";
/// Histogram, label [`REASON`] (finish reason): a request's life, arrival to its last output.
pub const REQUEST_DURATION_SECONDS: &str = "kvlease_request_duration_seconds";
/// Histogram: arrival to a request's first output token.
pub const TIME_TO_FIRST_TOKEN_SECONDS: &str = "kvlease_time_to_first_token_seconds";
/// Histogram: arrival to a request's first granted lease (its wait in the queue).
pub const QUEUE_WAIT_SECONDS: &str = "kvlease_queue_wait_seconds";
/// Counter: prompt tokens of the requests submitted.
pub const PROMPT_TOKENS_TOTAL: &str = "kvlease_prompt_tokens_total";
/// Counter: tokens generated and streamed to clients.
pub const OUTPUT_TOKENS_TOTAL: &str = "kvlease_output_tokens_total";
/// Counter: prompt tokens served from cached blocks instead of being computed.
pub const REUSED_TOKENS_TOTAL: &str = "kvlease_reused_tokens_total";
/// Counter: `Match` calls that failed, so kv-aware routing fell back to load alone
/// (least committed) for that step.
pub const ROUTING_MATCH_FAILURES_TOTAL: &str = "kvlease_routing_match_failures_total";

// === worker ===

/// Histogram: the compute time of one `Forward` on the worker (lock wait excluded).
pub const FORWARD_COMPUTE_DURATION_SECONDS: &str = "kvlease_forward_compute_duration_seconds";
/// Counter: input tokens run by accepted `Forward` calls.
pub const WORKER_FORWARD_TOKENS_TOTAL: &str = "kvlease_worker_forward_tokens_total";
/// Counter: `Forward` calls refused (invalid batch or backend failure).
pub const WORKER_FORWARD_REJECTED_TOTAL: &str = "kvlease_worker_forward_rejected_total";
/// Gauge, label [`WINDOW`]: the blocks of each KV pool the worker allocated.
pub const WORKER_POOL_CAPACITY_BLOCKS: &str = "kvlease_worker_pool_capacity_blocks";
/// Counter: bytes of K/V the worker pulled from peer workers (peer pulls
/// and disaggregated hand-offs).
pub const WORKER_PEER_PULLED_BYTES_TOTAL: &str = "kvlease_worker_peer_pulled_bytes_total";
/// Counter: sequences whose peer pull failed (each sat its pass out).
pub const WORKER_PEER_PULL_FAILURES_TOTAL: &str = "kvlease_worker_peer_pull_failures_total";
/// Counter: bytes of K/V the worker served to peer workers' pulls.
pub const WORKER_PEER_SERVED_BYTES_TOTAL: &str = "kvlease_worker_peer_served_bytes_total";

// === labels ===

/// Label: the pool group (a model replica's pools, e.g. `seeded-0/replica-0`).
pub const POOL_GROUP: &str = "pool_group";
/// Label: pool id.
pub const POOL_ID: &str = "pool_id";
/// Label: a pool size as a multiple of the real one.
pub const SCALE: &str = "scale";
/// Label: an eviction policy (`lru`, `lfu`, `chain`).
pub const POLICY: &str = "policy";
/// Label: the pool's window in tokens (`0` = full attention).
pub const WINDOW: &str = "window";
/// Label: block state.
pub const STATE: &str = "state";
/// Label: which call (`lease`, `extend`), lower case on every service.
pub const OP: &str = "op";
/// Label: which way a host-tier copy went.
pub const DIRECTION: &str = "direction";
/// Label: reject, finish or preemption reason.
pub const REASON: &str = "reason";

/// [`OP`] value: a `Lease` call.
pub const OP_LEASE: &str = "lease";
/// [`OP`] value: an `Extend` call.
pub const OP_EXTEND: &str = "extend";

/// [`STATE`] value: free blocks.
pub const STATE_FREE: &str = "free";
/// [`STATE`] value: released full blocks kept for reuse, evictable.
pub const STATE_CACHED: &str = "cached";
/// [`STATE`] value: blocks held by leases.
pub const STATE_IN_USE: &str = "in_use";
/// [`STATE`] value: released blocks waiting for their fence step.
pub const STATE_FENCED: &str = "fenced";
/// [`STATE`] value: host blocks receiving a demotion whose step has not completed.
pub const STATE_PENDING: &str = "pending";
/// [`STATE`] value: host blocks read by onboardings whose step has not completed.
pub const STATE_PINNED: &str = "pinned";
/// [`DIRECTION`] value: device -> host (an evicted block kept).
pub const DIRECTION_DEMOTED: &str = "demoted";
/// [`DIRECTION`] value: host -> device (a prefix hit on the host tier).
pub const DIRECTION_ONBOARDED: &str = "onboarded";
/// [`DIRECTION`] value: a demotion dropped before it published.
pub const DIRECTION_DEMOTION_DROPPED: &str = "demotion_dropped";
/// [`DIRECTION`] value: host -> disk (an evicted host block kept on disk).
pub const DIRECTION_SPILLED: &str = "spilled";
/// [`DIRECTION`] value: disk -> device (a prefix hit on the disk tier).
pub const DIRECTION_LOADED: &str = "loaded";
/// [`DIRECTION`] value: a disk block dropped from the index after a failed pass loaded it.
pub const DIRECTION_DISK_INVALIDATED: &str = "disk_invalidated";
